"""Regression alerts on replayed histories, and the tracking issue on the fake GitHub."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from github import GithubRetry

from ci import history, regress
from ci.github import Secret, Target, connect
from ci.github_errors import GitHubError
from ci.tracking import LABEL, TITLE_PREFIX, TrackResult, plan_issue, track
from tests.ci import history_fixtures as hx
from tests.ci.fake_github import FakeGitHub

TOKEN = "ghs_FAKE0123456789abcdefTRACKING"
SLOW = "triton/selected/triton/B1-T8192-Hq8-Hkv2-D64-l32-d16-ls64-n16-partbranch-bf16"
GPU = "NVIDIA H100 80GB HBM3"
NSA = ("decode/nsa_decode/triton/B8-T65536-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-branchescmp-dim2560-"
       "graphTrue-nsa_backendtriton-bf16")
# The issue tests replay the triton nightly's cases at T >= 8192 only (18 of 84): the bootstrap per
# case and night is the slow part, and longer kernels are the ones whose regressions matter.
LONG = ("-T8192-", "-T16384-")
DENSE = "decode/dense/sdpa_flash/B8-T65536-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-dim2560-graphTrue-nsa_backendtriton-bf16"


def test_one_case_20_percent_slower_is_the_only_regression() -> None:
    recs = hx.records(hx.H100_TRITON, 4, {3: {SLOW: 1.2}})
    rows = regress.regressions(recs[3], recs[:3], k=3, margin=0.1)
    assert len(rows) == len(recs[3].cases)
    (bad,) = regress.flagged(rows)
    assert bad.id == SLOW and rows[0] is bad  # worst first
    assert bad.ratio == pytest.approx(1.2, rel=2e-3) and bad.low > 1.1
    assert bad.baseline_runs == [r.id for r in recs[:3]] and bad.method == "samples"
    assert all(r.flag == "" for r in rows[1:])
    # A rerun of the same run (already in history) never compares with itself.
    assert regress.flagged(regress.regressions(recs[3], recs, k=3)) == [bad]


def test_a_persisting_regression_stays_flagged_until_accepted() -> None:
    recs = hx.flagged_history(hx.H100_TRITON, 6, {n: {SLOW: 1.2} for n in range(3, 6)}, keep=LONG)
    assert [r.regressions for r in recs][3:] == [[SLOW]] * 3
    rows = regress.regressions(recs[5], recs[:5], accepted={SLOW})  # baseline: nights 2, 3, 4
    assert regress.flagged(rows) == []


def test_a_slowdown_inside_the_margin_is_not_flagged() -> None:
    recs = hx.records(hx.H100_TRITON, 4, {3: {SLOW: 1.05}})
    assert regress.flagged(regress.regressions(recs[3], recs[:3], margin=0.1)) == []


def test_machine_drift_cancels_against_the_dense_case_of_the_same_run() -> None:
    drift = {NSA: 1.3, DENSE: 1.3}
    recs = hx.records(hx.H100_DECODE, 4, {3: drift})
    rows = {r.id: r for r in regress.regressions(recs[3], recs[:3])}
    assert rows[NSA].dense_id == DENSE and rows[NSA].flag == "" and rows[NSA].ratio == pytest.approx(1.0, abs=2e-3)
    assert rows[DENSE].flag == "drift"  # shown, but not our regression
    assert regress.flagged(list(rows.values())) == []
    recs = hx.records(hx.H100_DECODE, 4, {3: {NSA: 1.3}})
    (bad,) = regress.flagged(regress.regressions(recs[3], recs[:3]))
    assert bad.id == NSA and bad.ratio == pytest.approx(1.3, rel=5e-3)


# The whole-NSA `auto` plan at T=1k, the case of the measured H100 replay: two nightlies of one
# commit on one GPU, the second on a slower host (0.89 -> 1.17 ms, every GPU-bound case unchanged).
AUTO_1K = "auto/nsa_prefill/autoplan/B1-T1024-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-planauto-bf16"
AUTO_KEEP = ("autoplan/B1-T1024-Hq64-Hkv4-",)


def auto_nights(now: tuple[float, float | None], base: tuple[float, float | None] = (0.9, 0.6)) -> list:
    """Three baseline nights of AUTO_1K at ``base`` (median ms, host ms) and night 3 at ``now``."""
    return [history.build_record(hx.retimed(hx.H100_AUTO, n, {AUTO_1K: now if n == 3 else base}, keep=AUTO_KEEP))
            for n in range(4)]


def one_row(recs: list, **kwargs: Any) -> regress.Row:
    (row,) = regress.regressions(recs[3], recs[:3], k=3, margin=0.1, **kwargs)
    assert row.id == AUTO_1K
    return row


def test_a_slower_host_is_flagged_host_not_regression() -> None:
    row = one_row(auto_nights((1.17, 1.1)))
    assert row.ratio == pytest.approx(1.3, rel=2e-3) and row.low > 1.1  # slower beyond the margin ...
    assert row.flag == "host" and row.host_ms == 1.1  # ... but the host alone reaches the baseline's 0.9 ms
    assert row.baseline_ms == pytest.approx(0.9, rel=2e-3)
    assert regress.flagged([row]) == [] and regress.flagged([row], "host") == [row]


def test_the_same_slowdown_with_a_fast_host_is_a_regression() -> None:
    row = one_row(auto_nights((1.17, 0.3)))
    assert row.flag == "regression" and row.host_ms == 0.3
    # At the boundary: the host reaching exactly the baseline's median counts as host-bound.
    recs = auto_nights((1.17, 0.0))
    edge = dataclasses.replace(recs[3], cases=[dataclasses.replace(recs[3].cases[0], host_ms=row.baseline_ms)])
    assert one_row([*recs[:3], edge]).flag == "host"


def test_records_without_host_ms_are_judged_as_before() -> None:
    row = one_row(auto_nights((1.17, None), base=(0.9, None)))
    assert row.flag == "regression" and row.host_ms is None
    assert one_row(auto_nights((0.9, None), base=(0.9, None))).flag == ""


def test_a_slowdown_under_the_time_floor_on_both_sides_is_launch_bound() -> None:
    recs = auto_nights((0.08, None), base=(0.05, None))
    row = one_row(recs)
    assert row.ratio == pytest.approx(1.6, rel=2e-3) and row.flag == "launch-bound"
    assert regress.flagged([row]) == []
    assert one_row(recs, time_floor_ms=0.0).flag == "regression"  # the floor is the parameter's
    assert one_row(auto_nights((0.12, None), base=(0.05, None))).flag == "regression"  # now above it
    with pytest.raises(ValueError, match="time_floor_ms must be a number >= 0"):
        regress.regressions(recs[3], recs[:3], time_floor_ms=-1.0)


def test_ratio_of_ratios_matches_plain_ratio_when_dense_is_constant() -> None:
    now, base, dense = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.05, 0.95, 1.02, 0.98], [1.0] * 5
    from ci import stats

    assert regress.ratio_of_ratios(now, dense, base, dense) == stats.ratio_of_medians(now, base)
    with pytest.raises(ValueError, match="now must be non-empty positive times"):
        regress.ratio_of_ratios([], dense, base, dense)


def test_new_cases_and_other_models_are_handled() -> None:
    recs = hx.records(hx.H100_TRITON, 2)
    assert regress.regressions(recs[0], []) == []
    h200 = hx.records(hx.H200_FA2, 1)
    with pytest.raises(ValueError, match="past must hold runs of nvidia-h100-80gb-hbm3 only"):
        regress.regressions(recs[1], h200)


# -- tracking issue ------------------------------------------------------------------------------------
@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub({"README.md": b"# nsa\n"}, token=TOKEN) as server:
        yield server


def tracked(fake: FakeGitHub, night: int, recs: list, log: list[str] | None = None,
            retry: GithubRetry | None = None) -> TrackResult:
    rows = regress.regressions(recs[night], recs[:night], k=3, margin=0.1)
    plan = plan_issue(GPU, recs[night].id, rows, margin=0.1, k=3)
    target = Target(fake.api_url, "octo/nsa", Secret(TOKEN))
    retry = retry or GithubRetry(total=2, backoff_factor=0, max_rate_limit_wait=1)
    gh = connect(target, retry=retry, pace=False, timeout=5)
    sink = log if log is not None else []
    result = track(gh, plan, api_url=target.api_url, repository=target.repository, token=target.token,
                   log=sink.append)
    assert TOKEN not in "".join(sink)
    return result


def test_a_slow_run_opens_the_issue_and_a_recovered_run_closes_it(fake: FakeGitHub) -> None:
    # Nights 0-2 normal, 3 and 4 with SLOW 20% slower, 5 recovered. Night 4 is still flagged: night 3
    # was flagged, so it stays out of SLOW's baseline rather than making the slowdown the new normal.
    recs = hx.flagged_history(hx.H100_TRITON, 6, {3: {SLOW: 1.2}, 4: {SLOW: 1.2}}, keep=LONG)
    assert [r.regressions for r in recs] == [[], [], [], [SLOW], [SLOW], []]
    assert [tracked(fake, n, recs).outcome for n in range(3)] == ["none"] * 3
    assert fake.issues == {}

    opened = tracked(fake, 3, recs)
    (issue,) = fake.open_issues()
    assert opened == TrackResult("created", f"{fake.html_url}/issues/{issue.number}", issue.number)
    assert issue.title == TITLE_PREFIX + GPU and issue.labels == [LABEL]
    assert SLOW in issue.body and "1.20x" in issue.body and recs[3].id in issue.body
    assert issue.comments == []

    assert tracked(fake, 3, recs).outcome == "updated"  # a rerun of the same run adds nothing
    assert issue.comments == [] and len(fake.issues) == 1

    assert tracked(fake, 4, recs).outcome == "updated"
    assert len(issue.comments) == 1 and recs[4].id in issue.comments[0] and recs[4].id in issue.body
    assert tracked(fake, 4, recs).outcome == "updated" and len(issue.comments) == 1

    assert tracked(fake, 5, recs).outcome == "closed"
    assert issue.state == "closed" and "closing" in issue.comments[-1] and len(issue.comments) == 2
    assert tracked(fake, 5, recs).outcome == "none"
    assert len(fake.issues) == 1


def test_a_create_carried_out_before_a_server_error_is_not_duplicated(fake: FakeGitHub) -> None:
    recs = hx.records(hx.H100_TRITON, 4, {3: {SLOW: 1.2}}, keep=LONG)
    # GitHub opens the issue, answers 500, and PyGithub's retry opens a second one.
    fake.fail("POST", r"/issues$", 500, after=True, times=1)
    log: list[str] = []
    assert tracked(fake, 3, recs, log).outcome == "created"
    assert len(fake.open_issues()) == 1 and len(fake.issues) == 2
    dup = max(fake.issues.values(), key=lambda i: i.number)
    assert dup.state == "closed" and "Duplicate of" in dup.comments[-1]


@pytest.mark.parametrize("after", [True, False], ids=["posted-then-502", "lost-to-502"])
def test_a_closing_comment_and_a_502_give_one_comment(fake: FakeGitHub, after: bool) -> None:
    """Issue 34, item 6: GitHub posted the closing comment, answered 502, and the retried POST posted
    it twice. The production retry never repeats a comment POST; the marker is looked for again first."""
    from ci.github import production_retry

    recs = hx.flagged_history(hx.H100_TRITON, 6, {3: {SLOW: 1.2}, 4: {SLOW: 1.2}}, keep=LONG)
    assert tracked(fake, 3, recs).outcome == "created"
    (issue,) = fake.open_issues()
    fake.fail("POST", r"/issues/\d+/comments$", 502, after=after)
    log: list[str] = []
    assert tracked(fake, 5, recs, log, retry=production_retry().new(backoff_factor=0)).outcome == "closed"
    assert issue.state == "closed" and len(issue.comments) == 1 and recs[5].id in issue.comments[0]
    assert any("already there" in line for line in log) == after


def test_errors_are_one_line_with_the_permission_and_no_token(fake: FakeGitHub) -> None:
    recs = hx.records(hx.H100_TRITON, 4, {3: {SLOW: 1.2}}, keep=LONG)
    fake.fail("GET", r"/issues$", 403, message=f"Resource not accessible {TOKEN}")
    with pytest.raises(GitHubError, match="issues: write") as err:
        tracked(fake, 3, recs)
    assert TOKEN not in str(err.value) and "\n" not in str(err.value)
    fake.failures.clear()
    fake.fail("POST", r"/issues$", 500, times=5)  # never carried out: the rerun must open it
    with pytest.raises(GitHubError):
        tracked(fake, 3, recs)
    fake.failures.clear()
    assert tracked(fake, 3, recs).outcome == "created" and len(fake.issues) == 1


def test_the_issue_is_found_by_its_marker_after_its_label_was_deleted(fake: FakeGitHub) -> None:
    """Issue 34, item 7: no second issue beside an unlabelled open one, and recovery closes every one."""
    recs = hx.flagged_history(hx.H100_TRITON, 6, {3: {SLOW: 1.2}, 4: {SLOW: 1.2}}, keep=LONG)
    assert tracked(fake, 3, recs).outcome == "created"
    (issue,) = fake.open_issues()
    del fake.labels[LABEL]  # a person deleted the label: GitHub takes it off every issue
    issue.labels.clear()
    assert tracked(fake, 4, recs).outcome == "updated"
    assert fake.open_issues() == [issue] and recs[4].id in issue.body
    # A second open issue of this model (left by the old label lookup) is closed as a duplicate on recovery too.
    fake.labels[LABEL] = {"color": "d93f0b", "description": ""}  # that run made the label again
    dup = dataclasses.replace(issue, number=issue.number + 1, labels=[LABEL], comments=[])
    fake.issues[dup.number] = dup
    assert tracked(fake, 5, recs).outcome == "closed"
    assert fake.open_issues() == [] and all(i.state == "closed" for i in fake.issues.values())
    # Another model's issue (its own marker) is never touched.
    other = plan_issue("NVIDIA H200", recs[3].id, [], margin=0.1, k=3)
    assert other.model_marker != plan_issue(GPU, recs[3].id, [], margin=0.1, k=3).model_marker


def test_a_locked_issue_is_named_as_the_cause(fake: FakeGitHub) -> None:
    recs = hx.flagged_history(hx.H100_TRITON, 5, {3: {SLOW: 1.2}, 4: {SLOW: 1.2}}, keep=LONG)
    assert tracked(fake, 3, recs).outcome == "created"
    fake.fail("POST", r"/issues/\d+/comments$", 403, message="Unable to create comment because issue is locked.")
    with pytest.raises(GitHubError) as err:
        tracked(fake, 4, recs)
    text = str(err.value)
    assert "\n" not in text and "issues: write" not in text and TOKEN not in text
    assert "(Unable to create comment because issue is locked.): the conversation is locked" in text
    assert "unlock it" in text


@pytest.mark.parametrize("name", ["NVIDIA H100\n# Title **bold** [link](http://x) <b>`x`</b>",
                                  "NVIDIA\u2028H100\r\x00 |a|"])
def test_a_gpu_name_with_a_newline_or_markdown_is_made_inert(name: str) -> None:
    plan = plan_issue(name, "run-1", [], margin=0.1, k=3)
    for text in (plan.title, plan.gpu_name):
        assert not any(ch in text for ch in "\n\r\x00\u2028") and "  " not in text
        assert all(f"\\{ch}" in text for ch in "#*[]<>`|" if ch in name)
    assert plan.title.startswith(TITLE_PREFIX + "NVIDIA")
    assert f"**{plan.gpu_name}**" in plan.body and name not in plan.body
    assert plan.model_marker == f"<!-- nsa-regression: {history.gpu_slug(name)} -->"
    from ci.pr_plan import build_plan
    from tests.ci.test_github import decision

    pr = build_plan({**decision(), "gpu_name": name}, "", ())
    assert pr.title.startswith(f"NSA thresholds for {plan.gpu_name} (sm90): ")
    assert "\n" not in pr.title and pr.commit_message.splitlines()[0] == pr.title


def test_a_case_timed_at_0_ms_is_compared_with_nothing_instead_of_failing_the_bootstrap() -> None:
    """The results schema lets a timer round a tiny call down to 0 ms; ci.stats refuses such samples,
    so a zero anywhere (this run, a baseline run, a dense reference) once raised a traceback."""
    recs = hx.records(hx.H100_DECODE, 4)
    zero = [dataclasses.replace(c, samples_ms=[0.0, *c.samples_ms[1:]]) if c.id in (NSA, DENSE) else c
            for c in recs[3].cases]
    rows = regress.regressions(dataclasses.replace(recs[3], cases=zero), recs[:3])
    assert NSA not in {r.id for r in rows} and DENSE not in {r.id for r in rows} and rows
    base = [dataclasses.replace(r, cases=[dataclasses.replace(c, samples_ms=[0.0, *c.samples_ms[1:]])
                                          if c.id == DENSE else c for c in r.cases]) for r in recs[:3]]
    (row,) = [r for r in regress.regressions(recs[3], base) if r.id == NSA]
    assert row.dense_id is None  # the ratio falls back to the case alone
