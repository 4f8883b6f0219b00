"""Scratch: host and GPU time of one paged step vs the contiguous step, and their launches."""
import time, torch, sys
from bench.suites.decode import _module, fill_cache
from nsa.serving import PagedCache, GraphedDecode
B, T = int(sys.argv[1]), int(sys.argv[2])
p = {"B": B, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "dim": 2560, "block": 32, "stride": 16, "sel_block": 64,
     "sel_count": 16, "window": 512, "nsa_backend": "triton"}
attn, cfg = _module(p, torch.device("cuda"), torch.bfloat16)
torch.manual_seed(0)
x_t = torch.randn(B, 1, 2560, device="cuda", dtype=torch.bfloat16)
cache = PagedCache(attn, max_seqs=B, max_len=T + 4096, page_size=64)
with torch.no_grad():
    xs = torch.randn(B, T, 2560, device="cuda", dtype=torch.bfloat16)
    for i in range(B):
        cache.load(cache.add(), fill_cache(attn, xs[i:i + 1]))
    contig = fill_cache(attn, xs)
    del xs
    def run(name, fn, n=200):
        for _ in range(5): fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter(); e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n): fn()
        host = (time.perf_counter() - t0) / n * 1e3
        e1.record(); torch.cuda.synchronize()
        print(f"{name:<28} host enqueue {host*1e3:8.1f} us/step   wall (events) {e0.elapsed_time(e1)/n*1e3:8.1f} us/step")
    run("paged eager step", lambda: cache.step(x_t))
    import nsa.serving as sv
    def host(name, fn, n=300):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): fn()
        h = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize(); print(f"  host {name:<24} {h:7.1f} us")
    host("prepare", cache.prepare)
    host("fused_weights", cache._fused_weights)
    w, bb = cache._fused_weights()
    host("addmm", lambda: torch.addmm(bb, x_t.reshape(B, 2560), w.t(), out=cache._proj))
    host("prologue launch", cache._prologue_launch)
    host("decode launch (4)", cache._launch[False])
    for i, l in enumerate(cache._launch[False].launches): host(f"decode kernel {i}", l)
    host("lengths add", lambda: cache.lengths.add_(cache.active))
    host("o_proj", lambda: attn._out(cache._launch[False].out))
    host("step_device", lambda: cache.step_device(x_t))
    ts = []
    for i in range(12):
        torch.cuda.synchronize(); t0 = time.perf_counter(); attn.step(x_t, contig); torch.cuda.synchronize()
        ts.append(round((time.perf_counter() - t0) * 1e3, 2))
    print("contig eager step, each (ms, synchronised):", ts)
    g = GraphedDecode(cache)
    run("paged graph step", lambda: g(x_t))
    q, kv, gates = attn.project(x_t, start=T)
    run("contig decode_attend", lambda: attn.decode_attend(q, gates, contig))
    from torch.profiler import profile, ProfilerActivity
    for name, fn in (("paged", lambda: cache.step(x_t)),):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3): fn()
            torch.cuda.synchronize()
        print(name, prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
