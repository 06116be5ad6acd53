/*
 * validate.c -- every check of the caller's input before a backend sees it,
 * so that on error nothing is written: the fields of a layer description
 * (smoe_desc_validate), and the arguments of a forward / backward
 * (smoe_forward_validate, smoe_backward_validate: pointers, flags, buffer
 * sizes, alignment, overlap, host-visible GENERAL triples). T and pairs are
 * checked by the entry points (smoe.c) first.
 */
#include "smoe_internal.h"
#include "routing.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static const char *dtype_name(smoe_dtype t)
{
    switch (t) {
    case SMOE_DTYPE_F32: return "F32";
    case SMOE_DTYPE_BF16: return "BF16";
    case SMOE_DTYPE_F64: return "F64";
    }
    return "?";
}

/* ------------------------------------------------------------ descriptor */

/* The fields of SIGMOID_TOPK routing (smoe.h, smoe_routing): groups, the
 * scaling factor, and the modes that cannot use them. */
static smoe_status validate_sigmoid_fields(const smoe_layer_desc *desc)
{
    const int sigmoid = desc->routing == SMOE_ROUTING_SIGMOID_TOPK;
    const double c = desc->routed_scaling;
    const long long G = (long long)desc->n_group, g = (long long)desc->topk_group;
    SMOE_RETURN_ERROR_IF(!isfinite(c) || c <= 0.0, SMOE_ERROR_INVALID_VALUE,
                         "desc.routed_scaling = %g, must be finite and > 0 (1.0 is no "
                         "scaling, as smoe_layer_desc_default() sets)",
                         c);
    SMOE_RETURN_ERROR_IF(!sigmoid && c != 1.0, SMOE_ERROR_INVALID_VALUE,
                         "desc.routed_scaling = %g needs SIGMOID_TOPK routing (desc.routing = "
                         "%d scales nothing: leave it 1.0)",
                         c, (int)desc->routing);
    SMOE_RETURN_ERROR_IF(G < 0 || g < 0, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld, desc.topk_group = %lld: must be >= 0", G, g);
    SMOE_RETURN_ERROR_IF((G == 0) != (g == 0), SMOE_ERROR_INVALID_VALUE,
                         "desc.n_group = %lld, desc.topk_group = %lld: both 0 (no groups) or "
                         "both > 0",
                         G, g);
    if (G == 0) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!sigmoid, SMOE_ERROR_INVALID_VALUE,
                         "desc.n_group = %lld: group-limited selection needs SIGMOID_TOPK "
                         "routing (desc.routing = %d); set n_group = topk_group = 0",
                         G, (int)desc->routing);
    const long long E = (long long)desc->E, K = (long long)desc->K;
    SMOE_RETURN_ERROR_IF(E % G != 0, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld does not divide E = %lld", G, E);
    SMOE_RETURN_ERROR_IF(E / G < 2, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld gives groups of E/n_group = %lld expert(s); a "
                         "group's key sums its 2 best, so groups need >= 2",
                         G, E / G);
    SMOE_RETURN_ERROR_IF(g > G, SMOE_ERROR_INVALID_SIZE,
                         "desc.topk_group = %lld, must be in [1, n_group = %lld]", g, G);
    SMOE_RETURN_ERROR_IF(g * (E / G) < K, SMOE_ERROR_INVALID_SIZE,
                         "desc.topk_group = %lld groups of %lld experts hold fewer than K = %lld "
                         "experts",
                         g, E / G, K);
    return SMOE_SUCCESS;
}

smoe_status smoe_desc_validate(const smoe_layer_desc *desc)
{
    SMOE_RETURN_ERROR_IF(!desc, SMOE_ERROR_NULL_POINTER, "desc is NULL");
    SMOE_RETURN_ERROR_IF(desc->d <= 0, SMOE_ERROR_INVALID_SIZE, "desc.d = %lld, must be > 0",
                         (long long)desc->d);
    SMOE_RETURN_ERROR_IF(desc->n <= 0, SMOE_ERROR_INVALID_SIZE, "desc.n = %lld, must be > 0",
                         (long long)desc->n);
    SMOE_RETURN_ERROR_IF(desc->E <= 0 || desc->E > SMOE_MAX_EXPERTS, SMOE_ERROR_INVALID_SIZE,
                         "desc.E = %lld, must be in [1, %d] (the saved block keeps each "
                         "pair's expert in 16 bits)",
                         (long long)desc->E, SMOE_MAX_EXPERTS);
    SMOE_RETURN_ERROR_IF((unsigned)desc->routing > SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.routing = %d is not a smoe_routing", (int)desc->routing);
    if (desc->routing == SMOE_ROUTING_GENERAL) {
        /* K is not read by GENERAL routing; 0 (the default) is fine. */
        SMOE_RETURN_ERROR_IF(desc->K < 0 || desc->K > desc->E, SMOE_ERROR_INVALID_SIZE,
                             "desc.K = %lld, must be in [0, E = %lld] (not read by GENERAL)",
                             (long long)desc->K, (long long)desc->E);
    } else {
        SMOE_RETURN_ERROR_IF(desc->K <= 0 || desc->K > desc->E, SMOE_ERROR_INVALID_SIZE,
                             "desc.K = %lld, must be in [1, E = %lld]", (long long)desc->K,
                             (long long)desc->E);
    }
    SMOE_RETURN_ERROR_IF((unsigned)desc->activation > SMOE_ACT_GELU, SMOE_ERROR_INVALID_VALUE,
                         "desc.activation = %d is not a smoe_activation",
                         (int)desc->activation);
    SMOE_RETURN_ERROR_IF((unsigned)desc->w1_layout > SMOE_W1_CONCATENATED,
                         SMOE_ERROR_INVALID_VALUE, "desc.w1_layout = %d is not a smoe_w1_layout",
                         (int)desc->w1_layout);
    SMOE_RETURN_ERROR_IF(desc->has_bias != 0 && desc->has_bias != 1, SMOE_ERROR_INVALID_VALUE,
                         "desc.has_bias = %d, must be 0 or 1", desc->has_bias);
    SMOE_RETURN_ERROR_IF(desc->renormalize != 0 && desc->renormalize != 1,
                         SMOE_ERROR_INVALID_VALUE, "desc.renormalize = %d, must be 0 or 1",
                         desc->renormalize);
    SMOE_RETURN_ERROR_IF((unsigned)desc->rounding > SMOE_ROUND_NEAREST, SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d is not a smoe_rounding", (int)desc->rounding);
    SMOE_RETURN_ERROR_IF(desc->round_tile <= 0 || desc->round_tile > INT32_MAX,
                         SMOE_ERROR_INVALID_SIZE, "desc.round_tile = %lld, must be in [1, %d]",
                         (long long)desc->round_tile, INT32_MAX);
    SMOE_RETURN_ERROR_IF(desc->rounding != SMOE_ROUND_OFF &&
                             desc->routing == SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d: token rounding ranks tokens by their softmax "
                         "probabilities, which SIGMOID_TOPK routing has none of (use "
                         "TOPK_SOFTMAX or SOFTMAX_TOPK, or rounding off)",
                         (int)desc->rounding);
    SMOE_RETURN_ERROR_IF(desc->rounding != SMOE_ROUND_OFF &&
                             desc->routing == SMOE_ROUTING_GENERAL,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d needs TOPK_SOFTMAX or SOFTMAX_TOPK routing, "
                         "not GENERAL",
                         (int)desc->rounding);
    SMOE_FORWARD_IF_ERROR(validate_sigmoid_fields(desc));
    SMOE_RETURN_ERROR_IF((unsigned)desc->dtype > SMOE_DTYPE_F64, SMOE_ERROR_INVALID_VALUE,
                         "desc.dtype = %d is not a smoe_dtype", (int)desc->dtype);
    SMOE_RETURN_ERROR_IF((unsigned)desc->backend > SMOE_BACKEND_SM90, SMOE_ERROR_INVALID_VALUE,
                         "desc.backend = %d is not a smoe_backend", (int)desc->backend);
    SMOE_RETURN_ERROR_IF(desc->dtype == SMOE_DTYPE_F64 && (desc->backend == SMOE_BACKEND_CUDA ||
                                                           desc->backend == SMOE_BACKEND_SM90),
                         SMOE_ERROR_UNSUPPORTED,
                         "desc.dtype = F64 runs on the CPU backend only (desc.backend = %d)",
                         (int)desc->backend);
    SMOE_RETURN_ERROR_IF(desc->device < 0, SMOE_ERROR_INVALID_VALUE,
                         "desc.device = %d, must be >= 0", desc->device);
    SMOE_RETURN_ERROR_IF(desc->consume_saved != 0 && desc->consume_saved != 1,
                         SMOE_ERROR_INVALID_VALUE, "desc.consume_saved = %d, must be 0 or 1",
                         desc->consume_saved);
    /* Weight tensors must be indexable: E * 2n * d elements. */
    int64_t h_cols = smoe_is_gated(desc->activation) ? smoe_mul_i64(2, desc->n) : desc->n;
    int64_t w1 = smoe_mul_i64(smoe_mul_i64(desc->E, h_cols), desc->d);
    int64_t wr = smoe_mul_i64(desc->E, desc->d);
    SMOE_RETURN_ERROR_IF(h_cols < 0 || w1 < 0 || w1 > SMOE_MAX_ELEMS || wr > SMOE_MAX_ELEMS ||
                             h_cols > INT32_MAX || desc->d > INT32_MAX,
                         SMOE_ERROR_INVALID_SIZE,
                         "weights of E = %lld, n = %lld, d = %lld are too large",
                         (long long)desc->E, (long long)desc->n, (long long)desc->d);
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ call arguments */

/* The memory one call touches: each argument's extent in bytes and whether
 * the call writes it, for smoe.h's alignment and overlap rules. */
typedef struct span {
    const char *name;
    uintptr_t lo, hi; /* [lo, hi) */
    int out;
} span;

typedef struct span_set {
    span s[24];
    int n;
} span_set;

/* Adds p (bytes long) unless it is NULL; refuses it unless it is aligned to
 * `align` (elem: the element's size, for the message). */
static smoe_status span_add(span_set *set, const char *fn, const char *name, const void *p,
                            size_t bytes, size_t elem, size_t align, int out)
{
    if (!p) return SMOE_SUCCESS;
    if (align < elem) align = elem;
    SMOE_RETURN_ERROR_IF((uintptr_t)p % align != 0, SMOE_ERROR_INVALID_SIZE,
                         "%s: %s = %p is not %zu-byte aligned%s", fn, name, p, align,
                         align > elem ? " (the backend loads 16-byte vectors)" : "");
    if (bytes == 0 || set->n == (int)(sizeof set->s / sizeof set->s[0])) return SMOE_SUCCESS;
    span *sp = &set->s[set->n++];
    sp->name = name;
    sp->lo = (uintptr_t)p;
    sp->hi = sp->lo + bytes < sp->lo ? UINTPTR_MAX : sp->lo + bytes;
    sp->out = out;
    return SMOE_SUCCESS;
}

/* No output (or saved block, or workspace) shares a byte with anything else. */
static smoe_status spans_disjoint(const char *fn, const span_set *set)
{
    for (int i = 0; i < set->n; i++)
        for (int j = 0; j < i; j++) {
            const span *a = &set->s[i], *b = &set->s[j];
            if (!a->out && !b->out) continue;
            SMOE_RETURN_ERROR_IF(a->lo < b->hi && b->lo < a->hi, SMOE_ERROR_INVALID_VALUE,
                                 "%s: %s [%p, %zu bytes) overlaps %s [%p, %zu bytes); outputs, "
                                 "the saved block and the workspace may not overlap each other "
                                 "or an input",
                                 fn, a->name, (void *)a->lo, (size_t)(a->hi - a->lo), b->name,
                                 (void *)b->lo, (size_t)(b->hi - b->lo));
        }
    return SMOE_SUCCESS;
}

static smoe_status check_buffer(const char *fn, const char *name, size_t given, size_t need,
                                int64_t T, int64_t pairs, const char *query)
{
    SMOE_RETURN_ERROR_IF(given < need, SMOE_ERROR_INVALID_SIZE,
                         "%s: %s_bytes = %zu, but this call (T = %lld, pairs = %lld) needs %zu "
                         "(%s)",
                         fn, name, given, (long long)T, (long long)pairs, need, query);
    return SMOE_SUCCESS;
}

/* The first repeated expert in pairs [p0, p1) of one token, or -1. Short
 * runs compare pairs; longer ones mark experts in a bitmap on the stack,
 * 2^16 experts per pass (nothing allocated, nothing of the caller's
 * written, not even the workspace). */
static int64_t first_duplicate(const int32_t *ex, int64_t p0, int64_t p1, int64_t E)
{
    enum { PASS = 1 << 16 };
    if (p1 - p0 <= 32) {
        for (int64_t i = p0 + 1; i < p1; i++)
            for (int64_t j = p0; j < i; j++)
                if (ex[j] == ex[i]) return i;
        return -1;
    }
    uint64_t seen[PASS / 64];
    for (int64_t base = 0; base < E; base += PASS) {
        const int64_t span = E - base < PASS ? E - base : PASS;
        memset(seen, 0, (size_t)((span + 63) / 64) * sizeof seen[0]);
        for (int64_t i = p0; i < p1; i++) {
            const int64_t e = (int64_t)ex[i] - base;
            if (e < 0 || e >= span) continue;
            if (seen[e >> 6] >> (e & 63) & 1) return i;
            seen[e >> 6] |= (uint64_t)1 << (e & 63);
        }
    }
    return -1;
}

/* GENERAL triples in host memory: token in [0, T), expert in [0, E),
 * tokens non-decreasing, each (token, expert) once, finite scores. */
static smoe_status check_triples(const smoe_layer *layer, const smoe_forward_args *a)
{
    const char *fn = "smoe_layer_forward";
    const int64_t E = layer->desc.E;
    for (int64_t i = 0; i < a->pairs; i++) {
        int32_t t = a->pair_token[i], e = a->pair_expert[i];
        float s = a->pair_score[i];
        SMOE_RETURN_ERROR_IF(t < 0 || t >= a->T, SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_token[%lld] = %d, must be in [0, T = %lld)", fn,
                             (long long)i, (int)t, (long long)a->T);
        SMOE_RETURN_ERROR_IF(e < 0 || e >= E, SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_expert[%lld] = %d, must be in [0, E = %lld)", fn,
                             (long long)i, (int)e, (long long)E);
        SMOE_RETURN_ERROR_IF(!isfinite(s), SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_score[%lld] = %g is not finite", fn, (long long)i,
                             (double)s);
        SMOE_RETURN_ERROR_IF(i > 0 && t < a->pair_token[i - 1], SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_token[%lld] = %d < pair_token[%lld] = %d: triples must "
                             "be sorted by token",
                             fn, (long long)i, (int)t, (long long)(i - 1),
                             (int)a->pair_token[i - 1]);
    }
    /* Duplicates, token by token (the tokens are sorted now). */
    for (int64_t p0 = 0, p1; p0 < a->pairs; p0 = p1) {
        for (p1 = p0 + 1; p1 < a->pairs && a->pair_token[p1] == a->pair_token[p0]; p1++) {
        }
        const int64_t i = first_duplicate(a->pair_expert, p0, p1, E);
        SMOE_RETURN_ERROR_IF(i >= 0, SMOE_ERROR_INVALID_VALUE,
                             "%s: (token %d, expert %d) is given twice (again at pair %lld)", fn,
                             (int)a->pair_token[i], (int)a->pair_expert[i], (long long)i);
    }
    return SMOE_SUCCESS;
}

smoe_status smoe_forward_validate(const smoe_layer *layer, const char *fn,
                                  const smoe_forward_args *args, const smoe_call_shape *cs,
                                  const void *saved, size_t saved_bytes, const void *workspace,
                                  size_t workspace_bytes)
{
    const smoe_layer_desc *d = &layer->desc;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int training = !args->inference;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    if (T > 0 || !cs->empty_ok) SMOE_REQUIRE_PTR(args->x, "args.x");
    SMOE_REQUIRE_PTR(args->w1, "args.w1");
    SMOE_REQUIRE_PTR(args->w2, "args.w2");
    if (T > 0 || !cs->empty_ok) SMOE_REQUIRE_PTR(args->out, "args.out");
    if (d->has_bias) {
        SMOE_REQUIRE_PTR(args->b1, "args.b1 (the layer has biases)");
        SMOE_REQUIRE_PTR(args->b2, "args.b2 (the layer has biases)");
    } else {
        SMOE_RETURN_ERROR_IF(args->b1 || args->b2, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.b%d is given but the layer has no bias (desc.has_bias = 0)",
                             fn, args->b1 ? 1 : 2);
    }
    if (general) {
        if (pairs > 0) {
            SMOE_REQUIRE_PTR(args->pair_token, "args.pair_token (GENERAL routing)");
            SMOE_REQUIRE_PTR(args->pair_expert, "args.pair_expert (GENERAL routing)");
            SMOE_REQUIRE_PTR(args->pair_score, "args.pair_score (GENERAL routing)");
        }
        SMOE_RETURN_ERROR_IF(args->router_logits != NULL, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.router_logits is given but GENERAL routing has no router",
                             fn);
    } else {
        SMOE_REQUIRE_PTR(args->router_w, "args.router_w");
    }
    SMOE_RETURN_ERROR_IF(
        args->router_logits_dtype != SMOE_DTYPE_F32 && args->router_logits_dtype != d->dtype,
        SMOE_ERROR_INVALID_VALUE,
        "%s: args.router_logits_dtype = %d: SMOE_DTYPE_F32 (%d) or the layer's dtype (%d)", fn,
        (int)args->router_logits_dtype, (int)SMOE_DTYPE_F32, (int)d->dtype);
    SMOE_RETURN_ERROR_IF(args->expert_bias && d->routing != SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "%s: args.expert_bias is given but desc.routing = %d has no expert "
                         "bias (SIGMOID_TOPK only)",
                         fn, (int)d->routing);
    if (training) SMOE_REQUIRE_PTR(saved, "saved (a training forward, args.inference = 0)");
    SMOE_REQUIRE_PTR(workspace, "workspace");
    if (training)
        SMOE_FORWARD_IF_ERROR(check_buffer(fn, "saved", saved_bytes, cs->saved_need, T, pairs,
                                           cs->saved_query));
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "workspace", workspace_bytes, cs->ws_need, T, pairs,
                                       cs->ws_query));

    /* alignment and overlap */
    const size_t es = smoe_dtype_size(d->dtype), va = layer->vec_align;
    const size_t t = (size_t)T, dd = (size_t)d->d, n = (size_t)d->n, E = (size_t)d->E;
    const size_t Ex = (size_t)cs->E_experts, hc = (size_t)layer->h_cols, np = (size_t)pairs;
    span_set sp;
    sp.n = 0;
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.x", args->x, t * dd * es, es, va, 0));
    if (!general)
        SMOE_FORWARD_IF_ERROR(
            span_add(&sp, fn, "args.router_w", args->router_w, E * dd * es, es, va, 0));
    if (general) {
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_token", args->pair_token, np * 4, 4, 4, 0));
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_expert", args->pair_expert, np * 4, 4, 4, 0));
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_score", args->pair_score, np * 4, 4, 4, 0));
    }
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w1", args->w1, Ex * hc * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b1", args->b1, Ex * hc * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w2", args->w2, Ex * dd * n * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b2", args->b2, Ex * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.out", args->out, t * dd * es, es, va, 1));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.expert_bias", args->expert_bias, E * 4, 4, 4, 0));
    const size_t ls = smoe_dtype_size(args->router_logits_dtype);
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.router_logits", args->router_logits, t * E * ls, ls, ls, 1));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.expert_counts", args->expert_counts, E * 4, 4, 4, 1));
    if (training)
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "saved", saved, cs->saved_need, 16, 16, 1));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "workspace", workspace, cs->ws_need, 16, 16, 1));
    SMOE_FORWARD_IF_ERROR(spans_disjoint(fn, &sp));

    if (general && layer->backend == SMOE_BACKEND_CPU)
        SMOE_FORWARD_IF_ERROR(check_triples(layer, args));
    return SMOE_SUCCESS;
}

static smoe_status check_grad(const char *fn, const smoe_layer *layer, const smoe_grad *g,
                              const char *name, int allowed, const char *why, int f32_only)
{
    if (!g->ptr) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!allowed, SMOE_ERROR_INVALID_VALUE, "%s: args.%s.ptr is given but %s",
                         fn, name, why);
    smoe_dtype want = layer->desc.dtype;
    if (f32_only) {
        SMOE_RETURN_ERROR_IF(g->dtype != SMOE_DTYPE_F32, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.%s.dtype = %d, must be F32", fn, name, (int)g->dtype);
    } else {
        SMOE_RETURN_ERROR_IF(g->dtype != SMOE_DTYPE_F32 && g->dtype != want,
                             SMOE_ERROR_INVALID_VALUE,
                             "%s: args.%s.dtype = %d, must be F32 or the layer's %s", fn, name,
                             (int)g->dtype, dtype_name(want));
    }
    SMOE_RETURN_ERROR_IF(g->accumulate != 0 && g->accumulate != 1, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.%s.accumulate = %d, must be 0 or 1", fn, name, g->accumulate);
    return SMOE_SUCCESS;
}

/* A gradient output's extent (elems of its dtype), aligned as the layer's
 * tensors unless vec is 0. */
static smoe_status grad_span(span_set *sp, const char *fn, const char *name, const smoe_grad *g,
                             size_t elems, size_t vec_align)
{
    const size_t gs = smoe_dtype_size(g->dtype);
    return span_add(sp, fn, name, g->ptr, elems * gs, gs, vec_align, 1);
}

smoe_status smoe_backward_validate(const smoe_layer *layer, const char *fn,
                                   const smoe_backward_args *args, const smoe_call_shape *cs,
                                   const void *saved, size_t saved_bytes, const void *workspace,
                                   size_t workspace_bytes, int saved_out)
{
    const smoe_layer_desc *d = &layer->desc;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    const int some = T > 0 || !cs->empty_ok;
    if (some) SMOE_REQUIRE_PTR(args->x, "args.x");
    SMOE_REQUIRE_PTR(args->w1, "args.w1");
    SMOE_REQUIRE_PTR(args->w2, "args.w2");
    if (some) SMOE_REQUIRE_PTR(args->dout, "args.dout");
    if (!general) SMOE_REQUIRE_PTR(args->router_w, "args.router_w");
    if (d->has_bias) {
        SMOE_REQUIRE_PTR(args->b2, "args.b2 (the layer has biases)");
    } else {
        SMOE_RETURN_ERROR_IF(args->b2 != NULL, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.b2 is given but the layer has no bias", fn);
    }
    SMOE_RETURN_ERROR_IF(general && args->dlogits_extra != NULL, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.dlogits_extra is given but GENERAL routing has no router",
                         fn);
    SMOE_RETURN_ERROR_IF(
        args->dlogits_extra_dtype != SMOE_DTYPE_F32 && args->dlogits_extra_dtype != d->dtype,
        SMOE_ERROR_INVALID_VALUE,
        "%s: args.dlogits_extra_dtype = %d: SMOE_DTYPE_F32 (%d) or the layer's dtype (%d)", fn,
        (int)args->dlogits_extra_dtype, (int)SMOE_DTYPE_F32, (int)d->dtype);
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dx, "dx", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->drouter_w, "drouter_w", !general,
                                     "GENERAL routing has no router weight", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dw1, "dw1", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->db1, "db1", d->has_bias,
                                     "the layer has no bias", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dw2, "dw2", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->db2, "db2", d->has_bias,
                                     "the layer has no bias", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dpair_score, "dpair_score", general,
                                     "only GENERAL routing has pair scores", 1));
    SMOE_REQUIRE_PTR(saved, "saved");
    SMOE_REQUIRE_PTR(workspace, "workspace");
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "saved", saved_bytes, cs->saved_need, T, pairs,
                                       cs->saved_query));
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "workspace", workspace_bytes, cs->ws_need, T, pairs,
                                       cs->ws_query));

    const size_t es = smoe_dtype_size(d->dtype), va = layer->vec_align;
    const size_t t = (size_t)T, dd = (size_t)d->d, n = (size_t)d->n, E = (size_t)d->E;
    const size_t Ex = (size_t)cs->E_experts, hc = (size_t)layer->h_cols, np = (size_t)pairs;
    span_set sp;
    sp.n = 0;
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.x", args->x, t * dd * es, es, va, 0));
    if (!general)
        SMOE_FORWARD_IF_ERROR(
            span_add(&sp, fn, "args.router_w", args->router_w, E * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w1", args->w1, Ex * hc * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w2", args->w2, Ex * dd * n * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b2", args->b2, Ex * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.dout", args->dout, t * dd * es, es, va, 0));
    const size_t xs = smoe_dtype_size(args->dlogits_extra_dtype);
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.dlogits_extra", args->dlogits_extra, t * E * xs, xs, xs, 0));
    /* a consumed block is written: an output, so it may not overlap an input */
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "saved", saved, cs->saved_need, 16, 16, saved_out != 0));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dx.ptr", &args->dx, t * dd, va));
    /* the one output allowed inside the (consumed) saved block: drouter_w at
     * the block's router slot, which the backward writes last */
    const char *dr = (const char *)args->drouter_w.ptr;
    if (saved_out && cs->drouter_slot_bytes > 0 && dr &&
        dr == (const char *)saved + cs->drouter_slot) {
        SMOE_RETURN_ERROR_IF(args->drouter_w.accumulate != 0, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.drouter_w.ptr is the saved block's router slot "
                             "(smoe_layer_drouter_slot), which holds no gradient to add to: "
                             "args.drouter_w.accumulate must be 0",
                             fn);
        SMOE_RETURN_ERROR_IF(E * dd * smoe_dtype_size(args->drouter_w.dtype) >
                                 cs->drouter_slot_bytes,
                             SMOE_ERROR_INTERNAL, "%s: the router slot (%zu bytes) is too small",
                             fn, cs->drouter_slot_bytes);
    } else {
        SMOE_FORWARD_IF_ERROR(
            grad_span(&sp, fn, "args.drouter_w.ptr", &args->drouter_w, E * dd, va));
    }
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dw1.ptr", &args->dw1, Ex * hc * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.db1.ptr", &args->db1, Ex * hc, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dw2.ptr", &args->dw2, Ex * dd * n, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.db2.ptr", &args->db2, Ex * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dpair_score.ptr", &args->dpair_score, np, 4));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "workspace", workspace, cs->ws_need, 16, 16, 1));
    return spans_disjoint(fn, &sp);
}
