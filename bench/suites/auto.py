"""`auto` against every explicit plan for the same NSA call: the test of the dispatch design.

A cell is one NSA attention call (projections excluded): a prefill (`nsa_prefill`, `attend` over
T tokens) or one decode step (`nsa_decode`, `decode_attend` at t = S - 1 over a filled cache, B
sequences, replayed as a CUDA graph). Its variants are plans, each `NSAAttention(backend=...)`
on the same inputs:

    auto            the committed config's choice (what a user gets)
    sdpa            masked SDPA for every branch (torch scores and top-n)
    triton          the own Triton kernels for every branch
    triton-fa2win   Triton compressed + selection, sliding on FA-2
    triton-flexwin  Triton compressed + selection, sliding on FlexAttention
    flex            FlexAttention for every branch (torch scores and top-n)

`ci decide` turns the cases into the report's "auto vs best" table (ci/autobest.py): every cell
where `auto` is more than 10% slower than the fastest plan is listed first. A plan that cannot run
the call (FA-2 with dk != dv, Flex above head dim 128, out of memory) is recorded as skipped with
the reason. Plans whose selection scores run in torch are timed up to `TORCH_SCORED_MAX_T`: above
it one call takes seconds (O(T * Tc) scores on the host's launch loop), and the Triton-scored
plans were 10x and more faster at that length in every run; they are recorded as skipped there,
with that reason, rather than not at all. Each case carries the plan's per-branch backends and,
for `auto`, the plan it chose; peak GPU memory comes from the runner.
"""

from __future__ import annotations

from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product

NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, **NSA}      # class g16
G1 = {"B": 1, "Hq": 16, "Hkv": 16, "Dk": 128, "Dv": 128, **NSA}
G2 = {"B": 1, "Hq": 16, "Hkv": 8, "Dk": 128, "Dv": 128, **NSA}
G4 = {"B": 1, "Hq": 32, "Hkv": 8, "Dk": 128, "Dv": 128, **NSA}
G8 = {"B": 1, "Hq": 32, "Hkv": 4, "Dk": 128, "Dv": 128, **NSA}
SMALL = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 32, "Dv": 32, "block": 16, "stride": 8, "sel_block": 16,
         "sel_count": 4, "window": 32}
PLANS: dict[str, str | dict[str, str]] = {
    "auto": "auto",
    "sdpa": "sdpa",
    "triton": "triton",
    "triton-fa2win": {"cmp": "triton", "sel": "triton", "win": "fa2"},
    "triton-flexwin": {"cmp": "triton", "sel": "triton", "win": "flex"},
    "flex": "flex",
}
TORCH_SCORED = ("sdpa", "flex")
# 8192: at 16k one call of these plans took 0.2-0.7 s on the H100 (30-70x the Triton-scored plans),
# and timing it cost 10-27 s per cell without ever changing which plan was best.
TORCH_SCORED_MAX_T = 8192
# The all-Flex plan compiles one kernel per shape (seconds) and ran out of memory at 16k on the
# H100 (its selected mask table); from 8k up it is recorded as skipped with that reason.
FLEX_MAX_T = 4096
AUTO_BACKEND = "autoplan"  # results never say `auto`: the case's branch_backends say what it ran


def _variant(plan: str) -> Variant:
    return Variant(plan, "candidate", (("plan", plan),))


VARIANTS = tuple(_variant(name) for name in PLANS)
DECODE_VARIANTS = tuple(_variant(name) for name in ("auto", "sdpa", "triton", "triton-fa2win"))
BF16 = ("bf16",)
PREFILL = {
    "smoke": product(layout=(SMALL,), T=(100,), dtype=("fp32",)),
    # Nightly: short (launch-bound), mid and long T per class; 4k and the rest are in `full`.
    "nightly": product(layout=(PAPER, G1, G4), T=(1024, 16384, 65536), dtype=BF16),
    "full": product(layout=(PAPER, G1, G4), T=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), dtype=BF16)
    + product(layout=(G2, G8), T=(1024, 16384, 131072), dtype=BF16),
}
DECODE = {
    "smoke": product(layout=({**SMALL, "B": 2},), T=(100,), dtype=("fp32",)),
    "nightly": product(layout=({**PAPER, "B": 8},), T=(65536,), dtype=BF16),
    "full": product(layout=tuple({**lay, "B": 8} for lay in (PAPER, G1, G4)), T=(8192, 16384, 32768, 65536),
                    dtype=BF16),
}
SPECS = (CaseSpec("nsa_prefill", VARIANTS, PREFILL), CaseSpec("nsa_decode", DECODE_VARIANTS, DECODE))


def config_of(p: dict[str, Any]):
    from nsa import NSAConfig

    # dim only sizes the projections, which these cells exclude; kept small.
    return NSAConfig(dim=64, n_heads=p["Hq"], n_kv_heads=p["Hkv"], head_dim_qk=p["Dk"], head_dim_v=p["Dv"],
                     cmp_block=p["block"], cmp_stride=p["stride"], sel_block=p["sel_block"],
                     sel_count=p["sel_count"], window=p["window"])


def _ran(choices: list[dict[str, Any]], plan: str) -> tuple[str, dict[str, str], dict[str, Any] | None]:
    """(case backend, per-branch backends, auto's plan) from the dispatch record of one call."""
    by_op = {c["op"]: c["backend"] for c in choices}
    branches = {b: by_op.get(op, "?") for b, op in (("cmp", "compressed"), ("sel", "selected"), ("win", "sliding"))}
    chosen = next((c for c in reversed(choices) if c["op"] == "nsa_plan"), None)
    return (AUTO_BACKEND if plan == "auto" else plan), branches, chosen


def build(cell: Cell, device) -> Workload:
    import torch

    from bench import parity
    from nsa import NSAAttention, dispatch

    p = cell.params
    dtype, gen = parity.dtype_of(p["dtype"]), parity.generator(device, 0)
    attn = NSAAttention(config_of(p)).to(device=device, dtype=dtype).requires_grad_(False)
    work = Workload(fns={}, backends={}, dtype=p["dtype"], cuda_graph=cell.op == "nsa_decode" and device.type == "cuda")
    if cell.op == "nsa_prefill":
        B, T, Hq, Hkv, Dk, Dv = (p[k] for k in ("B", "T", "Hq", "Hkv", "Dk", "Dv"))
        q = parity.randn((B, T, Hq, Dk), dtype, device, gen)
        kv = {n: (parity.randn((B, T, Hkv, Dk), dtype, device, gen), parity.randn((B, T, Hkv, Dv), dtype, device, gen))
              for n in ("cmp", "sel", "win")}
        gates = torch.sigmoid(parity.randn((B, T, Hq, 3), dtype, device, gen))

        def call(module=attn):
            return module.attend(q, kv, gates)
    else:
        from bench.suites.decode import capture_attend, fill_cache

        x = parity.randn((p["B"], p["T"], 64), dtype, device, gen)
        cache = fill_cache(attn, x[:, :-1])
        q, kv1, gates = attn.project(x[:, -1:], start=p["T"] - 1)
        for name, (kb, vb) in cache.raw.items():
            kb.append(kv1[name][0])
            vb.append(kv1[name][1])
        cache.length = p["T"]
        attn._extend_compressed(cache, p["T"] - 1)
        del x

        def call(module=attn):
            return module.decode_attend(q, gates, cache)
    outputs: dict[str, Any] = {}
    for v in cell.variants:
        key, plan = v.key, v.backend
        module = NSAAttention(attn.config, backend=PLANS[plan]).to(device=device, dtype=dtype)
        if plan in TORCH_SCORED and cell.op == "nsa_prefill" and p["T"] > TORCH_SCORED_MAX_T:
            work.backends[key] = AUTO_BACKEND if plan == "auto" else plan
            work.reasons[key] = (f"plan {plan} scores blocks in torch: not timed above T = {TORCH_SCORED_MAX_T} "
                                 "(seconds per call; the Triton-scored plans were >= 10x faster there)")
            continue
        if plan == "flex" and p["T"] > FLEX_MAX_T:
            work.backends[key] = plan
            work.reasons[key] = (f"plan flex is not timed above T = {FLEX_MAX_T}: one compile per shape, and its "
                                 "selected-branch mask ran out of memory at 16k on the H100")
            continue
        fn = (lambda module=module: call(module))  # noqa: E731
        with dispatch.recording() as choices:
            _try(work, key, plan, fn, device)
        if key in work.fns and cell.op == "nsa_decode" and work.cuda_graph:
            work.captures[key] = (lambda module=module: capture_attend(module, q, gates, cache, ("cmp", "sel", "win")))
        work.backends[key], branches, chosen = _ran(choices, plan)
        work.extra[key] = {"plan": plan, "branch_backends": branches}
        if chosen is not None and plan == "auto":
            work.extra[key]["auto_plan"] = chosen["backend"]
            work.extra[key]["auto_class"] = chosen["why"]
        if key in work.fns:
            out = fn().float()
            if plan == "auto":
                outputs["auto"] = out
            elif "auto" in outputs:
                # Plans compute the same function; scores rounded differently may pick another block at
                # a near tie, so the difference is recorded, not asserted (tests check each kernel).
                work.extra[key]["max_abs_diff_vs_auto"] = float((out - outputs["auto"]).abs().max())
            del out
    outputs.clear()
    return work


def _try(work: Workload, key: str, plan: str, fn, device) -> None:
    """Run once (compiles, allocates): a plan that cannot run the call (BackendError) or runs out of
    memory is skipped with the reason; any other error fails the case."""
    from bench.runner import is_oom, release, why
    from nsa.backends import BackendError

    try:
        fn()
    except BackendError as exc:
        work.reasons[key] = f"plan {plan} cannot run this call: {exc}"
        return
    except Exception as exc:  # noqa: BLE001 - one plan's failure must not hide the others
        if is_oom(exc):
            work.reasons[key] = f"out of memory on the first call: {why(exc)}"
            release(device.type)
        else:
            work.failures[key] = f"first call raised {why(exc)}"
        return
    work.fns[key] = fn
