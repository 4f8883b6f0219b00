"""The train suite: its case ids per size, and its smoke cells run end to end on a CPU through the
one runner (dense SDPA and masked-SDPA NSA timed; Triton, cuDNN, FA-2 skipped with the reason)."""

from __future__ import annotations

import pytest
import torch

from bench import cli, runner, suites
from bench.cases import SIZES
from bench.suites import train
from bench.timing import Timer
from nsa_contract import results

TINY = Timer(warmup=1, rep=2, l2_flush=False)
PAPER = {"B": 1, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128, "block": 32, "stride": 16, "sel_block": 64,
         "sel_count": 16, "window": 512}
OPS = {"all": "nsa_train", "win": "sliding", "cmp": "compressed", "sel": "selected"}
SMOKE_SHAPE = "B1-T300-Hq8-Hkv2-D32-w512-l32-d16-ls64-n16-kvseparate"


def _ids(size: str) -> list[str]:
    return [c.case_id(v) for c in suites.cells(["train"], size) for v in c.variants]


def test_smoke_ids_are_every_variant_of_every_part():
    want = []
    for part, variants in (("all", ("autoplan", "triton", "sdpa")), ("win", ("triton", "torch_fa2", "sdpa")),
                           ("cmp", ("triton", "sdpa")), ("sel", ("triton", "sdpa"))):
        want += [f"train/dense/{b}/{SMOKE_SHAPE}-part{part}-bf16" for b in ("sdpa_flash", "sdpa_cudnn", "flash_attn")]
        want += [f"train/{OPS[part]}/{b}/{SMOKE_SHAPE}-part{part}-bf16" for b in variants]
    assert _ids("smoke") == want


@pytest.mark.parametrize("size", SIZES)
def test_every_size_has_unique_ids_for_the_whole_attention_and_each_branch(size):
    cells = suites.cells(["train"], size)
    ids = _ids(size)
    assert len(ids) == len(set(ids)) and all(i.startswith("train/") for i in ids)
    assert {c.params["part"] for c in cells} == set(OPS)
    assert all(OPS[c.params["part"]] == c.op and c.params["dtype"] == "bf16" for c in cells)
    for c in cells:
        backends = [v.backend for v in c.variants]
        assert backends[:3] == ["sdpa_flash", "sdpa_cudnn", "flash_attn"] and c.variants[0].role == "baseline"
        assert "triton" in backends and all(v.op == "dense" for v in c.variants[:3])
        assert ("torch_fa2" in backends) == (c.op == "sliding")


def test_nightly_and_full_grids():
    def grid(size: str, part: str) -> set[tuple]:
        return {(c.params["T"], c.params["Hq"], c.params["Hkv"]) for c in suites.cells(["train"], size)
                if c.params["part"] == part}

    assert all(PAPER.items() <= c.params.items() for c in suites.cells(["train"], "nightly"))
    for part in OPS:
        assert grid("nightly", part) == {(16384, 64, 4), (65536, 64, 4)}
        paper = {(t, 64, 4) for t in (8192, 16384, 32768, 65536)}
        assert grid("full", part) == (paper | {(65536, 16, 16), (65536, 32, 8)} if part == "all" else paper)
    assert "train/nsa_train/triton/B1-T65536-Hq64-Hkv4-D128-w512-l32-d16-ls64-n16-kvseparate-partall-bf16" \
        in _ids("nightly")


def test_cli_lists_the_nightly_ids(capsys):
    assert cli.main(["list", "--suites", "train", "--size", "nightly"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if not line.startswith("#")] == _ids("nightly")


def test_smoke_runs_on_a_cpu_end_to_end():
    opts = runner.RunOptions(device="cpu", timer=TINY)
    cases = runner.run_cells(list(enumerate(suites.cells(["train"], "smoke"))), opts)
    doc = results.check(runner.document(cases, opts, command="test", git_sha="unknown", machine={
        **{k: None for k in results.MACHINE_FIELDS}, "sm": "cpu", "gpu_name": "cpu"}))
    by = {(c["params"]["part"], c["requested_backend"]): c for c in doc["cases"]}
    assert [c["id"] for c in doc["cases"]] == _ids("smoke")
    for part in OPS:
        for name in ("sdpa_flash", "sdpa"):
            case = by[(part, name)]
            assert case["status"] == "ok", case["reason"]
            assert len(case["timing"]["samples_ms"]) == 2 and "peak_mem_bytes" not in case
        assert by[(part, "sdpa_flash")]["gqa"] == "native (enable_gqa=True)"
        assert by[(part, "triton")]["status"] == "skipped" and by[(part, "triton")]["reason"] == train.CPU_TRITON
        assert by[(part, "sdpa_cudnn")]["status"] == "skipped" and by[(part, "sdpa_cudnn")]["reason"]
        assert by[(part, "flash_attn")]["status"] == "skipped" and by[(part, "flash_attn")]["reason"]
    assert by[("win", "torch_fa2")]["status"] == "skipped" and "CUDA" in by[("win", "torch_fa2")]["reason"]
    nsa = by[("all", "sdpa")]
    assert nsa["op"] == "nsa_train" and nsa["backend"] == "sdpa"
    assert nsa["branch_backends"] == {"cmp": "sdpa", "sel": "sdpa", "win": "sdpa"} and nsa["plan"].endswith("grad")
    auto = by[("all", "autoplan")]   # what a user gets; on a CPU auto plans masked SDPA
    assert auto["status"] == "ok" and auto["plan"] == nsa["plan"], auto.get("reason")


@pytest.mark.parametrize("part", OPS)
def test_a_step_returns_the_gradient_of_every_input_and_leaves_no_grad(part):
    cell = next(c for c in suites.cells(["train"], "smoke", ["sdpa"]) if c.params["part"] == part)
    p = cell.params
    q, kv = (1, 300, p["Hq"], p["Dk"]), (1, 300, p["Hkv"], p["Dk"])
    tc = (300 - p["block"]) // p["stride"] + 1
    want = {"all": [q, *[kv] * 6, (1, 300, p["Hq"], 3)], "win": [q, kv, kv], "sel": [q, kv, kv],
            "cmp": [q, (1, tc, p["Hkv"], p["Dk"]), (1, tc, p["Hkv"], p["Dv"])]}[part]
    step = train.build(cell, torch.device("cpu")).fns["sdpa"]
    grads, again = step(), step()
    assert [tuple(g.shape) for g in grads] == want
    for g, g2 in zip(grads, again, strict=True):
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        # A fresh gradient every call: nothing accumulates between repeats.
        assert torch.equal(g, g2) and g.grad_fn is None


def test_train_step_is_the_gradient_against_grad_out():
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5)
    (g,) = train.train_step(lambda: x.sin() * 3, [x], w)()
    torch.testing.assert_close(g, 3 * x.detach().cos() * w)
    assert x.grad is None
