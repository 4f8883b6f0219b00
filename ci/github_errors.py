"""One-line, token-free explanations of failed GitHub calls (no network here; ``ci.github`` sends).

Every message reads ``GitHub answered <status> for <METHOD> <path> (<GitHub's words>): <cause>; <fix>``
or names the network problem, and passes through ``Secret.scrub`` so the token never shows.
"""

from __future__ import annotations

from datetime import datetime, timezone

import requests
from github import GithubException, RateLimitExceededException
from github.GithubException import RateLimitExceededExceedsMaxWait

__all__ = ["GitHubError", "Secret", "explain", "is_locked"]


class Secret:
    """A token that never shows itself in a repr, a str or a log line."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


class GitHubError(RuntimeError):
    """A request failed; the message is one line with the cause and the fix, the token scrubbed.

    ``status`` is the HTTP status GitHub answered, or None for network and input problems.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _github_message(exc: GithubException) -> str:
    data = exc.data if isinstance(exc.data, dict) else {}
    message = str(data.get("message") or exc.message or "").strip()
    details = [
        str(e.get("message") or e.get("code")) for e in data.get("errors") or [] if isinstance(e, dict)
    ]
    text = "; ".join(x for x in [message, *details] if x and x != "None")
    return " ".join(text.split())[:300]


def _is_rate_limit(exc: GithubException) -> bool:
    headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
    return (
        isinstance(exc, RateLimitExceededException)
        or exc.status == 429
        or (exc.status == 403 and headers.get("x-ratelimit-remaining") == "0")
        or "rate limit" in _github_message(exc).lower()
    )


def is_locked(exc: GithubException) -> bool:
    """A 403 because the issue or pull request is locked (GitHub: "Unable to create comment because
    issue is locked."): the token's permissions are not the cause."""
    return exc.status == 403 and "locked" in _github_message(exc).lower()


def _fix(status: int, method: str, path: str, exc: GithubException, repository: str) -> str:
    """Cause and fix for one failed call, from its status and what it was for."""
    reset_known = any(k.lower() == "x-ratelimit-reset" for k in (exc.headers or {}))
    if isinstance(exc, RateLimitExceededExceedsMaxWait) and exc.wait is not None and not reset_known:
        until = datetime.fromtimestamp(datetime.now(timezone.utc).timestamp() + exc.wait, timezone.utc)
        return (
            f"GitHub asked to wait {exc.wait:.0f} s before a retry, longer than this job waits; rerun after "
            f"{until:%H:%M} UTC, or use a token with its own quota (a GitHub App installation token)"
        )
    if _is_rate_limit(exc):
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        reset = headers.get("x-ratelimit-reset", "")
        when = (
            datetime.fromtimestamp(int(reset), timezone.utc).strftime(" (resets at %H:%M UTC)")
            if reset.isdigit()
            else ""
        )
        return (
            f"the API rate limit is exhausted{when}; rerun after the reset, or use a token with its own "
            "quota (a GitHub App installation token)"
        )
    if status == 401:
        return "the token was rejected (bad or expired credentials); set GITHUB_TOKEN or GH_TOKEN to a valid token"
    if is_locked(exc):
        return ("the conversation is locked, so GitHub refuses new comments whatever the token's permissions; "
                "unlock it (Unlock conversation on its page) or close it by hand, then rerun")
    if status == 403:
        if "/pulls" in path or "/issues/" in path:
            return (
                "the token lacks pull-requests: write; give the workflow job `permissions: pull-requests: write` "
                "or use a GitHub App token"
            )
        if "/git/" in path:
            return (
                "the token lacks contents: write, or a ruleset protects the branch; give the job "
                "`permissions: contents: write` (or use a GitHub App token) and allow pushes to nsa-thresholds/*"
            )
        return "the token lacks permission for this request; check the job's `permissions:` block"
    if status == 404:
        if "/contents/" in path:
            return "the config file is not on the base branch; pass --config with its path in the repository, or --base"
        return (
            f"{repository} is not found or not visible to the token; check GITHUB_REPOSITORY, GITHUB_API_URL "
            "(GitHub Enterprise: https://HOST/api/v3) and that the token can read the repository"
        )
    if status == 422:
        return "GitHub rejected the request; fix what the message names and rerun (reruns are safe)"
    if status >= 500:
        return "GitHub had a server error; rerun later (reruns rebuild the branch and never open a second PR)"
    return "unexpected answer; rerun, and report it if it persists"


def explain(
    exc: BaseException, method: str, path: str, *, repository: str, api_url: str, token: Secret
) -> GitHubError:
    """The ``GitHubError`` for ``exc``, raised by ``method`` on ``path`` (relative to the repository)."""
    where = f"{method} /repos/{repository}{path}"
    if isinstance(exc, GithubException):
        cause = _github_message(exc)
        detail = f" ({cause})" if cause else ""
        msg = f"GitHub answered {exc.status} for {where}{detail}: {_fix(exc.status, method, path, exc, repository)}"
        return GitHubError(token.scrub(msg), exc.status)
    if isinstance(exc, requests.exceptions.RetryError):
        reason = getattr(exc.args[0] if exc.args else None, "reason", None) or type(exc).__name__
        msg = (
            f"GitHub kept failing for {where} after retries ({reason}); rerun later (reruns rebuild the "
            "branch and never open a second PR)"
        )
        return GitHubError(token.scrub(msg))
    msg = (
        f"could not reach GitHub at {api_url} for {where} ({type(exc).__name__}); check "
        "GITHUB_API_URL (GitHub Enterprise: https://HOST/api/v3) and the runner's network, then rerun"
    )
    return GitHubError(token.scrub(msg))
