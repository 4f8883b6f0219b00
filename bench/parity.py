"""Inputs and the parity rule shared by every suite.

Rule (flash-attention's): a candidate's max abs error against an fp32 computation of the same
op may be at most twice the error of the same-dtype PyTorch path (masked SDPA, or the naive
matmul path) against that fp32 computation, plus a small absolute floor for the case where the
PyTorch path happens to be exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The floor is a few output roundings at |o| ~ 1 (bf16 eps 2^-8, fp16 2^-11) and a little more
# than fp32 reordering noise.
FLOORS = {"bf16": 4e-3, "fp16": 5e-4, "fp32": 1e-5}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
          gen: torch.Generator) -> torch.Tensor:
    """Standard normal (never zeros: zeros hide masking bugs), drawn in fp32 then cast."""
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def qkv(params: dict[str, Any], device: torch.device | str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q `[B, T, Hq, Dk]`, k `[B, T, Hkv, Dk]`, v `[B, T, Hkv, Dv]` for a case's params."""
    B, T, Hq, Hkv = params["B"], params["T"], params["Hq"], params["Hkv"]
    Dk, Dv = params["Dk"], params.get("Dv", params["Dk"])
    dtype, gen = dtype_of(params["dtype"]), generator(device, seed)
    return (randn((B, T, Hq, Dk), dtype, device, gen), randn((B, T, Hkv, Dk), dtype, device, gen),
            randn((B, T, Hkv, Dv), dtype, device, gen))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check(out: torch.Tensor, ref: torch.Tensor, basis: torch.Tensor, dtype: str) -> dict[str, Any]:
    """The `parity` record of a case: `out` and `basis` (same dtype) against fp32 `ref`."""
    if out.shape != ref.shape:
        return {"max_abs_err": None, "rel_err": None, "tol": None, "passed": False,
                "detail": f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"}
    err, basis_err = _max_abs(out, ref), _max_abs(basis, ref)
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    if not math.isfinite(basis_err):
        return {"max_abs_err": None, "rel_err": None, "tol": None, "passed": False,
                "detail": "the tolerance basis (same-dtype PyTorch path) holds NaN or infinity"}
    tol = 2.0 * basis_err + FLOORS.get(dtype, 0.0)
    if not math.isfinite(err):
        return {"max_abs_err": None, "rel_err": None, "tol": tol, "passed": False,
                "detail": "output holds NaN or infinity"}
    return {"max_abs_err": err, "rel_err": err / scale if scale > 0 else err, "tol": tol,
            "passed": err <= tol, "basis_err": basis_err}
