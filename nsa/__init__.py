"""Native Sparse Attention (arXiv 2502.11089) for PyTorch: paper-faithful module, functional ops,
an fp64 oracle, and interchangeable attention backends chosen by measured thresholds.

The public names load lazily: `import nsa` costs nothing until one is used. The torch-free
contract this package stands on (decision keys, the config loader, schemas) is the separate
package `nsa_contract`, which `ci` imports without this one (DESIGN.md).
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
