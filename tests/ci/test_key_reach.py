"""A decision key declared once, in nsa_contract/keys.py, reaches the loader, dispatch, decide, report, the PR
edit and the bench CLI with no other change than its value in configs/base.yaml: a new key for a
backend that exists is those 2 files (DESIGN.md, "Where a change goes").

The test copies the packages and the config into a temporary folder, declares one new key there
(`flex_min_len_win`: the sliding branch on FlexAttention, a new family) plus its value -1 in the
copy's config, and runs every stage in subprocesses with the copy first on `sys.path`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_contract import results
from tests.ci import fixtures as fx

REPO = Path(__file__).resolve().parents[2]
COPIED = ("nsa_contract", "nsa", "ci", "bench", "templates", "configs")
KEY, DECISION_ID, FLAG = "flex_min_len_win", "flex_win", "--flex-min-len-win"
DECLARATION = (f'    DecisionKey("{KEY}", "win", "flex", "flex", ("flex",), "flex", "{DECISION_ID}", NIGHTLY_T),\n')


def _insert_after(text: str, anchor: str, addition: str) -> str:
    assert text.count(anchor) >= 1, f"the copy must hold {anchor!r} to extend it"
    at = text.index(anchor) + len(anchor)
    return text[:at] + addition + text[at:]


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keyreach")
    for name in COPIED:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")  # marks a checkout (nsa_contract.resources)
    keys_py = root / "nsa_contract" / "keys.py"
    text = keys_py.read_text(encoding="utf-8")
    # The one place: a key in KEYS, and (a new family) its label beside the others.
    text = text.replace('FAMILY_LABELS = {"fa2": "FA-2", "triton": "Triton"}',
                        'FAMILY_LABELS = {"fa2": "FA-2", "triton": "Triton", "flex": "FlexAttention"}')
    line_end = text.index("\n", text.index("KEYS: tuple[DecisionKey, ...] = (")) + 1
    keys_py.write_text(text[:line_end] + DECLARATION + text[line_end:], encoding="utf-8")
    config = root / "configs" / "base.yaml"
    cfg = fx.pristine_config_text()
    cfg = _insert_after(cfg, "\nruntime:\n", f"  {KEY}: -1\n")
    cfg = _insert_after(cfg, "  sm90:   # Hopper: H100, H200\n", f"    {KEY}: -1\n")
    config.write_text(cfg, encoding="utf-8")
    # FlexAttention wins from 2048 in class g4 (suite flex: the key's own suite).
    cases = fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048, candidate="flex", suite="flex")
    results.dump(fx.document(cases), root / "results.json")
    return root


def _run(copy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    env.pop("NSA_CONFIG", None)
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=300)


def test_the_copy_declares_the_key_once_and_only_there(copy: Path) -> None:
    code = (f"import nsa_contract.keys as k, nsa_contract.settings as s; assert k.__file__.startswith({str(copy)!r}), k.__file__; "
            f"print(k.get({KEY!r}).flag, s.load().value({KEY!r}, 'sm90', 'g4'))")
    proc = _run(copy, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == FLAG and "-1" in proc.stdout


def test_dispatch_knows_the_key(copy: Path) -> None:
    code = (f"import nsa.dispatch as d; assert {KEY!r} in d.THRESHOLD_KEYS, d.THRESHOLD_KEYS; "
            f"print(d.describe('cpu')['keys'][{KEY!r}]['g4'])")
    proc = _run(copy, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "'value': -1" in proc.stdout


def test_decide_report_and_pr_carry_the_key(copy: Path) -> None:
    out = copy / "out"
    proc = _run(copy, "-m", "ci", "decide", "--results", "results.json", "--config", "configs/base.yaml",
                "--out", str(out / "decision.json"))
    assert proc.returncode == 0, proc.stderr
    assert f"{DECISION_ID} sm90.{KEY}: -1 -> {{g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}}" in proc.stdout
    doc = json.loads((out / "decision.json").read_text(encoding="utf-8"))
    branch = doc["branches"][DECISION_ID]
    assert (branch["key"], branch["family"], branch["classes"]["g4"]["proposed"]) == (KEY, "flex", 2048)
    assert KEY in [k["name"] for k in doc["keys"]] and doc["flex"] == {"ran": True, "reason": ""}
    proc = _run(copy, "-m", "ci", "report", "--decision", str(out / "decision.json"), "--out-dir", str(out / "rep"))
    assert proc.returncode == 0, proc.stderr
    text = (out / "rep" / "report.md").read_text(encoding="utf-8")
    assert f"## Branch {DECISION_ID} (sliding, `{KEY}`)" in text and f"| {DECISION_ID} | `{KEY}` |" in text
    assert (out / "rep" / f"speedup_{DECISION_ID}.png").is_file()
    # `ci pr` takes only a decision that `ci history` rewrote; K = 1 lets this one run's change last.
    one_run = out / "k1.yaml"
    one_run.write_text((copy / "configs" / "base.yaml").read_text(encoding="utf-8").replace(
        "history_runs: 3 ", "history_runs: 1 "), encoding="utf-8")
    proc = _run(copy, "-m", "ci", "history", "--results", "results.json", "--decision", str(out / "decision.json"),
                "--config", str(one_run), "--history-dir", str(out / "store"), "--out-dir", str(out / "hist"),
                "--dry-run")
    assert proc.returncode == 0, proc.stderr
    proc = _run(copy, "-m", "ci", "pr", "--decision", str(out / "decision.json"), "--report-dir", str(out / "rep"),
                "--config", "configs/base.yaml", "--out-dir", str(out / "pr"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    diff = (out / "pr" / "config.diff").read_text(encoding="utf-8")
    assert f"+    {KEY}: {{g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}}" in diff.splitlines()


def test_bench_run_offers_the_key_as_a_flag(copy: Path) -> None:
    proc = _run(copy, "-m", "bench", "run", "--help")
    assert proc.returncode == 0, proc.stderr
    assert FLAG in proc.stdout
