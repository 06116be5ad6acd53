#!/usr/bin/env bash
# The weight gradients at one shape under Nsight Compute, smoe's and
# SonicMoE's, in one process, for sm90_log.md Next 19 (gpt-oss-120b:
# SonicMoE's dW1 + dW2 take 5.47 ms in the layer, ours 6.91, and its tile
# shape alone did not explain it: rung 32). One device call:
#   run: bash scripts/ncu_dw_pair.sh [ROW]     carry [".cmpwhl"]
# compare_device.sh's setup, then compare.py (one row, one rep, smoe first)
# under ncu: the first six launches of smoe's vk_varlen_k_kernel (its dw2
# and dw1 come first) and of SonicMoE's QuACK GEMMs with one consumer
# warpgroup per tile (ThrLayoutVMNK128111...: the forward's down, then dW1
# and dW2 as session 40's kernel map orders them). Writes $OUT/dw.txt (the
# details pages) and $OUT/dw_sass.csv.gz (per SASS instruction, for
# scripts/ncu_sass_summary.py); a short table last. ncu's -c counts the
# launches of both: NCU_IMPLS=sonicmoe (compare.py's implementations),
# NCU_K (the kernel regex) and NCU_C (the count) take one side at a time.
set -uo pipefail
row=${1:-gpt-oss-120b}
export OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
rm -f /tmp/ncu_dw.ncu-rep
CMP_IMPLS=${NCU_IMPLS:-smoe-sm90-consume-lp,sonicmoe} CMP_ROWS="$row" CMP_BUDGET=${CMP_BUDGET:-540} \
  CMP_ARGS="--reps 1 --warmup 0" \
  CMP_PRE="ncu --clock-control none --set full --import-source yes -k regex:${NCU_K:-vk_varlen_k_kernel|quackgemm_default_epi.*ThrLayoutVMNK1281111} -c ${NCU_C:-6} -f -o /tmp/ncu_dw" \
  bash scripts/compare_device.sh > "$OUT/compare_under_ncu.log" 2>&1
grep -E "^==|FAILED|WARNING" "$OUT/compare_under_ncu.log" | tail -4
[ -f /tmp/ncu_dw.ncu-rep ] || { echo "no ncu report"; exit 1; }
ncu -i /tmp/ncu_dw.ncu-rep --page details > "$OUT/dw.txt" 2>&1
ncu -i /tmp/ncu_dw.ncu-rep --page source --csv --print-source sass 2>&1 | gzip -9 > "$OUT/dw_sass.csv.gz"
grep -E "^  [a-zA-Z_].*\(|^  kernel_cutlass|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|Registers Per|Achieved Occupancy|Issue Slots Busy" "$OUT/dw.txt" | cut -c1-110 | head -60
