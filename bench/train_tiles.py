"""Sweep the training kernels' launch parameters (`Tiles.trn_*`), each branch's forward + backward.

    python -m bench.train_tiles --T 16384,65536 --out train-tiles.json

Paper layout (64 query / 4 KV heads, D 128, bf16, B=1; l=32 d=16 l'=64 n=16 w=512). Each
variant replaces some `trn_*` fields of the device's `Tiles`; every branch is timed under it
(3 warm-up steps, `--rep` steps by CUDA events, raw samples kept). Variants run one after another
in one process, each branch's variants back to back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from bench.train_breakdown import event_samples

VARIANTS = {
    "base": {},
    "bm128_w8": {"trn_bm": 128, "trn_warps": 8},
    "bm128_w8_s3": {"trn_bm": 128, "trn_warps": 8, "trn_stages": 3},
    "bn128_w8": {"trn_bn": 128, "trn_warps": 8},
    "bm128_bn128_w8": {"trn_bm": 128, "trn_bn": 128, "trn_warps": 8},
    "s3": {"trn_stages": 3},
    "w8": {"trn_warps": 8},
    "sel_w4": {"trnsel_warps": 4},
    "sel_rows128_w8": {"trn_sel_rows": 128, "trn_warps": 8},
    "sel_chunk256": {"trn_sel_chunk": 256},
}


def _parts(t, q, k, v, kc, vc, idx, do, tiles, rep) -> list[dict]:
    """Each training kernel (family) alone, and the inference pass that finds the blocks."""
    from nsa.backends import triton_nsa
    from nsa.backends.triton_kernels import train

    q, k, v, kc, vc = (x.detach() for x in (q, k, v, kc, vc))
    sc = 128 ** -0.5
    idx = triton_nsa.distinct_blocks(idx)
    ow, lw = train.band_forward(q, k, v, mode=train.WIN, window=512, block=0, stride=0, scale=sc, q_start=0,
                                k_start=0, tiles=tiles)
    oc, lc = train.band_forward(q, kc, vc, mode=train.CMP, window=0, block=32, stride=16, scale=sc, q_start=0,
                                k_start=0, tiles=tiles)
    os_, ls = train.selected_forward(q, k, v, idx, sel_block=64, scale=sc, q_start=0, k_start=0, tiles=tiles)
    n_blocks = (t + 63) // 64
    parts = {
        "win_fwd": lambda: train.band_forward(q, k, v, mode=train.WIN, window=512, block=0, stride=0, scale=sc,
                                              q_start=0, k_start=0, tiles=tiles),
        "win_bwd": lambda: train.band_backward(do, q, k, v, ow, lw, mode=train.WIN, window=512, block=0, stride=0,
                                               scale=sc, q_start=0, k_start=0, tiles=tiles),
        "cmp_fwd": lambda: train.band_forward(q, kc, vc, mode=train.CMP, window=0, block=32, stride=16, scale=sc,
                                              q_start=0, k_start=0, tiles=tiles),
        "cmp_bwd": lambda: train.band_backward(do, q, kc, vc, oc, lc, mode=train.CMP, window=0, block=32, stride=16,
                                               scale=sc, q_start=0, k_start=0, tiles=tiles),
        "sel_fwd": lambda: train.selected_forward(q, k, v, idx, sel_block=64, scale=sc, q_start=0, k_start=0,
                                                  tiles=tiles),
        "sel_bwd": lambda: train.selected_backward(do, q, k, v, idx, os_, ls, sel_block=64, scale=sc, q_start=0,
                                                   k_start=0, tiles=tiles),
        "sel_invert": lambda: train.invert(idx, n_blocks=n_blocks, chunk=tiles.trn_sel_chunk),
        "select_inference_pass": lambda: triton_nsa.compressed_select(q, kc, vc, block=32, stride=16, sel_block=64,
                                                                      sel_count=16, scale=sc),
    }
    out = []
    for name, fn in parts.items():
        samples = event_samples(fn, rep)
        out.append({"T": t, "part": name, "ms_median": statistics.median(samples), "samples_ms": samples})
        print(f"T={t} part {name}: {statistics.median(samples):.2f} ms", flush=True)
    return out


def main() -> None:
    from nsa.backends.triton_kernels.tiles import current

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="65536")
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--parts", action="store_true", help="also time each training kernel alone (base tiles)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = current(torch.device("cuda"))
    rows = []
    for t in (int(x) for x in args.T.split(",")):
        _sweep(t, args, base, rows)


def _sweep(t: int, args: argparse.Namespace, base, rows: list[dict]) -> None:
    from nsa import ops
    from nsa.backends.triton_kernels.tiles import use_tiles

    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 64, 4, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, t, hq, d, device=dev, dtype=dt, generator=g).requires_grad_()
    k, v = (torch.randn(1, t, hkv, d, device=dev, dtype=dt, generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(1, t, hq, d, device=dev, dtype=dt, generator=g)
    with torch.no_grad():
        kc0, vc0 = ops.compress_kv(k, v, block=32, stride=16)
        idx = ops.select_blocks(q, kc0, block=32, stride=16, sel_block=64, sel_count=16)
    kc, vc = kc0.clone().requires_grad_(), vc0.clone().requires_grad_()
    branches = {
        "win": (lambda: ops.sliding_window_attention(q, k, v, window=512, backend="triton"), [q, k, v]),
        "cmp": (lambda: ops.compressed_attention(q, kc, vc, block=32, stride=16, backend="triton"), [q, kc, vc]),
        "sel": (lambda: ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton"), [q, k, v]),
    }
    if args.parts:
        rows.extend(_parts(t, q, k, v, kc, vc, idx, do, base, args.rep))
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)
    for branch, (fn, ins) in branches.items():
        for name, change in VARIANTS.items():
            if branch != "sel" and name.startswith("sel_"):
                continue
            tiles = dataclasses.replace(base, **change)
            try:
                with use_tiles(tiles):
                    samples = event_samples(lambda fn=fn, ins=ins: torch.autograd.grad(fn(), ins, do), args.rep)
            except Exception as exc:  # a tile the compiler refuses (shared memory): recorded
                rows.append({"T": t, "branch": branch, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"T={t} {branch} {name}: {type(exc).__name__}", flush=True)
                continue
            med = statistics.median(samples)
            rows.append({"T": t, "branch": branch, "variant": name, "change": change, "ms_median": med,
                         "samples_ms": samples})
            print(f"T={t} {branch} {name}: {med:.2f} ms", flush=True)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()
