"""What the threshold PR says and contains, built from a decision and a report folder (pure, no network).

``ci.github`` sends a ``PrPlan``; a dry run writes it to disk. Keeping the plan pure lets the
title, labels, body limit and committed paths be tested without a server.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ci import values
from nsa import keys

__all__ = [
    "BODY_LIMIT",
    "LABEL",
    "PlanError",
    "PrPlan",
    "ReportFile",
    "branch_for",
    "build_plan",
    "keep_unmeasured",
    "link_images",
    "load_report",
    "safe_name",
    "truncate_body",
    "validate_decision",
]

DECISION_SCHEMA = "nsa-decision/2"  # ci.decide.SCHEMA, not imported: this module stays free of numpy
BODY_LIMIT = 65536  # GitHub rejects a PR body longer than this many characters
TITLE_LIMIT = 256
LABEL = "nsa-thresholds"
REPORT_NAME = "report.md"
PLOT_SUFFIXES = (".png",)
_PROFILE = re.compile(r"sm[0-9]+[a-z]?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MARKDOWN = re.compile(r"([\\`*_\[\]<>#|~])")
NAME_LIMIT = 100


def safe_name(name: str) -> str:
    """``name`` (a GPU name from a results file) as one line of inert text for a title or a markdown
    body: control characters and line breaks become spaces, runs of spaces one, markdown and HTML
    characters are escaped with a backslash, and at most NAME_LIMIT characters are kept."""
    flat = " ".join(_CONTROL.sub(" ", name).split())[:NAME_LIMIT]
    return _MARKDOWN.sub(r"\\\1", flat)


class PlanError(ValueError):
    """The decision or report cannot make a PR; the message says how to fix it."""


@dataclass(frozen=True)
class ReportFile:
    """A file committed with the thresholds: ``path`` inside the repository, raw ``content``."""

    path: str
    content: bytes


@dataclass(frozen=True)
class PrPlan:
    """Everything the PR needs apart from the repository's state."""

    profile: str
    gpu_name: str
    branch: str
    title: str
    report: str
    labels: tuple[str, ...]
    changes: dict[str, values.Value]  # key -> int, or per-class mapping (written as a YAML flow mapping)
    files: tuple[ReportFile, ...]
    commit_message: str
    # (key, class) pairs this run measured (its cells covered the key's decision grid) and did not:
    # an open PR's change to an unmeasured pair is kept (`keep_unmeasured`), never closed on no evidence.
    covered: tuple[tuple[str, str], ...] = ()
    uncovered: tuple[tuple[str, str], ...] = ()
    decision: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def report_dir(self) -> str:
        return f"reports/{self.profile}"

    def body(self, raw_base: str | None = None) -> str:
        """The PR body: the report, image links pointing at ``raw_base`` when given, within the limit."""
        text = self.report if raw_base is None else link_images(self.report, self.files, raw_base)
        return truncate_body(text, f"{self.report_dir}/{REPORT_NAME}")


def branch_for(profile: str) -> str:
    """The one branch the pipeline pushes for ``profile``."""
    return f"nsa-thresholds/{profile}"


def truncate_body(text: str, full_report_path: str, limit: int = BODY_LIMIT) -> str:
    """``text`` cut at a line boundary so that it plus a note fits in ``limit`` characters."""
    if len(text) <= limit:
        return text
    note = (
        f"\n\n---\n*Report truncated to fit GitHub's {limit}-character limit; the full report is "
        f"committed as `{full_report_path}` on this PR's branch.*\n"
    )
    head = text[: limit - len(note)]
    cut = head.rfind("\n")
    if cut > len(head) // 2:
        head = head[:cut]
    return head + note


def link_images(text: str, files: tuple[ReportFile, ...], raw_base: str) -> str:
    """Point relative links to committed plots (``![..](plot.png)``, ``src="plot.png"``) at ``raw_base``."""
    names = {f.path.rsplit("/", 1)[-1] for f in files}

    def absolute(target: str) -> str | None:
        name = target[2:] if target.startswith("./") else target
        return f"{raw_base.rstrip('/')}/{name}" if name in names else None

    def markdown(m: re.Match[str]) -> str:
        url = absolute(m.group(2))
        return m.group(0) if url is None else f"{m.group(1)}({url})"

    def html(m: re.Match[str]) -> str:
        url = absolute(m.group(2))
        return m.group(0) if url is None else f"{m.group(1)}{url}{m.group(3)}"

    text = re.sub(r"(!\[[^\]]*\])\(([^)\s]+)\)", markdown, text)
    return re.sub(r"""(src=["'])([^"']+)(["'])""", html, text)


def load_report(report_dir: str | Path, profile: str) -> tuple[str, tuple[ReportFile, ...]]:
    """``report.md`` and the plots of ``report_dir``, as committed under ``reports/<profile>/``."""
    folder = Path(report_dir)
    report = folder / REPORT_NAME
    if not report.is_file():
        raise PlanError(
            f"--report-dir must contain {REPORT_NAME}, got {str(folder)!r} without it; "
            "run `python -m ci report` first and pass its output folder"
        )
    names = [REPORT_NAME] + sorted(
        p.name for p in folder.iterdir() if p.name != REPORT_NAME and p.suffix.lower() in PLOT_SUFFIXES
    )
    files = tuple(ReportFile(f"reports/{profile}/{n}", _read_regular(folder / n)) for n in names)
    return files[0].content.decode("utf-8"), files


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, a regular file of the report folder itself: a symlink (to
    /proc/self/environ, which holds the token, say), a hard link (a second name of a file elsewhere,
    such as a credentials file on the runner's disk), a FIFO, a device or a folder is refused, since
    whatever it reads would be committed to a public branch. ``O_NOFOLLOW`` refuses a symlink at the
    open itself, so nothing can swap the file for a link between a check and the read; the link
    count comes from the opened file itself. `ci report` writes every file new, with one name."""
    refused = (
        f"--report-dir must hold only regular files, got {str(path)!r} as {{what}}; the publisher follows "
        "no links, so delete it and rerun `python -m ci report` to write the folder anew"
    )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if path.is_symlink():
        raise PlanError(refused.format(what=f"a symlink to {os.readlink(path)!r}"))
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if path.is_symlink():  # made a link after the check above: O_NOFOLLOW refused it
            raise PlanError(refused.format(what="a symlink")) from None
        raise PlanError(f"--report-dir must hold readable files, got {str(path)!r} ({exc.strerror}); rerun "
                        "`python -m ci report` to write the folder anew") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise PlanError(refused.format(what="a folder" if stat.S_ISDIR(info.st_mode) else "a special file"))
    if info.st_nlink > 1:
        os.close(fd)
        raise PlanError(refused.format(what=f"a hard link (one of {info.st_nlink} names of one file)"))
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _branches(decision: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    branches = decision.get("branches")
    if not isinstance(branches, Mapping) or not branches:
        raise PlanError(
            f"decision.branches must be a non-empty mapping, got {branches!r}; "
            "pass the file written by `python -m ci decide`"
        )
    for name, b in branches.items():
        ok = (
            isinstance(b, Mapping)
            and isinstance(b.get("key"), str)
            and all(values.is_value(b.get(k)) for k in ("current", "proposed"))
            and isinstance(b.get("changed"), bool)
        )
        if not ok:
            raise PlanError(
                f"decision.branches.{name} must have key (str), current and proposed (int or class -> int) and changed "
                f"(bool), got {b!r}; pass the file written by `python -m ci decide`"
            )
    return dict(branches)


def _shown(value: values.Value) -> str:
    return values.text(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_decision(doc: Any) -> None:
    """Raise `PlanError` unless `doc` is a decision a threshold PR may carry.

    A PR may carry a decision only when no cell failed (exit_code 0: no parity failure, no failed
    cell anywhere) and every proposal is a value the decision rule can produce: -1, or one of the
    sequence lengths that key's cells were tested at. Anything else (a hand-edited file, a decision
    from a broken run) would put a value on the PR branch that no measurement supports.
    """
    fix = "rerun `python -m ci decide` and fix what it reports before opening a PR"
    if not isinstance(doc, Mapping):
        raise PlanError(f"decision must be a JSON object, got {type(doc).__name__}; pass out/decision.json")
    if doc.get("schema") != DECISION_SCHEMA:
        raise PlanError(f"decision.schema must be {DECISION_SCHEMA!r}, got {doc.get('schema')!r}; pass the file "
                        "written by `python -m ci decide`")
    if doc.get("exit_code") != 0 or isinstance(doc.get("exit_code"), bool):
        raise PlanError(f"decision.exit_code must be 0, got {doc.get('exit_code')!r} (3: parity failure); {fix}")
    cells = doc.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, Mapping) for c in cells):
        raise PlanError(f"decision.cells must be a list of cells, got {type(cells).__name__}; {fix}")
    failed = [str(c.get("id")) for c in cells if c.get("verdict") == "failed"]
    failures = doc.get("failures") or []
    parity = [str(f.get("id")) for f in failures if isinstance(f, Mapping) and f.get("parity_failed")]
    if failed or parity:
        shown = sorted(set(failed + parity))
        raise PlanError(f"decision must have no failed cells, got {len(shown)} ({', '.join(shown[:3])}"
                        f"{', ...' if len(shown) > 3 else ''}); {fix}")
    history_fix = ("run `python -m ci history` on it first (the K-run rule: a change needs the same value in the last "
                   "K runs), then pass the decision it rewrote")
    if not isinstance(doc.get("history"), Mapping):
        raise PlanError(f"decision must carry the verdict of `ci history`, got a decision without `history`; "
                        f"{history_fix}")
    from nsa import settings  # PyYAML: imported here, so `python -m ci guard` needs nothing installed

    for name, b in _branches(doc).items():
        try:
            settings.threshold(b["proposed"], f"decision.branches.{name}.proposed")
        except settings.SettingsError as exc:
            raise PlanError(f"{exc}; {fix}") from None
        if b["changed"] != (b["proposed"] != b["current"]):
            raise PlanError(f"decision.branches.{name}.changed must say whether proposed differs from current, got "
                            f"changed {b['changed']} with {b['current']} -> {b['proposed']}; {fix}")
        classes = b.get("classes")
        entries = classes.values() if isinstance(classes, Mapping) else [b]
        if isinstance(classes, Mapping) and classes:
            per_class = {c: e.get("proposed") for c, e in classes.items() if isinstance(e, Mapping)}
            whole = next(iter(set(per_class.values()))) if len(set(per_class.values())) == 1 else per_class
            if b["proposed"] != whole:
                raise PlanError(f"decision.branches.{name}.proposed must be what its classes propose ({whole}), got "
                                f"{b['proposed']}; {fix}")
        for e in entries:
            where = f"decision.branches.{name}" + (f".classes.{e.get('class')}" if classes else "")
            lengths = e.get("lengths")
            if not isinstance(lengths, list) or not all(isinstance(x, Mapping) and _is_int(x.get("T")) for x in lengths):
                raise PlanError(f"{where}.lengths must be a list of {{T: int, ...}}, got {lengths!r}; {fix}")
            tested = sorted(x["T"] for x in lengths)
            lasting = e.get("lasting")
            if not isinstance(lasting, Mapping) or not isinstance(lasting.get("covered"), bool):
                raise PlanError(f"{where}.lasting must be the verdict of `ci history` (held, covered), got "
                                f"{lasting!r}; {history_fix}")
            if e.get("changed") and lasting.get("held") is not True:
                raise PlanError(f"{where} must change only a value that lasted (lasting.held true), got "
                                f"{e.get('current')} -> {e.get('proposed')} with held {lasting.get('held')!r}; "
                                f"{history_fix}")
            if e.get("changed") and e.get("proposed") != -1 and e.get("proposed") not in tested:
                raise PlanError(f"{where}.proposed must be -1 or a tested length of {b['key']} "
                                f"({', '.join(map(str, tested)) or 'none tested'}), got {e.get('proposed')}; {fix}")


def _title(gpu_name: str, profile: str, branches: Mapping[str, Mapping[str, Any]]) -> str:
    parts = [
        f"{name} {_shown(b['current'])} -> {_shown(b['proposed'])}" if b["changed"]
        else f"{name} {_shown(b['current'])} (unchanged)"
        for name, b in branches.items()
    ]
    title = f"NSA thresholds for {gpu_name} ({profile}): {', '.join(parts)}"
    return title if len(title) <= TITLE_LIMIT else title[: TITLE_LIMIT - 3] + "..."


def _coverage(branches: Mapping[str, Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(covered, uncovered) (key, class) pairs from each entry's `lasting.covered` (set by `ci history`;
    an entry without it counts as covered). A branch without classes stands for every class."""
    covered: list[tuple[str, str]] = []
    uncovered: list[tuple[str, str]] = []
    for b in branches.values():
        classes = b.get("classes")
        items = (list(classes.items()) if isinstance(classes, Mapping) and classes
                 else [(c, b) for c in keys.CLASSES])
        for cls, e in items:
            lasting = e.get("lasting") if isinstance(e, Mapping) else None
            seen = not isinstance(lasting, Mapping) or lasting.get("covered") is not False
            (covered if seen else uncovered).append((b["key"], str(cls)))
    return covered, uncovered


def keep_unmeasured(plan: PrPlan, kept: Mapping[tuple[str, str], int], number: int) -> PrPlan:
    """``plan`` with the open PR #``number``'s values for (key, class) pairs this run did not measure.

    A run that never timed a key says nothing about it: the PR keeps the change that covering runs
    put there (it opened on K runs of evidence and closes only on covering evidence).
    """
    if not kept:
        return plan
    doc = copy.deepcopy(dict(plan.decision))
    for b in doc["branches"].values():
        mine = {cls: v for (key, cls), v in kept.items() if key == b["key"]}
        if not mine:
            continue
        why = f"kept from PR #{number}, this run did not measure it"
        classes = b.get("classes")
        if isinstance(classes, Mapping) and classes:
            for cls, v in mine.items():
                e = classes[cls]
                e.update(proposed=v, changed=v != e["current"], reason=f"{v} {why}")
            per_class = {c: e["proposed"] for c, e in classes.items()}
        else:
            whole = b["proposed"]
            per_class = {c: whole[c] if isinstance(whole, Mapping) else whole for c in keys.CLASSES} | mine
        b["proposed"] = values.written(per_class)
        b["changed"] = b["proposed"] != b["current"]
        shown = ", ".join(f"{c}: {v}" for c, v in values.ordered(mine).items())
        b["reason"] = f"{b.get('reason') or ''}; {shown} {why}".lstrip("; ")
    return build_plan(doc, plan.report, plan.files)


def build_plan(decision: Mapping[str, Any], report: str, files: tuple[ReportFile, ...]) -> PrPlan:
    """The plan for ``decision`` (the JSON of ``ci decide``) with its rendered report."""
    if not isinstance(decision, Mapping):
        raise PlanError(
            f"decision must be a JSON object, got {type(decision).__name__}; pass out/decision.json"
        )
    profile = decision.get("profile")
    if not isinstance(profile, str) or not _PROFILE.fullmatch(profile):
        raise PlanError(
            f"decision.profile must be a GPU profile such as 'sm90', got {profile!r}; "
            "a run without a GPU proposes no thresholds, so skip `ci pr` for it"
        )
    gpu_name = decision.get("gpu_name")
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise PlanError(
            f"decision.gpu_name must be a non-empty string, got {gpu_name!r}; "
            "pass the file written by `python -m ci decide`"
        )
    branches = _branches(decision)
    changes = {b["key"]: b["proposed"] for b in branches.values() if b["changed"]}
    covered, uncovered = _coverage(branches)
    gpu_name = safe_name(gpu_name)
    title = _title(gpu_name, profile, branches)
    lines = [title, ""]
    for name, b in branches.items():
        state = (f"{_shown(b['current'])} -> {_shown(b['proposed'])}" if b["changed"]
                 else f"{_shown(b['current'])} (unchanged)")
        lines.append(f"profiles.{profile}.{b['key']} ({name}): {state}")
        if b.get("reason"):
            lines.append(f"  {b['reason']}")
    lines += ["", f"Report: reports/{profile}/{REPORT_NAME}"]
    return PrPlan(
        profile=profile,
        gpu_name=gpu_name,
        branch=branch_for(profile),
        title=title,
        report=report,
        labels=(LABEL, f"profile:{profile}"),
        changes=changes,
        files=files,
        commit_message="\n".join(lines) + "\n",
        covered=tuple(covered),
        uncovered=tuple(uncovered),
        decision=decision,
    )
