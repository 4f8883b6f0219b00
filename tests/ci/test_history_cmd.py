"""`python -m ci history` on replayed nightlies: `ci decide`, then `ci history`, night after night.

Each night is a committed results file with a new run id and date (``history_fixtures.nightly``),
decided by the real `ci decide` and passed through the real `ci history` parser and command, with
history in a folder (``--history-dir``) or on the ``nsa-history`` branch of the fake GitHub, and
the tracking issue on the fake GitHub.
"""

from __future__ import annotations

import io
import json
import lzma
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from github import GithubRetry

from ci import history, history_cmd
from ci.__main__ import build_parser
from ci.__main__ import main as ci_main
from ci.github import connect
from tests.ci import fixtures as fx
from tests.ci import history_fixtures as hx
from tests.ci.fake_github import FakeGitHub

TOKEN = "ghs_FAKE0123456789abcdefHISTORYCMD"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
H100_SLUG, H200_SLUG = history.gpu_slug(H100), history.gpu_slug(H200)
SEL = ("triton/selected/",)  # the selection kernel's 42 cases: sel g4 measures 256 on the H100 file
LONG = ("-T8192-", "-T16384-")  # 18 long cases: the regression replay (the bootstrap is the slow part)
SLOW = "triton/selected/triton/B1-T8192-Hq8-Hkv2-D64-l32-d16-ls64-n16-partbranch-bf16"
SMOKE = hx.ROOT / "tests/data/h200x2/shard-smoke.json.xz"


@dataclass
class Pipeline:
    """`ci decide` then `ci history` in ``tmp`` for one nightly after another."""

    tmp: Path
    store: str  # "dir" or "branch"
    fake: FakeGitHub | None = None
    outputs: list[dict[str, str]] = field(default_factory=list)

    @property
    def decision(self) -> Path:
        return self.tmp / "out" / "decision.json"

    @property
    def out_dir(self) -> Path:
        return self.tmp / "out" / "history"

    def env(self) -> dict[str, str]:
        env = {"GITHUB_OUTPUT": str(self.tmp / "github_output")}
        if self.fake is not None:
            env |= {"GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": "octo/nsa", "GITHUB_API_URL": self.fake.api_url}
        return env

    def results(self, doc: Mapping[str, Any]) -> Path:
        path = self.tmp / "results" / f"{doc['run']['id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc), encoding="utf-8")
        return path

    @property
    def config(self) -> Path:
        """configs/base.yaml with every threshold at -1: the live values must not shape these replays."""
        path = self.tmp / "configs" / "base.yaml"
        if not path.exists():
            fx.write_pristine_config(path)
        return path

    def decide(self, results: Path) -> None:
        assert ci_main(["decide", "--results", str(results), "--config", str(self.config),
                        "--out", str(self.decision)]) in (0, 3)

    def history(self, results: Path, *extra: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
        argv = ["history", "--results", str(results), "--decision", str(self.decision),
                "--out-dir", str(self.out_dir), "--config", str(self.config), *extra]
        if self.store == "dir":
            argv += ["--history-dir", str(self.tmp / "store")]
        args = build_parser().parse_args(argv)
        assert args.run is history_cmd.main
        out, err = io.StringIO(), io.StringIO()
        (self.tmp / "github_output").unlink(missing_ok=True)
        rc = history_cmd.main(args, env=self.env() if env is None else env, out=out, err=err, connector=lambda t: connect(
            t, retry=GithubRetry(total=2, backoff_factor=0, max_rate_limit_wait=1), pace=False, timeout=5))
        assert TOKEN not in out.getvalue() + err.getvalue()
        gh_out = self.tmp / "github_output"
        self.outputs.append(dict(line.split("=", 1) for line in gh_out.read_text().splitlines())
                            if gh_out.exists() else {})
        return rc, out.getvalue(), err.getvalue()

    def night(self, doc: Mapping[str, Any], *extra: str) -> tuple[int, dict[str, Any]]:
        path = self.results(doc)
        self.decide(path)
        rc, _, err = self.history(path, *extra)
        assert rc in (0, 4), err
        return rc, json.loads(self.decision.read_text())

    def records(self, slug: str) -> list[str]:
        if self.store == "dir":
            folder = self.tmp / "store" / "history" / slug
            return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []
        assert self.fake is not None
        files = self.fake.files_at(history.BRANCH) if f"heads/{history.BRANCH}" in self.fake.refs else {}
        return sorted(p.rsplit("/", 1)[1] for p in files if p.startswith(f"history/{slug}/"))


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub({"README.md": b"# nsa\n"}, token=TOKEN) as server:
        yield server


@pytest.fixture(params=["dir", "branch"])
def pipe(request: pytest.FixtureRequest, tmp_path: Path, fake: FakeGitHub) -> Pipeline:
    return Pipeline(tmp_path, request.param, fake)


def changed(doc: Mapping[str, Any]) -> list[str]:
    """Every place the decision still proposes a change: entries, branch summaries, their classes."""
    out = [f"{e['key']}[{e['class']}]" for e in doc["decisions"] if e["changed"]]
    for name, b in doc["branches"].items():
        out += [name] if b["changed"] or b["proposed"] != b["current"] else []
        out += [f"{name}[{c}]" for c, e in b["classes"].items() if e["changed"]]
    return out


def run_id(night: int) -> str:
    return f"{hx.START + timedelta(days=night):%Y%m%dT%H%M%SZ}-n{night:03d}"


def slower_short(doc_rel: str, factor: float, up_to: int) -> dict[str, float]:
    """Scale the Triton side of every cell at T <= up_to (the H200 disagrees at short lengths)."""
    return {c["id"]: factor for c in hx.real(doc_rel)["cases"]
            if c["backend"] == "triton" and c["params"]["T"] <= up_to}


# (a) ------------------------------------------------------------------------------------------------
def test_models_that_disagree_never_change_a_threshold_until_k_runs_of_each_agree(pipe: Pipeline) -> None:
    slow = slower_short(hx.H100_TRITON, 3.0, 4096)
    for n in range(6):  # H100 on even nights, H200 (slower at short lengths) on odd ones
        on_h200 = n % 2 == 1
        doc = hx.nightly(hx.H100_TRITON, n, slow if on_h200 else None, gpu_name=H200 if on_h200 else H100, keep=SEL)
        rc, decision = pipe.night(doc)
        assert rc == 0 and changed(decision) == [], (n, changed(decision))
        entry = next(e for e in decision["decisions"] if (e["key"], e["class"]) == ("triton_min_len_sel", "g4"))
        assert entry["lasting"]["raw"] is not None or on_h200  # the H100's own run proposed 256
        assert decision["history"]["store"] == ("dir:" + str(pipe.tmp / "store") if pipe.store == "dir"
                                                else "branch:nsa-history")
    assert "run " in entry["reason"] and " measured " in entry["reason"]  # which run disagreed
    assert pipe.outputs[-1] == {"history": "added", "regression_issue": "none"}

    for n in range(6, 9):  # then the H200 agrees with the H100's last three runs
        rc, decision = pipe.night(hx.nightly(hx.H100_TRITON, n, gpu_name=H200, keep=SEL))
        assert rc == 0
    assert changed(decision) == ["triton_min_len_sel[g4]", "triton_sel", "triton_sel[g4]"]
    branch = decision["branches"]["triton_sel"]
    assert branch["proposed"] == {"g1": -1, "g2": -1, "g4": 256, "g8": -1, "g16": -1}
    assert "held in the last 3 runs on nvidia-h200 and on nvidia-h100-80gb-hbm3" in branch["reason"]
    ev = next(e for e in decision["history"]["evidence"] if e["held"])
    assert {(x["model"], x["measured"]) for x in ev["evidence"]} == {(H200_SLUG, 256), (H100_SLUG, 256)}
    assert decision["history"]["runs_used"] == {H200_SLUG: [run_id(n) for n in (6, 7, 8)],
                                                H100_SLUG: [run_id(n) for n in (0, 2, 4)]}
    assert len(pipe.records(H100_SLUG)) == 3 and len(pipe.records(H200_SLUG)) == 6
    assert sorted(p.name for p in (pipe.out_dir / "trends").iterdir()) == ["trend_key_triton_min_len_sel.png"]


# (b) ------------------------------------------------------------------------------------------------
def test_a_slow_case_opens_updates_and_closes_the_issue(pipe: Pipeline) -> None:
    assert pipe.fake is not None
    outcomes, codes = [], []
    for n in range(7):
        scale = {SLOW: 1.2} if n in (3, 4) else None
        rc, decision = pipe.night(hx.nightly(hx.H100_TRITON, n, scale, gpu_name=H100, keep=LONG))
        codes.append(rc)
        outcomes.append(pipe.outputs[-1]["regression_issue"])
        assert decision["regressions"]["flagged"] == ([SLOW] if n in (3, 4) else [])
        if n == 3:
            (issue,) = pipe.fake.open_issues()
            assert SLOW in issue.body and decision["regressions"]["rows"][0]["id"] == SLOW
    assert codes == [0, 0, 0, 4, 4, 0, 0]
    assert outcomes == ["skipped", "none", "none", "created", "updated", "closed", "none"]
    assert pipe.fake.open_issues() == [] and len(pipe.fake.issues) == 1
    report = json.loads((pipe.out_dir / "history.json").read_text())
    assert report["regression_issue"] == {"outcome": "none", "url": "", "number": None}


def test_exit_4_comes_after_everything_was_written(tmp_path: Path, fake: FakeGitHub) -> None:
    pipe = Pipeline(tmp_path, "dir", fake)
    for n in range(3):
        pipe.night(hx.nightly(hx.H100_TRITON, n, gpu_name=H100, keep=LONG))
    rc, decision = pipe.night(hx.nightly(hx.H100_TRITON, 3, {SLOW: 1.2}, gpu_name=H100, keep=LONG))
    assert rc == 4 and decision["regressions"]["margin"] == 0.1
    report = json.loads((pipe.out_dir / "history.json").read_text())
    assert report["history"]["outcome"] == "added" and report["regression_issue"]["outcome"] == "created"
    assert report["regressions"] == [SLOW]
    saved = history.loads((tmp_path / "store" / report["history"]["path"]).read_text())
    assert saved.regressions == [SLOW]  # kept out of the next nights' baselines
    assert pipe.outputs[-1] == {"history": "added", "regression_issue": "created"}


# The measured H100 replay: two nightlies of one commit, the second on a slower host. The whole-NSA
# `auto` plan at T=1k went 0.89 -> 1.17 ms while the GPU-bound cases did not move.
AUTO_1K = "auto/nsa_prefill/autoplan/B1-T1024-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-planauto-bf16"
AUTO_KEEP = ("B1-T1024-Hq64-Hkv4-",)  # AUTO_1K and the fixed plans of the same shape, unchanged
HOST_LINE = ("host-bound: this run's host enqueue time alone reaches the baseline's time; the kernels "
             "cannot be judged from it")


def auto_night(night: int, now: tuple[float, float | None], base: tuple[float, float | None]) -> dict[str, Any]:
    return hx.retimed(hx.H100_AUTO, night, {AUTO_1K: now if night == 3 else base}, gpu_name=H100, keep=AUTO_KEEP)


@pytest.mark.parametrize(("host_ms", "flag", "code"), [(1.1, "host", 0), (0.3, "regression", 4),
                                                       (None, "regression", 4)])
def test_a_slower_host_is_shown_but_opens_no_issue_and_fails_nothing(tmp_path: Path, fake: FakeGitHub,
                                                                     host_ms: float | None, flag: str,
                                                                     code: int) -> None:
    from ci import report

    pipe = Pipeline(tmp_path, "branch", fake)
    base = (0.9, None if host_ms is None else 0.6)  # None: records from before host_ms, as before
    for n in range(3):
        assert pipe.night(auto_night(n, base, base))[0] == 0
    rc, decision = pipe.night(auto_night(3, (1.17, host_ms), base))
    rows = decision["regressions"]["rows"]
    assert rc == code and decision["regressions"]["time_floor_ms"] == 0.1
    assert rows[0]["id"] == AUTO_1K and rows[0]["flag"] == flag and rows[0]["host_ms"] == host_ms
    assert rows[0]["ratio"] == pytest.approx(1.3, rel=2e-3) and all(r["flag"] == "" for r in rows[1:])
    saved = history.loads(fake.files_at(history.BRANCH)[f"history/{H100_SLUG}/{run_id(3)}.json"].decode())
    text = report.render_report(decision)
    if flag == "host":
        assert decision["regressions"]["flagged"] == [] and saved.regressions == []
        assert fake.issues == {} and pipe.outputs[-1] == {"history": "added", "regression_issue": "none"}
        assert HOST_LINE in text and "## Regressions" not in text
        assert f"| `{AUTO_1K}` | 1.17 | 0.9 | 1.1 | 1.30x [" in text and "0 flagged" in text
        assert "1 slower but host-bound" in report.render_summary(decision)
    else:
        assert decision["regressions"]["flagged"] == [AUTO_1K] and saved.regressions == [AUTO_1K]
        (issue,) = fake.open_issues()
        assert AUTO_1K in issue.body and pipe.outputs[-1]["regression_issue"] == "created"
        assert "## Regressions" in text and HOST_LINE not in text


@pytest.mark.parametrize(("floor", "flag", "code"), [(None, "launch-bound", 0), ("0.01", "regression", 4)])
def test_a_slowdown_under_the_config_time_floor_is_launch_bound(tmp_path: Path, fake: FakeGitHub,
                                                               floor: str | None, flag: str, code: int) -> None:
    pipe = Pipeline(tmp_path, "dir", fake)
    if floor is not None:
        text = pipe.config.read_text(encoding="utf-8")
        assert "time_floor_ms: 0.1 " in text
        pipe.config.write_text(text.replace("time_floor_ms: 0.1 ", f"time_floor_ms: {floor} "), encoding="utf-8")
    for n in range(3):
        assert pipe.night(auto_night(n, (0.05, None), (0.05, None)))[0] == 0
    rc, decision = pipe.night(auto_night(3, (0.08, None), (0.05, None)))
    (row,) = [r for r in decision["regressions"]["rows"] if r["id"] == AUTO_1K]
    assert rc == code and row["flag"] == flag and row["ratio"] == pytest.approx(1.6, rel=2e-3)
    assert decision["regressions"]["flagged"] == ([AUTO_1K] if code else [])
    assert len(fake.open_issues()) == (1 if code else 0)


# (c) ------------------------------------------------------------------------------------------------
def test_a_smoke_run_never_proposes_and_is_not_saved(tmp_path: Path, fake: FakeGitHub) -> None:
    pipe = Pipeline(tmp_path, "dir", fake)
    pipe.decide(SMOKE)
    rc, out, err = pipe.history(SMOKE)
    assert rc == 0, err
    decision = json.loads(pipe.decision.read_text())
    assert changed(decision) == [] and decision["regressions"]["flagged"] == []
    assert all(e["lasting"]["raw"] is None for e in decision["decisions"])  # decide proposed nothing either
    assert "history=not saved" in out and pipe.records(history.gpu_slug("NVIDIA H200")) == []
    assert pipe.outputs[-1] == {"history": "not saved", "regression_issue": "skipped"}
    assert fake.writes() == []


# (d) ------------------------------------------------------------------------------------------------
def test_a_rerun_of_the_same_run_adds_nothing(pipe: Pipeline) -> None:
    assert pipe.fake is not None
    docs = [hx.nightly(hx.H100_TRITON, n, gpu_name=H100, keep=SEL) for n in range(2)]
    for doc in docs:
        pipe.night(doc)
    first = pipe.decision.read_bytes()
    writes = len(pipe.fake.writes())
    rc, _, err = pipe.history(pipe.results(docs[1]))  # the step rerun on the decision it rewrote
    assert rc == 0, err
    assert pipe.decision.read_bytes() == first
    _, again = pipe.night(docs[1])  # the whole job rerun: decide, then history
    assert json.dumps(again).encode() and pipe.decision.read_bytes() == first
    assert pipe.outputs[-1]["history"] == "unchanged"
    assert len(pipe.records(H100_SLUG)) == 2
    assert pipe.fake.writes()[writes:] == []  # no commit, no comment
    assert "only 2 of 3 runs so far" in again["branches"]["triton_sel"]["reason"]


# (e) ------------------------------------------------------------------------------------------------
def _bad(tmp: Path, pipe: Pipeline, results: Path, name: str) -> tuple[list[str], dict[str, str] | None]:
    other = pipe.results(hx.nightly(hx.H100_TRITON, 9, gpu_name=H100, keep=LONG))
    broken = tmp / "broken.json"
    if name == "decision is not JSON":
        pipe.decision.write_text("{", encoding="utf-8")
    elif name == "decision of another schema":
        pipe.decision.write_text(json.dumps({"schema": "nsa-decision/1"}), encoding="utf-8")
    elif name == "bad config":
        broken.write_text("decide:\n  history_runs: 0\n", encoding="utf-8")
        return ["--config", str(broken)], None
    elif name == "decision of another run":
        return ["--results", str(other)], None
    elif name == "results missing":
        return ["--results", str(tmp / "missing.json")], None
    elif name == "two GPU models":
        h200 = pipe.results(hx.nightly(hx.H100_TRITON, 8, gpu_name=H200, keep=("-T4096-",)))
        return ["--results", str(results), str(h200)], None
    elif name == "dry-run variable":
        return [], {"NSA_PR_DRY_RUN": "maybe"}
    elif name in ("run dated in the future", "run dated yesterday"):
        doc = json.loads(results.read_text())
        doc["run"]["created_at"] = "2999-01-01T00:00:00Z" if name == "run dated in the future" else "yesterday"
        broken.write_text(json.dumps(doc), encoding="utf-8")
        return ["--results", str(broken)], None
    return [], None


BAD = {
    "decision is not JSON": "must be JSON",
    "decision of another schema": "decision.schema must be 'nsa-decision/2', got 'nsa-decision/1'",
    "bad config": "decide.history_runs must be an int >= 1",
    "decision of another run": "must decide run",
    "results missing": "missing.json",
    "two GPU models": "must come from one GPU model",
    "dry-run variable": "NSA_PR_DRY_RUN must be true or false",
    "run dated in the future": "run.created_at must not be in the future",
    "run dated yesterday": "run.created_at must be a UTC ISO-8601 time",
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_exits_2_and_changes_nothing(tmp_path: Path, fake: FakeGitHub, name: str) -> None:
    pipe = Pipeline(tmp_path, "dir", fake)
    results = pipe.results(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=LONG))
    pipe.decide(results)
    extra, env = _bad(tmp_path, pipe, results, name)
    before = pipe.decision.read_bytes()
    argv: Sequence[str] = extra if "--results" in extra else ["--results", str(results), *extra]
    args = build_parser().parse_args(["history", *argv, "--decision", str(pipe.decision), "--out-dir",
                                      str(pipe.out_dir), "--history-dir", str(tmp_path / "store")])
    err = io.StringIO()
    rc = history_cmd.main(args, env={**pipe.env(), **(env or {})}, out=io.StringIO(), err=err)
    assert rc == 2
    message = err.getvalue()
    assert message.startswith("error: ") and message.count("\n") == 1 and BAD[name] in message, message
    assert pipe.decision.read_bytes() == before
    assert not pipe.out_dir.exists() and not (tmp_path / "store").exists()
    assert not (tmp_path / "github_output").exists() and fake.writes() == []


# GitHub failures, dry runs, the first run -------------------------------------------------------------
def test_a_refused_issue_exits_1_with_one_line_and_the_rerun_repairs(tmp_path: Path, fake: FakeGitHub) -> None:
    pipe = Pipeline(tmp_path, "branch", fake)
    for n in range(3):
        pipe.night(hx.nightly(hx.H100_TRITON, n, gpu_name=H100, keep=LONG))
    path = pipe.results(hx.nightly(hx.H100_TRITON, 3, {SLOW: 1.2}, gpu_name=H100, keep=LONG))
    pipe.decide(path)
    fake.fail("GET", r"/issues$", 403, message=f"Resource not accessible by integration {TOKEN}")
    rc, _, err = pipe.history(path)
    assert rc == 1 and err.strip().splitlines()[-1].startswith("error: GitHub answered 403")
    assert "issues: write" in err
    assert pipe.outputs[-1] == {"history": "added", "regression_issue": "failed"}
    assert json.loads((pipe.out_dir / "history.json").read_text())["error"].startswith("GitHub answered 403")
    rc, _, err = pipe.history(path)  # the rerun: history already there, the issue opens now
    assert rc == 4, err
    assert pipe.outputs[-1] == {"history": "unchanged", "regression_issue": "created"}
    assert len(pipe.records(H100_SLUG)) == 4


def test_an_unreachable_branch_exits_1_and_leaves_the_decision(tmp_path: Path, fake: FakeGitHub) -> None:
    pipe = Pipeline(tmp_path, "branch", fake)
    path = pipe.results(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=LONG))
    pipe.decide(path)
    before = pipe.decision.read_bytes()
    fake.fail("GET", r"/git/ref/heads/nsa-history$", 500, times=5)
    rc, _, err = pipe.history(path)
    assert rc == 1 and err.startswith("error: GitHub kept failing for GET") and err.count("\n") == 1
    assert pipe.decision.read_bytes() == before and pipe.outputs[-1] == {}


def test_a_first_run_without_any_store_keeps_current_values(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "none")
    rc, decision = pipe.night(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=SEL), "--dry-run")
    assert rc == 0 and changed(decision) == []
    g4 = decision["branches"]["triton_sel"]["classes"]["g4"]
    assert "this run measured 256, but only 1 of 3 runs so far" in g4["reason"]
    assert g4["lasting"]["raw"]["proposed"] == 256 and decision["history"]["store"] == "none"
    assert decision["regressions"] == {"margin": 0.1, "k": 3, "time_floor_ms": 0.1, "rows": [], "flagged": []}
    issue = json.loads((pipe.out_dir / "issue.json").read_text())
    assert issue["outcome"] == "dry-run" and issue["planned"] == "skipped"
    assert (pipe.out_dir / "issue_body.md").read_text().startswith("<!-- nsa-regression:")
    assert pipe.outputs[-1] == {"history": "not saved", "regression_issue": "dry-run"}


def test_a_dry_run_with_a_history_dir_reads_it_and_plans_the_issue(tmp_path: Path, fake: FakeGitHub) -> None:
    pipe = Pipeline(tmp_path, "dir", fake)
    for n in range(3):
        pipe.night(hx.nightly(hx.H100_TRITON, n, gpu_name=H100, keep=LONG))
    writes = len(fake.writes())
    rc, decision = pipe.night(hx.nightly(hx.H100_TRITON, 3, {SLOW: 1.2}, gpu_name=H100, keep=LONG), "--dry-run")
    assert rc == 4 and decision["regressions"]["flagged"] == [SLOW]
    issue = json.loads((pipe.out_dir / "issue.json").read_text())
    assert issue["planned"] == "created or updated" and issue["regressions"] == 1
    assert SLOW in (pipe.out_dir / "issue_body.md").read_text()
    assert len(pipe.records(H100_SLUG)) == 3 and fake.writes()[writes:] == []


def test_help_names_exit_4_and_that_report_and_issue_still_happen(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ci_main(["history", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "4 a regression was flagged" in text and "report and the PR steps still run" in text


def test_a_chart_that_cannot_be_drawn_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ci import trends

    def broken(*_: Any) -> list[Path]:
        raise OSError("disk full")

    monkeypatch.setattr(trends, "write_trends", broken)
    pipe = Pipeline(tmp_path, "none")
    path = pipe.results(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=LONG))
    pipe.decide(path)
    rc, _, err = pipe.history(path)
    assert rc == 0 and "warning: trend charts not drawn (OSError: disk full)" in err
    report = json.loads((pipe.out_dir / "history.json").read_text())
    assert report["trends"] == [] and report["trends_error"] == "OSError: disk full" and report["error"] is None


def test_nsa_history_dir_stands_in_for_history_dir(tmp_path: Path, fake: FakeGitHub,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A local replay (`make gpu-bench`) has no token: NSA_HISTORY_DIR is its store, the flag still wins,
    and an empty value is no store at all."""
    pipe = Pipeline(tmp_path, "none")
    folder = tmp_path / "store"
    for n in range(2):
        path = pipe.results(hx.nightly(hx.H100_TRITON, n, gpu_name=H100, keep=LONG))
        pipe.decide(path)
        rc, out, _ = pipe.history(path, env={"GITHUB_OUTPUT": str(tmp_path / "github_output"),
                                             history_cmd.HISTORY_DIR_ENV: str(folder)})
        assert rc == 0 and f"history=added (dir:{folder}: " in out
    assert len(list((folder / "history" / H100_SLUG).glob("*.json"))) == 2
    decision = json.loads(pipe.decision.read_text())
    assert decision["history"]["runs_used"][H100_SLUG] == [run_id(0), run_id(1)]

    flag = tmp_path / "flag"
    rc, out, _ = pipe.history(path, "--history-dir", str(flag), env={history_cmd.HISTORY_DIR_ENV: str(folder)})
    assert rc == 0 and f"dir:{flag}" in out and (flag / "history" / H100_SLUG).is_dir()
    rc, out, _ = pipe.history(path, env={history_cmd.HISTORY_DIR_ENV: "  "})
    assert rc == 0 and "history=not saved (none: no --history-dir, no NSA_HISTORY_DIR" in out

    with pytest.raises(SystemExit):
        ci_main(["history", "--help"])
    assert "$NSA_HISTORY_DIR" in capsys.readouterr().out


# A history store that heals -----------------------------------------------------------------------
def plant(pipe: Pipeline, path: str, content: bytes) -> None:
    """Put a file into the pipeline's store as a person's push would."""
    if pipe.store == "dir":
        target = pipe.tmp / "store" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        return
    assert pipe.fake is not None
    has = f"heads/{history.BRANCH}" in pipe.fake.refs
    files = pipe.fake.files_at(history.BRANCH) if has else {}
    pipe.fake.commit_files(history.BRANCH, {**files, path: content}, "a hand edit", parents=None if has else [])


def test_a_corrupt_record_of_another_model_blocks_no_run_and_heals_at_its_next_run(pipe: Pipeline) -> None:
    bad = f"history/{H200_SLUG}/20251130T000000Z-x.json"
    plant(pipe, bad, b"{")
    path = pipe.results(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=SEL))
    pipe.decide(path)
    rc, _, err = pipe.history(path)
    assert rc == 0, err
    (line,) = [x for x in err.splitlines() if bad in x]
    assert line.startswith("warning: ") and "must be JSON" in line and f"quarantine/{H200_SLUG}/" in line
    assert pipe.records(H100_SLUG) == [f"{run_id(0)}.json"]
    rc, _ = pipe.night(hx.nightly(hx.H100_TRITON, 1, gpu_name=H200, keep=SEL))  # the H200's own run heals it
    assert rc == 0 and pipe.records(H200_SLUG) == [f"{run_id(1)}.json"]
    path = pipe.results(hx.nightly(hx.H100_TRITON, 2, gpu_name=H100, keep=SEL))
    pipe.decide(path)
    rc, _, err = pipe.history(path)
    assert rc == 0 and bad not in err and "warning" not in err


def test_a_renamed_copy_of_a_run_is_not_a_second_run(pipe: Pipeline) -> None:
    _, first = pipe.night(hx.nightly(hx.H100_TRITON, 0, gpu_name=H100, keep=SEL))
    record = history.record_path(H100_SLUG, run_id(0))
    text = ((pipe.tmp / "store" / record).read_bytes() if pipe.store == "dir" else
            pipe.fake.files_at(history.BRANCH)[record])  # type: ignore[union-attr]
    plant(pipe, f"history/{H100_SLUG}/copy.json", text)
    _, decision = pipe.night(hx.nightly(hx.H100_TRITON, 1, gpu_name=H100, keep=SEL))
    assert changed(decision) == []  # K = 3, two real runs: nothing holds yet
    assert "only 2 of 3 runs so far" in decision["branches"]["triton_sel"]["reason"]
    assert decision["history"]["runs_used"][H100_SLUG] == [run_id(0), run_id(1)]
    assert pipe.records(H100_SLUG) == [f"{run_id(0)}.json", f"{run_id(1)}.json"]  # the copy is in quarantine


# --- the decide job on the committed H100 nightlies (tests/data/h100/nightly, results/README.md) -------
#
# Run 3's results (ee410f6, with `timing.host_ms`) against the history store of runs 1 and 2, as the
# workflow's decide job sees it: the decision proposes nothing (the three "lasting" changes its job
# proposed at ee410f6 rested on cells where both sides were host-bound; the one change this run
# measures on its own is held back by the K-run rule) and no case is a regression (run 2's host was slower,
# run 3's was not; host-bound slowdowns are flagged `host`). This is the replay committed in
# run3/replay-6fa0465; the test keeps the rule from drifting away from the real data.

NIGHTLY = hx.ROOT / "tests/data/h100/nightly"
EARLIER = ("20261122T192959Z-11cdeb3-c02c78.json", "20261122T193633Z-11cdeb3-b56fd0.json")


def test_run3_replayed_on_runs_1_and_2_proposes_nothing_and_flags_no_regression(tmp_path, monkeypatch):
    store = tmp_path / "store"
    model = store / "history" / "nvidia-h100-80gb-hbm3"
    model.mkdir(parents=True)
    for name in EARLIER:
        # Stored xz-compressed; the history store reads plain JSON records.
        packed = NIGHTLY / "history-store/history/nvidia-h100-80gb-hbm3" / f"{name}.xz"
        (model / name).write_bytes(lzma.decompress(packed.read_bytes()))
    monkeypatch.setenv("NSA_HISTORY_DIR", str(store))
    for var in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT"):
        monkeypatch.delenv(var, raising=False)
    results, decision = NIGHTLY / "run3/results.json.xz", tmp_path / "decision.json"
    assert ci_main(["decide", "--results", str(results), "--out", str(decision)]) == 0
    raw = json.loads(decision.read_text())
    # This run alone measures one change (Triton compressed at G = 4 adopting from 4096, extended down
    # over host-bound lengths); runs 1 and 2 did not measure it, so the history rule holds it back.
    assert [(b["key"], c) for b in raw["branches"].values() for c, e in b["classes"].items()
            if e["changed"]] == [("triton_min_len_cmp", "g4")]
    host_bound = [c for c in raw["cells"] if c["note"].startswith("launch-bound: on both sides the host")]
    assert host_bound, "run 3 has cells where both sides are host-bound"
    assert ci_main(["history", "--results", str(results), "--decision", str(decision),
                 "--out-dir", str(tmp_path / "history")]) == 0
    doc = json.loads(decision.read_text())
    assert not [b for b in doc["branches"].values() if b["changed"]]
    reg = doc["regressions"]
    assert reg["flagged"] == []
    flags = {r["flag"] for r in reg["rows"]}
    assert "host" in flags and "regression" not in flags
    assert len(list(model.iterdir())) == 3  # run 3 recorded beside runs 1 and 2
