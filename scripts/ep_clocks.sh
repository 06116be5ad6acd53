#!/usr/bin/env bash
# ep_clocks.sh: SM clocks, power and the clock-event reasons of every GPU,
# sampled by nvidia-smi every 100 ms beside a list of runs, so that a run
# that is slower beside NCCL can be told apart as power (lower clocks, the
# power-cap reason set) or not (the same clocks).
#
#   BIN=/tmp/ab_m48 CASES="p1|-P 1 -r 30B-n512 -x 524288 -q 2;p2|-P 2 -r 30B-n512 -x 524288 -q 2" \
#     bash scripts/ep_clocks.sh
#
# BIN: a directory holding smoe_ep_bench (an extracted .prebuilt tarball).
# CASES: ';'-separated label|args[|VAR=value,...]; each case runs REPS times
# (default 3) back to back with -i 64. Per case and GPU it prints the
# samples taken while that GPU drew more than BUSY_W watts (default 300: the
# process's start and its host barriers are left out), their median SM
# clock and power, and the share of them with a power reason set (SW power
# cap, HW slowdown or HW power brake). Raw samples in $OUT/smi.csv, each
# case's output in $OUT/<label>.log.
set -uo pipefail
. "$(dirname "$0")/nccl_env.sh"
o=${OUT:-/tmp/ep_clocks}; mkdir -p "$o"; : > "$o/marks"
bin=${BIN:?set BIN}
fields=timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits > /dev/null 2>&1 ||
  fields=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 100 > "$o/smi.csv" 2>&1 &
smi=$!
sleep 1
IFS=';' read -ra CS <<< "${CASES:?set CASES}"
for c in "${CS[@]}"; do
  IFS='|' read -r lab args env <<< "$c"
  s=$(date +%s.%N)
  for _ in $(seq 1 "${REPS:-3}"); do
    # shellcheck disable=SC2086
    env ${env//,/ } timeout 120 "$bin/smoe_ep_bench" $args -i 64 >> "$o/$lab.log" 2>&1 ||
      echo "  ($lab rc=$?)"
  done
  echo "$lab $s $(date +%s.%N)" >> "$o/marks"
  echo "$lab: $(grep '^quick.*EP fwd' "$o/$lab.log" | sed 's/ (sm90.*//' | tr '\n' ' ')"
  sleep 1
done
kill "$smi"
python3 - "$o" "${BUSY_W:-300}" <<'EOF'
import sys, datetime, statistics as st
o, busy = sys.argv[1], float(sys.argv[2])
rows = []
for line in open(o + "/smi.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, int(f[1]), float(f[2]), float(f[3]), int(f[4], 16), float(f[5])))
    except (ValueError, IndexError):
        pass
# power reasons: SW power cap 0x4, HW slowdown 0x8, HW power brake 0x80
PW = 0x4 | 0x8 | 0x80
print(f"{'case':10} gpu  busy/all  clock MHz [p10-p90]    power W   power-reason  temp C")
for m in open(o + "/marks"):
    lab, s, e = m.split()
    s, e = float(s), float(e)
    for g in sorted({r[1] for r in rows}):
        a = [r for r in rows if r[1] == g and s <= r[0] <= e]
        b = [r for r in a if r[3] >= busy]
        if not b:
            print(f"{lab:10} {g:3}  {0:4}/{len(a):<4} (idle)")
            continue
        ck = sorted(r[2] for r in b)
        q = lambda p: ck[min(len(ck) - 1, int(p * len(ck)))]
        pr = sum(1 for r in b if r[4] & PW) / len(b)
        print(f"{lab:10} {g:3}  {len(b):4}/{len(a):<4} {st.median(ck):6.0f} [{q(.1):4.0f}-{q(.9):4.0f}]"
              f"   {st.median(r[3] for r in b):6.0f}   {100 * pr:9.0f}%   {max(r[5] for r in b):4.0f}")
EOF
