/*
 * routing.cu -- router top-K / softmax, token rounding and GENERAL triple
 * checks on the device (DESIGN.md section 2). Input: fp32 logits (T, E)
 * from the cuBLAS router GEMM (or the caller's triples). Output: the routed
 * pairs in token-major order ("assignments"): expert, token, score, the
 * token offsets (T+1) and the pair count, which stays on the device.
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
 *  - SIGMOID_TOPK (k_route_sigmoid): one warp per token, the token's keys
 *    s_e + b_e (double, routing_math.h's sigmoid: the host's bits) in
 *    shared memory; groups: one lane per group takes its two best keys
 *    and their sum, and a group is kept when fewer than topk_group groups
 *    rank ahead of it (the others' keys become -inf); then K picks, each a
 *    warp arg-max over the keys ranked after the previous pick (64-bit
 *    order-preserving images, equal keys to the lower expert, a shuffle
 *    butterfly over that total order). Scores: the K sigmoids summed in
 *    pick order (every lane alike), renormalised (+1e-20) and scaled in
 *    the host's order of operations.
 *  - Token rounding: (1) per token: softmax p over E, token-choice top-K,
 *    renormalised scores, and the ranking key of every (token, expert) pair
 *    (TC pairs: renormalised score; others: p - 1), stored expert-major as
 *    order-preserving 64-bit integers; f_e counted with integer atomics
 *    (a sum, so their order does not show). (2) One block per expert: the
 *    target count from f_e, then an exact radix select (8 passes of 8 bits)
 *    of the target-th largest key; keys above it are kept, and of the keys
 *    equal to it the lowest tokens (a block scan in token order). (3) Per
 *    token: count kept experts, one-block scan into token offsets, then
 *    write each token's kept pairs in expert order, scored with the
 *    renormalised score (TC pairs) or p (pairs added by rounding up).
 *  - GENERAL: each triple checked (token, expert in range, tokens sorted,
 *    no (token, expert) twice, finite score) by a kernel that only reads;
 *    the lowest bad index is recorded with atomicMin (whatever the thread
 *    order), and its reason goes into the call's status word, after which
 *    every later kernel of the call does nothing. Then the triples are
 *    copied as assignments, token offsets by binary search.
 * Deterministic: no floating-point atomics; every sum has a fixed order.
 */
#include <limits.h>

#include "cuda/cuda_common.h"
#include "cuda/routing_device.cuh"

/* ------------------------------------------------------------ block scan */

/* Exclusive scan of one int per thread over the block (blockDim.x a
 * multiple of 32, at most 1024); *total gets the block's sum. */
static __device__ int block_exclusive_scan(int v, int *total)
{
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w; /* inclusive */
    }
    __syncthreads();
    int before = warp == 0 ? 0 : warp_sums[warp - 1];
    *total = warp_sums[nwarps - 1];
    __syncthreads(); /* warp_sums may be reused by the next call */
    return before + x - v;
}

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
                int renormalize, int vec, smoe_assign_dev out)
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
                                  int renormalize, smoe_assign_dev out, cudaStream_t stream)
{
    int kpl = 0;
    while ((1 << kpl) < K) ++kpl;
    const int G = (32 >> kpl) < TCF_MAX_G ? (32 >> kpl) : TCF_MAX_G;
    const uintptr_t p = (uintptr_t)logits;
    int vec = 0;
    if (EPL >= 4) vec = E % 4 == 0 && p % 16 == 0;
    else if (EPL == 2) vec = E % 2 == 0 && p % 8 == 0;
    const size_t smem = mode == SMOE_ROUTING_TOPK_SOFTMAX ? 0 : (size_t)TCF_WARPS * E * 8;
    const int64_t warps = smoe_cdiv(T, G);
    const unsigned blocks = (unsigned)smoe_cdiv(warps, TCF_WARPS);
    if (K <= 4)
        k_route_tc_fast<EPL, true><<<blocks, TCF_WARPS * 32, smem, stream>>>(
            logits, T, E, K, kpl, G, mode, renormalize, vec, out);
    else
        k_route_tc_fast<EPL, false><<<blocks, TCF_WARPS * 32, smem, stream>>>(
            logits, T, E, K, kpl, G, mode, renormalize, vec, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_tc_fast");
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ sigmoid top-K */

/* Shared memory of one warp of k_route_sigmoid, in doubles: the keys (E),
 * the group keys (G), the picks (K int32). */
static __host__ __device__ size_t sig_warp_doubles(int E, int G, int K) { return (size_t)E + G + (K + 1) / 2; }

/* (ka, ia) ranks ahead of (kb, ib): larger key, equal keys lower index */
static __device__ __forceinline__ bool sig_ahead(uint64_t ka, int ia, uint64_t kb, int ib)
{
    return ka > kb || (ka == kb && ia < ib);
}

__global__ void k_route_sigmoid(const float *__restrict__ logits, const float *__restrict__ bias,
                                int T, int E, int K, int G, int g, int renormalize, double scale,
                                int warps, smoe_assign_dev out)
{
    extern __shared__ double sig_smem[];
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int t = blockIdx.x * warps + wib;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out.token_offset[T] = T * K;
        *out.count = T * K;
    }
    if (t >= T) return;
    double *key = sig_smem + (size_t)wib * sig_warp_doubles(E, G, K);
    double *gkey = key + E;
    int *pick = (int *)(gkey + G);
    const float *l = logits + (int64_t)t * E;
    for (int e = lane; e < E; e += 32)
        key[e] = smoe_sigmoid((double)l[e]) + (bias ? (double)bias[e] : 0.0);
    __syncwarp();
    if (G > 0) {
        /* group keys: the sum of each group's two best keys (equal keys
         * have equal values, so which of them is "second" does not show) */
        const int gs = E / G;
        for (int q = lane; q < G; q += 32) {
            uint64_t k1 = 0, k2 = 0;
            double v1 = 0.0, v2 = 0.0;
            for (int j = 0; j < gs; ++j) {
                const double v = key[q * gs + j];
                const uint64_t kv = smoe_sel_key(v);
                if (kv > k1) {
                    k2 = k1; v2 = v1;
                    k1 = kv; v1 = v;
                } else if (kv > k2) {
                    k2 = kv; v2 = v;
                }
            }
            gkey[q] = v1 + v2;
        }
        __syncwarp();
        /* a group is kept when fewer than g groups rank ahead of it; the
         * keys of the others become -inf (only gkey is read meanwhile) */
        for (int q = lane; q < G; q += 32) {
            const uint64_t kq = smoe_sel_key(gkey[q]);
            int ahead = 0;
            for (int j = 0; j < G; ++j) ahead += sig_ahead(smoe_sel_key(gkey[j]), j, kq, q);
            if (ahead >= g)
                for (int e = q * gs; e < (q + 1) * gs; ++e) key[e] = -CUDART_INF;
        }
        __syncwarp();
    }
    /* K picks, each the best key ranked after the previous pick */
    uint64_t pk = 0;
    int pi = -1;
    for (int k = 0; k < K; ++k) {
        uint64_t bk = 0;
        int bi = -1;
        for (int e = lane; e < E; e += 32) {
            const uint64_t ke = smoe_sel_key(key[e]);
            if (pi >= 0 && !sig_ahead(pk, pi, ke, e)) continue;
            if (bi < 0 || sig_ahead(ke, e, bk, bi)) {
                bk = ke;
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const uint64_t ok = __shfl_xor_sync(full, bk, o);
            const int oi = __shfl_xor_sync(full, bi, o);
            if (oi >= 0 && (bi < 0 || sig_ahead(ok, oi, bk, bi))) {
                bk = ok;
                bi = oi;
            }
        }
        if (lane == 0) pick[k] = bi;
        pk = bk;
        pi = bi;
    }
    __syncwarp();
    /* scores: the host's smoe_sigmoid_scores, operation for operation */
    double z = 0.0;
    for (int k = 0; k < K; ++k) z += smoe_sigmoid((double)l[pick[k]]);
    const double den = z + 1e-20;
    for (int k = lane; k < K; k += 32) {
        const int e = pick[k];
        const double sk = smoe_sigmoid((double)l[e]);
        const double v = renormalize ? sk / den : sk;
        const int64_t a = (int64_t)t * K + k;
        out.expert[a] = e;
        out.token[a] = t;
        out.score[a] = (float)(v * scale);
    }
    if (lane == 0) out.token_offset[t] = t * K;
}

static smoe_status launch_sigmoid(const smoe_layer_desc *desc, const float *logits,
                                  const float *bias, int T, smoe_assign_dev out,
                                  cudaStream_t stream)
{
    const int E = (int)desc->E, K = (int)desc->K, G = (int)desc->n_group;
    const size_t per = sig_warp_doubles(E, G, K) * 8;
    int warps = 4;
    while (warps > 1 && (size_t)warps * per > 48 * 1024) warps >>= 1;
    const size_t smem = (size_t)warps * per;
    if (smem > 48 * 1024)
        SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_route_sigmoid,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem));
    k_route_sigmoid<<<(unsigned)smoe_cdiv(T, warps), warps * 32, smem, stream>>>(
        logits, bias, T, E, K, G, (int)desc->topk_group, desc->renormalize,
        desc->routed_scaling, warps, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_sigmoid");
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ token rounding */

typedef struct tr_scratch {
    uint64_t *key;   /* (E, T) ranking keys, order-preserving */
    uint8_t *sel;    /* (E, T) token-choice pair?, then: kept? */
    int32_t *tc;     /* (T, K) token-choice experts */
    int32_t *f;      /* (E) token-choice counts */
    int32_t *cnt;    /* (T) kept pairs per token */
} tr_scratch;

static size_t align_up(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

static tr_scratch tr_scratch_make(void *base, int64_t T, int64_t E, int64_t K, size_t *bytes)
{
    tr_scratch s;
    char *p = (char *)base;
    size_t o = 0;
    s.key = (uint64_t *)(p + o); o += align_up((size_t)(E * T) * 8);
    s.sel = (uint8_t *)(p + o);  o += align_up((size_t)(E * T));
    s.tc = (int32_t *)(p + o);   o += align_up((size_t)(T * K) * 4);
    s.f = (int32_t *)(p + o);    o += align_up((size_t)E * 4);
    s.cnt = (int32_t *)(p + o);  o += align_up((size_t)T * 4);
    if (bytes) *bytes = o;
    return s;
}

__global__ void k_tr_keys(const float *__restrict__ logits, int T, int E, int K, tr_scratch s)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *l = logits + (int64_t)t * E;
    int32_t *tc = s.tc + (int64_t)t * K;
    smoe_topk_row(l, E, K, tc, 1);
    double m, sum;
    smoe_softmax_stats(l, E, &m, &sum);
    double z = 0.0;
    for (int k = 0; k < K; ++k) z += smoe_prob(l[tc[k]], m, sum);
    for (int e = 0; e < E; ++e) {
        s.key[(int64_t)e * T + t] = smoe_double_key(smoe_prob(l[e], m, sum) - 1.0);
        s.sel[(int64_t)e * T + t] = 0;
    }
    for (int k = 0; k < K; ++k) {
        const int e = tc[k];
        s.key[(int64_t)e * T + t] = smoe_double_key(smoe_prob(l[e], m, sum) / z);
        s.sel[(int64_t)e * T + t] = 1;
        atomicAdd(&s.f[e], 1);
    }
}

static __device__ int64_t tr_target(int64_t f, int64_t M, int64_t T, int rounding)
{
    int64_t q = f / M, r = f % M, c;
    if (rounding == SMOE_ROUND_UP) c = (q + (r > 0)) * M;
    else if (rounding == SMOE_ROUND_DOWN) c = q * M;
    else c = (q + (2 * r >= M)) * M; /* nearest, ties up */
    return c < T ? c : T;
}

#define TR_THREADS 512

/* One block per expert: keep its `target` best tokens. Rounding down (or
 * staying): the best `target` token-choice pairs by score. Rounding up: all
 * token-choice pairs and the best `target - f` others by p. Selection by an
 * exact radix select over the 64-bit keys of the candidates; equal keys go
 * to the lower token. Every t is read and written by the same thread. */
__global__ void __launch_bounds__(TR_THREADS) k_tr_select(int T, int E, int64_t M, int rounding,
                                                          tr_scratch s)
{
    __shared__ int hist[256];
    __shared__ uint64_t sh_prefix;
    __shared__ int sh_remaining;
    const int e = blockIdx.x;
    const uint64_t *key = s.key + (int64_t)e * T;
    uint8_t *sel = s.sel + (int64_t)e * T;
    const int64_t f = s.f[e];
    const int64_t target = tr_target(f, M, T, rounding);

    if (target <= 0 || target >= T) {
        const uint8_t v = target > 0 ? 1 : 0;
        for (int t = threadIdx.x; t < T; t += blockDim.x) sel[t] = v;
        return;
    }
    const int want_tc = target <= f; /* candidates: TC pairs, or the others */
    const int need = (int)(want_tc ? target : target - f);
    uint64_t prefix = 0, mask = 0;
    int remaining = need;
    for (int shift = 56; shift >= 0 && need > 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int t = threadIdx.x; t < T; t += blockDim.x) {
            if ((int)sel[t] != want_tc) continue;
            const uint64_t k = key[t];
            if ((k & mask) == prefix) atomicAdd(&hist[(int)((k >> shift) & 255u)], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int dgt = 255;
            for (; dgt > 0; --dgt) {
                if (hist[dgt] >= remaining) break;
                remaining -= hist[dgt];
            }
            sh_prefix = prefix | ((uint64_t)dgt << shift);
            sh_remaining = remaining;
        }
        __syncthreads();
        prefix = sh_prefix;
        remaining = sh_remaining;
        mask |= (uint64_t)255u << shift;
        __syncthreads();
    }
    /* prefix is the need-th largest candidate key: keep the candidates above
     * it and the first `remaining` equal to it (in token order). */
    int carry = 0;
    for (int base = 0; base < T; base += blockDim.x) {
        const int t = base + threadIdx.x;
        const int is_tc = t < T ? sel[t] : 0;
        const int cand = t < T && is_tc == want_tc && need > 0;
        const uint64_t k = cand ? key[t] : 0;
        const int eq = (cand && k == prefix) ? 1 : 0;
        int total;
        const int rank = carry + block_exclusive_scan(eq, &total);
        if (t < T) {
            int keep;
            if (cand) keep = k > prefix || (eq && rank < remaining);
            else keep = !want_tc && is_tc; /* rounding up keeps every TC pair */
            sel[t] = (uint8_t)keep;
        }
        carry += total;
    }
}

__global__ void k_tr_count(int T, int E, tr_scratch s)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    int c = 0;
    for (int e = 0; e < E; ++e) c += s.sel[(int64_t)e * T + t];
    s.cnt[t] = c;
}

/* One block: token_offset = exclusive scan of cnt; count = the total. */
__global__ void __launch_bounds__(1024) k_scan_tokens(const int32_t *__restrict__ cnt, int T,
                                                      int32_t *token_offset, int32_t *count)
{
    const int per = (T + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per;
    const int hi = min(lo + per, T);
    int local = 0;
    for (int t = lo; t < hi; ++t) local += cnt[t];
    int total;
    int run = block_exclusive_scan(local, &total);
    for (int t = lo; t < hi; ++t) {
        token_offset[t] = run;
        run += cnt[t];
    }
    if (threadIdx.x == 0) {
        token_offset[T] = total;
        *count = total;
    }
}

__global__ void k_tr_emit(const float *__restrict__ logits, int T, int E, int K, tr_scratch s,
                          smoe_assign_dev out)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *l = logits + (int64_t)t * E;
    const int32_t *tc = s.tc + (int64_t)t * K;
    double m, sum;
    smoe_softmax_stats(l, E, &m, &sum);
    double z = 0.0;
    for (int k = 0; k < K; ++k) z += smoe_prob(l[tc[k]], m, sum);
    int64_t o = out.token_offset[t];
    for (int e = 0; e < E; ++e) {
        if (!s.sel[(int64_t)e * T + t]) continue;
        bool is_tc = false;
        for (int k = 0; k < K; ++k) is_tc |= (tc[k] == e);
        const double p = smoe_prob(l[e], m, sum);
        out.expert[o] = e;
        out.token[o] = t;
        out.score[o] = (float)(is_tc ? p / z : p);
        ++o;
    }
}

/* ------------------------------------------------------------ GENERAL */

static __device__ int general_check(int64_t i, int T, int E, const int32_t *__restrict__ tok,
                                    const int32_t *__restrict__ ex, const float *__restrict__ sc,
                                    long long *value, long long *value2)
{
    const int t = tok[i], e = ex[i];
    *value = t;
    *value2 = T;
    if (t < 0 || t >= T) return SMOE_DEV_BAD_TOKEN;
    *value2 = 0;
    if (e < 0 || e >= E) {
        *value = e;
        return SMOE_DEV_BAD_EXPERT;
    }
    if (i > 0 && tok[i - 1] > t) {
        *value2 = tok[i - 1];
        return SMOE_DEV_UNSORTED;
    }
    /* same token earlier with the same expert; a run of equal tokens longer
     * than E must repeat an expert within any E+1 of its pairs */
    for (int64_t j = i - 1, steps = 0; j >= 0 && steps < E && tok[j] == t; --j, ++steps) {
        if (ex[j] == e) {
            *value2 = e;
            return SMOE_DEV_DUPLICATE;
        }
    }
    if (!isfinite(sc[i])) {
        *value = (long long)__float_as_uint(sc[i]);
        return SMOE_DEV_BAD_SCORE;
    }
    return SMOE_DEV_OK;
}

/* Every triple checked; the lowest bad index recorded (atomicMin: the same
 * whatever order the threads run in). Reads only. */
__global__ void k_general_check(int64_t pairs, int T, int E,
                                const int32_t *__restrict__ tok, const int32_t *__restrict__ ex,
                                const float *__restrict__ sc, smoe_dev_status *st)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    long long v, v2;
    if (general_check(i, T, E, tok, ex, sc, &v, &v2) != SMOE_DEV_OK)
        atomicMin(&st->first_bad, (int)i);
}

/* The reason and values of the lowest bad triple into the status word (the
 * later kernels of the call then do nothing), and into the layer's record. */
__global__ void k_general_reason(int T, int E, const int32_t *__restrict__ tok,
                                 const int32_t *__restrict__ ex, const float *__restrict__ sc,
                                 smoe_dev_status *st, smoe_dev_report rep)
{
    const int i = st->first_bad;
    if (i == INT_MAX) return;
    long long v, v2;
    const int code = general_check(i, T, E, tok, ex, sc, &v, &v2);
    st->value = v;
    st->value2 = v2;
    st->code = code;
    smoe_dev_report_error(rep, st);
}

/* The checked triples as assignments; token_offset[t] = the first pair
 * whose token is >= t (a binary search). */
__global__ void k_route_general(int64_t pairs, int T,
                                const int32_t *__restrict__ tok, const int32_t *__restrict__ ex,
                                const float *__restrict__ sc, smoe_assign_dev out)
{
    SMOE_DEV_RETURN_IF_ABORTED(out.abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) *out.count = (int32_t)pairs;
    if (i < pairs) {
        out.token[i] = tok[i];
        out.expert[i] = ex[i];
        out.score[i] = sc[i];
    }
    if (i <= T) {
        int64_t lo = 0, hi = pairs;
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (tok[mid] < i) lo = mid + 1; else hi = mid;
        }
        out.token_offset[i] = (int32_t)lo;
    }
}

__global__ void k_status_reset(smoe_dev_status *st)
{
    st->first_bad = INT_MAX;
    st->code = SMOE_DEV_OK;
    st->value = 0;
    st->value2 = 0;
}

/* ------------------------------------------------------------ launchers */

size_t smoe_cuda_routing_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding)
{
    if (!rounding || desc->rounding == SMOE_ROUND_OFF) return 0;
    size_t bytes;
    tr_scratch_make(NULL, T, desc->E, desc->K, &bytes);
    return bytes;
}

smoe_status smoe_cuda_route(const smoe_layer_desc *desc, int64_t T, int rounding,
                            const float *logits, const float *expert_bias, smoe_assign_dev out,
                            void *scratch, cudaStream_t stream)
{
    const int E = (int)desc->E, K = (int)desc->K, Ti = (int)T;
    if (desc->routing == SMOE_ROUTING_SIGMOID_TOPK) /* no token rounding (refused) */
        return launch_sigmoid(desc, logits, expert_bias, Ti, out, stream);
    /* one thread per token; small blocks spread the tokens over every SM */
    const int threads = 64;
    const int blocks = (int)smoe_cdiv(T, threads);
    if (!rounding || desc->rounding == SMOE_ROUND_OFF) {
        const int mode = (int)desc->routing, rn = desc->renormalize;
        if (K >= 1 && K <= 32) {
            if (E <= 32) return launch_tc_fast<1>(logits, Ti, E, K, mode, rn, out, stream);
            if (E <= 64) return launch_tc_fast<2>(logits, Ti, E, K, mode, rn, out, stream);
            if (E <= 128) return launch_tc_fast<4>(logits, Ti, E, K, mode, rn, out, stream);
            if (E <= 256) return launch_tc_fast<8>(logits, Ti, E, K, mode, rn, out, stream);
            if (E <= 512) return launch_tc_warp<16>(logits, Ti, E, K, mode, rn, out, stream);
            if (E <= 1024) return launch_tc_warp<32>(logits, Ti, E, K, mode, rn, out, stream);
        }
        k_route_token_choice<<<blocks, threads, 0, stream>>>(logits, Ti, E, K, (int)desc->routing,
                                                             desc->renormalize, out);
        SMOE_CUDA_LAUNCH_CHECK("k_route_token_choice");
        return SMOE_SUCCESS;
    }
    tr_scratch s = tr_scratch_make(scratch, T, E, K, NULL);
    SMOE_CUDA_CHECK(cudaMemsetAsync(s.f, 0, (size_t)E * 4, stream));
    k_tr_keys<<<blocks, threads, 0, stream>>>(logits, Ti, E, K, s);
    SMOE_CUDA_LAUNCH_CHECK("k_tr_keys");
    k_tr_select<<<E, TR_THREADS, 0, stream>>>(Ti, E, desc->round_tile, (int)desc->rounding, s);
    SMOE_CUDA_LAUNCH_CHECK("k_tr_select");
    k_tr_count<<<blocks, threads, 0, stream>>>(Ti, E, s);
    SMOE_CUDA_LAUNCH_CHECK("k_tr_count");
    k_scan_tokens<<<1, 1024, 0, stream>>>(s.cnt, Ti, out.token_offset, out.count);
    SMOE_CUDA_LAUNCH_CHECK("k_scan_tokens");
    k_tr_emit<<<blocks, threads, 0, stream>>>(logits, Ti, E, K, s, out);
    SMOE_CUDA_LAUNCH_CHECK("k_tr_emit");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_route_general(int64_t T, int64_t E, int64_t pairs,
                                    const int32_t *pair_token, const int32_t *pair_expert,
                                    const float *pair_score, smoe_assign_dev out,
                                    smoe_dev_status *status,
                                    smoe_dev_report report, cudaStream_t stream)
{
    const int threads = 256;
    if (pairs > 0) {
        k_general_check<<<(unsigned)smoe_cdiv(pairs, threads), threads, 0, stream>>>(
            pairs, (int)T, (int)E, pair_token, pair_expert, pair_score, status);
        SMOE_CUDA_LAUNCH_CHECK("k_general_check");
        k_general_reason<<<1, 1, 0, stream>>>((int)T, (int)E, pair_token, pair_expert,
                                              pair_score, status, report);
        SMOE_CUDA_LAUNCH_CHECK("k_general_reason");
    }
    const int64_t n = (pairs > T + 1 ? pairs : T + 1);
    k_route_general<<<(unsigned)smoe_cdiv(n, threads), threads, 0, stream>>>(
        pairs, (int)T, pair_token, pair_expert, pair_score, out);
    SMOE_CUDA_LAUNCH_CHECK("k_route_general");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_exclusive_scan(const int32_t *cnt, int64_t n, int32_t *offsets,
                                     int32_t *total, cudaStream_t stream)
{
    k_scan_tokens<<<1, 1024, 0, stream>>>(cnt, (int)n, offsets, total);
    SMOE_CUDA_LAUNCH_CHECK("k_scan_tokens");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_status_reset(smoe_dev_status *status, cudaStream_t stream)
{
    k_status_reset<<<1, 1, 0, stream>>>(status);
    SMOE_CUDA_LAUNCH_CHECK("k_status_reset");
    return SMOE_SUCCESS;
}
