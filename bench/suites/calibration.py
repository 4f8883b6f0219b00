"""A/A calibration: one backend against itself, so every report can state the noise floor.

Each cell holds two cases with identical params except `replica` ("A" baseline, "B"
candidate) on the same inputs, timed interleaved exactly like a real comparison; their
"speedup" should be 1 and its interval shows how wide an interval pure noise produces.
"""

from __future__ import annotations

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.fa2 import GQA64, SMOKE


def _pair(backend: str) -> tuple[Variant, Variant]:
    return (Variant(backend, "baseline", (("replica", "A"),)),
            Variant(backend, "candidate", (("replica", "B"),)))


_GRID = {
    "smoke": product(layout=(SMOKE,), T=(1000,), window=(512,), dtype=("bf16",)),
    "nightly": product(layout=(GQA64,), T=(1024, 8192), window=(512,), dtype=("bf16",)),
    "full": product(layout=(GQA64,), T=(1024, 4096, 16384), window=(512,), dtype=("bf16",)),
}
SPECS = (CaseSpec("sliding", _pair("sdpa"), _GRID), CaseSpec("sliding", _pair("fa2"), _GRID))


def build(cell: Cell, device) -> Workload:
    from bench.suites import branch

    return branch.build(cell, device, check=False)
