"""`python -m ci workflow-steps`: run one job of a GitHub Actions workflow on this machine.

    python -m ci workflow-steps .github/workflows/gpu-bench.yml --job gpu --dry-run
    python -m ci workflow-steps .github/workflows/gpu-bench.yml --job gpu --input size=smoke
    python -m ci workflow-steps .github/workflows/gpu-bench.yml --job decide

The job's `run:` steps execute in order in the current folder, under GitHub's default shell
(`bash --noprofile --norc -eo pipefail`), with the workflow, job and step `env:` merged, as a
manual dispatch with the default inputs would run them:
  `${{ inputs.NAME }}`  the input's default, or --input NAME=VALUE (booleans read true/false);
  `a || b`              the first operand that is not empty, false or 0;
  `'text'`, numbers     themselves;
  anything else         (secrets, vars, github, matrix, ...) empty: no token reaches a step, and
                        GITHUB_TOKEN / GH_TOKEN are removed from the inherited environment too, so
                        a threshold PR step makes a dry run.
`uses:` steps (checkout, artifacts) are listed, not run: their files are already in this working
tree. $GITHUB_ENV, $GITHUB_PATH, $GITHUB_OUTPUT and $GITHUB_STEP_SUMMARY are files under
--state-dir and work as on GitHub ($GITHUB_OUTPUT is fresh for each step, and what a step with an
`id:` writes there becomes `steps.<id>.outputs.<name>`). A step runs when no earlier step failed,
unless its `if:` is `always()` or `!cancelled()` (runs anyway) or `failure()` (only after a
failure). An `if:` may also join, with `&&`, comparisons of an earlier step's result with a quoted
string: `steps.<id>.outcome == 'success'`, `steps.<id>.conclusion != 'failure'`,
`steps.<id>.outputs.<name> != ''` (a step that did not run has outcome `skipped`; a missing output
is ''). Other `if:` expressions are refused. Wall time per step and in total is printed at the end.

History: the job's steps see NSA_HISTORY_DIR (default: out/history-store under the current folder,
made absolute; a value already in the environment wins), so `python -m ci history` keeps the run
history in that folder, as GitHub keeps it on the nsa-history branch, and a second replay on this
machine compares with the first. Set NSA_HISTORY_DIR to another folder to keep another history.

Exit codes: 0 every step that ran passed (or --dry-run), the first failing step's exit code
otherwise, 2 bad input (file, job, input).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from nsa_contract import exits

HELP = "run one workflow job's run: steps on this machine, env resolved from the inputs' defaults"
SHELL = ("bash", "--noprofile", "--norc", "-eo", "pipefail", "-c")
TOKENS = ("GITHUB_TOKEN", "GH_TOKEN")
STATE_FILES = {"GITHUB_ENV": "env", "GITHUB_PATH": "path", "GITHUB_OUTPUT": "output",
               "GITHUB_STEP_SUMMARY": "step_summary.md"}
_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}", re.S)
_INPUT = re.compile(r"(?:github\.event\.)?inputs\.([A-Za-z_][\w-]*)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CONDITIONS = {"always()": "always", "!cancelled()": "always", "success()||failure()": "always",
               "failure()": "failure", "success()": "success"}
_CHECK = re.compile(r"steps\.([A-Za-z_][\w-]*)\.(outcome|conclusion|outputs\.([A-Za-z_][\w-]*))\s*(==|!=)\s*"
                    r"'((?:[^']|'')*)'")
# The local stand-in for the nsa-history branch (see the module docstring); relative to the cwd.
HISTORY_ENV, HISTORY_DEFAULT = "NSA_HISTORY_DIR", Path("out") / "history-store"


class WorkflowError(ValueError):
    """A workflow, job or input this runner cannot use."""


@dataclass(frozen=True)
class Check:
    """`steps.<step>.<field> <op> '<value>'`; field is outcome, conclusion or outputs.<name>."""

    step: str
    field: str
    op: str  # == or !=
    value: str

    def holds(self, results: Mapping[str, Mapping[str, Any]]) -> bool:
        done = results.get(self.step, {})
        if self.field.startswith("outputs."):
            got = done.get("outputs", {}).get(self.field.split(".", 1)[1], "")
        else:
            got = done.get("outcome", "")
        return (got == self.value) == (self.op == "==")


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    run: str | None
    uses: str | None
    env: dict[str, str]
    condition: str  # success, always, failure
    working_directory: str | None
    id: str | None = None
    checks: tuple[Check, ...] = ()
    condition_text: str = ""  # the `if:` as written, for the listing (compound ones only)


@dataclass
class Outcome:
    step: Step
    status: str  # ok, failed, not run, GitHub only
    rc: int = 0
    seconds: float | None = None


@dataclass
class Resolver:
    """Evaluates the `${{ }}` expressions this runner understands; the rest become empty."""

    inputs: Mapping[str, Any]
    unresolved: list[str] = field(default_factory=list)

    def operand(self, text: str) -> Any:
        text = text.strip()
        if len(text) >= 2 and text[0] == text[-1] == "'":
            return text[1:-1].replace("''", "'")
        if _NUMBER.fullmatch(text):
            return float(text) if "." in text else int(text)
        if text in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[text]
        m = _INPUT.fullmatch(text)
        if m and m.group(1) in self.inputs:
            return self.inputs[m.group(1)]
        if text not in self.unresolved:
            self.unresolved.append(text)
        return ""

    def expression(self, expr: str) -> Any:
        value: Any = ""
        for part in _split_or(expr):
            value = self.operand(part)
            if value not in ("", False, 0, None):
                return value
        return value

    def text(self, value: Any) -> str:
        """`value` (an env or working-directory entry) with every expression replaced by its text."""
        if not isinstance(value, str):
            return _as_text(value)
        return _EXPR.sub(lambda m: _as_text(self.expression(m.group(1))), value)


def _split_or(expr: str, sep: str = "||") -> list[str]:
    """`a || 'b||c' || d` -> its operands (quotes respected); `sep="&&"` splits a conjunction."""
    parts, current, quoted, i = [], "", False, 0
    while i < len(expr):
        ch = expr[i]
        if ch == "'":
            quoted = not quoted
        if not quoted and expr.startswith(sep, i):
            parts.append(current)
            current, i = "", i + len(sep)
            continue
        current += ch
        i += 1
    return [*parts, current]


def _as_text(value: Any) -> str:
    """How GitHub writes an expression's value into an env var."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml  # here, not at the top: `python -m ci guard` runs before PyYAML is installed

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise WorkflowError(f"workflow {path} must be UTF-8 text, got bytes that are not; save it as UTF-8") from None
    except OSError as exc:
        raise WorkflowError(f"cannot read workflow {path}: {exc.strerror}; pass a path such as "
                            ".github/workflows/gpu-bench.yml") from None
    except yaml.YAMLError as exc:
        raise WorkflowError(f"workflow {path} must be valid YAML, got an error: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), dict):
        raise WorkflowError(f"workflow {path} must be a mapping with a `jobs:` mapping, got "
                            f"{type(doc).__name__}; pass a GitHub Actions workflow file")
    return doc


def triggers(doc: Mapping[Any, Any]) -> Any:
    """The `on:` value; YAML 1.1 (PyYAML) reads a bare `on` key as the boolean True."""
    return doc.get("on", doc.get(True))


def dispatch_inputs(doc: Mapping[Any, Any]) -> dict[str, dict[str, Any]]:
    """`on.workflow_dispatch.inputs`, or {} when the workflow has none."""
    on = triggers(doc)
    dispatch = on.get("workflow_dispatch") if isinstance(on, dict) else None
    inputs = dispatch.get("inputs") if isinstance(dispatch, dict) else None
    return dict(inputs) if isinstance(inputs, dict) else {}


def input_values(doc: Mapping[Any, Any], overrides: Mapping[str, str]) -> dict[str, Any]:
    """Every dispatch input's default, with `overrides` (NAME -> text) applied and type-checked."""
    spec = dispatch_inputs(doc)
    values = {name: (s or {}).get("default", False if (s or {}).get("type") == "boolean" else "")
              for name, s in spec.items()}
    for name, text in overrides.items():
        if name not in spec:
            raise WorkflowError(f"--input {name} must name a workflow_dispatch input, one of "
                                f"{', '.join(spec) or '(none)'}; got {name!r}")
        kind = (spec[name] or {}).get("type", "string")
        if kind == "boolean":
            if text.lower() not in ("true", "false"):
                raise WorkflowError(f"--input {name} must be true or false, got {text!r}")
            values[name] = text.lower() == "true"
        elif kind == "choice" and text not in (spec[name].get("options") or []):
            raise WorkflowError(f"--input {name} must be one of {spec[name].get('options')}, got {text!r}")
        else:
            values[name] = text
    return values


def _condition(raw: Any, where: str, earlier: Sequence[str] = ()) -> tuple[str, tuple[Check, ...]]:
    """(status, checks) of an `if:`: at most one status function (none: success()) and, joined with
    `&&`, comparisons of the steps with ids in `earlier`."""
    if raw is None:
        return "success", ()
    text = str(raw).strip()
    m = _EXPR.fullmatch(text)
    status, checks = [], []
    for term in _split_or(m.group(1) if m else text, "&&"):
        term = term.strip()
        if term.replace(" ", "") in _CONDITIONS:
            status.append(_CONDITIONS[term.replace(" ", "")])
            continue
        c = _CHECK.fullmatch(term)
        if c is None:
            raise WorkflowError(f"{where}: if: {raw!r} is not supported by the local runner; use always(), "
                                "!cancelled(), success() or failure(), optionally joined with && to "
                                "steps.<id>.outcome/conclusion/outputs.<name> == or != 'text'")
        if c.group(1) not in earlier:
            raise WorkflowError(f"{where}: if: {raw!r} reads steps.{c.group(1)}, which must be the id of an "
                                f"earlier step of the job, one of {', '.join(earlier) or '(none)'}; add `id:` there")
        field_name = "outputs." + c.group(3) if c.group(3) else "outcome"
        checks.append(Check(c.group(1), field_name, c.group(4), c.group(5).replace("''", "'")))
    if len(status) > 1:
        raise WorkflowError(f"{where}: if: {raw!r} must name at most one status function, got {len(status)}")
    return (status or ["success"])[0], tuple(checks)


def job_steps(doc: Mapping[Any, Any], job: str, resolver: Resolver) -> list[Step]:
    jobs = doc["jobs"]
    if job not in jobs:
        raise WorkflowError(f"--job must be one of {', '.join(jobs)}, got {job!r}")
    spec = jobs[job] or {}
    shell = ((spec.get("defaults") or {}).get("run") or {}).get("shell")
    base_env = {**(doc.get("env") or {}), **(spec.get("env") or {})}
    steps: list[Step] = []
    for number, raw in enumerate(spec.get("steps") or [], 1):
        if not isinstance(raw, dict):
            raise WorkflowError(f"job {job}: step {number} must be a mapping, got {raw!r}")
        name = raw.get("name") or raw.get("uses") or (str(raw.get("run", "")).strip().splitlines() or ["?"])[0]
        if raw.get("shell", shell) not in (None, "bash"):
            raise WorkflowError(f"step {name!r}: shell {raw.get('shell', shell)!r} is not supported; use bash")
        env = {k: resolver.text(v) for k, v in {**base_env, **(raw.get("env") or {})}.items()}
        wd = raw.get("working-directory", ((spec.get("defaults") or {}).get("run") or {}).get("working-directory"))
        status, checks = _condition(raw.get("if"), f"step {name!r}", [s.id for s in steps if s.id])
        steps.append(Step(number, name, raw.get("run"), raw.get("uses"), env, status,
                          resolver.text(wd) if wd is not None else None, raw.get("id"), checks,
                          str(raw.get("if")).strip() if checks else ""))
    return steps


def _read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines and KEY<<DELIMITER blocks, as GitHub reads $GITHUB_ENV."""
    out: dict[str, str] = {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            key, delim = line.split("<<", 1)
            if delim not in lines[i + 1:]:
                raise WorkflowError(f"{path}: {key}<<{delim} has no closing {delim} line")
            end = lines.index(delim, i + 1)
            out[key] = "\n".join(lines[i + 1:end])
            i = end + 1
            continue
        if "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
        i += 1
    return out


def _step_env(step: Step, state: Mapping[str, Path], cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TOKENS}
    env.setdefault(HISTORY_ENV, str(cwd / HISTORY_DEFAULT))
    env.update(_read_env_file(state["GITHUB_ENV"]))
    added = [p for p in state["GITHUB_PATH"].read_text(encoding="utf-8").splitlines() if p.strip()]
    if added:
        env["PATH"] = os.pathsep.join([*reversed(added), env.get("PATH", "")])
    env.update(step.env)
    env.update({k: str(p) for k, p in state.items()})
    env["GITHUB_WORKSPACE"] = str(cwd)
    return env


def _should_run(step: Step, *, failed: bool, results: Mapping[str, Mapping[str, Any]]) -> bool:
    status = step.condition == "always" or (failed if step.condition == "failure" else not failed)
    return status and all(c.holds(results) for c in step.checks)


def _describe(step: Step, total: int, out: TextIO) -> None:
    when = {"success": "", "always": " [if: always]", "failure": " [if: failure]"}[step.condition]
    if step.checks:
        when = f" [if: {step.condition_text}]"
    if step.uses:
        name = "" if step.name == step.uses else f"{step.name}: "
        print(f"[{step.number}/{total}] {name}uses {step.uses} (GitHub only, not run here){when}", file=out)
        return
    print(f"[{step.number}/{total}] {step.name}{when}", file=out)
    for line in (step.run or "").rstrip().splitlines():
        print(f"  $ {line}", file=out)
    if step.env:
        print("  env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items()), file=out)
    if step.working_directory:
        print(f"  working-directory: {step.working_directory}", file=out)


def run_job(path: str | os.PathLike[str], job: str, *, inputs: Mapping[str, str] | None = None,
            dry_run: bool = False, state_dir: str | os.PathLike[str] | None = None,
            out: TextIO | None = None) -> int:
    """Run (or with `dry_run` print) the `run:` steps of `job`; see the module docstring."""
    out = out or sys.stdout
    doc = load(path)
    resolver = Resolver(input_values(doc, inputs or {}))
    steps = job_steps(doc, job, resolver)
    shown = " ".join(f"{k}={_as_text(v)}" for k, v in resolver.inputs.items()) or "none"
    print(f"workflow-steps: {path} job {job}: {len(steps)} steps{' (dry run)' if dry_run else ''}; "
          f"inputs: {shown}", file=out)
    if resolver.unresolved:
        print(f"  empty here: {', '.join(resolver.unresolved)}", file=out)
    if dry_run:
        for step in steps:
            _describe(step, len(steps), out)
        return 0

    cwd = Path.cwd()
    state_root = Path(state_dir) if state_dir else cwd / "out" / "workflow-steps" / f"{Path(path).stem}-{job}"
    state_root.mkdir(parents=True, exist_ok=True)
    state = {k: (state_root / name).resolve() for k, name in STATE_FILES.items()}
    for p in state.values():
        p.write_text("", encoding="utf-8")
    outcomes: list[Outcome] = []
    results: dict[str, dict[str, Any]] = {}  # step id -> {"outcome": ..., "outputs": {...}}
    failed_rc, start = 0, time.perf_counter()
    for step in steps:
        out.flush()
        _describe(step, len(steps), out)
        if step.uses or step.run is None:
            outcomes.append(Outcome(step, "GitHub only"))
            if step.id:  # its files are already here, as if it had run
                results[step.id] = {"outcome": "success", "outputs": {}}
            continue
        if not _should_run(step, failed=bool(failed_rc), results=results):
            why = "an earlier step failed" if failed_rc and step.condition == "success" else (
                "no step failed" if step.condition == "failure" and not failed_rc else "its if: is false")
            print(f"  -> not run ({why})", file=out)
            outcomes.append(Outcome(step, "not run"))
            if step.id:
                results[step.id] = {"outcome": "skipped", "outputs": {}}
            continue
        out.flush()
        t0 = time.perf_counter()
        wd = cwd / step.working_directory if step.working_directory else cwd
        state["GITHUB_OUTPUT"].write_text("", encoding="utf-8")  # each step writes its own outputs
        rc = subprocess.run([*SHELL, step.run], env=_step_env(step, state, cwd), cwd=wd).returncode
        outcome = Outcome(step, "ok" if rc == 0 else "failed", rc, time.perf_counter() - t0)
        outcomes.append(outcome)
        if step.id:
            results[step.id] = {"outcome": "success" if rc == 0 else "failure",
                                "outputs": _read_env_file(state["GITHUB_OUTPUT"])}
        print(f"  -> {outcome.status if rc == 0 else f'FAILED (exit {rc})'} in {outcome.seconds:.1f} s", file=out)
        failed_rc = failed_rc or rc
    _summary(path, job, outcomes, time.perf_counter() - start, failed_rc, state, out)
    return failed_rc


def _summary(path: str | os.PathLike[str], job: str, outcomes: Sequence[Outcome], total: float, rc: int,
             state: Mapping[str, Path], out: TextIO) -> None:
    print(f"\n== workflow-steps summary: {path} job {job} ==", file=out)
    for o in outcomes:
        status = o.status if o.status != "failed" else f"FAILED ({o.rc})"
        seconds = f"{o.seconds:8.1f} s" if o.seconds is not None else " " * 10
        print(f"  {status:<12} {seconds}  {o.step.name}", file=out)
    print(f"total {total:.1f} s; exit {rc}", file=out)
    summary = state["GITHUB_STEP_SUMMARY"]
    if summary.stat().st_size:
        print(f"job summary: {summary}", file=out)


def _input_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--input must be NAME=VALUE such as size=smoke, got {text!r}")
    return name, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workflow", help="workflow file, e.g. .github/workflows/gpu-bench.yml")
    p.add_argument("--job", required=True, help="the job whose steps run, e.g. gpu or decide")
    p.add_argument("--input", type=_input_arg, action="append", default=[], metavar="NAME=VALUE",
                   help="a workflow_dispatch input other than its default (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the steps, their commands and env; run nothing")
    p.add_argument("--state-dir", default=None,
                   help="where $GITHUB_ENV/PATH/OUTPUT/STEP_SUMMARY files go "
                        "(default: out/workflow-steps/<workflow>-<job>)")


def run(args: argparse.Namespace) -> int:
    try:
        return run_job(args.workflow, args.job, inputs=dict(args.input), dry_run=args.dry_run,
                       state_dir=args.state_dir)
    except WorkflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.BAD_INPUT
