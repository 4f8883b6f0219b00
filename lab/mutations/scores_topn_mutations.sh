#!/bin/bash
# Each mutation of the scores kernel's query-tile loop and gather shift (scores.py), top-n's ranks
# and lane form (topn.py) and the int16 inversion sort (selection_blocks.py) must fail the tests named beside it
# (CPU, Triton's interpreter): `make mutants MUTANTS=scores_topn` over a copy of the tree (or bash lab/mutations/scores_topn_mutations.sh in a clone),
# with .venv built. Run it in a clone, not in a tree a device call carries.
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
d=nsa/backends/triton_kernels
for f in scores topn selection_blocks; do cp $d/$f.py /tmp/mut_$f.bak; done
tests() { TRITON_INTERPRET=1 timeout 900 $PY -m pytest -q -x -p no:cacheprovider tests/nsa/test_triton.py \
          -k "$1" >/dev/null 2>&1; }
run() { f=$d/$1.py; cmp -s $f /tmp/mut_$1.bak && { echo "NOT APPLIED (the pattern is gone): $3"; return; }
        tests "$2" && echo "SURVIVED: $3" || echo "killed: $3"; cp /tmp/mut_$1.bak $f; }
S="query_tiles_per_program"
R="algorithms_are_exact and rank"
C="in_query_chunks"
L="algorithms_are_exact and filter"
tests "$S or $R or $C or $L or lane_chunks_only or list_ids_fit" && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/_scores_tile(Q, LSE, S, SP, kt, b, h, pid_k, c0, t0 + i \* BQ,/_scores_tile(Q, LSE, S, SP, kt, b, h, pid_k, c0, t0 + (i \/\/ 2) * BQ,/' $d/scores.py
run scores "$S" "a program's tiles repeated"
sed -i 's/    t0 = pid_q \* QT \* BQ$/    t0 = pid_q * BQ/' $d/scores.py; run scores "$S" "programs' tiles overlapping"
sed -i 's/    t_last = q_start + tl.minimum(t0 + QT \* BQ, T) - 1/    t_last = q_start + tl.minimum(t0 + BQ, T) - 1/' $d/scores.py
run scores "$S" "a program returns when its first tile lies above the staircase"
sed -i 's/tl.broadcast_to(tl.maximum(i - 1, 0)\[None, :\], \[ROWS, NBK\])/tl.broadcast_to(i[None, :], [ROWS, NBK])/' $d/scores.py
run scores "$S" "the gather shift by no column"
sed -i 's/        return own + tl.where(i\[None, :\] == 0, 0.0, prev), nxt/        return own + prev, nxt/' $d/scores.py
run scores "$S" "the gather shift's column 0 not cleared"
sed -i 's/    rank = tl.sum((key\[None, :\] > key\[:, None\]).to(tl.int32), 1)/    rank = tl.sum((key[None, :] >= key[:, None]).to(tl.int32), 1)/' $d/topn.py
run topn "$R" "ranks counting the key itself"
key="    key = (_mono(s).to(tl.int64) << 32) | (4294967295 - j.to(tl.int64))"
sed -i "s/^$key\$/    key = (_mono(s).to(tl.int64) << 32) | j.to(tl.int64)/" $d/topn.py
run topn "$R" "ranks' ties to the higher index"
sed -i "s/^$key\$/    key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (4294967295 - j.to(tl.int64))/" $d/topn.py
run topn "$R" "ranks on raw score bits (negatives, -0.0)"
sed -i 's/                chosen = _top_by_rank(sc, jc, N)$/                chosen = _top_by_rank(sc, jc, N - 1)/' $d/topn.py
run topn "$R" "ranks keep n - 1"
sed -i 's/                slot = tl.cumsum(c2, 0) + (tl.cumsum(per_lane, 0) - per_lane)\[None, :\] - 1/                slot = tl.cumsum(c2, 0) + tl.cumsum(per_lane, 0)[None, :] - 1/' $d/topn.py
run topn "$L" "lane compaction: each lane's offset counts its own survivors"
sed -i 's/                slot = tl.cumsum(c2, 0) + (tl.cumsum(per_lane, 0) - per_lane)\[None, :\] - 1/                slot = c2 + (tl.cumsum(per_lane, 0) - per_lane)[None, :] - 1/' $d/topn.py
run topn "$L" "lane compaction: no scan within a lane"
sed -i 's/    jo = tl.sort(tl.where(chosen, j, 2147483647))          # taken blocks first, ascending/    jo = tl.where(chosen, j, 2147483647)/' $d/topn.py
run topn "$L" "lane form: taken blocks written in compaction order"
sed -i 's/            "LANES": int(lanes and use and width >= 32 and cap >= sel_count)}/            "LANES": int(lanes and use and width >= 32)}/' $d/topn.py
run topn "lane_chunks_only" "lane form with a cap below n"
sed -i 's/    use = algo == "filter" and width > cap and width \/\/ cw >= n2 and width >= min_width/    use = algo == "filter" and width > cap and width \/\/ cw >= n2/' $d/topn.py
run topn "lane_chunks_only" "the filter on rows under topn_filter_min"
sed -i 's/    return torch.int16 if n_lists <= torch.iinfo(torch.int16).max else torch.int32/    return torch.int16 if n_lists <= 2 ** 16 else torch.int32/' $d/selection_blocks.py
run selection_blocks "list_ids_fit" "int16 list ids past int16's range"
for f in scores topn selection_blocks; do diff -q $d/$f.py /tmp/mut_$f.bak >/dev/null && echo "restored $f"; done
