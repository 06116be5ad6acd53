#!/usr/bin/env python3
"""kernel_map.py: where the time goes, kernel by kernel, from compare.py --kernels.

    bench/kernel_map.py KERNELS.txt [--what forward+backward|forward]

compare.py --kernels FILE appends, for each implementation and row, the GPU
time per call of every kernel of a forward and of a forward + backward
(torch.profiler, same call for every implementation). This groups smoe's
kernels by the step they run (up, down, dh, dxt, dw = dW1 + dW2, agg =
the aggregations, other) and prints them beside SonicMoE's, one line per
row, in microseconds per call. SonicMoE's QuACK GEMMs are named by their
tile configuration, so GEMMs with the same configuration share one entry:
its up and dh are named by their epilogues, the rest is listed as
'gemms' (time x launches), largest first.
"""
import argparse
import re
import sys

HEAD = re.compile(r"## (\S+) T=(\d+) d=(\d+) n=(\d+) E=(\d+) K=(\d+) (forward\+backward|forward):")
LINE = re.compile(r"\s*([\d.]+) us\s+[\d.]+%\s+([\d.]+) x\s+(.*)")
SMOE_MODE = {"0": "up", "1": "down", "2": "dxt", "3": "dh"}  # sm90_grouped_gemm_kernel<BN, ST, MODE, FL>


def step_of(impl, name):
    """The layer step a kernel runs, or None for SonicMoE's other GEMMs."""
    if impl.startswith("smoe"):
        m = re.search(r"sm90_grouped_gemm_kernel<\d+, \d+, (\d),", name)
        if m:
            return SMOE_MODE[m.group(1)]
        if "vk_varlen_k" in name:
            return "dw"
        if "aggregate" in name:
            return "agg"
        return "other"
    if "dactGemmDGated" in name:
        return "dh"
    if "actGemmGated" in name:
        return "up"
    if "quackgemm" in name:
        return None
    if "token_gather_sum" in name:
        return "agg"
    return "other"


def parse(path, what):
    """{(row shape, impl): {step: us, 'gemms': [(us, launches)]}}"""
    out, cur, impl = {}, None, None
    with open(path) as f:
        for line in f:
            h = HEAD.match(line)
            if h:
                cur, impl = None, h.group(1)
                if h.group(7) == what:
                    cur = out.setdefault((h.groups()[1:6], impl), {})
                continue
            m = LINE.match(line)
            if cur is None or not m:
                continue
            us, calls, name = float(m.group(1)), float(m.group(2)), m.group(3)
            step = step_of(impl, name)
            if step is None:
                cur.setdefault("gemms", []).append((us, calls))
            else:
                cur[step] = cur.get(step, 0.0) + us
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernels")
    ap.add_argument("--what", default="forward+backward", choices=["forward+backward", "forward"])
    a = ap.parse_args(argv)
    data = parse(a.kernels, a.what)
    shapes = list(dict.fromkeys(s for s, _ in data))
    steps = ("up", "down", "dh", "dxt", "dw", "agg", "other")
    print("# %s, us per call; smoe's steps, then SonicMoE's (its GEMMs by config)" % a.what)
    for s in shapes:
        print("T=%s d=%s n=%s E=%s K=%s" % s)
        for (shape, impl), v in data.items():
            if shape != s:
                continue
            parts = ["%s %.0f" % (k, v[k]) for k in steps if k in v]
            if "gemms" in v:
                g = sorted(v["gemms"], reverse=True)
                parts.append("gemms " + ", ".join("%.0f x%g" % x for x in g))
            print("  %-22s %s" % (impl, "; ".join(parts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
