"""The playbook's commands still work as scripts from the repo root (tiny sizes, CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nsa_contract import results

ROOT = Path(__file__).resolve().parents[2]


def _script(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bench_fa2_win_and_cmp(tmp_path):
    for mode, extra in (("win", ["--w", "64"]), ("cmp", ["--l", "32", "--d", "16"])):
        out = tmp_path / f"{mode}.json"
        run = _script("bench/bench_fa2.py", "--mode", mode, "--heads", "8", "--dk", "64", "--dv", "64",
                      "--S_list", "96,160", *extra, "--iters", "2", "--warmup", "1", "--device", "cpu",
                      "--out", str(out))
        assert run.returncode == 0, run.stderr
        doc = results.load(out)
        assert [c["params"]["T"] for c in doc["cases"] if c["backend"] == "sdpa"] == [96, 160]
        assert all(c["params"]["Hkv"] == 8 for c in doc["cases"])
        assert "sdpa ms" in run.stdout


def test_bench_masked(tmp_path):
    out = tmp_path / "m.json"
    run = _script("bench/bench_masked.py", "--device", "cpu", "--iters", "2", "--warmup", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert {c["status"] for c in results.load(out)["cases"]} == {"ok"}


def test_bench_decode_csv_and_summary(tmp_path):
    out, csv_path = tmp_path / "d.json", tmp_path / "decode.csv"
    run = _script("bench/bench_decode.py", "--heads", "4", "--groups", "2", "--dk", "64", "--dv", "64",
                  "--S_list", "40,130", "--iters", "2", "--warmup", "1", "--csv", str(csv_path),
                  "--device", "cpu", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert csv_path.read_text().splitlines()[0].startswith("S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected")
    cases = results.load(out)["cases"]
    assert {c["params"]["Hkv"] for c in cases} == {2}
    assert sum(c["params"].get("part") == "attend" and c["status"] == "ok" for c in cases) == 2 * 4
    assert csv_path.read_text().splitlines()[0].endswith(",ms_attend,ms_attend_cmp,ms_attend_sel,ms_attend_win,"
                                                         "speedup_attend_vs_dense")
    summary = _script("bench/summarize_decode_csv.py", str(csv_path))
    assert summary.returncode == 0 and "2/2 rows match" in summary.stdout
    assert "dense/step ms" in summary.stdout and "dense/attend ms" in summary.stdout
    lines = csv_path.read_text().splitlines()
    fields = lines[1].split(",")
    fields[5] = str(int(fields[5]) + 1)  # reads_actual off by one -> a mismatch
    csv_path.write_text("\n".join([lines[0], ",".join(fields), *lines[2:]]) + "\n")
    bad = _script("bench/summarize_decode_csv.py", str(csv_path))
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout
    assert _script("bench/summarize_decode_csv.py", str(tmp_path / "none.csv")).returncode == 2


def test_bench_decode_target_knobs_reach_the_cells(tmp_path):
    out = tmp_path / "d.json"
    run = _script("bench/bench_decode.py", "--heads", "4", "--groups", "2", "--dk", "32", "--dv", "32",
                  "--S_list", "40", "--iters", "1", "--warmup", "0", "--nsa-backend", "triton", "--graph",
                  "--device", "cpu", "--out", str(out))
    assert run.returncode == 0, run.stderr
    cases = results.load(out)["cases"]
    assert {(c["params"]["nsa_backend"], c["params"]["graph"]) for c in cases} == {("triton", True)}
    assert all(c["status"] == "skipped" and "CUDA graph" in c["reason"] for c in cases)
