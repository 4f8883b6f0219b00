"""Shared plumbing of the playbook wrappers (bench/bench_*.py): old flags in, the one runner, a table out."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from bench import cli
from bench.cases import Cell
from nsa_contract import exits, results


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 128,256, got {text!r}") from None


def add_common(p: argparse.ArgumentParser, *, out: str) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--out", default=out, help="results file (schema v1) to write")
    p.add_argument("--strict", action="store_true", help="exit 3 when any case failed")


def run(cells: list[Cell], args: argparse.Namespace, *, script: str, argv: Sequence[str], size: str,
        suite: str) -> tuple[int, dict[str, Any] | None]:
    """Run `cells` on one device with the runner; returns (exit code, the results document)."""
    for name, default in (("gpus", 1), ("shard", None), ("fa2", "auto"), ("csv", None), ("block", None),
                          ("warmup_ms", None), ("rep_ms", None), ("no_l2_flush", False), ("cuda_graph", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    command = shlex.join(["python", script, *argv])
    try:
        code = cli.execute(cells, args, command=command, size=size, suite_names=[suite])
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.ERROR, None
    return code, results.load(args.out)


def print_table(doc: dict[str, Any], columns: Sequence[str]) -> None:
    """One row per cell: the params in `columns`, then median ms (and speedup) per backend."""
    rows: dict[tuple, dict[str, str]] = {}
    backends: list[str] = []
    for case in doc["cases"]:
        values = [case[c] if c == "op" else case["params"].get(c) for c in columns]
        row = rows.setdefault(tuple(values), {c: str(v) for c, v in zip(columns, values, strict=True)})
        name = case["backend"]
        if name not in backends:
            backends.append(name)
        if case["status"] == "ok":
            row[name] = f"{case['timing']['median_ms']:.4f}"
            if case["role"] == "baseline":
                row["_base"] = case["timing"]["median_ms"]
        else:
            row[name] = case["status"]
    header = [*columns, *(f"{b} ms" for b in backends)]
    lines = [header]
    for row in rows.values():
        base = row.get("_base")
        cells = [row[c] for c in columns]
        for b in backends:
            value = row.get(b, "")
            if base and value.replace(".", "", 1).isdigit() and float(value) > 0 and f"{base:.4f}" != value:
                value += f" ({float(base) / float(value):.2f}x)"
            cells.append(value)
        lines.append(cells)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(v).rjust(w) for v, w in zip(line, widths, strict=True)))
