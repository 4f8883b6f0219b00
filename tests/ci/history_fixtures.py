"""Recorded histories for the history, lasting, regress and trends tests, built from committed results.

Each nightly of a history is a real results file with a new run id and date, and optionally some
cases' samples scaled (``{case id: 1.2}`` makes that case 20% slower), so the statistics see real
GPU noise rather than synthetic noise.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from functools import cache
from pathlib import Path
from typing import Any

from ci import history
from nsa_contract import results

ROOT = Path(__file__).resolve().parents[2]
H100_TRITON = "tests/data/h100/triton-nightly.json.xz"
H200_FA2 = "tests/data/h200/nightly-fa2.json.xz"
H200_PREFILL_DECODE = "tests/data/h200/prefill-decode-nightly.json.xz"
H100_DECODE = "tests/data/h100/decode-b8.json.xz"
H100_FAST = "tests/data/h100/fast-full.json.xz"
H100_AUTO = "tests/data/h100/auto/auto-full.json.xz"
START = datetime(2025, 12, 1, 3, 0, tzinfo=timezone.utc)  # in the past: records dated later are refused


@cache
def _load(rel: str) -> dict[str, Any]:
    return results.load(ROOT / rel)


def real(rel: str) -> dict[str, Any]:
    """A fresh deep copy of a committed results file (validated)."""
    return copy.deepcopy(_load(rel))


def nightly(rel: str, night: int, scale: Mapping[str, float] | None = None, *, gpu_name: str | None = None,
            prefix: str = "n", keep: Sequence[str] = ()) -> dict[str, Any]:
    """The results of night ``night`` (0, 1, ...): ``rel`` re-dated, with ``scale``'d cases' samples;
    with ``keep``, only the cases whose id contains one of those strings (a smaller replay).

    Unscaled nights reuse the same samples: history then holds identical runs, as a stable machine
    gives, and any flag in a test comes from the scaling alone.
    """
    doc = real(rel)
    when = START + timedelta(days=night)
    doc["run"]["id"] = f"{when:%Y%m%dT%H%M%SZ}-{prefix}{night:03d}"
    doc["run"]["created_at"] = f"{when:%Y-%m-%dT%H:%M:%SZ}"
    if gpu_name is not None:
        doc["machine"]["gpu_name"] = gpu_name
    if keep:
        doc["cases"] = [c for c in doc["cases"] if any(k in c["id"] for k in keep)]
    for case in doc["cases"]:
        factor = (scale or {}).get(case["id"])
        if case["suite"] == "triton" and case["op"] == "selected" and "part" not in case["params"]:
            # The committed H100 file predates the whole-branch cells that decide triton_min_len_sel;
            # its selection cells stand in for them here (these tests replay histories, not kernels).
            case["params"]["part"] = "branch"
            case["id"] = results.case_id(case["suite"], case["op"], case["backend"], case["params"])
            factor = factor if factor is not None else (scale or {}).get(case["id"])
        if factor is not None and case["status"] == "ok":
            case["timing"] = results.timing_summary([s * factor for s in case["timing"]["samples_ms"]])
    return results.check(doc)


def retimed(rel: str, night: int, times: Mapping[str, tuple[float, float | None]], **kwargs: Any) -> dict[str, Any]:
    """Night ``night`` of ``rel`` with each case of ``times`` (``{case id: (median ms, host ms)}``)
    scaled to that median and given that ``timing.host_ms`` (None: none, as in files before it)."""
    medians = {c["id"]: c["timing"]["median_ms"] for c in _load(rel)["cases"] if c["status"] == "ok"}
    doc = nightly(rel, night, {cid: ms / medians[cid] for cid, (ms, _) in times.items()}, **kwargs)
    for case in doc["cases"]:
        host = times.get(case["id"], (0.0, None))[1]
        if host is not None:
            case["timing"]["host_ms"] = host
    return results.check(doc)


def records(rel: str, nights: int, scaled: Mapping[int, Mapping[str, float]] | None = None,
            **kwargs: Any) -> list[history.HistoryRun]:
    """History records of ``nights`` nightlies of ``rel``; ``scaled[night]`` scales cases that night."""
    return [history.build_record(nightly(rel, n, (scaled or {}).get(n), **kwargs)) for n in range(nights)]


def flagged_history(rel: str, nights: int, scaled: Mapping[int, Mapping[str, float]] | None = None,
                    **kwargs: Any) -> list[history.HistoryRun]:
    """Like ``records``, each night's regressions computed against the nights before and stored,
    as the decide job does before it saves a record."""
    from ci import regress

    out: list[history.HistoryRun] = []
    for rec in records(rel, nights, scaled, **kwargs):
        rows = regress.regressions(rec, out)
        out.append(dataclasses.replace(rec, regressions=[r.id for r in regress.flagged(rows)]))
    return out


def entry(key: str, measured: int | None, current: int = -1, cls: str = "all") -> dict[str, Any]:
    """One decision entry as the decide rewrite produces it (one per key and shape class)."""
    proposed = current if measured is None else measured
    return {"key": key, "class": cls, "current": current, "measured": measured, "proposed": proposed,
            "changed": proposed != current, "reason": f"this run measured {measured}"}


def decided(run_id: str, created_at: str, entries: Sequence[dict[str, Any]]) -> Any:
    from ci.lasting import RunDecisions

    return RunDecisions(run_id, created_at, list(entries))


def day(night: int) -> str:
    return f"{START + timedelta(days=night):%Y-%m-%dT%H:%M:%SZ}"
