"""The compressed branch through FlashAttention-3 (nsa/backends/triton_kernels/fa3_cmp.py) on a CPU:
the packing (queries of one compressed step as the heads of one query, the keys tiled per step
offset) against the Triton one-pass kernel and the fp64 oracle, with a pure-torch double of the
wheel's `_flash_attn_forward` installed. The real wheel runs in the GPU tests
(tests/nsa/test_fa3_cmp.py on the device, bf16, dk 128)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from nsa import ops, reference
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import fa3_cmp
from tests.bench import fa3_doubles
from tests.nsa.helpers import DEV, qkv, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")


@pytest.fixture
def fa3(monkeypatch):
    """The wheel where it is installed (a CUDA machine with fa3-fwd), else the double on CPU
    tensors; yields the double's call log (empty with the real wheel)."""
    calls: list[dict] = []
    if DEV == "cpu" or fa3_cmp.load() is None:
        if DEV == "cuda":
            pytest.skip("fa3-fwd is not installed on this CUDA machine")
        monkeypatch.setitem(sys.modules, fa3_cmp.MODULE,
                            fa3_doubles.fake_module(calls, dtypes=(torch.bfloat16, torch.float32)))
        monkeypatch.setattr(fa3_cmp, "DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(fa3_cmp, "DTYPES", (torch.bfloat16, torch.float32))
    yield calls


def _with_fa3(on: bool, min_group: int = 1, g1: bool = True, min_work: int = 0):
    base = triton_nsa.current_tiles(DEV)
    return triton_nsa.use_tiles(dataclasses.replace(base, cmp_fa3=on, cmp_fa3_min_group=min_group, cmp_fa3_g1=g1,
                                                    cmp_fa3_min_work=min_work))


@pytest.mark.parametrize(("b", "t", "hq", "hkv", "d"), [(2, 77, 4, 2, 64), (1, 64, 8, 8, 64), (2, 78, 4, 4, 64),
                                                         (1, 90, 16, 1, 128)],
                         ids=["B2-T77-G2-tail2", "B1-T64-G1-notail", "B2-T78-G1-tail3", "B1-T90-G16-tail3"])
def test_fa3_compressed_output_and_scores(b, t, hq, hkv, d, seed, fa3):
    """Output, log-sum-exp (through the scores) and the calls FA-3 gets: G > 1, one packed call of
    `(T - l + 1) // d` steps of `d * Hq` heads over `d * Hkv` tiled key heads; G = 1, one call
    per sequence with the KV heads as batch, `d` heads over one KV head, no tiling; causal,
    writing into the output's own slice; the first l - 1 queries see nothing; a partial last
    step (T77: 2 queries, T78 and T90: 3) goes to the Triton kernel."""
    block, stride, sel = 8, 4, 16
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32   # the interpreter's bf16 dots are wrong
    q, k, v = qkv(b, t, hq, hkv, d, d, dtype=dtype, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    kw = dict(block=block, stride=stride, sel_block=sel, scale=d ** -0.5)
    with _with_fa3(True):
        o, s = triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    with _with_fa3(False):
        o_ref, s_ref = triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    want = reference.compressed_attention(q.double(), kc.double(), vc.double(), block=block, stride=stride)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(o, want) < tol and rel_err(o_ref, want) < tol
    assert torch.equal(o[:, :block - 1], torch.zeros_like(o[:, :block - 1]))
    assert torch.allclose(s, s_ref, rtol=2e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-6), \
        float((s - s_ref).abs().max())
    if fa3:   # the double's log
        steps = (t - block + 1) // stride
        if hq == hkv:
            assert [c["fn"] for c in fa3] == ["_flash_attn_forward"] * b
            assert all(c["q_shape"] == (hq, steps, stride, d) and c["k_shape"] == (hkv, steps, 1, d) for c in fa3)
        else:
            assert [c["fn"] for c in fa3] == ["_flash_attn_forward"]
            assert fa3[0]["q_shape"] == (b, steps, stride * hq, d) and fa3[0]["k_shape"] == (b, steps, stride * hkv, d)
        assert all(c["causal"] and c["out_"] for c in fa3)


def test_fa3_only_where_the_gpu_profile_has_it(fake_gpu):
    """sm90 with the wheel installed, where the trade was measured; sm90 without it, an A100 (8, 0)
    or a Blackwell (10, 0) (no profile file: generic) keep the Triton pass; CPU tensors (the double) pass."""
    for cap, wheels, ok in (((9, 0), True, True), ((9, 0), False, False), ((8, 0), True, False),
                            ((10, 0), True, False)):
        fake_gpu(cap, wheels=wheels)
        assert fa3_cmp.enabled(torch.device("cuda", 0)) is ok
    assert fa3_cmp.enabled(torch.device("cpu"))


def test_fa3_compressed_not_used_where_it_cannot_run(seed, fa3):
    """fp16, chunked prefill (q_start > 0), too few queries for one whole step, a GQA group below
    `Tiles.cmp_fa3_min_group`, G = 1 with `Tiles.cmp_fa3_g1` off, or the tile switched off: the
    Triton kernel alone."""
    block, stride = 8, 4
    q, k, v = qkv(1, 40, 4, 2, 64, 64, dtype=torch.bfloat16, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    assert not fa3_cmp.usable(q.half(), kc.half(), vc.half(), block=block, stride=stride, q_start=0)
    assert not fa3_cmp.usable(q[..., :48], kc[..., :48], vc, block=block, stride=stride, q_start=0)
    assert not fa3_cmp.usable(q[:, 20:], kc, vc, block=block, stride=stride, q_start=20)
    assert not fa3_cmp.usable(q[:, :10], kc, vc, block=block, stride=stride, q_start=0)
    assert fa3_cmp.usable(q[:, :11], kc, vc, block=block, stride=stride, q_start=0)
    assert not fa3_cmp.usable(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, block=block, stride=stride,
                              q_start=0), "heads-major q: the packed view needs token-major rows"
    x = (q, kc, vc) if DEV == "cuda" else (q.float(), kc.float(), vc.float())
    for on, min_group in ((False, 1), (True, 4)):   # off; on, but G = 2 < 4
        with _with_fa3(on, min_group):
            triton_nsa.compressed_and_scores(*x, block=block, stride=stride, sel_block=16, scale=0.125)
    q1 = x[0][:, :, :2].contiguous()   # 2 heads over 2 KV heads: G = 1
    with _with_fa3(True, 4, g1=False):
        triton_nsa.compressed_and_scores(q1, *x[1:], block=block, stride=stride, sel_block=16, scale=0.125)
    assert not fa3


def test_fa3_compressed_only_from_its_work_floor(seed, fa3, monkeypatch):
    """`Tiles.cmp_fa3_min_work`: a prefill with B * Hq * T**2 (here 2 * 4 * 40**2 = 12800) under the
    floor keeps the Triton pass (small calls are bound by the host, where FA-3's call costs more
    than it saves), one of exactly the floor takes FA-3, the default floor keeps it off FA-3;
    the scores agree within the FA-3 tolerance. FA-3's entry point is spied (the real wheel on
    the GPU logs nothing itself)."""
    entered = []
    real = fa3_cmp.output_and_lse
    monkeypatch.setattr(fa3_cmp, "output_and_lse", lambda *a, **kw: entered.append(1) or real(*a, **kw))
    block, stride = 8, 4
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, k, v = qkv(2, 40, 4, 2, 64, 64, dtype=dtype, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    kw = dict(block=block, stride=stride, sel_block=16, scale=0.125)
    with _with_fa3(True, min_work=12801):
        _, s_off = triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    with triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles(DEV), cmp_fa3_min_group=1)):
        assert triton_nsa.current_tiles(DEV).cmp_fa3_min_work > 12800
        triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    assert entered == [] and fa3 == []
    with _with_fa3(True, min_work=12800):
        _, s_on = triton_nsa.compressed_and_scores(q, kc, vc, **kw)
    assert entered == [1]
    assert torch.allclose(s_on, s_off, rtol=2e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_fa3_is_a_declared_forward_only_backend(seed, fa3):
    """`backend="fa3"` names FA-3 for the compressed branch: forward output as the oracle's (the
    double's log shows the wheel was called, a partial last step on the Triton kernel); a call that
    needs gradients raises BackendError naming the missing backward and the fix, and `auto` never
    plans it (no key names it, and its declaration has no backward)."""
    from nsa import NSAAttention, NSAConfig, backends, dispatch
    from nsa.backends import BackendError

    assert backends.capabilities("fa3").backward == frozenset()
    assert backends.capabilities("fa3").forward == frozenset({"compressed"})
    block, stride = 8, 4
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, k, v = qkv(1, 78, 4, 2, 64, 64, dtype=dtype, device=DEV)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    with torch.no_grad():
        o = ops.compressed_attention(q, kc, vc, block=block, stride=stride, backend="fa3")
    want = reference.compressed_attention(q.double(), kc.double(), vc.double(), block=block, stride=stride)
    assert rel_err(o, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if DEV == "cpu":
        assert [c["fn"] for c in fa3] == ["_flash_attn_forward"]
    qg = q.clone().requires_grad_()
    with pytest.raises(BackendError, match=r"fa3.*no backward.*torch.no_grad"):
        ops.compressed_attention(qg, kc, vc, block=block, stride=stride, backend="fa3")
    with pytest.raises(BackendError, match=r"backend 'fa3' cannot run the compressed branch \(cmp\).*no backward"):
        dispatch.plan(NSAAttention(NSAConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim_qk=64, head_dim_v=64,
                                             cmp_block=block, cmp_stride=stride, sel_block=16),
                                   backend={"cmp": "fa3"}).to(DEV, dtype)._calls(
            qg, {n: (k, v) for n in ("cmp", "sel", "win")}, kc, vc, ("cmp",), 0, grad=True), {"cmp": "fa3"})
    why = backends.unsupported_reason("fa3", backends.AttnCall("compressed", q[:, 20:], kc, vc, 0.125, q_start=20,
                                                               block=block, stride=stride))
    assert why is not None and "q_start == 0" in why


def test_fa3_unavailable_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fa3_cmp, "load", lambda: None)
    from nsa import backends
    why = backends.unavailable_reason("fa3", "cuda")
    assert "pip install fa3-fwd" in why and "training plans never use it" in why
