"""fp64 oracle: NSA written per token, straight from docs/nsa.md.

Deliberately naive and independent of the fast paths: it imports nothing from nsa except the
config, rebuilds every visibility rule with explicit comparisons, and loops over batch, query
positions and heads. Small T only (it is O(B * T * Hq * T) Python work).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nsa.config import NSAConfig


def _attend_heads(q: Tensor, k: Tensor, v: Tensor, key_pos: list[int], group: int, scale: float) -> Tensor:
    """Query `q [Hq, dk]` of one token over the raw positions `key_pos` of `k/v [Tk, Hkv, D]`.

    Query head h reads KV head h // group. No keys -> zeros."""
    hq = q.shape[0]
    if not key_pos:
        return torch.zeros(hq, v.shape[-1], dtype=torch.float64)
    heads = torch.arange(hq) // group
    kk = k[key_pos][:, heads]                                   # [n, Hq, dk]
    vv = v[key_pos][:, heads]                                   # [n, Hq, dv]
    logits = torch.einsum("hd,nhd->hn", q, kk) * scale
    w = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    return torch.einsum("hn,nhd->hd", w / w.sum(dim=1, keepdim=True), vv)


def _d(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64).cpu()


def compress_avg(k: Tensor, block: int, stride: int) -> Tensor:
    """`[B, T, H, D]` -> `[B, Tc, H, D]`, token i = mean of raw tokens i*d .. i*d + l - 1."""
    k = _d(k)
    out = []
    i = 0
    while i * stride + block <= k.shape[1]:
        out.append(sum(k[:, i * stride + j] for j in range(block)) / block)
        i += 1
    if not out:
        return k.new_zeros(k.shape[0], 0, *k.shape[2:])
    return torch.stack(out, dim=1)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int,
                         scale: float | None = None, q_start: int = 0) -> Tensor:
    q, kc, vc = _d(q), _d(k_cmp), _d(v_cmp)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b_, tq, hq, _ = q.shape
    group = hq // kc.shape[2]
    out = torch.zeros(b_, tq, hq, vc.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for ti in range(tq):
            t = q_start + ti
            visible = [i for i in range(kc.shape[1]) if i * stride + block - 1 <= t]
            out[b, ti] = _attend_heads(q[b, ti], kc[b], vc[b], visible, group, scale)
    return out


def select_blocks(q: Tensor, k_cmp: Tensor, *, block: int, stride: int, sel_block: int, sel_count: int,
                  scale: float | None = None, q_start: int = 0) -> Tensor:
    q, kc = _d(q), _d(k_cmp)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b_, tq, hq, _ = q.shape
    hkv = kc.shape[2]
    group = hq // hkv
    out = torch.full((b_, tq, hkv, sel_count), -1, dtype=torch.int64)
    for b in range(b_):
        for ti in range(tq):
            t = q_start + ti
            visible = [i for i in range(kc.shape[1]) if i * stride + block - 1 <= t]
            n_blocks = t // sel_block + 1        # candidates: j * l' <= t
            for g in range(hkv):
                score = [0.0] * n_blocks
                for h in range(g * group, (g + 1) * group):
                    if not visible:
                        continue
                    logits = [float(kc[b, i, g] @ q[b, ti, h]) * scale for i in visible]
                    m = max(logits)
                    ex = [math.exp(x - m) for x in logits]
                    total = sum(ex)
                    for i, e in zip(visible, ex, strict=True):
                        p = e / total
                        for j in range(n_blocks):
                            lo = max(i * stride, j * sel_block)
                            hi = min(i * stride + block, (j + 1) * sel_block)
                            if hi > lo:
                                score[j] += p * (hi - lo)
                cur = t // sel_block
                forced = sorted({0, cur} | ({cur - 1} if cur - 1 >= 0 else set()))
                rest = sorted((j for j in range(n_blocks) if j not in forced), key=lambda j: (-score[j], j))
                chosen = sorted((forced + rest)[:sel_count])
                out[b, ti, g, :len(chosen)] = torch.tensor(chosen)
    return out


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, *, sel_block: int,
                       scale: float | None = None, q_start: int = 0) -> Tensor:
    q, k, v = _d(q), _d(k), _d(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b_, tq, hq, _ = q.shape
    group = hq // k.shape[2]
    out = torch.zeros(b_, tq, hq, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for ti in range(tq):
            t = q_start + ti
            for g in range(k.shape[2]):
                blocks = {int(j) for j in block_indices[b, ti, g] if int(j) >= 0}
                keys = [s for s in range(k.shape[1]) if s <= t and s // sel_block in blocks]
                heads = slice(g * group, (g + 1) * group)
                out[b, ti, heads] = _attend_heads(q[b, ti, heads], k[b, :, g:g + 1], v[b, :, g:g + 1], keys,
                                                  group, scale)
    return out


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float | None = None,
                             q_start: int = 0) -> Tensor:
    q, k, v = _d(q), _d(k), _d(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b_, tq, hq, _ = q.shape
    group = hq // k.shape[2]
    out = torch.zeros(b_, tq, hq, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for ti in range(tq):
            t = q_start + ti
            keys = [s for s in range(max(0, t - window + 1), t + 1) if s < k.shape[1]]
            out[b, ti] = _attend_heads(q[b, ti], k[b], v[b], keys, group, scale)
    return out


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> Tensor:
    """Full causal attention (coverage equivalences: big window / all blocks selected)."""
    return sliding_window_attention(q, k, v, window=k.shape[1] + q.shape[1], scale=scale)


def _rope(x: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE, position by position."""
    out = x.clone()
    half = x.shape[-1] // 2
    for t in range(x.shape[1]):
        for i in range(half):
            ang = t * theta ** (-i / half)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[:, t, :, i], x[:, t, :, i + half]
            out[:, t, :, i] = a * c - b * s
            out[:, t, :, i + half] = b * c + a * s
    return out


def _mlp_compress(x: Tensor, phi: torch.nn.Module, block: int, stride: int) -> Tensor:
    pos, w1, b1, w2, b2 = (_d(p) for p in (phi.pos, phi.fc1.weight, phi.fc1.bias, phi.fc2.weight, phi.fc2.bias))
    out = []
    i = 0
    while i * stride + block <= x.shape[1]:
        blk = x[:, i * stride:i * stride + block] + pos[None, :, None, :]       # [B, l, H, D]
        flat = blk.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)      # [B, H, l*D]
        hidden = torch.nn.functional.gelu(flat @ w1.T + b1)
        out.append(hidden @ w2.T + b2)
        i += 1
    if not out:
        return x.new_zeros(x.shape[0], 0, x.shape[2], w2.shape[0])
    return torch.stack(out, dim=1)


def module_forward(module: torch.nn.Module, x: Tensor, branches: tuple[str, ...] = ("cmp", "sel", "win")) -> Tensor:
    """The whole NSAAttention prefill in fp64 from the module's weights: `[B, T, dim] -> [B, T, dim]`."""
    c: NSAConfig = module.config
    x = _d(x)
    b_, t_, _ = x.shape
    scale = c.scale if c.scale is not None else c.head_dim_qk ** -0.5

    def lin(layer: torch.nn.Linear, inp: Tensor) -> Tensor:
        y = inp @ _d(layer.weight).T
        return y + _d(layer.bias) if layer.bias is not None else y

    q = lin(module.q_proj, x).view(b_, t_, c.n_heads, c.head_dim_qk)
    q = _rope(q, c.rope_theta) if c.rope else q
    kv = {}
    for name in (("cmp", "sel", "win") if c.kv == "separate" else ("shared",)):
        k = lin(module.k_proj[name], x).view(b_, t_, c.n_kv_heads, c.head_dim_qk)
        v = lin(module.v_proj[name], x).view(b_, t_, c.n_kv_heads, c.head_dim_v)
        kv[name] = (_rope(k, c.rope_theta) if c.rope else k, v)

    def branch_kv(branch: str) -> tuple[Tensor, Tensor]:
        return kv[branch if c.kv == "separate" else "shared"]

    gates = torch.sigmoid(lin(module.gate, x)).view(b_, t_, c.n_heads, 3)
    k_c, v_c = branch_kv("cmp")
    if c.phi == "mlp":
        kc = _mlp_compress(k_c, module.phi_k, c.cmp_block, c.cmp_stride)
        vc = _mlp_compress(v_c, module.phi_v, c.cmp_block, c.cmp_stride)
    else:
        kc, vc = compress_avg(k_c, c.cmp_block, c.cmp_stride), compress_avg(v_c, c.cmp_block, c.cmp_stride)
    out = torch.zeros(b_, t_, c.n_heads, c.head_dim_v, dtype=torch.float64)
    if "cmp" in branches:
        out += gates[..., 0:1] * compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, scale=scale)
    if "sel" in branches:
        idx = select_blocks(q, kc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                            sel_count=c.sel_count, scale=scale)
        out += gates[..., 1:2] * selected_attention(q, *branch_kv("sel"), idx, sel_block=c.sel_block, scale=scale)
    if "win" in branches:
        out += gates[..., 2:3] * sliding_window_attention(q, *branch_kv("win"), window=c.window, scale=scale)
    return lin(module.o_proj, out.reshape(b_, t_, -1))


def decode_reads(t: int, block_indices_row: Tensor, c: NSAConfig) -> tuple[int, list[list[int]], int]:
    """Spec read counts at position t: cmp `n_cmp(t)`, sel per (b, group), win `min(w, t+1)`."""
    n_cmp = 0 if t + 1 < c.cmp_block else (t + 1 - c.cmp_block) // c.cmp_stride + 1
    sel = [[sum(1 for j in row if j >= 0 for s in range(j * c.sel_block, (j + 1) * c.sel_block) if s <= t)
            for row in per_b.tolist()] for per_b in block_indices_row]
    return n_cmp, sel, min(c.window, t + 1)


# --- differentiable oracle (gradients) ----------------------------------------------------------
# The functions above detach (they compute outputs only). The gradient checks need autograd through
# the same rules: the visibility of each branch as an explicit boolean table, then dense masked
# attention in the inputs' own dtype (fp64 for the oracle, the kernel's dtype for the same-dtype
# torch path FlashAttention's tolerance rule compares with). Small T only: O(T * Tk) per head.

def window_visible(tq: int, tk: int, window: int, q_start: int = 0, k_start: int = 0) -> Tensor:
    """`[1, Tq, 1, Tk]`: query t sees raw key s iff `t - w < s <= t`."""
    vis = torch.zeros(1, tq, 1, tk, dtype=torch.bool)
    for i in range(tq):
        t = q_start + i
        for j in range(tk):
            s = k_start + j
            vis[0, i, 0, j] = t - window < s <= t
    return vis


def compressed_visible(tq: int, tc: int, block: int, stride: int, q_start: int = 0) -> Tensor:
    """`[1, Tq, 1, Tc]`: query t sees compressed token i iff `i*d + l - 1 <= t`."""
    vis = torch.zeros(1, tq, 1, tc, dtype=torch.bool)
    for i in range(tq):
        for c in range(tc):
            vis[0, i, 0, c] = c * stride + block - 1 <= q_start + i
    return vis


def selected_visible(block_indices: Tensor, tk: int, sel_block: int, q_start: int = 0) -> Tensor:
    """`[B, Tq, Hkv, Tk]`: query t of group g sees raw key s iff s's block is among the row's
    indices (a repeat counts once, -1 is no block) and `s <= t`."""
    b_, tq, hkv, _ = block_indices.shape
    vis = torch.zeros(b_, tq, hkv, tk, dtype=torch.bool)
    for b in range(b_):
        for i in range(tq):
            for g in range(hkv):
                blocks = {int(j) for j in block_indices[b, i, g] if int(j) >= 0}
                for s in range(tk):
                    vis[b, i, g, s] = s // sel_block in blocks and s <= q_start + i
    return vis


def attention_ad(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float | None = None) -> Tensor:
    """Differentiable attention `[B, Tq, Hq, dv]` under `visible [B|1, Tq, Hkv|1, Tk]` in q's dtype;
    query head h reads KV head `h // (Hq / Hkv)`; a row that sees nothing gives 0 (and 0 gradient)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    vis = visible.to(q.device)
    vis = vis.expand(q.shape[0], q.shape[1], k.shape[2], k.shape[1]).repeat_interleave(group, 2)  # [B, Tq, Hq, Tk]
    logits = torch.einsum("bthd,bshd->bths", q, kk) * scale
    logits = logits.masked_fill(~vis, float("-inf"))
    any_vis = vis.any(-1, keepdim=True)
    w = torch.softmax(torch.where(any_vis, logits, torch.zeros_like(logits)), -1) * any_vis
    return torch.einsum("bths,bshd->bthd", w, vv)
