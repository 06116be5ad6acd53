#!/usr/bin/env bash
# compute-sanitizer racecheck of the Hopper kernels, on the GPU machine:
#   scripts/racecheck_sm90.sh [BUILD_DIR]      (default build)
# 1. test_varlen_k_sm90 --tiny whole (its three smallest cases and a small
#    staged one with 256-row tiles: 137 s on an H200; --small and --staged
#    did not finish in 200-240 s), with the tool's defaults.
# 2. Every case of test_gemm_sm90 --small alone (--only-case N, the row
#    sweep's cases too), with the tool's defaults.
# 3. The layer on the Hopper path whole (test_layer_gpu --small --sm90),
#    with the tool's defaults: every kernel the layer runs.
# Under racecheck these kernels stop making progress now and then, at
# varying places, inside the tool only (GPU busy at 116 W; never outside
# it; synccheck clean: notes/sm90_log.md rung 14), so a run that passes its
# time limit is run again, up to three times. A hazard or a failed check
# fails the script at once.
# Exit status 0 only if every run finished with 0 hazards and every check
# passed.
set -uo pipefail
b=${1:-build}
g=$b/tests/gpu/test_gemm_sm90
cs="compute-sanitizer --tool racecheck --error-exitcode 9"
log=${RACE_LOGS:-/tmp}
fail=0
run1() { # name, time limit, command...: up to three runs while one stalls;
          # returns the last run's status (0, 9: hazard or failed check, 124)
  local n=$1 t=$2 k rc s=$(date +%s); shift 2
  for k in 1 2 3; do
    timeout "$t" $cs "$@" > "$log/race_$n.log" 2>&1
    rc=$?
    [ $rc = 124 ] || break
  done
  echo "$n: rc $rc after $k run(s), $(( $(date +%s) - s )) s, $(grep -o 'RACECHECK SUMMARY.*' "$log/race_$n.log")"
  return $rc
}
run1 varlen-k-tiny 300 $b/tests/gpu/test_varlen_k_sm90 --tiny || fail=1

cases=$($g --small | sed -n 's/^ok *case \([0-9]*\):.*/\1/p' | tr '\n' ' ')
[ -n "$cases" ] || { echo "no cases from $g --small"; fail=1; }
pids=()
for c in $cases; do # four at a time
  run1 "c$c" 60 $g --small --only-case "$c" &
  pids+=($!)
  if [ ${#pids[@]} -ge 4 ]; then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done

run1 layer-sm90-small 120 $b/tests/gpu/test_layer_gpu --small --sm90 || fail=1
[ $fail = 0 ] && echo "racecheck_sm90: PASS" || echo "racecheck_sm90: FAIL"
exit $fail
