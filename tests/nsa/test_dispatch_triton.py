"""backend="auto" with the own Triton kernels: per-op keys in priority order, per class, the
triton_* overrides, and the per-call plan (fused scores, explicit backends that cannot run).

`dispatch.pick` is the rule `choose` applies to CUDA tensors; it is called here on CPU tensors,
where the triton backend runs under TRITON_INTERPRET=1 (tests/conftest.py) and FA-2 cannot run.
"""

from __future__ import annotations

import pytest
import torch

from nsa import backends, dispatch, ops
from nsa.backends import AttnCall, BackendError, triton_nsa
from tests.nsa.helpers import qkv

YAML = """\
runtime:
  fa2_min_len_win: 4096
  fa2_min_len_cmp: -1
  triton_min_len_sel: 64
  triton_min_len_cmp: -1
profiles:
  sm90:
    triton_min_len_sel: 32
    triton_min_len_cmp: 48
"""
ENV = ("NSA_USE_FA2", "NSA_FA2_FORCE", "NSA_USE_TRITON", "NSA_PROFILE",
       *(f"NSA_{k.upper()}" for k in dispatch.THRESHOLD_KEYS))
G2 = "g2"  # the class of call(): 4 query heads over 2 KV heads
needs_triton = pytest.mark.skipif(triton_nsa.unavailable_reason("cpu") is not None,
                                  reason=f"triton backend unavailable on CPU: {triton_nsa.unavailable_reason('cpu')}")


def _clear() -> None:
    dispatch.set_overrides(**{k: None for k in dispatch._OVERRIDES})


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "base.yaml"
    path.write_text(YAML)
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NSA_CONFIG", str(path))
    _clear()
    yield path
    _clear()


def call(op: str, T: int, dtype: torch.dtype = torch.float32, q_start: int = 0) -> AttnCall:
    q, k, v = qkv(1, T, 4, 2, 16, 16, dtype=dtype)
    if op == "compressed":
        k, v = ops.compress_kv(k, v, block=8, stride=4)
        return AttnCall(op, q, k, v, 0.25, q_start=q_start, block=8, stride=4)
    if op == "selected":
        kc, _ = ops.compress_kv(k, v, block=8, stride=4)
        idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=3)
        return AttnCall(op, q, k, v, 0.25, q_start=q_start, sel_block=16, block_indices=idx)
    return AttnCall(op, q, k, v, 0.25, q_start=q_start, window=16)



@needs_triton
def test_selected_uses_triton_from_its_threshold(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    t = dispatch.thresholds()
    assert dispatch.pick(call("selected", 40), t) == ("triton", f"seq_len 40 >= triton_min_len_sel[{G2}]=32")
    assert dispatch.pick(call("selected", 31), t) == ("sdpa", f"seq_len 31 < triton_min_len_sel[{G2}]=32")
    # Decode: one query at t = 35 is sequence length 36.
    assert dispatch.pick(call("selected", 1, q_start=35), t)[0] == "triton"
    dispatch.set_overrides(use_triton=False)
    name, why = dispatch.pick(call("selected", 40), dispatch.thresholds())
    assert name == "sdpa" and why == f"triton_min_len_sel[{G2}]=-1 (NSA_USE_TRITON=0 / use_triton=False)"


@needs_triton
def test_a_class_mapping_applies_to_its_class_only(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    config.write_text(YAML.replace("triton_min_len_sel: 32", "triton_min_len_sel: {g1: -1, g2: 16}"))
    t = dispatch.thresholds()
    assert dispatch.pick(call("selected", 20), t)[0] == "triton"  # g2
    q, k, v = qkv(1, 20, 2, 2, 16, 16)                               # g1: -1
    mha = AttnCall("selected", q, k, v, 0.25, sel_block=16)
    assert dispatch.pick(mha, t) == ("sdpa", "triton_min_len_sel[g1]=-1 (base.yaml:profiles.sm90.triton_min_len_sel.g1)")


@needs_triton
def test_compressed_tries_triton_then_fa2_then_sdpa(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "16")
    t = dispatch.thresholds()
    assert dispatch.pick(call("compressed", 48), t) == ("triton", f"seq_len 48 >= triton_min_len_cmp[{G2}]=48")
    # Below triton's threshold FA-2 is next; on a CPU it cannot run, so masked SDPA, saying why.
    name, why = dispatch.pick(call("compressed", 40), t)
    fa2 = backends.resolve("fa2", "cpu")
    assert name == "sdpa"
    assert why.startswith(f"seq_len 40 < triton_min_len_cmp[{G2}]=48; FA-2 ({fa2}) cannot run this call: ")
    real = backends.unsupported_reason
    monkeypatch.setattr(backends, "unsupported_reason",
                        lambda name, c: None if name in ("flash_attn", "torch_fa2") else real(name, c))
    assert dispatch.pick(call("compressed", 40), t) == (fa2, f"seq_len 40 < triton_min_len_cmp[{G2}]=48; "
                                                             f"seq_len 40 >= fa2_min_len_cmp[{G2}]=16")
    # Triton cannot run a float64 call: FA-2 takes it even above triton's threshold.
    name, why = dispatch.pick(call("compressed", 64, dtype=torch.float64), t)
    assert name == fa2 and why.startswith("Triton (triton) cannot run this call: the triton kernels take")


@needs_triton
def test_triton_unavailable_falls_through(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.delenv("TRITON_INTERPRET")
    name, why = dispatch.pick(call("selected", 40), dispatch.thresholds())
    assert name == "sdpa" and "TRITON_INTERPRET=1" in why and why.startswith("Triton (triton) cannot run")


@needs_triton
def test_forcing_fa2_keeps_triton_first_and_raises_only_for_fa2(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_FA2_FORCE", "1")
    t = dispatch.thresholds()
    assert dispatch.pick(call("compressed", 48), t)[0] == "triton"
    with pytest.raises(BackendError, match="FA-2 is forced"):
        dispatch.pick(call("compressed", 40), t)
    assert dispatch.pick(call("selected", 10), t)[0] == "sdpa"  # no FA-2 key: nothing to force


def test_cpu_tensors_still_use_sdpa_with_triton_on(config):
    dispatch.set_overrides(triton_min_len_sel=0, triton_min_len_cmp=0)
    q, k, v = qkv(1, 40, 4, 2, 16, 16)
    kc, vc = ops.compress_kv(k, v, block=8, stride=4)
    idx = ops.select_blocks(q, kc, block=8, stride=4, sel_block=16, sel_count=3)
    with dispatch.recording() as log:
        ops.compressed_attention(q, kc, vc, block=8, stride=4)
        ops.selected_attention(q, k, v, idx, sel_block=16)
    assert [(r["op"], r["backend"]) for r in log] == [("compressed", "sdpa"), ("selected", "sdpa")]
    assert all("cpu" in r["why"] for r in log)


def _calls(T: int) -> dict[str, AttnCall]:
    c = {b: call(op, T) for b, op in (("win", "sliding"), ("cmp", "compressed"), ("sel", "selected"))}
    c["sel"].block_indices = None
    return c


@needs_triton
def test_plan_fuses_scores_when_selection_runs_on_triton(config, monkeypatch):
    """The selection scores come from the Triton compressed kernel as soon as the selected branch
    runs on Triton, and that kernel's compressed output replaces an auto-chosen cmp backend."""
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    dispatch.set_overrides(triton_min_len_cmp=-1)
    t = dispatch.thresholds()
    with dispatch.recording() as rec:
        p = dispatch.plan(_calls(40), "auto", t)
    assert (p.backend("sel"), p.backend("cmp"), p.scores, p.cls) == ("triton", "triton", "triton", G2)
    assert p.branches["cmp"].why.startswith("fused")
    assert rec[-1]["op"] == "nsa_plan" and rec[-1]["backend"] == p.label
    low = dispatch.plan(_calls(30), "auto", t)
    assert (low.backend("sel"), low.backend("cmp"), low.scores) == ("sdpa", "sdpa", "torch")


@needs_triton
def test_plan_explicit_backend_raises_for_a_branch_it_cannot_run(config):
    with pytest.raises(BackendError, match=r"cannot run the \w+ branch"):
        dispatch.plan(_calls(40), "fa2")
    p = dispatch.plan(_calls(40), {"sel": "triton"})
    assert (p.backend("sel"), p.backend("win"), p.scores) == ("triton", "sdpa", "triton")
    assert p.branches["sel"].why == "requested"


def test_plan_on_cpu_is_sdpa_everywhere(config):
    p = dispatch.plan(_calls(40))
    assert {b: p.backend(b) for b in ("win", "cmp", "sel")} == {"win": "sdpa", "cmp": "sdpa", "sel": "sdpa"}
    assert p.scores == "torch" and p.profile == "cpu"


def test_bench_cli_triton_off_is_applied_and_recorded(config, tmp_path):
    from bench import cli
    from nsa_contract import results

    out = tmp_path / "r.json"
    argv = ["run", "--suites", "calibration", "--size", "smoke", "--backends", "sdpa", "--out", str(out),
            "--device", "cpu", "--warmup", "1", "--rep", "2", "--triton", "off", "--fa2", "off"]
    try:
        assert cli.main(argv) == 0
    finally:
        _clear()
    run = results.load(out)["run"]
    assert (run["triton"], run["fa2"]) == ("off", "off")
    d = run["dispatch"]["keys"]
    for key in ("triton_min_len_sel", "triton_min_len_cmp", "triton_min_len_win", "fa2_min_len_win"):
        assert d[key]["g16"]["value"] == -1
    assert d["triton_min_len_sel"]["g1"]["source"] == "NSA_USE_TRITON=0 / use_triton=False"
    with pytest.raises(SystemExit):
        cli.main([*argv[:-2], "--triton", "force"])


def test_module_records_one_plan_per_call(monkeypatch):
    """NSAAttention runs from one plan per call, recorded like every auto choice."""
    from nsa import NSAAttention, NSAConfig

    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=3, window=8)
    m = NSAAttention(cfg)
    x = torch.randn(1, 20, 32)
    with dispatch.recording() as rec:
        m(x)
    plans = [r for r in rec if r["op"] == "nsa_plan"]
    # The parameters require grad and grad mode is on: a training plan; under no_grad, an inference one.
    assert len(plans) == 1 and plans[0]["backend"] == "cmp=sdpa sel=sdpa win=sdpa scores=torch grad"
    with torch.no_grad(), dispatch.recording() as rec:
        m(x)
    assert [r["backend"] for r in rec if r["op"] == "nsa_plan"] == ["cmp=sdpa sel=sdpa win=sdpa scores=torch"]
    with pytest.raises(BackendError, match=r"cannot run the \w+ branch"):
        NSAAttention(cfg, backend="fa2")(x)
