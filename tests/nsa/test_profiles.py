"""GPU profiles (nsa/profiles/): one object per kind of GPU, found from the device's capability;
an unknown GPU gets `generic` with one warning; a new kind is one file plus one YAML block. No GPU
needed: `fake_gpu` (tests/nsa/conftest.py) sets the capability cuda:0 reports, and FakeTensors
stand in for CUDA tensors."""

from __future__ import annotations

import logging
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nsa import dispatch, profiles, resources
from nsa.backends import AttnCall, _fa2_common, flex, triton_nsa
from nsa.backends.triton_kernels import decode, fa3_cmp, fa4_win
from nsa.profiles import Features, Profile, Tiles

CUDA0 = torch.device("cuda", 0)


def _cuda_call(op: str, seq_len: int, d: int = 64, hq: int = 4, hkv: int = 2) -> AttnCall:
    """A call on CUDA FakeTensors: device, dtype and shape without a GPU."""
    with FakeTensorMode():
        q = torch.empty(1, seq_len, hq, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, seq_len, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(1, seq_len, hkv, d, dtype=torch.bfloat16, device="cuda")
    return AttnCall(op, q, k, v, d ** -0.5, window=16, block=8, stride=4, sel_block=16,
                    block_indices=None)


def test_the_h100_gets_sm90_with_the_features_its_machine_allows(fake_gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake_gpu((9, 0))
    p = profiles.profile_for(CUDA0)
    assert (p.name, p.thresholds) == ("sm90", "sm90") and p.tiles == Tiles()
    assert p.features == Features(pdl=profiles._triton_has_gdc(), tma=True, fa2=True, fa3=True, fa4=True)
    assert p is profiles.profile_for("cuda") and dispatch.device_profile("cuda:0") == "sm90"
    assert fa3_cmp.enabled(CUDA0) and fa4_win.enabled(CUDA0) and decode.pdl_ok(CUDA0) == p.features.pdl
    # Without the wheels the same GPU keeps the own kernels.
    fake_gpu((9, 0), wheels=False)
    assert not profiles.profile_for(CUDA0).features.fa3 and not fa4_win.enabled(CUDA0)
    # The interpreter runs the kernels on the CPU: its tiles and no PDL, whatever the device.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert profiles.kernel_profile(CUDA0) is profiles.by_name("cpu") and not decode.pdl_ok(CUDA0)
    assert profiles.profile_for(CUDA0).name == "sm90"   # dispatch still reads the device's thresholds


def test_cpu_tensors_get_the_cpu_profile():
    p = profiles.profile_for("cpu")
    assert p is profiles.profile_for(None) is profiles.by_name("cpu")
    assert p.features == Features() and p.tiles.cmp_rows == 16 and not decode.pdl_ok("cpu")


@pytest.mark.parametrize("capability", [(8, 9), (10, 0), (12, 0)], ids=["sm89", "sm100", "sm120"])
def test_an_unknown_gpu_gets_generic_and_one_warning_per_device(fake_gpu, caplog, monkeypatch, capability):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kind = f"sm{capability[0]}{capability[1]}"
    fake_gpu(capability)
    fake_gpu(capability, index=1)
    with caplog.at_level(logging.WARNING, logger="nsa.profiles"):
        p = profiles.profile_for(CUDA0)
        for _ in range(3):
            assert profiles.profile_for("cuda:0") is p
            triton_nsa.current_tiles(CUDA0)
            dispatch.device_profile(CUDA0)
        assert caplog.messages and len(caplog.messages) == 1
        profiles.profile_for("cuda:1")
    assert len(caplog.messages) == 2
    assert (p.name, p.thresholds, p.tiles) == ("generic", kind, profiles.by_name("generic").tiles)
    assert p.tiles != Tiles() and p.tiles.cmp_stages <= 2 and p.tiles.win_stages <= 2
    assert p.features == Features(fa2=True)    # wheels installed (fake_gpu), but no FA-3, FA-4, PDL, TMA
    assert not fa3_cmp.enabled(CUDA0) and not fa4_win.enabled(CUDA0) and not decode.pdl_ok(CUDA0)
    assert triton_nsa.current_tiles(CUDA0) == p.tiles and dispatch.device_profile(CUDA0) == kind
    message = caplog.messages[0]
    assert f"GPU cuda:0 is {kind}" in message and "generic" in message
    assert f"add nsa/profiles/{kind}.py" in message and f"'{kind}:' block under 'profiles:'" in message


def test_features_need_the_capability_whatever_the_profile_declares(fake_gpu):
    """generic declares FA-2; a Turing card (7, 5) has no FA-2 kernels, and the FA-2 backends say why."""
    fake_gpu((7, 5))
    assert profiles.profile_for(CUDA0).features == Features()
    assert _fa2_common.unsupported_reason(_cuda_call("sliding", 64)) == \
        "FA-2 needs compute capability >= 8.0 (Ampere or later), got sm75"
    fake_gpu((8, 0))
    assert profiles.profile_for(CUDA0).features.fa2 and _fa2_common.unsupported_reason(_cuda_call("sliding", 64)) is None


def test_profiles_by_name():
    assert profiles.by_name("sm90").features.fa3   # as declared: no device, no wheel check
    assert profiles.by_name("sm61") == Profile("generic", "sm61", profiles.by_name("generic").tiles,
                                               profiles.by_name("generic").features)
    with pytest.raises(ValueError, match="profile must be 'cpu', 'generic' or 'sm<major><minor>', got 'h100'"):
        profiles.by_name("h100")
    with pytest.raises(ValueError, match="Features.fa3 must be a bool, got 1"):
        Features(fa3=1)
    with pytest.raises(TypeError, match="Profile 'x' needs a Tiles and a Features"):
        Profile("x", "x", {}, Features())


@pytest.fixture
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder whose `<name>.py` files count as nsa/profiles/<name>.py (removed at the end)."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    monkeypatch.setattr(profiles, "__path__", [*profiles.__path__, str(folder)])
    added: list[str] = []

    def add(name: str, text: str) -> None:
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
        added.append(f"nsa.profiles.{name}")

    yield add
    for module in added:
        __import__("sys").modules.pop(module, None)


def _config_with_block(tmp_path: Path, kind: str, block: str) -> Path:
    """configs/base.yaml with the `kind` block under `profiles:` replaced by `block` (or added)."""
    text = resources.default_config_path().read_text()
    text = re.sub(rf"^  {kind}:.*?(?=^  \S|\Z)", "", text, flags=re.M | re.S)
    path = tmp_path / "config.yaml"
    path.write_text(text.rstrip("\n") + "\n" + textwrap.indent(textwrap.dedent(block), "  "))
    return path


def test_a_new_gpu_kind_is_one_profile_file_and_one_yaml_block(fake_gpu, profile_dir, tmp_path, monkeypatch,
                                                               caplog):
    """A fake sm89 (Ada): nsa/profiles/sm89.py and a `sm89:` block, nothing else. Dispatch then
    reads its thresholds, the Triton kernels its tiles, and every feature check its features."""
    profile_dir("sm89", """
        from nsa.profiles import Features, Profile, Tiles

        PROFILE = Profile(name="sm89", thresholds="sm89", tiles=Tiles(sel_split=2, dec_chunk=64, win_stages=1),
                          features=Features(fa2=True, pdl=True, fa3=True, flex_max_head_dim=64))
    """)
    config = _config_with_block(tmp_path, "sm89", """
        sm89:
          fa2_min_len_win: -1
          fa2_min_len_cmp: -1
          triton_min_len_win: -1
          triton_min_len_cmp: -1
          triton_min_len_sel: {g1: 4096, g2: 777}
    """)
    monkeypatch.setenv("NSA_CONFIG", str(config))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake_gpu((8, 9))
    with caplog.at_level(logging.WARNING, logger="nsa.profiles"):
        p = profiles.profile_for(CUDA0)
    assert not caplog.messages
    assert (p.name, p.thresholds) == ("sm89", "sm89")
    # Thresholds: the block's value for this call's class (g2), through auto's choice.
    t = dispatch.thresholds(CUDA0)
    assert t.profile == "sm89" and t.lookup("triton_min_len_sel", "g2") == (777, "config.yaml:profiles.sm89.triton_min_len_sel.g2")
    assert dispatch.choose(_cuda_call("selected", 800)) == "triton"
    assert dispatch.choose(_cuda_call("selected", 700)) == "sdpa"
    assert dispatch.choose(_cuda_call("sliding", 8000)) == "sdpa"
    # Tiles: the file's, for the kernels on this device.
    tiles = triton_nsa.current_tiles(CUDA0)
    assert tiles is p.tiles and (tiles.sel_split, tiles.dec_chunk, tiles.launch("win")) == (2, 64, {"num_warps": 4, "num_stages": 1})
    # Features: what the file declares, less what sm89 cannot do (PDL needs sm90) or lacks (fa3 declared, fa4 not).
    assert p.features == Features(fa2=True, fa3=True, flex_max_head_dim=64)
    assert fa3_cmp.enabled(CUDA0) and not fa4_win.enabled(CUDA0) and not decode.pdl_ok(CUDA0)
    assert "head dims <= 64 on this GPU" in flex.unsupported_reason(_cuda_call("sliding", 64, d=96))
    assert _fa2_common.unsupported_reason(_cuda_call("sliding", 64)) is None


def test_a_profile_file_must_define_its_profile(fake_gpu, profile_dir):
    profile_dir("sm75", """
        from nsa.profiles import by_name
        PROFILE = by_name("sm90")
    """)
    fake_gpu((7, 5))
    with pytest.raises(TypeError, match=r"sm75.py must define PROFILE = Profile\(name='sm75', \.\.\.\)"):
        profiles.profile_for(CUDA0)
