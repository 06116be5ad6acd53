/*
 * test_layer_gpu.c -- the CUDA backend against the CPU oracle.
 *
 * For each case (a random shape, routing mode, activation, W1 layout, bias
 * setting, gradient dtype and accumulate flag; seeded):
 *   - the GPU layer runs forward + backward; its saved block is read back;
 *   - routing: smoe_route_cpu on the GPU's own fp32 router logits must give
 *     bit for bit the GPU's routed experts, scores (and token-rounding
 *     triples); the metadata (expert offsets, rows sorted by expert then
 *     token, assign_row a permutation, row_token/row_score, expert_counts)
 *     must be consistent;
 *   - the CPU layer in F64 (exact reference) and in BF16 (the
 *     bf16-rounding reference) run the same problem; when their routing
 *     differs from the GPU's (a near-tie the fp32 logits of two different
 *     GEMMs resolve differently) the case is redrawn, counted, and may not
 *     happen often;
 *   - FA3's rule on O, dX, dWr, dW1, dW2, db1, db2 (and GENERAL's score
 *     gradient): err(gpu, f64) <= 2 err(bf16 cpu, f64) + atol, errors
 *     relative to the reference's largest magnitude;
 *   - determinism: a second run (outputs poisoned first) is bit-identical;
 *   - some cases: forward + backward captured in a CUDA graph on a fresh
 *     stream, replayed, bit-identical to the eager run;
 *   - inference forward: nothing saved, same output as training (token
 *     choice modes).
 * SIGMOID_TOPK (expert bias, groups, renormalisation, scaling) runs as
 * extra random cases after the fixed ones.
 * Plus: F32 storage and unaligned sizes rejected at create time. (The
 * device-side checks, GENERAL triples and the saved block's header, are in
 * test_bad_input_gpu.)
 *
 * Usage: test_layer_gpu [seed] [--small] [--sm80|--sm90] [--only-case N [--repeat R]]
 * (--only-case N: only the N-th random case, drawn as in a full run, R
 * times: a case that failed once, run alone or under load.)
 * (--small: small shapes only, for compute-sanitizer; every row of the
 * Hopper tile tables is tested on its own in test_gemm_sm90). Exit code 0
 * when every check passed; a GPU-less machine skips (exit 0, says so).
 */
#include "smoe.h"
#include "smoe_internal.h"
#include "testutil.h"

#include "testutil_cuda.h"

static smoe_backend g_backend = SMOE_BACKEND_AUTO;

static int g_small = 0;
static int g_skipped = 0, g_cases = 0;

/* ------------------------------------------------------------ one run */

enum { G_DX, G_DWR, G_DW1, G_DB1, G_DW2, G_DB2, G_DPS, G_N };
static const char *g_names[G_N] = {"dX", "dWr", "dW1", "db1", "dW2", "db2", "dpair_score"};

typedef struct run_cfg {
    smoe_dtype gdt;  /* gradient dtype (F64 layer: F64) */
    int acc;         /* accumulate into G0 */
    int graph;       /* GPU: capture forward+backward in a CUDA graph */
    int inference;   /* forward only, inference */
    const float *extra; /* dlogits_extra (T, E) on the host, or NULL */
    int lowp_router; /* router_logits and dlogits_extra in the layer's dtype */
} run_cfg;

typedef struct run_out {
    double *out;          /* (T, d) */
    double *g[G_N];       /* gradients; NULL where absent */
    size_t gn[G_N];
    float *logits;        /* (T, E) or NULL */
    uint16_t *logits16;   /* (T, E) bf16 bits (lowp_router) or NULL */
    int32_t *counts;      /* (E) */
    void *saved;          /* host copy */
    smoe_saved_layout sl;
    void *raw_out, *raw_g[G_N]; /* raw bytes, for bit comparison */
    size_t raw_out_n, raw_g_n[G_N];
    smoe_status st;
} run_out;

static void run_out_free(run_out *r)
{
    free(r->out);
    free(r->logits);
    free(r->logits16);
    free(r->counts);
    free(r->saved);
    free(r->raw_out);
    for (int i = 0; i < G_N; i++) {
        free(r->g[i]);
        free(r->raw_g[i]);
    }
    memset(r, 0, sizeof *r);
}

/* Gradient sizes and whether the problem has them. */
static size_t grad_elems(const tu_problem *P, int i)
{
    const smoe_layer_desc *D = &P->desc;
    const int general = D->routing == SMOE_ROUTING_GENERAL;
    switch (i) {
    case G_DX: return (size_t)(P->T * D->d);
    case G_DWR: return general ? 0 : (size_t)(D->E * D->d);
    case G_DW1: return (size_t)(D->E * P->hc * D->d);
    case G_DB1: return D->has_bias ? (size_t)(D->E * P->hc) : 0;
    case G_DW2: return (size_t)(D->E * D->d * D->n);
    case G_DB2: return D->has_bias ? (size_t)(D->E * D->d) : 0;
    case G_DPS: return general ? (size_t)P->pairs : 0;
    }
    return 0;
}

/* Deterministic initial gradient values for accumulate=1. */
static double g0_value(int i, size_t j) { return 0.01 * (double)((j * 7 + (size_t)i * 3) % 11) - 0.05; }

static void *mem_alloc(int gpu, size_t n)
{
    if (gpu) return tu_dev_alloc(n);
    void *p = malloc(n ? n : 16);
    return p;
}
static void mem_free(int gpu, void *p)
{
    if (gpu) cudaFree(p);
    else free(p);
}
static void *mem_put(int gpu, const void *h, size_t n)
{
    if (gpu) return tu_dev_put(h, n);
    void *p = malloc(n ? n : 16);
    if (n) memcpy(p, h, n);
    return p;
}
static void *mem_get(int gpu, const void *p, size_t n)
{
    if (gpu) return tu_dev_fetch(p, n);
    void *h = malloc(n ? n : 1);
    if (n) memcpy(h, p, n);
    return h;
}
static void mem_fill(int gpu, void *p, int byte, size_t n)
{
    if (!n) return;
    if (gpu) CUDA_OK(cudaMemset(p, byte, n));
    else memset(p, byte, n);
}

/* Runs forward (+ backward unless inference) of layer L on problem P;
 * tensors in the layer's dtype, gradients in cfg->gdt. */
static void run_layer(smoe_layer *L, const tu_problem *P, const double *dout, const run_cfg *cfg,
                      run_out *R)
{
    const smoe_layer_desc D = smoe_layer_get_desc(L);
    const int gpu = smoe_layer_backend(L) != SMOE_BACKEND_CPU;
    const int general = D.routing == SMOE_ROUTING_GENERAL;
    const smoe_dtype dt = D.dtype;
    const size_t es = tu_dtype_size(dt);
    const int64_t T = P->T, d = D.d, n = D.n, E = D.E, hc = P->hc;
    const int64_t np = general ? P->pairs : 0;
    memset(R, 0, sizeof *R);

    void *hx = tu_to_dtype(dt, P->x, (size_t)(T * d));
    void *hwr = tu_to_dtype(dt, P->wr, (size_t)(E * d));
    void *hw1 = tu_to_dtype(dt, P->w1, (size_t)(E * hc * d));
    void *hw2 = tu_to_dtype(dt, P->w2, (size_t)(E * d * n));
    void *hdo = tu_to_dtype(dt, dout, (size_t)(T * d));
    void *x = mem_put(gpu, hx, (size_t)(T * d) * es);
    void *wr = mem_put(gpu, hwr, (size_t)(E * d) * es);
    void *w1 = mem_put(gpu, hw1, (size_t)(E * hc * d) * es);
    void *w2 = mem_put(gpu, hw2, (size_t)(E * d * n) * es);
    void *dO = mem_put(gpu, hdo, (size_t)(T * d) * es);
    void *b1 = NULL, *b2 = NULL;
    if (D.has_bias) {
        void *hb1 = tu_to_dtype(dt, P->b1, (size_t)(E * hc));
        void *hb2 = tu_to_dtype(dt, P->b2, (size_t)(E * d));
        b1 = mem_put(gpu, hb1, (size_t)(E * hc) * es);
        b2 = mem_put(gpu, hb2, (size_t)(E * d) * es);
        free(hb1);
        free(hb2);
    }
    free(hx); free(hwr); free(hw1); free(hw2); free(hdo);
    void *pt = NULL, *pe = NULL, *ps = NULL;
    if (general) {
        float *hs = (float *)malloc((size_t)np * 4 + 4);
        for (int64_t i = 0; i < np; i++) hs[i] = (float)P->ps[i];
        pt = mem_put(gpu, P->pt, (size_t)np * 4);
        pe = mem_put(gpu, P->pe, (size_t)np * 4);
        ps = mem_put(gpu, hs, (size_t)np * 4);
        free(hs);
    }
    float *ebias = NULL;
    if (P->ebias) {
        float *hb = (float *)malloc((size_t)E * 4);
        for (int64_t e = 0; e < E; e++) hb[e] = (float)P->ebias[e];
        ebias = (float *)mem_put(gpu, hb, (size_t)E * 4);
        free(hb);
    }
    const size_t out_b = (size_t)(T * d) * es;
    void *out = mem_alloc(gpu, out_b);
    const size_t lgs = cfg->lowp_router ? es : 4;
    void *logits = general ? NULL : mem_alloc(gpu, (size_t)(T * E) * lgs);
    int32_t *counts = (int32_t *)mem_alloc(gpu, (size_t)E * 4);
    const size_t saved_b = cfg->inference ? 0 : smoe_layer_saved_bytes(L, T, np);
    const size_t ws_b = smoe_layer_workspace_bytes(L, T, np);
    void *saved = saved_b ? mem_alloc(gpu, saved_b) : NULL;
    void *ws = mem_alloc(gpu, ws_b);
    if (saved) mem_fill(gpu, saved, 0x5A, saved_b);

    /* gradients */
    void *gbuf[G_N] = {0};
    void *g0raw[G_N] = {0};
    size_t gbytes[G_N] = {0};
    for (int i = 0; i < G_N && !cfg->inference; i++) {
        size_t ne = grad_elems(P, i);
        if (!ne) continue;
        smoe_dtype gd = i == G_DPS ? SMOE_DTYPE_F32 : cfg->gdt;
        gbytes[i] = ne * tu_dtype_size(gd);
        double *g0 = tu_alloc_d(ne);
        for (size_t j = 0; j < ne; j++) g0[j] = cfg->acc ? g0_value(i, j) : 0.0;
        g0raw[i] = tu_to_dtype(gd, g0, ne);
        free(g0);
        gbuf[i] = mem_alloc(gpu, gbytes[i]);
    }

    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T;
    fa.x = x;
    fa.router_w = general ? NULL : wr;
    fa.pairs = np;
    fa.pair_token = (const int32_t *)pt;
    fa.pair_expert = (const int32_t *)pe;
    fa.pair_score = (const float *)ps;
    fa.w1 = w1; fa.b1 = b1; fa.w2 = w2; fa.b2 = b2;
    fa.out = out;
    fa.router_logits = logits;
    fa.router_logits_dtype = cfg->lowp_router ? dt : SMOE_DTYPE_F32;
    fa.expert_counts = counts;
    fa.inference = cfg->inference;
    fa.expert_bias = ebias;

    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T;
    ba.x = x;
    ba.router_w = general ? NULL : wr;
    ba.pairs = np;
    ba.w1 = w1; ba.w2 = w2; ba.b2 = b2;
    ba.dout = dO;
    void *dextra = NULL;
    if (cfg->extra && !general) {
        if (cfg->lowp_router) {
            double *xd = tu_alloc_d((size_t)(T * E));
            for (int64_t i = 0; i < T * E; i++) xd[i] = (double)cfg->extra[i];
            void *xl = tu_to_dtype(dt, xd, (size_t)(T * E));
            dextra = mem_put(gpu, xl, (size_t)(T * E) * es);
            free(xd);
            free(xl);
            ba.dlogits_extra_dtype = dt;
        } else {
            dextra = mem_put(gpu, cfg->extra, (size_t)(T * E) * 4);
        }
        ba.dlogits_extra = dextra;
    }
    smoe_grad *gs[G_N] = {&ba.dx, &ba.drouter_w, &ba.dw1, &ba.db1, &ba.dw2, &ba.db2,
                          &ba.dpair_score};
    for (int i = 0; i < G_N; i++) {
        if (!gbuf[i]) continue;
        gs[i]->ptr = gbuf[i];
        gs[i]->dtype = i == G_DPS ? SMOE_DTYPE_F32 : cfg->gdt;
        gs[i]->accumulate = cfg->acc;
    }

    /* poison outputs, set accumulators */
    mem_fill(gpu, out, 0xFF, out_b);
    for (int i = 0; i < G_N; i++) {
        if (!gbuf[i]) continue;
        if (cfg->acc) {
            if (gpu) CUDA_OK(cudaMemcpy(gbuf[i], g0raw[i], gbytes[i], cudaMemcpyHostToDevice));
            else memcpy(gbuf[i], g0raw[i], gbytes[i]);
        } else {
            mem_fill(gpu, gbuf[i], 0xFF, gbytes[i]);
        }
    }

    smoe_status st = SMOE_SUCCESS;
    if (gpu && cfg->graph) {
        cudaStream_t s;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        /* the uploads and the poison above ran on the legacy stream, which a
         * non-blocking stream does not wait for (cudaMemset returns at once,
         * a pageable cudaMemcpy before its DMA ends): without this the graph
         * raced them whenever the GPU was busy (another process on it) */
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        st = smoe_layer_forward(L, &fa, saved, saved_b, ws, ws_b, s);
        if (st == SMOE_SUCCESS) st = smoe_layer_backward(L, &ba, saved, saved_b, ws, ws_b, s);
        cudaError_t ce = cudaStreamEndCapture(s, &graph);
        if (st == SMOE_SUCCESS && ce == cudaSuccess) {
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            CUDA_OK(cudaGraphLaunch(exec, s));
            CUDA_OK(cudaStreamSynchronize(s));
            CUDA_OK(cudaGraphExecDestroy(exec));
            CUDA_OK(cudaGraphDestroy(graph));
        } else if (ce != cudaSuccess) {
            fprintf(stderr, "graph capture: %s\n", cudaGetErrorString(ce));
            if (st == SMOE_SUCCESS) st = SMOE_ERROR_BACKEND;
        }
        CUDA_OK(cudaStreamDestroy(s));
    } else {
        st = smoe_layer_forward(L, &fa, saved, saved_b, ws, ws_b, NULL);
        if (st == SMOE_SUCCESS && !cfg->inference)
            st = smoe_layer_backward(L, &ba, saved, saved_b, ws, ws_b, NULL);
        if (gpu) CUDA_OK(cudaDeviceSynchronize());
    }
    if (st == SMOE_SUCCESS) {
        smoe_status cs = smoe_layer_device_status(L, NULL, 1);
        if (cs != SMOE_SUCCESS) st = cs;
    }
    R->st = st;
    if (st != SMOE_SUCCESS)
        fprintf(stderr, "run_layer (%s): %s: %s\n", smoe_layer_path_name(L),
                smoe_status_string(st), smoe_last_error());

    R->raw_out = mem_get(gpu, out, out_b);
    R->raw_out_n = out_b;
    R->out = tu_from_dtype(dt, R->raw_out, (size_t)(T * d));
    if (logits && cfg->lowp_router)
        R->logits16 = (uint16_t *)mem_get(gpu, logits, (size_t)(T * E) * 2);
    else if (logits)
        R->logits = (float *)mem_get(gpu, logits, (size_t)(T * E) * 4);
    R->counts = (int32_t *)mem_get(gpu, counts, (size_t)E * 4);
    for (int i = 0; i < G_N; i++) {
        if (!gbuf[i]) continue;
        smoe_dtype gd = i == G_DPS ? SMOE_DTYPE_F32 : cfg->gdt;
        R->raw_g[i] = mem_get(gpu, gbuf[i], gbytes[i]);
        R->raw_g_n[i] = gbytes[i];
        R->gn[i] = grad_elems(P, i);
        R->g[i] = tu_from_dtype(gd, R->raw_g[i], R->gn[i]);
    }
    if (saved) {
        R->saved = mem_get(gpu, saved, saved_b);
        int64_t cap = smoe_row_capacity(L, T, np, 0);
        smoe_saved_layout_make(L, T, cap, &R->sl);
    }

    mem_free(gpu, x); mem_free(gpu, wr); mem_free(gpu, w1); mem_free(gpu, w2);
    mem_free(gpu, dO); mem_free(gpu, b1); mem_free(gpu, b2);
    mem_free(gpu, pt); mem_free(gpu, pe); mem_free(gpu, ps);
    mem_free(gpu, out); mem_free(gpu, logits); mem_free(gpu, counts);
    if (ebias) mem_free(gpu, ebias);
    mem_free(gpu, saved); mem_free(gpu, ws);
    if (dextra) mem_free(gpu, dextra);
    for (int i = 0; i < G_N; i++) {
        if (gbuf[i]) mem_free(gpu, gbuf[i]);
        free(g0raw[i]);
    }
}

/* ------------------------------------------------------------ routing checks */

typedef struct routed {
    int64_t R;
    int32_t *tok, *ex; /* (R) token-major */
    double *sc;
} routed;

/* The routed pairs in a saved block (token-major), scores as stored. */
static routed routed_from_saved(const run_out *r, int64_t T, int f64)
{
    routed o;
    const char *b = (const char *)r->saved;
    const int32_t *toff = (const int32_t *)(b + r->sl.token_offset);
    const uint16_t *aexp = (const uint16_t *)(b + r->sl.assign_expert);
    const int32_t *arow = (const int32_t *)(b + r->sl.assign_row);
    o.R = toff[T];
    o.tok = (int32_t *)malloc((size_t)o.R * 4 + 4);
    o.ex = (int32_t *)malloc((size_t)o.R * 4 + 4);
    o.sc = (double *)malloc((size_t)o.R * 8 + 8);
    for (int64_t t = 0; t < T; t++)
        for (int32_t a = toff[t]; a < toff[t + 1]; a++) {
            o.tok[a] = (int32_t)t;
            o.ex[a] = aexp[a];
            const int32_t row = arow[a];
            o.sc[a] = f64 ? ((const double *)(b + r->sl.row_score))[row]
                          : (double)((const float *)(b + r->sl.row_score))[row];
        }
    return o;
}

static void routed_free(routed *o)
{
    free(o->tok);
    free(o->ex);
    free(o->sc);
}

/* Same selection (tokens, experts)? */
static int same_selection(const routed *a, const routed *b)
{
    if (a->R != b->R) return 0;
    for (int64_t i = 0; i < a->R; i++)
        if (a->tok[i] != b->tok[i] || a->ex[i] != b->ex[i]) return 0;
    return 1;
}

/* The GPU's saved metadata is self-consistent. */
static void check_metadata(const run_out *r, const smoe_layer_desc *D, int64_t T)
{
    const char *b = (const char *)r->saved;
    const int64_t E = D->E;
    const int32_t *toff = (const int32_t *)(b + r->sl.token_offset);
    const int32_t *eoff = (const int32_t *)(b + r->sl.expert_offset);
    const uint16_t *aexp = (const uint16_t *)(b + r->sl.assign_expert);
    const int32_t *arow = (const int32_t *)(b + r->sl.assign_row);
    const int32_t *rtok = (const int32_t *)(b + r->sl.row_token);
    const float *rsc = (const float *)(b + r->sl.row_score);
    const int64_t R = toff[T];
    int ok = eoff[0] == 0 && eoff[E] == R && R <= r->sl.cap;
    for (int64_t e = 0; e < E && ok; e++) {
        ok &= eoff[e + 1] >= eoff[e];
        ok &= r->counts[e] == eoff[e + 1] - eoff[e];
        for (int32_t row = eoff[e] + 1; row < eoff[e + 1] && ok; row++)
            ok &= rtok[row] > rtok[row - 1];
    }
    CHECK(ok, "expert offsets / counts / rows sorted by token (R=%lld)", (long long)R);
    if (!ok) return;
    char *hit = (char *)calloc((size_t)R + 1, 1);
    int ok2 = 1;
    for (int64_t t = 0; t < T && ok2; t++) {
        ok2 &= toff[t + 1] >= toff[t];
        for (int32_t a = toff[t]; a < toff[t + 1] && ok2; a++) {
            int32_t row = arow[a];
            if (row < 0 || row >= R || hit[row]) { ok2 = 0; break; }
            hit[row] = 1;
            ok2 &= rtok[row] == t;
            ok2 &= row >= eoff[aexp[a]] && row < eoff[aexp[a] + 1];
            (void)rsc;
        }
    }
    CHECK(ok2, "assign_row is a permutation matching row_token and the expert ranges");
    free(hit);
}

/* GPU routing vs smoe_route_cpu on the GPU's logits: bit-exact. */
static void check_routing_exact(const run_out *g, const smoe_layer_desc *D, int64_t T,
                                const double *ebias)
{
    float *bias = NULL;
    if (ebias) {
        bias = (float *)malloc((size_t)D->E * 4);
        for (int64_t e = 0; e < D->E; e++) bias[e] = (float)ebias[e];
    }
    const int64_t E = D->E, K = D->K;
    routed gr = routed_from_saved(g, T, 0);
    smoe_routing_result res;
    memset(&res, 0, sizeof res);
    int64_t np = 0;
    const int tr = D->rounding != SMOE_ROUND_OFF;
    int64_t cap = tr ? T * E : T * K;
    res.expert = (int32_t *)malloc((size_t)(T * K) * 4 + 4);
    res.score = (float *)malloc((size_t)(T * K) * 4 + 4);
    res.cap = cap;
    res.pair_token = (int32_t *)malloc((size_t)cap * 4 + 4);
    res.pair_expert = (int32_t *)malloc((size_t)cap * 4 + 4);
    res.pair_score = (float *)malloc((size_t)cap * 4 + 4);
    res.pairs = &np;
    CHECK_OK(smoe_route_cpu_biased(D, T, g->logits, bias, &res));
    int ok = 1;
    int64_t bad = -1;
    if (tr) {
        ok = np == gr.R;
        for (int64_t i = 0; i < np && ok; i++) {
            float gs = (float)gr.sc[i];
            if (res.pair_token[i] != gr.tok[i] || res.pair_expert[i] != gr.ex[i] ||
                memcmp(&gs, &res.pair_score[i], 4) != 0) {
                ok = 0;
                bad = i;
            }
        }
    } else {
        ok = gr.R == T * K;
        for (int64_t i = 0; i < T * K && ok; i++) {
            float gs = (float)gr.sc[i];
            if (res.expert[i] != gr.ex[i] || memcmp(&gs, &res.score[i], 4) != 0) {
                ok = 0;
                bad = i;
            }
        }
    }
    CHECK(ok, "GPU routing == smoe_route_cpu on the GPU's logits, bit for bit (R %lld vs %lld, "
              "first difference at pair %lld)",
          (long long)gr.R, (long long)(tr ? np : T * K), (long long)bad);
    free(res.expert); free(res.score); free(res.pair_token); free(res.pair_expert);
    free(res.pair_score);
    free(bias);
    routed_free(&gr);
}

/* ------------------------------------------------------------ comparisons */

static void check_rule(const char *what, const double *gpu, const double *b16, const double *f64,
                       size_t n, double atol)
{
    if (!n) return;
    double eg = tu_rel_err(gpu, f64, n), eb = tu_rel_err(b16, f64, n);
    size_t i = tu_argmax_diff(gpu, f64, n);
    CHECK(eg <= 2.0 * eb + atol,
          "%s: err(gpu) %.3g > 2 * err(bf16 cpu) %.3g + %.1g (worst at %zu: gpu %.8g, f64 %.8g)",
          what, eg, eb, atol, i, gpu[i], f64[i]);
}

static int bits_equal(const void *a, const void *b, size_t n)
{
    return n == 0 || memcmp(a, b, n) == 0;
}

static void check_bitwise(const char *what, const run_out *a, const run_out *b)
{
    int ok = a->st == b->st && bits_equal(a->raw_out, b->raw_out, a->raw_out_n);
    CHECK(ok, "%s: out differs", what);
    for (int i = 0; i < G_N; i++) {
        if (!a->raw_g[i]) continue;
        CHECK(b->raw_g[i] && bits_equal(a->raw_g[i], b->raw_g[i], a->raw_g_n[i]),
              "%s: %s differs", what, g_names[i]);
    }
}

/* ------------------------------------------------------------ one case */

typedef struct case_cfg {
    int64_t T, d, n, E, K;
    smoe_activation act;
    smoe_w1_layout layout;
    int bias;
    smoe_routing routing;
    int renorm;
    smoe_rounding rounding;
    int64_t M;
    int skew;        /* 1: most tokens prefer expert 0 */
    double gprob;    /* GENERAL: pair probability */
    smoe_dtype gdt;
    int acc, graph;
    int extra;       /* pass a dlogits_extra (not GENERAL) */
    int64_t G, g;    /* SIGMOID_TOPK: groups (0: none) */
    double scale;    /* SIGMOID_TOPK: routed_scaling */
} case_cfg;

static const char *act_names[] = {"swiglu", "geglu", "reglu", "relu2", "relu", "silu", "gelu"};
static const char *routing_names[] = {"topk_softmax", "softmax_topk", "general", "sigmoid_topk"};
static const char *rounding_names[] = {"off", "up", "down", "nearest"};

/* Returns 0 when the case was redrawn (routing near-tie). */
static int run_case(const case_cfg *c, uint64_t seed)
{
    tu_rng rng = tu_rng_make(seed);
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = c->d; D.n = c->n; D.E = c->E; D.K = c->K;
    D.activation = c->act;
    D.w1_layout = c->layout;
    D.has_bias = c->bias;
    D.routing = c->routing;
    D.renormalize = c->renorm;
    D.rounding = c->rounding;
    D.round_tile = c->M;
    if (c->routing == SMOE_ROUTING_SIGMOID_TOPK) {
        D.n_group = c->G;
        D.topk_group = c->g;
        D.routed_scaling = c->scale;
    }
    tu_case("seed=%llu T=%lld d=%lld n=%lld E=%lld K=%lld %s %s %s bias=%d groups=%lld/%lld "
            "scale=%g renorm=%d round=%s M=%lld skew=%d gdt=%s acc=%d graph=%d extra=%d",
            (unsigned long long)seed, (long long)c->T, (long long)c->d, (long long)c->n,
            (long long)c->E, (long long)c->K, act_names[c->act],
            c->layout ? "concat" : "interleaved", routing_names[c->routing], c->bias,
            (long long)D.topk_group, (long long)D.n_group, D.routed_scaling, c->renorm,
            rounding_names[c->rounding], (long long)c->M, c->skew,
            c->gdt == SMOE_DTYPE_F32 ? "f32" : "bf16", c->acc, c->graph, c->extra);

    tu_problem P;
    D.dtype = SMOE_DTYPE_BF16;
    tu_problem_init(&P, &D, c->T, &rng, 1.0, 1.0 / sqrt((double)c->d));
    /* router weights ~ 1/sqrt(d): softmax neither flat nor one-hot */
    for (int64_t i = 0; i < c->E * c->d; i++) P.wr[i] *= 2.0 / sqrt((double)c->d);
    if (c->skew)
        for (int64_t t = 0; t < c->T; t++) P.x[t * c->d] = 3.0 + 0.5 * tu_uniform(&rng);
    if (c->skew)
        for (int64_t j = 0; j < c->d; j++) P.wr[j] = j == 0 ? 2.0 : P.wr[j] * 0.2;
    tu_round_array(SMOE_DTYPE_BF16, P.x, (size_t)(c->T * c->d));
    tu_round_array(SMOE_DTYPE_BF16, P.wr, (size_t)(c->E * c->d));
    if (c->routing == SMOE_ROUTING_GENERAL) tu_problem_general(&P, &rng, c->gprob);
    double *dout = tu_alloc_d((size_t)(c->T * c->d));
    tu_fill_normal(&rng, dout, (size_t)(c->T * c->d), 1.0);
    tu_round_array(SMOE_DTYPE_BF16, dout, (size_t)(c->T * c->d));

    float *extra = NULL;
    smoe_layer *Lg = NULL, *Lb = NULL, *Lf = NULL;
    smoe_layer_desc Dg = D, Db = D, Df = D;
    Dg.backend = g_backend;
    Db.backend = SMOE_BACKEND_CPU;
    Df.backend = SMOE_BACKEND_CPU;
    Df.dtype = SMOE_DTYPE_F64;
    CHECK_OK(smoe_layer_create(&Dg, &Lg));
    CHECK_OK(smoe_layer_create(&Db, &Lb));
    CHECK_OK(smoe_layer_create(&Df, &Lf));
    int kept = 1;
    if (!Lg || !Lb || !Lf || smoe_layer_backend(Lg) == SMOE_BACKEND_CPU) {
        CHECK(0, "layer creation (gpu backend %d)", Lg ? (int)smoe_layer_backend(Lg) : -1);
        goto done;
    }

    if (c->extra && c->routing != SMOE_ROUTING_GENERAL) {
        extra = (float *)malloc((size_t)(c->T * c->E) * 4);
        for (int64_t i = 0; i < c->T * c->E; i++) extra[i] = (float)(0.3 * tu_normal(&rng));
    }
    run_cfg cg = {c->gdt, c->acc, 0, 0, extra, 0};
    run_cfg cf = {SMOE_DTYPE_F64, c->acc, 0, 0, extra, 0};
    run_out rg, rg2, rb, rf;
    run_layer(Lg, &P, dout, &cg, &rg);
    CHECK(rg.st == SMOE_SUCCESS, "gpu run failed");
    if (rg.st != SMOE_SUCCESS) {
        run_out_free(&rg);
        goto done;
    }
    run_layer(Lf, &P, dout, &cf, &rf);
    run_layer(Lb, &P, dout, &cg, &rb);
    CHECK(rf.st == SMOE_SUCCESS && rb.st == SMOE_SUCCESS, "cpu runs failed");

    /* routing: exact on the GPU's logits; same selection as the CPU's */
    if (c->routing != SMOE_ROUTING_GENERAL) check_routing_exact(&rg, &D, c->T, P.ebias);
    check_metadata(&rg, &D, c->T);
    {
        routed a = routed_from_saved(&rg, c->T, 0);
        routed f = routed_from_saved(&rf, c->T, 1);
        routed b = routed_from_saved(&rb, c->T, 0);
        int same = same_selection(&a, &f) && same_selection(&a, &b);
        routed_free(&a);
        routed_free(&f);
        routed_free(&b);
        if (!same) {
            kept = 0;
            g_skipped++;
        }
    }
    if (kept) {
        /* relu^2 squares H: a one-ulp difference in a bf16 H (fp32 vs double
         * accumulation rounding the other way) doubles in A, and with few
         * terms per output it shows at ~2^-7 of the largest value, however
         * lucky the CPU's rounding was. */
        const double atol = c->act == SMOE_ACT_RELU2 ? 8e-3 : 2e-3;
        check_rule("out", rg.out, rb.out, rf.out, (size_t)(c->T * c->d), atol);
        for (int i = 0; i < G_N; i++)
            if (rg.g[i]) check_rule(g_names[i], rg.g[i], rb.g[i], rf.g[i], rg.gn[i], atol);
    }

    /* determinism */
    run_layer(Lg, &P, dout, &cg, &rg2);
    check_bitwise("determinism (second run)", &rg, &rg2);
    run_out_free(&rg2);
    if (c->graph) {
        run_cfg cgg = cg;
        cgg.graph = 1;
        run_layer(Lg, &P, dout, &cgg, &rg2);
        CHECK(rg2.st == SMOE_SUCCESS, "graph capture run failed");
        check_bitwise("CUDA graph replay vs eager", &rg, &rg2);
        run_out_free(&rg2);
    }
    /* the router's tensors in bf16: router_logits the fp32 ones rounded,
     * and a dlogits_extra of bf16 values gives the fp32 one's gradients,
     * bit for bit */
    if (c->routing != SMOE_ROUTING_GENERAL) {
        float *x16 = NULL;
        if (extra) {
            x16 = (float *)malloc((size_t)(c->T * c->E) * 4);
            for (int64_t i = 0; i < c->T * c->E; i++)
                x16[i] = tu_bf16_to_f32(tu_f32_to_bf16(extra[i]));
        }
        run_cfg c32 = cg;
        c32.extra = x16;
        run_cfg c16 = c32;
        c16.lowp_router = 1;
        run_out r32, r16;
        run_layer(Lg, &P, dout, &c32, &r32);
        run_layer(Lg, &P, dout, &c16, &r16);
        CHECK(r32.st == SMOE_SUCCESS && r16.st == SMOE_SUCCESS, "bf16 router runs failed");
        if (r32.st == SMOE_SUCCESS && r16.st == SMOE_SUCCESS) {
            check_bitwise("router logits and dlogits_extra in bf16 vs fp32", &r32, &r16);
            int64_t bad = -1;
            for (int64_t i = 0; i < c->T * c->E && bad < 0; i++)
                if (tu_f32_to_bf16(r32.logits[i]) != r16.logits16[i]) bad = i;
            CHECK(bad < 0, "router_logits in bf16 differ from the fp32 ones rounded (first at "
                           "%lld: %04x, want %04x)",
                  (long long)bad, bad >= 0 ? r16.logits16[bad] : 0,
                  bad >= 0 ? tu_f32_to_bf16(r32.logits[bad]) : 0);
        }
        run_out_free(&r32);
        run_out_free(&r16);
        free(x16);
    }
    /* inference: token choice, nothing saved */
    {
        run_cfg ci = cg;
        ci.inference = 1;
        run_layer(Lg, &P, dout, &ci, &rg2);
        CHECK(rg2.st == SMOE_SUCCESS, "inference run failed");
        if (c->rounding == SMOE_ROUND_OFF)
            CHECK(bits_equal(rg.raw_out, rg2.raw_out, rg.raw_out_n),
                  "inference out != training out");
        else {
            run_out ri;
            run_layer(Lb, &P, dout, &ci, &ri);
            check_rule("inference out (token rounding off)", rg2.out, ri.out, ri.out,
                       (size_t)(c->T * c->d), 2e-2);
            run_out_free(&ri);
        }
        run_out_free(&rg2);
    }
    run_out_free(&rg);
    run_out_free(&rb);
    run_out_free(&rf);
done:
    smoe_layer_free(Lg);
    smoe_layer_free(Lb);
    smoe_layer_free(Lf);
    tu_problem_free(&P);
    free(dout);
    free(extra);
    return kept;
}

/* ------------------------------------------------------------ create */

static void test_create_rejects(void)
{
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 64; D.n = 32; D.E = 4; D.K = 2;
    D.backend = g_backend;
    smoe_layer *L = NULL;
    tu_case("create: F32 storage on the GPU");
    D.dtype = SMOE_DTYPE_F32;
    smoe_status st = smoe_layer_create(&D, &L);
    CHECK(st == SMOE_ERROR_UNSUPPORTED && L == NULL && strstr(smoe_last_error(), "bf16"),
          "F32 on CUDA: %s: %s", smoe_status_string(st), smoe_last_error());
    smoe_layer_free(L);
    L = NULL;
    tu_case("create: d not a multiple of 8");
    D.dtype = SMOE_DTYPE_BF16;
    D.d = 60;
    st = smoe_layer_create(&D, &L);
    CHECK(st == SMOE_ERROR_UNSUPPORTED && L == NULL, "d=60 on CUDA: %s: %s",
          smoe_status_string(st), smoe_last_error());
    smoe_layer_free(L);
    L = NULL;
    tu_case("create: AUTO with F32 falls back to the CPU");
    D.d = 64;
    D.dtype = SMOE_DTYPE_F32;
    D.backend = SMOE_BACKEND_AUTO;
    st = smoe_layer_create(&D, &L);
    CHECK(st == SMOE_SUCCESS && L && smoe_layer_backend(L) == SMOE_BACKEND_CPU,
          "AUTO + F32: %s: %s", smoe_status_string(st), smoe_last_error());
    smoe_layer_free(L);
}

/* ------------------------------------------------------------ main */

static case_cfg random_case(tu_rng *r, int i)
{
    static const int64_t ds[] = {8, 16, 24, 40, 64, 72, 136, 200};
    static const int64_t ns[] = {8, 16, 24, 40, 64, 136};
    case_cfg c;
    memset(&c, 0, sizeof c);
    c.d = ds[tu_int(r, 0, g_small ? 4 : 7)];
    c.n = ns[tu_int(r, 0, g_small ? 3 : 5)];
    if (i % 3 == 2) { /* multiples of 64: the shapes the Hopper kernels take */
        c.d = 64 * tu_int(r, 1, g_small ? 2 : 4);
        c.n = 64 * tu_int(r, 1, 2);
    }
    c.E = tu_int(r, 1, g_small ? 8 : 20);
    c.K = tu_int(r, 1, c.E < 6 ? c.E : 6);
    c.T = tu_int(r, 1, 4) == 1 ? tu_int(r, 1, 3) : tu_int(r, 1, g_small ? 80 : 300);
    c.act = (smoe_activation)(i % 7);
    c.layout = (smoe_w1_layout)tu_int(r, 0, 1);
    c.bias = (int)tu_int(r, 0, 1);
    const int mode = (int)(i % 5); /* 0 topk_softmax, 1 softmax_topk, 2 general, 3-4 rounding */
    c.routing = mode == 2 ? SMOE_ROUTING_GENERAL
                : mode == 0 ? SMOE_ROUTING_TOPK_SOFTMAX
                            : SMOE_ROUTING_SOFTMAX_TOPK;
    if (mode == 3) c.routing = SMOE_ROUTING_TOPK_SOFTMAX;
    c.renorm = (int)tu_int(r, 0, 1);
    c.rounding = mode >= 3 ? (smoe_rounding)tu_int(r, 1, 3) : SMOE_ROUND_OFF;
    static const int64_t Ms[] = {1, 4, 8, 16, 128};
    c.M = Ms[tu_int(r, 0, 4)];
    c.skew = tu_int(r, 0, 3) == 0;
    c.gprob = tu_range(r, 0.0, 0.6);
    c.gdt = tu_int(r, 0, 1) ? SMOE_DTYPE_F32 : SMOE_DTYPE_BF16;
    c.acc = (int)tu_int(r, 0, 2) == 0;
    c.graph = (i % 4) == 1;
    c.extra = tu_int(r, 0, 3) == 0;
    c.G = c.g = 0;
    c.scale = 1.0;
    return c;
}

/* A SIGMOID_TOPK case: random_case's shape and settings, E a multiple of 4
 * most of the time so groups apply (tu_set_groups), scaling 1 or 2.5. */
static case_cfg sigmoid_case(tu_rng *r, int i)
{
    case_cfg c = random_case(r, i);
    c.routing = SMOE_ROUTING_SIGMOID_TOPK;
    c.rounding = SMOE_ROUND_OFF;
    if (i % 3) c.E = 4 * tu_int(r, 1, g_small ? 2 : 8);
    if (c.K > c.E) c.K = c.E;
    smoe_layer_desc D = smoe_layer_desc_default();
    D.E = c.E;
    D.K = c.K;
    tu_set_groups(&D);
    if (i % 4 != 3) {
        c.G = D.n_group;
        c.g = D.topk_group;
    }
    c.scale = i % 2 ? 2.5 : 1.0;
    return c;
}

int main(int argc, char **argv)
{
    uint64_t seed = 20261121;
    int only = -1, repeat = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) g_small = 1;
        else if (!strcmp(argv[i], "--only-case") && i + 1 < argc) only = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sm80")) g_backend = SMOE_BACKEND_CUDA;
        else if (!strcmp(argv[i], "--sm90")) g_backend = SMOE_BACKEND_SM90;
        else seed = strtoull(argv[i], NULL, 0);
    }
    tu_seed = seed;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("test_layer_gpu: no CUDA device, skipped\n");
        return 0;
    }
    {
        /* the backend AUTO picks (Hopper when present), unless told */
        smoe_layer_desc D = smoe_layer_desc_default();
        D.d = 64; D.n = 64; D.E = 4; D.K = 2;
        D.backend = g_backend;
        smoe_layer *L = NULL;
        CHECK_OK(smoe_layer_create(&D, &L));
        if (L) printf("test_layer_gpu: backend %d, path \"%s\"\n", (int)smoe_layer_backend(L),
                      smoe_layer_path_name(L));
        if (L && g_backend == SMOE_BACKEND_AUTO) g_backend = smoe_layer_backend(L);
        smoe_layer_free(L);
    }

    test_create_rejects();

    tu_rng r = tu_rng_make(seed);
    const int ncases = g_small ? 12 : 70;
    if (only >= 0) { /* every case before it drawn, so that it is the same case */
        for (int i = 0; i <= only && i < ncases; i++) {
            case_cfg c = random_case(&r, i);
            if (i < only) continue;
            for (int k = 0; k < repeat; k++) {
                run_case(&c, seed * 1000 + (uint64_t)i);
                g_cases++;
            }
        }
        return tu_summary("test_layer_gpu");
    }
    for (int i = 0; i < ncases; i++) {
        case_cfg c = random_case(&r, i);
        uint64_t cs = seed * 1000 + (uint64_t)i;
        int tries = 0;
        while (!run_case(&c, cs) && tries < 3) {
            cs += 7919;
            tries++;
        }
        g_cases++;
    }
    /* fixed edge cases: T = 1; K = E; all tokens on one expert; empty experts;
     * sizes past one tile; a GENERAL problem with no pairs */
    {
        case_cfg c = random_case(&r, 0);
        c.T = 1; c.E = 5; c.K = 5; c.d = 40; c.n = 24; c.skew = 0;
        run_case(&c, seed + 1);
        c = random_case(&r, 1);
        c.T = 64; c.E = 6; c.K = 1; c.skew = 1; c.d = 72; c.n = 40;
        run_case(&c, seed + 2);
        c = random_case(&r, 0);
        c.T = 3; c.E = 16; c.K = 2; c.d = 24; c.n = 8;
        run_case(&c, seed + 3);
        c = random_case(&r, 2);
        c.gprob = 0.0;
        run_case(&c, seed + 4);
        c = random_case(&r, 3);
        c.rounding = SMOE_ROUND_UP; c.M = 128; c.T = 200; c.E = 4; c.K = 2;
        run_case(&c, seed + 5);
        if (!g_small) {
            c = random_case(&r, 0);
            c.T = 700; c.d = 264; c.n = 200; c.E = 12; c.K = 3; c.graph = 1;
            c.act = SMOE_ACT_SWIGLU;
            run_case(&c, seed + 6);
            c = random_case(&r, 4);
            c.T = 520; c.d = 136; c.n = 72; c.E = 8; c.K = 2; c.rounding = SMOE_ROUND_NEAREST;
            c.M = 32;
            run_case(&c, seed + 7);
        }
    }
    /* SIGMOID_TOPK: expert bias, groups, renormalisation, scaling */
    for (int i = 0; i < (g_small ? 4 : 16); i++) {
        case_cfg c = sigmoid_case(&r, i);
        uint64_t cs = seed * 1000 + 500 + (uint64_t)i;
        int tries = 0;
        while (!run_case(&c, cs) && tries < 3) {
            cs += 7919;
            tries++;
        }
        g_cases++;
    }
    tu_case("summary");
    CHECK(g_skipped * 5 <= g_cases, "%d of %d cases redrawn for routing near-ties", g_skipped,
          g_cases);
    printf("test_layer_gpu: %d random cases, %d redrawn (routing near-tie)\n", g_cases,
           g_skipped);
    return tu_summary("test_layer_gpu");
}
