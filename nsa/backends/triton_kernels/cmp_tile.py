"""One compressed tile's work, shared by the prefill and decode compressed kernels: the logits,
the second pass's `p` and `p @ Vc`, and the selection scores (Eq. 9-10: probabilities summed
over the group's heads, mapped to selection blocks by token overlap, in fp32). Logits are in
log2 units: the callers pass `qk_scale2` = scale * log2 e (common.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from nsa.backends.triton_kernels.common import _dot, _program_bh, _pv


@triton.jit
def _group_rows(Q, sqb, sqt, sqh, T, Tc, q_start,
                HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BTQ: tl.constexpr, CMP_BLOCK: tl.constexpr,
                STRIDE: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr):
    """Rows of one prefill program of the group-centric compressed kernels (grid: query tiles,
    latest first, x B*Hkv): the BTQ * GP rows are every (query, head) pair of the group. Returns
    (pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q): the query tile, the rows' queries,
    validity and heads, each row's visible compressed count, the tile's largest (the last query's;
    under the interpreter loops bound by a host int, the masks keep the result exact) and `q`."""
    n_tiles = tl.cdiv(T, BTQ)
    pid_t = n_tiles - 1 - tl.program_id(0)        # heaviest (latest) tiles first
    bh, b, h = _program_bh(1, HKV)
    rows = tl.arange(0, BTQ * GP)
    offs_t = pid_t * BTQ + rows // GP
    g = rows % GP
    row_ok = (offs_t < T) & (g < G)
    t_abs = q_start + offs_t
    nvis = tl.where(t_abs + 1 < CMP_BLOCK, 0, (t_abs + 1 - CMP_BLOCK) // STRIDE + 1)
    nvis = tl.where(row_ok, tl.minimum(nvis, Tc), 0)
    t_last = q_start + tl.minimum(pid_t * BTQ + BTQ, T) - 1
    max_vis = tl.minimum(tl.maximum((t_last + 1 - CMP_BLOCK) // STRIDE + 1, 0), Tc)
    offs_dk = tl.arange(0, BDK)
    heads = h * G + g
    q = tl.load(Q + b * sqb + offs_t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    return pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q


@triton.jit
def _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, qk_scale2,
                BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, IEEE: tl.constexpr, masked):
    """Q·Kc logits of one compressed tile `[c0, c0 + BC)` times `qk_scale2` (log2 units); -inf where invisible (`masked`,
    a runtime bool, False: the caller knows every row sees the whole tile)."""
    offs_c = c0 + tl.arange(0, BC)
    offs_dk = tl.arange(0, BDK)
    kc = tl.load(KC + kc_base + offs_c[:, None] * skt + offs_dk[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
    qk = _dot(q, tl.trans(kc), IEEE)
    if masked:
        qk = tl.where(offs_c[None, :] < nvis[:, None], qk * qk_scale2, float("-inf"))
    else:
        qk = qk * qk_scale2
    return qk


@triton.jit
def _group_scores(ps, offs_c, jb, NBW: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                  SEL_BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Eq. 9 for one compressed tile: `ps [BTQ, BC]` (probabilities summed over the group's
    heads, Eq. 10) -> group scores of selection blocks `jb + [0, NBW)`, `[BTQ, NBW]` fp32.
    w[i, j] = tokens shared by compressed token i `[i*STRIDE, i*STRIDE+CMP_BLOCK)` and block j
    `[j*SEL_BLOCK, (j+1)*SEL_BLOCK)`. MODE 0: broadcast-sum (BTQ < 16); 1: fp32 dot (BTQ, NBW >= 16).
    Both full fp32: ranks must not move with rounding (a 3xTF32 tensor-core variant was about
    2x slower on the H100, bench/triton_tiles.py at 32k)."""
    offs_j = jb + tl.arange(0, NBW)
    lo = tl.maximum(offs_c[:, None] * STRIDE, offs_j[None, :] * SEL_BLOCK)
    hi = tl.minimum(offs_c[:, None] * STRIDE + CMP_BLOCK, (offs_j[None, :] + 1) * SEL_BLOCK)
    w = tl.maximum(hi - lo, 0).to(tl.float32)
    if MODE == 1:
        return tl.dot(ps, w, input_precision="ieee")
    return tl.sum(ps[:, :, None] * w[None, :, :], 1)


@triton.jit
def _pv_tile(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, qk_scale2, m_safe, inv_l, acc,
             BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr,
             IEEE: tl.constexpr):
    """Second-pass work of one compressed tile `[c0, c0 + BC)` with the final softmax stats:
    the exact probabilities `p` (0 where invisible) and `acc + p @ Vc` (`m_safe`: the rows' final
    max, log2 units, 0 for an empty row). Returns (acc, p, offs_c)."""
    qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, qk_scale2, BC, BDK, DK, IEEE, True)
    p = tl.exp2(qk - m_safe[:, None]) * inv_l[:, None]
    offs_c = c0 + tl.arange(0, BC)
    offs_dv = tl.arange(0, BDV)
    vc = tl.load(VC + vc_base + offs_c[:, None] * svt + offs_dv[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dv[None, :] < DV), other=0.0)
    acc += _pv(p, vc, IEEE)
    return acc, p, offs_c


@triton.jit
def _carried_scores(p, offs_c, c0, carry, s_rows, t_ok, NB, BTQ: tl.constexpr, GP: tl.constexpr,
                    BC: tl.constexpr, SHIFT: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                    SEL_BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Scores of one tile when tiles end on block edges: blocks `[jb, jb + SHIFT)` are complete
    after it (the next tile starts at block jb + SHIFT) and are stored to `s_rows` (pointers of
    the tile's score rows, `[BTQ, 1]`); the spill into the next SHIFT blocks is returned as the
    new carry."""
    jb = (c0 * STRIDE) // SEL_BLOCK
    ps = tl.sum(tl.reshape(p, [BTQ, GP, BC]), 1)                      # Eq. 10: over heads
    own = carry + _group_scores(ps, offs_c, jb, SHIFT, CMP_BLOCK, STRIDE, SEL_BLOCK, MODE)
    offs_j = jb + tl.arange(0, SHIFT)
    tl.store(s_rows + offs_j[None, :], own, mask=t_ok & (offs_j[None, :] < NB))
    return _group_scores(ps, offs_c, jb + SHIFT, SHIFT, CMP_BLOCK, STRIDE, SEL_BLOCK, MODE)
