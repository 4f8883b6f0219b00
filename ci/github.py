"""Open, update or close the threshold PR through the GitHub REST API (the project's only network code).

One fixed branch per profile, ``nsa-thresholds/<profile>``. Each run rebuilds the branch from the
base branch's head with the Git Data API (blobs, tree, commit), then creates or force-updates the
ref, so the branch and the PR are the only state and a rerun always repairs a failed run. Open PRs
for the branch are looked up before any PR is created, and again after a failed create, because
PyGithub retries a POST that GitHub may already have carried out: running twice never opens a
second PR.

Outcomes: ``created``, ``updated`` (an open PR existed: push, refresh title and body), ``closed``
(the open PR became unnecessary: closed, branch deleted), ``none`` (nothing to change, no PR; or a
run that measured no threshold key, which leaves an open PR as it is).

Closing needs the same kind of evidence as opening: a (key, class) that this run did not measure
(``ci history`` marks it ``lasting.covered: false``) keeps the open PR's change to it.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
from github import Auth, Github, GithubException, GithubRetry, InputGitTreeElement
from github.GithubException import RateLimitExceededExceedsMaxWait
from github.GitRef import GitRef
from github.PullRequest import PullRequest
from github.Repository import Repository
from urllib3.exceptions import ConnectTimeoutError
from urllib3.util.retry import Retry

from ci.config_edit import ConfigEditError, edit_thresholds, unified_diff
from ci.github_call import branch_ref, post_comment
from ci.github_errors import GitHubError, Secret, explain
from ci.pr_plan import PrPlan, keep_unmeasured

__all__ = [
    "DEFAULT_API_URL",
    "CappedRetry",
    "GitHubError",
    "Result",
    "Secret",
    "Target",
    "connect",
    "publish",
    "target_from_env",
]

DEFAULT_API_URL = "https://api.github.com"
LABEL_COLORS = {"nsa-thresholds": "5319e7"}
PROFILE_LABEL_COLOR = "c5def5"
Log = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """Where the PR goes: API root, ``owner/name`` and the token."""

    api_url: str
    repository: str
    token: Secret


@dataclass(frozen=True)
class Result:
    outcome: str  # created | updated | closed | none
    url: str  # the PR's web address, "" for none without an open PR
    base: str
    config_diff: str
    body: str


def target_from_env(env: Mapping[str, str]) -> Target | None:
    """The target from ``GITHUB_API_URL``, ``GITHUB_REPOSITORY`` and ``GITHUB_TOKEN``/``GH_TOKEN``; None without a token."""
    # A token pasted or read from a file often ends in a line break, which requests refuses to send
    # in a header (and which read as "could not reach GitHub"); whitespace is never part of a token.
    var = next((v for v in ("GITHUB_TOKEN", "GH_TOKEN") if (env.get(v) or "").strip()), "")
    token = (env.get(var) or "").strip() if var else ""
    if not token:
        return None
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise GitHubError(f"{var} must be one token, got a value with a line break, space or control character "
                          "inside it; set it to the token alone (one line, e.g. the secret NSA_BOT_TOKEN)")
    repository = env.get("GITHUB_REPOSITORY", "")
    owner, _, name = repository.partition("/")
    if not owner or not name or "/" in name:
        raise GitHubError(
            f"GITHUB_REPOSITORY must be owner/name, got {repository!r}; set it (Actions sets it for you)"
        )
    api_url = (env.get("GITHUB_API_URL") or DEFAULT_API_URL).rstrip("/")
    return Target(api_url, repository, Secret(token))


MAX_WAIT_S = 120  # longest wait before one retry; a longer one fails the job with the reset time


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CappedRetry(GithubRetry):
    """GithubRetry whose every wait, `Retry-After` included, is logged and at most `max_rate_limit_wait`.

    PyGithub caps only the waits it computes from a rate-limit body; urllib3 sleeps a `Retry-After`
    header (429, 503, secondary limits) for as long as the server asks, silently. Here a wait above
    the cap raises `RateLimitExceededExceedsMaxWait` at once, which `explain` turns into one line
    with the cause and the fix, and every shorter wait is logged before it is slept.
    """

    def __init__(self, *, log: Log | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = log or _stderr

    def new(self, **kwargs: Any) -> CappedRetry:
        retry = super().new(**kwargs)
        retry.log = self.log
        return retry

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None, _stacktrace: Any = None) -> Retry:
        """As GithubRetry, except that a comment POST is never repeated after a 5xx or a lost answer:
        GitHub may have posted it, and `ci.github_call.post_comment` reads the comments before posting
        again. A refused connection or a rate limit (nothing was posted) is still retried."""
        if method == "POST" and urlsplit(url or "").path.endswith("/comments"):
            if response is not None and response.status >= 500:
                raise GithubException(response.status, {"message": response.reason or "server error"},
                                      dict(response.headers or {}))
            if error is not None and not isinstance(error, ConnectTimeoutError):
                raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)

    def sleep(self, response: Any = None) -> None:
        wait, why = None, "backoff"
        if self.respect_retry_after_header and response is not None:
            wait, why = self.get_retry_after(response), "Retry-After"
        if not wait:
            wait, why = self.get_backoff_time(), "backoff"
        cap = self.max_rate_limit_wait
        if cap is not None and wait > cap:
            status = getattr(response, "status", None) or 429
            headers = dict(getattr(response, "headers", None) or {})
            raise RateLimitExceededExceedsMaxWait(
                status, {"message": f"GitHub asked to wait {wait:.0f} s ({why}), more than the {cap:g} s cap"},
                headers, wait=wait)
        if wait > 0:
            status = getattr(response, "status", "")
            self.log(f"GitHub answered {status or 'an error'}: waiting {wait:.0f} s ({why}, at most {cap:g} s) "
                     "before retrying")
        super().sleep(response)


def production_retry(log: Log | None = None) -> CappedRetry:
    """A few quick retries, each wait logged; a wait longer than two minutes (a rate limit reset, a
    `Retry-After`) fails the job at once with the reset time instead of sleeping."""
    return CappedRetry(total=3, backoff_factor=1.0, secondary_rate_wait=60, max_rate_limit_wait=MAX_WAIT_S, log=log)


def connect(target: Target, *, retry: Any = None, pace: bool = True, timeout: int = 30) -> Github:
    """A PyGithub client for ``target``; ``retry=None`` means ``production_retry()``, ``pace=False`` drops throttling."""
    extra: dict[str, Any] = {} if pace else {"seconds_between_requests": None, "seconds_between_writes": None}
    return Github(
        base_url=target.api_url,
        auth=Auth.Token(target.token.reveal()),
        retry=production_retry() if retry is None else retry,
        timeout=timeout,
        **extra,
    )


class _Session:
    """One run against one repository: every call goes through ``call`` for one-line errors."""

    def __init__(self, gh: Github, target: Target, log: Log) -> None:
        self.gh, self.target, self.log = gh, target, log
        self.repo_path = f"/repos/{target.repository}"

    @contextmanager
    def call(self, method: str, path: str) -> Iterator[None]:
        """Run the calls in the block as ``method path`` (relative to the repository) with one-line errors."""
        try:
            yield
        except (GithubException, requests.exceptions.RequestException) as exc:
            t = self.target
            raise explain(
                exc, method, path, repository=t.repository, api_url=t.api_url, token=t.token
            ) from None

    def repository(self) -> Repository:
        with self.call("GET", ""):
            return self.gh.get_repo(self.target.repository)

    def ref(self, repo: Repository, branch: str) -> GitRef | None:
        """The branch's ref, loaded, or None."""
        return branch_ref(self.call, repo, branch)

    def open_pulls(self, repo: Repository, branch: str) -> list[PullRequest]:
        owner = self.target.repository.split("/")[0]
        with self.call("GET", f"/pulls?state=open&head={owner}:{branch}"):
            pulls = list(repo.get_pulls(state="open", head=f"{owner}:{branch}"))
        return sorted(pulls, key=lambda p: p.number)


def _push(s: _Session, repo: Repository, plan: PrPlan, base_sha: str, config_path: str, config: str) -> str:
    """Commit the config and report files on top of ``base_sha`` and point the branch at it."""
    with s.call("GET", f"/git/commits/{base_sha}"):
        base_commit = repo.get_git_commit(base_sha)
    with s.call("GET", f"/contents/{plan.report_dir}"):
        try:
            listed = repo.get_contents(plan.report_dir, ref=base_sha)
        except GithubException as exc:
            if exc.status != 404:
                raise
            listed = []
    new_paths = {f.path for f in plan.files}
    stale = [c.path for c in (listed if isinstance(listed, list) else [listed]) if c.type == "file"]
    elements = []
    with s.call("POST", "/git/blobs"):
        blob = repo.create_git_blob(config, "utf-8")
        elements.append(InputGitTreeElement(config_path, "100644", "blob", sha=blob.sha))
        for f in plan.files:
            blob = repo.create_git_blob(base64.b64encode(f.content).decode("ascii"), "base64")
            elements.append(InputGitTreeElement(f.path, "100644", "blob", sha=blob.sha))
    # Plots of an earlier run that this run did not make would describe another measurement.
    elements += [InputGitTreeElement(p, "100644", "blob", sha=None) for p in stale if p not in new_paths]
    with s.call("POST", "/git/trees"):
        tree = repo.create_git_tree(elements, base_commit.tree)
    ref = s.ref(repo, plan.branch)
    if ref is not None:
        with s.call("GET", f"/git/commits/{ref.object.sha}"):
            head = repo.get_git_commit(ref.object.sha)
            if head.tree.sha == tree.sha and [p.sha for p in head.parents] == [base_sha]:
                s.log(f"{plan.branch} already holds this change on top of {base_sha[:12]}")
                return head.sha
    with s.call("POST", "/git/commits"):
        commit = repo.create_git_commit(plan.commit_message, tree, [base_commit])
    if ref is None:
        try:
            with s.call("POST", "/git/refs"):
                repo.create_git_ref(f"refs/heads/{plan.branch}", commit.sha)
        except GitHubError as exc:
            # A retried POST that GitHub already carried out answers 422 "Reference already exists".
            if exc.status != 422:
                raise
            ref = s.ref(repo, plan.branch)
            if ref is None:
                raise
    if ref is not None:
        with s.call("PATCH", f"/git/refs/heads/{plan.branch}"):
            ref.edit(commit.sha, force=True)
    s.log(f"pushed {plan.branch} at {commit.sha[:12]} (base at {base_sha[:12]})")
    return commit.sha


def _labels(s: _Session, repo: Repository, pr: PullRequest, plan: PrPlan) -> None:
    """Create missing labels and put them on the PR; a failure here only warns."""
    try:
        for name in plan.labels:
            try:
                with s.call("GET", f"/labels/{name}"):
                    repo.get_label(name).name  # noqa: B018 - loads it; missing labels raise 404
            except GitHubError as exc:
                if exc.status != 404:
                    raise
                with s.call("POST", "/labels"):
                    repo.create_label(
                        name, LABEL_COLORS.get(name, PROFILE_LABEL_COLOR), "Benchmark-driven FA-2 thresholds"
                    )
        with s.call("POST", f"/issues/{pr.number}/labels"):
            pr.add_to_labels(*plan.labels)
    except GitHubError as exc:
        s.log(f"warning: labels not set: {exc}")


def _create_pull(s: _Session, repo: Repository, plan: PrPlan, base: str, body: str) -> PullRequest:
    try:
        with s.call("POST", "/pulls"):
            return repo.create_pull(base=base, head=plan.branch, title=plan.title, body=body)
    except GitHubError:
        # The POST may have succeeded before the error (a 5xx, then a retry answering 422 "already
        # exists"): look again rather than trust the error.
        found = s.open_pulls(repo, plan.branch)
        if found:
            s.log(f"found PR #{found[0].number} after a failed create; using it")
            return found[0]
        raise


def _close(s: _Session, pr: PullRequest, why: str) -> None:
    try:
        # `why` is its own marker: after a failed POST, a comment with this text means GitHub posted it.
        post_comment(s.call, f"/issues/{pr.number}/comments", why,
                     lambda: [c.body for c in pr.get_issue_comments()], lambda: pr.create_issue_comment(why), s.log)
    except GitHubError as exc:
        s.log(f"warning: no closing comment on PR #{pr.number}: {exc}")
    with s.call("PATCH", f"/pulls/{pr.number}"):
        pr.edit(state="closed")
    s.log(f"closed PR #{pr.number}")


def _delete_branch(s: _Session, repo: Repository, branch: str) -> None:
    ref = s.ref(repo, branch)
    if ref is not None:
        with s.call("DELETE", f"/git/refs/heads/{branch}"):
            ref.delete()
        s.log(f"deleted branch {branch}")


def _config_at(s: _Session, repo: Repository, config_path: str, sha: str, where: str) -> Any:
    """The config at commit ``sha``, read by the one loader (``nsa_contract.settings``)."""
    from nsa_contract import settings

    with s.call("GET", f"/contents/{config_path}?ref={sha}"):
        found = repo.get_contents(config_path, ref=sha)
    try:
        if isinstance(found, list):
            raise ValueError("a folder")
        return settings.load_text(found.decoded_content.decode("utf-8"), f"{config_path} on {where}")
    except (ValueError, UnicodeDecodeError) as exc:  # SettingsError is a ValueError
        raise ConfigEditError(f"{config_path} on {where} must be a config `ci pr` can read, got {exc}; fix it "
                              "there, or close that PR and delete its branch, then rerun") from None


def _unmeasured_changes(s: _Session, repo: Repository, pr: PullRequest, plan: PrPlan,
                        config_path: str) -> dict[tuple[str, str], int]:
    """The open PR's own changes (its head against the commit below it) to the (key, class) pairs this
    run did not measure: the values to keep, since no evidence of this run speaks about them."""
    head = pr.head.sha
    if not head:
        return {}
    with s.call("GET", f"/git/commits/{head}"):
        parents = [p.sha for p in repo.get_git_commit(head).parents]
    if not parents:
        return {}
    where = f"PR #{pr.number}'s branch"
    new = _config_at(s, repo, config_path, head, where)
    old = _config_at(s, repo, config_path, parents[0], f"the commit below {where}")
    kept = {}
    for key, cls in plan.uncovered:
        value = new.value(key, plan.profile, cls)[0]
        if value != old.value(key, plan.profile, cls)[0]:
            kept[(key, cls)] = value
    return kept


def publish(
    gh: Github,
    target: Target,
    plan: PrPlan,
    *,
    config_path: str,
    base: str | None = None,
    log: Log | None = None,
) -> Result:
    """Bring the PR for ``plan.profile`` in line with ``plan``; see the module docstring for outcomes.

    Raises:
        GitHubError: a request failed (one line, token scrubbed); a rerun repairs any partial state.
        ConfigEditError: the base branch's config cannot take the edit.
    """
    s = _Session(gh, target, log or (lambda line: print(line, file=sys.stderr)))
    repo = s.repository()
    with s.call("GET", ""):
        base = base or repo.default_branch
        html_url = repo.html_url
    pulls = s.open_pulls(repo, plan.branch)
    if pulls and not plan.covered:
        # Closing needs the same kind of evidence as opening: a run that measured no key (a `fast`-only
        # dispatch, another model's partial run) says nothing about the open PR's changes.
        s.log(f"this run measured no threshold key (no key's cells reached its decision grid); "
              f"PR #{pulls[0].number} is left as it is")
        return Result("none", pulls[0].html_url, base, "", plan.body())
    base_ref = s.ref(repo, base)
    if base_ref is None:
        raise GitHubError(
            f"base branch {base!r} must exist in {target.repository}, got 404; pass an existing --base"
        )
    base_sha = base_ref.object.sha
    with s.call("GET", f"/contents/{config_path}?ref={base_sha}"):
        old = repo.get_contents(config_path, ref=base_sha)
        if isinstance(old, list):
            raise GitHubError(
                f"--config must name a file, got the folder {config_path!r}; pass configs/base.yaml"
            )
        try:
            old_text = old.decoded_content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigEditError(
                f"{config_path} on {base} must be UTF-8 text, got a byte {exc.object[exc.start]:#04x} that is not "
                f"UTF-8 at offset {exc.start}; save it as UTF-8 on {base}, then rerun"
            ) from None
    if pulls and plan.uncovered:
        kept = _unmeasured_changes(s, repo, pulls[0], plan, config_path)
        if kept:
            s.log(f"kept PR #{pulls[0].number}'s change to {', '.join(f'{k}[{c}]' for k, c in kept)}: this run "
                  "did not measure it")
            plan = keep_unmeasured(plan, kept, pulls[0].number)
    new_text = edit_thresholds(old_text, plan.profile, plan.changes, source=f"{config_path} on {base}")
    diff = unified_diff(old_text, new_text, config_path)
    if new_text == old_text:
        why = (
            f"The latest benchmark run on {plan.gpu_name} ({plan.profile}) proposes no change to the thresholds "
            f"on `{base}`, so this PR is no longer needed."
        )
        for pr in pulls:
            _close(s, pr, why)
        # Also removes a branch left by a run that pushed but failed before opening its PR.
        _delete_branch(s, repo, plan.branch)
        url = pulls[0].html_url if pulls else ""
        return Result("closed" if pulls else "none", url, base, diff, plan.body())
    sha = _push(s, repo, plan, base_sha, config_path, new_text)
    body = plan.body(f"{html_url}/raw/{sha}/{plan.report_dir}")
    if pulls:
        pr, outcome = pulls[0], "updated"
        with s.call("PATCH", f"/pulls/{pr.number}"):
            pr.edit(title=plan.title, body=body, **({} if pr.base.ref == base else {"base": base}))
        for extra in pulls[1:]:
            _close(s, extra, f"Superseded by #{pr.number}, the one threshold PR for {plan.profile}.")
    else:
        pr, outcome = _create_pull(s, repo, plan, base, body), "created"
    _labels(s, repo, pr, plan)
    return Result(outcome, pr.html_url, base, diff, body)
