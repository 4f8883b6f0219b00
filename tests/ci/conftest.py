"""Shared fixtures of the ci tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ci import fixtures as fx


@pytest.fixture
def pristine_config(tmp_path: Path) -> Path:
    """``<tmp>/configs/base.yaml``: the live configs/base.yaml with every threshold key at -1, i.e. the
    config as it was before any adoption (see ``fixtures.pristine_config_text``). Tests that expect
    "-1 -> N" proposals use it, so they keep passing after a threshold PR changes the live values."""
    return fx.write_pristine_config(tmp_path / "configs" / "base.yaml")
