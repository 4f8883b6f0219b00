"""Launch parameters per GPU profile and the facade's input checks (no kernel runs here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa.backends import triton_nsa
from nsa.backends.triton_kernels import tiles as tiles_mod
from nsa.backends.triton_kernels.tiles import PROFILES, Tiles, current, profile_for, tiles, use_tiles


def test_profiles_sm90_is_the_swept_h100_table_and_unknown_gpus_get_default():
    assert tiles("sm90") == Tiles(cmp_rows=64, cmp_bc=32, cmp_warps=4, cmp_stages=3, sel_warps=2, sel_stages=2,
                                  split_tiles=8, split_warps=1, sel_split=4)
    assert tiles("sm80") is PROFILES["default"]
    assert tiles("cpu").cmp_rows == 16 and tiles("cpu").win_bn == 16
    with pytest.raises(ValueError, match="profile must be one of"):
        tiles("h100")


def test_profile_for_reads_the_device_capability(monkeypatch):
    assert profile_for("cpu") == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tiles_mod, "_capability", lambda dev: (9, 0))
    assert profile_for(torch.device("cuda", 0)) == "sm90"
    monkeypatch.setattr(tiles_mod, "_capability", lambda dev: (10, 0))
    assert profile_for(torch.device("cuda", 1)) == "sm100"
    assert current(torch.device("cuda", 1)) is PROFILES["default"]
    # The interpreter runs on the CPU whatever the tensors' device: the small CPU tiles.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert profile_for(torch.device("cuda", 0)) == "cpu"


def test_use_tiles_scopes_an_override_and_nests():
    base = current("cpu")
    one, two = dataclasses.replace(base, sel_split=2), dataclasses.replace(base, sel_split=8)
    with use_tiles(one):
        assert current("cpu") is one
        with use_tiles(two):
            assert current("cpu") is two
        assert current("cpu") is one
    assert current("cpu") is base
    with pytest.raises(TypeError, match="use_tiles must get a Tiles"):
        with use_tiles({"sel_split": 2}):
            pass


@pytest.mark.parametrize("changes, match", [
    ({"cmp_rows": 48}, "cmp_rows must be a power of two"),
    ({"win_bn": 8}, "win_bn must be >= 16"),
    ({"sel_warps": 0}, "sel_warps must be an int >= 1"),
    ({"topn_split_rows": -1}, "topn_split_rows must be an int >= 0"),
    ({"score_carry": 1}, "score_carry must be a bool"),
    ({"cmp_lse": "yes"}, "cmp_lse must be a bool"),
    ({"win_beside": 0}, "win_beside must be a bool"),
    ({"scr_bk": 8}, "scr_bk must be >= 16"),
    ({"lse_rows": 96}, "lse_rows must be a power of two"),
    ({"topn_algo": "sort"}, r"topn_algo must be one of \('argmax', 'filter'\)"),
    ({"dtop_algo": None}, "dtop_algo must be one of"),
    ({"topn_cap": 24}, "topn_cap must be a power of two"),
    ({"topn_nchunk": 100}, "topn_nchunk must be a power of two"),
    ({"topn_ctas": 0}, "topn_ctas must be an int >= 1"),
    ({"topn_lane_chunks": 48}, "topn_lane_chunks must be a power of two"),
    ({"topn_maxnreg": 8}, r"topn_maxnreg must be 0 \(no cap\) or 16..255"),
    ({"topn_maxnreg": 256}, "topn_maxnreg must be 0"),
])
def test_tiles_reject_values_the_kernels_cannot_take(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(Tiles(), **changes)


def test_tiles_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tiles().sel_split = 2
    assert Tiles(cmp_stages=None).launch("cmp") == {"num_warps": 4}
    assert Tiles().launch("win") == {"num_warps": 4, "num_stages": 3}


@pytest.mark.skipif(triton_nsa.unavailable_reason("cpu") is not None, reason="triton backend unavailable on CPU")
def test_facade_says_what_is_wrong_with_the_inputs():
    q, k, v = torch.randn(1, 5, 6, 16), torch.randn(1, 5, 4, 16), torch.randn(1, 5, 4, 8)
    with pytest.raises(ValueError, match="query heads must be a multiple of key/value heads"):
        triton_nsa.compressed_and_scores(q, k, v, block=8, stride=4, sel_block=16, scale=0.25)
    with pytest.raises(ValueError, match=r"must be \[B, T, H, D\] tensors"):
        triton_nsa.sliding_decode(q[0], k, v, t=4, scale=0.25)
    with pytest.raises(ValueError, match="sliding_decode's block must be a power of two"):
        triton_nsa.sliding_decode(q[:, :1, :4], k, v, t=4, scale=0.25, block=24)
    with pytest.raises(ValueError, match="scores must be a"):
        triton_nsa.topn(torch.zeros(1, 5, 4, 3, dtype=torch.float16), 0, sel_block=16, sel_count=2)
