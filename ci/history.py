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
shape class), for ``ci.lasting``), ``regressions`` (the case ids ``ci.regress`` flagged in this
run, kept out of later baselines) and ``results_sha`` (the sha-256 of the results the record was
built from; absent in records written before it).
Timings are rounded to 4 significant digits: run-to-run noise is 1% or more, so a fifth digit
carries nothing. Failed and skipped cases are not kept: they carry no timing, and the report of
their own run already says why.

Growth, measured on the committed results (``tests/ci/test_history.py`` pins these numbers):
``tests/data/h100/triton-nightly.json.xz`` (84 cases, 626 KB raw) gives a 58 KB record (13 KB zlib) and
``tests/data/h200/nightly-fa2.json.xz`` (130 cases, 1.39 MB raw) a 93 KB record (21 KB zlib): about
0.7 KB per case (``host_ms``, which these older files lack, adds ~20 bytes). A whole nightly of
~470 cases makes a ~320 KB record (~65 KB as git stores it; the four committed H100 records,
docs/pipeline.md "History"). At the default of 30 runs kept per model, a model's folder holds at
most ~10 MB; each run beyond that deletes the oldest in the same commit, so the branch's tree
stays bounded, and git history grows by ~65 KB per run (squash the branch yearly if that ever
matters).

A store reads each model's folder through ``sort_out``: every file is checked on its own (``loads``:
types, finite timings >= 0, at most MAX_SAMPLES samples, a UTC ``created_at`` no later than the
reader's clock plus CLOCK_SKEW), and must hold a run of that folder's model under its own run id. A
run is identified by its content: its run id (the file name) and ``results_sha``, the sha-256 of the
results it was built from, so a renamed copy, or a copy given a new run id, is one run, not two. A
file that fails is skipped with a one-line warning, never blocks a run, and is moved to
``quarantine/<slug>/`` in the commit of that model's next saved run (out of the readers' way, kept
for a person to look at). Dates are checked against the clock, not the run's commit time: neither
the results nor the record carry a commit time, and the GitHub store would need one API call per
record to learn it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta, timezone
from typing import Any

from nsa_contract.results import MACHINE_FIELDS, RUN_FIELDS, SM

SCHEMA = "nsa-history/1"
BRANCH = "nsa-history"
ROOT = "history"
QUARANTINE = "quarantine"  # bad records of history/<slug>/ move to quarantine/<slug>/
DEFAULT_KEEP = 30
MAX_SAMPLES = 64
CLOCK_SKEW = timedelta(hours=1)  # a record dated later than the reader's clock plus this is refused
_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|\+00:00)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
    results_sha: str | None = None  # sha-256 of the results it was built from; None in records before it

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


def check_created_at(value: Any, source: str, *, now: datetime | None = None) -> str:
    """``value`` when it is a UTC ISO-8601 time no later than ``now`` (the clock) plus CLOCK_SKEW.

    A run cannot be measured in the future: a later date would stay the newest run for good and make
    pruning drop real runs. Raises HistoryError naming ``source``; the caller adds the fix.
    """
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00")) if _UTC.fullmatch(value) else None
    except (TypeError, ValueError):
        when = None
    if when is None:
        raise HistoryError(f"{source} run.created_at must be a UTC ISO-8601 time such as 2026-01-31T03:00:00Z, "
                           f"got {_short(value)}")
    now = now or datetime.now(timezone.utc)
    if when > now + CLOCK_SKEW:
        raise HistoryError(f"{source} run.created_at must not be in the future, got {value} (the clock says "
                           f"{now:%Y-%m-%dT%H:%M:%SZ}, {CLOCK_SKEW.seconds // 3600} h of clock skew allowed)")
    return value


def results_sha(results: Mapping[str, Any]) -> str:
    """The sha-256 of a results document (canonical JSON): with the run id, what identifies a run."""
    text = json.dumps(results, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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
                      dense=dense_baselines(results["cases"]), decisions=[dict(d) for d in decisions],
                      results_sha=results_sha(results))


def dumps(record: HistoryRun) -> str:
    """The record as JSON text: compact, one case per line (readable, and diffs by case on the branch)."""
    head = {"schema": SCHEMA, "run": record.run, "machine": record.machine, "gpu": record.gpu,
            "profile": record.profile}
    if record.results_sha is not None:
        head["results_sha"] = record.results_sha

    def one(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)

    lines = ["{" + one(head)[1:-1] + ',"cases":[']
    cases = [{k: v for k, v in asdict(c).items() if not (k == "host_ms" and v is None)} for c in record.cases]
    lines += [one(c) + ("," if i < len(cases) - 1 else "") for i, c in enumerate(cases)]
    lines.append('],"dense":' + one(record.dense) + ',"decisions":[')
    lines += [one(d) + ("," if i < len(record.decisions) - 1 else "") for i, d in enumerate(record.decisions)]
    lines.append('],"regressions":' + one(record.regressions) + "}")
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_constant(name: str) -> float:
    raise HistoryError(f"numbers must be finite, got {name}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


CASE_FIELDS = tuple(f.name for f in fields(HistoryCase))


def _case_problem(c: Any) -> str:
    """What is wrong with one stored case ("" when nothing): what ci.regress, ci.stats and ci.trends read."""
    if not isinstance(c, dict):
        return f"cases must hold objects, got {_short(c)}"
    missing = [f for f in CASE_FIELDS if f not in c and f != "host_ms"]
    extra = [f for f in c if f not in CASE_FIELDS]
    if missing or extra:
        return f"case {_short(c.get('id'))} must have the {SCHEMA} case fields, got {missing} missing and {extra} unknown"
    where = f"case {_short(c['id'])}"
    if not all(isinstance(c[f], str) for f in ("id", "suite", "op", "backend")) or not isinstance(c["params"], dict):
        return f"{where} must have string id, suite, op, backend and an object params"
    for f in ("median_ms", "p20_ms", "p80_ms"):
        if not _finite(c[f]):
            return f"{where} {f} must be a finite time >= 0 (ms), got {_short(c[f])}"
    samples = c["samples_ms"]
    if not isinstance(samples, list) or not 0 < len(samples) <= MAX_SAMPLES or not all(map(_finite, samples)):
        return (f"{where} samples_ms must be a list of 1 to {MAX_SAMPLES} finite times >= 0 (ms), got "
                f"{_short(samples) if not isinstance(samples, list) else f'{len(samples)} values'}")
    if not (isinstance(c["n"], int) and not isinstance(c["n"], bool) and c["n"] >= len(samples)):
        return f"{where} n must be an int >= the {len(samples)} stored samples, got {_short(c['n'])}"
    if c.get("host_ms") is not None and not _finite(c["host_ms"]):
        return f"{where} host_ms must be a finite time >= 0 (ms) or absent, got {_short(c['host_ms'])}"
    return ""


def _problem(doc: dict[str, Any], now: datetime | None) -> str:
    """What is wrong with a record of the right schema ("" when nothing). Every field a reader uses is
    checked here, so a bad record stops at the load, never as a traceback in ci.lasting or ci.regress."""
    missing = [k for k in ("run", "machine", "gpu", "profile", "cases") if k not in doc]
    missing += [f"run.{k}" for k in RUN_FIELDS if isinstance(doc.get("run"), dict) and k not in doc["run"]]
    if missing:
        return f"must have {', '.join(missing)}, got a record without them"
    run = doc["run"]
    if not isinstance(run, dict) or not isinstance(doc["machine"], dict):
        return "must have objects run and machine"
    try:
        check_run_id(run["id"])
        check_created_at(run["created_at"], "", now=now)
    except HistoryError as exc:
        return str(exc).split("; ")[0].lstrip()
    if not isinstance(doc["gpu"], str) or not _SAFE.fullmatch(doc["gpu"]):
        return f"gpu must be a GPU model slug, got {_short(doc['gpu'])}"
    if not isinstance(doc["profile"], str) or not SM.fullmatch(doc["profile"]):
        return f"profile must be an sm such as 'sm90', got {_short(doc['profile'])}"
    if not isinstance(doc["cases"], list):
        return f"cases must be a list, got {type(doc['cases']).__name__}"
    if why := next(filter(None, map(_case_problem, doc["cases"])), ""):
        return why
    dense, decisions, regressions = doc.get("dense") or {}, doc.get("decisions") or [], doc.get("regressions") or []
    if not isinstance(dense, dict) or not all(isinstance(v, str) for v in dense.values()):
        return f"dense must map case ids to dense case ids, got {_short(dense)}"
    if not isinstance(decisions, list) or not all(
            isinstance(d, dict) and isinstance(d.get("key"), str) and isinstance(d.get("class", ""), str)
            and (d.get("measured") is None or (isinstance(d["measured"], int) and not isinstance(d["measured"], bool)))
            for d in decisions):
        return f"decisions must be a list of entries with a string key and class and an int or null measured, " \
               f"got {_short(decisions)}"
    if not isinstance(regressions, list) or not all(isinstance(r, str) for r in regressions):
        return f"regressions must be a list of case ids, got {_short(regressions)}"
    sha = doc.get("results_sha")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        return f"results_sha must be a sha-256 in hex, got {_short(sha)}"
    return ""


def loads(text: str, source: str = "history record", *, now: datetime | None = None) -> HistoryRun:
    """Parse and check one record (``now``: the clock for the future-date check); raises HistoryError
    naming ``source`` and the problem, in one line."""
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise HistoryError(f"{source} must be JSON, got a parse error ({exc or type(exc).__name__})") from None
    except HistoryError as exc:
        raise HistoryError(f"{source} must hold finite numbers, got {str(exc).rsplit(' ', 1)[-1]} (NaN or "
                           "infinity)") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise HistoryError(f"{source} must have schema {SCHEMA!r}, got {_short(got)}: written by another version "
                           "of ci.history, or not a record")
    if why := _problem(doc, now):
        raise HistoryError(f"{source} {why}")
    cases = [HistoryCase(**c) for c in doc["cases"]]
    return HistoryRun(run=doc["run"], machine=doc["machine"], gpu=doc["gpu"], profile=doc["profile"],
                      cases=cases, dense=doc.get("dense") or {}, decisions=doc.get("decisions") or [],
                      regressions=doc.get("regressions") or [], results_sha=doc.get("results_sha"))


def quarantine_path(path: str) -> str:
    """Where a bad record of ``history/<slug>/<name>`` goes: ``quarantine/<slug>/<name>``."""
    return f"{QUARANTINE}/{path.split('/', 1)[1]}"


def sort_out(slug: str, texts: Mapping[str, str], unreadable: Mapping[str, str] | None = None, *,
             now: datetime | None = None) -> tuple[dict[str, HistoryRun], dict[str, str]]:
    """(good runs, {path: why it is bad}) of one model's folder: ``texts`` (path -> text) and the paths
    that could not be read (path -> why). A good record parses (``loads``), is a run of ``slug``, is
    named by its run id, and is the first (by date, then id) with its ``results_sha``."""
    runs: dict[str, HistoryRun] = {}
    bad = dict(unreadable or {})
    for path, text in texts.items():
        try:
            rec = loads(text, path, now=now)
        except HistoryError as exc:
            bad[path] = str(exc)
            continue
        if rec.gpu != slug:
            bad[path] = f"{path} must hold a run of {slug}, got a run of {rec.gpu} (a record put in the wrong folder)"
        elif path.rsplit("/", 1)[-1] != f"{rec.id}.json":
            bad[path] = f"{path} must be named by its run id, got run {rec.id} (a renamed copy of that run)"
        else:
            runs[path] = rec
    first: dict[str, str] = {}
    for path in sorted(runs, key=lambda p: (runs[p].created_at, runs[p].id)):
        sha = runs[path].results_sha
        if sha is not None and sha in first:
            bad[path] = (f"{path} must hold a run of its own, got the results of run {runs[first[sha]].id} "
                         f"(results_sha {sha[:12]}) under another run id (a copy of that run)")
            del runs[path]
        elif sha is not None:
            first[sha] = path
    return runs, {p: " ".join(bad[p].split()) for p in sorted(bad)}


def warning(slug: str, why: str) -> str:
    """The one line a store logs for a bad record ``why`` (from ``sort_out``) of model ``slug``."""
    return (f"warning: {why}; skipped, and moved to {QUARANTINE}/{slug}/ by the next saved run of {slug} "
            "(look at it there, then delete it)")


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
    quarantine: dict[str, str] = field(default_factory=dict)  # bad record path -> its quarantine path


def plan_save(existing: Mapping[str, HistoryRun], texts: Mapping[str, str], record: HistoryRun,
              keep: int = DEFAULT_KEEP, bad: Iterable[str] = ()) -> SavePlan:
    """Plan writing ``record`` into a model folder holding ``existing`` (path -> record, texts alike)
    and the ``bad`` paths ``sort_out`` refused.

    The run's file is keyed by run id, so a rerun replaces it (or leaves it, when identical) and never
    adds a second one; then the newest ``keep`` runs stay and older ones are deleted in the same commit,
    and the bad records move to quarantine (a bad file at this run's own path is overwritten instead).
    """
    if keep < 1:
        raise HistoryError(f"keep must be at least 1, got {keep}; pass --history-keep 30 or more")
    path = record_path(record.gpu, record.id)
    text = dumps(record)
    moves = {p: quarantine_path(p) for p in sorted(bad) if p != path}
    runs = {p: r for p, r in existing.items() if p != path} | {path: record}
    order = sorted(runs, key=lambda p: (runs[p].created_at, runs[p].id))
    delete = [p for p in order[:-keep] if p != path and p in existing]
    if path in order[:-keep]:
        return SavePlan("too-old", path, text, [], moves)
    if path not in existing:
        outcome = "replaced" if path in set(bad) else "added"
    else:
        outcome = "unchanged" if texts.get(path) == text else "replaced"
    return SavePlan(outcome, path, text, delete, moves)
