/*
 * grouped_gemm_sm90.cu -- Hopper (sm_90a) varlen-M grouped GEMMs of the MoE
 * layer, the up, down, dh and dxt entries of smoe_gemm_ops_sm90 (gemm.h); the
 * dw1/dw2 entries come from varlen_k_sm90.cu.
 *
 * Shapes (gemm.h): rows sorted by expert, expert e owns rows
 * [expert_offset[e], expert_offset[e+1]), read on the device only.
 *   up:   H[r] = X[row_token[r]] W1[e]^T + b1[e]   (cap, h_cols), A = act(H)
 *   down: Y[r] = A[r] W2[e]^T + b2[e]              (cap, d)
 *   dh:   dA'[r] = dO[row_token[r]] W2[e]          (n columns), then dH, A', dS
 *   dxt:  dX~[r] = dH[r] W1[e]                     (cap, d)
 *
 * Algorithm: one persistent CTA per SM (384 threads = 3 warpgroups).
 *  - Warpgroup 0 produces (setmaxnreg down to 40, 56 when it gathers and
 *    keeps the tile's row tokens in registers): one thread loads the
 *    weight tile by TMA into 128B-swizzled shared memory (BN x 64 K-major for
 *    up/down; BN/64 boxes of 64 k-rows x 64 columns, MN-major, for dh/dxt).
 *    For the gathered operand (X in up, dO in dh) all 128 threads load the
 *    tile's 128 rows with 16-byte cp.async into the same swizzled layout
 *    (chunk c of row r at r*128 + ((c ^ (r & 7)) << 4)), completing on the
 *    stage's full barrier by cp.async.mbarrier.arrive.noinc (count 128 + the
 *    TMA thread's expect_tx arrival). For down/dxt the A tile comes by TMA.
 *    Gathering rows by TMA instead (1-row boxes, alone or mixed with
 *    cp.async) was measured 10-25% slower on an H100 and removed
 *    (notes/sm90_log.md, rung 4; code in commit e2d1a1a).
 *  - Warpgroups 1 and 2 consume (setmaxnreg up to 232, or 224): each owns 64 rows of
 *    the 128-row tile and runs wgmma m64nBNk16 (fp32 accumulators in
 *    registers; transpose bit for MN-major B), releasing a stage through its
 *    empty barrier once the wgmma that read it has retired (wait_group 1).
 *  - A STAGES-deep ring of full/empty mbarriers links them.
 *  - Tile scheduler: static and persistent. Tiles of expert e are
 *    ceil(count_e / 128) x ceil(N / BN); a prefix sum over experts (one warp,
 *    in shared memory, from expert_offset on the device: no host sync) turns
 *    a linear tile index into (expert, m-tile, n-tile) by binary search. CTA b
 *    takes tiles b, b + grid, ... N-tiles vary fastest, so the CTAs running
 *    at once share an expert's weight tiles and gathered rows in L2.
 *  - Epilogue through a per-warpgroup shared buffer, 64 columns (dh: 32 fp32
 *    units) at a time: the accumulator layout scatters a warp's stores over 8
 *    rows, so the chunk is staged and then stored as 128-byte row segments,
 *    clipped at the expert's last row and at N. The elementwise work (up: A =
 *    act(H); dh: dSwiGLU, A', dS) runs in a compact loop over the staged
 *    values, not unrolled over the 128 accumulators: unrolled, it made the
 *    kernel 450 KB of code and the instruction fetches stalled every warp.
 *    Rows of a tile past the expert's end are computed on zeros (gather) or
 *    on the next rows of A (TMA; possibly rows in [R, cap), which are
 *    allocated) and never stored.
 *
 * W1 layouts: logical H column c is physical W1 row smoe_w1_row(c). For the
 * interleaved layout an N tile is BN consecutive W1 rows and a thread's
 * accumulator column pair (2i, 2i+1) is (gate, up) of one unit. For the
 * concatenated layout the tile is loaded as two boxes, BN/2 gate rows then
 * the BN/2 matching up rows, so accumulator columns c and c + BN/2 (held by
 * the same thread) are the gate and up of one unit. b1 follows W1's physical
 * row order. dxt needs W1's rows in dH's column order: interleaved (or
 * non-gated) only; the concatenated layout returns SMOE_ERROR_UNSUPPORTED.
 *
 * Numerics: bf16 operands, fp32 accumulation in the tensor cores, bias added
 * in fp32, H rounded to bf16, A = act(bf16 H) in fp32 rounded to bf16 (the
 * same value the backward recomputes from the saved H). dh: A recomputed
 * from the saved bf16 H, dS partial sums per (row, n-tile) in fp32 in a fixed
 * order, written to scratch and summed in n-tile order by sm90_ds_finish
 * (plus <dO, b2[e]>). Deterministic: every output element is written once by
 * one thread; no atomics.
 *
 * Tile table (BM = 128 rows, BK = 64; H100 timings in notes/sm90_log.md):
 *   N >= 256: BN = 256, 4 stages (48 KiB each)
 *   N <  256: BN = 128, 6 stages (32 KiB each); up gathers one stage per
 *             producer warp there
 * Requirements (else SMOE_ERROR_UNSUPPORTED, and the layer runs the portable
 * kernel): d % 64 == 0, n % 64 == 0, E <= 1024, 16-byte aligned pointers.
 */
#include <cudaTypedefs.h>
#include <stdint.h>
#include <string.h>

#include "cuda/gemm.h"
#include "cuda/sm90/ptx_sm90.cuh"
#include "cuda/sm90/tensor_map_sm90.h"

using namespace smoe_sm90;

#define SM90_BM 128
#define SM90_BK 64
#define SM90_THREADS 384
#define SM90_MAX_EXPERTS 1024
/* setmaxnreg budgets: the gathering producer keeps its 8 row tokens (and
 * their row offsets) in registers for the whole tile, which needs 56; the
 * TMA-only producer and the warp-per-stage gather fit in 40. */
#define SM90_PRODUCER_REGS 40
#define SM90_CONSUMER_REGS 232
#define SM90_GATHER_PRODUCER_REGS 56
#define SM90_GATHER_CONSUMER_REGS 224
#define SM90_CLUSTER_PRODUCER_REGS 72 /* the multicast producer needs a few more */
#define SM90_CLUSTER_CONSUMER_REGS 216

/* Kernel variant flags (template parameter FL):
 *  SM90_FL_WS      gather one stage per producer warp (BN=128 up)
 *  SM90_FL_PP      ping-pong consumers: each warpgroup owns whole 128 x BN
 *                  tiles (alternate tiles of the CTA), so one warpgroup's
 *                  epilogue runs under the other's main loop; BN = 128.
 *                  Measured slower than the cooperative 128 x 256 tile for
 *                  up and dh on an H100 (notes/sm90_log.md, rung 6); kept
 *                  behind the variant hook and tested.
 *  SM90_FL_CLUSTER clusters of 2 CTAs along M: the pair takes m-tiles 2m and
 *                  2m + 1 of one (expert, n-tile), each CTA loads half of the
 *                  weight tile by TMA multicast into both, and a stage is
 *                  free only when the consumers of both CTAs released it
 *                  (empty barrier count 4, two arrivals remote). Measured
 *                  20-35% slower than one CTA per tile on an H100
 *                  (notes/sm90_log.md, rung 7); behind the hook, tested.
 *  SM90_FL_DH_CT   dh's flush with the activation dispatched once per chunk
 *                  (ep_flush_dh_ct); not yet timed. */
enum { SM90_FL_WS = 1, SM90_FL_PP = 2, SM90_FL_CLUSTER = 4, SM90_FL_DH_CT = 8 };

enum { SM90_MODE_UP = 0, SM90_MODE_DOWN = 1, SM90_MODE_DXT = 2, SM90_MODE_DH = 3 };

typedef struct sm90_gemm_params {
    const bf16 *a_src;            /* up: X (T, K) gathered by row_token */
    const bf16 *bias;             /* up: b1 (E, h_cols); down: b2 (E, N); may be NULL */
    bf16 *out0;                   /* up: H (cap, N), may be NULL; down: Y (cap, N) */
    bf16 *out1;                   /* up: A (cap, n) */
    const int32_t *expert_offset; /* (E+1) */
    const int32_t *row_token;     /* (cap) */
    int E;
    int K;                        /* reduction length */
    int N;                        /* output columns: h_cols (up) or d (down) */
    int n;                        /* intermediate size (up) */
    int gated, act, concat;
    /* dh only */
    const bf16 *h_in;             /* H (cap, h_cols) */
    const float *score;           /* (cap) */
    float *dsp;                   /* (tiles_n, cap) partial dS sums */
    int64_t cap;
    int h_cols;
} sm90_gemm_params;

/* Per consumer warpgroup: 64 rows x 64 bf16, rows padded to 144 bytes so the
 * accumulator-layout writes and the row-segment reads avoid bank conflicts. */
#define SM90_EP_STRIDE 144
#define SM90_EP_BYTES (64 * SM90_EP_STRIDE)

template <int BN, int STAGES>
struct sm90_tile_cfg {
    static constexpr int A_BYTES = SM90_BM * SM90_BK * 2;
    static constexpr int B_BYTES = BN * SM90_BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + 2 * SM90_EP_BYTES +
                                      2 * STAGES * 8 + (SM90_MAX_EXPERTS + 1) * 4 + 2 * 128 * 4;
    static_assert(STAGE_BYTES % 1024 == 0, "stages must keep 1024-byte alignment");
    static_assert(SMEM_BYTES <= 227 * 1024, "shared memory budget");
};

/* ------------------------------------------------------------ activations */

__device__ __forceinline__ float sm90_silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float sm90_gelu_tanh(float x)
{
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    /* 0.5 (1 + tanh z) = 1 / (1 + exp(-2z)): one exponential, no tanhf */
    float z = k0 * (x + k1 * x * x * x);
    return x / (1.0f + __expf(-2.0f * z));
}

__device__ __forceinline__ float sm90_act_gated(int act, float g, float u)
{
    switch (act) {
    case SMOE_ACT_GEGLU: return sm90_gelu_tanh(g) * u;
    case SMOE_ACT_REGLU: return fmaxf(g, 0.0f) * u;
    default: return sm90_silu(g) * u; /* SWIGLU */
    }
}

__device__ __forceinline__ float sm90_act_plain(int act, float h)
{
    switch (act) {
    case SMOE_ACT_RELU2: { float r = fmaxf(h, 0.0f); return r * r; }
    case SMOE_ACT_RELU: return fmaxf(h, 0.0f);
    case SMOE_ACT_SILU: return sm90_silu(h);
    default: return sm90_gelu_tanh(h); /* GELU */
    }
}

__device__ __forceinline__ float load_bias(const bf16 *b, int64_t i)
{
    return b ? __bfloat162float(b[i]) : 0.0f;
}

/* ------------------------------------------------------------ scheduler */

typedef struct sm90_tile {
    int e, n_tile;
    int row0, row_end; /* first row of the tile, end of the expert's rows */
} sm90_tile;

/* Tile (or, in a cluster of CL CTAs, tile group) t: expert, n-tile and this
 * CTA's m-tile (CTA `rank` of the group takes m-tile CL * m + rank). */
template <int CL>
__device__ __forceinline__ sm90_tile sm90_tile_decode(int t, const int *tile_start, int E, int nt,
                                                      const int32_t *expert_offset, int rank)
{
    int lo = 0, hi = E; /* tile_start[lo] <= t < tile_start[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (tile_start[mid] <= t) lo = mid; else hi = mid;
    }
    sm90_tile tl;
    int local = t - tile_start[lo];
    tl.e = lo;
    tl.n_tile = local % nt;
    tl.row0 = __ldg(expert_offset + lo) + ((local / nt) * CL + rank) * SM90_BM;
    tl.row_end = __ldg(expert_offset + lo + 1);
    return tl;
}

/* ------------------------------------------------------------ epilogue staging */


__device__ __forceinline__ void ep_put2(uint8_t *eb, int r, int c, float v0, float v1)
{
    *(__nv_bfloat162 *)(eb + r * SM90_EP_STRIDE + c * 2) = __floats2bfloat162_rn(v0, v1);
}

__device__ __forceinline__ void ep_put4(uint8_t *eb, int r, int c, float v0, float v1, float v2,
                                        float v3)
{
    __nv_bfloat162 a = __floats2bfloat162_rn(v0, v1), b = __floats2bfloat162_rn(v2, v3);
    uint2 pk;
    pk.x = *(uint32_t *)&a;
    pk.y = *(uint32_t *)&b;
    *(uint2 *)(eb + r * SM90_EP_STRIDE + c * 2) = pk;
}

/* Stores the warpgroup's staged 64 rows (WBYTES bytes each) to dst (row
 * stride ld elements), rows < nvalid only. Named barriers around it: the
 * whole warpgroup's writes land before the reads, and the reads finish
 * before the buffer is written again. */
template <int WBYTES>
__device__ __forceinline__ void ep_flush(const uint8_t *eb, bf16 *dst, int64_t ld, int nvalid,
                                         int t, int cw)
{
    constexpr int VPR = WBYTES / 16, RPI = 128 / VPR;
    named_barrier_sync(1 + cw, 128);
    const int v = t % VPR;
#pragma unroll
    for (int r = t / VPR; r < 64; r += RPI)
        if (r < nvalid)
            *(uint4 *)((uint8_t *)(dst + (int64_t)r * ld) + v * 16) =
                *(const uint4 *)(eb + r * SM90_EP_STRIDE + v * 16);
    named_barrier_sync(1 + cw, 128);
}

/* up's flush: stores the staged H chunk (64 columns from hc0, when H is
 * wanted) and A = act(H) from the same bf16 values: 8 columns per thread,
 * i.e. 4 (gate, up) pairs or 8 plain values. */
__device__ __noinline__ void ep_flush_up(const uint8_t *eb, bf16 *out_h, bf16 *out_a, int ldh,
                                         int lda, int gated, int act, int wrow0, int hc0,
                                         int nvalid, int t, int cw)
{
    named_barrier_sync(1 + cw, 128);
    const int v = t & 7;
#pragma unroll 1
    for (int r = t >> 3; r < 64; r += 16) {
        if (r >= nvalid) break;
        const uint4 hv = *(const uint4 *)(eb + r * SM90_EP_STRIDE + v * 16);
        const int64_t row = wrow0 + r;
        if (out_h) *(uint4 *)(out_h + row * ldh + hc0 + 8 * v) = hv;
        const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv;
        if (gated) {
            __nv_bfloat162 o0 = __floats2bfloat162_rn(
                sm90_act_gated(act, __low2float(h2[0]), __high2float(h2[0])),
                sm90_act_gated(act, __low2float(h2[1]), __high2float(h2[1])));
            __nv_bfloat162 o1 = __floats2bfloat162_rn(
                sm90_act_gated(act, __low2float(h2[2]), __high2float(h2[2])),
                sm90_act_gated(act, __low2float(h2[3]), __high2float(h2[3])));
            uint2 pk;
            pk.x = *(uint32_t *)&o0;
            pk.y = *(uint32_t *)&o1;
            *(uint2 *)(out_a + row * lda + hc0 / 2 + 4 * v) = pk;
        } else {
            uint4 ov;
            uint32_t *o = (uint32_t *)&ov;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                __nv_bfloat162 a2 = __floats2bfloat162_rn(sm90_act_plain(act, __low2float(h2[i])),
                                                          sm90_act_plain(act, __high2float(h2[i])));
                o[i] = *(uint32_t *)&a2;
            }
            *(uint4 *)(out_a + row * lda + hc0 + 8 * v) = ov;
        }
    }
    named_barrier_sync(1 + cw, 128);
}

/* f(x) and f'(x): the gate function (gated) or the activation. */
__device__ __forceinline__ void sm90_act_fd(int act, float x, float &f, float &df)
{
    switch (act) {
    case SMOE_ACT_GEGLU:
    case SMOE_ACT_GELU: {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        const float th = tanhf(k0 * (x + k1 * x * x * x));
        f = 0.5f * x * (1.0f + th);
        df = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * k0 * (1.0f + 3.0f * k1 * x * x);
        break;
    }
    case SMOE_ACT_REGLU:
    case SMOE_ACT_RELU:
        f = fmaxf(x, 0.0f);
        df = x > 0.0f ? 1.0f : 0.0f;
        break;
    case SMOE_ACT_RELU2: {
        const float r = fmaxf(x, 0.0f);
        f = r * r;
        df = 2.0f * r;
        break;
    }
    default: { /* SWIGLU, SILU */
        const float sg = 1.0f / (1.0f + __expf(-x));
        f = x * sg;
        df = sg * (1.0f + x * (1.0f - sg));
    }
    }
}

/* dh's flush, first step: the thread's H values (4 units: 4 (gate, up)
 * pairs or 4 plain values) and scores of its 4 rows t/8 + 16 i, loaded
 * before the staging barrier and before any store (a store may alias them
 * for the compiler, so loads left in the row loop were issued one row at a
 * time, each waiting a full memory latency). */
__device__ __forceinline__ void ep_dh_load(const bf16 *h_in, const float *score, int h_cols,
                                           int gated, int wrow0, int u, int nvalid, int t,
                                           uint4 *hvs, float *ss)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = (t >> 3) + 16 * i;
        hvs[i] = make_uint4(0u, 0u, 0u, 0u);
        ss[i] = 0.0f;
        if (r < nvalid) {
            const int64_t row = wrow0 + r;
            ss[i] = __ldg(score + row);
            if (gated) {
                hvs[i] = __ldg((const uint4 *)(h_in + row * h_cols + 2 * u));
            } else {
                const uint2 h = __ldg((const uint2 *)(h_in + row * h_cols + u));
                hvs[i].x = h.x;
                hvs[i].y = h.y;
            }
        }
    }
}

/* f and f' with the activation known at compile time: no per-element
 * dispatch, and the sigmoid by the fast reciprocal (1-2 ulp in fp32 before
 * the bf16 rounding). */
template <int ACT>
__device__ __forceinline__ void sm90_act_fd_ct(float x, float &f, float &df)
{
    if constexpr (ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_GELU) {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        const float th = tanhf(k0 * (x + k1 * x * x * x));
        f = 0.5f * x * (1.0f + th);
        df = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * k0 * (1.0f + 3.0f * k1 * x * x);
    } else if constexpr (ACT == SMOE_ACT_REGLU || ACT == SMOE_ACT_RELU) {
        f = fmaxf(x, 0.0f);
        df = x > 0.0f ? 1.0f : 0.0f;
    } else if constexpr (ACT == SMOE_ACT_RELU2) {
        const float r = fmaxf(x, 0.0f);
        f = r * r;
        df = 2.0f * r;
    } else { /* SWIGLU, SILU */
        const float sg = __fdividef(1.0f, 1.0f + __expf(-x));
        f = x * sg;
        df = sg * (1.0f + x * (1.0f - sg));
    }
}

/* sm90_act_fd (ACT < 0) or sm90_act_fd_ct<ACT>. */
template <int ACT>
__device__ __forceinline__ void sm90_act_fd_any(int act, float x, float &f, float &df)
{
    if constexpr (ACT < 0) sm90_act_fd(act, x, f, df);
    else sm90_act_fd_ct<ACT>(x, f, df);
}

/* dh's flush body for one thread's 4 rows (after the loads and the staging
 * barrier): per row r and unit u, with dA' staged in fp32 and s = score[r],
 *   gated:     A = f(g) u, dH = (s dA' f'(g) u, s dA' f(g)), A' = s A
 *   non-gated: A = f(h),   dH = s dA' f'(h),                 A' = s A
 * and dS partials <dA', A> summed over the row's 8 threads in a fixed order
 * into dsr[i] (row t/8 + 16 i). ACT < 0: the activation (and gating) from
 * the runtime `act` / `gated`, dispatched per element; ACT >= 0: known at
 * compile time. FULL: all 64 rows of the block are valid, so the rows need
 * no predicate and the compiler can interleave all 16 elements. */
template <int ACT, bool FULL>
__device__ __forceinline__ void ep_dh_rows(const uint8_t *eb, const uint4 *hvs, const float *ss,
                                           bf16 *out_dh, bf16 *out_as, int h_cols, int n,
                                           int gated, int act, int wrow0, int u, int nvalid,
                                           int t, float *dsr)
{
    const bool GATED = ACT < 0 ? gated != 0 : ACT <= SMOE_ACT_REGLU;
    const int v = t & 7;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = (t >> 3) + 16 * i;
        float part = 0.0f;
        if (FULL || r < nvalid) {
            const int64_t row = wrow0 + r;
            const float s = ss[i];
            const float4 da = *(const float4 *)(eb + r * SM90_EP_STRIDE + v * 16);
            const float dav[4] = {da.x, da.y, da.z, da.w};
            float av[4];
            if (GATED) {
                const uint4 hv = hvs[i];
                const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv;
                uint32_t dh_pk[4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float g = __low2float(h2[k]), up = __high2float(h2[k]);
                    float f, df;
                    sm90_act_fd_any<ACT>(act, g, f, df);
                    av[k] = f * up;
                    __nv_bfloat162 o = __floats2bfloat162_rn(s * dav[k] * df * up, s * dav[k] * f);
                    dh_pk[k] = *(uint32_t *)&o;
                }
                *(uint4 *)(out_dh + row * h_cols + 2 * u) =
                    make_uint4(dh_pk[0], dh_pk[1], dh_pk[2], dh_pk[3]);
            } else {
                const uint2 hv = make_uint2(hvs[i].x, hvs[i].y);
                const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv;
                float dhv[4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float x = (k & 1) ? __high2float(h2[k >> 1]) : __low2float(h2[k >> 1]);
                    float f, df;
                    sm90_act_fd_any<ACT>(act, x, f, df);
                    av[k] = f;
                    dhv[k] = s * dav[k] * df;
                }
                __nv_bfloat162 o0 = __floats2bfloat162_rn(dhv[0], dhv[1]);
                __nv_bfloat162 o1 = __floats2bfloat162_rn(dhv[2], dhv[3]);
                *(uint2 *)(out_dh + row * h_cols + u) =
                    make_uint2(*(uint32_t *)&o0, *(uint32_t *)&o1);
            }
            __nv_bfloat162 a0 = __floats2bfloat162_rn(s * av[0], s * av[1]);
            __nv_bfloat162 a1 = __floats2bfloat162_rn(s * av[2], s * av[3]);
            *(uint2 *)(out_as + row * n + u) = make_uint2(*(uint32_t *)&a0, *(uint32_t *)&a1);
            part = dav[0] * av[0] + dav[1] * av[1] + dav[2] * av[2] + dav[3] * av[3];
        }
        /* the row's 8 threads are 8 consecutive lanes */
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        dsr[i] += part;
    }
}

template <int ACT>
__device__ __forceinline__ void ep_dh_rows_any(const uint8_t *eb, const uint4 *hvs,
                                               const float *ss, bf16 *out_dh, bf16 *out_as,
                                               int h_cols, int n, int wrow0, int u, int nvalid,
                                               int t, float *dsr)
{
    if (nvalid >= 64)
        ep_dh_rows<ACT, true>(eb, hvs, ss, out_dh, out_as, h_cols, n, 0, 0, wrow0, u, nvalid, t,
                              dsr);
    else
        ep_dh_rows<ACT, false>(eb, hvs, ss, out_dh, out_as, h_cols, n, 0, 0, wrow0, u, nvalid, t,
                               dsr);
}

/* ep_flush_dh with one activation dispatch per chunk (SM90_FL_DH_CT; the
 * default's per-element switch compiles to an indirect branch per element,
 * notes/sm90_dh_research.md). Same arguments, same results up to the fast
 * sigmoid reciprocal. */
__device__ __noinline__ void ep_flush_dh_ct(const uint8_t *eb, const bf16 *h_in,
                                            const float *score, bf16 *out_dh, bf16 *out_as,
                                            int h_cols, int n, int gated, int act, int wrow0,
                                            int u0, int nvalid, int t, int cw, float *dsr)
{
    const int u = u0 + 4 * (t & 7);
    uint4 hvs[4];
    float ss[4];
    ep_dh_load(h_in, score, h_cols, gated, wrow0, u, nvalid, t, hvs, ss);
    named_barrier_sync(1 + cw, 128);
#define SM90_DH_ROWS(A)                                                                      \
    ep_dh_rows_any<A>(eb, hvs, ss, out_dh, out_as, h_cols, n, wrow0, u, nvalid, t, dsr)
    switch (act) {
    case SMOE_ACT_GEGLU: SM90_DH_ROWS(SMOE_ACT_GEGLU); break;
    case SMOE_ACT_REGLU: SM90_DH_ROWS(SMOE_ACT_REGLU); break;
    case SMOE_ACT_RELU2: SM90_DH_ROWS(SMOE_ACT_RELU2); break;
    case SMOE_ACT_RELU: SM90_DH_ROWS(SMOE_ACT_RELU); break;
    case SMOE_ACT_SILU: SM90_DH_ROWS(SMOE_ACT_SILU); break;
    case SMOE_ACT_GELU: SM90_DH_ROWS(SMOE_ACT_GELU); break;
    default: SM90_DH_ROWS(SMOE_ACT_SWIGLU); break;
    }
#undef SM90_DH_ROWS
    named_barrier_sync(1 + cw, 128);
}

/* dh's flush (the default): dA' for 32 units from u0 staged in fp32 by the
 * warpgroup; H and scores by ep_dh_load, then ep_dh_rows with the runtime
 * activation. */
__device__ __noinline__ void ep_flush_dh(const uint8_t *eb, const bf16 *h_in, const float *score,
                                         bf16 *out_dh, bf16 *out_as, int h_cols, int n, int gated,
                                         int act, int wrow0, int u0, int nvalid, int t, int cw,
                                         float *dsr)
{
    const int u = u0 + 4 * (t & 7);
    uint4 hvs[4];
    float ss[4];
    ep_dh_load(h_in, score, h_cols, gated, wrow0, u, nvalid, t, hvs, ss);
    named_barrier_sync(1 + cw, 128);
    ep_dh_rows<-1, false>(eb, hvs, ss, out_dh, out_as, h_cols, n, gated, act, wrow0, u, nvalid, t,
                          dsr);
    named_barrier_sync(1 + cw, 128);
}

/* ds[r] = the n-tile partials in tile order (+ <dO[tok[r]], b2[e]>). One
 * warp per row; rows past R untouched. */
__global__ void sm90_ds_finish(const float *dsp, int tiles, int64_t cap, const int32_t *off, int E,
                               const int32_t *tok, const bf16 *dout, const bf16 *b2, int d,
                               float *ds)
{
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= cap || r >= __ldg(off + E)) return;
    float dot = 0.0f;
    if (b2) {
        int lo = 0, hi = E;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (__ldg(off + mid) <= r) lo = mid; else hi = mid;
        }
        const bf16 *x = dout + (int64_t)__ldg(tok + r) * d;
        const bf16 *b = b2 + (int64_t)lo * d;
        for (int j = lane * 8; j < d; j += 256) {
            const uint4 xv = *(const uint4 *)(x + j), bv = *(const uint4 *)(b + j);
            const __nv_bfloat162 *xp = (const __nv_bfloat162 *)&xv;
            const __nv_bfloat162 *bp = (const __nv_bfloat162 *)&bv;
#pragma unroll
            for (int k = 0; k < 4; k++)
                dot += __low2float(xp[k]) * __low2float(bp[k]) +
                       __high2float(xp[k]) * __high2float(bp[k]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
    if (lane == 0) {
        float v = 0.0f;
        for (int t = 0; t < tiles; t++) v += dsp[(int64_t)t * cap + r];
        ds[r] = v + dot;
    }
}

/* ------------------------------------------------------------ the kernel */

/* A consumer warpgroup frees a stage: in a cluster, in both CTAs (the peer
 * multicasts its half of the next weight tile into this CTA's stage). */
template <int CL>
__device__ __forceinline__ void sm90_release(uint32_t empty_bar, int rank)
{
    mbar_arrive(empty_bar);
    if constexpr (CL > 1) mbar_arrive_cluster(empty_bar, (uint32_t)(rank ^ 1));
}

template <int BN, int STAGES, int MODE, int FL>
__global__ void __launch_bounds__(SM90_THREADS, 1)
sm90_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b, const sm90_gemm_params p)
{
    typedef sm90_tile_cfg<BN, STAGES> cfg;
    constexpr bool GATHER = (MODE == SM90_MODE_UP || MODE == SM90_MODE_DH);
    /* B stored K x N, N contiguous: W1 for dxt, W2 for dh */
    constexpr bool TRANS_B = (MODE == SM90_MODE_DXT || MODE == SM90_MODE_DH);
    constexpr int NACC = BN / 2;              /* accumulators of one m64 x BN block */
    constexpr bool WS = (FL & SM90_FL_WS) != 0;
    /* gather tokens in registers, loaded once per tile (not reloaded from
     * shared memory per k-block: that dependent chain stalled the producer;
     * notes/sm90_log.md, rung 6) */
    constexpr bool TOKREG = GATHER && !WS;
    constexpr bool PP = (FL & SM90_FL_PP) != 0;
    constexpr int MH = PP ? 2 : 1;            /* m64 blocks per consumer warpgroup */
    static_assert(!PP || BN == 128, "ping-pong tiles are 128 x 128");
    static_assert(!(WS && PP), "the warp-per-stage gather stands alone");
    constexpr int CL = (FL & SM90_FL_CLUSTER) ? 2 : 1; /* CTAs per cluster */
    static_assert(CL == 1 || (!WS && !PP), "clusters with the cooperative kernel only");

    extern __shared__ uint8_t smem_raw[];
    /* 1024-byte aligned base by an offset from smem_raw (not an integer round
     * trip, which loses the shared address space and turns every access
     * through it into a generic LD/ST: notes/sm90_log.md, rung 5) */
    uint8_t *smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    uint8_t *ep_base = smem + STAGES * cfg::STAGE_BYTES; /* 2 x SM90_EP_BYTES */
    uint64_t *full = (uint64_t *)(ep_base + 2 * SM90_EP_BYTES);
    uint64_t *empty = full + STAGES;
    int *tile_start = (int *)(empty + STAGES);
    int32_t *tok_slots = tile_start + SM90_MAX_EXPERTS + 1; /* WS: 2 x 128 tile tokens */

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int nt = (p.N + BN - 1) / BN;
    const int kb_count = p.K / SM90_BK;
    /* CTA crank of cluster cid; tile groups cid, cid + ncl, ... */
    const int crank = CL > 1 ? (int)cluster_ctarank() : 0;
    const int cid = blockIdx.x / CL, ncl = gridDim.x / CL;

    if (tid == 0) {
        tma_prefetch_map(&map_b);
        if (!GATHER) tma_prefetch_map(&map_a);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(smem_addr(full + s), GATHER ? (WS ? 32 : 128) + 1 : 1);
            mbar_init(smem_addr(empty + s), PP ? 1 : 2 * CL);
        }
        mbar_fence_init();
    }
    if (tid < 32) { /* tile_start = exclusive prefix sum of the experts' tile counts */
        int carry = 0;
        for (int e0 = 0; e0 < p.E; e0 += 32) {
            int e = e0 + tid, v = 0;
            if (e < p.E) {
                int cnt = __ldg(p.expert_offset + e + 1) - __ldg(p.expert_offset + e);
                v = (((cnt + SM90_BM - 1) / SM90_BM + CL - 1) / CL) * nt;
            }
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int u = __shfl_up_sync(0xffffffffu, v, o);
                if (tid >= o) v += u;
            }
            if (e < p.E) tile_start[e + 1] = carry + v;
            carry += __shfl_sync(0xffffffffu, v, 31);
        }
        if (tid == 0) tile_start[0] = 0;
    }
    __syncthreads();
    if constexpr (CL > 1) cluster_sync(); /* the peer's barriers are initialised */
    const int total = tile_start[p.E];

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        setmaxnreg_dec<(CL > 1) ? SM90_CLUSTER_PRODUCER_REGS
                                : TOKREG ? SM90_GATHER_PRODUCER_REGS : SM90_PRODUCER_REGS>();
        const uint32_t tx_bytes = GATHER ? cfg::B_BYTES : cfg::A_BYTES + cfg::B_BYTES;
        if constexpr (GATHER && WS) {
            /* Warp-per-stage gather: k-block `it` belongs to producer warp it % 4,
             * which loads the whole A tile of that stage (32 cp.async per lane)
             * and the weight tile, so four stages are in flight on four warps.
             * The tile's 128 gather tokens sit in a double-buffered shared array
             * (one barrier per tile: a buffer is rewritten two tiles later, after
             * every warp has passed the next tile's barrier). */
            const int pw = tid >> 5, lane = tid & 31, chunk = lane & 7;
            int it = 0, nth = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x, nth++) {
                sm90_tile tl = sm90_tile_decode<CL>(t, tile_start, p.E, nt, p.expert_offset, crank);
                int32_t *tokb = tok_slots + 128 * (nth & 1);
                {
                    int r = tl.row0 + tid;
                    tokb[tid] = r < tl.row_end ? __ldg(p.row_token + r) : -1;
                }
                named_barrier_sync(3, 128);
                for (int kb = 0; kb < kb_count; kb++, it++) {
                    if ((it & 3) != pw) continue;
                    const int stage = it % STAGES;
                    const uint32_t phase = (uint32_t)(it / STAGES) & 1;
                    const uint32_t fb = smem_addr(full + stage);
                    const uint32_t sa = smem_addr(smem + stage * cfg::STAGE_BYTES);
                    const uint32_t sb = sa + cfg::A_BYTES;
                    mbar_wait(smem_addr(empty + stage), phase ^ 1);
                    if (lane == 0) {
                        mbar_arrive_expect_tx(fb, tx_bytes);
                        if (p.concat) {
                            int g = tl.e * p.N + tl.n_tile * (BN / 2);
                            tma_load_2d(sb, &map_b, fb, kb * SM90_BK, g);
                            tma_load_2d(sb + cfg::B_BYTES / 2, &map_b, fb, kb * SM90_BK, g + p.n);
                        } else {
                            tma_load_2d(sb, &map_b, fb, kb * SM90_BK, tl.e * p.N + tl.n_tile * BN);
                        }
                    }
                    const bf16 *src0 = p.a_src + kb * SM90_BK + chunk * 8;
#pragma unroll 8
                    for (int i = 0; i < 32; i++) {
                        const int r = (lane >> 3) + 4 * i;
                        const uint32_t dst = sa + r * 128 + ((chunk ^ (r & 7)) << 4);
                        const int32_t ti = tokb[r];
                        cp_async_16(dst, src0 + (int64_t)(ti < 0 ? 0 : ti) * p.K, ti < 0 ? 0u : 16u);
                    }
                    cp_async_mbar_arrive_noinc(fb);
                }
            }
        } else {
        const int chunk = tid & 7, rsub = tid >> 3; /* rows rsub + 16 i, 16-byte chunk */
        int stage = 0;
        uint32_t phase = 0;
        for (int t = cid; t < total; t += ncl) {
            sm90_tile tl = sm90_tile_decode<CL>(t, tile_start, p.E, nt, p.expert_offset, crank);
            /* this thread's 8 gather rows, for the whole tile */
            int32_t tok[8];
            if (GATHER) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int r = tl.row0 + rsub + 16 * i;
                    tok[i] = r < tl.row_end ? __ldg(p.row_token + r) : -1;
                }
            }
            for (int kb = 0; kb < kb_count; kb++) {
                const uint32_t fb = smem_addr(full + stage);
                const uint32_t sa = smem_addr(smem + stage * cfg::STAGE_BYTES);
                const uint32_t sb = sa + cfg::A_BYTES;
                mbar_wait(smem_addr(empty + stage), phase ^ 1);
                if (tid == 0) {
                    mbar_arrive_expect_tx(fb, tx_bytes);
                    if constexpr (CL > 1) {
                        /* this CTA's half of the weight tile, into both CTAs */
                        if constexpr (TRANS_B) {
#pragma unroll
                            for (int j = crank * BN / 128; j < (crank + 1) * BN / 128; j++)
                                tma_load_2d_mc(sb + j * 8192, &map_b, fb, tl.n_tile * BN + 64 * j,
                                               tl.e * p.K + kb * SM90_BK, 3);
                        } else {
                            int g = tl.e * p.N + tl.n_tile * BN + crank * (BN / 2);
                            if (MODE == SM90_MODE_UP && p.concat)
                                g = tl.e * p.N + tl.n_tile * (BN / 2) + crank * p.n;
                            tma_load_2d_mc(sb + crank * (cfg::B_BYTES / 2), &map_b, fb,
                                           kb * SM90_BK, g, 3);
                        }
                    } else if constexpr (TRANS_B) {
                        /* BN/64 boxes of 64 k-rows x 64 n-columns, 8 KiB apart */
#pragma unroll
                        for (int j = 0; j < BN / 64; j++)
                            tma_load_2d(sb + j * 8192, &map_b, fb, tl.n_tile * BN + 64 * j,
                                        tl.e * p.K + kb * SM90_BK);
                    } else if (MODE == SM90_MODE_UP && p.concat) {
                        int g = tl.e * p.N + tl.n_tile * (BN / 2);
                        tma_load_2d(sb, &map_b, fb, kb * SM90_BK, g);
                        tma_load_2d(sb + cfg::B_BYTES / 2, &map_b, fb, kb * SM90_BK, g + p.n);
                    } else {
                        tma_load_2d(sb, &map_b, fb, kb * SM90_BK, tl.e * p.N + tl.n_tile * BN);
                    }
                    if (!GATHER) tma_load_2d(sa, &map_a, fb, kb * SM90_BK, tl.row0);
                }
                if (GATHER) {
                    const bf16 *src0 = p.a_src + kb * SM90_BK + chunk * 8;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        int r = rsub + 16 * i;
                        uint32_t dst = sa + r * 128 + ((chunk ^ (r & 7)) << 4);
                        const int32_t ti = tok[i];
                        const bf16 *src = src0 + (int64_t)(ti < 0 ? 0 : ti) * p.K;
                        cp_async_16(dst, src, ti < 0 ? 0u : 16u);
                    }
                    cp_async_mbar_arrive_noinc(fb);
                }
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
        }
        }
    } else {
        /* ---------------- consumers ---------------- */
        setmaxnreg_inc<(CL > 1) ? SM90_CLUSTER_CONSUMER_REGS
                                : TOKREG ? SM90_GATHER_CONSUMER_REGS : SM90_CONSUMER_REGS>();
        /* cooperative: rows 64 cw .. 64 cw + 63 of every tile; ping-pong: whole
         * tiles, the CTA's tiles j with j % 2 == cw */
        const int cw = wg - 1;
        const int lane = tid & 31, warp = (tid >> 5) & 3;
        const int q = lane & 3;
        float acc[MH * NACC];
        /* ring position of this warpgroup's next k-block: the producer fills
         * kb_count stages per tile, tile after tile */
        uint32_t pos = PP ? (uint32_t)(cw * kb_count) : 0u;
        for (int t = cid + (PP ? cw * ncl : 0); t < total; t += (PP ? 2 : 1) * ncl) {
            sm90_tile tl = sm90_tile_decode<CL>(t, tile_start, p.E, nt, p.expert_offset, crank);
            int prev = 0;
            /* Ping-pong order: a warpgroup starts its main loop only after the
             * other one has waited for the previous tile's last stage. Besides
             * taking turns on the tensor cores, this keeps its full-barrier
             * waits at most one phase ahead of the producer (a parity wait two
             * phases ahead would pass at once). Named barriers 4 (warpgroup 1
             * may go) and 5 (warpgroup 0 may go); an arrival is made only when
             * the other warpgroup has a next tile, so every one is matched. */
            if (PP && t >= ncl) named_barrier_sync(4 + (cw ^ 1), 256);
            if constexpr (MODE == SM90_MODE_DH) {
                /* warm L2 with the H rows this warpgroup's epilogue will read:
                 * two threads per row, 128-byte lines */
                const int hb = (p.gated ? 2 : 1) * tl.n_tile * BN; /* first H column */
                const int hw = min((p.gated ? 2 : 1) * BN, p.h_cols - hb);
#pragma unroll
                for (int mh = 0; mh < MH; mh++) {
                    const int row = tl.row0 + (PP ? mh : cw) * 64 + ((tid & 127) >> 1);
                    if (row < tl.row_end) {
                        const bf16 *hp = p.h_in + (int64_t)row * p.h_cols + hb;
                        for (int j = tid & 1; j * 64 < hw; j += 2) prefetch_l2(hp + j * 64);
                    }
                }
            }
            for (int kb = 0; kb < kb_count; kb++, pos++) {
                const int stage = (int)(pos % STAGES);
                mbar_wait(smem_addr(full + stage), (pos / STAGES) & 1);
                /* cp.async (generic proxy) writes -> wgmma (async proxy) reads
                 * (dropping it measured no gain: rung 6) */
                if (GATHER) fence_proxy_async();
                const uint32_t sa =
                    smem_addr(smem + stage * cfg::STAGE_BYTES) + (PP ? 0 : cw * 64 * 128);
                const uint32_t sb = smem_addr(smem + stage * cfg::STAGE_BYTES) + cfg::A_BYTES;
                wgmma_fence_regs<MH * NACC>(acc);
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < SM90_BK / 16; k++) {
                    /* K-major B steps 32 bytes along its rows; MN-major B steps 16 k-rows */
                    uint64_t db = TRANS_B ? wgmma_desc_sw128_mn(sb + k * 2048, 8192)
                                          : wgmma_desc_sw128(sb + k * 32);
#pragma unroll
                    for (int mh = 0; mh < MH; mh++) {
                        uint64_t da = wgmma_desc_sw128(sa + mh * 64 * 128 + k * 32);
                        if constexpr (BN == 256)
                            wgmma_m64n256k16<TRANS_B ? 1 : 0>(acc, da, db, (kb | k) != 0);
                        else
                            wgmma_m64n128k16<TRANS_B ? 1 : 0>(acc + mh * NACC, da, db,
                                                              (kb | k) != 0);
                    }
                }
                wgmma_commit();
                wgmma_fence_regs<MH * NACC>(acc);
                if (kb > 0) { /* the previous stage's wgmma has retired: release it */
                    wgmma_wait<1>();
                    if ((tid & 127) == 0) sm90_release<CL>(smem_addr(empty + prev), crank);
                }
                prev = stage;
            }
            if (PP) {
                pos += kb_count; /* the other warpgroup's tile */
                if (t + ncl < total) named_barrier_arrive(4 + cw, 256);
            }
            wgmma_wait<0>();
            wgmma_fence_regs<MH * NACC>(acc);
            if ((tid & 127) == 0) sm90_release<CL>(smem_addr(empty + prev), crank);

            /* ---------------- epilogue ----------------
             * Through a per-warpgroup shared buffer, 64 columns at a time: the
             * accumulator layout scatters a warp's stores over 8 rows, so each
             * chunk is written to shared memory first and then stored as whole
             * 128-byte row segments (16 bytes per thread), clipped at the
             * expert's last row. */
            uint8_t *eb = ep_base + cw * SM90_EP_BYTES;
            const int lr = warp * 16 + (lane >> 2); /* this thread's rows lr, lr + 8 in the 64 */
            const int n0 = tl.n_tile * BN;
            const int64_t bo = (int64_t)tl.e * p.N;
#pragma unroll
            for (int mh = 0; mh < MH; mh++) { /* each m64 block of the warpgroup */
            const float *ac = acc + mh * NACC;
            const int wrow0 = tl.row0 + (PP ? mh : cw) * 64; /* first row of the 64 */
            const int nvalid = min(64, tl.row_end - wrow0);
            float dsr[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* dh: dS partials of rows t/8 + 16 i */
#pragma unroll
            for (int c = 0; c < (MODE == SM90_MODE_DH ? BN / 32 : BN / 64); c++) {
                if constexpr (MODE == SM90_MODE_DH) {
                    /* dA' in fp32, 32 units a chunk; the flush does the rest */
                    const int u0 = n0 + 32 * c;
                    if (u0 >= p.N) break;
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) {
                        const int j = 4 * c + jj;
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            *(float2 *)(eb + (lr + 8 * h) * SM90_EP_STRIDE + (8 * jj + 2 * q) * 4) =
                                make_float2(ac[4 * j + 2 * h], ac[4 * j + 2 * h + 1]);
                    }
                    ((FL & SM90_FL_DH_CT) ? ep_flush_dh_ct : ep_flush_dh)(eb, p.h_in, p.score, p.out0, p.out1, p.h_cols, p.n, p.gated,
                                p.act, wrow0, u0, nvalid, tid & 127, cw, dsr);
                    if (c == BN / 32 - 1 || u0 + 32 >= p.N) {
                        /* the row partials of this n-tile, one writer per row */
                        if ((tid & 7) == 0)
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                const int r = ((tid & 127) >> 3) + 16 * i;
                                if (r < nvalid)
                                    p.dsp[(int64_t)tl.n_tile * p.cap + wrow0 + r] = dsr[i];
                            }
                    }
                } else if constexpr (MODE != SM90_MODE_UP) {
                    const int col0 = n0 + 64 * c;
                    if (col0 >= p.N) break;
#pragma unroll
                    for (int jj = 0; jj < 8; jj++) {
                        const int j = 8 * c + jj, col = col0 + 8 * jj + 2 * q;
                        float b0 = load_bias(p.bias, bo + col), b1 = load_bias(p.bias, bo + col + 1);
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            ep_put2(eb, lr + 8 * h, 8 * jj + 2 * q,
                                    ac[4 * j + 2 * h] + b0, ac[4 * j + 2 * h + 1] + b1);
                    }
                    ep_flush<128>(eb, p.out0 + (int64_t)wrow0 * p.N + col0, p.N, nvalid, tid & 127, cw);
                } else {
                    /* The chunk's 64 H columns (bias added, rounded) go to shared
                     * memory in interleaved order; the flush stores them and computes
                     * A from the staged bf16 values in a compact loop. (Unrolling the
                     * activation over all 128 accumulators made the kernel 450 KB of
                     * code, and the epilogue's instruction fetches stalled every warp.)
                     * Concatenated W1: chunk c holds units u0 .. u0 + 31, gates in
                     * accumulator chunks 4c..4c+3 and their ups BN/16 chunks further. */
                    int hc0;
                    if (p.gated && p.concat) {
                        const int u0 = n0 / 2 + 32 * c;
                        if (u0 >= p.n) break;
                        hc0 = 2 * u0;
#pragma unroll
                        for (int jj = 0; jj < 4; jj++) {
                            const int jg = 4 * c + jj, ju = jg + BN / 16, u = u0 + 8 * jj + 2 * q;
                            float bg0 = load_bias(p.bias, bo + u), bg1 = load_bias(p.bias, bo + u + 1);
                            float bu0 = load_bias(p.bias, bo + p.n + u);
                            float bu1 = load_bias(p.bias, bo + p.n + u + 1);
#pragma unroll
                            for (int h = 0; h < 2; h++)
                                ep_put4(eb, lr + 8 * h, 16 * jj + 4 * q, ac[4 * jg + 2 * h] + bg0,
                                        ac[4 * ju + 2 * h] + bu0, ac[4 * jg + 2 * h + 1] + bg1,
                                        ac[4 * ju + 2 * h + 1] + bu1);
                        }
                    } else {
                        hc0 = n0 + 64 * c;
                        if (hc0 >= p.N) break;
#pragma unroll
                        for (int jj = 0; jj < 8; jj++) {
                            const int j = 8 * c + jj, col = hc0 + 8 * jj + 2 * q;
                            float b0 = load_bias(p.bias, bo + col), b1 = load_bias(p.bias, bo + col + 1);
#pragma unroll
                            for (int h = 0; h < 2; h++)
                                ep_put2(eb, lr + 8 * h, 8 * jj + 2 * q, ac[4 * j + 2 * h] + b0,
                                        ac[4 * j + 2 * h + 1] + b1);
                        }
                    }
                    ep_flush_up(eb, p.out0, p.out1, p.N, p.n, p.gated, p.act, wrow0, hc0, nvalid,
                                tid & 127, cw);
                }
            }
            } /* mh */
        }
    }
    /* no CTA leaves while its peer may still multicast into it or arrive on
     * its barriers */
    if constexpr (CL > 1) cluster_sync();
}

/* ------------------------------------------------------------ host side */

static PFN_cuTensorMapEncodeTiled_v12000 sm90_encode_fn(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    if (!fn) {
        void *ptr = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)ptr;
    }
    return fn;
}

/* tensor_map_sm90.h */
extern "C" smoe_status smoe_sm90_make_map(CUtensorMap *map, const void *base, int64_t rows,
                                          int64_t cols, int box_rows, const char *what)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = sm90_encode_fn();
    if (!encode)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 gemm: cuTensorMapEncodeTiled not available "
                                             "from the driver");
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {SM90_BK, (cuuint32_t)box_rows};
    cuuint32_t estr[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box,
                        estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return smoe_fail(SMOE_ERROR_BACKEND,
                         "sm90 gemm: tensor map for %s (%lld x %lld) failed (CUresult %d)", what,
                         (long long)rows, (long long)cols, (int)r);
    return SMOE_SUCCESS;
}

static smoe_status sm90_check_common(const smoe_gemm_problem *p, const char *op)
{
    if (p->d % 64 != 0 || p->n % 64 != 0)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: needs d %% 64 == 0 and n %% 64 == 0 (d=%lld, n=%lld)", op,
                         (long long)p->d, (long long)p->n);
    if (p->E > SM90_MAX_EXPERTS)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 %s: at most %d experts (E=%lld)", op,
                         SM90_MAX_EXPERTS, (long long)p->E);
    if (p->E * p->h_cols > INT32_MAX || p->E * p->d > INT32_MAX || p->cap > INT32_MAX ||
        p->d > INT32_MAX / 2 || p->h_cols > INT32_MAX / 2)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 %s: sizes past 32-bit tile coordinates",
                         op);
    return SMOE_SUCCESS;
}

static int sm90_misaligned(const void *ptr) { return ((uintptr_t)ptr & 15) != 0; }

static int sm90_grid(const smoe_gemm_problem *p, int64_t n_tiles)
{
    int sms = p->num_sms;
    if (sms <= 0) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            sms = 132;
    }
    /* at most ceil(cap/BM) + E m-tiles in all */
    int64_t upper = ((p->cap + SM90_BM - 1) / SM90_BM + p->E) * n_tiles;
    return (int)(upper < sms ? upper : sms);
}

template <int BN, int STAGES, int MODE, int FL>
static smoe_status sm90_launch(const smoe_gemm_problem *p, const CUtensorMap *ma,
                               const CUtensorMap *mb, const sm90_gemm_params *prm, cudaStream_t s,
                               const char *op)
{
    typedef sm90_tile_cfg<BN, STAGES> cfg;
    void (*kern)(const CUtensorMap, const CUtensorMap, const sm90_gemm_params) =
        sm90_grouped_gemm_kernel<BN, STAGES, MODE, FL>;
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           cfg::SMEM_BYTES);
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 %s: cudaFuncSetAttribute: %s", op,
                         cudaGetErrorString(err));
    int grid = sm90_grid(p, (prm->N + BN - 1) / BN);
    if (grid <= 0) return SMOE_SUCCESS;
    if constexpr ((FL & SM90_FL_CLUSTER) != 0) {
        /* pairs of CTAs, no more than can be resident at once (the
         * schedule is static: a pair started late would run its tiles last) */
        cudaLaunchConfig_t lc;
        memset(&lc, 0, sizeof(lc));
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 2;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        lc.blockDim = dim3(SM90_THREADS, 1, 1);
        lc.dynamicSmemBytes = cfg::SMEM_BYTES;
        lc.stream = s;
        lc.attrs = at;
        lc.numAttrs = 1;
        static int max_clusters = 0; /* per instantiation, from the occupancy API */
        if (max_clusters == 0) {
            lc.gridDim = dim3((unsigned)(grid & ~1) > 0 ? (unsigned)(grid & ~1) : 2u, 1, 1);
            err = cudaOccupancyMaxActiveClusters(&max_clusters, kern, &lc);
            if (err != cudaSuccess || max_clusters <= 0)
                return smoe_fail(SMOE_ERROR_BACKEND, "sm90 %s: no 2-CTA cluster fits (%s)", op,
                                 cudaGetErrorString(err));
        }
        grid = grid < 2 ? 2 : grid & ~1;
        if (grid > 2 * max_clusters) grid = 2 * max_clusters;
        lc.gridDim = dim3((unsigned)grid, 1, 1);
        err = cudaLaunchKernelEx(&lc, kern, *ma, *mb, *prm);
    } else {
        kern<<<grid, SM90_THREADS, cfg::SMEM_BYTES, s>>>(*ma, *mb, *prm);
        err = cudaGetLastError();
    }
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 %s: launch failed: %s", op,
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

/* Benchmark hook for tests/gpu/test_gemm_sm90.cu and smoe_bench
 * --sm90-variant: 0 runs the tile table. Bits 0-1: 1 forces up's wide
 * configuration, 2 its narrow one; the SM90_VAR_* bits below switch on
 * kernels that are not in the tile table (notes/sm90_log.md). */
extern "C" int smoe_sm90_gemm_variant;
int smoe_sm90_gemm_variant = 0;
enum {
    SM90_VAR_UP_PP = 16,
    SM90_VAR_DH_PP = 32,
    SM90_VAR_CLUSTER = 128, /* 2-CTA clusters with weight multicast, BN = 256 kernels */
    SM90_VAR_DH_BN128 = 256, /* dh in 128 x 128 cooperative tiles, 6 stages (not yet timed) */
    SM90_VAR_DH_CT = 512     /* dh, BN = 256: SM90_FL_DH_CT (not yet timed) */
};

static int sm90_dh_bn(const smoe_gemm_problem *p)
{
    return (p->n >= 256 && !(smoe_sm90_gemm_variant & (SM90_VAR_DH_PP | SM90_VAR_DH_BN128)))
               ? 256
               : 128;
}

/* dh's partial dS sums: (ceil(n / BN), cap) fp32, sized for BN = 128 so that
 * every dh configuration fits. */
static size_t sm90_scratch_bytes(const smoe_gemm_problem *p)
{
    return (size_t)((p->n + 127) / 128) * (size_t)p->cap * sizeof(float);
}

/* The parameters every mode shares; the launchers fill in the rest. */
static sm90_gemm_params sm90_params(const smoe_gemm_problem *p, int64_t K, int64_t N)
{
    sm90_gemm_params prm;
    memset(&prm, 0, sizeof(prm));
    prm.expert_offset = p->expert_offset;
    prm.row_token = p->row_token;
    prm.E = (int)p->E;
    prm.K = (int)K;
    prm.N = (int)N;
    prm.n = (int)p->n;
    prm.cap = p->cap;
    prm.h_cols = (int)p->h_cols;
    return prm;
}

static smoe_status sm90_up(const smoe_gemm_problem *p, const bf16 *x, const bf16 *w1,
                           const bf16 *b1, bf16 *h, bf16 *a, void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "up"));
    if (sm90_misaligned(x) || sm90_misaligned(w1) || sm90_misaligned(h) || sm90_misaligned(a))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 up: x, w1, h, a must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    sm90_gemm_params prm = sm90_params(p, p->d, p->h_cols);
    prm.a_src = x;
    prm.bias = b1;
    prm.out0 = h;
    prm.out1 = a;
    prm.gated = p->gated;
    prm.act = (int)p->act;
    prm.concat = p->gated && p->w1_layout == SMOE_W1_CONCATENATED;
    /* tile table: BN=256 with the 128-thread gather wherever H has 256+
     * columns (measured best on every grid shape, notes/sm90_log.md); BN=128,
     * 6 stages, one producer warp per stage below that. The variant hook
     * forces one of them (1: BN=256, 2: BN=128). */
    const int v = smoe_sm90_gemm_variant;
    const int pp = (v & SM90_VAR_UP_PP) != 0;
    const int wide = !pp && ((v & 3) == 1 || ((v & 3) == 0 && p->h_cols >= 256));
    const int bn = wide ? 256 : 128;
    const int cl = wide && (v & SM90_VAR_CLUSTER);
    CUtensorMap mb;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w1, p->E * p->h_cols, p->d,
                                        (prm.concat || cl) ? bn / 2 : bn, "w1"));
    if (cl)
        return sm90_launch<256, 4, SM90_MODE_UP, SM90_FL_CLUSTER>(p, &mb, &mb, &prm, s, "up");
    if (pp) return sm90_launch<128, 6, SM90_MODE_UP, SM90_FL_PP>(p, &mb, &mb, &prm, s, "up");
    if (wide) return sm90_launch<256, 4, SM90_MODE_UP, 0>(p, &mb, &mb, &prm, s, "up");
    return sm90_launch<128, 6, SM90_MODE_UP, SM90_FL_WS>(p, &mb, &mb, &prm, s, "up");
}

static smoe_status sm90_down(const smoe_gemm_problem *p, const bf16 *a, const bf16 *w2,
                             const bf16 *b2, bf16 *y, void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "down"));
    if (sm90_misaligned(a) || sm90_misaligned(w2) || sm90_misaligned(y))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 down: a, w2, y must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    sm90_gemm_params prm = sm90_params(p, p->n, p->d);
    prm.bias = b2;
    prm.out0 = y;
    const int bn = p->d >= 256 ? 256 : 128;
    CUtensorMap ma, mb;
    const int cl = bn == 256 && (smoe_sm90_gemm_variant & SM90_VAR_CLUSTER);
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&ma, a, p->cap, p->n, SM90_BM, "a"));
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w2, p->E * p->d, p->n, cl ? bn / 2 : bn, "w2"));
    if (cl)
        return sm90_launch<256, 4, SM90_MODE_DOWN, SM90_FL_CLUSTER>(p, &ma, &mb, &prm, s, "down");
    if (bn == 256) return sm90_launch<256, 4, SM90_MODE_DOWN, 0>(p, &ma, &mb, &prm, s, "down");
    return sm90_launch<128, 6, SM90_MODE_DOWN, 0>(p, &ma, &mb, &prm, s, "down");
}

static smoe_status sm90_dxt(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *w1, bf16 *dxt,
                            void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "dxt"));
    if (p->gated && p->w1_layout == SMOE_W1_CONCATENATED)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "sm90 dxt: the concatenated W1 layout is not supported (its rows are not "
                         "in dH's column order)");
    if (sm90_misaligned(dh) || sm90_misaligned(w1) || sm90_misaligned(dxt))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 dxt: dh, w1, dxt must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    sm90_gemm_params prm = sm90_params(p, p->h_cols, p->d);
    prm.out0 = dxt;
    const int bn = p->d >= 256 ? 256 : 128;
    CUtensorMap ma, mb;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&ma, dh, p->cap, p->h_cols, SM90_BM, "dh"));
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w1, p->E * p->h_cols, p->d, 64, "w1"));
    if (bn == 256 && (smoe_sm90_gemm_variant & SM90_VAR_CLUSTER))
        return sm90_launch<256, 4, SM90_MODE_DXT, SM90_FL_CLUSTER>(p, &ma, &mb, &prm, s, "dxt");
    if (bn == 256) return sm90_launch<256, 4, SM90_MODE_DXT, 0>(p, &ma, &mb, &prm, s, "dxt");
    return sm90_launch<128, 6, SM90_MODE_DXT, 0>(p, &ma, &mb, &prm, s, "dxt");
}

/* The weight-gradient GEMMs (varlen-K) are in varlen_k_sm90.cu. */
extern "C" smoe_status smoe_sm90_dw2(const smoe_gemm_problem *p, const bf16 *dout,
                                     const bf16 *a_scaled, void *dw2, smoe_dtype out_dtype,
                                     int accumulate, void *scratch, cudaStream_t s);
extern "C" smoe_status smoe_sm90_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                                     void *dw1, smoe_dtype out_dtype, int accumulate,
                                     void *scratch, cudaStream_t s);

static smoe_status sm90_dh(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *w2,
                           const bf16 *b2, const bf16 *h, bf16 *dh, bf16 *a_scaled, float *ds,
                           void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "dh"));
    if (sm90_misaligned(dout) || sm90_misaligned(w2) || sm90_misaligned(h) ||
        sm90_misaligned(dh) || sm90_misaligned(a_scaled) || sm90_misaligned(b2))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "sm90 dh: dout, w2, b2, h, dh, a_scaled must be 16-byte aligned");
    if (!scratch || !p->row_score)
        return smoe_fail(SMOE_ERROR_INTERNAL, "sm90 dh: scratch and row_score are required");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    sm90_gemm_params prm = sm90_params(p, p->d, p->n);
    prm.a_src = dout;
    prm.out0 = dh;
    prm.out1 = a_scaled;
    prm.gated = p->gated;
    prm.act = (int)p->act;
    prm.h_in = h;
    prm.score = p->row_score;
    prm.dsp = (float *)scratch;
    const int bn = sm90_dh_bn(p);
    CUtensorMap mb;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w2, p->E * p->d, p->n, 64, "w2"));
    smoe_status st;
    if (bn == 256 && (smoe_sm90_gemm_variant & SM90_VAR_DH_CT))
        st = sm90_launch<256, 4, SM90_MODE_DH, SM90_FL_DH_CT>(p, &mb, &mb, &prm, s, "dh");
    else if (bn == 256 && (smoe_sm90_gemm_variant & SM90_VAR_CLUSTER))
        st = sm90_launch<256, 4, SM90_MODE_DH, SM90_FL_CLUSTER>(p, &mb, &mb, &prm, s, "dh");
    else if (bn == 256)
        st = sm90_launch<256, 4, SM90_MODE_DH, 0>(p, &mb, &mb, &prm, s, "dh");
    else if (smoe_sm90_gemm_variant & SM90_VAR_DH_PP)
        st = sm90_launch<128, 6, SM90_MODE_DH, SM90_FL_PP>(p, &mb, &mb, &prm, s, "dh");
    else
        st = sm90_launch<128, 6, SM90_MODE_DH, 0>(p, &mb, &mb, &prm, s, "dh");
    SMOE_FORWARD_IF_ERROR(st);
    const int tiles = (int)((p->n + bn - 1) / bn);
    sm90_ds_finish<<<(unsigned)((p->cap + 7) / 8), 256, 0, s>>>(
        (const float *)scratch, tiles, p->cap, p->expert_offset, (int)p->E, p->row_token, dout, b2,
        (int)p->d, ds);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 dh: dS reduction launch failed: %s",
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

extern "C" const smoe_gemm_ops smoe_gemm_ops_sm90 = {
    /* name          */ "tma+wgmma",
    /* scratch_bytes */ sm90_scratch_bytes,
    /* up            */ sm90_up,
    /* down          */ sm90_down,
    /* dh            */ sm90_dh,
    /* dw2           */ smoe_sm90_dw2,
    /* dxt           */ sm90_dxt,
    /* dw1           */ smoe_sm90_dw1,
};
