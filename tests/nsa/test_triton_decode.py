"""The fused decode step (triton_kernels/decode.py) against the fp64 oracle: on CUDA, or on CPU
under TRITON_INTERPRET=1. The step's output is the gated sum of the three branches at position t,
and its blocks are the oracle's top-n; separate caches per branch, strided like TokenBuffer views."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa import NSAAttention, NSAConfig, reference
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import common
from nsa.backends.triton_kernels import decode as triton_dec
from tests.nsa.helpers import DEV, assert_near_tie_flip, fp64_group_scores, rand, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")
L, D, SEL, N, W = 8, 4, 16, 4, 20
# (B, Hq, Hkv, dk, dv): GQA 1/4/16, dk != dv.
SHAPES = [(2, 8, 2, 16, 8), (1, 4, 4, 16, 16), (1, 16, 1, 32, 16)]
IDS = [f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-dk{s[3]}-dv{s[4]}" for s in SHAPES]
# dv = 32: two column programs (Tiles.dout_cols = 16) in kernel C's merges and in kernel D.
WIDE = (1, 4, 2, 16, 32)
SLOW = pytest.mark.slow     # `make test-slow`: the costlier duplicates under the interpreter


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and scratch start as NaN: an element read before it is written shows."""
    def nan_out(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def nan_scratch(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((n,), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(common, "empty_out", nan_out)
    monkeypatch.setattr(triton_dec, "_scratch", nan_scratch)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x as a view into a larger buffer (a TokenBuffer's capacity), so strides are not x's own."""
    buf = torch.full((x.shape[0], x.shape[1] + 5, *x.shape[2:]), float("nan"), dtype=x.dtype, device=x.device)
    buf[:, 2:2 + x.shape[1]] = x
    return buf[:, 2:2 + x.shape[1]]


def _step(shape, t, dtype=torch.float32):
    """Inputs of one step at t with separate K/V per branch, and the oracle's (output, blocks)."""
    b, hq, hkv, dk, dv = shape
    q = rand(b, 1, hq, dk, dtype=dtype, device=DEV)
    k_s, v_s = rand(b, t + 1, hkv, dk, dtype=dtype, device=DEV), rand(b, t + 1, hkv, dv, dtype=dtype, device=DEV)
    k_w, v_w = rand(b, t + 1, hkv, dk, dtype=dtype, device=DEV), rand(b, t + 1, hkv, dv, dtype=dtype, device=DEV)
    k_c, v_c = rand(b, t + 1, hkv, dk, dtype=dtype, device=DEV), rand(b, t + 1, hkv, dv, dtype=dtype, device=DEV)
    kc = reference.compress_avg(k_c, L, D).to(dtype=dtype, device=DEV)
    vc = reference.compress_avg(v_c, L, D).to(dtype=dtype, device=DEV)
    gates = torch.rand(b, 1, hq, 3, device=DEV).to(dtype)
    scale = dk ** -0.5
    idx = reference.select_blocks(q, kc, block=L, stride=D, sel_block=SEL, sel_count=N, scale=scale, q_start=t)
    o = (gates[..., 0:1].double().cpu() * reference.compressed_attention(q, kc, vc, block=L, stride=D, scale=scale,
                                                                         q_start=t)
         + gates[..., 1:2].double().cpu() * reference.selected_attention(q, k_s, v_s, idx, sel_block=SEL, scale=scale,
                                                                         q_start=t)
         + gates[..., 2:3].double().cpu() * reference.sliding_window_attention(q, k_w, v_w, window=W, scale=scale,
                                                                               q_start=t))
    nw = min(W, t + 1)
    caches = (_strided(kc), _strided(vc), _strided(k_s), _strided(v_s), _strided(k_w[:, t + 1 - nw:]),
              _strided(v_w[:, t + 1 - nw:]))
    return q, gates, caches, scale, o, idx


@pytest.mark.parametrize("t", [5, 37, 150, 299, 600])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_triton_decode_step_matches_oracle(shape, t, seed):
    """t = 5: no compressed token yet (output 0, scores 0, ties to the lowest blocks); t = 37:
    fewer candidates than n (-1 padding); t = 150: one chunk of kernel A (64 compressed keys on the
    CPU profile); t = 299, 600: 2 and 3 chunks (scores spilled across chunk edges); the window
    past position 0 from t = 20."""
    q, gates, caches, scale, ref, ref_idx = _step(shape, t)
    assert triton_nsa.decode_unsupported_reason(q, t=t, dv=shape[4], block=L, stride=D, sel_block=SEL) is None
    out, idx = triton_nsa.decode_step(q, gates, *caches, t=t, block=L, stride=D, sel_block=SEL, sel_count=N,
                                      window=W, scale=scale)
    assert torch.equal(idx.long().cpu(), ref_idx)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("shape,t", [
    # `make test`: 0, 1 and 2 chunks for every shape, 5 chunks (t = 1100) at GQA 16 and dv 32;
    # `make test-slow`: 3 chunks (t = 600) and the other shapes' 5
    pytest.param(shape, t, id=f"{sid}-{t}", marks=SLOW if t == 600 or (t == 1100 and sid in IDS[:2]) else ())
    for t in (5, 37, 150, 299, 600, 1100) for shape, sid in zip([*SHAPES, WIDE], [*IDS, "dv32"], strict=True)])
def test_triton_decode_group_flags_match_oracle(shape, t, seed):
    """Tiles.dec_flags (each kernel waits for its own group's counts, not the grid before it)
    against the oracle at 0 to 5 chunks, with a counts buffer kept across steps (as NSACache
    keeps one). After a step each group's counts are [0, merges, 0, C programs]: kernel D resets
    the chunk and top-n counts (under the interpreter only when they are at their targets: there
    nothing spins, so this is the check that every program counts in its own slot), kernel A of
    the next step the other two."""
    base = triton_nsa.current_tiles(DEV)
    tiles = dataclasses.replace(base, dec_flags=True, dec_cb=2)
    q, gates, caches, scale, ref, ref_idx = _step(shape, t)
    b, _, hkv = shape[:3]
    counts = triton_nsa.decode_counts(b * hkv + 3, DEV)      # wider than the step's groups
    ncol, nblk = max(shape[4], tiles.dout_cols) // tiles.dout_cols, N + -(-W // 64) + 1
    want = [[0] * (b * hkv) + [0] * 3, [ncol] * (b * hkv) + [0] * 3, [0] * (b * hkv + 3),
            [nblk] * (b * hkv) + [0] * 3]
    for _ in range(2):                                       # the second step reuses the counts
        with triton_nsa.use_tiles(tiles):
            out, idx = triton_nsa.decode_step(q, gates, *caches, t=t, block=L, stride=D, sel_block=SEL, sel_count=N,
                                              window=W, scale=scale, counts=counts)
        assert torch.equal(idx.long().cpu(), ref_idx)
        assert rel_err(out, ref) < 1e-5
        assert counts.cpu().tolist() == want


def test_triton_decode_counts_rejected_and_zeroed_on_failure(monkeypatch):
    """A counts buffer of the wrong shape or dtype is refused before any launch; a step that fails
    after some kernels ran (here: kernel D cannot launch) leaves the counts at 0, not half made."""
    q, gates, caches, scale, ref, ref_idx = _step(SHAPES[0], 299)
    kw = dict(t=299, block=L, stride=D, sel_block=SEL, sel_count=N, window=W, scale=scale)
    tiles = dataclasses.replace(triton_nsa.current_tiles(DEV), dec_flags=True)
    with triton_nsa.use_tiles(tiles):
        for bad in (torch.zeros(4, 1, dtype=torch.int32, device=DEV), torch.zeros(4, 8, device=DEV)):
            with pytest.raises(ValueError, match="counts must be"):
                triton_nsa.decode_step(q, gates, *caches, counts=bad, **kw)

        class Broken:
            def __getitem__(self, grid):
                raise RuntimeError("kernel D cannot launch")

        monkeypatch.setattr(triton_dec, "_dec_out", Broken())
        counts = triton_nsa.decode_counts(8, DEV)
        with pytest.raises(RuntimeError, match="kernel D"):
            triton_nsa.decode_step(q, gates, *caches, counts=counts, **kw)
        assert not counts.any()


@pytest.mark.parametrize("t,algo,once", [
    # `make test`: 0 and 2 chunks for each algorithm, 5 chunks (past dtop_once) for the default filter
    pytest.param(t, algo, once, id=f"{t}-{algo}-{oid}",
                 marks=SLOW if t == 600 or (t == 1100 and algo != "filter") else ())
    for oid, once in (("rows-by-loop", 0), ("rows-at-once", 4)) for algo in ("filter", "filter-rounds", "argmax")
    for t in (5, 299, 600, 1100)])
def test_triton_decode_topn_algorithms(algo, t, once, seed):
    """Kernel B's top-n by each algorithm of topn._select_row (the filter with a cap of 16, so a
    row of 64 blocks compacts, then int64 keys and one sort or the arg-max rounds; its scratch
    follows the score row in the NaN-poisoned scratch). Chunk partials 2 per load, so kernels B
    and D loop: t = 5 has no compressed token, t = 299 / 600 / 1100 have 2 / 3 / 5 chunks of the
    CPU profile's 64 compressed keys. The score row by the loop (Tiles.dtop_once = 0) or from one
    set of loads for up to 4 chunks (so t = 1100 takes the loop: the bound is tested both ways)."""
    base = triton_nsa.current_tiles(DEV)
    q, gates, caches, scale, ref, ref_idx = _step(SHAPES[0], t)
    with triton_nsa.use_tiles(dataclasses.replace(base, dtop_algo=algo.split("-")[0], dtop_cap=16,
                                                  dtop_sort64=algo == "filter", dec_cb=2, dtop_once=once)):
        out, idx = triton_nsa.decode_step(q, gates, *caches, t=t, block=L, stride=D, sel_block=SEL, sel_count=N,
                                          window=W, scale=scale)
    assert torch.equal(idx.long().cpu(), ref_idx)
    assert rel_err(out, ref) < 1e-5


def test_triton_decode_trace_rejected_without_gpu_timer():
    """`_trace` (the kernels' global-timer stamps) needs an int64 [>= groups, TRACE_SLOTS] buffer
    on the step's GPU; a wrong one, or Triton's interpreter (no timer), is refused before a launch."""
    q, gates, caches, scale, ref, ref_idx = _step(SHAPES[0], 299)
    kw = dict(t=299, block=L, stride=D, sel_block=SEL, sel_count=N, window=W, scale=scale,
              tiles=triton_nsa.current_tiles(DEV))
    bad = [torch.zeros(4, 16, dtype=torch.int32, device=DEV), torch.zeros(1, 16, dtype=torch.int64, device=DEV),
           torch.zeros(4, 8, dtype=torch.int64, device=DEV)]
    if DEV == "cpu":
        bad.append(torch.zeros(4, triton_dec.TRACE_SLOTS.value, dtype=torch.int64))
    for tr in bad:
        with pytest.raises(ValueError, match="_trace must be"):
            triton_dec.decode_step(q, gates, *caches, _trace=tr, **kw)


@pytest.mark.skipif(DEV != "cuda", reason="the kernels' global timer needs CUDA")
@pytest.mark.gpu
def test_triton_decode_trace_orders_each_group_chain_on_gpu(seed):
    """The global-timer stamps of a step with per-group waits (Tiles.dec_flags, dependent launch),
    bf16, the paper's sizes, 64/4 heads, B = 2 at t = 20000 (10 chunks): the output is the same with
    and without them, and in every group the chain runs in its order: A's chunks before the
    top-n passes its wait, the top-n before the selected blocks pass theirs, the selected and
    window blocks and C's merges before D passes its waits. A wait that let a program through
    early (a count in the wrong slot, a missing barrier) shows as a stamp out of order."""
    b, hq, hkv, t = 2, 64, 4, 20000
    g = torch.Generator(device=DEV).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=DEV, dtype=torch.bfloat16, generator=g)

    q, gates = r(b, 1, hq, 128), torch.sigmoid(r(b, 1, hq, 3))
    k, v = r(b, t + 1, hkv, 128), r(b, t + 1, hkv, 128)
    kc, vc = reference.compress_avg(k, 32, 16).to(DEV, torch.bfloat16), reference.compress_avg(v, 32, 16).to(
        DEV, torch.bfloat16)
    tiles = dataclasses.replace(triton_nsa.current_tiles(DEV), dec_flags=True)
    if not triton_dec.pdl_ok(torch.device(DEV)):
        pytest.skip("per-group waits need programmatic dependent launch (sm90+)")
    kw = dict(t=t, block=32, stride=16, sel_block=64, sel_count=16, window=512, scale=128 ** -0.5, tiles=tiles)
    counts = triton_nsa.decode_counts(b * hkv, DEV)
    want = triton_dec.decode_step(q, gates, kc, vc, k, v, k[:, -512:], v[:, -512:], counts=counts, **kw)
    for _ in range(3):
        tr = torch.zeros(b * hkv, triton_dec.TRACE_SLOTS.value, dtype=torch.int64, device=DEV)
        tr[:, list(triton_dec.TRACE_MIN_SLOTS)] = torch.iinfo(torch.int64).max
        got = triton_dec.decode_step(q, gates, kc, vc, k, v, k[:, -512:], v[:, -512:], counts=counts, _trace=tr, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        s = {name: tr[:, slot].cpu() for slot, name in triton_dec.TRACE_NAMES.items()}
        assert (s["A first start"] > 0).all() and (s["D end"] < torch.iinfo(torch.int64).max).all()
        chain = ["A first start", "A last end", "B top-n waited", "B top-n row stored", "B top-n selected",
                 "B top-n end", "C sel waited", "C sel end", "D waited", "D end"]
        for before, after in zip(chain, chain[1:], strict=False):
            assert (s[before] <= s[after]).all(), (before, after, s[before] - s[after])
        for before in ("C merges end", "C win end"):
            assert (s[before] <= s["D waited"]).all(), before
        assert (s["A last end"] <= s["C merges end"]).all()
        # "end": before the program's signal (decode.py _stamp), so a waiter's stamps follow it


@SLOW    # 2 x 40 module steps; the fused step alone runs in `make test` (the tests above)
def test_triton_decode_module_paths_agree(seed):
    """NSAAttention.step through the fused step and through the separate ops (Tiles.dec_fused off):
    both equal the oracle's prefill rows at every t, with the same reads."""
    cfg = NSAConfig(dim=32, n_heads=8, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=L, cmp_stride=D,
                    sel_block=SEL, sel_count=N, window=W)
    m = NSAAttention(cfg, backend="triton").to(DEV)
    base = triton_nsa.current_tiles(DEV)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        x = rand(1, 40, 32, device=DEV)
        ref = reference.module_forward(m, x)
        reads = {}
        for fused in (True, False):
            with triton_nsa.use_tiles(dataclasses.replace(base, dec_fused=fused)):
                cache = m.new_cache()
                for t in range(40):
                    y = m.step(x[:, t:t + 1], cache)
                    assert rel_err(y, ref[:, t:t + 1]) < 1e-5, (fused, t)
                reads[fused] = (cache.reads.cmp, cache.reads.sel.tolist(), cache.reads.win,
                                cache.reads.sel_blocks.tolist())
        assert reads[True] == reads[False]
        # t = 39: cmp (40 - 8) // 4 + 1 = 9; sel (3 - 1) * 16 + 39 % 16 + 1 = 40 (3 blocks); win 20.
        assert reads[True][:3] == (9, [[40, 40]], 20)


def test_triton_decode_step_rejects_bad_input():
    q = rand(1, 1, 4, 16, device=DEV)
    kv = rand(1, 10, 2, 16, device=DEV)
    gates = torch.rand(1, 1, 4, 3, device=DEV)
    kw = dict(block=L, stride=D, sel_block=SEL, sel_count=N, window=W, scale=0.25)
    with pytest.raises(ValueError, match="positions 0 .. t"):
        triton_nsa.decode_step(q, gates, kv[:, :1], kv[:, :1], kv, kv, kv, kv, t=10, **kw)
    with pytest.raises(ValueError, match="window cache"):
        triton_nsa.decode_step(q, gates, kv[:, :1], kv[:, :1], kv, kv, kv, kv, t=5, **kw)
    with pytest.raises(ValueError, match="one query per sequence"):
        triton_nsa.decode_step(rand(1, 2, 4, 16, device=DEV), gates, kv, kv, kv, kv, kv, kv, t=9, **kw)
    with pytest.raises(ValueError, match="gates"):
        triton_nsa.decode_step(q, gates[..., :2], kv[:, :1], kv[:, :1], kv, kv, kv, kv, t=9, **kw)
    assert "must divide" in triton_nsa.decode_unsupported_reason(q, t=9, dv=16, block=8, stride=3, sel_block=16)
    assert "l/d = 8 must be <=" in triton_nsa.decode_unsupported_reason(q, t=9, dv=16, block=32, stride=4,
                                                                        sel_block=16)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tensor-core path needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("flags", [False, True], ids=["grid-waits", "group-flags"])
@pytest.mark.parametrize("part_fp32", [False, True], ids=["bf16-partials", "fp32-partials"])
@pytest.mark.parametrize("dk", [128, 192])
def test_triton_decode_step_bf16_paper_sizes_on_gpu(dk, part_fp32, flags, seed):
    """bf16, the paper's l/d/l'/n/w and 64/4 heads at t = 5000 (several chunks of 128 compressed
    keys on the H100 profile): the output within 2x the separate-op path's error of the oracle,
    with the partial outputs in bf16 (the default) or fp32 (Tiles.dec_part_fp32), its kernels
    waiting for whole grids or for their group's counts (Tiles.dec_flags), and the blocks
    the separate-op path picks (both score in fp32 from the same logits, summed in different
    orders: a set may differ only at a near-tie of the fp64 scores)."""
    b, hq, hkv, dv, t = 2, 64, 4, 128, 5000
    cfg = NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=dk, head_dim_v=dv, cmp_block=32, cmp_stride=16,
                    sel_block=64, sel_count=16, window=512)
    m = NSAAttention(cfg, backend="triton").to(device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        x = rand(b, t + 1, 256, dtype=torch.bfloat16, device=DEV)
        _, cache = m.prefill(x[:, :t])
        q, kv, gates = m.project(x[:, t:], start=t)
        for name, (kb, vb) in cache.raw.items():
            kb.append(kv[name][0])
            vb.append(kv[name][1])
        cache.length = t + 1
        m._extend_compressed(cache, t)
        base = triton_nsa.current_tiles(DEV)
        outs = {}
        for fused in (True, False):
            with triton_nsa.use_tiles(dataclasses.replace(base, dec_fused=fused, dec_part_fp32=part_fp32,
                                                          dec_flags=flags)):
                outs[fused] = (m.decode_attend(q, gates, cache), cache.reads.sel_blocks.clone())
        k_s, v_s = (buf.view() for buf in cache.raw[m._kv_name("sel")])
        k_w, v_w = (buf.view(512) for buf in cache.raw[m._kv_name("win")])   # positions t - 511 .. t
        c = cfg

        def ref(idx):
            return (gates[..., 0:1].double().cpu() * reference.compressed_attention(
                        q, cache.k_cmp, cache.v_cmp, block=32, stride=16, scale=c.softmax_scale, q_start=t)
                    + gates[..., 1:2].double().cpu() * reference.selected_attention(
                        q, k_s, v_s, idx, sel_block=64, scale=c.softmax_scale, q_start=t)
                    + gates[..., 2:3].double().cpu() * reference.sliding_window_attention(
                        q, k_w, v_w, window=512, scale=c.softmax_scale, q_start=k_w.shape[1] - 1))

        fused_idx, sep_idx = outs[True][1], outs[False][1]
        if not torch.equal(fused_idx, sep_idx):
            # two fp32 score orders (fused chunks, separate ops): seen tied on the H100
            assert_near_tie_flip(fp64_group_scores(q, cache.k_cmp, cfg, t), fused_idx, sep_idx, "fused vs separate")
        assert rel_err(outs[True][0], ref(fused_idx)) <= 2 * rel_err(outs[False][0], ref(sep_idx)) + 1e-6
