"""`python -m ci guard`: refuse to go on unless this job runs from a trusted trigger.

The GPU job's first `run:` step. It passes only for `schedule` and for `workflow_dispatch` on the
default branch, the two triggers of `gpu-bench.yml`, which only people with write access can
cause. This is defence in depth and nothing more: a fork's pull request can edit its own copy of a
workflow and delete this step. What keeps fork code off the GPU runner are the repository and
runner-group settings docs/workflows.md lists ("Security: the self-hosted GPU runner").

Reads GITHUB_ACTIONS, GITHUB_EVENT_NAME, GITHUB_REF and the default branch from NSA_DEFAULT_BRANCH
or else from the event payload (GITHUB_EVENT_PATH). GitHub does not let a workflow's `env:`
overwrite GITHUB_* variables. Outside GitHub Actions (GITHUB_ACTIONS unset, as in `make
gpu-bench`) there is no event to check: the guard says so and passes.

Standard library only: it runs before the job installs anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from nsa_contract import exits

HELP = "refuse to run unless the event is schedule, or workflow_dispatch on the default branch"
TRUSTED_EVENTS = ("schedule", "workflow_dispatch")
FIX = ("run it from the Actions tab (workflow_dispatch) on the default branch, or let the nightly "
       "schedule run it; docs/workflows.md: \"Security: the self-hosted GPU runner\"")


class Refused(Exception):
    """This job must not go on; the message says why and how to run it instead."""


def _default_branch(env: Mapping[str, str]) -> str:
    """NSA_DEFAULT_BRANCH, else the event payload's repository.default_branch, else ""."""
    if env.get("NSA_DEFAULT_BRANCH"):
        return env["NSA_DEFAULT_BRANCH"]
    path = env.get("GITHUB_EVENT_PATH", "")
    if not path:
        return ""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    repo = payload.get("repository") if isinstance(payload, dict) else None
    branch = repo.get("default_branch") if isinstance(repo, dict) else None
    return branch if isinstance(branch, str) else ""


def check(env: Mapping[str, str]) -> str:
    """Why this job may go on (one line), or raise `Refused`."""
    if env.get("GITHUB_ACTIONS") != "true":
        return "not running in GitHub Actions (GITHUB_ACTIONS is not true): no event to check"
    event, ref = env.get("GITHUB_EVENT_NAME", ""), env.get("GITHUB_REF", "")
    if event not in TRUSTED_EVENTS:
        raise Refused(f"the GPU job must be triggered by {' or '.join(TRUSTED_EVENTS)}, got {event or 'nothing'!r} "
                      f"(ref {ref or 'unset'}); {FIX}")
    default = _default_branch(env)
    if not default:
        if event == "schedule":  # GitHub runs scheduled workflows on the default branch only
            return f"event schedule on {ref or 'the default branch'}"
        raise Refused(f"the default branch must be known to check a {event} run, got neither NSA_DEFAULT_BRANCH "
                      f"nor repository.default_branch in the event payload; set NSA_DEFAULT_BRANCH: "
                      "${{ github.event.repository.default_branch }} on the guard step")
    if ref != f"refs/heads/{default}":
        raise Refused(f"the GPU job must run on the default branch refs/heads/{default}, got {event} on "
                      f"{ref or 'an unset GITHUB_REF'}; {FIX}")
    return f"event {event} on {ref}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No arguments: everything comes from the environment GitHub sets."""


def run(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    try:
        why = check(os.environ if env is None else env)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.BAD_INPUT
    print(f"guard: ok, {why}")
    return exits.OK
