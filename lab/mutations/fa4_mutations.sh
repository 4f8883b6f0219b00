#!/bin/bash
# Each mutation of nsa/backends/triton_kernels/fa4_win.py must fail tests/nsa/test_fa4_win.py (CPU, the
# double of FA-4): `make mutants MUTANTS=fa4` over a copy of the tree (or bash lab/mutations/fa4_mutations.sh in a clone), with .venv built.
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
f=nsa/backends/triton_kernels/fa4_win.py
cp $f /tmp/fa4_win.bak
run() { cmp -s $f /tmp/fa4_win.bak && { echo "NOT APPLIED (the pattern is gone): $1"; return; }
      TRITON_INTERPRET=1 timeout 600 $PY -m pytest -q -p no:cacheprovider tests/nsa/test_fa4_win.py -x >/dev/null 2>&1 && echo "SURVIVED: $1" || echo "killed: $1"; cp /tmp/fa4_win.bak $f; }
TRITON_INTERPRET=1 $PY -m pytest -q -p no:cacheprovider tests/nsa/test_fa4_win.py >/dev/null 2>&1 && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/and q_start == 0 and k_start == 0/and k_start == 0/' $f; run "no q_start check"
sed -i 's/and q_start == 0 and k_start == 0/and q_start == 0/' $f; run "no k_start check"
sed -i 's/window_size=(window - 1, 0)/window_size=(window, 0)/' $f; run "window one wider"
sed -i 's/and q.shape\[1\] == k.shape\[1\] //' $f; run "no length check"
sed -i 's/(q.shape\[-1\], v.shape\[-1\]) in _DIMS/True/' $f; run "no dims check"
sed -i 's/and q.dtype in DTYPES //' $f; run "no dtype check"
sed -i 's/return device.type != "cuda" or profiles.profile_for(device).features.fa4/return True/' $f; run "fa4 on every GPU"
sed -i 's/    if not hasattr(mod, "flash_attn_func"):/    if False:/' $f; run "no attr check"
sed -i 's/        warnings.filterwarnings("ignore"/        (lambda *a, **k: None)("ignore"/' $f; run "no warning filter"
diff $f /tmp/fa4_win.bak && echo restored
