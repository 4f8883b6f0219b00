"""Selected attention, group-centric (paper Fig. 3): one program per (query token, KV group) loads
the queries of all heads of the group together (head tile padded to 16 for tl.dot), streams the
selected blocks' keys/values and keeps an online softmax; tokens after t inside the current block
are masked. Reads per program: `n * l'` keys and values of one KV head. With `gated` the
epilogue forms the module's gated sum. Few rows (decode): each row's blocks are split over
programs and combined (flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels import common
from nsa.backends.triton_kernels.common import (
    LOG2E,
    _dot,
    _merge_weights,
    _program_bh,
    _softmax_step,
    np2,
    unit_last_stride,
)
from nsa.backends.triton_kernels.tiles import Tiles


@triton.jit
def _gate_sum(o_cmp, o_sel, o_win, gate, g_ok, sgc):
    """g_cmp * o_cmp + g_sel * o_sel + g_win * o_win (fp32 outputs `[heads, dv]`), the three gates
    of each head at `gate + c * sgc` (heads where `g_ok`)."""
    g_cmp = tl.load(gate, mask=g_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gate + sgc, mask=g_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2 * sgc, mask=g_ok, other=0.0).to(tl.float32)
    return g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win


@triton.jit
def _gated(o, OC, OW, GT, b, t, heads, offs_g, offs_dv, omask, scb, sct, sch, swb, swt, swh,
           sgb, sgt, sgh, sgc, G: tl.constexpr):
    """The module's gated sum g_cmp * o_cmp + g_sel * o + g_win * o_win for one query's heads, fp32."""
    oc = tl.load(OC + b * scb + t * sct + heads[:, None] * sch + offs_dv[None, :], mask=omask, other=0.0)
    ow = tl.load(OW + b * swb + t * swt + heads[:, None] * swh + offs_dv[None, :], mask=omask, other=0.0)
    return _gate_sum(oc.to(tl.float32), o, ow.to(tl.float32), GT + b * sgb + t * sgt + heads * sgh, offs_g < G, sgc)


@triton.jit
def _sel_fwd(Q, K, V, IDX, Out, OC, OW, GT, PART,
             sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih, sob, sot, soh,
             scb, sct, sch, swb, swt, swh, sgb, sgt, sgh, sgc,
             T_k, q_start, k_start, qk_scale2,
             HKV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, SEL_BLOCK: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BG: tl.constexpr, BDK: tl.constexpr,
             BDV: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr, PER: tl.constexpr,
             SPLIT: tl.constexpr):
    """Online softmax in log2 units (`qk_scale2` = scale * log2 e) over the query's selected blocks.
    SPLIT > 1 (decode, few rows): program (t, group, split) takes blocks
    `[split * PER, (split + 1) * PER)` and writes its (m, l, acc) (m in log2 units) to PART for
    `_sel_combine`."""
    t = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    part = tl.program_id(2)
    t_abs = q_start + t
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    offs_s = tl.arange(0, SEL_BLOCK)
    heads = h * G + offs_g
    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=(offs_g[:, None] < G) & (offs_dk[None, :] < DK), other=0.0)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    for i in range(PER):
        blk = tl.load(IDX + b * sib + t * sit + h * sih + part * PER + i,
                      mask=part * PER + i < N_SEL, other=-1)
        pos = blk * SEL_BLOCK + offs_s
        valid = (blk >= 0) & (pos <= t_abs) & (pos >= k_start) & (pos < k_start + T_k)
        kpos = pos - k_start
        k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                    mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
        qk = _dot(q, tl.trans(k), IEEE)
        qk = tl.where(valid[None, :], qk * qk_scale2, float("-inf"))
        v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, IEEE)
    if SPLIT > 1:
        # Partial result of this split: [m, l, acc...] per row, combined by _sel_combine.
        row = ((t * tl.num_programs(1) + bh) * SPLIT + part) * BG + offs_g
        tl.store(PART + row * (BDV + 2), m_i)
        tl.store(PART + row * (BDV + 2) + 1, l_i)
        tl.store(PART + row[:, None] * (BDV + 2) + 2 + offs_dv[None, :], acc)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        omask = (offs_g[:, None] < G) & (offs_dv[None, :] < DV)
        if GATED:
            o = _gated(o, OC, OW, GT, b, t, heads, offs_g, offs_dv, omask, scb, sct, sch, swb, swt, swh,
                       sgb, sgt, sgh, sgc, G)
        tl.store(Out + b * sob + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(Out.dtype.element_ty),
                 mask=omask)


@triton.jit
def _sel_combine(PART, Out, OC, OW, GT, sob, sot, soh, scb, sct, sch, swb, swt, swh, sgb, sgt, sgh, sgc,
                 HKV: tl.constexpr, G: tl.constexpr, DV: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr,
                 SPLIT: tl.constexpr, GATED: tl.constexpr):
    """out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp2(m_s - m), over the splits of `_sel_fwd`
    (then the gated sum, with GATED)."""
    t = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    base = (t * tl.num_programs(1) + bh) * SPLIT * BG
    m = tl.full([BG], float("-inf"), tl.float32)
    for s in range(SPLIT):
        m = tl.maximum(m, tl.load(PART + (base + s * BG + offs_g) * (BDV + 2)))
    l_tot = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    for s in range(SPLIT):
        row = base + s * BG + offs_g
        w = _merge_weights(tl.load(PART + row * (BDV + 2)), m)
        l_tot += w * tl.load(PART + row * (BDV + 2) + 1)
        acc += w[:, None] * tl.load(PART + row[:, None] * (BDV + 2) + 2 + offs_dv[None, :])
    o = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    heads = h * G + offs_g
    omask = (offs_g[:, None] < G) & (offs_dv[None, :] < DV)
    if GATED:
        o = _gated(o, OC, OW, GT, b, t, heads, offs_g, offs_dv, omask, scb, sct, sch, swb, swt, swh,
                   sgb, sgt, sgh, sgc, G)
    tl.store(Out + b * sob + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=omask)


def selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float, q_start: int,
             k_start: int, tiles: Tiles, gated: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """`q [B, Tq, Hq, dk]` over the blocks `idx [B, Tq, Hkv, n]` (-1 padded) of `k/v [B, Tk, Hkv, d*]`
    (key positions `k_start ..`, query positions `q_start ..`) -> `[B, Tq, Hq, dv]`; with `gated =
    (gates [B, Tq, Hq, 3], o_cmp, o_win)` the gated sum of the three branches instead."""
    b, tq, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    q, k, v = unit_last_stride(q, k, v)
    idx = idx.to(torch.int32).contiguous()
    o = common.empty_out(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    gates, o_cmp, o_win = gated if gated is not None else (o, o, o)   # unused pointers when not gated
    group = hq // hkv
    n_sel = idx.shape[-1]
    # Few rows (decode): split each row's blocks over programs, then combine (flash-decoding).
    split = tiles.sel_split if tq <= 4 and tq * b * hkv < tiles.sel_split_rows else 1
    split = max(1, min(split, n_sel))
    per = triton.cdiv(n_sel, split)
    part = (torch.empty(tq * b * hkv * split * np2(group) * (np2(dv) + 2), dtype=torch.float32, device=q.device)
            if split > 1 else o)
    _sel_fwd[(tq, b * hkv, split)](
        q, k, v, idx, o, o_cmp, o_win, gates, part, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        o.stride(0), o.stride(1), o.stride(2), o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2),
        o_win.stride(0), o_win.stride(1), o_win.stride(2), gates.stride(0), gates.stride(1), gates.stride(2),
        gates.stride(3), k.shape[1], q_start, k_start, scale * LOG2E,
        HKV=hkv, G=group, N_SEL=n_sel, SEL_BLOCK=sel_block, DK=dk, DV=dv, BG=np2(group),
        BDK=np2(dk), BDV=np2(dv), IEEE=q.dtype == torch.float32, GATED=gated is not None, PER=per, SPLIT=split,
        **tiles.launch("sel"))
    if split > 1:
        _sel_combine[(tq, b * hkv)](part, o, o_cmp, o_win, gates, o.stride(0), o.stride(1), o.stride(2),
                                    o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2), o_win.stride(0),
                                    o_win.stride(1), o_win.stride(2), gates.stride(0), gates.stride(1),
                                    gates.stride(2), gates.stride(3), HKV=hkv, G=group, DV=dv, BG=np2(group),
                                    BDV=np2(dv), SPLIT=split, GATED=gated is not None)
    return o
