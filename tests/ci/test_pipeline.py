"""`python -m ci pipeline`: stages, files, the printed summary and exit codes.

One test runs the real sweep subprocess on this machine's CPU (a trimmed smoke size); the others
decide on fixture results with --results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ci import pipeline
from ci.__main__ import main
from nsa_contract import results
from tests.ci import fixtures as fx

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "base.yaml")  # the live file: only the CPU sweep, which proposes nothing


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN", "GITHUB_OUTPUT", "NSA_HISTORY_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)  # `python -m bench` runs from the repository root


def _results(tmp_path: Path, cases: list) -> str:
    return str(results.dump(fx.document(cases), tmp_path / "results.json"))


def _night(tmp_path: Path, n: int, cases: list) -> str:
    """Night `n`'s results: the same cases under a new run id and date (history keys runs by id)."""
    doc = fx.document(cases, run_extra={"id": f"run-{n:04d}", "created_at": f"2025-03-{n:02d}T03:17:00Z"})
    return str(results.dump(doc, tmp_path / f"results-{n}.json"))


def test_three_nights_on_one_store_propose_once_the_change_lasted(tmp_path: Path, pristine_config: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every stage, night after night, on one history store: the change becomes a proposal on night K=3."""
    cases = fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)
    out = tmp_path / "out"
    per_class = {"g1": -1, "g2": -1, "g4": 2048, "g8": -1, "g16": -1}  # only class g4 was measured
    for n in (1, 2):
        res = _night(tmp_path, n, cases)
        assert main(["pipeline", "--results", res, "--config", str(pristine_config), "--out-dir", str(out)]) == 0
        text = capsys.readouterr().out
        decision = json.loads((out / "decision.json").read_text())
        win = decision["branches"]["win"]
        assert win["proposed"] == -1 and not win["changed"]  # held back: nothing new is proposed
        assert f"only {n} of 3 runs so far" in win["classes"]["g4"]["reason"]
        assert decision["history"]["runs_used"]["nvidia-h100-80gb-hbm3"] == [f"run-{i:04d}" for i in range(1, n + 1)]
        assert decision["history"]["store"] == f"dir:{out / 'history-store'}"
        assert "  history ok" in text and f"added in {out / 'history-store'}; {n} run(s) of this GPU model" in text
        assert json.loads((out / "pr" / "pr.json").read_text())["outcome"] == "dry-run"
        assert (out / "pr" / "config.diff").read_text().strip() == ""
        assert "thresholds (sm90, NVIDIA H100 80GB HBM3): " in text and ", win -1 (unchanged)" in text
    report = (out / "report" / "report.md").read_text()
    assert "## History and trends" in report and "only 2 of 3 runs so far" in report
    assert sorted(p.name for p in (out / "history-store" / "history" / "nvidia-h100-80gb-hbm3").iterdir()) == [
        "run-0001.json", "run-0002.json"]

    res = _night(tmp_path, 3, cases)
    assert main(["pipeline", "--results", res, "--config", str(pristine_config), "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert json.loads((out / "decision.json").read_text())["branches"]["win"]["proposed"] == per_class
    assert (out / "report" / "report.md").is_file() and (out / "report" / "speedup_win.png").is_file()
    pr = json.loads((out / "pr" / "pr.json").read_text())
    assert pr["outcome"] == "dry-run" and pr["reason"] == "no GITHUB_TOKEN or GH_TOKEN"
    assert "  sweep   skipped" in text and f"--results {res}" in text
    assert ("thresholds (sm90, NVIDIA H100 80GB HBM3): triton_win -1 (unchanged), "
            "win -1 -> {g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}") in text
    # The dry run's config diff writes the per-class value as one flow-mapping line of the sm90 block.
    diff = (out / "pr" / "config.diff").read_text()
    assert [x for x in diff.splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---")] == [
        "-    fa2_min_len_win: -1", "+    fa2_min_len_win: {g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}"]
    assert f"report: {out / 'report' / 'report.md'}" in text
    assert "outcome dry-run" in text and text.rstrip().endswith("outcome: ok")


def test_history_dir_comes_from_the_flag_then_the_environment(tmp_path: Path, pristine_config: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(out_dir=str(tmp_path))
    assert pipeline.history_dir(args, tmp_path) == str(tmp_path / "history-store")
    monkeypatch.setenv("NSA_HISTORY_DIR", str(tmp_path / "env"))
    assert pipeline.history_dir(args, tmp_path) == str(tmp_path / "env")
    assert pipeline.history_dir(_args(history_dir=str(tmp_path / "flag")), tmp_path) == str(tmp_path / "flag")
    res = _night(tmp_path, 1, fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    assert main(["pipeline", "--results", res, "--config", str(pristine_config), "--out-dir", str(tmp_path / "o")]) == 0
    assert (tmp_path / "env" / "history" / "nvidia-h100-80gb-hbm3" / "run-0001.json").is_file()
    # --dry-run: nothing saved, the decision still rewritten.
    res = _night(tmp_path, 2, fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    assert main(["pipeline", "--results", res, "--config", str(pristine_config), "--out-dir", str(tmp_path / "o"),
                 "--dry-run"]) == 0
    assert len(list((tmp_path / "env" / "history" / "nvidia-h100-80gb-hbm3").iterdir())) == 1
    assert json.loads((tmp_path / "o" / "decision.json").read_text())["history"]["k"] == 3


def test_dry_run_flag_wins_over_a_token(tmp_path: Path, pristine_config: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "not-a-real-token")
    res = _results(tmp_path, fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    out = tmp_path / "out"
    config = str(pristine_config)
    assert main(["pipeline", "--results", res, "--config", config, "--out-dir", str(out), "--dry-run"]) == 0
    assert json.loads((out / "pr" / "pr.json").read_text())["reason"] == "--dry-run"


def test_parity_failure_exits_3_reports_and_skips_the_pr(tmp_path: Path, pristine_config: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    res = _results(tmp_path, fx.pair("sliding", fx.sliding_params(4096), 3.0, candidate_parity=False))
    out = tmp_path / "out"
    config = str(pristine_config)
    args = ["pipeline", "--results", res, "--config", config, "--out-dir", str(out)]
    assert main([*args, "--margin", "1.5"]) == 3
    text = capsys.readouterr().out
    assert json.loads((out / "decision.json").read_text())["margin"] == 1.5
    assert (out / "report" / "report.md").is_file() and not (out / "pr").exists()
    assert (out / "history" / "history.json").is_file() and "  history ok" in text
    assert "  decide  FAILED (exit 3)" in text and "  pr      skipped" in text and "decide failed" in text
    assert text.rstrip().endswith("outcome: failed at decide (exit 3)")


def test_bad_results_exit_2_without_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["pipeline", "--results", str(tmp_path / "none.json"), "--out-dir", str(out)]) == 2
    assert not (out / "report").exists()
    assert "cannot read results file" in capsys.readouterr().err


def test_a_config_the_pr_cannot_name_is_refused_before_any_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """With a token the PR stage edits --config on the base branch: a path outside any checkout is
    refused at the start, not after decide, history and report ran on it."""
    config = fx.write_pristine_config(tmp_path / "elsewhere" / "base.yaml")
    monkeypatch.setenv("GITHUB_TOKEN", "ghs_fake")
    monkeypatch.setenv("GITHUB_REPOSITORY", "octo/nsa")
    out = tmp_path / "out"
    res = _results(tmp_path, fx.sweep("sliding", {1024: 2.0}))
    assert main(["pipeline", "--results", res, "--config", str(config), "--out-dir", str(out),
                 "--history-dir", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "--config must be a path inside the repository" in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "store").exists()


def test_a_stage_that_crashes_still_gets_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def stage(argv: list[str]) -> int:
        if argv[0] == "history":
            raise RuntimeError("a bug in history")
        return main(argv)

    out = tmp_path / "out"
    args = _args(results=_results(tmp_path, fx.sweep("sliding", {1024: 2.0}) + fx.calibration(2.0, fx.TIGHT)),
                 config=str(fx.write_pristine_config(tmp_path / "c.yaml")), out_dir=str(out))
    args.dry_run = True
    assert pipeline.run(args, stage=stage) == 1
    captured = capsys.readouterr()
    assert "RuntimeError: a bug in history" in captured.err
    assert "  history FAILED (exit 1)" in captured.out and captured.out.rstrip().endswith("failed at history (exit 1)")


def test_a_file_system_fault_of_the_pipeline_itself_gets_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Clearing an earlier run's files can fail too (a folder made read-only): exit 2, one line, the summary."""
    def clear(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pipeline, "_clear", clear)
    out = tmp_path / "out"
    rc = main(["pipeline", "--results", _results(tmp_path, fx.sweep("sliding", {1024: 2.0})), "--out-dir", str(out),
               "--dry-run"])
    captured = capsys.readouterr()
    errors = [x for x in captured.err.splitlines() if "error:" in x]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in captured.err
    assert f"{str(out / 'decision.json')!r} must be writable, got Permission denied; make its folder" in errors[0]
    assert "== pipeline summary ==" in captured.out and "outcome: failed at files (exit 2)" in captured.out


def _args(**kw: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_size_auto_follows_the_probed_device(tmp_path: Path) -> None:
    probed: list[str] = []

    def probe(answer: str) -> pipeline.Probe:
        return lambda: probed.append(answer) or answer

    cmd, device, size = pipeline.sweep_command(_args(), tmp_path / "r.json", probe("cuda"))
    assert (device, size) == ("cuda", "nightly")
    assert cmd[1:] == ["-m", "bench", "run", "--suites", "fa2,triton,calibration,auto,fast,decode,train,serve", "--size",
                       "nightly", "--device", "cuda", "--out", str(tmp_path / "r.json")]
    cmd, device, size = pipeline.sweep_command(_args(), tmp_path / "r.json", probe("cpu"))
    assert (device, size) == ("cpu", "smoke") and cmd[5] == "fa2,triton,calibration"  # CPU smoke stays short
    explicit = _args(size="full", device="cuda", bench_args="--gpus 2 --rep 50")
    cmd, device, size = pipeline.sweep_command(explicit, tmp_path / "r.json", probe("never"))
    assert probed == ["cuda", "cpu"] and (device, size) == ("cuda", "full")
    assert cmd[-4:] == ["--gpus", "2", "--rep", "50"] and cmd[5] == "fa2,triton,calibration,auto,fast,decode,train,serve"
    # An explicit size with device auto probes only to pick the suites; explicit suites are kept as given.
    assert pipeline.sweep_command(_args(size="nightly"), tmp_path / "r.json", probe("cpu"))[0][5] == \
        "fa2,triton,calibration"
    assert pipeline.sweep_command(_args(size="smoke", device="cuda"), tmp_path / "r.json", probe("never"))[0][5] == \
        "fa2,triton,calibration"
    assert pipeline.sweep_command(_args(size="full", suites="fa2"), tmp_path / "r.json", probe("never"))[0][5] == "fa2"
    assert pipeline.sweep_command(_args(device="cpu"), tmp_path / "r.json", probe("never"))[1:] == ("cpu", "smoke")


def test_a_failed_sweep_stops_the_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["pipeline", "--device", "cpu", "--size", "smoke", "--bench-args=--no-such-flag",
               "--out-dir", str(out)])
    assert rc == 2 and not (out / "decision.json").exists()
    text = capsys.readouterr().out
    assert "  sweep   FAILED (exit 2)" in text and "decide" not in text.split("== pipeline summary ==")[1]


def test_cpu_sweep_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real sweep subprocess on this CPU: FA-2 is recorded as unavailable and the report says so."""
    out = tmp_path / "out"
    rc = main(["pipeline", "--device", "cpu", "--suites", "fa2", "--config", CONFIG, "--out-dir", str(out),
               "--bench-args", "--backends sdpa,fa2 --rep 3 --warmup 1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = results.load(out / "results.json")
    assert doc["machine"]["sm"] == "cpu" and doc["run"]["size"] == "smoke"
    assert {c["status"] for c in doc["cases"] if c["backend"] != "sdpa"} == {"skipped"}
    assert "No FA-2 threshold can be proposed from this run:** these results come from a CPU machine" in (
        out / "report" / "report.md").read_text()
    assert "No FA-2 threshold can be proposed: these results come from a CPU machine" in (out / "report" / "summary.md").read_text()
    assert "--size smoke --device cpu" in text and "FA-2 unavailable: " in text
    assert "results from a CPU machine" in text and not (out / "pr").exists()
    assert text.rstrip().endswith("outcome: ok")


# --- a failed stage never shows an earlier run's files or an unvetted change -------------------

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

def test_pipeline_rejects_an_out_dir_that_is_a_file_before_any_stage(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    args = pipeline.argparse.Namespace(out_dir=str(tmp_path / "f"), results=["r.json"], config=None, margin=None,
                                       previous=None, dry_run=True)
    assert pipeline.run(args, stage=lambda argv: 0) == 2
    assert "--out-dir must be a folder" in capsys.readouterr().err
