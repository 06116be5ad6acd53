#!/usr/bin/env bash
# Interleaved A/B runs of the layer benchmark, for differences smaller than
# the run-to-run spread (5-10% on one shape between runs of one binary):
#   scripts/ab_grid.sh ROWS "A B ..." [REPS]
# Each of A, B, ... is a path to a smoe_bench binary (run with its
# defaults), or args:OPTIONS with ':' for spaces and '+' for a space inside
# an option's value (build/smoe_bench with those options), e.g.
#   scripts/ab_grid.sh all "build/smoe_bench old/smoe_bench" 3
#   scripts/ab_grid.sh 30B-n512 "build/smoe_bench args:--gemm-row:down=256x4" 3
# REPS rounds (default 3), each running every candidate once in turn; then a
# table per row: the median forward / backward TFLOPS of each candidate, its
# range, and its ratio to the first candidate's median. CSVs go to
# ${OUT:-/tmp}/ab_*.csv. BACKEND=cuda times the portable path (default sm90).
# BENCH=PATH runs the args: candidates with another
# smoe_bench binary. LOOP=S adds smoe_bench's --loop S (S seconds of
# back-to-back forward+backward pairs, at the power limit) and a second
# table: each candidate's median ms and energy (J) per pair, ratio of
# the first's median time to each one's.
set -uo pipefail
rows=$1 cands=$2 reps=${3:-3}
out=${OUT:-/tmp}
bench=${BENCH:-build/smoe_bench} # args: candidates run this binary
i=0
for r in $(seq 1 "$reps"); do
  for c in $cands; do
    tag=$(echo "$c" | tr '/ ' '__')
    if [[ $c == args:* ]]; then
      IFS=: read -ra opts <<< "${c#args:}"
      $bench --rows "$rows" --backend "${BACKEND:-sm90}" ${LOOP:+--loop "$LOOP"} "${opts[@]//+/ }" --csv "$out/ab_${tag}_$r.csv" >/dev/null
    else
      "$c" --rows "$rows" --backend "${BACKEND:-sm90}" ${LOOP:+--loop "$LOOP"} --csv "$out/ab_${tag}_$r.csv" >/dev/null
    fi || { echo "FAILED: $c (round $r)"; exit 1; }
  done
done
python3 - "$out" "$reps" $cands <<'EOF'
import csv, statistics, sys
out, reps, cands = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = {}  # (cand, row) -> [(fwd, bwd)]
loop = {}  # (cand, row) -> [(ms, J)] where the CSV has them (LOOP=S)
order = []
for c in cands:
    tag = c.replace('/', '_').replace(' ', '_')
    for r in range(1, reps + 1):
        for row in csv.DictReader(open(f"{out}/ab_{tag}_{r}.csv")):
            if row['name'] not in order:
                order.append(row['name'])
            res.setdefault((c, row['name']), []).append(
                (float(row['fwd_tflops']), float(row['bwd_tflops'])))
            if row.get('loop_ms'):
                loop.setdefault((c, row['name']), []).append(
                    (float(row['loop_ms']), float(row['loop_j'] or 0)))
print(f"{reps} interleaved rounds; TFLOPS median [min-max], ratio of medians to {cands[0]}")
print(f"{'row':12s} " + " | ".join(f"{c:>34s}" for c in cands))
for name in order:
    cells = []
    base = res[(cands[0], name)]
    bf = statistics.median(x[0] for x in base)
    bb = statistics.median(x[1] for x in base)
    for c in cands:
        v = res[(c, name)]
        f = [x[0] for x in v]
        b = [x[1] for x in v]
        mf, mb = statistics.median(f), statistics.median(b)
        cells.append(f"{mf:5.0f}[{min(f):.0f}-{max(f):.0f}] {mb:5.0f}[{min(b):.0f}-{max(b):.0f}]"
                     f" {mf / bf:4.2f},{mb / bb:4.2f}")
    print(f"{name:12s} " + " | ".join(f"{x:>34s}" for x in cells))
if loop:
    print(f"loop: ms and J per forward+backward pair, median [min-max], ratio of the first's "
          f"median time to each one's (> 1: faster)")
    print(f"{'row':12s} " + " | ".join(f"{c:>34s}" for c in cands))
    for name in order:
        if (cands[0], name) not in loop:
            continue
        b0 = statistics.median(x[0] for x in loop[(cands[0], name)])
        cells = []
        for c in cands:
            v = loop.get((c, name), [])
            if not v:
                cells.append("-")
                continue
            ms = [x[0] for x in v]
            j = statistics.median(x[1] for x in v)
            m = statistics.median(ms)
            cells.append(f"{m:7.3f}[{min(ms):.3f}-{max(ms):.3f}] {j:6.2f}J {b0 / m:4.2f}")
        print(f"{name:12s} " + " | ".join(f"{x:>34s}" for x in cells))
EOF
