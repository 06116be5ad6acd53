#!/usr/bin/env bash
# The expert-parallel checks on a multi-GPU machine, from prebuilt binaries
# (.prebuilt/ep.tar.xz: build/tests/gpu/test_ep_gpu and build/smoe_ep_bench):
# the test, the test under compute-sanitizer memcheck (SMOE_EP_QUICK, API
# errors off: NCCL probes kernels at init), and
# the benchmark at a few shapes. A short table last.
set -uo pipefail
d=/tmp/ep; mkdir -p $d && tar -xJf .prebuilt/ep.tar.xz -C $d
if [ -z "${SMOE_NCCL_LIBRARY:-}" ]; then
  SMOE_NCCL_LIBRARY=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib','libnccl.so.2'))" 2>/dev/null)
  [ -f "$SMOE_NCCL_LIBRARY" ] || SMOE_NCCL_LIBRARY=$(find / -name 'libnccl.so.2' 2>/dev/null | head -1)
  export SMOE_NCCL_LIBRARY
fi
o=${OUT:-/tmp/ep_out}; mkdir -p "$o"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
ng=$(nvidia-smi -L | wc -l)
timeout 300 $d/test_ep_gpu > "$o/test_ep_gpu.log" 2>&1; echo "test_ep_gpu rc=$? $(tail -1 "$o/test_ep_gpu.log")"
if [ "${MEMCHECK:-1}" = 1 ]; then
  SMOE_EP_QUICK=1 timeout 240 compute-sanitizer --tool memcheck --report-api-errors no $d/test_ep_gpu > "$o/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|passed' "$o/memcheck.log" | tr '\n' ' ')"
fi
# each shape at P = 2 and at every GPU; expert_rows 2 T K (twice the mean)
IFS=';' read -ra SH <<< "${SHAPES:--r 30B-n512 -x 524288;-r 120B-n1024 -x 524288;-T 16384 -d 2048 -n 768 -E 128 -K 8 -x 262144;-T 8192 -d 4096 -n 14336 -E 8 -K 2 -x 32768}"
for s in "${SH[@]}"; do
  for p in $(printf '%s\n' 2 "$ng" | sort -u); do
    timeout 150 $d/smoe_ep_bench -P "$p" $s -i 20 >> "$o/bench.log" 2>&1 || echo "bench -P $p $s failed"
  done
done
cat "$o/bench.log"
