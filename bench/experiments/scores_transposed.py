"""Transposed compressed-scores kernel against the current one (H100).

What it measures: a copy of the scores kernel computed transposed (``_scores_t``: the compressed
keys are the A operand of the MMA, loaded once for all heads of a KV group; with ``AREG`` they are
also forced into registers) against the current ``scores._cmp_scores`` kernel ("base"), at
T = 8192 and 65536 with 64 query / 4 KV heads and T = 65536 with 16 / 16 heads (head dim 128,
bf16), for several BQ x BK / warps / stages tilings. Each entry has the median time, the largest
relative error against the base kernel's output (only for BK = 64), and registers / spills /
shared memory.

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 bench/experiments/scores_transposed.py

It writes ``$OUT/exp4.json``; the H100 result is stored as
``results/h100/experiments/scores-transposed.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from nsa import ops
from nsa.backends.triton_kernels import compressed as C
from nsa.backends.triton_kernels import scores as SC
from nsa.backends.triton_kernels.common import LOG2E, _dot
from nsa.backends.triton_kernels.tiles import current

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _scores_t(Q, KC, LSE, S, SP, sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
              T, Tc, NB, q_start, qk_scale2, one,
              HKV: tl.constexpr, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
              E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
              IEEE: tl.constexpr, AREG: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_q = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    t0 = pid_q * BQ
    c0 = pid_k * BK
    t_last = q_start + tl.minimum(t0 + BQ, T) - 1
    vis_last = tl.minimum(tl.maximum((t_last + 1 - L) // D + 1, 0), Tc)
    if c0 >= vis_last:
        return
    offs_q = t0 + tl.arange(0, BQ)
    q_ok = offs_q < T
    t_abs = q_start + offs_q
    nvis = tl.minimum(tl.where(t_abs + 1 < L, 0, (t_abs + 1 - L) // D + 1), Tc)
    offs_c = c0 + tl.arange(0, BK)
    offs_dk = tl.arange(0, BDK)
    kc = tl.load(KC + b * skb + h * skh + offs_c[:, None] * skt + offs_dk[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
    if AREG:
        kc = (kc.to(tl.float32) * one).to(KC.dtype.element_ty)
    q_rows = Q + b * sqb + offs_q[:, None].to(tl.int64) * sqt + offs_dk[None, :]
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
    own = tl.sum(p3 * (D * tl.minimum(R - r, E)).to(tl.float32)[None, :, None], 1)
    nxt = tl.sum(p3 * (D * tl.maximum(r + E - R, 0)).to(tl.float32)[None, :, None], 1)
    i = tl.arange(0, NBK)
    shift = (i[:, None] == i[None, :] + 1).to(tl.float32)     # row i takes nxt row i - 1
    tot = own + tl.dot(shift, nxt, input_precision="ieee")
    jb = c0 // R
    offs_j = jb + i
    rows = S + b * ssb + offs_q[None, :].to(tl.int64) * sst + h * ssh
    spill = tl.sum(tl.where(i[:, None] == NBK - 1, nxt, 0.0), 0)
    tl.store(rows + offs_j[:, None], tot, mask=q_ok[None, :] & (offs_j[:, None] < NB))
    tl.store(SP + b * spb + offs_q.to(tl.int64) * spt + h * sph + pid_k, spill, mask=q_ok & (jb + NBK < NB))


def run(T, hq, hkv):
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g)

    q = r(1, T, hq, 128)
    k, v = r(1, T, hkv, 128), r(1, T, hkv, 128)
    kc, vc = ops.compress_kv(k, v, block=32, stride=16)
    scale = 128 ** -0.5
    tiles = current(q.device)
    b, tq, tc = 1, T, kc.shape[1]
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=dev)
    o = torch.empty_like(q)
    C._launch_lse(q, kc, vc, o, lse, block=32, stride=16, scale=scale, q_start=0, tiles=tiles)
    rr, e = C._stride_map(32, 16, 64, tiles)
    nb = (T - 1) // 64 + 1
    out = {}
    ref = None
    for (bq, bk, warps, stages) in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (128, 64, 8, 2)):
        nbk = bk // rr
        s_ = torch.zeros(b, tq, hkv, nb, dtype=torch.float32, device=dev)
        sp_ = torch.zeros(b, tq, hkv, max(triton.cdiv(tc, bk), triton.cdiv(nb, nbk)), dtype=torch.float32, device=dev)
        variants = [("base", None)] if (bq, bk) == (64, 64) else []
        variants += [("trans", 0), ("trans_areg", 1)]
        for name, areg in variants:
            def launch(name=name, areg=areg, bq=bq, bk=bk, warps=warps, stages=stages, s_=s_, sp_=sp_):
                common = (q, kc, lse, s_, sp_, q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1),
                          kc.stride(2), lse.stride(0), lse.stride(1), s_.stride(0), s_.stride(1), s_.stride(2),
                          sp_.stride(0), sp_.stride(1), sp_.stride(2), tq, tc, nb, 0, scale * LOG2E)
                kw = dict(HKV=hkv, G=hq // hkv, L=32, D=16, R=rr, E=e, BQ=bq, BK=bk, DK=128, BDK=128, IEEE=False,
                          num_warps=warps, num_stages=stages)
                grid = (triton.cdiv(tc, bk), triton.cdiv(tq, bq), b * hkv)
                if name == "base":
                    return SC._cmp_scores[grid](*common, SPILL=True, **kw)
                return _scores_t[grid](*common, 1.0, AREG=areg, **kw)
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


res = {}
for T, hq, hkv in ((8192, 64, 4), (65536, 64, 4), (65536, 16, 16)):
    res[f"{T}-{hq}-{hkv}"] = run(T, hq, hkv)
with open(os.path.join(OUT, "exp4.json"), "w") as f:
    json.dump(res, f, indent=1)
