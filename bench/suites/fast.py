"""The fast NSA path (own Triton kernels) against dense causal attention, prefill (issue: Fast NSA).

Cells (paper layout: 64 query / 4 KV heads, D 128, l=32 d=16 l'=64 n=16 w=512, separate K/V):
- `nsa_prefill`: NSA attention forward, projections excluded (avg compression, fused Triton
  compressed-attention + selection scores, Triton top-n, sliding through FA-2 (torch's or
  flash-attn) on CUDA, Triton selection kernel whose epilogue forms the gated sum), against dense causal SDPA restricted
  to its flash (FA-2) and cuDNN backends, and FlashAttention-3 (`fa3`, optional `fa3-fwd` wheel,
  `skipped` with the reason where absent or unsupported).
- `selected`: the Triton selection kernel alone (blocks chosen by the real scores, outside the
  timed call) against the same dense baselines.
No parity here: NSA is not dense attention; tests/nsa/test_triton.py checks every kernel against
the fp64 oracle. Out of memory is recorded as `skipped`.
"""

from __future__ import annotations

from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.prefill import NSA, PAPER, _dense_variant, _fa3_variant, _probe

DENSE = (Variant("sdpa_flash", "baseline", op="dense"), Variant("sdpa_cudnn", op="dense"),
         Variant("fa3", op="dense"))
SMALL = {"B": 1, "Hq": 8, "Hkv": 2, "Dk": 32, "Dv": 32, **NSA}
PAPER_192 = {**PAPER, "Dk": 192}
# Small GQA groups: G = 1 and G = 4 at D 128, where the group-centric kernels pad (results/h100/small-groups/).
G1 = {**PAPER, "Hq": 16, "Hkv": 16}
G4 = {**PAPER, "Hq": 32, "Hkv": 8}
SIZES = {
    "smoke": product(layout=(SMALL,), T=(300,), dtype=("bf16",)),
    # Nightly keeps the trend cases (ci/trends.py): the paper layout at 16k and 64k.
    "nightly": product(layout=(PAPER,), T=(16384, 65536), dtype=("bf16",)),
    "full": product(layout=(PAPER,), T=(8192, 16384, 32768, 65536, 131072), dtype=("bf16",))
    + product(layout=(G1, G4, PAPER_192), T=(16384, 65536), dtype=("bf16",)),
}
# The kernel-alone cells carry `part: sel` so their dense cases get ids of their own; paper layout
# only (nightly: 64k), the whole-NSA cells cover the other layouts.
SEL_SIZES = {size: tuple({**params, "part": "sel"} for params in grid
                         if params["Hq"] == PAPER["Hq"] and params["Dk"] == PAPER["Dk"]
                         and (size != "nightly" or params["T"] == 65536))
             for size, grid in SIZES.items()}
# The sliding branch on FlexAttention instead of FA-2 (the faster of the two on the H200's fa2
# sweep above 2k tokens); its own case id, so both whole-NSA timings sit in one cell.
FLEX_WIN = Variant("triton", "candidate", (("win", "flex"),))
# Every branch on the own Triton kernels, the sliding one included (its band kernel).
TRITON_WIN = Variant("triton", "candidate", (("win", "triton"),))
SPECS = (
    CaseSpec("nsa_prefill", (*DENSE, Variant("triton", "candidate"), FLEX_WIN, TRITON_WIN), SIZES),
    CaseSpec("selected", (*DENSE, Variant("triton", "candidate")), SEL_SIZES),
)


def default_win_backend(q, kv: dict[str, tuple[Any, Any]]) -> str:
    """FA-2 for the sliding branch where it can run (CUDA, fp16/bf16, dk == dv); on CUDA otherwise
    (the paper's dk=192 / dv=128) the own Triton band kernel, rather than masked SDPA's T x T mask;
    masked SDPA on a CPU."""
    import torch

    fa2_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == kv["win"][1].shape[-1]
    return "fa2" if fa2_ok else ("triton" if q.is_cuda else "sdpa")


def nsa_triton(q, kv: dict[str, tuple[Any, Any]], gates, p: dict[str, Any], win_backend: str | None = None):
    """NSA attention forward on the fast path -> `[B, T, Hq, Dv]` (projections excluded); the
    sliding branch on `win_backend` (default: FA-2 where it can run, else masked SDPA)."""

    from nsa import ops
    from nsa.backends import triton_nsa

    scale = q.shape[-1] ** -0.5
    kc, vc = ops.compress_kv(*kv["cmp"], block=p["block"], stride=p["stride"])
    win_backend = win_backend or default_win_backend(q, kv)

    def chain():
        return triton_nsa.compressed_select(q, kc, vc, block=p["block"], stride=p["stride"],
                                            sel_block=p["sel_block"], sel_count=p["sel_count"], scale=scale)

    def window():
        return ops.sliding_window_attention(q, *kv["win"], window=p["window"], backend=win_backend)

    def finish(o_win, cmp_idx):
        # The selection kernel's epilogue forms the gated sum.
        o_cmp, idx = cmp_idx
        return triton_nsa.selected_gated(q, *kv["sel"], idx, sel_block=p["sel_block"], scale=scale, gates=gates,
                                         o_cmp=o_cmp, o_win=o_win)

    if win_backend == "triton":   # as NSAAttention.attend: the Triton window beside the chain (Tiles.win_beside)
        return triton_nsa.beside(window, chain, finish, device=q.device, rows=q.shape[0] * q.shape[1])
    cmp_idx = chain()
    return finish(window(), cmp_idx)


def build(cell: Cell, device) -> Workload:
    import torch
    from torch.nn.attention import SDPBackend

    from bench import parity
    from nsa import backends, ops
    from nsa.backends import AttnCall

    p = cell.params
    dtype, gen = parity.dtype_of(p["dtype"]), parity.generator(device, 0)
    B, T, Hq, Hkv, Dk, Dv = (p[k] for k in ("B", "T", "Hq", "Hkv", "Dk", "Dv"))
    q = parity.randn((B, T, Hq, Dk), dtype, device, gen)
    kv = {n: (parity.randn((B, T, Hkv, Dk), dtype, device, gen), parity.randn((B, T, Hkv, Dv), dtype, device, gen))
          for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(parity.randn((B, T, Hq, 3), dtype, device, gen))
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    dense = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for v in cell.variants:
        if v.backend in dense:
            _dense_variant(work, v.key, q, *kv["sel"], dense[v.backend], device)
            continue
        if v.backend == "fa3":
            _fa3_variant(work, v.key, q, *kv["sel"], device)
            continue
        work.backends[v.key] = "triton"
        if cell.op == "nsa_prefill":
            win = dict(v.extra).get("win")
            if win == "flex":
                call = AttnCall("sliding", q, kv["win"][0], kv["win"][1], p["Dk"] ** -0.5, window=p["window"])
                reason = backends.unavailable_reason("flex", device) or backends.unsupported_reason("flex", call)
                if reason is not None:
                    work.reasons[v.key] = f"flex cannot run the sliding branch here: {reason}"
                    continue
            fn = lambda win=win: nsa_triton(q, kv, gates, p, win)  # noqa: E731
            work.extra[v.key] = {"branch_backends": {"cmp": "triton", "sel": "triton",
                                                     "win": win or default_win_backend(q, kv)}}
        else:
            kc, _ = ops.compress_kv(*kv["cmp"], block=p["block"], stride=p["stride"])
            idx = ops.select_blocks(q, kc, block=p["block"], stride=p["stride"], sel_block=p["sel_block"],
                                    sel_count=p["sel_count"]) if T <= 16384 else _fast_idx(q, kv, p)
            fn = lambda idx=idx: ops.selected_attention(  # noqa: E731
                q, *kv["sel"], idx, sel_block=p["sel_block"], backend="triton")
        _probe(work, v.key, fn, device, unsupported_ok=False)
    return work


def _fast_idx(q, kv, p):
    from nsa import ops
    from nsa.backends import triton_nsa

    kc, vc = ops.compress_kv(*kv["cmp"], block=p["block"], stride=p["stride"])
    return triton_nsa.compressed_select(q, kc, vc, block=p["block"], stride=p["stride"], sel_block=p["sel_block"],
                                        sel_count=p["sel_count"], scale=q.shape[-1] ** -0.5)[1]
