"""The threshold PR opens and closes only on covering evidence (issue 34, item 1).

Night after night, the real `ci decide`, `ci history` (a folder store) and `ci pr` against the fake
GitHub: sm90's `fa2_min_len_cmp` is 4096, a value every fa2 run contradicts. Three agreeing nightlies
open the PR; a run that never measured the key (a `fast`-only dispatch, an H200 `fast` run) must
leave it alone, and the next fa2 run updates the same PR.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from github import GithubRetry

from ci import config_edit
from ci.__main__ import main as ci_main
from ci.github import connect
from ci.pr_cmd import run_pr
from nsa_contract import results
from tests.ci import fixtures as fx
from tests.ci.fake_github import FakeGitHub

TOKEN = "ghs_FAKE0123456789abcdefEVIDENCE"
BRANCH = "nsa-thresholds/sm90"
CMP_ADOPT_FROM_1024 = {256: 0.5, 512: 0.8, 1024: 2.0, 2048: 2.5, 4096: 3.0, 8192: 3.0, 16384: 3.0}


def fa2_night(*ops: str) -> list[dict[str, Any]]:
    """An fa2 run: the compressed sweep contradicts 4096 (FA-2 wins only short: -1); the window adopts from 2048."""
    sweeps = {"compressed": fx.CMP_SHORT_WINS, "sliding": fx.WIN_ADOPT_FROM_2048}
    return [c for op in ops for c in fx.sweep(op, sweeps[op])]


def fast_night() -> list[dict[str, Any]]:
    """A `fast`-only run: NSA calls at the paper layout, no fa2 or triton cell."""
    return [fx.case("fast", "nsa_prefill", "triton", fx.call_params(T), 0.001 * T) for T in (16384, 65536)]


class Replay:
    def __init__(self, tmp: Path, fake: FakeGitHub, config: str) -> None:
        self.tmp, self.fake, self.n = tmp, fake, 0
        self.config = tmp / "configs" / "base.yaml"
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config, encoding="utf-8")
        (tmp / "report").mkdir()
        (tmp / "report" / "report.md").write_text("# Report\n", encoding="utf-8")

    def night(self, cases: Sequence[dict[str, Any]], gpu_name: str | None = None) -> str:
        """decide, history and pr on one night's results; returns `ci pr`'s outcome line."""
        self.n += 1
        doc = fx.document(cases, run_extra={"id": f"run-{self.n:04d}", "created_at": f"2026-03-{self.n:02d}T03:00:00Z"})
        if gpu_name:
            doc["machine"]["gpu_name"] = gpu_name
        res = str(results.dump(results.check(doc), self.tmp / f"r{self.n}.json"))
        decision, config = str(self.tmp / "out" / "decision.json"), str(self.config)
        assert ci_main(["decide", "--results", res, "--config", config, "--out", decision]) == 0
        # No token in the environment: history reads and saves the folder store, the issue is a dry run.
        # Exit 4 (a case slower than its history) still rewrites the decision, and the PR still runs.
        assert ci_main(["history", "--results", res, "--decision", decision, "--config", config,
                        "--history-dir", str(self.tmp / "store"), "--out-dir", str(self.tmp / "out" / "h")]) in (0, 4)
        out, err = io.StringIO(), io.StringIO()
        rc = run_pr(["--decision", decision, "--report-dir", str(self.tmp / "report"), "--out-dir",
                     str(self.tmp / "out" / "pr")],
                    env={"GITHUB_API_URL": self.fake.api_url, "GITHUB_REPOSITORY": "octo/nsa", "GITHUB_TOKEN": TOKEN},
                    out=out, err=err, connector=lambda t: connect(
                        t, retry=GithubRetry(total=2, backoff_factor=0, max_rate_limit_wait=1), pace=False, timeout=5))
        assert rc == 0, err.getvalue()
        return out.getvalue().split()[0]

    def branch_config(self) -> str:
        return self.fake.files_at(BRANCH)["configs/base.yaml"].decode()


def _config(**sm90: int) -> str:
    return config_edit.edit_thresholds(fx.pristine_config_text(), "sm90", sm90)


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    yield from _fake(_config(fa2_min_len_cmp=4096))


def _fake(config: str) -> Iterator[FakeGitHub]:
    with FakeGitHub({"configs/base.yaml": config.encode(), "README.md": b"# nsa\n"}, token=TOKEN) as server:
        yield server


def test_a_run_that_never_measured_the_key_leaves_its_pr_alone(tmp_path: Path, fake: FakeGitHub) -> None:
    replay = Replay(tmp_path, fake, _config(fa2_min_len_cmp=4096))
    assert [replay.night(fa2_night("compressed")) for _ in range(3)] == ["outcome=none"] * 2 + ["outcome=created"]
    (pr,) = fake.open_pulls()
    assert "cmp 4096 -> {g1: 4096, g2: 4096, g4: -1, g8: 4096, g16: 4096}" in pr.title
    head = fake.refs[f"heads/{BRANCH}"]
    # A fast-only dispatch on the H100, then an H200 fast run (same sm90 profile): neither measured the key.
    assert replay.night(fast_night()) == "outcome=none"
    assert replay.night(fast_night(), gpu_name="NVIDIA H200") == "outcome=none"
    assert pr.state == "open" and pr.comments == [] and fake.refs[f"heads/{BRANCH}"] == head
    decision = json.loads((tmp_path / "out" / "decision.json").read_text())
    assert {e["lasting"]["covered"] for e in decision["decisions"]} == {False}
    # The next fa2 run: its streak of K covering runs still holds, so the same PR is updated.
    assert replay.night(fa2_night("compressed")) == "outcome=updated"
    assert [(p.number, p.state) for p in fake.pulls.values()] == [(pr.number, "open")]


def test_a_partial_run_keeps_the_changes_it_did_not_measure(tmp_path: Path) -> None:
    for fake in _fake(_config()):
        replay = Replay(tmp_path, fake, _config())
        both = [*fa2_night("sliding"), *fx.sweep("compressed", CMP_ADOPT_FROM_1024)]
        assert [replay.night(both) for _ in range(3)][-1] == "outcome=created"
        (pr,) = fake.open_pulls()
        win = "fa2_min_len_win: {g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}"
        cmp = "fa2_min_len_cmp: {g1: -1, g2: -1, g4: 1024, g8: -1, g16: -1}"
        assert win in replay.branch_config() and cmp in replay.branch_config()
        # Only the window measured: the compressed change stays in the PR.
        assert replay.night(fa2_night("sliding")) == "outcome=updated"
        assert win in replay.branch_config() and cmp in replay.branch_config()
        assert "cmp -1 -> {g1: -1, g2: -1, g4: 1024" in pr.title
        # Only the compressed branch measured, and FA-2 no longer wins there: that change goes, the window's stays.
        assert replay.night(fa2_night("compressed")) == "outcome=updated"
        assert win in replay.branch_config() and "fa2_min_len_cmp: -1" in replay.branch_config()
        assert [p.number for p in fake.pulls.values()] == [pr.number]
