#!/usr/bin/env bash
# One call on the GPU machine, from the repo root:
#   scripts/device_check.sh verify   build; C GPU tests; memcheck; Python GPU
#                                    tests; `make run` on the GPU; racecheck
#                                    last (over 600 s in all: SKIP="race-sm90"
#                                    for one device call)
#   scripts/device_check.sh bench    the grid on the Hopper path and on the
#                                    portable path, and the plain PyTorch
#                                    grouped_mm layer in the same call
#   scripts/device_check.sh sm90     the short loop for Hopper kernel work:
#                                    C GPU tests, racecheck of the Hopper
#                                    GEMMs, their timings (build/bench_gemm
#                                    --family sm90), the grid on the
#                                    Hopper path and its stage times; with
#                                    AB="candidates" also the grid in
#                                    interleaved rounds (scripts/ab_grid.sh:
#                                    smoe_bench binaries or args:--gemm-row:..)
# SKIP="name ..." leaves those steps out (a short call).
# Logs and CSVs are written to /tmp/smoe_out and, when $OUT is set (the
# device tool), packed into one file there ($OUT keeps at most 8 files); a
# short table comes last.
set -uo pipefail
mode=${1:-verify}
out=/tmp/smoe_out
rm -rf "$out"; mkdir -p "$out"
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/device_check_$mode.tgz" -C "$out" .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
     "$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l) modified files, $(date -u '+%F %H:%M') UTC"

if [ -n "${PREBUILT:-}" ]; then # binaries built elsewhere (scripts/prebuild.sh)
  mkdir -p build && tar -xJf .prebuilt/prebuilt.tar.xz -C build && cat build/STAMP
  gpu_tests=$(ls build/tests/gpu/test_*)
else
  if ! make -j16 all >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
  fi
  gpu_tests=$(make -s print-gpu-tests)
fi
echo "build ok"
# `make test-gpu` without make (a prebuilt tree has no objects to compare)
test_gpu() {
  local pass=0 fail=0 t
  for t in $gpu_tests; do
    if $t; then pass=$((pass+1)); else fail=$((fail+1)); echo "FAILED: $t"; fi
  done
  echo "$pass passed, $fail failed"; [ $fail -eq 0 ]
}
status=0
step() { # name, command...: run, keep the log, print one line
  local name=$1; shift
  case " ${SKIP:-} " in *" $name "*) echo "$name skipped (SKIP)"; return;; esac
  local t0=$(date +%s)
  if "$@" >"$out/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  printf '%-12s %-7s %4ss  %s\n' "$name" "$r" "$(( $(date +%s) - t0 ))" \
    "$(grep -E '[0-9]+ passed|ERROR SUMMARY' "$out/$name.log" | tail -n 1)"
  [ $r = ok ] || tail -15 "$out/$name.log"
}

if [ "$mode" = verify ]; then
  step test-gpu test_gpu
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/test_layer_gpu --small
  # every refusal, the device-side ones (bad triples, foreign saved blocks)
  # included, touches no memory it should not
  step mem-bad compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/test_bad_input_gpu
  # the Hopper GEMMs alone, every row of their tables (the layer test's small
  # shapes never put a whole 64-row block past the buffer's end)
  step mem-sm90 compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/test_gemm_sm90 --small
  step mem-vk compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/test_varlen_k_sm90 --small
  # the machine's own pytest (a carried one can clash with its plugins)
  export PYTHONPATH=$PWD/python
  step python env SMOE_LIBRARY=$PWD/build/libsmoe.so timeout 300 python3 -m pytest -q -p no:cacheprovider python/tests
  step run-gpu build/smoe_run
  step run-7B build/smoe_run --config 7B-n256
  # racecheck last (the slowest: with it the whole verify takes more than
  # one 600 s device call; SKIP="race-sm90" fits one): the portable layer
  # path on small cases; the Hopper kernels case by case
  # (scripts/racecheck_sm90.sh says how and why)
  step racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 build/tests/gpu/test_layer_gpu --small --sm80
  step race-sm90 env RACE_LOGS="$out" timeout 600 bash scripts/racecheck_sm90.sh
  echo; tail -n 12 "$out/run-7B.log"
elif [ "$mode" = sm90 ]; then
  step test-gpu timeout 300 bash -c "$(declare -f test_gpu); gpu_tests='$gpu_tests'; test_gpu"
  # racecheck case by case (scripts/racecheck_sm90.sh says why)
  step race-sm90 env RACE_LOGS="$out" timeout 600 bash scripts/racecheck_sm90.sh
  step gemm-bench timeout 240 build/bench_gemm --family sm90 --csv "$out/bench_gemm.csv"
  step bench-sm90 timeout 150 build/smoe_bench --rows all --backend sm90 --csv "$out/bench_sm90.csv"
  [ -n "${AB:-}" ] && step ab-grid env OUT="$out" timeout 420 bash scripts/ab_grid.sh all "$AB" 3
  step stages timeout 90 build/smoe_bench --rows 7B-n256,120B-n1024 --backend sm90 --stages
  echo "== GEMMs (plan rows)"; grep -E " plan |geometric" "$out/gemm-bench.log"
  echo "== grid, default"; tail -n 14 "$out/bench-sm90.log"
  [ -f "$out/ab-grid.log" ] && { echo "== grid, interleaved rounds"; cat "$out/ab-grid.log"; }
else
  step ceilings python3 bench/ceilings.py
  step bench-sm90 build/smoe_bench --rows all --backend sm90 --csv "$out/bench_sm90.csv"
  step stages build/smoe_bench --rows 7B-n256,120B-n1024 --backend sm90 --stages
  step bench-cuda build/smoe_bench --rows all --backend cuda --csv "$out/bench_cuda.csv"
  step torch python3 bench/torch_baseline.py --rows all --csv "$out/torch.csv"
  # smoe (both paths) and the plain PyTorch layer, same inputs, same process
  step compare env SMOE_LIBRARY=$PWD/build/libsmoe.so timeout 330 python3 bench/compare.py \
       --impls smoe-sm90,smoe-cuda,torch --time-budget 270 --csv "$out/compare.csv"
  echo; cat "$out/ceilings.log"; tail -n 16 "$out/bench-sm90.log"; echo
  tail -n 16 "$out/bench-cuda.log"; echo; cat "$out/torch.log"
fi
exit $status
