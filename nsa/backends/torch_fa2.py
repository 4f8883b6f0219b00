"""FA-2 kernels vendored in PyTorch (`aten._flash_attention_forward`), for GPUs without the
flash-attn package. Same kernels, same `[B, T, H, D]` layout, same window semantics.

sliding: one batched call, `is_causal=True`, `window_size_left = w - 1`, `window_size_right = 0`
(FA-2 aligns the last query with the last key, which is also a decode step's alignment).
compressed: varlen over buckets of `stride` queries with equal visible count: every bucket's
`cu_seqlens_k` entry points at the start of its batch's compressed keys and `seqused_k` holds
the visible count (docs/pipeline.md). Memory: the padded bucket copy of q, `O(B*T*Hq*dk)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa.backends import AttnCall, _fa2_common, caps

# aten._flash_attention_forward has a derivative (sliding: the batched causal window); the
# compressed buckets pass seqused_k, which the derivative does not take, so only the sliding op trains.
# No selected op.
CAPABILITIES = caps(forward=("sliding", "compressed"), backward=("sliding",))

def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    if not torch.cuda.is_available():
        return "torch_fa2 needs CUDA (torch.cuda.is_available() is False)"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"this torch ({torch.__version__}) has no aten._flash_attention_forward"
    if device is not None and torch.device(device).type != "cuda":
        return f"torch_fa2 runs on CUDA tensors only, got {device}"
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    return _fa2_common.unsupported_reason(call)


def _fa(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None, max_q: int, max_k: int,
        causal: bool, scale: float, **kw) -> Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **kw)
    return out[0]


def sliding(call: AttnCall) -> Tensor:
    q, k, v = (x.contiguous() for x in (call.q, call.k, call.v))
    return _fa(q, k, v, None, None, q.shape[1], k.shape[1], True, call.scale,
               window_size_left=call.window - 1, window_size_right=0)


def _buckets_kernel(call: AttnCall):
    def kernel(qb: Tensor, kc: Tensor, vc: Tensor, counts: Tensor, r0: int, pad_front: int) -> Tensor:
        b, r, d, hq, dk = qb.shape
        tc = kc.shape[1]
        dev = qb.device
        n_seq = b * r
        cu_q = torch.arange(0, n_seq + 1, device=dev, dtype=torch.int32) * d
        starts = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(r) * tc
        cu_k = torch.cat([starts, torch.tensor([b * tc], device=dev, dtype=torch.int32)])
        used = counts.to(device=dev, dtype=torch.int32).repeat(b)
        out = _fa(qb.reshape(n_seq * d, hq, dk).contiguous(), kc.reshape(b * tc, *kc.shape[2:]).contiguous(),
                  vc.reshape(b * tc, *vc.shape[2:]).contiguous(), cu_q, cu_k, d, tc, False, call.scale,
                  seqused_k=used)
        return out.view(b, r, d, hq, vc.shape[-1])
    return kernel


def compressed(call: AttnCall) -> Tensor:
    return _fa2_common.compressed_with_buckets(call, _buckets_kernel(call))
