"""torch.compile (CPU here; CUDA parts skipped without a GPU) and CUDA-graph
capture of a whole forward + backward."""
import pytest
import torch

import smoe
from test_functional import assert_close, make


def loss_fn(x, r, w1, w2, b1, b2, dout):
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=2, routing="softmax_topk")
    return (out * dout).sum() + smoe.switch_load_balancing_loss(logits, counts)


def grads_of(fn, tensors, dout):
    ins = [t.detach().clone().requires_grad_() for t in tensors]
    loss = fn(*ins, dout)
    loss.backward()
    return loss.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_cpu_forward_backward(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=dynamic)
    for T in ((12, 7) if dynamic else (12,)):
        t = make(T=T, d=8, n=4, E=4, act="swiglu", bias=True, dtype=torch.float32, seed=T)
        dout = torch.randn(T, 8, generator=torch.Generator().manual_seed(T))
        loss_e, g_e = grads_of(loss_fn, t, dout)
        loss_c, g_c = grads_of(compiled, t, dout)
        assert_close(loss_c, loss_e, 1e-6, "loss")
        for name, a, b in zip(["x", "router_w", "w1", "w2", "b1", "b2"], g_c, g_e):
            assert_close(a, b, 1e-6, "grad " + name)


def test_compile_module():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = smoe.MoE(4, 2, 8, 6, "swiglu", False, 0.3)
    x = torch.randn(3, 5, 8)
    out_e, aux_e = m(x)
    cm = torch.compile(m, fullgraph=True)
    out_c, aux_c = cm(x)
    assert_close(out_c, out_e, 1e-6, "out")
    assert_close(aux_c, aux_e, 1e-6, "aux")
    (out_c.sum() + aux_c).backward()
    assert m.router.weight.grad is not None and m.c_fc.weight.grad is not None


def sigmoid_loss_fn(x, r, w1, w2, b1, b2, dout, bias):
    out, counts, logits = smoe.moe(x, r, w1, w2, b1, b2, top_k=3, routing="sigmoid_topk",
                                   expert_bias=bias, n_group=4, topk_group=2,
                                   routed_scaling=2.5)
    return (out * dout).sum() + smoe.router_z_loss(logits)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_cpu_sigmoid_topk(dynamic):
    # The expert bias is an input of the graph, not a constant: a new bias
    # changes the choice without recompiling wrong results.
    torch._dynamo.reset()
    compiled = torch.compile(sigmoid_loss_fn, fullgraph=True, dynamic=dynamic)
    for T in ((12, 7) if dynamic else (12, 12)):
        t = make(T=T, d=8, n=4, E=8, act="swiglu", bias=True, dtype=torch.float32, seed=T)
        dout = torch.randn(T, 8, generator=torch.Generator().manual_seed(T))
        bias = torch.randn(8, generator=torch.Generator().manual_seed(T + 1)) * (T / 4)
        ins = [v.detach().clone().requires_grad_() for v in t]
        loss_e = sigmoid_loss_fn(*ins, dout, bias)
        loss_e.backward()
        g_e = [v.grad for v in ins]
        ins = [v.detach().clone().requires_grad_() for v in t]
        loss_c = compiled(*ins, dout, bias)
        loss_c.backward()
        # The loss is a sum the compiled graph may order differently (fp32):
        # 1.9e-6 relative seen with torch 2.11 on the GPU machine.
        assert_close(loss_c.detach(), loss_e.detach(), 4e-6, "loss")
        for name, a, b in zip(["x", "router_w", "w1", "w2", "b1", "b2"], [v.grad for v in ins],
                              g_e):
            assert_close(a, b, 1e-6, "grad " + name)


def test_compile_sigmoid_topk_options_as_arguments():
    # Numbers passed to the compiled function: a float arrives symbolic
    # (torch.SymFloat) and is checked and passed on as one.
    torch._dynamo.reset()
    x, r, w1, w2, _, _ = make(T=9, d=8, n=4, E=8, act="swiglu", bias=False, dtype=torch.float32,
                              seed=3)
    r.requires_grad_()

    def f(x, scaling, n_group, topk_group):
        return smoe.moe(x, r, w1, w2, top_k=2, routing="sigmoid_topk", routed_scaling=scaling,
                        n_group=n_group, topk_group=topk_group)[0]

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for args in ((2.5, 4, 2), (1.5, 4, 2), (1.5, 2, 1)):
        out_c, out_e = compiled(x, *args), f(x, *args)
        assert torch.equal(out_c, out_e), args
        g_c, = torch.autograd.grad(out_c.sum(), r)
        g_e, = torch.autograd.grad(out_e.sum(), r)
        assert torch.equal(g_c, g_e), args


def test_compile_module_sigmoid_topk():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = smoe.MoE(8, 3, 8, 6, "swiglu", False, 0.3, routing="sigmoid_topk", n_group=4,
                 topk_group=2, routed_scaling=2.5)
    with torch.no_grad():
        m.expert_bias.copy_(torch.randn(8) * 0.3)
    x = torch.randn(3, 5, 8)
    cm = torch.compile(m, fullgraph=True)
    for step in range(2):
        out_e, aux_e = m(x)
        counts_e = m.last_expert_counts
        m.zero_grad()
        out_e.square().sum().backward()
        g_e = [p.grad.clone() for p in m.parameters()]
        out_c, aux_c = cm(x)
        assert torch.equal(m.last_expert_counts, counts_e)
        assert_close(out_c, out_e, 1e-6, "out")
        assert_close(aux_c, aux_e, 1e-6, "aux")
        m.zero_grad()
        out_c.square().sum().backward()
        for (name, p), g in zip(m.named_parameters(), g_e):
            assert_close(p.grad, g, 1e-6, "d" + name)
        # The balancing update between steps: the compiled layer reads the
        # buffer at every call (expert 1 now wins every token).
        with torch.no_grad():
            m.expert_bias[1] = 5.0
    assert int(m.last_expert_counts[1]) == 15


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_inputs(T=256, d=128, n=64, E=8, seed=0):
    t = make(T=T, d=d, n=n, E=E, act="swiglu", bias=False, dtype=torch.float32, seed=seed)
    return [None if v is None else v.cuda().to(torch.bfloat16) for v in t]


@cuda
def test_cuda_matches_cpu_reference():
    x, r, w1, w2, _, _ = cuda_inputs()
    out, counts, logits = smoe.moe(x, r, w1, w2, top_k=2)
    ref, rcounts, _ = smoe.moe(*(t.cpu().double() for t in (x, r, w1, w2)), top_k=2)
    assert torch.equal(counts.cpu(), rcounts)
    assert_close(out.double().cpu(), ref, 3e-2, "out")


@cuda
def test_compile_cuda():
    torch._dynamo.reset()
    x, r, w1, w2, _, _ = cuda_inputs()
    dout = torch.randn_like(x)

    def f(x, r, w1, w2, b1, b2, dout):
        return loss_fn(x, r, w1, w2, None, None, dout)

    loss_e, g_e = grads_of(f, (x, r, w1, w2, x, x), dout)
    loss_c, g_c = grads_of(torch.compile(f, fullgraph=True), (x, r, w1, w2, x, x), dout)
    assert_close(loss_c.float(), loss_e.float(), 1e-2, "loss")
    for a, b in zip(g_c[:4], g_e[:4]):
        assert_close(a.float(), b.float(), 2e-2, "grad")


@cuda
def test_cuda_graph_capture_forward_backward():
    x, r, w1, w2, _, _ = cuda_inputs()
    params = [t.detach().clone().requires_grad_() for t in (x, r, w1, w2)]
    dout = torch.randn_like(x)

    def step():
        out, counts, logits = smoe.moe(*params, top_k=2, routing="softmax_topk")
        (out * dout).sum().backward()
        return out, counts

    # Warm up on a side stream (creates and caches the layer), as CUDA graphs require.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    for p in params:
        p.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out, static_counts = step()

    for seed in (1, 2):
        new = cuda_inputs(seed=seed)
        with torch.no_grad():
            for p, v in zip(params, new):
                p.copy_(v)
        g.replay()
        torch.cuda.synchronize()
        eager = [t.detach().clone().requires_grad_() for t in new[:4]]
        out, counts, _ = smoe.moe(*eager, top_k=2, routing="softmax_topk")
        (out * dout).sum().backward()
        assert torch.equal(static_counts, counts)
        assert torch.equal(static_out, out.detach())   # bitwise deterministic
        for p, e in zip(params, eager):
            assert torch.equal(p.grad, e.grad)
