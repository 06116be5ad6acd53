/*
 * test_saved_gpu.c -- desc.consume_saved on the GPU backends (test_saved's
 * test_consume on the device), every buffer in device memory.
 *
 * For each fixed case (routing mode, activation, W1 layout, bias, weight
 * gradient dtype, accumulate, dlogits_extra, which gradients are wanted,
 * dh's tile row; small shapes, R rows mostly not a multiple of the 128-row
 * tiles) on each GPU backend (the one AUTO picks, which is the Hopper path
 * on an sm_90 device, then CUDA, the portable kernels), a reading layer L0
 * and a consuming layer L1 (the same description, consume_saved = 1):
 *   - sizes: the same saved bytes; L1's workspace no larger than L0's and
 *     smaller by at most the dH region (cap x h_cols bf16, aligned), by
 *     at least half of it where dH dominates the backward (big_save);
 *   - forward, each layer into its own block (the header names the layer):
 *     out, router logits and expert counts bit for bit equal, the blocks
 *     equal past the header; L1's saved block and workspace exactly
 *     smoe_layer_saved_bytes and each call's own workspace size
 *     (smoe_layer_call_workspace_bytes), each followed
 *     by a guard that must stay as it was;
 *   - backward: every gradient bit for bit equal; L0's block unchanged;
 *     L1's header marked consumed; L1's workspace exactly
 *     smoe_layer_backward_workspace_bytes (A' in dW1's buffer where it
 *     fits: smaller where n > d); where it fits, L0's backward without dW1
 *     (A' in its workspace) gives the other gradients bit for bit;
 *   - a second backward of L1 with its consumed block (its H poisoned
 *     first: only the header decides): the call returns SMOE_SUCCESS,
 *     smoe_layer_device_status gives INVALID_VALUE ("consumed") once;
 *     the gradients (a sentinel) and the whole block are unchanged;
 *   - L0's block (valid, not consumed, another layer's) given to L1:
 *     refused the same way ("another layer"), nothing written to it, and
 *     L0's backward with it afterwards gives the first gradients again;
 *   - a new forward of L1 fills its block again: its backward gives L0's
 *     gradients; some cases also as a CUDA graph (forward + backward of L1)
 *     replayed twice.
 *
 * Usage: test_saved_gpu [seed] [--sm80|--sm90] (one backend only: the
 * portable kernels, or the Hopper ones). Exit code 0 when every check
 * passed; a GPU-less machine skips (exit 0, says so).
 */
#include "smoe.h"
#include "smoe_internal.h"
#include "testutil.h"

#include "testutil_cuda.h"

/* cuda_layer.h (C++ types in its other declarations): a GEMM's tile row */
extern smoe_status smoe_cuda_layer_set_row(smoe_layer *layer, const char *gemm, const char *name);

#define GUARD 4096
#define PAT 0xA5  /* guards */
#define SENT 0x3C /* gradients a refused call must not write */

static size_t al256(size_t x) { return (x + 255) / 256 * 256; }

/* ------------------------------------------------------------ cases */

/* which gradients a case asks for: bit TU_GX ... (0: every one the layer has) */
#define W(g) (1u << (g))

typedef struct gcase {
    const char *name;
    int64_t T, d, n, E, K;
    smoe_activation act;
    smoe_w1_layout layout;
    int bias;
    int mode;         /* tu_set_mode's numbering (testutil.h) */
    int64_t M;        /* token rounding's tile */
    double gprob;     /* GENERAL: pair probability */
    smoe_dtype gdt;   /* the weight gradients' dtype */
    int acc;          /* accumulate into set values */
    int extra;        /* pass a dlogits_extra (not GENERAL) */
    unsigned want;
    const char *row80, *row90; /* dh's tile row forced on both layers, or NULL */
    int big_save;     /* the workspace shrinks by at least half the dH region */
    int graph;        /* L1's forward + backward as a CUDA graph too */
} gcase;

#define BF SMOE_DTYPE_BF16
#define F32 SMOE_DTYPE_F32

static const gcase g_cases[] = {
    /* name, T, d, n, E, K, act, layout, bias, mode, M, gprob, gdt, acc, extra, want,
     * row80, row90, big_save, graph */
    {"topk-softmax swiglu (sparse router)", 200, 128, 64, 8, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 1, 0, 128, 0, BF, 0, 0, 0, NULL, NULL, 0, 0},
    {"softmax-topk geglu concat, extra, acc", 77, 64, 128, 6, 3, SMOE_ACT_GEGLU,
     SMOE_W1_CONCATENATED, 0, 1, 128, 0, F32, 1, 1, 0, NULL, NULL, 0, 0},
    {"softmax-topk-renorm swiglu n=256 (dh tma-store)", 150, 192, 256, 4, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 1, 2, 128, 0, F32, 0, 0, 0, NULL, NULL, 0, 0},
    {"dH dominates the workspace", 256, 64, 512, 4, 4, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 0,
     0, 128, 0, BF, 0, 0, 0, NULL, NULL, 1, 1},
    {"sigmoid renorm relu2 n=256 (dh 256x4 direct), acc", 90, 128, 256, 5, 2, SMOE_ACT_RELU2,
     SMOE_W1_INTERLEAVED, 0, 9, 128, 0, BF, 1, 0, 0, NULL, NULL, 0, 0},
    {"general silu bias", 64, 64, 64, 7, 0, SMOE_ACT_SILU, SMOE_W1_INTERLEAVED, 1, 3, 128, 0.4,
     F32, 0, 0, 0, NULL, NULL, 0, 0},
    {"general, no pairs", 16, 64, 64, 4, 0, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 1, 3, 128, 0.0,
     BF, 1, 0, 0, NULL, NULL, 0, 0},
    {"token rounding up, reglu concat", 100, 128, 128, 8, 2, SMOE_ACT_REGLU,
     SMOE_W1_CONCATENATED, 1, 4, 16, 0, BF, 0, 0, 0, NULL, NULL, 0, 0},
    {"token rounding up on topk-softmax, K=1, extra, acc", 60, 64, 64, 4, 1, SMOE_ACT_GELU,
     SMOE_W1_INTERLEAVED, 1, 7, 8, 0, F32, 1, 1, 0, NULL, NULL, 0, 0},
    {"token rounding nearest, no renorm", 45, 64, 192, 6, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 0, 8, 32, 0, BF, 0, 0, 0, NULL, NULL, 0, 0},
    {"sigmoid groups, d=40 n=24 (portable kernels), extra", 33, 40, 24, 8, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 1, 10, 128, 0, F32, 0, 1, 0, NULL, NULL, 0, 0},
    {"few rows, wide d (the router's buffers larger than dH)", 8, 512, 64, 4, 1, SMOE_ACT_RELU,
     SMOE_W1_INTERLEAVED, 0, 1, 128, 0, BF, 0, 0, 0, NULL, NULL, 0, 0},
    {"only dW1 and db1", 120, 128, 128, 6, 2, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 1, 1, 128, 0,
     F32, 0, 0, W(TU_GW1) | W(TU_GB1), NULL, NULL, 0, 0},
    {"only dx (dense router dx)", 70, 64, 64, 4, 2, SMOE_ACT_GEGLU, SMOE_W1_INTERLEAVED, 0, 2,
     128, 0, BF, 0, 0, W(TU_GX), NULL, NULL, 0, 0},
    {"only drouter_w, dW2, db2", 50, 64, 64, 4, 2, SMOE_ACT_SILU, SMOE_W1_INTERLEAVED, 1, 0, 128,
     0, BF, 1, 0, W(TU_GWR) | W(TU_GW2) | W(TU_GB2), NULL, NULL, 0, 0},
    {"T=1, K=E", 1, 64, 64, 5, 5, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 0, 1, 128, 0, F32, 0, 0,
     0, NULL, NULL, 0, 1},
    {"empty experts", 3, 64, 64, 16, 2, SMOE_ACT_RELU2, SMOE_W1_INTERLEAVED, 1, 0, 128, 0, BF, 0,
     0, 0, NULL, NULL, 0, 0},
    {"dh rows forced: DH epilogue / 256x4 direct gated", 130, 64, 256, 4, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 1, 0, 128, 0, BF, 0, 0, 0, "128x128x32 s4 dh", "256x4", 0, 1},
    {"dh rows forced: DH 256 / tma-store grouped", 300, 128, 256, 3, 2, SMOE_ACT_GEGLU,
     SMOE_W1_CONCATENATED, 0, 2, 128, 0, F32, 1, 0, 0, "256x128x32 s3 dh",
     "256x4 tma-store grouped", 0, 0},
    {"several tiles per expert", 700, 256, 256, 12, 3, SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 1, 0,
     128, 0, F32, 0, 0, 0, NULL, NULL, 0, 0},
    /* dh's claimed tiles (SM90_FL_DYN) with more tiles than SMs (about
     * 4 m-tiles x 2 n-tiles x 32 experts), in a CUDA graph too */
    {"dh row forced: tma-store grouped dynamic, graph", 4000, 256, 512, 32, 4, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 1, 0, 128, 0, BF, 0, 0, 0, "256x128x32 s3 dh",
     "256x4 tma-store grouped dynamic", 0, 1},
    /* the dense router term of dx in chunks, the same in both backwards:
     * T = 1100 (K n = d) in two chunks of 960 tokens in the dead dH region
     * after the router's other buffers; T = 600 and 520 in one */
    {"dense router dx in chunks: softmax-topk T=1100, extra", 1100, 128, 64, 8, 2,
     SMOE_ACT_SWIGLU, SMOE_W1_INTERLEAVED, 0, 1, 128, 0, BF, 0, 1, 0, NULL, NULL, 0, 0},
    {"dense router dx in chunks: sigmoid T=600, acc, graph", 600, 64, 128, 6, 2, SMOE_ACT_GEGLU,
     SMOE_W1_CONCATENATED, 1, 9, 128, 0, F32, 1, 0, 0, NULL, NULL, 0, 1},
    {"topk-softmax with extra (dense) T=520, only dx", 520, 64, 64, 4, 2, SMOE_ACT_SWIGLU,
     SMOE_W1_INTERLEAVED, 0, 0, 128, 0, BF, 0, 1, W(TU_GX), NULL, NULL, 0, 0},
};
#define NCASES ((int)(sizeof g_cases / sizeof g_cases[0]))

static const char *backend_name(smoe_backend b)
{
    return b == SMOE_BACKEND_SM90 ? "sm90" : b == SMOE_BACKEND_CUDA ? "cuda" : "?";
}

/* ------------------------------------------------------------ device buffers */

/* The problem's inputs on the device. */
typedef struct dev_in {
    void *x, *wr, *w1, *b1, *w2, *b2, *dout;
    int32_t *pt, *pe;
    float *ps, *extra, *ebias;
} dev_in;

static void dev_in_make(dev_in *in, const tu_problem *P, const double *dout, const float *extra)
{
    const smoe_layer_desc *D = &P->desc;
    const int64_t T = P->T, d = D->d, n = D->n, E = D->E, hc = P->hc;
    memset(in, 0, sizeof *in);
    in->x = tu_dev_to_dtype(BF, P->x, (size_t)(T * d));
    in->wr = tu_dev_to_dtype(BF, P->wr, (size_t)(E * d));
    in->w1 = tu_dev_to_dtype(BF, P->w1, (size_t)(E * hc * d));
    in->w2 = tu_dev_to_dtype(BF, P->w2, (size_t)(E * d * n));
    in->dout = tu_dev_to_dtype(BF, dout, (size_t)(T * d));
    if (D->has_bias) {
        in->b1 = tu_dev_to_dtype(BF, P->b1, (size_t)(E * hc));
        in->b2 = tu_dev_to_dtype(BF, P->b2, (size_t)(E * d));
    }
    if (D->routing == SMOE_ROUTING_GENERAL) {
        float *s = (float *)malloc((size_t)P->pairs * 4 + 4);
        for (int64_t i = 0; i < P->pairs; i++) s[i] = (float)P->ps[i];
        in->pt = (int32_t *)tu_dev_put(P->pt, (size_t)P->pairs * 4);
        in->pe = (int32_t *)tu_dev_put(P->pe, (size_t)P->pairs * 4);
        in->ps = (float *)tu_dev_put(s, (size_t)P->pairs * 4);
        free(s);
    } else if (extra) {
        in->extra = (float *)tu_dev_put(extra, (size_t)(T * E) * 4);
    }
    if (P->ebias) {
        float *b = (float *)malloc((size_t)E * 4);
        for (int64_t e = 0; e < E; e++) b[e] = (float)P->ebias[e];
        in->ebias = (float *)tu_dev_put(b, (size_t)E * 4);
        free(b);
    }
}

static void dev_in_free(dev_in *in)
{
    void *p[] = {in->x, in->wr, in->w1, in->b1, in->w2, in->b2, in->dout,
                 in->pt, in->pe, in->ps, in->extra, in->ebias};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) CUDA_OK(cudaFree(p[i]));
    memset(in, 0, sizeof *in);
}

/* One layer's forward outputs and its saved block and workspace, each of
 * the last two followed by a guard of GUARD bytes of PAT. */
typedef struct dev_run {
    void *out, *saved, *ws;
    float *logits;
    int32_t *counts;
    size_t sb, wb;   /* the buffers' sizes (wb: either call's workspace) */
    size_t wbf, wbb; /* the workspace_bytes each call is given: forward, backward */
} dev_run;

static void dev_run_make(dev_run *r, const tu_problem *P, size_t sb, size_t wb)
{
    const int64_t T = P->T, d = P->desc.d, E = P->desc.E;
    memset(r, 0, sizeof *r);
    r->sb = sb;
    r->wb = r->wbf = r->wbb = wb;
    r->out = tu_dev_alloc((size_t)(T * d) * 2);
    r->logits = (float *)tu_dev_alloc((size_t)(T * E) * 4);
    r->counts = (int32_t *)tu_dev_alloc((size_t)E * 4);
    r->saved = tu_dev_alloc(sb + GUARD);
    r->ws = tu_dev_alloc(wb + GUARD);
    CUDA_OK(cudaMemset(r->saved, 0x5A, sb));
    CUDA_OK(cudaMemset((char *)r->saved + sb, PAT, GUARD));
    CUDA_OK(cudaMemset(r->ws, PAT, wb + GUARD));
}

static void dev_run_free(dev_run *r)
{
    CUDA_OK(cudaFree(r->out));
    CUDA_OK(cudaFree(r->logits));
    CUDA_OK(cudaFree(r->counts));
    CUDA_OK(cudaFree(r->saved));
    CUDA_OK(cudaFree(r->ws));
}

/* r's whole workspace and its guard back to PAT (before a call whose
 * guard, at that call's own size, is checked after it) */
static void ws_reset(dev_run *r) { CUDA_OK(cudaMemset(r->ws, PAT, r->wb + GUARD)); }

/* the GUARD bytes after `bytes` of the device buffer p are all PAT */
static int guard_ok(const void *p, size_t bytes)
{
    unsigned char *h = (unsigned char *)tu_dev_fetch((const char *)p + bytes, GUARD);
    int ok = 1;
    for (size_t i = 0; i < GUARD; i++) ok &= h[i] == PAT;
    free(h);
    return ok;
}

/* The gradient outputs on the device: those the case wants and the layer
 * has; dx in bf16, dpair_score in fp32, the others in the case's dtype. */
typedef struct dev_grads {
    void *g[TU_NGRAD];
    size_t bytes[TU_NGRAD];
    smoe_dtype dt[TU_NGRAD];
    void *init[TU_NGRAD]; /* host: what grads_set writes */
} dev_grads;

/* Deterministic initial values for accumulate (as test_layer_gpu's). */
static double g0_value(int i, size_t j)
{
    return 0.01 * (double)((j * 7 + (size_t)i * 3) % 11) - 0.05;
}

static void grads_make(dev_grads *g, const tu_problem *P, const gcase *c)
{
    const smoe_layer_desc *D = &P->desc;
    const int64_t T = P->T, d = D->d, n = D->n, E = D->E, hc = P->hc;
    const int general = D->routing == SMOE_ROUTING_GENERAL;
    const size_t ne[TU_NGRAD] = {
        (size_t)(T * d), general ? 0 : (size_t)(E * d), (size_t)(E * hc * d),
        D->has_bias ? (size_t)(E * hc) : 0, (size_t)(E * d * n), D->has_bias ? (size_t)(E * d) : 0,
        general ? (size_t)P->pairs : 0};
    memset(g, 0, sizeof *g);
    for (int i = 0; i < TU_NGRAD; i++) {
        if (!ne[i] || (c->want && !(c->want & W(i)))) continue;
        g->dt[i] = i == TU_GX ? BF : i == TU_GPS ? F32 : c->gdt;
        g->bytes[i] = ne[i] * tu_dtype_size(g->dt[i]);
        g->g[i] = tu_dev_alloc(g->bytes[i]);
        double *v = tu_alloc_d(ne[i]);
        for (size_t j = 0; j < ne[i]; j++) v[j] = c->acc ? g0_value(i, j) : 0.0;
        g->init[i] = tu_to_dtype(g->dt[i], v, ne[i]);
        if (!c->acc) memset(g->init[i], 0xFF, g->bytes[i]); /* overwritten: NaN poison */
        free(v);
    }
}

static void grads_free(dev_grads *g)
{
    for (int i = 0; i < TU_NGRAD; i++) {
        if (g->g[i]) CUDA_OK(cudaFree(g->g[i]));
        free(g->init[i]);
    }
}

/* the initial values (accumulate) or the poison (overwrite) */
static void grads_set(const dev_grads *g)
{
    for (int i = 0; i < TU_NGRAD; i++)
        if (g->g[i])
            CUDA_OK(cudaMemcpy(g->g[i], g->init[i], g->bytes[i], cudaMemcpyHostToDevice));
}

static void grads_sentinel(const dev_grads *g)
{
    for (int i = 0; i < TU_NGRAD; i++)
        if (g->g[i]) CUDA_OK(cudaMemset(g->g[i], SENT, g->bytes[i]));
}

/* Host copies of the gradients (after the work queued before). */
typedef struct host_grads {
    void *g[TU_NGRAD];
} host_grads;

static host_grads grads_fetch(const dev_grads *g)
{
    host_grads h;
    CUDA_OK(cudaDeviceSynchronize());
    for (int i = 0; i < TU_NGRAD; i++) h.g[i] = g->g[i] ? tu_dev_fetch(g->g[i], g->bytes[i]) : NULL;
    return h;
}

static void host_grads_free(host_grads *h)
{
    for (int i = 0; i < TU_NGRAD; i++) free(h->g[i]);
}

/* The first gradient whose bytes differ, or -1. */
static int grads_differ(const dev_grads *g, const host_grads *a, const host_grads *b)
{
    for (int i = 0; i < TU_NGRAD; i++)
        if (g->g[i] && memcmp(a->g[i], b->g[i], g->bytes[i]) != 0) return i;
    return -1;
}

/* Every gradient still holds SENT bytes: the first that does not, or -1. */
static int grads_touched(const dev_grads *g)
{
    host_grads h = grads_fetch(g);
    int which = -1;
    for (int i = 0; i < TU_NGRAD && which < 0; i++) {
        if (!g->g[i]) continue;
        const unsigned char *b = (const unsigned char *)h.g[i];
        for (size_t j = 0; j < g->bytes[i]; j++)
            if (b[j] != SENT) {
                which = i;
                break;
            }
    }
    host_grads_free(&h);
    return which;
}

static const char *grad_name(int i) { return i >= 0 ? tu_grad_name[i] : "-"; }

/* ------------------------------------------------------------ calls */

static smoe_forward_args fwd_args(const tu_problem *P, const dev_in *in, const dev_run *r)
{
    const int general = P->desc.routing == SMOE_ROUTING_GENERAL;
    smoe_forward_args a;
    memset(&a, 0, sizeof a);
    a.T = P->T;
    a.x = in->x;
    a.router_w = general ? NULL : in->wr;
    a.pairs = general ? P->pairs : 0;
    a.pair_token = in->pt;
    a.pair_expert = in->pe;
    a.pair_score = in->ps;
    a.w1 = in->w1; a.b1 = in->b1; a.w2 = in->w2; a.b2 = in->b2;
    a.out = r->out;
    a.router_logits = general ? NULL : r->logits;
    a.expert_counts = r->counts;
    a.expert_bias = in->ebias;
    return a;
}

static smoe_backward_args bwd_args(const tu_problem *P, const dev_in *in, const dev_grads *g,
                                   int acc)
{
    const int general = P->desc.routing == SMOE_ROUTING_GENERAL;
    smoe_backward_args b;
    memset(&b, 0, sizeof b);
    b.T = P->T;
    b.x = in->x;
    b.router_w = general ? NULL : in->wr;
    b.pairs = general ? P->pairs : 0;
    b.w1 = in->w1; b.w2 = in->w2; b.b2 = in->b2;
    b.dout = in->dout;
    b.dlogits_extra = in->extra;
    smoe_grad *slot[TU_NGRAD] = {&b.dx, &b.drouter_w, &b.dw1, &b.db1, &b.dw2, &b.db2,
                                 &b.dpair_score};
    for (int i = 0; i < TU_NGRAD; i++) {
        if (!g->g[i]) continue;
        slot[i]->ptr = g->g[i];
        slot[i]->dtype = g->dt[i];
        slot[i]->accumulate = acc;
    }
    return b;
}

static smoe_status forward(smoe_layer *L, const tu_problem *P, const dev_in *in, dev_run *r,
                           void *stream)
{
    smoe_forward_args a = fwd_args(P, in, r);
    return smoe_layer_forward(L, &a, r->saved, r->sb, r->ws, r->wbf, stream);
}

/* backward of L with the saved block `saved` (sb bytes) and r's workspace */
static smoe_status backward(smoe_layer *L, const tu_problem *P, const dev_in *in,
                            const dev_grads *g, int acc, void *saved, size_t sb, dev_run *r,
                            void *stream)
{
    smoe_backward_args b = bwd_args(P, in, g, acc);
    return smoe_layer_backward(L, &b, saved, sb, r->ws, r->wbb, stream);
}

/* The call's status, then (waiting) the device's; a failure's message is
 * printed. */
static smoe_status settle(smoe_layer *L, smoe_status st, const char *what)
{
    if (st == SMOE_SUCCESS) st = smoe_layer_device_status(L, NULL, 1);
    if (st != SMOE_SUCCESS)
        fprintf(stderr, "  %s: %s: %s\n", what, smoe_status_string(st), smoe_last_error());
    return st;
}

/* A call the device refuses: the call itself succeeds, the device status
 * (read once) is INVALID_VALUE with `words` in its message, and a second
 * read finds nothing. */
static int refused_on_device(smoe_layer *L, smoe_status st, const char *words)
{
    char msg[512] = "";
    smoe_status ds = SMOE_SUCCESS, again = SMOE_SUCCESS;
    if (st == SMOE_SUCCESS) {
        ds = smoe_layer_device_status(L, NULL, 1);
        snprintf(msg, sizeof msg, "%s", smoe_last_error());
        again = smoe_layer_device_status(L, NULL, 1);
    }
    return CHECK(st == SMOE_SUCCESS && ds == SMOE_ERROR_INVALID_VALUE && strstr(msg, words) &&
                     again == SMOE_SUCCESS,
                 "call -> %s, device status -> %s (%s), read again -> %s; want SUCCESS, "
                 "INVALID_VALUE (\"%s\"), SUCCESS",
                 smoe_status_string(st), smoe_status_string(ds), msg,
                 smoe_status_string(again), words);
}

/* ------------------------------------------------------------ one case */

static void run_case(const gcase *c, smoe_backend be, uint64_t seed)
{
    tu_case("%s, backend %s, seed %llu", c->name, backend_name(be), (unsigned long long)seed);
    tu_rng rng = tu_rng_make(seed);
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = c->d; D.n = c->n; D.E = c->E; D.K = c->K;
    tu_set_mode(&D, c->mode); /* after E and K: groups need them */
    if (D.routing == SMOE_ROUTING_GENERAL) D.K = 0;
    D.activation = c->act;
    D.w1_layout = c->layout;
    D.has_bias = c->bias;
    D.round_tile = c->M;
    D.dtype = BF;
    D.backend = be;
    smoe_layer_desc D1 = D;
    D1.consume_saved = 1;
    smoe_layer *L0 = NULL, *L1 = NULL;
    smoe_status s0 = smoe_layer_create(&D, &L0);
    smoe_status s1 = s0 == SMOE_SUCCESS ? smoe_layer_create(&D1, &L1) : s0;
    if (!CHECK(s0 == SMOE_SUCCESS && s1 == SMOE_SUCCESS && smoe_layer_backend(L0) == be &&
                   smoe_layer_backend(L1) == be && smoe_layer_get_desc(L1).consume_saved == 1,
               "create -> %s, %s (%s)", smoe_status_string(s0), smoe_status_string(s1),
               smoe_last_error())) {
        smoe_layer_free(L0);
        smoe_layer_free(L1);
        return;
    }
    const char *row = be == SMOE_BACKEND_CUDA ? c->row80 : c->row90;
    if (row) {
        s0 = smoe_cuda_layer_set_row(L0, "dh", row);
        s1 = smoe_cuda_layer_set_row(L1, "dh", row);
        CHECK(s0 == SMOE_SUCCESS && s1 == SMOE_SUCCESS, "dh row \"%s\" -> %s, %s (%s)", row,
              smoe_status_string(s0), smoe_status_string(s1), smoe_last_error());
    }

    /* the problem, as test_layer_gpu draws it */
    tu_problem P;
    tu_problem_init(&P, &D, c->T, &rng, 1.0, 1.0 / sqrt((double)c->d));
    for (int64_t i = 0; i < c->E * c->d; i++) P.wr[i] *= 2.0 / sqrt((double)c->d);
    tu_round_array(BF, P.wr, (size_t)(c->E * c->d));
    if (D.routing == SMOE_ROUTING_GENERAL) tu_problem_general(&P, &rng, c->gprob);
    double *dout = tu_alloc_d((size_t)(c->T * c->d));
    tu_fill_normal(&rng, dout, (size_t)(c->T * c->d), 1.0);
    float *extra = NULL;
    if (c->extra && D.routing != SMOE_ROUTING_GENERAL) {
        extra = (float *)malloc((size_t)(c->T * c->E) * 4);
        for (int64_t i = 0; i < c->T * c->E; i++) extra[i] = (float)(0.3 * tu_normal(&rng));
    }
    dev_in in;
    dev_in_make(&in, &P, dout, extra);
    const int general = D.routing == SMOE_ROUTING_GENERAL;
    const int64_t T = c->T, np = general ? P.pairs : 0;

    /* sizes */
    const size_t sb0 = smoe_layer_saved_bytes(L0, T, np), sb1 = smoe_layer_saved_bytes(L1, T, np);
    const size_t wb0 = smoe_layer_workspace_bytes(L0, T, np);
    const size_t wb1 = smoe_layer_workspace_bytes(L1, T, np);
    const int64_t cap = smoe_row_capacity(L1, T, np, 0);
    smoe_saved_layout sl;
    smoe_saved_layout_make(L1, T, cap, &sl);
    const size_t dh_region = al256((size_t)(cap > 0 ? cap : 1) * (size_t)P.hc * 2);
    CHECK(sb0 == sb1 && sb1 == sl.total && sb1 > 0, "saved bytes %zu (reading), %zu (consuming), "
          "layout %zu", sb0, sb1, sl.total);
    /* the consuming backward also takes the dense router term of dx (T x d
     * fp32) in chunks: smaller by at most that buffer too */
    const size_t dxr_full = al256((size_t)(T * c->d) * 4);
    CHECK(wb0 > 0 && wb1 > 0 && wb1 <= wb0 && wb0 - wb1 <= dh_region + dxr_full &&
              (!c->big_save || wb0 - wb1 >= dh_region / 2),
          "workspace %zu (reading), %zu (consuming): want smaller by at most the dH region "
          "%zu and the router's dx term %zu%s",
          wb0, wb1, dh_region, dxr_full, c->big_save ? ", by at least half the dH region" : "");
    printf("  %-52s %-4s R cap %6lld, workspace %8zu -> %8zu (dH region %8zu)\n", c->name,
           backend_name(be), (long long)cap, wb0, wb1, dh_region);
    printf("  %-52s      consuming: forward's workspace %8zu, backward's %8zu\n", "",
           smoe_layer_call_workspace_bytes(L1, SMOE_CALL_FORWARD, T, np),
           smoe_layer_call_workspace_bytes(L1, SMOE_CALL_BACKWARD, T, np));

    /* the consuming layer's calls get each call's own size
     * (smoe_layer_call_workspace_bytes), the reading layer's the larger */
    const size_t wb1f = smoe_layer_call_workspace_bytes(L1, SMOE_CALL_FORWARD, T, np);
    const size_t wb1b = smoe_layer_call_workspace_bytes(L1, SMOE_CALL_BACKWARD, T, np);
    CHECK(wb1f > 0 && wb1b > 0 && wb1 == (wb1f > wb1b ? wb1f : wb1b),
          "consuming layer: workspace %zu, forward's %zu, backward's %zu", wb1, wb1f, wb1b);
    dev_run r0, r1;
    dev_run_make(&r0, &P, sb0, wb0);
    dev_run_make(&r1, &P, sb1, wb1);
    dev_grads g0, g1;
    grads_make(&g0, &P, c);
    grads_make(&g1, &P, c);
    /* the consuming backward's own size for its arguments: A' (cap x n
     * bf16) in dW1's buffer where dW1 is overwritten and holds it, never
     * larger; smaller where n > d, cap >= 2 T (dX~'s cap x d then holds a
     * dXr chunk) and A' is under the router GEMM's 8 MiB cuBLAS scratch
     * (which then goes after dX~'s region in both layouts; where A' is
     * larger and cap x d smaller, the scratch no longer fits the smaller
     * region, and the layout keeps A' if that is no smaller: "dh row
     * forced ... dynamic", cap x n x 2 = 16 MB, cap x d x 2 = 8.2 MB) */
    const smoe_backward_args ba = bwd_args(&P, &in, &g1, c->acc);
    const size_t wb1a = smoe_layer_backward_workspace_bytes(L1, &ba);
    const int a_fits = g1.g[TU_GW1] && !c->acc && cap > 0 &&
                       g1.bytes[TU_GW1] >= (size_t)cap * (size_t)c->n * 2;
    CHECK(wb1a > 0 && wb1a <= wb1b && (a_fits || wb1a == wb1b) &&
              (!(a_fits && c->n > c->d && cap >= 2 * T &&
                 (size_t)cap * (size_t)c->n * 2 < ((size_t)8 << 20)) ||
               wb1a < wb1b),
          "consuming layer: backward_workspace_bytes %zu against SMOE_CALL_BACKWARD %zu (A' %s "
          "dW1's buffer, n %lld, d %lld)",
          wb1a, wb1b, a_fits ? "fits" : "does not fit", (long long)c->n, (long long)c->d);
    printf("  %-52s      consuming backward's own (A' %s dW1): %8zu\n", "",
           a_fits ? "in" : "not in", wb1a);
    r1.wbf = wb1f;
    r1.wbb = wb1a;
    const size_t ob = (size_t)(T * c->d) * 2;

    /* forward: each layer into its own block */
    {
        s0 = settle(L0, forward(L0, &P, &in, &r0, NULL), "forward (reading)");
        s1 = settle(L1, forward(L1, &P, &in, &r1, NULL), "forward (consuming)");
        CHECK(s0 == SMOE_SUCCESS && s1 == SMOE_SUCCESS, "forward failed");
        void *o0 = tu_dev_fetch(r0.out, ob), *o1 = tu_dev_fetch(r1.out, ob);
        void *l0 = tu_dev_fetch(r0.logits, (size_t)(T * c->E) * 4);
        void *l1 = tu_dev_fetch(r1.logits, (size_t)(T * c->E) * 4);
        void *c0 = tu_dev_fetch(r0.counts, (size_t)c->E * 4);
        void *c1 = tu_dev_fetch(r1.counts, (size_t)c->E * 4);
        CHECK(!memcmp(o0, o1, ob) && (general || !memcmp(l0, l1, (size_t)(T * c->E) * 4)) &&
                  !memcmp(c0, c1, (size_t)c->E * 4),
              "forward: out %s, logits %s, counts %s", memcmp(o0, o1, ob) ? "differ" : "equal",
              memcmp(l0, l1, (size_t)(T * c->E) * 4) ? "differ" : "equal",
              memcmp(c0, c1, (size_t)c->E * 4) ? "differ" : "equal");
        free(o0); free(o1); free(l0); free(l1); free(c0); free(c1);
        char *b0 = (char *)tu_dev_fetch(r0.saved, sb0), *b1 = (char *)tu_dev_fetch(r1.saved, sb1);
        CHECK(!memcmp(b0 + sl.h, b1 + sl.h, sb1 - sl.h),
              "forward: the saved blocks differ past the header");
        free(b0);
        free(b1);
        CHECK(guard_ok(r1.saved, sb1) && guard_ok(r1.ws, wb1f),
              "forward: the consuming layer wrote past saved_bytes %zu or workspace_bytes %zu",
              sb1, wb1f);
    }

    /* backward: the same gradients; the reading layer's block unchanged,
     * the consuming one's marked consumed */
    void *blk0 = tu_dev_fetch(r0.saved, sb0 + GUARD);
    grads_set(&g0);
    grads_set(&g1);
    ws_reset(&r1);
    s0 = settle(L0, backward(L0, &P, &in, &g0, c->acc, r0.saved, sb0, &r0, NULL),
                "backward (reading)");
    s1 = settle(L1, backward(L1, &P, &in, &g1, c->acc, r1.saved, sb1, &r1, NULL),
                "backward (consuming)");
    CHECK(s0 == SMOE_SUCCESS && s1 == SMOE_SUCCESS, "backward failed");
    host_grads h0 = grads_fetch(&g0), h1 = grads_fetch(&g1);
    int which = grads_differ(&g0, &h0, &h1);
    CHECK(which < 0, "%s of the consuming backward differs from the reading one's",
          grad_name(which));
    host_grads_free(&h1);
    {
        void *now = tu_dev_fetch(r0.saved, sb0 + GUARD);
        CHECK(!memcmp(now, blk0, sb0 + GUARD), "the reading backward wrote into its saved block");
        free(now);
        smoe_saved_header h;
        tu_dev_get(&h, r1.saved, sizeof h);
        CHECK(h.consumed == 1 && h.status == 0 && guard_ok(r1.saved, sb1) &&
                  guard_ok(r1.ws, r1.wbb),
              "after the consuming backward: header consumed %d status %d; guards %d %d",
              (int)h.consumed, (int)h.status, guard_ok(r1.saved, sb1), guard_ok(r1.ws, r1.wbb));
    }
    if (a_fits) {
        /* the reading layer again without dW1 (A' then in its workspace):
         * every other gradient bit for bit as with A' in dW1's buffer */
        dev_grads g2 = g0;
        g2.g[TU_GW1] = NULL;
        grads_set(&g2);
        s0 = settle(L0, backward(L0, &P, &in, &g2, c->acc, r0.saved, sb0, &r0, NULL),
                    "backward (reading, no dW1)");
        host_grads h2 = grads_fetch(&g2);
        which = s0 == SMOE_SUCCESS ? grads_differ(&g2, &h0, &h2) : TU_GX;
        CHECK(which < 0, "%s without dW1 (A' in the workspace) differs from the run with A' in "
              "dW1's buffer", grad_name(which));
        host_grads_free(&h2);
    }

    /* a second backward with the consumed block: refused on the device,
     * nothing written (its H poisoned first, so that a write shows) */
    {
        CUDA_OK(cudaMemset((char *)r1.saved + sl.h, 0x5A, sl.row_score - sl.h));
        void *blk1 = tu_dev_fetch(r1.saved, sb1 + GUARD);
        grads_sentinel(&g1);
        s1 = backward(L1, &P, &in, &g1, c->acc, r1.saved, sb1, &r1, NULL);
        refused_on_device(L1, s1, "consumed");
        which = grads_touched(&g1);
        CHECK(which < 0, "the refused second backward wrote %s", grad_name(which));
        void *now = tu_dev_fetch(r1.saved, sb1 + GUARD);
        CHECK(!memcmp(now, blk1, sb1 + GUARD) && guard_ok(r1.ws, r1.wbb),
              "the refused second backward wrote into the saved block (or past the workspace)");
        free(now);
        free(blk1);
    }

    /* the reading layer's live block given to the consuming layer: refused,
     * left as it was, and still good for its own layer */
    {
        grads_sentinel(&g1);
        s1 = backward(L1, &P, &in, &g1, c->acc, r0.saved, sb0, &r1, NULL);
        refused_on_device(L1, s1, "another layer");
        which = grads_touched(&g1);
        void *now = tu_dev_fetch(r0.saved, sb0 + GUARD);
        CHECK(which < 0 && !memcmp(now, blk0, sb0 + GUARD),
              "the refused backward with another layer's block wrote %s%s", grad_name(which),
              memcmp(now, blk0, sb0 + GUARD) ? " and into that block" : "");
        free(now);
        grads_set(&g0);
        s0 = settle(L0, backward(L0, &P, &in, &g0, c->acc, r0.saved, sb0, &r0, NULL),
                    "backward (reading, again)");
        host_grads h = grads_fetch(&g0);
        which = grads_differ(&g0, &h0, &h);
        CHECK(s0 == SMOE_SUCCESS && which < 0,
              "the reading layer's backward with its block again: %s, %s differs",
              smoe_status_string(s0), grad_name(which));
        host_grads_free(&h);
    }

    /* a new forward fills the consumed block again */
    {
        CUDA_OK(cudaMemset(r1.saved, 0x5A, sb1));
        grads_set(&g1);
        s1 = settle(L1, forward(L1, &P, &in, &r1, NULL), "forward (consuming, again)");
        if (s1 == SMOE_SUCCESS)
            s1 = settle(L1, backward(L1, &P, &in, &g1, c->acc, r1.saved, sb1, &r1, NULL),
                        "backward (consuming, again)");
        CHECK(s1 == SMOE_SUCCESS, "forward + backward after the refusals failed");
        host_grads h = grads_fetch(&g1);
        which = grads_differ(&g1, &h0, &h);
        CHECK(which < 0, "after a new forward: %s differs from the reading backward's",
              grad_name(which));
        host_grads_free(&h);
    }

    /* the router slot (smoe_layer_drouter_slot): drouter_w written into the
     * consumed block gives the reading backward's bits, and every other
     * gradient too; accumulating there or writing past it is refused on the
     * host with nothing written. There is a slot where the consumed H holds
     * the router's buffers before it (split, tc, dla, wr2: sizes from
     * cuda_layer.cu's ws_make, 256-byte aligned) and E x d fp32 after them;
     * the test asks for one where H has room for all of it with margin. */
    if (g1.g[TU_GWR]) {
        size_t off = 1;
        const smoe_status ss = smoe_layer_drouter_slot(L1, T, np, &off);
        const size_t hb = (size_t)cap * (size_t)P.hc * 2, E_ = (size_t)c->E, d_ = (size_t)c->d;
        const size_t before = al256((size_t)T * 2 * E_ * 2) + al256((size_t)T * (size_t)c->K * 4) +
                              al256((size_t)cap * 4) + al256(2 * E_ * d_ * 2);
        const int roomy = hb >= before + E_ * d_ * 4 + 256;
        printf("  %-52s      router slot: %s", "", smoe_status_string(ss));
        if (ss == SMOE_SUCCESS) printf(" at %zu (H at %zu, %zu bytes)", off, sl.h, hb);
        printf("\n");
        CHECK(ss == SMOE_SUCCESS ? off % 256 == 0 && off >= sl.h && off + E_ * d_ * 4 <= sl.h + hb
                                 : ss == SMOE_ERROR_UNSUPPORTED && off == 1 && !roomy &&
                                       strstr(smoe_last_error(), "no room"),
              "router slot -> %s (%s), offset %zu; H [%zu, +%zu), room %d",
              smoe_status_string(ss), smoe_last_error(), off, sl.h, hb, roomy);
        if (ss == SMOE_SUCCESS) {
            dev_grads gs = g1;
            gs.g[TU_GWR] = (char *)r1.saved + off;
            grads_set(&g1);
            s1 = settle(L1, forward(L1, &P, &in, &r1, NULL), "forward (slot)");
            if (!c->acc) {
                ws_reset(&r1); /* the forward's part past the backward's size too */
                if (s1 == SMOE_SUCCESS)
                    s1 = settle(L1, backward(L1, &P, &in, &gs, 0, r1.saved, sb1, &r1, NULL),
                                "backward (drouter_w in the slot)");
                host_grads h = grads_fetch(&gs);
                which = s1 == SMOE_SUCCESS ? grads_differ(&gs, &h0, &h) : TU_GX;
                CHECK(which < 0 && guard_ok(r1.saved, sb1) && guard_ok(r1.ws, r1.wbb),
                      "with drouter_w in the slot: %s, %s differs from the reading backward's",
                      smoe_status_string(s1), grad_name(which));
                host_grads_free(&h);
                s1 = settle(L1, forward(L1, &P, &in, &r1, NULL), "forward (slot, again)");
            }
            /* refusals on a live block: nothing written */
            void *blk1 = tu_dev_fetch(r1.saved, sb1 + GUARD);
            grads_sentinel(&g1);
            for (int k = 0; k < 2; k++) {
                smoe_backward_args b = bwd_args(&P, &in, &gs, 0);
                if (k == 0) b.drouter_w.accumulate = 1;
                else b.drouter_w.ptr = (char *)r1.saved + off + 256;
                const smoe_status sr = smoe_layer_backward(L1, &b, r1.saved, sb1, r1.ws, r1.wbb,
                                                           NULL);
                CHECK(sr == SMOE_ERROR_INVALID_VALUE &&
                          strstr(smoe_last_error(), k == 0 ? "accumulate" : "overlaps"),
                      "drouter_w %s -> %s (%s)", k == 0 ? "accumulating in the slot" : "past it",
                      smoe_status_string(sr), smoe_last_error());
            }
            which = grads_touched(&g1);
            void *now = tu_dev_fetch(r1.saved, sb1 + GUARD);
            CHECK(s1 == SMOE_SUCCESS && which < 0 && !memcmp(now, blk1, sb1 + GUARD),
                  "the refused slot backwards wrote %s%s", grad_name(which),
                  memcmp(now, blk1, sb1 + GUARD) ? " or into the block" : "");
            free(now);
            free(blk1);
        }
    } else if (general) {
        size_t off = 1;
        const smoe_status ss = smoe_layer_drouter_slot(L1, T, np, &off);
        CHECK(ss == SMOE_ERROR_UNSUPPORTED && off == 1 && strstr(smoe_last_error(), "GENERAL"),
              "router slot of a GENERAL layer -> %s (%s)", smoe_status_string(ss),
              smoe_last_error());
    }

    /* the consuming layer's forward + backward in a CUDA graph, replayed
     * twice: each replay fills the block and consumes it */
    if (c->graph) {
        cudaStream_t s;
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        s1 = forward(L1, &P, &in, &r1, s);
        if (s1 == SMOE_SUCCESS) s1 = backward(L1, &P, &in, &g1, c->acc, r1.saved, sb1, &r1, s);
        cudaError_t ce = cudaStreamEndCapture(s, &graph);
        if (s1 == SMOE_SUCCESS && ce == cudaSuccess)
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        for (int rep = 0; rep < 2; rep++) {
            smoe_status gs = s1;
            which = -1;
            if (exec) {
                grads_set(&g1);
                /* grads_set's copies ran on the legacy stream, which s does
                 * not wait for */
                CUDA_OK(cudaDeviceSynchronize());
                CUDA_OK(cudaGraphLaunch(exec, s));
                gs = smoe_layer_device_status(L1, s, 1);
                host_grads h = grads_fetch(&g1);
                which = grads_differ(&g1, &h0, &h);
                host_grads_free(&h);
            }
            CHECK(exec && gs == SMOE_SUCCESS && which < 0,
                  "CUDA graph replay %d: capture %s (%s), status %s (%s), %s differs", rep,
                  smoe_status_string(s1), cudaGetErrorString(ce), smoe_status_string(gs),
                  smoe_last_error(), grad_name(which));
        }
        if (exec) CUDA_OK(cudaGraphExecDestroy(exec));
        if (graph) CUDA_OK(cudaGraphDestroy(graph));
        CUDA_OK(cudaStreamDestroy(s));
    }

    host_grads_free(&h0);
    free(blk0);
    grads_free(&g0);
    grads_free(&g1);
    dev_run_free(&r0);
    dev_run_free(&r1);
    dev_in_free(&in);
    free(dout);
    free(extra);
    tu_problem_free(&P);
    smoe_layer_free(L0);
    smoe_layer_free(L1);
}

/* ------------------------------------------------------------ main */

int main(int argc, char **argv)
{
    uint64_t seed = 20261127;
    int only = 0; /* 0: both backends; else the one named */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sm80")) only = SMOE_BACKEND_CUDA;
        else if (!strcmp(argv[i], "--sm90")) only = SMOE_BACKEND_SM90;
        else seed = strtoull(argv[i], NULL, 0);
    }
    tu_seed = seed;
    const int cc = tu_gpu_cc("test_saved_gpu");
    if (!cc) return 0;
    if (only == SMOE_BACKEND_SM90 && cc != 90) {
        printf("test_saved_gpu: the device is sm_%d, not sm_90: --sm90 skipped\n", cc);
        return 0;
    }

    /* the backends: AUTO's pick (Hopper on sm_90), then the portable one */
    smoe_backend list[2];
    int nb = 0;
    if (only) {
        list[nb++] = (smoe_backend)only;
    } else {
        smoe_layer_desc D = smoe_layer_desc_default();
        D.d = 64; D.n = 64; D.E = 4; D.K = 2;
        smoe_layer *L = NULL;
        tu_case("AUTO's backend");
        CHECK_OK(smoe_layer_create(&D, &L));
        if (L && smoe_layer_backend(L) != SMOE_BACKEND_CPU) list[nb++] = smoe_layer_backend(L);
        smoe_layer_free(L);
        if (nb == 0 || list[0] != SMOE_BACKEND_CUDA) list[nb++] = SMOE_BACKEND_CUDA;
    }
    for (int b = 0; b < nb; b++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        D.d = 64; D.n = 64; D.E = 4; D.K = 2;
        D.backend = list[b];
        smoe_layer *L = NULL;
        if (smoe_layer_create(&D, &L) == SMOE_SUCCESS)
            printf("test_saved_gpu: backend %s, path \"%s\"\n", backend_name(list[b]),
                   smoe_layer_path_name(L));
        smoe_layer_free(L);
        for (int i = 0; i < NCASES; i++) run_case(&g_cases[i], list[b], seed * 100 + (uint64_t)i);
    }
    return tu_summary("test_saved_gpu");
}
