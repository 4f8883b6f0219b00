"""Which evidence may decide a threshold at all. Pure functions, called by ``ci.decide`` per run.

- A cell where both sides run under a time floor, or where on both sides the host's enqueue time
  of one call reaches the timed median (``host_bound``), is launch-bound: its speedup measures
  launch overhead and CPU jitter, not the kernels, and flips between runs of the same machine.
- A cell whose effect is inside the A/A noise floor (``ci.noise``) says nothing this machine can
  resolve, whatever its interval claims.
- A results file whose lengths do not cover the decision grid (a smoke run) cannot propose: the
  threshold rule needs every tested length at and above L, and a thin grid would pick a wrong L.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def launch_bound(cell: Mapping[str, Any], floor_ms: float) -> bool:
    """Whether both sides' medians are under ``floor_ms``, or both sides are ``host_bound`` (a cell
    dict from ``ci.cells.Cell.to_dict``)."""
    if floor_ms < 0:
        raise ValueError(f"floor_ms must be >= 0, got {floor_ms}; set decide.launch_floor_ms, e.g. 0.05")
    sides = [cell.get("baseline"), cell.get("candidate")]
    if any(not s or s.get("median_ms") is None for s in sides):
        return False  # an untimed side is failed or skipped, which ci.cells already reports
    return (all(float(s["median_ms"]) < floor_ms for s in sides)  # type: ignore[union-attr]
            or all(host_bound(s) for s in sides))


def host_bound(side: Mapping[str, Any] | None) -> bool:
    """The GPU waited on the host: enqueueing one call took as long as the whole timed call
    (`host_ms >= median_ms`; the rule `ci.regress` uses for a `host` slowdown). Such a side's time
    is the host's launch rate (Python, dispatch, launches), which differs between machines and runs:
    on H100s the Triton compressed op at G = 1, T = 4096 timed 0.047 ms in the sweep of
    results/h100/sm90-classes-2 and 0.12-0.16 ms in the three nightlies of results/h100/nightly,
    where its host enqueue time alone was 0.2 ms. Results without `host_ms` are never host-bound."""
    if not side or side.get("median_ms") is None:
        return False
    host = side.get("host_ms")
    return host is not None and float(host) >= float(side["median_ms"])


def inside_noise(cell: Mapping[str, Any], half_width: float | None) -> bool:
    """Whether the speedup's distance from 1 is within the A/A half-width (None: no calibration, False)."""
    if half_width is None or cell.get("speedup") is None:
        return False
    return abs(float(cell["speedup"]) - 1.0) <= half_width


def excluded(cell: Mapping[str, Any], floor_ms: float, half_width: float | None) -> str:
    """Why ``cell`` may not decide, or "" when it may."""
    if launch_bound(cell, floor_ms):
        b, c = cell["baseline"]["median_ms"], cell["candidate"]["median_ms"]
        if all(host_bound(cell[s]) for s in ("baseline", "candidate")):
            return (f"launch-bound: on both sides the host's enqueue time of one call reaches the timed "
                    f"median ({b:.3g} and {c:.3g} ms)")
        return f"launch-bound: both sides under {floor_ms:g} ms ({b:.3g} and {c:.3g} ms)"
    if inside_noise(cell, half_width):
        return f"inside the A/A noise floor: {cell['speedup']:.3f}x is within 1 +- {half_width:.3f}"
    return ""


def covers_grid(tested_lengths: Iterable[int], required_lengths: Iterable[int]) -> tuple[bool, str]:
    """(True, "") when every required length was tested, else (False, why) for the report."""
    tested, required = set(tested_lengths), sorted(set(required_lengths))
    if not required:
        return False, ("the decision grid is empty; set the decision lengths in the suite "
                       "(a grid with no length cannot place a threshold)")
    missing = [t for t in required if t not in tested]
    if not missing:
        return True, ""
    shown = ", ".join(str(t) for t in missing[:8]) + (" ..." if len(missing) > 8 else "")
    return False, (f"this run tested {len(required) - len(missing)} of the {len(required)} decision "
                   f"lengths (missing {shown}), as a smoke run does; only a run of the full grid can "
                   "propose a threshold")
