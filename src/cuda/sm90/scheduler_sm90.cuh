/*
 * scheduler_sm90.cuh -- the varlen-M tile scheduler: a persistent CTA
 * takes tiles b, b + grid, ...; a tile index becomes (expert, n-tile,
 * m-tile) through the per-expert tile prefix sum (tile_start, built in
 * shared memory from expert_offset on the device) by binary search.
 */
#ifndef SMOE_SCHEDULER_SM90_CUH
#define SMOE_SCHEDULER_SM90_CUH

#include "cuda/sm90/config_sm90.cuh"

typedef struct sm90_tile {
    int e, n_tile;
    int row0, row_end; /* first row of the tile, end of the expert's rows */
} sm90_tile;

/* Tile t: expert, n-tile and m-tile. Within
 * an expert the tiles run row-major (gm == 0: every n-tile of one m-tile,
 * then the next m-tile) or in groups of gm m-tiles, column-major inside a
 * group, so that the tiles in flight at once share fewer weight columns.
 */
__device__ __forceinline__ sm90_tile sm90_tile_decode(int t, const int *tile_start, int E, int nt,
                                                      const int32_t *expert_offset, int os, int gm)
{
    int lo = 0, hi = E; /* tile_start[lo] <= t < tile_start[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (tile_start[mid] <= t) lo = mid; else hi = mid;
    }
    sm90_tile tl;
    int local = t - tile_start[lo];
    tl.e = lo;
    if (gm > 1) {
        const int mt = (tile_start[lo + 1] - tile_start[lo]) / nt;
        const int first = local / (gm * nt) * gm;
        const int rows = min(gm, mt - first), idx = local - first * nt;
        tl.n_tile = idx / rows;
        tl.row0 = __ldg(expert_offset + lo * os) + (first + idx % rows) * SM90_BM;
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

#endif /* SMOE_SCHEDULER_SM90_CUH */
