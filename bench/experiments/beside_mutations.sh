#!/bin/bash
# Run on a GPU machine from the repo root (PYTHONPATH=$PWD); the results/README.md win-beside entry cites it.
# Mutations of triton_nsa.beside; each must make one of the beside GPU tests fail.
f=nsa/backends/triton_nsa.py
cp $f /tmp/orig.py
run() { echo "== mutation: $1"; timeout 120 python3 -m pytest -m "gpu or not gpu" tests/nsa/test_triton.py -k "beside and not module" -q -p no:cacheprovider 2>&1 | grep -E "passed|failed" | tail -1; cp /tmp/orig.py $f; }
sed -i 's/                stream.wait_event(pair.last)/                pass/' $f; run "no wait for the last finish"
sed -i 's/        cur.wait_stream(pair.low)$/        pass/' $f; run "no wait for low"
sed -i 's/        cur.wait_stream(pair.high)$/        pass/' $f; run "no wait for high"
sed -i 's/        del s, c .*/        s.record_stream(cur) if s is not None else None/' $f; run "record_stream"
