"""Before/after timing of the Triton kernels for a rewrite that must not change their speed
(issue 35's shared primitives: "no cell slower by more than 2%"). One process per tree: run it
with `PYTHONPATH` naming the tree's `nsa` first, alternating trees, then compare:

    PYTHONPATH=/path/to/before:. python lab/kernel_ab.py run before $OUT/ab-before-1.json
    PYTHONPATH=.                  python lab/kernel_ab.py run after  $OUT/ab-after-1.json
    ... (again, alternating) ...
    python lab/kernel_ab.py compare $OUT/ab-before-*.json -- $OUT/ab-after-*.json

Cells (bf16, the paper's layout 64/4 heads, D 128, l 32, d 16, l' 64, n 16, w 512), every branch
on the triton backend: the layer's prefill forward (no grad) at T = 8k and 64k, a training step
(forward and backward) at 8k and 32k, and the fused decode step (`triton_nsa.decode_step`, the
four kernels, replayed from a CUDA graph) at B = 8, t = 64k - 1 and B = 1, t = 8k - 1 on random caches. Each cell's time is
`triton.testing.do_bench`'s median (L2 flushed before each call); `compare` takes, per tree and
cell, the least of the runs' medians (drift between processes only slows a run) and prints
after / before.
"""

import json
import os
import sys

import torch
import triton


def cells():
    import nsa
    from nsa import NSAAttention, NSAConfig
    from nsa.backends import triton_nsa

    cfg = NSAConfig(dim=2560, n_heads=64, n_kv_heads=4, head_dim_qk=128, head_dim_v=128, cmp_block=32,
                    cmp_stride=16, sel_block=64, sel_count=16, window=512)
    torch.manual_seed(0)
    attn = NSAAttention(cfg, backend="triton").cuda().to(torch.bfloat16)
    dev, bf = "cuda", torch.bfloat16
    yield "tree", nsa.__file__
    for t in (8192, 65536):
        x = torch.randn(1, t, cfg.dim, device=dev, dtype=bf)

        def fwd(x=x):
            with torch.no_grad():
                return attn(x)
        yield f"prefill_fwd_T{t}", fwd
    for t in (8192, 32768):
        x = torch.randn(1, t, cfg.dim, device=dev, dtype=bf, requires_grad=True)
        dy = torch.randn_like(x)

        def train(x=x, dy=dy):
            attn.zero_grad(set_to_none=True)
            x.grad = None
            attn(x).backward(dy)
        yield f"train_T{t}", train
    for b, t in ((8, 65535), (1, 8191)):
        n = t + 1
        hq, hkv, d = 64, 4, 128
        q = torch.randn(b, 1, hq, d, device=dev, dtype=bf)
        gates = torch.rand(b, 1, hq, 3, device=dev, dtype=bf)
        nc = (n - 32) // 16 + 1
        kc, vc = (torch.randn(b, nc, hkv, d, device=dev, dtype=bf) for _ in range(2))
        ks, vs = (torch.randn(b, n, hkv, d, device=dev, dtype=bf) for _ in range(2))
        kw, vw = ks[:, n - 512:], vs[:, n - 512:]
        counts = triton_nsa.decode_counts(b * hkv, dev)

        def dec(q=q, gates=gates, kc=kc, vc=vc, ks=ks, vs=vs, kw=kw, vw=vw, t=t, counts=counts):
            return triton_nsa.decode_step(q, gates, kc, vc, ks, vs, kw, vw, t=t, block=32, stride=16, sel_block=64,
                                          sel_count=16, window=512, scale=cfg.softmax_scale, counts=counts)
        # From a CUDA graph: the kernels' GPU time, not the host's launches.
        dec()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec()
        yield f"decode_B{b}_t{t}", graph.replay


def run(label: str, path: str) -> None:
    out = {"label": label, "device": torch.cuda.get_device_name(), "cells": {}}
    for name, fn in cells():
        if name == "tree":
            out["tree"] = fn
            continue
        fn()
        torch.cuda.synchronize()
        out["cells"][name] = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")
        print(f"{label} {name}: {out['cells'][name]:.4f} ms", flush=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def compare(before: list[str], after: list[str]) -> None:
    def best(paths):
        runs = [json.load(open(p)) for p in paths]
        return {c: min(r["cells"][c] for r in runs) for c in runs[0]["cells"]}, runs[0]["device"]
    (b, dev), (a, _) = best(before), best(after)
    print(f"device: {dev}; least median of {len(before)} / {len(after)} runs")
    worst = 0.0
    for c in b:
        ratio = a[c] / b[c]
        worst = max(worst, ratio)
        print(f"{c:<22} before {b[c]:9.4f} ms  after {a[c]:9.4f} ms  after/before {ratio:.3f}")
    print(f"worst after/before: {worst:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        i = sys.argv.index("--")
        compare(sys.argv[2:i], sys.argv[i + 1:])
