"""The decide job on the committed H100 nightlies (tests/data/h100/nightly; results/h100/nightly/ holds their
decisions and reports, results/README.md).

Run 3's results (ee410f6, with `timing.host_ms`) against the history store of runs 1 and 2, as the
workflow's decide job sees it: the decision proposes nothing (the three "lasting" changes its job
proposed at ee410f6 rested on cells where both sides were host-bound; the one change this run
measures on its own is held back by the K-run rule) and no case is a regression (run 2's host was slower,
run 3's was not; host-bound slowdowns are flagged `host`). This is the replay committed in
run3/replay-6fa0465; the test keeps the rule from drifting away from the real data.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

from ci.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
NIGHTLY = ROOT / "tests/data/h100/nightly"
EARLIER = ("20261122T192959Z-11cdeb3-c02c78.json", "20261122T193633Z-11cdeb3-b56fd0.json")


def test_run3_replayed_on_runs_1_and_2_proposes_nothing_and_flags_no_regression(tmp_path, monkeypatch):
    store = tmp_path / "store"
    model = store / "history" / "nvidia-h100-80gb-hbm3"
    model.mkdir(parents=True)
    for name in EARLIER:
        # Stored xz-compressed; the history store reads plain JSON records.
        packed = NIGHTLY / "history-store/history/nvidia-h100-80gb-hbm3" / f"{name}.xz"
        (model / name).write_bytes(lzma.decompress(packed.read_bytes()))
    monkeypatch.setenv("NSA_HISTORY_DIR", str(store))
    for var in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT"):
        monkeypatch.delenv(var, raising=False)
    results, decision = NIGHTLY / "run3/results.json.xz", tmp_path / "decision.json"
    assert main(["decide", "--results", str(results), "--out", str(decision)]) == 0
    raw = json.loads(decision.read_text())
    # This run alone measures one change (Triton compressed at G = 4 adopting from 4096, extended down
    # over host-bound lengths); runs 1 and 2 did not measure it, so the history rule holds it back.
    assert [(b["key"], c) for b in raw["branches"].values() for c, e in b["classes"].items()
            if e["changed"]] == [("triton_min_len_cmp", "g4")]
    host_bound = [c for c in raw["cells"] if c["note"].startswith("launch-bound: on both sides the host")]
    assert host_bound, "run 3 has cells where both sides are host-bound"
    assert main(["history", "--results", str(results), "--decision", str(decision),
                 "--out-dir", str(tmp_path / "history")]) == 0
    doc = json.loads(decision.read_text())
    assert not [b for b in doc["branches"].values() if b["changed"]]
    reg = doc["regressions"]
    assert reg["flagged"] == []
    flags = {r["flag"] for r in reg["rows"]}
    assert "host" in flags and "regression" not in flags
    assert len(list(model.iterdir())) == 3  # run 3 recorded beside runs 1 and 2
