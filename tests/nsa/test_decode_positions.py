"""The fused decode step with positions on the device (triton_kernels/decode.py, `pos`): a ragged
batch, a ring window, a paged raw cache and imported blocks, against the fp64 oracle per sequence
and against the same sequence stepped alone with its host position."""

from __future__ import annotations

import pytest
import torch

from nsa import reference
from nsa.backends import triton_nsa
from tests.nsa.helpers import DEV, rand, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")
L, D, SEL, N, W = 8, 4, 16, 4, 20
HQ, HKV, DK, DV = 4, 2, 16, 8
PAGE = 32          # two selection blocks a page


def _sequence(t: int, dtype=torch.float32):
    """One sequence's caches up to position t (separate K/V per branch), its query and gates."""
    q = rand(1, 1, HQ, DK, dtype=dtype, device=DEV)
    raw = {n: (rand(1, t + 1, HKV, DK, dtype=dtype, device=DEV), rand(1, t + 1, HKV, DV, dtype=dtype, device=DEV))
           for n in ("sel", "win", "cmp")}
    kc = reference.compress_avg(raw["cmp"][0], L, D).to(dtype=dtype, device=DEV)
    vc = reference.compress_avg(raw["cmp"][1], L, D).to(dtype=dtype, device=DEV)
    gates = torch.rand(1, 1, HQ, 3, device=DEV).to(dtype)
    return q, gates, raw, kc, vc


def _oracle(q, gates, raw, kc, vc, t, scale):
    idx = reference.select_blocks(q, kc, block=L, stride=D, sel_block=SEL, sel_count=N, scale=scale, q_start=t)
    g = gates.double().cpu()
    o = (g[..., 0:1] * reference.compressed_attention(q, kc, vc, block=L, stride=D, scale=scale, q_start=t)
         + g[..., 1:2] * reference.selected_attention(q, *raw["sel"], idx, sel_block=SEL, scale=scale, q_start=t)
         + g[..., 2:3] * reference.sliding_window_attention(q, *raw["win"], window=W, scale=scale, q_start=t))
    return o, idx


def _alone(q, gates, raw, kc, vc, t, scale):
    nw = min(W, t + 1)
    return triton_nsa.decode_step(q, gates, kc, vc, *raw["sel"], raw["win"][0][:, t + 1 - nw:],
                                  raw["win"][1][:, t + 1 - nw:], t=t, block=L, stride=D, sel_block=SEL, sel_count=N,
                                  window=W, scale=scale)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ragged_positions_match_each_sequence_alone(paged, seed):
    """Positions 0, 7 (l-1), 19 (w-1), 31 (a page's last token), 150 and 299 (two chunks of kernel
    A) in one launch: each sequence's output and blocks equal the oracle's and, bit for bit, the
    same sequence stepped alone; the window is a ring of 24 rows, the raw cache a shuffled pool."""
    ts = [0, 7, 19, 31, 150, 299]
    bound, cap = 320, 336
    scale = DK ** -0.5
    seqs = [_sequence(t) for t in ts]
    b = len(ts)
    q = torch.cat([s[0] for s in seqs])
    gates = torch.cat([s[1] for s in seqs])
    ncap = (cap - L) // D + 1
    kc = torch.full((b, ncap, HKV, DK), float("nan"), device=DEV)
    vc = torch.full((b, ncap, HKV, DV), float("nan"), device=DEV)
    ring = 24
    kw = torch.full((b, ring, HKV, DK), float("nan"), device=DEV)
    vw = torch.full((b, ring, HKV, DV), float("nan"), device=DEV)
    npp = cap // PAGE
    pool_k = torch.full((b * npp + 3, PAGE, HKV, DK), float("nan"), device=DEV)
    pool_v = torch.full((b * npp + 3, PAGE, HKV, DV), float("nan"), device=DEV)
    table = torch.randperm(b * npp + 3, generator=torch.Generator().manual_seed(seed))[:b * npp].view(b, npp)
    ks = torch.full((b, cap, HKV, DK), float("nan"), device=DEV)
    vs = torch.full((b, cap, HKV, DV), float("nan"), device=DEV)
    for i, (t, (_, _, raw, kci, vci)) in enumerate(zip(ts, seqs, strict=True)):
        kc[i, :kci.shape[1]], vc[i, :vci.shape[1]] = kci[0], vci[0]
        for p in range(max(0, t + 1 - W), t + 1):
            kw[i, p % ring], vw[i, p % ring] = raw["win"][0][0, p], raw["win"][1][0, p]
        ks[i, :t + 1], vs[i, :t + 1] = raw["sel"][0][0], raw["sel"][1][0]
        for p in range(t + 1):
            pool_k[table[i, p // PAGE], p % PAGE] = raw["sel"][0][0, p]
            pool_v[table[i, p // PAGE], p % PAGE] = raw["sel"][1][0, p]
    pos = torch.tensor(ts, dtype=torch.int32, device=DEV)
    extra = dict(page_table=table.to(torch.int32).to(DEV), page_size=PAGE) if paged else {}
    k_sel, v_sel = (pool_k, pool_v) if paged else (ks, vs)
    out, idx = triton_nsa.decode_step(q, gates, kc, vc, k_sel, v_sel, kw, vw, t=bound, block=L, stride=D,
                                      sel_block=SEL, sel_count=N, window=W, scale=scale, pos=pos,
                                      win_layout="ring", **extra)
    for i, (t, s) in enumerate(zip(ts, seqs, strict=True)):
        ref, ref_idx = _oracle(*s, t, scale)
        assert torch.equal(idx[i:i + 1].long().cpu(), ref_idx), t
        assert rel_err(out[i:i + 1], ref) < 1e-5, t
        alone, alone_idx = _alone(*s, t, scale)
        assert torch.equal(idx[i:i + 1], alone_idx), t
        assert torch.equal(out[i:i + 1], alone), t


def test_pages_window_and_imported_blocks(seed):
    """A shared-K/V layout (the window read from the raw cache's pages) and blocks given by the
    caller (no top-n): equal to the oracle with those blocks."""
    ts = [40, 130]
    scale = DK ** -0.5
    b, cap = len(ts), 160
    seqs = [_sequence(t) for t in ts]
    for s in seqs:                                   # shared K/V: one raw stream serves all branches
        s[2]["win"] = s[2]["sel"]
    q = torch.cat([s[0] for s in seqs])
    gates = torch.cat([s[1] for s in seqs])
    ncap = (cap - L) // D + 1
    kc = torch.zeros(b, ncap, HKV, DK, device=DEV)
    vc = torch.zeros(b, ncap, HKV, DV, device=DEV)
    npp = cap // PAGE
    table = torch.arange(b * npp).flip(0).view(b, npp).to(torch.int32)
    pool_k = torch.zeros(b * npp, PAGE, HKV, DK, device=DEV)
    pool_v = torch.zeros(b * npp, PAGE, HKV, DV, device=DEV)
    idx_given = torch.full((b, 1, HKV, N), -1, dtype=torch.int32)
    for i, (t, (_, _, raw, kci, vci)) in enumerate(zip(ts, seqs, strict=True)):
        kc[i, :kci.shape[1]], vc[i, :vci.shape[1]] = kci[0], vci[0]
        for p in range(t + 1):
            pool_k[table[i, p // PAGE], p % PAGE] = raw["sel"][0][0, p]
            pool_v[table[i, p // PAGE], p % PAGE] = raw["sel"][1][0, p]
        for h in range(HKV):                         # any blocks <= the current one, ascending
            chosen = sorted({0, t // SEL, (t // SEL) // 2 + h})
            idx_given[i, 0, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    pos = torch.tensor(ts, dtype=torch.int32, device=DEV)
    out, idx = triton_nsa.decode_step(q, gates, kc, vc, pool_k, pool_v, pool_k, pool_v, t=cap - 1, block=L, stride=D,
                                      sel_block=SEL, sel_count=N, window=W, scale=scale, pos=pos,
                                      win_layout="pages", page_table=table.to(DEV), page_size=PAGE,
                                      idx=idx_given.to(DEV))
    assert torch.equal(idx.cpu(), idx_given)
    for i, (t, (qi, gi, raw, kci, vci)) in enumerate(zip(ts, seqs, strict=True)):
        g = gi.double().cpu()
        ref = (g[..., 0:1] * reference.compressed_attention(qi, kci, vci, block=L, stride=D, scale=scale, q_start=t)
               + g[..., 1:2] * reference.selected_attention(qi, *raw["sel"], idx_given[i:i + 1].long(),
                                                            sel_block=SEL, scale=scale, q_start=t)
               + g[..., 2:3] * reference.sliding_window_attention(qi, *raw["sel"], window=W, scale=scale, q_start=t))
        assert rel_err(out[i:i + 1], ref) < 1e-5, t


def test_bad_position_arguments():
    """pos of the wrong dtype, a window layout that cannot go with host positions, a page size
    that splits a selection block: one clear error each, before any launch."""
    q, gates, raw, kc, vc = _sequence(40)
    args = (q, gates, kc, vc, *raw["sel"], raw["win"][0][:, -W:], raw["win"][1][:, -W:])
    kw = dict(t=40, block=L, stride=D, sel_block=SEL, sel_count=N, window=W, scale=1.0)
    with pytest.raises(ValueError, match="pos must be a contiguous int32"):
        triton_nsa.decode_step(*args, **kw, pos=torch.tensor([40], device=DEV), win_layout="ring")
    with pytest.raises(ValueError, match="win_layout must be"):
        triton_nsa.decode_step(*args, **kw, win_layout="ring")
    with pytest.raises(ValueError, match="page_size must be a multiple"):
        triton_nsa.decode_step(*args, **kw, pos=torch.tensor([40], dtype=torch.int32, device=DEV),
                               win_layout="ring", page_table=torch.zeros(1, 4, dtype=torch.int32, device=DEV),
                               page_size=24)
