#!/usr/bin/env python3
"""ncu_sass_summary.py: read the per-instruction page that scripts/ncu_kernel.sh
writes (NAME_sass.csv.gz, or a plain .csv from `ncu -i R --page source --csv
--print-source sass`) without ncu:

    scripts/ncu_sass_summary.py FILE [--top N] [--bucket BYTES] [--per COUNT]
                                     [--range NAME:LO:HI ...]

Prints the stall reasons over all samples, the N instructions with the most
samples (with their two main reasons and how often they ran), the samples
and executed instructions per BYTES of code from the kernel's start (where
a main loop, an epilogue, a producer sit shows as a run of heavy buckets),
and for each --range (offsets from the kernel's start, hex) its share of the
samples, its reasons, and its executed instructions divided by COUNT (e.g.
the consumer warps times the tiles: instructions per warp and tile).
notes/sm90_log.md rung 26 has an example of reading it.
"""
import argparse
import csv
import gzip
import io


def load(path):
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    lines = [l for l in raw.read().splitlines()]
    start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    return rows[0], rows[1:]


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bucket", type=lambda s: int(s, 0), default=0x800)
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--range", action="append", default=[])
    a = ap.parse_args()
    hdr, data = load(a.file)
    i_s = hdr.index("Warp Stall Sampling (All Samples)")
    i_e = hdr.index("Instructions Executed")
    reasons = [(i, h[6:]) for i, h in enumerate(hdr)
               if h.startswith("stall_") and "Not Issued" not in h]
    data = [r for r in data if r and r[0].startswith("0x")]
    base = int(data[0][0], 16)
    total = sum(num(r[i_s]) for r in data) or 1.0

    def why(rows, k=8):
        s = {name: sum(num(r[i]) for r in rows) for i, name in reasons}
        t = sum(s.values()) or 1.0
        return " ".join(f"{n} {v / t * 100:.0f}%" for n, v in
                        sorted(s.items(), key=lambda x: -x[1])[:k] if v > 0)

    print(f"{a.file}: {len(data)} instructions, {total:.0f} samples")
    print("reasons:", why(data, 10))
    print(f"\ntop {a.top} instructions by samples (offset, % of samples, executed, SASS, reasons)")
    for r in sorted(data, key=lambda r: -num(r[i_s]))[:a.top]:
        main2 = sorted(((num(r[i]), n) for i, n in reasons), reverse=True)[:2]
        print(f"  {int(r[0], 16) - base:6x} {num(r[i_s]) / total * 100:5.2f} {num(r[i_e]):>10.0f}"
              f"  {r[1][:56]:56s} {' '.join(f'{n} {int(v)}' for v, n in main2 if v > 0)}")
    print(f"\nper {a.bucket:#x} bytes of code (offset, % of samples, executed instructions)")
    b = {}
    for r in data:
        k = (int(r[0], 16) - base) // a.bucket
        s, e = b.get(k, (0.0, 0.0))
        b[k] = (s + num(r[i_s]), e + num(r[i_e]))
    for k in sorted(b):
        if b[k][0] / total >= 0.005:
            print(f"  {k * a.bucket:6x} {b[k][0] / total * 100:5.1f}% {b[k][1]:10.3g}")
    for spec in a.range:
        name, lo, hi = spec.split(":")
        lo, hi = int(lo, 16), int(hi, 16)
        sel = [r for r in data if lo <= int(r[0], 16) - base < hi]
        s = sum(num(r[i_s]) for r in sel)
        e = sum(num(r[i_e]) for r in sel)
        print(f"\n{name} [{lo:#x}, {hi:#x}): {s / total * 100:.1f}% of samples, "
              f"{e / a.per:.0f} instructions per {a.per:g}; {why(sel)}")


if __name__ == "__main__":
    main()
