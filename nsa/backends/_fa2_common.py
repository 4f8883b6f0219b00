"""What the two FA-2 backends (flash-attn package, torch's vendored kernels) share: their limits,
the decode alignment they need, and the bucketing of the compressed branch's staircase mask.

FA-2 takes `[B, T, H, D]` (and packed `[total, H, D]` for varlen), the same layout as nsa.ops,
so no transpose happens at this edge; SDPA and Flex are the ones that transpose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nsa import profiles
from nsa.backends import AttnCall
from nsa.masks import cmp_query_buckets


def unsupported_reason(call: AttnCall) -> str | None:
    q, k, v = call.q, call.k, call.v
    if q.device.type != "cuda":
        return f"FA-2 runs on CUDA tensors only, got {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FA-2 supports fp16/bf16 only, got {q.dtype}"
    profile = profiles.profile_for(q.device)
    if not profile.features.fa2:
        return f"FA-2 needs compute capability >= 8.0 (Ampere or later), got {profile.thresholds}"
    if q.shape[-1] != v.shape[-1]:
        return f"FA-2 needs dk == dv, got dk={q.shape[-1]}, dv={v.shape[-1]} (no silent padding)"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"FA-2 needs a head dim that is a multiple of 8 and <= 256, got {q.shape[-1]}"
    if call.op == "sliding" and call.k_start + k.shape[1] != call.q_start + q.shape[1]:
        return ("FA-2's causal window aligns the last query with the last key; got queries ending at "
                f"{call.q_start + q.shape[1]} and keys ending at {call.k_start + k.shape[1]}")
    if call.op == "compressed" and k.shape[1] == 0:
        return None  # all outputs are zero; handled without a kernel call
    return None


def compressed_with_buckets(call: AttnCall,
                            kernel: Callable[[Tensor, Tensor, Tensor, Tensor, int, int], Tensor]) -> Tensor:
    """Run the compressed branch as buckets of `stride` queries that see the same keys.

    `kernel(q_buckets [B, R, d, Hq, dk], k_cmp, v_cmp, counts [R] int32, r0, pad_front)` returns
    `[B, R, d, Hq, dv]`, where bucket r of batch b attends (non-causally) to the first
    `counts[r]` compressed tokens of batch b. Queries that see nothing get exactly 0.
    """
    q = call.q
    b, tq, hq, _ = q.shape
    dv = call.v.shape[-1]
    z, r0, counts = cmp_query_buckets(call.q_start, tq, call.block, call.stride)
    out = q.new_zeros(b, tq, hq, dv)
    if z == tq or call.k.shape[1] == 0:
        return out
    d = call.stride
    # Place the queries in whole buckets: position p -> bucket (p - (l-1)) // d, slot (p - (l-1)) % d.
    pad_front = (call.q_start + z - (call.block - 1)) - r0 * d
    n_slots = counts.numel() * d
    qb = q.new_zeros(b, n_slots, hq, q.shape[-1])
    qb[:, pad_front:pad_front + tq - z] = q[:, z:]
    ob = kernel(qb.view(b, counts.numel(), d, hq, -1), call.k, call.v, counts.to(q.device), r0, pad_front)
    out[:, z:] = ob.reshape(b, n_slots, hq, dv)[:, pad_front:pad_front + tq - z]
    return out
