from __future__ import annotations

import copy
import gzip
import json
import lzma
from typing import Any

import pytest

from nsa_contract import results
from tests.ci import fixtures as fx


def _doc(cases):
    return {"schema_version": 1,
            "run": {"id": "r", "created_at": "2026-01-01T00:00:00Z", "git_sha": "abc", "command": "x"},
            "machine": {k: None for k in results.MACHINE_FIELDS} | {"gpu_name": "cpu", "sm": "cpu"},
            "cases": cases}


def _case(status="ok", backend="sdpa", T=256, **more):
    params = {"B": 1, "T": T, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64, "window": 512, "dtype": "bf16"}
    case = {"id": results.case_id("fa2", "sliding", backend, params), "suite": "fa2", "op": "sliding",
            "backend": backend, "params": params, "status": status,
            "reason": None if status == "ok" else "why", "parity": None,
            "timing": results.timing_summary([1.0, 2.0, 3.0]) if status == "ok" else None}
    case.update(more)
    return case


def test_case_id_is_readable_and_stable():
    assert _case()["id"] == "fa2/sliding/sdpa/B1-T256-Hq8-Hkv2-D64-w512-bf16"


def test_round_trip(tmp_path):
    doc = _doc([_case(), _case("skipped", backend="torch_fa2")])
    path = results.dump(doc, tmp_path / "r.json")
    assert results.load(path) == json.loads(json.dumps(doc))


@pytest.mark.parametrize("suffix, pack", [(".xz", lzma.compress), (".gz", gzip.compress)])
def test_compressed_files_load_as_the_plain_file(tmp_path, suffix, pack):
    """The committed archives are .json.xz (results/README.md); `ci decide --results` reads them as is."""
    doc = _doc([_case()])
    plain = results.dump(doc, tmp_path / "r.json")
    packed = tmp_path / f"r.json{suffix}"
    packed.write_bytes(pack(plain.read_bytes()))
    assert results.load(packed) == results.load(plain)
    (tmp_path / f"bad.json{suffix}").write_bytes(plain.read_bytes())  # named compressed, stored plain
    with pytest.raises(results.ResultsError, match=f"must be {suffix[1:]}-compressed JSON"):
        results.load(tmp_path / f"bad.json{suffix}")


def test_nan_is_rejected_everywhere(tmp_path):
    with pytest.raises(results.ResultsError):
        results.timing_summary([1.0, float("nan")])
    bad = _doc([_case(parity={"max_abs_err": float("nan"), "rel_err": 0.0, "tol": 1.0, "passed": False})])
    with pytest.raises(results.ResultsError, match="NaN"):
        results.dump(bad, tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text(json.dumps(_doc([_case()])).replace('"median_ms": 2.0', '"median_ms": NaN'))
    with pytest.raises(results.ResultsError, match="NaN"):
        results.load(tmp_path / "nan.json")


def test_failed_case_with_timing_is_rejected():
    case = _case("failed")
    case["timing"] = results.timing_summary([1.0])
    assert any("must have no timing" in e for e in results.validate(_doc([case])))


def test_merge_keeps_every_shard_case():
    merged = results.merge([_doc([_case(T=256)]), _doc([_case(T=512)])])
    assert [c["params"]["T"] for c in merged["cases"]] == [256, 512]


@pytest.mark.parametrize("value, ok", [(None, True), (0, True), (123456789, True), (-1, False), (1.5, False),
                                       (True, False), ("1024", False)])
def test_peak_mem_bytes_is_an_optional_non_negative_int(value, ok):
    errors = results.validate(_doc([_case(peak_mem_bytes=value)]))
    assert (not errors) if ok else any("peak_mem_bytes must be a non-negative int" in e for e in errors)
    assert not results.validate(_doc([_case()]))     # absent is valid


@pytest.mark.parametrize("value, ok", [(0, True), (0.031, True), (2, True), (-0.1, False), (True, False),
                                       ("0.5", False), (None, False), (float("inf"), False)])
def test_host_ms_is_an_optional_non_negative_finite_number(value, ok):
    case = _case()
    case["timing"]["host_ms"] = value
    errors = results.validate(_doc([case]))
    assert (not errors) if ok else any("timing.host_ms must be a finite number >= 0 (ms) or absent" in e
                                       for e in errors), errors
    assert not results.validate(_doc([_case()]))     # absent (files written before it) is valid


def test_samples_per_case_are_bounded(tmp_path):
    """2,000,000 samples made the bootstrap of `ci decide` allocate 29.8 GiB; validation stops them."""
    at_bound = _case(timing=results.timing_summary([1.0] * results.MAX_SAMPLES_PER_CASE))
    assert results.check(_doc([at_bound]))
    over = _case(timing=results.timing_summary([1.0] * (results.MAX_SAMPLES_PER_CASE + 1)))
    with pytest.raises(results.ResultsError, match=f"at most {results.MAX_SAMPLES_PER_CASE} samples, got 10001"):
        results.check(_doc([over]))


def test_a_huge_case_exits_2_in_decide_with_one_line(tmp_path, capsys):
    from ci.__main__ import main

    path = tmp_path / "r.json"
    path.write_text(json.dumps(_doc([_case(timing=results.timing_summary([1.0] * 2_000_000))])), encoding="utf-8")
    assert main(["decide", "--results", str(path), "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at most 10000 samples, got 2000000" in err, err
    assert not (tmp_path / "d.json").exists()


@pytest.mark.parametrize("created_at", ["yesterday", "2026-13-01T00:00:00Z", "2026-01-01T00:00:00+02:00", 5, None])
def test_created_at_is_a_utc_time(created_at):
    doc = _doc([_case()])
    doc["run"]["created_at"] = created_at
    with pytest.raises(results.ResultsError, match="run.created_at must be a UTC ISO-8601 time"):
        results.check(doc)
    doc["run"]["created_at"] = "2026-01-01T00:00:00.25+00:00"
    assert results.check(doc)


# --- sample types, machine.sm, params and merged shards ---------------------------------------------

def _fixture_doc() -> dict[str, Any]:
    return fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0}))


@pytest.mark.parametrize("samples,message", [
    ([True] * 30, "samples_ms must hold non-negative numbers (ms), got True"),
    (["1.0"] * 30, "samples_ms must hold non-negative numbers (ms), got '1.0'"),
    ([-0.5] * 30, "samples_ms must hold non-negative numbers (ms), got -0.5"),
    ("1.0, 2.0", "samples_ms must be a non-empty list"),
])
def test_samples_must_be_positive_numbers(samples: Any, message: str) -> None:
    doc = copy.deepcopy(_fixture_doc())
    doc["cases"][0]["timing"]["samples_ms"] = samples
    assert any(message in e for e in results.validate(doc)), results.validate(doc)


@pytest.mark.parametrize("sm", [90, "90", "SM90", "", None])
def test_machine_sm_must_be_a_profile_string(sm: Any) -> None:
    doc = copy.deepcopy(_fixture_doc())
    doc["machine"]["sm"] = sm
    assert any("machine.sm must be a string such as 'sm90' or 'cpu'" in e for e in results.validate(doc))


def test_params_must_be_a_mapping() -> None:
    doc = copy.deepcopy(_fixture_doc())
    doc["cases"][0]["params"] = [1, 2]
    assert any("params must be an object" in e for e in results.validate(doc))


def test_a_broken_file_is_one_line_with_the_fix() -> None:
    doc = copy.deepcopy(_fixture_doc())
    for case in doc["cases"]:
        case["timing"]["samples_ms"] = [True]
    with pytest.raises(results.ResultsError) as info:
        results.check(doc, "x.json")
    text = str(info.value)
    n = sum(len(c["timing"]["samples_ms"]) > 0 for c in doc["cases"])  # one problem per broken case
    assert "\n" not in text and text.startswith(f"x.json must follow results schema v1, got {n} problem(s): ")
    assert text.endswith("; regenerate it with `python -m bench run`")


def test_merge_refuses_one_gpu_name_with_two_architectures() -> None:
    other = copy.deepcopy(_fixture_doc())
    other["machine"]["sm"] = "sm89"
    with pytest.raises(results.ResultsError, match="shards must come from one GPU kind"):
        results.merge([_fixture_doc(), other])


def test_timing_summary_refuses_negative_times() -> None:
    with pytest.raises(results.ResultsError, match="finite, non-negative and non-empty"):
        results.timing_summary([-1.0, 1.0])
