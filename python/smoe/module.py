"""smoe.MoE: the MoE feed-forward layer as an nn.Module, with SonicMoE's
constructor, and a loader for Hugging Face MoE checkpoints."""
import numbers
import re

import torch
import torch.nn as nn

from . import _lib as L
from ._lib import SmoeError
from .functional import (ACTIVATIONS, GATED, ROUNDINGS, ROUTINGS, W1_LAYOUTS, SmoeValueError,
                         _autocast_dtype, _enum, check_sigmoid_options, moe)

__all__ = ["Experts", "MoE", "switch_load_balancing_loss", "router_z_loss",
           "load_hf_moe_weights"]

# Each activation code's first name in ACTIVATIONS ('relu2' for RELU2).
_ACT_NAMES = {}
for _name, _code in ACTIVATIONS.items():
    _ACT_NAMES.setdefault(_code, _name)
del _name, _code


class Experts(nn.Module):
    """E linear maps stacked: weight (E, out_features, in_features), bias
    (E, out_features) or None. Initialised N(0, std), biases zero."""

    def __init__(self, num_experts, in_features, out_features, add_bias=False, std=None):
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.std = std
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if add_bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        std = self.std if self.std is not None else self.in_features ** -0.5
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self):
        return "num_experts=%d, in_features=%d, out_features=%d, bias=%s" % (
            self.num_experts, self.in_features, self.out_features, self.bias is not None)


def switch_load_balancing_loss(router_logits, expert_counts):
    """Switch Transformer load-balancing loss, E * sum_e f_e * P_e, with f_e
    the fraction of routed rows that went to expert e (from expert_counts)
    and P_e the mean router probability softmax(router_logits)[:, e]. It is 1
    for perfectly balanced routing. Its gradient reaches the router through
    router_logits (smoe passes it to the library as dlogits_extra)."""
    return _switch_loss(router_logits, expert_counts)


def _switch_loss(router_logits, expert_counts, group_sums=None):
    """switch_load_balancing_loss; with group_sums(prob_sums (E,) float32,
    expert_counts (E,)) -> the same two summed over a group of ranks
    (smoe.EPMoE's loss over the group), P_e and f_e of the group's tokens."""
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    E = logits.shape[1]
    # F.softmax(logits, -1, dtype=float32) and F.normalize(., p=1, dim=0),
    # spelled as the tensor operations those run (the same kernels and
    # autograd graph, so the same bits) without their Python wrappers.
    probs = logits.softmax(-1, dtype=torch.float32)
    sums = probs.sum(0)
    if group_sums is not None:
        sums, expert_counts = group_sums(sums, expert_counts)
    p = _l1_normalize(sums)
    f = _l1_normalize(expert_counts.to(torch.float32))
    return E * (p * f).sum()


def _l1_normalize(v):
    """F.normalize(v, p=1, dim=0, eps=1e-12)."""
    return v / torch.linalg.vector_norm(v, 1, 0, keepdim=True).clamp_min(1e-12).expand_as(v)


def router_z_loss(router_logits):
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens
    of logsumexp(router_logits)^2, which keeps the router's logits small.
    router_logits (..., E), e.g. what smoe.moe() or smoe.MoE(...,
    output_router_logits=True) returns; computed in float32 (float64 stays
    float64). Differentiable: its gradient reaches the router weight and x
    through the layer (smoe passes it to the library as dlogits_extra)."""
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    if logits.dtype != torch.float64:
        logits = logits.to(torch.float32)
    return torch.logsumexp(logits, -1).square().mean()


# SonicMoE's KernelBackendMoE values: which of its implementations to run.
# They compute the same layer; smoe runs its own kernels for each.
KERNEL_BACKENDS = ("sonicmoe", "torch", "scattermoe")


def _check_kernel_backend(value):
    """forward's kernel_backend_moe: None, or a KernelBackendMoE member (or
    its name or value as a string)."""
    if value is None:
        return
    if isinstance(value, bool):
        raise TypeError("smoe.MoE.forward: the second positional argument is kernel_backend_moe "
                        "(SonicMoE's order: forward(hidden_states, kernel_backend_moe, "
                        "is_inference_mode)), got %r; pass is_inference_mode=%r by keyword"
                        % (value, value))
    key = value
    if not isinstance(key, str):
        key = getattr(value, "value", None)
        if not isinstance(key, str):
            key = getattr(value, "name", None)
    if not isinstance(key, str) or key.lower() not in KERNEL_BACKENDS:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "smoe.MoE.forward: kernel_backend_moe = %r, must be None or one of "
                             "SonicMoE's KernelBackendMoE (%s; smoe runs its own kernels for "
                             "each)" % (value, ", ".join(repr(k) for k in KERNEL_BACKENDS)))


def _check_int(value, name, low=1, high=None, high_name=None):
    """value an int (not a bool) in [low, high]; a ValueError naming it if not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "%s = %r, must be an int"
                             % (name, value))
    if value < low or (high is not None and value > high):
        want = ">= %d" % low if high is None else "in [%d, %s = %d]" % (low, high_name, high)
        raise SmoeValueError(L.SMOE_ERROR_INVALID_SIZE, "%s = %d, must be %s"
                             % (name, value, want))
    return int(value)


def check_layer_sizes(num_experts, num_experts_per_tok, hidden_size, intermediate_size, who):
    """E, K, d, n as the constructors take them: positive ints, K <= E."""
    E = _check_int(num_experts, who + ": num_experts")
    K = _check_int(num_experts_per_tok, who + ": num_experts_per_tok", 1, E, "num_experts")
    d = _check_int(hidden_size, who + ": hidden_size")
    n = _check_int(intermediate_size, who + ": intermediate_size")
    return E, K, d, n


def check_routing(routing, n_group, topk_group, routed_scaling, E, K, who, general):
    """routing (a name or an enum) and routing 'sigmoid_topk''s options as
    the layer constructors take them (check_sigmoid_options' rules, the
    messages prefixed with `who`); 'general' is refused, `general` saying
    what takes the caller's triples instead. Returns (the smoe_routing code,
    n_group, topk_group, routed_scaling)."""
    code = _enum(ROUTINGS, routing, who + ": routing")
    if code == L.SMOE_ROUTING_GENERAL:
        raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                             "%s: routing = 'general' takes the caller's (token, expert, score) "
                             "triples: %s" % (who, general))
    n_group, topk_group, routed_scaling = check_sigmoid_options(
        code, n_group, topk_group, routed_scaling, E, K, who + ": ", routing)
    return code, n_group, topk_group, routed_scaling


def keep_expert_bias_float32(module):
    """After nn.Module._apply (.to(), .cuda(), .bfloat16()...): the module's
    expert_bias buffer, if it has one, back to float32. The library reads
    it as such, and small updates would vanish in a bfloat16 bias."""
    bias = module._buffers.get("expert_bias")
    if bias is not None and bias.dtype != torch.float32 and bias.is_floating_point():
        module._buffers["expert_bias"] = bias.float()


def check_logits_dtype(value, who):
    """A layer's router_logits_dtype: None or torch.float32 (float32 logits),
    or 'input' (the dtype of the layer's input x, after autocast, as
    Hugging Face's MoE blocks return them); SmoeValueError otherwise."""
    if value is None or value == "input" or value is torch.float32:
        return value
    raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                         "%s: router_logits_dtype = %r, must be None or torch.float32 "
                         "(float32 logits) or 'input' (x's dtype)" % (who, value))


def logits_dtype_of(value, x):
    """smoe.moe's router_logits_dtype for a layer's option `value`: with
    'input', x's dtype after autocast (the one smoe.moe computes in)."""
    if value != "input":
        return None
    ac = _autocast_dtype(x.device)
    return ac if ac is not None else x.dtype


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer on smoe, with the parameters
    and constructor of SonicMoE's MoE:

        router   nn.Linear(hidden_size, num_experts, bias=False)   (E, d)
        c_fc     Experts: weight (E, 2n, d) gated (W1 in `w1_layout`,
                 interleaved by default: row 2j gate j, row 2j+1 up j) or
                 (E, n, d); bias (E, 2n|n) if add_bias
        c_proj   Experts: weight (E, d, n); bias (E, d) if add_bias

    forward(hidden_states (..., d), kernel_backend_moe=None,
    is_inference_mode=False, *, output_router_logits=None) returns (output
    (..., d), aux_loss): aux_loss is the Switch load-balancing loss (a
    scalar tensor; None when is_inference_mode). Scale it and add it to the
    training loss yourself. kernel_backend_moe is SonicMoE's argument (its
    KernelBackendMoE, or the name): accepted for SonicMoE's call style
    `layer(x, KernelBackendMoE.sonicmoe)` and ignored, as smoe runs its own
    kernels; a bool there raises TypeError (is_inference_mode is the third
    argument). With output_router_logits (the constructor's, or forward's
    when not None) it returns (output, aux_loss, router_logits (T, E)
    float32, T the tokens of all leading dimensions): differentiable, for
    smoe.router_z_loss or Hugging Face's load-balancing loss, at no extra
    cost (the layer computes them anyway). router_logits_dtype='input'
    makes them x's dtype (after autocast), as Hugging Face's MoE blocks
    return them: the float32 logits rounded, half the bytes; the routing
    reads the float32 ones either way, aux_loss is then computed from the
    rounded ones.

    Keyword-only extras: routing ('topk_softmax', SonicMoE's; 'softmax_topk'
    with `renormalize`; or 'sigmoid_topk', below), token_rounding (None,
    'up', 'down', 'nearest'; applied in training mode only; not with
    'sigmoid_topk') with round_tile, w1_layout, consume_saved (smoe.moe's:
    the backward writes over what the forward saved, so each forward can be
    differentiated once).

    routing='sigmoid_topk' is DeepSeek-V3's router (smoe.moe's
    'sigmoid_topk'): sigmoid scores, the choice among the topk_group best of
    n_group expert groups (0, 0: no groups; n_group divides num_experts into
    groups of >= 2, topk_group in [1, n_group] holding >= num_experts_per_tok
    experts), the chosen scores renormalised if `renormalize` and multiplied
    by routed_scaling (finite, > 0). The layer then has a persistent float32
    buffer expert_bias (num_experts,), zeros at first, added to the scores
    for the choice only: it gets no gradient, you update it, as DeepSeek-V3's
    auxiliary-loss-free balancing does after each step, e.g. with u = 1e-3:

        load = layer.last_expert_counts.float()
        layer.expert_bias += u * torch.sign(load.mean() - load)

    It stays float32 when the layer moves to another dtype (.bfloat16()).
    The aux_loss returned is still the Switch loss of the softmax of the
    logits, which such a model leaves out of its training loss.
    activation_function takes a name ('swiglu', 'geglu', 'reglu', 'relu2'
    or 'relu_sq', 'relu', 'silu', 'gelu') or an enum whose value or name is
    one ('activation' is accepted as the keyword too).

    ep_group (an smoe.EPGroup or a torch.distributed group) makes the layer
    expert-parallel: smoe.MoE(..., ep_group=g, max_tokens=T) returns an
    smoe.EPMoE (its docstring: this rank's experts, max_tokens required,
    its options capacity, expert_rows, overlap, comm_sms, aux_loss_scope,
    keep_x, copy_engines); token_rounding and consume_saved are refused
    under it.

    The constructor checks every argument (sizes positive, num_experts_per_tok
    <= num_experts, names known) and forward checks x against the layer
    (hidden size, device, dtype outside autocast), raising ValueError (also a
    smoe.SmoeError) with a message naming the argument or tensor.
    """

    def __new__(cls, *args, ep_group=None, **kwargs):
        if ep_group is not None and cls is MoE:
            from .ep import _epmoe_from_moe  # (smoe.ep imports this module)
            return _epmoe_from_moe(args, ep_group, kwargs)
        from .ep import EP_ONLY
        given = sorted(k for k in kwargs if k in EP_ONLY)
        if given:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.MoE: %s: options of expert parallelism, which ep_group "
                                 "turns on (ep_group is None)" % ", ".join(given))
        return super().__new__(cls)

    def __init__(self, num_experts, num_experts_per_tok, hidden_size, intermediate_size,
                 activation_function="swiglu", add_bias=False, std=0.02, *,
                 routing="topk_softmax", renormalize=True, token_rounding=None, round_tile=128,
                 w1_layout="interleaved", activation=None, output_router_logits=False,
                 n_group=0, topk_group=0, routed_scaling=1.0, consume_saved=False,
                 router_logits_dtype=None, ep_group=None):
        super().__init__()
        if activation is not None:
            activation_function = activation
        E, K, d, n = check_layer_sizes(num_experts, num_experts_per_tok, hidden_size,
                                       intermediate_size, "smoe.MoE")
        self._act = _enum(ACTIVATIONS, activation_function, "smoe.MoE: activation_function")
        routing_c, n_group, topk_group, routed_scaling = check_routing(
            routing, n_group, topk_group, routed_scaling, E, K, "smoe.MoE",
            "use smoe.moe_general()")
        sigmoid = routing_c == L.SMOE_ROUTING_SIGMOID_TOPK
        if sigmoid and _enum(ROUNDINGS, token_rounding, "smoe.MoE: token_rounding") != \
                L.SMOE_ROUND_OFF:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.MoE: token_rounding = %r with routing = 'sigmoid_topk': "
                                 "token rounding ranks tokens by softmax probabilities, which "
                                 "sigmoid routing has none of" % (token_rounding,))
        _enum(ROUNDINGS, token_rounding, "smoe.MoE: token_rounding")
        _enum(W1_LAYOUTS, w1_layout, "smoe.MoE: w1_layout")
        round_tile = _check_int(round_tile, "smoe.MoE: round_tile")
        if not isinstance(consume_saved, bool):
            raise TypeError("smoe.MoE: consume_saved = %r, must be a bool" % (consume_saved,))
        self.router_logits_dtype = check_logits_dtype(router_logits_dtype, "smoe.MoE")
        if std is not None and (isinstance(std, bool) or not isinstance(std, numbers.Real)
                                or not 0 <= std < float("inf")):
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.MoE: std = %r, must be a "
                                 "finite number >= 0 (or None: 1/sqrt(fan-in))" % (std,))
        self.num_experts = E
        self.top_k = K
        self.hidden_size = d
        self.intermediate_size = n
        self.activation_function = activation_function
        self.routing = routing
        self.renormalize = renormalize
        self.token_rounding = token_rounding
        self.round_tile = round_tile
        self.w1_layout = w1_layout
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling = routed_scaling
        self.consume_saved = consume_saved
        self.output_router_logits = bool(output_router_logits)
        gated = self._act in GATED
        self.router = nn.Linear(d, E, bias=False)
        self.c_fc = Experts(E, d, 2 * n if gated else n, add_bias, std)
        self.c_proj = Experts(E, n, d, add_bias, std)
        # (None, for the other routings, is no buffer: not in the state dict.)
        self.register_buffer("expert_bias",
                             torch.zeros(E, dtype=torch.float32) if sigmoid else None)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .bfloat16()... move expert_bias with the layer but
        # keep it float32.
        out = super()._apply(fn, *args, **kwargs)
        keep_expert_bias_float32(self)
        return out

    def forward(self, hidden_states, kernel_backend_moe=None, is_inference_mode=False, *,
                output_router_logits=None):
        _check_kernel_backend(kernel_backend_moe)
        w1 = self.c_fc.weight
        self._check_input(hidden_states, w1)
        try:
            out, counts, logits = moe(
                hidden_states, self.router.weight, w1, self.c_proj.weight, self.c_fc.bias,
                self.c_proj.bias, top_k=self.top_k, routing=self.routing,
                renormalize=self.renormalize, activation=self._act_name(),
                w1_layout=self.w1_layout,
                token_rounding=self.token_rounding if self.training else None,
                round_tile=self.round_tile, inference=bool(is_inference_mode),
                expert_bias=self.expert_bias, n_group=self.n_group, topk_group=self.topk_group,
                routed_scaling=self.routed_scaling, consume_saved=self.consume_saved,
                router_logits_dtype=logits_dtype_of(self.router_logits_dtype, hidden_states))
        except SmoeError:
            self._check_parameters()   # a better message if they disagree with each other
            raise
        self.last_expert_counts = counts.detach()
        aux = None if is_inference_mode else switch_load_balancing_loss(logits, counts)
        if output_router_logits is None:
            output_router_logits = self.output_router_logits
        if output_router_logits:
            return out, aux, logits.reshape(-1, self.num_experts)
        return out, aux

    def _check_input(self, x, w):
        """x against the layer (w: c_fc.weight), named as the caller knows it:
        hidden size, device, dtype (outside autocast, which casts
        everything). A few comparisons: this runs on every call."""
        if not isinstance(x, torch.Tensor):
            raise TypeError("smoe.MoE.forward: hidden_states (x) must be a torch.Tensor, got %s"
                            % type(x).__name__)
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_SIZE,
                                 "smoe.MoE: x (hidden_states) has shape %s, its last dimension "
                                 "must be hidden_size = %d" % (tuple(x.shape), self.hidden_size))
        if x.device != w.device:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.MoE: x (hidden_states) is on %s but the layer's parameters "
                                 "are on %s (move the layer with .to(x.device), or x)"
                                 % (x.device, w.device))
        if x.dtype != w.dtype and _autocast_dtype(x.device) is None:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                 "smoe.MoE: x (hidden_states) has dtype %s but the layer's "
                                 "parameters have %s (convert x, or the layer with .to(dtype), "
                                 "or run under torch.autocast)" % (x.dtype, w.dtype))

    def _check_parameters(self):
        """Raises SmoeValueError naming a parameter whose device (or dtype,
        outside autocast) differs from c_fc.weight's; after a failed call
        only, to name the parameter rather than the functional's argument."""
        w = self.c_fc.weight
        params = (("router.weight", self.router.weight), ("c_proj.weight", self.c_proj.weight),
                  ("c_fc.bias", self.c_fc.bias), ("c_proj.bias", self.c_proj.bias))
        autocast = _autocast_dtype(w.device) is not None
        bias = self.expert_bias
        if bias is not None and bias.device != w.device:
            raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.MoE: expert_bias is on %s but "
                                 "c_fc.weight is on %s" % (bias.device, w.device))
        for name, p in params:
            if p is None:
                continue
            if p.device != w.device:
                raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE, "smoe.MoE: %s is on %s but "
                                     "c_fc.weight is on %s" % (name, p.device, w.device))
            if p.dtype != w.dtype and not autocast:
                raise SmoeValueError(L.SMOE_ERROR_INVALID_VALUE,
                                     "smoe.MoE: %s has dtype %s but c_fc.weight has %s: smoe "
                                     "takes one dtype for x and every parameter (or run under "
                                     "torch.autocast)" % (name, p.dtype, w.dtype))

    def _act_name(self):
        return _ACT_NAMES[self._act]

    def extra_repr(self):
        text = ("num_experts=%d, top_k=%d, hidden_size=%d, intermediate_size=%d, "
                "activation=%s, routing=%s, token_rounding=%s"
                % (self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
                   self._act_name(), self.routing, self.token_rounding))
        if self.expert_bias is not None:
            text += ", n_group=%d, topk_group=%d, routed_scaling=%g" % (
                self.n_group, self.topk_group, self.routed_scaling)
        if self.consume_saved:
            text += ", consume_saved=True"
        if self.router_logits_dtype is not None:
            text += ", router_logits_dtype=%r" % (self.router_logits_dtype,)
        return text


# ------------------------------------------------------------ Hugging Face weights

# Keys of Hugging Face blocks this loader would load wrong, and why.
_HF_REFUSED = (
    ("router.bias", "a gpt-oss block (router bias, interleaved gate/up, clamped SwiGLU with "
                    "alpha and limit), which smoe.MoE cannot compute; refused rather than loaded "
                    "wrong"),
    ("gate.e_score_correction_bias", "a DeepSeek-V3-style block (DeepSeek-V3, GLM-4.5, "
                                     "dots.llm1), whose shared experts smoe.MoE does "
                                     "not have (its routing is smoe.MoE's 'sigmoid_topk'); "
                                     "smoe.hf.replace_moe_blocks runs it"),
    ("shared_expert_gate.weight", "a Qwen2-MoE or Qwen3-Next block, whose gated shared expert "
                                  "smoe.MoE does not have; smoe.hf.replace_moe_blocks runs it"),
    ("gate.bias", "a router bias, which smoe.MoE's router does not have"),
)


def _take(state_dict, key, used):
    used.append(key)
    return state_dict[key]


def load_hf_moe_weights(module, state_dict, prefix="", *, transposed=None):
    """Copies one Hugging Face MoE block's weights into a smoe.MoE, or into
    a smoe.EPMoE: then the router (replicated) and only this rank's experts,
    [module.expert_start, module.expert_start + module.local_experts) of
    the checkpoint's E (rank r of P: [r E/P, (r+1) E/P)); the other ranks'
    expert tensors are neither read nor copied.

    `state_dict` is the model's state dict (or any mapping of name ->
    tensor); `prefix` names the MoE block in it, e.g.
    "model.layers.3.mlp." (Qwen3-MoE, OLMoE) or
    "model.layers.3.block_sparse_moe." (Mixtral). Recognised names under
    the prefix:

      router   gate.weight (E, d)              (Mixtral, Qwen3-MoE, OLMoE)
               or router.weight
      experts, one tensor per expert e:
               experts.{e}.gate_proj.weight (n, d), experts.{e}.up_proj.weight
               (n, d), experts.{e}.down_proj.weight (d, n)  (Qwen3-MoE, OLMoE)
               experts.{e}.w1.weight (gate), experts.{e}.w3.weight (up),
               experts.{e}.w2.weight (down)                   (Mixtral)
               (with .bias next to each weight when the module has biases)
      experts, fused (newer transformers):
               experts.gate_up_proj (E, 2n, d), gate rows then up rows, and
               experts.down_proj (E, d, n); layouts stored transposed,
               (E, d, 2n) and (E, n, d), are recognised by shape, or forced
               with transposed=True/False when the shapes cannot tell;
               experts.gate_up_proj_bias (E, 2n), experts.down_proj_bias (E, d).

    The gate and up halves are written into module.c_fc.weight in the
    module's w1_layout (interleaved: row 2j gate j, row 2j+1 up j;
    concatenated: as Hugging Face has them). The module must be built with
    the checkpoint's sizes and a gated activation ('swiglu' for these
    models), and with the model's routing:
      Mixtral     routing='topk_softmax'
      Qwen3-MoE   routing='softmax_topk', renormalize=config.norm_topk_prob
      OLMoE       routing='softmax_topk', renormalize=False (norm_topk_prob)
    Blocks smoe.MoE cannot compute are refused (ValueError): gpt-oss, DeepSeek-V3
    (and GLM-4.5's, dots.llm1's), Qwen2-MoE / Qwen3-Next (a gated shared
    expert) and any router with a bias (see _HF_REFUSED; smoe.hf runs all of
    them but gpt-oss).
    Returns the list of state-dict keys it used (a smoe.EPMoE: the router's
    and this rank's experts').
    """
    for name, why in _HF_REFUSED:
        if prefix + name in state_dict:
            raise ValueError("load_hf_moe_weights: the state dict has %s%s: %s"
                             % (prefix, name, why))
    # smoe.MoE keeps its activation code in _act, smoe.EPMoE in activation.
    act = module._act if isinstance(module, MoE) else module.activation
    if act not in GATED:
        raise ValueError("load_hf_moe_weights: the module's activation %r is not gated; "
                         "Hugging Face MoE experts are SwiGLU" % (_ACT_NAMES[act],))
    E, n, d = module.num_experts, module.intermediate_size, module.hidden_size
    # This rank's experts [lo, hi) of the checkpoint's E (all of them for smoe.MoE).
    lo = getattr(module, "expert_start", 0)
    hi = lo + getattr(module, "local_experts", E)
    has_bias = module.c_fc.bias is not None
    used = []

    def get(name):
        key = prefix + name
        if key not in state_dict:
            return None
        return _take(state_dict, key, used)

    router = get("gate.weight")
    if router is None:
        router = get("router.weight")
    if router is None:
        raise KeyError("load_hf_moe_weights: no %sgate.weight or %srouter.weight in the state "
                       "dict" % (prefix, prefix))
    if tuple(router.shape) != (E, d):
        raise ValueError("router weight has shape %s, the module wants (%d, %d)"
                         % (tuple(router.shape), E, d))

    gate_bias = up_bias = down_bias = None
    gate_up = get("experts.gate_up_proj")
    if gate_up is not None:
        down = get("experts.down_proj")
        if down is None:
            raise KeyError("load_hf_moe_weights: %sexperts.gate_up_proj without "
                           "%sexperts.down_proj" % (prefix, prefix))
        t = transposed
        if t is None:
            t = tuple(gate_up.shape) == (E, d, 2 * n) and (E, d, 2 * n) != (E, 2 * n, d)
        if t:
            gate_up = gate_up.transpose(1, 2)
            down = down.transpose(1, 2)
        if tuple(gate_up.shape) != (E, 2 * n, d) or tuple(down.shape) != (E, d, n):
            raise ValueError("fused experts have shapes %s and %s, the module wants (%d, %d, %d) "
                             "and (%d, %d, %d)" % (tuple(gate_up.shape), tuple(down.shape),
                                                   E, 2 * n, d, E, d, n))
        gate_up, down = gate_up[lo:hi], down[lo:hi]
        gate, up = gate_up[:, :n], gate_up[:, n:]
        if has_bias:
            gub = get("experts.gate_up_proj_bias")
            down_bias = get("experts.down_proj_bias")
            if gub is None or down_bias is None:
                raise KeyError("load_hf_moe_weights: the module has biases but the state dict "
                               "has no %sexperts.gate_up_proj_bias/down_proj_bias" % prefix)
            gub, down_bias = gub[lo:hi], down_bias[lo:hi]
            gate_bias, up_bias = gub[:, :n], gub[:, n:]
    else:
        pattern = re.compile(re.escape(prefix) + r"experts\.(\d+)\.(\w+)\.weight$")
        names = {m.group(2) for k in state_dict for m in [pattern.match(k)] if m}
        if {"gate_proj", "up_proj", "down_proj"} <= names:
            g_name, u_name, d_name = "gate_proj", "up_proj", "down_proj"
        elif {"w1", "w2", "w3"} <= names:
            g_name, u_name, d_name = "w1", "w3", "w2"
        else:
            raise KeyError("load_hf_moe_weights: found no experts under %r (looked for "
                           "experts.gate_up_proj, experts.{e}.gate_proj/up_proj/down_proj and "
                           "experts.{e}.w1/w2/w3)" % prefix)

        def stack(name, kind, shape):
            out = []
            for e in range(lo, hi):
                t = get("experts.%d.%s.%s" % (e, name, kind))
                if t is None:
                    raise KeyError("load_hf_moe_weights: missing %sexperts.%d.%s.%s"
                                   % (prefix, e, name, kind))
                if tuple(t.shape) != shape:
                    raise ValueError("experts.%d.%s.%s has shape %s, the module wants %s"
                                     % (e, name, kind, tuple(t.shape), shape))
                out.append(t)
            return torch.stack(out)

        gate = stack(g_name, "weight", (n, d))
        up = stack(u_name, "weight", (n, d))
        down = stack(d_name, "weight", (d, n))
        if has_bias:
            gate_bias = stack(g_name, "bias", (n,))
            up_bias = stack(u_name, "bias", (n,))
            down_bias = stack(d_name, "bias", (d,))

    layout = module.w1_layout
    with torch.no_grad():
        w1 = module.c_fc.weight
        module.router.weight.copy_(router)
        if _enum_layout(layout) == L.SMOE_W1_INTERLEAVED:
            w1[:, 0::2].copy_(gate)
            w1[:, 1::2].copy_(up)
        else:
            w1[:, :n].copy_(gate)
            w1[:, n:].copy_(up)
        module.c_proj.weight.copy_(down)
        if has_bias:
            b1 = module.c_fc.bias
            if _enum_layout(layout) == L.SMOE_W1_INTERLEAVED:
                b1[:, 0::2].copy_(gate_bias)
                b1[:, 1::2].copy_(up_bias)
            else:
                b1[:, :n].copy_(gate_bias)
                b1[:, n:].copy_(up_bias)
            module.c_proj.bias.copy_(down_bias)
    return used


def _enum_layout(layout):
    """A w1_layout name (smoe.MoE keeps the name) or code (smoe.EPMoE) as its code."""
    if layout in W1_LAYOUTS.values() and not isinstance(layout, (bool, str)):
        return layout
    return _enum(W1_LAYOUTS, layout, "w1_layout")
