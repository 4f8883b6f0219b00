"""GPU profiles: everything that depends on the kind of GPU, as one object per kind.

    profile_for(device) -> Profile(name, thresholds, tiles, features)

- `name`: the profile file it comes from: `sm90` (nsa/profiles/sm90.py), `generic`, `cpu`.
- `thresholds`: the block of `profiles:` in the config (configs/base.yaml) that nsa.dispatch
  reads for this device, `sm<major><minor>`; the values stay in YAML, where `ci pr` rewrites them.
- `tiles`: the own Triton kernels' launch parameters (nsa/profiles/tiles.py).
- `features`: what may run here (`Features`): the profile declares what its kind supports, and
  `profile_for` keeps a feature on only where the device's capability and the installed wheels
  allow it too.

A CUDA device of capability (major, minor) gets nsa/profiles/sm<major><minor>.py where that file
exists. Any other GPU gets `generic` (conservative tiles, no wheels, no PDL) with its own block
of thresholds, and one warning per device that says how to add its profile: one file here plus
one YAML block (nsa/profiles/README.md). CPU tensors, and the Triton interpreter whatever the
tensors' device (`kernel_profile`), get `cpu`.

Nothing here touches CUDA or Triton at import: the capability is read on the first call per
device, and cached.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass

import torch

from nsa.profiles.tiles import Tiles

__all__ = ["Features", "Profile", "Tiles", "by_name", "cache_clear", "interpreting", "kernel_profile", "profile_for"]

log = logging.getLogger("nsa.profiles")

# The modules the wheel features need (imported by fa3_cmp.load / fa4_win.load when they run).
WHEELS = {"fa3": "fa3_fwd_interface", "fa4": "flash_attn.cute"}
# The least capability each hardware feature needs, whatever a profile declares.
MIN_CAPABILITY = {"pdl": (9, 0), "tma": (9, 0), "fa2": (8, 0)}


@dataclass(frozen=True)
class Features:
    """What may run on a device. A profile file declares what its kind supports; `profile_for`
    turns off what this device's capability or this machine's installs do not allow."""

    pdl: bool = False    # programmatic dependent launch: decode kernels B-D (sm90+, Triton's gdc intrinsics)
    tma: bool = False    # tensor-memory-accelerator loads (sm90+); no kernel uses them yet
    fa2: bool = False    # FlashAttention-2's kernels (sm80+); whether its library is installed is each backend's check
    fa3: bool = False    # the fa3-fwd wheel for the compressed pass (fa3_cmp.py; its kernels are Hopper's)
    fa4: bool = False    # the flash-attn-4 wheel for the window (fa4_win.py)
    flex_max_head_dim: int = 128   # the largest head dim FlexAttention's compiled kernel takes here

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = int if f.name == "flex_max_head_dim" else bool
            if not isinstance(value, want) or (want is int and (isinstance(value, bool) or value < 0)):
                raise ValueError(f"Features.{f.name} must be a {'non-negative int' if want is int else 'bool'}, "
                                 f"got {value!r}")


@dataclass(frozen=True)
class Profile:
    """One kind of GPU: see the module doc."""

    name: str
    thresholds: str
    tiles: Tiles
    features: Features

    def __post_init__(self) -> None:
        if not isinstance(self.tiles, Tiles) or not isinstance(self.features, Features):
            raise TypeError(f"Profile {self.name!r} needs a Tiles and a Features, got "
                            f"{type(self.tiles).__name__} and {type(self.features).__name__}")


def interpreting() -> bool:
    """Triton's interpreter is on (read per call: tests set and unset it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def profile_for(device: torch.device | str | None) -> Profile:
    """The profile of `device`: `cpu` for anything but a CUDA device; a GPU's from its capability."""
    # Asked per call by dispatch and the kernels: no more than a device check and a cache lookup.
    dev = device if isinstance(device, torch.device) else torch.device(device if device is not None else "cpu")
    if dev.type != "cuda":
        return _cpu()
    return _cuda(dev.index if dev.index is not None else _current_index())


def kernel_profile(device: torch.device | str | None) -> Profile:
    """The profile the own Triton kernels run under: `cpu` under Triton's interpreter, which runs
    them on the CPU whatever the tensors' device (its small tiles, no PDL), else `profile_for`."""
    profile = profile_for(device)
    return _cpu() if profile.name != "cpu" and interpreting() else profile


def by_name(name: str) -> Profile:
    """A profile by name, as declared (features not checked against a device): `cpu`, `generic`,
    or `sm<major><minor>` (its file, else `generic` with that block of thresholds)."""
    if name in ("cpu", "generic"):
        return _declared(name)
    if re.fullmatch(r"sm\d+", name):
        found = _declared(name)
        return found if found is not None else dataclasses.replace(_declared("generic"), thresholds=name)
    raise ValueError(f"profile must be 'cpu', 'generic' or 'sm<major><minor>', got {name!r}; "
                     "use profile_for(device) for a device's own")


def cache_clear() -> None:
    """Forget the profiles read so far (tests that add a profile file or fake a device's capability)."""
    _cuda.cache_clear()
    _declared.cache_clear()


def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _current_index() -> int:
    return torch.cuda.current_device()


@functools.cache
def _cuda(index: int) -> Profile:
    # A device's capability never changes within a process, and dispatch asks on every call.
    capability = _capability(index)
    kind = f"sm{capability[0]}{capability[1]}"
    declared = _declared(kind)
    if declared is None:
        log.warning(
            "GPU cuda:%d is %s, which has no profile in nsa/profiles/: it runs with the conservative 'generic' "
            "tiles, without FA-3, FA-4 or PDL, and with the thresholds of profiles.%s in the config (else "
            "'runtime'). To tune it, add nsa/profiles/%s.py (start from sm90.py) and a '%s:' block under "
            "'profiles:' in configs/base.yaml; see nsa/profiles/README.md", index, kind, kind, kind, kind)
        declared = dataclasses.replace(_declared("generic"), thresholds=kind)
    return dataclasses.replace(declared, features=_allowed(declared.features, capability))


def _cpu() -> Profile:
    profile = _declared("cpu")
    assert profile is not None, "nsa/profiles/cpu.py is part of the package"
    return profile


@functools.cache
def _declared(name: str) -> Profile | None:
    """`PROFILE` of nsa/profiles/<name>.py, or None where there is no such file."""
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None
    profile = getattr(module, "PROFILE", None)
    if not isinstance(profile, Profile) or profile.name != name:
        raise TypeError(f"{module.__file__} must define PROFILE = Profile(name={name!r}, ...), got {profile!r}")
    return profile


def _allowed(declared: Features, capability: tuple[int, int]) -> Features:
    """`declared` with what this capability and this machine's installs cannot run turned off."""
    on = {f.name: getattr(declared, f.name) for f in dataclasses.fields(declared)}
    for name, least in MIN_CAPABILITY.items():
        on[name] = on[name] and capability >= least
    on["pdl"] = on["pdl"] and _triton_has_gdc()
    for name, module in WHEELS.items():
        on[name] = on[name] and _installed(module)
    return Features(**on)


def _triton_has_gdc() -> bool:
    """Triton has the grid-dependency-control intrinsics PDL needs (decode.py imports them)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def _installed(module: str) -> bool:
    """`module` can be found, without importing it (FA-4's import takes seconds); a broken install
    still fails at its use (`load()`), which then keeps the own kernel."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # noqa: BLE001 - a parent package that fails to import (a missing CUDA library) may raise anything
        return False
