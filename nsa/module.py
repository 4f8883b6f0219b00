"""NSAAttention: the paper's three-branch attention layer, prefill and cached decode.

`o_t = sum_c sigmoid(gate_c(x_t)) * attn_c(q_t)` over c in (cmp, sel, win), one gate per query
head per branch (paper Eq. 5). Each branch has its own K/V projections (`kv="separate"`, the
paper) or all share one (`kv="shared"`). RoPE is applied to queries and raw keys (nsa.rope).
Every call asks nsa.dispatch for one `Plan` (a backend per branch, with the reason) and runs the
one prefill path or the one decode path below from it. The module names no backend: the fused
paths it may take (selection scores from the compressed pass, the gated sum in the selection
kernel, the window beside the chain, a whole decode step) are those the plan's backends declare
(`nsa.backends.FUSIONS`). A call needs gradients when grad mode is on and an input or a parameter
it reads requires grad; its plan then holds only backends with each branch's backward, and it
takes no fusion whose output a gradient must flow through (docs/nsa.md, "Training").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from nsa import backends, dispatch, ops, packing
from nsa.backends import AttnCall
from nsa.backends.sdpa import masked_attention
from nsa.cache import NSACache, ReadCounts, TokenBuffer, decode_read_budget
from nsa.compression import MLPCompressor, avg_compress
from nsa.config import NSAConfig
from nsa.masks import n_compressed
from nsa.rope import apply_rope

if TYPE_CHECKING:
    from nsa.serving import PagedCache

BRANCHES = ("cmp", "sel", "win")
__all__ = ["BRANCHES", "NSAAttention", "NSACache", "ReadCounts", "decode_read_budget"]


class NSAAttention(nn.Module):
    """NSA attention layer: `[B, T, dim] -> [B, T, dim]`, causal.

    `forward(x)` is the prefill. Decode: `cache = attn.new_cache()`, `y, cache = attn.prefill(x)`
    (or start empty), then `y_t = attn.step(x_t, cache)` for `x_t [B, 1, dim]`; every step output
    equals the prefill output at that position. `cache.reads` holds the last step's read counts.
    Chunked prefill: `y, cache = attn.prefill(x_chunk, cache=cache)` continues a cache. Packed
    sequences: `attn(x, cu_seqlens=cu)` with `x [1, total_T, dim]` (docs/nsa.md).
    `backend`: `"auto"` (nsa.dispatch picks per branch from the thresholds), one backend name for
    every branch (`"sdpa"`, `"triton"`, `"flex"`, `"fa2"` ...), or a mapping branch -> name
    (`{"win": "fa2"}`; missing branches are auto). An explicit backend that cannot run a branch
    raises BackendError with the reason (FA-2 has no selected op: use a mapping), as does one
    without a branch's backward when the call needs gradients.
    """

    def __init__(self, config: NSAConfig, *, backend: str | Mapping[str, str] = "auto") -> None:
        super().__init__()
        c = self.config = config
        if isinstance(backend, Mapping):
            unknown = set(backend) - set(BRANCHES)
            if unknown:
                raise ValueError(f"backend mapping keys must be among {BRANCHES}, got {sorted(unknown)}")
            backend = dict(backend)
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

    def _compressed(self, kv: Mapping[str, tuple[Tensor, Tensor]],
                    branches: Sequence[str]) -> tuple[Tensor | None, Tensor | None]:
        """The compressed keys and values a prefill needs (the compressed branch, and the selection's
        scores), or (None, None) when neither branch runs."""
        if {"cmp", "sel"} & set(branches):
            return self.compress(*kv[self._kv_name("cmp")])
        return None, None

    def _needs_grad(self, *tensors: Tensor | None) -> bool:
        """Grad mode is on and an input, or a parameter the attention reads (the MLP `phi`), requires grad."""
        phi = list(self.phi_k.parameters()) + list(self.phi_v.parameters()) if self.config.phi == "mlp" else []
        return backends.needs_grad(*tensors, *phi)

    def _calls(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], kc: Tensor | None, vc: Tensor | None,
               branches: Sequence[str], q_start: int, k_start_win: int = 0, grad: bool = False,
               win_kv: tuple[Tensor, Tensor] | None = None) -> dict[str, AttnCall]:
        """The branch calls dispatch plans from (the selection call has no block indices yet).
        `win_kv`: the window's K/V when they are not `kv`'s (a chunk reads a tail of the cache)."""
        c, scale = self.config, self.config.softmax_scale
        calls = {}
        if "cmp" in branches:
            calls["cmp"] = AttnCall("compressed", q, kc, vc, scale, q_start=q_start, block=c.cmp_block,
                                    stride=c.cmp_stride, grad=grad)
        if "sel" in branches:
            k_s, v_s = kv[self._kv_name("sel")]
            calls["sel"] = AttnCall("selected", q, k_s, v_s, scale, q_start=q_start, sel_block=c.sel_block, grad=grad)
        if "win" in branches:
            k_w, v_w = win_kv if win_kv is not None else kv[self._kv_name("win")]
            calls["win"] = AttnCall("sliding", q, k_w, v_w, scale, q_start=q_start, k_start=k_start_win,
                                    window=c.window, grad=grad)
        return calls

    def _check_projections(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor | None = None,
                           t: int | None = None) -> None:
        """`attend` / `plan` / `decode_attend` inputs against this layer's config: the kv names of its
        kv mode (a mismatch was a KeyError), then every shape, heads and head dims included (another
        dv was a torch broadcast error, another head count a silent broadcast). `t`: the query length
        a decode step must have (1)."""
        c = self.config
        if not isinstance(q, Tensor) or q.dim() != 4:
            shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
            raise ValueError(f"q must be [B, T, n_heads={c.n_heads}, head_dim_qk={c.head_dim_qk}], got {shape}")
        if kv is not None and (not isinstance(kv, Mapping) or any(n not in kv for n in self.kv_names)):
            got = sorted(map(str, kv)) if isinstance(kv, Mapping) else type(kv).__name__
            other = "shared" if c.kv == "separate" else "separate"
            theirs = {"separate": set(BRANCHES), "shared": {"shared"}}[other]
            hint = f" (the projections of a kv={other!r} layer)" if isinstance(kv, Mapping) and set(kv) == theirs else ""
            raise ValueError(f"kv must map {list(self.kv_names)} to (k, v) for this kv={c.kv!r} layer, got {got}{hint}; "
                             f"pass this layer's own project(x) output, or make the layer with kv={other!r}")
        b = q.shape[0]
        t = q.shape[1] if t is None else t
        want = [("q", q, ("n_heads", "head_dim_qk")), ("gates", gates, ("n_heads", 3))]
        for name in self.kv_names if kv is not None else ():
            pair = kv[name]
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"kv[{name!r}] must be a (k, v) pair of tensors, got {type(pair).__name__}")
            want += [(f"kv[{name!r}] k", pair[0], ("n_kv_heads", "head_dim_qk")),
                     (f"kv[{name!r}] v", pair[1], ("n_kv_heads", "head_dim_v"))]
        for label, x, dims in want:
            if x is None:
                continue
            expected = (b, t, *(d if isinstance(d, int) else getattr(c, d) for d in dims))
            if not isinstance(x, Tensor) or tuple(x.shape) != expected:
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                names = ", ".join(f"{d}={getattr(c, d)}" for d in dims if isinstance(d, str))
                bt = "B and T from q" if t == q.shape[1] else f"B from q, T={t}"
                raise ValueError(f"{label} must be [B, T, {', '.join(map(str, dims))}] = {list(expected)} for this "
                                 f"layer ({names}, {bt}), got {list(shape) if isinstance(x, Tensor) else shape}; "
                                 "pass this layer's own project(x) output, or make the layer to match the tensors")

    def _grad_of(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor | None = None) -> bool:
        return self._needs_grad(q, gates, *(x for pair in kv.values() for x in pair))

    def plan(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], branches: Sequence[str] = BRANCHES,
             q_start: int = 0) -> dispatch.Plan:
        """The dispatch plan of a prefill (or a chunk at `q_start`) for these projections: the one
        `attend` runs. It compresses the keys, as `attend` does, since the compressed call's shape
        is part of the plan."""
        _check_branches(branches)
        self._check_projections(q, kv)
        return dispatch.plan(self._calls(q, kv, *self._compressed(kv, branches), branches, q_start,
                                         grad=self._grad_of(q, kv)), self.backend)

    def attend(self, q: Tensor, kv: dict[str, tuple[Tensor, Tensor]], gates: Tensor,
               branches: Sequence[str] = BRANCHES, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """Prefill attention (projections excluded): gated sum of the branches -> `[B, T, Hq, dv]`.

        Branches not in `branches` contribute 0 and are not computed (selection still needs the
        compressed keys). Memory: each branch op's (see nsa.ops), plus one `[B, T, Hq, dv]` output
        per branch.

        Packed sequences: with `cu_seqlens` (int32 `[N+1]`, flash-attn's convention, see
        nsa.packing), q `[total_T, Hq, dk]`, each kv pair `[total_T, Hkv, dk]` / `[total_T, Hkv, dv]`
        and gates `[total_T, Hq, 3]` hold N sequences one after another (RoPE applied at each
        sequence's own positions, as `forward(x, cu_seqlens=...)` does) -> `[total_T, Hq, dv]`.
        No query reads a key of another sequence; compression and selection blocks start at each
        sequence's position 0; an empty sequence is allowed. Each sequence runs this same path on
        its own (its own plan), so the output is bit for bit the one-at-a-time result, and it
        carries gradients as a batch-of-one call does. `cu_seqlens` is read to the host once (one
        device sync on a GPU); nothing else syncs.
        """
        if cu_seqlens is not None:
            self._check_packed(q, kv, gates)
            bounds = packing.seq_bounds(cu_seqlens, q.shape[0], q.device)
            return self._attend_packed(q, kv, gates, branches, bounds)
        _check_branches(branches)
        self._check_projections(q, kv, gates)
        kc, vc = self._compressed(kv, branches)
        return self._attend_at(q, gates, branches, 0, kv[self._kv_name("sel")], kv[self._kv_name("win")], 0,
                               kc, vc, self._grad_of(q, kv, gates))

    def _attend_at(self, q: Tensor, gates: Tensor, branches: Sequence[str], q_start: int,
                   sel_kv: tuple[Tensor, Tensor], win_kv: tuple[Tensor, Tensor], k_start_win: int,
                   kc: Tensor | None, vc: Tensor | None, grad: bool) -> Tensor:
        """The gated branches for queries at `q_start ..`: the selection over `sel_kv` (raw K/V from
        position 0), the window over `win_kv` (from position `k_start_win`), the compressed branch
        and the scores over `kc`/`vc` (every compressed token so far). A prefill has `q_start = 0`;
        a chunk continuing a cache has its cached tokens before its own (`prefill(x, cache=)`)."""
        c = self.config
        if not branches:
            return q.new_zeros(*q.shape[:3], c.head_dim_v)
        calls = self._calls(q, {self._kv_name("sel"): sel_kv}, kc, vc, branches, q_start, k_start_win, grad=grad,
                            win_kv=win_kv)
        plan = dispatch.plan(calls, self.backend)
        k_s, v_s = sel_kv

        def chain() -> tuple[Tensor | None, Tensor | None]:
            return self._cmp_and_blocks(plan, calls, q, kc, vc, branches, q_start)

        def window() -> Tensor | None:
            return ops.sliding_window_attention(q, *win_kv, window=c.window, scale=c.softmax_scale,
                                                backend=plan.backend("win"), q_start=q_start,
                                                k_start=k_start_win) if "win" in branches else None

        def finish(o_win: Tensor | None, cmp_idx: tuple[Tensor | None, Tensor | None]) -> Tensor:
            o_cmp, idx = cmp_idx
            o_sel = None
            if idx is not None and not self._fused_gate(plan, o_cmp, o_win):
                o_sel = ops.selected_attention(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                               backend=plan.backend("sel"), q_start=q_start)
            return self._gated(plan, q, k_s, v_s, idx, gates, o_cmp, o_sel, o_win, q_start)

        if "win" in branches and plan.fused("beside", "win") and q.is_cuda:
            # The window kernel beside the compressed branch and top-n (e.g. Tiles.win_beside).
            return backends.module(plan.backend("win")).beside(window, chain, finish, device=q.device,
                                                                rows=q.shape[0] * q.shape[1])
        cmp_idx = chain()
        return finish(window(), cmp_idx)

    def _cmp_and_blocks(self, plan: dispatch.Plan, calls: Mapping[str, AttnCall], q: Tensor, kc: Tensor | None,
                        vc: Tensor | None, branches: Sequence[str], q_start: int) -> tuple[Tensor | None, Tensor | None]:
        """Compressed output and selected blocks, per the plan: one pass of the `scores` backend gives
        both (plus its top-n) when `plan.scores` names one; else torch scores and the cmp backend.
        The blocks carry no gradient (the top-n is discrete), so they are found without autograd;
        under `plan.grad` the compressed output comes from the compressed op, which has a backward."""
        c = self.config
        o_cmp = idx = None
        if plan.grad and plan.scores != "torch" and {"cmp", "sel"} <= set(branches) and \
                plan.backend("cmp") == plan.scores and "train_scores" in backends.capabilities(plan.scores).fusions:
            # One training pass: the compressed output with its backward, the blocks from its statistics.
            return backends.module(plan.scores).compressed_select_train(
                q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block, sel_count=c.sel_count,
                scale=c.softmax_scale, q_start=q_start)
        if plan.scores != "torch":
            fused = backends.module(plan.scores)
            take_cmp = "cmp" in branches and plan.backend("cmp") == plan.scores and not plan.grad
            with torch.no_grad():
                if "sel" in branches:
                    o_fused, idx = fused.compressed_select(
                        q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                        sel_count=c.sel_count, scale=c.softmax_scale, q_start=q_start)
                elif take_cmp:
                    o_fused, _ = fused.compressed_and_scores(
                        q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                        scale=c.softmax_scale, q_start=q_start, scores=False)
            if take_cmp:
                o_cmp = o_fused
        elif "sel" in branches:
            with torch.no_grad():
                idx = ops.select_blocks(q, kc, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block,
                                        sel_count=c.sel_count, scale=c.softmax_scale, q_start=q_start)
        if "cmp" in branches and o_cmp is None:
            o_cmp = ops.compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, scale=c.softmax_scale,
                                             backend=plan.backend("cmp"), q_start=q_start)
        return o_cmp, idx

    def _fused_decode(self, plan: dispatch.Plan, q: Tensor, t: int) -> bool:
        """A decode step runs as one fused step when the plan puts every branch and the scores on
        one backend that declares `decode_step` and its kernels cover the geometry
        (`decode_unsupported_reason`)."""
        if set(plan.branches) != set(BRANCHES) or not plan.fused("decode_step", *BRANCHES) or \
                plan.scores != plan.backend("sel"):
            return False
        c = self.config
        return backends.module(plan.scores).decode_unsupported_reason(
            q, t=t, dv=c.head_dim_v, block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block) is None

    @staticmethod
    def _fused_gate(plan: dispatch.Plan, o_cmp: Tensor | None, o_win: Tensor | None) -> bool:
        """The selection kernel forms the gated sum in its epilogue when all three run and its
        backend declares `gated` (never under gradients: the fusion has no backward)."""
        return plan.fused("gated", "sel") and o_cmp is not None and o_win is not None

    def _gated(self, plan: dispatch.Plan, q: Tensor, k_s: Tensor, v_s: Tensor, idx: Tensor | None, gates: Tensor,
               o_cmp: Tensor | None, o_sel: Tensor | None, o_win: Tensor | None, q_start: int) -> Tensor:
        """`sum_c gate_c * o_c` -> `[B, Tq, Hq, dv]` (the one place the gated sum is written)."""
        c = self.config
        if idx is not None and self._fused_gate(plan, o_cmp, o_win):
            return backends.module(plan.backend("sel")).selected_gated(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                             gates=gates, o_cmp=o_cmp, o_win=o_win, q_start=q_start)
        out = torch.zeros(*q.shape[:3], c.head_dim_v, dtype=q.dtype, device=q.device)
        for i, o in enumerate((o_cmp, o_sel, o_win)):
            if o is not None:
                out = out + gates[..., i:i + 1] * o
        return out

    def _out(self, o: Tensor) -> Tensor:
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    # --- prefill ------------------------------------------------------------------------------
    def forward(self, x: Tensor, branches: Sequence[str] = BRANCHES, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """Prefill: `x [B, T, dim]` -> `[B, T, dim]`.

        Packed sequences: with `cu_seqlens` (int32 `[N+1]` on x's device, flash-attn's
        convention, see nsa.packing), `x [1, total_T, dim]` holds N sequences one after another
        -> `[1, total_T, dim]`. Each sequence is causal on its own: RoPE positions, compression
        blocks and selection blocks restart at its first token, and no token reads another
        sequence's. Empty sequences are allowed. The projections run once over the whole row; the
        attention runs per sequence (`attend(..., cu_seqlens=)`, bit for bit the one-at-a-time
        attention), so the output equals `forward` of each sequence alone up to the projection
        matmuls' rounding. Gradients flow as in a batched call. `cu_seqlens` is read to the host
        once (one device sync on a GPU).
        """
        if cu_seqlens is not None:
            return self._forward_packed(x, branches, cu_seqlens)
        _check_input(x, self.config)
        _check_branches(branches)
        q, kv, gates = self.project(x)
        return self._out(self.attend(q, kv, gates, branches))

    def _forward_packed(self, x: Tensor, branches: Sequence[str], cu_seqlens: Tensor) -> Tensor:
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != 1 or x.shape[-1] != c.dim or x.shape[1] < 1:
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"with cu_seqlens, x must be [1, total_T, dim={c.dim}] (the packed sequences in one row, "
                             f"total_T >= 1), got {shape}; pass x[None] for a [total_T, dim] tensor, or leave out "
                             "cu_seqlens for a [B, T, dim] batch")
        _check_branches(branches)
        bounds = packing.seq_bounds(cu_seqlens, x.shape[1], x.device)
        q, kv, gates = self._project_at(x, packing.positions(cu_seqlens, x.shape[1]))
        o = self._attend_packed(q[0], {n: (k[0], v[0]) for n, (k, v) in kv.items()}, gates[0], branches, bounds)
        return self._out(o[None])

    def _project_at(self, x: Tensor, pos: Tensor) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]], Tensor]:
        """`project` with each token's RoPE position given, `pos [T]` (packed sequences restart at 0)."""
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.n_heads, c.head_dim_qk)
        kv = {}
        for name in self.kv_names:
            k = self.k_proj[name](x).view(b, t, c.n_kv_heads, c.head_dim_qk)
            kv[name] = (apply_rope(k, pos, c.rope_theta) if c.rope else k,
                        self.v_proj[name](x).view(b, t, c.n_kv_heads, c.head_dim_v))
        gates = torch.sigmoid(self.gate(x)).view(b, t, c.n_heads, 3)
        return (apply_rope(q, pos, c.rope_theta) if c.rope else q), kv, gates

    def _check_packed(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor) -> None:
        """Packed `attend` inputs: every tensor `[total_T, H, D]` (no batch dim), then the shapes
        against this layer's config as `attend` checks them."""
        tensors = [("q", q), ("gates", gates)]
        if isinstance(kv, Mapping):
            tensors += [(f"kv[{n!r}]", x) for n, pair in kv.items() if isinstance(pair, (tuple, list))
                        for x in pair]
        for label, x in tensors:
            if not isinstance(x, Tensor) or x.dim() != 3:
                shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"with cu_seqlens, {label} must be [total_T, H, D] (packed sequences, no batch dim), "
                                 f"got {shape}; pass t[0] of a [1, total_T, H, D] tensor, or leave out cu_seqlens "
                                 "for [B, T, H, D] tensors")

        def one(x: object) -> object:
            return x[None] if isinstance(x, Tensor) else x

        packed = {n: tuple(one(x) for x in pair) if isinstance(pair, (tuple, list)) else pair
                  for n, pair in kv.items()} if isinstance(kv, Mapping) else kv
        self._check_projections(q[None], packed, gates[None])

    def _attend_packed(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor,
                       branches: Sequence[str], bounds: list[int]) -> Tensor:
        """`[total_T, Hq, dv]`: each non-empty sequence `bounds[i] .. bounds[i+1]` through `attend`
        as a batch of one (its own plan), the outputs joined in order."""
        _check_branches(branches)
        outs = []
        for s, e in zip(bounds, bounds[1:], strict=False):
            if e > s:
                one = {n: (k[None, s:e], v[None, s:e]) for n, (k, v) in kv.items()}
                outs.append(self.attend(q[None, s:e], one, gates[None, s:e], branches)[0])
        if not outs:
            return q.new_zeros(0, q.shape[1], self.config.head_dim_v)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _layout(self) -> tuple:
        """What a cache's contents depend on: heads, head dims, kv mode, compression and window."""
        c = self.config
        return (("n_kv_heads", c.n_kv_heads), ("head_dim_qk", c.head_dim_qk), ("head_dim_v", c.head_dim_v),
                ("kv", c.kv), ("phi", c.phi), ("cmp_block", c.cmp_block), ("cmp_stride", c.cmp_stride),
                ("sel_block", c.sel_block), ("window", c.window))

    def _check_cache(self, cache: NSACache) -> None:
        if not isinstance(cache, NSACache):
            raise TypeError(f"cache must be an NSACache from this layer's new_cache() or prefill(), got "
                            f"{type(cache).__name__}")
        if cache.layout is None:
            raise ValueError("this cache records no layer layout (an NSACache() made by hand holds no buffers); make "
                             "the cache with this layer's new_cache() or prefill()")
        if cache.layout != self._layout():
            theirs, ours = dict(cache.layout), dict(self._layout())
            diff = ", ".join(f"{k} {theirs.get(k)!r} != {ours[k]!r}" for k in ours if theirs.get(k) != ours[k])
            raise ValueError(f"this cache was made by a layer of another layout ({diff}); make the cache with this "
                             "layer's new_cache() or prefill()")

    @staticmethod
    def _check_batch(batch: int, cache: NSACache) -> None:
        """The step's batch against the sequences the cache holds (another B was a torch expand error)."""
        held = next((kb.data.shape[0] for kb, _ in cache.raw.values() if kb.data is not None), None)
        if held is not None and held != batch:
            raise ValueError(f"this cache holds B={held} sequences, got a step of B={batch}; step every sequence of "
                             "the cache together, or make one cache per batch (new_cache() or prefill())")

    def new_cache(self) -> NSACache:
        c = self.config
        cache = NSACache(layout=self._layout())
        if c.kv == "shared":
            cache.raw["shared"] = (TokenBuffer(), TokenBuffer())
        else:
            cache.raw = {"sel": (TokenBuffer(), TokenBuffer()),
                         "win": (TokenBuffer(c.window), TokenBuffer(c.window)),
                         "cmp": (TokenBuffer(c.cmp_block), TokenBuffer(c.cmp_block))}
        return cache

    def prefill(self, x: Tensor, branches: Sequence[str] = BRANCHES, *,
                cache: NSACache | None = None) -> tuple[Tensor, NSACache]:
        """Prefill `x [B, T, dim]` and return its output and a cache ready for `step`.

        Chunked prefill: with `cache` (from this layer's `new_cache()`, `prefill` or `step`s,
        holding `t0 = cache.length` tokens of the same B sequences), `x` is the next chunk,
        positions `t0 .. t0 + T - 1` (RoPE there). Its queries read the cached tokens and its own:
        the compressed stream so far plus the compressed tokens completed inside the chunk,
        selection over every block so far, the window reaching back into the cache. The chunk's
        K/V and compressed tokens are then appended to `cache`, which is returned. Prefilling a
        sequence in chunks gives the output of one prefill of the whole up to rounding (the
        kernels see other shapes) and the same cache, so later `step`s continue it. Gradients flow
        to the chunk's inputs and the layer's weights; the cached K/V are constants (a cache holds
        no autograd graph). A backend that cannot take queries after position 0 (`fa3`, `fa4`)
        raises BackendError when named; `auto` passes over it. Memory: the cached selection K/V are
        copied once per chunk (joined with the chunk's), `O(t0 + T)` tokens.
        """
        _check_input(x, self.config)
        if isinstance(branches, NSACache):
            raise TypeError("prefill's second argument is branches; pass the cache by name: prefill(x, cache=cache)")
        _check_branches(branches)
        if cache is None:
            cache = self.new_cache()      # a whole prefill is the chunk of an empty cache
        else:
            self._check_chunk_cache(cache, x)
        t0 = cache.length
        q, kv, gates = self.project(x, start=t0)
        y, new_cmp = self._attend_chunk(q, kv, gates, branches, cache, t0)
        for name, (kb, vb) in cache.raw.items():
            kb.append(kv[name][0].detach())
            vb.append(kv[name][1].detach())
        for buf, x_cmp in zip(cache.cmp, new_cmp, strict=True):
            buf.append(x_cmp.detach())
        cache.length = t0 + x.shape[1]
        if x.is_cuda:
            # Made here, not at the first step: a step captured in a CUDA graph then neither
            # allocates nor zeroes it (decode_counts; steps leave it zero).
            self._decode_counts(cache, x.shape[0], x.device)
        return y, cache

    def _check_chunk_cache(self, cache: NSACache, x: Tensor) -> None:
        """A cache a chunk may continue: this layer's layout, the chunk's B sequences, its device."""
        self._check_cache(cache)
        held = next((kb.data for kb, _ in cache.raw.values() if kb.data is not None), None)
        if held is None:
            return
        if held.shape[0] != x.shape[0]:
            raise ValueError(f"this cache holds B={held.shape[0]} sequences, got a chunk of B={x.shape[0]}; continue "
                             "every sequence of the cache together, or make one cache per batch (new_cache() or prefill())")
        if held.device != x.device:
            raise ValueError(f"this cache is on {held.device}, got a chunk on {x.device}; move the chunk to the "
                             "cache's device")

    def _attend_chunk(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor,
                      branches: Sequence[str], cache: NSACache, t0: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The chunk's output `[B, T, dim]` over the cached tokens and its own, and the compressed
        tokens completed inside the chunk (for the cache). Reads the cache, changes nothing. With
        an empty cache (`t0 = 0`) this is `attend`'s path on the chunk's projections alone."""
        c = self.config
        held = next(kb.data for kb, _ in cache.raw.values() if kb.data is not None) if t0 else None
        if held is not None and held.dtype != q.dtype:
            raise ValueError(f"this cache holds {held.dtype} K/V, got a chunk projecting to {q.dtype}; run the chunk "
                             "in the dtype the cache was filled in")
        n_old = n_compressed(t0, c.cmp_block, c.cmp_stride)
        n_held = cache.k_cmp.shape[1] if cache.k_cmp is not None else 0
        if n_held != n_old:
            raise ValueError(f"this cache holds {n_held} compressed tokens for {t0} raw ones, expected {n_old}; the "
                             "cache was changed outside the layer: make it with new_cache(), prefill() and step()")
        sel_name, win_name, cmp_name = (self._kv_name(b) for b in ("sel", "win", "cmp"))
        sel = _joined(cache, kv, sel_name, t0)                         # every token so far
        keep_w = min(c.window - 1, t0)                                 # what query t0 reads before itself
        win = _joined(cache, kv, win_name, keep_w, sel if win_name == sel_name else None, t0)
        # The compressed tokens completed inside the chunk start at n_old * d: their raw tokens
        # before the chunk (at most l - 1) are still in the cache.
        raw = _joined(cache, kv, cmp_name, t0 - n_old * c.cmp_stride, sel if cmp_name == sel_name else None, t0)
        new_cmp = self.compress(*raw)
        kc = vc = None
        if {"cmp", "sel"} & set(branches):
            kc, vc = (torch.cat([old, new], 1) if n_old else new for old, new in zip((cache.k_cmp, cache.v_cmp),
                                                                                    new_cmp, strict=True))
        grad = self._grad_of(q, kv, gates)
        o = self._attend_at(q, gates, branches, t0, sel, win, t0 - keep_w, kc, vc, grad)
        return self._out(o), new_cmp

    def _decode_counts(self, cache: NSACache, batch: int, device: torch.device) -> None:
        """`cache.dec_counts` for the fused decode step of `batch` sequences, made once by the first
        available backend that declares `decode_step`; a cache without one keeps None."""
        groups = batch * self.config.n_kv_heads
        counts = cache.dec_counts
        if counts is not None and counts.device == device and counts.shape[1] >= groups:
            return
        for name in backends.with_fusion("decode_step"):
            if backends.unavailable_reason(name, device) is None:
                cache.dec_counts = backends.module(name).decode_counts(groups, device)
                return

    # --- decode -------------------------------------------------------------------------------
    def step(self, x_t: Tensor, cache: NSACache | PagedCache, branches: Sequence[str] = BRANCHES) -> Tensor:
        """One decode step: `x_t [B, 1, dim]` at position `t = cache.length` -> `[B, 1, dim]`.

        Reads: the compressed stream (`n_cmp(t)` tokens), the selected blocks' raw tokens `<= t`
        (gathered, or read in place by the Triton kernel; nothing else of the raw cache is touched)
        and the last `min(w, t+1)` tokens.

        Every backend, gradients included, one length for the batch; each call plans and launches
        from the host (milliseconds of host time on a GPU). A generation loop on CUDA should use
        `nsa.serving.PagedCache`, whose step replays one CUDA graph (docs/nsa.md, "Serving"):
        given one as `cache`, this is `cache.step(x_t)` (`x_t [max_seqs, 1, dim]`, every branch).
        """
        c = self.config
        if not isinstance(cache, NSACache):
            from nsa.serving import PagedCache

            if isinstance(cache, PagedCache):
                if cache.layer is not self:
                    raise ValueError("this PagedCache holds another layer's K/V; step it with that layer, or "
                                     "make a PagedCache of this one")
                if tuple(branches) != BRANCHES:
                    raise ValueError(f"a PagedCache step runs every branch {BRANCHES}, got {tuple(branches)!r}; "
                                     "use an NSACache (attn.new_cache()) to run a subset")
                return cache.step(x_t)
        _check_input(x_t, c)
        _check_branches(branches)
        self._check_cache(cache)
        if x_t.shape[1] != 1:
            raise ValueError(f"step takes one token x_t [B, 1, dim], got T={x_t.shape[1]}; use prefill for more")
        self._check_batch(x_t.shape[0], cache)
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
        c = self.config
        _check_branches(branches)
        self._check_cache(cache)
        if cache.length < 1:
            raise ValueError("decode_attend needs a cache that holds the current token's K/V, got an empty cache; "
                             "call step(x_t, cache), which appends them first, or prefill(x)")
        self._check_projections(q, None, gates, t=1)
        self._check_batch(q.shape[0], cache)
        t = cache.length - 1
        reads = ReadCounts()
        if not branches:
            cache.reads = reads
            return q.new_zeros(*q.shape[:3], c.head_dim_v)
        kw, vw = cache.raw[self._kv_name("win")]
        win = (kw.view(c.window), vw.view(c.window))
        k_s, v_s = (b.view() for b in cache.raw[self._kv_name("sel")])
        kv = {self._kv_name("sel"): (k_s, v_s), self._kv_name("win"): win}
        grad = self._needs_grad(q, gates, *(x for pair in kv.values() for x in pair), cache.k_cmp, cache.v_cmp)
        calls = self._calls(q, kv, cache.k_cmp, cache.v_cmp, branches, t, k_start_win=t + 1 - win[0].shape[1],
                            grad=grad)
        plan = dispatch.plan(calls, self.backend)
        if self._fused_decode(plan, q, t):
            # Every branch on one backend with a fused step (Triton: four launches, triton_kernels/decode.py).
            self._decode_counts(cache, q.shape[0], q.device)
            out, idx = backends.module(plan.scores).decode_step(
                q, gates, cache.k_cmp, cache.v_cmp, k_s, v_s, *win, t=t, block=c.cmp_block, stride=c.cmp_stride,
                sel_block=c.sel_block, sel_count=c.sel_count, window=c.window, scale=c.softmax_scale,
                counts=cache.dec_counts)
            cache.reads = ReadCounts(cmp=cache.k_cmp.shape[1], win=win[0].shape[1], sel_blocks=idx,
                                     sel_rule=(t, c.sel_block))
            return out
        o_cmp, idx = self._cmp_and_blocks(plan, calls, q, cache.k_cmp, cache.v_cmp, branches, t)
        if o_cmp is not None:
            reads.cmp = cache.k_cmp.shape[1]
        o_win = o_sel = None
        if "win" in branches:
            o_win = ops.sliding_window_attention(q, *win, window=c.window, scale=c.softmax_scale,
                                                 backend=plan.backend("win"), q_start=t, k_start=t + 1 - win[0].shape[1])
            reads.win = win[0].shape[1]
        if idx is not None:
            reads.sel_blocks = idx
            if plan.backend("sel") == "sdpa":
                # Masked SDPA over a gather of only the selected blocks' tokens: reads counted from the gather.
                o_sel, reads.sel = _selected_decode(q, k_s, v_s, idx, t, c.sel_block, c.softmax_scale)
            else:
                # The kernel read the blocks in place: counted from its indices when read (cache.py).
                reads.sel_rule = (t, c.sel_block)
                if not self._fused_gate(plan, o_cmp, o_win):
                    o_sel = ops.selected_attention(q, k_s, v_s, idx, sel_block=c.sel_block, scale=c.softmax_scale,
                                                   backend=plan.backend("sel"), q_start=t)
        cache.reads = reads
        return self._gated(plan, q, k_s, v_s, idx, gates, o_cmp, o_sel, o_win, t)

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


def _joined(cache: NSACache, kv: Mapping[str, tuple[Tensor, Tensor]], name: str, last: int,
            whole: tuple[Tensor, Tensor] | None = None, t0: int = 0) -> tuple[Tensor, Tensor]:
    """The chunk's K/V of `kv[name]` after the `last` tokens before it: from `whole` (every token
    so far, `t0` of them cached) when given, else read from the cache's buffer `name` and joined."""
    k, v = kv[name]
    if last == 0:
        return k, v
    if whole is not None:
        return whole[0][:, t0 - last:], whole[1][:, t0 - last:]
    kb, vb = cache.raw[name]
    return torch.cat([kb.view(last), k], 1), torch.cat([vb.view(last), v], 1)


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
    # Token 0 of the forced block 0 is always valid, so no row is empty: skipping the empty-row
    # check keeps the step free of host syncs (capturable in a CUDA graph).
    o = masked_attention(q, kg, vg, mask, scale, fixed=(mask, None))
    return o, valid.sum(-1)


def _check_input(x: Tensor, c: NSAConfig) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.dim:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be [B, T, dim={c.dim}], got {shape}; pass the hidden states of this layer's "
                         "width, one row per sequence")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x must hold at least one sequence of at least one token, got [B, T, dim] = "
                         f"{tuple(x.shape)}; skip empty batches and prompts before the layer")


def _check_branches(branches: Sequence[str]) -> None:
    if isinstance(branches, str) or any(b not in BRANCHES for b in branches):
        raise ValueError(f"branches must be a sequence of names among {BRANCHES}, got {branches!r}; pass a tuple "
                         "such as ('cmp', 'sel', 'win') (all three, the default) or ('win',)")
