"""Packed sequences (varlen): `cu_seqlens` in flash-attn's convention, read once on the host.

A pack holds N sequences one after another along one token axis of `total_T` tokens; sequence i
is tokens `cu_seqlens[i] .. cu_seqlens[i+1] - 1`. `cu_seqlens` is int32 `[N+1]`, starts at 0,
never decreases (an empty sequence repeats a value) and ends at `total_T`, on the device of the
tensors it describes.

    cu_seqlens = [0, 3, 3, 7]      sequences of 3, 0 and 4 tokens
    token      0 1 2 | 3 4 5 6
    position   0 1 2 | 0 1 2 3      (RoPE, compression and selection blocks restart per sequence)
"""

from __future__ import annotations

import torch
from torch import Tensor


def seq_bounds(cu_seqlens: Tensor, total: int, device: torch.device) -> list[int]:
    """`cu_seqlens` validated and read to the host: the one host read of a packed call (a device
    synchronisation when it lives on a GPU). Raises ValueError/TypeError saying how to fix it."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor [N+1] (flash-attn's convention), got "
                        f"{type(cu_seqlens).__name__}; build it with torch.tensor([0, len0, len0 + len1, ...], "
                        "dtype=torch.int32)")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (flash-attn's convention), got {cu_seqlens.dtype}; "
                        "pass cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] with N >= 1 sequences, got shape {list(cu_seqlens.shape)}; "
                         "for one sequence of T tokens pass [0, T]")
    if cu_seqlens.device != torch.device(device):
        raise ValueError(f"cu_seqlens must be on the device of the packed tensors ({device}), got "
                         f"{cu_seqlens.device}; pass cu_seqlens.to({str(device)!r})")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}; it holds the cumulative lengths "
                         "[0, len0, len0 + len1, ...]")
    drops = [i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {bounds[i]} < "
                         f"cu_seqlens[{i - 1}] = {bounds[i - 1]}; an empty sequence repeats the previous value")
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens must end at the packed length total_T = {total}, got {bounds[-1]}; "
                         "the last entry is the sum of all sequence lengths")
    return bounds


def positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Each token's position within its own sequence, int64 `[total_T]`, on the device of
    `cu_seqlens` (checked by `seq_bounds` first), computed there: no host read, no copy."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    first = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - first
