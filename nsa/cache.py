"""Decode state of NSAAttention: the token buffers, the compressed stream and the read counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from nsa.config import NSAConfig


def decode_read_budget(seq_len: int, config: NSAConfig) -> int:
    """The paper's per-step token budget (Table 4): `s/d + n*l' + w` (an upper bound)."""
    return seq_len // config.cmp_stride + config.sel_count * config.sel_block + config.window


@dataclass
class ReadCounts:
    """Tokens one decode step handed to each branch's kernel.

    `cmp`: compressed tokens; `sel`: `[B, Hkv]` raw tokens of the selected blocks that are `<= t`
    (each KV group selects its own blocks); `win`: raw tokens of the window. A step that gathers
    sets `sel` from its gather; a step whose kernel reads the blocks in place sets `sel_rule =
    (t, l')` and `sel` is counted from `sel_blocks` when read (off the step's own path, so a
    CUDA-graph replay of the step runs no counting kernels; read after a replay, it counts that
    replay's blocks).
    """

    cmp: int = 0
    win: int = 0
    sel_blocks: Tensor | None = None  # [B, 1, Hkv, n] blocks the step selected
    sel_rule: tuple[int, int] | None = None
    _sel: Tensor | None = None

    @property
    def sel(self) -> Tensor | None:
        if self._sel is not None or self.sel_rule is None or self.sel_blocks is None:
            return self._sel
        t, sel_block = self.sel_rule
        blocks = self.sel_blocks[:, 0].long()                                  # [B, Hkv, n]
        per_block = (t - blocks * sel_block + 1).clamp(0, sel_block)
        return torch.where(blocks >= 0, per_block, torch.zeros_like(per_block)).sum(-1)

    @sel.setter
    def sel(self, value: Tensor | None) -> None:
        self._sel = value


class TokenBuffer:
    """Append-only `[B, L, H, D]` token buffer with amortised O(1) appends.

    `keep=None` keeps everything; `keep=w` keeps (at least) the last w tokens, sliding them to the
    front when the capacity `2w` fills up, so a window cache never grows with the sequence.
    """

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self.data: Tensor | None = None
        self.n = 0

    def append(self, x: Tensor) -> None:
        if self.keep is not None and x.shape[1] > self.keep:
            # Longer than what is kept (a prefill, or a chunk of one): only its last `keep` tokens
            # stay, nothing before them, so a window buffer never grows with the prompt or chunk.
            x = x[:, x.shape[1] - self.keep:]
            self.n = 0
        if self.data is None:
            cap = max(2 * (self.keep or 0), 2 * x.shape[1], 16)
            self.data = x.new_empty(x.shape[0], cap, *x.shape[2:])
        if self.n + x.shape[1] > self.data.shape[1]:
            if self.keep is not None:
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
        if self.data is None:
            raise RuntimeError("the cache buffer is empty; prefill or step the cache before reading it")
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
    raw: dict[str, tuple[TokenBuffer, TokenBuffer]] = field(default_factory=dict)
    # The compressed stream, appended in amortised O(1) (a decode step never copies the stream).
    cmp: tuple[TokenBuffer, TokenBuffer] = field(default_factory=lambda: (TokenBuffer(), TokenBuffer()))
    reads: ReadCounts = field(default_factory=ReadCounts)
    # The fused Triton decode step's per-group counts (triton_nsa.decode_counts): zero between
    # steps, kept here so that no step spends a kernel zeroing them. None until the first step.
    dec_counts: Tensor | None = None
    # The cache layout of the layer that made it (NSAAttention.new_cache): a layer with another
    # layout refuses the cache instead of broadcasting it into wrong output.
    layout: tuple | None = None

    @property
    def k_cmp(self) -> Tensor | None:
        """Compressed keys `[B, n_cmp, Hkv, dk]` (a view), None before the first prefill/step."""
        return self.cmp[0].view() if self.cmp[0].data is not None else None

    @property
    def v_cmp(self) -> Tensor | None:
        return self.cmp[1].view() if self.cmp[1].data is not None else None
