"""Results validation gaps closed by the hardening issue (item 7): sample types, machine.sm, merge."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from nsa_contract import results
from tests.ci import fixtures as fx


def _doc() -> dict[str, Any]:
    return fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0}))


@pytest.mark.parametrize("samples,message", [
    ([True] * 30, "samples_ms must hold non-negative numbers (ms), got True"),
    (["1.0"] * 30, "samples_ms must hold non-negative numbers (ms), got '1.0'"),
    ([-0.5] * 30, "samples_ms must hold non-negative numbers (ms), got -0.5"),
    ("1.0, 2.0", "samples_ms must be a non-empty list"),
])
def test_samples_must_be_positive_numbers(samples: Any, message: str) -> None:
    doc = copy.deepcopy(_doc())
    doc["cases"][0]["timing"]["samples_ms"] = samples
    assert any(message in e for e in results.validate(doc)), results.validate(doc)


@pytest.mark.parametrize("sm", [90, "90", "SM90", "", None])
def test_machine_sm_must_be_a_profile_string(sm: Any) -> None:
    doc = copy.deepcopy(_doc())
    doc["machine"]["sm"] = sm
    assert any("machine.sm must be a string such as 'sm90' or 'cpu'" in e for e in results.validate(doc))


def test_params_must_be_a_mapping() -> None:
    doc = copy.deepcopy(_doc())
    doc["cases"][0]["params"] = [1, 2]
    assert any("params must be an object" in e for e in results.validate(doc))


def test_a_broken_file_is_one_line_with_the_fix() -> None:
    doc = copy.deepcopy(_doc())
    for case in doc["cases"]:
        case["timing"]["samples_ms"] = [True]
    with pytest.raises(results.ResultsError) as info:
        results.check(doc, "x.json")
    text = str(info.value)
    n = sum(len(c["timing"]["samples_ms"]) > 0 for c in doc["cases"])  # one problem per broken case
    assert "\n" not in text and text.startswith(f"x.json must follow results schema v1, got {n} problem(s): ")
    assert text.endswith("; regenerate it with `python -m bench run`")


def test_merge_refuses_one_gpu_name_with_two_architectures() -> None:
    other = copy.deepcopy(_doc())
    other["machine"]["sm"] = "sm89"
    with pytest.raises(results.ResultsError, match="shards must come from one GPU kind"):
        results.merge([_doc(), other])


def test_timing_summary_refuses_negative_times() -> None:
    with pytest.raises(results.ResultsError, match="finite, non-negative and non-empty"):
        results.timing_summary([-1.0, 1.0])
