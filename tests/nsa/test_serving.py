"""nsa.serving.PagedCache: a ragged batch stepping through decode in one fixed set of launches,
over a paged raw cache, against each sequence stepped alone (NSAAttention.step on its own
contiguous cache, the same fused kernels) and the fp64 oracle; forks, freeing, imported blocks."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig, reference
from nsa.backends import triton_nsa
from nsa.serving import PagedCache, export_blocks, import_blocks
from tests.nsa.helpers import DEV, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")


def _layer(kv: str = "separate", seed: int = 0) -> NSAAttention:
    """The cache's layer: masked SDPA for its prefills (quick under the interpreter; a paged
    step always runs the fused Triton kernels)."""
    torch.manual_seed(seed)
    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=4, window=20, kv=kv)
    return NSAAttention(cfg, backend="sdpa").to(DEV)


def _alone(layer: NSAAttention, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """x [1, T, dim]: prefill `prompt` tokens, then step the rest with the same weights on the
    Triton backend (its fused decode step on a contiguous cache); the outputs of the steps."""
    _, cache = layer.prefill(x[:, :prompt])
    fused = NSAAttention(layer.config, backend="triton").to(DEV, next(layer.parameters()).dtype)
    fused.load_state_dict(layer.state_dict())
    return torch.cat([fused.step(x[:, t:t + 1], cache) for t in range(prompt, x.shape[1])], 1)


@pytest.mark.parametrize("kv", ["separate", pytest.param("shared", marks=pytest.mark.slow)])
def test_ragged_paged_steps_equal_each_sequence_alone(kv, seed):
    """Prompts of 1, 7 (l-1), 19 (w-1) and 31 tokens (the steps cross the page boundary at 32),
    one slot left free; three steps of the whole batch. Each sequence's outputs equal its own
    contiguous-cache steps and the oracle's prefill output at those positions."""
    layer = _layer(kv, seed)
    prompts, steps = [1, 7, 19, 31], 3
    xs = [torch.randn(1, p + steps, 32, device=DEV) for p in prompts]
    cache = PagedCache(layer, max_seqs=5, max_len=64, page_size=32)
    slots = [cache.add() for _ in prompts]
    with torch.no_grad():
        for s, x, p in zip(slots, xs, prompts, strict=True):
            cache.prefill(x[:, :p], s)
        outs = []
        for i in range(steps):
            x_t = torch.zeros(5, 1, 32, device=DEV)
            for s, x, p in zip(slots, xs, prompts, strict=True):
                x_t[s] = x[0, p + i]
            outs.append(cache.step(x_t))
        got = torch.cat(outs, 1)
        assert cache.lens == [p + steps for p in prompts] + [0]
        for s, x, p in zip(slots, xs, prompts, strict=True):
            alone = _alone(layer, x, p)
            assert rel_err(got[s:s + 1], alone) < 1e-5, p
            ref = reference.module_forward(layer, x)[:, p:]
            assert rel_err(got[s:s + 1], ref) < 1e-4, p


@pytest.mark.parametrize("phi,fused", [("mlp", True), pytest.param("avg", False, marks=pytest.mark.slow)],
                         ids=["mlp-fused", "avg-torch-prologue"])
def test_the_other_step_paths_equal_each_sequence_alone(phi, fused, seed):
    """The learnable compressor (the prologue launch, then torch's compression) and the torch
    prologue (a cache the fused step does not cover) give each sequence's own steps too."""
    torch.manual_seed(seed)
    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=4, window=20, phi=phi)
    layer = NSAAttention(cfg, backend="sdpa").to(DEV)
    prompts = [6, 21]
    xs = [torch.randn(1, p + 2, 32, device=DEV) for p in prompts]
    cache = PagedCache(layer, max_seqs=2, max_len=64)
    cache.fused = fused
    with torch.no_grad():
        for x, p in zip(xs, prompts, strict=True):
            cache.prefill(x[:, :p], cache.add())
        got = torch.cat([cache.step(torch.cat([x[:, p + i:p + i + 1] for x, p in zip(xs, prompts, strict=True)]))
                         for i in range(2)], 1)
        for s, (x, p) in enumerate(zip(xs, prompts, strict=True)):
            assert rel_err(got[s:s + 1], _alone(layer, x, p)) < 1e-5, p


def test_fork_shares_the_prefix_and_copies_on_write(seed):
    """A prompt of 40 tokens (its last page half full), forked; the two sequences step different
    tokens: each equals its own sequence alone, and the shared full page is not copied."""
    layer = _layer(seed=seed)
    prompt = torch.randn(1, 40, 32, device=DEV)
    nxt = torch.randn(2, 1, 32, device=DEV)
    cache = PagedCache(layer, max_seqs=2, max_len=64, page_size=32)
    with torch.no_grad():
        a = cache.add()
        cache.prefill(prompt, a)
        b = cache.fork(a)
        assert cache.pages[a] == cache.pages[b]
        out = cache.step(nxt)
        assert cache.pages[a][0] == cache.pages[b][0] and cache.pages[a][1] != cache.pages[b][1]
        for s in (a, b):
            alone = _alone(layer, torch.cat([prompt, nxt[s:s + 1]], 1), 40)
            assert rel_err(out[s:s + 1], alone) < 1e-5


def test_free_returns_pages_and_a_slot_is_reused(seed):
    layer = _layer(seed=seed)
    cache = PagedCache(layer, max_seqs=2, max_len=64, page_size=16, num_pages=6)
    x = torch.randn(1, 40, 32, device=DEV)
    with torch.no_grad():
        s = cache.add()
        cache.prefill(x[:, :33], s)             # 3 pages of 16
        assert len(cache.free_pages) == 2
        with pytest.raises(RuntimeError, match="page pool .* is full"):
            cache.prefill(x[:, :40], cache.add())
        cache.free(s)
        assert len(cache.free_pages) == 5 and cache.used == [False, True]
        again = cache.add()
        assert again == s
        cache.prefill(x[:, :20], again)
        out = cache.step(torch.cat([x[:, 20:21], torch.zeros(1, 1, 32, device=DEV)]))
        assert rel_err(out[again:again + 1], _alone(layer, x[:, :21], 20)) < 1e-5


def test_imported_blocks_run_the_selection(seed):
    """Blocks through the vLLM layout (`topk_idx [Hkv, total_q, k]`) and back give the same step."""
    layer = _layer(seed=seed)
    x = torch.randn(2, 1, 32, device=DEV)
    prompt = torch.randn(1, 50, 32, device=DEV)
    caches = [PagedCache(layer, max_seqs=2, max_len=64) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            for _ in range(2):
                cache.prefill(prompt, cache.add())
        own = caches[0].step(x)
        topk = export_blocks(caches[0].last_blocks)
        assert topk.shape == (2, 2, 4) and topk.dtype == torch.int32
        given = import_blocks(topk, batch=2)
        assert torch.equal(given, caches[0].last_blocks)
        assert torch.equal(caches[1].step(x, blocks=given), own)


def test_misuse_gets_the_fix():
    layer = _layer()
    with pytest.raises(ValueError, match="page_size must be a multiple of sel_block=16"):
        PagedCache(layer, max_seqs=2, max_len=64, page_size=24)
    cache = PagedCache(layer, max_seqs=2, max_len=64)
    with pytest.raises(ValueError, match="slot 1 holds no sequence"):
        cache.fork(1)
    s = cache.add()
    with pytest.raises(ValueError, match="past max_len=64"):
        cache.prefill(torch.randn(1, 65, 32, device=DEV), s)
    with pytest.raises(ValueError, match=r"x_t must be \[max_seqs=2, 1, dim=32\]"):
        cache.step(torch.randn(1, 1, 32, device=DEV))
    with pytest.raises(ValueError, match="graph must be True, False or None"):
        PagedCache(layer, max_seqs=2, max_len=64, graph="yes")
    if torch.device(DEV).type != "cuda":
        with pytest.raises(ValueError, match="graph=True needs a cache on a CUDA device.*graph=False"):
            PagedCache(layer, max_seqs=2, max_len=64, graph=True)
        with pytest.raises(ValueError, match="x_t is on meta, the cache on cpu"):
            cache.step(torch.empty(2, 1, 32, device="meta"))
    with pytest.raises(RuntimeError, match="for inference: .* torch.no_grad"):
        cache.step(torch.randn(2, 1, 32, device=DEV))       # the layer's parameters require grad
    assert cache.lens == [0, 0] and int(cache.lengths.sum()) == 0 and cache.pages == [[], []]
    cache.add()
    with pytest.raises(RuntimeError, match="all 2 slots hold sequences"):
        cache.add()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_replays_at_every_position_without_recapture(dtype, seed):
    """Paper-like geometry (l 32, d 16, l' 64, n 16, w 512) at ragged lengths across a page and a
    compression boundary: 40 graph replays equal 40 eager steps bit for bit; a fork and a freed
    slot between calls capture nothing new. The cache's torch prologue (the layer's own
    projections) equals each sequence alone; the fused step projects with one matmul, so its
    q/K/V differ by that GEMM's rounding, and a near-tie in the block scores may pick another
    block at some step: it must agree with the torch prologue at almost every step."""
    from nsa.serving import GraphedDecode

    torch.manual_seed(seed)
    cfg = NSAConfig(dim=256, n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64)
    layer = NSAAttention(cfg, backend="triton").to("cuda", dtype)
    prompts = [1, 500, 1000, 2020]
    steps = 40
    xs = [torch.randn(1, p + steps, 256, device="cuda", dtype=dtype) for p in prompts]
    # 0: eager; 1: stepped by GraphedDecode; 2: the torch prologue (its own graph); 3: its own graph
    caches = [PagedCache(layer, max_seqs=5, max_len=4096, page_size=128, graph=i != 0) for i in range(4)]
    caches[2].fused = False
    with torch.no_grad():
        for cache in caches:
            for x, p in zip(xs, prompts, strict=True):
                cache.prefill(x[:, :p], cache.add())
        graphed = GraphedDecode(caches[1])
        eager, replayed, torch_prologue, own = [], [], [], []
        for i in range(steps):
            x_t = torch.zeros(5, 1, 256, device="cuda", dtype=dtype)
            for s, (x, p) in enumerate(zip(xs, prompts, strict=True)):
                x_t[s] = x[0, p + i]
            eager.append(caches[0].step(x_t))
            replayed.append(graphed(x_t))
            torch_prologue.append(caches[2].step(x_t))
            own.append(caches[3].step(x_t))
            if i == 10:
                for cache in caches:                 # slot 4 joins as a fork of slot 1, then leaves
                    cache.fork(1)
            if i == 20:
                for cache in caches:
                    cache.free(4)
        assert graphed.captures == 1 and caches[3]._graph.captures == 1 and caches[2]._graph.captures == 1
        assert caches[0]._graph is None
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for s in range(4):
            a, b = torch.cat([o[s] for o in eager]), torch.cat([o[s] for o in replayed])
            assert torch.equal(a, b), s
            assert torch.equal(a, torch.cat([o[s] for o in own])), s
            ref = torch.cat([o[s] for o in torch_prologue])
            assert rel_err(ref, _alone(layer, xs[s], prompts[s])[0]) < tol, s
            per_step = [rel_err(a[i:i + 1], ref[i:i + 1]) for i in range(steps)]
            assert sum(e < tol for e in per_step) >= steps - 2 and max(per_step) < 0.2, (s, per_step)


@pytest.mark.gpu
def test_a_graphed_step_sees_parameters_changed_in_place(seed):
    """The cache's own graph (the default on CUDA) reads the layer's weights side by side: a change
    of the parameters in place, or a projection's parameter replaced by one of the same shape,
    reaches the next replay (the eager step's outputs, bit for bit) without a new capture; o_proj's
    weight replaced by a new tensor (read where it is) captures once more."""
    torch.manual_seed(seed)
    cfg = NSAConfig(dim=256, n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64)
    layer = NSAAttention(cfg, backend="triton").to("cuda", torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    caches = [PagedCache(layer, max_seqs=2, max_len=1024, graph=g) for g in (False, True)]
    with torch.no_grad():
        for cache in caches:
            for s in range(2):
                cache.prefill(x[s:s + 1, :200 + 50 * s], cache.add())
        for i in range(12):
            if i == 4:
                layer.q_proj.weight.mul_(0.5)
                layer.gate.bias.add_(1.0)
            if i == 8:
                layer.k_proj["sel"].weight = torch.nn.Parameter(torch.randn_like(layer.k_proj["sel"].weight) * 0.05)
            if i == 10:
                assert caches[1]._graph.captures == 1
                layer.o_proj.weight = torch.nn.Parameter(layer.o_proj.weight * 2)
            x_t = x[:, 250 + i:251 + i]
            a, b = (cache.step(x_t) for cache in caches)
            assert torch.equal(a, b), i
        assert caches[1]._graph.captures == 2


@pytest.mark.parametrize("kv", ["separate", "shared"])
def test_a_slot_prefilled_in_chunks_equals_one_prefill(kv, seed):
    """A slot prefilled in chunks of 13, 20 and 12 tokens (across a compression block, the window
    and a page of 32) gives the whole prefill's outputs, and its later steps equal those of a slot
    prefilled at once; a second slot in the batch is left as it was."""
    layer = _layer(kv, seed=seed)
    x = torch.randn(1, 47, 32, device=DEV)
    other = torch.randn(1, 9, 32, device=DEV)
    caches = [PagedCache(layer, max_seqs=2, max_len=64, page_size=32) for _ in range(2)]
    with torch.no_grad():
        whole = caches[0].prefill(x[:, :45], caches[0].add())
        s = caches[1].add()
        chunks = [caches[1].prefill(x[:, a:b], s) for a, b in ((0, 13), (13, 33), (33, 45))]
        assert rel_err(torch.cat(chunks, 1), whole) < 1e-5
        for cache in caches:
            cache.prefill(other, cache.add())
        assert caches[1].lens == caches[0].lens == [45, 9]
        for i in (45, 46):
            x_t = torch.cat([x[:, i:i + 1], torch.zeros(1, 1, 32, device=DEV)])
            a, b = (cache.step(x_t) for cache in caches)
            assert rel_err(b, a) < 1e-5


def test_the_layer_steps_a_paged_cache_as_the_cache_does(seed):
    """`attn.step(x_t, cache)` with a PagedCache is `cache.step(x_t)`: the same outputs and lengths;
    another layer's cache, or a subset of branches, is refused with the fix."""
    layer = _layer(seed=seed)
    x = torch.randn(2, 30, 32, device=DEV)
    caches = [PagedCache(layer, max_seqs=2, max_len=64) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            for s in range(2):
                cache.prefill(x[s:s + 1, :20 + 3 * s], cache.add())
        for i in range(3):
            x_t = x[:, 26 + i:27 + i]
            assert torch.equal(layer.step(x_t, caches[0]), caches[1].step(x_t))
        assert caches[0].lens == caches[1].lens == [23, 26]
        with pytest.raises(ValueError, match="runs every branch"):
            layer.step(x[:, :1], caches[0], branches=("win",))
        with pytest.raises(ValueError, match="another layer's K/V"):
            _layer(seed=seed + 1).step(x[:, :1], caches[0])
