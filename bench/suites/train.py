"""A training step (forward + backward) of NSA attention against dense causal attention.

Every timed call is one training step of the attention alone (projections excluded): the forward,
then `torch.autograd.grad` of its output against a fixed random `grad_out` with respect to every
input. The inputs are leaf tensors with `requires_grad=True`; the gradients are returned and
dropped, so nothing accumulates between repeats and no `.grad` needs zeroing.

Cells (paper layout: 64 query / 4 KV heads, D 128, l=32 d=16 l'=64 n=16 w=512, separate K/V, bf16):
- `nsa_train` (`part: all`): `NSAAttention.attend` over q, the three K/V pairs and the gates.
  Candidates: `autoplan` (`NSAAttention(cfg)`, backend `auto`, what a user gets: the plan `auto` makes for a call that
  needs gradients, recorded in the case's `plan`), `triton` (every branch on the own Triton training kernels, requested explicitly: forward
  with saved log-sum-exp, deterministic backward; the selection scores and top-n run forward only,
  inside the step, as in training) and `sdpa` (masked SDPA on every branch, torch scores and top-n).
- `sliding` / `compressed` / `selected` (`part: win` / `cmp` / `sel`): the branch op alone. The
  compressed keys and values are computed once outside the step and are leaves themselves (the
  average pooling is not timed); the selected blocks too are chosen once outside it (under
  `torch.no_grad`, from the real scores: `ops.select_blocks` up to 16k, the Triton scores and
  top-n above, as in the fast suite).
  Candidates: `triton`, `sdpa`, and on the window torch's FA-2 (`torch_fa2`, skipped where it
  cannot run).
- Dense baselines in every cell (as the fast suite's cells have them, so each case has a dense case
  of its own shape; `part` keeps the ids apart): SDPA restricted to its flash backend
  (`sdpa_flash`, torch's FA-2, the baseline) and to cuDNN (`sdpa_cudnn`), causal, native GQA
  (`enable_gqa=True`), else, where a backend refuses it, K/V repeated to Hq heads outside the
  step, the repeated tensors being the leaves (the case's `gqa` says which); and flash-attn's
  FA-2 (`flash_attn`, `flash_attn_func`, native GQA), skipped with the reason where
  `import flash_attn` fails.
Skipped with the reason: `sdpa` above `MASKED_MAX_T` tokens (T x T masks, O(T^2) work), `triton`
on a CPU (`CPU_TRITON`), and anything out of memory. No parity: NSA is not dense attention; the
gradients are checked against the fp64 oracle in tests/nsa/test_train.py. Peak GPU memory of each
timed variant (one untimed step after a reset) comes from the runner as `peak_mem_bytes`.

Cost (H200 nightly, tests/data/h200/train/train-nightly.json.xz, flash-attn absent): a dense step at 64k
takes 0.45 s (cuDNN) and 0.75 s (flash), so the timed calls add up to about 100 s (the 16k cells
took 36 s of wall time in another run, compiles included); `full` adds two 64k layouts and 32k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.cases import CaseSpec, Cell, Variant, Workload, product
from bench.suites.fast import G1, G4, SMALL
from bench.suites.prefill import PAPER

BF16 = ("bf16",)
DENSE = (Variant("sdpa_flash", "baseline", op="dense"), Variant("sdpa_cudnn", op="dense"),
         Variant("flash_attn", op="dense"))
NSA_VARIANTS = (*DENSE, Variant("triton"), Variant("sdpa"))
# The whole attention also as a user gets it: `auto` plans the training call (its plan is kept in the case).
# Its backend is `autoplan` (results never say `auto`, bench.suites.auto.AUTO_BACKEND).
AUTOPLAN = "autoplan"
NSA_TRAIN_VARIANTS = (*DENSE, Variant(AUTOPLAN), Variant("triton"), Variant("sdpa"))
FULL_T = (8192, 16384, 32768, 65536)
SIZES = {
    "smoke": product(layout=(SMALL,), T=(300,), dtype=BF16),
    "nightly": product(layout=(PAPER,), T=(16384, 65536), dtype=BF16),
    "full": product(layout=(PAPER,), T=FULL_T, dtype=BF16)
    + product(layout=(G1, G4), T=(65536,), dtype=BF16),
}
PARTS = (("win", "sliding"), ("cmp", "compressed"), ("sel", "selected"))


# Every cell carries `part` (`all` for the whole attention): its dense cases get ids of their own per
# part, and none is taken for a forward-only prefill case (ci/trends.py charts the paper-layout
# `dense` cases that have no `part`).
def _with_part(grid: Sequence[dict[str, Any]], part: str) -> tuple[dict[str, Any], ...]:
    return tuple({**params, "part": part} for params in grid)


# The branch cells: the smoke layout, else the paper layout only (the whole-attention cells cover the others).
BRANCH_GRID = {**SIZES, "full": product(layout=(PAPER,), T=FULL_T, dtype=BF16)}
SPECS = (
    CaseSpec("nsa_train", NSA_TRAIN_VARIANTS, {size: _with_part(grid, "all") for size, grid in SIZES.items()}),
    CaseSpec("sliding", (*DENSE, Variant("triton"), Variant("torch_fa2"), Variant("sdpa")),
             {size: _with_part(grid, "win") for size, grid in BRANCH_GRID.items()}),
    CaseSpec("compressed", NSA_VARIANTS, {size: _with_part(grid, "cmp") for size, grid in BRANCH_GRID.items()}),
    CaseSpec("selected", NSA_VARIANTS, {size: _with_part(grid, "sel") for size, grid in BRANCH_GRID.items()}),
)
# Masked SDPA builds T x T (or T x Tc) masks and does O(T^2) work: a training step at 16k would take
# most of the sweep's time and tell nothing the dense baselines do not.
MASKED_MAX_T = 8192
# Under TRITON_INTERPRET=1 one training step of the smoke cell (T 300, Hq 8, D 32) took about 200 s.
CPU_TRITON = ("the own Triton training kernels run on a CPU only under Triton's interpreter, where one training "
              "step of the smoke cell takes minutes (~200 s measured) and bf16 tl.dot is computed wrongly; "
              "time them on a GPU")


def train_step(forward: Callable[[], Any], inputs: Sequence[Any], grad_out: Any) -> Callable[[], Any]:
    """One training step of `forward`: its output `o`, then the gradients of `sum(o * grad_out)`
    with respect to `inputs` (leaves with requires_grad), returned as a tuple; no `.grad` is written."""
    import torch

    def step():
        return torch.autograd.grad(forward(), tuple(inputs), grad_out)

    return step


def build(cell: Cell, device) -> Workload:
    import torch

    from bench import parity

    p = cell.params
    dtype, gen = parity.dtype_of(p["dtype"]), parity.generator(device, 0)
    B, T, Hq, Hkv, Dk, Dv = (p[k] for k in ("B", "T", "Hq", "Hkv", "Dk", "Dv"))

    def leaf(shape):
        return parity.randn(shape, dtype, device, gen).requires_grad_()

    q = leaf((B, T, Hq, Dk))
    kv = {n: (leaf((B, T, Hkv, Dk)), leaf((B, T, Hkv, Dv))) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(parity.randn((B, T, Hq, 3), dtype, device, gen)).requires_grad_()
    grad_out = parity.randn((B, T, Hq, Dv), dtype, device, gen)
    work = Workload(fns={}, backends={}, dtype=p["dtype"])
    branch = _branch_inputs(cell.op, q, kv, p) if cell.op != "nsa_train" else None
    for v in cell.variants:
        key = v.key
        if v.backend in ("sdpa_flash", "sdpa_cudnn"):
            _dense_variant(work, key, q, *kv["sel"], grad_out, device)
        elif v.backend == "flash_attn":
            _flash_attn_variant(work, key, q, *kv["sel"], grad_out, device)
        elif v.backend == "sdpa" and T > MASKED_MAX_T:
            work.backends[key] = "sdpa"
            work.reasons[key] = (f"masked SDPA is not timed above T = {MASKED_MAX_T}: its T x T masks make a "
                                 "training step O(T^2) in work and memory")
        elif v.backend == "triton" and device.type == "cpu":
            work.backends[key] = "triton"
            work.reasons[key] = CPU_TRITON
        elif branch is None:
            _nsa_variant(work, key, v.backend, q, kv, gates, grad_out, p, device)
        else:
            _branch_variant(work, key, v.backend, cell.op, branch, grad_out, p, device)
    return work


def _dense_variant(work: Workload, key: str, q, k, v, grad_out, device) -> None:
    """Dense causal SDPA on one backend, fwd + bwd: native GQA first; a backend that refuses it gets
    K/V repeated to Hq heads outside the step (those repeated tensors are the leaves, as in a dense
    model on that backend), and the case's `gqa` says so."""
    from torch.nn.attention import SDPBackend

    from bench.suites.prefill import _dense, _probe

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[key]
    work.backends[key] = key
    gqa = q.shape[2] != k.shape[2]
    work.extra[key] = {"gqa": "native (enable_gqa=True)" if gqa else "none (MHA)"}
    _probe(work, key, train_step(lambda: _dense(q, k, v, backend), (q, k, v), grad_out), device, unsupported_ok=True)
    first = work.reasons.get(key, "")
    if not gqa or not first.startswith("SDPA backend cannot run"):
        return
    del work.reasons[key]
    group = q.shape[2] // k.shape[2]
    k_rep, v_rep = (x.detach().repeat_interleave(group, dim=2).requires_grad_() for x in (k, v))
    _probe(work, key, train_step(lambda: _dense(q, k_rep, v_rep, backend), (q, k_rep, v_rep), grad_out), device,
           unsupported_ok=True)
    work.extra[key]["gqa"] = (f"K/V repeated to {q.shape[2]} heads outside the step (native GQA: {first})"
                              if key not in work.reasons else "unsupported, native or with K/V repeated")


def _flash_attn_variant(work: Workload, key: str, q, k, v, grad_out, device) -> None:
    """flash-attn's FA-2 (`flash_attn_func`, causal, native GQA, `[B, T, H, D]` as is), fwd + bwd."""
    from bench.suites.prefill import _probe

    work.backends[key] = "flash_attn"
    work.extra[key] = {"gqa": "native" if q.shape[2] != k.shape[2] else "none (MHA)"}
    try:
        from flash_attn import flash_attn_func
    except (ImportError, OSError) as exc:  # OSError: installed, but its CUDA extension cannot load
        work.reasons[key] = f"flash-attn cannot be imported (pip install flash-attn on a CUDA machine): {exc}"
        return
    if device.type != "cuda":
        work.reasons[key] = f"flash-attn runs on CUDA tensors only, got {device}"
        return
    step = train_step(lambda: flash_attn_func(q, k, v, causal=True), (q, k, v), grad_out)
    _probe(work, key, step, device, unsupported_ok=True, who="flash-attn")


def _nsa_variant(work: Workload, key: str, backend: str, q, kv, gates, grad_out, p: dict[str, Any], device) -> None:
    """The whole attention (`NSAAttention.attend`) with every branch on `backend`, fwd + bwd."""
    from bench.suites.auto import config_of
    from bench.suites.prefill import _probe
    from nsa import NSAAttention
    from nsa.backends import BackendError

    work.backends[key] = backend   # `autoplan`: the case's `plan` and `branch_backends` say what auto ran
    attn = NSAAttention(config_of(p), backend="auto" if backend == AUTOPLAN else backend)   # attend uses no parameter
    try:
        plan = attn.plan(q, kv)   # grad mode on and the inputs require grad: a training plan
    except BackendError as exc:
        work.reasons[key] = f"{backend} cannot run this training step: {exc}"
        return
    work.extra[key] = {"plan": plan.label, "branch_backends": {b: bp.backend for b, bp in plan.branches.items()}}
    inputs = (q, *(x for pair in kv.values() for x in pair), gates)
    _probe(work, key, train_step(lambda: attn.attend(q, kv, gates), inputs, grad_out), device, unsupported_ok=False)


def _branch_inputs(op: str, q, kv, p: dict[str, Any]) -> dict[str, Any]:
    """The branch op's inputs (`bench.suites.branch` names) and `leaves`, the tensors the step
    differentiates: the compressed K/V and the selected blocks are computed once, without autograd."""
    import torch

    from bench.suites.fast import _fast_idx
    from nsa import ops

    branch = dict(PARTS)[p["part"]]
    if branch != op:
        raise ValueError(f"part {p['part']!r} must go with op {branch!r}, got op {op!r}")
    if op == "sliding":
        x = {"q": q, "k": kv["win"][0], "v": kv["win"][1]}
        return {**x, "leaves": (x["q"], x["k"], x["v"])}
    with torch.no_grad():
        kc, vc = ops.compress_kv(*kv["cmp"], block=p["block"], stride=p["stride"])
        if op == "compressed":
            kc, vc = kc.requires_grad_(), vc.requires_grad_()
            return {"q": q, "k_cmp": kc, "v_cmp": vc, "leaves": (q, kc, vc)}
        idx = ops.select_blocks(q, kc, block=p["block"], stride=p["stride"], sel_block=p["sel_block"],
                                sel_count=p["sel_count"]) if p["T"] <= 16384 else _fast_idx(q, kv, p)
    return {"q": q, "k": kv["sel"][0], "v": kv["sel"][1], "indices": idx, "leaves": (q, *kv["sel"])}


def _branch_variant(work: Workload, key: str, backend: str, op: str, x: dict[str, Any], grad_out,
                    p: dict[str, Any], device) -> None:
    """One branch op on an explicit backend, fwd + bwd; skipped with the reason where that backend
    cannot run it with gradients."""
    import dataclasses

    from bench.suites.branch import _attn_call, _nsa_call
    from bench.suites.prefill import _probe
    from nsa import backends

    try:
        resolved = backends.resolve(backend, device)
        reason = backends.unsupported_reason(resolved, dataclasses.replace(_attn_call(op, x, p), grad=True))
    except Exception as exc:  # noqa: BLE001 - a backend module that fails to import is unavailable
        resolved, reason = backend, f"{type(exc).__name__}: {exc}"
    work.backends[key] = resolved
    if reason is not None:
        work.reasons[key] = f"{resolved} cannot run this training step: {reason}"
        return
    _probe(work, key, train_step(_nsa_call(op, x, p, resolved), x["leaves"], grad_out), device, unsupported_ok=False)
