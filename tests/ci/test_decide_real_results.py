"""The decision rule on the committed real GPU sweep (H200, tests/data/h200/nightly-fa2.json.xz)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ci import decide
from ci.__main__ import main
from tests.ci import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "tests/data/h200/nightly-fa2.json.xz"


def _decide(config: Path, out: Path) -> dict[str, Any]:
    assert main(["decide", "--results", str(SWEEP), "--config", str(config), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_real_h200_sweep_proposes_sliding_2048_and_keeps_compressed_off(tmp_path, pristine_config):
    # Against the config before any adoption (every threshold -1), whatever the live file holds now.
    d = _decide(pristine_config, tmp_path / "decision.json")
    assert d["profile"] == "sm90"
    win, cmp = d["branches"]["win"]["classes"]["g4"], d["branches"]["cmp"]["classes"]["g4"]
    # The cells that rejected at 1024 are launch-bound (both sides under decide.time_floor_ms), so
    # they decide nothing; every deciding length adopts, and the threshold extends down over the
    # launch-bound lengths below (the rule of docs/pipeline.md). The 0.05 ms floor gave 2048.
    assert (win["proposed"], win["changed"]) == (256, True)
    assert "launch-bound" in win["reason"]
    assert (cmp["proposed"], cmp["changed"]) == (-1, False)
    # A sweep without the triton suite leaves the triton keys alone and says why.
    for name in ("triton_sel", "triton_cmp", "triton_win"):
        b = d["branches"][name]
        assert (b["proposed"], b["changed"]) == (-1, False)
        assert "suite triton did not run in these results" in b["reason"]
        assert all(e["measured"] is None for e in b["classes"].values())
    assert d["triton"]["ran"] is False
    assert not d["failures"]
    assert d["noise_floor"]["worst_half_width"] < 0.03


def test_real_h200_sweep_against_the_live_config_is_consistent(tmp_path, pristine_config):
    """With whatever the live configs/base.yaml holds (e.g. after this sweep's PR was merged), decide
    measures the same thresholds and proposes a change only where the live value differs from them."""
    pristine = _decide(pristine_config, tmp_path / "pristine.json")
    live = _decide(fx.REPO_CONFIG, tmp_path / "live.json")
    conf = decide.load_config(fx.REPO_CONFIG)
    assert live["profile"] == pristine["profile"] == "sm90" and not live["failures"]
    for name, b in live["branches"].items():
        for cls, e in b["classes"].items():
            current = conf.current("sm90", b["key"], cls)[0]
            assert e["current"] == current and e["measured"] == pristine["branches"][name]["classes"][cls]["measured"]
            assert e["proposed"] == (current if e["measured"] is None else e["measured"])
            assert e["changed"] == (e["proposed"] != current)
        assert b["changed"] == any(e["changed"] for e in b["classes"].values())
    win = live["branches"]["win"]["classes"]["g4"]
    if win["current"] == 256:  # the live file already holds this sweep's proposal: nothing to propose
        assert (win["proposed"], win["changed"]) == (256, False)
    else:
        assert (win["proposed"], win["changed"]) == (256, True)
