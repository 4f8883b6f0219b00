from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, results, suites
from tests.ci import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--device", "cpu", "--warmup", "1", "--rep", "2"]


def test_list_prints_ids_without_importing_torch():
    code = ("import sys; from bench.cli import main; rc = main(['list', '--suites', 'all', '--size', 'nightly']);"
            "assert 'torch' not in sys.modules, 'list imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ids = [line for line in out.stdout.splitlines() if not line.startswith("#")]
    assert "fa2/sliding/sdpa/B1-T16384-Hq8-Hkv2-D64-w512-bf16" in ids
    assert len(ids) == sum(len(c.variants) for c in suites.cells(suites.SUITES, "nightly"))


def test_run_writes_one_valid_results_file(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["run", "--suites", "calibration", "--size", "smoke", "--backends", "sdpa", "--out", str(out), *FAST]
    assert cli.main(argv) == 0
    doc = results.load(out)
    assert doc["run"]["command"] == "python -m bench " + " ".join(argv)
    assert doc["run"]["method"]["rep"] == 2 and doc["run"]["size"] == "smoke"
    assert [c["params"]["replica"] for c in doc["cases"]] == ["A", "B"]
    assert "eta" in capsys.readouterr().err


def test_shards_partition_the_cells_and_merge_back(tmp_path):
    base = ["run", "--suites", "masked", "--size", "smoke", "--backends", "sdpa", *FAST]
    for i in range(2):
        assert cli.main([*base, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}.json")]) == 0
    assert cli.main(["merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"),
                     "--out", str(tmp_path / "all.json")]) == 0
    merged = results.load(tmp_path / "all.json")
    want = [c.case_id(v) for c in suites.cells(["masked"], "smoke", ["sdpa"]) for v in c.variants]
    assert sorted(c["id"] for c in merged["cases"]) == sorted(want)
    assert json.loads((tmp_path / "s1.json").read_text())["run"]["shard"] == "1/2"


def test_usage_errors_exit_2(capsys):
    assert cli.main(["list", "--suites", "nope"]) == cli.EXIT_USAGE
    assert "suite must be one of" in capsys.readouterr().err


def test_strip_options_for_shard_children():
    argv = ["run", "--out", "x.json", "--csv=d.csv", "--gpus", "4", "--size", "nightly"]
    assert cli._without(argv, ("--out", "--csv", "--gpus")) == ["run", "--size", "nightly"]


def test_bench_merge_leaves_no_temp_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import main as bench_main

    shard = results.dump(fx.document(fx.sweep("sliding", {1024: 2.0})), tmp_path / "shard0.json")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    # A full disk is an exit 2 with one line naming the file and the fix, not a traceback.
    assert bench_main(["merge", str(shard), "--out", str(tmp_path / "all.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: the disk must have room for {str(tmp_path / 'all.json')!r}") and "; free" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard0.json"]
