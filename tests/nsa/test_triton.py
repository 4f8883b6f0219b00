"""Own Triton kernels against the fp64 oracle: on CUDA, or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from nsa import NSAAttention, NSAConfig, ops, reference
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import compressed as triton_cmp
from nsa.selection import compressed_probs, overlap_weights
from tests.nsa.helpers import DEV, qkv, rand, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")
# (B, T, Hq, Hkv, dk, dv): GQA 1/4/16, awkward T, dk != dv.
SHAPES = [(1, 37, 4, 4, 16, 16), (2, 70, 8, 2, 16, 8), (1, 45, 16, 1, 32, 16)]
IDS = [f"B{s[0]}-T{s[1]}-Hq{s[2]}-Hkv{s[3]}-dk{s[4]}-dv{s[5]}" for s in SHAPES]
B2_T70 = IDS[1]     # the costliest of SHAPES under the interpreter (B = 2, T = 70, 8 heads)
# Marker `slow` (`make test-slow`, nightly): the larger duplicates under the interpreter, whose cost grows
# with B * T * heads. Every kernel keeps a test against the oracle at a small shape in `make test`.
SLOW = pytest.mark.slow


def params(values, ids, slow=()):
    """pytest.param for each value, marked `slow` where its id is in `slow`."""
    assert set(slow) <= set(ids), set(slow) - set(ids)
    return [pytest.param(v, id=i, marks=SLOW if i in slow else ()) for v, i in zip(values, ids, strict=True)]


@pytest.fixture
def tiles():
    """`tiles(field=value, ...)`: launch parameters changed for this test only, on top of the device's
    profile (triton_nsa.use_tiles, undone at teardown)."""
    with contextlib.ExitStack() as stack:
        def override(**changes):
            base = triton_nsa.current_tiles(DEV)
            stack.enter_context(triton_nsa.use_tiles(dataclasses.replace(base, **changes)))
        yield override


@pytest.mark.parametrize("shape,split", [
    # `make test`: every split at GQA 16, one program at GQA 1
    pytest.param(shape, split, id=f"{sid}-{name}",
                 marks=SLOW if sid == B2_T70 or (sid == IDS[0] and split > 1) else ())
    for name, split in (("one-program", 1), ("split2", 2), ("split4", 4))
    for shape, sid in zip(SHAPES, IDS, strict=True)])
def test_triton_selected_matches_oracle(shape, split, seed, tiles):
    """One program per (query, group), or the blocks split over 2 or 4 programs and combined
    (decode's path; 3 blocks over 2 programs leaves one slot empty)."""
    tiles(sel_split=split)
    tiles(sel_split_rows=10 ** 9)
    q, k, v = qkv(*shape, device=DEV)
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=3)
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="triton")
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5
    # Decode: one query at t over the whole cache.
    t = shape[1] - 1
    out_t = ops.selected_attention(q[:, t:t + 1], k, v, idx[:, t:t + 1], sel_block=16, backend="triton", q_start=t)
    assert rel_err(out_t, out[:, t:t + 1]) < 1e-5


BLOCK_SHAPES = SHAPES + [(1, 300, 4, 4, 16, 16), (1, 50, 6, 2, 16, 16)]
BLOCK_IDS = IDS + ["B1-T300-Hq4-Hkv4-dk16-dv16", "B1-T50-Hq6-Hkv2-dk16-dv16"]
BLOCK_MODES = {"one-step-lists-only": (1, False), "three-steps-forced": (3, True)}
# `make test`: GQA 1 with one step and lists only; GQA 16 and GQA 3 (a head tile padded to 4) with three
# steps and the forced kernel.
BLOCK_DEFAULT = {(IDS[0], "one-step-lists-only"), (IDS[2], "three-steps-forced"),
                 ("B1-T50-Hq6-Hkv2-dk16-dv16", "three-steps-forced")}


@pytest.mark.parametrize("shape,steps,forced", [
    pytest.param(shape, *mode, id=f"{sid}-{mid}", marks=() if (sid, mid) in BLOCK_DEFAULT else SLOW)
    for mid, mode in BLOCK_MODES.items() for shape, sid in zip(BLOCK_SHAPES, BLOCK_IDS, strict=True)])
def test_triton_block_centric_selection_matches_oracle(shape, steps, forced, seed, tiles):
    """The block-centric path (selection_blocks.py: entries sorted by key block, one program per
    chunk of a block's list, partials combined per query): the oracle's output for GQA 1/4/16 and
    3 (a head tile padded to 4),
    lists longer than one chunk (block 0 is chosen by every query; T=300 gives 19 blocks), chunks
    of one or three steps of entries over one K/V load (the last step of a list part-filled), a
    chunk of queries at q_start > 0 (query tiles of the forced-block kernel straddling two current
    blocks), keys from k_start > 0, and the gated epilogue; with each query's forced blocks in the
    own kernel (`Tiles.selb_forced_min_group`) or every slot in the lists."""
    tiles(selb_max_group=16, selb_min_rows=0, selb_rows=16, selb_steps=steps, selb_forced_min_group=1 if forced else 0)
    q, k, v = qkv(*shape, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=4)
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="triton")
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5
    t0 = shape[1] // 2 + 1
    out_c = ops.selected_attention(q[:, t0:], k, v, idx[:, t0:], sel_block=16, backend="triton", q_start=t0)
    assert rel_err(out_c, out[:, t0:]) < 1e-5
    k0 = 7                            # keys from position 7 on only (a cache suffix): blocks before it masked
    args = (q[:, t0:], k[:, k0:], v[:, k0:], idx[:, t0:])
    out_k = ops.selected_attention(*args, sel_block=16, backend="triton", q_start=t0, k_start=k0)
    assert rel_err(out_k, ops.selected_attention(*args, sel_block=16, backend="sdpa", q_start=t0, k_start=k0)) < 1e-5
    o_cmp = ops.compressed_attention(q, kc, vc, block=8, stride=4)
    o_win = ops.sliding_window_attention(q, k, v, window=20)
    gates = torch.sigmoid(rand(*shape[:3], 3, device=DEV))
    want = gates[..., 0:1] * o_cmp + gates[..., 1:2] * out + gates[..., 2:3] * o_win
    got = triton_nsa.selected_gated(q, k, v, idx, sel_block=16, scale=shape[4] ** -0.5, gates=gates, o_cmp=o_cmp,
                                    o_win=o_win)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("forced", params([False, True], ["lists-only", "forced"], slow=["forced"]))
def test_block_centric_selection_in_query_chunks(forced, seed, tiles):
    """Past `Tiles.selb_part_cap` the block-centric path runs in chunks of queries (here 7 of
    them, the last one short, the first at q_start > 0): each query's partials and merge are
    the same computation, so the output equals the unchunked one bit for bit, gated and not; and
    the inversion's sort by int32 list ids (`selb_sort16` off) gives it too."""
    from nsa.backends.triton_kernels.selection_blocks import part_bytes_per_query

    shape = (1, 45, 8, 2, 16, 16)
    q, k, v = qkv(*shape, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=4)
    t0 = 3
    o_cmp = ops.compressed_attention(q, kc, vc, block=8, stride=4)[:, t0:]
    o_win = ops.sliding_window_attention(q, k, v, window=20)[:, t0:]
    gates = torch.sigmoid(rand(*shape[:3], 3, device=DEV))[:, t0:]
    args = (q[:, t0:], k, v, idx[:, t0:])
    kw = dict(sel_block=16, scale=shape[4] ** -0.5, q_start=t0)
    outs = []
    for cap, sort16 in ((0, True), (7 * part_bytes_per_query(1, 8, 5, 16, False, 4), True), (0, False)):
        tiles(selb_max_group=16, selb_min_rows=0, selb_rows=16, selb_forced_min_group=1 if forced else 0,
              selb_part_cap=cap, selb_sort16=sort16)
        outs.append((ops.selected_attention(*args, sel_block=16, backend="triton", q_start=t0),
                     triton_nsa.selected_gated(*args, **kw, gates=gates, o_cmp=o_cmp, o_win=o_win)))
    for other in outs[1:]:
        assert torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1])
    assert rel_err(outs[1][0], reference.selected_attention(*args, sel_block=16, q_start=t0)) < 1e-5


@pytest.mark.parametrize("family", params(["group-centric", "block-centric"], ["group-centric", "block-centric"],
                                           slow=["group-centric"]))
def test_triton_selected_counts_a_repeated_block_once(family, seed, tiles):
    """Caller-given block lists with -1 slots, a repeat in every row, blocks ahead of the query and
    rows with nothing selected: the spec's set (nsa.reference.selected_attention) in both kernel
    families. Before `distinct_blocks` both attended a repeat twice (0.43 off the oracle)."""
    tiles(selb_max_group=16 if family == "block-centric" else 0, selb_min_rows=0, selb_rows=16, selb_forced_min_group=1)
    shape = (2, 83, 8, 2, 16, 12)
    b, t, _, hkv, *_ = shape
    q, k, v = qkv(*shape, device=DEV)
    idx = torch.randint(-1, (t + 15) // 16, (b, t, hkv, 5), device=DEV)
    idx[..., 4] = idx[..., 1]
    idx[0, 10:13, 1] = -1
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="triton")
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5
    assert out[0, 10:13, 4:].abs().max() == 0


def test_block_lists_leave_out_the_forced_blocks():
    """With the forced-block kernel the lists take every given block but each query's 0, current and
    previous ones (a forced block left in a list would be attended, and its partial skipped)."""
    from nsa.backends.triton_kernels.selection_blocks import listed_slots

    idx = torch.tensor([[[[0, 1, 2, 5]]], [[[0, 3, 4, 5]]], [[[-1, 2, 6, 7]]]]).permute(1, 0, 2, 3)  # t = 0, 1, 2
    assert listed_slots(idx, 95, 32, forced=False).tolist() == (idx >= 0).tolist()
    # positions 95, 96, 97: current blocks 2, 3, 3
    assert listed_slots(idx, 95, 32, forced=True)[0, :, 0].tolist() == [
        [False, False, False, True], [False, False, True, True], [False, False, True, True]]


@pytest.mark.parametrize("family", ["group-centric", "block-centric"])
def test_triton_selected_with_logits_in_the_hundreds(family, seed, tiles):
    """Queries scaled so logits reach the hundreds (exp overflows fp32 past 88): every merge of
    partials must subtract a maximum over all of them, the forced blocks' and the lists'."""
    tiles(selb_max_group=16 if family == "block-centric" else 0, selb_min_rows=0, selb_rows=16, selb_forced_min_group=1)
    q, k, v = qkv(1, 90, 8, 2, 16, 16, device=DEV)
    q = q * 400
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=4)
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="triton")
    assert out.isfinite().all()
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-4


def test_distinct_blocks_keeps_each_block_once():
    idx = torch.tensor([[3, 1, 3, -1, 1], [0, 0, 0, 0, 0], [-1, -1, 2, -1, 5]])
    got = triton_nsa.distinct_blocks(idx)
    assert got.tolist() == [[-1, 1, -1, 3, -1], [0, -1, -1, -1, -1], [-1, -1, -1, 2, 5]]


def _score_ref(q, kc, t, nb, shape, scale, block=8, stride=4, sel_block=16):
    p = compressed_probs(q.double(), kc.double(), torch.arange(t, device=q.device), block=block, stride=stride,
                         scale=scale)
    ref = p @ overlap_weights(kc.shape[1], nb, block, stride, sel_block, q.device, torch.float64)
    return ref.view(shape[0], shape[3], shape[2] // shape[3], t, nb).sum(2).permute(0, 2, 1, 3)


@pytest.mark.parametrize("layout", ["lse", "carry", "read-modify-write"])
@pytest.mark.parametrize("shape", params(SHAPES, IDS, slow=[B2_T70]))
def test_triton_score_layouts_agree(shape, layout, seed, tiles):
    """Every prefill score path gives the oracle's scores and output: the one-pass kernel with the
    log-sum-exp and the scores kernel (scores.py, the default), and the two-pass kernel with the
    spill carried in registers or read-modify-written (the shapes cover both of its block maps:
    G=1 takes the fp32 dot, G=4/16 the broadcast-sum)."""
    tiles(cmp_lse=layout == "lse", score_carry=layout == "carry")
    q, k, v = qkv(*shape, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    scale = shape[4] ** -0.5
    out, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=8, stride=4, sel_block=16, scale=scale)
    t = shape[1]
    ref = _score_ref(q, kc, t, (t - 1) // 16 + 1, shape, scale)
    assert torch.allclose(scores.double(), ref, rtol=1e-5, atol=1e-5)
    assert rel_err(out, reference.compressed_attention(q, kc, vc, block=8, stride=4)) < 1e-5


# (block, stride, sel_block): E = l/d tokens' segments against R = l'/d segments per block.
GEOMETRIES = [(8, 4, 16), (4, 4, 16), (12, 4, 16), (16, 4, 16), (16, 8, 32)]


@SLOW    # T = 700 throughout; the scores kernel at small shapes: test_triton_score_layouts_agree and others
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"l{g[0]}-d{g[1]}-sel{g[2]}" for g in GEOMETRIES])
def test_triton_scores_kernel_geometries(geometry, seed, tiles):
    """The scores kernel's stride map (weights d*min(R-r, E) to the own block, d*max(0, r+E-R)
    to the next) against the oracle's overlap weights, over several key tiles (T = 700: the
    blocks shared by neighbouring tiles take the atomic adds), queries that see nothing, a
    query tile cut by T, and a chunk of queries starting at q_start > 0."""
    block, stride, sel_block = geometry
    tiles(cmp_lse=True, scr_bq=16, scr_bk=16 * sel_block // stride)
    shape = (1, 700, 8, 2, 16, 16)
    q, k, v = qkv(*shape, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    scale = 16 ** -0.5
    out, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=block, stride=stride, sel_block=sel_block,
                                                   scale=scale)
    nb = (700 - 1) // sel_block + 1
    ref = _score_ref(q, kc, 700, nb, shape, scale, block, stride, sel_block)
    assert torch.allclose(scores.double(), ref, rtol=1e-5, atol=1e-6)
    assert rel_err(out, reference.compressed_attention(q, kc, vc, block=block, stride=stride)) < 1e-5
    start = 301
    o_c, s_c = triton_nsa.compressed_and_scores(q[:, start:], kc, vc, block=block, stride=stride,
                                                sel_block=sel_block, scale=scale, q_start=start)
    assert torch.allclose(s_c, scores[:, start:], rtol=1e-5, atol=1e-6)
    assert rel_err(o_c, out[:, start:]) < 1e-5


# T = 300 in both; the CPU profile's scr_qt = 2 with the gather runs in `make test` (test_triton_score_layouts_agree)
@pytest.mark.parametrize("hq,start", [pytest.param(2, 0, id="G1", marks=SLOW),
                                      pytest.param(8, 137, id="G4-q_start137", marks=SLOW)])
def test_triton_scores_query_tiles_per_program(hq, start, seed, tiles):
    """`Tiles.scr_qt` query tiles per scores program, the block map's shift by a dot or a gather
    (`scr_gather`): the same scores bit for bit as one tile per program, zeroed with atomic edges
    and in the spill mode that top-n reads (so the same blocks), a whole prefill (against the
    oracle too) and a chunk from q_start = 137. 3 tiles per program: programs straddle the
    causal staircase, and the last one holds tiles past T (19 and 11 query tiles of 16)."""
    block, stride, sel_block = 8, 4, 16
    base = dict(cmp_lse=True, scr_bq=16, scr_bk=16 * sel_block // stride, topn_split_rows=0)
    q, k, v = qkv(1, 300, hq, 2, 16, 16, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    kw = dict(block=block, stride=stride, sel_block=sel_block, scale=16 ** -0.5)
    got = {}
    for qt, gather in ((1, False), (3, False), (3, True)):
        tiles(**base, scr_qt=qt, scr_gather=gather)
        o, s = triton_nsa.compressed_and_scores(q[:, start:], kc, vc, q_start=start, **kw)
        _, idx = triton_nsa.compressed_select(q[:, start:], kc, vc, sel_count=5, q_start=start, **kw)
        got[(qt, gather)] = (o, s, idx)
    o1, s1, i1 = got[(1, False)]
    for key, (o, s, idx) in got.items():
        assert torch.equal(s, s1), f"scores differ with (scr_qt, scr_gather) = {key}, q_start {start}"
        assert torch.equal(o, o1) and torch.equal(idx, i1), key
    nb = (300 - 1) // sel_block + 1
    if start == 0:
        ref = _score_ref(q, kc, 300, nb, (1, 300, hq, 2, 16, 16), 16 ** -0.5, block, stride, sel_block)
        assert torch.allclose(s1.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", params(SHAPES, IDS, slow=[B2_T70]))
def test_triton_compressed_and_scores_match(shape, seed):
    q, k, v = qkv(*shape, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    scale = shape[4] ** -0.5
    out, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=8, stride=4, sel_block=16, scale=scale)
    assert rel_err(out, reference.compressed_attention(q, kc, vc, block=8, stride=4)) < 1e-5
    assert out[:, :7].abs().max() == 0, "queries with no complete block get exactly 0"
    t = shape[1]
    ref = _score_ref(q, kc, t, (t - 1) // 16 + 1, shape, scale)
    assert torch.allclose(scores.double(), ref, rtol=1e-5, atol=1e-5)
    # Decode: the last 3 queries alone (q_start) give the same output and score rows.
    o_t, s_t = triton_nsa.compressed_and_scores(q[:, t - 3:], kc, vc, block=8, stride=4, sel_block=16, scale=scale,
                                                q_start=t - 3)
    assert rel_err(o_t, out[:, t - 3:]) < 1e-5
    assert torch.allclose(s_t, scores[:, t - 3:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("on", [True, False], ids=["beside-on", "beside-off"])
def test_beside_runs_in_order_without_a_gpu(on, tiles):
    """Off a GPU (or with Tiles.win_beside off) `beside` is chain, side, finish in order on the
    caller's stream, and returns what finish returns."""
    tiles(win_beside=on)
    order = []

    def side():
        order.append("side")
        return torch.ones(2)

    def chain():
        order.append("chain")
        return torch.full((2,), 2.0)

    def finish(s, c):
        order.append("finish")
        return s + c

    out = triton_nsa.beside(side, chain, finish, device="cpu", rows=1)
    assert order == ["chain", "side", "finish"]
    assert out.tolist() == [3.0, 3.0]


class _Logged(torch.cuda.Stream):
    """A stream that logs the waits and the event records `beside` asks of it."""

    def wait_stream(self, stream):
        self.log.append((self.name, "wait_stream"))
        torch.cuda.Stream.wait_event(self, stream.record_event())

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event is self.expect))
        super().wait_event(event)

    def record_event(self, event=None):
        self.log.append((self.name, "record_event"))
        return super().record_event(event)


@pytest.mark.gpu
def test_beside_orders_its_streams_on_gpu(tiles):
    """Each of the two streams waits for the caller's stream and for the last call's finish
    before side / chain run on them; the caller's stream waits for both (each records the event
    it waits on) before finish; past `win_beside_rows`, or under `win_beside_min_rows`, nothing
    runs on them."""
    tiles(win_beside=True, win_beside_rows=100, win_beside_min_rows=100)
    log = []
    high, low = _Logged(priority=-100), _Logged(priority=0)
    for stream, name in ((high, "high"), (low, "low")):
        stream.log, stream.name, stream.expect = log, name, None
    dev = torch.device("cuda", torch.cuda.current_device())
    own, pair = triton_nsa._streams(dev), triton_nsa._Streams(high, low)
    triton_nsa._STREAMS[dev] = pair

    def side():
        log.append("side")
        return torch.ones(4, device=DEV)

    def chain():
        log.append("chain")
        return torch.ones(4, device=DEV)

    def finish(s, c):
        log.append("finish")
        return s + c

    try:
        triton_nsa.beside(side, chain, finish, device=DEV, rows=100)
        assert pair.last is not None
        high.expect = low.expect = pair.last
        log.clear()
        out = triton_nsa.beside(side, chain, finish, device=DEV, rows=100)
        assert torch.all(out == 2.0)
        at = log.index
        for name, work in (("high", "chain"), ("low", "side")):
            assert at((name, "wait_stream")) < at(work) and at((name, "wait_event", True)) < at(work), log
            assert at(work) < at((name, "record_event")) < at("finish"), log
        log.clear()
        triton_nsa.beside(side, chain, finish, device=DEV, rows=101)
        assert log == ["chain", "side", "finish"]
        log.clear()
        triton_nsa.beside(side, chain, finish, device=DEV, rows=99)
        assert log == ["chain", "side", "finish"]
    finally:
        triton_nsa._STREAMS[dev] = own


@pytest.mark.gpu
@pytest.mark.parametrize("slow", ["side", "chain"])
def test_beside_joins_its_streams_on_gpu(slow, tiles):
    """Finish, on the caller's stream, sees what side and chain made when either is held back by
    a long sleep kernel on its own stream (and in order with win_beside off)."""
    for on in (True, False):
        tiles(win_beside=on, win_beside_min_rows=0)

        def side():
            torch.cuda._sleep(40_000_000 if slow == "side" else 0)
            return torch.full((1 << 20,), 1234.5, device=DEV)

        def chain():
            torch.cuda._sleep(40_000_000 if slow == "chain" else 0)
            return torch.full((1 << 20,), 2.0, device=DEV)

        for _ in range(3):
            out = triton_nsa.beside(side, chain, lambda s, c: s + c, device=DEV, rows=1)
            assert torch.all(out == 1236.5), out.unique()


@pytest.mark.gpu
def test_beside_reuses_its_streams_memory_after_the_last_finish_on_gpu(tiles):
    """A call from another stream reuses the side's freed block only after the previous call's
    finish has read it (the event its streams wait for), not when its own caller's stream says."""
    tiles(win_beside=True, win_beside_min_rows=0)
    n = 1 << 22

    def run(value, slow):
        def side():
            return torch.full((n,), value, device=DEV)

        def finish(s, c):
            if slow:
                torch.cuda._sleep(50_000_000)
            return s * 1.0

        return triton_nsa.beside(side, lambda: None, finish, device=DEV, rows=1)

    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        out1 = run(1.0, True)
    with torch.cuda.stream(second):
        out2 = run(2.0, False)
    torch.cuda.synchronize()
    assert torch.all(out1 == 1.0) and torch.all(out2 == 2.0)


@pytest.mark.gpu
def test_beside_memory_stays_flat_with_the_host_ahead_on_gpu(tiles):
    """Twenty calls enqueued far ahead of a slow GPU reuse one block for the side's output (with
    `record_stream` each call took a fresh one until the pool hit the device's limit)."""
    tiles(win_beside=True, win_beside_min_rows=0)
    n = 1 << 24            # 64 MiB of fp32

    def chain():
        torch.cuda._sleep(5_000_000)

    def call():
        return triton_nsa.beside(lambda: torch.ones(n, device=DEV), chain, lambda s, c: s.sum(), device=DEV,
                                 rows=1)

    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    sums = [call() for _ in range(20)]
    torch.cuda.synchronize()
    assert all(x.item() == n for x in sums)
    assert torch.cuda.max_memory_reserved() - before < 3 * 4 * n


@pytest.mark.gpu
def test_module_window_beside_equals_in_order_on_gpu(seed, tiles):
    """bf16 prefill through `auto` with the Triton window on its own stream (Tiles.win_beside):
    bit for bit the in-order forward, eager and replayed from a CUDA graph."""
    cfg = NSAConfig(dim=256, n_heads=16, n_kv_heads=1, head_dim_qk=128, head_dim_v=128)
    m = NSAAttention(cfg, backend={"win": "triton"}).to(DEV, torch.bfloat16)
    t = 3000
    q = rand(1, t, 16, 128, dtype=torch.bfloat16, device=DEV)
    kv = {n: (rand(1, t, 1, 128, dtype=torch.bfloat16, device=DEV), rand(1, t, 1, 128, dtype=torch.bfloat16,
                                                                        device=DEV)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(rand(1, t, 16, 3, dtype=torch.bfloat16, device=DEV))
    with torch.no_grad():
        base = triton_nsa.current_tiles(DEV)
        with triton_nsa.use_tiles(dataclasses.replace(base, win_beside=False)):
            ref = m.attend(q, kv, gates)
        tiles(win_beside=True, win_beside_min_rows=0)
        assert torch.equal(m.attend(q, kv, gates), ref)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m.attend(q, kv, gates)            # warm-up off the default stream, as torch.cuda.graph wants
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = m.attend(q, kv, gates)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@SLOW    # 53 decode steps; the kernels one by one run in `make test` (here and tests/nsa/test_triton_decode.py)
def test_triton_module_matches_oracle(seed):
    cfg = NSAConfig(dim=32, n_heads=8, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=4, window=20)
    m = NSAAttention(cfg, backend="triton").to(DEV)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        x = rand(2, 53, 32, device=DEV)
        ref = reference.module_forward(m, x)
        assert rel_err(m(x), ref) < 1e-5
        cache = m.new_cache()
        for t in range(53):
            y = m.step(x[:, t:t + 1], cache)
        assert rel_err(y, ref[:, -1:]) < 1e-5
        # Reads at t = 52 (spec): cmp (53 - 8) // 4 + 1 = 12; sel (4 - 1) * 16 + 52 % 16 + 1 = 53.
        assert cache.reads.cmp == 12
        assert cache.reads.sel.tolist() == [[53, 53], [53, 53]]


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tensor-core path needs CUDA")
@pytest.mark.gpu
def test_triton_bf16_paper_shapes_on_gpu(seed):
    """bf16, paper block sizes, GQA 16 and dk=dv=128 / dk=192: selection kernel within 2x SDPA's error."""
    for dk, dv in ((128, 128), (192, 128)):
        q, k, v = qkv(1, 1000, 16, 1, dk, dv, dtype=torch.bfloat16, device=DEV)
        kc, vc = ops.compress_kv(k, v, block=32, stride=16)
        idx = ops.select_blocks(q, kc, block=32, stride=16, sel_block=64, sel_count=16)
        ref = reference.selected_attention(q, k, v, idx, sel_block=64)
        ours = ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton")
        base = ops.selected_attention(q, k, v, idx, sel_block=64, backend="sdpa")
        assert rel_err(ours, ref) <= 2 * rel_err(base, ref) + 1e-6
        ref_c = reference.compressed_attention(q, kc, vc, block=32, stride=16)
        oc, sc = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64, scale=dk ** -0.5)
        bc = ops.compressed_attention(q, kc, vc, block=32, stride=16, backend="sdpa")
        assert rel_err(oc, ref_c) <= 2 * rel_err(bc, ref_c) + 1e-6
        # Scores of the bf16 inputs in fp64 vs the kernel's (fp32 throughout).
        ref_s = _score_ref(q, kc, 1000, sc.shape[-1], q.shape[:3] + (1,), dk ** -0.5, 32, 16, 64)
        assert torch.allclose(sc.double(), ref_s, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tensor-core path needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("part_fp32,forced", [(False, True), (True, True), (False, False)],
                         ids=["bf16-partials", "fp32-partials", "bf16-lists-only"])
def test_triton_block_centric_bf16_on_gpu(part_fp32, forced, seed, tiles):
    """bf16, paper block sizes, GQA 1, 4 and 8 through the block-centric kernel, partial outputs
    rounded to bf16 (the default) or kept in fp32, the forced blocks in their own kernel or in
    the lists: within 2x SDPA's error of the fp64 oracle."""
    tiles(selb_max_group=8, selb_min_rows=0, selb_part_fp32=part_fp32, selb_forced_min_group=1 if forced else 0)
    for hq, hkv in ((16, 16), (16, 4), (16, 2)):
        q, k, v = qkv(1, 1000, hq, hkv, 128, 128, dtype=torch.bfloat16, device=DEV)
        kc, _ = ops.compress_kv(k, v, block=32, stride=16)
        idx = ops.select_blocks(q, kc, block=32, stride=16, sel_block=64, sel_count=16)
        ref = reference.selected_attention(q, k, v, idx, sel_block=64)
        ours = ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton")
        base = ops.selected_attention(q, k, v, idx, sel_block=64, backend="sdpa")
        assert rel_err(ours, ref) <= 2 * rel_err(base, ref) + 1e-6, (hq, hkv)


def test_block_centric_list_ids_fit_their_sort_dtype():
    """The inversion's sort key holds every list id `0 .. n_lists` (the last: invalid slots)."""
    from nsa.backends.triton_kernels.selection_blocks import list_id_dtype

    for n_lists in (0, 6, 2 ** 15 - 1, 2 ** 15, 2 ** 20):
        dt = list_id_dtype(n_lists)
        assert torch.iinfo(dt).max >= n_lists and (dt == torch.int16) == (n_lists < 2 ** 15), n_lists


def test_interpreter_flag_is_what_cpu_runs_use():
    if DEV == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("q_start,mode", [
    pytest.param(q, m, id=f"{q}-{m}", marks=SLOW if (q, m) == (40, "chunks+merge") else ())
    for m in ("one-pass", "chunks+merge") for q in (0, 40)])
def test_triton_topn_matches_select_topn(q_start, mode, seed, tiles):
    """Same blocks as the PyTorch rule, including ties (scores drawn from a few values, signed
    zeros and negatives among them), rows with fewer candidates than n (-1 padding) and a
    decode-like q_start; also the few-rows path that splits each row over chunks of 4 blocks and merges the chunks'
    candidates."""
    from nsa.selection import select_topn

    tiles(topn_split_rows=10 ** 9 if mode == "chunks+merge" else 0)
    tiles(topn_chunk=4)

    b, tq, hkv, sel_block, n = 2, 29, 3, 4, 5
    nb = (q_start + tq - 1) // sel_block + 1
    scores = (torch.randint(0, 5, (b, tq, hkv, nb), device=DEV).float() - 1) / 4
    scores[scores == 0] = torch.where(torch.rand_like(scores[scores == 0]) < 0.5, 0.0, -0.0)
    ours = triton_nsa.topn(scores, q_start, sel_block=sel_block, sel_count=n)
    q_pos = torch.arange(q_start, q_start + tq, device=DEV)
    want = select_topn(scores.permute(0, 2, 1, 3), q_pos, sel_block=sel_block, sel_count=n)
    assert torch.equal(ours.long(), want.long())
    if q_start == 0:
        assert (ours[:, :2] == -1).any(), "early rows have fewer candidates than n: the -1 padding is exercised"


TOPN_CASES = ["spread", "one-bucket", "bucket-at-edge", "bucket-inside", "signed", "signed-zeros-on-top",
              "few-candidates"]
TOPN_ALGOS = ["filter", "filter-rounds", "filter-rank", "filter-rank-contiguous", "argmax"]
# `make test` runs argmax (cheap) on every case; filter-rank (Tiles' default) on every case but the two
# plainest (spread, signed); each other filter on the case that reaches its own exact rule (zeros of both
# signs tied on top; the contiguous chunks: the re-rank of the candidates), and the filter with int64 keys
# also on rows too narrow for it (few-candidates). `make test-slow` runs the rest.
TOPN_DEFAULT = {"argmax": TOPN_CASES, "filter-rank": [c for c in TOPN_CASES if c not in ("spread", "signed")],
                "filter": ["signed-zeros-on-top", "few-candidates"], "filter-rounds": ["signed-zeros-on-top"],
                "filter-rank-contiguous": ["bucket-inside"]}


@pytest.mark.parametrize("algo,case", [
    pytest.param(a, c, id=f"{a}-{c}", marks=() if c in TOPN_DEFAULT[a] else SLOW)
    for c in TOPN_CASES for a in TOPN_ALGOS])
def test_triton_topn_algorithms_are_exact(case, algo, seed, tiles):
    """Each top-n algorithm of topn._select_row against the PyTorch rule on rows of 120 blocks
    (n = 5, 7 index bits; filter: 32 strided chunks of 4 (contiguous chunks with
    "-contiguous"), at most 16 compacted, then the exact rule over them by int64 keys and one
    sort, by n arg-max rounds ("filter-rounds") or by all-pairs ranks of the int64 keys
    ("filter-rank")):
    scores spread out (the candidates decide); all in one truncation bucket (1.0 + k ulp,
    k < 2**7: the whole-row fallback decides, ties by index included); ~18 near-equal top scores
    in one bucket (across bitonic's 16th candidate, over filter's cap: fallback) or ~5 (inside:
    the exact re-rank of the candidates decides); signed values with zeros of both signs (also
    as the top n, where -0.0 and +0.0 must tie and the lower index win); rows
    with fewer candidates than 16 (filter: fewer than n chunks hold one). The persistent grid of
    the CPU profile (3 programs) walks many rows each."""
    from nsa.selection import select_topn

    tiles(topn_algo=algo.split("-")[0], topn_cap=16, topn_split_rows=0, topn_sort64=algo == "filter",
          topn_rank=algo.startswith("filter-rank"), topn_lane_chunks=0 if algo.endswith("contiguous") else 32)
    b, hkv, tq, sel_block, n, nb = 1, 2, 15, 4, 5, 120
    q_start = nb * sel_block - tq if case != "few-candidates" else 30     # ~118 candidates, or 8-12
    g = torch.Generator().manual_seed(seed)
    if case == "spread":
        scores = torch.rand(b, tq, hkv, nb, generator=g)
    elif case == "one-bucket":
        scores = 1.0 + torch.randint(0, 2 ** 7, (b, tq, hkv, nb), generator=g).float() * 2.0 ** -23
    elif case in ("bucket-at-edge", "bucket-inside"):
        scores = torch.rand(b, tq, hkv, nb, generator=g) * 0.5
        # ~18 near-equal top blocks per row (across the 16th candidate), or ~5 (inside the 16)
        near = torch.rand(b, tq, hkv, nb, generator=g) < (0.15 if case == "bucket-at-edge" else 0.04)
        scores[near] = 0.75 + torch.randint(0, 8, (int(near.sum()),), generator=g).float() * 2.0 ** -24
    elif case in ("signed", "signed-zeros-on-top"):
        scores = torch.randint(-4, 5, (b, tq, hkv, nb), generator=g).float() / 4
        if case == "signed-zeros-on-top":   # ~13 zeros per row above negatives: the top n are zeros of both signs
            scores = torch.where(scores > 0, -scores, scores)
        zero = scores == 0
        scores[zero] = torch.where(torch.rand(int(zero.sum()), generator=g) < 0.5, 0.0, -0.0)
    else:
        scores = torch.rand(b, tq, hkv, nb, generator=g)
    scores = scores.to(DEV)
    ours = triton_nsa.topn(scores, q_start, sel_block=sel_block, sel_count=n)
    q_pos = torch.arange(q_start, q_start + tq, device=DEV)
    want = select_topn(scores.permute(0, 2, 1, 3), q_pos, sel_block=sel_block, sel_count=n)
    assert torch.equal(ours.long(), want.long())


def test_topn_lane_chunks_only_where_the_filter_and_its_compaction_fit():
    """`sort_params` turns the lane form on for filter rows only: at least 32 blocks wide (the
    compaction's [width / 32, 32] view) and a cap of at least n (`_write_any` sorts the cap's
    slots into out[0:n]); rows the rounds take, or `lanes` off, keep it off. The filter itself
    runs only on rows of `min_width` blocks or more."""
    from nsa.backends.triton_kernels.topn import sort_params

    on = dict(sel_count=16, algo="filter", cap=32, nchunk=32, sort64=False, rank=True, lanes=True)
    assert sort_params(1024, **on)["LANES"] == 1 and sort_params(1024, **on)["CW"] == 32
    assert sort_params(64, **on)["LANES"] == 1
    assert sort_params(32, **on)["LANES"] == 0                        # <= cap: the rounds, no filter
    assert sort_params(1024, **{**on, "lanes": False})["LANES"] == 0
    assert sort_params(1024, **{**on, "algo": "argmax"})["LANES"] == 0
    assert sort_params(64, **on, min_width=128)["ALGO"] == 0 and sort_params(128, **on, min_width=128)["ALGO"] == 1
    wide = {**on, "sel_count": 40, "nchunk": 64}          # 64 chunks >= np2(40): the filter runs
    assert sort_params(1024, **{**wide, "cap": 64})["LANES"] == 1
    assert sort_params(1024, **wide)["ALGO"] == 1 and sort_params(1024, **wide)["LANES"] == 0      # cap 32 < n


def test_topn_width_classes_cover_every_query_once():
    """Each query lands in the narrowest power-of-two class holding its candidates (blocks
    0 .. (q_start + t) // sel_block), every query exactly once, the last class the full width."""
    from nsa.backends.triton_kernels.topn import width_classes

    for q_start, tq, sel_block, width, low in ((0, 300, 2, 256, 16), (37, 100, 4, 64, 16), (5000, 3, 64, 128, 16),
                                               (0, 1, 64, 16, 16), (0, 70, 4, 32, 16)):
        classes = width_classes(q_start, tq, sel_block, width, low)
        seen = []
        for t_lo, t_hi, w in classes:
            for t in range(t_lo, t_hi):
                cur = (q_start + t) // sel_block
                assert cur < w and (w == low or cur >= w // 2), (q_start, t, w)
            seen += range(t_lo, t_hi)
        assert seen == list(range(tq)) and classes[-1][2] <= width


@SLOW    # 300 rows; width_classes itself: the test above, top-n's rows: test_triton_topn_algorithms_are_exact
def test_triton_topn_over_width_classes(seed, tiles):
    """Prefill top-n runs one launch per width class (rows whose candidates fit 16, 32, ..., 256
    blocks): 300 queries over blocks of 2 span five classes, the filter runs in each class wider
    than its cap; the blocks equal the PyTorch rule's."""
    from nsa.backends.triton_kernels.topn import width_classes
    from nsa.selection import select_topn

    tiles(topn_cap=16, topn_split_rows=0, topn_filter_min=0)
    tq, sel_block, n = 300, 2, 5
    nb = (tq - 1) // sel_block + 1
    assert len(width_classes(0, tq, sel_block, 256, 16)) == 5
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, tq, 1, nb, generator=g).to(DEV)
    ours = triton_nsa.topn(scores, 0, sel_block=sel_block, sel_count=n)
    want = select_topn(scores.permute(0, 2, 1, 3), torch.arange(tq, device=DEV), sel_block=sel_block, sel_count=n)
    assert torch.equal(ours.long(), want.long())


# q_start = 250 (`make test`): the last 50 queries only, the rows past position 264 crossing a key tile
@pytest.mark.parametrize("q_start", params([0, 1, 37, 250], ["0", "1", "37", "250"], slow=["0", "1", "37"]))
def test_triton_compressed_select_is_scores_then_topn(q_start, seed, monkeypatch, tiles):
    """compressed_select (scores left unzeroed, key-tile spills in a side buffer that top-n adds)
    gives the blocks and output of compressed_and_scores + topn (zeroed scores, atomic edges),
    bit for bit. 300 positions, compressed tokens of 8 every 4, blocks of 16: key tiles of 64
    compressed tokens hold 16 blocks, so rows cross two tile edges. New fp32 tensors start as
    NaN here, so a score top-n reads that no kernel wrote would show."""
    from nsa.backends.triton_kernels import topn as triton_topn

    tiles(topn_split_rows=0)
    empty = torch.empty

    def nan_empty(*a, **k):
        out = empty(*a, **k)
        return out.fill_(float("nan")) if out.dtype == torch.float32 else out

    monkeypatch.setattr(triton_cmp.torch, "empty", nan_empty)
    q_all, k, v = qkv(1, 300, 4, 2, 16, 16, device=DEV)
    q = q_all[:, q_start:]
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    kw = dict(block=8, stride=4, sel_block=16, scale=16 ** -0.5, q_start=q_start)
    spills = []
    real = triton_topn.topn
    monkeypatch.setattr(triton_topn, "topn", lambda *a, **k: spills.append(k.get("spill")) or real(*a, **k))
    o, idx = triton_nsa.compressed_select(q, kc, vc, sel_count=5, **kw)
    assert len(spills) == 1 and spills[0] is not None and spills[0][1] == 16, "the spill path ran"
    o_ref, scores = triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    idx_ref = triton_nsa.topn(scores, q_start, sel_block=16, sel_count=5)
    assert torch.equal(o, o_ref)
    assert torch.equal(idx, idx_ref)
    assert (idx >= 3).any(), "rows pick free blocks, not only the forced ones"


@pytest.mark.parametrize("shape", params(SHAPES[1:], IDS[1:], slow=[B2_T70]))
def test_triton_split_decode_matches_prefill_rows(shape, seed, monkeypatch, tiles):
    """Decode splits the compressed keys over chunks (flash-decoding) when the queries fit one
    tile: same output as the oracle and the same score rows as the one-tile kernel (chunks of
    16 compressed keys here, so 2-3 chunks with a spill after each). GQA 1 pads its tile to 16
    queries, whose fp32-dot block map has no carry, so it keeps the one-tile kernel."""
    b, _, hq, hkv, dk, dv = shape
    t = 150
    q, k, v = qkv(b, t, hq, hkv, dk, dv, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    scale = dk ** -0.5
    full_o, full_s = triton_nsa.compressed_and_scores(q, kc, vc, block=8, stride=4, sel_block=16, scale=scale)
    ref = reference.compressed_attention(q, kc, vc, block=8, stride=4)
    tiles(split_tiles=1)
    calls = []
    real = triton_cmp._compressed_split
    monkeypatch.setattr(triton_cmp, "_compressed_split", lambda *a, **kw: calls.append(kw["n_split"]) or real(*a, **kw))
    # 149: 36 visible compressed keys, 3 chunks; 132: 32, exactly 2 chunks, so the last chunk's
    # spill lands in a block < Nb and must be added; 70: 16, one chunk (the one-tile kernel).
    for start in (t - 1, 132, 70):
        o1, s1 = triton_nsa.compressed_and_scores(q[:, start:start + 1], kc, vc, block=8, stride=4, sel_block=16,
                                                  scale=scale, q_start=start)
        assert rel_err(o1, ref[:, start:start + 1]) < 1e-5
        assert torch.allclose(s1, full_s[:, start:start + 1, :, :s1.shape[-1]], rtol=1e-5, atol=1e-6)
    assert calls and min(calls) >= 2, f"the split path ran with several chunks: {calls}"


@pytest.mark.parametrize("split", [1, 4], ids=["one-program", "split4"])
def test_triton_selected_gated_is_the_gated_sum(split, seed, tiles):
    """The selection kernel's gated epilogue (and the split combine's) equals the gated sum of
    the three branch outputs computed apart; the window-through-selection decode path equals
    the sliding op."""
    tiles(sel_split=split)
    tiles(sel_split_rows=10 ** 9)
    q, k, v = qkv(2, 45, 8, 2, 16, 16, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=3)
    o_cmp = ops.compressed_attention(q, kc, vc, block=8, stride=4)
    o_win = ops.sliding_window_attention(q, k, v, window=20)
    gates = torch.sigmoid(rand(2, 45, 8, 3, device=DEV))
    o_sel = ops.selected_attention(q, k, v, idx, sel_block=16)
    want = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
    got = triton_nsa.selected_gated(q, k, v, idx, sel_block=16, scale=16 ** -0.5, gates=gates, o_cmp=o_cmp,
                                    o_win=o_win)
    assert rel_err(got, want) < 1e-5
    t = 44
    o_t = triton_nsa.sliding_decode(q[:, t:t + 1], k[:, t + 1 - 20:t + 1], v[:, t + 1 - 20:t + 1], t=t,
                                    scale=16 ** -0.5, block=16)
    assert rel_err(o_t, o_win[:, t:t + 1]) < 1e-5
