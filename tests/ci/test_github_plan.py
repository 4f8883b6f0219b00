"""Tests of the PR plan (title, labels, body limit, committed paths) and the ``pr`` command's input checks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import results
from ci.__main__ import main
from ci.github import connect
from ci.pr_cmd import EXIT_INPUT, run_pr
from ci.pr_plan import (
    BODY_LIMIT,
    DECISION_SCHEMA,
    PlanError,
    ReportFile,
    build_plan,
    link_images,
    load_report,
    truncate_body,
    validate_decision,
)
from tests.ci import fixtures as fx
from tests.ci.fake_github import FakeGitHub
from tests.ci.test_github import BASE_CONFIG, TOKEN, decision


def test_plan_fields() -> None:
    files = (ReportFile("reports/sm90/report.md", b"# r\n"),)
    plan = build_plan(decision(win=(-1, 4096), cmp=(8192, -1)), "# r\n", files)
    assert plan.branch == "nsa-thresholds/sm90"
    assert plan.title == "NSA thresholds for NVIDIA H100 80GB HBM3 (sm90): win -1 -> 4096, cmp 8192 -> -1"
    assert plan.labels == ("nsa-thresholds", "profile:sm90")
    assert plan.changes == {"fa2_min_len_win": 4096, "fa2_min_len_cmp": -1}
    assert "profiles.sm90.fa2_min_len_win (win): -1 -> 4096" in plan.commit_message
    assert plan.commit_message.startswith(plan.title + "\n\n")


def test_unchanged_branch_is_not_a_change() -> None:
    plan = build_plan(decision(win=(-1, -1), cmp=(2048, 2048)), "", ())
    assert plan.changes == {}
    assert plan.title.endswith("win -1 (unchanged), cmp 2048 (unchanged)")


def test_truncate_body_fits_the_limit_with_a_note() -> None:
    text = "".join(f"| row {i} | {'x' * 60} |\n" for i in range(2000))
    assert len(text) > BODY_LIMIT
    body = truncate_body(text, "reports/sm90/report.md")
    assert len(body) <= BODY_LIMIT
    assert body.endswith("committed as `reports/sm90/report.md` on this PR's branch.*\n")
    assert text.startswith(body.split("\n\n---\n")[0])
    assert truncate_body("short", "x") == "short"


def test_long_report_body_is_truncated_in_the_plan() -> None:
    plan = build_plan(decision(), "y" * (BODY_LIMIT + 10), ())
    assert len(plan.body()) <= BODY_LIMIT and "truncated" in plan.body()


def test_link_images_rewrites_only_committed_plots() -> None:
    files = (ReportFile("reports/sm90/speedup_win.png", b""), ReportFile("reports/sm90/report.md", b""))
    text = (
        "![win](speedup_win.png) ![cmp](./speedup_win.png) ![ext](https://x/y.png) ![other](other.png)\n"
        '<img src="speedup_win.png" width="400">\n'
    )
    out = link_images(text, files, "https://h/o/r/raw/abc/reports/sm90/")
    assert out.count("(https://h/o/r/raw/abc/reports/sm90/speedup_win.png)") == 2
    assert "![ext](https://x/y.png)" in out and "![other](other.png)" in out
    assert 'src="https://h/o/r/raw/abc/reports/sm90/speedup_win.png" width="400"' in out


def test_load_report_collects_report_and_plots(tmp_path: Path) -> None:
    (tmp_path / "report.md").write_text("# r\n")
    (tmp_path / "b.png").write_bytes(b"\x89PNG b")
    (tmp_path / "a.png").write_bytes(b"\x89PNG a")
    (tmp_path / "summary.md").write_text("not committed")
    text, files = load_report(tmp_path, "sm89")
    assert text == "# r\n"
    assert [f.path for f in files] == ["reports/sm89/report.md", "reports/sm89/a.png", "reports/sm89/b.png"]
    with pytest.raises(PlanError, match=r"--report-dir must contain report\.md.*python -m ci report"):
        load_report(tmp_path / "missing", "sm89")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"profile": "cpu"}, r"decision\.profile must be a GPU profile such as 'sm90', got 'cpu'"),
        ({"profile": None}, r"decision\.profile must be a GPU profile"),
        ({"gpu_name": ""}, r"decision\.gpu_name must be a non-empty string"),
        ({"branches": {}}, r"decision\.branches must be a non-empty mapping"),
        (
            {"branches": {"win": {"key": "k", "current": "-1", "proposed": 1, "changed": True}}},
            r"decision\.branches\.win must have key \(str\), current and proposed \(int or class -> int\)",
        ),
        (
            {"branches": {"win": {"key": "k", "current": -1, "proposed": {"g3": 1}, "changed": True}}},
            r"decision\.branches\.win must have key \(str\), current and proposed \(int or class -> int\)",
        ),
        (
            {"branches": {"win": {"key": "k", "current": -1, "proposed": {"g4": True}, "changed": True}}},
            r"decision\.branches\.win must have key \(str\), current and proposed \(int or class -> int\)",
        ),
    ],
)
def test_bad_decisions(change: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        build_plan({**decision(), **change}, "", ())


def _run(tmp_path: Path, doc: Any, *extra: str) -> tuple[int, str]:
    (tmp_path / "decision.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    (tmp_path / "report").mkdir(exist_ok=True)
    (tmp_path / "report" / "report.md").write_text("# r\n")
    err = io.StringIO()
    rc = run_pr(
        [
            "--decision",
            str(tmp_path / "decision.json"),
            "--report-dir",
            str(tmp_path / "report"),
            "--out-dir",
            str(tmp_path / "pr"),
            *extra,
        ],
        env={},
        out=io.StringIO(),
        err=err,
    )
    return rc, err.getvalue()


def test_cli_input_errors_exit_2(tmp_path: Path) -> None:
    rc, err = _run(tmp_path, "{not json")
    assert rc == EXIT_INPUT and "--decision must be a readable JSON file" in err
    rc, err = _run(tmp_path, {**decision(), "profile": "cpu"})
    assert rc == EXIT_INPUT and "decision.profile must be a GPU profile" in err
    rc, err = _run(tmp_path, decision(), "--config", str(tmp_path / "nope.yaml"))
    assert rc == EXIT_INPUT and "--config must be a readable file" in err
    assert not (tmp_path / "pr").exists()


def test_pr_is_a_registered_subcommand() -> None:
    from ci.__main__ import build_parser

    args = build_parser().parse_args(["pr", "--decision", "d.json", "--dry-run"])
    assert args.report_dir == "out/report" and args.out_dir == "out/pr" and args.config == "configs/base.yaml"
    assert args.dry_run and args.base is None


@pytest.mark.parametrize("kind", ["symlink", "symlinked report", "hard link", "hard-linked report", "fifo", "folder"])
def test_load_report_refuses_anything_but_regular_files(tmp_path: Path, kind: str) -> None:
    """Issue 34, item 6: a link in the report folder to /proc/self/environ (the token) was committed
    to the thresholds branch as a PNG. Every file published must be a regular file of the folder itself."""
    secret = tmp_path / "environ"
    secret.write_bytes(b"GITHUB_TOKEN=ghs_secret\0")
    report = tmp_path / "report"
    report.mkdir()
    (report / "a.png").write_bytes(b"\x89PNG a")
    if kind == "symlinked report":
        (report / "report.md").symlink_to(secret)
        bad = report / "report.md"
    elif kind == "hard-linked report":  # a second name of the secret file: a regular file, but not the folder's own
        os.link(secret, report / "report.md")
        bad = report / "report.md"
    else:
        (report / "report.md").write_text("# r\n")
        bad = report / "speedup_win.png"
        {"symlink": lambda: bad.symlink_to(secret), "hard link": lambda: os.link(secret, bad),
         "fifo": lambda: os.mkfifo(bad), "folder": bad.mkdir}[kind]()
    with pytest.raises(PlanError) as err:
        load_report(report, "sm90")
    text = str(err.value)
    assert "\n" not in text and str(bad) in text and "regular files" in text and "rerun `python -m ci report`" in text
    assert "ghs_secret" not in text
    if kind.startswith("hard"):
        assert "a hard link (one of 2 names of one file)" in text


# --- `ci pr` re-checks the decision: no failed cell, values the rule can produce, the history verdict

def _decision(**changes: Any) -> dict[str, Any]:
    return {**decision(), "schema": DECISION_SCHEMA, **changes}


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

def test_the_plan_schema_is_the_decision_schema() -> None:
    from ci.decide import SCHEMA

    assert DECISION_SCHEMA == SCHEMA
