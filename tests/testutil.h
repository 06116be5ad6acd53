/*
 * testutil.h -- helpers shared by the C tests (header only).
 *
 *   - a seeded RNG (splitmix64) and fill helpers;
 *   - bf16 conversion and rounding, typed load/store for smoe_dtype buffers;
 *   - error measures (max abs, relative to the reference's max);
 *   - CHECK(): records pass/fail; a failure prints the seed, the current
 *     case (tu_case()) and the message; tu_summary() prints
 *     "N passed, M failed" and returns the exit code;
 *   - tu_tally: element checks |got - ref| <= tol of one output, counted,
 *     the first few failures printed;
 *   - the activations f and f' (tu_act1, tu_act1_d);
 *   - an independent naive reference of the layer (routing, token rounding,
 *     forward) in double precision, written from DESIGN.md and smoe.h, not
 *     from the library's code.
 *
 * C11, and C++ for the CUDA tests (nvcc), which add tests/gpu/testutil_cuda.h
 * (CUDA checks, device buffers, fills). Every test program takes an optional
 * seed as argv[1] (default fixed), so a failure can be replayed with the seed
 * it prints.
 */
#ifndef SMOE_TESTUTIL_H
#define SMOE_TESTUTIL_H

#include "smoe.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define TU_UNUSED __attribute__((unused))
#define TU_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define TU_UNUSED
#define TU_PRINTF(a, b)
#endif

/* ------------------------------------------------------------ RNG */

typedef struct tu_rng {
    uint64_t s;
} tu_rng;

static TU_UNUSED tu_rng tu_rng_make(uint64_t seed) {
    tu_rng r;
    r.s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    return r;
}

static TU_UNUSED uint64_t tu_next(tu_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) with 53 random bits */
static TU_UNUSED double tu_uniform(tu_rng *r) {
    return (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* uniform in [lo, hi) */
static TU_UNUSED double tu_range(tu_rng *r, double lo, double hi) {
    return lo + (hi - lo) * tu_uniform(r);
}

/* integer uniform in [lo, hi] */
static TU_UNUSED int64_t tu_int(tu_rng *r, int64_t lo, int64_t hi) {
    return lo + (int64_t)(tu_next(r) % (uint64_t)(hi - lo + 1));
}

static TU_UNUSED double tu_normal(tu_rng *r) {
    double u1 = tu_uniform(r), u2 = tu_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ------------------------------------------------------------ bf16 */

static TU_UNUSED uint16_t tu_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static TU_UNUSED float tu_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static TU_UNUSED double tu_round_bf16(double x) {
    return (double)tu_bf16_to_f32(tu_f32_to_bf16((float)x));
}

static TU_UNUSED double tu_round_dtype(smoe_dtype t, double x) {
    if (t == SMOE_DTYPE_BF16) return tu_round_bf16(x);
    if (t == SMOE_DTYPE_F32) return (double)(float)x;
    return x;
}

static TU_UNUSED size_t tu_dtype_size(smoe_dtype t) {
    return t == SMOE_DTYPE_F64 ? 8 : t == SMOE_DTYPE_F32 ? 4 : 2;
}

/* typed element access into a buffer of dtype t */
static TU_UNUSED double tu_load(smoe_dtype t, const void *p, size_t i) {
    if (t == SMOE_DTYPE_F64) return ((const double *)p)[i];
    if (t == SMOE_DTYPE_F32) return ((const float *)p)[i];
    return tu_bf16_to_f32(((const uint16_t *)p)[i]);
}

static TU_UNUSED void tu_store(smoe_dtype t, void *p, size_t i, double v) {
    if (t == SMOE_DTYPE_F64) ((double *)p)[i] = v;
    else if (t == SMOE_DTYPE_F32) ((float *)p)[i] = (float)v;
    else ((uint16_t *)p)[i] = tu_f32_to_bf16((float)v);
}

/* A double array -> a new buffer of dtype t (caller frees). */
static TU_UNUSED void *tu_to_dtype(smoe_dtype t, const double *src, size_t n) {
    void *p = malloc(n * tu_dtype_size(t) + 1);
    for (size_t i = 0; i < n; i++) tu_store(t, p, i, src[i]);
    return p;
}

static TU_UNUSED double *tu_from_dtype(smoe_dtype t, const void *src, size_t n) {
    double *p = (double *)malloc(n * sizeof(double) + 1);
    for (size_t i = 0; i < n; i++) p[i] = tu_load(t, src, i);
    return p;
}

/* ------------------------------------------------------------ fill */

static TU_UNUSED void tu_fill_uniform(tu_rng *r, double *p, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) p[i] = tu_range(r, lo, hi);
}

static TU_UNUSED void tu_fill_normal(tu_rng *r, double *p, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) p[i] = scale * tu_normal(r);
}

/* Rounds a double array in place to what dtype t can hold, so a reference
 * computed on it sees exactly the library's inputs. */
static TU_UNUSED void tu_round_array(smoe_dtype t, double *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = tu_round_dtype(t, p[i]);
}

static TU_UNUSED double *tu_alloc_d(size_t n) {
    double *p = (double *)calloc(n ? n : 1, sizeof(double));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

/* ------------------------------------------------------------ errors */

static TU_UNUSED double tu_max_abs(const double *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
    return m;
}

static TU_UNUSED double tu_max_abs_diff(const double *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(a[i] - b[i]);
        if (e != e) return INFINITY; /* NaN */
        m = fmax(m, e);
    }
    return m;
}

/* max |a - ref| / max |ref| (0 if both are all zero) */
static TU_UNUSED double tu_rel_err(const double *a, const double *ref, size_t n) {
    double num = tu_max_abs_diff(a, ref, n), den = tu_max_abs(ref, n);
    if (num == 0) return 0;
    return den > 0 ? num / den : INFINITY;
}

/* Index of the worst element of |a - ref| (for messages). */
static TU_UNUSED size_t tu_argmax_diff(const double *a, const double *ref, size_t n) {
    size_t best = 0;
    double m = -1;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(a[i] - ref[i]);
        if (e != e) return i;
        if (e > m) { m = e; best = i; }
    }
    return best;
}

/* ------------------------------------------------------------ tallies */

/* Element checks of one output: |got - ref| <= tol (a NaN fails), the
 * relative Frobenius error over the finite values, the worst err / tol; the
 * first five failures are printed with their index. rtol and atol give
 * tu_tally_rt's tolerance, rtol |ref| + atol. */
typedef struct tu_tally {
    const char *what;
    double rtol, atol;
    long long count, bad, nonfinite;
    double err2, ref2, worst, max_excess;
} tu_tally;

static TU_UNUSED tu_tally tu_tally_make(const char *what, double rtol, double atol) {
    tu_tally t;
    memset(&t, 0, sizeof t);
    t.what = what;
    t.rtol = rtol;
    t.atol = atol;
    return t;
}

static TU_UNUSED int tu_tally_add(tu_tally *t, double got, double ref, double tol, long long idx) {
    double err = fabs(got - ref);
    int ok = err <= tol;
    t->count++;
    if (!ok) {
        if (t->bad < 5)
            fprintf(stderr, "  %s[%lld]: got %.6g ref %.6g tol %.3g\n", t->what, idx, got, ref,
                    tol);
        t->bad++;
        if (err - tol > t->max_excess) t->max_excess = err - tol;
    }
    if (!isfinite(got)) {
        t->nonfinite++;
        return ok;
    }
    t->err2 += err * err;
    t->ref2 += ref * ref;
    if (tol > 0 && err / tol > t->worst) t->worst = err / tol;
    return ok;
}

/* the tally's own tolerance, rtol |ref| + atol */
static TU_UNUSED int tu_tally_rt(tu_tally *t, double got, double ref, long long idx) {
    return tu_tally_add(t, got, ref, t->rtol * fabs(ref) + t->atol, idx);
}

/* sqrt(sum err^2 / sum ref^2) over the finite values */
static TU_UNUSED double tu_tally_rel(const tu_tally *t) {
    return t->ref2 > 0 ? sqrt(t->err2 / t->ref2) : sqrt(t->err2);
}

/* ------------------------------------------------------------ checks */

static int tu_npass, tu_nfail;
static uint64_t tu_seed;
static char tu_case_buf[512];

static TU_UNUSED TU_PRINTF(1, 2) void tu_case(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tu_case_buf, sizeof tu_case_buf, fmt, ap);
    va_end(ap);
}

static TU_UNUSED TU_PRINTF(4, 5) int tu_check(int ok, const char *file, int line,
                                                const char *fmt, ...) {
    if (ok) {
        tu_npass++;
        return 1;
    }
    tu_nfail++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s:%d seed=%llu case=[%s]: ", file, line,
            (unsigned long long)tu_seed, tu_case_buf);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 0;
}

/* CHECK(condition, "printf message", ...): returns the condition's truth. */
#define CHECK(cond, ...) tu_check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

/* CHECK_OK(call): the call must return SMOE_SUCCESS. */
#define CHECK_OK(call)                                                                    \
    do {                                                                                  \
        smoe_status st_ = (call);                                                         \
        CHECK(st_ == SMOE_SUCCESS, "%s -> %s (%s)", #call, smoe_status_string(st_),       \
              smoe_last_error());                                                         \
    } while (0)

/* CHECK_CLOSE(a, ref, n, tol, what): relative error (to ref's max) <= tol. */
#define CHECK_CLOSE(a, ref, n, tol, what)                                                 \
    do {                                                                                  \
        const double *a_ = (a), *r_ = (ref);                                              \
        size_t n_ = (n);                                                                  \
        double e_ = tu_rel_err(a_, r_, n_), t_ = (tol);                                   \
        size_t i_ = tu_argmax_diff(a_, r_, n_);                                           \
        CHECK(e_ <= t_, "%s: rel err %.3g > %.3g (worst at %zu: got %.10g want %.10g)",   \
              (what), e_, t_, i_, n_ ? a_[i_] : 0.0, n_ ? r_[i_] : 0.0);                  \
    } while (0)

/* The seed from argv[1] (default: def). */
static TU_UNUSED uint64_t tu_init(int argc, char **argv, uint64_t def) {
    tu_seed = def;
    if (argc > 1) tu_seed = strtoull(argv[1], NULL, 0);
    return tu_seed;
}

/* Prints "N passed, M failed" on its own line; returns the exit code. */
static TU_UNUSED int tu_summary(const char *name) {
    fprintf(stdout, "%s (seed %llu)\n", name, (unsigned long long)tu_seed);
    fprintf(stdout, "%d passed, %d failed\n", tu_npass, tu_nfail);
    fflush(stdout);
    return tu_nfail ? 1 : 0;
}

/* ------------------------------------------------------------ reference */

/* The reference problem: everything in double, shapes in a desc. */
typedef struct tu_problem {
    smoe_layer_desc desc;
    int64_t T, hc;     /* hc: rows of W1 per expert (2n gated, n otherwise) */
    double *x;         /* (T, d) */
    double *wr;        /* (E, d) */
    double *w1;        /* (E, hc, d) */
    double *b1;        /* (E, hc)  or NULL */
    double *w2;        /* (E, d, n) */
    double *b2;        /* (E, d)   or NULL */
    /* routed pairs (token-major: token ascending, then expert ascending) */
    int64_t pairs;
    int32_t *pt, *pe;
    double *ps;
    double *ebias;     /* (E) SIGMOID_TOPK's expert bias (fp32 values) or NULL */
} tu_problem;

static TU_UNUSED int tu_gated(smoe_activation a) {
    return a == SMOE_ACT_SWIGLU || a == SMOE_ACT_GEGLU || a == SMOE_ACT_REGLU;
}

static TU_UNUSED double tu_silu(double x) { return x / (1.0 + exp(-x)); }
static TU_UNUSED double tu_gelu(double x) {
    const double c = 0.7978845608028654; /* sqrt(2/pi) */
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}
static TU_UNUSED double tu_relu(double x) { return x <= 0 ? 0 : x; } /* NaN stays NaN */

static TU_UNUSED double tu_act1(smoe_activation a, double x) {
    switch (a) {
    case SMOE_ACT_SWIGLU: case SMOE_ACT_SILU: return tu_silu(x);
    case SMOE_ACT_GEGLU: case SMOE_ACT_GELU: return tu_gelu(x);
    case SMOE_ACT_REGLU: case SMOE_ACT_RELU: return tu_relu(x);
    case SMOE_ACT_RELU2: return tu_relu(x) * tu_relu(x);
    }
    return NAN;
}

/* f' of tu_act1 (the gate function's where gated) */
static TU_UNUSED double tu_act1_d(smoe_activation a, double x) {
    switch (a) {
    case SMOE_ACT_SWIGLU: case SMOE_ACT_SILU: {
        double s = 1.0 / (1.0 + exp(-x));
        return s * (1.0 + x * (1.0 - s));
    }
    case SMOE_ACT_GEGLU: case SMOE_ACT_GELU: {
        const double c = 0.7978845608028654;
        double th = tanh(c * (x + 0.044715 * x * x * x));
        return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case SMOE_ACT_REGLU: case SMOE_ACT_RELU: return x > 0 ? 1.0 : 0.0;
    case SMOE_ACT_RELU2: return 2.0 * tu_relu(x);
    }
    return NAN;
}

/* h (hc values, W1's row order) -> a (n values) */
static TU_UNUSED void tu_activate(const smoe_layer_desc *D, const double *h, double *a) {
    int64_t n = D->n;
    for (int64_t j = 0; j < n; j++) {
        if (!tu_gated(D->activation)) {
            a[j] = tu_act1(D->activation, h[j]);
        } else if (D->w1_layout == SMOE_W1_INTERLEAVED) {
            a[j] = tu_act1(D->activation, h[2 * j]) * h[2 * j + 1];
        } else {
            a[j] = tu_act1(D->activation, h[j]) * h[n + j];
        }
    }
}

/* Expert e on token row x: h (hc), a (n), y (d). Any may be NULL except
 * their use as scratch is then internal. */
static TU_UNUSED void tu_expert(const tu_problem *P, int64_t e, const double *x, double *h_out,
                                double *y_out) {
    const smoe_layer_desc *D = &P->desc;
    int64_t d = D->d, n = D->n, hc = P->hc;
    double *h = tu_alloc_d((size_t)hc), *a = tu_alloc_d((size_t)n);
    for (int64_t i = 0; i < hc; i++) {
        double s = P->b1 ? P->b1[e * hc + i] : 0.0;
        const double *w = P->w1 + ((size_t)e * hc + i) * d;
        for (int64_t c = 0; c < d; c++) s += w[c] * x[c];
        h[i] = s;
    }
    tu_activate(D, h, a);
    if (h_out) memcpy(h_out, h, (size_t)hc * sizeof(double));
    if (y_out) {
        for (int64_t i = 0; i < d; i++) {
            double s = P->b2 ? P->b2[e * d + i] : 0.0;
            const double *w = P->w2 + ((size_t)e * d + i) * n;
            for (int64_t j = 0; j < n; j++) s += w[j] * a[j];
            y_out[i] = s;
        }
    }
    free(h);
    free(a);
}

/* logits = X Wr^T (T, E) */
static TU_UNUSED void tu_logits(const tu_problem *P, double *logits) {
    int64_t d = P->desc.d, E = P->desc.E;
    for (int64_t t = 0; t < P->T; t++)
        for (int64_t e = 0; e < E; e++) {
            double s = 0;
            for (int64_t c = 0; c < d; c++) s += P->x[t * d + c] * P->wr[e * d + c];
            logits[t * E + e] = s;
        }
}

/* The K largest of row[0..E) in descending order, ties to the lower index;
 * NaN above every number (as torch.topk ranks it). */
static TU_UNUSED void tu_topk(const double *row, int64_t E, int64_t K, int32_t *idx) {
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= idx[j] == e;
            if (taken) continue;
            if (best < 0 || (isnan(row[e]) && !isnan(row[best])) ||
                (!isnan(row[best]) && row[e] > row[best]))
                best = e;
        }
        idx[k] = (int32_t)best;
    }
}

static TU_UNUSED void tu_softmax(const double *row, int64_t E, double *p) {
    double m = row[0], s = 0;
    for (int64_t e = 1; e < E; e++) m = fmax(m, row[e]);
    for (int64_t e = 0; e < E; e++) s += (p[e] = exp(row[e] - m));
    for (int64_t e = 0; e < E; e++) p[e] /= s;
}

static TU_UNUSED double tu_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* SIGMOID_TOPK's selection of one row of logits, the naive way (Hugging
 * Face's DeepseekV3 router): key = sigmoid + bias; groups keyed by the sum
 * of their 2 best keys, the topk_group best kept, the others' keys -inf;
 * the K best keys. margin (optional): the smallest gap at a selection
 * boundary (K-th vs (K+1)-th key, topk_group-th vs next group key). */
static TU_UNUSED void tu_sigmoid_select(const smoe_layer_desc *D, const double *row,
                                        const double *bias, int32_t *idx, double *margin) {
    int64_t E = D->E, K = D->K, G = D->n_group, g = D->topk_group;
    double *key = tu_alloc_d((size_t)E), m = INFINITY;
    int32_t *all = (int32_t *)malloc((size_t)E * sizeof(int32_t));
    for (int64_t e = 0; e < E; e++) key[e] = tu_sigmoid(row[e]) + (bias ? bias[e] : 0.0);
    if (G > 0) {
        int64_t gs = E / G;
        double *gk = tu_alloc_d((size_t)G);
        int32_t two[2];
        for (int64_t q = 0; q < G; q++) {
            tu_topk(key + q * gs, gs, 2, two);
            gk[q] = key[q * gs + two[0]] + key[q * gs + two[1]];
        }
        tu_topk(gk, G, G, all);
        if (g < G) m = fmin(m, gk[all[g - 1]] - gk[all[g]]);
        for (int64_t j = g; j < G; j++)
            for (int64_t e = all[j] * gs; e < (all[j] + 1) * gs; e++) key[e] = -INFINITY;
        free(gk);
    }
    tu_topk(key, E, K < E ? K + 1 : K, all);
    for (int64_t k = 0; k < K; k++) idx[k] = all[k];
    if (K < E && key[all[K]] > -INFINITY) m = fmin(m, key[all[K - 1]] - key[all[K]]);
    if (margin) *margin = m;
    free(key);
    free(all);
}

/* Token choice: expert (T, K) and score (T, K), descending score (for
 * SIGMOID_TOPK: descending key); bias: SIGMOID_TOPK's (E) or NULL. */
static TU_UNUSED void tu_route_tc_bias(const smoe_layer_desc *D, int64_t T, const double *logits,
                                       const double *bias, int32_t *expert, double *score) {
    int64_t E = D->E, K = D->K;
    double *p = tu_alloc_d((size_t)E);
    for (int64_t t = 0; t < T; t++) {
        const double *row = logits + t * E;
        int32_t *ex = expert + t * K;
        double *sc = score + t * K;
        if (D->routing == SMOE_ROUTING_SIGMOID_TOPK) {
            tu_sigmoid_select(D, row, bias, ex, NULL);
            double z = 0;
            for (int64_t k = 0; k < K; k++) z += (sc[k] = tu_sigmoid(row[ex[k]]));
            for (int64_t k = 0; k < K; k++)
                sc[k] = (D->renormalize ? sc[k] / (z + 1e-20) : sc[k]) * D->routed_scaling;
            continue;
        }
        tu_topk(row, E, K, ex);
        if (D->routing == SMOE_ROUTING_SOFTMAX_TOPK && !D->renormalize) {
            tu_softmax(row, E, p);
            for (int64_t k = 0; k < K; k++) sc[k] = p[ex[k]];
        } else { /* softmax over the K selected logits == renormalised top-K probabilities */
            double m = row[ex[0]], s = 0;
            for (int64_t k = 0; k < K; k++) s += (sc[k] = exp(row[ex[k]] - m));
            for (int64_t k = 0; k < K; k++) sc[k] /= s;
        }
    }
    free(p);
}

static TU_UNUSED void tu_route_tc(const smoe_layer_desc *D, int64_t T, const double *logits,
                                  int32_t *expert, double *score) {
    tu_route_tc_bias(D, T, logits, NULL, expert, score);
}

static TU_UNUSED int64_t tu_round_target(smoe_rounding r, int64_t f, int64_t M, int64_t T) {
    int64_t t;
    if (r == SMOE_ROUND_UP) t = (f + M - 1) / M * M;
    else if (r == SMOE_ROUND_DOWN) t = f / M * M;
    else t = (2 * f + M) / (2 * M) * M; /* nearest, ties up: floor(f/M + 1/2) */
    return t < T ? t : T;
}

/* Token rounding (DESIGN.md section 2). Writes up to T*E triples sorted by
 * token then expert; returns their number. key_gap (optional): the smallest
 * gap between the keys of the last kept and the first dropped token of any
 * expert (how far the selection is from changing). */
static TU_UNUSED int64_t tu_route_tr(const smoe_layer_desc *D, int64_t T, const double *logits,
                                     int32_t *pt, int32_t *pe, double *ps, double *key_gap) {
    int64_t E = D->E, K = D->K, M = D->round_tile;
    double *p = tu_alloc_d((size_t)(T * E)), *key = tu_alloc_d((size_t)(T * E));
    double *sc = tu_alloc_d((size_t)(T * E));
    char *keep = (char *)calloc((size_t)(T * E), 1);
    int32_t *ex = (int32_t *)malloc((size_t)K * sizeof(int32_t));
    int64_t *f = (int64_t *)calloc((size_t)E, sizeof(int64_t));
    int32_t *order = (int32_t *)malloc((size_t)T * sizeof(int32_t));
    double gap = INFINITY;
    for (int64_t t = 0; t < T; t++) {
        tu_softmax(logits + t * E, E, p + t * E);
        for (int64_t e = 0; e < E; e++) {
            key[t * E + e] = p[t * E + e] - 1.0;
            sc[t * E + e] = p[t * E + e];
        }
        tu_topk(p + t * E, E, K, ex);
        double s = 0;
        for (int64_t k = 0; k < K; k++) s += p[t * E + ex[k]];
        for (int64_t k = 0; k < K; k++) {
            key[t * E + ex[k]] = sc[t * E + ex[k]] = p[t * E + ex[k]] / s;
            f[ex[k]]++;
        }
    }
    for (int64_t e = 0; e < E; e++) {
        int64_t target = tu_round_target(D->rounding, f[e], M, T);
        /* stable selection sort of tokens by key descending (ties: lower token) */
        for (int64_t t = 0; t < T; t++) order[t] = (int32_t)t;
        for (int64_t i = 0; i < T; i++) {
            int64_t b = i;
            for (int64_t j = i + 1; j < T; j++) {
                double kj = key[order[j] * E + e], kb = key[order[b] * E + e];
                if (kj > kb || (kj == kb && order[j] < order[b])) b = j;
            }
            int32_t tmp = order[i]; order[i] = order[b]; order[b] = tmp;
        }
        for (int64_t i = 0; i < target; i++) keep[order[i] * E + e] = 1;
        if (target > 0 && target < T)
            gap = fmin(gap, key[order[target - 1] * E + e] - key[order[target] * E + e]);
    }
    int64_t np = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++)
            if (keep[t * E + e]) {
                pt[np] = (int32_t)t; pe[np] = (int32_t)e; ps[np] = sc[t * E + e]; np++;
            }
    if (key_gap) *key_gap = gap;
    free(p); free(key); free(sc); free(keep); free(ex); free(f); free(order);
    return np;
}

/* Fills P->pairs/pt/pe/ps from the reference routing of P (token-choice
 * modes and token rounding; GENERAL problems keep their triples). */
static TU_UNUSED void tu_problem_route(tu_problem *P, int inference) {
    const smoe_layer_desc *D = &P->desc;
    if (D->routing == SMOE_ROUTING_GENERAL) return;
    int64_t T = P->T, E = D->E, K = D->K;
    double *lg = tu_alloc_d((size_t)(T * E));
    tu_logits(P, lg);
    free(P->pt); free(P->pe); free(P->ps);
    P->pt = (int32_t *)malloc((size_t)(T * E) * sizeof(int32_t));
    P->pe = (int32_t *)malloc((size_t)(T * E) * sizeof(int32_t));
    P->ps = tu_alloc_d((size_t)(T * E));
    if (D->rounding != SMOE_ROUND_OFF && !inference) {
        P->pairs = tu_route_tr(D, T, lg, P->pt, P->pe, P->ps, NULL);
    } else {
        int32_t *ex = (int32_t *)malloc((size_t)(T * K) * sizeof(int32_t));
        double *sc = tu_alloc_d((size_t)(T * K));
        tu_route_tc_bias(D, T, lg, P->ebias, ex, sc);
        P->pairs = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++)
                for (int64_t k = 0; k < K; k++)
                    if (ex[t * K + k] == e) {
                        P->pt[P->pairs] = (int32_t)t; P->pe[P->pairs] = (int32_t)e;
                        P->ps[P->pairs] = sc[t * K + k]; P->pairs++;
                    }
        free(ex); free(sc);
    }
    free(lg);
}

/* out (T, d) = sum over pairs of score * expert(x_t). */
static TU_UNUSED void tu_forward_ref(const tu_problem *P, double *out) {
    int64_t d = P->desc.d;
    double *y = tu_alloc_d((size_t)d);
    memset(out, 0, (size_t)(P->T * d) * sizeof(double));
    for (int64_t i = 0; i < P->pairs; i++) {
        tu_expert(P, P->pe[i], P->x + (int64_t)P->pt[i] * d, NULL, y);
        for (int64_t c = 0; c < d; c++) out[(int64_t)P->pt[i] * d + c] += P->ps[i] * y[c];
    }
    free(y);
}

/* Allocates the problem's arrays (random, normal * scale) for desc and T;
 * rounds them to desc.dtype so the reference sees the library's inputs. */
static TU_UNUSED void tu_problem_init(tu_problem *P, const smoe_layer_desc *D, int64_t T,
                                      tu_rng *r, double xscale, double wscale) {
    memset(P, 0, sizeof *P);
    P->desc = *D;
    P->T = T;
    P->hc = tu_gated(D->activation) ? 2 * D->n : D->n;
    int64_t d = D->d, n = D->n, E = D->E, hc = P->hc;
    P->x = tu_alloc_d((size_t)(T * d));
    P->wr = tu_alloc_d((size_t)(E * d));
    P->w1 = tu_alloc_d((size_t)(E * hc * d));
    P->w2 = tu_alloc_d((size_t)(E * d * n));
    tu_fill_normal(r, P->x, (size_t)(T * d), xscale);
    tu_fill_normal(r, P->wr, (size_t)(E * d), 1.0);
    tu_fill_normal(r, P->w1, (size_t)(E * hc * d), wscale);
    tu_fill_normal(r, P->w2, (size_t)(E * d * n), wscale);
    if (D->has_bias) {
        P->b1 = tu_alloc_d((size_t)(E * hc));
        P->b2 = tu_alloc_d((size_t)(E * d));
        tu_fill_normal(r, P->b1, (size_t)(E * hc), 0.5);
        tu_fill_normal(r, P->b2, (size_t)(E * d), 0.5);
    }
    smoe_dtype t = D->dtype;
    tu_round_array(t, P->x, (size_t)(T * d));
    tu_round_array(t, P->wr, (size_t)(E * d));
    tu_round_array(t, P->w1, (size_t)(E * hc * d));
    tu_round_array(t, P->w2, (size_t)(E * d * n));
    if (P->b1) {
        tu_round_array(t, P->b1, (size_t)(E * hc));
        tu_round_array(t, P->b2, (size_t)(E * d));
    }
    /* drawn last: the other modes' problems stay what they were */
    if (D->routing == SMOE_ROUTING_SIGMOID_TOPK) {
        P->ebias = tu_alloc_d((size_t)E);
        for (int64_t e = 0; e < E; e++) P->ebias[e] = (double)(float)tu_range(r, -0.2, 0.2);
    }
}

static TU_UNUSED void tu_problem_free(tu_problem *P) {
    free(P->x); free(P->wr); free(P->w1); free(P->b1); free(P->w2); free(P->b2);
    free(P->pt); free(P->pe); free(P->ps); free(P->ebias);
    memset(P, 0, sizeof *P);
}

/* Random GENERAL triples: each (token, expert) kept with probability prob,
 * sorted by token then expert, scores in [0.1, 1). */
static TU_UNUSED void tu_problem_general(tu_problem *P, tu_rng *r, double prob) {
    int64_t T = P->T, E = P->desc.E;
    free(P->pt); free(P->pe); free(P->ps);
    P->pt = (int32_t *)malloc((size_t)(T * E + 1) * sizeof(int32_t));
    P->pe = (int32_t *)malloc((size_t)(T * E + 1) * sizeof(int32_t));
    P->ps = tu_alloc_d((size_t)(T * E + 1));
    P->pairs = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++)
            if (tu_uniform(r) < prob) {
                P->pt[P->pairs] = (int32_t)t; P->pe[P->pairs] = (int32_t)e;
                P->ps[P->pairs] = (double)(float)tu_range(r, 0.1, 1.0); P->pairs++;
            }
}

/* ------------------------------------------------------------ library glue */

/* The problem's tensors in the layer's dtype, ready for forward/backward. */
typedef struct tu_bufs {
    smoe_dtype dt;
    void *x, *wr, *w1, *b1, *w2, *b2, *out;
    float *pscore; /* GENERAL scores as fp32 */
    float *logits;
    int32_t *counts;
    float *ebias;  /* SIGMOID_TOPK's expert bias or NULL */
    void *saved, *ws;
    size_t saved_bytes, ws_bytes;
    /* tu_run_backward's forward: ws_fwd (NULL: ws) of ws_fwd_bytes (0:
     * ws_bytes); its backward: ws of ws_bwd_bytes (0: ws_bytes) */
    void *ws_fwd;
    size_t ws_fwd_bytes, ws_bwd_bytes;
} tu_bufs;

static TU_UNUSED void tu_bufs_make(tu_bufs *B, const tu_problem *P, smoe_layer *L, int inference) {
    const smoe_layer_desc *D = &P->desc;
    int64_t T = P->T, d = D->d, n = D->n, E = D->E, hc = P->hc;
    memset(B, 0, sizeof *B);
    B->dt = D->dtype;
    B->x = tu_to_dtype(B->dt, P->x, (size_t)(T * d));
    B->wr = tu_to_dtype(B->dt, P->wr, (size_t)(E * d));
    B->w1 = tu_to_dtype(B->dt, P->w1, (size_t)(E * hc * d));
    B->w2 = tu_to_dtype(B->dt, P->w2, (size_t)(E * d * n));
    if (P->b1) {
        B->b1 = tu_to_dtype(B->dt, P->b1, (size_t)(E * hc));
        B->b2 = tu_to_dtype(B->dt, P->b2, (size_t)(E * d));
    }
    B->out = calloc((size_t)(T * d) + 1, tu_dtype_size(B->dt));
    B->logits = (float *)calloc((size_t)(T * E) + 1, sizeof(float));
    B->counts = (int32_t *)calloc((size_t)E + 1, sizeof(int32_t));
    int64_t np = D->routing == SMOE_ROUTING_GENERAL ? P->pairs : 0;
    if (P->ebias) {
        B->ebias = (float *)malloc((size_t)E * sizeof(float));
        for (int64_t e = 0; e < E; e++) B->ebias[e] = (float)P->ebias[e];
    }
    B->pscore = (float *)calloc((size_t)np + 1, sizeof(float));
    for (int64_t i = 0; i < np; i++) B->pscore[i] = (float)P->ps[i];
    B->saved_bytes = inference ? 0 : smoe_layer_saved_bytes(L, T, np);
    B->ws_bytes = smoe_layer_workspace_bytes(L, T, np);
    B->saved = B->saved_bytes ? malloc(B->saved_bytes) : NULL;
    B->ws = B->ws_bytes ? malloc(B->ws_bytes) : NULL;
    if (B->saved) memset(B->saved, 0x5A, B->saved_bytes);
}

static TU_UNUSED void tu_bufs_free(tu_bufs *B) {
    free(B->x); free(B->wr); free(B->w1); free(B->b1); free(B->w2); free(B->b2);
    free(B->out); free(B->pscore); free(B->logits); free(B->counts); free(B->saved); free(B->ws);
    free(B->ebias);
    memset(B, 0, sizeof *B);
}

static TU_UNUSED smoe_forward_args tu_fwd_args(const tu_problem *P, tu_bufs *B, int inference) {
    smoe_forward_args a;
    memset(&a, 0, sizeof a);
    a.T = P->T;
    a.x = B->x;
    if (P->desc.routing == SMOE_ROUTING_GENERAL) {
        a.pairs = P->pairs;
        a.pair_token = P->pt;
        a.pair_expert = P->pe;
        a.pair_score = B->pscore;
    } else {
        a.router_w = B->wr;
    }
    a.w1 = B->w1; a.b1 = B->b1; a.w2 = B->w2; a.b2 = B->b2;
    a.out = B->out;
    a.router_logits = P->desc.routing == SMOE_ROUTING_GENERAL ? NULL : B->logits;
    a.expert_counts = B->counts;
    a.inference = inference;
    a.expert_bias = B->ebias;
    return a;
}

/* Creates the layer for P->desc (CHECKed); NULL on failure. */
static TU_UNUSED smoe_layer *tu_layer(const smoe_layer_desc *D) {
    smoe_layer *L = NULL;
    smoe_status st = smoe_layer_create(D, &L);
    if (!CHECK(st == SMOE_SUCCESS && L, "smoe_layer_create -> %s (%s)", smoe_status_string(st),
               smoe_last_error()))
        return NULL;
    return L;
}

/* ------------------------------------------------------------ fixture */

/* A random problem (x scale 1, weights scale wscale; GENERAL: each
 * (token, expert) kept with probability prob), its layer and its buffers
 * for a training forward. */
typedef struct tu_fixture {
    tu_problem P;
    smoe_layer *L;
    tu_bufs B;
} tu_fixture;

/* 0 (CHECKed, nothing left allocated) if the layer cannot be created. */
static TU_UNUSED int tu_fixture_make(tu_fixture *F, const smoe_layer_desc *D, int64_t T, tu_rng *r,
                                     double wscale, double prob) {
    tu_problem_init(&F->P, D, T, r, 1.0, wscale);
    if (D->routing == SMOE_ROUTING_GENERAL) tu_problem_general(&F->P, r, prob);
    F->L = tu_layer(D);
    if (!F->L) {
        tu_problem_free(&F->P);
        return 0;
    }
    tu_bufs_make(&F->B, &F->P, F->L, 0);
    return 1;
}

static TU_UNUSED void tu_fixture_free(tu_fixture *F) {
    tu_bufs_free(&F->B);
    smoe_layer_free(F->L);
    tu_problem_free(&F->P);
}


static TU_UNUSED const char *tu_act_name(smoe_activation a) {
    static const char *names[] = {"swiglu", "geglu", "reglu", "relu2", "relu", "silu", "gelu"};
    return (unsigned)a < 7 ? names[a] : "?";
}

static TU_UNUSED const char *tu_mode_name(const smoe_layer_desc *D) {
    if (D->routing == SMOE_ROUTING_GENERAL) return "general";
    if (D->rounding != SMOE_ROUND_OFF) {
        static const char *tr[2][2][4] = {
            {{"", "tr-up/softmax-topk", "tr-down/softmax-topk", "tr-nearest/softmax-topk"},
             {"", "tr-up", "tr-down", "tr-nearest"}},
            {{"", "tr-up/topk-softmax", "tr-down/topk-softmax", "tr-nearest/topk-softmax"},
             {"", "tr-up/topk-softmax", "tr-down/topk-softmax", "tr-nearest/topk-softmax"}}};
        return tr[D->routing == SMOE_ROUTING_TOPK_SOFTMAX][D->renormalize != 0][D->rounding & 3];
    }
    if (D->routing == SMOE_ROUTING_SIGMOID_TOPK)
        return D->n_group ? (D->renormalize ? "sigmoid-groups-renorm" : "sigmoid-groups")
                          : (D->renormalize ? "sigmoid-renorm" : "sigmoid");
    if (D->routing == SMOE_ROUTING_TOPK_SOFTMAX) return "topk-softmax";
    return D->renormalize ? "softmax-topk-renorm" : "softmax-topk";
}

/* The tests' routing modes by number:
 *   0 TOPK_SOFTMAX   1 SOFTMAX_TOPK   2 SOFTMAX_TOPK + renormalize
 *   3 GENERAL
 *   4, 5, 6 token rounding up, down, nearest (SOFTMAX_TOPK + renormalize)
 *   7 token rounding up on TOPK_SOFTMAX
 *   8 token rounding to nearest on SOFTMAX_TOPK without renormalize
 *   9 SIGMOID_TOPK + renormalize, routed_scaling 2.5, expert bias
 *  10 SIGMOID_TOPK, expert bias, groups where D's E and K (set before the
 *     call) allow them (tu_set_groups), else none
 * (The problems of SIGMOID_TOPK modes carry a random expert bias.) */
#define TU_NMODES 11

/* Groups for a SIGMOID_TOPK desc whose E and K are set: 4 (else 2) groups
 * of >= 2 experts, keeping enough of them for K (at least half); none if
 * E allows neither. */
static TU_UNUSED void tu_set_groups(smoe_layer_desc *D) {
    D->n_group = D->topk_group = 0;
    for (int64_t G = 4; G >= 2; G -= 2) {
        if (D->E <= 0 || D->K <= 0 || D->E % G != 0 || D->E / G < 2) continue;
        int64_t gs = D->E / G, g = (D->K + gs - 1) / gs;
        if (g < G / 2) g = G / 2;
        D->n_group = G;
        D->topk_group = g;
        return;
    }
}

static TU_UNUSED void tu_set_mode(smoe_layer_desc *D, int mode) {
    D->routing = mode == 0 || mode == 7 ? SMOE_ROUTING_TOPK_SOFTMAX
               : mode == 3 ? SMOE_ROUTING_GENERAL
               : mode >= 9 ? SMOE_ROUTING_SIGMOID_TOPK : SMOE_ROUTING_SOFTMAX_TOPK;
    D->renormalize = mode == 2 || (mode >= 4 && mode <= 6) || mode == 9;
    D->rounding = mode == 4 || mode == 7 ? SMOE_ROUND_UP : mode == 5 ? SMOE_ROUND_DOWN
                : mode == 6 || mode == 8 ? SMOE_ROUND_NEAREST : SMOE_ROUND_OFF;
    D->routed_scaling = mode == 9 ? 2.5 : 1.0;
    D->n_group = D->topk_group = 0;
    if (mode == 10) tu_set_groups(D);
}

/* The smallest gap at a selection boundary of the reference routing of P:
 * between each token's K-th and (K+1)-th logit and, for token rounding,
 * between the last kept and the first dropped key of each expert. Exact
 * ties are structural (K=1: every kept key is 1) and stay ties under a
 * perturbation, so only positive gaps count. INFINITY for GENERAL. */
static TU_UNUSED double tu_selection_margin(const tu_problem *P) {
    const smoe_layer_desc *D = &P->desc;
    if (D->routing == SMOE_ROUTING_GENERAL) return INFINITY;
    int64_t T = P->T, E = D->E, K = D->K;
    double m = INFINITY, *lg = tu_alloc_d((size_t)(T * E));
    int32_t *idx = (int32_t *)malloc((size_t)(E + 1) * sizeof(int32_t));
    tu_logits(P, lg);
    if (D->routing == SMOE_ROUTING_SIGMOID_TOPK) {
        /* gaps of keys (sigmoid' <= 1/4: a logit gap is >= 4 key gaps) */
        for (int64_t t = 0; t < T; t++) {
            double g;
            tu_sigmoid_select(D, lg + t * E, P->ebias, idx, &g);
            m = fmin(m, g);
        }
    } else if (K < E)
        for (int64_t t = 0; t < T; t++) {
            tu_topk(lg + t * E, E, K + 1, idx);
            m = fmin(m, lg[t * E + idx[K - 1]] - lg[t * E + idx[K]]);
        }
    if (D->rounding != SMOE_ROUND_OFF) {
        int32_t *pt = (int32_t *)malloc((size_t)(T * E) * sizeof(int32_t));
        int32_t *pe = (int32_t *)malloc((size_t)(T * E) * sizeof(int32_t));
        double *ps = tu_alloc_d((size_t)(T * E)), gap;
        tu_route_tr(D, T, lg, pt, pe, ps, &gap);
        if (gap > 0) m = fmin(m, gap);
        free(pt); free(pe); free(ps);
    }
    free(idx);
    free(lg);
    return m;
}

/* ------------------------------------------------------------ gradients */

/* The seven gradient outputs of a backward, as buffers with their dtypes:
 * dx in the layer's dtype, the weight gradients in `wdt`, dpair_score fp32;
 * those the layer does not have (no bias, GENERAL's router) stay NULL. */
#define TU_NGRAD 7
enum { TU_GX, TU_GWR, TU_GW1, TU_GB1, TU_GW2, TU_GB2, TU_GPS };
static TU_UNUSED const char *tu_grad_name[TU_NGRAD] = {"dx", "drouter_w", "dw1", "db1", "dw2", "db2", "dpair_score"};

typedef struct tu_grads {
    void *g[TU_NGRAD];
    size_t n[TU_NGRAD];
    smoe_dtype dt[TU_NGRAD];
} tu_grads;

static TU_UNUSED void tu_grads_alloc(tu_grads *g, const tu_problem *P, smoe_dtype wdt) {
    const smoe_layer_desc *D = &P->desc;
    int64_t d = D->d, n = D->n, E = D->E, hc = P->hc, T = P->T;
    int general = D->routing == SMOE_ROUTING_GENERAL;
    memset(g, 0, sizeof *g);
    g->n[TU_GX] = (size_t)(T * d);
    g->n[TU_GWR] = general ? 0 : (size_t)(E * d);
    g->n[TU_GW1] = (size_t)(E * hc * d);
    g->n[TU_GB1] = D->has_bias ? (size_t)(E * hc) : 0;
    g->n[TU_GW2] = (size_t)(E * d * n);
    g->n[TU_GB2] = D->has_bias ? (size_t)(E * d) : 0;
    g->n[TU_GPS] = general ? (size_t)P->pairs : 0;
    for (int i = 0; i < TU_NGRAD; i++) {
        g->dt[i] = i == TU_GPS ? SMOE_DTYPE_F32 : i == TU_GX ? D->dtype : wdt;
        g->g[i] = (g->n[i] || (i == TU_GPS && general)) ? calloc(g->n[i] + 1, tu_dtype_size(g->dt[i]))
                                                     : NULL;
    }
}

static TU_UNUSED void tu_grads_free(tu_grads *g) {
    for (int i = 0; i < TU_NGRAD; i++) free(g->g[i]);
}

static TU_UNUSED double *tu_grad_d(const tu_grads *g, int i) { return tu_from_dtype(g->dt[i], g->g[i], g->n[i]); }

/* Forward (training) then backward with dout = G, dlogits_extra = G2. */
static TU_UNUSED int tu_run_backward(smoe_layer *L, const tu_problem *P, tu_bufs *B, const void *G,
                        const float *G2, tu_grads *g, int accumulate) {
    smoe_forward_args fa = tu_fwd_args(P, B, 0);
    smoe_status st = smoe_layer_forward(L, &fa, B->saved, B->saved_bytes,
                                        B->ws_fwd ? B->ws_fwd : B->ws,
                                        B->ws_fwd_bytes ? B->ws_fwd_bytes : B->ws_bytes, NULL);
    if (!CHECK(st == SMOE_SUCCESS, "forward -> %s (%s)", smoe_status_string(st), smoe_last_error()))
        return 0;
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = P->T;
    ba.x = B->x;
    ba.router_w = P->desc.routing == SMOE_ROUTING_GENERAL ? NULL : B->wr;
    ba.pairs = P->desc.routing == SMOE_ROUTING_GENERAL ? P->pairs : 0;
    ba.w1 = B->w1; ba.w2 = B->w2; ba.b2 = B->b2;
    ba.dout = G;
    ba.dlogits_extra = P->desc.routing == SMOE_ROUTING_GENERAL ? NULL : G2;
    smoe_grad *slot[TU_NGRAD] = {&ba.dx, &ba.drouter_w, &ba.dw1, &ba.db1, &ba.dw2, &ba.db2, &ba.dpair_score};
    for (int i = 0; i < TU_NGRAD; i++) {
        slot[i]->ptr = g->g[i];
        slot[i]->dtype = g->dt[i];
        slot[i]->accumulate = accumulate;
    }
    st = smoe_layer_backward(L, &ba, B->saved, B->saved_bytes, B->ws,
                             B->ws_bwd_bytes ? B->ws_bwd_bytes : B->ws_bytes, NULL);
    return CHECK(st == SMOE_SUCCESS, "backward -> %s (%s)", smoe_status_string(st), smoe_last_error());
}

#endif /* SMOE_TESTUTIL_H */
