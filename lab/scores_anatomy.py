"""Anatomy of the compressed-scores kernel (H100): MMA against exp cost, exp variants, and L2 rate.

What it measures:

* ``l2_TBps``: the read rate (in TB/s) a plain Triton kernel (``_l2read``) reaches on a 16 MB and a
  32 MB bf16 buffer that stays resident in L2, for a few chunk sizes / warps / stages;
* ``scores_8k`` / ``scores_64k``: the time of a copy of the scores kernel (``_scores_v``) at T = 8192
  and 65536 (64 query heads, 4 KV heads, head dim 128, bf16) for several BQ x BK / warps / stages
  tilings and MODEs: 0 the plain kernel, 3 no exp, 4 no MMA, 5 ``ex2.approx.ftz`` by inline PTX,
  6/7/8/10/11 part of the heads' exps done by a polynomial on the FMA pipe (``_ex2_poly``), 9 a
  warp-specialized head loop. Each entry has the median time, the largest relative error against
  MODE 0 (where the MODE computes the same thing), and registers / spills / shared memory.

Needs a CUDA GPU (it was run on an H100 in this project; the L2 kernel launches 132 * 64 programs,
sized for the H100's 132 SMs). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 lab/scores_anatomy.py

It writes ``$OUT/exp2.json``; the H100 result is stored as
``results/h100/experiments/scores-anatomy-l2.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import scores_common as scm
from scores_common import _spill_store, _tile_bounds, _tile_rows
from ci import atomic
from nsa.backends.triton_kernels.common import _dot

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _ex2_ftz(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _ex2_poly(x):
    """2**x on the FMA pipe: round-to-nearest by the 1.5 * 2**23 trick, degree-6 Taylor of
    2**f on [-0.5, 0.5], the integer part added to the exponent bits; 0 below 2**-126."""
    xc = tl.maximum(x, -126.0)
    t = xc + 12582912.0
    j = t - 12582912.0
    f = xc - j
    p = 0.00015403530393381608
    p = p * f + 0.0013333558146428443
    p = p * f + 0.009618129107628477
    p = p * f + 0.05550410866482158
    p = p * f + 0.2402265069591007
    p = p * f + 0.6931471805599453
    p = p * f + 1.0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return tl.where(x < -126.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _term(s, lse2, qk_scale2, MODE: tl.constexpr, g: tl.constexpr):
    x = s * qk_scale2 - lse2[:, None]
    if MODE == 3:
        out = x
    elif MODE == 5:
        out = _ex2_ftz(x)
    elif MODE == 6:
        if g % 4 == 3:
            out = _ex2_poly(x)
        else:
            out = tl.exp2(x)
    elif MODE == 7:
        if g % 2 == 1:
            out = _ex2_poly(x)
        else:
            out = tl.exp2(x)
    elif MODE == 8:
        if g % 4 == 3:
            out = _ex2_poly(x)
        else:
            out = _ex2_ftz(x)
    elif MODE == 10:
        if g % 8 == 7:
            out = _ex2_poly(x)
        else:
            out = _ex2_ftz(x)
    elif MODE == 11:
        if g % 4 == 1:
            out = _ex2_poly(x)
        elif g % 4 == 3:
            out = _ex2_poly(x)
        else:
            out = _ex2_ftz(x)
    else:
        out = tl.exp2(x)
    return out


@triton.jit
def _scores_v(Q, KC, LSE, S, SP,
              sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
              T, Tc, NB, q_start, qk_scale2,
              HKV: tl.constexpr, G: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, R: tl.constexpr,
              E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
              IEEE: tl.constexpr, MODE: tl.constexpr):
    t0, c0, skip = _tile_bounds(T, Tc, q_start, CMP_BLOCK, STRIDE, BQ, BK)
    if skip:
        return
    b, h, offs_q, q_ok, nvis, offs_c, offs_dk, kc, q_rows = _tile_rows(Q, KC, sqb, sqt, skb, skt, skh, T, Tc,
                                                                       q_start, t0, c0, HKV, CMP_BLOCK, STRIDE, BQ, BK, DK, BDK)
    kt = tl.trans(kc)
    acc = tl.zeros([BQ, BK], tl.float32)
    if MODE == 9:
        for g in tl.range(0, G, warp_specialize=True):
            head = h * G + g
            q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            s = _dot(q, kt, IEEE)
            acc += tl.exp2(s * qk_scale2 - lse2[:, None])
    elif MODE == 0 or MODE == 3 or MODE == 4 or MODE == 5:
        for g in range(G):
            head = h * G + g
            q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            if MODE == 4:
                s = tl.zeros([BQ, BK], tl.float32) + (lse2[:, None] * 0.001 + offs_c[None, :].to(tl.float32) * 1e-4)
            else:
                s = _dot(q, kt, IEEE)
            acc += _term(s, lse2, qk_scale2, MODE, 0)
    else:
        for g in tl.static_range(G):
            head = h * G + g
            q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            s = _dot(q, kt, IEEE)
            acc += _term(s, lse2, qk_scale2, MODE, g)
    _spill_store(acc, S, SP, b, h, offs_q, q_ok, nvis, offs_c, c0, ssb, sst, ssh, spb, spt, sph, NB, BQ, BK, R, E, STRIDE)


@triton.jit
def _l2read(X, Y, N_CHUNK, CH: tl.constexpr, ITERS: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([CH // W, W], tl.float32)
    r = tl.arange(0, CH // W)
    c = tl.arange(0, W)
    for i in range(ITERS):
        chunk = (pid * 7919 + i * 104729) % N_CHUNK
        x = tl.load(X + chunk * CH + r[:, None] * W + c[None, :])
        acc += x.to(tl.float32)
    tl.store(Y + pid, tl.sum(acc))


def scores_exp(T, hq=64, hkv=4):
    x = scm.inputs(T, hq, hkv)
    out = {}
    ref = None
    for (bq, bk, warps, stages) in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 2)):
        s_, sp_ = scm.buffers(x, bk)
        modes = (0, 3, 4, 5, 6, 7, 8, 10, 11, 9) if (bq, bk, warps) == (64, 64, 4) else (0, 5, 8)
        for mode in modes:
            def launch(mode=mode, bq=bq, bk=bk, warps=warps, stages=stages, s_=s_, sp_=sp_):
                return scm.launch(_scores_v, x, s_, sp_, bq, bk, warps, stages, MODE=mode)
            name = f"{bq}x{bk}w{warps}s{stages}m{mode}"
            try:
                s_.zero_()
                kern = launch()
                torch.cuda.synchronize()
                err = None
                if mode in (0, 5, 6, 7, 8, 10, 11, 9):
                    if ref is None and mode == 0:
                        ref = s_.clone()
                    mask = ref != 0
                    rel = ((s_ - ref).abs()[mask] / ref.abs()[mask]).max().item()
                    err = rel
                tm = do_bench(launch, warmup=5, rep=30, return_mode="median")
                meta = {"regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None),
                        "shared": getattr(kern.metadata, "shared", None)}
                out[name] = {"ms": tm, "max_rel_vs_base": err, **meta}
            except Exception as ex:  # noqa: BLE001
                out[name] = {"error": repr(ex)[:300]}
            print(T, name, out[name], flush=True)
    return out


def l2rate():
    out = {}
    for mb in (16, 32):
        n = mb * 2 ** 20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for ch, w, warps, stages in ((16384, 128, 2, 2), (32768, 256, 4, 2), (16384, 128, 4, 3), (32768, 256, 8, 3)):
            nch = n // (ch // 1)
            progs = 132 * 64
            iters = 64
            y = torch.empty(progs, device="cuda", dtype=torch.float32)

            def f(x=x, y=y, nch=nch, progs=progs, ch=ch, iters=iters, w=w, warps=warps, stages=stages):
                return _l2read[(progs,)](x, y, nch, CH=ch, ITERS=iters, W=w, num_warps=warps, num_stages=stages)

            try:
                f()
                tm = do_bench(f, warmup=5, rep=30, return_mode="median")
                out[f"{mb}MB-ch{ch}-w{warps}-s{stages}"] = progs * iters * ch * 2 / tm / 1e9
            except Exception as ex:  # noqa: BLE001
                out[f"{mb}MB-ch{ch}-w{warps}-s{stages}"] = repr(ex)[:200]
            print("l2", mb, ch, warps, stages, out[f"{mb}MB-ch{ch}-w{warps}-s{stages}"], flush=True)
    return out


if __name__ == "__main__":
    res = {"l2_TBps": l2rate(), "scores_8k": scores_exp(8192), "scores_64k": scores_exp(65536)}
    atomic.write_text(os.path.join(OUT, "exp2.json"), json.dumps(res, indent=1))
