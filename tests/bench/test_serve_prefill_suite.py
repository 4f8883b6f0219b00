"""The serve_prefill suite: packed against separate prefills, chunked against one prefill, on a CPU."""

from __future__ import annotations

import pytest

from bench import results, runner, suites
from bench.suites import serve_prefill as serving
from bench.timing import Timer

TINY = Timer(warmup=1, rep=2, l2_flush=False)


def test_grids_hold_the_issue_targets():
    full = suites.cells(["serve_prefill"], "full")
    packed = [c for c in full if "N" in c.params]
    chunked = [c for c in full if "C" in c.params]
    assert any(c.params["T"] == 65536 and c.params["N"] == 8 for c in packed)
    assert any(c.params["T"] == 65536 and c.params["C"] == 8192 for c in chunked)
    for c in full:
        assert c.op == "nsa_prefill" and [v.role for v in c.variants] == ["baseline", "candidate"]
        assert c.params["Hq"] == 64 and c.params["Hkv"] == 4 and c.params["dim"] == 2560


@pytest.mark.parametrize("n", [1, 3, 8])
def test_pack_lengths_are_unequal_and_add_up(n):
    for total in range(n, 300):
        sizes = serving.lengths(total, n)
        assert len(sizes) == n and sum(sizes) == total and min(sizes) >= 1, (total, sizes)
        assert n < 3 or total < 2 * n or len(set(sizes)) > 1, (total, sizes)
    assert serving.lengths(65536, 8) == [1821, 10922, 5461, 14562, 9102, 3641, 12742, 7285]
    with pytest.raises(ValueError, match="a pack needs 1 <= N <= T"):
        serving.lengths(n - 1, n)


def test_smoke_cells_run_on_cpu_and_record_what_ran():
    cells = suites.cells(["serve_prefill"], "smoke")
    opts = runner.RunOptions(device="cpu", timer=TINY)
    cases = runner.run_cells(list(enumerate(cells)), opts)
    doc = runner.document(cases, opts, command="test", git_sha="unknown",
                          machine={**{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"})
    results.check(doc)
    by = {c["params"]["mode"]: c for c in doc["cases"]}
    assert set(by) == {"separate", "packed", "whole", "chunked"}
    for mode, case in by.items():
        assert case["status"] == "ok", case["reason"]
        assert case["backend"] == "sdpa" and case["plans"] == ["cmp=sdpa sel=sdpa win=sdpa scores=torch"]
        assert case["id"].startswith("serve_prefill/nsa_prefill/sdpa/") and f"mode{mode}" in case["id"]
    assert by["packed"]["lengths"] == by["separate"]["lengths"] == serving.lengths(200, 8)
    # The same layer on the same tokens (bf16): the two sides differ by rounding only.
    assert 0 <= by["packed"]["max_abs_diff_vs_baseline"] < 0.05
    assert 0 <= by["chunked"]["max_abs_diff_vs_baseline"] < 0.05
