"""`python -m ci guard`: the GPU job runs only for a schedule or a dispatch on the default branch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ci import guard

GH = {"GITHUB_ACTIONS": "true", "NSA_DEFAULT_BRANCH": "main"}


@pytest.mark.parametrize("env", [
    {**GH, "GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/main"},
    {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": "refs/heads/main"},
    {},  # a local run (make gpu-bench): no event to check
], ids=["schedule", "dispatch-on-default", "schedule-default-unknown", "local"])
def test_guard_passes_trusted_triggers(env: dict[str, str]) -> None:
    assert guard.run(None, env=env) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("env", [
    {**GH, "GITHUB_EVENT_NAME": "pull_request", "GITHUB_REF": "refs/pull/7/merge"},
    {**GH, "GITHUB_EVENT_NAME": "pull_request_target", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main"},
    {**GH, "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/feature"},
    {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/main"},
    {"GITHUB_ACTIONS": "true"},
], ids=["fork-pr", "pr-target", "push", "dispatch-on-branch", "dispatch-default-unknown", "no-event"])
def test_guard_refuses_everything_else(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert guard.run(None, env=env) == 2  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the ") and "; " in err and "\n" not in err


def test_guard_reads_the_default_branch_from_the_event_payload(tmp_path: Path) -> None:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"repository": {"default_branch": "trunk"}}), encoding="utf-8")
    env = {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_EVENT_PATH": str(event)}
    assert guard.run(None, env={**env, "GITHUB_REF": "refs/heads/trunk"}) == 0  # type: ignore[arg-type]
    assert guard.run(None, env={**env, "GITHUB_REF": "refs/heads/main"}) == 2  # type: ignore[arg-type]
