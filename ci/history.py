"""History of nightly runs per GPU model: the record of one run, and which runs to keep. Pure functions.

The decide job keeps each run's evidence where a later decide job can read it without a GPU and
after the artifacts expire: one JSON file per run at ``history/<gpu-model-slug>/<run-id>.json`` on
the data branch ``nsa-history`` (``ci.history_store`` writes it, or a local folder offline). A file
holds the schema tag ``nsa-history/1``, the run's metadata (``run``: id, created_at, git_sha,
command; ``machine``: the schema's machine fields only, not the NVML snapshots), ``gpu`` (the slug),
``profile`` (the sm), one entry per ok case (id, suite, op, backend, params, median_ms, p20_ms,
p80_ms, n = the number of samples measured, samples_ms, and host_ms = the median host enqueue time
of one call, left out where the results file has none, as in records written before it), ``dense``
(case id -> the id of the dense case of the same run and shape, the denominator that cancels
machine drift in ``ci.regress``) and ``decisions`` (the run's own decision entries, one per (key,
shape class), for ``ci.lasting``) and ``regressions`` (the case ids ``ci.regress`` flagged in this
run, kept out of later baselines).
Timings are rounded to 4 significant digits: run-to-run noise is 1% or more, so a fifth digit
carries nothing. Failed and skipped cases are not kept: they carry no timing, and the report of
their own run already says why.

Growth, measured on the committed results (``tests/ci/test_history.py`` pins these numbers):
``results/h100/triton-nightly.json`` (84 cases, 626 KB raw) gives a 58 KB record (13 KB zlib) and
``results/h200/nightly-fa2.json`` (130 cases, 1.39 MB raw) a 93 KB record (21 KB zlib): about
0.7 KB per case (``host_ms``, which these older files lack, adds ~20 bytes), so a nightly of
both suites on one model adds ~150 KB per run (~35 KB as git stores it). At the default of 30 runs
kept per model, a model's folder holds at most ~4.5 MB; each run beyond that deletes the oldest in
the same commit, so the branch's tree stays bounded, and git history grows by ~35 KB per run
(squash the branch yearly if that ever matters).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.results import MACHINE_FIELDS, RUN_FIELDS

SCHEMA = "nsa-history/1"
BRANCH = "nsa-history"
ROOT = "history"
DEFAULT_KEEP = 30
MAX_SAMPLES = 64
SIG_DIGITS = 4
# Keys that name what ran rather than the problem's shape: a dense case matches an NSA case of the
# same run when every other param agrees (the dense baseline has no `branches`, `win`, `nsa_backend`).
NON_SHAPE_PARAMS = frozenset({"branches", "win", "nsa_backend", "replica"})
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class HistoryError(ValueError):
    """A history record or store is unusable: wrong schema, bad run id, a file that does not parse."""


@dataclass(frozen=True)
class HistoryCase:
    """One ok case of a run: its summary and up to MAX_SAMPLES samples (milliseconds)."""

    id: str
    suite: str
    op: str
    backend: str
    params: dict[str, Any]
    median_ms: float
    p20_ms: float
    p80_ms: float
    n: int  # samples measured; len(samples_ms) is at most MAX_SAMPLES
    samples_ms: list[float]
    host_ms: float | None = None  # median host enqueue time of one call; None in records before it


@dataclass(frozen=True)
class HistoryRun:
    """One run's record: what ran where, its cases, dense baselines and its own decision entries."""

    run: dict[str, Any]
    machine: dict[str, Any]
    gpu: str
    profile: str
    cases: list[HistoryCase]
    dense: dict[str, str] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)  # case ids ci.regress flagged in this run

    @property
    def id(self) -> str:
        return str(self.run["id"])

    @property
    def created_at(self) -> str:
        return str(self.run["created_at"])

    def case(self, case_id: str) -> HistoryCase | None:
        return next((c for c in self.cases if c.id == case_id), None)


def gpu_slug(gpu_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: the model's folder name."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")
    if not slug:
        raise HistoryError(f"machine.gpu_name must name a GPU model, got {gpu_name!r}; "
                           "record runs from a GPU machine only")
    return slug


def round_sig(value: float, digits: int = SIG_DIGITS) -> float:
    return float(f"{value:.{digits}g}")


def thin(samples_ms: Sequence[float], limit: int = MAX_SAMPLES) -> list[float]:
    """All samples when there are at most ``limit``, else ``limit`` evenly spaced order statistics.

    Why sorted and evenly spaced: the statistics that read history (bootstrap of medians, p20/p80)
    depend only on the empirical distribution, which evenly spaced order statistics keep (min, max
    and every quantile within 1/limit), whereas a random subsample would add noise and a time-order
    subsample would keep warm-up drift. 64 samples bound a record at ~0.7 KB per case, against
    ~5 KB for the up to 1000 samples a short kernel gets.
    """
    if limit < 2:
        raise HistoryError(f"limit must be at least 2, got {limit}; keep at least the min and max")
    ordered = sorted(float(s) for s in samples_ms)
    if len(ordered) <= limit:
        return ordered
    last = len(ordered) - 1
    return [ordered[round(i * last / (limit - 1))] for i in range(limit)]


def _shape(params: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in params.items() if k not in NON_SHAPE_PARAMS}, sort_keys=True)


def dense_baselines(cases: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """``{case id: dense case id}`` for non-dense cases with a dense case of the same suite and shape.

    Where several dense backends ran (``sdpa_flash``, ``sdpa_cudnn``), the one the bench marks
    ``role: baseline`` wins, then the first by backend name, so every run picks the same one.
    """
    ok = [c for c in cases if c.get("status", "ok") == "ok"]
    dense: dict[tuple[str, str], Mapping[str, Any]] = {}
    for c in sorted(ok, key=lambda c: (c.get("role") != "baseline", c["backend"])):
        if c["op"] == "dense":
            dense.setdefault((c["suite"], _shape(c["params"])), c)
    out = {}
    for c in ok:
        match = dense.get((c["suite"], _shape(c["params"])))
        if c["op"] != "dense" and match is not None:
            out[c["id"]] = str(match["id"])
    return out


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _SAFE.fullmatch(run_id) or ".." in run_id:
        raise HistoryError(f"run.id must be a file-name-safe string (letters, digits, . _ -), got {run_id!r}; "
                           "let `python -m bench` set the run id")
    return run_id


def record_path(slug: str, run_id: str) -> str:
    """Where a run's record lives, relative to the store's root (the same on the branch and on disk)."""
    return f"{ROOT}/{slug}/{check_run_id(run_id)}.json"


def build_record(results: Mapping[str, Any], decisions: Iterable[Mapping[str, Any]] = ()) -> HistoryRun:
    """The history record of a validated results document and the run's own decision entries."""
    machine = results["machine"]
    run = {k: results["run"][k] for k in RUN_FIELDS}
    check_run_id(run["id"])
    cases = []
    for c in results["cases"]:
        if c["status"] != "ok":
            continue
        t = c["timing"]
        cases.append(HistoryCase(
            id=c["id"], suite=c["suite"], op=c["op"], backend=c["backend"], params=dict(c["params"]),
            median_ms=round_sig(t["median_ms"]), p20_ms=round_sig(t["p20_ms"]), p80_ms=round_sig(t["p80_ms"]),
            n=len(t["samples_ms"]), samples_ms=[round_sig(s) for s in thin(t["samples_ms"])],
            host_ms=None if t.get("host_ms") is None else round_sig(t["host_ms"])))
    return HistoryRun(run=run, machine={k: machine.get(k) for k in MACHINE_FIELDS},
                      gpu=gpu_slug(machine["gpu_name"]), profile=str(machine["sm"]), cases=cases,
                      dense=dense_baselines(results["cases"]), decisions=[dict(d) for d in decisions])


def dumps(record: HistoryRun) -> str:
    """The record as JSON text: compact, one case per line (readable, and diffs by case on the branch)."""
    head = {"schema": SCHEMA, "run": record.run, "machine": record.machine, "gpu": record.gpu,
            "profile": record.profile}

    def one(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)

    lines = ["{" + one(head)[1:-1] + ',"cases":[']
    cases = [{k: v for k, v in asdict(c).items() if not (k == "host_ms" and v is None)} for c in record.cases]
    lines += [one(c) + ("," if i < len(cases) - 1 else "") for i, c in enumerate(cases)]
    lines.append('],"dense":' + one(record.dense) + ',"decisions":[')
    lines += [one(d) + ("," if i < len(record.decisions) - 1 else "") for i, d in enumerate(record.decisions)]
    lines.append('],"regressions":' + one(record.regressions) + "}")
    return "\n".join(lines) + "\n"


def loads(text: str, source: str = "history record") -> HistoryRun:
    """Parse and check one record; raises HistoryError naming ``source`` and the fix."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HistoryError(f"{source} must be JSON, got a parse error ({exc}); delete the file and rerun "
                           "the decide job of that run, or let pruning drop it") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise HistoryError(f"{source} must have schema {SCHEMA!r}, got {got!r}; it was written by another "
                           "version of ci.history: convert or delete it")
    missing = [k for k in ("run", "machine", "gpu", "profile", "cases") if k not in doc]
    missing += [f"run.{k}" for k in RUN_FIELDS if k not in (doc.get("run") or {})]
    if missing:
        raise HistoryError(f"{source} must have {', '.join(missing)}, got a record without them; delete it")
    try:
        cases = [HistoryCase(**c) for c in doc["cases"]]
    except TypeError as exc:
        raise HistoryError(f"{source} must hold cases with the {SCHEMA} fields, got {exc}; delete it") from None
    return HistoryRun(run=doc["run"], machine=doc["machine"], gpu=doc["gpu"], profile=doc["profile"],
                      cases=cases, dense=doc.get("dense") or {}, decisions=doc.get("decisions") or [],
                      regressions=doc.get("regressions") or [])


def chronological(runs: Iterable[HistoryRun]) -> list[HistoryRun]:
    """Oldest first, by created_at then id (ISO-8601 UTC strings sort as times)."""
    return sorted(runs, key=lambda r: (r.created_at, r.id))


def latest(runs: Iterable[HistoryRun], k: int, *, exclude: str | None = None) -> list[HistoryRun]:
    """The ``k`` most recent runs, oldest first, leaving out run id ``exclude`` (this run on a rerun)."""
    if k < 1:
        raise HistoryError(f"k must be at least 1, got {k}; set history.k in configs/base.yaml")
    kept = [r for r in chronological(runs) if r.id != exclude]
    return kept[-k:]


@dataclass(frozen=True)
class SavePlan:
    """What saving one record changes in one model's folder."""

    outcome: str  # added | replaced | unchanged | too-old
    path: str
    text: str
    delete: list[str]  # paths of runs that fall out of the last `keep`


def plan_save(existing: Mapping[str, HistoryRun], texts: Mapping[str, str], record: HistoryRun,
              keep: int = DEFAULT_KEEP) -> SavePlan:
    """Plan writing ``record`` into a model folder holding ``existing`` (path -> record, texts alike).

    The run's file is keyed by run id, so a rerun replaces it (or leaves it, when identical) and never
    adds a second one; then the newest ``keep`` runs stay and older ones are deleted in the same commit.
    """
    if keep < 1:
        raise HistoryError(f"keep must be at least 1, got {keep}; pass --history-keep 30 or more")
    path = record_path(record.gpu, record.id)
    text = dumps(record)
    runs = {p: r for p, r in existing.items() if p != path} | {path: record}
    order = sorted(runs, key=lambda p: (runs[p].created_at, runs[p].id))
    delete = [p for p in order[:-keep] if p != path and p in existing]
    if path in order[:-keep]:
        return SavePlan("too-old", path, text, [])
    if path not in existing:
        outcome = "added"
    else:
        outcome = "unchanged" if texts.get(path) == text else "replaced"
    return SavePlan(outcome, path, text, delete)
