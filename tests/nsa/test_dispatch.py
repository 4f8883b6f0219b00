"""backend="auto": one declaration of the keys, one loader, thresholds per profile and class,
overrides, the per-call plan and its record; CPU tensors always use sdpa."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nsa import dispatch, ops
from nsa.backends import AttnCall
from nsa_contract import keys, settings
from tests.nsa.helpers import qkv

YAML = """\
runtime:
  fa2_min_len_win: 4096
  fa2_min_len_cmp: -1
profiles:
  sm90:
    fa2_min_len_win: 2048
    triton_min_len_sel: {g1: -1, g16: 1024}
  sm80: {}
"""


def clear_env(monkeypatch) -> None:
    for var in ("NSA_PROFILE", "NSA_FA2_FORCE", *(f"NSA_USE_{f.upper()}" for f in keys.FAMILIES),
                *(k.env for k in keys.KEYS)):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "base.yaml"
    path.write_text(YAML)
    clear_env(monkeypatch)
    monkeypatch.setenv("NSA_CONFIG", str(path))
    dispatch.set_overrides(**{k: None for k in dispatch._OVERRIDES})
    yield path
    dispatch.set_overrides(**{k: None for k in dispatch._OVERRIDES})


def test_keys_and_settings_import_without_torch():
    code = "import sys, nsa_contract.keys, nsa_contract.settings; nsa_contract.settings.load(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("hq", "hkv", "cls"), [(16, 16, "g1"), (8, 4, "g2"), (12, 4, "g2"), (8, 2, "g4"),
                                                (64, 8, "g8"), (64, 4, "g16"), (64, 1, "g16")])
def test_class_is_the_group_size_bucket(hq, hkv, cls):
    assert keys.class_of(hq, hkv) == cls
    assert keys.class_of_params({"Hq": hq, "Hkv": hkv}) == cls


def test_profile_then_runtime_then_minus_one_per_class(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    t = dispatch.thresholds()
    assert t.lookup("fa2_min_len_win", "g4") == (2048, "base.yaml:profiles.sm90.fa2_min_len_win")
    assert t.lookup("fa2_min_len_cmp", "g4") == (-1, "base.yaml:runtime.fa2_min_len_cmp")
    assert t.lookup("triton_min_len_sel", "g16") == (1024, "base.yaml:profiles.sm90.triton_min_len_sel.g16")
    assert t.lookup("triton_min_len_sel", "g4")[0] == -1 and "not set" in t.lookup("triton_min_len_sel", "g4")[1]
    monkeypatch.setenv("NSA_PROFILE", "sm80")
    assert dispatch.thresholds().value("fa2_min_len_win", "g1") == 4096


def test_env_and_cli_overrides_are_reported(config, monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm90")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "512")
    d = dispatch.describe()
    assert d["keys"]["fa2_min_len_cmp"]["g4"] == {"value": 512, "source": "env NSA_FA2_MIN_LEN_CMP"}
    monkeypatch.setenv("NSA_USE_FA2", "0")
    assert dispatch.describe()["keys"]["fa2_min_len_win"]["g1"]["value"] == -1
    monkeypatch.delenv("NSA_USE_FA2")
    dispatch.set_overrides(force_fa2=True)
    t = dispatch.thresholds()
    assert t.force_fa2 and t.lookup("fa2_min_len_win", "g1")[0] == 0 and "force" in t.lookup("fa2_min_len_win", "g1")[1]
    dispatch.set_overrides(force_fa2=None, use_triton=False)
    assert dispatch.thresholds().value("triton_min_len_sel", "g16") == -1


@pytest.mark.parametrize("name", ["junk", "sm90 ", " sm90", "SM90", "sm86"])
def test_a_profile_named_by_hand_must_be_one_the_config_defines(config, monkeypatch, name):
    """NSA_PROFILE=junk once read `runtime` alone (every key -1 with the shipped config: masked
    SDPA everywhere) without a word; it and the code/CLI override are refused with the known names."""
    monkeypatch.setenv("NSA_PROFILE", name)
    with pytest.raises(ValueError, match=rf"NSA_PROFILE must name a profile of base\.yaml \(sm80, sm90\), got "
                                         rf"'{name}'; fix the name, or unset it to use the device's profile"):
        dispatch.thresholds()
    with pytest.raises(ValueError, match="NSA_PROFILE must name a profile"):
        dispatch.describe()
    monkeypatch.delenv("NSA_PROFILE")
    dispatch.set_overrides(profile=name)
    with pytest.raises(ValueError, match=r"override profile \(code/CLI\) must name a profile of base\.yaml"):
        dispatch.thresholds()
    dispatch.set_overrides(profile="sm90")
    assert dispatch.thresholds().value("fa2_min_len_win", "g1") == 2048
    dispatch.set_overrides(profile=None)
    assert dispatch.thresholds().profile == "cpu"     # the device's own profile may be missing: runtime


def test_bad_override_values_raise(config, monkeypatch):
    monkeypatch.setenv("NSA_USE_FA2", "yes")
    with pytest.raises(ValueError, match="NSA_USE_FA2 must be 0 or 1"):
        dispatch.thresholds()
    monkeypatch.delenv("NSA_USE_FA2")
    monkeypatch.setenv("NSA_TRITON_MIN_LEN_SEL", "-5")
    with pytest.raises(ValueError, match="must be -1"):
        dispatch.thresholds()
    with pytest.raises(ValueError, match="override names"):
        dispatch.set_overrides(fa2=True)
    with pytest.raises(ValueError, match="must be -1"):
        dispatch.set_overrides(fa2_min_len_win=-3)


@pytest.mark.parametrize(("text", "match"), [
    ("runtime:\n  fa2_min_len_wn: 2048\n", r"runtime\.fa2_min_len_wn is unknown; did you mean runtime\.fa2_min_len_win"),
    ("runtime:\n  fa2_min_len_win: off\n", "got the boolean False .*write -1 to disable"),
    ("runtime:\n  fa2_min_len_win: 4096.5\n", "got 4096.5"),
    ("runtime:\n  fa2_min_len_win: '4096'\n", "got '4096'"),
    ("runtime:\n  fa2_min_len_win: -5\n", "got -5"),
    ("runtime:\n  fa2_min_len_win: true\n", "got the boolean True"),
    ("runtime:\n  triton_min_len_sel: {g3: 5}\n", "class 'g3' is unknown"),
    ("base: &b\n  fa2_min_len_win: 1\nruntime:\n  <<: *b\n", r"merge keys \(<<\) must not be used"),
    ("runtime:\n  fa2_min_len_win: 1\n  fa2_min_len_win: 2\n", "must appear once"),
    ("profiles:\n  hopper:\n    fa2_min_len_win: 1\n", "profile names must look like sm90"),
    ("decide:\n  margin: .nan\n", "decide.margin must be a finite number"),
    ("nsa:\n  window: 0\n", "nsa.window must be a positive int"),
    ("nsa:\n  sel_count: 4097\n", r"nsa.sel_count must be at most 4096 .*got 4097; use the paper's 16"),
    ("nope: 1\n", "top-level section nope is unknown"),
    ("- a\n", "must be a YAML mapping"),
    ("runtime: [\n", "must be valid YAML"),
])
def test_one_loader_rejects_bad_configs_with_the_fix(text, match):
    with pytest.raises(settings.SettingsError, match=match):
        settings.load_text(text, "x.yaml")


def test_loader_rejects_non_utf8(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"runtime:\n  fa2_min_len_win: 1 # \xff\n")
    with pytest.raises(settings.SettingsError, match="must be UTF-8"):
        settings.load(p)


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


def test_repo_config_documents_every_key_and_loads():
    """configs/base.yaml: every key name is explained by a comment (on its line or just above) where it
    first appears, every decision key is there, and the one loader accepts the file."""
    lines = settings.DEFAULT_CONFIG.read_text().splitlines()
    documented: dict[str, bool] = {}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        key = stripped.split(":", 1)[0]
        above = lines[i - 1].strip() if i else ""
        documented[key] = documented.get(key, False) or "#" in line or above.startswith("#")
    assert documented and all(documented.values()), [k for k, ok in documented.items() if not ok]
    assert all(key in documented for key in keys.names())
    cfg = settings.load(settings.DEFAULT_CONFIG)
    assert set(cfg.runtime) == set(keys.names())
