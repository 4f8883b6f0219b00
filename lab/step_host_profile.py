"""Host time of the default decode step, `attn.step(x_t, cache)` on an `NSACache` (what
`NSAAttention(cfg)` gives a user), piece by piece, then a cProfile of the whole step.

    PYTHONPATH=. python lab/step_host_profile.py 8 65536     # B, tokens per sequence (CUDA)

Pieces are timed without synchronisation over many calls (host enqueue per call); the whole
step also with CUDA events around the loop (wall per step once the host or the GPU leads).
"""

import cProfile
import io
import pstats
import sys
import time

import torch

from bench.suites.decode import _module, fill_cache


def host(name, fn, n=200):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t0) / n * 1e6
    e1.record()
    torch.cuda.synchronize()
    print(f"  {name:<28} host {h:8.1f} us   wall {e0.elapsed_time(e1) / n * 1e3:8.1f} us", flush=True)


def main(b: int, t: int) -> None:
    p = {"B": b, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "dim": 2560, "block": 32, "stride": 16,
         "sel_block": 64, "sel_count": 16, "window": 512, "nsa_backend": "auto"}
    attn, _ = _module(p, torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    x_t = torch.randn(b, 1, 2560, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        cache = fill_cache(attn, torch.randn(b, t, 2560, device="cuda", dtype=torch.bfloat16))
        print(f"B={b} S={t} backend={attn.backend}", flush=True)
        host("step (whole)", lambda: attn.step(x_t, cache))
        tt = cache.length
        host("project", lambda: attn.project(x_t, start=tt))
        q, kv, gates = attn.project(x_t, start=tt)
        host("decode_attend", lambda: attn.decode_attend(q, gates, cache))
        o = attn.decode_attend(q, gates, cache)
        host("_out", lambda: attn._out(o))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            attn.step(x_t, cache)
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            print(s.getvalue(), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
