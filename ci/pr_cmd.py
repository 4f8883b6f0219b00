"""``python -m ci pr``: open, update or close the threshold PR for one decision.

Exit codes: 0 done (any outcome, or a dry run), 1 GitHub refused or could not be reached,
2 bad input (decision, report, config).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ci.args import DRY_RUN_ENV, env_dry_run
from ci.pr_plan import PlanError, PrPlan, build_plan, load_report, validate_decision
from nsa_contract import atomic, exits
from nsa_contract.paths import InputError, check_out_dir

if TYPE_CHECKING:
    from ci.github import Target

__all__ = ["add_arguments", "main", "repo_path", "run", "run_pr"]

DEFAULT_CONFIG = "configs/base.yaml"
Connect = Callable[["Target"], Any]

HELP = "open, update or close the threshold PR"
DESCRIPTION = """\
Open, update or close the pull request that proposes this GPU's FA-2 and Triton thresholds.

One branch per profile (nsa-thresholds/<profile>), rebuilt from the base branch on every run: its
commit changes only the threshold keys of configs/base.yaml plus reports/<profile>/. The outcome is
created, updated, closed or none; it is printed and written to $GITHUB_OUTPUT (outcome=, pr_url=).

--decision must be the file that `python -m ci history` rewrote (each change held for the last K runs);
decide's own file is refused. A key this run did not measure keeps the open PR's change to it, and a
run that measured no key leaves the open PR as it is: closing needs covering evidence, as opening does.

Environment: GITHUB_REPOSITORY (owner/name), GITHUB_TOKEN or GH_TOKEN, GITHUB_API_URL (default
https://api.github.com; GitHub Enterprise: https://HOST/api/v3), NSA_PR_DRY_RUN (true: as
--dry-run; how the GPU workflow passes its dry_run input). Without a token, with --dry-run or with
NSA_PR_DRY_RUN=true, nothing is sent: pr_body.md, config.diff and pr.json are written to --out-dir.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decision", required=True, help="decision JSON written by `python -m ci decide`")
    parser.add_argument(
        "--report-dir",
        default="out/report",
        help="folder with report.md and *.png from `python -m ci report` (default: %(default)s)",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG,
        help="config path in the repository; an absolute path must lie in a git checkout, and is taken relative "
             "to its root (default: %(default)s)"
    )
    parser.add_argument("--base", default=None, help="base branch (default: the repository's default branch)")
    parser.add_argument(
        "--dry-run", action="store_true", help="send nothing; write the planned PR to --out-dir"
    )
    parser.add_argument(
        "--out-dir",
        default="out/pr",
        help="where pr_body.md, config.diff and pr.json go (default: %(default)s)",
    )


def _write_outputs(out_dir: Path, plan: PrPlan, body: str, diff: str, info: Mapping[str, Any]) -> None:
    """pr_body.md, config.diff and pr.json, swapped in together: never one run's body with another's diff."""
    doc = {
        "title": plan.title,
        "branch": plan.branch,
        "labels": list(plan.labels),
        "changes": plan.changes,
        "files": [f.path for f in plan.files],
        **info,
    }
    with atomic.staging_dir(out_dir) as stage:
        (stage / "pr_body.md").write_text(body, encoding="utf-8")
        (stage / "config.diff").write_text(diff, encoding="utf-8")
        (stage / "pr.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _env_dry_run(env: Mapping[str, str]) -> bool:
    return env_dry_run(env, PlanError)


def _github_output(env: Mapping[str, str], outcome: str, url: str) -> None:
    path = env.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"outcome={outcome}\npr_url={url}\n")


def repo_path(path: str) -> str:
    """``path`` as GitHub names it: relative to the repository root, with forward slashes.

    An absolute path inside a git checkout (as `ci decide`, `ci history` and `ci report` accept it)
    is taken relative to that checkout's root; `ci pipeline` checks this before its first stage.
    """
    if os.path.isabs(path):
        absolute = Path(os.path.normpath(path))
        root = next((d for d in absolute.parents if (d / ".git").exists()), None)
        if root is None:
            raise PlanError(
                f"--config must be a path inside the repository, got {path!r}, outside any git checkout; pass "
                "it relative to the root, e.g. configs/base.yaml"
            )
        path = absolute.relative_to(root).as_posix()
    clean = posixpath.normpath(path.replace("\\", "/"))
    if clean.startswith(("/", "../")) or clean in (".", ".."):
        raise PlanError(
            f"--config must be a path inside the repository, got {path!r}; pass it relative to the root, "
            "e.g. configs/base.yaml"
        )
    return clean


def _load_plan(args: argparse.Namespace) -> PrPlan:
    try:
        decision = json.loads(Path(args.decision).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PlanError(
            f"--decision must be a readable JSON file, got {args.decision!r} ({exc}); run `python -m ci decide` first"
        ) from None
    profile = decision.get("profile") if isinstance(decision, dict) else None
    build_plan(decision, "", ())  # validates the decision before the report is read
    validate_decision(decision)
    report, files = load_report(args.report_dir, str(profile))
    return build_plan(decision, report, files)


def _dry_run(args: argparse.Namespace, plan: PrPlan, why: str, env: Mapping[str, str], out: TextIO) -> int:
    from ci.config_edit import ConfigEditError, edit_thresholds, unified_diff

    local = args.config
    if local == DEFAULT_CONFIG and not Path(local).is_file():  # not in a checkout: the installed copy
        from nsa_contract.resources import default_config_path

        local = str(default_config_path())
    try:
        with open(local, encoding="utf-8", newline="") as fh:
            old = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigEditError(
            f"--config must be a readable file of UTF-8 text, got {local!r} ({why}); run from the repository root"
        ) from None
    new = edit_thresholds(old, plan.profile, plan.changes, source=local)
    diff = unified_diff(old, new, args.config)
    would = "change" if diff else "nothing to change"
    _write_outputs(
        Path(args.out_dir), plan, plan.body(), diff, {"outcome": "dry-run", "base": args.base, "reason": why}
    )
    print(f"dry run ({why}): {would}; wrote pr_body.md, config.diff and pr.json to {args.out_dir}", file=out)
    print("outcome=dry-run", file=out)
    _github_output(env, "dry-run", "")
    return exits.OK


def run(
    args: argparse.Namespace,
    *,
    env: Mapping[str, str] | None = None,
    connector: Connect | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the ``pr`` subcommand for parsed ``args``; ``connector`` builds the client (tests pass one)."""
    # Imported here so that the other subcommands never load the network or YAML code.
    from ci.config_edit import ConfigEditError
    from ci.github import GitHubError, connect, publish, target_from_env

    env = os.environ if env is None else env
    out, err = out or sys.stdout, err or sys.stderr
    try:
        # Before anything is sent: the outcome must be writable (the folder is replaced as a whole).
        check_out_dir(args.out_dir, "--out-dir", replaced=True)
        plan = _load_plan(args)
        why = "--dry-run" if args.dry_run else f"{DRY_RUN_ENV}={env[DRY_RUN_ENV]}" if _env_dry_run(env) else ""
        target = None if why else target_from_env(env)
        if target is None:
            return _dry_run(args, plan, why or "no GITHUB_TOKEN or GH_TOKEN", env, out)
        gh = (connector or connect)(target)
        result = publish(
            gh,
            target,
            plan,
            config_path=repo_path(args.config),
            base=args.base,
            log=lambda line: print(line, file=err),
        )
    except (PlanError, ConfigEditError, InputError, FileNotFoundError) as exc:
        # FileNotFoundError: nsa_contract.resources found no default config (a broken install).
        print(f"error: {exc}", file=err)
        return exits.BAD_INPUT
    except GitHubError as exc:
        print(f"error: {exc}", file=err)
        return exits.ERROR
    _write_outputs(
        Path(args.out_dir),
        plan,
        result.body,
        result.config_diff,
        {"outcome": result.outcome, "pr_url": result.url, "base": result.base},
    )
    print(f"outcome={result.outcome}" + (f" pr_url={result.url}" if result.url else ""), file=out)
    _github_output(env, result.outcome, result.url)
    return exits.OK


def run_pr(argv: Sequence[str] | None = None, **kwargs: Any) -> int:
    """``python -m ci pr`` with ``argv`` (the arguments after ``pr``); keyword arguments go to ``run``."""
    parser = argparse.ArgumentParser(
        prog="python -m ci pr", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    return run_pr(argv)


if __name__ == "__main__":
    raise SystemExit(main())
