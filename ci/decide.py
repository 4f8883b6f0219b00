"""`ci decide`: turn results files into one threshold decision per (decision key, shape class).

The rule is docs/pipeline.md ("Decision"), applied to every key declared in `nsa_contract.keys` alike: the
key's candidate backend against masked SDPA in the key's suite, the same statistics, margin and
threshold rule. Cells are grouped by shape class (`nsa_contract.keys.class_of`: the GQA group size bucket),
and a class decides only from its own cells, so one layout never vetoes another that dispatch
would not confuse with it. Only cells at the model's configured grid (window, compression and
selection parameters) decide; every other pair is reported only. Cells where both sides are
faster than `decide.time_floor_ms`, or where on both sides the host's enqueue time of one call
reaches the timed median (`ci.gates.host_bound`), are launch-bound and decide nothing. A class
whose cells do not reach the longest length of the key's decision grid (a smoke or partial run)
keeps its value: the threshold rule needs every length above the proposal tested, and the longest
one most of all.

Everything here is pure except `load_config`, `decide_files` and `write_decision`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ci import autobest, gates, stats
from ci.cells import (
    Cell,
    case_problem,
    judge,
    length_verdict,
    pair_cases,
    parity_failed,
)
from ci.noise import CALIBRATION_SUITE, noise_floor
from nsa_contract import exits, keys, results, settings, values
from nsa_contract.decision import SCHEMA, Decision


class DecideError(ValueError):
    """Input that cannot be decided on: inconsistent results files or a broken config."""


@dataclass(frozen=True)
class Family:
    """A family of keys: one kind of candidate backend, timed in one suite."""

    name: str
    label: str
    suite: str
    backends: tuple[str, ...]


FAMILIES = tuple(Family(f, keys.FAMILY_LABELS[f], keys.of_family(f)[0].suite,
                        tuple(dict.fromkeys(c for k in keys.of_family(f) for c in k.candidates)))
                 for f in keys.FAMILIES)
FAMILY = {f.name: f for f in FAMILIES}


@dataclass(frozen=True)
class Branch:
    """One decision key as `ci` sees it (derived from `nsa_contract.keys.KEYS`)."""

    name: str  # the key's decision_id: its entry in the decision's `branches`
    op: str
    key: str
    family: Family

    @property
    def decl(self) -> keys.DecisionKey:
        return keys.get(self.key)


BRANCHES = tuple(Branch(k.decision_id, k.op, k.name, FAMILY[k.family]) for k in keys.KEYS)


# The paper's names of the grid fields, grouped as the model configures them (arXiv 2502.11089 Sec. 3).
GRID_GROUPS = (("window",), ("cmp_block", "cmp_stride"), ("sel_block", "sel_count"))
GRID_LABELS = {"window": "w", "cmp_block": "l", "cmp_stride": "d", "sel_block": "l'", "sel_count": "n"}


@dataclass(frozen=True)
class DecideConfig:
    """What `ci decide` needs from the config (margin possibly overridden)."""

    margin: float
    settings: settings.Settings

    @property
    def confidence(self) -> float:
        return float(self.settings.decide["confidence"])

    @property
    def time_floor_ms(self) -> float:
        return float(self.settings.decide["time_floor_ms"])

    @property
    def grid(self) -> dict[str, int]:
        return self.settings.grid

    @classmethod
    def from_mapping(cls, cfg: Any, margin: float | None = None, source: str = "config") -> DecideConfig:
        """From an already parsed config (tests, callers holding a dict), through the same loader."""
        import yaml

        try:
            loaded = settings.load_text(yaml.safe_dump(cfg, sort_keys=False), source)
        except settings.SettingsError as exc:
            raise DecideError(str(exc)) from None
        return cls(_margin(loaded, margin), loaded)

    def current(self, profile: str, key: str, cls: str) -> tuple[int, str]:
        """The threshold in force for `profile` and class `cls`, and where it comes from."""
        return self.settings.value(key, profile, cls)

    def off_grid(self, op: str, params: Mapping[str, Any]) -> str:
        """Why a branch cell's grid point is not the model's, or "" when it is: the first group of
        `nsa` fields (window; cmp_block/cmp_stride; sel_block/sel_count) that differs, by its config names."""
        fields = dict(keys.GRID_FIELDS.get(op, ()))
        for group in GRID_GROUPS:
            names = [n for n in group if n in fields]
            got = [params.get(fields[n]) for n in names]
            want = [self.grid[n] for n in names]
            if got == want:
                continue
            if names == ["window"]:
                return f"window {got[0]} is not nsa.window {want[0]}"
            shown = ", ".join(f"{GRID_LABELS[n]}={g}" for n, g in zip(names, got, strict=True))
            return f"{shown} is not nsa.{'/'.join(names)} {'/'.join(map(str, want))}"
        return ""


def load_config(path: str | os.PathLike[str] | None = None, margin: float | None = None) -> DecideConfig:
    """The config through the one loader (nsa_contract.settings), with an optional margin override."""
    try:
        cfg = settings.load(path)
    except settings.SettingsError as exc:
        raise DecideError(str(exc)) from None
    return DecideConfig(_margin(cfg, margin), cfg)


def _margin(cfg: settings.Settings, margin: float | None) -> float:
    """The margin override, else the config's decide.margin (the loader checked that one)."""
    chosen = cfg.decide["margin"] if margin is None else margin
    if isinstance(chosen, bool) or not isinstance(chosen, (int, float)) or not math.isfinite(chosen) or chosen <= 0:
        raise DecideError(f"margin must be a finite number > 0, got {chosen!r}; pass e.g. --margin 1.2")
    return float(chosen)


def branch_of(op: str, suite: str, candidate: str) -> Branch | None:
    """The branch a cell belongs to (its table in the report): the op's branch whose family has
    this candidate, else the one whose suite this is, else the op's first; None for an op
    without a threshold key."""
    options = [b for b in BRANCHES if b.op == op]
    for match in (lambda b: candidate in b.family.backends, lambda b: suite == b.family.suite, lambda b: True):
        found = next((b for b in options if match(b)), None)
        if found is not None:
            return found
    return None


def _mark_use(cell: Cell, cfg: DecideConfig) -> None:
    """Set branch, class, used_for_decision and note (why a cell is reported only)."""
    branch = branch_of(cell.op, cell.suite, cell.candidate_backend)
    cell.branch = branch.name if branch else None
    cell.cls = keys.class_of_params(cell.params)
    floor = cfg.time_floor_ms
    if branch is None:
        cell.note = f"op {cell.op} has no threshold key"
    elif cell.suite != branch.family.suite:
        cell.note = f"suite {cell.suite} is reported only; suite {branch.family.suite} decides"
    elif cell.candidate_backend not in branch.family.backends:
        cell.note = f"{cell.candidate_backend} is not {branch.family.label}; reported only"
    elif off := cfg.off_grid(cell.op, cell.params):
        cell.note = off
    elif cell.params.get("part") != branch.decl.part:
        cell.note = (f"part {cell.params.get('part') or 'attention only'} is reported only; "
                     f"{branch.key} is decided on part {branch.decl.part or 'attention only'}")
    elif cell.verdict == "skipped":
        cell.note = "skipped cells decide nothing"
    elif cell.cls is None:
        cell.note = "params must carry Hq and Hkv to give the cell a shape class"
    elif cell.baseline and cell.candidate and max(cell.baseline["median_ms"], cell.candidate["median_ms"]) < floor:
        cell.note = f"launch-bound: both sides under decide.time_floor_ms = {floor:g} ms"
    elif cell.baseline and cell.candidate and gates.host_bound(cell.baseline) and gates.host_bound(cell.candidate):
        cell.note = ("launch-bound: on both sides the host's enqueue time of one call (timing.host_ms) "
                     "reaches the timed median, so the host, not the kernel, ranked them")
    else:
        if not isinstance(cell.T, int):
            raise DecideError(f"case {cell.id}: params.T must be an integer sequence length, got "
                              f"{cell.T!r}; the bench must record T for every {cell.op} case")
        cell.used_for_decision = True


def _mark_auto(cell: Cell, cfg: DecideConfig, profile: str) -> None:
    """Which backend `auto` would pick for the cell under the config in force (thresholds only:
    dispatch also asks the backend whether it can run the call), so the report can show it."""
    if cell.cls is None or not isinstance(cell.T, int) or isinstance(cell.T, bool) or not keys.for_op(cell.op):
        return
    cell.auto_backend, cell.auto_why = cfg.settings.planned(cell.op, cell.cls, cell.T, profile)


def _join(lengths: Sequence[int]) -> str:
    return ", ".join(str(t) for t in lengths)


def measured_threshold(lengths: Sequence[tuple[int, str]], margin: float,
                       label: str = "FA-2") -> tuple[int | None, str]:
    """Threshold the length verdicts imply, and why; None when uncertain lengths decide it.

    The smallest tested length L such that every tested length >= L is `adopt`; -1 when the
    longest tested length is `reject`. An `inconclusive` or `failed` length above the last
    `reject` could move the answer either way, so then the answer is None (keep the current value).
    """
    tested = sorted((t, v) for t, v in lengths if v != "skipped")
    if not tested:
        return None, "no length was tested"
    last_reject = max((i for i, (_, v) in enumerate(tested) if v == "reject"), default=-1)
    deciding = [f"{t} ({v})" for t, v in tested[last_reject + 1:] if v in ("failed", "inconclusive")]
    wins_below = [t for t, v in tested[:last_reject + 1] if v == "adopt"]
    if deciding:
        return None, (f"{', '.join(deciding)} decide the answer; rerun with more repeats, or fix the "
                      "failures, to settle it")
    if last_reject == len(tested) - 1:
        if wins_below:
            return -1, (f"{label} cleared {margin:g}x only at {_join(wins_below)}, not at the longest tested "
                        f"length {tested[-1][0]} (reject), so {label} stays off for this branch")
        return -1, f"{label} never cleared {margin:g}x (longest tested length {tested[-1][0]} is reject)"
    adopted = [t for t, _ in tested[last_reject + 1:]]
    why = f"{label} cleared {margin:g}x at every tested length >= {adopted[0]} ({_join(adopted)})"
    if wins_below:
        why += f"; it also won at {_join(wins_below)}, below the reject at {tested[last_reject][0]}"
    return adopted[0], why


def _class_entry(branch: Branch, cls: str, cells: Sequence[Cell], cfg: DecideConfig, profile: str,
                 unavailable: str, launch_bound: Sequence[int] = ()) -> dict[str, Any]:
    """One (key, class) decision: lengths, measured threshold and the proposal against the value in force.
    `launch_bound`: lengths whose cells were all under the time floor (they decide nothing)."""
    current, source = cfg.current(profile, branch.key, cls)
    by_t: dict[int, list[Cell]] = {}
    for c in cells:
        by_t.setdefault(c.T, []).append(c)
    lengths = [{"T": t, "class": cls, "verdict": length_verdict(c.verdict for c in by_t[t]),
                "cells": [c.id for c in by_t[t]]} for t in sorted(by_t)]
    deciding = [(x["T"], x["verdict"]) for x in lengths]
    lengths = sorted(lengths + [{"T": t, "class": cls, "verdict": "launch-bound", "cells": []} for t in launch_bound],
                     key=lambda x: x["T"])
    longest = max(branch.decl.nightly_lengths)
    missing = [longest] if cells and longest not in by_t else []
    if unavailable:
        measured, reason = None, f"keeping {current}: {unavailable}; no threshold can be proposed"
    elif not cells:
        measured, reason = None, (f"keeping {current}: no deciding {branch.family.label} cell of op {branch.op} "
                                  f"in class {cls} (suite {branch.family.suite}, the model's grid)")
    elif missing:
        measured = None
        reason = (f"keeping {current}: the run's grid does not cover the decision grid (its longest length "
                  f"{longest} is untested in class {cls}; tested {_join(sorted(by_t))}); a smoke or partial run "
                  "never proposes")
    else:
        measured, why = measured_threshold(deciding, cfg.margin, branch.family.label)
        measured, why = _below_the_floor(measured, why, sorted(by_t), launch_bound, branch.family.label,
                                         current)
        if measured is None:
            reason = f"keeping {current}: {why}"
        elif measured == current:
            reason = f"{why}; the measured threshold {measured} is already in force ({source})"
        else:
            reason = f"{why}; proposing {measured} instead of {current} ({source})"
    proposed = current if measured is None else measured
    return {"key": branch.key, "class": cls, "op": branch.op, "family": branch.family.name,
            "candidate": branch.family.label, "suite": branch.family.suite, "current": current, "current_source": source, "measured": measured,
            "proposed": proposed, "changed": proposed != current, "reason": reason, "lengths": lengths}


def _below_the_floor(measured: int | None, why: str, deciding: Sequence[int], launch_bound: Sequence[int],
                     label: str, current: int | None = None) -> tuple[int | None, str]:
    """Extend an adopted threshold down over the launch-bound lengths just below it.

    Their timings decide nothing (launch overhead, not the kernel, ranks the two sides there), so
    they can neither adopt nor reject; where every deciding length from the threshold up adopted,
    the candidate keeps the lengths below it down to the next deciding length. In the whole NSA
    call those lengths are not launch-bound, and the H100 auto suite measured the masked-SDPA
    window 1.1-1.3x slower there (results/h100/sm90-classes). A value in force that already lies in
    that range (from the lowest launch-bound length up to the adopted one) stays: no timing
    contradicts it, and a change would rest on launch-bound cells alone."""
    if measured is None or measured < 0:
        return measured, why
    below = max((t for t in deciding if t < measured), default=-1)
    extend = [t for t in launch_bound if below < t < measured]
    if not extend:
        return measured, why
    if current is not None and min(extend) <= current <= measured:
        # The value in force sits among the launch-bound lengths (or at the adopted one): no timing
        # contradicts it, so moving it would rest on launch-bound cells alone (docs/pipeline.md).
        return current, (f"{why}; the value in force {current} lies in the launch-bound lengths "
                         f"{_join(sorted(extend))} (or at the first adopted one), where timings decide "
                         f"nothing: kept")
    return min(extend), (f"{why}; extended down to {min(extend)} over the launch-bound lengths "
                         f"{_join(sorted(extend))}, where timings decide nothing and {label} won above")


def written_value(per_class: Mapping[str, int]) -> int | dict[str, int]:
    """One int when every class agrees, else a mapping naming every class (the YAML form)."""
    return values.written(per_class)


def decide_branch(branch: Branch, cells: Sequence[Cell], cfg: DecideConfig, profile: str,
                  unavailable: str) -> dict[str, Any]:
    """One key's entry: a decision per class, and the value to write (int, or per-class mapping)."""
    used = [c for c in cells if c.branch == branch.name and c.used_for_decision]
    floor = {cls: sorted({c.T for c in cells if c.branch == branch.name and c.cls == cls
                          and c.note.startswith("launch-bound")} - {c.T for c in used if c.cls == cls})
             for cls in keys.CLASSES}
    classes = {cls: _class_entry(branch, cls, [c for c in used if c.cls == cls], cfg, profile, unavailable,
                                 floor[cls])
               for cls in keys.CLASSES}
    current = written_value({c: e["current"] for c, e in classes.items()})
    proposed = written_value({c: e["proposed"] for c, e in classes.items()})
    changed = [c for c, e in classes.items() if e["changed"]]
    decided = [c for c, e in classes.items() if e["lengths"]]
    shown = changed or decided
    if shown:
        reason = "; ".join(f"{c}: {classes[c]['reason']}" for c in shown)
    elif unavailable:
        reason = next(iter(classes.values()))["reason"]
    else:  # no class had a deciding cell: say so once, not in the words of whichever class came first
        reason = (f"keeping {values.text(current)}: no deciding {branch.family.label} cell of op {branch.op} in any "
                  f"class (suite {branch.family.suite}, the model's grid)")
    return {"key": branch.key, "op": branch.op, "family": branch.family.name, "candidate": branch.family.label,
            "suite": branch.family.suite, "current": current,
            "current_source": f"profiles.{profile}.{branch.key} (per class: see classes)",
            "proposed": proposed, "changed": bool(changed), "reason": reason,
            "lengths": [x for e in classes.values() for x in e["lengths"]], "classes": classes}


def _unavailable(family: Family, sm: str, cells: Sequence[Cell], suites_run: set[str]) -> str:
    """Why `family`'s candidates did not run in its suite, or "" when they did."""
    ran = [c for c in cells if c.suite == family.suite and c.candidate_backend in family.backends]
    if sm == "cpu":
        if family.name == "fa2":
            return "these results come from a CPU machine (sm = cpu) and FA-2 needs a CUDA GPU"
        return (f"these results come from a CPU machine (sm = cpu) and {family.label} thresholds need "
                "timings on a CUDA GPU")
    if family.suite not in suites_run:
        return (f"suite {family.suite} did not run in these results, so {family.label} was not measured (run "
                f"`python -m bench run --suites {family.suite}`)")
    if any(c.verdict != "skipped" for c in ran):
        return ""
    if ran:
        reasons = sorted({c.reason for c in ran})
        return f"every {family.label} case was skipped (" + "; ".join(reasons[:3]) + ")"
    if family.name == "fa2":
        return (f"the results hold no {' or '.join(family.backends)} case in suite {family.suite} "
                "with an sdpa baseline, so FA-2 was unavailable")
    return (f"the results hold no {' or '.join(family.backends)} case in suite {family.suite} with an sdpa "
            f"baseline, so the {family.label} kernels were not measured (run `python -m bench run --suites "
            f"{family.suite}`)")


def _sources(sources: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[str, list[Mapping[str, Any]]]:
    if not sources:
        raise DecideError("results must name at least one file, got none; pass --results out/results.json")
    sms = {name: doc["machine"]["sm"] for name, doc in sources}
    if len(set(sms.values())) > 1:
        raise DecideError(f"results files must all come from one GPU architecture, got {sms}; "
                          "decide each architecture's files in a separate run")
    return next(iter(sms.values())), results.unique_cases(sources, DecideError)


def decide(sources: Sequence[tuple[str, Mapping[str, Any]]], cfg: DecideConfig) -> dict[str, Any]:
    """The decision document for validated results documents `(name, doc)` of one architecture."""
    profile, cases = _sources(sources)
    # Calibration cases are A/A replicas (the noise floor), not SDPA-vs-candidate comparisons.
    # The auto suite times plans of one call against each other (ci.autobest), not against SDPA.
    pairs, unpaired = pair_cases(c for c in cases if c["suite"] not in (CALIBRATION_SUITE, autobest.SUITE))
    cells = [judge(b, c, cfg.margin, cfg.confidence) for b, c in pairs]
    for cell in cells:
        _mark_use(cell, cfg)
        _mark_auto(cell, cfg, profile)
    cells.sort(key=lambda c: (c.suite, c.op, c.candidate_backend, c.cls or "", json.dumps(c.params, sort_keys=True)))
    suites_run = {c["suite"] for c in cases}
    unavailable = {f.name: _unavailable(f, profile, cells, suites_run) for f in FAMILIES}
    failures = [{"id": c["id"], "suite": c["suite"], "op": c["op"], "backend": c["backend"],
                 "status": c["status"], "reason": problem[1], "parity_failed": parity_failed(c)}
                for c in cases if (problem := case_problem(c)) and problem[0] == "failed"]
    machine = sources[0][1]["machine"]
    return {
        "schema": SCHEMA,
        "profile": profile,
        "gpu_name": " + ".join(sorted({d["machine"]["gpu_name"] for _, d in sources})),
        "margin": cfg.margin,
        "confidence": cfg.confidence,
        "bootstrap": {"resamples": stats.RESAMPLES, "seed": stats.SEED, "min_samples": stats.MIN_SAMPLES},
        "grid": dict(cfg.grid),
        "keys": keys.describe(),
        "classes": list(keys.CLASSES),
        "time_floor_ms": cfg.time_floor_ms,
        "results_files": [name for name, _ in sources],
        "machine": dict(machine),
        "runs": [{"file": name, **d["run"]} for name, d in sources],
        **{f.name: {"ran": not unavailable[f.name], "reason": unavailable[f.name]} for f in FAMILIES},
        "branches": (branches := {b.name: decide_branch(b, cells, cfg, profile, unavailable[b.family.name])
                                  for b in BRANCHES}),
        "decisions": [e for b in branches.values() for e in b["classes"].values()],
        "cells": [c.to_dict() for c in cells],
        "failures": failures,
        "skips": [{"id": c["id"], "reason": c["reason"]} for c in cases if c["status"] == "skipped"],
        "unpaired": [c["id"] for c in unpaired],
        "parity": [{"id": c["id"], **c["parity"]} for c in cases if c.get("parity")],
        "noise_floor": noise_floor(cases, cfg.confidence),
        "auto_vs_best": autobest.auto_vs_best(cases, cfg.confidence),
        "cases": [{"id": c["id"], "suite": c["suite"], "op": c["op"], "backend": c["backend"],
                   "status": c["status"], "median_ms": (c.get("timing") or {}).get("median_ms"),
                   "p20_ms": (c.get("timing") or {}).get("p20_ms")} for c in cases],
        "exit_code": exits.FAILED_CASES if any(f["parity_failed"] for f in failures) else exits.OK,
    }


def decide_files(results_paths: Sequence[str | os.PathLike[str]], config_path: str | os.PathLike[str],
                 margin: float | None = None) -> dict[str, Any]:
    """Read results files and the config, then `decide`. Raises ResultsError or DecideError."""
    cfg = load_config(config_path, margin)
    return decide([(str(p), results.load(p)) for p in results_paths], cfg)


def write_decision(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Validate (nsa_contract.decision), then write atomically: a failed write leaves the previous file."""
    return Decision.from_dict(doc, "the decision of `ci decide`").write(path)


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """One line per threshold key, for the terminal and the Actions log."""
    lines = []
    for name, b in doc["branches"].items():
        current, proposed = values.text(b["current"]), values.text(b["proposed"])
        change = f"{current} -> {proposed}" if b["changed"] else f"{current} (unchanged)"
        lines.append(f"{name} {doc['profile']}.{b['key']}: {change}: {b['reason']}")
    avb = doc.get("auto_vs_best") or {}
    if avb.get("rows"):
        lines.append(f"auto vs best: {len(avb['slow'])} of {len(avb['rows'])} calls more than "
                     f"{(avb['limit'] - 1) * 100:.0f}% slower than the best plan")
    return lines
