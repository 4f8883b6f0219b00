"""NSAAttention: the paper's three-branch attention layer, prefill and cached decode.

`o_t = sum_c sigmoid(gate_c(x_t)) * attn_c(q_t)` over c in (cmp, sel, win), one gate per query
head per branch (paper Eq. 5). Each branch has its own K/V projections (`kv="separate"`, the
paper) or all share one (`kv="shared"`). RoPE is applied to queries and raw keys (nsa.rope).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from nsa import dispatch, ops
from nsa.backends import AttnCall
from nsa.backends.sdpa import masked_attention
from nsa.compression import MLPCompressor, avg_compress
from nsa.config import NSAConfig
from nsa.rope import apply_rope

BRANCHES = ("cmp", "sel", "win")


def decode_read_budget(seq_len: int, config: NSAConfig) -> int:
    """The paper's per-step token budget (Table 4): `s/d + n*l' + w` (an upper bound)."""
    return seq_len // config.cmp_stride + config.sel_count * config.sel_block + config.window


@dataclass
class ReadCounts:
    """Tokens one decode step handed to each branch's kernel.

    `cmp`: compressed tokens; `sel`: `[B, Hkv]` raw tokens of the selected blocks that are `<= t`
    (each KV group selects its own blocks); `win`: raw tokens of the window.
    """

    cmp: int = 0
    sel: Tensor | None = None
    win: int = 0
    sel_blocks: Tensor | None = None  # [B, 1, Hkv, n] blocks the step selected

    @property
    def sel_mean(self) -> float:
        return 0.0 if self.sel is None else float(self.sel.float().mean())


class _Buffer:
    """Append-only `[B, L, H, D]` token buffer with amortised O(1) appends.

    `keep=None` keeps everything; `keep=w` keeps (at least) the last w tokens, sliding them to the
    front when the capacity `2w` fills up, so a window cache never grows with the sequence.
    """

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self.data: Tensor | None = None
        self.n = 0

    def append(self, x: Tensor) -> None:
        if self.data is None:
            cap = max(2 * (self.keep or 0), 2 * x.shape[1], 16)
            self.data = x.new_empty(x.shape[0], cap, *x.shape[2:])
        if self.n + x.shape[1] > self.data.shape[1]:
            if self.keep is not None and x.shape[1] <= self.keep:
                tail = self.data[:, self.n - self.keep:self.n].clone() if self.n > self.keep else self.data[:, :self.n].clone()
                self.data[:, :tail.shape[1]] = tail
                self.n = tail.shape[1]
            if self.n + x.shape[1] > self.data.shape[1]:
                grown = x.new_empty(x.shape[0], 2 * (self.n + x.shape[1]), *x.shape[2:])
                grown[:, :self.n] = self.data[:, :self.n]
                self.data = grown
        self.data[:, self.n:self.n + x.shape[1]] = x
        self.n += x.shape[1]

    def view(self, last: int | None = None) -> Tensor:
        assert self.data is not None, "empty buffer"
        last = self.n if last is None else min(last, self.n)
        return self.data[:, self.n - last:self.n]


@dataclass
class NSACache:
    """Decode state of one NSAAttention: created by `new_cache`, filled by `prefill`, extended by `step`.

    Holds raw K/V of the selection branch (all tokens), the last `w` K/V of the sliding branch,
    the last `l` raw K/V of the compression branch and the compressed stream. With `kv="shared"`
    one raw buffer serves all three.
    """

    length: int = 0
    raw: dict[str, tuple[_Buffer, _Buffer]] = field(default_factory=dict)
    # The compressed stream, appended in amortised O(1) (a decode step never copies the stream).
    cmp: tuple[_Buffer, _Buffer] = field(default_factory=lambda: (_Buffer(), _Buffer()))
    reads: ReadCounts = field(default_factory=ReadCounts)

    @property
    def k_cmp(self) -> Tensor | None:
        """Compressed keys `[B, n_cmp, Hkv, dk]` (a view), None before the first prefill/step."""
        return self.cmp[0].view() if self.cmp[0].data is not None else None

    @property
    def v_cmp(self) -> Tensor | None:
        return self.cmp[1].view() if self.cmp[1].data is not None else None


class NSAAttention(nn.Module):
    """NSA attention layer: `[B, T, dim] -> [B, T, dim]`, causal.

    `forward(x)` is the prefill. Decode: `cache = attn.new_cache()`, `y, cache = attn.prefill(x)`
    (or start empty), then `y_t = attn.step(x_t, cache)` for `x_t [B, 1, dim]`; every step output
    equals the prefill output at that position. `cache.reads` holds the last step's read counts.
    `backend` applies to the sliding and compressed branches (`"auto"`: nsa.dispatch thresholds);
    `backend="triton"` runs the Triton compressed+scores kernel, Triton top-n and the Triton
    selection kernel, in prefill and in decode, with sliding through `auto`.
    """

    def __init__(self, config: NSAConfig, *, backend: str = "auto") -> None:
        super().__init__()
        c = self.config = config
        self.backend = backend
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim_qk, bias=False)
        self.kv_names = BRANCHES if c.kv == "separate" else ("shared",)
        self.k_proj = nn.ModuleDict({n: nn.Linear(c.dim, c.n_kv_heads * c.head_dim_qk, bias=False)
                                     for n in self.kv_names})
        self.v_proj = nn.ModuleDict({n: nn.Linear(c.dim, c.n_kv_heads * c.head_dim_v, bias=False)
                                     for n in self.kv_names})
        self.gate = nn.Linear(c.dim, c.n_heads * 3)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim_v, c.dim, bias=False)
        if c.phi == "mlp":
            self.phi_k = MLPCompressor(c.cmp_block, c.cmp_stride, c.head_dim_qk)
            self.phi_v = MLPCompressor(c.cmp_block, c.cmp_stride, c.head_dim_v)

    # --- pieces -------------------------------------------------------------------------------
    def _kv_name(self, branch: str) -> str:
        return branch if self.config.kv == "separate" else "shared"

    def project(self, x: Tensor, start: int = 0) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]], Tensor]:
        """`x [B, T, dim]` at positions `start..` -> q `[B,T,Hq,dk]`, {kv name: (k, v)}, gates `[B,T,Hq,3]`."""
        c = self.config
        b, t, _ = x.shape
        pos = torch.arange(start, start + t, device=x.device)
        q = self.q_proj(x).view(b, t, c.n_heads, c.head_dim_qk)
        if c.rope:
            q = apply_rope(q, pos, c.rope_theta)
        kv = {}
        for name in self.kv_names:
            k = self.k_proj[name](x).view(b, t, c.n_kv_heads, c.head_dim_qk)
            v = self.v_proj[name](x).view(b, t, c.n_kv_heads, c.head_dim_v)
            kv[name] = (apply_rope(k, pos, c.rope_theta) if c.rope else k, v)
        gates = torch.sigmoid(self.gate(x)).view(b, t, c.n_heads, 3)
        return q, kv, gates

    def compress(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c = self.config
        if c.phi == "mlp":
            return self.phi_k(k), self.phi_v(v)
        return avg_compress(k, c.cmp_block, c.cmp_stride), avg_compress(v, c.cmp_block, c.cmp_stride)

    def attend(self, q: Tensor, kv: dict[str, tuple[Tensor, Tensor]], gates: Tensor,
               branches: Sequence[str] = BRANCHES) -> Tensor:
        """Prefill attention (projections excluded): gated sum of the branches -> `[B, T, Hq, dv]`.

        Branches not in `branches` contribute 0 and are not computed (selection still needs the
        compressed keys). Memory: each branch op's (see nsa.ops), plus one `[B, T, Hq, dv]` output
        per branch.
        """
        c = self.config
        if self._use_triton(q, kv[self._kv_name("sel")][1], q.shape[1]):
            return self._attend_triton(q, kv, gates, branches)
        out = torch.zeros(*q.shape[:3], c.head_dim_v, dtype=q.dtype, device=q.device)
        k_c, v_c = kv[self._kv_name("cmp")]
        kc, vc = self.compress(k_c, v_c) if {"cmp", "sel"} & set(branches) else (None, None)
        if "cmp" in branches:
            o = ops.compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride,
                                         scale=c.softmax_scale, backend=self.backend)
            out = out + gates[..., 0:1] * o
        if "sel" in branches:
            idx = ops.select_blocks(q, kc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                                    sel_count=c.sel_count, scale=c.softmax_scale)
            k_s, v_s = kv[self._kv_name("sel")]
            o = ops.selected_attention(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                       backend="auto" if self.backend == "auto" else _sel_backend(self.backend))
            out = out + gates[..., 1:2] * o
        if "win" in branches:
            k_w, v_w = kv[self._kv_name("win")]
            o = ops.sliding_window_attention(q, k_w, v_w, window=c.window, scale=c.softmax_scale,
                                             backend=self.backend)
            out = out + gates[..., 2:3] * o
        return out

    def _attend_triton(self, q: Tensor, kv: dict[str, tuple[Tensor, Tensor]], gates: Tensor,
                       branches: Sequence[str], q_start: int = 0) -> Tensor:
        """The fast path: one group-centric Triton kernel gives the compressed output and the
        selection scores, Triton top-n, the sliding branch through `auto` dispatch (FA-2 above its
        threshold), then the group-centric Triton selection kernel, which also does the gated sum
        when all three branches run. Same semantics as `attend`."""
        from nsa.backends import triton_nsa

        c = self.config
        o_cmp = idx = o_win = None
        if {"cmp", "sel"} & set(branches):
            kc, vc = self.compress(*kv[self._kv_name("cmp")])
            o_cmp, idx = self._cmp_topn_triton(q, kc, vc, branches, q_start)
        if "win" in branches:
            k_w, v_w = kv[self._kv_name("win")]
            o_win = ops.sliding_window_attention(q, k_w, v_w, window=c.window, scale=c.softmax_scale,
                                                 backend="auto")
        k_s, v_s = kv[self._kv_name("sel")]
        if o_cmp is not None and idx is not None and o_win is not None:
            return triton_nsa.selected_gated(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                             gates=gates, o_cmp=o_cmp, o_win=o_win, q_start=q_start)
        out = torch.zeros(*q.shape[:3], c.head_dim_v, dtype=q.dtype, device=q.device)
        if o_cmp is not None:
            out = out + gates[..., 0:1] * o_cmp
        if idx is not None:
            o_sel = ops.selected_attention(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                           backend="triton", q_start=q_start)
            out = out + gates[..., 1:2] * o_sel
        if o_win is not None:
            out = out + gates[..., 2:3] * o_win
        return out

    def _use_triton(self, q: Tensor, v: Tensor, seq_len: int) -> bool:
        """The Triton path: always with `backend="triton"`; with `"auto"` where the dispatch
        thresholds put both the compressed and the selected branch on Triton at this length
        (`triton_min_len_cmp` / `triton_min_len_sel`, nsa.dispatch.triton_fused_ok) and the
        kernels support this call; recorded like every other auto choice."""
        if self.backend == "triton":
            return True
        if self.backend != "auto" or q.device.type != "cuda":
            return False
        c = self.config
        call = AttnCall("selected", q, v, v, c.softmax_scale, q_start=seq_len - q.shape[1], sel_block=c.sel_block)
        ok = dispatch.triton_fused_ok(seq_len, q.device, call)
        dispatch.record("nsa_triton_path", seq_len, "triton" if ok else "per-branch",
                        "triton_fused_ok" if ok else "below the triton thresholds or unsupported")
        return ok

    def _cmp_topn_triton(self, q: Tensor, kc: Tensor, vc: Tensor, branches: Sequence[str],
                         q_start: int) -> tuple[Tensor | None, Tensor | None]:
        """Compressed output and selected block indices on the Triton kernels (a prefill chunk or
        one decode step at `q_start`); `None` for a branch not asked for."""
        from nsa.backends import triton_nsa

        c = self.config
        o_cmp, scores = triton_nsa.compressed_and_scores(
            q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block, scale=c.softmax_scale,
            q_start=q_start, scores="sel" in branches)
        idx = None if scores is None else triton_nsa.topn(scores, q_start, sel_block=c.sel_block,
                                                          sel_count=c.sel_count)
        return (o_cmp if "cmp" in branches else None), idx

    def _out(self, o: Tensor) -> Tensor:
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    # --- prefill ------------------------------------------------------------------------------
    def forward(self, x: Tensor, branches: Sequence[str] = BRANCHES) -> Tensor:
        """Prefill: `x [B, T, dim]` -> `[B, T, dim]`."""
        _check_input(x, self.config)
        q, kv, gates = self.project(x)
        return self._out(self.attend(q, kv, gates, branches))

    def new_cache(self) -> NSACache:
        c = self.config
        cache = NSACache()
        if c.kv == "shared":
            cache.raw["shared"] = (_Buffer(), _Buffer())
        else:
            cache.raw = {"sel": (_Buffer(), _Buffer()),
                         "win": (_Buffer(c.window), _Buffer(c.window)),
                         "cmp": (_Buffer(c.cmp_block), _Buffer(c.cmp_block))}
        return cache

    def prefill(self, x: Tensor, branches: Sequence[str] = BRANCHES) -> tuple[Tensor, NSACache]:
        """Prefill `x [B, T, dim]` and return its output and a cache ready for `step`."""
        _check_input(x, self.config)
        q, kv, gates = self.project(x)
        y = self._out(self.attend(q, kv, gates, branches))
        cache = self.new_cache()
        for name, (kb, vb) in cache.raw.items():
            kb.append(kv[name][0])
            vb.append(kv[name][1])
        for buf, x_cmp in zip(cache.cmp, self.compress(*kv[self._kv_name("cmp")]), strict=True):
            buf.append(x_cmp)
        cache.length = x.shape[1]
        return y, cache

    # --- decode -------------------------------------------------------------------------------
    def step(self, x_t: Tensor, cache: NSACache, branches: Sequence[str] = BRANCHES) -> Tensor:
        """One decode step: `x_t [B, 1, dim]` at position `t = cache.length` -> `[B, 1, dim]`.

        Reads: the compressed stream (`n_cmp(t)` tokens), the selected blocks' raw tokens `<= t`
        (gathered, or read in place by the Triton kernel; nothing else of the raw cache is touched)
        and the last `min(w, t+1)` tokens.
        """
        c = self.config
        _check_input(x_t, c)
        if x_t.shape[1] != 1:
            raise ValueError(f"step takes one token x_t [B, 1, dim], got T={x_t.shape[1]}; use prefill for more")
        t = cache.length
        q, kv, gates = self.project(x_t, start=t)
        for name, (kb, vb) in cache.raw.items():
            kb.append(kv[name][0])
            vb.append(kv[name][1])
        cache.length = t + 1
        self._extend_compressed(cache, t)
        return self._out(self.decode_attend(q, gates, cache, branches))

    def decode_attend(self, q: Tensor, gates: Tensor, cache: NSACache, branches: Sequence[str] = BRANCHES) -> Tensor:
        """The attention of one decode step, projections excluded (as in the prefill benches):
        `q [B, 1, Hq, dk]` (RoPE applied) and `gates [B, 1, Hq, 3]` of the token at
        `t = cache.length - 1`, whose K/V the cache already holds -> `[B, 1, Hq, dv]`. Sets
        `cache.reads`; changes nothing else, so it can be replayed (CUDA graphs)."""
        t = cache.length - 1
        v_sel = cache.raw[self._kv_name("sel")][1].view()
        if branches and self._use_triton(q, v_sel, t + 1):
            return self._decode_attend_triton(q, gates, cache, branches, t)
        c = self.config
        reads = ReadCounts()
        out = torch.zeros(*q.shape[:3], c.head_dim_v, dtype=q.dtype, device=q.device)
        if "cmp" in branches:
            o = ops.compressed_attention(q, cache.k_cmp, cache.v_cmp, block=c.cmp_block, stride=c.cmp_stride,
                                         scale=c.softmax_scale, backend=self.backend, q_start=t)
            reads.cmp = cache.k_cmp.shape[1]
            out = out + gates[..., 0:1] * o
        if "sel" in branches:
            idx = ops.select_blocks(q, cache.k_cmp, block=c.cmp_block, stride=c.cmp_stride,
                                    sel_block=c.sel_block, sel_count=c.sel_count, scale=c.softmax_scale,
                                    q_start=t)
            kb, vb = cache.raw[self._kv_name("sel")]
            reads.sel_blocks = idx
            o, reads.sel = _selected_decode(q, kb.view(), vb.view(), idx, t, c.sel_block, c.softmax_scale)
            out = out + gates[..., 1:2] * o
        if "win" in branches:
            kb, vb = cache.raw[self._kv_name("win")]
            k_w, v_w = kb.view(c.window), vb.view(c.window)
            o = ops.sliding_window_attention(q, k_w, v_w, window=c.window, scale=c.softmax_scale,
                                             backend="auto" if self.backend == "triton" else self.backend,
                                             q_start=t, k_start=t + 1 - k_w.shape[1])
            reads.win = k_w.shape[1]
            out = out + gates[..., 2:3] * o
        cache.reads = reads
        return out

    def _decode_attend_triton(self, q: Tensor, gates: Tensor, cache: NSACache, branches: Sequence[str],
                              t: int) -> Tensor:
        """`decode_attend` on the Triton kernels: compressed + scores split over chunks of the
        compressed keys, two-stage top-n, the window's blocks through the selection kernel, and
        the selection kernel (blocks split, combined) forming the gated sum when all three run."""
        from nsa.backends import triton_nsa

        c = self.config
        reads = ReadCounts()
        o_cmp = idx = o_win = None
        if {"cmp", "sel"} & set(branches):
            o_cmp, idx = self._cmp_topn_triton(q, cache.k_cmp, cache.v_cmp, branches, t)
        if "win" in branches:
            kb, vb = cache.raw[self._kv_name("win")]
            k_w, v_w = kb.view(c.window), vb.view(c.window)
            o_win = triton_nsa.sliding_decode(q, k_w, v_w, t=t, scale=c.softmax_scale)
            dispatch.record("sliding", t + 1, "triton", "decode window as a block list through the selection kernel")
            reads.win = k_w.shape[1]
        if o_cmp is not None:
            reads.cmp = cache.k_cmp.shape[1]
        kb, vb = cache.raw[self._kv_name("sel")]
        if idx is not None:
            reads.sel_blocks, reads.sel = idx, _selected_reads(idx, t, c.sel_block)
        cache.reads = reads
        if o_cmp is not None and idx is not None and o_win is not None:
            return triton_nsa.selected_gated(q, kb.view(), vb.view(), idx, sel_block=c.sel_block,
                                             scale=c.softmax_scale, gates=gates, o_cmp=o_cmp, o_win=o_win, q_start=t)
        out = torch.zeros(*q.shape[:3], c.head_dim_v, dtype=q.dtype, device=q.device)
        if o_cmp is not None:
            out = out + gates[..., 0:1] * o_cmp
        if idx is not None:
            o = ops.selected_attention(q, kb.view(), vb.view(), idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                       backend="triton", q_start=t)
            out = out + gates[..., 1:2] * o
        if o_win is not None:
            out = out + gates[..., 2:3] * o_win
        return out

    def _extend_compressed(self, cache: NSACache, t: int) -> None:
        """Emit compressed token `(t+1-l)/d` when `t + 1 >= l` and `(t + 1 - l) % d == 0`."""
        c = self.config
        if cache.k_cmp is None:
            kb, vb = cache.raw[self._kv_name("cmp")]
            cache.cmp[0].append(kb.view()[:, :0])
            cache.cmp[1].append(vb.view()[:, :0])
        if t + 1 < c.cmp_block or (t + 1 - c.cmp_block) % c.cmp_stride:
            return
        kb, vb = cache.raw[self._kv_name("cmp")]
        nk, nv = self.compress(kb.view(c.cmp_block), vb.view(c.cmp_block))
        cache.cmp[0].append(nk)
        cache.cmp[1].append(nv)


def _sel_backend(backend: str) -> str:
    # FA-2 has no selected-attention path; an explicit fa2 module backend keeps sdpa for selection.
    return "sdpa" if backend in ("fa2", "flash_attn", "torch_fa2") else backend


def _selected_reads(idx: Tensor, t: int, sel_block: int) -> Tensor:
    """Raw tokens the selection kernel reads for the step at `t`, `[B, Hkv]`: those of its selected
    blocks that are `<= t` (the kernel's own mask rule), counted from the indices it was given."""
    blocks = idx[:, 0].long()                                                # [B, Hkv, n]
    per_block = (t - blocks * sel_block + 1).clamp(0, sel_block)
    return torch.where(blocks >= 0, per_block, torch.zeros_like(per_block)).sum(-1)


def _selected_decode(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, t: int, sel_block: int,
                     scale: float) -> tuple[Tensor, Tensor]:
    """Gather only the selected blocks' tokens of each KV group and attend over those `<= t`.

    q `[B, 1, Hq, dk]`, k/v `[B, L, Hkv, D]`, idx `[B, 1, Hkv, n]`. Returns the output and the
    measured reads `[B, Hkv]`: the gathered tokens that the attention's mask admitted.
    """
    b, _, hq, _ = q.shape
    hkv = k.shape[2]
    blocks = idx[:, 0]                                                        # [B, Hkv, n]
    tok = blocks[..., None] * sel_block + torch.arange(sel_block, device=q.device)  # [B, Hkv, n, l']
    valid = (blocks[..., None] >= 0) & (tok <= t)
    tok = torch.where(valid, tok, torch.zeros_like(tok)).flatten(2)           # [B, Hkv, n*l']
    valid = valid.flatten(2)
    gidx = tok.permute(0, 2, 1)                                               # [B, N, Hkv]
    kg = torch.gather(k, 1, gidx[..., None].expand(-1, -1, -1, k.shape[-1]))  # [B, N, Hkv, dk]
    vg = torch.gather(v, 1, gidx[..., None].expand(-1, -1, -1, v.shape[-1]))
    # Per-group masks: expand to query heads of each group, [B, Hq, 1, N].
    mask = valid.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]
    o = masked_attention(q, kg, vg, mask, scale)
    return o, valid.sum(-1)


def _check_input(x: Tensor, c: NSAConfig) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.dim:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be [B, T, dim={c.dim}], got {shape}")
