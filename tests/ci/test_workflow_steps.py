"""`python -m ci workflow-steps`: the local runner of a workflow job's `run:` steps."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from ci import workflow_steps as ws
from ci.__main__ import main

REPO = Path(__file__).resolve().parents[2]
GPU_WORKFLOW = REPO / ".github" / "workflows" / "gpu-bench.yml"

SYNTHETIC = """\
name: synthetic
on:
  workflow_dispatch:
    inputs:
      who: {type: string, default: world}
      loud: {type: boolean, default: false}
  push:
env:
  LEVEL: workflow
jobs:
  other:
    runs-on: ubuntu-latest
    steps:
      - run: exit 9
  main:
    runs-on: ubuntu-latest
    env:
      WHO: ${{ inputs.who || 'nobody' }}
    steps:
      - uses: actions/checkout@v4
      - name: greet
        run: printf '%s %s %s|%s\\n' "$WHO" "$LEVEL" "$LOUD" "${SECRET-unset}" > greeting.txt
        env:
          LOUD: ${{ inputs.loud }}
          SECRET: ${{ secrets.TOKEN || github.token }}
      - name: export
        run: mkdir -p bin && printf '#!/bin/sh\\necho tool-ran\\n' > bin/tool && chmod +x bin/tool && echo "$PWD/bin" >> "$GITHUB_PATH" && echo "FROM_ENV=carried" >> "$GITHUB_ENV"
      - name: use exports
        run: tool > tool.txt && echo "$FROM_ENV" >> tool.txt && echo "### hello" >> "$GITHUB_STEP_SUMMARY"
      - name: tokens
        run: echo "${GITHUB_TOKEN-none} ${GH_TOKEN-none}" > tokens.txt
      - name: fail
        run: exit 7
      - name: skipped after a failure
        run: touch never.txt
      - name: cleanup
        if: ${{ always() }}
        run: touch always.txt
      - name: on failure
        if: failure()
        run: touch failure.txt
"""


@pytest.fixture
def synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GH_TOKEN", "must-not-leak")
    monkeypatch.setenv("GITHUB_TOKEN", "must-not-leak")
    path = tmp_path / "wf.yml"
    path.write_text(SYNTHETIC, encoding="utf-8")
    return path


def test_runs_steps_in_order_with_env_conditions_and_github_files(synthetic: Path) -> None:
    tmp = synthetic.parent
    out = io.StringIO()
    rc = ws.run_job(synthetic, "main", inputs={"loud": "true"}, state_dir=tmp / "state", out=out)
    text = out.getvalue()
    assert rc == 7
    assert (tmp / "greeting.txt").read_text() == "world workflow true|\n"  # secrets are empty here
    assert (tmp / "tool.txt").read_text() == "tool-ran\ncarried\n"
    assert (tmp / "tokens.txt").read_text() == "none none\n"
    assert (tmp / "always.txt").exists() and (tmp / "failure.txt").exists()
    assert not (tmp / "never.txt").exists()
    assert (tmp / "state" / "step_summary.md").read_text() == "### hello\n"
    summary = text.split("== workflow-steps summary")[1]
    statuses = [line.split()[0] for line in summary.splitlines()[1:-2]]
    assert statuses == ["GitHub", "ok", "ok", "ok", "ok", "FAILED", "not", "ok", "ok"]
    assert "FAILED (7)" in summary and "total " in summary and "; exit 7" in summary
    assert f"job summary: {tmp / 'state' / 'step_summary.md'}" in text
    assert "empty here: secrets.TOKEN, github.token" in text


def test_cli_default_state_dir_and_passing_job(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wf = synthetic.parent / "ok.yml"
    wf.write_text("on: push\njobs:\n  j:\n    runs-on: x\n    steps:\n      - run: echo hi > hi.txt\n")
    assert main(["workflow-steps", str(wf), "--job", "j"]) == 0
    assert (synthetic.parent / "hi.txt").read_text() == "hi\n"
    assert (synthetic.parent / "out" / "workflow-steps" / "ok-j" / "env").is_file()
    assert "total " in capsys.readouterr().out


def test_dry_run_of_the_gpu_job_prints_commands_and_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["workflow-steps", str(GPU_WORKFLOW), "--job", "gpu", "--dry-run", "--input", "size=smoke"]) == 0
    text = capsys.readouterr().out
    assert ("inputs: suites=nightly size=smoke margin=1.2 dry_run=false "
            "runner_label=sm90") in text
    assert "  $ make ci-env\n" in text and "  $ make test-fa2-parity\n" in text
    assert '  $ python -m bench run --suites "$SUITES" --size "$SIZE"' in text
    assert "env: SUITES=nightly SIZE=smoke" in text
    assert "uses actions/upload-artifact@" in text and "[if: always]" in text
    assert list(tmp_path.iterdir()) == []


def test_decide_job_dry_run_resolves_the_token_to_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["workflow-steps", str(GPU_WORKFLOW), "--job", "decide", "--dry-run",
                 "--input", "dry_run=true", "--input", "margin="]) == 0
    text = capsys.readouterr().out
    assert "env: GITHUB_TOKEN='' NSA_PR_DRY_RUN=true" in text and "env: MARGIN=''" in text
    assert '--summary-to "$GITHUB_STEP_SUMMARY"' in text
    assert "History (lasting changes, regressions, trends) [if: always]" in text
    assert "[if: ${{ !cancelled() && steps.history.outputs.history != '' }}]" in text


OUTPUTS = """\
on: push
jobs:
  j:
    runs-on: x
    steps:
      - id: decide
        run: exit 3
      - id: history
        if: ${{ !cancelled() }}
        run: echo "history=added" >> "$GITHUB_OUTPUT" && echo "$NSA_HISTORY_DIR" > store.txt && exit 4
      - id: quiet
        if: ${{ !cancelled() }}
        run: echo none
      - name: report
        if: ${{ !cancelled() && steps.history.outputs.history != '' }}
        run: touch report.txt
      - name: pr
        if: ${{ !cancelled() && steps.decide.outcome == 'success' && steps.history.outputs.history != '' }}
        run: touch pr.txt
      - name: quiet output
        if: ${{ always() && steps.quiet.outputs.history == '' && steps.history.outcome == 'failure' }}
        run: touch quiet.txt
      - name: after failure
        if: steps.decide.outcome == 'failure'
        run: touch never.txt
"""


def test_if_reads_earlier_steps_outcomes_and_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decide job's gates: report after history wrote its output, PR only when decide passed too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ws.HISTORY_ENV, raising=False)
    wf = tmp_path / "wf.yml"
    wf.write_text(OUTPUTS, encoding="utf-8")
    out = io.StringIO()
    assert ws.run_job(wf, "j", out=out) == 3
    assert (tmp_path / "report.txt").exists() and (tmp_path / "quiet.txt").exists()
    assert not (tmp_path / "pr.txt").exists() and not (tmp_path / "never.txt").exists()
    assert "  -> not run (its if: is false)" in out.getvalue()
    assert "  -> not run (an earlier step failed)" in out.getvalue()
    # The local stand-in for the nsa-history branch: one folder, the same for every replay here.
    assert (tmp_path / "store.txt").read_text().strip() == str(tmp_path / "out" / "history-store")
    monkeypatch.setenv(ws.HISTORY_ENV, str(tmp_path / "mine"))
    wf.write_text(OUTPUTS.replace("exit 3", "exit 0"), encoding="utf-8")
    assert ws.run_job(wf, "j", out=io.StringIO()) == 4
    assert (tmp_path / "pr.txt").exists() and (tmp_path / "store.txt").read_text().strip() == str(tmp_path / "mine")


@pytest.mark.parametrize("cond,message", [
    ("${{ steps.later.outputs.x != '' }}", "reads steps.later, which must be the id of an earlier step"),
    ("${{ always() && failure() }}", "must name at most one status function"),
    ("${{ steps.a.outcome == success }}", "is not supported by the local runner"),
])
def test_unsupported_step_checks_are_refused(tmp_path: Path, cond: str, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    wf = tmp_path / "wf.yml"
    wf.write_text(textwrap.dedent(f"""\
        on: push
        jobs:
          j:
            runs-on: x
            steps:
              - id: a
                run: echo a
              - if: "{cond}"
                run: echo b
              - id: later
                run: echo c
        """))
    assert main(["workflow-steps", str(wf), "--job", "j", "--dry-run"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--job", "nope"], "--job must be one of gpu, decide, got 'nope'"),
    (["--job", "gpu", "--input", "colour=red"], "--input colour must name a workflow_dispatch input"),
    (["--job", "gpu", "--input", "dry_run=maybe"], "--input dry_run must be true or false"),
    (["--job", "gpu", "--input", "size=huge"], "--input size must be one of ['smoke', 'nightly', 'full']"),
])
def test_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["workflow-steps", str(GPU_WORKFLOW), "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unsupported_if_and_shell_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for step, message in (("if: github.ref == 'main'", "is not supported by the local runner"),
                          ("shell: pwsh", "shell 'pwsh' is not supported")):
        wf = tmp_path / "wf.yml"
        wf.write_text(textwrap.dedent(f"""\
            on: push
            jobs:
              j:
                runs-on: x
                steps:
                  - run: echo hi
                    {step}
            """))
        assert main(["workflow-steps", str(wf), "--job", "j", "--dry-run"]) == 2
        assert message in capsys.readouterr().err
    assert main(["workflow-steps", str(tmp_path / "missing.yml"), "--job", "j"]) == 2
    assert "cannot read workflow" in capsys.readouterr().err


def test_resolver() -> None:
    r = ws.Resolver({"suites": "", "size": "nightly", "dry_run": False, "n": 3})
    assert r.text("${{ inputs.suites || 'fa2,calibration' }}") == "fa2,calibration"
    assert r.text("${{ inputs.size || 'smoke' }}") == "nightly"
    assert r.text("${{ github.event.inputs.size }}") == "nightly"
    assert r.text("${{ inputs.dry_run }}") == "false" and r.text("${{ inputs.n }}") == "3"
    assert r.text("a-${{ 'x||y' }}-${{ 1.0 }}") == "a-x||y-1"
    assert r.text("${{ secrets.T || github.token }}") == "" and r.unresolved == ["secrets.T", "github.token"]
    assert r.text(True) == "true" and r.text(None) == ""
    assert r.text("${{ inputs.dry_run || 'it''s' }}") == "it's"
