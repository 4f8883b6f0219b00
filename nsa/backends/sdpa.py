"""Masked SDPA: `scaled_dot_product_attention` with explicit boolean masks, on every device.

The correctness reference among the fast backends and the fallback wherever they do not apply
(CPU, an untuned GPU, a head dim a kernel cannot take), so it must also survive long sequences.
Each branch has two regimes, chosen by element counts (`use_full_mask`):

- Short (`Tq * Tk <= FULL_MASK_ELEMENTS`, 2**24: T <= 4096 for sliding and selected; compressed
  with l=32, d=16 up to T ~ 16k): one SDPA call over a whole-sequence mask, `[Tq, Tk]` band
  (sliding) or `[Tq, Tc]` staircase (compressed), built once per shape and cached; selected:
  `[B, Hq, C, Tk]` block masks per chunk of C queries, while also `Tk <= SELECTED_MASK_SPAN *
  n * l'`. One call is the fastest form here, and the cached mask costs at most 16 MiB.
- Long: chunks of C queries that read only what they can see.

      sliding     chunk [c0, c1) reads keys [c0 - w + 1, c1): mask C x (C + w - 1);
                  time and memory O(Tq * (C + w)), C ~ w (`sliding_chunk`)
      compressed  chunk reads compressed keys [0, n_cmp(c1 - 1)): mask C x Tc; O(Tq * Tc)
      selected    each (query, KV group) gathers the n * l' tokens of its blocks and attends
                  over them; O(Tq * Hkv * n * l' * (dk + dv)), nothing of size Tk per query

Memory: short path, the mask (`O(Tq * Tk)` bools; selected `O(B * Hq * C * Tk)` per chunk) plus
whatever SDPA's kernel allocates for a masked call; long path, at most about CHUNK_ELEMENTS
elements per chunk (scores, gathered keys/values, indices), plus the `[B, Tq, Hq, Dv]` output.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa.backends import OPS, AttnCall, caps, shape_cached
from nsa.masks import compressed_mask, n_compressed, positions, selected_mask, selected_tokens, sliding_mask

# Largest whole-sequence mask (Tq * Tk elements) the short path builds; above it, query chunks.
# 2**24 = 4096 x 4096: the band at T = 4k is one 16 MiB mask and one call, while at T >= 8k a
# T x T mask (64 MiB and up, plus a T x T SDPA) would dominate what the chunks read.
FULL_MASK_ELEMENTS = 1 << 24
# Elements one chunk may hold: its SDPA scores (the math kernel materialises them), its mask,
# and for the selected branch its gathered keys/values and their indices. 2**26 = 8192**2, so
# from T = 8k on no chunk-bounded tensor reaches T x T elements, whatever the heads and dims
# (128 MiB in bf16 per tensor: large enough that launches do not dominate at 128k).
CHUNK_ELEMENTS = 1 << 26
# Fewest queries per sliding chunk: with a tiny window a chunk of w queries would mean T/w calls.
MIN_SLIDING_CHUNK = 128
# The selected short path reads every key for every query, the gathered one n * l' per query but
# each through an index gather; masking stays while Tk <= SELECTED_MASK_SPAN * n * l' (paper
# n * l' = 1024: prefill to 4k, and decode steps to t = 4k, which otherwise would read all t keys).
# A guess from the byte counts, not yet tuned on a GPU.
SELECTED_MASK_SPAN = 4
# The gathered selected path batches (batch, chunk query) pairs; CUDA's memory-efficient SDPA
# launches one grid row per batch entry and fails past 2**16 - 1 in some torch versions
# (pytorch/pytorch#146704), which tiny heads and dims could otherwise reach.
MAX_SDPA_BATCH = (1 << 16) - 1


# Masked SDPA and its gathers are plain torch ops: autograd differentiates every op.
CAPABILITIES = caps(backward=OPS)

def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    return None


def use_full_mask(tq: int, tk: int) -> bool:
    """The short path: a `[Tq, Tk]` mask (Tk = raw keys, or Tc compressed ones) is small enough."""
    return tq * tk <= FULL_MASK_ELEMENTS


def sliding_chunk(bsz: int, hq: int, tq: int, window: int) -> int:
    """Queries per chunk of the long sliding path.

    About w: the key span `C + w - 1` then stays under 2w, so at least half the pairs a chunk
    reads are visible; at least MIN_SLIDING_CHUNK; and `B * Hq * C * (C + w - 1)` within
    CHUNK_ELEMENTS (the largest such C, from the quadratic).
    """
    budget = max(1, CHUNK_ELEMENTS // max(1, bsz * hq))
    span = window - 1
    fits = (math.isqrt(span * span + 4 * budget) - span) // 2
    return max(1, min(fits, max(MIN_SLIDING_CHUNK, window), tq))


def compressed_chunk(bsz: int, hq: int, tq: int, tc: int) -> int:
    """Queries per chunk of the long compressed path: `B * Hq * C * Tc <= CHUNK_ELEMENTS`."""
    return max(1, min(tq, CHUNK_ELEMENTS // max(1, bsz * hq * tc)))


def selected_chunk(bsz: int, hq: int, hkv: int, tq: int, n_tokens: int, dk: int, dv: int) -> int:
    """Queries per chunk of the gathered selected path.

    Per query: `Hkv * n * l'` gathered keys and values (`dk + dv` each) and about four index or
    flag tensors of that many entries, and `Hq * n * l'` scores/mask; the chunk keeps the sum
    within CHUNK_ELEMENTS, and `B * C` within MAX_SDPA_BATCH.
    """
    per_query = bsz * n_tokens * (hkv * (dk + dv + 4) + hq)
    return max(1, min(tq, CHUNK_ELEMENTS // max(1, per_query), MAX_SDPA_BATCH // bsz))


def fix_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """Give rows with no visible key key 0 (a softmax over nothing is NaN); return the rows to zero.

    Done whether or not a row is empty: asking first would read a flag back from the GPU, a host
    synchronisation per call that also keeps the call out of a CUDA graph (nsa.graphs)."""
    if mask.shape[-1] == 0:
        return mask, None
    empty = ~mask.any(dim=-1, keepdim=True)                       # [..., Tq, 1]
    first = torch.arange(mask.shape[-1], device=mask.device) == 0   # no host-to-device write
    return mask | (empty & first), empty


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                     fixed: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
    """`[B, Tq, Hq, Dk]`, `[B, Tk, Hkv, D*]`, bool mask broadcastable to `[B, Hq, Tq, Tk]`.

    Rows with no visible key return exactly 0. `fixed` is `fix_empty_rows(mask)` when the caller
    has it already (cached masks), so the per-call cost is SDPA's alone.
    """
    if k.shape[1] == 0:
        # No key (a compressed branch before its first complete block): exactly 0, from products
        # over the empty key axis, so an output that must carry gradients does (a fresh zeros
        # tensor was cut from autograd: training on a sequence shorter than l raised).
        group = q.shape[2] // k.shape[2]
        kk, vv = (x.transpose(1, 2).repeat_interleave(group, dim=1) for x in (k, v))
        return (q.transpose(1, 2) @ kk.transpose(-1, -2) @ vv).transpose(1, 2)
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
    """`[B, Tq, Hq, Dk]` queries at `q_start ..` over keys `[B, Tk, Hkv, D*]` at `k_start ..` ->
    `[B, Tq, Hq, Dv]`; query t reads keys `t - w < s <= t`. Memory: `O(Tq * Tk)` mask when
    `use_full_mask`, else `O(B * Hq * C * (C + w))` per chunk (see `sliding_chunk`)."""
    q, k, v, w = call.q, call.k, call.v, call.window
    tq, tk = q.shape[1], k.shape[1]
    dev = str(q.device)
    if use_full_mask(tq, tk):
        fixed = shape_cached(_static_mask, "sliding", call.q_start, call.k_start, w, 0, tq, tk, dev)
        return masked_attention(q, k, v, fixed[0], call.scale, fixed)
    c = sliding_chunk(q.shape[0], q.shape[2], tq, w)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    inner: tuple[Tensor, Tensor | None] | None = None
    for c0 in range(0, tq, c):
        c1 = min(tq, c0 + c)
        lo = call.q_start + c0 - w + 1 - call.k_start            # key indices the chunk may see
        hi = call.q_start + c1 - call.k_start
        lo_in, hi_in = max(0, lo), min(tk, hi)
        if hi_in <= lo_in:
            continue                                             # nothing visible: stays 0
        if (lo_in, hi_in, c1 - c0) == (lo, hi, c):
            # A full chunk whose whole key span exists: the same relative band every time (query
            # i reads keys i .. i + w - 1 of the span), and each query sees itself, so no empty row.
            if inner is None:
                inner = shape_cached(_static_mask, "sliding", w - 1, 0, w, 0, c, c + w - 1, dev)
            fixed = inner
        else:
            q_pos = positions(call.q_start + c0, c1 - c0, dev)
            fixed = fix_empty_rows(sliding_mask(q_pos, positions(call.k_start + lo_in, hi_in - lo_in, dev), w))
        out[:, c0:c1] = masked_attention(q[:, c0:c1], k[:, lo_in:hi_in], v[:, lo_in:hi_in], fixed[0],
                                         call.scale, fixed)
    return out


def compressed(call: AttnCall) -> Tensor:
    """`[B, Tq, Hq, Dk]` queries at `q_start ..` over compressed keys `[B, Tc, Hkv, D*]` ->
    `[B, Tq, Hq, Dv]`; token i visible to t iff `i*d + l - 1 <= t`, none visible gives 0.
    Memory: `O(Tq * Tc)` mask when `use_full_mask`, else `O(B * Hq * C * Tc)` per chunk."""
    q, k, v, blk, d = call.q, call.k, call.v, call.block, call.stride
    tq, tc = q.shape[1], k.shape[1]
    dev = str(q.device)
    if use_full_mask(tq, tc):
        fixed = shape_cached(_static_mask, "compressed", call.q_start, 0, blk, d, tq, tc, dev)
        return masked_attention(q, k, v, fixed[0], call.scale, fixed)
    c = compressed_chunk(q.shape[0], q.shape[2], tq, tc)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    for c0 in range(0, tq, c):
        c1 = min(tq, c0 + c)
        m = min(tc, n_compressed(call.q_start + c1, blk, d))    # n_cmp of the chunk's last query
        if m == 0:
            continue                                             # nothing visible: stays 0
        mask = compressed_mask(positions(call.q_start + c0, c1 - c0, dev), m, blk, d)
        # Only a chunk whose first query precedes position l - 1 has empty rows: decided on ints,
        # so the other chunks skip fix_empty_rows' pass over the mask.
        fixed = fix_empty_rows(mask) if n_compressed(call.q_start + c0 + 1, blk, d) == 0 else (mask, None)
        out[:, c0:c1] = masked_attention(q[:, c0:c1], k[:, :m], v[:, :m], mask, call.scale, fixed)
    return out


def selected(call: AttnCall) -> Tensor:
    """`[B, Tq, Hq, Dk]` queries over raw keys `[B, Tk, Hkv, D*]` and `block_indices [B, Tq, Hkv, n]`
    -> `[B, Tq, Hq, Dv]`: query t reads the tokens `<= t` of its group's selected blocks.
    Memory: `O(B * Hq * C * Tk)` mask per chunk on the short path, else gathered
    `O(B * C * Hkv * n * l' * (dk + dv))` per chunk (see `selected_chunk`)."""
    n_tok = call.block_indices.shape[-1] * call.sel_block
    tk = call.k.shape[1]
    if not use_full_mask(call.q.shape[1], tk) or tk > SELECTED_MASK_SPAN * n_tok:
        return _selected_gathered(call)
    q, k, v = call.q, call.k, call.v
    bsz, tq, hq, _ = q.shape
    group = hq // k.shape[2]
    k_pos = positions(call.k_start, k.shape[1], q.device)
    n_blocks = (call.k_start + k.shape[1] - 1) // call.sel_block + 1 if k.shape[1] else 1
    chunk = max(1, CHUNK_ELEMENTS // max(1, bsz * hq * k.shape[1]))
    out = []
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        q_pos = positions(call.q_start + c0, c1 - c0, q.device)
        mask = selected_mask(call.block_indices[:, c0:c1], q_pos, k_pos, call.sel_block, n_blocks)
        mask = mask.repeat_interleave(group, dim=1)               # [B, Hq, C, Tk]
        out.append(masked_attention(q[:, c0:c1], k, v, mask, call.scale))
    return torch.cat(out, dim=1)


def _selected_gathered(call: AttnCall) -> Tensor:
    """The long selected path: per chunk, gather each (query, KV group)'s `n * l'` block tokens
    (`nsa.masks.selected_tokens`) and run SDPA with (chunk query, group) as the batch and the
    group's query heads as the query length, so no key outside the selected blocks is read."""
    q, k, v = call.q, call.k, call.v
    bsz, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    n_tok = call.block_indices.shape[-1] * call.sel_block
    out = q.new_zeros(bsz, tq, hq, dv)
    if tk == 0:
        return out
    c = selected_chunk(bsz, hq, hkv, tq, n_tok, dk, dv)
    b_idx = torch.arange(bsz, device=q.device)[:, None, None, None]
    h_idx = torch.arange(hkv, device=q.device)[None, None, :, None]
    first = torch.arange(n_tok, device=q.device) == 0
    for c0 in range(0, tq, c):
        c1 = min(tq, c0 + c)
        rows = bsz * (c1 - c0)
        q_pos = positions(call.q_start + c0, c1 - c0, q.device)
        key, visible = selected_tokens(call.block_indices[:, c0:c1], q_pos, call.sel_block, call.k_start, tk)
        kg = k[b_idx, key, h_idx]                                 # [B, C, Hkv, n*l', dk]
        vg = v[b_idx, key, h_idx]                                 # [B, C, Hkv, n*l', dv]
        # A row with nothing visible (all slots -1, or its blocks not in a decode cache) attends
        # gathered token 0 and is zeroed after: a softmax over nothing is NaN. Done for every row
        # on the small [B, C, Hkv, n*l'] flags, so there is no device sync per chunk.
        empty = ~visible.any(-1, keepdim=True)                    # [B, C, Hkv, 1]
        mask = (visible | (empty & first)).reshape(rows, hkv, 1, n_tok)
        o = F.scaled_dot_product_attention(
            q[:, c0:c1].reshape(rows, hkv, group, dk), kg.reshape(rows, hkv, n_tok, dk),
            vg.reshape(rows, hkv, n_tok, dv), attn_mask=mask, scale=call.scale)   # [B*C, Hkv, G, dv]
        o = o.masked_fill(empty.reshape(rows, hkv, 1, 1), 0.0)
        out[:, c0:c1] = o.reshape(bsz, c1 - c0, hq, dv)
    return out
