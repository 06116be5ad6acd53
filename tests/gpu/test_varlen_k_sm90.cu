/*
 * test_varlen_k_sm90.cu -- the Hopper weight-gradient GEMMs (smoe_sm90_dw2,
 * smoe_sm90_dw1 in src/cuda/sm90/varlen_k_sm90.cu) against independent
 * references.
 *
 * References: a naive tiled CUDA kernel accumulating in double (rows of each
 * expert walked in order, gathers done by plain indexing), itself checked
 * against a host double-precision loop on the small cases. Comparison on the
 * device, per element: |out - expected| <= tol(abs_sum, |expected|), where
 * abs_sum = sum |a||b| bounds the fp32 accumulation error, plus the relative
 * Frobenius error; overwrite runs start from NaN so an unwritten element
 * fails; accumulate runs start from random values; experts with no rows must
 * read exactly 0 (overwrite) or their old bits (accumulate). Rows past R are
 * NaN and their row_token entries out of range, so reading them shows.
 * Cases: random counts with empty experts, 1-row experts and counts around
 * the 64-row k-tile; partial M and N tiles; both output dtypes; accumulate
 * on and off; dW1 for interleaved, concatenated and non-gated W1; the
 * rejected shapes; determinism (two runs, bitwise); then the 7B (T=24576,
 * d=1536, n=256, E=128, K=8) and 120B (T=32768, d=4096, n=1024, E=128,
 * K=8) shapes with balanced routing (fp32 overwrite, bf16 accumulate), and
 * gpt-oss-120b's (128 x 192 tiles). The cases with d >= 2048 take the bf16
 * overwrite through the staged tile stored by TMA.
 *
 * Usage: test_varlen_k_sm90 [--small | --staged | --tiny] [seed]
 * (--small: the small and medium shapes only, for compute-sanitizer;
 * --staged: the staged-tile cases only, for racecheck; --tiny: the three
 * smallest cases and the first staged one (256-row tiles) only, for
 * racecheck, which did not finish --small or --staged in 200-240 s on an
 * H200). Every
 * check runs each row of the weight gradients' tile table (one row today;
 * failed checks are counted per row at the end). The fp32 and accumulating
 * outputs run dw1 as dH^T X, bf16 overwrite as X^T dH stored transposed:
 * both orientations are checked. Exit code 0 only if every check passed.
 * The timings of these GEMMs (and cuBLAS's batched GEMM of the same
 * per-expert shapes) are bench/bench_gemm.cu's.
 *
 * Build (sm_90a; links the kernel source directly):
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -Itests
 *        -Itests/gpu -DSMOE_WITH_CUDA tests/gpu/test_varlen_k_sm90.cu
 *        src/cuda/sm90/varlen_k_sm90.cu -o build/tests/gpu/test_varlen_k_sm90
 */
#include <algorithm>
#include <vector>

#include "cuda/gemm.h"
#include "testutil_cuda.h"

extern "C" smoe_status smoe_sm90_dw2(const smoe_gemm_problem *p, const bf16 *dout,
                                     const bf16 *a_scaled, void *dw2, smoe_dtype out_dtype,
                                     int accumulate, void *scratch, cudaStream_t s);
extern "C" smoe_status smoe_sm90_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                                     void *dw1, smoe_dtype out_dtype, int accumulate,
                                     void *scratch, cudaStream_t s);

/* The row of the weight gradients' tile table under test (the problems'
 * plan names it). */
static int g_vk_row = 0;
static uint64_t g_seed = 12345;

/* The kernels' only library dependency; the test links the .cu alone. */
static char g_last_error[512];
extern "C" smoe_status smoe_fail(smoe_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return status;
}

/* Rows under test (all four of the table: the tiles in row order and
 * grouped, each alone and in 2-CTA pairs along M; pairs on 6 or 8 SMs are
 * 3 or 4 clusters, and d = 576 and 2112 give odd m-tile counts, so a
 * pair's second CTA runs past M);
 * every correctness check runs for each, and failures are counted per row
 * (printed at the end). */
static std::vector<int> g_variants{0, 1, 2, 3};
static int g_cur_vi = 0;                 /* index into g_variants of the running one */
static std::vector<int> g_var_fail(1, 0);

static void set_variant(int vi)
{
    g_cur_vi = vi;
    g_vk_row = g_variants[vi];
}

/* One check, counted by testutil.h (tu_npass, tu_nfail) and per row; a
 * passing one is printed too. */
static void check(int ok, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (tu_check(ok, __FILE__, __LINE__, "%s", msg)) printf("  ok   %s\n", msg);
    else g_var_fail[g_cur_vi]++;
}

/* ------------------------------------------------------------ naive reference */

/* ref[e][c][j] = sum over rows r of e of A[ra(r)][c] * B[rb(r)][j] in double,
 * with ra = token (gather_a) or r, rb the other; also sum |a||b|. Logical
 * rows; 64x64 outputs per block, 4x4 per thread. */
__global__ void ref_kernel(const bf16 *A, const bf16 *B, int gather_a, const int32_t *off,
                           const int32_t *tok, int M, int N, float *ref, float *absr)
{
    __shared__ float As[16][64], Bs[16][64];
    const int e = blockIdx.z, m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int begin = off[e], end = off[e + 1];
    double acc[4][4], ab[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = ab[i][j] = 0.0;
    for (int r0 = begin; r0 < end; r0 += 16) {
        for (int q = threadIdx.x; q < 16 * 64; q += 256) {
            int kr = q / 64, c = q % 64, r = r0 + kr;
            float va = 0.f, vb = 0.f;
            if (r < end) {
                int t = tok[r];
                int ra = gather_a ? t : r, rb = gather_a ? r : t;
                if (m0 + c < M) va = __bfloat162float(A[(size_t)ra * M + m0 + c]);
                if (n0 + c < N) vb = __bfloat162float(B[(size_t)rb * N + n0 + c]);
            }
            As[kr][c] = va;
            Bs[kr][c] = vb;
        }
        __syncthreads();
        for (int kr = 0; kr < 16; kr++) {
            double a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = As[kr][ty + 16 * i];
            for (int j = 0; j < 4; j++) b[j] = Bs[kr][tx + 16 * j];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    acc[i][j] += a[i] * b[j];
                    ab[i][j] += fabs(a[i] * b[j]);
                }
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (m < M && n < N) {
                ref[((size_t)e * M + m) * N + n] = (float)acc[i][j];
                absr[((size_t)e * M + m) * N + n] = (float)ab[i][j];
            }
        }
}

/* Device-side comparison; accumulates counts and squared sums. */
struct cmp_result {
    unsigned long long bad, checked, nonfinite;
    double diff2, ref2, worst; /* worst = max |diff| / tol */
};

__device__ static double atomic_max_double(double *addr, double v)
{
    unsigned long long *a = (unsigned long long *)addr;
    unsigned long long old = *a, assumed;
    do {
        assumed = old;
        if (__longlong_as_double(assumed) >= v) break;
        old = atomicCAS(a, assumed, __double_as_longlong(v));
    } while (old != assumed);
    return __longlong_as_double(old);
}

__global__ void compare_kernel(const void *out, const void *old, const float *ref,
                               const float *absr, const int32_t *off, int E, int M, int N,
                               int out_f32, int accumulate, int map_rows, int n_half,
                               cmp_result *res)
{
    size_t total = (size_t)E * M * N;
    unsigned long long bad = 0, nonfinite = 0, checked = 0;
    double diff2 = 0, ref2 = 0, worst = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int e = (int)(i / ((size_t)M * N));
        int c = (int)((i / N) % M);
        int j = (int)(i % N);
        int prow = map_rows ? ((c & 1) ? n_half + (c >> 1) : (c >> 1)) : c;
        size_t pi = ((size_t)e * M + prow) * N + j;
        int empty = off[e + 1] <= off[e];
        double o, od = 0;
        uint32_t obits, oldbits = 0;
        if (out_f32) {
            float v = ((const float *)out)[pi];
            o = v;
            obits = __float_as_uint(v);
            if (accumulate) {
                float w = ((const float *)old)[pi];
                od = w;
                oldbits = __float_as_uint(w);
            }
        } else {
            bf16 v = ((const bf16 *)out)[pi];
            o = __bfloat162float(v);
            obits = *(const uint16_t *)&v;
            if (accumulate) {
                bf16 w = ((const bf16 *)old)[pi];
                od = __bfloat162float(w);
                oldbits = *(const uint16_t *)&w;
            }
        }
        checked++;
        if (empty) {
            /* exactly zero (overwrite) or untouched bits (accumulate) */
            if (accumulate ? obits != oldbits : o != 0.0) bad++;
            continue;
        }
        double expct = od + (double)ref[i];
        double tol = out_f32 ? 2e-5 * absr[i] + 1e-6 * fabs(expct) + 1e-6
                             : 4.5e-3 * fabs(expct) + 2e-5 * absr[i] + 1e-6;
        double diff = fabs(o - expct);
        if (!isfinite(o)) nonfinite++;
        if (!(diff <= tol)) bad++;
        if (isfinite(o)) {
            diff2 += diff * diff;
            if (diff / tol > worst) worst = diff / tol;
        }
        ref2 += expct * expct;
    }
    atomicAdd(&res->bad, bad);
    atomicAdd(&res->checked, checked);
    atomicAdd(&res->nonfinite, nonfinite);
    atomicAdd(&res->diff2, diff2);
    atomicAdd(&res->ref2, ref2);
    atomic_max_double(&res->worst, worst);
}

/* ------------------------------------------------------------ problem set-up */

struct problem {
    int64_t T, d, n, E, K, R, cap;
    int gated;
    smoe_w1_layout layout;
    std::vector<int32_t> off, tok; /* host */
    int32_t *d_off, *d_tok;
    bf16 *dout, *a_scaled, *x, *dh; /* device */
    int64_t h_cols;
};

static void problem_alloc(problem *P, uint64_t seed)
{
    P->h_cols = P->gated ? 2 * P->n : P->n;
    P->R = P->off[P->E];
    P->cap = P->R + 37;
    P->tok.resize(P->cap);
    for (int64_t r = P->R; r < P->cap; r++) P->tok[r] = 0x7fffffff; /* never read */
    CUDA_OK(cudaMalloc(&P->d_off, (P->E + 1) * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&P->d_tok, P->cap * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(P->d_off, P->off.data(), (P->E + 1) * sizeof(int32_t),
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(P->d_tok, P->tok.data(), P->cap * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&P->dout, P->T * P->d * sizeof(bf16)));
    CUDA_OK(cudaMalloc(&P->x, P->T * P->d * sizeof(bf16)));
    CUDA_OK(cudaMalloc(&P->a_scaled, P->cap * P->n * sizeof(bf16)));
    CUDA_OK(cudaMalloc(&P->dh, P->cap * P->h_cols * sizeof(bf16)));
    tu_dev_fill_bf16(P->dout, P->T * P->d, seed + 1, -1, 1);
    tu_dev_fill_bf16(P->x, P->T * P->d, seed + 2, -1, 1);
    tu_dev_fill_bf16(P->a_scaled, P->R * P->n, seed + 3, -1, 1);
    tu_dev_fill_bf16(P->dh, P->R * P->h_cols, seed + 4, -1, 1);
    /* rows past R: NaN, so a kernel reading them shows */
    tu_dev_poison(P->a_scaled + P->R * P->n, (P->cap - P->R) * P->n * sizeof(bf16));
    tu_dev_poison(P->dh + P->R * P->h_cols, (P->cap - P->R) * P->h_cols * sizeof(bf16));
    CUDA_OK(cudaDeviceSynchronize());
}

static void problem_free(problem *P)
{
    cudaFree(P->d_off);
    cudaFree(P->d_tok);
    cudaFree(P->dout);
    cudaFree(P->x);
    cudaFree(P->a_scaled);
    cudaFree(P->dh);
}

/* Random counts (some experts empty, some of 1 row, some around 64), each
 * expert's tokens random and sorted. */
static void routing_random(problem *P, tu_rng *s, int max_count)
{
    P->off.assign(P->E + 1, 0);
    P->tok.clear();
    for (int64_t e = 0; e < P->E; e++) {
        int c;
        uint64_t k = tu_next(s) % 8;
        if (k == 0) c = 0;
        else if (k == 1) c = 1;
        else if (k == 2) c = 63 + (int)(tu_next(s) % 3); /* 63, 64, 65 */
        else c = (int)(tu_next(s) % (uint64_t)(max_count + 1));
        if (e == 0) c = 0;              /* the first expert empty */
        if (e == P->E - 1) c = max_count; /* and the last one full */
        std::vector<int32_t> t(c);
        for (int i = 0; i < c; i++) t[i] = (int32_t)(tu_next(s) % (uint64_t)P->T);
        std::sort(t.begin(), t.end());
        P->tok.insert(P->tok.end(), t.begin(), t.end());
        P->off[e + 1] = P->off[e] + c;
    }
}

/* Balanced top-K routing: token pi(t) picks experts (t + k E/K) mod E. */
static void routing_balanced(problem *P, tu_rng *s)
{
    std::vector<int32_t> perm(P->T);
    for (int64_t t = 0; t < P->T; t++) perm[t] = (int32_t)t;
    for (int64_t t = P->T - 1; t > 0; t--) std::swap(perm[t], perm[tu_next(s) % (uint64_t)(t + 1)]);
    std::vector<std::vector<int32_t>> lists(P->E);
    for (int64_t t = 0; t < P->T; t++)
        for (int64_t k = 0; k < P->K; k++) lists[(t + k * (P->E / P->K)) % P->E].push_back(perm[t]);
    P->off.assign(P->E + 1, 0);
    P->tok.clear();
    for (int64_t e = 0; e < P->E; e++) {
        std::sort(lists[e].begin(), lists[e].end());
        P->tok.insert(P->tok.end(), lists[e].begin(), lists[e].end());
        P->off[e + 1] = P->off[e] + (int32_t)lists[e].size();
    }
}

static smoe_gemm_problem gemm_problem(const problem *P, int num_sms)
{
    smoe_gemm_problem g;
    memset(&g, 0, sizeof g);
    g.d = P->d;
    g.n = P->n;
    g.h_cols = P->h_cols;
    g.E = P->E;
    g.cap = P->cap;
    g.gated = P->gated;
    g.act = P->gated ? SMOE_ACT_SWIGLU : SMOE_ACT_RELU;
    g.w1_layout = P->layout;
    g.expert_offset = P->d_off;
    g.row_token = P->d_tok;
    g.row_score = NULL;
    g.num_sms = num_sms;
    static smoe_gemm_plan plan;
    for (int i = 0; i < SMOE_GEMM_COUNT; i++) plan.row[i] = -1;
    plan.row[SMOE_GEMM_DW2] = plan.row[SMOE_GEMM_DW1] = g_vk_row;
    g.plan = &plan;
    return g;
}

enum { OP_DW2 = 0, OP_DW1 = 1 };

struct op_shape {
    int M, N, gather_a;
    const bf16 *A, *B;
};

static op_shape op_shape_of(const problem *P, int op)
{
    op_shape s;
    if (op == OP_DW2) {
        s.M = (int)P->d; s.N = (int)P->n; s.gather_a = 1; s.A = P->dout; s.B = P->a_scaled;
    } else {
        s.M = (int)P->h_cols; s.N = (int)P->d; s.gather_a = 0; s.A = P->dh; s.B = P->x;
    }
    return s;
}

static smoe_status call_op(const problem *P, int op, void *out, smoe_dtype dt, int acc,
                           int num_sms, cudaStream_t st)
{
    smoe_gemm_problem g = gemm_problem(P, num_sms);
    if (op == OP_DW2) return smoe_sm90_dw2(&g, P->dout, P->a_scaled, out, dt, acc, NULL, st);
    return smoe_sm90_dw1(&g, P->dh, P->x, out, dt, acc, NULL, st);
}

/* Host double reference of one op on small problems (logical rows). */
static void host_ref(const problem *P, int op, std::vector<double> *ref)
{
    op_shape s = op_shape_of(P, op);
    size_t arows = s.gather_a ? P->T : P->cap, brows = s.gather_a ? P->cap : P->T;
    std::vector<bf16> A(arows * s.M), B(brows * s.N);
    CUDA_OK(cudaMemcpy(A.data(), s.A, A.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(B.data(), s.B, B.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    ref->assign((size_t)P->E * s.M * s.N, 0.0);
    for (int64_t e = 0; e < P->E; e++)
        for (int32_t r = P->off[e]; r < P->off[e + 1]; r++) {
            size_t ra = s.gather_a ? P->tok[r] : r, rb = s.gather_a ? r : P->tok[r];
            for (int c = 0; c < s.M; c++) {
                double a = __bfloat162float(A[ra * s.M + c]);
                double *dst = ref->data() + ((size_t)e * s.M + c) * s.N;
                const bf16 *brow = B.data() + rb * s.N;
                for (int j = 0; j < s.N; j++) dst[j] += a * (double)__bfloat162float(brow[j]);
            }
        }
}

struct refbuf {
    float *ref, *absr;
    size_t elems;
};

static refbuf gpu_ref(const problem *P, int op)
{
    op_shape s = op_shape_of(P, op);
    refbuf rb;
    rb.elems = (size_t)P->E * s.M * s.N;
    CUDA_OK(cudaMalloc(&rb.ref, rb.elems * sizeof(float)));
    CUDA_OK(cudaMalloc(&rb.absr, rb.elems * sizeof(float)));
    dim3 grid((s.N + 63) / 64, (s.M + 63) / 64, (unsigned)P->E);
    ref_kernel<<<grid, 256>>>(s.A, s.B, s.gather_a, P->d_off, P->d_tok, s.M, s.N, rb.ref, rb.absr);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    return rb;
}

static void refbuf_free(refbuf *rb)
{
    cudaFree(rb->ref);
    cudaFree(rb->absr);
}

/* Runs one (op, dtype, accumulate) and compares; returns pass. */
static int run_and_compare(const char *tag, const problem *P, int op, const refbuf *rb,
                           smoe_dtype dt, int acc, int num_sms)
{
    op_shape s = op_shape_of(P, op);
    size_t elems = (size_t)P->E * s.M * s.N;
    size_t esz = dt == SMOE_DTYPE_F32 ? 4 : 2;
    void *out, *old = NULL;
    CUDA_OK(cudaMalloc(&out, elems * esz));
    if (acc) {
        CUDA_OK(cudaMalloc(&old, elems * esz));
        if (dt == SMOE_DTYPE_F32) tu_dev_fill_f32((float *)old, elems, g_seed + 77, -4, 4);
        else tu_dev_fill_bf16(old, elems, g_seed + 78, -1, 1);
        CUDA_OK(cudaMemcpy(out, old, elems * esz, cudaMemcpyDeviceToDevice));
    } else {
        tu_dev_poison(out, elems * esz);
    }
    CUDA_OK(cudaDeviceSynchronize());
    g_last_error[0] = 0;
    smoe_status st = call_op(P, op, out, dt, acc, num_sms, 0);
    cudaError_t ce = cudaDeviceSynchronize();
    int ok = st == SMOE_SUCCESS && ce == cudaSuccess;
    if (!ok) {
        check(0, "%s v%d %s out=%s acc=%d: status %d (%s), cuda %s", tag, g_vk_row,
              op ? "dw1" : "dw2", dt == SMOE_DTYPE_F32 ? "f32" : "bf16", acc, (int)st,
              g_last_error, cudaGetErrorString(ce));
        exit(1); /* a device fault leaves the context unusable */
    }
    cmp_result *d_res, h_res;
    CUDA_OK(cudaMalloc(&d_res, sizeof(cmp_result)));
    CUDA_OK(cudaMemset(d_res, 0, sizeof(cmp_result)));
    const int map_rows = op == OP_DW1 && P->gated && P->layout == SMOE_W1_CONCATENATED;
    compare_kernel<<<1024, 256>>>(out, old, rb->ref, rb->absr, P->d_off, (int)P->E, s.M, s.N,
                                  dt == SMOE_DTYPE_F32, acc, map_rows, (int)P->n, d_res);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(&h_res, d_res, sizeof h_res, cudaMemcpyDeviceToHost));
    double rel = h_res.ref2 > 0 ? sqrt(h_res.diff2 / h_res.ref2) : sqrt(h_res.diff2);
    double rel_lim = dt == SMOE_DTYPE_F32 ? 1e-5 : 4e-3;
    int pass = h_res.bad == 0 && h_res.nonfinite == 0 && h_res.checked == elems && rel <= rel_lim;
    check(pass, "%-28s v%-2d %s out=%-4s acc=%d  M=%d N=%d: rel_fro %.2e, worst/tol %.3f, "
          "bad %llu, nonfinite %llu", tag, g_vk_row, op ? "dw1" : "dw2",
          dt == SMOE_DTYPE_F32 ? "f32" : "bf16", acc, s.M, s.N, rel, h_res.worst, h_res.bad,
          h_res.nonfinite);
    cudaFree(d_res);
    cudaFree(out);
    if (old) cudaFree(old);
    return pass;
}

/* Checks the GPU naive reference against the host double loop. */
static void check_ref_against_host(const char *tag, const problem *P, int op, const refbuf *rb)
{
    std::vector<double> h;
    host_ref(P, op, &h);
    std::vector<float> g(rb->elems);
    CUDA_OK(cudaMemcpy(g.data(), rb->ref, g.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double d2 = 0, r2 = 0;
    for (size_t i = 0; i < g.size(); i++) {
        double df = g[i] - h[i];
        d2 += df * df;
        r2 += h[i] * h[i];
    }
    double rel = sqrt(d2 / (r2 > 0 ? r2 : 1));
    check(rel < 1e-6, "%-28s %s naive GPU reference vs host double: rel_fro %.2e", tag,
          op ? "dw1" : "dw2", rel);
}

static void correctness_case(const char *tag, problem *P, int num_sms, int host_check)
{
    problem_alloc(P, g_seed);
    for (int op = 0; op < 2; op++) {
        refbuf rb = gpu_ref(P, op);
        if (host_check) check_ref_against_host(tag, P, op, &rb);
        for (size_t vi = 0; vi < g_variants.size(); vi++) {
            set_variant((int)vi);
            for (int dti = 0; dti < 2; dti++)
                for (int acc = 0; acc < 2; acc++)
                    run_and_compare(tag, P, op, &rb, dti ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32, acc,
                                    num_sms);
        }
        set_variant(0);
        refbuf_free(&rb);
    }
    problem_free(P);
}

/* Every row twice, fp32 and bf16 overwrite: the two runs bitwise equal,
 * and equal to row 0's (each tile's sum runs in the same order whatever
 * the tile order or the pairs). */
static void determinism_case(problem *P, int num_sms)
{
    problem_alloc(P, g_seed + 5);
    for (int op = 0; op < 2; op++)
        for (int dti = 0; dti < 2; dti++) {
            const smoe_dtype dt = dti ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
            op_shape s = op_shape_of(P, op);
            const size_t bytes = (size_t)P->E * s.M * s.N * (dti ? 2 : 4);
            void *o1, *o2;
            CUDA_OK(cudaMalloc(&o1, bytes));
            CUDA_OK(cudaMalloc(&o2, bytes));
            std::vector<char> h0(bytes), h1(bytes), h2(bytes);
            for (size_t vi = 0; vi < g_variants.size(); vi++) {
                set_variant((int)vi);
                smoe_status a = call_op(P, op, o1, dt, 0, num_sms, 0);
                smoe_status b = call_op(P, op, o2, dt, 0, num_sms, 0);
                CUDA_OK(cudaDeviceSynchronize());
                CUDA_OK(cudaMemcpy(h1.data(), o1, bytes, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(h2.data(), o2, bytes, cudaMemcpyDeviceToHost));
                if (vi == 0) h0 = h1;
                check(a == SMOE_SUCCESS && b == SMOE_SUCCESS &&
                          memcmp(h1.data(), h2.data(), bytes) == 0 &&
                          memcmp(h1.data(), h0.data(), bytes) == 0,
                      "determinism v%d %s %s: two runs bitwise equal, and equal to row %d's",
                      g_vk_row, op ? "dw1" : "dw2", dti ? "bf16" : "f32", g_variants[0]);
            }
            cudaFree(o1);
            cudaFree(o2);
        }
    set_variant(0);
    problem_free(P);
}

static void rejection_cases(int num_sms)
{
    problem P;
    P.T = 64; P.d = 100; P.n = 64; P.E = 2; P.K = 1; P.gated = 1; P.layout = SMOE_W1_INTERLEAVED;
    tu_rng s = tu_rng_make(g_seed);
    routing_random(&P, &s, 40);
    problem_alloc(&P, g_seed);
    float *out;
    CUDA_OK(cudaMalloc(&out, 4 * 1024 * 1024));
    CUDA_OK(cudaMemset(out, 0x11, 4 * 1024 * 1024));
    smoe_status a = call_op(&P, OP_DW2, out, SMOE_DTYPE_F32, 0, num_sms, 0);
    check(a == SMOE_ERROR_UNSUPPORTED, "d=100 rejected: status %d, \"%s\"", (int)a, g_last_error);
    P.d = 128;
    a = call_op(&P, OP_DW1, out, SMOE_DTYPE_F64, 0, num_sms, 0);
    check(a == SMOE_ERROR_UNSUPPORTED, "F64 output rejected: status %d, \"%s\"", (int)a,
          g_last_error);
    a = call_op(&P, OP_DW1, (char *)out + 8, SMOE_DTYPE_F32, 0, num_sms, 0);
    check(a == SMOE_ERROR_UNSUPPORTED, "misaligned output rejected: status %d, \"%s\"", (int)a,
          g_last_error);
    P.d = 100;
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint32_t> h(1024 * 1024);
    CUDA_OK(cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost));
    int untouched = 1;
    for (size_t i = 0; i < h.size(); i++) untouched &= h[i] == 0x11111111u;
    check(untouched, "rejected calls wrote nothing");
    cudaFree(out);
    problem_free(&P);
}

/* ------------------------------------------------------------ grid shapes */

/* A grid shape with balanced routing (gated, interleaved W1), as the layer
 * runs it: fp32 overwrite and bf16 accumulate against the GPU reference. */
static void balanced_case(const char *name, int64_t T, int64_t d, int64_t n, int64_t E, int64_t K,
                          int num_sms)
{
    problem P;
    P.T = T; P.d = d; P.n = n; P.E = E; P.K = K; P.gated = 1; P.layout = SMOE_W1_INTERLEAVED;
    tu_rng s = tu_rng_make(g_seed + 1000);
    routing_balanced(&P, &s);
    problem_alloc(&P, g_seed + 1000);
    printf("%s: T=%lld d=%lld n=%lld E=%lld K=%lld, R=%lld rows (balanced, %lld per expert)\n",
           name, (long long)T, (long long)d, (long long)n, (long long)E, (long long)K,
           (long long)P.R, (long long)(P.R / E));
    char tag[64];
    snprintf(tag, sizeof tag, "%s balanced", name);
    for (int op = 0; op < 2; op++) {
        refbuf rb = gpu_ref(&P, op);
        for (size_t vi = 0; vi < g_variants.size(); vi++) {
            set_variant((int)vi);
            run_and_compare(tag, &P, op, &rb, SMOE_DTYPE_F32, 0, num_sms);
            run_and_compare(tag, &P, op, &rb, SMOE_DTYPE_BF16, 1, num_sms);
        }
        set_variant(0);
        refbuf_free(&rb);
    }
    problem_free(&P);
}

/* ------------------------------------------------------------ main */

int main(int argc, char **argv)
{
    int small = 0, staged = 0, tiny = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) small = 1;
        else if (!strcmp(argv[i], "--staged")) staged = small = 1;
        else if (!strcmp(argv[i], "--tiny")) tiny = small = 1;
        else g_seed = strtoull(argv[i], NULL, 10);
    }
    tu_seed = g_seed;
    if (!tu_gpu_cc("test_varlen_k_sm90")) return 0;
    int dev = 0;
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (cc %d.%d, %d SMs), seed %llu\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, (unsigned long long)g_seed);
    if (prop.major != 9) {
        printf("SKIP: needs an sm_90 device\n");
        return 0;
    }
    const int num_sms = prop.multiProcessorCount;
    g_var_fail.assign(g_variants.size(), 0);
    set_variant(0);
    tu_rng s = tu_rng_make(g_seed);

    if (!staged) {   /* small: partial M and N tiles (BN=128 path), host-checked reference */
        const smoe_w1_layout lay[3] = {SMOE_W1_INTERLEAVED, SMOE_W1_CONCATENATED,
                                       SMOE_W1_INTERLEAVED};
        const char *nm[3] = {"small gated interleaved", "small gated concatenated",
                             "small not gated"};
        for (int v = 0; v < 3; v++) {
            problem P;
            P.T = 300; P.d = 192; P.n = 320; P.E = 7; P.K = 2;
            P.gated = v < 2; P.layout = lay[v];
            routing_random(&P, &s, 200);
            correctness_case(nm[v], &P, num_sms, 1);
        }
    }
    if (!staged && !tiny) {   /* medium: BN=256 path, few SMs so CTAs loop over many tiles */
        problem P;
        P.T = 2048; P.d = 512; P.n = 256; P.E = 16; P.K = 4; P.gated = 1;
        P.layout = SMOE_W1_CONCATENATED;
        routing_random(&P, &s, 700);
        correctness_case("medium concatenated 8 SMs", &P, 8, 0);
        routing_random(&P, &s, 700);
        correctness_case("medium concatenated all SMs", &P, num_sms, 0);
        routing_random(&P, &s, 700);
        determinism_case(&P, num_sms);
    }
    if (!staged && !tiny) {   /* 128 x 192 tiles (N % 256 != 0 == N % 192, gpt-oss-120b's n = 2880
         * in small): dw2 N = n = 960, dw1 N = h_cols = 1920 (bf16, stored
         * transposed) or d = 576 (fp32); M = 576 leaves a half m-tile */
        problem P;
        P.T = 700; P.d = 576; P.n = 960; P.E = 6; P.K = 2; P.gated = 1;
        P.layout = SMOE_W1_CONCATENATED;
        routing_random(&P, &s, 500);
        correctness_case("192-wide d = 576, n = 960", &P, num_sms, 0);
        routing_random(&P, &s, 500);
        correctness_case("192-wide d = 576, n = 960, 8 SMs", &P, 8, 0);
    }
    if (!staged && !tiny) {   /* 256-wide tiles ending in a partial one, where 192's cover as
         * many columns (GLM-4.5-Air's n = 1408 in small): dw2 N = n = 704,
         * dw1 N = h_cols = 1408, both in 3 or 6 tiles of 256; on 6 SMs
         * and on all of them the grid is a multiple of those, so the
         * waves' tiles run rotated (varlen_k_sm90.cu's vk_slot_tile), on 8
         * in the plain order */
        problem P;
        P.T = 600; P.d = 576; P.n = 704; P.E = 5; P.K = 2; P.gated = 1;
        P.layout = SMOE_W1_INTERLEAVED;
        const int sms[3] = {6, 8, num_sms};
        for (int v = 0; v < 3; v++) {
            routing_random(&P, &s, 400);
            char nm[64];
            snprintf(nm, sizeof nm, "partial 256-wide d = 576, n = 704, %d SMs", sms[v]);
            correctness_case(nm, &P, sms[v], 0);
        }
    }
    {   /* d >= 2048: bf16 overwrite through the staged tile stored by TMA
         * (varlen_k_sm90.cu's VK_F_TMA_ST), both W1 layouts: M = 2112 ends in
         * a half m-tile; dw2 N = 320 in 192-wide tiles (the last one
         * partial), dw1 N = 640 in 256-wide ones; N = 256 / 512 in 256-wide
         * ones (3 stages), and n = 704 in 192-wide ones (where 192's and
         * 256's tiles cover the same 768 / 1536 columns, vk_bn takes 192
         * for 256-row tiles; on 6 SMs: rotated waves); 8 SMs, so that a
         * CTA's staging is reused. The staged 192-wide tiles run 256 rows
         * high (VK_F_M256): at M = 2112 the last m-tile holds one m64 block
         * of rows, the other three past M.
         * --tiny runs the first case alone, with fewer rows */
        const int dd[3] = {2112, 2048, 2048}, nn[3] = {320, 256, 704};
        for (int v = 0; v < (tiny ? 1 : 6); v++) {
            problem P;
            P.T = tiny ? 150 : 400; P.d = dd[v / 2]; P.n = nn[v / 2]; P.E = tiny ? 3 : 5;
            P.K = 2; P.gated = 1;
            P.layout = (v & 1) ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
            routing_random(&P, &s, tiny ? 100 : 300);
            char nm[64];
            snprintf(nm, sizeof nm, "staged d = %d n = %d %s", dd[v / 2], nn[v / 2],
                     (v & 1) ? "concatenated" : "interleaved");
            correctness_case(nm, &P, v < 2 ? 8 : v >= 4 ? 6 : num_sms, 0);
        }
        if (!tiny) {
            /* every row against row 0, bitwise: staged tiles, odd m-tiles (the
             * pairs' second CTA past M), rotated waves on 6 SMs */
            problem P;
            P.T = 400; P.d = 2112; P.n = 704; P.E = 5; P.K = 2; P.gated = 1;
            P.layout = SMOE_W1_CONCATENATED;
            routing_random(&P, &s, 300);
            determinism_case(&P, 6);
            /* and dw2's 256-row tiles (row 0) against the pairs' 128-row
             * ones (rows 2, 3), bitwise: the same k order per element */
            problem Q;
            Q.T = 400; Q.d = 2112; Q.n = 320; Q.E = 5; Q.K = 2; Q.gated = 1;
            Q.layout = SMOE_W1_INTERLEAVED;
            routing_random(&Q, &s, 300);
            determinism_case(&Q, 8);
        }
    }
    if (!staged && !tiny) {   /* 18 m-tiles: the grouped row's groups of 16 and a last one of 2 */
        problem P;
        P.T = 1024; P.d = 2304; P.n = 384; P.E = 4; P.K = 2; P.gated = 1;
        P.layout = SMOE_W1_INTERLEAVED;
        routing_random(&P, &s, 600);
        correctness_case("wide d = 2304", &P, num_sms, 0);
    }
    if (!staged && !tiny) rejection_cases(num_sms);

    if (!small) {
        balanced_case("7B", 24576, 1536, 256, 128, 8, num_sms);
        balanced_case("120B", 32768, 4096, 1024, 128, 8, num_sms);
        balanced_case("gpt-oss-120b", 16384, 2880, 2880, 128, 4, num_sms);
    }
    for (size_t vi = 0; vi < g_variants.size(); vi++)
        printf("row %d: %d failed\n", g_variants[vi], g_var_fail[vi]);
    return tu_summary("test_varlen_k_sm90");
}
