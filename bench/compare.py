"""MoE layer implementations side by side, in one run on one device.

For each configuration (the rows of bench/grid.h: SonicMoE's grid, 'all', and
the public models' routed-expert shapes, 'models'; or any T,d,n,E,K) every
implementation gets the same router weights, the same expert weights, the
same input, the same output gradient and the same routing decisions. Each
one's output and gradients (dx, drouter, dw1, dw2) are first compared with
an fp32 reference; one that fails is reported and not timed. Then, with the
L2 cache flushed before each repetition and CUDA events around it:

  forward TFLOPS  = 6TKdn / t_fwd
  backward TFLOPS = 12TKdn / (t_fwdbwd - t_fwd)
  act_gib         = torch.cuda.memory_allocated() growth over one forward
                    (training mode; the outputs and everything kept for
                    backward), the number of SonicMoE's Figure 13
  peak_gib        = peak allocation of one forward+backward above what was
                    allocated before it (max_memory_allocated: the caching
                    allocator's blocks, a request rounded to its block)
  peak_req_gib    = the same peak in the bytes requested (PyTorch's
                    requested_bytes statistic), without that rounding

medians over --reps repetitions. The gradient pass is torch.autograd.grad
(no accumulation into .grad), the same for every implementation.

Training loop (beside the isolated timings): --loop-iters forward+backward
iterations back to back, no flush, no GPU delay, no synchronization between
them, a synchronize at the end; loop_ms = wall time / iterations, host time
included (loop_tflops = 18TKdn / loop_ms). A layer whose host enqueue is
slower than its GPU work shows it here and not in the isolated numbers.
With --loop-power, nvidia-smi samples the GPU's SM clock and power draw
every 50 ms during the loop (loop_mhz: median clock, loop_watts: mean
power, loop_joules: energy per iteration = loop_watts x loop_ms), and a
table of both implementations' clocks and energy is printed after the
ratios: a layer held back by the power limit in a loop (no 10 ms rests as
in the isolated timings) shows a lower clock there than its peer. Give
the loop enough iterations (--loop-iters) for a second or more of samples.

When both a smoe implementation and sonicmoe run (or with --ratio A/B), a
table of same-call ratios is printed last: B's time over A's per row for
the forward, the backward and the loop iteration, with geometric means.

Launch overhead. Between the L2 flush and the start event each repetition
enqueues a GPU-side delay (torch.cuda._sleep, --gpu-delay-ms, default 10
ms, calibrated in clock cycles at start-up). While the GPU sleeps, the CPU
runs ahead and enqueues the layer's kernels, so the events time the GPU
work, not the Python side's launch overhead, as in a training loop where
the host runs ahead of the GPU. Without the delay the GPU is idle when the
start event is recorded and the host's work up to the first kernel is
timed: smoe through Python read 5-20% below the C benchmark that way. The
host's enqueue time (perf_counter around the call, no synchronization) is
in the CSV (host_fwd_ms, host_fwdbwd_ms); the note says where it exceeded
the delay (the region may then include waits for the host) or the GPU time
(host-bound: a loop of such layers would leave the GPU waiting). On an
H100 the host took up to 2.7 ms to enqueue smoe's forward+backward, 6 ms
for the torch layer's, 8 ms for ScatterMoE's: hence the 10 ms default.

Implementations (--impls):
  smoe-sm90, smoe-cuda  smoe.moe() with $SMOE_TORCH_BACKEND forcing the
                        backend (the Hopper kernels; the portable CUDA ones)
  smoe-sm90-consume     smoe-sm90 with consume_saved=True (the backward
                        writes dH over the saved H: the smaller workspace)
  smoe-cpu              smoe.moe() on CPU tensors (--device cpu)
  torch                 bench/torch_baseline.py's layer (router, index gather,
                        torch.nn.functional.grouped_mm, SwiGLU, index_add)
  scattermoe            scattermoe.mlp.GLUMLP, if importable, with the
                        reference routing given to it
  sonicmoe              sonicmoe.functional.moe_TC_softmax_topk_layer (what
                        sonicmoe.MoE calls, without its auxiliary loss), if
                        importable; it routes itself
An implementation that cannot be imported or built is listed as
'unavailable' in the CSV, with the reason.

Routing. Router weights and inputs are made so that every token's top-K
experts win by a wide margin (logits of the chosen experts in [1, 2], of the
others in [-2, 0], before bf16 rounding): a layer that computes its logits
in bf16 or fp32, with any summation order, picks the same experts. The
decisions are computed once from fp32 logits (the reference routing), given
to the implementations that take routing as input, and compared with what
the self-routing ones pick (smoe, sonicmoe: from the logits they return;
torch: its routing step recomputed). Which experts a token gets is
uniformly random, as with a random router; the timings do not depend on the
values.

Reference: an fp32 per-expert loop (this file, independent of every
implementation) with the reference routing, run before the implementations,
the weights converted to fp32 one expert at a time. out, dx and drouter are
checked in full; dW1 and dW2 in full when their fp32 copy fits --ref-dw-gib
(4 GiB), else on an evenly spread subset of experts (first and last
included; CSV column dw_experts_checked), e.g. 24 of DeepSeek-V3's 256.
Errors are relative L2 norms, |a - ref| / |ref|, per tensor; the check
passes when all are below --tol and finite.

    python3 bench/compare.py [--rows all|models|NAME,...] [--shape T,d,n,E,K ...]
        [--impls smoe-sm90,smoe-cuda,torch,scattermoe,sonicmoe] [--reps 10]
        [--csv FILE] [--device cuda|cpu] [--time-budget SECONDS]
        [--gpu-delay-ms 10] [--loop-iters 20] [--ref-dw-gib 4] [--ratio A/B]
    python3 bench/compare.py --device cpu --shape 64,64,32,8,2   # CPU smoke test

The CSV has one line per (configuration, implementation); lines starting
with '#' say the device, versions, commit and settings. bench/plot.py turns
it into plots and a Markdown table.
"""
import argparse
import csv
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import torch_baseline  # noqa: E402  (its grid parser and its layer)

FIELDS = ["row", "T", "d", "n", "E", "K", "impl", "status", "path", "fwd_ms", "bwd_ms",
          "fwd_tflops", "bwd_tflops", "act_gib", "peak_gib", "peak_req_gib", "err_out", "err_dx",
          "err_drouter", "err_dw1", "err_dw2", "routing_mismatch", "host_fwd_ms",
          "host_fwdbwd_ms", "loop_ms", "loop_tflops", "loop_mhz", "loop_watts", "loop_joules",
          "dw_experts_checked", "note"]
GRAD_NAMES = ("out", "dx", "drouter", "dw1", "dw2")


# ------------------------------------------------------------------ problem

class Problem:
    """One configuration's tensors, on the device, in bf16, plus the reference
    routing: top_i (T, K) int64 expert ids (sorted per token)."""

    def __init__(self, T, d, n, E, K, device, seed):
        if E > d:
            raise ValueError("E = %d > d = %d: the margin construction needs E <= d" % (E, d))
        self.T, self.d, self.n, self.E, self.K = T, d, n, E, K
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        dt = torch.bfloat16
        # Router: E orthonormal rows (a random router's rows are nearly so).
        q, _ = torch.linalg.qr(torch.randn(d, E, device=device, generator=g, dtype=torch.float32))
        # Designed logits: the K chosen experts of each token in [1, 2], the rest in [-2, 0].
        chosen = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
        logits = torch.rand(T, E, device=device, generator=g) * 2.0 - 2.0
        logits.scatter_(1, chosen, 1.0 + torch.rand(T, K, device=device, generator=g))
        # x = noise outside span(q) + the component that gives those logits.
        z = torch.randn(T, d, device=device, generator=g)
        z -= (z @ q) @ q.t()
        z += logits @ q.t()
        del logits
        self.x = z.to(dt)
        del z
        self.wr = q.t().contiguous().to(dt)
        self.w1 = random_bf16((E, 2 * n, d), d ** -0.5, device, g)
        self.w2 = random_bf16((E, d, n), n ** -0.5, device, g)
        self.dout = (torch.randn(T, d, device=device, generator=g) * 0.1).to(dt)
        # The reference routing, from fp32 logits of the bf16 tensors.
        ref_logits = self.x.float() @ self.wr.float().t()
        top = ref_logits.topk(K + 1 if K < E else K, dim=1).values
        self.margin = float((top[:, K - 1] - top[:, K]).min()) if K < E else float("inf")
        self.top_i = ref_logits.topk(K, dim=1).indices.sort(dim=1).values
        self.designed_ok = bool((self.top_i == chosen.sort(dim=1).values).all())
        del ref_logits, top, chosen

    def leaves(self):
        """Fresh leaf tensors (requires_grad) over the same storage."""
        return [t.detach().requires_grad_() for t in (self.x, self.wr, self.w1, self.w2)]


def random_bf16(shape, scale, device, g):
    """Gaussian * scale in bf16, made a block of leading rows at a time (at most
    256 MiB of fp32 each), so the fp32 temporary of DeepSeek-V3's w1 (30 GB)
    never exists."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, (64 << 20) // per_row)
    for i in range(0, shape[0], step):
        blk = out[i:i + step]
        blk.copy_(torch.randn(blk.shape, device=device, generator=g) * scale)
    return out


def routing_mismatch(prob, logits):
    """Tokens whose top-K set from `logits` differs from the reference."""
    sel = logits.float().topk(prob.K, dim=1).indices.sort(dim=1).values
    return int((sel != prob.top_i).any(dim=1).sum())


# ---------------------------------------------------------------- reference

def checked_experts(E, n, d, budget_gib):
    """The experts whose dW1, dW2 the reference keeps (fp32, 12nd bytes each):
    all of them if they fit in budget_gib, else as many as fit (at least 2),
    spread evenly over 0..E-1, first and last included. None: all."""
    per = 12.0 * n * d
    m = int(budget_gib * 2 ** 30 // per)
    if m >= E:
        return None
    m = max(2, m)
    return sorted({round(i * (E - 1) / (m - 1)) for i in range(m)})


def reference(prob, dw_budget_gib=4.0):
    """fp32 output and gradients (out, dx, drouter, dw1, dw2) of the layer with
    the reference routing and SwiGLU (w1 interleaved: row 2j gate j, row 2j+1
    up j), for the loss sum(out * dout). A loop over experts, each expert's
    gradients from its own small autograd graph, its weights converted to fp32
    one expert at a time. out, dx and drouter are complete; dw1 and dw2 are
    kept for the experts of checked_experts() only (key "dw_experts": their
    ids, None for all), so the largest rows (DeepSeek-V3: 45 GB of fp32 dW)
    fit: each kept expert's dW is still the full fp32 gradient, compared
    with the same experts' rows of an implementation's dW."""
    T, d, n, E, K = prob.T, prob.d, prob.n, prob.E, prob.K
    torch.set_float32_matmul_precision("highest")     # no TF32
    x = prob.x.float().requires_grad_()
    wr = prob.wr.float().requires_grad_()
    keep = checked_experts(E, n, d, dw_budget_gib)
    slot = {e: i for i, e in enumerate(keep if keep is not None else range(E))}
    dout = prob.dout.float()
    logits = x @ wr.t()
    scores = logits.gather(1, prob.top_i).softmax(dim=1)          # (T, K)
    s_flat = scores.detach().reshape(-1)
    flat_e = prob.top_i.reshape(-1)
    order = flat_e.argsort(stable=True)                          # pair positions, by expert
    counts = torch.bincount(flat_e, minlength=E).tolist()
    out = torch.zeros(T, d, device=x.device)
    dx = torch.zeros(T, d, device=x.device)
    m = len(slot)
    dw1 = torch.zeros(m, 2 * n, d, device=x.device)
    dw2 = torch.zeros(m, d, n, device=x.device)
    ds = torch.zeros(T * K, device=x.device)
    start = 0
    for e in range(E):
        pos = order[start:start + counts[e]]
        start += counts[e]
        if pos.numel() == 0:
            continue
        tok = pos // K
        xe = x.detach()[tok].requires_grad_()
        w1e = prob.w1[e].float().requires_grad_()
        w2e = prob.w2[e].float().requires_grad_()
        se = s_flat[pos].requires_grad_()
        h = xe @ w1e.t()
        a = F.silu(h[:, 0::2]) * h[:, 1::2]
        y = (a @ w2e.t()) * se.unsqueeze(1)
        gx, g1, g2, gs = torch.autograd.grad(y, (xe, w1e, w2e, se), dout[tok])
        out.index_add_(0, tok, y.detach())
        dx.index_add_(0, tok, gx)
        if e in slot:
            dw1[slot[e]] = g1
            dw2[slot[e]] = g2
        ds[pos] = gs
    gx_router, gwr = torch.autograd.grad(scores, (x, wr), ds.view(T, K))
    dx += gx_router
    return {"out": out, "dx": dx, "drouter": gwr, "dw1": dw1, "dw2": dw2,
            "dw_experts": keep}


@torch.no_grad()
def rel_err(a, ref):
    """|a - ref| / |ref| (Frobenius), in fp32, in chunks; inf if not finite."""
    num = 0.0
    den = 0.0
    a2, r2 = a.reshape(a.shape[0], -1), ref.reshape(ref.shape[0], -1)
    step = max(1, (64 << 20) // max(1, a2.shape[1]))
    for i in range(0, a2.shape[0], step):
        ac = a2[i:i + step].float()
        rc = r2[i:i + step].float()
        num += float(((ac - rc) ** 2).sum())
        den += float((rc ** 2).sum())
    if not math.isfinite(num):
        return float("inf")
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


# ----------------------------------------------------------- implementations

def pkg_version(module, dist):
    try:
        import importlib.metadata
        return importlib.metadata.version(dist)
    except Exception:
        return getattr(module, "__version__", "?")


class Impl:
    """An implementation: prepare() once per configuration, then run(leaves)
    is the layer (forward, in training mode) returning its output; grads()
    maps the gradients of the prepared leaves to (dx, drouter, dw1, dw2) in
    the reference's layout."""
    name = "?"

    def available(self, device):
        """None if it can run on `device`, else why not."""
        return None

    def prepare(self, prob):
        self.prob = prob
        self.leaves = prob.leaves()
        self.path = ""

    def run(self):
        raise NotImplementedError

    def grads(self, g):
        return g

    def routing_check(self):
        """(mismatching tokens or None, note) after one run()."""
        return None, ""

    def release(self):
        self.leaves = None
        self.prob = None


def import_smoe():
    try:
        import smoe  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import smoe  # noqa: F401
    return sys.modules["smoe"]


class SmoeImpl(Impl):
    def __init__(self, backend, consume_saved=False, logits_lowp=False):
        self.backend = backend            # 'sm90', 'cuda' or 'cpu'
        self.consume_saved = consume_saved  # dH written over the saved H
        self.logits_lowp = logits_lowp    # router logits in x's dtype (SonicMoE's are bf16)
        self.name = ("smoe-" + backend + ("-consume" if consume_saved else "")
                     + ("-lp" if logits_lowp else ""))

    def available(self, device):
        want_cpu = self.backend == "cpu"
        if want_cpu != (device == "cpu"):
            return "runs on %s tensors" % ("CPU" if want_cpu else "CUDA")
        try:
            import_smoe().library_version()
        except Exception as e:  # ImportError, OSError from ctypes
            return "import smoe: %s" % e
        return None

    def _select_backend(self):
        smoe = import_smoe()
        if self.backend != "cpu":
            os.environ["SMOE_TORCH_BACKEND"] = self.backend
        # smoe.functional caches one layer per configuration and device, not per
        # backend: drop the cache so the next call builds the forced backend.
        smoe.functional._layers.clear()

    def prepare(self, prob):
        super().prepare(prob)
        self._select_backend()
        self.smoe = import_smoe()
        self.out_extra = None

    def run(self):
        x, wr, w1, w2 = self.leaves
        out, counts, logits = self.smoe.moe(
            x, wr, w1, w2, top_k=self.prob.K, routing="topk_softmax", activation="swiglu",
            w1_layout="interleaved", consume_saved=self.consume_saved,
            router_logits_dtype=x.dtype if self.logits_lowp else None)
        self.out_extra = (counts, logits)
        return out

    def routing_check(self):
        counts, logits = self.out_extra
        layers = list(self.smoe.functional._layers.values())
        if layers:
            self.path = (layers[-1].path_name + (" consume_saved" if self.consume_saved else "")
                         + (" logits in %s" % str(self.leaves[0].dtype).replace("torch.", "")
                            if self.logits_lowp else ""))
        mism = routing_mismatch(self.prob, logits)
        want = torch.bincount(self.prob.top_i.reshape(-1), minlength=self.prob.E)
        note = "" if torch.equal(counts.long().cpu(), want.cpu()) else "expert counts differ"
        return mism, note

    def release(self):
        super().release()
        self.out_extra = None
        if "smoe" in sys.modules:
            sys.modules["smoe"].functional._layers.clear()
        os.environ.pop("SMOE_TORCH_BACKEND", None)


class TorchImpl(Impl):
    name = "torch"

    def prepare(self, prob):
        super().prepare(prob)
        self.path = "grouped_mm %s" % ("cuda" if prob.device != "cpu" else "cpu")

    def run(self):
        x, wr, w1, w2 = self.leaves
        return torch_baseline.moe_forward(x, wr, w1, w2, self.prob.K)

    def routing_check(self):
        # torch_baseline.moe_forward routes from bf16 logits: recompute them.
        x, wr = self.prob.x, self.prob.wr
        with torch.no_grad():
            return routing_mismatch(self.prob, (x @ wr.t()).float()), "routes itself (bf16 logits)"


class ScatterMoEImpl(Impl):
    name = "scattermoe"

    def available(self, device):
        if device == "cpu":
            return "Triton kernels: CUDA only"
        try:
            import scattermoe.mlp  # noqa: F401
        except Exception as e:
            return "import scattermoe: %s" % e
        return None

    def prepare(self, prob):
        super().prepare(prob)
        import scattermoe.mlp
        E, d, n, K = prob.E, prob.d, prob.n, prob.K
        # GLUMLP's up projection: rows [0, n) the 'up' half, [n, 2n) the gate.
        w1 = prob.w1
        w1_sc = torch.cat([w1[:, 1::2], w1[:, 0::2]], dim=1).contiguous()
        with torch.device("meta"):           # its own initial weights are replaced
            mlp = scattermoe.mlp.GLUMLP(d, n, E, K)
        mlp.experts.weight = torch.nn.Parameter(w1_sc)
        mlp.output_experts.weight = torch.nn.Parameter(prob.w2.clone())
        self.mlp = mlp
        x, wr = prob.leaves()[:2]
        self.leaves = [x, wr, mlp.experts.weight, mlp.output_experts.weight]
        self.path = "scattermoe %s" % pkg_version(sys.modules["scattermoe"], "scattermoe")

    def run(self):
        x, wr = self.leaves[:2]
        logits = x @ wr.t()
        p = logits.float().gather(1, self.prob.top_i).softmax(dim=1).to(x.dtype)
        return self.mlp(x, p, self.prob.top_i)

    def grads(self, g):
        dx, dwr, dw1_sc, dw2 = g
        n = self.prob.n
        dw1 = torch.empty_like(dw1_sc)
        dw1[:, 0::2] = dw1_sc[:, n:]
        dw1[:, 1::2] = dw1_sc[:, :n]
        return dx, dwr, dw1, dw2

    def routing_check(self):
        return 0, "reference routing given"

    def release(self):
        super().release()
        self.mlp = None


class SonicMoEImpl(Impl):
    """SonicMoE's layer function, the one its nn.Module (sonicmoe.MoE) calls:
    router GEMM, its top-K-then-softmax router, both expert GEMMs and their
    backward. Called directly so that the module's auxiliary load-balancing
    loss (an extra softmax over all E logits) is not timed: no other
    implementation here computes one. It takes smoe's weight layouts as they
    are (w1 (E, 2n, d) interleaved gate/up, w2 (E, d, n)), viewed as
    (2n, d, E) and (d, n, E) as sonicmoe.MoE.forward does."""
    name = "sonicmoe"

    def available(self, device):
        if device == "cpu":
            return "CUDA only"
        try:
            from sonicmoe.enums import ActivationType  # noqa: F401
            from sonicmoe.functional import moe_TC_softmax_topk_layer  # noqa: F401
        except Exception as e:
            return "import sonicmoe: %s: %s" % (type(e).__name__, str(e).splitlines()[0]
                                                if str(e) else "")
        return None

    def prepare(self, prob):
        super().prepare(prob)
        import sonicmoe
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_TC_softmax_topk_layer
        self.layer = moe_TC_softmax_topk_layer
        self.act = ActivationType.SWIGLU
        self.stream = torch.cuda.current_stream().cuda_stream
        self.out_extra = None
        self.path = "sonicmoe %s" % pkg_version(sonicmoe, "sonic-moe")

    def run(self):
        x, wr, w1, w2 = self.leaves
        out, logits, counts = self.layer(x, wr, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0),
                                         None, self.prob.K, self.stream, self.act, False)
        self.out_extra = (counts, logits)
        return out

    def routing_check(self):
        counts, logits = self.out_extra
        mism = routing_mismatch(self.prob, logits)
        want = torch.bincount(self.prob.top_i.reshape(-1), minlength=self.prob.E)
        note = "" if torch.equal(counts.long().cpu(), want.cpu()) else "expert counts differ"
        return mism, note

    def release(self):
        super().release()
        self.out_extra = None
        self.layer = None


IMPLS = {
    "smoe-sm90": lambda: SmoeImpl("sm90"),
    "smoe-cuda": lambda: SmoeImpl("cuda"),
    "smoe-sm90-consume": lambda: SmoeImpl("sm90", consume_saved=True),
    "smoe-sm90-consume-lp": lambda: SmoeImpl("sm90", consume_saved=True, logits_lowp=True),
    "smoe-cpu": lambda: SmoeImpl("cpu"),
    "smoe-cpu-lp": lambda: SmoeImpl("cpu", logits_lowp=True),
    "torch": TorchImpl,
    "scattermoe": ScatterMoEImpl,
    "sonicmoe": SonicMoEImpl,
}


# ------------------------------------------------------------------- timing

class PowerSampler:
    """The GPU's SM clock (MHz) and power draw (W) every 50 ms while a loop
    runs, from an `nvidia-smi --query-gpu ... -lms 50` child whose lines a
    thread reads (instant power where the driver has it, else the
    driver's power.draw). stop() returns (median MHz, mean W, samples) or
    None with no samples; a diagnostic, so a missing nvidia-smi gives None,
    never an error."""

    def __init__(self, device_index):
        self.index = device_index
        self.proc = None
        self.samples = []
        self.thread = None
        self.query = None

    def _gpu_id(self):
        try:  # the UUID names the GPU whatever CUDA_VISIBLE_DEVICES maps
            return "GPU-%s" % torch.cuda.get_device_properties(self.index).uuid
        except Exception:
            return str(self.index)

    def start(self):
        import threading
        gid = self._gpu_id()
        for q in ("clocks.sm,power.draw.instant", "clocks.sm,power.draw"):
            try:
                r = subprocess.run(["nvidia-smi", "-i", gid, "--query-gpu=" + q,
                                    "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=20)
            except Exception:
                return False
            if r.returncode == 0 and len(r.stdout.split(",")) == 2 and \
                    "N/A" not in r.stdout and "[" not in r.stdout:
                self.query = q
                break
        if not self.query:
            return False
        self.samples = []
        self.proc = subprocess.Popen(["nvidia-smi", "-i", gid, "--query-gpu=" + self.query,
                                      "--format=csv,noheader,nounits", "-lms", "50"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self.proc.stdout:
                try:
                    mhz, watts = (float(v) for v in line.split(","))
                except ValueError:
                    continue
                self.samples.append((mhz, watts))
        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()
        time.sleep(0.2)  # the child's first sample comes before the loop starts
        self.samples.clear()
        return True

    def stop(self):
        if not self.proc:
            return None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.thread.join(timeout=10)
        got, self.proc = list(self.samples), None
        if not got:
            return None
        return (statistics.median(m for m, _ in got), statistics.fmean(w for _, w in got),
                len(got))


class Timer:
    """CUDA-event timing of one callable, the L2 flushed before each repetition.

    The repetition is enqueued as: flush (256 MiB zeroed), a GPU-side delay
    (torch.cuda._sleep, --gpu-delay-ms long), start event, the callable, end
    event. The delay keeps the GPU busy while the CPU runs ahead and enqueues
    the callable's kernels, so the GPU time between the events is the layer's
    own, not the Python side's launch overhead (custom-op dispatch, ctypes,
    autograd, tensor allocation), as in a training loop where the CPU runs
    ahead of the GPU. Without it, each repetition starts with an idle GPU
    right after the flush and the events also time the host's work up to the
    first kernel and every gap where the host falls behind. Every
    implementation is timed the same way. The host's own time to enqueue the
    callable is measured too (perf_counter, no synchronization inside it) and
    reported; where it is longer than the delay, the timed region may
    include waits for the host (at most the excess), and where it is longer
    than the GPU time, the layer is host-bound.

    _sleep counts clock cycles: the cycles per millisecond are measured once
    here (the fastest of five 1M-cycle sleeps, so the delay is at least the
    asked-for time at the highest clock seen)."""

    def __init__(self, device, delay_ms=10.0):
        self.cuda = device != "cpu"
        # 256 MiB written before each repetition: more than any L2 (H100: 50 MB).
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None
        self.delay_ms = delay_ms if self.cuda else 0.0
        self.delay_cycles = 0
        self.cycles_per_ms = None
        if self.cuda and delay_ms > 0:
            n = 1_000_000
            best = None
            torch.cuda._sleep(n)
            for _ in range(5):
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                torch.cuda._sleep(n)
                e.record()
                torch.cuda.synchronize()
                ms = s.elapsed_time(e)
                best = ms if best is None else min(best, ms)
            self.cycles_per_ms = n / best
            self.delay_cycles = int(math.ceil(delay_ms * self.cycles_per_ms))

    def describe(self):
        if not self.cuda:
            return "host wall clock"
        if not self.delay_cycles:
            return "no GPU delay before the start event"
        return ("GPU delay %.2g ms (torch.cuda._sleep %d cycles, %.0f MHz measured) between the "
                "flush and the start event" % (self.delay_ms, self.delay_cycles,
                                               self.cycles_per_ms / 1e3))

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def loop_ms(self, fn, iters, warmup, sampler=None):
        """Wall time per iteration of a training-like loop: `warmup` calls, a
        synchronize, then `iters` calls back to back (no flush, no delay, no
        synchronization between them: the host enqueues the next iteration
        while the GPU runs the last, as far as the implementation lets it),
        a final synchronize. Host time is included: where the host cannot
        keep ahead of the GPU, this is slower than the isolated timings."""
        for _ in range(warmup):
            fn()
        self.sync()
        if sampler:
            sampler.start()  # (stop() returns None where it could not start)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / iters

    def median_ms(self, fn, reps):
        """(median GPU ms between the events, median host ms to enqueue fn)."""
        times, host = [], []
        for _ in range(reps):
            if self.cuda:
                self.flush.zero_()
                if self.delay_cycles:
                    torch.cuda._sleep(self.delay_cycles)
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
                host.append(times[-1])
        return statistics.median(times), statistics.median(host)


def measure(impl, prob, ref, args, timer):
    """One implementation on one configuration: a CSV record (dict)."""
    rec = {"impl": impl.name, "status": "", "path": "", "note": ""}
    impl.prepare(prob)
    try:
        # Check: one forward + backward against the reference.
        out = impl.run()
        mism, note = impl.routing_check()
        rec["path"] = impl.path
        rec["routing_mismatch"] = "" if mism is None else mism
        rec["note"] = note
        g = torch.autograd.grad(out, impl.leaves, prob.dout)
        got = dict(zip(GRAD_NAMES, (out,) + tuple(impl.grads(g))))
        timer.sync()
        keep = ref.get("dw_experts")
        if keep is not None:
            # the reference kept dW1, dW2 of these experts only (reference())
            idx = torch.tensor(keep, device=got["dw1"].device)
            got["dw1"] = got["dw1"].index_select(0, idx)
            got["dw2"] = got["dw2"].index_select(0, idx)
            rec["dw_experts_checked"] = len(keep)
        else:
            rec["dw_experts_checked"] = prob.E
        errs = {k: rel_err(got[k], ref[k]) for k in GRAD_NAMES}
        del out, g, got
        for k, v in errs.items():
            rec["err_" + k] = "%.3g" % v
        bad = [k for k, v in errs.items() if not v <= args.tol]
        if bad:
            rec["status"] = "failed"
            rec["note"] = ("; ".join(filter(None, [rec["note"], "over --tol %g: %s"
                                                    % (args.tol, ", ".join(bad))])))
            return rec
        if mism:
            rec["note"] = "; ".join(filter(None, [rec["note"],
                                                  "routing differs on %d tokens" % mism]))

        leaves, dout = impl.leaves, prob.dout

        def fwd():
            return impl.run()

        def fwd_bwd():
            o = impl.run()
            return torch.autograd.grad(o, leaves, dout)

        for _ in range(args.warmup):
            fwd_bwd()
        timer.sync()
        t_f, h_f = timer.median_ms(fwd, args.reps)
        t_fb, h_fb = timer.median_ms(fwd_bwd, args.reps)
        t_b = t_fb - t_f
        flops = 6.0 * prob.T * prob.K * prob.d * prob.n
        if args.loop_iters > 0:
            sampler = (PowerSampler(torch.cuda.current_device())
                       if args.loop_power and timer.cuda else None)
            t_loop = timer.loop_ms(fwd_bwd, args.loop_iters, args.warmup, sampler)
            power = sampler.stop() if sampler else None
            rec.update(loop_ms="%.4f" % t_loop,
                       loop_tflops="%.2f" % (3 * flops / (t_loop * 1e-3) / 1e12))
            if power:
                mhz, watts, _ = power
                rec.update(loop_mhz="%.0f" % mhz, loop_watts="%.1f" % watts,
                           loop_joules="%.4f" % (watts * t_loop * 1e-3))
            elif args.loop_power:
                rec["note"] = "; ".join(filter(None, [rec["note"], "no power samples"]))
        if timer.cuda:
            # The host's enqueue time against the GPU's: longer than the delay, the
            # region may hold waits for the host; longer than the GPU time, a loop
            # of such layers would leave the GPU waiting (host-bound).
            warn = []
            for what, h, t in (("fwd", h_f, t_f), ("fwd+bwd", h_fb, t_fb)):
                if h > t:
                    warn.append("host-bound %s: enqueue %.2f ms > GPU %.2f ms" % (what, h, t))
                elif h > timer.delay_ms:
                    warn.append("%s enqueue %.2f ms > delay %.2g ms" % (what, h, timer.delay_ms))
            rec["note"] = "; ".join(filter(None, [rec["note"]] + warn))
        rec.update(fwd_ms="%.4f" % t_f, bwd_ms="%.4f" % t_b,
                   host_fwd_ms="%.4f" % h_f, host_fwdbwd_ms="%.4f" % h_fb,
                   fwd_tflops="%.2f" % (flops / (t_f * 1e-3) / 1e12),
                   bwd_tflops="%.2f" % (2 * flops / (t_b * 1e-3) / 1e12) if t_b > 0 else "")
        if timer.cuda:
            impl.out_extra = None
            gc.collect()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = impl.run()
            torch.cuda.synchronize()
            rec["act_gib"] = "%.3f" % ((torch.cuda.memory_allocated() - before) / 2 ** 30)
            del out
            impl.out_extra = None
            gc.collect()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            req_before = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
            torch.cuda.reset_peak_memory_stats()
            if args.peak_detail:
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            g = fwd_bwd()
            torch.cuda.synchronize()
            rec["peak_gib"] = "%.4f" % ((torch.cuda.max_memory_allocated() - before) / 2 ** 30)
            # the same peak in the bytes asked for (the allocator's block
            # rounding left out); "before" as requested bytes too
            st = torch.cuda.memory_stats()
            if "requested_bytes.all.peak" in st:
                rec["peak_req_gib"] = "%.4f" % ((st["requested_bytes.all.peak"] - req_before)
                                               / 2 ** 30)
            if args.peak_detail:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                with open(args.peak_detail, "a") as f:
                    f.write(peak_detail(snap, "%s %s" % (impl.name, prob_name(prob)),
                                        float(rec["peak_gib"])))
            del g
        if args.kernels and timer.cuda:
            try:
                text = kernel_table(fwd, fwd_bwd, timer, "%s %s" % (impl.name, prob_name(prob)))
            except Exception as e:  # a diagnostic: the timings above stand without it
                text = "## %s %s: no kernel table (%s: %s)\n" % (impl.name, prob_name(prob),
                                                                  type(e).__name__, e)
            with open(args.kernels, "a") as f:
                f.write(text)
        rec["status"] = "ok"
        return rec
    finally:
        impl.release()


# ---------------------------------------------------------------------- main

def prob_name(prob):
    return "T=%d d=%d n=%d E=%d K=%d" % (prob.T, prob.d, prob.n, prob.E, prob.K)


def peak_detail(snap, title, peak_gib, top=14):
    """The allocations live at the peak of a recorded forward+backward
    (torch.cuda.memory._snapshot() with history on from its start): replays
    the allocator's alloc / free events, finds the largest live total and
    lists what was live then, largest first, each named by its innermost
    Python frame outside torch (file:line function). Text for --peak-detail."""
    live, total, best, best_set = {}, 0, -1, {}
    for ev in (t for dev in snap.get("device_traces", []) for t in dev):
        a = ev.get("action")
        if a == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif a in ("free_requested", "free") and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
        else:
            continue
        if total > best:
            best, best_set = total, dict(live)

    def where(ev):
        for fr in ev.get("frames", []):
            fn = fr.get("filename", "")
            if "/torch/" in fn or fn.startswith("<") or fn.endswith("compare.py") and \
                    fr.get("name") in ("fwd_bwd", "measure"):
                continue
            return "%s:%s %s" % (os.path.basename(fn), fr.get("line"), fr.get("name"))
        return "?"
    groups = {}
    for ev in best_set.values():
        k = where(ev)
        n, b = groups.get(k, (0, 0))
        groups[k] = (n + 1, b + ev["size"])
    lines = ["## %s: peak %.3f GiB (max_memory_allocated above before); replayed live "
             "total at its peak %.1f MiB in %d allocations" % (title, peak_gib, best / 2 ** 20,
                                                               len(best_set))]
    for k, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append("  %10.2f MiB  %3d x  %s" % (b / 2 ** 20, n, k))
    return "\n".join(lines) + "\n"


def kernel_times(fn, timer, reps):
    """[(kernel name, calls, GPU us per call of fn)] in the order of first
    launch, and the span (us from the first kernel's start to the last's
    end) per call, from torch.profiler over `reps` calls of fn, each after
    the timer's GPU delay (no L2 flush: its kernel would be listed)."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    timer.sync()
    spans = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if timer.delay_cycles:
                torch.cuda._sleep(timer.delay_cycles)
            fn()
            timer.sync()
    evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None
           and str(e.device_type).endswith("CUDA")]
    # torch.cuda._sleep's kernel (the delay) is not the layer's
    evs = [e for e in evs if "spin_kernel" not in e.name and "sleep" not in e.name.lower()]
    evs.sort(key=lambda e: e.time_range.start)
    order, agg = [], {}
    for e in evs:
        if e.name not in agg:
            order.append(e.name)
            agg[e.name] = [0, 0.0]
        agg[e.name][0] += 1
        agg[e.name][1] += e.time_range.end - e.time_range.start
    # the span of each call: calls are separated by the delay (a gap far
    # longer than any gap inside a call)
    gap = timer.delay_ms * 1e3 / 2 if timer.delay_cycles else float("inf")
    if evs:
        s0, end = evs[0].time_range.start, evs[0].time_range.end
        for e in evs[1:]:
            if e.time_range.start - end > gap:
                spans.append(end - s0)
                s0 = e.time_range.start
            end = max(end, e.time_range.end)
        spans.append(end - s0)
    rows = [(n, agg[n][0] / reps, agg[n][1] / reps) for n in order]
    return rows, (statistics.median(spans) if spans else 0.0)


def kernel_table(fwd, fwd_bwd, timer, title, reps=5):
    """Text for --kernels: each GPU kernel of the forward and of forward +
    backward, its launches and GPU time per call, the sum and the span."""
    out = []
    for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        rows, span = kernel_times(fn, timer, reps)
        tot = sum(r[2] for r in rows)
        out.append("## %s %s: kernels %.1f us, span %.1f us (first start to last end)"
                   % (title, what, tot, span))
        for name, calls, us in rows:
            short = name if len(name) <= 110 else name[:107] + "..."
            out.append("  %9.1f us %5.1f%% %4.1f x  %s" % (us, 100 * us / tot if tot else 0,
                                                          calls, short))
    return "\n".join(out) + "\n"


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


OTHER_DISTS = {"scattermoe": ["scattermoe"],
               "sonicmoe": ["sonic-moe", "quack-kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi"]}


def versions(device, names=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = ["date %s" % now.strftime("%Y-%m-%d %H:%M UTC")]
    if device != "cpu":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        lines.append("device %s (%d SMs, %.0f GiB)" % (p.name, p.multi_processor_count,
                                                       p.total_memory / 2 ** 30))
    else:
        lines.append("device cpu (%s, %d threads)" % (platform.processor() or platform.machine(),
                                                     torch.get_num_threads()))
    lines.append("torch %s (CUDA %s)" % (torch.__version__, torch.version.cuda))
    try:
        import triton
        lines.append("triton %s" % triton.__version__)
    except Exception:
        lines.append("triton none")
    try:
        smoe = import_smoe()
        lines.append("smoe %s (%s)" % (smoe.library_version(), smoe.library_path()))
    except Exception as e:
        lines.append("smoe unavailable (%s)" % str(e).splitlines()[0])
    import importlib.metadata
    for nm in names:
        found = []
        for dist in OTHER_DISTS.get(nm, []):
            try:
                found.append("%s %s" % (dist, importlib.metadata.version(dist)))
            except Exception:
                pass
        if found:
            lines.append("%s: %s" % (nm, ", ".join(found)))
    lines.append("python %s" % platform.python_version())
    return lines


class Progress:
    """tqdm if importable, else one line per step."""

    def __init__(self, total):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None
        self.total, self.done, self.t0 = total, 0, time.time()

    def step(self, what):
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        else:
            print("[%d/%d %4.0fs] %s" % (self.done, self.total, time.time() - self.t0, what),
                  file=sys.stderr, flush=True)

    def write(self, line):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def parse_configs(args):
    """[(name, T, d, n, E, K)] from --rows (names of grid.h's two tables, 'all'
    or 'grid' for SonicMoE's grid, 'models' for the public models' shapes) and
    --shape."""
    grid = torch_baseline.grid_rows()
    models = torch_baseline.model_rows()
    configs = []
    if args.rows is not None or not args.shape:
        names = []
        for tok in (args.rows or "all").split(","):
            names += (list(grid) if tok in ("all", "grid") else
                      list(models) if tok == "models" else [tok])
        for name in names:
            shape = grid.get(name) or models.get(name)
            if shape is None:
                sys.exit("compare.py: no row %r in bench/grid.h (rows: %s; or all, models)"
                         % (name, ", ".join(list(grid) + list(models))))
            configs.append((name,) + shape)
    for s in args.shape or []:
        try:
            T, d, n, E, K = (int(v) for v in s.split(","))
        except ValueError:
            sys.exit("compare.py: --shape %r: want T,d,n,E,K" % s)
        if min(T, d, n, E, K) < 1 or K > E:
            sys.exit("compare.py: --shape %r: sizes must be positive and K <= E" % s)
        configs.append(("T%d-d%d-n%d-E%d-K%d" % (T, d, n, E, K), T, d, n, E, K))
    return configs


ROW_FMT = "%-15s %-10s %-7s %8s %8s %7s %7s %8s %7s %8s %8s %8s %8s  %s"


def fmt_row(rec):
    return (ROW_FMT % (
        rec["row"], rec["impl"], rec["status"], rec.get("fwd_ms", ""), rec.get("bwd_ms", ""),
        rec.get("fwd_tflops", ""), rec.get("bwd_tflops", ""), rec.get("loop_ms", ""),
        rec.get("act_gib", ""),
        rec.get("err_out", ""), rec.get("err_dx", ""), rec.get("err_dw1", ""),
        rec.get("err_drouter", ""),
        rec.get("path", "") + ("  " + rec["note"] if rec.get("note") else "")))


def ratio_pair(spec, names):
    """(A, B) for the ratio table: --ratio A/B, else the first smoe
    implementation run and sonicmoe, if both are; None: no table."""
    if spec:
        a, _, b = spec.partition("/")
        if not a or not b:
            sys.exit("compare.py: --ratio %r: want A/B" % spec)
        return a, b
    smoe = [nm for nm in names if nm.startswith("smoe-")]
    return (smoe[0], "sonicmoe") if smoe and "sonicmoe" in names else None


def ratio_table(records, a, b):
    """Lines: per row, A's speed over B's measured in this run: B's time over
    A's for the forward, the backward (= the TFLOPS ratio) and the training
    loop's iteration, and the geometric means over the rows where both ran.
    > 1: A is faster."""
    by = {(r["row"], r["impl"]): r for r in records}
    rows = list(dict.fromkeys(r["row"] for r in records))
    out = ["# same-call ratios %s / %s (> 1: %s faster; %s's time over %s's): forward, "
           "backward, training-loop iteration; %s's kernel path" % (a, b, a, b, a, a),
           "%-15s %7s %7s %7s  %s" % ("row", "fwd", "bwd", "loop", "path / why not")]
    logs = {"fwd": [], "bwd": [], "loop": []}
    per_row = {}   # row -> its logs, for the tables' own geometric means
    for row in rows:
        ra, rb = by.get((row, a)), by.get((row, b))
        if not ra or not rb or ra["status"] != "ok" or rb["status"] != "ok":
            why = "; ".join("%s %s%s" % (nm, r["status"], ": " + r["note"] if r.get("note") else "")
                            for nm, r in ((a, ra), (b, rb)) if r and r["status"] != "ok")
            out.append("%-15s %7s %7s %7s  %s" % (row, "-", "-", "-", why or "not run"))
            continue
        vals = {}
        for key in ("fwd", "bwd", "loop"):
            num_a, num_b = rb.get(key + "_ms"), ra.get(key + "_ms")   # B's time / A's
            try:
                v = float(num_a) / float(num_b)
            except (TypeError, ValueError, ZeroDivisionError):
                v = None
            vals[key] = v
            if v and v > 0:
                logs[key].append(math.log(v))
                per_row.setdefault(row, {})[key] = math.log(v)
        out.append("%-15s %7s %7s %7s  %s" % (row, *("%.3f" % vals[k] if vals[k] else "-"
                                                     for k in ("fwd", "bwd", "loop")),
                                              ra.get("path", "")))
    out.append("%-15s %7s %7s %7s  %s" % ("geomean", *("%.3f" % math.exp(sum(v) / len(v))
                                                       if v else "-" for v in logs.values()),
                                          "over %d row(s)" % len(logs["fwd"])))
    # each table's own, where the run has rows of both
    tables = (("models", set(torch_baseline.model_rows())),
              ("grid", set(torch_baseline.grid_rows())))
    if all(names & set(per_row) for _, names in tables):
        for label, names in tables:
            mine = [per_row[r] for r in per_row if r in names]
            means = []
            for key in ("fwd", "bwd", "loop"):
                v = [m[key] for m in mine if key in m]
                means.append("%.3f" % math.exp(sum(v) / len(v)) if v else "-")
            out.append("%-15s %7s %7s %7s  %s" % ("geomean " + label, *means,
                                                  "over %d row(s)" % len(mine)))
    return out


def power_table(records, a, b):
    """Lines: per row, the loop's median SM clock, mean power and energy per
    iteration of A and B (--loop-power), and B's energy over A's (> 1: A
    uses less); [] where no row has samples for both."""
    by = {(r["row"], r["impl"]): r for r in records}
    out = []
    for row in dict.fromkeys(r["row"] for r in records):
        ra, rb = by.get((row, a)), by.get((row, b))
        if not ra or not rb or not ra.get("loop_joules") or not rb.get("loop_joules"):
            continue
        out.append("%-15s %6s %6s %8s %6s %6s %8s %7s" % (
            row, ra["loop_mhz"], ra["loop_watts"], ra["loop_joules"], rb["loop_mhz"],
            rb["loop_watts"], rb["loop_joules"],
            "%.3f" % (float(rb["loop_joules"]) / float(ra["loop_joules"]))))
    if not out:
        return []
    return (["# training loop, %s then %s: median SM clock (MHz), mean power (W), energy per "
             "iteration (J); B's energy over A's (> 1: %s uses less)" % (a, b, a),
             "%-15s %6s %6s %8s %6s %6s %8s %7s" % ("row", "A MHz", "A W", "A J", "B MHz", "B W",
                                                  "B J", "energy")] + out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="grid.h rows by name, comma-separated; 'all' (or 'grid'): "
                    "SonicMoE's 12; 'models': the public models' shapes (default: all, unless "
                    "--shape is given)")
    ap.add_argument("--shape", action="append", help="T,d,n,E,K (repeatable)")
    ap.add_argument("--impls", help="comma-separated, from %s (default: smoe-sm90,smoe-cuda,"
                    "torch,scattermoe,sonicmoe on CUDA; smoe-cpu,torch on CPU)" % ", ".join(IMPLS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="forward+backward runs before timing")
    ap.add_argument("--tol", type=float, default=5e-2,
                    help="largest relative L2 error of the output and each gradient")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-delay-ms", type=float, default=10.0,
                    help="GPU-side delay between the L2 flush and the start event, so the host's "
                    "launch overhead is not timed (0: none; see Timer)")
    ap.add_argument("--loop-iters", type=int, default=20,
                    help="training-loop timing: forward+backward iterations back to back, wall "
                    "time per iteration, host included (0: skip)")
    ap.add_argument("--loop-power", action="store_true",
                    help="sample the SM clock and power by nvidia-smi during the loop; the CSV's "
                    "loop_mhz, loop_watts, loop_joules and a table after the ratios")
    ap.add_argument("--ref-dw-gib", type=float, default=4.0,
                    help="fp32 dW1+dW2 the reference keeps; past it, only a spread subset of "
                    "experts' dW is checked (out, dx, drouter always in full)")
    ap.add_argument("--ratio", help="A/B: print a table of A's speed over B's per row, last "
                    "(default: the first smoe implementation over sonicmoe, if both are run)")
    ap.add_argument("--table-only", metavar="CSV",
                    help="print the ratio table (--ratio, default smoe-sm90/sonicmoe) of an "
                    "earlier run's CSV and exit; no device needed")
    ap.add_argument("--csv", help="write the results here (written row by row)")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD, if any)")
    ap.add_argument("--peak-detail", metavar="FILE",
                    help="append, per implementation and row, the allocations live at the "
                    "forward+backward's peak (allocator history replayed; slower)")
    ap.add_argument("--kernels", metavar="FILE",
                    help="append each implementation's GPU kernels per forward and per "
                         "forward+backward (torch.profiler: name, launches, us) to FILE")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds; configurations not started by then are skipped (0: none)")
    args = ap.parse_args()

    if args.table_only:
        with open(args.table_only, newline="") as f:
            records = list(csv.DictReader(ln for ln in f if not ln.startswith("#")))
        pair = ratio_pair(args.ratio or "smoe-sm90/sonicmoe", [])
        for line in ratio_table(records, *pair) + power_table(records, *pair):
            print(line)
        return 0

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("compare.py: no CUDA device (use --device cpu for the smoke test)")
    names = (args.impls.split(",") if args.impls else
             ["smoe-sm90", "smoe-cuda", "torch", "scattermoe", "sonicmoe"] if device == "cuda"
             else ["smoe-cpu", "torch"])
    for nm in names:
        if nm not in IMPLS:
            sys.exit("compare.py: no implementation %r (have: %s)" % (nm, ", ".join(IMPLS)))
    configs = parse_configs(args)
    impls = [IMPLS[nm]() for nm in names]
    why_not = {im.name: im.available(device) for im in impls}
    runnable = [im for im in impls if why_not[im.name] is None]

    timer = Timer(device, args.gpu_delay_ms)
    header = versions(device, names)
    header.append("commit %s" % (args.commit or git_commit() or "unknown"))
    header.append("settings reps=%d warmup=%d tol=%g seed=%d; L2 flushed (256 MiB) before each "
                  "rep, then %s; medians; bf16, SwiGLU, TOPK_SOFTMAX; training loop: %s"
                  % (args.reps, args.warmup, args.tol, args.seed, timer.describe(),
                     "%d fwd+bwd iterations back to back after %d, wall time per iteration, "
                     "no flush, no delay" % (args.loop_iters, args.warmup)
                     if args.loop_iters > 0 else "off"))
    header.append("command %s" % " ".join(sys.argv))
    for line in header:
        print("# " + line)
    for nm, why in why_not.items():
        if why:
            print("# %s unavailable: %s" % (nm, why))

    csv_file = open(args.csv, "w", newline="") if args.csv else None
    writer = None
    if csv_file:
        for line in header:
            csv_file.write("# " + line + "\n")
        writer = csv.DictWriter(csv_file, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()

    def emit(rec):
        if writer:
            writer.writerow(rec)
            csv_file.flush()

    print(ROW_FMT % (
        "row", "impl", "status", "fwd ms", "bwd ms", "fwd TF", "bwd TF", "loop ms", "act GiB",
        "err out", "err dx", "err dw1", "err dr", "path / note"), flush=True)
    progress = Progress(len(configs) * (1 + len(runnable)))
    t_start = time.time()
    n_failed = 0
    records = []
    for (name, T, d, n, E, K) in configs:
        base = {"row": name, "T": T, "d": d, "n": n, "E": E, "K": K}
        if args.time_budget and time.time() - t_start > args.time_budget:
            for im in impls:
                rec = dict(base, impl=im.name, status="skipped", note="--time-budget reached")
                emit(rec)
                progress.write(fmt_row(rec))
            for _ in range(1 + len(runnable)):
                progress.step("%s skipped" % name)
            continue
        prob = ref = None
        try:
            prob = Problem(T, d, n, E, K, device, args.seed)
            if not prob.designed_ok:
                progress.write("# %s: the reference routing is not the designed one "
                               "(min margin %.3g)" % (name, prob.margin))
            ref = reference(prob, args.ref_dw_gib)
            timer.sync()
        except Exception as e:
            msg = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            for im in impls:
                rec = dict(base, impl=im.name, status="error", note="problem/reference: " + msg)
                n_failed += 1
                emit(rec)
                progress.write(fmt_row(rec))
            prob = ref = None
            gc.collect()
            if timer.cuda:
                torch.cuda.empty_cache()
            for _ in range(1 + len(runnable)):
                progress.step("%s error" % name)
            continue
        progress.step("%s reference" % name)
        for im in impls:
            if why_not[im.name]:
                rec = dict(base, impl=im.name, status="unavailable", note=why_not[im.name])
            else:
                try:
                    rec = dict(base, **measure(im, prob, ref, args, timer))
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    rec = dict(base, impl=im.name, status="error",
                               note="%s: %s" % (type(e).__name__, msg[0] if msg else ""))
                    if os.environ.get("COMPARE_TRACEBACK"):
                        traceback.print_exc()
                gc.collect()
                if timer.cuda:
                    torch.cuda.empty_cache()
                progress.step("%s %s" % (name, im.name))
            if rec["status"] in ("failed", "error"):
                n_failed += 1
            records.append(rec)
            emit(rec)
            progress.write(fmt_row(rec))
        if not prob.designed_ok or prob.margin < 0.5:
            progress.write("# %s: reference routing margin %.3g" % (name, prob.margin))
        del prob, ref
        gc.collect()
        if timer.cuda:
            torch.cuda.empty_cache()
    progress.close()
    if csv_file:
        csv_file.close()
    print("# %d configurations, %d implementation(s) failed or errored, %.0f s"
          % (len(configs), n_failed, time.time() - t_start))
    pair = ratio_pair(args.ratio, names)
    if pair:
        for line in ratio_table(records, *pair) + power_table(records, *pair):
            print(line)
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
