/*
 * test_gradcheck.c -- every gradient of the CPU backend against central
 * finite differences, in double precision (SMOE_DTYPE_F64 layers).
 *
 * Loss: L = <G, O> + <G2, X Wr^T> (the second term only for the router
 * modes; its gradient reaches the library as dlogits_extra = G2). The test
 * perturbs every element of X, Wr, W1, b1, W2, b2 and, for GENERAL routing,
 * the pair scores, runs the training forward twice, and compares
 * (L+ - L-) / 2 eps with the backward's gradient.
 *
 * Covered: each routing mode (TOPK_SOFTMAX, SOFTMAX_TOPK with and without
 * renormalisation, GENERAL, token rounding up/down/nearest, SIGMOID_TOPK
 * with expert bias, groups, renormalisation and scaling) x each
 * activation x both W1 layouts (gated ones) x bias on/off. Selections are
 * discrete: problems are redrawn until the logits (and the token-rounding
 * keys) have no near-tie at a selection boundary and, for the ReLU family,
 * no pre-activation is near the kink, so a perturbation of eps cannot change
 * the function's branch.
 *
 * Also: the dS identity (GENERAL dpair_score = <dO_t, Y_r> with Y computed
 * naively here), the accumulate flag (old + grad) for every gradient,
 * one gradient requested alone, and bf16 and fp32 layers with fp32
 * gradients against the fp64 layer on the same rounded inputs (bf16 also
 * against its own bf16 gradients).
 */
#include "testutil.h"

#include <omp.h>

/* ------------------------------------------------------------ margins */

/* Smallest distance from a selection boundary or a ReLU-family kink. */
static double problem_margin(tu_problem *P) {
    const smoe_layer_desc *D = &P->desc;
    double m = tu_selection_margin(P);
    smoe_activation a = D->activation;
    if (a == SMOE_ACT_RELU || a == SMOE_ACT_RELU2 || a == SMOE_ACT_REGLU) {
        tu_problem_route(P, 0);
        double *h = tu_alloc_d((size_t)P->hc);
        for (int64_t i = 0; i < P->pairs; i++) {
            tu_expert(P, P->pe[i], P->x + (int64_t)P->pt[i] * D->d, h, NULL);
            for (int64_t j = 0; j < P->hc; j++) {
                int is_gate = !tu_gated(a) || (D->w1_layout == SMOE_W1_INTERLEAVED ? j % 2 == 0 : j < D->n);
                if (is_gate) m = fmin(m, fabs(h[j]));
            }
        }
        free(h);
    }
    return m;
}

/* ------------------------------------------------------------ the check */

typedef struct fd_ctx {
    smoe_layer *L;
    tu_problem *P;
    tu_bufs *B;
    const double *G, *G2;
} fd_ctx;

static double loss(fd_ctx *c) {
    smoe_forward_args fa = tu_fwd_args(c->P, c->B, 0);
    smoe_status st = smoe_layer_forward(c->L, &fa, c->B->saved, c->B->saved_bytes, c->B->ws,
                                        c->B->ws_bytes, NULL);
    if (st != SMOE_SUCCESS) return NAN;
    const smoe_layer_desc *D = &c->P->desc;
    int64_t T = c->P->T, d = D->d, E = D->E;
    const double *o = (const double *)c->B->out, *x = (const double *)c->B->x,
                 *wr = (const double *)c->B->wr;
    double s = 0;
    for (int64_t i = 0; i < T * d; i++) s += c->G[i] * o[i];
    if (D->routing != SMOE_ROUTING_GENERAL)
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++) {
                double l = 0;
                for (int64_t k = 0; k < d; k++) l += x[t * d + k] * wr[e * d + k];
                s += c->G2[t * E + e] * l;
            }
    return s;
}

/* finite differences of one double tensor */
static void fd_tensor(fd_ctx *c, double *p, size_t n, double eps, double *fd) {
    for (size_t i = 0; i < n; i++) {
        double v = p[i];
        p[i] = v + eps;
        double lp = loss(c);
        p[i] = v - eps;
        double lm = loss(c);
        p[i] = v;
        fd[i] = (lp - lm) / (2 * eps);
    }
}

static void fd_scores(fd_ctx *c, float *p, size_t n, double eps, double *fd) {
    for (size_t i = 0; i < n; i++) {
        float v = p[i];
        float hi = (float)(v + eps), lo = (float)(v - eps);
        p[i] = hi;
        double lp = loss(c);
        p[i] = lo;
        double lm = loss(c);
        p[i] = v;
        fd[i] = (lp - lm) / ((double)hi - (double)lo);
    }
}

static int64_t n_configs, n_redrawn;

static void gradcheck(tu_rng *rng, smoe_layer_desc D, int64_t T, double prob) {
    tu_problem P;
    int64_t tries = 0;
    for (;;) {
        tu_problem_init(&P, &D, T, rng, 1.0, 0.6);
        if (D.routing == SMOE_ROUTING_GENERAL) tu_problem_general(&P, rng, prob);
        if (problem_margin(&P) > 2e-3) break;
        tu_problem_free(&P);
        n_redrawn++;
        if (++tries == 200) {
            CHECK(0, "no problem without near-ties after 200 draws");
            return;
        }
    }
    n_configs++;
    smoe_layer *L = tu_layer(&D);
    if (!L) { tu_problem_free(&P); return; }
    int64_t d = D.d, E = D.E;
    double *G = tu_alloc_d((size_t)(T * d)), *G2 = tu_alloc_d((size_t)(T * E));
    tu_fill_normal(rng, G, (size_t)(T * d), 1.0);
    tu_fill_normal(rng, G2, (size_t)(T * E), 0.3);
    tu_round_array(SMOE_DTYPE_F32, G2, (size_t)(T * E));
    float *G2f = (float *)malloc((size_t)(T * E) * sizeof(float));
    for (int64_t i = 0; i < T * E; i++) G2f[i] = (float)G2[i];
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, &P, SMOE_DTYPE_F64);
    /* the backward must overwrite: pre-fill with garbage */
    for (int i = 0; i < TU_NGRAD; i++)
        for (size_t j = 0; j < g.n[i]; j++) tu_store(g.dt[i], g.g[i], j, 1e3);
    if (tu_run_backward(L, &P, &B, G, G2f, &g, 0)) {
        /* Thousands of forwards of a few microseconds each: on one thread,
         * so that OpenMP start-up does not dominate on a busy machine (the
         * results are the same whatever the thread count: test_saved). */
        int nthr = omp_get_max_threads();
        omp_set_num_threads(1);
        fd_ctx c = {L, &P, &B, G, G2};
        void *tens[TU_NGRAD] = {B.x, B.wr, B.w1, B.b1, B.w2, B.b2, B.pscore};
        for (int i = 0; i < TU_NGRAD; i++) {
            if (!g.n[i]) continue;
            double *an = tu_grad_d(&g, i), *fd = tu_alloc_d(g.n[i]);
            if (i == TU_GPS) {
                fd_scores(&c, (float *)tens[i], g.n[i], 1e-3, fd);
                CHECK_CLOSE(an, fd, g.n[i], 1e-5, tu_grad_name[i]); /* fp32 output */
            } else {
                fd_tensor(&c, (double *)tens[i], g.n[i], 1e-5, fd);
                CHECK_CLOSE(an, fd, g.n[i], 1e-6, tu_grad_name[i]);
            }
            free(an);
            free(fd);
        }
        omp_set_num_threads(nthr);
    }
    tu_grads_free(&g);
    tu_bufs_free(&B);
    free(G); free(G2); free(G2f);
    smoe_layer_free(L);
    tu_problem_free(&P);
}

static smoe_layer_desc mode_desc(int mode) {
    smoe_layer_desc D = smoe_layer_desc_default();
    D.dtype = SMOE_DTYPE_F64;
    D.backend = SMOE_BACKEND_CPU;
    D.round_tile = 2;
    tu_set_mode(&D, mode);
    return D;
}

static void test_all_modes(tu_rng *rng) {
    for (int mode = 0; mode < TU_NMODES; mode++)
        for (int act = 0; act < 7; act++)
            for (int layout = 0; layout < 2; layout++)
                for (int bias = 0; bias < 2; bias++) {
                    if (layout && !tu_gated((smoe_activation)act)) continue;
                    smoe_layer_desc D = mode_desc(mode);
                    D.activation = (smoe_activation)act;
                    D.w1_layout = layout ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
                    D.has_bias = bias;
                    /* shapes vary with the case: K=1, K=E and not-round sizes */
                    int v = (act + bias + layout) % 3;
                    D.d = v == 0 ? 4 : v == 1 ? 5 : 3;
                    D.n = v == 0 ? 3 : v == 1 ? 2 : 3;
                    D.E = v == 2 ? 3 : 4;
                    D.K = v == 0 ? 2 : v == 1 ? 1 : 3;
                    if (D.rounding != SMOE_ROUND_OFF && D.K == D.E) D.K = 2;
                    if (mode == 10) tu_set_groups(&D);
                    int64_t T = v == 1 ? 6 : 5;
                    tu_case("gradcheck %s act=%s layout=%s bias=%d T=%lld d=%lld n=%lld E=%lld K=%lld",
                            tu_mode_name(&D), tu_act_name(D.activation),
                            layout ? "concat" : "interleaved", bias, (long long)T, (long long)D.d,
                            (long long)D.n, (long long)D.E, (long long)D.K);
                    gradcheck(rng, D, T, 0.5);
                }
}

/* Random small shapes and settings (T=1, E=1, K=E, d=1 and n=1 included). */
static void test_random_configs(tu_rng *rng) {
    for (int it = 0; it < 30; it++) {
        const int mode = (int)tu_int(rng, 0, TU_NMODES - 1);
        smoe_layer_desc D = mode_desc(mode);
        D.activation = (smoe_activation)tu_int(rng, 0, 6);
        D.w1_layout = tu_int(rng, 0, 1) ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
        D.has_bias = (int)tu_int(rng, 0, 1);
        D.d = tu_int(rng, 1, 6);
        D.n = tu_int(rng, 1, 4);
        D.E = tu_int(rng, 1, 5);
        D.K = tu_int(rng, 1, D.E);
        D.round_tile = tu_int(rng, 1, 4);
        if (mode == 10) tu_set_groups(&D);
        int64_t T = tu_int(rng, 1, 7);
        tu_case("gradcheck random it %d %s act=%s layout=%d bias=%d T=%lld d=%lld n=%lld E=%lld "
                "K=%lld M=%lld",
                it, tu_mode_name(&D), tu_act_name(D.activation), D.w1_layout, D.has_bias,
                (long long)T, (long long)D.d, (long long)D.n, (long long)D.E, (long long)D.K,
                (long long)D.round_tile);
        gradcheck(rng, D, T, 0.6);
    }
}

/* SIGMOID_TOPK with larger E: groups (several kept of several), the bias
 * moving the selection, renormalisation on and off, scaling, K = E. */
static void test_sigmoid(tu_rng *rng) {
    static const struct { int64_t E, K, G, g; int renorm; double c; } cs[] = {
        {8, 3, 4, 2, 1, 2.5}, {8, 3, 4, 2, 0, 1.0}, {8, 2, 2, 1, 1, 1.0}, {6, 4, 3, 2, 0, 0.7},
        {6, 6, 3, 3, 1, 1.5}, {8, 4, 4, 4, 1, 1.0}, {5, 2, 0, 0, 1, 16.0}, {4, 4, 2, 2, 0, 3.0},
    };
    for (int i = 0; i < (int)(sizeof cs / sizeof cs[0]); i++) {
        smoe_layer_desc D = mode_desc(9);
        D.activation = (smoe_activation)(i % 7);
        D.has_bias = i % 2;
        D.d = 4; D.n = 3;
        D.E = cs[i].E; D.K = cs[i].K;
        D.n_group = cs[i].G; D.topk_group = cs[i].g;
        D.renormalize = cs[i].renorm;
        D.routed_scaling = cs[i].c;
        int64_t T = 5 + i % 3;
        tu_case("gradcheck sigmoid E=%lld K=%lld groups %lld/%lld renorm=%d scale=%g act=%s "
                "bias=%d T=%lld",
                (long long)D.E, (long long)D.K, (long long)D.topk_group, (long long)D.n_group,
                D.renormalize, D.routed_scaling, tu_act_name(D.activation), D.has_bias,
                (long long)T);
        gradcheck(rng, D, T, 0.5);
    }
}

/* ------------------------------------------------------------ dS identity */

static void test_ds_identity(tu_rng *rng) {
    for (int it = 0; it < 8; it++) {
        smoe_layer_desc D = mode_desc(3);
        D.dtype = it < 4 ? SMOE_DTYPE_F64 : SMOE_DTYPE_F32;
        D.activation = (smoe_activation)(it % 7);
        D.has_bias = it % 2;
        D.w1_layout = (it / 2) % 2 ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
        D.d = 9; D.n = 5; D.E = 5;
        int64_t T = 7;
        tu_case("dS identity it %d dtype=%d act=%s bias=%d", it, D.dtype, tu_act_name(D.activation),
                D.has_bias);
        tu_problem P;
        tu_problem_init(&P, &D, T, rng, 1.0, 0.5);
        tu_problem_general(&P, rng, 0.6);
        smoe_layer *L = tu_layer(&D);
        if (!L) { tu_problem_free(&P); continue; }
        double *G = tu_alloc_d((size_t)(T * D.d));
        tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
        tu_round_array(D.dtype, G, (size_t)(T * D.d));
        void *Gb = tu_to_dtype(D.dtype, G, (size_t)(T * D.d));
        tu_bufs B;
        tu_bufs_make(&B, &P, L, 0);
        tu_grads g;
        tu_grads_alloc(&g, &P, D.dtype);
        if (tu_run_backward(L, &P, &B, Gb, NULL, &g, 0)) {
            double *want = tu_alloc_d((size_t)P.pairs + 1), *y = tu_alloc_d((size_t)D.d);
            for (int64_t i = 0; i < P.pairs; i++) {
                tu_expert(&P, P.pe[i], P.x + (int64_t)P.pt[i] * D.d, NULL, y);
                for (int64_t c = 0; c < D.d; c++) want[i] += G[(int64_t)P.pt[i] * D.d + c] * y[c];
            }
            double *got = tu_grad_d(&g, TU_GPS);
            CHECK_CLOSE(got, want, (size_t)P.pairs, D.dtype == SMOE_DTYPE_F64 ? 1e-6 : 1e-5,
                        "dpair_score vs <dO_t, Y_r>");
            free(got); free(want); free(y);
        }
        tu_grads_free(&g);
        tu_bufs_free(&B);
        free(G); free(Gb);
        smoe_layer_free(L);
        tu_problem_free(&P);
    }
}

/* ------------------------------------------------------------ accumulate */

static void test_accumulate(tu_rng *rng) {
    for (int mode = 0; mode < TU_NMODES; mode++) {
        for (int bf = 0; bf < 5; bf++) {
            /* layer dtype / weight-grad dtype: F64/F64, BF16/F32 (main-grad),
             * F32/F32, BF16/BF16, F64/F32 */
            smoe_layer_desc D = mode_desc(mode);
            D.dtype = bf == 0 || bf == 4 ? SMOE_DTYPE_F64 : bf == 2 ? SMOE_DTYPE_F32 : SMOE_DTYPE_BF16;
            D.activation = (smoe_activation)(mode % 7);
            D.has_bias = 1;
            D.d = 6; D.n = 4; D.E = 4; D.K = 2;
            int64_t T = 9;
            /* F64 layer: tu_grads in F64; bf16 layer: fp32 main-grads */
            smoe_dtype wdt = bf == 0 ? SMOE_DTYPE_F64 : bf == 3 ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
            /* the gradient problem: dtype-rounded inputs */
            tu_case("accumulate %s layer dtype=%d grad dtype=%d", tu_mode_name(&D), D.dtype, wdt);
            tu_fixture F;
            if (!tu_fixture_make(&F, &D, T, rng, 0.5, 0.5)) continue;
            double *G = tu_alloc_d((size_t)(T * D.d));
            tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
            void *Gb = tu_to_dtype(D.dtype, G, (size_t)(T * D.d));
            float *G2 = (float *)malloc((size_t)(T * D.E) * sizeof(float));
            for (int64_t i = 0; i < T * D.E; i++) G2[i] = (float)(0.3 * tu_normal(rng));
            tu_grads g, ga;
            tu_grads_alloc(&g, &F.P, wdt);
            tu_grads_alloc(&ga, &F.P, wdt);
            double *old[TU_NGRAD];
            for (int i = 0; i < TU_NGRAD; i++) {
                old[i] = tu_alloc_d(g.n[i] + 1);
                tu_fill_normal(rng, old[i], g.n[i], 1.0);
                tu_round_array(ga.dt[i], old[i], g.n[i]);
                for (size_t j = 0; j < g.n[i]; j++) tu_store(ga.dt[i], ga.g[i], j, old[i][j]);
            }
            if (tu_run_backward(F.L, &F.P, &F.B, Gb, G2, &g, 0) && tu_run_backward(F.L, &F.P, &F.B, Gb, G2, &ga, 1)) {
                for (int i = 0; i < TU_NGRAD; i++) {
                    if (!g.n[i]) continue;
                    double *a = tu_grad_d(&g, i), *b = tu_grad_d(&ga, i);
                    for (size_t j = 0; j < g.n[i]; j++) a[j] += old[i][j];
                    /* dx is in the layer's dtype: bf16 rounding of the sum */
                    double tol = ga.dt[i] == SMOE_DTYPE_BF16 ? 8e-3 : ga.dt[i] == SMOE_DTYPE_F32 ? 1e-6 : 1e-12;
                    char what[64];
                    snprintf(what, sizeof what, "%s accumulate", tu_grad_name[i]);
                    CHECK_CLOSE(b, a, g.n[i], tol, what);
                    free(a); free(b);
                }
            }
            for (int i = 0; i < TU_NGRAD; i++) free(old[i]);
            tu_grads_free(&g); tu_grads_free(&ga);
            free(G); free(Gb); free(G2);
            tu_fixture_free(&F);
        }
    }
}

/* ------------------------------------------------------------ partial requests */

/* Asking for one gradient alone (the others NULL) gives exactly what the
 * full request gives. */
static void test_partial(tu_rng *rng) {
    for (int mode = 0; mode < TU_NMODES; mode++) {
        smoe_layer_desc D = mode_desc(mode);
        D.dtype = mode % 2 ? SMOE_DTYPE_F32 : SMOE_DTYPE_F64;
        D.activation = (smoe_activation)((mode + 1) % 7);
        D.has_bias = 1;
        D.d = 7; D.n = 5; D.E = 4; D.K = 2; D.round_tile = 3;
        int64_t T = 10;
        tu_case("partial gradient requests %s dtype=%d", tu_mode_name(&D), D.dtype);
        tu_fixture F;
        if (!tu_fixture_make(&F, &D, T, rng, 0.5, 0.5)) continue;
        double *G = tu_alloc_d((size_t)(T * D.d));
        tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
        void *Gb = tu_to_dtype(D.dtype, G, (size_t)(T * D.d));
        float *G2 = (float *)malloc((size_t)(T * D.E) * sizeof(float));
        for (int64_t i = 0; i < T * D.E; i++) G2[i] = (float)(0.3 * tu_normal(rng));
        tu_grads full;
        tu_grads_alloc(&full, &F.P, D.dtype);
        if (tu_run_backward(F.L, &F.P, &F.B, Gb, G2, &full, 0)) {
            for (int i = 0; i < TU_NGRAD; i++) {
                if (!full.n[i]) continue;
                tu_grads one;
                tu_grads_alloc(&one, &F.P, D.dtype);
                for (int j = 0; j < TU_NGRAD; j++)
                    if (j != i) { free(one.g[j]); one.g[j] = NULL; }
                if (tu_run_backward(F.L, &F.P, &F.B, Gb, G2, &one, 0))
                    CHECK(memcmp(one.g[i], full.g[i], full.n[i] * tu_dtype_size(full.dt[i])) == 0,
                          "%s alone differs from %s in the full request", tu_grad_name[i], tu_grad_name[i]);
                tu_grads_free(&one);
            }
        }
        tu_grads_free(&full);
        free(G); free(Gb); free(G2);
        tu_fixture_free(&F);
    }
}

/* ------------------------------------------------------------ bf16 layer, fp32 grads */

/* A bf16 or fp32 layer against the fp64 layer on the same (rounded) inputs,
 * its weight gradients in fp32 (main-grad) and, for bf16, also in bf16,
 * which must be the fp32 ones rounded (within an ulp or two). */
static void test_lowp_grads(tu_rng *rng) {
    for (int it = 0; it < 2 * TU_NMODES; it++) {
        int mode = it % TU_NMODES;
        smoe_dtype dt = it < TU_NMODES ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
        smoe_layer_desc D = mode_desc(mode);
        D.dtype = dt;
        D.activation = (smoe_activation)((it + 3) % 7);
        D.has_bias = it % 2;
        D.w1_layout = it % 3 == 0 ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
        D.d = 16; D.n = 8; D.E = 4; D.K = 2; D.round_tile = 4;
        int64_t T = 12;
        tu_case("%s layer, fp32 grads %s act=%s", dt == SMOE_DTYPE_BF16 ? "bf16" : "fp32",
                tu_mode_name(&D), tu_act_name(D.activation));
        tu_problem P;
        int tries = 0;
        for (;;) { /* a low-precision router must not sit on a near-tie either */
            tu_problem_init(&P, &D, T, rng, 1.0, 0.4);
            if (D.routing == SMOE_ROUTING_GENERAL) tu_problem_general(&P, rng, 0.5);
            if (problem_margin(&P) > 0.05 || ++tries > 100) break;
            tu_problem_free(&P);
        }
        smoe_layer_desc D64 = D;
        D64.dtype = SMOE_DTYPE_F64;
        tu_problem P64 = P; /* the same rounded values in an F64 layer */
        P64.desc = D64;
        smoe_layer *L = tu_layer(&D), *L64 = tu_layer(&D64);
        if (L && L64) {
            double *G = tu_alloc_d((size_t)(T * D.d));
            tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
            tu_round_array(dt, G, (size_t)(T * D.d));
            void *Gb = tu_to_dtype(dt, G, (size_t)(T * D.d));
            float *G2 = (float *)malloc((size_t)(T * D.E) * sizeof(float));
            for (int64_t i = 0; i < T * D.E; i++) G2[i] = (float)tu_round_bf16(0.3 * tu_normal(rng));
            tu_bufs B, B64;
            tu_bufs_make(&B, &P, L, 0);
            tu_bufs_make(&B64, &P64, L64, 0);
            tu_grads g32, g16, g64;
            tu_grads_alloc(&g32, &P, SMOE_DTYPE_F32);
            tu_grads_alloc(&g16, &P, dt);
            tu_grads_alloc(&g64, &P64, SMOE_DTYPE_F64);
            if (tu_run_backward(L, &P, &B, Gb, G2, &g32, 0) && tu_run_backward(L, &P, &B, Gb, G2, &g16, 0) &&
                tu_run_backward(L64, &P64, &B64, G, G2, &g64, 0)) {
                for (int i = 0; i < TU_NGRAD; i++) {
                    if (!g32.n[i]) continue;
                    double *a = tu_grad_d(&g32, i), *b = tu_grad_d(&g16, i), *r = tu_grad_d(&g64, i);
                    char what[80];
                    snprintf(what, sizeof what, "%s (fp32 grad) vs fp64 layer", tu_grad_name[i]);
                    CHECK_CLOSE(a, r, g32.n[i], dt == SMOE_DTYPE_BF16 ? 3e-2 : 1e-4, what);
                    if (dt == SMOE_DTYPE_BF16) {
                        snprintf(what, sizeof what, "%s bf16 grad vs fp32 grad", tu_grad_name[i]);
                        CHECK_CLOSE(b, a, g32.n[i], 1.6e-2, what);
                    }
                    free(a); free(b); free(r);
                }
            }
            tu_grads_free(&g32); tu_grads_free(&g16); tu_grads_free(&g64);
            tu_bufs_free(&B);
            tu_bufs_free(&B64);
            free(G); free(Gb); free(G2);
        }
        smoe_layer_free(L);
        smoe_layer_free(L64);
        tu_problem_free(&P);
    }
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 7));
    test_all_modes(&rng);
    test_random_configs(&rng);
    test_sigmoid(&rng);
    test_ds_identity(&rng);
    test_accumulate(&rng);
    test_partial(&rng);
    test_lowp_grads(&rng);
    printf("gradcheck: %lld configurations (%lld draws redrawn for near-ties/kinks)\n",
           (long long)n_configs, (long long)n_redrawn);
    return tu_summary("test_gradcheck");
}
