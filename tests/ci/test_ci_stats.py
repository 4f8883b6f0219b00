"""ci.stats: the bootstrap interval of a ratio of medians, and the cell verdict."""

from __future__ import annotations

import numpy as np
import pytest

from ci import stats


def _noisy(median: float, spread: float, n: int, seed: int) -> list[float]:
    return list(median * (1 + spread * np.random.default_rng(seed).uniform(-1, 1, n)))


def test_point_estimate_is_ratio_of_medians_and_inside_interval() -> None:
    base, cand = _noisy(3.0, 0.05, 41, 1), _noisy(1.5, 0.05, 37, 2)
    sp = stats.ratio_of_medians(base, cand)
    assert sp.ratio == pytest.approx(np.median(base) / np.median(cand))
    assert sp.low < sp.ratio < sp.high
    assert sp.low == pytest.approx(2.0, rel=0.05) and sp.high == pytest.approx(2.0, rel=0.05)


def test_reproducible_with_fixed_seed_and_seed_matters() -> None:
    base, cand = _noisy(1.0, 0.3, 20, 3), _noisy(1.0, 0.3, 20, 4)
    assert stats.ratio_of_medians(base, cand) == stats.ratio_of_medians(base, cand)
    assert stats.ratio_of_medians(base, cand, seed=1) != stats.ratio_of_medians(base, cand, seed=2)


def test_higher_confidence_and_more_noise_widen_the_interval() -> None:
    base, cand = _noisy(1.0, 0.2, 30, 5), _noisy(1.0, 0.2, 30, 6)
    at_80 = stats.ratio_of_medians(base, cand, confidence=0.80)
    at_99 = stats.ratio_of_medians(base, cand, confidence=0.99)
    assert at_99.low < at_80.low and at_99.high > at_80.high
    tight = stats.ratio_of_medians(_noisy(1.0, 0.01, 30, 5), _noisy(1.0, 0.01, 30, 6))
    assert tight.half_width < at_80.half_width / 5


@pytest.mark.parametrize(("base", "cand", "match"), [
    ([], [1.0], "baseline samples must be a non-empty"),
    ([1.0], [0.0, 1.0], "candidate samples must hold finite positive"),
    ([1.0, float("nan")], [1.0], "baseline samples must hold finite positive"),
])
def test_bad_samples_raise_with_the_rule(base: list[float], cand: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stats.ratio_of_medians(base, cand)


def test_confidence_outside_unit_interval_raises() -> None:
    with pytest.raises(ValueError, match="confidence must be strictly between 0 and 1, got 1.5"):
        stats.ratio_of_medians([1.0], [1.0], confidence=1.5)


@pytest.mark.parametrize(("low", "high", "expected"), [
    (1.2, 1.5, "adopt"), (1.21, 1.3, "adopt"), (0.5, 1.19, "reject"), (1.1, 1.2, "inconclusive"),
    (1.19, 1.25, "inconclusive"),
])
def test_verdict_against_margin(low: float, high: float, expected: str) -> None:
    assert stats.verdict(stats.Speedup((low + high) / 2, low, high), 1.2) == expected
