"""An installed package carries its defaults (hardening issue, item 9), and the two installs (issue 34,
items 4 and 12).

`pip install .` must ship configs/base.yaml and templates/*.j2 (as nsa_contract/_data/), and
`nsa_contract.resources` must find them when the package runs outside a checkout; in a checkout it finds
the checkout's own files. Every `ci` stage reads that default (or $NSA_CONFIG, or --config) from
any folder.

Two installs, each tested in a fresh venv outside the checkout, run from another folder:
- the library, `pip install .`: the wheel carries `nsa` and the contract it stands on,
  `nsa_contract` (no top-level `bench` or `ci`), and requires only torch and PyYAML;
- the pipeline, `pip install -e ".[pipeline]"` (what `make setup` does, with `dev`): the checkout's
  `nsa`, `bench` and `ci`, so that `python -m ci pipeline` runs from anywhere.
Both wheels are built from a copy of the tracked files with the venv's setuptools (no build
isolation, no download) and installed with `--no-deps`; the fresh venv then sees this venv's
site-packages through a .pth line (torch and the rest without a download), which adds those
folders to sys.path but runs none of their .pth files: this venv's editable install of the
checkout stays out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from nsa_contract import resources, results, settings
from tests.ci import fixtures as fx

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_uses_its_own_files() -> None:
    assert resources.default_config_path() == REPO / "configs" / "base.yaml"
    assert resources.templates_dir() == REPO / "templates"


def test_resources_fall_back_to_the_packaged_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "nsa_contract" / "_data"
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


def _config_with(folder: Path, **decide: object) -> Path:
    """configs/base.yaml with the given `decide.*` values replaced, written to folder/mine.yaml."""
    text = (REPO / "configs" / "base.yaml").read_text(encoding="utf-8")
    for key, value in decide.items():
        text, n = re.subn(rf"^(  {key}: )\S+", rf"\g<1>{value}", text, count=1, flags=re.M)
        assert n == 1, key
    path = folder / "mine.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder outside the checkout, the working directory, with one results file; no token, no NSA_*."""
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "NSA_PR_DRY_RUN", "GITHUB_OUTPUT", "NSA_HISTORY_DIR", "NSA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "elsewhere"
    work.mkdir()
    results.dump(fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0})), work / "results.json")
    monkeypatch.chdir(work)
    return work


def _pipeline(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    from ci.__main__ import main

    rc = main(["pipeline", "--results", "results.json", "--dry-run", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    for stage in ("decide", "history", "report", "pr"):
        assert re.search(rf"^  {stage} +ok ", captured.out, re.M), captured.out
    return json.loads(Path("out/decision.json").read_text(encoding="utf-8"))


def test_every_stage_reads_the_default_config_from_another_folder(elsewhere: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # `ci history` used to read the relative path configs/base.yaml: exit 2 outside the checkout's root.
    doc = _pipeline(capsys)
    live = settings.load(REPO / "configs" / "base.yaml").decide
    assert doc["margin"] == live["margin"] and doc["history"]["k"] == live["history_runs"]


def test_nsa_config_is_the_config_of_every_stage_and_config_wins_over_it(
        elsewhere: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ci.__main__ import main

    mine = _config_with(elsewhere, margin=1.5, history_runs=1)
    monkeypatch.setenv("NSA_CONFIG", str(mine))
    doc = _pipeline(capsys)
    assert doc["margin"] == 1.5 and doc["history"]["k"] == 1  # decide and history alike
    live = settings.load(REPO / "configs" / "base.yaml").decide
    base = str(REPO / "configs" / "base.yaml")
    assert main(["decide", "--results", "results.json", "--config", base, "--out", "d.json"]) == 0
    assert main(["history", "--results", "results.json", "--decision", "d.json", "--config", base,
                 "--out-dir", "h", "--dry-run"]) == 0
    doc = json.loads(Path("d.json").read_text(encoding="utf-8"))
    assert doc["margin"] == live["margin"] and doc["history"]["k"] == live["history_runs"]
    capsys.readouterr()


@pytest.mark.parametrize("stage", ["decide", "history"])
def test_an_nsa_config_that_names_no_file_is_one_line_naming_it(elsewhere: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str],
                                                                stage: str) -> None:
    from ci.__main__ import main

    monkeypatch.setenv("NSA_CONFIG", str(elsewhere / "missing.yaml"))
    base = str(REPO / "configs" / "base.yaml")
    assert main(["decide", "--results", "results.json", "--config", base, "--out", "d.json"]) == 0
    before = Path("d.json").read_bytes()
    capsys.readouterr()
    argv = {"decide": ["decide", "--results", "results.json", "--out", "d.json"],
            "history": ["history", "--results", "results.json", "--decision", "d.json", "--out-dir", "h"]}[stage]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NSA_CONFIG" in err and "missing.yaml" in err, err
    assert Path("d.json").read_bytes() == before and not Path("h").exists()


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    for extra in ("setup.py", "MANIFEST.in", *(f"nsa_contract/{p.name}" for p in (REPO / "nsa_contract").glob("*.py"))):
        # also before they are committed
        shutil.copy2(REPO / extra, dest / extra)
    return dest


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files (what a clone has)."""
    return _tracked_copy(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `pip install .` installs."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(out.glob("nsa_bench-*.whl"))


@pytest.fixture(scope="module")
def editable_wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `pip install -e .` installs, built by the backend hook that pip calls (PEP 660)."""
    out = tmp_path_factory.mktemp("editable")
    code = "import sys, setuptools.build_meta as b; print(b.build_editable(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / proc.stdout.split()[-1]


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A new venv outside the checkout with `wheel` installed alone; returns its python.

    After the install, a .pth line puts this venv's site-packages on its path (torch, PyYAML and the
    pipeline's packages without a download); those folders' own .pth files do not run, so this venv's
    editable install of the checkout is not seen.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "zz_test_deps.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    return python


def _runner(python: Path, work: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    drop = ("PYTHONPATH", "NSA_CONFIG", "NSA_PROFILE", "NSA_HISTORY_DIR", "GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT",
            "NSA_PR_DRY_RUN")
    env = {k: v for k, v in os.environ.items() if k not in drop}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=300)

    return run


def test_the_wheel_carries_nsa_and_its_contract_with_the_config_and_templates(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert zf.read("nsa_contract/_data/base.yaml") == (REPO / "configs" / "base.yaml").read_bytes()
        for template in (REPO / "templates").glob("*.j2"):
            assert zf.read(f"nsa_contract/_data/templates/{template.name}") == template.read_bytes()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert "nsa_contract/resources.py" in names
    # No generic top-level names beside nsa and nsa_contract: bench/ and ci/ stay in the checkout (the
    # pipeline install).
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"nsa", "nsa_contract"}
    always = sorted(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r)
    assert always == ["pyyaml", "torch"], requires
    pipeline = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires if 'extra == "pipeline"' in r}
    assert {"pygithub", "ruamel.yaml", "matplotlib", "jinja2", "numpy"} <= pipeline, requires


def test_the_library_install_imports_nsa_with_its_packaged_config_and_nothing_else(wheel: Path,
                                                                                   tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = _runner(python, work)
    where = run("-c", "import importlib.util as u, nsa, nsa_contract.resources as r; print(nsa.__file__); "
                      "print(r.__file__); print(r.default_config_path()); print(r.templates_dir()); "
                      "print([n for n in ('bench', 'ci') if u.find_spec(n)])")
    assert where.returncode == 0, where.stderr
    *paths, found = where.stdout.strip().splitlines()
    assert all(p.startswith(str(tmp_path / "venv")) for p in paths), paths
    assert found == "[]", "bench and ci must not be installed by the library"
    # Dispatch reads the packaged defaults through the one loader (NSA_PROFILE keeps it off CUDA queries).
    thresholds = run("-c", "import os; os.environ['NSA_PROFILE'] = 'sm90'; from nsa import dispatch; "
                           "from nsa_contract import settings; print(settings.default_path()); t = dispatch.thresholds(); "
                           "print(t.lookup('triton_min_len_sel', 'g16'))")
    assert thresholds.returncode == 0, thresholds.stderr
    path_line, value_line = thresholds.stdout.strip().splitlines()[-2:]
    assert path_line.startswith(str(tmp_path / "venv")) and "base.yaml:profiles.sm90.triton_min_len_sel" in value_line


def test_the_pipeline_install_runs_the_pipeline_from_another_folder(editable_wheel: Path, source: Path,
                                                                    tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv", editable_wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    results.dump(fx.document(fx.sweep("sliding", {1024: 2.0, 2048: 2.0})), work / "results.json")
    run = _runner(python, work)
    where = run("-c", "import bench, ci, nsa, nsa_contract as c; print(bench.__file__); print(ci.__file__); "
                      "print(nsa.__file__); print(c.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(source)) for p in where.stdout.split()), where.stdout
    piped = run("-m", "ci", "pipeline", "--results", "results.json", "--dry-run")
    assert piped.returncode == 0, piped.stdout + piped.stderr
    for stage in ("decide", "history", "report", "pr"):
        assert re.search(rf"^  {stage} +ok ", piped.stdout, re.M), piped.stdout
    assert json.loads((work / "out" / "pr" / "pr.json").read_text())["outcome"] == "dry-run"
    assert (work / "out" / "report" / "report.md").is_file()


def test_a_stage_without_the_pipeline_extra_names_the_install_in_one_line(tmp_path: Path) -> None:
    # As `pip install -e .` without the extra: numpy missing (None in sys.modules blocks the import).
    code = ("import sys; sys.modules['numpy'] = None; from ci.__main__ import main; "
            "sys.exit(main(['decide', '--results', 'results.json']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "numpy" in proc.stderr and 'pip install -e ".[pipeline]"' in proc.stderr, \
        proc.stderr

