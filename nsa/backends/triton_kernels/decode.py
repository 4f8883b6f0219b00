"""One decode step of the whole NSA layer in four launches (results/h100/decode-fused/).

The separate-op decode (compressed split + spill, two-stage top-n, the window and the selection
each split and combined, torch glue between them) ran 15-20 kernels per step; at B = 8 on the
H100 most of its 77-110 us was launches and serial latency, not bytes. Here the step for one
query per sequence (`q [B, 1, Hq, dk]` at position `t`) is:

    A  _dec_cmp     grid (chunks, B*Hkv): one tile of CH compressed keys per program, all heads
                    of the group as rows (flash-decoding): the chunk's softmax partial (m, l, acc)
                    and its block-score partial: p = exp(logit - m) mapped to selection blocks per
                    head by the stride map of scores.py (own blocks, plus the one block spilled
                    into the next chunk).
    B  _dec_topn    grid (1, B*Hkv): each head's lse from the chunks' (m, l); the group scores
                    (Eq. 9-10) as sum over heads and chunks of exp(m_c - lse) * partial; then the
                    top-n (topn.py's `_select_row`).
    C  _dec_blocks  grid (selected + window + dv / dout_cols programs, B*Hkv): raw-token blocks,
                    all heads of the group as rows: the selected blocks and the window's 64-token
                    blocks, one softmax partial each; and the compressed output, merged from A's
                    chunk partials by columns (beside the top-n, so not on the chain after it).
    D  _dec_out     grid (B*Hkv, dv / dout_cols): merges the selected and window partials, takes
                    C's compressed output and forms the gated sum in fp32, written once in q's
                    dtype.

On sm90+ B, C and D go by programmatic dependent launch (`Tiles.dec_pdl`): each is launched
while the one before still runs, once every program of that kernel has started. With
`Tiles.dec_flags` (the default) each program then waits only for its own group's inputs: A's
programs, B's top-n and C's block and merge programs count themselves done per group (a
barrier, then a release atomic), and the programs that read them spin on those counts (acquire)
- so a group's top-n, selected blocks and merge run while later groups' chunks still stream.
The spin cannot block what it waits for: those programs have all started. The counts live in a
buffer the caller keeps (NSACache; `_counts`), which the step resets itself (A and D, see
their docstrings) rather than by a zeroing kernel before A. Without `dec_flags` each
waits for the whole grid before it (`griddepcontrol.wait`). C's window programs need nothing
from B and do not wait. A reads what the step's earlier torch kernels wrote, and those do not
signal dependents, so A is launched normally.

Partials are merged `Tiles.dec_cb` per vector load (a loop of dependent loads, one L2 round trip
each, costs more than the bytes: an unrolled 2-D variant measured 2x slower in B and D), except
that B's top-n program loads every chunk at once up to `Tiles.dtop_once` chunks, and D issues
all its loads before it uses any: on the last group's chain the round trips count, not the bytes
(results/h100/decode-tail/).
Scores are fp32 like the prefill kernels (docs/nsa.md, "Precision"): p relative to the chunk's
max, rescaled by exp(m_c - lse), is exp(logit - lse) up to fp32 rounding. Every softmax
statistic (row maxima, partials' m, lse) is in log2 units: the host passes `scale * LOG2E`
(common.py), and the merges use common's `_merge_weights` / `_merge_stats`. The partial outputs
(unnormalised acc) are stored in q's dtype, (m, l) in fp32 (docs/nsa.md, "Decode";
`Tiles.dec_part_fp32` keeps fp32). `decode_step(_trace=)` has the kernels stamp the GPU's global
timer per group at the points of TRACE_NAMES (lab/decode_trace.py: where the step's
time after kernel A goes, results/h100/decode-tail/). `supported` sends
other block geometries to the separate-op path; `Tiles.dec_fused = False` forces that path.
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
    _merge_stats,
    _merge_weights,
    _program_bh,
    _pv,
    _safe_max,
    _softmax_tile,
    np2,
    pow2,
    unit_last_stride,
)
from nsa.backends.triton_kernels.scores import _block_map
from nsa.backends.triton_kernels.tiles import Tiles, interpreting
from nsa.backends.triton_kernels.topn import _row_scores, _select_row, sort_params

try:   # programmatic dependent launch (sm90+): Triton's grid-dependency-control intrinsics
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # pragma: no cover - older Triton: the step runs without it (pdl_ok says so)
    gdc_launch_dependents = gdc_wait = None

WIN_BLOCK = 64   # window keys per window program of kernel C
# `decode_step(_trace=)`: per group, the global timer (ns) at these points of the step; the max over
# the programs that stamp a slot, or the min for TRACE_MIN_SLOTS (lab/decode_trace.py)
TRACE_SLOTS = tl.constexpr(16)
TRACE_NAMES = {0: "A last end", 1: "A first start", 10: "B top-n start", 2: "B top-n waited", 14: "B top-n row stored",
               15: "B top-n selected", 3: "B top-n end", 4: "C merges end", 11: "C sel first start", 5: "C sel waited",
               6: "C sel end", 12: "C win first start", 7: "C win end", 13: "D first start", 8: "D waited",
               9: "D end"}
TRACE_MIN_SLOTS = (1, 10, 11, 12, 13)


def _counts(n: int, device: torch.device) -> Tensor:
    """Per-group done-counts of the step (Tiles.dec_flags), zeroed: `[4, n]` int32 for n >= B*Hkv
    groups (A's chunks, C's merges, B's top-n, C's block programs). A step resets them itself (kernel A
    the second and fourth, kernel D the others), so a caller that keeps one (NSACache) passes it
    to every step and no step runs a zeroing kernel (~1.5 us of a 60 us step)."""
    return torch.zeros(4, n, dtype=torch.int32, device=device)


def _scratch(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """Scratch of the step (partials, scores; fp32 unless `dtype`): every element read is written
    first (tests fill it with NaN to hold the kernels to that)."""
    return torch.empty(max(n, 1), dtype=dtype, device=device)


@triton.jit
def _attend_block(q, Kb, Vb, skt, svt, kpos, valid, qk_scale2,
                  DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    """Softmax partial of the group's heads over one block of keys at rows `kpos` (masked by
    `valid`), log2 units: (row max m, p = exp2(logit * qk_scale2 - m), acc = p @ V); the row sum
    of p is l."""
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    k = tl.load(Kb + kpos[:, None].to(tl.int64) * skt + offs_dk[None, :],
                mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
    qk = _dot(q, tl.trans(k), IEEE)
    qk = tl.where(valid[None, :], qk * qk_scale2, float("-inf"))
    m, p = _softmax_tile(qk)
    v = tl.load(Vb + kpos[:, None].to(tl.int64) * svt + offs_dv[None, :],
                mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    acc = _pv(p, v, IEEE)
    return m, p, acc


@triton.jit
def _group_q(Q, b, h, sqb, sqh, G: tl.constexpr, BG: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr):
    """The query rows of the G heads of KV group `h` of sequence `b` (padded rows 0)."""
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    return tl.load(Q + b * sqb + (h * G + offs_g)[:, None] * sqh + offs_dk[None, :],
                   mask=(offs_g[:, None] < G) & (offs_dk[None, :] < DK), other=0.0)


@triton.jit
def _store_partial(PML, PACC, part, m, den, acc, BG: tl.constexpr, BDV: tl.constexpr):
    """Partial `part`: (row max m, row sum den) -> PML[part, 0/1] (fp32), acc -> PACC[part] (its dtype)."""
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    part = part.to(tl.int64)
    tl.store(PML + part * 2 * BG + offs_g, m)
    tl.store(PML + part * 2 * BG + BG + offs_g, den)
    tl.store(PACC + (part * BG + offs_g)[:, None] * BDV + offs_dv[None, :], acc.to(PACC.dtype.element_ty))


@triton.jit
def _signal(ptr):
    """Count this program done at `ptr`: a barrier (every thread's stores issued), then one
    release atomic, so a program that reads the count with acquire sees those stores."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _group_t(POS, b, t, DEVPOS: tl.constexpr):
    """The position of sequence `b`'s query: POS[b] (DEVPOS: a ragged batch, or a step replayed
    from a CUDA graph at any position), else the step's one host position `t`."""
    if DEVPOS:
        t = tl.minimum(tl.load(POS + b), t)    # t: the step's bound (never past its scratch)
    return t


@triton.jit
def _group_nch(t, tc, E: tl.constexpr, STRIDE: tl.constexpr, CH: tl.constexpr):
    """Compressed tokens visible at position `t` (at most `tc` stored), and their CH-token chunks."""
    nvis = tl.where(t + 1 >= E * STRIDE, tl.minimum((t + 1 - E * STRIDE) // STRIDE + 1, tc), 0)
    return nvis, (nvis + CH - 1) // CH


@triton.jit
def _page_rows(PT, b, pos, ok, spt, PAGE: tl.constexpr):
    """Rows of positions `pos` of sequence `b` in a cache: PAGE = 0: the sequence's own rows
    (`pos`); PAGE > 0: a page pool of PAGE-token pages, page `pos // PAGE` of the sequence at
    PT[b, pos // PAGE] (int64 rows of the pool viewed as `[pages * PAGE, ...]`)."""
    if PAGE > 0:
        page = tl.load(PT + b * spt + pos // PAGE, mask=ok, other=0)
        return page.to(tl.int64) * PAGE + pos % PAGE
    else:
        return pos


@triton.jit
def _await(ptr, target, FLAGS: tl.constexpr):
    """Wait until the count at `ptr` reaches `target` (acquire reads). Only programs launched after
    every program they wait for has started spin here (Tiles.dec_flags: a dependent launch
    starts when all programs of the kernel before it have started), so the wait always ends.
    FLAGS = 2 (the interpreter, where kernels run one after another): no spin (tests check the
    final counts instead, `_counts`)."""
    if FLAGS == 1:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _stamp(TR, bh, slot: tl.constexpr, MAX: tl.constexpr):
    """Diagnostics (`decode_step(_trace=)`, lab/decode_trace.py): the GPU's global
    timer (ns) into TR[bh, slot], the max (MAX) or min over the programs that stamp there."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [bh], dtype=tl.int64, is_pure=False,
                                    pack=1)
    if MAX:
        tl.atomic_max(TR + bh * TRACE_SLOTS + slot, now, sem="relaxed", scope="gpu")
    else:
        tl.atomic_min(TR + bh * TRACE_SLOTS + slot, now, sem="relaxed", scope="gpu")


# Positions and the sizes derived from them change every step: not specialised (each value's
# divisibility would compile another variant, seconds each, as a step crosses it).
@triton.jit(do_not_specialize=["t", "tc", "nchs"])
def _dec_cmp(Q, KC, VC, PML, PACC, PSC, PSP, SYNC, TR, POS, t, tc, nchs, sqb, sqh, skb, skt, skh, svb, svt, svh, nbh,
             qk_scale2, DEVPOS: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, CH: tl.constexpr,
             R: tl.constexpr, E: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
             BDV: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, FLAGS: tl.constexpr,
             TRACE: tl.constexpr):
    """Program (c, bh), c < nch (the group's own chunk count, at its position): chunk `c` of the
    compressed keys of (sequence, KV group) `bh`
    (`_chunk_role`); FLAGS: then counted done in SYNC[0][bh]. FLAGS, c = 0 (the grid has it even
    when nch = 0): first sets the group's counts SYNC[1] and SYNC[3], which the last step left
    at their targets, back to 0, before it lets kernel B start (so before any program of this
    step can count there); kernel D set SYNC[0] and SYNC[2] back to 0."""
    c = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    nvis, nch = _group_nch(_group_t(POS, b, t, DEVPOS), tc, E, STRIDE, CH)
    if TRACE:
        _stamp(TR, bh, 1, False)
    if FLAGS and c == 0:
        z = tl.atomic_xchg(SYNC + nbh + bh, 0, sem="relaxed", scope="gpu")
        z = z | tl.atomic_xchg(SYNC + 3 * nbh + bh, 0, sem="relaxed", scope="gpu")
        if PDL:
            if z >= 0:             # always (counts are >= 0): the trigger waits for both exchanges
                gdc_launch_dependents()
    elif PDL:
        gdc_launch_dependents()    # kernel B may start its programs (they wait for this grid)
    if c < nch:
        _chunk_role(Q, KC, VC, PML, PACC, PSC, PSP, b, h, bh * nchs + c, c, sqb, sqh, skb, skt, skh, svb, svt,
                    svh, nvis, qk_scale2, G, BG, CH, R, E, STRIDE, DK, DV, BDK, BDV, IEEE)
        if TRACE:                  # before the signal, so a waiting program's stamps come after it
            _stamp(TR, bh, 0, True)
        if FLAGS:
            _signal(SYNC + bh)


@triton.jit
def _chunk_role(Q, KC, VC, PML, PACC, PSC, PSP, b, h, part, c, sqb, sqh, skb, skt, skh, svb, svt, svh, nvis,
                qk_scale2, G: tl.constexpr, BG: tl.constexpr, CH: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
                STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                IEEE: tl.constexpr):
    """Chunk `c` = compressed keys `[c*CH, (c+1)*CH)`, visible below `nvis`, for the G heads of one
    (sequence, KV group): (m, l) -> PML[part, 0/1, g], acc -> PACC[part, g], block-score partial
    of blocks `c*CH/R + i` -> PSC[part, g, i] and the spill into block `(c+1)*CH/R` -> PSP[part, g]
    (part = bh * nchs + c, nchs the chunks of the step's largest position)."""
    offs_g = tl.arange(0, BG)
    g_ok = offs_g < G
    q = _group_q(Q, b, h, sqb, sqh, G, BG, DK, BDK)
    offs_c = c * CH + tl.arange(0, CH)
    m, p, acc = _attend_block(q, KC + b * skb + h * skh, VC + b * svb + h * svh, skt, svt, offs_c, offs_c < nvis,
                              qk_scale2, DK, DV, BDK, BDV, IEEE)
    # Padded head rows (q = 0) leave the partial empty, so they add nothing to the group's scores.
    m = tl.where(g_ok, m, float("-inf"))
    p = tl.where(g_ok[:, None], p, 0.0)
    _store_partial(PML, PACC, part, m, tl.sum(p, 1), acc, BG, BDV)
    part = part.to(tl.int64)
    # Block map (scores.py): token jR + r gives d*min(R-r, E) to block j, d*max(0, r+E-R) to j+1.
    NBK: tl.constexpr = CH // R
    tot, nxt = _block_map(p, BG, NBK, R, E, STRIDE)
    i = tl.arange(0, NBK)
    tl.store(PSC + (part * BG + offs_g)[:, None] * NBK + i[None, :], tot)
    tl.store(PSP + part * BG + offs_g, tl.sum(tl.where(i[None, :] == NBK - 1, nxt, 0.0), 1))


@triton.jit
def _window_role(Q, KW, VW, WML, WACC, b, h, part, wblk, sqb, sqh, skwb, skwt, skwh, svwb, svwt, svwh, t, kw_start,
                 PT, spt, wcap, qk_scale2, G: tl.constexpr, BG: tl.constexpr, WB: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr, WMODE: tl.constexpr,
                 PAGE: tl.constexpr):
    """Window block `wblk` (positions `wblk*WB ..` within `kw_start .. t`) of the window cache, for
    the G heads of one (sequence, KV group): its partial (m, l) -> WML[part], acc -> WACC[part]
    (part = bh * NWP + block). Needs nothing of the other kernels, so it never waits. Rows of the
    window cache: WMODE 0: it holds positions `kw_start ..` from row 0; 1: a ring of `wcap` rows,
    position p at row p % wcap; 2: the raw cache's pages (PT, PAGE: a shared-K/V layer's paged
    cache, read in place)."""
    q = _group_q(Q, b, h, sqb, sqh, G, BG, DK, BDK)
    pos_w = wblk * WB + tl.arange(0, WB)
    ok = (pos_w >= kw_start) & (pos_w <= t)
    if WMODE == 0:
        rows = pos_w - kw_start
    elif WMODE == 1:
        rows = pos_w % wcap
    else:
        rows = _page_rows(PT, b, pos_w, ok, spt, PAGE)
    if WMODE == 2:
        kb, vb = KW + h * skwh, VW + h * svwh
    else:
        kb, vb = KW + b * skwb + h * skwh, VW + b * svwb + h * svwh
    m, p_w, acc = _attend_block(q, kb, vb, skwt, svwt, rows, ok, qk_scale2, DK, DV, BDK, BDV, IEEE)
    _store_partial(WML, WACC, part, m, tl.sum(p_w, 1), acc, BG, BDV)


@triton.jit
def _load_ml(PML, part, ok, offs_g, BG: tl.constexpr):
    """(m, l) `[len(part), BG]` of partials `part` (int64) stored by `_store_partial`; rows not
    `ok`: (-inf, 0), which merge as nothing."""
    ptr = PML + (part * 2)[:, None] * BG + offs_g[None, :]
    return (tl.load(ptr, mask=ok[:, None], other=float("-inf")),
            tl.load(ptr + BG, mask=ok[:, None], other=0.0))


@triton.jit
def _chunk_stats(PML, base, nch, offs_g, NCH_HOST: tl.constexpr, DYN: tl.constexpr, BG: tl.constexpr,
                 CB: tl.constexpr):
    """(max m, l rescaled to it) over the chunk partials `base .. base + nch - 1`, per head, CB
    partials per vector load, merged into the running (m, l) as they come (log2 units)."""
    cc = tl.arange(0, CB)
    m_run = tl.full([BG], float("-inf"), tl.float32)
    l_run = tl.zeros([BG], tl.float32)
    for c0 in range(0, nch if DYN else NCH_HOST, CB):
        c = c0 + cc
        m, lc = _load_ml(PML, (base + c).to(tl.int64), c < nch, offs_g, BG)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        l_run = l_run * _merge_weights(m_run, m_new) + tl.sum(lc * _merge_weights(m, m_new[None, :]), 0)
        m_run = m_new
    return m_run, l_run


# Positions and the sizes derived from them change every step: not specialised (each value's
# divisibility would compile another variant, seconds each, as a step crosses it).
@triton.jit(do_not_specialize=["t", "tc", "nchs"])
def _dec_topn(PML, PSC, PSP, S, IDX, SYNC, TR, POS, t, tc, nchs, sib, sih, nbh,
              NCH_HOST: tl.constexpr, DYN: tl.constexpr, DEVPOS: tl.constexpr, EXT: tl.constexpr,
              E: tl.constexpr, STRIDE: tl.constexpr, CH: tl.constexpr, SEL_BLOCK: tl.constexpr,
              HKV: tl.constexpr, BG: tl.constexpr,
              NBK: tl.constexpr, SW: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr,
              ALGO: tl.constexpr, IB: tl.constexpr, K2: tl.constexpr, CW: tl.constexpr, CAP: tl.constexpr,
              SORT64: tl.constexpr, LANES: tl.constexpr, ONCE: tl.constexpr, PDL: tl.constexpr,
              FLAGS: tl.constexpr, TRACE: tl.constexpr):
    """Per (sequence, KV group) `bh` (FLAGS: waits for its own group's chunks, SYNC[0][bh] = nch,
    instead of kernel A's whole grid, and counts itself done in SYNC[2][bh]): lse per head; group
    scores of blocks [0, NB) -> S[bh] (fp32): block `c*NBK + i` gets sum_h exp(m_c,h - lse_h) *
    PSC[c, h, i], plus chunk c-1's spill at i = 0; then their top N under the spec's rules ->
    IDX[b, 0, h, :]. (The compressed output's merges ran here beside the top-n until kernel C
    took them: with one program per group, B's programs all start, and C is launched, as soon
    as A's first programs end, so C's reads begin under A's last wave; results/h100/decode-tail/.)
    EXT: IDX already holds the blocks (imported from an external indexer): no top-n, only the count."""
    if PDL:
        gdc_launch_dependents()    # kernel C may start its programs (they wait for this grid)
    bh, b, h = _program_bh(1, HKV)
    tg = _group_t(POS, b, t, DEVPOS)
    nvis, nch = _group_nch(tg, tc, E, STRIDE, CH)
    if TRACE:
        _stamp(TR, bh, 10, False)
    if FLAGS:
        _await(SYNC + bh, nch, FLAGS)     # this group's chunk partials are stored and visible
    elif PDL:
        gdc_wait()                 # kernel A's partials are complete and visible
    if TRACE:
        _stamp(TR, bh, 2, True)
    if not EXT:
        _topn_role(PML, PSC, PSP, S, IDX + b * sib + h * sih, bh, nch, nchs, tg // SEL_BLOCK + 1, tg // SEL_BLOCK,
                   NCH_HOST,
                   DYN, BG, NBK, SW, N, BN, CB, ALGO, IB, K2, CW, CAP, SORT64, LANES, ONCE, TR, TRACE)
    if TRACE:
        _stamp(TR, bh, 3, True)
    if FLAGS:
        _signal(SYNC + 2 * nbh + bh)


@triton.jit
def _topn_role(PML, PSC, PSP, S, out, bh, nch, nchs, NB, cur, NCH_HOST: tl.constexpr, DYN: tl.constexpr, BG: tl.constexpr,
               NBK: tl.constexpr, SW: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr,
               ALGO: tl.constexpr, IB: tl.constexpr, K2: tl.constexpr, CW: tl.constexpr, CAP: tl.constexpr,
               SORT64: tl.constexpr, LANES: tl.constexpr, ONCE: tl.constexpr, TR, TRACE: tl.constexpr):
    """Kernel B, r = 0: lse per head, the group's score row in S[bh] (`_scores_once` when the
    group's chunks fit ONCE, else `_scores_loop`), its top N -> `out`."""
    offs_g = tl.arange(0, BG)
    base = bh * nchs
    srow = S + bh.to(tl.int64) * (SW + CAP)   # the row, then CAP ints of top-n scratch
    k = tl.arange(0, NBK)
    if ONCE > 0 and nch <= ONCE:
        _scores_once(PML, PSC, PSP, srow, base, nch, offs_g, k, BG, NBK, SW, ONCE)
    else:
        _scores_loop(PML, PSC, PSP, srow, base, nch, offs_g, k, NCH_HOST, DYN, BG, NBK, SW, CB)
    jz = tl.arange(0, SW)
    tl.store(srow + jz, tl.zeros([SW], tl.float32), mask=jz >= (nch + 1) * NBK)   # past every chunk: 0
    tl.debug_barrier()
    if TRACE:
        _stamp(TR, bh, 14, True)
    s = _row_scores(srow, srow, jz, NB, cur, 0)
    _select_row(srow, srow, s, jz, NB, cur, out, srow + SW, N, BN, ALGO, IB, K2, CW, CAP, 0, SORT64, LANES)
    if TRACE:
        _stamp(TR, bh, 15, True)


@triton.jit
def _lse(m_run, l_run):
    """Log-sum-exp per head from (max, sum over the chunks), log2 units; +inf for a row that sees
    nothing (and the padded heads), so exp2(m - lse) is 0 there."""
    return tl.where(l_run == 0.0, float("inf"), _safe_max(m_run) + tl.log2(tl.where(l_run == 0.0, 1.0, l_run)))


@triton.jit
def _scores_once(PML, PSC, PSP, srow, base, nch, offs_g, k, BG: tl.constexpr, NBK: tl.constexpr, SW: tl.constexpr,
                 ONCE: tl.constexpr):
    """`_scores_loop` for `nch <= ONCE` chunks with every load issued at once: (m, l), the block
    partials and the spills of all chunks, then lse and the rows. The loop waits for one L2
    round trip per CB chunks, twice (lse, then the rows), on the step's chain for the last group
    (results/h100/decode-tail/). Chunk c's spill goes to block (c+1)*NBK, the first of row c+1 or,
    for the last chunk, of row nch (which has nothing else)."""
    c = tl.arange(0, ONCE)
    ok = c < nch
    part = (base + c).to(tl.int64)
    m, lc = _load_ml(PML, part, ok, offs_g, BG)
    own = tl.load(PSC + (part[:, None, None] * BG + offs_g[None, :, None]) * NBK + k[None, None, :],
                  mask=ok[:, None, None], other=0.0)
    sp = tl.load(PSP + part[:, None] * BG + offs_g[None, :], mask=ok[:, None], other=0.0)
    m_run, l_run, _ = _merge_stats(m, lc)
    lse = _lse(m_run, l_run)
    w = tl.exp2(m - lse[None, :])                                      # [ONCE, BG]
    sc = tl.sum(w[:, :, None] * own, 1)                                # [ONCE, NBK]
    spill = tl.sum(w * sp, 1)                                          # chunk c -> block (c+1)*NBK
    prev = tl.sum(tl.where(c[:, None] == c[None, :] + 1, spill[None, :], 0.0), 1)   # row c gets chunk c-1's
    sc = sc + tl.where(k[None, :] == 0, prev[:, None], 0.0)
    j = c[:, None] * NBK + k[None, :]
    tl.store(srow + j, sc, mask=ok[:, None] & (j < SW))
    j = nch * NBK + k                                                  # row nch: the last chunk's spill only
    tl.store(srow + j, tl.where(k == 0, tl.sum(tl.where(c == nch - 1, spill, 0.0), 0), 0.0), mask=j < SW)


@triton.jit
def _scores_loop(PML, PSC, PSP, srow, base, nch, offs_g, k, NCH_HOST: tl.constexpr, DYN: tl.constexpr,
                 BG: tl.constexpr, NBK: tl.constexpr, SW: tl.constexpr, CB: tl.constexpr):
    """The group's score row -> srow[0 : (nch + 1) * NBK], CB chunks per vector load: lse per head
    from the chunks' (m, l), then block `c*NBK + i` gets sum_h exp(m_c,h - lse_h) * PSC[c, h, i],
    plus chunk c-1's spill at i = 0."""
    m_run, l_run = _chunk_stats(PML, base, nch, offs_g, NCH_HOST, DYN, BG, CB)
    lse = _lse(m_run, l_run)
    cc = tl.arange(0, CB)
    # Chunk rows 0 .. nch: row nch holds only chunk nch-1's spill (the blocks after the last chunk).
    for c0 in range(0, (nch if DYN else NCH_HOST) + 1, CB):
        c = c0 + cc
        own_ok = c < nch
        part = (base + c).to(tl.int64)
        m = tl.load(PML + (part * 2)[:, None] * BG + offs_g[None, :], mask=own_ok[:, None], other=float("-inf"))
        own = tl.load(PSC + (part[:, None, None] * BG + offs_g[None, :, None]) * NBK + k[None, None, :],
                      mask=own_ok[:, None, None], other=0.0)
        sc = tl.sum(tl.exp2(m - lse[None, :])[:, :, None] * own, 1)                   # [CB, NBK]
        prev_ok = (c >= 1) & (c <= nch)
        mp = tl.load(PML + ((part - 1) * 2)[:, None] * BG + offs_g[None, :], mask=prev_ok[:, None],
                     other=float("-inf"))
        sp = tl.load(PSP + (part - 1)[:, None] * BG + offs_g[None, :], mask=prev_ok[:, None], other=0.0)
        sc = sc + tl.where(k[None, :] == 0, tl.sum(tl.exp2(mp - lse[None, :]) * sp, 1)[:, None], 0.0)
        j = c[:, None] * NBK + k[None, :]
        tl.store(srow + j, sc, mask=(c[:, None] <= nch) & (j < SW))


@triton.jit
def _cmp_merge_role(PML, PACC, OC, bh, col, nch, nchs, NCH_HOST: tl.constexpr, DYN: tl.constexpr, BG: tl.constexpr,
                    BDV: tl.constexpr, CB: tl.constexpr, DVC: tl.constexpr):
    """Kernel C, program N_SEL + NWP + col: compressed output columns `col*DVC ..` from kernel A's chunk
    partials, normalised (fp32) -> OC[bh]."""
    offs_g = tl.arange(0, BG)
    offs_v = col * DVC + tl.arange(0, DVC)
    base = bh * nchs
    m_run, l_run = _chunk_stats(PML, base, nch, offs_g, NCH_HOST, DYN, BG, CB)
    cc = tl.arange(0, CB)
    acc = tl.zeros([BG, DVC], tl.float32)
    for c0 in range(0, nch if DYN else NCH_HOST, CB):
        c = c0 + cc
        part = (base + c).to(tl.int64)
        m = tl.load(PML + (part * 2)[:, None] * BG + offs_g[None, :], mask=(c < nch)[:, None], other=float("-inf"))
        a = tl.load(PACC + (part[:, None, None] * BG + offs_g[None, :, None]) * BDV + offs_v[None, None, :],
                    mask=(c < nch)[:, None, None], other=0.0).to(tl.float32)
        acc += tl.sum(_merge_weights(m, m_run[None, :])[:, :, None] * a, 0)
    o_cmp = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(OC + (bh * BG + offs_g)[:, None] * BDV + offs_v[None, :], o_cmp)


# Positions and the sizes derived from them change every step: not specialised (each value's
# divisibility would compile another variant, seconds each, as a step crosses it).
@triton.jit(do_not_specialize=["t", "tc", "nchs", "win", "len_sel"])
def _dec_blocks(Q, KS, VS, KW, VW, IDX, PML, PACC, WML, WACC, CML, CACC, OC, SYNC, TR, POS, t, tc, nchs, PT, spt,
                win, wcap, sqb, sqh, sksb, skst, sksh, svsb, svst, svsh, skwb,
                skwt, skwh, svwb, svwt, svwh, sib, sih, len_sel, qk_scale2, nbh,
                DEVPOS: tl.constexpr, E: tl.constexpr, STRIDE: tl.constexpr, CH: tl.constexpr, PAGE: tl.constexpr,
                WMODE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, N_SEL: tl.constexpr,
                SEL_BLOCK: tl.constexpr,
                WB: tl.constexpr, NWP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                BDV: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, FLAGS: tl.constexpr,
                TRACE: tl.constexpr, NCH_HOST: tl.constexpr, DYN: tl.constexpr, CB: tl.constexpr,
                DVC: tl.constexpr):
    """FLAGS: the selected programs wait for their own group's top-n (SYNC[2][bh]) and the merges
    for its chunks (SYNC[0][bh]) instead of kernel B's whole grid; the block programs count
    themselves done in SYNC[3][bh], the merges in SYNC[1][bh].
    Program p < N_SEL: selected block slot p of IDX[b, 0, h] over the raw cache (positions
    `<= t`): its partial (m, l) -> PML[part], acc -> PACC[part].
    N_SEL <= p < N_SEL + NWP: window block `p - N_SEL` (`_window_role`; it needs nothing of A or B
    and does not wait).
    p >= N_SEL + NWP: the compressed output's columns `(p - N_SEL - NWP) * DVC ..` from A's chunk
    partials CML / CACC -> OC (`_cmp_merge_role`)."""
    if PDL:
        gdc_launch_dependents()    # kernel D may start its programs (they wait for this grid)
    p = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    tg = _group_t(POS, b, t, DEVPOS)
    nvis, nch = _group_nch(tg, tc, E, STRIDE, CH)
    if TRACE:
        _stamp(TR, bh, 11 if p < N_SEL else 12, False)
    if p < N_SEL:
        _selected_role(Q, KS, VS, IDX, PML, PACC, SYNC + 2 * nbh + bh, b, h, bh * N_SEL + p, p, sqb, sqh, sksb, skst,
                       sksh, svsb, svst, svsh, sib, sih, tg, len_sel, PT, spt, qk_scale2, G, BG, SEL_BLOCK, DK, DV,
                       BDK, BDV,
                       IEEE, PDL, FLAGS, TR, bh, TRACE, PAGE)
    elif p < N_SEL + NWP:
        kw_start = tl.maximum(tg + 1 - win, 0)
        _window_role(Q, KW, VW, WML, WACC, b, h, bh * NWP + p - N_SEL, kw_start // WB + p - N_SEL, sqb, sqh, skwb,
                     skwt, skwh, svwb, svwt, svwh, tg, kw_start, PT, spt, wcap, qk_scale2, G, BG, WB, DK, DV, BDK, BDV,
                     IEEE, WMODE, PAGE)
    else:
        if FLAGS:
            _await(SYNC + bh, nch, FLAGS)     # this group's chunk partials
        elif PDL:
            gdc_wait()             # kernel A's partials, through B's wait (C may start before A ends)
        _cmp_merge_role(CML, CACC, OC, bh, p - N_SEL - NWP, nch, nchs, NCH_HOST, DYN, BG, BDV, CB, DVC)
    if TRACE:
        _stamp(TR, bh, 6 if p < N_SEL else 7 if p < N_SEL + NWP else 4, True)
    if FLAGS:
        _signal(SYNC + (3 if p < N_SEL + NWP else 1) * nbh + bh)


@triton.jit
def _selected_role(Q, KS, VS, IDX, PML, PACC, topn_done, b, h, part, slot, sqb, sqh, sksb, skst, sksh, svsb, svst, svsh, sib, sih,
                   t, len_sel, PT, spt, qk_scale2, G: tl.constexpr, BG: tl.constexpr, SEL_BLOCK: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr, FLAGS: tl.constexpr, TR, bh, TRACE: tl.constexpr, PAGE: tl.constexpr):
    """Selected block `slot` of IDX[b, 0, h] (-1: empty) over the raw cache, positions `<= t`
    (PAGE > 0: a page pool, `_page_rows`; a page holds whole selection blocks)."""
    q = _group_q(Q, b, h, sqb, sqh, G, BG, DK, BDK)
    if FLAGS:
        _await(topn_done, 1, FLAGS)       # this group's block indices
    elif PDL:
        gdc_wait()                 # kernel B's block indices (and, through B's wait, A's partials)
    if TRACE:
        _stamp(TR, bh, 5, True)
    blk = tl.load(IDX + b * sib + h * sih + slot)
    pos_s = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    ok = (blk >= 0) & (pos_s <= t) & (pos_s < len_sel)
    if PAGE > 0:
        kb, vb = KS + h * sksh, VS + h * svsh
    else:
        kb, vb = KS + b * sksb + h * sksh, VS + b * svsb + h * svsh
    m, p_s, acc = _attend_block(q, kb, vb, skst, svst, _page_rows(PT, b, pos_s, ok, spt, PAGE), ok, qk_scale2, DK,
                                DV, BDK, BDV, IEEE)
    _store_partial(PML, PACC, part, m, tl.sum(p_s, 1), acc, BG, BDV)


@triton.jit
def _partials(PML, PACC, first, offs_g, offs_v, N: tl.constexpr, NP: tl.constexpr, BG: tl.constexpr,
              BDV: tl.constexpr):
    """(m, l, acc columns `offs_v`) of partials `first .. first + N - 1`, one vector load each
    (NP = N rounded up to a power of two); `_merged` combines them."""
    s = tl.arange(0, NP)
    ok = s < N
    part = (first + s).to(tl.int64)
    m, den = _load_ml(PML, part, ok, offs_g, BG)
    a = tl.load(PACC + (part[:, None, None] * BG + offs_g[None, :, None]) * BDV + offs_v[None, None, :],
                mask=ok[:, None, None], other=0.0)
    return m, den, a


@triton.jit
def _merged(m, den, a):
    """The normalised output of partials (m, l, acc) from `_partials` (m in log2 units), in fp32."""
    _, l_tot, w = _merge_stats(m, den)
    return tl.sum(w[:, :, None] * a.to(tl.float32), 0) / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]


# Positions and the sizes derived from them change every step: not specialised (each value's
# divisibility would compile another variant, seconds each, as a step crosses it).
@triton.jit(do_not_specialize=["t", "tc"])
def _dec_out(OC, BML, BACC, WML, WACC, GT, Out, SYNC, TR, POS, t, tc, sgb, sgh, sgc, sob, soh, nbh,
             DEVPOS: tl.constexpr, E: tl.constexpr, STRIDE: tl.constexpr, CH: tl.constexpr, HKV: tl.constexpr,
             G: tl.constexpr, BG: tl.constexpr, NSPL: tl.constexpr, NWP: tl.constexpr,
             NPS: tl.constexpr, NPW: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, DVC: tl.constexpr,
             PDL: tl.constexpr, FLAGS: tl.constexpr, TRACE: tl.constexpr):
    """Per (sequence, KV group, DVC output columns): the compressed output (kernel C's merges), the
    selected and window outputs merged from kernel C's partials, then
    `g_cmp * o_cmp + g_sel * o_sel + g_win * o_win` in fp32 -> Out[b, 0, heads]. FLAGS: waits for
    its own group's C block programs (SYNC[3][bh]) and merges (SYNC[1][bh]), not the whole grids;
    then its program for the first columns sets SYNC[0][bh] and SYNC[2][bh] back to 0: every
    program that waits on them has passed (C's merges counted in SYNC[1], C's selected programs
    in SYNC[3]). SYNC[1] and SYNC[3] stay at their targets for the next step's kernel A."""
    bh, b, h = _program_bh(0, HKV)
    if TRACE:
        _stamp(TR, bh, 13, False)
    if FLAGS:
        _await(SYNC + 3 * nbh + bh, NSPL + NWP, FLAGS)
        _await(SYNC + nbh + bh, BDV // DVC, FLAGS)
    elif PDL:
        gdc_wait()                 # kernel C's partials; B's through C's wait
    if TRACE:
        _stamp(TR, bh, 8, True)
    offs_g = tl.arange(0, BG)
    offs_v = tl.program_id(1) * DVC + tl.arange(0, DVC)
    # Every load first: each waits for an L2 round trip, and a use between them would put those
    # waits one after another on the last group's chain (results/h100/decode-tail/).
    g_ok = offs_g < G
    heads = h * G + offs_g
    o_cmp = tl.load(OC + (bh * BG + offs_g)[:, None] * BDV + offs_v[None, :])
    m_s, l_s, a_s = _partials(BML, BACC, bh * NSPL, offs_g, offs_v, NSPL, NPS, BG, BDV)
    m_w, l_w, a_w = _partials(WML, WACC, bh * NWP, offs_g, offs_v, NWP, NPW, BG, BDV)
    gate = GT + b * sgb + heads * sgh
    g_cmp = tl.load(gate, mask=g_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gate + sgc, mask=g_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2 * sgc, mask=g_ok, other=0.0).to(tl.float32)
    o = (g_cmp[:, None] * o_cmp + g_sel[:, None] * _merged(m_s, l_s, a_s)
         + g_win[:, None] * _merged(m_w, l_w, a_w))
    tl.store(Out + b * sob + heads[:, None] * soh + offs_v[None, :], o.to(Out.dtype.element_ty),
             mask=g_ok[:, None] & (offs_v[None, :] < DV))
    if TRACE:
        _stamp(TR, bh, 9, True)
    if FLAGS and tl.program_id(1) == 0:
        if FLAGS == 2:             # the interpreter: only counts at their targets (tests read them after a step)
            nvis, nch = _group_nch(_group_t(POS, b, t, DEVPOS), tc, E, STRIDE, CH)
            if (tl.load(SYNC + bh) == nch) & (tl.load(SYNC + 2 * nbh + bh) == 1):
                tl.store(SYNC + bh, 0)
                tl.store(SYNC + 2 * nbh + bh, 0)
        else:
            tl.store(SYNC + bh, 0)
            tl.store(SYNC + 2 * nbh + bh, 0)


def pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch can run here: the kernels' GPU profile has the `pdl` feature
    (sm90 or later, Triton with its intrinsics; never the interpreter's `cpu` profile)."""
    from nsa.profiles import kernel_profile
    return kernel_profile(device).features.pdl


def _geometry(block: int, stride: int, sel_block: int, chunk: int) -> tuple[int, int] | str:
    """(R, E) = (l' / d, l / d) for kernel A's block map, or why it does not apply."""
    if block % stride or sel_block % stride:
        return f"the stride d={stride} must divide l={block} and l'={sel_block}"
    r, e = sel_block // stride, block // stride
    if e > r or not pow2(r):
        return f"l/d = {e} must be <= l'/d = {r}, a power of two"
    if chunk % r or chunk // r < 16:
        return f"Tiles.dec_chunk = {chunk} must hold >= 16 whole selection blocks of {r} compressed tokens"
    return r, e


def supported(*, dk: int, dv: int, block: int, stride: int, sel_block: int, t: int, tiles: Tiles) -> str | None:
    """None when `decode_step` covers this step, else why the separate-op path runs it."""
    if not tiles.dec_fused:
        return "Tiles.dec_fused is off"
    if max(dk, dv) > 256:
        return f"head dims <= 256, got {dk}/{dv}"
    if not (pow2(sel_block) and sel_block >= 16):
        return f"sel_block must be a power of two >= 16, got {sel_block}"
    geometry = _geometry(block, stride, sel_block, tiles.dec_chunk)
    if isinstance(geometry, str):
        return geometry
    if np2(t // sel_block + 1) > tiles.dec_max_blocks:
        return f"{t // sel_block + 1} selection blocks > Tiles.dec_max_blocks = {tiles.dec_max_blocks}"
    return None


def decode_step(q: Tensor, gates: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor,
                k_win: Tensor, v_win: Tensor, *, t: int, block: int, stride: int, sel_block: int, sel_count: int,
                window: int, scale: float, tiles: Tiles, counts: Tensor | None = None, pos: Tensor | None = None,
                page_table: Tensor | None = None, page_size: int = 0, win_layout: str = "tail",
                idx: Tensor | None = None, _trace: Tensor | None = None, _plan: bool = False,
                scratch: dict | None = None) -> tuple[Tensor, Tensor] | DecodeLaunch:
    """The gated NSA output `[B, 1, Hq, dv]` of the query at position `t` and its selected blocks
    `[B, 1, Hkv, sel_count]` (int32, ascending, -1 padded). Caches: compressed `k_cmp/v_cmp [B, Tc,
    Hkv, *]` (tokens `0 ..`), raw `k_sel/v_sel [B, >= t+1, Hkv, *]` (positions `0 ..`), window
    `k_win/v_win [B, nw, Hkv, *]` (positions `t+1-nw .. t`, `nw <= window`). Scratch: partials
    of about `B*Hkv*16*(dv + l'/d ...)` elements per chunk and block (acc in q's dtype, the rest
    fp32); no host sync (capturable in a CUDA graph). `counts`: a `_counts` buffer (`[4, >= B*Hkv]`
    int32, zeroed once) that every step uses and resets itself; None: a fresh one (a zeroing kernel).

    Positions on the device (`pos`, int32 `[B]`): sequence b's query is at `pos[b]`, each `<= t`,
    which then only bounds the step (its scratch and grid; a larger pos is clamped to it), so one
    launch shape serves a ragged batch and any later position (a CUDA graph replays it). The
    window then is `win_layout="ring"`: `k_win/v_win [B, W, Hkv, *]`, position p at row `p % W`
    (`W >= window`), or `"pages"`: read from the raw cache's pages (`k_win is k_sel`, a layer
    with shared K/V). `page_table` (int32 `[B, pages]`, with `page_size`, a multiple of
    `sel_block`): `k_sel/v_sel` are a pool `[n_pages, page_size, Hkv, *]` and sequence b's
    position p sits in page `page_table[b, p // page_size]`. `idx`: the selected blocks given
    (`[B, 1, Hkv, sel_count]` int32, -1 padded, e.g. from an external indexer): no top-n runs.
    `_trace` (diagnostics, CUDA only): an int64 `[>= B*Hkv, TRACE_SLOTS]` buffer the kernels stamp
    with the global timer (TRACE_NAMES; the caller initialises it, lab/decode_trace.py).
    `_plan`: return the step's `DecodeLaunch` instead of running it; `scratch`: a dict the caller
    keeps, whose buffers the step reuses (allocated on first use)."""
    b, _, hq, dk = q.shape
    hkv, dv = k_sel.shape[2], v_sel.shape[-1]
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = unit_last_stride(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)
    group = hq // hkv
    dvc = tiles.dout_cols
    bg, bdk, bdv, bh = np2(group), np2(dk), np2(dv, dvc), b * hkv
    dev = q.device
    exact = q.dtype == torch.float32
    ch = tiles.dec_chunk
    pdl = tiles.dec_pdl and pdl_ok(dev)
    launch_pdl = {"launch_pdl": True} if pdl else {}   # B, C, D; A waits for the step's earlier kernels
    r, e = _geometry(block, stride, sel_block, ch)
    nbk = ch // r
    # Compressed tokens visible at the bound t (each group's own count is taken on the device).
    tc = min(k_cmp.shape[1], max(0, (t + 1 - block) // stride + 1))
    nchs = triton.cdiv(tc, ch)
    devpos = pos is not None
    paged = page_table is not None
    wmode = {"tail": 0, "ring": 1, "pages": 2}.get(win_layout)
    if wmode is None or (wmode == 0) == devpos or (wmode == 2 and not paged):
        raise ValueError(f"win_layout must be 'tail' (host position t), 'ring' or 'pages' (positions on the device; "
                         f"'pages' with a page_table), got {win_layout!r} with pos {'given' if devpos else 'None'}")
    if devpos and (pos.dtype != torch.int32 or pos.shape != (b,) or pos.device != torch.device(dev)
                   or not pos.is_contiguous()):
        raise ValueError(f"pos must be a contiguous int32 [{b}] tensor on {dev}, got {pos.dtype} {list(pos.shape)}")
    if paged:
        if page_size < sel_block or page_size % sel_block:
            raise ValueError(f"page_size must be a multiple of sel_block={sel_block}, got {page_size}")
        if (page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != b
                or page_table.stride(1) != 1 or page_table.device != torch.device(dev)):
            raise ValueError(f"page_table must be int32 [{b}, pages] (unit last stride) on {dev}, got "
                             f"{page_table.dtype} {list(page_table.shape)}")
        for name, x in (("k_sel", k_sel), ("v_sel", v_sel)):
            if x.shape[1] != page_size or x.stride(0) != page_size * x.stride(1):
                raise ValueError(f"{name} must be a page pool [n_pages, {page_size}, Hkv, D] with pages one after "
                                 f"another, got shape {list(x.shape)} strides {x.stride()}")
        pt, spt = page_table, page_table.stride(0)
    else:
        pt, spt = q, 0                                   # unused
    # Tiles.dec_flags: per-group done-counts (A's chunks, C's merges, B's top-n, C's blocks), so
    # each kernel waits for its own group, not for the grid before it (only with
    # dependent launch, which starts a kernel once every program of the one before has started).
    flags = (1 if pdl else 2 if interpreting() else 0) if tiles.dec_flags else 0
    if not flags:
        sync = torch.empty(1, dtype=torch.int32, device=dev)   # unused
    elif counts is None:
        sync = _counts(bh, dev)
    elif (counts.dtype != torch.int32 or counts.device != torch.device(dev) or counts.dim() != 2
          or counts.shape[0] != 4 or counts.shape[1] < bh or not counts.is_contiguous()):
        raise ValueError(f"counts must be a contiguous int32 [4, >= {bh}] buffer on {dev} (decode.py _counts), got "
                         f"{counts.dtype} {list(counts.shape)} on {counts.device}")
    else:
        sync = counts
    nbh = sync.shape[-1]
    # Every buffer before the first launch: a step that fails part way leaves no count behind.
    pdt = torch.float32 if tiles.dec_part_fp32 else q.dtype   # partial outputs; (m, l) and scores fp32
    def _buf(name: str, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        if scratch is None:
            return _scratch(n, dev, dtype)
        have = scratch.get(name)
        if have is None or have.numel() < max(n, 1) or have.dtype != dtype or have.device != torch.device(dev):
            have = scratch[name] = _scratch(n, dev, dtype)
        return have

    pml, pacc = _buf("pml", bh * nchs * 2 * bg), _buf("pacc", bh * nchs * bg * bdv, pdt)
    psc, psp = _buf("psc", bh * nchs * bg * nbk), _buf("psp", bh * nchs * bg)
    sw = np2(t // sel_block + 1)
    s = _buf("s", bh * (sw + tiles.dtop_cap))
    ext = {"EXT": idx is not None}
    if idx is None:
        idx = torch.empty(b, 1, hkv, sel_count, dtype=torch.int32, device=dev)
    elif (idx.dtype != torch.int32 or tuple(idx.shape) != (b, 1, hkv, sel_count) or idx.stride(-1) != 1
          or idx.device != torch.device(dev)):
        raise ValueError(f"idx must be int32 [{b}, 1, {hkv}, {sel_count}] on {dev} (unit last stride), got "
                         f"{idx.dtype} {list(idx.shape)}")
    ncol = bdv // dvc
    oc = _buf("oc", bh * bg * bdv)
    nwp = triton.cdiv(window, WIN_BLOCK) + 1        # blocks the window can touch (a fixed count: no recompiles)
    bml, bacc = _buf("bml", bh * sel_count * 2 * bg), _buf("bacc", bh * sel_count * bg * bdv, pdt)
    wml, wacc = _buf("wml", bh * nwp * 2 * bg), _buf("wacc", bh * nwp * bg * bdv, pdt)
    out = common.empty_out(b, 1, hq, dv, dtype=q.dtype, device=dev)
    if _trace is not None and (_trace.dtype != torch.int64 or _trace.dim() != 2 or _trace.shape[0] < bh
                               or _trace.shape[1] != TRACE_SLOTS.value or not _trace.is_contiguous()
                               or _trace.device != torch.device(dev) or interpreting()):
        raise ValueError(f"_trace must be a contiguous int64 [>= {bh}, {TRACE_SLOTS.value}] buffer on the step's GPU "
                         "(Triton's interpreter has no global timer)")
    trace = {"TRACE": _trace is not None}
    tr = _trace if _trace is not None else sync
    host = interpreting()
    loop = dict(NCH_HOST=nchs if host else 0, DYN=not host)
    posa = pos if devpos else sync                   # unused without DEVPOS
    geo = dict(DEVPOS=devpos, E=e, STRIDE=stride, CH=ch)
    win = window if devpos else k_win.shape[1]       # host t: the window cache holds positions t+1-nw .. t
    wcap = k_win.shape[1] if wmode == 1 else 1
    if wmode == 1 and wcap < window:
        raise ValueError(f"a ring window cache needs >= window={window} rows, got {wcap}")
    ps = page_size if paged else 0
    ksb, vsb = (0, 0) if paged else (k_sel.stride(0), v_sel.stride(0))
    len_sel = 2 ** 31 - 1 if paged else k_sel.shape[1]
    launches = []
    if nchs or flags:              # with flags, program 0 of each group also resets two counts
        launches.append((_dec_cmp, (max(nchs, 1), bh), (
            q, k_cmp, v_cmp, pml, pacc, psc, psp, sync, tr, posa, t, tc, nchs, q.stride(0), q.stride(2),
            k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), nbh,
            scale * LOG2E), dict(DEVPOS=devpos, HKV=hkv, G=group, BG=bg, CH=ch, R=r, E=e, STRIDE=stride, DK=dk, DV=dv,
                                 BDK=bdk,
                         BDV=bdv, IEEE=exact, PDL=pdl, FLAGS=flags, **trace, **tiles.launch("dec"))))
    launches.append((_dec_topn, (1, bh), (pml, psc, psp, s, idx, sync, tr, posa, t, tc, nchs, idx.stride(0),
                                          idx.stride(2), nbh), dict(
        **loop, **geo, **ext, SEL_BLOCK=sel_block, HKV=hkv, BG=bg, NBK=nbk, SW=sw, N=sel_count, BN=np2(sel_count),
        CB=tiles.dec_cb, **sort_params(sw, sel_count, tiles.dtop_algo, tiles.dtop_cap, tiles.topn_nchunk,
                                       tiles.dtop_sort64),
        ONCE=tiles.dtop_once, PDL=pdl, FLAGS=flags, **trace, **launch_pdl, num_warps=tiles.dtop_warps)))
    launches.append((_dec_blocks, (sel_count + nwp + ncol, bh), (
        q, k_sel, v_sel, k_win, v_win, idx, bml, bacc, wml, wacc, pml, pacc, oc, sync, tr, posa, t, tc, nchs,
        pt, spt, win, wcap, q.stride(0), q.stride(2), ksb, k_sel.stride(1), k_sel.stride(2), vsb, v_sel.stride(1),
        v_sel.stride(2), k_win.stride(0), k_win.stride(1), k_win.stride(2), v_win.stride(0), v_win.stride(1),
        v_win.stride(2), idx.stride(0), idx.stride(2), len_sel, scale * LOG2E, nbh), dict(
        **geo, PAGE=ps, WMODE=wmode, HKV=hkv, G=group, BG=bg, N_SEL=sel_count, SEL_BLOCK=sel_block, WB=WIN_BLOCK,
        NWP=nwp, DK=dk, DV=dv, BDK=bdk, BDV=bdv, IEEE=exact, PDL=pdl, FLAGS=flags, **trace, **loop,
        CB=tiles.dec_cb, DVC=dvc, **launch_pdl, **tiles.launch("dblk"))))
    launches.append((_dec_out, (bh, ncol), (
        oc, bml, bacc, wml, wacc, gates, out, sync, tr, posa, t, tc, gates.stride(0), gates.stride(2),
        gates.stride(3), out.stride(0), out.stride(2), nbh), dict(
        **geo, HKV=hkv, G=group, BG=bg, NSPL=sel_count, NWP=nwp, NPS=np2(sel_count, 1), NPW=np2(nwp, 1), DV=dv,
        BDV=bdv, DVC=dvc, PDL=pdl, FLAGS=flags, **trace, **launch_pdl, num_warps=tiles.dout_warps)))
    step = DecodeLaunch(launches, out, idx, sync if flags and counts is not None else None)
    if _plan:
        return step
    step()
    return out, idx


class DecodeLaunch:
    """The four launches of one decode step with every argument bound (`decode_step(_plan=True)`):
    calling it runs them again on the same buffers, so a caller whose inputs live in fixed buffers
    (nsa.serving: positions on the device) pays the step's host work once, then only the
    launches. `out` and `idx` are rewritten by every call."""

    def __init__(self, launches: list, out: Tensor, idx: Tensor, counts: Tensor | None) -> None:
        self.launches = [common.BoundLaunch(*launch) for launch in launches]
        self.out, self.idx, self.counts = out, idx, counts

    def __call__(self) -> None:
        try:
            for launch in self.launches:
                launch()
        except BaseException:
            if self.counts is not None:
                self.counts.zero_()   # kernels launched before the failure counted; the next step starts at 0
            raise
