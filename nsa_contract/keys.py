"""The decision keys: each threshold, declared once. Standard library only (no torch).

A decision key says from which sequence length (tokens so far: T in a prefill, t + 1 in a decode
step) one candidate backend runs one NSA branch when `backend="auto"`. Everything that names a key
derives from `KEYS`: the config loader (`nsa_contract.settings`), dispatch (`nsa.dispatch`), the
bench suites and CLI flags (`bench`), `ci decide / report / pr / pipeline` and, through the decision
file, the report templates. Adding a key for a backend that exists is one entry here plus its value
in configs/base.yaml (DESIGN.md, "Where a change goes"; tests/ci/test_key_reach.py).

Shape classes. A key's value may differ by class, so that one layout never vetoes another that
dispatch would not confuse with it (docs/pipeline.md, "Decision"). The class is the GQA group size
`Hq / Hkv` rounded down to a power of two, capped at 16: the own Triton kernels put all heads of
a group in one program (a tile of at least 16 rows), so their efficiency moves with the group size
while masked SDPA's does not. Head dims do not form classes: where a kernel cannot take a head dim
(FA-2 with dk != dv, FlexAttention above 128) its `unsupported_reason` rules it out per call and
dispatch moves on to the next candidate.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

BRANCH_OPS = {"win": "sliding", "cmp": "compressed", "sel": "selected"}
FAMILY_LABELS = {"fa2": "FA-2", "triton": "Triton"}
CLASSES = ("g1", "g2", "g4", "g8", "g16")
# The model grid each op's deciding cells must sit at (names of NSA config fields, bench params).
GRID_FIELDS = {
    "sliding": (("window", "window"),),
    "compressed": (("cmp_block", "block"), ("cmp_stride", "stride")),
    "selected": (("cmp_block", "block"), ("cmp_stride", "stride"), ("sel_block", "sel_block"),
                 ("sel_count", "sel_count")),
}
# Upper bound of `sel_count` (docs/nsa.md, "Selection"), for nsa.config and the config loader alike:
# the selected blocks are `[B, T, Hkv, n]` whatever T, padded with -1, so n sizes a per-token tensor.
# 4096 is 256 times the paper's 16, an index row of 32 KiB per token and KV head, and 262k tokens at
# l' = 64 (twice the longest context run here, 128k); 10**9 asked for 8 GB per token and KV head.
MAX_SEL_COUNT = 4096


@dataclass(frozen=True)
class DecisionKey:
    """One threshold: `branch` runs on `backend` from length `value(key)` up (-1: never).

    `candidates`: the backend names a results file records for this candidate (an alias such as
    `fa2` resolves to `flash_attn` or `torch_fa2`). `suite`: the bench suite whose cells decide it,
    candidate against masked SDPA. `name` is also the decision entry's key and the YAML key;
    `decision_id` the short name reports and older decision files use. `part`: which cells of
    the op decide, when a suite times more than one (`branch`: the whole branch as dispatch runs
    it, e.g. selection = scores + top-n + attention, not the attention alone).
    """

    name: str
    branch: str
    family: str
    backend: str
    candidates: tuple[str, ...]
    suite: str
    decision_id: str
    nightly_lengths: tuple[int, ...]
    part: str | None = None  # the deciding cells' `part` param (None: cells without one)

    @property
    def op(self) -> str:
        return BRANCH_OPS[self.branch]

    @property
    def label(self) -> str:
        return FAMILY_LABELS[self.family]

    @property
    def env(self) -> str:
        """The environment variable that overrides this key for experiments."""
        return f"NSA_{self.name.upper()}"

    @property
    def flag(self) -> str:
        """The `python -m bench run` flag that overrides this key."""
        return "--" + self.name.replace("_", "-")

    @property
    def grid(self) -> tuple[tuple[str, str], ...]:
        """(NSA config field, bench param) pairs the deciding cells must match."""
        return GRID_FIELDS[self.op]


NIGHTLY_T = (256, 512, 1024, 2048, 4096, 8192, 16384)
FA2_RECORDED = ("flash_attn", "torch_fa2")

# Per branch, in dispatch priority order: the first key whose length holds and whose backend can
# run the call wins; a branch with none runs masked SDPA.
# Sliding tries Triton before FA-2: in the H100 auto suite (results/h100/sm90-classes) the Triton
# window plan was as fast as the FA-2 one or faster in every prefill cell, and a decode step's
# window through the split Triton kernel took 0.126 ms against 0.203 ms with FA-2 (B=8, 64k).
KEYS: tuple[DecisionKey, ...] = (
    DecisionKey("triton_min_len_win", "win", "triton", "triton", ("triton",), "triton", "triton_win", NIGHTLY_T),
    DecisionKey("fa2_min_len_win", "win", "fa2", "fa2", FA2_RECORDED, "fa2", "win", NIGHTLY_T),
    DecisionKey("triton_min_len_cmp", "cmp", "triton", "triton", ("triton",), "triton", "triton_cmp", NIGHTLY_T),
    DecisionKey("fa2_min_len_cmp", "cmp", "fa2", "fa2", FA2_RECORDED, "fa2", "cmp", NIGHTLY_T),
    # With Triton, the selection branch's scores and top-n run on Triton too (one fused pass that
    # also yields the compressed output), so the whole branch is what this key is measured on.
    DecisionKey("triton_min_len_sel", "sel", "triton", "triton", ("triton",), "triton", "triton_sel", NIGHTLY_T,
                part="branch"),
)
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(k.family for k in KEYS))
_FOR_OP = {op: tuple(k for k in KEYS if k.op == op) for op in BRANCH_OPS.values()}


def names() -> tuple[str, ...]:
    return tuple(k.name for k in KEYS)


def get(name: str) -> DecisionKey:
    for key in KEYS:
        if key.name == name:
            return key
    raise KeyError(f"decision key must be one of {', '.join(names())}, got {name!r}")


def for_branch(branch: str) -> tuple[DecisionKey, ...]:
    """The keys of one branch (`win`, `cmp`, `sel`) in dispatch priority order."""
    if branch not in BRANCH_OPS:
        raise ValueError(f"branch must be one of {tuple(BRANCH_OPS)}, got {branch!r}")
    return tuple(k for k in KEYS if k.branch == branch)


def for_op(op: str) -> tuple[DecisionKey, ...]:
    return _FOR_OP.get(op) or tuple(k for k in KEYS if k.op == op)


def of_family(family: str) -> tuple[DecisionKey, ...]:
    return tuple(k for k in KEYS if k.family == family)


def suites() -> tuple[str, ...]:
    """The bench suites whose cells decide some key."""
    return tuple(dict.fromkeys(k.suite for k in KEYS))


@functools.lru_cache(maxsize=256)
def class_of(n_heads: int, n_kv_heads: int, head_dim_qk: int | None = None,
             head_dim_v: int | None = None) -> str:
    """The shape class of a call: `g<G>` with G the group size rounded down to a power of two,
    at most 16. Head dims are accepted for the callers' sake and do not change the class."""
    if n_kv_heads < 1 or n_heads < n_kv_heads or n_heads % n_kv_heads:
        raise ValueError(f"heads must be Hq a positive multiple of Hkv, got Hq={n_heads}, Hkv={n_kv_heads}")
    group = n_heads // n_kv_heads
    bucket = 1
    while bucket * 2 <= min(group, 16):
        bucket *= 2
    return f"g{bucket}"


def class_of_params(params: dict) -> str | None:
    """The class of a bench cell from its params (`Hq`, `Hkv`), None when they are missing."""
    hq, hkv = params.get("Hq"), params.get("Hkv")
    if not isinstance(hq, int) or not isinstance(hkv, int) or isinstance(hq, bool) or isinstance(hkv, bool):
        return None
    try:
        return class_of(hq, hkv)
    except ValueError:
        return None


def describe(keys: Iterable[DecisionKey] = KEYS) -> list[dict]:
    """Plain dicts of the keys (for results files, decision files and docs)."""
    return [{"name": k.name, "branch": k.branch, "op": k.op, "family": k.family, "label": k.label,
             "backend": k.backend, "candidates": list(k.candidates), "suite": k.suite,
             "decision_id": k.decision_id, "part": k.part} for k in keys]
