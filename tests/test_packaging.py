"""An installed package carries its defaults (hardening issue, item 9).

`pip install .` must ship configs/base.yaml and templates/*.j2 (as nsa/_data/), and
`nsa.resources` must find them when the package runs outside a checkout; in a checkout it finds
the checkout's own files. The wheel test builds from a copy of the tracked files, installs the
wheel with `--no-deps --target` (no download, no torch) and runs `ci decide` and `ci report` from
another folder with only that copy importable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import results
from nsa import resources
from tests.ci import fixtures as fx

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_uses_its_own_files() -> None:
    assert resources.default_config_path() == REPO / "configs" / "base.yaml"
    assert resources.templates_dir() == REPO / "templates"


def test_resources_fall_back_to_the_packaged_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "nsa" / "_data"
    (data / "templates").mkdir(parents=True)
    (data / "base.yaml").write_text("x: 1\n")
    (data / "templates" / "report.md.j2").write_text("r")
    monkeypatch.setattr(resources, "CHECKOUT", tmp_path)  # no pyproject.toml: not a checkout
    monkeypatch.setattr(resources, "DATA", data)
    assert resources.default_config_path() == data / "base.yaml"
    assert resources.templates_dir() == data / "templates"
    (data / "base.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="reinstall the package or set NSA_CONFIG"):
        resources.default_config_path()


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    for extra in ("setup.py", "MANIFEST.in", "nsa/resources.py"):  # also before they are committed
        shutil.copy2(REPO / extra, dest / extra)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _tracked_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(out.glob("nsa_bench-*.whl"))


def test_the_wheel_carries_the_config_and_templates(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert zf.read("nsa/_data/base.yaml") == (REPO / "configs" / "base.yaml").read_bytes()
        for template in (REPO / "templates").glob("*.j2"):
            assert zf.read(f"nsa/_data/templates/{template.name}") == template.read_bytes()
    assert "nsa/resources.py" in names and "ci/__main__.py" in names


def test_an_installed_package_decides_and_reports_from_another_folder(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    results.dump(fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0})), work / "results.json")
    # The installed copy, not this checkout (nor the editable install of the venv), must answer.
    env = {**os.environ, "PYTHONPATH": str(site), "NSA_CONFIG": ""}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=300)

    where = run("-c", "import ci, nsa.resources as r; print(ci.__file__); print(r.default_config_path()); "
                      "print(r.templates_dir())")
    assert where.returncode == 0, where.stderr
    lines = where.stdout.split()
    assert all(line.startswith(str(site)) for line in lines), lines
    # Dispatch reads the packaged defaults through the one loader (torch's CPU build is installed
    # here; NSA_PROFILE keeps the call off CUDA queries).
    thresholds = run("-c", "import os; os.environ['NSA_PROFILE'] = 'sm90'; from nsa import dispatch, settings; "
                           "print(settings.default_path()); t = dispatch.thresholds(); "
                           "print(t.lookup('triton_min_len_sel', 'g16'))")
    assert thresholds.returncode == 0, thresholds.stderr
    path_line, value_line = thresholds.stdout.strip().splitlines()[-2:]
    assert path_line.startswith(str(site)) and "base.yaml:profiles.sm90.triton_min_len_sel" in value_line
    decided = run("-m", "ci", "decide", "--results", "results.json", "--out", "decision.json")
    assert decided.returncode == 0, decided.stderr
    assert json.loads((work / "decision.json").read_text())["schema"] == "nsa-decision/2"
    reported = run("-m", "ci", "report", "--decision", "decision.json", "--out-dir", "report")
    assert reported.returncode == 0, reported.stderr
    assert (work / "report" / "report.md").is_file()
