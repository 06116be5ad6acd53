"""routing='sigmoid_topk' (smoe.h's SMOE_ROUTING_SIGMOID_TOPK, DeepSeek-V3's
router) through smoe.moe and smoe.MoE on the CPU backend, against the
PyTorch reference written from the header's formulas (reference.py's
moe_sigmoid_ref): outputs, expert
counts, router logits and every gradient in float64 and float32; the
expert bias (selection only, no gradient); both call paths; the refusals
of bad options, in Python and behind it in the library."""
import math

import pytest
import torch

import smoe
from smoe import _lib as L
from smoe import functional as fn
from reference import moe_sigmoid_ref
from test_functional import NAMES, assert_close, leaves, make
from test_paths import both, full_loss


def random_bias(E, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, generator=g, dtype=torch.float32) * scale


def run_both(tensors, **kw):
    """smoe.moe and the reference (float64, on the same values) on leaf
    copies of `tensors`, backward of a random linear function of out and
    router_logits; returns both sides' (out, counts, logits, grads)."""
    T, d = tensors[0].shape
    E = tensors[1].shape[0]
    g = torch.Generator().manual_seed(123)
    dout = torch.randn(T, d, generator=g, dtype=torch.float64)
    dlog = (torch.randn(T, E, generator=g, dtype=torch.float64) * 0.3).float().double()
    res = []
    for f in (smoe.moe, moe_sigmoid_ref):
        if f is smoe.moe:
            ins = leaves(*tensors)
        else:
            ins = leaves(*[None if t is None else t.to(torch.float64) for t in tensors])
        out, counts, logits = f(*ins, routing="sigmoid_topk", **kw)
        loss = (out.double() * dout).sum() + (logits.double() * dlog).sum()
        loss.backward()
        res.append((out.detach().double(), counts, logits.detach().double(),
                    [None if t is None else t.grad.double() for t in ins]))
    return res


def check(res, tol, logits_tol=1e-6):
    (o, c, lg, g), (ro, rc, rlg, rg) = res
    assert torch.equal(c, rc), "expert counts %s vs %s" % (c.tolist(), rc.tolist())
    assert_close(o, ro, tol, "out")
    assert_close(lg, rlg, logits_tol, "router_logits")
    for name, a, b in zip(NAMES, g, rg):
        if b is None:
            assert a is None
            continue
        assert_close(a, b, tol, "grad " + name)


E = 8
# (top_k, n_group, topk_group, renormalize, routed_scaling, with an expert bias)
CASES = [
    (2, 0, 0, True, 1.0, False),
    (3, 4, 2, True, 2.5, True),     # DeepSeek-V3's shape of options
    (3, 4, 2, False, 2.5, True),
    (1, 2, 1, True, 1.0, True),
    (4, 2, 1, False, 0.5, True),    # K = the experts of the one group kept
    (8, 4, 4, True, 1.5, True),     # K = E
    (2, 0, 0, False, 1.5, True),
]


@pytest.mark.parametrize("K,G,g,renorm,scaling,with_bias", CASES)
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("relu2", False)])
def test_matches_reference_f64(K, G, g, renorm, scaling, with_bias, act, bias):
    seed = 100 + CASES.index((K, G, g, renorm, scaling, with_bias))
    t = make(T=13, d=12, n=8, E=E, act=act, bias=bias, seed=seed)
    eb = random_bias(E, seed) if with_bias else None
    res = run_both(t, top_k=K, expert_bias=eb, n_group=G, topk_group=g, renormalize=renorm,
                   routed_scaling=scaling, activation=act)
    check(res, 1e-9)


@pytest.mark.parametrize("K,G,g,renorm,scaling,with_bias", [CASES[1], CASES[4]])
def test_matches_reference_f32(K, G, g, renorm, scaling, with_bias):
    # Inputs rounded to float32; the reference runs in float64 on the same values.
    t = make(T=16, d=16, n=8, E=E, act="swiglu", bias=True, dtype=torch.float32, seed=7)
    res = run_both(t, top_k=K, expert_bias=random_bias(E, 7), n_group=G, topk_group=g,
                   renormalize=renorm, routed_scaling=scaling)
    check(res, 2e-5, logits_tol=1e-5)


def test_leading_dims_and_t_1():
    x, r, w1, w2, _, _ = make(T=6, d=8, n=4, E=E, act="swiglu", bias=False, seed=3)
    kw = dict(top_k=3, expert_bias=random_bias(E, 3), n_group=4, topk_group=2,
              routed_scaling=2.5)
    out, counts, logits = smoe.moe(x.view(2, 3, 8), r, w1, w2, routing="sigmoid_topk", **kw)
    assert out.shape == (2, 3, 8) and logits.shape == (2, 3, E) and counts.shape == (E,)
    ref, rc, _ = moe_sigmoid_ref(x, r, w1, w2, **kw)
    assert_close(out.view(6, 8), ref, 1e-9, "out")
    assert torch.equal(counts, rc)
    out1, c1, _ = smoe.moe(x[:1], r, w1, w2, routing="sigmoid_topk", **kw)
    ref1, rc1, _ = moe_sigmoid_ref(x[:1], r, w1, w2, **kw)
    assert_close(out1, ref1, 1e-9, "out T=1")
    assert int(c1.sum()) == 3 and torch.equal(c1, rc1)


def test_gradcheck_f64():
    ins = [t.detach().clone().requires_grad_()
           for t in make(T=9, d=4, n=3, E=4, act="swiglu", bias=True, seed=31)]
    eb = random_bias(4, 31)

    def f(x, r, w1, w2, b1, b2):
        return smoe.moe(x, r, w1, w2, b1, b2, top_k=2, routing="sigmoid_topk", expert_bias=eb,
                        n_group=2, topk_group=1, routed_scaling=2.5)[0]

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_the_bias_chooses_but_does_not_score():
    x, r, w1, w2, _, _ = make(T=10, d=8, n=4, E=E, act="swiglu", bias=False, seed=5)
    eb = torch.zeros(E)
    eb[6] = 5.0     # sigmoid scores lie in (0, 1): expert 6 wins every token
    out, counts, _ = smoe.moe(x, r, w1, w2, top_k=2, routing="sigmoid_topk", expert_bias=eb,
                              renormalize=False)
    assert int(counts[6]) == 10 and int(counts.sum()) == 20
    # Its score is still its sigmoid: the reference adds no bias to scores.
    ref, rc, _ = moe_sigmoid_ref(x, r, w1, w2, top_k=2, expert_bias=eb, renormalize=False)
    assert torch.equal(counts, rc)
    assert_close(out, ref, 1e-9, "out")
    # No bias is a zero bias.
    a = smoe.moe(x, r, w1, w2, top_k=2, routing="sigmoid_topk")
    b = smoe.moe(x, r, w1, w2, top_k=2, routing="sigmoid_topk", expert_bias=torch.zeros(E))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_the_bias_gets_no_gradient_and_may_change_before_backward():
    # Backward reads the choice from the saved block: a bias updated in
    # place between forward and backward (as a training loop may do)
    # changes no gradient; a bias that requires a gradient gets none.
    t = make(T=12, d=8, n=4, E=E, act="swiglu", bias=True, seed=6)
    kw = dict(top_k=3, routing="sigmoid_topk", n_group=4, topk_group=2, routed_scaling=2.5)
    ins = leaves(*t)
    eb = random_bias(E, 6).requires_grad_()
    out, _, logits = smoe.moe(*ins, expert_bias=eb, **kw)
    with torch.no_grad():
        eb.mul_(-3.0)
    (out.sum() + logits.sum()).backward()
    assert eb.grad is None
    ref = leaves(*t)
    out_r, _, logits_r = smoe.moe(*ref, expert_bias=random_bias(E, 6), **kw)
    (out_r.sum() + logits_r.sum()).backward()
    assert torch.equal(out.detach(), out_r.detach())
    for name, a, b in zip(NAMES, ins, ref):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_eager_and_operator_agree(monkeypatch, dtype):
    t = make(T=11, d=8, n=4, E=E, act="swiglu", bias=True, seed=41, dtype=dtype)
    both(monkeypatch, t, full_loss(11, 8, E), top_k=3, routing="sigmoid_topk",
         expert_bias=random_bias(E, 41), n_group=4, topk_group=2, routed_scaling=2.5,
         renormalize=True)


def test_layers_cached_per_options_not_per_bias():
    x, r, w1, w2, _, _ = make(T=5, d=8, n=4, E=E, act="swiglu", bias=False, seed=1)
    kw = dict(top_k=2, routing="sigmoid_topk", n_group=4, topk_group=2)
    smoe.moe(x, r, w1, w2, routed_scaling=2.5, **kw)
    before = len(fn._layers)
    smoe.moe(x, r, w1, w2, routed_scaling=2.5, expert_bias=random_bias(E, 1), **kw)
    smoe.moe(x, r, w1, w2, routed_scaling=2.5, expert_bias=random_bias(E, 2), **kw)
    assert len(fn._layers) == before
    smoe.moe(x, r, w1, w2, routed_scaling=2.0, **kw)
    smoe.moe(x, r, w1, w2, top_k=2, routing="sigmoid_topk", n_group=2, topk_group=1,
             routed_scaling=2.5)
    assert len(fn._layers) == before + 2


def test_saved_bytes_formula_matches_library():
    # SIGMOID_TOPK keeps the fp32 logits for the sigmoid's derivative.
    for dtype in (L.SMOE_DTYPE_F32, L.SMOE_DTYPE_BF16, L.SMOE_DTYPE_F64):
        cfg = (24, 16, E, 3, L.SMOE_ACT_SWIGLU, 0, False, L.SMOE_ROUTING_SIGMOID_TOPK, True,
               L.SMOE_ROUND_OFF, 128, dtype, 4, 2, 2.5, False)
        layer = fn._get_layer(cfg, torch.device("cpu"))
        for T in (1, 3, 64, 1000):
            assert layer.saved_bytes(T, 0) == fn.saved_bytes(
                T, 0, d=24, n=16, E=E, K=3, activation=L.SMOE_ACT_SWIGLU,
                routing=L.SMOE_ROUTING_SIGMOID_TOPK, rounding=L.SMOE_ROUND_OFF, round_tile=128,
                dtype=dtype)


# ------------------------------------------------------------ refusals

@pytest.fixture
def t():
    return make(T=6, d=8, n=4, E=E, act="swiglu", bias=False, seed=0)[:4]


@pytest.mark.parametrize("kw,status,match", [
    (dict(n_group=3, topk_group=1), L.SMOE_ERROR_INVALID_SIZE,
     r"n_group = 3 does not divide E = 8"),
    (dict(n_group=8, topk_group=1), L.SMOE_ERROR_INVALID_SIZE,
     r"n_group = 8 gives groups of E/n_group = 1 expert\(s\)"),
    (dict(n_group=4, topk_group=5), L.SMOE_ERROR_INVALID_SIZE,
     r"topk_group = 5, must be in \[1, n_group = 4\]"),
    (dict(n_group=4, topk_group=1), L.SMOE_ERROR_INVALID_SIZE,
     r"topk_group = 1 groups of 2 experts hold fewer than top_k = 3 experts"),
    (dict(n_group=4), L.SMOE_ERROR_INVALID_VALUE,
     r"n_group = 4, topk_group = 0: both 0 \(no groups\) or both > 0"),
    (dict(n_group=-4, topk_group=-2), L.SMOE_ERROR_INVALID_SIZE,
     r"n_group = -4, topk_group = -2: must be >= 0"),
    (dict(n_group=4.0, topk_group=2), L.SMOE_ERROR_INVALID_VALUE, r"n_group = 4.0, must be an int"),
    (dict(topk_group=True), L.SMOE_ERROR_INVALID_VALUE, r"topk_group = True, must be an int"),
    (dict(routed_scaling=0.0), L.SMOE_ERROR_INVALID_VALUE,
     r"routed_scaling = 0.0, must be a finite number > 0"),
    (dict(routed_scaling=-2.5), L.SMOE_ERROR_INVALID_VALUE, r"routed_scaling = -2.5, must be"),
    (dict(routed_scaling=math.inf), L.SMOE_ERROR_INVALID_VALUE, r"routed_scaling = inf, must"),
    (dict(routed_scaling=math.nan), L.SMOE_ERROR_INVALID_VALUE, r"routed_scaling = nan, must"),
    (dict(routed_scaling="2.5"), L.SMOE_ERROR_INVALID_VALUE, r"routed_scaling = '2.5', must"),
    (dict(routed_scaling=torch.tensor(2.5)), L.SMOE_ERROR_INVALID_VALUE,
     r"routed_scaling = tensor\(2.5000\), must be a finite number"),
    (dict(token_rounding="up"), L.SMOE_ERROR_INVALID_VALUE,
     r"token_rounding = 'up' with routing='sigmoid_topk'"),
    (dict(expert_bias=torch.zeros(9)), L.SMOE_ERROR_INVALID_SIZE,
     r"expert_bias has shape \(9,\), expected \(8,\) \(E = 8 experts\)"),
    (dict(expert_bias=torch.zeros(1, 8)), L.SMOE_ERROR_INVALID_SIZE,
     r"expert_bias has shape \(1, 8\), must have 1 dimensions"),
    (dict(expert_bias=torch.zeros(8, dtype=torch.float64)), L.SMOE_ERROR_INVALID_VALUE,
     r"expert_bias has dtype torch.float64, must be float32"),
    (dict(expert_bias=torch.zeros(8, dtype=torch.bfloat16)), L.SMOE_ERROR_INVALID_VALUE,
     r"expert_bias has dtype torch.bfloat16, must be float32"),
    (dict(expert_bias=torch.zeros(8, device="meta")), L.SMOE_ERROR_INVALID_VALUE,
     r"expert_bias is on meta but x is on cpu"),
    (dict(expert_bias=[0.0] * 8), L.SMOE_ERROR_INVALID_VALUE,
     r"expert_bias must be a torch.Tensor, got list"),
])
def test_bad_options_refused(t, kw, status, match):
    x, r, w1, w2 = t
    with pytest.raises(smoe.SmoeError, match=match) as e:
        smoe.moe(x, r, w1, w2, top_k=3, routing="sigmoid_topk", **kw)
    assert e.value.status == status


@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
@pytest.mark.parametrize("kw,match", [
    (dict(expert_bias=torch.zeros(8)), r"expert_bias is given but routing = '%s' has no expert "
                                       r"bias \(routing='sigmoid_topk' only\)"),
    (dict(n_group=4, topk_group=2), r"n_group = 4, topk_group = 2: group-limited selection "
                                    r"needs routing='sigmoid_topk' \(routing = '%s'\)"),
    (dict(routed_scaling=2.5), r"routed_scaling = 2.5 needs routing='sigmoid_topk' \(routing "
                               r"= '%s' scales nothing"),
])
def test_sigmoid_options_refused_with_other_routings(t, routing, kw, match):
    x, r, w1, w2 = t
    with pytest.raises(ValueError, match=match % routing) as e:
        smoe.moe(x, r, w1, w2, top_k=2, routing=routing, **kw)
    assert isinstance(e.value, smoe.SmoeError)
    assert e.value.status == L.SMOE_ERROR_INVALID_VALUE
    # The defaults, spelled out, are fine.
    smoe.moe(x, r, w1, w2, top_k=2, routing=routing, expert_bias=None, n_group=0, topk_group=0,
             routed_scaling=1.0)


def test_the_library_checks_behind_python(t):
    # The same rules, from smoe_layer_create and smoe_layer_forward.
    x, r, w1, w2 = t
    base = (8, 4, E, 3, L.SMOE_ACT_SWIGLU, 0, False, L.SMOE_ROUTING_SIGMOID_TOPK, True,
            L.SMOE_ROUND_OFF, 128, L.SMOE_DTYPE_F64)
    with pytest.raises(smoe.SmoeError, match=r"desc.n_group = 3 does not divide E = 8"):
        fn._get_layer(base + (3, 1, 1.0, False), torch.device("cpu"))
    with pytest.raises(smoe.SmoeError, match=r"desc.routed_scaling = -1, must be finite"):
        fn._get_layer(base + (0, 0, -1.0, False), torch.device("cpu"))
    other = base[:7] + (L.SMOE_ROUTING_SOFTMAX_TOPK,) + base[8:]
    with pytest.raises(smoe.SmoeError, match=r"desc.routed_scaling = 2.5 needs SIGMOID_TOPK"):
        fn._get_layer(other + (0, 0, 2.5, False), torch.device("cpu"))
    layer = fn._get_layer(other + (0, 0, 1.0, False), torch.device("cpu"))
    with pytest.raises(smoe.SmoeError, match=r"args.expert_bias is given but desc.routing = 1"):
        fn._forward_core(layer, x, r, None, None, None, w1, w2, None, None, torch.zeros(E),
                         True, False)


# ------------------------------------------------------------ smoe.MoE

@pytest.mark.parametrize("kw,match", [
    (dict(n_group=3, topk_group=1), r"smoe.MoE: n_group = 3 does not divide E = 8"),
    (dict(n_group=8, topk_group=1), r"smoe.MoE: n_group = 8 gives groups of E/n_group = 1"),
    (dict(n_group=4, topk_group=5), r"smoe.MoE: topk_group = 5, must be in \[1, n_group = 4\]"),
    (dict(n_group=4, topk_group=1), r"smoe.MoE: topk_group = 1 groups of 2 experts hold fewer "
                                    r"than top_k = 3"),
    (dict(n_group=4), r"smoe.MoE: n_group = 4, topk_group = 0: both 0"),
    (dict(n_group="4", topk_group=2), r"smoe.MoE: n_group = '4', must be an int"),
    (dict(routed_scaling=0), r"smoe.MoE: routed_scaling = 0, must be a finite number > 0"),
    (dict(routed_scaling=float("inf")), r"smoe.MoE: routed_scaling = inf"),
    (dict(token_rounding="up"), r"smoe.MoE: token_rounding = 'up' with routing = "
                                r"'sigmoid_topk'"),
    (dict(routing="softmax_topk", n_group=4, topk_group=2),
     r"smoe.MoE: n_group = 4, topk_group = 2: group-limited selection needs "
     r"routing='sigmoid_topk' \(routing = 'softmax_topk'\)"),
    (dict(routing="topk_softmax", routed_scaling=2.5),
     r"smoe.MoE: routed_scaling = 2.5 needs routing='sigmoid_topk'"),
])
def test_module_constructor_rejects(kw, match):
    kw.setdefault("routing", "sigmoid_topk")
    with pytest.raises(ValueError, match=match) as e:
        smoe.MoE(8, 3, 16, 12, **kw)
    assert isinstance(e.value, smoe.SmoeError)


def sigmoid_layer(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    m = smoe.MoE(E, 3, 8, 6, "swiglu", False, 0.3, routing="sigmoid_topk", n_group=4,
                 topk_group=2, routed_scaling=2.5, **kw)
    return m.to(dtype)


def test_module_expert_bias_buffer():
    m = sigmoid_layer(torch.float32)
    assert m.expert_bias.dtype == torch.float32 and torch.equal(m.expert_bias, torch.zeros(E))
    assert list(m.state_dict())[0] == "expert_bias"      # persistent
    assert "expert_bias" not in dict(m.named_parameters())
    # It stays float32 when the layer changes dtype, and moves with it.
    for dtype in (torch.bfloat16, torch.float64):
        m.to(dtype)
        assert m.c_fc.weight.dtype == dtype and m.expert_bias.dtype == torch.float32
    m.to("meta")
    assert m.expert_bias.device.type == "meta" and m.expert_bias.dtype == torch.float32
    # A checkpoint carries it.
    a, b = sigmoid_layer(), sigmoid_layer()
    with torch.no_grad():
        a.expert_bias.copy_(random_bias(E, 9))
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.expert_bias, a.expert_bias)
    # The other routings have none (and their state dicts are as before).
    m = smoe.MoE(E, 2, 8, 6)
    assert m.expert_bias is None and "expert_bias" not in m.state_dict()
    assert "routed_scaling=2.5" in repr(sigmoid_layer()) and "n_group" not in repr(m)


def test_module_forward_matches_reference_and_balances():
    m = sigmoid_layer()
    x = torch.randn(2, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        m.expert_bias.copy_(random_bias(E, 4))

    def ref(xi, mod):
        return moe_sigmoid_ref(xi.view(20, 8), mod.router.weight, mod.c_fc.weight,
                               mod.c_proj.weight, top_k=3, expert_bias=mod.expert_bias,
                               n_group=4, topk_group=2, routed_scaling=2.5)

    out, aux = m(x)
    r_out, r_counts, _ = ref(x, m)
    assert_close(out.view(20, 8), r_out, 1e-9, "out")
    assert torch.equal(m.last_expert_counts, r_counts)
    assert aux is not None
    # Gradients: x and every parameter, none for the buffer.
    xi = x.clone().requires_grad_()
    m(xi)[0].square().sum().backward()
    m2 = sigmoid_layer()
    with torch.no_grad():
        m2.expert_bias.copy_(m.expert_bias)
    xr = x.clone().requires_grad_()
    ref(xr, m2)[0].square().sum().backward()
    assert_close(xi.grad, xr.grad, 1e-9, "dx")
    for (name, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert_close(p.grad, p2.grad, 1e-9, "d" + name)
    # DeepSeek-V3's balancing update, from the counts the layer returns: an
    # overloaded expert's bias goes down, an idle one's up.
    load = m.last_expert_counts.double()
    before = m.expert_bias.clone()
    with torch.no_grad():
        m.expert_bias += 1e-3 * torch.sign(load.mean() - load)
    step = (m.expert_bias - before).double()
    assert torch.equal(torch.sign(step), torch.sign(load.mean() - load))
    m(x)
    r_out, r_counts, _ = ref(x, m)
    assert torch.equal(m.last_expert_counts, r_counts)


# ------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fa3_rule(gpu, bf16, f64, what, atol=2e-3):
    """STYLE.md's rule: err(gpu, f64) <= 2 err(bf16 cpu, f64) + atol, errors
    relative to the float64 reference's largest magnitude."""
    scale = max(f64.abs().max().item(), 1e-30)
    err_gpu = (gpu.cpu().double() - f64).abs().max().item() / scale
    err_bf16 = (bf16.double() - f64).abs().max().item() / scale
    assert err_gpu <= 2 * err_bf16 + atol, "%s: err(gpu) %.3g > 2 * err(bf16 cpu) %.3g + %g" % (
        what, err_gpu, err_bf16, atol)


@cuda
@pytest.mark.parametrize("G,g,renorm", [(4, 2, True), (0, 0, False)])
def test_cuda_matches_cpu(G, g, renorm):
    # bfloat16 on the GPU against the CPU backend in float64 (the oracle
    # the tests above check) and in bfloat16 (the rounding reference), the
    # expert bias on the GPU: the same choice (counts), FA3's rule on the
    # output and every gradient.
    t = make(T=256, d=128, n=64, E=E, act="swiglu", bias=True, dtype=torch.float32, seed=61)
    t = [v.to(torch.bfloat16) for v in t]
    eb = random_bias(E, 61)
    kw = dict(top_k=3, routing="sigmoid_topk", n_group=G, topk_group=g, renormalize=renorm,
              routed_scaling=2.5)
    # (dout rounded to bfloat16 too: every run differentiates the same values)
    dout = torch.randn(256, 128, generator=torch.Generator().manual_seed(62)).to(torch.bfloat16)
    runs = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.bfloat16),
                          ("cpu", torch.float64)):
        ins = leaves(*[v.to(device, dtype) for v in t])
        out, counts, logits = smoe.moe(*ins, expert_bias=eb.to(device), **kw)
        (out * dout.to(device, dtype)).sum().backward()
        runs.append((out.detach(), counts.cpu(), [v.grad for v in ins]))
    (o_g, c_g, g_g), (o_b, c_b, g_b), (o_f, c_f, g_f) = runs
    assert torch.equal(c_g, c_f) and torch.equal(c_b, c_f), (c_g, c_b, c_f)
    fa3_rule(o_g, o_b, o_f, "out")
    for name, a, b, f in zip(NAMES, g_g, g_b, g_f):
        fa3_rule(a, b, f, "grad " + name)


@cuda
def test_cuda_compiled_module():
    # (d and n multiples of 64: the Hopper kernels run it as well as the
    # portable ones.)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = smoe.MoE(E, 3, 128, 64, "swiglu", False, 0.05, routing="sigmoid_topk", n_group=4,
                 topk_group=2, routed_scaling=2.5).cuda().bfloat16()
    with torch.no_grad():
        m.expert_bias.copy_(random_bias(E, 63))
    assert m.expert_bias.dtype == torch.float32 and m.expert_bias.is_cuda
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    out_e, _ = m(x)
    counts_e = m.last_expert_counts.clone()
    out_c, _ = torch.compile(m, fullgraph=True)(x)
    assert torch.equal(out_c, out_e)   # the same kernels, the same bits
    assert torch.equal(m.last_expert_counts, counts_e)
