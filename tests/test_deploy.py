"""deploy/gpu-runner.sh between two jobs: what one job leaves must not reach the next."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "gpu-runner.sh"


def _exe(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body, encoding="utf-8")
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which("bash") is None or os.name != "posix", reason="needs bash")
def test_the_caches_under_home_are_wiped_between_jobs(tmp_path: Path) -> None:
    """Issue 34, item 6: the script removed `_work` only; `~/.triton` and `~/.cache/pip` of one job
    survived into the next, contrary to docs/workflows.md. One job runs (writing both), then the second
    registration fails and the script stops: by then every cache of the job is gone."""
    runner, home, bin_dir = tmp_path / "runner", tmp_path / "home", tmp_path / "bin"
    for d in (runner, home, bin_dir):
        d.mkdir()
    token_file = tmp_path / "admin-token"
    token_file.write_text("ghp_admin\n", encoding="utf-8")
    # config.sh registers once, then fails (the script exits under set -e); run.sh is the job.
    _exe(runner / "config.sh", 'if [ -e .registered ]; then exit 7; fi; touch .registered\n')
    _exe(runner / "run.sh", 'mkdir -p _work/repo "$HOME/.triton/cache" "$HOME/.cache/pip" "$HOME/.nv/ComputeCache"\n'
                            'touch _work/repo/f "$HOME/.triton/cache/kernel.so" "$HOME/.cache/pip/wheel"\n'
                            'touch "$HOME/.nv/ComputeCache/jit" "$HOME/keep"\n')
    _exe(bin_dir / "curl", 'cat >/dev/null; echo \'{"token": "reg"}\'\n')
    _exe(bin_dir / "sleep", "exit 0\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "NSA_RUNNER_ORG": "org",
           "NSA_RUNNER_GROUP": "nsa-gpu", "NSA_RUNNER_LABELS": "gpu,sm90",
           "NSA_RUNNER_ADMIN_TOKEN_FILE": str(token_file)}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=runner, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr  # the second registration's failure ends the loop
    assert (runner / ".registered").exists() and (home / "keep").exists()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if any(part in ("_work", ".triton", ".cache", "ComputeCache") for part in p.parts))
    assert left == [], f"a job's files survived into the next registration: {left}"
