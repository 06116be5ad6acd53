/*
 * routing_rounding.cu -- token rounding on the device (DESIGN.md section 2;
 * desc.rounding UP, DOWN, NEAREST over TOPK_SOFTMAX or SOFTMAX_TOPK): each
 * expert's token count rounded to a multiple of round_tile, from fp32
 * logits (T, E) to the assignments of smoe_cuda_route (routing.cu), which
 * calls this file's launcher. Also the one-block scan of per-token counts
 * into token offsets that rounding ends with (smoe_cuda_exclusive_scan for
 * the expert-parallel path).
 *
 * Algorithm:
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
 * Deterministic: no floating-point atomics; every sum has a fixed order.
 */
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

/* One block: token_offset = exclusive scan of cnt; count = the total.
 * Tiles of SCAN_PER x 1024 counts staged in shared memory (coalesced loads
 * and stores), each thread scanning SCAN_PER consecutive ones, a carry
 * between tiles. The staging index skips a word every 32 so that the
 * threads' runs fall in distinct banks. */
#define SCAN_PER 8
static __device__ __forceinline__ int scan_slot(int i) { return i + (i >> 5); }

__global__ void __launch_bounds__(1024) k_scan_tokens(const int32_t *__restrict__ cnt, int T,
                                                      int32_t *token_offset, int32_t *count)
{
    __shared__ int tile[1024 * SCAN_PER + 1024 * SCAN_PER / 32];
    const int span = (int)blockDim.x * SCAN_PER, lo = (int)threadIdx.x * SCAN_PER;
    int carry = 0;
    for (int base = 0; base < T; base += span) {
        const int n = min(span, T - base);
        for (int i = threadIdx.x; i < n; i += blockDim.x) tile[scan_slot(i)] = cnt[base + i];
        __syncthreads();
        int local = 0;
#pragma unroll
        for (int k = 0; k < SCAN_PER; ++k) local += lo + k < n ? tile[scan_slot(lo + k)] : 0;
        int total;
        int run = carry + block_exclusive_scan(local, &total);
#pragma unroll
        for (int k = 0; k < SCAN_PER; ++k) {
            if (lo + k >= n) break;
            const int c = tile[scan_slot(lo + k)];
            tile[scan_slot(lo + k)] = run;
            run += c;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            token_offset[base + i] = tile[scan_slot(i)];
        __syncthreads(); /* the next tile overwrites the staging */
        carry += total;
    }
    if (threadIdx.x == 0) {
        token_offset[T] = carry;
        *count = carry;
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

/* ------------------------------------------------------------ launchers */

size_t smoe_cuda_routing_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding)
{
    if (!rounding || desc->rounding == SMOE_ROUND_OFF) return 0;
    size_t bytes;
    tr_scratch_make(NULL, T, desc->E, desc->K, &bytes);
    return bytes;
}

/* smoe_cuda_route's token rounding (desc->rounding != OFF). */
smoe_status smoe_cuda_route_rounding(const smoe_layer_desc *desc, int64_t T, const float *logits,
                                     smoe_assign_dev out, void *scratch, cudaStream_t stream)
{
    const int E = (int)desc->E, K = (int)desc->K, Ti = (int)T;
    /* one thread per token; small blocks spread the tokens over every SM */
    const int threads = 64;
    const int blocks = (int)smoe_cdiv(T, threads);
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

smoe_status smoe_cuda_exclusive_scan(const int32_t *cnt, int64_t n, int32_t *offsets,
                                     int32_t *total, cudaStream_t stream)
{
    k_scan_tokens<<<1, 1024, 0, stream>>>(cnt, (int)n, offsets, total);
    SMOE_CUDA_LAUNCH_CHECK("k_scan_tokens");
    return SMOE_SUCCESS;
}
