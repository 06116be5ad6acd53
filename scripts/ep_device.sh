#!/usr/bin/env bash
# The expert-parallel checks on a multi-GPU machine, from prebuilt binaries
# (.prebuilt/ep.tar.xz: build/tests/gpu/test_ep_gpu and build/smoe_ep_bench):
# the test, the test under compute-sanitizer memcheck (SMOE_EP_QUICK), and
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
  SMOE_EP_QUICK=1 timeout 240 compute-sanitizer --tool memcheck $d/test_ep_gpu > "$o/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|passed' "$o/memcheck.log" | tr '\n' ' ')"
fi
IFS=';' read -ra SH <<< "${SHAPES:--T 8192 -d 1536 -n 256 -E 128 -K 8;-T 16384 -d 4096 -n 512 -E 64 -K 8;-T 32768 -d 2048 -n 1024 -E 32 -K 4}"
for s in "${SH[@]}"; do
  timeout 120 $d/smoe_ep_bench -P "$ng" $s -i 20 >> "$o/bench.log" 2>&1 || echo "bench $s failed"
done
cat "$o/bench.log"
