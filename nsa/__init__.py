"""Native Sparse Attention (arXiv 2502.11089) for PyTorch: paper-faithful module, functional ops,
an fp64 oracle, and interchangeable attention backends chosen by measured thresholds.

The public names load lazily, so the torch-free modules (`nsa.keys`, `nsa.settings`) import
without torch: `ci` reads them on machines and in jobs that have no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "NSAConfig": "nsa.config",
    "NSAAttention": "nsa.module",
    "NSACache": "nsa.cache",
    "ReadCounts": "nsa.cache",
    "decode_read_budget": "nsa.cache",
    "GraphedAttend": "nsa.graphs",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")
