"""Top-n block indices from group scores: the spec's forced blocks (0, current, previous) and tie
rule (highest score, then the lower block index) by repeated arg-max, no sort. One program per
score row; few rows (decode): each row's blocks split over chunks, then the chunks' candidates
merged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels.common import np2
from nsa.backends.triton_kernels.tiles import Tiles


@triton.jit
def _row_scores(row, j, NB, cur):
    """Scores of blocks `j` of one row under the spec's rules: forced blocks (0, current `cur`,
    previous) +inf, non-candidates (`j > cur`, or past the row) -inf."""
    s = tl.load(row + j, mask=j < NB, other=0.0)
    s = tl.where((j == 0) | (j == cur) | (j == cur - 1), float("inf"), s)
    return tl.where(j <= cur, s, float("-inf"))


@triton.jit
def _take_top(s, j, N: tl.constexpr):
    """`N` rounds of: take the highest score, ties to the lowest block index `j`; never a -inf
    score. Returns the mask of taken entries (the spec's top-n rule, no sort)."""
    chosen = tl.zeros_like(j) != 0
    for _ in range(N):
        best = tl.max(s, 0)
        first = tl.min(tl.where(s == best, j, 2147483647), 0)
        pick = (j == first) & (s > float("-inf"))
        chosen = chosen | pick
        s = tl.where(pick, float("-inf"), s)
    return chosen


@triton.jit
def _write_blocks(out, j, chosen, N: tl.constexpr, BN: tl.constexpr):
    """Store the taken block indices (given in ascending order) to `out[0:N]`, then -1."""
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out + slot, j, mask=chosen)
    count = tl.sum(chosen.to(tl.int32), 0)
    offs_n = tl.arange(0, BN)
    tl.store(out + offs_n, tl.full([BN], -1, tl.int32), mask=(offs_n >= count) & (offs_n < N))


@triton.jit
def _topn_part(S, CS, CI, ssb, sst, ssh, NB, q_start, NP,
               HKV: tl.constexpr, SEL: tl.constexpr, N: tl.constexpr, CHK: tl.constexpr, BN: tl.constexpr):
    """Stage 1 of the few-rows top-n (decode): the top `N` of one chunk of `CHK` blocks of a row,
    under the same forced/candidate rules, as (score, index) candidates; empty slots -inf."""
    t = tl.program_id(0).to(tl.int64)   # t * score row stride passes 2**31 at 128k, 16 KV heads
    bh = tl.program_id(1)
    part = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
    h = bh % HKV
    cur = (q_start + t) // SEL
    j = part * CHK + tl.arange(0, CHK)
    s = _row_scores(S + b * ssb + t * sst + h * ssh, j, NB, cur)
    chosen = _take_top(s, j, N)
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    out = ((t * tl.num_programs(1) + bh) * NP + part) * N
    tl.store(CS + out + slot, s, mask=chosen)
    tl.store(CI + out + slot, j, mask=chosen)
    count = tl.sum(chosen.to(tl.int32), 0)
    offs_n = tl.arange(0, BN)
    empty = (offs_n >= count) & (offs_n < N)
    tl.store(CS + out + offs_n, tl.full([BN], float("-inf"), tl.float32), mask=empty)
    tl.store(CI + out + offs_n, tl.full([BN], -1, tl.int32), mask=empty)


@triton.jit
def _topn_merge(CS, CI, IDX, sib, sit, sih, NC,
                HKV: tl.constexpr, N: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr):
    """Stage 2: the top `N` of a row's `NC` candidates (highest score, ties to the lower block
    index), written ascending with -1 padding, like `_topn`."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
    h = bh % HKV
    c = tl.arange(0, BC)
    base = (t * tl.num_programs(1) + bh) * NC
    s = tl.load(CS + base + c, mask=c < NC, other=float("-inf"))
    j = tl.load(CI + base + c, mask=c < NC, other=-1)
    # Candidates arrive in ascending block order (each chunk stores its picks in order, chunks
    # in order; empty slots hold -inf and are never taken), as _write_blocks needs.
    _write_blocks(IDX + b * sib + t * sit + h * sih, j, _take_top(s, j, N), N, BN)


@triton.jit
def _topn(S, IDX, ssb, sst, ssh, sib, sit, sih, NB, q_start,
          HKV: tl.constexpr, SEL: tl.constexpr, N: tl.constexpr, BNB: tl.constexpr, BN: tl.constexpr):
    """One row of group scores -> its `N` blocks: forced block 0, current and previous; then the
    highest scores among candidates `j <= t // SEL`, ties to the lower index; ascending, -1 pad."""
    t = tl.program_id(0).to(tl.int64)   # t * score row stride passes 2**31 at 128k, 16 KV heads
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
    h = bh % HKV
    cur = (q_start + t) // SEL
    j = tl.arange(0, BNB)
    s = _row_scores(S + b * ssb + t * sst + h * ssh, j, NB, cur)
    _write_blocks(IDX + b * sib + t * sit + h * sih, j, _take_top(s, j, N), N, BN)


def topn(scores: Tensor, q_start: int, *, sel_block: int, sel_count: int, tiles: Tiles) -> Tensor:
    """Top-n block indices `[B, Tq, Hkv, sel_count]` (int32) from group scores `[B, Tq, Hkv, Nb]`:
    the rule of `nsa.selection.select_topn` (forced blocks, candidates `j <= t // l'`, ties to
    the lower index, ascending, -1 padded), one program per row, no sort and no scratch."""
    b, tq, hkv, nb = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    idx = torch.empty(b, tq, hkv, sel_count, dtype=torch.int32, device=scores.device)
    if tq == 0:
        return idx
    parts = triton.cdiv(nb, tiles.topn_chunk)
    if b * tq * hkv < tiles.topn_split_rows and parts > 1:
        # Few rows (decode): split each row's blocks over chunks, then merge the candidates.
        chk, bn = tiles.topn_chunk, np2(sel_count, 16)
        cs = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.float32, device=scores.device)
        ci = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.int32, device=scores.device)
        _topn_part[(tq, b * hkv, parts)](scores, cs, ci, scores.stride(0), scores.stride(1), scores.stride(2), nb,
                                         q_start, parts, HKV=hkv, SEL=sel_block, N=sel_count, CHK=chk, BN=bn,
                                         num_warps=1)
        _topn_merge[(tq, b * hkv)](cs, ci, idx, idx.stride(0), idx.stride(1), idx.stride(2), parts * sel_count,
                                   HKV=hkv, N=sel_count, BC=np2(parts * sel_count, 16), BN=bn, num_warps=4)
        return idx
    bnb = np2(nb, 16)
    _topn[(tq, b * hkv)](scores, idx, scores.stride(0), scores.stride(1), scores.stride(2), idx.stride(0),
                         idx.stride(1), idx.stride(2), nb, q_start, HKV=hkv, SEL=sel_block, N=sel_count,
                         BNB=bnb, BN=np2(sel_count, 16), num_warps=tiles.topn_warps if bnb >= 1024 else 1)
    return idx
