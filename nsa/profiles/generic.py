"""generic: any GPU without a profile file of its own (nsa/profiles/__init__.py warns once per
device). Nothing was measured there, so: the H100's tiles with what could fail on a smaller GPU
taken down, and no wheels or PDL (their trades were measured on sm90 only). FA-2's kernels stay
allowed where the capability has them (sm80+): an explicit `flash_attn` backend keeps working.
`auto` reads the device's own block of thresholds, at -1 (masked SDPA) until a run adopts a value."""

from __future__ import annotations

from nsa.profiles import Features, Profile, Tiles

PROFILE = Profile(
    name="generic",
    thresholds="generic",   # profile_for replaces it with the device's sm<major><minor>
    # Two pipeline stages at most: Ada and consumer Blackwell have about 100 KB of shared memory per
    # SM against the H100's 228 KB, and the 3-stage compressed, one-pass and band kernels at head
    # dim 256 need more. Partials of the block-centric selection capped at 2 GiB (16 on the H100).
    tiles=Tiles(cmp_stages=2, lse_stages=2, win_stages=2, selb_part_cap=2**31),
    features=Features(fa2=True),
)
