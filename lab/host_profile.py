"""Host time of the whole NSA forward (`NSAAttention.attend`, what `backend="auto"` runs) at short
lengths, where the GPU waits on the host. Per cell and `Tiles` variant (as `forward_ab.py`'s
`--variant LABEL:FIELD=VALUE,...`; none: the device's tiles), each variant alone, no interleaving
(an interleaved A/B lets one variant's GPU time hide another's host time):
- `enqueue_ms`: the host's time in the call (it returns before the GPU is done), median;
- `latency_ms`: the call to the GPU's end, synchronised after every call, median;
- `steady_ms`: `CALLS` calls back to back without a synchronisation, CUDA events around all of
  them, divided by `CALLS` (max(host, GPU) per call once either side leads), median of 5;
- `graphed_ms`: the same for `nsa.GraphedAttend` (its input copies, one replay, its output copy),
  after its capture, with the variant's tiles as given (not `Tiles.for_graphs`, its default), and `replay_ms` for the bare replay of its graph (the kernels' GPU time,
  no host in the way); `graphed_equal`: whether its output equals the eager call's bit for bit;
then, for the first variant and unless `--no-profile`, a cProfile of the enqueue (functions by own
and cumulative time).
Same inputs as `forward_ab.py` (bf16, seed 0, paper block sizes, one K/V per branch).

    PYTHONPATH=$PWD OUT=<dir> python3 lab/host_profile.py NAME [T/HQ/HKV ...] \
        [--variant LABEL:FIELD=VALUE,...] [--no-profile]

Writes `$OUT/NAME.json` (medians, ms) and `$OUT/NAME-T-HQ-HKV.prof.txt` (the two cProfile tables).
"""
import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.forward_ab import variants as tile_variants
from ci import atomic
from nsa import GraphedAttend, NSAAttention, NSAConfig
from nsa.backends import triton_nsa

OUT = os.environ.get("OUT", "/tmp")
CALLS = 60


def steady(fn) -> float:
    """Median over 5 of (CUDA events around `CALLS` back-to-back calls) / `CALLS`, ms."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def cell(spec: str, name: str, variants: dict, profile: bool = True) -> dict:
    t, hq, hkv = (int(x) for x in spec.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, 128)
    kv = {n: (r(1, t, hkv, 128), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=128, head_dim_v=128)).cuda()
    row = {"T": t, "heads": hq, "kv_heads": hkv, "calls": CALLS, "variants": {}}
    for k, (label, tiles) in enumerate(variants.items()):
        with torch.no_grad(), triton_nsa.use_tiles(tiles):
            for _ in range(10):                      # compile and warm up
                module.attend(q, kv, gates)
            torch.cuda.synchronize()
            enqueue, latency = [], []
            for _ in range(CALLS):
                t0 = time.perf_counter()
                module.attend(q, kv, gates)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                enqueue.append((t1 - t0) * 1e3)
                latency.append((t2 - t0) * 1e3)
            eager = steady(lambda: module.attend(q, kv, gates))
            graphed = GraphedAttend(module, tiles=tiles)     # the variant's tiles as they are
            equal = torch.equal(graphed(q, kv, gates), module.attend(q, kv, gates))
            graph = next(iter(graphed._graphs.values())).graph
            row["variants"][label] = {"enqueue_ms": statistics.median(enqueue),
                                      "latency_ms": statistics.median(latency), "steady_ms": eager,
                                      "graphed_ms": steady(functools.partial(graphed, q, kv, gates)),
                                      "replay_ms": steady(graph.replay), "graphed_equal": equal}
            del graphed, graph      # its graph's memory, before the next variant's
            if k == 0 and profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(CALLS):
                    module.attend(q, kv, gates)
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                for key in ("tottime", "cumulative"):
                    pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
                atomic.write_text(os.path.join(OUT, f"{name}-{t}-{hq}-{hkv}.prof.txt"), text.getvalue())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("cells", nargs="*", default=["1024/64/4", "4096/64/4"], metavar="T/HQ/HKV")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FIELD=VALUE,...")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile tables (one file per cell)")
    args = ap.parse_args()
    variants = tile_variants(args.variant or ["tiles:"], triton_nsa.current_tiles("cuda"))
    res = {"gpu": torch.cuda.get_device_name(), "variants": args.variant, "cells": []}
    for spec in args.cells:
        row = cell(spec, args.name, variants, profile=not args.no_profile)
        res["cells"].append(row)
        print(spec, {k: {m: round(x, 3) for m, x in v.items()} for k, v in row["variants"].items()}, flush=True)
        atomic.write_text(os.path.join(OUT, f"{args.name}.json"), json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
