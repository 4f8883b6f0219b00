"""backend="auto": thresholds from YAML per profile, overrides, recording; CPU always sdpa."""

from __future__ import annotations

import pytest

from nsa import dispatch, ops
from nsa.backends import AttnCall
from tests.nsa.helpers import qkv

YAML = """\
runtime:
  fa2_min_len_win: 4096
  fa2_min_len_cmp: -1
profiles:
  sm90:
    fa2_min_len_win: 2048
"""


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "base.yaml"
    path.write_text(YAML)
    for var in ("NSA_USE_FA2", "NSA_FA2_FORCE", "NSA_FA2_MIN_LEN_WIN", "NSA_FA2_MIN_LEN_CMP", "NSA_PROFILE",
                "NSA_USE_TRITON", "NSA_TRITON_MIN_LEN_SEL", "NSA_TRITON_MIN_LEN_CMP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NSA_CONFIG", str(path))
    dispatch.set_overrides(**{k: None for k in dispatch._OVERRIDES})
    yield path
    dispatch.set_overrides(**{k: None for k in dispatch._OVERRIDES})


def test_profile_overrides_runtime_and_falls_back(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    t = dispatch.thresholds()
    assert (t.fa2_min_len_win, t.fa2_min_len_cmp) == (2048, -1)
    assert t.sources["fa2_min_len_win"] == "base.yaml:profiles.sm90.fa2_min_len_win"
    assert t.sources["fa2_min_len_cmp"] == "base.yaml:runtime.fa2_min_len_cmp"
    monkeypatch.setenv("NSA_PROFILE", "sm80")
    assert dispatch.thresholds().fa2_min_len_win == 4096


def test_env_and_cli_overrides_are_reported(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "512")
    d = dispatch.describe()
    assert d["fa2_min_len_cmp"] == 512 and d["sources"]["fa2_min_len_cmp"] == "env NSA_FA2_MIN_LEN_CMP"
    monkeypatch.setenv("NSA_USE_FA2", "0")
    assert dispatch.describe()["fa2_min_len_win"] == -1
    monkeypatch.delenv("NSA_USE_FA2")
    dispatch.set_overrides(force_fa2=True)
    t = dispatch.thresholds()
    assert t.force_fa2 and t.fa2_min_len_win == 0 and "force" in t.sources["fa2_min_len_win"]


def test_bad_override_values_raise(config, monkeypatch):
    monkeypatch.setenv("NSA_USE_FA2", "yes")
    with pytest.raises(ValueError, match="NSA_USE_FA2 must be 0 or 1"):
        dispatch.thresholds()
    monkeypatch.delenv("NSA_USE_FA2")
    config.write_text("runtime:\n  fa2_min_len_win: -7\n")
    with pytest.raises(ValueError, match="int >= -1"):
        dispatch.thresholds()
    with pytest.raises(ValueError, match="override names"):
        dispatch.set_overrides(fa2=True)


def test_cpu_always_uses_sdpa_and_records_choice(config, monkeypatch):
    monkeypatch.setenv("NSA_FA2_FORCE", "1")
    q, k, v = qkv(1, 40, 4, 2, 8, 8)
    with dispatch.recording() as log:
        ops.sliding_window_attention(q, k, v, window=8)
        kc, vc = ops.compress_kv(k, v, block=8, stride=4)
        ops.compressed_attention(q, kc, vc, block=8, stride=4)
    assert [r["backend"] for r in log] == ["sdpa", "sdpa"]
    assert log[0]["seq_len"] == 40 and "cpu" in log[0]["why"]


def test_seq_len_is_tokens_so_far():
    q, k, v = qkv(1, 1, 2, 2, 8, 8)
    assert AttnCall("sliding", q, k, v, 1.0, q_start=99, k_start=99).seq_len == 100   # decode step t=99
    q, k, v = qkv(1, 64, 2, 2, 8, 8)
    assert AttnCall("sliding", q, k, v, 1.0).seq_len == 64


def test_repo_config_documents_every_key():
    """configs/base.yaml: every key name is explained by a comment (on its line or just above) where it
    first appears; profile entries repeat keys that `runtime` documents."""
    lines = dispatch.DEFAULT_CONFIG.read_text().splitlines()
    documented: dict[str, bool] = {}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        key = stripped.split(":", 1)[0]
        above = lines[i - 1].strip() if i else ""
        documented[key] = documented.get(key, False) or "#" in line or above.startswith("#")
    assert documented and all(documented.values()), [k for k, ok in documented.items() if not ok]
    assert all(key in documented for key in dispatch.THRESHOLD_KEYS)
    dispatch.set_overrides(config=str(dispatch.DEFAULT_CONFIG))
    try:
        t = dispatch.thresholds()
        assert t.fa2_min_len_win >= -1 and t.triton_min_len_sel >= -1
        assert all(t.sources[key].startswith("base.yaml:") for key in dispatch.THRESHOLD_KEYS)
    finally:
        dispatch.set_overrides(config=None)
