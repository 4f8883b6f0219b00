#!/bin/bash
# Each mutation of nsa.graphs.GraphedAttend and what capture relies on (the masks built uncached
# under capture, masked SDPA without host syncs, the warm-up's sync check, the key, the output
# copy, the eviction order, Tiles.for_graphs) must fail tests/nsa/test_graphs.py. Most need the
# GPU tests: on the device, `make mutants MUTANTS=graph MUTANTS_PY=python3` (a copy of the tree); on CPU (the venv,
# the default) only the key, the floors and the argument checks can be killed.
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
files="nsa/graphs.py nsa/backends/__init__.py nsa/backends/sdpa.py nsa/backends/triton_kernels/tiles.py"
for f in $files; do cp $f /tmp/gm_$(basename $f).bak; done
same() { for f in $files; do cmp -s $f /tmp/gm_$(basename $f).bak || return 1; done; }
restore() { for f in $files; do cp /tmp/gm_$(basename $f).bak $f; done; }
tests="tests/nsa/test_graphs.py"
run() { same && { echo "NOT APPLIED (the pattern is gone): $1"; return; }
      timeout 600 $PY -m pytest -m "gpu or not gpu" -q -p no:cacheprovider $tests -x >/dev/null 2>&1 && echo "SURVIVED: $1" || echo "killed: $1"
      restore; }
$PY -m pytest -m "gpu or not gpu" -q -p no:cacheprovider $tests >/dev/null 2>&1 && echo "baseline passes" || { echo "BASELINE FAILS"; exit 1; }
sed -i 's/    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():/    if False:/' nsa/backends/__init__.py; run "masks cached under capture too"
sed -i 's/    empty = ~mask.any(dim=-1, keepdim=True)                       # \[..., Tq, 1\]/&\n    bool(empty.any())/' nsa/backends/sdpa.py; run "masked SDPA reads a flag back"
sed -i 's/        torch.cuda.set_sync_debug_mode("error")/        pass/' nsa/graphs.py; run "no sync check before the capture"
sed -i 's/self.branches, requested, current(q.device), self.tiles,/self.branches, requested, self.tiles,/' nsa/graphs.py; run "key without the tiles in force"
sed -i 's/                dispatch.thresholds(q.device))/                None)/' nsa/graphs.py; run "key without the thresholds"
sed -i 's/            return entry.out.clone()/            return entry.out/' nsa/graphs.py; run "the graph's output returned, not a copy"
sed -i 's/self._graphs.popitem(last=False)/self._graphs.popitem(last=True)/' nsa/graphs.py; run "evicts the newest graph"
sed -i 's/        tiles = self.tiles if self.tiles is not None else current(q.device).for_graphs()/        tiles = self.tiles if self.tiles is not None else current(q.device)/' nsa/graphs.py; run "captures without lifting the floors"
sed -i 's/^HOST_FLOORS = ("selb_min_rows", "win_beside_min_rows")/HOST_FLOORS = ("selb_min_rows",)/' nsa/backends/triton_kernels/tiles.py; run "the window's floor kept"
same && echo restored
