"""FlashAttention-4 (the `flash-attn-4` wheel, CuTe DSL, import `flash_attn.cute`) as the prefill
sliding window: is it exact, and is it faster than the Triton band kernel? (H100)

What it writes to ``$OUT/fa4-window.json``:

* ``compile_s``: wall time of the first FA-4 window call (its JIT compile), per head-dim pair;
* ``check-T-hq-hkv-w-dk-dv``: relative error against a float64 window attention of the FA-4 call
  (``window_size = (w - 1, 0)``), of the Triton band kernel (``Tiles.win_fa4`` off), and of full causal FA-4 (a contrast
  that must be large); the same FA-4 call on a side stream and replayed from a CUDA graph
  (``side_equal`` / ``graph_equal``: bit-equal to the plain call); an exception's text instead
  where a call fails;
* ``time-T-hq-hkv-dk``: median ms (``do_bench``) of the FA-4 window with ``pack_gqa`` left to
  FA-4 and forced on/off, and of the Triton band kernel, plus their largest absolute difference.

Rerun from the repo root with the wheels installed in /tmp/site:

    PYTHONPATH=/tmp/site:$PWD OUT=<dir> python3 lab/fa4_window.py
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch
from triton.testing import do_bench

from window_common import band_tiles, ref_win
from ci import atomic
from nsa.backends.triton_kernels import sliding as W

OUT = os.environ.get("OUT", "/tmp")
res: dict = {}


def save() -> None:
    atomic.write_text(os.path.join(OUT, "fa4-window.json"), json.dumps(res, indent=1))


try:
    from flash_attn.cute import flash_attn_func
except Exception:  # noqa: BLE001
    res["import_error"] = traceback.format_exc()[-2000:]
    save()
    raise


def fa4_win(q, k, v, w, scale, pack_gqa=None, causal_only=False):
    ws = (None, 0) if causal_only else (w - 1, 0)
    out, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=ws, pack_gqa=pack_gqa)
    return out


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def inputs(T, hq, hkv, dk, dv, b=1):
    q = torch.randn(b, T, hq, dk, device=dev, dtype=dt, generator=g)
    k = torch.randn(b, T, hkv, dk, device=dev, dtype=dt, generator=g)
    v = torch.randn(b, T, hkv, dv, device=dev, dtype=dt, generator=g)
    return q, k, v


for dk, dv in ((128, 128), (192, 128)):
    q, k, v = inputs(1000, 16, 4, dk, dv)
    t0 = time.perf_counter()
    try:
        fa4_win(q, k, v, 512, dk ** -0.5)
        torch.cuda.synchronize()
        res[f"compile_s-{dk}-{dv}"] = time.perf_counter() - t0
    except Exception:  # noqa: BLE001
        res[f"compile_s-{dk}-{dv}"] = traceback.format_exc()[-1500:]
    print(dk, dv, res[f"compile_s-{dk}-{dv}"], flush=True)
save()

for (T, hq, hkv, w, dk, dv, b) in ((1000, 8, 2, 100, 128, 128, 1), (3001, 16, 4, 512, 128, 128, 2),
                                   (2048, 64, 4, 512, 128, 128, 1), (1537, 16, 16, 512, 128, 128, 1),
                                   (777, 32, 8, 512, 128, 128, 1), (2500, 16, 4, 512, 192, 128, 1),
                                   (300, 16, 4, 512, 128, 128, 1)):
    name = f"check-{T}-{hq}-{hkv}-{w}-{dk}-{dv}-b{b}"
    try:
        q, k, v = inputs(T, hq, hkv, dk, dv, b)
        sc = dk ** -0.5
        o = fa4_win(q, k, v, w, sc)
        ref = ref_win(q, k, v, w, sc)
        tri = W.sliding(q, k, v, window=w, scale=sc, q_start=0, k_start=0, tiles=band_tiles(q.device))
        oc = fa4_win(q, k, v, w, sc, causal_only=True)
        r = {"fa4_rel": rel(o, ref), "triton_rel": rel(tri, ref), "causal_rel": rel(oc, ref),
             "fa4_vs_triton_max_abs": (o.float() - tri.float()).abs().max().item()}
        side = torch.cuda.Stream(priority=-1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            o_side = fa4_win(q, k, v, w, sc)
        torch.cuda.current_stream().wait_stream(side)
        r["side_equal"] = bool(torch.equal(o_side, o))
        gr = torch.cuda.CUDAGraph()
        s2 = torch.cuda.Stream()
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s2):
            fa4_win(q, k, v, w, sc)
        torch.cuda.current_stream().wait_stream(s2)
        with torch.cuda.graph(gr):
            o_g = fa4_win(q, k, v, w, sc)
        gr.replay()
        torch.cuda.synchronize()
        r["graph_equal"] = bool(torch.equal(o_g, o))
        res[name] = r
    except Exception:  # noqa: BLE001
        res[name] = traceback.format_exc()[-1500:]
    print(name, res[name], flush=True)
save()

shapes = [(T, 64, 4, 128) for T in (8192, 16384, 32768, 65536, 131072)]
shapes += [(T, hq, hkv, 128) for T in (16384, 65536) for hq, hkv in ((16, 16), (32, 8))]
shapes += [(T, 64, 4, 192) for T in (16384, 65536)]
def time_shape(T, hq, hkv, dk) -> dict:
    r: dict = {}
    q, k, v = inputs(T, hq, hkv, dk, 128)
    sc = dk ** -0.5
    tl_ = band_tiles(q.device)
    o_t = W.sliding(q, k, v, window=512, scale=sc, q_start=0, k_start=0, tiles=tl_)
    r["triton_ms"] = do_bench(lambda: W.sliding(q, k, v, window=512, scale=sc, q_start=0, k_start=0, tiles=tl_),
                              warmup=5, rep=40, return_mode="median")
    for label, pg in (("fa4_ms", None), ("fa4_pack_ms", True), ("fa4_nopack_ms", False)):
        try:
            o_f = fa4_win(q, k, v, 512, sc, pack_gqa=pg)
            r[label.replace("_ms", "_max_abs_vs_triton")] = (o_f.float() - o_t.float()).abs().max().item()
            r[label] = do_bench(lambda pg=pg: fa4_win(q, k, v, 512, sc, pack_gqa=pg),
                                warmup=5, rep=40, return_mode="median")
        except Exception:  # noqa: BLE001
            r[label] = traceback.format_exc()[-600:]
    return r


for (T, hq, hkv, dk) in shapes:
    name = f"time-{T}-{hq}-{hkv}-{dk}"
    try:
        res[name] = time_shape(T, hq, hkv, dk)
    except Exception:  # noqa: BLE001
        res[name] = {"error": traceback.format_exc()[-1500:]}
    print(name, res[name], flush=True)
    save()
