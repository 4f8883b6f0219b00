"""NSAConfig: every shape and knob of one NSA attention layer, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NSAConfig:
    """One NSA attention layer (arXiv 2502.11089). Defaults are the paper's.

    Attributes:
        dim: model width; input and output are `[B, T, dim]`.
        n_heads: query heads `Hq`.
        n_kv_heads: key/value heads `Hkv` (GQA groups); `n_heads % n_kv_heads == 0`.
        head_dim_qk: `dk`, query/key head dim. head_dim_v: `dv`, value head dim (may differ).
        cmp_block: `l`, raw tokens per compressed token. cmp_stride: `d`, step between blocks.
        sel_block: `l'`, selection block size. sel_count: `n`, selected blocks incl. the 3 forced
            (3 to MAX_SEL_COUNT = 4096).
        window: `w`, sliding-window width including the query token.
        phi: compression function, `"avg"` (mean) or `"mlp"` (learnable, with position embedding).
        kv: `"separate"` (paper: own K/V projections per branch) or `"shared"` (one K/V).
        rope: apply rotary embedding to queries and raw keys (before compression).
        rope_theta: RoPE base. scale: softmax scale, default `head_dim_qk ** -0.5`.
    """

    dim: int = 2560
    n_heads: int = 64
    n_kv_heads: int = 4
    head_dim_qk: int = 192
    head_dim_v: int = 128
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    sel_count: int = 16
    window: int = 512
    phi: str = "avg"
    kv: str = "separate"
    rope: bool = True
    rope_theta: float = 10000.0
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim_qk", "head_dim_v",
                     "cmp_block", "cmp_stride", "sel_block", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NSAConfig.{name} must be a positive int, got {value!r}; pass a count, such as "
                                 f"{getattr(NSAConfig, name)} (the default)")
        validate_branch_params(cmp_block=self.cmp_block, cmp_stride=self.cmp_stride,
                               sel_block=self.sel_block, sel_count=self.sel_count,
                               window=self.window)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"NSAConfig.n_heads must be a multiple of n_kv_heads, got {self.n_heads} and "
                f"{self.n_kv_heads}; choose n_kv_heads dividing n_heads")
        if self.phi not in ("avg", "mlp"):
            raise ValueError(f"NSAConfig.phi must be 'avg' or 'mlp', got {self.phi!r}; pass phi='avg' (mean pooling) "
                             "or phi='mlp' (the paper's learned compression)")
        if self.kv not in ("separate", "shared"):
            raise ValueError(f"NSAConfig.kv must be 'separate' or 'shared', got {self.kv!r}; pass kv='separate' (K/V "
                             "per branch, the paper's) or kv='shared' (one K/V for all three)")
        if self.rope and self.head_dim_qk % 2:
            raise ValueError(
                f"NSAConfig.head_dim_qk must be even when rope=True, got {self.head_dim_qk}; "
                "use an even head dim or rope=False")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
                                           and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"NSAConfig.scale must be a finite positive number or None, got {self.scale!r}; leave "
                             "it None for the usual head_dim_qk ** -0.5, or pass a positive float")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim_qk ** -0.5


# Upper bound of `sel_count` (docs/nsa.md, "Selection"): the selected blocks are `[B, T, Hkv, n]`
# whatever T, padded with -1, so n sizes a per-token tensor. 4096 is 256 times the paper's 16, an
# index row of 32 KiB per token and KV head, and 262k tokens at l' = 64 (twice the longest
# context run here, 128k); 10**9 asked for 8 GB per token and KV head.
MAX_SEL_COUNT = 4096


def validate_branch_params(*, cmp_block: int | None = None, cmp_stride: int | None = None,
                           sel_block: int | None = None, sel_count: int | None = None,
                           window: int | None = None) -> None:
    """Shared checks of the branch parameters; ValueError says what to fix."""
    for name, value in (("cmp_block", cmp_block), ("cmp_stride", cmp_stride),
                        ("sel_block", sel_block), ("window", window)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if cmp_block is not None and cmp_stride is not None and cmp_stride > cmp_block:
        raise ValueError(
            f"cmp_stride must be <= cmp_block (blocks may overlap but not leave gaps), got "
            f"stride {cmp_stride} > block {cmp_block}; lower the stride or raise the block")
    if sel_count is not None and (not isinstance(sel_count, int) or isinstance(sel_count, bool) or sel_count < 3):
        raise ValueError(
            f"sel_count must be an int >= 3 (block 0, the current and the previous block are "
            f"always selected), got {sel_count!r}")
    if sel_count is not None and sel_count > MAX_SEL_COUNT:
        raise ValueError(
            f"sel_count must be at most {MAX_SEL_COUNT}, got {sel_count}: the block indices are [B, T, Hkv, "
            f"sel_count] at any T (-1 padded, docs/nsa.md), {sel_count * 8} bytes per token and KV head; "
            "use the paper's 16, or a count near the blocks your longest sequence has (T / sel_block)")
