#!/usr/bin/env bash
# One device call over the binaries of scripts/prebuild.sh (carry
# [".prebuilt"]): every GPU test on GPU 0 (LANES at once on the one GPU:
# correctness only, nothing here is timed), memcheck of the Hopper GEMM
# tests on their small cases, then, if .prebuilt/old_smoe_bench.xz holds
# another build's benchmark, the grid in interleaved rounds against it
# (scripts/ab_grid.sh; ROUNDS, default 2; AB_BACKENDS, default "sm90").
# Logs under $OUT; a table last.
set -uo pipefail
o=${OUT:-/tmp/pbc}; mkdir -p "$o" build
tar -xJf .prebuilt/prebuilt.tar.xz -C build && cat build/STAMP
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
# test_ep_gpu too (P = 1 on one GPU), with torch's libnccl where there is one
. "$(dirname "$0")/nccl_env.sh"
tests=$(ls build/tests/gpu/test_*)
lanes=${LANES:-3}; i=0
for t in $tests; do echo "$t" >> "$o/lane$((i % lanes)).list"; i=$((i+1)); done
for l in $(seq 0 $((lanes-1))); do
  ( for t in $(cat "$o/lane$l.list"); do
      n=$(basename "$t")
      timeout 400 "$t" > "$o/$n.log" 2>&1; rc=$?
      echo "$n rc=$rc $(grep -E '[0-9]+ passed|[0-9]+/[0-9]+ passed|SKIP' "$o/$n.log" | tail -1)"
    done ) > "$o/lane$l.out" &
done
( cs="compute-sanitizer --tool memcheck --error-exitcode 9"
  timeout 300 $cs build/tests/gpu/test_gemm_sm90 --small > "$o/mem_gemm_sm90.log" 2>&1
  echo "memcheck test_gemm_sm90 --small rc=$? $(grep 'ERROR SUMMARY' "$o/mem_gemm_sm90.log")"
  timeout 200 $cs build/tests/gpu/test_varlen_k_sm90 --small > "$o/mem_vk.log" 2>&1
  echo "memcheck test_varlen_k_sm90 --small rc=$? $(grep 'ERROR SUMMARY' "$o/mem_vk.log")"
  timeout 300 $cs build/tests/gpu/test_gemm --small > "$o/mem_gemm.log" 2>&1
  echo "memcheck test_gemm --small rc=$? $(grep 'ERROR SUMMARY' "$o/mem_gemm.log")"
) > "$o/mem.out" &
wait
cat "$o"/lane*.out "$o/mem.out"; echo "tests done after $(( $(date +%s) - t0 )) s"
if [ -f .prebuilt/old_smoe_bench.xz ]; then
  xz -dc .prebuilt/old_smoe_bench.xz > /tmp/old_smoe_bench && chmod +x /tmp/old_smoe_bench
  for b in ${AB_BACKENDS:-sm90}; do
    BACKEND=$b OUT="$o" timeout 300 bash scripts/ab_grid.sh all \
      "build/smoe_bench /tmp/old_smoe_bench" "${ROUNDS:-2}" > "$o/ab_$b.log" 2>&1
    echo "== $b"; cat "$o/ab_$b.log"
  done
fi
