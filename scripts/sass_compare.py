#!/usr/bin/env python3
"""sass_compare.py: is the device code of two builds the same, kernel by kernel?

    scripts/sass_compare.py BEFORE AFTER [--cuobjdump PATH] [--show N]

BEFORE and AFTER are folders (every *.o below them is read) or single
objects / libraries. For every object, `cuobjdump -sass` is split into
functions keyed by (arch, mangled name), wherever the function was compiled
(a kernel may move from one .cu to another); each function's instructions
are compared without their addresses, then with their encodings, and
`cuobjdump -res-usage` per (arch, function). It prints the counts and every
difference, and exits 1 if the sets of functions or any of them differ.

For a host-only refactoring (moving code between files): build the library
before (`make lib`, copy build/src aside) and after, then compare the two
folders. No GPU is needed; cuobjdump comes with the CUDA toolkit (or a
Triton wheel: triton/backends/nvidia/bin/cuobjdump), found on PATH, at
$CUOBJDUMP, or given with --cuobjdump.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

INSN = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
ENC2 = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
FUNC = re.compile(r"^\s*Function : (\S+)\s*$")
ARCH = re.compile(r"^arch = (\S+)\s*$")
RES_FUNC = re.compile(r"^\s*Function (\S+):\s*$")


def objects(path):
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.o"), recursive=True))
    return [path]


def run(tool, flag, obj):
    r = subprocess.run([tool, flag, obj], capture_output=True, text=True)
    if r.returncode != 0 and "does not contain device code" not in r.stderr:
        sys.exit(f"sass_compare: {tool} {flag} {obj} failed: {r.stderr.strip()}")
    return r.stdout


def sass(tool, obj, funcs):
    """funcs[(arch, name)] -> list of (insns, encodings), one per copy."""
    arch, cur = None, None
    for line in run(tool, "-sass", obj).splitlines():
        m = ARCH.match(line)
        if m:
            arch, cur = m.group(1), None
            continue
        m = FUNC.match(line)
        if m:
            cur = ([], [])
            funcs.setdefault((arch, m.group(1)), []).append(cur)
            continue
        if cur is None:
            continue
        m = INSN.match(line)
        if m:
            cur[0].append(re.sub(r"\s+", " ", m.group(1)))
            cur[1].append(m.group(2))
            continue
        m = ENC2.match(line)
        if m:
            cur[1].append(m.group(1))


def res_usage(tool, obj, res):
    arch, name = None, None
    for line in run(tool, "-res-usage", obj).splitlines():
        m = ARCH.match(line)
        if m:
            arch, name = m.group(1), None
            continue
        m = RES_FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        if name and line.strip():
            res.setdefault((arch, name), []).append(line.strip())
            name = None


def collect(tool, path):
    funcs, res = {}, {}
    objs = objects(path)
    if not objs:
        sys.exit(f"sass_compare: no objects under {path}")
    for o in objs:
        sass(tool, o, funcs)
        res_usage(tool, o, res)
    return objs, funcs, res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    ap.add_argument("--show", type=int, default=20, help="differences listed at most")
    a = ap.parse_args()
    if not a.cuobjdump:
        sys.exit("sass_compare: no cuobjdump on PATH (set $CUOBJDUMP or pass --cuobjdump)")
    ob, fb, rb = collect(a.cuobjdump, a.before)
    oa, fa, ra = collect(a.cuobjdump, a.after)
    print(f"before: {len(ob)} objects, {len(fb)} (arch, function) pairs")
    print(f"after:  {len(oa)} objects, {len(fa)} (arch, function) pairs")
    archs = sorted({k[0] for k in fb} | {k[0] for k in fa})
    for ar in archs:
        nb = sum(1 for k in fb if k[0] == ar)
        na = sum(1 for k in fa if k[0] == ar)
        print(f"  {ar}: {nb} before, {na} after")
    bad = 0

    def report(what, keys, detail=None):
        nonlocal bad
        if not keys:
            return
        bad += len(keys)
        print(f"{what}: {len(keys)}")
        for k in sorted(keys)[: a.show]:
            print(f"  {k[0]} {k[1]}")
            if detail:
                print(detail(k))

    report("only before", set(fb) - set(fa))
    report("only after", set(fa) - set(fb))
    common = set(fb) & set(fa)
    report("copies differ in number", {k for k in common if len(fb[k]) != len(fa[k])})
    same = {k for k in common if len(fb[k]) == len(fa[k])}
    key = lambda c: (c[0], c[1])
    report("instructions differ",
           {k for k in same if sorted(c[0] for c in fb[k]) != sorted(c[0] for c in fa[k])})
    report("encodings differ",
           {k for k in same if sorted(map(key, fb[k])) != sorted(map(key, fa[k]))})
    report("resource usage differs",
           {k for k in set(rb) | set(ra) if sorted(rb.get(k, [])) != sorted(ra.get(k, []))},
           lambda k: f"    before: {'; '.join(rb.get(k, []))}\n"
                     f"    after:  {'; '.join(ra.get(k, []))}")
    n_insn = sum(len(c[0]) for k in same for c in fa[k])
    n_code = sum(1 for k in same if sorted(map(key, fb[k])) == sorted(map(key, fa[k])))
    print(f"instructions and encodings identical: {n_code} of {len(set(fb) | set(fa))} "
          f"(arch, function) pairs")
    if bad:
        print(f"DIFFERENT: {bad} difference(s)")
        return 1
    print(f"IDENTICAL: {len(same)} (arch, function) pairs, {n_insn} instructions, "
          f"encodings and resource usage")
    return 0


if __name__ == "__main__":
    sys.exit(main())
