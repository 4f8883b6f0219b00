"""Malformed results files, configs, decisions and flags, fed to every `ci` and `bench` subcommand.

Each case runs the CLI in-process through its `main(argv)` and must end with exit 2, one `error:`
line that names the cause and the fix (`...; <fix>`), no traceback, and no file written or
changed anywhere in the test's folder. The cases are generated: every bad results file goes to
every subcommand that reads results, every bad config to every reader of configs, and so on.
The OS faults (an unwritable folder, a file where a folder must be, a symlinked output folder, a
full disk) go to every subcommand that writes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main as bench_main
from ci.__main__ import main as ci_main
from nsa_contract import results
from tests.ci import fixtures as fx

Doc = dict[str, Any]


def _good_results() -> Doc:
    return fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0}) + fx.calibration(2.0, fx.TIGHT))


def _edit(change: Callable[[Doc], None]) -> Callable[[], Doc]:
    def make() -> Doc:
        doc = copy.deepcopy(_good_results())
        change(doc)
        return doc
    return make


def _ok_case(doc: Doc) -> Doc:
    return next(c for c in doc["cases"] if c["status"] == "ok" and c["suite"] == "fa2")


def _candidate_case(doc: Doc) -> Doc:
    return next(c for c in doc["cases"] if c.get("parity"))


def _set(path: str, value: Any, pick: Callable[[Doc], Doc] = _ok_case) -> Callable[[Doc], None]:
    def change(doc: Doc) -> None:
        target = pick(doc)
        *parents, last = path.split(".")
        for name in parents:
            target = target[name]
        target[last] = value
    return change


def _machine(field: str, value: Any) -> Callable[[Doc], None]:
    def change(doc: Doc) -> None:
        doc["machine"][field] = value
    return change


# name -> bytes of a bad results file
BAD_RESULTS: dict[str, Callable[[], bytes]] = {
    "truncated": lambda: json.dumps(_good_results()).encode()[:200],
    "not_utf8": lambda: b"\xff\xfe{" + json.dumps(_good_results()).encode(),
    "json_list": lambda: b"[]",
    "no_machine": lambda: json.dumps({k: v for k, v in _good_results().items() if k != "machine"}).encode(),
    "bool_samples": lambda: json.dumps(_edit(_set("timing.samples_ms", [True] * 30))()).encode(),
    "string_samples": lambda: json.dumps(_edit(_set("timing.samples_ms", ["1.0"] * 30))()).encode(),
    "empty_samples": lambda: json.dumps(_edit(_set("timing.samples_ms", []))()).encode(),
    "negative_sample": lambda: json.dumps(_edit(_set("timing.samples_ms", [-1.0] * 30))()).encode(),
    "nan_sample": lambda: json.dumps(_edit(_set("timing.samples_ms", [float("nan")] * 30))()).encode(),
    "int_sm": lambda: json.dumps(_edit(_machine("sm", 90))()).encode(),
    "empty_gpu_name": lambda: json.dumps(_edit(_machine("gpu_name", ""))()).encode(),
    "params_list": lambda: json.dumps(_edit(_set("params", [1, 2]))()).encode(),
    "params_string": lambda: json.dumps(_edit(_set("params", "T=1024"))()).encode(),
    "parity_passed_string": lambda: json.dumps(_edit(_set("parity.passed", "yes", _candidate_case))()).encode(),
    "parity_err_string": lambda: json.dumps(_edit(_set("parity.max_abs_err", "small", _candidate_case))()).encode(),
    "median_string": lambda: json.dumps(_edit(_set("timing.median_ms", "fast"))()).encode(),
    "ok_without_timing": lambda: json.dumps(_edit(_set("timing", None))()).encode(),
    "id_number": lambda: json.dumps(_edit(_set("id", 7))()).encode(),
    "deep_nesting": lambda: b"[" * 100000,
}

VALID_CONFIG = fx.pristine_config_text()
BAD_CONFIGS: dict[str, bytes] = {
    "not_utf8": b"\xff\xfe" + VALID_CONFIG.encode(),
    "bad_yaml": b"decide: {margin: [\n",
    "yaml_list": b"- 1\n- 2\n",
    "no_margin": VALID_CONFIG.replace("margin:", "margin_typo:").encode(),
    "margin_string": VALID_CONFIG.replace("margin: 1.2", "margin: big").encode(),
}


def _decision(tmp: Path) -> Doc:
    """A valid decision (made once per test by the real `ci decide`, then `ci history`, as `ci pr` needs)."""
    res, cfg, out = tmp / "_r.json", tmp / "_c.yaml", tmp / "_d.json"
    results.dump(_good_results(), res)
    cfg.write_text(VALID_CONFIG, encoding="utf-8")
    assert ci_main(["decide", "--results", str(res), "--config", str(cfg), "--out", str(out)]) == 0
    assert ci_main(["history", "--results", str(res), "--decision", str(out), "--config", str(cfg),
                    "--history-dir", str(tmp / "_store"), "--out-dir", str(tmp / "_h"), "--dry-run"]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    for p in (res, cfg, out):
        p.unlink()
    return doc


def _dec_edit(change: Callable[[Doc], None]) -> Callable[[Doc], bytes]:
    def make(good: Doc) -> bytes:
        doc = copy.deepcopy(good)
        change(doc)
        return json.dumps(doc).encode()
    return make


def _propose(value: int) -> Callable[[Doc], None]:
    def change(doc: Doc) -> None:
        b = doc["branches"]["win"]
        b["proposed"], b["changed"] = value, value != b["current"]
    return change


def _fail_a_cell(doc: Doc) -> None:
    doc["cells"][0]["verdict"] = "failed"


def _unheld_change(doc: Doc) -> None:
    """decide's own change (kept under lasting.raw by `ci history`) put back, though it did not last."""
    b = doc["branches"]["win"]
    raw = {c: e["lasting"]["raw"] for c, e in b["classes"].items() if e["lasting"]["raw"]}
    assert raw, "the good decision must hold a change that history held back"
    for c, r in raw.items():
        b["classes"][c].update(proposed=r["proposed"], changed=True)
    per_class = {c: e["proposed"] for c, e in b["classes"].items()}
    b["proposed"] = per_class if len(set(per_class.values())) > 1 else next(iter(per_class.values()))
    b["changed"] = b["proposed"] != b["current"]


# Bad for both `ci report` and `ci pr`.
BAD_DECISIONS: dict[str, Callable[[Doc], bytes]] = {
    "truncated": lambda good: json.dumps(good).encode()[:100],
    "not_utf8": lambda good: b"\xff" + json.dumps(good).encode(),
    "wrong_schema": _dec_edit(lambda d: d.update(schema="other/1")),
    "list": lambda good: b"[1, 2]",
    "no_branches": _dec_edit(lambda d: d.pop("branches")),
    "cells_not_list": _dec_edit(lambda d: d.update(cells={"a": 1})),
}
# Bad for `ci pr` only: a report can show them, a PR must not carry them.
BAD_FOR_PR: dict[str, Callable[[Doc], bytes]] = {
    "parity_failed_exit_3": _dec_edit(lambda d: d.update(exit_code=3)),
    "failed_cell": _dec_edit(_fail_a_cell),
    "proposed_minus_5": _dec_edit(_propose(-5)),
    "proposed_untested_length": _dec_edit(_propose(3000)),
    "proposed_bool": _dec_edit(_propose(True)),  # type: ignore[arg-type]
    "changed_lies": _dec_edit(lambda d: d["branches"]["win"].update(changed=not d["branches"]["win"]["changed"])),
    "no_history_verdict": _dec_edit(lambda d: d.pop("history")),  # decide's file, never through `ci history`
    "change_not_held": _dec_edit(_unheld_change),
}


@dataclass(frozen=True)
class Case:
    id: str
    cli: str  # "ci" or "bench"
    argv: Callable[[Path], list[str]]  # the folder holds good.json, good.yaml, decision.json, report/
    setup: Callable[[Path], None] = lambda tmp: None
    fault: str = ""  # "full-disk": run in a subprocess with no room to write; "read-only": ro/ is not writable
    env: Callable[[Path], dict[str, str]] = lambda tmp: {}  # environment values set for the run


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_bytes(data)
    return setup


def _write_made(name: str, make: Callable[[], bytes]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_bytes(make())
    return setup


def _results_cases() -> list[Case]:
    cases = []
    for name, make in BAD_RESULTS.items():
        setup = _write_made("bad.json", make)
        cases += [
            Case(f"ci-decide-results-{name}", "ci", lambda t: ["decide", "--results", str(t / "bad.json"), "--config",
                                                                 str(t / "good.yaml"), "--out", str(t / "out" / "d.json")], setup),
            Case(f"ci-pipeline-results-{name}", "ci", lambda t: ["pipeline", "--results", str(t / "bad.json"), "--config",
                                                                   str(t / "good.yaml"), "--out-dir", str(t / "out"),
                                                                   "--dry-run"], setup),
            Case(f"ci-report-previous-{name}", "ci", lambda t: ["report", "--decision", str(t / "decision.json"),
                                                                  "--previous", str(t / "bad.json"), "--out-dir",
                                                                  str(t / "report")], setup),
            Case(f"bench-merge-{name}", "bench", lambda t: ["merge", str(t / "good.json"), str(t / "bad.json"),
                                                              "--out", str(t / "out" / "m.json")], setup),
        ]
    for name in ("missing", "folder"):
        setup = (lambda tmp: (tmp / "bad.json").mkdir()) if name == "folder" else (lambda tmp: None)
        cases += [
            Case(f"ci-decide-results-{name}", "ci", lambda t: ["decide", "--results", str(t / "bad.json"), "--config",
                                                                 str(t / "good.yaml"), "--out", str(t / "out" / "d.json")], setup),
            Case(f"bench-merge-{name}", "bench", lambda t: ["merge", str(t / "bad.json"), "--out", str(t / "m.json")], setup),
        ]
    return cases


def _config_cases() -> list[Case]:
    cases = []
    for name, data in {**BAD_CONFIGS, "missing": None}.items():
        setup = _write("bad.yaml", data) if data is not None else (lambda tmp: None)
        cases += [
            Case(f"ci-decide-config-{name}", "ci", lambda t: ["decide", "--results", str(t / "good.json"), "--config",
                                                                str(t / "bad.yaml"), "--out", str(t / "out" / "d.json")], setup),
            Case(f"ci-pipeline-config-{name}", "ci", lambda t: ["pipeline", "--results", str(t / "good.json"), "--config",
                                                                  str(t / "bad.yaml"), "--out-dir", str(t / "out"),
                                                                  "--dry-run"], setup),
        ]
        if name in ("not_utf8", "missing"):  # `ci pr` edits the config's text; it does not decide with it
            cases.append(Case(f"ci-pr-config-{name}", "ci", lambda t: [
                "pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"), "--config",
                str(t / "bad.yaml"), "--out-dir", str(t / "out"), "--dry-run"], setup))
    return cases


def _decision_cases(good_decision: Doc) -> list[Case]:
    cases = []
    for name, make in BAD_DECISIONS.items():
        setup = _write("bad_decision.json", make(good_decision))
        cases.append(Case(f"ci-report-decision-{name}", "ci", lambda t: [
            "report", "--decision", str(t / "bad_decision.json"), "--out-dir", str(t / "out")], setup))
    for name, make in {**BAD_DECISIONS, **BAD_FOR_PR}.items():
        setup = _write("bad_decision.json", make(good_decision))
        cases.append(Case(f"ci-pr-decision-{name}", "ci", lambda t: [
            "pr", "--decision", str(t / "bad_decision.json"), "--report-dir", str(t / "report"), "--config",
            str(t / "good.yaml"), "--out-dir", str(t / "out"), "--dry-run"], setup))
    return cases


def _flag_cases() -> list[Case]:
    cases = []
    for margin in ("nan", "inf", "-inf", "-1", "0", "abc"):
        cases += [
            Case(f"ci-decide-margin-{margin}", "ci", lambda t, m=margin: [
                "decide", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), f"--margin={m}",
                "--out", str(t / "out" / "d.json")]),
            Case(f"ci-pipeline-margin-{margin}", "ci", lambda t, m=margin: [
                "pipeline", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), f"--margin={m}",
                "--out-dir", str(t / "out"), "--dry-run"]),
        ]
    cases += [
        Case("ci-report-out-dir-is-a-file", "ci", lambda t: [
            "report", "--decision", str(t / "decision.json"), "--out-dir", str(t / "good.yaml")]),
        Case("ci-pipeline-out-dir-is-a-file", "ci", lambda t: [
            "pipeline", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), "--out-dir",
            str(t / "good.yaml"), "--dry-run"]),
        Case("ci-pipeline-out-dir-under-a-file", "ci", lambda t: [
            "pipeline", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), "--out-dir",
            str(t / "good.yaml" / "out"), "--dry-run"]),
        Case("ci-pr-out-dir-is-a-file", "ci", lambda t: [
            "pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"), "--config",
            str(t / "good.yaml"), "--out-dir", str(t / "good.yaml"), "--dry-run"]),
        Case("ci-decide-out-is-a-folder", "ci", lambda t: [
            "decide", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), "--out", str(t / "report")]),
        Case("bench-merge-out-is-a-folder", "bench", lambda t: [
            "merge", str(t / "good.json"), "--out", str(t / "report")]),
        Case("bench-merge-mixed-sm", "bench", lambda t: ["merge", str(t / "good.json"), str(t / "bad.json"),
                                                         "--out", str(t / "m.json")],
             lambda tmp: results.dump(_edit(_machine("sm", "sm89"))(), tmp / "bad.json")),
        Case("bench-merge-mixed-gpu", "bench", lambda t: ["merge", str(t / "good.json"), str(t / "bad.json"),
                                                          "--out", str(t / "m.json")],
             lambda tmp: results.dump(_edit(_machine("gpu_name", "NVIDIA L4"))(), tmp / "bad.json")),
        Case("bench-run-out-is-a-folder", "bench", lambda t: [
            "run", "--suites", "fa2", "--size", "smoke", "--device", "cpu", "--out", str(t / "report")]),
        Case("bench-run-unknown-suite", "bench", lambda t: [
            "run", "--suites", "nope", "--device", "cpu", "--out", str(t / "out" / "r.json")]),
        Case("bench-list-unknown-suite", "bench", lambda t: ["list", "--suites", "nope"]),
        Case("ci-workflow-steps-missing", "ci", lambda t: ["workflow-steps", str(t / "nope.yml"), "--job", "gpu",
                                                           "--dry-run"]),
        Case("ci-workflow-steps-not-a-workflow", "ci", lambda t: ["workflow-steps", str(t / "good.yaml"), "--job",
                                                                  "gpu", "--dry-run"]),
        Case("ci-workflow-steps-not-utf8", "ci", lambda t: ["workflow-steps", str(t / "bad.yml"), "--job", "gpu",
                                                            "--dry-run"], _write("bad.yml", b"\xff\xfejobs: {}\n")),
    ]
    return cases


def _env_cases() -> list[Case]:
    """Bad environment values, each to the subcommands that read it: a config that is missing or not
    UTF-8 (NSA_CONFIG), a profile the config lacks, a threshold or switch that is no value (read by
    `bench run` before any cell, on a CPU too), and a history store that is a file."""
    bench_run = lambda t: ["run", "--suites", "fa2", "--size", "smoke", "--device", "cpu",  # noqa: E731
                           "--out", str(t / "out" / "r.json")]
    decide = lambda t: ["decide", "--results", str(t / "good.json"), "--out", str(t / "out" / "d.json")]  # noqa: E731
    pipeline = lambda t: ["pipeline", "--results", str(t / "good.json"), "--out-dir", str(t / "out"),  # noqa: E731
                          "--dry-run"]
    history = lambda t: ["history", "--decision", str(t / "decision.json"), "--results", str(t / "good.json"),  # noqa: E731
                         "--out-dir", str(t / "out")]
    bad_config = {"NSA_CONFIG-missing": lambda t: {"NSA_CONFIG": str(t / "missing.yaml")},
                  "NSA_CONFIG-not-utf8": lambda t: {"NSA_CONFIG": str(t / "bad.yaml")}}
    not_utf8 = _write("bad.yaml", b"\xff\xfe" + VALID_CONFIG.encode())
    cases = [Case(f"ci-{name}-{env_id}", "ci", argv, not_utf8, env=env)
             for env_id, env in bad_config.items()
             for name, argv in (("decide", decide), ("pipeline", pipeline), ("history", history))]
    cases += [Case(f"bench-run-{env_id}", "bench", bench_run, not_utf8, env=env) for env_id, env in bad_config.items()]
    for name, value in (("NSA_PROFILE", "junk"), ("NSA_PROFILE", "sm90 "), ("NSA_FA2_MIN_LEN_WIN", "abc"),
                        ("NSA_FA2_MIN_LEN_WIN", "-7"), ("NSA_USE_FA2", "maybe"), ("NSA_FA2_FORCE", "yes")):
        cases.append(Case(f"bench-run-{name}-{value.strip() or 'blank'}{'-space' if value != value.strip() else ''}",
                          "bench", bench_run, env=lambda t, n=name, v=value: {n: v}))
    cases += [Case(f"ci-{name}-NSA_HISTORY_DIR-is-a-file", "ci", argv, env=lambda t: {"NSA_HISTORY_DIR": str(t / "good.yaml")})
              for name, argv in (("pipeline", pipeline), ("history", history))]
    return cases


def _writers(out: Callable[[Path], Path]) -> dict[str, tuple[str, Callable[[Path], list[str]]]]:
    """Every subcommand that writes, with its output under `out(tmp)`: `{id: (cli, argv)}`. The
    history store of `ci history` and `ci pipeline` lies under it too, so that it is checked as well."""
    def o(t: Path, name: str) -> str:
        return str(out(t) / name)

    return {
        "ci-decide": ("ci", lambda t: ["decide", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"),
                                       "--out", o(t, "d.json")]),
        "ci-history": ("ci", lambda t: ["history", "--results", str(t / "good.json"), "--decision", o(t, "d.json"),
                                        "--config", str(t / "good.yaml"), "--history-dir", o(t, "store"),
                                        "--out-dir", o(t, "history")]),
        "ci-report": ("ci", lambda t: ["report", "--decision", str(t / "decision.json"), "--out-dir", o(t, "report")]),
        "ci-pr": ("ci", lambda t: ["pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"),
                                   "--config", str(t / "good.yaml"), "--out-dir", o(t, "pr"), "--dry-run"]),
        "bench-merge": ("bench", lambda t: ["merge", str(t / "good.json"), "--out", o(t, "m.json")]),
        "ci-pipeline": ("ci", lambda t: ["pipeline", "--results", str(t / "good.json"), "--config",
                                         str(t / "good.yaml"), "--out-dir", o(t, "run"), "--history-dir",
                                         o(t, "store"), "--dry-run"]),
    }


def _copy_decision(into: str) -> Callable[[Path], None]:
    """`ci history` rewrites the decision it is given: a copy of the good one in `into`."""
    def setup(tmp: Path) -> None:
        (tmp / into).mkdir(exist_ok=True)
        (tmp / into / "d.json").write_bytes((tmp / GOOD_DECISION_PLACEHOLDER).read_bytes())
    return setup


def _os_fault_cases() -> list[Case]:
    cases = []
    # A file where a folder must be: the output folder itself, or a folder above it.
    for name, cli_argv in _writers(lambda t: t / "good.yaml" / "sub").items():
        cases.append(Case(f"{name}-out-under-a-file", *cli_argv))
    # The folder cannot be written (its mode; as root, which may write anyway, os.access says so).
    for name, cli_argv in _writers(lambda t: t / "ro").items():
        cases.append(Case(f"{name}-out-not-writable", *cli_argv, _copy_decision("ro"), fault="read-only"))
    # No room to write: `ulimit -f 0` in a subprocess (SIGXFSZ ignored, as Python does, so a write
    # fails with EFBIG as on a full disk). Every stage's first write fails.
    for name, cli_argv in _writers(lambda t: t / "full").items():
        cases.append(Case(f"{name}-full-disk", *cli_argv, _copy_decision("full"), fault="full-disk"))
    # Symlinked output folders: one that the stage replaces as a whole, and a broken one.
    link = _link("link", "report")
    cases += [
        Case("ci-report-out-dir-is-a-symlink", "ci", lambda t: ["report", "--decision", str(t / "decision.json"),
                                                                "--out-dir", str(t / "link")], link),
        Case("ci-pr-out-dir-is-a-symlink", "ci", lambda t: [
            "pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"), "--config",
            str(t / "good.yaml"), "--out-dir", str(t / "link"), "--dry-run"], link),
    ]
    broken = _link("link", "gone")
    for name, cli_argv in _writers(lambda t: t / "link").items():
        cases.append(Case(f"{name}-out-is-a-broken-symlink", *cli_argv, broken))
    # The path that is a file, for the folders `ci history` writes besides its --out-dir.
    cases += [
        Case("ci-history-history-dir-is-a-file", "ci", lambda t: [
            "history", "--results", str(t / "good.json"), "--decision", str(t / "h" / "d.json"), "--config",
            str(t / "good.yaml"), "--history-dir", str(t / "good.yaml"), "--out-dir", str(t / "h" / "out")],
            _copy_decision("h")),
        Case("ci-history-out-dir-is-a-file", "ci", lambda t: [
            "history", "--results", str(t / "good.json"), "--decision", str(t / "h" / "d.json"), "--config",
            str(t / "good.yaml"), "--history-dir", str(t / "h" / "store"), "--out-dir", str(t / "good.yaml")],
            _copy_decision("h")),
        Case("ci-pipeline-history-dir-is-a-file", "ci", lambda t: [
            "pipeline", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"), "--out-dir",
            str(t / "run"), "--history-dir", str(t / "good.yaml")]),
    ]
    return cases


def _link(name: str, to: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).symlink_to(to, target_is_directory=True)
    return setup


def _read_only(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ro/ (with what the case put there) is not writable: by its mode, and, for root, whom the mode
    does not stop, by os.access, as a read-only mount would answer."""
    ro = tmp / "ro"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access

        def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
            where = Path(os.path.abspath(path))
            inside = where == ro or ro in where.parents
            return False if inside and mode & os.W_OK else real(path, mode, *args, **kwargs)
        monkeypatch.setattr(os, "access", access)


FULL_DISK = """
import resource, signal, sys
import bench.cli, ci.__main__, ci.decide, ci.history_cmd, ci.plots, ci.report, ci.trends
ci.__main__.build_parser()  # registers (imports) every stage before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
main = ci.__main__.main if sys.argv[1] == "ci" else bench.cli.main
sys.exit(main(sys.argv[2:]))
"""


def _full_disk(case: Case, tmp: Path) -> tuple[int, str]:
    """Run `case` in a subprocess that may not write a byte to any file (`ulimit -f 0`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN",
                                                             "GITHUB_OUTPUT", "GITHUB_ACTIONS", "NSA_HISTORY_DIR")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, case.cli, *case.argv(tmp)], capture_output=True,
                          text=True, env=env, cwd=tmp, timeout=300)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def good_decision(tmp_path_factory: pytest.TempPathFactory) -> Doc:
    return _decision(tmp_path_factory.mktemp("decision"))


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with a digest of its content ("dir" for folders, the target for a symlink)."""
    return {str(p.relative_to(root)): f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
            else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


GOOD_DECISION_PLACEHOLDER = "decision.json"
CASES = _results_cases() + _config_cases() + _flag_cases() + _os_fault_cases() + _env_cases()
# The same order as _decision_cases builds them (that needs the real decision, made in a fixture).
DECISION_CASE_IDS = ([f"ci-report-decision-{n}" for n in BAD_DECISIONS]
                     + [f"ci-pr-decision-{n}" for n in {**BAD_DECISIONS, **BAD_FOR_PR}])


def _run(case: Case, tmp: Path, good_decision: Doc, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN", "GITHUB_OUTPUT", "GITHUB_ACTIONS"):
        monkeypatch.delenv(name, raising=False)
    results.dump(_good_results(), tmp / "good.json")
    (tmp / "good.yaml").write_text(VALID_CONFIG, encoding="utf-8")
    (tmp / GOOD_DECISION_PLACEHOLDER).write_text(json.dumps(good_decision), encoding="utf-8")
    (tmp / "report").mkdir()
    (tmp / "report" / "report.md").write_text("# report\n", encoding="utf-8")
    case.setup(tmp)
    for name, value in case.env(tmp).items():
        monkeypatch.setenv(name, value)
    if case.fault == "read-only":
        _read_only(tmp, monkeypatch)
    before = _snapshot(tmp)
    main = ci_main if case.cli == "ci" else bench_main
    if case.fault == "full-disk":
        rc, err = _full_disk(case, tmp)
    else:
        try:
            rc = main(case.argv(tmp))
        except SystemExit as exc:  # argparse rejects a flag's value
            rc = exc.code
        err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}, stderr:\n{err}"
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, f"want one error line, got:\n{err}"
    assert "; " in errors[0].split("error:", 1)[1], f"the error must say how to fix it: {errors[0]}"
    assert _snapshot(tmp) == before, "a rejected input must leave every file as it was"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case: Case, tmp_path: Path, good_decision: Doc,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _run(case, tmp_path, good_decision, monkeypatch, capsys)


@pytest.mark.parametrize("index", range(len(DECISION_CASE_IDS)), ids=DECISION_CASE_IDS)
def test_bad_decision_exits_2_with_one_line_and_writes_nothing(index: int, tmp_path: Path, good_decision: Doc,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _run(_decision_cases(good_decision)[index], tmp_path, good_decision, monkeypatch, capsys)


def test_zero_time_calibration_samples_decide_without_a_traceback(tmp_path: Path) -> None:
    """Zero times are valid (below the timer's resolution); the A/A pair is left out of the noise floor."""
    doc = _good_results()
    for case in doc["cases"]:
        if case["suite"] == "calibration":
            case["timing"] = results.timing_summary([0.0] * 30)
    results.dump(doc, tmp_path / "r.json")
    (tmp_path / "c.yaml").write_text(VALID_CONFIG, encoding="utf-8")
    assert ci_main(["decide", "--results", str(tmp_path / "r.json"), "--config", str(tmp_path / "c.yaml"),
                    "--out", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["noise_floor"]["cases"] == []


def test_the_good_inputs_pass(tmp_path: Path, good_decision: Doc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same commands with the good files succeed, so each bad case fails for its own reason."""
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN", "GITHUB_OUTPUT"):
        monkeypatch.delenv(name, raising=False)
    results.dump(_good_results(), tmp_path / "good.json")
    (tmp_path / "good.yaml").write_text(VALID_CONFIG, encoding="utf-8")
    (tmp_path / "decision.json").write_text(json.dumps(good_decision), encoding="utf-8")
    t = tmp_path
    assert ci_main(["decide", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"),
                    "--out", str(t / "d.json")]) == 0
    assert ci_main(["report", "--decision", str(t / "decision.json"), "--out-dir", str(t / "report")]) == 0
    assert ci_main(["pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"), "--config",
                    str(t / "good.yaml"), "--out-dir", str(t / "pr"), "--dry-run"]) == 0
    assert bench_main(["merge", str(t / "good.json"), "--out", str(t / "m.json")]) == 0
