"""smoe.hf: Hugging Face MoE blocks replaced in place by smoe-backed ones.
The reference is the transformers model itself: tiny random models built
from the config classes (nothing downloaded), an untouched deep copy beside
the patched one, compared in float32 on the CPU (block outputs and every
gradient, whole-model logits, losses, router logits and their gradients,
state dicts). Tested with transformers 5.24.0."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import smoe            # noqa: E402
import smoe.hf         # noqa: E402
from test_functional import assert_close   # noqa: E402

# Another transformers version than the tested ones may lay a block out
# differently (smoe.hf then refuses it) or fail in its own model: on such a
# version those cases skip, saying why; on a tested one they must pass.
TESTED = transformers.__version__ in smoe.hf.TESTED_TRANSFORMERS_VERSIONS


def untested_skip(what, err):
    if TESTED:
        raise err
    pytest.skip("transformers %s (tested: %s): %s: %s"
                % (transformers.__version__, ", ".join(smoe.hf.TESTED_TRANSFORMERS_VERSIONS),
                   what, err))


def replace_blocks(model, family, **kw):
    """smoe.hf.replace_moe_blocks(model, **kw), skipping where an untested
    transformers version has a layout smoe.hf refuses."""
    try:
        return smoe.hf.replace_moe_blocks(model, **kw)
    except ValueError as e:
        untested_skip("smoe.hf refuses %s's layout" % family, e)


def hf_run(model, family, *args, **kw):
    """model(*args, **kw) for the unpatched HF model, skipping where an
    untested transformers version's own model fails."""
    try:
        return model(*args, **kw)
    except Exception as e:   # noqa: BLE001 (whatever that version raises)
        untested_skip("its own %s model fails" % family, e)


V, D = 64, 16           # vocabulary, hidden size
# DeepSeek-V3's block and those that are the same code under other names
DSV3_LIKE = ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"]
FAMILIES = ["qwen3_moe", "qwen3_moe_no_norm", "qwen2_moe", "qwen3_next", "mixtral", "minimax",
            "minimax_m2", "olmoe", "flex_olmo", "jamba", "granitemoe", "granitemoeshared",
            "granitemoehybrid", "hunyuan"] + DSV3_LIKE


def tiny_model(family, **extra):
    """A two-layer model of `family` with random weights, float32, eval mode.
    The experts' and routers' weights are drawn large enough that the
    experts and the routing matter (the default init is tiny)."""
    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  router_aux_loss_coef=0.5)
    if family.startswith("qwen3_moe"):
        cfg = transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                          num_experts=8, num_experts_per_tok=2,
                                          norm_topk_prob=family == "qwen3_moe", mlp_only_layers=[],
                                          decoder_sparse_step=1, **common, **extra)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":   # (Qwen3-MoE's experts and a gated shared expert)
        cfg = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                          shared_expert_intermediate_size=20, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=False,
                                          mlp_only_layers=[], decoder_sparse_step=1, **common,
                                          **extra)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "qwen3_next":   # (Qwen2-MoE's block; linear and full attention)
        cfg = transformers.Qwen3NextConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
            decoder_sparse_step=1, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"], **common, **extra)
        cls = transformers.Qwen3NextForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=12, num_local_experts=8,
                                         num_experts_per_tok=2, **common, **extra)
        cls = transformers.MixtralForCausalLM
    elif family == "minimax":   # (Mixtral's block; lightning attention around it)
        cfg = transformers.MiniMaxConfig(intermediate_size=12, num_local_experts=8,
                                         num_experts_per_tok=2, head_dim=8, **common, **extra)
        cls = transformers.MiniMaxForCausalLM
    elif family == "minimax_m2":   # (sigmoid routing with the block's bias, no groups)
        cfg = transformers.MiniMaxM2Config(intermediate_size=12, num_local_experts=8,
                                           num_experts_per_tok=3, head_dim=8, **common, **extra)
        cls = transformers.MiniMaxM2ForCausalLM
    elif family == "hunyuan":   # (softmax_topk; router gate.wg; an ungated shared MLP)
        cfg = transformers.HunYuanMoEV1Config(intermediate_size=12, num_experts=8, moe_topk=2,
                                              head_dim=8, **common, **extra)
        cls = transformers.HunYuanMoEV1ForCausalLM
    elif family == "jamba":   # (softmax_topk unnormalised; Mamba layers, their slow path)
        cfg = transformers.JambaConfig(intermediate_size=12, num_experts=8, num_experts_per_tok=2,
                                       expert_layer_period=1, expert_layer_offset=0,
                                       attn_layer_period=1, attn_layer_offset=0,
                                       use_mamba_kernels=False, **common, **extra)
        cls = transformers.JambaForCausalLM
    elif family.startswith("granitemoe"):   # (topk_softmax; the router child is `router`)
        kw = dict(intermediate_size=12, num_local_experts=8, num_experts_per_tok=2)
        if family == "granitemoe":
            cfg = transformers.GraniteMoeConfig(**kw, **common, **extra)
            cls = transformers.GraniteMoeForCausalLM
        elif family == "granitemoeshared":
            cfg = transformers.GraniteMoeSharedConfig(shared_intermediate_size=20, **kw, **common,
                                                      **extra)
            cls = transformers.GraniteMoeSharedForCausalLM
        else:
            cfg = transformers.GraniteMoeHybridConfig(
                shared_intermediate_size=20, layer_types=["attention", "attention"],
                mamba_n_heads=2, mamba_d_head=16, **kw, **common, **extra)
            cls = transformers.GraniteMoeHybridForCausalLM
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=12, num_experts=8, num_experts_per_tok=3,
                                       norm_topk_prob=False, **common, **extra)
        cls = transformers.OlmoeForCausalLM
    elif family == "flex_olmo":   # (OLMoE's block)
        cfg = transformers.FlexOlmoConfig(intermediate_size=12, num_experts=8,
                                          num_experts_per_tok=3, norm_topk_prob=False, **common,
                                          **extra)
        cls = transformers.FlexOlmoForCausalLM
    elif family in DSV3_LIKE:
        del common["router_aux_loss_coef"]
        moe = dict(intermediate_size=32, moe_intermediate_size=12, n_routed_experts=8,
                   num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
        mla = dict(kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8,
                   qk_nope_head_dim=4)
        if family == "deepseek_v3":
            cfg = transformers.DeepseekV3Config(first_k_dense_replace=0, **moe, **mla, **common,
                                                **extra)
            cls = transformers.DeepseekV3ForCausalLM
        elif family == "glm4_moe":
            cfg = transformers.Glm4MoeConfig(first_k_dense_replace=0, head_dim=8, **moe, **common,
                                             **extra)
            cls = transformers.Glm4MoeForCausalLM
        elif family == "glm4_moe_lite":
            cfg = transformers.Glm4MoeLiteConfig(mlp_layer_types=["sparse", "sparse"], **moe,
                                                 **mla, **common, **extra)
            cls = transformers.Glm4MoeLiteForCausalLM
        else:
            cfg = transformers.Dots1Config(first_k_dense_replace=0, head_dim=8, **moe, **common,
                                           **extra)
            cls = transformers.Dots1ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ".experts." in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            elif name.endswith(("gate.weight", "router.weight", "gate.wg.weight")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith("e_score_correction_bias"):
                # Large enough to change which experts win, not what they score.
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return model


def patched_pair(family, **extra):
    ref = tiny_model(family, **extra)
    model = copy.deepcopy(ref)
    replaced = replace_blocks(model, family)
    return ref, model, replaced


def router_name(family):
    return "router" if family.startswith("granitemoe") or family == "jamba" else "gate"


def block_names(family):
    block = ("block_sparse_moe" if family.startswith("granitemoe") else
             "feed_forward" if family == "jamba" else "mlp")
    return ["model.layers.%d.%s" % (i, block) for i in range(2)]   # in this version


@pytest.mark.parametrize("family", FAMILIES)
def test_replaced_blocks_and_parameters_kept(family):
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    before = {name: (id(p), p) for name, p in model.named_parameters()}
    replaced = replace_blocks(model, family)
    assert sorted(replaced) == block_names(family)
    for name, block in replaced.items():
        new = model.get_submodule(name)
        assert type(block).__module__.startswith("transformers.models.")
        assert isinstance(new, (smoe.hf.SmoeSparseMoeBlock, smoe.hf.SmoeDeepseekV3MoE,
                                smoe.hf.SmoeMiniMaxM2SparseMoeBlock))
        assert isinstance(new, smoe.hf.SmoeSharedExpertMoeBlock) == (
            family in ("qwen2_moe", "qwen3_next", "hunyuan"))
        rn = router_name(family)
        assert getattr(new, rn) is getattr(block, rn) and new.experts is block.experts
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(id(after[k]) == before[k][0] for k in after)   # the very same Parameters
    # A second call finds nothing new and leaves the model alone.
    assert smoe.hf.replace_moe_blocks(model) == {}
    assert list(dict(model.named_parameters())) == list(before)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_forward_and_every_gradient(family):
    ref, model, replaced = patched_pair(family)
    g = torch.Generator().manual_seed(2)
    for name in replaced:
        hf_block, sm_block = ref.get_submodule(name), model.get_submodule(name)
        x = torch.randn(3, 7, D, generator=g)
        dout = torch.randn(3, 7, D, generator=g)
        results = []
        for block in (hf_block, sm_block):
            block.zero_grad()
            xi = x.clone().requires_grad_()
            out = block(xi)
            assert isinstance(out, torch.Tensor) and out.shape == x.shape   # as HF: a tensor
            out.backward(dout)
            grads = {k: p.grad for k, p in block.named_parameters()}
            results.append((out.detach(), xi.grad, grads))
        (o_ref, dx_ref, g_ref), (o, dx, gr) = results
        assert_close(o, o_ref, 2e-6, "%s out" % name)
        assert_close(dx, dx_ref, 2e-6, "%s dx" % name)
        assert list(gr) == list(g_ref)
        assert router_name(family) + (".wg.weight" if family == "hunyuan" else ".weight") in gr
        assert "experts.gate_up_proj" in gr and "experts.down_proj" in gr
        for k in g_ref:
            assert g_ref[k] is not None and gr[k] is not None, k
            assert_close(gr[k], g_ref[k], 2e-6, "%s d%s" % (name, k))
        # smoe's expert counts are what HF's router picked.
        top_k = getattr(hf_block, router_name(family)).top_k
        assert int(sm_block.last_expert_counts.sum()) == 21 * top_k


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_round_trip(family):
    ref, model, replaced = patched_pair(family)
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert sd[k].shape == sd_ref[k].shape and torch.equal(sd[k], sd_ref[k]), k
    # An HF checkpoint (another random model of the same config) loads into
    # the patched model, strictly, and the patched model computes what the
    # HF model with that checkpoint does.
    other = tiny_model(family)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = copy.deepcopy(other.state_dict())
    model.load_state_dict(ckpt, strict=True)
    assert all(torch.equal(model.state_dict()[k], ckpt[k]) for k in ckpt)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(model(ids).logits, other(ids).logits, 1e-5, "logits after load")
    # And the patched model's state dict loads into a plain HF model.
    plain = tiny_model(family)
    plain.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(plain.state_dict()[k], ckpt[k]) for k in ckpt)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_model_logits_loss_router_logits_and_gradients(family):
    ref, model, replaced = patched_pair(family)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, V, (2, 11), generator=g)
    labels = torch.randint(3, V, (2, 11), generator=g)
    with torch.no_grad():
        assert_close(model(ids).logits, ref(ids).logits, 1e-5, "logits")
    outs = []
    for m in (ref, model):
        m.zero_grad()
        run = (lambda *a, **k: hf_run(ref, family, *a, **k)) if m is ref else m
        out = run(ids, labels=labels, output_router_logits=True)
        out.loss.backward()
        outs.append(out)
    o_ref, o = outs
    assert_close(o.logits, o_ref.logits, 1e-5, "logits")
    assert_close(o.loss, o_ref.loss, 1e-6, "loss")
    # Older transformers (4.x) give DeepSeek-V3 no router_logits output.
    assert hasattr(o, "router_logits") == hasattr(o_ref, "router_logits")
    n_rl = len(replaced) if hasattr(o_ref, "router_logits") else 0
    assert len(getattr(o, "router_logits", ())) == len(getattr(o_ref, "router_logits", ())) == n_rl
    for a, b in zip(getattr(o, "router_logits", ()), getattr(o_ref, "router_logits", ())):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close(a, b, 1e-5, "router logits")
    if family in DSV3_LIKE + ["hunyuan"]:
        # its model has no aux loss (transformers 4.x: no aux_loss field)
        assert getattr(o_ref, "aux_loss", None) is None and getattr(o, "aux_loss", None) is None
    else:
        assert o_ref.aux_loss is not None and float(o_ref.aux_loss.detach()) > 0
        assert_close(o.aux_loss, o_ref.aux_loss, 1e-6, "aux loss")
    # Every parameter's gradient, the aux loss's share through the router
    # logits included (router_aux_loss_coef = 0.5).
    grads_ref = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        assert (p.grad is None) == (grads_ref[k].grad is None), k
        if p.grad is not None:
            assert_close(p.grad, grads_ref[k].grad, 2e-5, "d" + k)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_aux_loss_gradient_reaches_the_router(family):
    # The aux loss alone, differentiated: its gradient reaches the router
    # only through the router logits smoe hands to the HF recorder.
    ref, model, _ = patched_pair(family)
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(5))
    grads = []
    for m in (ref, model):
        m.zero_grad()
        m(ids, output_router_logits=True).aux_loss.backward()
        grads.append(m.get_submodule("model.layers.1.mlp.gate").weight.grad)
    assert grads[0].abs().max() > 0
    assert_close(grads[1], grads[0], 2e-5, "router grad from the aux loss")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hooks_installed_before_the_swap_and_gradient_checkpointing(family):
    # The router-logit recorder hooked before the swap (the router modules
    # are kept, hooks and all), then training with gradient checkpointing
    # (the blocks' forward runs again in backward).
    ref = tiny_model(family)
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(12))
    ref(ids, output_router_logits=True)
    model = copy.deepcopy(ref)
    smoe.hf.replace_moe_blocks(model)
    outs = []
    for m in (ref, model):
        m.train()
        # activation_checkpointing_enable in transformers 5, gradient_ in 4.
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        out = m(ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        outs.append(out)
    if hasattr(outs[0], "router_logits"):
        assert len(outs[1].router_logits) == 2
    assert_close(outs[1].loss, outs[0].loss, 1e-6, "loss")
    grads_ref = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        if grads_ref[k].grad is not None:
            assert_close(p.grad, grads_ref[k].grad, 2e-5, "d" + k)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bfloat16_model(family):
    # bfloat16 on the CPU backend, by STYLE.md's rule: the patched model's
    # error against the float32 model at most twice the HF bfloat16 model's
    # (plus a small atol); a finite bfloat16 gradient.
    ref, model, _ = patched_pair(family)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        exact = ref(ids).logits
    ref, model = ref.bfloat16(), model.bfloat16()
    ref.set_experts_implementation("eager")   # its grouped_mm wants 16-byte strides
    with torch.no_grad():
        hf, got = ref(ids).logits.float(), model(ids).logits.float()
    assert got.shape == hf.shape and got.dtype == hf.dtype
    err_hf, err = (hf - exact).abs().max(), (got - exact).abs().max()
    assert err <= 2 * err_hf + 1e-3 * exact.abs().max(), (float(err), float(err_hf))
    model(ids, labels=ids).loss.backward()
    w = model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    assert w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad).all()


def test_patched_model_copies_and_pickles(tmp_path):
    ref, model, _ = patched_pair("olmoe")
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(13))
    want = ref(ids, output_router_logits=True)
    torch.save(model, tmp_path / "model.pt")
    for m in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert isinstance(m.model.layers[0].mlp, smoe.hf.SmoeSparseMoeBlock)
        assert m.model.layers[0].mlp.gate.forward.router is m.model.layers[0].mlp.gate
        got = m(ids, output_router_logits=True)
        assert_close(got.logits, want.logits, 1e-5, "logits")
        assert_close(got.aux_loss, want.aux_loss, 1e-6, "aux loss")


def test_mixtral_jitter_noise_in_training():
    ref, model, replaced = patched_pair("mixtral", router_jitter_noise=0.2)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(6))
    for name in replaced:
        outs = []
        for m in (ref, model):
            block = m.get_submodule(name).train()
            torch.manual_seed(7)
            outs.append(block(x.clone()))
        assert_close(outs[1], outs[0], 2e-6, "jittered out")
        torch.manual_seed(8)
        assert not torch.allclose(model.get_submodule(name)(x.clone()), outs[1])
        with torch.no_grad():   # eval: no jitter
            model.get_submodule(name).eval()
            ref.get_submodule(name).eval()
            assert_close(model.get_submodule(name)(x), ref.get_submodule(name)(x), 2e-6, "eval")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_router_alone_and_restore(family):
    ref, model, replaced = patched_pair(family)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(9))
    name = sorted(replaced)[0]
    # Called on its own, the router is still the HF router.
    got = model.get_submodule(name).gate(x)
    want = ref.get_submodule(name).gate(x)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    smoe.hf.restore_moe_blocks(model, replaced)
    for n, block in replaced.items():
        assert model.get_submodule(n) is block
        assert "forward" not in vars(block.gate)
    ids = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_gpt_oss_refused():
    cfg = transformers.GptOssConfig(vocab_size=V, hidden_size=D, intermediate_size=12,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    before = model.model.layers[0].mlp
    with pytest.raises(ValueError, match="clamped SwiGLU"):
        smoe.hf.replace_moe_blocks(model)
    assert model.model.layers[0].mlp is before
    # The loader of smoe.MoE refuses its weights rather than loading them wrong.
    layer = smoe.MoE(4, 2, D, 12, "swiglu", True, 0.02)
    with pytest.raises(ValueError, match="gpt-oss"):
        smoe.load_hf_moe_weights(layer, model.state_dict(), "model.layers.0.mlp.")


def test_deepseek_v3_weights_refused_by_the_loader():
    model = tiny_model("deepseek_v3")
    layer = smoe.MoE(8, 3, D, 12, "swiglu", False, 0.02)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        smoe.load_hf_moe_weights(layer, model.state_dict(), "model.layers.0.mlp.")


def test_shared_expert_blocks_refused_by_the_loader():
    # (smoe.MoE has no shared expert: the loader must not drop it silently)
    model = tiny_model("qwen2_moe")
    layer = smoe.MoE(8, 2, D, 12, "swiglu", False, 0.02)
    with pytest.raises(ValueError, match="shared_expert_gate.weight: a Qwen2-MoE"):
        smoe.load_hf_moe_weights(layer, model.state_dict(), "model.layers.0.mlp.")


def test_unknown_layouts_refused_before_anything_is_replaced():
    model = tiny_model("qwen3_moe")
    blocks = [model.get_submodule(n) for n in block_names("qwen3_moe")]
    blocks[1].experts.is_transposed = True            # a layout this version does not have
    with pytest.raises(ValueError, match="is_transposed"):
        smoe.hf.replace_moe_blocks(model)
    assert [model.get_submodule(n) for n in block_names("qwen3_moe")] == blocks
    blocks[1].experts.is_transposed = False
    bias = torch.nn.Parameter(torch.zeros(8, 24))
    blocks[1].experts.register_parameter("gate_up_proj_bias", bias)
    with pytest.raises(ValueError, match="gate_up_proj_bias"):
        smoe.hf.replace_moe_blocks(model)
    del blocks[1].experts.gate_up_proj_bias
    blocks[0].experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="SiLU"):
        smoe.hf.replace_moe_blocks(model)
    assert [model.get_submodule(n) for n in block_names("qwen3_moe")] == blocks
    with pytest.raises(ValueError, match="not a block"):
        smoe.hf.replace_moe_blocks(blocks[1])
    with pytest.raises(ValueError, match="no MoE block"):
        smoe.hf.replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_deepseek_v3_runs_smoe_router():
    # The routing is smoe's 'sigmoid_topk' (the HF router's forward is not
    # run by the block); the router's hooks still see its float32 logits,
    # and the expert bias is read at every call.
    ref, model, replaced = patched_pair("deepseek_v3")
    name = sorted(replaced)[0]
    hf_block, sm_block = ref.get_submodule(name), model.get_submodule(name)
    seen = []
    sm_block.gate.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(14))
    cls = type(sm_block.gate)
    hf_forward = cls.forward

    def refuse(*args, **kwargs):
        raise AssertionError("the HF router ran")

    cls.forward = refuse
    try:
        with torch.no_grad():
            out = sm_block(x)
    finally:
        cls.forward = hf_forward
    with torch.no_grad():
        want = hf_block(x)
        logits = hf_block.gate(x)[0]
    assert_close(out, want, 2e-6, "out")
    assert len(seen) == 1 and seen[0].dtype == torch.float32 and seen[0].shape == (14, 8)
    assert_close(seen[0], logits, 1e-6, "router logits")
    # A new bias (as aux-loss-free balancing sets it) moves the choice.
    with torch.no_grad():
        for block in (hf_block, sm_block):
            block.gate.e_score_correction_bias[5] = 3.0   # expert 5 wins every token
        assert_close(sm_block(x), hf_block(x), 2e-6, "out after the bias update")
    assert int(sm_block.last_expert_counts[5]) == 14


def test_deepseek_v3_float32_router_in_a_bfloat16_model():
    # transformers keeps gate.weight and e_score_correction_bias in float32
    # when it loads a bfloat16 checkpoint: the router weight is rounded to
    # bfloat16 for smoe's router (differentiably: its gradient is float32).
    ref, model, replaced = patched_pair("deepseek_v3")
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        exact = ref(ids).logits
    model.bfloat16()
    for name in replaced:
        gate = model.get_submodule(name).gate
        gate.weight.data = gate.weight.data.float()
        gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    with torch.no_grad():
        got = model(ids).logits.float()
    ref.bfloat16()
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        hf = ref(ids).logits.float()
    err_hf, err = (hf - exact).abs().max(), (got - exact).abs().max()
    assert err <= 2 * err_hf + 1e-3 * exact.abs().max(), (float(err), float(err_hf))
    model(ids, labels=ids).loss.backward()
    w = model.get_parameter("model.layers.1.mlp.gate.weight")
    assert w.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all() and w.grad.abs().max() > 0


def test_deepseek_v3_routing_options_checked_at_replacement():
    model = tiny_model("deepseek_v3")
    model.get_submodule("model.layers.1.mlp.gate").topk_group = 1   # 1 group of 2 < K = 3
    before = [model.get_submodule(n) for n in block_names("deepseek_v3")]
    with pytest.raises(ValueError, match=r"the router's topk_group = 1 groups of 2 experts hold "
                       r"fewer than top_k = 3 experts"):
        smoe.hf.replace_moe_blocks(model)
    assert [model.get_submodule(n) for n in block_names("deepseek_v3")] == before


def test_traits_name_supported_blocks():
    # every block with traits of its own is one the table supports (a
    # misspelt class name would leave its traits unused)
    assert set(smoe.hf._TRAITS) <= set(smoe.hf._BLOCKS)


def test_ci_installs_the_tested_transformers():
    # python/ci.sh pins the transformers that smoe.hf is tested with
    import os
    import re
    ci = open(os.path.join(os.path.dirname(__file__), "..", "ci.sh")).read()
    pin = re.search(r"^tf=(\S+)$", ci, re.M)
    assert pin and pin.group(1) in smoe.hf.TESTED_TRANSFORMERS_VERSIONS
