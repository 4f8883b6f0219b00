"""Rotary position embedding (rotate-half form), applied to queries and RAW keys of every branch
before compression: compressed keys summarise already-rotated raw keys (docs/nsa.md)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotate `x [B, T, H, D]` (D even) by its positions `pos [T]` (or `[B, T]`: each sequence its own,
    a ragged decode batch); computed in fp32 for half inputs."""
    half = x.shape[-1] // 2
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=acc) / half)
    angle = pos.to(acc)[..., None] * inv_freq                            # [(B,) T, D/2]
    if angle.dim() == 2:
        angle = angle[None]
    cos, sin = angle.cos()[:, :, None, :], angle.sin()[:, :, None, :]
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
