"""`python -m bench readme-table`: the README's results table is the generator's output for the file it names."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from bench import readme_table
from bench.cli import main as bench_main
from nsa_contract import results

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_the_generators_output_for_the_file_it_names():
    """Edit the table by hand, or commit a newer results file without regenerating, and this fails:
    `python -m bench readme-table --readme README.md` rewrites it."""
    readme = ROOT / "README.md"
    source, body, _, _ = readme_table.block(readme.read_text(encoding="utf-8"))
    assert (ROOT / source).is_file(), f"the README's table names {source}, which the tree does not hold"
    assert body == readme_table.table(results.load(ROOT / source), source)
    assert readme_table.render(readme, ROOT) == readme.read_text(encoding="utf-8")


def _fast_doc() -> dict:
    """The committed fast-suite file the README uses, cut to two cells (64/4 at 8k, 16/16 at 16k)."""
    source, _, _, _ = readme_table.block((ROOT / "README.md").read_text(encoding="utf-8"))
    doc = copy.deepcopy(results.load(ROOT / source))
    keep = ("B1-T8192-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-kvseparate-",
            "B1-T16384-Hq16-Hkv16-D128-w512-l32-d16-ls64-n16-kvseparate-")
    doc["cases"] = [c for c in doc["cases"] if c["id"].split("/")[-1].startswith(keep)
                    and "partsel" not in c["id"]]
    return doc


def test_rows_take_the_all_triton_forward_and_the_dense_cases_of_its_own_cell():
    doc = _fast_doc()
    rows = readme_table.rows(doc)
    assert [(r["layout"], r["T"]) for r in rows] == [("64/4, D 128", 8192), ("16/16, D 128", 16384)]
    by_id = {c["id"]: c["timing"]["median_ms"] for c in doc["cases"] if c["status"] == "ok"}
    nsa = next(v for k, v in by_id.items() if "T8192" in k and k.endswith("wintriton-bf16"))
    fa3 = next(v for k, v in by_id.items() if "T8192" in k and k.startswith("fast/dense/fa3/"))
    assert rows[0]["nsa"] == nsa and rows[0]["fa3"] == fa3
    assert f"| 64/4, D 128 | 8k | {nsa:.2f} | {fa3:.2f} |" in readme_table.table(doc, "x.json")


def test_a_skipped_baseline_shows_a_dash_and_no_ratio():
    doc = _fast_doc()
    for case in doc["cases"]:
        if case["backend"] == "fa3":
            case.update(status="skipped", reason="fa3-fwd not installed", timing=None)
    line = readme_table.table(doc, "x.json").splitlines()[4]
    assert line.startswith("| 64/4, D 128 | 8k |") and line.endswith("| - | 1.73 | - |")


def test_a_file_without_fast_cells_and_a_readme_without_markers_are_refused(tmp_path):
    doc = _fast_doc()
    doc["cases"] = [c for c in doc["cases"] if c["op"] == "dense"]
    with pytest.raises(readme_table.TableError, match="--suites fast"):
        readme_table.rows(doc)
    with pytest.raises(readme_table.TableError, match="results-table"):
        readme_table.block("# a README without the table\n")


def test_cli_rewrites_only_the_block_and_names_the_new_file(tmp_path, capsys):
    doc = _fast_doc()
    results.dump(doc, tmp_path / "fast.json")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- results-table: gone.json -->\nstale\n<!-- /results-table -->\nafter\n")
    assert bench_main(["readme-table", str(tmp_path / "fast.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- results-table: fast.json -->\n") and text.endswith(
        "<!-- /results-table -->\nafter\n")
    assert "stale" not in text and "| 16/16, D 128 | 16k |" in text
    assert bench_main(["readme-table", "--readme", str(readme)]) == 0 and readme.read_text() == text
    assert bench_main(["readme-table", str(tmp_path / "missing.json")]) == 2
    assert "cannot read results file" in capsys.readouterr().err
