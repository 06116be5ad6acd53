#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, sanitizer on a small case,
# benchmark over the grid; a short table last. Usage (from the repo root):
#   scripts/device_check.sh [quick|full]     (OUT=dir keeps logs and CSVs)
# quick: tests + 3 grid rows; full: tests + sanitizer + all 12 rows.
set -uo pipefail
mode=${1:-quick}
out=${OUT:-/tmp/smoe_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $commit ($(git status --porcelain 2>/dev/null | wc -l) uncommitted changes), $(date -u +%F)"

if ! make -j16 all >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build ok"

status=0
make test-gpu 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|FAIL|failed|error" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "$mode" = full ] && [ -x build/tests/gpu/test_layer_gpu ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/test_layer_gpu --small \
    >"$out/memcheck.log" 2>&1 && echo "memcheck clean" || { echo "MEMCHECK FAILED"; tail -20 "$out/memcheck.log"; status=1; }
  compute-sanitizer --tool racecheck --error-exitcode 9 build/tests/gpu/test_layer_gpu --small \
    >"$out/racecheck.log" 2>&1 && echo "racecheck clean" || { echo "RACECHECK FAILED"; tail -20 "$out/racecheck.log"; status=1; }
fi

if [ -x build/smoe_bench ]; then
  if [ "$mode" = full ]; then rows=all; else rows=7B-n256,30B-n512,120B-n1024; fi
  build/smoe_bench --rows "$rows" --csv "$out/bench.csv" 2>&1 | tee "$out/bench.log" | tail -25
fi
exit $status
