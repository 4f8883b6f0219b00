"""`backend="auto"`: one plan per call, from the decision keys (nsa.keys) and the config (nsa.settings).

A threshold is a sequence length (tokens so far: T in a prefill, t + 1 in a decode step). For each
branch, the keys of `nsa.keys.for_branch` are tried in priority order: a key's backend runs the
branch when the length is >= its threshold for this GPU profile and this call's shape class, and
the backend can run the call (`backends.unsupported_reason`); a branch with none runs masked SDPA
(`sdpa`, which never builds a T x T mask at long T). CPU tensors always use `sdpa`.

The value for (profile, class) comes from `profiles.sm<major><minor>`, else `runtime`, else -1
(nsa.settings); the device's GPU profile (nsa.profiles) names that block. Overrides for experiments, each logged and written into every results file by
`describe()`:
    NSA_CONFIG=path                 read another config file
    NSA_PROFILE=sm90                use that profile instead of the device's (one the config defines)
    NSA_<KEY>=N                     replace one key for every class (e.g. NSA_FA2_MIN_LEN_WIN=4096)
    NSA_USE_<FAMILY>=0|1            0: every key of that family off (NSA_USE_FA2, NSA_USE_TRITON)
    NSA_FA2_FORCE=1                 FA-2 keys at 0; an FA-2 that cannot run then raises
`set_overrides(...)` does the same from code or a CLI flag (`python -m bench run --fa2 off|force`,
`--triton off`, `--<key> N`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nsa import backends, keys, profiles, settings
from nsa.backends import AttnCall, BackendError

log = logging.getLogger("nsa.dispatch")

THRESHOLD_KEYS: tuple[str, ...] = keys.names()
FORCEABLE = ("fa2",)
_OVERRIDES = ("profile", "config", *(f"use_{f}" for f in keys.FAMILIES), *(f"force_{f}" for f in FORCEABLE),
              *THRESHOLD_KEYS)

_cli_overrides: dict[str, Any] = {}
_cache: dict[tuple, Thresholds] = {}
_recorder: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "nsa_dispatch_recorder", default=None)


@dataclass(frozen=True, eq=False)  # hashed by identity: it keys its own plan cache
class Thresholds:
    """The thresholds in force for one profile: the config plus overrides, per class on demand."""

    profile: str
    config: settings.Settings
    overrides: dict[str, tuple[int, str]] = field(default_factory=dict)
    forced: frozenset[str] = frozenset()

    def lookup(self, key: str, cls: str) -> tuple[int, str]:
        """(value, source) of `key` in class `cls`."""
        if key in self.overrides:
            return self.overrides[key]
        return self.config.value(key, self.profile, cls)

    def value(self, key: str, cls: str = "g16") -> int:
        return self.lookup(key, cls)[0]

    @property
    def force_fa2(self) -> bool:
        return "fa2" in self.forced

    def table(self) -> dict[str, dict[str, dict[str, Any]]]:
        """`{key: {class: {value, source}}}` for results files and logs."""
        return {k: {c: dict(zip(("value", "source"), self.lookup(k, c), strict=True)) for c in keys.CLASSES}
                for k in THRESHOLD_KEYS}


@dataclass(frozen=True)
class BranchPlan:
    backend: str
    why: str


@dataclass(frozen=True)
class Plan:
    """What one NSA call runs: a backend per branch (`win`, `cmp`, `sel`), with the reason, and
    where the selection scores come from: a backend that declares the `scores` fusion (its
    compressed pass then also gives the compressed output and the top-n blocks) or `"torch"`
    (`nsa.selection`). `grad`: the call needs gradients, so every branch runs on a backend with
    that op's backward and no fusion's output is used where a gradient must flow."""

    seq_len: int
    cls: str
    profile: str
    branches: dict[str, BranchPlan]
    scores: str
    grad: bool = False

    def fused(self, fusion: str, *branches: str) -> bool:
        """All of `branches` run on one backend that declares `fusion`, and the call needs no
        gradients (no fusion has a backward)."""
        if self.grad or not branches or any(b not in self.branches for b in branches):
            return False
        names = {self.backend(b) for b in branches}
        return len(names) == 1 and fusion in backends.capabilities(names.pop()).fusions

    def backend(self, branch: str) -> str:
        return self.branches[branch].backend

    def frozen(self) -> tuple:
        """The plan as plain values (strings, ints, bools), which a compiled graph keeps as a constant."""
        return (self.seq_len, self.cls, self.profile, tuple((b, p.backend, p.why) for b, p in self.branches.items()),
                self.scores, self.grad)

    @classmethod
    def thawed(cls, values: tuple) -> Plan:
        seq_len, klass, profile, branches, scores, grad = values
        return cls(seq_len, klass, profile, {b: BranchPlan(name, why) for b, name, why in branches}, scores, grad)

    def describe(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "class": self.cls, "profile": self.profile, "scores": self.scores,
                "grad": self.grad, **{b: {"backend": p.backend, "why": p.why} for b, p in self.branches.items()}}

    @property
    def label(self) -> str:
        """Short form for logs and results: `win=fa2 cmp=triton sel=triton scores=triton`."""
        return " ".join([*(f"{b}={p.backend}" for b, p in self.branches.items()), f"scores={self.scores}",
                         *(["grad"] if self.grad else [])])


def device_profile(device: torch.device | str | None) -> str:
    """The config profile `device` reads: its GPU profile's block of thresholds (`sm90` for an
    H100, `sm89` for an L4 whatever nsa/profiles/ holds), `cpu` for anything but a CUDA device."""
    return profiles.profile_for(device).thresholds


def set_overrides(**values: Any) -> None:
    """Code/CLI overrides: `use_<family>`, `force_fa2`, any threshold key, `profile`, `config`
    (path). `None` removes one. Clears the threshold cache."""
    unknown = set(values) - set(_OVERRIDES)
    if unknown:
        raise ValueError(f"override names must be among {sorted(_OVERRIDES)}, got {sorted(unknown)}")
    for key, value in values.items():
        if value is None:
            _cli_overrides.pop(key, None)
        else:
            if key in THRESHOLD_KEYS:
                settings.threshold(value, f"override {key}")
            _cli_overrides[key] = value
            log.warning("nsa dispatch override from code/CLI: %s=%r", key, value)
    _cache.clear()


def _env_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}; unset it or use 0/1")
    return raw == "1"


def _env_names() -> tuple[str, ...]:
    return ("NSA_CONFIG", "NSA_PROFILE", "NSA_FA2_FORCE", *(f"NSA_USE_{f.upper()}" for f in keys.FAMILIES),
            *(keys.get(k).env for k in THRESHOLD_KEYS))


def thresholds(device: torch.device | str | None = None) -> Thresholds:
    """The thresholds in force for `device` (config file, profile, then env and CLI overrides)."""
    profile = str(_cli_overrides.get("profile") or os.environ.get("NSA_PROFILE") or device_profile(device))
    cache_key = (profile, tuple(os.environ.get(k) for k in _env_names()), tuple(sorted(map(repr, _cli_overrides.items()))))
    if cache_key not in _cache:
        _cache[cache_key] = _load(profile)
    return _cache[cache_key]


def _named_profile() -> str | None:
    """Where a profile named by hand comes from (`set_overrides(profile=...)` or NSA_PROFILE), else None."""
    if _cli_overrides.get("profile"):
        return "override profile (code/CLI)"
    return "NSA_PROFILE" if os.environ.get("NSA_PROFILE") else None


def _load(profile: str) -> Thresholds:
    config = settings.load(settings.config_source(_cli_overrides.get("config"))[0])
    named = _named_profile()
    if named is not None and profile not in config.profiles:
        # A name the config lacks reads `runtime` alone: with the shipped config every key at -1,
        # masked SDPA everywhere. A device's own profile may be missing (it falls back on purpose);
        # a profile named by hand must be one the config defines.
        raise settings.SettingsError(
            f"{named} must name a profile of {config.source} ({', '.join(sorted(config.profiles)) or 'none'}), "
            f"got {profile!r}; fix the name, or unset it to use the device's profile")
    overrides: dict[str, tuple[int, str]] = {}
    for key in keys.KEYS:
        env = os.environ.get(key.env)
        if env not in (None, ""):
            try:
                value = int(env)
            except ValueError:
                raise ValueError(f"{key.env} must be an int (-1 or a length), got {env!r}; set -1 (off) or a "
                                 "length, or unset it for the config's value") from None
            overrides[key.name] = (settings.threshold(value, key.env), f"env {key.env}")
        if key.name in _cli_overrides:
            value = _cli_overrides[key.name]
            if isinstance(value, dict):
                raise ValueError(f"override {key.name} must be one int for every class, got {value!r}")
            overrides[key.name] = (value, "override (code/CLI)")
    forced: set[str] = set()
    for family in keys.FAMILIES:
        use = _cli_overrides.get(f"use_{family}", _env_bool(f"NSA_USE_{family.upper()}"))
        force = family in FORCEABLE and bool(_cli_overrides.get(f"force_{family}", _env_bool("NSA_FA2_FORCE")))
        for key in keys.of_family(family):
            if use is False:
                overrides[key.name] = (-1, f"NSA_USE_{family.upper()}=0 / use_{family}=False")
            elif force:
                overrides[key.name] = (0, f"NSA_{family.upper()}_FORCE=1 / force_{family}=True")
        if force and use is not False:
            forced.add(family)
    result = Thresholds(profile, config, overrides, frozenset(forced))
    if overrides:
        log.warning("nsa dispatch thresholds with overrides: %s", overrides)
    return result


def describe(device: torch.device | str | None = None) -> dict[str, Any]:
    """Thresholds in force per key and class, with their sources (results files embed this)."""
    t = thresholds(device)
    return {"profile": t.profile, "config": t.config.source, "force_fa2": t.force_fa2, "keys": t.table()}


def call_class(call: AttnCall) -> str:
    return keys.class_of(call.q.shape[2], call.k.shape[2])


def pick(call: AttnCall, t: Thresholds) -> tuple[str, str]:
    """(backend, why) for one branch call under `t`, whatever the device: the first key of the
    call's op whose threshold `seq_len` clears (in the call's class) and whose backend can run the
    call, else `sdpa`. `why` lists every key passed over. Raises BackendError when a family is
    forced and its backend cannot run. `choose` applies it to CUDA tensors; tests call it on CPU.
    """
    cands = keys.for_op(call.op)
    if not cands:
        return "sdpa", f"no decision key for the {call.op} op"
    n, cls = call.seq_len, call_class(call)
    passed: list[str] = []
    for key in cands:
        limit, source = t.lookup(key.name, cls)
        if limit < 0:
            passed.append(f"{key.name}[{cls}]=-1 ({source})")
            continue
        if n < limit:
            passed.append(f"seq_len {n} < {key.name}[{cls}]={limit}")
            continue
        resolved = backends.resolve(key.backend, call.q.device)
        reason = backends.unsupported_reason(resolved, call)
        if reason is None:
            return resolved, "; ".join([*passed, f"seq_len {n} >= {key.name}[{cls}]={limit}"])
        if key.family in t.forced:
            raise BackendError(f"{key.label} is forced (NSA_{key.family.upper()}_FORCE) but {resolved} cannot run: {reason}")
        passed.append(f"{key.label} ({resolved}) cannot run this call: {reason}")
    return "sdpa", "; ".join(passed)


def choose(call: AttnCall) -> str:
    """The backend `auto` runs for one branch call; recorded (see `recording`)."""
    name, why = "sdpa", "cpu tensors always use sdpa"
    if call.q.device.type == "cuda":
        name, why = pick(call, thresholds(call.q.device))
    record(call.op, call.seq_len, name, why)
    return name


def plan(calls: dict[str, AttnCall], requested: str | dict[str, str] = "auto", t: Thresholds | None = None) -> Plan:
    """The plan of one NSA call from its branch calls (`win`, `cmp`, `sel`; the `sel` call needs no
    block indices yet) and the module's `backend`: `"auto"`, one backend name for every branch, or
    a mapping branch -> name (missing branches: auto).

    An explicit backend that cannot run its branch raises BackendError with the reason. With
    `auto`, each branch follows `pick`; the selection scores run on the Triton compressed kernel
    whenever the compressed or the selected branch runs on Triton (that kernel yields the
    compressed output and the scores in one pass), else in torch. `t`: thresholds to apply
    whatever the device (tests); by default those of a CUDA device, and `sdpa` on CPU tensors.
    """
    key = (_request_key(requested), tuple((b, backends.frozen(c)) for b, c in calls.items()))
    if torch.compiler.is_compiling():
        return Plan.thawed(_constant_plan(*key, t))
    return _memo_plan(key, calls, requested, t)


def _memo_plan(key: tuple, calls: dict[str, AttnCall], requested: str | dict[str, str], t: Thresholds | None) -> Plan:
    any_call = next(iter(calls.values()))
    device = any_call.q.device
    if t is None and device.type == "cuda":
        t = thresholds(device)
    # A prefill of one shape, or a decode step at one length, asks the same question every call:
    # the answer is cached per thresholds object (the checks below cost ~50 us of Python, which
    # at 1k tokens is ~10% of an H100 NSA call).
    memo = _PLANS.setdefault(t, {}) if t is not None else None
    if memo is not None and key in memo:
        return _recorded(memo[key])
    result = _plan(calls, requested, t, any_call, device)
    if memo is not None:
        if len(memo) > 4096:
            memo.clear()
        memo[key] = result
    return _recorded(result)


_PLANS: weakref.WeakKeyDictionary[Thresholds, dict[tuple, Plan]] = weakref.WeakKeyDictionary()


def _request_key(requested: str | dict[str, str]) -> tuple:
    return (requested,) if isinstance(requested, str) else tuple(sorted(requested.items()))


@torch.compiler.assume_constant_result
def _constant_plan(request: tuple, calls: tuple, t: Thresholds | None) -> tuple:
    """The plan of a call that dynamo traces: made outside the graph, by `plan` itself, from the
    frozen calls (shapes, dtypes, device, positions, knobs: `backends.frozen`), and kept as a
    constant of the graph. A compiled graph is specialised on its shapes (a new shape traces again,
    and plans again), so its plan is the one eager would make: the thresholds are read, the checks
    run and the choice is recorded, none of it traced (importlib, caches, YAML, logging). Plain
    values cross into the graph (`Plan.frozen`); the traced code builds its `Plan` from them."""
    requested = request[0] if len(request) == 1 and isinstance(request[0], str) else dict(request)
    return _memo_plan((request, calls), {b: backends.thawed(k) for b, k in calls}, requested, t).frozen()


def _recorded(result: Plan) -> Plan:
    for branch, bp in result.branches.items():
        record(keys.BRANCH_OPS[branch], result.seq_len, bp.backend, bp.why)
    record("nsa_plan", result.seq_len, result.label, f"class {result.cls}, profile {result.profile}")
    return result


def _plan(calls: dict[str, AttnCall], requested: str | dict[str, str], t: Thresholds | None, any_call: AttnCall,
          device: torch.device) -> Plan:
    chosen: dict[str, BranchPlan] = {}
    for branch, call in calls.items():
        want = requested.get(branch, "auto") if isinstance(requested, dict) else requested
        if want == "auto":
            name, why = pick(call, t) if t is not None else ("sdpa", "cpu tensors always use sdpa")
        else:
            name = backends.resolve(want, device)
            reason = backends.unsupported_reason(name, call)
            if reason is not None:
                fix = ("call it under torch.no_grad() (inference), or pass backend={branch: name} with a backend "
                       "that has this op's backward, or backend='auto'") if call.grad else \
                    "pass backend={branch: name} to choose per branch, or backend='auto'"
                raise BackendError(f"backend {want!r} cannot run the {keys.BRANCH_OPS[branch]} branch ({branch}): "
                                   f"{reason}; {fix}")
            why = "requested"
        chosen[branch] = BranchPlan(name, why)
    # The selection scores come from the compressed pass of a backend that declares the `scores`
    # fusion, when the compressed or the selected branch runs on it (that pass yields the
    # compressed output and the scores at once). The scores carry no gradient (the top-n is
    # discrete), so a training call may take them too; its compressed output then comes from the
    # compressed op, which has a backward.
    scores = "torch"
    grad = any(c.grad for c in calls.values())
    on = {chosen[b].backend for b in ("cmp", "sel") if b in chosen}
    for name in backends.with_fusion("scores"):
        if name not in on:
            continue
        probe = calls.get("cmp") or calls.get("sel")
        cmp_call = AttnCall("compressed", probe.q, probe.k, probe.v, probe.scale, q_start=probe.q_start,
                            grad=probe.grad)
        if backends.unsupported_reason(name, cmp_call) is None:
            scores = name
            if "cmp" in chosen and chosen["cmp"].backend != name and _auto(requested, "cmp"):
                chosen["cmp"] = BranchPlan(name, f"fused: the {name} selection scores yield the compressed output")
            break
    return Plan(any_call.seq_len, call_class(any_call), t.profile if t else "cpu", chosen, scores, grad)


def _auto(requested: str | dict[str, str], branch: str) -> bool:
    return (requested.get(branch, "auto") if isinstance(requested, dict) else requested) == "auto"


def record(op: str, seq_len: int, backend: str, why: str) -> None:
    """Log one `auto` choice and add it to the active `recording()`."""
    log.debug("auto %s seq_len=%d -> %s (%s)", op, seq_len, backend, why)
    rec = _recorder.get()
    if rec is not None:
        rec.append({"op": op, "seq_len": seq_len, "backend": backend, "why": why})


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Collect every `auto` choice made inside the block: `[{op, seq_len, backend, why}, ...]`."""
    log_list: list[dict[str, Any]] = []
    token = _recorder.set(log_list)
    try:
        yield log_list
    finally:
        _recorder.reset(token)
