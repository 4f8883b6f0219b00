"""Prefill compressed attention through FlashAttention-3 where the `fa3-fwd` wheel is installed:
the output and each row's log-sum-exp, which the scores kernel (scores.py) then reads.

Queries `t = l - 1 + d*u + r` (`0 <= r < d`) all see compressed tokens `0 .. u` and no more
(token i ends at `i*d + l - 1`). So the `d` queries of step u are `d` rows of one "packed" query
with `d * Hq` heads: for a contiguous `q [B, T, Hq, dk]` the slice from `l - 1` viewed as
`[B, U, d*Hq, dk]` is that packing with no copy, head `r*Hq + h` being query `l-1+d*u+r`, head h.
Causal attention of U packed queries over the first U compressed tokens (FA-3's causal mask
with equal lengths: u sees `0 .. u`) is then the compressed branch. GQA: FA-3 maps head `qh` to
KV head `qh // (d*Hq / Hkv')`; with the compressed keys tiled d times along heads
(`Hkv' = d*Hkv`, KV head `r*Hkv + hk`), head `r*Hq + hk*G + g` maps to `r*Hkv + hk`, i.e. to
`hk`, as it should. The output lands in `o`'s own slice (the same view); FA-3's log-sum-exp
`[B, d*Hq, U]` is re-ordered into `lse [B, Hq, T]`. Queries before `l - 1` see nothing (zero
output, `lse = +inf`); the last `< d` queries, a partial step, go to the Triton kernel.

G = 1 needs no tiled keys: per sequence, each KV head is one FA-3 batch entry whose d "heads"
are the step offsets r, all over that one KV head (GQA d:1). For head h the query of step u,
offset r sits at `q[b, l-1+d*u+r, h]`, so `[Hq, U, d, dk]` with strides (dk, d*Hq*dk, Hq*dk, 1)
is again a view of `q` (and of the output); the keys are `k_cmp[b]` viewed as `[Hkv, U, 1, dk]`.
(With G > 1 the heads of one group and the step offsets would form a 2-D head index no single
stride reaches, hence the tiling there.)

Where it runs: CUDA where the GPU profile has the `fa3` feature (sm90), bf16 (the wheel's build), head dims it has, `q_start == 0` (prefill),
`Tiles.cmp_fa3`, GQA groups of at least `Tiles.cmp_fa3_min_group` heads or, with
`Tiles.cmp_fa3_g1`, G = 1, and `B * Hq * T**2` at least `Tiles.cmp_fa3_min_work` (smaller
prefills are bound by the host, where this call's ~0.4-0.8 ms of Python and extra launches cost
more than FA-3 saves); else the caller runs its own kernel. Measured on the H100, whole
forward (results/h100/fa3-cmp, results/h100/fa3-g1): 64/4 heads at 64k 38.5 -> 35.7 ms, 128k
113.7 -> 103.3 ms, 32/8 at 64k 36.9 -> 36.5 ms; 16/16 with tiled keys 30.1 -> 30.8 ms (the d
copies of every KV head's compressed keys cost more than FA-3 saved), with the batch view
22.7 -> 21.7 ms at 64k (the pass 2.48 -> 1.50 ms) and 3.88 -> 3.90 ms at 16k.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from nsa import profiles

MODULE = profiles.WHEELS["fa3"]
# Devices and dtypes its kernels take (the wheel is built for bf16 only). CPU tests add "cpu" and
# fp32 to drive a pure-torch double: Triton's interpreter does not compute bf16 dots correctly.
DEVICES = ("cuda",)
DTYPES = (torch.bfloat16,)
_DIMS = {(d, d) for d in (64, 96, 128, 192, 256)} | {(192, 128)}


def load() -> ModuleType | None:
    """The wheel's interface module, or None where it is not installed or cannot load."""
    try:
        return importlib.import_module(MODULE)
    except (ImportError, OSError):
        return None


def enabled(device: torch.device) -> bool:
    """The device's GPU profile has the `fa3` feature (sm90 only: the wheel's FA-3 kernels are
    Hopper's, its sm8x build FA-2-like, and the trade was measured only there); other CUDA GPUs
    keep the Triton kernel. Non-CUDA devices (the tests' double) pass."""
    return device.type != "cuda" or profiles.profile_for(device).features.fa3


def usable(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, q_start: int) -> bool:
    """FA-3 can take this prefill's compressed branch (the module doc's conditions) and at least
    one whole step of `stride` queries exists."""
    tq, hq, dk = q.shape[1], q.shape[2], q.shape[3]
    return (q.device.type in DEVICES and q.dtype in DTYPES and (dk, v_cmp.shape[-1]) in _DIMS
            and q_start == 0 and block >= stride and (tq - (block - 1)) // stride >= 1
            and q.stride(-1) == 1 and q.stride(2) == dk and q.stride(1) == hq * dk and enabled(q.device)
            and load() is not None)


def _forward_into(fa3: ModuleType, q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal FA-3 forward writing `out` (a strided view), -> (out, lse `[B, H, Tq]`): the wheel's
    registered op `torch.ops.fa3_fwd.fwd` (the interface module's `fa3_fwd_cuda`), called with
    the positional arguments `_flash_attn_forward` passes it, since that Python wrapper is a
    custom op that refuses an output aliasing an argument."""
    args = (q, k, v, None, None, None, out, *([None] * 16), scale, True, -1, -1, 0, 0.0, True, None, 1, None, 0)
    res = fa3.fa3_fwd_cuda.fwd(*args)
    return res[0], res[1]


def output_and_lse(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor, *, block: int, stride: int,
                   scale: float, tail: Callable[[int], None]) -> None:
    """Fill `o [B, T, Hq, dv]` (contiguous) and `lse [B, Hq, T]` (fp32, natural log) for the
    queries of whole steps, zeros / +inf for those that see nothing; `tail(start)` computes the
    queries from `start` on (a partial step, fewer than `stride`; not called when none)."""
    fa3 = load()
    b, tq, hq, dk = q.shape
    hkv, dv = k_cmp.shape[2], v_cmp.shape[-1]
    first = block - 1
    steps = (tq - first) // stride
    end = first + steps * stride
    if hq == hkv:
        # G = 1: per sequence, KV head h as FA-3's batch and the d step offsets as its heads, all
        # over one KV head (GQA d:1): q viewed as [Hq, U, d, dk] (strides dk, d*Hq*dk, Hq*dk, 1),
        # keys as [Hkv, U, 1, dk]; no tiled keys. lse [Hq, d, U] -> lse[b, h, first + d*u + r].
        for i in range(b):
            qb = q[i, first:end].unflatten(0, (steps, stride)).permute(2, 0, 1, 3)
            ob = o[i, first:end].unflatten(0, (steps, stride)).permute(2, 0, 1, 3)
            kb = k_cmp[i, :steps].permute(1, 0, 2).unsqueeze(2)
            vb = v_cmp[i, :steps].permute(1, 0, 2).unsqueeze(2)
            out, lse_b = _forward_into(fa3, qb, kb, vb, ob, scale)
            if out.data_ptr() != ob.data_ptr():   # a build that ignores `out`
                ob.copy_(out)
            lse[i, :, first:end].copy_(lse_b.permute(0, 2, 1).reshape(hq, steps * stride))
    else:
        qp = q[:, first:end].view(b, steps, stride * hq, dk)
        op = o[:, first:end].view(b, steps, stride * hq, dv)
        kp = k_cmp[:, :steps].repeat(1, 1, stride, 1)
        vp = v_cmp[:, :steps].repeat(1, 1, stride, 1)
        out, lse_p = _forward_into(fa3, qp, kp, vp, op, scale)
        if out.data_ptr() != op.data_ptr():   # a build that ignores `out`
            op.copy_(out)
        # [B, d*Hq, U] (head r*Hq + h, step u) -> lse[b, h, first + d*u + r]
        lse[:, :, first:end].copy_(lse_p.view(b, stride, hq, steps).permute(0, 2, 3, 1).reshape(b, hq, steps * stride))
    o[:, :first].zero_()
    lse[:, :, :first].fill_(float("inf"))
    if end < tq:
        tail(end)
