"""The whole NSA forward with the prefill window on FlashAttention-4 against the Triton band kernel
(H100, the `flash-attn-4` wheel installed; the `fa3-fwd` wheel too, as `auto` uses it).

Variants per cell, timed interleaved by `bench.timing.measure` (CUDA events, L2 flushed before
each repeat), all through `NSAAttention.attend` (what `backend="auto"` runs):

* `band`: `Tiles.win_fa4` off (the window on the band kernel, beside the chain up to
  `win_beside_rows` query rows);
* `fa4`: the default tiles (the window on FA-4, beside likewise);
* `band_in_order`, `fa4_in_order`: the same with `Tiles.win_beside` off.

`rel_diff` is the relative difference of each variant's output to `band` (the two window kernels
round differently; the same kernels give 0). Cells: 64/4 at 8k..128k, 32/8 and 16/16 at 16k and
64k, 64/4 with the paper's dk 192 / dv 128 at 16k and 64k; bf16, the paper's block sizes,
random inputs (seed 0).

    PYTHONPATH=$PWD OUT=<dir> [REP_MS=400] python3 lab/fa4_forward.py [T/HQ/HKV[/DK] ...]

writes `$OUT/fa4-forward.json`.
"""
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.machine import dist_version
from bench.timing import Timer, measure
from ci import atomic
from nsa import NSAAttention, NSAConfig
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import fa4_win

OUT = os.environ.get("OUT", "/tmp")
CELLS = ["8192/64/4", "16384/64/4", "32768/64/4", "65536/64/4", "131072/64/4", "16384/32/8", "65536/32/8",
         "16384/16/16", "65536/16/16", "16384/64/4/192", "65536/64/4/192"]


def run_cell(cell: str) -> dict:
    t, hq, hkv, *rest = (int(x) for x in cell.split("/"))
    dk = rest[0] if rest else 128
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, dk)
    kv = {n: (r(1, t, hkv, dk), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=dk, head_dim_v=128)).cuda()
    base = triton_nsa.current_tiles("cuda")
    tiles = {"band": dataclasses.replace(base, win_fa4=False), "fa4": base,
             "band_in_order": dataclasses.replace(base, win_fa4=False, win_beside=False),
             "fa4_in_order": dataclasses.replace(base, win_beside=False)}

    def under(tl):
        def run():
            with triton_nsa.use_tiles(tl):
                return module.attend(q, kv, gates)
        return run

    fns = {name: under(tl) for name, tl in tiles.items()}
    with torch.no_grad():
        ref = fns["band"]().double()
        diff = {}
        for name, fn in fns.items():
            out = fn().double()
            diff[name] = float((out - ref).norm() / ref.norm())
        samples = measure(fns, Timer(warmup_ms=50, rep_ms=float(os.environ.get("REP_MS", 400)), min_rep=10,
                                     max_rep=60))
    return {"T": t, "heads": hq, "kv_heads": hkv, "dk": dk, "dv": 128,
            "fa4_usable": fa4_win.usable(q, *kv["win"], window=512, q_start=0, k_start=0), "rel_diff": diff,
            "median_ms": {k: statistics.median(v) for k, v in samples.items()}, "samples_ms": samples}


def main() -> None:
    cells = sys.argv[1:] or CELLS
    res = {"gpu": torch.cuda.get_device_name(), "fa4": dist_version("flash-attn-4")[0],
           "fa3": dist_version("fa3-fwd")[0], "cells": []}
    for cell in cells:
        row = run_cell(cell)
        res["cells"].append(row)
        print(cell, row["fa4_usable"], {k: f"{v:.1e}" for k, v in row["rel_diff"].items()},
              {k: round(v, 3) for k, v in row["median_ms"].items()}, flush=True)
        atomic.write_text(os.path.join(OUT, "fa4-forward.json"), json.dumps(res, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
