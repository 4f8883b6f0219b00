"""Playbook wrapper: NSA decode step latency per branch, its attention alone, and measured reads (suite `decode`).

    python bench/bench_decode.py --heads 4 --groups 2 --dk 64 --dv 64 --S_list 128,256,512,1024 \
        --iters 32 --warmup 8 --csv decode.csv

`--heads` are query heads, `--groups` KV heads. Each cell times the whole step (ms_total, per
branch ms_cmp..ms_win: projections, cache appends, o_proj included) and its attention alone
(`decode_attend`, ms_attend..ms_attend_win: what dense decode and the prefill benches time),
beside dense decode attention over the same cache. Writes a results file (schema v1), the legacy
CSV (`S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected`, then the layout, dense ms,
fastest dense / step `speedup_vs_dense`, the attend ms and fastest dense / attend
`speedup_attend_vs_dense`) when `--csv` is given, and prints the CSV's summary
(bench/summarize_decode_csv.py). The decode target (B = 8 up to 64k, Triton, CUDA graphs):

    python bench/bench_decode.py --batch 8 --heads 64 --groups 4 --dk 128 --dv 128 --dim 2560 \
        --S_list 8192,16384,32768,65536 --nsa-backend triton --graph --csv decode_b8.csv \
        --out out/decode_b8.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script, sys.path[0] is bench/ itself (whose modules would shadow top-level names):
# put the repo root there instead, so `import bench` finds the package.
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path[0] = str(_HERE.parent)
elif str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from bench import legacy  # noqa: E402
from bench.suites import decode  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--groups", type=int, default=2, help="KV heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--dim", type=int, help="model width (default heads * dv)")
    p.add_argument("--S_list", type=legacy.int_list, default=[128, 256, 512, 1024],
                   help="sequence lengths: the timed step is token S (position S - 1)")
    p.add_argument("--l", type=int, default=32)
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--sel_block", type=int, default=64)
    p.add_argument("--sel_count", type=int, default=16)
    p.add_argument("--w", type=int, default=512)
    p.add_argument("--iters", type=int, default=32, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=8, help="warmup steps per variant")
    p.add_argument("--nsa-backend", choices=("auto", "triton"), default="auto",
                   help="NSAAttention(backend=...) of the decode step")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA graph replays of the step and of dense decode (needs a GPU)")
    p.add_argument("--csv", help="legacy CSV output")
    legacy.add_common(p, out="out/bench_decode.json")
    args = p.parse_args(argv)
    args.rep = args.iters
    layout = {"B": args.batch, "Hq": args.heads, "Hkv": args.groups, "Dk": args.dk, "Dv": args.dv,
              "dim": args.dim or args.heads * args.dv, "block": args.l, "stride": args.d,
              "sel_block": args.sel_block, "sel_count": args.sel_count, "window": args.w}
    # Only knobs away from their defaults enter the params (and so the case ids).
    if args.nsa_backend != "auto":
        layout["nsa_backend"] = args.nsa_backend
    if args.graph:
        layout["graph"] = True
    cells = decode.cells(layout, args.S_list, args.dtype)
    code, doc = legacy.run(cells, args, script="bench/bench_decode.py", argv=argv, size="nightly", suite="decode")
    if doc is not None and args.csv:
        from bench import summarize_decode_csv

        summarize_decode_csv.main([args.csv])
    elif doc is not None:
        legacy.print_table(doc, ("T", "branches", "part"))
    return code


if __name__ == "__main__":
    sys.exit(main())
