"""The Triton kernels' shared softmax primitives (nsa/backends/triton_kernels/common.py) against
torch on fresh random logits in log2 units: the online update over key tiles is the one-shot
softmax, and merged partials are the softmax over the union of their keys; rows that see no key
give zeros, never NaN. Tiny shapes: each test runs in well under a second under the interpreter."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nsa.backends.triton_kernels.common import _merge_stats, _softmax_step, _softmax_tile  # noqa: E402
from tests.nsa import helpers  # noqa: E402

ROWS, KEYS, TILE, DV = 16, 64, 16, 16


@triton.jit
def _online(X, V, OUT, LSE, ROWS: tl.constexpr, KEYS: tl.constexpr, TILE: tl.constexpr, DV: tl.constexpr):
    """The first tile by `_softmax_tile`, the others by `_softmax_step`: the normalised output and
    the log2 log-sum-exp of every row."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, DV)
    c = tl.arange(0, TILE)
    x = tl.load(X + r[:, None] * KEYS + c[None, :])
    v = tl.load(V + c[:, None] * DV + d[None, :])
    m_i, p = _softmax_tile(x)
    l_i = tl.sum(p, 1)
    acc = tl.dot(p, v, input_precision="ieee")
    for k0 in range(TILE, KEYS, TILE):
        x = tl.load(X + r[:, None] * KEYS + k0 + c[None, :])
        v = tl.load(V + (k0 + c)[:, None] * DV + d[None, :])
        m_i, l_i, acc = _softmax_step(x, v, m_i, l_i, acc, True)
    empty = l_i == 0.0
    tl.store(OUT + r[:, None] * DV + d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None])
    tl.store(LSE + r, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))))


@triton.jit
def _merge(M, L, A, OUT, S: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr):
    """Partials (m, l, acc) `[S, ROWS, ...]` merged by `_merge_stats`: the normalised output."""
    s = tl.arange(0, S)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, DV)
    m = tl.load(M + s[:, None] * ROWS + r[None, :])
    den = tl.load(L + s[:, None] * ROWS + r[None, :])
    a = tl.load(A + (s[:, None, None] * ROWS + r[None, :, None]) * DV + d[None, None, :])
    _, l_tot, w = _merge_stats(m, den)
    out = tl.sum(w[:, :, None] * a, 0) / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    tl.store(OUT + r[:, None] * DV + d[None, :], out)


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in log2 units with some keys masked (-inf), one row masked whole, and values."""
    x = helpers.rand(ROWS, KEYS, device=helpers.DEV) * 4.0
    x[torch.rand(ROWS, KEYS, device=helpers.DEV) < 0.3] = float("-inf")
    x[3] = float("-inf")                      # a row that sees nothing
    x[5, :TILE] = float("-inf")               # a row whose first tile is empty
    return x.contiguous(), helpers.rand(KEYS, DV, device=helpers.DEV)


def _reference(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 softmax over the keys of logits `x` in log2 units (exp2 = exp of x * ln 2), and its log2
    log-sum-exp; an empty row gives 0 and -inf."""
    xn = x.double() * math.log(2)
    lse = torch.logsumexp(xn, 1)
    p = torch.where(torch.isinf(lse)[:, None], 0.0, torch.exp(xn - lse[:, None]))
    return p @ v.double(), lse / math.log(2)


def test_online_update_over_tiles_is_the_one_shot_softmax(seed: int) -> None:
    x, v = _logits(seed)
    o = torch.empty(ROWS, DV, device=helpers.DEV)
    lse = torch.empty(ROWS, device=helpers.DEV)
    _online[(1,)](x, v, o, lse, ROWS=ROWS, KEYS=KEYS, TILE=TILE, DV=DV)
    ref_o, ref_lse = _reference(x, v)
    assert helpers.rel_err(o, ref_o) < 1e-5
    assert torch.equal(o[3].cpu(), torch.zeros(DV))
    assert lse[3].item() == float("-inf")
    ok = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double().cpu()[ok], ref_lse.cpu()[ok], rtol=1e-5, atol=1e-5)


def test_merged_partials_are_the_softmax_over_the_union(seed: int) -> None:
    x, v = _logits(seed)
    x[7, KEYS // 2:] = float("-inf")          # a row whose second partial is empty
    halves = (slice(0, KEYS // 2), slice(KEYS // 2, KEYS))
    ms, ls, accs = [], [], []
    for part in halves:                       # each partial: (max, sum, unnormalised output), log2 units
        xp = x[:, part].double()
        m = xp.max(1).values
        p = torch.exp2(xp - torch.where(torch.isinf(m), 0.0, m)[:, None])
        ms.append(m)
        ls.append(p.sum(1))
        accs.append(p @ v[part].double())
    m, den, acc = (torch.stack(t).float().contiguous() for t in (ms, ls, accs))
    o = torch.empty(ROWS, DV, device=helpers.DEV)
    _merge[(1,)](m, den, acc, o, S=2, ROWS=ROWS, DV=DV)
    assert helpers.rel_err(o, _reference(x, v)[0]) < 1e-5
    assert torch.equal(o[3].cpu(), torch.zeros(DV))
