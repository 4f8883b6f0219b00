"""Workloads of one NSA branch op (`sliding`, `compressed`, `selected`) for the fa2, masked and
calibration suites. Imports torch and nsa, so suites import it inside `build` only.

Variants run `nsa.ops` with an explicit backend (`sdpa`, `fa2`, `flex`, ...) or the bench's own
`naive` path (plain matmuls, bench.naive); every one sees the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench import naive, parity
from bench.cases import Cell, Workload

NAIVE = "naive"


def _inputs(cell: Cell, device: torch.device) -> dict[str, Any]:
    from nsa import ops

    p = cell.params
    q, k, v = parity.qkv(p, device)
    inputs: dict[str, Any] = {"q": q, "k": k, "v": v}
    if cell.op in ("compressed", "selected"):
        inputs["k_cmp"], inputs["v_cmp"] = ops.compress_kv(k, v, block=p["block"], stride=p["stride"])
    if cell.op == "selected":
        inputs["indices"] = ops.select_blocks(q, inputs["k_cmp"], block=p["block"], stride=p["stride"],
                                              sel_block=p["sel_block"], sel_count=p["sel_count"])
    return inputs


def _nsa_call(op: str, x: dict[str, Any], p: dict[str, Any], backend: str) -> Callable[[], Any]:
    from nsa import ops

    if op == "sliding":
        return lambda: ops.sliding_window_attention(x["q"], x["k"], x["v"], window=p["window"], backend=backend)
    if op == "compressed":
        return lambda: ops.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], block=p["block"],
                                                stride=p["stride"], backend=backend)
    if op == "selected":
        return lambda: ops.selected_attention(x["q"], x["k"], x["v"], x["indices"],
                                              sel_block=p["sel_block"], backend=backend)
    raise ValueError(f"op must be sliding, compressed or selected, got {op!r}")


def _naive_call(op: str, x: dict[str, Any], p: dict[str, Any], upcast: bool) -> Callable[[], Any]:
    if op == "sliding":
        return lambda: naive.sliding(x["q"], x["k"], x["v"], window=p["window"], upcast=upcast)
    if op == "compressed":
        return lambda: naive.compressed(x["q"], x["k_cmp"], x["v_cmp"], block=p["block"],
                                        stride=p["stride"], upcast=upcast)
    if op == "selected":
        return lambda: naive.selected(x["q"], x["k"], x["v"], x["indices"], sel_block=p["sel_block"],
                                      upcast=upcast)
    raise ValueError(f"op must be sliding, compressed or selected, got {op!r}")


def _attn_call(op: str, x: dict[str, Any], p: dict[str, Any]) -> Any:
    from nsa.backends import AttnCall

    q = x["q"]
    scale = q.shape[-1] ** -0.5
    if op == "sliding":
        return AttnCall(op, q, x["k"], x["v"], scale, window=p["window"])
    if op == "compressed":
        return AttnCall(op, q, x["k_cmp"], x["v_cmp"], scale, block=p["block"], stride=p["stride"])
    return AttnCall(op, q, x["k"], x["v"], scale, sel_block=p["sel_block"], block_indices=x["indices"])


def _resolve(name: str, op: str, x: dict[str, Any], p: dict[str, Any],
             device: torch.device) -> tuple[str, str | None]:
    """(the backend that would run, why it cannot run here or None)."""
    from nsa import backends

    try:
        resolved = backends.resolve(name, device)
        return resolved, backends.unsupported_reason(resolved, _attn_call(op, x, p))
    except Exception as exc:  # noqa: BLE001 - a backend module that fails to import is unavailable
        return name, f"{type(exc).__name__}: {exc}"


def build(cell: Cell, device: torch.device, *, basis: str = "sdpa", check: bool = True) -> Workload:
    """Inputs once, one fn per variant, and (with `check`) the fp32 reference and tolerance basis.

    `basis` is the same-dtype path whose error against fp32 sets the tolerance: `sdpa` (masked
    SDPA, the fa2 suite's rule) or `naive` (the plain-matmul path).
    """
    p = cell.params
    x = _inputs(cell, device)
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    for variant in cell.variants:
        key = variant.key
        if variant.backend == NAIVE:
            work.fns[key], work.backends[key] = _naive_call(cell.op, x, p, upcast=False), NAIVE
            continue
        resolved, reason = _resolve(variant.backend, cell.op, x, p, device)
        work.backends[key] = resolved
        if reason is not None:
            work.reasons[key] = reason
        else:
            work.fns[key] = _nsa_call(cell.op, x, p, resolved)
    if check:
        work.reference = _naive_call(cell.op, x, p, upcast=True)
        work.tol_basis = _naive_call(cell.op, x, p, upcast=False) if basis == NAIVE else \
            _nsa_call(cell.op, x, p, "sdpa")
    return work
