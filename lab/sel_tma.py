"""The selection kernel with TMA block loads against the cp.async kernel (H100).

What it measures: a copy of the group-centric selection kernel (``_sel_tma``) that loads each
selected block's keys and values through device-side tensor descriptors (TMA) instead of the
pointer loads Triton pipelines with cp.async, against ``selection.selected`` ("base"), on the
blocks `compressed_select` picks for random inputs (64 query / 4 KV heads, head dim 128, bf16,
T = 8192 and 65536), for several warps / stages. Each entry has the median time and the largest
absolute difference from the base output (the same arithmetic: 0 or one bf16 ulp).

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 lab/sel_tma.py

It writes ``$OUT/exp5.json``; the H100 result is stored as
``results/h100/experiments/sel-tma.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from ci import atomic
from nsa import ops
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import selection as S
from nsa.backends.triton_kernels.tiles import current

OUT = os.environ.get("OUT", "/tmp")


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton.set_allocator(_alloc)


@triton.jit
def _sel_tma(Q, K, V, IDX, Out, sqt, sqh, skt, svt, sit, sih, sot, soh, T, scale,
             HKV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, SEL: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BG: tl.constexpr, SAME_ORDER: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kd = tl.make_tensor_descriptor(K, shape=[T, HKV * DK], strides=[skt, 1], block_shape=[SEL, DK])
    vd = tl.make_tensor_descriptor(V, shape=[T, HKV * DV], strides=[svt, 1], block_shape=[SEL, DV])
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    offs_s = tl.arange(0, SEL)
    heads = h * G + offs_g
    q = tl.load(Q + t * sqt + heads[:, None] * sqh + offs_dk[None, :], mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, DV], tl.float32)
    for i in range(N_SEL):
        blk = tl.load(IDX + t * sit + h * sih + i)
        row0 = tl.maximum(blk, 0) * SEL
        pos = row0 + offs_s
        valid = (blk >= 0) & (pos <= t)
        k = kd.load([row0, h * DK])
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = vd.load([row0, h * DV])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=offs_g[:, None] < G)


def run(T, hq=64, hkv=4):
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731
    q = r(1, T, hq, 128)
    k, v = r(1, T, hkv, 128), r(1, T, hkv, 128)
    kc, vc = ops.compress_kv(k, v, block=32, stride=16)
    scale = 128 ** -0.5
    _, idx = triton_nsa.compressed_select(q, kc, vc, block=32, stride=16, sel_block=64, sel_count=16, scale=scale)
    idx = idx.contiguous()
    tiles = current(q.device)
    out = {}
    ref = S.selected(q, k, v, idx, sel_block=64, scale=scale, q_start=0, k_start=0, tiles=tiles)
    out["base_ms"] = do_bench(lambda: S.selected(q, k, v, idx, sel_block=64, scale=scale, q_start=0, k_start=0,
                                                 tiles=tiles), warmup=5, rep=40, return_mode="median")
    print(T, "base", out["base_ms"], flush=True)
    for warps, stages in ((2, 2), (2, 3), (4, 2), (4, 3), (2, 4), (1, 3)):
        o = torch.empty_like(ref)
        def launch(warps=warps, stages=stages, o=o):
            _sel_tma[(T, hkv)](q, k, v, idx, o, q.stride(1), q.stride(2), k.stride(1), v.stride(1), idx.stride(1),
                               idx.stride(2), o.stride(1), o.stride(2), T, scale, HKV=hkv, G=hq // hkv, N_SEL=16,
                               SEL=64, DK=128, DV=128, BG=16, SAME_ORDER=0, num_warps=warps, num_stages=stages)
        key = f"tma-w{warps}-s{stages}"
        try:
            launch()
            torch.cuda.synchronize()
            diff = (o.float() - ref.float()).abs().max().item()
            ms = do_bench(launch, warmup=5, rep=40, return_mode="median")
            out[key] = {"ms": ms, "max_abs_diff": diff}
        except Exception as ex:  # noqa: BLE001
            out[key] = {"error": repr(ex)[:400]}
        print(T, key, out[key], flush=True)
    return out


res = {}
for T in (8192, 65536):
    res[str(T)] = run(T)
atomic.write_text(os.path.join(OUT, "exp5.json"), json.dumps(res, indent=1))
