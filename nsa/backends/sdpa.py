"""Masked SDPA: `scaled_dot_product_attention` with explicit boolean masks, on every device.

This is the baseline the pipeline compares FA-2 against, so it does the real masked attention:
a `[Tq, Tk]` band (sliding), `[Tq, Tc]` staircase (compressed) or per-group block mask
(selected). Memory: the mask, `O(Tq * Tk)` bools (selected: `O(B * Hq * C * Tk)` per chunk of C
queries), plus whatever SDPA's chosen kernel allocates for a masked call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa.backends import AttnCall
from nsa.masks import compressed_mask, positions, selected_mask, sliding_mask

# Elements of one chunk's [B, Hq, C, Tk] selected mask.
CHUNK_ELEMENTS = 1 << 27


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    return None


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """`[B, Tq, Hq, Dk]`, `[B, Tk, Hkv, D*]`, bool mask broadcastable to `[B, Hq, Tq, Tk]`.

    Rows with no visible key return exactly 0: they are given key 0 (so no softmax of an empty
    set, which is NaN) and zeroed afterwards.
    """
    empty = ~mask.any(dim=-1, keepdim=True)                       # [..., Tq, 1]
    if k.shape[1] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    first = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    first[0] = True
    mask = mask | (empty & first)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2])
    out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2)


def sliding(call: AttnCall) -> Tensor:
    q_pos = positions(call.q_start, call.q.shape[1], call.q.device)
    k_pos = positions(call.k_start, call.k.shape[1], call.q.device)
    return masked_attention(call.q, call.k, call.v, sliding_mask(q_pos, k_pos, call.window), call.scale)


def compressed(call: AttnCall) -> Tensor:
    q_pos = positions(call.q_start, call.q.shape[1], call.q.device)
    mask = compressed_mask(q_pos, call.k.shape[1], call.block, call.stride)
    return masked_attention(call.q, call.k, call.v, mask, call.scale)


def selected(call: AttnCall) -> Tensor:
    q, k, v = call.q, call.k, call.v
    bsz, tq, hq, _ = q.shape
    group = hq // k.shape[2]
    k_pos = positions(call.k_start, k.shape[1], q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, bsz * hq * k.shape[1]))
    out = []
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        q_pos = positions(call.q_start + c0, c1 - c0, q.device)
        mask = selected_mask(call.block_indices[:, c0:c1], q_pos, k_pos, call.sel_block)
        mask = mask.repeat_interleave(group, dim=1)               # [B, Hq, C, Tk]
        out.append(masked_attention(q[:, c0:c1], k, v, mask, call.scale))
    return torch.cat(out, dim=1)
