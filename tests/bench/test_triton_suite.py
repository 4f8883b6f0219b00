"""The triton suite: grids as data, and its tiny cells run on a CPU through the one runner
(the kernels under TRITON_INTERPRET=1, set by tests/conftest.py), then decided."""

from __future__ import annotations

import pytest

from bench import runner, suites
from bench.cases import Cell
from bench.suites import triton
from bench.timing import Timer
from ci import decide
from nsa.backends import triton_nsa
from nsa_contract import results
from nsa_contract import suites as lists

TINY = Timer(warmup=1, rep=2, l2_flush=False)
NIGHTLY_T = {256, 512, 1024, 2048, 4096, 8192, 16384}
LAYOUTS = ({"B": 1, "Hq": 8, "Hkv": 2, "Dk": 64}, {"B": 1, "Hq": 16, "Hkv": 16, "Dk": 128},
           {"B": 4, "Hq": 8, "Hkv": 2, "Dk": 64})
PAPER = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16}


def _run(cells: list[Cell]) -> dict:
    opts = runner.RunOptions(device="cpu", timer=TINY)
    cases = runner.run_cells(list(enumerate(cells)), opts)
    doc = runner.document(cases, opts, command="test", git_sha="unknown",
                          machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"})
    return results.check(doc)


def test_nightly_grid_sweeps_every_shape_class_on_every_branch_at_the_paper_blocks():
    from nsa_contract import keys

    cells = suites.cells(["triton"], "nightly")
    assert {c.op for c in cells} == {"selected", "compressed", "sliding"}
    for op, knobs in (("selected", PAPER), ("compressed", {"block": 32, "stride": 16}), ("sliding", {"window": 512})):
        at = [c for c in cells if c.op == op]
        # Every class decides from its own cells, up to the decision grid's longest length.
        assert {keys.class_of_params(c.params) for c in at} == set(keys.CLASSES), op
        for cls in keys.CLASSES:
            lengths = {c.params["T"] for c in at if keys.class_of_params(c.params) == cls}
            assert max(keys.NIGHTLY_T) in lengths and lengths <= NIGHTLY_T, (op, cls)
        assert all(knobs.items() <= c.params.items() and c.params["dtype"] == "bf16" for c in at)
    assert all([(v.backend, v.role) for v in c.variants] == [("sdpa", "baseline"), ("triton", "candidate")]
               for c in cells)
    full = suites.cells(["triton"], "full")
    assert max(c.params["T"] for c in full) == 65536 and len(full) > len(cells)
    assert "triton" in lists.DEFAULT


def test_smoke_grid_is_tiny():
    cells = suites.cells(["triton"], "smoke")
    assert cells and all(c.params["T"] <= 72 and c.params["Hkv"] == 1 and c.params["Dk"] <= 32 for c in cells)


@pytest.mark.skipif(triton_nsa.unavailable_reason("cpu") is not None,
                    reason="triton backend unavailable on CPU (needs triton and TRITON_INTERPRET=1)")
def test_smoke_cells_pass_parity_then_time_and_never_propose_from_a_cpu():
    cells = [c for c in suites.cells(["triton"], "smoke") if c.params["T"] == min(triton.SMOKE_T)]
    doc = _run(cells)
    by = {(c["op"], c["backend"]): c for c in doc["cases"]}
    assert set(by) == {(op, b) for op in ("selected", "compressed", "sliding") for b in ("sdpa", "triton")}
    for case in doc["cases"]:
        assert case["status"] == "ok", case["reason"]
        # The whole selection branch has no output parity (near ties); the kernels' cells do.
        assert case["op"] == "selected" or case["parity"]["passed"], case["id"]
        assert len(case["timing"]["samples_ms"]) == 2
    assert by[("selected", "triton")]["blocks_agree"] == 1.0
    assert by[("selected", "triton")]["id"] == "triton/selected/triton/B1-T40-Hq4-Hkv1-D32-l16-d8-ls16-n4-partbranch-fp16"
    d = decide.decide([("cpu.json", doc)], decide.DecideConfig.from_mapping({
        "nsa": {"cmp_block": 16, "cmp_stride": 8, "sel_block": 16, "sel_count": 4, "window": 32},
        "decide": {"margin": 1.2, "confidence": 0.95},
        "runtime": {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1}}))
    assert {c["branch"] for c in d["cells"]} == {"triton_sel", "triton_cmp", "triton_win"}
    assert all(c["used_for_decision"] for c in d["cells"])
    assert d["triton"]["ran"] is False and "CPU machine" in d["triton"]["reason"]
    assert not any(b["changed"] for b in d["branches"].values())


def test_bf16_on_a_cpu_is_skipped_with_the_interpreter_reason():
    cell = next(c for c in suites.cells(["triton"], "smoke") if c.op == "compressed")
    cell = Cell(cell.suite, cell.op, {**cell.params, "dtype": "bf16"}, cell.variants)
    by = {c["backend"]: c for c in _run([cell])["cases"]}
    assert by["sdpa"]["status"] == "ok"
    assert by["triton"]["status"] == "skipped"
    assert by["triton"]["reason"] in (triton.CPU_BF16, triton_nsa.unavailable_reason("cpu"))


def test_without_the_interpreter_a_cpu_run_records_triton_as_skipped(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cell = next(c for c in suites.cells(["triton"], "smoke") if c.op == "compressed")
    doc = _run([cell])
    by = {c["backend"]: c for c in doc["cases"]}
    assert by["sdpa"]["status"] == "ok" and by["sdpa"]["parity"]["passed"]
    assert by["triton"]["status"] == "skipped" and by["triton"]["timing"] is None
    assert "TRITON_INTERPRET=1" in by["triton"]["reason"] or "not installed" in by["triton"]["reason"]
