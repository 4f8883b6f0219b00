"""Benchmark suites, declared as data (`SPECS`: tuples of bench.cases.CaseSpec).

Each suite module holds its grids at module level (no torch import, so `python -m bench list`
is cheap) and a `build(cell, device) -> Workload` that imports torch and nsa when called. Which
suites a sweep runs by default (`default`, `nightly`) is `nsa_contract.suites`, shared with
`ci pipeline` and the GPU workflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType

from bench.cases import Cell, expand
from nsa_contract import suites as lists

# Every suite bench has (`all`). Which of them a sweep runs by default is nsa_contract.suites: serve and
# serve_prefill (the paged-cache serving loop, chunked prefill) are in neither list; name them.
SUITES = ("fa2", "triton", "masked", "decode", "prefill", "calibration", "fast", "auto", "train", "serve",
          "serve_prefill")


def load(name: str) -> ModuleType:
    if name not in SUITES:
        raise ValueError(f"suite must be one of {', '.join(SUITES)} (or a list: all, {', '.join(lists.SETS)}), "
                         f"got {name!r}")
    return importlib.import_module(f"bench.suites.{name}")


def parse(names: str | Iterable[str]) -> list[str]:
    """`"fa2,calibration"` or `["fa2", ...]` -> validated names in order. A name may stand for a list:
    `all` (every suite), `default` or `nightly` (nsa_contract.suites.SETS); a suite in two of them
    runs once."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    sets = {"all": SUITES, **lists.SETS}
    items = list(dict.fromkeys(s for n in items for s in sets.get(n, (n,))))
    for name in items:
        load(name)
    return items


def cells(names: Iterable[str], size: str, backends: Iterable[str] | None = None) -> list[Cell]:
    out: list[Cell] = []
    for name in names:
        out.extend(expand(name, load(name).SPECS, size, backends))
    return out
