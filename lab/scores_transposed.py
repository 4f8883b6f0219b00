"""Transposed compressed-scores kernel against the current one (H100).

What it measures: a copy of the scores kernel computed transposed (``_scores_t``: the compressed
keys are the A operand of the MMA, loaded once for all heads of a KV group; with ``AREG`` they are
also forced into registers) against the current ``scores._cmp_scores`` kernel ("base"), at
T = 8192 and 65536 with 64 query / 4 KV heads and T = 65536 with 16 / 16 heads (head dim 128,
bf16), for several BQ x BK / warps / stages tilings. Each entry has the median time, the largest
relative error against the base kernel's output (only for BK = 64), and registers / spills /
shared memory.

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 lab/scores_transposed.py

It writes ``$OUT/exp4.json``; the H100 result is stored as
``results/h100/experiments/scores-transposed.json``.
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
from scores_common import _tile_bounds, _tile_rows
from ci import atomic
from nsa.backends.triton_kernels import scores as SC
from nsa.backends.triton_kernels.common import _dot

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _scores_t(Q, KC, LSE, S, SP, sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
              T, Tc, NB, q_start, qk_scale2, one,
              HKV: tl.constexpr, G: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, R: tl.constexpr,
              E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
              IEEE: tl.constexpr, AREG: tl.constexpr):
    t0, c0, skip = _tile_bounds(T, Tc, q_start, CMP_BLOCK, STRIDE, BQ, BK)
    if skip:
        return
    b, h, offs_q, q_ok, nvis, offs_c, offs_dk, kc, q_rows = _tile_rows(Q, KC, sqb, sqt, skb, skt, skh, T, Tc,
                                                                       q_start, t0, c0, HKV, CMP_BLOCK, STRIDE, BQ, BK, DK, BDK)
    if AREG:
        kc = (kc.to(tl.float32) * one).to(KC.dtype.element_ty)
    acc = tl.zeros([BK, BQ], tl.float32)
    for g in range(G):
        head = h * G + g
        q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
        s = _dot(kc, tl.trans(q), IEEE)
        acc += tl.exp2(s * qk_scale2 - lse2[None, :])
    acc = tl.where((offs_c[:, None] < nvis[None, :]) & q_ok[None, :], acc, 0.0)
    NBK: tl.constexpr = BK // R
    p3 = tl.reshape(acc, [NBK, R, BQ])
    r = tl.arange(0, R)
    own = tl.sum(p3 * (STRIDE * tl.minimum(R - r, E)).to(tl.float32)[None, :, None], 1)
    nxt = tl.sum(p3 * (STRIDE * tl.maximum(r + E - R, 0)).to(tl.float32)[None, :, None], 1)
    i = tl.arange(0, NBK)
    shift = (i[:, None] == i[None, :] + 1).to(tl.float32)     # row i takes nxt row i - 1
    tot = own + tl.dot(shift, nxt, input_precision="ieee")
    jb = c0 // R
    offs_j = jb + i
    rows = S + b * ssb + offs_q[None, :].to(tl.int64) * sst + h * ssh
    spill = tl.sum(tl.where(i[:, None] == NBK - 1, nxt, 0.0), 0)
    tl.store(rows + offs_j[:, None], tot, mask=q_ok[None, :] & (offs_j[:, None] < NB))
    tl.store(SP + b * spb + offs_q.to(tl.int64) * spt + h * sph + tl.program_id(0), spill, mask=q_ok & (jb + NBK < NB))


def run(T, hq, hkv):
    x = scm.inputs(T, hq, hkv)
    out = {}
    ref = None
    for (bq, bk, warps, stages) in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (128, 64, 8, 2)):
        s_, sp_ = scm.buffers(x, bk)
        variants = [("base", None)] if (bq, bk) == (64, 64) else []
        variants += [("trans", 0), ("trans_areg", 1)]
        for name, areg in variants:
            def launch(name=name, areg=areg, bq=bq, bk=bk, warps=warps, stages=stages, s_=s_, sp_=sp_):
                if name == "base":
                    return scm.launch(SC._cmp_scores, x, s_, sp_, bq, bk, warps, stages, SPILL=True)
                return scm.launch(_scores_t, x, s_, sp_, bq, bk, warps, stages, 1.0, AREG=areg)
            key = f"{name}-{bq}x{bk}w{warps}s{stages}"
            try:
                s_.zero_()
                kern = launch()
                torch.cuda.synchronize()
                if ref is None:
                    ref = s_.clone()
                # compare only the candidate columns written by both (same BK tiling for base)
                m = ref != 0
                rel = (((s_ - ref).abs()[m]) / ref.abs()[m]).max().item() if bk == 64 else None
                tm = do_bench(launch, warmup=5, rep=30, return_mode="median")
                out[key] = {"ms": tm, "max_rel": rel, "regs": kern.n_regs, "spills": kern.n_spills,
                            "shared": kern.metadata.shared}
            except Exception as ex:  # noqa: BLE001
                out[key] = {"error": repr(ex)[:300]}
            print(T, hq, hkv, key, out[key], flush=True)
    return out


if __name__ == "__main__":
    res = {f"{T}-{hq}-{hkv}": run(T, hq, hkv) for T, hq, hkv in ((8192, 64, 4), (65536, 64, 4), (65536, 16, 16))}
    atomic.write_text(os.path.join(OUT, "exp4.json"), json.dumps(res, indent=1))
