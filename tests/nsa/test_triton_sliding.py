"""The Triton sliding-window (band) kernel against the fp64 oracle: on CUDA, or on CPU under
TRITON_INTERPRET=1; with `Tiles.win_fa4` off, so a GPU with FA-4 installed still tests it.

Outputs are poisoned with NaN before every run, so an element the kernel never writes fails
`rel_err` (which rejects NaN) instead of passing on whatever memory held.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa import ops, reference
from nsa.backends import AttnCall, triton_nsa
from nsa.backends.triton_kernels import common
from tests.nsa.helpers import DEV, qkv, rel_err

pytestmark = pytest.mark.skipif(
    triton_nsa.unavailable_reason(DEV) is not None,
    reason=f"triton backend unavailable: {triton_nsa.unavailable_reason(DEV)} (CPU: TRITON_INTERPRET=1)")

# (B, T, Hq, Hkv, dk, dv, window): GQA 1/4/16; T not a multiple of the 16-key tiles used under the
# interpreter; windows longer than T, shorter than a tile, and window 1 (the query itself).
CASES = [
    (1, 37, 4, 4, 16, 16, 20),
    (2, 70, 8, 2, 16, 8, 5),
    (1, 45, 16, 1, 32, 16, 100),
    (1, 7, 4, 1, 8, 24, 3),
    (2, 33, 2, 2, 16, 16, 1),
]
IDS = [f"B{c[0]}-T{c[1]}-Hq{c[2]}-Hkv{c[3]}-dk{c[4]}-dv{c[5]}-w{c[6]}" for c in CASES]


@pytest.fixture(autouse=True)
def band_kernel():
    """The band kernel, also where FA-4 is installed (`Tiles.win_fa4`; FA-4: tests/nsa/test_fa4_win.py)."""
    with triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles(DEV), win_fa4=False)):
        yield


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_filled(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(common, "empty_out", nan_filled)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_sliding_prefill_matches_oracle(case, seed):
    b, t, hq, hkv, dk, dv, w = case
    q, k, v = qkv(b, t, hq, hkv, dk, dv, device=DEV)
    out = ops.sliding_window_attention(q, k, v, window=w, backend="triton")
    assert rel_err(out, reference.sliding_window_attention(q, k, v, window=w)) < 1e-5


@pytest.mark.parametrize("case", CASES[:3], ids=IDS[:3])
def test_triton_sliding_decode_and_chunks_match_oracle(case, seed):
    """Decode: one query at t over the last min(w, t + 1) keys (k_start = t + 1 - n), early steps
    (t < w) included; a chunked prefill: queries from q_start over all keys from 0."""
    b, t_len, hq, hkv, dk, dv, w = case
    q, k, v = qkv(b, t_len, hq, hkv, dk, dv, device=DEV)
    ref = reference.sliding_window_attention(q, k, v, window=w)
    for t in sorted({0, min(w, t_len) - 1, t_len // 2, t_len - 1}):
        n = min(w, t + 1)
        k0 = t + 1 - n
        o = ops.sliding_window_attention(q[:, t:t + 1], k[:, k0:t + 1], v[:, k0:t + 1], window=w, backend="triton",
                                         q_start=t, k_start=k0)
        assert rel_err(o, ref[:, t:t + 1]) < 1e-5, f"decode step t={t}"
    start = t_len // 3
    o = ops.sliding_window_attention(q[:, start:], k, v, window=w, backend="triton", q_start=start)
    assert rel_err(o, ref[:, start:]) < 1e-5


def test_triton_sliding_fp16_within_twice_torch_error(seed):
    """fp16 (tensor-core path on a GPU): error against the fp64 oracle at most 2x that of PyTorch's
    own fp16 attention (SDPA with a band mask) on the same inputs."""
    q, k, v = qkv(1, 61, 8, 2, 32, 32, dtype=torch.float16, device=DEV)
    ref = reference.sliding_window_attention(q, k, v, window=24)
    ours = ops.sliding_window_attention(q, k, v, window=24, backend="triton")
    base = ops.sliding_window_attention(q, k, v, window=24, backend="sdpa")
    assert rel_err(ours, ref) <= 2 * rel_err(base, ref) + 1e-4


def test_triton_sliding_is_supported_and_says_why_not():
    q, k, v = qkv(1, 4, 4, 1, 192, 128, device=DEV)
    assert triton_nsa.unsupported_reason(AttnCall("sliding", q, k, v, 1.0, window=512)) is None
    reason = triton_nsa.unsupported_reason(AttnCall("sliding", q, k, v, 1.0, window=None))
    assert reason is not None and "window" in reason


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tensor-core path needs CUDA")
@pytest.mark.gpu
def test_triton_sliding_bf16_paper_dims_on_gpu(seed):
    """bf16, the paper's dk=192 / dv=128 (FA-2 cannot take them), w=512, GQA 16, T not a multiple
    of any tile: within 2x SDPA's error; decode rows from a window cache equal the prefill rows."""
    q, k, v = qkv(2, 1500, 16, 1, 192, 128, dtype=torch.bfloat16, device=DEV)
    ref = reference.sliding_window_attention(q, k, v, window=512)
    ours = ops.sliding_window_attention(q, k, v, window=512, backend="triton")
    base = ops.sliding_window_attention(q, k, v, window=512, backend="sdpa")
    assert rel_err(ours, ref) <= 2 * rel_err(base, ref) + 1e-6
    t = 1499
    o = ops.sliding_window_attention(q[:, t:], k[:, t - 511:], v[:, t - 511:], window=512, backend="triton",
                                     q_start=t, k_start=t - 511)
    assert rel_err(o, ref[:, t:]) <= 2 * rel_err(base[:, t:], ref[:, t:]) + 1e-6


def test_a_sequence_past_32_bit_offsets_is_refused_in_the_forward():
    """The forward kernels index rows within a sequence in int32: a call whose q, K/V or output
    spans more than 2^31 - 1 elements per sequence is refused with the reason (meta tensors: nothing
    is allocated); the same call with gradients (int64 training kernels) and a smaller one pass."""
    big = 2 ** 31 // (64 * 128) + 1                     # rows of 64 heads x 128 past 2^31 elements
    q = torch.empty(1, big, 64, 128, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(1, big, 4, 128, device="meta", dtype=torch.bfloat16)
    reason = triton_nsa.unsupported_reason(AttnCall("sliding", q, k, v, 1.0, window=512))
    assert "32 bits" in reason and "q spans" in reason and "another backend" in reason
    assert triton_nsa.unsupported_reason(AttnCall("sliding", q, k, v, 1.0, window=512, grad=True)) is None
    small = torch.empty(1, big - 2, 64, 128, device="meta", dtype=torch.bfloat16)
    assert triton_nsa.unsupported_reason(AttnCall("sliding", small, k[:, :big - 2], v[:, :big - 2], 1.0, window=512)) is None
    wide = torch.empty(1, 4, 64, 128, device="meta", dtype=torch.bfloat16)
    long_kv = torch.empty(1, 2 ** 31 // (4 * 128) + 1, 4, 128, device="meta", dtype=torch.bfloat16)
    assert "k spans" in triton_nsa.unsupported_reason(AttnCall("sliding", wide, long_kv, long_kv, 1.0, window=512))
