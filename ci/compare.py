"""Comparison of this run's case timings with a previous run's. Pure functions.

A case regressed when both its median and its p20 grew by more than the margin (new/old >
margin on both): one statistic alone moves with a noisy tail or a lucky low, both together mean
the whole distribution shifted. It improved when both shrank past the margin (old/new > margin).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Timings = dict[str, tuple[float, float]]


def timings(doc: Mapping[str, Any]) -> Timings:
    """`{case id: (median_ms, p20_ms)}` of the ok cases of a results or decision document."""
    out: Timings = {}
    for case in doc.get("cases", []):
        if case.get("status") != "ok":
            continue
        timing = case.get("timing") or case  # results files nest timing; decision files flatten it
        if timing.get("median_ms") and timing.get("p20_ms"):
            out[case["id"]] = (float(timing["median_ms"]), float(timing["p20_ms"]))
    return out


def compare(new: Timings, old: Timings, margin: float) -> dict[str, Any]:
    """Rows for cases present in both runs, flagged `regression`, `improvement` or ``."""
    rows = []
    for case_id in sorted(new.keys() & old.keys()):
        (new_med, new_p20), (old_med, old_p20) = new[case_id], old[case_id]
        median_ratio, p20_ratio = new_med / old_med, new_p20 / old_p20
        flag = ""
        if median_ratio > margin and p20_ratio > margin:
            flag = "regression"
        elif median_ratio < 1 / margin and p20_ratio < 1 / margin:
            flag = "improvement"
        rows.append({"id": case_id, "old_median_ms": old_med, "new_median_ms": new_med,
                     "median_ratio": median_ratio, "p20_ratio": p20_ratio, "flag": flag})
    return {
        "matched": len(rows),
        "only_new": len(new.keys() - old.keys()),
        "only_old": len(old.keys() - new.keys()),
        "regressions": _flagged(rows, "regression"),
        "improvements": _flagged(rows, "improvement"),
    }


def _flagged(rows: Iterable[dict[str, Any]], flag: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["flag"] == flag]
