/*
 * routing_sigmoid.cu -- SIGMOID_TOPK routing on the device (DESIGN.md
 * section 2; smoe.h, smoe_routing): expert bias, group-limited selection,
 * renormalisation and scaling, from fp32 logits (T, E) to the assignments
 * of smoe_cuda_route (routing.cu), which calls this file's launcher.
 *
 * Algorithm:
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
 * Deterministic: no floating-point atomics; every sum has a fixed order.
 */
#include "cuda/cuda_common.h"
#include "cuda/routing_device.cuh"

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

smoe_status smoe_cuda_route_sigmoid(const smoe_layer_desc *desc, const float *logits,
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
