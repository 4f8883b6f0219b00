"""The auto suite: `auto` beside every explicit plan on the same call; ids stable, plans recorded."""

from __future__ import annotations

from bench import runner, suites
from bench.suites import auto
from bench.timing import Timer
from nsa_contract import results

TINY = Timer(warmup=1, rep=3, l2_flush=False)


def _run(cells) -> dict:
    opts = runner.RunOptions(device="cpu", timer=TINY)
    cases = runner.run_cells(list(enumerate(cells)), opts)
    doc = runner.document(cases, opts, command="test", git_sha="unknown",
                          machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"})
    return results.check(doc)


def test_grids_cover_the_classes_and_lengths_auto_is_judged_on():
    from nsa_contract import keys

    full = suites.cells(["auto"], "full")
    prefill = [c for c in full if c.op == "nsa_prefill"]
    assert {c.params["T"] for c in prefill} == {1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072}
    assert {keys.class_of_params(c.params) for c in prefill} == set(keys.CLASSES)
    decode = [c for c in full if c.op == "nsa_decode"]
    assert {c.params["T"] for c in decode} == {8192, 16384, 32768, 65536}
    assert {keys.class_of_params(c.params) for c in decode} == {"g1", "g4", "g16"}
    assert all(c.params["B"] == 8 for c in decode)
    for c in full:
        assert [v.backend for v in c.variants][0] == "auto"
        assert all(dict(v.extra)["plan"] == v.backend for v in c.variants)


def test_auto_and_sdpa_plans_run_the_same_call_on_cpu():
    cells = suites.cells(["auto"], "smoke", backends=["auto", "sdpa"])
    doc = _run(cells)
    by = {(c["op"], c["params"]["plan"]): c for c in doc["cases"]}
    assert set(by) == {(op, p) for op in ("nsa_prefill", "nsa_decode") for p in ("auto", "sdpa")}
    for (_op, plan), case in by.items():
        assert case["status"] == "ok", case["reason"]
        assert case["branch_backends"] == {"cmp": "sdpa", "sel": "sdpa", "win": "sdpa"}
        assert case["backend"] == (auto.AUTO_BACKEND if plan == "auto" else plan)
    assert by[("nsa_prefill", "auto")]["auto_plan"] == "cmp=sdpa sel=sdpa win=sdpa scores=torch"
    # Same function, same inputs: the plans agree to rounding (fp32 smoke cells).
    assert by[("nsa_prefill", "sdpa")]["max_abs_diff_vs_auto"] < 1e-5
    assert by[("nsa_prefill", "auto")]["id"].startswith("auto/nsa_prefill/autoplan/")


def test_torch_scored_plans_are_skipped_with_the_reason_at_long_prefill():
    cell = next(c for c in suites.cells(["auto"], "full") if c.op == "nsa_prefill" and c.params["T"] == 131072)
    names = [v.backend for v in cell.variants]
    assert "sdpa" in names and "flex" in names
    assert auto.TORCH_SCORED_MAX_T < 131072 and auto.FLEX_MAX_T < 131072
