#!/usr/bin/env bash
# ep_ab.sh: A/B of expert-parallel builds on a multi-GPU machine, quick lines
# (smoe_ep_bench -q 1: the layer's defaults and the single layer, one process
# per line), interleaved build by build so drift hits every build alike.
#
#   RUNS="main:a cep4:b:SMOE_EP_CE_PARTS=4" P=4 ROUNDS=2 bash scripts/ep_ab.sh
#
# RUNS: label:dir[:VAR=value,...[:flag,value,...]] -- dir is
# .prebuilt/<dir>/prebuilt.tar.xz (scripts/prebuild.sh's, or one holding
# smoe_ep_bench alone), the VARs set and the smoe_ep_bench flags added for that
# label's lines only (e.g. "ce:a::-g,1": the copy engines at any P). SHAPES: ';'-separated name=options (default the
# four of bench/RESULTS.md's EP tables). TESTS=dir: first that build's
# test_ep_gpu (P = 1, 2 and every GPU up to 4). Lines to $OUT/ab.log as
# '<shape> r<round> <label> | quick ...' (bench/ep_plot.py --quick reads
# them when one label is kept), each build's raw output in $OUT/bench_<label>.log.
set -uo pipefail
. "$(dirname "$0")/nccl_env.sh"
o=${OUT:-/tmp/ep_ab}; mkdir -p "$o"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
for run in ${RUNS:?set RUNS}; do
  IFS=: read -r lab dir env fl <<< "$run"
  [ -d /tmp/ab_$dir ] && continue
  mkdir -p /tmp/ab_$dir && tar -xJf .prebuilt/$dir/prebuilt.tar.xz -C /tmp/ab_$dir || exit 1
  echo "$dir: $(head -1 /tmp/ab_$dir/STAMP)"
done
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | sort | uniq -c
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_S:-300} /tmp/ab_$TESTS/tests/gpu/test_ep_gpu > "$o/test_ep_gpu.log" 2>&1
  echo "test_ep_gpu ($TESTS) rc=$? $(tail -1 "$o/test_ep_gpu.log") $(el)"
  grep -E "FAIL" "$o/test_ep_gpu.log" | head -8
fi
IFS=';' read -ra SH <<< "${SHAPES:-30B-n512=-r 30B-n512 -x 524288;120B-n1024=-r 120B-n1024 -x 524288;Qwen3-like=-T 16384 -d 2048 -n 768 -E 128 -K 8 -x 262144;Mixtral-like=-T 8192 -d 4096 -n 14336 -E 8 -K 2 -x 32768}"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for sh in "${SH[@]}"; do
    name=${sh%%=*}; opts=${sh#*=}
    for run in $RUNS; do
      IFS=: read -r lab dir env fl <<< "$run"
      # shellcheck disable=SC2086
      env ${env//,/ } timeout 90 /tmp/ab_$dir/smoe_ep_bench -P "${P:-4}" $opts -i 20 -q 1 ${fl//,/ } > "$o/b.tmp" 2>&1 || echo "  ($lab rc=$?)"
      cat "$o/b.tmp" >> "$o/bench_$lab.log"
      echo "$name r$r $lab | $(grep '^quick.*EP fwd' "$o/b.tmp" | tail -1) $(el)" >> "$o/ab.log"
      tail -1 "$o/ab.log" | sed 's/; per-GPU/\n    per-GPU/; s/ (sm90: all tma+wgmma \[swiglu\]; ep: / (/'
    done
  done
done
