"""Decode: per-step latency of NSAAttention and its measured reads against the spec's.

For each sequence length S, the module's cache holds the first S - 1 tokens and one step at
position t = S - 1 is timed (the cache is restored before every call, outside the timed
region, so every sample is the same step). Variants: all three branches, and each branch alone
(`branches`: the others are gated off and not computed). Reads come from the module's read
counters (`cache.reads`, what the kernels were given) and are compared with the exact counts of
shared/spec/nsa.md: cmp `n_cmp(t)`, sel `(k - 1) * l' + t % l' + 1` with `k = min(n, t // l' + 1)`
selected blocks, win `min(w, t + 1)`, per KV group; a mismatch fails the case. The paper's
budget `s/d + n*l' + w` (Table 4) is recorded beside them.

Every use of the decode API (new_cache / prefill / step / reads) is in this file.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product

BRANCHES = ("cmp", "sel", "win")
VARIANTS = (Variant("auto", "baseline", (("branches", "all"),)),) + tuple(
    Variant("auto", "candidate", (("branches", b),)) for b in BRANCHES)
NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
SMALL = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 256, **NSA}
GQA = {"B": 1, "Hq": 8, "Hkv": 2, "Dk": 64, "Dv": 64, "dim": 512, **NSA}
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 192, "Dv": 128, "dim": 2560, **NSA}

SPECS = (CaseSpec("nsa_decode", VARIANTS, {
    "smoke": product(layout=(SMALL,), T=(20, 200, 1000), dtype=("bf16",)),
    "nightly": (product(layout=(PAPER,), T=(1024, 8192, 16384, 32768, 65536), dtype=("bf16",))
                + product(layout=(GQA,), T=(1024, 8192, 65536), dtype=("bf16",))),
    "full": (product(layout=(PAPER, GQA), T=(128, 512, 1024, 4096, 8192, 16384, 32768, 65536),
                     dtype=("bf16",))
             + product(layout=({**PAPER, "B": 4},), T=(1024, 8192, 32768), dtype=("bf16",))),
}),)
CSV_COLUMNS = ("S", "ms_total", "ms_cmp", "ms_sel", "ms_win", "reads_actual", "reads_expected")
LAYOUT_COLUMNS = ("B", "Hq", "Hkv", "Dk", "Dv", "dtype")


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


def _module(p: dict[str, Any], device, dtype):
    from nsa import NSAAttention, NSAConfig

    config = NSAConfig(dim=p["dim"], n_heads=p["Hq"], n_kv_heads=p["Hkv"], head_dim_qk=p["Dk"],
                       head_dim_v=p["Dv"], cmp_block=p["block"], cmp_stride=p["stride"],
                       sel_block=p["sel_block"], sel_count=p["sel_count"], window=p["window"])
    # No parameter requires grad, so no step records an autograd graph.
    return NSAAttention(config).to(device=device, dtype=dtype).requires_grad_(False), config


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


def build(cell: Cell, device) -> Workload:
    import copy

    from bench import parity
    from nsa import decode_read_budget, dispatch

    p = cell.params
    S = p["T"]
    dtype = parity.dtype_of(p["dtype"])
    attn, config = _module(p, device, dtype)
    gen = parity.generator(device, 0)
    x = parity.randn((p["B"], S, p["dim"]), dtype, device, gen)
    # The cache of the first S - 1 tokens; no branch is needed to fill it (branches=()).
    _, snapshot = attn.prefill(x[:, :S - 1], branches=())
    x_t = x[:, S - 1:]
    expected = expected_reads(S, p)
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    for v in cell.variants:
        key = v.key
        which = dict(v.extra)["branches"]
        branches = BRANCHES if which == "all" else (which,)
        state: dict[str, Any] = {}

        def setup(state=state) -> None:
            state["cache"] = copy.deepcopy(snapshot)

        def step(state=state, branches=branches):
            return attn.step(x_t, state["cache"], branches)

        setup()
        with dispatch.recording() as choices:
            step()
        by_op = {c["op"]: c["backend"] for c in choices}
        # The step's selection is a gather + masked SDPA inside the module (not dispatched).
        ran = {b: by_op.get(op, "sdpa") for b, op in (("cmp", "compressed"), ("sel", "selected"),
                                                     ("win", "sliding")) if b in branches}
        names = set(ran.values())
        work.backends[key] = names.pop() if len(names) == 1 else "+".join(f"{b}:{n}" for b, n in ran.items())
        reads = _measured_reads(state["cache"].reads, branches)
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
            work.fns[key], work.setups[key] = step, setup
    return work


def write_csv(cases: Iterable[dict[str, Any]], path: str | Path) -> int:
    """The legacy decode CSV (`S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected`, then
    the layout) from decode case records; one row per layout and S. Returns the row count."""
    rows: dict[tuple, dict[str, Any]] = {}
    for case in cases:
        if case.get("suite") != "decode" or case.get("op") != "nsa_decode":
            continue
        p = case["params"]
        key = tuple(p.get(k) for k in ("T", *LAYOUT_COLUMNS, "dim", "block", "stride", "sel_block",
                                       "sel_count", "window"))
        row = rows.setdefault(key, {"S": p["T"], **{k: p.get(k) for k in LAYOUT_COLUMNS}})
        which = p.get("branches", "all")
        timing = case.get("timing")
        row["ms_total" if which == "all" else f"ms_{which}"] = \
            f"{timing['median_ms']:.6g}" if timing else ""
        if which == "all" and case.get("reads"):
            row["reads_actual"] = f"{case['reads']['total']:g}"
            row["reads_expected"] = case["reads_expected"]["total"]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*CSV_COLUMNS, *LAYOUT_COLUMNS], restval="")
        writer.writeheader()
        writer.writerows(rows.values())
    return len(rows)
