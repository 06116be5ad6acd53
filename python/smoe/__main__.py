"""`python -m smoe`: what this installation would run here.

Prints the package and library versions, the library's path and whether it
was built with the CUDA backends, the CUDA device (or "no CUDA device"),
and for each kind of tensor that can run here the backend and kernel path a
layer gets (for d and n multiples of 64; the Hopper kernels need that).
Exit status 1 when the library cannot be loaded.
"""
import sys


def _gpu_build(L, F):
    """Whether the library has the CUDA backends and the Hopper kernels,
    from what smoe_layer_create says when asked for each: (cuda, sm90)."""
    cfg = (64, 64, 8, 2, L.SMOE_ACT_SWIGLU, L.SMOE_W1_INTERLEAVED, False,
           L.SMOE_ROUTING_TOPK_SOFTMAX, True, L.SMOE_ROUND_OFF, 128, L.SMOE_DTYPE_BF16, 0, 0, 1.0,
           False)
    built = []
    for backend in (L.SMOE_BACKEND_CUDA, L.SMOE_BACKEND_SM90):
        try:
            F._Layer(F._make_desc(cfg, backend, 0))
            built.append(True)
        except F.SmoeError as e:
            built.append("built without" not in e.message)
    return tuple(built)


def report():
    """The lines `python -m smoe` prints; raises ImportError without a library."""
    import torch

    from . import __version__
    from . import _lib as L
    from . import functional as F

    lib_version = L.version()   # loads the library (ImportError if missing)
    lines = ["smoe %s (library %s)" % (__version__, lib_version),
             "library: %s" % L.library_path()]
    cuda, sm90 = _gpu_build(L, F)
    if cuda:
        lines.append("built with: CPU and CUDA backends (%s)"
                     % ("Hopper sm_90a kernels too" if sm90 else "portable kernels only, "
                        "no sm_90a"))
    else:
        lines.append("built with: the CPU backend only (no nvcc at build time, or SMOE_CUDA=0)")
    torch_cuda = torch.version.cuda
    lines.append("torch: %s (%s)" % (torch.__version__,
                                    "CUDA %s" % torch_cuda if torch_cuda else "CPU build"))
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        lines.append("device: cuda:%d %s (sm_%d%d), %d visible"
                     % (index, torch.cuda.get_device_name(index), major, minor,
                        torch.cuda.device_count()))
        try:
            backend, path = F.layer_info("cuda:%d" % index, torch.bfloat16)
            lines.append("CUDA bfloat16 tensors: backend %s, path %s" % (backend, path))
        except F.SmoeError as e:
            lines.append("CUDA bfloat16 tensors: cannot run (%s)" % e)
    else:
        lines.append("device: no CUDA device%s" % (
            " (the library has the CUDA backends; torch sees no GPU)" if cuda else ""))
    for dtype in (torch.float32, torch.bfloat16):
        backend, path = F.layer_info("cpu", dtype)
        lines.append("CPU %s tensors: backend %s, path %s"
                     % (str(dtype).replace("torch.", ""), backend, path))
    return lines


def main():
    try:
        lines = report()
    except ImportError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
