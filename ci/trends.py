"""Trend plots: headline cases' medians (p20-p80 bars) over the last runs of one GPU model.

Headlines: the paper layout (Hq 64, Hkv 4, D 128) prefill, NSA against dense, at 16k and at 64k;
the training step (forward + backward, `train` suite) of the same layout and lengths;
decode at 64k (all branches, with the dense decode of the same shape where the run timed one); and
each threshold key's deciding cells, passed in by the caller (``{key: [case ids]}``, from the
decision's cells used for it). ``headlines`` and ``series`` are pure; ``plot_headline`` and
``write_trends`` draw PNGs (matplotlib, Agg), each written atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless CI runners have no display; select before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from ci.history import HistoryCase, HistoryRun, chronological  # noqa: E402

PAPER = {"Hq": 64, "Hkv": 4, "Dk": 128}
PREFILL_T = (16384, 65536)
DECODE_T = 65536


@dataclass(frozen=True)
class Headline:
    name: str  # file stem: trend_<name>.png
    title: str
    case_ids: list[str]


@dataclass(frozen=True)
class Point:
    run_id: str
    created_at: str
    median_ms: float
    p20_ms: float
    p80_ms: float


def _field(case: Mapping[str, Any] | HistoryCase, name: str) -> Any:
    return case[name] if isinstance(case, Mapping) else getattr(case, name)


def headlines(cases: Iterable[Mapping[str, Any] | HistoryCase],
              deciding: Mapping[str, Sequence[str]] | None = None) -> list[Headline]:
    """The headline charts for a run's cases (results cases or history cases); empty ones left out."""
    rows = [(_field(c, "id"), _field(c, "op"), _field(c, "params")) for c in cases]
    out = []
    for t in PREFILL_T:
        ids = sorted(cid for cid, op, p in rows if op in ("nsa_prefill", "dense") and p.get("T") == t
                     and all(p.get(k) == v for k, v in PAPER.items()) and p.get("Dv", 128) == 128
                     and "part" not in p and "branches" not in p and "dim" not in p)
        out.append(Headline(f"prefill_T{t}", f"prefill, paper layout (Hq64/Hkv4/D128), T={t // 1024}k", ids))
    for t in PREFILL_T:
        # A training step (forward + backward) of the whole attention, NSA against dense (`train` suite).
        ids = sorted(cid for cid, op, p in rows if op in ("nsa_train", "dense") and cid.startswith("train/")
                     and p.get("T") == t and p.get("part") == "all" and all(p.get(k) == v for k, v in PAPER.items()))
        out.append(Headline(f"train_T{t}", f"training step (fwd + bwd), paper layout, T={t // 1024}k", ids))
    decode = sorted(cid for cid, op, p in rows if p.get("T") == DECODE_T and (
        (op == "nsa_decode" and p.get("branches", "all") == "all") or (op == "dense" and "dim" in p)))
    out.append(Headline(f"decode_T{DECODE_T}", f"decode step at {DECODE_T // 1024}k tokens", decode))
    # The serve suite's ragged paged batch (nightly): every variant of that one cell.
    ragged = sorted(cid for cid, op, p in rows if op == "nsa_serve" and p.get("ragged"))
    out.append(Headline("serve_ragged", "decode step, ragged paged batch (B=32, 4k-64k)", ragged))
    for key, ids in sorted((deciding or {}).items()):
        out.append(Headline(f"key_{key}", f"{key}: deciding cells", sorted(ids)))
    return [h for h in out if h.case_ids]


def series(runs: Iterable[HistoryRun], case_ids: Iterable[str]) -> dict[str, list[Point]]:
    """``{case id: points oldest first}``; a run that did not time a case has no point for it."""
    ordered = chronological(runs)
    out: dict[str, list[Point]] = {}
    for cid in case_ids:
        out[cid] = [Point(r.id, r.created_at, c.median_ms, c.p20_ms, c.p80_ms)
                    for r in ordered if (c := r.case(cid)) is not None]
    return out


def _label(case_id: str) -> str:
    suite, op, backend, shape = case_id.split("/", 3)
    return f"{op} {backend} {shape}"


def _save_atomic(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_headline(headline: Headline, runs: Sequence[HistoryRun], path: Path) -> Path | None:
    """One PNG: x = run (date and id, oldest left), y = median ms with p20-p80 bars; None without data."""
    ordered = chronological(runs)
    data = {cid: pts for cid, pts in series(ordered, headline.case_ids).items() if pts}
    if not data:
        return None
    x_of = {r.id: i for i, r in enumerate(ordered)}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for cid, pts in sorted(data.items()):
        xs = [x_of[p.run_id] for p in pts]
        ys = [p.median_ms for p in pts]
        err = [[p.median_ms - p.p20_ms for p in pts], [p.p80_ms - p.median_ms for p in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=_label(cid))
    ax.set_xticks(range(len(ordered)))
    ax.set_xticklabels([f"{r.created_at[:10]}\n{r.id[-8:]}" for r in ordered], fontsize=7, rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms), bars p20-p80")
    ax.set_title(f"{headline.title}: last {len(ordered)} runs on {ordered[-1].machine.get('gpu_name', ordered[-1].gpu)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    try:
        _save_atomic(fig, path)
    finally:
        plt.close(fig)
    return path


def write_trends(runs: Sequence[HistoryRun], heads: Sequence[Headline], out_dir: Path) -> list[Path]:
    """``trend_<name>.png`` per headline with data, in ``out_dir``; returns the files written."""
    written = [plot_headline(h, runs, Path(out_dir) / f"trend_{h.name}.png") for h in heads]
    return [p for p in written if p is not None]
