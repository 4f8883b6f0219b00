"""Launch parameters per GPU profile and the facade's input checks (no kernel runs here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa import profiles
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels.tiles import Tiles, current, tiles, use_tiles
from nsa.profiles.tiles import FAMILIES, FIELDS, DecodeTiles, WindowTiles


def test_tiles_by_profile_name_and_unknown_gpus_get_generic():
    assert tiles("sm90") == Tiles(cmp_rows=64, cmp_bc=32, cmp_warps=4, cmp_stages=3, sel_warps=2, sel_stages=2,
                                  split_tiles=8, split_warps=1, sel_split=4)
    assert tiles("sm80") is tiles("generic") and tiles("generic") != tiles("sm90")
    assert tiles("cpu").cmp_rows == 16 and tiles("cpu").win_bn == 16
    with pytest.raises(ValueError, match="profile must be 'cpu', 'generic' or 'sm<major><minor>'"):
        tiles("h100")


def test_current_follows_the_device_profile_and_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(profiles, "_capability", lambda index: {0: (9, 0), 1: (10, 0)}[index])
    profiles.cache_clear()
    try:
        assert current("cpu") is tiles("cpu")
        assert current(torch.device("cuda", 0)) is tiles("sm90")
        assert current(torch.device("cuda", 1)) == tiles("generic")
        # The interpreter runs on the CPU whatever the tensors' device: the small CPU tiles.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert current(torch.device("cuda", 0)) is tiles("cpu")
    finally:
        profiles.cache_clear()


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
    ({"dec_stages": 0}, "DecodeTiles.dec_stages must be an int >= 1"),
    ({"trn_bm": 32.0}, "TrainTiles.trn_bm must be an int >= 1"),
    ({"selb_part_fp32": None}, "BlockTiles.selb_part_fp32 must be a bool"),
])
def test_tiles_reject_values_the_kernels_cannot_take(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(Tiles(), **changes)


def test_tiles_are_families_read_and_replaced_by_flat_names():
    base = Tiles()
    changed = dataclasses.replace(base, dec_chunk=64, sel_split=2)
    assert changed.decode.dec_chunk == changed.dec_chunk == 64 and changed.selection.sel_split == 2
    assert changed.window is base.window and changed != base
    back = dataclasses.replace(changed, dec_chunk=128, sel_split=4)
    assert back == base and hash(back) == hash(base) and len({base, back, changed}) == 2
    assert set(base.flat()) == set(FIELDS) and set(FIELDS.values()) == set(FAMILIES)
    assert all(f.name in FAMILIES for f in dataclasses.fields(Tiles))
    with pytest.raises(TypeError, match="Tiles has no field 'dec_chnk'"):
        dataclasses.replace(base, dec_chnk=64)
    with pytest.raises(TypeError, match="Tiles.decode must be a DecodeTiles, got WindowTiles"):
        Tiles(decode=WindowTiles())
    with pytest.raises(ValueError, match="DecodeTiles.dec_chunk must be >= 16"):
        DecodeTiles(dec_chunk=8)


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
