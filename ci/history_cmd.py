"""`python -m ci history`: keep only lasting threshold changes, record the run, flag regressions.

Runs after `ci decide` and before `ci report` / `ci pr`, on the same results files and decision:

1. reads the GPU model's past runs (and those of every other model of the profile) from the store:
   `--history-dir DIR`, else the folder in NSA_HISTORY_DIR (a local replay of the workflow,
   `make gpu-bench`, sets it), else the `nsa-history` branch when GITHUB_TOKEN (or GH_TOKEN) and
   GITHUB_REPOSITORY are set and this is no dry run, else none (a first run: nothing to compare);
   a bad record (not UTF-8, not a valid record, another model's run, a copy of a run, dated in the
   future) is skipped with one warning line and never blocks the run; this model's bad records
   move to quarantine/<slug>/ when this run is saved (`ci.history`, "sort_out");
2. turns back every proposed change that the last K runs (`decide.history_runs`) of this model and
   the latest runs of the profile's other models did not all measure (`ci.lasting`), in the
   decision's `decisions` and its `branches[...]` alike, and adds `history` (K, runs used, evidence
   per entry, store) and `regressions` (margin, rows worst first, flagged case ids); the decision
   is validated and then replaced atomically, so `ci report` and `ci pr` see lasting changes only;
3. compares every case with its baseline in this model's history (`ci.regress`,
   `decide.regression_margin`, `decide.time_floor_ms`: a slowdown that the host's enqueue time,
   launch-bound times or the dense reference explain is shown, not flagged as a regression) and
   saves this run's record (`decide.history_keep` runs kept per model; a smoke run is not saved;
   a rerun of the same run id replaces its own record);
4. opens, updates or closes the model's tracking issue (`ci.tracking`); without a token or on a
   dry run it writes issue_body.md and issue.json with the planned outcome instead;
5. draws trend PNGs into <out-dir>/trends/ (a chart that fails is only a warning) and writes
   <out-dir>/history.json (what was done).

Outcomes are printed one per line and appended to $GITHUB_OUTPUT (history=, regression_issue=)
once the decision was rewritten. Rerunning on the rewritten decision gives the same result: each
entry keeps decide's own proposal under `lasting.raw`.

Exit codes: 0 ok; 2 bad input (one line with the cause and the fix; nothing is written or
changed; --decision, --out-dir and --history-dir are checked before the first write), or a
file-system fault met later (a full disk: one line with the path and the fix); 4 a regression was flagged (a `host`, `launch-bound` or `drift` row is not one; the
decision, history, issue, trends and history.json are all written first, so the report and the PR
steps still run after it: let them run on this step's `history` output, and fail the job at the
end); 1 GitHub could not be reached or refused.

Environment: NSA_CONFIG (as --config when that is absent; empty: unset), NSA_HISTORY_DIR (as
--history-dir when that is absent; empty: unset), GITHUB_TOKEN or GH_TOKEN, GITHUB_REPOSITORY
(owner/name), GITHUB_API_URL (default https://api.github.com), NSA_PR_DRY_RUN (true: as
--dry-run), GITHUB_SERVER_URL and GITHUB_RUN_ID (link the issue to the run), GITHUB_OUTPUT. The branch needs `contents: write`, the issue
`issues: write`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from bench import results
from ci import decide, history, lasting, regress
from ci.args import InputError, check_out_dir, check_out_file, env_dry_run
from ci.history import HistoryError, HistoryRun
from nsa import keys, settings

__all__ = ["DESCRIPTION", "HELP", "HistoryInputError", "add_arguments", "main"]

EXIT_OK, EXIT_GITHUB, EXIT_INPUT, EXIT_REGRESSION = 0, 1, 2, 4
HISTORY_DIR_ENV = "NSA_HISTORY_DIR"
FUTURE_FIX = ("set the GPU machine's clock (NTP) and rerun the bench: a run dated later would stay the newest in "
              "history and push real runs out")
HELP = "keep only threshold changes that last K runs, save the run's history, flag regressions"
DESCRIPTION = __doc__ or ""
Connect = Callable[[Any], Any]


class HistoryInputError(ValueError):
    """Input that `ci history` cannot use; the message names the cause and the fix."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", nargs="+", required=True, metavar="RESULTS.json",
                   help="the run's results files, as passed to `ci decide` (one GPU model)")
    p.add_argument("--decision", default="out/decision.json",
                   help="decision file of `ci decide` for these results; rewritten in place (default: %(default)s)")
    p.add_argument("--config", default=None,
                   help="config with decide.history_runs, history_keep, regression_margin and time_floor_ms "
                        "(default: $NSA_CONFIG when set, else configs/base.yaml of the checkout, else the copy "
                        "installed with the package)")
    p.add_argument("--history-dir", default=None, metavar="DIR",
                   help="keep history in DIR/history/<gpu>/ instead of the nsa-history branch "
                        f"(default: ${HISTORY_DIR_ENV} when set and not empty)")
    p.add_argument("--out-dir", default="out/history",
                   help="for history.json, trends/*.png and, on a dry run, issue_body.md and issue.json "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="save no history and touch no issue (the decision is still rewritten); "
                        f"without --history-dir or ${HISTORY_DIR_ENV} no history is read either")


# -- inputs ---------------------------------------------------------------------------------------
def _env_dry_run(env: Mapping[str, str]) -> bool:
    return env_dry_run(env, HistoryInputError)


def merge_results(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """One results document from the run's files: the first file's run and machine, all cases.

    Shards and suites of one run share a GPU model; case ids must be unique across files, as
    `ci decide` requires. The record takes the first file's run id, so pass the files in the order
    given to `ci decide`.
    """
    docs = [(str(p), results.load(p)) for p in paths]
    _, first = docs[0]
    names = {n: d["machine"]["gpu_name"] for n, d in docs}
    if len(set(names.values())) > 1:
        raise HistoryInputError(f"results files must come from one GPU model, got {names}; run `ci decide` "
                                "and `ci history` once per model")
    return {**first, "cases": results.unique_cases(docs, HistoryInputError)}


def _smoke(merged: Mapping[str, Any]) -> bool:
    return merged["run"].get("size") == "smoke"


def load_decision(path: str | os.PathLike[str], merged: Mapping[str, Any]) -> dict[str, Any]:
    """The decision file, checked lightly against the schema and against these results."""
    fix = "run `python -m ci decide` on the same --results first"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise HistoryInputError(f"--decision must be a readable file, got {str(path)!r} "
                                f"({exc.strerror or exc}); {fix}") from None
    except ValueError as exc:
        raise HistoryInputError(f"--decision {path} must be JSON, got a parse error ({exc}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("schema") != decide.SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise HistoryInputError(f"--decision {path} must have schema {decide.SCHEMA!r}, got {got!r}; {fix}")
    entries, branches = doc.get("decisions"), doc.get("branches")
    ok_entries = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("class"), str)
        and all(_int(e.get(f)) for f in ("current", "proposed")) and isinstance(e.get("changed"), bool)
        for e in entries)
    ok_branches = isinstance(branches, dict) and all(
        isinstance(b, dict) and isinstance(b.get("key"), str) and isinstance(b.get("classes"), dict)
        for b in branches.values())
    if not ok_entries or not ok_branches:
        raise HistoryInputError(f"--decision {path} must hold `decisions` (key, class, current, proposed, "
                                f"changed) and `branches` with `classes`; got a file without them; {fix}")
    by_key = {(e["key"], e["class"]) for e in entries}
    in_branches = {(b["key"], c) for b in branches.values() for c in b["classes"]}
    if by_key != in_branches:
        raise HistoryInputError(f"--decision {path} must list the same (key, class) entries in decisions and "
                                f"branches, got {sorted(by_key ^ in_branches)[:3]} in one only; {fix}")
    if doc.get("profile") != merged["machine"]["sm"]:
        raise HistoryInputError(f"--decision {path} must be for profile {merged['machine']['sm']} of the "
                                f"results, got {doc.get('profile')!r}; {fix}")
    ran = {r.get("id") for r in doc.get("runs") or [] if isinstance(r, dict)}
    if ran and merged["run"]["id"] not in ran:
        raise HistoryInputError(f"--decision {path} must decide run {merged['run']['id']} of --results, got "
                                f"runs {sorted(map(str, ran))}; {fix}")
    return doc


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- the decision's rewrite -------------------------------------------------------------------------
RAW_FIELDS = ("proposed", "changed", "reason")


def raw_entries(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The decision's entries as `ci decide` wrote them (a rewritten file keeps them under lasting.raw)."""
    out = []
    for e in doc["decisions"]:
        entry = {k: v for k, v in e.items() if k != "lasting"}
        raw = (e.get("lasting") or {}).get("raw")
        if isinstance(raw, dict):
            entry.update({k: raw[k] for k in RAW_FIELDS if k in raw})
        out.append(entry)
    return out


def covers_grid(entry: Mapping[str, Any]) -> bool:
    """Whether this run's cells reached the key's longest decision length in this class."""
    try:
        longest = max(keys.get(str(entry["key"])).nightly_lengths)
    except KeyError:
        return False
    return any(x.get("T") == longest for x in entry.get("lengths") or [])


def record_entries(raw: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Entries worth keeping in history: those whose cells covered the decision grid (a run of another
    suite, or a partial run, says nothing about a key and must not break another run's streak)."""
    fields = ("key", "class", "op", "family", "current", "measured", "proposed", "changed", "reason")
    return [{f: e.get(f) for f in fields} | {"lengths": [{"T": x.get("T"), "verdict": x.get("verdict")}
                                                         for x in e.get("lengths") or []]}
            for e in raw if covers_grid(e)]


def _branch_summary(branch: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A branch entry with proposed / changed / reason recomputed from its classes, as `ci decide` does."""
    changed = [c for c, e in classes.items() if e["changed"]]
    decided = [c for c, e in classes.items() if e.get("lengths")]
    shown = changed or decided
    if shown:
        reason = "; ".join(f"{c}: {classes[c]['reason']}" for c in shown)
    else:
        reason = next(iter(classes.values()))["reason"]
    return {**branch, "proposed": decide.written_value({c: e["proposed"] for c, e in classes.items()}),
            "changed": bool(changed), "reason": reason, "classes": dict(classes)}


def rewrite(doc: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], raw: Sequence[Mapping[str, Any]],
            extra: Mapping[str, Any]) -> dict[str, Any]:
    """The decision with `entries` (lasting's output, in order) in `decisions` and in every branch."""
    by = {}
    for new, old in zip(entries, raw, strict=True):
        info = dict(new["lasting"])
        info.pop("evidence", None)
        info["raw"] = {f: old[f] for f in RAW_FIELDS} if old["changed"] else None
        # Whether this run measured the (key, class) at all: `ci pr` leaves an open PR's change to a
        # (key, class) that the run did not cover as it is (closing needs covering evidence too).
        info["covered"] = covers_grid(old)
        by[(new["key"], new["class"])] = {**{k: v for k, v in new.items() if k != "lasting"}, "lasting": info}
    branches = {name: _branch_summary(b, {c: by[(b["key"], c)] for c in b["classes"]})
                for name, b in doc["branches"].items()}
    return {**doc, "branches": branches, "decisions": [by[(e["key"], e["class"])] for e in entries], **extra}


def validate(doc: Mapping[str, Any]) -> None:
    """Check the rewritten decision before it replaces the old one; a ValueError means a bug here."""
    for e in doc["decisions"]:
        if e["changed"] != (e["proposed"] != e["current"]):
            raise ValueError(f"entry {e['key']}/{e['class']}: changed must say proposed != current, got {e}")
    for name, b in doc["branches"].items():
        classes = b["classes"]
        want = decide.written_value({c: e["proposed"] for c, e in classes.items()})
        if b["proposed"] != want or b["changed"] != any(e["changed"] for e in classes.values()):
            raise ValueError(f"branch {name} must summarise its classes, got proposed {b['proposed']!r}")
    json.dumps(doc, allow_nan=False)


def deciding_cells(doc: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{key: [case ids]}`` for the trend charts: per key and class, the candidate and baseline case of
    the cell used for the decision at the longest length (the one the threshold rule leans on most;
    every length would draw dozens of lines)."""
    longest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for cell in doc.get("cells") or []:
        branch = doc["branches"].get(cell.get("branch") or "")
        if branch and cell.get("used_for_decision") and isinstance(cell.get("T"), int):
            slot = (branch["key"], str(cell.get("cls")))
            if slot not in longest or cell["T"] > longest[slot]["T"]:
                longest[slot] = cell
    out: dict[str, list[str]] = {}
    for (key, _), cell in sorted(longest.items()):
        out.setdefault(key, []).extend([cell["id"], cell["baseline_id"]])
    return {k: sorted(set(v)) for k, v in out.items()}


# -- the run ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    store: str = "none"
    history: str = "not saved"
    history_detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    issue: str = "skipped"
    issue_detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    trends: list[str] = dataclasses.field(default_factory=list)
    decision: str = ""
    trends_error: str = ""
    error: str = ""


def _target(env: Mapping[str, str]) -> Any:
    """The GitHub target when a token and GITHUB_REPOSITORY are set, else None."""
    if not (env.get("GITHUB_TOKEN") or env.get("GH_TOKEN")) or not env.get("GITHUB_REPOSITORY"):
        return None
    from ci.github import target_from_env

    return target_from_env(env)


def _run_url(env: Mapping[str, str]) -> str:
    server, repo, run = env.get("GITHUB_SERVER_URL"), env.get("GITHUB_REPOSITORY"), env.get("GITHUB_RUN_ID")
    return f"{server.rstrip('/')}/{repo}/actions/runs/{run}" if server and repo and run else ""


def _github_output(env: Mapping[str, str], outcome: Outcome) -> None:
    path = env.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"history={outcome.history}\nregression_issue={outcome.issue}\n")


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    from ci import atomic

    atomic.write_text(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def issue_scope(record: HistoryRun, rows: Sequence[regress.Row], past: Sequence[HistoryRun]) -> str:
    """Why this run must leave the tracking issue alone, or "" when it may open, update or close it.

    A run that compared no case (the first runs, a smoke run, new cases only) cannot say anything
    is fixed; nor can one that did not time a case the latest flagged run flagged (a partial run of
    another suite must not close an issue about cases it never ran).
    """
    if not rows:
        return "no case of this run has history on this GPU model yet, so nothing was compared"
    if regress.flagged(rows):
        return ""
    before = [r for r in history.chronological(past) if r.id != record.id]
    if before and before[-1].regressions:
        compared = {r.id for r in rows}
        missing = [c for c in before[-1].regressions if c not in compared]
        if missing:
            return (f"this run did not time {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                    + f", flagged in run {before[-1].id}; the issue stays as it is until a run times them")
    return ""


def main(args: argparse.Namespace, *, env: Mapping[str, str] | None = None, connector: Connect | None = None,
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `ci history` for parsed ``args``; ``connector`` builds the PyGithub client (tests pass one)."""
    from ci.github_call import GitHubError

    env = os.environ if env is None else env
    out, err = out or sys.stdout, err or sys.stderr
    try:
        return _main(args, env, connector, out, err)
    except (HistoryInputError, HistoryError, InputError, results.ResultsError, settings.SettingsError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_INPUT
    except GitHubError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_GITHUB


def _main(args: argparse.Namespace, env: Mapping[str, str], connector: Connect | None, out: TextIO,
          err: TextIO) -> int:
    def log(line: str) -> None:
        print(line, file=err)

    # 1. Inputs: nothing is written until all of them are good.
    cfg = settings.load(settings.config_source(args.config)[0])
    k, keep = int(cfg.decide["history_runs"]), int(cfg.decide["history_keep"])
    margin, confidence = float(cfg.decide["regression_margin"]), float(cfg.decide["confidence"])
    floor = float(cfg.decide["time_floor_ms"])
    merged = merge_results(args.results)
    try:
        history.check_created_at(merged["run"]["created_at"], f"--results {args.results[0]}")
    except HistoryError as exc:
        raise HistoryInputError(f"{exc}; {FUTURE_FIX}") from None
    doc = load_decision(args.decision, merged)
    raw = raw_entries(doc)
    record = history.build_record(merged, record_entries(raw))
    smoke = _smoke(merged)
    dry = bool(args.dry_run) or _env_dry_run(env)
    target = None if dry else _target(env)
    out_dir = Path(args.out_dir)
    history_dir = args.history_dir or env.get(HISTORY_DIR_ENV, "").strip()
    # Every place this run writes, checked before the first write: a bad one must not leave the
    # decision rewritten or the run saved with the rest undone. The store is only read on a dry or
    # smoke run, so it need not be writable then.
    check_out_file(args.decision, "--decision")
    check_out_dir(out_dir, "--out-dir")
    if history_dir:
        check_out_dir(history_dir, "--history-dir" if args.history_dir else HISTORY_DIR_ENV,
                      writable=not (dry or smoke))

    # 2. History: the store, its runs of this profile.
    o = Outcome()
    gh = None
    if history_dir:
        from ci.history_store import LocalHistoryStore

        store: Any = LocalHistoryStore(history_dir, log=log)
        o.store = f"dir:{history_dir}"
    elif target is not None:
        from ci.github import connect
        from ci.history_store import GitHubHistoryStore

        gh = (connector or connect)(target)
        store = GitHubHistoryStore(gh, api_url=target.api_url, repository=target.repository, token=target.token,
                                   log=log)
        o.store = f"branch:{history.BRANCH}"
    else:
        store = None
    profile_runs: dict[str, list[HistoryRun]] = store.load_profile(record.profile) if store else {}
    own = [r for r in profile_runs.get(record.gpu, []) if r.id != record.id]

    # 3. Lasting changes and regressions, into the decision (validated, then replaced atomically).
    decided = lasting.from_history
    past = {m: decided(runs) for m, runs in profile_runs.items()}
    past.setdefault(record.gpu, [])
    current = lasting.RunDecisions(record.id, record.created_at, raw)
    entries = lasting.lasting(current, past, k, model=record.gpu)
    rows = regress.regressions(record, own, k=k, margin=margin, confidence=confidence, time_floor_ms=floor)
    flagged = [r.id for r in regress.flagged(rows)]
    record = dataclasses.replace(record, regressions=flagged)
    runs_used = {m: [r.id for r in history.latest([x for x in runs if x.id != record.id], k)]
                 for m, runs in profile_runs.items() if m != record.gpu}
    runs_used[record.gpu] = [r.id for r in history.latest(own, k - 1)] + [record.id] if k > 1 else [record.id]
    new_doc = rewrite(doc, entries, raw, {
        "history": {"k": k, "model": record.gpu, "run": record.id, "store": o.store, "runs_used": runs_used,
                    "evidence": [{"key": e["key"], "class": e["class"], "measured": e.get("measured"),
                                  "held": e["lasting"]["held"], "evidence": e["lasting"]["evidence"]}
                                 for e in entries]},
        "regressions": {"margin": margin, "k": k, "time_floor_ms": floor, "rows": [r.to_dict() for r in rows],
                        "flagged": flagged},
    })
    validate(new_doc)
    decide.write_decision(new_doc, args.decision)
    held = [f"{e['key']}[{e['class']}]" for e in entries if e["lasting"]["held"]]
    back = [f"{e['key']}[{e['class']}]" for e in entries if e["lasting"]["held"] is False]
    o.decision = (f"{len(held)} change(s) lasted {k} runs, {len(back)} held back; rewrote {args.decision}")

    try:
        # 4. Save this run (not a smoke run, not a dry run).
        if store is None:
            o.history = "not saved"
            o.history_detail = {"reason": "dry run" if dry else f"no --history-dir, no {HISTORY_DIR_ENV} and no "
                                                                 "GitHub token"}
        elif dry:
            o.history, o.history_detail = "not saved", {"reason": "dry run"}
        elif smoke:
            o.history, o.history_detail = "not saved", {"reason": "smoke run (size smoke): its cases decide nothing"}
        else:
            saved = store.save(record, keep)
            o.history = saved.outcome
            o.history_detail = {"path": saved.path, "pruned": saved.pruned, "commit": saved.commit}

        # 5. The tracking issue.
        from ci.tracking import plan_issue, track

        plan = plan_issue(record.machine.get("gpu_name") or record.gpu, record.id, rows, margin=margin, k=k,
                          run_url=_run_url(env))
        scope = issue_scope(record, rows, own)
        planned = "skipped" if scope else ("created or updated" if plan.regressions else "closed if open")
        if target is None:
            why = "dry run" if dry else "no GITHUB_TOKEN or GH_TOKEN with GITHUB_REPOSITORY"
            from ci import atomic

            atomic.write_text(out_dir / "issue_body.md", plan.body)
            o.issue = "dry-run"
            o.issue_detail = {"planned": planned, "reason": why + (f"; {scope}" if scope else ""),
                              "title": plan.title, "regressions": plan.regressions, "comment": plan.comment}
            _write_json(out_dir / "issue.json", {"outcome": o.issue, **o.issue_detail})
        elif scope:
            o.issue, o.issue_detail = "skipped", {"reason": scope}
        else:
            if gh is None:
                from ci.github import connect

                gh = (connector or connect)(target)
            result = track(gh, plan, api_url=target.api_url, repository=target.repository, token=target.token,
                           log=log)
            o.issue, o.issue_detail = result.outcome, {"url": result.url, "number": result.number}

        # 6. Trends over this model's kept runs, this one included (matplotlib loads only here). A chart
        # that cannot be drawn is a warning: the decision, the history and the issue stand without it.
        from ci import trends

        runs = history.chronological([*own, record])[-keep:]
        heads = trends.headlines(record.cases, deciding_cells(new_doc))
        try:
            o.trends = [str(p) for p in trends.write_trends(runs, heads, out_dir / "trends")]
        except (OSError, ValueError, RuntimeError) as exc:
            o.trends_error = f"{type(exc).__name__}: {exc}"
            log(f"warning: trend charts not drawn ({o.trends_error}); the rest of `ci history` is done")
    except BaseException as exc:
        o.error = str(exc) or type(exc).__name__
        raise
    finally:
        _finish(o, args, out_dir, record, flagged, env, out)
    return EXIT_REGRESSION if flagged else EXIT_OK


def _finish(o: Outcome, args: argparse.Namespace, out_dir: Path, record: HistoryRun, flagged: list[str],
            env: Mapping[str, str], out: TextIO) -> None:
    """history.json, one line per outcome and $GITHUB_OUTPUT (once the decision was rewritten)."""
    if o.error:
        o.history = o.history if o.history_detail else "failed"
        o.issue = o.issue if o.issue_detail else "failed"
    _write_json(out_dir / "history.json", {
        "run": record.id, "gpu": record.gpu, "profile": record.profile, "store": o.store,
        "history": {"outcome": o.history, **o.history_detail},
        "regression_issue": {"outcome": o.issue, **o.issue_detail},
        "regressions": flagged, "trends": o.trends, "trends_error": o.trends_error or None, "decision": o.decision, "error": o.error or None})
    print(f"decision: {o.decision}", file=out)
    where = o.history_detail.get("path") or o.history_detail.get("reason", "")
    print(f"history={o.history} ({o.store}{': ' + where if where else ''})", file=out)
    issue_where = o.issue_detail.get("url") or o.issue_detail.get("planned") or o.issue_detail.get("reason", "")
    print(f"regression_issue={o.issue}" + (f" ({issue_where})" if issue_where else ""), file=out)
    print(f"regressions={len(flagged)}" + (f" (worst {flagged[0]})" if flagged else ""), file=out)
    print(f"trends={len(o.trends)} PNG(s) in {out_dir / 'trends'}", file=out)
    _github_output(env, o)


# For `ci/__main__.py`: Subcommand("history", *FIELDS).
FIELDS = (HELP, DESCRIPTION, add_arguments, main)
