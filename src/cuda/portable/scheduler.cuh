/*
 * scheduler.cuh -- which output tile a CTA of the portable grouped GEMM
 * computes. Tiles are ordered by m-tile, then n-tile (n-tiles vary fastest
 * so the CTAs resident together share the gathered A rows and one
 * expert's weight); nothing is read on the host.
 *
 *  - varlen-M (up, down, dh, dxt), one CTA per tile: the grid is sized for
 *    the worst case, tiles_n * (ceil(cap/BM) + E) CTAs; each CTA finds its
 *    expert and m-tile with a warp-wide prefix sum over ceil(count_e/BM)
 *    read from off[]; CTAs past the last tile exit.
 *  - varlen-K (dw1, dw2), one CTA per tile: E * tiles_m * tiles_n CTAs,
 *    each running over its expert's rows.
 *  - Persistent grids: as many CTAs as fit at once walk the same order
 *    with a stride of the grid; off[] and varlen-M's m-tile prefix sums
 *    sit in shared memory (E <= GG_PERS_EMAX), so finding a tile is a
 *    binary search there, not a search through global memory.
 */
#ifndef SMOE_PORTABLE_SCHEDULER_CUH
#define SMOE_PORTABLE_SCHEDULER_CUH

#include "cuda/portable/config.cuh"

/* The tile of this CTA in a one-CTA-per-tile grid: expert e, M range
 * [m0, m_lim), N-tile, K range. false: none (a varlen-M CTA past the last
 * tile, or a varlen-K tile of an empty expert when accumulating, which
 * stays untouched). Every thread of the CTA calls it. */
template <int BM, bool VARLEN_K>
static __device__ __forceinline__ bool gg_block_tile(const gg_args &p, int warp, int lane,
                                                     gg_tile &tl)
{
    __shared__ int64_t s_info[3];
    if (!VARLEN_K) {
        const int64_t mt = blockIdx.x / p.tiles_n;
        tl.n_tile = (int)(blockIdx.x % p.tiles_n);
        if (warp == 0) {
            /* Tiles of expert e: ceil(count_e / BM); prefix sum 32 experts
             * at a time. */
            int64_t running = 0, found_e = -1, found_t = 0;
            for (int base = 0; base < p.E && found_e < 0; base += 32) {
                int ex = base + lane;
                int tiles = 0;
                if (ex < p.E) tiles = (p.off[ex + 1] - p.off[ex] + BM - 1) / BM;
                int incl = tiles;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    int v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                unsigned hit = __ballot_sync(0xffffffffu, ex < p.E && running + incl > mt);
                if (hit) {
                    int l = __ffs(hit) - 1;
                    int excl = __shfl_sync(0xffffffffu, incl - tiles, l);
                    found_e = base + l;
                    found_t = mt - running - excl;
                }
                running += __shfl_sync(0xffffffffu, incl, 31);
            }
            if (lane == 0) {
                s_info[0] = found_e;
                s_info[1] = found_e >= 0 ? p.off[found_e] + found_t * BM : 0;
                s_info[2] = found_e >= 0 ? p.off[found_e + 1] : 0;
            }
        }
        __syncthreads();
        tl.e = (int)s_info[0];
        if (tl.e < 0) return false;
        tl.m0 = s_info[1];
        tl.m_lim = s_info[2];
        tl.k_begin = 0;
        tl.k_end = p.K;
    } else {
        const int per_e = p.tiles_m * p.tiles_n;
        tl.e = blockIdx.x / per_e;
        const int rem = blockIdx.x % per_e;
        tl.n_tile = rem % p.tiles_n;
        tl.m0 = (int64_t)(rem / p.tiles_n) * BM;
        tl.m_lim = p.M;
        tl.k_begin = p.off[tl.e];
        tl.k_end = p.off[tl.e + 1];
        if (tl.k_end == tl.k_begin && p.accumulate) return false; /* untouched */
    }
    return true;
}

/* A persistent grid's tables in shared memory: s_off = off[0..E] and, for
 * varlen-M, s_ts = the first m-tile of each expert (s_ts[E] = the m-tiles
 * in all). Every thread of the CTA calls it; on return the tables are
 * visible to all. */
template <int BM, bool VARLEN_K, int NT>
static __device__ __forceinline__ void gg_pers_tables(const gg_args &p, int *s_off, int *s_ts,
                                                      int tid, int warp, int lane)
{
    for (int i = tid; i <= p.E; i += NT) s_off[i] = p.off[i];
    __syncthreads();
    if (!VARLEN_K && warp == 0) {
        int running = 0;
        for (int base = 0; base < p.E; base += 32) {
            const int ex = base + lane;
            const int tiles = ex < p.E ? (s_off[ex + 1] - s_off[ex] + BM - 1) / BM : 0;
            int incl = tiles;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            if (ex < p.E) s_ts[ex] = running + incl - tiles;
            running += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) s_ts[p.E] = running;
    }
    __syncthreads();
}

/* Tile t of a persistent grid (see gg_pers_next) from the tables in shared
 * memory: s_off = off[0..E], s_ts = varlen-M's first tile of each expert
 * (s_ts[E] = the m-tiles in all). */
template <int BM, bool VARLEN_K>
static __device__ __forceinline__ gg_tile gg_pers_tile(const gg_args &p, const int *s_off,
                                                       const int *s_ts, int t)
{
    gg_tile tl;
    if (!VARLEN_K) {
        const int mt = t / p.tiles_n;
        tl.n_tile = t % p.tiles_n;
        int lo = 0, hi = p.E; /* the last e with s_ts[e] <= mt (s_ts[0] = 0) */
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (s_ts[mid] <= mt) lo = mid;
            else hi = mid;
        }
        tl.e = lo;
        tl.m0 = s_off[lo] + (int64_t)(mt - s_ts[lo]) * BM;
        tl.m_lim = s_off[lo + 1];
        tl.k_begin = 0;
        tl.k_end = p.K;
    } else {
        const int per_e = p.tiles_m * p.tiles_n;
        tl.e = t / per_e;
        const int rem = t % per_e;
        tl.n_tile = rem % p.tiles_n;
        tl.m0 = (int64_t)(rem / p.tiles_n) * BM;
        tl.m_lim = p.M;
        tl.k_begin = s_off[tl.e];
        tl.k_end = s_off[tl.e + 1];
    }
    return tl;
}

/* The first tile index >= t, in steps of gridDim.x, with work (varlen-K
 * skips the empty experts' tiles when accumulating: untouched), or -1. */
template <bool VARLEN_K>
static __device__ __forceinline__ int gg_pers_next(const gg_args &p, const int *s_off,
                                                   const int *s_ts, int t)
{
    if (!VARLEN_K) return t < s_ts[p.E] * p.tiles_n ? t : -1;
    const int per_e = p.tiles_m * p.tiles_n, total = p.E * per_e;
    for (; t < total; t += gridDim.x) {
        const int e = t / per_e;
        if (!p.accumulate || s_off[e + 1] > s_off[e]) return t;
    }
    return -1;
}

#endif /* SMOE_PORTABLE_SCHEDULER_CUH */
