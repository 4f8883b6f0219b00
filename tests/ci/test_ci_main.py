"""`python -m ci decide` and `python -m ci report`: files, printed lines, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ci.__main__ import SUBCOMMANDS, main
from nsa_contract import results
from tests.ci import fixtures as fx

REPO = Path(__file__).resolve().parents[2]


def write_results(tmp_path: Path, cases: list, name: str = "results.json", sm: str = "sm90") -> Path:
    return results.dump(fx.document(cases, sm=sm), tmp_path / name)


def test_decide_then_report(tmp_path: Path, pristine_config: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    res = write_results(tmp_path, fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    out = tmp_path / "out" / "decision.json"
    assert main(["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Only class g4 was measured, so the value to write names every class (a YAML flow mapping).
    win = next(x for x in lines if x.startswith("win "))
    assert win.startswith("win sm90.fa2_min_len_win: -1 -> {g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}: g4: ")
    cmp = next(x for x in lines if x.startswith("cmp "))
    assert cmp.startswith("cmp sm90.fa2_min_len_cmp: -1 (unchanged): keeping -1: no deciding FA-2 cell")
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["results_files"] == [str(res)] and doc["branches"]["win"]["classes"]["g4"]["proposed"] == 2048
    assert main(["report", "--decision", str(out), "--out-dir", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "speedup_win.png").is_file()


def test_decide_exits_3_on_parity_failure_and_still_writes(tmp_path: Path, pristine_config: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    res = write_results(tmp_path, fx.pair("sliding", fx.sliding_params(4096), 3.0, candidate_parity=False))
    out = tmp_path / "decision.json"
    assert main(["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]) == 3
    assert "1 parity failure(s)" in capsys.readouterr().err
    assert json.loads(out.read_text(encoding="utf-8"))["exit_code"] == 3


def test_margin_flag_overrides_config(tmp_path: Path, pristine_config: Path) -> None:
    res = write_results(tmp_path, fx.sweep("sliding", {4096: 1.5}))
    out = tmp_path / "d.json"
    args = ["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]
    assert main([*args, "--margin", "2"]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["margin"] == 2.0 and doc["branches"]["win"]["classes"]["g4"]["proposed"] == -1


@pytest.mark.parametrize("problem", ["missing", "mixed_sm", "bad_config", "bad_json"])
def test_bad_input_exits_2_with_a_message(tmp_path: Path, pristine_config: Path,
                                          capsys: pytest.CaptureFixture[str], problem: str) -> None:
    res = write_results(tmp_path, fx.sweep("sliding", {1024: 2.0}))
    args = ["decide", "--results", str(res), "--config", str(pristine_config), "--out",
            str(tmp_path / "d.json")]
    expected = {"missing": "cannot read results file", "mixed_sm": "one GPU architecture",
                "bad_config": "threshold key runtime.fa2_min_len_cmpp is unknown; did you mean runtime.fa2_min_len_cmp?",
                "bad_json": "is not valid JSON"}[problem]
    if problem == "missing":
        args[2] = str(tmp_path / "nope.json")
    elif problem == "mixed_sm":
        args.insert(3, str(write_results(tmp_path, fx.sweep("sliding", {2048: 2.0}), "l4.json", sm="sm89")))
    elif problem == "bad_config":
        (tmp_path / "c.yaml").write_text("decide: {margin: 1.2, confidence: 0.95}\n"
                                         "runtime: {fa2_min_len_win: -1, fa2_min_len_cmpp: -1}\n", encoding="utf-8")
        args[4] = str(tmp_path / "c.yaml")
    else:
        res.write_text("{", encoding="utf-8")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err
    assert not (tmp_path / "d.json").exists()


def test_report_bad_decision_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--decision", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 2
    assert "cannot read decision file" in capsys.readouterr().err


def test_help_and_registry() -> None:
    assert {"decide", "report"} <= set(SUBCOMMANDS)
    proc = subprocess.run([sys.executable, "-m", "ci", "decide", "--help"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert "--results" in proc.stdout and "Exit 0 ok, 2 bad input, 3 parity failure" in " ".join(proc.stdout.split())
    proc = subprocess.run([sys.executable, "-m", "ci"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "decide" in proc.stderr


def test_ci_never_imports_torch() -> None:
    code = ("import sys, ci.__main__, ci.report, ci.plots, ci.decide; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_empty_margin_means_the_configs(tmp_path: Path, pristine_config: Path) -> None:
    """An unset workflow input expands to "": decide then uses decide.margin from the config."""
    res = write_results(tmp_path, fx.sweep("sliding", {4096: 1.5}))
    out = tmp_path / "d.json"
    args = ["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]
    assert main([*args, "--margin", ""]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["margin"] == 1.2
    with pytest.raises(SystemExit) as exc:
        main(["decide", "--results", str(res), "--margin", "fast"])
    assert exc.value.code == 2


def test_report_appends_the_summary(tmp_path: Path, pristine_config: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    res = write_results(tmp_path, fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))
    decision = tmp_path / "decision.json"
    config = str(pristine_config)
    assert main(["decide", "--results", str(res), "--config", config, "--out", str(decision)]) == 0
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("# earlier step\n", encoding="utf-8")
    args = ["report", "--decision", str(decision), "--out-dir", str(tmp_path / "rep")]
    assert main([*args, "--summary-to", str(step_summary)]) == 0
    summary = (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")
    assert step_summary.read_text(encoding="utf-8") == "# earlier step\n" + summary
    assert f"appended {tmp_path / 'rep' / 'summary.md'} to {step_summary}" in capsys.readouterr().out
    assert main([*args, "--summary-to", ""]) == 0  # "$GITHUB_STEP_SUMMARY" outside Actions
    assert "summary not appended" in capsys.readouterr().err
    assert step_summary.read_text(encoding="utf-8") == "# earlier step\n" + summary
    assert main([*args, "--summary-to", str(tmp_path / "no" / "such" / "dir" / "f.md")]) == 2
    assert "cannot append the summary to" in capsys.readouterr().err
