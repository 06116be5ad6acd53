"""Host (Python) cost per call of smoe.moe and smoe.MoE on CPU tensors: a
benchmark, run by hand (pytest does not collect it):

    python python/tests/host_overhead.py [T d n E K] [--operators] [--dtype bf16|f32|f64]

For each kind of call it prints the median over rounds of the time per call,
the part of it spent inside the library's smoe_layer_forward /
smoe_layer_backward (timed by wrapping the ctypes functions, so it includes
the ctypes call itself), and the difference: the host overhead of the
Python layer plus PyTorch's own (autograd engine, allocations, the loss
ops of MoE). --operators sends every call through the custom operators
(smoe.functional._EAGER = False), as under torch.compile or a dispatch
mode. Gradients are reset to None before each backward, as a training step
does, so no gradient accumulation is timed.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import smoe  # noqa: E402
from smoe import _lib as L  # noqa: E402
from smoe import functional as fn  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="*", type=int, default=[8, 64, 64, 8, 2],
                    help="T d n E K (default 8 64 64 8 2)")
    ap.add_argument("--operators", action="store_true",
                    help="every call through the custom operators")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if len(args.shape) != 5:
        ap.error("shape is T d n E K")
    T, d, n, E, K = args.shape
    dt = DTYPES[args.dtype]
    if args.operators:
        fn._EAGER = False   # (versions before the eager path always use the operators)

    torch.manual_seed(0)
    x = torch.randn(T, d).to(dt)
    r = (torch.randn(E, d) * 0.1).to(dt)
    w1 = (torch.randn(E, 2 * n, d) * d ** -0.5).to(dt)
    w2 = (torch.randn(E, d, n) * n ** -0.5).to(dt)
    params = [t.clone().requires_grad_() for t in (x, r, w1, w2)]
    gout = torch.randn(T, d).to(dt)
    module = smoe.MoE(E, K, d, n, "swiglu", False, 0.02).to(dt)

    in_c = [0.0]
    lib = L.lib()

    def timed(f):
        def call(*a):
            t0 = time.perf_counter()
            status = f(*a)
            in_c[0] += time.perf_counter() - t0
            return status
        return call

    for name in ("smoe_layer_forward", "smoe_layer_backward"):
        setattr(lib, name, timed(getattr(lib, name)))
    for name in ("forward_raw", "backward_raw"):   # (absent before the eager path)
        if getattr(L, name, None) is not None:
            setattr(L, name, timed(getattr(L, name)))

    def fwd_no_grad():
        with torch.no_grad():
            smoe.moe(x, r, w1, w2, top_k=K)

    def fwd_inference():
        smoe.moe(x, r, w1, w2, top_k=K, inference=True)

    def fwd_autograd():
        smoe.moe(*params, top_k=K)

    def fwd_bwd():
        for p in params:
            p.grad = None
        out, _, _ = smoe.moe(*params, top_k=K)
        out.backward(gout)

    def module_step():
        module.zero_grad()
        out, aux = module(x)
        (out.float().sum() + aux).backward()

    def median(f, reps):
        for _ in range(max(reps // 10, 20)):
            f()
        res = []
        for _ in range(args.rounds):
            in_c[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            res.append(((time.perf_counter() - t0) / reps * 1e6, in_c[0] / reps * 1e6))
        return sorted(res)[len(res) // 2]

    print("smoe host cost per call, T=%d d=%d n=%d E=%d K=%d %s, %s, torch %s, %d threads"
          % (T, d, n, E, K, args.dtype, "custom operators" if args.operators else "eager path",
             torch.__version__, torch.get_num_threads()))
    print("%-34s %9s %9s %9s" % ("us per call", "total", "in C", "host"))
    for name, f, reps in (("forward, torch.no_grad()", fwd_no_grad, 2000),
                          ("forward, inference=True", fwd_inference, 2000),
                          ("forward, with autograd", fwd_autograd, 2000),
                          ("forward + backward", fwd_bwd, 1000),
                          ("MoE: forward + aux loss + backward", module_step, 1000)):
        total, c = median(f, reps)
        print("%-34s %9.1f %9.1f %9.1f" % (name, total, c, total - c))


if __name__ == "__main__":
    main()
