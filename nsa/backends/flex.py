"""FlexAttention with block masks for all three branches (`[B, H, T, D]` inside, transposed here).

On CUDA the call is `torch.compile`d (FlexAttention's fast path); on CPU it runs eagerly, which
materialises the scores (tests only). Memory on CUDA: the block mask, `O(Tq/128 * Tk/128)` per
(batch, head) entry it varies over, plus the selected branch's `[B, Hkv, Tq, Nb]` block table.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from nsa import profiles
from nsa.backends import OPS, AttnCall, caps, shape_cached
from nsa.masks import cmp_visible_count, positions, selected_block_onehot

# flex_attention has its own backward (compiled on CUDA); masks are built from shapes and indices.
CAPABILITIES = caps(backward=OPS)

def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:
        return f"FlexAttention needs torch >= 2.5 ({exc})"
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    if call.grad and call.q.device.type != "cuda":
        # torch raises NotImplementedError there ("FlexAttention does not support backward on CPU").
        return "FlexAttention has no backward on CPU; call it under torch.no_grad() or use the sdpa backend"
    if call.q.device.type == "cuda" and call.q.dtype == torch.float64:
        return "FlexAttention's compiled kernel does not support fp64"
    dk, dv = call.q.shape[-1], call.v.shape[-1]
    if call.q.device.type == "cuda" and min(dk, dv) < 16:
        return f"FlexAttention's compiled kernel needs head dims >= 16, got {dk}/{dv}"
    if call.q.device.type == "cuda" and dk != dv:
        # Seen on an H100 (sliding and compressed, dk 32 / dv 16): the compiled kernel fails inside
        # torch.compile with a dynamo traceback instead of an error naming the head dims.
        return f"FlexAttention's compiled kernel needs equal q/k and v head dims, got dk {dk} != dv {dv}"
    limit = profiles.profile_for(call.q.device).features.flex_max_head_dim if call.q.device.type == "cuda" else 0
    if limit and max(dk, dv) > limit:
        # A per-GPU limit (shared memory): the GPU profile's flex_max_head_dim (nsa/profiles/).
        return f"FlexAttention's compiled kernel is limited to head dims <= {limit} on this GPU, got {dk}/{dv}"
    return None


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention
    # One compiled kernel per shape (dynamic=False is FlexAttention's fast path); dynamo's default
    # limit of 8 recompiles would silently drop later shapes of a sweep to the unfused eager path.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _static_block_mask(kind: str, q0: int, k0: int, a: int, b: int, tq: int, tk: int, device: str):
    """Block masks of the data-independent branches, built once per shape (as a model would)."""
    from torch.nn.attention.flex_attention import create_block_mask
    if kind == "sliding":
        def mask_mod(bi, h, qi, ki):
            diff = (qi + q0) - (ki + k0)
            return (diff >= 0) & (diff < a)
    else:
        def mask_mod(bi, h, qi, ki):
            return ki * b + a - 1 <= qi + q0
    return create_block_mask(mask_mod, None, None, tq, tk, device=device)


def _attend(call: AttnCall, mask_mod, b: int | None, h: int | None, block_mask=None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    q, k, v = (x.transpose(1, 2) for x in (call.q, call.k, call.v))
    if block_mask is None:
        block_mask = create_block_mask(mask_mod, b, h, q.shape[2], k.shape[2], device=q.device)
    fn = _compiled() if q.device.type == "cuda" else flex_attention
    out = fn(q, k, v, block_mask=block_mask, scale=call.scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def sliding(call: AttnCall) -> Tensor:
    bm = shape_cached(_static_block_mask, "sliding", call.q_start, call.k_start, call.window, 0, call.q.shape[1],
                      call.k.shape[1], str(call.q.device))
    return _attend(call, None, None, None, bm)


def compressed(call: AttnCall) -> Tensor:
    q0, block, stride = call.q_start, call.block, call.stride
    if call.k.shape[1] == 0:
        return call.q.new_zeros(*call.q.shape[:3], call.v.shape[-1])

    bm = shape_cached(_static_block_mask, "compressed", q0, 0, block, stride, call.q.shape[1], call.k.shape[1],
                      str(call.q.device))
    out = _attend(call, None, None, None, bm)
    empty = cmp_visible_count(positions(q0, call.q.shape[1], call.q.device), block, stride) == 0
    return out.masked_fill(empty[None, :, None, None], 0.0)


def selected(call: AttnCall) -> Tensor:
    q0, k0, ls = call.q_start, call.k_start, call.sel_block
    bsz, _, hq, _ = call.q.shape
    group = hq // call.k.shape[2]
    n_blocks = (k0 + call.k.shape[1] - 1) // ls + 1
    table = selected_block_onehot(call.block_indices, n_blocks).permute(0, 2, 1, 3).contiguous()  # [B,Hkv,Tq,Nb]

    def mask_mod(b, h, qi, ki):
        kp = ki + k0
        return table[b, h // group, qi, kp // ls] & (kp <= qi + q0)

    return _attend(call, mask_mod, bsz, hq)
