"""Prefill as serving engines and packed training batches give it: packed sequences and chunked prefill.

Both cells time the whole layer, `NSAAttention(config)` with `backend="auto"` (projections, the
attention and o_proj; inference: no parameter requires grad), op `nsa_prefill`, a `mode` param
telling the two sides of each comparison apart:

- packed (`N` sequences totalling `T` tokens, B = 1): `mode: separate` (baseline) runs `attn(x_i)`
  for each sequence in turn; `mode: packed` runs `attn(x, cu_seqlens=cu)` once on the packed row
  (`x [1, T, dim]`). The lengths are fixed, unequal and recorded in the case (`lengths`,
  `lengths(T, N)`). The issue's target: packed within 1.1x of
  separate at N = 8, T = 64k.
- chunked (`S = T` tokens in chunks of `C`): `mode: whole` (baseline) is one `attn.prefill(x)`;
  `mode: chunked` prefills `x[:, 0:C]`, then each next chunk with `prefill(chunk, cache=cache)`.
  Both build their cache from nothing on every call (no state carried between repeats). Target:
  chunked within 1.25x of whole at S = 64k, C = 8k.

Each case records `plans`: the distinct plans `auto` made (nsa.dispatch's record), one per
sequence or chunk; the case's `backend` names the backends that ran per branch. No parity gate:
the candidate's case records `max_abs_diff_vs_baseline` (its output against the baseline's, one
untimed call each), and the tests hold packed and chunked outputs to the one-at-a-time and
whole-prefill ones (tests/nsa/test_varlen.py, tests/nsa/test_chunked_prefill.py). Out of memory
is `skipped`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.auto import AUTO_BACKEND
from bench.suites.prefill import PAPER

BF16 = ("bf16",)
PACKED = (Variant("auto", "baseline", (("mode", "separate"),)), Variant("auto", "candidate", (("mode", "packed"),)))
CHUNKED = (Variant("auto", "baseline", (("mode", "whole"),)), Variant("auto", "candidate", (("mode", "chunked"),)))
MODEL = {**PAPER, "dim": 2560}
# Small enough for a CPU in seconds; the blocks and the window are still crossed by sequences and chunks.
TINY = {"B": 1, "Hq": 4, "Hkv": 2, "Dk": 32, "Dv": 32, "block": 16, "stride": 8, "sel_block": 16, "sel_count": 4,
        "window": 32, "kv": "separate", "dim": 64}

SPECS = (
    CaseSpec("nsa_prefill", PACKED, {
        "smoke": product(layout=(TINY,), T=(200,), N=(8,), dtype=BF16),
        "nightly": product(layout=(MODEL,), T=(16384,), N=(8,), dtype=BF16),
        "full": product(layout=(MODEL,), T=(16384, 65536), N=(8,), dtype=BF16),
    }),
    CaseSpec("nsa_prefill", CHUNKED, {
        "smoke": product(layout=(TINY,), T=(200,), C=(48,), dtype=BF16),
        "nightly": product(layout=(MODEL,), T=(16384,), C=(4096,), dtype=BF16),
        "full": product(layout=(MODEL,), T=(16384,), C=(4096,), dtype=BF16)
        + product(layout=(MODEL,), T=(65536,), C=(8192, 16384), dtype=BF16),
    }),
)


def lengths(total: int, n: int) -> list[int]:
    """`n` lengths of at least 1 summing to `total`: one token each, the rest shared by the weights
    `1 + (5 i mod n)` (unequal, in no order), the last taking what rounding leaves."""
    if n < 1 or total < n:
        raise ValueError(f"a pack needs 1 <= N <= T, got N={n}, T={total}; fix the serving grid")
    weights = [1 + (5 * i) % n for i in range(n)]
    out = [1 + (total - n) * w // sum(weights) for w in weights[:-1]]
    return [*out, total - sum(out)]


def _module(p: dict[str, Any], device, dtype):
    from nsa import NSAAttention, NSAConfig

    config = NSAConfig(dim=p["dim"], n_heads=p["Hq"], n_kv_heads=p["Hkv"], head_dim_qk=p["Dk"], head_dim_v=p["Dv"],
                       cmp_block=p["block"], cmp_stride=p["stride"], sel_block=p["sel_block"],
                       sel_count=p["sel_count"], window=p["window"], kv=p["kv"])
    return NSAAttention(config).to(device=device, dtype=dtype).requires_grad_(False)


def _label(choices: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The backends that ran per branch (`cmp:a+sel:b+win:c`, one name when all agree; `a|b` where
    sequences or chunks took different ones) and the distinct plans, in order."""
    ran = {b: sorted({c["backend"] for c in choices if c["op"] == op})
           for b, op in (("cmp", "compressed"), ("sel", "selected"), ("win", "sliding"))}
    names = {"|".join(v) for v in ran.values()}
    label = names.pop() if len(names) == 1 else "+".join(f"{b}:{'|'.join(v)}" for b, v in ran.items())
    plans = list(dict.fromkeys(c["backend"] for c in choices if c["op"] == "nsa_plan"))
    return label, plans


def build(cell: Cell, device) -> Workload:
    import torch

    from bench import parity
    from bench.suites.decode import _attempt
    from nsa import dispatch

    p = cell.params
    dtype = parity.dtype_of(p["dtype"])
    attn = _module(p, device, dtype)
    T = p["T"]
    x = parity.randn((p["B"], T, p["dim"]), dtype, device, parity.generator(device, 0))
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    fns: dict[str, Callable[[], Any]] = {}
    extra: dict[str, Any] = {}
    if "N" in p:
        sizes = lengths(T, p["N"])
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        parts = [x[:, s:e] for s, e in zip(bounds, bounds[1:], strict=False)]
        fns["separate"] = lambda: [attn(part) for part in parts]
        fns["packed"] = lambda: attn(x, cu_seqlens=cu)
        extra["lengths"] = sizes
    else:
        chunk = p["C"]

        def chunked() -> list[Any]:
            cache, ys = None, []
            for c0 in range(0, T, chunk):
                y, cache = attn.prefill(x[:, c0:c0 + chunk], cache=cache)
                ys.append(y)
            return ys

        fns["whole"] = lambda: attn.prefill(x)
        fns["chunked"] = chunked
    for v in cell.variants:
        key, mode = v.key, dict(v.extra)["mode"]
        with dispatch.recording() as choices:
            ran = _attempt(work, key, fns[mode], device, sdpa=False)
        # What ran (or began to run before a failure); results never say `auto`.
        work.backends[key], plans = _label(choices) if choices else (AUTO_BACKEND, [])
        work.extra[key] = {**extra, "plans": plans}
        if ran:
            work.fns[key] = fns[mode]
    _compare(work, cell, fns)
    return work


def _output(mode: str, out: Any) -> Any:
    """A variant's output as one `[1|B, T, dim]` tensor (separate and chunked return one per part)."""
    import torch

    if mode in ("separate", "chunked"):
        return torch.cat(out, 1)
    return out[0] if mode == "whole" else out


def _compare(work: Workload, cell: Cell, fns: dict[str, Callable[[], Any]]) -> None:
    """`max_abs_diff_vs_baseline` on the candidate's case: the same layer on the same tokens, so the
    two sides differ by rounding only (packed: the projections' matmuls; chunked: the kernels' shapes)."""
    base, cand = (v for v in cell.variants if v.role == "baseline"), (v for v in cell.variants if v.role == "candidate")
    for b, c in zip(base, cand, strict=True):
        if b.key in work.fns and c.key in work.fns:
            modes = dict(b.extra)["mode"], dict(c.extra)["mode"]
            diff = (_output(modes[1], fns[modes[1]]()).float() - _output(modes[0], fns[modes[0]]()).float()).abs()
            work.extra[c.key]["max_abs_diff_vs_baseline"] = float(diff.max())
