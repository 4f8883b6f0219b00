"""Host time of the whole NSA forward (`NSAAttention.attend`, what `backend="auto"` runs) at short
lengths, where the GPU waits on the host: per call, the host's enqueue time (the call returns
before the GPU is done) against the time to the GPU's end, both medians of back-to-back calls,
then a cProfile of the enqueue over the same calls (functions by own time and by cumulative time).
Same inputs as `forward_ab.py` (bf16, seed 0, paper block sizes, one K/V per branch).

    PYTHONPATH=$PWD OUT=<dir> python3 bench/experiments/host_profile.py NAME [T/HQ/HKV ...]

Writes `$OUT/NAME.json` (medians, ms) and `$OUT/NAME-T-HQ-HKV.prof.txt` (the two cProfile tables).
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
import torch

from ci import atomic
from nsa import NSAAttention, NSAConfig

OUT = os.environ.get("OUT", "/tmp")
CALLS = 60


def cell(spec: str, name: str) -> dict:
    t, hq, hkv = (int(x) for x in spec.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, 128)
    kv = {n: (r(1, t, hkv, 128), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=128, head_dim_v=128)).cuda()
    enqueue, total = [], []
    with torch.no_grad():
        for _ in range(10):                      # compile and warm up
            module.attend(q, kv, gates)
        torch.cuda.synchronize()
        for _ in range(CALLS):
            t0 = time.perf_counter()
            module.attend(q, kv, gates)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            enqueue.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
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
    return {"T": t, "heads": hq, "kv_heads": hkv, "calls": CALLS, "enqueue_ms": statistics.median(enqueue),
            "to_gpu_end_ms": statistics.median(total)}


def main() -> None:
    name, cells = sys.argv[1], sys.argv[2:] or ["1024/64/4", "4096/64/4"]
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for spec in cells:
        row = cell(spec, name)
        res["cells"].append(row)
        print(spec, row, flush=True)
        atomic.write_text(os.path.join(OUT, f"{name}.json"), json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
