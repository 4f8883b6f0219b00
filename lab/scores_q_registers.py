"""The scores kernel with the queries fed to the product from registers (H100).

What it measures: a copy of the scores kernel (``_scores_qr``) where each head's query tile is
multiplied by a runtime 1.0 before the product (MODE 1: in fp32 and back to bf16; MODE 2: in
bf16), so Triton cannot fold it and feeds the wgmma A operand from registers instead of shared
memory (the ncu profile showed the kernel at 72% of L1/shared-memory throughput), against the
unchanged body (MODE 0), at T = 65536 with 64/4 and 16/16 heads (head dim 128, bf16), 2 and 3
stages. Each entry has the median time, whether the scores equal MODE 0's bit for bit, registers
and shared memory.

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 lab/scores_q_registers.py

It writes ``$OUT/exp6.json``; the H100 result is stored as
``results/h100/experiments/scores-q-registers.json``.
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
def _scores_qr(Q, KC, LSE, S, SP, sqb, sqt, sqh, skb, skt, skh, slb, slh, ssb, sst, ssh, spb, spt, sph,
               T, Tc, NB, q_start, qk_scale2, one,
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
    _spill_store(acc, S, SP, b, h, offs_q, q_ok, nvis, offs_c, c0, ssb, sst, ssh, spb, spt, sph, NB, BQ, BK, R, E, STRIDE)


def run(T, hq, hkv):
    x = scm.inputs(T, hq, hkv)
    bq, bk = 64, 64
    out, ref = {}, None
    for mode in (0, 1, 2):
        for stages in (2, 3):
            s_, sp_ = scm.buffers(x, bk)

            def launch(mode=mode, stages=stages, s_=s_, sp_=sp_):
                return scm.launch(_scores_qr, x, s_, sp_, bq, bk, 4, stages, 1.0, MODE=mode)
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


if __name__ == "__main__":
    res = {f"{T}-{hq}-{hkv}": run(T, hq, hkv) for T, hq, hkv in ((65536, 64, 4), (65536, 16, 16))}
    atomic.write_text(os.path.join(OUT, "exp6.json"), json.dumps(res, indent=1))
