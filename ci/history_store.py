"""Where history records live: a local folder (``--history-dir``) or the ``nsa-history`` branch.

Both stores have one API: ``models()``, ``load(slug)`` (oldest first), ``load_profile(profile)``
and ``save(record, keep)``. The layout is the same in both (``history/<slug>/<run-id>.json``), so a
folder can be seeded from a checkout of the branch for offline work.

The branch store writes only through the Git Data API, as the threshold PR does: blob -> tree (on
the head's tree, deleting pruned runs) -> commit (parent: the head it read) -> fast-forward the ref,
never a force push. When another decide job moved the branch in between (422 "not a fast forward",
409, or 422 "reference already exists" on the first write), it reads the branch again and rebuilds
on the new head, so both runs survive. A record's path is its run id, so a rerun after any failure
writes the same file again (or finds it identical and writes nothing): nothing is lost or doubled.
A 422 from a branch protection rule or ruleset is no race: it is named, with the setting to change.

Both stores read a model's folder through ``ci.history.sort_out``: a bad record (not UTF-8, not a
file, not a valid record, another model's run, a copy of a run) is skipped with one warning line
and, in the same commit as that model's next saved run, moved to ``quarantine/<slug>/``.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from github import Github, InputGitTreeElement
from github.GitCommit import GitCommit
from github.GitRef import GitRef
from github.GitTree import GitTree
from github.Repository import Repository

from ci.github_call import Caller, GitHubError, branch_ref
from ci.github_errors import Secret
from ci.history import (
    BRANCH,
    DEFAULT_KEEP,
    ROOT,
    HistoryError,
    HistoryRun,
    chronological,
    plan_save,
    sort_out,
    warning,
)

__all__ = ["GitHubHistoryStore", "LocalHistoryStore", "SaveResult"]

Log = Callable[[str], None]
FORBIDDEN = (f"the token lacks contents: write, or a ruleset protects {BRANCH}; give the decide job "
             f"`permissions: contents: write` (or a GitHub App token) and allow it to push to {BRANCH}")
# GitHub's words for a ref update that a branch protection rule or a ruleset refused (422): no rerun passes.
PROTECTED = re.compile(r"protected (branch|ref)|rule violation|ruleset", re.IGNORECASE)


@dataclass(frozen=True)
class SaveResult:
    outcome: str  # added | replaced | unchanged | too-old
    path: str
    pruned: list[str] = field(default_factory=list)
    commit: str | None = None  # the branch commit that holds it (GitHub store), None when nothing moved
    quarantined: list[str] = field(default_factory=list)  # bad records moved to quarantine/<slug>/


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LocalHistoryStore:
    """Records under ``root/history/<slug>/``; writes are atomic (temp file, then rename)."""

    def __init__(self, root: str | os.PathLike[str], log: Log | None = None) -> None:
        self.root = Path(root)
        self.log = log or _stderr
        self._warned: set[str] = set()

    def _warn(self, slug: str, bad: dict[str, str]) -> None:
        for path, why in bad.items():
            if path not in self._warned:
                self._warned.add(path)
                self.log(warning(slug, why))

    def models(self) -> list[str]:
        base = self.root / ROOT
        return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def _read(self, slug: str) -> tuple[dict[str, HistoryRun], dict[str, str], dict[str, str]]:
        """(good runs, their texts, {bad path: why}) of the model's folder; paths relative to the root."""
        texts, unreadable = {}, {}
        folder = self.root / ROOT / slug
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            rel = path.relative_to(self.root).as_posix()
            try:
                texts[rel] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                unreadable[rel] = f"{rel} must be UTF-8 JSON, got a byte that is not UTF-8 at offset {exc.start}"
            except OSError as exc:
                unreadable[rel] = f"{rel} must be a readable file, got {exc.strerror or type(exc).__name__}"
        runs, bad = sort_out(slug, texts, unreadable)
        self._warn(slug, bad)
        return runs, {p: texts[p] for p in runs}, bad

    def load(self, slug: str) -> list[HistoryRun]:
        """The model's runs, oldest first."""
        return chronological(self._read(slug)[0].values())

    def load_profile(self, profile: str) -> dict[str, list[HistoryRun]]:
        """``{slug: runs oldest first}`` for every model whose runs were measured as ``profile``."""
        out = {s: [r for r in self.load(s) if r.profile == profile] for s in self.models()}
        return {s: runs for s, runs in out.items() if runs}

    def save(self, record: HistoryRun, keep: int = DEFAULT_KEEP) -> SaveResult:
        runs, texts, bad = self._read(record.gpu)
        plan = plan_save(runs, texts, record, keep, bad)
        if plan.outcome in ("added", "replaced"):
            if (self.root / plan.path).is_dir():  # a bad record that is a folder, at this run's own path
                shutil.rmtree(self.root / plan.path)
            _atomic_write(self.root / plan.path, plan.text)
        for path in plan.delete:
            (self.root / path).unlink(missing_ok=True)
        for src, dst in plan.quarantine.items():
            target = self.root / dst
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(self.root / src, target)
        self.log(f"history: {plan.outcome} {plan.path}" + (f", pruned {len(plan.delete)}" if plan.delete else "")
                 + (f", quarantined {len(plan.quarantine)}" if plan.quarantine else ""))
        return SaveResult(plan.outcome, plan.path, plan.delete, quarantined=list(plan.quarantine))


class GitHubHistoryStore:
    """Records on the ``branch`` of the repository ``gh`` reaches; see the module docstring."""

    def __init__(self, gh: Github, *, api_url: str, repository: str, token: Secret, branch: str = BRANCH,
                 attempts: int = 5, log: Log | None = None) -> None:
        if attempts < 1:
            raise HistoryError(f"attempts must be at least 1, got {attempts}; use the default 5")
        self.gh, self.branch, self.attempts = gh, branch, attempts
        self.caller = Caller(api_url, repository, token, FORBIDDEN)
        self.repository = repository
        self.log = log or _stderr
        self._repo: Repository | None = None
        self._warned: set[str] = set()

    _warn = LocalHistoryStore._warn

    def _repository(self) -> Repository:
        if self._repo is None:
            with self.caller.call("GET", ""):
                self._repo = self.gh.get_repo(self.repository)
        return self._repo

    def _ref(self) -> GitRef | None:
        return branch_ref(self.caller.call, self._repository(), self.branch)

    def _snapshot(self) -> tuple[GitRef | None, GitCommit | None, GitTree | None, dict[str, str]]:
        """(ref, head commit, its tree, {path: blob sha}) of the branch; Nones and {} before its first run."""
        ref = self._ref()
        if ref is None:
            return None, None, None, {}
        repo = self._repository()
        with self.caller.call("GET", f"/git/commits/{ref.object.sha}"):
            head = repo.get_git_commit(ref.object.sha)
            tree_sha = head.tree.sha
        with self.caller.call("GET", f"/git/trees/{tree_sha}?recursive=1"):
            tree = repo.get_git_tree(tree_sha, recursive=True)
            if tree.raw_data.get("truncated"):
                raise GitHubError(f"{self.branch} must list in one tree call, got a truncated tree; "
                                  "lower --history-keep or squash the branch")
            blobs = {e.path: e.sha for e in tree.tree if e.type == "blob"}
        return ref, head, tree, blobs

    def _blob_text(self, sha: str, path: str) -> str:
        with self.caller.call("GET", f"/git/blobs/{sha}"):
            blob = self._repository().get_git_blob(sha)
            content, encoding = blob.content, blob.encoding
        try:
            return base64.b64decode(content).decode("utf-8") if encoding == "base64" else str(content)
        except ValueError as exc:
            raise HistoryError(f"{self.branch}:{path} must be UTF-8 JSON, got {exc}") from None

    def _read(self, blobs: dict[str, str], slug: str) -> tuple[dict[str, HistoryRun], dict[str, str], dict[str, str]]:
        """(good runs, their texts, {bad path: why}) of the model's folder on the branch."""
        prefix = f"{ROOT}/{slug}/"
        texts, unreadable = {}, {}
        for p, sha in sorted(blobs.items()):
            if p.startswith(prefix) and p.endswith(".json") and "/" not in p[len(prefix):]:
                try:
                    texts[p] = self._blob_text(sha, p)
                except HistoryError as exc:
                    unreadable[p] = str(exc)
        runs, bad = sort_out(slug, texts, unreadable)
        self._warn(slug, {p: why if why.startswith(self.branch) else f"{self.branch}:{why}" for p, why in bad.items()})
        return runs, {p: texts[p] for p in runs}, bad

    def models(self) -> list[str]:
        blobs = self._snapshot()[3]
        return sorted({p.split("/")[1] for p in blobs if p.startswith(f"{ROOT}/") and p.count("/") == 2})

    def load(self, slug: str) -> list[HistoryRun]:
        return chronological(self._read(self._snapshot()[3], slug)[0].values())

    def load_profile(self, profile: str) -> dict[str, list[HistoryRun]]:
        blobs = self._snapshot()[3]
        slugs = sorted({p.split("/")[1] for p in blobs if p.startswith(f"{ROOT}/") and p.count("/") == 2})
        out = {s: [r for r in chronological(self._read(blobs, s)[0].values()) if r.profile == profile]
               for s in slugs}
        return {s: runs for s, runs in out.items() if runs}

    def save(self, record: HistoryRun, keep: int = DEFAULT_KEEP) -> SaveResult:
        """Write ``record`` and prune in one fast-forward commit; retries when the branch moved meanwhile."""
        repo = self._repository()
        for attempt in range(1, self.attempts + 1):
            ref, head, tree, blobs = self._snapshot()
            runs, texts, bad = self._read(blobs, record.gpu)
            plan = plan_save(runs, texts, record, keep, bad)
            if plan.outcome in ("unchanged", "too-old") and not plan.delete and not plan.quarantine:
                self.log(f"history: {plan.outcome} {self.branch}:{plan.path}")
                return SaveResult(plan.outcome, plan.path)
            elements = [InputGitTreeElement(p, "100644", "blob", sha=None) for p in [*plan.delete, *plan.quarantine]]
            elements += [InputGitTreeElement(dst, "100644", "blob", sha=blobs[src]) for src, dst in plan.quarantine.items()]
            with self.caller.call("POST", "/git/blobs"):
                if plan.outcome in ("added", "replaced"):
                    blob = repo.create_git_blob(plan.text, "utf-8")
                    elements.insert(0, InputGitTreeElement(plan.path, "100644", "blob", sha=blob.sha))
            with self.caller.call("POST", "/git/trees"):
                new_tree = repo.create_git_tree(elements, tree) if tree else repo.create_git_tree(elements)
            message = (f"history: {plan.outcome} {record.gpu} run {record.id}"
                       + (f", pruned {len(plan.delete)} older" if plan.delete else "")
                       + (f", quarantined {len(plan.quarantine)} bad" if plan.quarantine else ""))
            with self.caller.call("POST", "/git/commits"):
                commit = repo.create_git_commit(message, new_tree, [head] if head else [])
            try:
                if ref is None:
                    with self.caller.call("POST", "/git/refs"):
                        repo.create_git_ref(f"refs/heads/{self.branch}", commit.sha)
                else:
                    with self.caller.call("PATCH", f"/git/refs/heads/{self.branch}"):
                        ref.edit(commit.sha, force=False)
            except GitHubError as exc:
                # 422 "not a fast forward" / "already exists", 409 conflict: another job moved the
                # branch after we read it (or a retried POST of ours landed). Read it again.
                if exc.status not in (409, 422):
                    raise
                if exc.status == 422 and PROTECTED.search(str(exc)):
                    raise GitHubError(
                        f"{self.branch} must accept the decide job's fast-forward push, got 422 from a branch "
                        f"protection rule or ruleset ({str(exc).split(' (', 1)[-1].split('):', 1)[0]}): not a race, "
                        f"so every rerun fails alike; in the repository's Settings > Branches (or Settings > Rules "
                        f"> Rulesets) take {self.branch} out of the protected branches, or add the decide job's "
                        "token (github-actions or the GitHub App) to the bypass list", 422) from None
                self.log(f"history: {self.branch} moved during attempt {attempt} ({exc.status}); reading it again")
                continue
            self.log(f"history: {plan.outcome} {self.branch}:{plan.path} at {commit.sha[:12]}"
                     + (f", pruned {len(plan.delete)}" if plan.delete else "")
                     + (f", quarantined {len(plan.quarantine)}" if plan.quarantine else ""))
            return SaveResult(plan.outcome, plan.path, plan.delete, commit.sha, list(plan.quarantine))
        raise GitHubError(f"{self.branch} must stay still long enough to fast-forward, got {self.attempts} "
                          "concurrent updates in a row; rerun the decide job (reruns are safe)")

