"""Benchmark suites, declared as data (`SPECS`: tuples of bench.cases.CaseSpec).

Each suite module holds its grids at module level (no torch import, so `python -m bench list`
is cheap) and a `build(cell, device) -> Workload` that imports torch and nsa when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType

from bench.cases import Cell, expand

SUITES = ("fa2", "triton", "masked", "decode", "prefill", "calibration", "fast", "auto", "train", "serve",
          "serve_prefill")
# The suites whose cells decide thresholds (fa2: fa2_*, triton: triton_*), plus the A/A noise floor.
DEFAULT_SUITES = ("fa2", "triton", "calibration")


def load(name: str) -> ModuleType:
    if name not in SUITES:
        raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {name!r}")
    return importlib.import_module(f"bench.suites.{name}")


def parse(names: str | Iterable[str]) -> list[str]:
    """`"fa2,calibration"` or `["fa2", ...]` -> validated names in order; `all` means every suite."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if items == ["all"]:
        return list(SUITES)
    for name in items:
        load(name)
    return items


def cells(names: Iterable[str], size: str, backends: Iterable[str] | None = None) -> list[Cell]:
    out: list[Cell] = []
    for name in names:
        out.extend(expand(name, load(name).SPECS, size, backends))
    return out
