"""Where one fused decode step (decode.py) spends its time, by the GPU's global timer read inside
its kernels (decode_step's `_trace`): per (sequence, KV group), when kernel A's first chunk program
started and its last ended, when B's top-n program started, passed its wait and ended, when C's
selected programs passed their waits and ended, and when D's programs passed their waits and
ended. The issue's decode layout (B = 8, 64 query / 4 KV heads, D 128, bf16, one query at
t = S - 1, random inputs from `bench.nsa_breakdown.decode_inputs`), a CUDA graph of the step,
L2 flushed before each replay; medians over replays, in us from kernel A's first program.

Needs a CUDA GPU. From the repo root:

    python3 lab/decode_trace.py --S 8192,65536 --json decode-trace.json
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.nsa_breakdown import decode_inputs
from ci import atomic
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import decode as dec
from nsa.backends.triton_kernels.tiles import current

SLOTS = dec.TRACE_NAMES


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", default="8192,65536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tile", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    over = {}
    for item in args.tile:
        name, _, value = item.partition("=")
        over[name] = {"true": True, "false": False}.get(value.lower(), None)
        over[name] = int(value) if over[name] is None else over[name]
    dev, b = "cuda", args.batch
    tiles = dataclasses.replace(current(dev), **over)
    report = {"gpu": torch.cuda.get_device_name(), "batch": b, "tiles": over, "cells": []}
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    for t in (int(x) for x in args.S.split(",")):
        q, gates, k, v, kc, vc = decode_inputs(t, b, dev, torch.bfloat16)
        groups = b * 4
        counts = triton_nsa.decode_counts(groups, dev)
        init = torch.zeros(groups, dec.TRACE_SLOTS.value, dtype=torch.int64, device=dev)
        init[:, list(dec.TRACE_MIN_SLOTS)] = torch.iinfo(torch.int64).max
        trace = init.clone()

        def step(trace=trace, init=init, counts=counts, q=q, gates=gates, k=k, v=v, kc=kc, vc=vc, t=t):
            trace.copy_(init)
            dec.decode_step(q, gates, kc, vc, k, v, k[:, -512:], v[:, -512:], t=t - 1, block=32, stride=16,
                            sel_block=64, sel_count=16, window=512, scale=128 ** -0.5, tiles=tiles, counts=counts,
                            _trace=trace)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rows = []
        for _ in range(args.reps):
            flush.zero_()
            graph.replay()
            torch.cuda.synchronize()
            rows.append(trace.clone().cpu())
        rel = []
        for tr in rows:
            t0 = int(tr[:, 1].min())
            rel.append({s: [(int(tr[g, s]) - t0) / 1000 for g in range(groups)] for s in SLOTS})
        med = {s: [statistics.median(r[s][g] for r in rel) for g in range(groups)] for s in SLOTS}
        last = max(range(groups), key=lambda g: med[9][g])
        print(f"S={t} B={b} tiles {over}: us from kernel A's first program (medians of {args.reps} replays)")
        print(f"  {'':20s} " + " ".join(f"{'g' + str(g):>6s}" for g in (0, groups // 2, groups - 1)) + f"  last(g{last})"
              + "   max over groups")
        for s, name in SLOTS.items():
            vals = [med[s][g] for g in (0, groups // 2, groups - 1, last)]
            print(f"  {name:20s} " + " ".join(f"{x:6.1f}" for x in vals[:3]) + f"  {vals[3]:9.1f}"
                  + f"   {max(med[s]):6.1f}")
        report["cells"].append({"S": t, "median_us": {SLOTS[s]: med[s] for s in SLOTS}, "last_group": last})
    if args.json:
        atomic.write_text(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
