"""Does the fa3-fwd wheel take a sliding window (``window_size_left``), and is it exact and faster
than the Triton band kernel? (H100)

What it measures:

* ``check-T-hq-hkv-w``: for three small shapes, the relative error against a float64 reference
  window attention of the FA3 forward called with ``window_size_left = w - 1``, of the Triton
  sliding-window kernel, and of full causal FA3 (a contrast that should be large); if the FA3 call
  raises, the entry is the exception text instead;
* ``time-T-hq-hkv``: for T = 8192, 16384, 65536 with 64/4, 16/16 and 32/8 query/KV heads, and
  T = 131072 with 64/4 (head dim 128, bf16, window 512), the median time of the FA3 window call
  (with and without a preallocated output), the Triton sliding-window kernel time, and the
  largest absolute difference between the two outputs; ``fa3_err`` holds the exception text
  where the FA3 call fails.

In the stored H100 run the wheel refused local attention ("This flash attention build does not
support local attention"), so the file holds the error text and the Triton times only.

Needs a CUDA GPU (it was run on an H100 in this project) and the ``fa3-fwd`` wheel importable
(``fa3_cmp.load()``), e.g. installed with ``pip install --target /tmp/site fa3_fwd-*.whl``;
without it every FA3 entry just holds the resulting error text. Rerun from the repo root with

    PYTHONPATH=/tmp/site:$PWD OUT=<dir> python3 lab/fa3_window.py

It writes ``$OUT/exp3.json``; the H100 result is stored as
``results/h100/experiments/fa3-window.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch
from triton.testing import do_bench

from window_common import band_tiles, ref_win
from ci import atomic
from nsa.backends.triton_kernels import fa3_cmp
from nsa.backends.triton_kernels import sliding as W

OUT = os.environ.get("OUT", "/tmp")
res = {}
fa3 = fa3_cmp.load()
print("fa3", fa3)


def fa3_win(q, k, v, w, scale, out=None, left=None):
    args = (q, k, v, None, None, None, out, *([None] * 16), scale, True, w - 1 if left is None else left, 0, 0, 0.0,
            True, None, 1, None, 0)
    r = fa3.fa3_fwd_cuda.fwd(*args)
    return r[0], r[1]


dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
for (T, hq, hkv, w) in ((1000, 8, 2, 100), (3001, 16, 4, 512), (2048, 64, 4, 512)):
    q = torch.randn(1, T, hq, 128, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, T, hkv, 128, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, T, hkv, 128, device=dev, dtype=dt, generator=g)
    sc = 128 ** -0.5
    try:
        o, lse = fa3_win(q, k, v, w, sc)
        ref = ref_win(q, k, v, w, sc)
        err = ((o.double() - ref).norm() / ref.norm()).item()
        tri = W.sliding(q, k, v, window=w, scale=sc, q_start=0, k_start=0, tiles=band_tiles(q.device))
        err_t = ((tri.double() - ref).norm() / ref.norm()).item()
        # full causal for contrast: error vs the window ref should be large
        oc, _ = fa3_win(q, k, v, w, sc, left=-1)
        err_c = ((oc.double() - ref).norm() / ref.norm()).item()
        res[f"check-{T}-{hq}-{hkv}-{w}"] = {"fa3_rel": err, "triton_rel": err_t, "causal_rel": err_c}
    except Exception as ex:  # noqa: BLE001
        res[f"check-{T}-{hq}-{hkv}-{w}"] = repr(ex)[:400]
    print(res[f"check-{T}-{hq}-{hkv}-{w}"], flush=True)

for T in (8192, 16384, 65536, 131072):
    for (hq, hkv) in ((64, 4), (16, 16), (32, 8)):
        if T == 131072 and hq != 64:
            continue
        q = torch.randn(1, T, hq, 128, device=dev, dtype=dt, generator=g)
        k = torch.randn(1, T, hkv, 128, device=dev, dtype=dt, generator=g)
        v = torch.randn(1, T, hkv, 128, device=dev, dtype=dt, generator=g)
        sc = 128 ** -0.5
        tl_ = band_tiles(q.device)
        r = {}
        try:
            o_f, _ = fa3_win(q, k, v, 512, sc)
            o_t = W.sliding(q, k, v, window=512, scale=sc, q_start=0, k_start=0, tiles=tl_)
            r["max_abs_diff"] = (o_f.float() - o_t.float()).abs().max().item()
            r["fa3_ms"] = do_bench(lambda q=q, k=k, v=v, sc=sc: fa3_win(q, k, v, 512, sc),
                                   warmup=5, rep=30, return_mode="median")
            oo = torch.empty_like(q)
            r["fa3_out_ms"] = do_bench(lambda q=q, k=k, v=v, sc=sc, oo=oo: fa3_win(q, k, v, 512, sc, out=oo),
                                       warmup=5, rep=30, return_mode="median")
        except Exception as ex:  # noqa: BLE001
            r["fa3_err"] = repr(ex)[:300]
        r["triton_ms"] = do_bench(lambda q=q, k=k, v=v, sc=sc, tl_=tl_:
                                  W.sliding(q, k, v, window=512, scale=sc, q_start=0, k_start=0, tiles=tl_),
                                  warmup=5, rep=30, return_mode="median")
        res[f"time-{T}-{hq}-{hkv}"] = r
        print(T, hq, hkv, r, flush=True)
        del q, k, v
atomic.write_text(os.path.join(OUT, "exp3.json"), json.dumps(res, indent=1))
