"""One tracking issue per GPU model for performance regressions (PyGithub; see ``ci.regress``).

The issue is titled ``Performance regression on <GPU name>`` (the name made one line of inert
text), labelled ``nsa-regression``, and found by the model's marker in its body,
``<!-- nsa-regression: <gpu slug> -->``, among all open issues: never by its label (which a person
may delete) nor remembered elsewhere, so a rerun finds what a failed run left. Outcomes, as for the
threshold PR:

- ``created``: regressions and no open issue: opened with the list of regressions as its body.
- ``updated``: regressions and an open issue: body replaced, one comment for this run.
- ``closed``: no regression and an open issue: one comment for this run, then closed.
- ``none``: no regression and no open issue.

The body and every comment carry ``<!-- nsa-regression-run: <run id> -->``; a run's comment is not
posted where its marker already is, so rerunning a run adds nothing; a create that failed after GitHub carried it out is
found by looking again, never opened twice. Extra open issues with the model's marker (two jobs
raced, or a run opened one while the label was gone) are closed as duplicates of the oldest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from github import Github
from github.Issue import Issue
from github.Repository import Repository

from ci.github_call import Caller, GitHubError, post_comment
from ci.github_errors import Secret
from ci.history import gpu_slug
from ci.pr_plan import safe_name
from ci.regress import Row

__all__ = ["LABEL", "TITLE_PREFIX", "IssuePlan", "TrackResult", "plan_issue", "track"]

TITLE_PREFIX = "Performance regression on "
LABEL = "nsa-regression"
LABEL_COLOR = "d93f0b"
FORBIDDEN = ("the token lacks issues: write; give the decide job `permissions: issues: write` "
             "(or use a GitHub App token)")
Log = Callable[[str], None]


@dataclass(frozen=True)
class IssuePlan:
    gpu_name: str
    run_id: str
    title: str
    body: str  # the issue body while regressions stand
    comment: str  # this run's comment (update or close)
    regressions: int
    model: str = ""  # the GPU model's slug (ci.history.gpu_slug): the issue's own marker

    @property
    def marker(self) -> str:
        return run_marker(self.run_id)

    @property
    def model_marker(self) -> str:
        return model_marker(self.model)


@dataclass(frozen=True)
class TrackResult:
    outcome: str  # created | updated | closed | none
    url: str  # the issue's web address, "" for none
    number: int | None


def run_marker(run_id: str) -> str:
    return f"<!-- nsa-regression-run: {run_id} -->"


def model_marker(slug: str) -> str:
    return f"<!-- nsa-regression: {slug} -->"


def _fmt_row(r: Row) -> str:
    dense = f"`{r.dense_id.split('/')[2]}`" if r.dense_id else "—"
    return (f"| `{r.id}` | {r.baseline_ms:.4g} | {r.now_ms:.4g} | **{r.ratio:.2f}x** | "
            f"[{r.low:.2f}, {r.high:.2f}] | {dense} | {len(r.baseline_runs)} ({r.method}) |")


def plan_issue(gpu_name: str, run_id: str, rows: Sequence[Row], *, margin: float, k: int,
               run_url: str = "") -> IssuePlan:
    """The issue's title, body and this run's comment from ``ci.regress`` rows (pure)."""
    bad = [r for r in rows if r.flag == "regression"]
    run = f"[`{run_id}`]({run_url})" if run_url else f"`{run_id}`"
    slug, gpu_name = gpu_slug(gpu_name), safe_name(gpu_name)
    title = f"{TITLE_PREFIX}{gpu_name}"
    head = [
        model_marker(slug),
        run_marker(run_id),
        f"Nightly run {run} on **{gpu_name}** is slower than its history in {len(bad)} case(s).",
        "",
        f"Baseline: the pooled samples of the last {k} runs of this GPU model. Slowdown = now / baseline "
        "(divided by the same run's dense case where one exists, so machine drift cancels), with a 95% "
        f"bootstrap interval; flagged when the interval's lower bound exceeds {1 + margin:.2f}x.",
        "",
        "| case | baseline ms | now ms | slowdown | 95% interval | vs dense | baseline runs |",
        "|---|---|---|---|---|---|---|",
    ]
    body = "\n".join(head + [_fmt_row(r) for r in bad]) + "\n\nThis issue closes itself when a run shows none.\n"
    if bad:
        worst = bad[0]
        comment = (f"{run_marker(run_id)}\nRun {run}: {len(bad)} regression(s); worst `{worst.id}` at "
                   f"{worst.ratio:.2f}x [{worst.low:.2f}, {worst.high:.2f}].")
    else:
        comment = f"{run_marker(run_id)}\nRun {run}: no case is slower than its history beyond {1 + margin:.2f}x; closing."
    return IssuePlan(gpu_name, run_id, title, body, comment, len(bad), slug)


class _Tracker:
    def __init__(self, gh: Github, caller: Caller, log: Log) -> None:
        self.gh, self.caller, self.log = gh, caller, log

    def repository(self) -> Repository:
        with self.caller.call("GET", ""):
            return self.gh.get_repo(self.caller.repository)

    def open_issues(self, repo: Repository, plan: IssuePlan) -> list[Issue]:
        """The model's open tracking issues, found by the marker in their body (not by the label,
        which a person may delete, nor by the title)."""
        with self.caller.call("GET", "/issues?state=open"):
            found = [i for i in repo.get_issues(state="open") if i.pull_request is None
                     and plan.model_marker in {line.strip() for line in (i.body or "").splitlines()}]
        return sorted(found, key=lambda i: i.number)

    def comment_once(self, issue: Issue, plan: IssuePlan) -> None:
        """This run's comment, unless the body (opened by this run) or a comment already has its marker."""
        if plan.marker in (issue.body or "") and plan.regressions:
            return
        with self.caller.call("GET", f"/issues/{issue.number}/comments"):
            if any(plan.marker in (c.body or "") for c in issue.get_comments()):
                return
        post_comment(self.caller.call, f"/issues/{issue.number}/comments", plan.marker,
                     lambda: [c.body for c in issue.get_comments()], lambda: issue.create_comment(plan.comment),
                     self.log)

    def close(self, issue: Issue, plan: IssuePlan) -> None:
        self.comment_once(issue, plan)
        with self.caller.call("PATCH", f"/issues/{issue.number}"):
            issue.edit(state="closed")
        self.log(f"closed regression issue #{issue.number}")

    def label(self, repo: Repository) -> None:
        """Create the label when missing; a failure only warns (the issue still opens, unlabelled)."""
        try:
            with self.caller.call("GET", f"/labels/{LABEL}"):
                repo.get_label(LABEL).name  # noqa: B018 - loads it; a missing label raises 404
        except GitHubError as exc:
            if exc.status != 404:
                self.log(f"warning: label {LABEL} not checked: {exc}")
                return
            try:
                with self.caller.call("POST", "/labels"):
                    repo.create_label(LABEL, LABEL_COLOR, "Nightly benchmark slower than its history")
            except GitHubError as exc2:
                self.log(f"warning: label {LABEL} not created: {exc2}")

    def create(self, repo: Repository, plan: IssuePlan) -> list[Issue]:
        """Open the issue; returns the open issues of its title afterwards (oldest first).

        GitHub may have opened it before an error reached us, or twice when PyGithub retried the
        POST after a 5xx: look again rather than trust the answer, and let the caller close extras.
        """
        self.label(repo)
        error: GitHubError | None = None
        try:
            with self.caller.call("POST", "/issues"):
                repo.create_issue(plan.title, plan.body, labels=[LABEL])
        except GitHubError as exc:
            error = exc
        found = self.open_issues(repo, plan)
        if not found:
            raise error or GitHubError(f"the issue {plan.title!r} must be listed after it was opened, got "
                                       "none; rerun (reruns never open a second issue)")
        if error is not None:
            self.log(f"found regression issue #{found[0].number} after a failed create; using it")
        return found

    def dedupe(self, keep: Issue, extras: Sequence[Issue], plan: IssuePlan) -> None:
        why = f"{plan.marker}\nDuplicate of #{keep.number}, the one tracking issue for {plan.gpu_name}."
        for extra in extras:
            self.close(extra, IssuePlan(plan.gpu_name, plan.run_id, plan.title, plan.body, why, 0, plan.model))

def track(gh: Github, plan: IssuePlan, *, api_url: str, repository: str, token: Secret,
          log: Log | None = None) -> TrackResult:
    """Bring the GPU model's tracking issue in line with ``plan``; outcomes in the module docstring.

    Raises:
        GitHubError: a request failed (one line, token scrubbed); a rerun repairs any partial state.
    """
    t = _Tracker(gh, Caller(api_url, repository, token, FORBIDDEN), log or (lambda s: print(s, file=sys.stderr)))
    repo = t.repository()
    issues = t.open_issues(repo, plan)
    if not plan.regressions:
        for issue in issues:
            t.close(issue, plan)
        return TrackResult("closed", issues[0].html_url, issues[0].number) if issues else TrackResult("none", "", None)
    if not issues:
        issue, *extras = t.create(repo, plan)
        t.dedupe(issue, extras, plan)
        t.log(f"opened regression issue #{issue.number}")
        return TrackResult("created", issue.html_url, issue.number)
    issue = issues[0]
    t.comment_once(issue, plan)  # before the edit: an issue this run opened already says it all
    if issue.body != plan.body:
        with t.caller.call("PATCH", f"/issues/{issue.number}"):
            issue.edit(body=plan.body)
    t.dedupe(issue, issues[1:], plan)
    t.log(f"updated regression issue #{issue.number}")
    return TrackResult("updated", issue.html_url, issue.number)
