"""ci.decide on the triton_* keys: the same cells, statistics, margin and rule as the FA-2 keys."""

from __future__ import annotations

from typing import Any

from ci import decide, pr_plan
from nsa_contract import exits, keys
from tests.ci import fixtures as fx
from tests.ci.test_decide import cell, run


def triton(op: str, speedups: dict[int, float | str], **kw: Any) -> list[dict[str, Any]]:
    return fx.sweep(op, speedups, candidate="triton", suite="triton", **kw)


def test_selected_adopts_from_the_first_length_that_stays_adopted() -> None:
    doc = run(triton("selected", {1024: 0.7, 2048: 1.1, 4096: 1.8, 8192: 3.0, 16384: 6.0}))
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert [(x["T"], x["verdict"]) for x in sel["lengths"]] == [
        (1024, "reject"), (2048, "reject"), (4096, "adopt"), (8192, "adopt"), (16384, "adopt")]
    assert (sel["key"], sel["op"], sel["family"], sel["suite"]) == ("triton_min_len_sel", "selected", "triton",
                                                                     "triton")
    assert (sel["current"], sel["measured"], sel["proposed"], sel["changed"]) == (-1, 4096, 4096, True)
    assert sel["reason"].startswith("Triton cleared 1.2x at every tested length >= 4096")
    assert cell(doc, "selected", 8192, backend="triton", suite="triton")["used_for_decision"]
    assert doc["triton"] == {"ran": True, "reason": ""}
    # The FA-2 keys saw no FA-2 cell and keep their values.
    assert not doc["branches"]["win"]["classes"]["g4"]["changed"] and not doc["branches"]["cmp"]["classes"]["g4"]["changed"]
    assert doc["fa2"]["ran"] is False


def test_compressed_winner_at_short_lengths_only_gives_minus_one_and_says_where() -> None:
    doc = run(triton("compressed", fx.CMP_SHORT_WINS), fx.config(tcmp=1024))
    tcmp = doc["branches"]["triton_cmp"]["classes"]["g4"]
    assert (tcmp["current"], tcmp["measured"], tcmp["proposed"], tcmp["changed"]) == (1024, -1, -1, True)
    assert "Triton cleared 1.2x only at 256, 512, 1024, 2048" in tcmp["reason"]
    assert "so Triton stays off for this branch" in tcmp["reason"]


def test_every_triton_cell_rejected_gives_minus_one() -> None:
    doc = run(triton("selected", {1024: 0.5, 16384: 0.9}), fx.config(tsel=2048))
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert (sel["measured"], sel["proposed"], sel["changed"]) == (-1, -1, True)
    assert "Triton never cleared 1.2x" in sel["reason"]


def test_inconclusive_length_that_decides_keeps_the_current_value() -> None:
    doc = run(triton("selected", {1024: 0.6, 4096: "noisy", 16384: 5.0}), fx.config(tsel=16384))
    assert cell(doc, "selected", 4096, backend="triton", suite="triton")["verdict"] == "inconclusive"
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert (sel["measured"], sel["proposed"], sel["changed"]) == (None, 16384, False)
    assert "keeping 16384" in sel["reason"] and "4096 (inconclusive)" in sel["reason"]


def test_every_layout_must_adopt_at_a_length() -> None:
    cases = triton("compressed", {2048: 2.0, 8192: 3.0}) + triton("compressed", {2048: 1.0, 8192: 3.0}, B=4)
    tcmp = run(cases)["branches"]["triton_cmp"]["classes"]["g4"]
    assert [(x["T"], x["verdict"], len(x["cells"])) for x in tcmp["lengths"]] == [(2048, "reject", 2),
                                                                                   (8192, "adopt", 2),
                                                                                   (16384, "adopt", 2)]
    assert tcmp["proposed"] == 8192


def test_triton_parity_failure_fails_the_cell_and_the_run() -> None:
    cases = triton("selected", {1024: 3.0})
    cases += fx.pair("selected", fx.selected_params(4096), 3.0, candidate="triton", suite="triton",
                     candidate_parity=False)
    doc = run(cases)
    bad = cell(doc, "selected", 4096, backend="triton", suite="triton")
    assert bad["verdict"] == "failed" and doc["exit_code"] == exits.FAILED_CASES
    assert doc["branches"]["triton_sel"]["classes"]["g4"]["measured"] is None


def test_both_families_decide_the_compressed_branch_independently() -> None:
    cases = fx.sweep("compressed", {1024: 3.0, 8192: 0.6}) + triton("compressed", {1024: 0.8, 8192: 2.5})
    doc = run(cases, fx.config(cmp=1024))
    assert (doc["branches"]["cmp"]["classes"]["g4"]["proposed"], doc["branches"]["triton_cmp"]["classes"]["g4"]["proposed"]) == (-1, 8192)
    assert {c["branch"] for c in doc["cells"]} == {"cmp", "triton_cmp"}
    assert cell(doc, "compressed", 8192, backend="flash_attn")["branch"] == "cmp"
    assert cell(doc, "compressed", 8192, backend="triton", suite="triton")["branch"] == "triton_cmp"
    lines = decide.summary_lines(doc)
    # One line per key, in the order nsa_contract.keys declares them.
    assert [line.split(":")[0] for line in lines] == [f"{k.decision_id} sm90.{k.name}" for k in keys.KEYS]
    # Only class g4 was measured; the other classes keep what is in force (cmp: 1024 in every class).
    plan = pr_plan.build_plan(doc, "report", ())
    assert plan.changes == {"fa2_min_len_cmp": {"g1": 1024, "g2": 1024, "g4": -1, "g8": 1024, "g16": 1024},
                            "triton_min_len_cmp": {"g1": -1, "g2": -1, "g4": 8192, "g8": -1, "g16": -1}}
    assert "cmp 1024 -> {g1: 1024, g2: 1024, g4: -1, g8: 1024, g16: 1024}" in plan.title


def test_triton_cells_elsewhere_are_reported_not_used() -> None:
    # Only the deciding sweep is extended to the grid's end; the reported-only ones stop at 8192
    # (extended, the naive sweep's 16384 pair would repeat the sdpa case of the triton sweep).
    cases = triton("selected", {4096: 3.0})
    cases += triton("selected", {8192: 0.5}, sel_count=8, cover=False)
    cases += triton("selected", {8192: 0.5}, sel_block=32, cover=False)
    cases += triton("compressed", {8192: 0.5}, block=64, cover=False)
    cases += fx.sweep("selected", {8192: 0.5}, candidate="triton", suite="masked", cover=False)
    cases += fx.sweep("compressed", {8192: 0.5}, candidate="triton", cover=False)  # suite fa2
    cases += fx.sweep("selected", {8192: 0.5}, candidate="naive", suite="triton", cover=False)
    doc = run(cases)
    assert doc["branches"]["triton_sel"]["classes"]["g4"]["proposed"] == 4096
    assert doc["branches"]["triton_cmp"]["classes"]["g4"]["measured"] is None
    notes = sorted(c["note"] for c in doc["cells"] if not c["used_for_decision"])
    assert notes == ["l'=32, n=16 is not nsa.sel_block/sel_count 64/16",
                     "l'=64, n=8 is not nsa.sel_block/sel_count 64/16",
                     "l=64, d=16 is not nsa.cmp_block/cmp_stride 32/16",
                     "naive is not Triton; reported only",
                     "suite fa2 is reported only; suite triton decides",
                     "suite masked is reported only; suite triton decides"]


def test_skipped_triton_cases_keep_the_values_and_say_why() -> None:
    p = fx.selected_params(4096)
    reason = "the triton backend runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1), got cpu"
    cases = [fx.case("triton", "selected", "sdpa", p, 4.0),
             fx.case("triton", "selected", "triton", p, status="skipped", reason=reason)]
    doc = run(cases, fx.config(tsel=8192))
    assert doc["triton"]["ran"] is False and reason in doc["triton"]["reason"]
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert (sel["proposed"], sel["changed"]) == (8192, False) and "no threshold can be proposed" in sel["reason"]


def test_cpu_results_never_propose_triton_thresholds() -> None:
    doc = run(triton("selected", {4096: 3.0}), sm="cpu")
    assert doc["triton"]["ran"] is False and "CPU machine" in doc["triton"]["reason"]
    assert doc["branches"]["triton_sel"]["classes"]["g4"]["changed"] is False


def test_fa2_only_results_keep_the_triton_keys() -> None:
    doc = run(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    assert doc["branches"]["win"]["classes"]["g4"]["proposed"] == 2048
    for name in ("triton_sel", "triton_cmp", "triton_win"):
        b = doc["branches"][name]
        assert (b["current"], b["proposed"], b["changed"]) == (-1, -1, False)
        assert "suite triton did not run in these results" in b["reason"]
        assert all(e["measured"] is None and e["lengths"] == [] for e in b["classes"].values())


def test_config_without_triton_keys_decides_them_from_minus_one() -> None:
    cfg = {**fx.CONFIG, "runtime": {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1},
           "profiles": {"sm90": {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1}}}
    doc = run(triton("selected", {4096: 3.0}), cfg)
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert (sel["current"], sel["current_source"]) == (-1, "default (-1: triton_min_len_sel not set for sm90/g4)")
    assert (sel["proposed"], sel["changed"]) == (4096, True)


def test_profile_value_in_force_is_the_current_one() -> None:
    doc = run(triton("selected", {4096: 3.0}), fx.config(tsel=4096))
    sel = doc["branches"]["triton_sel"]["classes"]["g4"]
    assert (sel["current_source"], sel["changed"]) == ("config:profiles.sm90.triton_min_len_sel", False)
    assert "already in force" in sel["reason"]


def test_grid_in_the_decision_names_the_selection_parameters() -> None:
    doc = run(triton("selected", {4096: 3.0}))
    assert doc["grid"] == {"window": 512, "cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "sel_count": 16}
