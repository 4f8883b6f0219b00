"""The sdpa backend's long-sequence paths (query chunks; gathered selected blocks) against the fp64
oracle and the short full-mask path, and the promise that at T >= 8k nothing T x T is created."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nsa import NSAAttention, NSAConfig, ops, reference
from nsa.backends import sdpa
from tests.nsa.helpers import qkv, rand, rel_err

# (B, T, Hq, Hkv, dk, dv): T < l, T < w, T not a multiple of any block or chunk; GQA 1, 4, 16; dk != dv.
SHAPES = [
    (2, 7, 4, 1, 16, 8),
    (1, 37, 4, 4, 8, 12),
    (2, 70, 16, 1, 8, 8),
    (1, 101, 8, 2, 16, 24),
]
IDS = [f"B{s[0]}-T{s[1]}-Hq{s[2]}-Hkv{s[3]}-dk{s[4]}-dv{s[5]}" for s in SHAPES]
BR = dict(block=8, stride=4, sel_block=16, sel_count=4)
CHUNK = 5  # queries per chunk forced below: divides none of the T above, nor the blocks


@pytest.fixture
def long_path(monkeypatch):
    """Force the chunked paths at small T: no whole-sequence mask; `set_chunk(per_query)` makes a
    chunk CHUNK queries for an op whose chunk costs `per_query` elements per query."""
    monkeypatch.setattr(sdpa, "FULL_MASK_ELEMENTS", 0)

    def set_chunk(per_query: int) -> None:
        monkeypatch.setattr(sdpa, "CHUNK_ELEMENTS", CHUNK * per_query)
    return set_chunk


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("window", [1, 6, 16, 1000])
def test_chunked_sliding_matches_oracle(shape, window, long_path, seed):
    b, t, hq, *_ = shape
    q, k, v = qkv(*shape)
    long_path(b * hq * (CHUNK + window - 1))
    assert sdpa.sliding_chunk(b, hq, t, window) == min(CHUNK, t)
    out = ops.sliding_window_attention(q, k, v, window=window, backend="sdpa")
    assert rel_err(out, reference.sliding_window_attention(q, k, v, window=window)) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_chunked_compressed_matches_oracle(shape, long_path, seed):
    b, t, hq, *_ = shape
    q, k, v = qkv(*shape)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    long_path(b * hq * kc.shape[1])
    out = ops.compressed_attention(q, kc, vc, block=8, stride=4, backend="sdpa")
    ref = reference.compressed_attention(q, kc, vc, block=8, stride=4)
    assert rel_err(out, ref) < 1e-5 if ref.norm() > 0 else out.abs().max() == 0
    assert out[:, :7].abs().max() == 0, "queries with no complete block must get exactly 0"


def _sel_per_query(shape: tuple[int, ...], n: int, sel_block: int) -> int:
    b, _, hq, hkv, dk, dv = shape
    return b * n * sel_block * (hkv * (dk + dv + 4) + hq)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_chunked_selected_matches_oracle(shape, long_path, seed):
    q, k, v = qkv(*shape)
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)
    long_path(_sel_per_query(shape, 4, 16))
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="sdpa")
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5


def test_chunked_selected_padding_duplicates_and_empty_rows(long_path, seed):
    # Random block lists: -1 slots, repeated blocks, blocks ahead of the query (masked by
    # causality), and rows with no slot at all, which must give exactly 0.
    shape = (2, 83, 8, 2, 8, 12)
    b, t, _, hkv, *_ = shape
    q, k, v = qkv(*shape)
    n_blocks = (t + 15) // 16
    idx = torch.randint(-1, n_blocks, (b, t, hkv, 5))
    idx[:, :, :, 4] = idx[:, :, :, 1]                   # a duplicate in every row
    idx[0, 10:13, 1] = -1                               # three rows with nothing selected ...
    idx[0, 10:13, 0, 0] = 0                             # ... beside rows that see block 0
    long_path(_sel_per_query(shape, 5, 16))
    out = ops.selected_attention(q, k, v, idx, sel_block=16, backend="sdpa")
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5
    assert out[0, 10:13, 4:].abs().max() == 0 and out[0, 10:13, :4].abs().max() > 0


def test_chunked_paths_decode_and_continued_prefill_match(long_path, monkeypatch, seed):
    """Queries at q_start > 0, keys at k_start > 0 (a decode window, a prefill continued from a
    cache), one query and several: the chunked paths against the oracle / the full-mask path."""
    b, t, hq, hkv, dk, dv, w = 2, 90, 8, 2, 16, 8, 13
    q, k, v = qkv(b, t, hq, hkv, dk, dv)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)
    long_path(b * hq * (CHUNK + w - 1))
    for q0 in (89, 41):                                  # one decode step; a 49-query continuation
        qs = q[:, q0:]
        ref = reference.sliding_window_attention(qs, k, v, window=w, q_start=q0)
        k0 = q0 + 1 - w if q0 == 89 else 20               # the decode cache's window; an earlier cut
        out = ops.sliding_window_attention(qs, k[:, k0:], v[:, k0:], window=w, backend="sdpa", q_start=q0,
                                           k_start=k0)
        assert rel_err(out, ref) < 1e-5
    long_path(b * hq * kc.shape[1])
    out = ops.compressed_attention(q[:, 41:], kc, vc, block=8, stride=4, backend="sdpa", q_start=41)
    assert rel_err(out, reference.compressed_attention(q[:, 41:], kc, vc, block=8, stride=4, q_start=41)) < 1e-5
    long_path(_sel_per_query((b, t, hq, hkv, dk, dv), 4, 16))
    out = ops.selected_attention(q[:, 41:], k, v, idx[:, 41:], sel_block=16, backend="sdpa", q_start=41)
    assert rel_err(out, reference.selected_attention(q[:, 41:], k, v, idx[:, 41:], sel_block=16, q_start=41)) < 1e-5
    # Keys from position 20 only: tokens before it are not there to read, in both paths alike.
    cut = ops.selected_attention(q[:, 41:], k[:, 20:], v[:, 20:], idx[:, 41:], sel_block=16, backend="sdpa",
                                 q_start=41, k_start=20)
    monkeypatch.setattr(sdpa, "FULL_MASK_ELEMENTS", 1 << 24)
    full = ops.selected_attention(q[:, 41:], k[:, 20:], v[:, 20:], idx[:, 41:], sel_block=16, backend="sdpa",
                                  q_start=41, k_start=20)
    assert rel_err(cut, full) < 1e-5 and rel_err(cut, out) > 1e-3


def test_selected_decode_over_a_long_cache_gathers(monkeypatch, seed):
    # Default thresholds: a prefill of 101 tokens masks (Tk <= 4 * n * l'), one decode step over
    # 1000 cached keys gathers its n * l' = 64 tokens instead of masking all 1000.
    gathered = []
    real = sdpa._selected_gathered
    monkeypatch.setattr(sdpa, "_selected_gathered", lambda call: gathered.append(call.q.shape[1]) or real(call))
    q, k, v = qkv(1, 1000, 8, 2, 16, 8)
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    ops.selected_attention(q[:, :101], k[:, :101], v[:, :101], ops.select_blocks(q[:, :101], kc[:, :24], **BR),
                           sel_block=16, backend="sdpa")
    assert gathered == []
    idx = ops.select_blocks(q[:, -1:], kc, **BR, q_start=999)
    out = ops.selected_attention(q[:, -1:], k, v, idx, sel_block=16, backend="sdpa", q_start=999)
    assert gathered == [1]
    assert rel_err(out, reference.selected_attention(q[:, -1:], k, v, idx, sel_block=16, q_start=999)) < 1e-5


def test_short_and_long_paths_agree_in_half_precision(long_path, monkeypatch, seed):
    b, t, hq, hkv, dk, dv, w = 1, 77, 4, 2, 16, 8, 11
    q, k, v = qkv(b, t, hq, hkv, dk, dv, dtype=torch.bfloat16)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)

    def run() -> list[torch.Tensor]:
        return [ops.sliding_window_attention(q, k, v, window=w, backend="sdpa"),
                ops.compressed_attention(q, kc, vc, block=8, stride=4, backend="sdpa"),
                ops.selected_attention(q, k, v, idx, sel_block=16, backend="sdpa")]

    refs = [reference.sliding_window_attention(q, k, v, window=w),
            reference.compressed_attention(q, kc, vc, block=8, stride=4),
            reference.selected_attention(q, k, v, idx, sel_block=16)]
    monkeypatch.setattr(sdpa, "FULL_MASK_ELEMENTS", 1 << 24)
    short = run()
    monkeypatch.setattr(sdpa, "FULL_MASK_ELEMENTS", 0)
    long_path(1 << 9)
    for s, lng, ref in zip(short, run(), refs, strict=True):
        assert lng.dtype == torch.bfloat16
        assert rel_err(lng, ref) <= 2 * rel_err(s, ref) + 1e-6


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op outputs (every aten op passes through here, SDPA's
    internals included), with the op's name."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.numel() > self.numel:
                self.numel, self.op = x.numel(), f"{func} -> {tuple(x.shape)}"
        return out


T_LONG = 8192
PAPER_BLOCKS = dict(cmp_block=32, cmp_stride=16, sel_block=64, sel_count=16, window=512)


def test_no_t_by_t_tensor_at_8k_in_any_op(seed):
    # Default thresholds and chunk sizes; small heads and dims so T x T would dwarf everything else.
    t, p = T_LONG, PAPER_BLOCKS
    q, k, v = qkv(1, t, 4, 1, 8, 4)
    with torch.no_grad(), _Largest() as seen:
        ops.sliding_window_attention(q, k, v, window=p["window"], backend="sdpa")
        kc, vc = ops.compress_kv(k, v, block=p["cmp_block"], stride=p["cmp_stride"])
        ops.compressed_attention(q, kc, vc, block=p["cmp_block"], stride=p["cmp_stride"], backend="sdpa")
        idx = ops.select_blocks(q, kc, block=p["cmp_block"], stride=p["cmp_stride"], sel_block=p["sel_block"],
                                sel_count=p["sel_count"])
        ops.selected_attention(q, k, v, idx, sel_block=p["sel_block"], backend="sdpa")
    assert 0 < seen.numel < t * t, f"largest tensor: {seen.op}"


def test_no_t_by_t_tensor_at_8k_in_the_module_forward(seed):
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=1, head_dim_qk=8, head_dim_v=4, **PAPER_BLOCKS)
    m = NSAAttention(cfg, backend="sdpa")
    x = rand(1, T_LONG, 16)
    with torch.no_grad(), _Largest() as seen:
        y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert 0 < seen.numel < T_LONG * T_LONG, f"largest tensor: {seen.op}"


@pytest.mark.parametrize("op", ["sliding", "selected"])
def test_long_path_memory_grows_linearly_in_t(op, monkeypatch, seed):
    # With chunk sizes fixed, doubling T may double the largest tensor (inputs, outputs), never
    # quadruple it: nothing in these two paths is quadratic in T.
    monkeypatch.setattr(sdpa, "FULL_MASK_ELEMENTS", 0)
    monkeypatch.setattr(sdpa, "CHUNK_ELEMENTS", 1 << 16)
    largest = []
    for t in (1024, 2048):
        q, k, v = qkv(1, t, 4, 1, 8, 8)
        if op == "selected":
            idx = torch.randint(0, t // 16, (1, t, 1, 4))
        with torch.no_grad(), _Largest() as seen:
            if op == "sliding":
                ops.sliding_window_attention(q, k, v, window=64, backend="sdpa")
            else:
                ops.selected_attention(q, k, v, idx, sel_block=16, backend="sdpa")
        largest.append(seen.numel)
    assert largest[1] <= 2 * largest[0], largest
