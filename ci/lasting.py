"""Evidence that lasts: a threshold changes only when the change holds across runs and GPU models.

A run's decide step produces one entry per (key, shape class): ``{"key", "class", "current",
"measured", "proposed", "changed", "reason", ...}``, where ``measured`` is what that run's cells
alone say (None when they cannot say). ``lasting`` lets a change through only when

- the same value was measured in each of the last K runs of this GPU model (this run included),
  counting only runs that have an entry for that (key, class) (a run of another suite says nothing
  about the key: ``ci.history_cmd.record_entries`` records only entries whose cells reached the
  key's longest decision length, so a smoke or partial run never breaks a streak), and
- every other GPU model of the same profile that has history measured it in each of its latest K
  runs (fewer when it has fewer: a model with one run must agree in that run).

Otherwise the entry keeps ``current`` and ``reason`` says which run on which model disagreed, or
how many runs there are so far. Two models that disagree (an H100 and an H200 at short lengths)
therefore never flip a shared sm profile back and forth. Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ci.history import HistoryRun

DEFAULT_K = 3
Entry = Mapping[str, Any]


@dataclass(frozen=True)
class RunDecisions:
    """One run's decision entries (from its history record, or this run's decide)."""

    run_id: str
    created_at: str
    entries: list[dict[str, Any]] = field(default_factory=list)


def from_history(runs: Iterable[HistoryRun]) -> list[RunDecisions]:
    """The decision entries stored in history records, oldest first."""
    return [RunDecisions(r.id, r.created_at, list(r.decisions))
            for r in sorted(runs, key=lambda r: (r.created_at, r.id))]


def _entry(run: RunDecisions, key: str, cls: str) -> Entry | None:
    return next((e for e in run.entries if e.get("key") == key and e.get("class", "") == cls), None)


def _with_entry(runs: Sequence[RunDecisions], key: str, cls: str, skip: str) -> list[tuple[RunDecisions, Entry]]:
    """Runs (oldest first) that decided (key, cls), leaving out run id ``skip``; one per run id."""
    ordered = sorted(runs, key=lambda r: (r.created_at, r.run_id))
    once = {r.run_id: r for r in reversed(ordered)}  # a run listed twice (a copy) counts once: its first
    return [(r, e) for r in ordered if r.run_id != skip and once[r.run_id] is r
            and (e := _entry(r, key, cls)) is not None]


def _disagreement(model: str, runs: Sequence[tuple[RunDecisions, Entry]], target: int) -> str:
    for run, e in reversed(runs):  # newest first: the most recent disagreement is the one to report
        if e.get("measured") != target:
            return f"run {run.run_id} on {model} measured {e.get('measured')}"
    return ""


def hold(entry: Entry, *, model: str, run_id: str, history: Mapping[str, Sequence[RunDecisions]],
         k: int = DEFAULT_K) -> tuple[bool, str, list[dict[str, Any]]]:
    """(held, why not, evidence) for one changed entry of run ``run_id`` on GPU model ``model``."""
    key, cls, target = str(entry["key"]), str(entry.get("class", "")), entry["proposed"]
    own = _with_entry(history.get(model, ()), key, cls, run_id)[-(k - 1):] if k > 1 else []
    evidence = [{"model": model, "run": r.run_id, "measured": e.get("measured")} for r, e in own]
    evidence.append({"model": model, "run": run_id, "measured": entry.get("measured")})
    if entry.get("measured") != target:
        return False, f"this run measured {entry.get('measured')}, not {target}", evidence
    if why := _disagreement(model, own, target):
        return False, why, evidence
    if len(own) + 1 < k:
        return False, f"only {len(own) + 1} of {k} runs so far on {model}", evidence
    for other in sorted(m for m in history if m != model):
        theirs = _with_entry(history[other], key, cls, run_id)[-k:]
        evidence += [{"model": other, "run": r.run_id, "measured": e.get("measured")} for r, e in theirs]
        if why := _disagreement(other, theirs, target):
            return False, why, evidence
    return True, "", evidence


def lasting(current: RunDecisions, history: Mapping[str, Sequence[RunDecisions]], k: int = DEFAULT_K, *,
            model: str) -> list[dict[str, Any]]:
    """This run's entries with every change that does not last turned back into "keep current".

    Args:
        current: this run's entries, straight from decide (``measured`` is this run's evidence).
        history: ``{gpu model slug: its runs' decisions}`` for every model of this run's profile;
            this run may already be in it (matched by run id, never counted twice).
        k: how many consecutive runs of a model must agree (config ``history.k``, default 3).
        model: this run's GPU model slug (``ci.history.gpu_slug``).

    Each entry gains ``lasting``: ``{"k", "held", "evidence": [{"model", "run", "measured"}]}``.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}; set history.k in configs/base.yaml (default 3)")
    out = []
    for entry in current.entries:
        new = dict(entry)
        if not entry.get("changed"):
            new["lasting"] = {"k": k, "held": None, "evidence": []}
            out.append(new)
            continue
        held, why, evidence = hold(entry, model=model, run_id=current.run_id, history=history, k=k)
        new["lasting"] = {"k": k, "held": held, "evidence": evidence}
        if held:
            others = sorted({e["model"] for e in evidence if e["model"] != model})
            where = f"{model}" + (f" and on {', '.join(others)}" if others else "")
            new["reason"] = f"{entry.get('reason', '')}; held in the last {k} runs on {where}".lstrip("; ")
        else:
            new.update(proposed=entry["current"], changed=False, reason=(
                f"keeping {entry['current']}: this run measured {entry['proposed']}, but {why}; a change "
                f"needs the same value in the last {k} runs of every GPU model of this profile"))
        out.append(new)
    return out
