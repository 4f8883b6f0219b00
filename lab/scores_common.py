"""What the scores-kernel experiments share (`sel_forced_blocks.py`, `scores_anatomy.py`,
`scores_transposed.py`, `scores_q_registers.py`): their inputs, one launch with the argument list
of the production kernel (`nsa.backends.triton_kernels.scores._cmp_scores`), and that kernel's
tile prologue and SPILL epilogue, so each experiment kernel holds only the part it varies.

The prologue and epilogue are the production kernel's, copied here once: the experiments time
variants against it, and the production kernel stays as it was measured.
"""
from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from nsa import ops
from nsa.backends.triton_kernels import compressed as C
from nsa.backends.triton_kernels import scores as SC
from nsa.backends.triton_kernels.common import LOG2E
from nsa.backends.triton_kernels.tiles import current


@triton.jit
def _tile_bounds(T, Tc, q_start, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr):
    """(t0, c0, skip) of program (key tile, query tile, group): skip where the whole key tile lies
    above the query tile's causal staircase."""
    t0 = tl.program_id(1) * BQ
    c0 = tl.program_id(0) * BK
    t_last = q_start + tl.minimum(t0 + BQ, T) - 1
    vis_last = tl.minimum(tl.maximum((t_last + 1 - CMP_BLOCK) // STRIDE + 1, 0), Tc)
    return t0, c0, c0 >= vis_last


@triton.jit
def _tile_rows(Q, KC, sqb, sqt, skb, skt, skh, T, Tc, q_start, t0, c0,
               HKV: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
               DK: tl.constexpr, BDK: tl.constexpr):
    """(b, h, offs_q, q_ok, nvis, offs_c, offs_dk, kc, q_rows): the tile's queries, each one's
    visible compressed count, the compressed keys `[BK, BDK]` and the query rows' base pointers
    (add `head * sqh`)."""
    bh = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    offs_q = t0 + tl.arange(0, BQ)
    q_ok = offs_q < T
    t_abs = q_start + offs_q
    nvis = tl.minimum(tl.where(t_abs + 1 < CMP_BLOCK, 0, (t_abs + 1 - CMP_BLOCK) // STRIDE + 1), Tc)
    offs_c = c0 + tl.arange(0, BK)
    offs_dk = tl.arange(0, BDK)
    kc = tl.load(KC + b * skb + h * skh + offs_c[:, None] * skt + offs_dk[None, :],
                 mask=(offs_c[:, None] < Tc) & (offs_dk[None, :] < DK), other=0.0)
    q_rows = Q + b * sqb + offs_q[:, None].to(tl.int64) * sqt + offs_dk[None, :]
    return b, h, offs_q, q_ok, nvis, offs_c, offs_dk, kc, q_rows


@triton.jit
def _spill_store(acc, S, SP, b, h, offs_q, q_ok, nvis, offs_c, c0, ssb, sst, ssh, spb, spt, sph, NB,
                 BQ: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, E: tl.constexpr, STRIDE: tl.constexpr):
    """The summed probabilities `acc [BQ, BK]` -> block scores of the tile's columns in `S` and
    the spill into the next tile's first block in `SP` (the production kernel's SPILL mode)."""
    acc = tl.where((offs_c[None, :] < nvis[:, None]) & q_ok[:, None], acc, 0.0)
    NBK: tl.constexpr = BK // R
    tot, nxt = SC._block_map(acc, BQ, NBK, R, E, STRIDE)
    i = tl.arange(0, NBK)
    jb = c0 // R
    offs_j = jb + i
    rows = S + b * ssb + offs_q[:, None].to(tl.int64) * sst + h * ssh
    spill = tl.sum(tl.where(i[None, :] == NBK - 1, nxt, 0.0), 1)
    tl.store(rows + offs_j[None, :], tot, mask=q_ok[:, None] & (offs_j[None, :] < NB))
    tl.store(SP + b * spb + offs_q.to(tl.int64) * spt + h * sph + tl.program_id(0), spill,
             mask=q_ok & (jb + NBK < NB))


def inputs(T: int, hq: int, hkv: int, *, dev: str = "cuda", dtype: torch.dtype = torch.bfloat16, dk: int = 128,
           block: int = 32, stride: int = 16, sel_block: int = 64) -> types.SimpleNamespace:
    """Random q, k, v (seed 0, drawn in that order) of one sequence, the compressed keys and
    values, and each row's log-sum-exp by the Triton one-pass kernel: what the scores kernel
    reads. `dev="cpu"` with fp32 runs under TRITON_INTERPRET=1 (the check of the variants)."""
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dtype, generator=g)

    q = r(1, T, hq, dk)
    k, v = r(1, T, hkv, dk), r(1, T, hkv, dk)
    kc, vc = ops.compress_kv(k, v, block=block, stride=stride)
    scale = dk ** -0.5
    tiles = current(q.device)
    lse = torch.empty(1, hq, T, dtype=torch.float32, device=dev)
    C._launch_lse(q, kc, vc, torch.empty_like(q), lse, block=block, stride=stride, scale=scale, q_start=0,
                  tiles=tiles)
    rr, e = C._stride_map(block, stride, sel_block, tiles)
    return types.SimpleNamespace(q=q, k=k, v=v, kc=kc, vc=vc, scale=scale, tiles=tiles, lse=lse, rr=rr, e=e,
                                 T=T, hq=hq, hkv=hkv, dk=dk, block=block, stride=stride, sel_block=sel_block,
                                 tc=kc.shape[1], nb=(T - 1) // sel_block + 1)


def buffers(x: types.SimpleNamespace, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed scores `[1, T, Hkv, Nb]` and the spill buffer for key tiles of `bk` compressed tokens."""
    nbk = bk // x.rr
    s = torch.zeros(1, x.T, x.hkv, x.nb, dtype=torch.float32, device=x.q.device)
    sp = torch.zeros(1, x.T, x.hkv, max(triton.cdiv(x.tc, bk), triton.cdiv(x.nb, nbk)), dtype=torch.float32,
                     device=x.q.device)
    return s, sp


def launch(kern, x: types.SimpleNamespace, s: torch.Tensor, sp: torch.Tensor, bq: int, bk: int, warps: int,
           stages: int | None, *extra, **constexprs):
    """`kern` over the (key tile, query tile, KV group) grid with the production kernel's
    arguments, then `extra` positional ones, and its constexprs plus `constexprs`."""
    q, kc, lse = x.q, x.kc, x.lse
    opts = {"num_warps": warps} | ({"num_stages": stages} if stages is not None else {})
    return kern[(triton.cdiv(x.tc, bk), triton.cdiv(x.T, bq), x.hkv)](
        q, kc, lse, s, sp, q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
        lse.stride(0), lse.stride(1), s.stride(0), s.stride(1), s.stride(2), sp.stride(0), sp.stride(1),
        sp.stride(2), x.T, x.tc, x.nb, 0, x.scale * LOG2E, *extra,
        HKV=x.hkv, G=x.hq // x.hkv, CMP_BLOCK=x.block, STRIDE=x.stride, R=x.rr, E=x.e, BQ=bq, BK=bk, DK=x.dk, BDK=x.dk,
        IEEE=q.dtype == torch.float32, **constexprs, **opts)
