"""A fake clock for bench.timing: time moves only when a candidate says so; every event is logged.

Two times move: the device's (`now`, ms, read through markers) and the host's (`host_now`, ns,
read through `host_ns`, the enqueue time), each by what the candidate says a call takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FakeClock:
    name = "fake"

    def __init__(self, flushes: bool = True, peak: int | None = None) -> None:
        self.flushes = flushes
        self.now = 0.0
        self.log: list[tuple[str, ...]] = []
        self.peak = peak          # what peak_bytes reports (None: no memory counter, like a CPU)
        self.allocated = 0        # bytes "allocated" now; candidates may move it (see candidate)
        self.host_now = 0         # the host's clock (ns): what measure reads as enqueue time

    def marker(self) -> list[float | None]:
        return [None]

    def record(self, marker: list[float | None]) -> None:
        marker[0] = self.now
        self.log.append(("record",))

    def elapsed_ms(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]

    def synchronize(self) -> None:
        self.log.append(("sync",))

    def flush(self) -> None:
        self.log.append(("flush",))

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        return fn

    def reset_peak(self) -> None:
        self.log.append(("reset_peak",))
        if self.peak is not None:
            self.peak = self.allocated

    def peak_bytes(self) -> int | None:
        self.log.append(("peak",))
        return self.peak

    def host_ns(self) -> int:
        return self.host_now

    def candidate(self, name: str, durations: float | list[float], mem: int = 0,
                  host: float | list[float] = 0.0) -> Callable[[], None]:
        """A candidate that takes `durations` ms on the device and `host` ms on the host to enqueue
        (each cycled when a list), briefly needs `mem` bytes on top of what is allocated, and logs
        its calls."""
        seq = durations if isinstance(durations, list) else [durations]
        host_seq = host if isinstance(host, list) else [host]
        count = [0]

        def fn() -> None:
            self.log.append(("call", name))
            self.now += seq[count[0] % len(seq)]
            self.host_now += round(host_seq[count[0] % len(host_seq)] * 1e6)
            count[0] += 1
            if self.peak is not None:
                self.peak = max(self.peak, self.allocated + mem)
        return fn

    def calls(self) -> list[str]:
        return [e[1] for e in self.log if e[0] == "call"]
