"""A pure-torch double of the `fa3-fwd` wheel's interface (`fa3_fwd_interface`), for CPU contract tests.

Same entry points and `[B, T, H, D]` layout as the wheel's `flash_attn_func` / `flash_attn_with_kvcache` /
`_flash_attn_forward` (the low-level one with `out_` and the log-sum-exp, fa3_cmp.py),
bottom-right causal alignment, GQA by head groups. It rejects what that build rejects (fp16: compiled
out; a local window: compiled out; dk/dv pairs it has no kernel for) and records every call's
arguments, so a test can check what the adapter handed over.
"""

from __future__ import annotations

import types

import torch

from tests.nsa.fa2_doubles import _attend

_DIMS = {(d, d) for d in (64, 96, 128, 192, 256)} | {(192, 128)}


def _check(q, k, v, window_size, dtypes=(torch.bfloat16,)) -> None:
    assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "FA-3: q, k, v are [B, T, H, D]"
    assert q.dtype == k.dtype == v.dtype and q.dtype in dtypes, f"FA-3 wheel: bf16 only, got {q.dtype}"
    assert (q.shape[-1], v.shape[-1]) in _DIMS, f"FA-3 wheel: no kernel for dk/dv {q.shape[-1]}/{v.shape[-1]}"
    assert q.shape[2] % k.shape[2] == 0, f"FA-3: heads {q.shape[2]} must be divisible by KV heads {k.shape[2]}"
    assert tuple(window_size) == (-1, -1), "FA-3 wheel: local attention is compiled out"


def fake_module(calls: list[dict], dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> types.ModuleType:
    """The double, appending `{"fn": name, **kwargs}` to `calls` on every call. `dtypes`: what
    `_flash_attn_forward` accepts (the wheel: bf16; CPU tests of fa3_cmp add fp32, which Triton's
    interpreter computes correctly where it does not bf16)."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        _check(q, k, v, window_size)
        assert q.shape[0] == k.shape[0] and k.shape[:3] == v.shape[:3]
        calls.append({"fn": "flash_attn_func", "causal": causal, "softmax_scale": softmax_scale})
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return torch.stack([_attend(q[b], k[b], v[b], scale, causal, (-1, -1)) for b in range(q.shape[0])])

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        _check(q, k_cache, v_cache, window_size)
        assert k is None and v is None, "the adapter must not append to the cache"
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "FA-3: cache needs a unit last stride"
        assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
        assert cache_seqlens.shape == (q.shape[0],)
        calls.append({"fn": "flash_attn_with_kvcache", "causal": causal, "softmax_scale": softmax_scale})
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out = []
        for i in range(q.shape[0]):
            n = int(cache_seqlens[i])
            assert 0 <= n <= k_cache.shape[1]
            out.append(_attend(q[i], k_cache[i, :n], v_cache[i, :n], scale, causal, (-1, -1)))
        return torch.stack(out)

    def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                            cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                            leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
                            k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size_left=-1,
                            window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
        """The wheel's low-level forward: (out, softmax_lse [B, H, Tq] fp32 natural log, accum, accum);
        writes `out_` when given."""
        _check(q, k, v, (window_size_left, window_size_right), dtypes)
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "FA-3: unit last strides"
        calls.append({"fn": "_flash_attn_forward", "causal": causal, "softmax_scale": softmax_scale,
                      "out_": out_ is not None, "q_shape": tuple(q.shape), "k_shape": tuple(k.shape)})
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out = torch.stack([_attend(q[b], k[b], v[b], scale, causal, (-1, -1)) for b in range(q.shape[0])])
        tq, tk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
        logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(g, dim=2).double()) * scale
        if causal:
            allowed = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
            logits = logits.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(logits, -1).float()
        if out_ is not None:
            out_.copy_(out)
            out = out_
        return out, lse, None, None

    def fwd(*args):
        """`torch.ops.fa3_fwd.fwd`, positional as the wheel's `_flash_attn_forward` calls it."""
        assert len(args) == 34, f"fa3_fwd.fwd takes 34 positional arguments, got {len(args)}"
        assert all(a is None for a in args[3:6] + args[7:23]), "only q, k, v, out and the options are set"
        scale, causal, left, right, chunk, softcap = args[23:29]
        assert (left, right, chunk, softcap) == (-1, -1, 0, 0.0) and args[29:] == (True, None, 1, None, 0)
        return _flash_attn_forward(args[0], args[1], args[2], out_=args[6], softmax_scale=scale, causal=causal)

    mod = types.ModuleType("fa3_fwd_interface")
    mod._flash_attn_forward = _flash_attn_forward
    mod.fa3_fwd_cuda = types.SimpleNamespace(fwd=fwd)
    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return mod
