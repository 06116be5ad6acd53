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
 */
#include "cuda/cuda_common.h"

#define MD_CHUNK 256
#define MD_WARPS 4

static size_t align_up(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

size_t smoe_cuda_metadata_scratch_bytes(int64_t E, int64_t cap)
{
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

smoe_status smoe_cuda_metadata(int64_t E, int64_t cap, smoe_assign_dev in,
                               int32_t *expert_offset, int32_t *assign_row,
                               int32_t *row_token, float *row_score,
                               int32_t *expert_counts, void *scratch, cudaStream_t stream)
{
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
