"""smoe.hf: the MoE blocks of a Hugging Face transformers model on smoe, in
place, with the model's own parameter names.

    import smoe.hf
    replaced = smoe.hf.replace_moe_blocks(model)   # {qualified name: the HF block}
    ...                                            # train, save, load as before
    smoe.hf.restore_moe_blocks(model, replaced)    # back to the HF blocks

Each replacement adopts the HF block's children (the router `gate`, the
fused `experts`, DeepSeek-V3's `shared_experts`) as they are: the same
nn.Module and nn.Parameter objects under the same names, so the state dict
(keys, order, shapes, values) is the HF block's, a checkpoint loads and
saves unchanged, and an optimizer built before the swap keeps working. Only
the block's forward changes: the experts run as one smoe layer
(`w1 = experts.gate_up_proj` (E, 2n, d) in the concatenated layout, `w2 =
experts.down_proj` (E, d, n), SwiGLU), taking and returning what the HF
block does.

Blocks (transformers 5.24.0 is the version tested, by
python/tests/test_hf.py; the layouts of that version are checked at
replacement and any other layout is refused, not guessed):

  Qwen3MoeSparseMoeBlock    smoe routing 'softmax_topk', renormalize =
                            gate.norm_topk_prob
  OlmoeSparseMoeBlock       the same
  FlexOlmoSparseMoeBlock    the same (OLMoE's code)
  Qwen2MoeSparseMoeBlock,   the same routed experts, plus the HF shared
  Qwen3NextSparseMoeBlock   expert times sigmoid(shared_expert_gate(x))
  MixtralSparseMoeBlock     'topk_softmax' (softmax over E, top K,
                            renormalised, is softmax over the K largest
                            logits); router jitter noise in training as HF
  MiniMaxSparseMoeBlock     the same (Mixtral's code; MiniMax-Text-01)
  HunYuanMoEV1Moe           'softmax_topk', always renormalised; the
                            router weight is gate.wg.weight (cast to x's
                            dtype where it differs, differentiably), the
                            logits in its dtype as HF's; shared_mlp, the
                            HF MLP, added ungated
  JambaSparseMoeBlock       'softmax_topk', never renormalised (its router
                            has no norm_topk_prob); the router child is
                            `router`
  GraniteMoeMoE (and        'topk_softmax' (softmax over the K largest
  GraniteMoeShared's,       logits, as HF computes it); the router child
  GraniteMoeHybrid's)       is `router`, its logits float32 as HF's
  MiniMaxM2SparseMoeBlock   'sigmoid_topk' without groups: sigmoid scores,
                            the block's e_score_correction_bias for the
                            choice, renormalised (HF divides by the sum,
                            smoe by the sum + 1e-20 as DeepSeek-V3: the
                            same unless the K scores sum below 1e-12);
                            Mixtral's jitter noise in training
  DeepseekV3MoE             'sigmoid_topk' (sigmoid, gate.e_score_correction_bias
                            for the choice, gate.num_group groups of which
                            gate.topk_group are kept, renormalised if
                            gate.norm_topk_prob, times
                            gate.routed_scaling_factor); shared_experts
                            stay the HF MLP
  Glm4MoeMoE (GLM-4.5, GLM-4.5-Air), Glm4MoeLiteMoE, Dots1MoE (dots.llm1)
                            the same as DeepseekV3MoE (their router,
                            experts and block compute what DeepSeek-V3's
                            do, line for line, in this version)

Expert parallelism: replace_moe_blocks(model, ep_group=group,
max_tokens=T) on every rank runs each block on smoe.EPMoE's layer over the
group, each rank keeping only its experts' slice, [r E/P, (r+1) E/P), of
experts.gate_up_proj and experts.down_proj (new Parameters: the state dict
keeps its keys, this rank's shard in those two); the router and the
shared experts stay replicated. Load the HF model on every rank, then
replace: the other ranks' experts are freed.

Refused with an error naming why: gpt-oss (GptOssMLP; its experts use a
clamped SwiGLU, which smoe has no activation for) and every block of a
supported class whose structure is not the one above.

Router logits: in this transformers version the blocks return only the
hidden states, and `output_router_logits=True` records the router module's
first output through a forward hook. smoe computes the router logits itself
(one GEMM with fp32 accumulation inside the layer), so the router module's
forward is not run; instead it is called with smoe's logits, which it hands
back unchanged (see _RouterTap), so its hooks, the output recorder among
them, see (router_logits (T, E), None, None): in x's dtype, as the HF
router returns them, and float32 for DeepSeek-V3 (whose HF router computes
in float32). A loss on those logits (the aux load-balancing loss) reaches
the router weight through smoe's dlogits_extra. The router called on its
own (not from the block) still runs the HF forward.

DeepSeek-V3 dtypes: the HF router casts x and its weight to float32; smoe's
router takes them in x's dtype (exact products, float32 sums: the same
logits up to the order of the sums when the weight has x's dtype). A
float32 gate.weight in a bfloat16 model (transformers keeps it so when it
loads a checkpoint) is rounded to x's dtype for the call, differentiably:
its gradient arrives in float32, and the routing is a bfloat16 router's
(near-ties may choose otherwise than HF's float32 router).
e_score_correction_bias is used as float32 (converted if the model was cast).
"""
import torch
import torch.nn as nn

from ._lib import (SMOE_ACT_SWIGLU, SMOE_ERROR_INVALID_SIZE, SMOE_ROUTING_SIGMOID_TOPK,
                   SMOE_W1_CONCATENATED, SmoeError)
from .ep import _as_group, _ep_moe, check_ep_options
from .functional import ROUTINGS, _autocast_dtype, check_sigmoid_options, moe

__all__ = ["replace_moe_blocks", "restore_moe_blocks", "SmoeSparseMoeBlock",
           "SmoeSharedExpertMoeBlock", "SmoeMiniMaxM2SparseMoeBlock", "SmoeDeepseekV3MoE",
           "TESTED_TRANSFORMERS_VERSIONS"]

TESTED_TRANSFORMERS_VERSIONS = ("5.24.0",)

_SMOE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


# ------------------------------------------------------------ what is recognised

def _hf_name(cls):
    return cls.__module__ + "." + cls.__qualname__


def _hf_class(module, name):
    """The qualified name of transformers.models.<module>'s class <name>."""
    return "transformers.models.%s.modeling_%s.%s" % (module, module, name)


def _family(module, prefix, kind, children, block="SparseMoeBlock", router="TopKRouter"):
    """One _BLOCKS entry: transformers.models.<module>'s <prefix><block>,
    with its <prefix><router> and <prefix>Experts."""
    return _hf_class(module, prefix + block), (kind, _hf_class(module, prefix + router),
                                               _hf_class(module, prefix + "Experts"), children)


_GE = ("gate", "experts")
_RE = ("router", "experts")   # (IBM Granite's router child)
_SHARED_GATED = ("gate", "experts", "shared_expert", "shared_expert_gate")
_DSV3_CHILDREN = ("experts", "gate", "shared_experts")
_SHARED_MLP = ("gate", "experts", "shared_mlp")   # (HunYuan's)

# HF block class -> (kind, router class, experts class, the block's children).
# Matched by exact class (a subclass may compute something else).
_BLOCKS = dict([
    _family("qwen3_moe", "Qwen3Moe", "softmax_topk", ("experts", "gate")),
    _family("olmoe", "Olmoe", "softmax_topk", _GE),
    _family("mixtral", "Mixtral", "topk_softmax", _GE),
    # Qwen3-MoE's router and experts with a gated shared expert beside them
    _family("qwen2_moe", "Qwen2Moe", "softmax_topk", _SHARED_GATED),
    _family("qwen3_next", "Qwen3Next", "softmax_topk", _SHARED_GATED),
    # OLMoE's and Mixtral's blocks under other names (the same code in this version)
    _family("flex_olmo", "FlexOlmo", "softmax_topk", _GE),
    _family("minimax", "MiniMax", "topk_softmax", _GE),
    _family("minimax_m2", "MiniMaxM2", "minimax_m2", _GE),
    _family("hunyuan_v1_moe", "HunYuanMoEV1", "softmax_topk", _SHARED_MLP, "Moe", "Gate"),
    _family("jamba", "Jamba", "softmax_topk", _RE),
    _family("granitemoe", "GraniteMoe", "topk_softmax", _RE, "MoE"),
    _family("granitemoeshared", "GraniteMoeShared", "topk_softmax", _RE, "MoE"),
    _family("granitemoehybrid", "GraniteMoeHybrid", "topk_softmax", _RE, "MoE"),
    _family("deepseek_v3", "DeepseekV3", "deepseek_v3", _DSV3_CHILDREN, "MoE", "TopkRouter"),
    # DeepSeek-V3's block under other names (the same code in this version)
    _family("glm4_moe", "Glm4Moe", "deepseek_v3", _DSV3_CHILDREN, "MoE", "TopkRouter"),
    _family("glm4_moe_lite", "Glm4MoeLite", "deepseek_v3", _DSV3_CHILDREN, "MoE", "TopkRouter"),
    _family("dots1", "Dots1", "deepseek_v3", _DSV3_CHILDREN, "MoE", "TopkRouter"),
])

# What some blocks do differently from their kind's default: renorm (the
# renormalisation of softmax_topk when the router has no norm_topk_prob),
# logits (the dtype of the logits the HF router returns: 'x' by default,
# 'float32', or 'router', its weight's) and router_weight (the router's
# parameter, 'weight' by default).
_TRAITS = {
    _hf_class("hunyuan_v1_moe", "HunYuanMoEV1Moe"): dict(renorm=True, logits="router",
                                                         router_weight="wg.weight"),
    _hf_class("jamba", "JambaSparseMoeBlock"): dict(renorm=False),
    _hf_class("granitemoe", "GraniteMoeMoE"): dict(logits="float32"),
    _hf_class("granitemoeshared", "GraniteMoeSharedMoE"): dict(logits="float32"),
    _hf_class("granitemoehybrid", "GraniteMoeHybridMoE"): dict(logits="float32"),
}

_REFUSED = {
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP":
        "gpt-oss experts compute a clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * "
        "sigmoid(alpha * g) with g = clamp(gate, max=limit), which smoe has no activation for "
        "(its SwiGLU is silu(gate) * up; the clamps cannot be folded into the weights), so the "
        "block cannot be computed exactly. (Its interleaved gate/up layout and its router "
        "bias alone would be expressible.) The block is left to transformers.",
}


def _refuse(name, block, why, *args):
    raise ValueError("smoe.hf: cannot replace %s (%s): %s" % (name, _hf_name(type(block)),
                                                             why % args if args else why))


def _router_name(children):
    """The router's name among a block's children: `gate`, or (Granite)
    `router`."""
    return "router" if "router" in children else "gate"


def _check_block(name, block):
    """Checks that `block` has the structure of its class in the tested
    transformers version; returns (kind, E, n, d). Raises ValueError
    otherwise."""
    kind, router_cls, experts_cls, children = _BLOCKS[_hf_name(type(block))]
    have = tuple(n for n, _ in block.named_children())
    if have != children:
        _refuse(name, block, "children %s, expected %s (an unknown transformers layout)",
                have, children)
    own = {n: tuple(t.shape) for n, t in list(block.named_parameters(recurse=False)) +
           list(block.named_buffers(recurse=False))}
    router, experts = getattr(block, _router_name(children)), block.experts
    E0 = getattr(router, "num_experts", None)
    want_own = {"e_score_correction_bias": (E0,)} if kind == "minimax_m2" else {}
    if own != want_own:
        _refuse(name, block, "parameters or buffers of its own %s, expected %s: an unknown "
                "layout", own, want_own)
    for what, mod, cls in ((_router_name(children), router, router_cls),
                           ("experts", experts, experts_cls)):
        if _hf_name(type(mod)) != cls:
            _refuse(name, block, "its %s is a %s, expected %s", what, _hf_name(type(mod)), cls)

    params = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    if set(params) != {"gate_up_proj", "down_proj"} or list(experts.buffers()):
        _refuse(name, block, "experts with parameters %s (and %d buffers); expected exactly "
                "gate_up_proj (E, 2n, d) and down_proj (E, d, n)", sorted(params),
                len(list(experts.buffers())))
    if len(params["gate_up_proj"]) != 3 or len(params["down_proj"]) != 3:
        _refuse(name, block, "expert weights of shapes %s, %s; expected 3-dimensional",
                params["gate_up_proj"], params["down_proj"])
    E, h, d = params["gate_up_proj"]
    if params["down_proj"] != (E, d, h // 2) or h % 2:
        _refuse(name, block, "gate_up_proj has shape %s and down_proj %s; expected (E, 2n, d) "
                "and (E, d, n)", params["gate_up_proj"], params["down_proj"])
    n = h // 2
    # The flags transformers' use_experts_implementation sets on the experts
    # (absent: the defaults of that decorator, which are these).
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, want in flags.items():
        if getattr(experts, flag, want) != want:
            _refuse(name, block, "experts.%s = %r; smoe.hf handles %s = %r only", flag,
                    getattr(experts, flag), flag, want)
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or _hf_name(type(act)) == "transformers.activations."
            "SiLUActivation"):
        _refuse(name, block, "experts.act_fn is %s; smoe.hf handles SiLU (hidden_act 'silu') "
                "only", type(act).__name__)

    rparams = {n: tuple(p.shape) for n, p in router.named_parameters()}
    rbufs = {n: tuple(b.shape) for n, b in router.named_buffers()}
    want_bufs = {"e_score_correction_bias": (E,)} if kind == "deepseek_v3" else {}
    rw = _TRAITS.get(_hf_name(type(block)), {}).get("router_weight", "weight")
    if rparams != {rw: (E, d)} or rbufs != want_bufs:
        _refuse(name, block, "router parameters %s and buffers %s; expected %s (%d, %d)%s",
                rparams, rbufs, rw, E, d, " and e_score_correction_bias (%d,)" % E
                if want_bufs else " and no buffer")
    top_k = getattr(router, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= E or getattr(router, "num_experts", E) != E:
        _refuse(name, block, "router top_k = %r, num_experts = %r for E = %d", top_k,
                getattr(router, "num_experts", None), E)
    if (kind == "softmax_topk" and "renorm" not in _TRAITS.get(_hf_name(type(block)), {})
            and not isinstance(getattr(router, "norm_topk_prob", None), bool)):
        _refuse(name, block, "router.norm_topk_prob = %r, expected a bool",
                getattr(router, "norm_topk_prob", None))
    if "shared_expert_gate" in children:
        sg = block.shared_expert_gate
        if not (type(sg) is nn.Linear and tuple(sg.weight.shape) == (1, d) and sg.bias is None):
            _refuse(name, block, "shared_expert_gate is %s, expected nn.Linear(%d, 1, bias=False)",
                    sg, d)
    if kind in ("topk_softmax", "minimax_m2") and _router_name(children) == "gate":
        # Mixtral's, MiniMax's: the router jitter (Granite's block has none)
        if not isinstance(getattr(block, "jitter_noise", None), (int, float)):
            _refuse(name, block, "no jitter_noise attribute (an unknown Mixtral layout)")
    if kind == "deepseek_v3":
        for attr in ("num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"):
            if not hasattr(router, attr):
                _refuse(name, block, "its router has no %s (an unknown DeepSeek-V3 layout)", attr)
        try:
            check_sigmoid_options(SMOE_ROUTING_SIGMOID_TOPK, router.num_group, router.topk_group,
                                  router.routed_scaling_factor, E, top_k, "the router's ")
        except ValueError as e:
            _refuse(name, block, "%s (n_group = num_group, routed_scaling = "
                    "routed_scaling_factor)", e.message)
    for what, mod in (("router", router), ("experts", experts)):
        for p in mod.parameters():
            if p.dtype not in _SMOE_DTYPES:
                _refuse(name, block, "the %s have dtype %s; smoe takes float32, bfloat16 "
                        "(CPU and CUDA) or float64 (CPU)", what, p.dtype)
    return kind, E, n, d


# ------------------------------------------------------------ the router tap

class _RouterTap:
    """Installed as the router module's forward (an instance attribute)
    while its block runs on smoe. Called by the block with the outputs smoe
    computed, it returns them, so the router's forward hooks (transformers'
    output recorder for output_router_logits among them) see them; called
    any other way, it runs the forward the router had. A plain object, not
    a bound method, so that the model still deep-copies and pickles."""

    def __init__(self, router, previous):
        self.router = router
        self.previous = previous   # an instance-level forward the router had, or None

    def __call__(self, *args, _smoe_router_outputs=None, **kwargs):
        if _smoe_router_outputs is not None:
            return _smoe_router_outputs
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.router).forward(self.router, *args, **kwargs)


def _install_tap(router):
    if not isinstance(router.__dict__.get("forward"), _RouterTap):
        router.forward = _RouterTap(router, router.__dict__.get("forward"))


def _remove_tap(router):
    tap = router.__dict__.get("forward")
    if isinstance(tap, _RouterTap):
        if tap.previous is None:
            del router.forward
        else:
            router.forward = tap.previous


# ------------------------------------------------------------ the blocks

class _ExpertParallel:
    """An expert-parallel block's group, its share of the experts,
    [expert_start, expert_start + local_experts) of E, and the exchange's
    options (smoe.EPMoE's). A plain object, not a module: nothing of it is
    in the state dict. Called as smoe.moe is, it runs smoe.EPMoE's layer."""

    def __init__(self, group, E, max_tokens, capacity, expert_rows, overlap, comm_sms,
                 keep_x=False):
        self.group = group
        self.local_experts = E // group.size
        self.expert_start = group.rank * self.local_experts
        self.max_tokens, self.capacity, self.expert_rows = max_tokens, capacity, expert_rows
        self.overlap, self.comm_sms, self.keep_x = overlap, comm_sms, keep_x

    def __call__(self, x, router_w, w1, w2, *, top_k, routing, renormalize, expert_bias=None,
                 n_group=0, topk_group=0, routed_scaling=1.0, router_logits_dtype=None):
        return _ep_moe(self.group, x, router_w, w1, w2, top_k=top_k, routing=ROUTINGS[routing],
                       renormalize=renormalize, activation=SMOE_ACT_SWIGLU,
                       w1_layout=SMOE_W1_CONCATENATED, expert_bias=expert_bias,
                       n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling,
                       max_tokens=self.max_tokens, capacity=self.capacity,
                       expert_rows=self.expert_rows, overlap=self.overlap,
                       comm_sms=self.comm_sms, who="smoe.hf", keep_x=self.keep_x,
                       router_logits_dtype=router_logits_dtype)


class _SmoeBlock(nn.Module):
    """Adopts the HF block's children under their names (so the state dict
    is the HF block's), remembers the HF class, and taps the router. With
    `ep` (an _ExpertParallel) the experts' two parameters are replaced by
    this rank's slices of them."""

    def __init__(self, hf_block, kind, ep=None):
        super().__init__()
        for child_name, child in hf_block.named_children():
            self.add_module(child_name, child)
        for buf_name, buf in hf_block.named_buffers(recurse=False):   # MiniMax-M2's bias
            self.register_buffer(buf_name, buf,
                                 persistent=buf_name not in hf_block._non_persistent_buffers_set)
        for attr, value in vars(hf_block).items():   # config, top_k, jitter_noise...
            if not attr.startswith("_") and attr != "training":
                setattr(self, attr, value)
        self.hf_class = type(hf_block)
        self.kind = kind
        self.last_expert_counts = None
        self.ep = ep
        if ep is not None:
            lo, hi = ep.expert_start, ep.expert_start + ep.local_experts
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(self.experts, name)
                # A copy, so that the other ranks' experts are freed.
                self.experts.register_parameter(name, nn.Parameter(
                    p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
        self._router_name = _router_name(tuple(self._modules))
        traits = _TRAITS.get(_hf_name(type(hf_block)), {})
        self._logits = traits.get("logits", "x")
        self._renorm = traits.get("renorm")   # None: the kind's rule
        self._router_weight_name = traits.get("router_weight", "weight")
        _install_tap(self._gate())   # smoe's router logits reach the router's hooks

    def _gate(self):
        """The router child (`gate`, or Granite's `router`)."""
        return self._modules[self._router_name]

    def _router_weight(self):
        """The router's weight (E, d) as the HF router holds it."""
        return self._gate().get_parameter(self._router_weight_name)

    def _experts_weights(self):
        return self.experts.gate_up_proj, self.experts.down_proj

    def _moe(self, x, router_w, **routing):
        """The experts (this rank's, exchanging tokens with the group's
        other ranks, when expert-parallel): (out, expert_counts, router_logits)."""
        w1, w2 = self._experts_weights()
        if self.ep is None:
            return moe(x, router_w, w1, w2, activation="swiglu", w1_layout="concatenated",
                       **routing)
        return self.ep(x, router_w, w1, w2, **routing)

    def extra_repr(self):
        text = "hf_class=%s, routing=%s" % (self.hf_class.__name__, self.kind)
        if self.ep is not None:
            text += ", ep_rank=%d of %d, experts=[%d, %d)" % (
                self.ep.group.rank, self.ep.group.size, self.ep.expert_start,
                self.ep.expert_start + self.ep.local_experts)
        return text


class SmoeSparseMoeBlock(_SmoeBlock):
    """Qwen3-MoE, OLMoE or Mixtral's sparse MoE block on smoe.moe (the
    library's own router). forward(hidden_states (..., d)) -> (..., d), as
    the HF block. Reads gate.top_k, gate.norm_topk_prob and (Mixtral)
    jitter_noise at every call, as the HF block does."""

    def _routing(self):
        """smoe.moe's routing arguments for this block."""
        renorm = (self._renorm if self._renorm is not None else
                  True if self.kind == "topk_softmax" else bool(self._gate().norm_topk_prob))
        return dict(routing=self.kind, renormalize=renorm)

    def forward(self, hidden_states):
        x = hidden_states
        jitter = getattr(self, "jitter_noise", 0)   # (Mixtral's, MiniMax's)
        if self.training and jitter > 0:
            # the same draw as HF's (which scales its input in place; here a
            # new tensor)
            x = x * torch.empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter)
        # the HF block's router_logits are in x's dtype: have smoe return them
        # so (no float32 copy) where smoe sees that dtype too (no autocast to
        # another)
        gate, wr = self._gate(), self._router_weight()
        # the logits' dtype as the HF router returns them
        want = {"x": x.dtype, "float32": torch.float32, "router": wr.dtype}[self._logits]
        lp = {}
        if want == x.dtype and _autocast_dtype(x.device) in (None, x.dtype):
            lp = {"router_logits_dtype": x.dtype}
        out, counts, logits = self._moe(x, wr if wr.dtype == x.dtype else wr.to(x.dtype),
                                        top_k=gate.top_k, **self._routing(), **lp)
        self.last_expert_counts = counts.detach()
        x2 = x.reshape(-1, x.shape[-1])
        gate(x2, _smoe_router_outputs=(logits.reshape(x2.shape[0], -1).to(want), None, None))
        return out


class SmoeSharedExpertMoeBlock(SmoeSparseMoeBlock):
    """Qwen2-MoE's and Qwen3-Next's sparse block: SmoeSparseMoeBlock's routed
    experts on smoe plus the HF shared expert (an MLP on every token) times
    sigmoid(shared_expert_gate(x)), as the HF block adds them; HunYuan's:
    plus its shared_mlp, ungated."""

    def forward(self, hidden_states):
        out = super().forward(hidden_states)
        if "shared_mlp" in self._modules:
            return out + self.shared_mlp(hidden_states)
        x2 = hidden_states.reshape(-1, hidden_states.shape[-1])
        shared = torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return out + shared.reshape(out.shape)


class SmoeMiniMaxM2SparseMoeBlock(SmoeSparseMoeBlock):
    """MiniMax-M2's sparse block: SmoeSparseMoeBlock with routing
    'sigmoid_topk' without groups, the block's e_score_correction_bias for
    the choice, the chosen scores renormalised; Mixtral's jitter noise in
    training."""

    def _routing(self):
        bias = self.e_score_correction_bias
        return dict(routing="sigmoid_topk", renormalize=True,
                    expert_bias=bias if bias.dtype == torch.float32 else bias.float())


class SmoeDeepseekV3MoE(_SmoeBlock):
    """DeepSeek-V3's MoE block (and GLM-4.5's, GLM-4.5 Lite's, dots.llm1's,
    which are the same): the routed experts on smoe.moe with the library's
    'sigmoid_topk' router, shared_experts the HF MLP.
    forward(hidden_states (..., d)) -> (..., d), as the HF block. Reads the
    router's top_k, num_group, topk_group, norm_topk_prob,
    routed_scaling_factor and e_score_correction_bias at every call, as the
    HF router does."""

    def forward(self, hidden_states):
        x = hidden_states
        gate = self.gate
        router_w = gate.weight
        if router_w.dtype != x.dtype:
            router_w = router_w.to(x.dtype)
        bias = gate.e_score_correction_bias
        if bias.dtype != torch.float32:
            bias = bias.float()
        out, counts, logits = self._moe(x, router_w, top_k=gate.top_k, routing="sigmoid_topk",
                                        renormalize=bool(gate.norm_topk_prob), expert_bias=bias,
                                        n_group=gate.num_group, topk_group=gate.topk_group,
                                        routed_scaling=float(gate.routed_scaling_factor))
        self.last_expert_counts = counts.detach()
        x2 = x.reshape(-1, x.shape[-1])
        gate(x2, _smoe_router_outputs=(logits.reshape(x2.shape[0], -1), None, None))
        return out + self.shared_experts(hidden_states)


_CLASSES = {"softmax_topk": SmoeSparseMoeBlock, "topk_softmax": SmoeSparseMoeBlock,
            "deepseek_v3": SmoeDeepseekV3MoE, "minimax_m2": SmoeMiniMaxM2SparseMoeBlock}


def _smoe_class(block, kind):
    """The smoe block for a checked HF block of routing `kind`."""
    children = _BLOCKS[_hf_name(type(block))][3]
    if "shared_expert_gate" in children or "shared_mlp" in children:
        return SmoeSharedExpertMoeBlock
    return _CLASSES[kind]


# ------------------------------------------------------------ replace / restore

def _set_child(model, name, module):
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def replace_moe_blocks(model, ep_group=None, *, max_tokens=None, capacity=0, expert_rows=0,
                       overlap=0, comm_sms=0, keep_x=False):
    """Replaces, in place, every MoE block of `model` (an nn.Module holding
    transformers MoE blocks, e.g. a Qwen3MoeForCausalLM) that smoe.hf
    supports by its smoe-backed counterpart, which adopts the block's
    children (same modules, parameters and names: the state dict is
    unchanged). Everything is checked first: a gpt-oss block, or a block of
    a supported class with a structure other than the tested transformers
    version's, raises ValueError before anything is replaced. Blocks already
    replaced are left as they are. Raises ValueError if the model has no MoE
    block smoe.hf knows.

    Expert parallelism: with ep_group (a smoe.EPGroup, or a
    torch.distributed group: smoe.EPGroup.of's; every rank calls this
    together, on its copy of the model) each block runs smoe.EPMoE's layer
    over the group and keeps only this rank's experts: experts.gate_up_proj
    and experts.down_proj become new Parameters holding their slices
    [r E/P, (r+1) E/P) (rank r of P; E must divide; the rest is freed), so
    build the optimizer after the swap; the state dict keeps its keys, with
    E/P experts in those two (this rank's shard). The router, the shared
    experts and everything else stay replicated (their gradients are each
    rank's share: sum or average them over the group, as DDP does).
    max_tokens (required: the most tokens, batch x sequence, any rank's
    block will see), capacity, expert_rows, overlap, comm_sms and keep_x
    are smoe.EPMoE's. The models' load-balancing loss is then each rank's
    tokens' (transformers computes it from the router logits). Such a block
    cannot be restored (its other experts are gone): reload the model.

    Returns {qualified name: the original HF block}, for
    restore_moe_blocks() (with ep_group: for reference only, its experts
    are the sliced ones)."""
    who = "smoe.hf.replace_moe_blocks"
    if isinstance(model, _SmoeBlock) or _hf_name(type(model)) in _BLOCKS:
        raise ValueError("smoe.hf.replace_moe_blocks: pass the model (or a module holding the "
                         "blocks), not a block: a block cannot replace itself in place")
    if ep_group is not None:
        check_ep_options(max_tokens, capacity, expert_rows, overlap, comm_sms, who, keep_x)
    elif max_tokens is not None or (capacity, expert_rows, overlap, comm_sms, keep_x) != (
            0, 0, 0, 0, False):
        raise ValueError("%s: max_tokens, capacity, expert_rows, overlap, comm_sms and keep_x "
                         "are expert parallelism's: pass ep_group too" % who)
    found, done = [], 0
    for name, module in model.named_modules():
        cls = _hf_name(type(module))
        if isinstance(module, _SmoeBlock):
            done += 1
        elif cls in _REFUSED:
            raise ValueError("smoe.hf: cannot replace %s (%s): %s" % (name, cls, _REFUSED[cls]))
        elif cls in _BLOCKS:
            found.append((name, module, _check_block(name, module)))
    if not found and not done:
        raise ValueError("smoe.hf.replace_moe_blocks: %s has no MoE block smoe.hf knows "
                         "(supported: %s)" % (type(model).__name__, ", ".join(
                             sorted(c.rsplit(".", 1)[1] for c in _BLOCKS))))
    group = None
    if ep_group is not None and found:
        group = _as_group(ep_group, "smoe.hf.replace_moe_blocks")
        for name, block, (_, E, _, _) in found:
            if E % group.size:
                raise SmoeError(SMOE_ERROR_INVALID_SIZE, "smoe.hf: cannot replace %s (%s): its "
                                "E = %d experts cannot be split evenly over %d ranks"
                                % (name, _hf_name(type(block)), E, group.size))
    replaced, made = {}, {}
    for name, block, (kind, E, _, _) in found:
        new = made.get(id(block))
        if new is None:
            ep = None if group is None else _ExpertParallel(group, E, int(max_tokens),
                                                            int(capacity), int(expert_rows),
                                                            int(overlap), int(comm_sms),
                                                            bool(keep_x))
            new = made[id(block)] = _smoe_class(block, kind)(block, kind, ep)
            new.train(block.training)
        _set_child(model, name, new)
        replaced[name] = block
    return replaced


def restore_moe_blocks(model, replaced):
    """Puts back the HF blocks replace_moe_blocks() returned (their
    parameters are the ones the smoe blocks trained: they were shared).
    Everything is checked first: nothing is restored if a block cannot be
    (an expert-parallel one)."""
    for name in replaced:
        current = model.get_submodule(name)
        if not isinstance(current, _SmoeBlock):
            raise ValueError("smoe.hf.restore_moe_blocks: %s is a %s, not a smoe.hf block"
                             % (name, type(current).__name__))
        if current.ep is not None:
            raise ValueError("smoe.hf.restore_moe_blocks: %s is expert-parallel: it kept only "
                             "this rank's experts, the HF block cannot be restored (reload the "
                             "model)" % name)
    for name, block in replaced.items():
        current = model.get_submodule(name)
        router = block._modules.get(_router_name(tuple(block._modules)))
        if router is not None:
            _remove_tap(router)
        block.train(current.training)
        _set_child(model, name, block)
