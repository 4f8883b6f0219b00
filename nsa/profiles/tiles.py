"""Launch parameters of the own Triton kernels: one frozen dataclass per kernel family, and `Tiles`,
the set of all families that a GPU profile carries (nsa/profiles/).

Each family checks its own fields by their declared type when it is built: a `bool` field takes a
bool, an `int` field an int of at least its floor (a power of two where it is a `tl.arange` size or
a warp count, at least 16 where it is a `tl.dot` tile), `int | None` (stages) also None (Triton's
default), a `Literal` one of its values.

    compressed   cmp_*, lse_*, split_*, score_carry   compressed.py, scores.py, fa3_cmp.py
    scores       scr_*                                 the scores kernel (compressed.py)
    selection    sel_*                                 group-centric selection (selection.py)
    blocks       selb_*                                block-centric selection (selection_blocks.py)
    topn         topn_*                                top-n (topn.py)
    window       win_*                                 the band kernel, beside streams, FA-4 (sliding.py)
    decode       dec_*, dtop_*, dout_*, dblk_*         the fused decode step (decode.py)
    train        trn_*, trnsel_*                       the training kernels (train.py)

`Tiles` reads every field by its flat name as well (`tiles.dec_chunk` is `tiles.decode.dec_chunk`),
and builds from flat names, so `dataclasses.replace(tiles, sel_split=2)` changes one field of one
family. The defaults are the values measured best on the H100 (sm90); results/h100/TILES.md keeps
the measurements behind them. No torch or triton import here.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

TopnAlgo = Literal["argmax", "filter"]
TOPN_ALGOS: tuple[str, ...] = typing.get_args(TopnAlgo)


def _int(default: int, *, low: int = 1, pow2: bool = False, dot: bool = False) -> Any:
    """An int field of at least `low`; `pow2`: a power of two (0 passes where `low` is 0); `dot`: >= 16."""
    return field(default=default, metadata={"low": low, "pow2": pow2, "dot": dot})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class _Family:
    """Validation by declared type, shared by every family."""

    def __post_init__(self) -> None:
        cls = type(self).__name__
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _hints(type(self))[f.name]
            where = f"{cls}.{f.name}"
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{where} must be a bool, got {value!r}")
                continue
            if typing.get_origin(kind) is Literal:
                if value not in typing.get_args(kind):
                    raise ValueError(f"{where} must be one of {typing.get_args(kind)}, got {value!r}")
                continue
            if value is None and isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind):
                continue
            low = f.metadata.get("low", 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{where} must be an int >= {low}, got {value!r}; see nsa/profiles/tiles.py "
                                 "for the meaning of each field")
            if f.metadata.get("pow2") and value & (value - 1):
                raise ValueError(f"{where} must be a power of two (tl.arange sizes, warps), got {value}")
            if f.metadata.get("dot") and value < 16:
                raise ValueError(f"{where} must be >= 16 (tl.dot's smallest tile), got {value}")


@dataclass(frozen=True)
class CompressedTiles(_Family):
    """The compressed pass (compressed.py): the two-pass kernel (`cmp_*`), the one-pass output +
    log-sum-exp kernel (`lse_*`), FA-3 in its place (`cmp_fa3*`, fa3_cmp.py), decode's split kernel (`split_*`)."""

    cmp_rows: int = _int(64, pow2=True)      # (query, head) rows per program: 4 queries x 16 heads
    cmp_bc: int = _int(32, pow2=True, dot=True)   # compressed keys per tile
    cmp_warps: int = _int(4, pow2=True)      # one warp per query's 16 heads: the sum over heads stays in a warp
    cmp_stages: int | None = _int(3)
    score_carry: bool = True                 # carry block spill in registers when the tile ends on a block edge
    cmp_lse: bool = True                     # prefill: one-pass output + log-sum-exp, then the scores kernel
    cmp_fa3: bool = True                     # ... that pass by FA-3 where the profile has the fa3 feature
    cmp_fa3_min_group: int = _int(4)         # ... for GQA groups of at least this many heads (tiled keys)
    cmp_fa3_g1: bool = True                  # ... and for G = 1 with KV heads as FA-3's batch (no tiled keys)
    cmp_fa3_min_work: int = _int(2**32, low=0)   # ... for B * Hq * T**2 at least this (smaller: host-bound)
    lse_rows: int = _int(128, pow2=True, dot=True)   # one-pass kernel: (query, head) rows per program
    lse_bc: int = _int(32, pow2=True, dot=True)      # one-pass kernel: compressed keys per tile
    lse_warps: int = _int(8, pow2=True)
    lse_stages: int | None = _int(3)
    split_tiles: int = _int(8)               # decode: compressed tiles per chunk of the split kernel
    split_warps: int = _int(1, pow2=True)
    split_stages: int | None = None


@dataclass(frozen=True)
class ScoresTiles(_Family):
    """The prefill scores kernel (compressed.py): selection-block scores from the saved log-sum-exp."""

    scr_bq: int = _int(64, pow2=True, dot=True)   # queries per program
    scr_bk: int = _int(64, pow2=True, dot=True)   # compressed keys per program (a multiple of 16 * l' / d)
    scr_warps: int = _int(4, pow2=True)
    scr_stages: int | None = _int(2)
    scr_gather: bool = True                  # the block map's one-column shift by tl.gather, not an fp32 dot
    scr_qt: int = _int(16)                   # query tiles per program, one key-tile load for all


@dataclass(frozen=True)
class SelectionTiles(_Family):
    """Group-centric selected attention (selection.py), prefill and decode."""

    sel_warps: int = _int(2, pow2=True)
    sel_stages: int | None = _int(2)
    sel_split: int = _int(4)                 # decode: programs per row (the blocks split)
    sel_split_rows: int = _int(1024, low=0)  # ... below this many (query, group) rows


@dataclass(frozen=True)
class BlockTiles(_Family):
    """Block-centric selected attention for small groups (selection_blocks.py), prefill."""

    selb_max_group: int = _int(8, low=0)     # block-centric for GQA groups <= this (0: never)
    selb_min_rows: int = _int(32768, low=0)  # ... and at least this many (query, KV head) rows (fewer: host-bound)
    selb_part_cap: int = _int(2**34, low=0)  # bytes of partials at most; longer prefills run in query chunks (0: no cap)
    selb_sort16: bool = True                 # the inversion sorts int16 list ids when they fit: half the radix passes
    selb_rows: int = _int(128, pow2=True, dot=True)  # (entry, head) rows per program
    selb_warps: int = _int(4, pow2=True)
    selb_stages: int | None = _int(2)        # the loop over steps pipelines the gathers
    selb_steps: int = _int(8)                # steps of selb_rows rows per program, one K/V load for all
    selb_forced_min_group: int = _int(2, low=0)  # groups >= this: forced blocks in their own kernel (0: never)
    selb_forced_rows: int = _int(64, pow2=True, dot=True)  # ... (query, head) rows per program
    selb_forced_warps: int = _int(4, pow2=True)
    selb_part_fp32: bool = False             # partial outputs in fp32 (default: the input dtype, half the traffic)


@dataclass(frozen=True)
class TopNTiles(_Family):
    """Top-n block indices (topn.py): prefill rows, and decode's two-stage top-n over chunks."""

    topn_split_rows: int = _int(2048, low=0)  # decode: fewer score rows than this take the two-stage top-n
    topn_chunk: int = _int(128, pow2=True)   # blocks per chunk of the two-stage top-n
    topn_warps: int = _int(1, pow2=True)     # prefill rows of >= 1024 blocks (shorter rows: one warp)
    topn_algo: TopnAlgo = "filter"           # prefill rows: both exact (topn._select_row)
    topn_cap: int = _int(32, pow2=True, dot=True)  # "filter": most candidates compacted per row (more: arg-max rounds)
    topn_filter_min: int = _int(128, low=0)  # "filter" only for rows of at least this many blocks
    topn_nchunk: int = _int(256, pow2=True)  # "filter": chunk maxima per row
    topn_lane_chunks: int = _int(32, low=0, pow2=True)  # "filter": strided chunks, lane-order compaction (0: contiguous)
    topn_maxnreg: int = _int(128, low=0)     # registers per thread at most (ptxas maxnreg; 0: the compiler's choice)
    topn_sort64: bool = False                # "filter": the exact rule by int64 keys and one sort
    topn_rank: bool = True                   # "filter": the exact rule by all-pairs ranks instead of n arg-max rounds
    topn_ctas: int = _int(256)               # programs per SM, each walking rows

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.topn_maxnreg and not 16 <= self.topn_maxnreg <= 255:
            raise ValueError(f"TopNTiles.topn_maxnreg must be 0 (no cap) or 16..255 (ptxas' range), "
                             f"got {self.topn_maxnreg}")


@dataclass(frozen=True)
class WindowTiles(_Family):
    """The sliding window (sliding.py): the band kernel, the stream beside the chain, FA-4 in its place."""

    win_rows: int = _int(64, pow2=True)      # (query, head) rows per program
    win_bn: int = _int(32, pow2=True, dot=True)   # keys per tile
    win_warps: int = _int(4, pow2=True)
    win_stages: int | None = _int(3)
    win_beside: bool = True                  # prefill: the window on a low-priority stream beside the chain
    win_beside_rows: int = _int(32768, low=0)     # ... up to this many query rows (B * T)
    win_beside_min_rows: int = _int(4096, low=0)  # ... and from this many (fewer: host-bound)
    win_fa4: bool = True                     # prefill: the window by FA-4 where the profile has the fa4 feature
    win_fa4_min_work: int = _int(2**32, low=0)    # ... for B * Hq * T**2 at least this (as cmp_fa3_min_work)


@dataclass(frozen=True)
class DecodeTiles(_Family):
    """The fused decode step (decode.py): kernels A (compressed), B (lse, scores, top-n, `dtop_*`),
    C (selected and window blocks, `dblk_*`), D (merges, gated sum, `dout_*`)."""

    dec_fused: bool = True                   # the whole step in four launches where it applies
    dec_pdl: bool = True                     # kernels B, C, D by programmatic dependent launch (the pdl feature)
    dec_flags: bool = True                   # ... each waiting for its own group's inputs, not the whole grid
    dec_chunk: int = _int(128, pow2=True, dot=True)   # kernel A: compressed keys per program (>= 16 blocks)
    dec_part_fp32: bool = False              # partial outputs in fp32 (default: the input dtype)
    dec_warps: int = _int(4, pow2=True)
    dec_stages: int | None = None
    dtop_warps: int = _int(4, pow2=True)
    dtop_algo: TopnAlgo = "filter"           # kernel B: top-n as topn_algo (with dtop_cap)
    dtop_cap: int = _int(64, pow2=True, dot=True)  # kernel B: as topn_cap (it has no topn_rank)
    dtop_sort64: bool = True                 # kernel B: as topn_sort64
    dout_warps: int = _int(4, pow2=True)
    dout_cols: int = _int(16, pow2=True, dot=True)  # kernel D: output columns per program
    dec_cb: int = _int(16, pow2=True)        # kernels B and D: chunk partials per vector load
    dtop_once: int = _int(32, low=0, pow2=True)  # kernel B: groups of at most this many chunks in one set of loads
    dblk_warps: int = _int(4, pow2=True)
    dblk_stages: int | None = None
    dec_max_blocks: int = _int(8192, pow2=True)  # top-n in one program up to this many selection blocks


@dataclass(frozen=True)
class TrainTiles(_Family):
    """The training kernels (train.py): forward with saved log-sum-exp and every branch's backward.
    The band tiles are FlashAttention-2's 64 x 64, chosen by reasoning, not swept."""

    trn_bm: int = _int(64, pow2=True, dot=True)   # band kernels: query rows per tile
    trn_bn: int = _int(64, pow2=True, dot=True)   # band kernels: keys per tile
    trn_warps: int = _int(4, pow2=True)
    trn_stages: int | None = _int(2)
    trnsel_warps: int = _int(4, pow2=True)   # selected forward / dQ: one (query, KV group) per program
    trnsel_stages: int | None = _int(2)
    trn_sel_rows: int = _int(64, pow2=True, dot=True)  # selected dK/dV: (list entry, head) rows per step
    trn_sel_chunk: int = _int(1024)          # selected dK/dV: list entries per work item at most


FAMILIES: dict[str, type[_Family]] = {
    "compressed": CompressedTiles, "scores": ScoresTiles, "selection": SelectionTiles, "blocks": BlockTiles,
    "topn": TopNTiles, "window": WindowTiles, "decode": DecodeTiles, "train": TrainTiles,
}
# Flat field name -> the family that holds it.
FIELDS: dict[str, str] = {f.name: name for name, cls in FAMILIES.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, init=False)
class Tiles:
    """Every family's launch parameters. `Tiles(**changes)` starts from the defaults; `changes`
    name families (`decode=DecodeTiles(...)`) or flat fields (`dec_chunk=64`), which also makes
    `dataclasses.replace(tiles, dec_chunk=64)` work. Hashable by value (nsa/graphs.py keys its
    graphs by it); `*_stages = None` leaves Triton's default."""

    compressed: CompressedTiles
    scores: ScoresTiles
    selection: SelectionTiles
    blocks: BlockTiles
    topn: TopNTiles
    window: WindowTiles
    decode: DecodeTiles
    train: TrainTiles

    def __init__(self, **changes: Any) -> None:
        flat: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name in FAMILIES:
                continue
            if name not in FIELDS:
                raise TypeError(f"Tiles has no field {name!r}; its fields are listed in nsa/profiles/tiles.py")
            flat.setdefault(FIELDS[name], {})[name] = value
        for name, cls in FAMILIES.items():
            family = changes.get(name)
            if family is None:
                family = cls(**flat.get(name, {}))
            elif not isinstance(family, cls):
                raise TypeError(f"Tiles.{name} must be a {cls.__name__}, got {type(family).__name__}")
            elif name in flat:
                family = dataclasses.replace(family, **flat[name])
            object.__setattr__(self, name, family)
        # Hashed on every graph lookup (nsa/graphs.py): once, here.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, name) for name in FAMILIES)))

    def __hash__(self) -> int:
        return self._hash

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (results files, sweeps)."""
        return {name: getattr(self, name) for name in FIELDS}

    def for_graphs(self) -> Tiles:
        """These tiles with the floors that only the host's time justifies lifted (HOST_FLOORS):
        a CUDA graph replay (nsa.graphs) has no host time, so the kernels a short call would
        have taken but for it are the faster ones there."""
        return dataclasses.replace(self, **dict.fromkeys(HOST_FLOORS, 0))

    def launch(self, prefix: str) -> dict[str, int]:
        """`num_warps` / `num_stages` of kernel `prefix` (cmp, lse, split, scr, sel, selb, win, dec, dblk, trn, trnsel)."""
        opts = {"num_warps": getattr(self, f"{prefix}_warps")}
        stages = getattr(self, f"{prefix}_stages")
        if stages is not None:
            opts["num_stages"] = stages
        return opts


for _name, _family in FIELDS.items():
    setattr(Tiles, _name, property(operator.attrgetter(f"{_family}.{_name}"), doc=f"`{_family}.{_name}`"))
del _name, _family

# The floors set because a short eager call is bound by the host (Python, launches, torch ops),
# not by its kernels: Tiles.for_graphs lifts them for CUDA graph replays (results/h100/TILES.md).
# The wheels' work floors stay: lifted, FA-3 and FA-4 were slower at 2k-4k even replayed.
HOST_FLOORS = ("selb_min_rows", "win_beside_min_rows")
