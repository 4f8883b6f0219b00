"""The own Triton kernels against masked SDPA on all three branches: the data behind
`triton_min_len_sel`, `triton_min_len_cmp` and `triton_min_len_win` (nsa_contract/keys.py).

Baseline `sdpa` (masked SDPA), candidate `triton` (nsa/backends/triton_nsa.py). Same method as
the fa2 suite: every variant is parity-checked against an fp32 computation of the same op on the
same inputs (tolerance: 2x masked SDPA's own error + a floor) before timing, and both variants of
a cell are timed interleaved. `selected` uses block indices from `ops.select_blocks`, computed
once per cell outside the timed call, so both sides attend to the same real selection.

Grids: nightly and full sweep one head layout per shape class (GQA group 1, 2, 4, 8, 16) at the
paper's l = 32, d = 16, l' = 64, n = 16, w = 512 (the model's configuration, which `ci decide`
uses), in bf16, from 512 tokens up. Smoke is tiny (small
blocks too, so reported only) and fp16: on a CPU the kernels run under Triton's interpreter, about
a second per call at T = 40, and only with TRITON_INTERPRET=1 set before the process starts;
without it the `triton` cases are recorded as skipped with the reason. The interpreter of triton
3.6 computes `tl.dot` on bf16 wrongly (errors ~1e9 where fp16 and fp32 are exact), so on a CPU a
bf16 `triton` case is skipped with that reason instead of failing parity.

Nightly cost (42 cells): at most ~10 timed calls per variant of tens of ms at T = 16384, plus the
parity reference and one kernel compile per head layout, so on the order of two minutes on an
H100 (an estimate from the H200 timings in results/h200, not a measurement of this suite).
"""

from __future__ import annotations

from bench.cases import CaseSpec, Cell, Workload, key_variants, product
from bench.suites.fa2 import BATCH4, BF16, FULL_T, G2, G8, G16, GQA64, MHA128, NIGHTLY_T, PAPER

# The candidates are the triton keys' backends, per op (nsa_contract.keys).
VARIANTS = {op: key_variants("triton", op) for op in ("selected", "compressed", "sliding")}
CMP_PAPER = {"block": 32, "stride": 16}
SEL_PAPER = {**CMP_PAPER, "sel_block": 64, "sel_count": 16}
# One KV head (the whole group in one program) and small blocks keep the interpreter quick.
SMOKE = {"B": 1, "Hq": 4, "Hkv": 1, "Dk": 32, "Dv": 32}
CMP_SMOKE = {"block": 16, "stride": 8}
SEL_SMOKE = {**CMP_SMOKE, "sel_block": 16, "sel_count": 4}
SMOKE_T = (40, 72)
FP16 = ("fp16",)
CPU_BF16 = ("Triton's CPU interpreter (TRITON_INTERPRET=1) computes tl.dot on bf16 wrongly; bf16 cells "
            "need a GPU (the smoke grid is fp16)")
# Masked SDPA's selected mask is O(Hq * T^2) per call: the 64-head layout stops at 32k.
PAPER_T = NIGHTLY_T + (32768,)


def _with(layouts, knobs):
    return tuple({**lay, **knobs} for lay in layouts)


# One layout per shape class (nsa_contract.keys.class_of: GQA group size 1, 2, 4, 8, 16+), so every class
# decides from its own cells; plus a batch of 4 in class g4.
CLASS_LAYOUTS = (MHA128, G2, GQA64, G8, G16, BATCH4)
# 256 tokens is launch-bound on every GPU measured (both sides under decide.time_floor_ms).
CLASS_T = NIGHTLY_T[1:]
WIN_PAPER = {"window": 512}


def _grid(smoke: dict, paper: dict) -> dict[str, tuple]:
    return {
        "smoke": product(layout=_with((SMOKE,), smoke), T=SMOKE_T, dtype=FP16),
        "nightly": product(layout=_with(CLASS_LAYOUTS, paper), T=CLASS_T, dtype=BF16),
        "full": (product(layout=_with(CLASS_LAYOUTS, paper), T=FULL_T, dtype=BF16)
                 + product(layout=_with((PAPER,), paper), T=PAPER_T, dtype=BF16)
                 + product(layout=_with((GQA64,), paper), T=NIGHTLY_T, dtype=("fp16",))),
    }


# `triton_min_len_sel` is decided on the whole selection branch as dispatch runs it (nsa_contract/keys.py):
# torch scores + top-n + masked SDPA against the fused Triton scores + Triton top-n + the selection
# kernel. The attention-only cells (blocks given) are reported in the full sweep.
BRANCH = {"part": "branch"}


def _branch_grid(smoke: dict, paper: dict) -> dict[str, tuple]:
    grid = _grid({**smoke, **BRANCH}, {**paper, **BRANCH})
    return {**grid, "full": grid["full"] + _grid(smoke, paper)["nightly"]}


SPECS = (
    CaseSpec("selected", VARIANTS["selected"], _branch_grid(SEL_SMOKE, SEL_PAPER)),
    CaseSpec("compressed", VARIANTS["compressed"], _grid(CMP_SMOKE, CMP_PAPER)),
    CaseSpec("sliding", VARIANTS["sliding"], _grid({"window": 32}, WIN_PAPER)),
)


def build(cell: Cell, device) -> Workload:
    from bench.suites import branch

    work = branch.build(cell, device, basis="sdpa")
    if cell.params.get("part") == "branch":
        _whole_branch(cell, work, device)
    for v in cell.variants:
        if work.backends.get(v.key) == "triton" and v.key in work.fns and device.type == "cpu" \
                and cell.params["dtype"] == "bf16":
            del work.fns[v.key]
            work.reasons[v.key] = CPU_BF16
    return work


def _whole_branch(cell: Cell, work: Workload, device) -> None:
    """Replace the selected cell's variants by the whole selection branch on the same inputs: block
    scores, top-n and attention.

    No output parity here: the two score paths agree to fp32 rounding (tests/nsa/test_triton.py
    holds both to the fp64 oracle, on CPU and on the GPU), but over 10^5 rows a few near ties fall
    the other way, and one other block in one row moves that row's output far beyond a bf16
    tolerance (seen on the H100 at 8k-16k). What each side computes is checked instead: the
    attention-only cells (full sweep) parity-check the kernel, and `blocks_agree` records the share
    of (row, group) block sets the two paths pick alike."""
    from bench import parity
    from nsa import ops

    p = cell.params
    q, k, v = parity.qkv(p, device)
    kc, vc = ops.compress_kv(k, v, block=p["block"], stride=p["stride"])
    knobs = {"block": p["block"], "stride": p["stride"], "sel_block": p["sel_block"]}

    def torch_branch():
        idx = ops.select_blocks(q, kc, sel_count=p["sel_count"], **knobs)
        return ops.selected_attention(q, k, v, idx, sel_block=p["sel_block"], backend="sdpa")

    def triton_branch():
        from nsa.backends import triton_nsa

        scale = q.shape[-1] ** -0.5
        _, scores = triton_nsa.compressed_and_scores(q, kc, vc, scale=scale, **knobs)
        idx = triton_nsa.topn(scores, 0, sel_block=p["sel_block"], sel_count=p["sel_count"])
        return ops.selected_attention(q, k, v, idx, sel_block=p["sel_block"], backend="triton")

    work.reference = work.tol_basis = None
    for v_ in cell.variants:
        if v_.key in work.fns:
            work.fns[v_.key] = torch_branch if work.backends[v_.key] == "sdpa" else triton_branch
        if work.backends.get(v_.key) == "triton" and v_.key in work.fns:
            work.extra[v_.key] = {"blocks_agree": _agreement(q, kc, vc, p, knobs)}


def _agreement(q, kc, vc, p: dict, knobs: dict) -> float:
    """Share of (batch, row, group) rows whose block sets the torch and Triton score paths agree on."""
    from nsa import ops
    from nsa.backends import triton_nsa

    ref = ops.select_blocks(q, kc, sel_count=p["sel_count"], **knobs)
    _, scores = triton_nsa.compressed_and_scores(q, kc, vc, scale=q.shape[-1] ** -0.5, **knobs)
    got = triton_nsa.topn(scores, 0, sel_block=p["sel_block"], sel_count=p["sel_count"])
    return float((ref.sort(-1).values == got.long().sort(-1).values).all(-1).float().mean())
