"""Sweep the launch parameters of the own Triton kernels (a `Tiles` per GPU profile) at one T.

    python bench/triton_tiles.py --T 65536 [--profile sm90] [--json out.json]

Paper layout (64 query / 4 KV heads unless --heads/--kv-heads, D 128, l=32 d=16 l'=64 n=16), bf16, B=1 (decode: one
query at t = T - 1 for B=8 sequences: `dec` the split kernel's chunking, `step` the fused decode
step's knobs, timed as CUDA-graph replays, `dec_fused: False` being the separate-op step). Every variant is
checked against the default configuration's output before it is timed (same compressed output
to bf16 rounding, same scores to 1e-5 relative, same selected output), so a faster variant
that computes something else is reported as wrong, not as a win. Timing: bench.timing (CUDA
events, L2 flushed), one variant per measure() call, so variants are not interleaved with each
other: read differences of a few percent as noise. Each variant is the base profile's `Tiles`
(`--profile`, default: this GPU's) with a few fields replaced, run inside `use_tiles`; the
`sm90` tile/warp/stage and decode-split values come from this sweep (top-n and selection split
knobs, and the sliding kernel's, were set by reasoning until a sweep says otherwise). `win` runs
the sliding kernel, w=512.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variants() -> dict[str, list[dict]]:
    cmp = [{"cmp_lse": True}] + [{"cmp_lse": False, "score_carry": c} for c in (True, False)]
    cmp += [{"cmp_lse": False, "cmp_rows": r, "cmp_bc": bc, "cmp_warps": w, "cmp_stages": s}
            for r, bc, w, s in itertools.product((16, 32, 64), (32, 64), (1, 2, 4), (2, 3)) if w * 16 <= r]
    lse = [{"lse_rows": r, "lse_bc": bc, "lse_warps": w, "lse_stages": s}
           for r, bc, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if w * 16 <= r]
    scr = [{"scr_bq": q, "scr_bk": k, "scr_warps": w, "scr_stages": s}
           for q, k, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3))]
    sel = [{"sel_warps": w, "sel_stages": s} for w, s in itertools.product((1, 2, 4), (2, 3))]
    # block-centric selection (groups <= selb_max_group: run with --heads 16 --kv-heads 16 or 32/8)
    sel += [{"selb_rows": r, "selb_warps": w, "selb_stages": s}
            for r, w, s in itertools.product((64, 128, 256), (4, 8), (None, 2, 3)) if w * 16 <= r]
    dec = [{"split_tiles": n, "split_warps": w} for n, w in itertools.product((1, 2, 4, 8), (1, 2, 4))]
    win = [{"win_rows": r, "win_bn": bn, "win_warps": w, "win_stages": s}
           for r, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if w * 16 <= r]
    path = [{"cmp_lse": True}, {"cmp_lse": False}]
    topn = [{"topn_sort64": s, "topn_cap": c} for s, c in itertools.product((True, False), (32, 64, 128))]
    topn += [{"topn_algo": a, "topn_warps": w} for a, w in itertools.product(("filter", "argmax"), (1, 2))]
    topn += [{"topn_cap": c} for c in (32, 128)] + [{"topn_ctas": n} for n in (8, 16, 64, 128, 256, 1024)]
    topn += [{"topn_nchunk": n, "topn_cap": c} for n, c in itertools.product((32, 64, 128), (64, 128))]
    # The fused decode step (decode.py), one knob at a time around the base profile.
    step = [{}, {"dec_fused": False}, {"dec_pdl": False}, {"dtop_algo": "argmax"}, {"dtop_sort64": False}] + [{"dec_chunk": c} for c in (64, 256)] + [
        {"dtop_warps": w, "dec_cb": cb} for w, cb in itertools.product((2, 4, 8), (8, 16, 32))] + [
        {"dout_warps": w, "dout_cols": c} for w, c in itertools.product((2, 4, 8), (16, 32, 64))] + [
        {"dblk_warps": w} for w in (1, 4)]
    return {"path": path, "cmp": cmp, "lse": lse, "scr": scr, "topn": topn, "sel": sel, "dec": dec, "win": win,
            "step": step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=64, help="query heads of the prefill kinds (default 64)")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads of the prefill kinds (default 4)")
    ap.add_argument("--profile", help="base GPU profile (sm90, generic, ...; nsa/profiles/); default: this GPU's")
    ap.add_argument("--json", help="write every variant's samples (ms) here")
    ap.add_argument("--kinds", default="path,cmp,lse,scr,topn,sel,dec,win",
                    help="comma-separated kernel families to sweep (default: all)")
    args = ap.parse_args(argv)
    kinds = [x for x in args.kinds.split(",") if x]
    unknown = sorted(set(kinds) - set(_variants()))
    if unknown:
        print(f"unknown --kinds {unknown}; choose from {sorted(_variants())}", file=sys.stderr)
        return 2

    import torch

    from bench.timing import Timer, measure
    from nsa import ops, profiles
    from nsa.backends import triton_nsa

    if not torch.cuda.is_available():
        print("triton_tiles needs CUDA", file=sys.stderr)
        return 2
    dev, dt, t = "cuda", torch.bfloat16, args.T
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731
    q, k, v = r(1, t, args.heads, 128), r(1, t, args.kv_heads, 128), r(1, t, args.kv_heads, 128)
    kc, vc = ops.compress_kv(k, v, block=32, stride=16)
    profile = profiles.by_name(args.profile) if args.profile else profiles.profile_for(dev)
    base = profile.tiles

    def cmp():
        return triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5)

    with triton_nsa.use_tiles(base):   # references from the base profile, whatever this GPU's is
        o_ref, s_ref = cmp()
        idx = triton_nsa.topn(s_ref, 0, sel_block=64, sel_count=16)

    def lse():   # the one-pass kernel alone (no scores)
        return triton_nsa.compressed_and_scores(q, kc, vc, block=32, stride=16, sel_block=64, scale=128 ** -0.5,
                                                scores=False)

    def topn():
        return triton_nsa.topn(s_ref, 0, sel_block=64, sel_count=16)

    def sel():
        return ops.selected_attention(q, k, v, idx, sel_block=64, backend="triton")

    def win():   # the band kernel whose tiles are swept, not FA-4 where it is installed (Tiles.win_fa4)
        with triton_nsa.use_tiles(dataclasses.replace(triton_nsa.current_tiles(q.device), win_fa4=False)):
            return ops.sliding_window_attention(q, k, v, window=512, backend="triton")

    # Decode: one query per sequence at t = T - 1, B = 8, over the same compressed keys.
    qd = r(8, 1, 64, 128)
    kcd, vcd = kc.expand(8, -1, -1, -1).contiguous(), vc.expand(8, -1, -1, -1).contiguous()

    def dec():
        return triton_nsa.compressed_and_scores(qd, kcd, vcd, block=32, stride=16, sel_block=64, scale=128 ** -0.5,
                                                q_start=t - 1)

    if "step" in kinds:   # B = 8 sequences of their own (no L2 sharing between them)
        kd, vd = r(8, t, 4, 128), r(8, t, 4, 128)
        kcs, vcs = ops.compress_kv(kd, vd, block=32, stride=16)
        gates = torch.sigmoid(r(8, 1, 64, 3))

    def step():
        c = triton_nsa.current_tiles(dev)
        if not c.dec_fused:   # the separate-op step, as NSAAttention.decode_attend runs it
            o_c, s_c = triton_nsa.compressed_and_scores(qd, kcs, vcs, block=32, stride=16, sel_block=64,
                                                        scale=128 ** -0.5, q_start=t - 1)
            ix = triton_nsa.topn(s_c, t - 1, sel_block=64, sel_count=16)
            o_w = triton_nsa.sliding_decode(qd, kd[:, -512:], vd[:, -512:], t=t - 1, scale=128 ** -0.5)
            return triton_nsa.selected_gated(qd, kd, vd, ix, sel_block=64, scale=128 ** -0.5, gates=gates,
                                             o_cmp=o_c, o_win=o_w, q_start=t - 1), ix
        return triton_nsa.decode_step(qd, gates, kcs, vcs, kd, vd, kd[:, -512:], vd[:, -512:], t=t - 1, block=32,
                                      stride=16, sel_block=64, sel_count=16, window=512, scale=128 ** -0.5)

    with triton_nsa.use_tiles(base):
        refs = {"path": (o_ref, s_ref), "cmp": (o_ref, s_ref), "scr": (o_ref, s_ref), "lse": lse()[0], "topn": idx,
                "sel": sel(), "dec": dec(), "win": win(), "step": step() if "step" in kinds else None}
    timer = Timer(warmup_ms=25, rep_ms=200, min_rep=5, max_rep=20)
    graphs = Timer(warmup_ms=25, rep_ms=200, min_rep=20, max_rep=200, cuda_graph=True)
    report: dict[str, list[dict]] = {kind: [] for kind in kinds}
    fns = {"path": cmp, "cmp": cmp, "scr": cmp, "lse": lambda: lse()[0], "topn": topn, "sel": sel, "dec": dec, "win": win,
           "step": step}
    for kind in kinds:
        fn = fns[kind]
        for var in _variants()[kind]:
            row: dict = {"tiles": var}
            try:
                with triton_nsa.use_tiles(dataclasses.replace(base, **var)):
                    out = fn()
                    if kind in ("path", "cmp", "scr", "dec"):
                        ok = (torch.allclose(out[0].float(), refs[kind][0].float(), rtol=2e-2, atol=2e-2)
                              and torch.allclose(out[1], refs[kind][1], rtol=1e-5, atol=1e-6))
                    elif kind == "topn":
                        ok = torch.equal(out, refs[kind])
                    elif kind == "step":
                        ok = (torch.equal(out[1], refs[kind][1])
                              and torch.allclose(out[0].float(), refs[kind][0].float(), rtol=2e-2, atol=2e-2))
                    else:
                        ok = torch.allclose(out.float(), refs[kind].float(), rtol=2e-2, atol=2e-2)
                    row["matches_default"] = bool(ok)
                    samples = measure({"v": fn}, graphs if kind == "step" else timer)["v"]
                row["median_ms"], row["samples_ms"] = statistics.median(samples), samples
            except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            report[kind].append(row)
            print(kind, var, row.get("median_ms", row.get("error")), row.get("matches_default", ""), flush=True)
    for kind, rows in report.items():
        good = [x for x in rows if x.get("matches_default") and "median_ms" in x]
        if good:
            best = min(good, key=lambda x: x["median_ms"])
            print(f"best {kind}: {best['tiles']} {best['median_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"T": t, "heads": args.heads, "kv_heads": args.kv_heads, "gpu": torch.cuda.get_device_name(),
                       "profile": profile.name, "defaults": base.flat(), **report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
