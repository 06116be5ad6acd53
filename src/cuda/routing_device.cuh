/*
 * routing_device.cuh -- per-token routing arithmetic on the device, shared
 * by the forward routing kernels (routing.cu) and the router backward
 * (router_backward.cu), so both see the same selection and scores.
 *
 * It mirrors the host routing (src/routing.c) operation for operation, so
 * the same fp32 logits give the same bits:
 *  - selection compares the fp32 logits: larger first, equal logits to the
 *    lower expert, NaN above every number as torch.topk ranks it (-0 and +0
 *    are equal);
 *  - probabilities are computed in double: m = max, e_i = exp(l_i - m), the
 *    sum taken in index order, p_i = e_i / sum; scores are rounded to fp32
 *    last;
 *  - SIGMOID_TOPK: sigmoids from routing_math.h (the host's code, built of
 *    correctly rounded operations only), keys s + b in double, compared as
 *    smoe_sel_key images.
 */
#ifndef SMOE_CUDA_ROUTING_DEVICE_CUH
#define SMOE_CUDA_ROUTING_DEVICE_CUH

#include <math_constants.h>
#include <stdint.h>

#include "routing_math.h"

/* Order-preserving integer image of a logit: a > b as numbers iff
 * key(a) > key(b); equal numbers (+0, -0) give equal keys; NaN gives the
 * largest key (+inf gives 0xFF800000). 0 is left for padding. */
static __device__ __forceinline__ uint32_t smoe_logit_key(float f)
{
    if (f != f) return 0xFFFFFFFFu;
    if (f == 0.0f) f = 0.0f;
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* never 0: -inf gives 0x007FFFFF */
}

/* Order-preserving image of a double: -0 == +0, NaN as +inf (the host's
 * ranking maps NaN keys to +inf too: a token with a NaN score is kept). */
static __device__ __forceinline__ uint64_t smoe_double_key(double x)
{
    if (x != x) x = CUDART_INF;
    if (x == 0.0) x = 0.0;
    uint64_t u = (uint64_t)__double_as_longlong(x);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

/* Order-preserving image of a SIGMOID_TOPK key (double): -0 == +0, NaN
 * above +inf (as torch.topk and the host's ranks_before_d rank it); never
 * 0 (-inf gives 0x000FFFFFFFFFFFFF), so 0 can mean "none". */
static __device__ __forceinline__ uint64_t smoe_sel_key(double x)
{
    if (x != x) return 0xFFFFFFFFFFFFFFFFull;
    if (x == 0.0) x = 0.0;
    const uint64_t u = (uint64_t)__double_as_longlong(x);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

/* "Ranks ahead": larger key, or equal key and lower index. */
static __device__ __forceinline__ bool smoe_ahead(uint32_t ka, int ia, uint32_t kb, int ib)
{
    return ka > kb || (ka == kb && ia < ib);
}

/* The K best of E logits (row `l`), best first, into idx[0..K) (stride
 * `istride` elements). Each pass picks the best element ranked after the
 * previous pick, so no "taken" marks are needed. */
static __device__ __forceinline__ void smoe_topk_row(const float *__restrict__ l, int E, int K,
                                                     int32_t *idx, int64_t istride)
{
    uint32_t prev_k = 0xFFFFFFFFu;
    int prev_i = -1;
    for (int k = 0; k < K; ++k) {
        uint32_t best_k = 0;
        int best_i = -1;
        for (int e = 0; e < E; ++e) {
            uint32_t ke = smoe_logit_key(l[e]);
            /* must rank after the previous pick */
            if (prev_i >= 0 && !smoe_ahead(prev_k, prev_i, ke, e)) continue;
            if (best_i < 0 || smoe_ahead(ke, e, best_k, best_i)) {
                best_k = ke;
                best_i = e;
            }
        }
        idx[k * istride] = best_i;
        prev_k = best_k;
        prev_i = best_i;
    }
}

/* Softmax normaliser over the whole row, in double: max m and the sum of
 * exp(l_e - m) in index order. p_e = exp(l_e - m) / sum. */
static __device__ __forceinline__ void smoe_softmax_stats(const float *__restrict__ l, int E,
                                                          double *m_out, double *sum_out)
{
    double m = -CUDART_INF;
    for (int e = 0; e < E; ++e) {
        double v = (double)l[e];
        if (v > m) m = v;
    }
    double s = 0.0;
    for (int e = 0; e < E; ++e) s += exp((double)l[e] - m);
    *m_out = m;
    *sum_out = s;
}

static __device__ __forceinline__ double smoe_prob(float l, double m, double sum)
{
    return exp((double)l - m) / sum;
}

#endif /* SMOE_CUDA_ROUTING_DEVICE_CUH */
