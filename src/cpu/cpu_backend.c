/*
 * cpu_backend.c -- the CPU backend: plain C11 with OpenMP, the reference
 * (oracle) of every GPU test. DESIGN.md sections 2-5, computed the simple
 * way, row by row.
 *
 * Numerics. Every sum runs in double, in a fixed order, so the results are
 * deterministic whatever the thread count (each output element is summed by
 * one thread, over rows in ascending order). Every intermediate the GPU
 * stores in the layer's dtype is rounded to it here too: H (saved), and the
 * transient A, Y, A' = s*A, dH, dX~. Intermediates the GPU keeps in fp32
 * (router logits, scores, dS, dlogits) are rounded to fp32. dA' is the fp32
 * accumulator of the GPU's dH epilogue and is not stored, so it is not
 * rounded. A BF16 layer is therefore the "bf16-rounding reference" and an
 * F64 layer (nothing rounded; scores and logits double in the saved block)
 * the exact fp64 reference.
 *
 * Memory: the saved block holds H and O(R) + O(T*E) metadata only; Y, A,
 * dX~ and the converted inputs live in the workspace.
 */
#include "cpu/cpu_backend.h"
#include "routing.h"
#include "routing_math.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------ dtypes */

static inline double bf16_bits_to_double(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}

/* fp32 -> bf16, round to nearest even; NaN stays NaN. */
static inline uint16_t float_to_bf16_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline double load(const void *p, smoe_dtype t, int64_t i)
{
    switch (t) {
    case SMOE_DTYPE_F32: return (double)((const float *)p)[i];
    case SMOE_DTYPE_BF16: return bf16_bits_to_double(((const uint16_t *)p)[i]);
    default: return ((const double *)p)[i];
    }
}

/* Double to storage: through fp32 for BF16, as a fp32 accumulator would. */
static inline void store(void *p, smoe_dtype t, int64_t i, double v)
{
    switch (t) {
    case SMOE_DTYPE_F32: ((float *)p)[i] = (float)v; break;
    case SMOE_DTYPE_BF16: ((uint16_t *)p)[i] = float_to_bf16_bits((float)v); break;
    default: ((double *)p)[i] = v; break;
    }
}

static inline double round_to(smoe_dtype t, double v)
{
    switch (t) {
    case SMOE_DTYPE_F32: return (double)(float)v;
    case SMOE_DTYPE_BF16: return bf16_bits_to_double(float_to_bf16_bits((float)v));
    default: return v;
    }
}

/* fp32 intermediates (logits, scores, dS, dlogits): kept double in F64. */
static inline double round_f32(const smoe_layer *layer, double v)
{
    return layer->desc.dtype == SMOE_DTYPE_F64 ? v : (double)(float)v;
}

/* Writes one gradient element: overwrite, or add to what the buffer holds. */
static inline void grad_put(const smoe_grad *g, int64_t i, double v)
{
    if (g->accumulate) v += load(g->ptr, g->dtype, i);
    store(g->ptr, g->dtype, i, v);
}

/* Scores and logits in the saved block: fp32, double for F64 layers. */
static inline double saved_f(const smoe_layer *layer, const float *p, int64_t i)
{
    return layer->desc.dtype == SMOE_DTYPE_F64 ? ((const double *)(const void *)p)[i]
                                               : (double)p[i];
}

static inline void saved_f_put(const smoe_layer *layer, float *p, int64_t i, double v)
{
    if (layer->desc.dtype == SMOE_DTYPE_F64)
        ((double *)(void *)p)[i] = v;
    else
        p[i] = (float)v;
}

/* ------------------------------------------------------------ activations */

static const double GELU_C = 0.7978845608028654; /* sqrt(2/pi) */

static inline double act_f(smoe_activation a, double x)
{
    switch (a) {
    case SMOE_ACT_SWIGLU:
    case SMOE_ACT_SILU: return x / (1.0 + exp(-x));
    case SMOE_ACT_GEGLU:
    case SMOE_ACT_GELU: return 0.5 * x * (1.0 + tanh(GELU_C * (x + 0.044715 * x * x * x)));
    case SMOE_ACT_REGLU:
    case SMOE_ACT_RELU: return x <= 0.0 ? 0.0 : x; /* NaN stays NaN, as in PyTorch */
    case SMOE_ACT_RELU2: return x <= 0.0 ? 0.0 : x * x;
    }
    return 0.0;
}

static inline double act_df(smoe_activation a, double x)
{
    switch (a) {
    case SMOE_ACT_SWIGLU:
    case SMOE_ACT_SILU: {
        double sg = 1.0 / (1.0 + exp(-x));
        return sg * (1.0 + x * (1.0 - sg));
    }
    case SMOE_ACT_GEGLU:
    case SMOE_ACT_GELU: {
        double th = tanh(GELU_C * (x + 0.044715 * x * x * x));
        return 0.5 * (1.0 + th) +
               0.5 * x * (1.0 - th * th) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case SMOE_ACT_REGLU:
    case SMOE_ACT_RELU: return x <= 0.0 ? 0.0 : 1.0; /* PyTorch's: NaN passes */
    case SMOE_ACT_RELU2: return x <= 0.0 ? 0.0 : 2.0 * x;
    }
    return 0.0;
}

/* Physical W1 row (and b1 column) of logical, interleaved-order row c. */
static inline int64_t w1_row(const smoe_layer *layer, int64_t c)
{
    if (!layer->gated || layer->desc.w1_layout == SMOE_W1_INTERLEAVED) return c;
    return (c & 1) ? layer->desc.n + (c >> 1) : (c >> 1);
}

/* Dot products and row updates with a weight row read in its storage
 * dtype. Four partial sums in a fixed order (deterministic): one chain of
 * dependent adds would bound the speed by the add latency. */
#define DOT4(LOAD)                                                        \
    do {                                                                  \
        for (; i + 4 <= len; i += 4) {                                    \
            s0 += LOAD(i) * x[i];                                         \
            s1 += LOAD(i + 1) * x[i + 1];                                 \
            s2 += LOAD(i + 2) * x[i + 2];                                 \
            s3 += LOAD(i + 3) * x[i + 3];                                 \
        }                                                                 \
        for (; i < len; i++) s0 += LOAD(i) * x[i];                        \
    } while (0)

/* sum_i w[off + i] * x[i] */
static inline double dot_w(const void *w, smoe_dtype t, int64_t off, const double *x,
                           int64_t len)
{
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    if (t == SMOE_DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)w + off;
#define LOAD_BF16(k) bf16_bits_to_double(p[k])
        DOT4(LOAD_BF16);
#undef LOAD_BF16
    } else if (t == SMOE_DTYPE_F32) {
        const float *p = (const float *)w + off;
#define LOAD_F32(k) ((double)p[k])
        DOT4(LOAD_F32);
#undef LOAD_F32
    } else {
        const double *p = (const double *)w + off;
#define LOAD_F64(k) (p[k])
        DOT4(LOAD_F64);
#undef LOAD_F64
    }
    return (s0 + s1) + (s2 + s3);
}

/* y[i] += a * w[off + i] */
static inline void axpy_w(double *y, double a, const void *w, smoe_dtype t, int64_t off,
                          int64_t len)
{
    if (t == SMOE_DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)w + off;
        for (int64_t i = 0; i < len; i++) y[i] += a * bf16_bits_to_double(p[i]);
    } else if (t == SMOE_DTYPE_F32) {
        const float *p = (const float *)w + off;
        for (int64_t i = 0; i < len; i++) y[i] += a * (double)p[i];
    } else {
        const double *p = (const double *)w + off;
        for (int64_t i = 0; i < len; i++) y[i] += a * p[i];
    }
}

/* ------------------------------------------------------------ workspace */

typedef struct cpu_ws {
    double *xd;          /* (T, d) x in double */
    int32_t *row_expert; /* (cap) expert of each row */
    /* forward */
    void *meta;          /* saved-shaped block used when nothing is saved (inference) */
    float *logits32;     /* (T, E) */
    double *logits64;    /* (T, E) */
    void *route;         /* routing scratch */
    double *ascore;      /* (cap) assignment scores */
    double *a;           /* (cap, n) A */
    double *y;           /* (cap, d) Y */
    /* backward */
    double *dod;         /* (T, d) dO in double */
    double *ds;          /* (cap) dS */
    double *dap;         /* (cap, n) dA' */
    double *ap;          /* (cap, n) A' = s*A */
    double *dh;          /* (cap, h_cols) dH; NULL with consume_saved (dH is
                            then written over the saved H, in the dtype) */
    double *dxt;         /* (cap, d) dX~ */
    double *dxd;         /* (T, d) dX */
    double *dl;          /* (T, E) dlogits */
    double *rp;          /* (3E) router backward of one token: p, dp, logits */
    int32_t *ridx;       /* (K) */
    float *rl32;         /* (E) */
    size_t total;
} cpu_ws;

typedef struct ws_bump {
    char *base;
    size_t off;
} ws_bump;

static void *ws_take(ws_bump *b, size_t bytes)
{
    size_t off = b->off;
    b->off = (off + bytes + 255) / 256 * 256;
    return b->base ? b->base + off : NULL;
}

/* The workspace plan of a forward (backward = 0) or a backward; with base
 * NULL only the size. */
static void ws_plan(const smoe_layer *layer, int64_t T, int64_t cap, int backward, void *base,
                    cpu_ws *w)
{
    const smoe_layer_desc *D = &layer->desc;
    const size_t d = (size_t)D->d, n = (size_t)D->n, E = (size_t)D->E, t = (size_t)T;
    const size_t hc = (size_t)layer->h_cols, c = (size_t)cap;
    const int general = D->routing == SMOE_ROUTING_GENERAL;
    ws_bump b = {(char *)base, 0};
    memset(w, 0, sizeof *w);
    w->xd = (double *)ws_take(&b, t * d * 8);
    w->row_expert = (int32_t *)ws_take(&b, c * 4);
    if (!backward) {
        smoe_saved_layout l;
        smoe_saved_layout_make(layer, T, cap, &l);
        w->meta = ws_take(&b, l.total);
        if (!general) {
            size_t r0 = smoe_route_scratch_bytes(D, T, 0), r1 = smoe_route_scratch_bytes(D, T, 1);
            w->logits32 = (float *)ws_take(&b, t * E * 4);
            w->logits64 = (double *)ws_take(&b, t * E * 8);
            w->route = ws_take(&b, r0 > r1 ? r0 : r1);
        }
        w->ascore = (double *)ws_take(&b, c * 8);
        w->a = (double *)ws_take(&b, c * n * 8);
        w->y = (double *)ws_take(&b, c * d * 8);
    } else {
        w->dod = (double *)ws_take(&b, t * d * 8);
        w->ds = (double *)ws_take(&b, c * 8);
        w->dap = (double *)ws_take(&b, c * n * 8);
        w->ap = (double *)ws_take(&b, c * n * 8);
        if (!D->consume_saved) w->dh = (double *)ws_take(&b, c * hc * 8);
        w->dxt = (double *)ws_take(&b, c * d * 8);
        w->dxd = (double *)ws_take(&b, t * d * 8);
        if (!general) {
            w->dl = (double *)ws_take(&b, t * E * 8);
            w->rp = (double *)ws_take(&b, 3 * E * 8);
            w->ridx = (int32_t *)ws_take(&b, (size_t)D->K * 4);
            w->rl32 = (float *)ws_take(&b, E * 4);
        }
    }
    w->total = b.off;
}

static size_t cpu_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap, int call)
{
    cpu_ws f, b;
    ws_plan(layer, T, cap, 0, NULL, &f);
    ws_plan(layer, T, cap, 1, NULL, &b);
    if (call == SMOE_CALL_FORWARD) return f.total;
    if (call == SMOE_CALL_BACKWARD) return b.total;
    return f.total > b.total ? f.total : b.total;
}

static void to_double(const void *src, smoe_dtype t, int64_t count, double *dst)
{
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) dst[i] = load(src, t, i);
}

static void fill_row_expert(const smoe_layer *layer, const int32_t *off, int32_t *row_expert)
{
    for (int64_t e = 0; e < layer->desc.E; e++)
        for (int32_t r = off[e]; r < off[e + 1]; r++) row_expert[r] = (int32_t)e;
}

/* Weight gradients are summed over the rows of an expert in blocks of
 * this many columns, kept on the stack (no per-thread workspace). */
#define GRAD_BLOCK 256

/* ------------------------------------------------------------ forward */

/* Metadata from token-major assignments (token_offset, assign_expert and
 * scores in place): counts, expert offsets, rows sorted by expert then
 * token, each row's token and score, each assignment's row. */
static void build_metadata(const smoe_layer *layer, int64_t T, const double *ascore,
                           const smoe_saved_view *v, int32_t *counts_out)
{
    const int64_t E = layer->desc.E;
    const int32_t R = v->token_offset[T];
    int32_t *off = v->expert_offset;
    /* off[e+1] counts expert e, then becomes e's start, then (as the fill
     * cursor) e's end, which is expert_offset[e+1]. */
    for (int64_t e = 0; e <= E; e++) off[e] = 0;
    for (int32_t a = 0; a < R; a++) off[v->assign_expert[a] + 1]++;
    int32_t running = 0;
    for (int64_t e = 0; e < E; e++) {
        int32_t c = off[e + 1];
        if (counts_out) counts_out[e] = c;
        off[e + 1] = running;
        running += c;
    }
    /* Assignments are token-major, so each expert's rows come out by token. */
    for (int64_t t = 0; t < T; t++)
        for (int32_t a = v->token_offset[t]; a < v->token_offset[t + 1]; a++) {
            int32_t r = off[v->assign_expert[a] + 1]++;
            v->row_token[r] = (int32_t)t;
            saved_f_put(layer, v->row_score, r, round_f32(layer, ascore[a]));
            v->assign_row[a] = r;
        }
}

static smoe_status cpu_forward(smoe_layer *layer, const smoe_forward_args *args,
                               const smoe_saved_layout *L, void *saved, void *workspace,
                               void *stream)
{
    (void)stream;
    const smoe_layer_desc *D = &layer->desc;
    const smoe_dtype dt = D->dtype;
    const smoe_activation act = D->activation;
    const int64_t T = args->T, d = D->d, n = D->n, E = D->E, hc = layer->h_cols;
    const int general = D->routing == SMOE_ROUTING_GENERAL;
    const int gated = layer->gated, bias = D->has_bias;
    cpu_ws w;
    ws_plan(layer, T, L->cap, 0, workspace, &w);
    smoe_saved_view v = smoe_saved_view_make(L, saved ? saved : w.meta);

    to_double(args->x, dt, T * d, w.xd);

    /* 1. router logits = X Wr^T, and the routing */
    if (!general) {
        smoe_cpu_router_logits(layer, T, w.xd, args->router_w, w.logits32, w.logits64);
        smoe_assignments as;
        as.token_offset = v.token_offset;
        as.expert = v.assign_expert;
        as.score = w.ascore;
        as.cap = L->cap;
        as.R = 0;
        SMOE_FORWARD_IF_ERROR(smoe_route_assign(D, T, !args->inference, w.logits32,
                                                dt == SMOE_DTYPE_F64 ? w.logits64 : NULL,
                                                args->expert_bias, w.route, &as));
    } else {
        for (int64_t t = 0; t <= T; t++) v.token_offset[t] = 0;
        for (int64_t a = 0; a < args->pairs; a++) {
            v.token_offset[args->pair_token[a] + 1]++;
            v.assign_expert[a] = (uint16_t)args->pair_expert[a];
            w.ascore[a] = (double)args->pair_score[a];
        }
        for (int64_t t = 0; t < T; t++) v.token_offset[t + 1] += v.token_offset[t];
    }

    /* 2. metadata */
    build_metadata(layer, T, w.ascore, &v, args->expert_counts);
    const int32_t R = v.expert_offset[E];
    fill_row_expert(layer, v.expert_offset, w.row_expert);

    /* 3. up-projection: H = X[token] W1[e]^T + b1 (saved, dtype), A = act(H)
     *    from the unrounded H, rounded to dtype (as the GPU epilogue does) */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t e = w.row_expert[r];
        const double *x = w.xd + (int64_t)v.row_token[r] * d;
        if (gated) {
            for (int64_t j = 0; j < n; j++) {
                int64_t pg = w1_row(layer, 2 * j), pu = w1_row(layer, 2 * j + 1);
                double g = dot_w(args->w1, dt, (e * hc + pg) * d, x, d);
                double u = dot_w(args->w1, dt, (e * hc + pu) * d, x, d);
                if (bias) {
                    g += load(args->b1, dt, e * hc + pg);
                    u += load(args->b1, dt, e * hc + pu);
                }
                store(v.h, dt, r * hc + 2 * j, g);
                store(v.h, dt, r * hc + 2 * j + 1, u);
                w.a[r * n + j] = round_to(dt, act_f(act, g) * u);
            }
        } else {
            for (int64_t j = 0; j < n; j++) {
                double h = dot_w(args->w1, dt, (e * hc + j) * d, x, d);
                if (bias) h += load(args->b1, dt, e * hc + j);
                store(v.h, dt, r * hc + j, h);
                w.a[r * n + j] = round_to(dt, act_f(act, h));
            }
        }
    }

    /* 4. down-projection: Y = A W2[e]^T + b2, rounded to dtype */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t e = w.row_expert[r];
        for (int64_t i = 0; i < d; i++) {
            double y = dot_w(args->w2, dt, (e * d + i) * n, w.a + r * n, n);
            if (bias) y += load(args->b2, dt, e * d + i);
            w.y[r * d + i] = round_to(dt, y);
        }
    }

    /* 5. aggregation: o_t = sum over the token's assignments of s * Y[row] */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < d; i++) {
            double o = 0.0;
            for (int32_t a = v.token_offset[t]; a < v.token_offset[t + 1]; a++) {
                int32_t r = v.assign_row[a];
                o += saved_f(layer, v.row_score, r) * w.y[(int64_t)r * d + i];
            }
            store(args->out, dt, t * d + i, o);
        }

    /* optional outputs and the saved logits */
    if (!general && args->router_logits)
        smoe_cpu_put_logits(args->router_logits, args->router_logits_dtype, w.logits32, T * E);
    if (!general && saved && v.logits) {
        for (int64_t i = 0; i < T * E; i++)
            saved_f_put(layer, v.logits, i,
                        dt == SMOE_DTYPE_F64 ? w.logits64[i] : (double)w.logits32[i]);
    }
    if (saved) *v.header = smoe_saved_header_make(layer, T, args->pairs);
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ backward */

/* The saved block must be one a training forward with this T filled. */
static smoe_status check_saved(const smoe_layer *layer, const smoe_saved_view *v, int64_t T,
                               int64_t cap)
{
    const int64_t E = layer->desc.E;
    const int32_t R = v->expert_offset[E];
    int ok = v->expert_offset[0] == 0 && v->token_offset[0] == 0 && R >= 0 && R <= cap &&
             v->token_offset[T] == R;
    for (int64_t e = 0; ok && e < E; e++) ok = v->expert_offset[e] <= v->expert_offset[e + 1];
    for (int64_t t = 0; ok && t < T; t++) ok = v->token_offset[t] <= v->token_offset[t + 1];
    for (int32_t r = 0; ok && r < R; r++) ok = v->row_token[r] >= 0 && v->row_token[r] < T;
    for (int32_t a = 0; ok && a < R; a++)
        ok = v->assign_row[a] >= 0 && v->assign_row[a] < R && v->assign_expert[a] < E;
    SMOE_RETURN_ERROR_IF(!ok, SMOE_ERROR_INVALID_VALUE,
                         "smoe_layer_backward: the saved block was not filled by a training "
                         "forward with T = %lld (rows %d, capacity %lld)",
                         (long long)T, (int)R, (long long)cap);
    return SMOE_SUCCESS;
}

/* Router backward for one token: dlogits (E) from the dS of its
 * assignments, through the routing mode's softmax. */
static void router_grad_token(const smoe_layer *layer, int64_t t, const smoe_saved_view *v,
                              const double *ds, const smoe_cpu_router_scratch *w, double *dl)
{
    const smoe_layer_desc *D = &layer->desc;
    const int64_t E = D->E, K = D->K;
    const int32_t a0 = v->token_offset[t], a1 = v->token_offset[t + 1];
    for (int64_t e = 0; e < E; e++) dl[e] = 0.0;
    if (D->routing == SMOE_ROUTING_TOPK_SOFTMAX && D->rounding == SMOE_ROUND_OFF) {
        /* s = softmax over the K selected: ds_k -> s_k (dS_k - sum_j s_j dS_j) */
        double sum = 0.0;
        for (int32_t a = a0; a < a1; a++) {
            int32_t r = v->assign_row[a];
            sum += saved_f(layer, v->row_score, r) * ds[r];
        }
        for (int32_t a = a0; a < a1; a++) {
            int32_t r = v->assign_row[a];
            dl[v->assign_expert[a]] = saved_f(layer, v->row_score, r) * (ds[r] - sum);
        }
        return;
    }
    if (D->routing == SMOE_ROUTING_SIGMOID_TOPK) {
        /* The token's K pairs (selection order) with s = sigmoid(saved
         * logit): score_k = c s_k / Den (Den = sum_j s_j + 1e-20) or c s_k.
         * Renormalised: dL/ds_j = c (dS_j - G) / Den, G = sum_k dS_k s_k /
         * Den; else c dS_j. Then ds/dl = s (1 - s). */
        const double c = D->routed_scaling;
        double z = 0.0, g = 0.0;
        for (int32_t a = a0; a < a1; a++)
            z += smoe_sigmoid(saved_f(layer, v->logits, t * E + v->assign_expert[a]));
        const double den = z + 1e-20;
        if (D->renormalize)
            for (int32_t a = a0; a < a1; a++) {
                double sa = smoe_sigmoid(saved_f(layer, v->logits, t * E + v->assign_expert[a]));
                g += ds[v->assign_row[a]] * sa / den;
            }
        for (int32_t a = a0; a < a1; a++) {
            const int32_t e = v->assign_expert[a];
            const double sa = smoe_sigmoid(saved_f(layer, v->logits, t * E + e));
            const double dsa = ds[v->assign_row[a]];
            const double dsig = D->renormalize ? c * (dsa - g) / den : c * dsa;
            dl[e] = dsig * sa * (1.0 - sa);
        }
        return;
    }
    /* Through the full softmax p over E (saved logits). Scores are p_e or
     * p_e / Z, Z = sum of p over the token's K token-choice experts. Token
     * rounding: kept token-choice pairs p_e / Z (Z over all K, also those
     * rounding dropped), pairs rounding added p_e. SOFTMAX_TOPK: p_e / Z if
     * renormalised, else p_e. */
    double *p = w->rp, *dp = w->rp + E, *l64 = w->rp + 2 * E;
    for (int64_t e = 0; e < E; e++) {
        l64[e] = saved_f(layer, v->logits, t * E + e);
        w->rl32[e] = (float)l64[e];
    }
    smoe_softmax_probs(w->rl32, l64, E, p);
    smoe_topk_select(w->rl32, E, K, w->ridx);
    double z = 0.0;
    for (int64_t k = 0; k < K; k++) z += p[w->ridx[k]];
    for (int64_t e = 0; e < E; e++) dp[e] = 0.0;
    const int rounding = D->rounding != SMOE_ROUND_OFF;
    for (int32_t a = a0; a < a1; a++) {
        int32_t e = v->assign_expert[a];
        double g = ds[v->assign_row[a]];
        int normalised;
        if (rounding) {
            normalised = 0;
            for (int64_t k = 0; k < K; k++) normalised |= w->ridx[k] == e;
        } else {
            normalised = D->renormalize;
        }
        if (normalised) {
            /* s = p_e / Z: ds/dp_j = [j == e] / Z - p_e / Z^2 [j in top-K] */
            dp[e] += g / z;
            for (int64_t k = 0; k < K; k++) dp[w->ridx[k]] -= g * p[e] / (z * z);
        } else {
            dp[e] += g;
        }
    }
    double pdp = 0.0;
    for (int64_t e = 0; e < E; e++) pdp += p[e] * dp[e];
    for (int64_t e = 0; e < E; e++) dl[e] = p[e] * (dp[e] - pdp);
}

void smoe_cpu_router_logits(const smoe_layer *layer, int64_t T, const double *xd,
                            const void *router_w, float *l32, double *l64)
{
    const int64_t E = layer->desc.E, d = layer->desc.d;
    const smoe_dtype dt = layer->desc.dtype;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) {
            double l = dot_w(router_w, dt, e * d, xd + t * d, d);
            if (l64) l64[t * E + e] = l;
            if (l32) l32[t * E + e] = (float)l;
        }
}

void smoe_cpu_put_logits(void *dst, smoe_dtype dt, const float *l32, int64_t n)
{
    if (dt == SMOE_DTYPE_F32) {
        memcpy(dst, l32, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) store(dst, dt, i, (double)l32[i]);
}

void smoe_cpu_router_backward(const smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                              const double *ds, const void *dlogits_extra, smoe_dtype extra_dt,
                              const double *xd, const smoe_grad *drouter_w, double *dl,
                              const smoe_cpu_router_scratch *scratch)
{
    const int64_t E = layer->desc.E, d = layer->desc.d;
    for (int64_t t = 0; t < T; t++) {
        double *g = dl + t * E;
        router_grad_token(layer, t, v, ds, scratch, g);
        for (int64_t e = 0; e < E; e++) {
            if (dlogits_extra) g[e] += load(dlogits_extra, extra_dt, t * E + e);
            g[e] = round_f32(layer, g[e]);
        }
    }
    if (!drouter_w->ptr) return;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; e++) {
        double acc[GRAD_BLOCK];
        for (int64_t i0 = 0; i0 < d; i0 += GRAD_BLOCK) {
            int64_t len = d - i0 < GRAD_BLOCK ? d - i0 : GRAD_BLOCK;
            for (int64_t i = 0; i < len; i++) acc[i] = 0.0;
            for (int64_t t = 0; t < T; t++) {
                double g = dl[t * E + e];
                const double *x = xd + t * d + i0;
                for (int64_t i = 0; i < len; i++) acc[i] += g * x[i];
            }
            for (int64_t i = 0; i < len; i++) grad_put(drouter_w, e * d + i0 + i, acc[i]);
        }
    }
}

void smoe_cpu_router_dx(const smoe_layer *layer, const double *dl, const void *router_w,
                        double *o)
{
    const int64_t E = layer->desc.E, d = layer->desc.d;
    for (int64_t e = 0; e < E; e++) axpy_w(o, dl[e], router_w, layer->desc.dtype, e * d, d);
}

/* dH, in the workspace (double) or, consuming the saved block, over H (the
 * dtype). Every dH value is rounded to the dtype before it is stored, so
 * both hold the same numbers and the two modes give the same results. */
typedef struct cpu_dh {
    double *ws;
    void *h;
    smoe_dtype t;
} cpu_dh;

static inline double dh_get(const cpu_dh *g, int64_t i)
{
    return g->ws ? g->ws[i] : load(g->h, g->t, i);
}

static inline void dh_put(const cpu_dh *g, int64_t i, double v)
{
    if (g->ws) g->ws[i] = v;
    else store(g->h, g->t, i, v);
}

static smoe_status cpu_backward(smoe_layer *layer, const smoe_backward_args *args,
                                const smoe_saved_layout *L, void *saved, void *workspace,
                                void *stream)
{
    (void)stream;
    const smoe_layer_desc *D = &layer->desc;
    const smoe_dtype dt = D->dtype;
    const smoe_activation act = D->activation;
    const int64_t T = args->T, d = D->d, n = D->n, E = D->E, hc = layer->h_cols;
    const int general = D->routing == SMOE_ROUTING_GENERAL;
    const int gated = layer->gated, bias = D->has_bias;
    cpu_ws w;
    ws_plan(layer, T, L->cap, 1, workspace, &w);
    smoe_saved_view v = smoe_saved_view_make(L, saved);
    SMOE_FORWARD_IF_ERROR(
        smoe_saved_header_check(layer, v.header, T, general ? args->pairs : 0));
    SMOE_FORWARD_IF_ERROR(check_saved(layer, &v, T, L->cap));
    const cpu_dh dh = {w.dh, v.h, dt};
    const int32_t *off = v.expert_offset;
    const int32_t R = off[E];
    fill_row_expert(layer, off, w.row_expert);

    to_double(args->x, dt, T * d, w.xd);
    to_double(args->dout, dt, T * d, w.dod);

    /* 1. dA' = dO[token] W2[e] (fp32 accumulator, not stored on the GPU);
     *    with A = act(H) from the saved H: dS = <dA', A> (+ <dO, b2>),
     *    A' = s*A and dH = s * dact(H, dA'), both rounded to dtype. A row's
     *    H pair (or value) is read before its dH is stored, so dH may
     *    replace H in place (consume_saved). */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t e = w.row_expert[r];
        const double *g = w.dod + (int64_t)v.row_token[r] * d;
        const double s = saved_f(layer, v.row_score, r);
        double *dap = w.dap + r * n;
        for (int64_t j = 0; j < n; j++) dap[j] = 0.0;
        for (int64_t i = 0; i < d; i++) axpy_w(dap, g[i], args->w2, dt, (e * d + i) * n, n);
        double dsr = 0.0;
        for (int64_t j = 0; j < n; j++) {
            double da = round_f32(layer, dap[j]), a;
            if (gated) {
                double hg = load(v.h, dt, r * hc + 2 * j);
                double hu = load(v.h, dt, r * hc + 2 * j + 1);
                double fg = act_f(act, hg);
                a = fg * hu;
                dh_put(&dh, r * hc + 2 * j, round_to(dt, s * da * act_df(act, hg) * hu));
                dh_put(&dh, r * hc + 2 * j + 1, round_to(dt, s * da * fg));
            } else {
                double h = load(v.h, dt, r * hc + j);
                a = act_f(act, h);
                dh_put(&dh, r * hc + j, round_to(dt, s * da * act_df(act, h)));
            }
            dsr += da * a;
            w.ap[r * n + j] = round_to(dt, s * a);
        }
        if (bias) dsr += dot_w(args->b2, dt, e * d, g, d);
        w.ds[r] = round_f32(layer, dsr);
    }

    /* 2. dW2[e] = sum over e's rows of dO[token]^T A'; db2[e] = sum s dO.
     *    Experts without rows: zeros when overwriting, untouched when
     *    accumulating (as the GPU kernels do). */
    if (args->dw2.ptr || args->db2.ptr) {
#pragma omp parallel for schedule(static)
        for (int64_t ei = 0; ei < E * d; ei++) {
            const int64_t e = ei / d, i = ei % d;
            const int32_t r0 = off[e], r1 = off[e + 1];
            if (r0 == r1) {
                if (args->dw2.ptr && !args->dw2.accumulate)
                    for (int64_t j = 0; j < n; j++) store(args->dw2.ptr, args->dw2.dtype, ei * n + j, 0.0);
                if (args->db2.ptr && !args->db2.accumulate)
                    store(args->db2.ptr, args->db2.dtype, ei, 0.0);
                continue;
            }
            if (args->dw2.ptr) {
                double acc[GRAD_BLOCK];
                for (int64_t j0 = 0; j0 < n; j0 += GRAD_BLOCK) {
                    int64_t len = n - j0 < GRAD_BLOCK ? n - j0 : GRAD_BLOCK;
                    for (int64_t j = 0; j < len; j++) acc[j] = 0.0;
                    for (int32_t r = r0; r < r1; r++) {
                        double g = w.dod[(int64_t)v.row_token[r] * d + i];
                        const double *ap = w.ap + (int64_t)r * n + j0;
                        for (int64_t j = 0; j < len; j++) acc[j] += g * ap[j];
                    }
                    for (int64_t j = 0; j < len; j++) grad_put(&args->dw2, ei * n + j0 + j, acc[j]);
                }
            }
            if (args->db2.ptr) {
                double b = 0.0;
                for (int32_t r = r0; r < r1; r++)
                    b += saved_f(layer, v.row_score, r) * w.dod[(int64_t)v.row_token[r] * d + i];
                grad_put(&args->db2, ei, b);
            }
        }
    }

    /* 3. dX~ = dH W1[e], rounded to dtype */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t e = w.row_expert[r];
        double *o = w.dxt + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0;
        for (int64_t c = 0; c < hc; c++)
            axpy_w(o, dh_get(&dh, r * hc + c), args->w1, dt, (e * hc + w1_row(layer, c)) * d, d);
        for (int64_t i = 0; i < d; i++) o[i] = round_to(dt, o[i]);
    }

    /* 4. dW1[e] = sum over e's rows of dH^T X[token] (logical row c to W1's
     *    physical row), db1[e] = sum of dH rows */
    if (args->dw1.ptr || args->db1.ptr) {
#pragma omp parallel for schedule(static)
        for (int64_t ec = 0; ec < E * hc; ec++) {
            const int64_t e = ec / hc, c = ec % hc;
            const int64_t prow = e * hc + w1_row(layer, c);
            const int32_t r0 = off[e], r1 = off[e + 1];
            if (r0 == r1) {
                if (args->dw1.ptr && !args->dw1.accumulate)
                    for (int64_t i = 0; i < d; i++) store(args->dw1.ptr, args->dw1.dtype, prow * d + i, 0.0);
                if (args->db1.ptr && !args->db1.accumulate)
                    store(args->db1.ptr, args->db1.dtype, prow, 0.0);
                continue;
            }
            if (args->dw1.ptr) {
                double acc[GRAD_BLOCK];
                for (int64_t i0 = 0; i0 < d; i0 += GRAD_BLOCK) {
                    int64_t len = d - i0 < GRAD_BLOCK ? d - i0 : GRAD_BLOCK;
                    for (int64_t i = 0; i < len; i++) acc[i] = 0.0;
                    for (int32_t r = r0; r < r1; r++) {
                        double g = dh_get(&dh, (int64_t)r * hc + c);
                        const double *x = w.xd + (int64_t)v.row_token[r] * d + i0;
                        for (int64_t i = 0; i < len; i++) acc[i] += g * x[i];
                    }
                    for (int64_t i = 0; i < len; i++) grad_put(&args->dw1, prow * d + i0 + i, acc[i]);
                }
            }
            if (args->db1.ptr) {
                double b = 0.0;
                for (int32_t r = r0; r < r1; r++) b += dh_get(&dh, (int64_t)r * hc + c);
                grad_put(&args->db1, prow, b);
            }
        }
    }

    /* 5-6. router: dlogits through the routing mode, dWr */
    if (!general) {
        smoe_cpu_router_scratch rs = {w.rp, w.ridx, w.rl32};
        smoe_cpu_router_backward(layer, T, &v, w.ds, args->dlogits_extra,
                                 args->dlogits_extra_dtype, w.xd, &args->drouter_w,
                                 w.dl, &rs);
    } else if (args->dpair_score.ptr) {
        for (int64_t a = 0; a < R; a++) grad_put(&args->dpair_score, a, w.ds[v.assign_row[a]]);
    }

    /* dX = sum over the token's assignments of dX~[row] (+ dlogits Wr) */
    if (args->dx.ptr) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            double *o = w.dxd + t * d;
            for (int64_t i = 0; i < d; i++) o[i] = 0.0;
            for (int32_t a = v.token_offset[t]; a < v.token_offset[t + 1]; a++) {
                const double *src = w.dxt + (int64_t)v.assign_row[a] * d;
                for (int64_t i = 0; i < d; i++) o[i] += src[i];
            }
            if (!general) smoe_cpu_router_dx(layer, w.dl + t * E, args->router_w, o);
            for (int64_t i = 0; i < d; i++) grad_put(&args->dx, t * d + i, o[i]);
        }
    }
    /* H is gone: a second backward with this block is refused */
    if (D->consume_saved) v.header->consumed = 1;
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ init */

/* The router slot (smoe.h's smoe_layer_drouter_slot): all of H. With
 * consume_saved H holds dH, whose last readers (dX~, dW1, db1) run before
 * the router's backward writes drouter_w; nothing reads H after it. */
static int cpu_drouter_slot(const smoe_layer *layer, const smoe_saved_layout *l, size_t *offset,
                            size_t *bytes)
{
    *offset = l->h;
    *bytes = (size_t)l->cap * (size_t)layer->h_cols * smoe_dtype_size(layer->desc.dtype);
    return 1;
}

static const smoe_backend_ops cpu_ops = {
    .workspace_bytes = cpu_workspace_bytes,
    .forward = cpu_forward,
    .backward = cpu_backward,
    .destroy = NULL,
    .device_status = NULL,
    .backward_workspace_bytes = NULL,
    .drouter_slot = cpu_drouter_slot,
};

smoe_status smoe_cpu_layer_init(smoe_layer *layer)
{
    layer->ops = &cpu_ops;
    layer->state = NULL;
    snprintf(layer->path_name, sizeof layer->path_name, "cpu (%s, double accumulation)",
             layer->desc.dtype == SMOE_DTYPE_F64   ? "f64"
             : layer->desc.dtype == SMOE_DTYPE_F32 ? "f32"
                                                   : "bf16");
    return SMOE_SUCCESS;
}
