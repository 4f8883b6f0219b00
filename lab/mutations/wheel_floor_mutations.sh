#!/bin/bash
# Each mutation of the wheels' work floor (Tiles.cmp_fa3_min_work in compressed.py, win_fa4_min_work in
# sliding.py, the work both compare: common.prefill_work) must fail tests/nsa/test_fa3_cmp.py or tests/nsa/test_fa4_win.py (CPU, the wheels' doubles):
# `make mutants MUTANTS=wheel_floor` (a copy of the tree), or bash lab/mutations/wheel_floor_mutations.sh in a clone with .venv built.
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
c=nsa/backends/triton_kernels/compressed.py
s=nsa/backends/triton_kernels/sliding.py
w=nsa/backends/triton_kernels/common.py
cp $c /tmp/wf_compressed.bak; cp $s /tmp/wf_sliding.bak; cp $w /tmp/wf_common.bak
tests="tests/nsa/test_fa3_cmp.py tests/nsa/test_fa4_win.py"
run() { cmp -s $c /tmp/wf_compressed.bak && cmp -s $s /tmp/wf_sliding.bak && cmp -s $w /tmp/wf_common.bak && { echo "NOT APPLIED (the pattern is gone): $1"; return; }
      TRITON_INTERPRET=1 timeout 600 $PY -m pytest -q -p no:cacheprovider $tests -x >/dev/null 2>&1 && echo "SURVIVED: $1" || echo "killed: $1"
      cp /tmp/wf_compressed.bak $c; cp /tmp/wf_sliding.bak $s; cp /tmp/wf_common.bak $w; }
TRITON_INTERPRET=1 $PY -m pytest -q -p no:cacheprovider $tests >/dev/null 2>&1 && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/common.prefill_work(q) >= tiles.cmp_fa3_min_work/common.prefill_work(q) > tiles.cmp_fa3_min_work/' $c; run "FA-3: floor exclusive"
sed -i 's/common.prefill_work(q) >= tiles.cmp_fa3_min_work and/True and/' $c; run "FA-3: no floor"
sed -i 's/common.prefill_work(q) >= tiles.win_fa4_min_work/common.prefill_work(q) > tiles.win_fa4_min_work/' $s; run "FA-4: floor exclusive"
sed -i 's/common.prefill_work(q) >= tiles.win_fa4_min_work and/True and/' $s; run "FA-4: no floor"
sed -i 's/    return b \* hq \* t \* t$/    return b * t * t/' $w; run "the work without the heads"
sed -i 's/    return b \* hq \* t \* t$/    return b * hq * t/' $w; run "the work linear in T"
diff $c /tmp/wf_compressed.bak && diff $s /tmp/wf_sliding.bak && diff $w /tmp/wf_common.bak && echo restored
