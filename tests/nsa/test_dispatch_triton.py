"""backend="auto" with the own Triton kernels: per-op candidates in priority order, the triton_*
thresholds, their overrides and `triton_fused_ok`.

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


def test_candidates_are_in_priority_order():
    assert [(c.backend, c.key) for c in dispatch.CANDIDATES["compressed"]] == [
        ("triton", "triton_min_len_cmp"), ("fa2", "fa2_min_len_cmp")]
    assert [(c.backend, c.key) for c in dispatch.CANDIDATES["sliding"]] == [("fa2", "fa2_min_len_win")]
    assert [(c.backend, c.key) for c in dispatch.CANDIDATES["selected"]] == [("triton", "triton_min_len_sel")]
    assert dispatch.THRESHOLD_KEYS == ("fa2_min_len_win", "fa2_min_len_cmp", "triton_min_len_sel",
                                       "triton_min_len_cmp")


def test_triton_keys_load_from_profile_then_runtime_then_default(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    t = dispatch.thresholds()
    assert (t.triton_min_len_sel, t.triton_min_len_cmp, t.fa2_min_len_win) == (32, 48, 4096)
    assert t.sources["triton_min_len_sel"] == "base.yaml:profiles.sm90.triton_min_len_sel"
    monkeypatch.setenv("NSA_PROFILE", "sm80")
    t = dispatch.thresholds()
    assert (t.triton_min_len_sel, t.triton_min_len_cmp) == (64, -1)
    assert t.sources["triton_min_len_cmp"] == "base.yaml:runtime.triton_min_len_cmp"
    config.write_text("runtime:\n  fa2_min_len_win: -1\n")
    dispatch.set_overrides(config=str(config))  # clears the cache
    t = dispatch.thresholds()
    assert t.triton_min_len_sel == -1 and t.sources["triton_min_len_sel"] == "default (-1, key absent)"


def test_env_overrides_of_triton_keys(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_TRITON_MIN_LEN_SEL", "1024")
    monkeypatch.setenv("NSA_TRITON_MIN_LEN_CMP", "2048")
    d = dispatch.describe()
    assert (d["triton_min_len_sel"], d["triton_min_len_cmp"]) == (1024, 2048)
    assert d["sources"]["triton_min_len_cmp"] == "env NSA_TRITON_MIN_LEN_CMP"
    monkeypatch.setenv("NSA_USE_TRITON", "0")
    d = dispatch.describe()
    assert (d["triton_min_len_sel"], d["triton_min_len_cmp"]) == (-1, -1)
    assert d["sources"]["triton_min_len_sel"] == "NSA_USE_TRITON=0 / use_triton=False"
    assert d["fa2_min_len_win"] == 4096  # FA-2 keys untouched
    monkeypatch.setenv("NSA_USE_TRITON", "1")
    assert dispatch.describe()["triton_min_len_sel"] == 1024
    monkeypatch.setenv("NSA_USE_TRITON", "on")
    with pytest.raises(ValueError, match="NSA_USE_TRITON must be 0 or 1"):
        dispatch.thresholds()
    monkeypatch.setenv("NSA_USE_TRITON", "1")
    monkeypatch.setenv("NSA_TRITON_MIN_LEN_SEL", "-2")
    with pytest.raises(ValueError, match="int >= -1"):
        dispatch.thresholds()


def test_fa2_switches_leave_the_triton_keys_alone(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_USE_FA2", "0")
    t = dispatch.thresholds()
    assert (t.fa2_min_len_win, t.triton_min_len_sel, t.triton_min_len_cmp) == (-1, 32, 48)
    monkeypatch.delenv("NSA_USE_FA2")
    monkeypatch.setenv("NSA_FA2_FORCE", "1")
    t = dispatch.thresholds()
    assert (t.fa2_min_len_win, t.fa2_min_len_cmp, t.triton_min_len_sel, t.triton_min_len_cmp) == (0, 0, 32, 48)
    assert t.force_fa2 and t.sources["triton_min_len_cmp"].startswith("base.yaml:")


def test_code_overrides_of_triton_keys(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    dispatch.set_overrides(triton_min_len_sel=4096, triton_min_len_cmp=8192)
    t = dispatch.thresholds()
    assert (t.triton_min_len_sel, t.triton_min_len_cmp) == (4096, 8192)
    assert t.sources["triton_min_len_sel"] == "override (code/CLI)"
    dispatch.set_overrides(use_triton=False)
    assert dispatch.thresholds().triton_min_len_cmp == -1
    dispatch.set_overrides(use_triton=None, triton_min_len_cmp=None)
    assert dispatch.thresholds().triton_min_len_cmp == 48
    with pytest.raises(ValueError, match="override names"):
        dispatch.set_overrides(triton=True)


@needs_triton
def test_selected_uses_triton_from_its_threshold(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    t = dispatch.thresholds()
    assert dispatch.pick(call("selected", 40), t) == ("triton", "seq_len 40 >= triton_min_len_sel=32")
    assert dispatch.pick(call("selected", 31), t) == ("sdpa", "seq_len 31 < triton_min_len_sel=32")
    # Decode: one query at t = 35 is sequence length 36.
    assert dispatch.pick(call("selected", 1, q_start=35), t)[0] == "triton"
    dispatch.set_overrides(use_triton=False)
    name, why = dispatch.pick(call("selected", 40), dispatch.thresholds())
    assert name == "sdpa" and why == "triton_min_len_sel=-1 (NSA_USE_TRITON=0 / use_triton=False)"


@needs_triton
def test_compressed_tries_triton_then_fa2_then_sdpa(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "16")
    t = dispatch.thresholds()
    assert dispatch.pick(call("compressed", 48), t) == ("triton", "seq_len 48 >= triton_min_len_cmp=48")
    # Below triton's threshold FA-2 is next; on a CPU it cannot run, so masked SDPA, saying why.
    name, why = dispatch.pick(call("compressed", 40), t)
    fa2 = backends.resolve("fa2", "cpu")
    assert name == "sdpa"
    assert why.startswith(f"seq_len 40 < triton_min_len_cmp=48; FA-2 ({fa2}) cannot run this call: ")
    # Where FA-2 can run, it is picked.
    real = backends.unsupported_reason
    monkeypatch.setattr(backends, "unsupported_reason",
                        lambda name, c: None if name in ("flash_attn", "torch_fa2") else real(name, c))
    assert dispatch.pick(call("compressed", 40), t) == (fa2, "seq_len 40 < triton_min_len_cmp=48; "
                                                             "seq_len 40 >= fa2_min_len_cmp=16")
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
    assert dispatch.pick(call("selected", 10), t)[0] == "sdpa"  # no FA-2 candidate: nothing to force


def test_sliding_ignores_the_triton_keys(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    dispatch.set_overrides(triton_min_len_sel=0, triton_min_len_cmp=0)
    name, why = dispatch.pick(call("sliding", 40), dispatch.thresholds())
    assert (name, why) == ("sdpa", "seq_len 40 < fa2_min_len_win=4096")


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


@needs_triton
def test_triton_fused_ok_needs_both_thresholds_and_a_gpu(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")  # no CUDA query: the profile is given
    assert dispatch.triton_fused_ok(48, "cuda")  # cmp 48, sel 32
    assert not dispatch.triton_fused_ok(47, "cuda")
    assert not dispatch.triton_fused_ok(4096, "cpu")
    assert not dispatch.triton_fused_ok(4096, None)
    assert dispatch.triton_fused_ok(4096, "cuda", call("selected", 40))
    assert not dispatch.triton_fused_ok(4096, "cuda", call("selected", 40, dtype=torch.float64))
    monkeypatch.setenv("NSA_PROFILE", "sm80")  # runtime: triton_min_len_cmp is -1
    assert not dispatch.triton_fused_ok(1 << 20, "cuda")
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_USE_TRITON", "0")
    assert not dispatch.triton_fused_ok(1 << 20, "cuda")


def test_bench_cli_triton_off_is_applied_and_recorded(config, tmp_path):
    from bench import cli, results

    out = tmp_path / "r.json"
    argv = ["run", "--suites", "calibration", "--size", "smoke", "--backends", "sdpa", "--out", str(out),
            "--device", "cpu", "--warmup", "1", "--rep", "2", "--triton", "off", "--fa2", "off"]
    try:
        assert cli.main(argv) == 0
    finally:
        _clear()
    run = results.load(out)["run"]
    assert (run["triton"], run["fa2"]) == ("off", "off")
    d = run["dispatch"]
    assert (d["triton_min_len_sel"], d["triton_min_len_cmp"], d["fa2_min_len_win"]) == (-1, -1, -1)
    assert d["sources"]["triton_min_len_sel"] == "NSA_USE_TRITON=0 / use_triton=False"
    with pytest.raises(SystemExit):
        cli.main([*argv[:-2], "--triton", "force"])


def test_module_auto_takes_the_triton_path_only_on_cuda_above_both_thresholds(monkeypatch):
    """NSAAttention(backend="auto") asks dispatch.triton_fused_ok and records the choice; on CPU
    tensors it never takes the Triton path, whatever the thresholds."""
    import torch

    from nsa import NSAAttention, NSAConfig, dispatch

    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, sel_count=3, window=8)
    m = NSAAttention(cfg)
    asked = []
    monkeypatch.setattr(dispatch, "triton_fused_ok", lambda n, dev, call=None: asked.append(n) or True)
    x = torch.randn(1, 20, 32)
    assert m._use_triton(x.new_zeros(1, 20, 4, 16), x.new_zeros(1, 20, 2, 16), 20) is False
    assert asked == [], "CPU tensors never reach the threshold check"
    q = torch.zeros(1, 20, 4, 16, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")), raising=False)
    with dispatch.recording() as rec:
        assert m._use_triton(q, q[:, :, :2], 20) is True
    assert asked == [20] and rec[-1]["op"] == "nsa_triton_path" and rec[-1]["backend"] == "triton"
