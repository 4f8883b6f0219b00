"""Masked SDPA: `scaled_dot_product_attention` with explicit boolean masks, on every device.

This is the baseline the pipeline compares FA-2 against, so it does the real masked attention:
a `[Tq, Tk]` band (sliding), `[Tq, Tc]` staircase (compressed) or per-group block mask
(selected). Memory: the mask, `O(Tq * Tk)` bools (selected: `O(B * Hq * C * Tk)` per chunk of C
queries), plus whatever SDPA's chosen kernel allocates for a masked call.
"""

from __future__ import annotations

import functools

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


def fix_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """Give rows with no visible key key 0 (a softmax over nothing is NaN); return the rows to zero."""
    empty = ~mask.any(dim=-1, keepdim=True)                       # [..., Tq, 1]
    if mask.shape[-1] == 0 or not bool(empty.any()):
        return mask, None
    first = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    first[0] = True
    return mask | (empty & first), empty


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                     fixed: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
    """`[B, Tq, Hq, Dk]`, `[B, Tk, Hkv, D*]`, bool mask broadcastable to `[B, Hq, Tq, Tk]`.

    Rows with no visible key return exactly 0. `fixed` is `fix_empty_rows(mask)` when the caller
    has it already (cached masks), so the per-call cost is SDPA's alone.
    """
    if k.shape[1] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    mask, empty = fixed if fixed is not None else fix_empty_rows(mask)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2])
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _static_mask(kind: str, q0: int, k0: int, a: int, b: int, tq: int, tk: int,
                 device: str) -> tuple[Tensor, Tensor | None]:
    """Band / staircase masks depend on shapes only: built once per shape, as a model reusing them
    across layers would, so timings measure attention rather than mask construction."""
    q_pos = positions(q0, tq, device)
    if kind == "sliding":
        return fix_empty_rows(sliding_mask(q_pos, positions(k0, tk, device), a))
    return fix_empty_rows(compressed_mask(q_pos, tk, a, b))


def sliding(call: AttnCall) -> Tensor:
    fixed = _static_mask("sliding", call.q_start, call.k_start, call.window, 0, call.q.shape[1], call.k.shape[1],
                         str(call.q.device))
    return masked_attention(call.q, call.k, call.v, fixed[0], call.scale, fixed)


def compressed(call: AttnCall) -> Tensor:
    fixed = _static_mask("compressed", call.q_start, 0, call.block, call.stride, call.q.shape[1], call.k.shape[1],
                         str(call.q.device))
    return masked_attention(call.q, call.k, call.v, fixed[0], call.scale, fixed)


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
