"""ctypes mirror of include/smoe.h: every enum, struct and function.

Keep this file in step with the header: tests/test_lib.py parses smoe.h and
compiles a small C program that prints every struct's size and every field's
offset and every enum constant, and checks them against what is here.

The shared library is found, in order, at:
  1. $SMOE_LIBRARY (a path to libsmoe.so),
  2. next to this file (smoe/libsmoe.so, where `pip install` puts it),
  3. <repository root>/build/libsmoe.so (running from a source checkout).
"""
import ctypes
import os
import threading
from ctypes import (POINTER, Structure, c_char_p, c_double, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_void_p)

# ------------------------------------------------------------------ enums

SMOE_SUCCESS = 0
SMOE_ERROR_NULL_POINTER = 1
SMOE_ERROR_INVALID_SIZE = 2
SMOE_ERROR_INVALID_VALUE = 3
SMOE_ERROR_UNSUPPORTED = 4
SMOE_ERROR_NO_DEVICE = 5
SMOE_ERROR_OUT_OF_MEMORY = 6
SMOE_ERROR_BACKEND = 7
SMOE_ERROR_INTERNAL = 8

SMOE_DTYPE_F32 = 0
SMOE_DTYPE_BF16 = 1
SMOE_DTYPE_F64 = 2

SMOE_ACT_SWIGLU = 0
SMOE_ACT_GEGLU = 1
SMOE_ACT_REGLU = 2
SMOE_ACT_RELU2 = 3
SMOE_ACT_RELU = 4
SMOE_ACT_SILU = 5
SMOE_ACT_GELU = 6

SMOE_W1_INTERLEAVED = 0
SMOE_W1_CONCATENATED = 1

SMOE_ROUTING_TOPK_SOFTMAX = 0
SMOE_ROUTING_SOFTMAX_TOPK = 1
SMOE_ROUTING_GENERAL = 2
SMOE_ROUTING_SIGMOID_TOPK = 3

SMOE_ROUND_OFF = 0
SMOE_ROUND_UP = 1
SMOE_ROUND_DOWN = 2
SMOE_ROUND_NEAREST = 3

SMOE_BACKEND_AUTO = 0
SMOE_BACKEND_CPU = 1
SMOE_BACKEND_CUDA = 2
SMOE_BACKEND_SM90 = 3

SMOE_CALL_ANY = 0
SMOE_CALL_FORWARD = 1
SMOE_CALL_BACKWARD = 2

# Every enum of the header, by its C type name: {constant name: value}.
ENUMS = {
    "smoe_status": {
        "SMOE_SUCCESS": SMOE_SUCCESS,
        "SMOE_ERROR_NULL_POINTER": SMOE_ERROR_NULL_POINTER,
        "SMOE_ERROR_INVALID_SIZE": SMOE_ERROR_INVALID_SIZE,
        "SMOE_ERROR_INVALID_VALUE": SMOE_ERROR_INVALID_VALUE,
        "SMOE_ERROR_UNSUPPORTED": SMOE_ERROR_UNSUPPORTED,
        "SMOE_ERROR_NO_DEVICE": SMOE_ERROR_NO_DEVICE,
        "SMOE_ERROR_OUT_OF_MEMORY": SMOE_ERROR_OUT_OF_MEMORY,
        "SMOE_ERROR_BACKEND": SMOE_ERROR_BACKEND,
        "SMOE_ERROR_INTERNAL": SMOE_ERROR_INTERNAL,
    },
    "smoe_dtype": {
        "SMOE_DTYPE_F32": SMOE_DTYPE_F32,
        "SMOE_DTYPE_BF16": SMOE_DTYPE_BF16,
        "SMOE_DTYPE_F64": SMOE_DTYPE_F64,
    },
    "smoe_activation": {
        "SMOE_ACT_SWIGLU": SMOE_ACT_SWIGLU,
        "SMOE_ACT_GEGLU": SMOE_ACT_GEGLU,
        "SMOE_ACT_REGLU": SMOE_ACT_REGLU,
        "SMOE_ACT_RELU2": SMOE_ACT_RELU2,
        "SMOE_ACT_RELU": SMOE_ACT_RELU,
        "SMOE_ACT_SILU": SMOE_ACT_SILU,
        "SMOE_ACT_GELU": SMOE_ACT_GELU,
    },
    "smoe_w1_layout": {
        "SMOE_W1_INTERLEAVED": SMOE_W1_INTERLEAVED,
        "SMOE_W1_CONCATENATED": SMOE_W1_CONCATENATED,
    },
    "smoe_routing": {
        "SMOE_ROUTING_TOPK_SOFTMAX": SMOE_ROUTING_TOPK_SOFTMAX,
        "SMOE_ROUTING_SOFTMAX_TOPK": SMOE_ROUTING_SOFTMAX_TOPK,
        "SMOE_ROUTING_GENERAL": SMOE_ROUTING_GENERAL,
        "SMOE_ROUTING_SIGMOID_TOPK": SMOE_ROUTING_SIGMOID_TOPK,
    },
    "smoe_rounding": {
        "SMOE_ROUND_OFF": SMOE_ROUND_OFF,
        "SMOE_ROUND_UP": SMOE_ROUND_UP,
        "SMOE_ROUND_DOWN": SMOE_ROUND_DOWN,
        "SMOE_ROUND_NEAREST": SMOE_ROUND_NEAREST,
    },
    "smoe_backend": {
        "SMOE_BACKEND_AUTO": SMOE_BACKEND_AUTO,
        "SMOE_BACKEND_CPU": SMOE_BACKEND_CPU,
        "SMOE_BACKEND_CUDA": SMOE_BACKEND_CUDA,
        "SMOE_BACKEND_SM90": SMOE_BACKEND_SM90,
    },
    "smoe_call": {
        "SMOE_CALL_ANY": SMOE_CALL_ANY,
        "SMOE_CALL_FORWARD": SMOE_CALL_FORWARD,
        "SMOE_CALL_BACKWARD": SMOE_CALL_BACKWARD,
    },
}

# C enums are int-sized with these values (gcc, clang, MSVC).
c_enum = c_int

# ---------------------------------------------------------------- structs


class smoe_layer_desc(Structure):
    _fields_ = [
        ("d", c_int64),
        ("n", c_int64),
        ("E", c_int64),
        ("K", c_int64),
        ("activation", c_enum),
        ("w1_layout", c_enum),
        ("has_bias", c_int),
        ("routing", c_enum),
        ("renormalize", c_int),
        ("rounding", c_enum),
        ("round_tile", c_int64),
        ("n_group", c_int64),
        ("topk_group", c_int64),
        ("routed_scaling", c_double),
        ("dtype", c_enum),
        ("backend", c_enum),
        ("device", c_int),
        ("consume_saved", c_int),  # smoe.h: the backward writes dH over the saved H
    ]


class smoe_forward_args(Structure):
    _fields_ = [
        ("T", c_int64),
        ("x", c_void_p),
        ("router_w", c_void_p),
        ("pairs", c_int64),
        ("pair_token", POINTER(c_int32)),
        ("pair_expert", POINTER(c_int32)),
        ("pair_score", POINTER(c_float)),
        ("w1", c_void_p),
        ("b1", c_void_p),
        ("w2", c_void_p),
        ("b2", c_void_p),
        ("out", c_void_p),
        ("router_logits", c_void_p),
        ("expert_counts", POINTER(c_int32)),
        ("inference", c_int),
        ("expert_bias", POINTER(c_float)),
        ("router_logits_dtype", c_enum),
    ]


class smoe_grad(Structure):
    _fields_ = [
        ("ptr", c_void_p),
        ("dtype", c_enum),
        ("accumulate", c_int),
    ]


class smoe_backward_args(Structure):
    _fields_ = [
        ("T", c_int64),
        ("x", c_void_p),
        ("router_w", c_void_p),
        ("pairs", c_int64),
        ("w1", c_void_p),
        ("w2", c_void_p),
        ("b2", c_void_p),
        ("dout", c_void_p),
        ("dlogits_extra", c_void_p),
        ("dx", smoe_grad),
        ("drouter_w", smoe_grad),
        ("dw1", smoe_grad),
        ("db1", smoe_grad),
        ("dw2", smoe_grad),
        ("db2", smoe_grad),
        ("dpair_score", smoe_grad),
        ("dlogits_extra_dtype", c_enum),
    ]


class smoe_routing_result(Structure):
    _fields_ = [
        ("expert", POINTER(c_int32)),
        ("score", POINTER(c_float)),
        ("cap", c_int64),
        ("pair_token", POINTER(c_int32)),
        ("pair_expert", POINTER(c_int32)),
        ("pair_score", POINTER(c_float)),
        ("pairs", POINTER(c_int64)),
    ]


class smoe_ep_desc(Structure):
    _fields_ = [
        ("layer", smoe_layer_desc),
        ("rank", c_int),
        ("nranks", c_int),
        ("group", c_void_p),
        ("nccl_comm", c_void_p),
        ("max_tokens", c_int64),
        ("capacity", c_int64),
        ("expert_rows", c_int64),
        ("overlap", c_int),
        ("comm_sms", c_int),
        ("keep_x", c_int),
        ("copy_engines", c_int),
    ]


# The same two argument structs with every pointer as a plain c_void_p (and
# smoe_backward_args' smoe_grad members spelled out field by field), for the
# calls smoe.functional makes on every forward and backward: such a struct
# is filled in one constructor call from data_ptr() integers, with no
# ctypes.cast per pointer. Same sizes and offsets as the mirrors above
# (tests/test_lib.py checks them), so the library reads the same bytes.


def _raw(ctype):
    """An integer field as it is; a pointer as c_void_p."""
    return ctype if ctype in (c_int64, c_int) else c_void_p


class forward_args_raw(Structure):
    _fields_ = [(name, _raw(ctype)) for name, ctype in smoe_forward_args._fields_]


def _flattened(fields):
    """fields with each smoe_grad member replaced by its own fields, named
    <member>_<field>."""
    out = []
    for name, ctype in fields:
        if ctype is smoe_grad:
            out += [(name + "_" + f, _raw(t)) for f, t in smoe_grad._fields_]
        else:
            out.append((name, _raw(ctype)))
    return out


class backward_args_raw(Structure):
    _fields_ = _flattened(smoe_backward_args._fields_)


# Every struct of the header, by its C type name.
STRUCTS = {
    "smoe_layer_desc": smoe_layer_desc,
    "smoe_forward_args": smoe_forward_args,
    "smoe_grad": smoe_grad,
    "smoe_backward_args": smoe_backward_args,
    "smoe_routing_result": smoe_routing_result,
    "smoe_ep_desc": smoe_ep_desc,
}

# -------------------------------------------------------------- functions

# name: (restype, argtypes)
_FUNCTIONS = {
    "smoe_status_string": (c_char_p, [c_enum]),
    "smoe_last_error": (c_char_p, []),
    "smoe_version_string": (c_char_p, []),
    "smoe_layer_desc_default": (smoe_layer_desc, []),
    "smoe_layer_create": (c_enum, [POINTER(smoe_layer_desc), POINTER(c_void_p)]),
    "smoe_layer_free": (None, [c_void_p]),
    "smoe_layer_backend": (c_enum, [c_void_p]),
    "smoe_layer_path_name": (c_char_p, [c_void_p]),
    "smoe_layer_get_desc": (smoe_layer_desc, [c_void_p]),
    "smoe_layer_workspace_bytes": (c_size_t, [c_void_p, c_int64, c_int64]),
    # (layer, call, T, pairs); call: SMOE_CALL_*
    "smoe_layer_call_workspace_bytes": (c_size_t, [c_void_p, c_enum, c_int64, c_int64]),
    "smoe_layer_saved_bytes": (c_size_t, [c_void_p, c_int64, c_int64]),
    # (layer, args): reads args.T, args.pairs and args.dw1 only
    "smoe_layer_backward_workspace_bytes": (c_size_t, [c_void_p, POINTER(smoe_backward_args)]),
    # (layer, T, pairs, offset out): the consume_saved block's router slot
    "smoe_layer_drouter_slot": (c_enum, [c_void_p, c_int64, c_int64, POINTER(c_size_t)]),
    # (layer, args, saved, saved_bytes, workspace, workspace_bytes, stream)
    "smoe_layer_forward": (c_enum, [c_void_p, POINTER(smoe_forward_args), c_void_p, c_size_t,
                                    c_void_p, c_size_t, c_void_p]),
    "smoe_layer_backward": (c_enum, [c_void_p, POINTER(smoe_backward_args), c_void_p, c_size_t,
                                     c_void_p, c_size_t, c_void_p]),
    # (layer, stream, wait)
    "smoe_layer_device_status": (c_enum, [c_void_p, c_void_p, c_int]),
    "smoe_route_cpu": (c_enum, [POINTER(smoe_layer_desc), c_int64, POINTER(c_float),
                                POINTER(smoe_routing_result)]),
    "smoe_route_cpu_biased": (c_enum, [POINTER(smoe_layer_desc), c_int64, POINTER(c_float),
                                       POINTER(c_float), POINTER(smoe_routing_result)]),
    # expert parallelism (smoe.EPGroup over NCCL; the in-process group
    # is EPGroup.in_process's)
    "smoe_ep_group_create": (c_enum, [c_int, POINTER(c_void_p)]),
    "smoe_ep_group_free": (None, [c_void_p]),
    "smoe_ep_desc_default": (smoe_ep_desc, []),
    "smoe_ep_layer_create": (c_enum, [POINTER(smoe_ep_desc), POINTER(c_void_p)]),
    "smoe_ep_layer_free": (None, [c_void_p]),
    "smoe_ep_layer_workspace_bytes": (c_size_t, [c_void_p, c_int64]),
    "smoe_ep_layer_saved_bytes": (c_size_t, [c_void_p, c_int64]),
    "smoe_ep_layer_forward": (c_enum, [c_void_p, POINTER(smoe_forward_args), c_void_p, c_size_t,
                                       c_void_p, c_size_t, c_void_p]),
    "smoe_ep_layer_backward": (c_enum, [c_void_p, POINTER(smoe_backward_args), c_void_p,
                                        c_size_t, c_void_p, c_size_t, c_void_p]),
    "smoe_ep_layer_path_name": (c_char_p, [c_void_p]),
    "smoe_ep_layer_device_status": (c_enum, [c_void_p, c_void_p, c_int]),
}
FUNCTION_NAMES = tuple(_FUNCTIONS)

# The header's version macros this mirror was written for.
VERSION = (0, 4, 0)

# ------------------------------------------------------------------ loading


class SmoeError(RuntimeError):
    """A call into smoe failed. `status` is the smoe_status code (an int),
    `status_name` its name, and the message is smoe_last_error() (or, for
    checks done in Python before any call, a message of the same kind)."""

    def __init__(self, status, message):
        self.status = int(status)
        self.status_name = _STATUS_NAMES.get(self.status, "SMOE_STATUS_%d" % self.status)
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message))


_STATUS_NAMES = {v: k for k, v in ENUMS["smoe_status"].items()}


def _candidate_paths():
    env = os.environ.get("SMOE_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "libsmoe.so"),
        os.path.join(os.path.dirname(os.path.dirname(here)), "build", "libsmoe.so"),
    ]


_lib = None
_lib_lock = threading.Lock()


def library_path():
    """The path of the libsmoe.so this package loads (or would load)."""
    for p in _candidate_paths():
        if os.path.exists(p):
            return p
    return None


def lib():
    """The loaded libsmoe (ctypes.CDLL) with every function's signature set."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if path is None:
            raise ImportError(
                "smoe: libsmoe.so not found (looked at %s). Build it with `make lib` "
                "in the repository, or set SMOE_LIBRARY." % ", ".join(_candidate_paths()))
        handle = ctypes.CDLL(path)
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = handle.smoe_version_string().decode()
        major_minor = tuple(int(v) for v in version.split(".")[:2])
        if major_minor != VERSION[:2]:
            raise ImportError("smoe: %s is version %s, this Python package mirrors %d.%d"
                              % (path, version, VERSION[0], VERSION[1]))
        # Second function objects for forward and backward taking the raw
        # structs above (a CDLL item is a new function object each time).
        global forward_raw, backward_raw
        forward_raw = handle["smoe_layer_forward"]
        forward_raw.restype = c_enum
        forward_raw.argtypes = [c_void_p, POINTER(forward_args_raw), c_void_p, c_size_t,
                                c_void_p, c_size_t, c_void_p]
        backward_raw = handle["smoe_layer_backward"]
        backward_raw.restype = c_enum
        backward_raw.argtypes = [c_void_p, POINTER(backward_args_raw), c_void_p, c_size_t,
                                 c_void_p, c_size_t, c_void_p]
        _lib = handle
        return _lib


# smoe_layer_forward / smoe_layer_backward taking forward_args_raw /
# backward_args_raw; set by lib().
forward_raw = None
backward_raw = None


def release(obj, attr, free):
    """For __del__: takes obj.attr (a ctypes handle), sets it to None and
    passes it to free(handle) if it is set; errors are ignored (at
    interpreter shutdown the library or its module may be gone)."""
    handle = getattr(obj, attr, None)
    setattr(obj, attr, None)
    if handle is not None and handle.value:
        try:
            free(handle)
        except Exception:
            pass


def last_error():
    return lib().smoe_last_error().decode(errors="replace")


def status_string(status):
    return lib().smoe_status_string(status).decode(errors="replace")


def check(status):
    """Raises SmoeError with smoe_last_error() unless status is SMOE_SUCCESS."""
    if status != SMOE_SUCCESS:
        raise SmoeError(status, last_error() or status_string(status))


def version():
    return lib().smoe_version_string().decode()
