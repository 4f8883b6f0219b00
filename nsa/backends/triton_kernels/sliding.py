"""Sliding-window attention: query `t` reads keys `max(0, t - w + 1) .. t`.

Prefill (`_win_fwd`): group-centric like the compressed kernel: one program per (BTQ queries, KV
group) whose rows are every (query, head) pair of the group, so each key/value tile is loaded
once for all heads and BTQ neighbouring queries (the selection kernel's one-query programs would
load each key once per query: BTQ times the L2 traffic). Keys stream from the first query's
window start to the last query under the band mask `t - w < s <= t`. Any GQA ratio, dk != dv.
Prefill with FlashAttention-4 installed (sm90, bf16, `Tiles.win_fa4`, `B * Hq * T**2` at least
`Tiles.win_fa4_min_work`): FA-4's local window instead (fa4_win.py), 1.2-1.8x faster on the H100;
smaller prefills are bound by the host, where FA-4's call costs more than it saves.
Decode (`sliding_decode`): the window's blocks as a block list through the selection kernel,
whose few-rows split spreads one step over more programs than one program per group could.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels import common, fa4_win, selection
from nsa.backends.triton_kernels.common import LOG2E, _dot, _program_bh, _softmax_step, np2, unit_last_stride
from nsa.backends.triton_kernels.tiles import Tiles, interpreting


@triton.jit
def _win_step(q, K, V, b, h, skb, skt, skh, svb, svt, svh, kt, t_abs, k_start, T_k, window, qk_scale2, m_i, l_i,
              acc, BN: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr,
              IEEE: tl.constexpr, masked):
    """Keys `[kt, kt + BN)` of the online softmax, logits in log2 units (`qk_scale2` = scale * log2 e);
    `masked` False: the tile lies inside every row's window and the given keys."""
    pos = kt + tl.arange(0, BN)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    in_k = (pos >= k_start) & (pos < k_start + T_k)
    kpos = pos - k_start
    k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
    qk = _dot(q, tl.trans(k), IEEE)
    if masked:
        valid = in_k[None, :] & (pos[None, :] <= t_abs[:, None]) & (pos[None, :] > t_abs[:, None] - window)
        qk = tl.where(valid, qk * qk_scale2, float("-inf"))
    else:
        qk = qk * qk_scale2
    v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return _softmax_step(qk, v, m_i, l_i, acc, IEEE)


@triton.jit
def _win_fwd(Q, K, V, Out, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
             T, T_k, q_start, k_start, window, qk_scale2,
             HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BTQ: tl.constexpr, BN: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
             DYN_LOOP: tl.constexpr, NT_HOST: tl.constexpr):
    """Sliding-window attention, group-centric: one program per (BTQ queries, KV group) whose
    BTQ * GP rows are every (query, head) pair, so each key/value tile is loaded once for all
    heads of the group and BTQ neighbouring queries. Keys run from the first query's window
    start (rounded down to a BN edge) to the last query; row r keeps key s iff
    `t_r - window < s <= t_r` and s lies in the given keys `[k_start, k_start + T_k)`."""
    M: tl.constexpr = BTQ * GP
    pid_t = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    rows = tl.arange(0, M)
    offs_t = pid_t * BTQ + rows // GP
    g = rows % GP
    row_ok = (offs_t < T) & (g < G)
    t_abs = q_start + offs_t
    heads = h * G + g
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    t_first = q_start + pid_t * BTQ
    t_last = q_start + tl.minimum(pid_t * BTQ + BTQ, T) - 1
    k0 = (tl.maximum(tl.maximum(t_first - window + 1, k_start), 0) // BN) * BN
    lo_all = tl.maximum(t_last - window + 1, k_start)    # keys from here to t_first: in every row's window
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    # Tiles [i_lo, i_hi) lie inside every row's window and the given keys: no mask there.
    n_t = tl.cdiv(t_last + 1 - k0, BN)
    i_lo = tl.minimum(tl.cdiv(lo_all - k0, BN), n_t)
    i_hi = tl.minimum(tl.maximum(tl.maximum(tl.minimum(t_first + 1, k_start + T_k) - k0, 0) // BN, i_lo), n_t)
    if DYN_LOOP:   # GPU: masked head, unmasked middle, masked tail (a branch per tile fails to compile)
        for i in range(0, i_lo):
            m_i, l_i, acc = _win_step(q, K, V, b, h, skb, skt, skh, svb, svt, svh, k0 + i * BN, t_abs, k_start, T_k,
                                      window, qk_scale2, m_i, l_i, acc, BN, BDK, DK, BDV, DV, IEEE, True)
        for i in range(i_lo, i_hi):
            m_i, l_i, acc = _win_step(q, K, V, b, h, skb, skt, skh, svb, svt, svh, k0 + i * BN, t_abs, k_start, T_k,
                                      window, qk_scale2, m_i, l_i, acc, BN, BDK, DK, BDV, DV, IEEE, False)
        for i in range(i_hi, n_t):
            m_i, l_i, acc = _win_step(q, K, V, b, h, skb, skt, skh, svb, svt, svh, k0 + i * BN, t_abs, k_start, T_k,
                                      window, qk_scale2, m_i, l_i, acc, BN, BDK, DK, BDV, DV, IEEE, True)
    else:          # the interpreter: a host-int bound (NT_HOST, enough tiles for any program), same split
        for i in range(0, NT_HOST):
            m_i, l_i, acc = _win_step(q, K, V, b, h, skb, skt, skh, svb, svt, svh, k0 + i * BN, t_abs, k_start, T_k,
                                      window, qk_scale2, m_i, l_i, acc, BN, BDK, DK, BDV, DV, IEEE,
                                      (i < i_lo) | (i >= i_hi))
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + b * sob + offs_t[:, None] * sot + heads[:, None] * soh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))


def sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float, q_start: int, k_start: int,
            tiles: Tiles) -> Tensor:
    """`q [B, Tq, Hq, dk]` (positions `q_start ..`) over `k/v [B, Tk, Hkv, d*]` (positions `k_start ..`)
    -> `[B, Tq, Hq, dv]`; a query with no visible key gets 0."""
    if tiles.win_fa4 and q.shape[1] > 0 and common.prefill_work(q) >= tiles.win_fa4_min_work and \
            fa4_win.usable(q, k, v, window=window, q_start=q_start, k_start=k_start):
        return fa4_win.sliding(q, k, v, window=window, scale=scale)
    b, tq, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    q, k, v = unit_last_stride(q, k, v)
    o = common.empty_out(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    if tq == 0:
        return o
    group = hq // hkv
    gp = triton.next_power_of_2(group)
    # Rows >= 16 for tl.dot; a decode step (one query) takes one query's heads only.
    btq = max(max(1, 16 // gp), min(max(1, tiles.win_rows // gp), triton.next_power_of_2(tq)))
    bn = tiles.win_bn
    span = min(window, q_start + tq)   # keys a query can see, so a huge window costs no empty tiles
    nt_host = triton.cdiv(span + btq + bn - 2, bn) if interpreting() else 0
    _win_fwd[(triton.cdiv(tq, btq), b * hkv)](
        q, k, v, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        tq, k.shape[1], q_start, k_start, window, scale * LOG2E,
        HKV=hkv, G=group, GP=gp, BTQ=btq, BN=bn, DK=dk, DV=dv, BDK=np2(dk), BDV=np2(dv),
        IEEE=q.dtype == torch.float32, DYN_LOOP=not interpreting(), NT_HOST=nt_host, **tiles.launch("win"))
    return o


def sliding_decode(q: Tensor, k_w: Tensor, v_w: Tensor, *, t: int, scale: float, block: int, tiles: Tiles) -> Tensor:
    """Decode's sliding branch through the selection kernel: the query at position `t`
    (`q [B, 1, Hq, dk]`) over the window cache `k_w/v_w [B, n, Hkv, D]` holding positions
    `t+1-n .. t` (the last `n <= w` tokens); the window's `block`-token blocks are the block list
    and the kernel's own mask keeps exactly those positions."""
    n = k_w.shape[1]
    k_start = t + 1 - n
    first, last = k_start // block, t // block
    b, hkv = q.shape[0], k_w.shape[2]
    # A fixed list length (-1 padded) for every t, so the kernel never recompiles as decode moves.
    width = (n + block - 1) // block + 1
    blocks = torch.arange(first, first + width, device=q.device, dtype=torch.int32)
    blocks = torch.where(blocks <= last, blocks, torch.full_like(blocks, -1))
    idx = blocks.expand(b, q.shape[1], hkv, -1)
    return selection.selected(q, k_w, v_w, idx, sel_block=block, scale=scale, q_start=t, k_start=k_start, tiles=tiles)
