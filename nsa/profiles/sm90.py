"""sm90, Hopper (H100, H200): the tiles measured best on the H100 (the `Tiles` defaults;
results/h100/TILES.md), and every feature: PDL, TMA, FA-2, and the FA-3 / FA-4 wheels, whose
trades were measured here."""

from __future__ import annotations

from nsa.profiles import Features, Profile, Tiles

PROFILE = Profile(
    name="sm90",
    thresholds="sm90",
    tiles=Tiles(),
    features=Features(pdl=True, tma=True, fa2=True, fa3=True, fa4=True,
                      # head dim 192 failed in the compiled kernel (H200, torch 2.11, the parity suite)
                      flex_max_head_dim=128),
)
