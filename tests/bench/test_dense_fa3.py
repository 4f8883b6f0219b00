"""The FlashAttention-3 dense baseline (bench/dense_fa3.py) on a CPU: its adapter against a pure-torch
double of the `fa3-fwd` interface (layout, causal, GQA, kvcache arguments), the reasons it is skipped,
and its variant in the prefill, fast and decode suites."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import dense_fa3
from bench.cases import Cell
from bench.suites import decode, fast, prefill
from nsa import reference
from tests.bench import fa3_doubles
from tests.nsa.helpers import qkv, rel_err

CPU = torch.device("cpu")


@pytest.fixture
def fa3(monkeypatch):
    """The double installed as `fa3_fwd_interface`, CPU tensors allowed; yields its call log."""
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, dense_fa3.MODULE, fa3_doubles.fake_module(calls))
    monkeypatch.setattr(dense_fa3, "DEVICES", ("cuda", "cpu"))
    return calls


@pytest.fixture
def no_fa3(monkeypatch):
    monkeypatch.setitem(sys.modules, dense_fa3.MODULE, None)   # import raises ImportError


@pytest.mark.parametrize("hq, hkv, dk, dv", [(4, 4, 64, 64), (8, 2, 128, 128), (16, 1, 192, 128)],
                         ids=["MHA", "GQA4", "GQA16-dk192-dv128"])
def test_prefill_adapter_is_dense_causal_gqa_in_bthd(fa3, hq, hkv, dk, dv, seed):
    q, k, v = qkv(2, 37, hq, hkv, dk, dv, dtype=torch.bfloat16)
    assert dense_fa3.reason(q, k, v) is None
    out = dense_fa3.prefill(dense_fa3.load(), q, k, v)
    assert out.shape == (2, 37, hq, dv)
    assert rel_err(out, reference.causal_attention(q, k, v)) < 1e-2
    assert fa3 == [{"fn": "flash_attn_func", "causal": True, "softmax_scale": None}]


def test_decode_adapter_reads_the_whole_cache(fa3, seed):
    q, k, v = qkv(3, 1, 8, 2, 128, 128, dtype=torch.bfloat16, tk=50)
    lengths = dense_fa3.cache_lengths(k)
    out = dense_fa3.decode(dense_fa3.load(), q, k, v, lengths, 0.1)
    # The step's query at t = 49 sees all 50 keys: the last row of causal attention over them.
    q_all = torch.cat([torch.zeros(3, 49, 8, 128, dtype=q.dtype), q], 1)
    ref = reference.causal_attention(q_all, k, v, scale=0.1)[:, -1:]
    assert rel_err(out, ref) < 1e-2
    assert fa3 == [{"fn": "flash_attn_with_kvcache", "causal": True, "softmax_scale": 0.1}]


def test_reasons_name_what_is_missing(no_fa3, monkeypatch):
    q, k, v = qkv(1, 8, 4, 2, 128, 128, dtype=torch.bfloat16)
    assert "pip install fa3-fwd" in dense_fa3.reason(q, k, v)
    monkeypatch.setattr(dense_fa3, "DEVICES", ("cuda", "cpu"))
    assert dense_fa3.unsupported_reason(q, k, v) is None
    assert "bf16 only" in dense_fa3.unsupported_reason(q.half(), k.half(), v.half())
    q2, k2, v2 = qkv(1, 8, 4, 2, 128, 64, dtype=torch.bfloat16)
    assert "head dims" in dense_fa3.unsupported_reason(q2, k2, v2)
    monkeypatch.setattr(dense_fa3, "DEVICES", ("cuda",))
    assert "CUDA" in dense_fa3.unsupported_reason(q, k, v)


def _prefill_cell(suite, variants, dk=64, dv=64):
    p = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": dk, "Dv": dv, "T": 40, "block": 16, "stride": 8, "sel_block": 16,
         "sel_count": 2, "window": 16, "kv": "separate", "dtype": "bf16"}
    return Cell(suite, "nsa_prefill", p, tuple(v for v in variants if v.op == "dense"))


def test_prefill_and_fast_suites_skip_fa3_with_the_reason_or_time_it(no_fa3, monkeypatch):
    for suite, variants in (("prefill", prefill.VARIANTS), ("fast", fast.SPECS[0].variants)):
        work = (prefill if suite == "prefill" else fast).build(_prefill_cell(suite, variants), CPU)
        assert "pip install fa3-fwd" in work.reasons["fa3"] and "fa3" not in work.fns
        assert work.backends["fa3"] == "fa3"
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, dense_fa3.MODULE, fa3_doubles.fake_module(calls))
    monkeypatch.setattr(dense_fa3, "DEVICES", ("cuda", "cpu"))
    work = prefill.build(_prefill_cell("prefill", prefill.VARIANTS), CPU)
    assert "fa3" not in work.reasons and work.extra["fa3"]["gqa"] == "native"
    out = work.fns["fa3"]()
    assert out.shape == (1, 40, 4, 64) and calls[-1]["causal"] is True
    # No kernel for dk=32: skipped with the wheel's head-dim rule, never run.
    work = prefill.build(_prefill_cell("prefill", prefill.VARIANTS, dk=32, dv=32), CPU)
    assert "head dims" in work.reasons["fa3"]


def test_decode_suite_fa3_variant(fa3, monkeypatch):
    layout = {"B": 2, "Hq": 4, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 64, "block": 16, "stride": 8,
              "sel_block": 16, "sel_count": 3, "window": 24}
    cell = decode.cells(layout, [60], "bf16")[0]
    cell = Cell(cell.suite, cell.op, cell.params, tuple(v for v in cell.variants if v.op == "dense"))
    work = decode.build(cell, CPU)
    assert "fa3" in work.fns, work.reasons
    assert work.extra["fa3"]["reads"] == {"total": 60}
    flash = work.fns["sdpa_flash"]()
    assert rel_err(work.fns["fa3"](), flash) < 1e-2
    assert fa3[-1]["fn"] == "flash_attn_with_kvcache"
    assert "fa3" in decode.DENSE and "ms_dense_fa3" in decode.EXTRA_COLUMNS
