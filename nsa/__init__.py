"""Native Sparse Attention (arXiv 2502.11089) for PyTorch: paper-faithful module, functional ops,
an fp64 oracle, and interchangeable attention backends chosen by measured thresholds."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NSAConfig", "NSAAttention", "NSACache", "ReadCounts", "decode_read_budget"]
_HOME = {"NSAConfig": "nsa.config", "NSAAttention": "nsa.module", "NSACache": "nsa.module",
         "ReadCounts": "nsa.module", "decode_read_budget": "nsa.module"}


def __getattr__(name: str) -> Any:
    # Loaded on first use: torch-free submodules (nsa.resources) must import without torch, and
    # `ci/` reads them that way.
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")
