from __future__ import annotations

import time

import pytest

from bench.timing import CpuClock, Timer, measure, peak_memory
from nsa_contract import results
from tests.bench.fakes import FakeClock


def test_counts_interleave_in_blocks_and_warm_up_exactly():
    clock = FakeClock()
    fns = {"A": clock.candidate("A", 1.0), "B": clock.candidate("B", 2.0)}
    samples = measure(fns, Timer(warmup=2, rep=5, block=2, l2_flush=False), clock=clock)
    assert clock.calls() == ["A", "A", "B", "B"] + ["A", "A", "B", "B", "A", "A", "B", "B", "A", "B"]
    assert samples == {"A": [1.0] * 5, "B": [2.0] * 5}


def test_each_repeat_is_flushed_then_timed_alone():
    clock = FakeClock()
    measure({"A": clock.candidate("A", 1.0), "B": clock.candidate("B", 1.0)},
            Timer(warmup=0, rep=3, block=1), clock=clock)
    timed = clock.log[clock.log.index(("sync",)) + 1:]
    assert timed[:8] == [("flush",), ("record",), ("call", "A"), ("record",),
                         ("flush",), ("record",), ("call", "B"), ("record",)]
    assert timed.count(("flush",)) == 6 and timed[-1] == ("sync",)


def test_no_flush_when_disabled_or_the_clock_cannot():
    for clock, timer in ((FakeClock(), Timer(warmup=0, rep=2, l2_flush=False)),
                         (FakeClock(flushes=False), Timer(warmup=0, rep=2))):
        measure({"A": clock.candidate("A", 1.0)}, timer, clock=clock)
        assert ("flush",) not in clock.log


def test_budgets_size_warmup_per_candidate_and_repeats_by_the_slowest():
    clock = FakeClock()
    fns = {"A": clock.candidate("A", 1.0), "B": clock.candidate("B", 2.0)}
    timer = Timer(warmup_ms=10, rep_ms=40, min_rep=1, estimate_calls=5, l2_flush=False)
    samples = measure(fns, timer, clock=clock)
    # first call + 5 estimate calls + warmup (10 ms / own estimate) + 40 ms / 2 ms (slowest) repeats
    assert clock.calls().count("A") == 1 + 5 + 10 + 20
    assert clock.calls().count("B") == 1 + 5 + 5 + 20
    assert len(samples["A"]) == len(samples["B"]) == 20


def test_repeats_are_clamped():
    clock = FakeClock()
    fast = measure({"A": clock.candidate("A", 0.001)}, Timer(warmup=0, rep_ms=100, min_rep=1, max_rep=7), clock=clock)
    slow = measure({"A": clock.candidate("A", 50.0)}, Timer(warmup=0, rep_ms=100, min_rep=4), clock=clock)
    assert len(fast["A"]) == 7 and len(slow["A"]) == 4


def test_setup_runs_before_every_call_outside_the_timed_region():
    clock = FakeClock()

    def setup():
        clock.log.append(("setup",))
        clock.now += 100.0  # would show in the samples if it were timed

    samples = measure({"A": clock.candidate("A", 1.0)}, Timer(warmup=1, rep=3, l2_flush=False),
                      clock=clock, setup={"A": setup})
    calls = [i for i, e in enumerate(clock.log) if e[0] == "call"]
    assert all(clock.log[i - 1] in (("setup",), ("record",)) for i in calls)
    assert clock.log.count(("setup",)) == 4 and samples["A"] == [1.0] * 3


def test_samples_feed_the_schema_quantiles():
    clock = FakeClock()
    samples = measure({"A": clock.candidate("A", [1.0, 2.0, 3.0, 4.0, 5.0])},
                      Timer(warmup=0, rep=5, l2_flush=False), clock=clock)
    summary = results.timing_summary(samples["A"])
    assert summary["samples_ms"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert summary["median_ms"] == 3.0
    assert summary["p20_ms"] == pytest.approx(1.8) and summary["p80_ms"] == pytest.approx(4.2)


def test_cpu_clock_measures_wall_time():
    samples = measure({"sleep": lambda: time.sleep(0.002)}, Timer(warmup=1, rep=3), clock=CpuClock())
    assert len(samples["sleep"]) == 3 and all(1.5 <= s < 200 for s in samples["sleep"])
    assert Timer().method(CpuClock())["timer"] == "perf_counter"
    assert Timer().method(CpuClock())["l2_flush"] is False  # what was done, not what was asked


def test_bad_timers_and_devices_are_refused():
    with pytest.raises(ValueError, match="rep"):
        Timer(rep=0)
    with pytest.raises(ValueError, match="min_rep"):
        Timer(min_rep=5, max_rep=2)
    with pytest.raises(ValueError, match="cuda_graph"):
        measure({"A": lambda: None}, Timer(cuda_graph=True), device="cpu")
    with pytest.raises(ValueError, match="device"):
        measure({"A": lambda: None}, Timer(), device="tpu")


def test_candidate_exceptions_propagate():
    def boom():
        raise RuntimeError("kernel exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        measure({"A": boom}, Timer(warmup=1, rep=1), clock=FakeClock())


def test_replayed_candidates_are_not_captured_again():
    clock = FakeClock()
    wrapped = []
    clock.wrap = lambda fn: wrapped.append(fn) or fn
    fns = {"A": clock.candidate("A", 1.0), "B": clock.candidate("B", 2.0)}
    samples = measure(fns, Timer(warmup=0, rep=2, l2_flush=False, cuda_graph=True), clock=clock, replayed={"B"})
    assert wrapped == [fns["A"]] and samples == {"A": [1.0, 1.0], "B": [2.0, 2.0]}
    with pytest.raises(ValueError, match="replayed must name candidates"):
        measure(fns, Timer(warmup=0, rep=1), clock=clock, replayed={"C"})


def test_peak_memory_is_one_call_of_each_candidate_alone():
    clock = FakeClock(peak=0)
    clock.allocated = 1000                      # inputs held by the cell: part of every peak
    fns = {"A": clock.candidate("A", 1.0, mem=300), "B": clock.candidate("B", 1.0, mem=50)}
    before = len(clock.log)
    peaks = peak_memory(fns, clock=clock, setup={"B": lambda: clock.log.append(("setup",))})
    # A's larger peak must not leak into B's: the counter is reset between them.
    assert peaks == {"A": 1300, "B": 1050}
    assert clock.log[before + 1:] == [("sync",), ("reset_peak",), ("call", "A"), ("sync",), ("peak",),
                                      ("setup",), ("sync",), ("reset_peak",), ("call", "B"), ("sync",), ("peak",)]


def test_peak_memory_without_a_counter_is_none_and_costs_no_call():
    clock = FakeClock()                          # peak=None, like CpuClock
    assert peak_memory({"A": clock.candidate("A", 1.0)}, clock=clock) == {"A": None}
    assert clock.calls() == []
    assert CpuClock().peak_bytes() is None


def test_host_enqueue_time_is_taken_around_each_timed_repeat_only():
    clock = FakeClock()
    # Call 0 is the warmup (9 ms on the host, must not show); the timed repeats take 0.1, 0.2, 0.3.
    fns = {"A": clock.candidate("A", 1.0, host=[9.0, 0.1, 0.2, 0.3]), "B": clock.candidate("B", 2.0, host=0.5)}
    host: dict[str, list[float]] = {"stale": [1.0]}
    samples = measure(fns, Timer(warmup=1, rep=3, block=2, l2_flush=False), clock=clock, host=host)
    assert samples == {"A": [1.0] * 3, "B": [2.0] * 3}  # the event times are untouched
    assert host.keys() == {"A", "B"}
    assert host["A"] == pytest.approx([0.1, 0.2, 0.3]) and host["B"] == pytest.approx([0.5] * 3)


def test_host_samples_match_the_repeats_under_budgets_and_default_to_perf_counter():
    clock = FakeClock()
    host: dict[str, list[float]] = {}
    samples = measure({"A": clock.candidate("A", 1.0, host=0.25)},
                      Timer(warmup_ms=3, rep_ms=7, min_rep=1, l2_flush=False), clock=clock, host=host)
    assert len(host["A"]) == len(samples["A"]) == 7 and host["A"] == pytest.approx([0.25] * 7)
    # A clock without host_ns (CpuClock, CudaClock) is timed on the host by time.perf_counter_ns.
    host = {}
    measure({"sleep": lambda: time.sleep(0.002)}, Timer(warmup=0, rep=2), clock=CpuClock(), host=host)
    assert len(host["sleep"]) == 2 and all(1.5 <= h < 200 for h in host["sleep"])
