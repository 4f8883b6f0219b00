"""The one timing method of this repository; the only code that touches CUDA events.

Method (after triton's `do_bench`, extended to several candidates):

1. Estimate: each candidate runs once (compilation, autotuning and allocations happen here),
   then `estimate_calls` calls are timed to estimate its cost.
2. Warmup: each candidate runs `warmup` times, or as many times as fit in `warmup_ms` by its
   own estimate (at most `max_rep`).
3. Repeats: every candidate gets the same number of repeats, `rep`, or as many as fit in
   `rep_ms` for the slowest candidate (clamped to `[min_rep, max_rep]`). Repeats are
   interleaved in blocks, `A x block, B x block, A x block, ...`, so clock, thermal and
   background drift hit every candidate alike, and a paired comparison per round is possible.
4. Each repeat is timed on its own: a start/end marker pair around one call (CUDA events on a
   GPU, `time.perf_counter_ns` on a CPU, where torch work is synchronous). With `l2_flush`
   a 256 MiB buffer is zeroed before every repeat, outside the timed region, so no repeat
   starts with its inputs in L2. Elapsed times are read after one final synchronize; the raw
   samples (milliseconds) are returned.
5. Host enqueue time: with `measure(..., host={})`, each timed repeat's call is also bracketed by
   `time.perf_counter_ns` on the host, with no synchronize, so it is the time the host took to
   enqueue the call (Python, dispatch, launches), not the GPU's. An event time can never be below
   it while the GPU waits for the host, so `ci.regress` uses it to tell a slower host from slower
   kernels. (On a CPU clock the two coincide: torch CPU work is synchronous.)

`cuda_graph=True` captures each candidate in a CUDA graph and times replays, which removes the
CPU launch overhead of microsecond kernels. The clock is injectable (`measure(..., clock=)`),
which is how the tests check order and counts on a fake clock.

Peak memory (`peak_memory`): interleaved repeats cannot be told apart, so each candidate gets one
more, untimed call of its own, bracketed by the clock's peak-memory counter (CUDA's
`reset_peak_memory_stats` / `max_memory_allocated`; a CPU clock has none and reports None).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any, Protocol

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timer:
    """How to time. Counts (`warmup`, `rep`) win over budgets (`warmup_ms`, `rep_ms`) when set."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    warmup: int | None = None
    rep: int | None = None
    l2_flush: bool = True
    cuda_graph: bool = False
    block: int = 5
    min_rep: int = 10
    max_rep: int = 1000
    estimate_calls: int = 5

    def __post_init__(self) -> None:
        for name in ("block", "min_rep", "max_rep", "estimate_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"Timer.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"Timer.warmup must be >= 0, got {self.warmup}")
        if self.rep is not None and self.rep < 1:
            raise ValueError(f"Timer.rep must be >= 1, got {self.rep}; a timed case needs a sample")
        if self.min_rep > self.max_rep:
            raise ValueError(f"Timer.min_rep ({self.min_rep}) must be <= max_rep ({self.max_rep})")

    def method(self, clock: Clock) -> dict[str, Any]:
        """The `run.method` record of a results file: what was actually done on `clock`."""
        return {**asdict(self), "timer": clock.name, "interleaved": True,
                "l2_flush": self.l2_flush and clock.flushes, "statistic": "median"}


class Clock(Protocol):
    """Where time comes from. `marker()` makes an unrecorded marker, `record(m)` stamps it in
    stream order, `elapsed_ms(a, b)` is valid after `synchronize()`. A clock may also have
    `host_ns()`, the host's clock for the enqueue time (default `time.perf_counter_ns`; the
    tests' fake clock has its own)."""

    name: str
    flushes: bool

    def marker(self) -> Any: ...
    def record(self, marker: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def synchronize(self) -> None: ...
    def flush(self) -> None: ...
    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]: ...
    def reset_peak(self) -> None: ...
    def peak_bytes(self) -> int | None: ...


class CpuClock:
    """`time.perf_counter_ns`; torch CPU work is synchronous, so a stamp after the call ends it.
    There is no L2 flush on a CPU (a CPU timing is for smoke tests, never for a decision)."""

    name = "perf_counter"
    flushes = False

    def __init__(self, cuda_graph: bool = False) -> None:
        if cuda_graph:
            raise ValueError("cuda_graph needs a CUDA device; drop --cuda-graph or run on a GPU")

    def marker(self) -> list[int]:
        return [0]

    def record(self, marker: list[int]) -> None:
        marker[0] = time.perf_counter_ns()

    def elapsed_ms(self, start: list[int], end: list[int]) -> float:
        return (end[0] - start[0]) / 1e6

    def synchronize(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        return fn

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        return None


class CudaClock:
    """CUDA events on the current stream; the L2 flush buffer is allocated once per device."""

    name = "cuda_events"
    flushes = True
    _flush_buffers: dict[int, Any] = {}

    def __init__(self, cuda_graph: bool = False) -> None:
        import torch

        self._torch = torch
        self.cuda_graph = cuda_graph
        self.device = torch.cuda.current_device()

    def marker(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def record(self, marker: Any) -> None:
        marker.record()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def flush(self) -> None:
        buf = self._flush_buffers.get(self.device)
        if buf is None:
            buf = self._torch.empty(L2_FLUSH_BYTES, dtype=self._torch.uint8, device="cuda")
            self._flush_buffers[self.device] = buf
        buf.zero_()

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        if not self.cuda_graph:
            return fn
        torch = self._torch
        # Capture needs a warm, side-stream run first (lazy init, allocator pools, autotuning).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay

    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return int(self._torch.cuda.max_memory_allocated(self.device))


def _nop() -> None:
    pass


def default_clock(device: str, cuda_graph: bool = False) -> Clock:
    """The clock for `device` (`"cpu"` or `"cuda"`); torch is imported only for CUDA."""
    if device == "cpu":
        return CpuClock(cuda_graph)
    if device == "cuda":
        return CudaClock(cuda_graph)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _estimate(fn: Callable[[], Any], setup: Callable[[], Any] | None, clock: Clock, calls: int) -> float:
    """Mean ms of `calls` calls, each timed on its own so `setup` stays outside the timed region."""
    pairs = [(clock.marker(), clock.marker()) for _ in range(calls)]
    for start, end in pairs:
        if setup is not None:
            setup()
        clock.record(start)
        fn()
        clock.record(end)
    clock.synchronize()
    return sum(clock.elapsed_ms(s, e) for s, e in pairs) / calls


def measure(fns: dict[str, Callable[[], Any]], timer: Timer, *, clock: Clock | None = None,
            device: str = "cuda", setup: dict[str, Callable[[], Any]] | None = None,
            replayed: Collection[str] = (),
            host: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Time every candidate in `fns` interleaved; return its raw per-repeat samples in ms.

    Every candidate gets the same number of samples. `setup[name]`, when given, runs before
    every call of that candidate, outside the timed region (a decode step restores its cache
    there); it rules out `cuda_graph`. `replayed` names candidates whose fn already replays a
    CUDA graph that the caller captured (a stateful step captured on its own copy of its state):
    `cuda_graph` does not capture those again. Exceptions from a candidate propagate (the runner
    records the case); `clock` defaults to the one for `device`. `host`, when given (an empty
    dict), is filled with each candidate's per-repeat host enqueue time in ms, in the order of its
    samples: `time.perf_counter_ns` before and after each timed call, no synchronize.
    """
    if not fns:
        return {}
    setup = setup or {}
    unknown = set(replayed) - set(fns)
    if unknown:
        raise ValueError(f"replayed must name candidates of fns, got unknown {sorted(unknown)}")
    clock = clock if clock is not None else default_clock(device, timer.cuda_graph)
    if setup and timer.cuda_graph:
        raise ValueError("cuda_graph cannot replay a candidate that needs a setup step; drop --cuda-graph")
    run = {name: fn if name in replayed else clock.wrap(fn) for name, fn in fns.items()}
    host_ns: Callable[[], int] = getattr(clock, "host_ns", time.perf_counter_ns)

    estimate: dict[str, float] = {}
    if timer.warmup is None or timer.rep is None:
        for name, fn in run.items():
            setup.get(name, _nop)()
            fn()
            clock.synchronize()
            # A floor keeps a clock that did not move (fake clocks, empty fns) from dividing by 0.
            estimate[name] = max(_estimate(fn, setup.get(name), clock, timer.estimate_calls), 1e-6)

    for name, fn in run.items():
        n = timer.warmup if timer.warmup is not None else \
            min(max(1, int(timer.warmup_ms / estimate[name])), timer.max_rep)
        for _ in range(n):
            setup.get(name, _nop)()
            fn()
    if timer.rep is not None:
        n_rep = timer.rep
    else:
        n_rep = min(max(int(timer.rep_ms / max(estimate.values())), timer.min_rep), timer.max_rep)

    flush = timer.l2_flush and clock.flushes
    markers = {name: [(clock.marker(), clock.marker()) for _ in range(n_rep)] for name in run}
    enqueue_ns = {name: [0] * n_rep for name in run}
    clock.synchronize()
    for first in range(0, n_rep, timer.block):
        for name, fn in run.items():
            before = setup.get(name)
            for i in range(first, min(first + timer.block, n_rep)):
                start, end = markers[name][i]
                if before is not None:
                    before()
                if flush:
                    clock.flush()
                clock.record(start)
                t0 = host_ns()
                fn()
                enqueue_ns[name][i] = host_ns() - t0
                clock.record(end)
    clock.synchronize()
    samples = {name: [clock.elapsed_ms(s, e) for s, e in pairs] for name, pairs in markers.items()}
    for name, values in samples.items():
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise RuntimeError(f"{name}: the clock returned a non-finite or negative time; "
                               "is the candidate running on another stream?")
    if host is not None:
        host.clear()
        host.update({name: [ns / 1e6 for ns in values] for name, values in enqueue_ns.items()})
    return samples


def peak_memory(fns: dict[str, Callable[[], Any]], *, clock: Clock,
                setup: dict[str, Callable[[], Any]] | None = None) -> dict[str, int | None]:
    """Peak device memory of one call of each candidate, in bytes; None where `clock` has no
    memory counter (CPU).

    Per candidate, alone: its `setup` (if any), synchronize, reset the peak counter, one call,
    synchronize, read the counter. Run it after `measure` so compilation and autotuning are done.
    The peak counts everything allocated on the device meanwhile (the cell's inputs, the L2
    flush buffer, state other candidates hold), so it compares candidates of one cell: the
    difference between two is the difference of their working memory. A clock without a
    counter makes no call at all (CPU runs pay nothing). Exceptions propagate.
    """
    if clock.peak_bytes() is None:
        return dict.fromkeys(fns)
    setup = setup or {}
    peaks: dict[str, int | None] = {}
    for name, fn in fns.items():
        setup.get(name, _nop)()
        clock.synchronize()
        clock.reset_peak()
        fn()
        clock.synchronize()
        peaks[name] = clock.peak_bytes()
    return peaks
