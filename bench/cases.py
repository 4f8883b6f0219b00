"""Benchmark cases as data: what a suite declares and what the runner executes. Standard library only.

A suite is a tuple of `CaseSpec`s. Each spec names an op, the variants to compare (usually one
per backend: a baseline and its candidates) and a grid of params per size. Expanding a spec gives
`Cell`s: one `(op, params)` point whose variants run on the same inputs, are parity-checked
against the same reference and are timed interleaved in one `bench.timing.measure` call. Each
variant of a cell becomes one case in the results file.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nsa_contract import keys
from nsa_contract.results import case_id

SIZES = ("smoke", "nightly", "full")
ROLES = ("baseline", "candidate")


@dataclass(frozen=True)
class Variant:
    """One side of a comparison: a requested backend (an alias such as `fa2` resolves at run
    time) plus params that only this variant's case carries (`replica` in A/A calibration)."""

    backend: str
    role: str = "candidate"
    extra: tuple[tuple[str, Any], ...] = ()
    op: str | None = None  # a case op other than its cell's (prefill: `dense` beside `nsa_prefill`)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def key(self) -> str:
        """Unique within a cell: the backend plus the extra params, e.g. `sdpa` or `sdpa:replica=A`."""
        return self.backend + "".join(f":{k}={v}" for k, v in self.extra)


def key_variants(suite: str, op: str, *, baseline: str = "sdpa", extra: Iterable[Variant] = ()) -> tuple[Variant, ...]:
    """The variants of a suite's `op` cells: the baseline, then one candidate per backend of the
    decision keys this suite decides for this op (nsa_contract.keys, in their order), then `extra`
    (candidates timed for the report that no key names yet). A key declared for a backend adds
    its candidate to its suite's cells by itself: a new backend for `auto` is its module, its
    `_TABLE` line, its key and its value in configs/base.yaml (DESIGN.md)."""
    out = [Variant(baseline, "baseline")]
    for backend in dict.fromkeys(k.backend for k in keys.KEYS if k.suite == suite and k.op == op):
        out.append(Variant(backend))
    seen = {v.key for v in out}
    out.extend(v for v in extra if v.key not in seen)
    return tuple(out)


@dataclass(frozen=True)
class CaseSpec:
    op: str
    variants: tuple[Variant, ...]
    grid: Mapping[str, tuple[Mapping[str, Any], ...]]


@dataclass(frozen=True)
class Cell:
    suite: str
    op: str
    params: Mapping[str, Any]
    variants: tuple[Variant, ...]

    def variant_params(self, variant: Variant) -> dict[str, Any]:
        return {**self.params, **dict(variant.extra)}

    def variant_op(self, variant: Variant) -> str:
        return variant.op or self.op

    def case_id(self, variant: Variant, backend: str | None = None) -> str:
        """The case id; `backend` is the resolved name (ids in results never hold an alias)."""
        return case_id(self.suite, self.variant_op(variant), backend or variant.backend,
                       self.variant_params(variant))

    @property
    def label(self) -> str:
        """`suite/op params` for progress lines."""
        return f"{self.suite}/{self.op} " + case_id(self.suite, self.op, "-", self.params).rsplit("/", 1)[-1]


@dataclass
class Workload:
    """What a suite's `build(cell, device)` hands the runner for one cell.

    `fns[key]` runs one variant on the cell's inputs and returns its output; `backends[key]` is
    the backend that will actually run (aliases resolved); `reasons[key]` marks a variant that
    cannot run here (unavailable or unsupported), recorded as `skipped`; `failures[key]` one
    that raised when it should have run, recorded as `failed`. When `reference` is set
    (an fp32 computation of the same op on the same inputs), every runnable variant is
    parity-checked before timing; the tolerance is twice the error of `tol_basis` (the same-dtype
    PyTorch path, e.g. masked SDPA) plus a small absolute floor. `extra[key]` holds additional
    fields for that variant's case (read counters in decode, for instance); `setups[key]` runs
    before every timed call of that variant, outside the timed region (decode restores its cache).
    A setup rules out timing CUDA graph replays of `fns[key]`; `captures[key]`, when given, is
    what the runner uses instead under CUDA graphs: called once, it captures the variant on its
    own state and returns the graph's replay (no setup needed). `cuda_graph=True` times this cell
    under CUDA graphs whatever the timer says (the suite skips such a cell where there is no GPU).
    """

    fns: dict[str, Callable[[], Any]]
    backends: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    reference: Callable[[], Any] | None = None
    tol_basis: Callable[[], Any] | None = None
    dtype: str | None = None
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    setups: dict[str, Callable[[], Any]] = field(default_factory=dict)
    captures: dict[str, Callable[[], Callable[[], Any]]] = field(default_factory=dict)
    cuda_graph: bool = False


def product(*, layout: Iterable[Mapping[str, Any]] = ({},), **axes: Iterable[Any]) -> tuple[dict[str, Any], ...]:
    """Cartesian product of `layout` dicts (a few keys that travel together, such as a head
    layout) and per-key value lists: `product(layout=[{"B": 1}], T=(256, 512))`."""
    names = list(axes)
    out = []
    for base in layout:
        for values in itertools.product(*(tuple(axes[n]) for n in names)):
            out.append({**base, **dict(zip(names, values, strict=True))})
    return tuple(out)


def expand(suite: str, specs: Iterable[CaseSpec], size: str,
           backends: Iterable[str] | None = None) -> list[Cell]:
    """Cells of `specs` at `size`; `backends` keeps only variants whose requested name is listed."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    wanted = set(backends) if backends is not None else None
    cells = []
    for spec in specs:
        variants = tuple(v for v in spec.variants if wanted is None or v.backend in wanted)
        if not variants:
            continue
        for params in spec.grid.get(size, ()):
            cells.append(Cell(suite, spec.op, dict(params), variants))
    return cells


def shard(cells: list[Cell], index: int, count: int) -> list[tuple[int, Cell]]:
    """(position in `cells`, cell) of shard `index` of `count`: round robin, so every shard gets
    short and long lengths alike."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard must be i/N with 0 <= i < N, got {index}/{count}")
    return list(enumerate(cells))[index::count]
