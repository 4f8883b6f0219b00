"""`python -m ci pipeline`: the project's main job, sweep -> decide -> history -> report -> PR, on any machine.

Stages, in the order of ci.stages (the GPU workflow runs the same list), each a file under
--out-dir (default out/):
  sweep   `python -m bench run` in a subprocess (ci never imports torch) -> results.json.
          `--size auto` asks a subprocess whether torch sees a GPU: CUDA -> nightly, CPU -> smoke
          (FA-2 needs CUDA, so a CPU run records it as unavailable and the report says so; the triton
          suite runs on a CPU only under TRITON_INTERPRET=1, and CPU timings never propose).
          Suites by default (nsa_contract.suites): the `default` list, fa2,triton,calibration; for a
          nightly or full sweep on CUDA the `nightly` list, which adds auto,fast,decode,train,serve (auto against
          the best plan, the fast path at the paper layout, decode steps, training steps), as the GPU
          workflow's sweep; a CPU smoke run stays short.
          Skipped with --results, which decides on existing results files instead.
  decide  -> decision.json (exit 3 on parity failures; history and the report still run, the PR does not).
  history `python -m ci history` -> history/ (history.json, trends/*.png, issue files), and rewrites
          decision.json so a threshold changes only when the last K runs of this GPU model agree.
          The runs are kept in --history-dir (default: $NSA_HISTORY_DIR, else <out-dir>/history-store,
          which this command never clears), so the next pipeline run on this machine compares with
          this one; exit 4 when a case regressed (everything is still written, and the report and the
          PR still run). --dry-run saves no history and opens no issue.
  report  -> report/ (report.md, summary.md, speedup and trend plots); runs once history rewrote
          the decision.
  pr      -> pr/ (pr_body.md, config.diff, pr.json). A dry run unless GITHUB_TOKEN or GH_TOKEN is set
          and --dry-run is not given. Skipped for a CPU machine's results (thresholds belong to a
          GPU profile), after a failed decide or report, and when history did not rewrite the decision.
Exit code: that of the first stage that failed (sweep 1/2, decide 2/3, history 1/2/4, report 2,
pr 1/2), else 0. 4 means a regression: a case is significantly slower than in this GPU model's
history (the report lists it first).

Every path argument (--out-dir, --history-dir, and --config where the PR stage will send), and the
date of every --results file (history refuses a run dated in the future), is checked before the
first stage writes. A stage that fails, a file-system fault included (one line with the
path and the fix, exit 2), still ends with the summary.

--out-dir holds one run: before a stage runs, the file or folder it writes is removed (the history
store excepted), and the summary reads a stage's file only when that stage succeeded in this run.
A failed stage therefore never shows (or leaves behind for `ci pr`) the decision, report or PR
outcome of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ci import stages
from ci.args import env_dry_run, parse_margin
from nsa_contract import exits
from nsa_contract import suites as lists
from nsa_contract.paths import InputError, check_out_dir, file_system_error
from nsa_contract.values import text

HELP = "the main job: sweep this machine, decide, report, threshold PR (dry run without a token)"
GPU_SIZES = ("nightly", "full")
HISTORY_ENV, HISTORY_STORE = "NSA_HISTORY_DIR", "history-store"
SIZES = ("auto", "smoke", "nightly", "full")
SIZE_FOR_DEVICE = {"cpu": "smoke", "cuda": "nightly"}
PROBE = "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"

Stage = Callable[[list[str]], int]  # `python -m ci <argv>` in this process; returns its exit code
Probe = Callable[[], str]  # "cuda" or "cpu"


@dataclass
class StageResult:
    name: str
    status: str  # ok, failed, skipped
    rc: int = 0
    seconds: float | None = None
    detail: str = ""


class StageFailed(Exception):
    def __init__(self, message: str, rc: int = exits.ERROR) -> None:
        super().__init__(message)
        self.rc = rc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suites", default=None,
                   help=f"bench suites to sweep (default: {lists.joined(lists.DEFAULT)}, plus "
                        f"{lists.joined(lists.GPU)} for a nightly or full sweep on CUDA: the `nightly` list)")
    p.add_argument("--size", choices=SIZES, default="auto",
                   help="sweep size; auto: nightly when torch sees a GPU, smoke otherwise (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device for the sweep (default: %(default)s, as `python -m bench run`)")
    p.add_argument("--bench-args", default="",
                   help="more `python -m bench run` arguments in one string, e.g. --bench-args=\"--gpus 2 --rep 50\"")
    p.add_argument("--results", nargs="+", metavar="RESULTS.json",
                   help="skip the sweep and decide on these results files (shards of one run)")
    p.add_argument("--config", default=None,
                   help="config to decide against (default: $NSA_CONFIG when set, else configs/base.yaml of the "
                        "checkout, else the installed copy)")
    p.add_argument("--margin", type=parse_margin, default=None,
                   help="speedup the interval's lower bound must clear (default: the config's decide.margin)")
    p.add_argument("--previous", default=None, help="previous results or decision file for the report")
    p.add_argument("--out-dir", default="out", help="folder for every stage's files (default: %(default)s)")
    p.add_argument("--history-dir", default=None, metavar="DIR",
                   help=f"run history kept between pipeline runs (default: ${HISTORY_ENV} when set, else "
                        f"<out-dir>/{HISTORY_STORE})")
    p.add_argument("--dry-run", action="store_true",
                   help="never send the PR or touch the regression issue, even with a token; save no history")


def probe_device() -> str:
    """"cuda" when torch in a subprocess sees a GPU, else "cpu" (ci itself never imports torch)."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StageFailed(f"cannot tell whether a GPU is visible ({exc}); pass --size and --device") from None
    answer = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode != 0 or answer[0] not in SIZE_FOR_DEVICE:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StageFailed(f"cannot tell whether a GPU is visible: `python -c \"{PROBE}\"` failed ({why}); "
                          "install torch (make setup) or pass --size and --device")
    return answer[0]


def sweep_command(args: argparse.Namespace, out_file: Path, probe: Probe) -> tuple[list[str], str, str]:
    """The `python -m bench run` command line, with the device and size it will use."""
    device, size = args.device, args.size
    if size == "auto":
        if device == "auto":
            device = probe()
        size = SIZE_FOR_DEVICE[device]
    cmd = [sys.executable, "-m", "bench", "run", "--suites", suites(args, device, size, probe), "--size", size,
           "--device", device, "--out", str(out_file), *shlex.split(args.bench_args)]
    return cmd, device, size


def suites(args: argparse.Namespace, device: str, size: str, probe: Probe) -> str:
    """--suites, or the default: the GPU suites join it for a nightly or full sweep on CUDA only."""
    if args.suites is not None:
        return str(args.suites)
    if size not in GPU_SIZES:
        return lists.joined(lists.DEFAULT)
    on_cuda = device == "cuda" or (device == "auto" and probe() == "cuda")
    return lists.joined(lists.NIGHTLY if on_cuda else lists.DEFAULT)


def history_dir(args: argparse.Namespace, out: Path) -> str:
    """--history-dir, else $NSA_HISTORY_DIR (when not empty), else <out-dir>/history-store."""
    return args.history_dir or os.environ.get(HISTORY_ENV, "").strip() or str(out / HISTORY_STORE)


def _sweep(args: argparse.Namespace, out_file: Path, probe: Probe) -> str:
    cmd, device, size = sweep_command(args, out_file, probe)
    print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0 or not out_file.is_file():
        raise StageFailed(f"`python -m bench run` exited {rc}" + ("" if out_file.is_file() else
                          f" without writing {out_file}"), rc or exits.ERROR)
    machine = _read_json(out_file).get("machine", {})
    return f"{out_file} ({machine.get('gpu_name', device)}, size {size}, suites {cmd[cmd.index('--suites') + 1]})"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _call(stage: Stage, argv: list[str]) -> int:
    print("$ " + shlex.join(["python", "-m", "ci", *argv]), flush=True)
    try:
        return stage(argv)
    except SystemExit as exc:  # argparse inside the stage: a bad value passed through
        return exc.code if isinstance(exc.code, int) else 2
    except Exception:  # a bug in the stage: its traceback, then the other stages' outcome and the summary
        traceback.print_exc()
        return exits.ERROR


def _timed(name: str, fn: Callable[[], tuple[int, str]]) -> StageResult:
    print(f"\n== pipeline: {name} ==", flush=True)
    start = time.perf_counter()
    try:
        rc, detail = fn()
    except StageFailed as exc:
        rc, detail = exc.rc, str(exc)
        print(f"error: {exc}", file=sys.stderr)
    seconds = time.perf_counter() - start
    return StageResult(name, "ok" if rc == 0 else "failed", rc, seconds, detail)


def _clear(path: Path) -> None:
    """Remove an earlier run's output of the stage about to write `path`."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return
    print(f"removed {path} from an earlier run", flush=True)


def check_paths(args: argparse.Namespace, out: Path) -> None:
    """Every path the stages will write, and the --config the PR stage will name in the repository,
    checked before the first stage writes: a bad one must not fail a later stage after an earlier one
    wrote (a decision rewritten, a run saved to the store)."""
    check_out_dir(out, "--out-dir")
    store = args.history_dir or os.environ.get(HISTORY_ENV, "").strip()
    try:
        dry = args.dry_run or env_dry_run(os.environ)
    except InputError:  # refused by the history and PR stages themselves, in the summary
        dry = False
    if store:
        check_out_dir(store, "--history-dir" if args.history_dir else HISTORY_ENV, writable=not dry)
    if args.config and not dry and (os.environ.get("GITHUB_TOKEN") or os.environ.get("GH_TOKEN")):
        from ci.pr_cmd import repo_path
        from ci.pr_plan import PlanError

        try:
            repo_path(args.config)
        except PlanError as exc:
            raise InputError(f"{exc} (the PR stage edits that path on the base branch)") from None
    for path in args.results or ():
        check_created_at(path)


def check_created_at(path: str) -> None:
    """A results file dated in the future is refused by the history stage, after decide has written its
    decision: refused here, before any stage writes. A file that cannot be read or parsed is left to
    decide, which names what is wrong with it."""
    from ci import history, history_cmd

    try:
        created_at = json.loads(Path(path).read_text(encoding="utf-8"))["run"]["created_at"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        return
    try:
        history.check_created_at(created_at, f"--results {path}")
    except history.HistoryError as exc:
        raise InputError(f"{exc}; {history_cmd.FUTURE_FIX}") from None


def run(args: argparse.Namespace, stage: Stage, probe: Probe = probe_device) -> int:
    """Run every stage `args` asks for; `stage` runs one `python -m ci` subcommand in-process."""
    out = Path(args.out_dir)
    try:
        check_paths(args, out)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.BAD_INPUT
    done: list[StageResult] = []
    try:
        return _stages(args, stage, probe, out, done)
    except OSError as exc:  # the pipeline's own file work (clearing an earlier run's files, the sweep's folder)
        message = file_system_error(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        done.append(StageResult("files", "failed", exits.BAD_INPUT, detail=message))
        return _finish(done, {}, None)


@dataclass
class _Run:
    """One pipeline run, as its stages (ci.stages, in order) see it."""

    args: argparse.Namespace
    stage: Stage
    probe: Probe
    out: Path
    done: list[StageResult]
    files: list[str] = field(default_factory=list)  # the results files decided on
    doc: dict[str, Any] = field(default_factory=dict)  # the decision as last read ({}: none this run)
    stop: bool = False  # no later stage runs (and none is listed)

    def path(self, name: str) -> Path:
        """Where stage `name` writes (ci.stages), under --out-dir."""
        return self.out / stages.get(name).writes

    def vetted(self) -> bool:
        """Whether `ci history` rewrote the decision this run (as the workflow's `steps.history.outputs.history
        != ''`: history.json is written from then on, also with exit 4 or a GitHub error after it)."""
        return (self.path("history") / "history.json").is_file()


def _stages(args: argparse.Namespace, stage: Stage, probe: Probe, out: Path, done: list[StageResult]) -> int:
    run = _Run(args, stage, probe, out, done)
    for step in stages.STAGES:
        done.append(RUNNERS[step.name](run))
        if run.stop:
            break
    report_ok = any(r.name == "report" and r.status == "ok" for r in done)
    return _finish(done, run.doc, run.path("report") if report_ok else None)


def _run_sweep(run: _Run) -> StageResult:
    if run.args.results:
        run.files = list(run.args.results)
        return StageResult("sweep", "skipped", detail="--results " + " ".join(run.files))
    results_file = run.path("sweep")
    run.files = [str(results_file)]
    run.out.mkdir(parents=True, exist_ok=True)
    _clear(results_file)
    result = _timed("sweep", lambda: (0, _sweep(run.args, results_file, run.probe)))
    run.stop = result.status == "failed"
    return result


def _run_decide(run: _Run) -> StageResult:
    margin = [] if run.args.margin is None else ["--margin", repr(run.args.margin)]
    config = [] if run.args.config is None else ["--config", run.args.config]
    for later in stages.STAGES[stages.NAMES.index("decide"):]:  # never show an earlier run's files
        _clear(run.path(later.name))
    decision = run.path("decide")
    result = _timed("decide", lambda: (_call(run.stage, ["decide", "--results", *run.files, *config, *margin,
                                                         "--out", str(decision)]), str(decision)))
    # Exit 3 (parity failure) still writes the decision, and history and the report show the failures.
    run.doc = _read_json(decision) if result.rc in (0, exits.FAILED_CASES) else {}
    run.stop = not run.doc
    return result


def _run_history(run: _Run) -> StageResult:
    result = _history(run.args, run.stage, run.files, run.path("decide"), run.path("history"),
                      history_dir(run.args, run.out))
    run.doc = _read_json(run.path("decide"))
    return result


def _run_report(run: _Run) -> StageResult:
    if not run.vetted():
        return StageResult("report", "skipped", detail="history did not rewrite the decision")
    previous = ["--previous", run.args.previous] if run.args.previous else []
    report_dir = run.path("report")
    return _timed("report", lambda: (_call(run.stage, ["report", "--decision", str(run.path("decide")), *previous,
                                                        "--trends", str(run.path("history") / "trends"),
                                                        "--out-dir", str(report_dir)]), str(report_dir)))


def _run_pr(run: _Run) -> StageResult:
    if not run.vetted():
        return StageResult("pr", "skipped", detail="history did not rewrite the decision")
    return _pr(run.args, run.stage, run.doc, run.path("decide"), run.path("report"), run.path("pr"), run.done)


RUNNERS: dict[str, Callable[[_Run], StageResult]] = {
    "sweep": _run_sweep, "decide": _run_decide, "history": _run_history, "report": _run_report, "pr": _run_pr,
}


def _history(args: argparse.Namespace, stage: Stage, files: Sequence[str], decision: Path, out_dir: Path,
             store: str) -> StageResult:
    config = ["--config", args.config] if args.config else []

    def go() -> tuple[int, str]:
        rc = _call(stage, ["history", "--results", *files, "--decision", str(decision), *config,
                           "--history-dir", store, "--out-dir", str(out_dir), *(["--dry-run"] * args.dry_run)])
        info = _read_json(out_dir / "history.json")
        if not info:
            return rc, f"store {store}"
        runs = len(((_read_json(decision).get("history") or {}).get("runs_used") or {}).get(info.get("gpu"), []))
        flagged = len(info.get("regressions") or [])
        return rc, (f"{(info.get('history') or {}).get('outcome')} in {store}; {runs} run(s) of this GPU model "
                    f"used; {flagged} regression(s); {len(info.get('trends') or [])} trend chart(s)")
    return _timed("history", go)


def _pr(args: argparse.Namespace, stage: Stage, doc: dict[str, Any], decision: Path, report_dir: Path,
        pr_dir: Path, done: list[StageResult]) -> StageResult:
    # `ci pr --config` is the config's path inside the repository, which the local default matches.
    config = ["--config", args.config] if args.config else []
    # A regression (history exit 4) still lets the PR run, as in the workflow; it fails the pipeline at the end.
    failed = [r.name for r in done if r.status == "failed" and not (r.name == "history" and r.rc == exits.REGRESSION)]
    if failed:
        return StageResult("pr", "skipped", detail=f"{' and '.join(failed)} failed")
    if doc.get("profile") == "cpu":
        return StageResult("pr", "skipped", detail="results from a CPU machine: thresholds are per GPU profile")

    def go() -> tuple[int, str]:
        rc = _call(stage, ["pr", "--decision", str(decision), "--report-dir", str(report_dir), *config,
                           "--out-dir", str(pr_dir), *(["--dry-run"] * args.dry_run)])
        info = _read_json(pr_dir / "pr.json") if rc == 0 else {}
        return rc, f"outcome {info.get('outcome', 'unknown')}" + (f" {info['pr_url']}" if info.get("pr_url")
                                                                   else f", files in {pr_dir}")
    return _timed("pr", go)


def _finish(done: Sequence[StageResult], doc: dict[str, Any], report_dir: Path | None) -> int:
    print("\n== pipeline summary ==")
    for r in done:
        seconds = f"{r.seconds:7.1f} s" if r.seconds is not None else " " * 9
        status = r.status if r.status != "failed" else f"FAILED (exit {r.rc})"
        print(f"  {r.name:<7} {status:<16} {seconds}  {r.detail}")
    if any(r.name == "history" and r.rc == exits.REGRESSION for r in done):
        print("regression: a case is slower than in this GPU model's history; see the report's first section")
    if doc:
        fa2, triton = doc.get("fa2", {}), doc.get("triton", {})
        if not fa2.get("ran", True):
            print(f"FA-2 unavailable: {fa2.get('reason')}")
        if not triton.get("ran", True):
            print(f"Triton not measured: {triton.get('reason')}")
        # Only a decision that `ci history` rewrote proposes anything: decide's own proposal has not
        # passed the K-run rule, so it is never shown as a change (and `ci pr` refuses it).
        vetted = isinstance(doc.get("history"), dict)
        branches = ", ".join(f"{name} {text(b['current'])} -> {text(b['proposed'])}" if b.get("changed") and vetted
                             else f"{name} {text(b['current'])} (unchanged)" for name, b in doc.get("branches", {}).items())
        print(f"thresholds ({doc.get('profile')}, {doc.get('gpu_name')}): {branches}" + (
            "" if vetted else "; not vetted by `ci history`, so no change is proposed"))
        if report_dir is not None and (report_dir / "report.md").is_file():
            print(f"report: {report_dir / 'report.md'}")
    failed = [r for r in done if r.status == "failed"]
    print("outcome: " + (f"failed at {failed[0].name} (exit {failed[0].rc})" if failed else "ok"))
    return failed[0].rc if failed else 0
