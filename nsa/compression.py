"""Compression `phi`: a block of `l` raw keys (values) with stride `d` -> one compressed key (value)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nsa.masks import n_compressed


def blocks_view(x: Tensor, block: int, stride: int) -> Tensor:
    """`[B, T, H, D]` -> `[B, Tc, H, l, D]` overlapping blocks (a strided view, no copy)."""
    tc = n_compressed(x.shape[1], block, stride)
    if tc == 0:
        return x.new_empty(x.shape[0], 0, x.shape[2], block, x.shape[3])
    return x.unfold(1, block, stride).permute(0, 1, 2, 4, 3)


def avg_compress(x: Tensor, block: int, stride: int) -> Tensor:
    """Mean over each block: `[B, T, H, D]` -> `[B, Tc, H, D]`, accumulated in fp32 for half inputs."""
    blocks = blocks_view(x, block, stride)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return blocks.mean(dim=3, dtype=acc).to(x.dtype)


class MLPCompressor(nn.Module):
    """The paper's learnable phi: an MLP over the flattened block plus an intra-block position embedding.

    `phi(x_block) = W2 · gelu(W1 · flatten(x_block + pe) + b1) + b2`, shared across heads;
    `[B, T, H, D] -> [B, Tc, H, D_out]`. Hidden width defaults to `D`.
    """

    def __init__(self, block: int, stride: int, head_dim: int, out_dim: int | None = None,
                 hidden: int | None = None) -> None:
        super().__init__()
        self.block, self.stride = block, stride
        hidden = hidden or head_dim
        self.pos = nn.Parameter(torch.randn(block, head_dim) * 0.02)
        self.fc1 = nn.Linear(block * head_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim or head_dim)

    def forward(self, x: Tensor) -> Tensor:
        blocks = blocks_view(x, self.block, self.stride) + self.pos.to(x.dtype)
        return self.fc2(torch.nn.functional.gelu(self.fc1(blocks.flatten(-2))))
