"""Setuptools hooks: the defaults inside the wheel, and the pipeline's packages in an editable install.

1. Ship configs/base.yaml and templates/*.j2 inside the wheel as nsa_contract/_data/. The checkout
   keeps one copy of each file where people edit it; a build copies them into the package so that
   `pip install .` carries the defaults (nsa_contract.resources finds them). MANIFEST.in puts the
   sources of these copies into the sdist.
2. `pip install .` (a wheel, an sdist) carries the library alone: the nsa package and the
   torch-free contract it stands on, nsa_contract (pyproject.toml, `packages.find`), never
   top-level `bench` or `ci`, generic names that would collide with other projects' modules. The benchmark pipeline runs from a checkout:
   `pip install -e ".[pipeline]"` (`make setup`) maps the checkout's bench/ and ci/ as well, so
   `python -m ci` and `python -m bench` work from any folder. An editable install is the only
   build that adds them: what a wheel contains never depends on the environment or on an extra.

Metadata lives in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
PACKAGE_DATA = "nsa_contract/_data"
PIPELINE_PACKAGES = ["bench", "bench.*", "ci", "ci.*"]  # as pyproject.toml's `packages.find` would find them


def data_files() -> dict[str, str]:
    """Source path in the checkout -> path under nsa_contract/_data/."""
    files = {"configs/base.yaml": "base.yaml"}
    files.update({f"templates/{p.name}": f"templates/{p.name}" for p in sorted((ROOT / "templates").glob("*.j2"))})
    return files


class BuildPyWithData(build_py):
    """build_py, then the default config and templates copied into the built nsa_contract package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        for src, dst in data_files().items():
            target = Path(self.build_lib) / PACKAGE_DATA / dst
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / src, target)


class EditableWithPipeline(editable_wheel):
    """editable_wheel, with the checkout's pipeline packages (bench, ci) mapped beside nsa and nsa_contract."""

    def run(self) -> None:
        found = find_namespace_packages(where=str(ROOT), include=PIPELINE_PACKAGES)
        self.distribution.packages = [*self.distribution.packages, *(p for p in found
                                                                      if p not in self.distribution.packages)]
        super().run()


setup(cmdclass={"build_py": BuildPyWithData, "editable_wheel": EditableWithPipeline})
