"""smoe.EPMoE: the expert-parallel layer over a torch.distributed group.

Each of the group's P processes (one GPU each) holds E/P experts (rank r:
experts [r E/P, (r+1) E/P)) and passes its own tokens; the library moves
each token to the ranks of its experts and back over NCCL, on the current
CUDA stream, with no host synchronisation (include/smoe.h, "expert
parallelism"; notes/ep_design.md).

The library's NCCL communicator is its own, made from a unique id that rank
0 of the group creates and broadcasts over the group (as vLLM's ctypes NCCL
wrapper does), with the libnccl this process already has (PyTorch's):

    group = smoe.EPGroup(torch.distributed.group.WORLD)   # collective, once
    layer = smoe.EPMoE(num_experts=64, num_experts_per_tok=8, hidden_size=1024,
                       intermediate_size=512, ep_group=group, max_tokens=8192).cuda().bfloat16()
    out, aux_loss = layer(x)          # x: this rank's tokens (..., 1024)

Calls are collective: every rank runs forward and backward of the layer
together (T may differ per rank, at most max_tokens). The router weight is
replicated: its gradient here is this rank's share, to be summed over the
group like any replicated parameter's (DDP does; or layer.reduce_router_grad()).
The expert weights are this rank's own: do not average them over the group.
CUDA tensors, bfloat16. Eager autograd (torch.compile: not yet).

EPGroup.in_process(P) gives P groups for P threads of one process instead:
the library's in-process transport on its CPU backend (float32, float64 or
bfloat16 CPU tensors), for tests and simulation without GPUs.
"""
import ctypes
import os
import threading

import torch
import torch.nn as nn

from . import _lib as L
from ._lib import SmoeError
from .functional import (_DTYPES, ACTIVATIONS, GATED, W1_LAYOUTS, SmoeValueError, _aligned,
                         _enum)
from .module import (Experts, _check_int, _switch_loss, check_layer_sizes, check_routing,
                     keep_expert_bias_float32)

__all__ = ["EPGroup", "EPMoE"]


class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


_nccl = None


def _nccl_lib():
    """libnccl: the one this process has loaded (PyTorch's, found by its
    soname), else $SMOE_NCCL_LIBRARY, else the nvidia-nccl wheel's. libsmoe
    then finds the same library (it looks for a loaded libnccl.so.2 first)."""
    global _nccl
    if _nccl is not None:
        return _nccl
    names = ["libnccl.so.2"]
    env = os.environ.get("SMOE_NCCL_LIBRARY")
    if env:
        names.insert(0, env)
    try:
        import nvidia.nccl
        for p in nvidia.nccl.__path__:
            names.append(os.path.join(p, "lib", "libnccl.so.2"))
    except ImportError:
        pass
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as e:
            errors.append(str(e))
    else:
        raise SmoeError(L.SMOE_ERROR_NO_DEVICE, "smoe.EPGroup: no libnccl (%s); set "
                        "SMOE_NCCL_LIBRARY" % "; ".join(errors))
    lib.ncclGetUniqueId.restype = ctypes.c_int
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_NcclUniqueId)]
    lib.ncclCommInitRank.restype = ctypes.c_int
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                     _NcclUniqueId, ctypes.c_int]
    lib.ncclCommDestroy.restype = ctypes.c_int
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    _nccl = lib
    return lib


def _nccl_check(r, what):
    if r != 0:
        raise SmoeError(L.SMOE_ERROR_BACKEND, "smoe.EPGroup: %s: %s"
                        % (what, _nccl_lib().ncclGetErrorString(r).decode(errors="replace")))


class _Threads:
    """What the P threads of an in-process group share: the library's
    smoe_ep_group (freed with this object) and the slots of all_reduce."""

    def __init__(self, nranks):
        lib = L.lib()
        handle = ctypes.c_void_p()
        L.check(lib.smoe_ep_group_create(nranks, ctypes.byref(handle)))
        self._lib = lib
        self.handle = handle
        self.barrier = threading.Barrier(nranks)
        self.slots = [None] * nranks

    def all_reduce(self, rank, t):
        # Every rank adds the slots in rank order: the same bits everywhere.
        # The second wait keeps a slot until every rank has read it.
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for v in self.slots[1:]:
            total += v
        self.barrier.wait()
        self.slots[rank] = None
        t.copy_(total)

    def __del__(self):
        L.release(self, "handle", lambda h: self._lib.smoe_ep_group_free(h))


class EPGroup:
    """The library's NCCL communicator over a torch.distributed process group
    (default: the world), on this process's current CUDA device. Collective:
    every rank of the group constructs it together. (EPGroup.in_process(P):
    P groups for P threads of this process, on the CPU.)"""

    def __init__(self, group=None, device=None):
        import torch.distributed as dist
        self._threads = None
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        nccl = _nccl_lib()
        uid = _NcclUniqueId()
        if self.rank == 0:
            _nccl_check(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        t = torch.tensor(list(bytes(uid)), dtype=torch.uint8, device=self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        uid = _NcclUniqueId.from_buffer_copy(bytes(t.cpu().tolist()))
        comm = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _nccl_check(nccl.ncclCommInitRank(ctypes.byref(comm), self.size, uid, self.rank),
                        "ncclCommInitRank")
        self.comm = comm

    @classmethod
    def in_process(cls, nranks):
        """nranks groups, the r-th for rank r, to be used by nranks threads of
        this process (one rank each, calling every layer together): the
        library's in-process transport (smoe_ep_group), whose layers run on
        the CPU backend; all_reduce sums over the threads. For tests and
        simulation without GPUs."""
        shared = _Threads(nranks)
        groups = []
        for r in range(nranks):
            g = cls.__new__(cls)
            g._threads = shared
            g.group, g.rank, g.size, g.comm = None, r, nranks, None
            g.device = torch.device("cpu")
            groups.append(g)
        return groups

    def all_reduce(self, t):
        """Sums t over the group's ranks, in place, on every rank, and returns
        it. Collective. Over NCCL: torch.distributed.all_reduce on the
        group, ordered after the current stream's work, no host
        synchronisation."""
        if self._threads is not None:
            self._threads.all_reduce(self.rank, t)
        else:
            import torch.distributed as dist
            dist.all_reduce(t, group=self.group)
        return t

    def __del__(self):
        L.release(self, "comm", lambda c: _nccl_lib().ncclCommDestroy(c))


class _EPLayer:
    """One smoe_ep_layer handle (freed with the object) and its sizes per T."""

    def __init__(self, desc, group):
        lib = L.lib()
        ptr = ctypes.c_void_p()
        L.check(lib.smoe_ep_layer_create(ctypes.byref(desc), ctypes.byref(ptr)))
        self._group = group   # its communicator (or threads) outlives the handle
        self._lib = lib
        self.ptr = ptr
        self.desc = desc
        self.path_name = lib.smoe_ep_layer_path_name(ptr).decode()
        self._sizes = {}

    def __del__(self):
        L.release(self, "ptr", lambda p: self._lib.smoe_ep_layer_free(p))

    def sizes(self, T):
        s = self._sizes.get(T)
        if s is None:
            ws = self._lib.smoe_ep_layer_workspace_bytes(self.ptr, T)
            sv = self._lib.smoe_ep_layer_saved_bytes(self.ptr, T)
            if ws == 0 or sv == 0:
                raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, L.last_error())
            s = self._sizes[T] = (ws, sv)
        return s

    def call(self, fn, args, saved, ws, stream):
        lib = self._lib
        if stream is not None:
            st = lib.smoe_ep_layer_device_status(self.ptr, stream, 0)
            if st != L.SMOE_SUCCESS:
                raise SmoeError(st, "%s (found on the device in an earlier call of this layer; "
                                "this call was not run)" % L.last_error())
        ptype = fn.argtypes[1]  # POINTER(smoe_forward_args) or (smoe_backward_args)
        L.check(fn(self.ptr, ctypes.cast(ctypes.pointer(args), ptype), saved.data_ptr(),
                   saved.numel(), ws.data_ptr(), ws.numel(), stream))


def _p(t):
    return t.data_ptr() if t is not None else None


class _EPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, router_w, w1, w2, b1, b2, expert_bias, layer):
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        T, E = x.shape[0], layer.desc.layer.E
        ws_n, saved_n = layer.sizes(T)
        out = torch.empty_like(x)
        counts = torch.empty(E, dtype=torch.int32, device=x.device)
        logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
        saved = torch.empty(saved_n, dtype=torch.uint8, device=x.device)
        ws = torch.empty(ws_n, dtype=torch.uint8, device=x.device)
        args = L.forward_args_raw(T, x.data_ptr(), router_w.data_ptr(), 0, None, None, None,
                                  w1.data_ptr(), _p(b1), w2.data_ptr(), _p(b2), out.data_ptr(),
                                  logits.data_ptr(), counts.data_ptr(), 0, _p(expert_bias))
        layer.call(layer._lib.smoe_ep_layer_forward, args, saved, ws, stream)
        ctx.layer = layer
        ctx.has_bias = b1 is not None
        ctx.save_for_backward(x, router_w, w1, w2, b2, saved)
        ctx.mark_non_differentiable(counts)
        return out, counts, logits

    @staticmethod
    def backward(ctx, dout, dcounts, dlogits):
        x, router_w, w1, w2, b2, saved = ctx.saved_tensors
        layer = ctx.layer
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        T = x.shape[0]
        ws_n, _ = layer.sizes(T)
        ws = torch.empty(ws_n, dtype=torch.uint8, device=x.device)
        dout = _aligned(dout.to(x.dtype), 16 if x.is_cuda else x.element_size())
        if dlogits is not None:
            dlogits = _aligned(dlogits.to(torch.float32), 4)
        needs = ctx.needs_input_grad
        dx = torch.empty_like(x) if needs[0] else None
        dwr = torch.empty_like(router_w) if needs[1] else None
        dw1 = torch.empty_like(w1) if needs[2] else None
        dw2 = torch.empty_like(w2) if needs[3] else None
        db1 = (torch.empty(w1.shape[:2], dtype=w1.dtype, device=w1.device)
               if ctx.has_bias and needs[4] else None)
        db2 = torch.empty_like(b2) if ctx.has_bias and needs[5] else None
        dt = layer.desc.layer.dtype
        args = L.backward_args_raw(T, x.data_ptr(), router_w.data_ptr(), 0, w1.data_ptr(),
                                   w2.data_ptr(), _p(b2), dout.data_ptr(), _p(dlogits),
                                   _p(dx), dt, 0, _p(dwr), dt, 0, _p(dw1), dt, 0, _p(db1), dt, 0,
                                   _p(dw2), dt, 0, _p(db2), dt, 0, None, L.SMOE_DTYPE_F32, 0)
        layer.call(layer._lib.smoe_ep_layer_backward, args, saved, ws, stream)
        return dx, dwr, dw1, dw2, db1, db2, None, None


class _GroupSum(torch.autograd.Function):
    """t (a tensor of this rank) summed over an EPGroup, differentiable with
    the group's objective the sum of every rank's loss (as
    torch.distributed.nn.functional.all_reduce): t's gradient on each rank
    is the sum over the ranks of the result's gradient, the same all_reduce."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return group.all_reduce(t.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.clone(memory_format=torch.contiguous_format)), None


_AUX_LOSS_SCOPES = ("local", "group")


class EPMoE(nn.Module):
    """smoe.MoE's layer, expert-parallel over `ep_group` (an EPGroup, or a
    torch.distributed group to make one from). Parameters on this rank:
    router (E, d) replicated; c_fc (E/P, 2n|n, d) and c_proj (E/P, d, n)
    this rank's experts, [rank E/P, (rank+1) E/P) of the whole layer.

    max_tokens: the largest token count any rank's call passes (sizes the
    exchange buffers); capacity (rows one rank sends another per call, 0 =
    max_tokens) and expert_rows ((row, expert) pairs one rank computes, 0 =
    the worst case) as in smoe_ep_desc: a call beyond them fails on every
    rank, raised by the layer's next call or smoe.EPMoE.check_device().
    overlap (0 = the library decides, 1 = on, -1 = off) and comm_sms (SMs
    left to NCCL beside the GEMMs, 0 = 4 per rank within [8, 32]) as in smoe_ep_desc.

    routing: 'topk_softmax', 'softmax_topk' (with `renormalize`) or
    'sigmoid_topk' with n_group, topk_group and routed_scaling, as
    smoe.MoE takes them (the same checks and messages, made before the
    group is touched). With 'sigmoid_topk' the layer has smoe.MoE's
    persistent float32 buffer expert_bias (num_experts,), zeros at first,
    float32 whatever the layer's dtype, read for the choice only (no
    gradient). It is replicated: each rank routes its own tokens with its
    copy, so the copies must stay equal. Update it on every rank the same
    way from the group's counts, e.g. with u = 1e-3:

        load = layer.group.all_reduce(layer.last_expert_counts.float())
        layer.expert_bias += u * torch.sign(load.mean() - load)

    (last_expert_counts: the last forward's rows per expert of this rank's
    tokens, (E,) int32; group.all_reduce sums over the group, collective.)

    forward(hidden_states (..., d), *, output_router_logits=None) returns
    (out (..., d), aux_loss), or with output_router_logits (the
    constructor's, or forward's when not None) (out, aux_loss,
    router_logits (T, E) float32, T this rank's tokens), as smoe.MoE
    returns them: differentiable, for smoe.router_z_loss or Hugging Face's
    load-balancing loss.

    aux_loss is the Switch load-balancing loss (smoe.switch_load_balancing_loss),
    of this rank's tokens with aux_loss_scope='local' (the default: no
    communication), or of the group's with aux_loss_scope='group': the
    per-expert counts and sums of router probabilities are summed over the
    group (torch.distributed all_reduces of E values, two in forward, one
    in backward; no host synchronisation), so every rank gets the loss the
    single-GPU layer gives on the gathered batch. Its gradient counts the
    loss once per rank, as for any loss each rank adds: summed over the
    group (reduce_router_grad) the router's gradient is P times the
    single-GPU layer's gradient of that loss, averaged (DDP) it is that
    gradient. With 'group' its backward is collective: every rank
    backpropagates the aux loss, or none does.
    """

    def __init__(self, num_experts, num_experts_per_tok, hidden_size, intermediate_size,
                 activation_function="swiglu", add_bias=False, std=0.02, *, ep_group=None,
                 max_tokens, capacity=0, expert_rows=0, routing="topk_softmax",
                 renormalize=True, w1_layout="interleaved", overlap=0, comm_sms=0, n_group=0,
                 topk_group=0, routed_scaling=1.0, output_router_logits=False,
                 aux_loss_scope="local"):
        super().__init__()
        # Every argument is checked before the group is touched: a refused
        # layer makes no communicator.
        who = "smoe.EPMoE"
        E, K, d, n = check_layer_sizes(num_experts, num_experts_per_tok, hidden_size,
                                       intermediate_size, who)
        self.activation = _enum(ACTIVATIONS, activation_function, who + ": activation_function")
        self.routing, self.n_group, self.topk_group, self.routed_scaling = check_routing(
            routing, n_group, topk_group, routed_scaling, E, K, who,
            "the C API's smoe_ep_layer takes them, smoe.EPMoE does not")
        self.w1_layout = _enum(W1_LAYOUTS, w1_layout, who + ": w1_layout")
        for name, v in (("max_tokens", max_tokens), ("capacity", capacity),
                        ("expert_rows", expert_rows)):
            _check_int(v, who + ": " + name, 0)
        if overlap not in (-1, 0, 1):
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.EPMoE: overlap = %r, must be "
                                 "-1, 0 or 1" % (overlap,))
        _check_int(comm_sms, who + ": comm_sms", -1)
        if aux_loss_scope not in _AUX_LOSS_SCOPES:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.EPMoE: aux_loss_scope = %r, "
                                 "must be 'local' (this rank's tokens) or 'group' (the group's)"
                                 % (aux_loss_scope,))
        self.group = ep_group if isinstance(ep_group, EPGroup) else EPGroup(ep_group)
        P, r = self.group.size, self.group.rank
        if num_experts % P:
            raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "smoe.EPMoE: num_experts = %d cannot be "
                            "split evenly over %d ranks" % (num_experts, P))
        self.num_experts = E
        self.top_k = K
        self.hidden_size = d
        self.intermediate_size = n
        self.renormalize = bool(renormalize)
        self.max_tokens, self.capacity, self.expert_rows = (int(max_tokens), int(capacity),
                                                            int(expert_rows))
        self.overlap, self.comm_sms = int(overlap), int(comm_sms)
        self.output_router_logits = bool(output_router_logits)
        self.aux_loss_scope = aux_loss_scope
        self.local_experts = E // P
        self.expert_start = r * self.local_experts
        gated = self.activation in GATED
        self.router = nn.Linear(d, E, bias=False)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.c_fc = Experts(self.local_experts, d, 2 * n if gated else n, add_bias, std)
        self.c_proj = Experts(self.local_experts, n, d, add_bias, std)
        # (None, for the other routings, is no buffer: not in the state dict.)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32)
                             if self.routing == L.SMOE_ROUTING_SIGMOID_TOPK else None)
        self.last_expert_counts = None
        self._layer = None
        self._layer_on = None

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        keep_expert_bias_float32(self)
        return out

    def _get_layer(self, device, dtype):
        if self._layer is not None:
            if (device, dtype) != self._layer_on:
                raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.EPMoE: x is %s %s, but "
                                     "this layer runs on %s %s (its first call's)"
                                     % ((device, dtype) + self._layer_on))
            return self._layer
        threads = self.group._threads
        if threads is None:
            if dtype != torch.bfloat16 or device.type != "cuda":
                raise SmoeError(L.SMOE_ERROR_UNSUPPORTED, "smoe.EPMoE: CUDA bfloat16 tensors "
                                "(got %s %s)" % (device, dtype))
            backend = L.SMOE_BACKEND_AUTO
            index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            if device.type != "cpu" or dtype not in _DTYPES:
                raise SmoeError(L.SMOE_ERROR_UNSUPPORTED, "smoe.EPMoE: an in-process group's "
                                "layer takes CPU float32, float64 or bfloat16 tensors (got %s %s)"
                                % (device, dtype))
            backend, index = L.SMOE_BACKEND_CPU, 0
        lib = L.lib()
        ed = lib.smoe_ep_desc_default()
        D = ed.layer
        D.d, D.n, D.E, D.K = (self.hidden_size, self.intermediate_size, self.num_experts,
                              self.top_k)
        D.activation, D.w1_layout = self.activation, self.w1_layout
        D.has_bias = int(self.c_fc.bias is not None)
        D.routing, D.renormalize = self.routing, int(self.renormalize)
        D.n_group, D.topk_group, D.routed_scaling = (self.n_group, self.topk_group,
                                                     self.routed_scaling)
        D.dtype = _DTYPES[dtype]
        D.backend = backend
        D.device = index
        ed.layer = D
        ed.rank, ed.nranks = self.group.rank, self.group.size
        if threads is None:
            ed.nccl_comm = self.group.comm
        else:
            ed.group = threads.handle
        ed.max_tokens, ed.capacity, ed.expert_rows = (self.max_tokens, self.capacity,
                                                      self.expert_rows)
        ed.overlap, ed.comm_sms = self.overlap, self.comm_sms
        self._layer = _EPLayer(ed, self.group)
        self._layer_on = (device, dtype)
        return self._layer

    @property
    def path_name(self):
        return self._layer.path_name if self._layer is not None else None

    def _check_input(self, x):
        """x against the layer: hidden size, and the device and dtype of the
        parameters (and of expert_bias: the library reads it there)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError("smoe.EPMoE.forward: hidden_states (x) must be a torch.Tensor, "
                            "got %s" % type(x).__name__)
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_SIZE,
                                 "smoe.EPMoE: x (hidden_states) has shape %s, its last dimension"
                                 " must be hidden_size = %d" % (tuple(x.shape), self.hidden_size))
        w = self.c_fc.weight
        if x.device != w.device or x.dtype != w.dtype:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.EPMoE: x (hidden_states) is %s %s but the layer's "
                                 "parameters are %s %s" % (x.device, x.dtype, w.device, w.dtype))
        bias = self.expert_bias
        if bias is not None and (bias.device != x.device or bias.dtype != torch.float32
                                 or bias.shape != (self.num_experts,)):
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.EPMoE: expert_bias is %s %s %s, must be float32 (%d,) on "
                                 "x's device %s" % (bias.device, bias.dtype, tuple(bias.shape),
                                                    self.num_experts, x.device))

    def forward(self, hidden_states, *, output_router_logits=None):
        self._check_input(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        layer = self._get_layer(x.device, x.dtype)
        if x.shape[0] > self.max_tokens:
            raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "smoe.EPMoE: %d tokens, more than "
                            "max_tokens = %d" % (x.shape[0], self.max_tokens))
        align = 16 if x.is_cuda else x.element_size()
        x, *w = [_aligned(t, align) if t is not None else None for t in (
            x, self.router.weight, self.c_fc.weight, self.c_proj.weight, self.c_fc.bias,
            self.c_proj.bias)]
        bias = self.expert_bias
        if bias is not None:
            bias = _aligned(bias.detach(), 4)
        out, counts, logits = _EPFunction.apply(x, *w, bias, layer)
        self.last_expert_counts = counts
        aux = _switch_loss(logits, counts,
                           self._group_sums if self.aux_loss_scope == "group" else None)
        if output_router_logits is None:
            output_router_logits = self.output_router_logits
        if output_router_logits:
            return out.reshape(shape), aux, logits
        return out.reshape(shape), aux

    def _group_sums(self, prob_sums, counts):
        """The Switch loss's per-expert probability sums (differentiable) and
        counts, summed over the group."""
        counts = self.group.all_reduce(counts.clone())
        return _GroupSum.apply(prob_sums, self.group), counts

    def reduce_router_grad(self):
        """Sums the router weight's gradient over the group (the rank's
        share of a replicated parameter's gradient; not needed under DDP,
        which does it)."""
        if self.router.weight.grad is not None:
            self.group.all_reduce(self.router.weight.grad)

    def check_device(self):
        """Waits for the current stream and raises what the GPU found in this
        layer's calls (an exchange over capacity, another rank's failure).
        (On an in-process group every refusal is raised by the call.)"""
        if self._layer is None or self.group._threads is not None:
            return
        stream = torch.cuda.current_stream().cuda_stream
        st = self._layer._lib.smoe_ep_layer_device_status(self._layer.ptr, stream, 1)
        if st != L.SMOE_SUCCESS:
            raise SmoeError(st, L.last_error())
