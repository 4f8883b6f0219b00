"""The whole NSA forward (`NSAAttention.attend`, what `backend="auto"` runs) under several
`Tiles` variants, timed interleaved in one process by `bench.timing.measure` (CUDA events, L2
flushed before each repeat), on the same random inputs (bf16, seed 0, the paper's block sizes,
one K/V per branch as the fast suite).

    PYTHONPATH=$PWD OUT=<dir> [REP_MS=400] python3 bench/experiments/forward_ab.py NAME \\
        --variant base: --variant lists:selb_forced_min_group=0 [--variant ...] [T/HQ/HKV[/DK] ...]

A variant is `LABEL:FIELD=VALUE,FIELD=VALUE` (no fields: the device's tiles); the first is the
reference of `rel_diff` (each variant's output against it; 0 when the same kernels run). Cells
default to 32/8 and 16/16 heads at 16k and 64k. Writes `$OUT/NAME.json` (medians and raw samples,
ms) after each cell.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch

from bench.machine import dist_version
from bench.nsa_breakdown import _tile_changes
from bench.timing import Timer, measure
from ci import atomic
from nsa import NSAAttention, NSAConfig
from nsa.backends import triton_nsa

OUT = os.environ.get("OUT", "/tmp")
CELLS = ["16384/32/8", "65536/32/8", "16384/16/16", "65536/16/16"]


def variants(specs: list[str], base) -> dict:
    """`LABEL:FIELD=VALUE,...` -> {label: Tiles}."""
    out = {}
    for spec in specs:
        label, _, fields = spec.partition(":")
        if not label or label in out:
            raise SystemExit(f"--variant takes a new LABEL:FIELD=VALUE,..., got {spec!r}")
        pairs = [p for p in fields.split(",") if p]
        out[label] = dataclasses.replace(base, **_tile_changes(pairs, base))
    return out


def run_cell(cell: str, tiles: dict) -> dict:
    t, hq, hkv, *rest = (int(x) for x in cell.split("/"))
    dk = rest[0] if rest else 128
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, dk)
    kv = {n: (r(1, t, hkv, dk), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=dk, head_dim_v=128)).cuda()

    def under(tl):
        def run():
            with triton_nsa.use_tiles(tl):
                return module.attend(q, kv, gates)
        return run

    fns = {name: under(tl) for name, tl in tiles.items()}
    first = next(iter(fns))
    with torch.no_grad():
        ref = fns[first]().double()
        diff = {}
        for name, fn in fns.items():
            out = fn().double()
            diff[name] = float((out - ref).norm() / ref.norm())
        samples = measure(fns, Timer(warmup_ms=50, rep_ms=float(os.environ.get("REP_MS", 400)), min_rep=10,
                                     max_rep=60))
    return {"T": t, "heads": hq, "kv_heads": hkv, "dk": dk, "dv": 128, "rel_diff": diff,
            "median_ms": {k: statistics.median(v) for k, v in samples.items()}, "samples_ms": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="the output file's name, without .json")
    ap.add_argument("--variant", action="append", required=True, metavar="LABEL:FIELD=VALUE,...")
    ap.add_argument("cells", nargs="*", default=CELLS, metavar="T/HQ/HKV[/DK]")
    args = ap.parse_args()
    base = triton_nsa.current_tiles("cuda")
    tiles = variants(args.variant, base)
    res = {"gpu": torch.cuda.get_device_name(), "fa3": dist_version("fa3-fwd")[0],
           "fa4": dist_version("flash-attn-4")[0], "variants": args.variant, "cells": []}
    for cell in args.cells:
        row = run_cell(cell, tiles)
        res["cells"].append(row)
        print(cell, {k: f"{v:.1e}" for k, v in row["rel_diff"].items()},
              {k: round(v, 3) for k, v in row["median_ms"].items()}, flush=True)
        atomic.write_text(os.path.join(OUT, f"{args.name}.json"), json.dumps(res, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
