/*
 * mainloop_sm90.cuh -- the consumers' main-loop step: one k-block of
 * wgmma over a stage (the producer's TMA / cp.async loads and the
 * consumers' stage loop are still in the kernel, grouped_gemm_sm90.cu).
 */
#ifndef SMOE_MAINLOOP_SM90_CUH
#define SMOE_MAINLOOP_SM90_CUH

#include "cuda/sm90/config_sm90.cuh"

/* One k-block of the main loop: MH m64 blocks x WN columns x 64 k, from
 * the stage's A (sa) and B (sb) tiles, committed as one wgmma group. The
 * accumulators of block mh start at acc + mh * (NREG / MH); a width below the
 * tile's writes the first of them. */
template <int WN, bool TRANS_B, int MH, int NREG>
__device__ __forceinline__ void sm90_mma_kblock(float *acc, uint32_t sa, uint32_t sb, int kb)
{
    wgmma_fence_regs<NREG>(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < SM90_BK / 16; k++) {
        /* K-major B steps 32 bytes along its rows; MN-major B steps 16 k-rows */
        uint64_t db = TRANS_B ? wgmma_desc_sw128_mn(sb + k * 2048, 8192)
                              : wgmma_desc_sw128(sb + k * 32);
#pragma unroll
        for (int mh = 0; mh < MH; mh++) {
            uint64_t da = wgmma_desc_sw128(sa + mh * 64 * 128 + k * 32);
            float *am = acc + mh * (NREG / MH);
            const int sc = (kb | k) != 0;
            if constexpr (WN == 256) wgmma_m64n256k16<TRANS_B ? 1 : 0>(am, da, db, sc);
            else if constexpr (WN == 192) wgmma_m64n192k16<TRANS_B ? 1 : 0>(am, da, db, sc);
            else if constexpr (WN == 128) wgmma_m64n128k16<TRANS_B ? 1 : 0>(am, da, db, sc);
            else wgmma_m64n64k16<TRANS_B ? 1 : 0>(am, da, db, sc);
        }
    }
    wgmma_commit();
    wgmma_fence_regs<NREG>(acc);
}

#endif /* SMOE_MAINLOOP_SM90_CUH */
