"""`ci report`: render a decision file as markdown (report.md, summary.md) plus plots.

report.md doubles as the threshold PR body; summary.md is short enough for
`$GITHUB_STEP_SUMMARY`. A decision rewritten by `ci history` also carries `history` (K, runs used,
store, changes held back) and `regressions` (rows against the history baseline): flagged
regressions lead both files, and the trend PNGs of `ci history` (`--trends DIR`) are copied into
the report folder and embedded. Templates live in the checkout's `templates/` folder (an installed package
carries copies, see nsa.resources) and render under
StrictUndefined: a decision file missing a field fails loudly instead of printing a blank.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from bench import results
from ci import compare, values
from ci.decide import DECISION_SUITE, FAMILIES, SCHEMA
from nsa.resources import templates_dir

TEMPLATES = templates_dir()  # the checkout's templates/, else the copies installed with the package
SUMMARY_LIMIT = 1024 * 1024  # GitHub rejects a step summary above 1 MiB
SUMMARY_FAILURES = 5
METHOD_KEYS = ("timer", "statistic", "warmup_ms", "warmup", "rep_ms", "rep", "interleaved", "l2_flush")
CLASS_SHOWN = ("current", "current_source", "measured", "proposed", "changed", "reason")  # a class row's cells
RUN_SHOWN = ("file", "id", "created_at", "git_sha", "command", "method")


class ReportError(ValueError):
    """A decision or previous-run file the report cannot use."""


def _fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _fmt_num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _fmt_speedup(cell: Mapping[str, Any]) -> str:
    if cell["speedup"] is None:
        return "—"
    return f"{cell['speedup']:.2f}x [{cell['ci_low']:.2f}, {cell['ci_high']:.2f}]"


def _fmt_value(value: Any, nested: bool = False) -> str:
    if value is None:
        return "—"
    if isinstance(value, Mapping):
        text = ", ".join(f"{k}={_fmt_value(v, True)}" for k, v in value.items())
        return f"({text})" if nested else text
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_value(v, True) for v in value) or "none"
    return str(value)


def _fmt_mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:.0f}"


def _md_cell(value: Any) -> str:
    """Text safe inside a markdown table cell (no pipes, no line breaks)."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)  # markdown, not HTML
    env.filters.update(num=_fmt_num, ms=_fmt_ms, speedup=_fmt_speedup, value=_fmt_value, md=_md_cell,
                       threshold=values.text, mib=_fmt_mib)
    return env


def _shape(params: Mapping[str, Any]) -> str:
    dv = f" Dv{params['Dv']}" if "Dv" in params and params["Dv"] != params.get("Dk") else ""
    return (f"B{params.get('B')} Hq{params.get('Hq')}/Hkv{params.get('Hkv')} "
            f"D{params.get('Dk')}{dv} {params.get('dtype')}")


# The grid-point column of each op's table: its header and the params it shows.
GRID_COLUMNS = {"sliding": ("w", ("window",)), "compressed": ("l, d", ("block", "stride")),
                "selected": ("l, d, l', n", ("block", "stride", "sel_block", "sel_count"))}


def _grid(cell: Mapping[str, Any]) -> str:
    _, keys = GRID_COLUMNS.get(cell["op"], ("", ()))
    return ", ".join(str(cell["params"].get(k)) for k in keys)


def branch_suite(branch: Mapping[str, Any]) -> str:
    """The suite whose cells decide `branch` (decision files that predate the triton keys: fa2)."""
    return branch.get("suite", DECISION_SUITE)


def _row(cell: Mapping[str, Any]) -> dict[str, Any]:
    # Decision files from before the classes lack `cls` and `auto_backend`: shown as "—".
    return {**cell, "shape": _shape(cell["params"]), "grid": _grid(cell) if cell["branch"] else "",
            "decides": "yes" if cell["used_for_decision"] else (cell["note"] or "no"),
            "cls": cell.get("cls") or "—", "auto": cell.get("auto_backend") or "—"}


def _branch_rows(decision: Mapping[str, Any], branch: str) -> list[dict[str, Any]]:
    suite = branch_suite(decision["branches"][branch])
    cells = [c for c in decision["cells"] if c["branch"] == branch and c["suite"] == suite]
    cells.sort(key=lambda c: (not c["used_for_decision"], _grid(c), c["T"] or 0, _shape(c["params"]),
                              c["candidate_backend"]))
    return [_row(c) for c in cells]


def _class_rows(branch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per class of a key (empty for decision files from before the classes); classes whose
    rows say the same (a CPU run: every class kept for the one reason) share one row, `g1, g2, ...`."""
    rows: list[dict[str, Any]] = []
    for cls, e in (branch.get("classes") or {}).items():
        if rows and all(rows[-1].get(k) == e.get(k) for k in CLASS_SHOWN):
            rows[-1]["cls"] += f", {cls}"
        else:
            rows.append({**e, "cls": cls})
    return rows


def _reason_rows(decision: Mapping[str, Any]) -> list[dict[str, str]]:
    """The branches' reasons, branches with the same reason named together (`triton_win, triton_cmp`)."""
    rows: dict[str, list[str]] = {}
    for name, b in decision["branches"].items():
        rows.setdefault(b["reason"], []).append(name)
    return [{"names": ", ".join(names), "reason": reason} for reason, names in rows.items()]


def _fmt_dispatch(dispatch: Any) -> str:
    """A run's `dispatch` record in one short line: each key's value as the config writes it (one int
    when every class agrees), and where the values came from once, not per class and key."""
    try:
        found, origins = [], set()
        for key, per_class in dispatch["keys"].items():
            by_class = {c: e["value"] for c, e in per_class.items()}
            same = len(set(by_class.values())) == 1
            found.append(f"{key}={next(iter(by_class.values())) if same else values.text(by_class)}")
            for cls, e in per_class.items():
                origins.add(str(e["source"]).removesuffix(f".{cls}").removesuffix(f".{key}"))
        head = [f"{k}={_fmt_value(v)}" for k, v in dispatch.items() if k != "keys"]
    except (AttributeError, KeyError, TypeError, ValueError):  # a record of another shape: shown whole
        return _fmt_value(dispatch)
    return ", ".join(head + [f"keys from {'; '.join(sorted(origins))}: {', '.join(found)}"])


def _auto_vs_best(decision: Mapping[str, Any]) -> dict[str, Any] | None:
    """The auto-vs-best section: slow rows first (in table order), then every row; None without data."""
    avb = decision.get("auto_vs_best")
    if not avb or not avb["rows"]:
        return None
    slow = set(avb["slow"])
    rows = [{**r, "plans_text": "; ".join(_plan_text(p) for p in r["plans"])} for r in avb["rows"]]
    return {**avb, "rows": rows, "slow_rows": [r for r in rows if r["cell"] in slow],
            "limit_pct": f"{(avb['limit'] - 1) * 100:.0f}%"}


def _plan_text(plan: Mapping[str, Any]) -> str:
    """`sdpa 1.23 ms 512 MiB`, or `flex skipped: <reason>`: one plan of a call, for the details table."""
    if plan["status"] != "ok":
        return f"{plan['plan']} {plan['status']}: {plan['reason']}"
    mem = f" {_fmt_mib(plan['peak_mem_bytes'])} MiB" if plan.get("peak_mem_bytes") is not None else ""
    return f"{plan['plan']} {_fmt_ms(plan['median_ms'])} ms{mem}"


def _length_rows(branch: Mapping[str, Any], cells_by_id: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for length in branch["lengths"]:
        counts: dict[str, int] = {}
        for cid in length["cells"]:
            v = cells_by_id[cid]["verdict"]
            counts[v] = counts.get(v, 0) + 1
        rows.append({**length, "cls": length.get("class", "—"),
                     "counts": ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))})
    return rows


def _machine_rows(machine: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Required fields first, then the rest sorted; a nested record (NVML clocks) one row per field."""
    keys = [k for k in results.MACHINE_FIELDS if k in machine]
    keys += sorted(k for k in machine if k not in results.MACHINE_FIELDS)
    rows = []
    for k in keys:
        if isinstance(machine[k], Mapping):
            rows += [(f"{k}.{sub}", _fmt_value(v)) for sub, v in machine[k].items()]
        else:
            rows.append((k, _fmt_value(machine[k])))
    return rows


def _method_rows(run: Mapping[str, Any]) -> list[tuple[str, str]]:
    method = run.get("method")
    if not isinstance(method, Mapping):
        return []
    keys = [k for k in METHOD_KEYS if k in method] + sorted(k for k in method if k not in METHOD_KEYS)
    return [(k, _fmt_value(method[k])) for k in keys]


def _comparison(decision: Mapping[str, Any], previous: Mapping[str, Any] | None,
                previous_name: str) -> dict[str, Any] | None:
    if previous is None:
        return None
    prev_gpu = previous.get("gpu_name") or previous["machine"]["gpu_name"]
    result = compare.compare(compare.timings(decision), compare.timings(previous), decision["margin"])
    return {**result, "name": previous_name, "gpu_name": prev_gpu,
            "same_gpu": prev_gpu == decision["gpu_name"]}


def _history(decision: Mapping[str, Any]) -> dict[str, Any] | None:
    """The history section (`ci history`'s rewrite), or None for a decision it never saw."""
    info = decision.get("history")
    if not isinstance(info, Mapping):
        return None
    entries = {(e["key"], e["class"]): e for e in decision["decisions"]}
    rows = []
    for ev in info.get("evidence") or []:
        if ev.get("held") is None:  # decide proposed no change for it: nothing to hold
            continue
        e = entries.get((ev["key"], ev["class"]), {})
        rows.append({"key": ev["key"], "cls": ev["class"], "measured": ev.get("measured"),
                     "held": ev["held"], "reason": e.get("reason", ""),
                     "runs": ", ".join(f"{x['run']} ({x['model']}): {_fmt_value(x.get('measured'))}"
                                       for x in ev.get("evidence") or [])})
    used = [(model, ", ".join(ids) or "none") for model, ids in (info.get("runs_used") or {}).items()]
    return {**info, "rows": rows, "runs_used_rows": used}


def _regressions(decision: Mapping[str, Any]) -> dict[str, Any] | None:
    """Regression rows of `ci history` split by flag, worst first; None for a decision without them."""
    reg = decision.get("regressions")
    if not isinstance(reg, Mapping):
        return None
    # Decisions written before host_ms and time_floor_ms lack them: shown as "—".
    rows = [{"host_ms": None, **r} for r in reg.get("rows") or []]
    return {"time_floor_ms": None, **reg, "margin_pct": f"{reg['margin'] * 100:.0f}%", "compared": len(rows),
            "flagged_rows": [r for r in rows if r["flag"] == "regression"],
            "host_rows": [r for r in rows if r["flag"] == "host"],
            "launch_bound_rows": [r for r in rows if r["flag"] == "launch-bound"],
            "drift_rows": [r for r in rows if r["flag"] == "drift"],
            "improved_rows": [r for r in rows if r["flag"] == "improvement"]}


def context(decision: Mapping[str, Any], previous: Mapping[str, Any] | None = None,
            previous_name: str = "", plot_files: Mapping[str, str | None] | None = None,
            trend_files: list[str] | None = None) -> dict[str, Any]:
    """Everything the templates read: the raw decision as `d` plus derived, sorted rows."""
    cells_by_id = {c["id"]: c for c in decision["cells"]}
    branch_cells = {name: _branch_rows(decision, name) for name in decision["branches"]}
    shown = {c["id"] for rows in branch_cells.values() for c in rows}
    failed_cells = [_row(c) for c in decision["cells"] if c["verdict"] == "failed"]
    in_failed_cells = {c[k] for c in failed_cells for k in ("id", "baseline_id")}
    return {
        "d": decision,
        "machine_rows": _machine_rows(decision["machine"]),
        "runs": [{**run, "method_rows": _method_rows(run),
                  "extra_rows": [(k, _fmt_dispatch(v) if k == "dispatch" else _fmt_value(v))
                                 for k, v in run.items() if k not in RUN_SHOWN]}
                 for run in decision["runs"]],
        "failed_cells": failed_cells,
        "other_failures": [f for f in decision["failures"] if f["id"] not in in_failed_cells],
        "branch_cells": branch_cells,
        "length_rows": {n: _length_rows(b, cells_by_id) for n, b in decision["branches"].items()},
        "class_rows": {n: _class_rows(b) for n, b in decision["branches"].items()},
        "reason_rows": _reason_rows(decision),
        "auto_vs_best": _auto_vs_best(decision),
        "other_cells": [_row(c) for c in decision["cells"] if c["id"] not in shown],
        "parity_failed": [p for p in decision["parity"] if not p["passed"]],
        "parity_passed": [p for p in decision["parity"] if p["passed"]],
        "comparison": _comparison(decision, previous, previous_name),
        "plots": {name: (plot_files or {}).get(name) for name in decision["branches"]},
        "grid_header": {name: GRID_COLUMNS.get(b["op"], ("grid", ()))[0] for name, b in decision["branches"].items()},
        "suites": {name: branch_suite(b) for name, b in decision["branches"].items()},
        # Candidate families that could not be measured (FA-2 first; the triton entry is absent
        # from decision files that predate it).
        "not_measured": [{"name": f.name, "label": f.label, "reason": decision[f.name]["reason"]}
                         for f in FAMILIES if f.name in decision and not decision[f.name]["ran"]],
        "summary_failures": SUMMARY_FAILURES,
        "history": _history(decision),
        "regressions": _regressions(decision),
        "trends": list(trend_files or []),
    }


def render_report(decision: Mapping[str, Any], previous: Mapping[str, Any] | None = None,
                  previous_name: str = "", plot_files: Mapping[str, str | None] | None = None,
                  trend_files: list[str] | None = None) -> str:
    """report.md: the full report (also the threshold PR body)."""
    ctx = context(decision, previous, previous_name, plot_files, trend_files)
    return environment().get_template("report.md.j2").render(**ctx)


def render_summary(decision: Mapping[str, Any]) -> str:
    """summary.md: thresholds and headline lines, always under SUMMARY_LIMIT bytes."""
    text = environment().get_template("summary.md.j2").render(**context(decision))
    if len(text.encode()) > SUMMARY_LIMIT:
        cut = text.encode()[:SUMMARY_LIMIT - 200].decode(errors="ignore")
        text = cut + "\n\n(summary truncated at 1 MiB; read report.md)\n"
    return text


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"cannot read {what} {p}: {exc.strerror}; check the path") from None
    except RecursionError:
        raise ReportError(f"{what} {p} must be JSON of sane depth, got nesting too deep to read; pass the file "
                          "the pipeline wrote") from None
    except UnicodeDecodeError as exc:
        raise ReportError(f"{what} {p} must be UTF-8 JSON, got a byte that is not UTF-8 at offset {exc.start}; "
                          "pass the file the pipeline wrote") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{what} {p} must be JSON, got a parse error ({exc}); pass the file the pipeline "
                          "wrote, or regenerate it") from None


def load_decision(path: str | os.PathLike[str]) -> dict[str, Any]:
    doc = _read_json(path, "decision file")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ReportError(f"decision file {path} must have schema {SCHEMA!r}, got {got!r}; "
                          "write it with `python -m ci decide`")
    return doc


def load_previous(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A previous decision file or results file, for the comparison section."""
    doc = _read_json(path, "previous run")
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
        return doc
    if isinstance(doc, dict) and (str(doc.get("schema", "")).startswith("nsa-decision") or "branches" in doc):
        # Not a results file with hundreds of problems: a decision file this version cannot compare with.
        raise ReportError(f"previous run {path} is a decision file of schema {doc.get('schema')!r}, and --previous "
                          f"reads schema {SCHEMA!r} or a results file; pass that run's results.json instead, or "
                          "rerun `python -m ci decide` on it")
    try:
        return results.check(doc, str(path))
    except results.ResultsError as exc:
        raise ReportError(f"previous run {path} must be a results or decision file; {exc}") from None


def trend_pngs(trends_dir: str | os.PathLike[str] | None) -> list[Path]:
    """`trend_*.png` in `trends_dir` (`ci history`'s <out-dir>/trends), sorted; none when it is absent."""
    if trends_dir is None:
        return []
    folder = Path(trends_dir)
    if folder.exists() and not folder.is_dir():
        raise ReportError(f"--trends must be a folder, got the file {str(folder)!r}; pass `ci history`'s "
                          "--out-dir followed by /trends")
    found = sorted(folder.glob("trend_*.png")) if folder.is_dir() else []
    for png in found:  # copied into the report, which is published: a link would publish what it points at
        if png.is_symlink() or not png.is_file() or png.stat().st_nlink > 1:
            what = ("symlink" if png.is_symlink() else "special file or folder" if not png.is_file()
                    else f"hard link (one of {png.stat().st_nlink} names of one file)")
            raise ReportError(f"--trends must hold regular files, got {str(png)!r} as a {what}; delete it and "
                              "rerun `python -m ci history` to draw the charts anew")
    return found


def write_report(decision_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 previous_path: str | os.PathLike[str] | None = None,
                 trends_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write report.md, summary.md and one speedup PNG per threshold key with data; return the paths.

    The trend charts in `trends_dir` (absent or empty: none, a charts-less `ci history` run) are
    copied beside report.md and embedded in its history section.

    The decision is validated by rendering both templates before any plot is drawn. Everything is
    written into a temporary folder beside `out_dir`, which replaces `out_dir` only when every file
    is written: a failed report leaves no plots behind and never mixes with an earlier report.
    """
    decision = load_decision(decision_path)
    previous = load_previous(previous_path) if previous_path else None
    trends = trend_pngs(trends_dir)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out-dir must be a folder, got the file {str(out)!r}; pass another folder")

    def render(plot_names: Mapping[str, str | None] | None) -> tuple[str, str]:
        try:
            return (render_report(decision, previous, str(previous_path or ""), plot_names,
                                  [p.name for p in trends]), render_summary(decision))
        except (KeyError, TypeError, AttributeError, ValueError, jinja2.UndefinedError) as exc:
            raise ReportError(f"decision file {decision_path} lacks a field the report needs, or holds one of "
                              f"the wrong type ({type(exc).__name__}: {exc}); regenerate it with "
                              "`python -m ci decide`") from None

    render(None)
    from ci import atomic, plots  # matplotlib is slow to import; only this entry point draws

    with atomic.staging_dir(out) as stage:
        try:
            drawn = {name: plots.plot_branch([c for c in decision["cells"] if c["suite"] == branch_suite(b)],
                                             name, decision["margin"], stage / f"speedup_{name}.png")
                     for name, b in decision["branches"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"decision file {decision_path} must hold plottable cells, got "
                              f"{type(exc).__name__}: {exc}; regenerate it with `python -m ci decide`") from None
        report, summary = render({name: png.name if png else None for name, png in drawn.items()})
        names = [png.name for png in drawn.values() if png]
        for png in trends:
            shutil.copyfile(png, stage / png.name)
            names.append(png.name)
        for name, text in (("report.md", report), ("summary.md", summary)):
            (stage / name).write_text(text, encoding="utf-8")
            names.append(name)
    return [out / name for name in names]


def append_summary(summary_path: str | os.PathLike[str], target: str | os.PathLike[str]) -> bool:
    """Append summary.md to `target` ($GITHUB_STEP_SUMMARY); False, writing nothing, when `target` is ""."""
    if not str(target):
        return False
    text = Path(summary_path).read_text(encoding="utf-8")
    try:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise ReportError(f"cannot append the summary to {target}: {exc.strerror}; --summary-to must be a "
                          'writable file, e.g. "$GITHUB_STEP_SUMMARY"') from None
    return True
