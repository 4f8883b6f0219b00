"""Prefill compressed attention as two independent kernels: the branch output with its
log-sum-exp (one online-softmax pass), then the selection scores from that log-sum-exp.

`_cmp_lse`: one program per (BTQ queries, KV group), rows = every (query, head) pair of the
group (like `compressed._cmp_group`), flash-attention style: one pass over the visible
compressed keys with the output rescaled as the running max moves; writes the output and
`lse[b, head, t]` (natural log; `+inf` for a query that sees no compressed token).

`_cmp_scores`: one program per (compressed-key tile, query tile, KV group); the key tile is
loaded once, then for each head of the group `p = exp(q . k * scale - lse)` (the exact softmax
probabilities, no running max) is added into one `[BQ, BK]` fp32 tile: the head sum of Eq. 10
is a register add. Tiles wholly above the causal staircase return at once. The epilogue maps
the summed probabilities to selection blocks (Eq. 9) by the stride structure of the weights
(below) and writes each `[BQ, BK / R]` block tile once; the two block columns a tile shares
with its neighbours are atomic adds onto the zeroed scores, two addends each, so the result
does not depend on the programs' order. With SPILL (prefill straight into top-n:
`compressed.compressed_select`) no zeroing and no atomics: the tile's spill into the next
tile's first block goes to a side buffer that top-n adds (the same two addends, so the same
fp32 sum).

Block map, for `d | l`, `d | l'`, `E = l / d <= R = l' / d`, R a power of two: with segments of
`d` tokens, compressed token `i` covers segments `i .. i+E-1` and block `j` segments
`jR .. jR+R-1`, so token `jR + r` gives `d * min(R - r, E)` to block `j` and
`d * max(0, r + E - R)` to block `j + 1` (the paper's 16/32/32/32/16 weights). Other sizes use
`compressed._cmp_group`'s general map.

Precision: logits, probabilities and sums in fp32 from any input dtype (the scores differ from
the two-pass kernel's by fp32 rounding only; docs/nsa.md, "Precision").
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa.backends.triton_kernels.cmp_tile import _cmp_logits, _group_rows
from nsa.backends.triton_kernels.common import _dot, _program_bh, _safe_max, _softmax_step


@triton.jit
def _lse_step(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, qk_scale2, m_i, l_i, acc,
              BC: tl.constexpr, BDK: tl.constexpr, DK: tl.constexpr, BDV: tl.constexpr, DV: tl.constexpr,
              IEEE: tl.constexpr, masked):
    """One compressed tile of the online softmax, logits in log2 units (`qk_scale2` = scale * log2 e);
    `masked` False: every row sees the whole tile."""
    offs_c = c0 + tl.arange(0, BC)
    offs_dv = tl.arange(0, BDV)
    qk = _cmp_logits(q, KC, kc_base, skt, c0, nvis, Tc, qk_scale2, BC, BDK, DK, IEEE, masked)
    vc = tl.load(VC + vc_base + offs_c[:, None] * svt + offs_dv[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dv[None, :] < DV), other=0.0)
    return _softmax_step(qk, vc, m_i, l_i, acc, IEEE)


@triton.jit
def _cmp_lse(Q, KC, VC, Out, LSE,
             sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slh,
             T, Tc, q_start, qk_scale2,
             TC_ALL: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
             BTQ: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
             IEEE: tl.constexpr, DYN_LOOP: tl.constexpr):
    """Compressed attention, one online-softmax pass in log2 units (`qk_scale2` = scale * log2 e),
    + the rows' log-sum-exp (natural log)."""
    M: tl.constexpr = BTQ * GP
    pid_t, b, h, offs_t, row_ok, heads, nvis, max_vis, q = _group_rows(Q, sqb, sqt, sqh, T, Tc, q_start, HKV, G,
                                                                       GP, BTQ, CMP_BLOCK, STRIDE, DK, BDK)
    offs_dv = tl.arange(0, BDV)
    kc_base = b * skb + h * skh
    vc_base = b * svb + h * svh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    # Every valid row sees at least the first query's tokens: tiles below that need no mask.
    t_first = q_start + pid_t * BTQ
    all_vis = tl.minimum(tl.where(t_first + 1 < CMP_BLOCK, 0, (t_first + 1 - CMP_BLOCK) // STRIDE + 1), Tc)
    if DYN_LOOP:   # GPU: unmasked tiles, then the masked ones (a branch per tile fails to compile)
        full_end = (all_vis // BC) * BC
        for c0 in range(0, full_end, BC):
            m_i, l_i, acc = _lse_step(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, qk_scale2, m_i, l_i, acc,
                                      BC, BDK, DK, BDV, DV, IEEE, False)
        for c0 in range(full_end, max_vis, BC):
            m_i, l_i, acc = _lse_step(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, qk_scale2, m_i, l_i, acc,
                                      BC, BDK, DK, BDV, DV, IEEE, True)
    else:          # the interpreter: host-int bounds, the same split per tile
        for c0 in range(0, TC_ALL, BC):
            m_i, l_i, acc = _lse_step(q, KC, VC, kc_base, vc_base, skt, svt, c0, nvis, Tc, qk_scale2, m_i, l_i, acc,
                                      BC, BDK, DK, BDV, DV, IEEE, c0 + BC > all_vis)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(Out + b * sob + offs_t[:, None] * sot + heads[:, None] * soh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    # Stored in natural-log units: the scores kernel, FA-3's path (fa3_cmp.py) and a training
    # forward's caller (autograd.blocks_from_lse) all hand it over as such.
    lse = tl.where(empty, float("inf"), _safe_max(m_i) * 0.6931471805599453 + tl.log(tl.where(empty, 1.0, l_i)))  # ln 2
    tl.store(LSE + b * slb + heads * slh + offs_t, lse, mask=row_ok)


@triton.jit
def _block_map(p, ROWS: tl.constexpr, NBK: tl.constexpr, R: tl.constexpr, E: tl.constexpr, STRIDE: tl.constexpr,
               GATHER: tl.constexpr = False):
    """The stride map of `p [ROWS, NBK * R]` (probabilities of NBK * R consecutive compressed
    tokens, from a block edge) onto its NBK selection blocks: (tot, nxt), `tot[:, i]` = what block
    i gets from these tokens, `nxt[:, i]` = what block i + 1 gets from block i's tokens (so
    `nxt[:, NBK - 1]` spills past the tile). The shift of nxt by one column is an exact fp32 dot
    (NBK >= 16), or with GATHER a `tl.gather` of column i - 1 (the same values: a move, then one
    fp32 add either way)."""
    p3 = tl.reshape(p, [ROWS, NBK, R])
    r = tl.arange(0, R)
    own = tl.sum(p3 * (STRIDE * tl.minimum(R - r, E)).to(tl.float32)[None, None, :], 2)
    nxt = tl.sum(p3 * (STRIDE * tl.maximum(r + E - R, 0)).to(tl.float32)[None, None, :], 2)
    i = tl.arange(0, NBK)
    if GATHER:
        prev = tl.gather(nxt, tl.broadcast_to(tl.maximum(i - 1, 0)[None, :], [ROWS, NBK]), 1)
        return own + tl.where(i[None, :] == 0, 0.0, prev), nxt
    shift = (i[None, :] == i[:, None] + 1).to(tl.float32)      # column i -> i + 1, exact in fp32
    return own + tl.dot(nxt, shift, input_precision="ieee"), nxt


@triton.jit
def _cmp_scores(Q, KC, LSE, S, SP,
                sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
                T, Tc, NB, q_start, qk_scale2,
                HKV: tl.constexpr, G: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, R: tl.constexpr,
                E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
                IEEE: tl.constexpr, SPILL: tl.constexpr, QT: tl.constexpr = 1,
                GATHER: tl.constexpr = False):
    """Group scores of one (key tile, query tiles `pid_q * QT ..`, group) from the rows'
    log-sum-exp (log2 units come from `qk_scale2 = scale * log2(e)` and `lse * log2(e)`). The key
    tile is loaded once for the `QT` query tiles; neighbouring programs (along the key tiles) take
    the same query tiles, so those stay in L2. A program whose tiles all lie above the causal
    staircase returns at once; one straddling it runs each of its tiles (a tile above gives zeros:
    its stores are scores that top-n never reads, or zeros onto zeros). SPILL: S is not zeroed;
    every block column of the tile is stored and the spill into the next tile's first block goes
    to `SP[b, t, h, key tile]` (top-n adds it: `topn._row_scores`). Every block top-n reads is
    written: a candidate `j <= t // l' - 2` that is not forced holds a token query t sees (its
    first token ends at `l' j + l - 1 <= t` since `l <= l'`), so its tile, and the tile before,
    run; the forced blocks' scores are never read."""
    pid_k = tl.program_id(0)
    pid_q = tl.program_id(1)
    bh, b, h = _program_bh(2, HKV)
    c0 = pid_k * BK
    t0 = pid_q * QT * BQ
    t_last = q_start + tl.minimum(t0 + QT * BQ, T) - 1
    vis_last = tl.minimum(tl.maximum((t_last + 1 - CMP_BLOCK) // STRIDE + 1, 0), Tc)
    if c0 >= vis_last:        # every tile lies above the causal staircase
        return
    offs_c = c0 + tl.arange(0, BK)
    offs_dk = tl.arange(0, BDK)
    kc = tl.load(KC + b * skb + h * skh + offs_c[:, None] * skt + offs_dk[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
    kt = tl.trans(kc)
    for i in range(QT):
        _scores_tile(Q, LSE, S, SP, kt, b, h, pid_k, c0, t0 + i * BQ, sqb, sqt, sqh, slb, slh, ssb, sst, ssh,
                     spb, spt, sph, T, Tc, NB, q_start, qk_scale2, G, CMP_BLOCK, STRIDE, R, E, BQ, BK, DK, BDK, IEEE,
                     SPILL,
                     GATHER)


@triton.jit
def _scores_tile(Q, LSE, S, SP, kt, b, h, pid_k, c0, t0, sqb, sqt, sqh, slb, slh, ssb, sst, ssh, spb, spt, sph,
                 T, Tc, NB, q_start, qk_scale2, G: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                 R: tl.constexpr, E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr,
                 BDK: tl.constexpr, IEEE: tl.constexpr, SPILL: tl.constexpr, GATHER: tl.constexpr):
    """`_cmp_scores` for queries `t0 .. t0 + BQ - 1` against the loaded key tile `kt` (queries
    past T are masked: their loads give nothing, their stores are dropped)."""
    offs_q = t0 + tl.arange(0, BQ)
    q_ok = offs_q < T
    t_abs = q_start + offs_q
    nvis = tl.where(t_abs + 1 < CMP_BLOCK, 0, (t_abs + 1 - CMP_BLOCK) // STRIDE + 1)
    nvis = tl.minimum(nvis, Tc)
    offs_c = c0 + tl.arange(0, BK)
    offs_dk = tl.arange(0, BDK)
    q_rows = Q + b * sqb + offs_q[:, None].to(tl.int64) * sqt + offs_dk[None, :]
    acc = tl.zeros([BQ, BK], tl.float32)
    for g in range(G):
        head = h * G + g
        q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
        s = _dot(q, kt, IEEE)
        acc += tl.exp2(s * qk_scale2 - lse2[:, None])
    # Invisible entries (and rows that see nothing: lse = +inf) leave the sum here, by select.
    acc = tl.where((offs_c[None, :] < nvis[:, None]) & q_ok[:, None], acc, 0.0)
    NBK: tl.constexpr = BK // R
    tot, nxt = _block_map(acc, BQ, NBK, R, E, STRIDE, GATHER)
    i = tl.arange(0, NBK)
    jb = c0 // R
    offs_j = jb + i
    rows = S + b * ssb + offs_q[:, None].to(tl.int64) * sst + h * ssh
    spill = tl.sum(tl.where(i[None, :] == NBK - 1, nxt, 0.0), 1)
    if SPILL:
        tl.store(rows + offs_j[None, :], tot, mask=q_ok[:, None] & (offs_j[None, :] < NB))
        tl.store(SP + b * spb + offs_q.to(tl.int64) * spt + h * sph + pid_k, spill, mask=q_ok & (jb + NBK < NB))
    else:
        inner = q_ok[:, None] & (offs_j[None, :] < NB) & (i[None, :] > 0)
        tl.store(rows + offs_j[None, :], tot, mask=inner)
        # Column 0 also gets the previous tile's spill, and the last column spills into the next
        # tile's first block: atomic adds, two per block, onto zeros (order-independent).
        first = tl.sum(tl.where(i[None, :] == 0, tot, 0.0), 1)
        edge = S + b * ssb + offs_q.to(tl.int64) * sst + h * ssh
        tl.atomic_add(edge + jb, first, mask=q_ok & (jb < NB), sem="relaxed")
        tl.atomic_add(edge + jb + NBK, spill, mask=q_ok & (jb + NBK < NB), sem="relaxed")
