"""The decision rule on the committed real GPU sweep (H200, results/h200/nightly-fa2.json)."""

from __future__ import annotations

import json
from pathlib import Path

from ci.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def test_real_h200_sweep_proposes_sliding_2048_and_keeps_compressed_off(tmp_path):
    out = tmp_path / "decision.json"
    rc = main(["decide", "--results", str(ROOT / "results/h200/nightly-fa2.json"),
               "--config", str(ROOT / "configs/base.yaml"), "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["profile"] == "sm90"
    win, cmp = d["branches"]["win"], d["branches"]["cmp"]
    # 1024 is rejected in two layouts; every length from 2048 up adopts in every layout.
    assert (win["proposed"], win["changed"]) == (2048, True)
    assert (cmp["proposed"], cmp["changed"]) == (-1, False)
    # A sweep without the triton suite leaves the triton keys alone and says why.
    for name in ("triton_sel", "triton_cmp"):
        b = d["branches"][name]
        assert (b["proposed"], b["changed"], b["measured"]) == (-1, False, None)
        assert "no triton case in suite triton" in b["reason"]
    assert d["triton"]["ran"] is False
    assert not d["failures"]
    assert d["noise_floor"]["worst_half_width"] < 0.03
