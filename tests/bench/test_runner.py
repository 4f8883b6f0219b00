"""Runner statuses: parity failure, out of memory, exceptions; every outcome stays schema-valid."""

from __future__ import annotations

import types

import pytest
import torch

from bench import runner
from bench.cases import Cell, Variant, Workload
from bench.timing import Timer
from nsa_contract import results
from tests.bench.fakes import FakeClock

PARAMS = {"B": 1, "T": 8, "Hq": 1, "Hkv": 1, "Dk": 4, "Dv": 4, "window": 4, "dtype": "fp32"}


@pytest.fixture
def fake_suite(monkeypatch):
    """Install a suite whose build returns the workload the test sets."""
    holder: dict[str, Workload] = {}
    module = types.SimpleNamespace(build=lambda cell, device: holder["work"])
    import bench.suites

    monkeypatch.setattr(bench.suites, "load", lambda name: module)
    return holder


def _cell(*backends: str) -> Cell:
    variants = tuple(Variant(b, "baseline" if i == 0 else "candidate") for i, b in enumerate(backends))
    return Cell("fa2", "sliding", PARAMS, variants)


def _opts(clock=None) -> runner.RunOptions:
    return runner.RunOptions(device="cpu", timer=Timer(warmup=1, rep=3, l2_flush=False), clock=clock)


def _valid(cases):
    doc = runner.document(cases, _opts(), command="t", git_sha="unknown",
                          machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"})
    return results.check(doc)


def test_parity_failure_is_failed_and_not_timed(fake_suite):
    ref = torch.ones(4)
    clock = FakeClock()
    good, bad = clock.candidate("good", 1.0), clock.candidate("bad", 1.0)
    fake_suite["work"] = Workload(
        fns={"sdpa": lambda: (good(), ref)[1], "wrong": lambda: (bad(), ref + 1)[1]},
        backends={"sdpa": "sdpa", "wrong": "wrong"}, reference=lambda: ref, tol_basis=lambda: ref, dtype="fp32")
    cases = runner.run_cell(_cell("sdpa", "wrong"), _opts(clock))
    ok, failed = cases
    assert ok["status"] == "ok" and ok["parity"]["passed"] and ok["timing"]["samples_ms"] == [1.0] * 3
    assert failed["status"] == "failed" and failed["timing"] is None and "parity failed" in failed["reason"]
    assert failed["parity"] == {"max_abs_err": 1.0, "rel_err": 1.0, "tol": pytest.approx(1e-5),
                                "passed": False, "basis_err": 0.0}
    assert clock.calls().count("bad") == 1  # the parity run only
    _valid(cases)


def test_out_of_memory_skips_and_other_errors_fail(fake_suite):
    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 GiB")

    def broken():
        raise RuntimeError("illegal memory access")

    fake_suite["work"] = Workload(fns={"a": oom, "b": broken}, backends={"a": "a", "b": "b"},
                                  reference=lambda: torch.ones(1), tol_basis=lambda: torch.ones(1))
    a, b = runner.run_cell(_cell("a", "b"), _opts())
    assert a["status"] == "skipped" and "out of memory" in a["reason"]
    assert b["status"] == "failed" and "illegal memory access" in b["reason"]
    _valid([a, b])


def test_build_errors_settle_every_variant_and_the_sweep_goes_on(monkeypatch):
    def build(cell, device):
        if cell.params["T"] == 8:
            raise MemoryError()
        return Workload(fns={"sdpa": lambda: None}, backends={"sdpa": "sdpa"})

    import bench.suites

    monkeypatch.setattr(bench.suites, "load", lambda name: types.SimpleNamespace(build=build))
    cells = [(0, _cell("sdpa")), (1, Cell("fa2", "sliding", {**PARAMS, "T": 16}, _cell("sdpa").variants))]
    lines = []
    opts = _opts()
    opts.progress = types.SimpleNamespace(write=lines.append, flush=lambda: None)
    cases = runner.run_cells(cells, opts)
    assert [c["status"] for c in cases] == ["skipped", "ok"]
    assert "out of memory" in cases[0]["reason"]
    text = "".join(lines)
    assert "[1/2" in text and "[2/2" in text and "eta" in text and "SKIPPED" in text
    _valid(cases)


def test_unavailable_variants_are_skipped_with_the_reason(fake_suite):
    fake_suite["work"] = Workload(fns={"sdpa": lambda: None}, backends={"sdpa": "sdpa", "fa2": "torch_fa2"},
                                  reasons={"fa2": "torch_fa2 needs CUDA"})
    sdpa, fa2 = runner.run_cell(_cell("sdpa", "fa2"), _opts())
    assert sdpa["status"] == "ok"
    assert fa2["status"] == "skipped" and fa2["reason"] == "torch_fa2 needs CUDA"
    assert fa2["backend"] == "torch_fa2" and fa2["id"].startswith("fa2/sliding/torch_fa2/")
    assert fa2["requested_backend"] == "fa2"


def test_document_records_the_method():
    doc = _valid([])
    assert doc["run"]["method"]["timer"] == "perf_counter" and doc["run"]["method"]["interleaved"] is True
    assert doc["run"]["created_at"].endswith("Z") and doc["run"]["dispatch"]["profile"] == "cpu"


class _GraphClock(FakeClock):
    """A fake clock whose own CUDA graph capture (`wrap`) is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped: list = []

    def wrap(self, fn):
        self.wrapped.append(fn)
        return fn


def _stateful(clock: FakeClock, log: list[str]) -> Workload:
    """`dense` is pure; `step` needs its state restored (setup) or a capture of its own."""

    def setup():
        log.append("setup")

    def capture():
        log.append("capture")
        return clock.candidate("replay", 2.0)

    return Workload(fns={"dense": clock.candidate("dense", 1.0), "step": clock.candidate("eager", 3.0)},
                    backends={"dense": "dense", "step": "step"}, setups={"step": setup},
                    captures={"step": capture})


@pytest.mark.parametrize("how", ["timer", "workload"])
def test_under_graphs_a_captured_variant_is_timed_as_its_replay(fake_suite, how):
    clock, log = _GraphClock(), []
    work = _stateful(clock, log)
    work.cuda_graph = how == "workload"
    fake_suite["work"] = work
    opts = runner.RunOptions(device="cpu", timer=Timer(warmup=1, rep=3, l2_flush=False, cuda_graph=how == "timer"),
                             clock=clock)
    dense, step = runner.run_cell(_cell("dense", "step"), opts)
    assert log == ["capture"]  # captured once, never restored
    assert step["status"] == "ok" and step["timing"]["samples_ms"] == [2.0] * 3 and "eager" not in clock.calls()
    assert dense["timing"]["samples_ms"] == [1.0] * 3
    assert clock.wrapped == [work.fns["dense"]]  # the clock captures the pure one only
    assert dense["cuda_graph"] is step["cuda_graph"] is True and "cuda_graph_error" not in step
    _valid([dense, step])


def test_without_graphs_captures_are_never_called(fake_suite):
    clock, log = _GraphClock(), []
    fake_suite["work"] = _stateful(clock, log)
    dense, step = runner.run_cell(_cell("dense", "step"), _opts(clock))
    assert "capture" not in log and log.count("setup") == 1 + 3  # warmup + repeats, each restored
    assert step["timing"]["samples_ms"] == [3.0] * 3 and "cuda_graph" not in step


def test_a_failed_capture_or_a_setup_without_one_times_the_whole_cell_eagerly(fake_suite):
    clock, log = _GraphClock(), []
    work = _stateful(clock, log)

    def broken():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    work.captures["step"] = broken
    fake_suite["work"] = work
    opts = runner.RunOptions(device="cpu", timer=Timer(warmup=1, rep=3, l2_flush=False, cuda_graph=True), clock=clock)
    dense, step = runner.run_cell(_cell("dense", "step"), opts)
    assert step["status"] == dense["status"] == "ok" and step["timing"]["samples_ms"] == [3.0] * 3
    assert log.count("setup") == 4
    assert dense["cuda_graph"] is step["cuda_graph"] is False
    assert "operation not permitted" in step["cuda_graph_error"] and "eagerly" in dense["cuda_graph_error"]
    _valid([dense, step])
    work.captures.clear()  # a setup and no capture: eager too, no error to report
    dense, step = runner.run_cell(_cell("dense", "step"), opts)
    assert step["cuda_graph"] is False and "cuda_graph_error" not in step and step["timing"]["samples_ms"] == [3.0] * 3


def test_peak_memory_is_recorded_per_variant_where_the_clock_counts_it(fake_suite):
    clock = FakeClock(peak=0)
    clock.allocated = 4096
    fake_suite["work"] = Workload(fns={"small": clock.candidate("small", 1.0, mem=100),
                                       "big": clock.candidate("big", 1.0, mem=7000)},
                                  backends={"small": "small", "big": "big"})
    small, big = runner.run_cell(_cell("small", "big"), _opts(clock))
    assert small["peak_mem_bytes"] == 4196 and big["peak_mem_bytes"] == 11096
    assert clock.calls().count("small") == 1 + 3 + 1   # warmup, repeats, the peak-memory call
    _valid([small, big])
    cpu = runner.run_cell(_cell("small"), _opts(FakeClock()))[0]   # no counter: no field
    assert cpu["status"] == "ok" and "peak_mem_bytes" not in cpu


def test_a_failing_peak_memory_call_settles_the_variants(fake_suite):
    clock = FakeClock(peak=0)
    calls = [0]

    def fifth_call_fails():
        calls[0] += 1
        if calls[0] > 4:                                 # warmup + 3 repeats pass, the probe fails
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    fake_suite["work"] = Workload(fns={"a": fifth_call_fails}, backends={"a": "a"})
    (a,) = runner.run_cell(_cell("a"), _opts(clock))
    assert a["status"] == "skipped" and "peak memory" in a["reason"] and a["timing"] is None
    _valid([a])


def test_the_median_host_enqueue_time_of_the_timed_calls_is_recorded(fake_suite):
    clock = FakeClock()
    # Warmup 5 ms on the host (not timed), then 0.1, 0.2, 0.9: median 0.2 (the mean would be 0.4).
    fake_suite["work"] = Workload(fns={"a": clock.candidate("a", 1.0, host=[5.0, 0.1, 0.2, 0.9]),
                                       "b": clock.candidate("b", 1.0, host=0.05)},
                                  backends={"a": "a", "b": "b"})
    a, b = runner.run_cell(_cell("a", "b"), _opts(clock))
    assert a["timing"]["host_ms"] == pytest.approx(0.2) and b["timing"]["host_ms"] == pytest.approx(0.05)
    assert a["timing"]["samples_ms"] == [1.0] * 3
    _valid([a, b])
