"""Suites as data (grids, ids) and each suite run at tiny sizes on a CPU through the one runner."""

from __future__ import annotations

import csv

import pytest

from bench import runner, suites
from bench.cases import SIZES, Cell, Variant
from bench.suites import decode
from bench.timing import Timer
from nsa_contract import results

TINY = Timer(warmup=1, rep=2, l2_flush=False)
SMALL = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 32, "Dv": 32, "dtype": "bf16"}


def _run(cells: list[Cell]) -> list[dict]:
    cases = runner.run_cells(list(enumerate(cells)), runner.RunOptions(device="cpu", timer=TINY))
    doc = runner.document(cases, runner.RunOptions(device="cpu", timer=TINY), command="test",
                          git_sha="unknown", machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"})
    results.check(doc)
    return cases


@pytest.mark.parametrize("size", SIZES)
def test_every_suite_has_cells_with_unique_ids(size):
    cells = suites.cells(suites.SUITES, size)
    ids = [c.case_id(v) for c in cells for v in c.variants]
    assert {c.suite for c in cells} == set(suites.SUITES)
    assert len(ids) == len(set(ids))


def test_nightly_fa2_grid_covers_the_threshold_lengths():
    cells = suites.cells(["fa2"], "nightly")
    for op in ("sliding", "compressed"):
        at_model = [c for c in cells if c.op == op and c.params.get("window", 512) == 512
                    and c.params.get("block", 32) == 32 and c.params.get("stride", 16) == 16]
        for layout in ({"B": 1, "Hq": 8, "Hkv": 2, "Dk": 64}, {"B": 1, "Hq": 16, "Hkv": 16, "Dk": 128},
                       {"B": 4, "Hq": 8, "Hkv": 2, "Dk": 64}):
            lengths = {c.params["T"] for c in at_model if layout.items() <= c.params.items()}
            assert {256, 512, 1024, 2048, 4096, 8192, 16384} <= lengths, (op, layout)
    windows = {c.params["window"] for c in cells if c.op == "sliding"}
    assert {128, 512, 1024} <= windows
    assert all(c.params["dtype"] == "bf16" for c in cells)
    assert [v.backend for v in cells[0].variants] == ["sdpa", "fa2", "flex"]


def test_backend_filter_keeps_only_requested_variants():
    cells = suites.cells(["fa2"], "smoke", backends=["sdpa"])
    assert cells and all([v.backend for v in c.variants] == ["sdpa"] for c in cells)


def test_fa2_suite_parity_checks_then_times_and_skips_what_cannot_run():
    cells = [Cell("fa2", "sliding", {**SMALL, "T": 77, "window": 16}, suites.load("fa2").WIN),
             Cell("fa2", "compressed", {**SMALL, "T": 77, "block": 16, "stride": 8}, suites.load("fa2").CMP)]
    cases = _run(cells)
    by = {(c["op"], c["requested_backend"]): c for c in cases}
    for op in ("sliding", "compressed"):
        sdpa = by[(op, "sdpa")]
        assert sdpa["status"] == "ok" and sdpa["parity"]["passed"] and len(sdpa["timing"]["samples_ms"]) == 2
        fa2 = by[(op, "fa2")]
        assert fa2["status"] == "skipped" and "CUDA" in fa2["reason"] and fa2["backend"] in ("torch_fa2", "flash_attn")
        assert fa2["id"].split("/")[2] == fa2["backend"]
        assert by[(op, "flex")]["status"] in ("ok", "skipped")


def test_masked_suite_compares_naive_and_sdpa_on_every_branch():
    knobs = {"window": 16, "block": 16, "stride": 8, "sel_block": 16, "sel_count": 3}
    keys = {"sliding": ("window",), "compressed": ("block", "stride"),
            "selected": ("block", "stride", "sel_block", "sel_count")}
    variants = suites.load("masked").VARIANTS
    cells = [Cell("masked", op, {**SMALL, "T": 75, **{k: knobs[k] for k in ks}}, variants) for op, ks in keys.items()]
    cases = _run(cells)
    assert len(cases) == 6
    assert all(c["status"] == "ok" and c["parity"]["passed"] for c in cases), [c["reason"] for c in cases]
    assert {c["backend"] for c in cases} == {"sdpa", "naive"}


def test_calibration_is_one_backend_against_itself():
    spec = suites.load("calibration").SPECS[0]
    cases = _run([Cell("calibration", "sliding", {**SMALL, "T": 64, "window": 16}, spec.variants)])
    a, b = cases
    assert a["status"] == b["status"] == "ok" and a["backend"] == b["backend"] == "sdpa"
    assert {k: v for k, v in a["params"].items() if k != "replica"} == \
        {k: v for k, v in b["params"].items() if k != "replica"}
    assert (a["params"]["replica"], b["params"]["replica"]) == ("A", "B") and a["id"] != b["id"]


def test_prefill_times_nsa_against_dense_backends():
    p = {**SMALL, "T": 150, "block": 16, "stride": 8, "sel_block": 32, "sel_count": 3, "window": 32,
         "kv": "separate"}
    cases = _run([Cell("prefill", "nsa_prefill", p, suites.load("prefill").VARIANTS)])
    by = {c["requested_backend"]: c for c in cases}
    assert by["sdpa_flash"]["op"] == "dense" and by["sdpa_flash"]["status"] == "ok"
    assert by["sdpa_cudnn"]["status"] == "skipped" and by["sdpa_cudnn"]["reason"]
    nsa = by["auto"]
    assert nsa["op"] == "nsa_prefill" and nsa["status"] == "ok" and nsa["backend"] == "sdpa"
    assert nsa["branch_backends"] == {"cmp": "sdpa", "sel": "sdpa", "win": "sdpa"}


def test_decode_reads_match_the_spec_and_feed_the_legacy_csv(tmp_path):
    layout = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 32, "Dv": 32, "dim": 64, "block": 16, "stride": 8,
              "sel_block": 16, "sel_count": 3, "window": 24}
    cases = _run(decode.cells(layout, [10, 100], "fp32"))
    assert all(c["status"] == "ok" for c in cases if c["op"] == "nsa_decode"), [c["reason"] for c in cases]
    full = [c for c in cases if c["params"].get("branches") == "all" and "part" not in c["params"]]
    # S = 100: t = 99 -> cmp (100-16)//8+1 = 11, sel 2 full blocks + 99 % 16 + 1 = 36, win 24
    assert full[1]["reads_expected"] == {"cmp": 11, "sel": 36, "win": 24, "total": 71}
    assert full[1]["reads"]["total"] == 71
    assert full[0]["reads_expected"] == {"cmp": 0, "sel": 10, "win": 10, "total": 20}
    path = tmp_path / "d.csv"
    assert decode.write_csv(cases, path) == 2
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0])[:7] == list(decode.CSV_COLUMNS)
    assert rows[1]["S"] == "100" and rows[1]["reads_actual"] == "71" and rows[1]["reads_expected"] == "71"
    assert all(rows[1][k] for k in ("ms_total", "ms_cmp", "ms_sel", "ms_win"))
    # Dense decode of the same cell (flash runs on a CPU, cuDNN does not): its ms and the ratio.
    assert float(rows[1]["speedup_vs_dense"]) == pytest.approx(
        float(rows[1]["ms_dense_flash"]) / float(rows[1]["ms_total"]), rel=1e-4)
    assert rows[1]["ms_dense_cudnn"] == "" and rows[1]["nsa_backend"] == "auto"
    # The attention part alone (decode_attend) of the same cell, and fastest dense / attend.
    assert list(rows[0])[-5:] == ["ms_attend", "ms_attend_cmp", "ms_attend_sel", "ms_attend_win",
                                  "speedup_attend_vs_dense"]
    assert all(rows[1][k] for k in ("ms_attend", "ms_attend_cmp", "ms_attend_sel", "ms_attend_win"))
    attend = next(c for c in cases if c["params"].get("part") == "attend" and c["params"]["branches"] == "all"
                  and c["params"]["T"] == 100)
    assert float(rows[1]["ms_attend"]) == pytest.approx(attend["timing"]["median_ms"], rel=1e-4)
    assert float(rows[1]["speedup_attend_vs_dense"]) == pytest.approx(
        float(rows[1]["ms_dense_flash"]) / float(rows[1]["ms_attend"]), rel=1e-4)


def test_expected_reads_reach_the_paper_budget_at_long_lengths():
    p = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
    e = decode.expected_reads(65536, p)
    assert e == {"cmp": (65536 - 32) // 16 + 1, "sel": 16 * 64, "win": 512}


def test_a_declared_key_adds_its_candidate_to_its_suite(monkeypatch):
    """A suite's candidates come from the decision keys (bench.cases.key_variants): a key declared
    for a new backend in the fa2 suite's sliding branch joins those cells, and no other op's."""
    from bench.cases import key_variants
    from nsa_contract import keys

    extra = keys.DecisionKey("foo_min_len_win", "win", "fa2", "foo", ("foo",), "fa2", "foo_win", keys.NIGHTLY_T)
    monkeypatch.setattr(keys, "KEYS", (*keys.KEYS, extra))
    assert [v.key for v in key_variants("fa2", "sliding", extra=(Variant("flex"),))] == ["sdpa", "fa2", "foo", "flex"]
    assert [v.key for v in key_variants("fa2", "compressed")] == ["sdpa", "fa2"]
    assert [v.role for v in key_variants("triton", "selected")] == ["baseline", "candidate"]
