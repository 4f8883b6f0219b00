"""Malformed results files, configs, decisions and flags, fed to every `ci` and `bench` subcommand.

Each case runs the CLI in-process through its `main(argv)` and must end with exit 2, one `error:`
line that names the cause and the fix (`...; <fix>`), no traceback, and no file written or
changed anywhere in the test's folder. The cases are generated: every bad results file goes to
every subcommand that reads results, every bad config to every reader of configs, and so on.
The OS faults (an unwritable folder, a file where a folder must be, a symlinked output folder, a
full disk) go to every subcommand that writes; a link in a folder that is published (the report
folder, the trend charts copied into it) to the stage that would publish it.

Two classes answer otherwise, as documented:
- A bad record in the history store (NSA_HISTORY_DIR) never blocks a run (docs/pipeline.md,
  "Bad records heal instead of blocking"): every reader of the store exits 0 with one `warning:`
  line that names the record, the cause and what happens to it; the record's bytes are never
  changed (a saved run moves it whole to quarantine/<model>/, a dry run leaves it), and nothing
  else that was there changes. A run whose own results are dated in the future is bad input (exit 2).
- Misuse of the library (`NSAAttention`, `NSAConfig`, `nsa.ops`) raises ValueError with one line
  and the fix, before it changes the layer's weights or the cache it was given.
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

from bench import results
from bench.cli import main as bench_main
from ci import history
from ci.__main__ import main as ci_main
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
    "created_at_yesterday": lambda: json.dumps(_edit(lambda d: d["run"].update(created_at="yesterday"))()).encode(),
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
    record: str = ""  # a bad history record (path under store/) the run must skip and heal, not exit 2 on
    saved: bool = True  # with `record`: the run saves itself, so the record moves to quarantine/


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


SLUG = history.gpu_slug(fx.machine()["gpu_name"])


def _earlier_record() -> Doc:
    """A good history record of an earlier run of the same GPU model (its own run id, date and results)."""
    doc = _good_results()
    doc["run"].update(id="run-0000", created_at="2025-02-28T12:00:00Z")
    return json.loads(history.dumps(history.build_record(doc)))


def _record(change: Callable[[Doc], Any]) -> Callable[[], bytes]:
    def make() -> bytes:
        doc = _earlier_record()
        change(doc)
        return json.dumps(doc).encode()
    return make


# name -> (the file's name in the model's folder, its bytes; None: a folder of that name)
BAD_RECORDS: dict[str, tuple[str, Callable[[], bytes | None]]] = {
    "truncated": ("run-0000.json", lambda: _record(lambda d: None)()[:200]),
    "not_utf8": ("run-0000.json", lambda: b"\xff" + _record(lambda d: None)()),
    "json_list": ("run-0000.json", lambda: b"[]"),
    "wrong_schema": ("run-0000.json", _record(lambda d: d.update(schema="nsa-history/0"))),
    "missing_cases": ("run-0000.json", _record(lambda d: d.pop("cases"))),
    "nan_median": ("run-0000.json", _record(lambda d: d["cases"][0].update(median_ms=float("nan")))),
    "dated_2999": ("run-0000.json", _record(lambda d: d["run"].update(created_at="2999-01-01T00:00:00Z"))),
    "dated_yesterday": ("run-0000.json", _record(lambda d: d["run"].update(created_at="yesterday"))),
    "another_model": ("run-0000.json", _record(lambda d: d.update(gpu="nvidia-h200"))),
    "renamed_copy": ("copy.json", _record(lambda d: None)),  # beside the good run-0000.json it copies
    "a_folder": ("run-0000.json", lambda: None),
}
# Readers of the store: {id: (argv, whether the run saves itself)}; the decision history rewrites is h/d.json.
STORE_READERS: dict[str, tuple[Callable[[Path], list[str]], bool]] = {
    "ci-history": (lambda t: ["history", "--results", str(t / "good.json"), "--decision", str(t / "h" / "d.json"),
                              "--config", str(t / "good.yaml"), "--out-dir", str(t / "h" / "out")], True),
    "ci-history-dry-run": (lambda t: ["history", "--results", str(t / "good.json"), "--decision",
                                      str(t / "h" / "d.json"), "--config", str(t / "good.yaml"), "--out-dir",
                                      str(t / "h" / "out"), "--dry-run"], False),
    "ci-pipeline": (lambda t: ["pipeline", "--results", str(t / "good.json"), "--config", str(t / "good.yaml"),
                               "--out-dir", str(t / "run")], True),
}


def _bad_record(name: str) -> Callable[[Path], None]:
    file, make = BAD_RECORDS[name]

    def setup(tmp: Path) -> None:
        _copy_decision("h")(tmp)
        folder = tmp / "store" / "history" / SLUG
        folder.mkdir(parents=True)
        if name == "renamed_copy":
            (folder / "run-0000.json").write_bytes(make())
        data = make()
        (folder / file).mkdir() if data is None else (folder / file).write_bytes(data)
    return setup


def _history_record_cases() -> list[Case]:
    """Every bad record to `ci history` (which saves the run, so the record moves to quarantine/); one also
    to a dry run (which leaves it) and to `ci pipeline` (every record goes through the same reader). And
    a run whose own results are dated in the future: exit 2."""
    store = lambda t: {"NSA_HISTORY_DIR": str(t / "store")}  # noqa: E731
    cases = []
    for name, (file, _) in BAD_RECORDS.items():
        readers = ["ci-history"] + (["ci-history-dry-run", "ci-pipeline"]
                                    if name == "dated_2999" else [])
        for reader in readers:
            argv, saved = STORE_READERS[reader]
            cases.append(Case(f"{reader}-record-{name}", "ci", argv, _bad_record(name), env=store,
                              record=f"history/{SLUG}/{file}", saved=saved))
    future = _write_made("bad.json", lambda: json.dumps(_edit(lambda d: d["run"].update(
        created_at="2999-01-01T00:00:00Z"))()).encode())
    cases += [
        Case("ci-history-results-dated-2999", "ci", lambda t: [
            "history", "--results", str(t / "bad.json"), "--decision", str(t / "decision.json"), "--config",
            str(t / "good.yaml"), "--out-dir", str(t / "out")], future, env=store),
        Case("ci-pipeline-results-dated-2999", "ci", lambda t: [
            "pipeline", "--results", str(t / "bad.json"), "--config", str(t / "good.yaml"), "--out-dir",
            str(t / "run")], future, env=store),
    ]
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
    # A link in a folder that is published: the report folder `ci pr` commits, the trend charts `ci
    # report` copies into it. A symlink or a hard link there would publish the file it names.
    pr = lambda t: ["pr", "--decision", str(t / "decision.json"), "--report-dir", str(t / "report"),  # noqa: E731
                    "--config", str(t / "good.yaml"), "--out-dir", str(t / "out"), "--dry-run"]
    report = lambda t: ["report", "--decision", str(t / "decision.json"), "--trends", str(t / "trends"),  # noqa: E731
                        "--out-dir", str(t / "out")]
    for kind in ("symlink", "hard-link"):
        cases += [Case(f"ci-pr-report-dir-holds-a-{kind}", "ci", pr, _secret_link("report/speedup_win.png", kind)),
                  Case(f"ci-report-trends-hold-a-{kind}", "ci", report,
                       _secret_link("trends/trend_prefill_T16384.png", kind))]
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


def _secret_link(name: str, kind: str) -> Callable[[Path], None]:
    """`name` (under the test's folder) as a symlink or a hard link to secret.txt, a file outside it."""
    def setup(tmp: Path) -> None:
        secret = tmp / "secret.txt"
        secret.write_text("GITHUB_TOKEN=ghs_not_a_real_token\n", encoding="utf-8")
        (tmp / name).parent.mkdir(exist_ok=True)
        (tmp / name).symlink_to(secret) if kind == "symlink" else os.link(secret, tmp / name)
    return setup


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
CASES = (_results_cases() + _config_cases() + _flag_cases() + _os_fault_cases() + _env_cases()
         + _history_record_cases())
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
    if case.record:  # the run goes on; its trend charts (most of its time) say nothing about the record
        from ci import trends

        monkeypatch.setattr(trends, "write_trends", lambda *a, **k: [])
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
    if case.record:
        _check_healed(case, tmp, before, rc, err)
        return
    assert rc == 2, f"exit {rc}, stderr:\n{err}"
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, f"want one error line, got:\n{err}"
    assert "; " in errors[0].split("error:", 1)[1], f"the error must say how to fix it: {errors[0]}"
    assert _snapshot(tmp) == before, "a rejected input must leave every file as it was"


def _check_healed(case: Case, tmp: Path, before: dict[str, str], rc: int | str | None, err: str) -> None:
    """A bad record is skipped with one warning and healed, never an error: see the module docstring."""
    assert rc == 0, f"a bad history record must not stop the run, got exit {rc}, stderr:\n{err}"
    assert "Traceback" not in err and "error:" not in err, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, f"want one warning line, got:\n{err}"
    assert warnings[0].startswith(f"warning: {case.record} ") and "; skipped, and moved to quarantine/" in warnings[0]
    after = _snapshot(tmp)
    kept = f"store/{case.record}"
    moved = f"store/{history.quarantine_path(case.record)}"
    for path, digest in before.items():
        if path == "h/d.json":
            continue  # the decision `ci history` rewrites, as it does for every run
        if path == kept or path.startswith(kept + "/"):
            where = moved + path[len(kept):] if case.saved else path
            assert after.get(where) == digest, f"the bad record must stay byte for byte, at {where}"
        else:
            assert after.get(path) == digest, f"{path} changed"
    new_records = {p for p in after if p.startswith(f"store/history/{SLUG}/") and p not in before}
    assert new_records == ({f"store/history/{SLUG}/run-0001.json"} if case.saved else set())


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


# --- misuse of the library: ValueError with one line and the fix, nothing changed -----------------

@dataclass(frozen=True)
class Misuse:
    id: str
    call: Callable[[Any, Any, Any], object]  # (layer, its prefilled cache, x) -> must raise


def _config(**change: Any) -> Any:
    from nsa import NSAConfig

    base = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                sel_block=16, sel_count=3, window=16)
    return NSAConfig(**{**base, **change})


def _layer(**change: Any) -> Any:
    from nsa import NSAAttention

    return NSAAttention(_config(**change))


def _other_projections(layer: Any, x: Any, **change: Any) -> Any:
    """q and gates of `layer`, with K/V from `layer`'s own projections changed by `change` (a callable on kv)."""
    q, kv, gates = layer.project(x)
    return q, change["kv"](kv), gates


def _misuses() -> list[Misuse]:
    import torch

    from nsa import NSACache, ops

    step = lambda m, cache, x: m.step(x[:, :1], cache)  # noqa: E731
    cases = [Misuse(f"cache-of-a-layer-with-{k}-{v}", lambda m, c, x, k=k, v=v: step(_layer(**{k: v}), c, x))
             for k, v in (("n_kv_heads", 1), ("window", 32), ("kv", "shared"), ("head_dim_v", 8))]
    cases += [
        Misuse("decode-attend-on-a-cache-of-another-layout", lambda m, c, x: _layer(window=32).decode_attend(
            torch.randn(1, 1, 4, 16), torch.rand(1, 1, 4, 3), c)),
        Misuse("a-hand-made-cache", lambda m, c, x: m.step(x[:, :1], NSACache())),
        Misuse("a-step-of-another-batch-size", lambda m, c, x: m.step(torch.randn(2, 1, 32), c)),
        Misuse("decode-attend-of-two-tokens", lambda m, c, x: m.decode_attend(
            torch.randn(1, 2, 4, 16), torch.rand(1, 2, 4, 3), c)),
    ]
    cases += [Misuse(f"config-scale-{v}", lambda m, c, x, v=v: _config(scale=v))
              for v in (float("inf"), float("nan"), -1.0, 0.0, True)]
    cases += [Misuse(f"config-{k}-{v}", lambda m, c, x, k=k, v=v: _config(**{k: v}))
              for k, v in (("sel_count", 10**9), ("sel_count", 2_000_000), ("window", 0), ("kv", "both"),
                           ("phi", "max"), ("n_kv_heads", 3))]
    cases.append(Misuse("select-blocks-sel_count-10**9", lambda m, c, x: ops.select_blocks(
        torch.randn(1, 20, 4, 16), torch.randn(1, 4, 2, 16), block=8, stride=4, sel_block=16, sel_count=10**9)))
    for shape in ((1, 0, 32), (0, 5, 32), (1, 5, 16)):
        name = "x".join(map(str, shape))
        cases += [Misuse(f"forward-of-{name}", lambda m, c, x, s=shape: m(torch.randn(*s))),
                  Misuse(f"prefill-of-{name}", lambda m, c, x, s=shape: m.prefill(torch.randn(*s)))]
    for branches in (("foo",), "cmp", ("cmp", "window")):
        cases += [Misuse(f"forward-branches-{branches!r}", lambda m, c, x, b=branches: m(x, branches=b)),
                  Misuse(f"step-branches-{branches!r}", lambda m, c, x, b=branches: m.step(x[:, :1], c, branches=b))]
    shared = lambda kv: _layer(kv="shared").project(torch.randn(1, 20, 32))[1]  # noqa: E731
    cases += [
        Misuse("attend-with-kv-of-a-shared-layer", lambda m, c, x: m.attend(*_other_projections(
            m, x, kv=lambda kv: shared(kv)))),
        Misuse("plan-with-kv-of-a-shared-layer", lambda m, c, x: m.plan(m.project(x)[0], shared(None))),
        Misuse("attend-with-v-of-dv-8", lambda m, c, x: m.attend(*_other_projections(
            m, x, kv=lambda kv: {**kv, "sel": (kv["sel"][0], kv["sel"][1][..., :8])}))),
        Misuse("attend-with-k-of-1-kv-head", lambda m, c, x: m.attend(*_other_projections(
            m, x, kv=lambda kv: {**kv, "win": (kv["win"][0][:, :, :1], kv["win"][1])}))),
    ]
    return cases


MISUSES = _misuses()


def _state(obj: Any, seen: dict[int, Any] | None = None) -> Any:
    """Every tensor and number reachable from `obj` (a layer's state dict, a cache and what it holds), copied."""
    import torch

    seen = {} if seen is None else seen  # id -> the object, held so that no id is reused while walking
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    if id(obj) in seen:
        return "<seen>"
    seen[id(obj)] = obj
    if isinstance(obj, dict):
        return {k: _state(v, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_state(v, seen) for v in obj]
    return {k: _state(v, seen) for k, v in vars(obj).items()} if hasattr(obj, "__dict__") else repr(obj)


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        # Bit for bit: a cache's buffers hold uninitialised memory past its length, NaN included.
        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.detach().contiguous().reshape(-1).view(torch.uint8)
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b))))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN equals NaN here


@pytest.mark.parametrize("misuse", MISUSES, ids=[m.id for m in MISUSES])
def test_module_misuse_raises_one_line_with_the_fix_and_changes_nothing(misuse: Misuse) -> None:
    import torch

    torch.manual_seed(0)
    layer = _layer()
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        _, cache = layer.prefill(x)
        before = (_state(layer.state_dict()), _state(cache))
        with pytest.raises(ValueError) as info:
            misuse.call(layer, cache, x)
    text = str(info.value)
    assert "\n" not in text and "; " in text, f"want one line with the fix: {text!r}"
    assert _same((_state(layer.state_dict()), _state(cache)), before), "a refused call must change nothing"
