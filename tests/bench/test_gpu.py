"""The harness on a real GPU: CUDA events, L2 flush, graphs, one fa2 cell, the machine record.
Run with `pytest -m gpu tests/bench` (skipped with a reason without CUDA)."""

from __future__ import annotations

import pytest

from bench import machine, runner, suites
from bench.cases import Cell
from bench.timing import CudaClock, Timer, measure, peak_memory
from nsa_contract import results

pytestmark = pytest.mark.gpu


def test_cuda_events_time_interleaved_candidates():
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    fns = {"mm": lambda: a @ a, "mm2": lambda: (a @ a) @ a}
    samples = measure(fns, Timer(warmup_ms=5, rep_ms=20, min_rep=5), device="cuda")
    assert len(samples["mm"]) == len(samples["mm2"]) >= 5
    assert all(s > 0 for s in samples["mm"])
    assert sorted(samples["mm2"])[len(samples["mm2"]) // 2] > sorted(samples["mm"])[len(samples["mm"]) // 2]
    assert Timer().method(CudaClock())["l2_flush"] is True


def test_cuda_graph_replays():
    import torch

    a = torch.randn(256, 256, device="cuda")
    out = torch.empty_like(a)
    samples = measure({"mm": lambda: torch.mm(a, a, out=out)}, Timer(warmup=2, rep=10, cuda_graph=True),
                      device="cuda")
    assert len(samples["mm"]) == 10 and all(s > 0 for s in samples["mm"])


def test_peak_memory_sees_each_candidates_own_allocation():
    import torch

    clock = CudaClock()
    held = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")   # held throughout: in both peaks
    base = torch.cuda.memory_allocated()   # also whatever earlier tests keep (the L2 flush buffer)
    peaks = peak_memory({"big": lambda: torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                         "small": lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda")}, clock=clock)
    # The big call's peak must not leak into the small one's: the counter is reset in between.
    assert peaks["big"] - base >= 256 << 20 > peaks["small"] - base >= 1 << 20
    del held


def test_fa2_cell_on_the_gpu():
    params = {"B": 1, "T": 1024, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64, "window": 256, "dtype": "bf16"}
    cell = Cell("fa2", "sliding", params, suites.load("fa2").WIN_NO_FLEX)
    opts = runner.RunOptions(device="cuda", timer=Timer(warmup=2, rep=5))
    cases = runner.run_cell(cell, opts)
    assert [c["status"] for c in cases] == ["ok", "ok"], [c["reason"] for c in cases]
    assert cases[1]["backend"] in ("flash_attn", "torch_fa2") and cases[1]["parity"]["passed"]
    assert all(isinstance(c["peak_mem_bytes"], int) and c["peak_mem_bytes"] > 0 for c in cases)
    results.check(runner.document(cases, opts, command="t", git_sha="unknown", machine=machine.machine_info("cuda")))


def test_machine_record_names_the_gpu():
    info = machine.machine_info("cuda")
    assert info["sm"].startswith("sm") and info["gpu_name"] != "cpu" and info["cuda"]


def test_decode_target_cell_replays_cuda_graphs():
    """A small cell of the decode target's kind (Triton module backend, graph=True): every variant
    ran, the NSA steps and their attention alone (decode_attend) as their own captured graphs, with
    reads checked on an eager call."""
    from bench.suites import decode

    layout = {**decode.TARGET, "B": 2, "Hq": 16, "dim": 512}
    cell = decode.cells(layout, [4096], "bf16")[0]
    opts = runner.RunOptions(device="cuda", timer=Timer(warmup=2, rep=5))
    cases = runner.run_cell(cell, opts)
    by = {("attend:" if c["params"].get("part") == "attend" else "")
          + c["params"].get("branches", c["requested_backend"]): c for c in cases}
    for key in ("sdpa_flash", "all", "cmp", "sel", "win", "attend:all", "attend:cmp", "attend:sel", "attend:win"):
        assert by[key]["status"] == "ok", by[key]["reason"]
        assert by[key]["cuda_graph"] is True, by[key].get("cuda_graph_error")
    for key in ("all", "attend:all"):
        assert by[key]["reads"]["total"] == by[key]["reads_expected"]["total"]
    [speed] = decode.dense_speedups(cases).values()
    assert speed["speedup_attend"] > speed["speedup"]  # the attention is a part of the step
    results.check(runner.document(cases, opts, command="t", git_sha="unknown", machine=machine.machine_info("cuda")))
