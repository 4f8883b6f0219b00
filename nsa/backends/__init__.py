"""Backend registry: a static table name -> module, imported lazily.

Every backend module provides:
    unavailable_reason(device) -> str | None   # None: it can run on this device at all
    unsupported_reason(call) -> str | None     # None: it can run this exact call
    sliding(call), compressed(call), selected(call) -> Tensor   # ops it supports
An explicitly named backend that cannot run raises `BackendError` with the reason; only
`backend="auto"` (nsa.dispatch) may choose, and it records the name it chose.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

_TABLE = {
    "sdpa": "nsa.backends.sdpa",
    "flash_attn": "nsa.backends.flash_attn",
    "torch_fa2": "nsa.backends.torch_fa2",
    "flex": "nsa.backends.flex",
    "triton": "nsa.backends.triton_nsa",
}
ALIASES = ("fa2", "auto")
OPS = ("sliding", "compressed", "selected")


class BackendError(RuntimeError):
    """An explicitly requested backend cannot run this call."""


@dataclass
class AttnCall:
    """One attention call, `[B, T, H, D]` tensors; query positions `q_start ..`, key positions `k_start ..`.

    For `compressed`, k/v are the compressed keys/values (token i summarises `[i*d, i*d+l)`).
    For `selected`, `block_indices` is `[B, Tq, Hkv, n]` (int64, -1 padded).
    """

    op: str
    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    q_start: int = 0
    k_start: int = 0
    window: int | None = None
    block: int | None = None
    stride: int | None = None
    sel_block: int | None = None
    block_indices: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far: T in a prefill, t + 1 in a decode step."""
        return self.q_start + self.q.shape[1]


def names() -> tuple[str, ...]:
    return tuple(_TABLE)


def module(name: str) -> ModuleType:
    if name not in _TABLE:
        raise ValueError(f"backend must be one of {sorted(_TABLE) + list(ALIASES)}, got {name!r}")
    return _module(name)


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(_TABLE[name])


def resolve(name: str, device: torch.device | str | None = None) -> str:
    """Resolve the alias `fa2`: the flash-attn package when importable, else torch's vendored FA-2."""
    if name == "fa2":
        # Keyed by what sys.modules holds for flash_attn, so a module installed later (tests) counts.
        return _fa2_for(torch.device(device).type if device is not None else None, id(sys.modules.get("flash_attn")))
    if name not in _TABLE:
        module(name)  # raises with the valid names
    return name


@functools.cache
def _fa2_for(device_type: str | None, _flash_attn_id: int) -> str:
    # Asked once or twice per NSA call: whether flash-attn imports does not change within a process.
    return "flash_attn" if module("flash_attn").unavailable_reason(device_type) is None else "torch_fa2"


def unavailable_reason(name: str, device: torch.device | str | None = None) -> str | None:
    return module(resolve(name, device)).unavailable_reason(device)


def unsupported_reason(name: str, call: AttnCall) -> str | None:
    """Why backend `name` cannot run `call` (unavailable, op not implemented, dtype, head dim ...)."""
    mod = module(resolve(name, call.q.device))
    if not hasattr(mod, call.op):
        return f"backend {name} does not implement the {call.op} op"
    return mod.unavailable_reason(call.q.device) or mod.unsupported_reason(call)


def run(name: str, call: AttnCall) -> Tensor:
    """Run `call` on the explicitly named backend, or raise BackendError with the reason."""
    resolved = resolve(name, call.q.device)
    reason = unsupported_reason(resolved, call)
    if reason is not None:
        raise BackendError(f"backend {resolved!r} cannot run this {call.op} call: {reason}")
    return getattr(module(resolved), call.op)(call)


def shape_cached(cached: Any, *args: Any) -> Any:
    """`cached(*args)` (a functools cache of tensors built from shapes alone, such as masks), except
    while the current CUDA stream is capturing a graph: then the uncached function, so the tensor
    lives in the graph's own pool. A graph reads the memory it was captured with on every replay;
    a cached tensor could be evicted and its memory reused while the graph still runs."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return cached.__wrapped__(*args)
    return cached(*args)
