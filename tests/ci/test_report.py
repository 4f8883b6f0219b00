"""ci.report, ci.plots, ci.compare: golden report, strict templates, plots, comparison.

Regenerate the golden files after an intended change of the report with
`UPDATE_GOLDEN=1 python -m pytest tests/ci/test_report.py`, then read the diff before committing.
"""

from __future__ import annotations

import copy
import json
import lzma
import os
from pathlib import Path
from typing import Any

import jinja2
import pytest

from ci import compare, decide, report
from ci.__main__ import main
from nsa_contract import keys, results
from tests.ci import fixtures as fx

GOLDEN = Path(__file__).parent / "golden"
BRANCHES = tuple(k.decision_id for k in keys.KEYS)  # the report's branch sections, in declaration order


def section(text: str, heading: str) -> str:
    """From `heading` to the next `## ` heading (or the end)."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end + 1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def golden_decision() -> dict[str, Any]:
    conf = decide.DecideConfig.from_mapping(fx.config(cmp=2048))
    return decide.decide([("results.json", fx.golden_document())], conf)


def previous_results() -> dict[str, Any]:
    """The golden run's previous run: one case 1.5x faster then (a regression now), one slower."""
    doc = copy.deepcopy(fx.golden_document())
    for case in doc["cases"]:
        if case["id"] == "fa2/sliding/flash_attn/B1-T8192-Hq8-Hkv2-D64-w512-bf16":
            case["timing"] = fx.results.timing_summary(s / 1.5 for s in case["timing"]["samples_ms"])
        if case["id"] == "fa2/sliding/sdpa/B1-T256-Hq8-Hkv2-D64-w512-bf16":
            case["timing"] = fx.results.timing_summary(s * 2 for s in case["timing"]["samples_ms"])
    return doc


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"{name} differs from its golden file; see this module's docstring to regenerate"


def test_report_matches_golden() -> None:
    text = report.render_report(golden_decision(), previous_results(), "previous.json",
                                {name: f"speedup_{name}.png" for name in BRANCHES})
    check_golden("report.md", text)


def test_summary_matches_golden_and_is_small() -> None:
    text = report.render_summary(golden_decision())
    check_golden("summary.md", text)
    assert len(text.encode()) < 4096


def test_report_leads_with_failures_and_holds_every_section() -> None:
    text = report.render_report(golden_decision())
    order = ["## Failed cells", "## Auto against the best plan", "## Device and versions", "## Method",
             "## Noise floor", *(f"## Branch {name}" for name in BRANCHES), "## Parity", "## Skipped cases"]
    positions = [text.index(h) for h in order]
    assert positions == sorted(positions)
    assert "parity failed" in text[positions[0]:positions[1]]
    assert "| nvml.sm_clock_mhz | 1980 |" in text and "| nvml.temperature_c | 41 |" in text
    assert "| warmup_ms | 25 |" in text and "- dispatch: fa2_min_len_win=(value=-1, source=profiles.sm90)" in text
    assert "| 2048 | g4 | 512 | B1 Hq8/Hkv2 D64 bf16 | flash_attn |" in text
    assert "torch_fa2 needs torch >= 2.6" in text
    assert "## Comparison" not in text and "No FA-2 threshold can be proposed" not in text


def test_missing_method_renders_gracefully() -> None:
    decision = golden_decision()
    for run in decision["runs"]:
        del run["method"]
    assert "(timing method not recorded in this results file)" in report.render_report(decision)


def test_strict_undefined_fails_on_a_missing_field() -> None:
    decision = golden_decision()
    del decision["gpu_name"]
    with pytest.raises(jinja2.UndefinedError, match="gpu_name"):
        report.render_report(decision)
    decision = golden_decision()
    del decision["branches"]["win"]["current_source"]
    with pytest.raises(jinja2.UndefinedError, match="current_source"):
        report.render_report(decision)


def test_cpu_run_says_fa2_was_unavailable() -> None:
    conf = decide.DecideConfig.from_mapping(fx.config())
    decision = decide.decide([("cpu.json", fx.document(fx.sweep("sliding", {1024: 2.0}), sm="cpu"))], conf)
    for text in (report.render_report(decision), report.render_summary(decision)):
        assert "No FA-2 threshold can be proposed" in text and "these results come from a CPU machine" in text
        assert "sm = cpu" in text


def test_comparison_flags_only_when_median_and_p20_both_moved() -> None:
    old = {"a": (1.0, 0.9), "b": (1.0, 0.9), "c": (1.0, 0.9), "gone": (1.0, 1.0)}
    new = {"a": (1.3, 1.2), "b": (1.3, 0.95), "c": (0.7, 0.6), "fresh": (1.0, 1.0)}
    result = compare.compare(new, old, margin=1.2)
    assert [r["id"] for r in result["regressions"]] == ["a"]  # b: the p20 barely moved
    assert [r["id"] for r in result["improvements"]] == ["c"]
    assert (result["matched"], result["only_new"], result["only_old"]) == (3, 1, 1)


def test_comparison_reads_results_and_decision_files_alike() -> None:
    decision = golden_decision()
    from_decision, from_results = compare.timings(decision), compare.timings(fx.golden_document())
    assert from_decision == from_results and len(from_decision) > 10
    text = report.render_report(decision, previous_results(), "previous.json")
    assert "fa2/sliding/flash_attn/B1-T8192-Hq8-Hkv2-D64-w512-bf16` |" in text and "**regression**" in text


def test_write_report_writes_markdown_and_plots(tmp_path: Path) -> None:
    decision_path = decide.write_decision(golden_decision(), tmp_path / "decision.json")
    prev = tmp_path / "old.json"
    prev.write_text(json.dumps(previous_results()), encoding="utf-8")
    written = report.write_report(decision_path, tmp_path / "report", prev)
    names = sorted(p.name for p in written)
    # Every key with timed cells in its suite gets a plot (the golden document has no triton_win cell).
    assert names == ["report.md", "speedup_cmp.png", "speedup_triton_cmp.png", "speedup_triton_sel.png",
                     "speedup_win.png", "summary.md"]
    for png in ("speedup_win.png", "speedup_cmp.png", "speedup_triton_sel.png", "speedup_triton_cmp.png"):
        data = (tmp_path / "report" / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    text = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert "![speedup against T, branch win](speedup_win.png)" in text
    assert "## Comparison with the previous run" in text


def test_triton_tables_hold_only_suite_triton_cells_with_their_grid() -> None:
    text = report.render_report(golden_decision())
    sel = section(text, "## Branch triton_sel")
    assert "| T | class | l, d, l', n | shape | candidate |" in sel
    assert "| 4096 | g4 | 32, 16, 64, 16 | B1 Hq8/Hkv2 D64 bf16 | triton |" in sel and "| adopt | yes |" in sel
    assert "l'=64, n=8 is not nsa.sel_block/sel_count 64/16" in sel
    assert "flash_attn" not in sel
    cmp = section(text, "## Branch triton_cmp")
    assert "| 8192 | g4 | 32, 16 | B1 Hq8/Hkv2 D64 bf16 | triton |" in cmp and "flash_attn" not in cmp
    head = text[:text.index("## Failed cells")]
    assert ("| triton_sel | `triton_min_len_sel` | -1 (`profiles.sm90.triton_min_len_sel (per class: see classes)`) | "
            "{g1: -1, g2: -1, g4: 4096, g8: -1, g16: -1} | **changed** |") in head
    assert "Triton cleared 1.2x only at 1024, not at the longest tested length 16384" in head
    assert "No Triton threshold can be proposed" not in head


def test_fa2_only_run_says_the_triton_kernels_were_not_measured() -> None:
    conf = decide.DecideConfig.from_mapping(fx.config())
    decision = decide.decide([("r.json", fx.document(fx.sweep("sliding", {1024: 2.0})))], conf)
    for text in (report.render_report(decision), report.render_summary(decision)):
        assert "No Triton threshold can be proposed" in text and "python -m bench run --suites triton" in text
        assert "No FA-2 threshold can be proposed" not in text
    assert "No selected cells in suite `triton`." in report.render_report(decision)


def test_no_plot_for_a_branch_without_timed_cells(tmp_path: Path) -> None:
    conf = decide.DecideConfig.from_mapping(fx.config())
    decision = decide.decide([("r.json", fx.document(fx.sweep("sliding", {1024: 2.0})))], conf)
    path = decide.write_decision(decision, tmp_path / "d.json")
    names = sorted(p.name for p in report.write_report(path, tmp_path / "out"))
    assert names == ["report.md", "speedup_win.png", "summary.md"]
    assert "branch cmp](" not in (tmp_path / "out" / "report.md").read_text(encoding="utf-8")


def test_bad_decision_files_are_explained(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "something/else"}), encoding="utf-8")
    with pytest.raises(report.ReportError, match="schema must be 'nsa-decision/2', got 'something/else'"):
        report.load_decision(wrong)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**golden_decision(), "branches": {}}), encoding="utf-8")
    with pytest.raises(report.ReportError, match=r"decision\.branches must be a non-empty mapping, got \{\}"):
        report.write_report(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    lacking = tmp_path / "lacking.json"  # valid as a decision, but without a section the report shows
    doc = golden_decision()
    del doc["noise_floor"]
    lacking.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(report.ReportError, match="lacks a field the report needs"):
        report.write_report(lacking, tmp_path / "out")


def _with_history(decision: dict[str, Any]) -> dict[str, Any]:
    """The golden decision as `ci history` leaves it: one flagged regression, one change held back."""
    row = {"id": "fa2/sliding/fa2/B1-T8192-Hq8-Hkv2-D64-w512-bf16", "suite": "fa2", "op": "sliding",
           "backend": "flash_attn", "now_ms": 1.5, "baseline_ms": 1.0, "ratio": 1.5, "low": 1.3, "high": 1.7,
           "flag": "regression", "method": "samples", "dense_id": None, "baseline_runs": ["r1", "r2", "r3"]}
    e = decision["decisions"][0]
    return {**decision,
            "history": {"k": 3, "model": "nvidia-h100-80gb-hbm3", "run": "run-0001", "store": "dir:out/history-store",
                        "runs_used": {"nvidia-h100-80gb-hbm3": ["run-0001"]},
                        "evidence": [{"key": e["key"], "class": e["class"], "measured": 2048, "held": False,
                                      "evidence": [{"model": "nvidia-h100-80gb-hbm3", "run": "run-0001",
                                                    "measured": 2048}]}]},
            "regressions": {"margin": 0.1, "k": 3, "rows": [row], "flagged": [row["id"]]}}


def test_history_regressions_lead_and_trends_are_embedded(tmp_path: Path) -> None:
    decision = _with_history(golden_decision())
    text = report.render_report(decision, trend_files=["trend_prefill_T16384.png"])
    assert text.index("## Regressions") < text.index("## Failed cells") < text.index("## History and trends")
    assert "| `fa2/sliding/fa2/B1-T8192-Hq8-Hkv2-D64-w512-bf16` | 1.5 | 1 | 1.50x [1.30, 1.70] |" in text
    assert "Store: `dir:out/history-store`" in text and "![trend_prefill_T16384.png](trend_prefill_T16384.png)" in text
    summary = report.render_summary(decision)
    assert summary.index("**1 regression(s)**") < summary.index("| branch |")
    assert "1 change(s) held back, 1 case(s) compared" in summary
    # write_report copies the trend charts beside report.md; an absent folder is no charts.
    path = decide.write_decision(decision, tmp_path / "decision.json")
    trends = tmp_path / "history" / "trends"
    trends.mkdir(parents=True)
    (trends / "trend_decode_T65536.png").write_bytes(b"\x89PNG fake")
    written = report.write_report(path, tmp_path / "report", trends_dir=trends)
    assert (tmp_path / "report" / "trend_decode_T65536.png").read_bytes() == b"\x89PNG fake"
    assert "trend_decode_T65536.png" in {p.name for p in written}
    report.write_report(path, tmp_path / "report2", trends_dir=tmp_path / "none")
    assert "No trend charts" in (tmp_path / "report2" / "report.md").read_text()


def _dispatch(profile: str, per_class: dict[str, dict[str, int]], source: str) -> dict[str, Any]:
    """A results file's `run.dispatch` record, as `bench` writes it: every key, every class, its source."""
    return {"profile": profile, "config": "base.yaml", "force_fa2": False,
            "keys": {key: {cls: {"value": v, "source": source.format(key=key, cls=cls)} for cls, v in values.items()}
                     for key, values in per_class.items()}}


def test_a_cpu_report_leads_with_its_message_and_says_it_once_per_place() -> None:
    """Issue 34, item 11: a CPU run's "no threshold can be proposed" stood under 25 class rows that
    repeated it and a 2,000-character dispatch line. The message leads; classes that say the same share
    one row, branches with the same reason one bullet, and the dispatch line shows each key once."""
    conf = decide.DecideConfig.from_mapping(fx.config())
    decision = decide.decide([("cpu.json", fx.document(fx.sweep("sliding", {1024: 2.0}), sm="cpu"))], conf)
    decision["runs"][0]["dispatch"] = _dispatch("cpu", {k.name: dict.fromkeys(keys.CLASSES, -1) for k in keys.KEYS},
                                                "base.yaml:runtime.{key}")
    text = report.render_report(decision)
    body = [line for line in text.splitlines() if line.strip()]
    assert body[1].startswith("**No ") and "threshold can be proposed from this run:** these results come from a CPU" \
        in body[1]
    # two headlines, at most one bullet per family and class prefix, one class row per branch (was 32)
    assert text.count("these results come from a CPU machine") <= 2 + 3 + len(BRANCHES)
    all_classes = ", ".join(keys.CLASSES)
    for name in BRANCHES:
        assert f"| {all_classes} | -1 (" in section(text, f"## Branch {name} ")
    assert "- **triton_win, triton_cmp, triton_sel**: keeping -1: these results come from a CPU" in text
    (dispatch,) = [line for line in text.splitlines() if line.startswith("- dispatch: ")]
    assert dispatch == ("- dispatch: profile=cpu, config=base.yaml, force_fa2=False, keys from base.yaml:runtime: "
                        + ", ".join(f"{k.name}=-1" for k in keys.KEYS))
    assert max(len(line) for line in text.splitlines()) < 400
    summary = report.render_summary(decision)
    assert summary.count("these results come from a CPU machine") <= 2 + 3  # was 7


def test_the_dispatch_line_keeps_classes_that_differ() -> None:
    record = _dispatch("sm90", {"fa2_min_len_win": {"g1": 256, "g2": 256}, "triton_min_len_cmp": {"g1": 512, "g2": 8192}},
                       "base.yaml:profiles.sm90.{key}.{cls}")
    assert report._fmt_dispatch(record) == ("profile=sm90, config=base.yaml, force_fa2=False, keys from "
                                            "base.yaml:profiles.sm90: fa2_min_len_win=256, "
                                            "triton_min_len_cmp={g1: 512, g2: 8192}")
    assert report._fmt_dispatch({"keys": "odd"}) == "keys=odd"  # another shape: shown whole


def test_plots_are_titled_by_what_they_show(tmp_path: Path) -> None:
    """Issue 34, item 11: a CPU run's plots were titled "FA-2" but drew flex (reported only)."""
    from PIL import Image

    from ci import plots

    conf = decide.DecideConfig.from_mapping(fx.config())
    cpu = decide.decide([("cpu.json", fx.document(fx.sweep("sliding", {1024: 2.0}), sm="cpu"))], conf)
    flex = [{**c, "candidate_backend": "flex", "used_for_decision": False, "speedup": 0.5, "ci_low": 0.4,
             "ci_high": 0.6, "T": c["T"] or 1024} for c in cpu["cells"] if c["branch"] == "win"]
    assert flex
    png = plots.plot_branch(flex, "win", 1.2, tmp_path / "speedup_win.png")
    title = Image.open(png).text["Title"]
    assert title == "sliding branch (win): flex over masked SDPA, reported only (no FA-2 cell was timed)"
    assert plots.plot_title("win", ["torch_fa2", "flex"]) == "sliding branch (win): flex, torch_fa2 over masked SDPA"
    assert plots.plot_title("triton_cmp", ["triton"]) == "compressed branch (triton_cmp): triton over masked SDPA"


def test_a_change_held_back_says_held_back() -> None:
    """Issue 34, item 11: the one change the K-run rule held back showed "held: **no**"."""
    decision = _with_history(golden_decision())
    rows = section(report.render_report(decision), "## History and trends")
    assert "| K-run rule |" in rows and "| held |" not in rows
    (row,) = [line for line in rows.splitlines() if line.startswith("| `") and "run-0001" in line]
    assert "| **held back** |" in row and "**no**" not in row
    decision["history"]["evidence"][0]["held"] = True
    rows = section(report.render_report(decision), "## History and trends")
    assert "| lasted 3 runs: changed |" in rows


def test_previous_given_an_old_decision_file_names_it(tmp_path: Path) -> None:
    """Issue 34, item 11: `--previous old-decision.json` said "results file with 644 schema problems"."""
    old = golden_decision()
    old["schema"] = "nsa-decision/1"
    path = tmp_path / "old-decision.json"
    path.write_text(json.dumps(old), encoding="utf-8")
    with pytest.raises(report.ReportError) as err:
        report.load_previous(path)
    text = str(err.value)
    assert "\n" not in text and "schema problems" not in text
    assert "is a decision file of schema 'nsa-decision/1'" in text and "results.json" in text
    from ci.__main__ import main

    rc = main(["report", "--decision", str(decide.write_decision(golden_decision(), tmp_path / "d.json")),
               "--previous", str(path), "--out-dir", str(tmp_path / "out")])
    assert rc == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_linked_trend_chart_is_not_copied_into_the_report(tmp_path: Path, link: str) -> None:
    """Issue 34, item 6: the report copies the trend PNGs beside report.md, which `ci pr` publishes; a
    link there would turn whatever it points at into a regular file the publisher accepts."""
    path = decide.write_decision(golden_decision(), tmp_path / "decision.json")
    trends = tmp_path / "trends"
    trends.mkdir()
    secret = tmp_path / "environ"
    secret.write_bytes(b"GITHUB_TOKEN=ghs_secret\0")
    png = trends / "trend_prefill_T16384.png"
    png.symlink_to(secret) if link == "symlink" else os.link(secret, png)
    with pytest.raises(report.ReportError) as err:
        report.write_report(path, tmp_path / "report", trends_dir=trends)
    assert "trend_prefill_T16384.png" in str(err.value) and link in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "report").exists()


def test_committed_reports_say_which_changes_were_held_back() -> None:
    """Issue 34, item 11: a replayed H100 report said "held: **no**" on the change that was held back.
    The committed reports with a history section are rendered by today's template (results/README.md
    names the command), which says "held back" or "lasted K runs: changed"."""
    def text_of(path: Path) -> str:  # big reports are stored xz-compressed (results/README.md)
        data = path.read_bytes()
        return (lzma.decompress(data) if path.suffix == ".xz" else data).decode("utf-8")

    committed = [p for name in ("report.md", "report.md.xz") for p in (GOLDEN.parents[2] / "results").rglob(name)]
    reports = {path: text_of(path) for path in committed}
    reports = {path: text for path, text in reports.items() if "K-run rule:" in text}
    assert len(reports) >= 5
    for path, text in reports.items():
        assert "| key | class | measured | held |" not in text and "| **no** |" not in text, path
        assert "| key | class | measured | K-run rule |" in text, path


# --- the staging folder: validated before drawing, nothing left on failure, replaced whole --------

def _decision_file(tmp_path: Path, pristine_config: Path) -> Path:
    res = results.dump(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)), tmp_path / "r.json")
    out = tmp_path / "decision.json"
    assert main(["decide", "--results", str(res), "--config", str(pristine_config), "--out", str(out)]) == 0
    return out


def test_report_validates_before_it_draws_and_leaves_nothing_on_failure(tmp_path: Path, pristine_config: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    doc = json.loads(decision_path.read_text())
    del doc["runs"]  # the templates need it; plots do not
    decision_path.write_text(json.dumps(doc), encoding="utf-8")
    drawn: list[Any] = []
    from ci import plots

    monkeypatch.setattr(plots, "plot_branch", lambda *a, **k: drawn.append(a))
    with pytest.raises(report.ReportError, match="lacks a field the report needs"):
        report.write_report(decision_path, tmp_path / "report")
    assert drawn == [] and not (tmp_path / "report").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


def test_a_failed_report_over_an_existing_folder_keeps_the_old_report_whole(tmp_path: Path, pristine_config: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    out = tmp_path / "report"
    report.write_report(decision_path, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from ci import plots

    def broken(cells: Any, branch: str, margin: float, path: Path) -> Path:
        path.write_bytes(b"half a png")
        raise ValueError("matplotlib failed half-way")

    monkeypatch.setattr(plots, "plot_branch", broken)
    with pytest.raises(report.ReportError):
        report.write_report(decision_path, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "decision.json", "r.json", "report"]


def test_a_report_with_fewer_plots_replaces_the_folder(tmp_path: Path, pristine_config: Path) -> None:
    decision_path = _decision_file(tmp_path, pristine_config)
    out = tmp_path / "report"
    out.mkdir()
    (out / "speedup_old.png").write_bytes(b"an earlier run's plot")
    written = report.write_report(decision_path, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    assert not (out / "speedup_old.png").exists()
