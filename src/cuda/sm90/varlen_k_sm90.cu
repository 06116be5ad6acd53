/*
 * varlen_k_sm90.cu -- the weight-gradient grouped GEMMs on Hopper (sm_90a):
 * the dw2 and dw1 entries of gemm.h, exported as smoe_sm90_dw2/_dw1.
 *
 *   dW2[e] (d, n)      = sum over rows r of e of dO[row_token[r]]^T a_scaled[r]
 *   dW1[e] (h_cols, d) = sum over rows r of e of dH[r]^T X[row_token[r]],
 *                        logical row c stored at physical row smoe_w1_row(c)
 *
 * Both are C_e (M x N) = A_e^T B_e with the reduction over the expert's rows
 * ("varlen-K"): A_e is (count_e x M), B_e is (count_e x N), both row-major,
 * so both operands are MN-major in shared memory and wgmma reads them with
 * its transpose bits set. One operand is gathered by token along K (dO for
 * dW2: A; X for dW1: B), the other is a contiguous slice of rows (a_scaled,
 * dH). bf16-overwrite dW1 (the layer's) is computed as dW1[e]^T = X^T dH
 * instead, so that X is gathered on the 128-wide M side as dO is for dW2
 * (gathering the 256-wide side cost 10-15%: notes/sm90_log.md rung 11),
 * and each tile is stored transposed (vk_store_tile_bf16_t).
 *
 * Algorithm: a persistent, warp-specialised kernel. The tile scheduler
 * (scheduler_sm90.cuh's varlen-K one) walks the OUTPUT tiles (expert,
 * m-tile, n-tile), whose number the host knows (E * ceil(M/128) *
 * ceil(N/BN); BN = 256, 192 or 128: vk_bn), so the
 * grid is static; the k-loop length of a tile,
 * ceil(count_e / 64), is read on the device from expert_offset, and any
 * count (0 included) works: rows past the expert's end are zero-filled.
 *   - warpgroup 0 (producer, 56 registers): the gathered operand by 16-byte
 *     cp.async into the 128B-swizzled MN-major layout (a 64-column slab is
 *     64 k-rows of 128 bytes; chunk c of k-row r lands at r*128 +
 *     ((c ^ r%8)*16)). Thread 8g + q copies chunk q of every slab for k-rows
 *     4g..4g+3, so a warp instruction moves 4 rows x 128 contiguous bytes and
 *     a thread needs 4 row tokens per stage. The tokens come TOK_AHEAD
 *     k-iterations early, by 4-byte cp.async into a small shared-memory ring
 *     (a slot: the stage's 64 tokens in row order): a token load issued just
 *     before its use waits behind the earlier stages' copies in the memory
 *     pipeline, which made the first version 1.8x slower. A warp's 16 rows
 *     are its own: lanes 0-15 copy their tokens (64 contiguous bytes, one
 *     shared-memory wavefront), and after cp.async.wait_group and a warp
 *     barrier each thread reads its 4 with one 16-byte load. (Each thread
 *     copying its own 4 tokens into its own slots, as before, took four
 *     4-byte copies a thread at a 16-byte stride: 17% of the kernel's
 *     shared-memory wavefronts were those copies' bank conflicts, ncu at
 *     gpt-oss-120b, notes/sm90_log.md rung 34.)
 *     The contiguous operand comes by TMA (one 64-column x 64-row box per
 *     slab, issued by thread 0 with the stage's expect_tx) on every whole
 *     k-tile of the expert; only its last, partial k-tile goes by zero-filling
 *     cp.async, so no row past the expert's end (or past R) is read.
 *     Completion: the stage's full mbarrier counts the 128 threads'
 *     cp.async.mbarrier.arrive.noinc plus thread 0's arrival with the TMA
 *     bytes. Per-tile work (tile coordinates, column bases, the contiguous
 *     operand's row pointer) is done once per tile, and on whole k-tiles a
 *     gathered row costs one wide multiply-add before its copies: the
 *     producer's instruction stream, about 465 instructions per stage in the
 *     first version, was what held the pipeline back (notes/
 *     sm90_varlenk_log.md).
 *   - warpgroups 1 and 2 (consumers, 224 registers): each owns 64 rows of
 *     the 128-row M tile and runs wgmma m64nBNk16 (fp32 accumulators in
 *     registers) over the stage, releasing the previous stage through the
 *     empty mbarrier once its wgmma group retired (wait_group 1). No
 *     fence.proxy.async between the full-barrier wait and the wgmma reads of
 *     the cp.async data (CUTLASS's cp.async wgmma mainloop and QuACK omit it
 *     too; VK_F_NOFENCE below; the fenced variant measured 4-7% slower at
 *     the 120B shapes).
 *   - a ring of 4 stages of 64 k-rows; the producer runs ahead into the next
 *     tile while the consumers store the current one.
 *   - optionally (VK_F_CLM, the table's cluster-m rows) in clusters of two
 *     CTAs that take m-tiles 2i and 2i + 1 of one (expert, n-tile) and
 *     share its N-side tile by TMA multicast, each loading half its slabs.
 *   - where the staged tile runs 192 wide without pairs (VK_F_M256:
 *     gpt-oss-120b's d = 2880 among the benchmark's rows), 256-row M tiles:
 *     each consumer warpgroup owns 128 rows in two m64 accumulator sets,
 *     in 3 stages, so per flop 30% fewer bytes are loaded into the SM.
 * Epilogue: through a 2 KB shared-memory buffer per consumer warp, so that
 * global stores (and, for accumulate, loads of the old values, read a few
 * pieces ahead and warmed in L2 at the tile's start) are 16-byte row pieces
 * of 128 contiguous bytes; fp32 or bf16 output, the sum with the old value
 * formed in fp32; bf16 overwrite rounds into the buffer instead, so its row
 * pieces are 128 bytes too. Tiles of experts without rows write zeros
 * (overwrite) or nothing (accumulate).
 *
 * Numerics: bf16 products exact in fp32, fp32 accumulation by the tensor
 * cores in a fixed order. Deterministic: every output tile is owned by one
 * CTA; no atomics.
 *
 * Limits: d and n multiples of 64 (so rows are 16-byte aligned and M/N tiles
 * split into whole 64-column slabs); partial tiles are zero-filled on load and
 * clipped on store.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cuda/gemm.h"
#include "cuda/sm90/ptx_sm90.cuh"
#include "cuda/sm90/scheduler_sm90.cuh"
#include "cuda/sm90/tensor_map_sm90.h"

using namespace smoe_sm90;

#define VK_BM 128               /* M tile: two consumer warpgroups x 64 rows */
#define VK_THREADS 384          /* producer + 2 consumer warpgroups */
#define VK_EPI_BUF_BYTES (16 * 128) /* per consumer warp: 16 rows x 32 fp32 */
#define VK_PRODUCER_REGS 56
#define VK_CONSUMER_REGS 224

/* Kernel shape (bits of the CFG template parameter; one value ships,
 * VK_DEFAULT_CFG: the variants without these bits measured slower in
 * notes/sm90_varlenk_log.md and are in the history up to commit 3a13394).
 *   VK_F_TMA:     the contiguous operand by TMA on the expert's whole k-tiles
 *                 (cp.async only for its last, partial one);
 *   VK_F_NOFENCE: no fence.proxy.async after the consumers' full-barrier
 *                 wait (as CUTLASS's cp.async wgmma mainloop and QuACK do).
 * Two flags measured in the same runs were removed after them: VK_F_LEAN
 * (8; the producer with its per-tile work hoisted, about 4x fewer
 * instructions per stage) is now the only producer, so the measured variant
 * 11 is today's 3 and 9 is 1; 32 k-rows x 8 stages was 5-20% slower. */
#define VK_F_TMA 1
#define VK_F_NOFENCE 2
#define VK_DEFAULT_CFG (VK_F_TMA | VK_F_NOFENCE)
/* The grouped tile order (sm90_vk_tile_decode; the table's grouped row): a
 * compile-time bit, as the run-time branch cost the row order 1-3% of the
 * layer's backward on every grid row. */
#define VK_F_GROUPED 4
/* bf16 overwrite (the layer's dW1 and dW2) through a staging copy of the
 * whole tile stored by TMA (vk_stage_tile, vk_store_staged): the consumers
 * round the tile into shared memory and go on to the next tile's MMAs
 * while the TMA engine writes it out, where the other epilogues keep them
 * storing; with 128 x 256 tiles the staging (64 KiB) leaves room for 3
 * stages. Only with A gathered (the layer's bf16 dW1 is X^T dH). */
#define VK_F_TMA_ST 8
/* Pairs along M (clusters of two CTAs): the pair's CTAs take m-tiles 2i
 * and 2i + 1 of one (expert, n-tile) and share its N-side tile, which
 * comes by TMA (whole k-tiles), each CTA loading half of its 64-column
 * slabs into both by multicast: per stage a CTA reads 16 + 16 KiB from L2
 * instead of 16 + 32 (128 x 256 tiles). The gathered M side stays each
 * CTA's own. Each CTA's empty barriers count both CTAs' consumer warps
 * (the peer's multicast writes this CTA's stage). Only with A gathered
 * (the N-side operand contiguous): the layer's dW2 and bf16 dW1^T. */
#define VK_F_CLM 16
/* 256-row M tiles: each consumer warpgroup holds 128 rows in two m64
 * accumulator sets (2 x BN / 2 registers); 3 stages of 256 + BN columns x
 * 64 k-rows; the staged epilogue goes one m64 block per warpgroup at a
 * time (the same 2 x 64 x BN staging as the 128-row tile). Per flop, the
 * loads into the SM (L2 reads and shared-memory writes) drop by 30% at
 * BN = 192; the MMAs' shared-memory reads stay. Only with TMA_ST, A
 * gathered, no pairs, BN = 192 (vk_run says where it runs and why). */
#define VK_F_M256 512

template <int BN, int CFG>
struct vk_cfg {
    static constexpr int BK = 64;                    /* k-rows per stage */
    static constexpr bool TMA_ST = (CFG & VK_F_TMA_ST) != 0;
    static constexpr bool M256 = (CFG & VK_F_M256) != 0;
    static constexpr int BM = M256 ? 256 : VK_BM;   /* M tile */
    static constexpr int MB = BM / 128;              /* m64 blocks per consumer warpgroup */
    static constexpr int ACC1 = M256 ? BN / 2 : 1;   /* the second block's accumulators (else unused) */
    static constexpr int STAGES = M256 || (TMA_ST && BN == 256) ? 3 : 4;
    static constexpr int STG_BYTES = TMA_ST ? 128 * BN * 2 : 0; /* the staged tile (an m64 block a warpgroup) */
    static constexpr int PREGS = M256 ? 40 : VK_PRODUCER_REGS;
    static constexpr int CREGS = M256 ? 232 : VK_CONSUMER_REGS;
    static_assert(!M256 || (TMA_ST && BN == 192 && (CFG & VK_F_CLM) == 0), "M256: staged, BN = 192, no pairs");
    static_assert(PREGS * 128 + 2 * CREGS * 128 <= SM90_LAUNCH_REGS * VK_THREADS, "setmaxnreg budget");
    static constexpr int RPT = BK / 16;              /* k-rows per producer thread */
    static constexpr int TOK_AHEAD = STAGES - 1;     /* k-iterations the row tokens run ahead */
    static constexpr int TOK_SLOTS = TOK_AHEAD + 1;
    static constexpr int TOK_SLOT_BYTES = BK * 4;    /* the stage's tokens in row order */
    static constexpr bool TMA = (CFG & VK_F_TMA) != 0;
    static constexpr bool FENCE = (CFG & VK_F_NOFENCE) == 0;
    static constexpr int CL = (CFG & VK_F_CLM) ? 2 : 1; /* CTAs per cluster */
    static_assert(RPT == 4, "a producer thread reads its 4 tokens as one vector");
};

template <int BN, int CFG>
static constexpr size_t vk_smem_bytes()
{
    typedef vk_cfg<BN, CFG> C;
    return (size_t)C::STAGES * (C::BK * C::BM * 2 + C::BK * BN * 2) + 1024 + 128 +
           (size_t)C::TOK_SLOTS * C::TOK_SLOT_BYTES +
           (C::TMA_ST ? (size_t)C::STG_BYTES : 8 * VK_EPI_BUF_BYTES);
}

/* inside the launch allocation (SM90_LAUNCH_REGS x 384, ptx_sm90.cuh),
 * or setmaxnreg.inc waits forever (notes/sm90_log.md rung 32 item 3) */
static_assert(VK_PRODUCER_REGS * 128 + 2 * VK_CONSUMER_REGS * 128 <= SM90_LAUNCH_REGS * VK_THREADS,
              "setmaxnreg budget past the launch allocation");

typedef struct vk_args {
    const bf16 *a;                 /* (rows or T, M) row-major: M-side operand */
    const bf16 *b;                 /* (rows or T, N) row-major: N-side operand */
    const int32_t *expert_offset;  /* (E+1) */
    const int32_t *row_token;      /* (cap) */
    void *out;                     /* (E, M, N) fp32 or bf16 */
    int M, N;
    sm90_vk_sched sched;           /* the output tiles (scheduler_sm90.cuh) */
    int out_f32, accumulate;
    int map_rows;                  /* 1: logical row c -> smoe_w1_row (concatenated W1) */
    int n_half;                    /* n, for that map */
    int trans_out;                 /* 1: out is (E, N, M), the tile stored transposed
                                    * (bf16 overwrite; map_rows then maps columns) */
    const int *abort;              /* smoe_gemm_problem.abort */
    int rotate;                    /* 1: the waves' tiles rotated (vk_slot_tile) */
} vk_args;

/* ------------------------------------------------------------ wgmma, both operands MN-major */

template <int BN>
static __device__ __forceinline__ void vk_wgmma_mn(float *d, uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d)
{
    if constexpr (BN == 256) wgmma_m64n256k16<1, 1>(d, desc_a, desc_b, scale_d);
    else if constexpr (BN == 192) wgmma_m64n192k16<1, 1>(d, desc_a, desc_b, scale_d);
    else wgmma_m64n128k16<1, 1>(d, desc_a, desc_b, scale_d);
}

/* ------------------------------------------------------------ kernel */

/* A cluster's tiles (a cluster: one CTA, or a pair with VK_F_CLM, whose
 * tiles are then units of two m-tiles): slots c + j G, j = 0, 1, ..., for
 * cluster c of G. Slot s is tile s, or with p.rotate, in wave j, tile j G
 * + (b + j) mod G (b = s - j G): each wave still runs G consecutive tiles (the
 * same operands in L2) but no CTA keeps the same place in the waves. In
 * the plain order, where the last n-tile is partial and tiles_n divides G,
 * the CTAs whose place is that cheap tile every time ran ahead of the
 * others, and the tiles in flight spread over more experts (GLM-4.5-Air's
 * dw2, 6 n-tiles of 256 for N = 1408 on 22 x 6 CTAs: L2 hit rate 78%
 * against 86% at Qwen3-235B-A22B's N = 1536 with as many tiles, SMs idle
 * 13% of the time, 2.99 against 2.57 ms; rotated 2.68: ncu and bench_gemm,
 * notes/sm90_log.md rung 21). Everywhere else the rotation measured 1-15%
 * slower (every other model's dw1 and dw2), so vk_run asks for it only
 * there. The last wave's slots past the tiles hold none. */
static __device__ __forceinline__ int vk_slot_tile(int s, int rotate, int g)
{
    const int j = s / g;
    return rotate ? j * g + (s - j * g + j) % g : s;
}

/* The end of the slots: whole waves covering the tiles. */
static __device__ __forceinline__ int vk_slot_end(int total, int g)
{
    return (total + g - 1) / g * g;
}

/* This CTA's cluster and the number of clusters (CL CTAs each, consecutive
 * in blockIdx.x: a 1-D cluster launch). */
template <int CL>
static __device__ __forceinline__ int vk_cid()
{
    return (int)blockIdx.x / CL;
}
template <int CL>
static __device__ __forceinline__ int vk_ncl()
{
    return (int)gridDim.x / CL;
}

/* The producer's walk over its (tile, k-tile) iterations, skipping tiles of
 * experts without rows (and the last wave's empty slots); one cursor issues
 * the copies, a second one runs TOK_AHEAD iterations ahead fetching row
 * tokens. */
typedef struct vk_cursor {
    int slot, kt, nk, row_begin, row_end;
    int ncl; /* clusters: the slots' step */
} vk_cursor;

template <int BK>
static __device__ __forceinline__ void vk_cursor_load(const vk_args &p, vk_cursor *c)
{
    c->kt = 0;
    c->nk = 0;
    const int tile = vk_slot_tile(c->slot, p.rotate, c->ncl);
    if (tile >= p.sched.total) return;
    const int e = sm90_vk_tile_decode(p.sched, tile, false).e; /* either order's */
    c->row_begin = __ldg(p.expert_offset + e);
    c->row_end = __ldg(p.expert_offset + e + 1);
    c->nk = c->row_end > c->row_begin ? (c->row_end - c->row_begin + BK - 1) / BK : 0;
}

/* Moves to the first iteration at or after the current one that exists. */
template <int BK>
static __device__ __forceinline__ void vk_cursor_settle(const vk_args &p, vk_cursor *c)
{
    const int end = vk_slot_end(p.sched.total, c->ncl);
    while (c->slot < end && c->kt >= c->nk) {
        c->slot += c->ncl;
        vk_cursor_load<BK>(p, c);
    }
}

template <int BK>
static __device__ __forceinline__ void vk_cursor_start(const vk_args &p, vk_cursor *c, int cid,
                                                       int ncl)
{
    c->slot = cid;
    c->ncl = ncl;
    vk_cursor_load<BK>(p, c);
    vk_cursor_settle<BK>(p, c);
}

template <int BK>
static __device__ __forceinline__ void vk_cursor_next(const vk_args &p, vk_cursor *c)
{
    c->kt++;
    vk_cursor_settle<BK>(p, c);
}

/* Producer thread t = 8 g + q owns k-rows RPT g .. RPT g + RPT-1 of a stage
 * and, in each 64-column slab, the 16-byte chunk q: one warp instruction
 * moves 4 rows x 128 contiguous bytes, and a thread needs only RPT row
 * tokens per stage, all in its warp's 16 rows (warp w: rows 16 w ..). Lane
 * l < 16 of warp w copies the token of row 16 w + l into the slot (row
 * order); rows past the expert's end are left as they are (their copies
 * are zero-filled or not made). */
template <int BK>
static __device__ __forceinline__ void vk_fetch_tokens(const vk_args &p, const vk_cursor &c,
                                                       uint32_t slot, int t)
{
    static_assert(BK == 64, "a warp's 16 rows: 4 producer warps x 16 = BK");
    const int r = 16 * (t / 32) + t % 32;
    const int row = c.row_begin + c.kt * BK + r;
    if (t % 32 < 16 && row < c.row_end) cp_async_4(slot + 4 * r, p.row_token + row);
}

/* One operand's stage: BK k-rows x W columns from column col0; k-row r is
 * source row src_row[r - RPT g] (a token or the row itself), zero-filled past
 * the expert's end or the matrix's last column. */
template <int W, int BK>
static __device__ __forceinline__ void vk_copy_operand(uint32_t sdst, const bf16 *src, int ld,
                                                       int col0, int ncols, const int *src_row,
                                                       int rows_left, int g, int q)
{
    constexpr int RPT = BK / 16;
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int r = RPT * g + i;
        const bool row_ok = r < rows_left;
        const bf16 *rowp = src + (size_t)(row_ok ? src_row[i] : 0) * (size_t)ld + col0 + 8 * q;
        const uint32_t dst = sdst + (uint32_t)r * 128 + ((uint32_t)(q ^ (r & 7)) << 4);
#pragma unroll
        for (int sl = 0; sl < W / 64; sl++) {
            const bool ok = row_ok && col0 + 64 * sl < ncols;
            cp_async_16(dst + sl * BK * 128, ok ? rowp + 64 * sl : src, ok ? 16u : 0u);
        }
    }
}

/* The contiguous operand's stage by TMA (whole k-tiles only: every row is
 * the expert's): one box of 64 columns x BK rows per 64-column slab inside
 * the matrix; slabs past its last column are not loaded (they only feed
 * output rows/columns the epilogue clips). Returns the bytes issued.
 * In a pair (CL = 2, VK_F_CLM) the stage is shared: each CTA's barrier
 * expects every slab's bytes and this CTA (rank) loads the slabs sl with
 * sl % 2 == rank into both CTAs by multicast. */
template <int W, int BK, int CL>
static __device__ __forceinline__ uint32_t vk_tma_operand(uint32_t sdst, const CUtensorMap *map,
                                                          uint32_t bar, int col0, int ncols,
                                                          int row0, int rank)
{
    uint32_t bytes = 0;
#pragma unroll
    for (int sl = 0; sl < W / 64; sl++)
        if (col0 + 64 * sl < ncols) bytes += BK * 128;
    mbar_arrive_expect_tx(bar, bytes);
#pragma unroll
    for (int sl = 0; sl < W / 64; sl++) {
        if (col0 + 64 * sl >= ncols) continue;
        if constexpr (CL == 1)
            tma_load_2d(sdst + sl * BK * 128, map, bar, col0 + 64 * sl, row0);
        else if ((sl & 1) == rank)
            tma_load_2d_mc(sdst + sl * BK * 128, map, bar, col0 + 64 * sl, row0, 3);
    }
    return bytes;
}

/* A consumer warp's release of a stage: its own CTA's empty barrier and,
 * in a pair, the peer's (whose producer multicasts into this stage). */
template <int CL>
static __device__ __forceinline__ void vk_release(uint32_t bar, int rank)
{
    mbar_arrive(bar);
    if constexpr (CL > 1) mbar_arrive_remote(bar, (uint32_t)(rank ^ 1));
}

/* The stored row of logical dW1 row c (gemm.h's smoe_w1_row; map_rows: the
 * concatenated W1 layout, gate rows first, then the up rows). */
static __device__ __forceinline__ int vk_w1_row(const vk_args &p, int c)
{
    return p.map_rows ? (int)smoe_w1_row(c, p.n_half, 1, SMOE_W1_CONCATENATED) : c;
}

/* Warms L2 with the old values of this thread's two output rows
 * (accumulate), so the epilogue's reads return sooner. */
template <bool F32, int BN>
static __device__ __forceinline__ void vk_prefetch_out(const vk_args &p, int e, int row_base,
                                                       int col_tile, int lane)
{
    constexpr int ESZ = F32 ? 4 : 2;
    constexpr int LINES = BN * ESZ / 128; /* 128-byte lines per row segment */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row_base + 8 * h;
        if (row >= p.M) continue;
        const int prow = vk_w1_row(p, row);
        const char *rp = (const char *)p.out + (((size_t)e * p.M + prow) * p.N + col_tile) * ESZ;
#pragma unroll
        for (int l = lane % 4; l < LINES; l += 4)
            if (col_tile + l * (128 / ESZ) < p.N) prefetch_l2(rp + 128 * l);
    }
}

/* The epilogue's read-back rows of a thread: rows row0, row0 + 4, + 8,
 * + 12 of expert e's output (the concatenated-W1 row map applied), their
 * element offsets and whether they exist. */
static __device__ __forceinline__ void vk_epi_rows(const vk_args &p, int e, int row0,
                                                   size_t *rowoff, bool *row_ok)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int row = row0 + 4 * i;
        row_ok[i] = row < p.M;
        const int prow = vk_w1_row(p, row);
        rowoff[i] = ((size_t)e * p.M + (size_t)prow) * p.N;
    }
}

/* Accumulators to global memory through a 2 KB shared-memory buffer per
 * warp: a warp's 16 rows go out in pieces of 32 columns, each row piece as
 * 128 contiguous bytes (8 threads x 16 B) instead of 8-row scatters of 32 B.
 * The buffer is 16-byte-chunk swizzled by row. With ACC the old values are
 * read (as 16-byte row pieces too) VK_EPI_AHEAD pieces ahead of their use,
 * into registers separate from the accumulators (ptxas serialises every
 * wgmma of the kernel once an accumulator register is written by anything
 * else). */
#ifndef VK_EPI_AHEAD
#define VK_EPI_AHEAD 3
#endif
template <bool F32, bool ACC, int BN>
static __device__ __forceinline__ void vk_store_tile(const vk_args &p, const float *acc, int e,
                                                     int row0_warp, int n0, int lane, uint32_t buf,
                                                     bool zero)
{
    constexpr int PIECES = BN / 32;
    static_assert(PIECES >= VK_EPI_AHEAD, "epilogue read-ahead");
    const int rr0 = lane / 8, ch = lane % 8; /* read-back: row rr0 + 4 i, chunk ch */
    size_t rowoff[4];
    bool row_ok[4];
    vk_epi_rows(p, e, row0_warp + rr0, rowoff, row_ok);
    float4 old[VK_EPI_AHEAD][4];
    auto load_old = [&](int c, float4 *o) {
        const int col = n0 + 32 * c + 4 * ch;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (!row_ok[i] || col >= p.N) continue;
            if (F32) {
                o[i] = *(const float4 *)((const float *)p.out + rowoff[i] + col);
            } else {
                uint2 u = *(const uint2 *)((const bf16 *)p.out + rowoff[i] + col);
                float2 lo = __bfloat1622float2(*(__nv_bfloat162 *)&u.x);
                float2 hi = __bfloat1622float2(*(__nv_bfloat162 *)&u.y);
                o[i] = make_float4(lo.x, lo.y, hi.x, hi.y);
            }
        }
    };
    if (ACC) {
#pragma unroll
        for (int c = 0; c < VK_EPI_AHEAD; c++) load_old(c, old[c]);
    }
#pragma unroll
    for (int c = 0; c < PIECES; c++) {
        const int col = n0 + 32 * c + 4 * ch;
        const bool col_ok = col < p.N;
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            const int j = 4 * c + jj;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = lane / 4 + 8 * h;
                const int cc = 8 * jj + 2 * (lane % 4); /* column within the piece */
                const uint32_t a = buf + r * 128 + ((((cc >> 2) ^ (r & 7)) << 4) | ((cc & 3) << 2));
                float v0 = zero ? 0.f : acc[4 * j + 2 * h];
                float v1 = zero ? 0.f : acc[4 * j + 2 * h + 1];
                st_shared_v2_f32(a, v0, v1);
            }
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rr0 + 4 * i;
            const uint4 u4 = ld_shared_v4(buf + r * 128 + ((ch ^ (r & 7)) << 4));
            float4 v = make_float4(__uint_as_float(u4.x), __uint_as_float(u4.y),
                                   __uint_as_float(u4.z), __uint_as_float(u4.w));
            if (!row_ok[i] || !col_ok) continue;
            if (ACC) {
                const float4 o = old[c % VK_EPI_AHEAD][i];
                v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
            }
            if (F32) {
                *(float4 *)((float *)p.out + rowoff[i] + col) = v;
            } else {
                __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
                __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
                uint2 u;
                u.x = *(uint32_t *)&lo;
                u.y = *(uint32_t *)&hi;
                *(uint2 *)((bf16 *)p.out + rowoff[i] + col) = u;
            }
        }
        if (ACC && c + VK_EPI_AHEAD < PIECES) load_old(c + VK_EPI_AHEAD, old[c % VK_EPI_AHEAD]);
        __syncwarp();
    }
}

/* Piece c (64 columns) of a warp's 16 x BN accumulators, rounded to bf16,
 * into rows r0 .. r0 + 15 (r0 % 8 == 0) of a buffer of 128-byte rows in the
 * 128-byte swizzle (the 8-column group jj of row r at 16-byte chunk jj ^ (r
 * % 8)), by stmatrix: the accumulator layout is stmatrix's, matrix (jj, h)
 * the warp's rows 8 h .. 8 h + 7 x columns 8 jj .., 4 matrices per
 * instruction (12 instructions for a 192-wide tile where 32-bit stores took
 * 48). Z: the tile of an expert without rows, zeros. */
template <bool Z>
static __device__ __forceinline__ void vk_round_piece(const float *acc, int c, uint32_t buf,
                                                      int r0, int lane)
{
    const int mi = lane / 8, k = lane % 8; /* stmatrix: matrix, row */
#pragma unroll
    for (int s4 = 0; s4 < 4; s4++) {
        uint32_t r[4];
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int j = 8 * c + 2 * s4 + (m >> 1), h = m & 1;
            __nv_bfloat162 v = __floats2bfloat162_rn(Z ? 0.f : acc[4 * j + 2 * h],
                                                     Z ? 0.f : acc[4 * j + 2 * h + 1]);
            r[m] = *(uint32_t *)&v;
        }
        const int row = r0 + 8 * (mi & 1) + k;
        const int ch = 2 * s4 + (mi >> 1);
        stmatrix_x4(buf + row * 128 + ((ch ^ (row & 7)) << 4), r[0], r[1], r[2], r[3]);
    }
}

/* Piece c (64 columns) of a warpgroup's 64 x BN accumulators, rounded to
 * bf16, transposed into an 8 KiB buffer by stmatrix .trans (each warp its
 * 16 rows): buffer row j is block column 64 c + j, or with split the even
 * columns in rows 0-31 and the odd ones in rows 32-63; 16-byte chunk 2 warp
 * + h holds the warp's 8 block rows h, at chunk position ch ^ (row % 8).
 * Z as in vk_round_piece. */
template <bool Z>
static __device__ __forceinline__ void vk_round_piece_t(const float *acc, int c, uint32_t buf,
                                                        int warp, int lane, bool split)
{
    const int mi = lane / 8, k = lane % 8; /* stmatrix: matrix, row */
#pragma unroll
    for (int s4 = 0; s4 < 4; s4++) {
        /* matrices (jb, h): jb = 2 s4 + (m >> 1) is the 8-column group,
         * h = m & 1 the 8-row half of the warp's 16 */
        uint32_t r[4];
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int j = 8 * c + 2 * s4 + (m >> 1), h = m & 1;
            __nv_bfloat162 v = __floats2bfloat162_rn(Z ? 0.f : acc[4 * j + 2 * h],
                                                     Z ? 0.f : acc[4 * j + 2 * h + 1]);
            r[m] = *(uint32_t *)&v;
        }
        const int jr = 8 * (2 * s4 + (mi >> 1)) + k; /* block column */
        const int row = split ? (jr & 1) * 32 + (jr >> 1) : jr;
        const int ch = 2 * warp + (mi & 1);
        stmatrix_x4_trans(buf + row * 128 + ((ch ^ (row & 7)) << 4), r[0], r[1], r[2], r[3]);
    }
}

/* bf16 overwrite: the accumulators rounded to bf16 on their way into the
 * warp's 2 KB buffer, which then holds 16 rows x 64 columns, so each row
 * piece leaves as 128 contiguous bytes (8 threads x 16 B); the fp32 staging
 * above gives bf16 rows only 64-byte pieces. Rounded once, as there. */
template <int BN, bool Z>
static __device__ __forceinline__ void vk_store_tile_bf16(const vk_args &p, const float *acc,
                                                          int e, int row0_warp, int n0, int lane,
                                                          uint32_t buf)
{
    constexpr int PIECES = BN / 64;
    const int rr0 = lane / 8, ch = lane % 8; /* read-back: row rr0 + 4 i, chunk ch */
    size_t rowoff[4];
    bool row_ok[4];
    vk_epi_rows(p, e, row0_warp + rr0, rowoff, row_ok);
#pragma unroll
    for (int c = 0; c < PIECES; c++) {
        vk_round_piece<Z>(acc, c, buf, 0, lane);
        __syncwarp();
        const int col = n0 + 64 * c + 8 * ch; /* N % 64 == 0: a chunk is all in or all out */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rr0 + 4 * i;
            const uint4 v = ld_shared_v4(buf + r * 128 + ((ch ^ (r & 7)) << 4));
            if (row_ok[i] && col < p.N) *(uint4 *)((bf16 *)p.out + rowoff[i] + col) = v;
        }
        __syncwarp();
    }
}

/* bf16 overwrite of the transposed tile (trans_out: out is (E, N, M), dW1
 * computed as X^T dH so that the gathered operand is the narrow M side).
 * The warpgroup's four 2 KB warp buffers form one 8 KB buffer of 64 output
 * rows (columns j of the tile) x 64 elements (its rows i): per 64-column
 * piece each warp puts its 16 rows there with stmatrix .trans (bf16 pairs
 * straight from the accumulator layout), and after a warpgroup barrier each
 * output row leaves as 128 contiguous bytes (8 threads x 16 B). Chunk ch of
 * buffer row jr sits at chunk ch ^ (jr % 8), so neither side conflicts. */
template <int BN, bool Z>
static __device__ __forceinline__ void vk_store_tile_bf16_t(const vk_args &p, const float *acc,
                                                            int e, int m0, int n0, int warp,
                                                            int lane, uint32_t wbuf, int cw)
{
    constexpr int PIECES = BN / 64;
    const int tw = warp * 32 + lane;                /* thread in the warpgroup */
    const bool rows_ok = m0 < p.M;                  /* M % 64 == 0: all 64 or none */
#pragma unroll
    for (int c = 0; c < PIECES; c++) {
        if (n0 + 64 * c >= p.N) break;              /* N % 64 == 0 */
        vk_round_piece_t<Z>(acc, c, wbuf, warp, lane, false);
        named_barrier_sync(1 + cw, 128);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int jr = tw / 8 + 16 * i, ch = tw % 8;
            const uint4 v = ld_shared_v4(wbuf + jr * 128 + ((ch ^ (jr & 7)) << 4));
            const int col = n0 + 64 * c + jr;
            const int prow = vk_w1_row(p, col);
            if (rows_ok)
                *(uint4 *)((bf16 *)p.out + ((size_t)e * p.N + prow) * p.M + m0 + 8 * ch) = v;
        }
        named_barrier_sync(1 + cw, 128); /* the buffer is free for the next piece */
    }
}

/* VK_F_TMA_ST: a warpgroup's 64 x BN block of accumulators, rounded to
 * bf16, into its staging (wst): BN / 64 pieces of 8 KiB, each 64 rows of
 * 128 bytes in the 128-byte swizzle (16-byte chunk ch of row r at ch ^
 * (r % 8)) that vk_store_staged's TMA boxes read. Not transposed: piece c
 * holds the block's rows x columns 64 c .. 64 c + 63. Transposed
 * (trans_out): piece c's row j is the block's column 64 c + j (stmatrix
 * .trans), and with the concatenated W1 rows (map_rows) the even columns
 * (gate rows of dW1) go to rows 0-31 and the odd ones to rows 32-63, so
 * each half is one run of physical rows. */
template <int BN, bool Z>
static __device__ __forceinline__ void vk_stage_tile(const vk_args &p, const float *acc,
                                                     uint32_t wst, int warp, int lane)
{
    constexpr int PIECES = BN / 64;
    if (p.trans_out) {
#pragma unroll
        for (int c = 0; c < PIECES; c++)
            vk_round_piece_t<Z>(acc, c, wst + c * 8192, warp, lane, p.map_rows);
        return;
    }
#pragma unroll
    for (int c = 0; c < PIECES; c++) vk_round_piece<Z>(acc, c, wst + c * 8192, warp * 16, lane);
}

/* The staged block of expert e (rows m0 .. m0 + 63, columns n0 ..) to the
 * output by TMA, in boxes of 32 rows x 64 columns (omap: vk_run's output
 * map). Rows past M (M % 64 == 0: the whole block) and pieces past N (N %
 * 64 == 0) are another expert's or outside: not stored; columns past the
 * output's last are clipped by the TMA unit. */
template <int BN>
static __device__ __forceinline__ void vk_store_staged(const vk_args &p, const CUtensorMap *omap,
                                                       uint32_t wst, int e, int m0, int n0)
{
    if (m0 >= p.M) return;
#pragma unroll
    for (int c = 0; c < BN / 64; c++) {
        const int col = n0 + 64 * c;
        if (col >= p.N) break;
        const uint32_t src = wst + c * 8192;
        if (!p.trans_out) { /* (E M, N): rows e M + m0 .., columns col .. */
            tma_store_2d(omap, src, col, e * p.M + m0);
            tma_store_2d(omap, src + 4096, col, e * p.M + m0 + 32);
        } else if (!p.map_rows) { /* (E N, M): rows e N + col .., columns m0 .. */
            tma_store_2d(omap, src, m0, e * p.N + col);
            tma_store_2d(omap, src + 4096, m0, e * p.N + col + 32);
        } else { /* logical rows col .. col + 63: gate rows col / 2 .., up rows n + col / 2 .. */
            tma_store_2d(omap, src, m0, e * p.N + col / 2);
            tma_store_2d(omap, src + 4096, m0, e * p.N + p.n_half + col / 2);
        }
    }
}

/* The producer: the tile/k-tile iterations (vk_cursor), the row tokens
 * TOK_AHEAD iterations ahead through the thread's ring slots, and the
 * per-tile work done once per tile (the first version, which redid it every
 * stage, was removed after measuring: notes/sm90_varlenk_log.md). On a whole
 * k-tile of a tile inside both matrices' columns a gathered row costs one
 * wide multiply-add (token x row pitch + column base) and its 16-byte copies
 * take the slab offsets as immediates; the contiguous operand's rows walk a
 * pointer (or come by TMA with VK_F_TMA). Other k-tiles (the expert's last,
 * partial one; partial column tiles) take the general zero-filling path. */
template <int BN, bool GATHER_A, int CFG>
static __device__ __forceinline__ void vk_producer(const vk_args &p, const CUtensorMap *cmap,
                                                        uint32_t base, uint32_t full_bar,
                                                        uint32_t empty_bar, uint32_t tok_ring,
                                                        int t)
{
    typedef vk_cfg<BN, CFG> C;
    constexpr int BK = C::BK, STAGES = C::STAGES, RPT = C::RPT;
    constexpr int BM = C::BM;
    constexpr uint32_t A_BYTES = BK * BM * 2;
    constexpr uint32_t STAGE_BYTES = A_BYTES + BK * BN * 2;
    constexpr int WG = GATHER_A ? BM : BN; /* the gathered operand's tile width */
    constexpr int WC = GATHER_A ? BN : BM; /* the contiguous one's */
    constexpr uint32_t G_OFF = GATHER_A ? 0 : A_BYTES; /* their places in a stage */
    constexpr uint32_t C_OFF = GATHER_A ? A_BYTES : 0;
    const int g = t / 8, q = t % 8;
    const uint32_t my_tok = tok_ring + 4 * RPT * g; /* this thread's tokens in a slot */
    uint32_t dst_off[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int r = RPT * g + i;
        dst_off[i] = (uint32_t)r * 128 + ((uint32_t)(q ^ (r & 7)) << 4);
    }
    const bf16 *gsrc = GATHER_A ? p.a : p.b;
    const bf16 *csrc = GATHER_A ? p.b : p.a;
    const int gcols = GATHER_A ? p.M : p.N; /* = row pitch, elements */
    const int ccols = GATHER_A ? p.N : p.M;
    const uint32_t gpitch = 2u * (uint32_t)gcols; /* bytes */
    const size_t cpitch = 2 * (size_t)ccols;

    const int ncl = vk_ncl<C::CL>(), cid = vk_cid<C::CL>();
    const int rank = C::CL > 1 ? (int)cluster_rank() : 0;
    const int slot_end = vk_slot_end(p.sched.total, ncl);
    vk_cursor ahead;
    vk_cursor_start<BK>(p, &ahead, cid, ncl);
#pragma unroll 1
    for (int i = 0; i < C::TOK_AHEAD; i++) {
        if (ahead.slot < slot_end) {
            vk_fetch_tokens<BK>(p, ahead, tok_ring + i * C::TOK_SLOT_BYTES, t);
            vk_cursor_next<BK>(p, &ahead);
        }
        cp_async_commit();
    }
    uint32_t it = 0;
    for (int slot = cid; slot < slot_end; slot += ncl) {
        const int tile = vk_slot_tile(slot, p.rotate, ncl);
        if (tile >= p.sched.total) continue;
        const sm90_vk_tile tl = sm90_vk_tile_decode(p.sched, tile, (CFG & VK_F_GROUPED) != 0);
        /* a pair's unit: m-tiles 2 i (rank 0) and 2 i + 1 (rank 1; past M
         * where the m-tiles are odd in number: loaded as zeros, not stored) */
        const int e = tl.e, mt = C::CL * tl.m_tile + rank, nt = tl.n_tile;
        const int row_begin = __ldg(p.expert_offset + e);
        const int row_end = __ldg(p.expert_offset + e + 1);
        const int nk = row_end > row_begin ? (row_end - row_begin + BK - 1) / BK : 0;
        const int gcol0 = GATHER_A ? mt * BM : nt * BN;
        const int ccol0 = GATHER_A ? nt * BN : mt * BM;
        const bool full_cols = gcol0 + WG <= gcols && ccol0 + WC <= ccols;
        const char *gbase = (const char *)(gsrc + gcol0 + 8 * q);
        const char *crow =
            (const char *)(csrc + (size_t)(row_begin + RPT * g) * (size_t)ccols + ccol0 + 8 * q);
#pragma unroll 1
        for (int kt = 0; kt < nk; kt++, it++, crow += BK * cpitch) {
            if (ahead.slot < slot_end) {
                /* the slot read last iteration: every lane has read it */
                __syncwarp();
                vk_fetch_tokens<BK>(
                    p, ahead, tok_ring + ((it + C::TOK_AHEAD) % C::TOK_SLOTS) * C::TOK_SLOT_BYTES, t);
                vk_cursor_next<BK>(p, &ahead);
            }
            cp_async_commit();
            cp_async_wait<C::TOK_AHEAD>(); /* this iteration's tokens have landed */
            __syncwarp();                  /* ... those the warp's other lanes copied too */
            const uint32_t s = it % STAGES;
            const uint32_t ph = (it / STAGES) & 1;
            const int row0 = row_begin + kt * BK;
            const int rows_left = row_end - row0;
            int src_row[RPT];
            {
                uint4 tk = ld_shared_v4(my_tok + (it % C::TOK_SLOTS) * C::TOK_SLOT_BYTES);
                src_row[0] = (int)tk.x; src_row[1] = (int)tk.y;
                src_row[2] = (int)tk.z; src_row[3] = (int)tk.w;
            }
            const uint32_t sa = base + s * STAGE_BYTES;
            const uint32_t fb = full_bar + 8 * s;
            mbar_wait(empty_bar + 8 * s, ph ^ 1);
            if constexpr (C::CL > 1) {
                /* the pair: the gathered A as below, or zero-filled where the
                 * k-tile is partial or the m-tile reaches past M; B shared by
                 * multicast on whole k-tiles (the same decision in both CTAs:
                 * one expert, one n-tile), else each CTA's own by cp.async */
                static_assert(GATHER_A && C::TMA, "pairs share the N-side operand by TMA");
                const bool whole = rows_left >= BK;
                if (whole && gcol0 + WG <= gcols) {
#pragma unroll
                    for (int i = 0; i < RPT; i++) {
                        const char *gp = gbase + (size_t)(uint32_t)src_row[i] * gpitch;
#pragma unroll
                        for (int sl = 0; sl < WG / 64; sl++)
                            cp_async_16_full(sa + dst_off[i] + sl * BK * 128, gp + 128 * sl);
                    }
                } else {
                    vk_copy_operand<BM, BK>(sa, p.a, p.M, gcol0, p.M, src_row, rows_left, g, q);
                }
                if (whole) {
                    if (t == 0)
                        vk_tma_operand<WC, BK, 2>(sa + C_OFF, cmap, fb, ccol0, ccols, row0, rank);
                } else {
                    int own_row[RPT];
#pragma unroll
                    for (int i = 0; i < RPT; i++) own_row[i] = row0 + RPT * g + i;
                    vk_copy_operand<BN, BK>(sa + A_BYTES, p.b, p.N, ccol0, p.N, own_row, rows_left,
                                            g, q);
                    if (t == 0) mbar_arrive(fb);
                }
            } else if (full_cols && rows_left >= BK) {
#pragma unroll
                for (int i = 0; i < RPT; i++) {
                    const char *gp = gbase + (size_t)(uint32_t)src_row[i] * gpitch;
#pragma unroll
                    for (int sl = 0; sl < WG / 64; sl++)
                        cp_async_16_full(sa + G_OFF + dst_off[i] + sl * BK * 128, gp + 128 * sl);
                }
                if (C::TMA) {
                    if (t == 0)
                        vk_tma_operand<WC, BK, 1>(sa + C_OFF, cmap, fb, ccol0, ccols, row0, 0);
                } else {
#pragma unroll
                    for (int i = 0; i < RPT; i++) {
                        const char *cp = crow + i * cpitch;
#pragma unroll
                        for (int sl = 0; sl < WC / 64; sl++)
                            cp_async_16_full(sa + C_OFF + dst_off[i] + sl * BK * 128,
                                                cp + 128 * sl);
                    }
                }
            } else {
                int own_row[RPT];
#pragma unroll
                for (int i = 0; i < RPT; i++) own_row[i] = row0 + RPT * g + i;
                vk_copy_operand<BM, BK>(sa, p.a, p.M, mt * BM, p.M,
                                           GATHER_A ? src_row : own_row, rows_left, g, q);
                vk_copy_operand<BN, BK>(sa + A_BYTES, p.b, p.N, nt * BN, p.N,
                                        GATHER_A ? own_row : src_row, rows_left, g, q);
                if (C::TMA && t == 0) mbar_arrive(fb);
            }
            cp_async_mbar_arrive_noinc(fb);
        }
    }
    cp_async_wait_all();
}

/* TMA_ST: one m64 block of a warpgroup (64 rows, BN / 64 pieces of 64 x
 * 64) through its staging and out by TMA; M256 calls it once per block */
template <int BN>
static __device__ __forceinline__ void vk_block_out(const vk_args &p, const CUtensorMap *omap,
                                                    const float *acc, uint32_t wst, int e,
                                                    int m0, int n0, bool zero, int cw, int t,
                                                    int warp, int lane)
{
    if (t == 0) bulk_wait_read<0>(); /* the last block's store has read the staging */
    named_barrier_sync(1 + cw, 128);
    /* two copies, so that the rows' tiles select nothing */
    if (zero) vk_stage_tile<BN, true>(p, acc, wst, warp, lane);
    else vk_stage_tile<BN, false>(p, acc, wst, warp, lane);
    fence_proxy_async(); /* generic writes -> the TMA engine's reads */
    named_barrier_sync(1 + cw, 128);
    if (t == 0) {
        vk_store_staged<BN>(p, omap, wst, e, m0, n0);
        bulk_commit();
    }
}

template <int BN, bool GATHER_A, int CFG>
__global__ void __launch_bounds__(VK_THREADS, 1)
    vk_varlen_k_kernel(const vk_args p, const __grid_constant__ CUtensorMap cmap,
                       const __grid_constant__ CUtensorMap omap)
{
    typedef vk_cfg<BN, CFG> C;
    constexpr int BK = C::BK, STAGES = C::STAGES, BM = C::BM, MB = C::MB;
    constexpr uint32_t A_BYTES = BK * BM * 2;
    constexpr uint32_t B_BYTES = BK * BN * 2;
    constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(STAGE_BYTES % 1024 == 0, "stages stay 1024-byte aligned");
    static_assert(2 * 8 * STAGES <= 128, "barriers fit their 128 bytes");
    if (p.abort && *p.abort) return; /* the call's device-side check failed */

    extern __shared__ uint8_t vk_smem[];
    const uint32_t base = (smem_addr(vk_smem) + 1023u) & ~1023u;
    /* TMA_ST: the staged tile after the stages (1024-byte aligned, as the
     * 128-byte swizzle of its TMA boxes needs) */
    const uint32_t stg = base + STAGES * STAGE_BYTES;
    const uint32_t full_bar = stg + C::STG_BYTES;          /* + 8 s */
    const uint32_t empty_bar = full_bar + 8 * STAGES;      /* + 8 s */
    const uint32_t tok_ring = full_bar + 128;              /* TOK_SLOTS x TOK_SLOT_BYTES */
    const uint32_t epi_buf = tok_ring + C::TOK_SLOTS * C::TOK_SLOT_BYTES; /* 8 x 2 KB */
    const int wg = threadIdx.x / 128;
    const int t = threadIdx.x % 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            /* one cp.async arrival per producer thread (+ thread 0's TMA one) */
            mbar_init(full_bar + 8 * s, C::TMA ? 129 : 128);
            /* one arrival per consumer warp (of both CTAs in a pair) */
            mbar_init(empty_bar + 8 * s, 8 * C::CL);
        }
        mbar_fence_init();
    }
    __syncthreads();
    /* a pair: the peer's barriers are initialised before any multicast or
     * remote arrival reaches them */
    if constexpr (C::CL > 1) cluster_barrier();

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        setmaxnreg_dec<C::PREGS>();
        vk_producer<BN, GATHER_A, CFG>(p, &cmap, base, full_bar, empty_bar, tok_ring, t);
    } else {
        /* ---------------- consumers ---------------- */
        setmaxnreg_inc<C::CREGS>();
        const int cw = wg - 1; /* which half of the M tile (MB m64 blocks) */
        const int warp = t / 32, lane = t % 32;
        float acc[BN / 2];
        float acc1[C::ACC1]; /* the second m64 block's (M256) */
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < C::ACC1; i++) acc1[i] = 0.f;
        uint32_t it = 0;
        const int ncl = vk_ncl<C::CL>(), cid = vk_cid<C::CL>();
        const int rank = C::CL > 1 ? (int)cluster_rank() : 0;
        const int slot_end = vk_slot_end(p.sched.total, ncl);
        for (int slot = cid; slot < slot_end; slot += ncl) {
            const int tile = vk_slot_tile(slot, p.rotate, ncl);
            if (tile >= p.sched.total) continue;
            const sm90_vk_tile tl = sm90_vk_tile_decode(p.sched, tile, (CFG & VK_F_GROUPED) != 0);
            const int e = tl.e, mt = C::CL * tl.m_tile + rank, nt = tl.n_tile;
            const int row_begin = __ldg(p.expert_offset + e);
            const int row_end = __ldg(p.expert_offset + e + 1);
            const int nk = row_end > row_begin ? (row_end - row_begin + BK - 1) / BK : 0;
            if (nk == 0 && p.accumulate) continue;
            const int row_base = mt * BM + cw * 64 + warp * 16 + lane / 4;
            if (p.accumulate) {
                if (p.out_f32) vk_prefetch_out<true, BN>(p, e, row_base, nt * BN, lane);
                else vk_prefetch_out<false, BN>(p, e, row_base, nt * BN, lane);
            }
            uint32_t prev_s = 0;
            for (int kt = 0; kt < nk; kt++, it++) {
                const uint32_t s = it % STAGES;
                const uint32_t ph = (it / STAGES) & 1;
                mbar_wait(full_bar + 8 * s, ph);
                /* cp.async wrote through the generic proxy; wgmma reads through the async one */
                if (C::FENCE) fence_proxy_async();
                const uint32_t sa = base + s * STAGE_BYTES + (uint32_t)(cw * MB) * (BK * 128);
                const uint32_t sb = base + s * STAGE_BYTES + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 16; ks++) {
                    /* 16 k-rows = 2048 bytes: whole swizzle atoms, no phase change */
                    uint64_t da = wgmma_desc_sw128_mn(sa + ks * 2048, BK * 128);
                    uint64_t db = wgmma_desc_sw128_mn(sb + ks * 2048, BK * 128);
                    vk_wgmma_mn<BN>(acc, da, db, (kt > 0 || ks > 0) ? 1 : 0);
                    if constexpr (MB == 2) {
                        uint64_t da1 = wgmma_desc_sw128_mn(sa + BK * 128 + ks * 2048, BK * 128);
                        vk_wgmma_mn<BN>(acc1, da1, db, (kt > 0 || ks > 0) ? 1 : 0);
                    }
                }
                wgmma_commit();
                wgmma_wait<1>(); /* the previous stage's group has retired */
                if (kt > 0 && lane == 0) vk_release<C::CL>(empty_bar + 8 * prev_s, rank);
                prev_s = s;
            }
            /* unconditional, so that on every path the accumulators are
             * quiet before the epilogue reads them and the next tile's
             * accumulate loads write them (else ptxas serialises the wgmmas) */
            wgmma_wait<0>();
            wgmma_fence_regs<BN / 2>(acc);
            if constexpr (MB == 2) wgmma_fence_regs<BN / 2>(acc1);
            if (nk > 0 && lane == 0) vk_release<C::CL>(empty_bar + 8 * prev_s, rank);
            const bool zero = nk == 0;
            if constexpr (MB == 2) {
                /* each m64 block in turn through this warpgroup's staging */
                const uint32_t wst = stg + (uint32_t)cw * (64 * BN * 2);
                const int m0 = mt * BM + cw * 128;
                vk_block_out<BN>(p, &omap, acc, wst, e, m0, nt * BN, zero, cw, t, warp, lane);
                vk_block_out<BN>(p, &omap, acc1, wst, e, m0 + 64, nt * BN, zero, cw, t, warp,
                                  lane);
                continue;
            }
            if constexpr (C::TMA_ST) {
                /* this warpgroup's 64 rows */
                const uint32_t wst = stg + (uint32_t)cw * (64 * BN * 2);
                vk_block_out<BN>(p, &omap, acc, wst, e, mt * BM + cw * 64, nt * BN, zero, cw, t,
                                 warp, lane);
                continue;
            }
            const int row0_warp = mt * BM + cw * 64 + warp * 16;
            const uint32_t buf = epi_buf + (uint32_t)(cw * 4 + warp) * VK_EPI_BUF_BYTES;
            /* accumulate: no tile without rows gets here (continue above),
             * so its stores select nothing */
            if (p.out_f32) {
                if (p.accumulate)
                    vk_store_tile<true, true, BN>(p, acc, e, row0_warp, nt * BN, lane, buf, false);
                else
                    vk_store_tile<true, false, BN>(p, acc, e, row0_warp, nt * BN, lane, buf, zero);
            } else if (p.trans_out) {
                const uint32_t wbuf = epi_buf + (uint32_t)cw * 4 * VK_EPI_BUF_BYTES;
                if (zero)
                    vk_store_tile_bf16_t<BN, true>(p, acc, e, mt * BM + cw * 64, nt * BN, warp,
                                                   lane, wbuf, cw);
                else
                    vk_store_tile_bf16_t<BN, false>(p, acc, e, mt * BM + cw * 64, nt * BN, warp,
                                                    lane, wbuf, cw);
            } else {
                if (p.accumulate)
                    vk_store_tile<false, true, BN>(p, acc, e, row0_warp, nt * BN, lane, buf, false);
                else if (zero)
                    vk_store_tile_bf16<BN, true>(p, acc, e, row0_warp, nt * BN, lane, buf);
                else
                    vk_store_tile_bf16<BN, false>(p, acc, e, row0_warp, nt * BN, lane, buf);
            }
        }
    }
    /* TMA_ST: the last tile's stores complete before the CTA exits */
    if (C::TMA_ST && wg > 0 && t == 0) bulk_wait<0>();
    /* every stage the producer filled has been consumed: the barriers are
     * quiet and are invalidated before the CTA exits (ptx_sm90.cuh); in a
     * pair, no CTA leaves while its peer may still arrive on its barriers */
    if constexpr (C::CL > 1)
        cluster_barrier();
    else
        __syncthreads();
    if (threadIdx.x == 0)
        for (int s = 0; s < 2 * STAGES; s++) mbar_inval(full_bar + 8 * s);
}

/* ------------------------------------------------------------ launchers */

/* The contiguous operand (rows x cols bf16, row-major) is loaded through a
 * tensor map (tensor_map_sm90.h) in boxes of 64 columns x box_rows rows,
 * 128-byte swizzle: the layout the cp.async path writes. Rows = the caller's
 * row capacity; only whole k-tiles of an expert are loaded through it, so no
 * row past R is read. */

/* A launch of `ctas` CTAs in 1-D clusters of cl (the attribute lives in
 * *at, which must outlive *lc). */
static void vk_cluster_launch_config(cudaLaunchConfig_t *lc, cudaLaunchAttribute *at, int cl,
                                     int ctas, size_t smem, cudaStream_t stream)
{
    memset(at, 0, sizeof *at);
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = (unsigned)cl;
    at->val.clusterDim.y = 1;
    at->val.clusterDim.z = 1;
    memset(lc, 0, sizeof *lc);
    lc->gridDim = dim3((unsigned)ctas, 1, 1);
    lc->blockDim = dim3(VK_THREADS, 1, 1);
    lc->dynamicSmemBytes = smem;
    lc->stream = stream;
    lc->attrs = at;
    lc->numAttrs = 1;
}

/* VK_F_CLM: the pairs to launch for `units` units: at most num_sms / 2, at
 * most as many as can be resident at once (the occupancy query, once per
 * kernel: the schedule is static, so a pair started late would run its
 * units last), at least one. */
template <int BN, bool GATHER_A, int CFG>
static int vk_clusters(int units, int num_sms, cudaError_t *err)
{
    constexpr int CL = vk_cfg<BN, CFG>::CL;
    static int max_clusters = 0; /* the same value from every thread that sets it */
    int mc = __atomic_load_n(&max_clusters, __ATOMIC_RELAXED);
    *err = cudaSuccess;
    if (mc <= 0) {
        cudaLaunchAttribute at;
        cudaLaunchConfig_t lc;
        vk_cluster_launch_config(&lc, &at, CL, CL, vk_smem_bytes<BN, CFG>(), 0);
        *err = cudaOccupancyMaxActiveClusters(&mc, vk_varlen_k_kernel<BN, GATHER_A, CFG>, &lc);
        if (*err != cudaSuccess) return 0;
        if (mc <= 0) {
            *err = cudaErrorInvalidConfiguration; /* no pair fits */
            return 0;
        }
        __atomic_store_n(&max_clusters, mc, __ATOMIC_RELAXED);
    }
    int n = num_sms / CL;
    if (n > mc) n = mc;
    if (n > units) n = units;
    return n < 1 ? 1 : n;
}

template <int BN, bool GATHER_A, int CFG>
static smoe_status vk_launch(const vk_args *a, const CUtensorMap *map, const CUtensorMap *omap,
                             int num_sms, cudaStream_t stream)
{
    const size_t smem = vk_smem_bytes<BN, CFG>();
    cudaError_t err = cudaFuncSetAttribute(vk_varlen_k_kernel<BN, GATHER_A, CFG>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                         "sm90 varlen-K GEMM: cudaFuncSetAttribute(%zu bytes): %s", smem,
                         cudaGetErrorString(err));
    constexpr int CL = vk_cfg<BN, CFG>::CL;
    if constexpr (CL == 1) {
        int grid = a->sched.total < num_sms ? a->sched.total : num_sms;
        vk_varlen_k_kernel<BN, GATHER_A, CFG><<<grid, VK_THREADS, smem, stream>>>(*a, *map, *omap);
        err = cudaGetLastError();
    } else {
        const int clusters = vk_clusters<BN, GATHER_A, CFG>(a->sched.total, num_sms, &err);
        if (err == cudaSuccess) {
            cudaLaunchAttribute at;
            cudaLaunchConfig_t lc;
            vk_cluster_launch_config(&lc, &at, CL, clusters * CL, smem, stream);
            err = cudaLaunchKernelEx(&lc, vk_varlen_k_kernel<BN, GATHER_A, CFG>, *a, *map, *omap);
        }
    }
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                         "sm90 varlen-K GEMM: launch failed: %s", cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

/* One tile width's kernels (tile order, gathered side; tma_st: the TMA-store
 * epilogue, A gathered; clm: pairs along M, A gathered; m256: vk_run's
 * choice of 256-row tiles, which set the schedule's m-tiles). */
template <int BN>
static smoe_status vk_launch_bn(const vk_args *a, const CUtensorMap *map,
                                const CUtensorMap *omap, int gather_a, int grouped, int tma_st,
                                int clm, int m256, int num_sms, cudaStream_t stream)
{
    constexpr int C0 = VK_DEFAULT_CFG, C1 = VK_DEFAULT_CFG | VK_F_GROUPED;
    constexpr int C2 = C0 | VK_F_TMA_ST, C3 = C1 | VK_F_TMA_ST;
    if (clm) {
        constexpr int P0 = C0 | VK_F_CLM, P1 = C1 | VK_F_CLM, P2 = C2 | VK_F_CLM,
                      P3 = C3 | VK_F_CLM;
        if (tma_st)
            return grouped ? vk_launch<BN, true, P3>(a, map, omap, num_sms, stream)
                           : vk_launch<BN, true, P2>(a, map, omap, num_sms, stream);
        return grouped ? vk_launch<BN, true, P1>(a, map, omap, num_sms, stream)
                       : vk_launch<BN, true, P0>(a, map, omap, num_sms, stream);
    }
    if (tma_st) {
        /* 192 wide without pairs: 256-row tiles */
        constexpr int M256 = BN == 192 ? VK_F_M256 : 0;
        SMOE_RETURN_ERROR_IF(m256 != (M256 != 0), SMOE_ERROR_INTERNAL,
                             "sm90 varlen-K: 256-row tiles chosen %d, launched %d", m256,
                             M256 != 0);
        return grouped ? vk_launch<BN, true, C3 | M256>(a, map, omap, num_sms, stream)
                       : vk_launch<BN, true, C2 | M256>(a, map, omap, num_sms, stream);
    }
    if (grouped)
        return gather_a ? vk_launch<BN, true, C1>(a, map, omap, num_sms, stream)
                        : vk_launch<BN, false, C1>(a, map, omap, num_sms, stream);
    return gather_a ? vk_launch<BN, true, C0>(a, map, omap, num_sms, stream)
                    : vk_launch<BN, false, C0>(a, map, omap, num_sms, stream);
}

/* The output tile's width for N columns (N % 64 == 0): 256 where its tiles
 * cover no more columns than 192's (where 256 divides N, and e.g. GLM-4.5-
 * Air's dw2, N = 1408: 6 tiles of 256 or 8 of 192 both cover 1536), else
 * 192 unless its tiles cover more than 9/8 of the columns 128's cover.
 * 128 x 128 reads twice the shared memory per MMA of 128 x 256:
 * gpt-oss-120b's N = 2880 and 5760 (192 divides both) took the backward
 * from 416 to 448 TFLOPS, GLM-4.5-Air's dw2 +1% (H100, 3 interleaved
 * rounds, notes/sm90_log.md rung 19); 256 there instead of 192: dw2 in the
 * layer 3.38 ms against SonicMoE's 2.45 before it (rung 21). Where the
 * tile can run 256 rows high (tall: vk_run's m256) and 192's tiles cover
 * as many columns as 256's (N a multiple of 768, or 1408), 256 x 192 loads
 * 22% fewer bytes per flop than 128 x 256: on an H200 (session 46,
 * bench/RESULTS.md) Qwen3-30B-A3B's, Qwen3-235B-A22B's and GLM-4.5's dW
 * 3-5% faster under ncu, GLM-4.5-Air's dw2 2.57 -> 2.43 ms, and the four
 * rows' backward +1% in the layer (3 interleaved rounds, loop +1%). */
static int vk_bn(int64_t N, int tall)
{
    const int64_t w256 = (N + 255) / 256 * 256, w192 = (N + 191) / 192 * 192,
                  w128 = (N + 127) / 128 * 128;
    if (w256 < w192 || (w256 == w192 && !tall)) return 256;
    return 8 * w192 <= 9 * w128 ? 192 : 128;
}

/* Shared checks and launch: C_e (M x N) = A_e^T B_e, A gathered if gather_a. */
static smoe_status vk_run(const char *name, const smoe_gemm_problem *p, const bf16 *a,
                          const bf16 *b, int64_t M, int64_t N, int gather_a, void *out,
                          smoe_dtype out_dtype, int accumulate, int map_rows, int trans_out,
                          int grouped, int clm, cudaStream_t stream)
{
    SMOE_RETURN_ERROR_IF(p->d % 64 != 0 || p->n % 64 != 0 || p->h_cols % 64 != 0,
                         SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: needs d, n and h_cols multiples of 64 (d=%lld, n=%lld, "
                         "h_cols=%lld)",
                         name, (long long)p->d, (long long)p->n, (long long)p->h_cols);
    SMOE_RETURN_ERROR_IF(out_dtype != SMOE_DTYPE_F32 && out_dtype != SMOE_DTYPE_BF16,
                         SMOE_ERROR_UNSUPPORTED, "sm90 %s: output dtype %d is neither F32 nor BF16",
                         name, (int)out_dtype);
    SMOE_RETURN_ERROR_IF(p->E < 0 || M <= 0 || N <= 0, SMOE_ERROR_INVALID_SIZE,
                         "sm90 %s: bad sizes E=%lld M=%lld N=%lld", name, (long long)p->E,
                         (long long)M, (long long)N);
    /* the shape checks before the operand checks, so the layer's probe at
     * create time (no operands) sees them */
    SMOE_RETURN_ERROR_IF(p->off_stride > 1, SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: varlen-K takes no view of the rows (off_stride %d)", name,
                         p->off_stride);
    /* bf16 overwrite (A gathered: the layer's dW2 and dW1^T) leaves by TMA
     * from a staged tile (VK_F_TMA_ST) where M = d >= 2048 and the output's
     * rows have 32-bit coordinates; elsewhere, and for fp32 and accumulated
     * outputs, through the warps' buffers. In the layer (H100, 3
     * interleaved rounds, notes/sm90_log.md rung 19) the staged tile took
     * the backward +1-4% on the rows with d >= 2048 (gpt-oss-120b +4%,
     * Mixtral-8x7B +2%, DeepSeek-V3 even) and -1% at 1.4B-n256 and 7B-n256
     * (d = 768, 1536), where its 3 stages of 128 x 256 cost more than the
     * epilogue it hides. */
    const int64_t out_rows = p->E * (trans_out ? N : M), out_cols = trans_out ? M : N;
    const int tma_st = gather_a && out_dtype == SMOE_DTYPE_BF16 && !accumulate && M >= 2048 &&
                       out_rows <= INT32_MAX;
    /* 256-row tiles (VK_F_M256) where the staged tile runs at BN = 192
     * without pairs. Measured on an H200 (session 45, bench/RESULTS.md):
     * gpt-oss-120b's dw2 / dw1 2.03 / 4.07 -> 1.93 / 3.93 ms under ncu, its
     * backward +2% in the layer (3 interleaved rounds, loop +2%). Where
     * 256-wide tiles cover fewer columns than 192-wide ones, 192-wide
     * tiles in 256 rows lose (GLM-4.5-Air's dw1 +2% time, 30B-n512's
     * backward -4%), so BN stays 256; where they cover as many, vk_bn takes
     * 192 for these tiles; 128-wide tiles (N <= 128) keep 128 rows (not
     * measured). */
    const int tall = tma_st && !clm; /* the tile may run 256 rows high */
    const int bn = vk_bn(N, tall);
    const int m256 = tall && bn == 192;
    const int bm = m256 ? 256 : VK_BM;
    const int64_t tiles_m = (M + bm - 1) / bm;
    const int64_t tiles_n = (N + bn - 1) / bn;
    const int64_t total = p->E * tiles_m * tiles_n;
    SMOE_RETURN_ERROR_IF(M > INT32_MAX / 2 || N > INT32_MAX / 2 || total > INT32_MAX,
                         SMOE_ERROR_UNSUPPORTED, "sm90 %s: sizes too large (M=%lld, N=%lld, "
                         "%lld tiles)", name, (long long)M, (long long)N, (long long)total);
    if (p->E == 0) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!a || !b || !out || !p->expert_offset || !p->row_token,
                         SMOE_ERROR_NULL_POINTER, "sm90 %s: NULL operand", name);
    /* 16-byte cp.async of operand rows, 16-byte epilogue stores */
    SMOE_RETURN_ERROR_IF(((uintptr_t)a | (uintptr_t)b | (uintptr_t)out) % 16 != 0,
                         SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: operands and output must be 16-byte aligned", name);
    int num_sms = p->num_sms;
    if (num_sms <= 0) {
        int dev = 0;
        cudaError_t err = cudaGetDevice(&dev);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
        SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                             "sm90 %s: cannot read the multiprocessor count: %s", name,
                             cudaGetErrorString(err));
    }
    vk_args args;
    args.a = a;
    args.b = b;
    args.expert_offset = p->expert_offset;
    args.row_token = p->row_token;
    args.out = out;
    args.M = (int)M;
    args.N = (int)N;
    /* pairs along M (VK_F_CLM) where the N-side operand is the contiguous
     * one (A gathered); the schedule's units are then pairs of m-tiles */
    const int cl = clm && gather_a ? 2 : 1;
    const int64_t units_m = (tiles_m + cl - 1) / cl;
    args.sched.tiles_m = (int)units_m;
    args.sched.tiles_n = (int)tiles_n;
    args.sched.total = (int)(p->E * units_m * tiles_n);
    /* groups of 16 m-tiles (8 pairs): with ~132 tiles in flight, 16 slices
     * of the 128-wide M side and ~8 of the 256-wide N side, near the fewest
     * bytes for that many tiles */
    args.sched.gm = grouped ? (int)(units_m < 16 / cl ? units_m : 16 / cl) : 0;
    args.out_f32 = out_dtype == SMOE_DTYPE_F32;
    args.accumulate = accumulate != 0;
    args.map_rows = map_rows;
    args.n_half = (int)p->n;
    args.trans_out = trans_out;
    args.abort = p->abort;
    /* the rotated waves (vk_slot_tile) where the plain order pins CTAs to
     * a cheap partial last n-tile: N not a multiple of the tile, row order,
     * tiles_n dividing the grid (vk_launch's clusters: min(units, num_sms
     * / cl) unless fewer pairs fit at once) */
    const int64_t grid = args.sched.total < num_sms / cl ? args.sched.total : num_sms / cl;
    args.rotate = N % bn != 0 && !grouped && grid % tiles_n == 0;
    const int cfg = VK_DEFAULT_CFG;
    /* the contiguous operand: B (a_scaled) when A is gathered, else A (dH) */
    CUtensorMap map;
    memset(&map, 0, sizeof map);
    if ((cfg & VK_F_TMA) && p->cap > 0) {
        const int box_rows = vk_cfg<256, 0>::BK;
        SMOE_FORWARD_IF_ERROR(gather_a ? smoe_sm90_make_map(&map, b, p->cap, N, box_rows, name)
                                       : smoe_sm90_make_map(&map, a, p->cap, M, box_rows, name));
    }
    CUtensorMap omap;
    memset(&omap, 0, sizeof omap);
    if (tma_st) SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&omap, out, out_rows, out_cols, 32, name));
    const int pairs = cl > 1;
    if (bn == 256)
        return vk_launch_bn<256>(&args, &map, &omap, gather_a, grouped, tma_st, pairs, m256,
                                 num_sms, stream);
    if (bn == 192)
        return vk_launch_bn<192>(&args, &map, &omap, gather_a, grouped, tma_st, pairs, m256,
                                 num_sms, stream);
    return vk_launch_bn<128>(&args, &map, &omap, gather_a, grouped, tma_st, pairs, m256,
                             num_sms, stream);
}

/* The plan's row for a weight-gradient GEMM (grouped_gemm_sm90.cu's
 * sm90_vk_rows): 0 the tiles in row order, 1 grouped, 2 and 3 the same in
 * pairs along M (VK_F_CLM; where A is gathered). */
static smoe_status vk_row_check(const smoe_gemm_problem *p, int g, const char *op, int *grouped,
                                int *clm)
{
    SMOE_RETURN_ERROR_IF(!p->plan, SMOE_ERROR_INTERNAL, "sm90 %s: no plan", op);
    const int row = p->plan->row[g];
    SMOE_RETURN_ERROR_IF(row < 0 || row > 3, SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: tile row %d (the table has rows 0 to 3)", op, row);
    *grouped = row & 1;
    *clm = row >= 2;
    return SMOE_SUCCESS;
}

extern "C" smoe_status smoe_sm90_dw2(const smoe_gemm_problem *p, const bf16 *dout,
                                     const bf16 *a_scaled, void *dw2, smoe_dtype out_dtype,
                                     int accumulate, void *scratch, cudaStream_t s)
{
    (void)scratch;
    SMOE_RETURN_ERROR_IF(!p, SMOE_ERROR_NULL_POINTER, "sm90 dw2: NULL problem");
    int grouped = 0, clm = 0;
    SMOE_FORWARD_IF_ERROR(vk_row_check(p, SMOE_GEMM_DW2, "dw2", &grouped, &clm));
    /* M = d (dO columns, gathered by token), N = n (a_scaled columns) */
    return vk_run("dw2", p, dout, a_scaled, p->d, p->n, 1, dw2, out_dtype, accumulate, 0, 0,
                  grouped, clm, s);
}

extern "C" smoe_status smoe_sm90_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                                     void *dw1, smoe_dtype out_dtype, int accumulate,
                                     void *scratch, cudaStream_t s)
{
    (void)scratch;
    SMOE_RETURN_ERROR_IF(!p, SMOE_ERROR_NULL_POINTER, "sm90 dw1: NULL problem");
    int grouped = 0, clm = 0;
    SMOE_FORWARD_IF_ERROR(vk_row_check(p, SMOE_GEMM_DW1, "dw1", &grouped, &clm));
    const int map_rows = p->gated && p->w1_layout == SMOE_W1_CONCATENATED;
    /* bf16 overwrite (the layer's weight gradients): dW1^T = X^T dH, M = d
     * (X columns, gathered), N = h_cols, each tile stored transposed; the
     * gathered operand is then the 128-wide side, as in dw2 (gathering the
     * 256-wide side cost 10-15%: notes/sm90_log.md rung 11); fp32 or
     * accumulated outputs keep dH^T X (their epilogue reads and writes
     * the output in its own orientation) */
    if (out_dtype == SMOE_DTYPE_BF16 && !accumulate)
        return vk_run("dw1", p, x, dh, p->d, p->h_cols, 1, dw1, out_dtype, accumulate, map_rows, 1,
                      grouped, clm, s);
    /* M = h_cols (dH columns, logical interleaved order), N = d (X columns, gathered) */
    return vk_run("dw1", p, dh, x, p->h_cols, p->d, 0, dw1, out_dtype, accumulate, map_rows, 0,
                  grouped, clm, s);
}
