"""Auto against the best plan: is `backend="auto"` within 10% of the fastest path for each call?

The test of the dispatch design (docs/design/dispatch.md, "Measured, not assumed"; the aim in
docs/pipeline.md): the `auto` suite times an NSA call (`nsa_prefill` or `nsa_decode`) once per
plan, where `params.plan` names the plan (`auto`, `sdpa`, `flex`, `triton`, `triton-fa2win`, ...:
any name is a plan) and the case's `backend` says what ran (for auto a label such as
`auto:cmp=triton,sel=triton,win=torch_fa2`). A row is one call (same op and params except the
plan): auto's median, the fastest other plan that ran and its median, and auto/best with a
bootstrap interval from `ci.stats` on the raw samples. A row is `slow` when the point estimate of
auto/best exceeds the limit (1.10): the interval is shown beside it, but a flag on the point
estimate is what the design's promise is about and it cannot hide behind noise.

Pure: validated results cases in, plain dicts out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ci import stats
from nsa_contract import keys, results, suites

SUITE = suites.AUTO
AUTO_PLAN = "auto"
OPS = ("nsa_prefill", "nsa_decode")
LIMIT = 1.10  # auto may be at most 10% slower than the best plan (docs/pipeline.md)

Case = Mapping[str, Any]


def _plan(case: Case) -> str:
    return str(case["params"].get("plan", ""))


def _call_key(case: Case) -> tuple[str, str]:
    shape = {k: v for k, v in case["params"].items() if k != "plan"}
    return case["op"], json.dumps(shape, sort_keys=True)


def _plan_entry(case: Case) -> dict[str, Any]:
    timing = case.get("timing") or {}
    return {"plan": _plan(case), "backend": case["backend"], "status": case["status"],
            "reason": case.get("reason", ""), "median_ms": timing.get("median_ms"),
            "peak_mem_bytes": case.get("peak_mem_bytes"), "id": case["id"]}


def _timed(case: Case) -> bool:
    return case["status"] == "ok" and bool((case.get("timing") or {}).get("samples_ms"))


def row(op: str, shape: Mapping[str, Any], cases: list[Case], confidence: float,
        limit: float = LIMIT) -> dict[str, Any]:
    """One call's row from its cases (one per plan)."""
    by_plan = sorted(cases, key=lambda c: (_plan(c) != AUTO_PLAN, _plan(c)))
    auto = next((c for c in by_plan if _plan(c) == AUTO_PLAN), None)
    others = [c for c in by_plan if _plan(c) != AUTO_PLAN and _timed(c)]
    best = min(others, key=lambda c: (c["timing"]["median_ms"], _plan(c)), default=None)
    out: dict[str, Any] = {
        "cell": f"{op}/{results.case_id(SUITE, op, AUTO_PLAN, shape).rsplit('/', 1)[1]}",
        "op": op, "shape": dict(shape), "class": keys.class_of_params(shape), "T": shape.get("T"),
        "auto": _plan_entry(auto) if auto else None,
        "best": _plan_entry(best) if best else None,
        "ratio": None, "ci_low": None, "ci_high": None, "slow": False, "note": "",
        "plans": [_plan_entry(c) for c in by_plan],
        "skipped": [{"plan": _plan(c), "reason": c.get("reason", "")} for c in by_plan if c["status"] == "skipped"],
        "failed": [{"plan": _plan(c), "reason": c.get("reason", "")} for c in by_plan if c["status"] == "failed"],
    }
    if auto is None:
        out["note"] = "no auto plan was timed for this call"
    elif not _timed(auto):
        out["note"] = f"auto {auto['status']}: {auto.get('reason', '')}"
    elif best is None:
        out["note"] = "no other plan ran, so there is nothing to compare auto with"
    else:
        try:
            # ratio_of_medians(a, b) is median(a) / median(b): auto's time over the best's.
            sp = stats.ratio_of_medians(auto["timing"]["samples_ms"], best["timing"]["samples_ms"], confidence)
        except ValueError as exc:
            out["note"] = str(exc)
            return out
        out.update(ratio=sp.ratio, ci_low=sp.low, ci_high=sp.high, slow=sp.ratio > limit)
    return out


def auto_vs_best(cases: Iterable[Case], confidence: float = 0.95, limit: float = LIMIT) -> dict[str, Any]:
    """`{rows, slow, limit}` for the `auto` suite's cases of `cases`; `slow` lists the slow rows' cells.

    Rows are sorted by op, class and shape, T last, so a class's lengths read in order."""
    groups: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        if case["suite"] == SUITE and case["op"] in OPS:
            groups.setdefault(_call_key(case), []).append(case)
    rows = [row(op, json.loads(shape), group, confidence, limit) for (op, shape), group in groups.items()]
    rank = {c: i for i, c in enumerate(keys.CLASSES)}
    rows.sort(key=lambda r: (r["op"], rank.get(r["class"], len(rank)),
                             json.dumps({k: v for k, v in r["shape"].items() if k != "T"}, sort_keys=True), r["T"] or 0))
    return {"rows": rows, "slow": [r["cell"] for r in rows if r["slow"]], "limit": limit}
