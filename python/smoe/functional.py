"""smoe.moe(): the MoE layer as a differentiable PyTorch function.

The work is done by two custom operators, torch.ops.smoe.moe_forward and
torch.ops.smoe.moe_backward (torch.library.custom_op), with fake (meta)
implementations and an autograd formula, so the layer runs eagerly, under
torch.compile (the operators are opaque to the compiler) and inside CUDA
graphs (no host synchronisation, all memory from PyTorch's allocator).

Between forward and backward autograd keeps only the C library's saved block
(one uint8 tensor of smoe_layer_saved_bytes(): a 256-byte header saying
which layer and forward filled it, H, the routing metadata and, for
SOFTMAX_TOPK, SIGMOID_TOPK or token rounding, the router logits) plus
references to the inputs, which the caller holds anyway.

CPU tensors run on the CPU backend (float32, bfloat16, float64); CUDA
tensors on the GPU backends (bfloat16), on the current CUDA stream.

Host cost. A plain eager call (plain tensors on CPU or CUDA, not under
torch.compile or export, no TorchDispatchMode or TorchFunctionMode active,
no torch.func transform, no torch.jit trace) skips PyTorch's dispatcher: it
runs the same implementation as the operators, through an
autograd.Function when a gradient is wanted and directly otherwise. Every
other call goes through the operators. Per configuration and device the
layer handle is cached, and per token count its workspace and saved-block
sizes; the ctypes argument structs are filled in one constructor call.
"""
import ctypes
import math
import numbers
import os
import threading
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _lib as L
from ._lib import SmoeError

__all__ = ["moe", "moe_general", "ROUTINGS", "ACTIVATIONS", "W1_LAYOUTS", "ROUNDINGS",
           "saved_bytes", "layer_info", "set_debug", "check_device"]

# ------------------------------------------------------------ names -> enums

ROUTINGS = {
    "topk_softmax": L.SMOE_ROUTING_TOPK_SOFTMAX,
    "softmax_topk": L.SMOE_ROUTING_SOFTMAX_TOPK,
    "general": L.SMOE_ROUTING_GENERAL,
    "sigmoid_topk": L.SMOE_ROUTING_SIGMOID_TOPK,
}
ACTIVATIONS = {
    "swiglu": L.SMOE_ACT_SWIGLU,
    "geglu": L.SMOE_ACT_GEGLU,
    "reglu": L.SMOE_ACT_REGLU,
    "relu2": L.SMOE_ACT_RELU2,
    "relu_sq": L.SMOE_ACT_RELU2,   # SonicMoE's name
    "squared_relu": L.SMOE_ACT_RELU2,
    "relu": L.SMOE_ACT_RELU,
    "silu": L.SMOE_ACT_SILU,
    "gelu": L.SMOE_ACT_GELU,       # tanh approximation
}
# Each routing code's name in ROUTINGS.
_ROUTING_NAMES = {v: k for k, v in ROUTINGS.items()}
GATED = (L.SMOE_ACT_SWIGLU, L.SMOE_ACT_GEGLU, L.SMOE_ACT_REGLU)
W1_LAYOUTS = {
    "interleaved": L.SMOE_W1_INTERLEAVED,
    "concatenated": L.SMOE_W1_CONCATENATED,
}
ROUNDINGS = {
    None: L.SMOE_ROUND_OFF,
    "off": L.SMOE_ROUND_OFF,
    "up": L.SMOE_ROUND_UP,
    "down": L.SMOE_ROUND_DOWN,
    "nearest": L.SMOE_ROUND_NEAREST,
}
_DTYPES = {
    torch.float32: L.SMOE_DTYPE_F32,
    torch.bfloat16: L.SMOE_DTYPE_BF16,
    torch.float64: L.SMOE_DTYPE_F64,
}
_DTYPE_SIZE = {L.SMOE_DTYPE_F32: 4, L.SMOE_DTYPE_BF16: 2, L.SMOE_DTYPE_F64: 8}


class SmoeValueError(SmoeError, ValueError):
    """A bad argument found in Python before any call into the library (a
    name, a size, a tensor's shape, dtype or device): both a ValueError and
    a smoe.SmoeError (with its status), so either `except` catches it."""


def _enum(table, value, what):
    try:
        return table[value]   # the usual case: a name spelled as in the table
    except (KeyError, TypeError):
        pass
    key = value
    if not (value is None or isinstance(value, str)):
        # Enum members (SonicMoE's ActivationType etc.): use their value or name.
        key = getattr(value, "value", None)
        if not isinstance(key, str):
            key = getattr(value, "name", str(value))
    if isinstance(key, str):
        key = key.lower()
    if key not in table:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "%s = %r, must be one of %s"
                             % (what, value, ", ".join(repr(k) for k in table)))
    return table[key]


# ------------------------------------------------------------ layer cache

# Entries kept per layer in each of its size caches (workspace, saved block)
# before the cache starts over: one per token count seen.
_SIZE_CACHE_ENTRIES = 4096


class _Layer:
    """One smoe_layer handle (freed with the object), with its configuration
    and the sizes it reported, per (T, pairs)."""

    def __init__(self, desc, cfg=None):
        lib = L.lib()
        ptr = ctypes.c_void_p()
        L.check(lib.smoe_layer_create(ctypes.byref(desc), ctypes.byref(ptr)))
        self._lib = lib
        self.ptr = ptr
        self.desc = desc
        self.backend = lib.smoe_layer_backend(ptr)
        self.path_name = lib.smoe_layer_path_name(ptr).decode()
        self.cfg = cfg
        if cfg is not None:
            (self.d, self.n, self.E, self.K, self.activation, _, self.has_bias, self.routing, _,
             self.rounding, self.round_tile, self.dtype, _, _, self.routed_scaling,
             self.consume_saved) = cfg
            self.general = self.routing == L.SMOE_ROUTING_GENERAL
        self._ws = {}
        self._saved = {}
        self._slot = {}

    def __del__(self):
        L.release(self, "ptr", lambda p: self._lib.smoe_layer_free(p))

    def workspace_bytes(self, T, pairs, call=0, dw1=False):
        """The library's workspace size for a call of the kind `call`
        (L.SMOE_CALL_FORWARD / _BACKWARD; 0, SMOE_CALL_ANY: the larger). A
        backward that writes dW1 (dw1=True: overwritten, in the layer's
        dtype, as _backward_core asks for it) takes
        smoe_layer_backward_workspace_bytes: the CUDA backends keep A' in
        dW1's buffer until they write dW1 there, and need less where n >= d."""
        if call == L.SMOE_CALL_BACKWARD:
            a = L.smoe_backward_args()
            a.T, a.pairs = T, pairs
            if dw1:
                # the query reads whether dw1 is given, not what it points to
                a.dw1.ptr, a.dw1.dtype, a.dw1.accumulate = 16, self.dtype, 0
            n = self._lib.smoe_layer_backward_workspace_bytes(self.ptr, ctypes.byref(a))
        else:
            n = self._lib.smoe_layer_call_workspace_bytes(self.ptr, call, T, pairs)
        if n == 0:
            raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, L.last_error())
        return n

    def drouter_slot(self, T, pairs):
        """smoe_layer_drouter_slot: the byte offset in a consume_saved
        layer's saved block where the backward may write the router weight's
        gradient, or None where the layer has no such slot; asked once per
        (T, pairs)."""
        key = (T, pairs)
        if key not in self._slot:
            off = ctypes.c_size_t()
            st = self._lib.smoe_layer_drouter_slot(self.ptr, T, pairs, ctypes.byref(off))
            if len(self._slot) >= _SIZE_CACHE_ENTRIES:
                self._slot.clear()
            self._slot[key] = off.value if st == L.SMOE_SUCCESS else None
        return self._slot[key]

    def saved_bytes(self, T, pairs):
        n = self._lib.smoe_layer_saved_bytes(self.ptr, T, pairs)
        if n == 0:
            raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, L.last_error())
        return n

    def workspace_nbytes(self, T, pairs, call, dw1=False):
        """workspace_bytes(), asked of the library once per (T, pairs, call,
        dw1): each call allocates its own kind's size, so the backward does
        not hold the forward's Y and A (or the forward the backward's dX~)."""
        key = (T, pairs, call, bool(dw1))
        n = self._ws.get(key)
        if n is None:
            n = self.workspace_bytes(T, pairs, call, bool(dw1))
            if len(self._ws) >= _SIZE_CACHE_ENTRIES:
                self._ws.clear()
            self._ws[key] = n
        return n

    def saved_nbytes(self, T, pairs):
        """saved_bytes(), asked of the library once per (T, pairs) and then
        checked against the Python mirror saved_bytes() (which the fake
        implementation uses under torch.compile)."""
        key = (T, pairs)
        n = self._saved.get(key)
        if n is None:
            n = self.saved_bytes(T, pairs)
            want = saved_bytes(T, pairs, d=self.d, n=self.n, E=self.E, K=self.K,
                               activation=self.activation, routing=self.routing,
                               rounding=self.rounding, round_tile=self.round_tile,
                               dtype=self.dtype)
            if n != want:
                raise SmoeError(L.SMOE_ERROR_INTERNAL,
                                "smoe_layer_saved_bytes() = %d but smoe.functional.saved_bytes()"
                                " = %d: the Python mirror of the saved layout is out of date"
                                % (n, want))
            if len(self._saved) >= _SIZE_CACHE_ENTRIES:
                self._saved.clear()
            self._saved[key] = n
        return n


# {(cfg, device type, device index, $SMOE_TORCH_BACKEND for CUDA): _Layer}
_layers = {}
_layers_lock = threading.Lock()


def _make_desc(cfg, backend, device):
    (d, n, E, K, act, layout, has_bias, routing, renorm, rounding, tile, dtype, n_group,
     topk_group, routed_scaling, consume_saved) = cfg
    desc = L.lib().smoe_layer_desc_default()
    desc.d, desc.n, desc.E, desc.K = d, n, E, K
    desc.activation, desc.w1_layout, desc.has_bias = act, layout, int(has_bias)
    desc.routing, desc.renormalize = routing, int(renorm)
    desc.rounding, desc.round_tile = rounding, tile
    desc.n_group, desc.topk_group, desc.routed_scaling = n_group, topk_group, routed_scaling
    desc.dtype, desc.backend, desc.device = dtype, backend, device
    desc.consume_saved = int(consume_saved)
    return desc


def _gpu_backends():
    """The GPU backends to try, best first ($SMOE_TORCH_BACKEND=cuda|sm90 forces one)."""
    forced = os.environ.get("SMOE_TORCH_BACKEND", "").lower()
    if forced == "cuda":
        return (L.SMOE_BACKEND_CUDA,)
    if forced == "sm90":
        return (L.SMOE_BACKEND_SM90,)
    return (L.SMOE_BACKEND_SM90, L.SMOE_BACKEND_CUDA)


def _get_layer(cfg, device):
    """The cached layer for a configuration on a torch device (and, on CUDA,
    the backend $SMOE_TORCH_BACKEND forces, so changing it takes effect)."""
    dtype = device.type
    key = (cfg, dtype, device.index,
           "" if dtype == "cpu" else os.environ.get("SMOE_TORCH_BACKEND", "").lower())
    layer = _layers.get(key)
    if layer is not None:
        return layer
    with _layers_lock:
        layer = _layers.get(key)
        if layer is not None:
            return layer
        if device.type == "cpu":
            layer = _Layer(_make_desc(cfg, L.SMOE_BACKEND_CPU, 0), cfg)
        elif device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            error = None
            for backend in _gpu_backends():
                try:
                    layer = _Layer(_make_desc(cfg, backend, index), cfg)
                    break
                except SmoeError as e:
                    if e.status not in (L.SMOE_ERROR_NO_DEVICE, L.SMOE_ERROR_UNSUPPORTED):
                        raise
                    # "cannot run this" says more than "no such device".
                    if error is None or error.status == L.SMOE_ERROR_NO_DEVICE:
                        error = e
            if layer is None:
                raise error
        else:
            raise SmoeError(L.SMOE_ERROR_UNSUPPORTED,
                            "tensors on %s: smoe runs on CPU and CUDA tensors" % device)
        _layers[key] = layer
        return layer


def _config(x, w1, w2, has_bias, top_k, routing, renormalize, activation, w1_layout, rounding,
            round_tile, n_group, topk_group, consume_saved, routed_scaling):
    """The layer configuration (the key of _layers) for these tensors and
    options: (d, n, E, K, activation, w1_layout, has_bias, routing,
    renormalize, rounding, round_tile, dtype, n_group, topk_group,
    routed_scaling, consume_saved), enums as smoe_* codes."""
    d, n, E = x.shape[1], w2.shape[2], w1.shape[0]
    K = 0 if routing == L.SMOE_ROUTING_GENERAL else top_k
    dtype = _DTYPES.get(x.dtype)
    if dtype is None:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "dtype %s: smoe takes float32, bfloat16 or float64" % x.dtype)
    return (int(d), int(n), int(E), int(K), int(activation), int(w1_layout), bool(has_bias),
            int(routing), bool(renormalize), int(rounding), int(round_tile), dtype, int(n_group),
            int(topk_group), float(routed_scaling), bool(consume_saved))


# ------------------------------------------------------------ sizes

def _align(x):
    return (x + 255) // 256 * 256


# The saved block's first section: the library's header (which layer filled
# it, T, pairs, whether its forward succeeded).
_SAVED_HEADER = 256


def saved_bytes(T, pairs, *, d, n, E, K, activation, routing, rounding, round_tile, dtype):
    """smoe_layer_saved_bytes() computed in Python (also for symbolic T under
    torch.compile). Enum arguments are the smoe_* integer codes. Kept equal
    to the library's by tests/test_lib.py."""
    h_cols = 2 * n if activation in GATED else n
    if routing == L.SMOE_ROUTING_GENERAL:
        cap = pairs
    elif rounding in (L.SMOE_ROUND_UP, L.SMOE_ROUND_NEAREST):
        cap = torch.sym_min(T * E, T * K + E * (round_tile - 1))
    else:
        cap = T * K
    fsize = 8 if dtype == L.SMOE_DTYPE_F64 else 4
    off = _SAVED_HEADER                                # the header
    off = _align(off + cap * h_cols * _DTYPE_SIZE[dtype])   # h
    off = _align(off + cap * fsize)                    # row_score
    off = _align(off + cap * 4)                        # row_token
    off = _align(off + cap * 4)                        # assign_row
    off = _align(off + cap * 2)                        # assign_expert (uint16)
    off = _align(off + (T + 1) * 4)                    # token_offset
    off = _align(off + (E + 1) * 4)                    # expert_offset
    if routing in (L.SMOE_ROUTING_SOFTMAX_TOPK, L.SMOE_ROUTING_SIGMOID_TOPK) or (
            routing != L.SMOE_ROUTING_GENERAL and rounding != L.SMOE_ROUND_OFF):
        off = _align(off + T * E * fsize)              # logits
    return off


def _ptr(t):
    return t.data_ptr() if t is not None else None


def _grad_ptr(t):
    """A gradient buffer's pointer: NULL for one not computed or empty."""
    return t.data_ptr() if t is not None and t.numel() > 0 else None


def _aligned(t, align):
    """t as the library takes it: contiguous, and its data_ptr() a multiple of
    `align` bytes (16 for the CUDA backends' tensors of the layer's dtype,
    which their kernels load as 16-byte vectors). A view at a storage offset
    (w[1:], x[3:]) can start anywhere: such a tensor goes as an aligned copy.
    A fresh allocation (contiguous()) is always aligned."""
    if t is None:
        return None
    if not t.is_contiguous():
        return t.contiguous()
    if t.data_ptr() % align:
        return t.clone(memory_format=torch.contiguous_format)
    return t


# On CUDA the call runs with the tensors' device current and on its current
# stream, as `with torch.cuda.device(dev)` and torch.cuda.current_stream(dev)
# would do, through the functions those use (cheaper per call), where this
# PyTorch has them.
_exchange_device = getattr(torch.cuda, "_exchange_device", None)
_maybe_exchange_device = getattr(torch.cuda, "_maybe_exchange_device", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# Debug mode: every CUDA call waits for the device and raises its own
# device-side error at once (set_debug(); $SMOE_DEBUG=1 at import).
_DEBUG = os.environ.get("SMOE_DEBUG", "0").strip().lower() not in ("", "0", "false", "off", "no")


def set_debug(enabled=True):
    """Debug mode on or off (initially on when $SMOE_DEBUG=1 at import).

    On CUDA the library checks what lives in device memory (the GENERAL
    triples of moe_general; the saved block in backward) in its kernels, so
    a bad value is normally raised by the layer's next call. In debug mode
    every CUDA forward and backward waits for its stream right after it is
    queued (smoe_layer_device_status with wait=1) and raises its own error
    at once: slower, as each call synchronises the host with the device
    (skipped while the stream is being captured into a CUDA graph). The
    CPU backend checks everything before any work either way."""
    global _DEBUG
    _DEBUG = bool(enabled)


def _call(fn, layer, args, saved, ws, dev):
    """fn (L.forward_raw or L.backward_raw) on the layer, with the saved
    block (a uint8 tensor or None) and the workspace (a uint8 tensor), each
    with its size in bytes; raises SmoeError."""
    if saved is None:
        sp, sn = None, 0
    else:
        sp, sn = saved.data_ptr(), saved.numel()
    wp, wn = ws.data_ptr(), ws.numel()
    if dev.type != "cuda":
        status = fn(layer.ptr, ctypes.byref(args), sp, sn, wp, wn, None)
        if status != L.SMOE_SUCCESS:
            L.check(status)
    elif _exchange_device is None or _maybe_exchange_device is None or _raw_stream is None:
        with torch.cuda.device(dev):
            _cuda_call(fn, layer, args, sp, sn, wp, wn, torch.cuda.current_stream(dev).cuda_stream)
    else:
        prev = _exchange_device(dev.index)
        try:
            _cuda_call(fn, layer, args, sp, sn, wp, wn, _raw_stream(dev.index))
        finally:
            _maybe_exchange_device(prev)


def _cuda_call(fn, layer, args, sp, sn, wp, wn, stream):
    """_call on CUDA, with the layer's device current. Before the call: the
    error an earlier call of this layer met on the device, if the kernel that
    found it has finished (wait=0 reads page-locked memory: no
    synchronisation), is raised, and this call is not run. After it, in debug
    mode: waits for the stream and raises this call's own device error."""
    lib = layer._lib
    status = lib.smoe_layer_device_status(layer.ptr, stream, 0)
    if status != L.SMOE_SUCCESS:
        raise SmoeError(status, "%s (found on the device in an earlier call of this layer; "
                        "this call was not run)" % L.last_error())
    status = fn(layer.ptr, ctypes.byref(args), sp, sn, wp, wn, stream)
    if status != L.SMOE_SUCCESS:
        L.check(status)
    if _DEBUG and not torch.cuda.is_current_stream_capturing():
        status = lib.smoe_layer_device_status(layer.ptr, stream, 1)
        if status != L.SMOE_SUCCESS:
            raise SmoeError(status, L.last_error())


def check_device():
    """Raises SmoeError for the first error the GPU found in a call of any of
    smoe's layers (bad GENERAL triples, a saved block that does not belong to
    its backward) and not raised yet; returns None when there is none.

    Synchronises: waits for every CUDA device that has a smoe layer
    (torch.cuda.synchronize), then reads each layer's device status
    (smoe_layer_device_status with wait=1 on the device's current stream),
    which clears it. Other layers' errors found at the same time are
    appended to the message. Nothing to do for CPU layers (the CPU backend
    checks everything before any work and raises at once)."""
    with _layers_lock:
        layers = list(_layers.values())
    errors = []
    synced = set()
    for layer in layers:
        if layer.backend == L.SMOE_BACKEND_CPU:
            continue
        index = layer.desc.device
        with torch.cuda.device(index):
            if index not in synced:
                torch.cuda.synchronize(index)
                synced.add(index)
            stream = torch.cuda.current_stream(index).cuda_stream
            status = layer._lib.smoe_layer_device_status(layer.ptr, stream, 1)
            if status != L.SMOE_SUCCESS:
                errors.append((status, L.last_error()))
    if errors:
        status, message = errors[0]
        if len(errors) > 1:
            message += " (and %d more: %s)" % (len(errors) - 1,
                                               "; ".join(m for _, m in errors[1:]))
        raise SmoeError(status, message)
    return None


def _forward_core(layer, x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2,
                  expert_bias, inference, save, lowp=False):
    """smoe_layer_forward on real tensors: (out, expert_counts, router_logits
    ((0,) for GENERAL; float32, or x's dtype with lowp), saved block or None
    when nothing is kept). expert_bias: SIGMOID_TOPK's (E,) float32 bias, or
    None."""
    dev = x.device
    # Every tensor contiguous and aligned as the backend needs (the CUDA
    # backends: 16 bytes for the layer's dtype; element size on the CPU).
    va = 16 if dev.type == "cuda" else x.element_size()
    x, router_w, w1, w2, b1, b2 = (_aligned(t, va) for t in (x, router_w, w1, w2, b1, b2))
    general = layer.general
    T = x.shape[0]
    E = layer.E
    out = torch.empty_like(x)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    logits = torch.empty((0,) if general else (T, E), dtype=x.dtype if lowp else torch.float32,
                         device=dev)
    if general:
        pairs = pair_token.shape[0]
        if pairs > 0:
            pair_token, pair_expert, pair_score = (_aligned(t, 4) for t in (
                pair_token, pair_expert, pair_score))
            pt, pe, ps = pair_token.data_ptr(), pair_expert.data_ptr(), pair_score.data_ptr()
        else:
            pt = pe = ps = None
    else:
        pairs = 0
        pt = pe = ps = None
    if expert_bias is not None:
        expert_bias = _aligned(expert_bias, 4)
    # A forward whose result nobody differentiates needs no saved block, and
    # without token rounding the library's inference mode computes the same.
    lib_inference = inference or (not save and layer.rounding == L.SMOE_ROUND_OFF)
    if lib_inference:
        saved = None
    else:
        saved = torch.empty(layer.saved_nbytes(T, pairs), dtype=torch.uint8, device=dev)
    ws = torch.empty(layer.workspace_nbytes(T, pairs, L.SMOE_CALL_FORWARD), dtype=torch.uint8,
                     device=dev)
    args = L.forward_args_raw(T, x.data_ptr(), _ptr(router_w), pairs, pt, pe, ps,
                              w1.data_ptr(), _ptr(b1), w2.data_ptr(), _ptr(b2), out.data_ptr(),
                              None if general else logits.data_ptr(), counts.data_ptr(),
                              int(lib_inference), _ptr(expert_bias),
                              layer.dtype if lowp else L.SMOE_DTYPE_F32)
    _call(L.forward_raw, layer, args, saved, ws, dev)
    if not save or inference:
        saved = None
    return out, counts, logits, saved


# Bits of `needs` in moe_backward: which gradients to compute.
_NEED_X, _NEED_ROUTER, _NEED_W1, _NEED_B1, _NEED_W2, _NEED_B2, _NEED_SCORE = (1 << i for i in range(7))


def _dlogits_arg(dlogits, x, layer_dtype):
    """(tensor, smoe dtype) for a backward's dlogits_extra (None: (None,
    F32)): in the layer's dtype as it is when it has x's dtype (the gradient
    of logits returned in it), else as float32; aligned to its element."""
    if dlogits is None:
        return None, L.SMOE_DTYPE_F32
    if dlogits.dtype == x.dtype:
        return _aligned(dlogits, dlogits.element_size()), layer_dtype
    if dlogits.dtype != torch.float32:
        dlogits = dlogits.to(torch.float32)
    return _aligned(dlogits, 4), L.SMOE_DTYPE_F32


def _backward_core(layer, dout, dlogits_extra, x, router_w, w1, w2, b2, saved, pairs, needs):
    """smoe_layer_backward on real tensors: (dx, drouter_w, dw1, db1, dw2,
    db2, dpair_score), None for a gradient not asked for in `needs` or not
    part of the layer."""
    dev = x.device
    dtype = x.dtype
    va = 16 if dev.type == "cuda" else x.element_size()
    if dout.dtype != dtype:
        dout = dout.to(dtype)
    x, router_w, w1, w2, b2, dout = (_aligned(t, va) for t in (x, router_w, w1, w2, b2, dout))
    dlogits_extra, xdt = _dlogits_arg(dlogits_extra, x, layer.dtype)
    saved = _aligned(saved, 16)
    general = layer.general
    has_bias = layer.has_bias
    T, E = x.shape[0], layer.E

    def empty(shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device=dev)

    dx = empty(x.shape) if needs & _NEED_X else None
    want_router = not general and needs & _NEED_ROUTER
    # A consuming layer writes the router weight's gradient into its saved
    # block's router slot; it is allocated and copied out below, after the
    # workspace is freed, so it is never live beside the workspace and H.
    slot = (layer.drouter_slot(T, pairs)
            if want_router and getattr(layer, "consume_saved", False) else None)
    drouter = empty(router_w.shape) if want_router and slot is None else None
    dw1 = empty(w1.shape) if needs & _NEED_W1 else None
    db1 = empty((E, w1.shape[1])) if has_bias and needs & _NEED_B1 else None
    dw2 = empty(w2.shape) if needs & _NEED_W2 else None
    db2 = empty((E, x.shape[1])) if has_bias and needs & _NEED_B2 else None
    dscore = empty((pairs,), torch.float32) if general and needs & _NEED_SCORE else None
    ws = torch.empty(layer.workspace_nbytes(T, pairs, L.SMOE_CALL_BACKWARD, dw1 is not None),
                     dtype=torch.uint8, device=dev)
    ld, f32 = layer.dtype, L.SMOE_DTYPE_F32
    # Gradients overwrite (accumulate = 0).
    args = L.backward_args_raw(T, x.data_ptr(), _ptr(router_w), pairs, w1.data_ptr(),
                               w2.data_ptr(), _ptr(b2), dout.data_ptr(), _ptr(dlogits_extra),
                               _grad_ptr(dx), ld, 0,
                               saved.data_ptr() + slot if slot is not None else _grad_ptr(drouter),
                               ld, 0,
                               _grad_ptr(dw1), ld, 0, _grad_ptr(db1), ld, 0,
                               _grad_ptr(dw2), ld, 0, _grad_ptr(db2), ld, 0,
                               _grad_ptr(dscore), f32, 0, xdt)
    _call(L.backward_raw, layer, args, saved, ws, dev)
    if slot is not None:
        del ws
        drouter = empty(router_w.shape)
        nbytes = drouter.numel() * drouter.element_size()
        drouter.copy_(saved[slot:slot + nbytes].view(dtype).view(router_w.shape))
    return dx, drouter, dw1, db1, dw2, db2, dscore


# ------------------------------------------------------------ custom operators

# The forward operator's `config`: these options, in this order (ints). The
# first _N_OPTIONS are the layer's options, which backward takes again.
_FWD_CONFIG = ("top_k", "routing", "renormalize", "activation", "w1_layout", "rounding",
               "round_tile", "n_group", "topk_group", "consume_saved", "inference", "save",
               "logits_lowp")
_N_OPTIONS = 10
_CONSUME, _INFERENCE, _SAVE, _LOWP = 9, 10, 11, 12
# The backward operators' `config`.
_BWD_CONFIG = ("pairs", "has_bias", "top_k", "routing", "renormalize", "activation",
               "w1_layout", "rounding", "round_tile", "n_group", "topk_group", "consume_saved",
               "needs")


def _unpack(config, names, op):
    if len(config) != len(names):
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s: config has %d entries, must have %d (%s)"
                        % (op, len(config), len(names), ", ".join(names)))
    return config


@torch.library.custom_op("smoe::moe_forward", mutates_args=())
def _moe_forward(x: Tensor, router_w: Optional[Tensor], pair_token: Optional[Tensor],
                 pair_expert: Optional[Tensor], pair_score: Optional[Tensor], w1: Tensor,
                 w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor],
                 expert_bias: Optional[Tensor], config: List[int],
                 routed_scaling: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out (T, d), expert_counts (E) int32, router_logits (T, E) fp32 or (0,)
    for GENERAL, saved uint8 block or (0,) when nothing is kept).

    expert_bias: SIGMOID_TOPK's selection bias (E,) float32 or None (no
    gradient). config: [top_k, routing, renormalize, activation, w1_layout,
    rounding, round_tile, n_group, topk_group, consume_saved, inference,
    save] as ints
    (enums as smoe_* codes). The options are one list rather than one
    argument each because PyTorch's custom-operator autograd wrapper spends
    time quadratic in the number of arguments on every call;
    routed_scaling, SIGMOID_TOPK's factor (1.0 otherwise), is the one float
    and has its own argument (a double in the schema: passed exactly)."""
    (top_k, routing, renormalize, activation, w1_layout, rounding, round_tile, n_group,
     topk_group, consume, inference, save, lowp) = _unpack(config, _FWD_CONFIG,
                                                           "smoe::moe_forward")
    layer = _get_layer(_config(x, w1, w2, b1 is not None, top_k, routing, renormalize,
                               activation, w1_layout, rounding, round_tile, n_group, topk_group,
                               consume, routed_scaling), x.device)
    out, counts, logits, saved = _forward_core(layer, x, router_w, pair_token, pair_expert,
                                               pair_score, w1, w2, b1, b2, expert_bias,
                                               bool(inference), bool(save), bool(lowp))
    if saved is None:
        saved = torch.empty(0, dtype=torch.uint8, device=x.device)
    return out, counts, logits, saved


@_moe_forward.register_fake
def _moe_forward_fake(x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2,
                      expert_bias, config, routed_scaling):
    (top_k, routing, renormalize, activation, w1_layout, rounding, round_tile, n_group,
     topk_group, consume, inference, save, lowp) = _unpack(config, _FWD_CONFIG,
                                                           "smoe::moe_forward")
    cfg = _config(x, w1, w2, b1 is not None, top_k, routing, renormalize, activation, w1_layout,
                  rounding, round_tile, n_group, topk_group, consume, routed_scaling)
    general = routing == L.SMOE_ROUTING_GENERAL
    T, E = x.shape[0], w1.shape[0]
    pairs = pair_token.shape[0] if general else 0
    out = torch.empty_like(x)
    counts = x.new_empty((E,), dtype=torch.int32)
    logits = x.new_empty((0,) if general else (T, E), dtype=x.dtype if lowp else torch.float32)
    if save and not inference:
        nbytes = saved_bytes(T, pairs, d=cfg[0], n=cfg[1], E=E, K=cfg[3], activation=activation,
                             routing=routing, rounding=rounding, round_tile=round_tile,
                             dtype=cfg[11])
    else:
        nbytes = 0
    saved = x.new_empty((nbytes,), dtype=torch.uint8)
    return out, counts, logits, saved


def _moe_backward_impl(dout, dlogits_extra, x, router_w, w1, w2, b2, saved, config,
                       routed_scaling, consume):
    (pairs, has_bias, top_k, routing, renormalize, activation, w1_layout, rounding, round_tile,
     n_group, topk_group, consume_saved, needs) = _unpack(config, _BWD_CONFIG,
                                                          "smoe::moe_backward")
    if bool(consume_saved) != consume:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "config's consume_saved = %d: a consuming layer's backward is "
                        "smoe::moe_backward_consume, a reading one's smoe::moe_backward"
                        % consume_saved)
    if saved.numel() == 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "backward through a forward that kept nothing for it "
                        "(run with inference=True)")
    layer = _get_layer(_config(x, w1, w2, has_bias, top_k, routing, renormalize, activation,
                               w1_layout, rounding, round_tile, n_group, topk_group,
                               consume_saved, routed_scaling), x.device)
    grads = _backward_core(layer, dout, dlogits_extra, x, router_w, w1, w2, b2, saved, pairs,
                           needs)
    dev = x.device
    return tuple(g if g is not None else
                 torch.empty(0, dtype=torch.float32 if i == 6 else x.dtype, device=dev)
                 for i, g in enumerate(grads))


@torch.library.custom_op("smoe::moe_backward", mutates_args=())
def _moe_backward(dout: Tensor, dlogits_extra: Optional[Tensor], x: Tensor,
                  router_w: Optional[Tensor], w1: Tensor, w2: Tensor, b2: Optional[Tensor],
                  saved: Tensor, config: List[int], routed_scaling: float
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, drouter_w, dw1, db1, dw2, db2, dpair_score); a gradient not asked
    for in `needs` (or not part of the layer) is an empty tensor.

    config: [pairs, has_bias, top_k, routing, renormalize, activation,
    w1_layout, rounding, round_tile, n_group, topk_group, consume_saved,
    needs] as ints, consume_saved 0 (a consuming layer's backward writes
    over `saved`: smoe::moe_backward_consume); routed_scaling as in
    moe_forward (the layer's options must be the forward's: the saved block
    belongs to that layer)."""
    return _moe_backward_impl(dout, dlogits_extra, x, router_w, w1, w2, b2, saved, config,
                              routed_scaling, False)


@torch.library.custom_op("smoe::moe_backward_consume", mutates_args=("saved",))
def _moe_backward_consume(dout: Tensor, dlogits_extra: Optional[Tensor], x: Tensor,
                          router_w: Optional[Tensor], w1: Tensor, w2: Tensor,
                          b2: Optional[Tensor], saved: Tensor, config: List[int],
                          routed_scaling: float
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """smoe::moe_backward of a layer with consume_saved = 1 (config's
    consume_saved must be 1): the library writes dH over the saved block's H
    and marks the block consumed, so `saved` is declared mutated (PyTorch
    bumps its version: autograd refuses a second backward through it, and
    torch.compile orders the write after every read)."""
    return _moe_backward_impl(dout, dlogits_extra, x, router_w, w1, w2, b2, saved, config,
                              routed_scaling, True)


def _moe_backward_fake(dout, dlogits_extra, x, router_w, w1, w2, b2, saved, config,
                       routed_scaling):
    (pairs, has_bias, top_k, routing, renormalize, activation, w1_layout, rounding, round_tile,
     n_group, topk_group, consume_saved, needs) = _unpack(config, _BWD_CONFIG,
                                                          "smoe::moe_backward")
    general = routing == L.SMOE_ROUTING_GENERAL
    E = w1.shape[0]

    def buf(cond, shape, dtype=None):
        return x.new_empty(shape if cond else (0,), dtype=dtype or x.dtype)

    return (buf(needs & _NEED_X, x.shape),
            buf(not general and needs & _NEED_ROUTER,
                router_w.shape if router_w is not None else (0,)),
            buf(needs & _NEED_W1, w1.shape),
            buf(has_bias and needs & _NEED_B1, (E, w1.shape[1])),
            buf(needs & _NEED_W2, w2.shape),
            buf(has_bias and needs & _NEED_B2, (E, x.shape[1])),
            buf(general and needs & _NEED_SCORE, (pairs,), torch.float32))


_moe_backward.register_fake(_moe_backward_fake)
_moe_backward_consume.register_fake(_moe_backward_fake)


# Positions of the differentiable inputs of moe_forward, with their `needs`
# bits (the tenth tensor, expert_bias, gets no gradient).
_IN_X, _IN_ROUTER, _IN_SCORE, _IN_W1, _IN_W2, _IN_B1, _IN_B2 = 0, 1, 4, 5, 6, 7, 8
_N_TENSORS = 10
_GRAD_SLOTS = ((_IN_X, _NEED_X), (_IN_ROUTER, _NEED_ROUTER), (_IN_W1, _NEED_W1),
               (_IN_B1, _NEED_B1), (_IN_W2, _NEED_W2), (_IN_B2, _NEED_B2),
               (_IN_SCORE, _NEED_SCORE))   # in moe_backward's output order


def _save_context(ctx, x, router_w, pair_token, w1, w2, b1, b2, saved, options, routed_scaling,
                  inference, layer):
    ctx.save_for_backward(x, router_w, w1, w2, b2, saved)
    ctx.options = options          # top_k .. topk_group of the forward config
    ctx.routed_scaling = routed_scaling
    ctx.has_bias = b1 is not None
    ctx.pairs = pair_token.shape[0] if pair_token is not None else 0
    ctx.inference = inference
    ctx.layer = layer              # None: backward through the operator


def _setup_context(ctx, inputs, output):
    (x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2, expert_bias, config,
     routed_scaling) = inputs
    _save_context(ctx, x, router_w, pair_token, w1, w2, b1, b2, output[3],
                  tuple(config[:_N_OPTIONS]), routed_scaling, bool(config[_INFERENCE]), None)


def _input_grads(ctx, dout, dlogits):
    """The gradients of moe_forward's 10 tensor inputs."""
    x, router_w, w1, w2, b2, saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    needs = 0
    for pos, bit in _GRAD_SLOTS:
        if need[pos]:
            needs |= bit
    grads = [None] * _N_TENSORS
    if needs == 0 or (dout is None and dlogits is None):
        return grads
    if ctx.inference:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "backward through smoe.moe(..., inference=True): the forward kept "
                        "nothing for it")
    if dout is None:
        dout = torch.zeros_like(x)
    if dlogits is not None and dlogits.numel() == 0:
        dlogits = None
    layer = ctx.layer
    consume = ctx.options[_CONSUME]
    if (layer is not None and not torch.is_grad_enabled()
            and _direct(x.device, dout, dlogits, x, router_w, w1, w2, b2, saved)):
        out = _backward_core(layer, dout, dlogits, x, router_w, w1, w2, b2, saved, ctx.pairs,
                             needs)
        if consume:
            # The block now holds dH: a second backward through this graph
            # (retain_graph=True) fails at ctx.saved_tensors with autograd's
            # "modified by an inplace operation" (the operator below gets
            # the same from its mutates_args).
            torch.autograd.graph.increment_version(saved)
    else:
        op = torch.ops.smoe.moe_backward_consume if consume else torch.ops.smoe.moe_backward
        out = op(dout, dlogits, x, router_w, w1, w2, b2, saved,
                 [ctx.pairs, int(ctx.has_bias), *ctx.options, needs], ctx.routed_scaling)
    for (pos, bit), g in zip(_GRAD_SLOTS, out):
        if needs & bit:
            grads[pos] = g
    return grads


def _backward(ctx, dout, dcounts, dlogits, dsaved):
    # none for config and routed_scaling
    return tuple(_input_grads(ctx, dout, dlogits)) + (None, None)


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------ the eager path

class _MoeFunction(torch.autograd.Function):
    """moe_forward's autograd formula for plain eager calls (see _direct),
    without the dispatcher: the same implementation, the same saved
    tensors, the backward called directly when it can be."""

    @staticmethod
    def forward(ctx, x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2,
                expert_bias, layer, config):
        inference = bool(config[_INFERENCE])
        out, counts, logits, saved = _forward_core(layer, x, router_w, pair_token, pair_expert,
                                                   pair_score, w1, w2, b1, b2, expert_bias,
                                                   inference, not inference,
                                                   bool(config[_LOWP]))
        ctx.set_materialize_grads(False)   # an unused output's gradient stays None
        ctx.mark_non_differentiable(counts)
        _save_context(ctx, x, router_w, pair_token, w1, w2, b1, b2, saved,
                      tuple(config[:_N_OPTIONS]), layer.routed_scaling, inference, layer)
        return out, counts, logits

    @staticmethod
    def backward(ctx, dout, dcounts, dlogits):
        return tuple(_input_grads(ctx, dout, dlogits)) + (None, None)   # layer, config


# Set False to send every call through the operators (the tests run both ways).
_EAGER = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_C = torch._C
_functorch = getattr(_C, "_functorch", None)
_peek_interpreter = getattr(_functorch, "peek_interpreter_stack", None)
_dispatch_modes = getattr(_C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(_C, "_is_torch_function_mode_enabled", None)
_jit_tracing = getattr(_C, "_get_tracing_state", None)
if None in (_peek_interpreter, _dispatch_modes, _function_modes, _jit_tracing):
    _EAGER = False   # this PyTorch cannot tell: always the operators


def _direct(device, *tensors):
    """Whether a call on these tensors can skip the operators: a plain eager
    call on plain CPU or CUDA tensors, which the operators would send
    straight to their implementation (so it computes the same)."""
    if torch.compiler.is_compiling() or not _EAGER:
        return False
    if device.type != "cpu" and device.type != "cuda":
        return False
    if (_dispatch_modes() or _function_modes() or _peek_interpreter() is not None
            or _jit_tracing() is not None):
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


# ------------------------------------------------------------ public functions

def _check_tensor(t, name, dim, device, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise SmoeError(L.SMOE_ERROR_NULL_POINTER if t is None else L.SMOE_ERROR_INVALID_VALUE,
                        "%s must be a torch.Tensor, got %s" % (name, type(t).__name__))
    if dim is not None and t.dim() != dim:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "%s has shape %s, must have %d dimensions"
                        % (name, tuple(t.shape), dim))
    if t.device != device:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s is on %s but x is on %s"
                        % (name, t.device, device))
    if dtype is not None and t.dtype != dtype:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "%s has dtype %s but x has %s"
                        % (name, t.dtype, dtype))


def _check_shape(t, name, shape, why=None, *why_args):
    """t.shape must be `shape`; the message says why (why % why_args: only
    formatted on failure, as the sizes may be symbolic under torch.compile)."""
    if t.shape != shape:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "%s has shape %s, expected %s%s"
                        % (name, tuple(t.shape), tuple(shape),
                           " (%s)" % (why % why_args) if why else ""))


def _check_experts(x, w1, w2, b1, b2, activation):
    """Checks the expert tensors, takes d, n and E from w1 and w2 (checked
    against each other first), then checks x's hidden size against them.
    Returns (d, n, E, b1, b2) with a missing bias (when only one is given)
    filled with zeros."""
    if x.dtype not in _DTYPES:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "x has dtype %s: smoe takes float32, bfloat16 or float64" % x.dtype)
    device, dtype = x.device, x.dtype
    _check_tensor(w1, "w1", 3, device, dtype)
    _check_tensor(w2, "w2", 3, device, dtype)
    E, h, d = w1.shape
    E2, d2, n = w2.shape
    gated = activation in GATED
    if E2 != E or d2 != d or h != (2 * n if gated else n):
        both = "w1 has shape %s but w2 has shape %s: " % (tuple(w1.shape), tuple(w2.shape))
        if E2 != E:
            why = "E = %d experts in w1 (its first dimension) but %d in w2" % (E, E2)
        elif d2 != d:
            why = "d = %d in w1 (its last dimension) but %d in w2 (its second)" % (d, d2)
        else:
            why = ("w2 has n = %d (its last dimension), so w1 must have %d rows per expert "
                   "(%s), not %d" % (n, 2 * n if gated else n,
                                     "2n: a gated activation" if gated else
                                     "n: an activation that is not gated", h))
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, both + why)
    if x.shape[-1] != d:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE,
                        "x has hidden size %d (shape %s), but w1 and w2 have d = %d"
                        % (x.shape[-1], tuple(x.shape), d))
    if (b1 is None) != (b2 is None):
        if b1 is None:
            b1 = torch.zeros((E, h), dtype=dtype, device=device)
        else:
            b2 = torch.zeros((E, d), dtype=dtype, device=device)
    if b1 is not None:
        _check_tensor(b1, "b1", 2, device, dtype)
        _check_tensor(b2, "b2", 2, device, dtype)
        _check_shape(b1, "b1", (E, h), "E = %d, %s = %d from w1", E, "2n" if gated else "n", h)
        _check_shape(b2, "b2", (E, d), "E = %d, d = %d from w1 and w2", E, d)
    return d, n, E, b1, b2


def _autocast_dtype(device):
    if _AUTOCAST_BY_DEVICE:
        try:
            if torch.is_autocast_enabled(device.type):
                return torch.get_autocast_dtype(device.type)
        except RuntimeError:   # a device type without autocast ('meta')
            pass
        return None
    if device.type == "cuda" and torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    if device.type == "cpu" and torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    return None


def _autocast(device, *tensors):
    """Inside torch.autocast for the tensors' device, the floating inputs go
    to the autocast dtype (as autocast does for matmuls); the casts are
    differentiable, so fp32 master weights get fp32 gradients."""
    dtype = _autocast_dtype(device)
    if dtype is None or dtype not in _DTYPES:
        return tensors
    return tuple(t.to(dtype) if t is not None and t.dtype != dtype else t for t in tensors)


try:
    torch.is_autocast_enabled("cpu")
    torch.get_autocast_dtype("cpu")
    _AUTOCAST_BY_DEVICE = True
except (TypeError, AttributeError):
    _AUTOCAST_BY_DEVICE = False


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run(x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2, expert_bias,
         config, routed_scaling, d, n, E):
    """The forward on checked inputs (x (T, d)): through the eager path when
    _direct() allows, else through the operator. Returns (out, counts,
    logits)."""
    if _direct(x.device, x, router_w, pair_token, pair_expert, pair_score, w1, w2, b1, b2,
               expert_bias):
        (top_k, routing, renormalize, act, layout, rounding, round_tile, n_group,
         topk_group, consume) = config[:_N_OPTIONS]
        cfg = (d, n, E, top_k, act, layout, b1 is not None, routing, bool(renormalize), rounding,
               round_tile, _DTYPES[x.dtype], n_group, topk_group, routed_scaling, bool(consume))
        layer = _get_layer(cfg, x.device)
        inference = config[_INFERENCE]
        if config[_SAVE] or (inference and _wants_grad(x, router_w, pair_score, w1, w2, b1, b2)):
            # (inference=True with inputs that want a gradient: the output
            # takes part in autograd, whose backward then says why not.)
            return _MoeFunction.apply(x, router_w, pair_token, pair_expert, pair_score, w1, w2,
                                      b1, b2, expert_bias, layer, config)
        return _forward_core(layer, x, router_w, pair_token, pair_expert, pair_score, w1, w2,
                             b1, b2, expert_bias, bool(inference), False,
                             bool(config[_LOWP]))[:3]
    return torch.ops.smoe.moe_forward(x, router_w, pair_token, pair_expert, pair_score, w1, w2,
                                      b1, b2, expert_bias, config, routed_scaling)[:3]


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_sigmoid_options(routing, n_group, topk_group, routed_scaling, E, K, who="",
                          routing_name=None):
    """The options of routing 'sigmoid_topk' (smoe.h's rules, checked here to
    name the argument; the library checks them again): n_group and
    topk_group ints, both 0 (no groups) or n_group dividing E into groups of
    >= 2 experts and topk_group in [1, n_group] holding >= K experts;
    routed_scaling a finite number > 0. Other routings take the defaults (0,
    0, 1.0) only. `routing` is the smoe_routing code; `who` prefixes the
    message, `routing_name` names the routing in it. Returns (n_group,
    topk_group, routed_scaling) as int, int, float (a torch.SymFloat, under
    torch.compile, stays one)."""
    def refuse(status, message, *args):
        raise SmoeValueError(status, who + message % args)

    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if not _is_int(v):
            refuse(L.SMOE_ERROR_INVALID_VALUE, "%s = %r, must be an int", name, v)
    # (Comparisons rather than math.isfinite: under torch.compile a float
    # argument of the compiled function arrives as a torch.SymFloat, which
    # they guard on.)
    if (isinstance(routed_scaling, bool)
            or not isinstance(routed_scaling, (numbers.Real, torch.SymFloat))
            or not 0.0 < routed_scaling < math.inf):
        refuse(L.SMOE_ERROR_INVALID_VALUE, "routed_scaling = %r, must be a finite number > 0 "
               "(1.0: no scaling)", routed_scaling)
    G, g = int(n_group), int(topk_group)
    c = routed_scaling if isinstance(routed_scaling, torch.SymFloat) else float(routed_scaling)
    if routing != L.SMOE_ROUTING_SIGMOID_TOPK:
        name = routing_name if routing_name is not None else routing
        if G != 0 or g != 0:
            refuse(L.SMOE_ERROR_INVALID_VALUE, "n_group = %d, topk_group = %d: group-limited "
                   "selection needs routing='sigmoid_topk' (routing = %r); leave both 0", G, g,
                   name)
        if c != 1.0:
            refuse(L.SMOE_ERROR_INVALID_VALUE, "routed_scaling = %r needs routing='sigmoid_topk'"
                   " (routing = %r scales nothing: leave it 1.0)", routed_scaling, name)
        return G, g, c
    if G < 0 or g < 0:
        refuse(L.SMOE_ERROR_INVALID_SIZE, "n_group = %d, topk_group = %d: must be >= 0", G, g)
    # Written with and/or, not (G == 0) != (g == 0): under torch.compile
    # with dynamic shapes G and g arrive as SymInts, and torch 2.11's dynamo
    # cannot compare two symbolic booleans.
    if (G == 0 and g != 0) or (G != 0 and g == 0):
        refuse(L.SMOE_ERROR_INVALID_VALUE, "n_group = %d, topk_group = %d: both 0 (no groups) "
               "or both > 0", G, g)
    if G == 0:
        return G, g, c
    if E % G:
        refuse(L.SMOE_ERROR_INVALID_SIZE, "n_group = %d does not divide E = %d experts", G, E)
    if E // G < 2:
        refuse(L.SMOE_ERROR_INVALID_SIZE, "n_group = %d gives groups of E/n_group = %d "
               "expert(s); a group's key sums its 2 best, so groups need >= 2", G, E // G)
    if g > G:
        refuse(L.SMOE_ERROR_INVALID_SIZE, "topk_group = %d, must be in [1, n_group = %d]", g, G)
    if g * (E // G) < K:
        refuse(L.SMOE_ERROR_INVALID_SIZE, "topk_group = %d groups of %d experts hold fewer than "
               "top_k = %d experts", g, E // G, K)
    return G, g, c


def _check_expert_bias(expert_bias, routing, x, E):
    """expert_bias: None, or for routing 'sigmoid_topk' a float32 tensor (E,)
    on x's device. Returned detached (it gets no gradient)."""
    if expert_bias is None:
        return None
    if routing != L.SMOE_ROUTING_SIGMOID_TOPK:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "expert_bias is given but routing = %r has no expert bias "
                             "(routing='sigmoid_topk' only)" % _ROUTING_NAMES[routing])
    _check_tensor(expert_bias, "expert_bias", 1, x.device)
    _check_shape(expert_bias, "expert_bias", (E,), "E = %d experts", E)
    if expert_bias.dtype != torch.float32:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "expert_bias has dtype %s, must be float32"
                        % expert_bias.dtype)
    return expert_bias.detach()


def moe(x, router_w, w1, w2, b1=None, b2=None, *, top_k, routing="topk_softmax",
        renormalize=True, activation="swiglu", w1_layout="interleaved", token_rounding=None,
        round_tile=128, inference=False, expert_bias=None, n_group=0, topk_group=0,
        routed_scaling=1.0, consume_saved=False, ep_group=None, max_tokens=None, capacity=0,
        expert_rows=0, overlap=0, comm_sms=0, keep_x=False, copy_engines=None,
        router_logits_dtype=None):
    """The MoE feed-forward layer (token-choice routing), differentiable.

    Shapes (T tokens: x may have any leading dimensions, flattened to T):
      x (..., d), router_w (E, d), w1 (E, 2n, d) for gated activations or
      (E, n, d), w2 (E, d, n), b1 (E, 2n|n), b2 (E, d). One dtype for all:
      float32, bfloat16 or float64 on CPU, bfloat16 on CUDA.

    routing: 'topk_softmax' (the K largest logits, softmax over them),
      'softmax_topk' (softmax over all E, the K largest; renormalised to sum
      1 if `renormalize`) or 'sigmoid_topk' (DeepSeek-V3's, below).
      activation: 'swiglu', 'geglu', 'reglu', 'relu2', 'relu', 'silu',
      'gelu'. w1_layout: 'interleaved' (gate j in row 2j, up j in row 2j+1)
      or 'concatenated' (gate rows [0, n), up rows [n, 2n)).
    token_rounding: None, 'up', 'down' or 'nearest': each expert's token
      count rounded to a multiple of round_tile (training only; inference
      uses plain token choice; not with 'sigmoid_topk').
    'sigmoid_topk' (smoe.h's SMOE_ROUTING_SIGMOID_TOPK; Hugging Face's
      DeepseekV3TopkRouter): scores s = sigmoid(logits); the K experts are
      chosen by s + expert_bias, among the topk_group best of n_group
      contiguous groups of experts (a group ranked by the sum of its two
      best keys) when n_group > 0; their s are renormalised to sum 1 if
      `renormalize` and multiplied by routed_scaling. expert_bias: None
      (zeros) or a float32 tensor (E,) on x's device, read for the choice
      only, never differentiated: the caller updates it (DeepSeek-V3's
      aux-loss-free balancing). The other routings refuse expert_bias,
      n_group, topk_group and routed_scaling other than None, 0, 0, 1.0.
    inference: nothing is kept for backward (the output cannot be
      differentiated).
    consume_saved: the backward writes dH over the saved block's H (smoe.h's
      desc.consume_saved): the same gradients in a workspace smaller by dH's
      region (T*K x 2n, n if not gated). The graph can then be
      differentiated once: a second backward (retain_graph=True) raises
      autograd's "modified by an inplace operation" RuntimeError.
    Inside torch.autocast (for x's device) the inputs are cast to the
    autocast dtype first, differentiably (expert_bias stays float32).

    Expert parallelism: with ep_group (a torch.distributed group, whose one
      smoe.EPGroup of this process smoe.EPGroup.of makes at the first call,
      or an smoe.EPGroup) x is this rank's tokens,
      router_w (E, d) the whole router, w1, w2, b1, b2 this rank's experts
      [rank E/P, (rank+1) E/P) (E/P rows of the shapes above), and every
      rank of the group calls together, with the same options. max_tokens
      (required: the largest token count any rank passes) and capacity,
      expert_rows, overlap, comm_sms, keep_x, copy_engines are
      smoe.EPMoE's. The gradient of router_w is this rank's share: sum it
      over the group (torch.distributed.all_reduce, or EPGroup.all_reduce)
      as for any replicated parameter. token_rounding and consume_saved are refused under it
      (see smoe.h's smoe_ep_desc); expert_counts are this rank's tokens'.

    router_logits_dtype: None or torch.float32 (the default), or x's dtype
      (after autocast): the float32 logits rounded (the routing reads the
      float32 ones either way; bfloat16 logits are what Hugging Face's MoE
      blocks return, at half the bytes). Under ep_group too.

    Returns (out (..., d), expert_counts (E,) int32, router_logits (..., E)
    in router_logits_dtype). Gradients reach x, router_w, w1, w2, b1, b2; a
    loss computed from router_logits (an auxiliary load-balancing loss)
    sends its gradient back through the router too.
    """
    if not isinstance(x, torch.Tensor):
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "x must be a torch.Tensor")
    if ep_group is not None:
        from .ep import _moe_ep  # (smoe.ep imports this module)
        return _moe_ep(ep_group, x, router_w, w1, w2, b1, b2, top_k=top_k, routing=routing,
                       renormalize=renormalize, activation=activation, w1_layout=w1_layout,
                       token_rounding=token_rounding, inference=inference,
                       expert_bias=expert_bias, n_group=n_group, topk_group=topk_group,
                       routed_scaling=routed_scaling, consume_saved=consume_saved,
                       max_tokens=max_tokens, capacity=capacity, expert_rows=expert_rows,
                       overlap=overlap, comm_sms=comm_sms, keep_x=keep_x,
                       copy_engines=copy_engines, router_logits_dtype=router_logits_dtype)
    if (max_tokens is not None or copy_engines is not None or keep_x or capacity or expert_rows
            or overlap or comm_sms):
        ep_only = [name for name, v in (
            ("max_tokens", max_tokens is not None), ("capacity", capacity),
            ("expert_rows", expert_rows), ("overlap", overlap), ("comm_sms", comm_sms),
            ("keep_x", keep_x), ("copy_engines", copy_engines is not None)) if v]
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "smoe.moe: %s: options of expert parallelism, which ep_group "
                             "turns on (ep_group is None)" % ", ".join(ep_only))
    routing_c = _enum(ROUTINGS, routing, "routing")
    if routing_c == L.SMOE_ROUTING_GENERAL:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "routing='general' takes (token, expert, score) triples: use "
                        "smoe.moe_general()")
    act = _enum(ACTIVATIONS, activation, "activation")
    layout = _enum(W1_LAYOUTS, w1_layout, "w1_layout")
    rounding = _enum(ROUNDINGS, token_rounding, "token_rounding")
    x, router_w, w1, w2, b1, b2 = _autocast(x.device, x, router_w, w1, w2, b1, b2)
    if x.dim() < 1:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE, "x must have a hidden dimension")
    d, n, E, b1, b2 = _check_experts(x, w1, w2, b1, b2, act)
    _check_tensor(router_w, "router_w", 2, x.device, x.dtype)
    _check_shape(router_w, "router_w", (E, d), "E = %d, d = %d from w1 and w2", E, d)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE,
                        "top_k = %r, must be an int in [1, E = %d]" % (top_k, E))
    if routing_c == L.SMOE_ROUTING_SIGMOID_TOPK or not (
            expert_bias is None and n_group == 0 and topk_group == 0 and routed_scaling == 1.0):
        n_group, topk_group, routed_scaling = check_sigmoid_options(
            routing_c, n_group, topk_group, routed_scaling, E, top_k,
            routing_name=_ROUTING_NAMES[routing_c])
        expert_bias = _check_expert_bias(expert_bias, routing_c, x, E)
        if routing_c == L.SMOE_ROUTING_SIGMOID_TOPK and rounding != L.SMOE_ROUND_OFF:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "token_rounding = %r with routing='sigmoid_topk': token rounding"
                                 " ranks tokens by softmax probabilities, which sigmoid routing "
                                 "has none of" % (token_rounding,))
    else:
        n_group, topk_group, routed_scaling = 0, 0, 1.0
    if router_logits_dtype in (None, torch.float32):
        lowp = 0
    elif router_logits_dtype == x.dtype:
        lowp = 1
    else:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "smoe.moe: router_logits_dtype = %s: None, torch.float32 or x's "
                             "dtype (%s)" % (router_logits_dtype, x.dtype))
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, d)
    save = not inference and _wants_grad(x2, router_w, w1, w2, b1, b2)
    config = [int(top_k), routing_c, int(bool(renormalize)), act, layout, rounding,
              int(round_tile), n_group, topk_group, int(bool(consume_saved)),
              int(bool(inference)), int(save), lowp]
    out, counts, logits = _run(x2, router_w, None, None, None, w1, w2, b1, b2, expert_bias,
                               config, routed_scaling, d, n, E)
    if flat:
        return out, counts, logits
    lead = x.shape[:-1]
    return out.view(*lead, d), counts, logits.view(*lead, E)


def moe_general(x, pair_token, pair_expert, pair_score, w1, w2, b1=None, b2=None, *,
                activation="swiglu", w1_layout="interleaved", inference=False, validate=None,
                consume_saved=False):
    """The MoE layer with the caller's routing: `pairs` triples (token,
    expert, score), sorted by token, each (token, expert) at most once, any
    number of experts per token (0..E).

    x (T, d); pair_token, pair_expert (pairs,) integer; pair_score (pairs,)
    float32 (differentiable); w1, w2, b1, b2 as in moe().
    Returns (out (T, d), expert_counts (E,) int32). Gradients reach x, w1,
    w2, b1, b2 and pair_score. consume_saved as in moe().

    Triples are checked (token in [0, T), expert in [0, E), sorted by token,
    no (token, expert) twice, finite scores). The CPU backend checks them
    before any work and raises at once. The GPU backends check them on the
    device without waiting for it: a call with a bad triple writes nothing
    (its outputs are left as allocated, not to be used) and its error is
    raised by the layer's next call (forward or backward), or at once in
    debug mode (smoe.set_debug(True) or $SMOE_DEBUG=1), or by
    smoe.check_device(), which waits for the device. validate=True checks
    them here first with a few torch operations that wait for the device
    (not inside CUDA graphs) and raises before the call; the default (None)
    leaves the checks to the library.
    """
    if not isinstance(x, torch.Tensor):
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "x must be a torch.Tensor")
    act = _enum(ACTIVATIONS, activation, "activation")
    layout = _enum(W1_LAYOUTS, w1_layout, "w1_layout")
    x, w1, w2, b1, b2 = _autocast(x.device, x, w1, w2, b1, b2)
    _check_tensor(x, "x", 2, x.device)
    d, n, E, b1, b2 = _check_experts(x, w1, w2, b1, b2, act)
    for name, t in (("pair_token", pair_token), ("pair_expert", pair_expert),
                    ("pair_score", pair_score)):
        _check_tensor(t, name, 1, x.device)
    pairs = pair_token.shape[0]
    if pair_expert.shape[0] != pairs or pair_score.shape[0] != pairs:
        raise SmoeError(L.SMOE_ERROR_INVALID_SIZE,
                        "pair_token, pair_expert, pair_score have %d, %d, %d entries"
                        % (pairs, pair_expert.shape[0], pair_score.shape[0]))
    if pair_token.dtype.is_floating_point or pair_expert.dtype.is_floating_point:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "pair_token and pair_expert must be integers")
    if pair_score.dtype != torch.float32:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE,
                        "pair_score has dtype %s, must be float32" % pair_score.dtype)
    pair_token = pair_token.to(torch.int32)
    pair_expert = pair_expert.to(torch.int32)
    if validate and pairs > 0:
        _validate_triples(pair_token, pair_expert, pair_score, x.shape[0], E)
    save = not inference and _wants_grad(x, pair_score, w1, w2, b1, b2)
    config = [0, L.SMOE_ROUTING_GENERAL, 0, act, layout, L.SMOE_ROUND_OFF, 128, 0, 0,
              int(bool(consume_saved)), int(bool(inference)), int(save), 0]
    out, counts, _ = _run(x, None, pair_token, pair_expert, pair_score, w1, w2, b1, b2, None,
                          config, 1.0, d, n, E)
    return out, counts


def _validate_triples(tok, exp, score, T, E):
    tok, exp = tok.long(), exp.long()

    def first(bad):
        i = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        return i

    i = first((tok < 0) | (tok >= T))
    if i >= 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "pair_token[%d] = %d, must be in [0, T = %d)"
                        % (i, int(tok[i]), T))
    i = first((exp < 0) | (exp >= E))
    if i >= 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "pair_expert[%d] = %d, must be in [0, E = %d)"
                        % (i, int(exp[i]), E))
    i = first(~torch.isfinite(score))
    if i >= 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "pair_score[%d] = %g is not finite"
                        % (i, float(score[i])))
    i = first(tok[1:] < tok[:-1])
    if i >= 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "pair_token[%d] = %d < pair_token[%d] = %d: "
                        "triples must be sorted by token" % (i + 1, int(tok[i + 1]), i, int(tok[i])))
    key = torch.sort(tok * E + exp).values
    i = first(key[1:] == key[:-1])
    if i >= 0:
        raise SmoeError(L.SMOE_ERROR_INVALID_VALUE, "(token %d, expert %d) is given twice"
                        % (int(key[i]) // E, int(key[i]) % E))


def layer_info(x_or_device, dtype=torch.bfloat16):
    """The backend and kernel path a device would run on, e.g. ('cpu', 'cpu (f32, ...)')."""
    device = x_or_device.device if isinstance(x_or_device, torch.Tensor) else torch.device(x_or_device)
    if isinstance(x_or_device, torch.Tensor):
        dtype = x_or_device.dtype
    cfg = (64, 64, 8, 2, L.SMOE_ACT_SWIGLU, L.SMOE_W1_INTERLEAVED, False,
           L.SMOE_ROUTING_TOPK_SOFTMAX, False, L.SMOE_ROUND_OFF, 128, _DTYPES[dtype], 0, 0, 1.0,
           False)
    layer = _get_layer(cfg, device)
    names = {v: k[len("SMOE_BACKEND_"):].lower() for k, v in L.ENUMS["smoe_backend"].items()}
    return names[layer.backend], layer.path_name
