"""FlashAttention-4 (the `flash-attn-4` wheels, import `flash_attn.cute`) as a declared backend: the
sliding window of a prefill, forward only.

Declared without a backward: this project has not checked FA-4's backward against the fp64
oracle, so a call that needs gradients never runs here (`auto` does not plan it; naming it raises
`BackendError` with the fix). The kernel path is nsa/backends/triton_kernels/fa4_win.py (FA-4's
local mask `window_size = (w - 1, 0)`, its conditions and measurements). `auto` reaches FA-4
through the `triton` backend, whose window switches to it by `Tiles.win_fa4*`; this module is for
asking for FA-4 by name (`backend={"win": "fa4"}`) and for declaring what it can and cannot do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa.backends import AttnCall, caps
from nsa.backends.triton_kernels import fa4_win

CAPABILITIES = caps(forward=("sliding",), backward=(), decode=False)


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type not in fa4_win.DEVICES:
        return f"fa4 runs on CUDA tensors only, got {dev}"
    if fa4_win.load() is None:
        return f"FA-4 is not importable ({fa4_win.MODULE}); pip install flash-attn-4 on an sm90 machine"
    if dev is not None and not fa4_win.enabled(dev):
        return ("fa4 runs where the GPU profile has the fa4 feature (sm90, Hopper: the trade was measured there); "
                "this device's profile has it off (nsa/profiles/)")
    return None


def unsupported_reason(call: AttnCall) -> str | None:
    q, k, v = call.q, call.k, call.v
    if q.dtype not in fa4_win.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"fa4 takes {', '.join(map(str, fa4_win.DTYPES))} q, k, v here, got {q.dtype}/{k.dtype}/{v.dtype}"
    if (q.shape[-1], v.shape[-1]) not in fa4_win._DIMS:
        return f"fa4 has no kernel checked here for head dims {q.shape[-1]}/{v.shape[-1]}"
    if not fa4_win.usable(q, k, v, window=call.window or 0, q_start=call.q_start, k_start=call.k_start):
        return (f"fa4 takes a whole prefill (q_start == k_start == 0, as many queries as keys) and a window >= 1; "
                f"got q_start={call.q_start}, k_start={call.k_start}, {q.shape[1]} queries, {k.shape[1]} keys, "
                f"window={call.window}")
    return None


def sliding(call: AttnCall) -> Tensor:
    return fa4_win.sliding(call.q, call.k, call.v, window=call.window, scale=call.scale)
