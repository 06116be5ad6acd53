"""Router logits out of smoe.MoE (output_router_logits) and the router
z-loss: the value against the plain formula, and its gradient through the
layer (into the router weight, x and nothing else) against the PyTorch
reference of tests/reference.py, on the CPU backend in float64 and float32."""
import pytest
import torch

import smoe
from reference import moe_ref
from test_functional import assert_close, leaves, make


def z_loss_formula(logits):
    """ST-MoE eq. 5: (1/T) sum_t (log sum_e exp(logit_te))^2, spelled out."""
    lg = logits.reshape(-1, logits.shape[-1]).double()
    return (lg.exp().sum(-1).log() ** 2).sum() / lg.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_z_loss_value(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 5, generator=g) * 3).to(dtype)
    z = smoe.router_z_loss(logits)
    assert z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close(z.double(), z_loss_formula(logits), tol, "z-loss")
    # Large logits: logsumexp does not overflow where the formula would.
    big = torch.tensor([[1000.0, 999.0, -5.0]])
    assert torch.isfinite(smoe.router_z_loss(big))
    assert abs(smoe.router_z_loss(big).item() - (1000 + torch.log1p(torch.tensor(
        torch.e ** -1.0)).item()) ** 2) < 1e-1


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 2e-4)])
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
def test_z_loss_gradient_through_the_layer(dtype, tol, routing):
    # loss = <out, dout> + 0.1 * z-loss(router_logits): every gradient
    # against the reference's autograd. The z-loss term reaches the router
    # weight and x only through the logits (the library's dlogits_extra).
    T, d, n, E, K = 9, 8, 6, 5, 2
    tensors = make(T, d, n, E, "swiglu", True, dtype=dtype, seed=4)
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    res = []
    for fn in (smoe.moe, moe_ref):
        ins = leaves(*tensors) if fn is smoe.moe else leaves(*[t.double() for t in tensors])
        out, _, logits = fn(*ins, top_k=K, routing=routing)
        assert logits.requires_grad
        z = smoe.router_z_loss(logits)
        ((out.double() * dout).sum() + 0.1 * z.double()).backward()
        res.append((z.detach().double(), [t.grad.double() for t in ins]))
    (z, grads), (z_ref, grads_ref) = res
    assert_close(z, z_ref, tol, "z-loss")
    for name, g, g_ref in zip(("x", "router_w", "w1", "w2", "b1", "b2"), grads, grads_ref):
        assert_close(g, g_ref, tol, "d" + name)


def test_z_loss_alone_reaches_router_and_x_only():
    # With the z-loss as the only loss, the router weight's and x's
    # gradients are the dense dlogits @ ... of the formula, and the experts
    # get zero gradient.
    x, r, w1, w2, _, _ = make(7, 8, 4, 4, "swiglu", False, seed=6)
    x, r, w1, w2 = leaves(x, r, w1, w2)
    _, _, logits = smoe.moe(x, r, w1, w2, top_k=2)
    smoe.router_z_loss(logits).backward()
    x2, r2 = leaves(x.detach(), r.detach())
    z_loss_formula(x2 @ r2.T).backward()
    assert_close(r.grad, r2.grad, 1e-6, "drouter_w")
    assert_close(x.grad, x2.grad, 1e-6, "dx")
    assert w1.grad is None or not w1.grad.any()
    assert w2.grad is None or not w2.grad.any()


def test_module_returns_router_logits():
    torch.manual_seed(2)
    m = smoe.MoE(6, 2, 8, 4, "swiglu", False, 0.3).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    out, aux = m(x)                               # default: two outputs, as SonicMoE
    out2, aux2, logits = m(x, output_router_logits=True)
    assert torch.equal(out, out2) and torch.equal(aux, aux2)
    assert logits.shape == (15, 6) and logits.dtype == torch.float32
    assert_close(logits.double(), x.reshape(15, 8) @ m.router.weight.T, 1e-6, "logits")
    # The constructor flag, and forward's flag over it.
    m2 = smoe.MoE(6, 2, 8, 4, "swiglu", False, 0.3, output_router_logits=True).double()
    m2.load_state_dict(m.state_dict())
    o, a, lg = m2(x)
    assert torch.equal(lg, logits)
    assert len(m2(x, output_router_logits=False)) == 2
    # Inference mode: no aux loss, the logits still come back.
    o, a, lg = m2(x, is_inference_mode=True)
    assert a is None and torch.equal(lg, logits)


def test_module_z_loss_and_aux_loss_train_the_router():
    # Both auxiliary losses from one forward; the router weight's gradient
    # against the reference layer's.
    torch.manual_seed(3)
    m = smoe.MoE(4, 2, 8, 6, "swiglu", False, 0.3, output_router_logits=True).double()
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    out, aux, logits = m(x)
    (out.square().sum() + 0.01 * aux + 0.001 * smoe.router_z_loss(logits)).backward()
    x2, r2, w1, w2 = leaves(x.detach(), m.router.weight, m.c_fc.weight, m.c_proj.weight)
    o2, counts, lg2 = moe_ref(x2, r2, w1, w2, top_k=2)
    p = torch.softmax(lg2.float(), -1).sum(0)
    aux2 = 4 * ((p / p.sum()) * (counts.float() / counts.sum())).sum()
    (o2.square().sum() + 0.01 * aux2 + 0.001 * smoe.router_z_loss(lg2.float())).backward()
    assert_close(m.router.weight.grad, r2.grad, 1e-5, "drouter_w")
    assert_close(x.grad, x2.grad, 1e-5, "dx")
    assert_close(m.c_fc.weight.grad, w1.grad, 1e-8, "dw1")


def _devices():
    out = [("cpu", torch.float32), ("cpu", torch.float64), ("cpu", torch.bfloat16)]
    if torch.cuda.is_available():
        out.append(("cuda", torch.bfloat16))
    return out


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("device,dtype", _devices())
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk", "sigmoid_topk"])
def test_router_logits_dtype(device, dtype, routing, eager, monkeypatch):
    # router_logits_dtype=x's dtype: the float32 logits rounded, and a loss
    # on them whose gradient the dtype holds exactly (c, bf16 values) gives
    # the float32 logits' gradients bit for bit (smoe.h's
    # router_logits_dtype and dlogits_extra_dtype)
    monkeypatch.setattr(smoe.functional, "_EAGER", eager)
    g = torch.Generator().manual_seed(1)
    T, d, n, E, K = 32, 64, 64, 8, 2
    x = torch.randn(T, d, generator=g).to(device, dtype).requires_grad_()
    wr = (torch.randn(E, d, generator=g) * 0.3).to(device, dtype).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, generator=g) * 0.2).to(device, dtype).requires_grad_()
    w2 = (torch.randn(E, d, n, generator=g) * 0.2).to(device, dtype).requires_grad_()
    c = torch.randn(T, E, generator=g).to(torch.bfloat16).float().to(device)
    res = []
    for ldt in (None, dtype):
        out, _, lg = smoe.moe(x, wr, w1, w2, top_k=K, routing=routing, router_logits_dtype=ldt)
        assert lg.dtype == (torch.float32 if ldt is None else dtype)
        loss = out.float().sum() + (lg.float() * c).sum()
        res.append((out.detach(), lg.detach(), torch.autograd.grad(loss, (x, wr, w1, w2))))
    (o32, l32, g32), (o, lo, gl) = res
    assert torch.equal(o32, o)
    assert torch.equal(l32.to(dtype), lo)
    for name, a, b in zip(("x", "router_w", "w1", "w2"), g32, gl):
        assert torch.equal(a, b), name


def test_router_logits_dtype_refused():
    x = torch.randn(4, 8)
    w1, w2, wr = torch.randn(2, 8, 8), torch.randn(2, 8, 4), torch.randn(2, 8)
    with pytest.raises(smoe.SmoeError, match="router_logits_dtype"):
        smoe.moe(x, wr, w1, w2, top_k=1, router_logits_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_module_router_logits_dtype_input(dtype):
    # smoe.MoE(..., router_logits_dtype='input'): the logits (and the aux
    # loss's input) in x's dtype, the float32 layer's logits rounded; out
    # and the experts' gradients as with float32 logits (the routing reads
    # float32 ones either way; the aux loss's gradient moves only the
    # router's and x's)
    torch.manual_seed(3)
    T, d, n, E, K = 24, 32, 32, 8, 2
    m32 = smoe.MoE(E, K, d, n, output_router_logits=True).to(dtype)
    mlp = smoe.MoE(E, K, d, n, output_router_logits=True, router_logits_dtype="input").to(dtype)
    mlp.load_state_dict(m32.state_dict())
    assert "router_logits_dtype='input'" in repr(mlp)
    x = torch.randn(2, T // 2, d, dtype=dtype)
    res = []
    for m in (m32, mlp):
        xi = x.clone().requires_grad_()
        out, aux, lg = m(xi)
        out.float().sum().backward()
        res.append((out.detach(), aux.detach(), lg.detach(), xi.grad, m.c_fc.weight.grad))
    (o32, a32, l32, dx32, dw32), (o, a, lg, dx, dw) = res
    assert l32.dtype == torch.float32 and lg.dtype == dtype
    assert torch.equal(l32.to(dtype), lg)
    assert torch.equal(o32, o) and torch.equal(dx32, dx) and torch.equal(dw32, dw)
    assert torch.allclose(a32, a, rtol=2e-2)
    with pytest.raises(smoe.SmoeError, match="router_logits_dtype = 'bf16'"):
        smoe.MoE(E, K, d, n, router_logits_dtype="bf16")


def test_module_router_logits_dtype_input_under_autocast():
    # 'input' is x's dtype after autocast: a float32 layer and x under
    # torch.autocast(bfloat16) return bfloat16 logits, the float32 layer's
    # under the same autocast rounded
    torch.manual_seed(4)
    m32 = smoe.MoE(8, 2, 32, 32, output_router_logits=True)
    mlp = smoe.MoE(8, 2, 32, 32, output_router_logits=True, router_logits_dtype="input")
    mlp.load_state_dict(m32.state_dict())
    x = torch.randn(12, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o32, _, l32 = m32(x)
        o, _, lg = mlp(x)
    assert l32.dtype == torch.float32 and lg.dtype == torch.bfloat16
    assert torch.equal(l32.to(torch.bfloat16), lg) and torch.equal(o32, o)
