"""Every functional op against the fp64 oracle, on fresh random inputs with awkward sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nsa import ops, reference
from tests.nsa.helpers import qkv, rand, rel_err

# (B, T, Hq, Hkv, dk, dv): T=1, T < l, T < w, T not a multiple of any block; GQA 1, 4, 16; dk != dv.
SHAPES = [
    (1, 1, 2, 2, 8, 8),
    (2, 7, 4, 1, 16, 8),
    (1, 37, 4, 4, 8, 12),
    (2, 70, 16, 1, 8, 8),
    (1, 101, 8, 2, 16, 24),
]
BR = dict(block=8, stride=4, sel_block=16, sel_count=4)
IDS = [f"B{s[0]}-T{s[1]}-Hq{s[2]}-Hkv{s[3]}-dk{s[4]}-dv{s[5]}" for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compress_kv_matches_oracle(shape, seed):
    b, t, _, hkv, dk, dv = shape
    k, v = rand(b, t, hkv, dk), rand(b, t, hkv, dv)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    tc = 0 if t < 8 else (t - 8) // 4 + 1
    assert kc.shape == (b, tc, hkv, dk) and vc.shape == (b, tc, hkv, dv)
    if tc:
        assert rel_err(kc, reference.compress_avg(k, 8, 4)) < 1e-6
        assert rel_err(vc, reference.compress_avg(v, 8, 4)) < 1e-6


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_sliding_matches_oracle_fp32(shape, seed):
    q, k, v = qkv(*shape)
    for window in (1, 5, 16, 1000):
        out = ops.sliding_window_attention(q, k, v, window=window)
        assert out.shape == (*q.shape[:3], v.shape[-1])
        assert rel_err(out, reference.sliding_window_attention(q, k, v, window=window)) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compressed_matches_oracle_fp32(shape, seed):
    q, k, v = qkv(*shape)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    out = ops.compressed_attention(q, kc, vc, block=8, stride=4)
    ref = reference.compressed_attention(q, kc, vc, block=8, stride=4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-5 if ref.norm() > 0 else out.abs().max() == 0
    assert out[:, :7].abs().max() == 0, "queries with no complete block must get exactly 0"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_select_blocks_match_oracle_exactly(shape, seed):
    q, k, v = (x.double() for x in qkv(*shape))
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)
    assert idx.dtype == torch.int64 and idx.shape == (q.shape[0], q.shape[1], k.shape[2], 4)
    assert torch.equal(idx, reference.select_blocks(q, kc, **BR))


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_selected_matches_oracle_fp32(shape, seed):
    q, k, v = qkv(*shape)
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)
    out = ops.selected_attention(q, k, v, idx, sel_block=16)
    assert rel_err(out, reference.selected_attention(q, k, v, idx, sel_block=16)) < 1e-5


def test_selection_forced_blocks_tie_rule_and_padding():
    # All scores tie (q = 0 gives uniform p_cmp over identical overlaps): the lower indices win.
    b, t, h, d = 1, 200, 2, 8
    q = torch.zeros(b, t, h, d, dtype=torch.float64)
    kc = rand(b, (t - 8) // 4 + 1, h, d).double()
    idx = reference_idx = ops.select_blocks(q, kc, **BR)
    assert torch.equal(idx, reference.select_blocks(q, kc, **BR))
    row = reference_idx[0, 199, 0].tolist()      # t=199: blocks 0..12, current 12, previous 11
    assert 0 in row and 12 in row and 11 in row and len(set(row)) == 4
    assert row == sorted(row)
    assert reference_idx[0, 5, 0].tolist() == [0, -1, -1, -1]   # one candidate: padded with -1
    assert reference_idx[0, 20, 0].tolist() == [0, 1, -1, -1]   # current=1, previous=0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_2x_of_plain_sdpa(dtype, seed):
    b, t, hq, hkv, d, w = 2, 45, 4, 2, 16, 9
    q, k, v = qkv(b, t, hq, hkv, d, d, dtype=dtype)
    ref = reference.sliding_window_attention(q, k, v, window=w)
    ours = ops.sliding_window_attention(q, k, v, window=w)
    pos = torch.arange(t)
    band = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < w)
    plain = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=band).transpose(1, 2)
    assert rel_err(ours, ref) <= 2 * rel_err(plain, ref) + 1e-6
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    ref_c = reference.compressed_attention(q, kc, vc, block=8, stride=4)
    out_c = ops.compressed_attention(q, kc, vc, block=8, stride=4)
    # Plain masked bf16 SDPA over the same compressed keys as the error yardstick.
    nvis = torch.where(pos + 1 < 8, 0, (pos + 1 - 8) // 4 + 1)
    cm = torch.arange(kc.shape[1])[None, :] < nvis[:, None]
    cm[:7, 0] = True
    plain_c = F.scaled_dot_product_attention(
        q.transpose(1, 2), kc.repeat_interleave(2, 2).transpose(1, 2), vc.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=cm).transpose(1, 2).clone()
    plain_c[:, :7] = 0
    assert rel_err(out_c, ref_c) <= 2 * rel_err(plain_c, ref_c) + 1e-6


def test_causality_every_branch_and_selection(seed):
    b, t, hq, hkv, d, t0 = 1, 90, 4, 2, 8, 50
    q, k, v = qkv(b, t, hq, hkv, d, d)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, t0 + 1:] += 3.0
    k2[:, t0 + 1:] -= 2.0
    v2[:, t0 + 1:] *= -4.0

    def run(q, k, v):
        kc, vc = ops.compress_kv(k, v, block=8, stride=4)
        idx = ops.select_blocks(q, kc, **BR)
        return (ops.sliding_window_attention(q, k, v, window=20), ops.compressed_attention(q, kc, vc, block=8, stride=4),
                idx, ops.selected_attention(q, k, v, idx, sel_block=16))

    for a, c in zip(run(q, k, v), run(q2, k2, v2), strict=True):
        assert torch.equal(a[:, :t0 + 1], c[:, :t0 + 1])
        assert not torch.equal(a, c), "the perturbation must reach later positions (test must be able to fail)"


def test_window_covering_t_equals_causal_attention(seed):
    q, k, v = qkv(2, 33, 4, 2, 8, 8)
    out = ops.sliding_window_attention(q, k, v, window=33)
    assert rel_err(out, reference.causal_attention(q, k, v)) < 1e-5


def test_selecting_every_block_equals_causal_attention(seed):
    q, k, v = qkv(1, 75, 4, 1, 8, 8)
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=5)   # 5 blocks cover 75
    out = ops.selected_attention(q, k, v, idx, sel_block=16)
    assert rel_err(out, reference.causal_attention(q, k, v)) < 1e-5


def test_group_shares_blocks_and_groups_differ(seed):
    q, k, v = (x.double() for x in qkv(1, 180, 8, 2, 8, 8))
    kc, _ = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, **BR)
    # Permuting query heads inside a group cannot change that group's blocks (Eq. 10 group sum).
    perm = torch.tensor([3, 2, 1, 0, 4, 5, 6, 7])
    assert torch.equal(idx, ops.select_blocks(q[:, :, perm], kc, **BR))
    # ... while a per-head choice would: selection depends on the group, not on one head.
    assert not torch.equal(idx[..., 0, :], idx[..., 1, :])
    per_head = [ops.select_blocks(q[:, :, h:h + 1], kc[:, :, h // 4:h // 4 + 1], **BR) for h in range(4)]
    assert any(not torch.equal(p[..., 0, :], idx[..., 0, :]) for p in per_head)


@pytest.mark.parametrize("bad, exc, needle", [
    (lambda q, k, v: ops.sliding_window_attention(q[0], k, v, window=4), ValueError, "4-D"),
    (lambda q, k, v: ops.sliding_window_attention(q, k, v, window=0), ValueError, "window"),
    (lambda q, k, v: ops.sliding_window_attention(q[:, :, :3], k, v, window=4), ValueError, "multiple"),
    (lambda q, k, v: ops.sliding_window_attention(q, k.half(), v, window=4), TypeError, "dtype"),
    (lambda q, k, v: ops.sliding_window_attention(q, k, v.int(), window=4), TypeError, "float"),
    (lambda q, k, v: ops.compress_kv(k, v, block=4, stride=8), ValueError, "stride"),
    (lambda q, k, v: ops.sliding_window_attention(q, k, v, window=4, backend="nope"), ValueError, "backend"),
    (lambda q, k, v: ops.select_blocks(q, k, block=8, stride=4, sel_block=16, sel_count=2), ValueError, "sel_count"),
])
def test_bad_inputs_raise_with_fix(bad, exc, needle):
    q, k, v = qkv(1, 12, 4, 2, 8, 8)
    with pytest.raises(exc, match=needle):
        bad(q, k, v)


def test_bhtd_tensor_is_caught():
    # [B, H, T, D] fed as [B, T, H, D]: T=12 tokens, Hq=4, Hkv=2 -> q would claim 12 "heads" vs 2.
    q, k, v = qkv(1, 12, 4, 2, 8, 8)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        ops.sliding_window_attention(q.transpose(1, 2), k, v, window=4)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        ops.sliding_window_attention(q, k.transpose(1, 2), v.transpose(1, 2), window=4)
