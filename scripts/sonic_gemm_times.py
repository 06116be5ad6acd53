#!/usr/bin/env python3
"""sonic_gemm_times.py: SonicMoE's time for each of its GEMMs, GEMM by GEMM,
beside ours.

    scripts/sonic_gemm_times.py RECORDS [--ours CSV ...] [--rows models|grid|all]

RECORDS is the sonic-new.tar.xz that scripts/compare_device.sh leaves in
its $OUT, or a folder with QuACK's *.autotune.json files below it. QuACK
autotunes each GEMM on its first call and records every config's time
(triton.testing.do_bench, L2 cleared before each call; median, 20th and
80th percentiles), so a compare run leaves SonicMoE's GEMM times on the live
routing of that run. The records are keyed by tensor shapes; this script
matches them to the six GEMMs of each row of bench/grid.h (up, down, dh, dxt,
dw1, dw2 in our names) and prints the best config's median and the config
(tile m x n, "pp" ping-pong, "c" cluster m n).

--stages takes the output (stdout and stderr together) of
`smoe_bench --rows ... --stages`: the layer's own time for each stage, mean
of 3 calls, the L2 flushed before each call but not between its stages;
its up, down, dh, dxt, dw1 and dw2 go beside SonicMoE's (dh's stage holds
the dS reduction too). This is the comparison to make: session 24 found
bench_gemm's random routing reading dxt 15-20% slower than the same kernel
runs in the layer (notes/sm90_log.md rung 21).

--ours takes bench_gemm --csv files instead: each GEMM's plan row (the bf16
weight gradients), with SonicMoE's time over ours (> 1: ours faster).
bench_gemm flushes L2 too; its routing is its own (random by default), not
compare.py's router. Where both are given, the stages win.
"""
import argparse
import csv
import glob
import json
import os
import re
import sys
import tarfile
import tempfile

GEMMS = ("up", "down", "dh", "dxt", "dw1", "dw2")


def shapes_of_grid(path, table):
    """{name: (T, d, n, E, K)} of one row table of bench/grid.h."""
    text = open(path).read()
    start = text.index("smoe_grid_row %s[] = {" % table)
    body = text[start:text.index("};", start)]
    row = re.compile(r'\{"([^"]+)",\s*"[^"]+",((?:\s*\d+,){5})')
    return {m.group(1): tuple(int(v) for v in m.group(2).split(",")[:5])
            for m in row.finditer(body)}


def records(path):
    """[(kind, [shape tuples], best median ms, config)] of every record."""
    tmp = None
    if os.path.isfile(path):
        tmp = tempfile.TemporaryDirectory()
        with tarfile.open(path) as t:
            t.extractall(tmp.name, filter="data")
        path = tmp.name
    out = []
    for f in glob.glob(os.path.join(path, "**", "*.autotune.json"), recursive=True):
        kind = os.path.basename(f).replace(".autotune.json", "")
        for line in open(f):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            shapes = [tuple(int(v) for v in re.findall(r"\d+", k))
                      for k in rec["key"] if k.startswith("torch.Size")]
            timed = [c for c in rec["configs_timings"] if c[1]]
            if not timed:
                continue
            cfg, t = min(timed, key=lambda c: c[1][0])
            m = re.search(r"tile_m=(\d+), tile_n=(\d+), pingpong=(\w+), "
                          r"is_dynamic_persistent=\w+, cluster_m=(\d+), cluster_n=(\d+)", cfg)
            name = ("%sx%s%s c%s%s" % (m.group(1), m.group(2), "pp" if m.group(3) == "True"
                                       else "", m.group(4), m.group(5))) if m else cfg[:24]
            out.append((kind, shapes, t[0], name))
    if tmp:
        tmp.cleanup()
    return out


def sonic_gemms(recs, T, d, n, E, K):
    """{gemm: (ms, config)}: the fastest record matching each GEMM's shapes."""
    R = T * K
    want = {  # (record kind, first two tensor shapes)
        "up": ("gemm_gated_tuned", (T, d), (E, d, 2 * n)),
        "dh": ("gemm_dgated_tuned", (T, d), (E, d, n)),
        "down": ("gemm_tuned", (R, n), (E, n, d)),
        "dxt": ("gemm_tuned", (R, 2 * n), (E, 2 * n, d)),
        "dw1": ("gemm_tuned", (d, T), (R, 2 * n)),
        "dw2": ("gemm_tuned", (d, T), (R, n)),
    }
    got = {}
    for g, (kind, a, b) in want.items():
        hits = [(ms, cfg) for k, s, ms, cfg in recs if k == kind and s[:2] == [a, b]]
        if hits:
            got[g] = min(hits)
    return got


def ours_of(paths):
    """{(shape, gemm): ms} of the plan rows in bench_gemm CSVs (bf16 weight
    gradients; the last file wins)."""
    ours = {}
    for p in paths:
        for r in csv.DictReader(open(p)):
            if r["plan"] == "1" and r["wgrad"] in ("", "bf16"):
                ours[(r["shape"], r["gemm"])] = float(r["ms"])
    return ours


def stages_of(paths):
    """{(row, gemm): ms} from smoe_bench --stages output: each block of stage
    lines belongs to the row line that follows it ("NAME  T=...")."""
    ours, pending = {}, {}
    stage = re.compile(r"^\s+(up|down|dh|dxt|dw1|dw2)\s+([0-9.]+) ms\s")
    row = re.compile(r"^(\S+)\s+T=\d+")
    for p in paths:
        for line in open(p):
            m = stage.match(line)
            if m:
                pending[m.group(1)] = float(m.group(2))
                continue
            m = row.match(line)
            if m:
                for g, ms in pending.items():
                    ours[(m.group(1), g)] = ms
                pending = {}
    return ours


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("--ours", action="append", default=[])
    ap.add_argument("--stages", action="append", default=[])
    ap.add_argument("--rows", default="all", choices=("models", "grid", "all"))
    a = ap.parse_args()
    grid_h = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "grid.h")
    rows = {}
    if a.rows in ("models", "all"):
        rows.update(shapes_of_grid(grid_h, "smoe_model_rows"))
    if a.rows in ("grid", "all"):
        rows.update(shapes_of_grid(grid_h, "smoe_grid"))
    recs = records(a.records)
    if not recs:
        sys.exit("no QuACK autotune records under %s" % a.records)
    ours = ours_of(a.ours)
    ours.update(stages_of(a.stages))
    print("# SonicMoE: best config's median ms and config; ours: %s ms and SonicMoE / ours"
          % ("the layer's stage" if a.stages else "bench_gemm plan row"))
    print("%-16s %s" % ("row", " ".join("%-30s" % g for g in GEMMS)))
    for name, (T, d, n, E, K) in rows.items():
        got = sonic_gemms(recs, T, d, n, E, K)
        if not got:
            continue
        cells = []
        for g in GEMMS:
            s = got.get(g)
            o = ours.get((name, g))
            c = "%6.3f %-11s" % s if s else "%-18s" % "-"
            if o:
                c += " %6.3f" % o + (" %4.2f" % (s[0] / o) if s else "")
            cells.append("%-30s" % c)
        print("%-16s %s" % (name, " ".join(cells)))


if __name__ == "__main__":
    main()
