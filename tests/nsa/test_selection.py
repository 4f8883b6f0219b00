"""nsa.selection pieces: the banded block mapping against the dense overlap map."""

from __future__ import annotations

import pytest
import torch

from nsa.selection import block_scores, overlap_bands, overlap_weights


@pytest.mark.parametrize("block, stride, sel_block, n_cmp, n_blocks", [
    (32, 16, 64, 50, 14),   # paper shapes; the last blocks see no compressed token
    (8, 4, 16, 3, 2),
    (8, 8, 8, 9, 9),        # d = l: blocks do not overlap each other
    (12, 4, 16, 20, 7),     # l not a multiple of l'
    (5, 3, 16, 30, 6),      # d divides neither l nor l'
    (7, 2, 3, 40, 30),      # l' < l: one compressed token spans several blocks
    (32, 16, 64, 0, 1),     # no compressed token yet
])
def test_banded_block_scores_equal_the_dense_overlap_map(block, stride, sel_block, n_cmp, n_blocks, seed):
    p = torch.rand(2, 3, 5, n_cmp, dtype=torch.float64)
    dense = p @ overlap_weights(n_cmp, n_blocks, block, stride, sel_block, "cpu", torch.float64)
    banded = block_scores(p, overlap_bands(n_cmp, n_blocks, block, stride, sel_block, "cpu", torch.float64))
    assert banded.shape == dense.shape == (2, 3, 5, n_blocks)
    torch.testing.assert_close(banded, dense, rtol=1e-12, atol=1e-12)
