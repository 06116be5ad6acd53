"""smoe.MoE: SonicMoE's constructor and parameters, the Switch aux loss and
its gradient, train/eval behaviour, and loading Hugging Face MoE weights
(checked against a Hugging-Face-style forward written here)."""
import pytest
import torch
import torch.nn.functional as F

import smoe
from reference import moe_ref
from test_functional import assert_close


def test_constructor_and_parameters():
    m = smoe.MoE(8, 2, 16, 12, "swiglu", True, 0.02)
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    assert shapes == {"router.weight": (8, 16), "c_fc.weight": (8, 24, 16), "c_fc.bias": (8, 24),
                      "c_proj.weight": (8, 16, 12), "c_proj.bias": (8, 16)}
    assert abs(m.c_fc.weight.std().item() - 0.02) < 0.005
    m2 = smoe.MoE(num_experts=4, num_experts_per_tok=1, hidden_size=8, intermediate_size=6,
                  activation="relu2", add_bias=False, std=0.1)
    assert tuple(m2.c_fc.weight.shape) == (4, 6, 8) and m2.c_fc.bias is None

    class ActivationType:  # an enum-like object as SonicMoE passes
        value = "swiglu"
    assert smoe.MoE(4, 2, 8, 6, ActivationType(), False, 0.1)._act == 0


def test_forward_matches_reference_and_aux_loss():
    torch.manual_seed(1)
    m = smoe.MoE(4, 2, 8, 6, "geglu", True, 0.3).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    out, aux = m(x)
    ref, counts, logits = moe_ref(x.view(10, 8), m.router.weight, m.c_fc.weight, m.c_proj.weight,
                                  m.c_fc.bias, m.c_proj.bias, top_k=2, activation="geglu")
    assert_close(out.view(10, 8), ref, 1e-10, "out")
    p = torch.softmax(logits.float(), -1).sum(0)
    want = 4 * ((p / p.sum()) * (counts.float() / counts.sum())).sum()
    assert_close(aux, want, 1e-5, "aux loss")
    # The aux loss alone differentiates the router through router_logits.
    m.zero_grad()
    aux.backward()
    r = m.router.weight.detach().clone().requires_grad_()
    lg = (x.view(10, 8) @ r.T).float()
    p = torch.softmax(lg, -1).sum(0)
    (4 * ((p / p.sum()) * (counts.float() / counts.sum())).sum()).backward()
    assert_close(m.router.weight.grad, r.grad.double(), 1e-5, "router grad from aux")


def test_inference_mode_and_eval():
    torch.manual_seed(2)
    m = smoe.MoE(4, 2, 8, 6, "swiglu", False, 0.3, token_rounding="up", round_tile=4)
    x = torch.randn(13, 8)
    out_i, aux_i = m(x, is_inference_mode=True)
    assert aux_i is None
    m.eval()                     # token rounding is for training only
    out_e, aux_e = m(x)
    assert torch.equal(out_e, out_i) and aux_e is not None
    m.train()
    m(x)
    assert all(int(c) % 4 == 0 for c in m.last_expert_counts)


# ------------------------------------------------------------ Hugging Face

def hf_forward(x, gate_w, gates, ups, downs, top_k, norm_topk_prob, mixtral=False):
    """What Mixtral / Qwen3-MoE / OLMoE sparse MoE blocks compute."""
    logits = x @ gate_w.T
    if mixtral:
        w, sel = logits.topk(top_k, -1)
        w = torch.softmax(w, -1)
    else:
        p = torch.softmax(logits, -1)
        w, sel = p.topk(top_k, -1)
        if norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(gate_w.shape[0]):
        tok, k = (sel == e).nonzero(as_tuple=True)
        if tok.numel():
            h = F.silu(x[tok] @ gates[e].T) * (x[tok] @ ups[e].T)
            out.index_add_(0, tok, (h @ downs[e].T) * w[tok, k, None])
    return out


def hf_weights(E, d, n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.3  # noqa: E731
    return r(E, d), [r(n, d) for _ in range(E)], [r(n, d) for _ in range(E)], [r(d, n) for _ in range(E)]


@pytest.mark.parametrize("style", ["qwen3", "olmoe", "mixtral", "fused", "fused_transposed"])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_load_hf_weights(style, layout):
    E, d, n, K = 4, 8, 6, 2
    gate_w, gates, ups, downs = hf_weights(E, d, n, seed=5)
    prefix = "model.layers.0.mlp." if style != "mixtral" else "model.layers.0.block_sparse_moe."
    sd = {prefix + "gate.weight": gate_w, "model.embed_tokens.weight": torch.zeros(3)}
    if style in ("qwen3", "olmoe"):
        for e in range(E):
            sd[prefix + "experts.%d.gate_proj.weight" % e] = gates[e]
            sd[prefix + "experts.%d.up_proj.weight" % e] = ups[e]
            sd[prefix + "experts.%d.down_proj.weight" % e] = downs[e]
    elif style == "mixtral":
        for e in range(E):
            sd[prefix + "experts.%d.w1.weight" % e] = gates[e]
            sd[prefix + "experts.%d.w3.weight" % e] = ups[e]
            sd[prefix + "experts.%d.w2.weight" % e] = downs[e]
    else:
        gu = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)   # (E, 2n, d)
        dn = torch.stack(downs)                                          # (E, d, n)
        if style == "fused_transposed":
            gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        sd[prefix + "experts.gate_up_proj"] = gu
        sd[prefix + "experts.down_proj"] = dn
    routing = {"qwen3": ("softmax_topk", True), "olmoe": ("softmax_topk", False),
               "mixtral": ("topk_softmax", True)}.get(style, ("softmax_topk", True))
    m = smoe.MoE(E, K, d, n, "swiglu", False, 0.02, routing=routing[0], renormalize=routing[1],
                 w1_layout=layout).double()
    used = smoe.load_hf_moe_weights(m, sd, prefix)
    assert "model.embed_tokens.weight" not in used and len(used) == len(sd) - 1
    x = torch.randn(11, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out, _ = m(x)
    want = hf_forward(x, gate_w, gates, ups, downs, K, routing[1], mixtral=style == "mixtral")
    assert_close(out, want, 1e-10, "out")


def test_load_hf_weights_with_biases_and_errors():
    E, d, n = 3, 8, 4
    gate_w, gates, ups, downs = hf_weights(E, d, n, seed=6)
    sd = {"gate.weight": gate_w}
    for e in range(E):
        for name, w in (("gate_proj", gates[e]), ("up_proj", ups[e]), ("down_proj", downs[e])):
            sd["experts.%d.%s.weight" % (e, name)] = w
            sd["experts.%d.%s.bias" % (e, name)] = torch.full((w.shape[0],), float(e + 1))
    m = smoe.MoE(E, 2, d, n, "swiglu", True, 0.02).double()
    smoe.load_hf_moe_weights(m, sd)
    assert torch.equal(m.c_fc.bias[1], torch.full((2 * n,), 2.0, dtype=torch.float64))
    assert torch.equal(m.c_fc.weight[2, 1::2], ups[2])
    with pytest.raises(KeyError, match="gate.weight"):
        smoe.load_hf_moe_weights(m, sd, prefix="nope.")
    with pytest.raises(ValueError, match="router weight has shape"):
        smoe.load_hf_moe_weights(smoe.MoE(E + 1, 2, d, n, "swiglu", False, 0.02), sd)
    with pytest.raises(ValueError, match="not gated"):
        smoe.load_hf_moe_weights(smoe.MoE(E, 2, d, n, "relu", False, 0.02), sd)


def test_autocast_cpu_bf16_master_weights():
    torch.manual_seed(3)
    m = smoe.MoE(4, 2, 16, 8, "swiglu", True, 0.2)
    x = torch.randn(10, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, aux = m(x)
    assert out.dtype == torch.bfloat16
    (out.float().pow(2).sum() + aux).backward()
    assert m.c_fc.weight.grad.dtype == torch.float32
    ref = smoe.MoE(4, 2, 16, 8, "swiglu", True, 0.2).bfloat16()
    ref.load_state_dict({k: v.bfloat16() for k, v in m.state_dict().items()})
    out_ref, _ = ref(x.bfloat16())
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_load_from_transformers_model(family):
    # A tiny randomly initialised model from the transformers package (no
    # download): its own MoE block is the reference.
    transformers = pytest.importorskip("transformers")
    E, d, n, K = 4, 16, 12, 2
    common = dict(vocab_size=32, hidden_size=d, intermediate_size=n, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=K,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=n, num_experts=E,
                                          norm_topk_prob=True, mlp_only_layers=[], **common)
        model_cls, routing, renorm = transformers.Qwen3MoeForCausalLM, "softmax_topk", True
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=E, **common)
        model_cls, routing, renorm = transformers.MixtralForCausalLM, "topk_softmax", True
    else:
        cfg = transformers.OlmoeConfig(num_experts=E, norm_topk_prob=False, **common)
        model_cls, routing, renorm = transformers.OlmoeForCausalLM, "softmax_topk", False
    torch.manual_seed(0)
    model = model_cls(cfg).eval()   # float32: its grouped GEMMs take no float64
    layer0 = model.model.layers[0]
    block = getattr(layer0, "mlp", None) or getattr(layer0, "block_sparse_moe")
    prefix = [k for k in model.state_dict() if k.endswith(".gate.weight")][0][:-len("gate.weight")]
    with torch.no_grad():   # random init is tiny: make the experts matter
        for p in block.parameters():
            p.normal_(0, 0.3)
    m = smoe.MoE(E, K, d, n, "swiglu", False, 0.02, routing=routing, renormalize=renorm)
    smoe.load_hf_moe_weights(m, model.state_dict(), prefix)
    x = torch.randn(1, 9, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
    want = want[0] if isinstance(want, tuple) else want
    out, _ = m(x)
    assert_close(out, want, 1e-5, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_switch_loss_is_the_normalize_formula_bit_for_bit(dtype):
    # smoe's switch_load_balancing_loss spells F.softmax / F.normalize as the
    # tensor operations they run: the same value and gradient, to the bit.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 6, generator=g).to(dtype)
    counts = torch.tensor([4, 0, 7, 1, 3, 15], dtype=torch.int32)

    def textbook(lg):
        lg = lg.reshape(-1, lg.shape[-1])
        probs = F.softmax(lg, dim=-1, dtype=torch.float32)
        p = F.normalize(probs.sum(0), p=1, dim=0)
        f = F.normalize(counts.to(torch.float32), p=1, dim=0)
        return lg.shape[1] * (p * f).sum()

    res = []
    for fn in (smoe.switch_load_balancing_loss, lambda lg, c: textbook(lg)):
        lg = logits.clone().requires_grad_()
        loss = fn(lg, counts)
        loss.backward()
        res.append((loss.detach(), lg.grad))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
