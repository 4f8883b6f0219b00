"""Backend registry, CPU backends against the oracle, and the FA-2 adapters' contract via doubles."""

from __future__ import annotations

import sys

import pytest
import torch

from nsa import backends, ops, reference
from nsa.backends import AttnCall, BackendError
from tests.nsa import fa2_doubles
from tests.nsa.helpers import qkv, rel_err

CASES = [(2, 37, 4, 2, 16, 16, 5), (1, 50, 16, 1, 8, 8, 64), (1, 23, 4, 4, 16, 16, 7)]
IDS = [f"B{c[0]}-T{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}-w{c[6]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flex_on_cpu_matches_oracle(case, seed):
    b, t, hq, hkv, dk, dv, w = case
    q, k, v = qkv(b, t, hq, hkv, dk, dv)
    assert rel_err(ops.sliding_window_attention(q, k, v, window=w, backend="flex"),
                   reference.sliding_window_attention(q, k, v, window=w)) < 1e-5
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    assert rel_err(ops.compressed_attention(q, kc, vc, block=8, stride=4, backend="flex"),
                   reference.compressed_attention(q, kc, vc, block=8, stride=4)) < 1e-5
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=3)
    assert rel_err(ops.selected_attention(q, k, v, idx, sel_block=16, backend="flex"),
                   reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5


def test_unknown_and_unavailable_backends_raise_with_reason():
    q, k, v = qkv(1, 8, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.sliding_window_attention(q, k, v, window=4, backend="fa5")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="torch_fa2.*CUDA"):
            ops.sliding_window_attention(q, k, v, window=4, backend="torch_fa2")
    kc, vc = ops.compress_kv(k, v, block=4, stride=2)
    idx = ops.select_blocks(q, kc, block=4, stride=2, sel_block=4, sel_count=3)
    with pytest.raises(BackendError, match="does not implement the selected op"):
        ops.selected_attention(q, k, v, idx, sel_block=4, backend="torch_fa2" if torch.cuda.is_available() else "fa2")


def test_fa2_alias_resolves_to_what_exists(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)      # import flash_attn -> ImportError
    assert backends.resolve("fa2") == "torch_fa2"
    assert "not importable" in backends.unavailable_reason("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", fa2_doubles.fake_flash_attn_module())
    assert backends.resolve("fa2") == "flash_attn"


def _call(op: str, b: int, t: int, hq: int, hkv: int, d: int, **kw) -> AttnCall:
    q, k, v = qkv(b, t, hq, hkv, d, d, dtype=torch.float64)
    if op == "compressed":
        k, v = ops.compress_kv(k, v, block=kw["block"], stride=kw["stride"])
    return AttnCall(op, q, k, v, d ** -0.5, **kw)


DOUBLE_CASES = [(2, 45, 4, 2, 16), (1, 100, 8, 8, 8), (3, 19, 16, 1, 8)]


def _check_adapter(adapter, shape) -> None:
    """Both FA-2 adapters, on the doubles, against the oracle: windows below and above T, and
    compressed grids where the stride divides the block, equals it and does not divide it."""
    for w in (1, 9, 500):
        call = _call("sliding", *shape, window=w)
        assert rel_err(adapter.sliding(call), reference.sliding_window_attention(call.q, call.k, call.v, window=w)) < 1e-9
    for block, stride in ((8, 4), (16, 16), (5, 3)):
        call = _call("compressed", *shape, block=block, stride=stride)
        ref = reference.compressed_attention(call.q, call.k, call.v, block=block, stride=stride)
        assert rel_err(adapter.compressed(call), ref) < 1e-9


SHAPE_IDS = [f"B{s[0]}-T{s[1]}-Hq{s[2]}-Hkv{s[3]}" for s in DOUBLE_CASES]


@pytest.mark.parametrize("shape", DOUBLE_CASES, ids=SHAPE_IDS)
def test_flash_attn_adapter_contract(shape, monkeypatch, seed):
    monkeypatch.setitem(sys.modules, "flash_attn", fa2_doubles.fake_flash_attn_module())
    from nsa.backends import flash_attn as adapter
    _check_adapter(adapter, shape)


@pytest.mark.parametrize("shape", DOUBLE_CASES, ids=SHAPE_IDS)
def test_torch_fa2_adapter_contract(shape, monkeypatch, seed):
    from nsa.backends import torch_fa2 as adapter

    def fake_fa(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **kw):
        return fa2_doubles.aten_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                        scale=scale, **kw)[0]

    monkeypatch.setattr(adapter, "_fa", fake_fa)
    _check_adapter(adapter, shape)


def test_fa2_adapters_decode_alignment(monkeypatch, seed):
    """One query at position t with a cache: the adapters must line it up with the last key."""
    monkeypatch.setitem(sys.modules, "flash_attn", fa2_doubles.fake_flash_attn_module())
    from nsa.backends import flash_attn as adapter
    q, k, v = qkv(2, 60, 4, 2, 8, 8, dtype=torch.float64)
    for t in (0, 6, 7, 33, 59):
        w = 10
        kw, vw = k[:, max(0, t - w + 1):t + 1], v[:, max(0, t - w + 1):t + 1]
        call = AttnCall("sliding", q[:, t:t + 1], kw, vw, 8 ** -0.5, q_start=t, k_start=max(0, t - w + 1), window=w)
        ref = reference.sliding_window_attention(q, k, v, window=w)[:, t:t + 1]
        assert rel_err(adapter.sliding(call), ref) < 1e-9
        kc, vc = ops.compress_kv(k[:, :t + 1], v[:, :t + 1], block=8, stride=4)
        call = AttnCall("compressed", q[:, t:t + 1], kc, vc, 8 ** -0.5, q_start=t, block=8, stride=4)
        kc_all, vc_all = ops.compress_kv(k, v, block=8, stride=4)
        ref = reference.compressed_attention(q, kc_all, vc_all, block=8, stride=4)[:, t:t + 1]
        assert rel_err(adapter.compressed(call), ref) < 1e-9 if ref.norm() > 0 else adapter.compressed(call).abs().max() == 0


def test_fa2_limits_are_reported_not_papered_over():
    from nsa.backends import _fa2_common
    q, k, v = qkv(1, 8, 2, 2, 16, 8)
    reason = _fa2_common.unsupported_reason(AttnCall("sliding", q, k, v, 0.25, window=4))
    assert reason is not None and "CUDA" in reason
