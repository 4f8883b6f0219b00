#!/bin/bash
# On a GPU machine: `make mutants MUTANTS=beside MUTANTS_PY=python3` (a copy of the tree); results/h100/win-beside/ cites it.
# Mutations of triton_nsa.beside; each must make one of the beside GPU tests fail.
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
f=nsa/backends/triton_nsa.py
cp $f /tmp/orig.py
run() { echo "== mutation: $1"; timeout 120 $PY -m pytest -m "gpu or not gpu" tests/nsa/test_triton.py -k "beside and not module" -q -p no:cacheprovider 2>&1 | grep -E "passed|failed" | tail -1; cp /tmp/orig.py $f; }
sed -i 's/                stream.wait_event(pair.last)/                pass/' $f; run "no wait for the last finish"
sed -i 's/        cur.wait_stream(pair.low)$/        pass/' $f; run "no wait for low"
sed -i 's/        cur.wait_stream(pair.high)$/        pass/' $f; run "no wait for high"
sed -i 's/        del s, c .*/        s.record_stream(cur) if s is not None else None/' $f; run "record_stream"
