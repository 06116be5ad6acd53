"""The two ways a call runs: plain eager calls skip PyTorch's dispatcher
(smoe.functional._direct), every other call goes through the custom
operators. Both must compute the same bits (outputs, counts, logits, every
gradient), the eager way must really be taken in plain eager code, and the
operators wherever the eager way would be wrong (dispatch modes, fake and
meta tensors, torch.compile, double backward)."""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import smoe
from smoe import functional as fn
from test_functional import general_triples, leaves, make


@pytest.fixture
def operators_only(monkeypatch):
    monkeypatch.setattr(fn, "_EAGER", False)


def run(eager, tensors, loss, monkeypatch, general=None, **kw):
    """smoe.moe (or smoe.moe_general with `general` triples) on leaf copies
    of `tensors`, backward of loss(out, logits); returns (out, counts,
    logits, grads, name of out's grad_fn)."""
    monkeypatch.setattr(fn, "_EAGER", eager)
    ins = leaves(*tensors)
    if general is None:
        out, counts, logits = smoe.moe(*ins, **kw)
    else:
        x, _, w1, w2, b1, b2 = ins
        tok, exp, score = general
        score = score.detach().clone().requires_grad_()
        ins = [x, score, w1, w2, b1, b2]
        out, counts = smoe.moe_general(x, tok, exp, score, w1, w2, b1, b2, **kw)
        logits = None
    name = type(out.grad_fn).__name__
    l = loss(out, logits)
    if l is not None:
        l.backward()
    return out.detach(), counts, None if logits is None else logits.detach(), \
        [None if t is None else t.grad for t in ins], name


def assert_same(a, b):
    for u, v in zip(a[:3], b[:3]):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.equal(u, v)
    for u, v in zip(a[3], b[3]):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.equal(u, v)


def both(monkeypatch, tensors, loss, **kw):
    eager = run(True, tensors, loss, monkeypatch, **kw)
    op = run(False, tensors, loss, monkeypatch, **kw)
    assert eager[4] == "_MoeFunctionBackward", eager[4]
    assert op[4].startswith("GeneratedBackwardFor_smoe_moe_forward"), op[4]
    assert_same(eager, op)
    return eager


def full_loss(T, d, E):
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(T, d, generator=g, dtype=torch.float64)
    dlog = torch.randn(T, E, generator=g, dtype=torch.float64).float()

    def loss(out, logits):
        total = (out.double() * dout).sum()
        if logits is not None:
            total = total + (logits * dlog).sum()
        return total

    return loss


@pytest.mark.parametrize("routing,rounding", [("topk_softmax", None), ("softmax_topk", None),
                                              ("softmax_topk", "up"), ("topk_softmax", "down"),
                                              ("topk_softmax", "nearest")])
@pytest.mark.parametrize("bias,dtype", [(False, torch.float64), (True, torch.float32),
                                        (True, torch.bfloat16)])
def test_eager_and_operator_agree(monkeypatch, routing, rounding, bias, dtype):
    t = make(T=11, d=8, n=4, E=5, act="swiglu", bias=bias, seed=41, dtype=dtype)
    both(monkeypatch, t, full_loss(11, 8, 5), top_k=2, routing=routing, token_rounding=rounding,
         round_tile=2)


@pytest.mark.parametrize("which", ["out", "logits"])
def test_one_output_used(monkeypatch, which):
    # The eager way leaves an unused output's gradient None (the operator's
    # autograd fills it with zeros): the same gradients either way.
    t = make(T=7, d=8, n=4, E=4, act="geglu", bias=True, seed=42)

    def loss(out, logits):
        return (out * out).sum() if which == "out" else (logits * logits).sum()

    both(monkeypatch, t, loss, top_k=2, activation="geglu", routing="softmax_topk")


def test_general_eager_and_operator_agree(monkeypatch):
    t = make(T=6, d=8, n=4, E=3, act="relu", bias=True, seed=43)
    triples = general_triples(6, 3, seed=4, p=0.6)
    both(monkeypatch, t, full_loss(6, 8, 3), general=triples, activation="relu")


def test_leading_dims_and_non_contiguous(monkeypatch):
    x, r, w1, w2, b1, b2 = make(T=12, d=8, n=4, E=4, act="swiglu", bias=False, seed=44)
    x3 = x.t().contiguous().t().reshape(3, 4, 8)          # not contiguous as (T, d) either
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    res = []
    for eager in (True, False):
        monkeypatch.setattr(fn, "_EAGER", eager)
        ins = leaves(x3, r, w1t, w2)
        out, counts, logits = smoe.moe(*ins, top_k=2)
        assert out.shape == (3, 4, 8) and logits.shape == (3, 4, 4)
        (out.sum() + logits.sum()).backward()
        res.append((out.detach(), counts, logits.detach(), [t.grad for t in ins]))
    assert_same(*res)


@pytest.mark.parametrize("inference", [False, True])
def test_no_grad_and_inference(monkeypatch, inference):
    x, r, w1, w2, _, _ = make(T=9, d=8, n=4, E=4, act="swiglu", bias=False, seed=45)
    res = []
    for eager in (True, False):
        monkeypatch.setattr(fn, "_EAGER", eager)
        with torch.no_grad():
            out, counts, logits = smoe.moe(x, r, w1, w2, top_k=2, inference=inference,
                                           token_rounding="up", round_tile=4)
        assert out.grad_fn is None and not out.requires_grad
        res.append((out, counts, logits, []))
    assert_same(*res)


def test_backward_after_inference_either_way(monkeypatch):
    for eager in (True, False):
        monkeypatch.setattr(fn, "_EAGER", eager)
        x, r, w1, w2 = leaves(*make(T=5, d=8, n=4, E=4, act="swiglu", bias=False, seed=46)[:4])
        out, _, _ = smoe.moe(x, r, w1, w2, top_k=2, inference=True)
        with pytest.raises(smoe.SmoeError, match="inference=True"):
            out.sum().backward()


def test_only_some_inputs_want_gradients(monkeypatch):
    x, r, w1, w2, b1, b2 = make(T=8, d=8, n=4, E=4, act="swiglu", bias=True, seed=47)
    loss = full_loss(8, 8, 4)
    for wanted in itertools.combinations(range(6), 2):
        res = []
        for eager in (True, False):
            monkeypatch.setattr(fn, "_EAGER", eager)
            ins = [t.detach().clone().requires_grad_(i in wanted)
                   for i, t in enumerate((x, r, w1, w2, b1, b2))]
            out, counts, logits = smoe.moe(*ins, top_k=2)
            loss(out, logits).backward()
            res.append((out.detach(), counts, logits.detach(), [t.grad for t in ins]))
        assert all((g is not None) == (i in wanted) for i, g in enumerate(res[0][3]))
        assert_same(*res)


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_the_operators():
    x, r, w1, w2 = leaves(*make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=48)[:4])
    ref_out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    with _Record() as rec:
        out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
        out.sum().backward()
    assert "smoe.moe_forward.default" in rec.ops and "smoe.moe_backward.default" in rec.ops
    assert torch.equal(out.detach(), ref_out.detach())


def test_fake_and_meta_tensors_go_through_the_operators():
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=49)[:4]
    with FakeTensorMode() as mode:
        out, counts, logits = smoe.moe(*(mode.from_tensor(v) for v in t), top_k=2)
        assert (out.shape, counts.shape, logits.shape) == ((6, 8), (4,), (6, 4))
    out, counts, logits = smoe.moe(*(v.to("meta") for v in t), top_k=2)
    assert out.is_meta and (out.shape, counts.shape, logits.shape) == ((6, 8), (4,), (6, 4))


def test_double_backward_goes_through_the_operator():
    # create_graph=True: the backward runs as the operator (the gradient is
    # right; differentiating it again is not supported, either way).
    t = make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=50)[:4]
    x, r, w1, w2 = leaves(*t)
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert "smoe_moe_backward" in type(g.grad_fn).__name__
    x2, r2, w12, w22 = leaves(*t)
    out, _, _ = smoe.moe(x2, r2, w12, w22, top_k=2)
    out.sum().backward()
    assert torch.equal(g.detach(), x2.grad)


def test_operators_only_flag_runs_everything(operators_only):
    x, r, w1, w2 = leaves(*make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=51)[:4])
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor_smoe_moe_forward")


def test_sizes_asked_once_per_token_count(monkeypatch):
    from smoe import _lib as L
    t = make(T=9, d=8, n=4, E=4, act="swiglu", bias=False, seed=52)[:4]
    cfg = (8, 4, 4, 2, L.SMOE_ACT_SWIGLU, L.SMOE_W1_INTERLEAVED, False,
           L.SMOE_ROUTING_SOFTMAX_TOPK, True, L.SMOE_ROUND_OFF, 128, L.SMOE_DTYPE_F64, 0, 0, 1.0, False)
    layer = fn._get_layer(cfg, torch.device("cpu"))
    layer._ws.clear()
    layer._saved.clear()
    asked = []
    for name in ("workspace_bytes", "saved_bytes"):
        real = getattr(layer, name)
        monkeypatch.setattr(layer, name, lambda T, p, *c, _r=real, _n=name:
                            asked.append((_n, T)) or _r(T, p, *c))
    for T in (9, 9, 4, 9, 4):
        x, r, w1, w2 = leaves(t[0][:T], *t[1:])
        out, _, _ = smoe.moe(x, r, w1, w2, top_k=2, routing="softmax_topk")
        out.sum().backward()
    # the workspace once per token count and call (forward, backward)
    assert sorted(asked) == [("saved_bytes", 4), ("saved_bytes", 9), ("workspace_bytes", 4),
                             ("workspace_bytes", 4), ("workspace_bytes", 9),
                             ("workspace_bytes", 9)]
    F, B = L.SMOE_CALL_FORWARD, L.SMOE_CALL_BACKWARD
    # (the backward writes dW1: its own size, with A' allowed in dW1's buffer)
    assert layer._ws == {(T, 0, c, c == B): layer.workspace_bytes(T, 0, c, c == B)
                         for T in (4, 9) for c in (F, B)}
    assert layer._saved == {(9, 0): layer.saved_bytes(9, 0), (4, 0): layer.saved_bytes(4, 0)}


class _Buffer:
    """A stand-in for the saved block or workspace tensor."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.nbytes


def test_cuda_call_glue(monkeypatch):
    # The CUDA branch of _call (run here without a GPU, on stand-ins): the
    # tensors' device is made current for the call and restored after, even
    # when the call fails; the library gets that device's current stream and
    # the buffers' sizes; the layer's device status is polled (wait=0) before
    # the call, and read with wait=1 after it in debug mode.
    events = []
    monkeypatch.setattr(fn, "_exchange_device", lambda i: events.append(("set", i)) or 0)
    monkeypatch.setattr(fn, "_maybe_exchange_device", lambda i: events.append(("restore", i)))
    monkeypatch.setattr(fn, "_raw_stream", lambda i: 0x5000 + i)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(fn, "_DEBUG", False)
    device_status = {0: fn.L.SMOE_SUCCESS, 1: fn.L.SMOE_SUCCESS}   # by wait

    class Lib:
        @staticmethod
        def smoe_layer_device_status(ptr, stream, wait):
            events.append(("status", ptr, stream, wait))
            return device_status[wait]

    class Layer:
        ptr = 1234
        _lib = Lib

    def library(status):
        def call(ptr, args, saved, saved_bytes, ws, ws_bytes, stream):
            events.append(("call", ptr, saved, saved_bytes, ws, ws_bytes, stream))
            return status
        return call

    args = fn.L.forward_args_raw()
    saved, ws = _Buffer(7, 700), _Buffer(8, 800)
    fn._call(library(0), Layer, args, saved, ws, torch.device("cuda", 3))
    assert events == [("set", 3), ("status", 1234, 0x5003, 0),
                      ("call", 1234, 7, 700, 8, 800, 0x5003), ("restore", 0)]
    events.clear()
    with pytest.raises(smoe.SmoeError):
        fn._call(library(fn.L.SMOE_ERROR_BACKEND), Layer, args, None, ws,
                 torch.device("cuda", 1))
    assert events == [("set", 1), ("status", 1234, 0x5001, 0),
                      ("call", 1234, None, 0, 8, 800, 0x5001), ("restore", 0)]
    # An earlier call's device error: raised before this call, which is not made.
    events.clear()
    device_status[0] = fn.L.SMOE_ERROR_INVALID_VALUE
    with pytest.raises(smoe.SmoeError, match="earlier call of this layer") as e:
        fn._call(library(0), Layer, args, saved, ws, torch.device("cuda", 2))
    assert e.value.status == fn.L.SMOE_ERROR_INVALID_VALUE
    assert events == [("set", 2), ("status", 1234, 0x5002, 0), ("restore", 0)]
    # Debug mode: after the call, wait=1 on its stream, and its error raised.
    device_status[0] = fn.L.SMOE_SUCCESS
    smoe.set_debug(True)
    events.clear()
    fn._call(library(0), Layer, args, saved, ws, torch.device("cuda", 0))
    assert events == [("set", 0), ("status", 1234, 0x5000, 0),
                      ("call", 1234, 7, 700, 8, 800, 0x5000), ("status", 1234, 0x5000, 1),
                      ("restore", 0)]
    device_status[1] = fn.L.SMOE_ERROR_INVALID_VALUE
    with pytest.raises(smoe.SmoeError) as e:
        fn._call(library(0), Layer, args, saved, ws, torch.device("cuda", 0))
    assert e.value.status == fn.L.SMOE_ERROR_INVALID_VALUE
    # ... but not while the stream is being captured into a CUDA graph.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    events.clear()
    fn._call(library(0), Layer, args, saved, ws, torch.device("cuda", 0))
    assert [ev[0] for ev in events] == ["set", "status", "call", "restore"]
    smoe.set_debug(False)
    # The CPU branch: no status calls, stream NULL.
    events.clear()
    fn._call(library(0), Layer, args, saved, ws, torch.device("cpu"))
    assert events == [("call", 1234, 7, 700, 8, 800, None)]
