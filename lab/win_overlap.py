"""The sliding-window kernel on a second stream, beside the compressed branch and top-n (H100).

The window branch needs only q, k, v; the selection kernel's gated-sum epilogue is the first
thing that reads its output. In order, it runs after `compressed_select` (the compressed pass,
the scores kernel, top-n's launches). Here it is launched first on its own stream, and the
selection waits for both streams. Variants, timed interleaved by `bench.timing.measure` (CUDA
events on the calling stream, L2 flushed before each repeat):

* `serial`: the fast suite's forward (`bench.suites.fast.nsa_triton(..., "triton")`) in order
  (`Tiles.win_beside` off);
* `beside`: the same with `Tiles.win_beside` on at every T (`triton_nsa.beside`, with
  `win_beside_rows` lifted): the chain on a
  high-priority stream, the window on a low-priority one, so the window's programs fill what the
  chain leaves idle (its kernels' tails, the gaps of its small launches);
* `beside_swapped`: the window on the high-priority stream, the chain on the low one;
* `beside_same`: two streams of the same (default) priority;
* `auto_in_order`, `auto`: `NSAAttention.attend` with the default backend, `win_beside` off / the
  default tiles (beside up to `win_beside_rows` query rows).

Every variant's output is compared bit for bit with `serial` (the same kernels on the same
inputs). REP_MS: the repeats' budget per variant (at least 10, at most 60 repeats). Layouts: 64/4 at 8k..128k, 32/8 and 16/16 at 16k and 64k; bf16, D 128, the paper's
block sizes, random inputs (seed 0).

    PYTHONPATH=$PWD OUT=<dir> [REP_MS=400] python3 lab/win_overlap.py [T/HQ/HKV ...]

writes `$OUT/win-overlap.json`.
"""
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.suites.fast import nsa_triton
from bench.timing import Timer, measure
from ci import atomic
from nsa import NSAAttention, NSAConfig
from nsa.backends import triton_nsa

OUT = os.environ.get("OUT", "/tmp")
P = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
CELLS = ["8192/64/4", "16384/64/4", "32768/64/4", "65536/64/4", "131072/64/4", "16384/32/8", "65536/32/8",
         "16384/16/16", "65536/16/16"]


def inputs(t: int, hq: int, hkv: int):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, 128)
    kv = {n: (r(1, t, hkv, 128), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    return q, kv, torch.sigmoid(r(1, t, hq, 3))


def with_streams(fn, pair):
    """`fn` with `triton_nsa.beside` running on `pair` (a `triton_nsa._Streams`) instead of the
    device's own."""
    def run():
        dev = torch.device("cuda", torch.cuda.current_device())
        own = triton_nsa._streams(dev)
        triton_nsa._STREAMS[dev] = pair
        try:
            return fn()
        finally:
            triton_nsa._STREAMS[dev] = own
    return run


def run_cell(cell: str, streams: dict) -> dict:
    t, hq, hkv = (int(x) for x in cell.split("/"))
    q, kv, gates = inputs(t, hq, hkv)
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=128, head_dim_v=128)).cuda()
    base = triton_nsa.current_tiles("cuda")
    off = dataclasses.replace(base, win_beside=False)
    # The beside variants at every T (Tiles.win_beside_rows lifted); `auto` with the defaults.
    every = dataclasses.replace(base, win_beside=True, win_beside_rows=1 << 40)

    def under(tiles, fn):
        def run():
            with triton_nsa.use_tiles(tiles):
                return fn()
        return run

    def fast():
        return nsa_triton(q, kv, gates, P, "triton")

    fns = {"serial": under(off, fast), "beside": under(every, fast)}
    for name, pair in streams.items():
        fns[name] = under(every, with_streams(fast, pair))
    fns["auto_in_order"] = under(off, lambda: module.attend(q, kv, gates))
    fns["auto"] = lambda: module.attend(q, kv, gates)
    with torch.no_grad():
        return _time(fns, t, hq, hkv)


def _time(fns, t, hq, hkv) -> dict:
    ref = fns["serial"]()
    same = {}
    for name, fn in fns.items():
        out = fn()
        torch.cuda.synchronize()
        same[name] = bool(torch.equal(out, ref))
    retries = torch.cuda.memory_stats()["num_alloc_retries"]
    samples = measure(fns, Timer(warmup_ms=50, rep_ms=float(os.environ.get("REP_MS", 400)), min_rep=10, max_rep=60))
    return {"T": t, "heads": hq, "kv_heads": hkv, "bit_equal": same,
            # cudaMalloc retries after emptying the cache (each one a device-wide stall) while timing
            "alloc_retries": torch.cuda.memory_stats()["num_alloc_retries"] - retries,
            "reserved_gb": torch.cuda.memory_reserved() / 2**30,
            "median_ms": {k: statistics.median(v) for k, v in samples.items()},
            "max_ms": {k: max(v) for k, v in samples.items()}, "samples_ms": samples}


def main() -> None:
    cells = sys.argv[1:] or CELLS
    # A lower number is a higher priority; torch maps a value past the device's range to its end.
    hi, lo, a, b = (torch.cuda.Stream(priority=p) for p in (-100, 0, 0, 0))
    streams = {"beside_swapped": triton_nsa._Streams(lo, hi), "beside_same": triton_nsa._Streams(a, b)}
    res = {"gpu": torch.cuda.get_device_name(), "priorities": [hi.priority, lo.priority], "cells": []}
    for cell in cells:
        row = run_cell(cell, streams)
        res["cells"].append(row)
        print(cell, row["bit_equal"], "retries", row["alloc_retries"], {k: round(v, 3) for k, v in row["median_ms"].items()},
              "max", {k: round(v, 1) for k, v in row["max_ms"].items()}, flush=True)
        atomic.write_text(os.path.join(OUT, "win-overlap.json"), json.dumps(res, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
