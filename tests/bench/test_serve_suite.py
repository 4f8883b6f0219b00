"""bench.suites.serve on a CPU (Triton's interpreter): the smoke cell builds, its paged and
contiguous steps agree (the build checks it), the GPU-only variants are skipped with a reason,
and the ragged lengths are drawn as declared."""

from __future__ import annotations

import pytest
import torch

from bench.cases import expand
from bench.suites import serve
from nsa.backends import triton_nsa


def test_ragged_lengths_are_drawn_in_range_and_repeatable():
    p = {"B": 32, "ragged": (4096, 65536, 0)}
    lens = serve.lengths(p)
    assert len(lens) == 32 and all(4096 <= n <= 65536 for n in lens) and lens == serve.lengths(p)
    assert len(set(lens)) > 16
    assert serve.lengths({"B": 3, "T": 7}) == [7, 7, 7]


@pytest.mark.slow
@pytest.mark.skipif(triton_nsa.unavailable_reason("cpu") is not None, reason="needs TRITON_INTERPRET=1")
def test_smoke_cell_builds_and_runs_on_cpu():
    torch.set_num_threads(1)
    (cell,) = expand("serve", serve.SPECS, "smoke")
    work = serve.build(cell, torch.device("cpu"))
    assert not work.failures, work.failures
    assert set(work.reasons) == {"contig_graph", "paged_graph", "dense_cudnn", "paged_even_graph", "paged_step",
                                 "dense_fa3_paged", "dense_fa3"}
    assert "CUDA" in work.reasons["paged_step"] and "fa3" in work.reasons["dense_fa3"].lower()
    for key in ("paged_eager", "contig_eager"):
        work.setups[key]()
        out = work.fns[key]()
        assert out.shape == (3, 1, 256) and torch.isfinite(out.float()).all()
