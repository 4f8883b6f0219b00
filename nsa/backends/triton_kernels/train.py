"""Training kernels: the three branches' forward with a saved log-sum-exp, and their backward.

The inference kernels (compressed.py, selection*.py, sliding.py) keep no softmax statistics; the
kernels here save, per (query, head) row and branch, the log-sum-exp `lse` in log2 units
(`m + log2(l)` of the logits times `scale * log2 e`; `+inf` for a row that sees no key, so that
every probability the backward rebuilds there is exactly 0), and the backward rebuilds the
probabilities from it, FlashAttention-2 style:

    p = exp2(q.k * scale * log2 e - lse)      delta = rowsum(dO * O)
    dV = p^T dO      dP = dO V^T      dS = p * (dP - delta)      dQ = scale dS K      dK = scale dS^T Q

Two families, both deterministic (no atomics; every sum runs in a fixed order):

* **Band** (`band_*`): the sliding window and the compressed branch, one kernel set with a key
  position rule: key j sits at position `koff + j * kstride` and query t sees it iff that is
  `<= t` (and, for the window, `> t - w`). Window: `koff = k_start, kstride = 1`; compressed:
  `koff = l - 1, kstride = d` (token i is complete at raw position `i*d + l - 1`). dQ: one program
  per (query tile, query head). dK/dV: one program per (key tile, KV head) looping over every
  query head of its group and every query tile that sees the key tile, so GQA's sum over heads
  stays in registers.
* **Selected** (`sel_*`): forward and dQ one program per (query, KV group), the group's heads as
  rows, over the query's block list; for groups under 16 heads (`_selp_*`), 16 / G consecutive
  queries per program, over the union of their blocks, each row masked to its own (H100, 64k:
  16/16 heads 187.3 -> 148.2 ms a step, 32/8 142.6 -> 137.2; results/h100/train/). dK/dV block-centric: the index lists are inverted on the
  device (a sort of (block, query) pairs per KV group: for each block, the queries that chose it,
  ascending), the lists are cut into work items of at most `chunk` queries (the forced block 0
  is chosen by every query; cut, it does not hold one program for T queries), each item writes
  fp32 partials, and a second kernel sums each block's items in order. No atomics, so the
  result is the same bit for bit on every run, under `torch.use_deterministic_algorithms` too.

Rows with no visible key and `-1` slots give exact zeros, never NaN. The top-n selection itself
has no gradient (its indices are discrete; docs/nsa.md, "Training").
Launch parameters come from `Tiles` (`trn_*`); all run under `TRITON_INTERPRET=1` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels.common import (
    LOG2E,
    _dot,
    _program_bh,
    _pv,
    _softmax_step,
    np2,
    unit_last_stride,
)
from nsa.backends.triton_kernels.tiles import Tiles, interpreting

WIN, CMP = 0, 1


# --- shared pieces ---------------------------------------------------------------------------
@triton.jit
def _tile(X, row_off, ok, BD: tl.constexpr, D: tl.constexpr):
    """Rows of X at element offsets `row_off` (int64), columns `:D` padded to BD; 0 where not `ok`."""
    offs = tl.arange(0, BD)
    return tl.load(X + row_off[:, None] + offs[None, :], mask=ok[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def _store_tile(X, row_off, ok, x, BD: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, BD)
    tl.store(X + row_off[:, None] + offs[None, :], x.to(X.dtype.element_ty), mask=ok[:, None] & (offs[None, :] < D))


@triton.jit
def _finish(acc, m_i, l_i):
    """Output rows and their log-sum-exp (log2 units; +inf on a row that saw no key)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    return o, tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))


@triton.jit
def _grad_tile(q, k, v, do, lse, delta, vis, qk_scale2, IEEE: tl.constexpr):
    """p rebuilt from the saved log-sum-exp (0 where not `vis`), and dS = p * (dO V^T - delta)."""
    p = tl.where(vis, tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale2 - lse[:, None]), 0.0)
    return p, p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])


# --- band: sliding window and compressed ------------------------------------------------------
@triton.jit
def _band_keys(t_first, t_last, koff, kstride, window, Tk, MODE: tl.constexpr):
    """Key index range [lo, hi) that queries t_first..t_last can see."""
    if MODE == 0:
        lo = tl.maximum(t_first - window + 1 - koff, 0)
        hi = tl.minimum(t_last - koff + 1, Tk)
    else:
        lo = t_first * 0
        hi = tl.where(t_last >= koff, tl.minimum((t_last - koff) // kstride + 1, Tk), 0)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _band_visible(t_abs, kpos, window, MODE: tl.constexpr):
    vis = kpos[None, :] <= t_abs[:, None]
    if MODE == 0:
        vis = vis & (kpos[None, :] > t_abs[:, None] - window)
    return vis


@triton.jit
def _band_rows(Q, pid_m, sqb, sqt, sqh, Tq, Tk, q_start, koff, kstride, window, G: tl.constexpr,
               HQ: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr):
    """A (query tile, query head) program's rows (grid: query tiles x B*Hq): batch, heads, query
    offsets, positions, the queries, and the key range [lo, hi) they can see."""
    _, b, hq = _program_bh(1, HQ)
    offs_m = pid_m * BM + tl.arange(0, BM)
    row_ok = offs_m < Tq
    q = _tile(Q, b * sqb + offs_m.to(tl.int64) * sqt + hq * sqh, row_ok, BDK, DK)
    t_first = q_start + pid_m * BM
    t_last = q_start + tl.minimum(pid_m * BM + BM, Tq) - 1
    lo, hi = _band_keys(t_first, t_last, koff, kstride, window, Tk, MODE)
    return b, hq, hq // G, offs_m, row_ok, q_start + offs_m, q, lo, hi


@triton.jit
def _band_kv(K, V, b, hk, j0, Tk, skb, skt, skh, svb, svt, svh, BN: tl.constexpr, BDK: tl.constexpr,
             DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr):
    """Keys and values `[j0, j0 + BN)` of KV head hk, and which of them exist."""
    offs_n = j0 + tl.arange(0, BN)
    in_k = offs_n < Tk
    rows = offs_n.to(tl.int64)
    k = _tile(K, b * skb + rows * skt + hk * skh, in_k, BDK, DK)
    v = _tile(V, b * svb + rows * svt + hk * svh, in_k, BDV, DV)
    return offs_n, in_k, k, v


@triton.jit
def _band_fwd(Q, K, V, Out, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
              Tq, Tk, q_start, koff, kstride, window, qk_scale2, NK_HOST: tl.constexpr,
              G: tl.constexpr, HQ: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
              DYN: tl.constexpr):
    b, hq, hk, offs_m, row_ok, t_abs, q, lo, hi = _band_rows(Q, tl.program_id(0), sqb, sqt, sqh,
                                                             Tq, Tk, q_start, koff, kstride, window, G, HQ, MODE,
                                                             BM, BDK, DK)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for j0 in range((lo // BN) * BN if DYN else 0, hi if DYN else NK_HOST, BN):   # interpreter: host bounds
        offs_n, in_k, k, v = _band_kv(K, V, b, hk, j0, Tk, skb, skt, skh, svb, svt, svh, BN, BDK, DK, BDV, DV)
        vis = _band_visible(t_abs, koff + offs_n * kstride, window, MODE) & in_k[None, :]
        s = tl.where(vis, _dot(q, tl.trans(k), IEEE) * qk_scale2, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    _store_tile(Out, b * sob + offs_m.to(tl.int64) * sot + hq * soh, row_ok, o, BDV, DV)
    tl.store(LSE + b * slb + hq * slh + offs_m, lse, mask=row_ok)


@triton.jit
def _band_dq(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
             Tq, Tk, q_start, koff, kstride, window, qk_scale2, scale, NK_HOST: tl.constexpr,
             G: tl.constexpr, HQ: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
             DYN: tl.constexpr):
    """dQ of one (query tile, query head); DO and DQ share Q's / O's strides (sob.. for DO, sqb.. for DQ)."""
    b, hq, hk, offs_m, row_ok, t_abs, q, lo, hi = _band_rows(Q, tl.program_id(0), sqb, sqt, sqh,
                                                             Tq, Tk, q_start, koff, kstride, window, G, HQ, MODE,
                                                             BM, BDK, DK)
    do = _tile(DO, b * sob + offs_m.to(tl.int64) * sot + hq * soh, row_ok, BDV, DV)
    lse = tl.load(LSE + b * slb + hq * slh + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + hq * slh + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BM, BDK], tl.float32)
    for j0 in range((lo // BN) * BN if DYN else 0, hi if DYN else NK_HOST, BN):   # interpreter: host bounds
        offs_n, in_k, k, v = _band_kv(K, V, b, hk, j0, Tk, skb, skt, skh, svb, svt, svh, BN, BDK, DK, BDV, DV)
        vis = _band_visible(t_abs, koff + offs_n * kstride, window, MODE) & in_k[None, :]
        _, ds = _grad_tile(q, k, v, do, lse, delta, vis, qk_scale2, IEEE)
        dq += _pv(ds, k, IEEE)
    _store_tile(DQ, b * sqb + offs_m.to(tl.int64) * sqt + hq * sqh, row_ok, dq * scale, BDK, DK)


@triton.jit
def _band_dkdv(Q, K, V, DO, LSE, DELTA, DK_, DV_, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
               slb, slh, Tq, Tk, q_start, koff, kstride, window, qk_scale2, scale, NQ_HOST: tl.constexpr,
               sdkb, sdkt, sdkh, sdvb, sdvt, sdvh,
               G: tl.constexpr, HKV: tl.constexpr, NSPLIT: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
               IEEE: tl.constexpr, DYN: tl.constexpr):
    """dK/dV of one (key tile, KV head, part of the group): the part's G / NSPLIT query heads, every
    query tile that sees the keys, summed in registers; stored at head `hk * NSPLIT + part` of
    DK_/DV_ (NSPLIT 1: the gradients themselves; else fp32 partials the caller sums over parts)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // (HKV * NSPLIT)).to(tl.int64)
    hk = (bh // NSPLIT) % HKV
    part = bh % NSPLIT
    HPP: tl.constexpr = G // NSPLIT
    offs_n, in_k, k, v = _band_kv(K, V, b, hk, pid_n * BN, Tk, skb, skt, skh, svb, svt, svh, BN, BDK, DK, BDV, DV)
    kpos = koff + offs_n * kstride
    # Queries (indices into Q) that can see a key of this tile.
    p_first = koff + pid_n * BN * kstride
    p_last = koff + (tl.minimum(pid_n * BN + BN, Tk) - 1) * kstride
    i_lo = tl.maximum(p_first - q_start, 0)
    if MODE == 0:
        i_hi = tl.minimum(p_last + window - q_start, Tq)
    else:
        i_hi = Tq + p_first * 0
    i_hi = tl.maximum(i_hi, i_lo)
    dk = tl.zeros([BN, BDK], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    for g in range(0, HPP):
        hq = hk * G + part * HPP + g
        for m0 in range((i_lo // BM) * BM if DYN else 0, i_hi if DYN else NQ_HOST, BM):   # interpreter: host bounds
            offs_m = m0 + tl.arange(0, BM)
            row_ok = offs_m < Tq
            rows = offs_m.to(tl.int64)
            q = _tile(Q, b * sqb + rows * sqt + hq * sqh, row_ok, BDK, DK)
            do = _tile(DO, b * sob + rows * sot + hq * soh, row_ok, BDV, DV)
            lse = tl.load(LSE + b * slb + hq * slh + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + b * slb + hq * slh + offs_m, mask=row_ok, other=0.0)
            vis = _band_visible(q_start + offs_m, kpos, window, MODE) & in_k[None, :]
            p, ds = _grad_tile(q, k, v, do, lse, delta, vis, qk_scale2, IEEE)   # [BM, BN]
            dv += _pv(tl.trans(p), do, IEEE)
            dk += _pv(tl.trans(ds), q, IEEE)
    ho = hk * NSPLIT + part
    rows = offs_n.to(tl.int64)
    _store_tile(DK_, b * sdkb + rows * sdkt + ho * sdkh, in_k, dk * scale, BDK, DK)
    _store_tile(DV_, b * sdvb + rows * sdvt + ho * sdvh, in_k, dv, BDV, DV)


def _band_geometry(mode: int, *, window: int, block: int, stride: int, k_start: int) -> tuple[int, int, int]:
    """(koff, kstride, window) of the band rule for one branch."""
    if mode == WIN:
        return k_start, 1, window
    return block - 1, stride, 0


def band_forward(q: Tensor, k: Tensor, v: Tensor, *, mode: int, window: int, block: int, stride: int, scale: float,
                 q_start: int, k_start: int, tiles: Tiles) -> tuple[Tensor, Tensor]:
    """Window (`mode=WIN`, keys at `k_start ..`) or compressed (`mode=CMP`, compressed keys) attention
    -> (`o [B, Tq, Hq, dv]`, `lse [B, Hq, Tq]` fp32, log2 units, +inf on empty rows)."""
    q, k, v = unit_last_stride(q, k, v)
    b, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    o = torch.empty(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
    if tq == 0:
        return o, lse
    if tk == 0:
        return o.zero_(), lse.fill_(float("inf"))
    koff, kstr, win = _band_geometry(mode, window=window, block=block, stride=stride, k_start=k_start)
    bm, bn = tiles.trn_bm, tiles.trn_bn
    _band_fwd[(triton.cdiv(tq, bm), b * hq)](
        q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        tq, tk, q_start, koff, kstr, win, scale * LOG2E, tk,
        G=hq // hkv, HQ=hq, MODE=mode, BM=bm, BN=bn, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
        IEEE=q.dtype == torch.float32, DYN=not interpreting(), **tiles.launch("trn"))
    return o, lse


def _delta(o: Tensor, do: Tensor) -> Tensor:
    """rowsum(dO * O) `[B, Hq, Tq]` fp32."""
    return (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()


def band_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, *, mode: int, window: int,
                  block: int, stride: int, scale: float, q_start: int, k_start: int,
                  tiles: Tiles) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `band_forward`'s output for the upstream gradient `do`."""
    q, k, v, o, do = (x.contiguous() for x in (q, k, v, o, do))
    b, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    dq = torch.empty_like(q)
    dk_ = torch.empty_like(k)
    dv_ = torch.empty_like(v)
    if tq == 0 or tk == 0:
        return dq.zero_(), dk_.zero_(), dv_.zero_()
    delta = _delta(o, do)
    lse = lse.contiguous()
    koff, kstr, win = _band_geometry(mode, window=window, block=block, stride=stride, k_start=k_start)
    bm, bn = tiles.trn_bm, tiles.trn_bn
    common = dict(MODE=mode, BM=bm, BN=bn, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv), IEEE=q.dtype == torch.float32,
                  DYN=not interpreting(), **tiles.launch("trn"))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
               v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1))
    geo = (tq, tk, q_start, koff, kstr, win, scale * LOG2E, scale)
    _band_dq[(triton.cdiv(tq, bm), b * hq)](q, k, v, do, lse, delta, dq, *strides, *geo, tk, G=hq // hkv, HQ=hq,
                                            **common)
    # The compressed branch's key tiles are few (T / d / BN per KV head) and each is read by every
    # later query: one program per query head, fp32 partials summed over the group after, keeps
    # the GPU full. The window's key tiles are many and each is read by w queries only.
    group = hq // hkv
    nsplit = group if mode == CMP and group > 1 else 1
    if nsplit > 1:
        pk = torch.empty(b, tk, hkv * nsplit, dk, dtype=torch.float32, device=q.device)
        pv = torch.empty(b, tk, hkv * nsplit, dv, dtype=torch.float32, device=q.device)
    else:
        pk, pv = dk_, dv_
    _band_dkdv[(triton.cdiv(tk, bn), b * hkv * nsplit)](
        q, k, v, do, lse, delta, pk, pv, *strides, *geo, tq, pk.stride(0), pk.stride(1), pk.stride(2), pv.stride(0),
        pv.stride(1), pv.stride(2), G=group, HKV=hkv, NSPLIT=nsplit, **common)
    if nsplit > 1:   # a fixed-order sum over the group's heads: deterministic
        dk_.copy_(pk.view(b, tk, hkv, nsplit, dk).sum(3))
        dv_.copy_(pv.view(b, tk, hkv, nsplit, dv).sum(3))
    return dq, dk_, dv_


# --- selected ---------------------------------------------------------------------------------
@triton.jit
def _sel_rows(Q, b, i, hk, sqb, sqt, sqh, G: tl.constexpr, RP: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr):
    """One query's rows: the heads of group hk (RP >= G rows, the rest masked) and their queries."""
    g = tl.arange(0, RP)
    ok = g < G
    heads = hk * G + g
    return heads, ok, _tile(Q, b * sqb + i.to(tl.int64) * sqt + heads * sqh, ok, BDK, DK)


@triton.jit
def _sel_block(K, V, IDX, b, i, hk, s_, t, k_start, Tk, sib, sit, sih, skb, skt, skh, svb, svt, svh,
               SEL_BLOCK: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr):
    """Slot s_ of query i's block list: the block's keys and values `<= t` (none for a -1 slot)."""
    blk = tl.load(IDX + b * sib + i.to(tl.int64) * sit + hk * sih + s_)
    tok = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    kp = tok - k_start
    valid = (blk >= 0) & (tok <= t) & (kp >= 0) & (kp < Tk)
    rows = kp.to(tl.int64)
    return valid, _tile(K, b * skb + rows * skt + hk * skh, valid, BDK, DK), \
        _tile(V, b * svb + rows * svt + hk * svh, valid, BDV, DV)


@triton.jit
def _sel_fwd(Q, K, V, IDX, Out, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, sib, sit, sih,
             slb, slh, Tq, Tk, q_start, k_start, qk_scale2, NSEL: tl.constexpr,
             G: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr, SEL_BLOCK: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    """One (query, KV group): the group's heads as rows, over the query's blocks."""
    i = tl.program_id(0)
    bh, b, hk = _program_bh(1, HKV)
    heads, ok, q = _sel_rows(Q, b, i, hk, sqb, sqt, sqh, G, RP, BDK, DK)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, BDV], tl.float32)
    for s_ in range(0, NSEL):
        valid, k, v = _sel_block(K, V, IDX, b, i, hk, s_, q_start + i, k_start, Tk, sib, sit, sih, skb, skt, skh,
                                 svb, svt, svh, SEL_BLOCK, BDK, DK, BDV, DV)
        s = tl.where(valid[None, :], _dot(q, tl.trans(k), IEEE) * qk_scale2, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    _store_tile(Out, b * sob + i.to(tl.int64) * sot + heads * soh, ok, o, BDV, DV)
    tl.store(LSE + b * slb + heads * slh + i, lse, mask=ok)


@triton.jit
def _sel_dq(Q, K, V, DO, IDX, LSE, DELTA, DQ, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
            sib, sit, sih, slb, slh, Tq, Tk, q_start, k_start, qk_scale2, scale, NSEL: tl.constexpr,
            G: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr, SEL_BLOCK: tl.constexpr, DK: tl.constexpr,
            DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    bh, b, hk = _program_bh(1, HKV)
    heads, ok, q = _sel_rows(Q, b, i, hk, sqb, sqt, sqh, G, RP, BDK, DK)
    do = _tile(DO, b * sob + i.to(tl.int64) * sot + heads * soh, ok, BDV, DV)
    lse = tl.load(LSE + b * slb + heads * slh + i, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + heads * slh + i, mask=ok, other=0.0)
    dq = tl.zeros([RP, BDK], tl.float32)
    for s_ in range(0, NSEL):
        valid, k, v = _sel_block(K, V, IDX, b, i, hk, s_, q_start + i, k_start, Tk, sib, sit, sih, skb, skt, skh,
                                 svb, svt, svh, SEL_BLOCK, BDK, DK, BDV, DV)
        _, ds = _grad_tile(q, k, v, do, lse, delta, valid[None, :], qk_scale2, IEEE)
        dq += _pv(ds, k, IEEE)
    _store_tile(DQ, b * sqb + i.to(tl.int64) * sqt + heads * sqh, ok, dq * scale, BDK, DK)


# Small groups (G < 16): one (query, group) per program would pad G heads to 16 rows and load each
# query's blocks for its G rows alone (at G = 1 the selected branch took 150 of 189 ms at 64k, 16/16
# heads, H200). Instead QP = 16 / G consecutive queries share a program: rows (query, head), the
# union of their blocks loaded once each (`union_lists`), each row masked to its own blocks.
@triton.jit
def _selp_rows(Q, IDX, b, c, hk, Tq, sqb, sqt, sqh, sib, sit, sih, NSEL: tl.constexpr, G: tl.constexpr,
               GP: tl.constexpr, RP: tl.constexpr, NP: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr):
    """Rows (query c * QP + r // GP, head r % GP of group hk), their queries and block lists."""
    r = tl.arange(0, RP)
    i = c * (RP // GP) + r // GP
    g = r % GP
    ok = (g < G) & (i < Tq)
    heads = hk * G + g
    q = _tile(Q, b * sqb + i.to(tl.int64) * sqt + heads * sqh, ok, BDK, DK)
    sl = tl.arange(0, NP)
    lists = tl.load(IDX + b * sib + i.to(tl.int64)[:, None] * sit + hk * sih + sl[None, :],
                    mask=ok[:, None] & (sl[None, :] < NSEL), other=-1)
    return i, heads, ok, q, lists


@triton.jit
def _selp_block(K, V, U, urow, s_, i, lists, q_start, k_start, Tk, skb, skt, skh, svb, svt, svh, b, hk,
                SEL_BLOCK: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr):
    """Union slot s_: the block's keys and values, and which (row, key) pairs see them."""
    blk = tl.load(U + urow + s_)
    tok = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    kp = tok - k_start
    in_k = (blk >= 0) & (kp >= 0) & (kp < Tk)
    rows = kp.to(tl.int64)
    k = _tile(K, b * skb + rows * skt + hk * skh, in_k, BDK, DK)
    v = _tile(V, b * svb + rows * svt + hk * svh, in_k, BDV, DV)
    mine = tl.sum((lists == blk).to(tl.int32), 1) > 0
    vis = mine[:, None] & in_k[None, :] & (tok[None, :] <= (q_start + i)[:, None])
    return vis, k, v


@triton.jit
def _selp_fwd_step(K, V, U, urow, s_, i, lists, q, m_i, l_i, acc, q_start, k_start, Tk, skb, skt, skh, svb, svt,
                   svh, b, hk, qk_scale2, SEL_BLOCK: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr,
                   BDV: tl.constexpr, DV: tl.constexpr, IEEE: tl.constexpr):
    vis, k, v = _selp_block(K, V, U, urow, s_, i, lists, q_start, k_start, Tk, skb, skt, skh, svb, svt, svh,
                            b, hk, SEL_BLOCK, BDK, DK, BDV, DV)
    s = tl.where(vis, _dot(q, tl.trans(k), IEEE) * qk_scale2, float("-inf"))
    return _softmax_step(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def _selp_dq_step(K, V, U, urow, s_, i, lists, q, do, lse, delta, dq, q_start, k_start, Tk, skb, skt, skh, svb, svt,
                  svh, b, hk, qk_scale2, SEL_BLOCK: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr,
                  BDV: tl.constexpr, DV: tl.constexpr, IEEE: tl.constexpr):
    vis, k, v = _selp_block(K, V, U, urow, s_, i, lists, q_start, k_start, Tk, skb, skt, skh, svb, svt, svh,
                            b, hk, SEL_BLOCK, BDK, DK, BDV, DV)
    _, ds = _grad_tile(q, k, v, do, lse, delta, vis, qk_scale2, IEEE)
    return dq + _pv(ds, k, IEEE)


@triton.jit
def _selp_fwd(Q, K, V, IDX, U, CNT, Out, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
              sib, sit, sih, slb, slh, Tq, Tk, q_start, k_start, qk_scale2, C, NU_HOST: tl.constexpr,
              NSEL: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr,
              NP: tl.constexpr, NU: tl.constexpr, SEL_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr, DYN: tl.constexpr):
    """QP queries x the group's heads as rows, over the union of the queries' blocks."""
    c = tl.program_id(0)
    bh, b, hk = _program_bh(1, HKV)
    i, heads, ok, q, lists = _selp_rows(Q, IDX, b, c, hk, Tq, sqb, sqt, sqh, sib, sit, sih, NSEL, G, GP, RP, NP,
                                        BDK, DK)
    urow = (bh.to(tl.int64) * C + c) * NU
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, BDV], tl.float32)
    if DYN:
        for s_ in range(0, tl.load(CNT + bh * C + c)):
            m_i, l_i, acc = _selp_fwd_step(K, V, U, urow, s_, i, lists, q, m_i, l_i, acc, q_start, k_start, Tk,
                                           skb, skt, skh, svb, svt, svh, b, hk, qk_scale2, SEL_BLOCK, BDK, DK, BDV, DV, IEEE)
    else:   # the interpreter takes host-int loop bounds only
        for s_ in range(0, NU_HOST):
            m_i, l_i, acc = _selp_fwd_step(K, V, U, urow, s_, i, lists, q, m_i, l_i, acc, q_start, k_start, Tk,
                                           skb, skt, skh, svb, svt, svh, b, hk, qk_scale2, SEL_BLOCK, BDK, DK, BDV, DV, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    _store_tile(Out, b * sob + i.to(tl.int64) * sot + heads * soh, ok, o, BDV, DV)
    tl.store(LSE + b * slb + heads * slh + i, lse, mask=ok)


@triton.jit
def _selp_dq(Q, K, V, DO, IDX, U, CNT, LSE, DELTA, DQ, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
             sib, sit, sih, slb, slh, Tq, Tk, q_start, k_start, qk_scale2, scale, C, NU_HOST: tl.constexpr,
             NSEL: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr,
             NP: tl.constexpr, NU: tl.constexpr, SEL_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr, DYN: tl.constexpr):
    c = tl.program_id(0)
    bh, b, hk = _program_bh(1, HKV)
    i, heads, ok, q, lists = _selp_rows(Q, IDX, b, c, hk, Tq, sqb, sqt, sqh, sib, sit, sih, NSEL, G, GP, RP, NP,
                                        BDK, DK)
    do = _tile(DO, b * sob + i.to(tl.int64) * sot + heads * soh, ok, BDV, DV)
    lse = tl.load(LSE + b * slb + heads * slh + i, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + heads * slh + i, mask=ok, other=0.0)
    urow = (bh.to(tl.int64) * C + c) * NU
    dq = tl.zeros([RP, BDK], tl.float32)
    if DYN:
        for s_ in range(0, tl.load(CNT + bh * C + c)):
            dq = _selp_dq_step(K, V, U, urow, s_, i, lists, q, do, lse, delta, dq, q_start, k_start, Tk,
                               skb, skt, skh, svb, svt, svh, b, hk, qk_scale2, SEL_BLOCK, BDK, DK, BDV, DV, IEEE)
    else:   # the interpreter takes host-int loop bounds only
        for s_ in range(0, NU_HOST):
            dq = _selp_dq_step(K, V, U, urow, s_, i, lists, q, do, lse, delta, dq, q_start, k_start, Tk,
                               skb, skt, skh, svb, svt, svh, b, hk, qk_scale2, SEL_BLOCK, BDK, DK, BDV, DV, IEEE)
    _store_tile(DQ, b * sqb + i.to(tl.int64) * sqt + heads * sqh, ok, dq * scale, BDK, DK)


@triton.jit
def _sel_dkdv_step(Q, DO, LSE, DELTA, QLIST, b, bh, hk, e0, e_hi, k, v, tok, in_k, dk, dv,
                   sqb, sqt, sqh, sob, sot, soh, slb, slh, q_start, qk_scale2, NL,
                   G: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    """BQ list entries (queries) x the group's heads as rows against one block's keys."""
    M: tl.constexpr = BQ * GP
    r = tl.arange(0, M)
    g = r % GP
    e = e0 + r // GP
    ok = (e < e_hi) & (g < G)
    qi = tl.load(QLIST + bh.to(tl.int64) * NL + e, mask=ok, other=0)
    heads = hk * G + g
    rows = qi.to(tl.int64)
    q = _tile(Q, b * sqb + rows * sqt + heads * sqh, ok, BDK, DK)
    do = _tile(DO, b * sob + rows * sot + heads * soh, ok, BDV, DV)
    lse = tl.load(LSE + b * slb + heads * slh + qi, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + heads * slh + qi, mask=ok, other=0.0)
    vis = ok[:, None] & in_k[None, :] & (tok[None, :] <= (q_start + qi)[:, None])
    p, ds = _grad_tile(q, k, v, do, lse, delta, vis, qk_scale2, IEEE)   # [M, SEL_BLOCK]
    return dk + _pv(tl.trans(ds), q, IEEE), dv + _pv(tl.trans(p), do, IEEE)


@triton.jit
def _sel_dkdv_part(Q, K, V, DO, LSE, DELTA, QLIST, OFF, ITEM_BLK, ITEM_OFF, PK, PV,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
                   Tq, Tk, q_start, k_start, qk_scale2, NB, W, NL, CH, NSTEP_HOST: tl.constexpr,
                   G: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, SEL_BLOCK: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
                   DYN: tl.constexpr):
    """Work item `w` of (batch, KV group) `bh`: at most CH queries of one block's list -> fp32
    partials of that block's dK/dV (unscaled dK) at PK/PV[bh, w]."""
    w = tl.program_id(0)
    bh = tl.program_id(1)
    blk = tl.load(ITEM_BLK + bh * W + w)
    if blk < NB:
        b = (bh // HKV).to(tl.int64)
        hk = bh % HKV
        first = tl.load(OFF + bh * (NB + 1) + blk)
        end = tl.load(OFF + bh * (NB + 1) + blk + 1)
        c = w - tl.load(ITEM_OFF + bh * (NB + 1) + blk)
        e_lo = first + c * CH
        e_hi = tl.minimum(end, e_lo + CH)
        tok = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
        kp = tok - k_start
        in_k = (kp >= 0) & (kp < Tk)
        k = _tile(K, b * skb + kp.to(tl.int64) * skt + hk * skh, in_k, BDK, DK)
        v = _tile(V, b * svb + kp.to(tl.int64) * svt + hk * svh, in_k, BDV, DV)
        dk = tl.zeros([SEL_BLOCK, BDK], tl.float32)
        dv = tl.zeros([SEL_BLOCK, BDV], tl.float32)
        if DYN:
            for e0 in range(e_lo, e_hi, BQ):
                dk, dv = _sel_dkdv_step(Q, DO, LSE, DELTA, QLIST, b, bh, hk, e0, e_hi, k, v, tok, in_k, dk, dv,
                                        sqb, sqt, sqh, sob, sot, soh, slb, slh, q_start, qk_scale2, NL,
                                        G, GP, BQ, DK, DV, BDK, BDV, IEEE)
        else:   # the interpreter takes host-int loop bounds only
            for st in range(0, NSTEP_HOST):
                dk, dv = _sel_dkdv_step(Q, DO, LSE, DELTA, QLIST, b, bh, hk, e_lo + st * BQ, e_hi, k, v, tok, in_k,
                                        dk, dv, sqb, sqt, sqh, sob, sot, soh, slb, slh, q_start, qk_scale2, NL,
                                        G, GP, BQ, DK, DV, BDK, BDV, IEEE)
        rows = (bh.to(tl.int64) * W + w) * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
        tl.store(PK + rows[:, None] * BDK + tl.arange(0, BDK)[None, :], dk)
        tl.store(PV + rows[:, None] * BDV + tl.arange(0, BDV)[None, :], dv)


@triton.jit
def _sel_sum_step(PK, PV, bh, w, hi, W, dk, dv, SEL_BLOCK: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    use = w < hi
    rows = (bh.to(tl.int64) * W + w) * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    dk += tl.load(PK + rows[:, None] * BDK + tl.arange(0, BDK)[None, :], mask=use, other=0.0)
    dv += tl.load(PV + rows[:, None] * BDV + tl.arange(0, BDV)[None, :], mask=use, other=0.0)
    return dk, dv


@triton.jit
def _sel_dkdv_sum(PK, PV, ITEM_OFF, DK_, DV_, skb, skt, skh, svb, svt, svh, Tk, k_start, scale, NB, W,
                  NIT_HOST: tl.constexpr, HKV: tl.constexpr, SEL_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BDK: tl.constexpr, BDV: tl.constexpr, DYN: tl.constexpr):
    """dK/dV of block `blk` of (batch, KV group) `bh`: its work items' partials summed in order."""
    blk = tl.program_id(0)
    bh, b, hk = _program_bh(1, HKV)
    lo = tl.load(ITEM_OFF + bh * (NB + 1) + blk)
    hi = tl.load(ITEM_OFF + bh * (NB + 1) + blk + 1)
    dk = tl.zeros([SEL_BLOCK, BDK], tl.float32)
    dv = tl.zeros([SEL_BLOCK, BDV], tl.float32)
    if DYN:
        for w in range(lo, hi):
            dk, dv = _sel_sum_step(PK, PV, bh, w, hi, W, dk, dv, SEL_BLOCK, BDK, BDV)
    else:   # the interpreter takes host-int loop bounds only
        for j in range(0, NIT_HOST):
            dk, dv = _sel_sum_step(PK, PV, bh, lo + j, hi, W, dk, dv, SEL_BLOCK, BDK, BDV)
    kp = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK) - k_start
    in_k = (kp >= 0) & (kp < Tk)
    _store_tile(DK_, b * skb + kp.to(tl.int64) * skt + hk * skh, in_k, dk * scale, BDK, DK)
    _store_tile(DV_, b * svb + kp.to(tl.int64) * svt + hk * svh, in_k, dv, BDV, DV)


def _sel_rows_pad(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def _queries_per_program(group: int) -> int:
    """Queries a selected forward / dQ program takes: 16 rows of (query, head), at least one query."""
    return max(1, _sel_rows_pad(group) // triton.next_power_of_2(group))


def union_lists(idx: Tensor, qp: int) -> tuple[Tensor, Tensor]:
    """Per (batch, KV group, chunk of `qp` queries): the distinct blocks of the chunk's rows of `idx
    [B, Tq, Hkv, n]`, ascending, then -1: `u [B*Hkv, C, qp*n]` (int32), and their count `[B*Hkv, C]`.
    On the device (two sorts), no host synchronisation."""
    b, tq, hkv, n = idx.shape
    c = (tq + qp - 1) // qp
    x = idx.to(torch.int32)
    if c * qp != tq:
        x = torch.cat([x, x.new_full((b, c * qp - tq, hkv, n), -1)], 1)
    big = torch.iinfo(torch.int32).max
    x = x.reshape(b, c, qp, hkv, n).permute(0, 3, 1, 2, 4).reshape(b * hkv, c, qp * n)
    srt = torch.where(x >= 0, x, big).sort(-1).values
    dup = torch.cat([torch.zeros_like(srt[..., :1], dtype=torch.bool), srt[..., 1:] == srt[..., :-1]], -1)
    u = torch.where(dup, big, srt).sort(-1).values
    cnt = (u != big).sum(-1, dtype=torch.int32)
    return torch.where(u != big, u, -1).contiguous(), cnt.contiguous()


def _selp_args(q: Tensor, idx: Tensor, group: int) -> tuple[int, Tensor, Tensor, dict]:
    qp = _queries_per_program(group)
    u, cnt = union_lists(idx, qp)
    dyn = not interpreting()
    meta = dict(NSEL=idx.shape[-1], G=group, GP=triton.next_power_of_2(group), RP=_sel_rows_pad(group),
                NP=np2(idx.shape[-1], 1), NU=u.shape[-1], NU_HOST=0 if dyn else u.shape[-1], DYN=dyn)
    return u.shape[1], u, cnt, meta


def selected_forward(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float, q_start: int,
                     k_start: int, tiles: Tiles) -> tuple[Tensor, Tensor]:
    """Selected attention over `idx [B, Tq, Hkv, n]` (distinct blocks per row, -1 padded) ->
    (`o [B, Tq, Hq, dv]`, `lse [B, Hq, Tq]`)."""
    q, k, v = unit_last_stride(q, k, v)
    b, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    o = torch.empty(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
    if tq == 0:
        return o, lse
    group = hq // hkv
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
               v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), idx.stride(0), idx.stride(1),
               idx.stride(2), lse.stride(0), lse.stride(1))
    if _queries_per_program(group) > 1:
        c, u, cnt, meta = _selp_args(q, idx, group)
        _selp_fwd[(c, b * hkv)](q, k, v, idx, u, cnt, o, lse, *strides, tq, tk, q_start, k_start, scale * LOG2E, c,
                                HKV=hkv, SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
                                IEEE=q.dtype == torch.float32, **meta, **tiles.launch("trnsel"))
        return o, lse
    _sel_fwd[(tq, b * hkv)](
        q, k, v, idx, o, lse, *strides, tq, tk, q_start, k_start, scale * LOG2E, idx.shape[-1],
        G=group, HKV=hkv, RP=_sel_rows_pad(group), SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
        IEEE=q.dtype == torch.float32, **tiles.launch("trnsel"))
    return o, lse


def invert(idx: Tensor, *, n_blocks: int, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """The block lists of `idx [B, Tq, Hkv, n]` turned around, per (batch, KV group) `bh`, on the
    device without a host synchronisation: `qlist [BH, Tq*n]` the queries that chose each block,
    block by block, ascending (then unused entries); `off [BH, NB+1]` where each block's queries
    start; work items of at most `chunk` queries: `item_off [BH, NB+1]` each block's first item
    and `item_blk [BH, W]` each item's block (NB past the last item). W bounds the item count."""
    b, tq, hkv, n = idx.shape
    bh = b * hkv
    e = idx.permute(0, 2, 1, 3).reshape(bh, tq * n).long()
    qid = torch.arange(tq, device=idx.device).repeat_interleave(n)
    key = torch.where((e >= 0) & (e < n_blocks), e * tq + qid, torch.full_like(e, n_blocks * tq))
    key = key.sort(dim=1).values
    qlist = key % tq
    bounds = torch.arange(n_blocks + 1, device=idx.device) * tq
    off = torch.searchsorted(key, bounds.expand(bh, -1).contiguous())
    items = (off[:, 1:] - off[:, :-1] + chunk - 1) // chunk
    item_off = torch.cat([items.new_zeros(bh, 1), items.cumsum(1)], 1)
    w = n_blocks + (tq * n + chunk - 1) // chunk
    item_blk = torch.searchsorted(item_off, torch.arange(w, device=idx.device).expand(bh, -1).contiguous(),
                                  right=True) - 1
    return qlist.contiguous(), off.contiguous(), item_off.contiguous(), item_blk.contiguous(), w


def selected_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, o: Tensor, lse: Tensor, *,
                      sel_block: int, scale: float, q_start: int, k_start: int,
                      tiles: Tiles) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, o, do = (x.contiguous() for x in (q, k, v, o, do))
    b, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    dq = torch.empty_like(q)
    dk_ = torch.empty_like(k)
    dv_ = torch.empty_like(v)
    if tq == 0 or tk == 0:
        return dq.zero_(), dk_.zero_(), dv_.zero_()
    delta = _delta(o, do)
    lse = lse.contiguous()
    ieee = q.dtype == torch.float32
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
               v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    if _queries_per_program(group) > 1:
        c, u, cnt, meta = _selp_args(q, idx, group)
        _selp_dq[(c, b * hkv)](
            q, k, v, do, idx, u, cnt, lse, delta, dq, *strides, idx.stride(0), idx.stride(1), idx.stride(2),
            lse.stride(0), lse.stride(1), tq, tk, q_start, k_start, scale * LOG2E, scale, c,
            HKV=hkv, SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv), IEEE=ieee, **meta,
            **tiles.launch("trnsel"))
    else:
        _sel_dq[(tq, b * hkv)](
            q, k, v, do, idx, lse, delta, dq, *strides, idx.stride(0), idx.stride(1), idx.stride(2), lse.stride(0),
            lse.stride(1), tq, tk, q_start, k_start, scale * LOG2E, scale, idx.shape[-1],
            G=group, HKV=hkv, RP=_sel_rows_pad(group), SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
            IEEE=ieee, **tiles.launch("trnsel"))
    n_blocks = (k_start + tk + sel_block - 1) // sel_block
    chunk = tiles.trn_sel_chunk
    qlist, off, item_off, item_blk, w = invert(idx, n_blocks=n_blocks, chunk=chunk)
    bdk, bdv = np2(dk), np2(dv)
    pk = torch.empty(b * hkv, w, sel_block, bdk, dtype=torch.float32, device=q.device)
    pv = torch.empty(b * hkv, w, sel_block, bdv, dtype=torch.float32, device=q.device)
    gp = triton.next_power_of_2(group)
    bq = max(1, tiles.trn_sel_rows // gp)
    dyn = not interpreting()
    _sel_dkdv_part[(w, b * hkv)](
        q, k, v, do, lse, delta, qlist, off, item_blk, item_off, pk, pv, *strides, lse.stride(0), lse.stride(1),
        tq, tk, q_start, k_start, scale * LOG2E, n_blocks, w, qlist.shape[1], chunk,
        0 if dyn else triton.cdiv(chunk, bq),
        G=group, HKV=hkv, GP=gp, BQ=bq, SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=bdk, BDV=bdv, IEEE=ieee, DYN=dyn,
        **tiles.launch("trn"))
    _sel_dkdv_sum[(n_blocks, b * hkv)](
        pk, pv, item_off, dk_, dv_, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        tk, k_start, scale, n_blocks, w, 0 if dyn else triton.cdiv(tq, chunk) + 1,
        HKV=hkv, SEL_BLOCK=sel_block, DK=dk, DV=dv, BDK=bdk, BDV=bdv, DYN=dyn, num_warps=4)
    return dq, dk_, dv_
