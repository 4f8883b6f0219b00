"""Regression alerts: every case of this run against its history baseline. Pure functions.

Baseline: the samples of the last K runs of the same GPU model that timed the case, pooled (this
run left out by id, so a rerun never compares with itself). Runs in which the case was itself
flagged (``HistoryRun.regressions``) are left out of its baseline: otherwise a regression that
persists would become its own baseline after K/2 nights and the issue would close while the code is
still slow. An intended slowdown is accepted by listing its case id in ``accepted`` (phase 2: a
config key), which puts those runs back; after the kept history (30 runs) rolls past the change,
it is the baseline anyway. Slowdown = median(now) / median(baseline)
with the decision's bootstrap (``ci.stats``: percentile interval, fixed seed, independent resampling
of each side). Where the run timed a dense case of the same suite and shape (``HistoryRun.dense``)
and every baseline run timed it too, the slowdown is a ratio of ratios,
(now / dense now) / (baseline / dense baseline), so machine drift (clocks, driver, a warmer room)
cancels and only the case's own change remains. With fewer than ``stats.MIN_SAMPLES`` samples on
a side, the baseline side is the per-run medians instead: the interval then shows run-to-run spread.

A case is a ``regression`` when the interval's lower bound exceeds 1 + margin (significant and
beyond the margin), an ``improvement`` when its upper bound is under 1 / (1 + margin). A slowdown
that the timing cannot pin on this project's kernels gets another flag instead, checked in this
order:

- ``launch-bound``: both the median now and the baseline's are under ``time_floor_ms`` (config
  ``decide.time_floor_ms``, the floor below which ``ci decide`` lets no cell decide). Such a call
  is a launch or two, ranked by launch overhead; consecutive runs of one commit differ there.
  Flagged rather than left blank so the report still lists a tiny kernel that became much slower.
- ``host``: this run's host enqueue time of one call (``HistoryCase.host_ms``, the median over the
  timed repeats) reaches the baseline's median time, ``now.host_ms >= baseline_ms``. The host alone
  now takes as long as the whole call took in the baseline, so the event time measured the host
  (Python, dispatch, launch rate) and the GPU cannot be judged. Measured on an H100: two nightlies
  of the same commit on the same GPU, where every GPU-bound case matched (ratio 1.00) but the
  host-bound ones (microsecond Triton kernels, masked-SDPA references of many small ops, the whole
  NSA call at short lengths) were up to 4x slower in the second run because its host was slower;
  without this rule that run failed with over a hundred "regressions". A code change that slows
  the host path itself is flagged ``host`` too, and shows in the report. Records without
  ``host_ms`` (written before it was measured) are judged as before.
- ``drift``: a dense case that slowed down. It is the reference other cases are divided by (torch's
  attention, not this project's code), so its slowdown is the machine or a torch upgrade.

``host``, ``launch-bound`` and ``drift`` rows are shown in the report, but they neither open or
update the tracking issue nor fail the job, and their runs stay in later baselines (only
``regression`` ids are stored in ``HistoryRun.regressions``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ci import stats
from ci.history import HistoryCase, HistoryRun, latest
from nsa_contract import settings

DEFAULT_MARGIN = 0.1
DEFAULT_K = 3
DEFAULT_TIME_FLOOR_MS = float(settings.DECIDE_FIELDS["time_floor_ms"][0])
FLAGS = ("regression", "host", "drift", "launch-bound", "", "improvement")  # the report's order


@dataclass(frozen=True)
class Row:
    """One case's slowdown against its baseline (above 1: slower now)."""

    id: str
    suite: str
    op: str
    backend: str
    now_ms: float
    baseline_ms: float
    ratio: float
    low: float
    high: float
    flag: str  # one of FLAGS
    method: str  # "samples" or "run medians"
    dense_id: str | None = None
    baseline_runs: list[str] = field(default_factory=list)
    host_ms: float | None = None  # this run's host enqueue time of one call; None when not recorded

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _boot_medians(rng: np.random.Generator, values: Sequence[float], resamples: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    return np.median(arr[rng.integers(0, arr.size, size=(resamples, arr.size))], axis=1)


def ratio_of_ratios(now: Sequence[float], now_dense: Sequence[float], base: Sequence[float],
                    base_dense: Sequence[float], confidence: float = 0.95,
                    resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> stats.Speedup:
    """Bootstrap interval of (median(now) / median(now_dense)) / (median(base) / median(base_dense)).

    The same method as ``stats.ratio_of_medians`` (four sides resampled independently, percentile
    interval, fixed seed), extended to the dense-normalised slowdown.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence}; use e.g. 0.95")
    for name, values in (("now", now), ("now_dense", now_dense), ("base", base), ("base_dense", base_dense)):
        if len(values) == 0 or min(values) <= 0:
            raise ValueError(f"{name} must be non-empty positive times, got {list(values)[:3]}; "
                             "pass the ok cases' samples")
    rng = np.random.default_rng(seed)
    boot = ((_boot_medians(rng, now, resamples) / _boot_medians(rng, now_dense, resamples))
            / (_boot_medians(rng, base, resamples) / _boot_medians(rng, base_dense, resamples)))
    alpha = 1 - confidence
    low, high = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    point = (np.median(now) / np.median(now_dense)) / (np.median(base) / np.median(base_dense))
    return stats.Speedup(float(point), float(low), float(high))


def _timed(case: HistoryCase | None) -> bool:
    """Whether a case has times to divide by: a timer can round a tiny call down to 0 ms (the results
    schema allows it, and ``ci decide`` judges such a cell failed); such a case is compared with nothing."""
    return case is not None and case.median_ms > 0 and min(case.samples_ms) > 0


def _pooled(runs: Sequence[HistoryRun], case_id: str) -> list[float]:
    return [s for r in runs for s in r.case(case_id).samples_ms]  # type: ignore[union-attr]


def _flag(low: float, high: float, margin: float, *, op: str, now_ms: float, baseline_ms: float,
          host_ms: float | None, time_floor_ms: float) -> str:
    """The row's flag (module docstring): the interval's verdict, then what explains a slowdown."""
    if high < 1 / (1 + margin):
        return "improvement"
    if low <= 1 + margin:
        return ""
    if max(now_ms, baseline_ms) < time_floor_ms:
        return "launch-bound"
    if host_ms is not None and host_ms >= baseline_ms:
        return "host"
    return "drift" if op == "dense" else "regression"


def _row(current: HistoryRun, runs: list[HistoryRun], case_id: str, margin: float,
         confidence: float, time_floor_ms: float) -> Row:
    now = current.case(case_id)
    assert now is not None  # callers pass ids of this run's cases
    dense_id = current.dense.get(case_id)
    dense_now = current.case(dense_id) if dense_id else None
    if not _timed(dense_now) or not all(_timed(r.case(dense_id)) for r in runs):  # type: ignore[arg-type]
        dense_id = None
    base = _pooled(runs, case_id)
    thin = min(len(now.samples_ms), len(base)) < stats.MIN_SAMPLES
    if thin:
        base = [r.case(case_id).median_ms for r in runs]  # type: ignore[union-attr]
    if dense_id is not None:
        dense_base = ([r.case(dense_id).median_ms for r in runs] if thin  # type: ignore[union-attr]
                      else _pooled(runs, dense_id))
        sp = ratio_of_ratios(now.samples_ms, dense_now.samples_ms, base, dense_base, confidence)  # type: ignore[union-attr]
    else:
        # ratio_of_medians(a, b) is median(a) / median(b): now over baseline, above 1 when slower.
        sp = stats.ratio_of_medians(now.samples_ms, base, confidence)
    baseline_ms = float(np.median(base))
    flag = _flag(sp.low, sp.high, margin, op=now.op, now_ms=now.median_ms, baseline_ms=baseline_ms,
                 host_ms=now.host_ms, time_floor_ms=time_floor_ms)
    return Row(id=case_id, suite=now.suite, op=now.op, backend=now.backend, now_ms=now.median_ms,
               baseline_ms=baseline_ms, ratio=sp.ratio, low=sp.low, high=sp.high, flag=flag,
               method="run medians" if thin else "samples", dense_id=dense_id,
               baseline_runs=[r.id for r in runs], host_ms=now.host_ms)


def regressions(current: HistoryRun, past: Sequence[HistoryRun], *, k: int = DEFAULT_K,
                margin: float = DEFAULT_MARGIN, confidence: float = 0.95,
                accepted: Collection[str] = (), time_floor_ms: float = DEFAULT_TIME_FLOOR_MS) -> list[Row]:
    """One row per case of ``current`` that the last ``k`` runs of its model timed; worst first.

    Args:
        current: this run's history record (``ci.history.build_record``).
        past: earlier records of the same GPU model (this run among them is ignored).
        k: runs that make up a baseline (config ``history.k``); a case uses the last k runs that timed it.
        margin: slowdown beyond 1 + margin, at the interval's lower bound, is a regression (0.1 = 10%).
        accepted: case ids whose flagged runs count in their baseline again (an intended slowdown).
        time_floor_ms: a slowdown with both medians under it is ``launch-bound``, never a regression
            (config ``decide.time_floor_ms``).

    Store ``[r.id for r in flagged(rows)]`` as the record's ``regressions`` before saving it.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}; pass e.g. --regression-margin 0.1")
    if not time_floor_ms >= 0:
        raise ValueError(f"time_floor_ms must be a number >= 0, got {time_floor_ms}; set decide.time_floor_ms "
                         "in configs/base.yaml (0.1 ms by default)")
    others = [r for r in past if r.gpu != current.gpu]
    if others:
        raise ValueError(f"past must hold runs of {current.gpu} only, got {others[0].gpu} ({others[0].id}); "
                         "pass store.load(record.gpu)")
    rows = []
    for case in current.cases:
        if not _timed(case):
            continue
        usable = [r for r in past if _timed(r.case(case.id))
                  and (case.id in accepted or case.id not in r.regressions)]
        runs = latest(usable, k, exclude=current.id)
        if runs:
            rows.append(_row(current, runs, case.id, margin, confidence, time_floor_ms))
    order = {f: i for i, f in enumerate(FLAGS)}
    return sorted(rows, key=lambda r: (order[r.flag], -r.low if r.flag == "regression" else -r.ratio, r.id))


def flagged(rows: Sequence[Row], flag: str = "regression") -> list[Row]:
    return [r for r in rows if r.flag == flag]
