"""Playbook wrapper: masked SDPA against the naive matmul reference, per branch (suite `masked`).

    python bench/bench_masked.py [--size smoke|nightly|full] [--device cpu]

Writes a results file (schema v1) and prints a table.
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

from bench import legacy, suites  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("smoke", "nightly", "full"), default="smoke")
    p.add_argument("--iters", type=int, help="timed repeats per variant (default: by time budget)")
    p.add_argument("--warmup", type=int, help="warmup calls per variant (default: by time budget)")
    legacy.add_common(p, out="out/bench_masked.json")
    args = p.parse_args(argv)
    args.rep = args.iters
    cells = suites.cells(["masked"], args.size)
    if args.dtype != "bf16":
        cells = [type(c)(c.suite, c.op, {**c.params, "dtype": args.dtype}, c.variants) for c in cells]
    code, doc = legacy.run(cells, args, script="bench/bench_masked.py", argv=argv, size=args.size, suite="masked")
    if doc is not None:
        legacy.print_table(doc, ("op", "T", "Hq", "Hkv", "Dk"))
    return code


if __name__ == "__main__":
    sys.exit(main())
