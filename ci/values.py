"""Threshold values as the pipeline passes them around: a plain int, or a per-class mapping.

`nsa.settings` reads them from YAML and validates them; this module only checks the two shapes a
decision file may carry and writes the one text form every stage shows (summary lines, the PR
title and commit message, the pipeline summary) and the YAML edit writes: `2048`, or the
one-line flow mapping `{g1: -1, g4: 2048, g16: 1024}` with classes in `nsa.keys.CLASSES` order.
Standard library only, like the rest of `ci`'s pure modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nsa import keys

Value = int | dict[str, int]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_value(value: Any) -> bool:
    """An int, or a non-empty mapping of known class names to ints (the decision file's shapes)."""
    if is_int(value):
        return True
    return (isinstance(value, Mapping) and bool(value)
            and all(c in keys.CLASSES and is_int(v) for c, v in value.items()))


def ordered(value: Mapping[str, int]) -> dict[str, int]:
    """The mapping with its classes in `nsa.keys.CLASSES` order (g1 ... g16)."""
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
