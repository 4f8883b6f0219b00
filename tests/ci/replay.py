"""Replay committed benchmark runs, night by night, through `ci decide`, `ci history` and `ci pr`.

The runs are the committed results files, in tests/data/ and results/ (real GPU runs, each as
`python -m bench run` wrote it), taken in the order they were measured (`run.created_at`, which is also how history orders
them). Each night runs the real stages: `ci decide` on the night's results, `ci history` on a
folder store that carries over from night to night, and `ci pr` against the GitHub double
(tests/ci/fake_github.py), whose default branch holds the replay's config.

After every night, `Replay.night` checks the double against a ledger kept here, apart from the
code under test: for each GPU model and (key, class), the values its covering runs measured (a run
covers a (key, class) when its cells reached the key's longest nightly length). From that ledger
alone it says what the one threshold PR must hold:

- a run that covered no (key, class) leaves the PR as it was (open or not, same head commit);
- a covered (key, class) is in the PR exactly when decide proposed a change and the last K
  covering runs of this model, and the latest K of every other model of the profile, measured that
  value; otherwise a covering run takes it out;
- a (key, class) the run did not cover keeps whatever the open PR had for it;
- nothing left: no PR is open. At most one PR is open at any time, ever.

Any difference raises AssertionError naming the night, so a replay fails as soon as the pipeline
opens a PR on evidence that does not cover the change, or closes one on a run that measured nothing.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from github import GithubRetry
from ruamel.yaml import YAML

from ci.__main__ import main as ci_main
from ci.github import connect
from ci.history import gpu_slug
from ci.pr_cmd import run_pr
from nsa_contract import keys, results
from tests.ci.fake_github import FakeGitHub

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
DATA = ROOT / "tests" / "data"  # the runs the tests replay, under their results/ paths (results/README.md)
TOKEN = "ghs_FAKE0123456789abcdefREPLAY"
REPOSITORY = "octo/nsa"
Slot = tuple[str, str]  # (key, class)
Case = Mapping[str, Any]


def read(path: Path) -> Any:
    """A committed file's JSON (`.json`, or `.json.xz` / `.json.gz` as results are kept)."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def load(path: Path) -> dict[str, Any]:
    """A committed results file, validated."""
    return results.check(read(path), str(path.relative_to(ROOT)))


def committed(profile: str) -> list[Path]:
    """Every committed results file (tests/data/ and results/) of GPU profile ``profile``, oldest run first."""
    found = []
    for path in (p for root in (DATA, RESULTS) for p in root.rglob("*.json*")):
        if not path.name.endswith((".json", ".json.gz", ".json.xz")):
            continue
        try:
            doc = load(path)
        except (results.ResultsError, ValueError, KeyError, TypeError):
            continue  # not a results file (a decision, a breakdown, a tile sweep)
        if doc["machine"]["sm"] == profile:
            found.append((doc["run"]["created_at"], doc["run"]["id"], path))
    return [p for *_, p in sorted(found)]


def find(name: str) -> Path:
    """The committed file that results/README.md names ``name`` (a path under results/ as the run
    wrote it): in tests/data/ or results/, stored as named or xz-compressed."""
    plain = name.removesuffix(".gz").removesuffix(".xz")
    for root in (DATA, RESULTS):
        for candidate in (name, plain, plain + ".xz"):
            if (root / candidate).is_file():
                return root / candidate
    raise FileNotFoundError(f"no committed results file {name} in tests/data/ or results/; see results/README.md")


def only_key(key: str, classes: Iterable[str] | None = None, also: Iterable[str] = ("fast",)) -> Callable[[Case], bool]:
    """A case filter: the cells of ``key`` (of ``classes`` only, when given), and every case of the
    suites ``also`` (by default `fast`, which decides no threshold). A night so cut is what `python -m
    bench run --suites` would have timed for that key (and class) alone: it takes a second, where
    the whole sweep, ten."""
    k = keys.get(key)
    wanted = None if classes is None else set(classes)
    extra = set(also)

    def keep(c: Case) -> bool:
        if c["suite"] in extra:
            return True
        return (c["suite"] == k.suite and c["op"] == k.op
                and (wanted is None or keys.class_of_params(dict(c["params"])) in wanted))

    return keep


def _expand(value: Any) -> dict[str, int]:
    return dict(value) if isinstance(value, Mapping) else {c: int(value) for c in keys.CLASSES}


def thresholds(config_text: str, profile: str) -> dict[Slot, int]:
    """``{(key, class): value}`` of ``profile`` in a config whose profile sets every key (and class)."""
    block = YAML(typ="safe", pure=True).load(config_text)["profiles"][profile]
    return {(k, c): v for k in keys.names() for c, v in _expand(block[k]).items()}


def history_runs(config_text: str) -> int:
    """K, `decide.history_runs`: how many covering runs must agree."""
    return int(YAML(typ="safe", pure=True).load(config_text)["decide"]["history_runs"])


@dataclass
class Night:
    """What one night did: its source, ``ci pr``'s outcome and the PR the ledger expects after it."""

    source: str
    model: str
    covered: list[Slot]
    outcome: str
    expected: dict[Slot, int]


@dataclass
class Replay:
    """Nights against one GitHub double; ``config`` is configs/base.yaml on its default branch."""

    tmp: Path
    fake: FakeGitHub
    config: str
    profile: str = "sm90"
    keep: Callable[[Case], bool] | None = None
    ledger: dict[str, dict[Slot, list[int | None]]] = field(default_factory=dict)
    pr: dict[Slot, int] = field(default_factory=dict)
    nights: list[Night] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cfg = self.tmp / "configs" / "base.yaml"
        self.cfg.parent.mkdir(parents=True, exist_ok=True)
        self.cfg.write_text(self.config, encoding="utf-8")
        self.base = thresholds(self.config, self.profile)
        self.k = history_runs(self.config)
        self.last: dict[str, str] = {}  # model -> created_at of its latest night
        report = self.tmp / "report"
        report.mkdir()
        (report / "report.md").write_text("# Report\n", encoding="utf-8")

    @property
    def branch(self) -> str:
        return f"nsa-thresholds/{self.profile}"

    def run(self, paths: Iterable[Path]) -> list[Night]:
        for path in paths:
            self.night(path)
        return self.nights

    def night(self, path: Path) -> Night:
        """One night: the three stages on ``path``'s results, then the double checked against the ledger."""
        name = str(path.relative_to(ROOT))
        doc = read(path)
        if self.keep is not None:
            doc = {**doc, "cases": [c for c in doc["cases"] if self.keep(c)]}
        doc = results.check(doc, name)  # the night as replayed (validating the cut-away cases costs seconds)
        model = gpu_slug(doc["machine"]["gpu_name"])
        # The ledger counts a model's runs in the order of the nights; history orders them by created_at.
        # Nights of different models may interleave freely (each model's streak is its own).
        assert doc["run"]["created_at"] > self.last.get(model, ""), f"{name}: nights of {model} out of order"
        self.last[model] = doc["run"]["created_at"]
        res = str(results.dump(doc, self.tmp / "nights" / f"{doc['run']['id']}.json"))
        decision, cfg = str(self.tmp / "out" / "decision.json"), str(self.cfg)
        assert ci_main(["decide", "--results", res, "--config", cfg, "--out", decision]) == 0, name
        raw = json.loads(Path(decision).read_text(encoding="utf-8"))["decisions"]
        # The folder store carries the nights; no token reaches history (its issue is a dry run). Exit
        # 4 (a case slower than its history) still rewrites the decision, and the PR step still runs.
        assert ci_main(["history", "--results", res, "--decision", decision, "--config", cfg, "--history-dir",
                        str(self.tmp / "store"), "--out-dir", str(self.tmp / "out" / "history")]) in (0, 4), name
        before = self._state()
        out, err = io.StringIO(), io.StringIO()
        rc = run_pr(["--decision", decision, "--report-dir", str(self.tmp / "report"), "--out-dir",
                     str(self.tmp / "out" / "pr")],
                    env={"GITHUB_API_URL": self.fake.api_url, "GITHUB_REPOSITORY": REPOSITORY, "GITHUB_TOKEN": TOKEN},
                    out=out, err=err, connector=lambda t: connect(
                        t, retry=GithubRetry(total=2, backoff_factor=0, max_rate_limit_wait=1), pace=False, timeout=5))
        assert rc == 0, f"{name}: ci pr exit {rc}: {err.getvalue()}"
        covered = self._expect(raw, model, saved=doc["run"].get("size") != "smoke")
        night = Night(name, model, covered, out.getvalue().split()[0], dict(self.pr))
        self.nights.append(night)
        self._check(night, before)
        return night

    # -- the ledger: what the PR must hold, from the measured values alone --------------------------
    def _expect(self, raw: list[dict[str, Any]], model: str, saved: bool) -> list[Slot]:
        covered = [e for e in raw if _covers(e)]
        # A smoke run is weighed against the history but never saved to it, so it joins no later streak.
        mine = {s: list(v) for s, v in self.ledger.get(model, {}).items()}
        if saved:
            self.ledger[model] = mine
        for e in covered:
            mine.setdefault((e["key"], e["class"]), []).append(e["measured"])
        for e in covered:
            slot = (e["key"], e["class"])
            target = e["proposed"] if e["changed"] else None
            agree = [mine[slot][-self.k:]] + [runs[slot][-self.k:] for m, runs in self.ledger.items()
                                         if m != model and slot in runs]
            if target is not None and len(mine[slot]) >= self.k and all(v == target for vs in agree for v in vs):
                self.pr[slot] = target
            else:
                self.pr.pop(slot, None)
        return [(e["key"], e["class"]) for e in covered]

    def _state(self) -> tuple[list[int], str | None]:
        return [p.number for p in self.fake.open_pulls()], self.fake.refs.get(f"heads/{self.branch}")

    def _check(self, night: Night, before: tuple[list[int], str | None]) -> None:
        where = f"{night.source} ({night.model}, outcome {night.outcome}, covered {len(night.covered)} slot(s))"
        opened = self.fake.open_pulls()
        assert len(opened) <= 1, f"{where}: {len(opened)} threshold PRs open at once"
        if not night.covered:
            assert self._state() == before, f"{where}: a run that measured no key changed the PR"
            return
        if not self.pr:
            assert not opened, f"{where}: PR #{opened[0].number} is open, but no change lasted {self.k} covering runs"
            return
        assert opened, f"{where}: no PR is open, but {sorted(self.pr)} lasted {self.k} covering runs"
        (pr,) = opened
        if pr.number not in self.numbers:
            assert not before[0], f"{where}: PR #{pr.number} was opened beside #{before[0][0]}"
            self.numbers.append(pr.number)
        on_branch = thresholds(self.fake.files_at(self.branch)["configs/base.yaml"].decode(), self.profile)
        changes = {s: v for s, v in on_branch.items() if v != self.base[s]}
        assert changes == self.pr, f"{where}: the PR changes {changes}, the covering evidence says {self.pr}"


def _covers(entry: Mapping[str, Any]) -> bool:
    """Whether a run's cells reached the key's longest nightly length in this class (read off the entry's
    tested lengths, not taken from `ci history`, which is under test)."""
    longest = max(keys.get(str(entry["key"])).nightly_lengths)
    return any(x.get("T") == longest for x in entry.get("lengths") or [])


def fake_github(config: str) -> FakeGitHub:
    """The double with ``config`` as configs/base.yaml on its default branch (use it as a context manager)."""
    return FakeGitHub({"configs/base.yaml": config.encode(), "README.md": b"# nsa\n"}, token=TOKEN)
