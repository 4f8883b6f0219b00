"""Prefill attention replayed from CUDA graphs: `NSAAttention.attend` without its host time.

A short prefill is bound by the host, not the GPU: at 1k-4k tokens on an H100 one `attend` call
spends 0.6-2.5 ms in Python and kernel launches against well under 1 ms of kernels
(docs/performance.md; results/h100/graphs/, results/h100/wheel-floors/). `GraphedAttend` captures `attend` once per call
signature and replays it: each later call with that signature costs a copy of its inputs into
the graph's buffers, one replay and a copy of the output.

    graphed = GraphedAttend(attn)            # attn: an NSAAttention on a CUDA device
    with torch.no_grad():
        o = graphed(q, kv, gates)            # as attn.attend(q, kv, gates): [B, T, Hq, dv]

What a graph holds fixed is what it was captured with, so the signature covers all of it: each
input's shape, strides, dtype and device, the branches, the module's requested backend, the
dispatch thresholds object in force (a new one after an override or an environment change), the
Triton tiles in force, and the module's parameters' storage (the MLP compressor reads them). A
call that differs in any of them captures a new graph. The output is bit for bit `attend`'s
under the tiles the graph was captured with (the same kernels on the same data;
tests/nsa/test_graphs.py). By default those are the tiles in force with the host's floors lifted
(`Tiles.for_graphs`), so a short call may run other kernels than the eager `attend` (the
block-centric selection, for one), each checked against the fp64 oracle on its own.

Costs: the first call of a signature runs `attend` `warmup` times and captures it (compiles and
autotuning happen there); each graph keeps the memory of one call's intermediates in its own
pool, so at most `max_graphs` are kept, the least recently used dropped first. Inference only:
replays record no autograd graph, so a call with gradients enabled and any input or parameter
requiring them raises. Training goes through the layer itself, `attn(x)` (or `attn.attend` called
directly), whose gradients flow as docs/nsa.md, "Training", says.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nsa import dispatch
from nsa.backends.triton_kernels.tiles import Tiles, current, use_tiles
from nsa.module import BRANCHES, NSAAttention

__all__ = ["GraphedAttend"]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    q: Tensor
    kv: dict[str, tuple[Tensor, Tensor]]
    gates: Tensor
    out: Tensor


def _copy_in(static_q: Tensor, static_kv: Mapping[str, tuple[Tensor, Tensor]], static_gates: Tensor, q: Tensor,
             kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor) -> None:
    """A call's inputs into a graph's own buffers (the capture's, and every replay's)."""
    static_q.copy_(q)
    static_gates.copy_(gates)
    for name, (k, v) in kv.items():
        static_kv[name][0].copy_(k)
        static_kv[name][1].copy_(v)


def _signature(t: Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


class GraphedAttend:
    """`attn.attend(q, kv, gates, branches)` replayed from one CUDA graph per call signature.

    `q [B, T, Hq, dk]`, `kv {name: (k [B, T, Hkv, dk], v [B, T, Hkv, dv])}` and `gates
    [B, T, Hq, 3]` as for `NSAAttention.attend`, all on one CUDA device. Returns a new
    `[B, T, Hq, dv]` tensor each call (a copy of the graph's output, so a later call never
    changes an earlier result). `max_graphs`: graphs kept (least recently used dropped first);
    `warmup`: eager calls on a side stream before each capture (compiles, autotuning, allocator).
    `tiles`: the Triton launch parameters to capture with; by default those in force at the call
    with the host's floors lifted (`Tiles.for_graphs`: a replay has no host time, so a short
    call takes the kernels that are fastest on the GPU).
    """

    def __init__(self, attn: NSAAttention, *, branches: Sequence[str] = BRANCHES, max_graphs: int = 4,
                 warmup: int = 2, tiles: Tiles | None = None) -> None:
        if not isinstance(attn, NSAAttention):
            raise TypeError(f"attn must be an NSAAttention, got {type(attn).__name__}")
        unknown = set(branches) - set(BRANCHES)
        if unknown or not branches:
            raise ValueError(f"branches must be a non-empty subset of {BRANCHES}, got {tuple(branches)}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}; each graph keeps one call's memory")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}; the first call compiles the kernels, "
                             "which a capture cannot do")
        if tiles is not None and not isinstance(tiles, Tiles):
            raise TypeError(f"tiles must be a Tiles or None, got {type(tiles).__name__}")
        self.attn, self.branches, self.max_graphs, self.warmup = attn, tuple(branches), max_graphs, warmup
        self.tiles = tiles
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self.captures = 0       # graphs captured so far (a test and a caller's check of re-capture)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and its memory."""
        self._graphs.clear()

    def __call__(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor) -> Tensor:
        tensors = [q, gates, *(t for pair in kv.values() for t in pair)]
        params = tuple(self.attn.parameters())
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *params)):
            raise RuntimeError("GraphedAttend is for inference: its replays record no autograd graph; call it under "
                               "torch.no_grad() (or torch.inference_mode()), and train through the layer itself "
                               "(attn(x), or attn.attend(q, kv, gates) without GraphedAttend), which carries gradients")
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"GraphedAttend needs every input on one CUDA device, got {sorted(map(str, devices))}; "
                             "call attn.attend(...) for CPU tensors")
        key = self._key(q, kv, gates, params)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(q, kv, gates)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        with torch.no_grad():
            _copy_in(entry.q, entry.kv, entry.gates, q, kv, gates)
            entry.graph.replay()
            return entry.out.clone()

    def _key(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor,
             params: tuple[Tensor, ...]) -> tuple:
        """What a graph holds fixed (module docstring). The thresholds object itself is in the key:
        a new one replaces it after any override, and the key keeps it alive, so no other object
        takes its identity while its graph is kept."""
        backend = self.attn.backend
        requested = backend if isinstance(backend, str) else tuple(sorted(backend.items()))
        return (_signature(q), _signature(gates),
                tuple((name, _signature(k), _signature(v)) for name, (k, v) in sorted(kv.items())),
                self.branches, requested, current(q.device), self.tiles,
                tuple((p.data_ptr(), p.dtype, tuple(p.shape)) for p in params),
                dispatch.thresholds(q.device))

    def _capture(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor) -> _Graph:
        tiles = self.tiles if self.tiles is not None else current(q.device).for_graphs()
        with use_tiles(tiles):
            return self._capture_with(q, kv, gates)

    def _capture_with(self, q: Tensor, kv: Mapping[str, tuple[Tensor, Tensor]], gates: Tensor) -> _Graph:
        static_q, static_gates = torch.empty_like(q), torch.empty_like(gates)
        static_kv = {name: (torch.empty_like(k), torch.empty_like(v)) for name, (k, v) in kv.items()}
        with torch.no_grad():
            _copy_in(static_q, static_kv, static_gates, q, kv, gates)
            # Warm up off the caller's stream, as torch.cuda.graph asks: kernels compile and the
            # allocator settles before the capture, which may neither compile nor synchronise.
            side = torch.cuda.Stream(q.device)
            side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side):
                for i in range(self.warmup):
                    self._warm(static_q, static_kv, static_gates, last=i == self.warmup - 1)
            torch.cuda.current_stream(q.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.attn.attend(static_q, static_kv, static_gates, self.branches)
        self.captures += 1
        return _Graph(graph, static_q, static_kv, static_gates, out)

    def _warm(self, q: Tensor, kv: dict[str, tuple[Tensor, Tensor]], gates: Tensor, last: bool) -> None:
        """One eager call; the last one with host synchronisations made errors. A capture that meets
        one fails, and torch then leaves its CUDA random generator marked as capturing (every later
        random draw on the device raises), so a call that synchronises is refused here, before."""
        if not last:
            self.attn.attend(q, kv, gates, self.branches)
            return
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.attn.attend(q, kv, gates, self.branches)
            return
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            cause = exc
        finally:
            torch.cuda.set_sync_debug_mode(before)
        plan = self.attn.plan(q, kv, self.branches)
        raise RuntimeError(f"this call synchronises with the host, so it cannot be captured in a CUDA graph ({cause}); "
                           f"its plan is [{plan.label}]. Call attn.attend(...) for it") from cause
