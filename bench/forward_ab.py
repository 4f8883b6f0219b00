"""`python -m bench forward-ab`: the whole NSA forward under several `Tiles` variants, A/B in one process.

    python -m bench forward-ab --out out/selb-forced.json \\
        --variant lists:selb_forced_min_group=0 --variant forced: [T/HQ/HKV[/DK] ...]

Each variant runs `NSAAttention.attend` (what `backend="auto"` runs) with its tiles, on the same
random inputs (bf16, seed 0, the paper's block sizes, one K/V per branch as the fast suite), timed
interleaved by `bench.timing.measure` (CUDA events, L2 flushed before each repeat), so the
variants share the machine's state and drift. A variant is `LABEL:FIELD=VALUE,FIELD=VALUE` (no
fields: the device's tiles); the first is the reference of `rel_diff` (each variant's output
against it; 0 when the same kernels run). Cells default to 32/8 and 16/16 heads at 16k and 64k.
The JSON (medians and raw samples, ms, with the GPU and the FA-3 / FA-4 wheel versions) is
rewritten atomically after each cell, so a run cut short keeps the cells it finished.
results/h100/selb-forced/ and results/h100/wheel-floors/ hold runs of it.

Needs a CUDA GPU. Exit codes: 0 done; 2 bad input (a variant or cell that does not parse, an
unknown `Tiles` field, no CUDA), with a message saying how to fix it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

CELLS = ("16384/32/8", "65536/32/8", "16384/16/16", "65536/16/16")
DV = 128


def tile_changes(pairs: Sequence[str], base: Any) -> dict[str, Any]:
    """`NAME=VALUE` pairs -> `Tiles` field changes, typed like the field's current value."""
    # `Tiles.flat()` names every flat field (a family's name is an attribute too, but not a field).
    fields = set(base.flat()) if callable(getattr(base, "flat", None)) else {f.name for f in dataclasses.fields(base)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"a tile change must be NAME=VALUE with NAME a Tiles field, got {pair!r}; "
                             "see nsa/profiles/tiles.py for the fields")
        cur = getattr(base, name)
        if isinstance(cur, bool):
            if raw not in ("True", "False"):
                raise ValueError(f"Tiles.{name} must be True or False, got {raw!r}")
            out[name] = raw == "True"
        elif isinstance(cur, int) or cur is None:
            try:
                out[name] = None if raw == "None" else int(raw)
            except ValueError:
                raise ValueError(f"Tiles.{name} must be an int (or None), got {raw!r}") from None
        else:
            out[name] = raw
    return out


def variants(specs: Sequence[str], base: Any) -> dict[str, Any]:
    """`LABEL:FIELD=VALUE,...` -> {label: Tiles}, in the order given."""
    out: dict[str, Any] = {}
    for spec in specs:
        label, _, fields = spec.partition(":")
        if not label or label in out:
            raise ValueError(f"--variant must be a new LABEL:FIELD=VALUE,..., got {spec!r}; labels must differ")
        out[label] = dataclasses.replace(base, **tile_changes([p for p in fields.split(",") if p], base))
    return out


def parse_cell(cell: str) -> tuple[int, int, int, int]:
    """`T/HQ/HKV[/DK]` -> (T, Hq, Hkv, dk); dk defaults to 128."""
    try:
        t, hq, hkv, *rest = (int(x) for x in cell.split("/"))
    except ValueError:
        raise ValueError(f"a cell must be T/HQ/HKV[/DK] in integers, got {cell!r}; e.g. 65536/32/8") from None
    if len(rest) > 1 or min(t, hq, hkv, *rest) < 1 or hq % hkv:
        raise ValueError(f"a cell must be T/HQ/HKV[/DK] with positive sizes and HKV dividing HQ, got {cell!r}")
    return t, hq, hkv, rest[0] if rest else 128


def run_cell(cell: str, tiles: dict[str, Any], rep_ms: float) -> dict[str, Any]:
    """One cell: every variant's output against the first's, then their interleaved timings."""
    import torch

    from bench.timing import Timer, measure
    from nsa import NSAAttention, NSAConfig
    from nsa.backends import triton_nsa

    t, hq, hkv, dk = parse_cell(cell)
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

    q = r(1, t, hq, dk)
    kv = {n: (r(1, t, hkv, dk), r(1, t, hkv, DV)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    module = NSAAttention(NSAConfig(dim=256, n_heads=hq, n_kv_heads=hkv, head_dim_qk=dk, head_dim_v=DV)).cuda()

    def under(tl: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with triton_nsa.use_tiles(tl):
                return module.attend(q, kv, gates)
        return run

    fns = {name: under(tl) for name, tl in tiles.items()}
    with torch.no_grad():
        ref = next(iter(fns.values()))().double()
        diff = {name: float((fn().double() - ref).norm() / ref.norm()) for name, fn in fns.items()}
        samples = measure(fns, Timer(warmup_ms=50, rep_ms=rep_ms, min_rep=10, max_rep=60))
    return {"T": t, "heads": hq, "kv_heads": hkv, "dk": dk, "dv": DV, "rel_diff": diff,
            "median_ms": {k: statistics.median(v) for k, v in samples.items()}, "samples_ms": samples}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench forward-ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write (rewritten after each cell)")
    ap.add_argument("--variant", action="append", required=True, metavar="LABEL:FIELD=VALUE,...",
                    help="a Tiles variant; give two or more, the first is the reference")
    ap.add_argument("--rep-ms", type=float, default=400.0, help="repeat budget per variant and cell, ms (10-60 repeats)")
    ap.add_argument("cells", nargs="*", default=list(CELLS), metavar="T/HQ/HKV[/DK]")
    args = ap.parse_args(argv)
    try:
        for cell in args.cells:
            parse_cell(cell)
        import torch

        if not torch.cuda.is_available():
            raise ValueError("forward-ab times CUDA kernels and needs a CUDA GPU, got none; run it on a GPU machine")
        from bench.machine import dist_version
        from nsa.backends import triton_nsa
        from nsa_contract import atomic

        tiles = variants(args.variant, triton_nsa.current_tiles("cuda"))
        report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "fa3": dist_version("fa3-fwd")[0],
                                  "fa4": dist_version("flash-attn-4")[0], "variants": args.variant, "cells": []}
        for cell in args.cells:
            row = run_cell(cell, tiles, args.rep_ms)
            report["cells"].append(row)
            print(cell, {k: f"{v:.1e}" for k, v in row["rel_diff"].items()},
                  {k: round(v, 3) for k, v in row["median_ms"].items()}, flush=True)
            atomic.write_text(args.out, json.dumps(report, indent=1))
            torch.cuda.empty_cache()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
