"""Selected attention, block-centric, for small GQA groups (prefill).

The group-centric kernel (selection.py) loads `n` blocks of keys/values for every (query, KV
group): at G = 1 to 8 each load serves 1 to 8 query heads, so the branch is bound by those
gathers (at G = 1, 64k tokens, 16 KV heads: ~550 GB from L2). Here the selection is inverted:
for each (batch, KV head, key block) the list of (query, slot) entries that selected it; one
program takes a chunk of one list (up to `Tiles.selb_steps` steps of entries, the next step's
query rows gathered while one is attended), loads that key block once, and attends the chunk's
queries x heads to it (rows = entries x heads, causal mask per row), writing each row's
partial (its output over the block, normalised, and its log-sum-exp, log2 units like every
softmax statistic of the kernels: common.py) to buffers indexed by the entry. A combine kernel then merges the `n` partials of each (query, group), in slot order, and
applies the gated sum.

Forced blocks (`Tiles.selb_forced_min_group`): each query's blocks 0, current and previous, which every
query of a `sel_block` run shares, can stay out of the lists; `_selb_forced_fwd` attends them
with query tiles (each block's keys/values loaded once per tile) and writes one partial per
(query, head), which the combine merges in place of their three. Attending them inside the
combine instead (7105cf3) saved the lists kernel 3 of 16 entries per (query, group) but made the
combine far slower (32/8 heads at 64k: lists 8.38 -> 6.90 ms, combine 3.48 -> 11.84 ms;
results/h100/selb-forced/).

Inversion: a stable sort of the entries by (batch, KV head, block), the lists' starts, a chunk
table, and each program's list by one `searchsorted` over the chunk table, so the launch needs
no host synchronisation (the grid is an upper bound; spare programs return).

Memory: the partials are `B * T * Hkv * n * G` rows of `dv` outputs in the input dtype
(`Tiles.selb_part_fp32`: fp32) and one fp32 log-sum-exp each (n times the output; with the
forced-block kernel n + 1), so past `Tiles.selb_part_cap` bytes the queries run in chunks. Their
traffic is why this path is for small groups: on the H100 it wins up to G = 8 and loses at
G = 16 (`Tiles.selb_max_group`; results/h100/selb-forced/). The outputs in a
contiguous `[rows, dv]` buffer apart from the log-sum-exps keep the stores and the combine's
loads aligned (one `(m, l, o)` row of `dv + 2` floats left every `o` 8 bytes off a 16-byte
vector). Precision: a bf16/fp16 partial is its normalised output rounded once to the input
dtype (relative 2**-9 for bf16) before the fp32 merge, so the branch output carries at most
one rounding more than the group-centric kernel's; fp32 inputs keep fp32 partials (docs/nsa.md,
"Selected attention").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa.backends.triton_kernels import common
from nsa.backends.triton_kernels.common import (
    _dot,
    _merge_weights,
    _program_bh,
    _pv,
    _safe_max,
    _softmax_step,
    _softmax_tile,
    np2,
)
from nsa.backends.triton_kernels.selection import _gated
from nsa.backends.triton_kernels.tiles import Tiles, interpreting
from nsa.selection import is_forced


@triton.jit
def _selb_fwd(Q, K, V, ORDER, LSTART, LCOUNT, CSTART, PLIST, OP, LSEP,
              sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
              Tq, T_k, q_start, k_start, qk_scale2, NL, NBK,
              HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, N_SEL: tl.constexpr, SEL_BLOCK: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BQ: tl.constexpr, STEPS: tl.constexpr, BDK: tl.constexpr,
              BDV: tl.constexpr, IEEE: tl.constexpr, DYN: tl.constexpr):
    """One chunk of up to STEPS * BQ entries of one (batch, KV head, block) list, BQ entries a
    step, the block's keys/values loaded once -> each row's partial: its output over the block,
    normalised, at `OP[row]` (the partials' dtype) and its log-sum-exp (log2 units: logits times
    `qk_scale2` = scale * log2 e; -inf where the row sees no key of the block) at `LSEP[row]`,
    row = entry * G + head. DYN: the steps stop at
    the list's end (the interpreter runs all STEPS, masked)."""
    p = tl.program_id(0)
    lo = tl.load(PLIST + p)        # the list whose chunks hold program p (NL: a spare program)
    if lo >= NL:
        return
    chunk = p - tl.load(CSTART + lo)
    left = tl.load(LCOUNT + lo) - chunk * (BQ * STEPS)     # entries of this list from the chunk's first
    first = tl.load(LSTART + lo) + chunk * (BQ * STEPS)
    bh = lo // NBK
    blk = lo % NBK
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    M: tl.constexpr = BQ * GP
    rows = tl.arange(0, M)
    slot_in_step = rows // GP
    g = rows % GP
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    heads = h * G + g
    pos = blk * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    kvalid = (pos >= k_start) & (pos < k_start + T_k)
    kpos = pos - k_start
    k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                mask=kvalid[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                mask=kvalid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    kt = tl.trans(k)
    for i in range(0, tl.minimum(STEPS, tl.cdiv(left, BQ)) if DYN else STEPS):
        slot = i * BQ + slot_in_step
        ok = (slot < left) & (g < G)
        e = tl.load(ORDER + first + slot, mask=ok, other=0).to(tl.int64)   # flat entry (b, t, h, s)
        t = (e // (HKV * N_SEL)) % Tq
        q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                    mask=ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        s = _dot(q, kt, IEEE)
        vis = kvalid[None, :] & (pos[None, :] <= (q_start + t)[:, None])
        s = tl.where(vis, s * qk_scale2, float("-inf"))
        m, pr = _softmax_tile(s)
        l_sum = tl.sum(pr, 1)
        acc = _pv(pr, v, IEEE)
        empty = l_sum == 0.0
        o = acc / tl.where(empty, 1.0, l_sum)[:, None]
        row = e * G + g
        tl.store(LSEP + row, tl.where(empty, float("-inf"), _safe_max(m) + tl.log2(tl.where(empty, 1.0, l_sum))),
                 mask=ok)
        tl.store(OP + row[:, None] * DV + offs_dv[None, :], o.to(OP.dtype.element_ty),
                 mask=ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _is_forced(j, cur):
    """Block(s) `j` among the forced blocks of a query whose current block is `cur` (0, cur, cur - 1)."""
    return (j >= 0) & ((j == 0) | (j == cur) | (j == cur - 1))


@triton.jit
def _listed(j, cur, FORCED: tl.constexpr):
    """A slot holding block `j` has a partial from the lists kernel: it holds a block (j >= 0)
    and, with FORCED, not one of the query's forced blocks (those are `_selb_forced_fwd`'s)."""
    used = j >= 0
    if FORCED:
        used = used & ~_is_forced(j, cur)
    return used


@triton.jit
def _selb_combine(OP, LSEP, FOP, FLSE, IDX, Out, OC, OW, GT, sib, sit, sih, sob, sot, soh,
                  scb, sct, sch, swb, swt, swh, sgb, sgt, sgh, sgc, Tq, q_start,
                  HKV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, SEL_BLOCK: tl.constexpr, DV: tl.constexpr,
                  BG: tl.constexpr, BDV: tl.constexpr, GATED: tl.constexpr, FORCED: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s, w_s = exp2(lse_s - max lse) (log2 units), over the slots of one
    (query, group) that hold a block (idx >= 0); with FORCED the slots holding the query's forced
    blocks are skipped and the one partial of `_selb_forced_fwd` (FOP, FLSE) takes their place;
    then the gated sum with GATED."""
    t = tl.program_id(0)
    bh, b, h = _program_bh(1, HKV)
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    gmask = offs_g < G
    cur = (q_start + t) // SEL_BLOCK
    base = ((b * Tq + t) * HKV + h) * N_SEL
    frow = ((b * Tq + t) * HKV + h) * G + offs_g
    lse_f = tl.full([BG], float("-inf"), tl.float32)      # the forced blocks' partial (FORCED)
    if FORCED:
        lse_f = tl.load(FLSE + frow, mask=gmask, other=float("-inf"))
    m = lse_f
    for s in tl.static_range(N_SEL):   # pass 1: the largest log-sum-exp of each head
        used = _listed(tl.load(IDX + b * sib + t * sit + h * sih + s), cur, FORCED)
        m = tl.maximum(m, tl.load(LSEP + (base + s) * G + offs_g, mask=gmask & used, other=float("-inf")))
    l_tot = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    dmask = offs_dv[None, :] < DV
    if FORCED:
        w = _merge_weights(lse_f, m)
        o_f = tl.load(FOP + frow[:, None] * DV + offs_dv[None, :], mask=gmask[:, None] & dmask, other=0.0)
        l_tot += w
        acc += w[:, None] * o_f.to(tl.float32)
    for s in tl.static_range(N_SEL):   # pass 2: the weighted outputs (a slot without a block weighs 0)
        used = _listed(tl.load(IDX + b * sib + t * sit + h * sih + s), cur, FORCED)
        row = (base + s) * G + offs_g
        rmask = gmask & used
        w = _merge_weights(tl.load(LSEP + row, mask=rmask, other=float("-inf")), m)
        o_s = tl.load(OP + row[:, None] * DV + offs_dv[None, :], mask=rmask[:, None] & dmask, other=0.0)
        l_tot += w
        acc += w[:, None] * o_s.to(tl.float32)
    o = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    heads = h * G + offs_g
    omask = gmask[:, None] & dmask
    if GATED:
        o = _gated(o, OC, OW, GT, b, t, heads, offs_g, offs_dv, omask, scb, sct, sch, swb, swt, swh,
                   sgb, sgt, sgh, sgc, G)
    tl.store(Out + b * sob + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=omask)


@triton.jit
def _forced_step(q, K, V, given, j, cur, t_abs, valid, m_i, l_i, acc, b, h, skb, skt, skh, svb, svt, svh,
                 T_k, k_start, qk_scale2, SEL_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BDK: tl.constexpr,
                 BDV: tl.constexpr, IEEE: tl.constexpr):
    """Block `j` into the rows' online softmax (log2 units) for the rows that have it among their
    forced blocks and in their block list (`given [rows, slots]`, -1 padded), keys `<= t_abs`."""
    member = valid & _is_forced(j, cur) & (tl.sum((given == j).to(tl.int32), 1) > 0)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    pos = j * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
    kvalid = (pos >= k_start) & (pos < k_start + T_k)
    kpos = pos - k_start
    k = tl.load(K + b * skb + kpos[:, None] * skt + h * skh + offs_dk[None, :],
                mask=kvalid[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + kpos[:, None] * svt + h * svh + offs_dv[None, :],
                mask=kvalid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    s = _dot(q, tl.trans(k), IEEE) * qk_scale2
    vis = member[:, None] & kvalid[None, :] & (pos[None, :] <= t_abs[:, None])
    return _softmax_step(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc, IEEE)


@triton.jit
def _selb_forced_fwd(Q, K, V, IDX, FOP, FLSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih,
                     Tq, T_k, q_start, k_start, qk_scale2,
                     HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, N_SEL: tl.constexpr, BN: tl.constexpr,
                     SEL_BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BQ: tl.constexpr, BDK: tl.constexpr,
                     BDV: tl.constexpr, IEEE: tl.constexpr):
    """The forced blocks' partial (`Tiles.selb_forced_min_group`): one program per (BQ <= SEL_BLOCK queries, batch,
    KV group) attends each row's forced blocks that its list holds (0, the current and the previous
    block: at most 4 blocks for the whole tile, since BQ queries span at most two current blocks),
    each block's keys/values loaded once for the tile, with an online softmax, and writes one
    partial per (query, head) row, as `_selb_fwd` does per entry: the output normalised at
    `FOP[row]`, the log-sum-exp (log2 units, -inf where the row has none of them) at `FLSE[row]`,
    row = ((b * Tq + t) * HKV + h) * G + head. Rows here: query-major, G heads each (padded to GP)."""
    t0 = tl.program_id(0) * BQ
    bh, b, h = _program_bh(1, HKV)
    rows = tl.arange(0, BQ * GP)
    t = (t0 + rows // GP).to(tl.int64)
    g = rows % GP
    valid = (t < Tq) & (g < G)
    heads = h * G + g
    t_abs = q_start + t
    cur = t_abs // SEL_BLOCK
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_dk[None, :],
                mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
    offs_s = tl.arange(0, BN)
    given = tl.load(IDX + b * sib + t[:, None] * sit + h * sih + offs_s[None, :],
                    mask=valid[:, None] & (offs_s[None, :] < N_SEL), other=-1)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * GP], tl.float32)
    acc = tl.zeros([BQ * GP, BDV], tl.float32)
    # The tile's forced blocks, each once: 0, then c_lo - 1 .. c_hi (c_hi <= c_lo + 1), from 1.
    c_lo = (q_start + t0) // SEL_BLOCK
    c_hi = (q_start + tl.minimum(t0 + BQ, Tq) - 1) // SEL_BLOCK
    m_i, l_i, acc = _forced_step(q, K, V, given, 0, cur, t_abs, valid, m_i, l_i, acc, b, h, skb, skt, skh,
                                 svb, svt, svh, T_k, k_start, qk_scale2, SEL_BLOCK, DK, DV, BDK, BDV, IEEE)
    for i in tl.static_range(3):
        j = c_lo - 1 + i
        if (j >= 1) & (j <= c_hi):
            m_i, l_i, acc = _forced_step(q, K, V, given, j, cur, t_abs, valid, m_i, l_i, acc, b, h, skb, skt,
                                         skh, svb, svt, svh, T_k, k_start, qk_scale2, SEL_BLOCK, DK, DV, BDK, BDV,
                                         IEEE)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    row = ((b * Tq + t) * HKV + h) * G + g
    tl.store(FLSE + row, lse, mask=valid)
    tl.store(FOP + row[:, None] * DV + offs_dv[None, :], (acc / l_safe[:, None]).to(FOP.dtype.element_ty),
             mask=valid[:, None] & (offs_dv[None, :] < DV))


def listed_slots(idx: Tensor, q_start: int, sel_block: int, forced: bool) -> Tensor:
    """The slots of `idx [B, Tq, Hkv, n]` that go to the block lists: those holding a block,
    less (`forced`) each query's forced blocks (`nsa.selection.is_forced`, the rule `_is_forced`
    applies in the kernels), which `_selb_forced_fwd`'s query tiles attend."""
    listed = idx >= 0
    if forced:
        pos = q_start + torch.arange(idx.shape[1], device=idx.device, dtype=idx.dtype)
        cur = pos.div(sel_block, rounding_mode="floor")[None, :, None, None]
        listed &= ~is_forced(idx, cur)
    return listed


def part_bytes_per_query(b: int, hq: int, n_sel: int, dv: int, part_fp32: bool, itemsize: int) -> int:
    """Bytes of partials (outputs and log-sum-exps) one query position adds: B * Hq * n rows."""
    return b * hq * n_sel * (dv * (4 if part_fp32 else itemsize) + 4)


def selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float, q_start: int,
             k_start: int, tiles: Tiles, gated: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Same contract as `selection.selected` (prefill, small groups): `q [B, Tq, Hq, dk]` over
    the blocks `idx [B, Tq, Hkv, n]` (-1 padded) of `k/v [B, Tk, Hkv, d*]`. The partials take
    n times the output's size; past `Tiles.selb_part_cap` bytes the queries run in chunks that
    stay under it (each its own lists and combine)."""
    b, tq, hq, _ = q.shape
    dv, n_sel = v.shape[-1], idx.shape[-1]
    o = common.empty_out(b, tq, hq, dv, dtype=q.dtype, device=q.device)
    # (n + 1: the forced-block kernel's partial too, an upper bound)
    per_q = part_bytes_per_query(b, hq, n_sel + 1, dv, tiles.selb_part_fp32, q.element_size())
    cap = tiles.selb_part_cap
    step = max(1, tq if cap == 0 or tq * per_q <= cap else cap // per_q)   # (tq = 0: no chunk)
    for t0 in range(0, tq, step):
        t1 = min(tq, t0 + step)
        part = None if gated is None else tuple(x[:, t0:t1] for x in gated)
        _selected_into(o[:, t0:t1], q[:, t0:t1], k, v, idx[:, t0:t1], sel_block=sel_block, scale=scale,
                       q_start=q_start + t0, k_start=k_start, tiles=tiles, gated=part)
    return o


def list_id_dtype(n_lists: int) -> torch.dtype:
    """The narrowest sort key for list ids `0 .. n_lists` (n_lists: the invalid slots' id):
    torch.sort's radix sort runs over every bit of the key, so int16 takes half the passes."""
    return torch.int16 if n_lists <= torch.iinfo(torch.int16).max else torch.int32


def _selected_into(o: Tensor, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float,
                   q_start: int, k_start: int, tiles: Tiles, gated: tuple[Tensor, Tensor, Tensor] | None) -> None:
    """`selected` for one chunk of queries, written into `o [B, Tq, Hq, dv]` (a view)."""
    b, tq, hq, dk = q.shape
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    n_sel = idx.shape[-1]
    idx = idx.to(torch.int32).contiguous()
    gates, o_cmp, o_win = gated if gated is not None else (o, o, o)
    nbk = max(1, triton.cdiv(k_start + tk, sel_block))
    n_lists = b * hkv * nbk
    # Entries (b, t, h, s) in flat order; key = list id (b, h, block), invalid slots last.
    bh = (torch.arange(b, device=q.device, dtype=torch.int32)[:, None, None, None] * hkv
          + torch.arange(hkv, device=q.device, dtype=torch.int32)[None, None, :, None])
    forced = 0 < tiles.selb_forced_min_group <= group
    key = torch.where(listed_slots(idx, q_start, sel_block, forced), bh * nbk + idx, n_lists).flatten()
    if tiles.selb_sort16:
        key = key.to(list_id_dtype(n_lists))   # int16 where the ids fit: half the radix passes of int32
    sorted_key, order = torch.sort(key, stable=True)
    # List l's entries are sorted[lstart[l] : lstart[l + 1]] (a search of the sorted keys, no histogram).
    lstart = torch.searchsorted(sorted_key, torch.arange(n_lists + 1, device=q.device, dtype=key.dtype))
    counts = lstart[1:] - lstart[:-1]
    bq = max(1, tiles.selb_rows // triton.next_power_of_2(group))
    per = bq * tiles.selb_steps       # entries per program: selb_steps steps of bq, one K/V load
    cstart = torch.zeros(n_lists + 1, dtype=torch.int64, device=q.device)
    cstart[1:] = torch.cumsum((counts + per - 1) // per, 0)
    rows = b * tq * hkv * n_sel * group
    part_o = torch.empty(rows, dv, dtype=torch.float32 if tiles.selb_part_fp32 else q.dtype, device=q.device)
    part_lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    grid = triton.cdiv(b * tq * hkv * n_sel, per) + n_lists     # >= the number of chunks
    # Each program's list (CSTART[l] <= p < CSTART[l + 1]; n_lists past the last chunk), found
    # for all programs at once rather than by a chain of dependent loads in each.
    plist = torch.searchsorted(cstart, torch.arange(grid, device=q.device, dtype=torch.int64), right=True) - 1
    _selb_fwd[(grid,)](
        q, k, v, order, lstart, counts, cstart, plist, part_o, part_lse,   # int64 entries: B*T*Hkv*n can pass 2**31
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), tq, tk, q_start, k_start, scale * common.LOG2E, n_lists, nbk,
        HKV=hkv, G=group, GP=triton.next_power_of_2(group), N_SEL=n_sel, SEL_BLOCK=sel_block, DK=dk, DV=dv, BQ=bq,
        STEPS=tiles.selb_steps, BDK=np2(dk), BDV=np2(dv), IEEE=q.dtype == torch.float32, DYN=not interpreting(),
        **tiles.launch("selb"))
    if forced:
        f_o = torch.empty(b * tq * hkv * group, dv, dtype=part_o.dtype, device=q.device)
        f_lse = torch.empty(b * tq * hkv * group, dtype=torch.float32, device=q.device)
        bq_f = max(1, min(sel_block, tiles.selb_forced_rows // triton.next_power_of_2(group)))
        _selb_forced_fwd[(triton.cdiv(tq, bq_f), b * hkv)](
            q, k, v, idx, f_o, f_lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1), idx.stride(2), tq, tk, q_start,
            k_start, scale * common.LOG2E,
            HKV=hkv, G=group, GP=triton.next_power_of_2(group), N_SEL=n_sel, BN=np2(n_sel, 1), SEL_BLOCK=sel_block,
            DK=dk, DV=dv, BQ=bq_f, BDK=np2(dk), BDV=np2(dv), IEEE=q.dtype == torch.float32,
            num_warps=tiles.selb_forced_warps)
    else:
        f_o, f_lse = part_o, part_lse      # not read (FORCED off)
    _selb_combine[(tq, b * hkv)](
        part_o, part_lse, f_o, f_lse, idx, o, o_cmp, o_win, gates, idx.stride(0), idx.stride(1), idx.stride(2),
        o.stride(0), o.stride(1), o.stride(2), o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2), o_win.stride(0),
        o_win.stride(1), o_win.stride(2), gates.stride(0), gates.stride(1), gates.stride(2), gates.stride(3), tq,
        q_start, HKV=hkv, G=group, N_SEL=n_sel, SEL_BLOCK=sel_block, DV=dv, BG=np2(group, 1), BDV=np2(dv),
        GATED=gated is not None, FORCED=forced, num_warps=tiles.sel_warps)
