/*
 * test_routing_gpu.cu -- the device routing (routing*.cu) and metadata
 * (metadata.cu) kernels alone, at the grid's sizes, against the host
 * routing (smoe_route_cpu) on the same fp32 logits:
 *   - token choice (TOPK_SOFTMAX, SOFTMAX_TOPK with and without
 *     renormalisation) and token rounding (up, down, nearest; on both): the
 *     routed experts, scores and token-rounding triples bit for bit;
 *   - logits with many exact ties (a few quantised values, +0 and -0, -inf)
 *     so both tie-breaks (lower expert; lower token) are exercised;
 *   - SIGMOID_TOPK (k_route_sigmoid): experts and scores bit for bit with
 *     smoe_route_cpu_biased, with and without an expert bias (random,
 *     quantised so keys tie, non-finite), groups (several kept, all kept,
 *     groups of 2), renormalisation and scaling, K = E, K > 32, E = 4096;
 *   - GENERAL triples (random, sorted) through the device copy;
 *   - metadata: expert offsets, rows sorted by expert then token,
 *     assign_row a permutation, row_token / row_score matching, counts;
 *   - determinism: a second run gives the same bytes;
 *   - the aggregation kernels (aggregate.cu) on each token-choice case's
 *     rows: forward and backward with token offsets and with exactly K rows
 *     per token (k_uniform), bit for bit against each other and against a
 *     host sum in the same order (fmaf), d = 64, 40 and 20 (16-byte and
 *     scalar columns), scored and unscored (scores of 1), the backward
 *     with the per-pair router term and the column term into bf16, and
 *     with a dense fp32 term accumulated into fp32 in two token chunks;
 *   - the small and edge cases twice: with the metadata's cooperative
 *     launch (as the layer runs it where the tiles fit) and through its
 *     two-launch path (smoe_cuda_metadata_beside, as the expert-parallel
 *     layer runs it beside an exchange);
 * and prints the time of routing + metadata for the large cases.
 * Usage: test_routing_gpu [seed] [--small]
 */
#include "cuda/cuda_common.h"
#include "testutil_cuda.h"

/* 1: the metadata through its two-launch path (smoe_cuda_metadata_beside) */
static int g_two_launch = 0;

/* The cases' draws. The state starts at the seed itself, not at
 * tu_rng_make's mix of it, so a seed gives the inputs that the counts in
 * bench/RESULTS.md were measured on. */
static tu_rng g_rng;

/* Device outputs of one routing + metadata run. */
struct dev_run {
    int64_t T, E, cap;
    smoe_assign_dev as;
    int32_t *eoff, *arow, *rtok, *counts;
    float *rsc;
    void *rscratch, *mscratch;
};

static void dev_run_alloc(dev_run *r, const smoe_layer_desc *D, int64_t T, int64_t cap, int tr)
{
    r->T = T;
    r->E = D->E;
    r->cap = cap;
    r->as.expert = (int32_t *)tu_dev_alloc((size_t)cap * 4);
    r->as.token = (int32_t *)tu_dev_alloc((size_t)cap * 4);
    r->as.score = (float *)tu_dev_alloc((size_t)cap * 4);
    r->as.token_offset = (int32_t *)tu_dev_alloc(((size_t)T + 1) * 4);
    r->as.count = (int32_t *)tu_dev_alloc(4);
    r->as.expert16 = (uint16_t *)tu_dev_alloc((size_t)cap * 2);
    r->as.abort = NULL; /* no device-side check before these kernels */
    r->eoff = (int32_t *)tu_dev_alloc(((size_t)D->E + 1) * 4);
    r->arow = (int32_t *)tu_dev_alloc((size_t)cap * 4);
    r->rtok = (int32_t *)tu_dev_alloc((size_t)cap * 4);
    r->rsc = (float *)tu_dev_alloc((size_t)cap * 4);
    r->counts = (int32_t *)tu_dev_alloc((size_t)D->E * 4);
    r->rscratch = tu_dev_alloc(smoe_cuda_routing_scratch_bytes(D, T, tr) + 256);
    r->mscratch = tu_dev_alloc(smoe_cuda_metadata_scratch_bytes(D->E, cap) + 256);
}

static void dev_run_free(dev_run *r)
{
    cudaFree(r->as.expert); cudaFree(r->as.token); cudaFree(r->as.score);
    cudaFree(r->as.token_offset); cudaFree(r->as.count); cudaFree(r->eoff); cudaFree(r->arow);
    cudaFree(r->rtok); cudaFree(r->rsc); cudaFree(r->counts); cudaFree(r->rscratch);
    cudaFree(r->mscratch); cudaFree(r->as.expert16);
}

/* Host copy of the results. */
struct host_run {
    int32_t R;
    int32_t *ex, *tok, *toff, *eoff, *arow, *rtok, *counts;
    uint16_t *ex16; /* the metadata's 16-bit copy of ex */
    float *sc, *rsc;
};

static host_run fetch_run(const dev_run *r)
{
    host_run h;
    tu_dev_get(&h.R, r->as.count, 4);
    size_t R = (size_t)(h.R >= 0 && h.R <= r->cap ? h.R : 0);
    h.ex = (int32_t *)tu_dev_fetch(r->as.expert, R * 4);
    h.ex16 = (uint16_t *)tu_dev_fetch(r->as.expert16, R * 2);
    h.tok = (int32_t *)tu_dev_fetch(r->as.token, R * 4);
    h.sc = (float *)tu_dev_fetch(r->as.score, R * 4);
    h.toff = (int32_t *)tu_dev_fetch(r->as.token_offset, ((size_t)r->T + 1) * 4);
    h.eoff = (int32_t *)tu_dev_fetch(r->eoff, ((size_t)r->E + 1) * 4);
    h.arow = (int32_t *)tu_dev_fetch(r->arow, R * 4);
    h.rtok = (int32_t *)tu_dev_fetch(r->rtok, R * 4);
    h.rsc = (float *)tu_dev_fetch(r->rsc, R * 4);
    h.counts = (int32_t *)tu_dev_fetch(r->counts, (size_t)r->E * 4);
    return h;
}

static void host_run_free(host_run *h)
{
    free(h->ex); free(h->tok); free(h->sc); free(h->toff); free(h->eoff); free(h->arow);
    free(h->rtok); free(h->rsc); free(h->counts); free(h->ex16);
}

static int same_run(const host_run *a, const host_run *b, int64_t T, int64_t E)
{
    if (a->R != b->R) return 0;
    size_t R = (size_t)a->R;
    return !memcmp(a->ex, b->ex, R * 4) && !memcmp(a->ex16, b->ex16, R * 2) &&
           !memcmp(a->tok, b->tok, R * 4) &&
           !memcmp(a->sc, b->sc, R * 4) && !memcmp(a->toff, b->toff, (size_t)(T + 1) * 4) &&
           !memcmp(a->eoff, b->eoff, (size_t)(E + 1) * 4) && !memcmp(a->arow, b->arow, R * 4) &&
           !memcmp(a->rtok, b->rtok, R * 4) && !memcmp(a->rsc, b->rsc, R * 4);
}

static void check_metadata(const host_run *h, int64_t T, int64_t E)
{
    const int32_t R = h->R;
    int ok = h->eoff[0] == 0 && h->eoff[E] == R && h->toff[0] == 0 && h->toff[T] == R;
    for (int64_t e = 0; e < E && ok; e++) {
        ok &= h->eoff[e + 1] >= h->eoff[e] && h->counts[e] == h->eoff[e + 1] - h->eoff[e];
        for (int32_t r = h->eoff[e] + 1; r < h->eoff[e + 1] && ok; r++)
            ok &= h->rtok[r] > h->rtok[r - 1];
    }
    CHECK(ok, "offsets / counts / rows sorted by token within each expert (R=%d)", R);
    if (!ok) return;
    char *hit = (char *)calloc((size_t)R + 1, 1);
    int ok2 = 1;
    for (int64_t t = 0; t < T && ok2; t++)
        for (int32_t a = h->toff[t]; a < h->toff[t + 1] && ok2; a++) {
            const int32_t r = h->arow[a];
            if (r < 0 || r >= R || hit[r]) {
                ok2 = 0;
                break;
            }
            hit[r] = 1;
            ok2 &= h->tok[a] == t && h->rtok[r] == t;
            ok2 &= r >= h->eoff[h->ex[a]] && r < h->eoff[h->ex[a] + 1];
            ok2 &= h->ex16[a] == h->ex[a];
            ok2 &= !memcmp(&h->rsc[r], &h->sc[a], 4);
        }
    CHECK(ok2, "assign_row a permutation; row_token / row_score / expert ranges / the 16-bit "
               "experts match");
    free(hit);
}

/* ------------------------------------------------------------ cases */

enum { L_NORMAL, L_TIES, L_NONFINITE };

/* Equal scores: the same bits, or both NaN (the host's and the device's
 * NaNs may differ in sign and payload). */
static int same_score(float a, float b)
{
    return !memcmp(&a, &b, 4) || (a != a && b != b);
}

/* SIGMOID_TOPK's settings for run_case: groups, scaling, the bias kind
 * (0 none, 1 random, 2 quantised: ties, 3 with non-finite values) */
static struct {
    int64_t G, g;
    double scale;
    int bias;
} g_sig = {0, 0, 1.0, 0};

/* ------------------------------------------------------------ aggregation */

static uint16_t *rand_bf16(size_t n)
{
    uint16_t *h = (uint16_t *)malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = tu_f32_to_bf16((float)(2.0 * tu_uniform(&g_rng) - 1.0));
    return h;
}

static float *rand_f32(size_t n)
{
    float *h = (float *)malloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = (float)(2.0 * tu_uniform(&g_rng) - 1.0);
    return h;
}

/* The forward and backward aggregations on one routing run's rows (T
 * tokens, exactly K each): with token offsets and with k_uniform, against
 * each other and the host's sums in assignment order, bit for bit. */
static void check_aggregate(const dev_run *r, const host_run *g, int64_t T, int64_t E, int64_t K)
{
    /* 64 and 192: the backward's slab kernel (d % 64 == 0, K = 2, 4, 8, 16:
     * one and three slabs); 40 and 20 the others */
    static const int64_t ds[4] = {64, 40, 20, 192};
    for (int di = 0; di < 4; di++) {
        const int64_t d = ds[di], R = g->R;
        uint16_t *yh = rand_bf16((size_t)(R * d));
        float *dlh = rand_f32((size_t)R), *exh = rand_f32((size_t)(T * d));
        float *colh = rand_f32((size_t)d), *dx0 = rand_f32((size_t)(T * d));
        uint16_t *wrh = rand_bf16((size_t)(E * d));
        bf16 *y = (bf16 *)tu_dev_put(yh, (size_t)(R * d) * 2);
        bf16 *wr = (bf16 *)tu_dev_put(wrh, (size_t)(E * d) * 2);
        float *dl = (float *)tu_dev_put(dlh, (size_t)R * 4);
        float *ex = (float *)tu_dev_put(exh, (size_t)(T * d) * 4);
        float *col = (float *)tu_dev_put(colh, (size_t)d * 4);
        /* unscored: every row's score 1 (the kernels always scale) */
        float *ones_h = (float *)malloc((size_t)R * 4 + 4);
        for (int64_t i = 0; i < R; i++) ones_h[i] = 1.0f;
        float *ones = (float *)tu_dev_put(ones_h, (size_t)R * 4 + 4);
        bf16 *ob = (bf16 *)tu_dev_alloc((size_t)(T * d) * 2);
        float *of = (float *)tu_dev_alloc((size_t)(T * d) * 4);
        uint16_t *want_b = (uint16_t *)malloc((size_t)(T * d) * 2);
        float *want_f = (float *)malloc((size_t)(T * d) * 4);
        smoe_saved_header hdr;
        memset(&hdr, 0, sizeof hdr);
        /* scored only where every score is finite (a NaN's bits after the
         * sums are the device's, not the host's) */
        int finite = 1;
        for (int64_t i = 0; i < R; i++) finite &= isfinite(g->rsc[i]) != 0;
        for (int scored = 0; scored < 1 + finite; scored++) {
            /* forward: out[t] = sum_a score[row_a] y[row_a] */
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < d; c++) {
                    float acc = 0.0f;
                    for (int32_t a = g->toff[t]; a < g->toff[t + 1]; a++) {
                        const int32_t row = g->arow[a];
                        acc = fmaf(scored ? g->rsc[row] : 1.0f,
                                   tu_bf16_to_f32(yh[(size_t)(row * d + c)]), acc);
                    }
                    want_b[t * d + c] = tu_f32_to_bf16(acc);
                }
            for (int ku = 0; ku < 2; ku++) {
                tu_dev_poison(ob, (size_t)(T * d) * 2);
                CHECK_OK(smoe_cuda_aggregate_forward(T, d, ku ? NULL : r->as.token_offset,
                                                     ku ? (int)K : 0, r->arow,
                                                     scored ? r->rsc : ones, y, ob, NULL, hdr,
                                                     NULL, 0));
                uint16_t *got = (uint16_t *)tu_dev_fetch(ob, (size_t)(T * d) * 2);
                CHECK(!memcmp(got, want_b, (size_t)(T * d) * 2),
                      "aggregate forward (d %lld, %s, %s) differs from the host's sums",
                      (long long)d, scored ? "scored" : "unscored",
                      ku ? "k_uniform" : "token offsets");
                free(got);
            }
        }
        /* backward into bf16: dx[t] = sum_a (dxt[row_a] + dl_a wr[e_a]) + col */
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < d; c++) {
                float acc = 0.0f;
                for (int32_t a = g->toff[t]; a < g->toff[t + 1]; a++) {
                    acc += tu_bf16_to_f32(yh[(size_t)(g->arow[a] * d + c)]);
                    acc = fmaf(dlh[a], tu_bf16_to_f32(wrh[(size_t)(g->ex[a] * d + c)]), acc);
                }
                want_b[t * d + c] = tu_f32_to_bf16(acc + colh[c]);
            }
        for (int ku = 0; ku < 2; ku++) {
            tu_dev_poison(ob, (size_t)(T * d) * 2);
            CHECK_OK(smoe_cuda_aggregate_backward(T, d, ku ? NULL : r->as.token_offset,
                                                  ku ? (int)K : 0, r->arow, y, NULL, dl,
                                                  r->as.expert16, wr, E, col, ob, SMOE_DTYPE_BF16,
                                                  0, NULL, 0));
            uint16_t *got = (uint16_t *)tu_dev_fetch(ob, (size_t)(T * d) * 2);
            CHECK(!memcmp(got, want_b, (size_t)(T * d) * 2),
                  "aggregate backward into bf16 (d %lld, %s) differs from the host's sums",
                  (long long)d, ku ? "k_uniform" : "token offsets");
            free(got);
        }
        /* backward into fp32, accumulated, with the dense term extra, in
         * two chunks of tokens (k_uniform: the rows from the chunk's first
         * assignment, as the layer's dXr chunks pass them) */
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < d; c++) {
                float acc = 0.0f;
                for (int32_t a = g->toff[t]; a < g->toff[t + 1]; a++)
                    acc += tu_bf16_to_f32(yh[(size_t)(g->arow[a] * d + c)]);
                acc += exh[t * d + c];
                want_f[t * d + c] = dx0[t * d + c] + acc;
            }
        const int64_t t1 = T / 3;
        for (int ku = 0; ku < 2; ku++) {
            CUDA_OK(cudaMemcpy(of, dx0, (size_t)(T * d) * 4, cudaMemcpyHostToDevice));
            for (int part = 0; part < 2; part++) {
                const int64_t t0 = part ? t1 : 0, tn = part ? T - t1 : t1;
                CHECK_OK(smoe_cuda_aggregate_backward(
                    tn, d, ku ? NULL : r->as.token_offset + t0, ku ? (int)K : 0,
                    r->arow + (ku ? t0 * K : 0), y, ex + t0 * d, NULL, NULL, NULL, 0, NULL,
                    of + t0 * d, SMOE_DTYPE_F32, 1, NULL, 0));
            }
            float *got = (float *)tu_dev_fetch(of, (size_t)(T * d) * 4);
            CHECK(!memcmp(got, want_f, (size_t)(T * d) * 4),
                  "aggregate backward into fp32, accumulated (d %lld, %s) differs from the "
                  "host's sums", (long long)d, ku ? "k_uniform" : "token offsets");
            free(got);
        }
        free(yh); free(dlh); free(exh); free(colh); free(dx0); free(wrh); free(want_b);
        free(want_f); free(ones_h);
        cudaFree(ones);
        cudaFree(y); cudaFree(wr); cudaFree(dl); cudaFree(ex); cudaFree(col); cudaFree(ob);
        cudaFree(of);
    }
}

static void run_case(int64_t T, int64_t E, int64_t K, smoe_routing routing, int renorm,
                     smoe_rounding rounding, int64_t M, int logits_kind, int timed)
{
    const int sig = routing == SMOE_ROUTING_SIGMOID_TOPK;
    char name[256];
    snprintf(name, sizeof name, "T=%lld E=%lld K=%lld routing=%d renorm=%d rounding=%d M=%lld %s",
             (long long)T, (long long)E, (long long)K, (int)routing, renorm, (int)rounding,
             (long long)M,
             logits_kind == L_TIES ? "ties" : logits_kind == L_NONFINITE ? "nonfinite" : "normal");
    if (sig) {
        const size_t n = strlen(name);
        snprintf(name + n, sizeof name - n, " groups %lld/%lld scale %g bias %d",
                 (long long)g_sig.g, (long long)g_sig.G, g_sig.scale, g_sig.bias);
    }
    tu_case("%s", name);
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 64; D.n = 64; D.E = E; D.K = K;
    D.routing = routing;
    D.renormalize = renorm;
    D.rounding = rounding;
    D.round_tile = M;
    float *bias = NULL, *dbias = NULL;
    if (sig) {
        D.n_group = g_sig.G;
        D.topk_group = g_sig.g;
        D.routed_scaling = g_sig.scale;
        if (g_sig.bias) {
            bias = (float *)malloc((size_t)E * 4);
            for (int64_t e = 0; e < E; e++) {
                const int q = (int)(tu_next(&g_rng) % 40);
                if (g_sig.bias == 1) bias[e] = (float)(0.6 * (tu_uniform(&g_rng) - 0.5));
                else if (g_sig.bias == 2) bias[e] = (float)(0.25 * (q % 3) - 0.25);
                else bias[e] = q == 0 ? NAN : q == 1 ? INFINITY : q == 2 ? -INFINITY
                                      : (float)(0.6 * (tu_uniform(&g_rng) - 0.5));
            }
            dbias = (float *)tu_dev_put(bias, (size_t)E * 4);
        }
    }
    const int tr = rounding != SMOE_ROUND_OFF;
    int64_t cap = T * K;
    if (tr && rounding != SMOE_ROUND_DOWN) {
        int64_t x = T * K + E * (M - 1);
        cap = x < T * E ? x : T * E;
    }

    float *lg = (float *)malloc((size_t)(T * E) * 4);
    for (int64_t i = 0; i < T * E; i++) {
        if (logits_kind == L_TIES) {
            const int q = (int)(tu_next(&g_rng) % 7);
            static const float vals[7] = {0.0f, -0.0f, 0.5f, 0.5f, -1.25f, 2.0f, -INFINITY};
            lg[i] = vals[q];
        } else if (logits_kind == L_NONFINITE) {
            /* mostly numbers; NaN and +-inf here and there (NaN ranks first) */
            const int q = (int)(tu_next(&g_rng) % 40);
            lg[i] = q == 0 ? NAN : q == 1 ? INFINITY : q == 2 ? -INFINITY
                                      : (float)(2.0 * (tu_uniform(&g_rng) - 0.5));
        } else {
            const double u0 = tu_uniform(&g_rng), u1 = tu_uniform(&g_rng);
            lg[i] = (float)(3.0 * (u0 + u1 + tu_uniform(&g_rng) - 1.5));
        }
    }
    float *dlg = (float *)tu_dev_put(lg, (size_t)(T * E) * 4);

    dev_run r;
    dev_run_alloc(&r, &D, T, cap, tr);
    cudaEvent_t e0, e1, em;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventCreate(&em));
    host_run h[2];
    float ms = 0, ms_route = 0;
    /* the second run also writes the logits rounded to bf16 (the layer's
     * bf16 router_logits), every other case one element past an aligned
     * start (the kernels' per-value stores) */
    static int lg16_shift = 0;
    lg16_shift ^= 1;
    uint16_t *dlg16 = (uint16_t *)tu_dev_alloc((size_t)(T * E + 8) * 2);
    tu_dev_poison(dlg16, (size_t)(T * E + 8) * 2);
    for (int rep = 0; rep < 2; rep++) {
        tu_dev_poison(r.as.expert, (size_t)cap * 4);
        tu_dev_poison(r.as.expert16, (size_t)cap * 2);
        tu_dev_poison(r.rsc, (size_t)cap * 4);
        CUDA_OK(cudaEventRecord(e0, 0));
        CHECK_OK(smoe_cuda_route(&D, T, tr, dlg, dbias, rep == 1 ? dlg16 + lg16_shift : NULL, r.as,
                                 r.rscratch, 0));
        CUDA_OK(cudaEventRecord(em, 0));
        CHECK_OK(smoe_cuda_metadata_beside(E, cap, r.as, r.eoff, r.arow, r.rtok, r.rsc, r.counts,
                                           r.mscratch, g_two_launch, 0));
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        if (rep == 1) {
            CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
            CUDA_OK(cudaEventElapsedTime(&ms_route, e0, em));
        }
        h[rep] = fetch_run(&r);
    }
    CHECK(same_run(&h[0], &h[1], T, E), "two runs differ");
    {
        uint16_t *l16 = (uint16_t *)malloc((size_t)(T * E + 8) * 2);
        CUDA_OK(cudaMemcpy(l16, dlg16, (size_t)(T * E + 8) * 2, cudaMemcpyDeviceToHost));
        int64_t bad = -1;
        for (int64_t i = 0; i < T * E && bad < 0; i++) {
            const uint16_t want = tu_f32_to_bf16(lg[i]), got = l16[lg16_shift + i];
            const int nan_both = lg[i] != lg[i] && got != 0xffff && (got & 0x7fff) > 0x7f80;
            if (got != want && !nan_both) bad = i;
        }
        /* nothing written outside the (T, E) block (still tu_dev_poison's 0xff) */
        int fence_ok = 1;
        for (int64_t i = 0; i < T * E + 8; i++)
            if ((i < lg16_shift || i >= lg16_shift + T * E) && l16[i] != 0xffff) fence_ok = 0;
        CHECK(bad < 0, "bf16 logits differ from the fp32 ones rounded (first at %lld: %04x, "
                       "want %04x)",
              (long long)bad, bad >= 0 ? l16[lg16_shift + bad] : 0,
              bad >= 0 ? tu_f32_to_bf16(lg[bad]) : 0);
        CHECK(fence_ok, "bf16 logits: a write outside the (T, E) block");
        free(l16);
    }
    cudaFree(dlg16);
    if (timed)
        printf("  %-72s routing %7.1f us, metadata %7.1f us\n", name, ms_route * 1000.0,
               (ms - ms_route) * 1000.0);

    /* the host routing on the same logits */
    smoe_routing_result res;
    memset(&res, 0, sizeof res);
    int64_t np = 0;
    res.expert = (int32_t *)malloc((size_t)(T * K) * 4);
    res.score = (float *)malloc((size_t)(T * K) * 4);
    res.cap = cap;
    res.pair_token = (int32_t *)malloc((size_t)cap * 4);
    res.pair_expert = (int32_t *)malloc((size_t)cap * 4);
    res.pair_score = (float *)malloc((size_t)cap * 4);
    res.pairs = &np;
    CHECK_OK(smoe_route_cpu_biased(&D, T, lg, bias, &res));
    const host_run *g = &h[0];
    int64_t bad = -1;
    if (tr) {
        int ok = np == g->R;
        for (int64_t i = 0; i < np && ok; i++)
            if (res.pair_token[i] != g->tok[i] || res.pair_expert[i] != g->ex[i] ||
                !same_score(res.pair_score[i], g->sc[i])) {
                ok = 0;
                bad = i;
            }
        CHECK(ok, "token rounding triples differ from smoe_route_cpu (R %d vs %lld; first at %lld: "
                  "gpu (%d,%d,%.9g) cpu (%d,%d,%.9g))",
              g->R, (long long)np, (long long)bad, bad >= 0 ? g->tok[bad] : -1,
              bad >= 0 ? g->ex[bad] : -1, bad >= 0 ? g->sc[bad] : 0.0,
              bad >= 0 ? res.pair_token[bad] : -1, bad >= 0 ? res.pair_expert[bad] : -1,
              bad >= 0 ? res.pair_score[bad] : 0.0);
        if (ok) {
            /* every expert count a multiple of M (or capped at T) */
            int okm = 1;
            for (int64_t e = 0; e < E; e++) {
                int32_t c = g->counts[e];
                okm &= (c % M == 0) || c == T;
            }
            CHECK(okm, "token rounding: an expert count is not a multiple of M = %lld",
                  (long long)M);
        }
    } else {
        int ok = g->R == T * K;
        for (int64_t i = 0; i < T * K && ok; i++)
            if (res.expert[i] != g->ex[i] || !same_score(res.score[i], g->sc[i])) {
                ok = 0;
                bad = i;
            }
        CHECK(ok, "token choice differs from smoe_route_cpu (first at %lld: gpu %d %.9g, cpu %d %.9g)",
              (long long)bad, bad >= 0 ? g->ex[bad] : -1, bad >= 0 ? g->sc[bad] : 0.0,
              bad >= 0 ? res.expert[bad] : -1, bad >= 0 ? res.score[bad] : 0.0);
    }
    check_metadata(g, T, E);
    /* the aggregations on these rows (token choice: exactly K per token) */
    if (!tr && g->R == T * K) check_aggregate(&r, g, T, E, K);

    free(res.expert); free(res.score); free(res.pair_token); free(res.pair_expert);
    free(res.pair_score);
    host_run_free(&h[0]);
    host_run_free(&h[1]);
    dev_run_free(&r);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(em);
    cudaFree(dlg);
    free(lg);
    if (dbias) cudaFree(dbias);
    free(bias);
}

static void run_general(int64_t T, int64_t E, double prob)
{
    tu_case("GENERAL T=%lld E=%lld prob=%.2f", (long long)T, (long long)E, prob);
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 64; D.n = 64; D.E = E; D.K = 1;
    D.routing = SMOE_ROUTING_GENERAL;
    int32_t *pt = (int32_t *)malloc((size_t)(T * E) * 4 + 4);
    int32_t *pe = (int32_t *)malloc((size_t)(T * E) * 4 + 4);
    float *ps = (float *)malloc((size_t)(T * E) * 4 + 4);
    int64_t np = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++)
            if (tu_uniform(&g_rng) < prob) {
                pt[np] = (int32_t)t;
                pe[np] = (int32_t)e;
                ps[np] = (float)tu_uniform(&g_rng);
                np++;
            }
    /* shuffle the experts within each token (any order is allowed) */
    for (int64_t i = 0; i + 1 < np; i++)
        if (pt[i] == pt[i + 1] && (tu_next(&g_rng) & 1)) {
            int32_t x = pe[i]; pe[i] = pe[i + 1]; pe[i + 1] = x;
            float y = ps[i]; ps[i] = ps[i + 1]; ps[i + 1] = y;
        }
    int32_t *dpt = (int32_t *)tu_dev_put(pt, (size_t)np * 4);
    int32_t *dpe = (int32_t *)tu_dev_put(pe, (size_t)np * 4);
    float *dps = (float *)tu_dev_put(ps, (size_t)np * 4);
    dev_run r;
    dev_run_alloc(&r, &D, T, np, 0);
    smoe_dev_status *st = (smoe_dev_status *)tu_dev_alloc(sizeof(smoe_dev_status));
    CHECK_OK(smoe_cuda_status_reset(st, 0));
    smoe_dev_report no_report = {NULL, NULL, 0}; /* the status word alone */
    CHECK_OK(smoe_cuda_route_general(T, E, np, dpt, dpe, dps, r.as, st, no_report, 0));
    CHECK_OK(smoe_cuda_metadata_beside(E, np, r.as, r.eoff, r.arow, r.rtok, r.rsc, r.counts,
                                       r.mscratch, g_two_launch, 0));
    CUDA_OK(cudaDeviceSynchronize());
    smoe_dev_status hs;
    tu_dev_get(&hs, st, sizeof hs);
    CHECK(hs.code == SMOE_DEV_OK, "valid triples flagged: code %d at %d", hs.code, hs.first_bad);
    host_run h = fetch_run(&r);
    int ok = h.R == np;
    for (int64_t i = 0; i < np && ok; i++)
        ok &= h.ex[i] == pe[i] && h.tok[i] == pt[i] && !memcmp(&h.sc[i], &ps[i], 4);
    CHECK(ok, "GENERAL triples not copied as given");
    check_metadata(&h, T, E);
    host_run_free(&h);
    cudaFree(st);
    dev_run_free(&r);
    cudaFree(dpt); cudaFree(dpe); cudaFree(dps);
    free(pt); free(pe); free(ps);
}

static void run_sigmoid_cases(int large);

static void run_edge_cases(smoe_routing TK, smoe_routing ST)
{
    /* small and edge cases */
    run_case(1, 3, 3, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(1, 5, 2, ST, 1, SMOE_ROUND_UP, 4, L_NORMAL, 0);
    run_case(100, 8, 2, TK, 0, SMOE_ROUND_UP, 128, L_NORMAL, 0);   /* target capped at T */
    run_case(300, 16, 4, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(300, 16, 4, ST, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(777, 12, 3, ST, 1, SMOE_ROUND_NEAREST, 16, L_TIES, 0);
    run_case(777, 12, 3, TK, 0, SMOE_ROUND_DOWN, 16, L_TIES, 0);
    run_case(1000, 7, 7, TK, 0, SMOE_ROUND_UP, 8, L_NORMAL, 0);
    /* token rounding's scan over the tokens: tiles of 8192, a carry between
     * (a whole number of tiles, and a part tile after two) */
    run_case(16384, 32, 2, ST, 1, SMOE_ROUND_NEAREST, 8, L_NORMAL, 0);
    run_case(20001, 64, 4, TK, 0, SMOE_ROUND_UP, 16, L_NORMAL, 0);
    /* NaN and infinite logits: NaN ranks first on both, scores NaN alike */
    run_case(300, 16, 4, TK, 0, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(300, 16, 4, ST, 1, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(257, 64, 2, TK, 0, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(257, 200, 8, ST, 0, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(300, 600, 8, TK, 0, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(200, 64, 40, ST, 1, SMOE_ROUND_OFF, 128, L_NONFINITE, 0);
    run_case(400, 12, 3, ST, 1, SMOE_ROUND_UP, 16, L_NONFINITE, 0);
    run_case(400, 12, 3, TK, 0, SMOE_ROUND_DOWN, 16, L_NONFINITE, 0);
    run_case(500, 64, 40, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);     /* K > 32: thread path */
    run_case(500, 64, 40, ST, 1, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(300, 1100, 4, ST, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);   /* E > 1024 */
    run_case(300, 600, 8, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(2000, 300, 3, ST, 1, SMOE_ROUND_UP, 32, L_NORMAL, 0);
    /* the E <= 256 token-choice kernel: vector and scalar loads (E % 4),
     * 1..8 tokens per warp (K), T not a multiple of them, padding lanes,
     * and its K-picks path (more than 32 candidates: many equal logits) */
    run_case(1001, 64, 4, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(1001, 64, 4, ST, 1, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(513, 45, 5, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(333, 100, 1, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(333, 97, 32, ST, 1, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(777, 250, 16, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(777, 250, 16, ST, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(300, 256, 16, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(500, 200, 24, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(67, 20, 19, ST, 1, SMOE_ROUND_OFF, 128, L_NORMAL, 0);
    run_case(4097, 256, 4, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 0);   /* K <= 4: group maxima */
    run_case(999, 128, 2, ST, 1, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_case(999, 200, 3, TK, 0, SMOE_ROUND_OFF, 128, L_TIES, 0);
    run_general(50, 6, 0.3);
    run_general(3, 4, 0.0);
    run_sigmoid_cases(0);
}

/* SIGMOID_TOPK: groups G/g (0: none), scaling, bias kind, then run_case */
static void sig_case(int64_t T, int64_t E, int64_t K, int64_t G, int64_t g, int renorm,
                     double scale, int bias, int logits_kind, int timed)
{
    g_sig.G = G;
    g_sig.g = g;
    g_sig.scale = scale;
    g_sig.bias = bias;
    run_case(T, E, K, SMOE_ROUTING_SIGMOID_TOPK, renorm, SMOE_ROUND_OFF, 128, logits_kind, timed);
    g_sig.G = g_sig.g = 0;
    g_sig.scale = 1.0;
    g_sig.bias = 0;
}

static void run_sigmoid_cases(int large)
{
    if (large) {
        /* DeepSeek-V3's router (256 experts, 8 groups, 4 kept, K = 8,
         * scaling 2.5) and Kimi-K2's (384 experts, 1 group), timed */
        sig_case(32768, 256, 8, 8, 4, 1, 2.5, 1, L_NORMAL, 1);
        sig_case(32768, 384, 8, 1, 1, 1, 2.827, 1, L_NORMAL, 1);
        sig_case(32768, 128, 8, 0, 0, 1, 1.0, 1, L_NORMAL, 1);
        return;
    }
    sig_case(1, 4, 2, 0, 0, 0, 1.0, 0, L_NORMAL, 0);
    sig_case(300, 16, 4, 0, 0, 1, 2.5, 1, L_NORMAL, 0);
    sig_case(300, 16, 4, 4, 2, 1, 2.5, 1, L_NORMAL, 0);
    sig_case(300, 16, 4, 4, 2, 0, 1.0, 2, L_TIES, 0);      /* ties in keys and group keys */
    sig_case(300, 16, 4, 8, 2, 1, 1.0, 2, L_TIES, 0);      /* groups of 2 */
    sig_case(300, 16, 4, 4, 4, 1, 1.0, 1, L_NORMAL, 0);    /* every group kept */
    sig_case(300, 16, 16, 4, 4, 1, 1.0, 1, L_NORMAL, 0);   /* K = E */
    sig_case(300, 16, 4, 4, 2, 1, 1.0, 3, L_NONFINITE, 0); /* NaN / inf logits and biases */
    sig_case(257, 64, 40, 2, 2, 1, 0.5, 1, L_TIES, 0);     /* K > 32 */
    sig_case(777, 250, 16, 5, 3, 0, 1.0, 1, L_NORMAL, 0);
    sig_case(1001, 256, 8, 8, 4, 1, 2.5, 1, L_NORMAL, 0);  /* DeepSeek-V3's shape */
    sig_case(333, 97, 5, 0, 0, 1, 1.0, 0, L_TIES, 0);
    sig_case(64, 4096, 8, 64, 8, 1, 1.0, 1, L_NORMAL, 0);  /* E = 4096: one warp per block */
    sig_case(64, 4096, 8, 2048, 8, 1, 1.0, 2, L_TIES, 0);  /* 2048 groups of 2 */
}

int main(int argc, char **argv)
{
    uint64_t seed = 424242;
    int small = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) small = 1;
        else seed = strtoull(argv[i], NULL, 0);
    }
    tu_seed = seed;
    g_rng.s = seed;
    if (!tu_gpu_cc("test_routing_gpu")) return 0;
    const smoe_routing TK = SMOE_ROUTING_TOPK_SOFTMAX, ST = SMOE_ROUTING_SOFTMAX_TOPK;
    /* twice: the metadata as the layer runs it (one cooperative launch
     * where the tiles fit), then through its two-launch path */
    for (int pass = 0; pass < 2; pass++) {
        g_two_launch = pass;
        if (pass) printf("metadata: the two-launch path\n");
        run_edge_cases(TK, ST);
    }
    g_two_launch = 0;
    if (!small) {
        run_general(4000, 64, 0.1);
        run_case(5000, 32, 2, TK, 0, SMOE_ROUND_NEAREST, 64, L_TIES, 0);
        /* the grid's sizes, timed */
        run_case(40960, 128, 8, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 1);
        run_case(32768, 256, 16, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 1);
        run_case(32768, 256, 16, ST, 1, SMOE_ROUND_OFF, 128, L_NORMAL, 1);
        run_case(32768, 128, 8, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 1);
        run_case(32768, 64, 4, TK, 0, SMOE_ROUND_OFF, 128, L_NORMAL, 1);
        run_case(24576, 64, 4, TK, 0, SMOE_ROUND_UP, 128, L_NORMAL, 1);
        run_case(32768, 128, 8, ST, 1, SMOE_ROUND_NEAREST, 128, L_NORMAL, 1);
        run_case(20000, 64, 4, ST, 0, SMOE_ROUND_DOWN, 128, L_NORMAL, 1);
        run_sigmoid_cases(1);
    }
    return tu_summary("test_routing_gpu");
}
