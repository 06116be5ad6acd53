/*
 * test_nonfinite.c -- NaN and infinities on the CPU backend (smoe.h,
 * "Non-finite values"): one NaN or +inf put into x (one token), the router
 * weight (one expert), W1 or W2 (one element of one expert) or dout (one
 * token), for TOPK_SOFTMAX and SOFTMAX_TOPK, in F64.
 *  - The forward's output against the tests' naive reference (testutil.h,
 *    NaN ranked first as torch.topk ranks it): non-finite in exactly the
 *    same places, equal elsewhere.
 *  - What the damage must not reach stays bit for bit as in the clean run:
 *    other tokens' outputs and dx rows (x, dout), the outputs of tokens not
 *    routed to the damaged expert (W1, W2).
 *  - A NaN logit: its token's output and dx are all NaN.
 * python/tests/test_nonfinite.py compares the same cases with PyTorch, and
 * tests/gpu/test_nonfinite_gpu the GPU backends with this one.
 */
#include "testutil.h"

enum { INJ_X, INJ_WR, INJ_W1, INJ_W2, INJ_DOUT, INJ_N };
static const char *inj_name[INJ_N] = {"x", "router_w", "w1", "w2", "dout"};

typedef struct run {
    double *out, *dx, *dw1;
    int32_t *expert; /* (T, K) routed experts, from the saved block's order */
} run;

static void run_free(run *r) { free(r->out); free(r->dx); free(r->dw1); free(r->expert); }

static void layer_run(const smoe_layer_desc *D, const tu_problem *P, const double *dout, run *r) {
    smoe_layer *L = tu_layer(D);
    if (!L) return;
    tu_bufs B;
    tu_bufs_make(&B, P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, P, SMOE_DTYPE_F64);
    tu_run_backward(L, P, &B, dout, NULL, &g, 0);
    const int64_t T = P->T, d = D->d, E = D->E, K = D->K;
    r->out = tu_from_dtype(D->dtype, B.out, (size_t)(T * d));
    r->dx = tu_grad_d(&g, TU_GX);
    r->dw1 = tu_grad_d(&g, TU_GW1);
    /* each token's experts, by the CPU routing of the layer's own logits */
    r->expert = (int32_t *)malloc((size_t)(T * K) * 4);
    float *sc = (float *)malloc((size_t)(T * K) * 4);
    smoe_routing_result res;
    memset(&res, 0, sizeof res);
    res.expert = r->expert;
    res.score = sc;
    CHECK_OK(smoe_route_cpu(D, T, B.logits, &res));
    (void)E;
    free(sc);
    tu_grads_free(&g);
    tu_bufs_free(&B);
    smoe_layer_free(L);
}

static int routed_to(const run *r, int64_t t, int64_t K, int64_t e) {
    for (int64_t k = 0; k < K; k++)
        if (r->expert[t * K + k] == e) return 1;
    return 0;
}

static int rows_equal(const double *a, const double *b, int64_t t, int64_t d) {
    return !memcmp(a + t * d, b + t * d, (size_t)d * sizeof(double));
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 41));
    for (int mode = 0; mode < 2; mode++)
        for (int inj = 0; inj < INJ_N; inj++)
            for (int nan = 0; nan < 2; nan++) {
                smoe_layer_desc D = smoe_layer_desc_default();
                D.d = 12; D.n = 6; D.E = 6; D.K = 2;
                D.has_bias = 1;
                D.routing = mode ? SMOE_ROUTING_SOFTMAX_TOPK : SMOE_ROUTING_TOPK_SOFTMAX;
                D.renormalize = 1;
                D.dtype = SMOE_DTYPE_F64;
                D.backend = SMOE_BACKEND_CPU;
                const int64_t T = 9, d = D.d, K = D.K, t = 4, e = 2;
                tu_problem P;
                tu_problem_init(&P, &D, T, &rng, 1.0, 0.5);
                double *dout = tu_alloc_d((size_t)(T * d));
                tu_fill_normal(&rng, dout, (size_t)(T * d), 1.0);
                tu_case("%s: %s in %s, clean run", tu_mode_name(&D), nan ? "NaN" : "+inf",
                        inj_name[inj]);
                run clean = {0}, bad = {0};
                layer_run(&D, &P, dout, &clean);
                const double v = nan ? NAN : INFINITY;
                switch (inj) {
                case INJ_X: P.x[t * d + 3] = v; break;
                case INJ_WR: P.wr[e * d + 5] = v; break;
                case INJ_W1: P.w1[(e * P.hc + 1) * d + 2] = v; break;
                case INJ_W2: P.w2[(e * d + 4) * D.n + 1] = v; break;
                default: dout[t * d + 6] = v; break;
                }
                tu_case("%s: %s in %s", tu_mode_name(&D), nan ? "NaN" : "+inf", inj_name[inj]);
                layer_run(&D, &P, dout, &bad);
                if (!clean.out || !bad.out) {
                    run_free(&clean);
                    run_free(&bad);
                    continue;
                }
                /* the forward against the naive reference */
                tu_problem_route(&P, 0);
                double *ref = tu_alloc_d((size_t)(T * d));
                tu_forward_ref(&P, ref);
                size_t first = (size_t)-1;
                double err = 0.0, scale = 0.0;
                for (int64_t i = 0; i < T * d; i++) {
                    if (!!isfinite(ref[i]) != !!isfinite(bad.out[i]) && first == (size_t)-1)
                        first = (size_t)i;
                    if (isfinite(ref[i]) && isfinite(bad.out[i])) {
                        err = fmax(err, fabs(ref[i] - bad.out[i]));
                        scale = fmax(scale, fabs(ref[i]));
                    }
                }
                CHECK(first == (size_t)-1, "out[%zu] = %g, the reference has %g", first,
                      first == (size_t)-1 ? 0.0 : bad.out[first],
                      first == (size_t)-1 ? 0.0 : ref[first]);
                CHECK(err <= 1e-12 * (scale + 1.0), "out differs from the reference by %g", err);
                free(ref);
                /* what the damage must not reach */
                int reached = 0;
                for (int64_t u = 0; u < T; u++) {
                    if (inj == INJ_X || inj == INJ_DOUT) {
                        if (u == t) continue;
                        if (!rows_equal(bad.dx, clean.dx, u, d)) reached |= 1;
                        if (!rows_equal(bad.out, clean.out, u, d)) reached |= 2;
                    } else if (inj == INJ_W1 || inj == INJ_W2) {
                        if (routed_to(&clean, u, K, e)) continue;
                        if (!rows_equal(bad.out, clean.out, u, d)) reached |= 2;
                    }
                }
                CHECK(!(reached & 1), "another token's dx changed");
                CHECK(!(reached & 2), "an output the damage cannot reach changed");
                /* a NaN logit (x NaN: all of the token's logits) */
                if (inj == INJ_X && nan) {
                    int all = 1;
                    for (int64_t c = 0; c < d; c++) all &= isnan(bad.out[t * d + c]) && isnan(bad.dx[t * d + c]);
                    CHECK(all, "a token with NaN logits: its out and dx rows are not all NaN");
                    CHECK(bad.expert[t * K] == 0 && bad.expert[t * K + 1] == 1,
                          "all-NaN logits pick experts %d, %d (want 0, 1: NaN first, ties to the "
                          "lower expert)",
                          bad.expert[t * K], bad.expert[t * K + 1]);
                }
                if (inj == INJ_WR && nan) {
                    /* every token's logit e is NaN: every token picks e first */
                    int first_e = 1;
                    for (int64_t u = 0; u < T; u++) first_e &= bad.expert[u * K] == e;
                    CHECK(first_e, "a NaN router weight row: not every token picks its expert first");
                }
                run_free(&clean);
                run_free(&bad);
                free(dout);
                tu_problem_free(&P);
            }
    return tu_summary("test_nonfinite");
}
