"""A local, in-memory fake of the GitHub REST endpoints that ``ci.github`` uses.

Serves on 127.0.0.1 with an ephemeral port under a GitHub-Enterprise-style prefix
(``http://127.0.0.1:PORT/api/v3``), so PyGithub talks to it through ``base_url`` exactly as it
would to an Enterprise server. State: one repository with refs, blobs, trees (flat path -> blob),
commits, pull requests, issues, labels and comments. ``fail`` injects errors for matching requests;
``before`` runs a callback first (another writer moving a branch between our read and our write).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

PREFIX = "/api/v3"


def _sha(kind: str, payload: Any) -> str:
    data = payload if isinstance(payload, bytes) else json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha1(kind.encode() + b"\0" + data).hexdigest()


@dataclass
class Failure:
    """Answer ``status`` to the next ``times`` requests matching ``method`` and the path regex.

    ``after=True`` carries the request out first and only then answers the error (a POST that
    GitHub completed although the client saw a 5xx).
    """

    method: str
    pattern: str
    status: int
    message: str = "injected failure"
    headers: dict[str, str] = field(default_factory=dict)
    times: int = 1
    after: bool = False


@dataclass
class Pull:
    number: int
    head: str
    base: str
    title: str
    body: str
    state: str = "open"
    labels: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


@dataclass
class Issue:
    number: int
    title: str
    body: str
    state: str = "open"
    labels: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


@dataclass
class Hook:
    """Call ``fn(fake)`` before serving the next ``times`` requests matching ``method`` and the regex."""

    method: str
    pattern: str
    fn: Callable[[FakeGitHub], None]
    times: int = 1


class FakeGitHub:
    """The fake's state and server; use as a context manager."""

    def __init__(
        self,
        files: dict[str, bytes],
        *,
        owner: str = "octo",
        name: str = "nsa",
        token: str = "",
        default_branch: str = "main",
    ) -> None:
        self.owner, self.name, self.token, self.default_branch = owner, name, token, default_branch
        self.blobs: dict[str, bytes] = {}
        self.trees: dict[str, dict[str, str]] = {}
        self.commits: dict[str, dict[str, Any]] = {}
        self.refs: dict[str, str] = {}
        self.pulls: dict[int, Pull] = {}
        self.labels: dict[str, dict[str, str]] = {}
        self.issues: dict[int, Issue] = {}
        self.hooks: list[Hook] = []
        self.failures: list[Failure] = []
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.RLock()
        self.commit_files(default_branch, files, "initial", parents=[])
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.fake = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    # -- setup and inspection helpers for tests ------------------------------------------------
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{PREFIX}"

    @property
    def html_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{self.owner}/{self.name}"

    def __enter__(self) -> FakeGitHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, method: str, pattern: str, status: int, **kwargs: Any) -> None:
        self.failures.append(Failure(method, pattern, status, **kwargs))

    def before(self, method: str, pattern: str, fn: Callable[[FakeGitHub], None], times: int = 1) -> None:
        self.hooks.append(Hook(method, pattern, fn, times))

    def open_issues(self) -> list[Issue]:
        return [i for i in self.issues.values() if i.state == "open"]

    def is_ancestor(self, old: str, new: str) -> bool:
        """Whether commit ``old`` is ``new`` or one of its ancestors (a fast-forward from old to new)."""
        todo, seen = [new], set()
        while todo:
            sha = todo.pop()
            if sha == old:
                return True
            if sha not in seen and sha in self.commits:
                seen.add(sha)
                todo.extend(self.commits[sha]["parents"])
        return False

    def commit_files(
        self, branch: str, files: dict[str, bytes], message: str, parents: list[str] | None = None
    ) -> str:
        """Commit ``files`` (the whole tree) onto ``branch`` directly, as a push by a person would."""
        with self.lock:
            tree = {p: self._blob(c) for p, c in files.items()}
            tree_sha = self._tree(tree)
            parents = [self.refs[f"heads/{branch}"]] if parents is None else parents
            sha = self._commit(tree_sha, parents, message)
            self.refs[f"heads/{branch}"] = sha
            return sha

    def files_at(self, ref: str) -> dict[str, bytes]:
        with self.lock:
            sha = self.refs.get(f"heads/{ref}", ref)
            return {p: self.blobs[b] for p, b in self.trees[self.commits[sha]["tree"]].items()}

    def open_pulls(self) -> list[Pull]:
        return [p for p in self.pulls.values() if p.state == "open"]

    def writes(self) -> list[tuple[str, str, int]]:
        return [entry for entry in self.log if entry[0] != "GET"]

    # -- object store ----------------------------------------------------------------------------
    def _blob(self, content: bytes) -> str:
        sha = _sha("blob", content)
        self.blobs[sha] = content
        return sha

    def _tree(self, entries: dict[str, str]) -> str:
        sha = _sha("tree", entries)
        self.trees[sha] = dict(entries)
        return sha

    def _commit(self, tree: str, parents: list[str], message: str) -> str:
        sha = _sha("commit", {"tree": tree, "parents": parents, "message": message, "time": time.time_ns()})
        self.commits[sha] = {"tree": tree, "parents": parents, "message": message}
        return sha

    # -- JSON shapes -------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return f"{self.api_url}/repos/{self.owner}/{self.name}{path}"

    def repo_json(self) -> dict[str, Any]:
        return {
            "id": 1,
            "name": self.name,
            "full_name": f"{self.owner}/{self.name}",
            "owner": {"login": self.owner, "url": f"{self.api_url}/users/{self.owner}"},
            "default_branch": self.default_branch,
            "url": self.url(""),
            "html_url": self.html_url,
        }

    def ref_json(self, ref: str) -> dict[str, Any]:
        sha = self.refs[ref]
        return {
            "ref": f"refs/{ref}",
            "url": self.url(f"/git/refs/{ref}"),
            "object": {"sha": sha, "type": "commit", "url": self.url(f"/git/commits/{sha}")},
        }

    def commit_json(self, sha: str) -> dict[str, Any]:
        c = self.commits[sha]
        return {
            "sha": sha,
            "url": self.url(f"/git/commits/{sha}"),
            "message": c["message"],
            "tree": {"sha": c["tree"], "url": self.url(f"/git/trees/{c['tree']}")},
            "parents": [{"sha": p, "url": self.url(f"/git/commits/{p}")} for p in c["parents"]],
        }

    def pull_json(self, p: Pull) -> dict[str, Any]:
        return {
            "number": p.number,
            "id": p.number,
            "state": p.state,
            "title": p.title,
            "body": p.body,
            "url": self.url(f"/pulls/{p.number}"),
            "html_url": f"{self.html_url}/pull/{p.number}",
            "issue_url": self.url(f"/issues/{p.number}"),
            "head": {
                "ref": p.head,
                "label": f"{self.owner}:{p.head}",
                "sha": self.refs.get(f"heads/{p.head}"),
            },
            "base": {"ref": p.base, "label": f"{self.owner}:{p.base}"},
            "labels": [self.labels[n] for n in p.labels],
        }

    def label_json(self, name: str) -> dict[str, Any]:
        return {"name": name, **self.labels[name], "url": self.url(f"/labels/{name}")}

    def issue_json(self, i: Issue) -> dict[str, Any]:
        return {
            "number": i.number,
            "id": i.number,
            "state": i.state,
            "title": i.title,
            "body": i.body,
            "url": self.url(f"/issues/{i.number}"),
            "html_url": f"{self.html_url}/issues/{i.number}",
            "comments_url": self.url(f"/issues/{i.number}/comments"),
            "comments": len(i.comments),
            "labels": [self.label_json(n) for n in i.labels],
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm and delayed
        # ACKs add ~40 ms to every request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        headers = headers or {}
        if "x-ratelimit-remaining" not in {k.lower() for k in headers}:
            self.send_header("X-RateLimit-Remaining", "4999")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        fake: FakeGitHub = self.server.fake  # type: ignore[attr-defined]
        split = urlsplit(self.path)
        path, query = split.path, {k: v[0] for k, v in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null") if length else None
        auth = self.headers.get("Authorization", "")
        with fake.lock:
            if auth.split(" ", 1)[-1] != fake.token:
                # Echo the credential, as a careless proxy might: the client must scrub it.
                fake.log.append((method, path, 401))
                return self._send(401, {"message": f"Bad credentials ({auth})"})
            for hook in [h for h in fake.hooks if h.times > 0 and h.method == method]:
                if re.search(hook.pattern, path):
                    hook.times -= 1
                    hook.fn(fake)
            failure = next(
                (
                    f
                    for f in fake.failures
                    if f.times > 0 and f.method == method and re.search(f.pattern, path)
                ),
                None,
            )
            if failure is not None:
                failure.times -= 1
                if failure.after:
                    _route(fake, method, path, query, body)
                fake.log.append((method, path, failure.status))
                return self._send(failure.status, {"message": failure.message}, failure.headers)
            status, payload = _route(fake, method, path, query, body)
            fake.log.append((method, path, status))
        self._send(status, payload)

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")


def _not_found() -> tuple[int, Any]:
    return 404, {"message": "Not Found"}


def _invalid(message: str) -> tuple[int, Any]:
    return 422, {
        "message": "Validation Failed",
        "errors": [{"resource": "PullRequest", "code": "custom", "message": message}],
    }


def _route(fake: FakeGitHub, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
    root = f"{PREFIX}/repos/{fake.owner}/{fake.name}"
    if not path.startswith(root):
        return _not_found()
    rest = unquote(path[len(root) :])
    if method == "GET" and rest == "":
        return 200, fake.repo_json()
    if m := re.fullmatch(r"/git/ref/(heads/.+)", rest):
        if method != "GET":  # PATCH and DELETE live under /git/refs/
            return _not_found()
        return (200, fake.ref_json(m[1])) if m[1] in fake.refs else _not_found()
    if rest == "/git/refs" and method == "POST":
        ref = body["ref"].removeprefix("refs/")
        if ref in fake.refs:
            return 422, {"message": "Reference already exists"}
        if body["sha"] not in fake.commits:
            return 422, {"message": "Object does not exist"}
        fake.refs[ref] = body["sha"]
        return 201, fake.ref_json(ref)
    if m := re.fullmatch(r"/git/refs/(heads/.+)", rest):
        if m[1] not in fake.refs:
            return 422, {"message": "Reference does not exist"}
        if method == "DELETE":
            del fake.refs[m[1]]
            return 204, None
        if method == "PATCH":
            if not body.get("force") and not fake.is_ancestor(fake.refs[m[1]], body["sha"]):
                return 422, {"message": "Update is not a fast forward"}
            fake.refs[m[1]] = body["sha"]
            return 200, fake.ref_json(m[1])
    if m := re.fullmatch(r"/git/commits/([0-9a-f]+)", rest):
        return (200, fake.commit_json(m[1])) if m[1] in fake.commits else _not_found()
    if (m := re.fullmatch(r"/git/blobs/([0-9a-f]+)", rest)) and method == "GET":
        if m[1] not in fake.blobs:
            return _not_found()
        content = fake.blobs[m[1]]
        return 200, {"sha": m[1], "size": len(content), "encoding": "base64",
                     "content": base64.b64encode(content).decode(), "url": fake.url(f"/git/blobs/{m[1]}")}
    if (m := re.fullmatch(r"/git/trees/([0-9a-f]+)", rest)) and method == "GET":
        if m[1] not in fake.trees:
            return _not_found()
        entries = fake.trees[m[1]]
        # Trees are stored flat (path -> blob); without ?recursive=1 GitHub lists the top level only.
        paths = sorted(entries) if query.get("recursive") else sorted(p for p in entries if "/" not in p)
        return 200, {
            "sha": m[1],
            "url": fake.url(f"/git/trees/{m[1]}"),
            "truncated": False,
            "tree": [{"path": p, "mode": "100644", "type": "blob", "sha": entries[p]} for p in paths],
        }
    if rest == "/git/blobs" and method == "POST":
        raw = base64.b64decode(body["content"]) if body["encoding"] == "base64" else body["content"].encode()
        sha = fake._blob(raw)
        return 201, {"sha": sha, "url": fake.url(f"/git/blobs/{sha}")}
    if rest == "/git/trees" and method == "POST":
        entries = dict(fake.trees[body["base_tree"]]) if body.get("base_tree") else {}
        for e in body["tree"]:
            if e.get("sha") is None:
                entries.pop(e["path"], None)
            else:
                entries[e["path"]] = e["sha"]
        sha = fake._tree(entries)
        return 201, {
            "sha": sha,
            "url": fake.url(f"/git/trees/{sha}"),
            "tree": [
                {"path": p, "mode": "100644", "type": "blob", "sha": b} for p, b in sorted(entries.items())
            ],
        }
    if rest == "/git/commits" and method == "POST":
        if body["tree"] not in fake.trees or any(p not in fake.commits for p in body["parents"]):
            return 422, {"message": "Tree or parent does not exist"}
        sha = fake._commit(body["tree"], body["parents"], body["message"])
        return 201, fake.commit_json(sha)
    if (m := re.fullmatch(r"/contents/(.+)", rest)) and method == "GET":
        ref = query.get("ref", fake.default_branch)
        sha = fake.refs.get(f"heads/{ref}", ref)
        if sha not in fake.commits:
            return _not_found()
        tree = fake.trees[fake.commits[sha]["tree"]]
        target = m[1].strip("/")
        if target in tree:
            content = fake.blobs[tree[target]]
            return 200, {
                "type": "file",
                "encoding": "base64",
                "content": base64.b64encode(content).decode(),
                "size": len(content),
                "name": target.rsplit("/", 1)[-1],
                "path": target,
                "sha": tree[target],
                "url": fake.url(f"/contents/{target}"),
            }
        children = sorted({p[len(target) + 1 :].split("/")[0] for p in tree if p.startswith(target + "/")})
        if not children:
            return _not_found()
        return 200, [
            {
                "type": "file" if f"{target}/{c}" in tree else "dir",
                "name": c,
                "path": f"{target}/{c}",
                "sha": tree.get(f"{target}/{c}", "0" * 40),
                "url": fake.url(f"/contents/{target}/{c}"),
            }
            for c in children
        ]
    if rest == "/pulls" and method == "GET":
        head = query.get("head", "")
        pulls = [
            p
            for p in fake.pulls.values()
            if query.get("state", "open") in (p.state, "all")
            and (not head or f"{fake.owner}:{p.head}" == head)
        ]
        return 200, [fake.pull_json(p) for p in pulls]
    if rest == "/pulls" and method == "POST":
        head, base = body["head"], body["base"]
        if any(p.head == head and p.state == "open" for p in fake.pulls.values()):
            return _invalid(f"A pull request already exists for {fake.owner}:{head}.")
        if f"heads/{head}" not in fake.refs or f"heads/{base}" not in fake.refs:
            return _invalid("head or base branch invalid")
        number = max([0, *fake.pulls, *fake.issues]) + 1
        fake.pulls[number] = Pull(number, head, base, body.get("title", ""), body.get("body", ""))
        return 201, fake.pull_json(fake.pulls[number])
    if (m := re.fullmatch(r"/pulls/(\d+)", rest)) and int(m[1]) in fake.pulls:
        pull = fake.pulls[int(m[1])]
        if method == "PATCH":
            for k in ("title", "body", "state", "base"):
                if k in body:
                    setattr(pull, k, body[k])
        return 200, fake.pull_json(pull)
    if (m := re.fullmatch(r"/issues/(\d+)/comments", rest)) and method == "GET" and int(m[1]) in fake.pulls:
        return 200, [
            {"id": k + 1, "body": c, "url": fake.url(f"/issues/comments/{m[1]}{k}")}
            for k, c in enumerate(fake.pulls[int(m[1])].comments)
        ]
    if (m := re.fullmatch(r"/issues/(\d+)/comments", rest)) and method == "POST" and int(m[1]) in fake.pulls:
        fake.pulls[int(m[1])].comments.append(body["body"])
        return 201, {
            "id": len(fake.pulls[int(m[1])].comments),
            "body": body["body"],
            "url": fake.url(f"/issues/comments/{m[1]}"),
        }
    if (m := re.fullmatch(r"/issues/(\d+)/labels", rest)) and method == "POST" and int(m[1]) in fake.pulls:
        pull = fake.pulls[int(m[1])]
        names = body if isinstance(body, list) else body["labels"]
        for n in names:
            fake.labels.setdefault(n, {"color": "ededed", "description": ""})
            if n not in pull.labels:
                pull.labels.append(n)
        return 200, [fake.label_json(n) for n in pull.labels]
    if (m := re.fullmatch(r"/labels/(.+)", rest)) and method == "GET":
        return (200, fake.label_json(m[1])) if m[1] in fake.labels else _not_found()
    if rest == "/labels" and method == "POST":
        if body["name"] in fake.labels:
            return 422, {"message": "Validation Failed", "errors": [{"code": "already_exists"}]}
        fake.labels[body["name"]] = {"color": body["color"], "description": body.get("description", "")}
        return 201, fake.label_json(body["name"])
    return _issue_route(fake, method, rest, query, body)


def _issue_route(fake: FakeGitHub, method: str, rest: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
    """Issues and their comments (pull requests' comments are served above)."""
    if rest == "/issues" and method == "GET":
        wanted = [n for n in query.get("labels", "").split(",") if n]
        found = [
            i
            for i in fake.issues.values()
            if query.get("state", "open") in (i.state, "all") and all(n in i.labels for n in wanted)
        ]
        return 200, [fake.issue_json(i) for i in sorted(found, key=lambda i: i.number)]
    if rest == "/issues" and method == "POST":
        number = max([0, *fake.pulls, *fake.issues]) + 1
        for n in body.get("labels", []):
            fake.labels.setdefault(n, {"color": "ededed", "description": ""})
        fake.issues[number] = Issue(number, body["title"], body.get("body", ""), labels=list(body.get("labels", [])))
        return 201, fake.issue_json(fake.issues[number])
    m = re.fullmatch(r"/issues/(\d+)(/comments)?", rest)
    if not m or int(m[1]) not in fake.issues:
        return _not_found()
    issue = fake.issues[int(m[1])]
    if m[2] and method == "GET":
        return 200, [
            {"id": k + 1, "body": c, "url": fake.url(f"/issues/comments/{issue.number}{k}")}
            for k, c in enumerate(issue.comments)
        ]
    if m[2] and method == "POST":
        issue.comments.append(body["body"])
        return 201, {"id": len(issue.comments), "body": body["body"], "url": fake.url(f"/issues/{issue.number}")}
    if method == "PATCH":
        for k in ("title", "body", "state"):
            if k in body:
                setattr(issue, k, body[k])
    return 200, fake.issue_json(issue)
