"""Prepared experiments on the Hopper varlen-M kernels, for one device call.

Each experiment is a set of source edits (exact string replacements, so an
edit that no longer applies fails loudly instead of silently measuring the
baseline). For each one, on the GPU machine: copy the sources to
/tmp/smoe_exp/<name>, apply its edits, build the sm90 GEMM test and the
benchmarks there (make -j16), run the GEMM test's correctness cases, the
Hopper GEMMs' timings (bench_gemm --family sm90, the plan rows) and the
layer benchmark on three grid rows. A short
summary comes last; full logs go to $OUT/<name>.log.

    python3 scripts/sm90_experiments.py [name ...]      (default: all)

An experiment that wins is then applied to src/ by hand and committed with
its numbers in bench/RESULTS.md; this script only measures.
"""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GG = "src/cuda/sm90/grouped_gemm_sm90.cu"
PTX = "src/cuda/sm90/ptx_sm90.cuh"

# The shared-memory base derived by an integer round trip loses its address
# space: every access through it is a generic LD/ST (1003 in the SASS of
# grouped_gemm_sm90.o, 0 after this edit). notes/sm90_log.md, rung 5.
SMEM = (GG,
        "    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);\n",
        "    uint8_t *smem = smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw)"
        " & 1023u)) & 1023u);\n")
# 256-byte L2 prefetch on the gathered rows' cp.async (the row's next
# k-blocks come into L2 with the first miss). notes/sm90_gather_research.md.
L2_256 = (PTX,
          '"cp.async.cg.shared.global [%0], [%1], 16, %2;"',
          '"cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;"')

EXPERIMENTS = {
    "base": [],
    "smem": [SMEM],
    "smem_l2": [SMEM, L2_256],
}

ROWS = "7B-n256,30B-n512,120B-n1024"


def run(cmd, cwd, log, timeout):
    log.write("$ %s\n" % " ".join(cmd))
    log.flush()
    try:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = 124
    log.write(out)
    log.write("[rc %d]\n" % rc)
    log.flush()
    return rc, out


def experiment(name, edits, out_dir):
    work = "/tmp/smoe_exp/" + name
    shutil.rmtree(work, ignore_errors=True)
    for part in ("include", "src", "tests", "bench", "Makefile"):
        src = os.path.join(ROOT, part)
        dst = os.path.join(work, part)
        if os.path.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.o"))
        else:
            os.makedirs(work, exist_ok=True)
            shutil.copy(src, dst)
    for path, old, new in edits:
        f = os.path.join(work, path)
        text = open(f).read()
        if text.count(old) != 1:
            return ["%s: edit does not apply to %s" % (name, path)]
        open(f, "w").write(text.replace(old, new))
    summary = []
    with open(os.path.join(out_dir, name + ".log"), "w") as log:
        rc, out = run(["make", "-j16", "build/tests/gpu/test_gemm_sm90", "build/bench_gemm",
                       "build/smoe_bench"], work, log, 400)
        if rc != 0:
            return ["%s: build failed (see %s.log)" % (name, name)]
        rc, out = run(["build/tests/gpu/test_gemm_sm90"], work, log, 240)
        summary.append("%s: correctness rc %d, %s" % (name, rc, out.strip().splitlines()[-1]
                                                      if out.strip() else "no output"))
        rc, out = run(["build/bench_gemm", "--family", "sm90"], work, log, 240)
        summary += ["%s: %s" % (name, l) for l in out.splitlines() if " plan " in l]
        rc, out = run(["build/smoe_bench", "--rows", ROWS, "--backend", "sm90"], work, log, 240)
        table = out.splitlines()
        summary += ["%s: %s" % (name, l) for l in table[-(len(ROWS.split(",")) + 1):]]
    return summary


def main():
    names = sys.argv[1:] or list(EXPERIMENTS)
    out_dir = os.environ.get("OUT", "/tmp/smoe_exp_out")
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    for name in names:
        lines += experiment(name, EXPERIMENTS[name], out_dir)
        print("\n".join(l for l in lines if l.startswith(name)), flush=True)
    print("\n== summary")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
