"""Serving: a paged decode cache for a batch of sequences of different lengths, and its step.

`PagedCache` holds up to `max_seqs` sequences (slots) of one `NSAAttention` layer, each at its
own length:

- the raw K/V the selection branch reads (all of a `kv="shared"` layer's) in a pool of pages of
  `page_size` tokens (`sel_block` by default, or a multiple), addressed per slot by a block table
  `page_table [max_seqs, pages]` (int32, vLLM's layout). Page 0 is never handed out: free slots
  point every entry there, so their steps write and read nothing of another sequence;
- a `kv="separate"` layer's window K/V in a ring of `window` rows per slot, its compression
  branch's last `cmp_block` raw K/V in a ring per slot, and the compressed stream per slot
  (a shared-K/V layer's window reads the pages in place);
- the lengths, on the device (`lengths`, int32) and on the host (`lens`): the host allocates
  pages and never reads the device copy, so a step never synchronises.

A step (`PagedCache.step`) runs every slot: one fixed set of launches whatever the lengths, which
is what lets `GraphedDecode` capture it once and replay it at any positions. A free slot's row
computes on the null page and its output is to be ignored; only the slots in `active` advance.

    cache = PagedCache(attn, max_seqs=8, max_len=65536)
    for s, prompt in enumerate(prompts):            # x [1, T_s, dim]: each its own length
        y = cache.prefill(prompt, slot=cache.add())  # again on the same slot: the next chunk
    y_t = cache.step(x_t)                           # x_t [8, 1, dim] -> [8, 1, dim]

`fork(slot)` starts a sequence that shares the slot's pages (a common prefix); the first append
to a shared page copies it (copy on write; only the last page is ever written).
`export_blocks` / `import_blocks` convert selected blocks to and from the `topk_idx [Hkv,
total_q, k]` layout (int32, -1 padded) of vLLM's and TensorRT-LLM's block-sparse attention, so
the selection branch can run from an external indexer's blocks (`step(..., blocks=)`).

Needs the Triton backend's fused decode kernels (a CUDA device, or Triton's interpreter on a CPU);
the contiguous `NSACache` of `NSAAttention.step` serves every other backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import common
from nsa.backends.triton_kernels import decode as _dec
from nsa.backends.triton_kernels import serve as _serve
from nsa.cache import NSACache
from nsa.masks import n_compressed
from nsa.module import NSAAttention
from nsa.rope import apply_rope

__all__ = ["PagedCache", "export_blocks", "import_blocks"]

NULL_PAGE = 0


class PagedCache:
    """Paged decode state of up to `max_seqs` sequences of `layer` (module docstring).

    `max_len`: the longest sequence a slot may hold (sizes the block table, the compressed stream,
    the step's launch shapes and the fused step's RoPE tables, `max_len * head_dim_qk * 4` bytes). `num_pages`: the pool (default: every slot at `max_len`, plus
    the null page); forks share pages, so a pool smaller than that serves more sequences with
    common prefixes. `device`/`dtype`: the layer's parameters' by default.
    """

    def __init__(self, layer: NSAAttention, *, max_seqs: int, max_len: int, page_size: int | None = None,
                 num_pages: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, graph: bool | None = None) -> None:
        if not isinstance(layer, NSAAttention):
            raise TypeError(f"layer must be an NSAAttention, got {type(layer).__name__}")
        c = self.config = layer.config
        self.layer = layer
        param = next(layer.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        why = triton_nsa.unavailable_reason(self.device)
        if why is not None:
            raise RuntimeError(f"PagedCache needs the triton backend's decode kernels: {why}; use attn.new_cache() "
                               "and attn.step(...) (any backend) instead")
        for name, value in (("max_seqs", max_seqs), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        page = c.sel_block if page_size is None else page_size
        if not isinstance(page, int) or page < c.sel_block or page % c.sel_block:
            raise ValueError(f"page_size must be a multiple of sel_block={c.sel_block} (a page holds whole selection "
                             f"blocks), got {page_size!r}")
        why = triton_nsa.decode_unsupported_reason(
            torch.empty(1, 1, c.n_heads, c.head_dim_qk, device="meta"), t=max_len - 1, dv=c.head_dim_v,
            block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block)
        if why is not None:
            raise ValueError(f"the fused decode step cannot run this layer at max_len={max_len}: {why}")
        self.max_seqs, self.max_len, self.page_size = max_seqs, max_len, page
        self.pages_per_seq = -(-max_len // page)
        if num_pages is None:
            num_pages = max_seqs * self.pages_per_seq + 1
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), got {num_pages!r}")
        self.num_pages = num_pages
        hkv, dk, dv, dev, dt = c.n_kv_heads, c.head_dim_qk, c.head_dim_v, self.device, self.dtype
        self.raw_name = layer._kv_name("sel")
        self.k_pool = torch.zeros(num_pages, page, hkv, dk, device=dev, dtype=dt)
        self.v_pool = torch.zeros(num_pages, page, hkv, dv, device=dev, dtype=dt)
        self.shared = c.kv == "shared"
        if not self.shared:
            self.k_win = torch.zeros(max_seqs, c.window, hkv, dk, device=dev, dtype=dt)
            self.v_win = torch.zeros(max_seqs, c.window, hkv, dv, device=dev, dtype=dt)
        self.k_ring = torch.zeros(max_seqs, c.cmp_block, hkv, dk, device=dev, dtype=dt)
        self.v_ring = torch.zeros(max_seqs, c.cmp_block, hkv, dv, device=dev, dtype=dt)
        self.n_cmp = max(1, n_compressed(max_len, c.cmp_block, c.cmp_stride))
        self.k_cmp = torch.zeros(max_seqs, self.n_cmp, hkv, dk, device=dev, dtype=dt)
        self.v_cmp = torch.zeros(max_seqs, self.n_cmp, hkv, dv, device=dev, dtype=dt)
        self.page_table = torch.full((max_seqs, self.pages_per_seq), NULL_PAGE, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.counts = triton_nsa.decode_counts(max_seqs * hkv, dev)
        self.active = torch.zeros(max_seqs, dtype=torch.int32, device=dev)   # 1: the slot holds a sequence
        # Host state: which slots hold a sequence, their lengths and pages, the pool's free list
        # and each page's references (forks share pages).
        self.lens = [0] * max_seqs
        self.used = [False] * max_seqs
        self.pages: list[list[int]] = [[] for _ in range(max_seqs)]
        self.refs = [0] * num_pages
        self.free_pages = list(range(num_pages - 1, NULL_PAGE, -1))
        self._slots = torch.arange(max_seqs, device=dev)
        self._ring_pos = torch.arange(c.cmp_block, device=dev)
        self.last_blocks: Tensor | None = None   # the last step's selected blocks [max_seqs, 1, Hkv, n]
        # The fused step (one projection matmul, one prologue launch, the decode launches bound
        # once): head dims even (RoPE halves) and a half or fp32 cache; else the torch prologue.
        self.fused = (dt in (torch.float16, torch.bfloat16, torch.float32) and dk % 2 == 0 and dv % 2 == 0)
        self._q = torch.zeros(max_seqs, 1, c.n_heads, dk, device=dev, dtype=dt)
        self._gates = torch.zeros(max_seqs, 1, c.n_heads, 3, device=dev, dtype=dt)
        self._pos = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self._blocks_in = torch.full((max_seqs, 1, hkv, c.sel_count), -1, dtype=torch.int32, device=dev)
        self._weight_key: tuple | None = None
        self._weight: tuple[Tensor, Tensor] | None = None
        self._weight_gen = 0          # bumped when the side-by-side weights move to new storage
        self._weight_mods = [layer.q_proj, *(m for n in layer.kv_names for m in (layer.k_proj[n], layer.v_proj[n])),
                             layer.gate]
        if graph is not None and not isinstance(graph, bool):
            raise ValueError(f"graph must be True, False or None (None: on for a CUDA cache), got {graph!r}")
        self.graph = (self.device.type == "cuda") if graph is None else graph
        if self.graph and self.device.type != "cuda":
            raise ValueError(f"graph=True needs a cache on a CUDA device, got {self.device}; pass graph=False")
        self._graph: _StepGraph | None = None
        # The parameters a captured step reads where they are (o_proj, an MLP phi's; all of them on
        # the torch prologue): a graph whose parameter was replaced by a new tensor captures again.
        # The fused step's q, K/V and gate parameters are copied into its side-by-side weights.
        copied = {(id(m), "weight") for m in self._weight_mods} | {(id(layer.gate), "bias")}
        self._graph_params = [(m._parameters, n) for m in layer.modules() for n, p in m._parameters.items()
                              if p is not None and (id(m), n) not in copied]
        self._all_params = [(m._parameters, n) for m in layer.modules() for n, p in m._parameters.items()
                            if p is not None]
        self._launch: dict[bool, _dec.DecodeLaunch] = {}
        self._scratch: dict[str, Tensor] = {}
        self._proj: Tensor | None = None
        self._prologue_launch: common.BoundLaunch | None = None
        if self.fused:
            half = dk // 2
            inv_freq = c.rope_theta ** (-torch.arange(half, device=dev, dtype=torch.float32) / half)
            angle = torch.arange(max_len, device=dev).to(torch.float32)[:, None] * inv_freq    # as nsa.rope
            self._cos, self._sin = angle.cos().contiguous(), angle.sin().contiguous()

    # --- slots and pages (host) -----------------------------------------------------------------
    def add(self) -> int:
        """A free slot for a new sequence (length 0)."""
        for s, used in enumerate(self.used):
            if not used:
                self.used[s], self.lens[s] = True, 0
                self.lengths[s] = 0
                self.active[s] = 1
                return s
        raise RuntimeError(f"all {self.max_seqs} slots hold sequences; free() one, or make the cache with more "
                           "max_seqs")

    def free(self, slot: int) -> None:
        """End the sequence in `slot`: its pages return to the pool (those no fork still holds)."""
        self._check_slot(slot)
        for page in self.pages[slot]:
            self._release(page)
        self.pages[slot] = []
        self.used[slot], self.lens[slot] = False, 0
        self.page_table[slot] = NULL_PAGE
        self.lengths[slot] = 0
        self.active[slot] = 0

    def fork(self, slot: int) -> int:
        """A new slot continuing `slot`'s sequence: it shares every page (copy on write at the
        last, partly filled one) and copies the per-slot rings and compressed stream."""
        self._check_slot(slot)
        new = self.add()
        self.pages[new] = list(self.pages[slot])
        for page in self.pages[new]:
            self.refs[page] += 1
        self.lens[new] = self.lens[slot]
        self.page_table[new] = self.page_table[slot]
        self.lengths[new] = self.lens[slot]
        for buf in self._per_slot():
            buf[new] = buf[slot]
        return new

    def _per_slot(self) -> list[Tensor]:
        bufs = [self.k_ring, self.v_ring, self.k_cmp, self.v_cmp]
        return bufs if self.shared else [*bufs, self.k_win, self.v_win]

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_seqs or not self.used[slot]:
            raise ValueError(f"slot {slot!r} holds no sequence (slots in use: "
                             f"{[s for s, u in enumerate(self.used) if u]}); add() one first")

    def _release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_pages.append(page)

    def _new_page(self) -> int:
        if not self.free_pages:
            raise RuntimeError(f"the page pool ({self.num_pages - 1} pages of {self.page_size} tokens) is full; free() "
                               "a sequence, or make the cache with more num_pages")
        page = self.free_pages.pop()
        self.refs[page] = 1
        return page

    def reserve(self, slot: int, n: int) -> None:
        """Pages for `n` more tokens of `slot` (copying a shared last page first): host work
        before a step or a prefill writes them."""
        self._check_slot(slot)
        end = self.lens[slot] + n
        if end > self.max_len:
            raise ValueError(f"slot {slot} would hold {end} tokens, past max_len={self.max_len}; make the cache with "
                             "a larger max_len")
        first = self.lens[slot] // self.page_size
        pages = self.pages[slot]
        cow = n > 0 and first < len(pages) and self.refs[pages[first]] > 1
        need = -(-end // self.page_size)
        if cow + max(0, need - len(pages)) > len(self.free_pages):        # before taking any: nothing half done
            raise RuntimeError(f"the page pool ({self.num_pages - 1} pages of {self.page_size} tokens) is full; free() "
                               "a sequence, or make the cache with more num_pages")
        if cow:                                                            # copy on write
            old, new = pages[first], self._new_page()
            self.k_pool[new], self.v_pool[new] = self.k_pool[old], self.v_pool[old]
            self._release(old)
            pages[first] = new
            self.page_table[slot, first] = new
        while len(pages) < need:         # one fill per page: no host-to-device copy, so no synchronisation
            page = self._new_page()
            self.page_table[slot, len(pages)] = page
            pages.append(page)

    # --- prefill ---------------------------------------------------------------------------------
    def prefill(self, x: Tensor, slot: int) -> Tensor:
        """Prefill `slot` with `x [1, T, dim]` through the layer's own prefill (any backend, `auto`
        by default) and store its K/V: returns the layer's output `[1, T, dim]`. A slot that holds
        tokens already is continued (chunked prefill, `NSAAttention.prefill(x, cache=)`): its
        tokens are gathered from the pages and rings into a contiguous cache for the chunk (a copy
        of `O(t0)` tokens), and only the chunk's own K/V and compressed tokens are stored back."""
        self._check_slot(slot)
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"x must be one sequence [1, T, dim], got {tuple(x.shape) if isinstance(x, Tensor) else x}")
        t0 = self.lens[slot]
        self.reserve(slot, x.shape[1])
        if not t0:
            y, dense = self.layer.prefill(x)
            self.load(slot, dense)
            return y
        y, dense = self.layer.prefill(x, cache=self._contiguous(slot))
        self._store(slot, dense, t0)
        return y

    def _contiguous(self, slot: int) -> NSACache:
        """The `NSACache` of `slot`'s sequence: its raw tokens from the pages, the window's and the
        compression ring's last tokens in position order, its compressed stream."""
        layer, c = self.layer, self.config
        t = self.lens[slot]
        rows = self._rows(slot, torch.arange(t, device=self.device))
        cache = layer.new_cache()

        def last(k: Tensor, v: Tensor, n: int) -> tuple[Tensor, Tensor]:
            p = torch.arange(max(0, t - n), t, device=self.device)
            return k[slot, p % n][None], v[slot, p % n][None]

        for name, (kb, vb) in cache.raw.items():
            if name == self.raw_name:
                k = self.k_pool.view(-1, *self.k_pool.shape[2:])[rows][None]
                v = self.v_pool.view(-1, *self.v_pool.shape[2:])[rows][None]
            elif name == "win":
                k, v = last(self.k_win, self.v_win, c.window)
            else:
                k, v = last(self.k_ring, self.v_ring, c.cmp_block)
            kb.append(k)
            vb.append(v)
        n = n_compressed(t, c.cmp_block, c.cmp_stride)
        cache.cmp[0].append(self.k_cmp[slot:slot + 1, :n])
        cache.cmp[1].append(self.v_cmp[slot:slot + 1, :n])
        cache.length = t
        return cache

    def _store(self, slot: int, dense: NSACache, t0: int) -> None:
        """Tokens `t0 ..` of a contiguous cache (a chunk that continued the slot, or with t0 = 0 a
        whole prefill) into `slot`'s pages, rings and stream (pages reserved already)."""
        layer, c = self.layer, self.config
        t = dense.length
        kb, vb = dense.raw[self.raw_name]
        self._write_pages(slot, torch.arange(t0, t, device=self.device), kb.view(t - t0)[0], vb.view(t - t0)[0])
        rings = [(dense.raw[layer._kv_name("cmp")], self.k_ring, self.v_ring, c.cmp_block)]
        if not self.shared:
            rings.append((dense.raw["win"], self.k_win, self.v_win, c.window))
        for (kd, vd), k_ring, v_ring, n in rings:
            p = torch.arange(max(0, t - n), t, device=self.device)
            k_ring[slot, p % n] = kd.view(n)[0]
            v_ring[slot, p % n] = vd.view(n)[0]
        n_old = n_compressed(t0, c.cmp_block, c.cmp_stride)
        if dense.k_cmp is not None and dense.k_cmp.shape[1] > n_old:
            n = dense.k_cmp.shape[1]
            self.k_cmp[slot, n_old:n], self.v_cmp[slot, n_old:n] = dense.k_cmp[0, n_old:], dense.v_cmp[0, n_old:]
        self.lens[slot] = t
        self.lengths[slot] = t

    def load(self, slot: int, dense: NSACache) -> None:
        """Store a one-sequence contiguous cache (`NSAAttention.prefill`'s) in the empty `slot`."""
        self._check_slot(slot)
        self.layer._check_cache(dense)
        t = dense.length
        kb, vb = dense.raw[self.raw_name]
        if self.lens[slot] or kb.data is None or kb.data.shape[0] != 1:
            raise ValueError(f"load takes a one-sequence cache into an empty slot; slot {slot} holds "
                             f"{self.lens[slot]} tokens")
        self.reserve(slot, t)
        self._store(slot, dense, 0)

    def _rows(self, slot: int, pos: Tensor) -> Tensor:
        """Rows of `slot`'s positions `pos` in the pool viewed as `[pages * page_size, ...]`."""
        return self.page_table[slot, pos // self.page_size].long() * self.page_size + pos % self.page_size

    def _write_pages(self, slot: int, pos: Tensor, k: Tensor, v: Tensor) -> None:
        rows = self._rows(slot, pos)
        self.k_pool.view(-1, *self.k_pool.shape[2:])[rows] = k.to(self.dtype)
        self.v_pool.view(-1, *self.v_pool.shape[2:])[rows] = v.to(self.dtype)

    # --- decode ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Host work of the next step: a page for every active slot whose next token starts one
        (or writes a shared page). `step` calls it; `GraphedDecode` calls it before each replay."""
        page, refs = self.page_size, self.refs
        for s, used in enumerate(self.used):
            if used:
                n, pages = self.lens[s], self.pages[s]
                # Most steps write into the slot's own last page: nothing to do (no call, no check).
                if n % page == 0 or n >= self.max_len or n // page >= len(pages) or refs[pages[n // page]] > 1:
                    self.reserve(s, 1)

    def step(self, x_t: Tensor, *, blocks: Tensor | None = None) -> Tensor:
        """One decode step of every slot: `x_t [max_seqs, 1, dim]` (a free slot's row is ignored)
        -> `[max_seqs, 1, dim]`, each active slot at its own position, which then advances.
        `blocks`: the selected blocks given `[max_seqs, 1, Hkv, sel_count]` (`import_blocks`).

        On a CUDA cache (`graph=True`, the default there) the step without `blocks` is replayed
        from a CUDA graph captured at the first such step (the launches depend on the cache's sizes
        alone): the host's part is the page work, an input copy, one replay and an output copy.
        Changing the layer's parameters in place is seen by the next step; replacing one with a
        new tensor is seen too (copied into the fused weights, or the graph is captured again)."""
        self._check_step(x_t)             # before prepare: a refused step takes no page
        self.prepare()
        if self.graph and blocks is None:
            if self._graph is None:
                self._graph = _StepGraph(self, warmup=1)
            out = self._graph.run(x_t)
        else:
            out = self._step_device(x_t, blocks)
        self.advance()
        return out

    def advance(self) -> None:
        """The host's lengths after a step (the device's advanced in the step itself)."""
        for s, used in enumerate(self.used):
            if used:
                self.lens[s] += 1

    def step_device(self, x_t: Tensor, *, blocks: Tensor | None = None) -> Tensor:
        """The device work of `step`: no host synchronisation, the same launches at any lengths
        (the active slots' device lengths advance; `advance()` is the host's side)."""
        self._check_step(x_t)
        return self._step_device(x_t, blocks)

    def _check_step(self, x_t: Tensor) -> None:
        c = self.config
        if not isinstance(x_t, Tensor) or tuple(x_t.shape) != (self.max_seqs, 1, c.dim):
            raise ValueError(f"x_t must be [max_seqs={self.max_seqs}, 1, dim={c.dim}] (one row per slot; a free "
                             f"slot's row is ignored), got {tuple(x_t.shape) if isinstance(x_t, Tensor) else x_t}")
        if x_t.device != self.device:
            raise ValueError(f"x_t is on {x_t.device}, the cache on {self.device}; move x_t to the cache's device")
        if torch.is_grad_enabled() and (x_t.requires_grad or any(p.requires_grad for p in self.layer.parameters())):
            raise RuntimeError("a PagedCache step is for inference: its fused step records no autograd graph through "
                               "the projections and the attention; call it under torch.no_grad() (or "
                               "torch.inference_mode()), and train through the layer itself (attn(x))")

    def _step_device(self, x_t: Tensor, blocks: Tensor | None) -> Tensor:
        layer, c = self.layer, self.config
        if self.fused:
            return self._step_fused(x_t, blocks)
        pos = self.lengths
        q, kv, gates = self._project(x_t, pos)
        # The new token's K/V: the pages (a free slot's rows point at the null page), the rings.
        k_s, v_s = kv[self.raw_name]
        page = self.page_table.gather(1, (pos // self.page_size).long()[:, None])[:, 0].long()
        rows = page * self.page_size + (pos % self.page_size).long()
        self.k_pool.view(-1, *self.k_pool.shape[2:])[rows] = k_s[:, 0]
        self.v_pool.view(-1, *self.v_pool.shape[2:])[rows] = v_s[:, 0]
        if not self.shared:
            w = (pos % c.window).long()
            self.k_win[self._slots, w] = kv["win"][0][:, 0]
            self.v_win[self._slots, w] = kv["win"][1][:, 0]
        k_c, v_c = kv[layer._kv_name("cmp")]
        r = (pos % c.cmp_block).long()
        self.k_ring[self._slots, r] = k_c[:, 0]
        self.v_ring[self._slots, r] = v_c[:, 0]
        self._emit_compressed(pos)
        k_win, v_win = (self.k_pool, self.v_pool) if self.shared else (self.k_win, self.v_win)
        out, idx = triton_nsa.decode_step(
            q, gates, self.k_cmp, self.v_cmp, self.k_pool, self.v_pool, k_win, v_win, t=self.max_len - 1,
            block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block, sel_count=c.sel_count, window=c.window,
            scale=c.softmax_scale, counts=self.counts, pos=pos, page_table=self.page_table,
            page_size=self.page_size, win_layout="pages" if self.shared else "ring", idx=blocks)
        self.last_blocks = idx
        self.lengths.add_(self.active)
        return layer._out(out)

    def _fused_weights(self) -> tuple[Tensor, Tensor]:
        """The layer's q, K/V and gate weights side by side (and the gate's bias after zeros): one
        matmul projects a step. Refreshed when a parameter changes (its storage or version): in
        place when the shapes and dtype allow, so a captured step graph and the bound launches
        read the new values; else in new storage (`_weight_gen` counts those moves)."""
        mods = self._weight_mods
        gate_bias = mods[-1]._parameters["bias"]
        key = tuple((w.data_ptr(), w._version) for w in (m._parameters["weight"] for m in mods)) + (
            gate_bias.data_ptr(), gate_bias._version)
        if key != self._weight_key:
            with torch.no_grad():
                weight = torch.cat([m.weight for m in mods]).to(self.dtype)
                bias = torch.zeros(weight.shape[0], device=self.device, dtype=self.dtype)
                bias[-mods[-1].weight.shape[0]:] = gate_bias
                old = self._weight
                if old is not None and old[0].shape == weight.shape and old[0].device == weight.device:
                    old[0].copy_(weight)
                    old[1].copy_(bias)
                else:
                    self._weight = (weight, bias)
                    self._weight_gen += 1
            self._weight_key = key
        return self._weight

    def _step_fused(self, x_t: Tensor, blocks: Tensor | None) -> Tensor:
        """`step_device` in a few launches: the projection matmul, the prologue (serve.py), the
        decode kernels bound once (decode.py `DecodeLaunch`), the lengths' advance, o_proj."""
        layer, c = self.layer, self.config
        weight, bias = self._fused_weights()
        if self._proj is None or self._proj.shape[1] != weight.shape[0]:
            self._proj = torch.empty(self.max_seqs, weight.shape[0], device=self.device, dtype=self.dtype)
            self._prologue_launch = None
        torch.addmm(bias, x_t.reshape(self.max_seqs, c.dim).to(self.dtype), weight.t(), out=self._proj)
        if self._prologue_launch is None:
            self._prologue_launch = self._bind_prologue(self._proj)
        self._prologue_launch()
        if c.phi != "avg":
            self._emit_compressed(self._pos)
        given = blocks is not None
        if given:
            if tuple(blocks.shape) != tuple(self._blocks_in.shape):
                raise ValueError(f"blocks must be [max_seqs, 1, Hkv, sel_count] = {list(self._blocks_in.shape)} "
                                 f"int32 (import_blocks), got {list(blocks.shape)}")
            self._blocks_in.copy_(blocks)
        launch = self._launch.get(given)
        if launch is None:
            launch = self._launch[given] = self._bind_decode(given)
        launch()
        self.last_blocks = launch.idx
        self.lengths.add_(self.active)
        return layer._out(launch.out)

    def _bind_decode(self, given: bool) -> _dec.DecodeLaunch:
        c = self.config
        k_win, v_win = (self.k_pool, self.v_pool) if self.shared else (self.k_win, self.v_win)
        tiles = triton_nsa.current_tiles(self.device)
        return _dec.decode_step(
            self._q, self._gates, self.k_cmp, self.v_cmp, self.k_pool, self.v_pool, k_win, v_win, t=self.max_len - 1,
            block=c.cmp_block, stride=c.cmp_stride, sel_block=c.sel_block, sel_count=c.sel_count, window=c.window,
            scale=c.softmax_scale, tiles=tiles, counts=self.counts, pos=self._pos, page_table=self.page_table,
            page_size=self.page_size, win_layout="pages" if self.shared else "ring",
            idx=self._blocks_in if given else None, _plan=True, scratch=self._scratch)

    def _bind_prologue(self, proj: Tensor) -> common.BoundLaunch:
        c, layer = self.config, self.layer
        hq, hkv, dk, dv = c.n_heads, c.n_kv_heads, c.head_dim_qk, c.head_dim_v
        cols, off = {}, hq * dk
        for name in layer.kv_names:
            cols[name] = (off, off + hkv * dk)
            off += hkv * (dk + dv)
        sel, cmp_ = cols[self.raw_name], cols[layer._kv_name("cmp")]
        win = cols.get("win", (0, 0))
        nrole = 2 if self.shared else 3
        k_win, v_win = (self.k_ring, self.v_ring) if self.shared else (self.k_win, self.v_win)
        avg = c.phi == "avg"
        grid = (self.max_seqs, hq + nrole * 2 * hkv + 1 + (2 * hkv if avg else 0))
        return common.BoundLaunch(_serve._serve_prologue, grid, (
            proj, self.lengths, self._pos, self.page_table, self._cos, self._sin, self._q, self._gates, self.k_pool,
            self.v_pool, k_win, v_win, self.k_ring, self.v_ring, self.k_cmp, self.v_cmp, proj.stride(0),
            self.page_table.stride(0)), dict(
            HQ=hq, HKV=hkv, DK=dk, DV=dv, BHK=_serve.np2(dk // 2), BHV=_serve.np2(dv // 2),
            BG=_serve.np2(3 * hq), OK_SEL=sel[0], OV_SEL=sel[1], OK_WIN=win[0], OV_WIN=win[1], OK_CMP=cmp_[0],
            OV_CMP=cmp_[1], OG=off, NROLE=nrole, PAGE=self.page_size, W=c.window, CMP_BLOCK=c.cmp_block,
            STRIDE=c.cmp_stride, NC=self.n_cmp, ROPE=c.rope, AVG=avg))

    def _project(self, x_t: Tensor, pos: Tensor) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]], Tensor]:
        """`NSAAttention.project` with each slot at its own position `pos [max_seqs]`."""
        layer, c = self.layer, self.config
        b = x_t.shape[0]
        p = pos[:, None]
        q = layer.q_proj(x_t).view(b, 1, c.n_heads, c.head_dim_qk)
        if c.rope:
            q = apply_rope(q, p, c.rope_theta)
        kv = {}
        for name in layer.kv_names:
            k = layer.k_proj[name](x_t).view(b, 1, c.n_kv_heads, c.head_dim_qk)
            v = layer.v_proj[name](x_t).view(b, 1, c.n_kv_heads, c.head_dim_v)
            kv[name] = (apply_rope(k, p, c.rope_theta) if c.rope else k, v)
        gates = torch.sigmoid(layer.gate(x_t)).view(b, 1, c.n_heads, 3)
        return q, kv, gates

    def _emit_compressed(self, pos: Tensor) -> None:
        """Compressed token `(t+1-l)/d` of each slot whose token `t` completes one: computed for
        every slot from its ring (in position order) and stored where due (fixed shapes)."""
        c = self.config
        start = pos + 1 - c.cmp_block
        due = (start >= 0) & (start % c.cmp_stride == 0)
        order = (start[:, None] + self._ring_pos) % c.cmp_block                     # [B, l]
        k = self.k_ring.gather(1, order.long()[:, :, None, None].expand(-1, -1, *self.k_ring.shape[2:]))
        v = self.v_ring.gather(1, order.long()[:, :, None, None].expand(-1, -1, *self.v_ring.shape[2:]))
        nk, nv = self.layer.compress(k, v)                                          # [B, 1, Hkv, *]
        n = (start.clamp(min=0) // c.cmp_stride).clamp(max=self.n_cmp - 1).long()
        keep = due[:, None, None]
        self.k_cmp[self._slots, n] = torch.where(keep, nk[:, 0], self.k_cmp[self._slots, n])
        self.v_cmp[self._slots, n] = torch.where(keep, nv[:, 0], self.v_cmp[self._slots, n])


def export_blocks(idx: Tensor) -> Tensor:
    """Selected blocks `[B, Tq, Hkv, n]` (NSA's) -> `topk_idx [Hkv, B*Tq, n]` int32 (-1 padded)."""
    if idx.dim() != 4:
        raise ValueError(f"idx must be [B, Tq, Hkv, n], got {list(idx.shape)}")
    return idx.permute(2, 0, 1, 3).reshape(idx.shape[2], -1, idx.shape[3]).to(torch.int32).contiguous()


def import_blocks(topk_idx: Tensor, batch: int, q_len: int = 1) -> Tensor:
    """`topk_idx [Hkv, total_q, k]` (int32, -1 padded) -> NSA's `[B, Tq, Hkv, k]` for `total_q = B*Tq`."""
    if topk_idx.dim() != 3 or topk_idx.shape[1] != batch * q_len:
        raise ValueError(f"topk_idx must be [Hkv, total_q={batch * q_len}, k], got {list(topk_idx.shape)}")
    return topk_idx.reshape(topk_idx.shape[0], batch, q_len, -1).permute(1, 2, 0, 3).to(torch.int32).contiguous()



class _StepGraph:
    """One CUDA graph of `PagedCache.step_device` (no `blocks`): captured at the first `run`, then
    replayed at every later position (positions are read on the device). An in-place change of the
    parameters reaches the replay (the fused step's q, K/V and gate weights are copied into the
    side-by-side weights it reads first); it is captured again when the side-by-side weights move
    to new storage (`PagedCache._weight_gen`) or a parameter it reads where it is (o_proj, an MLP
    `phi`'s; every one on the torch prologue) is replaced by another tensor."""

    def __init__(self, cache: PagedCache, warmup: int) -> None:
        self.cache, self.warmup = cache, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self._gen = -1
        self._ptrs: tuple[int, ...] = ()
        self._x: Tensor | None = None
        self._out: Tensor | None = None

    def run(self, x_t: Tensor) -> Tensor:
        """The step of `x_t` after the cache's `prepare()` (the caller advances the host lengths)."""
        cache = self.cache
        if cache.fused:
            cache._fused_weights()
        held = cache._graph_params if cache.fused else cache._all_params
        ptrs = tuple(d[n].data_ptr() for d, n in held)
        if self.graph is None or self._gen != cache._weight_gen or ptrs != self._ptrs:
            self._capture(x_t)
            self._ptrs = ptrs
        self._x.copy_(x_t)
        self.graph.replay()
        return self._out.clone()

    def _capture(self, x_t: Tensor) -> None:
        cache = self.cache
        self.graph = self._out = None
        self._x = x_t.detach().clone()
        lengths = cache.lengths.clone()
        side = torch.cuda.Stream(cache.device)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.no_grad(), torch.cuda.stream(side):
            # Each warm-up step writes the same K/V at the same positions as the replay will, and
            # advances the device lengths, which are set back after it.
            for _ in range(self.warmup):
                cache._step_device(self._x, None)
                cache.lengths.copy_(lengths)
        torch.cuda.current_stream(cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            self._out = cache._step_device(self._x, None)
        self.graph, self._gen = graph, cache._weight_gen
        self.captures += 1


class GraphedDecode:
    """`PagedCache.step` replayed from one CUDA graph of its own: captured on the first call, then
    replayed at every later position of every slot (the step's launches depend on the cache's
    sizes alone, positions are read on the device), so it is never captured again as sequences
    grow, fork, end or start. Per call: the host's page work (`PagedCache.prepare`), a copy of
    `x_t` into the graph's input, one replay, a copy of the output. A CUDA cache's own `step`
    does the same (`PagedCache(graph=True)`, its default there); this wrapper keeps a graph apart
    from the cache's, with its own warm-up count and capture counter.

        step = GraphedDecode(cache)
        with torch.no_grad():
            y_t = step(x_t)          # as cache.step(x_t): [max_seqs, 1, dim]

    The graph holds the cache's tensors and, for the fused step, the layer's weights side by side
    (`PagedCache._fused_weights`, refreshed in place before each replay). Inference only, like
    nsa.graphs.GraphedAttend.
    """

    def __init__(self, cache: PagedCache, *, warmup: int = 2) -> None:
        if not isinstance(cache, PagedCache):
            raise TypeError(f"cache must be a PagedCache, got {type(cache).__name__}")
        if cache.device.type != "cuda":
            raise ValueError(f"GraphedDecode needs a cache on a CUDA device, got {cache.device}; call cache.step(x_t)")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first call compiles the kernels), got {warmup}")
        self.cache = cache
        self._graph = _StepGraph(cache, warmup)

    @property
    def captures(self) -> int:
        return self._graph.captures

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return self._graph.graph

    def __call__(self, x_t: Tensor) -> Tensor:
        cache = self.cache
        cache._check_step(x_t)
        cache.prepare()
        out = self._graph.run(x_t)
        cache.advance()
        return out
