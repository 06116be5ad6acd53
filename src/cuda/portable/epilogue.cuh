/*
 * epilogue.cuh -- the portable grouped GEMM's epilogues: from a tile's
 * fp32 accumulators (each thread holds rows g, g+8 of each m16 and
 * columns 2*t4, 2*t4+1 of each n8 of its warp tile) to the GEMM's outputs,
 * through shared memory (the pipeline's stages, free after the main loop,
 * or in a persistent grid the space after the stages the next tile's
 * prologue fills) so that rows leave with coalesced 16-byte stores clipped
 * at the expert's last row and at N.
 *
 *   UP     up: bias, the bf16 H tile staged; A = act(H) computed from each
 *          16-byte chunk of H on the way out (a gated pair (gate, up) sits
 *          in adjacent columns), from the rounded H as the backward sees it.
 *          The activation is a compile-time constant, dispatched once per
 *          tile (activation.cuh).
 *   STORE  down, dxt: bias, bf16.
 *   DH     dh, unrolled over the thread's fragments: H tile (2*BN columns
 *          for BN columns of dA' when gated) into shared memory, per
 *          element A and dact recomputed, dS partial sums per row and
 *          N-tile to scratch (quad shuffles, then the warps in order), A'
 *          stored, dH written over H and stored. The fallback of devices
 *          with less shared memory than DHX needs.
 *   DHX    dh's default: H loaded unpadded in two halves (the second lands
 *          while the first is processed), the rows' scores in shared
 *          memory, half the fp32 dA' rows at a time staged, then whole rows
 *          per warp, two at a time (dS of a row: the lane's columns in
 *          order, then a butterfly), dH stored straight from registers.
 *          Unrolled DH was 560 KB of code for its seven activations and
 *          stalled on it (notes/portable_log.md, call 1 and session 6: dh
 *          252 -> 309 TFLOPS at 120B).
 *   DW     dw1, dw2, unrolled over the fragments: fp32 or bf16, overwrite
 *          or accumulate in fp32.
 *   DWS    the same through fp32 staging (half the rows at a time) and a
 *          rolled loop, 8 columns a thread, 16-byte stores (and loads, to
 *          accumulate).
 * The dS partial sums are reduced by smoe_ds_reduce (ds_reduce.cu).
 */
#ifndef SMOE_PORTABLE_EPILOGUE_CUH
#define SMOE_PORTABLE_EPILOGUE_CUH

#include "cuda/activation.cuh"
#include "cuda/portable/config.cuh"
#include "cuda/ptx.cuh"

/* dh's per-element epilogue, from the thread's fp32 dA' accumulators and
 * the H tile in shared memory (row pitch `pitch` bytes, local columns):
 * dS partial sums per row into dsr, A' = s*A to global memory, dH = s*dact
 * written over H in shared memory (each thread its own elements). */
template <int ACT, int MI, int NI>
static __device__ __forceinline__ void gg_epi_dh(const gg_args &p, const float (&acc)[MI][NI][4],
                                                 unsigned char *hs, int pitch, int64_t m0,
                                                 int64_t m_lim, int64_t n0, int64_t n_lim,
                                                 int wm0, int wn0, int g, int t4,
                                                 float (&dsr)[MI][2])
{
    constexpr bool GATED = smoe_act_gated(ACT);
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            dsr[mi][h] = 0.0f;
            const int lr = wm0 + mi * 16 + g + h * 8;
            const int64_t r = m0 + lr;
            if (r >= m_lim) continue;
            const float s = p.score[r];
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                const int cl = wn0 + ni * 8 + 2 * t4;
                const int64_t c = n0 + cl;
                if (c >= n_lim) continue;
                const float d0 = acc[mi][ni][2 * h], d1 = acc[mi][ni][2 * h + 1];
                float a0, a1;
                if (GATED) {
                    uint2 hr = *(const uint2 *)(hs + lr * pitch + cl * 4);
                    const __nv_bfloat162 p0 = *(const __nv_bfloat162 *)&hr.x;
                    const __nv_bfloat162 p1 = *(const __nv_bfloat162 *)&hr.y;
                    const float u0 = __high2float(p0), u1 = __high2float(p1);
                    float f0, df0, f1, df1;
                    smoe_act_fd<ACT>(__low2float(p0), f0, df0);
                    smoe_act_fd<ACT>(__low2float(p1), f1, df1);
                    a0 = f0 * u0;
                    a1 = f1 * u1;
                    __nv_bfloat162 q0 = __floats2bfloat162_rn(s * d0 * df0 * u0, s * d0 * f0);
                    __nv_bfloat162 q1 = __floats2bfloat162_rn(s * d1 * df1 * u1, s * d1 * f1);
                    hr.x = *(uint32_t *)&q0;
                    hr.y = *(uint32_t *)&q1;
                    *(uint2 *)(hs + lr * pitch + cl * 4) = hr;
                } else {
                    const __nv_bfloat162 hv = *(const __nv_bfloat162 *)(hs + lr * pitch + cl * 2);
                    float df0, df1;
                    smoe_act_fd<ACT>(__low2float(hv), a0, df0);
                    smoe_act_fd<ACT>(__high2float(hv), a1, df1);
                    *(__nv_bfloat162 *)(hs + lr * pitch + cl * 2) =
                        __floats2bfloat162_rn(s * d0 * df0, s * d1 * df1);
                }
                dsr[mi][h] += d0 * a0 + d1 * a1;
                *(__nv_bfloat162 *)(p.out2 + r * p.ld_out2 + c) =
                    __floats2bfloat162_rn(s * a0, s * a1);
            }
        }
}

/* The thread's fp32 accumulator pairs into a staging tile (row pitch
 * `srow` bytes), rows relative to the staged block (lr0 = the warp's
 * first row there). */
template <int MI, int NI>
static __device__ __forceinline__ void gg_stage_acc(const float (&acc)[MI][NI][4], float *stg,
                                                    int srow, int lr0, int wn0, int g, int t4)
{
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float *row = (float *)((unsigned char *)stg + (lr0 + mi * 16 + g + h * 8) * srow);
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
                *(float2 *)(row + wn0 + ni * 8 + 2 * t4) =
                    make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
}

/* One 4-column group of dh's epilogue, in place on its H: gated, hv holds
 * 4 (gate, up) pairs and becomes dH (s d f'(gate) up, s d f(gate)); plain,
 * 4 values and s d f'(h). d: the group's fp32 dA'; s: the row's score;
 * a = act(H) (gated: f(gate) up), for A' and the dS terms. */
template <int ACT>
static __device__ __forceinline__ void gg_dh_group(uint4 &hv, float s, const float d[4],
                                                   float a[4])
{
    __nv_bfloat162 *hp = (__nv_bfloat162 *)&hv;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float u = __high2float(hp[k]);
        float f, df;
        smoe_act_fd<ACT>(__low2float(hp[k]), f, df);
        a[k] = f * u;
        hp[k] = __floats2bfloat162_rn(s * d[k] * df * u, s * d[k] * f);
    }
}

template <int ACT>
static __device__ __forceinline__ void gg_dh_group(uint2 &hv, float s, const float d[4],
                                                   float a[4])
{
    __nv_bfloat162 *hp = (__nv_bfloat162 *)&hv;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        float df0, df1;
        smoe_act_fd<ACT>(__low2float(hp[k]), a[2 * k], df0);
        smoe_act_fd<ACT>(__high2float(hp[k]), a[2 * k + 1], df1);
        hp[k] = __floats2bfloat162_rn(s * d[2 * k] * df0, s * d[2 * k + 1] * df1);
    }
}

/* DHX's rows [r0, r0 + nrows) of the tile, from the staged fp32 dA' (row
 * pitch srow bytes, rows relative to r0): whole rows per warp, two at a
 * time (rows lr and lr + NW: their loads and butterflies interleave), BN/32
 * dA' columns per lane in 4-column groups (16 bytes of fp32 dA', 16 bytes
 * of gated H or 8 of plain H); the score from shared memory (ssc, the
 * tile's rows), H read from an unpadded tile (row pitch `pitch` bytes), dH
 * stored to global memory straight from registers (16 bytes a lane gated,
 * 8 plain: a warp writes one contiguous piece of the row), A' with 8-byte
 * stores. dS of a row: the lane's columns in order, then a butterfly over
 * the warp, written straight to the row's partial sum. n is a multiple of
 * 8, so a 4-column group is inside N or outside it as a whole. */
template <int ACT, int BN, int NW>
static __device__ void gg_epi_dh_rowsx(const gg_args &p, const float *stg, int srow,
                                       const unsigned char *hs, int pitch, const float *ssc,
                                       int r0, int nrows, int64_t m0, int64_t m_lim, int64_t n0,
                                       int64_t n_lim, int n_tile, int warp, int lane)
{
    constexpr bool GATED = smoe_act_gated(ACT);
    constexpr int GROUPS = BN / 128; /* 4-column groups per lane */
    const int64_t hc0 = GATED ? 2 * n0 : n0;
#pragma unroll 1
    for (int lb = r0 + warp; lb < r0 + nrows; lb += 2 * NW) {
        float dsum[2] = {0.0f, 0.0f};
        bool live[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int lr = lb + u * NW;
            const int64_t r = m0 + lr;
            live[u] = lr < r0 + nrows && r < m_lim; /* warp-uniform */
            if (!live[u]) continue;
            const float s = ssc[lr];
            const float *srw = (const float *)((const unsigned char *)stg + (lr - r0) * srow);
#pragma unroll
            for (int q = 0; q < GROUPS; q++) {
                const int cl = (q * 32 + lane) * 4; /* local dA' column */
                const int64_t c = n0 + cl;
                if (c >= n_lim) continue;
                const float4 dv = *(const float4 *)(srw + cl);
                const float d[4] = {dv.x, dv.y, dv.z, dv.w};
                float a[4];
                if (GATED) {
                    uint4 hv = *(const uint4 *)(hs + lr * pitch + cl * 4);
                    gg_dh_group<ACT>(hv, s, d, a);
                    *(uint4 *)(p.out + r * p.ld_out + hc0 + 2 * cl) = hv;
                } else {
                    uint2 hv = *(const uint2 *)(hs + lr * pitch + cl * 2);
                    gg_dh_group<ACT>(hv, s, d, a);
                    *(uint2 *)(p.out + r * p.ld_out + hc0 + cl) = hv;
                }
#pragma unroll
                for (int k = 0; k < 4; k++) dsum[u] += d[k] * a[k];
                __nv_bfloat162 ao[2] = {__floats2bfloat162_rn(s * a[0], s * a[1]),
                                        __floats2bfloat162_rn(s * a[2], s * a[3])};
                *(uint2 *)(p.out2 + r * p.ld_out2 + c) = *(const uint2 *)ao;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            dsum[0] += __shfl_xor_sync(0xffffffffu, dsum[0], o);
            dsum[1] += __shfl_xor_sync(0xffffffffu, dsum[1], o);
        }
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (live[u]) p.dsp[(int64_t)n_tile * p.cap + m0 + lb + u * NW] = dsum[u];
        }
    }
}

/* UP and STORE: the staged bf16 tile ts (rows of 2*BN + 16 bytes) out in
 * 16-byte chunks, a rolled loop, coalesced and clipped at the expert's
 * last row and at N; UP also writes A = act(H) of each chunk (ACT a
 * compile-time constant: one activation's code per instance, dispatched
 * once per tile; the run-time switch it replaced inlined all seven into
 * every element). H (p.out) is not written where p.out is NULL
 * (inference). */
template <int EPI, int ACT, int BM, int BN, int NT>
static __device__ __forceinline__ void gg_epi_rows_out(const gg_args &p, const unsigned char *ts,
                                                       int64_t m0, int64_t m_lim, int64_t n0,
                                                       int64_t n_lim, int tid)
{
    constexpr int OP = 2 * BN + 16; /* bytes per staged row */
    constexpr int CPR = BN / 8;
#pragma unroll 1
    for (int i = tid; i < BM * CPR; i += NT) {
        const int lr = i / CPR, ch = i % CPR;
        const int64_t r = m0 + lr, c = n0 + ch * 8;
        if (r >= m_lim || c >= n_lim) continue;
        const uint4 v = *(const uint4 *)(ts + lr * OP + ch * 16);
        if (EPI == GG_EPI_STORE || p.out) *(uint4 *)(p.out + r * p.ld_out + c) = v;
        if constexpr (EPI == GG_EPI_UP) {
            const __nv_bfloat162 *hp = (const __nv_bfloat162 *)&v;
            if constexpr (smoe_act_gated(ACT)) {
                __nv_bfloat162 o[2];
#pragma unroll
                for (int q = 0; q < 2; q++)
                    o[q] = __floats2bfloat162_rn(
                        smoe_act_f<ACT>(__low2float(hp[2 * q])) * __high2float(hp[2 * q]),
                        smoe_act_f<ACT>(__low2float(hp[2 * q + 1])) * __high2float(hp[2 * q + 1]));
                *(uint2 *)(p.out2 + r * p.ld_out2 + (c >> 1)) = *(const uint2 *)o;
            } else {
                __nv_bfloat162 o[4];
#pragma unroll
                for (int q = 0; q < 4; q++)
                    o[q] = __floats2bfloat162_rn(smoe_act_f<ACT>(__low2float(hp[q])),
                                                 smoe_act_f<ACT>(__high2float(hp[q])));
                *(uint4 *)(p.out2 + r * p.ld_out2 + c) = *(const uint4 *)o;
            }
        }
    }
}

/* The epilogue EPI (see the file's overview) of tile tl
 * from the thread's accumulators; es: the shared memory they may use (the
 * pipeline's stages, free after the main loop, or in a persistent grid the
 * space after the stages the next tile's prologue fills). */
template <GG_TPARAMS>
static __device__ __forceinline__ void gg_epilogue(
    const gg_args &p, const gg_tile &tl,
    const float (&acc)[gg_cfg<BM, BN, BK, WM, WN, STAGES, FA>::MI]
                      [gg_cfg<BM, BN, BK, WM, WN, STAGES, FA>::NI][4],
    unsigned char *es)
{
    typedef gg_cfg<BM, BN, BK, WM, WN, STAGES, FA> C;
    constexpr int NT = C::NT, MI = C::MI, NI = C::NI;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int wm0 = wm * C::WTM, wn0 = wn * C::WTN;
    const int e = tl.e, n_tile = tl.n_tile;
    const int64_t m0 = tl.m0, m_lim = tl.m_lim, n0 = (int64_t)n_tile * BN, n_lim = p.N;
    const uint32_t esa = smoe_smem_addr(es);
    (void)esa;
    /* --- epilogues. Thread holds rows g, g+8 of each m16 and columns
     * 2*t4, 2*t4+1 of each n8: a gated pair (gate, up) sits in one thread. */
    const int g = lane >> 2, t4 = lane & 3;

    if (EPI == GG_EPI_UP || EPI == GG_EPI_STORE) {
        /* Through shared memory: the thread's bf16 pairs (plus bias) go into
         * a padded BM x BN tile (H, Y or dX~); then 16-byte chunks leave
         * in a rolled loop, coalesced and clipped at the expert's last row
         * and at N; up computes A from each chunk of H on the way out (a
         * gated pair sits in one chunk). */
        constexpr int OP = 2 * BN + 16; /* bytes per staged row */
        unsigned char *ts = es;
        const bf16 *bias = p.bias ? p.bias + (int64_t)e * p.bias_stride : nullptr;
        __syncthreads(); /* every warp is done with the pipeline's stages */
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            const int cl = wn0 + ni * 8 + 2 * t4;
            const int64_t c = n0 + cl;
            float b0 = 0.0f, b1 = 0.0f;
            if (bias && c < n_lim) {
                b0 = __bfloat162float(bias[gg_map(p, p.bias_map, c)]);
                b1 = __bfloat162float(bias[gg_map(p, p.bias_map, c + 1)]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int lr = wm0 + mi * 16 + g + h * 8;
                    *(__nv_bfloat162 *)(ts + lr * OP + cl * 2) = __floats2bfloat162_rn(
                        acc[mi][ni][2 * h] + b0, acc[mi][ni][2 * h + 1] + b1);
                }
        }
        __syncthreads();
        if constexpr (EPI == GG_EPI_STORE) {
            gg_epi_rows_out<GG_EPI_STORE, SMOE_ACT_SWIGLU, BM, BN, NT>(p, ts, m0, m_lim, n0, n_lim,
                                                                      tid);
        } else {
#define GG_UP_ROWS(A) gg_epi_rows_out<GG_EPI_UP, A, BM, BN, NT>(p, ts, m0, m_lim, n0, n_lim, tid)
            SMOE_ACT_SWITCH(p.act, GG_UP_ROWS);
#undef GG_UP_ROWS
        }
    } else if (EPI == GG_EPI_DH) {
        /* dA' tile (BM x BN over n) needs H columns [2*n0, 2*n0 + 2*BN)
         * (gated) or [n0, n0 + BN): they come into shared memory (over the
         * stages) with coalesced 16-byte copies, rows padded so that a
         * quad's 8-byte (gated) or 4-byte reads of 8 rows hit distinct
         * banks. */
        const int hcpr = (p.gated ? 2 * BN : BN) / 8;
        const int pitch = p.gated ? 4 * BN + 32 : 2 * BN + 16; /* bytes */
        const int64_t hc0 = p.gated ? 2 * n0 : n0;
        __syncthreads(); /* every warp is done with the pipeline's stages */
        for (int i = tid; i < BM * hcpr; i += NT) {
            const int lr = i / hcpr, ch = i % hcpr;
            const int64_t r = m0 + lr, col = hc0 + ch * 8;
            const bool v = r < m_lim && col < p.ld_h;
            smoe_cp_async16(esa + lr * pitch + ch * 16, v ? p.hin + r * p.ld_h + col : p.hin, v);
        }
        smoe_cp_async_commit();
        smoe_cp_async_wait<0>();
        unsigned char *hs = es; /* H in, dH out */
        __syncthreads();
        float dsr[MI][2];
#define GG_DH_REGS(A)                                                                          \
    gg_epi_dh<A, MI, NI>(p, acc, hs, pitch, m0, m_lim, n0, n_lim, wm0, wn0, g, t4, dsr)
        SMOE_ACT_SWITCH(p.act, GG_DH_REGS);
#undef GG_DH_REGS
        /* Row sums: the quad, then the WN warps of a row in order. */
        float *red = (float *)(es + C::DH_H_BYTES); /* [WN][BM], after the H tile */
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float v = dsr[mi][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (t4 == 0) red[wn * BM + wm0 + mi * 16 + g + h * 8] = v;
            }
        __syncthreads();
        for (int lr = tid; lr < BM; lr += NT) {
            const int64_t r = m0 + lr;
            if (r >= m_lim) continue;
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < WN; w++) v += red[w * BM + lr];
            p.dsp[(int64_t)n_tile * p.cap + r] = v;
        }
        /* dH rows out, coalesced (the barrier above ordered the writes). */
        for (int i = tid; i < BM * hcpr; i += NT) {
            const int lr = i / hcpr, ch = i % hcpr;
            const int64_t r = m0 + lr, col = hc0 + ch * 8;
            if (r < m_lim && col < p.ld_out)
                *(uint4 *)(p.out + r * p.ld_out + col) =
                    *(const uint4 *)(hs + lr * pitch + ch * 16);
        }
    } else if (EPI == GG_EPI_DHX) {
        /* H's rows come into shared memory unpadded (rows of whole 16-byte
         * chunks, read back whole by consecutive lanes) in two commit
         * groups, one per half of the rows, and the rows' scores beside
         * them; half the fp32 dA' rows at a time are staged after H, and
         * every warp takes whole rows (gg_epi_dh_rowsx, two at a time),
         * storing dH and A' straight from registers: the second half's H
         * lands while the first half is processed, no row waits for a
         * score load, no pass copies dH back out of shared memory. */
        const int hcpr = (p.gated ? 2 * BN : BN) / 8; /* 16-byte chunks per H row */
        const int pitch = hcpr * 16;
        const int64_t hc0 = p.gated ? 2 * n0 : n0;
        constexpr int PR = BM / 2;
        float *stg = (float *)(es + C::DHX_H_BYTES);
        float *ssc = (float *)(es + C::DHX_H_BYTES + PR * C::SROW);
        const int ch = tid % hcpr, rstep = NT / hcpr;
        __syncthreads(); /* every warp is done with the pipeline's stages */
#pragma unroll 1
        for (int half = 0; half < 2; half++) {
#pragma unroll 1
            for (int lr = half * PR + tid / hcpr; lr < (half + 1) * PR; lr += rstep) {
                const int64_t r = m0 + lr, col = hc0 + ch * 8;
                const bool v = r < m_lim && col < p.ld_h;
                smoe_cp_async16(esa + lr * pitch + ch * 16, v ? p.hin + r * p.ld_h + col : p.hin,
                                v);
            }
            smoe_cp_async_commit();
        }
        for (int lr = tid; lr < BM; lr += NT) ssc[lr] = m0 + lr < m_lim ? p.score[m0 + lr] : 0.0f;
#pragma unroll 1
        for (int pass = 0; pass < 2; pass++) {
            if (wm0 / PR == pass)
                gg_stage_acc<MI, NI>(acc, stg, C::SROW, wm0 - pass * PR, wn0, g, t4);
            if (pass == 0) smoe_cp_async_wait<1>();
            else smoe_cp_async_wait<0>();
            __syncthreads(); /* staging written, this half's H and the scores landed */
#define GG_DHX_ROWS(A)                                                                         \
    gg_epi_dh_rowsx<A, BN, NT / 32>(p, stg, C::SROW, es, pitch, ssc, pass * PR, PR, m0, m_lim, \
                                    n0, n_lim, n_tile, warp, lane)
            SMOE_ACT_SWITCH(p.act, GG_DHX_ROWS);
#undef GG_DHX_ROWS
            if (pass == 0) __syncthreads(); /* staging consumed */
        }
    } else if (EPI == GG_EPI_DWS) {
        /* Half the rows at a time through fp32 staging over the stages, then
         * 8 columns per thread and step: coalesced 16-byte (bf16) or 2x16-byte
         * (fp32) stores, the old value read the same way to accumulate. */
        float *stg = (float *)es;
        constexpr int PR = BM / 2, CPR = BN / 8;
        __syncthreads(); /* every warp is done with the pipeline's stages */
#pragma unroll 1
        for (int pass = 0; pass < 2; pass++) {
            if (wm0 / PR == pass)
                gg_stage_acc<MI, NI>(acc, stg, C::SROW, wm0 - pass * PR, wn0, g, t4);
            __syncthreads();
#pragma unroll 1
            for (int i = tid; i < PR * CPR; i += NT) {
                const int lr = i / CPR, ch = i % CPR;
                const int64_t m = m0 + pass * PR + lr, c = n0 + ch * 8;
                if (m >= m_lim || c >= n_lim) continue;
                const float *sp =
                    (const float *)((const unsigned char *)stg + lr * C::SROW) + ch * 8;
                const float4 v0 = *(const float4 *)sp, v1 = *(const float4 *)(sp + 4);
                float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
                const int64_t o = ((int64_t)e * p.M + gg_map(p, p.out_map, m)) * p.N + c;
                if (p.out_f32) {
                    float4 *q = (float4 *)((float *)p.wout + o);
                    if (p.accumulate) {
                        const float4 a0 = q[0], a1 = q[1];
                        v[0] += a0.x; v[1] += a0.y; v[2] += a0.z; v[3] += a0.w;
                        v[4] += a1.x; v[5] += a1.y; v[6] += a1.z; v[7] += a1.w;
                    }
                    q[0] = make_float4(v[0], v[1], v[2], v[3]);
                    q[1] = make_float4(v[4], v[5], v[6], v[7]);
                } else {
                    uint4 *q = (uint4 *)((bf16 *)p.wout + o);
                    if (p.accumulate) {
                        const uint4 a = *q;
                        const __nv_bfloat162 *ap = (const __nv_bfloat162 *)&a;
#pragma unroll
                        for (int k = 0; k < 4; k++) {
                            v[2 * k] += __low2float(ap[k]);
                            v[2 * k + 1] += __high2float(ap[k]);
                        }
                    }
                    __nv_bfloat162 ov[4];
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        ov[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
                    *q = *(const uint4 *)ov;
                }
            }
            __syncthreads(); /* staging consumed */
        }
    } else { /* GG_EPI_DW */
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int64_t m = m0 + wm0 + mi * 16 + g + h * 8;
                if (m >= m_lim) continue;
                const int64_t orow = ((int64_t)e * p.M + gg_map(p, p.out_map, m)) * p.N;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const int64_t c = n0 + wn0 + ni * 8 + 2 * t4;
                    if (c >= n_lim) continue;
                    float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                    if (p.out_f32) {
                        float2 *q = (float2 *)((float *)p.wout + orow + c);
                        if (p.accumulate) {
                            float2 o = *q;
                            v0 += o.x;
                            v1 += o.y;
                        }
                        *q = make_float2(v0, v1);
                    } else {
                        __nv_bfloat162 *q = (__nv_bfloat162 *)((bf16 *)p.wout + orow + c);
                        if (p.accumulate) {
                            __nv_bfloat162 o = *q;
                            v0 += __low2float(o);
                            v1 += __high2float(o);
                        }
                        *q = __floats2bfloat162_rn(v0, v1);
                    }
                }
            }
    }
}


#endif /* SMOE_PORTABLE_EPILOGUE_CUH */
