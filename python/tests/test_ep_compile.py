"""smoe.EPMoE under torch.compile(fullgraph=True), and without gradients,
on the CPU: P ranks as P threads of this process (smoe.EPGroup.in_process,
the library's in-process transport), each compiling its own model.

Compiling in several threads tests what P processes would do: dynamo's
compile lock lets one thread trace and compile at a time, and nothing
collective runs while compiling (the layer's handle, whose creation is
collective, is made by the operator's first real call; the saved block's
size comes from a Python bound, smoe.ep._ep_saved_bound); the compiled
forward and backward then run their collective operators (smoe::ep_forward,
ep_backward, ep_group_sums, ep_all_reduce) concurrently, in graph order.

Compiled against eager on the same weights and tokens, a model of two
EPMoE layers with a residual between them (two layers' collectives in one
graph), P = 1, 2, 4: with backend="aot_eager" (the same ATen operations
as eager around the operators) every result and gradient bit for bit,
with token counts that change (a rank with none) under dynamic=True;
with inductor the output, the expert counts, the router logits and every
gradient of a loss on the output and the logits bit for bit, the Switch
aux loss (inductor's own float32 reductions) and the gradients through it
within 1e-6. Inductor costs 20-50 s a case on two cores: one case here, the
GPU tests compile with it at WORLD 1 and 2. Also: the collectives of the
compiled graphs ordered by effect tokens, blocks compiled one by one
sharing one graph, the operators' path run eagerly (the same bits as the
direct path), forward without gradients (no saved block: the library's
inference forward), torch.library.opcheck, the operators' refusals, the
Python bound of the saved block against the library, and smoe.moe(...,
ep_group=g) compiled against eager (one function compiled for two groups:
the group's id reaches the operators as a constant, not a SymInt)."""
import operator

import pytest
import torch
import torch.nn as nn

import smoe
from smoe import ep as smoe_ep
from test_ep import SIGMOID, SPLITS, D, E, N, ep_layer, random_bias, run_ranks
from test_functional import assert_close, make


class TwoLayers(nn.Module):
    """h = x + moe1(x); y = h + moe2(h): the layers' collectives in one graph."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        o1, a1, l1 = self.first(x, output_router_logits=True)
        h = x + o1
        o2, a2, l2 = self.second(h, output_router_logits=True)
        return h + o2, a1 + a2, l1, l2


# name: (P, K, EPMoE options, expert bias seed, add_bias, backend, dynamic)
CASES = {
    # inductor: the layers' results bitwise, the aux loss within rounding
    "P2_sigmoid_group_inductor": (2, 3, dict(SIGMOID, aux_loss_scope="group"), 21, True,
                                  "inductor", False),
    # aot_eager: every bit (inductor takes 20-50 s a case on two cores: the
    # GPU tests compile with it at WORLD 1 and 2)
    "P1_topk_softmax": (1, 2, {}, None, False, "aot_eager", False),
    "P2_softmax_topk_bias_dynamic": (2, 2, dict(routing="softmax_topk"), None, True,
                                     "aot_eager", True),
    "P4_topk_softmax_group": (4, 2, dict(aux_loss_scope="group"), None, False, "aot_eager",
                              False),
}
# Token counts per rank at each step; the dynamic case changes them (a
# rank with none included) without recompiling.
STEPS = {1: [[12], [12]], 2: [[7, 5], [7, 5]], 4: [[5, 0, 4, 3], [5, 0, 4, 3]]}
DYNAMIC_STEPS = [[7, 5], [3, 8], [6, 0]]


def _model(group, P, K, opts, bias, act_bias, seed):
    t1 = make(8, D, N, E, "swiglu", act_bias, seed=seed)
    t2 = make(8, D, N, E, "swiglu", act_bias, seed=seed + 1)
    kw = dict(opts, max_tokens=12)
    return TwoLayers(ep_layer(group, K, t1, bias, **kw), ep_layer(group, K, t2, bias, **kw))


def _step(fn, model, x, dout, dlog, aux_coef):
    """fn(x) -> (y, aux, l1, l2); the loss sum(y dout) + sum(l1 dlog) +
    sum(l2 dlog) + aux_coef aux; returns every result and gradient."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    y, aux, l1, l2 = fn(x)
    loss = (y * dout).sum() + (l1.double() * dlog).sum() + (l2.double() * dlog).sum()
    if aux_coef:
        loss = loss + aux_coef * aux
    loss.backward()
    res = {"y": y.detach(), "aux": aux.detach(), "l1": l1.detach(), "l2": l2.detach(),
           "dx": x.grad, "counts1": model.first.last_expert_counts.clone(),
           "counts2": model.second.last_expert_counts.clone()}
    for name, p in model.named_parameters():
        res["d" + name] = p.grad.clone()
    return res


def _compare(case, backend=None):
    """Each rank's [(aux coefficient, eager results, compiled results)] per step."""
    P, K, opts, bias_seed, act_bias, case_backend, dynamic = CASES[case]
    bias = random_bias(bias_seed) if bias_seed is not None else None
    steps = DYNAMIC_STEPS if dynamic else STEPS[P]
    T = max(sum(s) for s in steps)
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(T, D, generator=g, dtype=torch.float64)
    dout_all = torch.randn(T, D, generator=g, dtype=torch.float64)
    dlog_all = (torch.randn(T, E, generator=g) * 0.3).double()

    def rank(r, group):
        model = _model(group, P, K, opts, bias, act_bias, seed=17)
        compiled = torch.compile(model, fullgraph=True, backend=backend or case_backend,
                                 dynamic=dynamic)
        out = []
        for i, split in enumerate(steps):
            lo = sum(split[:r])
            s = slice(lo, lo + split[r])
            # The first step's loss leaves the aux loss out (every gradient
            # then comes from the layers and exact operations); the next
            # ones add it.
            coef = 0.0 if i == 0 else 0.5
            eager = _step(model, model, x_all[s], dout_all[s], dlog_all[s], coef)
            comp = _step(compiled, model, x_all[s], dout_all[s], dlog_all[s], coef)
            out.append((coef, eager, comp))
        return out

    return run_ranks(P, rank)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_matches_eager(case):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    every_bit = CASES[case][5] == "aot_eager"
    for r, steps in enumerate(_compare(case)):
        for i, (coef, eager, comp) in enumerate(steps):
            where = "%s rank %d step %d" % (case, r, i)
            assert eager.keys() == comp.keys()
            for k in comp:
                if every_bit or k in ("y", "l1", "l2", "counts1", "counts2") or (
                        k.startswith("d") and coef == 0.0):
                    assert torch.equal(comp[k], eager[k]), "%s: %s differs" % (where, k)
                else:   # inductor's float32 reductions in the aux loss (and its gradient)
                    assert_close(comp[k].double(), eager[k].double(), 1e-6, where + " " + k)
    # One graph per rank; dynamic: other token counts without a recompile,
    # but for the rank given none (dynamo specialises a size of 0): its
    # graph then differs from the others', the collectives' order not.
    P, dynamic = CASES[case][0], CASES[case][6]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == P + dynamic


def _graphs(model, x):
    """The forward and backward graphs AOTAutograd hands the compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep,
                                                                         bw_compiler=keep))
    y, aux, _, _ = compiled(x)
    (y.sum() + aux).backward()
    return graphs


def test_collectives_ordered_by_effect_tokens():
    # Every collective operator of the compiled graphs runs under
    # with_effects, one token threaded through them in program order
    # (forward: ep_forward, ep_group_sums of each layer; backward: the
    # second layer's ep_all_reduce and ep_backward, then the first's), so
    # no compiler pass can reorder two of them on one rank only.
    torch._dynamo.reset()
    (g,) = smoe.EPGroup.in_process(1)
    model = _model(g, 1, 2, dict(aux_loss_scope="group"), None, False, seed=30)
    x = make(6, D, N, E, "swiglu", False, seed=31)[0].requires_grad_()
    fw, bw = _graphs(model, x)
    want = (["ep_forward", "ep_group_sums"] * 2, ["ep_all_reduce", "ep_backward"] * 2)
    for gm, names in zip((fw, bw), want):
        token, seen = None, []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            assert "smoe" not in str(node.target), "%s outside with_effects" % node.target
            if node.target is torch.ops.higher_order.with_effects:
                op = node.args[1]
                seen.append(op._opname if hasattr(op, "_opname") else op.__name__.split(".")[0])
                if token is not None:   # the previous one's token, through getitem
                    prev = node.args[0]
                    assert prev.target is operator.getitem and prev.args == (token, 0)
                token = node
        assert seen == names, seen


def test_blocks_compiled_one_by_one_share_one_graph():
    # Regional compilation (each block compiled on its own, as for a big
    # model): the operators' arguments name the group and the options, not
    # the layer, so nine layers of one configuration compile once (dynamo
    # would stop at its recompile limit, 8, otherwise) and share one library
    # handle; each computes with its own weights.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (g,) = smoe.EPGroup.in_process(1)
    x = make(6, D, N, E, "swiglu", False, seed=40)[0]
    for i in range(9):
        t = make(6, D, N, E, "swiglu", False, seed=41 + i)
        m = ep_layer(g, 2, t, None, max_tokens=8)
        want = m(x)
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert i == 0 or not torch.equal(got[0], first)
        first = got[0] if i == 0 else first
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(g._layers) == 1


@pytest.mark.parametrize("P", [1, 2])
def test_operator_path_matches_eager_path(P, monkeypatch):
    # Every call through the custom operators (as under a dispatch mode or
    # a torch.func transform), eagerly: the same bits as the direct path.
    bias = random_bias(22)

    def run(direct):
        monkeypatch.setattr(smoe.functional, "_EAGER", direct)
        if not direct:
            monkeypatch.setattr(smoe_ep._EPFunction, "apply", None)   # not called
        return _compare_eager(P, bias)

    a, b = run(True), run(False)
    for ra, rb in zip(a, b):
        for k in ra:
            assert torch.equal(ra[k], rb[k]), k


def _compare_eager(P, bias):
    split = SPLITS[P]
    t = make(sum(split), D, N, E, "swiglu", True, seed=23)
    dout = torch.randn(sum(split), D, generator=torch.Generator().manual_seed(24),
                       dtype=torch.float64)

    def rank(r, group):
        m = ep_layer(group, 3, t, bias, max_tokens=max(split), aux_loss_scope="group", **SIGMOID)
        lo = sum(split[:r])
        x = t[0][lo:lo + split[r]].clone().requires_grad_()
        out, aux, logits = m(x, output_router_logits=True)
        ((out * dout[lo:lo + split[r]]).sum() + logits.sum() + aux).backward()
        res = {"out": out.detach(), "aux": aux.detach(), "logits": logits.detach(), "dx": x.grad}
        res.update({n: p.grad for n, p in m.named_parameters()})
        return res

    return run_ranks(P, rank)


class _SavedSpy:
    """Records, for each forward call of a layer handle, whether it was
    given a saved block (None: the library's inference forward)."""

    def __init__(self, monkeypatch):
        self.forwards = []
        call = smoe_ep._EPLayer.call

        def spy(layer, fn, args, saved, ws, stream):
            if fn is layer._lib.smoe_ep_layer_forward:
                self.forwards.append((saved is not None, int(args.inference)))
            return call(layer, fn, args, saved, ws, stream)

        monkeypatch.setattr(smoe_ep._EPLayer, "call", spy)


@pytest.mark.parametrize("compiled", [False, True])
def test_forward_without_gradients_keeps_no_saved_block(compiled, monkeypatch):
    # Under torch.no_grad(), torch.inference_mode(), or with nothing that
    # requires a gradient, the forward is the library's inference forward
    # (args.inference = 1, no saved block): the same out, counts and logits.
    spy = _SavedSpy(monkeypatch)
    torch._dynamo.reset()
    P = 2

    def rank(r, group):
        t = make(10, D, N, E, "swiglu", True, seed=25)
        m = ep_layer(group, 2, t, None, max_tokens=5, routing="softmax_topk")
        f = torch.compile(m, fullgraph=True, backend="aot_eager") if compiled else m
        x = t[0][r * 5:(r + 1) * 5]
        res = [f(x.clone().requires_grad_())]          # training: a saved block
        with torch.no_grad():
            res.append(f(x))
        if not compiled:
            with torch.inference_mode():
                res.append(f(x))
            m.requires_grad_(False)
            res.append(f(x))                            # nothing requires a gradient
            m.requires_grad_(True)
        out = [tuple(v.detach().clone() for v in o) for o in res]
        return out, [o[0].requires_grad for o in res]

    res = run_ranks(P, rank)
    n = 2 if compiled else 4
    assert spy.forwards == [(True, 0)] * P + [(False, 1)] * (P * (n - 1))
    for outs, requires in res:
        assert requires == [True] + [False] * (n - 1)
        for o in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))


def test_operators_opcheck():
    # Schema, fake implementations and autograd registration of the four
    # operators (P = 1). (ep_forward's saved block has bytes no call
    # writes, so the AOT-dispatch tests, which compare every output bit,
    # are left out for it and ep_backward, as test_autograd.py does for
    # smoe::moe_forward; the compiled tests above check them.)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.EPMoE(E, 2, D, N, "swiglu", True, ep_group=g, max_tokens=8,
                   routing="softmax_topk").double()
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
    w = [m.router.weight, m.c_fc.weight, m.c_proj.weight, m.c_fc.bias, m.c_proj.bias]
    args = (x, *w, None, m._options + [1], 1.0)
    torch.library.opcheck(torch.ops.smoe.ep_forward.default, args, test_utils=checks)
    torch.library.opcheck(torch.ops.smoe.ep_forward.default,
                          (x, *w, None, m._options + [0], 1.0), test_utils=checks)
    saved = torch.ops.smoe.ep_forward(*args)[3].detach()
    bargs = (torch.randn(6, D, dtype=torch.float64), torch.randn(6, E), x.detach(),
             *[t.detach() for t in w[:3]], w[4].detach(), saved, m._options + [0b111111], 1.0)
    torch.library.opcheck(torch.ops.smoe.ep_backward.default, bargs, test_utils=checks)
    p = torch.rand(E, requires_grad=True)
    c = torch.randint(0, 5, (E,), dtype=torch.int32)
    torch.library.opcheck(torch.ops.smoe.ep_group_sums.default, (p, c, g._id))
    torch.library.opcheck(torch.ops.smoe.ep_all_reduce.default, (p, g._id))


def test_operators_refuse_a_freed_group_and_a_bad_config():
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=8)
    x = torch.randn(4, D)
    w = (m.router.weight, m.c_fc.weight, m.c_proj.weight, None, None, None)
    with pytest.raises(smoe.SmoeError, match=r"smoe::ep_forward: no live smoe.EPGroup has id "
                       r"123456"):
        torch.ops.smoe.ep_forward(x, *w, [123456] + m._options[1:] + [1], 1.0)
    with pytest.raises(smoe.SmoeError, match=r"smoe::ep_forward: config has 3 entries, must "
                       r"have 17 \(group, top_k, .*, keep_x, copy_engines, logits_lowp, "
                       r"save\)"):
        torch.ops.smoe.ep_forward(x, *w, [g._id, 2, 0], 1.0)
    saved = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(smoe.SmoeError, match=r"backward through a forward that kept nothing"):
        torch.ops.smoe.ep_backward(x, None, x, *w[:3], None, saved, m._options + [1], 1.0)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_saved_bound_covers_the_library(P):
    # The Python bound the operator (and its fake, under torch.compile)
    # allocates: at least the library's smoe_ep_layer_saved_bytes(T) for
    # every T, a few sections of the CUDA layout more (<= 512 bytes here).
    configs = [(routing, dtype, cap, rows)
               for routing in ("topk_softmax", "softmax_topk", "sigmoid_topk")
               for dtype in (torch.float32, torch.float64, torch.bfloat16)
               for cap, rows in ((0, 0), (3, 0), (0, 7), (5, 10 ** 6))]
    configs += [("topk_softmax", dtype, cap, 0, True)
                for dtype in (torch.float32, torch.float64, torch.bfloat16) for cap in (0, 3)]

    def rank(r, group):
        out = []
        for routing, dtype, cap, rows, *keep in configs:
            keep_x = bool(keep and keep[0])
            m = smoe.EPMoE(E, 3, D, N, ep_group=group, max_tokens=9, routing=routing,
                           capacity=cap, expert_rows=rows, keep_x=keep_x).to(dtype)
            layer = group._layer(m._cfg, torch.device("cpu"), dtype)
            for T in range(10):
                bound = smoe_ep._ep_saved_bound(T, P, E, 3, D, N, m.activation, m.routing,
                                                dtype, 9, cap, rows, keep_x)
                out.append((routing, dtype, cap, rows, keep_x, T, bound, layer.sizes(T)[1]))
        return out

    for rows in run_ranks(P, rank):
        for *case, bound, need in rows:
            assert need <= bound <= need + 512, (case, bound, need)


@pytest.mark.parametrize("P", [1, 2])
def test_functional_with_ep_group_compiled_matches_eager(P):
    # smoe.moe(..., ep_group=g) inside torch.compile(fullgraph=True): the
    # same bits as eager, output and every gradient (biases included)
    torch._dynamo.reset()
    split = SPLITS[P]
    offs = [sum(split[:r]) for r in range(P + 1)]
    t = make(sum(split), D, N, E, "swiglu", True, seed=31)

    def rank(r, group):
        El = E // P
        ws = [v[r * El:(r + 1) * El] for v in (t[2], t[3], t[4], t[5])]

        def f(x, wr, w1, w2, b1, b2):
            out, counts, logits = smoe.moe(x, wr, w1, w2, b1, b2, top_k=2, ep_group=group,
                                           max_tokens=max(split), routing="softmax_topk")
            return out, logits

        res = []
        for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
            ins = [t[0][offs[r]:offs[r + 1]].clone(), t[1].clone()] + [w.clone() for w in ws]
            for v in ins:
                v.requires_grad_()
            out, logits = fn(*ins)
            (out.square().sum() + logits.double().sum()).backward()
            res.append([out.detach()] + [v.grad for v in ins])
        return res

    for eager, compiled in run_ranks(P, rank):
        for i, (a, b) in enumerate(zip(eager, compiled)):
            assert torch.equal(a, b), i
