#!/usr/bin/env bash
# ep_trace_round.sh: one device call on 2 or 4 GPUs of one host (about 9 min)
# for expert parallelism, from builds staged here:
#   scripts/prebuild.sh; mkdir -p .prebuilt/m; mv .prebuilt/prebuilt.tar.xz .prebuilt/STAMP .prebuilt/m/
#   (a variant's smoe_ep_bench alone, tarred with a STAMP, as .prebuilt/p/prebuilt.tar.xz;
#   .prebuilt/q: another, with its tests/gpu/test_ep_gpu, which then runs too)
#   run: bash scripts/ep_trace_round.sh   carry [".prebuilt/m", ".prebuilt/p", ".prebuilt/q"]   timeout 600
# 1. m's test_ep_gpu (P = 1, 2, G); 2. SMOE_EP_TRACE=1 of the layer's
# defaults at P = G (and 2, and 1 beside the single layer's stages) on
# the shapes below 85%, summed by
# bench/ep_trace_sum.py; 3. the A/B of RUNS4 (G >= 4, at P = 4) or RUNS2
# (at P = 2) by scripts/ep_ab.sh (defaults: q = exp/bw-xpack-late at both;
# exp/ce-parts' 4 parts and own share 20% at P = 4, the own split at 35%
# at P = 2); 4. memcheck at
# P = 2 with test_ep_gpu's warm-up all-reduce (does a stall come at NCCL's
# first collective or the layer's first call?; a first-case stall is
# retried) by scripts/ep_memcheck.sh, with the time left.
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
. scripts/nccl_env.sh
export OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
for d in m p q; do [ -f .prebuilt/$d/prebuilt.tar.xz ] && mkdir -p /tmp/ab_$d && tar -xJf .prebuilt/$d/prebuilt.tar.xz -C /tmp/ab_$d; done
G=$(nvidia-smi -L | wc -l); echo "GPUs: $G; m: $(head -1 /tmp/ab_m/STAMP)"
timeout 300 /tmp/ab_m/tests/gpu/test_ep_gpu > $OUT/test_ep_gpu.log 2>&1
echo "test_ep_gpu rc=$? $(tail -1 $OUT/test_ep_gpu.log) [$(el) s]"; grep FAIL $OUT/test_ep_gpu.log | head -5
if [ -x /tmp/ab_q/tests/gpu/test_ep_gpu ]; then # q's own tests (a variant staged with them)
  timeout 240 /tmp/ab_q/tests/gpu/test_ep_gpu > $OUT/test_ep_gpu_q.log 2>&1; rc=$?
  echo "q: $(head -1 /tmp/ab_q/STAMP): test_ep_gpu rc=$rc $(tail -1 $OUT/test_ep_gpu_q.log) [$(el) s]"
  grep FAIL $OUT/test_ep_gpu_q.log | head -5
fi
B=/tmp/ab_m/smoe_ep_bench
trace() { # name P opts
  local n=$1 p=$2; shift 2
  SMOE_EP_TRACE=1 timeout 90 $B -P $p "$@" -i 20 -q 2 > $OUT/trace_P${p}_$n.log 2>&1
  echo "== trace $n P=$p [$(el) s]: $(grep '^quick.*EP fwd' $OUT/trace_P${p}_$n.log)"
  grep -E "^smoe ep trace, rank 0|^  r0 " $OUT/trace_P${p}_$n.log
}
trace 30B-n512 $G -r 30B-n512 -x 524288
trace Qwen3-like $G -T 16384 -d 2048 -n 768 -E 128 -K 8 -x 262144
[ $G -gt 2 ] && CUDA_VISIBLE_DEVICES=0,1 trace 30B-n512 2 -r 30B-n512 -x 524288
# P = 1 beside the single layer's stages (the EP path's own cost: 94.9% at P = 1 in session 34)
CUDA_VISIBLE_DEVICES=0 trace 30B-n512 1 -r 30B-n512 -x 524288
CUDA_VISIBLE_DEVICES=0 timeout 60 /tmp/ab_m/smoe_bench --rows 30B-n512 --stages 2>&1 | grep -E "^  |fwd " | grep -v "0.00[0-9] ms"
python3 bench/ep_trace_sum.py $OUT/trace_*.log
if [ $G -ge 4 ]; then
  RUNS=${RUNS4:-"main:m xl:q c4:p:SMOE_EP_CE_PARTS=4 s20:p:SMOE_EP_OWN_SHARE=20"} P=4 ROUNDS=2 bash scripts/ep_ab.sh | grep -v "^ *per-GPU" | tail -30
else # P = 2: the forward's own split (50% by default) on the kernel path
  RUNS=${RUNS2:-"main:m xl:q s35:p:SMOE_EP_OWN_SHARE=35"} P=2 ROUNDS=2 \
  SHAPES="30B-n512=-r 30B-n512 -x 524288;120B-n1024=-r 120B-n1024 -x 524288" bash scripts/ep_ab.sh | grep -v "^ *per-GPU" | tail -20
fi
left=$(( 570 - $(el) ))
echo "memcheck with ${left}s left"
[ $left -gt 60 ] && CUDA_VISIBLE_DEVICES=0,1 SMOE_EP_WARMUP=1 TEST=/tmp/ab_m/tests/gpu/test_ep_gpu \
  BUDGET=$left STALL=60 RETRY=1 OUT=$OUT/mc bash scripts/ep_memcheck.sh
echo "done [$(el) s]"
