#!/bin/bash
# Each mutation of the forced-block kernel and the combine's forced mode in nsa/backends/triton_kernels/selection_blocks.py must
# fail the block-centric tests of tests/nsa/test_triton.py (CPU, Triton's interpreter):
# `make mutants MUTANTS=selb_forced` (a copy of the tree), or bash lab/mutations/selb_forced_mutations.sh in a clone with .venv built.
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
f=nsa/backends/triton_kernels/selection_blocks.py
cp $f /tmp/selection_blocks.bak
tests() { TRITON_INTERPRET=1 timeout 900 $PY -m pytest -q -p no:cacheprovider tests/nsa/test_triton.py \
          -k "block_centric_selection or repeated or hundreds or forced_blocks" "$@" >/dev/null 2>&1; }
run() { cmp -s $f /tmp/selection_blocks.bak && { echo "NOT APPLIED (the pattern is gone): $1"; return; }
      tests -x && echo "SURVIVED: $1" || echo "killed: $1"; cp /tmp/selection_blocks.bak $f; }
tests && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/        j = c_lo - 1 + i$/        j = c_lo + i/' $f; run "the tile's previous block skipped"
sed -i 's/    c_hi = (q_start + tl.minimum(t0 + BQ, Tq) - 1) \/\/ SEL/    c_hi = c_lo/' $f; run "a tile's second current block skipped"
sed -i 's/        if (j >= 1) \& (j <= c_hi):/        if (j >= 0) \& (j <= c_hi):/' $f; run "block 0 attended twice"
sed -i 's/    member = valid \& _is_forced(j, cur) \& (tl.sum((given == j).to(tl.int32), 1) > 0)/    member = valid \& _is_forced(j, cur)/' $f; run "forced blocks the list lacks attended"
sed -i 's/    return (j >= 0) \& ((j == 0) | (j == cur) | (j == cur - 1))/    return (j >= 0) \& ((j == 0) | (j == cur))/' $f; run "the kernel's rule without the previous block"
sed -i 's/        listed \&= ~is_forced(idx, cur)/        listed \&= (idx != 0) \& (idx != cur)/' $f; run "the lists' rule without the previous block"
sed -i 's/        w = tl.exp(lse_f - m_safe)/& * 0.5/' $f; run "the forced partial misweighted"
sed -i 's/    m = lse_f$/    m = tl.full([BG], float("-inf"), tl.float32)/' $f; run "the forced partial left out of the max"
sed -i 's/        m = tl.maximum(m, tl.load(LSEP + (base + s) \* G + offs_g, mask=gmask \& used, other=float("-inf")))/        m = m/' $f; run "the slots left out of the max"
sed -i 's/        used = used \& ~_is_forced(j, cur)/        used = used/' $f; run "the forced slots merged by the combine too"
sed -i 's/    cur = (q_start + t) \/\/ SEL/    cur = t \/\/ SEL/' $f; run "the combine's current block without q_start"
sed -i 's/(m_i + tl.log2(l_safe)) \/ common.LOG2E)/m_i + tl.log2(l_safe))/' $f; run "the forced log-sum-exp left in log2 units"
sed -i 's/(acc \/ l_safe\[:, None\]).to(FOP/acc.to(FOP/' $f; run "the forced partial not normalised"
sed -i 's/    valid = (t < Tq) \& (g < G)$/    valid = t < Tq/' $f; run "padded heads stored"
python3 - <<'PY'
p = "nsa/backends/triton_kernels/selection_blocks.py"
s = open(p).read()
a = "    vis = member[:, None] & kvalid[None, :] & (pos[None, :] <= t_abs[:, None])"
open(p, "w").write(s.replace(a, "    vis = member[:, None] & kvalid[None, :]"))
PY
run "no causal mask in the forced blocks"
diff $f /tmp/selection_blocks.bak && echo restored
