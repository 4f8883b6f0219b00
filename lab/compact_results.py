"""How results/ went from 37 MB to under 5 MB (run once, at the commit after 6aef779; kept so the rule is on record).

    python3 lab/compact_results.py [--dry-run] [ROOT]

The rules, in order, for every file under ROOT/results (ROOT: the repository root):
1. Lab archives (JSON from the lab/ scripts and the bench profilers, not results schema v1, no
   history record, no decision): every list of 16 or more numbers (raw timing samples or timer
   stamps) becomes `{"samples_dropped": n, "min", "p20", "median", "p80", "max"}`, the medians the
   files already report being unchanged; stored as plain `.json` (a `.json.gz` loses its `.gz`).
2. Results files (schema v1) and decisions over 64 KiB: stored as `.json.xz` (xz -9e), which
   `bench.results.load`, and so `python -m ci decide --results`, reads as is; a `.json.gz` becomes
   `.json.xz`. The raw samples stay: `ci decide` bootstraps them.
3. Reports, logs and CSV files over 32 KiB: `.md.xz`, `.log.xz`, `.csv.xz`.
The raw files before this are in git at 6aef779 (`git show 6aef779:results/<path>`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import statistics
import sys
from pathlib import Path
from typing import Any

SAMPLES_MIN = 16
XZ_JSON_OVER = 64 * 1024
XZ_TEXT_OVER = 32 * 1024


def _is_numbers(x: Any) -> bool:
    return (isinstance(x, list) and len(x) >= SAMPLES_MIN
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x))


def summarise(x: Any) -> Any:
    """`x` with every list of SAMPLES_MIN or more numbers replaced by its summary."""
    if isinstance(x, dict):
        return {k: summarise(v) for k, v in x.items()}
    if _is_numbers(x):
        s = sorted(x)
        q = statistics.quantiles(s, n=5, method="inclusive")
        return {"samples_dropped": len(s), "min": s[0], "p20": q[0], "median": statistics.median(s),
                "p80": q[3], "max": s[-1]}
    if isinstance(x, list):
        return [summarise(v) for v in x]
    return x


def _kind(path: Path, doc: Any) -> str:
    if isinstance(doc, dict) and doc.get("schema_version") == 1:
        return "results"
    if "history-store" in path.parts or path.name.split(".")[0] in ("decision", "history"):
        return "pipeline"
    return "lab"


def plan(path: Path) -> tuple[Path, bytes] | None:
    """The file's new name and bytes, or None to leave it as it is."""
    raw = path.read_bytes()
    name = path.name
    if name.endswith((".json", ".json.gz")):
        data = gzip.decompress(raw) if name.endswith(".gz") else raw
        base = name.removesuffix(".gz")
        kind = _kind(path, json.loads(data))
        if kind == "lab":
            out = (json.dumps(summarise(json.loads(data)), indent=1) + "\n").encode()
            return (path.with_name(base), out) if out != raw or base != name else None
        if len(data) > XZ_JSON_OVER or name.endswith(".gz"):
            return path.with_name(base + ".xz"), lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        return None
    if name.endswith((".md", ".log", ".csv")) and len(raw) > XZ_TEXT_OVER and name != "README.md":
        return path.with_name(name + ".xz"), lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=".", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    before = after = 0
    for path in sorted((args.root / "results").rglob("*")):
        if not path.is_file():
            continue
        size = path.stat().st_size
        before += size
        change = plan(path)
        if change is None:
            after += size
            continue
        new, data = change
        after += len(data)
        print(f"{path.relative_to(args.root)} -> {new.name}: {size} -> {len(data)} bytes")
        if not args.dry_run:
            new.write_bytes(data)
            if new != path:
                path.unlink()
    print(f"results/: {before} -> {after} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
