"""Speedup of a candidate over a baseline, with a bootstrap confidence interval. Pure functions.

Speedup = baseline median / candidate median (above 1: the candidate is faster). The interval is
a percentile bootstrap of that ratio of medians: each side's samples are resampled independently
(the bench interleaves repeats, so drift hits both sides alike and they need not be paired), with
a fixed seed so the same results file always gives the same decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 20250218  # fixed: a decision must be reproducible from its results file
MIN_SAMPLES = 5  # below this a bootstrap interval is too narrow to trust


@dataclass(frozen=True)
class Speedup:
    """Point estimate and two-sided interval of baseline median / candidate median."""

    ratio: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _as_samples(name: str, samples: Sequence[float]) -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty list of times, got {len(arr)} values; "
                         "time the case before comparing it")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must hold finite positive times, got min {arr.min()!r}; "
                         "record a case the timer could not measure as failed")
    return arr


def _medians(rng: np.random.Generator, arr: np.ndarray, resamples: int) -> np.ndarray:
    idx = rng.integers(0, arr.size, size=(resamples, arr.size))
    return np.median(arr[idx], axis=1)


def ratio_of_medians(baseline_ms: Sequence[float], candidate_ms: Sequence[float],
                     confidence: float = 0.95, resamples: int = RESAMPLES,
                     seed: int = SEED) -> Speedup:
    """Bootstrap `confidence` interval of median(baseline) / median(candidate).

    Args:
        baseline_ms: raw timing samples of the baseline (milliseconds, all > 0).
        candidate_ms: raw timing samples of the candidate (milliseconds, all > 0).
        confidence: two-sided level, strictly between 0 and 1.
        resamples: bootstrap replicates (vectorised: memory is resamples x len(samples)).
        seed: the generator seed; the default makes every run reproducible.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence}; "
                         "set decide.confidence in configs/base.yaml, e.g. 0.95")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    base = _as_samples("baseline samples", baseline_ms)
    cand = _as_samples("candidate samples", candidate_ms)
    rng = np.random.default_rng(seed)
    ratios = _medians(rng, base, resamples) / _medians(rng, cand, resamples)
    alpha = 1 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return Speedup(float(np.median(base) / np.median(cand)), float(low), float(high))


def verdict(speedup: Speedup, margin: float) -> str:
    """`adopt` when the interval clears `margin`, `reject` when it lies below, else `inconclusive`."""
    if speedup.low >= margin:
        return "adopt"
    if speedup.high < margin:
        return "reject"
    return "inconclusive"
