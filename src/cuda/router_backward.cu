/*
 * router_backward.cu -- the router's share of the backward (DESIGN.md
 * section 5.6-5.7) and the bias gradients:
 *   dlogits (T, E) from the per-row score gradients dS (the dH GEMM's dS):
 *     TOPK_SOFTMAX  dl_e = s_e (dS_e - sum_j s_j dS_j) on the K picked
 *                   logits (a softmax over those K), 0 elsewhere;
 *     SOFTMAX_TOPK  dp_e = dS_e on the picked experts (renormalised:
 *                   dp_e = (dS_e - sum_j s_j dS_j) / Z, Z = sum of the
 *                   picked p), then through the full softmax:
 *                   dl_e = p_e (dp_e - <p, dp>);
 *     token rounding  p = softmax over E, TC = token-choice top-K,
 *                   Z = sum_{TC} p. Kept TC pairs score p_i / Z, added
 *                   pairs p_e, so dp_i = [i kept] dS_i / Z - G / Z^2 for
 *                   i in TC (G = sum of dS_j p_j over kept TC pairs) and
 *                   dp_e = dS_e for added pairs; then the full softmax;
 *     SIGMOID_TOPK  s_e = sigmoid(l_e) of the token's K pairs (routing_math.h,
 *                   as the forward), Den = sum s + 1e-20, c the scaling:
 *                   dl_e = s_e (1 - s_e) c (dS_e - G) / Den renormalised
 *                   (G = sum_j dS_j s_j / Den), else s_e (1 - s_e) c dS_e;
 *                   0 off the picked experts.
 *   plus dlogits_extra. One thread per token, sums in a fixed order; p in
 *   double (as the forward).
 *   dlogits is written as a bf16 hi/lo pair (T, 2E) so the dense GEMMs
 *   dWr = dlogits^T X and dX += dlogits Wr run on cuBLAS bf16 tensor cores
 *   with ~16 significant bits of dlogits: [hi lo]^T X gives both halves of
 *   dWr (added here), [hi lo] [Wr; Wr] gives dX's share in one GEMM.
 *   Bias gradients: per-expert column sums in a fixed order (no atomics).
 */
#include "cuda/cuda_common.h"
#include "cuda/routing_device.cuh"

/* ------------------------------------------------------------ dlogits */

/* The caller's extra gradient of one token (ex: its row, fp32, or bf16
 * where xb), expert e. */
static __device__ __forceinline__ double extra_at(const void *__restrict__ ex, int xb, int e)
{
    return xb ? (double)__bfloat162float(((const bf16 *)ex)[e]) : (double)((const float *)ex)[e];
}

/* The token's row of the extra gradient (T, E), by its dtype; NULL: none. */
static __device__ __forceinline__ const void *extra_row(const void *extra, int xb, int t, int E)
{
    if (!extra) return NULL;
    return xb ? (const void *)((const bf16 *)extra + (int64_t)t * E)
              : (const void *)((const float *)extra + (int64_t)t * E);
}

/* dlogits[e] = v (+ the caller's extra gradient ex[e]) stored as the bf16
 * pair hi + lo (hi rounded, lo the rest), the dWr GEMM's two halves. */
static __device__ __forceinline__ void store_split(double v, const void *__restrict__ ex, int xb,
                                                   int e, bf16 *__restrict__ hi,
                                                   bf16 *__restrict__ lo)
{
    if (ex) v += extra_at(ex, xb, e);
    const float f = (float)v;
    const bf16 h = __float2bfloat16_rn(f);
    hi[e] = h;
    lo[e] = __float2bfloat16_rn(f - __bfloat162float(h));
}

/* The token's pair for expert e (assignments [a0, a1)): its dS and score. */
static __device__ __forceinline__ bool pair_lookup(int e, int a0, int a1,
                                                   const uint16_t *__restrict__ assign_expert,
                                                   const int32_t *__restrict__ assign_row,
                                                   const float *__restrict__ ds,
                                                   const float *__restrict__ row_score,
                                                   double *dS, double *sc)
{
    for (int a = a0; a < a1; ++a) {
        const int r = assign_row[a];
        if (assign_expert[a] == e && r >= 0) {
            *dS = (double)ds[r];
            if (sc) *sc = (double)row_score[r];
            return true;
        }
    }
    return false;
}

__global__ void k_router_dlogits(int T, int E, int K, int mode, int renormalize, int tr,
                                 double scale, const float *__restrict__ logits,
                                 const int32_t *__restrict__ token_offset,
                                 const uint16_t *__restrict__ assign_expert,
                                 const int32_t *__restrict__ assign_row,
                                 const float *__restrict__ row_score, const float *__restrict__ ds,
                                 const void *__restrict__ extra, int extra_bf16,
                                 bf16 *__restrict__ split, int32_t *__restrict__ tc_scratch,
                                 const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int a0 = token_offset[t], a1 = token_offset[t + 1];
    bf16 *hi = split + (int64_t)t * 2 * E;
    bf16 *lo = hi + E;
    const void *ex = extra_row(extra, extra_bf16, t, E);

#define PAIR_LOOKUP(e, found, dS, sc) \
    found = pair_lookup((e), a0, a1, assign_expert, assign_row, ds, row_score, &(dS), (sc))

    if (mode == SMOE_ROUTING_TOPK_SOFTMAX && !tr) {
        double g = 0.0;
        for (int a = a0; a < a1; ++a) {
            const int r = assign_row[a];
            if (r >= 0) g += (double)row_score[r] * (double)ds[r];
        }
        for (int e = 0; e < E; ++e) {
            bool found;
            double dS = 0.0, sc = 0.0;
            PAIR_LOOKUP(e, found, dS, &sc);
            double v = found ? sc * (dS - g) : 0.0;
            store_split(v, ex, extra_bf16, e, hi, lo);
        }
        return;
    }

    const float *l = logits + (int64_t)t * E;
    if (mode == SMOE_ROUTING_SIGMOID_TOPK) {
        double z = 0.0, g = 0.0;
        for (int a = a0; a < a1; ++a) z += smoe_sigmoid((double)l[assign_expert[a]]);
        const double den = z + 1e-20;
        if (renormalize)
            for (int a = a0; a < a1; ++a) {
                const int r = assign_row[a];
                if (r >= 0) g += (double)ds[r] * smoe_sigmoid((double)l[assign_expert[a]]) / den;
            }
        for (int e = 0; e < E; ++e) {
            bool found;
            double dS = 0.0;
            PAIR_LOOKUP(e, found, dS, NULL);
            double v = 0.0;
            if (found) {
                const double se = smoe_sigmoid((double)l[e]);
                const double dsig = renormalize ? scale * (dS - g) / den : scale * dS;
                v = dsig * se * (1.0 - se);
            }
            store_split(v, ex, extra_bf16, e, hi, lo);
        }
        return;
    }
    double m, sum;
    smoe_softmax_stats(l, E, &m, &sum);

    /* dp on the picked / kept experts; c = <p, dp> */
    double z = 1.0, gsum = 0.0;
    int32_t *tc = tc_scratch + (int64_t)t * K;
    if (tr) {
        smoe_topk_row(l, E, K, tc, 1);
        z = 0.0;
        for (int k = 0; k < K; ++k) z += smoe_prob(l[tc[k]], m, sum);
        for (int k = 0; k < K; ++k) {
            bool found;
            double dS = 0.0;
            PAIR_LOOKUP(tc[k], found, dS, NULL);
            if (found) gsum += dS * smoe_prob(l[tc[k]], m, sum);
        }
    } else if (renormalize) {
        z = 0.0;
        for (int a = a0; a < a1; ++a) z += smoe_prob(l[assign_expert[a]], m, sum);
        for (int a = a0; a < a1; ++a) {
            const int r = assign_row[a];
            if (r < 0) continue;
            gsum += (smoe_prob(l[assign_expert[a]], m, sum) / z) * (double)ds[r];
        }
    }

    /* pass 1: c = <p, dp>; pass 2: write. dp_e recomputed in both. */
    double c = 0.0;
    for (int pass = 0; pass < 2; ++pass) {
        for (int e = 0; e < E; ++e) {
            bool found;
            double dS = 0.0;
            PAIR_LOOKUP(e, found, dS, NULL);
            double dp = 0.0;
            if (tr) {
                bool in_tc = false;
                for (int k = 0; k < K; ++k) in_tc |= (tc[k] == e);
                if (in_tc) dp = (found ? dS / z : 0.0) - gsum / (z * z);
                else if (found) dp = dS;
            } else if (found) {
                dp = renormalize ? (dS - gsum) / z : dS;
            }
            const double p = smoe_prob(l[e], m, sum);
            if (pass == 0) {
                c += p * dp;
                continue;
            }
            double v = p * (dp - c);
            store_split(v, ex, extra_bf16, e, hi, lo);
        }
    }
#undef PAIR_LOOKUP
}

/* TOPK_SOFTMAX without rounding, one warp per token (its pairs <= 32):
 * lane k holds pair k; g = sum_j s_j dS_j by a fixed shuffle tree; the
 * dlogits row is built in shared memory (zeros, then the pairs' entries)
 * and written coalesced. */
#define DLW_WARPS 4

__global__ void __launch_bounds__(DLW_WARPS * 32)
k_router_dlogits_topk_warp(int T, int E, const int32_t *__restrict__ token_offset,
                           const uint16_t *__restrict__ assign_expert,
                           const int32_t *__restrict__ assign_row,
                           const float *__restrict__ row_score, const float *__restrict__ ds,
                           const void *__restrict__ extra, int extra_bf16,
                           bf16 *__restrict__ split, float *__restrict__ assign_dl,
                           const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    extern __shared__ double dlw_row[]; /* DLW_WARPS * E */
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int t = blockIdx.x * DLW_WARPS + wib;
    if (t >= T) return;
    double *row = dlw_row + (size_t)wib * E;
    const int a0 = token_offset[t], a1 = token_offset[t + 1];
    const int a = a0 + lane;
    int e = -1;
    double s = 0.0, dS = 0.0;
    if (a < a1) {
        const int r = assign_row[a];
        if (r >= 0) {
            e = assign_expert[a];
            s = (double)row_score[r];
            dS = (double)ds[r];
        }
    }
    double g = s * dS;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) g += __shfl_down_sync(0xffffffffu, g, o);
    g = __shfl_sync(0xffffffffu, g, 0);
    for (int j = lane; j < E; j += 32) row[j] = 0.0;
    __syncwarp();
    if (e >= 0) row[e] = s * (dS - g);
    if (assign_dl && a < a1) assign_dl[a] = e >= 0 ? (float)(s * (dS - g)) : 0.0f;
    __syncwarp();
    bf16 *hi = split + (int64_t)t * 2 * E;
    bf16 *lo = hi + E;
    const void *ex = extra_row(extra, extra_bf16, t, E);
    for (int j = lane; j < E; j += 32) {
        double v = row[j];
        store_split(v, ex, extra_bf16, j, hi, lo);
    }
}

/* ------------------------------------------------------------ small kernels */

__global__ void k_stack_twice(const bf16 *__restrict__ wr, int64_t n, bf16 *__restrict__ wr2,
                              const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const bf16 v = wr[i];
        wr2[i] = v;
        wr2[i + n] = v;
    }
}

__global__ void k_combine_halves(const float *__restrict__ dwr2, int64_t n, void *dwr, int f32,
                                 int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = dwr2[i] + dwr2[i + n];
        if (f32) {
            float *o = (float *)dwr;
            o[i] = accumulate ? o[i] + v : v;
        } else {
            bf16 *o = (bf16 *)dwr;
            if (accumulate) v += __bfloat162float(o[i]);
            o[i] = __float2bfloat16_rn(v);
        }
    }
}

__global__ void k_pair_score_grad(int64_t pairs, const int32_t *__restrict__ count,
                                  const int32_t *__restrict__ assign_row,
                                  const float *__restrict__ ds, float *dscore, int accumulate,
                                  const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs || i >= *count) return;
    const int r = assign_row[i];
    const float g = r >= 0 ? ds[r] : 0.0f;
    dscore[i] = accumulate ? dscore[i] + g : g;
}

/* grid (ceil(cols/64), E), block (32, 8): thread x owns 2 columns, y is a
 * row lane; lanes take rows y, y+8, ...; lane sums added in lane order. */
__global__ void __launch_bounds__(256)
k_expert_colsum(int64_t cols, const int32_t *__restrict__ expert_offset,
                const bf16 *__restrict__ src, const int32_t *__restrict__ gather,
                const float *__restrict__ scale, int64_t n, int gated, smoe_w1_layout layout,
                int map_w1, void *dst, int f32, int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    __shared__ float part[8][64];
    const int e = blockIdx.y;
    const int64_t c0 = (int64_t)blockIdx.x * 64 + 2 * threadIdx.x;
    const int r0 = expert_offset[e], r1 = expert_offset[e + 1];
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int r = r0 + threadIdx.y; r < r1; r += 8) {
        const int64_t srow = gather ? gather[r] : r;
        const float s = scale ? scale[r] : 1.0f;
        const bf16 *p = src + srow * cols + c0;
        if (c0 < cols) acc0 = fmaf(s, __bfloat162float(p[0]), acc0);
        if (c0 + 1 < cols) acc1 = fmaf(s, __bfloat162float(p[1]), acc1);
    }
    part[threadIdx.y][2 * threadIdx.x] = acc0;
    part[threadIdx.y][2 * threadIdx.x + 1] = acc1;
    __syncthreads();
    if (threadIdx.y == 0) {
        for (int j = 0; j < 2; ++j) {
            const int64_t c = c0 + j;
            if (c >= cols) break;
            float v = 0.0f;
            for (int y = 0; y < 8; ++y) v += part[y][2 * threadIdx.x + j];
            const int64_t pc = map_w1 ? smoe_w1_row(c, n, gated, layout) : c;
            const int64_t o = (int64_t)e * cols + pc;
            if (f32) {
                float *d = (float *)dst;
                d[o] = accumulate ? d[o] + v : v;
            } else {
                bf16 *d = (bf16 *)dst;
                if (accumulate) v += __bfloat162float(d[o]);
                d[o] = __float2bfloat16_rn(v);
            }
        }
    }
}

/* n fp32 values rounded to bf16 (the router_logits output in bf16). */
__global__ void k_logits_bf16(const float *__restrict__ src, bf16 *__restrict__ dst, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* ------------------------------------------------------------ launchers */

smoe_status smoe_cuda_logits_out(const float *lg, void *dst, smoe_dtype dt, int64_t n,
                                 cudaStream_t s)
{
    if (n <= 0) return SMOE_SUCCESS;
    if (dt == SMOE_DTYPE_F32) {
        SMOE_CUDA_CHECK(cudaMemcpyAsync(dst, lg, (size_t)n * 4, cudaMemcpyDeviceToDevice, s));
        return SMOE_SUCCESS;
    }
    SMOE_RETURN_ERROR_IF(dt != SMOE_DTYPE_BF16, SMOE_ERROR_INTERNAL,
                         "router logits out: dtype %d (F32 or BF16)", (int)dt);
    int64_t b = smoe_cdiv(n, 256);
    k_logits_bf16<<<(unsigned)(b < 65535 ? b : 65535), 256, 0, s>>>(lg, (bf16 *)dst, n);
    SMOE_CUDA_LAUNCH_CHECK("k_logits_bf16");
    return SMOE_SUCCESS;
}

int smoe_cuda_router_sparse(const smoe_layer_desc *desc, int rounding, const void *dlogits_extra)
{
    return desc->routing == SMOE_ROUTING_TOPK_SOFTMAX &&
           !(rounding && desc->rounding != SMOE_ROUND_OFF) && desc->K <= 32 && !dlogits_extra;
}

smoe_status smoe_cuda_router_dlogits(const smoe_layer_desc *desc, int64_t T, int rounding,
                                     const float *logits, const int32_t *token_offset,
                                     const uint16_t *assign_expert, const int32_t *assign_row,
                                     const float *row_score, const float *ds,
                                     const void *dlogits_extra, smoe_dtype extra_dt, bf16 *split,
                                     int32_t *tc_scratch, float *assign_dl, const int *abort,
                                     cudaStream_t stream)
{
    const int tr = rounding && desc->rounding != SMOE_ROUND_OFF;
    const int xb = extra_dt == SMOE_DTYPE_BF16;
    if (smoe_cuda_router_sparse(desc, rounding, dlogits_extra)) {
        const size_t smem = (size_t)DLW_WARPS * desc->E * 8;
        if (smem > 48 * 1024)
            SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_router_dlogits_topk_warp,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem));
        k_router_dlogits_topk_warp<<<(unsigned)smoe_cdiv(T, DLW_WARPS), DLW_WARPS * 32, smem,
                                     stream>>>((int)T, (int)desc->E, token_offset, assign_expert,
                                               assign_row, row_score, ds, dlogits_extra, xb,
                                               split, assign_dl, abort);
        SMOE_CUDA_LAUNCH_CHECK("k_router_dlogits_topk_warp");
        return SMOE_SUCCESS;
    }
    if (assign_dl)
        return smoe_fail(SMOE_ERROR_INTERNAL, "router dlogits: per-pair dlogits asked for a "
                                              "dense routing mode");
    const int threads = 64;
    k_router_dlogits<<<(unsigned)smoe_cdiv(T, threads), threads, 0, stream>>>(
        (int)T, (int)desc->E, (int)desc->K, (int)desc->routing, desc->renormalize, tr,
        desc->routed_scaling, logits,
        token_offset, assign_expert, assign_row, row_score, ds, dlogits_extra, xb, split,
        tc_scratch, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_router_dlogits");
    return SMOE_SUCCESS;
}

static unsigned grid_for(int64_t n, int threads)
{
    int64_t b = smoe_cdiv(n, threads);
    if (b < 1) b = 1;
    return (unsigned)(b > 65535 ? 65535 : b);
}

smoe_status smoe_cuda_stack_twice(const bf16 *wr, int64_t E, int64_t d, bf16 *wr2,
                                  const int *abort, cudaStream_t stream)
{
    k_stack_twice<<<grid_for(E * d, 256), 256, 0, stream>>>(wr, E * d, wr2, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_stack_twice");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_combine_halves(const float *dwr2, int64_t E, int64_t d, void *dwr,
                                     smoe_dtype dtype, int accumulate, const int *abort,
                                     cudaStream_t stream)
{
    k_combine_halves<<<grid_for(E * d, 256), 256, 0, stream>>>(
        dwr2, E * d, dwr, dtype == SMOE_DTYPE_F32, accumulate, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_combine_halves");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_pair_score_grad(int64_t pairs, const int32_t *count,
                                      const int32_t *assign_row, const float *ds, float *dscore,
                                      int accumulate, const int *abort, cudaStream_t stream)
{
    if (pairs <= 0) return SMOE_SUCCESS;
    k_pair_score_grad<<<(unsigned)smoe_cdiv(pairs, 256), 256, 0, stream>>>(
        pairs, count, assign_row, ds, dscore, accumulate, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_pair_score_grad");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_expert_colsum(int64_t E, int64_t cols, const int32_t *expert_offset,
                                    const bf16 *src, const int32_t *gather, const float *scale,
                                    int64_t n, int gated, smoe_w1_layout layout, int map_w1,
                                    void *dst, smoe_dtype dtype, int accumulate,
                                    const int *abort, cudaStream_t stream)
{
    dim3 grid((unsigned)smoe_cdiv(cols, 64), (unsigned)E);
    dim3 block(32, 8);
    k_expert_colsum<<<grid, block, 0, stream>>>(cols, expert_offset, src, gather, scale, n, gated,
                                                layout, map_w1, dst, dtype == SMOE_DTYPE_F32,
                                                accumulate, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_expert_colsum");
    return SMOE_SUCCESS;
}
