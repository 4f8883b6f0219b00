"""Native Sparse Attention (arXiv 2502.11089) for PyTorch: paper-faithful module, functional ops,
an fp64 oracle, and interchangeable attention backends chosen by measured thresholds."""

from __future__ import annotations

from nsa.config import NSAConfig
from nsa.module import NSAAttention, NSACache, ReadCounts, decode_read_budget

__all__ = ["NSAConfig", "NSAAttention", "NSACache", "ReadCounts", "decode_read_budget"]
