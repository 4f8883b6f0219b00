"""Host enqueue time of one paged decode step (nsa.serving.PagedCache), piece by piece, beside the
contiguous step and GraphedDecode; then a profiler table of the paged step's launches.

    PYTHONPATH=. python lab/serve_host_breakdown.py 8 65536     # B, tokens per sequence (CUDA)

Host times are per call without synchronisation over 300 calls; "wall (events)" brackets 200
calls with CUDA events. The per-piece numbers in docs/nsa.md ("Serving") came from this script on
an H100 (9-43 us of host per launch there); the contiguous step is timed call by call, synchronised.
"""

import sys
import time

import torch
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
    cache = PagedCache(attn, max_seqs=b, max_len=t + 4096, page_size=64)
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
        q, _, gates = attn.project(x_t, start=t)
        timed("contig decode_attend", lambda: attn.decode_attend(q, gates, contig))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                cache.step(x_t)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
