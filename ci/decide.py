"""`ci decide`: turn results files into one threshold decision per threshold key (a JSON file).

The rule is `shared/spec/pipeline.md` ("Decision"), applied to every threshold key alike: a
candidate backend against masked SDPA, the same statistics, margin and threshold rule.

    branch      key                  suite   op          candidate backends
    win         fa2_min_len_win      fa2     sliding     flash_attn, torch_fa2 (FA-2)
    cmp         fa2_min_len_cmp      fa2     compressed  flash_attn, torch_fa2 (FA-2)
    triton_sel  triton_min_len_sel   triton  selected    triton (own Triton kernels)
    triton_cmp  triton_min_len_cmp   triton  compressed  triton (own Triton kernels)

Only cells of the key's suite and candidates at the model's configured window, compression and
selection parameters decide; every other pair (other suites, windows, blocks, backends such as
`flex`) is reported only. When both FA-2 backends ran, a length needs both to win: the
dispatcher may pick either.

Everything here is pure except `load_config`, `decide_files` and `write_decision`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import results
from ci import stats
from ci.cells import (
    FA2_BACKENDS,
    TRITON_BACKENDS,
    Cell,
    case_problem,
    judge,
    length_verdict,
    pair_cases,
    parity_failed,
)
from ci.noise import CALIBRATION_SUITE, noise_floor

SCHEMA = "nsa-decision/1"
DECISION_SUITE = "fa2"  # the FA-2 keys' suite (kept for callers that predate the triton keys)
EXIT_OK, EXIT_BAD_INPUT, EXIT_PARITY = 0, 2, 3


class DecideError(ValueError):
    """Input that cannot be decided on: inconsistent results files or a broken config."""


@dataclass(frozen=True)
class Family:
    """A family of threshold keys: one kind of candidate backend, timed in one suite."""

    name: str  # "fa2" or "triton", the prefix of its keys and its field in the decision file
    label: str  # how reasons and the report name it
    suite: str  # the bench suite whose cells decide its keys
    backends: tuple[str, ...]  # candidate backends as results files record them


FA2 = Family("fa2", "FA-2", "fa2", FA2_BACKENDS)
TRITON = Family("triton", "Triton", "triton", TRITON_BACKENDS)
FAMILIES = (FA2, TRITON)


@dataclass(frozen=True)
class Branch:
    name: str  # "win", "cmp", "triton_sel", "triton_cmp": the key in the decision's `branches`
    op: str  # the results op that times this branch
    key: str  # the threshold key under runtime / profiles.<sm>
    family: Family = FA2


BRANCHES = (Branch("win", "sliding", "fa2_min_len_win"), Branch("cmp", "compressed", "fa2_min_len_cmp"),
            Branch("triton_sel", "selected", "triton_min_len_sel", TRITON),
            Branch("triton_cmp", "compressed", "triton_min_len_cmp", TRITON))
DECISION_SUITES = tuple(f.suite for f in FAMILIES)


@dataclass(frozen=True)
class DecideConfig:
    """What `ci decide` needs from configs/base.yaml (margin possibly overridden)."""

    margin: float
    confidence: float
    window: int
    cmp_block: int
    cmp_stride: int
    runtime: Mapping[str, Any]
    profiles: Mapping[str, Any]
    sel_block: int | None = None
    sel_count: int | None = None

    @classmethod
    def from_mapping(cls, cfg: Any, margin: float | None = None, source: str = "config") -> DecideConfig:
        def get(section: str, key: str) -> Any:
            value = (cfg.get(section) or {}).get(key) if isinstance(cfg, Mapping) else None
            if value is None:
                raise DecideError(f"{source}: {section}.{key} must be set, got nothing; "
                                  "compare with configs/base.yaml in the repository")
            return value

        chosen = get("decide", "margin") if margin is None else margin
        if isinstance(chosen, bool) or not isinstance(chosen, (int, float)) or chosen <= 0:
            raise DecideError(f"margin must be a positive number, got {chosen!r}; "
                              "pass e.g. --margin 1.2 or fix decide.margin")
        confidence = get("decide", "confidence")
        if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise DecideError(f"{source}: decide.confidence must be strictly between 0 and 1, "
                              f"got {confidence!r}; use e.g. 0.95")
        # The FA-2 keys predate the triton ones: a config without triton keys still decides (-1).
        for b in BRANCHES:
            if b.family is FA2:
                get("runtime", b.key)
        profiles = cfg.get("profiles") or {}
        return cls(float(chosen), float(confidence), get("nsa", "window"), get("nsa", "cmp_block"),
                   get("nsa", "cmp_stride"), cfg["runtime"], profiles, get("nsa", "sel_block"),
                   get("nsa", "sel_count"))

    def current(self, profile: str, key: str) -> tuple[int, str]:
        """The threshold in force for `profile` and where it comes from (-1 when no section sets it,
        as in nsa.dispatch)."""
        prof = self.profiles.get(profile)
        if isinstance(prof, Mapping) and prof.get(key) is not None:
            return int(prof[key]), f"profiles.{profile}.{key}"
        if self.runtime.get(key) is None:
            return -1, f"default (-1, {key} absent)"
        return int(self.runtime[key]), f"runtime.{key}"

    def off_grid(self, op: str, params: Mapping[str, Any]) -> str:
        """Why a branch cell's grid point is not the model's, or "" when it is."""
        if op == "sliding" and params.get("window") != self.window:
            return f"window {params.get('window')} is not nsa.window {self.window}"
        if op in ("compressed", "selected") and \
                (params.get("block"), params.get("stride")) != (self.cmp_block, self.cmp_stride):
            return (f"l={params.get('block')}, d={params.get('stride')} is not nsa.cmp_block/cmp_stride "
                    f"{self.cmp_block}/{self.cmp_stride}")
        if op == "selected" and (params.get("sel_block"), params.get("sel_count")) != (self.sel_block, self.sel_count):
            return (f"l'={params.get('sel_block')}, n={params.get('sel_count')} is not nsa.sel_block/sel_count "
                    f"{self.sel_block}/{self.sel_count}")
        return ""


def parse_margin(text: str) -> float | None:
    """A `--margin` value: a number, or empty for the config's decide.margin.

    Empty is what an unset workflow input expands to (a scheduled run has no inputs), so the
    workflow can always pass `--margin "$MARGIN"`.
    """
    if not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--margin must be a number such as 1.2, or empty for the config's decide.margin; got {text!r}"
        ) from None


def load_config(path: str | os.PathLike[str], margin: float | None = None) -> DecideConfig:
    p = Path(path)
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DecideError(f"cannot read config {p}: {exc.strerror}; pass --config configs/base.yaml") from None
    except yaml.YAMLError as exc:
        raise DecideError(f"config {p} must be valid YAML, got an error: {exc}") from None
    return DecideConfig.from_mapping(cfg, margin, str(p))


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
    """Set branch, used_for_decision and note (why a cell is reported only)."""
    branch = branch_of(cell.op, cell.suite, cell.candidate_backend)
    cell.branch = branch.name if branch else None
    if branch is None:
        cell.note = f"op {cell.op} has no threshold key"
    elif cell.suite != branch.family.suite:
        cell.note = f"suite {cell.suite} is reported only; suite {branch.family.suite} decides"
    elif cell.candidate_backend not in branch.family.backends:
        cell.note = f"{cell.candidate_backend} is not {branch.family.label}; reported only"
    elif off := cfg.off_grid(cell.op, cell.params):
        cell.note = off
    elif cell.verdict == "skipped":
        cell.note = "skipped cells decide nothing"
    else:
        if not isinstance(cell.T, int):
            raise DecideError(f"case {cell.id}: params.T must be an integer sequence length, got "
                              f"{cell.T!r}; the bench must record T for every {cell.op} case")
        cell.used_for_decision = True


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


def decide_branch(branch: Branch, cells: Sequence[Cell], cfg: DecideConfig, profile: str,
                  unavailable: str) -> dict[str, Any]:
    """One branch's entry: lengths, measured threshold and the proposal against the current value."""
    current, source = cfg.current(profile, branch.key)
    used = [c for c in cells if c.branch == branch.name and c.used_for_decision]
    by_t: dict[int, list[Cell]] = {}
    for c in used:
        by_t.setdefault(c.T, []).append(c)
    lengths = [{"T": t, "verdict": length_verdict(c.verdict for c in by_t[t]), "cells": [c.id for c in by_t[t]]}
               for t in sorted(by_t)]
    if unavailable or not used:
        why = unavailable or (f"no {branch.family.label} cell of op {branch.op} at the configured grid point "
                              f"ran in suite {branch.family.suite}")
        measured, reason = None, f"keeping {current}: {why}; no threshold can be proposed"
    else:
        measured, why = measured_threshold([(x["T"], x["verdict"]) for x in lengths], cfg.margin,
                                           branch.family.label)
        if measured is None:
            reason = f"keeping {current}: {why}"
        elif measured == current:
            reason = f"{why}; the measured threshold {measured} is already in force ({source})"
        else:
            reason = f"{why}; proposing {measured} instead of {current} ({source})"
    proposed = current if measured is None else measured
    return {"key": branch.key, "op": branch.op, "family": branch.family.name, "candidate": branch.family.label,
            "suite": branch.family.suite, "current": current, "current_source": source,
            "measured": measured, "proposed": proposed, "changed": proposed != current,
            "reason": reason, "lengths": lengths}


def _unavailable(family: Family, sm: str, cells: Sequence[Cell]) -> str:
    """Why `family`'s candidates did not run in its suite, or "" when they did."""
    ran = [c for c in cells if c.suite == family.suite and c.candidate_backend in family.backends]
    if sm == "cpu":
        if family is FA2:
            return "these results come from a CPU machine (sm = cpu) and FA-2 needs a CUDA GPU"
        return (f"these results come from a CPU machine (sm = cpu) and {family.label} thresholds need "
                "timings on a CUDA GPU")
    if any(c.verdict != "skipped" for c in ran):
        return ""
    if ran:
        reasons = sorted({c.reason for c in ran})
        return f"every {family.label} case was skipped (" + "; ".join(reasons[:3]) + ")"
    if family is FA2:
        return (f"the results hold no {' or '.join(FA2_BACKENDS)} case in suite {DECISION_SUITE} "
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
    cases: list[Mapping[str, Any]] = []
    origin: dict[str, str] = {}
    for name, doc in sources:
        for case in doc["cases"]:
            if case["id"] in origin:
                raise DecideError(f"case ids must be unique across results files, got {case['id']!r} in "
                                  f"{origin[case['id']]} and {name}; pass one file per shard, not reruns")
            origin[case["id"]] = name
            cases.append(case)
    return next(iter(sms.values())), cases


def decide(sources: Sequence[tuple[str, Mapping[str, Any]]], cfg: DecideConfig) -> dict[str, Any]:
    """The decision document for validated results documents `(name, doc)` of one architecture."""
    profile, cases = _sources(sources)
    # Calibration cases are A/A replicas (the noise floor), not SDPA-vs-candidate comparisons.
    pairs, unpaired = pair_cases(c for c in cases if c["suite"] != CALIBRATION_SUITE)
    cells = [judge(b, c, cfg.margin, cfg.confidence) for b, c in pairs]
    for cell in cells:
        _mark_use(cell, cfg)
    cells.sort(key=lambda c: (c.suite, c.op, c.candidate_backend, json.dumps(c.params, sort_keys=True)))
    unavailable = {f.name: _unavailable(f, profile, cells) for f in FAMILIES}
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
        "grid": {"window": cfg.window, "cmp_block": cfg.cmp_block, "cmp_stride": cfg.cmp_stride,
                 "sel_block": cfg.sel_block, "sel_count": cfg.sel_count},
        "results_files": [name for name, _ in sources],
        "machine": dict(machine),
        "runs": [{"file": name, **d["run"]} for name, d in sources],
        **{f.name: {"ran": not unavailable[f.name], "reason": unavailable[f.name]} for f in FAMILIES},
        "branches": {b.name: decide_branch(b, cells, cfg, profile, unavailable[b.family.name]) for b in BRANCHES},
        "cells": [c.to_dict() for c in cells],
        "failures": failures,
        "skips": [{"id": c["id"], "reason": c["reason"]} for c in cases if c["status"] == "skipped"],
        "unpaired": [c["id"] for c in unpaired],
        "parity": [{"id": c["id"], **c["parity"]} for c in cases if c.get("parity")],
        "noise_floor": noise_floor(cases, cfg.confidence),
        "cases": [{"id": c["id"], "suite": c["suite"], "op": c["op"], "backend": c["backend"],
                   "status": c["status"], "median_ms": (c.get("timing") or {}).get("median_ms"),
                   "p20_ms": (c.get("timing") or {}).get("p20_ms")} for c in cases],
        "exit_code": EXIT_PARITY if any(f["parity_failed"] for f in failures) else EXIT_OK,
    }


def decide_files(results_paths: Sequence[str | os.PathLike[str]], config_path: str | os.PathLike[str],
                 margin: float | None = None) -> dict[str, Any]:
    """Read results files and the config, then `decide`. Raises ResultsError or DecideError."""
    cfg = load_config(config_path, margin)
    return decide([(str(p), results.load(p)) for p in results_paths], cfg)


def write_decision(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return p


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """One line per threshold key, for the terminal and the Actions log."""
    lines = []
    for name, b in doc["branches"].items():
        change = f"{b['current']} -> {b['proposed']}" if b["changed"] else f"{b['current']} (unchanged)"
        lines.append(f"{name} {doc['profile']}.{b['key']}: {change}: {b['reason']}")
    return lines
