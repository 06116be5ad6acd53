"""smoe.moe / smoe.moe_general on the CPU backend against the plain PyTorch
reference (tests/reference.py): outputs, expert counts, router logits and
every gradient, for each routing mode and activation."""
import itertools

import pytest
import torch

import smoe
from reference import GATED, moe_general_ref, moe_ref

ACTS = ["swiglu", "geglu", "reglu", "relu2", "relu", "silu", "gelu"]


def make(T, d, n, E, act, bias, dtype=torch.float64, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    h = 2 * n if act in GATED else n

    def r(*shape, s=scale):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype)

    x = r(T, d, s=1.0)
    router = r(E, d)
    w1 = r(E, h, d, s=d ** -0.5)
    w2 = r(E, d, n, s=n ** -0.5)
    b1 = r(E, h, s=0.1) if bias else None
    b2 = r(E, d, s=0.1) if bias else None
    return x, router, w1, w2, b1, b2


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def run_both(tensors, dtype_ref=torch.float64, **kw):
    """Runs smoe.moe and the reference on copies of `tensors`, backward of
    a random linear function of out and router_logits; returns both sides'
    (out, counts, logits, grads)."""
    res = []
    T, d = tensors[0].shape
    E = tensors[1].shape[0]
    g = torch.Generator().manual_seed(123)
    dout = torch.randn(T, d, generator=g, dtype=torch.float64)
    # router_logits are float32 on every layer (the header's contract), so
    # is their incoming gradient: make it exactly representable.
    dlog = (torch.randn(T, E, generator=g, dtype=torch.float64) * 0.3).float().double()
    for fn in (smoe.moe, moe_ref):
        ins = leaves(*tensors) if fn is smoe.moe else leaves(
            *[None if t is None else t.to(dtype_ref) for t in tensors])
        out, counts, logits = fn(*ins, **kw)
        loss = (out.double() * dout).sum() + (logits.double() * dlog).sum()
        loss.backward()
        res.append((out.detach().double(), counts, logits.detach().double(),
                    [None if t is None else t.grad.double() for t in ins]))
    return res


def assert_close(a, b, tol, what):
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1e-3)
    assert err <= tol * scale, "%s: max error %.3g, scale %.3g, tol %.3g" % (what, err, scale, tol)


NAMES = ["x", "router_w", "w1", "w2", "b1", "b2"]


def check(res, tol, logits_tol=None):
    (o, c, l, g), (ro, rc, rl, rg) = res
    assert torch.equal(c, rc), "expert counts %s vs %s" % (c.tolist(), rc.tolist())
    assert_close(o, ro, tol, "out")
    assert_close(l, rl, logits_tol or max(tol, 1e-6), "router_logits")
    for name, a, b in zip(NAMES, g, rg):
        if b is None:
            assert a is None
            continue
        assert_close(a, b, tol, "grad " + name)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("routing,renorm", [("topk_softmax", True), ("softmax_topk", True),
                                            ("softmax_topk", False)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference_f64(act, routing, renorm, bias):
    t = make(T=13, d=12, n=8, E=5, act=act, bias=bias, seed=hash((act, routing, renorm, bias)) % 1000)
    res = run_both(t, top_k=2, routing=routing, renormalize=renorm, activation=act)
    # router_logits are float32 (the header's contract) even for f64 layers.
    check(res, 1e-9, logits_tol=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_w1_layouts(layout, act):
    t = make(T=9, d=8, n=6, E=4, act=act, bias=True, seed=7)
    res = run_both(t, top_k=3, activation=act, w1_layout=layout)
    check(res, 1e-9, logits_tol=1e-6)


def test_concatenated_is_permuted_interleaved():
    x, r, w1, w2, b1, b2 = make(T=7, d=8, n=4, E=3, act="swiglu", bias=True, seed=3)
    out_i, _, _ = smoe.moe(x, r, w1, w2, b1, b2, top_k=2, w1_layout="interleaved")
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    out_c, _, _ = smoe.moe(x, r, w1[:, perm].contiguous(), w2, b1[:, perm].contiguous(), b2,
                           top_k=2, w1_layout="concatenated")
    assert_close(out_c, out_i, 1e-12, "out")


@pytest.mark.parametrize("K", [1, 4])
def test_k_edges(K):
    # K = 1 and K = E (every token on every expert).
    t = make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=K)
    for routing in ("topk_softmax", "softmax_topk"):
        res = run_both(t, top_k=K, routing=routing)
        check(res, 1e-9, logits_tol=1e-6)


def test_single_token_and_leading_dims():
    x, r, w1, w2, _, _ = make(T=6, d=8, n=4, E=4, act="swiglu", bias=False, seed=11)
    out, counts, logits = smoe.moe(x.view(2, 3, 8), r, w1, w2, top_k=2)
    assert out.shape == (2, 3, 8) and logits.shape == (2, 3, 4) and counts.shape == (4,)
    ref, _, _ = moe_ref(x, r, w1, w2, top_k=2)
    assert_close(out.view(6, 8), ref, 1e-12, "out")
    out1, counts1, _ = smoe.moe(x[:1], r, w1, w2, top_k=2)
    ref1, rc1, _ = moe_ref(x[:1], r, w1, w2, top_k=2)
    assert_close(out1, ref1, 1e-12, "out T=1")
    assert int(counts1.sum()) == 2 and torch.equal(counts1, rc1)


@pytest.mark.parametrize("rounding", ["up", "down", "nearest"])
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
def test_token_rounding(rounding, routing):
    t = make(T=29, d=8, n=6, E=4, act="swiglu", bias=True, seed=17)
    res = run_both(t, top_k=2, routing=routing, token_rounding=rounding, round_tile=4)
    check(res, 1e-9, logits_tol=1e-6)
    counts = res[0][1]
    assert all(int(c) % 4 == 0 or int(c) == 29 for c in counts), counts


def test_token_rounding_not_in_inference():
    x, r, w1, w2, _, _ = make(T=29, d=8, n=6, E=4, act="swiglu", bias=False, seed=5)
    out_inf, c_inf, _ = smoe.moe(x, r, w1, w2, top_k=2, token_rounding="up", round_tile=4,
                                 inference=True)
    out_tc, c_tc, _ = smoe.moe(x, r, w1, w2, top_k=2, routing="topk_softmax")
    assert torch.equal(c_inf, c_tc)
    assert_close(out_inf, out_tc, 1e-12, "inference ignores rounding")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("act", ["swiglu", "relu2", "gelu"])
def test_low_precision(dtype, tol, act):
    # Inputs rounded to `dtype`; the reference runs in float64 on the same
    # rounded values. bf16 outputs and gradients are stored in bf16.
    t = make(T=16, d=16, n=8, E=4, act=act, bias=True, dtype=dtype, seed=21)
    res = run_both(t, top_k=2, activation=act, routing="softmax_topk")
    check(res, tol, logits_tol=1e-5)


def test_inference_flag_same_output_and_no_backward():
    x, r, w1, w2, b1, b2 = leaves(*make(T=8, d=8, n=4, E=4, act="swiglu", bias=True, seed=2))
    out_t, _, _ = smoe.moe(x, r, w1, w2, b1, b2, top_k=2)
    out_i, _, _ = smoe.moe(x, r, w1, w2, b1, b2, top_k=2, inference=True)
    assert torch.equal(out_t.detach(), out_i.detach())
    with pytest.raises(smoe.SmoeError, match="inference"):
        out_i.sum().backward()


def test_grads_not_requested_are_none():
    x, r, w1, w2, _, _ = make(T=8, d=8, n=4, E=4, act="swiglu", bias=False, seed=4)
    w1 = w1.clone().requires_grad_()
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    out.sum().backward()
    assert w1.grad is not None and x.grad is None and r.grad is None and w2.grad is None
    ref_w1 = w1.detach().clone().requires_grad_()
    moe_ref(x, r, ref_w1, w2, top_k=2)[0].sum().backward()
    assert_close(w1.grad, ref_w1.grad, 1e-10, "dw1")


def test_grads_overwrite_and_accumulate_across_calls():
    # The library overwrites its gradient buffers; autograd then sums the
    # contributions of two calls into .grad as usual.
    x, r, w1, w2, _, _ = leaves(*make(T=8, d=8, n=4, E=4, act="swiglu", bias=False, seed=6))
    (smoe.moe(x, r, w1, w2, top_k=2)[0].sum() * 2).backward()
    g_once = w2.grad.clone()
    w2.grad = None
    smoe.moe(x, r, w1, w2, top_k=2)[0].sum().backward()
    smoe.moe(x, r, w1, w2, top_k=2)[0].sum().backward()
    assert_close(w2.grad, g_once, 1e-12, "two backward calls")


def test_only_router_logits_used():
    # A loss on router_logits alone: the gradient reaches router_w and x
    # through dlogits_extra (dout is zero).
    x, r, w1, w2, _, _ = leaves(*make(T=8, d=8, n=4, E=4, act="swiglu", bias=False, seed=8))
    _, _, logits = smoe.moe(x, r, w1, w2, top_k=2, routing="softmax_topk")
    logits.pow(2).sum().backward()
    xr, rr = leaves(x, r)
    (xr @ rr.T).float().double().pow(2).sum().backward()
    assert_close(r.grad, rr.grad, 1e-6, "drouter_w")
    assert_close(x.grad, xr.grad, 1e-6, "dx")
    assert w1.grad is None or float(w1.grad.abs().max()) == 0.0


def general_triples(T, E, seed, p=0.45):
    g = torch.Generator().manual_seed(seed)
    sel = torch.rand(T, E, generator=g) < p
    tok, exp = sel.nonzero(as_tuple=True)
    score = torch.rand(tok.numel(), generator=g, dtype=torch.float32) + 0.1
    return tok.to(torch.int32), exp.to(torch.int32), score


@pytest.mark.parametrize("act", ["swiglu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_general_routing(act, bias):
    x, _, w1, w2, b1, b2 = make(T=11, d=8, n=6, E=5, act=act, bias=bias, seed=9)
    tok, exp, score = general_triples(11, 5, seed=1)
    assert (torch.bincount(tok, minlength=11) == 0).any()  # a token with no expert
    ins = leaves(x, w1, w2, b1, b2)
    sc = score.clone().requires_grad_()
    out, counts = smoe.moe_general(ins[0], tok, exp, sc, ins[1], ins[2], ins[3], ins[4],
                                   activation=act)
    ref_ins = leaves(x, w1, w2, b1, b2)
    rsc = score.double().requires_grad_()
    rout, rcounts = moe_general_ref(ref_ins[0], tok, exp, rsc, *ref_ins[1:], activation=act)
    assert torch.equal(counts, rcounts)
    assert_close(out, rout, 1e-6, "out")  # float32 scores
    dout = torch.randn_like(rout)
    (out * dout).sum().backward()
    (rout * dout).sum().backward()
    for name, a, b in zip(["x", "w1", "w2", "b1", "b2"], ins, ref_ins):
        if b is not None:
            assert_close(a.grad, b.grad, 1e-6, "grad " + name)
    assert_close(sc.grad.double(), rsc.grad, 1e-5, "grad pair_score")


def test_general_no_pairs():
    x, _, w1, w2, _, _ = make(T=4, d=8, n=4, E=3, act="swiglu", bias=False, seed=10)
    e = torch.empty(0, dtype=torch.int32)
    out, counts = smoe.moe_general(x, e, e, torch.empty(0), w1, w2)
    assert float(out.abs().max()) == 0.0 and int(counts.sum()) == 0


def test_autograd_keeps_only_the_saved_block():
    # What autograd keeps between forward and backward: the inputs (held by
    # the caller anyway) and one uint8 block of smoe_layer_saved_bytes().
    x, r, w1, w2, b1, b2 = leaves(*make(T=10, d=8, n=4, E=4, act="swiglu", bias=True, seed=12))
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, _ = smoe.moe(x, r, w1, w2, b1, b2, top_k=2)
    # (x is saved as its (T, d) view: same storage, no copy.)
    inputs = {t.untyped_storage().data_ptr() for t in (x, r, w1, w2, b1, b2)}
    extra = [t for t in packed if t.untyped_storage().data_ptr() not in inputs]
    assert len(extra) == 1 and extra[0].dtype == torch.uint8, [(t.dtype, t.shape) for t in extra]
    want = smoe.functional.saved_bytes(10, 0, d=8, n=4, E=4, K=2, activation=0, routing=0,
                                       rounding=0, round_tile=128, dtype=2)
    assert extra[0].numel() == want
    # H alone is T*K rows of 2n float64: the block holds little besides it.
    assert want < 10 * 2 * 8 * 8 + 6 * 256 + 10 * 2 * 24


def test_no_grad_keeps_nothing():
    x, r, w1, w2, _, _ = make(T=10, d=8, n=4, E=4, act="swiglu", bias=False, seed=12)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        smoe.moe(x, r, w1, w2, top_k=2)
    assert packed == []


def test_layers_cached_per_configuration():
    from smoe import functional as fn
    x, r, w1, w2, _, _ = make(T=5, d=8, n=4, E=4, act="swiglu", bias=False, seed=1)
    smoe.moe(x, r, w1, w2, top_k=2)
    before = len(fn._layers)
    smoe.moe(x, r, w1, w2, top_k=2)
    smoe.moe(x[:3], r, w1, w2, top_k=2)
    assert len(fn._layers) == before
    smoe.moe(x, r, w1, w2, top_k=3)
    assert len(fn._layers) == before + 1


@pytest.mark.parametrize("routing,rounding", list(itertools.product(
    ["topk_softmax", "softmax_topk"], [None, "up", "down", "nearest"])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_saved_bytes_formula_matches_library(routing, rounding, dtype):
    from smoe import functional as fn
    from smoe import _lib as L
    act = L.SMOE_ACT_SWIGLU
    for T in (1, 3, 64, 1000):
        for E, K, M in ((4, 2, 128), (7, 3, 4)):
            cfg = (24, 16, E, K, act, 0, False, fn.ROUTINGS[routing], True, fn.ROUNDINGS[rounding],
                   M, fn._DTYPES[dtype], 0, 0, 1.0, False)
            layer = fn._get_layer(cfg, torch.device("cpu"))
            want = layer.saved_bytes(T, 0)
            got = fn.saved_bytes(T, 0, d=24, n=16, E=E, K=K, activation=act,
                                 routing=fn.ROUTINGS[routing], rounding=fn.ROUNDINGS[rounding],
                                 round_tile=M, dtype=fn._DTYPES[dtype])
            assert got == want, (T, E, K, M)
    cfg = (24, 16, 5, 0, L.SMOE_ACT_RELU, 0, True, L.SMOE_ROUTING_GENERAL, False, 0, 128,
           fn._DTYPES[dtype], 0, 0, 1.0, False)
    layer = fn._get_layer(cfg, torch.device("cpu"))
    for pairs in (0, 1, 17):
        assert layer.saved_bytes(9, pairs) == fn.saved_bytes(
            9, pairs, d=24, n=16, E=5, K=0, activation=L.SMOE_ACT_RELU,
            routing=L.SMOE_ROUTING_GENERAL, rounding=0, round_tile=128, dtype=fn._DTYPES[dtype])
