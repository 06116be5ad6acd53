"""Non-finite inputs follow PyTorch (include/smoe.h, "Non-finite values"):
a NaN or an infinity in x, router_w, w1, w2 or the incoming gradient
propagates as IEEE arithmetic does, and the router's top-K ranks NaN above
every number. smoe.moe in float64 on the CPU against the plain PyTorch
reference (reference.py, autograd for the gradients): the output, the
router logits and every gradient must be non-finite at exactly the same
places (torch.isfinite masks) and close where finite, with the same expert
counts. A CUDA variant (bfloat16 against the same float64 reference) is
skipped without a GPU. GENERAL pair scores that are not finite are refused.

Where smoe and the reference differ (see SKIPPED and
nan_token_cannot_displace), the cases are left out, not hidden:
 - softmax_topk with +inf or NaN next to numbers in a token's logits
   (+inf in x, NaN or +inf in router_w): that token's softmax row is all
   NaN; the reference's top-K of those probabilities picks the experts of
   lowest index, smoe the K largest logits (smoe.h: both token-choice modes
   pick the K largest logits).
 - token rounding with a NaN token: the reference ranks an expert's tokens
   by one combined key (the renormalised probability for the tokens that
   chose the expert, p - 1 for the others), where a NaN key ranks first
   over all of them, so a NaN token that did not choose expert e displaces
   one that did when e's count is already a multiple of round_tile; smoe
   never drops a token's own choice when rounding up, and ranks NaN first
   only among the tokens it adds.
"""
import pytest
import torch

import smoe
from reference import moe_general_ref, moe_ref, topk
from test_functional import assert_close, leaves, make

NAN, INF = float("nan"), float("inf")
T, D, N, E, K = 6, 8, 4, 4, 2


def inject(t, where, value, dout):
    """Copies of (x, router_w, w1, w2) and dout with `value` put in one place:
    x one element of token 2 (every logit of token 2 becomes non-finite),
    router_w the whole row of expert 1 ('router_w') or one element of it
    ('router_w_elem': the logit of expert 1 becomes +-inf by x's sign), w1
    one element of expert 1, w2 one element of expert 1, dout the row of
    token 2."""
    x, r, w1, w2 = (v.clone() for v in t)
    dout = dout.clone()
    if where == "x":
        x[2, 3] = value
    elif where == "router_w":
        r[1, :] = value
    elif where == "router_w_elem":
        r[1, 2] = value
    elif where == "w1":
        w1[1, 2, 3] = value
    elif where == "w2":
        w2[1, 3, 1] = value
    elif where == "dout":
        dout[2, :] = value
    else:
        raise ValueError(where)
    return (x, r, w1, w2), dout


def outputs_and_grads(fn, tensors, dout, dlog, **kw):
    """(counts, [out, router_logits, dx, drouter_w, dw1, dw2]) in float64,
    backward of sum(out * dout) + sum(router_logits * dlog)."""
    ins = leaves(*tensors)
    out, counts, logits = fn(*ins, **kw)
    loss = (out.double() * dout).sum() + (logits.double() * dlog).sum()
    loss.backward()
    return counts.cpu(), [v.detach().double().cpu() for v in
                          [out, logits] + [i.grad for i in ins]]


NAMES = ["out", "router_logits", "dx", "drouter_w", "dw1", "dw2"]


def assert_same_nonfinite(got, want, tol, what):
    fg, fw = torch.isfinite(got), torch.isfinite(want)
    if not torch.equal(fg, fw):
        diff = (fg != fw).nonzero()
        i = tuple(diff[0].tolist())
        raise AssertionError("%s: non-finite at different places (%d of them); first at %s: "
                             "smoe %r, reference %r" % (what, diff.shape[0], list(i),
                                                        got[i].item(), want[i].item()))
    if fg.any():
        assert_close(got[fg], want[fw], tol, what + " (where finite)")


def compare(tensors, dout, dlog, tol, logits_tol, device="cpu", dtype=torch.float64, **kw):
    """smoe.moe on `device` in `dtype` against moe_ref in float64 on the
    CPU, on the same (rounded) values."""
    mine = [v.to(device=device, dtype=dtype) for v in tensors]
    ref_in = [v.to(dtype).double() for v in tensors]   # the values smoe sees
    dout_m = dout.to(device=device, dtype=torch.float64)
    dout_r = dout.to(dtype).double()
    counts, got = outputs_and_grads(smoe.moe, mine, dout_m, dlog.to(device), **kw)
    rcounts, want = outputs_and_grads(moe_ref, ref_in, dout_r, dlog, **kw)
    assert torch.equal(counts, rcounts), "expert counts %s, reference %s" % (
        counts.tolist(), rcounts.tolist())
    for name, g, w in zip(NAMES, got, want):
        assert_same_nonfinite(g, w, logits_tol if name == "router_logits" else tol, name)
    # The injection must have reached something.
    assert not all(bool(torch.isfinite(w).all()) for w in want)
    return got


def base(seed=0):
    t = make(T=T, d=D, n=N, E=E, act="swiglu", bias=False, seed=seed)[:4]
    g = torch.Generator().manual_seed(123)
    dout = torch.randn(T, D, generator=g, dtype=torch.float64)
    # router_logits are float32: their incoming gradient exactly so.
    dlog = (torch.randn(T, E, generator=g, dtype=torch.float64) * 0.3).float().double()
    return t, dout, dlog


# (routing, token_rounding, where, value): every case where smoe and the
# reference agree.
CASES = []
for _v in (NAN, INF):
    for _where in ("x", "router_w", "router_w_elem", "w1", "w2", "dout"):
        CASES.append(("topk_softmax", None, _where, _v))
    for _where in ("w1", "w2", "dout"):
        CASES.append(("softmax_topk", None, _where, _v))
        CASES.append(("softmax_topk", "up", _where, _v))
# NaN in x makes every logit of its token NaN: the softmax row is NaN in
# both, and both take the first K experts (equal keys: the lower index).
CASES.append(("softmax_topk", None, "x", NAN))
CASES.append(("softmax_topk", "up", "x", NAN))
CASES.append(("topk_softmax", "up", "x", NAN))

# Left out: softmax_topk (with or without rounding) and +inf in x, or NaN or
# +inf in router_w. A token whose logits hold +inf or NaN next to numbers
# has an all-NaN softmax row; the reference (softmax, then top-K of the
# probabilities) then picks the experts of lowest index, smoe the K largest
# logits (smoe.h: both token-choice modes pick the K largest logits). The
# outputs of such tokens are NaN in both, but the expert counts differ, and
# so does which experts' dw1/dw2 the NaN reaches. With token_rounding='up'
# the rounding order differs too (nan_token_cannot_displace).
SKIPPED = [("softmax_topk", r, w, v) for r in (None, "up")
                        for w, v in (("x", INF), ("router_w", NAN), ("router_w", INF),
                                     ("router_w_elem", NAN), ("router_w_elem", INF))]


def nan_token_cannot_displace(tensors, K, M, token=2):
    """Whether the token rounding of these inputs (NaN in x at `token`) is
    free of the one known difference: in the reference a NaN token that did
    not choose expert e displaces one that did whenever e's token-choice
    count is a positive multiple of M (nothing to add; the reference still
    re-ranks every token by its combined key, NaN first), while smoe keeps
    the tokens' own choices. The tests pick round_tile so that no such
    expert exists (and the rounding still adds tokens)."""
    x, r = (v.double() for v in tensors[:2])
    _, idx = topk(torch.softmax(x @ r.T, dim=-1), K)
    chose = torch.zeros(x.shape[0], r.shape[0], dtype=torch.bool).scatter(1, idx, True)
    f = chose.sum(0)
    return all(bool(chose[token, e]) or int(f[e]) % M != 0 for e in range(r.shape[0]))


def _id(case):
    routing, rounding, where, value = case
    return "%s-%s-%s-%s" % (routing, rounding or "plain", where, value)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_nonfinite_matches_reference_f64(case):
    routing, rounding, where, value = case
    t, dout, dlog = base()
    tensors, dout = inject(t, where, value, dout)
    kw = dict(top_k=K, routing=routing)
    if rounding:
        kw.update(token_rounding=rounding, round_tile=4)
        if where == "x":
            assert nan_token_cannot_displace(tensors, K, 4)
    got = compare(tensors, dout, dlog, 1e-9, 1e-6, **kw)
    if where == "x" and value != value:
        # NaN in one token's x: its output row is NaN, the others are not.
        finite_rows = torch.isfinite(got[0]).all(1)
        assert not finite_rows[2] and finite_rows[[0, 1, 3, 4, 5]].all()


def test_general_nan_in_x_matches_reference():
    x, _, w1, w2 = base()[0]
    x = x.clone()
    x[1, 0] = NAN
    tok = torch.tensor([0, 0, 1, 2, 3, 5], dtype=torch.int32)
    exp = torch.tensor([0, 2, 1, 1, 3, 0], dtype=torch.int32)
    score = torch.tensor([0.5, 0.25, 1.0, 0.75, 0.5, 2.0])
    ins = leaves(x, score, w1, w2)
    out, counts = smoe.moe_general(ins[0], tok, exp, ins[1], ins[2], ins[3])
    out.sum().backward()
    rins = leaves(x, score.double(), w1, w2)
    rout, rcounts = moe_general_ref(rins[0], tok, exp, rins[1], rins[2], rins[3])
    rout.sum().backward()
    assert torch.equal(counts, rcounts)
    for name, g, w in (("out", out, rout), ("dx", ins[0].grad, rins[0].grad),
                       ("dpair_score", ins[1].grad, rins[1].grad),
                       ("dw1", ins[2].grad, rins[2].grad), ("dw2", ins[3].grad, rins[3].grad)):
        assert_same_nonfinite(g.double(), w.double(), 1e-6 if name == "dpair_score" else 1e-9,
                              name)
    assert not torch.isfinite(out[1]).any() and torch.isfinite(out[[0, 2, 3, 4, 5]]).all()


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_general_nonfinite_scores_refused(value):
    x, _, w1, w2 = base()[0]
    tok = torch.tensor([0, 1, 2], dtype=torch.int32)
    exp = torch.tensor([0, 1, 2], dtype=torch.int32)
    score = torch.tensor([1.0, value, 1.0])
    for validate in (None, True):
        with pytest.raises(smoe.SmoeError, match=r"pair_score\[1\] = .* is not finite") as e:
            smoe.moe_general(x, tok, exp, score, w1, w2, validate=validate)
        assert e.value.status == smoe._lib.SMOE_ERROR_INVALID_VALUE


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The GPU backends need d and n multiples of 8.
CT, CD, CN, CE = 8, 32, 16, 4


def cuda_base(seed=1):
    t = make(T=CT, d=CD, n=CN, E=CE, act="swiglu", bias=False, seed=seed)[:4]
    g = torch.Generator().manual_seed(321)
    dout = torch.randn(CT, CD, generator=g, dtype=torch.float64)
    dlog = (torch.randn(CT, CE, generator=g, dtype=torch.float64) * 0.3).float().double()
    return t, dout, dlog


@cuda
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_nonfinite_matches_reference_cuda_bf16(case):
    routing, rounding, where, value = case
    t, dout, dlog = cuda_base()
    tensors, dout = inject(t, where, value, dout)
    kw = dict(top_k=K, routing=routing)
    if rounding:
        # Expert counts 3, 6, 3, 4 here: round_tile 4 would meet the known
        # difference (nan_token_cannot_displace), 5 does not.
        kw.update(token_rounding=rounding, round_tile=5)
        if where == "x":
            assert nan_token_cannot_displace([v.to(torch.bfloat16) for v in tensors], K, 5)
    compare(tensors, dout, dlog, 5e-2, 5e-2, device="cuda", dtype=torch.bfloat16, **kw)
    smoe.check_device()
