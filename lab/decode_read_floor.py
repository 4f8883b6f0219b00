"""How fast kernel A of the fused decode step (decode.py) could read the compressed cache: the
issue's decode layout (B = 8, 64 query / 4 KV heads, D 128, bf16, one query at t = S - 1, random
inputs from `bench.nsa_breakdown.decode_inputs`), CUDA graphs, L2 flushed between repeats
(bench/timing.py). Timed in one process:

- `null`: a graph of one empty kernel (the harness's floor);
- `read-{tok,head}-w{4,8}`: a kernel that only reads the compressed K and V in kernel A's tiles
  (one program per chunk of 128 compressed tokens and KV head) and stores one sum per program,
  from the cache's token-major layout `[B, Tc, Hkv, D]` (rows of one head 1 KB apart) or a
  head-major copy `[B, Hkv, Tc, D]` (rows contiguous);
- `loop-CH-SUB-sSTAGES-wWARPS`: the same bytes in chunks of CH tokens, SUB per step of a
  pipelined loop, with kernel A's two products but no softmax (`_read_loop`);
- `zeros`: the counts zeroing a cut step runs; `A-tok`, `A-head`: the step cut after kernel A
  (lab/decode_chain.py) on either layout (decode_step takes any strides);
- `step-tok`, `step-head`: the whole step, a kept counts buffer.

Needs a CUDA GPU. From the repo root:

    python3 lab/decode_read_floor.py --S 8192,65536 --json read-floor.json
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch
import triton
import triton.language as tl

from decode_chain import _cut
from bench.nsa_breakdown import decode_inputs
from bench.timing import Timer, measure
from ci import atomic
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import decode as dec

LOOPS = [(128, 32, 3, 4), (128, 64, 2, 4), (256, 64, 3, 4), (256, 32, 4, 4), (512, 64, 3, 4), (512, 64, 4, 8),
         (1024, 64, 3, 4), (1024, 64, 4, 4), (512, 128, 2, 8), (256, 64, 2, 4)]


@triton.jit
def _null(OUT):
    pass


@triton.jit
def _read(K, V, OUT, skb, skt, skh, nvis, nch, HKV: tl.constexpr, CH: tl.constexpr, D: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    rows = c * CH + tl.arange(0, CH)
    off = b * skb + h * skh + rows[:, None].to(tl.int64) * skt + tl.arange(0, D)[None, :]
    ok = (rows < nvis)[:, None]
    k = tl.load(K + off, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(V + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + bh * nch + c, tl.sum(tl.sum(k + v, 1), 0))


@triton.jit
def _read_loop(Q, K, V, OUT, skb, skt, skh, nvis, nch, HKV: tl.constexpr, CH: tl.constexpr, SUB: tl.constexpr,
               D: tl.constexpr, STAGES: tl.constexpr):
    """Kernel A's bytes in chunks of CH tokens, SUB per step of a pipelined loop, with A's two
    products (q @ k^T, then @ v) but no softmax: what a streaming kernel A could reach."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * 16 * D + tl.arange(0, 16)[:, None] * D + offs_d[None, :])
    acc = tl.zeros([16, D], tl.float32)
    for s in tl.range(0, CH // SUB, num_stages=STAGES):
        rows = c * CH + s * SUB + tl.arange(0, SUB)
        off = b * skb + h * skh + rows[:, None].to(tl.int64) * skt + offs_d[None, :]
        ok = (rows < nvis)[:, None]
        k = tl.load(K + off, mask=ok, other=0.0)
        v = tl.load(V + off, mask=ok, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        acc += tl.dot(qk.to(tl.bfloat16), v)
    tl.store(OUT + bh * nch + c, tl.sum(tl.sum(acc, 1), 0))


def _cell(t: int, b: int, dev: str) -> dict:
    """Every candidate at cache length t, timed together."""
    q, gates, k, v, kc, vc = decode_inputs(t, b, dev, torch.bfloat16)
    kw, vw = k[:, -512:], v[:, -512:]
    head = {"tok": (kc, vc), "head": tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (kc, vc))}
    hkv, tc = kc.shape[2], kc.shape[1]
    nvis = min(tc, (t - 32) // 16 + 1)
    nch = triton.cdiv(nvis, 128)
    out = torch.empty(b * hkv * nch, device=dev)
    kept = triton_nsa.decode_counts(b * hkv, dev)

    def step(after, kk, vv):
        def fn():
            with _cut(dec, after):
                return triton_nsa.decode_step(q, gates, kk, vv, k, v, kw, vw, t=t - 1, block=32, stride=16,
                                              sel_block=64, sel_count=16, window=512, scale=128 ** -0.5,
                                              counts=kept if after == 4 else None)
        return fn

    def read(kk, vv, w):
        return lambda: _read[(nch, b * hkv)](kk, vv, out, kk.stride(0), kk.stride(1), kk.stride(2), nvis, nch, HKV=hkv,
                                             CH=128, D=128, num_warps=w)

    def read_loop(kk, vv, ch, sub, st, w):
        nl = triton.cdiv(nvis, ch)
        return lambda: _read_loop[(nl, b * hkv)](q, kk, vv, out, kk.stride(0), kk.stride(1), kk.stride(2), nvis, nl,
                                                 HKV=hkv, CH=ch, SUB=sub, D=128, STAGES=st, num_warps=w)

    fns = {"null": lambda: _null[(1,)](out), "zeros": lambda: torch.zeros(4, b * hkv, dtype=torch.int32, device=dev)}
    for lay, (kk, vv) in head.items():
        for w in (4, 8):
            fns[f"read-{lay}-w{w}"] = read(kk, vv, w)
        if lay == "tok":
            for ch, sub, st, w in LOOPS:
                fns[f"loop-{ch}-{sub}-s{st}-w{w}"] = read_loop(kk, vv, ch, sub, st, w)
        fns[f"A-{lay}"] = step(1, kk, vv)
        fns[f"step-{lay}"] = step(4, kk, vv)
    ref = step(4, kc, vc)()
    alt = step(4, *head["head"])()
    assert torch.equal(ref[1], alt[1]) and torch.equal(ref[0], alt[0]), "head-major cache changed the step"
    samples = measure(fns, Timer(warmup_ms=25, rep_ms=300, cuda_graph=True), device=dev)
    med = {key: statistics.median(x) * 1000 for key, x in samples.items()}
    mb = 2 * kc[:, :nvis].numel() * kc.element_size() / 1e6
    print(f"S={t} B={b}: compressed K+V {mb:.1f} MB, medians us:")
    for key, val in med.items():
        print(f"  {key:22s} {val:7.1f}" + (f"   {mb / val:.2f} TB/s" if key.startswith(("read", "loop")) else ""))
    return {"S": t, "mbytes": mb, "median_us": med, "samples_ms": samples}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", default="8192,65536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "cells": []}
    for t in (int(x) for x in args.S.split(",")):
        report["cells"].append(_cell(t, args.batch, "cuda"))
    if args.json:
        atomic.write_text(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
