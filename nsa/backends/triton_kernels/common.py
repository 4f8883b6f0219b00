"""Host-side helpers shared by the kernel families: sizes, the output allocation."""

from __future__ import annotations

import torch
import triton
from torch import Tensor


def pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def np2(x: int, floor: int = 16) -> int:
    """Next power of two, at least `floor` (tl.arange sizes; 16 is tl.dot's smallest tile)."""
    return max(floor, triton.next_power_of_2(x))


def empty_out(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The kernels' output allocation, one place: tests fill it with NaN to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


def unit_last_stride(*xs: Tensor) -> tuple[Tensor, ...]:
    """The kernels take any strides but a unit last one (vector loads along the head dim)."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
