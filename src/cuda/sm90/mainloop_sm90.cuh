/*
 * mainloop_sm90.cuh -- the consumers' main-loop step: one k-block of
 * wgmma over a stage; the producer warpgroup's two loops, which fill the
 * ring of stages (the warp-per-stage gather, SM90_FL_WS, and the TMA
 * producer with its 128- or 64-thread cp.async gather), and a consumer
 * warpgroup's loop (the stages through wgmma, then the tile's epilogue).
 */
#ifndef SMOE_MAINLOOP_SM90_CUH
#define SMOE_MAINLOOP_SM90_CUH

#include "cuda/sm90/config_sm90.cuh"
#include "cuda/sm90/epilogue_sm90.cuh"
#include "cuda/sm90/scheduler_sm90.cuh"

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

/* ------------------------------------------------------------ producers */

/* The weight tile of k-block kb of tile tl, by TMA onto the stage's full
 * barrier fb (issued by one thread): BN rows x 64 k, K-major (up's
 * concatenated W1 as two boxes, the BN/2 gate rows then the matching up
 * rows), or for dh / dxt BN/64 boxes of 64 k-rows x 64 n-columns, MN-major,
 * 8 KiB apart. */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_load_b(const CUtensorMap &map_b, const sm90_gemm_params &p,
                                            const sm90_tile &tl, uint32_t sb, uint32_t fb, int kb)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    typedef typename K::cfg cfg;
    if constexpr (K::TRANS_B) {
#pragma unroll
        for (int j = 0; j < BN / 64; j++)
            tma_load_2d(sb + j * 8192, &map_b, fb, tl.n_tile * BN + 64 * j,
                        tl.e * p.K + kb * SM90_BK);
    } else if (MODE == SM90_MODE_UP && p.concat) {
        int g = tl.e * p.N + tl.n_tile * (BN / 2);
        tma_load_2d(sb, &map_b, fb, kb * SM90_BK, g);
        tma_load_2d(sb + cfg::B_BYTES / 2, &map_b, fb, kb * SM90_BK, g + p.n);
    } else {
        tma_load_2d(sb, &map_b, fb, kb * SM90_BK, tl.e * p.N + tl.n_tile * BN);
    }
}

/* One 16-byte chunk of gathered row r of a stage's A tile (sa): chunk
 * `chunk` of token ti's row (src0 points at the k-block's first column plus
 * the chunk), into the 128B-swizzled layout; zeros where ti < 0 (a row past
 * the expert's end). */
__device__ __forceinline__ void sm90_gather_chunk(uint32_t sa, int r, int chunk, const bf16 *src0,
                                                  int32_t ti, int K)
{
    const uint32_t dst = sa + r * 128 + ((chunk ^ (r & 7)) << 4);
    cp_async_16(dst, src0 + (int64_t)(ti < 0 ? 0 : ti) * K, ti < 0 ? 0u : 16u);
}

/* The producer's tail (as CUTLASS's), from the ring position after its last
 * k-block: no producer thread leaves while a stage it filled is still
 * unreleased, i.e. with its TMA loads or copies possibly in flight (under
 * racecheck an early exit stalled the consumers of a 6-stage down:
 * notes/sm90_log.md rung 13). */
template <int STAGES>
__device__ __forceinline__ void sm90_producer_tail(const uint64_t *empty, int stage,
                                                   uint32_t phase)
{
    for (int i = 0; i < STAGES; i++) {
        mbar_wait(smem_addr(empty + stage), phase ^ 1);
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
    }
}

/* The warp-per-stage gather (SM90_FL_WS, up): k-block `it` of the CTA
 * belongs to producer warp it % 4, which loads the whole A tile of that
 * stage (32 cp.async per lane) and, from its lane 0, the weight tile, so
 * four stages are in flight on four warps. The tile's 128 gather tokens sit
 * in a double-buffered shared array (one barrier per tile: a buffer is
 * rewritten two tiles later, after every warp has passed the next tile's
 * barrier). */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_produce_warp_gather(const CUtensorMap &map_b,
                                                         const sm90_gemm_params &p,
                                                         const sm90_ctx &c, int tid)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    typedef typename K::cfg cfg;
    static_assert(MODE == SM90_MODE_UP && K::WS, "the warp-per-stage gather is up's");
    uint8_t *smem = c.smem;
    uint64_t *full = c.full, *empty = c.empty;
    int32_t *tok_slots = c.tok_slots;
    const int pw = tid >> 5, lane = tid & 31, chunk = lane & 7;
    int it = 0, nth = 0;
    for (int t = blockIdx.x; t < c.total; t += gridDim.x, nth++) {
        sm90_tile tl = sm90_tile_decode(t, c.tile_start, p.E, c.nt, p.expert_offset,
                                        p.off_stride, c.gm);
        int32_t *tokb = tok_slots + 128 * (nth & 1);
        {
            int r = tl.row0 + tid;
            tokb[tid] = r < tl.row_end ? __ldg(p.row_token + r) : -1;
        }
        named_barrier_sync(3, 128);
        for (int kb = 0; kb < c.kb_count; kb++, it++) {
            if ((it & 3) != pw) continue;
            const int stage = it % STAGES;
            const uint32_t phase = (uint32_t)(it / STAGES) & 1;
            const uint32_t fb = smem_addr(full + stage);
            const uint32_t sa = smem_addr(smem + stage * cfg::STAGE_BYTES);
            const uint32_t sb = sa + cfg::A_BYTES;
            mbar_wait(smem_addr(empty + stage), phase ^ 1);
            if (lane == 0) {
                mbar_arrive_expect_tx(fb, cfg::B_BYTES);
                sm90_load_b<BN, STAGES, MODE, FL>(map_b, p, tl, sb, fb, kb);
            }
            const bf16 *src0 = p.a_src + kb * SM90_BK + chunk * 8;
#pragma unroll 8
            for (int i = 0; i < 32; i++) {
                const int r = (lane >> 3) + 4 * i;
                sm90_gather_chunk(sa, r, chunk, src0, tokb[r], p.K);
            }
            cp_async_mbar_arrive_noinc(fb);
        }
    }
    /* the producer's tail (sm90_producer_tail's wait), from ring position it */
    for (int i = 0; i < STAGES; i++, it++)
        mbar_wait(smem_addr(empty + it % STAGES), ((uint32_t)(it / STAGES) & 1) ^ 1);
}

/* The TMA producer: one thread loads each stage's weight tile by TMA, and
 * the A tile either by TMA too (down, dxt) or, for the gathering GEMMs (up,
 * dh), by 16-byte cp.async from all 128 threads of the warpgroup (8 rows
 * each) or from SM90_FL_EPIWG's 64 gathering threads (16 rows each), their
 * row tokens loaded into registers once per tile (sm90_traits::TOKREG). */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_produce_tma(const CUtensorMap &map_a,
                                                 const CUtensorMap &map_b,
                                                 const sm90_gemm_params &p, const sm90_ctx &c,
                                                 int tid)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    typedef typename K::cfg cfg;
    constexpr bool GATHER = K::GATHER;
    uint8_t *smem = c.smem;
    uint64_t *full = c.full, *empty = c.empty;
    const uint32_t tx_bytes = GATHER ? cfg::B_BYTES : cfg::A_BYTES + cfg::B_BYTES;
    /* rows rsub + RS i (i < PRT), 16-byte chunk: 128 gathering threads
     * take 8 rows each, EPIWG's 64 take 16 */
    constexpr int PRT = K::EPIWG ? 16 : 8, RS = 128 / PRT;
    /* the threads running this loop: 128, or EPIWG's 64 gathering ones */
    constexpr int NPROD = K::EPIWG ? 64 : 128;
    constexpr bool DYN = K::DYN;
    const int chunk = tid & 7, rsub = tid >> 3;
    int stage = 0;
    uint32_t phase = 0;
    /* SM90_FL_DYN: the next tile is claimed this many k-blocks before the
     * tile's last, so the claim's latency is hidden and the claims still
     * come in the order the CTAs reach their tiles' ends */
    const int claim_kb = DYN ? (c.kb_count > 4 ? c.kb_count - 4 : 0) : 0;
    int t = c.cid;
    if (DYN && tid == 0) c.dyn[0] = t;
    for (uint32_t j = 0; t < c.total; j++) {
        sm90_tile tl = sm90_tile_decode(t, c.tile_start, p.E, c.nt, p.expert_offset,
                                        p.off_stride, c.gm);
        int nxt = 0; /* DYN: thread 0's claim */
        /* this thread's gather rows, for the whole tile */
        int32_t tok[PRT];
        if (GATHER) {
#pragma unroll
            for (int i = 0; i < PRT; i++) {
                int r = tl.row0 + rsub + RS * i;
                tok[i] = r < tl.row_end ? __ldg(p.row_token + r) : -1;
            }
        }
        for (int kb = 0; kb < c.kb_count; kb++) {
            const uint32_t fb = smem_addr(full + stage);
            const uint32_t sa = smem_addr(smem + stage * cfg::STAGE_BYTES);
            const uint32_t sb = sa + cfg::A_BYTES;
            mbar_wait(smem_addr(empty + stage), phase ^ 1);
            if (tid == 0) {
                mbar_arrive_expect_tx(fb, tx_bytes);
                sm90_load_b<BN, STAGES, MODE, FL>(map_b, p, tl, sb, fb, kb);
                if (!GATHER) tma_load_2d(sa, &map_a, fb, kb * SM90_BK, tl.row0);
                /* (the result is first used after the k-loop) */
                if (DYN && kb == claim_kb) nxt = c.ncl + atomicAdd(sm90_dyn_counter(p), 1);
            }
            if (GATHER) {
                const bf16 *src0 = p.a_src + kb * SM90_BK + chunk * 8;
#pragma unroll
                for (int i = 0; i < PRT; i++)
                    sm90_gather_chunk(sa, rsub + RS * i, chunk, src0, tok[i], p.K);
                cp_async_mbar_arrive_noinc(fb);
            }
            if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
        if constexpr (DYN) {
            /* slot j + 1 was last read at tile j - 7's start, which the
             * consumers are past: the stages they released let this thread
             * reach here */
            if (tid == 0) c.dyn[(j + 1) & (SM90_DYN_SLOTS - 1)] = nxt;
            named_barrier_sync(3, NPROD);
            t = c.dyn[(j + 1) & (SM90_DYN_SLOTS - 1)];
        } else {
            t += c.ncl;
        }
    }
    if constexpr (DYN) {
        /* the end (the slot holds t >= total): the next stage's full
         * barrier completes with no data in it (every arrival it counts:
         * thread 0's, and each gathering thread's), and the consumers,
         * reading the slot there, release that stage and leave */
        mbar_wait(smem_addr(empty + stage), phase ^ 1);
        const uint32_t fb = smem_addr(full + stage);
        if (GATHER || tid == 0) mbar_arrive(fb);
        if (GATHER && tid == 0) mbar_arrive(fb);
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
    }
    sm90_producer_tail<STAGES>(empty, stage, phase);
}

/* The producer warpgroup (its gathering threads with SM90_FL_EPIWG): the
 * stages of every tile of the CTA, by the warp-per-stage gather
 * (SM90_FL_WS) or the TMA producer, then the producer's tail. */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_produce(const CUtensorMap &map_a, const CUtensorMap &map_b,
                                             const sm90_gemm_params &p, const sm90_ctx &c,
                                             int tid)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    if constexpr (K::GATHER && K::WS)
        sm90_produce_warp_gather<BN, STAGES, MODE, FL>(map_b, p, c, tid);
    else
        sm90_produce_tma<BN, STAGES, MODE, FL>(map_a, map_b, p, c, tid);
}

/* A consumer warpgroup (wg 1 or 2): per tile the main loop over the stages
 * (wgmma, each stage released once its wgmma retired), then the tile's
 * epilogue. */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_consume(const CUtensorMap &map_a, const CUtensorMap &map_c,
                                             const sm90_gemm_params &p, const sm90_ctx &c,
                                             int tid, int wg)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    typedef typename K::cfg cfg;
    constexpr bool GATHER = K::GATHER, TRANS_B = K::TRANS_B, PP = K::PP;
    constexpr int MH = K::MH, NACC = K::NACC;
    uint8_t *smem = c.smem, *ep_base = c.ep_base;
    uint64_t *full = c.full, *empty = c.empty, *stg = c.stg;
    const int *tile_start = c.tile_start;
    const int nt = c.nt, kb_count = c.kb_count, total = c.total, gm = c.gm, cid = c.cid,
              ncl = c.ncl;
    /* cooperative: rows 64 cw .. 64 cw + 63 of every tile; ping-pong: whole
     * tiles, the CTA's tiles j with j % 2 == cw */
    const int cw = wg - 1;
    float acc[MH * NACC];
    /* ring position of this warpgroup's next k-block: the producer fills
     * kb_count stages per tile, tile after tile */
    uint32_t pos = PP ? (uint32_t)(cw * kb_count) : 0u;
    uint32_t ep_it = 0; /* TMA_ST2: this warpgroup's chunks so far */
    uint32_t jt = 0;    /* EPIWG: this CTA's tiles so far */
    constexpr bool DYN = K::DYN;
    uint32_t jd = 0; /* DYN: this CTA's tiles so far (the ring's slot) */
    int t0 = cid + (PP ? cw * ncl : 0);
    if constexpr (DYN) { /* the first tile, as the producer wrote it before its first arrival */
        mbar_wait(smem_addr(full + pos % STAGES), (pos / STAGES) & 1);
        t0 = c.dyn[0];
    } /* (the main loop's wait on that stage then passes at once) */
    for (int t = t0; t < total;) {
        sm90_tile tl = sm90_tile_decode(t, tile_start, p.E, nt, p.expert_offset,
                                            p.off_stride, gm);
        int prev = 0;
        /* Ping-pong order: a warpgroup starts its main loop only after the
         * other one has waited for the previous tile's last stage. Besides
         * taking turns on the tensor cores, this keeps its full-barrier
         * waits at most one phase ahead of the producer (a parity wait two
         * phases ahead would pass at once). Named barriers 4 (warpgroup 1
         * may go) and 5 (warpgroup 0 may go); an arrival is made only when
         * the other warpgroup has a next tile, so every one is matched. */
        if (PP && t >= ncl) named_barrier_sync(4 + (cw ^ 1), 256);
        /* columns of this tile the MMA computes (BN = 192 only; p.N % 64 == 0) */
        const int wn = min(BN, p.N - tl.n_tile * BN);
        for (int kb = 0; kb < kb_count; kb++, pos++) {
            const int stage = (int)(pos % STAGES);
            mbar_wait(smem_addr(full + stage), (pos / STAGES) & 1);
            /* cp.async (generic proxy) writes -> wgmma (async proxy) reads
             * (dropping it measured no gain: rung 6) */
            if (GATHER) fence_proxy_async();
            const uint32_t sa =
                smem_addr(smem + stage * cfg::STAGE_BYTES) + (PP ? 0 : cw * 64 * 128);
            const uint32_t sb = smem_addr(smem + stage * cfg::STAGE_BYTES) + cfg::A_BYTES;
            if constexpr (BN == 192) {
                /* the last n-tile of d = 4096 has 64 valid columns: a
                 * narrower wgmma there, no wasted MMA (each width its
                 * own fence..commit block, so no wgmma sits in a
                 * divergent path of another's) */
                if (wn == 192)
                    sm90_mma_kblock<192, TRANS_B, MH, MH * NACC>(acc, sa, sb, kb);
                else if (wn == 128)
                    sm90_mma_kblock<128, TRANS_B, MH, MH * NACC>(acc, sa, sb, kb);
                else
                    sm90_mma_kblock<64, TRANS_B, MH, MH * NACC>(acc, sa, sb, kb);
            } else {
                sm90_mma_kblock<BN, TRANS_B, MH, MH * NACC>(acc, sa, sb, kb);
            }
            if (kb > 0) { /* the previous stage's wgmma has retired: release it */
                wgmma_wait<1>();
                if ((tid & 127) == 0) mbar_arrive(smem_addr(empty + prev));
            }
            prev = stage;
        }
        if (PP) {
            pos += kb_count; /* the other warpgroup's tile */
            if (t + ncl < total) named_barrier_arrive(4 + cw, 256);
        }
        wgmma_wait<0>();
        wgmma_fence_regs<MH * NACC>(acc);
        if ((tid & 127) == 0) mbar_arrive(smem_addr(empty + prev));

        sm90_epilogue_tile<BN, STAGES, MODE, FL>(acc, tl, p, &map_a, &map_c, ep_base, stg, tid,
                                                 cw, ep_it, jt);
        if constexpr (DYN) {
            /* the next tile's first stage (or the end's) holds its slot */
            jd++;
            mbar_wait(smem_addr(full + pos % STAGES), (pos / STAGES) & 1);
            t = c.dyn[jd & (SM90_DYN_SLOTS - 1)];
        } else {
            t += (PP ? 2 : 1) * ncl;
        }
    }
    /* DYN: the end's stage, released (no wgmma read it) */
    if (DYN && (tid & 127) == 0) mbar_arrive(smem_addr(empty + pos % STAGES));
}
#endif /* SMOE_MAINLOOP_SM90_CUH */
