#!/usr/bin/env bash
# Profile one launch of one kernel with Nsight Compute on the GPU machine and
# write text reports (no ncu is needed where they are read):
#   scripts/ncu_kernel.sh NAME 'KERNEL_REGEX' program args...
# e.g. scripts/ncu_kernel.sh dh7b 'kernel<256, 4, 3, 0>' \
#        build/bench_gemm --family sm90 --shape 7B --gemm dh --no-cublas --reps 1 --warmup 0
# Writes $OUT/NAME.txt (the details page: throughput, memory, warp-state
# stall reasons, ...) and $OUT/NAME_sass.csv.gz (per SASS instruction: the
# source line and the sampled stall reasons; scripts/ncu_sass_summary.py
# reads it here). The clocks are left alone (--clock-control none), as the
# machine's notes ask.
set -uo pipefail
name=$1 regex=$2; shift 2
out=${OUT:-/tmp}
rep=/tmp/ncu_$name
ncu --clock-control none --set full --import-source yes --kernel-name-base demangled \
    -k "regex:$regex" -c 1 -f -o "$rep" "$@" > "/tmp/ncu_$name.log" 2>&1
rc=$?
tail -n 5 "/tmp/ncu_$name.log"
[ -f "$rep.ncu-rep" ] || { echo "no report (rc $rc)"; exit 1; }
ncu -i "$rep.ncu-rep" --page details > "$out/$name.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -9 > "$out/${name}_sass.csv.gz"
grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L2 Hit Rate|Registers Per|Achieved Occupancy" "$out/$name.txt" | head -12
