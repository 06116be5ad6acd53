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

static TU_UNUSED void single_run(const tu_problem *P0, const double *dout, smoe_dtype dt, single_res *s) {
    tu_problem P = *P0;
    P.desc.dtype = dt;
    P.desc.backend = SMOE_BACKEND_CPU;
    smoe_layer *L = tu_layer(&P.desc);
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, &P, dt == SMOE_DTYPE_F64 ? SMOE_DTYPE_F64 : SMOE_DTYPE_F32);
    void *G = tu_to_dtype(dt, dout, (size_t)(P.T * P.desc.d));
    tu_run_backward(L, &P, &B, G, NULL, &g, 0);
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

#endif /* SMOE_TEST_EP_REF_H */
