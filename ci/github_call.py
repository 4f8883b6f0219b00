"""One-line, token-free errors for the history branch and the tracking issue (PyGithub calls).

``ci.github`` has its own session for the threshold PR; this is the same pattern (every request runs
inside ``call(method, path)`` and any failure becomes a ``GitHubError`` from ``ci.github_errors``)
with the 403 fix that fits each caller: the history branch needs ``contents: write``, the tracking
issue ``issues: write``, and the generic advice would name the PR's permission instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import requests
from github import GithubException

from ci.github_errors import GitHubError, Secret, explain, is_locked

__all__ = ["Caller", "GitHubError", "post_comment"]


@dataclass(frozen=True)
class Caller:
    """Runs PyGithub calls for ``repository`` with one-line errors; ``forbidden`` is the 403 fix."""

    api_url: str
    repository: str
    token: Secret
    forbidden: str

    @contextmanager
    def call(self, method: str, path: str) -> Iterator[None]:
        """Run the block as ``method path`` (relative to the repository); failures raise GitHubError."""
        try:
            yield
        except (GithubException, requests.exceptions.RequestException) as exc:
            err = explain(exc, method, path, repository=self.repository, api_url=self.api_url, token=self.token)
            locked = isinstance(exc, GithubException) and is_locked(exc)
            if err.status == 403 and "rate limit" not in str(err) and not locked:
                where = f"{method} /repos/{self.repository}{path}"
                err = GitHubError(self.token.scrub(f"GitHub answered 403 for {where}: {self.forbidden}"), 403)
            raise err from None


def branch_ref(call: Callable[[str, str], AbstractContextManager[None]], repo, branch: str):
    """The branch's ref, loaded (so that its URL is the plural one edits need), or None when the
    branch does not exist; `call(method, path)` is the caller's error-translating context."""
    try:
        with call("GET", f"/git/ref/heads/{branch}"):
            ref = repo.get_git_ref(f"heads/{branch}")
            ref.object  # noqa: B018 - loads the ref; a missing branch raises 404 here
            return ref
    except GitHubError as exc:
        if exc.status == 404:
            return None
        raise


def post_comment(call: Callable[[str, str], AbstractContextManager[None]], path: str, marker: str,
                 bodies: Callable[[], Iterable[str | None]], post: Callable[[], object],
                 log: Callable[[str], None]) -> None:
    """Post a comment whose text holds ``marker`` once, even when GitHub answers a 5xx after posting it.

    A comment POST is not idempotent: GitHub may carry it out and still answer 502 (or drop the
    connection), and a blind retry posts it twice. ``ci.github.CappedRetry`` therefore never repeats
    one; here a POST that failed without a definite answer (a 5xx, no answer) is followed by reading
    the comments (``bodies``) again, and the comment is posted once more only when none holds
    ``marker``. ``path`` names the comments for ``call``'s one-line errors.
    """
    try:
        with call("POST", path):
            post()
        return
    except GitHubError as exc:
        if exc.status is not None and exc.status < 500:
            raise
        first = exc
    with call("GET", path):
        if any(marker in (body or "") for body in bodies()):
            log(f"the comment on {path} is already there although GitHub answered "
                f"{first.status or 'nothing'}; not posting it again")
            return
    with call("POST", path):
        post()
