"""Serving decode: one step of a batch through nsa.serving's paged cache, eager and replayed
from a CUDA graph, beside the same tokens in the contiguous cache of `NSAAttention.step` and
beside dense attention over them.

Cells (op `nsa_serve`): `B` sequences, either all of length `T` or, with `ragged` = (lo, hi,
seed), lengths drawn uniformly in [lo, hi] (`lengths(params)`); the layer of bench.suites.decode's
target (64/4 heads, D 128, NSA geometry of the paper), bf16. Every sequence holds its tokens
and the step is the next token of each.

Variants, each one step of the whole layer (projections, cache appends, attention, o_proj):
- `paged_step`: `PagedCache.step(x_t)` as a CUDA cache makes it by default (`graph=True`): the
  host's page work, an input copy, one replay of the cache's own graph, an output copy;
- `paged_eager`: `PagedCache.step(x_t)` with `graph=False`: every launch from the host;
- `paged_graph`: `GraphedDecode(cache)(x_t)`: page work, input copy, one replay, output copy;
- `contig_eager`, `contig_graph`: `NSAAttention.step` on contiguous caches of B sequences of one
  length (the cell's `T`, or for a ragged cell the mean of its lengths, so the same tokens), with
  the triton backend's fused step; the graph variant as bench.suites.decode's `capture_step`;
- `dense_cudnn`: SDPA (cuDNN) of the step's query over every cached key, eager, contiguous
  (`B` x the same length): what dense attention alone costs;
- `dense_fa3_paged`: FlashAttention-3's `flash_attn_with_kvcache` of the step's query over the
  paged cache's own pool, block table and lengths (the raw K/V every token holds; ragged cells
  too), attention alone, eager; `skipped` where the `fa3-fwd` wheel is not installed
  (bench/dense_fa3.py) or its build refuses paged K/V (the PyPI build does);
- `dense_fa3`: the same kernel over a contiguous copy of those tokens, each sequence its own
  length (`cache_seqlens`; zero-padded to the longest);
- `paged_even_graph` (ragged cells only): `GraphedDecode` over a paged cache of `B` sequences of
  the mean length, the same tokens: the ragged batch's cost against the equal-length one on the
  same path (issue 36's target for ragged batches).
The cache's lengths are set back before every timed call (a setup outside the timed region), so
every sample is the same step. Before timing, the paged step's output is checked against the
contiguous step's on the same tokens (equal-length cells; `failed` when they differ beyond bf16
rounding): the two must be the same work.
"""

from __future__ import annotations

import random
from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product

VARIANTS = (Variant("contig_graph", "baseline"), Variant("paged_graph"), Variant("paged_eager"),
            Variant("contig_eager"), Variant("dense_cudnn"), Variant("paged_even_graph"), Variant("paged_step"),
            Variant("dense_fa3_paged"), Variant("dense_fa3"))
NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
TARGET = {"B": 8, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "dim": 2560, **NSA, "page": 64}
SMOKE = {"B": 3, "Hq": 4, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 256, **NSA, "page": 64}
RAGGED = (4096, 65536, 0)

SPECS = (CaseSpec("nsa_serve", VARIANTS, {
    "smoke": product(layout=(SMOKE,), T=(200,), dtype=("bf16",)),
    # Nightly: the one ragged paged decode cell (B = 32, 4k-64k) with its trend.
    "nightly": product(layout=({**TARGET, "B": 32, "ragged": RAGGED},), T=(0,), dtype=("bf16",)),
    "full": (product(layout=(TARGET,), T=(8192, 16384, 32768, 65536), dtype=("bf16",))
             + product(layout=({**TARGET, "B": 32, "ragged": RAGGED},), T=(0,), dtype=("bf16",))),
}),)


def lengths(p: dict[str, Any]) -> list[int]:
    """The cell's sequence lengths: `T` for each of `B`, or `ragged` = (lo, hi, seed) drawn uniformly."""
    if p.get("ragged"):
        lo, hi, seed = p["ragged"]
        rng = random.Random(seed)
        return [rng.randint(lo, hi) for _ in range(p["B"])]
    return [p["T"]] * p["B"]


def build(cell: Cell, device) -> Workload:
    from bench.runner import file_build_error, release

    work = Workload(fns={}, backends={v.key: v.backend for v in cell.variants}, dtype=cell.params["dtype"])
    try:
        _populate(work, cell, device)
    except Exception as exc:  # noqa: BLE001 - filed per variant, as bench.suites.decode does
        file_build_error(work, cell.variants, exc)
        release(device.type)
    return work


def _populate(work: Workload, cell: Cell, device) -> None:
    import torch

    from bench.suites.decode import _module, capture_step, dense_decode, fill_cache
    from nsa.backends import triton_nsa
    from nsa.serving import GraphedDecode, PagedCache

    p = cell.params
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[p["dtype"]]
    why = triton_nsa.unavailable_reason(device)
    if why is not None:
        for v in cell.variants:
            work.reasons[v.key] = f"the paged decode step needs the triton backend: {why}"
        return
    keys = {v.backend: v.key for v in cell.variants}
    attn, config = _module({**p, "nsa_backend": "triton"}, device, dtype)
    lens = lengths(p)
    b = len(lens)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x_t = torch.randn(b, 1, p["dim"], generator=gen).to(device=device, dtype=dtype)
    cache = PagedCache(attn, max_seqs=b, max_len=max(lens) + 64, page_size=p["page"])
    even = round(sum(lens) / b)             # contiguous: B sequences of one length, the same tokens
    with torch.no_grad():
        xs = torch.randn(b, even, p["dim"], generator=gen).to(device=device, dtype=dtype)
        for i, n in enumerate(lens):        # one sequence at a time: only one contiguous copy at once
            x = xs[i:i + 1] if n == even else torch.randn(1, n, p["dim"], generator=gen).to(device=device, dtype=dtype)
            cache.load(cache.add(), fill_cache(attn, x))
            del x
        restore = _restorer(cache)
        work.fns[keys["paged_eager"]] = lambda: cache.step(x_t)
        work.setups[keys["paged_eager"]] = _with_graph(cache, False, restore)
        if device.type == "cuda":
            work.fns[keys["paged_step"]] = lambda: cache.step(x_t)
            work.setups[keys["paged_step"]] = _with_graph(cache, True, restore)
            graphed = GraphedDecode(cache)
            work.fns[keys["paged_graph"]] = lambda: graphed(x_t)
            work.setups[keys["paged_graph"]] = restore
        if p.get("ragged") and device.type == "cuda":
            even_cache = PagedCache(attn, max_seqs=b, max_len=even + 64, page_size=p["page"])
            for i in range(b):
                even_cache.load(even_cache.add(), fill_cache(attn, xs[i:i + 1]))
            even_graphed = GraphedDecode(even_cache)
            work.fns[keys["paged_even_graph"]] = lambda: even_graphed(x_t)
            work.setups[keys["paged_even_graph"]] = _restorer(even_cache)
        else:
            work.reasons[keys["paged_even_graph"]] = (
                "a ragged cell's equal-length twin: an equal-length cell's paged_graph is that case" if not p.get("ragged")
                else "CUDA graphs need a CUDA device")
        snapshot = fill_cache(attn, xs)
        del xs
        contig = _contiguous(snapshot)
        if device.type == "cuda":
            work.fns[keys["contig_graph"]] = capture_step(attn, x_t, snapshot, ("cmp", "sel", "win"))
        else:
            work.reasons[keys["contig_graph"]] = "CUDA graphs need a CUDA device"
            work.reasons[keys["paged_graph"]] = "CUDA graphs need a CUDA device"
            work.reasons[keys["paged_step"]] = "a cache's own graph needs a CUDA device (elsewhere it is paged_eager)"
        state = {}

        def setup_contig() -> None:
            state["cache"] = contig()

        work.fns[keys["contig_eager"]] = lambda: attn.step(x_t, state["cache"])
        work.setups[keys["contig_eager"]] = setup_contig
        k, v = (buf.view() for buf in snapshot.raw["sel"])
        q = torch.randn(b, 1, p["Hq"], p["Dk"], generator=gen).to(device=device, dtype=dtype)
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend
            work.fns[keys["dense_cudnn"]] = lambda: dense_decode(q, k, v, SDPBackend.CUDNN_ATTENTION,
                                                                 config.softmax_scale)
        else:
            work.reasons[keys["dense_cudnn"]] = "cuDNN attention needs a CUDA device"
        _fa3(work, keys, q, cache, config.softmax_scale)
        if device.type == "cuda":           # the cache's own graph replays the eager step, bit for bit
            outs = []
            for graph in (False, True):
                cache.graph = graph
                restore()
                outs.append(cache.step(x_t))
            restore()
            if not torch.equal(*outs):
                work.failures[keys["paged_step"]] = "the cache's graph step differs from its eager step"
                work.fns.pop(keys["paged_step"], None)
        cache.graph = False
        if not p.get("ragged"):             # the same work: paged and contiguous agree on one step
            restore()
            setup_contig()
            paged, dense = cache.step(x_t), attn.step(x_t, state["cache"])
            restore()
            err = _max_rel(paged, dense)
            if not err < 2e-2:
                for v in cell.variants:
                    work.failures[v.key] = f"the paged step differs from the contiguous step by {err:.3g} (max rel)"
                work.fns.clear()


def _with_graph(cache, graph: bool, restore):
    """A setup: the cache's lengths set back, and its step with (`graph=True`) or without its own graph."""
    def setup() -> None:
        cache.graph = graph
        restore()
    return setup


def _fa3(work: Workload, keys: dict[str, str], q, cache, scale: float) -> None:
    """`dense_fa3_paged` and `dense_fa3`: FA-3's kvcache kernel over the paged cache's pool, block
    table and lengths, and over a contiguous copy of the same tokens (`[B, longest, Hkv, D]`, each
    sequence its own `cache_seqlens`). Each is checked against dense attention of every sequence
    (fp32 math SDPA over its tokens read from the pages, `dense_decode`) before it is timed; a variant that raises or
    differs is filed alone, the cell's other variants go on."""
    import torch
    from torch.nn.attention import SDPBackend

    from bench import dense_fa3
    from bench.runner import why
    from bench.suites.decode import dense_decode

    paged, contig = keys["dense_fa3_paged"], keys["dense_fa3"]
    work.backends[paged], work.backends[contig] = f"{dense_fa3.NAME}_paged", dense_fa3.NAME
    why_not = dense_fa3.reason(q, cache.k_pool, cache.v_pool)
    if why_not is not None:
        work.reasons[paged] = work.reasons[contig] = why_not
        return
    fa3, lens, dev = dense_fa3.load(), cache.lengths.clone(), q.device
    seqs = []
    for b, n in enumerate(cache.lens):
        rows = cache._rows(b, torch.arange(n, device=dev))
        seqs.append(tuple(pool.view(-1, *pool.shape[2:])[rows] for pool in (cache.k_pool, cache.v_pool)))
    longest = max(cache.lens)
    k_c = torch.zeros(len(seqs), longest, *cache.k_pool.shape[2:], device=dev, dtype=cache.k_pool.dtype)
    v_c = torch.zeros(len(seqs), longest, *cache.v_pool.shape[2:], device=dev, dtype=cache.v_pool.dtype)
    for b, (k, v) in enumerate(seqs):
        k_c[b, :k.shape[0]], v_c[b, :v.shape[0]] = k, v
    fns = {paged: lambda: dense_fa3.decode_paged(fa3, q, cache.k_pool, cache.v_pool, cache.page_table, lens, scale),
           contig: lambda: dense_fa3.decode(fa3, q, k_c, v_c, lens, scale)}
    for key, fn in fns.items():
        try:
            out = fn()
        except RuntimeError as exc:
            if "paged" in str(exc).lower():
                work.reasons[key] = f"the installed FA-3 build refuses a paged cache: {why(exc)}"
            else:
                work.failures[key] = f"FA-3 raised {why(exc)}"
            continue
        for b, (k, v) in enumerate(seqs):
            ref = dense_decode(q[b:b + 1].float(), k.float()[None], v.float()[None], SDPBackend.MATH, scale)
            err = _max_rel(out[b:b + 1], ref)
            if not err < 2e-2:
                work.failures[key] = f"FA-3 differs from dense attention of sequence {b} by {err:.3g} (max rel)"
                break
        else:
            work.fns[key] = fn
    del seqs


def _max_rel(out, ref) -> float:
    """Largest absolute difference of `out` from `ref`, relative to `ref`'s largest magnitude."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def _restorer(cache):
    """A setup that sets a paged cache's lengths (device and host) back to those it has now, so
    every timed step is the same step."""
    saved, saved_host = cache.lengths.clone(), list(cache.lens)

    def restore() -> None:
        cache.lengths.copy_(saved)
        cache.lens[:] = saved_host
    return restore


def _contiguous(snapshot):
    """A fresh copy of a contiguous cache per timed call (a step appends to it)."""
    import copy

    return lambda: copy.deepcopy(snapshot)
