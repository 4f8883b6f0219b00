"""Trend plots: the headline selection and the data series (files are checked to exist, not pixels)."""

from __future__ import annotations

from pathlib import Path

from ci import trends
from tests.ci import history_fixtures as hx

PREFILL_NSA_64K = "fast/nsa_prefill/triton/B1-T65536-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-kvseparate-bf16"
PREFILL_DENSE_64K = "fast/dense/sdpa_flash/B1-T65536-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-kvseparate-bf16"


def test_headlines_pick_the_paper_layout_and_decode_at_64k() -> None:
    heads = {h.name: h for h in trends.headlines(hx.real(hx.H100_FAST)["cases"])}
    assert set(heads) == {"prefill_T16384", "prefill_T65536"}
    ids = heads["prefill_T65536"].case_ids
    assert PREFILL_NSA_64K in ids and PREFILL_DENSE_64K in ids
    assert all("T65536-Hq64-Hkv4-D128-" in i and "part" not in i for i in ids)
    assert len(ids) == 4  # dense under two SDPA backends, NSA and its flex-window variant
    assert not any("D192" in i for i in heads["prefill_T16384"].case_ids)

    decode = trends.headlines(hx.real(hx.H100_DECODE)["cases"])
    (dec,) = decode
    assert dec.name == "decode_T65536"
    assert all("T65536" in i for i in dec.case_ids)
    assert {i.split("/")[1] for i in dec.case_ids} == {"nsa_decode", "dense"}
    assert not any("branchescmp" in i or "branchessel" in i for i in dec.case_ids)

    keyed = trends.headlines([], {"fa2_min_len_win": ["b", "a"]})
    assert [(h.name, h.case_ids) for h in keyed] == [("key_fa2_min_len_win", ["a", "b"])]


def test_series_follow_the_runs_oldest_first() -> None:
    recs = hx.records(hx.H100_FAST, 4, {2: {PREFILL_NSA_64K: 1.5}})
    shuffled = [recs[2], recs[0], recs[3], recs[1]]
    got = trends.series(shuffled, [PREFILL_NSA_64K, "missing/case"])
    pts = got[PREFILL_NSA_64K]
    assert [p.run_id for p in pts] == [r.id for r in recs]
    base = recs[0].case(PREFILL_NSA_64K)
    assert [round(p.median_ms / base.median_ms, 3) for p in pts] == [1.0, 1.0, 1.5, 1.0]
    assert all(p.p20_ms <= p.median_ms <= p.p80_ms for p in pts)
    assert got["missing/case"] == []


def test_write_trends_writes_one_png_per_headline_with_data(tmp_path: Path) -> None:
    recs = hx.records(hx.H100_FAST, 3)
    heads = trends.headlines(recs[-1].cases) + [trends.Headline("empty", "no data", ["missing/case"])]
    written = trends.write_trends(recs, heads, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["trend_prefill_T16384.png", "trend_prefill_T65536.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in written)  # no temp


def test_headlines_pick_the_training_steps_of_the_paper_layout() -> None:
    """The committed H200 train run (tests/data/h200/train/train-nightly.json.xz): its whole-attention
    cells at 16k and 64k, NSA and dense, never the per-branch ones."""
    from nsa_contract import results

    run = results.load(Path(__file__).resolve().parents[2] / "tests/data/h200/train/train-nightly.json.xz")
    heads = {h.name: h for h in trends.headlines(run["cases"])}
    for t in (16384, 65536):
        ids = heads[f"train_T{t}"].case_ids
        assert any(i.startswith("train/nsa_train/triton/") for i in ids)
        assert any(i.startswith("train/dense/sdpa_cudnn/") for i in ids)
        assert all("partall" in i and f"T{t}-" in i for i in ids)
    assert "prefill_T16384" not in heads     # training cells are not prefill cells


def test_the_ragged_paged_decode_cell_has_its_own_trend():
    """The serve suite's nightly cell (a ragged batch over the paged cache) is one headline with
    every variant of that cell, and no other case joins it."""
    import json
    from pathlib import Path

    cases = json.loads((Path(__file__).resolve().parents[2] / "results/h100/serve/serve_full.json").read_text())["cases"]
    heads = {h.name: h for h in trends.headlines(cases)}
    ragged = heads["serve_ragged"].case_ids
    expected = sorted(c["id"] for c in cases if c["op"] == "nsa_serve" and c["params"].get("ragged"))
    assert len(expected) >= 5 and sorted(ragged) == expected
