"""Helpers shared by the kernel families: sizes, the output allocation, log2(e), the two products
of attention under each input precision, and the online-softmax step of the kernels that work in
log2 units."""

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
def _softmax_step(qk2, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax on logits `qk2` in log2 units (-inf where masked):
    the new running max, sum and `acc * alpha + p @ v` (fp32; bf16/fp16 `p` on tensor cores)."""
    m_new = tl.maximum(m_i, tl.max(qk2, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk2 - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _pv(p, v, IEEE)


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
