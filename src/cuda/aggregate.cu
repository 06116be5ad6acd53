/*
 * aggregate.cu -- the per-token reduction over a token's routed rows
 * (DESIGN.md sections 4.5 and 5.5):
 *   forward   out[t] = sum_a row_score[r_a] * Y[r_a]           (T, d) bf16
 *   backward  dx[t] (op)= sum_a (dX~[r_a] + dl_a Wr[e_a]) (+ dXr[t])  bf16|fp32
 * where a runs over the token's assignments [token_offset[t],
 * token_offset[t+1]) and r_a = assign_row[a] (-1: a skipped GENERAL triple,
 * ignored). The router's contribution dlogits * Wr comes either per pair
 * (dl_a, when dlogits is nonzero only on the routed pairs: Wr's rows are
 * read from L2) or as a dense fp32 dXr (T, d) from cuBLAS; either way dX
 * is written once.
 *
 * One block per token, each thread owning 8 consecutive columns (16-byte
 * loads) when d is a multiple of 8, else 1. Where every token has exactly K
 * assignments (top-K routing without token rounding: token t's are t K ..
 * t K + K - 1, so no token_offset is read), the _k kernels instead give
 * each thread one (token, 8-column chunk) item of the flattened T x d / 8
 * items (1 column where d % 8 != 0) and read the token's rows AGG_UNROLL
 * at a time, the indices past K predicated off, so that all of a short
 * token's loads are in flight at once (layer forward +1-2% at K = 2 and
 * 4, d = 768 and 1536: notes/sm90_log.md rung 23). For K = 2, 4 and 8 the
 * _kc kernels take K as a constant and load every row of their items
 * before summing any, kept raw (a uint4 per 8 columns), with 2 items per
 * thread at K = 2: in the layer on an H100 (ncu, rung 25) the forward's
 * aggregation 67 -> 61 us at 1.4B-n1024, 198 -> 191 us at 1.4B-n256, the
 * backward's 78 -> 75 and 233 -> 226 us; more items per thread lost at K
 * = 4 and 8 (registers: fewer warps in flight). The sum runs in
 * assignment order in fp32 (fma) in every kernel, so results are
 * deterministic, bitwise the same in both kinds of kernel, and do not
 * depend on the launch shape. Each token gathers its rows: no atomics, no
 * scatter. The backward with the per-pair router term, K = 2, 4, 8 or 16
 * and d % 64 == 0, runs k_aggregate_backward_slab: the router weight's
 * 64-column slab staged in shared memory per block, the same sums (H200,
 * session 40, layer backward against the _kc kernels: +0.9-2.6% on five of
 * ten rows, even on the others; notes/sm90_log.md rung 31).
 */
#include "cuda/cuda_common.h"

#define AGG_THREADS 128
#define AGG_UNROLL 4

template <int VEC>
struct vec_io;

template <>
struct vec_io<8> {
    static __device__ __forceinline__ void load(const bf16 *p, float *v)
    {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void store(bf16 *p, const float *v)
    {
        uint4 u;
        __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        *reinterpret_cast<uint4 *>(p) = u;
    }
};

template <>
struct vec_io<1> {
    static __device__ __forceinline__ void load(const bf16 *p, float *v) { v[0] = __bfloat162float(*p); }
    static __device__ __forceinline__ void store(bf16 *p, const float *v) { *p = __float2bfloat16_rn(v[0]); }
};

/* One VEC-column piece of a row as loaded (8 bf16 in a uint4, or 1), kept
 * raw until it is summed, so that many can be in flight in few registers. */
template <int VEC>
struct vec_raw;

template <>
struct vec_raw<8> {
    uint4 u;
    __device__ __forceinline__ void load(const bf16 *p) { u = *reinterpret_cast<const uint4 *>(p); }
    /* acc += piece */
    __device__ __forceinline__ void add_into(float *acc) const
    {
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
        }
    }
    /* acc += s * piece, in column order */
    __device__ __forceinline__ void fma_into(float *acc, float s) const
    {
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            acc[2 * i] = fmaf(s, f.x, acc[2 * i]);
            acc[2 * i + 1] = fmaf(s, f.y, acc[2 * i + 1]);
        }
    }
};

template <>
struct vec_raw<1> {
    bf16 u;
    __device__ __forceinline__ void load(const bf16 *p) { u = *p; }
    __device__ __forceinline__ void add_into(float *acc) const { acc[0] += __bfloat162float(u); }
    __device__ __forceinline__ void fma_into(float *acc, float s) const
    {
        acc[0] = fmaf(s, __bfloat162float(u), acc[0]);
    }
};

/* The forward's saved-block header (when the call saves one), written by
 * one thread with the call's device status. */
static __device__ __forceinline__ void agg_write_header(smoe_saved_header *header,
                                                        smoe_saved_header h, const int *abort)
{
    if (header && blockIdx.x == 0 && threadIdx.x == 0) {
        h.status = abort ? *abort : 0;
        *header = h;
    }
}

/* acc += row_score[r[j]] y[r[j]] for j < AGG_UNROLL in order (r[j] < 0
 * skipped), columns c .. c + VEC - 1: the rows' loads all in flight before
 * the sums. */
template <int VEC>
static __device__ __forceinline__ void agg_fma_group(float *acc, const int *r,
                                                     const float *__restrict__ row_score,
                                                     const bf16 *__restrict__ y, int64_t d,
                                                     int64_t c)
{
    float sc[AGG_UNROLL], v[AGG_UNROLL][VEC];
#pragma unroll
    for (int j = 0; j < AGG_UNROLL; ++j) {
        sc[j] = r[j] < 0 ? 0.0f : row_score[r[j]];
        if (r[j] >= 0) vec_io<VEC>::load(y + (int64_t)r[j] * d + c, v[j]);
    }
#pragma unroll
    for (int j = 0; j < AGG_UNROLL; ++j) {
        if (r[j] < 0) continue;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = fmaf(sc[j], v[j][i], acc[i]);
    }
}

/* acc += sum over a in [a0, a1) of row_score[r_a] y[r_a], r_a =
 * assign_row[a] (-1 skipped), columns c .. c + VEC - 1, in order, four
 * rows' loads in flight at once. */
template <int VEC>
static __device__ __forceinline__ void agg_rows_into(float *acc, int a0, int a1,
                                                     const int32_t *__restrict__ assign_row,
                                                     const float *__restrict__ row_score,
                                                     const bf16 *__restrict__ y, int64_t d,
                                                     int64_t c)
{
    int a = a0;
    for (; a + AGG_UNROLL <= a1; a += AGG_UNROLL) {
        int r[AGG_UNROLL];
#pragma unroll
        for (int j = 0; j < AGG_UNROLL; ++j) r[j] = assign_row[a + j];
        agg_fma_group<VEC>(acc, r, row_score, y, d, c);
    }
    for (; a < a1; ++a) {
        const int r = assign_row[a];
        if (r < 0) continue;
        const float s = row_score[r];
        float v[VEC];
        vec_io<VEC>::load(y + (int64_t)r * d + c, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = fmaf(s, v[i], acc[i]);
    }
}

template <int VEC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_forward(int64_t T, int64_t d, const int32_t *__restrict__ token_offset,
                    const int32_t *__restrict__ assign_row, const float *__restrict__ row_score,
                    const bf16 *__restrict__ y, bf16 *__restrict__ out,
                    smoe_saved_header *header, smoe_saved_header h, const int *abort)
{
    agg_write_header(header, h, abort);
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int a0 = token_offset[t], a1 = token_offset[t + 1];
        for (int64_t c = (int64_t)threadIdx.x * VEC; c < d; c += (int64_t)AGG_THREADS * VEC) {
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
            agg_rows_into<VEC>(acc, a0, a1, assign_row, row_score, y, d, c);
            vec_io<VEC>::store(out + t * d + c, acc);
        }
    }
}

/* The expert-parallel combine (smoe_cuda_aggregate_combine): one block per
 * token; its entries in order, each either a slot of this rank's own rows
 * (their pairs summed as k_aggregate_forward sums a token's) or a peer's
 * partial sum. */
template <int VEC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_combine(int64_t T, int64_t d, const int32_t *__restrict__ ent_offset,
                    const int32_t *__restrict__ dest, int self, const int32_t *__restrict__ pidx,
                    const int32_t *__restrict__ slot_offset,
                    const int32_t *__restrict__ assign_row, const float *__restrict__ row_score,
                    const bf16 *__restrict__ y, const bf16 *__restrict__ part,
                    bf16 *__restrict__ out, smoe_saved_header *header, smoe_saved_header h,
                    const int *abort)
{
    agg_write_header(header, h, abort);
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int e0 = ent_offset[t], e1 = ent_offset[t + 1];
        for (int64_t c = (int64_t)threadIdx.x * VEC; c < d; c += (int64_t)AGG_THREADS * VEC) {
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
            for (int e = e0; e < e1; ++e) {
                const int p = pidx[e];
                if (p < 0) continue;
                if (dest[e] == self) {
                    agg_rows_into<VEC>(acc, slot_offset[p], slot_offset[p + 1], assign_row,
                                       row_score, y, d, c);
                } else {
                    float v[VEC];
                    vec_io<VEC>::load(part + (int64_t)p * d + c, v);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] += v[i];
                }
            }
            vec_io<VEC>::store(out + t * d + c, acc);
        }
    }
}

/* Adds AGG_UNROLL loaded rows v[j] (r[j] < 0: none) to acc in order, each
 * with its per-pair router term dl_a wr[e_a] (a = a_first + j) where
 * assign_dl is given. */
template <int VEC>
static __device__ __forceinline__ void agg_backward_chunk(float *acc, const int *r,
                                                          const float (*v)[VEC], int64_t a_first,
                                                          const float *assign_dl,
                                                          const uint16_t *assign_expert,
                                                          const bf16 *wr, int64_t d, int64_t c)
{
#pragma unroll
    for (int j = 0; j < AGG_UNROLL; ++j) {
        if (r[j] < 0) continue;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += v[j][i];
        if (assign_dl) {
            const float g = assign_dl[a_first + j];
            float w[VEC];
            vec_io<VEC>::load(wr + (int64_t)assign_expert[a_first + j] * d + c, w);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = fmaf(g, w[i], acc[i]);
        }
    }
}

/* The backward's last step for token t's columns c .. c + VEC - 1: the dense
 * router term and the column term added, then dx written (fp32 or bf16,
 * overwritten or accumulated). */
template <int VEC>
static __device__ __forceinline__ void agg_backward_store(float *acc, int64_t t, int64_t c,
                                                          int64_t d, const float *extra,
                                                          const float *col, void *dx, int dx_f32,
                                                          int accumulate)
{
    if (extra) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += extra[t * d + c + i];
    }
    if (col) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += col[c + i];
    }
    if (dx_f32) {
        float *o = (float *)dx + t * d + c;
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = accumulate ? o[i] + acc[i] : acc[i];
    } else {
        bf16 *o = (bf16 *)dx + t * d + c;
        if (accumulate) {
            float old[VEC];
            vec_io<VEC>::load(o, old);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += old[i];
        }
        vec_io<VEC>::store(o, acc);
    }
}

template <int VEC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_backward(int64_t T, int64_t d, const int32_t *__restrict__ token_offset,
                     const int32_t *__restrict__ assign_row, const bf16 *__restrict__ dxt,
                     const float *__restrict__ extra, const float *__restrict__ assign_dl,
                     const uint16_t *__restrict__ assign_expert, const bf16 *__restrict__ wr,
                     const float *__restrict__ col, void *__restrict__ dx, int dx_f32,
                     int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int a0 = token_offset[t], a1 = token_offset[t + 1];
        for (int64_t c = (int64_t)threadIdx.x * VEC; c < d; c += (int64_t)AGG_THREADS * VEC) {
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
            int a = a0;
            for (; a + AGG_UNROLL <= a1; a += AGG_UNROLL) {
                int r[AGG_UNROLL];
                float v[AGG_UNROLL][VEC];
#pragma unroll
                for (int j = 0; j < AGG_UNROLL; ++j) r[j] = assign_row[a + j];
#pragma unroll
                for (int j = 0; j < AGG_UNROLL; ++j)
                    if (r[j] >= 0) vec_io<VEC>::load(dxt + (int64_t)r[j] * d + c, v[j]);
                agg_backward_chunk<VEC>(acc, r, v, a, assign_dl, assign_expert, wr, d, c);
            }
            for (; a < a1; ++a) {
                const int r = assign_row[a];
                if (r < 0) continue;
                float v[VEC];
                vec_io<VEC>::load(dxt + (int64_t)r * d + c, v);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] += v[i];
                if (assign_dl) {
                    const float g = assign_dl[a];
                    vec_io<VEC>::load(wr + (int64_t)assign_expert[a] * d + c, v);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] = fmaf(g, v[i], acc[i]);
                }
            }
            agg_backward_store<VEC>(acc, t, c, d, extra, col, dx, dx_f32, accumulate);
        }
    }
}

/* ------------------------------------------------- exactly K rows per token */

/* Item g of the flattened T x d / VEC (token, VEC-column chunk) items: the
 * token and the chunk's first column. A 32-bit division where the items
 * fit (a 64-bit division is a long subroutine). */
template <int VEC>
static __device__ __forceinline__ void agg_item(int64_t g, int64_t cols, bool narrow, int64_t *t,
                                                int64_t *c)
{
    if (narrow) {
        const uint32_t gg = (uint32_t)g, cc = (uint32_t)cols, tt = gg / cc;
        *t = tt;
        *c = (int64_t)(gg - tt * cc) * VEC;
    } else {
        *t = g / cols;
        *c = (g - *t * cols) * VEC;
    }
}

#define AGG_ITEMS_LOOP(T, d)                                                                     \
    const int64_t cols = (d) / VEC, items = (T) * cols;                                          \
    const bool narrow = items <= (int64_t)UINT32_MAX;                                            \
    for (int64_t g = (int64_t)blockIdx.x * AGG_THREADS + threadIdx.x; g < items;                 \
         g += (int64_t)gridDim.x * AGG_THREADS)

/* Any K (the exactly-K rows with K not 2, 4 or 8): the token's rows
 * AGG_UNROLL at a time, the indices past K predicated off. */
template <int VEC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_forward_k(int64_t T, int64_t d, int K, const int32_t *__restrict__ assign_row,
                      const float *__restrict__ row_score, const bf16 *__restrict__ y,
                      bf16 *__restrict__ out, smoe_saved_header *header, smoe_saved_header h,
                      const int *abort)
{
    agg_write_header(header, h, abort);
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    AGG_ITEMS_LOOP(T, d)
    {
        int64_t t, c;
        agg_item<VEC>(g, cols, narrow, &t, &c);
        const int32_t *rows = assign_row + t * K;
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
        for (int a = 0; a < K; a += AGG_UNROLL) {
            int r[AGG_UNROLL];
#pragma unroll
            for (int j = 0; j < AGG_UNROLL; ++j) r[j] = a + j < K ? rows[a + j] : -1;
            agg_fma_group<VEC>(acc, r, row_score, y, d, c);
        }
        vec_io<VEC>::store(out + t * d + c, acc);
    }
}

/* The _kc kernels' loop: g0 steps IPT S, S the grid's threads. */
#define AGG_KC_ITEMS_LOOP(T, d)                                                                  \
    const int64_t cols = (d) / VEC, items = (T) * cols, S = (int64_t)gridDim.x * AGG_THREADS;    \
    const bool narrow = items <= (int64_t)UINT32_MAX;                                            \
    for (int64_t g0 = (int64_t)blockIdx.x * AGG_THREADS + threadIdx.x; g0 < items; g0 += IPT * S)

/* The _kc kernels' items g0 + i S (i < IPT): each one's token t, first
 * column c, whether it exists, and its KC row indices (-1 where it does
 * not). */
template <int VEC, int KC, int IPT>
static __device__ __forceinline__ void agg_kc_items(int64_t g0, int64_t S, int64_t items,
                                                    int64_t cols, bool narrow,
                                                    const int32_t *__restrict__ assign_row,
                                                    int64_t *t, int64_t *c, bool *ok,
                                                    int (*r)[KC])
{
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
        const int64_t g = g0 + i * S;
        ok[i] = g < items;
        agg_item<VEC>(ok[i] ? g : g0, cols, narrow, &t[i], &c[i]);
#pragma unroll
        for (int a = 0; a < KC; ++a) r[i][a] = ok[i] ? assign_row[t[i] * KC + a] : -1;
    }
}

/* Exactly KC rows per token, KC a compile-time constant, and IPT items per
 * thread (items g, g + S, ..., g + (IPT - 1) S of the flattened items, S
 * the grid's threads; the loop steps IPT S): every item's row indices are
 * loaded, then every row piece of every item (IPT KC loads in flight, kept
 * raw), then each item is summed in assignment order and stored. Bitwise
 * the same sums as k_aggregate_forward_k's. */
template <int VEC, int KC, int IPT>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_forward_kc(int64_t T, int64_t d, int /* K: KC */,
                       const int32_t *__restrict__ assign_row,
                       const float *__restrict__ row_score, const bf16 *__restrict__ y,
                       bf16 *__restrict__ out, smoe_saved_header *header, smoe_saved_header h,
                       const int *abort)
{
    agg_write_header(header, h, abort);
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    AGG_KC_ITEMS_LOOP(T, d)
    {
        int64_t t[IPT], c[IPT];
        bool ok[IPT];
        int r[IPT][KC];
        agg_kc_items<VEC, KC, IPT>(g0, S, items, cols, narrow, assign_row, t, c, ok, r);
        vec_raw<VEC> v[IPT][KC];
        float sc[IPT][KC];
#pragma unroll
        for (int i = 0; i < IPT; ++i)
#pragma unroll
            for (int a = 0; a < KC; ++a) {
                sc[i][a] = r[i][a] < 0 ? 0.0f : row_score[r[i][a]];
                if (r[i][a] >= 0) v[i][a].load(y + (int64_t)r[i][a] * d + c[i]);
            }
#pragma unroll
        for (int i = 0; i < IPT; ++i) {
            if (!ok[i]) continue;
            float acc[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
#pragma unroll
            for (int a = 0; a < KC; ++a)
                if (r[i][a] >= 0) v[i][a].fma_into(acc, sc[i][a]);
            vec_io<VEC>::store(out + t[i] * d + c[i], acc);
        }
    }
}

/* The backward's exactly-KC kernel with IPT items per thread, as
 * k_aggregate_forward_kc: the row indices (and, with assign_dl, the pairs'
 * dl and experts) of every item, then every dX~ piece and router row piece
 * in flight, then per item the same sums in the same order as
 * k_aggregate_backward_k (dX~ added, then dl_a Wr[e_a] by fma, row by row)
 * and agg_backward_store. */
template <int VEC, int KC, int IPT>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_backward_kc(int64_t T, int64_t d, int /* K: KC */,
                        const int32_t *__restrict__ assign_row, const bf16 *__restrict__ dxt,
                        const float *__restrict__ extra, const float *__restrict__ assign_dl,
                        const uint16_t *__restrict__ assign_expert, const bf16 *__restrict__ wr,
                        const float *__restrict__ col, void *__restrict__ dx, int dx_f32,
                        int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    AGG_KC_ITEMS_LOOP(T, d)
    {
        int64_t t[IPT], c[IPT];
        bool ok[IPT];
        int r[IPT][KC];
        agg_kc_items<VEC, KC, IPT>(g0, S, items, cols, narrow, assign_row, t, c, ok, r);
        vec_raw<VEC> v[IPT][KC];
#pragma unroll
        for (int i = 0; i < IPT; ++i)
#pragma unroll
            for (int a = 0; a < KC; ++a)
                if (r[i][a] >= 0) v[i][a].load(dxt + (int64_t)r[i][a] * d + c[i]);
        if (assign_dl) {
            vec_raw<VEC> w[IPT][KC];
            float dl[IPT][KC];
#pragma unroll
            for (int i = 0; i < IPT; ++i)
#pragma unroll
                for (int a = 0; a < KC; ++a) {
                    const int64_t p = t[i] * KC + a;
                    dl[i][a] = r[i][a] >= 0 ? assign_dl[p] : 0.0f;
                    if (r[i][a] >= 0) w[i][a].load(wr + (int64_t)assign_expert[p] * d + c[i]);
                }
#pragma unroll
            for (int i = 0; i < IPT; ++i) {
                if (!ok[i]) continue;
                float acc[VEC];
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
#pragma unroll
                for (int a = 0; a < KC; ++a) {
                    if (r[i][a] < 0) continue;
                    v[i][a].add_into(acc);
                    w[i][a].fma_into(acc, dl[i][a]);
                }
                agg_backward_store<VEC>(acc, t[i], c[i], d, extra, col, dx, dx_f32, accumulate);
            }
        } else {
#pragma unroll
            for (int i = 0; i < IPT; ++i) {
                if (!ok[i]) continue;
                float acc[VEC];
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
#pragma unroll
                for (int a = 0; a < KC; ++a)
                    if (r[i][a] >= 0) v[i][a].add_into(acc);
                agg_backward_store<VEC>(acc, t[i], c[i], d, extra, col, dx, dx_f32, accumulate);
            }
        }
    }
}

/* The backward's k_aggregate_forward_k: any K, AGG_UNROLL rows at a time. */
template <int VEC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_backward_k(int64_t T, int64_t d, int K, const int32_t *__restrict__ assign_row,
                       const bf16 *__restrict__ dxt, const float *__restrict__ extra,
                       const float *__restrict__ assign_dl,
                       const uint16_t *__restrict__ assign_expert, const bf16 *__restrict__ wr,
                       const float *__restrict__ col, void *__restrict__ dx, int dx_f32,
                       int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    AGG_ITEMS_LOOP(T, d)
    {
        int64_t t, c;
        agg_item<VEC>(g, cols, narrow, &t, &c);
        const int64_t a0 = t * K;
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
        for (int a = 0; a < K; a += AGG_UNROLL) {
            int r[AGG_UNROLL];
            float v[AGG_UNROLL][VEC];
#pragma unroll
            for (int j = 0; j < AGG_UNROLL; ++j) r[j] = a + j < K ? assign_row[a0 + a + j] : -1;
#pragma unroll
            for (int j = 0; j < AGG_UNROLL; ++j)
                if (r[j] >= 0) vec_io<VEC>::load(dxt + (int64_t)r[j] * d + c, v[j]);
            agg_backward_chunk<VEC>(acc, r, v, a0 + a, assign_dl, assign_expert, wr, d, c);
        }
        agg_backward_store<VEC>(acc, t, c, d, extra, col, dx, dx_f32, accumulate);
    }
}

/* ------------------------------------------------- the router term's slab */

/* The backward with the per-pair router term, exactly KC rows per token and
 * d % 64 == 0: a block owns one 64-column slab of d (blockIdx.x) and tokens
 * in blocks of AGG_SLAB_TOKENS (blockIdx.y, grid-stride), and stages the
 * router weight's slab, E x 64 bf16, in shared memory first. Each pair's
 * Wr piece is then a shared-memory read: read from L2 per pair (the _kc
 * kernel) it was as many bytes as dX~ itself, 4 GiB at 30B-n256 (K = 16),
 * where the staging reads E x d x 2 bytes per token block. A thread
 * takes (token, 8-column chunk) items of its block, every dX~ piece of an
 * item in flight, then the same sums in the same order as
 * k_aggregate_backward_k and agg_backward_store. Blocks with consecutive
 * x (launched together) read the same tokens' rows. */
#define AGG_SLAB_COLS 64
#define AGG_SLAB_TOKENS 256
#define AGG_SLAB_SMEM_MAX (96 * 1024) /* E <= 768 */

template <int KC>
__global__ void __launch_bounds__(AGG_THREADS)
k_aggregate_backward_slab(int64_t T, int64_t d, int E, const int32_t *__restrict__ assign_row,
                          const bf16 *__restrict__ dxt, const float *__restrict__ extra,
                          const float *__restrict__ assign_dl,
                          const uint16_t *__restrict__ assign_expert, const bf16 *__restrict__ wr,
                          const float *__restrict__ col, void *__restrict__ dx, int dx_f32,
                          int accumulate, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    extern __shared__ uint4 agg_slab[]; /* E x 8 pieces of 8 bf16 */
    const int64_t c0 = (int64_t)blockIdx.x * AGG_SLAB_COLS;
    for (int i = threadIdx.x; i < E * 8; i += AGG_THREADS)
        agg_slab[i] = *reinterpret_cast<const uint4 *>(wr + (int64_t)(i >> 3) * d + c0 +
                                                       8 * (i & 7));
    __syncthreads();
    const int64_t blocks = (T + AGG_SLAB_TOKENS - 1) / AGG_SLAB_TOKENS;
    for (int64_t tb = blockIdx.y; tb < blocks; tb += gridDim.y) {
        for (int it = threadIdx.x; it < AGG_SLAB_TOKENS * 8; it += AGG_THREADS) {
            const int64_t t = tb * AGG_SLAB_TOKENS + (it >> 3);
            if (t >= T) break;
            const int j = it & 7;
            const int64_t c = c0 + 8 * j, a0 = t * KC;
            int r[KC];
            vec_raw<8> v[KC];
#pragma unroll
            for (int a = 0; a < KC; ++a) r[a] = assign_row[a0 + a];
#pragma unroll
            for (int a = 0; a < KC; ++a)
                if (r[a] >= 0) v[a].load(dxt + (int64_t)r[a] * d + c);
            float acc[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
#pragma unroll
            for (int a = 0; a < KC; ++a) {
                if (r[a] < 0) continue;
                v[a].add_into(acc);
                vec_raw<8> w;
                w.u = agg_slab[assign_expert[a0 + a] * 8 + j];
                w.fma_into(acc, assign_dl[a0 + a]);
            }
            agg_backward_store<8>(acc, t, c, d, extra, col, dx, dx_f32, accumulate);
        }
    }
}

#undef AGG_ITEMS_LOOP
#undef AGG_KC_ITEMS_LOOP

/* Blocks for `work` units, `per` units to a block (one token, or
 * AGG_THREADS (token, column chunk) items, one per thread): grid-stride
 * past 2^20 blocks; 1 for T = 0 (the forward's header). */
static unsigned agg_grid(int64_t work, int per)
{
    const int64_t b = (work + per - 1) / per;
    return (unsigned)(b < 1 ? 1 : b < (1 << 20) ? b : (1 << 20));
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

smoe_status smoe_cuda_aggregate_forward(int64_t T, int64_t d, const int32_t *token_offset,
                                        int k_uniform, const int32_t *assign_row,
                                        const float *row_score, const bf16 *y, bf16 *out,
                                        smoe_saved_header *header, smoe_saved_header h,
                                        const int *abort, cudaStream_t stream)
{
    const bool v8 = d % 8 == 0 && aligned16(y) && aligned16(out);
    SMOE_RETURN_ERROR_IF(!row_score, SMOE_ERROR_INTERNAL, "aggregate forward: no row scores");
    /* the kernel by k_uniform, the column width by v8; then K and the items
     * per thread of the exactly-K kernels */
#define AGG_FWD(KERNEL, GRID, OFFS, ...)                                                         \
    do {                                                                                         \
        if (v8) KERNEL<8, ##__VA_ARGS__><<<GRID(8), AGG_THREADS, 0, stream>>>(                   \
            T, d, OFFS, assign_row, row_score, y, out, header, h, abort);                        \
        else KERNEL<1, ##__VA_ARGS__><<<GRID(1), AGG_THREADS, 0, stream>>>(                      \
            T, d, OFFS, assign_row, row_score, y, out, header, h, abort);                        \
    } while (0)
#define AGG_GRID_ITEMS(V) agg_grid(T * (d / (V)), AGG_THREADS)
#define AGG_GRID_ITEMS2(V) agg_grid(T * (d / (V)), 2 * AGG_THREADS)
#define AGG_GRID_TOKENS(V) agg_grid(T, 1)
    if (k_uniform == 2) {
        AGG_FWD(k_aggregate_forward_kc, AGG_GRID_ITEMS2, 2, 2, 2);
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_forward_kc<K 2>");
    } else if (k_uniform == 4) {
        AGG_FWD(k_aggregate_forward_kc, AGG_GRID_ITEMS, 4, 4, 1);
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_forward_kc<K 4>");
    } else if (k_uniform == 8) {
        AGG_FWD(k_aggregate_forward_kc, AGG_GRID_ITEMS, 8, 8, 1);
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_forward_kc<K 8>");
    } else if (k_uniform > 0) {
        AGG_FWD(k_aggregate_forward_k, AGG_GRID_ITEMS, k_uniform);
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_forward_k");
    } else {
        AGG_FWD(k_aggregate_forward, AGG_GRID_TOKENS, token_offset);
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_forward");
    }
#undef AGG_FWD
#undef AGG_GRID_ITEMS
#undef AGG_GRID_ITEMS2
#undef AGG_GRID_TOKENS
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_aggregate_combine(int64_t T, int64_t d, const int32_t *ent_offset,
                                        const int32_t *dest, int self, const int32_t *pidx,
                                        const int32_t *slot_offset, const int32_t *assign_row,
                                        const float *row_score, const bf16 *y, const bf16 *part,
                                        bf16 *out, smoe_saved_header *header,
                                        smoe_saved_header h, const int *abort,
                                        cudaStream_t stream)
{
    const unsigned grid = agg_grid(T, 1);
    if (d % 8 == 0 && aligned16(y) && aligned16(part) && aligned16(out))
        k_aggregate_combine<8><<<grid, AGG_THREADS, 0, stream>>>(
            T, d, ent_offset, dest, self, pidx, slot_offset, assign_row, row_score, y, part, out,
            header, h, abort);
    else
        k_aggregate_combine<1><<<grid, AGG_THREADS, 0, stream>>>(
            T, d, ent_offset, dest, self, pidx, slot_offset, assign_row, row_score, y, part, out,
            header, h, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_aggregate_combine");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_aggregate_backward(int64_t T, int64_t d, const int32_t *token_offset,
                                         int k_uniform, const int32_t *assign_row,
                                         const bf16 *dxt, const float *extra,
                                         const float *assign_dl, const uint16_t *assign_expert,
                                         const bf16 *wr, int64_t E, const float *col,
                                         void *dx, smoe_dtype dx_dtype, int accumulate,
                                         const int *abort, cudaStream_t stream)
{
    const int f32 = dx_dtype == SMOE_DTYPE_F32;
    const bool v8 = d % 8 == 0 && aligned16(dxt) && aligned16(dx) && (!wr || aligned16(wr));
    const size_t slab = (size_t)E * AGG_SLAB_COLS * 2;
    if (T > 0 && assign_dl && wr && v8 && d % AGG_SLAB_COLS == 0 && slab <= AGG_SLAB_SMEM_MAX &&
        (k_uniform == 2 || k_uniform == 4 || k_uniform == 8 || k_uniform == 16)) {
        const int64_t blocks = (T + AGG_SLAB_TOKENS - 1) / AGG_SLAB_TOKENS;
        const dim3 grid((unsigned)(d / AGG_SLAB_COLS), (unsigned)(blocks < 65535 ? blocks : 65535));
#define AGG_SLAB(KC)                                                                             \
    do {                                                                                         \
        if (slab > 48 * 1024)                                                                    \
            SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_aggregate_backward_slab<KC>,                   \
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,     \
                                                 (int)slab));                                     \
        k_aggregate_backward_slab<KC><<<grid, AGG_THREADS, slab, stream>>>(                      \
            T, d, (int)E, assign_row, dxt, extra, assign_dl, assign_expert, wr, col, dx, f32,    \
            accumulate, abort);                                                                  \
    } while (0)
        if (k_uniform == 2) AGG_SLAB(2);
        else if (k_uniform == 4) AGG_SLAB(4);
        else if (k_uniform == 8) AGG_SLAB(8);
        else AGG_SLAB(16);
#undef AGG_SLAB
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_backward_slab");
        return SMOE_SUCCESS;
    }
    if (k_uniform > 0) {
        /* K = 2, 4, 8: the constant-K kernel, 2 items per thread at K = 2 */
#define AGG_BWD(VEC, KERNEL, IPT, ...)                                                           \
    KERNEL<VEC, ##__VA_ARGS__><<<agg_grid(T * (d / VEC), AGG_THREADS * IPT), AGG_THREADS, 0,     \
                                 stream>>>(T, d, k_uniform, assign_row, dxt, extra, assign_dl,   \
                                           assign_expert, wr, col, dx, f32, accumulate, abort)
#define AGG_BWD_ANY(VEC)                                                                         \
    do {                                                                                         \
        if (k_uniform == 2) AGG_BWD(VEC, k_aggregate_backward_kc, 2, 2, 2);                      \
        else if (k_uniform == 4) AGG_BWD(VEC, k_aggregate_backward_kc, 1, 4, 1);                 \
        else if (k_uniform == 8) AGG_BWD(VEC, k_aggregate_backward_kc, 1, 8, 1);                 \
        else AGG_BWD(VEC, k_aggregate_backward_k, 1);                                            \
    } while (0)
        if (v8) AGG_BWD_ANY(8);
        else AGG_BWD_ANY(1);
#undef AGG_BWD_ANY
#undef AGG_BWD
        SMOE_CUDA_LAUNCH_CHECK("k_aggregate_backward_k");
        return SMOE_SUCCESS;
    }
    if (v8)
        k_aggregate_backward<8><<<agg_grid(T, 1), AGG_THREADS, 0, stream>>>(
            T, d, token_offset, assign_row, dxt, extra, assign_dl, assign_expert, wr, col, dx,
            f32, accumulate, abort);
    else
        k_aggregate_backward<1><<<agg_grid(T, 1), AGG_THREADS, 0, stream>>>(
            T, d, token_offset, assign_row, dxt, extra, assign_dl, assign_expert, wr, col, dx,
            f32, accumulate, abort);
    SMOE_CUDA_LAUNCH_CHECK("k_aggregate_backward");
    return SMOE_SUCCESS;
}
