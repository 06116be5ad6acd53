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
    with pytest.raises(ValueError, match="DeepSeek-V3 block"):
        smoe.load_hf_moe_weights(smoe.EPMoE(E, 2, d, n, ep_group=g, max_tokens=4), sd, prefix)
