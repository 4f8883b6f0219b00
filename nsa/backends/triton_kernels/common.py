"""Helpers shared by the kernel families: sizes, the output allocation, log2(e), the two products
of attention under each input precision, and the kernels' shared primitives:

    _program_bh       a program's (sequence, KV group) from its id, the sequence index in int64
    _softmax_update   one key tile of the online softmax (`_softmax_step`: with `acc * alpha + p @ v`;
                      `_softmax_tile`: a tile alone, the partial of one block)
    _merge_weights    the weights that merge softmax partials (flash-decoding splits, block partials;
                      `_merge_stats`: partials stacked along axis 0)

Units: every kernel works in log2 units. The host passes `scale * LOG2E` (`qk_scale2`), so a
logit times it is `x = logit * scale * log2(e)` and `exp(logit * scale - m) = exp2(x - m2)`
with one exp2 and no extra multiply; row maxima `m`, partial maxima and log-sum-exps inside the
kernels are in the same units. A log-sum-exp that leaves the kernels keeps the units its reader
expects (each store says which)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = math.log2(math.e)   # logits times scale * LOG2E are in log2 units: exp2 needs no multiply


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """`a @ b` accumulated in fp32: full-fp32 products for fp32 inputs (IEEE; the oracle tests'
    exact path), tensor cores for bf16/fp16."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _pv(p, v, IEEE: tl.constexpr):
    """`p @ v` for fp32 probabilities `p`: in fp32 with IEEE, else `p` rounded to `v`'s dtype on
    tensor cores (fp32 accumulation)."""
    if IEEE:
        out = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(p.to(v.dtype), v)
    return out


@triton.jit
def _program_bh(AXIS: tl.constexpr, H: tl.constexpr):
    """This program's (bh, b, h) from its id along AXIS, `bh = b * H + h` (sequence b, head or KV
    group h of H): `b` in int64, so `b * batch stride` and every offset added to it stay exact
    past 2**31 elements (B >= 2 sequences of 128k tokens with 16 KV heads already pass it)."""
    bh = tl.program_id(AXIS)
    return bh, (bh // H).to(tl.int64), bh % H


@triton.jit
def _safe_max(m):
    """A row max with -inf (nothing seen) taken as 0, so `exp2(x - _safe_max(m))` of an empty
    row is exp2(-inf) = 0, never exp2(-inf + inf) = NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _softmax_update(qk2, m_i, l_i):
    """One key tile of the online softmax on logits `qk2 [rows, keys]` in log2 units (-inf where
    masked) into the running row max `m_i` and sum `l_i`: (m_new, l_new, alpha, p), `alpha =
    exp2(m_i - m_new)` the factor that rescales what was summed before, `p = exp2(qk2 - m_new)`
    (m_new taken as 0 while a row has seen nothing)."""
    m_new = tl.maximum(m_i, tl.max(qk2, 1))
    m_safe = _safe_max(m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk2 - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _softmax_step(qk2, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """`_softmax_update` with the output: the new running max, sum and `acc * alpha + p @ v` (fp32;
    bf16/fp16 `p` on tensor cores)."""
    m_new, l_new, alpha, p = _softmax_update(qk2, m_i, l_i)
    return m_new, l_new, acc * alpha[:, None] + _pv(p, v, IEEE)


@triton.jit
def _softmax_tile(qk2):
    """The softmax partial of one key tile alone (a block, a chunk): its row max `m` and `p =
    exp2(qk2 - m)` (log2 units; `_softmax_update` from nothing, without its rescale of nothing);
    the partial's sum is `tl.sum(p, 1)`."""
    m = tl.max(qk2, 1)
    return m, tl.exp2(qk2 - _safe_max(m)[:, None])


@triton.jit
def _merge_weights(m, m_ref):
    """Weights of softmax partials with maxima `m` (log2 units; -inf: an empty partial) merged
    under the reference max `m_ref` (the partials' max, broadcast to `m`'s shape): `exp2(m -
    m_ref)`, 0 for an empty partial and for every partial when all are empty. The merged sum is
    `sum(w * l)`, the merged output `sum(w * acc) / sum(w * l)`; a partial kept as (log-sum-exp,
    normalised output) merges the same way with `m` = its log-sum-exp and `l` = 1."""
    return tl.exp2(m - _safe_max(m_ref))


@triton.jit
def _merge_stats(m, den):
    """Partials (max m, sum den) stacked along axis 0 (`[S, rows]`, log2 units) merged: (m_tot,
    l_tot, w), w `[S, rows]` each partial's `_merge_weights` (the merged output:
    `sum(w[:, :, None] * acc, 0) / l_tot`)."""
    m_tot = tl.max(m, 0)
    w = _merge_weights(m, m_tot[None, :])
    return m_tot, tl.sum(w * den, 0), w


def pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def np2(x: int, floor: int = 16) -> int:
    """Next power of two, at least `floor` (tl.arange sizes; 16 is tl.dot's smallest tile)."""
    return max(floor, triton.next_power_of_2(x))


def prefill_work(q: Tensor) -> int:
    """`B * Hq * T**2` of a prefill's queries `q [B, T, Hq, d]`: what its work grows with, the
    measure both wheels' floors compare (`Tiles.cmp_fa3_min_work`, `win_fa4_min_work`)."""
    b, t, hq = q.shape[0], q.shape[1], q.shape[2]
    return b * hq * t * t


def empty_out(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The kernels' output allocation, one place: tests fill it with NaN to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


def unit_last_stride(*xs: Tensor) -> tuple[Tensor, ...]:
    """The kernels take any strides but a unit last one (vector loads along the head dim)."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


class BoundLaunch:
    """One Triton launch whose arguments never change (tensors are fixed buffers the caller
    rewrites in place): the first call launches through `kernel[grid](...)` (compiling it), later
    calls go straight to the compiled kernel's launcher with the arguments bound once, which
    skips Triton's per-call binding and cache lookup (tens of microseconds of host time for a
    kernel of many arguments). On the current stream at each call, so a CUDA graph captures it.
    Under the interpreter every call is a plain launch."""

    def __init__(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        self.kernel, self.grid, self.args, self.kwargs = kernel, tuple(grid) + (1,) * (3 - len(grid)), args, kwargs
        self._compiled = None
        self._values: tuple = ()

    def __call__(self) -> None:
        if self._compiled is not None:
            c = self._compiled
            stream = torch.cuda.current_stream(self._device).cuda_stream
            meta = c.launch_metadata(self.grid, stream, *self._values)
            c.run(*self.grid, stream, c.function, c.packed_metadata, meta, triton.knobs.runtime.launch_enter_hook,
                  triton.knobs.runtime.launch_exit_hook, *self._values)
            return
        compiled = self.kernel[self.grid](*self.args, **self.kwargs)
        device = next((a.device for a in self.args if isinstance(a, Tensor)), None)
        binder = getattr(self.kernel, "device_caches", None)
        if compiled is None or device is None or device.type != "cuda" or binder is None or not hasattr(compiled, "run"):
            return                                # the interpreter, or a launcher this class does not know
        kwargs = dict(self.kwargs, debug=self.kwargs.get("debug", self.kernel.debug) or triton.knobs.runtime.debug,
                      instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
        bound, _, _ = binder[device.index if device.index is not None else torch.cuda.current_device()][4](
            *self.args, **kwargs)
        self._values, self._device, self._compiled = tuple(bound.values()), device, compiled
