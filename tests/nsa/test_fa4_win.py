"""The prefill window through FlashAttention-4 (nsa/backends/triton_kernels/fa4_win.py): on a CPU
with a pure-torch double of `flash_attn.cute.flash_attn_func` installed (the call FA-4 gets, the
result against the band kernel and the fp64 oracle, and every case that must keep the band
kernel); on a CUDA machine with the `flash-attn-4` wheel, the real kernels against the fp64
oracle for every head-dim pair `fa4_win` admits.

Outputs of the band kernel are poisoned with NaN (`common.empty_out`), so a result that silently
came from an unwritten band-kernel buffer fails `rel_err`."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from nsa import ops, reference
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import common, fa4_win, sliding
from tests.nsa.helpers import DEV, qkv, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")


def _fake_fa4(calls: list[dict]) -> types.ModuleType:
    """`flash_attn.cute` with FA-4's `flash_attn_func` signature in plain torch: causal with a left
    window `window_size[0]` (FA-4's local mask, keys `i - left .. i` for query i of equal-length
    q and k), GQA head h -> KV head h // G; returns (out in q's dtype, lse) and logs each call."""
    mod = types.ModuleType(fa4_win.MODULE)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), pack_gqa=None, **kw):
        calls.append({"q_shape": tuple(q.shape), "k_shape": tuple(k.shape), "v_shape": tuple(v.shape),
                      "scale": softmax_scale, "causal": causal, "window_size": tuple(window_size), "kw": kw})
        left = window_size[0]
        qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
        g = qd.shape[1] // kd.shape[1]
        kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
        s = qd @ kd.transpose(-1, -2) * softmax_scale
        i = torch.arange(q.shape[1])[:, None]
        j = torch.arange(k.shape[1])[None, :]
        keep = j <= i if causal else torch.ones_like(j <= i)
        if left is not None:
            keep = keep & (j >= i - left)
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
        out = (s.softmax(-1) @ vd).transpose(1, 2).to(q.dtype)
        return out, torch.logsumexp(s, -1).float()

    mod.flash_attn_func = flash_attn_func
    return mod


@pytest.fixture
def fa4(monkeypatch):
    """The wheel where it is installed (a CUDA machine with flash-attn-4), else the double on CPU
    tensors; yields the call log: `{"spy": True}` for each `fa4_win.sliding` call, then (the
    double only) what FA-4's function got."""
    calls: list[dict] = []
    real = fa4_win.sliding

    def spy(*args, **kwargs):
        calls.append({"spy": True})
        return real(*args, **kwargs)

    monkeypatch.setattr(fa4_win, "sliding", spy)
    if DEV == "cpu" or fa4_win.load() is None:
        if DEV == "cuda":
            pytest.skip("flash-attn-4 is not installed on this CUDA machine")
        monkeypatch.setitem(sys.modules, fa4_win.MODULE, _fake_fa4(calls))
        monkeypatch.setattr(fa4_win, "DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(fa4_win, "DTYPES", (torch.bfloat16, torch.float32))
    yield calls


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_filled(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(common, "empty_out", nan_filled)


def _with_fa4(on: bool, min_work: int = 0):
    return triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles(DEV), win_fa4=on,
                                                    win_fa4_min_work=min_work))


def _dtype():
    return torch.bfloat16 if DEV == "cuda" else torch.float32   # the interpreter's bf16 dots are wrong


@pytest.mark.parametrize(("b", "t", "hq", "hkv", "dk", "dv", "w"),
                         [(2, 77, 8, 2, 64, 64, 20), (1, 45, 16, 1, 64, 64, 100), (1, 40, 4, 4, 192, 128, 1)],
                         ids=["B2-T77-G4-w20", "B1-T45-G16-w>T", "B1-T40-G1-dk192-w1"])
def test_fa4_window_matches_band_kernel_and_oracle(b, t, hq, hkv, dk, dv, w, seed, fa4):
    """The `triton` sliding op with `win_fa4` on goes through FA-4 (one call: causal, window
    `(w - 1, 0)`, the given scale, the tensors as they are) and agrees with the band kernel and
    the fp64 oracle; windows shorter than T, longer than T, and of one key."""
    q, k, v = qkv(b, t, hq, hkv, dk, dv, dtype=_dtype(), device=DEV)
    scale = 0.3
    with _with_fa4(True):
        out = ops.sliding_window_attention(q, k, v, window=w, scale=scale, backend="triton")
    with _with_fa4(False):
        band = ops.sliding_window_attention(q, k, v, window=w, scale=scale, backend="triton")
    want = reference.sliding_window_attention(q, k, v, window=w, scale=scale)
    tol = 1e-2 if q.dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, want) < tol and rel_err(band, want) < tol
    assert fa4[0] == {"spy": True}
    if len(fa4) > 1:   # the double's log
        assert len(fa4) == 2
        got = fa4[1]
        assert got["q_shape"] == (b, t, hq, dk) and got["k_shape"] == (b, t, hkv, dk)
        assert got["causal"] and got["window_size"] == (w - 1, 0) and got["scale"] == scale


def test_fa4_window_not_used_where_it_cannot_run(seed, fa4, monkeypatch):
    """The band kernel, and no FA-4 call, for: `win_fa4` off, a chunked prefill (q_start > 0), a
    decode-like call over a key suffix (k_start > 0), as many queries as keys but starting later
    (FA-4 would align them), fewer queries than keys, keys after every query, a head-dim pair
    FA-4 was not checked with, a dtype outside its list, and a GPU other than sm90."""
    dt = _dtype()
    q, k, v = qkv(1, 40, 4, 2, 64, 64, dtype=dt, device=DEV)
    want = reference.sliding_window_attention(q, k, v, window=9)
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5

    def check(out, ref):
        assert rel_err(out, ref) < tol

    with _with_fa4(False):
        check(ops.sliding_window_attention(q, k, v, window=9, backend="triton"), want)
    with _with_fa4(True):
        check(ops.sliding_window_attention(q[:, 13:], k, v, window=9, backend="triton", q_start=13), want[:, 13:])
        check(ops.sliding_window_attention(q[:, 30:], k[:, 22:], v[:, 22:], window=9, backend="triton",
                                           q_start=30, k_start=22), want[:, 30:])
        # as many queries as keys, but the queries start later: FA-4 would align query i with key i
        check(ops.sliding_window_attention(q[:, 5:], k[:, :35], v[:, :35], window=9, backend="triton", q_start=5),
              reference.sliding_window_attention(q[:, 5:], k[:, :35], v[:, :35], window=9, q_start=5))
        # fewer queries than keys from 0 (the later keys are in the future), and keys that start
        # after every query (nothing visible: zeros); FA-4 aligns the last query with the last key
        # (ops refuses that shape in a prefill; the kernel family's entry point takes it)
        check(sliding.sliding(q[:, :30], k, v, window=9, scale=64 ** -0.5, q_start=0, k_start=0,
                              tiles=triton_nsa.current_tiles(DEV)), want[:, :30])
        none = ops.sliding_window_attention(q[:, :18], k[:, 22:], v[:, 22:], window=9, backend="triton", k_start=22)
        assert torch.equal(none, torch.zeros_like(none))
        q2, k2, v2 = qkv(1, 24, 4, 2, 32, 32, dtype=dt, device=DEV)
        check(ops.sliding_window_attention(q2, k2, v2, window=5, backend="triton"),
              reference.sliding_window_attention(q2, k2, v2, window=5))
        q16, k16, v16 = (x.half() for x in (q, k, v))
        assert not fa4_win.usable(q16, k16, v16, window=9, q_start=0, k_start=0)
        if DEV == "cpu":
            # On the GPU its profile decides; here a double says "no fa4 feature".
            monkeypatch.setattr(fa4_win, "enabled", lambda device: False)
            assert not fa4_win.usable(q, k, v, window=9, q_start=0, k_start=0)
    assert fa4 == []


def test_fa4_only_where_the_gpu_profile_has_it(fake_gpu):
    """sm90 with the wheel passes; sm90 without it, or any other CUDA capability, keeps the band
    kernel; CPU tensors (the double) pass."""
    fake_gpu((9, 0))
    assert fa4_win.enabled(torch.device("cuda", 0))
    fake_gpu((9, 0), wheels=False)
    assert not fa4_win.enabled(torch.device("cuda", 0))
    fake_gpu((10, 0))
    assert not fa4_win.enabled(torch.device("cuda", 0))
    assert fa4_win.enabled(torch.device("cpu"))


def test_fa4_load_is_none_without_the_wheel(monkeypatch):
    """Not installed (the import raises), or a module without `flash_attn_func`: None, and
    `sliding` says to check `usable` first."""
    monkeypatch.setitem(sys.modules, fa4_win.MODULE, None)   # `import` raises ImportError
    assert fa4_win.load() is None
    monkeypatch.setitem(sys.modules, fa4_win.MODULE, types.ModuleType(fa4_win.MODULE))
    assert fa4_win.load() is None
    q, k, v = qkv(1, 4, 2, 2, 64, 64)
    with pytest.raises(RuntimeError, match="usable"):
        fa4_win.sliding(q, k, v, window=2, scale=1.0)


@pytest.mark.skipif(DEV != "cuda", reason="the real FA-4 kernels need CUDA and the flash-attn-4 wheel")
@pytest.mark.gpu
@pytest.mark.parametrize(("dk", "dv"), sorted(fa4_win._DIMS))
def test_fa4_window_bf16_every_head_dim_pair_on_gpu(dk, dv, seed, fa4):
    """The wheel's kernels for each admitted (dk, dv): B = 2, GQA 4, T not a multiple of any
    tile, w = 512 and w = 100: within 2x SDPA's error of the fp64 oracle, and within 2x of the
    band kernel's own error (itself within 2x SDPA's)."""
    q, k, v = qkv(2, 1111, 8, 2, dk, dv, dtype=torch.bfloat16, device=DEV)
    assert fa4_win.usable(q, k, v, window=512, q_start=0, k_start=0)
    for w in (512, 100):
        want = reference.sliding_window_attention(q, k, v, window=w)
        with _with_fa4(True):
            out = ops.sliding_window_attention(q, k, v, window=w, backend="triton")
        with _with_fa4(False):
            band = ops.sliding_window_attention(q, k, v, window=w, backend="triton")
        base = ops.sliding_window_attention(q, k, v, window=w, backend="sdpa")
        err, err_band, err_base = rel_err(out, want), rel_err(band, want), rel_err(base, want)
        assert err <= 2 * err_base + 1e-6 and err <= 2 * err_band + 1e-6, (w, err, err_band, err_base)
        assert err_band <= 2 * err_base + 1e-6, (w, err_band, err_base)


def test_fa4_load_silences_only_the_cute_dsl_compile_warning(monkeypatch):
    """FA-4's compile warns that its `aux_data` argument is no JIT argument (one UserWarning per
    compile); the first successful `load` filters that message, and nothing else."""
    import warnings

    monkeypatch.setitem(sys.modules, fa4_win.MODULE, _fake_fa4([]))
    monkeypatch.setattr(fa4_win, "_QUIET", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fa4_win.load() is not None and fa4_win.load() is not None
        warnings.warn("Argument aux_data (position 17) cannot be converted to a JitArgument for function 'f'",
                      UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning"]
    assert fa4_win._QUIET == [True]


def test_fa4_window_only_from_its_work_floor(seed, fa4):
    """`Tiles.win_fa4_min_work`: a prefill with B * Hq * T**2 (here 2 * 4 * 40**2 = 12800) under the
    floor keeps the band kernel (small calls are bound by the host, where FA-4's call costs more
    than it saves), one of exactly the floor takes FA-4, the default floor keeps the band kernel;
    both agree with the oracle."""
    q, k, v = qkv(2, 40, 4, 2, 64, 64, dtype=_dtype(), device=DEV)
    want = reference.sliding_window_attention(q, k, v, window=9)
    tol = 1e-2 if q.dtype == torch.bfloat16 else 1e-5
    with _with_fa4(True, min_work=12801):
        assert rel_err(ops.sliding_window_attention(q, k, v, window=9, backend="triton"), want) < tol
    with triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles(DEV), win_fa4=True)):
        assert triton_nsa.current_tiles(DEV).win_fa4_min_work > 12800
        assert rel_err(ops.sliding_window_attention(q, k, v, window=9, backend="triton"), want) < tol
    assert fa4 == []
    with _with_fa4(True, min_work=12800):
        assert rel_err(ops.sliding_window_attention(q, k, v, window=9, backend="triton"), want) < tol
    assert fa4[0] == {"spy": True}


def test_fa4_is_a_declared_forward_only_backend(seed, fa4):
    """`backend="fa4"` names FA-4 for the window: forward output as the oracle's (through FA-4's
    function); a call that needs gradients raises BackendError naming the missing backward; a
    decode-like call (q_start > 0) is refused with the reason."""
    from nsa import backends
    from nsa.backends import BackendError

    assert backends.capabilities("fa4").backward == frozenset()
    q, k, v = qkv(1, 45, 4, 2, 64, 64, dtype=_dtype(), device=DEV)
    with torch.no_grad():
        o = ops.sliding_window_attention(q, k, v, window=9, backend="fa4")
    want = reference.sliding_window_attention(q.double(), k.double(), v.double(), window=9)
    assert rel_err(o, want) < (1e-2 if DEV == "cuda" else 1e-5)
    assert any(c.get("spy") for c in fa4)
    with pytest.raises(BackendError, match=r"fa4.*no backward"):
        ops.sliding_window_attention(q.clone().requires_grad_(), k, v, window=9, backend="fa4")
    why = backends.unsupported_reason("fa4", backends.AttnCall("sliding", q[:, -1:], k, v, 0.125, q_start=44,
                                                               window=9))
    assert why is not None and "whole prefill" in why
