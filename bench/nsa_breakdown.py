"""Where the fast NSA prefill spends its time: each stage timed alone (CUDA events, bench.timing).

    python bench/nsa_breakdown.py --T 65536 [--json out.json]
    python bench/nsa_breakdown.py --T 65536 --decode-batch 8     # one decode step's stages

Stages: avg compression, the Triton compressed+scores kernels (default: one-pass output + log-sum-exp, then
the scores kernel; and the earlier two-pass kernel), top-n (Triton, and the torch rule),
the Triton selection kernel (alone, and with the gated-sum epilogue), sliding (FA-2, the Triton band kernel, and
FA-4 where the flash-attn-4 wheel is installed), the torch
gated sum, the whole forward as the fast suite times it; and dense causal FA-2 / cuDNN for scale. Paper layout
(64 query / 4 KV heads unless --heads/--kv-heads, D 128, l=32 d=16 l'=64 n=16 w=512), bf16, B=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


PARAMS = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=64, help="query heads (prefill; default the paper's 64)")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads (prefill; 16/16 is GQA 1, 32/8 GQA 4)")
    ap.add_argument("--json", help="write the medians (ms) here")
    ap.add_argument("--kernels", action="store_true",
                    help="prefill: only the whole forward's per-kernel device times (torch.profiler), no stages")
    ap.add_argument("--tile", action="append", default=[], metavar="NAME=VALUE",
                    help="with --kernels: run with this Tiles field changed (repeatable), e.g. cmp_fa3=False")
    ap.add_argument("--trace", help="with --kernels: also write a Chrome trace (CPU and CUDA) of two forwards here")
    ap.add_argument("--zeroed-scores", action="store_true",
                    help="with --kernels: the forward through compressed_and_scores + topn (zeroed scores, atomic "
                         "key-tile edges) instead of compressed_select, for an A/B")
    ap.add_argument("--decode-batch", type=int, default=0,
                    help="instead: one decode step at t = T - 1 for this many sequences, each stage in a CUDA graph")
    args = ap.parse_args(argv)
    if args.decode_batch:
        return _decode(args)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.suites.fast import nsa_triton
    from bench.timing import Timer, measure
    from nsa import ops
    from nsa.backends import triton_nsa
    from nsa.backends.triton_kernels import fa4_win
    from nsa.selection import select_from_scores

    if not torch.cuda.is_available():
        print("nsa_breakdown needs CUDA", file=sys.stderr)
        return 2

    def _band(fn):   # the band kernel even where FA-4 is installed (Tiles.win_fa4)
        with triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles("cuda"), win_fa4=False)):
            return fn()

    dev, dt, t = "cuda", torch.bfloat16, args.T
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731
    if args.heads % args.kv_heads:
        print(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}", file=sys.stderr)
        return 2
    q = r(1, t, args.heads, 128)
    k, v = r(1, t, args.kv_heads, 128), r(1, t, args.kv_heads, 128)
    gates = torch.sigmoid(r(1, t, args.heads, 3))
    kc, vc = ops.compress_kv(k, v, block=32, stride=16)
    o_cmp, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5)
    idx = triton_nsa.topn(scores, 0, sel_block=64, sel_count=16)
    o_sel = ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton")
    o_win = ops.sliding_window_attention(q, k, v, window=512, backend="fa2")

    def dense(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
        return fn

    if args.kernels and args.zeroed_scores:
        def zeroed():
            kc, vc = ops.compress_kv(k, v, block=32, stride=16)
            o_cmp, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64,
                                                             scale=128 ** -0.5)
            idx = triton_nsa.topn(scores, 0, sel_block=64, sel_count=16)
            o_win = ops.sliding_window_attention(q, k, v, window=512, backend="triton")
            return triton_nsa.selected_gated(q, k, v, idx, sel_block=64, scale=128 ** -0.5, gates=gates,
                                             o_cmp=o_cmp, o_win=o_win)
        return _prefill_kernels(args, zeroed)
    if args.kernels:
        return _prefill_kernels(args, lambda: nsa_triton(q, {"cmp": (k, v), "sel": (k, v), "win": (k, v)}, gates,
                                                         PARAMS, win_backend="triton"))

    two_pass = dataclasses.replace(triton_nsa.current_tiles(dev), cmp_lse=False)

    def _two_pass(fn):   # the earlier path: compressed + scores in one two-pass kernel
        with triton_nsa.use_tiles(two_pass):
            return fn()

    stages = {
        "compress_kv (avg)": lambda: ops.compress_kv(k, v, block=32, stride=16),
        "cmp attention + scores (triton)": lambda: triton_nsa.compressed_and_scores(
            q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5),
        "cmp attention only (triton)": lambda: triton_nsa.compressed_and_scores(
            q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5, scores=False),
        "cmp attention + scores (two-pass kernel)": lambda: _two_pass(lambda: triton_nsa.compressed_and_scores(
            q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5)),
        "top-n (triton)": lambda: triton_nsa.topn(scores, 0, sel_block=64, sel_count=16),
        "top-n (torch, select_from_scores)": lambda: select_from_scores(scores, 0, sel_block=64, sel_count=16),
        "selected attention (triton)": lambda: ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton"),
        "sliding w=512 (fa2)": lambda: ops.sliding_window_attention(q, k, v, window=512, backend="fa2"),
        "sliding w=512 (triton band kernel)": lambda: _band(lambda: ops.sliding_window_attention(
            q, k, v, window=512, backend="triton")),
        **({"sliding w=512 (fa4)": lambda: fa4_win.sliding(q, k, v, window=512, scale=128 ** -0.5)}
           if fa4_win.usable(q, k, v, window=512, q_start=0, k_start=0) else {}),
        "gated sum (torch)": lambda: gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win,
        "selected + gated sum (triton)": lambda: triton_nsa.selected_gated(
            q, k, v, idx, sel_block=64, scale=128 ** -0.5, gates=gates, o_cmp=o_cmp, o_win=o_win),
        "NSA forward total (bench.suites.fast)": lambda: nsa_triton(q, {"cmp": (k, v), "sel": (k, v), "win": (k, v)},
                                                                    gates, PARAMS),
        "dense causal FA-2": dense(SDPBackend.FLASH_ATTENTION),
        "dense causal cuDNN": dense(SDPBackend.CUDNN_ATTENTION),
    }
    samples = measure(stages, Timer(warmup_ms=50, rep_ms=300, min_rep=5, max_rep=50))
    med = {name: statistics.median(s) for name, s in samples.items()}
    print(f"T={t} heads {args.heads}/{args.kv_heads} ({torch.cuda.get_device_name()})")
    for name, ms in med.items():
        print(f"  {name:34s} {ms:9.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"T": t, "heads": args.heads, "kv_heads": args.kv_heads, "gpu": torch.cuda.get_device_name(),
                       "median_ms": med, "samples_ms": samples}, fh, indent=1)
    return 0


def decode_inputs(t: int, b: int, device: str, dtype):
    """The issue's decode layout, random (seed 0): q `[b, 1, 64, 128]`, gates `[b, 1, 64, 3]`, one
    raw K/V `[b, t, 4, 128]` for every branch and its compressed K/V (l 32, d 16). Shared with
    lab/decode_chain.py, so both time the same inputs."""
    import torch

    from nsa import ops

    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    q, gates = r(b, 1, 64, 128), torch.sigmoid(r(b, 1, 64, 3))
    k, v = r(b, t, 4, 128), r(b, t, 4, 128)
    kc, vc = ops.compress_kv(k, v, block=32, stride=16)
    return q, gates, k, v, kc, vc


def _decode(args) -> int:
    """Decode stages at t = T - 1 for B sequences (the decode suite's target layout), CUDA graphs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.timing import Timer, measure
    from nsa import ops
    from nsa.backends import triton_nsa

    if not torch.cuda.is_available():
        print("nsa_breakdown needs CUDA", file=sys.stderr)
        return 2
    dev, t, b = "cuda", args.T, args.decode_batch
    q, gates, k, v, kc, vc = decode_inputs(t, b, dev, torch.bfloat16)
    s0 = t - 1
    o_cmp, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64,
                                                     scale=128 ** -0.5, q_start=s0)
    idx = triton_nsa.topn(scores, s0, sel_block=64, sel_count=16)
    o_sel = ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton", q_start=s0)
    kw, vw = k[:, -512:], v[:, -512:]
    o_win = ops.sliding_window_attention(q, kw, vw, window=512, backend="sdpa", q_start=s0, k_start=t - 512)

    def dense(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      enable_gqa=True)
        return fn

    stages = {
        "cmp attention + scores (triton split)": lambda: triton_nsa.compressed_and_scores(
            q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5, q_start=s0),
        "cmp attention only (triton split)": lambda: triton_nsa.compressed_and_scores(
            q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5, q_start=s0, scores=False),
        "top-n (triton)": lambda: triton_nsa.topn(scores, s0, sel_block=64, sel_count=16),
        "selected attention (triton)": lambda: ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton",
                                                                      q_start=s0),
        "sliding w=512 (sdpa)": lambda: ops.sliding_window_attention(q, kw, vw, window=512, backend="sdpa",
                                                                     q_start=s0, k_start=t - 512),
        "sliding w=512 (triton window blocks)": lambda: triton_nsa.sliding_decode(q, kw, vw, t=s0,
                                                                                  scale=128 ** -0.5),
        "sliding w=512 (triton band kernel)": lambda: ops.sliding_window_attention(
            q, kw, vw, window=512, backend="triton", q_start=s0, k_start=t - 512),
        "gated sum (torch)": lambda: gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win,
        "selected + gated sum (triton, split)": lambda: triton_nsa.selected_gated(
            q, k, v, idx, sel_block=64, scale=128 ** -0.5, gates=gates, o_cmp=o_cmp, o_win=o_win, q_start=s0),
        "whole step, separate ops (the dec_fused=False path)": lambda: _separate_step(
            triton_nsa, q, gates, kc, vc, k, v, kw, vw, s0),
        "whole step, fused (triton_nsa.decode_step)": lambda: triton_nsa.decode_step(
            q, gates, kc, vc, k, v, kw, vw, t=s0, block=32, stride=16, sel_block=64, sel_count=16, window=512,
            scale=128 ** -0.5),
        "dense decode FA-2": dense(SDPBackend.FLASH_ATTENTION),
        "dense decode cuDNN": dense(SDPBackend.CUDNN_ATTENTION),
    }
    fused_out, fused_idx = stages["whole step, fused (triton_nsa.decode_step)"]()
    sep_out, sep_idx = stages["whole step, separate ops (the dec_fused=False path)"]()
    agree = {"blocks_equal": bool(torch.equal(fused_idx, sep_idx)),
             "max_abs_diff": float((fused_out.float() - sep_out.float()).abs().max())}
    print(f"fused vs separate step: {agree}")
    samples = measure(stages, Timer(warmup_ms=25, rep_ms=200, cuda_graph=True))
    kernels = _kernel_times(stages["whole step, fused (triton_nsa.decode_step)"])
    med = {name: statistics.median(x) for name, x in samples.items()}
    print(f"decode B={b} t={s0} ({torch.cuda.get_device_name()}), CUDA graphs")
    for name, ms in med.items():
        print(f"  {name:40s} {ms * 1000:9.1f} us")
    print("fused step, per kernel (profiler over graph replays):")
    for name, us in kernels.items():
        print(f"  {name:40s} {us:9.1f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"T": t, "B": b, "decode": True, "gpu": torch.cuda.get_device_name(), "median_ms": med,
                       "fused_vs_separate": agree, "fused_kernels_us": kernels, "samples_ms": samples}, fh, indent=1)
    return 0


def _separate_step(triton_nsa, q, gates, kc, vc, k, v, kw, vw, s0):
    """The step as NSAAttention.decode_attend runs it with Tiles.dec_fused off: (output, blocks)."""
    o_cmp, scores = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5,
                                                     q_start=s0)
    idx = triton_nsa.topn(scores, s0, sel_block=64, sel_count=16)
    o_win = triton_nsa.sliding_decode(q, kw, vw, t=s0, scale=128 ** -0.5)
    out = triton_nsa.selected_gated(q, k, v, idx, sel_block=64, scale=128 ** -0.5, gates=gates, o_cmp=o_cmp,
                                    o_win=o_win, q_start=s0)
    return out, idx


def _tile_changes(pairs: list[str], base) -> dict:
    """`--tile NAME=VALUE` pairs -> Tiles field changes (bench.forward_ab.tile_changes); a bad pair exits."""
    from bench.forward_ab import tile_changes

    try:
        return tile_changes(pairs, base)
    except ValueError as exc:
        raise SystemExit(f"--tile: {exc}") from None


def _prefill_kernels(args, fn, iters: int = 10) -> int:
    """Mean device time per forward of each kernel of the fast prefill (torch.profiler, no graphs),
    with `--tile` changes applied."""
    from nsa.backends import triton_nsa

    base = triton_nsa.current_tiles("cuda")
    with triton_nsa.use_tiles(dataclasses.replace(base, **_tile_changes(args.tile, base))):
        return _profile_forward(args, fn, iters)


def _profile_forward(args, fn, iters: int) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.timing import Timer, measure

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = _per_kernel_us(prof, iters)
    if args.trace:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tr:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
        tr.export_chrome_trace(args.trace)
    samples = measure({"forward": fn}, Timer(warmup_ms=50, rep_ms=300, min_rep=5, max_rep=50))["forward"]
    print(f"T={args.T} heads {args.heads}/{args.kv_heads} ({torch.cuda.get_device_name()}): forward "
          f"{statistics.median(samples):.3f} ms (CUDA events, median of {len(samples)}); per forward:")
    for name, us in out.items():
        print(f"  {name:60s} {us / 1000:9.3f} ms")
    print(f"  {'sum':60s} {sum(out.values()) / 1000:9.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"T": args.T, "heads": args.heads, "kv_heads": args.kv_heads, "gpu": torch.cuda.get_device_name(),
                       "tiles_changed": args.tile, "forward_ms": statistics.median(samples),
                       "forward_samples_ms": samples, "kernels_us": out}, fh, indent=1)
    return 0


def _kernel_times(fn, replays: int = 50) -> dict[str, float]:
    """Mean device time per call of each kernel of `fn`, us, from torch.profiler over CUDA-graph
    replays (what a graph launch runs; kernel names as the profiler reports them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.suites.decode import _graph, _warm

    _warm(fn)
    graph = _graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return _per_kernel_us(prof, replays)


def _per_kernel_us(prof, calls: int) -> dict[str, float]:
    """Device time per call of each CUDA kernel in a torch.profiler run of `calls` calls, us,
    largest first (names as the profiler reports them, cut to 60 characters)."""
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            out[ev.key[:60]] = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)) / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    raise SystemExit(main())
