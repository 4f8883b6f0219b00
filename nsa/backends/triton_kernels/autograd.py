"""The training kernels (train.py) as `torch.library` custom ops with autograd and fake tensors.

    nsa::band_attn(q, k, v, mode, window, block, stride, scale, q_start, k_start) -> (o, lse)
    nsa::selected_attn(q, k, v, idx, sel_block, scale, q_start, k_start) -> (o, lse)

and their backward ops, and, with no gradient,

    nsa::blocks_from_lse(q, k_cmp, v_cmp, lse2, block, stride, sel_block, sel_count, scale, q_start) -> idx

the top-n blocks from a compressed training forward's log-sum-exp (the scores kernel and top-n,
raw Triton launches that dynamo must not trace). Each forward saves its inputs, its output and the log-sum-exp `lse
[B, Hq, Tq]` (fp32) per row: that is what a layer keeps for the backward, besides the selected
indices `[B, T, Hkv, n]` (docs/nsa.md, "Training"). The fake (meta) implementations give shapes
only, so `torch.compile` traces a training step through the attention without a graph break,
and no op synchronises with the host, so a caller's CUDA graph can capture forward and backward.
`idx` carries no gradient (the top-n selection is discrete).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nsa.backends.triton_kernels import compressed as _cmp
from nsa.backends.triton_kernels import train
from nsa.backends.triton_kernels.tiles import current

WIN, CMP = train.WIN, train.CMP


def _lse_shape(q: Tensor) -> tuple[int, int, int]:
    return q.shape[0], q.shape[2], q.shape[1]


@torch.library.custom_op("nsa::band_attn", mutates_args=())
def band_attn(q: Tensor, k: Tensor, v: Tensor, mode: int, window: int, block: int, stride: int, scale: float,
              q_start: int, k_start: int) -> tuple[Tensor, Tensor]:
    return train.band_forward(q, k, v, mode=mode, window=window, block=block, stride=stride, scale=scale,
                              q_start=q_start, k_start=k_start, tiles=current(q.device))


@band_attn.register_fake
def _(q, k, v, mode, window, block, stride, scale, q_start, k_start):
    return (q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(_lse_shape(q), dtype=torch.float32))


@torch.library.custom_op("nsa::band_attn_bwd", mutates_args=())
def band_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, mode: int, window: int,
                  block: int, stride: int, scale: float, q_start: int,
                  k_start: int) -> tuple[Tensor, Tensor, Tensor]:
    return train.band_backward(do, q, k, v, o, lse, mode=mode, window=window, block=block, stride=stride,
                               scale=scale, q_start=q_start, k_start=k_start, tiles=current(q.device))


@band_attn_bwd.register_fake
def _(do, q, k, v, o, lse, mode, window, block, stride, scale, q_start, k_start):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _band_setup(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = args


def _band_backward(ctx, do: Tensor, _dlse: Tensor | None):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = band_attn_bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, *([None] * len(ctx.args))


band_attn.register_autograd(_band_backward, setup_context=_band_setup)


@torch.library.custom_op("nsa::selected_attn", mutates_args=())
def selected_attn(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, sel_block: int, scale: float, q_start: int,
                  k_start: int) -> tuple[Tensor, Tensor]:
    return train.selected_forward(q, k, v, idx, sel_block=sel_block, scale=scale, q_start=q_start,
                                  k_start=k_start, tiles=current(q.device))


@selected_attn.register_fake
def _(q, k, v, idx, sel_block, scale, q_start, k_start):
    return (q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(_lse_shape(q), dtype=torch.float32))


@torch.library.custom_op("nsa::selected_attn_bwd", mutates_args=())
def selected_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, o: Tensor, lse: Tensor,
                      sel_block: int, scale: float, q_start: int, k_start: int) -> tuple[Tensor, Tensor, Tensor]:
    return train.selected_backward(do, q, k, v, idx, o, lse, sel_block=sel_block, scale=scale, q_start=q_start,
                                   k_start=k_start, tiles=current(q.device))


@selected_attn_bwd.register_fake
def _(do, q, k, v, idx, o, lse, sel_block, scale, q_start, k_start):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _sel_setup(ctx, inputs, output) -> None:
    q, k, v, idx, *args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, idx, o, lse)
    ctx.args = args


def _sel_backward(ctx, do: Tensor, _dlse: Tensor | None):
    q, k, v, idx, o, lse = ctx.saved_tensors
    dq, dk, dv = selected_attn_bwd(do, q, k, v, idx, o, lse, *ctx.args)
    return dq, dk, dv, None, *([None] * len(ctx.args))


selected_attn.register_autograd(_sel_backward, setup_context=_sel_setup)


def sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float, q_start: int, k_start: int) -> Tensor:
    return band_attn(q, k, v, WIN, window, 0, 0, scale, q_start, k_start)[0]


def compressed(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, scale: float,
               q_start: int) -> Tensor:
    return band_attn(q, k_cmp, v_cmp, CMP, 0, block, stride, scale, q_start, 0)[0]


def selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float, q_start: int,
             k_start: int) -> Tensor:
    """`idx` rows must hold distinct blocks (triton_nsa.distinct_blocks)."""
    return selected_attn(q, k, v, idx.contiguous(), sel_block, scale, q_start, k_start)[0]


@torch.library.custom_op("nsa::blocks_from_lse", mutates_args=())
def blocks_from_lse(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, lse2: Tensor, block: int, stride: int, sel_block: int,
                    sel_count: int, scale: float, q_start: int) -> Tensor:
    """The top-n blocks `[B, Tq, Hkv, sel_count]` (int32) from the compressed training forward's
    log-sum-exp `lse2` (log2 units, as the training kernels keep it); where the scores kernel's block
    map does not apply, an inference compressed pass finds them (`compressed_select`)."""
    tiles = current(q.device)
    idx = _cmp.select_from_lse(q, k_cmp, lse2 * math.log(2), block=block, stride=stride, sel_block=sel_block,
                               sel_count=sel_count, scale=scale, q_start=q_start, tiles=tiles)
    if idx is None:
        _, idx = _cmp.compressed_select(q, k_cmp, v_cmp, block=block, stride=stride, sel_block=sel_block,
                                        sel_count=sel_count, scale=scale, q_start=q_start, tiles=tiles)
    return idx


@blocks_from_lse.register_fake
def _(q, k_cmp, v_cmp, lse2, block, stride, sel_block, sel_count, scale, q_start):
    return q.new_empty(q.shape[0], q.shape[1], k_cmp.shape[2], sel_count, dtype=torch.int32)
