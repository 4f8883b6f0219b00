"""`python -m bench forward-ab`: variants and cells parse into what runs, bad input exits 2 before any GPU work.

The timing itself needs CUDA (run on the GPU machine; results/h100/selb-forced/ holds runs of it).
"""

from __future__ import annotations

import dataclasses

import pytest

from bench import forward_ab
from bench.cli import main as bench_main


@dataclasses.dataclass(frozen=True)
class FakeTiles:
    """A stand-in for `Tiles` with one field of each kind the parser types."""

    rows: int = 128
    stages: int | None = None
    forced: bool = True
    algo: str = "filter"


def test_variants_keep_their_order_and_type_each_field_like_the_base():
    out = forward_ab.variants(["base:", "b:rows=64,stages=2,forced=False,algo=argmax", "c:stages=None"], FakeTiles())
    assert list(out) == ["base", "b", "c"]
    assert out["base"] == FakeTiles()
    assert out["b"] == FakeTiles(rows=64, stages=2, forced=False, algo="argmax")
    assert out["c"] == FakeTiles(stages=None)


@pytest.mark.parametrize("specs, match", [
    (["a:rows=1", "a:rows=2"], "labels must differ"),
    ([":rows=1"], "LABEL:FIELD=VALUE"),
    (["a:nope=1"], "a Tiles field"),
    (["a:rows"], "NAME=VALUE"),
    (["a:forced=yes"], "True or False"),
    (["a:rows=wide"], "must be an int"),
])
def test_bad_variants_say_what_is_wrong(specs, match):
    with pytest.raises(ValueError, match=match):
        forward_ab.variants(specs, FakeTiles())


def test_cells_parse_with_dk_defaulting_to_128():
    assert forward_ab.parse_cell("65536/32/8") == (65536, 32, 8, 128)
    assert forward_ab.parse_cell("16384/64/4/192") == (16384, 64, 4, 192)
    for bad in ("64k/32/8", "1024/32", "1024/32/8/128/1", "1024/30/8", "0/8/8"):
        with pytest.raises(ValueError, match="T/HQ/HKV"):
            forward_ab.parse_cell(bad)


def test_cli_refuses_a_bad_cell_and_a_machine_without_cuda(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ab.json"
    assert bench_main(["forward-ab", "--out", str(out), "--variant", "a:", "1024/32"]) == 2
    assert "T/HQ/HKV" in capsys.readouterr().err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["forward-ab", "--out", str(out), "--variant", "a:", "1024/32/8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.exists()
