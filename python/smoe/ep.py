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
together (T may differ per rank, at most max_tokens; with the overlap on
NCCL's kernels a rank whose T is the capacity, max_tokens by default, sends
x itself, with no pack of its rows). The router weight is
replicated: its gradient here is this rank's share, to be summed over the
group like any replicated parameter's (DDP does; or layer.reduce_router_grad()).
The expert weights are this rank's own: do not average them over the group.
CUDA tensors, bfloat16.

Autograd, torch.compile and CUDA graphs: as smoe.moe, a plain eager call
runs the library through an autograd.Function; every other call (under
torch.compile, export, a dispatch mode...) through the custom operators
torch.ops.smoe.ep_forward and ep_backward (and ep_group_sums,
ep_all_reduce for aux_loss_scope='group'), with fake implementations and
an autograd formula, the same bits either way. The operators cannot take
the library's handle: they take the group's id and the layer's options
(config: List[int]), and find the handle in the group (EPGroup._layer),
which keeps one per configuration, device and dtype, made by the first
real call (collective). Nothing in their arguments is particular to one
layer, so layers of one configuration share a compiled graph. The saved
block's size at trace time is a Python bound (_ep_saved_bound; checked
against the library at every call). The four operators are registered as
ordered side effects (PyTorch's effect tokens), so a compiled graph runs
the collectives in program order on every rank. A forward without
gradients (torch.no_grad(), inference_mode(), nothing requiring one) is
the library's inference forward: no saved block.
A compiled EPMoE captured in a CUDA graph replays the eager layer's bits
too. The library's NCCL communicators are freed beside the caller
(ncclCommDestroy waits for every graph that captured an operation on
them, and a graph may outlive its module): a group's layers and then its
communicator in one thread, which the process waits for at exit (20 s at
most).

EPGroup.in_process(P) gives P groups for P threads of one process instead:
the library's in-process transport on its CPU backend (float32, float64 or
bfloat16 CPU tensors), for tests and simulation without GPUs.
"""
import atexit
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from . import _lib as L
from ._lib import SmoeError
from .functional import (_DTYPES, _NEED_B1, _NEED_B2, _NEED_ROUTER, _NEED_W1, _NEED_W2, _NEED_X,
                         _SAVED_HEADER, _SIZE_CACHE_ENTRIES, ACTIVATIONS, GATED, ROUNDINGS,
                         W1_LAYOUTS, SmoeValueError, _align, _aligned, _autocast,
                         _check_expert_bias, _check_experts, _check_shape, _check_tensor,
                         _direct, _dlogits_arg, _enum, _grad_ptr, _ptr, _wants_grad, saved_bytes)
from .module import (Experts, _check_int, _switch_loss, check_layer_sizes,
                     check_logits_dtype, check_routing, keep_expert_bias_float32)

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


def _free_in_order(jobs, keep):
    for free, handle in jobs:
        try:
            free(handle)
        except Exception:
            pass
    with _PENDING_LOCK:
        _PENDING.discard(threading.current_thread())


# The threads freeing NCCL resources (_free_beside): joined at exit, so
# that no NCCL teardown is still running while the process ends (a rank
# then died of SIGSEGV after its work was done, now and then).
_PENDING = set()
_PENDING_LOCK = threading.Lock()
_EXIT_WAIT_S = 20.0


def _join_pending():
    deadline = time.monotonic() + _EXIT_WAIT_S
    with _PENDING_LOCK:
        threads = list(_PENDING)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_pending)


def _free_jobs_beside(jobs, keep=None):
    """Runs free(handle) for each (free, handle) of jobs, in order, in one
    daemon thread, which holds `keep` (what must outlive the frees) until
    they are done. ncclCommDestroy waits until every CUDA graph that
    captured an operation on the communicator is destroyed (NCCL counts
    them), and a graph may well outlive the module whose calls it replays
    (torch's CUDAGraph and torch.compile's caches hold them): a free inline
    would then block the thread that dropped the last reference, or the
    interpreter's exit, for good. In a thread it ends when the last such
    graph goes, or with the process; at exit the process waits up to
    _EXIT_WAIT_S for these threads. One thread runs a group's frees in
    order (its layers in the order they were made, then its communicator),
    as the collective parts of smoe_ep_layer_free need the same order on
    every rank."""
    if not jobs:
        return
    t = threading.Thread(target=_free_in_order, args=(jobs, keep), name="smoe-nccl-free",
                         daemon=True)
    with _PENDING_LOCK:
        _PENDING.add(t)
    t.start()


def _take(obj, attr):
    """obj.attr (a ctypes handle) or None when unset; obj.attr becomes None."""
    handle = getattr(obj, attr, None)
    setattr(obj, attr, None)
    return handle if handle is not None and handle.value else None


def _free_beside(obj, attr, free, keep=None):
    """For __del__ of an object over an NCCL communicator: takes obj.attr
    and frees it in a thread (_free_jobs_beside). At interpreter shutdown
    nothing is freed (the process is ending; no thread can start)."""
    handle = _take(obj, attr)
    if handle is None or sys.is_finalizing():
        return
    _free_jobs_beside([(free, handle)], keep)


class _NcclComm:
    """An ncclComm_t, destroyed with the object (which the group and every
    layer handle made over it hold), beside the caller (_free_beside)."""

    def __init__(self, handle):
        self.handle = handle

    def __del__(self):
        _free_beside(self, "handle", lambda c: _nccl_lib().ncclCommDestroy(c))


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


# The live groups by id: the custom operators take a group's id (an int)
# and find it, and its layer handles, here.
_EP_GROUPS = weakref.WeakValueDictionary()
_EP_GROUP_IDS = itertools.count(1)
# EPGroup.of's: (id of a torch.distributed group, device) -> its EPGroup,
# which holds the group (so the id stays that group's), kept for the process
_EP_OF = {}


class EPGroup:
    """The library's NCCL communicator over a torch.distributed process group
    (default: the world), on this process's current CUDA device. Collective:
    every rank of the group constructs it together. (EPGroup.in_process(P):
    P groups for P threads of this process, on the CPU.)

    The group also keeps the library's layer handles of its smoe.EPMoE
    layers, one per configuration, device and dtype (shared by the layers
    that have the same one, as smoe.moe shares its layers' handles): each
    is created by the first call that needs it, collectively, and freed
    with the group."""

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
        self._comm = _NcclComm(comm)
        self._register()

    def _register(self):
        self._layers = {}
        self._layers_lock = threading.Lock()
        self._id = next(_EP_GROUP_IDS)
        # The id as a string too: torch.compile guards on a string's value,
        # while an int attribute that differs between two compilations of
        # the same code (two groups through one function) turns into a
        # SymInt there, which the operators cannot look a group up by.
        self._id_key = str(self._id)
        _EP_GROUPS[self._id] = self

    def __del__(self):
        # every layer of the group, in the order they were made, then the
        # communicator, in one thread (_free_jobs_beside); an in-process
        # group's layers go with their own objects
        if getattr(self, "_threads", None) is not None or sys.is_finalizing():
            return
        jobs = []
        for layer in list(getattr(self, "_layers", {}).values()):
            h = _take(layer, "ptr")
            if h is not None:
                jobs.append((layer._lib.smoe_ep_layer_free, h))
        comm = getattr(self, "_comm", None)
        h = _take(comm, "handle") if comm is not None else None
        if h is not None:
            jobs.append((lambda c: _nccl_lib().ncclCommDestroy(c), h))
        _free_jobs_beside(jobs)

    @property
    def comm(self):
        """The ncclComm_t (a ctypes c_void_p); None for an in-process group."""
        return self._comm.handle if self._comm is not None else None

    @classmethod
    def of(cls, group=None, device=None):
        """The EPGroup of a torch.distributed group (default: the world) on
        `device` (default: the current CUDA device): made, collectively, by
        the first use in this process, then the same object, kept until the
        process ends. smoe.MoE / smoe.EPMoE / smoe.moe / smoe.hf take a
        torch.distributed group through it, so the layers that name one
        group share one communicator (and its copy engines' windows)
        instead of making one each."""
        import torch.distributed as dist
        g = group if group is not None else dist.group.WORLD
        dev = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        key = (id(g), dev)
        hit = _EP_OF.get(key)
        if hit is None:
            hit = cls(g, dev)
            _EP_OF[key] = hit
        return hit

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
            g.group, g.rank, g.size, g._comm = None, r, nranks, None
            g.device = torch.device("cpu")
            g._register()
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

    def _layer(self, cfg, device, dtype):
        """The layer handle of configuration `cfg` (EPMoE._cfg) for tensors on
        `device` of `dtype`: cached, or created now (collective: every rank
        gets here together, as every rank calls its layers together)."""
        key = (cfg, device.type, device.index, dtype)
        layer = self._layers.get(key)
        if layer is not None:
            return layer
        with self._layers_lock:
            layer = self._layers.get(key)
            if layer is None:
                layer = self._layers[key] = _EPLayer(self._desc(cfg, device, dtype),
                                                     self._threads or self._comm)
            return layer

    def _desc(self, cfg, device, dtype):
        (d, n, E, K, act, layout, has_bias, routing, renorm, n_group, topk_group, scaling,
         max_tokens, capacity, expert_rows, overlap, comm_sms, keep_x, copy_engines) = cfg
        _check_backend(self, device, dtype)
        if self._threads is None:
            backend = L.SMOE_BACKEND_AUTO
            index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            backend, index = L.SMOE_BACKEND_CPU, 0
        ed = L.lib().smoe_ep_desc_default()
        D = ed.layer
        D.d, D.n, D.E, D.K = d, n, E, K
        D.activation, D.w1_layout, D.has_bias = act, layout, int(has_bias)
        D.routing, D.renormalize = routing, int(renorm)
        D.n_group, D.topk_group, D.routed_scaling = n_group, topk_group, scaling
        D.dtype, D.backend, D.device = _DTYPES[dtype], backend, index
        ed.layer = D
        ed.rank, ed.nranks = self.rank, self.size
        if self._threads is None:
            ed.nccl_comm = self.comm
        else:
            ed.group = self._threads.handle
        ed.max_tokens, ed.capacity, ed.expert_rows = max_tokens, capacity, expert_rows
        ed.overlap, ed.comm_sms, ed.keep_x = overlap, comm_sms, int(keep_x)
        ed.copy_engines = int(copy_engines)
        return ed


def _check_backend(group, device, dtype):
    """The tensors' device and dtype against the group's transport (also
    under torch.compile: comparisons only)."""
    if group._threads is None:
        if dtype != torch.bfloat16 or device.type != "cuda":
            raise SmoeError(L.SMOE_ERROR_UNSUPPORTED, "smoe.EPMoE: CUDA bfloat16 tensors "
                            "(got %s %s)" % (device, dtype))
    elif device.type != "cpu" or dtype not in _DTYPES:
        raise SmoeError(L.SMOE_ERROR_UNSUPPORTED, "smoe.EPMoE: an in-process group's "
                        "layer takes CPU float32, float64 or bfloat16 tensors (got %s %s)"
                        % (device, dtype))


class _EPLayer:
    """One smoe_ep_layer handle (freed with the object) and its sizes per T."""

    def __init__(self, desc, transport):
        lib = L.lib()
        ptr = ctypes.c_void_p()
        L.check(lib.smoe_ep_layer_create(ctypes.byref(desc), ctypes.byref(ptr)))
        self._transport = transport   # its communicator (or threads) outlives the handle
        self._lib = lib
        self.ptr = ptr
        self.desc = desc
        self.path_name = lib.smoe_ep_layer_path_name(ptr).decode()
        self._sizes = {}

    def __del__(self):
        # the layer's own communicator (the overlap's) is destroyed with it:
        # beside the caller too, the group's communicator kept until then
        lib = getattr(self, "_lib", None)
        _free_beside(self, "ptr", lambda p: lib.smoe_ep_layer_free(p),
                     keep=getattr(self, "_transport", None))

    def sizes(self, T):
        s = self._sizes.get(T)
        if s is None:
            ws = self._lib.smoe_ep_layer_workspace_bytes(self.ptr, T)
            sv = self._lib.smoe_ep_layer_saved_bytes(self.ptr, T)
            if ws == 0 or sv == 0:
                raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, L.last_error())
            if len(self._sizes) >= _SIZE_CACHE_ENTRIES:
                self._sizes.clear()
            s = self._sizes[T] = (ws, sv)
        return s

    def call(self, fn, args, saved, ws, stream):
        """fn (smoe_ep_layer_forward or _backward) with the saved block (a
        uint8 tensor, or None: an inference forward's NULL) and the
        workspace; on CUDA, first raises what an earlier call of the layer
        met on the device."""
        lib = self._lib
        if stream is not None:
            st = lib.smoe_ep_layer_device_status(self.ptr, stream, 0)
            if st != L.SMOE_SUCCESS:
                raise SmoeError(st, "%s (found on the device in an earlier call of this layer; "
                                "this call was not run)" % L.last_error())
        ptype = fn.argtypes[1]  # POINTER(smoe_forward_args) or (smoe_backward_args)
        sp, sn = (None, 0) if saved is None else (saved.data_ptr(), saved.numel())
        L.check(fn(self.ptr, ctypes.cast(ctypes.pointer(args), ptype), sp, sn, ws.data_ptr(),
                   ws.numel(), stream))


# ------------------------------------------------------------ the calls

def _stream(x):
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None


def _ep_forward_core(layer, x, router_w, w1, w2, b1, b2, expert_bias, saved_nbytes, lowp=0):
    """smoe_ep_layer_forward on real tensors: (out, expert_counts (E,) int32,
    router_logits (T, E) fp32, or x's dtype with lowp, the saved block or
    None). saved_nbytes: None
    for the library's size at this T, 0 for an inference forward (no saved
    block: args.inference = 1), or a size at least the library's (the
    custom operator's, _ep_saved_bound)."""
    va = 16 if x.is_cuda else x.element_size()
    x, router_w, w1, w2, b1, b2 = (_aligned(t, va) for t in (x, router_w, w1, w2, b1, b2))
    if expert_bias is not None:
        expert_bias = _aligned(expert_bias, 4)
    T, E = x.shape[0], layer.desc.layer.E
    ws_n, saved_n = layer.sizes(T)
    if saved_nbytes:
        if saved_nbytes < saved_n:
            raise SmoeError(L.SMOE_ERROR_INTERNAL,
                            "smoe_ep_layer_saved_bytes(T = %d) = %d but smoe.ep._ep_saved_bound()"
                            " = %d: the Python bound of the saved layout is out of date"
                            % (T, saved_n, saved_nbytes))
        saved_n = saved_nbytes
    out = torch.empty_like(x)
    counts = torch.empty(E, dtype=torch.int32, device=x.device)
    logits = torch.empty(T, E, dtype=x.dtype if lowp else torch.float32, device=x.device)
    inference = saved_nbytes == 0
    saved = None if inference else torch.empty(saved_n, dtype=torch.uint8, device=x.device)
    ws = torch.empty(ws_n, dtype=torch.uint8, device=x.device)
    args = L.forward_args_raw(T, x.data_ptr(), router_w.data_ptr(), 0, None, None, None,
                              w1.data_ptr(), _ptr(b1), w2.data_ptr(), _ptr(b2), out.data_ptr(),
                              logits.data_ptr(), counts.data_ptr(), int(inference),
                              _ptr(expert_bias),
                              layer.desc.layer.dtype if lowp else L.SMOE_DTYPE_F32)
    layer.call(layer._lib.smoe_ep_layer_forward, args, saved, ws, _stream(x))
    return out, counts, logits, saved


def _ep_backward_core(layer, dout, dlogits, x, router_w, w1, w2, b2, saved, needs):
    """smoe_ep_layer_backward on real tensors: (dx, drouter_w, dw1, db1,
    dw2, db2), None for a gradient not asked for in `needs` (smoe.moe's
    bits) or not part of the layer. Gradients overwrite."""
    va = 16 if x.is_cuda else x.element_size()
    if dout.dtype != x.dtype:
        dout = dout.to(x.dtype)
    x, router_w, w1, w2, b2, dout = (_aligned(t, va) for t in (x, router_w, w1, w2, b2, dout))
    dlogits, xdt = _dlogits_arg(dlogits, x, layer.desc.layer.dtype)
    saved = _aligned(saved, 16)
    T = x.shape[0]
    has_bias = layer.desc.layer.has_bias

    def empty(shape, need):
        return torch.empty(shape, dtype=x.dtype, device=x.device) if needs & need else None

    dx = empty(x.shape, _NEED_X)
    dwr = empty(router_w.shape, _NEED_ROUTER)
    dw1 = empty(w1.shape, _NEED_W1)
    db1 = empty(w1.shape[:2], _NEED_B1) if has_bias else None
    dw2 = empty(w2.shape, _NEED_W2)
    db2 = empty((w2.shape[0], x.shape[1]), _NEED_B2) if has_bias else None
    ws = torch.empty(layer.sizes(T)[0], dtype=torch.uint8, device=x.device)
    dt = layer.desc.layer.dtype
    args = L.backward_args_raw(T, x.data_ptr(), router_w.data_ptr(), 0, w1.data_ptr(),
                               w2.data_ptr(), _ptr(b2), dout.data_ptr(), _ptr(dlogits),
                               _grad_ptr(dx), dt, 0, _grad_ptr(dwr), dt, 0, _grad_ptr(dw1), dt,
                               0, _grad_ptr(db1), dt, 0, _grad_ptr(dw2), dt, 0, _grad_ptr(db2),
                               dt, 0, None, L.SMOE_DTYPE_F32, 0, xdt)
    layer.call(layer._lib.smoe_ep_layer_backward, args, saved, ws, _stream(x))
    return dx, dwr, dw1, db1, dw2, db2


# ------------------------------------------------------------ custom operators

# The operators' `config`: the group's id and the layer's options, in this
# order (ints; enums as smoe_* codes), then forward's `save` or backward's
# `needs`. With the tensors' shapes and routed_scaling they name the
# layer handle (EPGroup._layer). Nothing in them is particular to one
# smoe.EPMoE: layers with the same options share one compiled graph (a
# model whose blocks are compiled one by one compiles once).
_EP_OPTIONS = ("group", "top_k", "activation", "w1_layout", "routing", "renormalize", "n_group",
               "topk_group", "max_tokens", "capacity", "expert_rows", "overlap", "comm_sms",
               "keep_x", "copy_engines", "logits_lowp")
_N_EP_OPTIONS = len(_EP_OPTIONS)
_EP_LOWP = _N_EP_OPTIONS - 1   # router logits in x's dtype (1) or float32 (0)


def _ep_unpack(config, last, op):
    if len(config) != _N_EP_OPTIONS + 1:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s: config has %d entries, must have %d "
                        "(%s, %s)" % (op, len(config), _N_EP_OPTIONS + 1,
                                      ", ".join(_EP_OPTIONS), last))
    return config


def _ep_group(group_id, op):
    g = _EP_GROUPS.get(group_id)
    if g is None:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s: no live smoe.EPGroup has id %d (the "
                        "group was freed)" % (op, group_id))
    return g


def _ep_cfg(config, routed_scaling, x, router_w, w2, has_bias):
    """The layer configuration (EPGroup._layer's key, as EPMoE._cfg) from an
    operator's config, routed_scaling and tensors."""
    (_, K, act, layout, routing, renorm, n_group, topk_group, max_tokens, capacity, expert_rows,
     overlap, comm_sms, keep_x, copy_engines, _) = config[:_N_EP_OPTIONS]
    # (d from x, n from w2, E from the router: w1 has this rank's E/P.)
    return (int(x.shape[1]), int(w2.shape[2]), int(router_w.shape[0]), int(K), int(act),
            int(layout), bool(has_bias), int(routing), bool(renorm), int(n_group),
            int(topk_group), float(routed_scaling), int(max_tokens), int(capacity),
            int(expert_rows), int(overlap), int(comm_sms), bool(keep_x), int(copy_engines))


def _ep_saved_bound(T, P, E, K, d, n, activation, routing, dtype, max_tokens, capacity,
                    expert_rows, keep_x=False, copy_engines=-1):
    """A saved-block size, in bytes, at least smoe_ep_layer_saved_bytes(T) of
    such a layer (E the whole layer's experts, P ranks, dtype a torch
    dtype), computed in Python: also for a symbolic T under torch.compile,
    and before the handle exists (creating it is collective: the first
    real call does). It is the sum of every section of both backends'
    layouts (src/ep_calls.c's saved_make and src/cuda/ep_cuda.cu's gsaved_make),
    each at its larger size, the experts' part being
    smoe.functional.saved_bytes() of their GENERAL layer; the operator
    checks the library's size against it at every call; keep_x adds the
    received rows of x (one per received-row slot, d). With copy_engines
    (smoe_ep_desc's code: 1, or 0 at P >= 4, where the library may take
    them)
    the received rows have P (C + 1) + C slots at most (two parts of
    ceil(C / 2) per peer, this rank's own after them) and up to 4
    chunks."""
    El = E // P
    C = capacity or max_tokens
    ce = P > 1 and (copy_engines == 1 or (copy_engines == 0 and P >= 4))
    slots = P * (C + 1) + C if ce else P * C
    chunks = max(P + 1, 4) if ce else P + 1
    worst = P * C * min(K, El)
    rows = expert_rows if expert_rows and expert_rows < worst else worst
    code = _DTYPES[dtype]
    fs = 8 if code == L.SMOE_DTYPE_F64 else 4
    A = T * K
    logits = T * E * fs if routing in (L.SMOE_ROUTING_SOFTMAX_TOPK,
                                       L.SMOE_ROUTING_SIGMOID_TOPK) else 0
    sections = (_SAVED_HEADER,            # header
                (T + 1) * 4,              # token_offset
                A * 2, A * 4, A * fs,     # assign_expert (uint16), assign_row, scores
                logits,                   # logits (SOFTMAX_TOPK, SIGMOID_TOPK)
                T * P * 4,                # slot (CPU); pidx (CUDA: T min(K, P))
                2 * P * 8 + 8,            # counts (CPU)
                (T + 1) * 4,              # ent_off (CUDA)
                rows * 4,                 # tri_slot
                (El * chunks + 1) * 4)    # off2 (CUDA: El nc + 1)
    total = 0
    for size in sections:
        total = total + _align(size)
    experts = saved_bytes(slots, rows, d=d, n=n, E=El, K=0, activation=activation,
                          routing=L.SMOE_ROUTING_GENERAL, rounding=L.SMOE_ROUND_OFF,
                          round_tile=128, dtype=code)
    xkeep = slots * d * torch.empty(0, dtype=dtype).element_size() if keep_x else 0
    return total + _align(experts) + _align(xkeep)


def _ep_op_saved_bound(T, config, x, router_w, w2, op):
    g = _ep_group(config[0], op)
    (_, K, act, _, routing, _, _, _, max_tokens, capacity, expert_rows, _, _, keep_x,
     copy_engines, _) = config[:_N_EP_OPTIONS]
    return _ep_saved_bound(T, g.size, router_w.shape[0], K, x.shape[1], w2.shape[2], act,
                           routing, x.dtype, max_tokens, capacity, expert_rows, keep_x,
                           copy_engines if x.is_cuda else -1)


@torch.library.custom_op("smoe::ep_forward", mutates_args=())
def _ep_forward(x: Tensor, router_w: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                b2: Optional[Tensor], expert_bias: Optional[Tensor], config: List[int],
                routed_scaling: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """smoe.EPMoE's forward on this rank's tokens x (T, d): (out (T, d),
    expert_counts (E,) int32, router_logits (T, E) fp32, saved uint8 block,
    (0,) when save is 0: the library's inference forward, nothing kept).
    config: _EP_OPTIONS then save. Collective, as the layer's calls are."""
    op = "smoe::ep_forward"
    config = _ep_unpack(config, "save", op)
    g = _ep_group(config[0], op)
    cfg = _ep_cfg(config, routed_scaling, x, router_w, w2, b1 is not None)
    layer = g._layer(cfg, x.device, x.dtype)
    nbytes = _ep_op_saved_bound(x.shape[0], config, x, router_w, w2, op) if config[-1] else 0
    out, counts, logits, saved = _ep_forward_core(layer, x, router_w, w1, w2, b1, b2,
                                                  expert_bias, nbytes, config[_EP_LOWP])
    if saved is None:
        saved = torch.empty(0, dtype=torch.uint8, device=x.device)
    return out, counts, logits, saved


@_ep_forward.register_fake
def _ep_forward_fake(x, router_w, w1, w2, b1, b2, expert_bias, config, routed_scaling):
    op = "smoe::ep_forward"
    config = _ep_unpack(config, "save", op)
    T, E = x.shape[0], router_w.shape[0]
    nbytes = _ep_op_saved_bound(T, config, x, router_w, w2, op) if config[-1] else 0
    return (x.new_empty(x.shape), x.new_empty((E,), dtype=torch.int32),
            x.new_empty((T, E), dtype=x.dtype if config[_EP_LOWP] else torch.float32),
            x.new_empty((nbytes,), dtype=torch.uint8))


@torch.library.custom_op("smoe::ep_backward", mutates_args=())
def _ep_backward(dout: Tensor, dlogits: Optional[Tensor], x: Tensor, router_w: Tensor,
                 w1: Tensor, w2: Tensor, b2: Optional[Tensor], saved: Tensor, config: List[int],
                 routed_scaling: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, drouter_w, dw1, db1, dw2, db2) of the ep_forward that filled
    `saved` (config: _EP_OPTIONS, the forward's, then needs: smoe.moe's
    bits); a gradient not asked for or not part of the layer is an empty
    tensor. Collective."""
    op = "smoe::ep_backward"
    config = _ep_unpack(config, "needs", op)
    if saved.numel() == 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s: backward through a forward that kept "
                        "nothing for it (it ran without gradients)" % op)
    g = _ep_group(config[0], op)
    cfg = _ep_cfg(config, routed_scaling, x, router_w, w2, b2 is not None)
    layer = g._layer(cfg, x.device, x.dtype)
    grads = _ep_backward_core(layer, dout, dlogits, x, router_w, w1, w2, b2, saved, config[-1])
    return tuple(t if t is not None else x.new_empty((0,)) for t in grads)


@_ep_backward.register_fake
def _ep_backward_fake(dout, dlogits, x, router_w, w1, w2, b2, saved, config, routed_scaling):
    needs = _ep_unpack(config, "needs", "smoe::ep_backward")[-1]
    has_bias = b2 is not None

    def buf(need, shape):
        return x.new_empty(shape if need else (0,))

    return (buf(needs & _NEED_X, x.shape), buf(needs & _NEED_ROUTER, router_w.shape),
            buf(needs & _NEED_W1, w1.shape), buf(has_bias and needs & _NEED_B1, w1.shape[:2]),
            buf(needs & _NEED_W2, w2.shape),
            buf(has_bias and needs & _NEED_B2, (w2.shape[0], x.shape[1])))


# ep_forward's differentiable inputs (x, router_w, w1, w2, b1, b2) with their
# `needs` bits, and where ep_backward returns each one's gradient.
_EP_NEEDS = (_NEED_X, _NEED_ROUTER, _NEED_W1, _NEED_W2, _NEED_B1, _NEED_B2)
_EP_GRAD_AT = (0, 1, 2, 4, 3, 5)


def _ep_save_context(ctx, x, router_w, w1, w2, b2, saved, options, routed_scaling, layer):
    ctx.save_for_backward(x, router_w, w1, w2, b2, saved)
    ctx.options = options          # the forward config's _EP_OPTIONS
    ctx.routed_scaling = routed_scaling
    ctx.layer = layer              # None: backward through the operator


def _ep_setup_context(ctx, inputs, output):
    x, router_w, w1, w2, b1, b2, _, config, routed_scaling = inputs
    _ep_save_context(ctx, x, router_w, w1, w2, b2, output[3], list(config[:_N_EP_OPTIONS]),
                     routed_scaling, None)


def _ep_input_grads(ctx, dout, dlogits):
    """The gradients of ep_forward's six differentiable inputs."""
    x, router_w, w1, w2, b2, saved = ctx.saved_tensors
    needs = 0
    for need, bit in zip(ctx.needs_input_grad, _EP_NEEDS):
        if need:
            needs |= bit
    if needs == 0 or (dout is None and dlogits is None):
        return [None] * 6
    if dout is None:
        dout = torch.zeros_like(x)
    layer = ctx.layer
    if (layer is not None and not torch.is_grad_enabled()
            and _direct(x.device, dout, dlogits, x, router_w, w1, w2, b2, saved)):
        out = _ep_backward_core(layer, dout, dlogits, x, router_w, w1, w2, b2, saved, needs)
    else:
        out = torch.ops.smoe.ep_backward(dout, dlogits, x, router_w, w1, w2, b2, saved,
                                         ctx.options + [needs], ctx.routed_scaling)
    return [out[i] if needs & bit else None for i, bit in zip(_EP_GRAD_AT, _EP_NEEDS)]


def _ep_backward_formula(ctx, dout, dcounts, dlogits, dsaved):
    # none for expert_bias, config, routed_scaling
    return tuple(_ep_input_grads(ctx, dout, dlogits)) + (None, None, None)


_ep_forward.register_autograd(_ep_backward_formula, setup_context=_ep_setup_context)


class _EPFunction(torch.autograd.Function):
    """ep_forward's autograd formula for plain eager calls (functional's
    _direct), without the dispatcher: the same implementation and saved
    tensors, the backward called directly when it can be."""

    @staticmethod
    def forward(ctx, x, router_w, w1, w2, b1, b2, expert_bias, layer, options, routed_scaling):
        out, counts, logits, saved = _ep_forward_core(layer, x, router_w, w1, w2, b1, b2,
                                                      expert_bias, None, options[_EP_LOWP])
        ctx.set_materialize_grads(False)   # an unused output's gradient stays None
        ctx.mark_non_differentiable(counts)
        _ep_save_context(ctx, x, router_w, w1, w2, b2, saved, options, routed_scaling, layer)
        return out, counts, logits

    @staticmethod
    def backward(ctx, dout, dcounts, dlogits):
        # none for expert_bias, layer, options, routed_scaling
        return tuple(_ep_input_grads(ctx, dout, dlogits)) + (None, None, None, None)


@torch.library.custom_op("smoe::ep_group_sums", mutates_args=())
def _ep_group_sums(prob_sums: Tensor, counts: Tensor, group_id: int) -> Tuple[Tensor, Tensor]:
    """The Switch loss's per-expert probability sums (E,) fp32 and counts
    (E,) summed over the EPGroup `group_id`: the counts first, then the
    sums, one collective each (EPGroup.all_reduce). The sums are
    differentiable: their gradient is summed over the group the same way
    (smoe::ep_all_reduce)."""
    group = _ep_group(group_id, "smoe::ep_group_sums")
    counts = group.all_reduce(counts.clone(memory_format=torch.contiguous_format))
    return group.all_reduce(prob_sums.clone(memory_format=torch.contiguous_format)), counts


@_ep_group_sums.register_fake
def _ep_group_sums_fake(prob_sums, counts, group_id):
    return (torch.empty_like(prob_sums, memory_format=torch.contiguous_format),
            torch.empty_like(counts, memory_format=torch.contiguous_format))


@torch.library.custom_op("smoe::ep_all_reduce", mutates_args=())
def _ep_all_reduce(t: Tensor, group_id: int) -> Tensor:
    """t summed over the EPGroup `group_id` (a new tensor). Collective."""
    group = _ep_group(group_id, "smoe::ep_all_reduce")
    return group.all_reduce(t.clone(memory_format=torch.contiguous_format))


@_ep_all_reduce.register_fake
def _ep_all_reduce_fake(t, group_id):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _ep_sum_setup(ctx, inputs, output):
    ctx.group_id = inputs[-1]


def _ep_group_sums_backward(ctx, dsums, dcounts):
    # The group's objective is the sum of every rank's loss (as
    # torch.distributed.nn.functional.all_reduce's): each rank's sums get
    # the gradient summed over the ranks.
    if dsums is None:
        return None, None, None
    return torch.ops.smoe.ep_all_reduce(dsums, ctx.group_id), None, None


def _ep_all_reduce_backward(ctx, grad):
    return torch.ops.smoe.ep_all_reduce(grad, ctx.group_id), None


_ep_group_sums.register_autograd(_ep_group_sums_backward, setup_context=_ep_sum_setup)
_ep_all_reduce.register_autograd(_ep_all_reduce_backward, setup_context=_ep_sum_setup)


def _register_ordered():
    """Registers the four collective operators as ordered side effects
    (PyTorch's effect tokens, as for aten::_print): AOTAutograd threads a
    token through them, forward and backward, so a compiled graph runs them
    in program order. Without it inductor may order two independent ones
    (one layer's ep_group_sums and the next layer's ep_forward) differently
    on ranks whose graphs differ (other token counts), and the ranks would
    wait in different collectives. Returns False where this PyTorch has no
    such registry (EPMoE then refuses torch.compile)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    for name in ("ep_forward", "ep_backward", "ep_group_sums", "ep_all_reduce"):
        _register_effectful_op(getattr(torch.ops.smoe, name).default, _EffectType.ORDERED)
    return True


_ORDERED = _register_ordered()


def check_ep_options(max_tokens, capacity, expert_rows, overlap, comm_sms, who, keep_x=False,
                     copy_engines=None):
    """The exchange's options as smoe.EPMoE takes them (smoe_ep_desc's):
    max_tokens, capacity, expert_rows ints >= 0, overlap -1, 0, 1 or 2,
    comm_sms an int >= -1, keep_x a bool, copy_engines None (the library
    decides) or a bool; a SmoeValueError naming the one that is not."""
    for name, v in (("max_tokens", max_tokens), ("capacity", capacity),
                    ("expert_rows", expert_rows)):
        _check_int(v, who + ": " + name, 0)
    if overlap not in (-1, 0, 1, 2):
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "%s: overlap = %r, must be -1, 0, 1 or 2" % (who, overlap))
    _check_int(comm_sms, who + ": comm_sms", -1)
    if keep_x not in (False, True):  # (0 and 1 compare equal to them)
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "%s: keep_x = %r, must be a bool"
                             % (who, keep_x))
    if copy_engines is not None and copy_engines not in (False, True):
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "%s: copy_engines = %r, must be None "
                             "(automatic) or a bool" % (who, copy_engines))


def _ce_code(copy_engines):
    """smoe_ep_desc.copy_engines of the option: None 0 (the library
    decides), True 1, False -1."""
    return 0 if copy_engines is None else 1 if copy_engines else -1


def _ep_layer_config(group, d, n, E, K, activation, w1_layout, has_bias, routing, renormalize,
                     n_group, topk_group, routed_scaling, max_tokens, capacity, expert_rows,
                     overlap, comm_sms, keep_x=False, copy_engines=None, lowp=False):
    """(options, cfg) of a layer on `group` (enums as smoe_* codes): the
    operators' config (_EP_OPTIONS, without save or needs) and the key of
    the group's handle (EPGroup._layer). lowp: the router logits returned
    in x's dtype (a forward argument, not part of the handle's key)."""
    options = [int(group._id_key), K, activation, w1_layout, routing, int(renormalize), n_group,
               topk_group, max_tokens, capacity, expert_rows, overlap, comm_sms, int(keep_x),
               _ce_code(copy_engines), int(bool(lowp))]
    cfg = (d, n, E, K, activation, w1_layout, bool(has_bias), routing, bool(renormalize),
           n_group, topk_group, float(routed_scaling), max_tokens, capacity, expert_rows,
           overlap, comm_sms, bool(keep_x), _ce_code(copy_engines))
    return options, cfg


def _ep_run(group, options, cfg, routed_scaling, x, router_w, w1, w2, b1, b2, expert_bias):
    """The layer on checked tensors, x (T, d) this rank's tokens: (out (T,
    d), expert_counts (E,), router_logits (T, E)), through the eager path
    when functional._direct allows, else the operators (smoe.EPMoE's
    forward and smoe.hf's expert-parallel blocks)."""
    w = (router_w, w1, w2, b1, b2)
    # Without a gradient to compute (torch.no_grad(), inference_mode(),
    # nothing requiring one) the forward keeps nothing for backward: the
    # library's inference forward, with no saved block.
    save = _wants_grad(x, *w)
    if _direct(x.device, x, *w, expert_bias):
        layer = group._layer(cfg, x.device, x.dtype)
        if save:
            return _EPFunction.apply(x, *w, expert_bias, layer, options, routed_scaling)
        return _ep_forward_core(layer, x, *w, expert_bias, 0)[:3]
    if not _ORDERED and torch.compiler.is_compiling():
        raise SmoeError(L.SMOE_ERROR_UNSUPPORTED, "smoe.EPMoE under torch.compile needs "
                        "PyTorch's effect tokens (torch._higher_order_ops.effects), which keep "
                        "the collective operators in order on every rank; this PyTorch has none")
    return torch.ops.smoe.ep_forward(x, *w, expert_bias, options + [int(save)],
                                     routed_scaling)[:3]


def _ep_moe(group, x, router_w, w1, w2, *, top_k, routing, renormalize, activation, w1_layout,
            expert_bias, n_group, topk_group, routed_scaling, max_tokens, capacity, expert_rows,
            overlap, comm_sms, who, keep_x=False, copy_engines=None, b1=None, b2=None,
            router_logits_dtype=None):
    """The layer on x (..., d), this rank's tokens, with router_w (E, d) and
    this rank's experts w1, w2 (and biases b1, b2, both or neither; enums
    as smoe_* codes; the routing options checked by the caller): (out (...,
    d), expert_counts (E,), router_logits (T, E) in router_logits_dtype:
    None or torch.float32, or x's dtype). smoe.hf's expert-parallel
    blocks call it with their Hugging Face parameters, smoe.moe with
    ep_group through _moe_ep; `who` names the caller in errors."""
    x2 = x.reshape(-1, x.shape[-1])
    _check_backend(group, x2.device, x2.dtype)
    for name, t in (("the router weight", router_w), ("w1", w1), ("w2", w2), ("b1", b1),
                    ("b2", b2)):
        if t is not None and (t.device != x.device or t.dtype != x.dtype):
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "%s: x is %s %s but %s is %s %s"
                                 % (who, x.device, x.dtype, name, t.device, t.dtype))
    if x2.shape[0] > max_tokens:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "%s: %d tokens, more than max_tokens = %d"
                        % (who, x2.shape[0], max_tokens))
    if router_logits_dtype not in (None, torch.float32, x.dtype):
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "%s: router_logits_dtype = %s: None, torch.float32 or x's dtype "
                             "(%s)" % (who, router_logits_dtype, x.dtype))
    lowp = router_logits_dtype not in (None, torch.float32)
    options, cfg = _ep_layer_config(group, x2.shape[1], w2.shape[2], router_w.shape[0], top_k,
                                    activation, w1_layout, b1 is not None, routing, renormalize,
                                    n_group, topk_group, routed_scaling, max_tokens, capacity,
                                    expert_rows, overlap, comm_sms, keep_x, copy_engines, lowp)
    out, counts, logits = _ep_run(group, options, cfg, routed_scaling, x2, router_w, w1, w2,
                                  b1, b2, expert_bias)
    return out.reshape(x.shape), counts, logits


def _as_group(ep_group, who):
    """An EPGroup as given, or a torch.distributed group's (EPGroup.of);
    TypeError for anything else."""
    if isinstance(ep_group, EPGroup):
        return ep_group
    import torch.distributed as dist
    if dist.is_available() and isinstance(ep_group, dist.ProcessGroup):
        return EPGroup.of(ep_group)
    raise TypeError("%s: ep_group must be an smoe.EPGroup or a torch.distributed process "
                    "group, got %s" % (who, type(ep_group).__name__))


def _refuse_under_ep(who, token_rounding, consume_saved):
    """What the expert-parallel layer does not take (smoe_ep_desc refuses
    them too): a SmoeValueError saying why."""
    if _enum(ROUNDINGS, token_rounding, who + ": token_rounding") != L.SMOE_ROUND_OFF:
        raise SmoeValueError(L.SMOE_ERROR_UNSUPPORTED,
                             "%s: token_rounding = %r with ep_group: token rounding ranks the "
                             "tokens of every rank per expert, a count over the group the "
                             "expert-parallel layer does not make; not supported"
                             % (who, token_rounding))
    if consume_saved is not False:
        raise SmoeValueError(L.SMOE_ERROR_UNSUPPORTED,
                             "%s: consume_saved = %r with ep_group: the expert-parallel "
                             "backward reads what its forward saved and writes over none of "
                             "it; not supported" % (who, consume_saved))


def _moe_ep(group, x, router_w, w1, w2, b1, b2, *, top_k, routing, renormalize, activation,
            w1_layout, token_rounding, inference, expert_bias, n_group, topk_group,
            routed_scaling, consume_saved, max_tokens, capacity, expert_rows, overlap,
            comm_sms, keep_x, copy_engines, router_logits_dtype=None):
    """smoe.moe with ep_group (its docstring says what): the checks, then
    _ep_moe."""
    who = "smoe.moe (ep_group)"
    group = _as_group(group, who)
    _refuse_under_ep(who, token_rounding, consume_saved)
    if max_tokens is None:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "%s: max_tokens is required: the largest token count any rank of "
                             "the group passes, the same on every rank (it sizes the "
                             "exchange)" % who)
    check_ep_options(max_tokens, capacity, expert_rows, overlap, comm_sms, who, keep_x,
                     copy_engines)
    act = _enum(ACTIVATIONS, activation, who + ": activation")
    layout = _enum(W1_LAYOUTS, w1_layout, who + ": w1_layout")
    x, router_w, w1, w2, b1, b2 = _autocast(x.device, x, router_w, w1, w2, b1, b2)
    if x.dim() < 1:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "%s: x must have a hidden dimension" % who)
    d, n, El, b1, b2 = _check_experts(x, w1, w2, b1, b2, act)
    P = group.size
    E = El * P
    _check_tensor(router_w, "router_w", 2, x.device, x.dtype)
    _check_shape(router_w, "router_w", (E, d),
                 "E = %d: w1 and w2 hold this rank's %d experts of %d ranks; d = %d", E, El, P,
                 d)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE,
                        "%s: top_k = %r, must be an int in [1, E = %d]" % (who, top_k, E))
    routing_c, n_group, topk_group, routed_scaling = check_routing(
        routing, n_group, topk_group, routed_scaling, E, top_k, who,
        "smoe.moe_general has no expert-parallel form")
    expert_bias = _check_expert_bias(expert_bias, routing_c, x, E)
    kw = dict(top_k=int(top_k), routing=routing_c, renormalize=bool(renormalize),
              activation=act, w1_layout=layout, expert_bias=expert_bias, n_group=n_group,
              topk_group=topk_group, routed_scaling=routed_scaling,
              max_tokens=int(max_tokens), capacity=int(capacity),
              expert_rows=int(expert_rows), overlap=int(overlap), comm_sms=int(comm_sms),
              who=who, keep_x=bool(keep_x), copy_engines=copy_engines, b1=b1, b2=b2,
              router_logits_dtype=router_logits_dtype)
    if inference:
        with torch.no_grad():
            out, counts, logits = _ep_moe(group, x, router_w, w1, w2, **kw)
    else:
        out, counts, logits = _ep_moe(group, x, router_w, w1, w2, **kw)
    return out, counts, logits.reshape(*x.shape[:-1], E)


# smoe.MoE's keywords that smoe.EPMoE takes as they are
_MOE_EP_SHARED = ("routing", "renormalize", "w1_layout", "output_router_logits", "n_group",
                  "topk_group", "routed_scaling", "router_logits_dtype")
# smoe.EPMoE's keywords that smoe.MoE takes only with ep_group
EP_ONLY = ("max_tokens", "capacity", "expert_rows", "overlap", "comm_sms", "aux_loss_scope",
           "keep_x", "copy_engines")


def _epmoe_from_moe(args, ep_group, kwargs):
    """smoe.MoE(..., ep_group=g, ...): the EPMoE of those arguments, with
    what only smoe.MoE takes refused under expert parallelism."""
    who = "smoe.MoE (ep_group)"
    kw = dict(kwargs)
    _refuse_under_ep(who, kw.pop("token_rounding", None), kw.pop("consume_saved", False))
    kw.pop("round_tile", None)  # (token rounding's, which is refused)
    act = kw.pop("activation", None)
    if act is not None:  # smoe.MoE's alias of activation_function
        if len(args) > 4 or "activation_function" in kw:
            raise TypeError("%s: activation and activation_function both given" % who)
        kw["activation_function"] = act
    unknown = sorted(k for k in kw if k not in _MOE_EP_SHARED + EP_ONLY +
                     ("activation_function", "add_bias", "std"))
    if unknown:
        raise TypeError("%s: unexpected keyword argument(s) %s" % (who, ", ".join(unknown)))
    return EPMoE(*args, ep_group=ep_group, **kw)


_AUX_LOSS_SCOPES = ("local", "group")


class EPMoE(nn.Module):
    """smoe.MoE's layer, expert-parallel over `ep_group` (an EPGroup, or a
    torch.distributed group: EPGroup.of(group), the one EPGroup of that
    group in this process, so layers naming one group share its
    communicator; None: the world's). Parameters on this rank:
    router (E, d) replicated; c_fc (E/P, 2n|n, d) and c_proj (E/P, d, n)
    this rank's experts, [rank E/P, (rank+1) E/P) of the whole layer.

    max_tokens: the largest token count any rank's call passes (sizes the
    exchange buffers); capacity (rows one rank sends another per call, 0 =
    max_tokens) and expert_rows ((row, expert) pairs one rank computes, 0 =
    the worst case) as in smoe_ep_desc: a call beyond them fails on every
    rank, raised by the layer's next call or smoe.EPMoE.check_device().
    overlap (0 = the library decides, 1 = on, -1 = off, 2 = the backward
    only) and comm_sms (SMs left to NCCL beside the GEMMs, 0 = 4 per rank
    within [8, 32], 8 with copy_engines) as in smoe_ep_desc.
    keep_x=True keeps the rows of x this rank received for the backward,
    which then sends only the output gradient (one exchange of the three
    fewer) for P * capacity * d elements more in the saved activation per
    rank (smoe_ep_desc.keep_x; off: x travels again, the memory floor).
    copy_engines=True moves the rows by the GPU's copy engines (NCCL >=
    2.28's all-to-all from a window the group's copy-engine layers share,
    (6 P + 3) * capacity * d elements; Hopper GEMMs, P > 1, GPUs in one
    NVLink domain; faster at P = 4, slower at P = 2 on most shapes:
    bench/RESULTS.md; smoe_ep_desc.copy_engines); False keeps NCCL's
    kernels; None (the default) lets the library take them from P = 4
    where they can run (the path name says which). The CPU group refuses
    True.

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
    router_logits (T, E) float32, or x's dtype with
    router_logits_dtype='input', T this rank's tokens), as smoe.MoE returns
    them: differentiable, for smoe.router_z_loss or Hugging Face's
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

    Autograd, torch.compile (fullgraph=True, static or dynamic token
    counts; each rank compiles its own model) and CUDA graphs (of the
    eager or the compiled layer), as smoe.MoE; every option, aux_loss_scope='group' included (its
    all-reduces are operators too). Under torch.no_grad() or
    torch.inference_mode() (or with nothing requiring a gradient) the
    forward keeps nothing for backward (the library's inference forward,
    args.inference = 1: no saved block). The layer's C handle belongs to
    the group (one per configuration, device and dtype, shared by its
    layers of that configuration), made by the first call on that device
    and dtype, collectively.
    """

    def __init__(self, num_experts, num_experts_per_tok, hidden_size, intermediate_size,
                 activation_function="swiglu", add_bias=False, std=0.02, *, ep_group=None,
                 max_tokens, capacity=0, expert_rows=0, routing="topk_softmax",
                 renormalize=True, w1_layout="interleaved", overlap=0, comm_sms=0, n_group=0,
                 topk_group=0, routed_scaling=1.0, output_router_logits=False,
                 aux_loss_scope="local", keep_x=False, copy_engines=None,
                 router_logits_dtype=None):
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
        check_ep_options(max_tokens, capacity, expert_rows, overlap, comm_sms, who, keep_x,
                         copy_engines)
        self.router_logits_dtype = check_logits_dtype(router_logits_dtype, who)
        if aux_loss_scope not in _AUX_LOSS_SCOPES:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.EPMoE: aux_loss_scope = %r, "
                                 "must be 'local' (this rank's tokens) or 'group' (the group's)"
                                 % (aux_loss_scope,))
        self.group = EPGroup.of() if ep_group is None else _as_group(ep_group, who)
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
        self.overlap, self.comm_sms, self.keep_x = int(overlap), int(comm_sms), bool(keep_x)
        self.copy_engines = None if copy_engines is None else bool(copy_engines)
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
        # The operators' config (_EP_OPTIONS) and the group's layer handle's
        # key (EPGroup._layer): this layer's options, nothing of its own.
        self._options, self._cfg = _ep_layer_config(
            self.group, d, n, E, K, self.activation, self.w1_layout, add_bias, self.routing,
            self.renormalize, self.n_group, self.topk_group, self.routed_scaling,
            self.max_tokens, self.capacity, self.expert_rows, self.overlap, self.comm_sms,
            self.keep_x, self.copy_engines)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        keep_expert_bias_float32(self)
        return out

    def _handle(self):
        """The group's layer handle for this layer on its parameters' device
        and dtype, if a call has created it (else None)."""
        w = self.c_fc.weight
        return self.group._layers.get((self._cfg, w.device.type, w.device.index, w.dtype))

    @property
    def path_name(self):
        """The kernel path of this rank's experts (smoe_ep_layer_path_name),
        once a call has created the layer's handle; None before."""
        layer = self._handle()
        return layer.path_name if layer is not None else None

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
        _check_backend(self.group, x.device, x.dtype)
        if x.shape[0] > self.max_tokens:
            raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "smoe.EPMoE: %d tokens, more than "
                            "max_tokens = %d" % (x.shape[0], self.max_tokens))
        bias = self.expert_bias
        if bias is not None:
            bias = bias.detach()
        options = self._options
        if self.router_logits_dtype == "input" and x.dtype != torch.float32:
            options = options[:_EP_LOWP] + [1]   # (logits in x's dtype)
        out, counts, logits = _ep_run(self.group, options, self._cfg, self.routed_scaling,
                                      x, self.router.weight, self.c_fc.weight,
                                      self.c_proj.weight, self.c_fc.bias, self.c_proj.bias, bias)
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
        counts, summed over the group (smoe::ep_group_sums)."""
        return torch.ops.smoe.ep_group_sums(prob_sums, counts, int(self.group._id_key))

    def reduce_router_grad(self):
        """Sums the router weight's gradient over the group (the rank's
        share of a replicated parameter's gradient; not needed under DDP,
        which does it)."""
        if self.router.weight.grad is not None:
            self.group.all_reduce(self.router.weight.grad)

    def check_device(self):
        """Waits for the current stream and raises what the GPU found in this
        layer's calls (an exchange over capacity, another rank's failure;
        the handle is shared by the group's layers of the same
        configuration, so theirs too). (On an in-process group every
        refusal is raised by the call.)"""
        layer = self._handle()
        if layer is None or self.group._threads is not None:
            return
        stream = torch.cuda.current_stream().cuda_stream
        st = layer._lib.smoe_ep_layer_device_status(layer.ptr, stream, 1)
        if st != L.SMOE_SUCCESS:
            raise SmoeError(st, L.last_error())
