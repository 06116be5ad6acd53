/*
 * test_cpu_basic.c -- a small self-check of the CPU backend's forward,
 * against a naive per-token loop written here from the layer's definition
 * (smoe.h, DESIGN.md sections 1-2), independent of the library's code:
 *
 *   for each token: logits = Wr x, top-K (larger first, ties to the lower
 *   expert), softmax over those K; for each picked expert: h = W1 x + b1
 *   (gate/up rows read from W1's own layout), a = act(h), y = W2 a + b2;
 *   o = sum_k s_k y_k.
 *
 * Every activation x both W1 layouts x bias on/off x dtype F64, F32, BF16,
 * on a few shapes (odd sizes, K = 1, K = E). F64 must agree to rounding
 * noise, F32 to fp32 rounding, BF16 (every stored intermediate rounded) to
 * bf16 rounding. Also: the router_logits and expert_counts outputs, and
 * that inference and training forwards give the same output.
 * Prints "N passed, M failed"; exits nonzero on failure.
 */
#include "smoe.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_pass, g_fail;

static void check(int ok, const char *what, const char *case_name, double value, double limit)
{
    if (ok) {
        g_pass++;
    } else {
        g_fail++;
        printf("FAIL %s [%s]: %.3e (limit %.3e)\n", what, case_name, value, limit);
    }
}

/* ------------------------------------------------------------ data */

static uint64_t g_state = 12345;
static double urand(void) /* uniform in [-1, 1) */
{
    g_state = g_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_state >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static double from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static size_t esize(smoe_dtype t) { return t == SMOE_DTYPE_BF16 ? 2 : t == SMOE_DTYPE_F32 ? 4 : 8; }

static void put(void *p, smoe_dtype t, size_t i, double v)
{
    if (t == SMOE_DTYPE_BF16) ((uint16_t *)p)[i] = to_bf16((float)v);
    else if (t == SMOE_DTYPE_F32) ((float *)p)[i] = (float)v;
    else ((double *)p)[i] = v;
}

static double get(const void *p, smoe_dtype t, size_t i)
{
    if (t == SMOE_DTYPE_BF16) return from_bf16(((const uint16_t *)p)[i]);
    if (t == SMOE_DTYPE_F32) return ((const float *)p)[i];
    return ((const double *)p)[i];
}

/* A random tensor in dtype t, and its exact values in double. */
static void *rand_tensor(size_t count, smoe_dtype t, double scale, double **exact)
{
    void *p = calloc(count ? count : 1, esize(t));
    *exact = malloc(sizeof(double) * (count ? count : 1));
    for (size_t i = 0; i < count; i++) {
        put(p, t, i, scale * urand());
        (*exact)[i] = get(p, t, i);
    }
    return p;
}

/* ------------------------------------------------------------ naive reference */

static double act_value(smoe_activation a, double x)
{
    const double c = sqrt(2.0 / 3.14159265358979323846);
    switch (a) {
    case SMOE_ACT_SWIGLU: case SMOE_ACT_SILU: return x / (1.0 + exp(-x));
    case SMOE_ACT_GEGLU: case SMOE_ACT_GELU: return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
    case SMOE_ACT_REGLU: case SMOE_ACT_RELU: return x > 0 ? x : 0;
    case SMOE_ACT_RELU2: return x > 0 ? x * x : 0;
    }
    return NAN;
}

static int gated(smoe_activation a)
{
    return a == SMOE_ACT_SWIGLU || a == SMOE_ACT_GEGLU || a == SMOE_ACT_REGLU;
}

typedef struct problem {
    int64_t T, d, n, E, K;
    smoe_activation act;
    smoe_w1_layout layout;
    int bias;
    const double *x, *wr, *w1, *b1, *w2, *b2; /* exact values */
} problem;

/* out (T, d), logits (T, E) as fp32, counts (E). Scores: softmax of the
 * fp32 logits, or of the exact ones for an F64 layer (f64). */
static void naive_forward(const problem *P, int f64, double *out, float *logits, int32_t *counts)
{
    const int64_t d = P->d, n = P->n, E = P->E, K = P->K;
    const int g = gated(P->act);
    const int64_t rows = g ? 2 * n : n;
    double *h = malloc(sizeof(double) * rows), *a = malloc(sizeof(double) * n);
    int *picked = malloc(sizeof(int) * E);
    int64_t *sel = malloc(sizeof(int64_t) * K);
    double *s = malloc(sizeof(double) * K), *l64 = malloc(sizeof(double) * E);
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t t = 0; t < P->T; t++) {
        const double *x = P->x + t * d;
        for (int64_t e = 0; e < E; e++) {
            double l = 0;
            for (int64_t i = 0; i < d; i++) l += P->wr[e * d + i] * x[i];
            logits[t * E + e] = (float)l; /* the selection reads fp32 logits */
            l64[e] = f64 ? l : (double)(float)l; /* F64 scores: exact logits */
            picked[e] = 0;
        }
        for (int64_t k = 0; k < K; k++) { /* largest not yet picked; ties: lower index */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!picked[e] && (best < 0 || logits[t * E + e] > logits[t * E + best])) best = e;
            picked[best] = 1;
            sel[k] = best;
            counts[best]++;
        }
        double m = l64[sel[0]], z = 0;
        for (int64_t k = 0; k < K; k++) z += exp(l64[sel[k]] - m);
        for (int64_t k = 0; k < K; k++) s[k] = exp(l64[sel[k]] - m) / z;
        for (int64_t i = 0; i < d; i++) out[t * d + i] = 0;
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = sel[k];
            for (int64_t r = 0; r < rows; r++) {
                double v = P->bias ? P->b1[e * rows + r] : 0;
                for (int64_t i = 0; i < d; i++) v += P->w1[(e * rows + r) * d + i] * x[i];
                h[r] = v;
            }
            for (int64_t j = 0; j < n; j++) {
                if (!g) {
                    a[j] = act_value(P->act, h[j]);
                } else if (P->layout == SMOE_W1_INTERLEAVED) {
                    a[j] = act_value(P->act, h[2 * j]) * h[2 * j + 1];
                } else {
                    a[j] = act_value(P->act, h[j]) * h[n + j];
                }
            }
            for (int64_t i = 0; i < d; i++) {
                double y = P->bias ? P->b2[e * d + i] : 0;
                for (int64_t j = 0; j < n; j++) y += P->w2[(e * d + i) * n + j] * a[j];
                out[t * d + i] += s[k] * y;
            }
        }
    }
    free(h);
    free(a);
    free(picked);
    free(sel);
    free(s);
    free(l64);
}

/* ------------------------------------------------------------ one case */

static void run_case(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, smoe_activation act,
                     smoe_w1_layout layout, int bias, smoe_dtype dt)
{
    char name[160];
    static const char *acts[] = {"swiglu", "geglu", "reglu", "relu2", "relu", "silu", "gelu"};
    static const char *dts[] = {"f32", "bf16", "f64"};
    snprintf(name, sizeof name, "T=%lld d=%lld n=%lld E=%lld K=%lld %s %s bias=%d %s",
             (long long)T, (long long)d, (long long)n, (long long)E, (long long)K, acts[act],
             layout == SMOE_W1_INTERLEAVED ? "interleaved" : "concatenated", bias, dts[dt]);

    smoe_layer_desc desc = smoe_layer_desc_default();
    desc.d = d;
    desc.n = n;
    desc.E = E;
    desc.K = K;
    desc.activation = act;
    desc.w1_layout = layout;
    desc.has_bias = bias;
    desc.dtype = dt;
    desc.backend = SMOE_BACKEND_CPU;
    smoe_layer *layer = NULL;
    smoe_status st = smoe_layer_create(&desc, &layer);
    check(st == SMOE_SUCCESS, "create", name, st, 0);
    if (st != SMOE_SUCCESS) return;

    const int64_t rows = gated(act) ? 2 * n : n;
    problem P = {T, d, n, E, K, act, layout, bias, NULL, NULL, NULL, NULL, NULL, NULL};
    double *ex, *ewr, *ew1, *eb1, *ew2, *eb2;
    void *x = rand_tensor((size_t)(T * d), dt, 1.0, &ex);
    void *wr = rand_tensor((size_t)(E * d), dt, 1.0, &ewr);
    void *w1 = rand_tensor((size_t)(E * rows * d), dt, 1.0 / sqrt((double)d), &ew1);
    void *b1 = rand_tensor((size_t)(E * rows), dt, 0.5, &eb1);
    void *w2 = rand_tensor((size_t)(E * d * n), dt, 1.0 / sqrt((double)n), &ew2);
    void *b2 = rand_tensor((size_t)(E * d), dt, 0.5, &eb2);
    P.x = ex;
    P.wr = ewr;
    P.w1 = ew1;
    P.b1 = eb1;
    P.w2 = ew2;
    P.b2 = eb2;

    size_t wsb = smoe_layer_workspace_bytes(layer, T, 0), svb = smoe_layer_saved_bytes(layer, T, 0);
    void *ws = aligned_alloc(64, (wsb + 63) / 64 * 64), *saved = aligned_alloc(64, (svb + 63) / 64 * 64);
    void *out = calloc((size_t)(T * d), esize(dt)), *out2 = calloc((size_t)(T * d), esize(dt));
    float *logits = calloc((size_t)(T * E), sizeof(float));
    int32_t *counts = calloc((size_t)E, sizeof(int32_t));

    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T;
    fa.x = x;
    fa.router_w = wr;
    fa.w1 = w1;
    fa.w2 = w2;
    fa.b1 = bias ? b1 : NULL;
    fa.b2 = bias ? b2 : NULL;
    fa.out = out;
    fa.router_logits = logits;
    fa.expert_counts = counts;
    st = smoe_layer_forward(layer, &fa, saved, svb, ws, wsb, NULL);
    check(st == SMOE_SUCCESS, "forward", name, st, 0);
    if (st != SMOE_SUCCESS) printf("  %s\n", smoe_last_error());

    double *ref = malloc(sizeof(double) * (size_t)(T * d));
    float *ref_logits = malloc(sizeof(float) * (size_t)(T * E));
    int32_t *ref_counts = malloc(sizeof(int32_t) * (size_t)E);
    naive_forward(&P, dt == SMOE_DTYPE_F64, ref, ref_logits, ref_counts);

    double num = 0, den = 0;
    for (int64_t i = 0; i < T * d; i++) {
        double e = fabs(get(out, dt, (size_t)i) - ref[i]);
        if (e > num || e != e) num = e;
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    double rel = num / (den > 0 ? den : 1);
    double tol = dt == SMOE_DTYPE_F64 ? 1e-12 : dt == SMOE_DTYPE_F32 ? 2e-5 : 3e-2;
    check(rel <= tol, "out vs naive loop", name, rel, tol);

    double lerr = 0;
    for (int64_t i = 0; i < T * E; i++) {
        double e = fabs((double)logits[i] - (double)ref_logits[i]) / (fabs((double)ref_logits[i]) + 1e-3);
        if (e > lerr) lerr = e;
    }
    check(lerr <= 1e-6, "router_logits", name, lerr, 1e-6);
    int cnt_ok = 1;
    for (int64_t e = 0; e < E; e++) cnt_ok &= counts[e] == ref_counts[e];
    check(cnt_ok, "expert_counts", name, 0, 0);

    /* inference: nothing saved, the same output bit for bit */
    fa.inference = 1;
    fa.out = out2;
    fa.router_logits = NULL;
    fa.expert_counts = NULL;
    st = smoe_layer_forward(layer, &fa, NULL, 0, ws, wsb, NULL);
    check(st == SMOE_SUCCESS && !memcmp(out, out2, (size_t)(T * d) * esize(dt)),
          "inference == training output", name, st, 0);

    free(ref);
    free(ref_logits);
    free(ref_counts);
    free(ws);
    free(saved);
    free(out);
    free(out2);
    free(logits);
    free(counts);
    void *bufs[] = {x, wr, w1, b1, w2, b2, ex, ewr, ew1, eb1, ew2, eb2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    smoe_layer_free(layer);
}

int main(void)
{
    static const int64_t shapes[][5] = {
        /* T, d, n, E, K */
        {13, 24, 10, 6, 2},
        {1, 8, 4, 3, 1},   /* T = 1, K = 1 */
        {7, 16, 6, 4, 4},  /* K = E */
        {33, 40, 12, 9, 3},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int act = SMOE_ACT_SWIGLU; act <= SMOE_ACT_GELU; act++)
            for (int layout = 0; layout <= 1; layout++)
                for (int bias = 0; bias <= 1; bias++)
                    for (int dt = 0; dt <= 2; dt++)
                        run_case(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3],
                                 shapes[s][4], (smoe_activation)act, (smoe_w1_layout)layout, bias,
                                 (smoe_dtype)dt);
    printf("test_cpu_basic: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
