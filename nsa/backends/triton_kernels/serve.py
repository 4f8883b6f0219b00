"""The prologue of a paged decode step (nsa.serving) in one launch: from the step's projections
`P [B, cols]` (q, each K/V, the gate logits; one matmul of the layer's weights side by side) it
applies RoPE at each sequence's own position, writes the query and the sigmoid gates for the
decode kernels, the new token's K/V into the page pool, the window ring and the compression
ring, and, where the token completes a compression block (mean `phi`), the compressed token.

Programs (b, j): j < HQ: query head j; then one per (role, K or V, KV head) over the roles
(sel: the page pool; win: the window ring, separate K/V only; cmp: the compression ring); then
the gates (and `POS[b] = LEN[b]`, the position the decode kernels read); then, with AVG, one per
(K or V, KV head) for the compressed token. Every program reads the position `LEN[b]`; none
writes it (the caller advances it after the step), and the compression programs read ring rows
of earlier positions only, never the row this step writes.

RoPE: `COS`/`SIN [positions, dk/2]` fp32 tables made once by the caller with nsa.rope's own
arithmetic, so the rotation's inputs match the layer's; the rotation itself runs in fp32 here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _halves(P, col, COS, SIN, pos, HALF: tl.constexpr, BH: tl.constexpr, ROPE: tl.constexpr):
    """The two halves of a head's vector at columns `col ..` of the row P, rotated (ROPE) at `pos`."""
    i = tl.arange(0, BH)
    ok = i < HALF
    x1 = tl.load(P + col + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(P + col + HALF + i, mask=ok, other=0.0).to(tl.float32)
    if ROPE:
        c = tl.load(COS + pos.to(tl.int64) * HALF + i, mask=ok, other=0.0)
        s = tl.load(SIN + pos.to(tl.int64) * HALF + i, mask=ok, other=0.0)
        return x1 * c - x2 * s, x2 * c + x1 * s
    return x1, x2


@triton.jit
def _put(dst, a, b, HALF: tl.constexpr, BH: tl.constexpr):
    i = tl.arange(0, BH)
    ok = i < HALF
    tl.store(dst + i, a.to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + i, b.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_to(row, col, dst, COS, SIN, pos, HALF: tl.constexpr, BH: tl.constexpr, ROPE: tl.constexpr):
    """One head's vector from columns `col ..` of P's row to `dst`, rotated (ROPE) at `pos`."""
    a, b = _halves(row, col, COS, SIN, pos, HALF, BH, ROPE)
    _put(dst, a, b, HALF, BH)


@triton.jit
def _block_mean(row, col, RING, DST, b, pos, h, COS, SIN, HKV: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr,
                CMP_BLOCK: tl.constexpr, ROPE: tl.constexpr):
    """The compressed token (mean `phi`, in fp32 as avg_compress) of the block ending at `pos`, for
    KV head `h` of K or V: the new token as the ring will hold it (rounded to the cache's dtype)
    plus the `CMP_BLOCK - 1` tokens before it, read from the ring; stored at `DST`."""
    a1, a2 = _halves(row, col, COS, SIN, pos, HALF, BH, ROPE)
    a1 = a1.to(RING.dtype.element_ty).to(tl.float32)
    a2 = a2.to(RING.dtype.element_ty).to(tl.float32)
    i = tl.arange(0, BH)
    for back in range(1, CMP_BLOCK):
        src = RING + ((b.to(tl.int64) * CMP_BLOCK + (pos - back) % CMP_BLOCK) * HKV + h) * (2 * HALF)
        a1 += tl.load(src + i, mask=i < HALF, other=0.0).to(tl.float32)
        a2 += tl.load(src + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _put(DST, a1 / CMP_BLOCK, a2 / CMP_BLOCK, HALF, BH)


@triton.jit
def _serve_prologue(P, LEN, POS, PT, COS, SIN, QO, GO, KPOOL, VPOOL, KWIN, VWIN, KRING, VRING, KCMP, VCMP, spb, spt,
                    HQ: tl.constexpr, HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BHK: tl.constexpr, BHV: tl.constexpr, BG: tl.constexpr,
                    OK_SEL: tl.constexpr, OV_SEL: tl.constexpr, OK_WIN: tl.constexpr, OV_WIN: tl.constexpr,
                    OK_CMP: tl.constexpr, OV_CMP: tl.constexpr, OG: tl.constexpr, NROLE: tl.constexpr,
                    PAGE: tl.constexpr, W: tl.constexpr, CMP_BLOCK: tl.constexpr, STRIDE: tl.constexpr, NC: tl.constexpr,
                    ROPE: tl.constexpr, AVG: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(LEN + b)
    row = P + b.to(tl.int64) * spb
    HK: tl.constexpr = DK // 2
    HV: tl.constexpr = DV // 2
    NW: tl.constexpr = NROLE * 2 * HKV
    if j < HQ:
        _rotate_to(row, j * DK, QO + (b * HQ + j).to(tl.int64) * DK, COS, SIN, pos, HK, BHK, ROPE)
    elif j < HQ + NW:
        w = j - HQ
        role = w // (2 * HKV)          # 0: sel (pool), 1: cmp (ring), 2: win (ring)
        is_v = (w // HKV) % 2
        h = w % HKV
        # The destination row (of `[rows, HKV, D]`) of this token in the role's buffer.
        if role == 0:
            page = tl.load(PT + b * spt + pos // PAGE)
            r = (page.to(tl.int64) * PAGE + pos % PAGE) * HKV + h
        elif role == 1:
            r = (b.to(tl.int64) * CMP_BLOCK + pos % CMP_BLOCK) * HKV + h
        else:
            r = (b.to(tl.int64) * W + pos % W) * HKV + h
        # K heads are rotated, V heads copied; each role reads its own columns of P.
        if role == 0:
            if is_v == 0:
                _rotate_to(row, OK_SEL + h * DK, KPOOL + r * DK, COS, SIN, pos, HK, BHK, ROPE)
            else:
                _rotate_to(row, OV_SEL + h * DV, VPOOL + r * DV, COS, SIN, pos, HV, BHV, False)
        elif role == 1:
            if is_v == 0:
                _rotate_to(row, OK_CMP + h * DK, KRING + r * DK, COS, SIN, pos, HK, BHK, ROPE)
            else:
                _rotate_to(row, OV_CMP + h * DV, VRING + r * DV, COS, SIN, pos, HV, BHV, False)
        else:
            if is_v == 0:
                _rotate_to(row, OK_WIN + h * DK, KWIN + r * DK, COS, SIN, pos, HK, BHK, ROPE)
            else:
                _rotate_to(row, OV_WIN + h * DV, VWIN + r * DV, COS, SIN, pos, HV, BHV, False)
    elif j == HQ + NW:
        ig = tl.arange(0, BG)
        g = tl.load(row + OG + ig, mask=ig < HQ * 3, other=0.0).to(tl.float32)
        tl.store(GO + b.to(tl.int64) * HQ * 3 + ig, (1.0 / (1.0 + tl.exp(-g))).to(GO.dtype.element_ty),
                 mask=ig < HQ * 3)
        tl.store(POS + b, pos)
    elif AVG:
        w = j - HQ - NW - 1
        is_v = w // HKV
        h = w % HKV
        start = pos + 1 - CMP_BLOCK
        n = start // STRIDE
        if (start >= 0) & (start % STRIDE == 0) & (n < NC):
            slot = (b.to(tl.int64) * NC + n) * HKV + h
            if is_v == 0:
                _block_mean(row, OK_CMP + h * DK, KRING, KCMP + slot * DK, b, pos, h, COS, SIN, HKV, HK, BHK,
                            CMP_BLOCK, ROPE)
            else:
                _block_mean(row, OV_CMP + h * DV, VRING, VCMP + slot * DV, b, pos, h, COS, SIN, HKV, HV, BHV,
                            CMP_BLOCK, False)


def np2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))
