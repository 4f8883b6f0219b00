"""Results file schema (version 1): build, validate, read, write, merge. Standard library only.

`bench/` writes these files and `ci/` reads them without importing torch. The contract is
`docs/pipeline.md` ("Results file"); `validate` enforces every required field so a file
that would mislead the decision step is rejected when written, not when a PR is already open.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
import os
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from nsa_contract import atomic

SCHEMA_VERSION = 1
OPS = ("sliding", "compressed", "selected", "nsa_prefill", "nsa_decode", "nsa_train", "nsa_serve", "dense")
STATUSES = ("ok", "skipped", "failed")
RUN_FIELDS = ("id", "created_at", "git_sha", "command")
MACHINE_FIELDS = ("gpu_name", "sm", "driver", "cuda", "torch", "triton", "flash_attn", "python")
TIMING_FIELDS = ("samples_ms", "median_ms", "p20_ms", "p80_ms")
# Optional in `timing`: host_ms, the median host enqueue time of one timed call (files before it lack it).
PARITY_FIELDS = ("max_abs_err", "rel_err", "tol", "passed")
SM = re.compile(r"sm[0-9]+[a-z]?|cpu")  # the profile a results file is decided for
UTC_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|\+00:00)")  # run.created_at
# The most timing samples one case may hold. `ci decide` bootstraps every cell with 2000 resamples of
# all its samples (each array 2000 x samples x 8 bytes): 2,000,000 samples asked for 29.8 GiB, 10,000
# stay at 160 MB an array; the bench takes at most 1000 (the shortest kernels).
MAX_SAMPLES_PER_CASE = 10_000

# Order and short names of the params that make up a case id; anything else is appended sorted.
_ID_KEYS = (("B", "B"), ("T", "T"), ("Hq", "Hq"), ("Hkv", "Hkv"), ("Dk", "D"), ("Dv", "Dv"),
            ("window", "w"), ("block", "l"), ("stride", "d"), ("sel_block", "ls"),
            ("sel_count", "n"))


class ResultsError(ValueError):
    """A results file is missing, unreadable or breaks the schema."""


def case_id(suite: str, op: str, backend: str, params: Mapping[str, Any]) -> str:
    """Stable readable id: `suite/op/backend/B1-T8192-Hq8-Hkv2-D64-w512-bf16`.

    `Dv` is shown only where it differs from `Dk`; the dtype is always last.
    """
    parts = []
    used = {"dtype"}
    for key, short in _ID_KEYS:
        if key not in params:
            continue
        used.add(key)
        if key == "Dv" and params.get("Dk") == params["Dv"]:
            continue
        parts.append(f"{short}{params[key]}")
    for key in sorted(k for k in params if k not in used):
        parts.append(f"{key}{params[key]}")
    if "dtype" in params:
        parts.append(str(params["dtype"]))
    return f"{suite}/{op}/{backend}/{'-'.join(parts)}"


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (numpy's default method)."""
    if not sorted_values:
        raise ResultsError("quantile of no samples; a timed case needs at least one sample")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def timing_summary(samples_ms: Iterable[float]) -> dict[str, Any]:
    """The `timing` object of a case: raw samples plus median, p20 and p80 (milliseconds)."""
    samples = [float(s) for s in samples_ms]
    if not samples or any(not math.isfinite(s) or s < 0 for s in samples):
        raise ResultsError(f"samples_ms must be finite, non-negative and non-empty, got {samples[:5]}; "
                           "record a case the timer could not measure as failed")
    ordered = sorted(samples)
    return {
        "samples_ms": samples,
        "median_ms": statistics.median(ordered),
        "p20_ms": quantile(ordered, 0.2),
        "p80_ms": quantile(ordered, 0.8),
    }


def _require(obj: Any, fields: Iterable[str], where: str, errors: list[str]) -> None:
    if not isinstance(obj, Mapping):
        errors.append(f"{where} must be an object, got {type(obj).__name__}")
        return
    for name in fields:
        if name not in obj:
            errors.append(f"{where}.{name} is missing")


def _is_number(value: Any) -> bool:
    """An int or float that is not a bool (JSON true would otherwise count as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_machine(machine: Any, errors: list[str]) -> None:
    if not isinstance(machine, Mapping):
        return
    sm, gpu = machine.get("sm"), machine.get("gpu_name")
    if "sm" in machine and not (isinstance(sm, str) and SM.fullmatch(sm)):
        errors.append(f"machine.sm must be a string such as 'sm90' or 'cpu', got {sm!r}")
    if "gpu_name" in machine and not (isinstance(gpu, str) and gpu.strip()):
        errors.append(f"machine.gpu_name must be a non-empty string, got {gpu!r}")


def _check_created_at(run: Any, errors: list[str]) -> None:
    """`run.created_at` is a UTC ISO-8601 time (`2026-01-31T03:00:00Z`): history orders runs by it."""
    if not isinstance(run, Mapping) or "created_at" not in run:
        return
    value = run["created_at"]
    try:
        ok = isinstance(value, str) and bool(UTC_TIME.fullmatch(value)) and bool(datetime.fromisoformat(
            value.replace("Z", "+00:00")))
    except ValueError:
        ok = False
    if not ok:
        text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        errors.append(f"run.created_at must be a UTC ISO-8601 time such as 2026-01-31T03:00:00Z, got {text}")


def _check_timing(timing: Mapping[str, Any], where: str, errors: list[str]) -> None:
    samples = timing.get("samples_ms")
    if not isinstance(samples, list) or not samples:
        errors.append(f"{where}.timing.samples_ms must be a non-empty list of times in ms, got {samples!r}")
    elif len(samples) > MAX_SAMPLES_PER_CASE:
        errors.append(f"{where}.timing.samples_ms must hold at most {MAX_SAMPLES_PER_CASE} samples, got "
                      f"{len(samples)}: the bootstrap resamples all of them 2000 times; time fewer repeats")
    elif not all(_is_number(x) and math.isfinite(x) and x >= 0 for x in samples):
        # Zero is allowed: a timer's resolution can round a tiny call down to it (ci then judges
        # such a cell failed instead of dividing by it).
        bad = next(x for x in samples if not (_is_number(x) and math.isfinite(x) and x >= 0))
        errors.append(f"{where}.timing.samples_ms must hold non-negative numbers (ms), got {bad!r}")
    for name in TIMING_FIELDS[1:]:
        if name in timing and not _is_number(timing[name]):
            errors.append(f"{where}.timing.{name} must be a number (ms), got {timing[name]!r}")
    if "host_ms" in timing:
        host = timing["host_ms"]
        if not (_is_number(host) and math.isfinite(host) and host >= 0):
            errors.append(f"{where}.timing.host_ms must be a finite number >= 0 (ms) or absent, got {host!r}; "
                          "record the median host enqueue time of the timed calls, or leave it out")


def _check_parity(parity: Mapping[str, Any], where: str, errors: list[str]) -> None:
    if "passed" in parity and not isinstance(parity["passed"], bool):
        errors.append(f"{where}.parity.passed must be true or false, got {parity['passed']!r}")
    for name in PARITY_FIELDS[:3]:
        if parity.get(name) is not None and not _is_number(parity[name]):
            errors.append(f"{where}.parity.{name} must be a number or null, got {parity[name]!r}")


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, Mapping):
        return any(_has_nan(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_nan(v) for v in value)
    return False


def _check_peak_mem(value: Any, where: str, errors: list[str]) -> None:
    """`peak_mem_bytes` is optional (absent or None on a CPU); when present, bytes as an int."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        errors.append(f"{where}: peak_mem_bytes must be a non-negative int (bytes) or absent, got {value!r}; "
                      "record torch.cuda.max_memory_allocated() as an int")


def validate(doc: Any) -> list[str]:
    """Every way `doc` breaks schema version 1, as readable strings (empty when valid)."""
    errors: list[str] = []
    if not isinstance(doc, Mapping):
        return [f"a results file must hold a JSON object, got {type(doc).__name__}"]
    if doc.get("schema_version") != SCHEMA_VERSION:
        errors.append(f"schema_version must be {SCHEMA_VERSION}, got {doc.get('schema_version')!r}")
    _require(doc.get("run"), RUN_FIELDS, "run", errors)
    _check_created_at(doc.get("run"), errors)
    _require(doc.get("machine"), MACHINE_FIELDS, "machine", errors)
    _check_machine(doc.get("machine"), errors)
    cases = doc.get("cases")
    if not isinstance(cases, list):
        errors.append("cases must be a list")
        return errors
    seen: set[str] = set()
    for i, case in enumerate(cases):
        where = f"cases[{i}]"
        _require(case, ("id", "suite", "op", "backend", "params", "status", "reason"), where, errors)
        if not isinstance(case, Mapping):
            continue
        where = f"case {case.get('id', i)!r}"
        for name in ("id", "suite", "op", "backend", "status"):
            if name in case and not isinstance(case[name], str):
                errors.append(f"{where}: {name} must be a string, got {case[name]!r}")
        if "params" in case and not isinstance(case["params"], Mapping):
            errors.append(f"{where}: params must be an object of shapes and knobs, got {type(case['params']).__name__}")
        if not isinstance(case.get("id"), str):
            continue
        if case.get("id") in seen:
            errors.append(f"{where} appears twice; case ids must be unique")
        seen.add(case.get("id"))
        if case.get("op") not in OPS:
            errors.append(f"{where}: op must be one of {OPS}, got {case.get('op')!r}")
        if case.get("backend") == "auto":
            errors.append(f"{where}: backend must name the backend that ran, never 'auto'")
        status = case.get("status")
        if status not in STATUSES:
            errors.append(f"{where}: status must be one of {STATUSES}, got {status!r}")
        timing = case.get("timing")
        if status == "ok":
            _require(timing, TIMING_FIELDS, f"{where}.timing", errors)
            if isinstance(timing, Mapping):
                _check_timing(timing, where, errors)
        elif timing is not None:
            errors.append(f"{where}: a {status} case must have no timing")
        if status in ("skipped", "failed") and not case.get("reason"):
            errors.append(f"{where}: a {status} case needs a reason")
        if case.get("parity") is not None:
            _require(case["parity"], PARITY_FIELDS, f"{where}.parity", errors)
            if isinstance(case["parity"], Mapping):
                _check_parity(case["parity"], where, errors)
        _check_peak_mem(case.get("peak_mem_bytes"), where, errors)
        if _has_nan(case):
            errors.append(f"{where} holds NaN or infinity; record the case as failed instead")
    return errors


def check(doc: Any, source: str = "results") -> dict[str, Any]:
    """Return `doc` if valid, else raise ResultsError listing every problem."""
    errors = validate(doc)
    if errors:
        # One line, as every CLI error: the first problems, then how many more.
        shown = "; ".join(errors[:5]) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")
        raise ResultsError(f"{source} must follow results schema v{SCHEMA_VERSION}, got {len(errors)} problem(s): "
                           f"{shown}; regenerate it with `python -m bench run`")
    return dict(doc)


# Committed archives are stored compressed (results/README.md); reading them needs no unpacking step.
_DECOMPRESS = {".xz": lzma.decompress, ".gz": gzip.decompress}


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate one results file: JSON, or JSON compressed by xz (`.json.xz`) or gzip (`.json.gz`)."""
    p = Path(path)
    try:
        data = p.read_bytes()
        unpack = _DECOMPRESS.get(p.suffix)
        if unpack is not None:
            try:
                data = unpack(data)
            except (lzma.LZMAError, EOFError, OSError) as exc:
                raise ResultsError(f"results file {p} must be {p.suffix[1:]}-compressed JSON, got data that does not "
                                   f"decompress ({exc}); regenerate it with `python -m bench run`") from None
        text = data.decode("utf-8")
    except OSError as exc:
        raise ResultsError(f"cannot read results file {p}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError as exc:
        raise ResultsError(f"results file {p} must be UTF-8 JSON, got a byte that is not UTF-8 at offset "
                           f"{exc.start}; regenerate it with `python -m bench run`") from None
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{p} is not valid JSON ({exc}); regenerate it with `python -m bench`") from None
    except RecursionError:
        raise ResultsError(f"{p} is not valid results JSON (nested too deep to read); regenerate it with "
                           "`python -m bench`") from None
    return check(doc, str(p))


def _reject_constant(name: str) -> float:
    raise ResultsError(f"results must hold finite numbers, got {name}; NaN and infinity never appear in a valid "
                       "file: record a case the timer could not measure as failed")


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(check(doc), indent=1, sort_keys=False, allow_nan=False) + "\n"


def dump(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Validate, then write atomically: a failed write leaves the old file and no temporary file."""
    p = Path(path)
    if p.is_dir():
        raise ResultsError(f"--out must be a file path, got the folder {str(p)!r}; pass e.g. {str(p / 'results.json')!r}")
    return atomic.write_text(p, dumps(doc))


def unique_cases(sources: Sequence[tuple[str, Mapping[str, Any]]],
                 error: type[Exception] = ResultsError) -> list[Mapping[str, Any]]:
    """Every case of the named documents `(name, doc)`, in order (shards of one run); a case id in
    two of them raises `error` naming both files."""
    origin: dict[str, str] = {}
    cases: list[Mapping[str, Any]] = []
    for name, doc in sources:
        for case in doc["cases"]:
            if case["id"] in origin:
                raise error(f"case ids must be unique across results files, got {case['id']!r} in "
                            f"{origin[case['id']]} and {name}; pass one file per shard, not reruns")
            origin[case["id"]] = name
            cases.append(case)
    return cases


def merge(docs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge shard files of one run (one process per GPU) into one document.

    Shards must come from one machine kind (same `gpu_name` and `sm`: the decision is per
    profile, and one name with two architectures means the files were mislabelled); `run` and
    `machine` are taken from the first.
    """
    if not docs:
        raise ResultsError("merge needs at least one results document, got none; pass the shard files")
    first = check(docs[0])
    kind = (first["machine"]["gpu_name"], first["machine"]["sm"])
    merged = {**first, "cases": []}
    for doc in docs:
        doc = check(doc)
        other = (doc["machine"]["gpu_name"], doc["machine"]["sm"])
        if other != kind:
            raise ResultsError(
                f"shards must come from one GPU kind (gpu_name and sm), got {kind[0]!r}/{kind[1]} and "
                f"{other[0]!r}/{other[1]}; run one sweep per GPU kind")
        merged["cases"].extend(doc["cases"])
    return check(merged, "merged results")
