"""nsa_contract.suites: the default and nightly lists, written once, are suites bench has, and every
key's suite is swept by default."""

from __future__ import annotations

import pytest

from bench import suites as bench_suites
from nsa_contract import keys, suites


def test_the_lists_name_suites_that_bench_has() -> None:
    for name, names in suites.SETS.items():
        assert set(names) <= set(bench_suites.SUITES), (name, names)
        assert len(set(names)) == len(names), name


def test_the_serving_suites_run_as_declared() -> None:
    """serve (its nightly size: the one ragged paged decode cell) joins the nightly sweep on CUDA;
    serve_prefill runs only when named."""
    for name in ("serve", "serve_prefill"):
        assert name in bench_suites.SUITES and bench_suites.parse(name) == [name]
    assert "serve" in suites.NIGHTLY and "serve" not in suites.DEFAULT
    assert all("serve_prefill" not in names for names in suites.SETS.values())


def test_every_key_is_decided_by_a_default_sweep() -> None:
    assert {k.suite for k in keys.KEYS} | {suites.CALIBRATION} == set(suites.DEFAULT)


@pytest.mark.parametrize("text,expected", [
    ("nightly", suites.NIGHTLY),
    ("default", suites.DEFAULT),
    ("default,masked", (*suites.DEFAULT, "masked")),
    ("fa2,default", suites.DEFAULT),  # a suite named twice runs once, where it first appears
    ("all", bench_suites.SUITES),
])
def test_bench_takes_a_list_by_its_name(text: str, expected: tuple[str, ...]) -> None:
    assert bench_suites.parse(text) == list(expected)


def test_an_unknown_suite_names_the_lists_too() -> None:
    with pytest.raises(ValueError, match=r"suite must be one of fa2, .* \(or a list: all, default, nightly\), "
                                         r"got 'nightly2'"):
        bench_suites.parse("nightly2")
