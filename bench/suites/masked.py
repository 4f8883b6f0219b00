"""Masked SDPA against a straightforward reference, per branch: real attention on both sides.

The `naive` variant is explicit `softmax(q k^T * scale + mask) v` in plain torch matmuls
(bench.naive; no fused kernel, no fp64); `sdpa` is nsa's masked-SDPA path. Both are
parity-checked against the fp32 computation of the same op (tolerance: 2x the naive same-dtype
path's error + a floor, flash-attention's rule) and timed interleaved.
"""

from __future__ import annotations

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.fa2 import GQA64, MHA128, SMOKE

VARIANTS = (Variant("sdpa", "baseline"), Variant("naive"))
NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
_NSA_KEYS = {"sliding": ("window",), "compressed": ("block", "stride"),
             "selected": ("block", "stride", "sel_block", "sel_count")}


def _grid(op: str) -> dict[str, tuple]:
    knobs = {k: NSA[k] for k in _NSA_KEYS[op]}
    return {
        "smoke": product(layout=({**SMOKE, **knobs},), T=(200, 1000), dtype=("bf16",)),
        "nightly": product(layout=({**GQA64, **knobs}, {**MHA128, **knobs}), T=(1024, 4096, 8192),
                           dtype=("bf16",)),
        "full": product(layout=({**GQA64, **knobs}, {**MHA128, **knobs}), T=(1024, 4096, 8192, 16384),
                        dtype=("bf16", "fp16")),
    }


SPECS = tuple(CaseSpec(op, VARIANTS, _grid(op)) for op in ("sliding", "compressed", "selected"))


def build(cell: Cell, device) -> Workload:
    from bench.suites import branch

    return branch.build(cell, device, basis="naive")
