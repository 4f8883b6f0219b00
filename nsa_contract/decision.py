"""The decision document (decision.json): its schema, its one validation, and how it is read and written.

`ci decide` writes it; `ci history` rewrites it (lasting changes, regressions); `ci report` and
`ci pr` read it. Each of them goes through `Decision`, so they agree on what a valid decision is
and refuse the same broken files with the same message. What is checked here is the document's
own consistency, the parts every stage reads:

- `schema` is `SCHEMA`; `profile` a profile name (`sm90`, `cpu`); `gpu_name` a non-empty string;
  `exit_code` 0 or `nsa_contract.exits.FAILED_CASES` (a parity failure);
- `branches`: one entry per decision key (`key`, `suite`, `current`, `proposed`, `changed`), each
  value a threshold (`nsa_contract.values.problem`), `changed` saying `proposed != current`; a
  branch with `classes` holds one entry per shape class (`key`, `class`, `current`, `proposed`,
  `changed`, `lengths`), and its own values and `changed` summarise them; a branch without
  `classes` stands for every class (and then carries `lengths` itself);
- `decisions`, when present: the same (key, class) entries as the branches' classes.

What a stage needs beyond that stays with the stage: `ci history` needs per-class entries to
rewrite (`Decision.per_class`) and a decision of its own results' run; `ci pr` needs a GPU profile,
no failed cell and `ci history`'s verdict on every change.

`Decision` types the header and the branches; `doc` is the whole document as written (cells,
cases, noise floor, history, ...), which the report templates read as JSON. Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa_contract import atomic, exits, keys, values
from nsa_contract.results import SM

__all__ = ["SCHEMA", "BranchDecision", "ClassDecision", "Decision", "DecisionError"]

SCHEMA = "nsa-decision/2"
EXIT_CODES = (exits.OK, exits.FAILED_CASES)
FIX = "pass the file `python -m ci decide` wrote (or `ci history` rewrote), or rerun `python -m ci decide`"


class DecisionError(ValueError):
    """A decision document that breaks the schema; the message lists the problems and the fix."""


@dataclass(frozen=True)
class ClassDecision:
    """One (key, shape class): the value in force, the one proposed, and the lengths tested."""

    key: str
    cls: str
    current: int
    proposed: int
    changed: bool
    tested: tuple[int, ...]  # the lengths (T) whose cells decided, sorted
    lasting: Mapping[str, Any] | None = None  # `ci history`'s verdict (held, covered, ...); None before it


@dataclass(frozen=True)
class BranchDecision:
    """One decision key: its value for every class (an int) or per class (a mapping)."""

    name: str  # the entry's name in `branches` (the key's decision_id: win, triton_sel, ...)
    key: str
    suite: str
    current: values.Value
    proposed: values.Value
    changed: bool
    reason: str = ""
    classes: Mapping[str, ClassDecision] = field(default_factory=dict)  # empty: one value for every class


@dataclass(frozen=True)
class Decision:
    """A validated decision document; `doc` is the document itself, `to_json` writes it back."""

    profile: str
    gpu_name: str
    exit_code: int
    branches: Mapping[str, BranchDecision]
    history: Mapping[str, Any] | None
    doc: Mapping[str, Any]

    @property
    def per_class(self) -> bool:
        """Whether every branch carries its classes and `decisions` lists them (what `ci decide` writes)."""
        return isinstance(self.doc.get("decisions"), list) and all(b.classes for b in self.branches.values())

    @staticmethod
    def validate(doc: Any) -> list[str]:
        """Every way `doc` breaks the decision schema, as `"<where> must ..., got ..."` strings (empty: valid)."""
        return _problems(doc)

    @classmethod
    def from_dict(cls, doc: Any, source: str = "decision") -> Decision:
        """The decision `doc` (parsed JSON), validated; raises DecisionError naming every problem."""
        problems = _problems(doc)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise DecisionError(f"{source} must follow decision schema {SCHEMA}, got {len(problems)} problem(s): "
                                f"{shown}; {FIX}")
        branches = {name: _branch(name, b) for name, b in doc["branches"].items()}
        history = doc.get("history")
        return cls(doc["profile"], doc["gpu_name"], doc["exit_code"], branches,
                   history if isinstance(history, Mapping) else None, doc)

    @classmethod
    def from_json(cls, text: str, source: str = "decision") -> Decision:
        """Parse and validate decision JSON; NaN and infinity are refused (the writer never writes them)."""
        try:
            doc = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise DecisionError(f"{source} must be JSON, got a parse error ({exc}); {FIX}") from None
        return cls.from_dict(doc, source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Decision:
        """Read and validate a decision file. OSError (no such file, ...) is left to the caller."""
        data = Path(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecisionError(f"decision file {path} must be UTF-8 JSON, got a byte that is not UTF-8 at offset "
                                f"{exc.start}; {FIX}") from None
        return cls.from_json(text, f"decision file {path}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.doc)

    def to_json(self) -> str:
        return json.dumps(self.doc, indent=1, allow_nan=False) + "\n"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically: a failed write leaves the previous file, never a truncated one."""
        return atomic.write_text(path, self.to_json())


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _summary(per_class: Mapping[str, Any]) -> Any:
    """The branch value its classes imply: one int when they agree, else the mapping (order aside)."""
    found = set(per_class.values())
    return next(iter(found)) if len(found) == 1 else dict(per_class)


def _tested(entry: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(sorted(x["T"] for x in entry["lengths"]))


def _branch(name: str, b: Mapping[str, Any]) -> BranchDecision:
    classes = {cls: ClassDecision(e["key"], cls, e["current"], e["proposed"], e["changed"], _tested(e),
                                  e.get("lasting") if isinstance(e.get("lasting"), Mapping) else None)
               for cls, e in (b.get("classes") or {}).items()}
    return BranchDecision(name, b["key"], b["suite"], b["current"], b["proposed"], b["changed"],
                          str(b.get("reason") or ""), classes)


def _lengths_problems(e: Mapping[str, Any], where: str, errors: list[str]) -> None:
    lengths = e.get("lengths")
    if not isinstance(lengths, list) or not all(isinstance(x, Mapping) and _int(x.get("T")) for x in lengths):
        errors.append(f"{where}.lengths must be a list of {{T: int, ...}}, got {lengths!r}")


def _entry_problems(e: Any, where: str, errors: list[str]) -> None:
    """One (key, class) entry: int values, the proposal a threshold, `changed` consistent, `lengths`."""
    if not isinstance(e, Mapping):
        errors.append(f"{where} must be an object, got {type(e).__name__}")
        return
    for name in ("current", "proposed"):
        if not _int(e.get(name)):
            errors.append(f"{where}.{name} must be an int, got {e.get(name)!r}")
        elif why := values.problem(e[name], f"{where}.{name}"):
            errors.append(why)
    if not isinstance(e.get("changed"), bool):
        errors.append(f"{where}.changed must be true or false, got {e.get('changed')!r}")
    elif _int(e.get("current")) and _int(e.get("proposed")) and e["changed"] != (e["proposed"] != e["current"]):
        errors.append(f"{where}.changed must say whether proposed differs from current, got changed {e['changed']} "
                      f"with {e['current']} -> {e['proposed']}")
    _lengths_problems(e, where, errors)


def _branch_problems(name: str, b: Any, errors: list[str]) -> set[tuple[str, str]]:
    """Problems of one branch; returns its (key, class) pairs."""
    where = f"decision.branches.{name}"
    ok = (isinstance(b, Mapping) and isinstance(b.get("key"), str)
          and all(values.is_value(b.get(k)) for k in ("current", "proposed"))
          and isinstance(b.get("changed"), bool) and isinstance(b.get("suite"), str))
    if not ok:
        errors.append(f"{where} must have key (str), current and proposed (int or class -> int), changed (bool) "
                      f"and suite (str), got {b!r}")
        return set()
    for part in ("current", "proposed"):
        if why := values.problem(b[part], f"{where}.{part}"):
            errors.append(why)
    if b["changed"] != (b["proposed"] != b["current"]):
        errors.append(f"{where}.changed must say whether proposed differs from current, got changed {b['changed']} "
                      f"with {values.text(b['current'])} -> {values.text(b['proposed'])}")
    classes = b.get("classes")
    if classes is None:  # one value for every class (no per-class entries to check)
        _lengths_problems(b, where, errors)
        return set()
    if not isinstance(classes, Mapping) or not classes:
        errors.append(f"{where}.classes must be a non-empty mapping of shape classes, got {classes!r}")
        return set()
    before = len(errors)
    for cls, e in classes.items():
        at = f"{where}.classes.{cls}"
        if cls not in keys.CLASSES:
            errors.append(f"{at}: class {cls!r} is unknown; classes are {', '.join(keys.CLASSES)}")
            continue
        _entry_problems(e, at, errors)
        if isinstance(e, Mapping) and (e.get("key"), e.get("class")) != (b["key"], cls):
            errors.append(f"{at} must be the entry of ({b['key']}, {cls}), got ({e.get('key')}, {e.get('class')})")
    if len(errors) > before:
        return set()
    for part in ("current", "proposed"):
        whole = _summary({c: e[part] for c, e in classes.items()})
        if b[part] != whole:
            errors.append(f"{where}.{part} must be what its classes hold ({values.text(whole)}), got "
                          f"{values.text(b[part])}")
    if b["changed"] != any(e["changed"] for e in classes.values()):
        errors.append(f"{where}.changed must say whether any class changed, got {b['changed']}")
    return {(b["key"], c) for c in classes}


def _problems(doc: Any) -> list[str]:
    if not isinstance(doc, Mapping):
        return [f"decision must be a JSON object, got {type(doc).__name__}"]
    if doc.get("schema") != SCHEMA:  # another version's file: its other fields mean other things
        return [f"decision.schema must be {SCHEMA!r}, got {doc.get('schema')!r}"]
    errors: list[str] = []
    profile, gpu_name, code = doc.get("profile"), doc.get("gpu_name"), doc.get("exit_code")
    if not (isinstance(profile, str) and SM.fullmatch(profile)):
        errors.append(f"decision.profile must be a profile such as 'sm90' or 'cpu', got {profile!r}")
    if not (isinstance(gpu_name, str) and gpu_name.strip()):
        errors.append(f"decision.gpu_name must be a non-empty string, got {gpu_name!r}")
    if not _int(code) or code not in EXIT_CODES:
        errors.append(f"decision.exit_code must be {' or '.join(map(str, EXIT_CODES))}, got {code!r}")
    if doc.get("history") is not None and not isinstance(doc.get("history"), Mapping):
        errors.append(f"decision.history must be an object (`ci history`'s verdict) or absent, got "
                      f"{type(doc['history']).__name__}")
    branches = doc.get("branches")
    if not isinstance(branches, Mapping) or not branches:
        errors.append(f"decision.branches must be a non-empty mapping, got {branches!r}")
        return errors
    pairs: set[tuple[str, str]] = set()
    for name, b in branches.items():
        pairs |= _branch_problems(str(name), b, errors)
    entries = doc.get("decisions")
    if entries is None:
        return errors
    if not isinstance(entries, list):
        errors.append(f"decision.decisions must be a list of (key, class) entries, got {type(entries).__name__}")
        return errors
    before = len(errors)
    for i, e in enumerate(entries):
        _entry_problems(e, f"decision.decisions[{i}]", errors)
    if len(errors) == before:
        listed = {(e.get("key"), e.get("class")) for e in entries}
        if listed != pairs:
            odd = sorted(map(str, listed ^ pairs))[:3]
            errors.append(f"decision.decisions must list the same (key, class) entries as the branches' classes, "
                          f"got {', '.join(odd)} in one only")
    return errors
