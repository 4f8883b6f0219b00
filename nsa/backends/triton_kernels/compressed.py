"""Compressed attention and the selection scores in one kernel family, group-centric.

Prefill (`_cmp_group`): one program per (BTQ queries, KV group) holds every (query, head) row of
the group, so each compressed key/value tile is loaded once for all heads. Two passes over the
visible compressed keys (softmax stats, then output); the second also forms the selection scores
(Eq. 9-10) and writes each `[BTQ, blocks]` tile once, never materialising `[T, Tc]` in HBM.
Decode (`_cmp_split`, few queries): the compressed keys split over chunks, flash-decoding style,
stats pass then output/scores pass, the chunks' score spill added by `_add_spill`.
Softmax statistics in log2 units (the host passes `scale * LOG2E`; common.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels import common
from nsa.backends.triton_kernels import fa3_cmp as _fa3
from nsa.backends.triton_kernels import scores as _scr
from nsa.backends.triton_kernels import topn as _topn
from nsa.backends.triton_kernels.cmp_tile import (
    _carried_scores,
    _cmp_logits,
    _group_rows,
    _group_scores,
    _pv_tile,
)
from nsa.backends.triton_kernels.common import (
    LOG2E,
    _merge_stats,
    _program_bh,
    _safe_max,
    _softmax_update,
    np2,
    pow2,
    unit_last_stride,
)
from nsa.backends.triton_kernels.tiles import Tiles, interpreting


@triton.jit
def _cmp_group(Q, KC, VC, Out, S,
               sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, ssb, sst, ssh,
               T, Tc, NB, q_start, qk_scale2,
               TC_ALL: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
               BTQ: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BNB: tl.constexpr,
               BDK: tl.constexpr, BDV: tl.constexpr, SCORES: tl.constexpr, SCORE_MODE: tl.constexpr,
               SHIFT: tl.constexpr, IEEE: tl.constexpr, DYN_LOOP: tl.constexpr):
    """Group-centric compressed attention (+ selection scores): one program per (BTQ queries,
    KV group); its BTQ * GP rows are every (query, head) pair of the group, so each compressed
    tile is loaded once for all heads. Pass 1: softmax stats. Pass 2: output and, with SCORES,
    the Eq. 9-10 group scores: probabilities summed over heads, then mapped to selection
    blocks by overlap, written once per tile."""
    M: tl.constexpr = BTQ * GP
    # Causal: the tile's last query sees the most compressed tokens (max_vis): the loops stop there.
    pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q = _group_rows(Q, sqb, sqt, sqh, T, Tc, q_start, HKV, G,
                                                                       GP, BTQ, CMP_BLOCK, STRIDE, DK, BDK)
    offs_dv = tl.arange(0, BDV)
    kc_base = b * skb + h * skh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
        qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, qk_scale2, BC, BDK, DK, IEEE, True)
        m_i, l_i, _, _ = _softmax_update(qk, m_i, l_i)
    m_safe = _safe_max(m_i)
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    acc = tl.zeros([M, BDV], tl.float32)
    t_first = pid_t * BTQ + tl.arange(0, BTQ)
    carry = tl.zeros([BTQ, SHIFT if SHIFT > 0 else 1], tl.float32)
    # A score row's offset t * (Hkv * Nb) passes 2**31 at 128k with 16 KV heads: int64.
    s_rows = S + b * ssb + t_first[:, None].to(tl.int64) * sst + h * ssh
    for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
        acc, p, offs_c = _pv_tile(q, KC, VC, kc_base, b * svb + h * svh, skt, svt, c0, nvis, Tc, qk_scale2,
                                  m_safe, inv_l, acc, BC, BDK, DK, BDV, DV, IEEE)
        if SCORES:
            if SHIFT > 0:
                carry = _carried_scores(p, offs_c, c0, carry, s_rows, t_first[:, None] < T, NB, BTQ, GP, BC,
                                        SHIFT, CMP_BLOCK, STRIDE, SEL_BLOCK, SCORE_MODE)
            else:
                # General sizes: read-modify-write of the tile's blocks (they overlap the next tile's).
                jb = (c0 * STRIDE) // SEL_BLOCK
                ps = tl.sum(tl.reshape(p, [BTQ, GP, BC]), 1)              # Eq. 10: over heads
                tot = _group_scores(ps, offs_c, jb, BNB, CMP_BLOCK, STRIDE, SEL_BLOCK, SCORE_MODE)
                offs_j = jb + tl.arange(0, BNB)
                ptr = S + b * ssb + t_first[:, None].to(tl.int64) * sst + h * ssh + offs_j[None, :]
                smask = (t_first[:, None] < T) & (offs_j[None, :] < NB)
                old = tl.load(ptr, mask=smask, other=0.0)
                tl.store(ptr, old + tot, mask=smask)
                tl.debug_barrier()
    if SCORES and SHIFT > 0:
        jb_end = (tl.cdiv(max_vis if DYN_LOOP else TC_ALL, BC) * BC * STRIDE) // SEL_BLOCK
        offs_j = jb_end + tl.arange(0, SHIFT)
        tl.store(S + b * ssb + t_first[:, None].to(tl.int64) * sst + h * ssh + offs_j[None, :], carry,
                 mask=(t_first[:, None] < T) & (offs_j[None, :] < NB))
    tl.store(Out + b * sob + offs_t[:, None] * sot + heads[:, None] * soh + offs_dv[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _cmp_split(Q, KC, VC, ML, PACC, S, SPILL,
               sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, ssb, sst, ssh,
               T, Tc, NB, q_start, qk_scale2, NS,
               PASS: tl.constexpr, NSP: tl.constexpr, CH: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
               GP: tl.constexpr, BTQ: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr,
               SEL_BLOCK: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
               SCORES: tl.constexpr, SCORE_MODE: tl.constexpr, SHIFT: tl.constexpr, IEEE: tl.constexpr):
    """Decode (a few queries, long context): `_cmp_group` split over chunks of CH compressed
    keys, one program per (chunk, KV group), so a step uses the whole GPU. PASS 1: each
    chunk's softmax stats (log2 units) -> ML. PASS 2: the global stats from every chunk's, then this
    chunk's output share -> PACC (summed on the host) and its block scores -> S, with the
    spill past the chunk's last block -> SPILL (added by `_add_spill`)."""
    M: tl.constexpr = BTQ * GP
    s = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    rows = tl.arange(0, M)
    offs_t = rows // GP
    g = rows % GP
    row_ok = (offs_t < T) & (g < G)
    t_abs = q_start + offs_t
    c_lo = s * CH
    nvis = tl.where(t_abs + 1 < CMP_BLOCK, 0, (t_abs + 1 - CMP_BLOCK) // STRIDE + 1)
    nvis = tl.where(row_ok, tl.minimum(tl.minimum(nvis, Tc), c_lo + CH), 0)   # this chunk's keys only
    offs_dk = tl.arange(0, BDK)
    heads = h * G + g
    q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    kc_base = b * skb + h * skh
    if PASS == 1:
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        for i in range(0, CH, BC):
            qk = _cmp_logits(q, KC, kc_base, skt, c_lo + i, nvis, Tc, qk_scale2, BC, BDK, DK, IEEE, True)
            m_i, l_i, _, _ = _softmax_update(qk, m_i, l_i)
        tl.store(ML + (s * tl.num_programs(1) + bh) * M + rows, m_i)
        tl.store(ML + ((NS + s) * tl.num_programs(1) + bh) * M + rows, l_i)
    else:
        offs_s = tl.arange(0, NSP)
        at = (offs_s[:, None] * tl.num_programs(1) + bh) * M + rows[None, :]
        m_all = tl.load(ML + at, mask=offs_s[:, None] < NS, other=float("-inf"))
        l_all = tl.load(ML + NS * tl.num_programs(1) * M + at, mask=offs_s[:, None] < NS, other=0.0)
        m_max, l_tot, _ = _merge_stats(m_all, l_all)
        m_safe = _safe_max(m_max)
        inv_l = 1.0 / tl.where(l_tot == 0.0, 1.0, l_tot)
        offs_dv = tl.arange(0, BDV)
        acc = tl.zeros([M, BDV], tl.float32)
        t_first = tl.arange(0, BTQ)
        carry = tl.zeros([BTQ, SHIFT], tl.float32)
        s_rows = S + b * ssb + t_first[:, None].to(tl.int64) * sst + h * ssh
        for i in range(0, CH, BC):
            acc, p, offs_c = _pv_tile(q, KC, VC, kc_base, b * svb + h * svh, skt, svt, c_lo + i, nvis, Tc,
                                      qk_scale2, m_safe, inv_l, acc, BC, BDK, DK, BDV, DV, IEEE)
            if SCORES:
                carry = _carried_scores(p, offs_c, c_lo + i, carry, s_rows, t_first[:, None] < T, NB, BTQ, GP,
                                        BC, SHIFT, CMP_BLOCK, STRIDE, SEL_BLOCK, SCORE_MODE)
        tl.store(PACC + ((s * tl.num_programs(1) + bh) * M + rows[:, None]) * BDV + offs_dv[None, :], acc)
        if SCORES:
            tl.store(SPILL + ((s * tl.num_programs(1) + bh) * BTQ + t_first[:, None]) * SHIFT
                     + tl.arange(0, SHIFT)[None, :], carry)


@triton.jit
def _add_spill(S, SPILL, ssb, sst, ssh, T, NB,
               HKV: tl.constexpr, BTQ: tl.constexpr, SHIFT: tl.constexpr, CHB: tl.constexpr):
    """S[block (s+1)*CHB + k] += SPILL[s, k]: chunk s's scores past its last block (the next
    chunk's own stores are done; chunks' spill ranges do not overlap)."""
    s = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    t = tl.arange(0, BTQ)
    k = tl.arange(0, SHIFT)
    spill = tl.load(SPILL + ((s * tl.num_programs(1) + bh) * BTQ + t[:, None]) * SHIFT + k[None, :])
    offs_j = (s + 1) * CHB + k
    ptr = S + b * ssb + t[:, None].to(tl.int64) * sst + h * ssh + offs_j[None, :]
    mask = (t[:, None] < T) & (offs_j[None, :] < NB)
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + spill, mask=mask)


def _cmp_tiles(tq: int, group: int, tiles: Tiles) -> tuple[int, int, int]:
    """(queries per program, padded group, compressed tile): rows = queries x padded heads, >= 16
    for tl.dot."""
    gp = triton.next_power_of_2(group)
    btq = max(1, tiles.cmp_rows // gp)
    btq = max(max(1, 16 // gp), min(btq, triton.next_power_of_2(tq)))   # decode: few queries
    return btq, gp, tiles.cmp_bc


def _score_layout(btq: int, bc: int, block: int, stride: int, sel_block: int, carry: bool) -> tuple[int, int]:
    """(score mode, shift). Mode 0 (broadcast-sum) for query tiles < 16, mode 1 (fp32 dot)
    otherwise: for tiles >= 16 Triton rewrites a broadcast-multiply-sum into a TF32 tensor-core
    dot (seen on the H100: scores off by 4e-4), which would let rounding move the ranks.
    shift > 0 carries the spill in registers (tiles end on block edges)."""
    mode = 1 if btq >= 16 else 0
    shift = 0
    if carry and (bc * stride) % sel_block == 0:
        cand = bc * stride // sel_block
        spill = -(-max(0, block - stride) // sel_block)
        if pow2(cand) and spill <= cand and (mode == 0 or cand >= 16):
            shift = cand
    return mode, shift


def compressed_and_scores(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                          scale: float, q_start: int, scores: bool, tiles: Tiles) -> tuple[Tensor, Tensor | None]:
    """Compressed-branch output `[B, Tq, Hq, Dv]` and group scores `[B, Tq, Hkv, Nb]` (fp32) in one kernel
    (`scores=False`: None), for queries at `q_start ..` over compressed keys `[B, Tc, Hkv, d*]`.

    `Nb = (q_start + Tq - 1) // sel_block + 1`. Memory: the two outputs; nothing of size `T x Tc`.
    """
    b, tq, hq, dk = q.shape
    tc, hkv, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    q, k_cmp, v_cmp = unit_last_stride(q, k_cmp, v_cmp)
    o = common.empty_out(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    nb = (q_start + tq - 1) // sel_block + 1
    s = torch.zeros(b, tq, hkv, nb if scores else 1, dtype=torch.float32, device=q.device)
    if tc == 0:
        o.zero_()
        return o, s if scores else None
    group = hq // hkv
    btq, gp, bc = _cmp_tiles(tq, group, tiles)
    exact = q.dtype == torch.float32
    mode, shift = _score_layout(btq, bc, block, stride, sel_block, tiles.score_carry)
    chunk = bc * tiles.split_tiles
    route = _route(q, k_cmp, block=block, stride=stride, sel_block=sel_block, q_start=q_start, scores=scores,
                   tiles=tiles)
    if route == "split":
        return _compressed_split(q, k_cmp, v_cmp, o, s, block=block, stride=stride, sel_block=sel_block, scale=scale,
                                 q_start=q_start, scores=scores, btq=btq, gp=gp, bc=bc, mode=mode, shift=shift,
                                 chunk=chunk, n_split=triton.cdiv(_max_vis(tc, tq, q_start, block, stride), chunk),
                                 tiles=tiles)
    if route == "lse":
        return _compressed_lse(q, k_cmp, v_cmp, o, s, block=block, stride=stride, sel_block=sel_block, scale=scale,
                               q_start=q_start, scores=scores, tiles=tiles)
    bnb = np2((bc * stride + block) // sel_block + 2, 16)
    _cmp_group[(triton.cdiv(tq, btq), b * hkv)](
        q, k_cmp, v_cmp, o, s, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), o.stride(0), o.stride(1), o.stride(2),
        s.stride(0), s.stride(1), s.stride(2), tq, tc, nb, q_start, scale * LOG2E,
        TC_ALL=tc if interpreting() else 0, HKV=hkv, G=group, GP=gp, BTQ=btq, CMP_BLOCK=block, STRIDE=stride,
        SEL_BLOCK=sel_block,
        DK=dk, DV=dv, BC=bc, BNB=bnb, BDK=np2(dk), BDV=np2(dv), SCORES=scores, SCORE_MODE=mode, SHIFT=shift,
        IEEE=exact, DYN_LOOP=not interpreting(), **tiles.launch("cmp"))
    return o, s if scores else None


def _max_vis(tc: int, tq: int, q_start: int, block: int, stride: int) -> int:
    """Compressed tokens the last query sees."""
    return min(tc, max(0, (q_start + tq - block) // stride + 1))


def _route(q: Tensor, k_cmp: Tensor, *, block: int, stride: int, sel_block: int, q_start: int, scores: bool,
           tiles: Tiles) -> str:
    """Which kernels `compressed_and_scores` runs (tc > 0): "split" (decode: few queries, the keys
    split over chunks), "lse" (prefill: one-pass output + log-sum-exp, then the scores kernel) or
    "group" (the two-pass group kernel: other block/stride sizes, or `Tiles.cmp_lse` off)."""
    tq, tc = q.shape[1], k_cmp.shape[1]
    btq, _, bc = _cmp_tiles(tq, q.shape[2] // k_cmp.shape[2], tiles)
    _, shift = _score_layout(btq, bc, block, stride, sel_block, tiles.score_carry)
    chunk = bc * tiles.split_tiles
    if tq <= btq and shift > 0 and (chunk * stride) % sel_block == 0 and \
            _max_vis(tc, tq, q_start, block, stride) > chunk:
        return "split"
    if tiles.cmp_lse and (not scores or _stride_map(block, stride, sel_block, tiles) is not None):
        return "lse"
    return "group"


def compressed_select(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                      sel_count: int, scale: float, q_start: int, tiles: Tiles) -> tuple[Tensor, Tensor]:
    """Compressed-branch output and the top-n blocks `[B, Tq, Hkv, sel_count]` (int32), the
    values of `compressed_and_scores` then `topn.topn`. Prefill on the "lse" route with many rows
    hands the scores to top-n without zeroing them or adding key-tile edges atomically: the
    scores kernel writes each row's candidate blocks and a side buffer of key-tile spills
    (`scores._cmp_scores`, SPILL), which top-n adds (`topn._row_scores`). The same fp32 sums,
    so the same blocks; entries past a row's candidates are left undefined and never read."""
    b, tq, hq, dk = q.shape
    tc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    rows, nb = b * tq * hkv, (q_start + tq - 1) // sel_block + 1
    if tq == 0 or tc == 0 or rows < tiles.topn_split_rows or \
            _route(q, k_cmp, block=block, stride=stride, sel_block=sel_block, q_start=q_start, scores=True,
                   tiles=tiles) != "lse" or \
            tiles.scr_bk // _stride_map(block, stride, sel_block, tiles)[0] > np2(nb, 16):
        o, s = compressed_and_scores(q, k_cmp, v_cmp, block=block, stride=stride, sel_block=sel_block, scale=scale,
                                     q_start=q_start, scores=True, tiles=tiles)
        return o, _topn.topn(s, q_start, sel_block=sel_block, sel_count=sel_count, tiles=tiles)
    q, k_cmp, v_cmp = unit_last_stride(q, k_cmp, v_cmp)
    o = common.empty_out(b, tq, hq, v_cmp.shape[-1], dtype=q.dtype, device=q.device)
    r, _ = _stride_map(block, stride, sel_block, tiles)
    nbk = tiles.scr_bk // r
    s = torch.empty(b, tq, hkv, nb, dtype=torch.float32, device=q.device)
    sp = torch.empty(b, tq, hkv, max(triton.cdiv(tc, tiles.scr_bk), triton.cdiv(nb, nbk)), dtype=torch.float32,
                     device=q.device)
    _compressed_lse(q, k_cmp, v_cmp, o, s, block=block, stride=stride, sel_block=sel_block, scale=scale,
                    q_start=q_start, scores=True, tiles=tiles, spill=sp)
    idx = _topn.topn(s, q_start, sel_block=sel_block, sel_count=sel_count, tiles=tiles, spill=(sp, nbk))
    return o, idx


def _compressed_split(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, s: Tensor, *, block: int, stride: int,
                      sel_block: int, scale: float, q_start: int, scores: bool, btq: int, gp: int, bc: int, mode: int,
                      shift: int, chunk: int, n_split: int, tiles: Tiles) -> tuple[Tensor, Tensor | None]:
    """Decode: `_cmp_split` over `n_split` chunks of the compressed keys (flash-decoding), then the
    output shares summed and the chunks' score spill added."""
    b, tq, hq, dk = q.shape
    tc, hkv, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    rows, bh, bdv = btq * gp, b * hkv, np2(dv)
    ml = torch.empty(2, n_split, bh, rows, dtype=torch.float32, device=q.device)
    pacc = torch.empty(n_split, bh, rows, bdv, dtype=torch.float32, device=q.device)
    spill = torch.empty(n_split, bh, btq, shift, dtype=torch.float32, device=q.device)
    args = (q, k_cmp, v_cmp, ml, pacc, s, spill, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0),
            k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), s.stride(0),
            s.stride(1), s.stride(2), tq, tc, s.shape[-1], q_start, scale * LOG2E, n_split)
    meta = dict(NSP=np2(n_split, 1), CH=chunk, HKV=hkv, G=hq // hkv, GP=gp, BTQ=btq, CMP_BLOCK=block, STRIDE=stride,
                SEL_BLOCK=sel_block, DK=dk, DV=dv, BC=bc, BDK=np2(dk), BDV=bdv, SCORES=scores, SCORE_MODE=mode,
                SHIFT=shift, IEEE=q.dtype == torch.float32, **tiles.launch("split"))
    _cmp_split[(n_split, bh)](*args, PASS=1, **meta)
    _cmp_split[(n_split, bh)](*args, PASS=2, **meta)
    if scores:
        # Every chunk's spill, the last one's too (its blocks may still be < Nb; the mask drops the rest).
        _add_spill[(n_split, bh)](s, spill, s.stride(0), s.stride(1), s.stride(2), tq, s.shape[-1], HKV=hkv,
                                      BTQ=btq, SHIFT=shift, CHB=chunk * stride // sel_block)
    out = pacc.sum(0).view(b, hkv, btq, gp, bdv)[:, :, :tq, :hq // hkv, :dv]
    o.copy_(out.permute(0, 2, 1, 3, 4).reshape(b, tq, hq, dv))
    return o, s if scores else None


def _stride_map(block: int, stride: int, sel_block: int, tiles: Tiles) -> tuple[int, int] | None:
    """(R, E) = (l' / d, l / d) when the scores kernel's block map applies (scores.py): d divides
    l and l', E <= R, R a power of two, and the kernel's key tile holds >= 16 whole blocks."""
    if block % stride or sel_block % stride:
        return None
    r, e = sel_block // stride, block // stride
    if e > r or not pow2(r) or tiles.scr_bk % r or tiles.scr_bk // r < 16:
        return None
    return r, e


def _launch_lse(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor, *, block: int, stride: int,
                scale: float, q_start: int, tiles: Tiles) -> None:
    """`scores._cmp_lse` over queries `q` (positions `q_start ..`): `o` and `lse [B, Hq, Tq]`."""
    b, tq, hq, dk = q.shape
    tc, hkv, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    group = hq // hkv
    gp = triton.next_power_of_2(group)
    btq = max(max(1, 16 // gp), min(max(1, tiles.lse_rows // gp), triton.next_power_of_2(tq)))
    _scr._cmp_lse[(triton.cdiv(tq, btq), b * hkv)](
        q, k_cmp, v_cmp, o, lse, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1), tq, tc, q_start, scale * LOG2E,
        TC_ALL=tc if interpreting() else 0, HKV=hkv, G=group, GP=gp, BTQ=btq, CMP_BLOCK=block, STRIDE=stride, DK=dk,
        DV=dv,
        BC=tiles.lse_bc, BDK=np2(dk), BDV=np2(dv), IEEE=q.dtype == torch.float32, DYN_LOOP=not interpreting(),
        **tiles.launch("lse"))


def _compressed_lse(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, s: Tensor, *, block: int, stride: int,
                    sel_block: int, scale: float, q_start: int, scores: bool,
                    tiles: Tiles, spill: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Prefill as two kernels (scores.py): output + log-sum-exp in one pass, then, with `scores`,
    the group scores from the log-sum-exp over (key tile, query tile) programs (`spill`: the
    scores kernel's SPILL mode, `s` not zeroed, key-tile spills into `spill [B, Tq, Hkv, tiles]`)."""
    b, tq, hq, dk = q.shape
    group = hq // k_cmp.shape[2]
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)

    def one_pass(start: int) -> None:   # queries start.. of this call through _cmp_lse
        _launch_lse(q[:, start:], k_cmp, v_cmp, o[:, start:], lse[:, :, start:], block=block, stride=stride,
                    scale=scale, q_start=q_start + start, tiles=tiles)

    if tiles.cmp_fa3 and (group >= tiles.cmp_fa3_min_group or (group == 1 and tiles.cmp_fa3_g1)) and \
            common.prefill_work(q) >= tiles.cmp_fa3_min_work and \
            _fa3.usable(q, k_cmp, v_cmp, block=block, stride=stride, q_start=q_start):
        _fa3.output_and_lse(q, k_cmp, v_cmp, o, lse, block=block, stride=stride, scale=scale, tail=one_pass)
    else:
        one_pass(0)
    if not scores:
        return o, None
    _launch_scores(q, k_cmp, lse, s, spill, block=block, stride=stride, sel_block=sel_block, scale=scale,
                   q_start=q_start, tiles=tiles)
    return o, s


def _launch_scores(q: Tensor, k_cmp: Tensor, lse: Tensor, s: Tensor, spill: Tensor | None, *, block: int,
                   stride: int, sel_block: int, scale: float, q_start: int, tiles: Tiles) -> None:
    """`scores._cmp_scores`: the group scores from the compressed branch's log-sum-exp `lse
    [B, Hq, Tq]` (natural log, +inf on rows that see nothing) into `s` (zeroed; or, with `spill`,
    written without zeroing and the key-tile spills into `spill`)."""
    b, tq, hq, dk = q.shape
    tc, hkv = k_cmp.shape[1], k_cmp.shape[2]
    group = hq // hkv
    exact = q.dtype == torch.float32
    r, e = _stride_map(block, stride, sel_block, tiles)
    bq, bk = tiles.scr_bq, tiles.scr_bk
    sp = spill if spill is not None else s
    qt = tiles.scr_qt
    _scr._cmp_scores[(triton.cdiv(tc, bk), triton.cdiv(tq, bq * qt), b * hkv)](
        q, k_cmp, lse, s, sp, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), lse.stride(0), lse.stride(1), s.stride(0), s.stride(1), s.stride(2), sp.stride(0),
        sp.stride(1), sp.stride(2), tq, tc, s.shape[-1], q_start, scale * LOG2E,
        HKV=hkv, G=group, CMP_BLOCK=block, STRIDE=stride, R=r, E=e, BQ=bq, BK=bk, DK=dk, BDK=np2(dk), IEEE=exact,
        SPILL=spill is not None, QT=qt, GATHER=tiles.scr_gather, **tiles.launch("scr"))


def select_from_lse(q: Tensor, k_cmp: Tensor, lse: Tensor, *, block: int, stride: int, sel_block: int,
                    sel_count: int, scale: float, q_start: int, tiles: Tiles) -> Tensor | None:
    """The top-n blocks `[B, Tq, Hkv, sel_count]` (int32) from a compressed pass already made (its
    log-sum-exp `lse [B, Hq, Tq]`, natural log): the scores kernel, then top-n, as
    `compressed_select` finds them after its own pass. A training forward, which keeps its
    log-sum-exp for the backward, so needs no second compressed pass. None where the scores
    kernel's block map does not apply (`_stride_map`): the caller runs `compressed_select`."""
    tq, tc = q.shape[1], k_cmp.shape[1]
    if tq == 0 or tc == 0 or _stride_map(block, stride, sel_block, tiles) is None:
        return None
    q, k_cmp = unit_last_stride(q, k_cmp)
    nb = (q_start + tq - 1) // sel_block + 1
    s = torch.zeros(q.shape[0], tq, k_cmp.shape[2], nb, dtype=torch.float32, device=q.device)
    _launch_scores(q, k_cmp, lse.contiguous(), s, None, block=block, stride=stride, sel_block=sel_block,
                   scale=scale, q_start=q_start, tiles=tiles)
    return _topn.topn(s, q_start, sel_block=sel_block, sel_count=sel_count, tiles=tiles)


def compressed_fa3(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, scale: float,
                   tiles: Tiles) -> Tensor:
    """The compressed branch of a prefill through FlashAttention-3 whatever the tiles' FA-3 settings
    (the `fa3` backend, nsa/backends/fa3.py): FA-3 for the whole steps of `stride` queries, the
    one-pass kernel for a partial last step; no scores. The caller checks `_fa3.usable` first."""
    b, tq, hq, _ = q.shape
    q, k_cmp, v_cmp = unit_last_stride(q, k_cmp, v_cmp)
    o = common.empty_out(b, tq, hq, v_cmp.shape[-1], dtype=q.dtype, device=q.device)
    forced = dataclasses.replace(tiles, cmp_fa3=True, cmp_fa3_min_group=1, cmp_fa3_g1=True, cmp_fa3_min_work=0)
    s = torch.zeros(b, tq, k_cmp.shape[2], 1, dtype=torch.float32, device=q.device)
    return _compressed_lse(q, k_cmp, v_cmp, o, s, block=block, stride=stride, sel_block=16, scale=scale, q_start=0,
                           scores=False, tiles=forced)[0]
