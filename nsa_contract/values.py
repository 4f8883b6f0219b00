"""Threshold values: a plain int, or a per-class mapping, and the one rule for what they may be.

`problem` is the rule every reader applies (the config loader, `nsa_contract.settings`, and the
decision's validation, `nsa_contract.decision`): -1 (off) or a sequence length >= 0, per class or
for every class. `text` writes the one text form every stage shows (summary lines, the PR title
and commit message, the pipeline summary) and the YAML edit writes: `2048`, or the one-line flow
mapping `{g1: -1, g4: 2048, g16: 1024}` with classes in `nsa_contract.keys.CLASSES` order.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nsa_contract import keys

Value = int | dict[str, int]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_value(value: Any) -> bool:
    """An int, or a non-empty mapping of known class names to ints (the decision file's shapes)."""
    if is_int(value):
        return True
    return (isinstance(value, Mapping) and bool(value)
            and all(c in keys.CLASSES and is_int(v) for c, v in value.items()))


def problem(value: Any, where: str) -> str | None:
    """Why `value` is no threshold (`"<where> must ..., got ...; <fix>"`), or None when it is one: -1
    (off) or a sequence length >= 0, or a non-empty mapping of known classes to such ints."""
    if isinstance(value, Mapping):
        if not value:
            return f"{where} must name at least one class, got an empty mapping; write a plain int"
        for cls, v in value.items():
            if cls not in keys.CLASSES:
                return f"{where}: class {cls!r} is unknown; classes are {', '.join(keys.CLASSES)}"
            why = _plain(v, f"{where}.{cls}")
            if why is not None:
                return why
        return None
    return _plain(value, where)


def _plain(value: Any, where: str) -> str | None:
    if isinstance(value, bool):
        return (f"{where} must be -1 (off) or a sequence length >= 0, got the boolean {value} "
                "(YAML reads on/off/yes/no/true/false as booleans); write -1 to disable")
    if not is_int(value) or value < -1:
        return (f"{where} must be -1 (off) or a sequence length >= 0, got {value!r}; "
                "write an integer such as 2048, or -1")
    return None


def ordered(value: Mapping[str, int]) -> dict[str, int]:
    """The mapping with its classes in `nsa_contract.keys.CLASSES` order (g1 ... g16)."""
    return {c: value[c] for c in keys.CLASSES if c in value}


def written(per_class: Mapping[str, int]) -> Value:
    """One int when every class agrees, else a mapping naming every class (the YAML form)."""
    found = set(per_class.values())
    return next(iter(found)) if len(found) == 1 else {c: per_class[c] for c in keys.CLASSES}


def text(value: Any) -> str:
    """`2048`, or `{g1: -1, g4: 2048}`: the YAML flow form, also used wherever a value is shown."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{c}: {v}" for c, v in ordered(value).items()) + "}"
    return str(value)
