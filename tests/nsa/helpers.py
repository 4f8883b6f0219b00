"""Test helpers: random inputs (never zeros) and the error measure."""

from __future__ import annotations

import torch
from torch import Tensor


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def qkv(b: int, t: int, hq: int, hkv: int, dk: int, dv: int, dtype: torch.dtype = torch.float32,
        device: str = "cpu", tk: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    tk = t if tk is None else tk
    return (rand(b, t, hq, dk, dtype=dtype, device=device), rand(b, tk, hkv, dk, dtype=dtype, device=device),
            rand(b, tk, hkv, dv, dtype=dtype, device=device))


def rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    denom = ref.norm()
    return float((out - ref).norm() / denom) if denom > 0 else float((out - ref).norm())
