"""The `triton` backend: own Triton kernels for every NSA branch, forward and backward.

This module is the backend the registry names (`nsa.backends.__init__`): it says when the
kernels can run, validates inputs, picks the launch parameters and calls the kernel families in
`nsa.backends.triton_kernels` (one module each: selection (group- and block-centric), compressed +
scores, top-n, sliding).

    sliding(call), compressed(call), selected(call)     the registry's ops, `AttnCall` in
    compressed_and_scores(q, k_cmp, v_cmp, ...)        compressed output + selection scores
    compressed_select(q, k_cmp, v_cmp, ...)            compressed output + top-n blocks (scores kept internal)
    compressed_select_train(q, k_cmp, v_cmp, ...)      the same for training: output with gradients, one pass
    topn(scores, q_start, ...)                          block indices from scores
    selected_gated(q, k, v, idx, ...)                   selected attention + the gated sum
    beside(side, chain, finish, device=, rows=)         prefill: the window on a stream beside the chain
    sliding_decode(q, k_w, v_w, t=...)                  decode's window through the selection kernel
    decode_step(q, gates, caches..., t=...)             a whole decode step (all branches, gated), 4 launches
    decode_counts(groups, device)                       the per-group counts a cache keeps for decode_step

Launch parameters: the frozen `Tiles` of the device's GPU profile (nsa/profiles/: `sm90` for an
H100, `cpu` under the interpreter; `tiles(name)` by name). Every function above that launches
kernels takes `tiles=` (None: `use_tiles(...)`'s override if one is active, else the profile's).

A call that needs gradients (`AttnCall.grad`) runs the training kernels instead
(`triton_kernels/train.py` through the custom ops of `triton_kernels/autograd.py`): the forward
saves each row's log-sum-exp, the backward is deterministic. The inference kernels (and the FA-3 /
FA-4 wheels they may call) run only for calls without gradients; of the fusions, only
`compressed_select_train` (`train_scores`) serves a call that needs gradients.

All run under `TRITON_INTERPRET=1` on CPU (tests), and on CUDA.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nsa.backends import OPS, AttnCall, caps
from nsa.backends.triton_kernels.tiles import Tiles, current, interpreting, tiles, use_tiles

try:
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

if triton is not None:
    from nsa.backends.triton_kernels import autograd as _train
    from nsa.backends.triton_kernels import compressed as _cmp
    from nsa.backends.triton_kernels import decode as _dec
    from nsa.backends.triton_kernels import selection as _sel
    from nsa.backends.triton_kernels import selection_blocks as _selb
    from nsa.backends.triton_kernels import sliding as _win
    from nsa.backends.triton_kernels import topn as _topn

__all__ = ["Tiles", "beside", "compressed", "compressed_and_scores", "compressed_select", "current_tiles", "decode_counts", "decode_step",
           "decode_unsupported_reason", "distinct_blocks", "kernels_interpreted", "selected", "selected_gated", "sliding", "sliding_decode", "tiles", "topn", "unavailable_reason",
           "unsupported_reason", "use_tiles"]

CAPABILITIES = caps(backward=OPS, fusions=("scores", "train_scores", "gated", "beside", "decode_step"))

current_tiles = current


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    if triton is None:
        return "triton is not installed (pip install triton)"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        if not interpreting():
            return f"the triton backend runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1), got {dev}"
        if not kernels_interpreted():
            return ("TRITON_INTERPRET=1 was set after nsa's Triton kernels were defined, so they were compiled "
                    f"for the GPU and cannot take {dev} tensors; set it before importing nsa")
    return None


def kernels_interpreted() -> bool:
    """The own kernels run under Triton's interpreter: Triton decides that when a kernel is defined
    (TRITON_INTERPRET=1 at import of nsa's Triton modules), not per call."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_topn._topn, InterpretedFunction)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def unsupported_reason(call: AttnCall) -> str | None:
    q, v = call.q, call.v
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels take fp16/bf16/fp32, got {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return f"the triton kernels support head dims <= 256, got {q.shape[-1]}/{v.shape[-1]}"
    if call.op == "selected" and not (_pow2(call.sel_block) and call.sel_block >= 16):
        return f"the triton selection kernel needs sel_block a power of two >= 16, got {call.sel_block}"
    if call.op == "sliding" and (call.window is None or call.window < 1):
        return f"the triton sliding kernel needs a window >= 1, got {call.window}"
    if not call.grad:
        # The forward kernels add a sequence's base offset in int64 but index rows inside it in
        # int32 (a row times its stride); the training kernels index rows in int64.
        spans = {name: 1 + sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:], strict=True))
                 for name, x in (("q", q), ("k", call.k), ("v", v))}
        spans["the output"] = q.shape[1] * q.shape[2] * v.shape[-1]       # [B, Tq, Hq, dv], contiguous
        for name, span in spans.items():
            if span > _I32:
                return (f"the triton forward kernels index within a sequence in 32 bits: {name} spans {span} elements "
                        f"per sequence, more than 2^31 - 1; auto runs this call on another backend (or split the "
                        "sequence into chunks with prefill(x, cache=))")
    return None


_I32 = 2 ** 31 - 1


def _require() -> None:
    if triton is None:
        raise RuntimeError(f"the triton backend cannot run: {unavailable_reason()}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, names: str = "q, k, v") -> None:
    """`q [B, Tq, Hq, dk]`, `k [B, Tk, Hkv, dk]`, `v [B, Tk, Hkv, dv]`, one dtype, `Hq % Hkv == 0`."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{names} must be [B, T, H, D] tensors, got shapes {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}; the layout is the flash-attn one (tokens before heads)")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{names} must agree on B (all), Tk and Hkv (keys, values) and dk (queries, keys), got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads must be a multiple of key/value heads (GQA), got Hq={q.shape[2]}, "
                         f"Hkv={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{names} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")


def _check_block(name: str, block: int) -> None:
    if not (_pow2(block) and block >= 16):
        raise ValueError(f"{name} must be a power of two >= 16 (a tl.arange tile), got {block}; the paper uses 64")


def _tiles(x: Tensor, given: Tiles | None) -> Tiles:
    return given if given is not None else current(x.device)


def sliding(call: AttnCall) -> Tensor:
    """Causal sliding-window attention: query `t = q_start + i` of `q [B, Tq, Hq, dk]` reads keys
    `max(0, t - w + 1) .. t` among `k/v [B, Tk, Hkv, d*]` at positions `k_start ..` (decode:
    `q_start = t` and the last <= w keys) -> `[B, Tq, Hq, dv]`. Any GQA ratio, dk != dv."""
    _require()
    _check_qkv(call.q, call.k, call.v)
    if call.window is None or call.window < 1:
        raise ValueError(f"window must be an int >= 1, got {call.window}; the paper uses 512")
    if call.grad:
        return _train.sliding(call.q, call.k, call.v, window=call.window, scale=call.scale, q_start=call.q_start,
                              k_start=call.k_start)
    tk = call.k.shape[1]
    if call.q.shape[1] == 1 and call.k_start + tk - 1 == call.q_start and tk <= call.window:
        # A decode step over the window cache: the split selection-kernel path (more programs for
        # one query; the band kernel would run one program per KV group).
        return sliding_decode(call.q, call.k, call.v, t=call.q_start, scale=call.scale)
    return _win.sliding(call.q, call.k, call.v, window=call.window, scale=call.scale, q_start=call.q_start,
                        k_start=call.k_start, tiles=_tiles(call.q, None))


def _selection(q: Tensor, k: Tensor, tiles: Tiles):
    """The selection kernel family for this call: block-centric (selection_blocks.py) for small
    groups over many rows (prefill), else group-centric (selection.py)."""
    group, rows = q.shape[2] // k.shape[2], q.shape[0] * q.shape[1] * k.shape[2]
    return _selb if group <= tiles.selb_max_group and rows >= tiles.selb_min_rows else _sel


def distinct_blocks(idx: Tensor) -> Tensor:
    """`idx [..., n]` with each row's repeats of a block replaced by -1 (the rows sorted): the
    kernels attend every slot they are given, while the spec's selected set counts a block once
    (docs/nsa.md, "Selection"; nsa.reference.selected_attention)."""
    s = idx.sort(-1).values
    again = torch.zeros_like(s, dtype=torch.bool)
    again[..., 1:] = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    return s.masked_fill(again, -1)


def selected(call: AttnCall) -> Tensor:
    """Selected attention over `call.block_indices [B, Tq, Hkv, n]` -> `[B, Tq, Hq, dv]`; a block
    given twice in a row counts once (`distinct_blocks`)."""
    _require()
    _check_qkv(call.q, call.k, call.v)
    _check_block("sel_block", call.sel_block)
    if call.grad:
        return _train.selected(call.q, call.k, call.v, distinct_blocks(call.block_indices), sel_block=call.sel_block,
                               scale=call.scale, q_start=call.q_start, k_start=call.k_start)
    tiles = _tiles(call.q, None)
    return _selection(call.q, call.k, tiles).selected(call.q, call.k, call.v, distinct_blocks(call.block_indices),
                                                      sel_block=call.sel_block, scale=call.scale,
                                                      q_start=call.q_start, k_start=call.k_start, tiles=tiles)


def selected_gated(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, *, sel_block: int, scale: float,
                   gates: Tensor, o_cmp: Tensor, o_win: Tensor, q_start: int = 0, k_start: int = 0,
                   tiles: Tiles | None = None) -> Tensor:
    """The whole NSA output `g_cmp * o_cmp + g_sel * selected(q, k, v, idx) + g_win * o_win`
    (gates `[B, Tq, Hq, 3]`, o_cmp/o_win `[B, Tq, Hq, dv]`), the gated sum done in the selection
    kernel's epilogue. `idx` rows must hold distinct blocks, as `ops.select_blocks` and
    `compressed_select` give them (a repeat would be attended twice; `distinct_blocks` removes
    repeats, at the cost of a sort this hot path does not pay)."""
    _require()
    _check_qkv(q, k, v)
    _check_block("sel_block", sel_block)
    want = (*q.shape[:3], v.shape[-1])
    for name, x in (("o_cmp", o_cmp), ("o_win", o_win)):
        if tuple(x.shape) != want or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [B, Tq, Hq, dv] = {list(want)} with a unit last stride, "
                             f"got {list(x.shape)} strides {x.stride()}")
    if tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates must be [B, Tq, Hq, 3], got {list(gates.shape)}")
    tiles = _tiles(q, tiles)
    return _selection(q, k, tiles).selected(q, k, v, idx, sel_block=sel_block, scale=scale, q_start=q_start,
                                            k_start=k_start, tiles=tiles, gated=(gates, o_cmp, o_win))


@dataclasses.dataclass
class _Streams:
    """A device's two streams for `beside`, and the event after the last call's `finish`."""

    high: torch.cuda.Stream
    low: torch.cuda.Stream
    last: torch.cuda.Event | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_STREAMS: dict[torch.device, _Streams] = {}


def _streams(device: torch.device) -> _Streams:
    """The (high, low) priority streams of `device`, made once: a stream per call would cost a
    stream's creation and, in the caching allocator, a memory pool of its own every call."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pair = _STREAMS.get(device)
    if pair is None:
        # A lower number is a higher priority; torch maps a value past the device's range to its end.
        pair = _STREAMS.setdefault(device, _Streams(torch.cuda.Stream(device, priority=-100),
                                                    torch.cuda.Stream(device, priority=0)))
    return pair


def beside(side: Callable[[], Tensor | None], chain: Callable[[], Any],
           finish: Callable[[Tensor | None, Any], Tensor], *, device: torch.device | str, rows: int,
           tiles: Tiles | None = None) -> Tensor:
    """`finish(side(), chain())`, with `side` (the prefill window branch) on a low-priority stream
    beside `chain` (the compressed pass, scores, top-n) on a high-priority one, where the device is
    a GPU, `tiles.win_beside` is on and the call has `tiles.win_beside_min_rows` to
    `tiles.win_beside_rows` query rows (`rows` = B * T; beyond, the measured gain turned into a
    loss; below, the host bounds the call and the streams' waits cost it more than the overlap
    gives): the side's programs take what the chain's kernels leave
    idle (their tails, the gaps between top-n's launches), and the high priority keeps the chain,
    which gates everything after it, from waiting behind them. Elsewhere it runs `chain`, then
    `side`, then `finish` in order on the caller's stream.

    Order and memory, without `record_stream`: both streams start after the caller's stream's
    pending work and after the previous call's `finish`; `finish` runs on the caller's stream once
    both are done, so the result lives in the caller's pool and what follows sees it as if all ran
    in order. The two streams' outputs go back to their pools when this returns; the next call's
    streams, which alone allocate there, wait for this call's `finish` (an event) before reusing
    them. (`record_stream` would hold each freed block until an event on its reader passes: with
    the host ahead of the GPU, as in any loop, every call took fresh blocks, the pool grew to the
    device's limit, and emptying it stalled the GPU: 90-150 ms forwards against 35 among the
    repeats of lab/win_overlap.py at 64k.) Under a CUDA graph capture the streams
    fork from and join back to the capturing one, and the graph's private pool keeps its blocks,
    so no event is kept across calls."""
    dev = torch.device(device)
    tiles = tiles if tiles is not None else current(dev)
    if dev.type != "cuda" or interpreting() or not tiles.win_beside or \
            not tiles.win_beside_min_rows <= rows <= tiles.win_beside_rows:
        c = chain()
        return finish(side(), c)
    pair = _streams(dev)
    cur = torch.cuda.current_stream(dev)
    capturing = torch.cuda.is_current_stream_capturing()
    with pair.lock:
        for stream in (pair.high, pair.low):
            stream.wait_stream(cur)
            if pair.last is not None and not capturing:
                stream.wait_event(pair.last)
        with torch.cuda.stream(pair.low):
            s = side()
        with torch.cuda.stream(pair.high):
            c = chain()
        cur.wait_stream(pair.low)
        cur.wait_stream(pair.high)
        out = finish(s, c)
        if not capturing:
            pair.last = torch.cuda.Event()
            pair.last.record(cur)
        del s, c        # freed only after the event that the next call's streams wait for
    return out


def sliding_decode(q: Tensor, k_w: Tensor, v_w: Tensor, *, t: int, scale: float, block: int = 64,
                   tiles: Tiles | None = None) -> Tensor:
    """Decode's sliding branch: the query at position `t` (`q [B, 1, Hq, dk]`) over the window
    cache `k_w/v_w [B, n, Hkv, d*]` holding positions `t+1-n .. t` (the last `n <= w` tokens),
    as a block list of `block`-token blocks through the selection kernel (split over programs).
    Same result as `sliding` with `q_start=t, k_start=t+1-n`."""
    _require()
    _check_qkv(q, k_w, v_w, "q, k_w, v_w")
    if q.shape[1] != 1:
        raise ValueError(f"sliding_decode takes one query per sequence, got {q.shape[1]}; use the sliding op")
    _check_block("sliding_decode's block", block)
    return _win.sliding_decode(q, k_w, v_w, t=t, scale=scale, block=block, tiles=_tiles(q, tiles))


def compressed_and_scores(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                          scale: float, q_start: int = 0, scores: bool = True,
                          tiles: Tiles | None = None) -> tuple[Tensor, Tensor | None]:
    """Compressed-branch output `[B, Tq, Hq, dv]` and group scores `[B, Tq, Hkv, Nb]` (fp32, None
    with `scores=False`) in one kernel, for `q [B, Tq, Hq, dk]` at positions `q_start ..` over
    compressed keys/values `[B, Tc, Hkv, d*]` (token i summarises `[i*stride, i*stride + block)`).

    `Nb = (q_start + Tq - 1) // sel_block + 1`. Memory: the two outputs; nothing of size `T x Tc`.
    """
    _require()
    _check_qkv(q, k_cmp, v_cmp, "q, k_cmp, v_cmp")
    if block < 1 or stride < 1:
        raise ValueError(f"block and stride must be >= 1, got {block}, {stride}; the paper uses 32, 16")
    if scores:
        _check_block("sel_block", sel_block)
    return _cmp.compressed_and_scores(q, k_cmp, v_cmp, block=block, stride=stride, sel_block=sel_block, scale=scale,
                                      q_start=q_start, scores=scores, tiles=_tiles(q, tiles))


def compressed_select(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                      sel_count: int, scale: float, q_start: int = 0,
                      tiles: Tiles | None = None) -> tuple[Tensor, Tensor]:
    """Compressed-branch output `[B, Tq, Hq, dv]` and the top-n blocks `[B, Tq, Hkv, sel_count]`
    (int32): the values of `compressed_and_scores` then `topn`, for callers that need the blocks,
    not the scores. Prefill passes the scores to top-n without zeroing them or atomic adds at
    key-tile edges (the same fp32 sums, so the same blocks)."""
    _require()
    _check_qkv(q, k_cmp, v_cmp, "q, k_cmp, v_cmp")
    if block < 1 or stride < 1:
        raise ValueError(f"block and stride must be >= 1, got {block}, {stride}; the paper uses 32, 16")
    _check_block("sel_block", sel_block)
    if sel_count < 1:
        raise ValueError(f"sel_count must be >= 1, got {sel_count}; the paper uses 16")
    return _cmp.compressed_select(q, k_cmp, v_cmp, block=block, stride=stride, sel_block=sel_block,
                                  sel_count=sel_count, scale=scale, q_start=q_start, tiles=_tiles(q, tiles))


def topn(scores: Tensor, q_start: int, *, sel_block: int, sel_count: int, tiles: Tiles | None = None) -> Tensor:
    """Top-n block indices `[B, Tq, Hkv, sel_count]` (int32) from group scores `[B, Tq, Hkv, Nb]`:
    the rule of `nsa.selection.select_topn` (forced blocks, candidates `j <= t // l'`, ties to
    the lower index, ascending, -1 padded), no sort."""
    _require()
    if scores.dim() != 4 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a [B, Tq, Hkv, Nb] fp32 tensor, got {list(scores.shape)} {scores.dtype}; "
                         "pass compressed_and_scores' scores")
    if sel_count < 1:
        raise ValueError(f"sel_count must be >= 1, got {sel_count}; the paper uses 16")
    return _topn.topn(scores, q_start, sel_block=sel_block, sel_count=sel_count, tiles=_tiles(scores, tiles))


def compressed_select_train(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int, sel_block: int,
                            sel_count: int, scale: float, q_start: int = 0) -> tuple[Tensor, Tensor]:
    """The `train_scores` fusion: the compressed branch's training forward (its output carries
    gradients; it keeps its log-sum-exp for the backward) and the top-n blocks from that same
    log-sum-exp, so a training call makes one compressed pass, not an inference pass for the
    blocks and a training pass for the output. The blocks carry no gradient."""
    _require()
    _check_qkv(q, k_cmp, v_cmp, "q, k_cmp, v_cmp")
    _check_block("sel_block", sel_block)
    if sel_count < 1:
        raise ValueError(f"sel_count must be >= 1, got {sel_count}; the paper uses 16")
    o, lse2 = _train.band_attn(q, k_cmp, v_cmp, _train.CMP, 0, block, stride, scale, q_start, 0)
    with torch.no_grad():
        idx = _train.blocks_from_lse(q.detach(), k_cmp.detach(), v_cmp.detach(), lse2.detach(), block, stride,
                                     sel_block, sel_count, scale, q_start)
    return o, idx


def compressed(call: AttnCall) -> Tensor:
    """Compressed attention over `call.k/v` (compressed keys/values) -> `[B, Tq, Hq, dv]`."""
    if call.grad:
        _require()
        _check_qkv(call.q, call.k, call.v, "q, k_cmp, v_cmp")
        return _train.compressed(call.q, call.k, call.v, block=call.block, stride=call.stride, scale=call.scale,
                                 q_start=call.q_start)
    o, _ = compressed_and_scores(call.q, call.k, call.v, block=call.block, stride=call.stride, sel_block=16,
                                 scale=call.scale, q_start=call.q_start, scores=False)
    return o


def decode_unsupported_reason(q: Tensor, *, t: int, dv: int, block: int, stride: int, sel_block: int,
                              tiles: Tiles | None = None) -> str | None:
    """None when `decode_step` can run this step (one query per sequence, the kernels' block
    geometry, launch profile with `dec_fused`), else the reason the separate-op path runs it."""
    if triton is None:
        return unavailable_reason()
    if q.dim() != 4 or q.shape[1] != 1:
        return f"decode_step takes one query per sequence, q [B, 1, Hq, dk], got {list(q.shape)}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels take fp16/bf16/fp32, got {q.dtype}"
    return _dec.supported(dk=q.shape[-1], dv=dv, block=block, stride=stride, sel_block=sel_block, t=t,
                          tiles=_tiles(q, tiles))


def decode_step(q: Tensor, gates: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
                v_win: Tensor, *, t: int, block: int, stride: int, sel_block: int, sel_count: int, window: int,
                scale: float, tiles: Tiles | None = None, counts: Tensor | None = None, pos: Tensor | None = None,
                page_table: Tensor | None = None, page_size: int = 0, win_layout: str | None = None,
                idx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One decode step of the whole layer: `g_cmp * o_cmp + g_sel * o_sel + g_win * o_win`
    `[B, 1, Hq, dv]` for the query `q [B, 1, Hq, dk]` at position `t`, and its selected blocks
    `[B, 1, Hkv, sel_count]` (int32, ascending, -1 padded), in four launches (decode.py).

    Caches: compressed `k_cmp/v_cmp [B, Tc, Hkv, *]` (token i summarises `[i*stride, i*stride +
    block)`), raw `k_sel/v_sel [B, >= t+1, Hkv, *]` from position 0, the window `k_win/v_win
    [B, nw, Hkv, *]` holding positions `t+1-nw .. t` (`1 <= nw <= window`); gates `[B, 1, Hq, 3]`.
    `counts`: the step's per-group counts from `decode_counts` (zero, and left zero by the step),
    kept by the caller across steps so that no step zeroes them; None: a fresh buffer per step.

    Serving (nsa.serving): `pos` (int32 `[B]` on the device) puts each sequence's query at its own
    position, `t` then bounds them all (the launch shapes depend on t alone, so a CUDA graph of the
    step replays at any positions up to it); the window is then a ring (`win_layout="ring"`,
    `[B, W >= window, Hkv, *]`, position p at row p % W) or the raw cache's pages (`"pages"`).
    `page_table` (int32 `[B, pages]`) and `page_size` (a multiple of `sel_block`): `k_sel/v_sel`
    are a page pool `[n_pages, page_size, Hkv, *]`. `idx`: the selected blocks, given (an
    external indexer's; no top-n runs). decode.py's `decode_step` says more.
    """
    _require()
    tiles = _tiles(q, tiles)
    serving = pos is not None
    win_layout = win_layout or ("ring" if serving else "tail")
    why = decode_unsupported_reason(q, t=t, dv=v_sel.shape[-1] if v_sel.dim() == 4 else -1, block=block,
                                    stride=stride, sel_block=sel_block, tiles=tiles)
    if why is not None:
        raise ValueError(f"decode_step cannot run this step: {why}; use the separate ops (NSAAttention does)")
    _check_qkv(q, k_cmp, v_cmp, "q, k_cmp, v_cmp")
    if page_table is None:
        _check_qkv(q, k_sel, v_sel, "q, k_sel, v_sel")
    if win_layout != "pages":
        _check_qkv(q, k_win, v_win, "q, k_win, v_win")
    if not (k_sel.shape[2] == k_cmp.shape[2] == k_win.shape[2]) or not (
            v_sel.shape[-1] == v_cmp.shape[-1] == v_win.shape[-1]):
        raise ValueError(f"the three caches must share Hkv and dv, got k_sel {list(k_sel.shape)}, k_cmp "
                         f"{list(k_cmp.shape)}, k_win {list(k_win.shape)}, v dims {v_sel.shape[-1]}/"
                         f"{v_cmp.shape[-1]}/{v_win.shape[-1]}")
    if not serving:
        if t < 0 or k_sel.shape[1] < t + 1:
            raise ValueError(f"k_sel/v_sel must hold positions 0 .. t = {t}, got {k_sel.shape[1]} tokens")
        if window < 1 or not 1 <= k_win.shape[1] <= min(window, t + 1):
            raise ValueError(f"the window cache must hold the last 1 .. min(window={window}, t+1) tokens, got "
                             f"{k_win.shape[1]}")
    elif t < 0 or window < 1:
        raise ValueError(f"t (the bound on every position) must be >= 0 and window >= 1, got {t}, {window}")
    if tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates must be [B, 1, Hq, 3], got {list(gates.shape)}")
    if block < 1 or stride < 1 or sel_count < 1:
        raise ValueError(f"block, stride and sel_count must be >= 1, got {block}, {stride}, {sel_count}")
    return _dec.decode_step(q, gates, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, t=t, block=block, stride=stride,
                            sel_block=sel_block, sel_count=sel_count, window=window, scale=scale, tiles=tiles,
                            counts=counts, pos=pos, page_table=page_table, page_size=page_size,
                            win_layout=win_layout, idx=idx)


def decode_counts(groups: int, device: torch.device | str) -> Tensor:
    """A zeroed counts buffer for `decode_step` steps of up to `groups` = B * Hkv (sequence, KV
    group) pairs; steps leave it zero, so one buffer serves every step of a cache."""
    return _dec._counts(groups, torch.device(device))
