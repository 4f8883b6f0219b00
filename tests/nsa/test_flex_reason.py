"""`backend="flex"` on CUDA with dk != dv is refused with the reason (hardening issue, item 10).

Seen on an H100 (sliding and compressed, B2 T37 Hq8 Hkv2 dk32/dv16): the compiled kernel failed
inside torch.compile with a dynamo traceback. `unsupported_reason` reads only the tensors' device,
dtype and shape, so stand-ins that say "cuda" test it on a CPU machine.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from nsa import profiles
from nsa.backends import AttnCall, BackendError, flex


def _call(op: str, dk: int, dv: int, device: str = "cuda") -> AttnCall:
    def t(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16, shape=shape)

    return AttnCall(op=op, q=t(2, 37, 8, dk), k=t(2, 37, 2, dk), v=t(2, 37, 2, dv), scale=dk ** -0.5,
                    window=16, block=8, stride=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("op", ["sliding", "compressed", "selected"])
def test_cuda_dk_ne_dv_is_unsupported_with_the_reason(op: str) -> None:
    reason = flex.unsupported_reason(_call(op, 32, 16))
    assert reason == "FlexAttention's compiled kernel needs equal q/k and v head dims, got dk 32 != dv 16"


def test_cuda_equal_dims_and_cpu_unequal_dims_stay_supported(fake_gpu) -> None:
    fake_gpu((9, 0))
    assert flex.unsupported_reason(_call("sliding", 32, 32)) is None
    assert flex.unsupported_reason(_call("sliding", 32, 16, device="cpu")) is None


def test_the_head_dim_limit_is_the_gpu_profiles(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """128 on sm90 (head dim 192 failed there); another GPU's profile may say otherwise."""
    fake_gpu((9, 0))
    assert flex.unsupported_reason(_call("sliding", 128, 128)) is None
    assert flex.unsupported_reason(_call("sliding", 192, 192)) == \
        "FlexAttention's compiled kernel is limited to head dims <= 128 on this GPU, got 192/192"
    assert flex.unsupported_reason(_call("sliding", 192, 192, device="cpu")) is None
    smaller = dataclasses.replace(profiles.by_name("sm90"), features=profiles.Features(flex_max_head_dim=64))
    monkeypatch.setattr(profiles, "profile_for", lambda device: smaller)
    assert "head dims <= 64 on this GPU, got 96/96" in flex.unsupported_reason(_call("sliding", 96, 96))


def test_explicit_flex_raises_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from nsa import backends

    monkeypatch.setattr(backends, "resolve", lambda name, device=None: name)
    monkeypatch.setattr(flex, "unavailable_reason", lambda device=None: None)
    with pytest.raises(BackendError, match=r"backend 'flex' cannot run this sliding call: .*dk 32 != dv 16"):
        backends.run("flex", _call("sliding", 32, 16))
