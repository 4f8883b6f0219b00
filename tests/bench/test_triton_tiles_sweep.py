"""bench/triton_tiles.py: every swept variant is a valid `Tiles`; without CUDA it says so and exits 2."""

from __future__ import annotations

import dataclasses

import pytest

from bench import triton_tiles
from nsa.backends.triton_kernels.tiles import tiles
from tests.nsa.helpers import DEV


@pytest.mark.parametrize("kind", ["cmp", "sel", "dec", "win"])
def test_every_variant_is_a_valid_tiles_of_the_base_profile(kind):
    variants = triton_tiles._variants()[kind]
    assert variants
    for var in variants:
        assert dataclasses.replace(tiles("sm90"), **var) is not None


@pytest.mark.skipif(DEV == "cuda", reason="checks the no-CUDA exit")
def test_sweep_needs_cuda(capsys):
    assert triton_tiles.main(["--T", "128"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
