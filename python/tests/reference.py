"""A plain PyTorch MoE layer, written from the math in include/smoe.h and
DESIGN.md with a loop over experts: the independent reference of the tests.
Every routing decision and score is a differentiable torch expression, so
autograd gives the reference gradients."""
import math

import torch
import torch.nn.functional as F

GATED = ("swiglu", "geglu", "reglu")


def activation(h, name, layout, n):
    if name in GATED:
        if layout == "interleaved":
            g, u = h[:, 0::2], h[:, 1::2]
        else:
            g, u = h[:, :n], h[:, n:]
        if name == "swiglu":
            return F.silu(g) * u
        if name == "geglu":
            return F.gelu(g, approximate="tanh") * u
        return F.relu(g) * u
    if name == "relu2":
        return F.relu(h) ** 2
    if name == "relu":
        return F.relu(h)
    if name == "silu":
        return F.silu(h)
    if name == "gelu":
        return F.gelu(h, approximate="tanh")
    raise ValueError(name)


def topk(v, K):
    """torch.topk along the last dimension, with smoe.h's order of equal keys
    (the lower expert first; NaN above every number, NaNs equal), which
    torch.topk leaves open: a stable descending sort."""
    idx = torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :K]
    return v.gather(-1, idx), idx


def route(logits, K, routing, renormalize=True, rounding=None, M=128):
    """Dense (T, E) scores (zero where not routed) and the routed mask."""
    T, E = logits.shape
    if rounding is None:
        if routing == "topk_softmax":
            vals, idx = topk(logits, K)
            s = torch.softmax(vals, dim=-1)
        elif routing == "softmax_topk":
            p = torch.softmax(logits, dim=-1)
            s, idx = topk(p, K)
            if renormalize:
                s = s / s.sum(-1, keepdim=True)
        else:
            raise ValueError(routing)
        S = torch.zeros_like(logits).scatter(1, idx, s)
        mask = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
        return S, mask
    # Token rounding (DESIGN.md section 2).
    p = torch.softmax(logits, dim=-1)
    _, idx = topk(p, K)
    tc = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    renorm = p / (p * tc).sum(-1, keepdim=True)
    key = torch.where(tc, renorm, p - 1).detach()
    f = tc.sum(0)
    mask = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        c = int(f[e])
        if rounding == "up":
            target = math.ceil(c / M) * M
        elif rounding == "down":
            target = (c // M) * M
        elif rounding == "nearest":
            target = math.floor(c / M + 0.5) * M
        else:
            raise ValueError(rounding)
        target = min(target, T)
        # Descending key, ties to the lower token, NaN (a token with a NaN
        # logit) first: a stable descending sort.
        order = torch.sort(key[:, e], descending=True, stable=True).indices
        mask[order[:target], e] = True
    S = torch.where(mask, torch.where(tc, renorm, p), torch.zeros_like(p))
    return S, mask


def experts(x, S, mask, w1, w2, b1, b2, act, layout):
    T, d = x.shape
    n = w2.shape[2]
    out = torch.zeros(T, d, dtype=x.dtype)
    for e in range(w1.shape[0]):
        tok = mask[:, e].nonzero().flatten()
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].T
        if b1 is not None:
            h = h + b1[e]
        a = activation(h, act, layout, n)
        y = a @ w2[e].T
        if b2 is not None:
            y = y + b2[e]
        out = out.index_add(0, tok, S[tok, e, None] * y)
    return out


def moe_ref(x, router_w, w1, w2, b1=None, b2=None, *, top_k, routing="topk_softmax",
            renormalize=True, activation="swiglu", w1_layout="interleaved", token_rounding=None,
            round_tile=128):
    """(out, expert_counts, router_logits), as smoe.moe."""
    logits = x @ router_w.T
    S, mask = route(logits, top_k, routing, renormalize, token_rounding, round_tile)
    out = experts(x, S.to(x.dtype), mask, w1, w2, b1, b2, activation, w1_layout)
    return out, mask.sum(0).to(torch.int32), logits


def sigmoid_route(logits, K, bias=None, n_group=0, topk_group=0, renormalize=True, scaling=1.0):
    """Dense (T, E) scores (zero where not routed) and the routed mask.
    s = sigmoid(logits); the choice ranks s + bias (held constant: no
    gradient reaches the bias or the choice); with groups, only the
    topk_group groups whose two largest keys sum highest take part; the K
    chosen s are renormalised (+ 1e-20, as Hugging Face) and scaled."""
    T, E = logits.shape
    s = torch.sigmoid(logits)
    key = s.detach().to(torch.float64)
    if bias is not None:
        key = key + bias.detach().to(torch.float64)
    if n_group:
        size = E // n_group
        group_key = key.view(T, n_group, size).topk(2, dim=-1).values.sum(-1)
        _, kept = topk(group_key, topk_group)
        keep = torch.zeros(T, n_group, dtype=torch.bool).scatter(1, kept, True)
        key = key.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    _, idx = topk(key, K)
    chosen = s.gather(1, idx)
    if renormalize:
        chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    chosen = chosen * scaling
    scores = torch.zeros_like(s).scatter(1, idx, chosen)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    return scores, mask


def moe_sigmoid_ref(x, router_w, w1, w2, b1=None, b2=None, *, top_k, expert_bias=None,
                    n_group=0, topk_group=0, renormalize=True, routed_scaling=1.0,
                    activation="swiglu", w1_layout="interleaved", routing="sigmoid_topk"):
    """(out, expert_counts, router_logits), as smoe.moe(..., routing='sigmoid_topk')."""
    assert routing == "sigmoid_topk"
    logits = x @ router_w.T
    S, mask = sigmoid_route(logits, top_k, expert_bias, n_group, topk_group, renormalize,
                            routed_scaling)
    out = experts(x, S.to(x.dtype), mask, w1, w2, b1, b2, activation, w1_layout)
    return out, mask.sum(0).to(torch.int32), logits


def moe_general_ref(x, pair_token, pair_expert, pair_score, w1, w2, b1=None, b2=None, *,
                    activation="swiglu", w1_layout="interleaved"):
    T, E = x.shape[0], w1.shape[0]
    S = torch.zeros(T, E, dtype=pair_score.dtype).index_put(
        (pair_token.long(), pair_expert.long()), pair_score)
    mask = torch.zeros(T, E, dtype=torch.bool)
    mask[pair_token.long(), pair_expert.long()] = True
    out = experts(x, S.to(x.dtype), mask, w1, w2, b1, b2, activation, w1_layout)
    return out, mask.sum(0).to(torch.int32)
