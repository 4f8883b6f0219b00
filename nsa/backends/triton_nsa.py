"""Own Triton kernels for NSA's sparse branches (forward only).

`selected`: the paper's group-centric kernel (Fig. 3): one program per (query token, KV group)
loads the queries of all heads of the group together (head tile padded to 16 for tl.dot),
streams the selected blocks' keys/values and keeps an online softmax; tokens after t inside
the current block are masked. Reads per program: `n * l'` keys and values of one KV head.

`compressed_and_scores`: one pass pair over the compressed keys per (query tile, KV group, head)
that produces both the compressed branch's output and the selection scores (Eq. 9-10: the
softmax probabilities mapped to selection blocks by token overlap and summed over the group's
heads) without materialising `[T, Tc]` in HBM. Writes `[B, T, Hkv, Nb]` fp32 scores.

Both run under `TRITON_INTERPRET=1` on CPU (tests), and on CUDA.
"""

from __future__ import annotations

import os

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
    return None


def _np2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(x))


if triton is not None:

    @triton.jit
    def _sel_fwd(Q, K, V, IDX, Out,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih, sob, sot, soh,
                 T_k, q_start, k_start, scale,
                 HKV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, SEL: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BG: tl.constexpr, BDK: tl.constexpr,
                 BDV: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
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
        for s in range(N_SEL):
            blk = tl.load(IDX + b * sib + t * sit + h * sih + s)
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
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(Out + b * sob + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(Out.dtype.element_ty),
                 mask=(offs_g[:, None] < G) & (offs_dv[None, :] < DV))

    @triton.jit
    def _cmp_fwd(Q, KC, VC, Out, S, MS, IL,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, ssb, sst, ssh,
                 T, Tc, NB, q_start, scale,
                 TC_ALL: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr, SEL: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BNB: tl.constexpr,
                 BDK: tl.constexpr, BDV: tl.constexpr, SCORES: tl.constexpr, IEEE: tl.constexpr,
                 DYN_LOOP: tl.constexpr):
        pid_t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        offs_t = pid_t * BT + tl.arange(0, BT)
        t_abs = q_start + offs_t
        row_ok = offs_t < T
        nvis = tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1)
        nvis = tl.where(row_ok, tl.minimum(nvis, Tc), 0)
        # Causal: the tile's last query sees the most compressed tokens, so the loops stop there.
        # (Under the interpreter the bound must be a host int: TC_ALL; masks keep the result exact.)
        t_last = q_start + tl.minimum(pid_t * BT + BT, T) - 1
        max_vis = tl.minimum(tl.maximum((t_last + 1 - L) // D + 1, 0), Tc)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        for g in range(G):
            hq = h * G + g
            q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + hq * sqh + offs_dk[None, :],
                        mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            m_i = tl.full([BT], float("-inf"), tl.float32)
            l_i = tl.zeros([BT], tl.float32)
            for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
                offs_c = c0 + tl.arange(0, BC)
                kc = tl.load(KC + b * skb + offs_c[:, None] * skt + h * skh + offs_dk[None, :],
                             mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
                if IEEE:
                    qk = tl.dot(q, tl.trans(kc), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(kc))
                qk = tl.where(offs_c[None, :] < nvis[:, None], qk * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qk - m_safe[:, None]), 1)
                m_i = m_new
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
            acc = tl.zeros([BT, BDV], tl.float32)
            for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
                offs_c = c0 + tl.arange(0, BC)
                kc = tl.load(KC + b * skb + offs_c[:, None] * skt + h * skh + offs_dk[None, :],
                             mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
                if IEEE:
                    qk = tl.dot(q, tl.trans(kc), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(kc))
                qk = tl.where(offs_c[None, :] < nvis[:, None], qk * scale, float("-inf"))
                p = tl.exp(qk - m_safe[:, None]) * inv_l[:, None]          # exact p_cmp, 0 where invisible
                vc = tl.load(VC + b * svb + offs_c[:, None] * svt + h * svh + offs_dv[None, :],
                             mask=(offs_c[:, None] < Tc) & (offs_dv[None, :] < DV), other=0.0)
                if IEEE:
                    acc += tl.dot(p, vc.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(p.to(vc.dtype), vc)
            tl.store(Out + b * sob + offs_t[:, None] * sot + hq * soh + offs_dv[None, :],
                     acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
            if SCORES:
                # Softmax stats per (query, head) for the scores kernel: [B, T, Hq] fp32.
                stat = b * (T * HKV * G) + offs_t * (HKV * G) + hq
                tl.store(MS + stat, m_safe, mask=row_ok)
                tl.store(IL + stat, inv_l, mask=row_ok)

    @triton.jit
    def _cmp_scores(Q, KC, S, MS, IL,
                    sqb, sqt, sqh, skb, skt, skh, ssb, sst, ssh,
                    T, Tc, NB, q_start, scale,
                    TC_ALL: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                    SEL: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BNB: tl.constexpr,
                    BDK: tl.constexpr, IEEE: tl.constexpr, DYN_LOOP: tl.constexpr):
        """Group scores: for each compressed tile, sum over the group's heads of p_cmp @ overlap,
        accumulated in registers and added to the output once per tile (not once per head)."""
        pid_t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        offs_t = pid_t * BT + tl.arange(0, BT)
        t_abs = q_start + offs_t
        row_ok = offs_t < T
        nvis = tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1)
        nvis = tl.where(row_ok, tl.minimum(nvis, Tc), 0)
        t_last = q_start + tl.minimum(pid_t * BT + BT, T) - 1
        max_vis = tl.minimum(tl.maximum((t_last + 1 - L) // D + 1, 0), Tc)
        offs_dk = tl.arange(0, BDK)
        for c0 in range(0, max_vis if DYN_LOOP else TC_ALL, BC):
            offs_c = c0 + tl.arange(0, BC)
            kc = tl.load(KC + b * skb + offs_c[:, None] * skt + h * skh + offs_dk[None, :],
                         mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
            # Overlap of compressed token i [i*D, i*D+L) with selection block j [j*SEL, (j+1)*SEL).
            jb = (c0 * D) // SEL
            offs_j = jb + tl.arange(0, BNB)
            lo = tl.maximum(offs_c[:, None] * D, offs_j[None, :] * SEL)
            hi = tl.minimum(offs_c[:, None] * D + L, (offs_j[None, :] + 1) * SEL)
            w = tl.maximum(hi - lo, 0).to(tl.float32)
            tot = tl.zeros([BT, BNB], tl.float32)
            for g in range(G):
                hq = h * G + g
                q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + hq * sqh + offs_dk[None, :],
                            mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
                stat = b * (T * HKV * G) + offs_t * (HKV * G) + hq
                m = tl.load(MS + stat, mask=row_ok, other=0.0)
                il = tl.load(IL + stat, mask=row_ok, other=0.0)
                if IEEE:
                    qk = tl.dot(q, tl.trans(kc), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(kc))
                qk = tl.where(offs_c[None, :] < nvis[:, None], qk * scale, float("-inf"))
                p = tl.exp(qk - m[:, None]) * il[:, None]
                tot += tl.dot(p, w, input_precision="ieee")               # ranks need full fp32
            ptr = S + b * ssb + offs_t[:, None] * sst + h * ssh + offs_j[None, :]
            smask = row_ok[:, None] & (offs_j[None, :] < NB)
            old = tl.load(ptr, mask=smask, other=0.0)
            tl.store(ptr, old + tot, mask=smask)
            tl.debug_barrier()   # the next tile's window overlaps this one's blocks


def selected(call: AttnCall) -> Tensor:
    q, k, v, idx = call.q, call.k, call.v, call.block_indices
    b, tq, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    idx = idx.to(torch.int32).contiguous()
    o = torch.empty(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    group = hq // hkv
    _sel_fwd[(tq, b * hkv)](
        q, k, v, idx, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        o.stride(0), o.stride(1), o.stride(2), k.shape[1], call.q_start, call.k_start, call.scale,
        HKV=hkv, G=group, N_SEL=idx.shape[-1], SEL=call.sel_block, DK=dk, DV=dv, BG=_np2(group),
        BDK=_np2(dk), BDV=_np2(dv), IEEE=q.dtype == torch.float32)
    return o


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
    bt, bc = (16, 16) if _interpret() else (64, 64)
    bnb = _np2((bc * stride + block) // sel_block + 2, 16)
    stats = (torch.empty(b, tq, hq, dtype=torch.float32, device=q.device) if scores else s,
             torch.empty(b, tq, hq, dtype=torch.float32, device=q.device) if scores else s)
    grid = (triton.cdiv(tq, bt), b * hkv)
    common = dict(TC_ALL=tc if _interpret() else 0, HKV=hkv, G=hq // hkv, L=block, D=stride, DK=dk, BT=bt, BC=bc,
                  BDK=_np2(dk), IEEE=q.dtype == torch.float32, DYN_LOOP=not _interpret())
    _cmp_fwd[grid](
        q, k_cmp, v_cmp, o, s, *stats, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
        k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), o.stride(0), o.stride(1), o.stride(2),
        s.stride(0), s.stride(1), s.stride(2), tq, tc, nb, q_start, scale,
        SEL=sel_block, DV=dv, BNB=bnb, BDV=_np2(dv), SCORES=scores, **common)
    if scores:
        _cmp_scores[grid](
            q, k_cmp, s, *stats, q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1),
            k_cmp.stride(2), s.stride(0), s.stride(1), s.stride(2), tq, tc, nb, q_start, scale,
            SEL=sel_block, BNB=bnb, **common)
    return o, s if scores else None


def compressed(call: AttnCall) -> Tensor:
    o, _ = compressed_and_scores(call.q, call.k, call.v, block=call.block, stride=call.stride, sel_block=16,
                                 scale=call.scale, q_start=call.q_start, scores=False)
    return o
