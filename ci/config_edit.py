"""Round-trip edit of the threshold keys of one profile in ``configs/base.yaml``.

The threshold PR must change nothing but the values it proposes: every comment, blank line, key
order, indentation and unrelated byte of the file is kept. ``edit_thresholds`` first lets
ruamel.yaml round-trip the document; if its dump touches any other line (ruamel re-indents odd
indentation, normalises line endings, ...), it falls back to rewriting only the value token on
each edited key's line. Either way the result is verified twice before it is returned: parsed, it
differs from the input only at the edited keys, and textually only those keys' lines changed.
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


def _load(text: str, source: str) -> CommentedMap:
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


def _check_changes(block: CommentedMap, profile: str, changes: Mapping[str, int], source: str) -> None:
    for key, value in changes.items():
        name = f"profiles.{profile}.{key}"
        if key not in block:
            raise ConfigEditError(
                f"{name} must exist in {source}, got keys {sorted(str(k) for k in block)}; "
                f"add `{key}: -1` to the `{profile}:` block by hand (edits never add keys)"
            )
        if isinstance(block[key], (Mapping, list)):
            raise ConfigEditError(
                f"{name} must hold a single value in {source}, got {_kind(block[key])}; "
                "replace it with an integer by hand"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigEditError(
                f"{name} must be set to an int, got {value!r} ({type(value).__name__}); "
                "pass a sequence length, or -1 to disable FA-2"
            )


def _value_spots(block: CommentedMap, keys: list[str]) -> dict[int, int]:
    """0-based line -> leftmost value column of the edited keys: the only lines that may change."""
    spots: dict[int, int] = {}
    for key in keys:
        _, _, line, col = block.lc.data[key]
        spots[line] = min(col, spots.get(line, col))
    return spots


def _eol(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :]


def _only_lines_changed(old: str, new: str, spots: dict[int, int]) -> bool:
    """Same line count; a changed line is an edited value's line, same up to the value, same ending."""
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    if len(old_lines) != len(new_lines):
        return False
    for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)):
        if a == b:
            continue
        if i not in spots or a[: spots[i]] != b[: spots[i]] or _eol(a) != _eol(b):
            return False
    return True


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


def _token_end(line: str, start: int, flow: bool) -> int:
    """End (exclusive) of the scalar token starting at ``line[start]``, or ``start`` if unknown."""
    quote = line[start : start + 1]
    if quote in ("'", '"'):
        i = start + 1
        while i < len(line):
            if quote == '"' and line[i] == "\\":
                i += 2
                continue
            if line[i] == quote:
                if quote == "'" and line[i + 1 : i + 2] == "'":
                    i += 2
                    continue
                return i + 1
            i += 1
        return start  # the scalar spans lines: not editable in place
    end = len(line.rstrip("\r\n"))
    for i in range(start, end):
        if line[i] == "#" and i > start and line[i - 1] in " \t":
            end = i
            break
        if flow and line[i] in ",]}":
            end = i
            break
    while end > start and line[end - 1] in " \t":
        end -= 1
    return end


def _replace_tokens(
    text: str,
    where: dict[str, tuple[int, int]],
    flow: bool,
    changes: Mapping[str, int],
    profile: str,
    source: str,
) -> str:
    """Rewrite only the value token of each edited key (``where``: key -> value line, column),
    keeping a trailing comment's column."""
    lines = text.splitlines(keepends=True)
    # Right to left, so that earlier columns on a shared (flow-style) line stay valid.
    for line_no, col, key in sorted(((*where[k], k) for k in changes), reverse=True):
        line = lines[line_no]
        end = _token_end(line, col, flow)
        if end <= col or line[col] in "|>&*!":
            raise ConfigEditError(
                f"profiles.{profile}.{key} must be a one-line scalar in {source} to be edited in place, "
                f"got {line.strip()!r}; write it as `{key}: <int>` on one line"
            )
        new_token = str(changes[key])
        rest = line[end:]
        comment = rest.lstrip(" ")
        if comment.startswith("#"):
            # Keep the comment where it was when the new token fits, else one space before it.
            gap = max(1, len(rest) - len(comment) + (end - col) - len(new_token))
            rest = " " * gap + comment
        lines[line_no] = line[:col] + new_token + rest
    return "".join(lines)


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
    return got == expected and _only_lines_changed(old, new, spots)


def edit_thresholds(text: str, profile: str, changes: Mapping[str, int], *, source: str = "config") -> str:
    """Return ``text`` with ``profiles.<profile>.<key>`` set to each value in ``changes``.

    Pure: no file access. Only existing keys of an existing profile are edited (no key is ever
    added); every other byte is kept. ``source`` names the file in error messages.

    Raises:
        ConfigEditError: malformed YAML, a missing profile or key, or a value that is not an int.
    """
    doc = _load(text, source)
    block = _profile_block(doc, profile, source)
    _check_changes(block, profile, changes, source)
    todo = {k: v for k, v in changes.items() if block[k] != v or type(block[k]) is not int}
    if not todo:
        return text
    spots = _value_spots(block, list(todo))
    # Positions as parsed, taken before the round-trip document is modified.
    where = {k: (block.lc.data[k][2], block.lc.data[k][3]) for k in todo}
    flow = bool(block.fa.flow_style())
    for key, value in todo.items():
        block[key] = value
    out = io.StringIO()
    _rt_yaml().dump(doc, out)
    dumped = out.getvalue()
    if _verify(text, dumped, profile, todo, spots, source):
        return dumped
    replaced = _replace_tokens(text, where, flow, todo, profile, source)
    if _verify(text, replaced, profile, todo, spots, source):
        return replaced
    raise ConfigEditError(
        f"profiles.{profile} in {source} must be editable without touching other lines, got a layout "
        f"(anchors, multi-line values, ...) that would change more than {sorted(todo)}; "
        "edit the values by hand"
    )


def unified_diff(old: str, new: str, path: str) -> str:
    """Unified diff of one file, ``a/<path>`` against ``b/<path>``; empty when nothing changed."""
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
        )
    )


def apply_to_file(path: str | os.PathLike[str], profile: str, changes: Mapping[str, int]) -> str:
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
