"""FA-2 parity suite (GPU): every backend, every op, against the fp64 oracle and masked SDPA.

Run: `NSA_TEST_FA2=1 pytest -k fa2_parity` or `pytest -m gpu` (skipped without CUDA).
Criteria: fp32 mean abs error <= 5e-5 against fp64; fp16/bf16 error against fp64 at most 2x that
of same-dtype masked SDPA on the same inputs (plus 1e-6 absolute, for errors at rounding level).
Set NSA_PARITY_LOG=path to append one JSON line per check (per-op max error per backend).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nsa import backends, ops, reference
from nsa.backends import AttnCall, BackendError

pytestmark = pytest.mark.gpu
DEV = "cuda"
BACKENDS = ("sdpa", "fa2", "flex")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, T, Hq, Hkv, dk, dv): T not a multiple of 8, GQA 1/4/16, head dims 64/128/192, dk != dv.
SHAPES = [
    (2, 37, 4, 4, 64, 64),
    (1, 131, 8, 2, 128, 128),
    (1, 203, 16, 1, 64, 64),
    (1, 77, 4, 1, 192, 192),
    (2, 61, 4, 2, 192, 128),
]
SHAPE_IDS = [f"B{s[0]}-T{s[1]}-Hq{s[2]}-Hkv{s[3]}-dk{s[4]}-dv{s[5]}" for s in SHAPES]
CMP = dict(block=16, stride=8)


def _log(**rec) -> None:
    path = os.environ.get("NSA_PARITY_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def _inputs(shape, dtype):
    b, t, hq, hkv, dk, dv = shape
    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(3), "little"))
    mk = lambda *s: torch.randn(*s, device=DEV, generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(b, t, hq, dk), mk(b, t, hkv, dk), mk(b, t, hkv, dv)


def _check(op, backend, shape, dtype_name, run, ref):
    """Run `run(backend)` and `run("sdpa")`, compare both with the fp64 `ref`."""
    out = run(backend).double().cpu()
    assert not torch.isnan(out).any(), f"{backend} {op} produced NaN"
    base = run("sdpa").double().cpu()
    err = (out - ref).abs()
    base_err = (base - ref).abs()
    if dtype_name == "fp32":
        tol = 5e-5
        passed = float(err.mean()) <= tol
    else:
        tol = 2 * float(base_err.max()) + 1e-6
        passed = float(err.max()) <= tol
    _log(op=op, backend=backends.resolve(backend, DEV), shape=shape, dtype=dtype_name,
         max_abs_err=float(err.max()), mean_abs_err=float(err.mean()), sdpa_max_abs_err=float(base_err.max()),
         vs_sdpa_max_abs=float((out - base).abs().max()), tol=tol, passed=passed)
    assert passed, f"{backend} {op} {dtype_name}: max err {float(err.max()):.3g} mean {float(err.mean()):.3g} tol {tol:.3g}"


def _unsupported(backend, call: AttnCall) -> str | None:
    """None if `backend` runs `call`; else its reason, after checking that an explicit call raises."""
    reason = backends.unsupported_reason(backend, call)
    if reason is not None:
        # The limit must be one of the documented kinds, never a crash.
        assert any(s in reason for s in ("dk == dv", "fp16/bf16", "fp64", "does not implement", "head dim")), reason
        with pytest.raises(BackendError, match="cannot run"):
            backends.run(backend, call)
        _log(op=call.op, backend=backends.resolve(backend, DEV), dtype=str(call.q.dtype), unsupported=reason)
    return reason


def _each_backend(op, shape, dtype_name, call, run, ref, names=BACKENDS):
    """One fp64 oracle per case, every backend checked against it (and against sdpa)."""
    ran = []
    for backend in names:
        if _unsupported(backend, call) is None:
            _check(op, backend, shape, dtype_name, run, ref)
            ran.append(backend)
    assert "sdpa" in ran


# Windows: smaller than T, and larger than every T (covers the whole causal prefix).
@pytest.mark.parametrize("window", [16, 4096])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fa2_parity_sliding(shape, dtype_name, window):
    q, k, v = _inputs(shape, DTYPES[dtype_name])
    ref = reference.sliding_window_attention(q, k, v, window=window)
    _each_backend("sliding", shape, dtype_name, AttnCall("sliding", q, k, v, 1.0, window=window),
                  lambda b: ops.sliding_window_attention(q, k, v, window=window, backend=b), ref)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fa2_parity_compressed(shape, dtype_name):
    q, k, v = _inputs(shape, DTYPES[dtype_name])
    kc, vc = ops.compress_kv(k, v, **CMP)
    ref = reference.compressed_attention(q, kc, vc, **CMP)
    _each_backend("compressed", shape, dtype_name, AttnCall("compressed", q, kc, vc, 1.0, **CMP),
                  lambda b: ops.compressed_attention(q, kc, vc, backend=b, **CMP), ref)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fa2_parity_selected(shape, dtype_name):
    q, k, v = _inputs(shape, DTYPES[dtype_name])
    kc, _ = ops.compress_kv(k, v, **CMP)
    idx = ops.select_blocks(q, kc, sel_block=32, sel_count=3, **CMP)
    ref = reference.selected_attention(q, k, v, idx, sel_block=32)
    _each_backend("selected", shape, dtype_name,
                  AttnCall("selected", q, k, v, 1.0, sel_block=32, block_indices=idx),
                  lambda b: ops.selected_attention(q, k, v, idx, sel_block=32, backend=b), ref,
                  names=("sdpa", "fa2", "flex"))


@pytest.mark.parametrize("backend", ["fa2", "flex"])
def test_fa2_parity_decode_alignment(backend):
    """A decode step (one query at t, keys from a cache) on the real kernels."""
    q, k, v = _inputs((2, 300, 8, 2, 64, 64), torch.bfloat16)
    w = 64
    ref_w = reference.sliding_window_attention(q, k, v, window=w)
    kc_all, vc_all = ops.compress_kv(k, v, **CMP)
    ref_c = reference.compressed_attention(q, kc_all, vc_all, **CMP)
    for t in (0, 14, 15, 63, 64, 299):
        k0 = max(0, t - w + 1)
        o = ops.sliding_window_attention(q[:, t:t + 1], k[:, k0:t + 1], v[:, k0:t + 1], window=w, backend=backend,
                                         q_start=t, k_start=k0)
        assert (o.double().cpu() - ref_w[:, t:t + 1]).abs().max() < 2e-2, f"sliding t={t}"
        kc, vc = ops.compress_kv(k[:, :t + 1], v[:, :t + 1], **CMP)
        o = ops.compressed_attention(q[:, t:t + 1], kc, vc, backend=backend, q_start=t, **CMP)
        assert (o.double().cpu() - ref_c[:, t:t + 1]).abs().max() < 2e-2, f"compressed t={t}"


def test_fa2_parity_layout_mixup_is_loud():
    """A [B, H, T, D] tensor where [B, T, H, D] is expected raises (non-square shapes)."""
    q, k, v = _inputs((1, 96, 8, 2, 64, 64), torch.bfloat16)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
            ops.sliding_window_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=16,
                                         backend=backend)
        with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
            ops.sliding_window_attention(q, k.transpose(1, 2), v.transpose(1, 2), window=16, backend=backend)
