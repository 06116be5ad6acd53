/* A probe, not a test: does compute-sanitizer's racecheck stall on a
 * minimal warp-specialised TMA + mbarrier pipeline, without our GEMMs?
 * (notes/sm90_log.md rung 14: the Hopper GEMM test stalls now and then under
 * racecheck only.) The kernel has the skeleton of sm90_grouped_gemm_kernel:
 * 384 threads, setmaxnreg, warpgroup 0's thread 0 filling a ring of STAGES
 * stages by bulk copies on full barriers (expect_tx), warpgroups 1-2 each
 * reading its half of every stage from shared memory and releasing it on
 * the empty barrier (2 arrivals), a per-warpgroup named barrier around a
 * small epilogue staging, the producer's tail, the barriers invalidated at
 * the end. No wgmma, no tensor map. Each launch is checked (the sums of
 * what the consumers read: a quarter of every stage).
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc \
 *        dev/probe_racecheck_tma.cu -o build/probe_racecheck_tma
 *   compute-sanitizer --tool racecheck build/probe_racecheck_tma [launches]
 *
 * Prints a line every 20 launches (line-buffered), so a stall shows where.
 *
 * Result (H100, compute-sanitizer 2025.3.1, session 9): no stall in 100
 * launches alone and 4 x 70 launches four at once (the sums right every
 * time), so the skeleton alone does not reproduce the GEMM test's stall.
 * racecheck does report 12-15 hazards between each bulk copy (UBLKCP) and
 * the consumers' LDS of the same stage, with or without the consumers'
 * fence.proxy.async before the release: it does not take the full
 * barrier's completion (or the empty barrier's arrive -> wait) as ordering
 * the async-proxy writes against the generic reads. The GEMMs never read a
 * TMA-written stage with generic loads (wgmma reads it), so this report
 * does not arise there. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/sm90/ptx_sm90.cuh"

using namespace smoe_sm90;

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);      \
            exit(2);                                                                             \
        }                                                                                        \
    } while (0)

enum { STAGES = 6, STAGE_BYTES = 32768, TILE_KB = 5, THREADS = 384 };

/* one bulk copy of `bytes` (a multiple of 16) from global to shared memory,
 * completing on `bar` */
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                          uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

/* tiles t = blockIdx.x, + gridDim.x, ... < ntiles; tile t, k-block k reads
 * src block (t * TILE_KB + k) % nsrc; out[t] = sum of its words */
__global__ void __launch_bounds__(THREADS, 1)
probe_kernel(const uint32_t *src, int nsrc, int ntiles, uint32_t *out)
{
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    uint64_t *full = (uint64_t *)(smem + STAGES * STAGE_BYTES);
    uint64_t *empty = full + STAGES;
    uint32_t *stage_sum = (uint32_t *)(empty + STAGES); /* 2 x 128 words */
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(smem_addr(full + s), 1);
            mbar_init(smem_addr(empty + s), 2);
        }
        mbar_fence_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<40>();
        int stage = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            for (int k = 0; k < TILE_KB; k++) {
                mbar_wait(smem_addr(empty + stage), phase ^ 1);
                if (tid == 0) {
                    const uint32_t fb = smem_addr(full + stage);
                    mbar_arrive_expect_tx(fb, STAGE_BYTES);
                    const uint32_t *blk = src + (size_t)((t * TILE_KB + k) % nsrc) * (STAGE_BYTES / 4);
                    bulk_load(smem_addr(smem + stage * STAGE_BYTES), blk, STAGE_BYTES / 2, fb);
                    bulk_load(smem_addr(smem + stage * STAGE_BYTES) + STAGE_BYTES / 2,
                              blk + STAGE_BYTES / 8, STAGE_BYTES / 2, fb);
                }
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
        }
        for (int i = 0; i < STAGES; i++) { /* the tail */
            mbar_wait(smem_addr(empty + stage), phase ^ 1);
            if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
    } else {
        setmaxnreg_inc<232>();
        const int cw = wg - 1, t128 = tid & 127;
        uint32_t pos = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            uint32_t acc = 0;
            for (int k = 0; k < TILE_KB; k++, pos++) {
                const int s = (int)(pos % STAGES);
                mbar_wait(smem_addr(full + s), (pos / STAGES) & 1);
                const uint32_t *w = (const uint32_t *)(smem + s * STAGE_BYTES + cw * (STAGE_BYTES / 2));
                for (int i = t128; i < STAGE_BYTES / 8; i += 512) acc += w[i]; /* a quarter of it */
                /* these generic-proxy reads before the next bulk copy (async
                 * proxy) writes the stage: without the fence racecheck reports
                 * the copy racing them (the GEMMs read stages by wgmma, in the
                 * async proxy already) */
                fence_proxy_async();
                named_barrier_sync(1 + cw, 128); /* the warpgroup has read the stage */
                if (t128 == 0) mbar_arrive(smem_addr(empty + s));
            }
            /* epilogue through shared memory: the warpgroup's 128 partial sums */
            stage_sum[cw * 128 + t128] = acc;
            named_barrier_sync(1 + cw, 128);
            if (t128 < 32) {
                uint32_t v = 0;
                for (int i = t128; i < 128; i += 32) v += stage_sum[cw * 128 + i];
                for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (t128 == 0) atomicAdd(out + t, v);
            }
            named_barrier_sync(1 + cw, 128); /* stage_sum read before it is rewritten */
        }
    }
    __syncthreads();
    if (tid == 0)
        for (int i = 0; i < 2 * STAGES; i++) mbar_inval(smem_addr(full + i));
}

int main(int argc, char **argv)
{
    const int launches = argc > 1 ? atoi(argv[1]) : 200;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int nsrc = 64, ntiles = 3 * sms + 7;
    const size_t words = (size_t)nsrc * STAGE_BYTES / 4;
    uint32_t *h = (uint32_t *)malloc(words * 4), *d_src, *d_out;
    uint32_t *ho = (uint32_t *)malloc(ntiles * 4), *want = (uint32_t *)calloc(ntiles, 4);
    for (size_t i = 0; i < words; i++) h[i] = (uint32_t)(i * 2654435761u >> 7);
    for (int t = 0; t < ntiles; t++)
        for (int k = 0; k < TILE_KB; k++) {
            const uint32_t *b = h + (size_t)((t * TILE_KB + k) % nsrc) * (STAGE_BYTES / 4);
            for (int i = 0; i < STAGE_BYTES / 4; i++) /* the words the consumers read */
                if (i % (STAGE_BYTES / 8) % 512 < 128) want[t] += b[i];
        }
    CK(cudaMalloc(&d_src, words * 4));
    CK(cudaMalloc(&d_out, ntiles * 4));
    CK(cudaMemcpy(d_src, h, words * 4, cudaMemcpyHostToDevice));
    const size_t smem = 1024 + STAGES * STAGE_BYTES + 2 * STAGES * 8 + 2 * 128 * 4;
    CK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    setvbuf(stdout, NULL, _IOLBF, 0);
    int bad = 0;
    for (int l = 0; l < launches; l++) {
        CK(cudaMemset(d_out, 0, ntiles * 4));
        probe_kernel<<<sms, THREADS, smem>>>(d_src, nsrc, ntiles, d_out);
        CK(cudaGetLastError());
        CK(cudaMemcpy(ho, d_out, ntiles * 4, cudaMemcpyDeviceToHost));
        for (int t = 0; t < ntiles; t++) bad += ho[t] != want[t];
        if ((l + 1) % 20 == 0) printf("launch %d done, %d wrong sums so far\n", l + 1, bad);
    }
    printf("%s: %d launches, %d wrong sums\n", bad ? "FAIL" : "ok", launches, bad);
    return bad != 0;
}
