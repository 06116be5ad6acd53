#!/usr/bin/env bash
# The expert-parallel checks on a multi-GPU machine, from the binaries of
# scripts/prebuild.sh (.prebuilt/prebuilt.tar.xz; carry [".prebuilt"]):
#   GPU_TESTS=1  first the single-GPU tests, one lane per GPU
#                (CUDA_VISIBLE_DEVICES), test_ep_gpu left to the next step
#   test_ep_gpu  P = 1, 2 and every GPU up to 4
#   MEMCHECK=1   test_ep_gpu under compute-sanitizer memcheck (SMOE_EP_QUICK:
#                the largest P alone; API errors off: NCCL probes kernels)
#   PYTESTS=1    python/tests/test_ep_gpu.py (WORLD 1, 2 and 4 over NCCL, the
#                machine's torch) on the staged libsmoe.so
#   the benchmark: each of SHAPES (';'-separated smoe_ep_bench options) at
#                every P of PS (default "2 <every GPU>"), BENCH_ARGS added
# Logs under $OUT (the device tool) or /tmp/ep_out; a short table last.
set -uo pipefail
d=/tmp/pb; rm -rf $d; mkdir -p $d && tar -xJf .prebuilt/prebuilt.tar.xz -C $d && cat $d/STAMP
. "$(dirname "$0")/nccl_env.sh"
o=${OUT:-/tmp/ep_out}; mkdir -p "$o"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
ng=$(nvidia-smi -L | wc -l)
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s]"; }
if [ "${GPU_TESTS:-0}" = 1 ]; then
  tests=$(ls $d/tests/gpu/test_* | grep -v test_ep_gpu)
  i=0; for t in $tests; do echo "$t" >> "$o/lane$((i % ng)).list"; i=$((i+1)); done
  for l in $(seq 0 $((ng-1))); do
    [ -f "$o/lane$l.list" ] || continue
    ( for t in $(cat "$o/lane$l.list"); do
        n=$(basename $t)
        if CUDA_VISIBLE_DEVICES=$l timeout 400 $t > "$o/$n.log" 2>&1; then r=ok; else r="FAILED rc=$?"; fi
        echo "$n $r $(grep -E '[0-9]+ passed|SKIP' "$o/$n.log" | tail -1)"
      done ) > "$o/lane$l.out" &
  done
  wait; cat "$o"/lane*.out; el
fi
timeout 300 $d/tests/gpu/test_ep_gpu > "$o/test_ep_gpu.log" 2>&1; echo "test_ep_gpu rc=$? $(tail -1 "$o/test_ep_gpu.log") $(el)"
grep -E "FAIL" "$o/test_ep_gpu.log" | head -5
if [ "${MEMCHECK:-0}" = 1 ]; then
  SMOE_EP_QUICK=1 timeout ${MEMCHECK_S:-280} compute-sanitizer --tool memcheck --report-api-errors no $d/tests/gpu/test_ep_gpu > "$o/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|passed' "$o/memcheck.log" | tr '\n' ' ') $(el)"
fi
if [ "${PYTESTS:-0}" = 1 ]; then
  PYTHONPATH=$PWD/python SMOE_LIBRARY=$d/libsmoe.so timeout ${PYTESTS_S:-600} python3 -m pytest -q \
    -p no:cacheprovider python/tests/test_ep_gpu.py > "$o/pytest_ep_gpu.log" 2>&1
  echo "pytest test_ep_gpu.py rc=$? $(tail -1 "$o/pytest_ep_gpu.log") $(el)"
fi
IFS=';' read -ra SH <<< "${SHAPES:--r 30B-n512 -x 524288;-r 120B-n1024 -x 524288;-T 16384 -d 2048 -n 768 -E 128 -K 8 -x 262144;-T 8192 -d 4096 -n 14336 -E 8 -K 2 -x 32768}"
for s in "${SH[@]}"; do
  for p in ${PS:-$(printf '%s\n' 2 "$ng" | sort -u)}; do
    timeout 150 $d/smoe_ep_bench -P "$p" $s ${BENCH_ARGS:-} -i 20 >> "$o/bench.log" 2>&1 || echo "bench -P $p $s failed"
    echo "P=$p $s: $(grep 'per-GPU EP' "$o/bench.log" | tail -1) $(el)"
  done
done
