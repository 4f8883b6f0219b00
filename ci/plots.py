"""Speedup-against-length plots for the report (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless CI runners have no display; select before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from nsa_contract import keys  # noqa: E402

# (op, candidate label, candidate backends) per key declared in nsa_contract.keys, so a new key gets a plot title too.
BRANCH_LABELS = {k.decision_id: (k.op, k.label, tuple(k.candidates)) for k in keys.KEYS}
GRID_LABELS = {"sliding": (("w", "window"),), "compressed": (("l", "block"), ("d", "stride")),
               "selected": (("l", "block"), ("d", "stride"), ("l'", "sel_block"), ("n", "sel_count"))}


def series_label(cell: Mapping[str, Any]) -> str:
    """Legend text of a cell's series: backend, grid point and the shape knobs except T."""
    p = cell["params"]
    grid = ",".join(f"{label}={p.get(key)}" for label, key in GRID_LABELS.get(cell["op"], ()))
    return (f"{cell['candidate_backend']} {grid} B{p.get('B')} Hq{p.get('Hq')}/Hkv{p.get('Hkv')} "
            f"D{p.get('Dk')} {p.get('dtype')}")


def plot_title(branch: str, backends: Iterable[str]) -> str:
    """What the plot shows: the backends it draws, and, when none of them is a candidate of the key
    (a CPU run: flex only, reported), that the key's own candidates are not in it."""
    op, label, candidates = BRANCH_LABELS.get(branch, (branch, "", ()))
    shown = sorted(set(backends))
    text = f"{op} branch ({branch}): {', '.join(shown)} over masked SDPA"
    if label and not set(shown) & set(candidates):
        return f"{text}, reported only (no {label} cell was timed)"
    return text


def plot_branch(cells: Iterable[Mapping[str, Any]], branch: str, margin: float, path: Path) -> Path | None:
    """Plot the `branch` cells' speedup (CI error bars) against T, log2 x axis; None if no data.

    Pass the cells of one suite: series are keyed by backend, grid point and shape, not suite.

    Series that decide the threshold are solid; reported-only ones are dashed and faded.
    """
    series: dict[str, list[Mapping[str, Any]]] = {}
    used: set[str] = set()
    for c in cells:
        if c["branch"] != branch or c["speedup"] is None or c["T"] is None:
            continue
        label = series_label(c)
        series.setdefault(label, []).append(c)
        if c["used_for_decision"]:
            used.add(label)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label in sorted(series, key=lambda s: (s not in used, s)):
        pts = sorted(series[label], key=lambda c: c["T"])
        ts = [c["T"] for c in pts]
        ys = [c["speedup"] for c in pts]
        err = [[c["speedup"] - c["ci_low"] for c in pts], [c["ci_high"] - c["speedup"] for c in pts]]
        decisive = label in used
        ax.errorbar(ts, ys, yerr=err, marker="o", capsize=3, label=label + ("" if decisive else " (reported)"),
                    linestyle="-" if decisive else "--", alpha=1.0 if decisive else 0.45)
    ax.axhline(margin, color="red", linewidth=1, label=f"margin {margin:g}x")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("speedup = SDPA / candidate")
    title = plot_title(branch, (series[label][0]["candidate_backend"] for label in series))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Title": title})
    plt.close(fig)
    return path
