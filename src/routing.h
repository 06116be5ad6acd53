/*
 * routing.h -- host routing shared by the core (smoe_route_cpu) and the CPU
 * backend: top-K selection, softmax, token rounding (DESIGN.md section 2).
 *
 * Selection (which experts a token gets, which tokens token rounding keeps)
 * depends only on the fp32 logits, with the deterministic tie-break: equal
 * keys go to the lower expert index, and in token rounding to the lower
 * token index. Scores are computed in double, from the fp32 logits, or from
 * the double logits an F64 layer passes (so the fp64 reference is exact).
 */
#ifndef SMOE_ROUTING_H
#define SMOE_ROUTING_H

#include "smoe_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks every field of a layer description (validate.c). */
smoe_status smoe_desc_validate(const smoe_layer_desc *desc);

/* smoe_row_capacity() for a description (smoe.c). */
int64_t smoe_desc_row_capacity(const smoe_layer_desc *desc, int64_t T, int64_t pairs,
                               int inference);

/* The K largest of E logits, largest first; equal logits: lower index first;
 * NaN ranks above every number (as torch.topk). */
void smoe_topk_select(const float *logits, int64_t E, int64_t K, int32_t *idx);

/* SIGMOID_TOPK's selection of one token (smoe.h, smoe_routing): key (E)
 * gets sigmoid(logit) + bias (bias may be NULL), masked to -inf outside
 * the kept groups; gkey (n_group) the group keys, gidx (topk_group) the
 * kept groups; idx (K) the picks, best first. */
void smoe_sigmoid_select(const smoe_layer_desc *desc, const float *logits, const float *bias,
                         double *key, double *gkey, int32_t *gidx, int32_t *idx);

/* SIGMOID_TOPK's K scores from the K selected sigmoids s (selection
 * order): renormalised (sum + 1e-20) if desc.renormalize, times
 * desc.routed_scaling. */
void smoe_sigmoid_scores(const smoe_layer_desc *desc, const double *s, double *score);

/* p = softmax(l) over E, in double: m = max, e_i = exp(l_i - m), the sum
 * taken in index order. l64 (may be NULL) replaces l32 when given. */
void smoe_softmax_probs(const float *l32, const double *l64, int64_t E, double *p);

/* Routed pairs in token-major order (token ascending; token choice: the
 * token's experts by descending score; token rounding: by expert index). */
typedef struct smoe_assignments {
    int32_t *token_offset; /* (T+1) pairs of token t: [token_offset[t], token_offset[t+1]) */
    uint16_t *expert;      /* (cap); E <= SMOE_MAX_EXPERTS */
    double *score;         /* (cap) */
    int64_t cap;           /* capacity of expert/score */
    int64_t R;             /* out: pairs written */
} smoe_assignments;

/* Scratch bytes smoe_route_assign needs; `rounding` 1 applies the
 * description's token rounding, 0 gives plain token choice. */
size_t smoe_route_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding);

/* Routes T tokens from fp32 logits (T, E). desc is valid and not GENERAL.
 * logits64 (T, E), optional: the F64 layer's exact logits, used for the
 * scores (the selection still uses the fp32 logits). expert_bias (E):
 * SIGMOID_TOPK's selection bias, or NULL. */
smoe_status smoe_route_assign(const smoe_layer_desc *desc, int64_t T, int rounding,
                              const float *logits, const double *logits64,
                              const float *expert_bias, void *scratch, smoe_assignments *out);

#ifdef __cplusplus
}
#endif

#endif /* SMOE_ROUTING_H */
