"""The hardening issue, one test (or a few) per item: guard, retry waits, stale pipeline files,
decision validation in `ci pr`, atomic writes, and the report's staging folder."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from urllib3 import HTTPResponse

from ci import guard, pipeline, report
from ci.__main__ import main
from ci.github import MAX_WAIT_S, CappedRetry, connect, production_retry
from ci.pr_cmd import run_pr
from ci.pr_plan import PlanError, validate_decision
from nsa_contract import atomic, results
from tests.ci import fixtures as fx
from tests.ci.fake_github import FakeGitHub
from tests.ci.test_github import BASE_CONFIG, TOKEN, decision

# --- item 1: the guard -------------------------------------------------------------------------

GH = {"GITHUB_ACTIONS": "true", "NSA_DEFAULT_BRANCH": "main"}


@pytest.mark.parametrize("env", [
    {**GH, "GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/main"},
    {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": "refs/heads/main"},
    {},  # a local run (make gpu-bench): no event to check
], ids=["schedule", "dispatch-on-default", "schedule-default-unknown", "local"])
def test_guard_passes_trusted_triggers(env: dict[str, str]) -> None:
    assert guard.run(None, env=env) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("env", [
    {**GH, "GITHUB_EVENT_NAME": "pull_request", "GITHUB_REF": "refs/pull/7/merge"},
    {**GH, "GITHUB_EVENT_NAME": "pull_request_target", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/feature"},
    {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/main"},
    {"GITHUB_ACTIONS": "true"},
], ids=["fork-pr", "pr-target", "push", "dispatch-on-branch", "dispatch-default-unknown", "no-event"])
def test_guard_refuses_everything_else(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert guard.run(None, env=env) == 2  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the ") and "; " in err and "\n" not in err


def test_guard_reads_the_default_branch_from_the_event_payload(tmp_path: Path) -> None:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"repository": {"default_branch": "trunk"}}), encoding="utf-8")
    env = {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_EVENT_PATH": str(event)}
    assert guard.run(None, env={**env, "GITHUB_REF": "refs/heads/trunk"}) == 0  # type: ignore[arg-type]
    assert guard.run(None, env={**env, "GITHUB_REF": "refs/heads/main"}) == 2  # type: ignore[arg-type]


# --- item 2: long Retry-After waits fail fast, every wait is logged -----------------------------

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
        (tmp_path / "d.json").write_text(json.dumps(_decision()), encoding="utf-8")
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


# --- item 3: the pipeline never shows an earlier run's files -------------------------------------

def test_a_failed_stage_shows_no_stale_decision_or_pr(tmp_path: Path, pristine_config: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN", "GITHUB_OUTPUT"):
        monkeypatch.delenv(name, raising=False)
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    out = tmp_path / "out"
    argv = ["pipeline", "--results", str(res), "--config", str(pristine_config), "--out-dir", str(out), "--dry-run"]
    assert main(argv) == 0
    assert (out / "decision.json").is_file() and (out / "pr" / "pr.json").is_file()
    capsys.readouterr()
    res.write_text(res.read_text()[:300], encoding="utf-8")  # truncated
    assert main(argv) == 2
    text = capsys.readouterr().out
    assert "thresholds (" not in text and "outcome dry-run" not in text and "report:" not in text
    assert "outcome: failed at decide (exit 2)" in text
    assert not (out / "decision.json").exists() and not (out / "report").exists() and not (out / "pr").exists()


def test_a_failed_pr_stage_does_not_show_an_earlier_outcome(tmp_path: Path, pristine_config: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT"):
        monkeypatch.delenv(name, raising=False)
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    out = tmp_path / "out"
    argv = ["pipeline", "--results", str(res), "--config", str(pristine_config), "--out-dir", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    monkeypatch.setenv("NSA_PR_DRY_RUN", "maybe")  # history and pr read it: the run fails with exit 2
    assert main(argv) == 2
    text = capsys.readouterr().out
    # The earlier run's outcome is never shown; the stage that failed is.
    assert "outcome dry-run" not in text and ("outcome unknown" in text or "failed at history (exit 2)" in text)


# --- item 4: `ci pr` re-checks the decision -----------------------------------------------------

def _decision(**changes: Any) -> dict[str, Any]:
    return {**decision(), **changes}


def test_validate_decision_accepts_a_clean_decision() -> None:
    validate_decision(_decision())


@pytest.mark.parametrize("change,message", [
    ({"exit_code": 3}, "exit_code must be 0, got 3"),
    ({"exit_code": False}, "exit_code must be 0"),
    ({"cells": [{"id": "fa2/sliding/flash_attn/x", "verdict": "failed"}]}, "must have no failed cells, got 1"),
    ({"failures": [{"id": "fa2/sliding/torch_fa2/y", "parity_failed": True}]}, "must have no failed cells"),
    ({"schema": "nsa-decision/0"}, "decision.schema must be 'nsa-decision/2'"),
])
def test_validate_decision_refuses_failures(change: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate_decision(_decision(**change))


@pytest.mark.parametrize("proposed", [-5, 3000, 0])
def test_validate_decision_refuses_a_value_the_rule_cannot_produce(proposed: int) -> None:
    doc = _decision()
    doc["branches"]["win"].update(proposed=proposed, changed=True)
    # -5 is refused by the one loader's value rule, the others by the tested-lengths rule.
    expected = (r"proposed must be -1 \(off\) or a sequence length >= 0, got -5" if proposed < -1
                else r"proposed must be -1 or a tested length of fa2_min_len_win \(1024, 2048")
    with pytest.raises(PlanError, match=expected):
        validate_decision(doc)


def test_validate_decision_accepts_minus_one_and_tested_lengths() -> None:
    for proposed in (-1, 1024, 8192):
        doc = _decision()
        doc["branches"]["win"].update(current=512, proposed=proposed, changed=True)
        validate_decision(doc)


def test_validate_decision_refuses_a_decision_history_never_rewrote() -> None:
    """Issue 34, item 2: `ci pr` needs `ci history`'s verdict, as it needs cells that did not fail."""
    doc = _decision()
    del doc["history"]
    with pytest.raises(PlanError, match=r"without `history`; run `python -m ci history` on it first"):
        validate_decision(doc)
    doc = _decision()
    del doc["branches"]["cmp"]["lasting"]  # an unchanged entry needs the verdict too (was it measured?)
    with pytest.raises(PlanError, match=r"branches.cmp.lasting must be the verdict of `ci history`"):
        validate_decision(doc)


@pytest.mark.parametrize("held", [False, None])
def test_validate_decision_refuses_a_change_that_did_not_last(held: bool | None) -> None:
    doc = _decision()
    doc["branches"]["win"]["lasting"]["held"] = held
    with pytest.raises(PlanError, match=rf"win must change only a value that lasted \(lasting.held true\), got -1 -> "
                                        rf"4096 with held {held}; run `python -m ci history`"):
        validate_decision(doc)


def test_ci_pr_refuses_the_raw_decision_of_one_run(tmp_path: Path, pristine_config: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """decide's own file proposes `win -1 -> {.. g4: 2048 ..}` from one run: `ci pr` exits 2, sends nothing."""
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    assert main(["decide", "--results", str(res), "--config", str(pristine_config), "--out",
                 str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["branches"]["win"]["changed"]
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_text("# r\n", encoding="utf-8")
    capsys.readouterr()
    with FakeGitHub({"configs/base.yaml": BASE_CONFIG}, token=TOKEN) as fake:
        import io

        err = io.StringIO()
        rc = run_pr(["--decision", str(tmp_path / "d.json"), "--report-dir", str(tmp_path / "report"),
                     "--out-dir", str(tmp_path / "pr")],
                    env={"GITHUB_API_URL": fake.api_url, "GITHUB_REPOSITORY": "octo/nsa", "GITHUB_TOKEN": TOKEN},
                    out=io.StringIO(), err=err, connector=lambda target: connect(target, pace=False, timeout=5))
        assert fake.log == []
    text = err.getvalue().strip()
    assert rc == 2 and "\n" not in text and "run `python -m ci history` on it first" in text
    assert not (tmp_path / "pr").exists()


def test_a_failed_history_stage_shows_no_unvetted_change(tmp_path: Path, pristine_config: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT", "NSA_HISTORY_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NSA_PR_DRY_RUN", "maybe")  # decide ignores it, history refuses it (exit 2)
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    out = tmp_path / "out"
    assert main(["pipeline", "--results", str(res), "--config", str(pristine_config), "--out-dir", str(out)]) == 2
    text = capsys.readouterr().out
    assert "outcome: failed at history (exit 2)" in text
    assert "win -1 -> " not in text and "win -1 (unchanged)" in text and "not vetted by `ci history`" in text
    # The decision left behind is decide's own: `ci pr` refuses it.
    monkeypatch.delenv("NSA_PR_DRY_RUN")
    assert main(["pr", "--decision", str(out / "decision.json"), "--report-dir", str(tmp_path),
                 "--out-dir", str(out / "pr"), "--dry-run"]) == 2
    assert "run `python -m ci history` on it first" in capsys.readouterr().err


# --- item 5: atomic writes -----------------------------------------------------------------------

def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "decision.json"
    target.write_text('{"good": true}\n', encoding="utf-8")

    def fail_fsync(fd: int) -> None:  # what `ulimit -f` or a full disk does half-way through a write
        raise OSError(27, "File too large")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="File too large"):
        atomic.write_text(target, '{"new": "' + "x" * 100000 + '"}\n')
    assert target.read_text(encoding="utf-8") == '{"good": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["decision.json"]


def test_atomic_write_keeps_the_usual_mode(tmp_path: Path) -> None:
    path = atomic.write_text(tmp_path / "new.txt", "x")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_failed_write_removes_the_folders_it_made_and_names_the_path(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError) as info:
        atomic.write_text(tmp_path / "new" / "sub" / "decision.json", "{}\n")
    assert info.value.filename == str(tmp_path / "new" / "sub" / "decision.json")
    with pytest.raises(OSError) as info, atomic.staging_dir(tmp_path / "made" / "report") as stage:
        (stage / "a.png").write_bytes(b"x")
        raise OSError(27, "File too large")  # as PIL raises it, naming no file
    assert info.value.filename == str(tmp_path / "made" / "report")
    assert list(tmp_path.iterdir()) == []


def test_bench_merge_leaves_no_temp_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import main as bench_main

    shard = results.dump(fx.document(fx.sweep("sliding", {1024: 2.0})), tmp_path / "shard0.json")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    # A full disk is an exit 2 with one line naming the file and the fix, not a traceback.
    assert bench_main(["merge", str(shard), "--out", str(tmp_path / "all.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: the disk must have room for {str(tmp_path / 'all.json')!r}") and "; free" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard0.json"]


def _decision_file(tmp_path: Path, pristine_config: Path) -> Path:
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    out = tmp_path / "decision.json"
    assert main(["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]) == 0
    return out


def test_report_validates_before_it_draws_and_leaves_nothing_on_failure(tmp_path: Path, pristine_config: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    doc = json.loads(decision_path.read_text())
    del doc["runs"]  # the templates need it; plots do not
    decision_path.write_text(json.dumps(doc), encoding="utf-8")
    drawn: list[Any] = []
    from ci import plots

    monkeypatch.setattr(plots, "plot_branch", lambda *a, **k: drawn.append(a))
    with pytest.raises(report.ReportError, match="lacks a field the report needs"):
        report.write_report(decision_path, tmp_path / "report")
    assert drawn == [] and not (tmp_path / "report").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


def test_a_failed_report_over_an_existing_folder_keeps_the_old_report_whole(tmp_path: Path, pristine_config: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    out = tmp_path / "report"
    report.write_report(decision_path, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from ci import plots

    def broken(cells: Any, branch: str, margin: float, path: Path) -> Path:
        path.write_bytes(b"half a png")
        raise ValueError("matplotlib failed half-way")

    monkeypatch.setattr(plots, "plot_branch", broken)
    with pytest.raises(report.ReportError):
        report.write_report(decision_path, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "decision.json", "r.json", "report"]


def test_a_report_with_fewer_plots_replaces_the_folder(tmp_path: Path, pristine_config: Path) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    out = tmp_path / "report"
    out.mkdir()
    (out / "speedup_old.png").write_bytes(b"an earlier run's plot")
    written = report.write_report(decision_path, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    assert not (out / "speedup_old.png").exists()


def test_pipeline_rejects_an_out_dir_that_is_a_file_before_any_stage(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    args = pipeline.argparse.Namespace(out_dir=str(tmp_path / "f"), results=["r.json"], config=None, margin=None,
                                       previous=None, dry_run=True)
    assert pipeline.run(args, stage=lambda argv: 0) == 2
    assert "--out-dir must be a folder" in capsys.readouterr().err
