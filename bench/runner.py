"""The one runner: cells in, case records out, one results document per process.

Per cell: the suite builds inputs and one fn per variant; variants that cannot run here are
`skipped` with the reason; with a reference, every runnable variant is parity-checked first and
a variant failing parity is `failed` and not timed; the rest are timed interleaved in one
`bench.timing.measure` call. Out of memory anywhere in a cell makes its remaining variants
`skipped` (the cache is emptied and the sweep goes on); any other exception makes them `failed`
with the exception as the reason.

CUDA graphs (the timer's `cuda_graph`, or a workload's `cuda_graph=True` for its cell): a variant
with a capture (`Workload.captures`, a stateful decode step) is timed as the replay it returns;
the others are captured by the clock. A variant that still needs a setup, or a capture that
raises, makes the whole cell run eagerly; every case of the cell records `cuda_graph` (and
`cuda_graph_error` when a capture raised).

Peak memory: after timing, each timed variant makes one more call of its own between a reset
and a read of the device's peak counter (`bench.timing.peak_memory`), recorded as
`peak_mem_bytes` (absent on a CPU, which has no counter). It counts everything allocated on the
device meanwhile, inputs included: compare variants of one cell.

Host enqueue time: `timing.host_ms` is the median over the timed repeats of the host's time to
enqueue one call (`bench.timing.measure(..., host=)`). Where it reaches the event time, the GPU
was waiting for the host: the case measures the host, not the kernels (`ci.regress` uses it).
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from bench.cases import Cell, Workload
from bench.timing import Clock, Timer, default_clock, measure, peak_memory
from nsa_contract import results

TIMERS = {
    "smoke": Timer(warmup_ms=5, rep_ms=20, min_rep=5),
    "nightly": Timer(warmup_ms=25, rep_ms=100, min_rep=10),
    "full": Timer(warmup_ms=50, rep_ms=300, min_rep=20),
}


@dataclass
class RunOptions:
    device: str                          # "cpu" or "cuda" (resolved, never "auto")
    timer: Timer
    progress: TextIO = field(default_factory=lambda: sys.stderr)
    prefix: str = ""                     # progress-line prefix, e.g. "[gpu 1] "
    clock: Clock | None = None           # injected by tests; default: the device's clock


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when a GPU is visible, else `cpu`; an explicit `cuda` without one raises."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device must be a visible CUDA GPU for --device cuda, but torch sees none; "
                           "use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "can't allocate memory" in text or isinstance(exc, MemoryError))


def why(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:500]


def file_build_error(work, variants, exc: BaseException) -> None:
    """A suite's build raised: every variant not yet filed is `skipped` (out of memory) or
    `failed` with the exception, and nothing is left to time."""
    for v in variants:
        if v.key not in work.reasons and v.key not in work.failures:
            if is_oom(exc):
                work.reasons[v.key] = f"out of memory while building the inputs: {why(exc)}"
            else:
                work.failures[v.key] = f"building the inputs raised {why(exc)}"
    work.fns.clear()
    work.setups.clear()


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _device_index() -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit():
        return int(visible)
    import torch

    return torch.cuda.current_device()


def run_cell(cell: Cell, opts: RunOptions, index: int = 0) -> list[dict[str, Any]]:
    """Every case record of one cell (see the module docstring for the statuses)."""
    import torch

    from bench import parity
    from bench.suites import load

    records: dict[str, dict[str, Any]] = {}
    for v in cell.variants:
        records[v.key] = {"id": cell.case_id(v), "suite": cell.suite, "op": cell.variant_op(v),
                          "backend": v.backend, "requested_backend": v.backend, "role": v.role,
                          "params": cell.variant_params(v), "status": "pending", "reason": None,
                          "parity": None, "timing": None, "cell_index": index}
        if opts.device == "cuda":
            records[v.key]["device_index"] = _device_index()

    def settle(keys: list[str], status: str, reason: str) -> None:
        for key in keys:
            if records[key]["status"] == "pending":
                records[key].update(status=status, reason=reason)

    def on_error(keys: list[str], exc: BaseException, what: str) -> None:
        if is_oom(exc):
            settle(keys, "skipped", f"out of memory {what}: {why(exc)}")
            release(opts.device)
        else:
            settle(keys, "failed", f"{what} raised {why(exc)}")

    work: Workload | None = None
    try:
        work = load(cell.suite).build(cell, torch.device(opts.device))
    except Exception as exc:  # noqa: BLE001 - one broken cell must not stop the sweep
        on_error(list(records), exc, "while building the inputs")
    if work is not None:
        _run_workload(cell, work, records, opts, parity, on_error, settle)
    del work
    release(opts.device)
    return list(records.values())


def _run_workload(cell: Cell, work: Workload, records: dict[str, dict[str, Any]], opts: RunOptions,
                  parity: Any, on_error: Callable, settle: Callable) -> None:
    for key, rec in records.items():
        rec["backend"] = work.backends.get(key, rec["backend"])
        rec["id"] = results.case_id(rec["suite"], rec["op"], rec["backend"], rec["params"])
        rec.update(work.extra.get(key, {}))
        if key in work.failures:
            settle([key], "failed", work.failures[key])
        elif key in work.reasons:
            settle([key], "skipped", work.reasons[key])
        elif key not in work.fns:
            settle([key], "skipped", "the suite built no function for this variant")
    pending = [k for k, r in records.items() if r["status"] == "pending"]
    if work.reference is not None and pending:
        try:
            ref, basis = work.reference(), work.tol_basis()
        except Exception as exc:  # noqa: BLE001
            on_error(pending, exc, "while computing the parity reference")
            return
        for key in pending:
            try:
                check = parity.check(work.fns[key](), ref, basis, work.dtype or "fp32")
            except Exception as exc:  # noqa: BLE001
                on_error([key], exc, "during the parity run")
                continue
            records[key]["parity"] = check
            if not check["passed"]:
                detail = check.get("detail") or f"max_abs_err {check['max_abs_err']:.3g} > tol {check['tol']:.3g}"
                settle([key], "failed", f"parity failed: {detail}")
        del ref, basis
    pending = [k for k, r in records.items() if r["status"] == "pending"]
    if not pending:
        return
    fns = {k: work.fns[k] for k in pending}
    setups = {k: work.setups[k] for k in pending if k in work.setups}
    timer, replayed = opts.timer, set()
    if timer.cuda_graph or work.cuda_graph:
        timer = replace(timer, cuda_graph=True)
        replayed = _capture(work, pending, fns, setups, records, opts.device)
        if setups:
            # A graph replays a frozen call; a step that restores state first cannot be replayed,
            # so the whole cell runs eagerly (its variants stay comparable).
            timer = replace(timer, cuda_graph=False)
        for key in pending:
            records[key]["cuda_graph"] = timer.cuda_graph
    host: dict[str, list[float]] = {}
    try:
        samples = measure(fns, timer, clock=opts.clock, device=opts.device, setup=setups, replayed=replayed,
                          host=host)
    except Exception as exc:  # noqa: BLE001
        on_error(pending, exc, "while timing")
        return
    try:
        # Its own calls, not the timed ones: those are interleaved, so one counter would mix variants.
        peaks = peak_memory(fns, clock=opts.clock if opts.clock is not None else default_clock(opts.device),
                            setup=setups)
    except Exception as exc:  # noqa: BLE001
        on_error(pending, exc, "while measuring peak memory")
        return
    for key in pending:
        timing = results.timing_summary(samples[key])
        timing["host_ms"] = statistics.median(host[key])
        records[key].update(status="ok", timing=timing)
        if peaks[key] is not None:
            records[key]["peak_mem_bytes"] = peaks[key]


def _capture(work: Workload, pending: list[str], fns: dict[str, Callable], setups: dict[str, Callable],
             records: dict[str, dict[str, Any]], device: str) -> set[str]:
    """Swap every variant that has a capture for its graph replay (in `fns`, dropping its setup);
    the names swapped. One capture that raises puts every variant back (the cell is timed eagerly,
    its records say why in `cuda_graph_error`)."""
    replays: dict[str, Callable] = {}
    for key in pending:
        if key not in work.captures:
            continue
        try:
            replays[key] = work.captures[key]()
        except Exception as exc:  # noqa: BLE001 - the cell is still timed, eagerly
            replays.clear()
            if is_oom(exc):
                release(device)
            for rec in (records[k] for k in pending):
                rec["cuda_graph_error"] = f"capturing {key} raised {why(exc)}; the cell was timed eagerly"
            return set()
    for key, replay in replays.items():
        fns[key] = replay
        setups.pop(key, None)
    return set(replays)


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def describe_cell(cell: Cell, recs: list[dict[str, Any]]) -> str:
    base = next((r for r in recs if r["role"] == "baseline" and r["status"] == "ok"), None)
    parts = []
    for r in recs:
        name = r["backend"] + "".join(f":{k}={v}" for k, v in r["params"].items() if k in ("replica", "branches", "part"))
        if r["status"] != "ok":
            parts.append(f"{name} {r['status'].upper()} ({r['reason'][:80]})")
            continue
        med = r["timing"]["median_ms"]
        ratio = f" {base['timing']['median_ms'] / med:.2f}x" if base is not None and r is not base and med > 0 else ""
        parts.append(f"{name} {med:.4g} ms{ratio}")
    return " | ".join(parts)


def run_cells(cells: list[tuple[int, Cell]], opts: RunOptions) -> list[dict[str, Any]]:
    """Run `(global index, cell)` pairs in order, printing one progress line per cell."""
    out: list[dict[str, Any]] = []
    start = time.monotonic()
    for done, (index, cell) in enumerate(cells, 1):
        t0 = time.monotonic()
        recs = run_cell(cell, opts, index)
        out.extend(recs)
        now = time.monotonic()
        eta = (now - start) / done * (len(cells) - done)
        print(f"{opts.prefix}[{done}/{len(cells)} {_fmt_s(now - start)} eta {_fmt_s(eta)}] "
              f"{cell.label} ({now - t0:.1f}s): {describe_cell(cell, recs)}",
              file=opts.progress, flush=True)
    return out


def _dispatch_record(device: str) -> dict[str, Any] | None:
    try:
        import torch

        from nsa import dispatch
    except ImportError:
        return None
    describe = getattr(dispatch, "describe", None)
    if describe is None:
        return None
    try:
        return describe(torch.device(device))
    except Exception as exc:  # noqa: BLE001 - a bad override is reported, not fatal to the record
        return {"error": why(exc)}


def document(cases: list[dict[str, Any]], opts: RunOptions, *, command: str, git_sha: str,
             machine: dict[str, Any], extra_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results document (schema v1) of one process's run."""
    now = dt.datetime.now(dt.timezone.utc)
    clock = opts.clock if opts.clock is not None else default_clock(opts.device, opts.timer.cuda_graph)
    run = {"id": f"{now:%Y%m%dT%H%M%SZ}-{git_sha[:8]}-{uuid.uuid4().hex[:6]}",
           "created_at": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
           "git_sha": git_sha, "command": command, "method": opts.timer.method(clock)}
    dispatch = _dispatch_record(opts.device)
    if dispatch is not None:
        run["dispatch"] = dispatch
    run.update(extra_run or {})
    return {"schema_version": results.SCHEMA_VERSION, "run": run, "machine": machine, "cases": cases}
