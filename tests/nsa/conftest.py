"""Fixtures of the nsa tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from nsa import profiles


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """`fake_gpu((9, 0), wheels=True, index=0)`: cuda:<index> reports that capability (no GPU
    needed; plain "cuda" is cuda:0), and every wheel counts as installed or none does; the
    profile caches are cleared on each call and at the end."""
    capabilities: dict[int, tuple[int, int]] = {}

    def fake(capability: tuple[int, int], *, wheels: bool = True, index: int = 0) -> None:
        capabilities[index] = capability
        monkeypatch.setattr(profiles, "_installed", lambda module: wheels)
        profiles.cache_clear()

    monkeypatch.setattr(profiles, "_capability", lambda index: capabilities[index])
    monkeypatch.setattr(profiles, "_current_index", lambda: 0)
    profiles.cache_clear()
    yield fake
    profiles.cache_clear()
