/*
 * routing_general.cu -- GENERAL routing on the device: the caller's
 * (token, expert, score) triples checked, then copied as the assignments
 * smoe_cuda_route's kernels give (routing.cu): expert, token, score, the
 * token offsets (T+1) and the pair count.
 *
 * Algorithm:
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

/* ------------------------------------------------------------ launcher */

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
