/*
 * bench_gemm.cu -- the six grouped GEMMs of the layer alone (src/cuda/gemm.h),
 * both families (portable "sm80": mma.sync; Hopper "sm90": TMA + wgmma), on
 * the benchmark grid's shapes, each against cuBLAS in the same process.
 *
 *   bench_gemm [--family sm80|sm90|all] [--shape NAME[,NAME...]] [--gemm NAME]
 *              [--all-rows] [--row GEMM=NAME ...] [--wgrad bf16|f32|f32-acc|all]
 *              [--reps N] [--warmup N] [--no-flush] [--no-cublas] [--csv FILE]
 *              [--routing random|balanced|even|hot]
 *
 * Shapes (T, d, n, E, K): 7B (24576, 1536, 256, 128, 8), 30B (32768, 4096,
 * 512, 128, 8), 120B (32768, 4096, 1024, 128, 8), 120B-n2048 (32768, 4096,
 * 2048, 64, 4); all four by default. The benchmark grid's twelve rows and
 * the public models' shapes of bench/grid.h by name (1.4B-n256, ...,
 * Mixtral-8x7B, ...) or all with --shape grid, --shape models. SwiGLU,
 * interleaved W1, no bias. Routing (since 2026-11-27, session 22): K
 * distinct experts per token drawn uniformly, as the layer's near-uniform
 * router gives (counts binomial around T K / E, every expert its own
 * tokens). --routing balanced is the earlier one: token t goes to experts
 * (p(t) K + k) mod E, k < K, for a random permutation p, so every expert
 * holds exactly T K / E rows, and where E is a multiple of K the experts
 * K j .. K j + K - 1 hold the same tokens, so the experts in flight gather
 * the same rows, which stay in L2: up to 2.3x faster than the layer runs
 * the same GEMM (DeepSeek-V3's dh, notes/sm90_log.md rung 19). Results
 * before that date are balanced. Two diagnostic routings separate the
 * causes (rung 20): --routing even gives every expert T K / E rows (one
 * more for some where E does not divide T K) of its own random tokens
 * (for each k a random permutation p_k, token t to expert p_k(t) mod E; a
 * token may meet an expert twice), --routing hot takes random's counts
 * with every token index reduced mod 256 (the gathered rows then stay in
 * L2).
 *
 * Each GEMM runs its family's plan row for the shape (the row the layer
 * would run; "plan" on its line), or --row's row, or with --all-rows every
 * row of its tile table that can run the shape; each line names the row
 * that ran. The Hopper family runs on sm_90 devices only. Weight gradients
 * (dw2, dw1): bf16 overwrite, as the layer asks; --wgrad picks fp32
 * overwrite (f32), fp32 accumulate (f32-acc) or all three.
 *
 * Timing: CUDA events around each call, the median of --reps (20) calls
 * after --warmup (3). Before each call, warm-up included, a memset of
 * max(256 MiB, 2 x L2) bytes outside the events evicts L2 (the H100 has
 * 50 MiB), as in bench/bench.c, so no call finds what the one before left
 * in L2; the inputs are not rotated. --no-flush leaves the memset out: the
 * inputs that fit in L2 then stay there from call to call. cuBLAS is timed
 * the same way. TFLOPS = 2 R N K / time.
 *
 * Baseline (--no-cublas leaves it out): for up, down, dh and dxt cuBLAS's
 * dense GEMM of the same M = R, N, K (bf16 in and out, fp32 compute: no
 * gather, no activation, no scatter); for dw2 and dw1 its strided-batched
 * GEMM of E equal per-expert products (K = R / E, fp32 out: no gather).
 * ratio = cuBLAS's time / ours (above 1: ours is faster). The last lines:
 * per family the geometric mean of the plan rows' ratios, and cuBLAS's
 * dense 8192^3 bf16 GEMM as the device's reachable peak.
 *
 * The GEMMs' correctness is the tests' (tests/gpu/test_gemm.cu,
 * test_gemm_sm90.cu, test_varlen_k_sm90.cu: every row of every table).
 */
#include <cublas_v2.h>

#include "cuda/gemm.h"
#include "grid.h"
#include "testutil_cuda.h"

typedef struct shape {
    const char *name;
    int64_t T, d, n, E, K;
} shape;

/* Four of the grid's shapes (the default), then the twelve rows of the
 * benchmark grid and the public models' shapes of bench/grid.h (by name,
 * or all of them with --shape grid or --shape models). */
#define NGRID 4
#define NSHAPES (NGRID + SMOE_GRID_ROWS + SMOE_MODEL_ROWS)
static shape g_shapes[NSHAPES] = {
    {"7B", 24576, 1536, 256, 128, 8},
    {"30B", 32768, 4096, 512, 128, 8},
    {"120B", 32768, 4096, 1024, 128, 8},
    {"120B-n2048", 32768, 4096, 2048, 64, 4},
};

static void add_model_shapes(void)
{
    for (int k = 0; k < SMOE_GRID_ROWS + SMOE_MODEL_ROWS; k++) {
        const smoe_grid_row *r =
            k < SMOE_GRID_ROWS ? &smoe_grid[k] : &smoe_model_rows[k - SMOE_GRID_ROWS];
        shape s = {r->name, r->T, r->d, r->n, r->E, r->K};
        g_shapes[NGRID + k] = s;
    }
}

enum { FAM_SM80, FAM_SM90, NFAM };
static const char *const g_fam_name[NFAM] = {"sm80", "sm90"};

/* The weight gradients' output modes (--wgrad). */
enum { WG_BF16, WG_F32, WG_F32_ACC, NWG };
static const char *const g_wg_name[NWG] = {"bf16", "f32", "f32-acc"};

/* Options. */
static int g_reps = 20, g_warmup = 3, g_all_rows = 0, g_cublas = 1, g_flush = 1;
enum { ROUTE_RANDOM, ROUTE_BALANCED, ROUTE_EVEN, ROUTE_HOT, NROUTE };
static const char *const g_route_name[NROUTE] = {"random", "balanced", "even", "hot"};
static int g_routing = ROUTE_RANDOM; /* --routing */
static int g_gemm = -1;                  /* --gemm: this GEMM only */
static int g_wg[NWG] = {1, 0, 0};        /* --wgrad: the modes timed */
static int g_row[NFAM][SMOE_GEMM_COUNT]; /* --row: -1, the plan's */
static FILE *g_csv = NULL;

/* The first --wgrad mode: the one the geometric mean and the totals take. */
static int first_wg(void)
{
    for (int w = 0; w < NWG; w++)
        if (g_wg[w]) return w;
    return WG_BF16;
}

/* Whether name is in the comma-separated list (always without a list). */
static int in_list(const char *list, const char *name)
{
    if (!list) return 1;
    const size_t len = strlen(name);
    for (const char *q = list; *q;) {
        const size_t l = strcspn(q, ",");
        if (l == len && !strncmp(q, name, len)) return 1;
        q += l + (q[l] == ',');
    }
    return 0;
}

/* Whether shape k is asked for: the first four by default, the grid's or
 * the models' with "grid" or "models" in the list. */
static int shape_wanted(const char *list, int k)
{
    if (!list) return k < NGRID;
    const int grid = k >= NGRID && k < NGRID + SMOE_GRID_ROWS, model = k >= NGRID + SMOE_GRID_ROWS;
    return in_list(list, g_shapes[k].name) || (grid && in_list(list, "grid")) ||
           (model && in_list(list, "models"));
}

/* Per family: the sum of log(ratio) over the plan rows, and their number. */
static double g_log_ratio[NFAM];
static int g_nratio[NFAM];

/* ------------------------------------------------------------ timing */

/* A call to time: 0 on success. */
typedef int (*bench_fn)(void *ctx);

/* The L2 flush's buffer (NULL with --no-flush) and its size. */
static void *g_flush_buf = NULL;
static size_t g_flush_bytes = 0;

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* The median time of fn in ms, -1 if a call failed. */
static float median_ms(bench_fn fn, void *ctx)
{
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    float *t = (float *)malloc(sizeof(float) * (size_t)g_reps);
    int ok = 1;
    for (int it = -g_warmup; it < g_reps && ok; it++) {
        if (g_flush_buf) CUDA_OK(cudaMemsetAsync(g_flush_buf, it & 0xff, g_flush_bytes, 0));
        CUDA_OK(cudaEventRecord(e0));
        ok = fn(ctx) == 0;
        CUDA_OK(cudaEventRecord(e1));
        CUDA_OK(cudaEventSynchronize(e1));
        if (it >= 0) CUDA_OK(cudaEventElapsedTime(&t[it], e0, e1));
    }
    CUDA_OK(cudaGetLastError());
    qsort(t, (size_t)g_reps, sizeof(float), cmp_float);
    float med = ok ? t[g_reps / 2] : -1.0f;
    free(t);
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    return med;
}

/* ------------------------------------------------------------ one shape's buffers */

typedef struct bufs {
    int64_t T, d, n, E, K, R, hc;
    int32_t *off, *tok; /* device */
    float *score;
    bf16 *x, *w1, *w2, *dout, *h, *a, *y, *dh, *as, *dxt;
    float *ds;
    void *dw1, *dw2, *scratch; /* dw1, dw2: room for fp32 if an fp32 mode is timed */
} bufs;

/* A random permutation of 0 .. T - 1 into perm. */
static void shuffle(int32_t *perm, int64_t T, tu_rng *r)
{
    for (int64_t t = 0; t < T; t++) perm[t] = (int32_t)t;
    for (int64_t t = T - 1; t > 0; t--) {
        int64_t j = tu_int(r, 0, t);
        int32_t v = perm[t];
        perm[t] = perm[j];
        perm[j] = v;
    }
}

/* Rows from each token's K expert picks (pick[t K + k]), sorted by expert,
 * then token: the experts' offsets and each row's token. */
static void rows_of_picks(const shape *S, const int32_t *pick, int32_t *off, int32_t *tok)
{
    const int64_t T = S->T, E = S->E, K = S->K;
    int32_t *fill = (int32_t *)calloc((size_t)E, sizeof(int32_t));
    for (int64_t i = 0; i < T * K; i++) fill[pick[i]]++;
    off[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        off[e + 1] = off[e] + fill[e];
        fill[e] = off[e];
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) tok[fill[pick[t * K + k]]++] = (int32_t)t;
    free(fill);
}

/* Balanced routing (--routing balanced, see the top). */
static void route_balanced(const shape *S, tu_rng *r, int32_t *pick)
{
    const int64_t T = S->T, E = S->E, K = S->K;
    int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
    shuffle(perm, T, r);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) pick[t * K + k] = (int32_t)((perm[t] * K + k) % E);
    free(perm);
}

/* Random routing (the default): K distinct experts per token, uniform. */
static void route_random(const shape *S, tu_rng *r, int32_t *pick)
{
    const int64_t T = S->T, E = S->E, K = S->K;
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            int again;
            do { /* K <= E: redraw an expert this token already has */
                e = (int32_t)tu_int(r, 0, E - 1);
                again = 0;
                for (int64_t j = 0; j < k; j++) again |= pick[t * K + j] == e;
            } while (again);
            pick[t * K + k] = e;
        }
}

/* Even routing (--routing even, diagnostic): for each k a random permutation
 * p_k of the tokens, token t to expert p_k(t) mod E. */
static void route_even(const shape *S, tu_rng *r, int32_t *pick)
{
    const int64_t T = S->T, E = S->E, K = S->K;
    int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t k = 0; k < K; k++) {
        shuffle(perm, T, r);
        for (int64_t t = 0; t < T; t++) pick[t * K + k] = (int32_t)(perm[t] % E);
    }
    free(perm);
}

static smoe_gemm_problem problem_of(const bufs *B, int num_sms)
{
    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = B->d;
    p.n = B->n;
    p.h_cols = B->hc;
    p.E = B->E;
    p.cap = B->R;
    p.gated = 1;
    p.act = SMOE_ACT_SWIGLU;
    p.w1_layout = SMOE_W1_INTERLEAVED;
    p.expert_offset = B->off;
    p.row_token = B->tok;
    p.row_score = B->score;
    p.num_sms = num_sms;
    return p;
}

static void bufs_make(bufs *B, const shape *S, const smoe_gemm_ops *const *ops, int num_sms)
{
    memset(B, 0, sizeof *B);
    B->T = S->T; B->d = S->d; B->n = S->n; B->E = S->E; B->K = S->K;
    B->R = S->T * S->K;
    B->hc = 2 * S->n;
    const int64_t T = B->T, d = B->d, n = B->n, E = B->E, R = B->R, hc = B->hc;
    tu_rng r = tu_rng_make(1);
    int32_t *off = (int32_t *)malloc(sizeof(int32_t) * (size_t)(E + 1));
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)R);
    float *score = (float *)malloc(sizeof(float) * (size_t)R);
    int32_t *pick = (int32_t *)malloc(sizeof(int32_t) * (size_t)R);
    if (g_routing == ROUTE_BALANCED) route_balanced(S, &r, pick);
    else if (g_routing == ROUTE_EVEN) route_even(S, &r, pick);
    else route_random(S, &r, pick);
    rows_of_picks(S, pick, off, tok);
    free(pick);
    if (g_routing == ROUTE_HOT)
        for (int64_t i = 0; i < B->R; i++) tok[i] %= (int32_t)(T < 256 ? T : 256);
    for (int64_t i = 0; i < R; i++) score[i] = 1.0f / (float)S->K;
    B->off = (int32_t *)tu_dev_put(off, sizeof(int32_t) * (size_t)(E + 1));
    B->tok = (int32_t *)tu_dev_put(tok, sizeof(int32_t) * (size_t)R);
    B->score = (float *)tu_dev_put(score, sizeof(float) * (size_t)R);
    free(off); free(tok); free(score);
    struct { bf16 **p; int64_t count; float scale; } in[] = {
        {&B->x, T * d, 1.0f}, {&B->w1, E * hc * d, 1.0f / sqrtf((float)d)},
        {&B->w2, E * d * n, 1.0f / sqrtf((float)n)}, {&B->dout, T * d, 1.0f},
        {&B->h, R * hc, 1.0f}, {&B->a, R * n, 1.0f}, {&B->y, R * d, 1.0f},
        {&B->dh, R * hc, 1.0f}, {&B->as, R * n, 1.0f}, {&B->dxt, R * d, 1.0f}};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
        *in[i].p = (bf16 *)tu_dev_alloc(2 * (size_t)in[i].count);
        tu_dev_fill_bf16(*in[i].p, (size_t)in[i].count, 100 + i, -in[i].scale, in[i].scale);
    }
    B->ds = (float *)tu_dev_alloc(4 * (size_t)R);
    /* room for fp32 only where an fp32 mode is timed (DeepSeek-V3's fp32
     * dW1 alone is 30 GB) */
    const size_t wsz = g_wg[WG_F32] || g_wg[WG_F32_ACC] ? 4 : 2;
    B->dw1 = tu_dev_alloc(wsz * (size_t)(E * hc * d));
    B->dw2 = tu_dev_alloc(wsz * (size_t)(E * d * n));
    if (wsz == 4) {
        tu_dev_fill_f32((float *)B->dw1, (size_t)(E * hc * d), 200, -1.0f, 1.0f);
        tu_dev_fill_f32((float *)B->dw2, (size_t)(E * d * n), 201, -1.0f, 1.0f);
    }
    smoe_gemm_problem p = problem_of(B, num_sms);
    size_t scratch = 0;
    for (int f = 0; f < NFAM; f++)
        if (ops[f] && ops[f]->scratch_bytes(&p) > scratch) scratch = ops[f]->scratch_bytes(&p);
    B->scratch = tu_dev_alloc(scratch);
    CUDA_OK(cudaDeviceSynchronize());
}

static void bufs_free(bufs *B)
{
    void *p[] = {B->off, B->tok, B->score, B->x, B->w1, B->w2, B->dout, B->h, B->a,
                 B->y, B->dh, B->as, B->dxt, B->ds, B->dw1, B->dw2, B->scratch};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_OK(cudaFree(p[i]));
}

/* ------------------------------------------------------------ the calls */

typedef struct gemm_call {
    const smoe_gemm_ops *ops;
    const smoe_gemm_problem *p;
    const bufs *B;
    int g, wg;
} gemm_call;

static int gemm_run(void *ctx)
{
    const gemm_call *c = (const gemm_call *)ctx;
    const smoe_gemm_ops *G = c->ops;
    const smoe_gemm_problem *p = c->p;
    const bufs *B = c->B;
    const smoe_dtype wdt = c->wg == WG_BF16 ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
    const int acc = c->wg == WG_F32_ACC;
    smoe_status st = SMOE_ERROR_INTERNAL;
    switch (c->g) {
    case SMOE_GEMM_UP: st = G->up(p, B->x, B->w1, NULL, B->h, B->a, B->scratch, 0); break;
    case SMOE_GEMM_DOWN: st = G->down(p, B->a, B->w2, NULL, B->y, B->scratch, 0); break;
    case SMOE_GEMM_DH:
        st = G->dh(p, B->dout, B->w2, NULL, B->h, B->dh, B->as, B->ds, B->scratch, 0);
        break;
    case SMOE_GEMM_DW2: st = G->dw2(p, B->dout, B->as, B->dw2, wdt, acc, B->scratch, 0); break;
    case SMOE_GEMM_DXT: st = G->dxt(p, B->dh, B->w1, B->dxt, B->scratch, 0); break;
    case SMOE_GEMM_DW1: st = G->dw1(p, B->dh, B->x, B->dw1, wdt, acc, B->scratch, 0); break;
    }
    return st == SMOE_SUCCESS ? 0 : -1;
}

/* cuBLAS: row-major C (M x N) = A (M x K) B^T, B (N x K), as column-major
 * C^T = B A^T; batched: E products C_e (M x N, fp32) = A_e^T B_e with
 * A_e (K x M), B_e (K x N) row-major. */
typedef struct cublas_call {
    cublasHandle_t h;
    int batched, M, N, K, E;
    void *A, *B, *C;
} cublas_call;

static int cublas_run(void *ctx)
{
    const cublas_call *c = (const cublas_call *)ctx;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    if (!c->batched)
        st = cublasGemmEx(c->h, CUBLAS_OP_T, CUBLAS_OP_N, c->N, c->M, c->K, &one, c->B,
                          CUDA_R_16BF, c->K, c->A, CUDA_R_16BF, c->K, &zero, c->C, CUDA_R_16BF,
                          c->N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    else
        st = cublasGemmStridedBatchedEx(c->h, CUBLAS_OP_N, CUBLAS_OP_T, c->N, c->M, c->K, &one,
                                        c->B, CUDA_R_16BF, c->N, (long long)c->K * c->N, c->A,
                                        CUDA_R_16BF, c->M, (long long)c->K * c->M, &zero, c->C,
                                        CUDA_R_32F, c->N, (long long)c->M * c->N, c->E,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) fprintf(stderr, "cuBLAS error %d\n", (int)st);
    return st == CUBLAS_STATUS_SUCCESS ? 0 : -1;
}

/* GEMM g's sizes as one product of R (or the experts' rows summed) rows:
 * M = R, N the output's columns, K the reduced length; for the weight
 * gradients M x N is one expert's output and K = R summed over them. */
static void gemm_mnk(const bufs *B, int g, int64_t *M, int64_t *N, int64_t *K)
{
    const int64_t d = B->d, n = B->n, hc = B->hc, R = B->R;
    switch (g) {
    case SMOE_GEMM_UP: *M = R; *N = hc; *K = d; break;
    case SMOE_GEMM_DOWN: *M = R; *N = d; *K = n; break;
    case SMOE_GEMM_DH: *M = R; *N = n; *K = d; break;
    case SMOE_GEMM_DW2: *M = d; *N = n; *K = R; break;
    case SMOE_GEMM_DXT: *M = R; *N = d; *K = hc; break;
    default: *M = hc; *N = d; *K = R; break; /* dw1 */
    }
}

/* cuBLAS's time for GEMM g's sizes (ms), -1 on failure. */
static float cublas_ms(cublasHandle_t h, const bufs *B, int g)
{
    int64_t M, N, K;
    gemm_mnk(B, g, &M, &N, &K);
    cublas_call c;
    memset(&c, 0, sizeof c);
    c.h = h;
    c.batched = g == SMOE_GEMM_DW2 || g == SMOE_GEMM_DW1;
    c.M = (int)M;
    c.N = (int)N;
    c.E = c.batched ? (int)B->E : 1;
    c.K = (int)(c.batched ? K / B->E : K);
    const size_t a = (size_t)c.E * (c.batched ? (size_t)c.K * M : (size_t)M * K);
    const size_t b = (size_t)c.E * (size_t)c.K * N, out = (size_t)c.E * M * N;
    c.A = tu_dev_alloc(2 * a);
    c.B = tu_dev_alloc(2 * b);
    c.C = tu_dev_alloc((c.batched ? 4 : 2) * out);
    tu_dev_fill_bf16(c.A, a, 300, -1.0f, 1.0f);
    tu_dev_fill_bf16(c.B, b, 301, -1.0f, 1.0f);
    float ms = median_ms(cublas_run, &c);
    CUDA_OK(cudaFree(c.A));
    CUDA_OK(cudaFree(c.B));
    CUDA_OK(cudaFree(c.C));
    return ms;
}

/* ------------------------------------------------------------ one shape */

static void bench_shape(const shape *S, const smoe_gemm_ops *const *ops, int num_sms,
                        cublasHandle_t h)
{
    bufs B;
    bufs_make(&B, S, ops, num_sms);
    printf("\n%s: T=%lld d=%lld n=%lld E=%lld K=%lld, R=%lld rows (%s routing, %lld per expert"
           "%s)\n", S->name, (long long)S->T, (long long)S->d, (long long)S->n, (long long)S->E,
           (long long)S->K, (long long)B.R, g_route_name[g_routing],
           (long long)(B.R / B.E),
           g_routing == ROUTE_RANDOM || g_routing == ROUTE_HOT ? " on average" : "");
    float cb[SMOE_GEMM_COUNT];
    for (int g = 0; g < SMOE_GEMM_COUNT; g++)
        cb[g] = g_cublas && (g_gemm < 0 || g_gemm == g) ? cublas_ms(h, &B, g) : -1.0f;
    for (int f = 0; f < NFAM; f++) {
        if (!ops[f]) continue;
        const smoe_gemm_ops *G = ops[f];
        smoe_gemm_problem p = problem_of(&B, num_sms);
        smoe_gemm_plan plan, run;
        G->plan(&p, &plan);
        for (int g = 0; g < SMOE_GEMM_COUNT; g++)
            if (g_row[f][g] >= 0) plan.row[g] = g_row[f][g];
        run = plan;
        p.plan = &run;
        double fwd = 0, bwd = 0;
        int timed = 0;
        for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
            if (g_gemm >= 0 && g != g_gemm) continue;
            if (plan.row[g] < 0) {
                printf("  %s %-5s no row of this family runs the shape\n", g_fam_name[f],
                       smoe_gemm_name(g));
                continue;
            }
            int64_t M, N, K;
            gemm_mnk(&B, g, &M, &N, &K);
            const double flop = 2.0 * (double)M * N * K;
            const int wgrad = g == SMOE_GEMM_DW2 || g == SMOE_GEMM_DW1;
            for (int r = g_all_rows ? 0 : plan.row[g]; G->row_name(g, r); r++) {
                if (g_all_rows && r != plan.row[g] && !G->row_fits(&p, g, r)) continue;
                run.row[g] = r;
                for (int wg = 0; wg < NWG; wg++) {
                    if (wgrad ? !g_wg[wg] : wg != WG_BF16) continue;
                    gemm_call c = {G, &p, &B, g, wg};
                    const float ms = median_ms(gemm_run, &c);
                    char what[32];
                    snprintf(what, sizeof what, "%s%s%s", smoe_gemm_name(g), wgrad ? " " : "",
                             wgrad ? g_wg_name[wg] : "");
                    if (ms < 0) {
                        printf("  %s %-12s \"%s\": %s\n", g_fam_name[f], what, G->row_name(g, r),
                               smoe_last_error());
                        continue;
                    }
                    const int is_plan = r == plan.row[g];
                    const double ratio = cb[g] > 0 ? cb[g] / ms : 0;
                    printf("  %s %-12s %-26s %-4s %8.3f ms %6.1f TFLOPS", g_fam_name[f], what,
                           G->row_name(g, r), is_plan ? "plan" : "", ms, flop / ms * 1e-9);
                    if (cb[g] > 0)
                        printf(" | cuBLAS %8.3f ms %6.1f TFLOPS | %.2fx", cb[g],
                               flop / cb[g] * 1e-9, ratio);
                    printf("\n");
                    if (g_csv)
                        fprintf(g_csv, "%s,%s,%s,%s,%d,%s,%.4f,%.2f,%.4f,%.3f\n", g_fam_name[f],
                                S->name, smoe_gemm_name(g), G->row_name(g, r), is_plan,
                                wgrad ? g_wg_name[wg] : "", ms, flop / ms * 1e-9,
                                cb[g] > 0 ? cb[g] : 0.0, ratio);
                    if (is_plan && (!wgrad || wg == first_wg())) {
                        if (ratio > 0) {
                            g_log_ratio[f] += log(ratio);
                            g_nratio[f]++;
                        }
                        timed++;
                        if (g <= SMOE_GEMM_DOWN) fwd += ms;
                        else bwd += ms;
                    }
                }
                if (!g_all_rows) break;
            }
            run.row[g] = plan.row[g];
        }
        if (timed == SMOE_GEMM_COUNT) {
            const double f3 = 2.0 * B.R * B.d * B.n;
            printf("  %s fwd GEMMs %8.3f ms %6.1f TFLOPS   bwd GEMMs %8.3f ms %6.1f TFLOPS\n",
                   g_fam_name[f], fwd, 3 * f3 / fwd * 1e-9, bwd, 6 * f3 / bwd * 1e-9);
        }
    }
    fflush(stdout);
    bufs_free(&B);
}

/* ------------------------------------------------------------ main */

/* --row GEMM=NAME: the row in every family whose table has it. */
static int parse_row(const char *spec, const smoe_gemm_ops *const *all)
{
    const char *eq = strchr(spec, '=');
    const int g = eq ? smoe_gemm_find(spec, (size_t)(eq - spec)) : -1;
    int found = 0;
    for (int f = 0; g >= 0 && f < NFAM; f++) {
        if (!all[f]) continue;
        g_row[f][g] = smoe_gemm_row_find(all[f], g, eq + 1);
        found += g_row[f][g] >= 0;
    }
    if (found) return 0;
    fprintf(stderr, "--row %s: no such GEMM or row; the rows:\n", spec);
    for (int f = 0; f < NFAM; f++) {
        if (!all[f]) continue;
        for (int gg = 0; gg < SMOE_GEMM_COUNT; gg++) {
            fprintf(stderr, "  %s %s:", g_fam_name[f], smoe_gemm_name(gg));
            for (int r = 0; all[f]->row_name(gg, r); r++)
                fprintf(stderr, " \"%s\"", all[f]->row_name(gg, r));
            fprintf(stderr, "\n");
        }
    }
    return -1;
}

static int usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--family sm80|sm90|all] [--shape NAME[,NAME...]] [--gemm NAME]\n"
            "       [--all-rows] [--row GEMM=NAME ...] [--wgrad bf16|f32|f32-acc|all]\n"
            "       [--reps N] [--warmup N] [--no-flush] [--no-cublas] [--csv FILE]\n"
            "       [--routing random|balanced|even|hot]\n",
            argv0);
    return 2;
}

int main(int argc, char **argv)
{
    const smoe_gemm_ops *all[NFAM] = {&smoe_gemm_ops_sm80, NULL};
#ifdef SMOE_WITH_SM90
    all[FAM_SM90] = &smoe_gemm_ops_sm90;
#endif
    int fam[NFAM] = {1, 1};
    const char *shapes = NULL;
    add_model_shapes();
    for (int f = 0; f < NFAM; f++)
        for (int g = 0; g < SMOE_GEMM_COUNT; g++) g_row[f][g] = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--all-rows")) g_all_rows = 1;
        else if (!strcmp(a, "--no-cublas")) g_cublas = 0;
        else if (!strcmp(a, "--no-flush")) g_flush = 0;
        else if (!v) return usage(argv[0]);
        else if (!strcmp(a, "--family")) {
            fam[FAM_SM80] = !strcmp(v, "sm80") || !strcmp(v, "all");
            fam[FAM_SM90] = !strcmp(v, "sm90") || !strcmp(v, "all");
            if (!fam[FAM_SM80] && !fam[FAM_SM90]) return usage(argv[0]);
            i++;
        } else if (!strcmp(a, "--shape")) shapes = argv[++i];
        else if (!strcmp(a, "--gemm")) {
            g_gemm = smoe_gemm_find(v, strlen(v));
            if (g_gemm < 0) return usage(argv[0]);
            i++;
        } else if (!strcmp(a, "--row")) {
            if (parse_row(v, all)) return 2;
            i++;
        } else if (!strcmp(a, "--wgrad")) {
            int all_modes = !strcmp(v, "all"), any = all_modes;
            for (int w = 0; w < NWG; w++) {
                g_wg[w] = all_modes || !strcmp(v, g_wg_name[w]);
                any |= g_wg[w];
            }
            if (!any) return usage(argv[0]);
            i++;
        } else if (!strcmp(a, "--routing")) {
            g_routing = -1;
            for (int k = 0; k < NROUTE; k++)
                if (!strcmp(v, g_route_name[k])) g_routing = k;
            if (g_routing < 0) return usage(argv[0]);
            i++;
        } else if (!strcmp(a, "--reps")) g_reps = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup")) g_warmup = atoi(argv[++i]);
        else if (!strcmp(a, "--csv")) {
            g_csv = fopen(v, "w");
            if (!g_csv) {
                perror(v);
                return 2;
            }
            fprintf(g_csv, "family,shape,gemm,row,plan,wgrad,ms,tflops,cublas_ms,ratio\n");
            i++;
        } else return usage(argv[0]);
    }
    if (g_reps < 1 || g_warmup < 0) return usage(argv[0]);
    if (shapes) { /* every name in the list must be a shape */
        int named = 1, known = 0;
        for (const char *q = shapes; *q; q++) named += *q == ',';
        for (int k = 0; k < NSHAPES; k++) known += in_list(shapes, g_shapes[k].name);
        known += in_list(shapes, "models") + in_list(shapes, "grid");
        if (known != named) {
            fprintf(stderr, "--shape %s: the shapes are", shapes);
            for (int k = 0; k < NSHAPES; k++) fprintf(stderr, " %s", g_shapes[k].name);
            fprintf(stderr, ", grid (its twelve rows) and models (every model's)\n");
            return 2;
        }
    }
    const int cc = tu_gpu_cc("bench_gemm");
    if (!cc) return 0;
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const smoe_gemm_ops *ops[NFAM];
    for (int f = 0; f < NFAM; f++) ops[f] = fam[f] ? all[f] : NULL;
    if (ops[FAM_SM90] && cc != 90) {
        printf("sm90: needs an sm_90 device (this one is sm_%d), left out\n", cc);
        ops[FAM_SM90] = NULL;
    }
    if (g_flush) {
        g_flush_bytes = (size_t)256 << 20;
        const size_t l2 = (size_t)prop.l2CacheSize;
        if (2 * l2 > g_flush_bytes) g_flush_bytes = 2 * l2;
        g_flush_buf = tu_dev_alloc(g_flush_bytes);
    }
    printf("bench_gemm on %s (sm_%d, %d SMs, L2 %d MiB): median of %d after %d warm-up%s, ",
           prop.name, cc, prop.multiProcessorCount, prop.l2CacheSize >> 20, g_reps, g_warmup,
           g_warmup == 1 ? "" : "s");
    if (g_flush) printf("L2 flushed before each call (%zu MiB memset)\n", g_flush_bytes >> 20);
    else printf("L2 not flushed (--no-flush)\n");
    cublasHandle_t h = NULL;
    if (g_cublas && cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        printf("cublasCreate failed: no cuBLAS baseline\n");
        g_cublas = 0;
    }
    for (int k = 0; k < NSHAPES; k++)
        if (shape_wanted(shapes, k))
            bench_shape(&g_shapes[k], ops, prop.multiProcessorCount, h);
    printf("\n");
    for (int f = 0; f < NFAM; f++)
        if (g_nratio[f])
            printf("%s: geometric mean of cuBLAS time / ours over %d plan rows: %.3f\n",
                   g_fam_name[f], g_nratio[f], exp(g_log_ratio[f] / g_nratio[f]));
    if (g_cublas && g_gemm < 0) {
        cublas_call c = {h, 0, 8192, 8192, 8192, 1, NULL, NULL, NULL};
        const size_t sq = (size_t)8192 * 8192;
        c.A = tu_dev_alloc(2 * sq);
        c.B = tu_dev_alloc(2 * sq);
        c.C = tu_dev_alloc(2 * sq);
        tu_dev_fill_bf16(c.A, sq, 400, -1.0f, 1.0f);
        tu_dev_fill_bf16(c.B, sq, 401, -1.0f, 1.0f);
        const float ms = median_ms(cublas_run, &c);
        printf("cuBLAS dense bf16 8192^3: %.3f ms %.1f TFLOPS\n", ms,
               2.0 * 8192.0 * 8192.0 * 8192.0 / ms * 1e-9);
        CUDA_OK(cudaFree(c.A));
        CUDA_OK(cudaFree(c.B));
        CUDA_OK(cudaFree(c.C));
    }
    if (h) cublasDestroy(h);
    if (g_flush_buf) CUDA_OK(cudaFree(g_flush_buf));
    if (g_csv) fclose(g_csv);
    return 0;
}
