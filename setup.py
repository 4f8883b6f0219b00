"""Setuptools hook: ship configs/base.yaml and templates/*.j2 inside the wheel as nsa/_data/.

The checkout keeps one copy of each file where people edit it; a build copies them into the
package so that `pip install .` carries the defaults (nsa.resources finds them). Metadata lives in
pyproject.toml; MANIFEST.in puts the sources of these copies into the sdist.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE_DATA = "nsa/_data"


def data_files() -> dict[str, str]:
    """Source path in the checkout -> path under nsa/_data/."""
    files = {"configs/base.yaml": "base.yaml"}
    files.update({f"templates/{p.name}": f"templates/{p.name}" for p in sorted((ROOT / "templates").glob("*.j2"))})
    return files


class BuildPyWithData(build_py):
    """build_py, then the default config and templates copied into the built nsa package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        for src, dst in data_files().items():
            target = Path(self.build_lib) / PACKAGE_DATA / dst
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / src, target)


setup(cmdclass={"build_py": BuildPyWithData})
