"""Training: no output is ever cut from autograd, and every branch's backward matches fp64 autograd.

The gradient gate follows FlashAttention's rule: a kernel's error against fp64 autograd
(nsa.reference.attention_ad over the spec's visibility tables) may be at most twice the error of
the same-dtype torch autograd path, plus a floor of a few units of rounding of the result's scale
(fp32 paths both sit at rounding level, where twice the smaller one is noise). Indices stay fixed:
the top-n selection carries no gradient. CPU runs the Triton kernels under the interpreter at
small, awkward shapes; the `gpu` tests repeat the gate in bf16/fp16 at larger ones.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nsa import NSAAttention, NSAConfig, backends, ops
from nsa import reference as ref
from nsa.backends import AttnCall, BackendError, triton_nsa
from tests.nsa.helpers import DEV

HAS_TRITON = triton_nsa.unavailable_reason(DEV) is None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"triton backend cannot run here: "
                                  f"{triton_nsa.unavailable_reason(DEV)}")


def _leaf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.detach().to(dtype).clone().requires_grad_()


def _grads(fn, ins: list[torch.Tensor], do: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn(*ins)
    gs = torch.autograd.grad(out, ins, do.to(out.dtype))
    return out.detach(), [g.detach() for g in gs]


def _gate(name: str, kernel, torch_path, oracle, ins: list[torch.Tensor], dtype: torch.dtype) -> None:
    """FlashAttention's rule on the output and every input gradient."""
    do = torch.randn(*ins[0].shape[:3], ins[2].shape[-1], device=ins[0].device)
    o64, g64 = _grads(oracle, [_leaf(x, torch.float64) for x in ins], do.double())
    o_t, g_t = _grads(torch_path, [_leaf(x, dtype) for x in ins], do)
    o_k, g_k = _grads(kernel, [_leaf(x, dtype) for x in ins], do)
    for what, k_, t_, r_ in (("out", o_k, o_t, o64), *((f"d{n}", a, b, c) for n, a, b, c in
                                                          zip("qkv", g_k, g_t, g64, strict=True))):
        assert torch.isfinite(k_).all(), f"{name} {what}: non-finite values"
        err_k = (k_.double() - r_).abs().max().item()
        err_t = (t_.double() - r_).abs().max().item()
        floor = (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * max(r_.abs().max().item(), 1e-3)
        assert err_k <= 2 * err_t + floor, f"{name} {what}: kernel err {err_k:.3g} > 2 x torch err {err_t:.3g} + {floor:.3g}"


def _inputs(b, t, hq, hkv, dk, dv, tk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    tk = t if tk is None else tk
    return (torch.randn(b, t, hq, dk, generator=g).to(DEV), torch.randn(b, tk, hkv, dk, generator=g).to(DEV),
            torch.randn(b, tk, hkv, dv, generator=g).to(DEV))


# (B, T, Hq, Hkv, dk, dv): awkward T (not a multiple of any block), G 1..16, dk != dv and head dims that
# are not powers of two (the kernels mask the padded columns, as for the paper's 192)
SHAPES = [(1, 37, 4, 2, 32, 16), (2, 21, 2, 2, 16, 32), (1, 29, 4, 1, 32, 32), (1, 19, 16, 1, 24, 40)]
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
def test_window_backward_matches_fp64(shape):
    b, t, hq, hkv, dk, dv = shape
    w = 8   # T > w and, at the first queries, T < w
    vis = ref.window_visible(t, t, w)

    def kernel(q, k, v):
        return ops.sliding_window_attention(q, k, v, window=w, backend="triton")

    def dense(q, k, v):
        return ref.attention_ad(q, k, v, vis)

    for dtype in DTYPES:
        _gate(f"win {shape} {dtype}", kernel, dense, dense, list(_inputs(*shape)), dtype)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
def test_compressed_backward_matches_fp64_through_phi(shape):
    """dq, and dk/dv of the raw keys through `phi` (avg): the compressed tokens' gradient spreads
    over the raw tokens they summarise. Queries before the first complete block see nothing."""
    b, t, hq, hkv, dk, dv = shape
    blk, d = 8, 4
    tc = (t - blk) // d + 1
    vis = ref.compressed_visible(t, tc, blk, d)

    def kernel(q, k, v):
        kc, vc = ops.compress_kv(k, v, block=blk, stride=d)
        return ops.compressed_attention(q, kc, vc, block=blk, stride=d, backend="triton")

    def dense(q, k, v):
        kc, vc = ops.compress_kv(k, v, block=blk, stride=d)
        return ref.attention_ad(q, kc, vc, vis)

    for dtype in DTYPES:
        _gate(f"cmp {shape} {dtype}", kernel, dense, dense, list(_inputs(*shape)), dtype)


@needs_triton
def test_compressed_backward_with_no_complete_block_is_zero():
    """T < l: no compressed token at all; output and every gradient exactly 0, never NaN."""
    q, k, v = (x.requires_grad_() for x in _inputs(1, 5, 2, 1, 16, 16))
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    out = ops.compressed_attention(q, kc, vc, block=8, stride=4, backend="triton")
    assert out.requires_grad
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(q.grad, torch.zeros_like(q))
    for x in (k.grad, v.grad):   # no compressed token reads the raw keys: no gradient reaches them
        assert x is None or torch.equal(x, torch.zeros_like(x))


def _indices(q, k, sel_block, n, seed=1):
    """Random block rows: distinct candidates `<= t // l'`, a repeated block and `-1` slots mixed in."""
    g = torch.Generator().manual_seed(seed)
    b, t, hkv = q.shape[0], q.shape[1], k.shape[2]
    idx = torch.full((b, t, hkv, n), -1, dtype=torch.long)
    for bi in range(b):
        for i in range(t):
            for h in range(hkv):
                cand = torch.randperm(i // sel_block + 1, generator=g)[:n]
                idx[bi, i, h, :len(cand)] = cand
    idx[0, -1, 0, -1] = idx[0, -1, 0, 0]          # a repeated block counts once
    idx[0, t // 2, 0, 1:] = -1                    # -1 padding
    return idx.to(q.device)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
def test_selected_backward_matches_fp64(shape):
    """dq, and dk/dv summed over every (query, group) that chose a block (block-centric, no atomics)."""
    sb, n = 16, 3
    q, k, v = _inputs(*shape)
    idx = _indices(q, k, sb, n)
    vis = ref.selected_visible(idx.cpu(), k.shape[1], sb)

    def kernel(q, k, v):
        return ops.selected_attention(q, k, v, idx, sel_block=sb, backend="triton")

    def dense(q, k, v):
        return ref.attention_ad(q, k, v, vis)

    for dtype in DTYPES:
        _gate(f"sel {shape} {dtype}", kernel, dense, dense, [q, k, v], dtype)


@needs_triton
def test_selected_backward_is_deterministic_and_padded_rows_are_zero():
    sb = 16
    q, k, v = _inputs(1, 40, 4, 2, 16, 16)
    idx = _indices(q, k, sb, 2)
    idx[0, 3] = -1                                  # a row with no block at all
    runs = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = ops.selected_attention(qq, kk, vv, idx, sel_block=sb, backend="triton")
        out.square().sum().backward()
        runs.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()
    assert torch.equal(runs[0][0][0, 3], torch.zeros_like(runs[0][0][0, 3]))
    assert torch.equal(runs[0][1][0, 3], torch.zeros_like(runs[0][1][0, 3]))


# --- no silent gradient loss ---------------------------------------------------------------------
def _op_call(op: str, grad: bool):
    q, k, v = (x.requires_grad_(grad) for x in _inputs(1, 33, 4, 2, 16, 16))
    if op == "sliding":
        return lambda be: ops.sliding_window_attention(q, k, v, window=8, backend=be), (q, k, v)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    if op == "compressed":
        return lambda be: ops.compressed_attention(q, kc, vc, block=8, stride=4, backend=be), (q, k, v)
    idx = _indices(q, k, 16, 2)
    return lambda be: ops.selected_attention(q, k, v, idx, sel_block=16, backend=be), (q, k, v)


@pytest.mark.parametrize("name", backends.names())
@pytest.mark.parametrize("op", backends.OPS)
def test_every_backend_keeps_gradients_or_refuses(name, op):
    """Per backend and op: a call that needs gradients either gets them (every input's gradient
    finite and not all zero) or raises BackendError naming the missing backward; never an output
    cut from autograd."""
    caps = backends.capabilities(name)
    why = backends.unavailable_reason(name, DEV)
    if why is not None:
        pytest.skip(f"{name} cannot run here: {why}")
    if op not in caps.forward:
        pytest.skip(f"{name} has no {op} op")
    run, ins = _op_call(op, True)
    if op not in caps.backward:
        with pytest.raises(BackendError, match="no backward"):
            run(name)
        return
    try:
        out = run(name)
    except BackendError as exc:   # this call's shape or dtype: refused loudly, as it must be
        assert "cannot run" in str(exc)
        return
    assert out.requires_grad
    out.square().sum().backward()
    for x in ins:
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_wrong_declaration_is_caught(monkeypatch):
    """A backend that declares a backward but returns a detached output raises, not a silent cut."""
    fake = types.ModuleType("nsa_fake_backend")
    fake.CAPABILITIES = backends.caps(backward=backends.OPS)
    fake.unavailable_reason = lambda device=None: None
    fake.unsupported_reason = lambda call: None
    fake.sliding = lambda call: backends.module("sdpa").sliding(call).detach()
    monkeypatch.setitem(sys.modules, "nsa_fake_backend", fake)
    monkeypatch.setitem(backends._TABLE, "fake", "nsa_fake_backend")
    run, _ = _op_call("sliding", True)
    with pytest.raises(BackendError, match="cut from autograd"):
        run("fake")
    run, _ = _op_call("sliding", False)
    assert not run("fake").requires_grad      # without gradients the same backend is fine


def test_explicit_backend_without_backward_raises_with_the_fix(monkeypatch):
    fake = types.ModuleType("nsa_fwd_only")
    fake.CAPABILITIES = backends.caps()       # forward only
    fake.unavailable_reason = lambda device=None: None
    fake.unsupported_reason = lambda call: None
    for op in backends.OPS:
        setattr(fake, op, getattr(backends.module("sdpa"), op))
    monkeypatch.setitem(sys.modules, "nsa_fwd_only", fake)
    monkeypatch.setitem(backends._TABLE, "fwdonly", "nsa_fwd_only")
    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=3, window=8)
    m = NSAAttention(cfg, backend={"sel": "fwdonly"})
    x = torch.randn(1, 24, 32)
    with pytest.raises(BackendError, match=r"selected branch \(sel\).*no backward.*torch.no_grad"):
        m(x)
    with torch.no_grad():
        m(x)                                   # inference may use it
    # auto never plans it for a training call
    call = AttnCall("selected", torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), 1.0,
                    sel_block=16, grad=True)
    assert "no backward" in backends.unsupported_reason("fwdonly", call)


def _module_grads(cfg, backend, x, dtype, seed=0):
    torch.manual_seed(seed)
    m = NSAAttention(cfg, backend=backend).to(DEV, dtype)
    xx = x.detach().to(DEV, dtype).requires_grad_()
    y = m(xx)
    y.square().mean().backward()
    return y.detach(), xx.grad, {n: p.grad for n, p in m.named_parameters()}


@needs_triton
@pytest.mark.parametrize("phi", ["avg", pytest.param("mlp", marks=pytest.mark.slow)])   # mlp: ~20 s; phi's
def test_module_trains_on_triton_like_sdpa(phi):                                      # gradient: the cmp gate
    """The issue's repro: every parameter and the input get a gradient on the Triton plan, equal to
    the masked-SDPA plan's (fp32, to rounding; both plans select the same blocks on these inputs)."""
    cfg = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim_qk=32, head_dim_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=3, window=8, phi=phi)
    x = torch.randn(1, 45, 64)
    y_t, dx_t, g_t = _module_grads(cfg, "triton", x, torch.float32)
    y_s, dx_s, g_s = _module_grads(cfg, "sdpa", x, torch.float32)
    assert dx_t is not None and all(g is not None for g in g_t.values()), [n for n, g in g_t.items() if g is None]
    assert torch.allclose(y_t, y_s, rtol=1e-4, atol=1e-5)
    assert torch.allclose(dx_t, dx_s, rtol=1e-3, atol=1e-6)
    for name in g_s:
        assert torch.allclose(g_t[name], g_s[name], rtol=1e-3, atol=1e-6), name


# --- torch.compile -------------------------------------------------------------------------------
def _compiled_step_matches_eager(m: NSAAttention, lengths, compile_backend: str, dtype=torch.float32, tol=0.0):
    """`torch.compile(m, fullgraph=True)` (a graph break raises) over training steps at each length
    (dynamic shapes left to dynamo: a second length recompiles, and the plan is made again), the
    gradients of the input and every parameter against eager's."""
    compiled = torch.compile(m, fullgraph=True, backend=compile_backend)
    params = list(m.parameters())
    for t in lengths:
        x = torch.randn(1, t, m.config.dim, device=DEV, dtype=dtype, requires_grad=True)
        ref_g = torch.autograd.grad(m(x).float().square().mean(), [x, *params])
        got = torch.autograd.grad(compiled(x).float().square().mean(), [x, *params])
        for a, b in zip(ref_g, got, strict=True):
            assert torch.allclose(a, b, rtol=tol, atol=tol), (t, (a - b).abs().max().item())


@needs_triton
@pytest.mark.parametrize(("backend", "lengths"), [
    pytest.param("triton", (45,), marks=pytest.mark.slow),   # ~30-55 s under the interpreter
    ("auto", (70, 91))])
def test_module_training_step_compiles_without_graph_breaks(backend, lengths):
    """NSAAttention in a training step under torch.compile(fullgraph=True): the plan is made outside
    the graph (dispatch.plan, a constant of it), the Triton training kernels and the top-n are custom
    ops with fake implementations, so nothing in the attention breaks the graph. aot_eager: dynamo and
    AOTAutograd trace forward and backward, the ops run as in eager, so the gradients are equal bit for
    bit (on CPU, `auto` is masked SDPA; a second length there checks the recompile, which the
    interpreter makes too slow for the Triton plan). The GPU test below compiles with inductor."""
    torch.manual_seed(0)
    cfg = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=16, cmp_stride=8,
                    sel_block=16, sel_count=3, window=32)
    torch._dynamo.reset()
    _compiled_step_matches_eager(NSAAttention(cfg, backend=backend).to(DEV), lengths, "aot_eager")


# --- GPU: the toy model, torch.compile and CUDA graphs ---------------------------------------------
def _toy(cfg, backend):
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, cfg.dim)
            self.layers = torch.nn.ModuleList(NSAAttention(cfg, backend=backend) for _ in range(2))
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(cfg.dim) for _ in range(2))
            self.head = torch.nn.Linear(cfg.dim, 64)

        def forward(self, tok):
            h = self.emb(tok)
            for attn, norm in zip(self.layers, self.norms, strict=True):
                h = h + attn(norm(h))
            return self.head(h)
    return Toy()


@pytest.mark.gpu
def test_toy_model_trains_alike_on_sdpa_and_triton():
    """Two NSA layers, synthetic data (copy a token from 100 back: it needs attention beyond the
    window), 200 AdamW steps from the same weights with the masked-SDPA plan and the Triton plan,
    bf16 autocast: the curves agree within bf16 noise and both learn."""
    cfg = NSAConfig(dim=128, n_heads=8, n_kv_heads=2, head_dim_qk=32, head_dim_v=32, cmp_block=16, cmp_stride=8,
                    sel_block=32, sel_count=4, window=64)
    curves = {}
    for backend in ("sdpa", "triton"):
        torch.manual_seed(0)
        model = _toy(cfg, backend).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(200):
            tok = torch.randint(0, 64, (4, 384), device="cuda", generator=gen)
            target = torch.roll(tok, 100, dims=1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tok)
            loss = torch.nn.functional.cross_entropy(logits[:, 100:].float().reshape(-1, 64), target[:, 100:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[backend] = torch.tensor(losses)
    a, b = curves["sdpa"], curves["triton"]
    print("toy losses sdpa", a[::20].tolist(), "triton", b[::20].tolist())
    assert b[-20:].mean() < 0.7 * b[:10].mean(), "the Triton plan did not learn"
    assert (a[-20:].mean() - b[-20:].mean()).abs() < 0.1 * a[:10].mean()
    assert ((a[:50] - b[:50]).abs() / a[:50]).max() < 0.05


def _layer(cfg):
    torch.manual_seed(0)
    return NSAAttention(cfg).cuda()


CFG_GPU = dict(dim=256, n_heads=8, n_kv_heads=2, head_dim_qk=32, head_dim_v=32, cmp_block=16, cmp_stride=8,
               sel_block=32, sel_count=4, window=64)


@pytest.mark.gpu
def test_training_step_captures_in_a_cuda_graph():
    """Forward and backward of the layer on the Triton plan, captured in a caller's CUDA graph the
    way torch's docs capture a whole network (warm-up on a side stream, grads set to None), replay
    to eager's gradients bit for bit."""
    cfg = NSAConfig(**CFG_GPU)
    m = _layer(cfg)
    x = torch.randn(2, 700, cfg.dim, device="cuda", requires_grad=True)
    params = [x, *m.parameters()]

    def zero():
        for p in params:
            p.grad = None

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            zero()
            m(x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(s)
    zero()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(x).square().mean().backward()
    graph.replay()
    torch.cuda.synchronize()
    got = [p.grad.clone() for p in params]
    eager = torch.autograd.grad(m(x).square().mean(), params)
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_training_kernels_compile_without_graph_breaks():
    """torch.compile(fullgraph=True: a graph break raises) over the three training custom ops,
    forward and backward, gives eager's gradients."""
    from nsa.backends.triton_kernels import autograd as tri

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g).cuda().requires_grad_() for s in
               ((1, 300, 8, 32), (1, 300, 2, 32), (1, 300, 2, 32)))
    kc, vc = (x.detach()[:, :36].clone().requires_grad_() for x in (k, v))
    idx = _indices(q, k, 32, 3).to(torch.int32)

    def loss(q, k, v, kc, vc):
        o = tri.sliding(q, k, v, window=64, scale=0.2, q_start=0, k_start=0)
        o = o + tri.compressed(q, kc, vc, block=16, stride=8, scale=0.2, q_start=0)
        o = o + tri.selected(q, k, v, idx, sel_block=32, scale=0.2, q_start=0, k_start=0)
        return o.square().mean()

    ins = [q, k, v, kc, vc]
    ref_g = torch.autograd.grad(loss(*ins), ins)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*ins), ins)
    for a, b in zip(ref_g, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_module_training_step_compiles_with_inductor():
    """The layer (auto plan: Triton training kernels, torch FA-2 where the thresholds say) in a
    training step under torch.compile(fullgraph=True) with inductor, bf16: no graph break, and the
    gradients agree with eager's to bf16 rounding (inductor fuses the projections and gates
    differently)."""
    torch.manual_seed(0)
    m = NSAAttention(NSAConfig(**CFG_GPU)).cuda().to(torch.bfloat16)
    torch._dynamo.reset()
    _compiled_step_matches_eager(m, (700, 1500), "inductor", dtype=torch.bfloat16, tol=3e-2)


def _tail_gate(name, got, low, ref64):
    """FlashAttention's rule on tensors cut from a long run: `got` (kernel), `low` (the same-dtype torch
    autograd path) against `ref64`."""
    for what, k_, t_, r_ in zip(("out", "dq", "dk", "dv"), got, low, ref64, strict=True):
        assert torch.isfinite(k_).all(), f"{name} {what}: non-finite values"
        err_k = (k_.double() - r_).abs().max().item()
        err_t = (t_.double() - r_).abs().max().item()
        floor = 2 * torch.finfo(torch.bfloat16).eps * max(r_.abs().max().item(), 1e-3)
        assert err_k <= 2 * err_t + floor, f"{name} {what}: kernel err {err_k:.3g} > 2 x torch err {err_t:.3g} + {floor:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("branch", ["win", "cmp", "sel"])
def test_training_kernels_at_128k_use_int64_offsets(branch):
    """The paper layout at 128k with dk 192 and B=2: q holds 2 x 131072 x 64 x 192 = 3.2e9 elements,
    beyond int32, so an offset computed in 32 bits lands elsewhere. Only the last 16 queries of the
    second sequence get an output gradient: their outputs and dq, and dk/dv of the keys they read,
    are checked with the fp64 oracle on that slice (FlashAttention's rule), and every other
    gradient must be exactly zero."""
    from nsa.backends.triton_kernels import autograd as tri

    b, t, hq, hkv, dk, dv, r = 2, 131072, 64, 4, 192, 128, 16
    w, blk, strd, sb, n = 512, 32, 16, 64, 16
    scale = dk ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, t, hq, dk, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    tk = (t - blk) // strd + 1 if branch == "cmp" else t
    k = torch.randn(b, tk, hkv, dk, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, tk, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.zeros(b, t, hq, dv, device="cuda", dtype=torch.bfloat16)
    do[1, -r:] = torch.randn(r, hq, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    q0 = t - r
    if branch == "win":
        k0 = q0 - w + 1
        out = tri.sliding(q, k, v, window=w, scale=scale, q_start=0, k_start=0)
        vis = ref.window_visible(r, t - k0, w, q_start=q0, k_start=k0)
    elif branch == "cmp":
        k0 = 0
        out = tri.compressed(q, k, v, block=blk, stride=strd, scale=scale, q_start=0)
        vis = ref.compressed_visible(r, tk, blk, strd, q_start=q0)
    else:
        # distinct blocks per row: the current block, then steps of 7 * (head + 1) blocks back, -1 below 0
        cur = torch.arange(t, device="cuda") // sb
        step = 7 * (torch.arange(hkv, device="cuda") + 1)
        idx = cur[:, None, None] - torch.arange(n, device="cuda")[None, None, :] * step[None, :, None]
        idx = torch.where(idx >= 0, idx, -1).to(torch.int32)[None].expand(b, t, hkv, n).contiguous()
        k0 = 0
        out = tri.selected(q, k, v, idx, sel_block=sb, scale=scale, q_start=0, k_start=0)
        rows = idx[1, -r:].long()                                               # [r, Hkv, n]
        hit = torch.zeros(r, hkv, t // sb, dtype=torch.bool, device="cuda")
        hit.scatter_(2, rows.clamp(min=0), rows >= 0)
        pos = torch.arange(t, device="cuda")
        vis = (hit.repeat_interleave(sb, 2)[..., :t] & (pos <= (q0 + torch.arange(r, device="cuda"))[:, None, None]))[None]
    dq, dk_, dv_ = torch.autograd.grad(out, [q, k, v], do)
    assert not dq[0].any() and not dq[1, :q0].any()
    assert not dk_[0].any() and not dk_[1, :k0].any() and not dv_[0].any() and not dv_[1, :k0].any()
    got = [out[1:, -r:], dq[1:, -r:], dk_[1:, k0:], dv_[1:, k0:]]
    del dq, dk_, dv_, out

    def tail(dtype):
        qs, ks, vs = (x.detach()[1:, s].to(dtype).requires_grad_() for x, s in
                      ((q, slice(q0, None)), (k, slice(k0, None)), (v, slice(k0, None))))
        o = ref.attention_ad(qs, ks, vs, vis, scale)
        return [o.detach(), *torch.autograd.grad(o, [qs, ks, vs], do[1:, -r:].to(dtype))]

    _tail_gate(f"{branch} 128k", got, tail(torch.bfloat16), tail(torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_training_under_deterministic_algorithms_repeats_bit_for_bit(backend):
    """With torch.use_deterministic_algorithms(True) a training step of the layer runs (no backend in
    the plan refuses it) and two steps give equal gradients bit for bit, at a length where `auto`
    plans the Triton kernels (and torch's FA-2 for the window, where the thresholds say)."""
    cfg = NSAConfig(**CFG_GPU)
    m = _layer(cfg) if backend == "auto" else NSAAttention(cfg, backend=backend).cuda()
    x = torch.randn(2, 3000, cfg.dim, device="cuda", requires_grad=True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(m(x).square().mean(), [x, *m.parameters()]) for _ in range(2)]
        plan = m.plan(*m.project(x)[:2]).label
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b), plan
