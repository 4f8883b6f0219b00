"""Launch parameters of the own Triton kernels, one frozen `Tiles` per GPU profile.

A profile is `f"sm{major}{minor}"` for a CUDA device (`torch.cuda.get_device_capability`) and
`"cpu"` for CPU tensors or whenever Triton's interpreter runs (it runs on the CPU whatever the
tensors' device). `tiles(profile)` returns that profile's entry, or `default` for a GPU nobody
swept. A caller that wants other values (bench/triton_tiles.py, tests) passes `tiles=` to the
facade functions or scopes an override with `use_tiles(...)`; nothing mutates a shared table.

No triton import here: the registry reads profiles on machines without triton too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

TOPN_ALGOS = ("argmax", "filter")


@dataclass(frozen=True)
class Tiles:
    """Launch parameters; `*_stages = None` leaves Triton's default."""

    cmp_rows: int = 64            # (query, head) rows per compressed-kernel program: 4 queries x 16 heads
    cmp_bc: int = 32              # compressed keys per tile
    cmp_warps: int = 4            # one warp per query's 16 heads: the sum over heads stays in a warp
    cmp_stages: int | None = 3
    score_carry: bool = True      # carry block spill in registers when the tile ends on a block edge
    cmp_lse: bool = True          # prefill: one-pass output + log-sum-exp, then the scores kernel (scores.py)
    cmp_fa3: bool = True          # prefill: the one-pass output + log-sum-exp by FlashAttention-3 where installed (fa3_cmp.py)
    cmp_fa3_min_group: int = 4    # ... for GQA groups of at least this many heads (tiled keys; G=1 measured slower: fa3_cmp.py)
    cmp_fa3_g1: bool = True       # ... and for G = 1 with KV heads as FA-3's batch (no tiled keys: fa3_cmp.py)
    cmp_fa3_min_work: int = 2**32  # ... for prefills with B * Hq * T**2 (query-head rows times keys, what the forward's
                                  # work grows with) at least this; smaller ones are bound by the host, where FA-3's call
                                  # costs more than it saves (H100, auto, both wheels -> own kernels: 64/4 heads 1k 1.94
                                  # -> 1.18 ms, 4k 2.15 -> 1.52; 32/8 8k 3.62 -> 2.71; 16/16 8k 2.48 -> 1.95; at 2**32,
                                  # 64/4 8k and 16/16 16k, the wheels 1-3% faster; results/h100/wheel-floors/)
    lse_rows: int = 128           # one-pass kernel: (query, head) rows per program
    lse_bc: int = 32              # one-pass kernel: compressed keys per tile
    lse_warps: int = 8
    lse_stages: int | None = 3
    scr_bq: int = 64              # scores kernel: queries per program
    scr_bk: int = 64              # scores kernel: compressed keys per program (a multiple of 16 * l' / d)
    scr_warps: int = 4
    scr_stages: int | None = 2
    scr_gather: bool = True       # scores kernel: the block map's one-column shift by tl.gather, not an fp32 dot
                                  # (H100, 16/16 heads at 64k: the kernel 3.49 -> 2.85 ms; results/h100/scores-qt/)
    scr_qt: int = 16              # scores kernel: query tiles per program, one key-tile load for all (H100, 64k:
                                  # the kernel 4.46 -> 3.49 ms at 16/16 heads; forward 16/16 20.7 -> 19.6 ms, 32/8
                                  # 25.2 -> 24.5; 64/4 within +-1%; results/h100/scores-qt/)
    sel_warps: int = 2
    sel_stages: int | None = 2
    split_tiles: int = 8          # decode: compressed tiles per chunk of the split kernel
    split_warps: int = 1
    split_stages: int | None = None
    selb_max_group: int = 8       # prefill selection block-centric (selection_blocks.py) for groups <= this; 0: never
                                  # (H100, 64/8 heads: 16k 10.48 -> 7.95 ms, 64k 57.4 -> 45.0; 64/4 slower: 39.1 ->
                                  # 43.7 at 64k; results/h100/selb-forced/)
    selb_min_rows: int = 32768    # ... and at least this many (query, KV head) rows; fewer are bound by the host, where
                                  # the inversion's torch ops cost more than the gathers they save (H100, steady ms,
                                  # block-centric / group-centric: 32/8 heads 1k 2.22 / 0.98, 2k 2.36 / 1.19, 4k 2.29 /
                                  # 2.23; 16/16 1k 1.85 / 1.04, 2k 2.00 / 2.04, 4k 2.55 / 4.07; results/h100/wheel-floors/)
    selb_part_cap: int = 2**34    # block-centric: bytes of partials (n + 1 times the output) at most; longer prefills
                                  # run in chunks of queries under it (0: no cap). 16 GiB: 32/8 and 16/16 heads whole
                                  # to 64k, 64/8 in 2 chunks at 64k (45.0 ms; 4 GiB chunks: 45.6)
    selb_sort16: bool = True      # block-centric: the inversion sorts int16 list ids when they fit (< 2**15 lists):
                                  # half the radix passes (H100, 16/16 heads at 64k: 0.67 -> 0.32 ms; results/h100/sort16/)
    selb_rows: int = 128          # block-centric kernel: (entry, head) rows per program
    selb_warps: int = 4
    selb_stages: int | None = 2   # (the loop over steps below pipelines the gathers; 3 stages measured 1.6x slower)
    selb_steps: int = 8           # block-centric: steps of selb_rows rows per program, one K/V load for all
                                  # (64k: 32/8 9.8 -> 8.4 ms, 16/16 5.2 -> 4.4 ms; results/h100/selb-steps/)
    selb_forced_min_group: int = 2  # block-centric: for groups >= this, each query's forced blocks (0, current,
                                  # previous) attended by query tiles in their own kernel, outside the lists
                                  # (selection_blocks.py); 0: never. H100 at 64k: 32/8 heads 24.1 -> 23.6 ms, 32/16
                                  # 32.5 -> 31.7, 48/16 50.5 -> 49.3; 16/16 even at 64k, slower at 16k
                                  # (results/h100/selb-forced/)
    selb_forced_rows: int = 64    # ... (query, head) rows per forced-block program (queries <= sel_block; 64 measured
                                  # faster than 32, 128 and 256 at 32/8)
    selb_forced_warps: int = 4
    selb_part_fp32: bool = False  # block-centric: partial outputs in fp32 (default: the input dtype; bf16 halves the
                                  # partials' traffic: 32/8 heads at 64k, results/h100/selb-bf16/)
    sel_split: int = 4            # decode: programs per row of the selection kernel (blocks split)
    sel_split_rows: int = 1024    # fewer (query, group) rows than this: split
    topn_split_rows: int = 2048   # fewer score rows than this (decode): two-stage top-n over chunks
    topn_chunk: int = 128         # blocks per chunk of the two-stage top-n
    topn_warps: int = 1           # prefill top-n, rows of >= 1024 blocks (shorter rows: one warp)
    topn_algo: str = "filter"     # prefill top-n rows: "argmax" or "filter" (both exact; topn._select_row)
    topn_cap: int = 32            # "filter": most candidates compacted per row (more: that row takes arg-max rounds
                                  # over the whole row); 32 with topn_rank (64: the ranks' 64 x 64 compares cost more)
    topn_filter_min: int = 128    # prefill "filter": only rows of at least this many blocks (narrower: the rounds). At
                                  # 64 blocks the filter has 16 chunks, so its threshold is the least chunk maximum and
                                  # 46% of those rows passed the cap anyway; the rounds alone were 17% faster there
                                  # (ncu, H100: 45.1 -> 37.2 us at 16/16 heads, 16k; results/h100/topn-lanes/)
    topn_nchunk: int = 256        # "filter": chunk maxima per row (chunks of max(4, blocks / this) blocks)
    topn_lane_chunks: int = 32    # prefill "filter": this many strided chunks (a chunk's maximum within each lane) and the
                                  # survivors compacted in lane order (topn._select_row, LANES); 0: contiguous chunks
                                  # of topn_nchunk and a scan in block order (decode's kernel B keeps those)
    topn_maxnreg: int = 128       # prefill top-n: registers per thread at most (ptxas maxnreg; 0: the compiler's
                                  # choice, 239 on the H100 for 1024-block rows in lane form with 64 chunks: 8 warps
                                  # per SM). H100, 16/16 heads at 64k: top-n 4.38 -> 3.80 ms with 32 lane chunks and
                                  # this cap; forward 18.08 -> 17.33 (results/h100/topn-lanes/)
    topn_sort64: bool = False     # prefill "filter": the exact rule over the compacted blocks by int64 keys and one
                                  # sort (topn.py); off: slower on the spill rows (64k: 2.11 against 1.85 ms at 64/4)
    topn_rank: bool = True        # prefill "filter": the exact rule over the compacted blocks by all-pairs ranks of
                                  # int64 keys (topn._top_by_rank) instead of n arg-max rounds (H100, 64k, top-n with
                                  # topn_cap 32: 16/16 heads 4.78 -> 4.39 ms, 32/8 2.38 -> 2.15, 64/4 1.18 -> 1.09;
                                  # results/h100/topn-rank/)
    topn_ctas: int = 256          # prefill top-n: programs per SM, each walking rows (its scratch: topn_cap ints)
    win_rows: int = 64            # sliding: (query, head) rows per program
    win_bn: int = 32              # sliding: keys per tile
    win_warps: int = 4
    win_stages: int | None = 3
    win_beside: bool = True       # prefill: the window kernel on a low-priority stream beside the compressed pass,
                                  # scores and top-n on a high-priority one (triton_nsa.beside) ...
    win_beside_rows: int = 32768  # ... up to this many query rows (B * T): 64/4 heads, 8k-32k 1-4% faster, 128k ~1%
                                  # slower (results/h100/win-beside/)
    win_beside_min_rows: int = 4096  # ... and from this many (fewer: host-bound, where the streams' waits and events
                                  # cost more than the overlap gives: 1k-2k 0.1-0.4 ms slower, 4k 0.14 ms faster at
                                  # 64/4; results/h100/wheel-floors/beside.json)
    win_fa4: bool = True          # prefill: the window by FlashAttention-4 where installed, sm90 only (fa4_win.py;
                                  # the window at 64/4, 64k 3.53 -> 2.71 ms, dk 192 5.11 -> 3.01; results/h100/fa4-win/)
    win_fa4_min_work: int = 2**32  # ... for prefills with B * Hq * T**2 at least this (as cmp_fa3_min_work)
    dec_fused: bool = True        # decode: the whole step in four launches (decode.py) where it applies
    dec_pdl: bool = True          # decode.py: kernels B, C, D by programmatic dependent launch (sm90+)
    dec_flags: bool = True        # ... each waiting for its own group's inputs (per-group counts), not the whole grid
    dec_chunk: int = 128          # decode.py kernel A: compressed keys per program (one tile; >= 16 blocks)
    dec_part_fp32: bool = False   # decode.py: partial outputs in fp32 (default: the input dtype, as selb_part_fp32)
    dec_warps: int = 4
    dec_stages: int | None = None
    dtop_warps: int = 4           # decode.py kernel B (lse, scores, top-n)
    dtop_algo: str = "filter"     # decode.py kernel B: top-n as topn_algo (with dtop_cap)
    dtop_cap: int = 64            # decode.py kernel B: as topn_cap (the prefill's 32 came with topn_rank, which
                                  # kernel B does not take: it has dtop_sort64)
    dtop_sort64: bool = True      # decode.py kernel B: as topn_sort64 (step at 64k, B=8: 71.0 -> 67.4 us)
    dout_warps: int = 4           # decode.py kernel D (merges, gated sum)
    dout_cols: int = 16           # decode.py kernel D: output columns per program (>= 16)
    dec_cb: int = 16              # decode.py kernels B and D: chunk partials per vector load
    dtop_once: int = 32           # decode.py kernel B: a group of at most this many chunks gets its score row from
                                  # one set of loads (64k, B=8: step 59.3 -> 58.2 us; results/h100/decode-tail/); 0: never
    dblk_warps: int = 4           # decode.py kernel C (selected and window blocks, compressed merges)
    dblk_stages: int | None = None
    dec_max_blocks: int = 8192    # decode.py: top-n in one program up to this many selection blocks
    # Training (train.py): forward with saved log-sum-exp and the backward of every branch. Chosen by
    # reasoning (FlashAttention-2's 64 x 64 tiles), not swept yet.
    trn_bm: int = 64              # band kernels: query rows per tile
    trn_bn: int = 64              # band kernels: keys per tile
    trn_warps: int = 4
    trn_stages: int | None = 2
    trnsel_warps: int = 4         # selected forward / dQ: one (query, KV group) per program, >= 16 rows (H200, 64/4
                                  # heads at 64k, the branch's training step: 2 warps 58.9 ms, 4 warps 56.4;
                                  # results/h200/train/train-tiles-64k.json)
    trnsel_stages: int | None = 2
    trn_sel_rows: int = 64        # selected dK/dV: (list entry, head) rows per step
    trn_sel_chunk: int = 1024     # selected dK/dV: list entries (queries) per work item at most; a longer list
                                  # (block 0 is every query's) is cut, its items' fp32 partials summed in order

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("topn_algo", "dtop_algo"):
                if value not in TOPN_ALGOS:
                    raise ValueError(f"Tiles.{f.name} must be one of {TOPN_ALGOS}, got {value!r}")
                continue
            if f.name in ("score_carry", "cmp_lse", "cmp_fa3", "dec_fused", "dec_pdl", "topn_sort64",
                          "dtop_sort64", "selb_part_fp32", "cmp_fa3_g1", "dec_part_fp32", "dec_flags",
                          "win_beside", "win_fa4", "scr_gather", "topn_rank", "selb_sort16"):
                if not isinstance(value, bool):
                    raise ValueError(f"Tiles.{f.name} must be a bool, got {value!r}")
                continue
            if value is None and f.name.endswith("_stages"):
                continue
            # The split thresholds may be 0 (never split); every size, count and warp is >= 1.
            low = 0 if f.name in ("cmp_fa3_min_work", "win_fa4_min_work", "topn_filter_min", "topn_maxnreg", "topn_lane_chunks", "dtop_once", "win_beside_rows", "win_beside_min_rows", "sel_split_rows", "topn_split_rows", "selb_max_group", "selb_min_rows",
                                  "selb_forced_min_group", "selb_part_cap") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Tiles.{f.name} must be an int >= {low}, got {value!r}; see nsa/backends/"
                                 "triton_kernels/tiles.py for the meaning of each field")
        for name in ("cmp_rows", "cmp_bc", "win_rows", "win_bn", "topn_chunk", "cmp_warps", "sel_warps",
                     "split_warps", "win_warps", "lse_rows", "lse_bc", "lse_warps",
                     "scr_bq", "scr_bk", "scr_warps", "selb_rows", "selb_warps", "selb_forced_rows", "selb_forced_warps",
                     "topn_warps", "dec_chunk",
                     "dec_warps", "dtop_warps", "dout_warps", "dblk_warps",
                     "dec_max_blocks", "dout_cols", "dec_cb", "topn_cap", "dtop_cap", "topn_nchunk", "dtop_once",
                     "topn_lane_chunks", "trn_bm", "trn_bn", "trn_warps", "trnsel_warps", "trn_sel_rows"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two (tl.arange sizes, warps), got {value}")
        if self.topn_maxnreg and not 16 <= self.topn_maxnreg <= 255:
            raise ValueError(f"Tiles.topn_maxnreg must be 0 (no cap) or 16..255 (ptxas' range), got {self.topn_maxnreg}")
        for name in ("cmp_bc", "win_bn", "lse_bc", "scr_bq", "scr_bk", "lse_rows", "selb_rows", "dec_chunk", "dout_cols",
                     "topn_cap", "dtop_cap", "selb_forced_rows", "trn_bm", "trn_bn", "trn_sel_rows"):
            if getattr(self, name) < 16:
                raise ValueError(f"Tiles.{name} must be >= 16 (tl.dot's smallest tile), got {getattr(self, name)}")

    def for_graphs(self) -> Tiles:
        """These tiles with the floors that only the host's time justifies lifted (HOST_FLOORS):
        a CUDA graph replay (nsa.graphs) has no host time, so the kernels a short call would
        have taken but for it are the faster ones there."""
        return dataclasses.replace(self, **dict.fromkeys(HOST_FLOORS, 0))

    def launch(self, prefix: str) -> dict[str, int]:
        """`num_warps` / `num_stages` of kernel family `prefix` (cmp, sel, split, win, lse, scr, selb, dec, dblk)."""
        opts = {"num_warps": getattr(self, f"{prefix}_warps")}
        stages = getattr(self, f"{prefix}_stages")
        if stages is not None:
            opts["num_stages"] = stages
        return opts


# The floors set because a short eager call is bound by the host (Python, launches, torch ops),
# not by its kernels: Tiles.for_graphs lifts them for CUDA graph replays. Replayed on the H100
# (results/h100/graphs/): selb_min_rows at 0 took 16/16 heads at 1k from 1.01 to 0.25 ms and 32/8
# at 2k from 1.15 to 0.60; win_beside_min_rows at 0 gave 64/4 at 2k 0.96 -> 0.91 and 1k 0.58 ->
# 0.60. The wheels' work floors stay: lifted, FA-3 and FA-4 made 64/4 at 2k-4k and 32/8 at 2k 4-5%
# slower even replayed, and 64/4 at 1k 7% faster.
HOST_FLOORS = ("selb_min_rows", "win_beside_min_rows")

# sm90: what bench/triton_tiles.py measured best on the H100 (cmp/sel tiles, warps, stages, the
# decode split and step, the top-n algorithm and grid; results/h100/). `lse_*` and `win_*`: the one
# setting that beat the earlier one at every swept shape (8k/16k/64k at 64/4 heads, 64k at 16/16
# and 32/8; results/h100/topn-lse-pdl/), not each shape's best (128/128/8 lse tiles win at 64k, 64/4,
# and lose at 8k); the selection split knobs were set by reasoning. default: the same values,
# unswept elsewhere. cpu: Triton's interpreter is slow per element, so the smallest tiles tl.dot
# takes keep CPU tests quick.
PROFILES: dict[str, Tiles] = {
    "sm90": Tiles(),
    "default": Tiles(),
    "cpu": Tiles(cmp_rows=16, cmp_bc=16, win_rows=16, win_bn=16, lse_rows=16, lse_bc=16, scr_bq=16, scr_bk=64,
                 scr_qt=2, dec_chunk=64, topn_ctas=3, trn_bm=16, trn_bn=16, trn_sel_rows=16, trn_sel_chunk=8),
}

_override: contextvars.ContextVar[Tiles | None] = contextvars.ContextVar("nsa_triton_tiles", default=None)


def interpreting() -> bool:
    """Triton's interpreter is on (read per call: tests set and unset it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tiles(profile: str) -> Tiles:
    """The launch parameters of `profile` (`sm90`, `cpu`, ...); an unlisted `smXY` gets `default`."""
    if profile in PROFILES:
        return PROFILES[profile]
    if re.fullmatch(r"sm\d+", profile):
        return PROFILES["default"]
    raise ValueError(f"profile must be one of {sorted(PROFILES)} or 'sm<major><minor>', got {profile!r}; "
                     "use profile_for(device)")


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def profile_for(device: torch.device | str) -> str:
    """`sm{major}{minor}` for a CUDA device, `cpu` for anything else or under the interpreter."""
    dev = torch.device(device)
    if dev.type != "cuda" or interpreting():
        return "cpu"
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    major, minor = _capability(dev)
    return f"sm{major}{minor}"


def current(device: torch.device | str) -> Tiles:
    """The `use_tiles` override when one is active, else the device's profile."""
    override = _override.get()
    return override if override is not None else tiles(profile_for(device))


@contextlib.contextmanager
def use_tiles(value: Tiles) -> Iterator[Tiles]:
    """Run the kernels with `value` inside the block (sweeps, tests), whatever the device's profile."""
    if not isinstance(value, Tiles):
        raise TypeError(f"use_tiles must get a Tiles, got {type(value).__name__}; "
                        "build one with dataclasses.replace(tiles(profile), field=...)")
    token = _override.set(value)
    try:
        yield value
    finally:
        _override.reset(token)
