"""Numbers and citations in docs/ that drifted from the repository (issue 34, item 13)."""

from __future__ import annotations

import json
import lzma
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_doc_states_the_size_of_the_committed_history_records():
    """docs/pipeline.md said ~150 KB per nightly record; the committed records are 311-331 KiB.
    The stated byte range and case range must cover every committed record."""
    # The four records of tests/data/h100/nightly/history-store, stored xz-compressed.
    records = [lzma.decompress(p.read_bytes()) for p in sorted(ROOT.glob("tests/data/*/nightly/history-store/history/*/*.json.xz"))]
    assert len(records) == 4, "the committed store holds the records of four nightlies"
    sizes = [len(r) for r in records]
    cases = [len(json.loads(r)["cases"]) for r in records]
    text = " ".join((ROOT / "docs" / "pipeline.md").read_text().split())
    assert "~150 KB per nightly" not in text
    m = re.search(r"([\d,]+)-([\d,]+) bytes each", text)
    assert m, "docs/pipeline.md must state the measured record size range"
    lo, hi = (int(g.replace(",", "")) for g in m.groups())
    assert lo <= min(sizes) and max(sizes) <= hi, (sizes, lo, hi)
    m = re.search(r"(\d+)-(\d+) cases", text)
    assert m and int(m[1]) <= min(cases) and max(cases) <= int(m[2]), cases
    per_nightly = int(re.search(r"~(\d+) KB per nightly", text)[1]) * 1000
    assert 0.9 * min(sizes) <= per_nightly <= 1.1 * max(sizes)


PERFORMANCE_DOCS = ("docs/performance.md", "docs/notes/*.md")


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def _stored(name: str) -> tuple[str, ...]:
    """The names a cited file may be stored under: results/README.md's rule compresses results files
    and decisions as `.xz` and stores lab archives (once `.json.gz`) as trimmed plain `.json`; the
    notebook keeps the names the files had when it was written."""
    plain = name.removesuffix(".gz").removesuffix(".xz")
    return (name, plain, plain + ".xz")


def test_performance_docs_cite_only_files_of_the_repository():
    """The performance notes cited a file outside the repository (KINDS.md of the machine lender);
    every file docs/performance.md and the notebook in docs/notes/ name must be one the repository
    tracks (globs and `...` patterns aside)."""
    tracked = _tracked()
    missing = {}
    docs = sorted(p for pattern in PERFORMANCE_DOCS for p in ROOT.glob(pattern))
    assert len(docs) > 10, "docs/performance.md and the notebook docs/notes/*.md must exist"
    for doc in docs:
        text = doc.read_text()
        for m in re.finditer(r"(?<![\w*.-])((?:\.\./|/)?\w[\w./-]*\.(?:md|py|json|log|csv|txt|yaml|sh)(?:\.gz|\.xz)?)\b", text):
            name = m[1]
            outside = name.startswith("/") or (name.startswith("../") and not (doc.parent / name).resolve().is_relative_to(ROOT))
            name = name.removeprefix("../").removeprefix("../")
            if outside or ("..." not in name and not any(f == n or f.endswith("/" + n) for n in _stored(name)
                                                         for f in tracked)):
                missing.setdefault(f"{doc.relative_to(ROOT)}: {name}", text[:m.start()].count("\n") + 1)
    assert not missing, f"files cited by the performance docs that the repository does not hold: {missing}"


def test_results_folders_cited_in_code_and_docs_exist():
    """Code comments and docs cite the results folder behind a number (never a notebook item): each
    `results/...` path they name must be a tracked file or folder (globs and `{a,b}` patterns aside)."""
    tracked = _tracked()
    folders = {str(Path(f).parent) + "/" for f in tracked} | {"results/"}
    for f in list(folders):
        parts = f.rstrip("/").split("/")
        folders |= {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
    sources = [f for f in tracked if f.endswith((".py", ".md", ".yml", ".yaml", ".sh"))
               and not f.startswith("results/") and (ROOT / f).exists()]
    missing = {}
    for rel in sources:
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"(?<![\w/.-])results/[\w./*{},-]*[\w/*}]", text):
            name = m[0]
            if any(c in name for c in "*{") or name == "results/x.json":
                continue
            if not set(_stored(name)) & set(tracked) and (name if name.endswith("/") else name + "/") not in folders:
                missing.setdefault(rel, []).append(name)
    assert not missing, f"results paths cited that the repository does not hold: {missing}"


def test_the_readme_library_example_runs():
    """The README's ten-line example (prefill, a decode step, a training step) runs as printed, on CPU."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- library example -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md must hold the library example after `<!-- library example -->`"
    assert len(m[1].strip().splitlines()) <= 12, "the README's example is meant to stay about ten lines"
    scope: dict = {}
    exec(compile(m[1], "README.md example", "exec"), scope)
    assert scope["y"].shape == scope["x"].shape and scope["y_t"].shape == (2, 1, scope["cfg"].dim)
    assert all(p.grad is not None for p in scope["attn"].parameters() if p.requires_grad)


def test_results_readme_names_only_files_the_tree_holds():
    """results/README.md is the index of results/: every file it names is tracked (under its storage
    rules: `.xz` added, `.gz` dropped), in results/ or tests/data/, apart from the ones its sections
    "How the files are stored" and "Not in the tree" say are only in git history."""
    tracked = _tracked()
    text = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    start, end = text.index("## How the files are stored"), text.index("## Index")
    history_only = set(re.findall(r"`([^`]+)`", text[start:end]))
    missing = []
    for m in re.finditer(r"`([\w./-]+\.(?:json|log|csv|md|txt|diff|jsonl)(?:\.gz|\.xz)?)`", text):
        name = m[1]
        if name.startswith("-") or name in history_only:
            continue
        if not any(f == n or f.endswith("/" + n) for n in _stored(name) for f in tracked):
            missing.append(name)
    assert not missing, f"results/README.md names files the tree does not hold: {missing}"


def test_results_stay_under_5_mb():
    """results/ shrank from 37 MB to about 3.5 MB (results/README.md, "How the files are stored");
    a new run belongs there compressed, or in the nightly history."""
    size = sum((ROOT / f).stat().st_size for f in _tracked() if f.startswith("results/") and (ROOT / f).exists())
    assert size < 5_000_000, f"results/ holds {size / 1e6:.1f} MB; compress or drop as results/README.md says"
