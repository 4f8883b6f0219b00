"""FA-2 against masked SDPA on the two branches FA-2 can run: the data behind the thresholds.

Sliding branch over a `T x w` grid; compressed branch over `T` with `(l, d)`. Baseline `sdpa`
(masked SDPA), candidates `fa2` (flash-attn when importable, else torch's vendored FA-2) and
`flex`. Every variant is parity-checked against an fp32 computation of the same op on the same
inputs (tolerance: 2x masked SDPA's own error + a floor) before timing; all variants of a cell
are timed interleaved. The model's configuration (w = 512; l = 32, d = 16; configs/base.yaml)
is swept at every length; other windows and (l, d) at fewer lengths, for the report.
"""

from __future__ import annotations

from bench.cases import CaseSpec, Cell, Variant, Workload, key_variants, product

# The candidates are the fa2 keys' backends (nsa_contract.keys); FlexAttention is timed beside them
# for the report on the model's layout only (no key decides it).
FLEX = Variant("flex")
WIN, WIN_NO_FLEX = key_variants("fa2", "sliding", extra=(FLEX,)), key_variants("fa2", "sliding")
CMP, CMP_NO_FLEX = key_variants("fa2", "compressed", extra=(FLEX,)), key_variants("fa2", "compressed")

# Head layouts (B, Hq, Hkv, D): the spec's measurement layout with GQA, a wide MHA one, a batch.
GQA64 = {"B": 1, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64}
MHA128 = {"B": 1, "Hq": 16, "Hkv": 16, "Dk": 128, "Dv": 128}
BATCH4 = {"B": 4, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64}
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128}
SMOKE = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 64, "Dv": 64}
# With GQA64 (g4) and MHA128 (g1): one layout per shape class (nsa_contract.keys.class_of), so each class's
# thresholds come from its own cells.
G2 = {"B": 1, "Hq": 16, "Hkv": 8, "Dk": 64, "Dv": 64}
G8 = {"B": 1, "Hq": 16, "Hkv": 2, "Dk": 64, "Dv": 64}
G16 = {"B": 1, "Hq": 32, "Hkv": 2, "Dk": 64, "Dv": 64}

NIGHTLY_T = (256, 512, 1024, 2048, 4096, 8192, 16384)
FULL_T = NIGHTLY_T + (32768, 65536)
CMP_DEFAULT = {"block": 32, "stride": 16}
CMP_OTHER = ({"block": 16, "stride": 8}, {"block": 64, "stride": 32})
BF16 = ("bf16",)


def _with(layouts, extra):
    return tuple({**lay, **extra} for lay in layouts)


# Flex compiles one kernel per new shape (seconds each on a cold cache), so the nightly sweep runs
# it on one layout at the model's configuration only; FA-2 and SDPA run everywhere.
SPECS = (
    CaseSpec("sliding", WIN, {
        "smoke": product(layout=(SMOKE,), T=(200, 1000), window=(512,), dtype=BF16),
        "nightly": product(layout=(GQA64,), T=NIGHTLY_T, window=(512,), dtype=BF16),
        "full": product(layout=(GQA64, MHA128), T=FULL_T, window=(512,), dtype=BF16),
    }),
    CaseSpec("sliding", WIN_NO_FLEX, {
        "nightly": (product(layout=(MHA128, BATCH4, G2, G8, G16), T=NIGHTLY_T, window=(512,), dtype=BF16)
                    + product(layout=(GQA64,), T=(1024, 4096, 16384), window=(128, 1024), dtype=BF16)),
        "full": (product(layout=(PAPER,), T=FULL_T, window=(512,), dtype=BF16)
                 + product(layout=(GQA64, MHA128), T=FULL_T, window=(512,), dtype=("fp16",))
                 + product(layout=(BATCH4,), T=NIGHTLY_T + (32768,), window=(512,), dtype=BF16)
                 + product(layout=(GQA64, MHA128), T=(1024, 4096, 16384, 65536),
                           window=(64, 128, 256, 1024, 2048, 4096), dtype=BF16)),
    }),
    CaseSpec("compressed", CMP, {
        "smoke": product(layout=_with((SMOKE,), CMP_DEFAULT), T=(200, 1000), dtype=BF16),
        "nightly": product(layout=_with((GQA64,), CMP_DEFAULT), T=NIGHTLY_T, dtype=BF16),
        "full": product(layout=_with((GQA64, MHA128), CMP_DEFAULT), T=FULL_T, dtype=BF16),
    }),
    CaseSpec("compressed", CMP_NO_FLEX, {
        "nightly": (product(layout=_with((MHA128, BATCH4), CMP_DEFAULT), T=NIGHTLY_T, dtype=BF16)
                    + product(layout=tuple({**GQA64, **ld} for ld in CMP_OTHER), T=(1024, 4096, 16384),
                              dtype=BF16)),
        "full": (product(layout=_with((PAPER,), CMP_DEFAULT), T=FULL_T, dtype=BF16)
                 + product(layout=_with((GQA64, MHA128), CMP_DEFAULT), T=FULL_T, dtype=("fp16",))
                 + product(layout=_with((BATCH4,), CMP_DEFAULT), T=NIGHTLY_T + (32768,), dtype=BF16)
                 + product(layout=tuple({**lay, **ld} for lay in (GQA64, MHA128) for ld in CMP_OTHER),
                           T=(1024, 4096, 16384, 65536), dtype=BF16)),
    }),
)


def build(cell: Cell, device) -> Workload:
    from bench.suites import branch

    return branch.build(cell, device, basis="sdpa")
