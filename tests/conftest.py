"""Shared test set-up: one torch thread (2-core CI), GPU tests skipped with a reason without CUDA."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # ci/ tests run without torch too
        return
    torch.set_num_threads(1)
    from tests.nsa import helpers

    helpers.DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if helpers.DEV == "cpu":
        # Own Triton kernels run on CPU through Triton's interpreter (read when kernels are defined).
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Queried here, not at import: collecting never touches CUDA on a machine without it.
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    elif os.environ.get("NSA_TEST_FA2") != "1" and "gpu" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="GPU suite is opt-in: NSA_TEST_FA2=1 pytest -k fa2_parity, or pytest -m gpu")
    else:
        return
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run (fresh random inputs), printed on failure for reproduction."""
    value = int(os.environ.get("NSA_TEST_SEED", "0")) or int.from_bytes(os.urandom(3), "little")
    import torch
    torch.manual_seed(value)
    print(f"NSA_TEST_SEED={value}")
    return value
