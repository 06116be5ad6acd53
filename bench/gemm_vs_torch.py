"""Each of smoe's six grouped GEMMs alone against torch.nn.functional.grouped_mm
(CUTLASS inside), on the same pre-gathered inputs, in the same process.

smoe's launchers (src/cuda/gemm.h, tables smoe_gemm_ops_sm90 and
smoe_gemm_ops_sm80) are called through build/libsmoe_gemm_shim.so
(bench/gemm_shim.cu, `make gemm-shim`). Torch does the same math on the
operand already gathered by token (Xg = X[row_token], dOg = dO[row_token]),
so torch's time holds no gather while ours does its gather inside:

  kind  ours                                       torch
  up    H = X[tok] W1^T, A = act(H)                grouped_mm(Xg, W1^T, offs)
  down  Y = A W2^T                                 grouped_mm(A, W2^T, offs)
  dh    dA' = dO[tok] W2 + dSwiGLU/A'/dS epilogue   grouped_mm(dOg, W2, offs) (GEMM only)
  dw2   dW2[e] = dO[tok]^T A'   (varlen K)         grouped_mm(dOg^T, A', offs) -> (E, d, n)
  dxt   dX~ = dH W1                                grouped_mm(dH, W1, offs)
  dw1   dW1[e] = dH^T X[tok]    (varlen K)         grouped_mm(dH^T, Xg, offs) -> (E, 2n, d)

Balanced routing (each expert T*K/E rows), bf16, SwiGLU, interleaved W1.
Before timing, each of ours is checked against torch's result (norm-wise
relative error, plus the dh epilogue against an fp32 torch reference); a
failure is reported instead of a time. Times: CUDA events, median over reps
after warm-up, a 256 MiB L2 flush before each rep.

    python3 bench/gemm_vs_torch.py [--rows 7B-n256,30B-n512|all] [--kinds up,dw1]
        [--tables sm90,sm80] [--reps 20] [--wgrad-dtype bf16|f32] [--csv FILE]
    python3 bench/gemm_vs_torch.py --dry-run    (no GPU: arguments, grid, shim ABI,
                                                 torch references on a tiny CPU case, table)
"""
import argparse
import csv
import ctypes
import os
import sys
import time
from ctypes import Structure, c_char_p, c_int, c_int32, c_int64, c_size_t, c_void_p

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHIM = os.path.join(os.path.dirname(HERE), "build", "libsmoe_gemm_shim.so")
sys.path.insert(0, HERE)
import torch_baseline  # noqa: E402  (its grid parser and its timing loop)
from torch_baseline import grid_rows  # noqa: E402
DEFAULT_ROWS = "7B-n256,30B-n512,120B-n1024,120B-n2048"

KINDS = ["up", "down", "dh", "dw2", "dxt", "dw1"]  # index = the shim's kind number
TABLES = {"sm80": 0, "sm90": 1}
SMOE_DTYPE_F32, SMOE_DTYPE_BF16 = 0, 1
SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED = 0, 0
SHIM_NO_ENTRY, SHIM_BAD_ARG = -1, -2
STATUS = ["SUCCESS", "NULL_POINTER", "INVALID_SIZE", "INVALID_VALUE", "UNSUPPORTED",
          "NO_DEVICE", "OUT_OF_MEMORY", "BACKEND", "INTERNAL"]


# ------------------------------------------------------------------ the shim

class ShimProblem(Structure):
    """Mirror of smoe_shim_problem in bench/gemm_shim.cu."""
    _fields_ = [
        ("d", c_int64), ("n", c_int64), ("h_cols", c_int64), ("E", c_int64), ("cap", c_int64),
        ("expert_offset", c_void_p), ("row_token", c_void_p), ("row_score", c_void_p),
        ("gated", c_int32), ("act", c_int32), ("w1_layout", c_int32), ("num_sms", c_int32),
        ("out_dtype", c_int32), ("accumulate", c_int32),
    ]


PtrArray = c_void_p * 8


def load_shim(path):
    lib = ctypes.CDLL(path)
    lib.smoe_shim_problem_size.restype = c_size_t
    lib.smoe_shim_problem_size.argtypes = []
    lib.smoe_shim_has_table.restype = c_int
    lib.smoe_shim_has_table.argtypes = [c_int]
    lib.smoe_shim_table_name.restype = c_char_p
    lib.smoe_shim_table_name.argtypes = [c_int]
    lib.smoe_shim_last_error.restype = c_char_p
    lib.smoe_shim_last_error.argtypes = []
    lib.smoe_shim_scratch_bytes.restype = c_size_t
    lib.smoe_shim_scratch_bytes.argtypes = [c_int, ctypes.POINTER(ShimProblem)]
    lib.smoe_shim_gemm.restype = c_int
    lib.smoe_shim_gemm.argtypes = [c_int, c_int, ctypes.POINTER(ShimProblem), PtrArray,
                                   c_void_p, c_void_p]
    size = lib.smoe_shim_problem_size()
    if size != ctypes.sizeof(ShimProblem):
        raise RuntimeError(f"{path}: smoe_shim_problem is {size} bytes, the mirror here "
                           f"{ctypes.sizeof(ShimProblem)}")
    return lib


def status_text(lib, rc):
    if rc == SHIM_NO_ENTRY:
        return "no entry in the table"
    if rc == SHIM_BAD_ARG:
        return "shim: bad table/kind/arguments"
    name = STATUS[rc] if 0 <= rc < len(STATUS) else str(rc)
    msg = lib.smoe_shim_last_error() or b""
    return f"{name}: {msg.decode(errors='replace')}"


def ptr(t):
    return None if t is None else t.data_ptr()


# ------------------------------------------------------------------ problem

def make_problem(T, d, n, E, K, dev, seed):
    """Balanced routing and every operand of the six GEMMs, bf16 on `dev`."""
    g = torch.Generator(device=dev).manual_seed(seed)
    R = T * K
    h_cols = 2 * n

    def randn(*shape, scale=1.0):
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
        return t.mul_(scale) if scale != 1.0 else t

    # assignment i = t K + k of the t-th token of a random permutation goes to
    # expert i % E: T K / E rows per expert, rows sorted by expert, tokens
    # ascending within an expert
    perm = torch.randperm(T, device=dev, generator=g)
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(T, device=dev)
    tok_all = torch.arange(T, device=dev).repeat_interleave(K)
    k_all = torch.arange(K, device=dev).repeat(T)
    e_all = (rank[tok_all] * K + k_all) % E
    order = torch.argsort(e_all, stable=True)
    row_token = tok_all[order].to(torch.int32).contiguous()
    counts = torch.bincount(e_all, minlength=E)
    expert_offset = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    expert_offset[1:] = counts.cumsum(0).to(torch.int32)
    offs = expert_offset[1:].contiguous()
    row_score = torch.rand(R, device=dev, generator=g).mul_(0.9).add_(0.05).contiguous()
    tok = row_token.long()

    P = dict(T=T, d=d, n=n, E=E, K=K, R=R, h_cols=h_cols, row_token=row_token,
             expert_offset=expert_offset, offs=offs, row_score=row_score)
    P["x"] = randn(T, d)
    P["xg"] = P["x"][tok].contiguous()
    P["w1"] = randn(E, h_cols, d, scale=d ** -0.5)
    P["w2"] = randn(E, d, n, scale=n ** -0.5)
    P["a_in"] = randn(R, n)                    # down's input A
    P["h_in"] = randn(R, h_cols)               # dh's saved H
    P["dout"] = randn(T, d)
    P["doutg"] = P["dout"][tok].contiguous()
    P["dh_in"] = randn(R, h_cols, scale=0.5)   # dxt's and dw1's dH
    P["as_in"] = randn(R, n)                   # dw2's A'
    return P


def shim_problem(P, num_sms, wgrad_dtype):
    q = ShimProblem()
    q.d, q.n, q.h_cols, q.E, q.cap = P["d"], P["n"], P["h_cols"], P["E"], P["R"]
    q.expert_offset = ptr(P["expert_offset"])
    q.row_token = ptr(P["row_token"])
    q.row_score = ptr(P["row_score"])
    q.gated, q.act, q.w1_layout, q.num_sms = 1, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, num_sms
    q.out_dtype = SMOE_DTYPE_F32 if wgrad_dtype == "f32" else SMOE_DTYPE_BF16
    q.accumulate = 0
    return q


def flops(kind, P):
    R, d, n = P["R"], P["d"], P["n"]
    return 2.0 * R * d * n * (2 if kind in ("up", "dxt", "dw1") else 1)


# ------------------------------------------------------------------ torch side

def torch_fn(kind, P):
    """A closure computing torch's GEMM of `kind` on the pre-gathered operands."""
    o = P["offs"]
    if kind == "up":
        return lambda: F.grouped_mm(P["xg"], P["w1"].transpose(1, 2), offs=o)
    if kind == "down":
        return lambda: F.grouped_mm(P["a_in"], P["w2"].transpose(1, 2), offs=o)
    if kind == "dh":
        return lambda: F.grouped_mm(P["doutg"], P["w2"], offs=o)
    if kind == "dw2":
        return lambda: F.grouped_mm(P["doutg"].t(), P["as_in"], offs=o)
    if kind == "dxt":
        return lambda: F.grouped_mm(P["dh_in"], P["w1"], offs=o)
    if kind == "dw1":
        return lambda: F.grouped_mm(P["dh_in"].t(), P["xg"], offs=o)
    raise ValueError(kind)


def dh_reference(P, dap, rows=slice(None)):
    """fp32 reference of the dh launcher's outputs for `rows`, from dA' of
    those rows (torch's GEMM)."""
    h = P["h_in"][rows].float()
    gate, up = h[:, 0::2], h[:, 1::2]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    a = silu * up
    dap = dap.float()
    s = P["row_score"][rows].unsqueeze(1)
    ds = (dap * a).sum(1)
    dgate = dap * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dap * silu
    dh = torch.stack((dgate, dup), dim=2).reshape(h.shape) * s
    return dh, a * s, ds


def loop_reference(kind, P):
    """Per-expert fp32 matmuls (independent of grouped_mm), for --dry-run."""
    eo = P["expert_offset"].tolist()
    outs = []
    for e in range(P["E"]):
        r0, r1 = eo[e], eo[e + 1]
        if kind == "up":
            outs.append(P["xg"][r0:r1].float() @ P["w1"][e].float().t())
        elif kind == "down":
            outs.append(P["a_in"][r0:r1].float() @ P["w2"][e].float().t())
        elif kind == "dh":
            outs.append(P["doutg"][r0:r1].float() @ P["w2"][e].float())
        elif kind == "dw2":
            outs.append((P["doutg"][r0:r1].float().t() @ P["as_in"][r0:r1].float()).unsqueeze(0))
        elif kind == "dxt":
            outs.append(P["dh_in"][r0:r1].float() @ P["w1"][e].float())
        elif kind == "dw1":
            outs.append((P["dh_in"][r0:r1].float().t() @ P["xg"][r0:r1].float()).unsqueeze(0))
    return torch.cat(outs, 0)


class ErrSum:
    """Norm-wise relative error ||got - ref|| / ||ref|| in fp32, summed over chunks."""

    def __init__(self):
        self.num = 0.0
        self.den = 0.0

    def add(self, got, ref):
        rf = ref.float()
        self.num += (got.float() - rf).pow(2).sum().item()  # NaN if got has NaN
        self.den += rf.pow(2).sum().item()

    def value(self):
        return (self.num / max(self.den, 1e-30)) ** 0.5


def rel_err(got, ref, chunk=1 << 24):
    g, r = got.reshape(-1), ref.reshape(-1)
    acc = ErrSum()
    for i in range(0, r.numel(), chunk):
        acc.add(g[i:i + chunk], r[i:i + chunk])
    return acc.value()


# ------------------------------------------------------------------ ours

def ours_buffers(kind, P, wgrad_dtype):
    """Output buffers of `kind`, poisoned (NaN) so unwritten rows fail the check."""
    dev, R, d, n, E, hc = P["x"].device, P["R"], P["d"], P["n"], P["E"], P["h_cols"]
    wdt = torch.float32 if wgrad_dtype == "f32" else torch.bfloat16

    def nan(*shape, dtype=torch.bfloat16):
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)

    if kind == "up":
        return {"h": nan(R, hc), "a": nan(R, n)}
    if kind == "down":
        return {"y": nan(R, d)}
    if kind == "dh":
        return {"dh": nan(R, hc), "as": nan(R, n), "ds": nan(R, dtype=torch.float32)}
    if kind == "dw2":
        return {"dw2": nan(E, d, n, dtype=wdt)}
    if kind == "dxt":
        return {"dxt": nan(R, d)}
    return {"dw1": nan(E, hc, d, dtype=wdt)}


def ours_ptrs(kind, P, B):
    if kind == "up":
        p = [P["x"], P["w1"], None, B["h"], B["a"]]
    elif kind == "down":
        p = [P["a_in"], P["w2"], None, B["y"]]
    elif kind == "dh":
        p = [P["dout"], P["w2"], None, P["h_in"], B["dh"], B["as"], B["ds"]]
    elif kind == "dw2":
        p = [P["dout"], P["as_in"], B["dw2"]]
    elif kind == "dxt":
        p = [P["dh_in"], P["w1"], B["dxt"]]
    else:
        p = [P["dh_in"], P["x"], B["dw1"]]
    return PtrArray(*([ptr(t) for t in p] + [None] * (8 - len(p))))


def check_ours(kind, P, B, ref, rows_per_chunk=8192):
    """Worst relative error of ours against torch's result (and, for up and dh,
    against the fp32 activation / epilogue computed from it), row chunks at a time."""
    if kind == "down":
        return rel_err(B["y"], ref)
    if kind in ("dw2", "dxt", "dw1"):
        return rel_err(B[kind], ref)
    names = ("h", "a") if kind == "up" else ("dh", "as", "ds")
    errs = {k: ErrSum() for k in names}
    for r0 in range(0, P["R"], rows_per_chunk):
        sl = slice(r0, min(r0 + rows_per_chunk, P["R"]))
        if kind == "up":
            h = ref[sl].float()
            errs["h"].add(B["h"][sl], h)
            errs["a"].add(B["a"][sl], F.silu(h[:, 0::2]) * h[:, 1::2])
        else:
            dh_ref, as_ref, ds_ref = dh_reference(P, ref[sl], sl)
            errs["dh"].add(B["dh"][sl], dh_ref)
            errs["as"].add(B["as"][sl], as_ref)
            errs["ds"].add(B["ds"][sl], ds_ref)
    return max(e.value() for e in errs.values())


# ------------------------------------------------------------------ timing

def median_ms(fn, reps, warmup, flush):
    """torch_baseline's CUDA-event median (L2 flushed per rep), after warm-up calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return torch_baseline.median_ms(fn, reps, flush)


def bench_row(name, shape, args, lib, flush, num_sms):
    T, d, n, E, K = shape
    P = make_problem(T, d, n, E, K, "cuda", args.seed)
    q = shim_problem(P, num_sms, args.wgrad_dtype)
    scratch_bytes = max(lib.smoe_shim_scratch_bytes(TABLES[t], ctypes.byref(q))
                        for t in args.tables)
    scratch = torch.empty(max(scratch_bytes, 256), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for kind in args.kinds:
        kid = KINDS.index(kind)
        fl = flops(kind, P)
        r = {"row": name, "kind": kind, "gflop": fl / 1e9, "notes": []}
        tfn = torch_fn(kind, P)
        try:
            ref = tfn()
            torch.cuda.synchronize()
            r["torch_ms"] = median_ms(tfn, args.reps, args.warmup, flush)
        except Exception as exc:  # torch cannot run this form here
            ref = None
            r["notes"].append(f"torch grouped_mm cannot: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120]}")
        for tname in args.tables:
            tab = TABLES[tname]
            if not lib.smoe_shim_has_table(tab):
                r["notes"].append(f"{tname}: table not built")
                continue
            B = ours_buffers(kind, P, args.wgrad_dtype)
            ptrs = ours_ptrs(kind, P, B)

            def call(tab=tab, ptrs=ptrs):
                return lib.smoe_shim_gemm(tab, kid, ctypes.byref(q), ptrs, scratch.data_ptr(),
                                          stream)

            rc = call()
            torch.cuda.synchronize()
            if rc != 0:
                r["notes"].append(f"{tname}: {status_text(lib, rc)}")
                continue
            if ref is not None:
                err = check_ours(kind, P, B, ref)
                r[f"{tname}_err"] = err
                if not err <= args.tol:
                    r["notes"].append(f"{tname}: CHECK FAILED rel err {err:.3g} > {args.tol:g}"
                                      " (not timed)")
                    continue
            else:
                r["notes"].append(f"{tname}: not checked (no torch result)")
            bad = []

            def timed(call=call, bad=bad):
                rc = call()
                if rc != 0:
                    bad.append(rc)

            r[f"{tname}_ms"] = median_ms(timed, args.reps, args.warmup, flush)
            if bad:
                r["notes"].append(f"{tname}: a timed call returned {status_text(lib, bad[0])}")
                del r[f"{tname}_ms"]
            del B
        if kind == "dh":
            r["notes"].append("torch: GEMM only; ours also runs the dSwiGLU/A'/dS epilogue")
        if kind == "up":
            r["notes"].append("ours also writes A = SwiGLU(H)")
        del ref
        results.append(r)
        print_result(r, args.tables)
    del P
    torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------ output

def tflops(r, key):
    ms = r.get(key + "_ms")
    return None if ms is None else r["gflop"] / ms  # GFLOP per ms = TFLOP/s


def fmt(v, w, p=1):
    return f"{'-':>{w}s}" if v is None else f"{v:{w}.{p}f}"


def header(tables):
    cols = f"{'row':12s} {'kind':5s} {'GFLOP':>8s}"
    for t in tables:
        cols += f" {t + ' TF':>9s}"
    cols += f" {'torch TF':>9s}"
    for t in tables:
        cols += f" {t + '/torch':>11s}"
    return cols + "  notes"


def print_result(r, tables):
    line = f"{r['row']:12s} {r['kind']:5s} {r['gflop']:8.1f}"
    tt = tflops(r, "torch")
    for t in tables:
        line += " " + fmt(tflops(r, t), 9)
    line += " " + fmt(tt, 9)
    for t in tables:
        ours = tflops(r, t)
        line += " " + fmt(None if ours is None or tt is None else ours / tt, 11, 2)
    if r["notes"]:
        line += "  " + "; ".join(r["notes"])
    print(line, flush=True)


def csv_rows(results, tables):
    head = ["row", "kind", "gflop", "torch_ms", "torch_tflops"]
    for t in tables:
        head += [f"{t}_ms", f"{t}_tflops", f"{t}_over_torch", f"{t}_rel_err"]
    head.append("notes")
    out = [head]
    for r in results:
        tt = tflops(r, "torch")
        row = [r["row"], r["kind"], f"{r['gflop']:.3f}", r.get("torch_ms", ""),
               "" if tt is None else f"{tt:.2f}"]
        for t in tables:
            ours = tflops(r, t)
            row += [r.get(f"{t}_ms", ""), "" if ours is None else f"{ours:.2f}",
                    "" if ours is None or tt is None else f"{ours / tt:.3f}",
                    "" if f"{t}_err" not in r else f"{r[t + '_err']:.3g}"]
        row.append("; ".join(r["notes"]))
        out.append(row)
    return out


def write_csv(path, results, tables):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(csv_rows(results, tables))


# ------------------------------------------------------------------ dry run

def dry_run(args, grid, names):
    """No GPU: the grid, the shim's ABI, torch's six forms and the dh epilogue
    reference on a tiny CPU case against per-expert fp32 loops, the table."""
    print("# dry run (no CUDA): nothing below is a GPU measurement")
    for name in names:
        T, d, n, E, K = grid[name]
        P = dict(R=T * K, d=d, n=n)
        tot = sum(flops(k, P) for k in args.kinds) / 1e9
        print(f"# {name}: T={T} d={d} n={n} E={E} K={K} R={T * K} rows/expert={T * K // E}"
              f" GFLOP(kinds)={tot:.1f}")
    ok = True
    if os.path.exists(args.shim):
        lib = load_shim(args.shim)
        names_t = {t: lib.smoe_shim_table_name(TABLES[t]).decode() for t in TABLES}
        print(f"# shim {args.shim}: problem {ctypes.sizeof(ShimProblem)} bytes (matches), "
              f"tables sm80={lib.smoe_shim_has_table(0)} ({names_t['sm80']}) "
              f"sm90={lib.smoe_shim_has_table(1)} ({names_t['sm90']})")
        q = ShimProblem()
        rc = lib.smoe_shim_gemm(0, 99, ctypes.byref(q), PtrArray(), None, None)
        print(f"# shim kind 99 -> {rc} ({status_text(lib, rc)})")
        ok &= rc == SHIM_BAD_ARG
        rc = lib.smoe_shim_gemm(7, 0, ctypes.byref(q), PtrArray(), None, None)
        print(f"# shim table 7 -> {rc} ({status_text(lib, rc)})")
        ok &= rc == SHIM_BAD_ARG
        print(f"# shim scratch_bytes sm80 for cap=0: {lib.smoe_shim_scratch_bytes(0, ctypes.byref(q))}")
    else:
        print(f"# shim {args.shim} not built (make gemm-shim): ABI not checked")

    T, d, n, E, K = 96, 64, 32, 8, 2
    P = make_problem(T, d, n, E, K, "cpu", args.seed)
    eo = P["expert_offset"].tolist()
    counts = [eo[e + 1] - eo[e] for e in range(E)]
    tok = P["row_token"].tolist()
    # balanced, sorted by expert, tokens ascending within an expert, K distinct experts a token
    ok &= len(set(counts)) == 1 and sum(counts) == T * K
    ok &= all(tok[r] < tok[r + 1] for e in range(E) for r in range(eo[e], eo[e + 1] - 1))
    print(f"# tiny CPU case T={T} d={d} n={n} E={E} K={K}: rows/expert {counts[0]}, "
          f"routing {'ok' if ok else 'WRONG'}")
    results = []
    for kind in args.kinds:
        r = {"row": "tiny-cpu", "kind": kind, "gflop": flops(kind, P) / 1e9, "notes": []}
        fn = torch_fn(kind, P)
        t0 = time.perf_counter()
        got = fn()
        r["torch_ms"] = (time.perf_counter() - t0) * 1e3
        ref = loop_reference(kind, P)
        err = rel_err(got, ref)
        good = err <= args.tol and tuple(got.shape) == tuple(ref.shape)
        r["notes"].append(f"torch form vs fp32 loop: shape {tuple(got.shape)} rel err {err:.2g}"
                          f" {'ok' if good else 'FAIL'}")
        if kind == "dh":
            # the epilogue reference against a direct per-element computation
            dh_ref, as_ref, ds_ref = dh_reference(P, ref)
            h = P["h_in"].float()
            i, j = 5, 3
            g_, u_ = h[i, 2 * j].item(), h[i, 2 * j + 1].item()
            sg = 1.0 / (1.0 + torch.exp(torch.tensor(-g_)).item())
            s = P["row_score"][i].item()
            dap = ref[i, j].item()
            want_g = s * dap * u_ * (sg + g_ * sg * (1 - sg))
            want_u = s * dap * g_ * sg
            want_a = s * g_ * sg * u_
            a_row = (h[i, 0::2] * torch.sigmoid(h[i, 0::2]) * h[i, 1::2])
            want_ds = (ref[i] * a_row).sum().item()
            e_ep = max(abs(dh_ref[i, 2 * j].item() - want_g), abs(dh_ref[i, 2 * j + 1].item() - want_u),
                       abs(as_ref[i, j].item() - want_a), abs(ds_ref[i].item() - want_ds))
            good &= e_ep < 1e-4
            r["notes"].append(f"epilogue ref element check {e_ep:.1g}")
        # the checking code: correct outputs pass, poisoned (unwritten) outputs fail
        B = ours_buffers(kind, P, args.wgrad_dtype)
        e_poison = check_ours(kind, P, B, got, rows_per_chunk=50)
        if kind == "up":
            B["h"].copy_(ref)
            hr = B["h"].float()
            B["a"].copy_(F.silu(hr[:, 0::2]) * hr[:, 1::2])
        elif kind == "dh":
            dh_ref, as_ref, ds_ref = dh_reference(P, ref)
            B["dh"].copy_(dh_ref)
            B["as"].copy_(as_ref)
            B["ds"].copy_(ds_ref)
        else:
            B[next(iter(B))].copy_(ref)
        e_good = check_ours(kind, P, B, got, rows_per_chunk=50)
        checker_ok = e_good <= args.tol and not e_poison <= args.tol
        good &= checker_ok
        r["notes"].append(f"checker: exact-ish {e_good:.2g} passes, poisoned {e_poison} fails"
                          f" {'ok' if checker_ok else 'FAIL'}")
        ok &= good
        r["notes"].append("ours not run (dry run)")
        results.append(r)
    print("# CPU timings below are torch on the CPU, for the table's format only")
    print(header(args.tables))
    for r in results:
        print_result(r, args.tables)
    if args.csv:
        write_csv(args.csv, results, args.tables)
        print(f"# wrote {args.csv}")
    print("dry run", "ok" if ok else "FAILED")
    return 0 if ok else 1


# ------------------------------------------------------------------ main

def parse_list(value, allowed, what):
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: unknown {bad or value!r}; choose from {','.join(allowed)}")
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="grid.h rows by name, or 'all'")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--tables", default="sm90,sm80")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tol", type=float, default=1e-2,
                    help="largest norm-wise relative error accepted (bf16 outputs)")
    ap.add_argument("--wgrad-dtype", choices=("bf16", "f32"), default="bf16",
                    help="dW1/dW2 output of ours (torch's is bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shim", default=os.environ.get("SMOE_GEMM_SHIM", DEFAULT_SHIM))
    ap.add_argument("--csv")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: see the module doc")
    args = ap.parse_args(argv)
    args.kinds = parse_list(args.kinds, KINDS, "kinds")
    args.tables = parse_list(args.tables, list(TABLES), "tables")
    if args.reps < 1 or args.warmup < 0:
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    grid = grid_rows()
    names = list(grid) if args.rows == "all" else parse_list(args.rows, list(grid), "rows")
    if args.dry_run:
        return dry_run(args, grid, names)

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run here)")
    lib = load_shim(args.shim)
    prop = torch.cuda.get_device_properties(0)
    print(f"# torch {torch.__version__} on {prop.name} ({prop.multi_processor_count} SMs); "
          f"ours: {args.shim}, tables "
          + ", ".join(f"{t}={lib.smoe_shim_table_name(TABLES[t]).decode() or 'absent'}"
                      for t in args.tables)
          + f"; wgrad out {args.wgrad_dtype}; median of {args.reps} after {args.warmup} warm-up,"
          " L2 flushed; torch on pre-gathered operands")
    print(header(args.tables))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    failed = 0
    for name in names:
        results += bench_row(name, grid[name], args, lib, flush, prop.multi_processor_count)
    for r in results:
        failed += sum("CHECK FAILED" in x or "a timed call" in x for x in r["notes"])
    if args.csv:
        write_csv(args.csv, results, args.tables)
    print(f"{failed} check failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
