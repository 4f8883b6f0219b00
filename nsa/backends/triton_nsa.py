"""Own Triton kernels for NSA's sparse branches (forward only).

`selected`: the paper's group-centric kernel (Fig. 3): one program per (query token, KV group)
loads the queries of all heads of the group together (head tile padded to 16 for tl.dot),
streams the selected blocks' keys/values and keeps an online softmax; tokens after t inside
the current block are masked. Reads per program: `n * l'` keys and values of one KV head.
`selected_gated` forms the module's gated sum in its epilogue; `sliding_decode` runs decode's
window as a block list through the same kernel.

`compressed_and_scores`: group-centric too: one program per (BTQ queries, KV group) holds every
(query, head) row of the group, so each compressed key/value tile is loaded once for all heads.
Two passes over the visible compressed keys (softmax stats, then output); the second also forms
the selection scores (Eq. 9-10: probabilities summed over the group's heads, then mapped to
selection blocks by token overlap, in fp32) and writes each `[BTQ, blocks]` tile once, never
materialising `[T, Tc]` in HBM. Writes `[B, T, Hkv, Nb]` fp32 scores.

`sliding`: the window branch, group-centric like the compressed kernel: one program per (BTQ
queries, KV group) whose rows are every (query, head) pair, streaming the keys from the first
query's window start to the last query with the band mask `t - w < s <= t`; any GQA ratio and
dk != dv (the paper's 192/128, which FA-2 cannot take).

`topn`: one program per score row; the spec's forced blocks and tie rule by repeated arg-max,
no sort.

Decode (few rows) splits the work over more programs, flash-decoding style: the compressed keys
over chunks (`_cmp_split`, stats pass then output/scores pass), each row's blocks for top-n
(`_topn_part` + `_topn_merge`) and for selection (`_sel_fwd` splits + `_sel_combine`).
Launch parameters live in `TILES` (swept by bench/triton_tiles.py).

All run under `TRITON_INTERPRET=1` on CPU (tests), and on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from nsa.backends import AttnCall

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    if triton is None:
        return "triton is not installed (pip install triton)"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda" and not _interpret():
        return f"the triton backend runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1), got {dev}"
    return None


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def unsupported_reason(call: AttnCall) -> str | None:
    q, v = call.q, call.v
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels take fp16/bf16/fp32, got {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return f"the triton kernels support head dims <= 256, got {q.shape[-1]}/{v.shape[-1]}"
    if call.op == "selected" and not (_pow2(call.sel_block) and call.sel_block >= 16):
        return f"the triton selection kernel needs sel_block a power of two >= 16, got {call.sel_block}"
    if call.op == "sliding" and (call.window is None or call.window < 1):
        return f"the triton sliding kernel needs a window >= 1, got {call.window}"
    return None


def _empty_out(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The kernels' output allocation, one place: tests fill it with NaN to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _np2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(x))


if triton is not None:

    @triton.jit
    def _gated(o, OC, OW, GT, b, t, heads, offs_g, offs_dv, omask, scb, sct, sch, swb, swt, swh,
               sgb, sgt, sgh, sgc, G: tl.constexpr):
        """The module's gated sum g_cmp * o_cmp + g_sel * o + g_win * o_win for one query's heads, fp32."""
        oc = tl.load(OC + b * scb + t * sct + heads[:, None] * sch + offs_dv[None, :], mask=omask, other=0.0)
        ow = tl.load(OW + b * swb + t * swt + heads[:, None] * swh + offs_dv[None, :], mask=omask, other=0.0)
        gate = GT + b * sgb + t * sgt + heads * sgh
        g_cmp = tl.load(gate, mask=offs_g < G, other=0.0).to(tl.float32)
        g_sel = tl.load(gate + sgc, mask=offs_g < G, other=0.0).to(tl.float32)
        g_win = tl.load(gate + 2 * sgc, mask=offs_g < G, other=0.0).to(tl.float32)
        return g_cmp[:, None] * oc.to(tl.float32) + g_sel[:, None] * o + g_win[:, None] * ow.to(tl.float32)

    @triton.jit
    def _sel_fwd(Q, K, V, IDX, Out, OC, OW, GT, PART,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih, sob, sot, soh,
                 scb, sct, sch, swb, swt, swh, sgb, sgt, sgh, sgc,
                 T_k, q_start, k_start, scale,
                 HKV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, SEL: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BG: tl.constexpr, BDK: tl.constexpr,
                 BDV: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr, PER: tl.constexpr,
                 SPLIT: tl.constexpr):
        """SPLIT > 1 (decode, few rows): program (t, group, split) takes blocks
        `[split * PER, (split + 1) * PER)` and writes its (m, l, acc) to PART for `_sel_combine`."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        part = tl.program_id(2)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        t_abs = q_start + t
        offs_g = tl.arange(0, BG)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        offs_s = tl.arange(0, SEL)
        heads = h * G + offs_g
        q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_dk[None, :],
                    mask=(offs_g[:, None] < G) & (offs_dk[None, :] < DK), other=0.0)
        m_i = tl.full([BG], float("-inf"), tl.float32)
        l_i = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BDV], tl.float32)
        for i in range(PER):
            blk = tl.load(IDX + b * sib + t * sit + h * sih + part * PER + i,
                          mask=part * PER + i < N_SEL, other=-1)
            pos = blk * SEL + offs_s
            valid = (blk >= 0) & (pos <= t_abs) & (pos >= k_start) & (pos < k_start + T_k)
            kpos = pos - k_start
            k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                        mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                        mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
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
        """out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s over the splits of `_sel_fwd`
        (then the gated sum, with GATED)."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        offs_g = tl.arange(0, BG)
        offs_dv = tl.arange(0, BDV)
        base = (t * tl.num_programs(1) + bh) * SPLIT * BG
        m = tl.full([BG], float("-inf"), tl.float32)
        for s in range(SPLIT):
            m = tl.maximum(m, tl.load(PART + (base + s * BG + offs_g) * (BDV + 2)))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_tot = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BDV], tl.float32)
        for s in range(SPLIT):
            row = base + s * BG + offs_g
            w = tl.exp(tl.load(PART + row * (BDV + 2)) - m_safe)
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

    @triton.jit
    def _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, scale,
                    BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, IEEE: tl.constexpr):
        """Scaled Q·Kc logits of one compressed tile `[c0, c0 + BC)`; -inf where invisible."""
        offs_c = c0 + tl.arange(0, BC)
        offs_dk = tl.arange(0, BDK)
        kc = tl.load(KC + kc_base + offs_c[:, None] * skt + offs_dk[None, :],
                     mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(kc), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(kc))
        return tl.where(offs_c[None, :] < nvis[:, None], qk * scale, float("-inf"))

    @triton.jit
    def _group_scores(ps, offs_c, jb, NBW: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                      SEL: tl.constexpr, MODE: tl.constexpr):
        """Eq. 9 for one compressed tile: `ps [BTQ, BC]` (probabilities summed over the group's
        heads, Eq. 10) -> group scores of selection blocks `jb + [0, NBW)`, `[BTQ, NBW]` fp32.
        w[i, j] = tokens shared by compressed token i `[i*D, i*D+L)` and block j
        `[j*SEL, (j+1)*SEL)`. MODE 0: broadcast-sum (BTQ < 16); 1: fp32 dot (BTQ, NBW >= 16).
        Both full fp32: ranks must not move with rounding (a 3xTF32 tensor-core variant was about
        2x slower on the H100, bench/triton_tiles.py at 32k)."""
        offs_j = jb + tl.arange(0, NBW)
        lo = tl.maximum(offs_c[:, None] * D, offs_j[None, :] * SEL)
        hi = tl.minimum(offs_c[:, None] * D + L, (offs_j[None, :] + 1) * SEL)
        w = tl.maximum(hi - lo, 0).to(tl.float32)
        if MODE == 1:
            return tl.dot(ps, w, input_precision="ieee")
        return tl.sum(ps[:, :, None] * w[None, :, :], 1)

    @triton.jit
    def _pv_tile(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, scale, m_safe, inv_l, acc,
                 BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr,
                 IEEE: tl.constexpr):
        """Second-pass work of one compressed tile `[c0, c0 + BC)` with the final softmax stats:
        the exact probabilities `p` (0 where invisible) and `acc + p @ Vc`. Returns (acc, p, offs_c)."""
        qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, scale, BC, BDK, DK, IEEE)
        p = tl.exp(qk - m_safe[:, None]) * inv_l[:, None]
        offs_c = c0 + tl.arange(0, BC)
        offs_dv = tl.arange(0, BDV)
        vc = tl.load(VC + vc_base + offs_c[:, None] * svt + offs_dv[None, :],
                     mask=(offs_c[:, None] < Tc) & (offs_dv[None, :] < DV), other=0.0)
        if IEEE:
            acc += tl.dot(p, vc.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(vc.dtype), vc)
        return acc, p, offs_c

    @triton.jit
    def _carried_scores(p, offs_c, c0, carry, s_rows, t_ok, NB, BTQ: tl.constexpr, GP: tl.constexpr,
                        BC: tl.constexpr, SHIFT: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                        SEL: tl.constexpr, MODE: tl.constexpr):
        """Scores of one tile when tiles end on block edges: blocks `[jb, jb + SHIFT)` are complete
        after it (the next tile starts at block jb + SHIFT) and are stored to `s_rows` (pointers of
        the tile's score rows, `[BTQ, 1]`); the spill into the next SHIFT blocks is returned as the
        new carry."""
        jb = (c0 * D) // SEL
        ps = tl.sum(tl.reshape(p, [BTQ, GP, BC]), 1)                      # Eq. 10: over heads
        own = carry + _group_scores(ps, offs_c, jb, SHIFT, L, D, SEL, MODE)
        offs_j = jb + tl.arange(0, SHIFT)
        tl.store(s_rows + offs_j[None, :], own, mask=t_ok & (offs_j[None, :] < NB))
        return _group_scores(ps, offs_c, jb + SHIFT, SHIFT, L, D, SEL, MODE)

    @triton.jit
    def _cmp_group(Q, KC, VC, Out, S,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, ssb, sst, ssh,
                   T, Tc, NB, q_start, scale,
                   TC_ALL: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   BTQ: tl.constexpr, L: tl.constexpr, D: tl.constexpr, SEL: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BNB: tl.constexpr,
                   BDK: tl.constexpr, BDV: tl.constexpr, SCORES: tl.constexpr, SCORE_MODE: tl.constexpr,
                   SHIFT: tl.constexpr, IEEE: tl.constexpr, DYN_LOOP: tl.constexpr):
        """Group-centric compressed attention (+ selection scores): one program per (BTQ queries,
        KV group); its BTQ * GP rows are every (query, head) pair of the group, so each compressed
        tile is loaded once for all heads. Pass 1: softmax stats. Pass 2: output and, with SCORES,
        the Eq. 9-10 group scores: probabilities summed over heads, then mapped to selection
        blocks by overlap, written once per tile."""
        M: tl.constexpr = BTQ * GP
        n_tiles = tl.cdiv(T, BTQ)
        pid_t = n_tiles - 1 - tl.program_id(0)        # heaviest (latest) tiles first
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        rows = tl.arange(0, M)
        offs_t = pid_t * BTQ + rows // GP
        g = rows % GP
        row_ok = (offs_t < T) & (g < G)
        t_abs = q_start + offs_t
        nvis = tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1)
        nvis = tl.where(row_ok, tl.minimum(nvis, Tc), 0)
        # Causal: the tile's last query sees the most compressed tokens, so the loops stop there.
        # (Under the interpreter the bound must be a host int: TC_ALL; masks keep the result exact.)
        t_last = q_start + tl.minimum(pid_t * BTQ + BTQ, T) - 1
        max_vis = tl.minimum(tl.maximum((t_last + 1 - L) // D + 1, 0), Tc)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        heads = h * G + g
        q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                    mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        kc_base = b * skb + h * skh
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
            qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, scale, BC, BDK, DK, IEEE)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qk - m_safe[:, None]), 1)
            m_i = m_new
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        acc = tl.zeros([M, BDV], tl.float32)
        t_first = pid_t * BTQ + tl.arange(0, BTQ)
        carry = tl.zeros([BTQ, SHIFT if SHIFT > 0 else 1], tl.float32)
        s_rows = S + b * ssb + t_first[:, None] * sst + h * ssh
        for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
            acc, p, offs_c = _pv_tile(q, KC, VC, kc_base, b * svb + h * svh, skt, svt, c0, nvis, Tc, scale, m_safe,
                                      inv_l, acc, BC, BDK, DK, BDV, DV, IEEE)
            if SCORES:
                if SHIFT > 0:
                    carry = _carried_scores(p, offs_c, c0, carry, s_rows, t_first[:, None] < T, NB, BTQ, GP, BC,
                                            SHIFT, L, D, SEL, SCORE_MODE)
                else:
                    # General sizes: read-modify-write of the tile's blocks (they overlap the next tile's).
                    jb = (c0 * D) // SEL
                    ps = tl.sum(tl.reshape(p, [BTQ, GP, BC]), 1)              # Eq. 10: over heads
                    tot = _group_scores(ps, offs_c, jb, BNB, L, D, SEL, SCORE_MODE)
                    offs_j = jb + tl.arange(0, BNB)
                    ptr = S + b * ssb + t_first[:, None] * sst + h * ssh + offs_j[None, :]
                    smask = (t_first[:, None] < T) & (offs_j[None, :] < NB)
                    old = tl.load(ptr, mask=smask, other=0.0)
                    tl.store(ptr, old + tot, mask=smask)
                    tl.debug_barrier()
        if SCORES and SHIFT > 0:
            jb_end = (tl.cdiv(max_vis if DYN_LOOP else TC_ALL, BC) * BC * D) // SEL
            offs_j = jb_end + tl.arange(0, SHIFT)
            tl.store(S + b * ssb + t_first[:, None] * sst + h * ssh + offs_j[None, :], carry,
                     mask=(t_first[:, None] < T) & (offs_j[None, :] < NB))
        tl.store(Out + b * sob + offs_t[:, None] * sot + heads[:, None] * soh + offs_dv[None, :],
                 acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))

    @triton.jit
    def _cmp_split(Q, KC, VC, ML, PACC, S, SPILL,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, ssb, sst, ssh,
                   T, Tc, NB, q_start, scale, NS,
                   PASS: tl.constexpr, NSP: tl.constexpr, CH: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, BTQ: tl.constexpr, L: tl.constexpr, D: tl.constexpr, SEL: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                   SCORES: tl.constexpr, SCORE_MODE: tl.constexpr, SHIFT: tl.constexpr, IEEE: tl.constexpr):
        """Decode (a few queries, long context): `_cmp_group` split over chunks of CH compressed
        keys, one program per (chunk, KV group), so a step uses the whole GPU. PASS 1: each
        chunk's softmax stats -> ML. PASS 2: the global stats from every chunk's, then this
        chunk's output share -> PACC (summed on the host) and its block scores -> S, with the
        spill past the chunk's last block -> SPILL (added by `_add_spill`)."""
        M: tl.constexpr = BTQ * GP
        s = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        rows = tl.arange(0, M)
        offs_t = rows // GP
        g = rows % GP
        row_ok = (offs_t < T) & (g < G)
        t_abs = q_start + offs_t
        c_lo = s * CH
        nvis = tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1)
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
                qk = _cmp_logits(q, KC, kc_base, skt, c_lo + i, nvis, Tc, scale, BC, BDK, DK, IEEE)
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qk - m_safe[:, None]), 1)
                m_i = m_new
            tl.store(ML + (s * tl.num_programs(1) + bh) * M + rows, m_i)
            tl.store(ML + ((NS + s) * tl.num_programs(1) + bh) * M + rows, l_i)
        else:
            offs_s = tl.arange(0, NSP)
            at = (offs_s[:, None] * tl.num_programs(1) + bh) * M + rows[None, :]
            m_all = tl.load(ML + at, mask=offs_s[:, None] < NS, other=float("-inf"))
            l_all = tl.load(ML + NS * tl.num_programs(1) * M + at, mask=offs_s[:, None] < NS, other=0.0)
            m_max = tl.max(m_all, 0)
            m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
            l_tot = tl.sum(l_all * tl.exp(m_all - m_safe[None, :]), 0)
            inv_l = 1.0 / tl.where(l_tot == 0.0, 1.0, l_tot)
            offs_dv = tl.arange(0, BDV)
            acc = tl.zeros([M, BDV], tl.float32)
            t_first = tl.arange(0, BTQ)
            carry = tl.zeros([BTQ, SHIFT], tl.float32)
            s_rows = S + b * ssb + t_first[:, None] * sst + h * ssh
            for i in range(0, CH, BC):
                acc, p, offs_c = _pv_tile(q, KC, VC, kc_base, b * svb + h * svh, skt, svt, c_lo + i, nvis, Tc, scale,
                                          m_safe, inv_l, acc, BC, BDK, DK, BDV, DV, IEEE)
                if SCORES:
                    carry = _carried_scores(p, offs_c, c_lo + i, carry, s_rows, t_first[:, None] < T, NB, BTQ, GP,
                                            BC, SHIFT, L, D, SEL, SCORE_MODE)
            tl.store(PACC + ((s * tl.num_programs(1) + bh) * M + rows[:, None]) * BDV + offs_dv[None, :], acc)
            if SCORES:
                tl.store(SPILL + ((s * tl.num_programs(1) + bh) * BTQ + t_first[:, None]) * SHIFT
                         + tl.arange(0, SHIFT)[None, :], carry)

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
        t = tl.program_id(0)
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
    def _add_spill(S, SPILL, ssb, sst, ssh, T, NB,
                   HKV: tl.constexpr, BTQ: tl.constexpr, SHIFT: tl.constexpr, CHB: tl.constexpr):
        """S[block (s+1)*CHB + k] += SPILL[s, k]: chunk s's scores past its last block (the next
        chunk's own stores are done; chunks' spill ranges do not overlap)."""
        s = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        t = tl.arange(0, BTQ)
        k = tl.arange(0, SHIFT)
        spill = tl.load(SPILL + ((s * tl.num_programs(1) + bh) * BTQ + t[:, None]) * SHIFT + k[None, :])
        offs_j = (s + 1) * CHB + k
        ptr = S + b * ssb + t[:, None] * sst + h * ssh + offs_j[None, :]
        mask = (t[:, None] < T) & (offs_j[None, :] < NB)
        tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + spill, mask=mask)

    @triton.jit
    def _topn(S, IDX, ssb, sst, ssh, sib, sit, sih, NB, q_start,
              HKV: tl.constexpr, SEL: tl.constexpr, N: tl.constexpr, BNB: tl.constexpr, BN: tl.constexpr):
        """One row of group scores -> its `N` blocks: forced block 0, current and previous; then the
        highest scores among candidates `j <= t // SEL`, ties to the lower index; ascending, -1 pad."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        cur = (q_start + t) // SEL
        j = tl.arange(0, BNB)
        s = _row_scores(S + b * ssb + t * sst + h * ssh, j, NB, cur)
        _write_blocks(IDX + b * sib + t * sit + h * sih, j, _take_top(s, j, N), N, BN)

    @triton.jit
    def _win_fwd(Q, K, V, Out, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                 T, T_k, q_start, k_start, window, scale,
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
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
        h = bh % HKV
        rows = tl.arange(0, M)
        offs_t = pid_t * BTQ + rows // GP
        g = rows % GP
        row_ok = (offs_t < T) & (g < G)
        t_abs = q_start + offs_t
        heads = h * G + g
        offs_n = tl.arange(0, BN)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                    mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        t_first = q_start + pid_t * BTQ
        t_last = q_start + tl.minimum(pid_t * BTQ + BTQ, T) - 1
        k0 = (tl.maximum(tl.maximum(t_first - window + 1, k_start), 0) // BN) * BN
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BDV], tl.float32)
        # GPU: exactly the tiles up to the last query. The interpreter needs a host-int bound
        # (NT_HOST, enough tiles for any program); the masks keep the result exact either way.
        for i in range(0, tl.cdiv(t_last + 1 - k0, BN) if DYN_LOOP else NT_HOST):
            pos = k0 + i * BN + offs_n
            in_k = (pos >= k_start) & (pos < k_start + T_k)
            kpos = pos - k_start
            k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                        mask=in_k[:, None] & (offs_dk[None, :] < DK), other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            valid = in_k[None, :] & (pos[None, :] <= t_abs[:, None]) & (pos[None, :] > t_abs[:, None] - window)
            qk = tl.where(valid, qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                        mask=in_k[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + b * sob + offs_t[:, None] * sot + heads[:, None] * soh + offs_dv[None, :],
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))


def sliding(call: AttnCall) -> Tensor:
    """Causal sliding-window attention on `_win_fwd`: query `t = q_start + i` of `q [B, Tq, Hq, dk]`
    reads keys `max(0, t - w + 1) .. t` among the given `k/v [B, Tk, Hkv, d*]` (positions
    `k_start ..`; decode: q_start = t and the last <= w keys) -> `[B, Tq, Hq, dv]`. Any GQA ratio;
    a query with no visible key gets 0."""
    return _sliding(call.q, call.k, call.v, window=call.window, scale=call.scale, q_start=call.q_start,
                    k_start=call.k_start)


def _sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float, q_start: int, k_start: int) -> Tensor:
    b, tq, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = _empty_out(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    if tq == 0:
        return o
    group = hq // hkv
    gp = triton.next_power_of_2(group)
    rows = 16 if _interpret() else TILES["win_rows"]
    # Rows >= 16 for tl.dot; a decode step (one query) takes one query's heads only.
    btq = max(max(1, 16 // gp), min(max(1, rows // gp), triton.next_power_of_2(tq)))
    bn = 16 if _interpret() else TILES["win_bn"]
    span = min(window, q_start + tq)   # keys a query can see, so a huge window costs no empty tiles
    nt_host = triton.cdiv(span + btq + bn - 2, bn) if _interpret() else 0
    _win_fwd[(triton.cdiv(tq, btq), b * hkv)](
        q, k, v, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        tq, k.shape[1], q_start, k_start, window, scale,
        HKV=hkv, G=group, GP=gp, BTQ=btq, BN=bn, DK=dk, DV=dv, BDK=_np2(dk), BDV=_np2(dv),
        IEEE=q.dtype == torch.float32, DYN_LOOP=not _interpret(), NT_HOST=nt_host, **_launch("win"))
    return o


def selected(call: AttnCall) -> Tensor:
    return _selected(call.q, call.k, call.v, call.block_indices, sel_block=call.sel_block, scale=call.scale,
                     q_start=call.q_start, k_start=call.k_start)


def selected_gated(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float,
                   gates: Tensor, o_cmp: Tensor, o_win: Tensor, q_start: int = 0, k_start: int = 0) -> Tensor:
    """The whole NSA output `g_cmp * o_cmp + g_sel * selected(q, k, v, idx) + g_win * o_win`
    (gates `[B, Tq, Hq, 3]`), the gated sum done in the selection kernel's epilogue."""
    want = (*q.shape[:3], v.shape[-1])
    for name, x in (("o_cmp", o_cmp), ("o_win", o_win)):
        if tuple(x.shape) != want or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [B, Tq, Hq, dv] = {list(want)} with a unit last stride, "
                             f"got {list(x.shape)} strides {x.stride()}")
    if tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates must be [B, Tq, Hq, 3], got {list(gates.shape)}")
    return _selected(q, k, v, idx, sel_block=sel_block, scale=scale, q_start=q_start, k_start=k_start,
                     gated=(gates, o_cmp, o_win))


def _selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float, q_start: int,
              k_start: int, gated: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    b, tq, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    idx = idx.to(torch.int32).contiguous()
    o = torch.empty(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    gates, o_cmp, o_win = gated if gated is not None else (o, o, o)   # unused pointers when not gated
    group = hq // hkv
    n_sel = idx.shape[-1]
    # Few rows (decode): split each row's blocks over programs, then combine (flash-decoding).
    split = TILES["sel_split"] if tq <= 4 and tq * b * hkv < TILES["sel_split_rows"] else 1
    split = max(1, min(split, n_sel))
    per = triton.cdiv(n_sel, split)
    part = (torch.empty(tq * b * hkv * split * _np2(group) * (_np2(dv) + 2), dtype=torch.float32, device=q.device)
            if split > 1 else o)
    _sel_fwd[(tq, b * hkv, split)](
        q, k, v, idx, o, o_cmp, o_win, gates, part, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        o.stride(0), o.stride(1), o.stride(2), o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2),
        o_win.stride(0), o_win.stride(1), o_win.stride(2), gates.stride(0), gates.stride(1), gates.stride(2),
        gates.stride(3), k.shape[1], q_start, k_start, scale,
        HKV=hkv, G=group, N_SEL=n_sel, SEL=sel_block, DK=dk, DV=dv, BG=_np2(group),
        BDK=_np2(dk), BDV=_np2(dv), IEEE=q.dtype == torch.float32, GATED=gated is not None, PER=per, SPLIT=split,
        **_launch("sel"))
    if split > 1:
        _sel_combine[(tq, b * hkv)](part, o, o_cmp, o_win, gates, o.stride(0), o.stride(1), o.stride(2),
                                    o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2), o_win.stride(0),
                                    o_win.stride(1), o_win.stride(2), gates.stride(0), gates.stride(1),
                                    gates.stride(2), gates.stride(3), HKV=hkv, G=group, DV=dv, BG=_np2(group),
                                    BDV=_np2(dv), SPLIT=split, GATED=gated is not None)
    return o


def sliding_decode(q: Tensor, k_w: Tensor, v_w: Tensor, *, t: int, scale: float, block: int = 64) -> Tensor:
    """Decode's sliding branch through the selection kernel: the query at position `t`
    (`q [B, 1, Hq, dk]`) over the window cache `k_w/v_w [B, n, Hkv, D]` holding positions
    `t+1-n .. t` (the last `n <= w` tokens); the window's `block`-token blocks are the block list
    and the kernel's own mask keeps exactly those positions."""
    if q.shape[1] != 1:
        raise ValueError(f"sliding_decode takes one query per sequence, got {q.shape[1]}; use the sliding op")
    if not (_pow2(block) and block >= 16):
        raise ValueError(f"sliding_decode needs block a power of two >= 16, got {block}; use 64")
    n = k_w.shape[1]
    k_start = t + 1 - n
    first, last = k_start // block, t // block
    b, hkv = q.shape[0], k_w.shape[2]
    # A fixed list length (-1 padded) for every t, so the kernel never recompiles as decode moves.
    width = (n + block - 1) // block + 1
    blocks = torch.arange(first, first + width, device=q.device, dtype=torch.int32)
    blocks = torch.where(blocks <= last, blocks, torch.full_like(blocks, -1))
    idx = blocks.expand(b, q.shape[1], hkv, -1)
    return _selected(q, k_w, v_w, idx, sel_block=block, scale=scale, q_start=t, k_start=k_start)


# Launch parameters. The cmp/sel tile, warp and stage defaults and the decode split are what
# bench/triton_tiles.py measured best on the H100 (it sweeps them by editing this dict); the
# top-n and selection split knobs were set by reasoning, not swept. Under the interpreter
# smaller tiles keep CPU tests quick.
TILES: dict[str, Any] = {
    "cmp_rows": 64,         # (query, head) rows per compressed-kernel program: 4 queries x 16 heads
    "cmp_bc": 32,           # compressed keys per tile
    "cmp_warps": 4,         # one warp per query's 16 heads: the sum over heads stays in a warp
    "cmp_stages": 3,        # None: Triton's default
    "score_carry": True,    # carry block spill in registers when the tile ends on a block edge
    "sel_warps": 2,
    "sel_stages": 2,
    "split_tiles": 8,       # decode: compressed tiles per chunk of the split kernel
    "split_warps": 1,
    "split_stages": None,
    "sel_split": 4,           # decode: programs per row of the selection kernel (blocks split)
    "sel_split_rows": 1024,   # fewer (query, group) rows than this: split
    "topn_split_rows": 2048,  # fewer score rows than this (decode): two-stage top-n over chunks
    "topn_chunk": 128,        # blocks per chunk of the two-stage top-n
    "win_rows": 64,           # sliding: (query, head) rows per program (4 queries x 16 heads), not swept
    "win_bn": 64,             # sliding: keys per tile, not swept
    "win_warps": 4,
    "win_stages": 3,
}


def _launch(prefix: str) -> dict[str, int]:
    opts = {"num_warps": TILES[f"{prefix}_warps"]}
    if TILES[f"{prefix}_stages"] is not None:
        opts["num_stages"] = TILES[f"{prefix}_stages"]
    return opts


def _cmp_tiles(tq: int, group: int) -> tuple[int, int, int]:
    """(queries per program, padded group, compressed tile): rows = queries x padded heads, >= 16
    for tl.dot (16 under the interpreter, which is slow per element)."""
    gp = triton.next_power_of_2(group)
    rows = 16 if _interpret() else TILES["cmp_rows"]
    btq = max(1, rows // gp)
    btq = max(max(1, 16 // gp), min(btq, triton.next_power_of_2(tq)))   # decode: few queries
    return btq, gp, 16 if _interpret() else TILES["cmp_bc"]


def _score_layout(btq: int, bc: int, block: int, stride: int, sel_block: int) -> tuple[int, int]:
    """(score mode, shift). Mode 0 (broadcast-sum) for query tiles < 16, mode 1 (fp32 dot)
    otherwise: for tiles >= 16 Triton rewrites a broadcast-multiply-sum into a TF32 tensor-core
    dot (seen on the H100: scores off by 4e-4), which would let rounding move the ranks.
    shift > 0 carries the spill in registers (tiles end on block edges)."""
    mode = 1 if btq >= 16 else 0
    shift = 0
    if TILES["score_carry"] and (bc * stride) % sel_block == 0:
        cand = bc * stride // sel_block
        spill = -(-max(0, block - stride) // sel_block)
        if _pow2(cand) and spill <= cand and (mode == 0 or cand >= 16):
            shift = cand
    return mode, shift


def compressed_and_scores(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                          scale: float, q_start: int = 0, scores: bool = True) -> tuple[Tensor, Tensor | None]:
    """Compressed-branch output `[B, Tq, Hq, Dv]` and group scores `[B, Tq, Hkv, Nb]` (fp32) in one kernel.

    `Nb = (q_start + Tq - 1) // sel_block + 1`. Memory: the two outputs; nothing of size `T x Tc`.
    """
    b, tq, hq, dk = q.shape
    tc, hkv, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    q, k_cmp, v_cmp = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cmp, v_cmp))
    o = torch.empty(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    nb = (q_start + tq - 1) // sel_block + 1
    s = torch.zeros(b, tq, hkv, nb if scores else 1, dtype=torch.float32, device=q.device)
    if tc == 0:
        o.zero_()
        return o, s if scores else None
    group = hq // hkv
    btq, gp, bc = _cmp_tiles(tq, group)
    exact = q.dtype == torch.float32
    mode, shift = _score_layout(btq, bc, block, stride, sel_block)
    chunk = bc * TILES["split_tiles"]
    max_vis = min(tc, max(0, (q_start + tq - block) // stride + 1))
    if tq <= btq and shift > 0 and (chunk * stride) % sel_block == 0 and max_vis > chunk:
        return _compressed_split(q, k_cmp, v_cmp, o, s, block=block, stride=stride, sel_block=sel_block, scale=scale,
                                 q_start=q_start, scores=scores, btq=btq, gp=gp, bc=bc, mode=mode, shift=shift,
                                 chunk=chunk, n_split=triton.cdiv(max_vis, chunk))
    bnb = _np2((bc * stride + block) // sel_block + 2, 16)
    _cmp_group[(triton.cdiv(tq, btq), b * hkv)](
        q, k_cmp, v_cmp, o, s, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), o.stride(0), o.stride(1), o.stride(2),
        s.stride(0), s.stride(1), s.stride(2), tq, tc, nb, q_start, scale,
        TC_ALL=tc if _interpret() else 0, HKV=hkv, G=group, GP=gp, BTQ=btq, L=block, D=stride, SEL=sel_block,
        DK=dk, DV=dv, BC=bc, BNB=bnb, BDK=_np2(dk), BDV=_np2(dv), SCORES=scores, SCORE_MODE=mode, SHIFT=shift,
        IEEE=exact, DYN_LOOP=not _interpret(), **_launch("cmp"))
    return o, s if scores else None


def _compressed_split(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, s: Tensor, *, block: int, stride: int,
                      sel_block: int, scale: float, q_start: int, scores: bool, btq: int, gp: int, bc: int, mode: int,
                      shift: int, chunk: int, n_split: int) -> tuple[Tensor, Tensor | None]:
    """Decode: `_cmp_split` over `n_split` chunks of the compressed keys (flash-decoding), then the
    output shares summed and the chunks' score spill added."""
    b, tq, hq, dk = q.shape
    tc, hkv, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    rows, bh, bdv = btq * gp, b * hkv, _np2(dv)
    ml = torch.empty(2, n_split, bh, rows, dtype=torch.float32, device=q.device)
    pacc = torch.empty(n_split, bh, rows, bdv, dtype=torch.float32, device=q.device)
    spill = torch.empty(n_split, bh, btq, shift, dtype=torch.float32, device=q.device)
    args = (q, k_cmp, v_cmp, ml, pacc, s, spill, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0),
            k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), s.stride(0),
            s.stride(1), s.stride(2), tq, tc, s.shape[-1], q_start, scale, n_split)
    meta = dict(NSP=_np2(n_split, 1), CH=chunk, HKV=hkv, G=hq // hkv, GP=gp, BTQ=btq, L=block, D=stride,
                SEL=sel_block, DK=dk, DV=dv, BC=bc, BDK=_np2(dk), BDV=bdv, SCORES=scores, SCORE_MODE=mode,
                SHIFT=shift, IEEE=q.dtype == torch.float32, **_launch("split"))
    _cmp_split[(n_split, bh)](*args, PASS=1, **meta)
    _cmp_split[(n_split, bh)](*args, PASS=2, **meta)
    if scores:
        # Every chunk's spill, the last one's too (its blocks may still be < Nb; the mask drops the rest).
        _add_spill[(n_split, bh)](s, spill, s.stride(0), s.stride(1), s.stride(2), tq, s.shape[-1], HKV=hkv,
                                      BTQ=btq, SHIFT=shift, CHB=chunk * stride // sel_block)
    out = pacc.sum(0).view(b, hkv, btq, gp, bdv)[:, :, :tq, :hq // hkv, :dv]
    o.copy_(out.permute(0, 2, 1, 3, 4).reshape(b, tq, hq, dv))
    return o, s if scores else None


def topn(scores: Tensor, q_start: int, *, sel_block: int, sel_count: int) -> Tensor:
    """Top-n block indices `[B, Tq, Hkv, sel_count]` (int32) from group scores `[B, Tq, Hkv, Nb]`:
    the rule of `nsa.selection.select_topn` (forced blocks, candidates `j <= t // l'`, ties to
    the lower index, ascending, -1 padded), one program per row, no sort and no scratch."""
    b, tq, hkv, nb = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    idx = torch.empty(b, tq, hkv, sel_count, dtype=torch.int32, device=scores.device)
    if tq == 0:
        return idx
    parts = triton.cdiv(nb, TILES["topn_chunk"])
    if b * tq * hkv < TILES["topn_split_rows"] and parts > 1:
        # Few rows (decode): split each row's blocks over chunks, then merge the candidates.
        chk, bn = TILES["topn_chunk"], _np2(sel_count, 16)
        cs = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.float32, device=scores.device)
        ci = torch.empty(tq, b * hkv, parts, sel_count, dtype=torch.int32, device=scores.device)
        _topn_part[(tq, b * hkv, parts)](scores, cs, ci, scores.stride(0), scores.stride(1), scores.stride(2), nb,
                                         q_start, parts, HKV=hkv, SEL=sel_block, N=sel_count, CHK=chk, BN=bn,
                                         num_warps=1)
        _topn_merge[(tq, b * hkv)](cs, ci, idx, idx.stride(0), idx.stride(1), idx.stride(2), parts * sel_count,
                                   HKV=hkv, N=sel_count, BC=_np2(parts * sel_count, 16), BN=bn, num_warps=4)
        return idx
    bnb = _np2(nb, 16)
    _topn[(tq, b * hkv)](scores, idx, scores.stride(0), scores.stride(1), scores.stride(2), idx.stride(0),
                         idx.stride(1), idx.stride(2), nb, q_start, HKV=hkv, SEL=sel_block, N=sel_count,
                         BNB=bnb, BN=_np2(sel_count, 16), num_warps=4 if bnb >= 1024 else 1)
    return idx


def compressed(call: AttnCall) -> Tensor:
    o, _ = compressed_and_scores(call.q, call.k, call.v, block=call.block, stride=call.stride, sel_block=16,
                                 scale=call.scale, q_start=call.q_start, scores=False)
    return o
