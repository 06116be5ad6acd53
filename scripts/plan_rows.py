#!/usr/bin/env python3
"""plan_rows.py: where the plan's row is not the fastest, from bench_gemm --all-rows CSVs.

    scripts/plan_rows.py CSV [CSV ...] [--family sm90] [--margin 0.03]

Each CSV is bench_gemm's (`--all-rows --csv FILE`: family, shape, gemm, row,
plan, wgrad, ms, ...); several CSVs (rounds of the same command) are
combined by the median time of each (family, shape, gemm, row, wgrad). For
every (shape, gemm, wgrad) it prints the plan's row and time, the fastest
row and its time, and the plan's time over the fastest; lines where the
fastest row beats the plan's by more than --margin (default 3%) are marked
'*': the candidates for a plan change, to be checked in the layer
(scripts/ab_grid.sh), since an isolated GEMM's gain does not always
survive there (notes/sm90_log.md rungs 15-19). Exit status 0; 2 on bad
input.
"""
import argparse
import csv
import statistics
import sys


def read_rows(paths, family):
    """{(shape, gemm, wgrad): {row: [ms, ...]}} and {(shape, gemm, wgrad): plan row}"""
    times, plan = {}, {}
    for path in paths:
        with open(path, newline="") as f:
            lines = [ln for ln in f if not ln.startswith("#")]
        for rec in csv.DictReader(lines):
            if rec.get("family") != family:
                continue
            key = (rec["shape"], rec["gemm"], rec.get("wgrad", ""))
            ms = float(rec["ms"])
            if ms <= 0:
                continue
            times.setdefault(key, {}).setdefault(rec["row"], []).append(ms)
            if rec.get("plan") == "1":
                plan[key] = rec["row"]
    return times, plan


def report(times, plan, margin, out=sys.stdout):
    """One line per (shape, gemm, wgrad); returns how many were marked."""
    marked = 0
    w = max(len(r) for rows in times.values() for r in rows)
    print(f"{'shape':16s} {'gemm':5s} {'wgrad':7s} {'plan row':{w}s} {'ms':>8s}   "
          f"{'fastest row':{w}s} {'ms':>8s} {'plan/fastest':>12s}", file=out)
    for key in sorted(times):
        rows = {r: statistics.median(v) for r, v in times[key].items()}
        best = min(rows, key=rows.get)
        prow = plan.get(key)
        if prow is None or prow not in rows:
            print(f"{key[0]:16s} {key[1]:5s} {key[2]:7s} {'(no plan row timed)':{w}s} {'':8s}   "
                  f"{best:{w}s} {rows[best]:8.3f}", file=out)
            continue
        ratio = rows[prow] / rows[best]
        flag = "*" if ratio > 1.0 + margin else ""
        marked += flag == "*"
        print(f"{key[0]:16s} {key[1]:5s} {key[2]:7s} {prow:{w}s} {rows[prow]:8.3f}   "
              f"{best:{w}s} {rows[best]:8.3f} {ratio:11.3f}{flag}", file=out)
    return marked


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--family", default="sm90")
    ap.add_argument("--margin", type=float, default=0.03)
    a = ap.parse_args()
    try:
        times, plan = read_rows(a.csv, a.family)
    except (OSError, KeyError, ValueError) as e:
        print(f"plan_rows: {e}", file=sys.stderr)
        return 2
    if not times:
        print(f"plan_rows: no {a.family} rows in {', '.join(a.csv)}", file=sys.stderr)
        return 2
    marked = report(times, plan, a.margin)
    print(f"{marked} of {len(times)} (shape, gemm) pairs have a row more than "
          f"{100 * a.margin:.0f}% faster than the plan's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
