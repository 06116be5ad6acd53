/*
 * ep_ref.h -- what the expert-parallel tests (test_ep.c on the CPU,
 * gpu/test_ep_gpu.c over NCCL) share: the single CPU layer on the gathered
 * batch as the reference, the comparison rule, a hash for bitwise repeats.
 */
#ifndef SMOE_TEST_EP_REF_H
#define SMOE_TEST_EP_REF_H

#include "testutil.h"

static TU_UNUSED uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The single layer on the whole batch: out, the seven gradients (F64). */
typedef struct single_res {
    double *out, *g[7];
    int32_t counts[64];
} single_res;

/* G2: dlogits_extra (T, E) fp32, or NULL */
static TU_UNUSED void single_run(const tu_problem *P0, const double *dout, const float *G2,
                                 smoe_dtype dt, single_res *s) {
    tu_problem P = *P0;
    P.desc.dtype = dt;
    P.desc.backend = SMOE_BACKEND_CPU;
    smoe_layer *L = tu_layer(&P.desc);
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, &P, dt == SMOE_DTYPE_F64 ? SMOE_DTYPE_F64 : SMOE_DTYPE_F32);
    void *G = tu_to_dtype(dt, dout, (size_t)(P.T * P.desc.d));
    tu_run_backward(L, &P, &B, G, G2, &g, 0);
    s->out = tu_from_dtype(dt, B.out, (size_t)(P.T * P.desc.d));
    for (int i = 0; i < 7; i++) s->g[i] = g.g[i] ? tu_grad_d(&g, i) : NULL;
    memcpy(s->counts, B.counts, (size_t)P.desc.E * 4);
    free(G);
    tu_grads_free(&g);
    tu_bufs_free(&B);
    smoe_layer_free(L);
}

static TU_UNUSED void single_free(single_res *s) {
    free(s->out);
    for (int i = 0; i < 7; i++) free(s->g[i]);
}

/* a against ref: F64 within 1e-6 relative; BF16 by FA3's rule with b16 */
static TU_UNUSED void close_enough(const char *what, const double *a, const double *ref, const double *b16,
                         size_t n, int bf16) {
    const double scale = tu_max_abs(ref, n) + 1e-30, err = tu_max_abs_diff(a, ref, n) / scale;
    if (!bf16) {
        CHECK(err <= 1e-6, "%s: rel err %.3g against the single layer", what, err);
    } else {
        const double eb = tu_max_abs_diff(b16, ref, n) / scale;
        CHECK(err <= 2.0 * eb + 1e-2, "%s: err %.3g > 2 x %.3g (single bf16) + 1e-2", what, err,
              eb);
    }
}

/* Rank q's results against the single layer's: its tokens [t0, t0 + T),
 * its experts (the q-th E/P of them), its triples [p0, p0 + np). out and
 * g[TU_NGRAD] (the gradients in tu_grads order; biases only with them,
 * dpair_score for GENERAL). */
static TU_UNUSED void ep_check_rank(int q, int NP, const tu_problem *P, const single_res *s64,
                                    const single_res *s16, int bf16, int64_t t0, int64_t T,
                                    int64_t p0, int64_t np, const double *out,
                                    double *const *g) {
    const int64_t d = P->desc.d, n = P->desc.n, El = P->desc.E / NP, hc = P->hc;
    const int general = P->desc.routing == SMOE_ROUTING_GENERAL;
    const struct {
        int gi;
        int64_t off, len;
        int on;
    } part[] = {{TU_GX, t0 * d, T * d, 1},
                {TU_GW1, q * El * hc * d, El * hc * d, 1},
                {TU_GW2, q * El * d * n, El * d * n, 1},
                {TU_GB1, q * El * hc, El * hc, P->b1 != NULL},
                {TU_GB2, q * El * d, El * d, P->b1 != NULL},
                {TU_GPS, p0, np, general && np > 0}};
    char what[64];
    snprintf(what, sizeof what, "rank %d out", q);
    close_enough(what, out, s64->out + t0 * d, bf16 ? s16->out + t0 * d : NULL, (size_t)(T * d),
                 bf16);
    for (size_t i = 0; i < sizeof part / sizeof part[0]; i++) {
        if (!part[i].on) continue;
        const int gi = part[i].gi;
        snprintf(what, sizeof what, "rank %d %s", q, tu_grad_name[gi]);
        close_enough(what, g[gi], s64->g[gi] + part[i].off,
                     bf16 ? s16->g[gi] + part[i].off : NULL, (size_t)part[i].len, bf16);
    }
}

/* The ranks' expert counts summed, and (routed modes) their drouter_w
 * shares summed (dwr[q], E x d), against the single layer's. */
static TU_UNUSED void ep_check_sums(int NP, const tu_problem *P, const single_res *s64,
                                    const single_res *s16, int bf16, double *const *dwr,
                                    const int32_t *const *counts) {
    const int64_t E = P->desc.E, d = P->desc.d;
    int32_t cnt[64] = {0};
    for (int q = 0; q < NP; q++)
        for (int64_t e = 0; e < E; e++) cnt[e] += counts[q][e];
    CHECK(!memcmp(cnt, s64->counts, (size_t)E * 4),
          "expert counts summed over ranks differ from the single layer's");
    if (P->desc.routing == SMOE_ROUTING_GENERAL) return;
    double *sum = tu_alloc_d((size_t)(E * d));
    for (int q = 0; q < NP; q++)
        for (int64_t i = 0; i < E * d; i++) sum[i] += dwr[q][i];
    close_enough("drouter_w (summed over ranks)", sum, s64->g[TU_GWR],
                 bf16 ? s16->g[TU_GWR] : NULL, (size_t)(E * d), bf16);
    free(sum);
}

#endif /* SMOE_TEST_EP_REF_H */
