"""A few fused decode steps (decode.py) at one cache length, for a profiler: the issue's decode
layout (B sequences, one query at t = S - 1, 64 query / 4 KV heads, D 128, bf16, paper block
sizes, random inputs from `bench.nsa_breakdown.decode_inputs`), one kept counts buffer, `steps`
steps. `--tile NAME=VALUE` overrides a `Tiles` field.

Needs a CUDA GPU. Used on the H100 under Nsight Compute, from the repo root (the second step's
four kernels):

    S="--section SpeedOfLight --section Occupancy --section WarpStateStats \\
       --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats"
    PYTHONPATH=$PWD ncu $S -k regex:"_dec_" --launch-skip 4 -c 4 --csv --page details \\
        python3 lab/decode_once.py 65536 > ncu-decode-64k.csv
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.nsa_breakdown import decode_inputs
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels.tiles import current, use_tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("S", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tile", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    over = {}
    for item in args.tile:
        name, _, value = item.partition("=")
        over[name] = {"true": True, "false": False}.get(value.lower(), None)
        if over[name] is None:
            over[name] = int(value)
    t, b, dev = args.S, args.batch, "cuda"
    q, gates, k, v, kc, vc = decode_inputs(t, b, dev, torch.bfloat16)
    counts = triton_nsa.decode_counts(b * 4, dev)
    with use_tiles(dataclasses.replace(current(dev), **over)):
        for _ in range(args.steps):
            triton_nsa.decode_step(q, gates, kc, vc, k, v, k[:, -512:], v[:, -512:], t=t - 1, block=32, stride=16,
                                   sel_block=64, sel_count=16, window=512, scale=128 ** -0.5, counts=counts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
