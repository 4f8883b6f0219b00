"""The decode suite on a CPU: dense baseline against fp64, the cache it builds, reads, skips, graph paths,
the attention-only variants (decode_attend) beside the whole step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import nsa.backends.triton_nsa  # noqa: F401 - kernels defined under the interpreter (conftest) before a test unsets it
from bench import runner, suites
from bench.cases import Cell
from bench.suites import decode
from bench.timing import Timer
from nsa_contract import results
from tests.bench.fakes import FakeClock

TINY = Timer(warmup=1, rep=2, l2_flush=False)
LAYOUT = {"B": 2, "Hq": 4, "Hkv": 2, "Dk": 32, "Dv": 32, "dim": 64, "block": 16, "stride": 8,
          "sel_block": 16, "sel_count": 3, "window": 24}
CPU = torch.device("cpu")
SETS = ("all", *decode.BRANCHES)
STEP_KEYS = tuple(f"auto:branches={b}" for b in SETS)
ATTEND_KEYS = tuple(f"auto:branches={b}:part=attend" for b in SETS)


def _cell(S: int = 100, **knobs) -> Cell:
    return decode.cells({**LAYOUT, **knobs}, [S], "fp32")[0]


def _run(cells: list[Cell], timer: Timer = TINY, clock=None) -> list[dict]:
    opts = runner.RunOptions(device="cpu", timer=timer, clock=clock)
    cases = runner.run_cells(list(enumerate(cells)), opts)
    results.check(runner.document(cases, opts, command="test", git_sha="unknown",
                                  machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"}))
    return cases


def _by_variant(cases: list[dict]) -> dict[str, dict]:
    """Dense cases by backend, steps by branch set (`all`), attention-only cases as `attend:all`."""
    return {("attend:" if c["params"].get("part") == "attend" else "")
            + c["params"].get("branches", c["requested_backend"]): c for c in cases}


def _reference(q, k, v, scale):
    """fp64 attention of q `[B, 1, Hq, Dk]` over k/v `[B, S, Hkv, D]`; group g owns query heads g*G..(g+1)*G-1."""
    group = q.shape[2] // k.shape[2]
    out = torch.empty(q.shape[0], 1, q.shape[2], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            kh, vh = k[b, :, h // group].double(), v[b, :, h // group].double()
            p = torch.softmax(kh @ q[b, 0, h].double() * scale, dim=0)
            out[b, 0, h] = p @ vh
    return out


def test_dense_decode_equals_fp64_in_the_cache_layout(seed):
    # S, Hq, Hkv, Dk, Dv all differ, so a transposition or a wrong head grouping cannot pass.
    B, S, Hq, Hkv, Dk, Dv = 2, 11, 6, 2, 8, 5
    q = torch.randn(B, 1, Hq, Dk, dtype=torch.float64)
    k, v = torch.randn(B, S, Hkv, Dk, dtype=torch.float64), torch.randn(B, S, Hkv, Dv, dtype=torch.float64)
    out = decode.dense_decode(q, k, v, SDPBackend.MATH, Dk ** -0.5)
    assert out.shape == (B, 1, Hq, Dv)
    torch.testing.assert_close(out, _reference(q, k, v, Dk ** -0.5), rtol=1e-12, atol=1e-12)
    # The flash backend on the CPU, fp32, Dk == Dv: the same function.
    v8 = torch.randn(B, S, Hkv, Dk, dtype=torch.float64)
    out = decode.dense_decode(q.float(), k.float(), v8.float(), SDPBackend.FLASH_ATTENTION, Dk ** -0.5)
    torch.testing.assert_close(out.double(), _reference(q, k, v8, Dk ** -0.5), rtol=1e-4, atol=1e-5)


def test_fill_cache_is_what_prefill_leaves(seed):
    cell = _cell()
    attn, _ = decode._module(cell.params, CPU, torch.float32)
    for T in (10, 70):  # T < l and T < w; T past both, not a multiple of any block
        x = torch.randn(2, T + 1, LAYOUT["dim"])
        built = decode.fill_cache(attn, x[:, :T], chunk=16)
        _, prefilled = attn.prefill(x[:, :T], branches=())
        assert built.length == prefilled.length == T
        torch.testing.assert_close(built.k_cmp, prefilled.k_cmp)
        for name in built.raw:
            for a, b in zip(built.raw[name], prefilled.raw[name], strict=True):
                keep = a.keep or T
                torch.testing.assert_close(a.view(), b.view(keep))
        y_built, y_prefilled = attn.step(x[:, T:], built), attn.step(x[:, T:], prefilled)
        torch.testing.assert_close(y_built, y_prefilled, rtol=1e-5, atol=1e-6)
        assert built.reads.cmp == prefilled.reads.cmp and built.reads.win == prefilled.reads.win
        assert torch.equal(built.reads.sel, prefilled.reads.sel)


def test_building_a_cell_attends_with_one_query_only(monkeypatch):
    """No prefill attention runs (the only T x T risk): every attention call in build is one step's."""
    import nsa.selection

    seen: list[tuple[str, int]] = []
    sdpa, probs = F.scaled_dot_product_attention, nsa.selection.compressed_probs

    def spy_sdpa(q, *args, **kw):
        seen.append(("sdpa", q.shape[-2]))
        return sdpa(q, *args, **kw)

    def spy_probs(q, *args, **kw):
        seen.append(("scores", q.shape[1]))
        return probs(q, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(nsa.selection, "compressed_probs", spy_probs)
    work = decode.build(_cell(S=300), CPU)
    assert {kind for kind, _ in seen} == {"sdpa", "scores"}
    assert all(n == 1 for _, n in seen), seen
    assert set(work.fns) == {"sdpa_flash", *STEP_KEYS, *ATTEND_KEYS}


def test_dense_baseline_reads_the_whole_cache_beside_the_nsa_step(monkeypatch):
    calls = []
    real = decode.dense_decode

    def spy(q, k, v, backend, scale):
        calls.append((q, k, v, scale))
        return real(q, k, v, backend, scale)

    monkeypatch.setattr(decode, "dense_decode", spy)
    cases = _run([_cell(S=100)])
    by = _by_variant(cases)
    q, k, v, scale = calls[0]
    assert q.shape == (2, 1, 4, 32) and k.shape == (2, 100, 2, 32) and v.shape == (2, 100, 2, 32)
    torch.testing.assert_close(real(q, k, v, SDPBackend.FLASH_ATTENTION, scale).double(),
                               _reference(q, k, v, scale), rtol=1e-4, atol=1e-5)
    flash, cudnn = by["sdpa_flash"], by["sdpa_cudnn"]
    assert flash["op"] == cudnn["op"] == "dense" and flash["role"] == "baseline"
    assert flash["status"] == "ok" and flash["reads"] == {"total": 100} and flash["gqa"] == "native"
    assert cudnn["status"] == "skipped" and cudnn["reason"].startswith("SDPA backend cannot run")
    for b in (*SETS, *(f"attend:{b}" for b in SETS)):
        assert by[b]["status"] == "ok" and by[b]["op"] == "nsa_decode", by[b]["reason"]
        assert {k: v for k, v in by[b]["params"].items() if k not in ("branches", "part")} == flash["params"]
    # S = 100: t = 99 -> cmp (100-16)//8+1 = 11, sel 2 full blocks + 99 % 16 + 1 = 36, win 24
    assert by["all"]["reads"]["total"] == by["all"]["reads_expected"]["total"] == 71
    for b in SETS:  # the attention part reads what the step reads
        assert by[f"attend:{b}"]["reads"] == by[b]["reads"] and by[f"attend:{b}"]["reads_expected"] == \
            by[b]["reads_expected"]
    assert len({c["id"] for c in cases}) == len(cases)
    [speed] = decode.dense_speedups(cases).values()
    assert speed["nsa"] == by["all"]["timing"]["median_ms"] and speed["attend"] == by["attend:all"]["timing"]["median_ms"]
    assert speed["speedup"] == pytest.approx(speed["sdpa_flash"] / speed["nsa"])
    assert speed["speedup_attend"] == pytest.approx(speed["sdpa_flash"] / speed["attend"])


@pytest.mark.parametrize("nsa_backend", ["auto", "triton"])
def test_decode_attend_variants_are_the_attention_part_of_the_step(monkeypatch, nsa_backend):
    """o_proj of what an attend variant returns is the step's output on the same cache state, and
    repeated calls (as graph replays are) give the same output on an unchanged cache."""
    _need_interpreted_kernels()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    made = []
    real = decode._module
    monkeypatch.setattr(decode, "_module", lambda p, device, dtype: made.append(real(p, device, dtype)) or made[-1])
    work = decode.build(_cell(S=100, nsa_backend=nsa_backend), CPU)
    [(attn, _)] = made
    assert not work.failures and set(work.reasons) == {"sdpa_cudnn", "fa3"}, (work.failures, work.reasons)
    for b in SETS:
        step, attend = f"auto:branches={b}", f"auto:branches={b}:part=attend"
        assert work.extra[attend]["reads"] == work.extra[step]["reads"]
        assert work.backends[attend] == work.backends[step]
        work.setups[step]()
        y = work.fns[step]()
        o = work.fns[attend]()
        assert o.shape == (2, 1, 4, 32) and o.abs().max() > 0
        torch.testing.assert_close(attn._out(o), y, rtol=1e-5, atol=1e-6)
        assert torch.equal(work.fns[attend](), o)


def test_step_case_ids_are_kept_and_attend_ids_are_new():
    cell = _cell(S=100)
    ids = {v.key: cell.case_id(v) for v in cell.variants}
    assert len(set(ids.values())) == len(ids) == len(decode.VARIANTS) == 11
    for b in SETS:
        step, attend = ids[f"auto:branches={b}"], ids[f"auto:branches={b}:part=attend"]
        assert step == f"decode/nsa_decode/auto/B2-T100-Hq4-Hkv2-D32-w24-l16-d8-ls16-n3-branches{b}-dim64-fp32"
        assert attend == step.replace("-fp32", "-partattend-fp32")


def test_reads_that_differ_from_the_spec_fail_and_are_never_timed_or_captured(monkeypatch):
    real = decode.expected_reads
    monkeypatch.setattr(decode, "expected_reads", lambda s, p: {**real(s, p), "win": real(s, p)["win"] + 1})
    work = decode.build(_cell(S=100), CPU)
    for b in ("all", "win"):
        for key in (f"auto:branches={b}", f"auto:branches={b}:part=attend"):
            assert "win measured 24 expected 25" in work.failures[key]
            assert key not in work.fns and key not in work.captures
    assert set(work.captures) == {f"auto:branches={b}{part}" for b in ("cmp", "sel") for part in ("", ":part=attend")}


def test_graph_cells_are_skipped_on_a_cpu_with_the_reason():
    cases = _run([_cell(S=100, graph=True)])
    assert len(cases) == len(decode.VARIANTS)
    assert all(c["status"] == "skipped" and "CUDA graph" in c["reason"] for c in cases)


def _need_interpreted_kernels() -> None:
    """CPU-tensor Triton cells need kernels defined under the interpreter (conftest sets it on a
    machine without CUDA); on a CUDA machine they were compiled for the GPU at import."""
    if not nsa.backends.triton_nsa.kernels_interpreted():
        pytest.skip("nsa's Triton kernels were compiled for the GPU at import (TRITON_INTERPRET unset): "
                    "CPU-tensor triton cells cannot run here")


def test_cpu_triton_cells_are_skipped_when_the_kernels_were_compiled_for_the_gpu(monkeypatch):
    """TRITON_INTERPRET=1 set after import (kernels compiled for the GPU): the triton cells say
    why they cannot run instead of launching GPU code on CPU tensors."""
    triton_nsa = nsa.backends.triton_nsa
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_nsa, "kernels_interpreted", lambda: False)
    assert "set it before importing nsa" in triton_nsa.unavailable_reason("cpu")
    by = _by_variant(_run([_cell(S=100, nsa_backend="triton")]))
    assert by["all"]["status"] == "skipped" and "before importing nsa" in by["all"]["reason"], by["all"]["reason"]
    assert by["sdpa_flash"]["status"] == "ok"


def test_triton_module_backend_without_the_interpreter_is_skipped(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    by = _by_variant(_run([_cell(S=100, nsa_backend="triton")]))
    # backend="triton" now names Triton for every branch, the window too (it has a sliding op).
    for b in ("all", "cmp", "sel", "win", "attend:all", "attend:cmp", "attend:sel", "attend:win"):
        assert by[b]["status"] == "skipped" and "triton" in by[b]["reason"], by[b]["reason"]
    assert by["sdpa_flash"]["status"] == "ok"


@pytest.mark.slow  # the module's prefill and steps under Triton's interpreter; the [triton] attend variants stay
def test_triton_module_backend_reads_match_the_spec(monkeypatch):
    _need_interpreted_kernels()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    by = _by_variant(_run([_cell(S=100, nsa_backend="triton")]))
    assert all(c["status"] == "ok" for c in by.values() if c["op"] == "nsa_decode"), \
        [c["reason"] for c in by.values()]
    assert by["all"]["reads"]["total"] == 71 and by["all"]["params"]["nsa_backend"] == "triton"
    assert by["attend:all"]["reads"] == by["all"]["reads"]
    # The window runs as a block list through the selection kernel (recorded as a sliding choice).
    assert by["all"]["branch_backends"] == by["attend:all"]["branch_backends"] == \
        {"cmp": "triton", "sel": "triton", "win": "triton"}
    assert by["cmp"]["backend"] == "triton" and by["all"]["id"].split("/")[2] == "triton"
    assert by["win"]["backend"] == "triton", "the window-only variant runs the same window kernel as the step"


def test_an_unknown_module_backend_fails_the_cell_with_the_fix():
    cases = _run([_cell(S=40, nsa_backend="flex")])
    assert all(c["status"] == "failed" and "nsa_backend must be one of" in c["reason"] for c in cases)


def test_each_capture_is_one_step_of_its_own_branches_on_the_prefilled_cache(monkeypatch):
    captured, attended = [], []
    monkeypatch.setattr(decode, "capture_step",
                        lambda attn, x_t, snapshot, branches: captured.append((x_t, snapshot, branches)))
    monkeypatch.setattr(decode, "capture_attend",
                        lambda attn, q, gates, cache, branches: attended.append((q, gates, cache, branches)))
    work = decode.build(_cell(S=100), CPU)
    assert set(work.captures) == {*STEP_KEYS, *ATTEND_KEYS}
    assert set(work.setups) == set(STEP_KEYS)  # decode_attend changes no state: nothing to restore
    assert not work.cuda_graph
    for fn in work.captures.values():
        fn()
    wanted = [decode.BRANCHES, ("cmp",), ("sel",), ("win",)]
    assert [b for _, _, b in captured] == wanted
    assert all(x_t.shape == (2, 1, 64) and snap.length == 99 for x_t, snap, _ in captured)
    # decode_attend on the cache that holds token t = 99, with that token's q and gates; one shared cache.
    assert [b for *_, b in attended] == wanted
    assert all(q.shape == (2, 1, 4, 32) and g.shape == (2, 1, 4, 3) and c.length == 100 for q, g, c, _ in attended)
    assert len({id(c) for _, _, c, _ in attended}) == 1


def test_under_cuda_graphs_the_steps_are_timed_as_their_captured_replays(monkeypatch):
    """`--cuda-graph` (the timer) on a plain decode cell: each NSA variant is captured once and its
    replay timed without a cache restore; dense variants go to the clock's own capture."""
    clock = FakeClock()
    wrapped: list = []
    clock.wrap = lambda fn: wrapped.append(fn) or fn
    replays: list[tuple[str, ...]] = []

    def fake_capture(attn, x_t, snapshot, branches):
        replays.append(branches)
        return clock.candidate("replay:" + "+".join(branches), 1.0)

    def fake_attend(attn, q, gates, cache, branches):
        replays.append(("attend", *branches))
        return clock.candidate("attend:" + "+".join(branches), 0.5)

    monkeypatch.setattr(decode, "capture_step", fake_capture)
    monkeypatch.setattr(decode, "capture_attend", fake_attend)
    cases = _run([_cell(S=60)], timer=Timer(warmup=1, rep=3, l2_flush=False, cuda_graph=True), clock=clock)
    by = _by_variant(cases)
    assert all(c["status"] == "ok" and c["cuda_graph"] is True for c in cases if c["status"] != "skipped")
    # Captured once each; then 1 warmup + 3 repeats of the replay (an eager step would not move
    # the fake clock, so samples of 1.0 are the replay's).
    assert len(replays) == 8 and clock.calls().count("replay:cmp+sel+win") == 1 + 3
    assert clock.calls().count("attend:cmp+sel+win") == 1 + 3
    assert by["all"]["timing"]["samples_ms"] == [1.0] * 3
    assert by["attend:all"]["timing"]["samples_ms"] == [0.5] * 3
    assert len(wrapped) == 1  # the dense flash fn; the replays are not captured again


def test_a_capture_that_raises_times_the_whole_cell_eagerly(monkeypatch):
    def broken(attn, x_t, snapshot, branches):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "capture_step", broken)
    clock = FakeClock()
    cases = _run([_cell(S=60)], timer=Timer(warmup=1, rep=2, l2_flush=False, cuda_graph=True), clock=clock)
    ran = [c for c in cases if c["status"] == "ok"]
    assert len(ran) == 9 and all(c["cuda_graph"] is False for c in ran)
    assert all("operation not permitted" in c["cuda_graph_error"] for c in ran)


def test_grids_hold_the_decode_target():
    for size, lengths in (("nightly", {8192, 65536}), ("full", {8192, 16384, 32768, 65536})):
        cells = [c for c in suites.cells(["decode"], size) if c.params["B"] == 8]
        assert {c.params["T"] for c in cells} == lengths
        for c in cells:
            assert {k: c.params[k] for k in ("Hq", "Hkv", "Dk", "Dv", "block", "stride", "sel_block",
                                                  "sel_count", "window", "nsa_backend", "graph")} == \
                {"Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "block": 32, "stride": 16, "sel_block": 64,
                 "sel_count": 16, "window": 512, "nsa_backend": "triton", "graph": True}
            assert {v.backend for v in c.variants} >= {"sdpa_flash", "sdpa_cudnn", "auto"}
        ids = [c.case_id(v) for c in suites.cells(["decode"], size) for v in c.variants]
        assert len(ids) == len(set(ids))
    smoke = suites.cells(["decode"], "smoke")
    assert all("graph" not in c.params and "nsa_backend" not in c.params for c in smoke)


def test_out_of_memory_while_building_skips_every_case_and_keeps_the_file_valid(monkeypatch):
    def oom(*args, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(decode, "fill_cache", oom)
    cases = _run([_cell(S=100)])
    assert all(c["status"] == "skipped" and "out of memory while building" in c["reason"] for c in cases)
    assert {c["backend"] for c in cases} == {"sdpa_flash", "sdpa_cudnn", "fa3", "sdpa"}
