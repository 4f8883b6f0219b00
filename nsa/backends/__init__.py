"""Backend registry: a static table name -> module, imported lazily.

Every backend module provides:
    CAPABILITIES: Capabilities                 # what it can do: ops forward and backward, decode, fusions
    unavailable_reason(device) -> str | None   # None: it can run on this device at all
    unsupported_reason(call) -> str | None     # None: it can run this exact call
    sliding(call), compressed(call), selected(call) -> Tensor   # the ops of CAPABILITIES.forward
and one function per fusion it declares (see `FUSIONS`). A call that needs gradients
(`AttnCall.grad`) may run only on a backend whose `CAPABILITIES.backward` holds its op; the module
and dispatch read these declarations and never name a backend. An explicitly named backend that
cannot run raises `BackendError` with the reason; only `backend="auto"` (nsa.dispatch) may
choose, and it records the name it chose. `run` checks the promise: an output of a call that
needs gradients must carry them, or it raises (a silent cut from autograd is never returned).

Under `torch.compile` the checks are not traced: dynamo calls `constant_reason` with the call's
shapes, dtypes and device (`frozen(call)`) and keeps the answer as a constant of the graph, which
is specialised on those shapes anyway (nsa.dispatch plans the same way). The table's modules are
kept in a plain dict once imported, which dynamo reads without tracing `importlib`.
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys
from dataclasses import dataclass
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
    "fa3": "nsa.backends.fa3",
    "fa4": "nsa.backends.fa4",
}
ALIASES = ("fa2", "auto")
OPS = ("sliding", "compressed", "selected")


# Fused paths a backend may declare, each a function of its module that NSAAttention calls:
#   scores       compressed_select(...) / compressed_and_scores(...): the compressed pass also yields
#                the selection scores and top-n blocks (forward only: its output carries no gradient)
#   gated        selected_gated(...): the selection kernel forms the gated sum in its epilogue
#   beside       beside(side, chain, finish, ...): the prefill window on a stream beside the chain
#   decode_step  decode_step(...), decode_counts(...), decode_unsupported_reason(...): a whole step
#   train_scores compressed_select_train(...): for a call that needs gradients, the compressed
#                output (with gradients) and the top-n blocks from one training pass
# Only train_scores has a backward: otherwise a call that needs gradients runs the separate ops.
FUSIONS = ("scores", "gated", "beside", "decode_step", "train_scores")


@dataclass(frozen=True)
class Capabilities:
    """What one backend declares it can do."""

    forward: frozenset[str]                 # ops it runs (OPS)
    backward: frozenset[str]                # ops whose output carries gradients to q, k and v
    decode: bool                            # it runs one-query decode calls of its forward ops
    fusions: frozenset[str] = frozenset()   # FUSIONS it provides (forward only)

    def __post_init__(self) -> None:
        for name, ops in (("forward", self.forward), ("backward", self.backward)):
            if not set(ops) <= set(OPS):
                raise ValueError(f"Capabilities.{name} must be among {OPS}, got {sorted(ops)}")
        if not self.backward <= self.forward:
            raise ValueError(f"a backward needs its forward: {sorted(self.backward - self.forward)}")
        if not set(self.fusions) <= set(FUSIONS):
            raise ValueError(f"Capabilities.fusions must be among {FUSIONS}, got {sorted(self.fusions)}")


def caps(*, forward: tuple[str, ...] = OPS, backward: tuple[str, ...] = (), decode: bool = True,
         fusions: tuple[str, ...] = ()) -> Capabilities:
    return Capabilities(frozenset(forward), frozenset(backward), decode, frozenset(fusions))


class BackendError(RuntimeError):
    """An explicitly requested backend cannot run this call."""


def needs_grad(*tensors: Tensor | None) -> bool:
    """A call needs gradients when grad mode is on and any of its inputs requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    grad: bool = False          # the output must carry gradients (needs_grad of the inputs)

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


_LOADED: dict[str, ModuleType] = {}


def _module(name: str) -> ModuleType:
    mod = _LOADED.get(name)
    if mod is None:
        mod = _LOADED[name] = importlib.import_module(_TABLE[name])
    return mod


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


def capabilities(name: str, device: torch.device | str | None = None) -> Capabilities:
    """What backend `name` (an alias resolved for `device`) declares."""
    return module(resolve(name, device)).CAPABILITIES


def with_fusion(fusion: str) -> tuple[str, ...]:
    """The backends that declare `fusion`, in table order."""
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    return tuple(n for n in _TABLE if fusion in _module(n).CAPABILITIES.fusions)


def unsupported_reason(name: str, call: AttnCall) -> str | None:
    """Why backend `name` cannot run `call` (unavailable, op not implemented, no backward for a
    call that needs gradients, dtype, head dim ...)."""
    if torch.compiler.is_compiling():
        return constant_reason(name, frozen(call))
    return _unsupported_reason(name, call)


def frozen(call: AttnCall) -> tuple:
    """Everything of a call that a backend's checks and a plan depend on, as plain values: the op,
    shapes, dtypes and device of its tensors, positions, knobs, and whether it needs gradients."""
    idx = call.block_indices
    return (call.op, *((_sizes(x), x.dtype) for x in (call.q, call.k, call.v)), call.q.device,
            call.scale, call.q_start, call.k_start, call.window, call.block, call.stride, call.sel_block,
            None if idx is None else (_sizes(idx), idx.dtype), call.grad)


def _sizes(x: Tensor) -> tuple[int, ...]:
    # operator.index, not int: under torch.compile with dynamic shapes it specialises a symbolic
    # size to the value at hand (a guard: another size compiles again), so the key is plain ints.
    return tuple(operator.index(n) for n in x.shape)


def thawed(key: tuple) -> AttnCall:
    """An `AttnCall` of the shapes, dtypes and device in `frozen`'s key, over stand-in tensors (one
    element each, expanded: no memory in proportion to the shapes), for the checks alone."""
    op, (qs, qd), (ks, kd), (vs, vd), dev, scale, q_start, k_start, window, block, stride, sel_block, idx, grad = key

    def stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty((), dtype=dtype, device=dev).expand(shape)

    return AttnCall(op, stand_in(qs, qd), stand_in(ks, kd), stand_in(vs, vd), scale, q_start=q_start, k_start=k_start,
                    window=window, block=block, stride=stride, sel_block=sel_block,
                    block_indices=None if idx is None else stand_in(*idx), grad=grad)


@torch.compiler.assume_constant_result
def constant_reason(name: str, key: tuple) -> str | None:
    """`unsupported_reason` for a frozen call, run outside the traced graph (see the module's docstring)."""
    return _unsupported_reason(name, thawed(key))


def _unsupported_reason(name: str, call: AttnCall) -> str | None:
    mod = module(resolve(name, call.q.device))
    if call.op not in mod.CAPABILITIES.forward or not hasattr(mod, call.op):
        return f"backend {name} does not implement the {call.op} op"
    if call.grad and call.op not in mod.CAPABILITIES.backward:
        return (f"backend {name} has no backward for the {call.op} op and this call needs gradients "
                "(grad mode is on and an input requires grad)")
    return mod.unavailable_reason(call.q.device) or mod.unsupported_reason(call)


def run(name: str, call: AttnCall) -> Tensor:
    """Run `call` on the explicitly named backend, or raise BackendError with the reason. A call
    that needs gradients whose output came back without them raises: a declaration was wrong."""
    resolved = resolve(name, call.q.device)
    reason = unsupported_reason(resolved, call)
    if reason is not None:
        fix = ("; call it under torch.no_grad() (inference), or name a backend with this op's backward "
               "(backend='auto' picks one)") if call.grad else ""
        raise BackendError(f"backend {resolved!r} cannot run this {call.op} call: {reason}{fix}")
    out = getattr(module(resolved), call.op)(call)
    if call.grad and not out.requires_grad:
        raise BackendError(f"backend {resolved!r} returned a {call.op} output cut from autograd although the call "
                           "needs gradients; its CAPABILITIES.backward is wrong: report it, and use another backend")
    return out


def shape_cached(cached: Any, *args: Any) -> Any:
    """`cached(*args)` (a functools cache of tensors built from shapes alone, such as masks), except
    while the current CUDA stream is capturing a graph: then the uncached function, so the tensor
    lives in the graph's own pool. A graph reads the memory it was captured with on every replay;
    a cached tensor could be evicted and its memory reused while the graph still runs. Under
    torch.compile the uncached function too: dynamo traces through a cache, not into it."""
    if torch.compiler.is_compiling() or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        return cached.__wrapped__(*args)    # (traced: the graph builds the tensor itself)
    return cached(*args)
