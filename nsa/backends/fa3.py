"""FlashAttention-3 (the PyPI wheel `fa3-fwd`, import `fa3_fwd_interface`) as a declared backend:
the compressed branch of a prefill, forward only.

The wheel has no backward, so `CAPABILITIES.backward` is empty: a call that needs gradients never
runs here (`auto` does not plan it; naming it raises `BackendError` with the fix). The kernel
path is nsa/backends/triton_kernels/fa3_cmp.py (the packing of each compressed step's queries as
heads of one query, its conditions and measurements); a partial last step of fewer than `stride`
queries runs on the Triton one-pass kernel, so this backend needs Triton too. `auto` reaches FA-3
through the `triton` backend, whose compressed pass switches to it by `Tiles.cmp_fa3*` (it also
yields the selection scores from FA-3's log-sum-exp); this module is for asking for FA-3
by name (`backend={"cmp": "fa3"}`) and for declaring what the wheel can and cannot do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa.backends import AttnCall, caps
from nsa.backends.triton_kernels import fa3_cmp

CAPABILITIES = caps(forward=("compressed",), backward=(), decode=False)


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type not in fa3_cmp.DEVICES:
        return f"fa3 runs on CUDA tensors only, got {dev}"
    if fa3_cmp.load() is None:
        return (f"the FA-3 wheel is not importable ({fa3_cmp.MODULE}); pip install fa3-fwd on an sm90 machine "
                "(forward only: training plans never use it)")
    if dev is not None and not fa3_cmp.enabled(dev):
        return ("fa3 runs where the GPU profile has the fa3 feature (sm90, Hopper: the wheel's FA-3 kernels are "
                "Hopper's); this device's profile has it off (nsa/profiles/)")
    from nsa.backends import triton_nsa
    return triton_nsa.unavailable_reason(device)   # a partial last step runs on the Triton kernel


def unsupported_reason(call: AttnCall) -> str | None:
    q, k, v = call.q, call.k, call.v
    if q.dtype not in fa3_cmp.DTYPES:
        return f"the FA-3 wheel is built for {', '.join(map(str, fa3_cmp.DTYPES))} only, got {q.dtype}"
    if (q.shape[-1], v.shape[-1]) not in fa3_cmp._DIMS:
        return f"the FA-3 wheel has no kernel for head dims {q.shape[-1]}/{v.shape[-1]}"
    if call.q_start != 0:
        return "fa3 takes a prefill from position 0 only (q_start == 0), not a chunk or a decode step"
    if not fa3_cmp.usable(q, k, v, block=call.block, stride=call.stride, q_start=call.q_start):
        return (f"fa3 needs q contiguous as [B, T, Hq, dk], block >= stride and at least one whole step of "
                f"stride queries after the first block - 1 (got T={q.shape[1]}, block={call.block}, "
                f"stride={call.stride})")
    return None


def compressed(call: AttnCall) -> Tensor:
    from nsa.backends.triton_kernels import compressed as _cmp
    from nsa.backends.triton_kernels.tiles import current

    if call.k.shape[1] == 0:
        return call.q.new_zeros(*call.q.shape[:3], call.v.shape[-1])
    return _cmp.compressed_fa3(call.q, call.k, call.v, block=call.block, stride=call.stride, scale=call.scale,
                               tiles=current(call.q.device))
