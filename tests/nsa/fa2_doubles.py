"""Pure-torch doubles of the FA-2 entry points our adapters call, for CPU contract tests.

Same signatures and `[B, T, H, D]` layout as flash-attn's `flash_attn_func` /
`flash_attn_with_kvcache` and as `aten._flash_attention_forward` (batched or varlen with
`seqused_k`), same window and bottom-right causal semantics. They check the argument contract
(dtypes of index tensors, head divisibility, shapes) as strictly as the real kernels do, so an
adapter that hands over `[B, H, T, D]` or the wrong offsets fails here, on every push.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: tuple[int, int]) -> Tensor:
    """q `[Tq, H, D]`, k/v `[Tk, Hkv, D]` of one sequence; FA-2 masking (bottom-right aligned)."""
    tq, h, _ = q.shape
    tk, hkv, _ = k.shape
    assert h % hkv == 0, f"FA-2: number of heads {h} must be divisible by KV heads {hkv}"
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qi = torch.arange(tq)[:, None] + (tk - tq)      # bottom-right alignment
    ki = torch.arange(tk)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        allowed &= ki >= qi - left
    if right >= 0:
        allowed &= ki <= qi + right
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, -1))
    return torch.einsum("hqk,khd->qhd", p, v.double()).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    assert q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0] and k.shape == v.shape[:3] + (v.shape[3],)
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FA-2: q, k, v must share the head dim"
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.stack([_attend(q[b], k[b], v[b], scale, causal, tuple(window_size)) for b in range(q.shape[0])])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    assert k is None and v is None, "the adapter must not append to the cache"
    assert cache_seqlens is not None and cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    if cache_batch_idx is not None:
        assert cache_batch_idx.dtype == torch.int32 and cache_batch_idx.shape == (q.shape[0],)
    assert q.shape[-1] == k_cache.shape[-1] == v_cache.shape[-1], "FA-2: q, k, v must share the head dim"
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = []
    for i in range(q.shape[0]):
        src = int(cache_batch_idx[i]) if cache_batch_idx is not None else i
        n = int(cache_seqlens[i])
        assert 0 <= n <= k_cache.shape[1]
        out.append(_attend(q[i], k_cache[src, :n], v_cache[src, :n], scale, causal, tuple(window_size)))
    return torch.stack(out)


def fake_flash_attn_module() -> types.ModuleType:
    mod = types.ModuleType("flash_attn")
    mod.__version__ = "2.7.0-double"
    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return mod


def aten_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                                 scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                                 alibi_slopes=None):
    """Double of `torch.ops.aten._flash_attention_forward` (returns a 1-tuple: output first)."""
    window = (-1 if window_size_left is None else window_size_left,
              -1 if window_size_right is None else window_size_right)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_q is None:
        assert q.dim() == 4 and q.shape[1] == max_q and k.shape[1] == max_k
        return (torch.stack([_attend(q[b], k[b], v[b], scale, is_causal, window) for b in range(q.shape[0])]),)
    assert q.dim() == 3 and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    for i in range(cu_q.numel() - 1):
        q0, q1 = int(cu_q[i]), int(cu_q[i + 1])
        k0 = int(cu_k[i])
        n = int(seqused_k[i]) if seqused_k is not None else int(cu_k[i + 1]) - k0
        assert q1 - q0 <= max_q and n <= max_k
        out[q0:q1] = _attend(q[q0:q1], k[k0:k0 + n], v[k0:k0 + n], scale, is_causal, window)
    return (out,)
