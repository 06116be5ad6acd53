/*
 * metadata.cu -- routing metadata on the device (DESIGN.md section 3), with
 * no host synchronisation: from the token-major assignments (expert, token,
 * score of each routed pair; their count on the device) it builds
 *   expert_offset (E+1)  rows of expert e: [expert_offset[e], expert_offset[e+1])
 *   assign_row (cap)     the row of each assignment (-1: skipped triple)
 *   row_token, row_score (cap)  per row, for the GEMMs' gather and scaling
 *   expert_counts (E)    optional output
 * Rows are sorted by expert, then by token.
 *
 * Algorithm: a stable counting sort. Assignments are cut into chunks of 256,
 * one warp per chunk.
 *   1. Per chunk, a histogram over experts (shared-memory integer atomics:
 *      only the counts survive, so thread order does not show).
 *   2. One block per expert: exclusive scan of its counts over the chunks
 *      (where the chunk's rows of that expert start) and its total.
 *   3. Every block scans the E totals (expert offsets); each warp then walks
 *      its chunk in order, 32 assignments at a time: lanes holding the same
 *      expert find each other with __match_any_sync and rank by lane, so the
 *      row order is the assignment order, i.e. by token. Deterministic.
 * Grids are sized for the capacity; the real count is read on the device.
 * That is the path for E > 1024; for E <= 1024 the same sort runs in one or
 * two launches (the md2 kernels below).
 */
#include <cooperative_groups.h>

#include "cuda/cuda_common.h"
#include "cuda/ptx.cuh"

#define MD_CHUNK 256
#define MD_WARPS 4

static size_t align_up(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

#define MD2_MAX_E 1024
#define MD2_MIN_TILE 1024 /* MD2_THREADS * 2 */

size_t smoe_cuda_metadata_scratch_bytes(int64_t E, int64_t cap)
{
    if (E >= 1 && E <= MD2_MAX_E) /* tile_hist: a row of E (rounded up to 4) per tile */
        return align_up((size_t)(smoe_cdiv(cap > 0 ? cap : 1, MD2_MIN_TILE) * ((E + 3) / 4 * 4)) *
                        4);
    const int64_t nchunk = smoe_cdiv(cap > 0 ? cap : 1, MD_CHUNK);
    return align_up((size_t)(E * nchunk) * 4) + align_up((size_t)E * 4);
}

/* 1. chunk_count[e * nchunk + c] = pairs of expert e in chunk c. */
__global__ void __launch_bounds__(MD_WARPS * 32)
k_md_histogram(const int32_t *__restrict__ expert, const int32_t *__restrict__ count, int64_t cap,
               int E, int nchunk, int32_t *chunk_count)
{
    extern __shared__ int sh[]; /* MD_WARPS * E */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * MD_WARPS + warp;
    int *h = sh + warp * E;
    for (int e = lane; e < E; e += 32) h[e] = 0;
    __syncwarp();
    if (c < nchunk) {
        const int64_t n = *count < cap ? *count : cap;
        for (int i = lane; i < MD_CHUNK; i += 32) {
            const int64_t a = (int64_t)c * MD_CHUNK + i;
            if (a >= n) break;
            const int e = expert[a];
            if (e >= 0 && e < E) atomicAdd(&h[e], 1);
        }
    }
    __syncwarp();
    if (c < nchunk)
        for (int e = lane; e < E; e += 32) chunk_count[(int64_t)e * nchunk + c] = h[e];
}

/* Exclusive scan of one int per thread over the block; *total = the sum. */
static __device__ int md_block_scan(int v, int *total)
{
    __shared__ int ws[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nw ? ws[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        ws[lane] = w;
    }
    __syncthreads();
    const int before = warp == 0 ? 0 : ws[warp - 1];
    *total = ws[nw - 1];
    __syncthreads();
    return before + x - v;
}

/* 2. One block per expert: chunk counts -> chunk starts; totals. */
__global__ void __launch_bounds__(256) k_md_scan_chunks(int nchunk, int32_t *chunk_count,
                                                        int32_t *expert_total)
{
    int32_t *row = chunk_count + (int64_t)blockIdx.x * nchunk;
    const int per = (nchunk + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(lo + per, nchunk);
    int local = 0;
    for (int c = lo; c < hi; ++c) local += row[c];
    int total;
    int run = md_block_scan(local, &total);
    for (int c = lo; c < hi; ++c) {
        const int v = row[c];
        row[c] = run;
        run += v;
    }
    if (threadIdx.x == 0) expert_total[blockIdx.x] = total;
}

/* 3. Expert offsets, then the stable placement of every assignment. */
__global__ void __launch_bounds__(MD_WARPS * 32)
k_md_place(smoe_assign_dev in, int64_t cap, int E, int nchunk,
           const int32_t *__restrict__ chunk_base, const int32_t *__restrict__ expert_total,
           int32_t *expert_offset, int32_t *assign_row, int32_t *row_token, float *row_score,
           int32_t *expert_counts)
{
    extern __shared__ int sh[]; /* offs[E + 1], then MD_WARPS * E running counts */
    SMOE_DEV_RETURN_IF_ABORTED(in.abort);
    int *offs = sh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int *run = sh + (E + 1) + warp * E;

    /* expert offsets: exclusive scan of the totals */
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(lo + per, E);
    int local = 0;
    for (int e = lo; e < hi; ++e) local += expert_total[e];
    int total;
    int acc = md_block_scan(local, &total);
    for (int e = lo; e < hi; ++e) {
        offs[e] = acc;
        acc += expert_total[e];
    }
    if (threadIdx.x == 0) offs[E] = total;
    for (int e = lane; e < E; e += 32) run[e] = 0;
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e <= E; e += blockDim.x) expert_offset[e] = offs[e];
        if (expert_counts)
            for (int e = threadIdx.x; e < E; e += blockDim.x) expert_counts[e] = expert_total[e];
    }

    const int c = blockIdx.x * MD_WARPS + warp;
    if (c >= nchunk) return;
    const int64_t n = *in.count < cap ? *in.count : cap;
    for (int b = 0; b < MD_CHUNK; b += 32) {
        const int64_t a = (int64_t)c * MD_CHUNK + b + lane;
        const bool inside = a < n;
        int e = inside ? in.expert[a] : -1;
        if (inside && in.expert16) in.expert16[a] = (uint16_t)e;
        if (e >= E) e = -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
            const int rank = __popc(peers & ((1u << lane) - 1u));
            const int r = offs[e] + chunk_base[(int64_t)e * nchunk + c] + run[e] + rank;
            assign_row[a] = r;
            row_token[r] = in.token[a];
            row_score[r] = in.score[a];
        } else if (inside) {
            assign_row[a] = -1;
        }
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) run[e] += __popc(peers);
        __syncwarp();
    }
}

/* ------------------------------------------------------------ E <= 1024 */

/* E <= MD2_MAX_E: tiles of 512 * IPT assignments (IPT = 2, 4 or 8 so that
 * there are about 128 tiles), one block of 512 threads per tile.
 *   - Each warp ranks its 32 * IPT assignments in order, 32 at a time:
 *     lanes of equal experts find each other (a ballot per expert bit) and
 *     rank by lane, after a per-warp running count per expert. The warps'
 *     counts, scanned per expert, give the tile's counts (its row of
 *     tile_hist).
 *   - Every block sums the tile_hist columns (int4 loads): the tiles before
 *     its own (where its rows of expert e start among expert e's rows) and
 *     all of them (the expert totals, then their exclusive scan: the expert
 *     offsets). Row of an assignment: expert offset + tiles before + warps
 *     before + rank in the warp. The tile's rows are staged in shared
 *     memory in row order, so row_token and row_score are written in runs.
 * Where every tile's block fits on the device at once: one cooperative
 * launch (k_md2_coop: ranks, tile_hist, a grid barrier, the rest; the
 * assignments read once). Else two: k_md2_hist (the tile histograms,
 * shared-memory integer atomics: only counts survive) and k_md2_place, a
 * programmatic dependent of it where the device has that.
 * Same rows as the three-launch sort (stable: by expert, then assignment
 * order); no atomics that decide an order. */
#define MD2_THREADS 512
#define MD2_WARPS (MD2_THREADS / 32)
#define MD2_PART 2048 /* ints of one column-sum partial array (P * Ep) */

static int md2_ipt(int64_t cap)
{
    return cap >= 128 * 8 * MD2_THREADS ? 8 : cap >= 128 * 4 * MD2_THREADS ? 4 : 2;
}

static int64_t md2_pad(int64_t E) { return (E + 3) / 4 * 4; }

template <int IPT>
__global__ void __launch_bounds__(MD2_THREADS)
k_md2_hist(const int32_t *__restrict__ expert, const int32_t *__restrict__ count, int64_t cap,
           int E, int Ep, int32_t *tile_hist)
{
    extern __shared__ int h[]; /* Ep */
    smoe_griddep_launch_dependents(); /* they wait for this grid's end */
    for (int e = threadIdx.x; e < Ep; e += MD2_THREADS) h[e] = 0;
    __syncthreads();
    const int64_t n = *count < cap ? *count : cap;
    const int64_t base = (int64_t)blockIdx.x * (MD2_THREADS * IPT) + threadIdx.x;
    int ex[IPT];
#pragma unroll
    for (int r = 0; r < IPT; ++r) {
        const int64_t a = base + r * MD2_THREADS;
        ex[r] = a < n ? expert[a] : -1;
    }
#pragma unroll
    for (int r = 0; r < IPT; ++r)
        if (ex[r] >= 0 && ex[r] < E) atomicAdd(&h[ex[r]], 1);
    __syncthreads();
    int32_t *row = tile_hist + (int64_t)blockIdx.x * Ep;
    for (int e = threadIdx.x; e < Ep; e += MD2_THREADS) row[e] = h[e];
}

/* Lanes whose code equals this lane's (codes < 2^bits): one ballot per bit,
 * what __match_any_sync gives (measured faster on an H100: metadata 0.021
 * against 0.023 ms at T = 32768, E = 256, K = 16). */
static __device__ __forceinline__ unsigned md2_match(int code, int bits)
{
    unsigned peers = 0xffffffffu;
    for (int i = 0; i < bits; ++i) {
        const bool bit = (code >> i) & 1;
        const unsigned b = __ballot_sync(0xffffffffu, bit);
        peers &= bit ? b : ~b;
    }
    return peers;
}

static size_t md2_smem_bytes(int64_t Ep, int ipt)
{
    return (size_t)(MD2_WARPS * Ep + 2 * Ep + 2 * MD2_PART + 3 * MD2_THREADS * ipt) * 4;
}

/* The block's shared memory (md2_smem_bytes). */
struct md2_smem {
    int *wcnt;  /* MD2_WARPS * Ep: per-warp counts, then their prefix */
    int *gbase; /* Ep: the tile's first row of each expert */
    int *toff;  /* Ep: the tile's count, then its local offset */
    int *ppre;  /* MD2_PART: column sums over the tiles before */
    int *ptot;  /* MD2_PART: column sums over all tiles */
    int *srow;  /* tile: staged rows, in row order */
    int *stok;
    float *ssc;
};

static __device__ __forceinline__ md2_smem md2_smem_make(int *sm, int Ep, int tile)
{
    md2_smem s;
    s.wcnt = sm;
    s.gbase = s.wcnt + MD2_WARPS * Ep;
    s.toff = s.gbase + Ep;
    s.ppre = s.toff + Ep;
    s.ptot = s.ppre + MD2_PART;
    s.srow = s.ptot + MD2_PART;
    s.stok = s.srow + tile;
    s.ssc = (float *)(s.stok + tile);
    return s;
}

/* The warp's IPT rounds of 32 assignments from abase; bit r of the result:
 * round r's assignment exists. */
template <int IPT>
static __device__ __forceinline__ unsigned md2_load(const smoe_assign_dev &in, int64_t n,
                                                    int64_t abase, int (&ex)[IPT],
                                                    int (&tk)[IPT], float (&sc)[IPT])
{
    unsigned inside = 0;
#pragma unroll
    for (int r = 0; r < IPT; ++r) {
        const int64_t a = abase + r * 32;
        ex[r] = -1;
        tk[r] = 0;
        sc[r] = 0.0f;
        if (a < n) {
            inside |= 1u << r;
            ex[r] = in.expert[a];
            tk[r] = in.token[a];
            sc[r] = in.score[a];
            if (in.expert16) in.expert16[a] = (uint16_t)ex[r];
        }
    }
    return inside;
}

/* Column sums of tile_hist (thread (p, c4) takes the tiles p, p + P, ... of
 * columns 4 c4 .. 4 c4 + 3), then the expert totals, their exclusive scan
 * (the expert offsets, written by block 0 with the counts) and gbase.
 * COHERENT: tile_hist was written by this grid (loads bypass L1). */
template <bool COHERENT>
static __device__ void md2_offsets(const int32_t *tile_hist, int ntiles, int E, int Ep,
                                   const md2_smem &s, int32_t *expert_offset,
                                   int32_t *expert_counts)
{
    const int tid = threadIdx.x, b = blockIdx.x;
    const int C4 = Ep >> 2, P = MD2_THREADS / C4;
    {
        const int c4 = tid % C4, p = tid / C4;
        if (p < P) {
            int4 pre = make_int4(0, 0, 0, 0), tot = make_int4(0, 0, 0, 0);
            const int4 *col = reinterpret_cast<const int4 *>(tile_hist) + c4;
#pragma unroll 8
            for (int t = p; t < ntiles; t += P) {
                const int4 v = COHERENT ? __ldcg(col + (int64_t)t * C4)
                                        : __ldg(col + (int64_t)t * C4);
                tot.x += v.x;
                tot.y += v.y;
                tot.z += v.z;
                tot.w += v.w;
                if (t < b) {
                    pre.x += v.x;
                    pre.y += v.y;
                    pre.z += v.z;
                    pre.w += v.w;
                }
            }
            reinterpret_cast<int4 *>(s.ppre + p * Ep)[c4] = pre;
            reinterpret_cast<int4 *>(s.ptot + p * Ep)[c4] = tot;
        }
    }
    __syncthreads();
    /* thread tid owns experts 2 tid, 2 tid + 1 */
    const int e0 = 2 * tid;
    int tot2[2] = {0, 0}, pre2[2] = {0, 0};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int e = e0 + q;
        if (e < E)
            for (int p = 0; p < P; ++p) {
                tot2[q] += s.ptot[p * Ep + e];
                pre2[q] += s.ppre[p * Ep + e];
            }
    }
    int total;
    const int off0 = md_block_scan(tot2[0] + tot2[1], &total);
    const int off1 = off0 + tot2[0];
    if (e0 < Ep) s.gbase[e0] = off0 + pre2[0];
    if (e0 + 1 < Ep) s.gbase[e0 + 1] = off1 + pre2[1];
    if (b == 0) {
        if (e0 < E) expert_offset[e0] = off0;
        if (e0 + 1 < E) expert_offset[e0 + 1] = off1;
        if (tid == 0) expert_offset[E] = total;
        if (expert_counts) {
            if (e0 < E) expert_counts[e0] = tot2[0];
            if (e0 + 1 < E) expert_counts[e0 + 1] = tot2[1];
        }
    }
}

/* Rank within the warp, 32 assignments at a time in order: rk = earlier
 * assignments of the same expert in the warp; wc (the warp's row of wcnt)
 * ends as the warp's counts. ex: -1 for the skipped ones. */
template <int IPT>
static __device__ __forceinline__ void md2_rank(const int (&ex)[IPT], int (&rk)[IPT], int mbits,
                                                int *wc, int Ep, int lane)
{
    const unsigned lt = (1u << lane) - 1u;
    for (int e = lane; e < Ep; e += 32) wc[e] = 0;
    __syncwarp();
    const int skip = (1 << mbits) - 1; /* >= E: the code of skipped ones */
#pragma unroll
    for (int r = 0; r < IPT; ++r) {
        const int e = ex[r];
        const unsigned peers = md2_match(e >= 0 ? e : skip, mbits);
        const int before = e >= 0 ? wc[e] : 0;
        rk[r] = before + __popc(peers & lt);
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) wc[e] = before + __popc(peers);
        __syncwarp();
    }
}

/* Per expert: exclusive scan of the warps' counts; toff = the tile's count
 * (after a barrier behind md2_rank). */
static __device__ __forceinline__ void md2_warp_scan(const md2_smem &s, int Ep)
{
    for (int e = threadIdx.x; e < Ep; e += MD2_THREADS) {
        int run = 0;
#pragma unroll
        for (int v = 0; v < MD2_WARPS; ++v) {
            const int c = s.wcnt[v * Ep + e];
            s.wcnt[v * Ep + e] = run;
            run += c;
        }
        s.toff[e] = run;
    }
}

/* The tile's ranks: out-of-range experts dropped (-1), each warp's ranks
 * (md2_rank), then the warps' counts scanned per expert (md2_warp_scan);
 * returns the warp's count row. Ends behind a barrier. */
template <int IPT>
static __device__ __forceinline__ int *md2_rank_tile(int (&ex)[IPT], int (&rk)[IPT], int mbits,
                                                     const md2_smem &s, int E, int Ep, int w,
                                                     int lane)
{
#pragma unroll
    for (int r = 0; r < IPT; ++r) ex[r] = ex[r] >= 0 && ex[r] < E ? ex[r] : -1;
    int *wc = s.wcnt + w * Ep;
    md2_rank<IPT>(ex, rk, mbits, wc, Ep, lane);
    __syncthreads();
    md2_warp_scan(s, Ep);
    __syncthreads();
    return wc;
}

/* toff: the tile's counts -> its local offsets; returns the tile's rows
 * (after a barrier behind md2_warp_scan). */
static __device__ __forceinline__ int md2_tile_offsets(const md2_smem &s, int Ep)
{
    const int e0 = 2 * threadIdx.x;
    const int c0 = e0 < Ep ? s.toff[e0] : 0, c1 = e0 + 1 < Ep ? s.toff[e0 + 1] : 0;
    int nrows;
    const int l0 = md_block_scan(c0 + c1, &nrows); /* has barriers: reads are done */
    if (e0 < Ep) s.toff[e0] = l0;
    if (e0 + 1 < Ep) s.toff[e0 + 1] = l0 + c0;
    return nrows;
}

/* Every assignment's row (after a barrier behind md2_tile_offsets and
 * md2_offsets); the tile's rows staged in row order, then written. */
template <int IPT>
static __device__ __forceinline__ void md2_place_rows(const md2_smem &s, int nrows, unsigned inside,
                                                      int64_t abase, const int (&ex)[IPT],
                                                      const int (&rk)[IPT], const int (&tk)[IPT],
                                                      const float (&sc)[IPT], const int *wc,
                                                      int32_t *assign_row, int32_t *row_token,
                                                      float *row_score)
{
#pragma unroll
    for (int r = 0; r < IPT; ++r) {
        if (!(inside >> r & 1u)) continue;
        const int64_t a = abase + r * 32;
        const int e = ex[r];
        if (e < 0) {
            assign_row[a] = -1;
            continue;
        }
        const int wp = wc[e] + rk[r];
        const int row = s.gbase[e] + wp, pos = s.toff[e] + wp;
        assign_row[a] = row;
        s.srow[pos] = row;
        s.stok[pos] = tk[r];
        s.ssc[pos] = sc[r];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < nrows; j += MD2_THREADS) {
        const int row = s.srow[j];
        row_token[row] = s.stok[j];
        row_score[row] = s.ssc[j];
    }
}

template <int IPT>
__global__ void __launch_bounds__(MD2_THREADS, 1)
k_md2_place(smoe_assign_dev in, int64_t cap, int E, int Ep, int mbits, int ntiles,
            const int32_t *__restrict__ tile_hist, int32_t *expert_offset, int32_t *assign_row,
            int32_t *row_token, float *row_score, int32_t *expert_counts)
{
    constexpr int TILE = MD2_THREADS * IPT, S = TILE / MD2_WARPS;
    extern __shared__ int sm[];
    const md2_smem s = md2_smem_make(sm, Ep, TILE);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;

    smoe_griddep_wait(); /* the histogram (and the assignments) are complete */
    SMOE_DEV_RETURN_IF_ABORTED(in.abort);

    /* the warp's assignments first: their latency overlaps the column sums */
    const int64_t n = *in.count < cap ? *in.count : cap;
    const int64_t abase = (int64_t)blockIdx.x * TILE + w * S + lane;
    int ex[IPT], rk[IPT], tk[IPT];
    float sc[IPT];
    const unsigned inside = md2_load<IPT>(in, n, abase, ex, tk, sc);
    md2_offsets<false>(tile_hist, ntiles, E, Ep, s, expert_offset, expert_counts);
    int *wc = md2_rank_tile<IPT>(ex, rk, mbits, s, E, Ep, w, lane);
    const int nrows = md2_tile_offsets(s, Ep);
    __syncthreads();
    md2_place_rows<IPT>(s, nrows, inside, abase, ex, rk, tk, sc, wc, assign_row, row_token,
                        row_score);
}

/* The same in one launch where every tile's block is resident at once
 * (a cooperative launch): the warp ranks first, the tile's counts into
 * tile_hist, a grid barrier, then the column sums and the rows. The
 * assignments are read once. */
template <int IPT>
__global__ void __launch_bounds__(MD2_THREADS, IPT >= 8 ? 1 : 2)
k_md2_coop(smoe_assign_dev in, int64_t cap, int E, int Ep, int mbits, int ntiles,
           int32_t *tile_hist, int32_t *expert_offset, int32_t *assign_row, int32_t *row_token,
           float *row_score, int32_t *expert_counts)
{
    constexpr int TILE = MD2_THREADS * IPT, S = TILE / MD2_WARPS;
    extern __shared__ int sm[];
    SMOE_DEV_RETURN_IF_ABORTED(in.abort); /* every block, before the grid barrier */
    const md2_smem s = md2_smem_make(sm, Ep, TILE);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t n = *in.count < cap ? *in.count : cap;
    const int64_t abase = (int64_t)blockIdx.x * TILE + w * S + lane;
    int ex[IPT], rk[IPT], tk[IPT];
    float sc[IPT];
    const unsigned inside = md2_load<IPT>(in, n, abase, ex, tk, sc);
    int *wc = md2_rank_tile<IPT>(ex, rk, mbits, s, E, Ep, w, lane);
    int32_t *row = tile_hist + (int64_t)blockIdx.x * Ep;
    for (int e = threadIdx.x; e < Ep; e += MD2_THREADS) row[e] = s.toff[e];
    __threadfence();
    cooperative_groups::this_grid().sync();
    md2_offsets<true>(tile_hist, ntiles, E, Ep, s, expert_offset, expert_counts);
    const int nrows = md2_tile_offsets(s, Ep);
    __syncthreads();
    md2_place_rows<IPT>(s, nrows, inside, abase, ex, rk, tk, sc, wc, assign_row, row_token,
                        row_score);
}

template <int IPT>
static smoe_status md2_launch(int64_t E, int64_t cap, smoe_assign_dev in, int32_t *expert_offset,
                              int32_t *assign_row, int32_t *row_token, float *row_score,
                              int32_t *expert_counts, int32_t *tile_hist, int coop_ok,
                              cudaStream_t stream)
{
    int Ei = (int)E, Ep = (int)md2_pad(E), mbits = 1;
    while ((1 << mbits) - 1 < E) ++mbits;
    int ntiles = (int)smoe_cdiv(cap > 0 ? cap : 1, (int64_t)MD2_THREADS * IPT);
    const size_t smem = md2_smem_bytes(Ep, IPT);
    int dev = 0, major = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&dev));
    SMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    {
        int coop = 0, sms = 0, per_sm = 0;
        SMOE_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
        SMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        SMOE_CUDA_CHECK(cudaFuncSetAttribute(
            k_md2_coop<IPT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        SMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_md2_coop<IPT>,
                                                                      MD2_THREADS, smem));
        if (coop && coop_ok &&
            (int64_t)ntiles <= (int64_t)per_sm * sms) {
            void *args[] = {&in,    &cap,           &Ei,        &Ep,
                            &mbits, &ntiles,        &tile_hist, &expert_offset,
                            &assign_row, &row_token, &row_score, &expert_counts};
            SMOE_CUDA_CHECK(cudaLaunchCooperativeKernel((const void *)k_md2_coop<IPT>,
                                                        dim3((unsigned)ntiles),
                                                        dim3(MD2_THREADS), args, smem, stream));
            SMOE_CUDA_LAUNCH_CHECK("k_md2_coop");
            return SMOE_SUCCESS;
        }
    }
    k_md2_hist<IPT><<<ntiles, MD2_THREADS, (size_t)Ep * 4, stream>>>(in.expert, in.count, cap,
                                                                      Ei, Ep, tile_hist);
    SMOE_CUDA_LAUNCH_CHECK("k_md2_hist");
    SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_md2_place<IPT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3((unsigned)ntiles);
    cfg.blockDim = dim3(MD2_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = major >= 9 ? 1 : 0;
    SMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k_md2_place<IPT>, in, cap, Ei, Ep, mbits, ntiles,
                                       (const int32_t *)tile_hist, expert_offset, assign_row,
                                       row_token, row_score, expert_counts));
    SMOE_CUDA_LAUNCH_CHECK("k_md2_place");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_metadata(int64_t E, int64_t cap, smoe_assign_dev in,
                               int32_t *expert_offset, int32_t *assign_row,
                               int32_t *row_token, float *row_score,
                               int32_t *expert_counts, void *scratch, cudaStream_t stream)
{
    return smoe_cuda_metadata_beside(E, cap, in, expert_offset, assign_row, row_token, row_score,
                                     expert_counts, scratch, 0, stream);
}

smoe_status smoe_cuda_metadata_beside(int64_t E, int64_t cap, smoe_assign_dev in,
                                      int32_t *expert_offset, int32_t *assign_row,
                                      int32_t *row_token, float *row_score,
                                      int32_t *expert_counts, void *scratch, int beside,
                                      cudaStream_t stream)
{
    if (E >= 1 && E <= MD2_MAX_E) {
        const int ipt = md2_ipt(cap);
        int32_t *tile_hist = (int32_t *)scratch;
        if (ipt == 8)
            return md2_launch<8>(E, cap, in, expert_offset, assign_row, row_token, row_score,
                                 expert_counts, tile_hist, !beside, stream);
        if (ipt == 4)
            return md2_launch<4>(E, cap, in, expert_offset, assign_row, row_token, row_score,
                                 expert_counts, tile_hist, !beside, stream);
        return md2_launch<2>(E, cap, in, expert_offset, assign_row, row_token, row_score,
                             expert_counts, tile_hist, !beside, stream);
    }
    const int64_t nchunk = smoe_cdiv(cap > 0 ? cap : 1, MD_CHUNK);
    int32_t *chunk_count = (int32_t *)scratch;
    int32_t *expert_total =
        (int32_t *)((char *)scratch + align_up((size_t)(E * nchunk) * 4));
    const int blocks = (int)smoe_cdiv(nchunk, MD_WARPS);
    const size_t sh_hist = (size_t)MD_WARPS * E * 4;
    const size_t sh_place = (size_t)(E + 1 + MD_WARPS * E) * 4;
    if (sh_place > 48 * 1024) {
        SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_md_place,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)sh_place));
        SMOE_CUDA_CHECK(cudaFuncSetAttribute(k_md_histogram,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)sh_hist));
    }
    k_md_histogram<<<blocks, MD_WARPS * 32, sh_hist, stream>>>(in.expert, in.count, cap, (int)E,
                                                               (int)nchunk, chunk_count);
    SMOE_CUDA_LAUNCH_CHECK("k_md_histogram");
    k_md_scan_chunks<<<(unsigned)E, 256, 0, stream>>>((int)nchunk, chunk_count, expert_total);
    SMOE_CUDA_LAUNCH_CHECK("k_md_scan_chunks");
    k_md_place<<<blocks, MD_WARPS * 32, sh_place, stream>>>(
        in, cap, (int)E, (int)nchunk, chunk_count, expert_total, expert_offset, assign_row,
        row_token, row_score, expert_counts);
    SMOE_CUDA_LAUNCH_CHECK("k_md_place");
    return SMOE_SUCCESS;
}
