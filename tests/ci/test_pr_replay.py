"""The committed sm90 runs replayed night by night: the threshold PR opens and closes only on covering
evidence, and never piles up (issue 34, item 1; the helper and its ledger: tests/ci/replay.py).

The runs are real H100 and H200 results (tests/data/ and results/). The replay's config sets the sm90 thresholds
to what those runs measure; a test then sets one value that they contradict, or K to 2 (the nightly
runs 1 and 2 agree where run 3 does not), so that a PR has a reason to open and close. The default
tests cut each night to one key's cells (`replay.only_key`) and skip the trend charts, so that they
take seconds; the `slow` test replays every committed sm90 file whole.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ci import config_edit, history_cmd, lasting, pr_plan, trends
from tests.ci import fixtures as fx
from tests.ci import replay

# What the committed sm90 runs measure (the values of configs/base.yaml at 6aef779); a test changes one.
SM90: dict[str, Any] = {
    "fa2_min_len_win": 256, "fa2_min_len_cmp": -1, "triton_min_len_sel": 512,
    "triton_min_len_win": {"g1": 512, "g2": 512, "g4": 2048, "g8": 4096, "g16": 1024},
    "triton_min_len_cmp": {"g1": 512, "g2": 512, "g4": 8192, "g8": 2048, "g16": 1024},
}
H100_FAST, H200_FAST = "h100/fast-full-fa3.json", "h200/fast-full.json"  # `fast` suite only: measure no key
SWEEP_1, SWEEP_2 = "h100/sm90-classes/nightly-sweep.json.gz", "h100/sm90-classes-2/nightly-sweep.json.gz"
RUN = "h100/nightly/run{}/results.json"


def config(history_runs: int | None = None, **sm90: Any) -> str:
    text = config_edit.edit_thresholds(fx.pristine_config_text(), "sm90", {**SM90, **sm90})
    if history_runs is not None:
        text = text.replace("history_runs: 3 ", f"history_runs: {history_runs} ", 1)
        assert replay.history_runs(text) == history_runs
    return text


def paths(*names: str) -> list[Path]:
    return [replay.find(n) for n in names]


@pytest.fixture
def no_charts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trend charts take most of a night's time under matplotlib and say nothing about the PR."""
    monkeypatch.setattr(trends, "write_trends", lambda *a, **k: [])


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # `ci history` must use the replay's folder store and never look for a GitHub token.
    for var in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_REPOSITORY", "GITHUB_OUTPUT", "NSA_HISTORY_DIR", "NSA_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@contextlib.contextmanager
def _replay(tmp: Path, text: str, keep: Any = None) -> Iterator[replay.Replay]:
    with replay.fake_github(text) as fake:
        yield replay.Replay(tmp, fake, text, keep=keep)


def test_the_issue_repro_on_recorded_runs(tmp_path: Path, no_charts: None) -> None:
    """sm90 fa2_min_len_cmp 4096, which every fa2 run contradicts (FA-2 never wins the compressed branch):
    the PR opens on the third covering H100 run (the H200 run agrees), a `fast`-only run on the H200
    and on the H100 leave it alone, and the next covering run updates the same PR (run 2 of the
    nightlies is left out to keep the test short)."""
    text = config(fa2_min_len_cmp=4096)
    with _replay(tmp_path, text, replay.only_key("fa2_min_len_cmp", classes=("g1",))) as r:
        r.run(paths("h200/nightly-fa2.json", SWEEP_1, SWEEP_2, RUN.format(1), H200_FAST, H100_FAST, RUN.format(3)))
        assert [n.outcome for n in r.nights] == ["outcome=none"] * 3 + ["outcome=created"] + ["outcome=none"] * 2 + [
            "outcome=updated"]
        assert [n.covered for n in r.nights if n.source.removesuffix(".xz").endswith(("fast-full-fa3.json", "fast-full.json"))] == [[], []]
        assert r.pr == {("fa2_min_len_cmp", "g1"): -1}
        assert len(r.fake.pulls) == 1 and r.numbers == [next(iter(r.fake.pulls))]


def test_a_change_the_next_covering_run_contradicts_closes_the_pr(tmp_path: Path, no_charts: None) -> None:
    """With K = 2, triton_min_len_cmp of class g4 (8192 in force): runs 1 and 2 of the nightlies (one
    commit, minutes apart) measure 16384 and open the PR; a `fast`-only run leaves it; run 3 measures
    512, so the change no longer lasts and the PR closes; run 4 measures 512 again and opens a new
    one, the only one open."""
    text = config(history_runs=2)
    with _replay(tmp_path, text, replay.only_key("triton_min_len_cmp", classes=("g4",))) as r:
        r.run(paths(RUN.format(1), RUN.format(2), H100_FAST, RUN.format(3), RUN.format(4)))
        assert [n.outcome.removeprefix("outcome=") for n in r.nights] == ["none", "created", "none", "closed",
                                                                           "created"]
        assert r.nights[1].expected == {("triton_min_len_cmp", "g4"): 16384}
        assert r.pr == {("triton_min_len_cmp", "g4"): 512}
        assert [p.state for p in r.fake.pulls.values()] == ["closed", "open"]


def _break(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    if rule == "history marks every entry covered":
        monkeypatch.setattr(history_cmd, "covers_grid", lambda entry: True)
    elif rule == "pr counts every entry as measured":
        monkeypatch.setattr(pr_plan, "_coverage", lambda branches: (
            [(b["key"], c) for b in branches.values() for c in (b.get("classes") or {})], []))
    else:  # the K-run rule: every change lasts at once
        real = lasting.hold
        monkeypatch.setattr(lasting, "hold", lambda entry, **kw: (True, "", real(entry, **kw)[2]))


@pytest.mark.parametrize("rule", ["history marks every entry covered", "pr counts every entry as measured"])
def test_the_replay_fails_when_a_run_that_measured_nothing_may_close_the_pr(
        tmp_path: Path, no_charts: None, monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    """With K = 1 the first covering run opens the PR; with the covering rule broken, the `fast`-only run
    after it closes the PR, and the replay must say so."""
    _break(monkeypatch, rule)
    text = config(history_runs=1, fa2_min_len_cmp=4096)
    with _replay(tmp_path, text, replay.only_key("fa2_min_len_cmp", classes=("g1",))) as r:
        with pytest.raises(AssertionError, match="a run that measured no key changed the PR"):
            r.run(paths(SWEEP_2, H100_FAST))
        assert [n.outcome for n in r.nights] == ["outcome=created", "outcome=closed"]


def test_the_replay_fails_when_a_change_need_not_last(tmp_path: Path, no_charts: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _break(monkeypatch, "the K-run rule")
    text = config(fa2_min_len_cmp=4096)
    with _replay(tmp_path, text, replay.only_key("fa2_min_len_cmp", classes=("g1",))) as r:
        with pytest.raises(AssertionError, match="PR #1 is open, but no change lasted 3 covering runs"):
            r.run(paths(SWEEP_1))


@pytest.mark.slow
def test_every_committed_sm90_run_whole(tmp_path: Path, no_charts: None) -> None:
    """All committed sm90 results (50 files, H100 and H200), oldest first and uncut, with K = 2 and the
    contradicted fa2_min_len_cmp of the first test: the ledger holds after every night."""
    text = config(history_runs=2, fa2_min_len_cmp=4096)
    nights = replay.committed("sm90")
    assert len(nights) >= 40
    with _replay(tmp_path, text) as r:
        r.run(nights)
        seen = [n.outcome.removeprefix("outcome=") for n in r.nights]
        assert {"created", "updated", "none"} <= set(seen), seen
        # A covering run took a change out of the open PR (run 3 of the nightlies, Triton compressed).
        assert any(set(a.expected) - set(b.expected) for a, b in itertools.pairwise(r.nights)), seen


def test_a_night_of_a_model_out_of_order_is_refused(tmp_path: Path, no_charts: None) -> None:
    with _replay(tmp_path, config(), replay.only_key("fa2_min_len_cmp")) as r:
        with pytest.raises(AssertionError, match="out of order"):
            r.run(paths(H100_FAST, "h100/fast-full.json"))

