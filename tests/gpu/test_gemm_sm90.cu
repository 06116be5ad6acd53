/*
 * test_gemm_sm90.cu -- the Hopper grouped GEMMs of smoe_gemm_ops_sm90 (up,
 * down, dxt, dh) against an independent reference: naive CUDA kernels (one
 * thread per output, fp32 sums of bf16 products) for the GEMMs and host double
 * for the activation, dSwiGLU, A' and dS.
 *
 *   test_gemm_sm90              correctness: random shapes, random expert
 *                               counts (empty experts, counts that are not
 *                               multiples of 128 or 64), every activation,
 *                               both W1 layouts, with/without bias and H;
 *                               poisoned outputs; run-to-run bit equality.
 *   test_gemm_sm90 --grid       the benchmark grid's shapes (bench/bench_gemm.cu)
 *                               with balanced routing, each GEMM once, 1000
 *                               sampled rows checked.
 *   --row GEMM=NAME             every case and shape with that row of
 *                               GEMM's tile table (up, down, dxt, dh; the
 *                               names of grouped_gemm_sm90.cu's table, e.g.
 *                               --row "down=256x4 tma-store"), the table's
 *                               plan for the others; cases whose shape
 *                               the row cannot run are skipped; every
 *                               other case on a grid of 2-8 SMs;
 *                               --seed, --cases.
 *   Without --row, after the plan's cases: every row of every table on
 *   further random cases (at least 6 that the row can run, every other one
 *   on a grid of 2-8 SMs, so that each CTA runs several tiles),
 *   so each kernel the table holds stays tested.
 *   test_gemm_sm90 --small      one small case (for compute-sanitizer).
 *   --trace                     each op synchronised and named as it ends.
 *   --only-case N               run only case N (as numbered in the output,
 *                               the variant sweep's too); the others are
 *                               still drawn, so case N is the same.
 *
 * Exit status 0 only if every check passed. Seeded; a failure prints the
 * seed and the case. The timings of these GEMMs are bench/bench_gemm.cu's.
 */
#include "cuda/gemm.h"
#include "testutil_cuda.h"

/* The plan every case runs: the table's (smoe_gemm_ops_sm90.plan), with
 * g_force_row as GEMM g_force_gemm's row when g_force_gemm >= 0. */
static smoe_gemm_plan g_plan;
static int g_force_gemm = -1, g_force_row = -1;

/* The library's error recorder, for linking the GEMM object alone; the
 * library's own definition wins when it is linked in. */
extern "C" __attribute__((weak)) smoe_status smoe_fail(smoe_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "smoe_fail: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return status;
}

/* ------------------------------------------------------------ rng */

static tu_rng g_rng;
static uint32_t rnd(void) { return (uint32_t)tu_next(&g_rng); }
static int rnd_int(int lo, int hi) { return (int)tu_int(&g_rng, lo, hi); }

/* uniform in [-scale, scale), rounded to bf16 */
static void rand_bf16(bf16 *p, int64_t count, float scale)
{
    if (count > 0) tu_dev_fill_bf16(p, (size_t)count, tu_next(&g_rng), -scale, scale);
}

/* ------------------------------------------------------------ reference kernels */

/* ref[i][c] = sum_k X[tok][k] W1[e][phys(c)][k] + b1[e][phys(c)], for the rows listed */
__global__ void ref_up_kernel(const int32_t *rows, int nrows, const int32_t *row_expert,
                              const int32_t *row_token, const bf16 *x, const bf16 *w1,
                              const bf16 *b1, int d, int n, int h_cols, int gated, int layout,
                              float *ref)
{
    int i = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nrows || c >= h_cols) return;
    int r = rows[i], e = row_expert[r], t = row_token[r];
    int64_t pc = smoe_w1_row(c, n, gated, (smoe_w1_layout)layout);
    const bf16 *xr = x + (int64_t)t * d;
    const bf16 *wr = w1 + ((int64_t)e * h_cols + pc) * d;
    float s = 0.0f;
    for (int k = 0; k < d; k++) s += __bfloat162float(xr[k]) * __bfloat162float(wr[k]);
    if (b1) s += __bfloat162float(b1[(int64_t)e * h_cols + pc]);
    ref[(int64_t)i * h_cols + c] = s;
}

/* ref[i][c] = sum_k A[r][k] W2[e][c][k] + b2[e][c] */
__global__ void ref_down_kernel(const int32_t *rows, int nrows, const int32_t *row_expert,
                                const bf16 *a, const bf16 *w2, const bf16 *b2, int d, int n,
                                float *ref)
{
    int i = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nrows || c >= d) return;
    int r = rows[i], e = row_expert[r];
    const bf16 *ar = a + (int64_t)r * n;
    const bf16 *wr = w2 + ((int64_t)e * d + c) * n;
    float s = 0.0f;
    for (int k = 0; k < n; k++) s += __bfloat162float(ar[k]) * __bfloat162float(wr[k]);
    if (b2) s += __bfloat162float(b2[(int64_t)e * d + c]);
    ref[(int64_t)i * d + c] = s;
}

/* ref[i][c] = sum_k dH[r][k] W1[e][phys(k)][c] */
__global__ void ref_dxt_kernel(const int32_t *rows, int nrows, const int32_t *row_expert,
                               const bf16 *dh, const bf16 *w1, int d, int n, int h_cols, int gated,
                               int layout, float *ref)
{
    int i = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nrows || c >= d) return;
    int r = rows[i], e = row_expert[r];
    const bf16 *dr = dh + (int64_t)r * h_cols;
    float s = 0.0f;
    for (int k = 0; k < h_cols; k++) {
        int64_t pk = smoe_w1_row(k, n, gated, (smoe_w1_layout)layout);
        s += __bfloat162float(dr[k]) * __bfloat162float(w1[((int64_t)e * h_cols + pk) * d + c]);
    }
    ref[(int64_t)i * d + c] = s;
}

/* dap[i][j] = sum_k dO[tok][k] W2[e][k][j]; bdot[i] = <dO[tok], b2[e]> (b2 may be NULL) */
__global__ void ref_dap_kernel(const int32_t *rows, int nrows, const int32_t *row_expert,
                               const int32_t *row_token, const bf16 *dout, const bf16 *w2,
                               const bf16 *b2, int d, int n, float *dap, float *bdot)
{
    int i = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nrows || j > n) return;
    int r = rows[i], e = row_expert[r], t = row_token[r];
    const bf16 *x = dout + (int64_t)t * d;
    float s = 0.0f;
    if (j < n) {
        for (int k = 0; k < d; k++)
            s += __bfloat162float(x[k]) * __bfloat162float(w2[((int64_t)e * d + k) * n + j]);
        dap[(int64_t)i * n + j] = s;
    } else {
        if (b2)
            for (int k = 0; k < d; k++)
                s += __bfloat162float(x[k]) * __bfloat162float(b2[(int64_t)e * d + k]);
        bdot[i] = s;
    }
}

/* ------------------------------------------------------------ host helpers */

static float bf2f(bf16 v) { return __bfloat162float(v); }
static float round_bf16(float f) { return (float)tu_round_bf16(f); }
static int is_poison(bf16 v)
{
    uint16_t b;
    memcpy(&b, &v, 2);
    return b == TU_POISON_BF16;
}

/* A tally (tolerance rtol |ref| + atol) passes with no element outside its
 * tolerance, none non-finite and a relative Frobenius error under 8e-3. */
static int check_report(const tu_tally *c, const char *tag)
{
    double rel = tu_tally_rel(c);
    int ok = c->bad == 0 && c->nonfinite == 0 && rel < 8e-3;
    if (!ok)
        printf("  FAIL %s %s: %lld/%lld outside tol, %lld non-finite, rel err %.3g, "
               "worst excess %.3g\n",
               tag, c->what, c->bad, c->count, c->nonfinite, rel, c->max_excess);
    return ok;
}

static double rms_of(const float *v, int64_t count)
{
    double s = 0;
    for (int64_t i = 0; i < count; i++) s += (double)v[i] * v[i];
    return count ? sqrt(s / count) : 0.0;
}

/* ------------------------------------------------------------ one problem */

typedef struct problem_host {
    int64_t T, d, n, E, cap, R;
    int act, layout, gated, bias;
    int32_t *offset;     /* E+1 */
    int32_t *row_token;  /* cap (rows >= R: garbage) */
    int32_t *row_expert; /* cap */
} problem_host;

typedef struct problem_dev {
    bf16 *x, *w1, *b1, *w2, *b2, *h, *a, *y, *a_in, *dh_in, *dxt;
    bf16 *dout, *dh_out, *as_out; /* dh: dO (T, d), outputs (cap, h_cols), (cap, n) */
    float *score, *ds_out, *scratch;
    int dh_ran;
    int dxt_ran; /* dxt ran (interleaved or non-gated W1) */
    int32_t *offset, *row_token, *row_expert, *rows;
    float *ref;
} problem_dev;

static void dev_alloc(problem_dev *D, const problem_host *P)
{
    int64_t hc = P->gated ? 2 * P->n : P->n;
    memset(D, 0, sizeof(*D));
    CUDA_OK(cudaMalloc(&D->x, P->T * P->d * 2));
    CUDA_OK(cudaMalloc(&D->w1, P->E * hc * P->d * 2));
    CUDA_OK(cudaMalloc(&D->b1, P->E * hc * 2));
    CUDA_OK(cudaMalloc(&D->w2, P->E * P->d * P->n * 2));
    CUDA_OK(cudaMalloc(&D->b2, P->E * P->d * 2));
    CUDA_OK(cudaMalloc(&D->h, P->cap * hc * 2 + 16));
    CUDA_OK(cudaMalloc(&D->a, P->cap * P->n * 2 + 16));
    CUDA_OK(cudaMalloc(&D->a_in, P->cap * P->n * 2 + 16));
    CUDA_OK(cudaMalloc(&D->y, P->cap * P->d * 2 + 16));
    CUDA_OK(cudaMalloc(&D->dh_in, P->cap * hc * 2 + 16));
    CUDA_OK(cudaMalloc(&D->dxt, P->cap * P->d * 2 + 16));
    CUDA_OK(cudaMalloc(&D->dout, P->T * P->d * 2 + 16));
    CUDA_OK(cudaMalloc(&D->dh_out, P->cap * hc * 2 + 16));
    CUDA_OK(cudaMalloc(&D->as_out, P->cap * P->n * 2 + 16));
    CUDA_OK(cudaMalloc(&D->score, P->cap * 4 + 16));
    CUDA_OK(cudaMalloc(&D->ds_out, P->cap * 4 + 16));
    CUDA_OK(cudaMalloc(&D->scratch, P->cap * 4 * ((P->n + 127) / 128) + 32));
    {
        float *sc = (float *)malloc(P->cap * 4 + 4);
        for (int64_t r = 0; r < P->cap; r++) sc[r] = 0.05f + (rnd() % 1000) / 1000.0f;
        CUDA_OK(cudaMemcpy(D->score, sc, P->cap * 4, cudaMemcpyHostToDevice));
        free(sc);
    }
    CUDA_OK(cudaMalloc(&D->offset, (P->E + 1) * 4));
    CUDA_OK(cudaMalloc(&D->row_token, P->cap * 4 + 4));
    CUDA_OK(cudaMalloc(&D->row_expert, P->cap * 4 + 4));
    CUDA_OK(cudaMemcpy(D->offset, P->offset, (P->E + 1) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(D->row_token, P->row_token, P->cap * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(D->row_expert, P->row_expert, P->cap * 4, cudaMemcpyHostToDevice));
    rand_bf16(D->x, P->T * P->d, 1.0f);
    rand_bf16(D->w1, P->E * hc * P->d, 2.0f / sqrtf((float)P->d));
    rand_bf16(D->b1, P->E * hc, 0.5f);
    rand_bf16(D->w2, P->E * P->d * P->n, 2.0f / sqrtf((float)P->n));
    rand_bf16(D->b2, P->E * P->d, 0.5f);
    rand_bf16(D->a_in, P->cap * P->n, 1.0f);
    rand_bf16(D->dh_in, P->cap * hc, 1.0f);
    rand_bf16(D->dout, P->T * P->d, 1.0f);
    if (P->cap > P->R) CUDA_OK(cudaMemset(D->dh_in + P->R * hc, 0xFF, (P->cap - P->R) * hc * 2));
    /* rows past R of the down input: NaN, which must not reach any output */
    if (P->cap > P->R) CUDA_OK(cudaMemset(D->a_in + P->R * P->n, 0xFF, (P->cap - P->R) * P->n * 2));
}

static void dev_free(problem_dev *D)
{
    cudaFree(D->x); cudaFree(D->w1); cudaFree(D->b1); cudaFree(D->w2); cudaFree(D->b2);
    cudaFree(D->h); cudaFree(D->a); cudaFree(D->a_in); cudaFree(D->y); cudaFree(D->offset);
    cudaFree(D->dh_in); cudaFree(D->dxt);
    cudaFree(D->dout); cudaFree(D->dh_out); cudaFree(D->as_out); cudaFree(D->score);
    cudaFree(D->ds_out); cudaFree(D->scratch);
    cudaFree(D->row_token); cudaFree(D->row_expert); cudaFree(D->rows); cudaFree(D->ref);
}

static smoe_gemm_problem make_problem(const problem_host *P, const problem_dev *D, int sms)
{
    smoe_gemm_problem g;
    memset(&g, 0, sizeof(g));
    g.d = P->d;
    g.n = P->n;
    g.gated = P->gated;
    g.h_cols = P->gated ? 2 * P->n : P->n;
    g.E = P->E;
    g.cap = P->cap;
    g.act = (smoe_activation)P->act;
    g.w1_layout = (smoe_w1_layout)P->layout;
    g.expert_offset = D->offset;
    g.row_token = D->row_token;
    g.row_score = D->score;
    g.num_sms = sms;
    smoe_gemm_ops_sm90.plan(&g, &g_plan);
    if (g_force_gemm >= 0) g_plan.row[g_force_gemm] = g_force_row;
    g.plan = &g_plan;
    return g;
}

/* Whether the forced row (if any) can run g's shape. */
static int forced_row_fits(const smoe_gemm_problem *g)
{
    return g_force_gemm < 0 || smoe_gemm_ops_sm90.row_fits(g, g_force_gemm, g_force_row);
}

/* Checks rows `rows` (host list, nr of them) of H/A (up) and Y (down). Returns 1 if good. */
static int verify(const problem_host *P, problem_dev *D, const int32_t *rows, int nr, int with_h,
                  const char *tag)
{
    int64_t hc = P->gated ? 2 * P->n : P->n;
    const smoe_activation act = (smoe_activation)P->act;
    int ok = 1;
    if (nr == 0) return 1;
    CUDA_OK(cudaMalloc(&D->rows, nr * 4));
    CUDA_OK(cudaMemcpy(D->rows, rows, nr * 4, cudaMemcpyHostToDevice));
    int64_t refcols = hc > P->d ? hc : P->d;
    CUDA_OK(cudaMalloc(&D->ref, (int64_t)nr * refcols * 4));
    float *ref = (float *)malloc((size_t)nr * refcols * 4);
    bf16 *gh = (bf16 *)malloc((size_t)hc * 2), *ga = (bf16 *)malloc((size_t)P->n * 2);
    bf16 *gy = (bf16 *)malloc((size_t)P->d * 2);

    /* up */
    ref_up_kernel<<<dim3((unsigned)((hc + 127) / 128), nr), 128>>>(
        D->rows, nr, D->row_expert, D->row_token, D->x, D->w1, P->bias ? D->b1 : NULL, (int)P->d,
        (int)P->n, (int)hc, P->gated, P->layout, D->ref);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(ref, D->ref, (size_t)nr * hc * 4, cudaMemcpyDeviceToHost));
    double rms_h = rms_of(ref, (int64_t)nr * hc);
    float *want = (float *)malloc((size_t)nr * P->n * 4);
    for (int64_t i = 0; i < nr; i++) {
        const float *rr = ref + i * hc;
        for (int64_t j = 0; j < P->n; j++)
            want[i * P->n + j] =
                (float)(P->gated ? tu_act1(act, round_bf16(rr[2 * j])) * round_bf16(rr[2 * j + 1])
                                 : tu_act1(act, round_bf16(rr[j])));
    }
    double rms_a = rms_of(want, (int64_t)nr * P->n);
    tu_tally ch = tu_tally_make("H", 1.0 / 128, 1e-3 * rms_h);
    /* A from a bf16 H that may sit one ulp away from the rounded reference */
    tu_tally ca = tu_tally_make("A", 1.0 / 64, 1e-2 * rms_a);
    for (int i = 0; i < nr; i++) {
        int64_t r = rows[i];
        const float *rr = ref + (int64_t)i * hc;
        if (with_h) {
            CUDA_OK(cudaMemcpy(gh, D->h + r * hc, hc * 2, cudaMemcpyDeviceToHost));
            for (int64_t c = 0; c < hc; c++) tu_tally_rt(&ch, bf2f(gh[c]), rr[c], r * hc + c);
        }
        CUDA_OK(cudaMemcpy(ga, D->a + r * P->n, P->n * 2, cudaMemcpyDeviceToHost));
        for (int64_t j = 0; j < P->n; j++)
            tu_tally_rt(&ca, bf2f(ga[j]), want[(int64_t)i * P->n + j], r * P->n + j);
    }
    free(want);
    if (with_h) ok &= check_report(&ch, tag);
    ok &= check_report(&ca, tag);

    /* down */
    ref_down_kernel<<<dim3((unsigned)((P->d + 127) / 128), nr), 128>>>(
        D->rows, nr, D->row_expert, D->a_in, D->w2, P->bias ? D->b2 : NULL, (int)P->d, (int)P->n,
        D->ref);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(ref, D->ref, (size_t)nr * P->d * 4, cudaMemcpyDeviceToHost));
    double rms_y = rms_of(ref, (int64_t)nr * P->d);
    tu_tally cy = tu_tally_make("Y", 1.0 / 128, 1e-3 * rms_y);
    for (int i = 0; i < nr; i++) {
        int64_t r = rows[i];
        CUDA_OK(cudaMemcpy(gy, D->y + r * P->d, P->d * 2, cudaMemcpyDeviceToHost));
        for (int64_t c = 0; c < P->d; c++)
            tu_tally_rt(&cy, bf2f(gy[c]), ref[(int64_t)i * P->d + c], r * P->d + c);
    }
    ok &= check_report(&cy, tag);

    /* dxt */
    if (D->dxt_ran) {
        ref_dxt_kernel<<<dim3((unsigned)((P->d + 127) / 128), nr), 128>>>(
            D->rows, nr, D->row_expert, D->dh_in, D->w1, (int)P->d, (int)P->n, (int)hc, P->gated,
            P->layout, D->ref);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaMemcpy(ref, D->ref, (size_t)nr * P->d * 4, cudaMemcpyDeviceToHost));
        double rms_x = rms_of(ref, (int64_t)nr * P->d);
        tu_tally cx = tu_tally_make("dXt", 1.0 / 128, 1e-3 * rms_x);
        for (int i = 0; i < nr; i++) {
            int64_t r = rows[i];
            CUDA_OK(cudaMemcpy(gy, D->dxt + r * P->d, P->d * 2, cudaMemcpyDeviceToHost));
            for (int64_t c = 0; c < P->d; c++)
                tu_tally_rt(&cx, bf2f(gy[c]), ref[(int64_t)i * P->d + c], r * P->d + c);
        }
        ok &= check_report(&cx, tag);
    }

    /* dh: H input = dh_in, score, dO */
    if (D->dh_ran) {
        float *dap_d, *bdot_d;
        CUDA_OK(cudaMalloc(&dap_d, (size_t)nr * P->n * 4));
        CUDA_OK(cudaMalloc(&bdot_d, (size_t)nr * 4));
        ref_dap_kernel<<<dim3((unsigned)((P->n + 1 + 127) / 128), nr), 128>>>(
            D->rows, nr, D->row_expert, D->row_token, D->dout, D->w2, P->bias ? D->b2 : NULL,
            (int)P->d, (int)P->n, dap_d, bdot_d);
        CUDA_OK(cudaGetLastError());
        float *dap = (float *)malloc((size_t)nr * P->n * 4), *bdot = (float *)malloc(nr * 4);
        CUDA_OK(cudaMemcpy(dap, dap_d, (size_t)nr * P->n * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(bdot, bdot_d, (size_t)nr * 4, cudaMemcpyDeviceToHost));
        cudaFree(dap_d); cudaFree(bdot_d);
        bf16 *hin = (bf16 *)malloc(hc * 2), *gdh = (bf16 *)malloc(hc * 2), *gas = (bf16 *)malloc(P->n * 2);
        double *wdh = (double *)malloc(hc * sizeof(double)), *was = (double *)malloc(P->n * sizeof(double));
        /* expected values first (for the scales), then the checks */
        double s2dh = 0, s2as = 0;
        int64_t cnt_dh = 0, cnt_as = 0;
        for (int pass = 0; pass < 2; pass++) {
            tu_tally cdh =
                tu_tally_make("dH", 1.0 / 64, pass ? 1e-2 * sqrt(s2dh / (cnt_dh + 1)) : 0);
            tu_tally cas =
                tu_tally_make("A'", 1.0 / 64, pass ? 1e-2 * sqrt(s2as / (cnt_as + 1)) : 0);
            int64_t ds_bad = 0;
            double ds_worst = 0;
            for (int i = 0; i < nr; i++) {
                int64_t r = rows[i];
                float s;
                CUDA_OK(cudaMemcpy(hin, D->dh_in + r * hc, hc * 2, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(&s, D->score + r, 4, cudaMemcpyDeviceToHost));
                double dsum = 0, dabs = 0;
                for (int64_t j = 0; j < P->n; j++) {
                    double da = dap[(int64_t)i * P->n + j], f, df, A;
                    if (P->gated) {
                        double g = bf2f(hin[2 * j]), u = bf2f(hin[2 * j + 1]);
                        f = tu_act1(act, g);
                        df = tu_act1_d(act, g);
                        A = f * u;
                        wdh[2 * j] = s * da * df * u;
                        wdh[2 * j + 1] = s * da * f;
                    } else {
                        f = tu_act1(act, bf2f(hin[j]));
                        df = tu_act1_d(act, bf2f(hin[j]));
                        A = f;
                        wdh[j] = s * da * df;
                    }
                    was[j] = s * A;
                    dsum += da * A;
                    dabs += fabs(da * A);
                }
                if (!pass) {
                    for (int64_t c = 0; c < hc; c++) s2dh += wdh[c] * wdh[c];
                    for (int64_t j = 0; j < P->n; j++) s2as += was[j] * was[j];
                    cnt_dh += hc;
                    cnt_as += P->n;
                    continue;
                }
                CUDA_OK(cudaMemcpy(gdh, D->dh_out + r * hc, hc * 2, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(gas, D->as_out + r * P->n, P->n * 2, cudaMemcpyDeviceToHost));
                for (int64_t c = 0; c < hc; c++)
                    tu_tally_rt(&cdh, bf2f(gdh[c]), wdh[c], r * hc + c);
                for (int64_t j = 0; j < P->n; j++)
                    tu_tally_rt(&cas, bf2f(gas[j]), was[j], r * P->n + j);
                float gds;
                CUDA_OK(cudaMemcpy(&gds, D->ds_out + r, 4, cudaMemcpyDeviceToHost));
                double want = dsum + bdot[i], tol = 4e-3 * (dabs + fabs(bdot[i])) + 1e-5;
                if (!(fabs(gds - want) <= tol)) {
                    ds_bad++;
                    if (fabs(gds - want) > ds_worst || !isfinite(gds)) ds_worst = fabs(gds - want);
                }
            }
            if (pass) {
                ok &= check_report(&cdh, tag);
                ok &= check_report(&cas, tag);
                if (ds_bad) {
                    printf("  FAIL %s dS: %lld rows outside tol, worst %.3g\n", tag, (long long)ds_bad, ds_worst);
                    ok = 0;
                }
            }
        }
        free(dap); free(bdot); free(hin); free(gdh); free(gas); free(wdh); free(was);
    }

    cudaFree(D->rows); D->rows = NULL;
    cudaFree(D->ref); D->ref = NULL;
    free(ref); free(gh); free(ga); free(gy);
    return ok;
}

/* Rows [R, cap) of the outputs must still hold the poison. */
static int check_untouched(const bf16 *dptr, int64_t R, int64_t cap, int64_t cols, const char *what,
                           const char *tag)
{
    if (cap <= R || !dptr) return 1;
    int64_t cnt = (cap - R) * cols;
    bf16 *hbuf = (bf16 *)malloc((size_t)cnt * 2);
    CUDA_OK(cudaMemcpy(hbuf, dptr + R * cols, (size_t)cnt * 2, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < cnt; i++) bad += !is_poison(hbuf[i]);
    free(hbuf);
    if (bad) printf("  FAIL %s %s: %lld elements past R were written\n", tag, what, (long long)bad);
    return bad == 0;
}

static int bitwise_equal(const bf16 *d1, const bf16 *d2, int64_t count)
{
    if (count == 0) return 1;
    uint16_t *a = (uint16_t *)malloc((size_t)count * 2), *b = (uint16_t *)malloc((size_t)count * 2);
    CUDA_OK(cudaMemcpy(a, d1, (size_t)count * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b, d2, (size_t)count * 2, cudaMemcpyDeviceToHost));
    int eq = memcmp(a, b, (size_t)count * 2) == 0;
    free(a); free(b);
    return eq;
}

static void build_rows_from_counts(problem_host *P, const int *counts)
{
    P->offset = (int32_t *)malloc((P->E + 1) * 4);
    P->offset[0] = 0;
    for (int e = 0; e < P->E; e++) P->offset[e + 1] = P->offset[e] + counts[e];
    P->R = P->offset[P->E];
    P->row_token = (int32_t *)malloc((P->cap + 1) * 4);
    P->row_expert = (int32_t *)malloc((P->cap + 1) * 4);
    for (int e = 0; e < P->E; e++) {
        int32_t prev = -1;
        for (int r = P->offset[e]; r < P->offset[e + 1]; r++) {
            /* ascending tokens within an expert, like the real metadata */
            int32_t t = prev + 1 + (int32_t)(rnd() % 3);
            if (t >= P->T) t = (int32_t)(rnd() % P->T);
            P->row_token[r] = t;
            prev = t;
            P->row_expert[r] = e;
        }
    }
    for (int64_t r = P->R; r < P->cap; r++) {
        P->row_token[r] = 0x7FFFFFF0; /* garbage past R: must never be read */
        P->row_expert[r] = 0;
    }
}

/* One random correctness case. */
/* --trace: each op of run_case synchronised and named on stdout (flushed)
 * as it finishes, to find the launch a sanitizer run stops in. */
static int g_trace = 0;
static void trace_op(const char *tag, int rep, const char *op)
{
    if (!g_trace) return;
    cudaError_t e = cudaDeviceSynchronize();
    printf("  trace %s rep %d: %s done (%s)\n", tag, rep, op, cudaGetErrorString(e));
    fflush(stdout);
}

/* --only-case N: every case is still drawn (the generator's sequence, and so
 * each case, stays the same), only case N runs; run_case returns -1 for the
 * others. */
static int g_only_case = -1;

/* 1 passed, 0 failed, -1 skipped (--only-case) */
static int run_case(int idx, int sms)
{
    static const int ds[] = {64, 128, 192, 256, 384, 512, 576};
    static const int ns[] = {64, 128, 192, 256, 320, 512};
    static const int Es[] = {1, 2, 3, 5, 8, 16, 33};
    problem_host P;
    memset(&P, 0, sizeof(P));
    P.d = ds[rnd() % 7];
    P.n = ns[rnd() % 6];
    P.E = Es[rnd() % 7];
    P.T = rnd_int(1, 700);
    P.act = rnd_int(0, 6);
    P.gated = P.act <= SMOE_ACT_REGLU;
    P.layout = rnd_int(0, 1);
    P.bias = rnd_int(0, 1);
    int with_h = rnd_int(0, 3) != 0;
    int *counts = (int *)malloc(P.E * sizeof(int));
    int64_t R = 0;
    for (int e = 0; e < P.E; e++) {
        int kind = rnd_int(0, 5);
        counts[e] = kind == 0 ? 0 : kind == 1 ? 128 * rnd_int(1, 3) : kind == 2 ? rnd_int(1, 9)
                                                                            : rnd_int(1, 420);
        R += counts[e];
    }
    P.cap = R + rnd_int(0, 1) * rnd_int(1, 200);
    if (P.cap == 0) P.cap = 1;
    build_rows_from_counts(&P, counts);
    free(counts);

    char tag[256];
    snprintf(tag, sizeof(tag),
             "case %d: T=%lld d=%lld n=%lld E=%lld R=%lld cap=%lld act=%d layout=%d bias=%d h=%d",
             idx, (long long)P.T, (long long)P.d, (long long)P.n, (long long)P.E, (long long)P.R,
             (long long)P.cap, P.act, P.layout, P.bias, with_h);

    problem_dev D;
    dev_alloc(&D, &P); /* (draws from the generator: made for skipped cases too) */
    if (g_only_case >= 0 && idx != g_only_case) {
        dev_free(&D);
        free(P.offset); free(P.row_token); free(P.row_expert);
        return -1;
    }
    smoe_gemm_problem g = make_problem(&P, &D, sms);
    if (!forced_row_fits(&g)) { /* a shape the forced row cannot run */
        dev_free(&D);
        free(P.offset); free(P.row_token); free(P.row_expert);
        return -1;
    }
    int64_t hc = g.h_cols;
    int ok = 1;
    bf16 *h2, *a2, *y2, *x2;
    CUDA_OK(cudaMalloc(&x2, P.cap * P.d * 2 + 16));
    CUDA_OK(cudaMalloc(&h2, P.cap * hc * 2 + 16));
    CUDA_OK(cudaMalloc(&a2, P.cap * P.n * 2 + 16));
    CUDA_OK(cudaMalloc(&y2, P.cap * P.d * 2 + 16));
    for (int rep = 0; rep < 2; rep++) {
        bf16 *h = rep ? h2 : D.h, *a = rep ? a2 : D.a, *y = rep ? y2 : D.y, *xt = rep ? x2 : D.dxt;
        CUDA_OK(cudaMemset(xt, 0xFF, P.cap * P.d * 2));
        CUDA_OK(cudaMemset(h, 0xFF, P.cap * hc * 2));
        CUDA_OK(cudaMemset(a, 0xFF, P.cap * P.n * 2));
        CUDA_OK(cudaMemset(y, 0xFF, P.cap * P.d * 2));
        smoe_status st = smoe_gemm_ops_sm90.up(&g, D.x, D.w1, P.bias ? D.b1 : NULL,
                                               with_h ? h : NULL, a, NULL, 0);
        if (st != SMOE_SUCCESS) { printf("  FAIL %s: up returned %d\n", tag, (int)st); ok = 0; }
        trace_op(tag, rep, "up");
        st = smoe_gemm_ops_sm90.down(&g, D.a_in, D.w2, P.bias ? D.b2 : NULL, y, NULL, 0);
        if (st != SMOE_SUCCESS) { printf("  FAIL %s: down returned %d\n", tag, (int)st); ok = 0; }
        trace_op(tag, rep, "down");
        st = smoe_gemm_ops_sm90.dxt(&g, D.dh_in, D.w1, xt, NULL, 0);
        trace_op(tag, rep, "dxt");
        int concat = P.gated && P.layout == SMOE_W1_CONCATENATED;
        if (concat ? st != SMOE_ERROR_UNSUPPORTED : st != SMOE_SUCCESS) {
            printf("  FAIL %s: dxt returned %d\n", tag, (int)st);
            ok = 0;
        }
        D.dxt_ran = !concat;
        if (rep == 0) {
            CUDA_OK(cudaMemset(D.dh_out, 0xFF, P.cap * hc * 2));
            CUDA_OK(cudaMemset(D.as_out, 0xFF, P.cap * P.n * 2));
            CUDA_OK(cudaMemset(D.ds_out, 0xFF, P.cap * 4));
            if (smoe_gemm_ops_sm90.scratch_bytes(&g) >
                (size_t)(P.cap * 4 * ((P.n + 127) / 128) + 32)) {
                printf("  FAIL %s: scratch_bytes too large for the test buffer\n", tag);
                ok = 0;
            }
            st = smoe_gemm_ops_sm90.dh(&g, D.dout, D.w2, P.bias ? D.b2 : NULL, D.dh_in, D.dh_out,
                                       D.as_out, D.ds_out, D.scratch, 0);
            if (st != SMOE_SUCCESS) { printf("  FAIL %s: dh returned %d\n", tag, (int)st); ok = 0; }
            D.dh_ran = st == SMOE_SUCCESS;
            trace_op(tag, rep, "dh");
        }
        CUDA_OK(cudaDeviceSynchronize());
    }
    if (ok) {
        int32_t *rows = (int32_t *)malloc((P.R + 1) * 4);
        for (int64_t r = 0; r < P.R; r++) rows[r] = (int32_t)r;
        ok &= verify(&P, &D, rows, (int)P.R, with_h, tag);
        free(rows);
        ok &= check_untouched(with_h ? D.h : NULL, P.R, P.cap, hc, "H", tag);
        ok &= check_untouched(D.a, P.R, P.cap, P.n, "A", tag);
        ok &= check_untouched(D.y, P.R, P.cap, P.d, "Y", tag);
        ok &= check_untouched(D.dxt, D.dxt_ran ? P.R : 0, P.cap, P.d, "dXt", tag);
        ok &= check_untouched(D.dh_out, P.R, P.cap, hc, "dH", tag);
        ok &= check_untouched(D.as_out, P.R, P.cap, P.n, "A'", tag);
        int det = bitwise_equal(D.a, a2, P.R * P.n) && bitwise_equal(D.y, y2, P.R * P.d) &&
                  bitwise_equal(D.dxt, x2, P.R * P.d) &&
                  (!with_h || bitwise_equal(D.h, h2, P.R * hc));
        if (!det) printf("  FAIL %s: two runs differ\n", tag);
        ok &= det;
        if (!with_h) {
            /* inference: H must not be touched at all */
            ok &= check_untouched(D.h, 0, P.cap, hc, "H (inference)", tag);
        }
    }
    printf("%s %s\n", ok ? "ok  " : "FAIL", tag);
    cudaFree(h2); cudaFree(a2); cudaFree(y2); cudaFree(x2);
    dev_free(&D);
    free(P.offset); free(P.row_token); free(P.row_expert);
    return ok;
}

/* ------------------------------------------------------------ grid shapes */

typedef struct shape {
    const char *name;
    int64_t T, d, n, E, K;
} shape;

/* --grid: a shape of the benchmark grid (bench/bench_gemm.cu's), balanced
 * routing, SwiGLU, interleaved W1, no bias; up, down, dxt and dh once on
 * the plan's rows (--row's where it fits), about 1000 rows checked. 1
 * passed, 0 failed, -1 skipped (the forced row cannot run the shape). */
static int grid_case(const shape *S, int sms)
{
    problem_host P;
    memset(&P, 0, sizeof(P));
    P.T = S->T; P.d = S->d; P.n = S->n; P.E = S->E;
    P.act = SMOE_ACT_SWIGLU; P.gated = 1; P.layout = SMOE_W1_INTERLEAVED; P.bias = 0;
    P.cap = S->T * S->K;
    /* balanced routing: assignment i = t K + k of a randomly permuted token goes to
     * expert i % E (K distinct experts per token when E % K == 0) */
    int32_t *perm = (int32_t *)malloc(S->T * 4);
    for (int64_t t = 0; t < S->T; t++) perm[t] = (int32_t)t;
    for (int64_t t = S->T - 1; t > 0; t--) {
        int64_t j = rnd() % (t + 1);
        int32_t tmp = perm[t]; perm[t] = perm[j]; perm[j] = tmp;
    }
    int *counts = (int *)calloc(S->E, sizeof(int));
    for (int64_t i = 0; i < S->T * S->K; i++) counts[i % S->E]++;
    P.offset = (int32_t *)malloc((P.E + 1) * 4);
    P.offset[0] = 0;
    for (int e = 0; e < P.E; e++) P.offset[e + 1] = P.offset[e] + counts[e];
    P.R = P.offset[P.E];
    P.row_token = (int32_t *)malloc(P.cap * 4);
    P.row_expert = (int32_t *)malloc(P.cap * 4);
    int *fill = (int *)calloc(S->E, sizeof(int));
    /* tokens ascending within each expert: walk tokens in order */
    int32_t *inv = (int32_t *)malloc(S->T * 4);
    for (int64_t t = 0; t < S->T; t++) inv[perm[t]] = (int32_t)t;
    for (int64_t tok = 0; tok < S->T; tok++) {
        int64_t t = inv[tok];
        for (int64_t k = 0; k < S->K; k++) {
            int e = (int)((t * S->K + k) % S->E);
            int64_t r = P.offset[e] + fill[e]++;
            P.row_token[r] = (int32_t)tok;
            P.row_expert[r] = e;
        }
    }
    free(perm); free(inv); free(fill); free(counts);

    problem_dev D;
    dev_alloc(&D, &P);
    smoe_gemm_problem g = make_problem(&P, &D, sms);
    if (!forced_row_fits(&g)) {
        dev_free(&D);
        free(P.offset); free(P.row_token); free(P.row_expert);
        return -1;
    }
    int64_t hc = g.h_cols;
    int ok = 1;
    CUDA_OK(cudaMemset(D.h, 0xFF, P.cap * hc * 2));
    CUDA_OK(cudaMemset(D.a, 0xFF, P.cap * P.n * 2));
    CUDA_OK(cudaMemset(D.y, 0xFF, P.cap * P.d * 2));
    CUDA_OK(cudaMemset(D.dxt, 0xFF, P.cap * P.d * 2));
    CUDA_OK(cudaMemset(D.dh_out, 0xFF, P.cap * hc * 2));
    CUDA_OK(cudaMemset(D.as_out, 0xFF, P.cap * P.n * 2));
    CUDA_OK(cudaMemset(D.ds_out, 0xFF, P.cap * 4));
    if (smoe_gemm_ops_sm90.scratch_bytes(&g) > (size_t)(P.cap * 4 * ((P.n + 127) / 128) + 32)) {
        printf("  FAIL grid %s: scratch_bytes too large for the test buffer\n", S->name);
        dev_free(&D);
        free(P.offset); free(P.row_token); free(P.row_expert);
        return 0;
    }
    const char *op[4] = {"up", "down", "dxt", "dh"};
    smoe_status st[4];
    st[0] = smoe_gemm_ops_sm90.up(&g, D.x, D.w1, NULL, D.h, D.a, NULL, 0);
    st[1] = smoe_gemm_ops_sm90.down(&g, D.a_in, D.w2, NULL, D.y, NULL, 0);
    st[2] = smoe_gemm_ops_sm90.dxt(&g, D.dh_in, D.w1, D.dxt, NULL, 0);
    st[3] = smoe_gemm_ops_sm90.dh(&g, D.dout, D.w2, NULL, D.dh_in, D.dh_out, D.as_out, D.ds_out,
                                  D.scratch, 0);
    char tag[128];
    snprintf(tag, sizeof(tag), "grid %s: T=%lld d=%lld n=%lld E=%lld K=%lld", S->name,
             (long long)S->T, (long long)S->d, (long long)S->n, (long long)S->E, (long long)S->K);
    for (int i = 0; i < 4; i++)
        if (st[i] != SMOE_SUCCESS) {
            printf("  FAIL %s: %s returned %d\n", tag, op[i], (int)st[i]);
            ok = 0;
        }
    CUDA_OK(cudaDeviceSynchronize());
    D.dxt_ran = 1;
    D.dh_ran = 1;
    if (ok) {
        int nr = 0;
        int32_t *rows = (int32_t *)malloc(1200 * 4);
        for (int64_t r = 0; r < P.R && nr < 1200; r += 1 + P.R / 1000) rows[nr++] = (int32_t)r;
        rows[nr++] = (int32_t)(P.R - 1);
        ok &= verify(&P, &D, rows, nr, 1, tag);
        free(rows);
    }
    printf("%s %s\n", ok ? "ok  " : "FAIL", tag);
    dev_free(&D);
    free(P.offset); free(P.row_token); free(P.row_expert);
    return ok;
}

int main(int argc, char **argv)
{
    int grid = 0, small = 0, cases = 40;
    uint64_t seed = 0x5EED5EEDull;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--grid")) grid = 1;
        else if (!strcmp(argv[i], "--small")) small = 1;
        else if (!strcmp(argv[i], "--trace")) g_trace = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--cases") && i + 1 < argc) cases = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--row") && i + 1 < argc) {
            const char *spec = argv[++i], *eq = strchr(spec, '=');
            g_force_gemm = eq ? smoe_gemm_find(spec, (size_t)(eq - spec)) : -1;
            g_force_row = g_force_gemm >= 0
                              ? smoe_gemm_row_find(&smoe_gemm_ops_sm90, g_force_gemm, eq + 1)
                              : -1;
            if (g_force_row < 0) {
                printf("--row %s: no such GEMM or row\n", spec);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--only-case") && i + 1 < argc) g_only_case = atoi(argv[++i]);
    }
    g_rng = tu_rng_make(seed);
    tu_seed = seed;
    if (!tu_gpu_cc("test_gemm_sm90")) return 0;
    int dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    printf("device %s (sm_%d%d, %d SMs), seed 0x%llx\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, (unsigned long long)seed);
    if (prop.major != 9) {
        printf("SKIP: needs an sm_90 device\n");
        return 0;
    }
    int sms = prop.multiProcessorCount, failed = 0, total = 0;
    if (small) cases = 2;
    if (!grid) {
        for (int i = 0; i < cases; i++) {
            /* a forced row: every other case on a grid of 2-8 SMs too (more
             * tiles than CTAs, e.g. for the claimed tiles under racecheck) */
            const int r = run_case(i, g_force_gemm >= 0 && i % 2 ? 2 + i % 7 : sms);
            total += r >= 0;
            failed += r == 0;
        }
        if (g_force_gemm < 0) {
            /* every row of every varlen-M table, on further random cases
             * until 6 of them fit the row (dh's TMA-store rows need a gated
             * activation and n >= 256, the wide rows of down and dxt d >=
             * 256: more draws there) */
            static const int gemms[4] = {SMOE_GEMM_UP, SMOE_GEMM_DOWN, SMOE_GEMM_DXT,
                                         SMOE_GEMM_DH};
            int next = cases;
            for (int gi = 0; gi < 4; gi++) {
                for (int row = 0;; row++) {
                    const char *rn = smoe_gemm_ops_sm90.row_name(gemms[gi], row);
                    if (!rn) break;
                    g_force_gemm = gemms[gi];
                    g_force_row = row;
                    int ran = 0, tries = 0;
                    const int want = small ? 1 : 6;
                    /* --only-case N: draw no further than case N (each draw
                     * allocates, which is slow under compute-sanitizer) */
                    for (; ran < want && tries < 80 && (g_only_case < 0 || next <= g_only_case);
                         tries++) {
                        /* every other case on a grid of 2-8 SMs, so that each
                         * CTA runs several tiles */
                        const int r = run_case(next, next % 2 ? sms : 2 + next % 7);
                        next++;
                        ran += r >= 0;
                        total += r >= 0;
                        failed += r == 0;
                    }
                    printf("row %s \"%s\": %d cases\n", smoe_gemm_name(gemms[gi]), rn, ran);
                    if (ran == 0 && !small && g_only_case < 0) {
                        printf("  FAIL: no random case fits row %s \"%s\"\n",
                               smoe_gemm_name(gemms[gi]), rn);
                        failed++;
                    }
                }
            }
            g_force_gemm = g_force_row = -1;
        }
    } else {
        static const shape shapes[] = {
            {"7B", 24576, 1536, 256, 128, 8},
            {"30B", 32768, 4096, 512, 128, 8},
            {"120B", 32768, 4096, 1024, 128, 8},
            {"120B-n2048", 32768, 4096, 2048, 64, 4},
        };
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
            const int r = grid_case(&shapes[i], sms);
            total += r >= 0;
            failed += r == 0;
        }
    }
    printf("%d/%d passed\n", total - failed, total);
    return failed ? 1 : 0;
}
