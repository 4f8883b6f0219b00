"""GraphedAttend: CUDA-graph replays of NSAAttention.attend, bit for bit the eager call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa import GraphedAttend, NSAAttention, NSAConfig, dispatch
from nsa.backends import triton_nsa
from tests.nsa.helpers import DEV, rand

SMALL = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
             sel_block=16, sel_count=4, window=20)


def _eager(attn: NSAAttention, *inputs):
    """`attn.attend` under the tiles a GraphedAttend captures with by default (`Tiles.for_graphs`)."""
    with triton_nsa.use_tiles(triton_nsa.current_tiles(DEV).for_graphs()):
        return attn.attend(*inputs)


def _inputs(t: int, hq: int, hkv: int, dk: int, dv: int, *, device=DEV, dtype=torch.float32):
    q = rand(1, t, hq, dk, device=device, dtype=dtype)
    kv = {n: (rand(1, t, hkv, dk, device=device, dtype=dtype), rand(1, t, hkv, dv, device=device, dtype=dtype))
          for n in ("cmp", "sel", "win")}
    return q, kv, torch.sigmoid(rand(1, t, hq, 3, device=device, dtype=dtype))


@pytest.mark.parametrize("kwargs,match", [
    ({"branches": ()}, "branches must be a non-empty subset"),
    ({"branches": ("cmp", "dense")}, "branches must be a non-empty subset"),
    ({"max_graphs": 0}, "max_graphs must be >= 1"),
    ({"warmup": 0}, "warmup must be >= 1"),
])
def test_graphed_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphedAttend(NSAAttention(NSAConfig(**SMALL)), **kwargs)
    with pytest.raises(TypeError, match="attn must be an NSAAttention"):
        GraphedAttend(torch.nn.Linear(2, 2))


def test_graphed_refuses_cpu_tensors_and_gradients():
    graphed = GraphedAttend(NSAAttention(NSAConfig(**SMALL)))
    q, kv, gates = _inputs(40, 4, 2, 16, 8, device="cpu")
    with torch.no_grad(), pytest.raises(ValueError, match=r"one CUDA device, got \['cpu'\].*attn.attend"):
        graphed(q, kv, gates)
    # Gradients enabled and the module's parameters require them (the default): refused first.
    with pytest.raises(RuntimeError, match=r"for inference.*torch.no_grad\(\)") as refused:
        graphed(q, kv, gates)
    assert len(graphed) == 0 and graphed.captures == 0
    # The fix it names is true: the layer itself trains (it once said "call attn.attend(...) to
    # train" while training did not work; now the module call carries gradients).
    assert "train through the layer itself (attn(x)" in str(refused.value)
    attn = graphed.attn
    x = torch.randn(1, 40, attn.config.dim)
    attn(x).sum().backward()
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0


def test_graphed_key_covers_what_a_graph_holds_fixed():
    """Same shapes with other data share a key; strides, tiles, thresholds, the requested backend
    and the parameters' storage each give another (a graph replays what it was captured with)."""
    attn = NSAAttention(NSAConfig(**SMALL, phi="mlp"))
    graphed = GraphedAttend(attn)
    q, kv, gates = _inputs(40, 4, 2, 16, 8, device="cpu")

    def key(q=q, kv=kv):
        return graphed._key(q, kv, gates, tuple(attn.parameters()))

    base = key()
    assert key(q=rand(*q.shape)) == base
    assert key(q=rand(1, 4, 40, 16).transpose(1, 2)) != base                 # other strides
    cpu_tiles = triton_nsa.current_tiles("cpu")
    with triton_nsa.use_tiles(dataclasses.replace(cpu_tiles, sel_warps=cpu_tiles.sel_warps * 2)):
        assert key() != base
    assert key() == base
    dispatch.set_overrides(triton_min_len_sel=123)
    try:
        assert key() != base
    finally:
        dispatch.set_overrides(triton_min_len_sel=None)
    # Clearing the override loads a fresh thresholds object: another key (a re-capture, never a
    # stale plan), stable from then on.
    base = key()
    assert key() == base
    attn.backend = "sdpa"
    assert key() != base
    attn.backend = "auto"
    first = next(attn.phi_k.parameters())
    first.data = first.data.clone()
    assert key() != base


LAYOUTS = [(3000, 16, 1, 128, 128), (1000, 8, 2, 64, 64), (777, 12, 4, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"T{t}-Hq{hq}-Hkv{hkv}-dk{dk}" for t, hq, hkv, dk, _ in LAYOUTS])
def test_graphed_equals_eager_on_gpu(layout, seed):
    """bf16 through `auto`: every replay equals the eager call on the same data and tiles bit for
    bit, new data of the same shape reuses the graph, and a result is not changed by the next call."""
    t, hq, hkv, dk, dv = layout
    attn = NSAAttention(NSAConfig(dim=64, n_heads=hq, n_kv_heads=hkv, head_dim_qk=dk, head_dim_v=dv))
    attn = attn.to(DEV, torch.bfloat16)
    graphed = GraphedAttend(attn)
    with torch.no_grad():
        first = _inputs(t, hq, hkv, dk, dv, dtype=torch.bfloat16)
        out1 = graphed(*first)
        kept = out1.clone()
        second = _inputs(t, hq, hkv, dk, dv, dtype=torch.bfloat16)
        out2 = graphed(*second)
        torch.cuda.synchronize()
        assert graphed.captures == 1 and len(graphed) == 1
        assert torch.equal(out1, kept) and not torch.equal(out1, out2)
        assert torch.equal(out1, _eager(attn, *first))
        assert torch.equal(out2, _eager(attn, *second))


@pytest.mark.gpu
def test_graphed_recaptures_and_drops_the_least_recent_on_gpu(seed):
    attn = NSAAttention(NSAConfig(dim=64, n_heads=8, n_kv_heads=2, head_dim_qk=64, head_dim_v=64))
    attn = attn.to(DEV, torch.bfloat16)
    graphed = GraphedAttend(attn, max_graphs=2)
    a, b, c = (_inputs(t, 8, 2, 64, 64, dtype=torch.bfloat16) for t in (300, 500, 700))
    with torch.no_grad():
        graphed(*a)
        graphed(*b)
        graphed(*a)                # a is now the most recent
        graphed(*c)                # drops b
        assert graphed.captures == 3 and len(graphed) == 2
        graphed(*a)
        assert graphed.captures == 3
        out_b = graphed(*b)        # captured again
        assert graphed.captures == 4 and torch.equal(out_b, _eager(attn, *b))
        # Other tiles: another graph, equal to the eager call under the same tiles.
        base = triton_nsa.current_tiles(DEV)
        with triton_nsa.use_tiles(dataclasses.replace(base, win_beside=not base.win_beside, win_beside_min_rows=0)):
            out_a = graphed(*a)
            assert graphed.captures == 5 and torch.equal(out_a, _eager(attn, *a))
        assert graphed.captures == 5


@pytest.mark.gpu
def test_graphed_refuses_a_call_that_synchronises_before_capturing(seed, monkeypatch):
    """A call that reads a value back from the GPU cannot be captured: refused in the warm-up with
    the plan named, before any capture (a failed capture leaves torch's CUDA generator marked as
    capturing, and every later random draw on the device raises)."""
    from nsa import ops

    attn = NSAAttention(NSAConfig(**SMALL)).to(DEV)
    q, kv, gates = _inputs(40, 4, 2, 16, 8)
    window = ops.sliding_window_attention

    def reads_back(q, *args, **kwargs):
        float(q.sum())                  # a host synchronisation
        return window(q, *args, **kwargs)

    monkeypatch.setattr(ops, "sliding_window_attention", reads_back)
    graphed = GraphedAttend(attn)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"synchronises with the host.*its plan is \[.*win="):
        graphed(q, kv, gates)
    assert graphed.captures == 0 and len(graphed) == 0
    assert torch.cuda.get_sync_debug_mode() == 0
    assert torch.isfinite(rand(3, device=DEV)).all()          # the generator still draws
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(graphed(q, kv, gates), _eager(attn, q, kv, gates))


def test_graphed_captures_with_the_host_floors_lifted():
    """By default a capture runs under the tiles in force with HOST_FLOORS at 0; given tiles, under
    those. (The capture itself is replaced by a spy: no CUDA needed.)"""
    from nsa.backends.triton_kernels import tiles as tiles_mod

    base = tiles_mod.current("cpu")
    lifted = base.for_graphs()
    assert all(getattr(lifted, f) == 0 for f in tiles_mod.HOST_FLOORS)
    # What the replayed measurements decided (results/h100/graphs/): the block-centric selection
    # and the window beside the chain at any length; the wheels only above their work floors.
    assert (lifted.selb_min_rows, lifted.win_beside_min_rows) == (0, 0)
    assert (lifted.cmp_fa3_min_work, lifted.win_fa4_min_work) == (base.cmp_fa3_min_work, base.win_fa4_min_work) > (0, 0)
    assert all(getattr(base, f) > 0 for f in tiles_mod.HOST_FLOORS)
    assert dataclasses.replace(lifted, **{f: getattr(base, f) for f in tiles_mod.HOST_FLOORS}) == base
    q, kv, gates = _inputs(40, 4, 2, 16, 8, device="cpu")
    for given, expect in ((None, lifted), (base, base)):
        graphed = GraphedAttend(NSAAttention(NSAConfig(**SMALL)), tiles=given)
        seen = []
        graphed._capture_with = lambda *a, seen=seen: seen.append(tiles_mod.current("cpu"))
        graphed._capture(q, kv, gates)
        assert seen == [expect]
    with pytest.raises(TypeError, match="tiles must be a Tiles"):
        GraphedAttend(NSAAttention(NSAConfig(**SMALL)), tiles={"selb_min_rows": 0})


@pytest.mark.gpu
def test_graphed_owns_the_masks_it_reads_on_gpu(seed):
    """Masked SDPA caches its band masks per shape; a graph must not read the cached ones, which
    can be evicted and their memory reused while the graph still replays
    (nsa.backends.shape_cached). Here the cached masks are overwritten in place ("all visible")
    after the capture: the replay must not see it."""
    from nsa.backends import sdpa
    from nsa.masks import n_compressed

    attn = NSAAttention(NSAConfig(**SMALL), backend="sdpa").to(DEV)
    graphed = GraphedAttend(attn)
    c = attn.config
    t, dev = 300, str(torch.device(DEV, torch.cuda.current_device()))
    with torch.no_grad():
        graphed(*_inputs(t, 4, 2, 16, 8))
        fresh = _inputs(t, 4, 2, 16, 8)
        expect = _eager(attn, *fresh)
        misses = sdpa._static_mask.cache_info().misses
        for args in (("sliding", 0, 0, c.window, 0, t, t, dev),
                     ("compressed", 0, 0, c.cmp_block, c.cmp_stride, t, n_compressed(t, c.cmp_block, c.cmp_stride), dev)):
            assert sdpa.use_full_mask(args[5], args[6])       # the cached path is the one taken
            sdpa._static_mask(*args)[0].fill_(True)
        assert sdpa._static_mask.cache_info().misses == misses   # both were the cached masks
        assert torch.equal(graphed(*fresh), expect)
        assert graphed.captures == 1
    sdpa._static_mask.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [300, 1500], ids=["masked-sdpa", "triton"])
def test_module_forward_captures_in_a_callers_graph_on_gpu(t, seed):
    """The whole layer (projections, RoPE, attention, gates, output projection) in a caller's own
    `torch.cuda.graph`, as a model captured whole would run it: equal to the eager forward bit for
    bit, at a length `auto` gives masked SDPA and one it gives the Triton kernels."""
    attn = NSAAttention(NSAConfig(dim=96, n_heads=8, n_kv_heads=2, head_dim_qk=64, head_dim_v=64))
    attn = attn.to(DEV, torch.bfloat16)
    x = rand(2, t, 96, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                attn(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(x)
        x.copy_(rand(2, t, 96, device=DEV, dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, attn(x))
