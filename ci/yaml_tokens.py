"""Line-level YAML edits for ci.config_edit: replace one value token in place, check what changed.

ruamel.yaml's round trip re-indents odd layouts and cannot write a new flow mapping on the key's
own line, so the edit falls back to rewriting the value token itself: a plain or quoted scalar,
or a one-line flow mapping `{g1: -1, g16: 1024}`, or one value inside such a mapping. Everything
else on the line, a trailing comment's column included, is kept. Pure string functions.
"""

from __future__ import annotations

from collections.abc import Mapping


class TokenError(ValueError):
    """A value that is not one token on one line; the caller words the message."""


def eol(line: str) -> str:
    return line[len(line.rstrip("\r\n")):]


def only_lines_changed(old: str, new: str, spots: Mapping[int, int]) -> bool:
    """Same line count; a changed line is an edited value's line, same up to the value, same ending."""
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    if len(old_lines) != len(new_lines):
        return False
    for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)):
        if a == b:
            continue
        if i not in spots or a[: spots[i]] != b[: spots[i]] or eol(a) != eol(b):
            return False
    return True


def _quoted_end(line: str, start: int) -> int:
    quote, i = line[start], start + 1
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


def _flow_end(line: str, start: int) -> int:
    """End of the flow collection opening at `line[start]`, on this line only (else `start`)."""
    depth, i = 0, start
    while i < len(line):
        ch = line[i]
        if ch in "'\"":
            end = _quoted_end(line, i)
            if end == i:
                return start
            i = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch == "#" and line[i - 1] in " \t":
            return start
        i += 1
    return start  # the collection continues on the next line


def token_end(line: str, start: int, flow: bool) -> int:
    """End (exclusive) of the value token starting at ``line[start]``, or ``start`` if unknown.

    ``flow``: the value sits inside a flow collection, where `,`, `]` and `}` end a plain scalar.
    """
    first = line[start : start + 1]
    if first in ("'", '"'):
        return _quoted_end(line, start)
    if first in ("{", "["):
        return _flow_end(line, start)
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


def comment_start(line: str) -> int:
    """Column of the line's trailing comment (`#` after a blank, outside quotes), or -1."""
    i = 0
    while i < len(line):
        ch = line[i]
        if ch in "'\"" and (i == 0 or line[i - 1] in " \t{[,:"):
            end = _quoted_end(line, i)
            if end == i:
                return -1
            i = end
            continue
        if ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
        i += 1
    return -1


def replace_tokens(text: str, where: Mapping[str, tuple[int, int]], flow: bool | Mapping[str, bool],
                   new_tokens: Mapping[str, str]) -> str:
    """Rewrite only the value token of each key (``where``: key -> value line, column); ``flow``
    (one for all, or per key): the token sits inside a flow collection. A trailing comment keeps
    its column when the line still fits before it, else it moves to one space after the code.

    Raises TokenError(key, line) for a value that is not one token on its line.
    """
    lines = text.splitlines(keepends=True)
    by_line: dict[int, list[tuple[int, str]]] = {}
    for key in new_tokens:
        line_no, col = where[key]
        by_line.setdefault(line_no, []).append((col, key))
    for line_no, edits in by_line.items():
        line = lines[line_no]
        comment_col = comment_start(line)
        # Right to left, so that earlier columns on a shared (flow-style) line stay valid.
        for col, key in sorted(edits, reverse=True):
            end = token_end(line, col, flow if isinstance(flow, bool) else flow[key])
            if end <= col or line[col] in "|>&*!":
                raise TokenError(key, line.strip())
            line = line[:col] + new_tokens[key] + line[end:]
        now = comment_start(line)
        if comment_col >= 0 and now >= 0 and now != comment_col:
            code = line[:now].rstrip(" \t")
            line = code + " " * max(1, comment_col - len(code)) + line[now:]
        lines[line_no] = line
    return "".join(lines)
