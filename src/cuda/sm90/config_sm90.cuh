/*
 * config_sm90.cuh -- the Hopper varlen-M GEMMs' constants, kernel
 * shapes (the FL flags the tile table combines), parameters and shared-
 * memory budget (grouped_gemm_sm90.cu composes the kernel from these and
 * scheduler_sm90.cuh, mainloop_sm90.cuh, epilogue_sm90.cuh).
 */
#ifndef SMOE_CONFIG_SM90_CUH
#define SMOE_CONFIG_SM90_CUH

#include "cuda/gemm.h"
#include "cuda/sm90/ptx_sm90.cuh"

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
/* up's epilogue warps (SM90_FL_EPIWG): the producer warpgroup holds them */
#define SM90_EPIWG_PRODUCER_REGS 96
#define SM90_EPIWG_CONSUMER_REGS 200
static_assert(SM90_PRODUCER_REGS + 2 * SM90_CONSUMER_REGS <= 3 * SM90_LAUNCH_REGS,
              "setmaxnreg budget past the launch allocation");
static_assert(SM90_GATHER_PRODUCER_REGS + 2 * SM90_GATHER_CONSUMER_REGS <= 3 * SM90_LAUNCH_REGS,
              "setmaxnreg budget past the launch allocation");
static_assert(SM90_EPIWG_PRODUCER_REGS + 2 * SM90_EPIWG_CONSUMER_REGS <= 3 * SM90_LAUNCH_REGS,
              "setmaxnreg budget past the launch allocation");
/* Kernel shapes (template parameter FL), combined by the rows of the tile
 * table (host side, below):
 *  SM90_FL_WS      up, BN = 128: one producer warp gathers a whole stage
 *                  (four stages in flight on four warps).
 *  SM90_FL_PP      down / dxt, 128 x 192 ping-pong: each consumer
 *                  warpgroup owns whole tiles (alternate tiles of the CTA),
 *                  so one warpgroup's epilogue runs under the other's main
 *                  loop; 5 stages of 40 KiB, 192 accumulators per thread
 *                  (SonicMoE's H100 down-projection tile).
 *  SM90_FL_RASTER  the tiles of an expert in groups of p.raster_gm m-tiles
 *                  (sm90_tile_decode), so the tiles in flight share fewer
 *                  weight columns; a flag of its own so that the row-major
 *                  kernels carry no grouped-order code (as a runtime branch
 *                  in every kernel some forwards read 1-2% lower).
 *  SM90_FL_TMA_ST2 down (and dh), BN = 256, 4 stages, E <= 256: each
 *                  64-column chunk of a warpgroup's block goes to one of
 *                  two 8 KiB buffers and leaves by TMA store; a buffer is
 *                  refilled once its store two chunks back has read it, so
 *                  the last chunks drain under the next main loop. Fits
 *                  beside four stages because its tile_start table holds
 *                  257 entries (not 1025) and it has no WS slots. dh stores
 *                  dH and A' through an 8 KiB and a 4 KiB buffer per
 *                  warpgroup, single-buffered, 32 units at a time
 *                  (ep_dh_tma); otherwise dh's epilogue is ep_dh_direct.
 *  SM90_FL_EPIWG   up, cooperative 128 x 256, 3 stages: the consumers only
 *                  round the tile (bias added) into a padded staging copy of
 *                  the whole tile (8 units of 64 x 64) and go on to the next
 *                  tile's main loop; warps 2-3 of the producer warpgroup
 *                  (the epilogue warps; warps 0-1 gather, 16 rows each per
 *                  stage) store H from it and compute and store A
 *                  (ep_flush_up_ct), so up's epilogue runs under the next
 *                  main loop. (A fourth warpgroup would cap every thread at
 *                  128 registers, too few for the m64n256 wgmma.) Two
 *                  mbarriers hand the staging over: full (256 consumer
 *                  arrivals), empty (64 epilogue arrivals).
 *  SM90_FL_DYN     dh, cooperative: the CTA's next tile is claimed from a
 *                  counter in global memory (sm90_dyn_counter, zeroed by
 *                  the launcher before each launch) instead of taken as tile
 *                  cid + j ncl, so the tiles start in index order whatever
 *                  each tile cost, and the tiles that share an operand (an
 *                  expert's m-tiles share its weight slice, its n-tiles
 *                  the gathered rows) still run at the same time, which is
 *                  what keeps that operand in L2. Under random routing
 *                  some m-tiles hold a few rows and finish early; with the
 *                  static order the CTAs then drift apart and DeepSeek-V3's
 *                  dh read its operands from DRAM 2.3 times over
 *                  (notes/sm90_log.md rung 20). The producer's thread 0
 *                  claims (a few k-blocks before its tile's last) and
 *                  passes the tile on through a ring of 8 slots in shared
 *                  memory, written before the tile's first full-barrier
 *                  arrival; a tile index >= total ends the CTA: the
 *                  producer fills no stage for it but arrives on the next
 *                  stage's full barrier, and the consumers read the slot,
 *                  release that stage and leave.
 * Measured and retired (the numbers in notes/sm90_log.md; the code in git):
 * ping-pong 128 x 128 up and dh (rung 6), 2-CTA clusters with weight
 * multicast (rung 7; again in session 24 along N and along M for down /
 * dxt: even in the layer, rung 21, branch exp/cluster-pairs), cooperative
 * 128 x 192 down / dxt, the TMA-store
 * epilogue for dxt, ping-pong 192 in the grouped order, dh's H by TMA
 * through a slot ring (rung 12 item 9), dw1 gathered along N (rung 11):
 * all in the history up to commit 3a13394, behind the variant hook this
 * table replaced; the whole tile staged and stored by TMA, evict-first
 * stores and storer warps (rungs 9-10, commit 4efa11a); up's H and A by
 * TMA (c461f84); down with the weight tile resident (94709c7); the
 * weight gradients' 4 stages beside a staged tile of one piece at a time
 * and dw1 transposed for fp32 and accumulated outputs (rung 22, branch
 * exp/dw1-trans-f32); up as a 128 x 192 ping-pong and up's epilogue in a
 * fourth warpgroup (rung 25, branches exp/up-pp192 and exp/up-epi4). */
enum {
    SM90_FL_WS = 1,
    SM90_FL_PP = 2,
    SM90_FL_RASTER = 16,
    SM90_FL_TMA_ST2 = 128,
    SM90_FL_EPIWG = 512,
    SM90_FL_DYN = 1024
};

/* 64 x 64 staging units (SM90_EP_BYTES each) of the padded staging: one per
 * consumer warpgroup, or with SM90_FL_EPIWG the whole 128 x 256 tile. */
__host__ __device__ constexpr int sm90_epu(int fl) { return (fl & SM90_FL_EPIWG) ? 8 : 2; }

/* mbarriers besides the main loop's: the staging's full and empty
 * (SM90_FL_EPIWG) */
__host__ __device__ constexpr int sm90_xbar(int fl) { return (fl & SM90_FL_EPIWG) ? 2 : 0; }

/* The claimed tiles' ring (SM90_FL_DYN): 8 ints, counted in 8-byte words
 * after the mbarriers. */
#define SM90_DYN_SLOTS 8
__host__ __device__ constexpr int sm90_dynw(int fl) { return (fl & SM90_FL_DYN) ? 4 : 0; }

/* 8 KiB epilogue buffers per consumer warpgroup: two with SM90_FL_TMA_ST2,
 * none otherwise (the padded staging buffers). */
__host__ __device__ constexpr int sm90_epb(int fl) { return (fl & SM90_FL_TMA_ST2) ? 2 : 0; }

enum { SM90_MODE_UP = 0, SM90_MODE_DOWN = 1, SM90_MODE_DXT = 2, SM90_MODE_DH = 3 };

typedef struct sm90_gemm_params {
    const bf16 *a_src;            /* up: X (T, K) gathered by row_token */
    const bf16 *bias;             /* up: b1 (E, h_cols); down: b2 (E, N); may be NULL */
    bf16 *out0;                   /* up: H (cap, N), may be NULL; down: Y (cap, N) */
    bf16 *out1;                   /* up: A (cap, n) */
    const int32_t *expert_offset; /* (E+1), or a view's: smoe_gemm_problem */
    const int32_t *row_token;     /* (cap) */
    int off_stride;               /* >= 1: expert e's rows from expert_offset[e off_stride] */
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
    int raster_gm; /* tile order within an expert: 0 row-major, else groups of gm m-tiles */
    const int *abort; /* smoe_gemm_problem.abort */
} sm90_gemm_params;

/* SM90_FL_DYN (dh): the claim counter, after the dS partials in dh's scratch,
 * 16-byte aligned (sm90_scratch_bytes); zero at launch. (Not a field of its
 * own: one more pointer in the parameters moved ptxas's register allocation
 * in every kernel, spills included.) */
__host__ __device__ __forceinline__ int *sm90_dyn_counter(const sm90_gemm_params &p)
{
    const int64_t ds = ((int64_t)((p.n + 127) / 128) * p.cap * 4 + 15) & ~(int64_t)15;
    return (int *)((char *)p.dsp + ds);
}

/* Per consumer warpgroup: 64 rows x 64 bf16, rows padded to 144 bytes so the
 * accumulator-layout writes and the row-segment reads avoid bank conflicts. */
#define SM90_EP_STRIDE 144
#define SM90_EP_BYTES (64 * SM90_EP_STRIDE)

template <int BN, int STAGES, int EPB = 0, int EPU = 2, int XBAR = 0>
struct sm90_tile_cfg {
    static constexpr int A_BYTES = SM90_BM * SM90_BK * 2;
    static constexpr int B_BYTES = BN * SM90_BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    /* epilogue buffers: two 64-column chunk buffers (one per consumer
     * warpgroup), or EPB 8 KiB buffers per warpgroup */
    static constexpr int EP_TOTAL = EPB ? 2 * EPB * 8192 : EPU * SM90_EP_BYTES;
    static constexpr int HBAR_BYTES = XBAR * 8; /* sm90_xbar's and sm90_dynw's */
    /* EPB > 0: tile_start for E <= 256 and no WS token slots */
    static constexpr int SMEM_BYTES =
        EPB ? 1024 + STAGES * STAGE_BYTES + EP_TOTAL + 2 * STAGES * 8 + HBAR_BYTES + (256 + 1) * 4
              : 1024 + STAGES * STAGE_BYTES + EP_TOTAL + 2 * STAGES * 8 + HBAR_BYTES +
                    (SM90_MAX_EXPERTS + 1) * 4 + 2 * 128 * 4;
    static_assert(STAGE_BYTES % 1024 == 0, "stages must keep 1024-byte alignment");
    static_assert(SMEM_BYTES <= 227 * 1024, "shared memory budget");
};

/* What a kernel <BN, STAGES, MODE, FL> is, at compile time. */
template <int BN, int STAGES, int MODE, int FL>
struct sm90_traits {
    typedef sm90_tile_cfg<BN, STAGES, sm90_epb(FL), sm90_epu(FL), sm90_xbar(FL) + sm90_dynw(FL)>
        cfg;
    static constexpr bool GATHER = MODE == SM90_MODE_UP || MODE == SM90_MODE_DH;
    /* B stored K x N, N contiguous: W1 for dxt, W2 for dh */
    static constexpr bool TRANS_B = MODE == SM90_MODE_DXT || MODE == SM90_MODE_DH;
    static constexpr int NACC = BN / 2; /* accumulators of one m64 x BN block */
    static constexpr bool WS = (FL & SM90_FL_WS) != 0;
    /* gather tokens in registers, loaded once per tile (not reloaded from
     * shared memory per k-block: that dependent chain stalled the
     * producer; notes/sm90_log.md, rung 6) */
    static constexpr bool TOKREG = GATHER && !WS;
    static constexpr bool PP = (FL & SM90_FL_PP) != 0;
    static constexpr int MH = PP ? 2 : 1; /* m64 blocks per consumer warpgroup */
    static constexpr bool TMA_ST2 = (FL & SM90_FL_TMA_ST2) != 0;
    static constexpr bool EPIWG = (FL & SM90_FL_EPIWG) != 0;
    static_assert(!TMA_ST2 || (BN == 256 && (FL & (SM90_FL_PP | SM90_FL_WS)) == 0) ||
                      (MODE == SM90_MODE_DH && BN == 128 && (FL & SM90_FL_PP) != 0),
                  "the double-buffered TMA-store epilogue is for cooperative 128 x 256 tiles "
                  "and dh's 128 x 128 ping-pong");
    static_assert(!EPIWG || (MODE == SM90_MODE_UP && BN == 256 &&
                             (FL & ~(SM90_FL_EPIWG | SM90_FL_RASTER)) == 0),
                  "the epilogue warps are for the cooperative 128 x 256 up");
    static_assert(!PP || (BN == 192 && !GATHER) || (BN == 128 && MODE == SM90_MODE_DH),
                  "ping-pong tiles are 128 x 192 (down / dxt) or 128 x 128 (dh)");
    static_assert(!(WS && PP), "the warp-per-stage gather stands alone");
    static constexpr bool DYN = (FL & SM90_FL_DYN) != 0;
    static_assert(!DYN || (MODE == SM90_MODE_DH &&
                           (FL & (SM90_FL_PP | SM90_FL_WS | SM90_FL_EPIWG)) == 0),
                  "claimed tiles: dh (its scratch holds the counter), cooperative");
};

/* A CTA's shared memory and schedule, as the kernel lays them out. */
typedef struct sm90_ctx {
    uint8_t *smem;           /* STAGES stages of A and B tiles, 1024-byte aligned */
    uint8_t *ep_base;        /* the epilogue's buffers (cfg::EP_TOTAL bytes) */
    uint64_t *full, *empty;  /* the stages' mbarriers */
    uint64_t *stg;           /* EPIWG's staging full / empty */
    const int *tile_start;   /* (E + 1) per-expert tile prefix sum */
    int32_t *tok_slots;      /* WS: 2 x 128 tile tokens */
    int nt, kb_count, total; /* n-tiles, k-blocks per tile, tiles */
    int gm;                  /* the tile order's group (0: row-major) */
    int cid, ncl;            /* this CTA takes tiles cid, cid + ncl, ... */
    int *dyn;                /* SM90_FL_DYN: the claimed tiles' ring */
} sm90_ctx;

/* ------------------------------------------------------------ bias */

__device__ __forceinline__ float load_bias(const bf16 *b, int64_t i)
{
    return b ? __bfloat162float(b[i]) : 0.0f;
}

#endif /* SMOE_CONFIG_SM90_CUH */
