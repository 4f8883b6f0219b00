"""Playbook wrapper: FA-2 vs masked SDPA on one branch, old flags, the one runner underneath.

    python bench/bench_fa2.py --mode win --heads 8 --dk 64 --dv 64 --S_list 128,256,512,1024,2048 --w 512 --iters 100
    python bench/bench_fa2.py --mode cmp --heads 8 --dk 64 --dv 64 --S_list 128,256,512,1024,2048 --l 32 --d 16 --iters 100

Writes a results file (schema v1, suite `fa2`) and prints a table; `python -m bench run
--suites fa2` runs the full grid.
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
from bench.cases import Cell, Variant  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("win", "cmp"), required=True, help="sliding (win) or compressed (cmp) branch")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--groups", type=int, help="KV heads (default: --heads, i.e. MHA)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--S_list", type=legacy.int_list, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--w", type=int, default=512, help="window (win mode)")
    p.add_argument("--l", type=int, default=32, help="compression block (cmp mode)")
    p.add_argument("--d", type=int, default=16, help="compression stride (cmp mode)")
    p.add_argument("--iters", type=int, default=100, help="timed repeats per backend")
    p.add_argument("--warmup", type=int, default=10, help="warmup calls per backend")
    p.add_argument("--backends", default="sdpa,fa2", help="comma-separated; sdpa is the baseline")
    legacy.add_common(p, out="out/bench_fa2.json")
    args = p.parse_args(argv)
    args.rep = args.iters
    op = "sliding" if args.mode == "win" else "compressed"
    knobs = {"window": args.w} if op == "sliding" else {"block": args.l, "stride": args.d}
    variants = tuple(Variant(b, "baseline" if b == "sdpa" else "candidate")
                     for b in args.backends.split(",") if b.strip())
    cells = [Cell("fa2", op, {"B": args.batch, "T": s, "Hq": args.heads, "Hkv": args.groups or args.heads,
                              "Dk": args.dk, "Dv": args.dv, **knobs, "dtype": args.dtype}, variants)
             for s in args.S_list]
    code, doc = legacy.run(cells, args, script="bench/bench_fa2.py", argv=argv, size="nightly", suite="fa2")
    if doc is not None:
        legacy.print_table(doc, ("T", *knobs))
    return code


if __name__ == "__main__":
    sys.exit(main())
