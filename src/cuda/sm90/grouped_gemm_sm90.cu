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
 *  - Epilogue of up, down, dxt through a per-warpgroup shared buffer, 64
 *    columns at a time: the accumulator layout scatters a warp's stores over
 *    8 rows, so the chunk is staged and then stored as 128-byte row
 *    segments, clipped at the expert's last row and at N. up's A = act(H)
 *    runs in a compact loop over the staged values with the activation as a
 *    template parameter (unrolled over the 128 accumulators with a runtime
 *    switch it made the kernel 450 KB of code and stalled every warp on
 *    instruction fetch). down at 256 < n <= 1024 on the 128 x 256 tile
 *    stages its chunks for TMA stores instead (SM90_FL_TMA_ST2), and the
 *    ping-pong 128 x 192 kernels of down / dxt hide one warpgroup's
 *    epilogue under the other's main loop (the tile table below).
 *  - dh's epilogue works straight from the accumulator registers
 *    (ep_dh_direct): each thread loads the H pairs of its own accumulator
 *    columns (8 bytes per row and column group, 16 loads in flight ahead of
 *    the math), computes dH, A' and its rows' dS partials, and stores from
 *    registers; no staging, no barriers (staged, each chunk waited for its
 *    H loads with nothing in flight: notes/sm90_log.md, rung 8). Gated
 *    with BN = 256 and E <= 256 (every grid row) it computes the same way
 *    but stores dH and A' through two small shared buffers by TMA
 *    (ep_dh_tma), which leave while the math of the next units runs.
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
 * from the saved bf16 H (sigmoid by the fast reciprocal: 1-2 fp32 ulp before
 * rounding), dS partial sums per (row, n-tile) in fp32 in a fixed order,
 * written to scratch and summed in n-tile order by sm90_ds_finish (plus
 * <dO, b2[e]>). Deterministic: every output element is written once by
 * one thread; no atomics.
 *
 * Parts: config_sm90.cuh (constants, kernel shapes, parameters),
 * scheduler_sm90.cuh (tiles), mainloop_sm90.cuh (the two producers, the
 * consumers' loop, the wgmma k-block), epilogue_sm90.cuh (every epilogue);
 * this file composes the kernel from them and holds the host side: tensor
 * maps, the tile table (a named row per kernel configuration, with why it
 * is there) and the launchers, which run the row the layer's plan names.
 * Requirements (else the plan has no Hopper row, and the layer runs the
 * portable kernel): d % 64 == 0, n % 64 == 0, E <= 1024; 16-byte aligned
 * pointers (else SMOE_ERROR_UNSUPPORTED; validate.c refuses them earlier).
 */
#include <cudaTypedefs.h>
#include <stdint.h>
#include <string.h>

#include "cuda/gemm.h"
#include "cuda/sm90/tensor_map_sm90.h"

#include "cuda/sm90/config_sm90.cuh"
#include "cuda/sm90/epilogue_sm90.cuh"
#include "cuda/sm90/mainloop_sm90.cuh"
#include "cuda/sm90/scheduler_sm90.cuh"

/* ------------------------------------------------------------ the kernel */

template <int BN, int STAGES, int MODE, int FL>
__global__ void __launch_bounds__(SM90_THREADS, 1)
sm90_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b,
                         const __grid_constant__ CUtensorMap map_c, const sm90_gemm_params p)
{
    /* up / dh: map_a is A's / A''s output map there (they gather their
     * input), map_c H's / dH's */
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    typedef typename K::cfg cfg;
    constexpr bool GATHER = K::GATHER, WS = K::WS, TOKREG = K::TOKREG, PP = K::PP;
    constexpr bool EPIWG = K::EPIWG;
    /* a failed device-side check of the call: every CTA leaves at once (the
     * same word for all, before any barrier) */
    if (p.abort && *p.abort) return;

    extern __shared__ uint8_t smem_raw[];
    /* 1024-byte aligned base by an offset from smem_raw (not an integer round
     * trip, which loses the shared address space and turns every access
     * through it into a generic LD/ST: notes/sm90_log.md, rung 5) */
    sm90_ctx c;
    c.smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    c.ep_base = c.smem + STAGES * cfg::STAGE_BYTES; /* cfg::EP_TOTAL bytes */
    c.full = (uint64_t *)(c.ep_base + cfg::EP_TOTAL);
    c.empty = c.full + STAGES;
    c.stg = c.empty + STAGES; /* sm90_xbar's: EPIWG's staging full, empty */
    c.dyn = (int *)(c.stg + sm90_xbar(FL)); /* sm90_dynw's (SM90_FL_DYN) */
    int *tile_start = (int *)(c.stg + sm90_xbar(FL) + sm90_dynw(FL));
    c.tile_start = tile_start;
    c.tok_slots = tile_start + SM90_MAX_EXPERTS + 1; /* WS: 2 x 128 tile tokens */
    c.nt = (p.N + BN - 1) / BN;
    c.kb_count = p.K / SM90_BK;
    c.cid = blockIdx.x; /* tiles cid, cid + ncl, ... */
    c.ncl = gridDim.x;
    /* m-tiles per group of the tile order, 0: row-major (constant 0 unless
     * SM90_FL_RASTER, so the other kernels carry no grouped-order code) */
    c.gm = (FL & SM90_FL_RASTER) ? p.raster_gm : 0;

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    if (tid == 0) {
        tma_prefetch_map(&map_b);
        if (!GATHER) tma_prefetch_map(&map_a);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(smem_addr(c.full + s), GATHER ? (WS ? 32 : EPIWG ? 64 : 128) + 1 : 1);
            mbar_init(smem_addr(c.empty + s), PP ? 1 : 2);
        }
        if constexpr (EPIWG) {
            mbar_init(smem_addr(c.stg), 256);
            mbar_init(smem_addr(c.stg + 1), 64);
        }
        mbar_fence_init();
    }
    if (tid < 32) sm90_tile_starts(p, c.nt, tile_start, tid);
    __syncthreads();
    c.total = tile_start[p.E];

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        if constexpr (EPIWG) /* within the pool a CTA launches with (config_sm90.cuh) */
            setmaxnreg_dec<SM90_EPIWG_PRODUCER_REGS>();
        else
            setmaxnreg_dec<TOKREG ? SM90_GATHER_PRODUCER_REGS : SM90_PRODUCER_REGS>();
        if (EPIWG && tid >= 64)
            sm90_epilogue_warps<BN, STAGES, MODE, FL>(p, c, tid);
        else
            sm90_produce<BN, STAGES, MODE, FL>(map_a, map_b, p, c, tid);
    } else {
        /* ---------------- consumers ---------------- */
        if constexpr (EPIWG)
            setmaxnreg_inc<SM90_EPIWG_CONSUMER_REGS>();
        else
            setmaxnreg_inc<TOKREG ? SM90_GATHER_CONSUMER_REGS : SM90_CONSUMER_REGS>();
        sm90_consume<BN, STAGES, MODE, FL>(map_a, map_c, p, c, tid, wg);
    }
    /* the TMA stores have read their shared-memory sources before the CTA's
     * shared memory goes away */
    if constexpr (K::TMA_ST2) /* (each warp's lane 0 issued dh's; thread 0 of a warpgroup down's) */
        if (wg > 0 && (tid & 31) == 0) bulk_wait<0>();
    __syncthreads();
    /* no wait, arrival or copy touches a barrier any more (the producer's
     * tail saw every stage released) */
    if (tid == 0)
        for (int i = 0; i < 2 * STAGES + sm90_xbar(FL); i++) mbar_inval(smem_addr(c.full + i));
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

/* A 2-D bf16 tensor map (rows x cols, row-major) with a box of box_cols x
 * box_rows elements and the given shared-memory swizzle. */
static smoe_status sm90_make_map_box(CUtensorMap *map, const void *base, int64_t rows,
                                     int64_t cols, int box_cols, int box_rows,
                                     CUtensorMapSwizzle swizzle, const char *what)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = sm90_encode_fn();
    if (!encode)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 gemm: cuTensorMapEncodeTiled not available "
                                             "from the driver");
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
    cuuint32_t estr[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box,
                        estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return smoe_fail(SMOE_ERROR_BACKEND,
                         "sm90 gemm: tensor map for %s (%lld x %lld) failed (CUresult %d)", what,
                         (long long)rows, (long long)cols, (int)r);
    return SMOE_SUCCESS;
}

/* tensor_map_sm90.h: 64-column boxes, 128B swizzle (the operand tiles) */
extern "C" smoe_status smoe_sm90_make_map(CUtensorMap *map, const void *base, int64_t rows,
                                          int64_t cols, int box_rows, const char *what)
{
    return sm90_make_map_box(map, base, rows, cols, SM90_BK, box_rows, CU_TENSOR_MAP_SWIZZLE_128B,
                             what);
}

/* What every varlen-M row needs (sm90_check_common says why not). */
static int sm90_shape_ok(const smoe_gemm_problem *p)
{
    return p->d % 64 == 0 && p->n % 64 == 0 && p->E <= SM90_MAX_EXPERTS &&
           p->E * p->h_cols <= INT32_MAX && p->E * p->d <= INT32_MAX && p->cap <= INT32_MAX &&
           p->d <= INT32_MAX / 2 && p->h_cols <= INT32_MAX / 2;
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

/* The kernel <BN, STAGES, MODE, FL> over prm: a persistent grid, at most
 * one CTA per SM. */
template <int BN, int STAGES, int MODE, int FL>
static smoe_status sm90_launch(const smoe_gemm_problem *p, const CUtensorMap *ma,
                               const CUtensorMap *mb, const CUtensorMap *mc,
                               const sm90_gemm_params *prm, cudaStream_t s, const char *op)
{
    typedef typename sm90_traits<BN, STAGES, MODE, FL>::cfg cfg;
    void (*kern)(const CUtensorMap, const CUtensorMap, const CUtensorMap,
                 const sm90_gemm_params) = sm90_grouped_gemm_kernel<BN, STAGES, MODE, FL>;
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           cfg::SMEM_BYTES);
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 %s: cudaFuncSetAttribute: %s", op,
                         cudaGetErrorString(err));
    const int grid = sm90_grid(p, (prm->N + BN - 1) / BN);
    if (grid <= 0) return SMOE_SUCCESS;
    kern<<<grid, SM90_THREADS, cfg::SMEM_BYTES, s>>>(*ma, *mb, *mc, *prm);
    err = cudaGetLastError();
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "sm90 %s: launch failed: %s", op,
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ the tile table */

/* What a row needs of the shape. */
enum {
    SM90_NEED_D256 = 1, /* d >= 256 (the 192- and 256-wide tiles of down and dxt) */
    SM90_NEED_N256 = 2, /* n >= 256 (dh's 256-wide tiles) */
    SM90_NEED_H256 = 4, /* h_cols >= 256 (up's epilogue warps) */
    SM90_NEED_E256 = 8, /* E <= 256 (SM90_FL_TMA_ST2's smaller tile_start table) */
    SM90_NEED_GATED = 16 /* a gated activation (dh's TMA-store epilogue) */
};

/* The rows of each varlen-M GEMM: X(index, name, BN, stages, flags, needs).
 * Why each row is there (H100, notes/sm90_log.md; the choice is
 * sm90_plan's):
 *  up    the 128 x 256 tile with the 128-thread gather wherever H has 256+
 *        columns (best on every grid shape); with its epilogue in the
 *        epilogue warps where d >= 2048 and n >= 512 (up's epilogue was
 *        12-16% of its time at the 30B rows; layer forward +1-2% at
 *        30B-n512 and 120B, +1-5% at 30B-n1024, but -2% at 30B-n256 and 7B
 *        and -7-13% at d = 768: rung 13; at d = 2048 and 2880, OLMoE-1B-7B,
 *        Qwen3-30B-A3B and gpt-oss-120b's shapes, +6-9% with the down rule
 *        below: bench/RESULTS.md, 2026-11-27); below 256 columns 128 x 128
 *        with 6 stages and a producer warp per stage.
 *  down  ping-pong 128 x 192 where the reduction n is short (n <= 1024:
 *        n <= 512 +1-4% at 30B-n512 and 120B-n512 over the TMA-store tile,
 *        2026-11-27; Qwen3-30B-A3B's n = 768 +3% forward in the layer,
 *        session 16; at n = 1024 the H100 had measured the TMA-store tile
 *        ahead (30B-n1024 and OLMoE-1B-7B 0.98-0.99x with the ping-pong,
 *        rungs 10-11 and session 16), but with today's kernels on an H200
 *        the ping-pong reads layer forward +2% at 30B-n1024, 120B-n1024 and
 *        OLMoE-1B-7B, 3 interleaved rounds, ranges apart, session 48) or
 *        where d is a multiple of 192 but not of 256 (gpt-oss's 2880,
 *        grouped from 8 MiB: 128 x 256 would leave a quarter-full last
 *        tile); for d > 4096 the ping-pong, grouped from 8 MiB (GLM-4.5 +5%,
 *        DeepSeek-V3 +1%; at d = 4096, GLM-4.5-Air and Qwen3-235B-A22B,
 *        it lost 2-3% to 128 x 256: 2026-11-27); else 128 x 256. (The
 *        TMA-store rows stay in the table, for the tests and bench_gemm.)
 *  dxt   the ping-pong where the reduction h_cols is at most 1024 (in row
 *        order at 512 < h_cols <= 1024 where d % 192 != 0: layer backward
 *        +2% at 30B-n512 and 120B-n512 on an H200, 3 interleaved rounds,
 *        ranges apart, session 48), the plain 128 x 256 tile otherwise;
 *        its ping-pong grouped from 4 MiB (30B-n256: layer backward +3%,
 *        bench_gemm 4.15 -> 3.69 ms on random routing, session 23; 1.4B
 *        and 7B keep row order). At
 *        gpt-oss-120b's d = 2880 the ping-pong grouped measured 3.48 ms
 *        against the 256-wide tile's 3.96 alone but only +1% in the layer
 *        (ranges overlapping), and -8% at GLM-4.5-Air: not taken.
 *  dh    128 x 256 where n >= 256, its dH and A' stored by TMA where gated
 *        and E <= 256 (backward +1-3% on the 1.4B, 7B, 120B-n512 and
 *        120B-n2048 rows, the others even), ep_dh_direct otherwise; 128 x
 *        192 in the grouped order where n is a multiple of 192 but not of
 *        256 (gpt-oss's 2880: the 256-wide tile leaves a quarter-full last
 *        n-tile; layer backward +5%, row order +3%, 256 grouped +1%:
 *        2026-11-27; alone it measured 2.44 ms against 2.52 and 2.34).
 *        The TMA-store tile with claimed tiles (SM90_FL_DYN), grouped,
 *        where d >= 4096 and one expert's W2 slice is 10 MiB or more
 *        (random routing, bench_gemm: DeepSeek-V3 8.44 -> 4.43 ms,
 *        GLM-4.5-Air 3.63 -> 3.25, Mixtral-8x7B 7.21 -> 6.86; layer
 *        backward, 2 interleaved rounds: DeepSeek-V3 +13%, GLM-4.5,
 *        GLM-4.5-Air, Qwen3-235B-A22B and 120B-n2048 +2%, Mixtral +1%;
 *        below those sizes the claimed tiles measured 0.95-1.00x in the
 *        layer: session 23, notes/sm90_log.md rung 20).
 *  every 128 x 256 (and 192) row has a "grouped" twin, taken where one
 *        expert's weight slice is 16 MiB or more: up, dxt, down and dh
 *        +3-12% at 120B-n2048 (W1 32 MiB, W2 16 MiB), up and dxt +3-7% at
 *        120B (W1 16 MiB), down -5% there (W2 8 MiB): rung 9.
 *  dw2, dw1 (varlen_k_sm90.cu; sm90_vk_grouped) the tiles in row order,
 *        grouped by 16 m-tiles and in 2-CTA pairs along M where N >= 8192
 *        (sm90_vk_rows).
 *  d < 256: 128 x 128, 6 stages. */
#define SM90_UP_ROWS(X)                                                                          \
    X(0, "256x3 epilogue-warps", 256, 3, SM90_FL_EPIWG, SM90_NEED_H256)                          \
    X(1, "256x3 epilogue-warps grouped", 256, 3, SM90_FL_EPIWG | SM90_FL_RASTER, SM90_NEED_H256) \
    X(2, "256x4", 256, 4, 0, 0)                                                                  \
    X(3, "256x4 grouped", 256, 4, SM90_FL_RASTER, 0)                                             \
    X(4, "128x6 warp-gather", 128, 6, SM90_FL_WS, 0)
#define SM90_DOWN_ROWS(X)                                                                        \
    X(0, "192x5 ping-pong", 192, 5, SM90_FL_PP, SM90_NEED_D256)                                  \
    X(1, "192x5 ping-pong grouped", 192, 5, SM90_FL_PP | SM90_FL_RASTER, SM90_NEED_D256)         \
    X(2, "256x4 tma-store", 256, 4, SM90_FL_TMA_ST2, SM90_NEED_D256 | SM90_NEED_E256)            \
    X(3, "256x4 tma-store grouped", 256, 4, SM90_FL_TMA_ST2 | SM90_FL_RASTER,                    \
      SM90_NEED_D256 | SM90_NEED_E256)                                                           \
    X(4, "256x4", 256, 4, 0, SM90_NEED_D256)                                                     \
    X(5, "256x4 grouped", 256, 4, SM90_FL_RASTER, SM90_NEED_D256)                                \
    X(6, "128x6", 128, 6, 0, 0)
#define SM90_DXT_ROWS(X)                                                                         \
    X(0, "192x5 ping-pong", 192, 5, SM90_FL_PP, SM90_NEED_D256)                                  \
    X(1, "192x5 ping-pong grouped", 192, 5, SM90_FL_PP | SM90_FL_RASTER, SM90_NEED_D256)         \
    X(2, "256x4", 256, 4, 0, SM90_NEED_D256)                                                     \
    X(3, "256x4 grouped", 256, 4, SM90_FL_RASTER, SM90_NEED_D256)                                \
    X(4, "128x6", 128, 6, 0, 0)
#define SM90_DH_ROWS(X)                                                                          \
    X(0, "256x4 tma-store", 256, 4, SM90_FL_TMA_ST2,                                             \
      SM90_NEED_N256 | SM90_NEED_E256 | SM90_NEED_GATED)                                         \
    X(1, "256x4 tma-store grouped", 256, 4, SM90_FL_TMA_ST2 | SM90_FL_RASTER,                    \
      SM90_NEED_N256 | SM90_NEED_E256 | SM90_NEED_GATED)                                         \
    X(2, "256x4", 256, 4, 0, SM90_NEED_N256)                                                     \
    X(3, "256x4 grouped", 256, 4, SM90_FL_RASTER, SM90_NEED_N256)                                \
    X(4, "128x6", 128, 6, 0, 0)                                                                  \
    X(5, "192x4 grouped", 192, 4, SM90_FL_RASTER, SM90_NEED_N256)                                \
    X(6, "256x4 tma-store dynamic", 256, 4, SM90_FL_TMA_ST2 | SM90_FL_DYN,                       \
      SM90_NEED_N256 | SM90_NEED_E256 | SM90_NEED_GATED)                                         \
    X(7, "256x4 tma-store grouped dynamic", 256, 4,                                              \
      SM90_FL_TMA_ST2 | SM90_FL_RASTER | SM90_FL_DYN,                                            \
      SM90_NEED_N256 | SM90_NEED_E256 | SM90_NEED_GATED)                                         \
    X(8, "128x6 ping-pong tma-store", 128, 6, SM90_FL_PP | SM90_FL_TMA_ST2,                       \
      SM90_NEED_E256 | SM90_NEED_GATED)                                                          \
    X(9, "128x6 ping-pong tma-store grouped", 128, 6,                                            \
      SM90_FL_PP | SM90_FL_TMA_ST2 | SM90_FL_RASTER, SM90_NEED_E256 | SM90_NEED_GATED)

typedef struct sm90_row {
    const char *name;
    int bn, stages, fl, need;
} sm90_row;

#define SM90_ROW(i, name, bn, st, fl, need) {name, bn, st, fl, need},
static const sm90_row sm90_up_rows[] = {SM90_UP_ROWS(SM90_ROW)};
static const sm90_row sm90_down_rows[] = {SM90_DOWN_ROWS(SM90_ROW)};
static const sm90_row sm90_dxt_rows[] = {SM90_DXT_ROWS(SM90_ROW)};
static const sm90_row sm90_dh_rows[] = {SM90_DH_ROWS(SM90_ROW)};
#undef SM90_ROW
/* The weight gradients' rows (varlen_k_sm90.cu; the same for dw2 and dw1):
 * the tiles of an expert in row order, or grouped by 16 m-tiles where an
 * expert has many tiles (sm90_plan). */
static const sm90_row sm90_vk_rows[] = {
    {"128x256 tma (x192 or x128 where N % 256 != 0; bf16 staged where d >= 2048)", 0, 4, 0, 0},
    {"128x256 tma grouped (x192 or x128 where N % 256 != 0; bf16 staged where d >= 2048)", 0, 4,
     0, 0},
    /* Pairs along M sharing the N-side tile by multicast (varlen_k_sm90.cu's
     * VK_F_CLM) where A is gathered: dw2, and dw1 with a bf16 overwrite;
     * dw1 into fp32 or accumulated runs the same tiles without pairs. In
     * the layer (H100, two calls of 3 interleaved rounds, session 25) the
     * grouped pair took Mixtral-8x7B's backward +1.7% both times (647 ->
     * 658, 650 -> 661 TFLOPS); pairs in row order measured 0.97-1.02x on
     * the other models and grid rows, inside the calls' spread, so the plan
     * takes the grouped pair (N >= 8192) and the plain row order elsewhere.
     * Also measured then and not kept: 4 stages beside a staged tile of one
     * 64 x 64 piece per warpgroup at a time (0.98-1.02x). */
    {"128x256 tma cluster-m (x192 or x128 where N % 256 != 0; bf16 staged where d >= 2048)", 0,
     4, 0, 0},
    {"128x256 tma cluster-m grouped (x192 or x128 where N % 256 != 0; bf16 staged where d >= "
     "2048)",
     0, 4, 0, 0},
};

/* GEMM g's table (NULL for dw1, dw2) and its length. */
static const sm90_row *sm90_rows(int g, int *count)
{
#define SM90_N(t) (int)(sizeof(t) / sizeof(t[0]))
    switch (g) {
    case SMOE_GEMM_UP: *count = SM90_N(sm90_up_rows); return sm90_up_rows;
    case SMOE_GEMM_DOWN: *count = SM90_N(sm90_down_rows); return sm90_down_rows;
    case SMOE_GEMM_DXT: *count = SM90_N(sm90_dxt_rows); return sm90_dxt_rows;
    case SMOE_GEMM_DH: *count = SM90_N(sm90_dh_rows); return sm90_dh_rows;
    default: *count = SM90_N(sm90_vk_rows); return NULL;
    }
#undef SM90_N
}

static const char *sm90_row_name(int g, int row)
{
    int count = 0;
    const sm90_row *t = sm90_rows(g, &count);
    if (g < 0 || g >= SMOE_GEMM_COUNT || row < 0 || row >= count) return NULL;
    return t ? t[row].name : sm90_vk_rows[row].name;
}

/* Whether row `row` of GEMM g can run the shape of p (0 with the reason
 * recorded otherwise). */
static int sm90_row_fits_op(const smoe_gemm_problem *p, int g, int row, const char *op)
{
    int count = 0;
    const sm90_row *t = sm90_rows(g, &count);
    if (row < 0 || row >= count) {
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 %s: no row %d in its tile table", op, row);
        return 0;
    }
    if (!t) return 1;
    const int need = t[row].need;
    const char *why = (need & SM90_NEED_D256) && p->d < 256    ? "d >= 256"
                      : (need & SM90_NEED_N256) && p->n < 256  ? "n >= 256"
                      : (need & SM90_NEED_H256) && p->h_cols < 256 ? "h_cols >= 256"
                      : (need & SM90_NEED_E256) && p->E > 256  ? "E <= 256"
                      : (need & SM90_NEED_GATED) && !p->gated  ? "a gated activation"
                                                               : NULL;
    if (why)
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 %s: tile row \"%s\" needs %s", op, t[row].name,
                  why);
    return why == NULL;
}

static int sm90_row_fits(const smoe_gemm_problem *p, int g, int row)
{
    if (g < 0 || g >= SMOE_GEMM_COUNT) return 0;
    if (!sm90_shape_ok(p)) return sm90_check_common(p, smoe_gemm_name(g)) == SMOE_SUCCESS;
    if (g == SMOE_GEMM_DXT && p->gated && p->w1_layout == SMOE_W1_CONCATENATED) {
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 dxt: not with the concatenated W1 layout");
        return 0;
    }
    return sm90_row_fits_op(p, g, row, smoe_gemm_name(g));
}

/* Where one expert's weight slice (K x N bf16) is `mib` MiB or more: the
 * grouped tile order (see the rows above). */
static int sm90_grouped(int64_t K, int64_t N, int mib) { return K * N * 2 >= ((int64_t)mib << 20); }

/* Whether a weight gradient (M x N per expert; 128 x 256 tiles, 128 x 192
 * or 128 x 128 where N % 256 != 0: varlen_k_sm90.cu's vk_bn) takes its
 * grouped row: where N >= 8192, so that ~132 tiles in row order span one
 * or two m-tiles and 32 or more N-side slices of the expert's rows, which
 * then do not stay in L2 (Mixtral-8x7B, 4096 rows per expert: 117 and
 * 235 MiB; dw2 8.70 -> 5.76 ms, dw1 19.9 -> 11.9 ms). Elsewhere the
 * grouped order measured 0.84-1.06x of the row order (bench_gemm,
 * 2026-11-27), so those keep row order. */
static int sm90_vk_grouped(int64_t N) { return N >= 8192; }

/* The tile table's choice for each GEMM at p's shape (the rows above say
 * why); -1 where these kernels cannot run it. */
static void sm90_plan(const smoe_gemm_problem *p, smoe_gemm_plan *plan)
{
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) plan->row[g] = -1;
    if (!sm90_shape_ok(p)) return;
    const int64_t d = p->d, n = p->n, hc = p->h_cols, E = p->E;
    /* up (K = d, N = h_cols) */
    if (hc >= 256) {
        const int epiwg = d >= 2048 && n >= 512, gr = sm90_grouped(d, hc, 16);
        plan->row[SMOE_GEMM_UP] = epiwg ? gr : 2 + gr;
    } else {
        plan->row[SMOE_GEMM_UP] = 4;
    }
    /* down (K = n, N = d) */
    if (d < 256) {
        plan->row[SMOE_GEMM_DOWN] = 6;
    } else {
        const int gr = sm90_grouped(n, d, 16);
        if (n <= 1024)
            plan->row[SMOE_GEMM_DOWN] = gr;
        else if (d % 256 != 0 && d % 192 == 0) plan->row[SMOE_GEMM_DOWN] = sm90_grouped(n, d, 8);
        else if (d > 4096) plan->row[SMOE_GEMM_DOWN] = sm90_grouped(n, d, 8);
        else plan->row[SMOE_GEMM_DOWN] = 4 + gr;
    }
    /* dxt (K = h_cols, N = d): W1's rows in dH's column order only; the
     * ping-pong grouped from 4 MiB (30B-n256: layer backward +3%, 3 rounds,
     * session 23) */
    if (!(p->gated && p->w1_layout == SMOE_W1_CONCATENATED)) {
        const int gr = sm90_grouped(hc, d, 16), pp_gr = sm90_grouped(hc, d, 4);
        plan->row[SMOE_GEMM_DXT] = d < 256                                      ? 4
                                   : (hc <= 512 || (hc <= 1024 && d % 192 == 0)) ? pp_gr
                                   : hc <= 1024                                  ? 0
                                                                                 : 2 + gr;
    }
    /* dh (K = d, N = n): the 128 x 128 ping-pong where d <= 1536, so that
     * one consumer's epilogue (H's loads, dS) runs beside the other's main
     * loop. bench_gemm on an H200 (session 30): 1.3-5.6% faster than the
     * 128 x 256 tiles at the 1.4B and 7B rows (d = 768, 1536), 0-15% slower
     * from d = 2048 on (30B, 120B, every model shape), where the main loop
     * is long enough to hide the epilogue without it. */
    {
        const int gr = sm90_grouped(d, n, 16), dyn = d >= 4096 && sm90_grouped(d, n, 10);
        plan->row[SMOE_GEMM_DH] = n < 256                      ? 4
                                  : (n % 256 != 0 && n % 192 == 0) ? 5
                                  : (p->gated && E <= 256)         ? (d <= 1536 ? 8 : dyn ? 7 : gr)
                                                                   : 2 + gr;
    }
    /* dw2 (M = d, N = n), dw1 (M = d, N = h_cols): grouped and in pairs
     * along M where N >= 8192, else row order (sm90_vk_rows) */
    plan->row[SMOE_GEMM_DW2] = sm90_vk_grouped(n) ? 3 : 0;
    plan->row[SMOE_GEMM_DW1] = sm90_vk_grouped(hc) ? 3 : 0;
}

/* The plan's row for GEMM g, checked against p's shape. */
static smoe_status sm90_row_of(const smoe_gemm_problem *p, int g, const char *op, int *row)
{
    if (!p->plan)
        return smoe_fail(SMOE_ERROR_INTERNAL, "sm90 %s: no plan (smoe_gemm_problem.plan)", op);
    *row = p->plan->row[g];
    if (*row < 0)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 %s: the plan has no Hopper kernel for it",
                         op);
    return sm90_row_fits_op(p, g, *row, op) ? SMOE_SUCCESS : SMOE_ERROR_UNSUPPORTED;
}

/* dh's partial dS sums: (ceil(n / BN), cap) fp32, sized for BN = 128 so that
 * every dh row fits; then, 16-byte aligned, the claim counter of the
 * SM90_FL_DYN rows. */
static size_t sm90_scratch_bytes(const smoe_gemm_problem *p)
{
    return (((size_t)((p->n + 127) / 128) * (size_t)p->cap * sizeof(float) + 15) & ~(size_t)15) +
           16;
}

/* The parameters every mode shares; the launchers fill in the rest. */
static sm90_gemm_params sm90_params(const smoe_gemm_problem *p, int64_t K, int64_t N,
                                   const sm90_row *row)
{
    sm90_gemm_params prm;
    memset(&prm, 0, sizeof(prm));
    prm.expert_offset = p->expert_offset;
    prm.off_stride = p->off_stride > 1 ? p->off_stride : 1;
    prm.row_token = p->row_token;
    prm.E = (int)p->E;
    prm.K = (int)K;
    prm.N = (int)N;
    prm.n = (int)p->n;
    prm.cap = p->cap;
    prm.h_cols = (int)p->h_cols;
    prm.abort = p->abort;
    prm.raster_gm = (row->fl & SM90_FL_RASTER) ? 16 : 0;
    return prm;
}

/* Row `row` of MODE's table, launched. */
template <int MODE>
static smoe_status sm90_run_row(int row, const smoe_gemm_problem *p, const CUtensorMap *ma,
                                const CUtensorMap *mb, const CUtensorMap *mc,
                                const sm90_gemm_params *prm, cudaStream_t s, const char *op)
{
#define SM90_CASE(i, name, bn, st, fl, need)                                                     \
    case i: return sm90_launch<bn, st, MODE, fl>(p, ma, mb, mc, prm, s, op);
    if constexpr (MODE == SM90_MODE_UP) {
        switch (row) { SM90_UP_ROWS(SM90_CASE) }
    } else if constexpr (MODE == SM90_MODE_DOWN) {
        switch (row) { SM90_DOWN_ROWS(SM90_CASE) }
    } else if constexpr (MODE == SM90_MODE_DXT) {
        switch (row) { SM90_DXT_ROWS(SM90_CASE) }
    } else {
        switch (row) { SM90_DH_ROWS(SM90_CASE) }
    }
#undef SM90_CASE
    return smoe_fail(SMOE_ERROR_INTERNAL, "sm90 %s: row %d", op, row);
}

static smoe_status sm90_up(const smoe_gemm_problem *p, const bf16 *x, const bf16 *w1,
                           const bf16 *b1, bf16 *h, bf16 *a, void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "up"));
    int row = -1;
    SMOE_FORWARD_IF_ERROR(sm90_row_of(p, SMOE_GEMM_UP, "up", &row));
    if (sm90_misaligned(x) || sm90_misaligned(w1) || sm90_misaligned(h) || sm90_misaligned(a))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 up: x, w1, h, a must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    const sm90_row *R = &sm90_up_rows[row];
    sm90_gemm_params prm = sm90_params(p, p->d, p->h_cols, R);
    prm.a_src = x;
    prm.bias = b1;
    prm.out0 = h;
    prm.out1 = a;
    prm.gated = p->gated;
    prm.act = (int)p->act;
    prm.concat = p->gated && p->w1_layout == SMOE_W1_CONCATENATED;
    CUtensorMap mb;
    SMOE_FORWARD_IF_ERROR(
        smoe_sm90_make_map(&mb, w1, p->E * p->h_cols, p->d, prm.concat ? R->bn / 2 : R->bn, "w1"));
    return sm90_run_row<SM90_MODE_UP>(row, p, &mb, &mb, &mb, &prm, s, "up");
}

static smoe_status sm90_down(const smoe_gemm_problem *p, const bf16 *a, const bf16 *w2,
                             const bf16 *b2, bf16 *y, void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "down"));
    int row = -1;
    SMOE_FORWARD_IF_ERROR(sm90_row_of(p, SMOE_GEMM_DOWN, "down", &row));
    if (sm90_misaligned(a) || sm90_misaligned(w2) || sm90_misaligned(y))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 down: a, w2, y must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    const sm90_row *R = &sm90_down_rows[row];
    sm90_gemm_params prm = sm90_params(p, p->n, p->d, R);
    prm.bias = b2;
    prm.out0 = y;
    CUtensorMap ma, mb, mc;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&ma, a, p->cap, p->n, SM90_BM, "a"));
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w2, p->E * p->d, p->n, R->bn, "w2"));
    mc = mb;
    if (R->fl & SM90_FL_TMA_ST2) /* Y's map for the TMA stores */
        SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mc, y, p->cap, p->d, 64, "y"));
    return sm90_run_row<SM90_MODE_DOWN>(row, p, &ma, &mb, &mc, &prm, s, "down");
}

static smoe_status sm90_dxt(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *w1, bf16 *dxt,
                            void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "dxt"));
    if (p->gated && p->w1_layout == SMOE_W1_CONCATENATED)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "sm90 dxt: the concatenated W1 layout is not supported (its rows are not "
                         "in dH's column order)");
    int row = -1;
    SMOE_FORWARD_IF_ERROR(sm90_row_of(p, SMOE_GEMM_DXT, "dxt", &row));
    if (sm90_misaligned(dh) || sm90_misaligned(w1) || sm90_misaligned(dxt))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED, "sm90 dxt: dh, w1, dxt must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    const sm90_row *R = &sm90_dxt_rows[row];
    sm90_gemm_params prm = sm90_params(p, p->h_cols, p->d, R);
    prm.out0 = dxt;
    CUtensorMap ma, mb;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&ma, dh, p->cap, p->h_cols, SM90_BM, "dh"));
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w1, p->E * p->h_cols, p->d, 64, "w1"));
    return sm90_run_row<SM90_MODE_DXT>(row, p, &ma, &mb, &mb, &prm, s, "dxt");
}

static smoe_status sm90_dh(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *w2,
                           const bf16 *b2, const bf16 *h, bf16 *dh, bf16 *a_scaled, float *ds,
                           void *scratch, cudaStream_t s)
{
    SMOE_FORWARD_IF_ERROR(sm90_check_common(p, "dh"));
    int row = -1;
    SMOE_FORWARD_IF_ERROR(sm90_row_of(p, SMOE_GEMM_DH, "dh", &row));
    if (sm90_misaligned(dout) || sm90_misaligned(w2) || sm90_misaligned(h) ||
        sm90_misaligned(dh) || sm90_misaligned(a_scaled) || sm90_misaligned(b2))
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "sm90 dh: dout, w2, b2, h, dh, a_scaled must be 16-byte aligned");
    if (p->cap == 0 || p->E == 0) return SMOE_SUCCESS;
    if (!scratch || !p->row_score)
        return smoe_fail(SMOE_ERROR_INTERNAL, "sm90 dh: scratch and row_score are required");
    const sm90_row *R = &sm90_dh_rows[row];
    sm90_gemm_params prm = sm90_params(p, p->d, p->n, R);
    prm.a_src = dout;
    prm.out0 = dh;
    prm.out1 = a_scaled;
    prm.gated = p->gated;
    prm.act = (int)p->act;
    prm.h_in = h;
    prm.score = p->row_score;
    prm.dsp = (float *)scratch;
    if (R->fl & SM90_FL_DYN) { /* the claim counter, zeroed for this launch */
        int *tc = sm90_dyn_counter(prm);
        const cudaError_t err = cudaMemsetAsync(tc, 0, sizeof(int), s);
        if (err != cudaSuccess)
            return smoe_fail(SMOE_ERROR_BACKEND, "sm90 dh: zeroing the tile counter: %s",
                             cudaGetErrorString(err));
    }
    /* map_a: A''s output map (TMA stores), map_b W2, map_c dH's */
    CUtensorMap ma, mb, mc;
    SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mb, w2, p->E * p->d, p->n, 64, "w2"));
    ma = mc = mb;
    if (R->fl & SM90_FL_TMA_ST2) {
        /* 16-row boxes: each warp stores its own rows (ep_pair_out_warp) */
        SMOE_FORWARD_IF_ERROR(smoe_sm90_make_map(&mc, dh, p->cap, p->h_cols, 16, "dh"));
        SMOE_FORWARD_IF_ERROR(sm90_make_map_box(&ma, a_scaled, p->cap, p->n, 32, 16,
                                                CU_TENSOR_MAP_SWIZZLE_64B, "a_scaled"));
    }
    SMOE_FORWARD_IF_ERROR(sm90_run_row<SM90_MODE_DH>(row, p, &ma, &mb, &mc, &prm, s, "dh"));
    return smoe_ds_reduce(p, (const float *)scratch, (int)((p->n + R->bn - 1) / R->bn), dout, b2,
                          ds, s);
}

/* The weight-gradient GEMMs (varlen-K) are in varlen_k_sm90.cu; their one
 * row needs nothing of the plan. */
extern "C" smoe_status smoe_sm90_dw2(const smoe_gemm_problem *p, const bf16 *dout,
                                     const bf16 *a_scaled, void *dw2, smoe_dtype out_dtype,
                                     int accumulate, void *scratch, cudaStream_t s);
extern "C" smoe_status smoe_sm90_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                                     void *dw1, smoe_dtype out_dtype, int accumulate,
                                     void *scratch, cudaStream_t s);

extern "C" const smoe_gemm_ops smoe_gemm_ops_sm90 = {
    /* name          */ "tma+wgmma",
    /* scratch_bytes */ sm90_scratch_bytes,
    /* up            */ sm90_up,
    /* down          */ sm90_down,
    /* dh            */ sm90_dh,
    /* dw2           */ smoe_sm90_dw2,
    /* dxt           */ sm90_dxt,
    /* dw1           */ smoe_sm90_dw1,
    /* plan          */ sm90_plan,
    /* row_name      */ sm90_row_name,
    /* row_fits      */ sm90_row_fits,
};
