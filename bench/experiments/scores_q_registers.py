"""The scores kernel with the queries fed to the product from registers (H100).

What it measures: a copy of the scores kernel (``_scores_qr``) where each head's query tile is
multiplied by a runtime 1.0 before the product (MODE 1: in fp32 and back to bf16; MODE 2: in
bf16), so Triton cannot fold it and feeds the wgmma A operand from registers instead of shared
memory (the ncu profile showed the kernel at 72% of L1/shared-memory throughput), against the
unchanged body (MODE 0), at T = 65536 with 64/4 and 16/16 heads (head dim 128, bf16), 2 and 3
stages. Each entry has the median time, whether the scores equal MODE 0's bit for bit, registers
and shared memory.

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 bench/experiments/scores_q_registers.py

It writes ``$OUT/exp6.json``; the H100 result is stored as
``results/h100/experiments/scores-q-registers.json``.
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
def _scores_qr(Q, KC, LSE, S, SP, sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
               T, Tc, NB, q_start, qk_scale2, one,
               HKV: tl.constexpr, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               E: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
               IEEE: tl.constexpr, MODE: tl.constexpr):
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
    kt = tl.trans(kc)
    q_rows = Q + b * sqb + offs_q[:, None].to(tl.int64) * sqt + offs_dk[None, :]
    acc = tl.zeros([BQ, BK], tl.float32)
    for g in range(G):
        head = h * G + g
        q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if MODE == 1:
            q = (q.to(tl.float32) * one).to(Q.dtype.element_ty)
        elif MODE == 2:
            q = q * one.to(Q.dtype.element_ty)
        lse2 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
        s = _dot(q, kt, IEEE)
        acc += tl.exp2(s * qk_scale2 - lse2[:, None])
    acc = tl.where((offs_c[None, :] < nvis[:, None]) & q_ok[:, None], acc, 0.0)
    NBK: tl.constexpr = BK // R
    tot, nxt = SC._block_map(acc, BQ, NBK, R, E, D)
    i = tl.arange(0, NBK)
    jb = c0 // R
    offs_j = jb + i
    rows = S + b * ssb + offs_q[:, None].to(tl.int64) * sst + h * ssh
    spill = tl.sum(tl.where(i[None, :] == NBK - 1, nxt, 0.0), 1)
    tl.store(rows + offs_j[None, :], tot, mask=q_ok[:, None] & (offs_j[None, :] < NB))
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
    bq, bk = 64, 64
    nbk = bk // rr
    out, ref = {}, None
    for mode in (0, 1, 2):
        for stages in (2, 3):
            s_ = torch.zeros(b, tq, hkv, nb, dtype=torch.float32, device=dev)
            sp_ = torch.zeros(b, tq, hkv, max(triton.cdiv(tc, bk), triton.cdiv(nb, nbk)), dtype=torch.float32,
                              device=dev)

            def launch(mode=mode, stages=stages, s_=s_, sp_=sp_):
                return _scores_qr[(triton.cdiv(tc, bk), triton.cdiv(tq, bq), b * hkv)](
                    q, kc, lse, s_, sp_, q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1),
                    kc.stride(2), lse.stride(0), lse.stride(1), s_.stride(0), s_.stride(1), s_.stride(2),
                    sp_.stride(0), sp_.stride(1), sp_.stride(2), tq, tc, nb, 0, scale * LOG2E, 1.0,
                    HKV=hkv, G=hq // hkv, L=32, D=16, R=rr, E=e, BQ=bq, BK=bk, DK=128, BDK=128, IEEE=False,
                    MODE=mode, num_warps=4, num_stages=stages)
            key = f"mode{mode}-s{stages}"
            try:
                kern = launch()
                torch.cuda.synchronize()
                if ref is None:
                    ref = s_.clone()
                same = bool(torch.equal(s_, ref))
                ms = do_bench(launch, warmup=5, rep=30, return_mode="median")
                out[key] = {"ms": ms, "same_as_mode0": same, "regs": kern.n_regs, "shared": kern.metadata.shared}
            except Exception as ex:  # noqa: BLE001
                out[key] = {"error": repr(ex)[:300]}
            print(T, hq, hkv, key, out[key], flush=True)
    return out


res = {}
for T, hq, hkv in ((65536, 64, 4), (65536, 16, 16)):
    res[f"{T}-{hq}-{hkv}"] = run(T, hq, hkv)
with open(os.path.join(OUT, "exp6.json"), "w") as f:
    json.dump(res, f, indent=1)
