"""ci.decide: cells, length verdicts and the threshold rule of docs/pipeline.md."""

from __future__ import annotations

from typing import Any

import pytest

from ci import decide
from ci.cells import length_verdict
from nsa_contract import exits
from tests.ci import fixtures as fx


def run(cases: list[dict[str, Any]], cfg: dict[str, Any] | None = None, sm: str = "sm90",
        margin: float | None = None) -> dict[str, Any]:
    conf = decide.DecideConfig.from_mapping(cfg or fx.config(), margin)
    return decide.decide([("r.json", fx.document(cases, sm=sm))], conf)


def cell(doc: dict[str, Any], op: str, T: int, backend: str = "flash_attn", suite: str = "fa2") -> dict[str, Any]:
    found = [c for c in doc["cells"] if c["op"] == op and c["T"] == T and c["candidate_backend"] == backend
             and c["suite"] == suite]
    assert len(found) == 1, found
    return found[0]


def test_clear_adopt_from_2048_is_proposed() -> None:
    doc = run(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    win = doc["branches"]["win"]["classes"]["g4"]
    assert [(x["T"], x["verdict"]) for x in win["lengths"]] == [
        (256, "reject"), (512, "reject"), (1024, "reject"), (2048, "adopt"), (4096, "adopt"), (8192, "adopt"),
        (16384, "adopt")]
    assert (win["current"], win["measured"], win["proposed"], win["changed"]) == (-1, 2048, 2048, True)
    assert cell(doc, "sliding", 4096)["ci_low"] > 1.2
    assert doc["exit_code"] == 0 and doc["schema"] == "nsa-decision/2" and doc["profile"] == "sm90"
    # Only class g4 (8 query / 2 KV heads) was measured: the other classes keep their value, so the
    # value to write names every class.
    branch = doc["branches"]["win"]
    assert branch["proposed"] == {"g1": -1, "g2": -1, "g4": 2048, "g8": -1, "g16": -1} and branch["changed"]
    assert branch["reason"].startswith("g4: FA-2 cleared 1.2x at every tested length >= 2048")
    assert all(not e["changed"] and "no deciding FA-2 cell of op sliding in class" in e["reason"]
               for c, e in branch["classes"].items() if c != "g4")
    # One entry per (key, class), keys in their declared order (nsa_contract.keys: the sliding keys first).
    assert [(e["key"], e["class"]) for e in doc["decisions"] if e["key"] == "fa2_min_len_win"] == [
        ("fa2_min_len_win", c) for c in doc["classes"]]
    assert [e["key"] for e in doc["decisions"]][::5] == [k["name"] for k in doc["keys"]]
    # No compressed cells: that branch keeps its value and says why, once for every class.
    cmp = doc["branches"]["cmp"]
    assert cmp["changed"] is False and cmp["proposed"] == -1
    assert "no deciding FA-2 cell of op compressed in any class" in cmp["reason"]
    assert "no deciding FA-2 cell of op compressed in class g4" in cmp["classes"]["g4"]["reason"]


def test_measured_value_already_in_force_is_not_a_proposal() -> None:
    doc = run(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048), fx.config(win=2048))
    win = doc["branches"]["win"]["classes"]["g4"]
    assert (win["measured"], win["proposed"], win["changed"]) == (2048, 2048, False)
    assert "already in force" in win["reason"]


def test_current_value_falls_back_to_runtime_without_profile() -> None:
    doc = run(fx.sweep("sliding", {1024: 3.0}), fx.config(win=4096, runtime=(8192, -1)), sm="sm89")
    win = doc["branches"]["win"]["classes"]["g4"]
    # The source names the config ("config" for a parsed mapping, the file's name for a file).
    assert (win["current"], win["current_source"]) == (8192, "config:runtime.fa2_min_len_win")
    assert (win["proposed"], win["changed"]) == (1024, True)
    doc = run(fx.sweep("sliding", {1024: 3.0}), fx.config(win=4096))
    assert doc["branches"]["win"]["classes"]["g4"]["current_source"] == "config:profiles.sm90.fa2_min_len_win"


def test_inconclusive_length_that_decides_keeps_current() -> None:
    doc = run(fx.sweep("sliding", {512: 0.5, 1024: 0.7, 2048: "noisy", 4096: 3.0, 8192: 6.0}), fx.config(win=4096))
    win = doc["branches"]["win"]["classes"]["g4"]
    assert cell(doc, "sliding", 2048)["verdict"] == "inconclusive"
    assert (win["measured"], win["proposed"], win["changed"]) == (None, 4096, False)
    assert "keeping 4096" in win["reason"] and "2048 (inconclusive)" in win["reason"]


def test_inconclusive_below_a_reject_does_not_decide() -> None:
    doc = run(fx.sweep("sliding", {256: "noisy", 512: 0.8, 1024: 2.0, 2048: 3.0}))
    assert cell(doc, "sliding", 256)["verdict"] == "inconclusive"
    assert doc["branches"]["win"]["classes"]["g4"]["proposed"] == 1024


def test_one_inconclusive_batch_size_stops_a_length() -> None:
    cases = (fx.sweep("sliding", {1024: 2.0, 2048: 3.0, 4096: 3.0}) +
             fx.sweep("sliding", {1024: 2.0, 2048: "noisy", 4096: 3.0}, B=4))
    doc = run(cases)
    lengths = {x["T"]: x for x in doc["branches"]["win"]["classes"]["g4"]["lengths"]}
    assert [lengths[t]["verdict"] for t in (1024, 2048, 4096, 16384)] == ["adopt", "inconclusive", "adopt", "adopt"]
    assert len(lengths[2048]["cells"]) == 2
    assert doc["branches"]["win"]["classes"]["g4"]["measured"] is None


def test_parity_failure_fails_the_cell_and_the_run_but_writes_everything() -> None:
    cases = fx.sweep("compressed", {256: 4.0, 1024: 3.0})
    cases += fx.pair("compressed", fx.compressed_params(4096), 3.0, candidate_parity=False)
    doc = run(cases)
    bad = cell(doc, "compressed", 4096)
    assert bad["verdict"] == "failed" and "parity failed" in bad["reason"]
    assert doc["exit_code"] == exits.FAILED_CASES
    assert [f["id"] for f in doc["failures"]] == [bad["id"]] and doc["failures"][0]["parity_failed"]
    cmp = doc["branches"]["cmp"]["classes"]["g4"]
    assert cmp["measured"] is None and "4096 (failed)" in cmp["reason"]


def test_parity_record_without_numbers_is_a_failure_with_its_detail() -> None:
    p = fx.sliding_params(4096)
    bad = {"max_abs_err": None, "rel_err": None, "tol": None, "passed": False, "detail": "output holds NaN"}
    cases = [fx.case("fa2", "sliding", "sdpa", p, 4.0),
             fx.case("fa2", "sliding", "flash_attn", p, status="failed", reason="parity failed", parity=bad)]
    doc = run(cases)
    assert cell(doc, "sliding", 4096)["reason"] == "candidate flash_attn parity failed: output holds NaN"
    assert doc["exit_code"] == 3 and doc["parity"][0]["max_abs_err"] is None
    bad.pop("detail")
    doc = run([cases[0], fx.case("fa2", "sliding", "flash_attn", p, status="failed", reason="x", parity=bad)])
    assert "max_abs_err —, rel_err —, tol —" in cell(doc, "sliding", 4096)["reason"]
    from ci import report
    assert "| — | — | — | **NO** |" in report.render_report(doc)


def test_failed_status_without_parity_error_does_not_exit_non_zero() -> None:
    cases = fx.sweep("sliding", {1024: 2.0}) + [
        fx.case("fa2", "sliding", "sdpa", fx.sliding_params(65536), status="failed", reason="CUDA out of memory"),
        fx.case("fa2", "sliding", "flash_attn", fx.sliding_params(65536), 1.0)]
    doc = run(cases)
    assert cell(doc, "sliding", 65536)["verdict"] == "failed"
    assert doc["exit_code"] == 0 and doc["failures"][0]["reason"] == "sdpa failed: CUDA out of memory"
    assert doc["branches"]["win"]["classes"]["g4"]["measured"] is None  # the failed top length decides


def test_every_cell_rejected_gives_minus_one() -> None:
    doc = run(fx.sweep("sliding", {1024: 0.5, 4096: 0.8, 16384: 0.9}), fx.config(win=2048))
    win = doc["branches"]["win"]["classes"]["g4"]
    assert (win["measured"], win["proposed"], win["changed"]) == (-1, -1, True)
    assert "never cleared" in win["reason"]
    assert run(fx.sweep("sliding", {1024: 0.5}))["branches"]["win"]["classes"]["g4"]["changed"] is False


def test_wins_only_at_short_lengths_gives_minus_one_and_says_where() -> None:
    doc = run(fx.sweep("compressed", fx.CMP_SHORT_WINS), fx.config(cmp=1024))
    cmp = doc["branches"]["cmp"]["classes"]["g4"]
    assert (cmp["measured"], cmp["proposed"], cmp["changed"]) == (-1, -1, True)
    assert "only at 256, 512, 1024, 2048" in cmp["reason"]


def test_dip_in_the_middle_proposes_above_the_dip_and_reports_the_early_wins() -> None:
    doc = run(fx.sweep("sliding", {256: 2.0, 512: 1.8, 1024: 0.9, 2048: 1.6, 4096: 3.0}))
    win = doc["branches"]["win"]["classes"]["g4"]
    assert win["proposed"] == 2048
    assert "also won at 256, 512, below the reject at 1024" in win["reason"]


def test_single_length() -> None:
    assert run(fx.sweep("sliding", {4096: 3.0}))["branches"]["win"]["classes"]["g4"]["proposed"] == 4096
    assert run(fx.sweep("sliding", {4096: 0.5}))["branches"]["win"]["classes"]["g4"]["proposed"] == -1


def test_no_fa2_backend_keeps_current_and_says_fa2_was_unavailable() -> None:
    only_sdpa = [fx.case("fa2", "sliding", "sdpa", fx.sliding_params(t)) for t in (1024, 4096)]
    doc = run(only_sdpa, fx.config(win=4096))
    assert doc["fa2"]["ran"] is False and "no flash_attn or torch_fa2 case" in doc["fa2"]["reason"]
    win = doc["branches"]["win"]["classes"]["g4"]
    assert (win["proposed"], win["changed"], win["measured"]) == (4096, False, None)
    assert "no threshold can be proposed" in win["reason"]


def test_skipped_fa2_cases_are_skipped_cells_with_their_reason() -> None:
    cases = [fx.case("fa2", "sliding", "sdpa", fx.sliding_params(2048)),
             fx.case("fa2", "sliding", "flash_attn", fx.sliding_params(2048), status="skipped",
                     reason="flash_attn is not installed")]
    doc = run(cases)
    c = cell(doc, "sliding", 2048)
    assert c["verdict"] == "skipped" and c["reason"] == "candidate flash_attn skipped: flash_attn is not installed"
    assert not c["used_for_decision"]
    assert doc["skips"] == [{"id": c["id"], "reason": "flash_attn is not installed"}]
    assert doc["fa2"]["ran"] is False and "flash_attn is not installed" in doc["fa2"]["reason"]
    assert doc["branches"]["win"]["classes"]["g4"]["changed"] is False


def test_cpu_machine_never_proposes() -> None:
    doc = run(fx.sweep("sliding", {4096: 3.0}), sm="cpu")
    assert doc["fa2"]["ran"] is False and "CPU machine" in doc["fa2"]["reason"]
    assert doc["branches"]["win"]["classes"]["g4"]["changed"] is False


def test_off_grid_other_backends_and_other_suites_are_reported_not_used() -> None:
    cases = fx.sweep("sliding", {2048: 3.0, 8192: 5.0})
    cases += fx.sweep("sliding", {2048: 0.5, 8192: 0.5}, window=256)
    cases += fx.sweep("sliding", {16384: 0.5}, suite="sweep")
    cases.append(fx.case("fa2", "sliding", "flex", fx.sliding_params(8192), 100.0))
    cases += fx.sweep("compressed", {4096: 0.5}, block=64) + fx.sweep("compressed", {4096: 3.0})
    doc = run(cases)
    assert doc["branches"]["win"]["classes"]["g4"]["proposed"] == 2048
    assert doc["branches"]["cmp"]["classes"]["g4"]["proposed"] == 4096
    used = {(c["op"], c["T"]) for c in doc["cells"] if c["used_for_decision"]}
    # fx.sweep extends each sweep to the decision grid's longest length (16384).
    assert used == {("sliding", 2048), ("sliding", 8192), ("sliding", 16384), ("compressed", 4096),
                    ("compressed", 16384)}
    notes = {c["note"] for c in doc["cells"] if not c["used_for_decision"]}
    assert notes == {"window 256 is not nsa.window 512", "suite sweep is reported only; suite fa2 decides",
                     "flex is not FA-2; reported only",
                     "l=64, d=16 is not nsa.cmp_block/cmp_stride 32/16"}
    assert cell(doc, "sliding", 8192, backend="flex")["verdict"] == "reject"


def test_margin_override_changes_the_verdict() -> None:
    cases = fx.sweep("sliding", {4096: 1.5})
    assert run(cases)["branches"]["win"]["classes"]["g4"]["proposed"] == 4096
    strict = run(cases, margin=2.0)
    assert strict["margin"] == 2.0 and strict["branches"]["win"]["classes"]["g4"]["proposed"] == -1


def test_too_few_samples_are_inconclusive() -> None:
    p = fx.sliding_params(4096)
    doc = run([fx.case("fa2", "sliding", "sdpa", p, 4.0, n=3), fx.case("fa2", "sliding", "flash_attn", p, 1.0, n=3)])
    c = cell(doc, "sliding", 4096)
    assert c["verdict"] == "inconclusive" and "only 3 samples" in c["reason"]


def test_calibration_noise_floor() -> None:
    cases = fx.calibration(2.0, 0.02) + fx.calibration(1.0, 0.2, T=2048) + fx.calibration(0.01, 0.9, T=64)
    cases += fx.calibration(0.5, 0.02, backend="flash_attn")
    doc = run(cases)
    assert doc["cells"] == []  # sdpa and flash_attn replicas were not timed against each other
    nf = doc["noise_floor"]
    assert len(nf["cases"]) == 4 and {r["backend"] for r in nf["cases"]} == {"sdpa", "flash_attn"}
    for row in nf["cases"]:
        assert row["ci_low"] <= row["speedup"] <= row["ci_high"]
        assert row["speedup"] == pytest.approx(row["median_a_ms"] / row["median_b_ms"])
    by_t = {r["id"].split("-")[1]: r for r in nf["cases"] if r["backend"] == "sdpa"}
    assert by_t["T64"]["counts"] is False and by_t["T2048"]["counts"] is True
    assert by_t["T2048"]["half_width"] > by_t["T4096"]["half_width"]
    assert nf["worst_half_width"] == by_t["T2048"]["half_width"] and nf["worst_case"] == by_t["T2048"]["id"]
    assert "replica" not in nf["worst_case"]
    assert run(fx.sweep("sliding", {1024: 2.0}))["noise_floor"]["worst_half_width"] is None


@pytest.mark.parametrize(("verdicts", "expected"), [
    (["adopt", "adopt"], "adopt"), (["adopt", "inconclusive"], "inconclusive"),
    (["failed", "inconclusive"], "failed"), (["failed", "reject"], "reject"),
    (["adopt", "skipped"], "adopt"), (["skipped"], "skipped"),
])
def test_length_verdict(verdicts: list[str], expected: str) -> None:
    assert length_verdict(verdicts) == expected


def test_results_from_two_architectures_are_refused() -> None:
    conf = decide.DecideConfig.from_mapping(fx.config())
    docs = [("a.json", fx.document(fx.sweep("sliding", {1024: 2.0}))),
            ("b.json", fx.document(fx.sweep("sliding", {2048: 2.0}), sm="sm89"))]
    with pytest.raises(decide.DecideError, match="must all come from one GPU architecture"):
        decide.decide(docs, conf)


def test_shards_merge_but_a_case_twice_is_refused() -> None:
    conf = decide.DecideConfig.from_mapping(fx.config())
    # Shard a stops short of the grid's end, shard b covers it: together they decide.
    a = fx.document(fx.sweep("sliding", {1024: 2.0}, cover=False))
    b = fx.document(fx.sweep("sliding", {2048: 2.0}))
    assert decide.decide([("a", a), ("b", b)], conf)["branches"]["win"]["classes"]["g4"]["proposed"] == 1024
    with pytest.raises(decide.DecideError, match="case ids must be unique across results files"):
        decide.decide([("a", a), ("a2", a)], conf)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda c: c["decide"].update(margin=-1), "decide.margin must be a finite number > 0, got -1"),
    (lambda c: c["decide"].update(margin=float("inf")), "decide.margin must be a finite number > 0, got inf"),
    (lambda c: c["decide"].update(confidence=95), "decide.confidence must be a number strictly between 0 and 1, "
                                                 "got 95"),
    (lambda c: c["nsa"].update(window=0), "nsa.window must be a positive int, got 0"),
    (lambda c: c["nsa"].update(windw=512), "nsa key nsa.windw is unknown; did you mean nsa.window?"),
    (lambda c: c["profiles"]["sm90"].update(fa2_min_len_win={"g3": 1}), "class 'g3' is unknown"),
])
def test_bad_config_is_explained(mutate: Any, match: str) -> None:
    cfg = {k: dict(v) for k, v in fx.config().items()}
    mutate(cfg)
    with pytest.raises(decide.DecideError, match=match):
        decide.DecideConfig.from_mapping(cfg)


def test_repository_config_loads() -> None:
    from pathlib import Path
    conf = decide.load_config(Path(__file__).resolve().parents[2] / "configs" / "base.yaml")
    assert (conf.margin, conf.confidence) == (1.2, 0.95)
    assert conf.grid == {"cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}


def test_a_missing_grid_field_takes_the_papers_value() -> None:
    """The one loader fills an absent nsa field with the paper's value (nsa_contract.settings.NSA_FIELDS)."""
    cfg = {k: dict(v) for k, v in fx.config().items()}
    del cfg["nsa"]["window"]
    assert decide.DecideConfig.from_mapping(cfg).grid["window"] == 512


def test_each_cell_says_what_auto_runs_under_the_config_in_force() -> None:
    """auto_backend is Settings.planned(op, class, T, profile): per class, from the key's length up."""
    cfg = fx.config()
    cfg["profiles"]["sm90"]["fa2_min_len_win"] = {"g4": 2048, "g16": -1}
    cfg["profiles"]["sm90"]["triton_min_len_win"] = {"g16": 4096}
    cases = fx.sweep("sliding", {1024: 2.0, 2048: 2.0}, cover=False)
    cases += fx.sweep("sliding", {2048: 2.0, 4096: 2.0}, Hq=16, Hkv=1, cover=False)
    doc = run(cases, cfg)
    got = {(c["cls"], c["T"]): (c["auto_backend"], c["auto_why"]) for c in doc["cells"]}
    assert got[("g4", 1024)] == ("sdpa", "no sliding key holds at 1024 in g4")
    assert got[("g4", 2048)] == ("fa2", "fa2_min_len_win[g4]=2048 <= 2048")
    assert got[("g16", 2048)][0] == "sdpa"
    assert got[("g16", 4096)] == ("triton", "triton_min_len_win[g16]=4096 <= 4096")
    # The decision names the class's own value in force, and each length its class.
    g16 = doc["branches"]["win"]["classes"]["g16"]
    assert (g16["current"], g16["current_source"]) == (-1, "config:profiles.sm90.fa2_min_len_win.g16")
    assert {x["class"] for x in g16["lengths"]} == {"g16"}


def test_a_launch_bound_cell_decides_nothing() -> None:
    cases = fx.sweep("sliding", {1024: 3.0}, sdpa_ms=0.02)  # both sides under decide.time_floor_ms
    doc = run(cases)
    assert not any(c["used_for_decision"] for c in doc["cells"])
    assert all("launch-bound" in c["note"] for c in doc["cells"])
    assert doc["branches"]["win"]["changed"] is False and doc["time_floor_ms"] == 0.1


def test_an_adopted_threshold_extends_down_over_launch_bound_lengths_only() -> None:
    # 512 and 1024 are launch-bound (both sides under 0.1 ms, even where FA-2 "loses"): they decide
    # nothing, so the threshold adopted from 2048 extends down to 512, and the reason says so.
    cases = fx.sweep("sliding", {512: 0.6, 1024: 0.8}, sdpa_ms=0.05, cover=False)
    cases += fx.sweep("sliding", {2048: 3.0, 4096: 3.0, 8192: 3.0})
    win = run(cases)["branches"]["win"]["classes"]["g4"]
    assert win["proposed"] == 512 and "extended down to 512 over the launch-bound lengths 512, 1024" in win["reason"]
    assert [(x["T"], x["verdict"]) for x in win["lengths"]][:2] == [(512, "launch-bound"), (1024, "launch-bound")]
    # A deciding reject below stops the extension at the reject.
    cases = fx.sweep("sliding", {256: 0.5}, cover=False) + fx.sweep("sliding", {1024: 0.8}, sdpa_ms=0.05, cover=False)
    cases += fx.sweep("sliding", {2048: 3.0, 4096: 3.0, 8192: 3.0})
    win = run(cases)["branches"]["win"]["classes"]["g4"]
    assert win["proposed"] == 1024


def test_a_class_short_of_the_decision_grid_keeps_its_value_while_another_decides() -> None:
    cases = fx.sweep("sliding", {2048: 3.0, 4096: 3.0}, cover=False)  # g4 stops at 4096: a smoke run
    cases += fx.sweep("sliding", {1024: 3.0}, Hq=16, Hkv=1)  # g16 reaches 16384
    win = run(cases)["branches"]["win"]
    assert win["classes"]["g4"]["proposed"] == -1 and "does not cover the decision grid" in win["classes"]["g4"]["reason"]
    assert win["classes"]["g16"]["proposed"] == 1024
    assert win["proposed"] == {"g1": -1, "g2": -1, "g4": -1, "g8": -1, "g16": 1024}


def _host(cases: list, lengths: set[int], factor: float) -> list:
    """Give the cases at `lengths` a host enqueue time of `factor` x their median (bench.timing)."""
    for c in cases:
        if c["params"]["T"] in lengths:
            c["timing"]["host_ms"] = c["timing"]["median_ms"] * factor
    return cases


def test_host_bound_cells_are_launch_bound_and_the_value_in_force_among_them_stays() -> None:
    # The H100 nightlies: Triton compressed at G = 1 from 512 to 4096 timed 0.12-0.16 ms on both sides
    # with 0.2 ms of host enqueue time, so the host ranked them; 8192 and up adopted. With the value in
    # force (512) among those launch-bound lengths, nothing proposes a change.
    cfg = fx.config()
    cfg["profiles"]["sm90"]["fa2_min_len_win"] = 512
    cases = _host(fx.sweep("sliding", {512: 0.8, 1024: 0.9, 2048: 0.9}, sdpa_ms=0.15, cover=False),
                  {512, 1024, 2048}, 1.3)
    cases += fx.sweep("sliding", {4096: 3.0, 8192: 3.0})
    doc = run(cases, cfg)
    win = doc["branches"]["win"]["classes"]["g4"]
    notes = {c["T"]: c["note"] for c in doc["cells"] if c["T"] <= 2048}
    assert all(n.startswith("launch-bound: on both sides the host") for n in notes.values()), notes
    assert [(x["T"], x["verdict"]) for x in win["lengths"]][:3] == [
        (512, "launch-bound"), (1024, "launch-bound"), (2048, "launch-bound")]
    assert win["proposed"] == 512 and win["changed"] is False
    assert "the value in force 512 lies in the launch-bound lengths 512, 1024, 2048" in win["reason"]


def test_a_value_in_force_below_the_launch_bound_lengths_still_moves_up_to_them() -> None:
    # Off (-1) or under the lowest launch-bound length, the value is contradicted by nothing only down
    # to that length: the extension proposes it, as before host times were recorded.
    cases = _host(fx.sweep("sliding", {1024: 0.9, 2048: 0.9}, sdpa_ms=0.15, cover=False), {1024, 2048}, 1.3)
    cases += fx.sweep("sliding", {4096: 3.0, 8192: 3.0})
    win = run(cases)["branches"]["win"]["classes"]["g4"]
    assert win["proposed"] == 1024 and "extended down to 1024" in win["reason"]


def test_one_host_bound_side_still_decides() -> None:
    # The candidate waits on the host but masked SDPA is GPU-bound (the FA-2 side of a long cell):
    # the comparison is real, and it rejects.
    cases = fx.sweep("sliding", {2048: 0.5, 4096: 0.5, 8192: 0.5}, sdpa_ms=0.3)
    for c in cases:
        if c["backend"] != "sdpa":
            c["timing"]["host_ms"] = c["timing"]["median_ms"] * 2
        else:
            c["timing"]["host_ms"] = c["timing"]["median_ms"] * 0.2
    doc = run(cases)
    assert all(c["used_for_decision"] for c in doc["cells"])
    assert doc["branches"]["win"]["classes"]["g4"]["proposed"] == -1
