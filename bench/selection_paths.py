"""The selected branch's two Triton paths against each other, per GQA layout and T.

    python bench/selection_paths.py [--T 16384,65536] [--json out.json]

group-centric (selection.py: one program per (query, KV group), n blocks gathered per program)
against block-centric (selection_blocks.py: entries sorted by key block, each block loaded once
per chunk of the queries that chose it, partials combined), at 16/16 (G=1), 32/8 (G=4), 64/8
(G=8) and 64/4 (G=16) heads, D 128, bf16, B=1, the paper's l=32 d=16 l'=64 n=16, blocks chosen by the
Triton scores and top-n on random inputs. Every block-centric variant is checked against the
group-centric output (bf16 tolerance) before it is timed; the inversion alone (sort, counts,
chunk table) is timed too. Timing: bench.timing (CUDA events, L2 flushed, median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = ((16, 16), (32, 8), (64, 8), (64, 4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="16384,65536", help="comma-separated sequence lengths")
    ap.add_argument("--json", help="write medians and samples (ms) here")
    args = ap.parse_args(argv)

    import torch

    from bench.timing import Timer, measure
    from nsa import ops
    from nsa.backends import triton_nsa

    if not torch.cuda.is_available():
        print("selection_paths needs CUDA", file=sys.stderr)
        return 2
    dev, dt = "cuda", torch.bfloat16
    base = triton_nsa.current_tiles(dev)
    group_centric = dataclasses.replace(base, selb_max_group=0)
    variants = {f"block-centric rows{r} warps{w}": dataclasses.replace(base, selb_max_group=64, selb_min_rows=0,
                                                                      selb_rows=r, selb_warps=w)
                for r in (32, 64, 128) for w in (2, 4, 8)}
    timer = Timer(warmup_ms=25, rep_ms=200, min_rep=5, max_rep=20)
    report = []
    for t in (int(x) for x in args.T.split(",")):
        for hq, hkv in LAYOUTS:
            g = torch.Generator(device=dev).manual_seed(0)
            r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731, B023
            q, k, v = r(1, t, hq, 128), r(1, t, hkv, 128), r(1, t, hkv, 128)
            kc, vc = ops.compress_kv(k, v, block=32, stride=16)
            _, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64,
                                                         scale=128 ** -0.5)
            idx = triton_nsa.topn(scores, 0, sel_block=64, sel_count=16)
            del scores

            def run(tiles, q=q, k=k, v=v, idx=idx):
                with triton_nsa.use_tiles(tiles):
                    return ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton")

            def inversion(idx=idx, hkv=hkv, t=t):
                nbk = t // 64
                bh = torch.arange(hkv, device=dev, dtype=torch.int32)[None, None, :, None]
                key = torch.where(idx >= 0, bh * nbk + idx, hkv * nbk).flatten()
                _, order = torch.sort(key, stable=True)
                counts = torch.bincount(key, minlength=hkv * nbk + 1)
                return order, torch.cumsum(counts, 0)

            ref = run(group_centric)
            row = {"T": t, "Hq": hq, "Hkv": hkv, "median_ms": {}, "samples_ms": {}, "matches": {}}
            fns = {"group-centric": lambda: run(group_centric), "inversion only": inversion}
            for name, tiles in variants.items():
                try:
                    out = run(tiles)
                    row["matches"][name] = bool(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2))
                    fns[name] = (lambda tiles=tiles: run(tiles))
                except Exception as exc:  # noqa: BLE001 - a variant that cannot compile or fit is a result
                    row["matches"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            samples = measure(fns, timer)
            for name, s in samples.items():
                row["median_ms"][name] = statistics.median(s)
                row["samples_ms"][name] = s
            report.append(row)
            print(f"T={t} {hq}/{hkv}: " + " | ".join(f"{n} {m:.3f}" + ("" if row["matches"].get(n, True) is True
                                                                         else " WRONG")
                                                     for n, m in row["median_ms"].items()), flush=True)
            del q, k, v, kc, vc, idx, ref
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
