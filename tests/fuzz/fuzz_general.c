/*
 * fuzz_general.c -- GENERAL triples (tokens, experts and scores from the
 * input: out of range, unsorted, repeated, NaN and infinite among them)
 * through a small CPU layer. Oracle: the call succeeds exactly when the
 * triples keep smoe.h's rules (token in [0, T), expert in [0, E), tokens
 * sorted, each (token, expert) once, finite scores), checked here
 * independently; a refused call writes nothing; an accepted one gives what
 * the tests' naive double reference (testutil.h) gives, and its backward
 * runs.
 */
#include "fuzz_util.h"
#include "testutil.h"

static int triples_ok(const int32_t *pt, const int32_t *pe, const float *ps, int64_t np,
                      int64_t T, int64_t E) {
    for (int64_t i = 0; i < np; i++) {
        if (pt[i] < 0 || pt[i] >= T || pe[i] < 0 || pe[i] >= E || !isfinite(ps[i])) return 0;
        if (i > 0 && pt[i] < pt[i - 1]) return 0;
        for (int64_t j = i - 1; j >= 0 && pt[j] == pt[i]; j--)
            if (pe[j] == pe[i]) return 0;
    }
    return 1;
}

/* tu_forward_ref of P with every input, weight and score replaced by its
 * absolute value: the size of the terms the forward sums. */
static void forward_ref_abs(const tu_problem *P, double *ref)
{
    const smoe_layer_desc *D = &P->desc;
    const size_t d = (size_t)D->d, n = (size_t)D->n, E = (size_t)D->E, hc = (size_t)P->hc;
    tu_problem A = *P;
    const double *src[6] = {P->x, P->w1, P->b1, P->w2, P->b2, P->ps};
    const size_t len[6] = {(size_t)P->T * d, E * hc * d, E * hc, E * d * n, E * d,
                           (size_t)P->pairs};
    double *dst[6];
    for (int k = 0; k < 6; k++) {
        dst[k] = NULL;
        if (!src[k]) continue;
        dst[k] = tu_alloc_d(len[k] + 1);
        for (size_t i = 0; i < len[k]; i++) dst[k][i] = fabs(src[k][i]);
    }
    A.x = dst[0]; A.w1 = dst[1]; A.b1 = dst[2]; A.w2 = dst[3]; A.b2 = dst[4]; A.ps = dst[5];
    tu_forward_ref(&A, ref);
    for (int k = 0; k < 6; k++) free(dst[k]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz r = {data, size};
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = fz_range(&r, 1, 6);
    D.n = fz_range(&r, 1, 4);
    D.E = fz_range(&r, 1, 6);
    D.K = 0;
    D.routing = SMOE_ROUTING_GENERAL;
    D.activation = (smoe_activation)(int)fz_range(&r, 0, 6);
    D.has_bias = (int)(fz_u8(&r) & 1);
    D.dtype = SMOE_DTYPE_F64; /* exact, so the reference can be tight */
    D.backend = SMOE_BACKEND_CPU;
    const int64_t T = fz_range(&r, 1, 8), E = D.E;
    int64_t np = fz_range(&r, 0, T * E + 2);
    if (np > T * E) np = T * E; /* more is a size error, tested by fuzz_layer */
    int32_t *pt = (int32_t *)malloc((size_t)np * 4 + 4), *pe = (int32_t *)malloc((size_t)np * 4 + 4);
    float *ps = (float *)malloc((size_t)np * 4 + 4);
    /* mostly valid: sorted tokens, distinct experts; then some damage */
    int64_t t = 0, e = 0;
    for (int64_t i = 0; i < np; i++) {
        if (e >= E || (fz_u8(&r) & 3) == 0) { t++; e = 0; }
        if (t >= T) t = T - 1;
        e += fz_range(&r, 0, 1);
        pt[i] = (int32_t)t;
        pe[i] = (int32_t)(e < E ? e : E - 1);
        e++;
        ps[i] = ((float)fz_u8(&r) + 1.0f) / 256.0f;
    }
    const int damage = (int)fz_range(&r, 0, 4);
    for (int k = 0; k < damage && np > 0; k++) {
        const int64_t i = fz_range(&r, 0, np - 1);
        switch (fz_u8(&r) % 4) {
        case 0: pt[i] = (int32_t)fz_range(&r, -2, T + 1); break;
        case 1: pe[i] = (int32_t)fz_range(&r, -2, E + 1); break;
        default: ps[i] = fz_float(&r); break;
        }
    }

    smoe_layer *L = NULL;
    FZ_CHECK(smoe_layer_create(&D, &L) == SMOE_SUCCESS, "create");
    tu_problem P;
    tu_rng rng = tu_rng_make(fz_bits(&r, 8));
    tu_problem_init(&P, &D, T, &rng, 1.0, 0.5);
    const size_t sb = smoe_layer_saved_bytes(L, T, np), wb = smoe_layer_workspace_bytes(L, T, np);
    void *saved = malloc(sb), *ws = malloc(wb);
    double *out = (double *)malloc((size_t)(T * D.d) * 8);
    memset(out, 0xA5, (size_t)(T * D.d) * 8);
    smoe_forward_args a;
    memset(&a, 0, sizeof a);
    a.T = T; a.x = P.x; a.pairs = np; a.pair_token = pt; a.pair_expert = pe; a.pair_score = ps;
    a.w1 = P.w1; a.b1 = P.b1; a.w2 = P.w2; a.b2 = P.b2; a.out = out;
    smoe_status st = smoe_layer_forward(L, &a, saved, sb, ws, wb, NULL);
    const int ok = triples_ok(pt, pe, ps, np, T, E);
    if (!ok) {
        FZ_CHECK(st == SMOE_ERROR_INVALID_VALUE, "bad triples: status %s", smoe_status_string(st));
        for (int64_t i = 0; i < T * D.d * 8; i++)
            FZ_CHECK(((unsigned char *)out)[i] == 0xA5, "a refused forward wrote out");
    } else {
        FZ_CHECK(st == SMOE_SUCCESS, "valid triples refused: %s", smoe_status_string(st));
        P.pairs = np;
        P.pt = (int32_t *)malloc((size_t)np * 4 + 4);
        P.pe = (int32_t *)malloc((size_t)np * 4 + 4);
        P.ps = tu_alloc_d((size_t)np + 1);
        for (int64_t i = 0; i < np; i++) {
            P.pt[i] = pt[i];
            P.pe[i] = pe[i];
            P.ps[i] = ps[i];
        }
        double *ref = tu_alloc_d((size_t)(T * D.d));
        tu_forward_ref(&P, ref);
        /* The sums' own size, not the result's: the same layer on the
         * absolute values of every input, weight and score. Where the terms
         * cancel, the result is far smaller than they are, and two exact
         * fp64 summation orders then differ by more than 1e-12 of it
         * (1.7e-18 against a result of 2.3e-7: a finding of CI's fuzz). */
        double *ref_abs = tu_alloc_d((size_t)(T * D.d));
        forward_ref_abs(&P, ref_abs);
        const double scale = tu_max_abs(ref, (size_t)(T * D.d)) +
                             tu_max_abs(ref_abs, (size_t)(T * D.d)) + 1e-300;
        FZ_CHECK(tu_max_abs_diff(out, ref, (size_t)(T * D.d)) <= 1e-12 * scale + 1e-300,
                 "out differs from the reference by %g (scale %g)",
                 tu_max_abs_diff(out, ref, (size_t)(T * D.d)), scale);
        free(ref_abs);
        free(ref);
        /* the backward of an accepted forward runs */
        double *dx = (double *)malloc((size_t)(T * D.d) * 8);
        float *dps = (float *)malloc((size_t)np * 4 + 4);
        smoe_backward_args b;
        memset(&b, 0, sizeof b);
        b.T = T; b.x = P.x; b.pairs = np; b.w1 = P.w1; b.w2 = P.w2; b.b2 = P.b2; b.dout = P.x;
        b.dx = (smoe_grad){dx, SMOE_DTYPE_F64, 0};
        b.dpair_score = (smoe_grad){np ? dps : NULL, SMOE_DTYPE_F32, 0};
        FZ_CHECK(smoe_layer_backward(L, &b, saved, sb, ws, wb, NULL) == SMOE_SUCCESS, "backward");
        free(dx);
        free(dps);
    }
    tu_problem_free(&P);
    free(out); free(saved); free(ws); free(pt); free(pe); free(ps);
    smoe_layer_free(L);
    return 0;
}
