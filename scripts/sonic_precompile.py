#!/usr/bin/env python3
"""sonic_precompile.py: build, on a machine WITHOUT a GPU, every kernel that
SonicMoE (0.1.2.post1 over quack-kernels 0.3.11, nvidia-cutlass-dsl 4.4.2,
triton 3.6.0) compiles on its first forward+backward on an H100 (sm_90a):
QuACK's GEMM candidates into QuACK's disk cache, the Triton kernels' candidates
into Triton's; a device run then loads them and only times the candidates
(its autotuning is unchanged).

Why this works:
- QuACK's GEMM entry points (quack/gemm.py, gemm_act.py, gemm_dact.py) compile
  through `jit_cache` (quack/cache_utils.py): the compile takes symbolic sizes
  (fake CuTe tensors), its key is (function, dtypes, majors, tile, cluster,
  pingpong, epilogue flags, varlen/gather flags, device capability) and never
  a tensor size, and the result is exported with `export_to_c` to
  $QUACK_CACHE_DIR/<fingerprint>/<sha256 of the key>.o. The fingerprint
  hashes the Python minor version, the cutlass-dsl and tvm-ffi versions and
  QuACK's own sources, so a cache made here from the same unpacked wheels is
  found by the device. The .o holds x86-64 host code and an sm_90a cubin; the
  device loads it with `cute.runtime.load_module` (milliseconds).
- QuACK's autotuner (quack/autotuner.py) first compiles configs[0]
  in-process; when that takes under 0.5 s (a cache hit) it starts no compile
  workers, then times every candidate, each loaded from the cache.
- The compile needs no GPU: QUACK_ARCH=90 replaces the capability query,
  CUTE_DSL_ARCH=sm_90a the DSL's, and the DSL's only driver use is a
  `cuInit(0)` check before its JIT step (cutlass/base_dsl/compiler.py), which
  fails when libcuda.so.1 cannot be loaded, and with the CUDA toolkit's link
  stub too (cuda-bindings finds cuInit through cuGetProcAddress, which the
  stub answers with an error). This script builds a small stand-in
  libcuda.so.1 (C, compiled with cc into a temp folder) whose cuInit succeeds
  and whose other entry points return CUDA_ERROR_STUB_LIBRARY, and runs
  itself again with it on LD_LIBRARY_PATH. No kernel is launched.
- Triton compiles without a GPU given a target: JITFunction.run(...,
  warmup=True) compiles into TRITON_CACHE_DIR and launches nothing; the
  device finds the kernel when the cache key matches (same triton build, same
  source, specialization and options). Triton's group files record absolute
  paths: the device must unpack the cache to the same path (--out).

What it does: under torch's FakeTensorMode (device "cuda", no memory), it
runs SonicMoE's own layer function (`moe_TC_softmax_topk_layer`, tensors laid
out as bench/compare.py passes them) and then its backward nodes, for each
configuration asked for, with SonicMoE's and QuACK's custom operators
replaced by the Python functions they wrap, SonicMoE's CuTe top-K kernel
(kept in memory only, never on disk) by a no-op, QuACK's
`Autotuner.__call__` by a loop that compiles every candidate the real
autotuner would time (the same pruning) with quack.cache_utils.COMPILE_ONLY
set (as QuACK's own compile workers do), Triton's launches by compiles and
Triton's autotuner by a loop over its pruned candidates. QuACK's kernel keys
do not depend on T, d, n, E or K (the first configuration compiles all 80,
the others hit them); Triton's depend on d and K (constexprs).

Usage (Python 3.12 with torch 2.11, triton 3.6.0 and cuda-bindings; the
wheels of notes/compare.md unpacked into SITE):
    python3.12 scripts/sonic_precompile.py --site /tmp/cmp-site \
        --out /tmp/sonic-cache --jobs 2 --tar .sonic-cache/sonic-cache.tar.xz
On the device: tar -xJf .sonic-cache/sonic-cache.tar.xz -C /tmp, then
QUACK_CACHE_DIR=/tmp/sonic-cache/quack TRITON_CACHE_DIR=/tmp/sonic-cache/triton.

Options: --rows (rows of bench/grid.h, comma-separated, all, models; default
all), --shape T,d,n,E,K (repeatable), --jobs N (compile processes; each takes
every N-th candidate of each autotuned kernel), --no-triton (QuACK only),
--list (count the kernels and candidates, compile nothing), --tar FILE
(xz-compressed tar of --out, without lock files and Triton's IR files).
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB_ENV = "SONIC_PRECOMPILE_STUB"  # set once the stand-in driver is in place

STUB_C = r"""
/* Stand-in libcuda.so.1 for compiling without a GPU (scripts/sonic_precompile.py).
 * cuInit and cuDriverGetVersion succeed; every other driver entry point (the
 * names the CUDA toolkit's link stub exports, generated into STUB_NAMES)
 * returns CUDA_ERROR_STUB_LIBRARY (34). cuGetProcAddress, through which
 * cuda-bindings finds the entry points, looks names up in that table. */
#include <stdio.h>
#include <string.h>

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *v) { if (v) *v = 13000; return 0; }

#define STUB(name) int name(void) { return 34; }
STUB_DEFS
#undef STUB

static const struct { const char *name; void *fn; } table[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
#define STUB(name) {#name, (void *)name},
STUB_DEFS
#undef STUB
};

static int lookup(const char *sym, void **pfn) {
    static const char *suffix[] = {"_v3", "_v2", ""};
    char name[256];
    for (int s = 0; s < 3; s++) {
        snprintf(name, sizeof name, "%s%s", sym, suffix[s]);
        for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
            if (!strcmp(table[i].name, name)) { *pfn = table[i].fn; return 0; }
    }
    *pfn = 0;
    return 500; /* CUDA_ERROR_NOT_FOUND */
}

int cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags,
                        int *status) {
    (void)ver; (void)flags;
    int r = lookup(sym, pfn);
    if (status) *status = r ? 2 : 1; /* SYMBOL_NOT_FOUND : SUCCESS */
    return r;
}

int cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    (void)ver; (void)flags;
    return lookup(sym, pfn);
}
"""

SKIP_EXPORT = {"cuInit", "cuDriverGetVersion", "cuGetProcAddress", "cuGetProcAddress_v2"}


def find_toolkit_stub():
    cands = []
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base:
            cands += [os.path.join(base, sub, "stubs", "libcuda.so")
                      for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for c in cands:
        if os.path.exists(c):
            return os.path.realpath(c)
    return None


def driver_loads():
    """True when libcuda.so.1 loads and cuInit(0) returns without raising."""
    code = ("import cuda.bindings.driver as d; r = d.cuInit(0); "
            "print('ok' if r is not None else 'bad')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return p.returncode == 0 and p.stdout.strip() == "ok"


def build_stub(folder):
    """Compile the stand-in libcuda.so.1 into `folder`; return the folder.
    The entry point names come from the CUDA toolkit's link stub (only its
    symbol table is read); without one, only the three functions above exist."""
    stub = find_toolkit_stub()
    syms = []
    if stub is not None:
        words = subprocess.run(["nm", "-D", "--defined-only", stub], capture_output=True,
                               text=True, check=True).stdout.split()
        # `nm -D` lines: address, type, name; keep the text symbols.
        syms = sorted({words[i + 2] for i in range(0, len(words) - 2, 3)
                       if words[i + 1] in ("T", "W") and words[i + 2].startswith("cu")}
                      - SKIP_EXPORT)
    defs = " ".join("STUB(%s)" % s for s in syms)
    c_path = os.path.join(folder, "cudastub.c")
    with open(c_path, "w") as f:
        f.write("#define STUB_DEFS %s\n%s" % (defs, STUB_C))
    so = os.path.join(folder, "libcuda.so.1")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", so, c_path], check=True)
    link = os.path.join(folder, "libcuda.so")
    if not os.path.exists(link):
        os.symlink("libcuda.so.1", link)
    return folder


def ensure_driver():
    """Make libcuda.so.1 loadable: run this script again with the stand-in
    on LD_LIBRARY_PATH when no driver loads."""
    if os.environ.get(STUB_ENV) or driver_loads():
        return
    folder = tempfile.mkdtemp(prefix="sonic-cudastub-")
    build_stub(folder)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = folder + (":" + env["LD_LIBRARY_PATH"]
                                       if env.get("LD_LIBRARY_PATH") else "")
    env[STUB_ENV] = folder
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def setup_paths(site):
    """The unpacked wheels: SITE and the cutlass-dsl package folder (its .pth
    file is not read from a PYTHONPATH folder)."""
    if site:
        for p in (os.path.join(site, "nvidia_cutlass_dsl", "python_packages"), site):
            if p not in sys.path:
                sys.path.insert(0, p)
    bench = os.path.join(ROOT, "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)


def configs_from_args(args):
    import compare  # bench/: the same --rows / --shape selection as the run
    return compare.parse_configs(args)


class Stats:
    def __init__(self):
        self.per_fn = {}  # name -> dict(configs, compiled, hits, failed, seconds)
        self.errors = []

    def add(self, name):
        return self.per_fn.setdefault(name, {"calls": 0, "configs": 0, "compiled": 0,
                                             "hit": 0, "failed": 0, "seconds": 0.0})


def patch_for_compile(stats, part, nparts, list_only, triton_too):
    """Route SonicMoE's calls to the Python code under its custom operators and
    replace QuACK's (and, with triton_too, Triton's) autotuner call with
    compile-every-candidate."""
    import torch
    import quack.cache_utils as cache_utils
    import quack.autotuner as autotuner
    import quack.gemm_interface as gi
    import sonicmoe.functional as sf
    from sonicmoe.functional import forward as sf_fwd
    from sonicmoe.functional import backward as sf_bwd

    cache_utils.COMPILE_ONLY = True

    # Custom operators dispatch to their fake kernels under FakeTensorMode;
    # every one that SonicMoE's layer reaches is replaced, in the module that
    # calls it, by the Python function it wraps (its `_init_fn`).
    import sonicmoe.functional.triton_kernels as sf_tk
    for mod in (gi, sf, sf_fwd, sf_bwd, sf_tk):
        for nm, obj in list(vars(mod).items()):
            if hasattr(obj, "_init_fn") and type(obj).__name__ == "CustomOpDef":
                setattr(mod, nm, obj._init_fn)

    def noop(*a, **k):
        return None

    # SonicMoE's CuTe top-K kernel keeps its compiled kernel in memory only
    # (forward.py's _topk_fwd.compile_cache): nothing to put on disk.
    sf_fwd._topk_fwd = noop
    if triton_too:
        patch_triton(stats, part, nparts, list_only)
    else:
        for mod in (sf, sf_fwd, sf_bwd):
            for nm in ("_topk_softmax_bwd", "_router_forward", "_token_broadcast_backward",
                       "TC_topk_router_metadata_triton", "token_gather_and_sum_varlen_K_triton"):
                if hasattr(mod, nm):
                    setattr(mod, nm, noop)

    def compile_all(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        allargs = dict(self.nargs, **kwargs)
        flags = (("cu_seqlens_m", "varlen_m"), ("cu_seqlens_k", "varlen_k"),
                 ("A_idx", "gather_A"), ("colvec_scale", "scale"))
        name = "%s(%s)" % (self.fn.__name__, ",".join(
            tag for k, tag in flags if allargs.get(k) is not None))
        st = stats.add(name)
        st["calls"] += 1
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        st["configs"] = max(st["configs"], len(configs))
        ret = None
        done_one = False
        for i, cfg in enumerate(configs):
            if list_only or i % nparts != part:
                continue
            before = cache_utils_counts(self.fn)
            t0 = time.time()
            try:
                ret = self.fn(*args, **kwargs, **cfg.all_kwargs())
                done_one = True
            except Exception as e:
                st["failed"] += 1
                stats.errors.append("%s [%s]: %s: %s" % (name, cfg, type(e).__name__,
                                                         str(e).strip().splitlines()[0]
                                                         if str(e).strip() else ""))
                continue
            st["seconds"] += time.time() - t0
            after = cache_utils_counts(self.fn)
            if after[1] > before[1]:
                st["compiled"] += 1
            else:
                st["hit"] += 1
        if not done_one:
            # This part compiled none of them (or --list): a value for the
            # caller from the config QuACK would use untuned, compiled only
            # when not listing.
            if list_only:
                return fake_return(name, args, kwargs, self)
            ret = self.fn(*args, **kwargs, **configs[0].all_kwargs())
        self.nargs = None
        return ret

    autotuner.Autotuner.__call__ = compile_all
    return torch


class _FakeDriver:
    """What triton.runtime.jit needs of the active driver to compile (not to
    launch): device 0, stream 0 and the target, sm_90 with 32-thread warps."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", int(arch), 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def patch_triton(stats, part, nparts, list_only):
    """Triton kernels: compile (JITFunction.run with warmup=True, which
    compiles into TRITON_CACHE_DIR and launches nothing) instead of launching;
    an autotuned kernel compiles every candidate its pruning keeps. Fake
    tensors become triton's MockTensor (its dtype, a 16-byte aligned null
    pointer: the alignment torch's allocations have on the device)."""
    import torch
    import triton.runtime.autotuner as ta
    import triton.runtime.jit as tj
    from triton.runtime.driver import driver
    driver.set_active(_FakeDriver(os.environ["QUACK_ARCH"]))

    def mock(v):
        return tj.MockTensor(v.dtype, list(v.shape)) if isinstance(v, torch.Tensor) else v

    orig_run = tj.JITFunction.run

    in_tuner = []
    outcome = []  # cache_hit of the last compile, from Triton's compilation listener

    def listener(src, metadata, metadata_group, times, cache_hit):
        outcome.append(cache_hit)

    from triton import knobs
    knobs.compilation.listener = listener

    def jit_run(self, *args, grid, warmup, **kwargs):
        name = "triton " + self.fn.__name__
        st = stats.add(name)
        st["calls"] += 1
        if list_only or (not in_tuner and part != 0):
            return None
        t0 = time.time()
        outcome.clear()
        try:
            orig_run(self, *[mock(a) for a in args], grid=grid, warmup=True,
                     **{k: mock(v) for k, v in kwargs.items()})
        except Exception as e:
            st["failed"] += 1
            stats.errors.append("%s: %s: %s" % (name, type(e).__name__,
                                                str(e).strip().splitlines()[0]
                                                if str(e).strip() else ""))
            return None
        st["seconds"] += time.time() - t0
        # No listener call: an in-memory hit (same key earlier in this process).
        st["hit" if outcome != [False] else "compiled"] += 1
        return None

    def tuner_run(self, *args, **kwargs):
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        st = stats.add("triton " + self.base_fn.__name__)
        st["configs"] = max(st["configs"], len(configs))
        in_tuner.append(1)
        try:
            for i, cfg in enumerate(configs):
                if i % nparts == part:
                    self.fn.run(*args, grid=None, warmup=True, **kwargs, **cfg.all_kwargs())
        finally:
            in_tuner.pop()
        self.nargs = None
        return None

    tj.JITFunction.run = jit_run
    ta.Autotuner.run = tuner_run


def cache_utils_counts(fn):
    """(hits, misses) summed over QuACK's jit_cache'd compile functions."""
    import quack.gemm as g1
    import quack.gemm_act as g2
    import quack.gemm_dact as g3
    h = m = 0
    for f in (g1._compile_gemm, g2._compile_gemm_act, g3._compile_gemm_dact):
        ci = f.cache_info()
        h += ci.hits
        m += ci.misses
    return h, m


def fake_return(name, args, kwargs, tuner):
    """What the tuned function returns, without compiling (--list)."""
    import torch
    if name.startswith("gemm_dgated_tuned"):
        nargs = dict(zip(tuner.arg_names, args), **kwargs)
        if nargs.get("colvec_reduce"):
            A_idx = nargs.get("A_idx")
            A = nargs["A"]
            m = A_idx.shape[0] if A_idx is not None else A.shape[0]
            return torch.empty(m, dtype=torch.float32, device=A.device)
    return None


def run_layer(torch, T, d, n, E, K):
    """SonicMoE's forward and gradient pass on fake CUDA tensors, laid out as
    bench/compare.py passes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_TC_softmax_topk_layer
    with FakeTensorMode():
        bf = torch.bfloat16
        dev = "cuda"
        x = torch.empty(T, d, dtype=bf, device=dev).requires_grad_()
        wr = torch.empty(E, d, dtype=bf, device=dev).requires_grad_()
        w1 = torch.empty(E, 2 * n, d, dtype=bf, device=dev).requires_grad_()
        w2 = torch.empty(E, d, n, dtype=bf, device=dev).requires_grad_()
        dout = torch.empty(T, d, dtype=bf, device=dev)
        out, logits, counts = moe_TC_softmax_topk_layer(
            x, wr, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, K, 0,
            ActivationType.SWIGLU, False)
        # torch's autograd engine wants a real CUDA device for CUDA tensors;
        # the two expert backward nodes (every GEMM of the backward) are
        # called directly, with the gradients the engine would pass them.
        down = find_node(out.grad_fn, "_DownProjectionBackward")
        up = find_node(out.grad_fn, "_UpProjectionBackward")
        router = find_node(out.grad_fn, "TC_Softmax_Topk_Router_FunctionBackward")
        grads = down.apply(dout)  # (a, dh, dw2, db2, ds, ...)
        up.apply(None, grads[1])  # outputs (a: not differentiable, h)
        router.apply(grads[4], None)  # outputs (top-K scores, indices)


def find_node(root, name):
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == name:
            return node
        todo += [nf for nf, _ in node.next_functions]
    raise RuntimeError("sonic_precompile: no %s node in SonicMoE's graph" % name)


def worker(args, part, nparts):
    stats = Stats()
    torch = patch_for_compile(stats, part, nparts, args.list, not args.no_triton)
    t0 = time.time()
    for (name, T, d, n, E, K) in configs_from_args(args):
        t1 = time.time()
        run_layer(torch, T, d, n, E, K)
        if args.verbose:
            print("part %d/%d: %s done in %.1f s" % (part, nparts, name, time.time() - t1),
                  flush=True)
    return stats, time.time() - t0


def cache_summary(out):
    """(QuACK kernels, Triton kernels, bytes) under the cache root."""
    nq = nt = size = 0
    for dp, _, fs in os.walk(out):
        for f in fs:
            size += os.path.getsize(os.path.join(dp, f))
            nq += f.endswith(".o")
            nt += f.startswith("__grp__")
    return nq, nt, size


def tar_filter(ti):
    """Leave out lock files and Triton's intermediate files: a cache hit reads
    only the group file, the metadata .json and the .cubin."""
    base = os.path.basename(ti.name)
    if base == "lock" or base.endswith(".lock"):
        return None
    if ti.isfile() and base.rsplit(".", 1)[-1] in ("ttir", "ttgir", "llir", "ptx", "source"):
        return None
    return ti


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", default="/tmp/cmp-site",
                    help="folder with the unpacked wheels (notes/compare.md)")
    ap.add_argument("--out", default="/tmp/sonic-cache",
                    help="cache root: QUACK_CACHE_DIR=OUT/quack, TRITON_CACHE_DIR=OUT/triton. "
                    "Triton's cache records absolute paths: the device must unpack it "
                    "to the same path")
    ap.add_argument("--rows", help="grid.h rows, comma-separated, 'all' (default) or 'models'")
    ap.add_argument("--shape", action="append", help="T,d,n,E,K (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--part", help=argparse.SUPPRESS)  # i/N: one compile process
    ap.add_argument("--arch", default="90", help="QUACK_ARCH (default 90: sm_90a)")
    ap.add_argument("--no-triton", action="store_true",
                    help="QuACK's GEMMs only, not SonicMoE's Triton kernels")
    ap.add_argument("--list", action="store_true", help="list the kernels, compile nothing")
    ap.add_argument("--tar", help="write an xz-compressed tar of OUT here (unpack with "
                    "tar -xJf TAR -C <parent of OUT>)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    args.out = os.path.abspath(args.out)
    os.environ["QUACK_ARCH"] = args.arch
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_%sa" % args.arch)
    os.environ["QUACK_CACHE_DIR"] = os.path.join(args.out, "quack")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(args.out, "triton")
    os.environ.setdefault("QUACK_CACHE_ENABLED", "1")
    os.makedirs(os.environ["QUACK_CACHE_DIR"], exist_ok=True)
    setup_paths(args.site)
    if not args.list:
        ensure_driver()

    if args.part:
        i, n = (int(v) for v in args.part.split("/"))
        stats, secs = worker(args, i, n)
        import json
        print("PART-RESULT " + json.dumps({"per_fn": stats.per_fn, "errors": stats.errors,
                                           "seconds": secs}), flush=True)
        return 0

    t0 = time.time()
    n0 = cache_summary(args.out)
    jobs = 1 if args.list else max(1, args.jobs)
    if jobs == 1:
        stats, _ = worker(args, 0, 1)
        results = [{"per_fn": stats.per_fn, "errors": stats.errors}]
    else:
        import json
        procs = []
        base = [sys.executable, os.path.abspath(__file__), "--site", args.site or "",
                "--out", args.out, "--arch", args.arch]
        if args.rows:
            base += ["--rows", args.rows]
        for s in args.shape or []:
            base += ["--shape", s]
        if args.no_triton:
            base.append("--no-triton")
        for i in range(jobs):
            procs.append(subprocess.Popen(base + ["--part", "%d/%d" % (i, jobs)],
                                          stdout=subprocess.PIPE, text=True))
        results = []
        for p in procs:
            out, _ = p.communicate()
            line = [ln for ln in out.splitlines() if ln.startswith("PART-RESULT ")]
            if p.returncode or not line:
                sys.exit("sonic_precompile: a compile process failed (exit %d)" % p.returncode)
            results.append(json.loads(line[-1][len("PART-RESULT "):]))

    merged = {}
    errors = []
    for r in results:
        errors += r["errors"]
        for nm, st in r["per_fn"].items():
            m = merged.setdefault(nm, {"calls": st["calls"], "configs": st["configs"],
                                       "compiled": 0, "hit": 0, "failed": 0, "seconds": 0.0})
            for k in ("compiled", "hit", "failed", "seconds"):
                m[k] += st[k]
    print("%-44s %5s %7s %8s %5s %6s %9s" % ("kernel (QuACK tuned GEMM / Triton)", "calls",
                                            "configs", "compiled", "hit", "failed", "compile s"))
    for nm, m in sorted(merged.items()):
        print("%-44s %5d %7d %8d %5d %6d %9.1f" % (nm, m["calls"], m["configs"], m["compiled"],
                                                  m["hit"], m["failed"], m["seconds"]))
    for e in errors:
        print("compile failed: " + e)
    n1 = cache_summary(args.out)
    print("cache %s: %d QuACK kernels (%d new), %d Triton kernels (%d new), %.1f MB; "
          "%.0f s wall, %d process(es)" % (args.out, n1[0], n1[0] - n0[0], n1[1],
                                           n1[1] - n0[1], n1[2] / 1e6, time.time() - t0, jobs))
    if not args.no_triton and not args.list:
        from triton.runtime.cache import triton_key
        import hashlib
        print("triton key sha256 %s (the device's must match for its cache to hit)"
              % hashlib.sha256(triton_key().encode()).hexdigest()[:16])
    if args.tar:
        with tarfile.open(args.tar, "w:xz", preset=9) as tf:
            tf.add(args.out, arcname=os.path.basename(args.out), filter=tar_filter)
        print("tar %s: %.1f MB (unpack: tar -xJf %s -C %s)"
              % (args.tar, os.path.getsize(args.tar) / 1e6, args.tar,
                 os.path.dirname(args.out)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
