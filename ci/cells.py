"""Cells: one `(suite, op, params)` timed under the baseline (masked SDPA) and one candidate
(FA-2, the own Triton kernels, or any other backend a suite times).

A cell's verdict is `adopt`, `reject` or `inconclusive` from the speedup interval against the
margin, `failed` when either side failed or broke parity, and `skipped` when either side did not
run. Which cells may decide a threshold is `ci.decide`'s business; this module only pairs cases
and judges each pair. Pure functions over validated results documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ci import stats
from nsa_contract import keys

BASELINE = "sdpa"
FA2_BACKENDS = tuple(dict.fromkeys(c for k in keys.of_family("fa2") for c in k.candidates))
TRITON_BACKENDS = tuple(dict.fromkeys(c for k in keys.of_family("triton") for c in k.candidates))
VERDICTS = ("adopt", "reject", "inconclusive", "failed", "skipped")

Case = Mapping[str, Any]


@dataclass
class Cell:
    """One baseline/candidate pair; `id` is the candidate's case id (unique per cell)."""

    id: str
    suite: str
    op: str
    params: dict[str, Any]
    T: int | None
    baseline_id: str
    baseline_backend: str
    candidate_backend: str
    baseline: dict[str, float] | None
    candidate: dict[str, float] | None
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str
    reason: str
    branch: str | None = None
    cls: str | None = None  # shape class (nsa_contract.keys.class_of): a class decides from its own cells only
    used_for_decision: bool = False
    note: str = ""
    # What `auto` picks for this cell under the config in force (nsa_contract.settings.Settings.planned).
    auto_backend: str | None = None
    auto_why: str = ""
    parity: dict[str, Any] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _params_key(case: Case) -> tuple[str, str, str]:
    return case["suite"], case["op"], json.dumps(case["params"], sort_keys=True)


def pair_cases(cases: Iterable[Case]) -> tuple[list[tuple[Case, Case]], list[Case]]:
    """Pair every non-baseline case with the `sdpa` case of the same suite, op and params.

    Returns (pairs, unpaired): `unpaired` are non-baseline cases with no baseline to compare to.
    """
    groups: dict[tuple[str, str, str], list[Case]] = {}
    for case in cases:
        groups.setdefault(_params_key(case), []).append(case)
    pairs: list[tuple[Case, Case]] = []
    unpaired: list[Case] = []
    for group in groups.values():
        bases = [c for c in group if c["backend"] == BASELINE]
        others = [c for c in group if c["backend"] != BASELINE]
        if bases:
            pairs.extend((bases[0], other) for other in others)
        else:
            unpaired.extend(others)
    return pairs, unpaired


def parity_failed(case: Case) -> bool:
    parity = case.get("parity")
    return isinstance(parity, Mapping) and parity.get("passed") is False


def _num(value: Any) -> str:
    return "—" if value is None else f"{value:.3g}"


def case_problem(case: Case) -> tuple[str, str] | None:
    """(`failed` or `skipped`, reason) when this case cannot be timed against another, else None."""
    if parity_failed(case):
        p = case["parity"]
        detail = p.get("detail") or (f"max_abs_err {_num(p['max_abs_err'])}, rel_err {_num(p['rel_err'])}, "
                                     f"tol {_num(p['tol'])}")
        return "failed", f"{case['backend']} parity failed: {detail}"
    if case["status"] in ("failed", "skipped"):
        return case["status"], f"{case['backend']} {case['status']}: {case['reason']}"
    return None


def _timing(case: Case) -> dict[str, float] | None:
    timing = case.get("timing")
    if not timing:
        return None
    out = {k: timing[k] for k in ("median_ms", "p20_ms", "p80_ms")} | {"n": len(timing["samples_ms"])}
    if timing.get("host_ms") is not None:  # host enqueue time of one call (bench.timing), when recorded
        out["host_ms"] = timing["host_ms"]
    return out


def judge(baseline: Case, candidate: Case, margin: float, confidence: float) -> Cell:
    """Build the cell of one pair, with its speedup interval and verdict."""
    cell = Cell(
        id=candidate["id"], suite=candidate["suite"], op=candidate["op"],
        params=dict(candidate["params"]), T=candidate["params"].get("T"),
        baseline_id=baseline["id"], baseline_backend=baseline["backend"],
        candidate_backend=candidate["backend"], baseline=_timing(baseline),
        candidate=_timing(candidate), speedup=None, ci_low=None, ci_high=None,
        verdict="inconclusive", reason="", parity=candidate.get("parity"))
    problems: list[tuple[str, str]] = []
    for side, case in (("baseline", baseline), ("candidate", candidate)):
        found = case_problem(case)
        if found:
            problems.append((found[0], f"{side} {found[1]}"))
    if problems:
        failed = [reason for verdict, reason in problems if verdict == "failed"]
        cell.verdict = "failed" if failed else "skipped"
        cell.reason = "; ".join(failed or [reason for _, reason in problems])
        return cell
    base_s, cand_s = baseline["timing"]["samples_ms"], candidate["timing"]["samples_ms"]
    try:
        sp = stats.ratio_of_medians(base_s, cand_s, confidence)
    except ValueError as exc:
        cell.verdict, cell.reason = "failed", str(exc)
        return cell
    cell.speedup, cell.ci_low, cell.ci_high = sp.ratio, sp.low, sp.high
    n = min(len(base_s), len(cand_s))
    if n < stats.MIN_SAMPLES:
        cell.reason = (f"only {n} samples on one side; a decision needs at least {stats.MIN_SAMPLES} "
                       "(raise the bench's repeats)")
        return cell
    cell.verdict = stats.verdict(sp, margin)
    cell.reason = f"{sp.ratio:.2f}x [{sp.low:.2f}, {sp.high:.2f}] against margin {margin:g}"
    return cell


def length_verdict(verdicts: Iterable[str]) -> str:
    """Verdict of one length from its cells' verdicts (skipped cells ignored).

    `adopt` only when every tested cell is; one `reject` settles the length as not adopted
    whatever the uncertain cells would show, so it outranks `failed` and `inconclusive`.
    Returns `skipped` when no cell was tested.
    """
    tested = [v for v in verdicts if v != "skipped"]
    for outcome in ("reject", "failed", "inconclusive"):
        if outcome in tested:
            return outcome
    return "adopt" if tested else "skipped"
