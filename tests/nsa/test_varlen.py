"""Packed sequences (`cu_seqlens`): each sequence of a pack is its own causal prompt, equal to the
oracle and to running it alone (bit for bit at the attend level, forward and backward); bad
`cu_seqlens` get the fix; the one host read of `cu_seqlens` is the only one added."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig, reference
from tests.nsa.helpers import assert_close_but_near_ties, rand, rel_err

# l = 8, d = 4, l' = 16, w = 20. Lengths 1, l-1, an empty one, l, w-1 and 2 l'.
SMALL = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
             sel_block=16, sel_count=4, window=20)
LENGTHS = (1, 7, 0, 8, 19, 32)


def _module(backend: str = "auto", **over) -> NSAAttention:
    m = NSAAttention(NSAConfig(**{**SMALL, **over}), backend=backend)
    with torch.no_grad():
        for p in m.parameters():       # non-trivial weights everywhere (biases too)
            p.normal_(0, 0.3)
    return m


def _cu(lengths) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32), list(zip(bounds, bounds[1:], strict=False))


@pytest.mark.parametrize("backend, over", [("auto", {}), ("sdpa", {}), ("auto", {"kv": "shared"}),
                                           ("auto", {"phi": "mlp"})], ids=["auto", "sdpa", "shared", "mlp"])
def test_packed_forward_is_each_sequence_alone_and_the_oracle(backend, over, seed):
    m = _module(backend, **over)
    cu, spans = _cu(LENGTHS)
    x = rand(1, sum(LENGTHS), 32)
    with torch.no_grad():
        y = m(x, cu_seqlens=cu)
        assert y.shape == x.shape
        for s, e in spans:
            if e > s:
                part = x[:, s:e]
                assert_close_but_near_ties(m, part, y[:, s:e], m(part), f"sequence {s}..{e} alone")
                assert_close_but_near_ties(m, part, y[:, s:e], reference.module_forward(m, part),
                                           f"sequence {s}..{e} against the oracle")


def _packed_inputs(m: NSAAttention, lengths) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """Projections of random packed tokens at each sequence's own positions, `[total_T, H, D]` leaves."""
    from nsa import packing

    cu, _ = _cu(lengths)
    with torch.no_grad():
        q, kv, gates = m._project_at(rand(1, sum(lengths), 32), packing.positions(cu, sum(lengths)))

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t[0].clone().requires_grad_()

    return leaf(q), {n: (leaf(k), leaf(v)) for n, (k, v) in kv.items()}, leaf(gates), cu


@pytest.mark.parametrize("backend, over", [("auto", {}), ("sdpa", {}), ("auto", {"kv": "shared"})],
                         ids=["auto", "sdpa", "shared"])
def test_packed_attend_is_bit_for_bit_one_at_a_time_forward_and_backward(backend, over, seed):
    m = _module(backend, **over)
    q, kv, gates, cu = _packed_inputs(m, LENGTHS)
    leaves = [q, gates, *(t for pair in kv.values() for t in pair)]
    o = m.attend(q, kv, gates, cu_seqlens=cu)
    grad_out = rand(*o.shape)
    grads = torch.autograd.grad(o, leaves, grad_out)
    for s, e in _cu(LENGTHS)[1]:
        if e == s:
            continue
        one = [t[s:e].detach()[None].requires_grad_() for t in leaves]
        kv_one = {n: (one[2 + 2 * i], one[3 + 2 * i]) for i, n in enumerate(kv)}
        o_one = m.attend(one[0], kv_one, one[1])
        assert torch.equal(o[s:e], o_one[0]), (s, e)
        # A sequence shorter than l has no compressed token: its compressed K/V get no gradient.
        for g, g_one in zip(grads, torch.autograd.grad(o_one, one, grad_out[None, s:e], allow_unused=True),
                            strict=True):
            assert torch.equal(g[s:e], g_one[0] if g_one is not None else torch.zeros_like(g[s:e])), (s, e)


def test_packed_forward_gradients_are_the_per_sequence_ones(seed):
    """Training on a pack: the weights' gradients are the sum of the sequences' own, the input's
    gradient each sequence's own (to the rounding of the projections' matmuls)."""
    m = _module()
    lengths = (1, 0, 11, 30)
    cu, spans = _cu(lengths)
    x = rand(1, sum(lengths), 32).requires_grad_()
    g = rand(*x.shape)
    (m(x, cu_seqlens=cu) * g).sum().backward()
    packed = {n: p.grad.clone() for n, p in m.named_parameters()}
    x_grad = x.grad.clone()
    m.zero_grad()
    x.grad = None
    for s, e in spans:
        if e > s:
            (m(x[:, s:e]) * g[:, s:e]).sum().backward()
    for n, p in m.named_parameters():
        assert rel_err(packed[n], p.grad) < 1e-5, n
    assert rel_err(x_grad, x.grad) < 1e-5


def test_a_sequence_shorter_than_the_compression_block_trains(seed):
    """Its compressed branch reads no key; its output was a fresh zeros tensor cut from autograd, so
    a training call of fewer than l tokens (alone or in a pack) raised BackendError."""
    m = _module("sdpa")
    x = rand(1, 5, 32).requires_grad_()
    m(x).square().sum().backward()
    assert x.grad.isfinite().all() and x.grad.abs().sum() > 0


def test_packed_call_reads_cu_seqlens_once_and_adds_no_other_host_read(monkeypatch):
    """The only host read a packed call adds to its sequences' own calls is `cu_seqlens.tolist()`."""
    m = _module()
    cu, spans = _cu(LENGTHS)
    x = rand(1, sum(LENGTHS), 32)
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k: (
            reads.append(_name), _real(self, *a, **k))[1])
    with torch.no_grad():
        m(x, cu_seqlens=cu)
        packed = list(reads)
        reads.clear()
        for s, e in spans:
            if e > s:
                m(x[:, s:e])
    assert packed.count("tolist") == reads.count("tolist") + 1
    assert sorted(packed) == sorted([*reads, "tolist"])


@pytest.mark.parametrize("cu, error, match", [
    ([0, 10, 45], ValueError, r"cu_seqlens must end at the packed length total_T = 67, got 45"),
    ([1, 50, 67], ValueError, r"cu_seqlens must start at 0, got 1"),
    ([0, 50, 40, 67], ValueError, r"non-decreasing, got cu_seqlens\[2\] = 40 < cu_seqlens\[1\] = 50"),
    ([0], ValueError, r"1-D \[N\+1\] with N >= 1 sequences, got shape \[1\]"),
    ([[0, 67]], ValueError, r"1-D \[N\+1\] with N >= 1 sequences, got shape \[1, 2\]"),
    ("int64", TypeError, r"cu_seqlens must be int32 .* got torch.int64; pass cu_seqlens.to\(torch.int32\)"),
    ("list", TypeError, r"cu_seqlens must be an int32 tensor \[N\+1\] .* got list"),
    ("meta", ValueError, r"cu_seqlens must be on the device of the packed tensors \(cpu\), got meta"),
])
def test_bad_cu_seqlens_get_the_fix(cu, error, match):
    m = _module()
    x = rand(1, 67, 32)
    if cu == "int64":
        cu = torch.tensor([0, 67])
    elif cu == "list":
        cu = [0, 67]
    elif cu == "meta":
        cu = torch.tensor([0, 67], dtype=torch.int32, device="meta")
    else:
        cu = torch.tensor(cu, dtype=torch.int32)
    q, kv, gates, _ = _packed_inputs(m, (67,))
    with torch.no_grad():
        with pytest.raises(error, match=match):
            m(x, cu_seqlens=cu)
        with pytest.raises(error, match=match):
            m.attend(q, kv, gates, cu_seqlens=cu)


def test_packed_shapes_get_the_fix():
    m = _module()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, kv, gates, _ = _packed_inputs(m, (5, 7))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"x must be \[1, total_T, dim=32\] .* got \[12, 32\]; pass x\[None\]"):
            m(rand(12, 32), cu_seqlens=cu)
        with pytest.raises(ValueError, match=r"x must be \[1, total_T, dim=32\] .* got \[2, 6, 32\]"):
            m(rand(2, 6, 32), cu_seqlens=cu)
        with pytest.raises(ValueError, match=r"q must be \[total_T, H, D\] .* got \[1, 12, 4, 16\]"):
            m.attend(q[None], kv, gates, cu_seqlens=cu)
        with pytest.raises(ValueError, match=r"kv\['sel'\] v must be .* got \[1, 12, 2, 4\]"):
            m.attend(q, {**kv, "sel": (kv["sel"][0], kv["sel"][1][..., :4])}, gates, cu_seqlens=cu)
        with pytest.raises(ValueError, match="branches must be a sequence of names"):
            m(rand(1, 12, 32), branches="cmp", cu_seqlens=cu)


@pytest.mark.slow
def test_triton_packed_forward_is_each_sequence_alone(seed):
    """The Triton plan over a pack with an empty and a short sequence: each sequence is the oracle's,
    the longest one also its run alone (about 20 s under the interpreter)."""
    m = _module("triton", head_dim_v=16)
    lengths = (3, 0, 17)
    cu, spans = _cu(lengths)
    x = rand(1, sum(lengths), 32)
    with torch.no_grad():
        y = m(x, cu_seqlens=cu)
        assert rel_err(y[:, 3:], m(x[:, 3:])) < 1e-6
        for s, e in spans:
            if e > s:
                assert rel_err(y[:, s:e], reference.module_forward(m, x[:, s:e])) < 1e-5, (s, e)
