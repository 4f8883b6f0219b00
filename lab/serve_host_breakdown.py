"""Host enqueue time of one paged decode step (nsa.serving.PagedCache), piece by piece, beside the
contiguous step and GraphedDecode; then a profiler table of the paged step's launches.

    PYTHONPATH=. python lab/serve_host_breakdown.py 8 65536     # B, tokens per sequence (CUDA)

Also the cache's own graph step (`PagedCache.step`, the default on CUDA) with the GPU idle before
each call, its pieces, and the GPU time of the attention alone (the four decode kernels replayed
from a graph of their own, `triton.testing.do_bench`, L2 flushed) beside the whole step's replay.

Host times are per call without synchronisation over 300 calls; "wall (events)" brackets 200
calls with CUDA events. The per-piece numbers in docs/nsa.md ("Serving") came from this script on
an H100 (9-43 us of host per launch there); the contiguous step is timed call by call, synchronised.
"""

import sys
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from bench.suites.decode import _module, fill_cache
from nsa.serving import GraphedDecode, PagedCache


def timed(name, fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    e1.record()
    torch.cuda.synchronize()
    print(f"{name:<28} host enqueue {host:8.1f} us/step   wall (events) {e0.elapsed_time(e1) / n * 1e3:8.1f} us/step")


def host(name, fn, n=300):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"  host {name:<24} {h:7.1f} us")


def main(b: int, t: int) -> None:
    p = {"B": b, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "dim": 2560, "block": 32, "stride": 16,
         "sel_block": 64, "sel_count": 16, "window": 512, "nsa_backend": "triton"}
    attn, _ = _module(p, torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    x_t = torch.randn(b, 1, 2560, device="cuda", dtype=torch.bfloat16)
    cache = PagedCache(attn, max_seqs=b, max_len=t + 8192, page_size=64, graph=False)
    with torch.no_grad():
        xs = torch.randn(b, t, 2560, device="cuda", dtype=torch.bfloat16)
        for i in range(b):
            cache.load(cache.add(), fill_cache(attn, xs[i:i + 1]))
        contig = fill_cache(attn, xs)
        del xs
        timed("paged eager step", lambda: cache.step(x_t))
        host("prepare", cache.prepare)
        host("fused_weights", cache._fused_weights)
        w, bias = cache._fused_weights()
        host("addmm", lambda: torch.addmm(bias, x_t.reshape(b, 2560), w.t(), out=cache._proj))
        host("prologue launch", cache._prologue_launch)
        host("decode launch (4)", cache._launch[False])
        for i, launch in enumerate(cache._launch[False].launches):
            host(f"decode kernel {i}", launch)
        host("lengths add", lambda: cache.lengths.add_(cache.active))
        host("o_proj", lambda: attn._out(cache._launch[False].out))
        host("step_device", lambda: cache.step_device(x_t))
        each = []
        for _ in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            attn.step(x_t, contig)
            torch.cuda.synchronize()
            each.append(round((time.perf_counter() - t0) * 1e3, 2))
        print("contig eager step, each (ms, synchronised):", each)
        graphed = GraphedDecode(cache)
        timed("paged graph step", lambda: graphed(x_t))
        # The cache's own graph (PagedCache.step's default on CUDA): per call, the host's enqueue
        # with an idle GPU (synchronised before each call, not after), then its pieces.
        cache.graph = True
        timed("paged step (own graph)", lambda: cache.step(x_t))
        idle = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.step(x_t)
            idle.append((time.perf_counter() - t0) * 1e6)
        idle.sort()
        print(f"  paged step (own graph), GPU idle before each call: host median {idle[100]:.1f} us, "
              f"p10 {idle[20]:.1f}, p90 {idle[180]:.1f}")
        g = cache._graph
        host("check_step", lambda: cache._check_step(x_t))
        host("prepare", cache.prepare)
        host("advance", cache.advance)
        host("input copy", lambda: g._x.copy_(x_t))
        host("replay", g.graph.replay)
        host("output clone", g._out.clone)
        # The attention alone (the four decode kernels, bound), replayed from a graph of its own:
        # GPU time with an L2 flush before each replay (triton's do_bench), as the target.
        att = torch.cuda.CUDAGraph()
        launch = cache._launch[False]
        with torch.cuda.graph(att):
            launch()
        ms = triton.testing.do_bench(att.replay, warmup=50, rep=300, return_mode="median")
        print(f"  attention alone (4 decode kernels) from a graph: GPU {ms * 1e3:.1f} us (do_bench median, L2 flushed)")
        prof_all = triton.testing.do_bench(g.graph.replay, warmup=25, rep=100, return_mode="median")
        print(f"  whole step graph replay: GPU {prof_all * 1e3:.1f} us (do_bench median, L2 flushed)")
        q, _, gates = attn.project(x_t, start=contig.length - 1)
        timed("contig decode_attend", lambda: attn.decode_attend(q, gates, contig))
        # The same attention on the contiguous cache (NSAAttention.decode_attend), from a graph.
        dense_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(dense_graph):
            attn.decode_attend(q, gates, contig)
        ms = triton.testing.do_bench(dense_graph.replay, warmup=50, rep=300, return_mode="median")
        print(f"  contiguous decode_attend from a graph: GPU {ms * 1e3:.1f} us (do_bench median, L2 flushed)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                cache.step(x_t)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
