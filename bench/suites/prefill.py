"""Whole NSA attention (projections excluded) against dense causal attention, prefill.

Dense baselines: SDPA restricted to the flash backend (`sdpa_flash`, torch's FA-2) and to the
cuDNN backend (`sdpa_cudnn`), causal, GQA; FlashAttention-3 (`fa3`, the optional `fa3-fwd` wheel:
bench/dense_fa3.py), `skipped` with the reason where it is not installed or cannot take the call
(bf16 only, CUDA, its head dims). NSA: the three branches through the public ops with
`backend="auto"` (nsa.dispatch picks per branch; the case's `backend` names what ran, e.g.
`sdpa` or `cmp:torch_fa2+sel:sdpa+win:torch_fa2`, and `branch_backends` lists it), gates =
sigmoid of random logits, gated sum. `kv="separate"` (the paper's three K/V pairs). No parity:
the ops differ (NSA is not dense attention); nsa's own tests check NSA against its fp64 oracle.
Out of memory at long T is recorded as `skipped` and the sweep goes on.
"""

from __future__ import annotations

from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.fa2 import SMOKE

VARIANTS = (Variant("sdpa_flash", "baseline", op="dense"), Variant("sdpa_cudnn", op="dense"),
            Variant("fa3", op="dense"), Variant("auto", "candidate"))
NSA = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512, "kv": "separate"}
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, **NSA}
MHA16 = {"B": 1, "Hq": 16, "Hkv": 16, "Dk": 128, "Dv": 128, **NSA}

SPECS = (CaseSpec("nsa_prefill", VARIANTS, {
    "smoke": product(layout=({**SMOKE, **NSA},), T=(200, 1000), dtype=("bf16",)),
    "nightly": product(layout=(PAPER,), T=(4096, 16384), dtype=("bf16",)),
    "full": product(layout=(PAPER, MHA16), T=(1024, 4096, 8192, 16384, 32768, 65536), dtype=("bf16",)),
}),)
BRANCH_OPS = (("cmp", "compressed"), ("sel", "selected"), ("win", "sliding"))


def _nsa_attention_only(q, kv: dict[str, tuple[Any, Any]], gates, p: dict[str, Any]):
    """`o = sum_c gates[..., c] * attn_c(q)` over (cmp, sel, win) with the public ops -> `[B, T, Hq, Dv]`.

    `kv[c] = (k, v)` raw `[B, T, Hkv, D]` per branch; `gates [B, T, Hq, 3]` in (0, 1).
    """
    from nsa import ops

    k_c, v_c = ops.compress_kv(*kv["cmp"], block=p["block"], stride=p["stride"])
    o = gates[..., 0:1] * ops.compressed_attention(q, k_c, v_c, block=p["block"], stride=p["stride"])
    # Selection scores are the compressed branch's own attention probabilities (paper Eq. 8-9).
    idx = ops.select_blocks(q, k_c, block=p["block"], stride=p["stride"], sel_block=p["sel_block"],
                            sel_count=p["sel_count"])
    o = o + gates[..., 1:2] * ops.selected_attention(q, *kv["sel"], idx, sel_block=p["sel_block"])
    return o + gates[..., 2:3] * ops.sliding_window_attention(q, *kv["win"], window=p["window"])


def _dense(q, k, v, backend: Any):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _dense_variant(work: Workload, key: str, q, k, v, backend: Any, device) -> None:
    """Native GQA first; a backend without it gets K/V repeated to Hq heads (built here, outside
    the timed call; the case says so in `gqa`), as a dense model on that backend would do."""
    work.backends[key] = key
    _probe(work, key, lambda: _dense(q, k, v, backend), device, unsupported_ok=True)
    work.extra[key] = {"gqa": "native" if q.shape[2] != k.shape[2] else "none (MHA)"}
    if key in work.reasons and q.shape[2] != k.shape[2]:
        first = work.reasons.pop(key)
        group = q.shape[2] // k.shape[2]
        k_rep, v_rep = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        _probe(work, key, lambda: _dense(q, k_rep, v_rep, backend), device, unsupported_ok=True)
        work.extra[key]["gqa"] = (f"K/V repeated to {q.shape[2]} heads (native GQA: {first})"
                                  if key not in work.reasons else "unsupported, native or with K/V repeated")


def _fa3_variant(work: Workload, key: str, q, k, v, device) -> None:
    """Dense causal FA-3 (native GQA, `[B, T, H, D]` as is), or `skipped` with the reason it cannot run."""
    from bench import dense_fa3

    work.backends[key] = dense_fa3.NAME
    work.extra[key] = {"gqa": "native" if q.shape[2] != k.shape[2] else "none (MHA)"}
    why_not = dense_fa3.reason(q, k, v)
    if why_not is not None:
        work.reasons[key] = why_not
        return
    fa3 = dense_fa3.load()
    _probe(work, key, lambda: dense_fa3.prefill(fa3, q, k, v), device, unsupported_ok=True, who="FA-3")


def _label(choices: list[dict[str, Any]]) -> tuple[str, dict[str, str]]:
    by_op = {c["op"]: c["backend"] for c in choices}
    # Selection in a prefill goes through selected_attention's dispatch too; an op missing from
    # the record ran an explicit backend, which nsa only does with sdpa.
    branches = {name: by_op.get(op, "sdpa") for name, op in BRANCH_OPS}
    names = set(branches.values())
    label = names.pop() if len(names) == 1 else "+".join(f"{b}:{n}" for b, n in branches.items())
    return label, branches


def build(cell: Cell, device) -> Workload:
    import torch
    from torch.nn.attention import SDPBackend

    from bench import parity
    from nsa import dispatch

    p = cell.params
    dtype, gen = parity.dtype_of(p["dtype"]), parity.generator(device, 0)
    B, T, Hq, Hkv, Dk, Dv = (p[k] for k in ("B", "T", "Hq", "Hkv", "Dk", "Dv"))
    q = parity.randn((B, T, Hq, Dk), dtype, device, gen)
    names = ("cmp", "sel", "win") if p["kv"] == "separate" else ("cmp",)
    kv = {n: (parity.randn((B, T, Hkv, Dk), dtype, device, gen), parity.randn((B, T, Hkv, Dv), dtype, device, gen))
          for n in names}
    kv = {b: kv[b if b in kv else "cmp"] for b in ("cmp", "sel", "win")}
    gates = torch.sigmoid(parity.randn((B, T, Hq, 3), dtype, device, gen))
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    dense = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for v in cell.variants:
        key = v.key
        if v.backend in dense:
            _dense_variant(work, key, q, *kv["win"], dense[v.backend], device)
        elif v.backend == "fa3":
            _fa3_variant(work, key, q, *kv["win"], device)
        else:
            fn = lambda: _nsa_attention_only(q, kv, gates, p)  # noqa: E731
            with dispatch.recording() as choices:
                _probe(work, key, fn, device, unsupported_ok=False)
            work.backends[key], branches = _label(choices)
            work.extra[key] = {"branch_backends": branches}
    return work


def _probe(work: Workload, key: str, fn, device, *, unsupported_ok: bool, who: str = "SDPA backend") -> None:
    """Run once (compiles, allocates); file `fn` under fns, reasons (skipped) or failures. With
    `unsupported_ok`, a RuntimeError means the dense kernel (`who`) cannot take this call here."""
    from bench.runner import is_oom, release, why

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
        if is_oom(exc):
            work.reasons[key] = f"out of memory on the first call: {why(exc)}"
            release(device.type)
        elif unsupported_ok and isinstance(exc, RuntimeError):
            # SDPA restricted to one backend raises when that backend cannot take the call
            # ("No available kernel", cuDNN absent or shape unsupported), FA-3 off Hopper: not this
            # variant's fault.
            work.reasons[key] = f"{who} cannot run this call: {why(exc)}"
        else:
            work.failures[key] = f"first call raised {why(exc)}"
        return
    work.fns[key] = fn
