"""The launch parameters the own Triton kernels run with: the `Tiles` of the device's GPU profile
(nsa/profiles/; `cpu` under Triton's interpreter), or the `use_tiles(...)` override in force. A
caller that wants other values (bench/triton_tiles.py, tests) passes `tiles=` to the facade
functions or scopes an override with `use_tiles(...)`; nothing mutates a shared table.

No triton import here: the registry reads profiles on machines without triton too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from nsa import profiles
from nsa.profiles import interpreting
from nsa.profiles.tiles import HOST_FLOORS, Tiles

__all__ = ["HOST_FLOORS", "Tiles", "current", "interpreting", "tiles", "use_tiles"]

_override: contextvars.ContextVar[Tiles | None] = contextvars.ContextVar("nsa_triton_tiles", default=None)


def tiles(profile: str) -> Tiles:
    """The tiles of the profile named `profile` (`sm90`, `generic`, `cpu`; an `smXY` without a
    profile file gets `generic`'s)."""
    return profiles.by_name(profile).tiles


def current(device: torch.device | str) -> Tiles:
    """The `use_tiles` override when one is active, else the tiles of the device's profile."""
    override = _override.get()
    return override if override is not None else profiles.kernel_profile(device).tiles


@contextlib.contextmanager
def use_tiles(value: Tiles) -> Iterator[Tiles]:
    """Run the kernels with `value` inside the block (sweeps, tests), whatever the device's profile."""
    if not isinstance(value, Tiles):
        raise TypeError(f"use_tiles must get a Tiles, got {type(value).__name__}; "
                        "build one with dataclasses.replace(tiles(profile), field=...)")
    token = _override.set(value)
    try:
        yield value
    finally:
        _override.reset(token)
