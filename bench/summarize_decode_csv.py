"""Summarize the legacy decode CSV: latency per branch, reads against the spec, reduction vs dense
(reads, and time where the CSV has the dense decode columns). Two time ratios, both fastest dense
attention ms over an NSA ms on the same cache: `dense/step` over the whole step (q/k/v/gate
projections, cache appends, o_proj included) and `dense/attend` over its attention alone
(`NSAAttention.decode_attend`, the like-for-like ratio; `ms_attend` column, absent in older CSVs).

    python bench/summarize_decode_csv.py decode.csv

Exit codes: 0 every row's measured reads equal the expected reads; 1 some row differs (or has
no reads); 2 the file is missing or lacks the legacy columns.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REQUIRED = ("S", "ms_total", "ms_cmp", "ms_sel", "ms_win", "reads_actual", "reads_expected")


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def summarize(rows: list[dict[str, str]]) -> tuple[list[list[str]], int]:
    """Table lines (header first) and the number of rows whose reads differ from the spec."""
    header = ["S", "ms_total", "ms_cmp", "ms_sel", "ms_win", "ms_attend", "reads", "expected", "match",
              "dense/nsa reads", "dense/step ms", "dense/attend ms"]
    lines, bad = [header], 0
    for row in rows:
        actual, expected, s = _num(row["reads_actual"]), _num(row["reads_expected"]), _num(row["S"])
        ok = actual is not None and expected is not None and actual == expected
        bad += not ok
        ratio = f"{s / actual:.2f}x" if s and actual else "-"
        lines.append([row["S"], *(row[k] or "-" for k in ("ms_total", "ms_cmp", "ms_sel", "ms_win")),
                      row.get("ms_attend") or "-", row["reads_actual"] or "-", row["reads_expected"] or "-",
                      "ok" if ok else "MISMATCH", ratio,
                      *(f"{_num(row.get(k)):.2f}x" if _num(row.get(k)) else "-"
                        for k in ("speedup_vs_dense", "speedup_attend_vs_dense"))])
    return lines, bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="CSV written by bench/bench_decode.py --csv or python -m bench run --csv")
    args = p.parse_args(argv)
    path = Path(args.csv)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
    except OSError as exc:
        print(f"error: cannot read {path}: {exc.strerror}; run bench/bench_decode.py --csv {path} first",
              file=sys.stderr)
        return 2
    if missing:
        print(f"error: {path} must have the columns {','.join(REQUIRED)}, missing {','.join(missing)}",
              file=sys.stderr)
        return 2
    lines, bad = summarize(rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)))
    print("reads: per KV group per step (cmp + sel + win); expected from docs/nsa.md; "
          f"{len(rows) - bad}/{len(rows)} rows match")
    print("ms_total..ms_win: whole decode steps (projections, cache appends, o_proj included); ms_attend: "
          "decode_attend, the step's attention only; dense/step ms and dense/attend ms: fastest dense "
          "decode attention ms over each")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
