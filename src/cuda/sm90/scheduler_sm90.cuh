/*
 * scheduler_sm90.cuh -- the tile schedulers: varlen-M's (sm90_tile_decode:
 * a tile index becomes (expert, n-tile, m-tile) through the per-expert
 * tile prefix sum, tile_start, built in shared memory from expert_offset on
 * the device, by binary search) and varlen-K's (sm90_vk_tile_decode: its
 * tiles walk the output, tiles_m x tiles_n per expert, so one division
 * finds the expert). Both are static and persistent (CTA b takes tiles b,
 * b + grid, ...), and within an expert both take row order or the grouped
 * order (sm90_tile_group_of).
 */
#ifndef SMOE_SCHEDULER_SM90_CUH
#define SMOE_SCHEDULER_SM90_CUH

#include "cuda/sm90/config_sm90.cuh"

/* The grouped tile order, within one expert's tiles_m x tiles_n tiles:
 * groups of gm m-tiles (the last group shorter), column-major inside a
 * group (m fastest), so that the tiles in flight at once share fewer
 * weight columns (varlen-M) or fewer slices of both operands (varlen-K)
 * than in row order (n fastest: every n-tile of one m-tile, then the next
 * m-tile), which both schedulers take otherwise. Tile `local` is tile idx
 * of the group of `rows` m-tiles from m-tile `first`: its m-tile is
 * first + idx % rows, its n-tile idx / rows. The callers make that split
 * themselves: varlen-M reads the expert's first row between the two, as
 * the kernels it was measured with did. */
typedef struct sm90_tile_group {
    int first, rows, idx;
} sm90_tile_group;

__host__ __device__ __forceinline__ sm90_tile_group sm90_tile_group_of(int local, int tiles_m,
                                                                       int tiles_n, int gm)
{
    sm90_tile_group g;
    g.first = local / (gm * tiles_n) * gm;
    g.rows = min(gm, tiles_m - g.first);
    g.idx = local - g.first * tiles_n;
    return g;
}

/* ------------------------------------------------------------ varlen-M */

typedef struct sm90_tile {
    int e, n_tile;
    int row0, row_end; /* first row of the tile, end of the expert's rows */
} sm90_tile;

/* Tile t: expert, n-tile and first row. The m-tiles of expert e are its
 * rows in blocks of SM90_BM; gm > 1 (SM90_FL_RASTER's p.raster_gm) takes the
 * grouped order, else row order (gm is a constant 0 in the other kernels). */
__device__ __forceinline__ sm90_tile sm90_tile_decode(int t, const int *tile_start, int E, int nt,
                                                      const int32_t *expert_offset, int os, int gm)
{
    int lo = 0, hi = E; /* tile_start[lo] <= t < tile_start[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (tile_start[mid] <= t) lo = mid; else hi = mid;
    }
    sm90_tile tl;
    const int local = t - tile_start[lo];
    tl.e = lo;
    if (gm > 1) {
        const sm90_tile_group g =
            sm90_tile_group_of(local, (tile_start[lo + 1] - tile_start[lo]) / nt, nt, gm);
        tl.n_tile = g.idx / g.rows;
        tl.row0 = __ldg(expert_offset + lo * os) + (g.first + g.idx % g.rows) * SM90_BM;
    } else {
        tl.n_tile = local % nt;
        tl.row0 = __ldg(expert_offset + lo * os) + (local / nt) * SM90_BM;
    }
    tl.row_end = __ldg(expert_offset + lo * os + 1);
    return tl;
}

/* tile_start = the exclusive prefix sum of the experts' tile counts
 * (ceil(count_e / BM) x nt), by one warp (lane = its lane). */
__device__ __forceinline__ void sm90_tile_starts(const sm90_gemm_params &p, int nt, int *tile_start,
                                                 int lane)
{
    int carry = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
        int e = e0 + lane, v = 0;
        if (e < p.E) {
            const int32_t *o = p.expert_offset + e * p.off_stride;
            int cnt = __ldg(o + 1) - __ldg(o);
            v = (cnt + SM90_BM - 1) / SM90_BM * nt;
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        if (e < p.E) tile_start[e + 1] = carry + v;
        carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) tile_start[0] = 0;
}

/* ------------------------------------------------------------ varlen-K */

/* A varlen-K GEMM's output tiles (the host fills it): every expert has
 * tiles_m x tiles_n of them, whatever its row count, so the host knows
 * their number. */
typedef struct sm90_vk_sched {
    int tiles_m, tiles_n, total; /* total = E tiles_m tiles_n */
    int gm;                      /* the grouped order's group of m-tiles */
} sm90_vk_sched;

typedef struct sm90_vk_tile {
    int e, m_tile, n_tile;
} sm90_vk_tile;

/* Output tile `tile`: expert, m-tile and n-tile, the expert's tiles in row
 * order or `grouped` (VK_F_GROUPED): the ~num_sms tiles in flight then read
 * gm slices of the M-side operand and about num_sms / gm of the N-side
 * one, instead of one or two M slices and every N slice of the expert (for
 * one expert's output of 32 x 112 tiles, Mixtral's dW1, that re-read dH
 * from DRAM once per m-tile). */
__device__ __forceinline__ sm90_vk_tile sm90_vk_tile_decode(const sm90_vk_sched &s, int tile,
                                                            bool grouped)
{
    const int per_e = s.tiles_m * s.tiles_n;
    sm90_vk_tile tl;
    tl.e = tile / per_e;
    const int local = tile - tl.e * per_e;
    if (grouped) {
        const sm90_tile_group g = sm90_tile_group_of(local, s.tiles_m, s.tiles_n, s.gm);
        tl.n_tile = g.idx / g.rows;
        tl.m_tile = g.first + (g.idx - tl.n_tile * g.rows); /* idx % rows */
    } else {
        tl.m_tile = local / s.tiles_n;
        tl.n_tile = local - tl.m_tile * s.tiles_n;
    }
    return tl;
}

#endif /* SMOE_SCHEDULER_SM90_CUH */
