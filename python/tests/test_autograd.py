"""torch.autograd.gradcheck in float64 on the CPU backend, and
torch.library.opcheck of the custom operators (schema, fake/meta
implementations, autograd registration)."""
import pytest
import torch

import smoe
from test_functional import general_triples, make


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


@pytest.mark.parametrize("routing,rounding", [("topk_softmax", None), ("softmax_topk", None),
                                              ("softmax_topk", "up"), ("topk_softmax", "down")])
@pytest.mark.parametrize("act", ["swiglu", "relu2", "gelu"])
def test_gradcheck_f64(routing, rounding, act):
    ins = [leaf(t) for t in make(T=9, d=4, n=3, E=3, act=act, bias=True, seed=31)]

    def f(x, r, w1, w2, b1, b2):
        return smoe.moe(x, r, w1, w2, b1, b2, top_k=2, routing=routing, activation=act,
                        token_rounding=rounding, round_tile=2)[0]

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradcheck_concatenated_no_bias():
    x, r, w1, w2, _, _ = [leaf(t) for t in make(T=6, d=4, n=3, E=4, act="geglu", bias=False,
                                                    seed=32)]

    def f(x, r, w1, w2):
        return smoe.moe(x, r, w1, w2, top_k=3, activation="geglu", w1_layout="concatenated",
                        routing="softmax_topk", renormalize=False)[0]

    assert torch.autograd.gradcheck(f, (x, r, w1, w2), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradcheck_general_f64():
    x, _, w1, w2, b1, b2 = [leaf(t) for t in make(T=5, d=4, n=3, E=3, act="swiglu", bias=True,
                                                    seed=33)]
    tok, exp, score = general_triples(5, 3, seed=2, p=0.6)

    def f(x, w1, w2, b1, b2):
        return smoe.moe_general(x, tok, exp, score, w1, w2, b1, b2)[0]

    assert torch.autograd.gradcheck(f, (x, w1, w2, b1, b2), eps=1e-6, atol=1e-7, rtol=1e-6)


def _fwd_args(save=True, bias=True, routing=0, rounding=0, consume=0, lowp=0):
    x, r, w1, w2, b1, b2 = make(T=8, d=8, n=4, E=4, act="swiglu", bias=bias, seed=34,
                                dtype=torch.float32)
    ins = [t.requires_grad_() if t is not None else None for t in (x, r, w1, w2, b1, b2)]
    x, r, w1, w2, b1, b2 = ins
    sigmoid = routing == smoe.functional.ROUTINGS["sigmoid_topk"]
    # SIGMOID_TOPK: an expert bias, 2 groups of which 1 is kept, scaling 2.5.
    eb = torch.randn(4, generator=torch.Generator().manual_seed(35)) if sigmoid else None
    G, g, scaling = (2, 1, 2.5) if sigmoid else (0, 0, 1.0)
    # expert_bias; config: top_k, routing, renormalize, activation, w1_layout,
    # rounding, round_tile, n_group, topk_group, consume_saved, inference,
    # save, logits_lowp; routed_scaling
    return (x, r, None, None, None, w1, w2, b1, b2, eb,
            [2, routing, 1, 0, 0, rounding, 4, G, g, consume, 0, int(save), lowp], scaling)


# opcheck's AOT-dispatch tests compare every output bit for bit between two
# runs; the saved block's padding and its rows past R are never written
# (filling them would cost a memset of H per call), so those tests are left
# out here, and test_compile.py checks the compiled results instead.
_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("routing,rounding,lowp", [(0, 0, 0), (1, 0, 0), (1, 1, 0), (3, 0, 0),
                                                   (1, 0, 1)])
def test_opcheck_forward(routing, rounding, lowp):
    # lowp: the router logits in x's dtype (router_logits_dtype)
    torch.library.opcheck(torch.ops.smoe.moe_forward.default,
                          _fwd_args(routing=routing, rounding=rounding, lowp=lowp),
                          test_utils=_CHECKS)


def test_opcheck_forward_no_bias_no_save():
    # save=False is what smoe.moe passes when nothing needs a gradient.
    torch.library.opcheck(torch.ops.smoe.moe_forward.default, _fwd_args(save=False, bias=False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("routing", [0, 3])
def test_opcheck_backward(routing):
    args = _fwd_args(routing=routing)
    x, r, w1, w2, b2 = args[0], args[1], args[5], args[6], args[8]
    config, scaling = args[10], args[11]
    with torch.no_grad():
        out, counts, logits, saved = torch.ops.smoe.moe_forward(*args)
    dout = torch.randn_like(out)
    dlog = torch.randn_like(logits)
    # config: pairs, has_bias, top_k, routing, renormalize, activation,
    # w1_layout, rounding, round_tile, n_group, topk_group, consume_saved, needs;
    # routed_scaling
    bargs = (dout, dlog, x.detach(), r.detach(), w1.detach(), w2.detach(), b2.detach(), saved,
             [0, 1, *config[:10], 0b111111], scaling)
    torch.library.opcheck(torch.ops.smoe.moe_backward.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("routing", [0, 3])
def test_opcheck_backward_consume(routing):
    # The consuming backward declares `saved` mutated; opcheck's schema test
    # checks that it writes only what it declares. Each check runs the
    # backward again, on a fresh block: the library refuses a consumed one.
    args = _fwd_args(routing=routing, consume=1)
    x, r, w1, w2, b2 = args[0], args[1], args[5], args[6], args[8]
    config, scaling = args[10], args[11]
    with torch.no_grad():
        out, _, logits, _ = torch.ops.smoe.moe_forward(*args)
    dout = torch.randn_like(out)
    dlog = torch.randn_like(logits)
    for check in ("test_schema", "test_faketensor"):
        with torch.no_grad():
            saved = torch.ops.smoe.moe_forward(*args)[3]
        bargs = (dout, dlog, x.detach(), r.detach(), w1.detach(), w2.detach(), b2.detach(),
                 saved, [0, 1, *config[:10], 0b111111], scaling)
        torch.library.opcheck(torch.ops.smoe.moe_backward_consume.default, bargs,
                              test_utils=(check,))
