"""One compressed tile's work, shared by the prefill and decode compressed kernels: the logits,
the second pass's `p` and `p @ Vc`, and the selection scores (Eq. 9-10: probabilities summed
over the group's heads, mapped to selection blocks by token overlap, in fp32)."""

from __future__ import annotations

import triton
import triton.language as tl

from nsa.backends.triton_kernels.common import _dot, _pv


@triton.jit
def _group_rows(Q, sqb, sqt, sqh, T, Tc, q_start,
                HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BTQ: tl.constexpr, L: tl.constexpr,
                D: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr):
    """Rows of one prefill program of the group-centric compressed kernels (grid: query tiles,
    latest first, x B*Hkv): the BTQ * GP rows are every (query, head) pair of the group. Returns
    (pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q): the query tile, the rows' queries,
    validity and heads, each row's visible compressed count, the tile's largest (the last query's;
    under the interpreter loops bound by a host int, the masks keep the result exact) and `q`."""
    n_tiles = tl.cdiv(T, BTQ)
    pid_t = n_tiles - 1 - tl.program_id(0)        # heaviest (latest) tiles first
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)   # b * batch stride can pass 2**31 (B >= 2 at 128k)
    h = bh % HKV
    rows = tl.arange(0, BTQ * GP)
    offs_t = pid_t * BTQ + rows // GP
    g = rows % GP
    row_ok = (offs_t < T) & (g < G)
    t_abs = q_start + offs_t
    nvis = tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1)
    nvis = tl.where(row_ok, tl.minimum(nvis, Tc), 0)
    t_last = q_start + tl.minimum(pid_t * BTQ + BTQ, T) - 1
    max_vis = tl.minimum(tl.maximum((t_last + 1 - L) // D + 1, 0), Tc)
    offs_dk = tl.arange(0, BDK)
    heads = h * G + g
    q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    return pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q


@triton.jit
def _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, scale,
                BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, IEEE: tl.constexpr, masked):
    """Scaled Q·Kc logits of one compressed tile `[c0, c0 + BC)`; -inf where invisible (`masked`,
    a runtime bool, False: the caller knows every row sees the whole tile)."""
    offs_c = c0 + tl.arange(0, BC)
    offs_dk = tl.arange(0, BDK)
    kc = tl.load(KC + kc_base + offs_c[:, None] * skt + offs_dk[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
    qk = _dot(q, tl.trans(kc), IEEE)
    if masked:
        qk = tl.where(offs_c[None, :] < nvis[:, None], qk * scale, float("-inf"))
    else:
        qk = qk * scale
    return qk


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
    qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, scale, BC, BDK, DK, IEEE, True)
    p = tl.exp(qk - m_safe[:, None]) * inv_l[:, None]
    offs_c = c0 + tl.arange(0, BC)
    offs_dv = tl.arange(0, BDV)
    vc = tl.load(VC + vc_base + offs_c[:, None] * svt + offs_dv[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dv[None, :] < DV), other=0.0)
    acc += _pv(p, vc, IEEE)
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
