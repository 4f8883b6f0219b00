"""End-to-end tests of ``python -m ci pr`` against the local fake GitHub (no network leaves the host)."""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from github import GithubRetry
from urllib3 import HTTPResponse

from ci.github import MAX_WAIT_S, CappedRetry, Secret, Target, connect, production_retry
from ci.pr_cmd import run_pr
from tests.ci.fake_github import FakeGitHub, Pull

TOKEN = "ghs_FAKE0123456789abcdefTOKEN"
BRANCH = "nsa-thresholds/sm90"
GOLDEN = Path(__file__).parent / "golden"
BASE_CONFIG = (GOLDEN / "config_base.yaml").read_bytes()
TESTED = (1024, 2048, 4096, 8192)  # the lengths every fixture branch was "measured" at
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def decision(win: tuple[int, int] = (-1, 4096), cmp: tuple[int, int] = (-1, -1)) -> dict[str, Any]:
    def branch(key: str, current: int, proposed: int) -> dict[str, Any]:
        return {
            "key": key,
            "current": current,
            "proposed": proposed,
            "changed": proposed != current,
            "reason": f"measured {proposed}",
            "lengths": [{"T": t, "verdict": "adopt", "cells": []} for t in TESTED],
            # As `ci history` leaves it: the change lasted K runs, and this run measured the key.
            "lasting": lasting(proposed != current),
        }

    return {
        "schema": "nsa-decision/2",
        "profile": "sm90",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "branches": {"win": branch("fa2_min_len_win", *win), "cmp": branch("fa2_min_len_cmp", *cmp)},
        "exit_code": 0,
        "cells": [],
        "failures": [],
        "history": {"k": 3, "model": "nvidia-h100-80gb-hbm3"},
    }


def lasting(changed: bool = True, covered: bool = True) -> dict[str, Any]:
    """An entry's `lasting` as `ci history` writes it."""
    return {"k": 3, "held": True if changed else None, "raw": None, "covered": covered}


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    files = {"configs/base.yaml": BASE_CONFIG, "README.md": b"# nsa\n"}
    with FakeGitHub(files, token=TOKEN) as server:
        yield server


class Runner:
    """Writes the inputs and runs ``ci pr`` in-process with a fast, small-retry client."""

    def __init__(self, tmp: Path, fake: FakeGitHub) -> None:
        self.tmp, self.fake = tmp, fake
        self.output = tmp / "github_output"
        self.env = {
            "GITHUB_API_URL": fake.api_url,
            "GITHUB_REPOSITORY": "octo/nsa",
            "GITHUB_TOKEN": TOKEN,
            "GITHUB_OUTPUT": str(self.output),
        }
        self.retry: Any = GithubRetry(total=2, backoff_factor=0, max_rate_limit_wait=1)
        self.report = "# Report\n\n![speedup](speedup_win.png)\n"
        self.plots = {"speedup_win.png": PNG}
        self.links: dict[str, Path] = {}  # name in the report folder -> the file its symlink points at

    def __call__(self, doc: dict[str, Any], *extra: str) -> tuple[int, str, str]:
        report_dir = self.tmp / "report"
        report_dir.mkdir(exist_ok=True)
        for old in report_dir.iterdir():
            old.unlink()
        (report_dir / "report.md").write_text(self.report, encoding="utf-8")
        for name, content in self.plots.items():
            (report_dir / name).write_bytes(content)
        for name, target in self.links.items():
            (report_dir / name).symlink_to(target)
        (self.tmp / "decision.json").write_text(json.dumps(doc), encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        argv = [
            "--decision",
            str(self.tmp / "decision.json"),
            "--report-dir",
            str(report_dir),
            "--out-dir",
            str(self.tmp / "pr"),
            *extra,
        ]
        rc = run_pr(
            argv,
            env=self.env,
            out=out,
            err=err,
            connector=lambda target: connect(target, retry=self.retry, pace=False, timeout=5),
        )
        text_out, text_err = out.getvalue(), err.getvalue()
        assert TOKEN not in text_out + text_err
        return rc, text_out, text_err

    def outputs(self) -> list[str]:
        return self.output.read_text().splitlines() if self.output.exists() else []


@pytest.fixture
def run(tmp_path: Path, fake: FakeGitHub) -> Runner:
    return Runner(tmp_path, fake)


def config_diff(fake: FakeGitHub, ref: str) -> list[tuple[str, str]]:
    old = fake.files_at("main")["configs/base.yaml"].decode().splitlines(keepends=True)
    new = fake.files_at(ref)["configs/base.yaml"].decode().splitlines(keepends=True)
    assert len(old) == len(new)
    return [(a, b) for a, b in zip(old, new, strict=True) if a != b]


def test_outcome_sequence(run: Runner, fake: FakeGitHub) -> None:
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=created" in out
    (pr,) = fake.open_pulls()
    assert pr.head == BRANCH and pr.base == "main"
    assert pr.title == "NSA thresholds for NVIDIA H100 80GB HBM3 (sm90): win -1 -> 4096, cmp -1 (unchanged)"
    assert sorted(pr.labels) == ["nsa-thresholds", "profile:sm90"]
    head = fake.refs[f"heads/{BRANCH}"]
    assert f"{fake.html_url}/raw/{head}/reports/sm90/speedup_win.png" in pr.body
    assert run.outputs() == ["outcome=created", f"pr_url={fake.html_url}/pull/{pr.number}"]
    assert fake.commits[head]["parents"] == [fake.refs["heads/main"]]

    run.report = "# Report, second run\n"
    run.plots = {}
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=updated" in out
    assert [p.number for p in fake.open_pulls()] == [pr.number]
    assert pr.body == "# Report, second run\n"
    # Rebuilt from base: the plot of the first run is gone, nothing of the first commit is kept.
    assert "reports/sm90/speedup_win.png" not in fake.files_at(BRANCH)
    assert fake.commits[fake.refs[f"heads/{BRANCH}"]]["parents"] == [fake.refs["heads/main"]]

    rc, out, _ = run(decision(win=(-1, -1)))
    assert rc == 0 and "outcome=closed" in out
    assert fake.open_pulls() == [] and pr.state == "closed"
    assert "no longer needed" in pr.comments[-1]
    assert f"heads/{BRANCH}" not in fake.refs

    rc, out, _ = run(decision(win=(-1, -1)))
    assert rc == 0 and out.strip() == "outcome=none"
    assert run.outputs()[-2:] == ["outcome=none", "pr_url="]
    assert len(fake.pulls) == 1
    assert json.loads((run.tmp / "pr" / "pr.json").read_text())["outcome"] == "none"


def test_commit_changes_only_threshold_lines_and_report(run: Runner, fake: FakeGitHub) -> None:
    assert run(decision(win=(-1, 4096), cmp=(-1, 2048)))[0] == 0
    base, branch = fake.files_at("main"), fake.files_at(BRANCH)
    assert set(branch) - set(base) == {"reports/sm90/report.md", "reports/sm90/speedup_win.png"}
    assert {p for p in base if base[p] != branch.get(p)} == {"configs/base.yaml"}
    assert config_diff(fake, BRANCH) == [
        ("    fa2_min_len_win: -1\n", "    fa2_min_len_win: 4096\n"),
        ("    fa2_min_len_cmp: -1\n", "    fa2_min_len_cmp: 2048\n"),
    ]
    assert branch["configs/base.yaml"] == (GOLDEN / "config_base.sm90.expected.yaml").read_bytes()
    assert branch["reports/sm90/speedup_win.png"] == PNG
    diff = (run.tmp / "pr" / "config.diff").read_text()
    assert "+    fa2_min_len_win: 4096" in diff and "+    fa2_min_len_cmp: 2048" in diff


def test_rerun_without_change_pushes_nothing(run: Runner, fake: FakeGitHub) -> None:
    assert run(decision())[0] == 0
    head = fake.refs[f"heads/{BRANCH}"]
    del fake.log[:]
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=updated" in out
    assert fake.refs[f"heads/{BRANCH}"] == head
    assert not [w for w in fake.writes() if "/git/refs" in w[1] or "/git/commits" in w[1]]


def test_base_already_has_the_values(run: Runner, fake: FakeGitHub) -> None:
    """A decision made before its PR was merged proposes nothing new against the current base."""
    assert run(decision())[0] == 0
    merged = BASE_CONFIG.replace(
        b"  sm90:   # Hopper: H100, H200\n    fa2_min_len_win: -1",
        b"  sm90:   # Hopper: H100, H200\n    fa2_min_len_win: 4096",
    )
    fake.commit_files("main", {**fake.files_at("main"), "configs/base.yaml": merged}, "merge")
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=closed" in out
    assert run(decision())[1].strip() == "outcome=none"


def test_base_option_and_ghe_prefix(run: Runner, fake: FakeGitHub) -> None:
    fake.commit_files("release", fake.files_at("main"), "branch off", parents=[])
    rc, out, _ = run(decision(), "--base", "release")
    assert rc == 0 and "outcome=created" in out
    assert fake.open_pulls()[0].base == "release"
    assert all(path.startswith("/api/v3/") for _, path, _ in fake.log)


def test_duplicate_open_prs_are_collapsed(run: Runner, fake: FakeGitHub) -> None:
    assert run(decision())[0] == 0
    first = fake.open_pulls()[0]

    fake.pulls[99] = Pull(99, BRANCH, "main", "dup", "dup")  # left by some earlier bug
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=updated" in out
    assert [p.number for p in fake.open_pulls()] == [first.number]
    assert "Superseded" in fake.pulls[99].comments[0]


@pytest.mark.parametrize("retry", ["retrying", "no-retry"])
def test_5xx_after_create_never_duplicates(run: Runner, fake: FakeGitHub, retry: str) -> None:
    """GitHub created the PR but answered 500: a retried POST (or our own look) must find it."""
    if retry == "no-retry":
        run.retry = 0
    fake.fail("POST", r"/pulls$", 500, after=True)
    rc, out, err = run(decision())
    assert rc == 0 and "outcome=created" in out
    assert len(fake.pulls) == 1 and len(fake.open_pulls()) == 1
    assert "found PR #1 after a failed create" in err
    posts = [w for w in fake.writes() if w[0] == "POST" and w[1].endswith("/pulls")]
    assert [status for *_, status in posts] == ([500, 422] if retry == "retrying" else [500])
    assert run(decision())[1].startswith("outcome=updated")
    assert len(fake.pulls) == 1


def test_403_on_create_leaves_state_a_rerun_repairs(run: Runner, fake: FakeGitHub) -> None:
    fake.fail("POST", r"/pulls$", 403, message="Resource not accessible by integration")
    rc, out, err = run(decision())
    assert rc == 1 and "outcome" not in out
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: GitHub answered 403 for POST /repos/octo/nsa/pulls")
    assert "pull-requests: write" in line and "GitHub App token" in line
    assert f"heads/{BRANCH}" in fake.refs and fake.pulls == {}
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=created" in out and len(fake.pulls) == 1


def test_push_failure_then_nothing_to_change_cleans_the_branch(run: Runner, fake: FakeGitHub) -> None:
    run.retry = 0
    fake.fail("POST", r"/pulls$", 502)
    assert run(decision())[0] == 1
    assert f"heads/{BRANCH}" in fake.refs
    rc, out, _ = run(decision(win=(-1, -1)))
    assert rc == 0 and out.strip() == "outcome=none"
    assert f"heads/{BRANCH}" not in fake.refs


def test_422_on_ref_create(run: Runner, fake: FakeGitHub) -> None:
    fake.fail("POST", r"/git/refs$", 422, message="Reference update failed: protected by a ruleset")
    rc, _, err = run(decision())
    assert rc == 1
    assert "GitHub answered 422 for POST /repos/octo/nsa/git/refs (Reference update failed" in err
    assert fake.pulls == {} and f"heads/{BRANCH}" not in fake.refs
    assert run(decision())[0] == 0 and len(fake.open_pulls()) == 1


def test_failed_close_is_repaired_by_rerun(run: Runner, fake: FakeGitHub) -> None:
    assert run(decision())[0] == 0
    run.retry = 0
    fake.fail("PATCH", r"/pulls/\d+$", 500)
    rc, _, err = run(decision(win=(-1, -1)))
    assert rc == 1 and "GitHub answered 500 for PATCH" in err and "rerun later" in err
    assert len(fake.open_pulls()) == 1
    rc, out, _ = run(decision(win=(-1, -1)))
    assert rc == 0 and "outcome=closed" in out and fake.open_pulls() == []


def test_bad_token_is_never_shown(run: Runner, fake: FakeGitHub, capsys: pytest.CaptureFixture[str]) -> None:
    fake.token = "ghs_the_right_one"  # the fake echoes the rejected credential in its message
    rc, out, err = run(decision())
    assert rc == 1
    assert "GitHub answered 401 for GET /repos/octo/nsa" in err and "GITHUB_TOKEN" in err
    assert "***" in err
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    assert run.outputs() == []


def test_token_wrappers_hide_the_token() -> None:
    secret = Secret(TOKEN)
    target = Target("https://api.github.com", "o/r", secret)
    assert TOKEN not in repr(secret) + str(secret) + repr(target) + str(target)
    assert secret.scrub(f"x {TOKEN} y") == "x *** y"


def test_rate_limit(run: Runner, fake: FakeGitHub) -> None:
    reset = int(time.time()) + 3600
    fake.fail(
        "GET",
        r"/pulls$",
        403,
        message="API rate limit exceeded for installation ID 1.",
        headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)},
        times=5,
    )
    rc, _, err = run(decision())
    assert rc == 1
    assert "GitHub answered 403 for GET /repos/octo/nsa/pulls" in err
    assert "rate limit is exhausted (resets at" in err and "rerun after the reset" in err
    assert fake.writes() == []


def test_unknown_repository(run: Runner) -> None:
    run.env["GITHUB_REPOSITORY"] = "octo/missing"
    rc, _, err = run(decision())
    assert rc == 1 and "GitHub answered 404 for GET /repos/octo/missing" in err
    assert "check GITHUB_REPOSITORY" in err


def test_unreachable_api(run: Runner) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run.env["GITHUB_API_URL"] = f"http://127.0.0.1:{port}/api/v3"
    run.retry = 0
    rc, _, err = run(decision())
    assert rc == 1 and "could not reach GitHub at http://127.0.0.1:" in err and "GITHUB_API_URL" in err
    assert len(err.strip().splitlines()) == 1


def test_label_failure_only_warns(run: Runner, fake: FakeGitHub) -> None:
    fake.fail("POST", r"/labels$", 403, message="Resource not accessible by integration", times=10)
    rc, out, err = run(decision())
    assert rc == 0 and "outcome=created" in out
    assert "warning: labels not set" in err


def test_missing_profile_on_base_is_an_input_error(run: Runner, fake: FakeGitHub) -> None:
    doc = decision()
    doc["profile"] = "sm100"
    rc, _, err = run(doc)
    assert rc == 2 and "profiles.sm100 must be a mapping in configs/base.yaml on main" in err
    assert fake.writes() == []


def test_non_utf8_config_on_base_is_one_line_exit_2(run: Runner, fake: FakeGitHub) -> None:
    fake.commit_files("main", {**fake.files_at("main"), "configs/base.yaml": b"\xff\xfe" + BASE_CONFIG}, "latin")
    rc, _, err = run(decision())
    assert rc == 2 and "Traceback" not in err and not (run.tmp / "pr").exists()
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "configs/base.yaml on main must be UTF-8 text, got a byte 0xff" in line and "; save it as UTF-8" in line
    assert fake.writes() == []


def test_absolute_config_inside_a_checkout_names_the_repository_path(run: Runner, fake: FakeGitHub,
                                                                     tmp_path: Path) -> None:
    """`ci decide`, `ci history` and `ci report` take --config as an absolute path; so does `ci pr`
    when the path lies in a git checkout (taken relative to its root). Outside one it is refused."""
    checkout = tmp_path / "checkout"
    (checkout / ".git").mkdir(parents=True)
    rc, out, _ = run(decision(), "--config", str(checkout / "configs" / "base.yaml"))
    assert rc == 0 and "outcome=created" in out
    assert len(config_diff(fake, BRANCH)) == 1
    rc, _, err = run(decision(), "--config", str(tmp_path / "elsewhere" / "base.yaml"))
    assert rc == 2 and "--config must be a path inside the repository" in err and "outside any git checkout" in err


@pytest.mark.parametrize("mode", ["no-token", "flag", "env"])
def test_dry_run_sends_nothing(
    run: Runner, fake: FakeGitHub, mode: str, monkeypatch: pytest.MonkeyPatch, pristine_config: Path
) -> None:
    # --config defaults to configs/base.yaml: run where that is the live file with thresholds at -1.
    monkeypatch.chdir(pristine_config.parents[1])
    extra: tuple[str, ...] = ()
    if mode == "no-token":
        del run.env["GITHUB_TOKEN"]
    elif mode == "env":  # the GPU workflow's dry_run input
        run.env["NSA_PR_DRY_RUN"] = "true"
    else:
        extra = ("--dry-run",)
    rc, out, _ = run(decision(), *extra)
    assert rc == 0 and "outcome=dry-run" in out
    assert fake.log == []
    pr_dir = run.tmp / "pr"
    plan = json.loads((pr_dir / "pr.json").read_text())
    assert plan["outcome"] == "dry-run" and plan["branch"] == BRANCH
    assert plan["labels"] == ["nsa-thresholds", "profile:sm90"]
    assert plan["title"].startswith("NSA thresholds for NVIDIA H100 80GB HBM3 (sm90): win -1 -> 4096")
    assert (pr_dir / "pr_body.md").read_text() == run.report
    diff = (pr_dir / "config.diff").read_text()
    assert "-    fa2_min_len_win: -1\n+    fa2_min_len_win: 4096\n" in diff
    assert run.outputs() == ["outcome=dry-run", "pr_url="]


def test_dry_run_proposes_a_triton_key_and_changes_only_its_line(
    run: Runner, fake: FakeGitHub, monkeypatch: pytest.MonkeyPatch, pristine_config: Path
) -> None:
    monkeypatch.chdir(pristine_config.parents[1])
    doc = decision(win=(-1, -1))
    doc["branches"]["triton_sel"] = {"key": "triton_min_len_sel", "current": -1, "proposed": 8192,
                                     "changed": True, "reason": "measured 8192", "lasting": lasting(),
                                         "lengths": [{"T": 8192, "verdict": "adopt", "cells": []}]}
    rc, out, _ = run(doc, "--dry-run")
    assert rc == 0 and "outcome=dry-run" in out and fake.log == []
    plan = json.loads((run.tmp / "pr" / "pr.json").read_text())
    assert "triton_sel -1 -> 8192" in plan["title"]
    diff = (run.tmp / "pr" / "config.diff").read_text()
    minus = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert (minus, plus) == (["-    triton_min_len_sel: -1"], ["+    triton_min_len_sel: 8192"])
    # The edited line is in the measured profile: the nearest profile header above it is sm90's.
    assert _profile_of_changed_line(diff, (pristine_config.parents[1] / "configs" / "base.yaml").read_text()) == "sm90"


def test_dry_run_writes_a_per_class_proposal_as_one_flow_line(
    run: Runner, fake: FakeGitHub, monkeypatch: pytest.MonkeyPatch, pristine_config: Path
) -> None:
    monkeypatch.chdir(pristine_config.parents[1])
    doc = decision(win=(-1, -1))
    proposed = {"g1": -1, "g2": -1, "g4": 2048, "g8": 1024, "g16": -1}
    classes = {cls: {"class": cls, "current": -1, "proposed": v, "changed": v != -1, "lasting": lasting(v != -1),
                     "lengths": [{"T": t, "verdict": "adopt", "cells": []} for t in (1024, 2048) if v != -1]}
               for cls, v in proposed.items()}
    doc["branches"]["win"] = {"key": "fa2_min_len_win", "current": -1, "changed": True, "reason": "g4, g8 measured",
                              "proposed": proposed, "classes": classes,
                              "lengths": [x for e in classes.values() for x in e["lengths"]]}
    rc, out, _ = run(doc, "--dry-run")
    assert rc == 0 and "outcome=dry-run" in out and fake.log == []
    plan = json.loads((run.tmp / "pr" / "pr.json").read_text())
    assert "win -1 -> {g1: -1, g2: -1, g4: 2048, g8: 1024, g16: -1}" in plan["title"]
    diff = (run.tmp / "pr" / "config.diff").read_text()
    plus = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert plus == ["+    fa2_min_len_win: {g1: -1, g2: -1, g4: 2048, g8: 1024, g16: -1}"]
    # A proposal that is neither an int nor a class -> int mapping is refused before anything is written.
    doc["branches"]["win"]["proposed"] = {"g3": 1}
    rc, _, err = run(doc, "--dry-run")
    assert rc == 2 and "current and proposed (int or class -> int)" in err


def _profile_of_changed_line(diff: str, config: str) -> str:
    """The `profiles:` block holding the diff's first changed line of ``config``."""
    hunk = next(line for line in diff.splitlines() if line.startswith("@@"))
    start = int(hunk.split()[1].split(",")[0].lstrip("-"))
    body = [line for line in diff.splitlines()[diff.splitlines().index(hunk) + 1:] if not line.startswith("+")]
    changed = start + next(i for i, line in enumerate(body) if line.startswith("-"))
    lines = config.splitlines()
    header = next(line for line in reversed(lines[:changed - 1]) if line.startswith("  ") and not line.startswith("   "))
    return header.split(":")[0].strip()


@pytest.mark.parametrize("value", ["false", ""])
def test_dry_run_env_false_or_empty_sends(run: Runner, fake: FakeGitHub, value: str) -> None:
    run.env["NSA_PR_DRY_RUN"] = value  # empty: a scheduled run, which has no inputs
    rc, out, _ = run(decision())
    assert rc == 0 and "outcome=created" in out


def test_dry_run_env_must_be_a_boolean(run: Runner, fake: FakeGitHub) -> None:
    run.env["NSA_PR_DRY_RUN"] = "maybe"
    rc, _, err = run(decision())
    assert rc == 2 and "NSA_PR_DRY_RUN must be true or false" in err
    assert fake.log == []


def test_gh_token_and_dotted_config_path(run: Runner, fake: FakeGitHub) -> None:
    run.env["GH_TOKEN"] = run.env.pop("GITHUB_TOKEN")
    rc, out, _ = run(decision(), "--config", "./configs/base.yaml")
    assert rc == 0 and "outcome=created" in out
    assert len(config_diff(fake, BRANCH)) == 1


def test_long_report_is_truncated_in_the_pr(run: Runner, fake: FakeGitHub) -> None:
    run.report = "# Report\n" + "| a | b |\n" * 10000
    assert run(decision())[0] == 0
    (pr,) = fake.open_pulls()
    assert len(pr.body) <= 65536 and "Report truncated" in pr.body
    assert fake.files_at(BRANCH)["reports/sm90/report.md"].decode() == run.report


def unmeasured(doc: dict[str, Any], *names: str) -> dict[str, Any]:
    """``doc`` as a run that never timed ``names`` (a `fast`-only dispatch): kept values, covered false."""
    for name in names:
        b = doc["branches"][name]
        b.update(proposed=b["current"], changed=False, lasting=lasting(False, covered=False),
                 reason=f"keeping {b['current']}: suite fa2 did not run")
    return doc


def test_a_run_that_measured_no_key_leaves_the_open_pr_alone(run: Runner, fake: FakeGitHub) -> None:
    """Issue 34, item 1: a PR opened on K runs of evidence is not closed by a run with none."""
    assert run(decision())[1].startswith("outcome=created")
    (pr,) = fake.open_pulls()
    head, body, title = fake.refs[f"heads/{BRANCH}"], pr.body, pr.title
    del fake.log[:]
    rc, out, err = run(unmeasured(decision(), "win", "cmp"))
    assert rc == 0 and out.strip() == f"outcome=none pr_url={fake.html_url}/pull/{pr.number}"
    assert f"PR #{pr.number} is left as it is" in err
    assert fake.writes() == [] and pr.state == "open" and pr.comments == []
    assert (fake.refs[f"heads/{BRANCH}"], pr.body, pr.title) == (head, body, title)
    # The next run that measures the key updates the same PR: no second one is opened.
    assert run(decision())[1].startswith("outcome=updated")
    assert [p.number for p in fake.pulls.values()] == [pr.number]


def test_an_unmeasured_key_keeps_its_change_and_a_measured_one_drops_it(run: Runner, fake: FakeGitHub) -> None:
    assert run(decision(win=(-1, 4096), cmp=(-1, 2048)))[1].startswith("outcome=created")
    (pr,) = fake.open_pulls()
    # A run that measured the window only: the compressed key's change stays on the branch and in the title.
    rc, out, err = run(unmeasured(decision(win=(-1, 4096), cmp=(-1, -1)), "cmp"))
    assert rc == 0 and out.startswith("outcome=updated")
    assert f"kept PR #{pr.number}'s change to fa2_min_len_cmp[g1]" in err
    assert config_diff(fake, BRANCH) == [
        ("    fa2_min_len_win: -1\n", "    fa2_min_len_win: 4096\n"),
        ("    fa2_min_len_cmp: -1\n", "    fa2_min_len_cmp: 2048\n"),
    ]
    assert "win -1 -> 4096, cmp -1 -> 2048" in pr.title
    # A run that measured both, and no longer finds the compressed change: that change goes.
    assert run(decision(win=(-1, 4096), cmp=(-1, -1)))[1].startswith("outcome=updated")
    assert config_diff(fake, BRANCH) == [("    fa2_min_len_win: -1\n", "    fa2_min_len_win: 4096\n")]
    # And a run that measured both and needs neither closes the PR.
    assert run(decision(win=(-1, -1)))[1].startswith("outcome=closed")
    assert pr.state == "closed" and [p.number for p in fake.pulls.values()] == [pr.number]


def test_a_symlink_in_the_report_folder_is_refused_before_anything_is_sent(run: Runner, fake: FakeGitHub) -> None:
    """Issue 34, item 6: `out/report/x.png -> /proc/self/environ` committed the token's environment
    to the thresholds branch. The publisher reads regular files only, and says which one it refused."""
    secret = run.tmp / "environ"
    secret.write_bytes(f"GITHUB_TOKEN={TOKEN}\0".encode())
    run.links = {"speedup_cmp.png": secret}
    rc, out, err = run(decision())
    assert rc == 2 and "outcome" not in out
    (line,) = err.strip().splitlines()
    assert "speedup_cmp.png" in line and "a symlink to" in line and "rerun `python -m ci report`" in line
    assert fake.writes() == [] and fake.pulls == {} and f"heads/{BRANCH}" not in fake.refs


@pytest.mark.parametrize("token", [TOKEN + "\n", f" {TOKEN}\r\n"])
def test_a_token_with_a_trailing_newline_works(run: Runner, fake: FakeGitHub, token: str) -> None:
    """Issue 34, item 6: a token pasted with its line break was reported as "could not reach GitHub"
    (requests refuses the header). Surrounding whitespace is never part of a token: it is stripped."""
    run.env["GITHUB_TOKEN"] = token
    rc, out, err = run(decision())
    assert rc == 0 and "outcome=created" in out, err
    assert "could not reach GitHub" not in err


def test_a_token_with_a_line_break_inside_names_the_cause(run: Runner, fake: FakeGitHub) -> None:
    run.env["GITHUB_TOKEN"] = f"{TOKEN}\nghs_second_line"
    rc, out, err = run(decision())
    assert rc == 1 and "outcome" not in out
    (line,) = err.strip().splitlines()
    assert "GITHUB_TOKEN" in line and "line break" in line and "could not reach GitHub" not in line
    assert TOKEN not in line and fake.writes() == []


def test_a_closing_comment_carried_out_before_a_502_is_posted_once(run: Runner, fake: FakeGitHub) -> None:
    """Issue 34, item 6: GitHub posted the comment, answered 502, and the retried POST posted it again.
    A comment POST is not retried blindly: the PR's comments are read again for it first."""
    from ci.github import production_retry

    assert run(decision())[0] == 0
    (pr,) = fake.open_pulls()
    retry = production_retry()
    run.retry = retry.new(backoff_factor=0)  # the production policy, without its waits
    fake.fail("POST", r"/issues/\d+/comments$", 502, after=True)
    rc, out, err = run(decision(win=(-1, -1)))
    assert rc == 0 and "outcome=closed" in out, err
    assert pr.state == "closed" and len(pr.comments) == 1 and "no longer needed" in pr.comments[0]
    assert "already there" in err


def test_a_closing_comment_lost_to_a_502_is_posted_again(run: Runner, fake: FakeGitHub) -> None:
    from ci.github import production_retry

    assert run(decision())[0] == 0
    (pr,) = fake.open_pulls()
    run.retry = production_retry().new(backoff_factor=0)
    fake.fail("POST", r"/issues/\d+/comments$", 502)  # never carried out
    rc, out, err = run(decision(win=(-1, -1)))
    assert rc == 0 and "outcome=closed" in out, err
    assert pr.state == "closed" and len(pr.comments) == 1 and "no longer needed" in pr.comments[0]


# --- Retry-After waits: a long one fails fast, every wait is logged ------------------------------

def test_retry_after_above_the_cap_fails_at_once() -> None:
    from github.GithubException import RateLimitExceededExceedsMaxWait

    retry = production_retry(log=lambda line: None)
    start = time.monotonic()
    with pytest.raises(RateLimitExceededExceedsMaxWait) as info:
        retry.sleep(HTTPResponse(status=429, headers={"Retry-After": "3600"}))
    assert time.monotonic() - start < 1 and info.value.wait == 3600
    assert retry.max_rate_limit_wait == MAX_WAIT_S == 120


def test_a_wait_below_the_cap_is_logged_then_slept(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    lines: list[str] = []
    production_retry(log=lines.append).sleep(HTTPResponse(status=429, headers={"Retry-After": "7"}))
    assert slept == [7] and len(lines) == 1 and "waiting 7 s (Retry-After, at most 120 s)" in lines[0]


def test_new_retries_keep_the_log() -> None:
    lines: list[str] = []
    retry = CappedRetry(total=3, max_rate_limit_wait=5, log=lines.append).new(total=2)
    assert isinstance(retry, CappedRetry) and retry.log == lines.append and retry.max_rate_limit_wait == 5


def test_ci_pr_against_a_429_with_retry_after_3600_fails_fast_with_one_line(tmp_path: Path) -> None:
    with FakeGitHub({"configs/base.yaml": BASE_CONFIG}, token=TOKEN) as fake:
        fake.fail("GET", r"/pulls$", 429, message="slow down", headers={"Retry-After": "3600"}, times=5)
        (tmp_path / "report").mkdir()
        (tmp_path / "report" / "report.md").write_text("# r\n", encoding="utf-8")
        (tmp_path / "d.json").write_text(json.dumps(decision()), encoding="utf-8")
        import io

        err = io.StringIO()
        start = time.monotonic()
        rc = run_pr(["--decision", str(tmp_path / "d.json"), "--report-dir", str(tmp_path / "report"),
                     "--out-dir", str(tmp_path / "pr")],
                    env={"GITHUB_API_URL": fake.api_url, "GITHUB_REPOSITORY": "octo/nsa", "GITHUB_TOKEN": TOKEN},
                    out=io.StringIO(), err=err,
                    connector=lambda target: connect(target, pace=False, timeout=5))
        assert time.monotonic() - start < 20
    text = err.getvalue().strip()
    assert rc == 1 and "\n" not in text and TOKEN not in text
    assert "GitHub asked to wait 3600 s before a retry, longer than this job waits; rerun after" in text
