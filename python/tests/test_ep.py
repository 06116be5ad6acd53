"""smoe.EPMoE on the CPU: P ranks as P threads of this process over
smoe.EPGroup.in_process(P) (the library's in-process transport), in float64
against the PyTorch reference (reference.py) on the whole batch: output,
dx, the router's gradient summed over the ranks, every expert's weight
gradient, the expert counts and the router logits it returns; routing
'sigmoid_topk' with groups, scaling and an expert bias; the load-balancing
loss of each rank's tokens and of the group's (against the single layer's on
the gathered batch, value and gradient); the constructor's refusals, made
before the group is touched (smoe.MoE's messages for the routing options).
tests/test_ep_gpu.py runs the same layer over NCCL."""
import threading

import pytest
import torch

import smoe
from smoe import _lib as L
import reference as R
from test_functional import assert_close, make

E, D, N = 8, 16, 8
# Tokens per rank: unequal, one rank with none at P = 4.
SPLITS = {1: [12], 2: [7, 5], 4: [5, 0, 4, 3]}
SIGMOID = dict(routing="sigmoid_topk", n_group=4, topk_group=2, routed_scaling=2.5)


def run_ranks(P, fn):
    """fn(rank, group) on P threads, one per rank of an in-process group;
    their results in rank order, or the first rank's failure raised."""
    groups = smoe.EPGroup.in_process(P)
    results, errors = [None] * P, [None] * P

    def main(r):
        try:
            results[r] = fn(r, groups[r])
        except BaseException as e:  # noqa: B902 (reported below)
            errors[r] = e
            groups[r]._threads.barrier.abort()   # the other ranks' all_reduce waits end

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a rank is still waiting (a collective another rank skipped)"
    for e in errors:
        if e is not None:
            raise e
    return results


def random_bias(seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, generator=g, dtype=torch.float32) * scale


def switch_ref(logits, counts):
    """The Switch loss in float64 from the reference's logits and counts."""
    p = torch.softmax(logits, -1).sum(0)
    f = counts.double() / counts.sum()
    return E * ((p / p.sum()) * f).sum()


def ep_layer(group, K, t, bias, **kw):
    """An EPMoE on `group` holding its experts' share of the whole layer's
    weights t = (x, router, w1, w2, b1, b2), float64."""
    _, wr, w1, w2, b1, b2 = t
    m = smoe.EPMoE(E, K, D, N, "swiglu", b1 is not None, ep_group=group, **kw).double()
    lo, hi = m.expert_start, m.expert_start + m.local_experts
    with torch.no_grad():
        m.router.weight.copy_(wr)
        m.c_fc.weight.copy_(w1[lo:hi])
        m.c_proj.weight.copy_(w2[lo:hi])
        if b1 is not None:
            m.c_fc.bias.copy_(b1[lo:hi])
            m.c_proj.bias.copy_(b2[lo:hi])
        if bias is not None:
            m.expert_bias.copy_(bias)
    return m


def batch(P, act_bias, seed):
    """The whole batch over P ranks: (split, offsets, the layer's tensors t =
    (x, router, w1, w2, b1, b2) float64, dout, dlog)."""
    split = SPLITS[P]
    T = sum(split)
    offs = [sum(split[:r]) for r in range(P + 1)]
    t = make(T, D, N, E, "swiglu", act_bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(T, D, generator=g, dtype=torch.float64)
    dlog = torch.randn(T, E, generator=g, dtype=torch.float64) * 0.3
    return split, offs, t, dout, dlog


def gather(res, act_bias):
    """The ranks' results as the whole batch's: tokens' and experts' rows
    concatenated in rank order, the router's gradient (summed over the
    group, so the same on every rank), the counts summed."""
    ep = {k: torch.cat([v[k] for v in res]) for k in ("out", "dx", "logits", "dw1", "dw2")}
    if act_bias:
        ep["db1"] = torch.cat([v["db1"] for v in res])
        ep["db2"] = torch.cat([v["db2"] for v in res])
    ep["dwr"] = res[0]["dwr"]
    for v in res[1:]:
        assert torch.equal(v["dwr"], ep["dwr"])
    ep["counts"] = sum(v["counts"] for v in res)
    return ep


def run_case(P, K, kw, bias=None, act_bias=True, aux_coef=0.5, seed=0):
    """The layer over P ranks and the reference on the whole batch, each
    differentiating sum(out * dout) + sum(logits * dlog) + aux_coef * (each
    rank's aux_loss); returns (ep results, reference results)."""
    split, offs, t, dout, dlog = batch(P, act_bias, seed)
    routing = kw.get("routing", "topk_softmax")
    scope = kw.get("aux_loss_scope", "local")

    def rank(r, group):
        m = ep_layer(group, K, t, bias, max_tokens=max(split), **kw)
        x = t[0][offs[r]:offs[r + 1]].clone().requires_grad_()
        out, aux, logits = m(x, output_router_logits=True)
        s = slice(offs[r], offs[r + 1])
        loss = (out * dout[s]).sum() + (logits.double() * dlog[s]).sum() + aux_coef * aux
        loss.backward()
        m.reduce_router_grad()
        bs = (m.c_fc.bias.grad, m.c_proj.bias.grad) if act_bias else (None, None)
        return dict(out=out.detach(), dx=x.grad, logits=logits.detach(), aux=aux.detach(),
                    counts=m.last_expert_counts, dwr=m.router.weight.grad,
                    dw1=m.c_fc.weight.grad, dw2=m.c_proj.weight.grad, db1=bs[0], db2=bs[1])

    res = run_ranks(P, rank)
    ep = gather(res, act_bias)
    ep["aux"] = [v["aux"] for v in res]

    if routing == "sigmoid_topk":
        opts = {k: v for k, v in kw.items() if k in ("n_group", "topk_group", "routed_scaling",
                                                      "renormalize")}

        def ref_fn(*a):
            return R.moe_sigmoid_ref(*a, top_k=K, expert_bias=bias, **opts)
    else:
        def ref_fn(*a):
            return R.moe_ref(*a, top_k=K, routing=routing, renormalize=kw.get("renormalize", True))
    ins = [None if v is None else v.clone().requires_grad_() for v in t]
    out, counts, logits = ref_fn(*ins)
    if scope == "group":
        aux = [switch_ref(logits, counts)] * P
    else:   # each rank's tokens: their logits, and their counts
        aux = []
        for r in range(P):
            lg = logits[offs[r]:offs[r + 1]]
            aux.append(switch_ref(lg, ref_fn(t[0][offs[r]:offs[r + 1]], *t[1:])[1])
                       if lg.shape[0] else lg.sum())
    loss = (out * dout).sum() + (logits * dlog).sum() + aux_coef * sum(aux)
    loss.backward()
    ref = dict(out=out.detach(), dx=ins[0].grad, logits=logits.detach(), counts=counts,
               dwr=ins[1].grad, dw1=ins[2].grad, dw2=ins[3].grad, aux=aux)
    if act_bias:
        ref["db1"], ref["db2"] = ins[4].grad, ins[5].grad
    return ep, ref


def check(ep, ref, tol=1e-6):
    # (The F64 EP layer passes its scores to the experts as float32,
    # smoe.h: ~1e-7 from the reference, not 1e-12.)
    assert torch.equal(ep["counts"], ref["counts"]), (ep["counts"], ref["counts"])
    assert_close(ep["out"], ref["out"], tol, "out")
    assert_close(ep["logits"].double(), ref["logits"], tol, "router_logits")
    for k in ("dx", "dwr", "dw1", "dw2", "db1", "db2"):
        if k in ref:
            assert_close(ep[k], ref[k], tol, "grad " + k)


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
def test_matches_reference(P, routing):
    ep, ref = run_case(P, 2, dict(routing=routing))
    check(ep, ref)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_keep_x_same_bits(P):
    # keep_x keeps the received rows of x for the backward instead of
    # sending them again: the same computation, so the same bits.
    ep, ref = run_case(P, 2, dict(routing="softmax_topk", keep_x=True))
    check(ep, ref)
    ep0, _ = run_case(P, 2, dict(routing="softmax_topk"))
    for k in ("out", "dx", "dwr", "dw1", "dw2", "db1", "db2"):
        assert torch.equal(ep[k], ep0[k]), k


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_topk_groups_scaling_bias(P, renormalize):
    # DeepSeek-V3's shape of options, a non-zero bias replicated on every
    # rank; the routing choice differs from the unbiased one.
    bias = random_bias(5)
    kw = dict(SIGMOID, renormalize=renormalize)
    ep, ref = run_case(P, 3, kw, bias=bias, seed=5)
    check(ep, ref)
    _, unbiased = run_case(1, 3, kw, bias=None, aux_coef=0.0, seed=5)
    assert not torch.equal(unbiased["counts"], ref["counts"])


@pytest.mark.parametrize("P", [1, 2, 4])
def test_local_aux_loss_is_each_ranks_own(P):
    ep, ref = run_case(P, 2, {}, aux_coef=0.7, seed=11)
    check(ep, ref)
    for r, (a, b) in enumerate(zip(ep["aux"], ref["aux"])):
        assert_close(a.double(), b.detach(), 1e-6, "rank %d's aux_loss" % r)


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("routing", ["topk_softmax", "sigmoid_topk"])
def test_group_aux_loss_is_the_gathered_batchs(P, routing):
    # Every rank's aux_loss: the same bits, the reference's loss on the whole
    # batch (and the single layer's); its gradient counted once per rank.
    kw = dict(aux_loss_scope="group")
    bias = None
    if routing == "sigmoid_topk":
        kw.update(SIGMOID)
        bias = random_bias(12)
    ep, ref = run_case(P, 3, kw, bias=bias, aux_coef=0.7, seed=12)
    check(ep, ref)
    for a in ep["aux"]:
        assert torch.equal(a, ep["aux"][0])
    assert_close(ep["aux"][0].double(), ref["aux"][0].detach(), 1e-6, "aux_loss")
    # the single layer on the gathered batch
    T = sum(SPLITS[P])
    x, wr, w1, w2, b1, b2 = make(T, D, N, E, "swiglu", True, seed=12)
    opts = {k: v for k, v in kw.items() if k != "aux_loss_scope"}
    _, counts, logits = smoe.moe(x, wr, w1, w2, b1, b2, top_k=3, expert_bias=bias, **opts)
    single = smoe.switch_load_balancing_loss(logits, counts)
    assert_close(ep["aux"][0].double(), single.double(), 1e-6, "aux_loss vs the single layer")


def test_group_aux_loss_gradient_alone():
    # Only the aux loss, backward on every rank: the router's gradient
    # summed over P = 2 ranks is 2x the single layer's; x gets its
    # share (2x the single layer's dx of those tokens); experts get none.
    P, T, K = 2, 12, 2
    t = make(T, D, N, E, "swiglu", False, seed=13)

    def rank(r, group):
        m = ep_layer(group, K, t, None, max_tokens=T // P, aux_loss_scope="group")
        x = t[0][r * T // P:(r + 1) * T // P].clone().requires_grad_()
        _, aux = m(x)
        aux.backward()
        m.reduce_router_grad()
        return aux.detach(), x.grad, m.router.weight.grad, m.c_fc.weight.grad

    res = run_ranks(P, rank)
    x, wr, w1, w2 = (v.clone().requires_grad_() for v in t[:4])
    _, counts, logits = smoe.moe(x, wr, w1, w2, top_k=K)
    aux = smoe.switch_load_balancing_loss(logits, counts)
    aux.backward()
    assert_close(res[0][0].double(), aux.detach().double(), 1e-6, "aux_loss")
    assert_close(res[0][2], P * wr.grad, 1e-5, "drouter_w")
    assert_close(torch.cat([v[1] for v in res]), P * x.grad, 1e-5, "dx")
    for v in res:
        assert v[3] is None or not v[3].any()


@pytest.mark.parametrize("P", [1, 2])
def test_router_logits_as_smoe_moe_returns_them(P):
    # The constructor's flag, forward's over it, the single layer's logits
    # and its z-loss gradient.
    split = SPLITS[P]
    T = sum(split)
    t = make(T, D, N, E, "swiglu", False, seed=14)

    def rank(r, group):
        m = ep_layer(group, 2, t, None, max_tokens=max(split), output_router_logits=True)
        lo = sum(split[:r])
        x = t[0][lo:lo + split[r]].clone().requires_grad_()
        out, aux, logits = m(x.view(1, -1, D))
        assert logits.shape == (split[r], E) and logits.dtype == torch.float32
        assert len(m(x, output_router_logits=False)) == 2
        smoe.router_z_loss(logits).backward()
        m.reduce_router_grad()
        return logits.detach(), x.grad, m.router.weight.grad

    res = run_ranks(P, rank)
    x, wr, w1, w2 = (v.clone().requires_grad_() for v in t[:4])
    _, _, logits = smoe.moe(x, wr, w1, w2, top_k=2)
    assert torch.equal(torch.cat([v[0] for v in res]), logits.detach())
    z = 0
    for r in range(P):   # each rank's z-loss, of its own tokens
        lo = sum(split[:r])
        z = z + smoe.router_z_loss(logits[lo:lo + split[r]])
    z.backward()
    assert_close(torch.cat([v[1] for v in res]), x.grad, 1e-6, "dx")
    assert_close(res[0][2], wr.grad, 1e-6, "drouter_w")


def test_expert_bias_update_from_the_groups_counts():
    # The docstring's update: every rank gets the group's counts and keeps
    # the same bias; the next call routes with it.
    P, T = 2, 16
    t = make(T, D, N, E, "swiglu", False, seed=15)

    def rank(r, group):
        m = ep_layer(group, 3, t, None, max_tokens=T // P, **SIGMOID)
        x = t[0][r * T // P:(r + 1) * T // P]
        m(x)
        load = m.group.all_reduce(m.last_expert_counts.float())
        with torch.no_grad():
            m.expert_bias += 1e-1 * torch.sign(load.mean() - load)
        m(x)
        return load, m.expert_bias.clone(), m.last_expert_counts

    res = run_ranks(P, rank)
    _, c0, _ = R.moe_sigmoid_ref(*t[:4], top_k=3, n_group=4, topk_group=2, routed_scaling=2.5)
    assert torch.equal(res[0][0], c0.float()) and torch.equal(res[1][0], c0.float())
    assert torch.equal(res[0][1], res[1][1])
    _, c1, _ = R.moe_sigmoid_ref(*t[:4], top_k=3, expert_bias=res[0][1], n_group=4,
                                 topk_group=2, routed_scaling=2.5)
    assert torch.equal(res[0][2] + res[1][2], c1)


def test_expert_bias_buffer():
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.EPMoE(E, 3, D, N, ep_group=g, max_tokens=4, **SIGMOID)
    assert m.expert_bias.dtype == torch.float32 and torch.equal(m.expert_bias, torch.zeros(E))
    assert "expert_bias" in m.state_dict() and "expert_bias" not in dict(m.named_parameters())
    for dtype in (torch.bfloat16, torch.float64):
        m.to(dtype)
        assert m.c_fc.weight.dtype == dtype and m.expert_bias.dtype == torch.float32
    m2 = smoe.EPMoE(E, 3, D, N, ep_group=g, max_tokens=4, **SIGMOID)
    with torch.no_grad():
        m.expert_bias.copy_(random_bias(3))
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.expert_bias, m.expert_bias)
    m3 = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4)
    assert m3.expert_bias is None and "expert_bias" not in m3.state_dict()


def test_float32_and_bfloat16_run():
    # The CPU backend's other dtypes, against the single layer in the same dtype.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        t = [v.to(dtype) for v in make(10, D, N, E, "swiglu", False, seed=16)[:4]]

        def rank(r, group):
            m = ep_layer(group, 2, t + [None, None], None, max_tokens=5).to(dtype)
            return m(t[0][r * 5:(r + 1) * 5])[0].detach()

        out = torch.cat(run_ranks(2, rank))
        ref = smoe.moe(*t, top_k=2)[0]
        assert out.dtype == dtype
        assert_close(out.double(), ref.double(), tol, "out %s" % dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_router_logits_dtype_input(dtype):
    # smoe.EPMoE(..., router_logits_dtype='input') (and smoe.MoE's, through
    # ep_group): the logits in x's dtype, the float32 ones rounded; out and
    # the experts' gradients the same bits
    t = [v.to(dtype) for v in make(10, D, N, E, "swiglu", False, seed=17)[:4]]

    def rank(r, group):
        res = []
        for ldt in (None, "input"):
            m = ep_layer(group, 2, t + [None, None], None, max_tokens=5,
                         output_router_logits=True, router_logits_dtype=ldt).to(dtype)
            x = t[0][r * 5:(r + 1) * 5].clone().requires_grad_()
            out, _, lg = m(x)
            out.float().sum().backward()
            res.append((out.detach(), lg.detach(), x.grad, m.c_fc.weight.grad))
        return res

    for (o32, l32, dx32, dw32), (o, lg, dx, dw) in run_ranks(2, rank):
        assert l32.dtype == torch.float32 and lg.dtype == dtype
        assert torch.equal(l32.to(dtype), lg)
        assert torch.equal(o32, o) and torch.equal(dx32, dx) and torch.equal(dw32, dw)
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.MoE(E, 2, D, N, ep_group=g, max_tokens=4, router_logits_dtype="input")
    assert isinstance(m, smoe.EPMoE) and m.router_logits_dtype == "input"
    with pytest.raises(smoe.SmoeError, match="router_logits_dtype = torch.float16"):
        smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4, router_logits_dtype=torch.float16)


# ------------------------------------------------------------ refusals

BAD_ROUTING = [
    dict(routing="sigmoid_topk", n_group=3, topk_group=1),
    dict(routing="sigmoid_topk", n_group=4, topk_group=5),
    dict(routing="sigmoid_topk", n_group=4, topk_group=1),
    dict(routing="sigmoid_topk", n_group=8, topk_group=4),
    dict(routing="sigmoid_topk", n_group=4),
    dict(routing="sigmoid_topk", n_group=-4, topk_group=2),
    dict(routing="sigmoid_topk", n_group="4", topk_group=2),
    dict(routing="sigmoid_topk", routed_scaling=0),
    dict(routing="sigmoid_topk", routed_scaling=float("nan")),
    dict(routing="softmax_topk", n_group=4, topk_group=2),
    dict(routing="topk_softmax", routed_scaling=2.5),
    dict(routing="topk"),
]


@pytest.mark.parametrize("kw", BAD_ROUTING)
def test_routing_options_refused_as_smoe_moe_refuses_them(kw):
    # The same check (module.check_routing), the same message, made before
    # the group is touched (ep_group=object() would fail there).
    with pytest.raises(ValueError) as want:
        smoe.MoE(E, 3, D, N, **kw)
    with pytest.raises(ValueError) as got:
        smoe.EPMoE(E, 3, D, N, ep_group=object(), max_tokens=8, **kw)
    assert isinstance(got.value, smoe.SmoeError)
    assert got.value.status == want.value.status
    assert str(got.value) == str(want.value).replace("smoe.MoE", "smoe.EPMoE")


@pytest.mark.parametrize("kw,match", [
    (dict(routing="general"), r"smoe.EPMoE: routing = 'general' takes the caller's \(token, "
                              r"expert, score\) triples: the C API's smoe_ep_layer"),
    (dict(activation_function="swish"), r"smoe.EPMoE: activation_function = 'swish', must be"),
    (dict(w1_layout="fused"), r"smoe.EPMoE: w1_layout = 'fused', must be one of"),
    (dict(aux_loss_scope="global"), r"smoe.EPMoE: aux_loss_scope = 'global', must be 'local'"),
    (dict(overlap=3), r"smoe.EPMoE: overlap = 3, must be -1, 0, 1 or 2"),
    (dict(comm_sms=-2), r"smoe.EPMoE: comm_sms = -2, must be >= -1"),
    (dict(keep_x=2), r"smoe.EPMoE: keep_x = 2, must be a bool"),
    (dict(copy_engines=2), r"smoe.EPMoE: copy_engines = 2, must be None \(automatic\) or a "
     r"bool"),
    (dict(max_tokens=-1), r"smoe.EPMoE: max_tokens = -1, must be >= 0"),
    (dict(max_tokens=8.0), r"smoe.EPMoE: max_tokens = 8.0, must be an int"),
    (dict(capacity=-3), r"smoe.EPMoE: capacity = -3, must be >= 0"),
    (dict(expert_rows=None), r"smoe.EPMoE: expert_rows = None, must be an int"),
])
def test_constructor_refuses_before_the_group(kw, match):
    kw.setdefault("max_tokens", 8)
    with pytest.raises(ValueError, match=match) as e:
        smoe.EPMoE(E, 2, D, N, ep_group=object(), **kw)
    assert isinstance(e.value, smoe.SmoeError)


def test_copy_engines_refused_on_the_cpu():
    # the in-process group's layer exchanges by host copies: the library
    # refuses the option at create (the first call), on every rank
    def rank(r, g):
        m = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4, copy_engines=True).double()
        with pytest.raises(smoe.SmoeError, match=r"copy_engines = 1: the CPU backend") as e:
            m(torch.randn(4, D, dtype=torch.float64))
        # None (automatic: never on the CPU) and False (NCCL's kernels
        # asked for) take the host copies
        outs = [smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4, copy_engines=ce).double()
                (torch.randn(4, D, dtype=torch.float64))[0] for ce in (None, False)]
        assert all(o.shape == (4, D) for o in outs)
        return e.value.status
    assert run_ranks(2, rank) == [L.SMOE_ERROR_UNSUPPORTED] * 2


def test_experts_must_split_over_the_ranks():
    g = smoe.EPGroup.in_process(3)[0]
    with pytest.raises(smoe.SmoeError, match=r"num_experts = 8 cannot be split evenly over 3"):
        smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=8)


def test_calls_refused():
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4).double()
    x = torch.randn(4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"smoe.EPMoE: x \(hidden_states\) has shape \(4, 8\), "
                       r"its last dimension must be hidden_size = 16"):
        m(x[:, :8])
    with pytest.raises(ValueError, match=r"x \(hidden_states\) is cpu torch.float32 but the "
                       r"layer's parameters are cpu torch.float64"):
        m(x.float())
    with pytest.raises(smoe.SmoeError, match=r"5 tokens, more than max_tokens = 4"):
        m(torch.randn(5, D, dtype=torch.float64))
    m(x)
    m.float()   # a second handle, the group's float32 one, made by this call
    assert m(x.float())[0].dtype == torch.float32 and len(g._layers) == 2
    s = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4, **{**SIGMOID, "topk_group": 1})
    s.expert_bias = torch.zeros(E, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"expert_bias is cpu torch.float64 \(8,\), must be "
                       r"float32"):
        s(x.float())


def test_nccl_frees_in_order_in_one_thread_and_joined_at_exit():
    # An NCCL group's teardown (EPGroup.__del__): its layers in the order
    # they were made, then its communicator, in one thread that exit waits
    # for (a rank died of SIGSEGV at exit with the frees still running).
    import threading
    import time
    from smoe import ep as E_
    seen, gate = [], threading.Event()

    def free(tag):
        gate.wait(5)
        time.sleep(0.05)
        seen.append((tag, threading.current_thread().name))

    keep = object()
    E_._free_jobs_beside([(free, "layer a"), (free, "layer b"), (free, "comm")], keep)
    assert len(E_._PENDING) == 1 and seen == []
    gate.set()
    E_._join_pending()
    assert [t for t, _ in seen] == ["layer a", "layer b", "comm"]
    assert {n for _, n in seen} == {"smoe-nccl-free"} and not E_._PENDING


# ------------------------------------------------------------ smoe.moe and smoe.MoE with ep_group

def run_functional(P, K, kw, seed=21, act_bias=True):
    """smoe.moe(..., ep_group=g) on each rank (its tokens, the whole router,
    its experts' slices), differentiating sum(out * dout) + sum(logits *
    dlog); the router's gradient summed over the group. Returns (ep, ref)
    as run_case does, the reference's loss the same without aux."""
    split, offs, t, dout, dlog = batch(P, act_bias, seed)

    def rank(r, group):
        El = E // P
        lo, hi = r * El, (r + 1) * El
        x = t[0][offs[r]:offs[r + 1]].clone().requires_grad_()
        ws = [None if v is None else v[lo:hi].clone().requires_grad_() for v in
              (t[2], t[3], t[4], t[5])]
        wr = t[1].clone().requires_grad_()
        out, counts, logits = smoe.moe(x, wr, *ws, top_k=K, ep_group=group,
                                       max_tokens=max(split), **kw)
        s = slice(offs[r], offs[r + 1])
        ((out * dout[s]).sum() + (logits.double() * dlog[s]).sum()).backward()
        group.all_reduce(wr.grad)
        return dict(out=out.detach(), dx=x.grad, logits=logits.detach(), counts=counts,
                    dwr=wr.grad, dw1=ws[0].grad, dw2=ws[1].grad,
                    db1=ws[2].grad if act_bias else None, db2=ws[3].grad if act_bias else None)

    res = run_ranks(P, rank)
    ep = gather(res, act_bias)
    ins = [None if v is None else v.clone().requires_grad_() for v in t]
    out, counts, logits = R.moe_ref(*ins, top_k=K, routing=kw.get("routing", "topk_softmax"),
                                    renormalize=kw.get("renormalize", True))
    ((out * dout).sum() + (logits * dlog).sum()).backward()
    ref = dict(out=out.detach(), dx=ins[0].grad, logits=logits.detach(), counts=counts,
               dwr=ins[1].grad, dw1=ins[2].grad, dw2=ins[3].grad)
    if act_bias:
        ref["db1"], ref["db2"] = ins[4].grad, ins[5].grad
    return ep, ref


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
def test_functional_with_ep_group_matches_reference(P, routing):
    # smoe.moe's expert-parallel form: this rank's tokens and experts, the
    # whole batch's reference (biases included, one rank with no tokens at
    # P = 4)
    ep, ref = run_functional(P, 2, dict(routing=routing))
    check(ep, ref)


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("P", [1, 2])
def test_functional_with_ep_group_router_logits_dtype(P, dtype, eager, monkeypatch):
    # router_logits_dtype=x's dtype under ep_group: each rank's logits are
    # its float32 ones rounded, and a loss on them whose gradient the dtype
    # holds exactly gives the float32 logits' gradients bit for bit (the
    # library's dlogits_extra_dtype); another dtype is refused
    monkeypatch.setattr(smoe.functional, "_EAGER", eager)
    split = SPLITS[P]
    t = make(sum(split), D, N, E, "swiglu", False, seed=21)
    g = torch.Generator().manual_seed(5)
    c = torch.randn(sum(split), E, generator=g).to(torch.bfloat16).float()

    def rank(r, group):
        lo, El = sum(split[:r]), E // P
        x = t[0][lo:lo + split[r]].to(dtype).clone().requires_grad_()
        wr = t[1].to(dtype).clone().requires_grad_()
        w1 = t[2][r * El:(r + 1) * El].to(dtype).clone().requires_grad_()
        w2 = t[3][r * El:(r + 1) * El].to(dtype).clone().requires_grad_()
        res = []
        for ldt in (None, dtype):
            out, _, lg = smoe.moe(x, wr, w1, w2, top_k=2, ep_group=group,
                                  max_tokens=max(split), router_logits_dtype=ldt)
            assert lg.dtype == (torch.float32 if ldt is None else dtype)
            loss = out.float().sum() + (lg.float() * c[lo:lo + split[r]]).sum()
            res.append((out.detach(), lg.detach(), torch.autograd.grad(loss, (x, wr, w1, w2))))
        with pytest.raises(smoe.SmoeError, match="router_logits_dtype"):
            smoe.moe(x, wr, w1, w2, top_k=2, ep_group=group, max_tokens=max(split),
                     router_logits_dtype=torch.float16)
        return res

    for (o32, l32, g32), (o, lo_, gl) in run_ranks(P, rank):
        assert torch.equal(o32, o)
        assert torch.equal(l32.to(dtype), lo_)
        for name, a, b in zip(("x", "router_w", "w1", "w2"), g32, gl):
            assert torch.equal(a, b), name


def test_functional_with_ep_group_inference_and_leading_dims():
    # inference=True keeps nothing for backward (no grad_fn); x (a, b, d)
    # gives out (a, b, d) and router_logits (a, b, E), as without ep_group
    t = make(6, D, N, E, "swiglu", False, seed=3)

    def rank(r, group):
        x = t[0][3 * r:3 * r + 3].reshape(1, 3, D).clone().requires_grad_()
        lo, hi = r * E // 2, (r + 1) * E // 2
        out, counts, logits = smoe.moe(x, t[1], t[2][lo:hi], t[3][lo:hi], top_k=2,
                                       ep_group=group, max_tokens=3, inference=True)
        return out, counts, logits

    res = run_ranks(2, rank)
    out_ref, counts_ref, logits_ref = R.moe_ref(*t, top_k=2)
    out = torch.cat([o.reshape(3, D) for o, _, _ in res])
    assert all(o.shape == (1, 3, D) and o.grad_fn is None for o, _, _ in res)
    assert all(lg.shape == (1, 3, E) for _, _, lg in res)
    assert torch.equal(sum(c for _, c, _ in res), counts_ref)
    assert_close(out, out_ref, 1e-6, "out")
    assert_close(torch.cat([lg.reshape(3, E) for _, _, lg in res]).double(), logits_ref, 1e-6,
                 "router_logits")


def test_functional_ep_group_refusals():
    (g,) = smoe.EPGroup.in_process(1)
    t = make(4, D, N, E, "swiglu", False, seed=4)
    x, wr, w1, w2 = t[:4]
    cases = [
        (dict(ep_group=g, max_tokens=4, token_rounding="up"), "token_rounding = 'up'"),
        (dict(ep_group=g, max_tokens=4, consume_saved=True), "consume_saved = True"),
        (dict(ep_group=g), "max_tokens is required"),
        (dict(ep_group=g, max_tokens=4, overlap=2), "overlap = 2"),
        (dict(ep_group=g, max_tokens=3), "4 tokens, more than max_tokens = 3"),
        (dict(ep_group=g, max_tokens=4, routing="general"), "no expert-parallel form"),
        (dict(max_tokens=4), "max_tokens: options of expert parallelism"),
        (dict(keep_x=True, copy_engines=False), "keep_x, copy_engines: options of expert"),
    ]
    for kw, msg in cases:
        with pytest.raises(smoe.SmoeError, match=msg):
            smoe.moe(x, wr, w1, w2, top_k=2, **kw)
    with pytest.raises(TypeError, match="must be an smoe.EPGroup"):
        smoe.moe(x, wr, w1, w2, top_k=2, ep_group=object(), max_tokens=4)
    # the router must hold P times this rank's experts
    (g2a, g2b) = smoe.EPGroup.in_process(2)
    with pytest.raises(smoe.SmoeError, match="router_w"):
        smoe.moe(x, wr, w1, w2, top_k=2, ep_group=g2a, max_tokens=4)


def test_module_with_ep_group_is_epmoe_same_bits():
    # smoe.MoE(..., ep_group=g) is an smoe.EPMoE: the same layer (same
    # weights, same bits) as the one made directly
    P, split = 2, SPLITS[2]
    t = make(sum(split), D, N, E, "swiglu", True, seed=8)

    def rank(r, group):
        a = smoe.MoE(E, 2, D, N, "swiglu", True, ep_group=group, max_tokens=max(split),
                     routing="softmax_topk").double()
        b = ep_layer(group, 2, t, None, max_tokens=max(split), routing="softmax_topk")
        assert isinstance(a, smoe.EPMoE) and not isinstance(a, smoe.MoE)
        a.load_state_dict(b.state_dict())
        x = t[0][:split[0]] if r == 0 else t[0][split[0]:]
        outs = []
        for m in (a, b):
            xr = x.clone().requires_grad_()
            out, aux = m(xr)
            (out.square().sum() + aux).backward()
            outs.append((out.detach(), xr.grad, m.c_fc.weight.grad, m.router.weight.grad))
        return outs

    for oa, ob in run_ranks(P, rank):
        for u, v in zip(oa, ob):
            assert torch.equal(u, v)


def test_module_ep_group_refusals():
    (g,) = smoe.EPGroup.in_process(1)
    with pytest.raises(smoe.SmoeError, match="token_rounding = 'nearest' with ep_group"):
        smoe.MoE(E, 2, D, N, ep_group=g, max_tokens=4, token_rounding="nearest")
    with pytest.raises(smoe.SmoeError, match="consume_saved = True with ep_group"):
        smoe.MoE(E, 2, D, N, ep_group=g, max_tokens=4, consume_saved=True)
    with pytest.raises(smoe.SmoeError, match="capacity, keep_x: options of expert parallelism"):
        smoe.MoE(E, 2, D, N, capacity=8, keep_x=True)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        smoe.MoE(E, 2, D, N, ep_group=g, max_tokens=4, no_such_option=1)
    # the alias activation= works as in smoe.MoE
    m = smoe.MoE(E, 2, D, N, ep_group=g, max_tokens=4, activation="geglu")
    assert isinstance(m, smoe.EPMoE) and m.c_fc.weight.shape == (E, 2 * N, D)


def test_torch_group_maps_to_one_epgroup(monkeypatch, tmp_path):
    # A torch.distributed group given as ep_group becomes its one EPGroup
    # of this process (EPGroup.of): layers naming the same group share it,
    # another group gets its own. (gloo, one rank; EPGroup's NCCL
    # construction is replaced by an in-process group's state, so the
    # layers run here.)
    import torch.distributed as dist
    from smoe import ep as smoe_ep
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    made, keep = [], []

    def fake_init(self, group=None, device=None):
        made.append(group)
        (g,) = smoe.EPGroup.in_process(1)
        keep.append(g)          # (its handles stay alive with it)
        self.__dict__.update(g.__dict__)
        self._register()        # an id of its own, for the operators' lookup

    monkeypatch.setattr(smoe_ep.EPGroup, "__init__", fake_init)
    monkeypatch.setattr(smoe_ep, "_EP_OF", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "init"), rank=0,
                            world_size=1)
    try:
        world, other = dist.group.WORLD, dist.new_group([0])
        a = smoe.MoE(E, 2, D, N, ep_group=world, max_tokens=4).double()
        b = smoe.EPMoE(E, 2, D, N, ep_group=world, max_tokens=4).double()
        c = smoe.EPMoE(E, 2, D, N, ep_group=other, max_tokens=4).double()
        assert a.group is b.group and c.group is not a.group
        assert made == [world, other]
        t = make(4, D, N, E, "swiglu", False, seed=9)
        out, _, _ = smoe.moe(*t[:4], top_k=2, ep_group=world, max_tokens=4)
        assert made == [world, other]
        assert_close(out, R.moe_ref(*t[:4], top_k=2)[0], 1e-6, "out")
        with pytest.raises(TypeError, match="must be an smoe.EPGroup or a torch.distributed"):
            smoe.moe(*t[:4], top_k=2, ep_group="world", max_tokens=4)
    finally:
        dist.destroy_process_group()
