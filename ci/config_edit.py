"""Round-trip edit of the threshold keys of one profile in ``configs/base.yaml``.

The threshold PR must change nothing but the values it proposes: every comment, blank line, key
order, indentation and unrelated byte of the file is kept. ``edit_thresholds`` first lets
ruamel.yaml round-trip the document; if its dump touches any other line (ruamel re-indents odd
indentation, normalises line endings, ...), or the value is or becomes a per-class mapping, it
rewrites only the value token on each edited key's line (``ci.yaml_tokens``). A per-class value
is written as a one-line flow mapping, ``{g1: -1, g2: 2048, g4: 2048, g8: 1024, g16: 1024}``.

One loader: the file is read through ``nsa_contract.settings`` before the edit (a config it rejects is
refused with its message) and after it (the new text must load and hold the intended values),
besides the checks that only the edited keys changed, parsed and line by line.
"""

from __future__ import annotations

import difflib
import io
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from ci import yaml_tokens
from nsa_contract import keys, settings, values

__all__ = ["ConfigEditError", "apply_to_file", "edit_thresholds", "unified_diff"]


class ConfigEditError(ValueError):
    """The edit cannot be made safely; the message says what is wrong and how to fix it."""


def _rt_yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines or comments
    return yaml


def _plain(text: str, source: str) -> Any:
    """Parse ``text`` into plain Python objects (dicts, lists, scalars) for the semantic check."""
    try:
        return YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:  # pragma: no cover - the round-trip parse already accepted it
        raise ConfigEditError(
            f"{source} must stay valid YAML after the edit, got {exc}; report this bug"
        ) from None


def _settings(text: str, source: str) -> settings.Settings:
    """The one loader's verdict on ``text``; its message, unchanged, when it refuses the file."""
    try:
        return settings.load_text(text, source)
    except settings.SettingsError as exc:
        raise ConfigEditError(str(exc)) from None


def _load(text: str, source: str) -> CommentedMap:
    _settings(text, source)
    try:
        doc = _rt_yaml().load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or type(exc).__name__
        raise ConfigEditError(
            f"{source} must be valid YAML, got {problem!s}{where}; fix the file by hand and rerun"
        ) from None
    except YAMLError as exc:
        raise ConfigEditError(
            f"{source} must be valid YAML, got {exc}; fix the file by hand and rerun"
        ) from None
    if not isinstance(doc, CommentedMap):
        raise ConfigEditError(
            f"{source} must be a YAML mapping at the top level, got {_kind(doc)}; "
            "start from configs/base.yaml"
        )
    return doc


def _profile_block(doc: CommentedMap, profile: str, source: str) -> CommentedMap:
    profiles = doc.get("profiles")
    if not isinstance(profiles, CommentedMap):
        raise ConfigEditError(
            f"{source} must have a `profiles:` mapping, got {_kind(profiles)}; "
            "add `profiles:` with one block per GPU architecture, as in configs/base.yaml"
        )
    block = profiles.get(profile)
    if not isinstance(block, CommentedMap):
        known = ", ".join(str(k) for k in profiles) or "none"
        got = "no such block" if profile not in profiles else _kind(block)
        raise ConfigEditError(
            f"profiles.{profile} must be a mapping in {source}, got {got} (profiles: {known}); "
            f"add a `{profile}:` block with the threshold keys set to -1 under `profiles:`, then rerun"
        )
    return block


def _check_changes(block: CommentedMap, profile: str, changes: Mapping[str, Any],
                   source: str) -> dict[str, values.Value]:
    """The changes validated by the loader's own rule (`nsa_contract.settings.threshold`), mappings in class order."""
    checked: dict[str, values.Value] = {}
    for key, value in changes.items():
        name = f"profiles.{profile}.{key}"
        if key not in keys.names():
            raise ConfigEditError(
                f"{name} must be a decision key declared in nsa_contract/keys.py ({', '.join(keys.names())}), got "
                f"{key!r}; fix the decision file or declare the key"
            )
        if key not in block:
            raise ConfigEditError(
                f"{name} must exist in {source}, got keys {sorted(str(k) for k in block)}; "
                f"add `{key}: -1` to the `{profile}:` block by hand (edits never add keys)"
            )
        old = block[key]
        if isinstance(old, CommentedMap) and not old.fa.flow_style():
            raise ConfigEditError(
                f"{name} must be an int or a one-line flow mapping in {source} to be edited in place, got a "
                f"block mapping; write it on one line as `{key}: {values.text(dict(old))}` by hand"
            )
        try:
            valid = settings.threshold(value, name)
        except settings.SettingsError as exc:
            raise ConfigEditError(str(exc)) from None
        checked[key] = values.ordered(valid) if isinstance(valid, dict) else valid
    return checked


def _value_spots(block: CommentedMap, names: list[str]) -> dict[int, int]:
    """0-based line -> leftmost value column of the edited keys: the only lines that may change."""
    spots: dict[int, int] = {}
    for key in names:
        _, _, line, col = block.lc.data[key]
        spots[line] = min(col, spots.get(line, col))
    return spots


def _unshared(obj: Any) -> Any:
    """Copy without YAML aliasing, so that editing one node cannot silently edit another."""
    if isinstance(obj, dict):
        return {k: _unshared(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unshared(v) for v in obj]
    return obj


def _kind(obj: Any) -> str:
    if obj is None:
        return "nothing"
    if isinstance(obj, Mapping):
        return "a mapping"
    if isinstance(obj, list):
        return "a list"
    return f"a {type(obj).__name__}"


def _replace_tokens(text: str, where: dict[str, tuple[int, int]], flow: bool | Mapping[str, bool],
                    changes: Mapping[str, values.Value], section: str, source: str) -> str:
    """``yaml_tokens.replace_tokens`` with the values' YAML text; errors name the key and the fix."""
    try:
        return yaml_tokens.replace_tokens(text, where, flow, {k: values.text(v) for k, v in changes.items()})
    except yaml_tokens.TokenError as exc:
        key, line = exc.args
        raise ConfigEditError(
            f"{section}.{key} must be a one-line value in {source} to be edited in place, got {line!r}; "
            f"write it as `{key}: <int>` or `{key}: {{g1: <int>, ...}}` on one line"
        ) from None


def _verify(
    old: str, new: str, profile: str, changes: Mapping[str, int], spots: dict[int, int], source: str
) -> bool:
    """True when ``new`` is ``old`` with only the edited keys changed, both parsed and textually."""
    try:
        expected = _unshared(_plain(old, source))
        got = _unshared(_plain(new, source))
    except ConfigEditError:
        return False
    expected["profiles"][profile].update(changes)
    return got == expected and yaml_tokens.only_lines_changed(old, new, spots)


def _same(old: Any, new: values.Value) -> bool:
    """True when the value as written already is ``new`` (an int must be written as an int)."""
    if isinstance(new, dict):
        return isinstance(old, Mapping) and dict(old) == new
    return type(old) is int and old == new


def edit_thresholds(text: str, profile: str, changes: Mapping[str, values.Value], *,
                    source: str = "config") -> str:
    """Return ``text`` with ``profiles.<profile>.<key>`` set to each value in ``changes``.

    A value is an int (every class) or a mapping of classes to ints, written as a one-line flow
    mapping in `nsa_contract.keys.CLASSES` order. Pure: no file access. Only existing keys of an existing
    profile are edited (no key is ever added); every other byte is kept. ``source`` names the file
    in error messages.

    Raises:
        ConfigEditError: a config the loader (nsa_contract.settings) rejects, a missing profile or key, a
        value the loader would reject, or a layout that cannot be edited on the value's line.
    """
    doc = _load(text, source)
    block = _profile_block(doc, profile, source)
    checked = _check_changes(block, profile, changes, source)
    todo = {k: v for k, v in checked.items() if not _same(block[k], v)}
    if not todo:
        return text
    spots = _value_spots(block, list(todo))
    # Positions as parsed, taken before the round-trip document is modified. A flow mapping that
    # keeps its classes has only its changed values rewritten, each in place (quotes, spacing and
    # the comment column of the written mapping stay); one that gains or loses a class is
    # written whole.
    where, tokens, in_flow = {}, {}, {}
    for k, v in todo.items():
        old = block[k]
        if isinstance(v, dict) and isinstance(old, CommentedMap) and set(old) == set(v):
            for cls in v:
                if not _same(old[cls], v[cls]):
                    where[f"{k}.{cls}"] = (old.lc.data[cls][2], old.lc.data[cls][3])
                    tokens[f"{k}.{cls}"], in_flow[f"{k}.{cls}"] = v[cls], True
        else:
            where[k] = (block.lc.data[k][2], block.lc.data[k][3])
            tokens[k], in_flow[k] = v, bool(block.fa.flow_style())
    candidates = []
    # A mapping (old or new) goes straight to the token rewrite: ruamel would write a new one as a
    # block on the following lines, and the edit must keep the line count.
    if not any(isinstance(v, dict) or isinstance(block[k], Mapping) for k, v in todo.items()):
        for key, value in todo.items():
            block[key] = value
        out = io.StringIO()
        _rt_yaml().dump(doc, out)
        candidates.append(out.getvalue())
    for new in candidates:
        if _verify(text, new, profile, todo, spots, source):
            return _checked(new, profile, todo, source)
    replaced = _replace_tokens(text, where, in_flow, tokens, f"profiles.{profile}", source)
    if _verify(text, replaced, profile, todo, spots, source):
        return _checked(replaced, profile, todo, source)
    raise ConfigEditError(
        f"profiles.{profile} in {source} must be editable without touching other lines, got a layout "
        f"(anchors, multi-line values, ...) that would change more than {sorted(todo)}; "
        "edit the values by hand"
    )


def _checked(new: str, profile: str, todo: Mapping[str, values.Value], source: str) -> str:
    """``new`` once the one loader accepts it and reads every edited value back as intended."""
    try:
        loaded = settings.load_text(new, source)
    except settings.SettingsError as exc:  # pragma: no cover - the input loaded and only values changed
        raise ConfigEditError(f"{source} must still load after the edit, got: {exc}; report this bug") from None
    for key, value in todo.items():
        if loaded.written(key, profile) != value:  # pragma: no cover - _verify compared the parsed files
            raise ConfigEditError(f"profiles.{profile}.{key} must read back as {values.text(value)} after the "
                                  f"edit, got {loaded.written(key, profile)!r}; report this bug")
    return new


def unified_diff(old: str, new: str, path: str) -> str:
    """Unified diff of one file, ``a/<path>`` against ``b/<path>``; empty when nothing changed."""
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
        )
    )


def apply_to_file(path: str | os.PathLike[str], profile: str, changes: Mapping[str, values.Value]) -> str:
    """Edit the file at ``path`` in place, atomically, and return the unified diff.

    Nothing is written when the edit fails or changes nothing (the diff is then empty).
    """
    target = Path(path)
    try:
        with open(target, encoding="utf-8", newline="") as fh:
            old = fh.read()
    except OSError as exc:
        raise ConfigEditError(
            f"config path must be a readable file, got {str(target)!r} ({exc.strerror}); pass --config"
        ) from None
    new = edit_thresholds(old, profile, changes, source=str(target))
    if new == old:
        return ""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(new)
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return unified_diff(old, new, str(path))
