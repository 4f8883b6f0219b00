"""One whole NSA forward on the fast path (every branch on the own Triton kernels), for a
profiler: `T`, query heads and KV heads from the command line, bf16, head dim 128, paper block
sizes, separate K/V per branch, random inputs (seed 0).

Needs a CUDA GPU. Used on the H100 under Nsight Compute, from the repo root:

    S="--section SpeedOfLight --section Occupancy --section WarpStateStats \\
       --section MemoryWorkloadAnalysis --section LaunchStats"
    PYTHONPATH=$PWD ncu $S -k regex:"_selb" -c 2 --csv --page details \\
        python3 lab/fwd_once.py 65536 32 8 > ncu-selb-32-8.csv

(stored in `results/h100/experiments/`, with the other two profiles' kernel filters named in
`results/README.md`).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nsa, bench
import torch

from bench.suites.fast import nsa_triton


def main() -> None:
    t, hq, hkv = (int(x) for x in sys.argv[1:4])
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g)

    q = r(1, t, hq, 128)
    kv = {n: (r(1, t, hkv, 128), r(1, t, hkv, 128)) for n in ("cmp", "sel", "win")}
    gates = torch.sigmoid(r(1, t, hq, 3))
    p = {"block": 32, "stride": 16, "sel_block": 64, "sel_count": 16, "window": 512}
    nsa_triton(q, kv, gates, p, "triton")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
