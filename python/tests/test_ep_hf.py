"""Hugging Face MoE weights and blocks on smoe.EPMoE, on the CPU: P ranks as
P threads (smoe.EPGroup.in_process). smoe.load_hf_moe_weights into an
EPMoE reads the router and this rank's experts only; the layer over the
ranks then computes what smoe.MoE loaded from the same state dict and the
Hugging Face block compute on the gathered tokens. smoe.hf.replace_moe_blocks
with ep_group: each rank's model keeps its experts' slice of every block and
computes, on its own tokens, what the untouched transformers model computes
on them (logits, loss, router logits, aux loss), with every gradient
(replicated parameters: the ranks' shares summed; experts: this rank's
slice of the reference's)."""
import copy

import pytest
import torch

import smoe
from test_ep import run_ranks
from test_functional import assert_close
from test_module import hf_forward, hf_weights


def hf_state_dict(style, E, d, n, bias, seed):
    """A Hugging Face block's state dict in one of the layouts the loader
    reads (per-expert Qwen3-MoE / OLMoE or Mixtral names, fused, fused and
    transposed), with its prefix and the tensors hf_forward takes."""
    gate_w, gates, ups, downs = hf_weights(E, d, n, seed)
    prefix = "model.layers.1.mlp." if style != "mixtral" else "model.layers.1.block_sparse_moe."
    sd = {prefix + "gate.weight": gate_w, "model.embed_tokens.weight": torch.zeros(3)}
    g = torch.Generator().manual_seed(seed + 1)
    biases = [[torch.randn(t.shape[0], generator=g, dtype=torch.float64) * 0.1 for t in ts]
              for ts in (gates, ups, downs)]
    if style in ("qwen3", "mixtral"):
        names = ("gate_proj", "up_proj", "down_proj") if style == "qwen3" else ("w1", "w3", "w2")
        for e in range(E):
            for name, ts, bs in zip(names, (gates, ups, downs), biases):
                sd[prefix + "experts.%d.%s.weight" % (e, name)] = ts[e]
                if bias:
                    sd[prefix + "experts.%d.%s.bias" % (e, name)] = bs[e]
    else:
        gu = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)   # (E, 2n, d)
        dn = torch.stack(downs)                                          # (E, d, n)
        if style == "fused_transposed":
            gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        sd[prefix + "experts.gate_up_proj"] = gu
        sd[prefix + "experts.down_proj"] = dn
        if bias:
            sd[prefix + "experts.gate_up_proj_bias"] = torch.cat(
                [torch.stack(biases[0]), torch.stack(biases[1])], dim=1)
            sd[prefix + "experts.down_proj_bias"] = torch.stack(biases[2])
    return sd, prefix, (gate_w, gates, ups, downs)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("style,bias", [("qwen3", False), ("mixtral", False), ("fused", False),
                                        ("fused_transposed", False), ("qwen3", True),
                                        ("fused", True)])
def test_load_hf_weights_into_ep_keeps_this_ranks_experts(P, style, bias):
    E, d, n, K, T = 8, 8, 6, 2, 6
    sd, prefix, hf = hf_state_dict(style, E, d, n, bias, seed=5)
    routing = "topk_softmax" if style == "mixtral" else "softmax_topk"
    single = smoe.MoE(E, K, d, n, "swiglu", bias, 0.02, routing=routing).double()
    single_used = smoe.load_hf_moe_weights(single, sd, prefix)
    x = torch.randn(P * T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def rank(r, group):
        m = smoe.EPMoE(E, K, d, n, "swiglu", bias, ep_group=group, max_tokens=T,
                       routing=routing).double()
        used = smoe.load_hf_moe_weights(m, sd, prefix)
        lo, hi = m.expert_start, m.expert_start + m.local_experts
        assert torch.equal(m.router.weight, single.router.weight)
        assert torch.equal(m.c_fc.weight, single.c_fc.weight[lo:hi])
        assert torch.equal(m.c_proj.weight, single.c_proj.weight[lo:hi])
        if bias:
            assert torch.equal(m.c_fc.bias, single.c_fc.bias[lo:hi])
            assert torch.equal(m.c_proj.bias, single.c_proj.bias[lo:hi])
        with torch.no_grad():
            return used, m(x[r * T:(r + 1) * T])[0]

    res = run_ranks(P, rank)
    if style in ("qwen3", "mixtral"):   # per-expert tensors: each rank read its own
        for r, (used, _) in enumerate(res):
            experts = {int(k[len(prefix):].split(".")[1]) for k in used if ".experts." in k}
            assert experts == set(range(r * E // P, (r + 1) * E // P)), (r, experts)
        assert sorted(sum((u for u, _ in res), [])) == sorted(
            [k for k in single_used if ".experts." in k] + [prefix + "gate.weight"] * P)
    else:
        assert all(u == single_used for u, _ in res)
    # (The float64 EP layer hands its scores to the experts as float32,
    # smoe.h: ~1e-8 from the float64 single layer, as in test_ep.py.)
    out = torch.cat([o for _, o in res])
    with torch.no_grad():
        assert_close(out, single(x)[0], 1e-6, "EP out vs smoe.MoE")
    if not bias:
        want = hf_forward(x, *hf, K, True, mixtral=style == "mixtral")
        assert_close(out, want, 1e-6, "EP out vs the HF computation")


def test_load_hf_weights_into_ep_refusals():
    E, d, n = 8, 8, 6
    sd, prefix, _ = hf_state_dict("qwen3", E, d, n, False, seed=6)
    (g,) = smoe.EPGroup.in_process(1)
    with pytest.raises(ValueError, match="not gated"):
        smoe.load_hf_moe_weights(smoe.EPMoE(E, 2, d, n, "relu", ep_group=g, max_tokens=4), sd,
                                 prefix)
    sd[prefix + "gate.e_score_correction_bias"] = torch.zeros(E)
    with pytest.raises(ValueError, match="DeepSeek-V3-style block"):
        smoe.load_hf_moe_weights(smoe.EPMoE(E, 2, d, n, ep_group=g, max_tokens=4), sd, prefix)


# ------------------------------------------------------------ smoe.hf with ep_group

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "minimax_m2", "olmoe", "deepseek_v3",
            "glm4_moe", "granitemoe", "hunyuan"]
ROWS = 2          # sequences per rank
SEQ = 7


def _batch(P, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (P * ROWS, SEQ), generator=g)
    labels = torch.randint(3, 64, (P * ROWS, SEQ), generator=g)
    return ids, labels


def _is_expert(name):
    return name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")


@pytest.mark.parametrize("keep_x", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_replace_blocks_expert_parallel_matches_the_hf_model(family, keep_x):
    pytest.importorskip("transformers")
    from test_hf import block_names, hf_run, tiny_model
    P = 2
    ids, labels = _batch(P, seed=4)
    # (Every model built here: tiny_model seeds the global generator, which
    # the rank threads would share.)
    ref = tiny_model(family)
    models = [copy.deepcopy(ref) for _ in range(P)]
    ref_sd = copy.deepcopy(ref.state_dict())
    E = ref.get_submodule(block_names(family)[0]).experts.gate_up_proj.shape[0]
    # The reference: the HF model on each rank's sequences, the ranks'
    # losses summed (their gradients accumulate).
    want = []
    for r in range(P):
        rows = slice(r * ROWS, (r + 1) * ROWS)
        out = hf_run(ref, family, ids[rows], labels=labels[rows], output_router_logits=True)
        out.loss.backward()
        want.append(out)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    def rank(r, group):
        model = models[r]
        replaced = smoe.hf.replace_moe_blocks(model, ep_group=group, max_tokens=ROWS * SEQ,
                                              keep_x=keep_x)
        assert sorted(replaced) == block_names(family)
        lo, hi = r * E // P, (r + 1) * E // P
        sd = model.state_dict()
        assert list(sd) == list(ref_sd)
        for k, v in sd.items():   # this rank's shard of the experts, the rest replicated
            assert torch.equal(v, ref_sd[k][lo:hi] if _is_expert(k) else ref_sd[k]), k
        rows = slice(r * ROWS, (r + 1) * ROWS)
        out = model(ids[rows], labels=labels[rows], output_router_logits=True)
        out.loss.backward()
        # the layer handles' configurations (EPGroup._layer's keys) end with
        # keep_x, copy_engines (0: the library decides)
        assert {key[0][-2:] for key in group._layers} == {(keep_x, 0)}
        return out, {k: p.grad for k, p in model.named_parameters()}

    import smoe.hf   # noqa: F401
    res = run_ranks(P, rank)
    for r, ((got, _), exp) in enumerate(zip(res, want)):
        assert_close(got.logits, exp.logits, 1e-5, "rank %d logits" % r)
        assert_close(got.loss, exp.loss, 1e-6, "rank %d loss" % r)
        if getattr(exp, "aux_loss", None) is not None:
            assert_close(got.aux_loss, exp.aux_loss, 1e-6, "rank %d aux loss" % r)
        for a, b in zip(getattr(got, "router_logits", ()), getattr(exp, "router_logits", ())):
            assert_close(a, b, 1e-5, "rank %d router logits" % r)
    for k, g in ref_grads.items():
        if g is None:
            assert all(grads[k] is None for _, grads in res), k
        elif _is_expert(k):   # each rank: its slice of the experts' gradient
            for r, (_, grads) in enumerate(res):
                assert_close(grads[k], g[r * E // P:(r + 1) * E // P], 2e-5, "d%s rank %d" % (k, r))
        else:                 # replicated: the ranks' shares sum to it
            assert_close(sum(grads[k] for _, grads in res), g, 2e-5, "d" + k)


def test_replace_blocks_expert_parallel_compiled_block():
    # One expert-parallel block under torch.compile (fullgraph, the
    # operators; backend aot_eager): the eager block's bits, forward and
    # every gradient.
    pytest.importorskip("transformers")
    import smoe.hf
    from test_hf import tiny_model
    torch._dynamo.reset()
    P, T = 2, 9

    models = [tiny_model("deepseek_v3") for _ in range(P)]

    def rank(r, group):
        model = models[r]
        smoe.hf.replace_moe_blocks(model, ep_group=group, max_tokens=T)
        block = model.get_submodule("model.layers.1.mlp")
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        x = torch.randn(1, T, 16, generator=torch.Generator().manual_seed(20 + r))
        res = []
        for f in (block, compiled):
            block.zero_grad()
            xi = x.clone().requires_grad_()
            out = f(xi)
            out.square().sum().backward()
            res.append([out.detach(), xi.grad] + [p.grad for p in block.parameters()])
        return res

    for eager, comp in run_ranks(P, rank):
        assert len(eager) == len(comp)
        for a, b in zip(eager, comp):
            assert torch.equal(a, b)


def test_replace_blocks_expert_parallel_refusals():
    pytest.importorskip("transformers")
    import smoe.hf
    from test_hf import tiny_model
    model = tiny_model("qwen3_moe")
    blocks = [model.get_submodule("model.layers.%d.mlp" % i) for i in range(2)]
    (g1,) = smoe.EPGroup.in_process(1)
    with pytest.raises(ValueError, match=r"max_tokens = None, must be an int"):
        smoe.hf.replace_moe_blocks(model, ep_group=g1)
    with pytest.raises(ValueError, match=r"overlap = 3, must be -1, 0, 1 or 2"):
        smoe.hf.replace_moe_blocks(model, ep_group=g1, max_tokens=8, overlap=3)
    with pytest.raises(ValueError, match=r"keep_x = 2, must be a bool"):
        smoe.hf.replace_moe_blocks(model, ep_group=g1, max_tokens=8, keep_x=2)
    with pytest.raises(ValueError, match=r"expert parallelism's: pass ep_group too"):
        smoe.hf.replace_moe_blocks(model, max_tokens=8)
    with pytest.raises(ValueError, match=r"expert parallelism's: pass ep_group too"):
        smoe.hf.replace_moe_blocks(model, keep_x=True)
    g3 = smoe.EPGroup.in_process(3)[0]
    with pytest.raises(smoe.SmoeError, match=r"E = 8 experts cannot be split evenly over 3"):
        smoe.hf.replace_moe_blocks(model, ep_group=g3, max_tokens=8)
    assert [model.get_submodule("model.layers.%d.mlp" % i) for i in range(2)] == blocks
    replaced = smoe.hf.replace_moe_blocks(model, ep_group=g1, max_tokens=8)
    block = model.get_submodule("model.layers.0.mlp")
    assert "ep_rank=0 of 1, experts=[0, 8)" in repr(block)
    with pytest.raises(smoe.SmoeError, match=r"smoe.hf: 9 tokens, more than max_tokens = 8"):
        block(torch.randn(9, 16))
    with pytest.raises(ValueError, match=r"is expert-parallel: .* cannot be restored"):
        smoe.hf.restore_moe_blocks(model, replaced)
    assert model.get_submodule("model.layers.0.mlp") is block
