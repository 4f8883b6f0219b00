"""The one reader of configs/base.yaml (and of any `NSA_CONFIG` file). Standard library + PyYAML.

Every consumer (nsa.dispatch, ci decide / report / pr, ci.config_edit's checks) loads through
`load` / `load_text`, so they agree on what a file means and reject the same mistakes: an unknown
or misspelt key, a threshold that is not -1 or a non-negative int, a class that does not exist, a
merge key (`<<:`), a duplicated key, a file that is not UTF-8. Each error names the key, what it
got and how to fix it.

Threshold values (docs/pipeline.md, "Thresholds"): a plain int applies to every shape class; a
mapping names classes (`{g1: -1, g16: 1024}`, classes from `nsa_contract.keys.CLASSES`); one value's
rule is `nsa_contract.values.problem`. The value in force for (profile, class) is the profile's
entry, else `runtime`'s, else -1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nsa_contract import keys, values
from nsa_contract.keys import MAX_SEL_COUNT

CONFIG_ENV = "NSA_CONFIG"  # another config file instead of the default (config_source)
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "base.yaml"  # a checkout's

Value = values.Value

# The model grid (the paper's values are the defaults; `ci decide` uses them as the decision grid).
NSA_FIELDS = {"cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
# `decide` keys: name -> (default, check, what it must be).
DECIDE_FIELDS: dict[str, tuple[Any, Any, str]] = {
    "margin": (1.2, lambda v: _number(v) and math.isfinite(v) and v > 0, "a finite number > 0"),
    "confidence": (0.95, lambda v: _number(v) and 0 < v < 1, "a number strictly between 0 and 1"),
    "history_runs": (3, lambda v: _int(v) and v >= 1, "an int >= 1 (runs a change must hold over)"),
    "history_keep": (30, lambda v: _int(v) and v >= 1, "an int >= 1 (runs kept per GPU model)"),
    "time_floor_ms": (0.1, lambda v: _number(v) and math.isfinite(v) and v >= 0,
                      "a finite number >= 0 (ms; cells with both sides faster are launch-bound)"),
    "regression_margin": (0.1, lambda v: _number(v) and math.isfinite(v) and v > 0,
                          "a finite number > 0 (0.1: a slowdown must exceed 10%)"),
}
SECTIONS = ("nsa", "decide", "runtime", "profiles")


class SettingsError(ValueError):
    """A config file that cannot be used; the message names the key and the fix."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Settings:
    """A validated config: the model grid, the decide knobs and every threshold as written."""

    source: str
    nsa: dict[str, int]
    decide: dict[str, Any]
    runtime: dict[str, Value] = field(default_factory=dict)
    profiles: dict[str, dict[str, Value]] = field(default_factory=dict)

    def value(self, key: str, profile: str, cls: str) -> tuple[int, str]:
        """(threshold, where it came from) for `key` on `profile` (e.g. `sm90`) in class `cls`."""
        keys.get(key)
        if cls not in keys.CLASSES:
            raise SettingsError(f"class must be one of {', '.join(keys.CLASSES)}, got {cls!r}")
        for where, section in ((f"profiles.{profile}", self.profiles.get(profile, {})), ("runtime", self.runtime)):
            if key not in section:
                continue
            raw = section[key]
            if isinstance(raw, dict):
                if cls in raw:
                    return raw[cls], f"{self.source}:{where}.{key}.{cls}"
                continue
            return raw, f"{self.source}:{where}.{key}"
        return -1, f"default (-1: {key} not set for {profile}/{cls})"

    def written(self, key: str, profile: str) -> Value | None:
        """The value as written under `profiles.<profile>` (None when absent)."""
        return self.profiles.get(profile, {}).get(key)

    @property
    def grid(self) -> dict[str, int]:
        return dict(self.nsa)

    def planned(self, op: str, cls: str, seq_len: int, profile: str) -> tuple[str, str]:
        """(backend alias, why) that `auto` picks for `op` at `seq_len` in class `cls` from the
        thresholds alone: the first key of the op whose length holds, else `sdpa`. Dispatch also
        checks that the backend can run the actual call (dtype, head dims) before using it."""
        for key in keys.for_op(op):
            limit, _ = self.value(key.name, profile, cls)
            if 0 <= limit <= seq_len:
                return key.backend, f"{key.name}[{cls}]={limit} <= {seq_len}"
        return "sdpa", f"no {op} key holds at {seq_len} in {cls}"


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses merge keys and duplicate keys instead of resolving them silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SettingsError(
                    f"merge keys (<<) must not be used, got one at line {key_node.start_mark.line + 1}; "
                    "write the values out (the threshold PR edits each value in place)")
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise SettingsError(f"key {key!r} must appear once per mapping, got it twice (line "
                                    f"{key_node.start_mark.line + 1}); remove one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


def default_path() -> Path:
    """configs/base.yaml of a checkout, else the copy installed with the package (nsa_contract.resources)."""
    from nsa_contract import resources

    try:
        return resources.default_config_path()
    except FileNotFoundError as exc:
        raise SettingsError(str(exc)) from None


def config_source(path: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The config a reader uses and what chose it, one rule for nsa.dispatch and every `ci` stage:
    `path` (a --config value or an override in code) when given, else $NSA_CONFIG when set and not
    empty, else `default_path()` (the checkout's configs/base.yaml, else the installed copy; never a
    path relative to the working directory)."""
    if path:
        return Path(path), "--config"
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env), CONFIG_ENV
    return default_path(), "the default config"


def load(path: str | Path | None = None) -> Settings:
    """Read and validate a config file (default: `default_path()`)."""
    p = Path(path) if path is not None else default_path()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SettingsError(f"config {p} must be readable, got {exc.strerror or exc}; pass an existing file "
                            "(--config / NSA_CONFIG) or restore configs/base.yaml") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(f"config {p} must be UTF-8 text, got a byte that is not ({exc.reason} at byte "
                            f"{exc.start}); re-save the file as UTF-8") from None
    return load_text(text, str(p))


def load_text(text: str, source: str = "config") -> Settings:
    """Validate YAML text; `source` names it in messages and in each value's origin."""
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except SettingsError as exc:
        raise SettingsError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{source} must be valid YAML, got: {' '.join(str(exc).split())}; fix the syntax") from None
    if not isinstance(doc, Mapping):
        raise SettingsError(f"{source} must be a YAML mapping with sections {', '.join(SECTIONS)}, got "
                            f"{type(doc).__name__}; start from configs/base.yaml")
    _unknown(doc, SECTIONS, source, "top-level section")
    nsa = _section(doc, "nsa", source, required=False)
    _unknown(nsa, NSA_FIELDS, source, "nsa key", "nsa.")
    grid = {}
    for name, default in NSA_FIELDS.items():
        value = nsa.get(name, default)
        if not _int(value) or value < 1:
            raise SettingsError(f"{source}: nsa.{name} must be a positive int, got {value!r}; "
                                "see configs/base.yaml for the paper's values")
        grid[name] = value
    if grid["sel_count"] < 3:
        raise SettingsError(f"{source}: nsa.sel_count must be >= 3 (three blocks are forced), got {grid['sel_count']}")
    if grid["sel_count"] > MAX_SEL_COUNT:
        raise SettingsError(f"{source}: nsa.sel_count must be at most {MAX_SEL_COUNT} (the block indices are "
                            f"[B, T, Hkv, sel_count] at any T), got {grid['sel_count']}; use the paper's 16")
    decide_doc = _section(doc, "decide", source, required=False)
    _unknown(decide_doc, DECIDE_FIELDS, source, "decide key", "decide.")
    decide = {}
    for name, (default, ok, what) in DECIDE_FIELDS.items():
        value = decide_doc.get(name, default)
        if not ok(value):
            raise SettingsError(f"{source}: decide.{name} must be {what}, got {value!r}; fix the value")
        decide[name] = value
    runtime = _thresholds(_section(doc, "runtime", source, required=False), source, "runtime")
    profiles_doc = _section(doc, "profiles", source, required=False)
    profiles = {}
    for name, block in profiles_doc.items():
        if not isinstance(name, str) or not (name.startswith("sm") and name[2:].isdigit()):
            raise SettingsError(f"{source}: profile names must look like sm90 (sm + compute capability), got "
                                f"{name!r}; rename it")
        if not isinstance(block, Mapping):
            raise SettingsError(f"{source}: profiles.{name} must be a mapping of threshold keys, got "
                                f"{type(block).__name__}; write `{name}:` then indented keys")
        profiles[name] = _thresholds(block, source, f"profiles.{name}")
    # Values carry the file's name as their origin ("base.yaml:profiles.sm90.<key>"); errors the full path.
    return Settings(Path(source).name, grid, decide, runtime, profiles)


def _section(doc: Mapping[str, Any], name: str, source: str, required: bool = True) -> Mapping[str, Any]:
    value = doc.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise SettingsError(f"{source}: section {name} must be a mapping, got {type(value).__name__}; "
                            "compare with configs/base.yaml")
    return value


def _unknown(doc: Mapping[str, Any], allowed: Any, source: str, what: str, prefix: str = "") -> None:
    for name in doc:
        if name not in allowed:
            import difflib

            near = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"known: {', '.join(map(str, allowed))}"
            raise SettingsError(f"{source}: {what} {prefix}{name} is unknown; {hint} (fix or remove it)")


def threshold(value: Any, where: str) -> Value:
    """Validate one threshold value as written (plain or per class); raises SettingsError."""
    why = values.problem(value, where)
    if why is not None:
        raise SettingsError(why)
    return dict(value) if isinstance(value, Mapping) else value


def _thresholds(block: Mapping[str, Any], source: str, where: str) -> dict[str, Value]:
    _unknown(block, keys.names(), source, "threshold key", f"{where}.")
    return {name: threshold(value, f"{source}: {where}.{name}") for name, value in block.items()}
