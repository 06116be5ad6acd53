/*
 * routing.c -- routing on the host from fp32 logits (DESIGN.md section 2):
 * TOPK_SOFTMAX, SOFTMAX_TOPK (renormalised or not), SIGMOID_TOPK (expert
 * bias, groups, renormalisation, scaling) and token rounding (up, down,
 * nearest) on top of the first two. The CPU backend's routing and the GPU
 * tests' reference (through smoe_route_cpu).
 *
 * Determinism: the selection reads only the fp32 logits. Top-K: the larger
 * logit first, NaN before every number (torch.topk's order), equal logits
 * by lower expert index. SIGMOID_TOPK selects by double keys
 * sigmoid(fp32 logit) + bias (routing_math.h's sigmoid, the GPU's too),
 * NaN first, equal keys by lower index. Token rounding ranks the
 * tokens of an expert by a combined key computed in double from the fp32
 * logits (larger key first, equal keys by lower token index).
 */
#include "routing.h"
#include "routing_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ selection */

/* Does key a (index ia) rank before key b (index ib)? NaN ranks first, as
 * torch.topk ranks it; equal keys (-0 and +0 too) by the lower index. */
static int ranks_before_d(double a, int64_t ia, double b, int64_t ib)
{
    int na = isnan(a), nb = isnan(b);
    if (na || nb) {
        if (na != nb) return na;
        return ia < ib;
    }
    if (a != b) return a > b;
    return ia < ib;
}

/* The same for fp32 logits (exact in double). */
static int ranks_before(float a, int64_t ia, float b, int64_t ib)
{
    return ranks_before_d((double)a, ia, (double)b, ib);
}

void smoe_topk_select(const float *logits, int64_t E, int64_t K, int32_t *idx)
{
    /* K passes of a scan: each finds the best logit ranking after the
     * previous pick. O(E*K), no scratch, exactly the (value desc, index
     * asc) order. */
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (k > 0 && !ranks_before(logits[idx[k - 1]], idx[k - 1], logits[e], e)) continue;
            if (best < 0 || ranks_before(logits[e], e, logits[best], best)) best = e;
        }
        idx[k] = (int32_t)best;
    }
}

void smoe_softmax_probs(const float *l32, const double *l64, int64_t E, double *p)
{
    double m = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < E; e++) {
        double v = l64 ? l64[e] : (double)l32[e];
        if (v > m) m = v;
    }
    for (int64_t e = 0; e < E; e++) {
        double v = l64 ? l64[e] : (double)l32[e];
        p[e] = exp(v - m);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
}

/* The K best of n double keys, best first (smoe_topk_select's scan). */
static void topk_select_d(const double *v, int64_t n, int64_t K, int32_t *idx)
{
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            if (k > 0 && !ranks_before_d(v[idx[k - 1]], idx[k - 1], v[e], e)) continue;
            if (best < 0 || ranks_before_d(v[e], e, v[best], best)) best = e;
        }
        idx[k] = (int32_t)best;
    }
}

void smoe_sigmoid_select(const smoe_layer_desc *desc, const float *logits, const float *bias,
                         double *key, double *gkey, int32_t *gidx, int32_t *idx)
{
    const int64_t E = desc->E, K = desc->K, G = desc->n_group, g = desc->topk_group;
    for (int64_t e = 0; e < E; e++)
        key[e] = smoe_sigmoid((double)logits[e]) + (bias ? (double)bias[e] : 0.0);
    if (G > 0) {
        /* a group's key: the sum of its two best keys (their order does not
         * change the sum); keep the g best groups, mask the others */
        const int64_t gs = E / G;
        int32_t two[2];
        for (int64_t q = 0; q < G; q++) {
            topk_select_d(key + q * gs, gs, 2, two);
            gkey[q] = key[q * gs + two[0]] + key[q * gs + two[1]];
        }
        topk_select_d(gkey, G, g, gidx);
        for (int64_t q = 0; q < G; q++) {
            int kept = 0;
            for (int64_t j = 0; j < g; j++) kept |= gidx[j] == q;
            if (!kept)
                for (int64_t e = q * gs; e < (q + 1) * gs; e++) key[e] = -INFINITY;
        }
    }
    topk_select_d(key, E, K, idx);
}

void smoe_sigmoid_scores(const smoe_layer_desc *desc, const double *s, double *score)
{
    const int64_t K = desc->K;
    double z = 0.0;
    for (int64_t k = 0; k < K; k++) z += s[k];
    const double den = z + 1e-20;
    for (int64_t k = 0; k < K; k++) {
        double v = desc->renormalize ? s[k] / den : s[k];
        score[k] = v * desc->routed_scaling;
    }
}

/* ------------------------------------------------------------ scratch */

static size_t al64(size_t x) { return (x + 63) / 64 * 64; }

size_t smoe_route_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding)
{
    const size_t E = (size_t)desc->E, K = (size_t)desc->K, t = (size_t)T;
    if (!rounding || desc->rounding == SMOE_ROUND_OFF)
        return al64(E * 8) + al64(E * 8) + al64(K * 4) + al64(E * 4);
    return al64(t * E * 8) * 2   /* probabilities: keys (fp32 logits), scores */
           + al64(t * E)         /* 1: token-choice pair */
           + al64(t * E)         /* 1: kept pair */
           + al64(t * 8) * 2     /* Z_t for keys and for scores */
           + al64(t * K * 4)     /* token-choice experts */
           + al64(E * 8)         /* f_e */
           + al64(t * 16);       /* candidates of one expert */
}

typedef struct scratch_bump {
    char *p;
} scratch_bump;

static void *take(scratch_bump *b, size_t bytes)
{
    void *r = b->p;
    b->p += al64(bytes);
    return r;
}

/* ------------------------------------------------------------ token choice */

static smoe_status route_token_choice(const smoe_layer_desc *desc, int64_t T, const float *logits,
                                      const double *logits64, const float *bias, void *scratch,
                                      smoe_assignments *out)
{
    const int64_t E = desc->E, K = desc->K;
    scratch_bump b = {(char *)scratch};
    double *p = (double *)take(&b, (size_t)E * 8);
    double *lk = (double *)take(&b, (size_t)E * 8);
    int32_t *idx = (int32_t *)take(&b, (size_t)K * 4);
    int32_t *gidx = (int32_t *)take(&b, (size_t)E * 4);
    SMOE_RETURN_ERROR_IF(out->cap < T * K, SMOE_ERROR_INTERNAL,
                         "route_token_choice: capacity %lld < T*K = %lld", (long long)out->cap,
                         (long long)(T * K));
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        const double *l64 = logits64 ? logits64 + t * E : NULL;
        uint16_t *ex = out->expert + t * K;
        double *sc = out->score + t * K;
        out->token_offset[t] = (int32_t)(t * K);
        if (desc->routing == SMOE_ROUTING_SIGMOID_TOPK) {
            /* keys in p, group keys in lk; the K sigmoids in lk after */
            smoe_sigmoid_select(desc, l, bias, p, lk, gidx, idx);
            for (int64_t k = 0; k < K; k++) {
                ex[k] = (uint16_t)idx[k];
                lk[k] = smoe_sigmoid(l64 ? l64[idx[k]] : (double)l[idx[k]]);
            }
            smoe_sigmoid_scores(desc, lk, sc);
            continue;
        }
        smoe_topk_select(l, E, K, idx);
        for (int64_t k = 0; k < K; k++) ex[k] = (uint16_t)idx[k];
        if (desc->routing == SMOE_ROUTING_TOPK_SOFTMAX) {
            /* softmax over the K selected logits, largest first */
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) lk[k] = l64 ? l64[idx[k]] : (double)l[idx[k]];
            double m = lk[0];
            for (int64_t k = 1; k < K; k++)
                if (lk[k] > m) m = lk[k];
            for (int64_t k = 0; k < K; k++) {
                sc[k] = exp(lk[k] - m);
                sum += sc[k];
            }
            for (int64_t k = 0; k < K; k++) sc[k] /= sum;
        } else {
            smoe_softmax_probs(l, l64, E, p);
            double z = 0.0;
            for (int64_t k = 0; k < K; k++) {
                sc[k] = p[idx[k]];
                z += sc[k];
            }
            if (desc->renormalize)
                for (int64_t k = 0; k < K; k++) sc[k] /= z;
        }
    }
    out->token_offset[T] = (int32_t)(T * K);
    out->R = T * K;
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ token rounding */

typedef struct cand {
    double key;
    int32_t token;
} cand;

/* NaN keys (from NaN logits) were mapped to +inf, so this order is total. */
static int cand_cmp(const void *pa, const void *pb)
{
    const cand *a = (const cand *)pa, *b = (const cand *)pb;
    if (a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->token > b->token) - (a->token < b->token);
}

/* A NaN key (its token has a NaN logit) ranks first: the token is kept and
 * its output is NaN, as it would be without rounding. */
static double nan_high(double k) { return isnan(k) ? INFINITY : k; }

static int64_t rounded_target(smoe_rounding r, int64_t f, int64_t M, int64_t T)
{
    int64_t q = f / M, rem = f % M, target;
    switch (r) {
    case SMOE_ROUND_UP: target = (q + (rem > 0)) * M; break;
    case SMOE_ROUND_DOWN: target = q * M; break;
    case SMOE_ROUND_NEAREST: target = (q + (2 * rem >= M)) * M; break; /* ties up */
    default: target = f; break;
    }
    return target < T ? target : T;
}

static smoe_status route_rounding(const smoe_layer_desc *desc, int64_t T, const float *logits,
                                  const double *logits64, void *scratch, smoe_assignments *out)
{
    const int64_t E = desc->E, K = desc->K, M = desc->round_tile;
    scratch_bump b = {(char *)scratch};
    double *pkey = (double *)take(&b, (size_t)T * E * 8);
    double *pscore = (double *)take(&b, (size_t)T * E * 8);
    unsigned char *tc = (unsigned char *)take(&b, (size_t)T * E);
    unsigned char *keep = (unsigned char *)take(&b, (size_t)T * E);
    double *zkey = (double *)take(&b, (size_t)T * 8);
    double *zscore = (double *)take(&b, (size_t)T * 8);
    int32_t *tcx = (int32_t *)take(&b, (size_t)T * K * 4);
    int64_t *f = (int64_t *)take(&b, (size_t)E * 8);
    cand *c = (cand *)take(&b, (size_t)T * 16);

    /* 1-2. softmax over E, token choice, renormaliser Z_t over the K picks */
    memset(tc, 0, (size_t)T * E);
    memset(keep, 0, (size_t)T * E);
    for (int64_t e = 0; e < E; e++) f[e] = 0;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        smoe_softmax_probs(l, NULL, E, pkey + t * E);
        if (logits64)
            smoe_softmax_probs(l, logits64 + t * E, E, pscore + t * E);
        else
            memcpy(pscore + t * E, pkey + t * E, (size_t)E * 8);
        int32_t *x = tcx + t * K;
        smoe_topk_select(l, E, K, x);
        double zk = 0.0, zs = 0.0;
        for (int64_t k = 0; k < K; k++) {
            tc[t * E + x[k]] = 1;
            f[x[k]]++;
            zk += pkey[t * E + x[k]];
            zs += pscore[t * E + x[k]];
        }
        zkey[t] = zk;
        zscore[t] = zs;
    }

    /* 3-5. per expert: rank by the combined key, keep the first target_e */
    for (int64_t e = 0; e < E; e++) {
        int64_t target = rounded_target(desc->rounding, f[e], M, T);
        int64_t nc = 0;
        if (target <= f[e]) {
            for (int64_t t = 0; t < T; t++)
                if (tc[t * E + e]) {
                    c[nc].key = nan_high(pkey[t * E + e] / zkey[t]);
                    c[nc].token = (int32_t)t;
                    nc++;
                }
            qsort(c, (size_t)nc, sizeof *c, cand_cmp);
            for (int64_t i = 0; i < target; i++) keep[(int64_t)c[i].token * E + e] = 1;
        } else {
            for (int64_t t = 0; t < T; t++) {
                if (tc[t * E + e]) {
                    keep[t * E + e] = 1;
                } else {
                    c[nc].key = nan_high(pkey[t * E + e] - 1.0);
                    c[nc].token = (int32_t)t;
                    nc++;
                }
            }
            qsort(c, (size_t)nc, sizeof *c, cand_cmp);
            for (int64_t i = 0; i < target - f[e]; i++) keep[(int64_t)c[i].token * E + e] = 1;
        }
    }

    /* 6. GENERAL-shaped result, by token then expert */
    int64_t R = 0;
    for (int64_t t = 0; t < T; t++) {
        out->token_offset[t] = (int32_t)R;
        for (int64_t e = 0; e < E; e++) {
            if (!keep[t * E + e]) continue;
            SMOE_RETURN_ERROR_IF(R >= out->cap, SMOE_ERROR_INTERNAL,
                                 "token rounding: more than the capacity of %lld rows",
                                 (long long)out->cap);
            out->expert[R] = (uint16_t)e;
            out->score[R] = tc[t * E + e] ? pscore[t * E + e] / zscore[t] : pscore[t * E + e];
            R++;
        }
    }
    out->token_offset[T] = (int32_t)R;
    out->R = R;
    return SMOE_SUCCESS;
}

smoe_status smoe_route_assign(const smoe_layer_desc *desc, int64_t T, int rounding,
                              const float *logits, const double *logits64,
                              const float *expert_bias, void *scratch, smoe_assignments *out)
{
    if (rounding && desc->rounding != SMOE_ROUND_OFF)
        return route_rounding(desc, T, logits, logits64, scratch, out);
    return route_token_choice(desc, T, logits, logits64, expert_bias, scratch, out);
}
