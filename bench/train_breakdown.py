"""Training step (forward + backward) of NSA attention, whole and per branch, beside dense attention.

    python -m bench.train_breakdown --T 8192,16384,65536 --layouts 64/4 --out train.json

Per (layout, T): `nsa` = `NSAAttention.attend` under gradients (what `auto` plans for training),
its branches alone (`win`, `cmp`, `sel`, each on the plan's backend; `sel` with blocks chosen
outside the timed call), and dense causal attention through SDPA's cuDNN and flash (torch FA-2)
backends, GQA by `enable_gqa`. bf16, B=1, D 128, l=32 d=16 l'=64 n=16 w=512. Each variant: 3
warm-up steps, then `--rep` steps timed by CUDA events, raw samples kept; peak memory of one
step beside. The `bench run --suites train` cells are the pipeline's; this is the breakdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def event_samples(fn, rep: int, warmup: int = 3) -> list[float]:
    """`warmup` untimed calls, then `rep` calls each timed by a pair of CUDA events (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return samples


def _time(fn, rep: int) -> tuple[list[float], float]:
    """Raw samples after 3 warm-up calls, and the peak memory (GiB) of one call before them."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return event_samples(fn, rep, warmup=0), peak


def cell(hq: int, hkv: int, t: int, rep: int, d: int = 128) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa import NSAAttention, NSAConfig, ops

    dev, dt = "cuda", torch.bfloat16
    cfg = NSAConfig(dim=hq * d, n_heads=hq, n_kv_heads=hkv, head_dim_qk=d, head_dim_v=d)
    m = NSAAttention(cfg).to(dev, dt).requires_grad_(False)
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g).requires_grad_()

    q = leaf(1, t, hq, d)
    kv = {n: (leaf(1, t, hkv, d), leaf(1, t, hkv, d)) for n in ("cmp", "sel", "win")}
    gates = torch.rand(1, t, hq, 3, device=dev, dtype=dt, generator=g).requires_grad_()
    do = torch.randn(1, t, hq, d, device=dev, dtype=dt, generator=g)
    ins = [q, gates, *(x for p in kv.values() for x in p)]
    out: dict = {"Hq": hq, "Hkv": hkv, "T": t, "variants": {}}

    def step(fn, inputs):
        def run():
            o = fn()
            torch.autograd.grad(o, inputs, do)
        return run

    with torch.no_grad():
        kc, vc = ops.compress_kv(*kv["cmp"], block=cfg.cmp_block, stride=cfg.cmp_stride)
        idx = ops.select_blocks(q, kc, block=cfg.cmp_block, stride=cfg.cmp_stride, sel_block=cfg.sel_block,
                                sel_count=cfg.sel_count)
    plan = m.plan(q, kv)
    out["plan"] = plan.label
    variants = {
        "nsa": step(lambda: m.attend(q, kv, gates), ins),
        "win": step(lambda: ops.sliding_window_attention(q, *kv["win"], window=cfg.window,
                                                         backend=plan.backend("win")), [q, *kv["win"]]),
        "cmp": step(lambda: ops.compressed_attention(q, *ops.compress_kv(*kv["cmp"], block=cfg.cmp_block,
                                                                          stride=cfg.cmp_stride),
                                                      block=cfg.cmp_block, stride=cfg.cmp_stride,
                                                      backend=plan.backend("cmp")), [q, *kv["cmp"]]),
        "sel": step(lambda: ops.selected_attention(q, *kv["sel"], idx, sel_block=cfg.sel_block,
                                                   backend=plan.backend("sel")), [q, *kv["sel"]]),
    }
    if "--win-fa2" in sys.argv:
        variants["win_torch_fa2"] = step(lambda: ops.sliding_window_attention(q, *kv["win"], window=cfg.window,
                                                                              backend="torch_fa2"), [q, *kv["win"]])
    qd = q.detach().transpose(1, 2).requires_grad_()
    kd, vd = (x.detach().transpose(1, 2).requires_grad_() for x in kv["win"])
    for name, be in (("dense_cudnn", SDPBackend.CUDNN_ATTENTION), ("dense_flash", SDPBackend.FLASH_ATTENTION)):
        def dense(be=be):
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        variants[name] = (lambda dense=dense: torch.autograd.grad(dense(), [qd, kd, vd], do.transpose(1, 2)))
    for name, fn in variants.items():
        try:
            samples, peak = _time(fn, rep)
        except Exception as exc:  # out of memory or a backend refusing: recorded, not hidden
            out["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            torch.cuda.empty_cache()
            continue
        out["variants"][name] = {"ms_median": statistics.median(samples), "samples_ms": samples, "peak_gib": peak}
        print(f"{hq}/{hkv} T={t} {name}: {statistics.median(samples):.2f} ms, peak {peak:.2f} GiB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="8192,16384,65536")
    ap.add_argument("--layouts", default="64/4")
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--win-fa2", action="store_true", help="also time the window on torch's FA-2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cells = []
    for lay in args.layouts.split(","):
        hq, hkv = (int(x) for x in lay.split("/"))
        for t in (int(x) for x in args.T.split(",")):
            cells.append(cell(hq, hkv, t, args.rep))
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cells": cells}, f)


if __name__ == "__main__":
    main()
