"""Test helpers: random inputs (never zeros), the error measure, and the near-tie check of two
block selections."""

from __future__ import annotations

import torch
from torch import Tensor

# The device of the tests that run on a GPU or else under Triton's interpreter: "cuda" where torch
# sees a GPU. Set by tests/conftest.py's pytest_configure hook, before any test module is imported,
# so that no module probes CUDA at import; outside pytest it stays "cpu".
DEV = "cpu"


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def qkv(b: int, t: int, hq: int, hkv: int, dk: int, dv: int, dtype: torch.dtype = torch.float32,
        device: str = "cpu", tk: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    tk = t if tk is None else tk
    return (rand(b, t, hq, dk, dtype=dtype, device=device), rand(b, tk, hkv, dk, dtype=dtype, device=device),
            rand(b, tk, hkv, dv, dtype=dtype, device=device))


def rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    denom = ref.norm()
    return float((out - ref).norm() / denom) if denom > 0 else float((out - ref).norm())


def fp64_group_scores(q_t: Tensor, k_cmp: Tensor, config, t: int) -> Tensor:
    """The fp64 group scores `[B, Hkv, Nb]` (Eq. 9-10) of one query `q_t [B, 1, Hq, dk]` at position `t`."""
    from nsa.selection import compressed_probs, overlap_weights

    c = config
    nb = t // c.sel_block + 1
    p = compressed_probs(q_t.double().cpu(), k_cmp.double().cpu(), torch.tensor([t]), block=c.cmp_block,
                         stride=c.cmp_stride, scale=c.softmax_scale)
    w = overlap_weights(k_cmp.shape[1], nb, c.cmp_block, c.cmp_stride, c.sel_block, "cpu", torch.float64)
    return (p @ w).view(q_t.shape[0], c.n_kv_heads, -1, nb).sum(2)


def assert_near_tie_flip(score: Tensor, idx_a: Tensor, idx_b: Tensor, where: str) -> None:
    """Two fp32 selections (different summation orders) cannot order blocks whose scores differ by
    rounding: accept block sets `idx_a`, `idx_b` (`[B, 1, Hkv, n]`) that differ only where each
    block in one and not the other has a partner in the difference whose fp64 score (`score
    [B, Hkv, Nb]`) is within 1e-5 of the row's largest."""
    for b in range(score.shape[0]):
        for g in range(score.shape[1]):
            a = {int(j) for j in idx_a[b, 0, g] if j >= 0}
            d = {int(j) for j in idx_b[b, 0, g] if j >= 0}
            for j1 in a ^ d:
                gaps = [abs(float(score[b, g, j1] - score[b, g, j2])) for j2 in (a ^ d) - {j1}]
                assert gaps and min(gaps) < 1e-5 * float(score[b, g].abs().max()), (
                    f"{where}, b {b} group {g}: blocks {sorted(a)} vs {sorted(d)} differ by more than a near-tie")


def selection_is_ambiguous(m, x: Tensor, t: int, rel: float = 1e-5) -> bool:
    """Whether fp32 rounding may pick either of two blocks at position t of prompt `x [B, T, dim]`
    through layer `m`: for some (sequence, KV group), the last block taken by the top-n and the
    first one left out have fp64 group scores within `rel` of the row's largest."""
    c = m.config
    with torch.no_grad():
        q, kv, _ = m.project(x[:, :t + 1])
        kc, _ = m.compress(*kv[m._kv_name("cmp")])
        score = fp64_group_scores(q[:, t:t + 1], kc, c, t)
    cur = t // c.sel_block
    forced = {0, cur, cur - 1} - {-1}
    free = c.sel_count - len(forced)
    for row in score.flatten(0, 1):
        rest = sorted((float(row[j]) for j in range(cur + 1) if j not in forced), reverse=True)
        if 0 < free < len(rest) and rest[free - 1] - rest[free] < rel * float(row.abs().max()):
            return True
    return False


def assert_close_but_near_ties(m, x: Tensor, out: Tensor, ref: Tensor, where: str, tol: float = 1e-5,
                               start: int = 0) -> None:
    """`out` and `ref` (`[B, T, dim]`, positions `start ..` of prompt `x`) agree within `tol` relative
    error at every position, except where the selection is ambiguous at fp32 rounding (two paths
    of different shapes may then select different blocks: `selection_is_ambiguous`)."""
    for i in range(out.shape[1]):
        err = rel_err(out[:, i], ref[:, i])
        assert err < tol or selection_is_ambiguous(m, x, start + i), f"{where}, position {start + i}: error {err:.3g}"
