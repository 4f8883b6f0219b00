"""Visibility rules of the three branches, as boolean masks over token positions.

One definition serves prefill (queries at positions 0..T-1) and decode (one query at position t,
keys from a cache). The `sdpa`, `flex` and FA-2 (`flash_attn`, `torch_fa2`) backends build their
masks or bounds from these functions; the `triton` kernels (`nsa.backends.triton_nsa`) apply the
same rules inside the kernel, and the parity tests hold them to these. The fp64 oracle
(`nsa.reference`) re-derives the rules independently with per-token loops.
"""

from __future__ import annotations

import torch
from torch import Tensor


def n_compressed(seq_len: int, block: int, stride: int) -> int:
    """Number of compressed tokens for `seq_len` raw tokens: token i covers `[i*d, i*d + l)`."""
    return 0 if seq_len < block else (seq_len - block) // stride + 1


def cmp_visible_count(pos: Tensor, block: int, stride: int) -> Tensor:
    """`n_cmp(t)`: compressed tokens whose block is complete at position t (`i*d + l - 1 <= t`)."""
    return torch.where(pos + 1 < block, torch.zeros_like(pos), (pos + 1 - block) // stride + 1)


def positions(start: int, length: int, device: torch.device | str) -> Tensor:
    return torch.arange(start, start + length, device=device)


def sliding_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """`[Tq, Tk]`: key s visible to query t iff `t - w < s <= t`."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)


def compressed_mask(q_pos: Tensor, n_cmp_keys: int, block: int, stride: int) -> Tensor:
    """`[Tq, Tc]`: compressed token i visible to query t iff its block ends at or before t."""
    idx = torch.arange(n_cmp_keys, device=q_pos.device)
    return idx[None, :] < cmp_visible_count(q_pos, block, stride)[:, None]


def selected_block_onehot(block_indices: Tensor, n_blocks: int) -> Tensor:
    """`[B, Tq, Hkv, n_blocks]` bool from `[B, Tq, Hkv, n]` indices (`-1` = empty slot)."""
    valid = block_indices >= 0
    idx = torch.where(valid, block_indices, torch.zeros_like(block_indices)).clamp_max(n_blocks - 1)
    in_range = valid & (block_indices < n_blocks)
    # Count hits per block, so duplicate indices cannot unset a block (scatter of bools would).
    counts = torch.zeros(*block_indices.shape[:-1], n_blocks, dtype=torch.int32, device=block_indices.device)
    counts.scatter_add_(-1, idx, in_range.to(torch.int32))
    return counts > 0


def selected_mask(block_indices: Tensor, q_pos: Tensor, k_pos: Tensor, sel_block: int, n_blocks: int) -> Tensor:
    """`[B, Hkv, Tq, Tk]`: key s visible to query t iff s's block is selected for t and `s <= t`.

    `n_blocks`: selection blocks up to the last key position (`k_pos.max() // sel_block + 1`),
    passed by the caller, who knows the positions, rather than read back from the GPU (a host
    synchronisation, which would also keep the call out of a CUDA graph)."""
    onehot = selected_block_onehot(block_indices, n_blocks)          # [B, Tq, Hkv, Nb]
    by_key = onehot[..., k_pos // sel_block]                         # [B, Tq, Hkv, Tk]
    causal = k_pos[None, :] <= q_pos[:, None]                        # [Tq, Tk]
    return by_key.permute(0, 2, 1, 3) & causal


def selected_tokens(block_indices: Tensor, q_pos: Tensor, sel_block: int, k_start: int,
                    n_keys: int) -> tuple[Tensor, Tensor]:
    """The raw tokens each (query, KV group) reads, as gather indices: the list form of `selected_mask`.

    `block_indices [B, Tq, Hkv, n]` (`-1` = empty slot) for queries at positions `q_pos [Tq]`; keys
    sit at positions `k_start .. k_start + n_keys - 1`. Slot j stands for tokens
    `[idx*l', (idx+1)*l')`. Returns `(key, visible)`, both `[B, Tq, Hkv, n * l']`: the key index
    of each token (0 where not visible, so gathering with it is always in range) and whether it
    counts: its slot is not `-1`, does not repeat an earlier slot of the row (a duplicate block
    must not enter the softmax twice, as it cannot in the mask form), the token is `<= t`, and
    its key exists. Memory: `O(B * Tq * Hkv * n * l')` plus `O(B * Tq * Hkv * n^2)` for duplicates.
    """
    same = block_indices[..., :, None] == block_indices[..., None, :]       # [B, Tq, Hkv, n, n]
    repeat = same.tril(-1).any(-1)                                          # equals an earlier slot
    slot_ok = (block_indices >= 0) & ~repeat
    tok = block_indices[..., None] * sel_block + torch.arange(sel_block, device=block_indices.device)
    key = tok - k_start                                                     # [B, Tq, Hkv, n, l']
    visible = slot_ok[..., None] & (tok <= q_pos[None, :, None, None, None]) & (key >= 0) & (key < n_keys)
    key = torch.where(visible, key, torch.zeros_like(key))
    return key.flatten(3), visible.flatten(3)


def cmp_query_buckets(q_start: int, tq: int, block: int, stride: int) -> tuple[int, int, Tensor]:
    """Group queries of equal visible compressed count, for kernels without a staircase mask.

    Queries `q_start .. q_start+tq-1`. The first `z` of them see nothing (`t + 1 < l`); from
    position `l - 1` on, every run of `d` consecutive queries (bucket r covers positions
    `l-1 + r*d .. l-1 + r*d + d - 1`) sees the same `r + 1` compressed tokens.
    Returns `(z, r0, counts)`: leading empty queries, the first bucket index, and the visible
    count of each bucket from r0 on (int32, one per bucket that holds a query).
    """
    z = min(tq, max(0, block - 1 - q_start))
    if z == tq:
        return z, 0, torch.zeros(0, dtype=torch.int32)
    first, last = q_start + z, q_start + tq - 1
    r0, r1 = (first - (block - 1)) // stride, (last - (block - 1)) // stride
    return z, r0, torch.arange(r0 + 1, r1 + 2, dtype=torch.int32)
