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
  rows, over the query's block list. dK/dV block-centric: the index lists are inverted on the
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

from nsa.backends.triton_kernels.common import LOG2E, _dot, np2, unit_last_stride
from nsa.backends.triton_kernels.tiles import Tiles, interpreting

WIN, CMP = 0, 1


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
def _band_fwd(Q, K, V, Out, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
              Tq, Tk, q_start, koff, kstride, window, qk_scale2, NK_HOST: tl.constexpr,
              G: tl.constexpr, HQ: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
              DYN: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    hq = bh % HQ
    hk = hq // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    row_ok = offs_m < Tq
    t_abs = q_start + offs_m
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + offs_m[:, None].to(tl.int64) * sqt + hq * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    t_first = q_start + pid_m * BM
    t_last = q_start + tl.minimum(pid_m * BM + BM, Tq) - 1
    lo, hi = _band_keys(t_first, t_last, koff, kstride, window, Tk, MODE)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for j0 in range((lo // BN) * BN if DYN else 0, hi if DYN else NK_HOST, BN):   # interpreter: host bounds
        offs_n = j0 + tl.arange(0, BN)
        in_k = offs_n < Tk
        k = tl.load(K + b * skb + offs_n[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                    mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + offs_n[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                    mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
        vis = _band_visible(t_abs, koff + offs_n * kstride, window, MODE) & in_k[None, :]
        s = tl.where(vis, _dot(q, tl.trans(k), IEEE) * qk_scale2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(Out + b * sob + offs_m[:, None].to(tl.int64) * sot + hq * soh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + b * slb + hq * slh + offs_m, lse, mask=row_ok)


@triton.jit
def _band_dq(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
             Tq, Tk, q_start, koff, kstride, window, qk_scale2, scale, NK_HOST: tl.constexpr,
             G: tl.constexpr, HQ: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
             DYN: tl.constexpr):
    """dQ of one (query tile, query head); DO and DQ share Q's / O's strides (sob.. for DO, sqb.. for DQ)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    hq = bh % HQ
    hk = hq // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    row_ok = offs_m < Tq
    t_abs = q_start + offs_m
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + offs_m[:, None].to(tl.int64) * sqt + hq * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    do = tl.load(DO + b * sob + offs_m[:, None].to(tl.int64) * sot + hq * soh + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + b * slb + hq * slh + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + hq * slh + offs_m, mask=row_ok, other=0.0)
    t_first = q_start + pid_m * BM
    t_last = q_start + tl.minimum(pid_m * BM + BM, Tq) - 1
    lo, hi = _band_keys(t_first, t_last, koff, kstride, window, Tk, MODE)
    dq = tl.zeros([BM, BDK], tl.float32)
    for j0 in range((lo // BN) * BN if DYN else 0, hi if DYN else NK_HOST, BN):   # interpreter: host bounds
        offs_n = j0 + tl.arange(0, BN)
        in_k = offs_n < Tk
        k = tl.load(K + b * skb + offs_n[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                    mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + offs_n[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                    mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
        vis = _band_visible(t_abs, koff + offs_n * kstride, window, MODE) & in_k[None, :]
        p = tl.where(vis, tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale2 - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + b * sqb + offs_m[:, None].to(tl.int64) * sqt + hq * sqh + offs_dk[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_dk[None, :] < DK))


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
    offs_n = pid_n * BN + tl.arange(0, BN)
    in_k = offs_n < Tk
    kpos = koff + offs_n * kstride
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    k = tl.load(K + b * skb + offs_n[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + offs_n[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
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
            q = tl.load(Q + b * sqb + offs_m[:, None].to(tl.int64) * sqt + hq * sqh + offs_dk[None, :],
                        mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            do = tl.load(DO + b * sob + offs_m[:, None].to(tl.int64) * sot + hq * soh + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(LSE + b * slb + hq * slh + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + b * slb + hq * slh + offs_m, mask=row_ok, other=0.0)
            vis = _band_visible(q_start + offs_m, kpos, window, MODE) & in_k[None, :]
            p = tl.where(vis, tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale2 - lse[:, None]), 0.0)   # [BM, BN]
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            if IEEE:
                dv += tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
                dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    ho = hk * NSPLIT + part
    tl.store(DK_ + b * sdkb + offs_n[:, None].to(tl.int64) * sdkt + ho * sdkh + offs_dk[None, :],
             (dk * scale).to(DK_.dtype.element_ty), mask=in_k[:, None] & (offs_dk[None, :] < DK))
    tl.store(DV_ + b * sdvb + offs_n[:, None].to(tl.int64) * sdvt + ho * sdvh + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=in_k[:, None] & (offs_dv[None, :] < DV))


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
    g = tl.arange(0, RP)
    ok = g < G
    offs_dk = tl.arange(0, BDK)
    q = tl.load(Q + b * sqb + i.to(tl.int64) * sqt + (hk * G + g)[:, None] * sqh + offs_dk[None, :],
                mask=ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    return g, ok, q


@triton.jit
def _sel_fwd(Q, K, V, IDX, Out, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, sib, sit, sih,
             slb, slh, Tq, Tk, q_start, k_start, qk_scale2, NSEL: tl.constexpr,
             G: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    """One (query, KV group): the group's heads as rows, over the query's blocks."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    t = q_start + i
    g, ok, q = _sel_rows(Q, b, i, hk, sqb, sqt, sqh, G, RP, BDK, DK)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, BDV], tl.float32)
    for s_ in range(0, NSEL):
        blk = tl.load(IDX + b * sib + i.to(tl.int64) * sit + hk * sih + s_)
        tok = blk * SB + tl.arange(0, SB)
        kp = tok - k_start
        valid = (blk >= 0) & (tok <= t) & (kp >= 0) & (kp < Tk)
        k = tl.load(K + b * skb + kp[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                    mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kp[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.where(valid[None, :], _dot(q, tl.trans(k), IEEE) * qk_scale2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(Out + b * sob + i.to(tl.int64) * sot + (hk * G + g)[:, None] * soh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=ok[:, None] & (offs_dv[None, :] < DV))
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + b * slb + (hk * G + g) * slh + i, lse, mask=ok)


@triton.jit
def _sel_dq(Q, K, V, DO, IDX, LSE, DELTA, DQ, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
            sib, sit, sih, slb, slh, Tq, Tk, q_start, k_start, qk_scale2, scale, NSEL: tl.constexpr,
            G: tl.constexpr, HKV: tl.constexpr, RP: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr,
            DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    t = q_start + i
    g, ok, q = _sel_rows(Q, b, i, hk, sqb, sqt, sqh, G, RP, BDK, DK)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    heads = hk * G + g
    do = tl.load(DO + b * sob + i.to(tl.int64) * sot + heads[:, None] * soh + offs_dv[None, :],
                 mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + b * slb + heads * slh + i, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + heads * slh + i, mask=ok, other=0.0)
    dq = tl.zeros([RP, BDK], tl.float32)
    for s_ in range(0, NSEL):
        blk = tl.load(IDX + b * sib + i.to(tl.int64) * sit + hk * sih + s_)
        tok = blk * SB + tl.arange(0, SB)
        kp = tok - k_start
        valid = (blk >= 0) & (tok <= t) & (kp >= 0) & (kp < Tk)
        k = tl.load(K + b * skb + kp[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                    mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kp[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        p = tl.where(valid[None, :], tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale2 - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + b * sqb + i.to(tl.int64) * sqt + heads[:, None] * sqh + offs_dk[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=ok[:, None] & (offs_dk[None, :] < DK))


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
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    qi = tl.load(QLIST + bh.to(tl.int64) * NL + e, mask=ok, other=0)
    heads = hk * G + g
    q = tl.load(Q + b * sqb + qi[:, None].to(tl.int64) * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    do = tl.load(DO + b * sob + qi[:, None].to(tl.int64) * sot + heads[:, None] * soh + offs_dv[None, :],
                 mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + b * slb + heads * slh + qi, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + b * slb + heads * slh + qi, mask=ok, other=0.0)
    vis = ok[:, None] & in_k[None, :] & (tok[None, :] <= (q_start + qi)[:, None])
    p = tl.where(vis, tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale2 - lse[:, None]), 0.0)   # [M, SB]
    dp = _dot(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    if IEEE:
        dv += tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
        dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
    else:
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    return dk, dv


@triton.jit
def _sel_dkdv_part(Q, K, V, DO, LSE, DELTA, QLIST, OFF, ITEM_BLK, ITEM_OFF, PK, PV,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
                   Tq, Tk, q_start, k_start, qk_scale2, NB, W, NL, CH, NSTEP_HOST: tl.constexpr,
                   G: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, SB: tl.constexpr,
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
        tok = blk * SB + tl.arange(0, SB)
        kp = tok - k_start
        in_k = (kp >= 0) & (kp < Tk)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        k = tl.load(K + b * skb + kp[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
                    mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kp[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
                    mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
        dk = tl.zeros([SB, BDK], tl.float32)
        dv = tl.zeros([SB, BDV], tl.float32)
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
        rows = tl.arange(0, SB)
        base = (bh.to(tl.int64) * W + w) * SB
        tl.store(PK + (base + rows[:, None]) * BDK + offs_dk[None, :], dk)
        tl.store(PV + (base + rows[:, None]) * BDV + offs_dv[None, :], dv)


@triton.jit
def _sel_sum_step(PK, PV, bh, w, hi, W, dk, dv, SB: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    use = w < hi
    rows = tl.arange(0, SB)
    base = (bh.to(tl.int64) * W + w) * SB
    dk += tl.load(PK + (base + rows[:, None]) * BDK + tl.arange(0, BDK)[None, :], mask=use, other=0.0)
    dv += tl.load(PV + (base + rows[:, None]) * BDV + tl.arange(0, BDV)[None, :], mask=use, other=0.0)
    return dk, dv


@triton.jit
def _sel_dkdv_sum(PK, PV, ITEM_OFF, DK_, DV_, skb, skt, skh, svb, svt, svh, Tk, k_start, scale, NB, W, NIT_HOST: tl.constexpr,
                  HKV: tl.constexpr, SB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                  BDV: tl.constexpr, DYN: tl.constexpr):
    """dK/dV of block `blk` of (batch, KV group) `bh`: its work items' partials summed in order."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    lo = tl.load(ITEM_OFF + bh * (NB + 1) + blk)
    hi = tl.load(ITEM_OFF + bh * (NB + 1) + blk + 1)
    rows = tl.arange(0, SB)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    dk = tl.zeros([SB, BDK], tl.float32)
    dv = tl.zeros([SB, BDV], tl.float32)
    if DYN:
        for w in range(lo, hi):
            dk, dv = _sel_sum_step(PK, PV, bh, w, hi, W, dk, dv, SB, BDK, BDV)
    else:   # the interpreter takes host-int loop bounds only
        for j in range(0, NIT_HOST):
            dk, dv = _sel_sum_step(PK, PV, bh, lo + j, hi, W, dk, dv, SB, BDK, BDV)
    kp = blk * SB + rows - k_start
    in_k = (kp >= 0) & (kp < Tk)
    tl.store(DK_ + b * skb + kp[:, None].to(tl.int64) * skt + hk * skh + offs_dk[None, :],
             (dk * scale).to(DK_.dtype.element_ty), mask=in_k[:, None] & (offs_dk[None, :] < DK))
    tl.store(DV_ + b * svb + kp[:, None].to(tl.int64) * svt + hk * svh + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=in_k[:, None] & (offs_dv[None, :] < DV))


def _sel_rows_pad(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


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
    _sel_fwd[(tq, b * hkv)](
        q, k, v, idx, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), idx.stride(0), idx.stride(1),
        idx.stride(2), lse.stride(0), lse.stride(1), tq, tk, q_start, k_start, scale * LOG2E, idx.shape[-1],
        G=hq // hkv, HKV=hkv, RP=_sel_rows_pad(hq // hkv), SB=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
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
    _sel_dq[(tq, b * hkv)](
        q, k, v, do, idx, lse, delta, dq, *strides, idx.stride(0), idx.stride(1), idx.stride(2), lse.stride(0),
        lse.stride(1), tq, tk, q_start, k_start, scale * LOG2E, scale, idx.shape[-1],
        G=group, HKV=hkv, RP=_sel_rows_pad(group), SB=sel_block, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv), IEEE=ieee,
        **tiles.launch("trnsel"))
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
        G=group, HKV=hkv, GP=gp, BQ=bq, SB=sel_block, DK=dk, DV=dv, BDK=bdk, BDV=bdv, IEEE=ieee, DYN=dyn,
        **tiles.launch("trn"))
    _sel_dkdv_sum[(n_blocks, b * hkv)](
        pk, pv, item_off, dk_, dv_, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        tk, k_start, scale, n_blocks, w, 0 if dyn else triton.cdiv(tq, chunk) + 1,
        HKV=hkv, SB=sel_block, DK=dk, DV=dv, BDK=bdk, BDV=bdv, DYN=dyn, num_warps=4)
    return dq, dk_, dv_
