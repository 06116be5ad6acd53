"""consume_saved=True (smoe.h's desc.consume_saved: the backward writes dH
over the saved block's H): the same gradients, bit for bit, as the reading
backward; one backward per graph, a second one (retain_graph=True) raising
autograd's in-place error; torch.compile; smoe.MoE's option. On the CPU,
and in bf16 on CUDA (every GPU backend: AUTO's, cuda, sm90) where there is
a GPU."""
import pytest
import torch

import smoe
from smoe import functional as fn
from test_functional import assert_close, leaves, make

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def inputs(device, T, act="swiglu", bias=True, seed=0, dtype=torch.float64, E=4):
    """make()'s tensors for the tests that run on both devices: on the CPU
    as given (d=8, n=4); on CUDA in bf16 with d = n = 64 (the GPU backends
    need multiples of 8, the Hopper kernels of 64)."""
    if device == "cpu":
        return make(T=T, d=8, n=4, E=E, act=act, bias=bias, dtype=dtype, seed=seed)
    t = make(T=T, d=64, n=64, E=E, act=act, bias=bias, dtype=torch.bfloat16, seed=seed)
    return [None if v is None else v.to(device) for v in t]

# (routing, activation, bias, extra moe() options)
CASES = [
    ("topk_softmax", "swiglu", False, {}),
    ("softmax_topk", "geglu", True, {}),
    ("softmax_topk", "relu2", False, {"token_rounding": "up", "round_tile": 4}),
    ("topk_softmax", "gelu", True, {"w1_layout": "concatenated"}),
    ("sigmoid_topk", "swiglu", True, {"n_group": 4, "topk_group": 2, "routed_scaling": 2.5,
                                      "expert_bias": "randn"}),
    ("sigmoid_topk", "silu", False, {}),
]
E = 8


def grads(tensors, consume, dout_seed, retain=False, **kw):
    """out, logits and every input's gradient of smoe.moe(consume_saved=consume)
    under a random linear loss of out and router_logits."""
    ins = leaves(*tensors)
    x, r, w1, w2, b1, b2 = ins
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=3, consume_saved=consume, **kw)
    g = torch.Generator(device=x.device).manual_seed(dout_seed)
    dout = torch.randn(out.shape, generator=g, device=x.device).to(out.dtype)
    dlog = torch.randn(logits.shape, generator=g, device=x.device)
    loss = (out * dout).sum() + (logits * dlog).sum()
    loss.backward(retain_graph=retain)
    return [out.detach(), logits.detach()] + [t.grad for t in ins if t is not None], loss


def _options(kw, device):
    kw = dict(kw)
    if kw.get("expert_bias") == "randn":
        kw["expert_bias"] = torch.randn(E, generator=torch.Generator().manual_seed(9)).to(device)
    return kw


def check_equal(device, dtype, routing, act, bias, extra, seed, T=37, d=16, n=12):
    t = make(T=T, d=d, n=n, E=E, act=act, bias=bias, dtype=dtype, seed=seed)
    t = [None if v is None else v.to(device) for v in t]
    kw = _options(extra, device)
    want, _ = grads(t, False, seed, routing=routing, activation=act, **kw)
    got, _ = grads(t, True, seed, routing=routing, activation=act, **kw)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), "output/gradient %d differs with consume_saved" % i


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("eager", [True, False])
def test_gradients_bitwise_equal(case, dtype, eager, monkeypatch):
    # eager=False sends every call through the custom operators.
    monkeypatch.setattr(fn, "_EAGER", eager)
    check_equal(torch.device("cpu"), dtype, *CASES[case], seed=40 + case)


# The GPU's shapes: d and n multiples of 64 (the Hopper kernels run them;
# the CUDA backends need multiples of 8), R = T K = 450 rows, not a multiple
# of the 128-row tiles; n = 256 takes dh's 256-wide Hopper tiles (the
# TMA-store epilogue where gated), n = 64 the 128-wide ones.
CUDA_SHAPES = [dict(T=150, d=128, n=64), dict(T=150, d=128, n=256)]


@cuda
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("backend", ["", "cuda", "sm90"])
@pytest.mark.parametrize("shape", range(len(CUDA_SHAPES)))
@pytest.mark.parametrize("eager", [True, False])
def test_gradients_bitwise_equal_cuda(case, backend, shape, eager, monkeypatch):
    # The same kernels on both sides; only the dh GEMM's output lies
    # elsewhere (over H), so bf16 gradients are expected bit-identical.
    if backend == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 backend needs an sm_90 GPU")
    monkeypatch.setenv("SMOE_TORCH_BACKEND", backend)
    monkeypatch.setattr(fn, "_EAGER", eager)
    check_equal(torch.device("cuda"), torch.bfloat16, *CASES[case], seed=60 + case,
                **CUDA_SHAPES[shape])


@pytest.mark.parametrize("device", DEVICES)
def test_general_routing(device):
    t = inputs(device, T=10, bias=True, seed=3)
    tok = torch.tensor([0, 0, 1, 3, 3, 3, 7, 9], device=device)
    exp = torch.tensor([1, 2, 0, 0, 1, 3, 2, 2], device=device)
    score = torch.rand(8, generator=torch.Generator().manual_seed(4)).to(device)
    res = []
    for consume in (False, True):
        x, w1, w2, b1, b2, s = leaves(t[0], t[2], t[3], t[4], t[5], score)
        out, _ = smoe.moe_general(x, tok, exp, s, w1, w2, b1, b2, consume_saved=consume)
        out.square().sum().backward()
        res.append([out.detach(), x.grad, w1.grad, w2.grad, b1.grad, b2.grad, s.grad])
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_the_layer_is_a_consuming_one():
    t = make(T=5, d=8, n=4, E=4, act="swiglu", bias=False, seed=5)
    x, r, w1, w2 = leaves(*t[:4])
    smoe.moe(x, r, w1, w2, top_k=2, consume_saved=True)[0].sum().backward()
    layers = [(k, v) for k, v in fn._layers.items() if k[0][:4] == (8, 4, 4, 2)]
    flags = {v.consume_saved for k, v in layers}
    assert True in flags
    for k, v in layers:
        assert v.desc.consume_saved == int(v.consume_saved) == int(k[0][-1])


@pytest.mark.parametrize("device", DEVICES)
def test_router_gradient_in_the_saved_block(device, monkeypatch):
    # A consuming layer's backward writes the router weight's gradient into
    # its saved block's router slot (smoe_layer_drouter_slot) and copies it
    # out after freeing the workspace; the gradients stay bit for bit those
    # of the reading backward, which has no slot (a separate buffer).
    seen = []
    real = fn._Layer.drouter_slot

    def spy(self, T, pairs):
        off = real(self, T, pairs)
        seen.append(off)
        return off

    monkeypatch.setattr(fn._Layer, "drouter_slot", spy)
    dev = torch.device(device)
    T, d, n, dtype = (37, 16, 12, torch.float32) if device == "cpu" else \
        (256, 128, 128, torch.bfloat16)
    check_equal(dev, dtype, "softmax_topk", "swiglu", True, {}, seed=71, T=T, d=d, n=n)
    assert seen and all(off is not None and off % 256 == 0 for off in seen)
    # the reading layer of the same shape has none
    reading = [v for k, v in fn._layers.items()
               if k[1] == device and k[0][:3] == (d, n, E) and not v.consume_saved]
    assert reading and all(real(v, T, 0) is None for v in reading)


def test_workspace_is_the_librarys_and_smaller():
    # Python takes the workspace size from smoe_layer_workspace_bytes of the
    # consuming layer (no Python formula to keep in step); on the CPU backend
    # it loses the double dH, T K x 2n x 8 bytes, once the backward's part
    # is the larger one (at T = 1 the forward's is).
    base = (24, 16, 8, 2, smoe.functional.ACTIVATIONS["swiglu"], 0, False,
            fn.ROUTINGS["topk_softmax"], True, 0, 128, fn._DTYPES[torch.float32], 0, 0, 1.0)
    reading = fn._get_layer(base + (False,), torch.device("cpu"))
    consuming = fn._get_layer(base + (True,), torch.device("cpu"))
    assert consuming is not reading and consuming.desc.consume_saved == 1
    assert consuming.workspace_bytes(1, 0) <= reading.workspace_bytes(1, 0)
    for T in (9, 100, 1000):
        less = reading.workspace_bytes(T, 0) - consuming.workspace_bytes(T, 0)
        assert less == T * 2 * 2 * 16 * 8, (T, less)
        assert consuming.saved_nbytes(T, 0) == reading.saved_nbytes(T, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("create_graph", [False, True])
def test_second_backward_raises_inplace_error(eager, create_graph, device, monkeypatch):
    # The consumed block is saved with ctx.save_for_backward: its version is
    # bumped after the backward (increment_version on the direct path, the
    # operator's mutates_args otherwise), so the second backward fails when
    # autograd unpacks it, before the library is called.
    monkeypatch.setattr(fn, "_EAGER", eager)
    t = inputs(device, T=11, bias=True, seed=6)
    x, r, w1, w2, b1, b2 = leaves(*t)
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=2, consume_saved=True)
    loss = out.square().sum() + logits.sum()
    loss.backward(retain_graph=True, create_graph=create_graph)
    first = w1.grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert torch.equal(w1.grad, first)   # nothing accumulated
    # The reading layer can be differentiated twice.
    x, r, w1, w2, b1, b2 = leaves(*t)
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=2)
    loss = out.square().sum() + logits.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.equal(w1.grad, 2 * first)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_grad_twice_raises(device):
    t = inputs(device, T=6, act="relu", bias=False, seed=7)
    x, r, w1, w2 = leaves(*t[:4])
    out = smoe.moe(x, r, w1, w2, top_k=1, activation="relu", consume_saved=True)[0].sum()
    torch.autograd.grad(out, [w1], retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, [w2])


def test_module_option():
    torch.manual_seed(1)
    a = smoe.MoE(8, 2, 16, 12, "swiglu", True, 0.3, routing="softmax_topk")
    b = smoe.MoE(8, 2, 16, 12, "swiglu", True, 0.3, routing="softmax_topk",
                 consume_saved=True)
    b.load_state_dict(a.state_dict())
    assert not a.consume_saved and b.consume_saved
    assert "consume_saved=True" in repr(b) and "consume_saved" not in repr(a)
    x = torch.randn(2, 9, 16)
    res = []
    for m in (a, b):
        out, aux = m(x)
        (out.square().sum() + aux).backward(retain_graph=True)
        res.append([out.detach(), aux.detach()] + [p.grad for p in m.parameters()])
    for u, v in zip(*res):
        assert torch.equal(u, v)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out, aux = b(x)
        loss = out.sum() + aux
        loss.backward(retain_graph=True)
        loss.backward()
    with pytest.raises(TypeError):
        smoe.MoE(8, 2, 16, 12, consume_saved="yes")


def _loss(x, r, w1, w2, b1, b2, dout, consume):
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=2, routing="softmax_topk",
                                   consume_saved=consume)
    return (out * dout).sum() + smoe.switch_load_balancing_loss(logits, counts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_equal_to_eager(dynamic, device):
    # Compiled with consume_saved: bit for bit the compiled reading layer's
    # results, and eager's to test_compile.py's tolerance (the compiled loss
    # around the layer may round differently: in bf16 on CUDA by more).
    torch._dynamo.reset()

    def reading(*a):
        return _loss(*a, False)

    def consuming(*a):
        return _loss(*a, True)

    fns = (consuming, torch.compile(reading, fullgraph=True, dynamic=dynamic),
           torch.compile(consuming, fullgraph=True, dynamic=dynamic))
    tol = 1e-6 if device == "cpu" else 2e-2
    for T in ((12, 7) if dynamic else (12,)):
        t = inputs(device, T=T, bias=True, seed=T, dtype=torch.float32)
        d = t[0].shape[1]
        dout = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).to(device, t[0].dtype)
        res = []
        for f in fns:
            ins = leaves(*t)
            loss = f(*ins, dout)
            loss.backward()
            res.append([loss.detach()] + [v.grad for v in ins])
        for i, (eager, comp_reading, comp) in enumerate(zip(*res)):
            assert torch.equal(comp, comp_reading), i
            assert_close(comp.float(), eager.float(), tol, "result %d" % i)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("donated", [True, False])
def test_compile_second_backward_refused(donated, device):
    with torch._functorch.config.patch(donated_buffer=donated):
        _compile_second_backward(donated, device)


def _compile_second_backward(donated, device):
    # Under torch.compile the backward is the compiled graph, which calls
    # smoe::moe_backward_consume on its saved activation. By default
    # (donated buffers) PyTorch refuses retain_graph=True for such a graph
    # at once, consuming or not; without them the second backward fails on
    # the block's bumped version, as in eager.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _loss(*a, True), fullgraph=True)
    t = inputs(device, T=12, bias=True, seed=8, dtype=torch.float32)
    dout = torch.randn(12, t[0].shape[1], generator=torch.Generator().manual_seed(8))
    dout = dout.to(device, t[0].dtype)
    ins = leaves(*t)
    loss = compiled(*ins, dout)
    if donated:
        with pytest.raises(RuntimeError, match="donated buffers"):
            loss.backward(retain_graph=True)
        return
    loss.backward(retain_graph=True)
    first = ins[2].grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert torch.equal(ins[2].grad, first)
