"""Where the default files live: the checkout's, else the copies installed with the library.

A checkout keeps one copy of each (`configs/base.yaml`, `templates/*.j2`); building a wheel copies
them into `nsa_contract/_data/` (setup.py), so that an installed library carries its defaults. The
checkout wins when both exist, so editing `configs/base.yaml` in a checkout takes effect at once.
`NSA_CONFIG` overrides the config in the readers (nsa_contract.settings.config_source), not here.
Standard library only: `ci/` uses it without importing torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_config_path", "templates_dir"]

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent
DATA = PACKAGE / "_data"


def _in_checkout() -> bool:
    # pyproject.toml beside the package tells a source checkout from site-packages.
    return (CHECKOUT / "pyproject.toml").is_file()


def default_config_path() -> Path:
    """The default thresholds file: `<checkout>/configs/base.yaml`, else `nsa_contract/_data/base.yaml`."""
    for path in ((CHECKOUT / "configs" / "base.yaml") if _in_checkout() else None, DATA / "base.yaml"):
        if path is not None and path.is_file():
            return path
    raise FileNotFoundError(f"the default config must be at {CHECKOUT / 'configs' / 'base.yaml'} (checkout) or "
                            f"{DATA / 'base.yaml'} (installed), got neither; reinstall the package or set NSA_CONFIG")


def templates_dir() -> Path:
    """The report templates' folder: `<checkout>/templates`, else `nsa_contract/_data/templates`."""
    for path in ((CHECKOUT / "templates") if _in_checkout() else None, DATA / "templates"):
        if path is not None and (path / "report.md.j2").is_file():
            return path
    raise FileNotFoundError(f"the report templates must be in {CHECKOUT / 'templates'} (checkout) or "
                            f"{DATA / 'templates'} (installed), got neither; reinstall the package")
