"""Noise floor from the `calibration` suite: the same case timed twice (replicas A and B).

An A/A "speedup" should be 1; its interval's half-width is the smallest effect this machine can
resolve, which the report sets beside the decision margin. Pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ci import stats
from nsa_contract import suites
from nsa_contract.results import case_id

CALIBRATION_SUITE = suites.CALIBRATION
# Sub-50 us kernels are dominated by launch jitter; their A/A spread says little about the
# millisecond-scale cells that decide thresholds, so they do not set the worst half-width.
MIN_MEDIAN_MS = 0.05


def noise_floor(cases: Iterable[Mapping[str, Any]], confidence: float) -> dict[str, Any]:
    """A/A speedups of calibration replicas, and the worst half-width above MIN_MEDIAN_MS.

    Replicas are cases of suite `calibration` with identical op, backend and params except
    `params["replica"]` in {"A", "B"}; both must have status `ok`.
    """
    replicas: dict[tuple[str, str, str], dict[str, Mapping[str, Any]]] = {}
    for case in cases:
        replica = case["params"].get("replica")
        if case["suite"] != CALIBRATION_SUITE or replica not in ("A", "B") or case["status"] != "ok":
            continue
        rest = {k: v for k, v in case["params"].items() if k != "replica"}
        key = (case["op"], case["backend"], json.dumps(rest, sort_keys=True))
        replicas.setdefault(key, {})[replica] = case
    rows = []
    for (op, backend, params_json), pair in sorted(replicas.items()):
        if set(pair) != {"A", "B"}:
            continue
        a, b = pair["A"]["timing"], pair["B"]["timing"]
        try:
            sp = stats.ratio_of_medians(a["samples_ms"], b["samples_ms"], confidence)
        except ValueError:  # zero times (below the timer's resolution) give no A/A ratio to learn from
            continue
        rows.append({
            "id": case_id(CALIBRATION_SUITE, op, backend, json.loads(params_json)),
            "op": op, "backend": backend,
            "median_a_ms": a["median_ms"], "median_b_ms": b["median_ms"],
            "speedup": sp.ratio, "ci_low": sp.low, "ci_high": sp.high, "half_width": sp.half_width,
            "counts": min(a["median_ms"], b["median_ms"]) > MIN_MEDIAN_MS,
        })
    counted = [r for r in rows if r["counts"]]
    worst = max(counted, key=lambda r: r["half_width"], default=None)
    return {
        "cases": rows,
        "min_median_ms": MIN_MEDIAN_MS,
        "worst_half_width": worst["half_width"] if worst else None,
        "worst_case": worst["id"] if worst else None,
    }
