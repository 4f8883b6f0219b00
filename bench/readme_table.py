"""`python -m bench readme-table`: the README's results table, generated from one `fast` suite results file.

    python -m bench readme-table results/h100/final-0a86c24/fast-full.json.xz   # print the table
    python -m bench readme-table --readme README.md                       # rewrite the README's table
    python -m bench readme-table FILE --readme README.md                  # the same from another file

The README holds the table between `<!-- results-table: FILE -->` and `<!-- /results-table -->`;
tests/bench/test_readme_table.py fails when the two differ, so the table cannot drift from its file.
One row per cell that has the whole NSA forward with every branch on the own Triton kernels (the
`fast` suite's `win=triton` case, the plan `auto` picks at these shapes), against dense FA-3 and
cuDNN measured in the same cell. Standard library only: no torch, no GPU.

Exit codes: 0 done; 2 bad input (a file that is not a results file, no such cells, a README
without the markers), with a message saying how to fix it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nsa_contract import results

EXIT_OK, EXIT_USAGE = 0, 2
BEGIN = re.compile(r"<!-- results-table: (?P<file>\S+) -->\n")
END = "<!-- /results-table -->"
DENSE = {"fa3": "dense FA-3", "sdpa_cudnn": "dense cuDNN"}


class TableError(ValueError):
    """The results file or the README cannot give the table."""


def _ms(value: float | None) -> str:
    """Three significant figures up to 999 ms, trailing zeros kept (14.0, 9.90), so columns read alike."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _tokens(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def _layout(params: Mapping[str, Any]) -> str:
    dims = f"D {params['Dk']}" if params["Dk"] == params["Dv"] else f"dk {params['Dk']} / dv {params['Dv']}"
    return f"{params['Hq']}/{params['Hkv']}, {dims}"


def rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per cell with an all-Triton NSA forward: layout, T, NSA median ms and the dense medians (None
    where that baseline was skipped), in the file's cell order."""
    cells: dict[int, dict[str, Any]] = {}
    for case in doc["cases"]:
        if case["suite"] != "fast" or case["status"] != "ok":
            continue
        cell = cells.setdefault(case["cell_index"], {})
        if case["op"] == "nsa_prefill" and case["params"].get("win") == "triton":
            cell["params"], cell["nsa"] = case["params"], case["timing"]["median_ms"]
        elif case["op"] == "dense" and case["backend"] in DENSE:
            cell[case["backend"]] = case["timing"]["median_ms"]
    out = [{"layout": _layout(c["params"]), "T": c["params"]["T"], "nsa": c["nsa"],
            **{b: c.get(b) for b in DENSE}} for c in cells.values() if "nsa" in c]
    if not out:
        raise TableError("the results file must hold `fast` suite cells with an all-Triton NSA forward "
                         "(`win=triton`), got none; pass a file from `python -m bench run --suites fast`")
    return out


def table(doc: Mapping[str, Any], source: str) -> str:
    """The markdown block: a caption naming device, versions, tree and command, then the table."""
    run, machine = doc["run"], doc["machine"]
    command = re.sub(r" --out \S+", "", run["command"])
    wheels = ", ".join(f"`{k}` {machine[k]}" for k in ("fa3", "fa4") if machine.get(k)) or "no FA-3/FA-4 wheels"
    caption = (f"{machine['gpu_name']} ({machine['sm']}, torch {machine['torch']}, triton {machine['triton']}, "
               f"{wheels}), tree {run['git_sha'][:7]}, `{command}`; "
               f"[`{source}`]({source}). Medians in ms, bf16, B = 1, attention without "
               "projections; NSA: every branch on the own Triton kernels (the plan `auto` picks at these shapes), "
               "dense: measured in the same cell.")
    lines = [caption, "", "| heads (q/kv), head dim | T | NSA forward | dense FA-3 | dense cuDNN | FA-3 / NSA |",
             "|---|---|---|---|---|---|"]
    for r in rows(doc):
        ratio = "-" if r["fa3"] is None else f"{r['fa3'] / r['nsa']:.2f}x"
        lines.append(f"| {r['layout']} | {_tokens(r['T'])} | {_ms(r['nsa'])} | {_ms(r['fa3'])} | "
                     f"{_ms(r['sdpa_cudnn'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def block(text: str) -> tuple[str, str, int, int]:
    """The README's table block: (results file named in its marker, current table, start, end offsets)."""
    m = BEGIN.search(text)
    end = text.find(END, m.end()) if m else -1
    if m is None or end < 0:
        raise TableError(f"the README must hold the table between `<!-- results-table: FILE -->` and `{END}`, "
                         "got no such pair; add the two lines where the table goes")
    return m["file"], text[m.end():end], m.start(), end + len(END)


def render(readme: Path, root: Path, source: str | None = None) -> str:
    """The README's text with its table regenerated from `source` (default: the file its marker names)."""
    text = readme.read_text(encoding="utf-8")
    named, _, start, end = block(text)
    source = source or named
    path = Path(source) if Path(source).is_absolute() else root / source
    body = table(results.load(path), source)
    return f"{text[:start]}<!-- results-table: {source} -->\n{body}{END}{text[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench readme-table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", help="a `fast` suite results file (.json, .json.xz or .json.gz)")
    ap.add_argument("--readme", type=Path, help="rewrite the table in this README (atomically) instead of printing")
    args = ap.parse_args(argv)
    try:
        if args.readme is None:
            if args.file is None:
                raise TableError("readme-table needs a results file or --readme; pass one of them")
            sys.stdout.write(table(results.load(args.file), args.file))
            return EXIT_OK
        from nsa_contract import atomic

        root = args.readme.resolve().parent
        source = None if args.file is None else Path(args.file).resolve().relative_to(root).as_posix()
        atomic.write_text(args.readme, render(args.readme, root, source))
    except (TableError, results.ResultsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # a FILE outside the README's folder
        print(f"error: the results file must lie under the README's folder, got {args.file} ({exc})", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
