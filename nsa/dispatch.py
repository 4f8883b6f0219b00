"""`backend="auto"`: pick the backend of each branch call from the thresholds in configs/base.yaml.

Thresholds are sequence lengths (tokens so far: T in a prefill, t + 1 in a decode step; see
`AttnCall.seq_len`). Each op has candidate backends in priority order (`CANDIDATES`), each with
its own threshold key; a candidate runs when the length is >= its threshold and it can run the
call, else the next one is tried, else `sdpa` (masked SDPA). -1 disables a candidate.

    op           candidates (priority order)
    compressed   triton (triton_min_len_cmp), then FA-2 (fa2_min_len_cmp)
    sliding      FA-2 (fa2_min_len_win)
    selected     triton (triton_min_len_sel)

The profile `profiles.sm<major><minor>` of the current CUDA device overrides `runtime`; CPU
tensors always use `sdpa`.

Overrides for experiments (each logged and reported by `describe()`, which results files embed):
    NSA_CONFIG=path            read thresholds from another YAML file
    NSA_PROFILE=sm90           use that profile instead of the device's
    NSA_USE_FA2=0|1            0: FA-2 off for every branch; 1: thresholds as configured (default)
    NSA_FA2_FORCE=1            FA-2 for every length; an FA-2 that cannot run then raises
    NSA_FA2_MIN_LEN_WIN=N, NSA_FA2_MIN_LEN_CMP=N   replace one FA-2 threshold
    NSA_USE_TRITON=0|1         0: the own Triton kernels off for every branch; 1: as configured
    NSA_TRITON_MIN_LEN_SEL=N, NSA_TRITON_MIN_LEN_CMP=N   replace one Triton threshold
`set_overrides(...)` does the same from code or a CLI flag (`python -m bench run --fa2 off|force`,
`--triton off`).
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


@dataclass(frozen=True)
class Candidate:
    """One backend `auto` may pick for an op: `backend` (an alias such as `fa2` resolves per
    device) from the sequence length in threshold `key` up; `family` names its switches."""

    backend: str
    key: str
    family: str  # "fa2" or "triton": NSA_USE_<FAMILY>, use_<family>, and the label in `why`


FA2, TRITON = "fa2", "triton"
CANDIDATES: dict[str, tuple[Candidate, ...]] = {
    "compressed": (Candidate("triton", "triton_min_len_cmp", TRITON), Candidate("fa2", "fa2_min_len_cmp", FA2)),
    "sliding": (Candidate("fa2", "fa2_min_len_win", FA2),),
    "selected": (Candidate("triton", "triton_min_len_sel", TRITON),),
}
# Every threshold key, FA-2's first (the order of `Thresholds`, results files and reports).
THRESHOLD_KEYS: tuple[str, ...] = ("fa2_min_len_win", "fa2_min_len_cmp", "triton_min_len_sel", "triton_min_len_cmp")
FAMILY_OF = {c.key: c.family for cands in CANDIDATES.values() for c in cands}
LABELS = {FA2: "FA-2", TRITON: "Triton"}
_ENV_KEYS = ("NSA_CONFIG", "NSA_USE_FA2", "NSA_FA2_FORCE", "NSA_USE_TRITON",
             *(f"NSA_{k.upper()}" for k in THRESHOLD_KEYS))
_OVERRIDES = ("use_fa2", "force_fa2", "use_triton", *THRESHOLD_KEYS, "profile", "config")

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
    triton_min_len_sel: int = -1
    triton_min_len_cmp: int = -1
    force_fa2: bool = False
    sources: dict[str, str] = field(default_factory=dict)

    def value(self, key: str) -> int:
        """The threshold `key` (one of THRESHOLD_KEYS)."""
        if key not in THRESHOLD_KEYS:
            raise ValueError(f"threshold key must be one of {THRESHOLD_KEYS}, got {key!r}")
        return getattr(self, key)


def device_profile(device: torch.device | str | None) -> str:
    """`sm90` for a CUDA device of capability 9.0, `cpu` otherwise."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def set_overrides(**values: Any) -> None:
    """Code/CLI overrides: `use_fa2`, `force_fa2`, `use_triton`, any threshold key
    (`fa2_min_len_win`, `fa2_min_len_cmp`, `triton_min_len_sel`, `triton_min_len_cmp`), `profile`,
    `config` (path). `None` removes one. Clears the threshold cache."""
    unknown = set(values) - set(_OVERRIDES)
    if unknown:
        raise ValueError(f"override names must be among {sorted(_OVERRIDES)}, got {sorted(unknown)}")
    for key, value in values.items():
        if value is None:
            _cli_overrides.pop(key, None)
        else:
            _cli_overrides[key] = value
            log.warning("nsa dispatch override from code/CLI: %s=%r", key, value)
    _cache.clear()


def _int_threshold(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{where} must be an int >= -1 (-1 disables that backend), got {value!r}; fix the value")
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
    key = (profile, tuple(os.environ.get(k) for k in _ENV_KEYS), tuple(sorted(_cli_overrides.items())))
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
    for name in THRESHOLD_KEYS:
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
    fa2_keys = [k for k in THRESHOLD_KEYS if FAMILY_OF[k] == FA2]
    use = _cli_overrides.get("use_fa2", _env_bool("NSA_USE_FA2"))
    force = bool(_cli_overrides.get("force_fa2", _env_bool("NSA_FA2_FORCE")))
    if use is False:
        for name in fa2_keys:
            values[name], sources[name] = -1, "NSA_USE_FA2=0 / use_fa2=False"
        force = False
    if force:
        for name in fa2_keys:
            values[name], sources[name] = 0, "NSA_FA2_FORCE=1 / force_fa2=True"
    if _cli_overrides.get("use_triton", _env_bool("NSA_USE_TRITON")) is False:
        for name in (k for k in THRESHOLD_KEYS if FAMILY_OF[k] == TRITON):
            values[name], sources[name] = -1, "NSA_USE_TRITON=0 / use_triton=False"
    result = Thresholds(profile=profile, force_fa2=force, sources=sources, **values)
    if any(not s.startswith(path.name) for s in sources.values()):
        log.warning("nsa dispatch thresholds with overrides: %s", describe_thresholds(result))
    return result


def describe_thresholds(t: Thresholds) -> dict[str, Any]:
    return asdict(t)


def describe(device: torch.device | str | None = None) -> dict[str, Any]:
    """Thresholds in force and their sources, for results files and logs."""
    return describe_thresholds(thresholds(device))


def pick(call: AttnCall, t: Thresholds) -> tuple[str, str]:
    """(backend, why) for `call` under thresholds `t`, whatever the device: the first candidate of
    `CANDIDATES[call.op]` whose threshold `seq_len` clears and that can run the call
    (`backends.unsupported_reason` is None), else `sdpa`. `why` lists every candidate passed over.
    Raises BackendError when FA-2 is forced (`t.force_fa2`) and the FA-2 candidate cannot run.
    `choose` applies it to CUDA tensors; tests call it directly on CPU ones.
    """
    cands = CANDIDATES.get(call.op, ())
    if not cands:
        return "sdpa", f"no threshold-dispatched backend for the {call.op} op"
    n = call.seq_len
    passed: list[str] = []
    for cand in cands:
        limit = t.value(cand.key)
        if limit < 0:
            passed.append(f"{cand.key}=-1 ({t.sources.get(cand.key, 'default')})")
            continue
        if n < limit:
            passed.append(f"seq_len {n} < {cand.key}={limit}")
            continue
        resolved = backends.resolve(cand.backend, call.q.device)
        reason = backends.unsupported_reason(resolved, call)
        if reason is None:
            return resolved, "; ".join([*passed, f"seq_len {n} >= {cand.key}={limit}"])
        if cand.family == FA2 and t.force_fa2:
            raise BackendError(f"FA-2 is forced (NSA_FA2_FORCE) but {resolved} cannot run: {reason}")
        passed.append(f"{LABELS[cand.family]} ({resolved}) cannot run this call: {reason}")
    return "sdpa", "; ".join(passed)


def choose(call: AttnCall) -> str:
    """The backend `auto` runs for `call`; recorded (see `recording`) and logged at debug level."""
    device = call.q.device
    name, why = "sdpa", "cpu tensors always use sdpa"
    if device.type == "cuda":
        name, why = pick(call, thresholds(device))
    record(call.op, call.seq_len, name, why)
    return name


def record(op: str, seq_len: int, backend: str, why: str) -> None:
    """Log one `auto` choice and add it to the active `recording()` (also used by nsa.module for
    its choice of the fused Triton path, op `nsa_triton_path`)."""
    log.debug("auto %s seq_len=%d -> %s (%s)", op, seq_len, backend, why)
    rec = _recorder.get()
    if rec is not None:
        rec.append({"op": op, "seq_len": seq_len, "backend": backend, "why": why})


def triton_fused_ok(seq_len: int, device: torch.device | str | None, call: AttnCall | None = None) -> bool:
    """Whether `auto` would run both the compressed and the selected branch on the own Triton
    kernels at sequence length `seq_len` (tokens so far) on `device`, so that a caller may use
    the fused compressed-attention + selection-scores kernel instead of two separate passes.

    True only on a CUDA device where the triton backend is available and `seq_len` is at least
    both `triton_min_len_cmp` and `triton_min_len_sel` (neither -1, neither switched off by
    NSA_USE_TRITON=0). Per-call limits (dtype, head dims, sel_block) need a call: pass `call`
    (any of the layer's branch calls) to require `backends.unsupported_reason("triton", call)`
    to be None as well. Records nothing; the caller records what it runs.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return False
    t = thresholds(dev)
    limits = (t.triton_min_len_cmp, t.triton_min_len_sel)
    if min(limits) < 0 or seq_len < max(limits):
        return False
    if backends.unavailable_reason("triton", dev) is not None:
        return False
    return call is None or backends.unsupported_reason("triton", call) is None


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Collect every `auto` choice made inside the block: `[{op, seq_len, backend, why}, ...]`."""
    log_list: list[dict[str, Any]] = []
    token = _recorder.set(log_list)
    try:
        yield log_list
    finally:
        _recorder.reset(token)
