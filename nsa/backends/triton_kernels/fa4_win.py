"""Prefill sliding window through FlashAttention-4 where the `flash-attn-4` wheel is installed
(CuTe DSL kernels, import `flash_attn.cute`): the same band `t - w < s <= t` as the Triton band
kernel (sliding.py), one call, FA-4's local mask `window_size = (w - 1, 0)` with its causal
right edge. Layout `[B, T, H, D]` in and out, as ours; GQA by FA-4's own head mapping (KV head
`h // G`, the same as `nsa.ops`), so no repeated keys.

Where it runs: CUDA where the GPU profile has the `fa4` feature (sm90), bf16, the head-dim pairs in `_DIMS` (each checked against the fp64
oracle on the H100: tests/nsa/test_fa4_win.py), a prefill over the whole sequence (`q_start ==
k_start == 0`, as many queries as keys), `Tiles.win_fa4`, `B * Hq * T**2` at least
`Tiles.win_fa4_min_work` (smaller prefills are bound by the host, and FA-4's call costs it
~0.3-0.5 ms); else the caller runs the band kernel.
FA-4 compiles a kernel per configuration on its first call in a process (3.0-3.6 s in the stored run,
2.7-4.9 s over three runs of `fa4_window.py` on the H100); later calls reuse it.

Measured on the H100 (`lab/fa4_window.py`, `results/h100/fa4-win/`), the window
alone, w = 512, median ms, band kernel -> FA-4: 64/4 heads 8k 0.41 -> 0.33, 16k 0.82 -> 0.68, 64k
3.53 -> 2.71, 128k 7.68 -> 6.20; 32/8 at 64k 1.77 -> 1.40; 16/16 at 64k 0.89 -> 0.72; the paper's
dk 192 / dv 128 at 64/4: 16k 1.25 -> 0.70, 64k 5.11 -> 3.01. The whole forward (`auto`,
`fa4_forward.py`): 64/4 at 64k 35.5 -> 34.5 ms, dk 192 at 64k 58.4 -> 55.9.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch
from torch import Tensor

from nsa import profiles

MODULE = profiles.WHEELS["fa4"]
# Devices and dtypes it takes here (bf16: what was measured). CPU tests add "cpu" and fp32 to
# drive a pure-torch double.
DEVICES = ("cuda",)
DTYPES = (torch.bfloat16,)
_DIMS = {(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)}


_QUIET: list[bool] = []


def load() -> ModuleType | None:
    """FA-4's interface module (with `flash_attn_func`), or None where it is not installed or
    cannot load (a missing CuTe DSL or CUDA library raises more than ImportError)."""
    try:
        mod = importlib.import_module(MODULE)
    except Exception:  # noqa: BLE001 - a broken install may raise anything on import
        return None
    if not hasattr(mod, "flash_attn_func"):
        return None
    if not _QUIET:
        # The CuTe DSL warns at each compile that FA-4's `aux_data` argument is no JIT argument:
        # one filter for that message alone, set once (a `catch_warnings` per call would swap
        # the process's filters under other threads).
        warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument",
                                category=UserWarning)
        _QUIET.append(True)
    return mod


def enabled(device: torch.device) -> bool:
    """The device's GPU profile has the `fa4` feature (sm90: the trade was measured there); other
    CUDA GPUs keep the band kernel. Non-CUDA devices (the tests' double) pass."""
    return device.type != "cuda" or profiles.profile_for(device).features.fa4


def usable(q: Tensor, k: Tensor, v: Tensor, *, window: int, q_start: int, k_start: int) -> bool:
    """FA-4 can take this window call (the module doc's conditions)."""
    return (q.device.type in DEVICES and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and (q.shape[-1], v.shape[-1]) in _DIMS and q_start == 0 and k_start == 0
            and q.shape[1] == k.shape[1] and window >= 1 and enabled(q.device) and load() is not None)


def sliding(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float) -> Tensor:
    """`q [B, T, Hq, dk]` over `k/v [B, T, Hkv, d*]`, query t reading keys `max(0, t - w + 1) .. t`
    -> `[B, T, Hq, dv]` (call `usable` first)."""
    fa4 = load()
    if fa4 is None:
        raise RuntimeError(f"{MODULE} is not importable; check fa4_win.usable(...) before fa4_win.sliding")
    out, _ = fa4.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=(window - 1, 0))
    return out
