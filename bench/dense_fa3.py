"""FlashAttention-3 as an optional dense baseline: the `fa3-fwd` wheel (module `fa3_fwd_interface`).

That build is forward only, bf16 only (its fp16 and local-window kernels are compiled out),
causal and GQA, `[B, T, H, D]` layout like FA-2; head dims 64/96/128/192/256 with dv == dk, and
dk=192 / dv=128 (the paper's dims). It targets Hopper. Where it is not installed, or a call is
outside what it takes, `reason(...)` says why and the suites record the variant as `skipped`
with that reason; nothing falls back to another kernel under the `fa3` name.

    pip install fa3-fwd
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

MODULE = "fa3_fwd_interface"
NAME = "fa3"
# Devices the kernels run on (tests add "cpu" to drive a pure-torch double through the suites).
DEVICES = ("cuda",)
# (dk, dv) pairs of the wheel's build (fa3_fwd_config: HDIM64..256 and HDIMDIFF192 enabled).
_SAME_DIMS = (64, 96, 128, 192, 256)
_DIFF_DIMS = ((192, 128),)


def load() -> ModuleType | str:
    """The interface module, or why it cannot be imported."""
    try:
        return importlib.import_module(MODULE)
    except ImportError as exc:
        return f"fa3-fwd is not installed (pip install fa3-fwd on a Hopper GPU): {exc}"
    except OSError as exc:  # the wheel's CUDA extension cannot load (no driver, wrong CUDA)
        return f"fa3-fwd is installed but its CUDA extension cannot load: {exc}"


def unsupported_reason(q: Any, k: Any, v: Any) -> str | None:
    """Why the wheel cannot take `q [B, Tq, Hq, dk]`, `k [B, Tk, Hkv, dk]`, `v [B, Tk, Hkv, dv]`."""
    import torch

    if q.device.type not in DEVICES:
        return f"FA-3 runs on CUDA tensors, got {q.device.type}"
    if q.dtype != torch.bfloat16:
        return f"the fa3-fwd wheel is built for bf16 only (fp16 compiled out), got {q.dtype}"
    dk, dv = q.shape[-1], v.shape[-1]
    if not ((dk == dv and dk in _SAME_DIMS) or (dk, dv) in _DIFF_DIMS):
        return (f"the fa3-fwd wheel takes head dims {_SAME_DIMS} with dv == dk, or dk/dv {_DIFF_DIMS}, "
                f"got {dk}/{dv}")
    if q.shape[2] % k.shape[2]:
        return f"FA-3 needs Hq a multiple of Hkv, got {q.shape[2]}/{k.shape[2]}"
    return None


def reason(q: Any, k: Any, v: Any) -> str | None:
    """None when FA-3 can run this call here; else the reason (not installed, device, dtype, dims)."""
    mod = load()
    return mod if isinstance(mod, str) else unsupported_reason(q, k, v)


def prefill(fa3: ModuleType, q: Any, k: Any, v: Any, scale: float | None = None) -> Any:
    """Dense causal attention, `[B, T, H, D]` in and out (FA-3 takes that layout: no transpose),
    native GQA (Hq a multiple of Hkv)."""
    return fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)


def cache_lengths(k_cache: Any) -> Any:
    """`cache_seqlens` for a cache whose every sequence holds all `Tk` tokens (int32 `[B]`); built
    once outside the timed call."""
    import torch

    return torch.full((k_cache.shape[0],), k_cache.shape[1], dtype=torch.int32, device=k_cache.device)


def decode(fa3: ModuleType, q: Any, k_cache: Any, v_cache: Any, lengths: Any, scale: float) -> Any:
    """One step's query `q [B, 1, Hq, dk]` over the whole cache `k_cache/v_cache [B, S, Hkv, d*]`
    (`lengths` from `cache_lengths`) -> `[B, 1, Hq, dv]`. Causal: FA-3 aligns the query with the
    last key, so it reads every cached key, as the step at t = S - 1 does; nothing is appended."""
    return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, softmax_scale=scale, causal=True)


def decode_paged(fa3: ModuleType, q: Any, k_pool: Any, v_pool: Any, page_table: Any, lengths: Any, scale: float) -> Any:
    """One step's query `q [B, 1, Hq, dk]` over a paged cache: `k_pool/v_pool [pages, page_size,
    Hkv, d*]`, `page_table [B, pages per sequence]` int32 (vLLM's block table, the layout of
    nsa.serving.PagedCache) and `lengths [B]` int32, each sequence's tokens -> `[B, 1, Hq, dv]`.
    Causal: each query reads all its sequence's `lengths[b]` keys; nothing is appended."""
    return fa3.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, page_table=page_table,
                                       softmax_scale=scale, causal=True)
