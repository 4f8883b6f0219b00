"""A fake clock for bench.timing: time moves only when a candidate says so; every event is logged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FakeClock:
    name = "fake"

    def __init__(self, flushes: bool = True) -> None:
        self.flushes = flushes
        self.now = 0.0
        self.log: list[tuple[str, ...]] = []

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

    def candidate(self, name: str, durations: float | list[float]) -> Callable[[], None]:
        """A candidate that takes `durations` ms (cycled when a list) and logs its calls."""
        seq = durations if isinstance(durations, list) else [durations]
        count = [0]

        def fn() -> None:
            self.log.append(("call", name))
            self.now += seq[count[0] % len(seq)]
            count[0] += 1
        return fn

    def calls(self) -> list[str]:
        return [e[1] for e in self.log if e[0] == "call"]
