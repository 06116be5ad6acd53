"""The plain PyTorch MoE layer of shared/bench/grid.tsv's torch_grouped_mm
columns, measured on the GPU at hand, so smoe's numbers can be compared with
a baseline taken on the same device in the same call.

The layer: router GEMM, top-K + softmax, an index gather of X, two
torch.nn.functional.grouped_mm calls with SwiGLU between them, the scores
applied, and index_add_ to aggregate. Forward time, backward time (forward +
backward minus forward) and the activation memory (bytes the forward leaves
allocated, output included), medians over repetitions with L2 flushed.

    python3 bench/torch_baseline.py [--rows 7B-n256,120B-n1024|all] [--csv FILE]
"""
import argparse
import csv
import re
import statistics
import sys

import torch
import torch.nn.functional as F

GRID_H = __file__.rsplit("/", 1)[0] + "/grid.h"


def grid_rows(table="smoe_grid"):
    """{name: (T, d, n, E, K)} of one row table of grid.h: "smoe_grid" (SonicMoE's
    grid) or "smoe_model_rows" (public models' shapes)."""
    rows = {}
    pat = re.compile(r'\{"([^"]+)",\s*"[^"]+",\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),')
    inside = False
    for line in open(GRID_H):
        if re.match(r"static const smoe_grid_row %s\[\] = \{" % table, line):
            inside = True
            continue
        if inside and line.startswith("};"):
            break
        m = pat.search(line) if inside else None
        if m:
            rows[m.group(1)] = tuple(int(v) for v in m.groups()[1:])
    return rows


def model_rows():
    return grid_rows("smoe_model_rows")


def moe_forward(x, wr, w1, w2, K):
    T, d = x.shape
    E = wr.shape[0]
    logits = (x @ wr.t()).float()
    top_v, top_i = logits.topk(K, dim=-1)
    scores = top_v.softmax(-1)
    flat_e = top_i.flatten()
    order = flat_e.argsort(stable=True)
    tok = order // K
    offs = torch.bincount(flat_e, minlength=E).cumsum(0).to(torch.int32)
    h = F.grouped_mm(x[tok], w1.transpose(1, 2), offs=offs)
    a = F.silu(h[:, 0::2]) * h[:, 1::2]
    y = F.grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * scores.flatten()[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def median_ms(fn, reps, flush):
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def bench_row(T, d, n, E, K, reps, flush):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, d, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
    wr = (torch.randn(E, d, device=dev, generator=g) * d ** -0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, device=dev, generator=g) * d ** -0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, d, n, device=dev, generator=g) * n ** -0.5).bfloat16().requires_grad_()
    dout = torch.randn(T, d, device=dev, generator=g).bfloat16()

    def fwd():
        return moe_forward(x, wr, w1, w2, K)

    def fwd_bwd():
        out = moe_forward(x, wr, w1, w2, K)
        out.backward(dout)

    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    t_f = median_ms(fwd, reps, flush)
    t_fb = median_ms(fwd_bwd, reps, flush)
    for p in (x, wr, w1, w2):
        p.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = moe_forward(x, wr, w1, w2, K)
    torch.cuda.synchronize()
    act = torch.cuda.memory_allocated() - before
    del out
    flops = 6.0 * T * K * d * n
    t_b = t_fb - t_f
    return t_f, t_b, flops / (t_f * 1e-3) / 1e12, 2 * flops / (t_b * 1e-3) / 1e12, act / 2 ** 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="all")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--csv")
    args = ap.parse_args()
    grid = grid_rows()
    names = list(grid) if args.rows == "all" else args.rows.split(",")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'row':12s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF':>8s} {'bwd TF':>8s} {'act GiB':>8s}")
    out = []
    for name in names:
        T, d, n, E, K = grid[name]
        r = bench_row(T, d, n, E, K, args.reps, flush)
        out.append((name,) + r)
        print(f"{name:12s} {r[0]:8.3f} {r[1]:8.3f} {r[2]:8.1f} {r[3]:8.1f} {r[4]:8.2f}", flush=True)
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["row", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "act_gib"])
            w.writerows(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
