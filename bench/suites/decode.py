"""Decode: per-step latency of NSAAttention and its measured reads against the spec's, beside
dense decode over the same cache.

For each sequence length S, the module's cache holds the first S - 1 tokens and one step at
position t = S - 1 is timed (the cache is restored before every call, outside the timed
region, so every sample is the same step). Variants: all three branches, and each branch alone
(`branches`: the others are gated off and not computed). Reads come from the module's read
counters (`cache.reads`, what the kernels were given) and are compared with the exact counts of
docs/nsa.md: cmp `n_cmp(t)`, sel `(k - 1) * l' + t % l' + 1` with `k = min(n, t // l' + 1)`
selected blocks, win `min(w, t + 1)`, per KV group; a mismatch fails the case. The paper's
budget `s/d + n*l' + w` (Table 4) is recorded beside them.

Two parts of the step are timed per branch set. The whole `step` (no `part` param: q/k/v/gate
projections, the cache appends, the attention and o_proj) and, with `part: "attend"`, only its
attention: `attn.decode_attend(q_t, gates_t, cache, branches)` on the cache that already holds
token t (built by one eager step with no branch on a copy of the S - 1 token cache, the same
cache the dense baselines read) with q_t, gates_t from `project(x_t, start=t)`. decode_attend
changes nothing but `cache.reads`, so it needs no restore; its reads are checked like the step's.
The attention part is what the prefill benches (and the paper's Figure 6) time.

Dense baselines (op `dense`, same cell params): the step's query (`project(x_t)` at t = S - 1)
attending to every one of the S raw keys of the selection branch's cache (the K/V the NSA step
gathers from), no mask (every cached key is `<= t`), through SDPA restricted to its flash backend
(`sdpa_flash`, the baseline) or cuDNN (`sdpa_cudnn`), and FlashAttention-3's kvcache kernel (`fa3`,
the optional `fa3-fwd` wheel, bench/dense_fa3.py; `skipped` with the reason where it is not
installed or cannot take the call: bf16 and CUDA only). The dense call is attention only:
`dense_speedups` and `write_csv` pair it by params with both NSA parts, fastest dense / step
(projections included) and fastest dense / attend (attention against attention).

Knobs in the cell params: `nsa_backend` ("auto" or "triton": `NSAAttention(config, backend=)`),
and `graph: True`, which times the cell as CUDA graph replays (as `--cuda-graph` does for every
cell; skipped without a GPU). Under graphs each NSA step variant is captured once on its own copy
of the cache and replays re-run that one step's kernels on the same buffers (the new token's K/V
go to the same slot), so every sample is the same work; each attend variant is captured once on
the shared cache that holds token t. Reads are still checked on an eager call.

Every use of the decode API (new_cache / project / step / decode_attend / reads) is in this file;
`fill_cache` restates how prefill fills a cache (tests/bench/test_decode.py holds it to prefill's result).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from nsa_contract import atomic

BRANCHES = ("cmp", "sel", "win")
DENSE = ("sdpa_flash", "sdpa_cudnn", "fa3")
# Step variants first (their case ids predate the attend ones), then the attention-only part.
VARIANTS = (Variant("sdpa_flash", "baseline", op="dense"), Variant("sdpa_cudnn", op="dense"),
            Variant("fa3", op="dense"), Variant("auto", "candidate", (("branches", "all"),))) + tuple(
    Variant("auto", "candidate", (("branches", b),)) for b in BRANCHES) + tuple(
    Variant("auto", "candidate", (("branches", b), ("part", "attend"))) for b in ("all", *BRANCHES))
NSA_BACKENDS = ("auto", "triton")
NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
SMALL = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 256, **NSA}
GQA = {"B": 1, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 512, **NSA}
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 192, "Dv": 128, "dim": 2560, **NSA}
# The decode target: one step at B = 8 over a long cache, Triton module backend, CUDA graphs.
TARGET = {"B": 8, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "dim": 2560, **NSA, "nsa_backend": "triton",
          "graph": True}

SPECS = (CaseSpec("nsa_decode", VARIANTS, {
    "smoke": product(layout=(SMALL,), T=(20, 200, 1000), dtype=("bf16",)),
    # Nightly: the decode target (B = 8, CUDA graphs) at 8k and 64k, the trend cases; the eager
    # paper and GQA layouts are in `full` (the nightly job stays within 10 minutes on an H100).
    "nightly": product(layout=(TARGET,), T=(8192, 65536), dtype=("bf16",)),
    "full": (product(layout=(PAPER, GQA), T=(128, 512, 1024, 4096, 8192, 16384, 32768, 65536),
                     dtype=("bf16",))
             + product(layout=({**PAPER, "B": 4},), T=(1024, 8192, 32768), dtype=("bf16",))
             + product(layout=(TARGET,), T=(8192, 16384, 32768, 65536), dtype=("bf16",))),
}),)
CSV_COLUMNS = ("S", "ms_total", "ms_cmp", "ms_sel", "ms_win", "reads_actual", "reads_expected")
LAYOUT_COLUMNS = ("B", "Hq", "Hkv", "Dk", "Dv", "dtype")
# speedup_vs_dense: fastest dense / whole step; speedup_attend_vs_dense: fastest dense / decode_attend.
EXTRA_COLUMNS = ("nsa_backend", "cuda_graph", "ms_dense_flash", "ms_dense_cudnn", "ms_dense_fa3", "speedup_vs_dense",
                 "ms_attend", "ms_attend_cmp", "ms_attend_sel", "ms_attend_win", "speedup_attend_vs_dense")
# Tokens projected at a time while building a cache (bounds the fp32 RoPE temporaries of q).
FILL_CHUNK = 4096


def expected_reads(seq_len: int, p: dict[str, Any]) -> dict[str, int]:
    """Tokens per KV group that the step at t = seq_len - 1 must read, per branch (the spec's rules)."""
    t = seq_len - 1
    block, stride, ls, n = p["block"], p["stride"], p["sel_block"], p["sel_count"]
    k = min(n, t // ls + 1)  # selected blocks: all complete except the current one (t // ls)
    return {"cmp": 0 if t + 1 < block else (t + 1 - block) // stride + 1, "sel": (k - 1) * ls + t % ls + 1,
            "win": min(p["window"], t + 1)}


def cells(layout: dict[str, Any], lengths: Iterable[int], dtype: str) -> list[Cell]:
    """Cells for the playbook wrapper: one layout, several S."""
    return [Cell("decode", "nsa_decode", {**layout, "T": s, "dtype": dtype}, VARIANTS) for s in lengths]


def dense_decode(q, k, v, backend: Any, scale: float):
    """Dense attention of one step's query over a whole cache: q `[B, 1, Hq, Dk]`, k/v `[B, S, Hkv, D*]`
    (the cache's layout) -> `[B, 1, Hq, Dv]`. SDPA takes `[B, H, T, D]`, so it is transposed here.
    No mask: every cached key is `<= t` (`is_causal` would align a single query with key 0)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _module(p: dict[str, Any], device, dtype):
    from nsa import NSAAttention, NSAConfig

    config = NSAConfig(dim=p["dim"], n_heads=p["Hq"], n_kv_heads=p["Hkv"], head_dim_qk=p["Dk"],
                       head_dim_v=p["Dv"], cmp_block=p["block"], cmp_stride=p["stride"],
                       sel_block=p["sel_block"], sel_count=p["sel_count"], window=p["window"])
    # No parameter requires grad, so no step records an autograd graph.
    attn = NSAAttention(config, backend=p.get("nsa_backend", "auto"))
    return attn.to(device=device, dtype=dtype).requires_grad_(False), config


def fill_cache(attn, x, chunk: int = FILL_CHUNK):
    """The decode cache of `x [B, T, dim]`: what `attn.prefill(x, branches=())` leaves, without its
    whole-sequence q, gates and output (`[B, T, Hq, D]` each, with fp32 RoPE temporaries, tens of GB
    at B = 8, T = 64k). K/V are projected `chunk` tokens at a time; the window and compression
    buffers get only the tokens they keep (`w`, `l`); nothing of size T x T exists at any point."""
    import torch

    parts: dict[str, list[tuple[Any, Any]]] = {}
    for c0 in range(0, x.shape[1], chunk):
        _, kv, _ = attn.project(x[:, c0:c0 + chunk], start=c0)
        for name, pair in kv.items():
            parts.setdefault(name, []).append(pair)
    kv = {name: (torch.cat([k for k, _ in ps], 1), torch.cat([v for _, v in ps], 1)) for name, ps in parts.items()}
    del parts
    cache = attn.new_cache()
    for name, (kb, vb) in cache.raw.items():
        k, v = kv[name]
        keep = k.shape[1] if kb.keep is None else min(kb.keep, k.shape[1])
        kb.append(k[:, k.shape[1] - keep:])
        vb.append(v[:, v.shape[1] - keep:])
    for buf, x_cmp in zip(cache.cmp, attn.compress(*kv["cmp" if "cmp" in kv else "shared"]), strict=True):
        buf.append(x_cmp)
    cache.length = x.shape[1]
    return cache


def _measured_reads(reads: Any, branches: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    if "cmp" in branches:
        out["cmp"] = int(reads.cmp)
    if "sel" in branches:
        sel = reads.sel
        out["sel"] = float(sel.float().mean())
        out["sel_min"], out["sel_max"] = int(sel.min()), int(sel.max())
    if "win" in branches:
        out["win"] = int(reads.win)
    return out


def _warm(fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` once on a side stream, as capture needs before it (the args die with the call)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)


def _graph(fn: Callable[..., Any], *args: Any):
    """The CUDA graph of `fn(*args)`. capture_begin/end by hand rather than torch.cuda.graph: when
    the call raises, the capture still ends, the caller's stream comes back and the call's own
    error is the one raised. A call that syncs with the host (`.item()`, a host-to-device copy)
    cannot be captured: this raises."""
    import contextlib

    import torch

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin()
        try:
            fn(*args)
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            raise
        graph.capture_end()
    torch.cuda.synchronize()
    return graph


def capture_step(attn, x_t, snapshot, branches: tuple[str, ...]) -> Callable[[], None]:
    """CUDA-graph one step of `x_t` on its own copy of `snapshot`; return the graph's replay.

    A replay re-runs the captured kernels on the same buffers: the new token's K/V are written to
    the same slot, the same compressed token is emitted and the same blocks are read, so every
    replay is the same step (no buffer grows at this step: a filled cache has twice its length of
    room). The warmup runs on a throwaway copy, freed before the capture's copy is made.
    """
    import copy

    _warm(attn.step, x_t, copy.deepcopy(snapshot), branches)
    cache = copy.deepcopy(snapshot)
    graph = _graph(attn.step, x_t, cache, branches)

    def replay(graph=graph, cache=cache) -> None:  # the graph's buffers live in `cache`
        graph.replay()
    return replay


def capture_attend(attn, q_t, gates_t, cache, branches: tuple[str, ...]) -> Callable[[], None]:
    """CUDA-graph `attn.decode_attend(q_t, gates_t, cache, branches)`; return the graph's replay.

    decode_attend writes nothing of `cache` (only the Python attribute `cache.reads`), so the
    warmup and the capture run on `cache` itself, which the other attend variants and the dense
    baselines share; every replay is the same attention over the same buffers.
    """
    _warm(attn.decode_attend, q_t, gates_t, cache, branches)
    graph = _graph(attn.decode_attend, q_t, gates_t, cache, branches)

    def replay(graph=graph, held=(q_t, gates_t, cache)) -> None:  # the graph reads these buffers
        graph.replay()
    return replay


def _attempt(work: Workload, key: str, fn: Callable[[], Any], device, *, sdpa: bool,
             who: str = "SDPA backend") -> bool:
    """Run `fn` once (compiles, allocates); True when it ran. Otherwise file the reason: out of
    memory, or a backend that cannot take the call (an nsa `BackendError`, or with `sdpa` any
    RuntimeError of the dense kernel `who`), is `skipped`; anything else `failed`."""
    from bench.runner import is_oom, release, why
    from nsa.backends import BackendError

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
        if is_oom(exc):
            work.reasons[key] = f"out of memory on the first call: {why(exc)}"
            release(device.type)
        elif isinstance(exc, BackendError):
            work.reasons[key] = f"the nsa backend cannot run here: {why(exc)}"
        elif sdpa and isinstance(exc, RuntimeError):
            # "No available kernel", cuDNN absent or shape unsupported, FA-3 off Hopper: not this
            # variant's fault.
            work.reasons[key] = f"{who} cannot run this call: {why(exc)}"
        else:
            work.failures[key] = f"first call raised {why(exc)}"
        return False
    return True


def _dense_variant(work: Workload, key: str, q, k, v, backend: Any, scale: float, device) -> None:
    """Native GQA first; a backend without it gets K/V repeated to Hq heads (built here, outside the
    timed call; the case says so in `gqa`), as bench.suites.prefill's dense variants do."""
    work.backends[key] = key
    gqa = q.shape[2] != k.shape[2]
    work.extra[key] = {"gqa": "native" if gqa else "none (MHA)", "reads": {"total": k.shape[1]}}
    fn = lambda: dense_decode(q, k, v, backend, scale)  # noqa: E731
    if not _attempt(work, key, fn, device, sdpa=True):
        if not gqa or key not in work.reasons:
            return
        first = work.reasons.pop(key)
        group = q.shape[2] // k.shape[2]
        k_rep, v_rep = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        fn = lambda: dense_decode(q, k_rep, v_rep, backend, scale)  # noqa: E731
        if not _attempt(work, key, fn, device, sdpa=True):
            work.extra[key]["gqa"] = "unsupported, native or with K/V repeated"
            return
        work.extra[key]["gqa"] = f"K/V repeated to {q.shape[2]} heads (native GQA: {first})"
    work.fns[key] = fn


def _fa3_variant(work: Workload, key: str, q, k, v, scale: float, device) -> None:
    """Dense decode on FA-3's kvcache kernel over the same S cached tokens (native GQA, nothing
    appended), or `skipped` with the reason it cannot run."""
    from bench import dense_fa3

    work.backends[key] = dense_fa3.NAME
    work.extra[key] = {"gqa": "native" if q.shape[2] != k.shape[2] else "none (MHA)", "reads": {"total": k.shape[1]}}
    why_not = dense_fa3.reason(q, k, v)
    if why_not is not None:
        work.reasons[key] = why_not
        return
    fa3, lengths = dense_fa3.load(), dense_fa3.cache_lengths(k)
    fn = lambda: dense_fa3.decode(fa3, q, k, v, lengths, scale)  # noqa: E731
    if _attempt(work, key, fn, device, sdpa=True, who="FA-3"):
        work.fns[key] = fn


def _branches(v: Variant) -> tuple[str, ...]:
    which = dict(v.extra)["branches"]
    return BRANCHES if which == "all" else (which,)


def _part(v: Variant) -> str:
    """`step` (the whole decode step) or `attend` (decode_attend only)."""
    return dict(v.extra).get("part", "step")


def _branch_backends(backend: str, branches: tuple[str, ...], choices: list[dict[str, Any]]) -> dict[str, str]:
    """What ran per branch: nsa.dispatch's record, else the explicit module backend; with auto,
    the selection decode is a gather + masked SDPA inside the module (never dispatched)."""
    by_op = {c["op"]: c["backend"] for c in choices}
    # With auto above the triton thresholds the module takes its fused Triton path (recorded as
    # op nsa_triton_path): compressed and selected both run on Triton, neither is dispatched.
    fused = backend == "triton" or by_op.get("nsa_triton_path") == "triton"
    default = {"cmp": "triton" if fused else ("sdpa" if backend == "auto" else backend),
               "sel": "triton" if fused else "sdpa", "win": "sdpa"}
    return {b: by_op.get(op, default[b]) for b, op in (("cmp", "compressed"), ("sel", "selected"),
                                                     ("win", "sliding")) if b in branches}


def _label(ran: dict[str, str]) -> str:
    names = set(ran.values())
    return names.pop() if len(names) == 1 else "+".join(f"{b}:{n}" for b, n in ran.items())


def build(cell: Cell, device) -> Workload:
    from bench.runner import file_build_error, release

    p = cell.params
    backend = p.get("nsa_backend", "auto")
    work = Workload(fns={}, backends={}, dtype=p["dtype"], cuda_graph=bool(p.get("graph", False)))
    steps = {v.key: _branches(v) for v in cell.variants if v.op != "dense"}
    for key, branches in steps.items():  # until a step runs: the backends that would run on a CPU
        work.backends[key] = _label(_branch_backends(backend, branches, []))
    if work.cuda_graph and device.type != "cuda":
        for v in cell.variants:
            work.reasons[v.key] = ("graph=True times this cell as CUDA graph replays, which need a CUDA "
                                   f"device, got {device.type}; run it on a GPU")
        return work
    try:
        if backend not in NSA_BACKENDS:
            raise ValueError(f"nsa_backend must be one of {NSA_BACKENDS}, got {backend!r}; fix the decode grid")
        _populate(work, cell, device, backend, steps)
    except Exception as exc:  # noqa: BLE001 - filed here so every case keeps the backend label set above
        file_build_error(work, cell.variants, exc)
        work.captures.clear()
    else:
        return work
    release(device.type)  # here, once the exception (and the inputs its frames hold) is gone
    return work


def _populate(work: Workload, cell: Cell, device, backend: str, steps: dict[str, tuple[str, ...]]) -> None:
    import copy

    from bench import parity
    from nsa import backends, decode_read_budget, dispatch

    p = cell.params
    S = p["T"]
    # The module calls its Triton kernels directly in decode: ask the backend first, so a CPU
    # without TRITON_INTERPRET gets a reason rather than Triton's driver error.
    blocked = None if backend == "auto" else backends.unavailable_reason(backend, device)
    dtype = parity.dtype_of(p["dtype"])
    attn, config = _module(p, device, dtype)
    gen = parity.generator(device, 0)
    x = parity.randn((p["B"], S, p["dim"]), dtype, device, gen)
    x_t = x[:, S - 1:].clone()
    # The cache of the first S - 1 tokens; no branch is needed to fill it.
    snapshot = fill_cache(attn, x[:, :S - 1])
    del x
    expected = expected_reads(S, p)
    # The cache a step at t = S - 1 reads: the snapshot plus token t, appended by a step with no
    # branch (it appends and attends to nothing). The dense variants read all S raw tokens of its
    # selection branch; the attend variants run decode_attend on it with that step's q and gates.
    after = copy.deepcopy(snapshot)
    attn.step(x_t, after, ())
    kb, vb = after.raw["sel" if "sel" in after.raw else "shared"]
    k_all, v_all = kb.view(), vb.view()
    q_t, _, gates_t = attn.project(x_t, start=S - 1)
    for v in cell.variants:
        key = v.key
        if v.op == "dense" and v.backend == "fa3":
            _fa3_variant(work, key, q_t, k_all, v_all, config.softmax_scale, device)
            continue
        if v.op == "dense":
            _dense_variant(work, key, q_t, k_all, v_all, _sdpa_backend(v.backend), config.softmax_scale, device)
            continue
        branches = steps[key]
        if blocked is not None and backend in _branch_backends(backend, branches, []).values():
            work.reasons[key] = f"nsa_backend={backend} cannot run here: {blocked}"
            continue
        if _part(v) == "attend":  # no state to restore: decode_attend only sets after.reads
            def fn(branches=branches):
                return attn.decode_attend(q_t, gates_t, after, branches)

            setup = None
            capture = lambda branches=branches: capture_attend(attn, q_t, gates_t, after, branches)  # noqa: E731
            last_reads = lambda: after.reads  # noqa: E731
        else:
            state: dict[str, Any] = {}

            def setup(state=state) -> None:
                state["cache"] = copy.deepcopy(snapshot)

            def fn(state=state, branches=branches):
                return attn.step(x_t, state["cache"], branches)

            setup()
            capture = lambda branches=branches: capture_step(attn, x_t, snapshot, branches)  # noqa: E731
            last_reads = lambda state=state: state.pop("cache").reads  # noqa: E731
        with dispatch.recording() as choices:
            if not _attempt(work, key, fn, device, sdpa=False):
                continue
        ran = _branch_backends(backend, branches, choices)
        work.backends[key] = _label(ran)
        reads = _measured_reads(last_reads(), branches)
        want = {b: expected[b] for b in branches}
        reads["total"] = sum(reads[b] for b in branches)
        want["total"] = sum(want.values())
        work.extra[key] = {"branch_backends": ran, "reads": reads, "reads_expected": want,
                           "reads_budget": decode_read_budget(S, config)}
        wrong = [b for b in branches if reads[b] != want[b]
                 or (b == "sel" and reads["sel_min"] != reads["sel_max"])]
        if wrong:
            work.failures[key] = "reads differ from the spec: " + ", ".join(
                f"{b} measured {reads[b]:g} expected {want[b]}" for b in wrong)
        else:
            work.fns[key], work.captures[key] = fn, capture
            if setup is not None:
                work.setups[key] = setup


def _sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def _row_key(p: dict[str, Any]) -> tuple:
    return tuple(p.get(k) for k in ("T", *LAYOUT_COLUMNS, "dim", "block", "stride", "sel_block", "sel_count",
                                    "window", "nsa_backend", "graph"))


def dense_speedups(cases: Iterable[dict[str, Any]]) -> dict[tuple, dict[str, float]]:
    """Per decode cell (keyed by its params, `branches` and `part` aside): median ms of the whole
    NSA step (`nsa`), of its attention alone (`attend`, decode_attend) and of each dense backend
    that ran; `speedup` = fastest dense / NSA step (projections included) and `speedup_attend` =
    fastest dense / NSA attention (attention against attention, as the prefill benches compare)."""
    out: dict[tuple, dict[str, float]] = {}
    for case in cases:
        p, timing = case["params"], case.get("timing")
        if case.get("suite") != "decode" or not timing or case.get("op") not in ("nsa_decode", "dense"):
            continue
        if case["op"] == "nsa_decode" and p.get("branches", "all") != "all":
            continue
        if case["op"] == "dense":
            name = case["requested_backend"]
        else:
            name = "attend" if p.get("part") == "attend" else "nsa"
        out.setdefault(_row_key(p), {})[name] = timing["median_ms"]
    for row in out.values():
        dense = [row[d] for d in DENSE if d in row]
        for nsa, ratio in (("nsa", "speedup"), ("attend", "speedup_attend")):
            if dense and row.get(nsa):
                row[ratio] = min(dense) / row[nsa]
    return out


def write_csv(cases: Iterable[dict[str, Any]], path: str | Path) -> int:
    """The legacy decode CSV (`S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected`, then
    the layout, then `EXTRA_COLUMNS`: module backend, CUDA graphs, dense ms, fastest dense / NSA
    step, then decode_attend ms (all branches, then each alone) and fastest dense / decode_attend)
    from decode case records; one row per cell. `ms_total`..`ms_win` are whole steps. Returns the
    row count."""
    cases = list(cases)
    rows: dict[tuple, dict[str, Any]] = {}
    # Step cases first, so reads and cuda_graph come from the step when it ran, else from attend.
    nsa = sorted((c for c in cases if c.get("suite") == "decode" and c.get("op") == "nsa_decode"),
                 key=lambda c: c["params"].get("part") == "attend")
    for case in nsa:
        p = case["params"]
        row = rows.setdefault(_row_key(p), {"S": p["T"], **{k: p.get(k) for k in LAYOUT_COLUMNS},
                                            "nsa_backend": p.get("nsa_backend", "auto")})
        which = p.get("branches", "all")
        timing = case.get("timing")
        if p.get("part") == "attend":
            column = "ms_attend" if which == "all" else f"ms_attend_{which}"
        else:
            column = "ms_total" if which == "all" else f"ms_{which}"
        row[column] = f"{timing['median_ms']:.6g}" if timing else ""
        if which == "all" and case.get("reads") and "reads_actual" not in row:
            row["reads_actual"] = f"{case['reads']['total']:g}"
            row["reads_expected"] = case["reads_expected"]["total"]
        if which == "all" and "cuda_graph" in case and "cuda_graph" not in row:
            row["cuda_graph"] = case["cuda_graph"]
    for key, found in dense_speedups(cases).items():
        if key in rows:
            for name, column in (("sdpa_flash", "ms_dense_flash"), ("sdpa_cudnn", "ms_dense_cudnn"),
                                 ("fa3", "ms_dense_fa3"), ("speedup", "speedup_vs_dense"),
                                 ("speedup_attend", "speedup_attend_vs_dense")):
                if name in found:
                    rows[key][column] = f"{found[name]:.6g}"
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[*CSV_COLUMNS, *LAYOUT_COLUMNS, *EXTRA_COLUMNS], restval="")
    writer.writeheader()
    writer.writerows(rows.values())
    # Atomic (nsa_contract.atomic: a temporary file, then a rename): a reader never sees half a table, and an
    # existing file, or a hard link to one, is replaced rather than written through.
    atomic.write_text(path, text.getvalue())
    return len(rows)
