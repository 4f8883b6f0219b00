"""Synthetic results documents for the ci tests (schema v1, validated by nsa_contract.results.check).

Timings are deterministic: each case's samples come from a generator seeded by its id, so the
bootstrap (also seeded) gives the same verdicts, and the same golden report, on every machine.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from ruamel.yaml import YAML

from ci import config_edit
from nsa_contract import keys, results

TIGHT = 0.01  # +-1% uniform noise: the interval is far narrower than the margin's headroom
NOISY = 0.5  # +-50%: the interval straddles any margin near the true speedup
N_SAMPLES = 30


def samples(median_ms: float, spread: float, key: str, n: int = N_SAMPLES) -> list[float]:
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return [round(median_ms * (1 + spread * u), 6) for u in rng.uniform(-1, 1, n)]


def machine(sm: str = "sm90", gpu_name: str = "NVIDIA H100 80GB HBM3", **extra: Any) -> dict[str, Any]:
    return {"gpu_name": gpu_name, "sm": sm, "driver": "550.54.15", "cuda": "12.4", "torch": "2.5.1",
            "triton": "3.1.0", "flash_attn": "2.6.3" if sm != "cpu" else None, "python": "3.11.7", **extra}


def run(method: Mapping[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": "run-0001", "created_at": "2025-03-01T12:00:00Z", "git_sha": "abc1234",
                           "command": "python -m bench --suite fa2"}
    if method is not None:
        doc["method"] = dict(method)
    return doc


METHOD = {"timer": "cuda_events", "warmup_ms": 25, "rep": 100, "interleaved": True, "l2_flush": True}


def sliding_params(T: int, window: int = 512, B: int = 1, Hq: int = 8, Hkv: int = 2, D: int = 64,
                   dtype: str = "bf16") -> dict[str, Any]:
    return {"B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "Dk": D, "Dv": D, "window": window, "dtype": dtype}


def compressed_params(T: int, block: int = 32, stride: int = 16, B: int = 1, Hq: int = 8, Hkv: int = 2,
                      D: int = 64, dtype: str = "bf16") -> dict[str, Any]:
    return {"B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "Dk": D, "Dv": D, "block": block, "stride": stride,
            "dtype": dtype}


def selected_params(T: int, block: int = 32, stride: int = 16, sel_block: int = 64, sel_count: int = 16,
                    B: int = 1, Hq: int = 8, Hkv: int = 2, D: int = 64, dtype: str = "bf16",
                    part: str | None = "branch") -> dict[str, Any]:
    """A selection cell; `part="branch"` (scores + top-n + attention) is what triton_min_len_sel is
    decided on, `part=None` the attention alone (reported only)."""
    extra = {"part": part} if part else {}
    return {**compressed_params(T, block, stride, B, Hq, Hkv, D, dtype), "sel_block": sel_block,
            "sel_count": sel_count, **extra}


def case(suite: str, op: str, backend: str, params: Mapping[str, Any], median_ms: float | None = 1.0,
         spread: float = TIGHT, status: str = "ok", reason: str = "",
         parity: Mapping[str, Any] | None = None, n: int = N_SAMPLES) -> dict[str, Any]:
    cid = results.case_id(suite, op, backend, params)
    doc: dict[str, Any] = {"id": cid, "suite": suite, "op": op, "backend": backend, "params": dict(params),
                           "status": status, "reason": reason}
    if status == "ok":
        doc["timing"] = results.timing_summary(samples(median_ms, spread, cid, n))
    if parity is not None:
        doc["parity"] = dict(parity)
    return doc


def parity(passed: bool = True) -> dict[str, Any]:
    return {"max_abs_err": 0.002 if passed else 0.25, "rel_err": 0.001 if passed else 0.3, "tol": 0.0078,
            "passed": passed}


def pair(op: str, params: Mapping[str, Any], speedup: float, candidate: str = "flash_attn",
         suite: str = "fa2", spread: float = TIGHT, sdpa_ms: float | None = None,
         candidate_parity: bool = True) -> list[dict[str, Any]]:
    """An sdpa case and a candidate case whose true speedup is `speedup`."""
    base_ms = sdpa_ms if sdpa_ms is not None else 0.001 * params["T"]
    return [case(suite, op, "sdpa", params, base_ms, spread),
            case(suite, op, candidate, params, base_ms / speedup, spread, parity=parity(candidate_parity))]


GRID_END = max(keys.NIGHTLY_T)  # the longest length of every key's decision grid


def sweep(op: str, speedups: Mapping[int, float | str], cover: bool = True, **kw: Any) -> list[dict[str, Any]]:
    """Pairs over T; a value "noisy" means true speedup 1.2 (the margin) with +-50% noise.

    `cover=True` extends a sweep that stops short with the decision grid's longest length at the
    last given speedup (the last verdict continues), as a nightly run would reach it; `ci decide`
    proposes nothing from a run that does not. `cover=False` keeps the sweep as given."""
    if cover and speedups and GRID_END not in speedups:
        speedups = {**speedups, GRID_END: speedups[max(speedups)]}
    make = {"sliding": sliding_params, "compressed": compressed_params, "selected": selected_params}[op]
    grid = {k: kw.pop(k) for k in ("window", "block", "stride", "sel_block", "sel_count", "B", "Hq", "Hkv", "D",
                                   "dtype", "part") if k in kw}
    cases: list[dict[str, Any]] = []
    for T, s in speedups.items():
        if s == "noisy":
            cases += pair(op, make(T, **grid), 1.2, spread=NOISY, **kw)
        else:
            cases += pair(op, make(T, **grid), float(s), **kw)
    return cases


def call_params(T: int, B: int = 1, Hq: int = 8, Hkv: int = 2, D: int = 64, dtype: str = "bf16") -> dict[str, Any]:
    """The shape of one NSA call (`nsa_prefill` / `nsa_decode`) at the model's grid."""
    return {"B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "Dk": D, "Dv": D, "window": 512, "block": 32, "stride": 16,
            "sel_block": 64, "sel_count": 16, "dtype": dtype}


AUTO_LABEL = "auto:cmp=triton,sel=triton,win=torch_fa2"
PLAN_BACKENDS = {"sdpa": "sdpa", "flex": "flex", "triton": "triton", "triton-fa2win": "triton+torch_fa2",
                 "triton-flexwin": "triton+flex"}


def auto_call(op: str, params: Mapping[str, Any], plans: Mapping[str, float | tuple[str, str]],
              auto_backend: str = AUTO_LABEL, spread: float = TIGHT) -> list[dict[str, Any]]:
    """One call of suite `auto` timed under each plan: a median in ms, or (status, reason) for a plan
    that was skipped or failed. Each timed plan records a peak memory that grows with its time."""
    cases = []
    for plan, how in plans.items():
        p = {**params, "plan": plan}
        backend = auto_backend if plan == "auto" else PLAN_BACKENDS.get(plan, plan)
        if isinstance(how, tuple):
            cases.append(case("auto", op, backend, p, status=how[0], reason=how[1]))
        else:
            c = case("auto", op, backend, p, how, spread)
            c["peak_mem_bytes"] = int(how * 2**28)
            cases.append(c)
    return cases


def calibration(median_ms: float, spread: float, T: int = 4096, backend: str = "sdpa") -> list[dict[str, Any]]:
    """Replicas A and B of one sliding case, same true time."""
    return [case("calibration", "sliding", backend, {**sliding_params(T), "replica": r}, median_ms, spread)
            for r in ("A", "B")]


def document(cases: Iterable[Mapping[str, Any]], sm: str = "sm90", method: Mapping[str, Any] | None = None,
             run_extra: Mapping[str, Any] | None = None, **machine_extra: Any) -> dict[str, Any]:
    gpu = {"sm90": "NVIDIA H100 80GB HBM3", "sm89": "NVIDIA L4", "cpu": "cpu"}.get(sm, "GPU")
    doc = {"schema_version": results.SCHEMA_VERSION, "run": {**run(method), **(run_extra or {})},
           "machine": machine(sm, gpu, **machine_extra), "cases": list(cases)}
    return results.check(doc, "fixture")


TRITON_OFF = {"triton_min_len_sel": -1, "triton_min_len_cmp": -1, "triton_min_len_win": -1}
CONFIG: dict[str, Any] = {
    "nsa": {"cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "sel_count": 16, "window": 512},
    "decide": {"margin": 1.2, "confidence": 0.95},
    "runtime": {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1, **TRITON_OFF},
    "profiles": {"sm90": {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1, **TRITON_OFF}},
}


def config(win: int = -1, cmp: int = -1, runtime: tuple[int, int] = (-1, -1), tsel: int = -1,
           tcmp: int = -1) -> dict[str, Any]:
    """CONFIG with the sm90 profile at (win, cmp, tsel, tcmp) and runtime's FA-2 keys at `runtime`."""
    return {**CONFIG, "runtime": {"fa2_min_len_win": runtime[0], "fa2_min_len_cmp": runtime[1], **TRITON_OFF},
            "profiles": {"sm90": {"fa2_min_len_win": win, "fa2_min_len_cmp": cmp, "triton_min_len_sel": tsel,
                                  "triton_min_len_cmp": tcmp}}}


# The spec's H100 sliding picture (masked/FA-2 at w=512): adopt from 2048 up.
WIN_ADOPT_FROM_2048 = {256: 0.44, 512: 0.62, 1024: 0.73, 2048: 1.5, 4096: 3.4, 8192: 6.75, 16384: 13.0}
# The spec's compressed picture: FA-2 wins at short lengths only.
CMP_SHORT_WINS = {256: 5.4, 512: 4.0, 1024: 3.0, 2048: 2.5, 4096: 1.0, 8192: 0.65, 16384: 0.6}


def golden_document() -> dict[str, Any]:
    """Every section of the report at once: the input of the golden-file test."""
    cases = sweep("sliding", WIN_ADOPT_FROM_2048)
    cases += sweep("sliding", {2048: 0.9, 8192: 2.0}, window=256)  # off-grid: reported only
    cases.append(case("fa2", "sliding", "flex", sliding_params(4096), 4.096 / 2.1))  # not FA-2: reported only
    cases += sweep("compressed", {256: 5.4, 1024: 3.0, 8192: 0.65})
    cases += pair("compressed", compressed_params(512), 4.0, candidate_parity=False)
    cases += sweep("sliding", {4096: 3.3}, suite="sweep")  # other suite: reported only
    cases.append(case("fa2", "sliding", "torch_fa2", sliding_params(32768), status="skipped",
                      reason="torch_fa2 needs torch >= 2.6 (have 2.5.1)"))
    cases.append(case("fa2", "sliding", "sdpa", sliding_params(32768), 32.8))
    cases.append(case("fa2", "selected", "triton", sliding_params(4096), status="failed",
                      reason="triton compile error: out of shared memory"))
    # Own Triton kernels, suite triton: selected adopts from 4096, compressed wins only short.
    cases += sweep("selected", {1024: 0.8, 4096: 1.6, 16384: 4.0}, candidate="triton", suite="triton")
    cases += sweep("compressed", {1024: 2.0, 8192: 0.7}, candidate="triton", suite="triton")
    cases += sweep("selected", {4096: 0.5}, sel_count=8, candidate="triton", suite="triton")  # off-grid
    # A second class (g16: 16 query heads, 1 KV head) where FA-2 wins from 1024: the proposal names classes.
    cases += sweep("sliding", {1024: 1.6, 4096: 3.0}, Hq=16, Hkv=1)
    cases += calibration(2.0, 0.02) + calibration(0.01, 0.4, T=64)
    # Auto against every plan: within 10% at 4096, slow at 16384 (a skipped plan), fine in decode (a failed one).
    cases += auto_call("nsa_prefill", call_params(4096), {"auto": 2.0, "sdpa": 3.0, "flex": 2.2, "triton": 1.9})
    cases += auto_call("nsa_prefill", call_params(16384), {
        "auto": 9.0, "sdpa": 30.0, "triton-fa2win": 7.0,
        "flex": ("skipped", "flex needs dk == dv on CUDA, got dk 192, dv 128")})
    cases += auto_call("nsa_decode", call_params(8192, Hq=16, Hkv=1), {
        "auto": 0.5, "sdpa": 0.6, "triton": ("failed", "triton: out of shared memory (98304 > 65536 bytes)")},
        auto_backend="auto:cmp=triton,sel=triton,win=sdpa")
    nvml = {"available": True, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "temperature_c": 41,
            "throttle_reasons": []}
    dispatch = {"fa2_min_len_win": {"value": -1, "source": "profiles.sm90"}}
    return document(cases, method=METHOD, run_extra={"dispatch": dispatch}, nvml=nvml, gpu_memory_gib=79.1)


# --- configs/base.yaml as it was before any threshold was adopted ---------------------------------
# The threshold PR changes the live file's values; tests that assume "nothing adopted yet" build
# that config from the live file instead, so a merged threshold PR never breaks its own CPU tests.

REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"
CONFIG_THRESHOLD_KEYS = keys.names()


def read_text(path: Path) -> str:
    """The file's exact text (line endings kept)."""
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def pristine_config_text(text: str | None = None, source: str = "configs/base.yaml") -> str:
    """``text`` (default: the live configs/base.yaml) with every threshold key under ``runtime`` and
    every profile set to -1, edited by ci.config_edit: every comment, key order and other byte kept.

    Profiles go through the public ``edit_thresholds`` (what the PR itself runs); ``runtime``, which
    the PR never edits, through the same module's in-place value rewrite. The result is checked:
    parsed, it is the input with only the threshold values set to -1, and no line is added or lost.
    """
    old = read_text(REPO_CONFIG) if text is None else text
    safe = YAML(typ="safe", pure=True)
    expected = safe.load(old)
    new = old
    for profile, block in (expected.get("profiles") or {}).items():
        if isinstance(block, Mapping):
            keys = {k: -1 for k in CONFIG_THRESHOLD_KEYS if k in block}
            new = config_edit.edit_thresholds(new, profile, keys, source=source)
            expected["profiles"][profile].update(keys)
    runtime = config_edit._load(new, source).get("runtime")
    if isinstance(runtime, Mapping):
        todo = {k: -1 for k in CONFIG_THRESHOLD_KEYS if k in runtime and runtime[k] != -1}
        if todo:
            where = {k: (runtime.lc.data[k][2], runtime.lc.data[k][3]) for k in todo}
            flow = bool(runtime.fa.flow_style())
            new = config_edit._replace_tokens(new, where, flow, todo, "runtime", source)
        expected["runtime"].update({k: -1 for k in CONFIG_THRESHOLD_KEYS if k in runtime})
    assert safe.load(new) == expected, "only threshold values may change"
    assert len(new.splitlines()) == len(old.splitlines()), "no line may be added or removed"
    return new


def write_pristine_config(path: Path) -> Path:
    """Write :func:`pristine_config_text` of the live config to ``path`` (parents created); return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(pristine_config_text())
    return path
