"""Lasting decisions across runs and GPU models, and the gates on what evidence may decide."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci import gates, history
from ci.history_store import LocalHistoryStore
from ci.lasting import RunDecisions, from_history, lasting
from tests.ci import history_fixtures as hx

KEY = "fa2_min_len_win"
H100, H200 = "nvidia-h100-80gb-hbm3", "nvidia-h200"


def run(night: int, measured: int | None, prefix: str = "n", current: int = -1) -> RunDecisions:
    return RunDecisions(f"{prefix}{night:03d}", hx.day(night), [hx.entry(KEY, measured, current)])


def only(entries: list[dict]) -> dict:
    (e,) = entries
    return e


def test_a_change_needs_k_agreeing_runs_of_this_model() -> None:
    past: list[RunDecisions] = []
    outcomes = []
    for night in range(4):
        now = run(night, 2048)
        e = only(lasting(now, {H100: past}, 3, model=H100))
        outcomes.append((e["proposed"], e["changed"]))
        past.append(now)
    assert outcomes == [(-1, False), (-1, False), (2048, True), (2048, True)]
    first = only(lasting(run(0, 2048), {}, 3, model=H100))
    assert "only 1 of 3 runs so far on nvidia-h100-80gb-hbm3" in first["reason"]
    assert first["lasting"]["held"] is False and first["measured"] == 2048


def test_one_disagreeing_run_resets_the_streak_and_is_named() -> None:
    past = [run(0, 2048), run(1, 4096), run(2, 2048)]
    e = only(lasting(run(3, 2048), {H100: past}, 3, model=H100))
    assert (e["proposed"], e["changed"]) == (-1, False)
    assert "run n001 on nvidia-h100-80gb-hbm3 measured 4096" in e["reason"]
    assert only(lasting(run(4, 2048), {H100: [*past, run(3, 2048)]}, 3, model=H100))["changed"] is True


def test_h100_and_h200_disagreeing_at_short_lengths_never_flip_flop() -> None:
    # Replayed from real records: nights alternate between an H100 and an H200 of profile sm90; the
    # H100 measures 2048, the H200 4096. No run may propose, whichever model runs.
    store_runs: dict[str, list[RunDecisions]] = {H100: [], H200: []}
    proposals = []
    for night in range(8):
        model, value = (H100, 2048) if night % 2 == 0 else (H200, 4096)
        now = run(night, value, prefix=model[-4:])
        store_runs[model].append(now)
        e = only(lasting(now, store_runs, 3, model=model))
        proposals.append(e["changed"])
        if night >= 5:
            assert "measured" in e["reason"] and ("h200" in e["reason"] or "h100" in e["reason"])
    assert proposals == [False] * 8
    # Then both models measure 2048 for three runs each: the change holds everywhere and is proposed.
    for night in range(8, 15):
        model = H100 if night % 2 == 0 else H200
        now = run(night, 2048, prefix=model[-4:])
        store_runs[model].append(now)
        e = only(lasting(now, store_runs, 3, model=model))
        proposals.append(e["changed"])
    # The H200's 4096 of night 7 is among its latest 3 until night 13: only then does it hold in both.
    assert proposals[8:] == [False, False, False, False, False, True, True]
    assert "held in the last 3 runs on nvidia-h100-80gb-hbm3 and on nvidia-h200" in e["reason"]


def test_history_records_round_trip_through_a_store(tmp_path: Path) -> None:
    store = LocalHistoryStore(tmp_path, log=lambda _: None)
    for night in range(3):
        doc = hx.nightly(hx.H100_TRITON, night)
        store.save(history.build_record(doc, [hx.entry("triton_min_len_cmp", 8192)]))
    h200 = hx.nightly(hx.H200_FA2, 0)
    store.save(history.build_record(h200, [hx.entry(KEY, 2048)]))  # another suite: no triton entry
    runs = {slug: from_history(rs) for slug, rs in store.load_profile("sm90").items()}
    latest = runs[H100][-1]
    (e,) = lasting(latest, runs, 3, model=H100)  # this run is also in history: counted once
    assert (e["proposed"], e["changed"]) == (8192, True)
    assert [x["run"] for x in e["lasting"]["evidence"]] == [r.run_id for r in runs[H100]]


def test_unchanged_entries_pass_through() -> None:
    e = only(lasting(run(0, -1), {}, 3, model=H100))
    assert (e["proposed"], e["changed"], e["lasting"]["held"]) == (-1, False, None)
    with pytest.raises(ValueError, match="k must be at least 1"):
        lasting(run(0, 1), {}, 0, model=H100)


# -- gates -------------------------------------------------------------------------------------------
def cell(base_ms: float, cand_ms: float) -> dict:
    return {"baseline": {"median_ms": base_ms}, "candidate": {"median_ms": cand_ms}, "speedup": base_ms / cand_ms}


def test_launch_bound_needs_both_sides_under_the_floor() -> None:
    assert gates.launch_bound(cell(0.02, 0.01), 0.05)
    assert not gates.launch_bound(cell(0.2, 0.01), 0.05)
    assert not gates.launch_bound({"baseline": None, "candidate": {"median_ms": 0.01}}, 0.05)
    assert "launch-bound" in gates.excluded(cell(0.02, 0.01), 0.05, None)


def test_inside_noise_floor() -> None:
    assert gates.inside_noise(cell(1.0, 0.99), 0.02)
    assert not gates.inside_noise(cell(1.0, 0.8), 0.02)
    assert not gates.inside_noise(cell(1.0, 0.99), None)
    assert gates.excluded(cell(1.0, 0.5), 0.05, 0.02) == ""


def test_a_smoke_file_never_covers_the_decision_grid() -> None:
    smoke = hx.real("tests/data/h200x2/shard-smoke.json.xz")
    nightly = hx.real(hx.H200_FA2)
    grid = sorted({c["params"]["T"] for c in nightly["cases"] if c["suite"] == "fa2"})

    def lengths(doc: dict) -> set[int]:
        return {c["params"]["T"] for c in doc["cases"] if c["suite"] == "fa2" and c["status"] == "ok"}

    ok, why = gates.covers_grid(lengths(smoke), grid)
    assert not ok and "tested 0 of the 7 decision lengths" in why and "smoke" in why
    assert gates.covers_grid(lengths(nightly), grid) == (True, "")
    assert gates.covers_grid(lengths(nightly), [])[0] is False
