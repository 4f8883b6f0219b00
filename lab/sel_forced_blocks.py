"""Selection-kernel and scores-kernel experiment (H100).

What it measures, for T = 8192 and 65536 (64 query heads, 4 KV heads, head dim 128, bf16):

* the selection kernel (``selection.selected``) time with num_stages 2 and 3 for three index sets:
  the real top-k indices ("real"), the real ones with the forced blocks (block 0 and the query's
  own and previous block) replaced by -1 ("free": what dropping the forced blocks would save),
  and the same blocks for every query ("same": does L1 reuse make it faster);
* whether the forced blocks sit at positions 0, 14, 15 of full index rows;
* the Triton sliding-window kernel time (window 512);
* the current compressed-scores kernel against a software-pipelined variant (``_scores_pp``,
  MODE 1: next head's product issued before this head's exp; MODE 2: two heads per step) for
  a few warps/stages, with whether its output is bit-identical to the current kernel.

Needs a CUDA GPU (it was run on an H100 in this project). Rerun from the repo root with

    PYTHONPATH=$PWD OUT=<dir> python3 lab/sel_forced_blocks.py

It writes ``$OUT/exp1.json``; the H100 result is stored as
``results/h100/experiments/forced-same-scores-pp.json``.
"""
import dataclasses
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
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import scores as SC
from nsa.backends.triton_kernels import selection as S
from nsa.backends.triton_kernels.common import _dot

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _scores_pp(Q, KC, LSE, S, SP,
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
    if MODE == 1:   # software pipelined: the next head's product issued before this head's exp
        head = h * G
        q = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        s = _dot(q, kt, IEEE)
        for g in range(1, G):
            head = h * G + g
            qn = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            sn = _dot(qn, kt, IEEE)
            lse2 = tl.load(LSE + b * slb + (head - 1) * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            acc += tl.exp2(s * qk_scale2 - lse2[:, None])
            s = sn
        lse2 = tl.load(LSE + b * slb + (h * G + G - 1) * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
        acc += tl.exp2(s * qk_scale2 - lse2[:, None])
    else:           # two heads per step: two products, then two exps
        for g in range(0, G, 2):
            head = h * G + g
            q0 = tl.load(q_rows + head * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            q1 = tl.load(q_rows + (head + 1) * sqh, mask=q_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            s0 = _dot(q0, kt, IEEE)
            s1 = _dot(q1, kt, IEEE)
            l0 = tl.load(LSE + b * slb + head * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            l1 = tl.load(LSE + b * slb + (head + 1) * slh + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
            acc += tl.exp2(s0 * qk_scale2 - l0[:, None])
            acc += tl.exp2(s1 * qk_scale2 - l1[:, None])
    _spill_store(acc, S, SP, b, h, offs_q, q_ok, nvis, offs_c, c0, ssb, sst, ssh, spb, spt, sph, NB, BQ, BK, R, E, STRIDE)


def run(T, hq=64, hkv=4):
    x = scm.inputs(T, hq, hkv)
    q, k, v, scale, tiles = x.q, x.k, x.v, x.scale, x.tiles
    dev = q.device
    _, idx = triton_nsa.compressed_select(q, x.kc, x.vc, block=32, stride=16, sel_block=64, sel_count=16,
                                          scale=scale)
    key = f"{T}-{hq}-{hkv}"
    out = {}
    t = torch.arange(T, device=dev).view(1, T, 1, 1)
    i = t // 64
    forced = (idx == 0) | (idx == i) | (idx == i - 1)
    idx_free = torch.where(forced, torch.full_like(idx, -1), idx)
    same = torch.cat([torch.zeros_like(idx[..., :1]), torch.arange(1, 14, device=dev, dtype=idx.dtype).expand(*idx.shape[:3], 13),
                      (i - 1).clamp(min=0).to(idx.dtype).expand(*idx.shape[:3], 1), i.to(idx.dtype).expand(*idx.shape[:3], 1)], -1)
    print("forced per row (mean)", forced.sum(-1).float().mean().item(), flush=True)
    for name, ix in (("real", idx), ("free", idx_free), ("same", same)):
        for st in (2, 3):
            tl_ = dataclasses.replace(tiles, sel_stages=st)

            def f(ix=ix, tl_=tl_):
                return S.selected(q, k, v, ix, sel_block=64, scale=scale, q_start=0, k_start=0, tiles=tl_)

            out[f"sel_{name}_st{st}"] = do_bench(f, warmup=5, rep=50, return_mode="median")
        print(key, name, out[f"sel_{name}_st2"], out[f"sel_{name}_st3"], flush=True)
    # sorted-by-nothing check: are forced blocks at positions 0, -2, -1 of full rows?
    full = (i >= 15).expand_as(idx[..., :1]).squeeze(-1)
    pos_ok = ((idx[..., 0] == 0) & (idx[..., 14] == (i - 1).squeeze(-1)) & (idx[..., 15] == i.squeeze(-1)))
    out["forced_pos_ok_full_rows"] = bool(pos_ok[full].all().item())
    # window kernel time (triton, win tiles default)

    def fw():
        return triton_nsa._win.sliding(q, k, v, window=512, scale=scale, q_start=0, k_start=0, tiles=tiles)

    out["win"] = do_bench(fw, warmup=5, rep=50, return_mode="median")
    # scores kernel variants on one lse
    bq, bk = tiles.scr_bq, tiles.scr_bk
    s_ref, sp_ref = scm.buffers(x, bk)

    def base():
        return scm.launch(SC._cmp_scores, x, s_ref, sp_ref, bq, bk, tiles.scr_warps, tiles.scr_stages, SPILL=True)

    base()
    out["scr_base"] = do_bench(base, warmup=5, rep=30, return_mode="median")
    for mode in (1, 2):
        for warps, stages in ((4, 2), (4, 3), (8, 2)):
            s2, sp2 = torch.zeros_like(s_ref), torch.zeros_like(sp_ref)

            def variant(s2=s2, sp2=sp2, warps=warps, stages=stages, mode=mode):
                return scm.launch(_scores_pp, x, s2, sp2, bq, bk, warps, stages, MODE=mode)

            try:
                variant()
                same_ = bool(torch.equal(s2, s_ref) and torch.equal(sp2, sp_ref))
                tm = do_bench(variant, warmup=5, rep=30, return_mode="median")
            except Exception as ex:  # noqa: BLE001
                same_, tm = repr(ex)[:200], None
            out[f"scr_mode{mode}_w{warps}_s{stages}"] = (tm, same_)
            print(key, mode, warps, stages, tm, same_, flush=True)
    print(key, json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    res = {f"{T}-64-4": run(T) for T in (8192, 65536)}
    atomic.write_text(os.path.join(OUT, "exp1.json"), json.dumps(res, indent=1))
