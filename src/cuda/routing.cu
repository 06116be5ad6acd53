/*
 * routing.cu -- the router's token-choice top-K on the device (TOPK_SOFTMAX,
 * SOFTMAX_TOPK; DESIGN.md section 2), and smoe_cuda_route, which runs a
 * layer's routing: these kernels, SIGMOID_TOPK's (routing_sigmoid.cu) or
 * token rounding's (routing_rounding.cu); the caller's GENERAL triples are
 * routing_general.cu's. Input: fp32 logits (T, E) from the cuBLAS router
 * GEMM. Output: the routed pairs in token-major order ("assignments"):
 * expert, token, score, the token offsets (T+1) and the pair count, which
 * stays on the device.
 *
 * Algorithm:
 *  - Token choice: one warp per token (E <= 1024, K <= 32; else one thread
 *    per token): K picks, each the best logit ranked after the previous
 *    pick (larger first, equal -> lower expert, NaN first; a warp arg-max
 *    over that total order). Scores in double, rounded to fp32, with the
 *    host routing's (src/routing.c) operations in its order, so the same
 *    logits give the same bits on both. For E <= 256 (k_route_tc_fast):
 *    the same picks from a candidate filter and ranks instead of K serial
 *    warp arg-maxes, several tokens per warp.
 * Deterministic: no floating-point atomics; every sum has a fixed order.
 */
#include "cuda/cuda_common.h"
#include "cuda/routing_device.cuh"

/* ------------------------------------------------------------ token choice */

__global__ void k_route_token_choice(const float *__restrict__ logits, int T, int E, int K,
                                     int mode, int renormalize, smoe_assign_dev out)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) {
        out.token_offset[T] = T * K;
        *out.count = T * K;
    }
    if (t >= T) return;
    const float *l = logits + (int64_t)t * E;
    int32_t *idx = out.expert + (int64_t)t * K;
    float *score = out.score + (int64_t)t * K;
    smoe_topk_row(l, E, K, idx, 1);
    out.token_offset[t] = t * K;
    for (int k = 0; k < K; ++k) out.token[(int64_t)t * K + k] = t;

    if (mode == SMOE_ROUTING_TOPK_SOFTMAX) {
        /* softmax over the K picked logits, taken in pick order */
        const double m = (double)l[idx[0]];
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += exp((double)l[idx[k]] - m);
        for (int k = 0; k < K; ++k) score[k] = (float)(exp((double)l[idx[k]] - m) / sum);
    } else {
        double m, sum;
        smoe_softmax_stats(l, E, &m, &sum);
        if (renormalize) {
            double z = 0.0;
            for (int k = 0; k < K; ++k) z += smoe_prob(l[idx[k]], m, sum);
            for (int k = 0; k < K; ++k) score[k] = (float)(smoe_prob(l[idx[k]], m, sum) / z);
        } else {
            for (int k = 0; k < K; ++k) score[k] = (float)smoe_prob(l[idx[k]], m, sum);
        }
    }
}

/* The same routing, one warp per token (E <= 32 * EPL, K <= 32): each lane
 * holds EPL logits as 64-bit ranks (key << 32 | ~index: larger = ranks
 * ahead, a total order) sorted best first; each of the K picks takes the
 * warp's best head in two warp reductions (the largest key, then the lowest
 * index among the lanes holding it), and the winning lane drops its head.
 * The picks equal the sequential ones. (A warp arg-max tree of shuffles per
 * pick over all EPL values measured 0.135 ms at T = 32768, E = 256, K = 16
 * on an H100.) Sums that the host takes in a fixed order are taken in that
 * order here too (one lane, or shuffles in pick order). */
#define TCW_WARPS 4

/* compare-exchange: a ends ranked ahead of (or equal to) b */
static __device__ __forceinline__ void tcw_cx(uint64_t &a, uint64_t &b)
{
    const uint64_t hi = a > b ? a : b, lo = a > b ? b : a;
    a = hi;
    b = lo;
}

template <int EPL>
__global__ void __launch_bounds__(TCW_WARPS * 32)
k_route_token_choice_warp(const float *__restrict__ logits, int T, int E, int K, int mode,
                          int renormalize, smoe_assign_dev out)
{
    extern __shared__ double tcw_exp[]; /* SOFTMAX_TOPK: TCW_WARPS * E */
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int t = blockIdx.x * TCW_WARPS + wib;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out.token_offset[T] = T * K;
        *out.count = T * K;
    }
    if (t >= T) return;
    const float *l = logits + (int64_t)t * E;
    /* rank = key << 32 | ~e; padding (e >= E, key 0) ranks below every
     * logit (-inf's key is 0x007FFFFF, NaN's the largest); K <= E, so
     * padding and exhausted lanes (rank 0) are never picked */
    uint64_t v[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        const uint32_t key = e < E ? smoe_logit_key(l[e]) : 0u;
        v[j] = ((uint64_t)key << 32) | (uint32_t)~(uint32_t)e;
    }
    /* sort the lane's ranks, best first (odd-even transposition network) */
#pragma unroll
    for (int r = 0; r < EPL; ++r)
#pragma unroll
        for (int j = r & 1; j + 1 < EPL; j += 2) tcw_cx(v[j], v[j + 1]);
    int my_idx = -1;
    for (int k = 0; k < K; ++k) {
        const uint32_t hk = (uint32_t)(v[0] >> 32);
        const uint32_t bk = __reduce_max_sync(0xffffffffu, hk);
        const uint32_t bl = __reduce_max_sync(0xffffffffu, hk == bk ? (uint32_t)v[0] : 0u);
        const int bi = (int)~bl;
        if ((bi & 31) == lane) { /* this lane's head was picked: drop it */
#pragma unroll
            for (int j = 0; j + 1 < EPL; ++j) v[j] = v[j + 1];
            v[EPL - 1] = 0;
        }
        if (lane == k) my_idx = bi;
    }
    const float lk = lane < K ? l[my_idx] : 0.0f;
    double score = 0.0;
    if (mode == SMOE_ROUTING_TOPK_SOFTMAX) {
        const double m = __shfl_sync(0xffffffffu, (double)lk, 0);
        const double ek = lane < K ? exp((double)lk - m) : 0.0;
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += __shfl_sync(0xffffffffu, ek, k);
        score = ek / sum;
    } else {
        double *ex = tcw_exp + (size_t)wib * E;
        double m = -CUDART_INF;
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            const int e = lane + 32 * j;
            if (e < E) {
                const double v = (double)l[e];
                if (v > m) m = v;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double v = __shfl_xor_sync(0xffffffffu, m, o);
            if (v > m) m = v;
        }
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            const int e = lane + 32 * j;
            if (e < E) ex[e] = exp((double)l[e] - m);
        }
        __syncwarp();
        double sum = 0.0;
        if (lane == 0)
            for (int e = 0; e < E; ++e) sum += ex[e];
        sum = __shfl_sync(0xffffffffu, sum, 0);
        const double p = lane < K ? exp((double)lk - m) / sum : 0.0;
        if (renormalize) {
            double z = 0.0;
            for (int k = 0; k < K; ++k) z += __shfl_sync(0xffffffffu, p, k);
            score = p / z;
        } else {
            score = p;
        }
    }
    if (lane < K) {
        const int64_t a = (int64_t)t * K + lane;
        out.expert[a] = my_idx;
        out.token[a] = t;
        out.score[a] = (float)score;
    }
    if (lane == 0) out.token_offset[t] = t * K;
}

template <int EPL>
static smoe_status launch_tc_warp(const float *logits, int T, int E, int K, int mode,
                                  int renormalize, smoe_assign_dev out, cudaStream_t stream)
{
    const size_t smem = mode == SMOE_ROUTING_TOPK_SOFTMAX ? 0 : (size_t)TCW_WARPS * E * 8;
    k_route_token_choice_warp<EPL><<<(unsigned)smoe_cdiv(T, TCW_WARPS), TCW_WARPS * 32, smem,
                                     stream>>>(logits, T, E, K, mode, renormalize, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_token_choice_warp");
    return SMOE_SUCCESS;
}

/* The same routing, faster, for E <= 256 (EPL = 1, 2, 4, 8 logits per
 * lane): lane l holds the logits e = EPL*l + j, j < EPL (vector loads where
 * the row allows), so at equal keys the lower lane, then the lower j, is the
 * lower expert. Selection without K serial picks:
 *  1. tau = the K-th largest of the 32 lane maxima (a bitonic sort of the
 *     maxima; for K <= 4 the least of KP groups' maxima, 5 shuffles);
 *     at least K logits rank at or above tau, so the K best are among the
 *     candidates, the logits with key >= tau (about K + K/4 of them on
 *     random logits, 2K for K <= 4).
 *  2. The candidates are compacted into 32 slots (a warp scan of the
 *     lanes' counts) as 64-bit ranks (key << 32 | ~expert: larger = ranked
 *     ahead); each one's rank is the number of larger ranks, so rank k is
 *     pick k.
 *  3. Over 32 candidates (many equal logits): K picks, each the warp's
 *     largest key (the lowest lane holding it, then its lowest j).
 * The picks equal the sequential ones. A warp routes G = min(32 / KP, 4)
 * tokens (KP: K rounded up to a power of two) one after the other, loading
 * the next token's logits while it ranks the current one, then scores them
 * together, lane g*KP + k taking pick k of token g, so the fp64 exp and
 * division run once per lane instead of once per token. Scores: the same
 * fp64 operations, sums in the same order, as k_route_token_choice_warp. */
#define TCF_WARPS 4
#define TCF_MAX_G 4

/* smoe_logit_key without branches (NaN above every number, padding 0) */
static __device__ __forceinline__ uint32_t tcf_key(float f)
{
    /* f + 0 turns -0 into +0 */
    const uint32_t u = __float_as_uint(f + 0.0f);
    const uint32_t k = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
    return f != f ? 0xFFFFFFFFu : k;
}

/* The lane's EPL logits of row l (0 past E). */
template <int EPL>
static __device__ __forceinline__ void tcf_load(const float *__restrict__ l, int E, int lane,
                                                int vec, float (&f)[EPL])
{
    const int e0 = EPL * lane;
    if (EPL >= 4 && vec) {
#pragma unroll
        for (int q = 0; q < EPL / 4; ++q) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (e0 + 4 * q < E) /* E % 4 == 0: all four or none */
                v = __ldg(reinterpret_cast<const float4 *>(l + e0) + q);
            f[4 * q + 0] = v.x;
            f[4 * q + 1] = v.y;
            f[4 * q + 2] = v.z;
            f[4 * q + 3] = v.w;
        }
    } else if (EPL == 2 && vec) {
        float2 v = make_float2(0.f, 0.f);
        if (e0 < E) v = __ldg(reinterpret_cast<const float2 *>(l + e0)); /* E % 2 == 0 */
        f[0] = v.x;
        f[EPL - 1] = v.y;
    } else {
#pragma unroll
        for (int j = 0; j < EPL; ++j) f[j] = e0 + j < E ? __ldg(l + e0 + j) : 0.0f;
    }
}

/* The token's row of logits (the registers tcf_load filled) rounded to
 * bf16 into l16, its row of the caller's bf16 router_logits: where vec16
 * (E % EPL == 0 and l16 2 EPL-byte aligned) one store of the lane's EPL
 * values, else one per value. The same conversion as k_logits_bf16's. */
template <int EPL>
static __device__ __forceinline__ void tcf_store_bf16(bf16 *__restrict__ l16, int E, int lane,
                                                      int vec16, const float (&f)[EPL])
{
    const int e0 = EPL * lane;
    if (EPL >= 2 && vec16) {
        if (e0 >= E) return; /* E % EPL == 0: all EPL values or none */
        uint32_t w[EPL / 2 > 0 ? EPL / 2 : 1];
#pragma unroll
        for (int q = 0; q < EPL / 2; ++q)
            w[q] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * q])) |
                   ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * q + 1])) << 16);
        if constexpr (EPL == 2) *reinterpret_cast<uint32_t *>(l16 + e0) = w[0];
        else if constexpr (EPL == 4) *reinterpret_cast<uint2 *>(l16 + e0) = make_uint2(w[0], w[1]);
        else if constexpr (EPL == 8)
            *reinterpret_cast<uint4 *>(l16 + e0) = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j)
        if (e0 + j < E) l16[e0 + j] = __float2bfloat16_rn(f[j]);
}

/* The K picks of one token into pick[0..K) (warp-wide; pick: the token's
 * slots; cs: 32 candidate slots). */
template <int EPL, bool SMALLK>
static __device__ __forceinline__ void tcf_select(const float (&f)[EPL], int E, int K, int kpl,
                                                  int lane, int *pick, unsigned long long *cs)
{
    const unsigned full = 0xffffffffu;
    const int e0 = EPL * lane;
    uint32_t kk[EPL];
    if (E >= 32 * EPL) { /* every lane full (uniform) */
#pragma unroll
        for (int j = 0; j < EPL; ++j) kk[j] = tcf_key(f[j]);
    } else {
#pragma unroll
        for (int j = 0; j < EPL; ++j) kk[j] = e0 + j < E ? tcf_key(f[j]) : 0u;
    }
    uint32_t v = kk[0];
#pragma unroll
    for (int j = 1; j < EPL; ++j) v = max(v, kk[j]);
    uint32_t tau;
    if (SMALLK) { /* K <= 4 */
        /* KP groups of 32 / KP lanes: tau = the least of the groups' maxima
         * (each group holds a logit at or above it: KP >= K of them) */
        const int gl = 32 >> kpl;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t p = __shfl_xor_sync(full, v, o);
            v = o < gl ? max(v, p) : min(v, p);
        }
        tau = v;
    } else {
        /* bitonic sort of the lane maxima, descending over the lanes */
#pragma unroll
        for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                const uint32_t p = __shfl_xor_sync(full, v, stride);
                const bool keep_max = ((lane & stride) == 0) == ((lane & size) == 0);
                v = keep_max ? max(v, p) : min(v, p);
            }
        }
        tau = __shfl_sync(full, v, K - 1);
    }
    tau = tau ? tau : 1u; /* padding (key 0) never a candidate */
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j) cnt += kk[j] >= tau;
    int inc = cnt; /* inclusive warp scan of the counts */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(full, inc, o);
        if (lane >= o) inc += y;
    }
    const int total = __shfl_sync(full, inc, 31);
    if (total <= 32) {
        __syncwarp(); /* the previous token's slots are read */
        cs[lane] = 0ull; /* below every candidate */
        __syncwarp();
        int pos = inc - cnt;
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            if (kk[j] >= tau) {
                cs[pos] = (unsigned long long)kk[j] << 32 | (uint32_t)~(uint32_t)(e0 + j);
                ++pos;
            }
        }
        __syncwarp();
        const unsigned long long me = cs[lane];
        const ulonglong2 *cs2 = reinterpret_cast<const ulonglong2 *>(cs);
        int rank = 0;
#pragma unroll 4
        for (int c = 0; c < total; c += 2) {
            const ulonglong2 o = cs2[c >> 1];
            rank += o.x > me;
            rank += o.y > me;
        }
        if (lane < total && rank < K) pick[rank] = (int)~(uint32_t)me;
        return;
    }
    /* many equal logits: K picks, each taking the best key left */
    for (int k = 0; k < K; ++k) {
        uint32_t m = kk[0];
#pragma unroll
        for (int j = 1; j < EPL; ++j) m = max(m, kk[j]);
        const uint32_t bk = __reduce_max_sync(full, m);
        const unsigned b = __ballot_sync(full, m == bk);
        if (lane == __ffs(b) - 1) {
            int jw = 0;
#pragma unroll
            for (int j = EPL - 1; j >= 0; --j)
                if (kk[j] == bk) jw = j;
#pragma unroll
            for (int j = 0; j < EPL; ++j)
                if (j == jw) kk[j] = 0u;
            pick[k] = e0 + jw;
        }
    }
}

/* v / (the sum of v over the lanes gb .. gb + K - 1 of the warp: a token's
 * K picks), summed in pick order through the warp's row of shared memory */
static __device__ __forceinline__ double tcf_over_group_sum(double *row, int lane, int gb, int K,
                                                            double v)
{
    row[lane] = v;
    __syncwarp();
    double sum = 0.0;
    for (int i = 0; i < K; ++i) sum += row[gb + i];
    return v / sum;
}

template <int EPL, bool SMALLK>
__global__ void __launch_bounds__(TCF_WARPS * 32)
k_route_tc_fast(const float *__restrict__ logits, int T, int E, int K, int kpl, int G, int mode,
                int renormalize, int vec, bf16 *__restrict__ lg16, int vec16,
                smoe_assign_dev out)
{
    extern __shared__ double tcf_exp[]; /* SOFTMAX_TOPK: TCF_WARPS * E */
    __shared__ int sh_pick[TCF_WARPS][32];
    __shared__ __align__(16) unsigned long long sh_cs[TCF_WARPS][32];
    __shared__ double sh_sum[TCF_WARPS][32];
    __shared__ double sh_m[TCF_WARPS][TCF_MAX_G], sh_s[TCF_WARPS][TCF_MAX_G];
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, KP = 1 << kpl;
    const int64_t t0 = ((int64_t)blockIdx.x * TCF_WARPS + wib) * G;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out.token_offset[T] = T * K;
        *out.count = T * K;
    }
    if (t0 >= T) return;
    const int ng = (int)(T - t0 < G ? T - t0 : G); /* tokens of this warp */
    float f[EPL], fn[EPL];
    tcf_load<EPL>(logits + t0 * E, E, lane, vec, f);
    for (int g = 0; g < ng; ++g) {
        if (g + 1 < ng) tcf_load<EPL>(logits + (t0 + g + 1) * E, E, lane, vec, fn);
        if (lg16) tcf_store_bf16<EPL>(lg16 + (t0 + g) * E, E, lane, vec16, f);
        if (mode != SMOE_ROUTING_TOPK_SOFTMAX) {
            /* the softmax normaliser over the row, as the warp kernel */
            double *ex = tcf_exp + (size_t)wib * E;
            double m = -CUDART_INF;
#pragma unroll
            for (int j = 0; j < EPL; ++j) {
                if (EPL * lane + j < E) {
                    const double v = (double)f[j];
                    if (v > m) m = v;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const double v = __shfl_xor_sync(full, m, o);
                if (v > m) m = v;
            }
            __syncwarp(); /* the previous token's sum is taken */
#pragma unroll
            for (int j = 0; j < EPL; ++j)
                if (EPL * lane + j < E) ex[EPL * lane + j] = exp((double)f[j] - m);
            __syncwarp();
            if (lane == 0) {
                double s = 0.0;
                for (int e = 0; e < E; ++e) s += ex[e];
                sh_m[wib][g] = m;
                sh_s[wib][g] = s;
            }
        }
        tcf_select<EPL, SMALLK>(f, E, K, kpl, lane, &sh_pick[wib][g * KP], sh_cs[wib]);
#pragma unroll
        for (int j = 0; j < EPL; ++j) f[j] = fn[j];
    }
    __syncwarp();
    const int g = lane >> kpl, k = lane & (KP - 1);
    const int64_t t = t0 + g;
    const bool act = g < ng && k < K;
    const int e = act ? sh_pick[wib][lane] : 0;
    const float lk = act ? __ldg(logits + t * E + e) : 0.0f;
    const int gb = lane - k; /* the group's first lane */
    double score;
    if (mode == SMOE_ROUTING_TOPK_SOFTMAX) {
        /* softmax over the K picked logits */
        const double m = __shfl_sync(full, (double)lk, gb);
        score = tcf_over_group_sum(sh_sum[wib], lane, gb, K, act ? exp((double)lk - m) : 0.0);
    } else {
        const double m = g < ng ? sh_m[wib][g] : 0.0, s = g < ng ? sh_s[wib][g] : 1.0;
        const double p = act ? exp((double)lk - m) / s : 0.0;
        score = renormalize ? tcf_over_group_sum(sh_sum[wib], lane, gb, K, p) : p;
    }
    if (act) {
        const int64_t a = t * K + k;
        out.expert[a] = e;
        out.token[a] = (int32_t)t;
        out.score[a] = (float)score;
        if (k == 0) out.token_offset[t] = (int32_t)(t * K);
    }
}

template <int EPL>
static smoe_status launch_tc_fast(const float *logits, int T, int E, int K, int mode,
                                  int renormalize, bf16 *lg16, smoe_assign_dev out,
                                  cudaStream_t stream)
{
    int kpl = 0;
    while ((1 << kpl) < K) ++kpl;
    const int G = (32 >> kpl) < TCF_MAX_G ? (32 >> kpl) : TCF_MAX_G;
    const uintptr_t p = (uintptr_t)logits;
    int vec = 0;
    if (EPL >= 4) vec = E % 4 == 0 && p % 16 == 0;
    else if (EPL == 2) vec = E % 2 == 0 && p % 8 == 0;
    const int vec16 = EPL >= 2 && E % EPL == 0 && (uintptr_t)lg16 % (2 * EPL) == 0;
    const size_t smem = mode == SMOE_ROUTING_TOPK_SOFTMAX ? 0 : (size_t)TCF_WARPS * E * 8;
    const int64_t warps = smoe_cdiv(T, G);
    const unsigned blocks = (unsigned)smoe_cdiv(warps, TCF_WARPS);
    if (K <= 4)
        k_route_tc_fast<EPL, true><<<blocks, TCF_WARPS * 32, smem, stream>>>(
            logits, T, E, K, kpl, G, mode, renormalize, vec, lg16, vec16, out);
    else
        k_route_tc_fast<EPL, false><<<blocks, TCF_WARPS * 32, smem, stream>>>(
            logits, T, E, K, kpl, G, mode, renormalize, vec, lg16, vec16, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_tc_fast");
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ launcher */

smoe_status smoe_cuda_route(const smoe_layer_desc *desc, int64_t T, int rounding,
                            const float *logits, const float *expert_bias, void *logits16,
                            smoe_assign_dev out, void *scratch, cudaStream_t stream)
{
    const int E = (int)desc->E, K = (int)desc->K, Ti = (int)T;
    const int mode = (int)desc->routing, rn = desc->renormalize;
    const int choice = !rounding || desc->rounding == SMOE_ROUND_OFF; /* token choice alone */
    bf16 *lg16 = (bf16 *)logits16;
    /* the fast token-choice kernels (E <= 256) write the bf16 copy from
     * the logits they read; every other path leaves it to a pass of its own */
    if (mode != SMOE_ROUTING_SIGMOID_TOPK && choice && K >= 1 && K <= 32 && E <= 256) {
        if (E <= 32) return launch_tc_fast<1>(logits, Ti, E, K, mode, rn, lg16, out, stream);
        if (E <= 64) return launch_tc_fast<2>(logits, Ti, E, K, mode, rn, lg16, out, stream);
        if (E <= 128) return launch_tc_fast<4>(logits, Ti, E, K, mode, rn, lg16, out, stream);
        return launch_tc_fast<8>(logits, Ti, E, K, mode, rn, lg16, out, stream);
    }
    if (lg16)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_logits_out(logits, lg16, SMOE_DTYPE_BF16, T * E, stream));
    if (mode == SMOE_ROUTING_SIGMOID_TOPK) /* no token rounding (refused) */
        return smoe_cuda_route_sigmoid(desc, logits, expert_bias, Ti, out, stream);
    if (!choice) return smoe_cuda_route_rounding(desc, T, logits, out, scratch, stream);
    if (K >= 1 && K <= 32) {
        if (E <= 512) return launch_tc_warp<16>(logits, Ti, E, K, mode, rn, out, stream);
        if (E <= 1024) return launch_tc_warp<32>(logits, Ti, E, K, mode, rn, out, stream);
    }
    /* one thread per token; small blocks spread the tokens over every SM */
    const int threads = 64;
    k_route_token_choice<<<(unsigned)smoe_cdiv(T, threads), threads, 0, stream>>>(
        logits, Ti, E, K, mode, rn, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_token_choice");
    return SMOE_SUCCESS;
}
