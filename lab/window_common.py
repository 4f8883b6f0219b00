"""What the window experiments share (`fa3_window.py`, `fa4_window.py`): the tiles that keep the
Triton band kernel, and the fp64 window attention they check FA-3 / FA-4 and the band kernel
against, vectorised on the inputs' device (`nsa.reference.sliding_window_attention` loops per
query in Python, too slow at T = 3000)."""
from __future__ import annotations

import dataclasses

import torch

from nsa.backends.triton_kernels.tiles import current


def band_tiles(device):
    """The device's tiles with FA-4 off: `sliding.sliding` itself takes FA-4 where it is installed
    (`Tiles.win_fa4`), and the band kernel is what FA-3 / FA-4 are compared with here."""
    return dataclasses.replace(current(device), win_fa4=False)


def ref_win(q, k, v, w, scale):
    """`q [B, T, Hq, dk]` over `k/v [B, T, Hkv, d*]` in float64, query t reading keys
    `t - w < s <= t`, GQA head h -> KV head h // G."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    t = torch.arange(q.shape[1], device=q.device)
    m = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - w)
    s = s.masked_fill(~m, float("-inf"))
    return (s.softmax(-1) @ vd).transpose(1, 2)
