"""ci.autobest and its report section: is auto within 10% of the best plan for every call?"""

from __future__ import annotations

from typing import Any

import pytest

from ci import autobest, decide, report
from tests.ci import fixtures as fx


def rows(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return autobest.auto_vs_best(fx.document(cases)["cases"])


def decision(cases: list[dict[str, Any]]) -> dict[str, Any]:
    conf = decide.DecideConfig.from_mapping(fx.config())
    return decide.decide([("r.json", fx.document(cases))], conf)


def test_a_row_per_call_with_the_best_other_plan_and_the_ratio_interval() -> None:
    out = rows(fx.auto_call("nsa_prefill", fx.call_params(4096), {"auto": 2.0, "sdpa": 3.0, "flex": 2.2,
                                                                  "triton": 1.9}))
    (row,) = out["rows"]
    assert (row["op"], row["class"], row["T"], row["shape"]["Hq"]) == ("nsa_prefill", "g4", 4096, 8)
    assert "plan" not in row["shape"] and row["cell"] == "nsa_prefill/B1-T4096-Hq8-Hkv2-D64-w512-l32-d16-ls64-n16-bf16"
    assert (row["auto"]["backend"], row["best"]["plan"], row["best"]["backend"]) == (fx.AUTO_LABEL, "triton", "triton")
    assert row["ratio"] == pytest.approx(row["auto"]["median_ms"] / row["best"]["median_ms"])
    assert row["ci_low"] <= row["ratio"] <= row["ci_high"] and row["ratio"] == pytest.approx(2.0 / 1.9, rel=0.02)
    assert row["slow"] is False and out["slow"] == [] and out["limit"] == autobest.LIMIT == 1.1
    # Every plan with its median and peak memory, auto first.
    assert [p["plan"] for p in row["plans"]] == ["auto", "flex", "sdpa", "triton"]
    assert row["plans"][0]["peak_mem_bytes"] == int(2.0 * 2**28)


def test_slow_means_the_point_estimate_above_ten_percent() -> None:
    just_over = fx.auto_call("nsa_prefill", fx.call_params(2048), {"auto": 1.12, "flex": 1.0})
    just_under = fx.auto_call("nsa_prefill", fx.call_params(8192), {"auto": 1.08, "flex": 1.0})
    out = rows(just_over + just_under)
    by_t = {r["T"]: r for r in out["rows"]}
    assert by_t[2048]["slow"] and not by_t[8192]["slow"]
    assert out["slow"] == [by_t[2048]["cell"]]
    # Rows read in T order within an op and class.
    assert [r["T"] for r in out["rows"]] == [2048, 8192]


def test_auto_faster_than_every_plan_is_not_slow_and_the_best_is_the_fastest_other() -> None:
    (row,) = rows(fx.auto_call("nsa_decode", fx.call_params(8192), {"auto": 0.5, "sdpa": 0.6, "flex": 0.55}))["rows"]
    assert row["best"]["plan"] == "flex" and row["ratio"] < 1 and not row["slow"]


def test_skipped_and_failed_plans_are_listed_with_reasons_and_never_best() -> None:
    (row,) = rows(fx.auto_call("nsa_prefill", fx.call_params(16384), {
        "auto": 9.0, "sdpa": 30.0, "triton-fa2win": 7.0, "flex": ("skipped", "flex needs dk == dv"),
        "triton": ("failed", "out of shared memory")}))["rows"]
    assert row["best"]["plan"] == "triton-fa2win" and row["slow"]
    assert row["skipped"] == [{"plan": "flex", "reason": "flex needs dk == dv"}]
    assert row["failed"] == [{"plan": "triton", "reason": "out of shared memory"}]
    flex = next(p for p in row["plans"] if p["plan"] == "flex")
    assert (flex["median_ms"], flex["peak_mem_bytes"], flex["status"]) == (None, None, "skipped")


@pytest.mark.parametrize(("plans", "note"), [
    ({"sdpa": 1.0, "flex": 1.1}, "no auto plan was timed"),
    ({"auto": ("failed", "boom"), "sdpa": 1.0}, "auto failed: boom"),
    ({"auto": 1.0, "flex": ("skipped", "no flex")}, "no other plan ran"),
])
def test_a_call_without_a_comparison_says_why_and_is_not_slow(plans: dict[str, Any], note: str) -> None:
    (row,) = rows(fx.auto_call("nsa_prefill", fx.call_params(4096), plans))["rows"]
    assert note in row["note"] and row["ratio"] is None and not row["slow"]


def test_classes_and_ops_are_separate_calls_and_other_suites_are_ignored() -> None:
    cases = fx.auto_call("nsa_prefill", fx.call_params(4096), {"auto": 1.0, "sdpa": 2.0})
    cases += fx.auto_call("nsa_prefill", fx.call_params(4096, Hq=16, Hkv=1), {"auto": 1.0, "sdpa": 2.0})
    cases += fx.auto_call("nsa_decode", fx.call_params(4096), {"auto": 1.0, "sdpa": 2.0})
    cases += fx.sweep("sliding", {4096: 2.0})
    out = rows(cases)
    assert [(r["op"], r["class"]) for r in out["rows"]] == [("nsa_decode", "g4"), ("nsa_prefill", "g4"),
                                                           ("nsa_prefill", "g16")]


def test_decide_carries_the_rows_and_keeps_the_auto_suite_out_of_sdpa_pairs() -> None:
    cases = fx.auto_call("nsa_prefill", fx.call_params(16384), {"auto": 9.0, "triton-fa2win": 7.0, "sdpa": 30.0})
    cases += fx.sweep("sliding", {4096: 2.0})
    doc = decision(cases)
    avb = doc["auto_vs_best"]
    assert avb["limit"] == 1.1 and len(avb["rows"]) == 1 and avb["slow"] == [avb["rows"][0]["cell"]]
    # The plan=sdpa case is not the baseline of the other plans: no auto case becomes a cell or unpaired.
    assert all(c["suite"] != "auto" for c in doc["cells"]) and doc["unpaired"] == []
    assert "auto vs best: 1 of 1 calls more than 10% slower than the best plan" in decide.summary_lines(doc)


def test_report_lists_slow_calls_first_then_the_full_table() -> None:
    cases = fx.auto_call("nsa_prefill", fx.call_params(4096), {"auto": 1.0, "flex": 1.02})
    cases += fx.auto_call("nsa_prefill", fx.call_params(16384), {"auto": 9.0, "triton-fa2win": 7.0})
    text = report.render_report(decision(cases))
    part = text[text.index("## Auto against the best plan"):text.index("## Device and versions")]
    slow_table, full_table = part.index("| slow call |"), part.index("| call | class |")
    assert slow_table < full_table and "1 of 2 calls are slow" in part
    slow_rows = part[slow_table:full_table]
    assert "T16384" in slow_rows and "T4096" not in slow_rows and "**1.29**" in slow_rows
    assert part.count("T4096") == 2  # the full table and the plan details, never the slow list
    summary = report.render_summary(decision(cases))
    assert "Auto vs best: 1 of 2 calls slow (auto more than 10% slower than the best plan; see report.md)." in summary


def test_report_says_none_when_no_call_is_slow_and_explains_a_missing_suite() -> None:
    text = report.render_report(decision(fx.auto_call("nsa_decode", fx.call_params(4096), {"auto": 1.0, "sdpa": 1.5})))
    assert "Slow calls: none." in text and "| slow call |" not in text
    text = report.render_report(decision(fx.sweep("sliding", {4096: 2.0})))
    assert "No `auto` suite cases in these results" in text
    assert "Auto vs best: no `auto` suite cases" in report.render_summary(decision(fx.sweep("sliding", {4096: 2.0})))
