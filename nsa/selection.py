"""Block selection (paper Eq. 9-12): compressed-attention scores -> top-n blocks per KV group."""

from __future__ import annotations

import torch
from torch import Tensor

from nsa.masks import compressed_mask

# Elements of one chunk's [B, Hq, C, Tc] score tensor; bounds prefill memory (see select_topn).
CHUNK_ELEMENTS = 1 << 26


def overlap_weights(n_cmp: int, n_blocks: int, block: int, stride: int, sel_block: int,
                    device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """`[Tc, Nb]`: tokens shared by compressed block i `[i*d, i*d+l)` and selection block j."""
    start = torch.arange(n_cmp, device=device)[:, None] * stride
    lo = torch.arange(n_blocks, device=device)[None, :] * sel_block
    overlap = torch.minimum(start + block, lo + sel_block) - torch.maximum(start, lo)
    return overlap.clamp_min(0).to(dtype)


def overlap_bands(n_cmp: int, n_blocks: int, block: int, stride: int, sel_block: int,
                  device: torch.device | str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The nonzero band of `overlap_weights`, by selection block: `[Nb, K]` compressed-token
    indices (ascending, clamped into range) and `[Nb, K]` shared-token weights (0 on padding).

    Block j `[j*l', (j+1)*l')` meets compressed tokens `i` with `j*l' - l < i*d < (j+1)*l'`, at
    most `K = (l + l') // d + 1` of them, so mapping a row of scores costs `O(Nb * K) ~ O(Tc)`
    instead of the dense `[Tc, Nb]` product's `O(Tc * Nb)` (cubic in T over a prefill: at 128k
    with the paper's shapes it was ~3e14 flops, most of the torch selection's time).
    """
    k = (block + sel_block) // stride + 1
    lo = torch.arange(n_blocks, device=device) * sel_block                     # [Nb]
    first = (torch.div(lo - block, stride, rounding_mode="floor") + 1).clamp_min(0)
    idx = first[:, None] + torch.arange(k, device=device)                     # [Nb, K]
    start = idx * stride
    overlap = torch.minimum(start + block, lo[:, None] + sel_block) - torch.maximum(start, lo[:, None])
    overlap = torch.where(idx < n_cmp, overlap.clamp_min(0), torch.zeros_like(overlap))
    return idx.clamp_max(max(n_cmp - 1, 0)), overlap.to(dtype)


def block_scores(p_cmp: Tensor, bands: tuple[Tensor, Tensor]) -> Tensor:
    """`p_slc [..., Nb]` from `p_cmp [..., Tc]` and `overlap_bands`: `sum_i p_cmp[i] * overlap(i, j)`
    over the band of block j, summed in ascending i (deterministic; blocks with equal inputs tie
    exactly, as the tie rule needs). Memory: `[..., Nb, K]`, about `(1 + l/l') * Tc` per row."""
    idx, weights = bands
    if p_cmp.shape[-1] == 0:
        return p_cmp.new_zeros(*p_cmp.shape[:-1], idx.shape[0])
    band = p_cmp.index_select(-1, idx.flatten()).view(*p_cmp.shape[:-1], *idx.shape)
    return (band * weights).sum(-1)


def compressed_probs(q: Tensor, k_cmp: Tensor, q_pos: Tensor, *, block: int, stride: int,
                     scale: float) -> Tensor:
    """`p_cmp`, `[B, Hq, Tq, Tc]`: softmax over the visible compressed keys; 0 where none is visible.

    Computed in fp32 for half inputs (ranks must not depend on bf16 rounding), else in the input dtype.
    """
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    hq, hkv = q.shape[2], k_cmp.shape[2]
    kq = k_cmp.to(acc).repeat_interleave(hq // hkv, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q.to(acc), kq) * scale
    visible = compressed_mask(q_pos, k_cmp.shape[1], block, stride)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)  # rows with nothing visible: exactly 0


def is_forced(j: Tensor, cur: Tensor) -> Tensor:
    """Where blocks `j` are among the forced blocks of a query whose current block is `cur`:
    block 0, the current block and the previous one (broadcasting)."""
    return (j == 0) | (j == cur) | (j == cur - 1)


def select_topn(group_scores: Tensor, q_pos: Tensor, *, sel_block: int, sel_count: int) -> Tensor:
    """Top-n blocks from group scores `[B, Hkv, Tq, Nb]` -> indices `[B, Tq, Hkv, sel_count]`.

    Forced: block 0, the current block and the previous one. Candidates: `j * l' <= t`. Ties go to
    the lower index. Rows list the chosen blocks ascending, padded with `-1`.
    """
    n_blocks = group_scores.shape[-1]
    j = torch.arange(n_blocks, device=q_pos.device)
    cur = (q_pos // sel_block)[:, None]
    candidate = j[None, :] <= cur
    forced = is_forced(j[None, :], cur)
    scores = group_scores.masked_fill(forced, float("inf")).masked_fill(~candidate, float("-inf"))
    k = min(sel_count, n_blocks)
    # Exact "highest score, ties to the lower index" without a full sort (a sort of every row
    # dominated the GPU prefill): take everything above the k-th largest score, then the
    # lowest-index blocks that tie with it; never a non-candidate.
    thr = torch.topk(scores, k, dim=-1).values[..., -1:]
    above = scores > thr
    tied = scores == thr
    room = k - above.sum(-1, keepdim=True)
    take = (above | (tied & (torch.cumsum(tied, dim=-1) <= room))) & (scores > float("-inf"))
    j = torch.arange(n_blocks, device=scores.device)
    top_idx = torch.topk(torch.where(take, j, n_blocks), k, dim=-1, largest=False, sorted=True).values
    top_idx = torch.where(top_idx == n_blocks, torch.full_like(top_idx, -1), top_idx)
    if k < sel_count:
        pad = top_idx.new_full((*top_idx.shape[:-1], sel_count - k), -1)
        top_idx = torch.cat([top_idx, pad], dim=-1)
    return top_idx.permute(0, 2, 1, 3).contiguous()


def select_blocks_impl(q: Tensor, k_cmp: Tensor, q_start: int, *, block: int, stride: int,
                       sel_block: int, sel_count: int, scale: float) -> Tensor:
    """Scores and top-n, chunked over queries: peak memory `O(B * Hq * C * Tc)` for a chunk of C
    queries (C chosen so that is at most CHUNK_ELEMENTS), plus the `[Nb, K]` overlap bands.
    Time `O(B * Hq * Tq * Tc * dk)` for the scores; the block mapping is banded (`block_scores`)."""
    bsz, tq, hq, _ = q.shape
    hkv = k_cmp.shape[2]
    t_last = q_start + tq - 1
    n_blocks = t_last // sel_block + 1
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    bands = overlap_bands(k_cmp.shape[1], n_blocks, block, stride, sel_block, q.device, acc)
    chunk = max(1, CHUNK_ELEMENTS // max(1, bsz * hq * max(k_cmp.shape[1], bands[0].numel())))
    out = []
    for c0 in range(0, tq, chunk):
        q_pos = torch.arange(q_start + c0, q_start + min(tq, c0 + chunk), device=q.device)
        p_cmp = compressed_probs(q[:, c0:c0 + chunk], k_cmp, q_pos, block=block, stride=stride, scale=scale)
        p_slc = block_scores(p_cmp, bands)                               # [B, Hq, C, Nb]
        group = p_slc.view(bsz, hkv, hq // hkv, *p_slc.shape[2:]).sum(2)  # Eq. 10
        out.append(select_topn(group, q_pos, sel_block=sel_block, sel_count=sel_count))
    return torch.cat(out, dim=1)


def select_from_scores(scores: Tensor, q_start: int, *, sel_block: int, sel_count: int,
                       chunk: int = 8192) -> Tensor:
    """Top-n from precomputed group scores `[B, Tq, Hkv, Nb]` (e.g. the Triton fused kernel's),
    with the same forced blocks and tie rule as `select_topn`; chunked over queries so the sort's
    scratch stays `O(B * Hkv * chunk * Nb)`."""
    out = []
    for c0 in range(0, scores.shape[1], chunk):
        part = scores[:, c0:c0 + chunk]
        q_pos = torch.arange(q_start + c0, q_start + c0 + part.shape[1], device=scores.device)
        out.append(select_topn(part.permute(0, 2, 1, 3), q_pos, sel_block=sel_block, sel_count=sel_count))
    return torch.cat(out, dim=1)
