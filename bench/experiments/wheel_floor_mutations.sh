#!/bin/bash
# Each mutation of the wheels' work floor (Tiles.cmp_fa3_min_work in compressed.py, win_fa4_min_work in
# sliding.py) must fail tests/nsa/test_fa3_cmp.py or tests/nsa/test_fa4_win.py (CPU, the wheels' doubles):
# bash bench/experiments/wheel_floor_mutations.sh from the repo root, with .venv built.
cd "$(dirname "$0")/../.."
c=nsa/backends/triton_kernels/compressed.py
s=nsa/backends/triton_kernels/sliding.py
cp $c /tmp/wf_compressed.bak; cp $s /tmp/wf_sliding.bak
tests="tests/nsa/test_fa3_cmp.py tests/nsa/test_fa4_win.py"
run() { cmp -s $c /tmp/wf_compressed.bak && cmp -s $s /tmp/wf_sliding.bak && { echo "NOT APPLIED (the pattern is gone): $1"; return; }
      TRITON_INTERPRET=1 timeout 600 .venv/bin/python -m pytest -q -p no:cacheprovider $tests -x >/dev/null 2>&1 && echo "SURVIVED: $1" || echo "killed: $1"
      cp /tmp/wf_compressed.bak $c; cp /tmp/wf_sliding.bak $s; }
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider $tests >/dev/null 2>&1 && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/b \* hq \* tq \* tq >= tiles.cmp_fa3_min_work/b * hq * tq * tq > tiles.cmp_fa3_min_work/' $c; run "FA-3: floor exclusive"
sed -i 's/b \* hq \* tq \* tq >= tiles.cmp_fa3_min_work and/True and/' $c; run "FA-3: no floor"
sed -i 's/b \* hq \* tq \* tq >= tiles.cmp_fa3_min_work/b * tq * tq >= tiles.cmp_fa3_min_work/' $c; run "FA-3: work without the heads"
sed -i 's/q.shape\[0\] \* q.shape\[2\] \* q.shape\[1\] \*\* 2 >= tiles.win_fa4_min_work/q.shape[0] * q.shape[2] * q.shape[1] ** 2 > tiles.win_fa4_min_work/' $s; run "FA-4: floor exclusive"
sed -i 's/q.shape\[0\] \* q.shape\[2\] \* q.shape\[1\] \*\* 2 >= tiles.win_fa4_min_work and/True and/' $s; run "FA-4: no floor"
sed -i 's/q.shape\[0\] \* q.shape\[2\] \* q.shape\[1\] \*\* 2/q.shape[0] * q.shape[1] ** 2/' $s; run "FA-4: work without the heads"
diff $c /tmp/wf_compressed.bak && diff $s /tmp/wf_sliding.bak && echo restored
