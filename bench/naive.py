"""Straightforward attention in plain torch matmuls: the benches' reference and `naive` backend.

Explicit `softmax(q k^T * scale + mask) v` with the branch's boolean mask, no fused kernel, no
fp64. Tensors are `[B, T, H, D]`; q has `Hq` heads, k and v have `Hkv` (GQA, `Hq % Hkv == 0`,
query head `h` reads KV head `h // (Hq / Hkv)`). Queries are processed in chunks so the score
matrix stays within `_CHUNK_BYTES`. A query with no visible key gets exactly 0.

With `upcast=True` everything runs in fp32 with full-precision matmuls (no TF32): the "fp32
computation of the same op" that parity is measured against. With `upcast=False` matmuls run in
the input dtype and the softmax in fp32, the usual same-dtype PyTorch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CHUNK_BYTES = 512 * 1024 * 1024
MaskFn = Callable[[int, int], torch.Tensor]  # (t0, t1) -> bool mask [..., t1 - t0, S]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskFn, *,
              scale: float | None = None, upcast: bool = False) -> torch.Tensor:
    """`[B, T, Hq, Dk] x [B, S, Hkv, Dk] x [B, S, Hkv, Dv] -> [B, T, Hq, Dv]` under `mask(t0, t1)`,
    which returns `[t1-t0, S]` (shared) or `[B, Hkv, t1-t0, S]` (per KV head) booleans."""
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Hq % Hkv:
        raise ValueError(f"query heads must be a multiple of KV heads, got Hq={Hq}, Hkv={Hkv}")
    out_dtype = q.dtype
    scale = Dk ** -0.5 if scale is None else scale
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, Dk).permute(0, 2, 3, 1, 4)   # [B, Hkv, G, T, Dk]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)                    # [B, Hkv, 1, Dk, S]
    vt = v.permute(0, 2, 1, 3).unsqueeze(2)                    # [B, Hkv, 1, S, Dv]
    chunk = max(1, _CHUNK_BYTES // max(1, B * Hq * max(S, 1) * 4))
    out = torch.zeros(B, Hkv, G, T, Dv, dtype=out_dtype, device=q.device)
    if S == 0:
        return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv)
    with _highest_precision(upcast):
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            m = mask(t0, t1)
            m = m.unsqueeze(-3) if m.dim() == 4 else m             # per KV head -> broadcast over G
            scores = torch.matmul(qg[:, :, :, t0:t1], kt).float() * scale
            scores = scores.masked_fill(~m, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)                # rows with no visible key -> 0
            o = torch.matmul(probs.to(vt.dtype), vt)
            out[:, :, :, t0:t1] = o.to(out_dtype)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv)


class _highest_precision:
    """fp32 matmuls without TF32 for the reference, restored afterwards."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        self.saved = torch.get_float32_matmul_precision()
        if self.enabled:
            torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc: object) -> None:
        torch.set_float32_matmul_precision(self.saved)


def sliding_mask(T: int, window: int, device: torch.device) -> MaskFn:
    """Query t reads keys `max(0, t - w + 1) ... t`."""
    s = torch.arange(T, device=device)

    def mask(t0: int, t1: int) -> torch.Tensor:
        t = torch.arange(t0, t1, device=device)[:, None]
        return (s[None, :] <= t) & (s[None, :] > t - window)
    return mask


def compressed_mask(Tc: int, block: int, stride: int, device: torch.device) -> MaskFn:
    """Query t reads compressed token i iff `i*stride + block - 1 <= t` (its block is complete)."""
    last = torch.arange(Tc, device=device) * stride + block - 1

    def mask(t0: int, t1: int) -> torch.Tensor:
        t = torch.arange(t0, t1, device=device)[:, None]
        return last[None, :] <= t
    return mask


def selected_mask(indices: torch.Tensor, T: int, sel_block: int) -> MaskFn:
    """Query t of KV head h reads raw token s iff `s // sel_block` is in `indices[b, t, h]` and
    `s <= t`; indices are `[B, T, Hkv, n]` block numbers padded with -1."""
    B, _, Hkv, _ = indices.shape
    device = indices.device
    n_blocks = -(-T // sel_block)
    s = torch.arange(T, device=device)

    def mask(t0: int, t1: int) -> torch.Tensor:
        idx = indices[:, t0:t1].long()
        idx = torch.where(idx < 0, n_blocks, idx)                   # padding -> a dummy block
        hit = torch.zeros(B, t1 - t0, Hkv, n_blocks + 1, dtype=torch.bool, device=device)
        hit.scatter_(-1, idx, True)
        tok = hit[..., :n_blocks].repeat_interleave(sel_block, dim=-1)[..., :T]   # [B, t, Hkv, T]
        t = torch.arange(t0, t1, device=device)[:, None]
        causal = s[None, :] <= t
        return tok.permute(0, 2, 1, 3) & causal
    return mask


def sliding(q, k, v, *, window: int, scale=None, upcast=False) -> torch.Tensor:
    return attention(q, k, v, sliding_mask(k.shape[1], window, q.device), scale=scale, upcast=upcast)


def compressed(q, k_cmp, v_cmp, *, block: int, stride: int, scale=None, upcast=False) -> torch.Tensor:
    mask = compressed_mask(k_cmp.shape[1], block, stride, q.device)
    return attention(q, k_cmp, v_cmp, mask, scale=scale, upcast=upcast)


def selected(q, k, v, indices, *, sel_block: int, scale=None, upcast=False) -> torch.Tensor:
    mask = selected_mask(indices, k.shape[1], sel_block)
    return attention(q, k, v, mask, scale=scale, upcast=upcast)


def causal(q, k, v, *, scale=None, upcast=False) -> torch.Tensor:
    return sliding(q, k, v, window=k.shape[1], scale=scale, upcast=upcast)
