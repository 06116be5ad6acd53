/*
 * kernel.cuh -- the portable grouped GEMM as a composition of its parts:
 * the scheduler (scheduler.cuh) names a tile, the main loop (mainloop.cuh)
 * accumulates it, the epilogue (epilogue.cuh) writes it. Template
 * parameters: the tile configuration (config.cuh), the operands' layouts
 * and maps, the epilogue, and PERS (a persistent grid or one CTA per tile).
 * Instances are made only by the rows of the tile table in
 * grouped_gemm.cu.
 */
#ifndef SMOE_PORTABLE_KERNEL_CUH
#define SMOE_PORTABLE_KERNEL_CUH

#include "cuda/portable/epilogue.cuh"
#include "cuda/portable/mainloop.cuh"
#include "cuda/portable/scheduler.cuh"

/* The grouped GEMM. PERS = 0: one CTA per tile (varlen-M grids sized for
 * the worst case; a CTA past the last tile exits). PERS = 1: persistent
 * (UP, STORE and DWS epilogues): after a tile's main loop the next tile's
 * loaders are set up and its first STAGES-1 k-tiles issued into the stages
 * they fill, then the epilogue runs in the shared memory after them, so the
 * next tile's loads land while it runs; varlen-M's gathered tokens of the
 * tile after that come with the first of those loads. */
template <GG_TPARAMS, int PERS>
__global__ void __launch_bounds__(WM *WN * 32)
    gg_kernel(const gg_args p)
{
    typedef gg_kt<GG_TARGS> K;
    typedef typename K::C C;
    constexpr int NT = C::NT, MI = C::MI, NI = C::NI;
    constexpr bool VARLEN_K = K::VARLEN_K;
    static_assert(!PERS || EPI == GG_EPI_UP || EPI == GG_EPI_STORE || EPI == GG_EPI_DWS,
                  "persistent grids: epilogues that fit after the prologue's stages");

    extern __shared__ __align__(128) unsigned char gg_smem[];
    if (p.abort && *p.abort) return;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int wm0 = wm * C::WTM, wn0 = wn * C::WTN;
    const uint32_t smem0 = smoe_smem_addr(gg_smem);
    typename K::LA la;
    typename K::LB lb;
    float acc[MI][NI][4];

    if constexpr (!PERS) {
        gg_tile tl;
        if (!gg_block_tile<BM, VARLEN_K>(p, warp, lane, tl)) return;
        const int KT = (int)((tl.k_end - tl.k_begin + BK - 1) / BK);
        const bf16 *a_base = p.a.ptr + (int64_t)tl.e * p.a.expert_stride;
        const bf16 *b_base = p.b.ptr + (int64_t)tl.e * p.b.expert_stride;
        gg_setup<GG_TARGS>(p, tl, la, lb, a_base, b_base, tid, nullptr);
        gg_prologue<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, tid, 0, 0, 0);
        gg_mainloop<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, lane, wm0, wn0, acc);
        gg_epilogue<GG_TARGS>(p, tl, acc, gg_smem);
    } else {
        /* Tables: off[0..E], varlen-M's first tile of each expert; then
         * two buffers of prefetched tokens (tile j's tokens come with tile
         * j-1's prologue into buffer j & 1). */
        int *s_off = (int *)(gg_smem + C::pers_tail(EPI));
        int *s_ts = s_off + (GG_PERS_EMAX + 1);
        int *tok_s = s_ts + (GG_PERS_EMAX + 1);
        unsigned char *es = gg_smem + C::PERS_EOFF;
        gg_pers_tables<BM, VARLEN_K, NT>(p, s_off, s_ts, tid, warp, lane);
        const bool tokpf = !VARLEN_K && A_KM && p.a.map == GG_MAP_TOKEN;
        int t = gg_pers_next<VARLEN_K>(p, s_off, s_ts, (int)blockIdx.x);
        if (t < 0) return;
        gg_tile tl = gg_pers_tile<BM, VARLEN_K>(p, s_off, s_ts, t);
        int tn = gg_pers_next<VARLEN_K>(p, s_off, s_ts, t + (int)gridDim.x);
        int KT = (int)((tl.k_end - tl.k_begin + BK - 1) / BK);
        {
            const bf16 *a_base = p.a.ptr + (int64_t)tl.e * p.a.expert_stride;
            const bf16 *b_base = p.b.ptr + (int64_t)tl.e * p.b.expert_stride;
            gg_setup<GG_TARGS>(p, tl, la, lb, a_base, b_base, tid, nullptr);
            gg_tile nx = tl;
            if (tokpf && tn >= 0) nx = gg_pers_tile<BM, VARLEN_K>(p, s_off, s_ts, tn);
            gg_prologue<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, tid,
                                  tokpf && tn >= 0 ? smoe_smem_addr(tok_s + BM) : 0, nx.m0,
                                  nx.m_lim);
        }
#pragma unroll 1
        for (int it = 0;; it++) {
            {
                const bf16 *a_base = p.a.ptr + (int64_t)tl.e * p.a.expert_stride;
                const bf16 *b_base = p.b.ptr + (int64_t)tl.e * p.b.expert_stride;
                gg_mainloop<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, lane, wm0, wn0,
                                      acc);
            }
            __syncthreads(); /* every warp is done with the stages */
            gg_tile nx = tl;
            int tnn = -1;
            if (tn >= 0) {
                nx = gg_pers_tile<BM, VARLEN_K>(p, s_off, s_ts, tn);
                tnn = gg_pers_next<VARLEN_K>(p, s_off, s_ts, tn + (int)gridDim.x);
                gg_tile nn = nx;
                if (tokpf && tnn >= 0) nn = gg_pers_tile<BM, VARLEN_K>(p, s_off, s_ts, tnn);
                const bf16 *a_base = p.a.ptr + (int64_t)nx.e * p.a.expert_stride;
                const bf16 *b_base = p.b.ptr + (int64_t)nx.e * p.b.expert_stride;
                gg_setup<GG_TARGS>(p, nx, la, lb, a_base, b_base, tid,
                                   tokpf ? tok_s + ((it + 1) & 1) * BM : nullptr);
                gg_prologue<GG_TARGS>(p, nx, la, lb, a_base, b_base, smem0,
                                      (int)((nx.k_end - nx.k_begin + BK - 1) / BK), tid,
                                      tokpf && tnn >= 0 ? smoe_smem_addr(tok_s + (it & 1) * BM) : 0,
                                      nn.m0, nn.m_lim);
            }
            gg_epilogue<GG_TARGS>(p, tl, acc, es);
            if (tn < 0) break;
            tl = nx;
            tn = tnn;
            KT = (int)((tl.k_end - tl.k_begin + BK - 1) / BK);
        }
    }
}

#endif /* SMOE_PORTABLE_KERNEL_CUH */
