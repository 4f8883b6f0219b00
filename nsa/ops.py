"""Public functional API of NSA's pieces. Every tensor is `[B, T, H, D]`.

`q` has `Hq` heads; `k`/`v` may have `Hkv` heads with `Hq % Hkv == 0` (GQA: query head h reads
KV head `h // (Hq // Hkv)`). `scale` defaults to `dk ** -0.5`. Queries sit at positions
`q_start .. q_start + Tq - 1` (0 for a prefill; `t` for a decode step) and raw keys at
`k_start ..`; query t may read key s only if `s <= t`.

`backend`: `"auto"` (thresholds from configs/base.yaml, see nsa.dispatch), or a name from
`nsa.backends` (`sdpa`, `fa2`, `flash_attn`, `torch_fa2`, `flex`, `triton`); a named backend
that cannot run raises `BackendError` with the reason. A call needs gradients when grad mode is on
and q, k or v requires grad: it then runs only on a backend with that op's backward (`auto`
skips the others; a named one without it raises), so no output is cut from autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa import backends, dispatch
from nsa.backends import AttnCall
from nsa.compression import avg_compress
from nsa.config import validate_branch_params
from nsa.masks import n_compressed
from nsa.selection import select_blocks_impl

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D [B, T, H, D], got shape {tuple(x.shape)}; add the batch/head dims")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a float tensor (fp16/bf16/fp32/fp64), got {x.dtype}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_len: bool, what: str = "k") -> None:
    for name, x in (("q", q), (what, k), ("v" if what == "k" else "v_cmp", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, {what} and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, {what} and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q {tuple(q.shape)}, {what} {tuple(k.shape)}, v {tuple(v.shape)} must agree on B (and k/v on "
            "T and H); tensors are [B, T, H, D] — a [B, H, T, D] tensor must be transposed first")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and {what} must share the head dim dk, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads must be a multiple of KV heads (GQA), got Hq={q.shape[2]}, Hkv={k.shape[2]}; "
            "tensors are [B, T, H, D] — check a [B, H, T, D] tensor was not passed")
    if same_len and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and {what} must have the same T in a prefill, got {q.shape[1]} and {k.shape[1]}; tensors are "
            "[B, T, H, D] — a [B, H, T, D] tensor must be transposed; for decode pass q_start/k_start")


def _scale(q: Tensor, scale: float | None) -> float:
    return float(q.shape[-1]) ** -0.5 if scale is None else float(scale)


def _run(call: AttnCall, backend: str) -> Tensor:
    name = dispatch.choose(call) if backend == "auto" else backend
    return backends.run(name, call)


def compress_kv(k: Tensor, v: Tensor, *, block: int, stride: int, phi: str = "avg") -> tuple[Tensor, Tensor]:
    """Compress raw keys/values `[B, T, Hkv, D]` -> `[B, Tc, Hkv, D]`, `Tc = 0 if T < l else (T-l)//d + 1`.

    Compressed token i summarises raw tokens `[i*d, i*d + l)`. `phi="avg"` (mean; fp32 accumulation
    for half inputs). The learnable `mlp` phi lives in the module (`nsa.compression.MLPCompressor`).
    Memory: the output only (the blocks are a strided view).
    """
    validate_branch_params(cmp_block=block, cmp_stride=stride)
    _check_tensor("k", k)
    _check_tensor("v", v)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [B, T, H], got {tuple(k.shape)} and {tuple(v.shape)}")
    if phi != "avg":
        raise ValueError(f"phi must be 'avg' here, got {phi!r}; use NSAAttention(phi='mlp') for the learnable phi")
    return avg_compress(k, block, stride), avg_compress(v, block, stride)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int, stride: int,
                         scale: float | None = None, backend: str = "auto", q_start: int = 0) -> Tensor:
    """Attention of each query over its visible compressed tokens -> `[B, Tq, Hq, Dv]`.

    Compressed token i (of `k_cmp [B, Tc, Hkv, Dk]`) is visible to query t iff `i*d + l - 1 <= t`
    (its block is complete). A query with none visible (t + 1 < l) gets exactly 0.

        t \\ i  0 1 2 3      (l=4, d=2)
        0..2   . . . .     <- nothing visible: output 0
        3..4   x . . .
        5..6   x x . .
        7..8   x x x .

    Memory (backend `sdpa`): one cached `[Tq, Tc]` mask while `Tq * Tc <= 2**24`, else chunks of
    queries over the compressed keys they can see, `O(B * Hq * C * Tc)` each (nsa.backends.sdpa).
    """
    validate_branch_params(cmp_block=block, cmp_stride=stride)
    _check_qkv(q, k_cmp, v_cmp, same_len=False, what="k_cmp")
    needed = n_compressed(q_start + q.shape[1], block, stride)
    if k_cmp.shape[1] < needed:
        raise ValueError(
            f"k_cmp must hold the {needed} compressed tokens of {q_start + q.shape[1]} raw tokens, got "
            f"{k_cmp.shape[1]}; build it with compress_kv(k, v, block={block}, stride={stride})")
    call = AttnCall("compressed", q, k_cmp, v_cmp, _scale(q, scale), q_start=q_start, block=block, stride=stride,
                    grad=backends.needs_grad(q, k_cmp, v_cmp))
    return _run(call, backend)


def select_blocks(q: Tensor, k_cmp: Tensor, *, block: int, stride: int, sel_block: int, sel_count: int,
                  scale: float | None = None, q_start: int = 0) -> Tensor:
    """Top-n selection blocks per query and KV group -> int64 `[B, Tq, Hkv, sel_count]`, `-1` padded.

    Scores (paper Eq. 9-10): `p_cmp` = the compressed branch's softmax over visible compressed
    tokens, mapped to blocks of `l'` tokens by token overlap, summed over the query heads of a
    group (all heads of a group share one block set). Candidates: `j * l' <= t`. Forced: block 0,
    `t // l'` and `t // l' - 1`. The rest: highest score, ties to the lower index. Each row holds
    `min(n, #candidates)` distinct blocks in ascending order, then `-1`.
    Memory: `O(B * Hq * C * max(Tc, Nb))` fp32 per chunk of C queries (bounded), plus the output.
    """
    validate_branch_params(cmp_block=block, cmp_stride=stride, sel_block=sel_block, sel_count=sel_count)
    _check_qkv(q, k_cmp, k_cmp, same_len=False, what="k_cmp")
    return select_blocks_impl(q, k_cmp, q_start, block=block, stride=stride, sel_block=sel_block,
                              sel_count=sel_count, scale=_scale(q, scale))


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, *, sel_block: int,
                       scale: float | None = None, backend: str = "auto", q_start: int = 0,
                       k_start: int = 0) -> Tensor:
    """Attention of query t over the raw tokens of its group's selected blocks, `<= t` -> `[B, Tq, Hq, Dv]`.

    `block_indices`: int `[B, Tq, Hkv, n]` from `select_blocks` (`-1` slots ignored). Block j covers
    raw tokens `[j*l', (j+1)*l')`; tokens after t in the current block are masked.
    Memory (backend `sdpa`): `[B, Hq, C, Tk]` masks per chunk while `Tq * Tk <= 2**24`; beyond,
    each (query, group) gathers its `n * l'` tokens, `O(B * C * Hkv * n * l' * (dk + dv))` per
    chunk, `O(Tq * n * l')` work in all (nsa.backends.sdpa).
    """
    validate_branch_params(sel_block=sel_block)
    _check_qkv(q, k, v, same_len=q_start == 0 and k_start == 0)
    if not isinstance(block_indices, Tensor) or block_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError("block_indices must be an int32/int64 tensor from select_blocks")
    expected = (q.shape[0], q.shape[1], k.shape[2])
    if block_indices.dim() != 4 or tuple(block_indices.shape[:3]) != expected:
        raise ValueError(
            f"block_indices must be [B, Tq, Hkv, n] = [{expected[0]}, {expected[1]}, {expected[2]}, n], got "
            f"{tuple(block_indices.shape)}")
    call = AttnCall("selected", q, k, v, _scale(q, scale), q_start=q_start, k_start=k_start,
                    sel_block=sel_block, block_indices=block_indices.long(), grad=backends.needs_grad(q, k, v))
    return _run(call, backend)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float | None = None,
                             backend: str = "auto", q_start: int = 0, k_start: int = 0) -> Tensor:
    """Causal sliding-window attention: query t reads keys `max(0, t-w+1) .. t` -> `[B, Tq, Hq, Dv]`.

        t \\ s  0 1 2 3 4     (w=3)
        0      x . . . .
        1      x x . . .
        2      x x x . .
        3      . x x x .
        4      . . x x x

    Memory (backend `sdpa`): one cached `[Tq, Tk]` band while `Tq * Tk <= 2**24`; beyond, chunks
    of C ~ w queries over their `C + w - 1` keys, `O(Tq * w)` in all (nsa.backends.sdpa).
    """
    validate_branch_params(window=window)
    _check_qkv(q, k, v, same_len=q_start == 0 and k_start == 0)
    call = AttnCall("sliding", q, k, v, _scale(q, scale), q_start=q_start, k_start=k_start, window=window,
                    grad=backends.needs_grad(q, k, v))
    return _run(call, backend)
