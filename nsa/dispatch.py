"""`backend="auto"`: pick the backend of each branch call from the thresholds in configs/base.yaml.

Thresholds are sequence lengths (tokens so far: T in a prefill, t + 1 in a decode step; see
`AttnCall.seq_len`). A branch uses FA-2 when that length is >= its threshold; -1 disables it.
The profile `profiles.sm<major><minor>` of the current CUDA device overrides `runtime`; CPU
tensors always use `sdpa`.

Overrides for experiments (each logged and reported by `describe()`, which results files embed):
    NSA_CONFIG=path            read thresholds from another YAML file
    NSA_PROFILE=sm90           use that profile instead of the device's
    NSA_USE_FA2=0|1            0: FA-2 off for every branch; 1: thresholds as configured (default)
    NSA_FA2_FORCE=1            FA-2 for every length; an FA-2 that cannot run then raises
    NSA_FA2_MIN_LEN_WIN=N, NSA_FA2_MIN_LEN_CMP=N   replace one threshold
`set_overrides(...)` does the same from code or a CLI flag (`python -m bench run --fa2 off|force`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from nsa import backends
from nsa.backends import AttnCall, BackendError

log = logging.getLogger("nsa.dispatch")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "base.yaml"
THRESHOLD_KEYS = {"sliding": "fa2_min_len_win", "compressed": "fa2_min_len_cmp"}

_cli_overrides: dict[str, Any] = {}
_cache: dict[tuple, Thresholds] = {}
_recorder: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "nsa_dispatch_recorder", default=None)


@dataclass(frozen=True)
class Thresholds:
    """Thresholds in force for one profile, with where each value came from."""

    profile: str
    fa2_min_len_win: int
    fa2_min_len_cmp: int
    force_fa2: bool = False
    sources: dict[str, str] = field(default_factory=dict)

    def for_op(self, op: str) -> int:
        return getattr(self, THRESHOLD_KEYS[op])


def device_profile(device: torch.device | str | None) -> str:
    """`sm90` for a CUDA device of capability 9.0, `cpu` otherwise."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def set_overrides(**values: Any) -> None:
    """Code/CLI overrides: `use_fa2`, `force_fa2`, `fa2_min_len_win`, `fa2_min_len_cmp`, `profile`,
    `config` (path). `None` removes one. Clears the threshold cache."""
    allowed = {"use_fa2", "force_fa2", "fa2_min_len_win", "fa2_min_len_cmp", "profile", "config"}
    unknown = set(values) - allowed
    if unknown:
        raise ValueError(f"override names must be among {sorted(allowed)}, got {sorted(unknown)}")
    for key, value in values.items():
        if value is None:
            _cli_overrides.pop(key, None)
        else:
            _cli_overrides[key] = value
            log.warning("nsa dispatch override from code/CLI: %s=%r", key, value)
    _cache.clear()


def _int_threshold(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{where} must be an int >= -1 (-1 disables FA-2), got {value!r}; fix the value")
    return value


def _env_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}; unset it or use 0/1")
    return raw == "1"


def thresholds(device: torch.device | str | None = None) -> Thresholds:
    """The thresholds in force for `device` (config file, profile, then env and CLI overrides)."""
    profile = str(_cli_overrides.get("profile") or os.environ.get("NSA_PROFILE") or device_profile(device))
    env_keys = ("NSA_CONFIG", "NSA_USE_FA2", "NSA_FA2_FORCE", "NSA_FA2_MIN_LEN_WIN", "NSA_FA2_MIN_LEN_CMP")
    key = (profile, tuple(os.environ.get(k) for k in env_keys), tuple(sorted(_cli_overrides.items())))
    if key not in _cache:
        _cache[key] = _load(profile)
    return _cache[key]


def _load(profile: str) -> Thresholds:
    path = Path(_cli_overrides.get("config") or os.environ.get("NSA_CONFIG") or DEFAULT_CONFIG)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ValueError(f"NSA config {path} must be readable, got {exc.strerror}; set NSA_CONFIG") from None
    runtime = doc.get("runtime") or {}
    prof = (doc.get("profiles") or {}).get(profile) or {}
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for name in THRESHOLD_KEYS.values():
        if name in prof:
            values[name], sources[name] = prof[name], f"{path.name}:profiles.{profile}.{name}"
        elif name in runtime:
            values[name], sources[name] = runtime[name], f"{path.name}:runtime.{name}"
        else:
            values[name], sources[name] = -1, "default (-1, key absent)"
        env = os.environ.get(f"NSA_{name.upper()}")
        if env not in (None, ""):
            try:
                values[name], sources[name] = int(env), f"env NSA_{name.upper()}"
            except ValueError:
                raise ValueError(f"NSA_{name.upper()} must be an int, got {env!r}") from None
        if name in _cli_overrides:
            values[name], sources[name] = _cli_overrides[name], "override (code/CLI)"
        values[name] = _int_threshold(values[name], sources[name])
    use = _cli_overrides.get("use_fa2", _env_bool("NSA_USE_FA2"))
    force = bool(_cli_overrides.get("force_fa2", _env_bool("NSA_FA2_FORCE")))
    if use is False:
        for name in values:
            values[name], sources[name] = -1, "NSA_USE_FA2=0 / use_fa2=False"
        force = False
    if force:
        for name in values:
            values[name], sources[name] = 0, "NSA_FA2_FORCE=1 / force_fa2=True"
    result = Thresholds(profile=profile, force_fa2=force, sources=sources, **values)
    if any(not s.startswith(path.name) for s in sources.values()):
        log.warning("nsa dispatch thresholds with overrides: %s", describe_thresholds(result))
    return result


def describe_thresholds(t: Thresholds) -> dict[str, Any]:
    return asdict(t)


def describe(device: torch.device | str | None = None) -> dict[str, Any]:
    """Thresholds in force and their sources, for results files and logs."""
    return describe_thresholds(thresholds(device))


def choose(call: AttnCall) -> str:
    """The backend `auto` runs for `call`; recorded (see `recording`) and logged at debug level."""
    device = call.q.device
    name, why = "sdpa", "cpu tensors always use sdpa"
    if device.type == "cuda" and call.op in THRESHOLD_KEYS:
        t = thresholds(device)
        limit = t.for_op(call.op)
        if limit < 0:
            why = f"{THRESHOLD_KEYS[call.op]}=-1 ({t.sources[THRESHOLD_KEYS[call.op]]})"
        elif call.seq_len < limit:
            why = f"seq_len {call.seq_len} < {THRESHOLD_KEYS[call.op]}={limit}"
        else:
            fa2 = backends.resolve("fa2", device)
            reason = backends.unsupported_reason(fa2, call)
            if reason is None:
                name, why = fa2, f"seq_len {call.seq_len} >= {THRESHOLD_KEYS[call.op]}={limit}"
            elif t.force_fa2:
                raise BackendError(f"FA-2 is forced (NSA_FA2_FORCE) but {fa2} cannot run: {reason}")
            else:
                why = f"FA-2 ({fa2}) cannot run this call: {reason}"
    elif device.type == "cuda":
        why = f"no FA-2 path for the {call.op} op"
    log.debug("auto %s seq_len=%d -> %s (%s)", call.op, call.seq_len, name, why)
    rec = _recorder.get()
    if rec is not None:
        rec.append({"op": call.op, "seq_len": call.seq_len, "backend": name, "why": why})
    return name


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Collect every `auto` choice made inside the block: `[{op, seq_len, backend, why}, ...]`."""
    log_list: list[dict[str, Any]] = []
    token = _recorder.set(log_list)
    try:
        yield log_list
    finally:
        _recorder.reset(token)
