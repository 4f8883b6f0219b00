"""Top-n block indices from group scores: the spec's forced blocks (0, current, previous) and tie
rule (highest score, then the lower block index), exact. Prefill: programs walking score rows;
each row is filtered to its few blocks that can still be in the top n (int32 keys, chunk maxima,
a compaction; `_select_row`), then the rule runs by arg-max rounds over those. Few rows (decode's
separate-op path): each row's blocks split over chunks, then the chunks' candidates merged.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels.common import _program_bh, np2, pow2
from nsa.backends.triton_kernels.tiles import Tiles, interpreting


@triton.jit
def _row_scores(row, sprow, j, NB, cur, NBK: tl.constexpr):
    """Scores of blocks `j` of one row under the spec's rules: forced blocks (0, current `cur`,
    previous) +inf, non-candidates (`j > cur`, or past the row) -inf. `NBK > 0`: the scores
    kernel left each key tile's spill into the next tile's first block in `sprow`
    (`scores._cmp_scores`, SPILL): block `k * NBK` adds `sprow[k - 1]`, the same two fp32 addends
    the atomic path sums."""
    ok = (j < NB) & (j <= cur)
    s = tl.load(row + j, mask=ok, other=0.0)
    if NBK > 0:
        s += tl.load(sprow + (j // NBK - 1), mask=ok & (j % NBK == 0) & (j >= NBK), other=0.0)
    return _rule(s, j, cur)


@triton.jit
def _full_row_scores(row, sprow, NB, cur, BNB: tl.constexpr, NBK: tl.constexpr):
    """`_row_scores` of blocks `0 .. BNB - 1`; with the spill, the row is loaded as
    `[BNB / NBK, NBK]` so the spills are one contiguous load added to column 0 (a gather per
    block costs more than the row)."""
    if NBK > 0:
        c = tl.arange(0, BNB // NBK)
        k = tl.arange(0, NBK)
        j2 = c[:, None] * NBK + k[None, :]
        s2 = tl.load(row + j2, mask=(j2 < NB) & (j2 <= cur), other=0.0)
        spv = tl.load(sprow + (c - 1), mask=(c >= 1) & (c * NBK < NB) & (c * NBK <= cur), other=0.0)
        s = tl.reshape(s2 + tl.where(k[None, :] == 0, spv[:, None], 0.0), [BNB])
    else:
        s = tl.load(row + tl.arange(0, BNB), mask=(tl.arange(0, BNB) < NB) & (tl.arange(0, BNB) <= cur), other=0.0)
    return _rule(s, tl.arange(0, BNB), cur)


@triton.jit
def _rule(s, j, cur):
    """Forced blocks (0, current `cur`, previous) +inf, non-candidates (`j > cur`) -inf."""
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
def _mono(s):
    """fp32 scores `s` as int32 in the same order: the bits as signed ints with a negative's
    magnitude bits flipped, and -0.0 taken as +0.0 (the rule ties them)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _keys(s, j, IB: tl.constexpr):
    """int32 sort keys of scores `s` (+inf forced, -inf not a candidate) at blocks `j` < 2**IB,
    ordered as (score, then the lower index): the score's bits made monotone as signed ints
    (negatives' magnitude bits flipped; -0.0 taken as +0.0), the low IB cleared (truncation
    keeps order: a higher key part means a higher score), then the index field
    `2**IB - 1 - j`. Candidates' keys are distinct and > -2**31 + 1; non-candidates -2**31 + 1."""
    mono = _mono(s)
    key = ((mono >> IB) << IB) | ((1 << IB) - 1 - j)
    return tl.where(s > float("-inf"), key, -2147483647)


@triton.jit
def _select_row(row, sprow, s, j, NB, cur, out, scr, N: tl.constexpr, BN: tl.constexpr, ALGO: tl.constexpr,
                IB: tl.constexpr, K2: tl.constexpr, CW: tl.constexpr, CAP: tl.constexpr, NBK: tl.constexpr,
                SORT64: tl.constexpr, LANES: tl.constexpr):
    """The spec's top-`N` of one row (scores `s = _row_scores(row, sprow, j, ...)` at blocks `j`, the
    row's shape), written ascending to `out[0:N]`, -1 padded; exact (fp32 scores, ties to the
    lower index) in every `ALGO` (`sort_params` picks it and the sizes):
    0: `N` arg-max rounds over the row.
    1 (filter): the row's int32 `_keys` (score part truncated: order exact except inside one
      bucket) in chunks of `CW`; `tau` = the `N`-th largest chunk maximum, so at least `N` blocks
      (those maxima) have keys >= tau, and a block in a lower bucket than tau's has a lower score
      than each of them: it cannot be in the top `N`. The blocks in tau's bucket or above (>= N
      of them, a few more for spread scores) are compacted in block order into `scr[0:CAP]` and
      the exact rule runs over them (SORT64 1: `_top_by_keys64`, 2: `_top_by_rank`, 0: `N`
      arg-max rounds); more than `CAP` (many near-equal scores): the arg-max rounds over the
      whole row.
    `LANES` (same blocks, fewer instructions in a warp whose lane `l` holds blocks `l, l + 32,
    ...`): chunk `c` is the strided set `c, c + W / CW, ...`, so its maximum is a reduction
    inside each lane; the survivors are compacted in (lane, then register) order by a scan over
    each lane's registers and one over the lanes' counts, instead of one scan in block order
    across the lanes for every register; `_write_any` puts the taken blocks back in ascending
    order. Any partition into chunks keeps the filter exact: it only needs `N` distinct maxima."""
    if ALGO == 1:
        key = _keys(s, j, IB)
        W: tl.constexpr = 1 << IB
        if LANES:
            cmax = tl.max(tl.reshape(key, [CW, W // CW]), 0)                 # strided chunks
        else:
            cmax = tl.max(tl.reshape(key, [W // CW, CW]), 1)
        top = tl.topk(cmax, K2)                                             # K2 = np2(N) here
        tau = tl.sum(tl.where(tl.arange(0, K2) == N - 1, top, 0), 0)
        cand = (key > -2147483647) & ((key >> IB) >= (tau >> IB))
        count = tl.sum(cand.to(tl.int32), 0)
        if count > CAP:
            _write_blocks(out, j, _take_top(s, j, N), N, BN)
        else:
            sp = scr.to(tl.pointer_type(tl.int32))     # decode passes a slice of its fp32 scratch
            if LANES:
                c2 = tl.reshape(cand.to(tl.int32), [W // 32, 32])              # [register, lane]
                per_lane = tl.sum(c2, 0)
                slot = tl.cumsum(c2, 0) + (tl.cumsum(per_lane, 0) - per_lane)[None, :] - 1
                tl.store(sp + tl.reshape(slot, [W]), j, mask=cand)
            else:
                tl.store(sp + tl.cumsum(cand.to(tl.int32), 0) - 1, j, mask=cand)
            tl.debug_barrier()
            c = tl.arange(0, CAP)
            jc = tl.load(sp + c, mask=c < count, other=2147483647)
            tl.debug_barrier()                      # every lane has read scr before it is reused
            sc = _row_scores(row, sprow, jc, NB, cur, NBK)
            if SORT64 == 2:
                chosen = _top_by_rank(sc, jc, N)
            elif SORT64 == 1:
                chosen = _top_by_keys64(sc, jc, N, K2)
            else:
                chosen = _take_top(sc, jc, N)
            if LANES:
                _write_any(out, jc, chosen, N)
            else:
                _write_blocks(out, jc, chosen, N, BN)
    else:
        _write_blocks(out, j, _take_top(s, j, N), N, BN)


@triton.jit
def _keys64(s, j):
    """Exact int64 keys of scores `s` at blocks `j` (< 2**31; -inf: not a candidate) in the rule's
    order: the score's 32 bits made monotone (-0.0 as +0.0), then the index field `2**32 - 1 - j`
    (higher score, then lower index); non-candidates get the lowest key, below every candidate."""
    key = (_mono(s).to(tl.int64) << 32) | (4294967295 - j.to(tl.int64))
    return tl.where(s > float("-inf"), key, -9223372036854775807)


@triton.jit
def _top_by_keys64(s, j, N: tl.constexpr, K2: tl.constexpr):
    """The mask of the spec's top `N` of scores `s` at blocks `j` (< 2**31; -inf: not a
    candidate): the `N`-th largest of the exact `_keys64` by one bitonic top-`K2`
    (`K2 = np2(N)`), and every candidate at or above it. Fewer than N candidates: all of them.
    The same set `_take_top` picks, in a sorting network instead of N dependent arg-max rounds."""
    key = _keys64(s, j)
    top = tl.topk(key, K2)
    thr = tl.sum(tl.where(tl.arange(0, K2) == N - 1, top, 0), 0)
    return (key >= thr) & (s > float("-inf"))


@triton.jit
def _top_by_rank(s, j, N: tl.constexpr):
    """The mask of the spec's top `N` of scores `s` at blocks `j` (distinct, < 2**31; -inf: not a
    candidate) by ranks: the exact `_keys64`, and for each block the count of keys above its own
    from one all-pairs comparison; the top `N` are the candidates of rank < N (all of them when
    fewer). No dependent rounds: the comparisons are independent, then one sum per row."""
    key = _keys64(s, j)
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
    return (rank < N) & (s > float("-inf"))


@triton.jit
def _write_blocks(out, j, chosen, N: tl.constexpr, BN: tl.constexpr):
    """Store the taken block indices (given in ascending order) to `out[0:N]`, then -1."""
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out + slot, j, mask=chosen)
    count = tl.sum(chosen.to(tl.int32), 0)
    offs_n = tl.arange(0, BN)
    tl.store(out + offs_n, tl.full([BN], -1, tl.int32), mask=(offs_n >= count) & (offs_n < N))


@triton.jit
def _write_any(out, j, chosen, N: tl.constexpr):
    """`_write_blocks` for taken blocks `j` (distinct, at most `N`, `j.numel >= N`) in any order:
    one sort of the taken blocks (the others as 2**31 - 1, last) puts them ascending in
    `out[0:N]`, then -1."""
    jo = tl.sort(tl.where(chosen, j, 2147483647))          # taken blocks first, ascending
    c = tl.arange(0, j.numel)
    tl.store(out + c, tl.where(jo == 2147483647, -1, jo), mask=c < N)


@triton.jit
def _topn_part(S, CS, CI, ssb, sst, ssh, NB, q_start, NP,
               HKV: tl.constexpr, SEL_BLOCK: tl.constexpr, N: tl.constexpr, CHK: tl.constexpr, BN: tl.constexpr):
    """Stage 1 of the few-rows top-n (decode): the top `N` of one chunk of `CHK` blocks of a row,
    under the same forced/candidate rules, as (score, index) candidates; empty slots -inf."""
    t = tl.program_id(0).to(tl.int64)   # t * score row stride passes 2**31 at 128k, 16 KV heads
    bh, b, h = _program_bh(1, HKV)
    part = tl.program_id(2)
    cur = (q_start + t) // SEL_BLOCK
    j = part * CHK + tl.arange(0, CHK)
    row = S + b * ssb + t * sst + h * ssh
    s = _row_scores(row, row, j, NB, cur, 0)
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
    bh, b, h = _program_bh(1, HKV)
    c = tl.arange(0, BC)
    base = (t * tl.num_programs(1) + bh) * NC
    s = tl.load(CS + base + c, mask=c < NC, other=float("-inf"))
    j = tl.load(CI + base + c, mask=c < NC, other=-1)
    # Candidates arrive in ascending block order (each chunk stores its picks in order, chunks
    # in order; empty slots hold -inf and are never taken), as _write_blocks needs.
    _write_blocks(IDX + b * sib + t * sit + h * sih, j, _take_top(s, j, N), N, BN)


@triton.jit
def _topn(S, SP, IDX, SCR, ssb, sst, ssh, spb, spt, sph, sib, sit, sih, NB, q_start, t0, n_rows, iters,
          HKV: tl.constexpr, BH: tl.constexpr, SEL_BLOCK: tl.constexpr, N: tl.constexpr, BNB: tl.constexpr,
          BN: tl.constexpr, ALGO: tl.constexpr, IB: tl.constexpr, K2: tl.constexpr, CW: tl.constexpr,
          CAP: tl.constexpr, NBK: tl.constexpr, SORT64: tl.constexpr, LANES: tl.constexpr,
          ITERS_HOST: tl.constexpr, DYN: tl.constexpr):
    """Rows `pid, pid + P, ...` (`iters` of them at most) of the `n_rows` rows of group scores from
    query `t0` on (row `(t - t0) * BH + bh`), each with at most `BNB` candidates -> their `N`
    blocks: forced block 0, current and previous; then the highest scores among candidates
    `j <= t // SEL_BLOCK`, ties to the lower index; ascending, -1 pad.
    `SCR[pid]`: this program's `CAP` ints of compaction scratch (the filter). `NBK > 0`: `SP`
    holds the scores kernel's key-tile spills (`_row_scores`)."""
    pid = tl.program_id(0)
    scr = SCR + pid * CAP
    j = tl.arange(0, BNB)
    for i in range(0, iters if DYN else ITERS_HOST):   # the interpreter loops over host ints only
        r = pid + i * tl.num_programs(0)
        if r < n_rows:
            t = t0 + (r // BH).to(tl.int64)   # t * score row stride passes 2**31 at 128k, 16 KV heads
            bh = r % BH
            b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
            h = bh % HKV
            cur = (q_start + t) // SEL_BLOCK
            row = S + b * ssb + t * sst + h * ssh
            sprow = SP + b * spb + t * spt + h * sph
            s = _full_row_scores(row, sprow, NB, cur, BNB, NBK)
            _select_row(row, sprow, s, j, NB, cur, IDX + b * sib + t * sit + h * sih, scr, N, BN, ALGO, IB, K2, CW,
                        CAP, NBK, SORT64, LANES)


def sort_params(width: int, sel_count: int, algo: str, cap: int, nchunk: int, sort64: bool,
                rank: bool = False, lanes: bool = False, min_width: int = 0) -> dict[str, int]:
    """`ALGO`, `IB` (index bits), `K2` (np2(n)), `CW`, `CAP`, `SORT64`, `LANES` of `_select_row` for
    rows of `width` (a power of two) blocks: the filter's chunks hold CW = max(4, width / nchunk)
    blocks (strided with `lanes`, contiguous without); rows too short for it (<= cap blocks,
    fewer than np2(n) chunks, or under `min_width`) take the arg-max rounds. The rule over the
    filter's survivors: `SORT64` 2 with `rank` (all-pairs ranks), else 1 with `sort64` (one
    int64 sort; needs cap >= np2(n)), else 0 (n arg-max rounds). `lanes` needs width >= 32 where
    the filter runs (its compaction views the row as [width / 32, 32]) and cap >= n
    (`_write_any` sorts the cap slots)."""
    n2, cw = np2(sel_count, 1), max(4, width // nchunk)
    use = algo == "filter" and width > cap and width // cw >= n2 and width >= min_width
    return {"ALGO": int(use), "IB": max(width.bit_length() - 1, 1), "K2": n2, "CW": cw, "CAP": cap,
            "SORT64": 2 if rank else int(sort64 and cap >= n2),
            "LANES": int(lanes and use and width >= 32 and cap >= sel_count)}


def width_classes(q_start: int, tq: int, sel_block: int, width: int, low: int) -> list[tuple[int, int, int]]:
    """`(t_lo, t_hi, w)` covering queries `0 .. tq - 1` (positions `q_start ..`) by powers of two
    `w` from `low` to `width`: the queries whose candidate blocks `0 .. (q_start + t) // sel_block`
    fit in `w` (`q_start + t < w * sel_block`) and not in `w / 2`; `width` takes the rest."""
    out, t_lo, w = [], 0, low
    while t_lo < tq:
        t_hi = tq if w >= width else min(tq, max(t_lo, w * sel_block - q_start))
        if t_hi > t_lo:
            out.append((t_lo, t_hi, w))
        t_lo, w = t_hi, w * 2
    return out


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs(device: torch.device, per_sm: int, rows: int) -> int:
    """Persistent grid size: `per_sm` programs per SM (interpreter: `per_sm` in all), at most `rows`."""
    dev = torch.device(device)
    total = per_sm * (_sm_count(dev) if dev.type == "cuda" and not interpreting() else 1)
    return max(1, min(rows, total))


def topn(scores: Tensor, q_start: int, *, sel_block: int, sel_count: int, tiles: Tiles,
         spill: tuple[Tensor, int] | None = None) -> Tensor:
    """Top-n block indices `[B, Tq, Hkv, sel_count]` (int32) from group scores `[B, Tq, Hkv, Nb]`:
    the rule of `nsa.selection.select_topn` (forced blocks, candidates `j <= t // l'`, ties to
    the lower index, ascending, -1 padded). Rows of many blocks: `Tiles.topn_ctas` programs per SM
    walk the rows, each with `topn_cap` ints of scratch for the filter (`_select_row`); few rows
    (decode's separate-op path): two stages over chunks of `topn_chunk` blocks. `spill = (sp,
    nbk)`: scores from the scores kernel's spill mode (`compressed.compressed_select`): block
    `k * nbk` adds `sp[b, t, h, k - 1]`, and only each row's candidates are defined."""
    b, tq, hkv, nb = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    idx = torch.empty(b, tq, hkv, sel_count, dtype=torch.int32, device=scores.device)
    if tq == 0:
        return idx
    parts = triton.cdiv(nb, tiles.topn_chunk)
    if spill is None and b * tq * hkv < tiles.topn_split_rows and parts > 1:
        # Few rows (decode): split each row's blocks over chunks, then merge the candidates.
        chk, bn = tiles.topn_chunk, np2(sel_count, 16)
        cs = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.float32, device=scores.device)
        ci = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.int32, device=scores.device)
        _topn_part[(tq, b * hkv, parts)](scores, cs, ci, scores.stride(0), scores.stride(1), scores.stride(2), nb,
                                         q_start, parts, HKV=hkv, SEL_BLOCK=sel_block, N=sel_count, CHK=chk, BN=bn,
                                         num_warps=1)
        _topn_merge[(tq, b * hkv)](cs, ci, idx, idx.stride(0), idx.stride(1), idx.stride(2), parts * sel_count,
                                   HKV=hkv, N=sel_count, BC=np2(parts * sel_count, 16), BN=bn, num_warps=4)
        return idx
    sp, nbk = spill if spill is not None else (scores, 0)
    bnb = np2(nb, 16)
    if nbk and (sp.dim() != 4 or sp.shape[:3] != scores.shape[:3] or sp.stride(-1) != 1 or not pow2(nbk)
                or nbk > bnb or sp.shape[3] < triton.cdiv(nb, nbk) - 1):
        raise ValueError(f"spill must be a [B, Tq, Hkv, >= Nb / nbk - 1] unit-stride buffer beside scores "
                         f"{tuple(scores.shape)} with nbk a power of two <= {bnb}, got {tuple(sp.shape)}, nbk {nbk}")
    # Rows by width: queries whose candidates (blocks <= t // sel_block) fit in `w` blocks run with
    # `w`-wide vectors (the filter's cost follows the width), one launch per width class.
    nprog_max = programs(scores.device, tiles.topn_ctas, b * tq * hkv)
    scr = torch.empty(nprog_max, tiles.topn_cap, dtype=torch.int32, device=scores.device)
    for t_lo, t_hi, w in width_classes(q_start, tq, sel_block, bnb, max(16, nbk)):
        rows = b * (t_hi - t_lo) * hkv
        nprog = programs(scores.device, tiles.topn_ctas, rows)
        iters, dyn = triton.cdiv(rows, nprog), not interpreting()
        _topn[(nprog,)](scores, sp, idx, scr, scores.stride(0), scores.stride(1), scores.stride(2), sp.stride(0),
                        sp.stride(1), sp.stride(2), idx.stride(0), idx.stride(1), idx.stride(2), nb, q_start, t_lo,
                        rows, iters, ITERS_HOST=0 if dyn else iters, DYN=dyn, HKV=hkv, BH=b * hkv, SEL_BLOCK=sel_block,
                        N=sel_count, BNB=w, BN=np2(sel_count, 16), NBK=nbk,
                        **sort_params(w, sel_count, tiles.topn_algo, tiles.topn_cap,
                                      tiles.topn_lane_chunks or tiles.topn_nchunk, tiles.topn_sort64,
                                      tiles.topn_rank, tiles.topn_lane_chunks > 0, tiles.topn_filter_min),
                        num_warps=tiles.topn_warps if w >= 1024 else 1,
                        **({"maxnreg": tiles.topn_maxnreg} if tiles.topn_maxnreg and not interpreting() else {}))
    return idx
