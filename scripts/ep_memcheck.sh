#!/usr/bin/env bash
# ep_memcheck.sh: test_ep_gpu under compute-sanitizer's memcheck at the largest
# P of the machine (SMOE_EP_QUICK=1), one process per case group, on a GPU
# machine. Under memcheck a P = 2 process has stalled in its first case (both
# ranks past their last launch, neither stream finishing; sessions 32-35,
# bench/RESULTS.md), never in a later one, so a group whose process starts no
# new case for STALL seconds is killed and, if that was its first case,
# started again (RETRY times).
#
#   TEST=build/tests/gpu/test_ep_gpu bash scripts/ep_memcheck.sh
#   CASES="Hopper;copy engines" STALL=60 RETRY=1 BUDGET=500 bash scripts/ep_memcheck.sh
#
# CASES: ';'-separated SMOE_EP_CASE texts (default: the whole suite in one
# process); BUDGET: seconds for all of it. Logs in $OUT (default /tmp/ep_mc).
# Extra environment passes through (e.g. CUDA_MODULE_LOADING=EAGER, or
# SMOE_EP_WARMUP=1: test_ep_gpu's one all-reduce before the first case).
set -uo pipefail
. "$(dirname "$0")/nccl_env.sh"
o=${OUT:-/tmp/ep_mc}; mkdir -p "$o"
T=${TEST:-build/tests/gpu/test_ep_gpu}
STALL=${STALL:-60}; RETRY=${RETRY:-1}; BUDGET=${BUDGET:-500}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
[ -x "$T" ] || { echo "ep_memcheck: no $T"; exit 2; }
run() { # group text, log; echo the number of cases started; rc 3 = stalled
  local c=$1 log=$2 cnt=0 now since
  SMOE_EP_QUICK=1 SMOE_EP_CASE="$c" setsid compute-sanitizer --tool memcheck \
    --report-api-errors no "$T" > "$log" 2>&1 &
  local pid=$!
  since=$(date +%s)
  while kill -0 $pid 2>/dev/null; do
    sleep 3
    now=$(grep -c '^case' "$log")
    [ "$now" -ne "$cnt" ] && { cnt=$now; since=$(date +%s); }
    if [ $(( $(date +%s) - since )) -gt "$STALL" ] || [ "$(el)" -gt "$BUDGET" ]; then
      kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
      echo "$cnt"; return 3
    fi
  done
  wait $pid
  echo "$cnt"
}
IFS=';' read -ra G <<< "${CASES:-}"
[ ${#G[@]} -eq 0 ] && G=("")
i=0
for g in "${G[@]}"; do
  i=$((i + 1))
  for try in $(seq 0 "$RETRY"); do
    [ $(( BUDGET - $(el) )) -lt 20 ] && { echo "group ${g:-all}: not run (budget)"; break; }
    log=$o/mc_${i}_$try.log
    cnt=$(run "$g" "$log"); rc=$?
    res="$(grep -E '[0-9]+ passed' "$log" | tail -1) $(grep 'ERROR SUMMARY' "$log" | tail -1)"
    if [ $rc -eq 3 ]; then
      echo "group ${g:-all} (try $try): STALLED after $cnt case(s) at $(el) s: $(grep -v '^=====' "$log" | tail -1)"
      [ "$cnt" -le 1 ] && continue
    else
      echo "group ${g:-all} (try $try): $cnt cases, $res [$(el) s]"
    fi
    break
  done
done
