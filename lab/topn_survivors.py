"""How many blocks per score row pass top-n's filter (`topn._select_row`, ALGO 1) on the fast
path's own scores, with contiguous chunks (`Tiles.topn_nchunk`) and in lane form
(`Tiles.topn_lane_chunks`): the rows past the cap take the arg-max rounds over the whole row.
The filter is replayed in PyTorch on the group scores of `compressed_and_scores` (complete
scores, no key-tile spill), random inputs as `fwd_once.py` (bf16, seed 0, paper block sizes).

    PYTHONPATH=$PWD OUT=<dir> python3 lab/topn_survivors.py 65536 16 16 [65536 64 4 ...]

Writes `$OUT/topn-survivors.json`: per layout and width class, rows, mean survivors, the 99th
percentile, the largest count and the share of rows over the cap, for each chunk form.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from ci import atomic
from nsa.backends import triton_nsa
from nsa.backends.triton_kernels.tiles import tiles as tiles_of
from nsa.ops import compress_kv

OUT = os.environ.get("OUT", "/tmp")
SEL, N = 64, 16


def keys(s: torch.Tensor, j: torch.Tensor, ib: int) -> torch.Tensor:
    """`topn._keys` in PyTorch: the score's bits made monotone, low `ib` bits replaced by the index field."""
    bits = torch.where(s == 0, torch.zeros_like(s), s).view(torch.int32)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = ((mono >> ib) << ib) | ((1 << ib) - 1 - j)
    return torch.where(s > float("-inf"), key, torch.full_like(key, -2147483647))


def survivors(s: torch.Tensor, w: int, cw: int, lanes: bool) -> torch.Tensor:
    """Per row of `s [R, w]` (the rule applied): the count of blocks at or above tau's bucket."""
    ib = w.bit_length() - 1
    key = keys(s, torch.arange(w, device=s.device, dtype=torch.int32), ib)
    cmax = key.view(-1, cw, w // cw).amax(1) if lanes else key.view(-1, w // cw, cw).amax(2)
    tau = cmax.topk(N, dim=1).values[:, N - 1:N]
    cand = (key > -2147483647) & ((key >> ib) >= (tau >> ib))
    return cand.sum(1)


def main() -> None:
    args = [int(x) for x in sys.argv[1:]] or [65536, 16, 16]
    base = tiles_of("sm90")
    forms = {"contiguous": (base.topn_nchunk, False), "lanes": (base.topn_lane_chunks, True)}
    out = {"gpu": torch.cuda.get_device_name(), "cap": base.topn_cap, "forms": {k: v[0] for k, v in forms.items()},
           "layouts": []}
    for t, hq, hkv in zip(args[0::3], args[1::3], args[2::3], strict=True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, t, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, t, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, t, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        kc, vc = compress_kv(k, v, block=32, stride=16)
        _, sc = triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=SEL, scale=128 ** -0.5)
        del q, k, v, kc, vc
        nb = sc.shape[-1]
        row = {"T": t, "heads": hq, "kv_heads": hkv, "classes": []}
        w = 16
        while w // 2 < nb:
            t_lo, t_hi = (w // 2) * SEL if w > 16 else 0, min(t, w * SEL)
            if t_hi <= t_lo:
                break
            ww = min(w, 1 << (nb - 1).bit_length())
            pos = torch.arange(t_lo, t_hi, device="cuda")
            cur = (pos // SEL)[:, None, None]
            jj = torch.arange(ww, device="cuda")
            s = torch.zeros(1, t_hi - t_lo, hkv, ww, device="cuda")
            s[..., :min(ww, nb)] = sc[:, t_lo:t_hi, :, :min(ww, nb)]
            s = torch.where((jj == 0) | (jj == cur) | (jj == cur - 1), float("inf"), s)
            s = torch.where(jj <= cur, s, float("-inf")).reshape(-1, ww)
            cls = {"width": ww, "rows": s.shape[0]}
            for name, (nchunk, lanes) in forms.items():
                cw = max(4, ww // nchunk)
                if not (ww > base.topn_cap and ww // cw >= N):
                    continue                      # rows the rounds take: no filter
                c = torch.cat([survivors(s[i:i + 65536], ww, cw, lanes) for i in range(0, s.shape[0], 65536)]).float()
                cls[name] = {"mean": c.mean().item(), "p99": c.quantile(0.99).item() if c.numel() <= 2 ** 24 else None,
                             "max": c.max().item(), "over_cap": (c > base.topn_cap).float().mean().item()}
            row["classes"].append(cls)
            print(t, hq, hkv, cls, flush=True)
            w *= 2
        out["layouts"].append(row)
        del sc
        torch.cuda.empty_cache()
    atomic.write_text(os.path.join(OUT, "topn-survivors.json"), json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
