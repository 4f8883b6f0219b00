"""Chunked prefill, `NSAAttention.prefill(x, cache=cache)`: a prompt prefilled in chunks gives the
whole prefill's output, the oracle's, and a cache whose steps continue it; gradients reach the
chunk only; misuse gets the fix."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig, reference
from nsa.backends import BackendError
from tests.nsa.helpers import assert_close_but_near_ties, rand, rel_err

# l = 8, d = 4, l' = 16, w = 20: chunk sizes 1, l-1, l, w-1 and 2 l' below.
SMALL = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
             sel_block=16, sel_count=4, window=20)
# Boundaries 1, 8, 16, 35, 67: inside a compression block (1, 35: not multiples of d, or mid-block)
# and inside a selection block (1, 35, 67), plus a chunk longer than the window.
SCHEDULES = {"awkward": (1, 7, 8, 19, 32, 8), "two": (13, 62), "tokens": (40, 1, 1, 33), "one": (75,)}


def _module(backend: str = "auto", **over) -> NSAAttention:
    m = NSAAttention(NSAConfig(**{**SMALL, **over}), backend=backend)
    with torch.no_grad():
        for p in m.parameters():       # non-trivial weights everywhere (biases too)
            p.normal_(0, 0.3)
    return m


def _chunked(m: NSAAttention, x: torch.Tensor, sizes: tuple[int, ...], cache=None):
    ys, t0 = [], 0
    for n in sizes:
        y, cache = m.prefill(x[:, t0:t0 + n], cache=cache)
        ys.append(y)
        t0 += n
    return torch.cat(ys, 1), cache


@pytest.mark.parametrize("backend, over", [("auto", {}), ("sdpa", {}), ("auto", {"kv": "shared"}),
                                           ("auto", {"phi": "mlp"})], ids=["auto", "sdpa", "shared", "mlp"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_chunks_equal_one_prefill_the_oracle_and_later_steps(backend, over, schedule, seed):
    m = _module(backend, **over)
    sizes = SCHEDULES[schedule]
    x = rand(2, sum(sizes) + 6, 32)
    t = sum(sizes)
    with torch.no_grad():
        whole, whole_cache = m.prefill(x[:, :t])
        start = m.new_cache() if schedule == "one" else None     # an empty cache is continued too
        y, cache = _chunked(m, x, sizes, start)
        assert start is None or cache is start
        assert_close_but_near_ties(m, x, y, whole, "chunks against the whole prefill")
        assert_close_but_near_ties(m, x, y, reference.module_forward(m, x[:, :t]), "chunks against the oracle")
        assert cache.length == whole_cache.length == t
        assert rel_err(cache.k_cmp, whole_cache.k_cmp) < 1e-6 and rel_err(cache.v_cmp, whole_cache.v_cmp) < 1e-6
        for name in cache.raw:
            for a, b in zip(cache.raw[name], whole_cache.raw[name], strict=True):
                keep = min(a.keep or t, t)
                assert a.view().shape[1] >= keep and rel_err(a.view(keep), b.view(keep)) < 1e-6
        for i in range(t, x.shape[1]):               # the next steps continue both caches alike
            assert_close_but_near_ties(m, x, m.step(x[:, i:i + 1], cache), m.step(x[:, i:i + 1], whole_cache),
                                       "a step after the chunks", start=i)
        assert cache.length == whole_cache.length == x.shape[1]


def test_one_branch_chunks_equal_the_one_branch_prefill(seed):
    m = _module()
    x = rand(1, 45, 32)
    with torch.no_grad():
        for branches in [("cmp",), ("sel",), ("win",), ()]:
            y0, cache = m.prefill(x[:, :21], branches=branches)
            y1, cache = m.prefill(x[:, 21:], branches=branches, cache=cache)
            assert rel_err(torch.cat([y0, y1], 1), m(x, branches=branches)) < 1e-5, branches
            assert cache.length == 45 and cache.k_cmp.shape[1] == (45 - 8) // 4 + 1


def test_a_window_buffer_keeps_only_the_window(seed):
    """A prefill, or a chunk, longer than the window no longer leaves all its tokens in the window
    and compression buffers (they grew with the prompt)."""
    m = _module()
    x = rand(1, 70, 32)
    with torch.no_grad():
        _, cache = m.prefill(x[:, :50])
        win, cmp = cache.raw["win"][0], cache.raw["cmp"][0]
        assert (win.n, win.data.shape[1], cmp.n, cmp.data.shape[1]) == (20, 40, 8, 16)
        _, cache = m.prefill(x[:, 50:], cache=cache)
    assert (win.n, win.data.shape[1], cmp.n, cmp.data.shape[1]) == (40, 40, 8, 16)
    assert cache.raw["sel"][0].n == 70


def test_chunk_gradients_reach_the_chunk_and_the_weights_not_the_cache(seed):
    """The chunk's output is the whole prefill's at its positions, with the cached tokens constant:
    its input gradient equals the whole prefill's gradient at the chunk's tokens (for a loss on the
    chunk's outputs), and the cache keeps no autograd graph."""
    m = _module()
    t0, t = 21, 45
    x = rand(1, t, 32)
    g = rand(1, t - t0, 32)
    whole_x = x.clone().requires_grad_()
    (m(whole_x)[:, t0:] * g).sum().backward()
    m.zero_grad()
    with torch.no_grad():
        _, cache = m.prefill(x[:, :t0])
    chunk = x[:, t0:].clone().requires_grad_()
    y, cache = m.prefill(chunk, cache=cache)
    (y * g).sum().backward()
    assert rel_err(chunk.grad, whole_x.grad[:, t0:]) < 1e-5
    assert all(p.grad is not None for p in (m.q_proj.weight, m.k_proj["cmp"].weight, m.k_proj["sel"].weight,
                                            m.k_proj["win"].weight, m.gate.weight, m.o_proj.weight))
    assert not any(b.data.requires_grad for pair in cache.raw.values() for b in pair)
    assert not cache.k_cmp.requires_grad and not cache.v_cmp.requires_grad


def test_chunk_misuse_gets_the_fix(monkeypatch):
    from nsa import NSACache
    from nsa.backends import fa3

    m, other = _module(), _module(window=32)
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        _, cache = m.prefill(x[:, :20])
        with pytest.raises(ValueError, match=r"this cache holds B=2 sequences, got a chunk of B=1; continue every"):
            m.prefill(x[:1, 20:], cache=cache)
        with pytest.raises(ValueError, match=r"another layout \(window 20 != 32\)"):
            other.prefill(x[:, 20:], cache=cache)
        with pytest.raises(TypeError, match=r"pass the cache by name: prefill\(x, cache=cache\)"):
            m.prefill(x[:, 20:], cache)
        with pytest.raises(TypeError, match="cache must be an NSACache"):
            m.prefill(x[:, 20:], cache={"sel": None})
        with pytest.raises(ValueError, match="records no layer layout"):
            m.prefill(x[:, 20:], cache=NSACache())
        with pytest.raises(ValueError, match=r"this cache holds torch.float32 K/V, got a chunk projecting to "
                                             r"torch.float64"):
            m.double().prefill(x[:, 20:].double(), cache=cache)
        m.float()
        # A backend that takes prefills from position 0 only says so when named for a chunk.
        bf = _module({"cmp": "fa3"}, head_dim_qk=64, head_dim_v=64).to(torch.bfloat16)
        monkeypatch.setattr(fa3, "unavailable_reason", lambda device=None: None)
        _, bcache = _module(head_dim_qk=64, head_dim_v=64).to(torch.bfloat16).prefill(x[:, :20].bfloat16())
        with pytest.raises(BackendError, match=r"'fa3' cannot run the compressed branch \(cmp\): fa3 takes a "
                                               r"prefill from position 0 only"):
            bf.prefill(x[:, 20:].bfloat16(), cache=bcache)
        assert cache.length == 20 and bcache.length == 20     # refused before anything was appended
        m.prefill(x[:, 20:], cache=cache)                     # the right inputs still continue it
    assert cache.length == 30


@pytest.mark.slow
def test_triton_chunks_equal_one_prefill(seed):
    """The Triton kernels take queries after position 0 (q_start > 0, T > 1) in every branch, forward
    and, for a chunk that needs gradients, the training kernels (about 25 s under the interpreter)."""
    m = _module("triton", head_dim_v=16)
    x = rand(1, 28, 32)
    with torch.no_grad():
        whole, whole_cache = m.prefill(x[:, :27])
        y, cache = _chunked(m, x, (11, 16))
        assert_close_but_near_ties(m, x, y, whole, "triton chunks against the whole prefill")
        assert_close_but_near_ties(m, x, y, reference.module_forward(m, x[:, :27]), "triton chunks against the oracle")
        assert_close_but_near_ties(m, x, m.step(x[:, 27:], cache), m.step(x[:, 27:], whole_cache), "a step", start=27)
    sdpa = _module("sdpa", head_dim_v=16)
    sdpa.load_state_dict(m.state_dict())
    grads = []
    for layer in (m, sdpa):
        with torch.no_grad():
            _, cache = layer.prefill(x[:, :11])
        chunk = x[:, 11:27].clone().requires_grad_()
        layer.prefill(chunk, cache=cache)[0].square().sum().backward()
        grads.append(chunk.grad)
    assert rel_err(*grads) < 1e-4
