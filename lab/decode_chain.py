"""Where one fused decode step's time goes along its chain of four launches (decode.py: A ->
B -> C -> D, B..D by programmatic dependent launch), for several `Tiles` variants: each variant's
step is timed whole and cut after A, after B and after C (the later kernels replaced by no-ops
while the graph is captured), so the differences are what each kernel adds to the chain, waits
included. The issue's decode layout: B = 8 sequences, one query at t = S - 1, 64 query / 4 KV
heads, D 128, bf16, paper block sizes, random inputs (seed 0), CUDA graphs, L2 flushed between
repeats (bench/timing.py). Every variant's blocks are checked equal to the default's, and its
output against the default's, before anything is timed. Whole steps share one kept counts
buffer (`triton_nsa.decode_counts`, as NSACache keeps one; steps leave it zero); a cut step
leaves counts behind, so it gets a fresh one, whose zeroing kernel is in the cut's time.

Needs a CUDA GPU. From the repo root:

    python3 lab/decode_chain.py --S 8192,65536 --json decode-chain.json

`--prev FILE` also times an earlier copy of decode.py (`git show REV:nsa/backends/triton_kernels/decode.py`)
in the same process, with its own kept counts buffer where its decode_step takes one (earlier
versions of this script gave `prev` fresh counts, so its whole step also timed a zeroing kernel:
`results/README.md` says which files that affects).
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.nsa_breakdown import decode_inputs
from bench.timing import Timer, measure
from ci import atomic
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import decode as dec
from nsa.backends.triton_kernels.tiles import Tiles, current, use_tiles

VARIANTS: list[dict] = [{}, {"dtop_warps": 8}, {"dec_warps": 8}, {"dec_warps": 2}]
KERNELS = ("_dec_topn", "_dec_blocks", "_dec_out")   # what a cut after A, B, C replaces


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _cut(module, after: int):
    """Kernels of decode `module` after the `after`-th (1 = A) do not launch."""
    saved = {name: getattr(module, name) for name in KERNELS}
    try:
        for name in KERNELS[after - 1:]:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _cell(t: int, b: int, dev: str, base: Tiles, variants: list[dict], prev, gpu: str) -> dict | None:
    """One cache length: every run's step and its cuts timed together; None if a run's blocks
    differ from the default's."""
    q, gates, k, v, kc, vc = decode_inputs(t, b, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    kw, vw = k[:, -512:], v[:, -512:]

    kept = triton_nsa.decode_counts(b * 4, dev)   # as NSACache keeps one: whole steps leave it zero
    # An earlier decode.py that takes a kept buffer gets its own, in its own format: a whole step
    # with fresh counts would time a zeroing kernel the current one does not run (~1.5 us).
    prev_kept = (prev._counts(b * 4, torch.device(dev))
                 if prev is not None and "counts" in inspect.signature(prev.decode_step).parameters else None)

    def step(tiles: Tiles, after: int = 4, module=dec):
        def fn():
            kw_args = dict(t=t - 1, block=32, stride=16, sel_block=64, sel_count=16, window=512,
                           scale=128 ** -0.5)
            with use_tiles(tiles), _cut(module, after):
                if module is dec:   # a cut step leaves its counts behind: it gets fresh ones
                    return triton_nsa.decode_step(q, gates, kc, vc, k, v, kw, vw, **kw_args,
                                                  counts=kept if after == 4 else None)
                extra = {"counts": prev_kept if after == 4 else None} if prev_kept is not None else {}
                return module.decode_step(q, gates, kc, vc, k, v, kw, vw, tiles=tiles, **kw_args, **extra)
        return fn

    ref_out, ref_idx = step(base)()
    fns, checks = {}, {}
    runs = [(str(i), dataclasses.replace(base, **over), dec) for i, over in enumerate(variants)]
    runs += [("prev", base, prev)] if prev is not None else []
    for key, tiles, module in runs:
        out, idx = step(tiles, module=module)()
        checks[key] = {"blocks_equal": bool(torch.equal(idx, ref_idx)),
                       "max_abs_diff": float((out.float() - ref_out.float()).abs().max())}
        if not checks[key]["blocks_equal"]:
            print(f"S={t} variant {key}: blocks differ from the default's", file=sys.stderr)
            return None
        for after, name in ((1, "A"), (2, "A+B"), (3, "A+B+C"), (4, "step")):
            fns[f"{key}:{name}"] = step(tiles, after, module)
    samples = measure(fns, Timer(warmup_ms=25, rep_ms=300, cuda_graph=dev == "cuda"), device=dev)
    med = {key: statistics.median(x) * 1000 for key, x in samples.items()}
    print(f"S={t} B={b} ({gpu}), CUDA graphs, us: A | +B | +C | +D = step")
    for key, _, _ in runs:
        a, ab, abc, st = (med[f"{key}:{n}"] for n in ("A", "A+B", "A+B+C", "step"))
        label = "prev" if key == "prev" else json.dumps(variants[int(key)])
        print(f"  {label:50s} {a:6.1f} | {ab - a:5.1f} | {abc - ab:5.1f} | {st - abc:5.1f} = {st:6.1f}"
              f"   (max |out - default| {checks[key]['max_abs_diff']:.2e})")
    return {"S": t, "median_us": med, "checks": checks, "samples_ms": samples}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", default="8192,65536", help="cache lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default=None, help="JSON list of Tiles overrides (default: VARIANTS)")
    ap.add_argument("--prev", default=None, help="also time this copy of an earlier decode.py (same kernel "
                    "names), called directly with the default tiles, as variant 'prev'")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a check of the script under TRITON_INTERPRET=1 (fp32)")
    args = ap.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    prev = None
    if args.prev:
        spec = importlib.util.spec_from_file_location("decode_prev", args.prev)
        prev = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prev)
    dev, b = args.device, args.batch
    base = current(dev)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    report = {"gpu": gpu, "batch": b, "variants": variants, "cells": []}
    for t in (int(x) for x in args.S.split(",")):
        cell = _cell(t, b, dev, base, variants, prev, report["gpu"])
        if cell is None:
            return 1
        report["cells"].append(cell)
    if args.json:
        atomic.write_text(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
