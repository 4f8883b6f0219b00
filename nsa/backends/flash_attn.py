"""The flash-attn package (FA-2): `flash_attn_func` with `window_size` for the sliding branch and
`flash_attn_with_kvcache` over query buckets for the compressed branch.

Tensors stay `[B, T, H, D]`, flash-attn's own layout. The compressed branch's staircase (one more
visible key every `stride` queries) has no FA-2 mask, so queries are grouped in buckets of
`stride` that see the same keys: each bucket is one kvcache batch entry whose `cache_seqlens`
is its visible count and whose `cache_batch_idx` points at its batch's compressed keys.
Memory: the padded bucket copy of q, `O(B*T*Hq*dk)`.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch
from torch import Tensor

from nsa.backends import AttnCall, _fa2_common, caps

_IMPORT_ERROR: list[BaseException] = []


def _lib() -> ModuleType:
    if "flash_attn" in sys.modules:  # imported before (or set in sys.modules: None blocks it)
        return importlib.import_module("flash_attn")
    # A failed import is not cached by Python: each retry searches sys.path again (~35 us, once or
    # twice per NSA call through `resolve("fa2")`). Installing flash-attn needs a new process anyway.
    if _IMPORT_ERROR:
        raise _IMPORT_ERROR[0]
    try:
        return importlib.import_module("flash_attn")
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        _IMPORT_ERROR.append(exc)
        raise


# flash_attn_func has a backward; the compressed buckets run flash_attn_with_kvcache, which has none.
# No selected op (FA-2 has no block-sparse mask).
CAPABILITIES = caps(forward=("sliding", "compressed"), backward=("sliding",))

def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    try:
        lib = _lib()
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        return f"flash-attn is not importable ({type(exc).__name__}: {exc}); pip install '.[gpu]' on a CUDA machine"
    spec = getattr(lib, "__spec__", None)
    if spec is not None and spec.origin is None and spec.submodule_search_locations is not None:
        return ("flash_attn is only a namespace package here (flash-attn-4 installs flash_attn.cute alone); "
                "FA-2 needs the flash-attn package: pip install '.[gpu]' on a CUDA machine")
    if not hasattr(lib, "flash_attn_with_kvcache"):
        return f"flash-attn {getattr(lib, '__version__', '?')} lacks flash_attn_with_kvcache; need >= 2.6"
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    return _fa2_common.unsupported_reason(call)


def sliding(call: AttnCall) -> Tensor:
    return _lib().flash_attn_func(call.q, call.k, call.v, softmax_scale=call.scale, causal=True,
                                  window_size=(call.window - 1, 0))


def compressed(call: AttnCall) -> Tensor:
    lib = _lib()

    def kernel(qb: Tensor, kc: Tensor, vc: Tensor, counts: Tensor, r0: int, pad_front: int) -> Tensor:
        b, r, d, hq, dk = qb.shape
        out = lib.flash_attn_with_kvcache(
            qb.reshape(b * r, d, hq, dk), kc, vc,
            cache_seqlens=counts.to(device=qb.device, dtype=torch.int32).repeat(b),
            cache_batch_idx=torch.arange(b, device=qb.device, dtype=torch.int32).repeat_interleave(r),
            softmax_scale=call.scale, causal=False)
        return out.view(b, r, d, hq, vc.shape[-1])

    return _fa2_common.compressed_with_buckets(call, kernel)
