/*
 * epilogue_sm90.cuh -- the varlen-M GEMMs' epilogues, from a consumer
 * warpgroup's accumulators: the padded staging and its row-segment
 * stores (down, dxt), up's H and A = act(H) (ep_flush_up_ct), dh's dH, A'
 * and dS partials straight from registers (ep_dh_direct) or through TMA
 * stores (ep_dh_tma), and the double-buffered TMA-store chunks
 * (ep_store_chunks_tma).
 */
#ifndef SMOE_EPILOGUE_SM90_CUH
#define SMOE_EPILOGUE_SM90_CUH

#include "cuda/sm90/config_sm90.cuh"
#include "cuda/sm90/scheduler_sm90.cuh"

/* ------------------------------------------------------------ epilogue staging */


__device__ __forceinline__ void ep_put2(uint8_t *eb, int r, int c, float v0, float v1)
{
    *(__nv_bfloat162 *)(eb + r * SM90_EP_STRIDE + c * 2) = __floats2bfloat162_rn(v0, v1);
}

__device__ __forceinline__ void ep_put4(uint8_t *eb, int r, int c, float v0, float v1, float v2,
                                        float v3)
{
    __nv_bfloat162 a = __floats2bfloat162_rn(v0, v1), b = __floats2bfloat162_rn(v2, v3);
    uint2 pk;
    pk.x = *(uint32_t *)&a;
    pk.y = *(uint32_t *)&b;
    *(uint2 *)(eb + r * SM90_EP_STRIDE + c * 2) = pk;
}

/* Stores the warpgroup's staged 64 rows (WBYTES bytes each) to dst (row
 * stride ld elements), rows < nvalid only. WARP: warp w stores the rows
 * 16 w .. 16 w + 15 it staged itself (the accumulator layout), 4 at a
 * time, so only its own lanes meet (__syncwarp; rung 26); else (the
 * ping-pong kernels, where the extra index registers spilled) thread t
 * takes rows t / 8 + 16 i between warpgroup barriers. Either way the
 * writes land before the reads, and the reads finish before the buffer is
 * written again. */
template <int WBYTES, bool WARP>
__device__ __forceinline__ void ep_flush(const uint8_t *eb, bf16 *dst, int64_t ld, int nvalid,
                                         int t, int cw)
{
    constexpr int VPR = WBYTES / 16;
    static_assert(VPR == 8, "rows of 128 bytes");
    if (WARP) __syncwarp();
    else named_barrier_sync(1 + cw, 128);
    const int v = t % VPR;
    const int rb = WARP ? 16 * ((t >> 5) & 3) + (t & 31) / VPR : t / VPR, rs = WARP ? 4 : 16;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rb + rs * i;
        if (r >= nvalid) continue;
        uint8_t *gp = (uint8_t *)(dst + (int64_t)r * ld) + v * 16;
        const uint4 val = *(const uint4 *)(eb + r * SM90_EP_STRIDE + v * 16);
        *(uint4 *)gp = val;
    }
    if (WARP) __syncwarp();
    else named_barrier_sync(1 + cw, 128);
}

/* up's flush: stores the staged H chunk (64 columns from hc0, when H is
 * wanted) and A = act(H) from the same bf16 values: 8 columns per thread,
 * i.e. 4 (gate, up) pairs or 8 plain values, for 4 rows. The activation is
 * a template parameter (ep_flush_up_any dispatches once per chunk; a
 * per-element switch with an IEEE division measured 12-14% slower on up,
 * notes/sm90_log.md rung 8); the 4 rows are read before the second barrier,
 * so the buffer is refilled while the math and stores run. */
template <int ACT, bool SYNC = true>
__device__ __noinline__ void ep_flush_up_ct(const uint8_t *eb, bf16 *out_h, bf16 *out_a, int ldh,
                                            int lda, int wrow0, int hc0, int nvalid, int t)
{
    constexpr bool GATED = ACT <= SMOE_ACT_REGLU;
    /* SYNC (the consumer warps): warp w staged rows 16 w .. 16 w + 15 and
     * flushes those same rows, 4 at a time, so its own lanes are all that
     * must meet (no warpgroup barrier: rung 26). The epilogue warps (SYNC
     * false) take rows t / 8 + 16 i of a tile handed over by mbarriers. */
    const int v = t & 7;
    const int rb = SYNC ? 16 * ((t >> 5) & 3) + ((t & 31) >> 3) : t >> 3, rs = SYNC ? 4 : 16;
    if (SYNC) __syncwarp();
    uint4 hv[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        hv[i] = *(const uint4 *)(eb + (rb + rs * i) * SM90_EP_STRIDE + v * 16);
    if (SYNC) __syncwarp(); /* the warp's rows may be refilled now */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rb + rs * i;
        if (r >= nvalid) break;
        const int64_t row = wrow0 + r;
        if (out_h) st_global_v4(out_h + row * ldh + hc0 + 8 * v, hv[i]);
        const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv[i];
        if (GATED) {
            uint32_t o[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                __nv_bfloat162 a2 = __floats2bfloat162_rn(
                    smoe_act_f<ACT>(__low2float(h2[2 * k])) * __high2float(h2[2 * k]),
                    smoe_act_f<ACT>(__low2float(h2[2 * k + 1])) * __high2float(h2[2 * k + 1]));
                o[k] = *(uint32_t *)&a2;
            }
            *(uint2 *)(out_a + row * lda + hc0 / 2 + 4 * v) = make_uint2(o[0], o[1]);
        } else {
            uint32_t o[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                __nv_bfloat162 a2 = __floats2bfloat162_rn(smoe_act_f<ACT>(__low2float(h2[k])),
                                                          smoe_act_f<ACT>(__high2float(h2[k])));
                o[k] = *(uint32_t *)&a2;
            }
            st_global_v4(out_a + row * lda + hc0 + 8 * v, make_uint4(o[0], o[1], o[2], o[3]));
        }
    }
}

/* ep_flush_up_ct with the activation dispatched once per chunk (SYNC false:
 * the epilogue warps, whose staging is handed over by mbarriers). */
template <bool SYNC = true>
__device__ __forceinline__ void ep_flush_up_any(const uint8_t *eb, bf16 *out_h, bf16 *out_a,
                                                int ldh, int lda, int act, int wrow0, int hc0,
                                                int nvalid, int t)
{
#define SM90_UP_FLUSH(A)                                                                         \
    ep_flush_up_ct<A, SYNC>(eb, out_h, out_a, ldh, lda, wrow0, hc0, nvalid, t)
    SMOE_ACT_SWITCH(act, SM90_UP_FLUSH);
#undef SM90_UP_FLUSH
}

/* dh: a thread's two rows (lr, lr + 8 of the warpgroup's 64): valid?, the
 * row loaded (row 0 of the block stands in for rows past nvalid), its score
 * and its first H element (hw H columns per unit). */
__device__ __forceinline__ void ep_dh_rows(const sm90_gemm_params &p, int wrow0, int nvalid,
                                           int n0, int lr, int q, int hw, bool *rv, int64_t *row,
                                           float *s, const bf16 **hp)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        rv[h] = lr + 8 * h < nvalid;
        row[h] = wrow0 + (rv[h] ? lr + 8 * h : 0);
        s[h] = __ldg(p.score + row[h]);
        hp[h] = p.h_in + row[h] * p.h_cols + hw * (n0 + 2 * q);
    }
}

/* dh: a thread's two row sums of dS partials, reduced over the row's 4 lanes
 * (same lane / 4: its 4 column phases) and written for this n-tile. */
__device__ __forceinline__ void ep_dh_ds_out(float *ds, const bool *rv, const int64_t *row, int q,
                                             int n_tile, const sm90_gemm_params &p)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        ds[h] += __shfl_xor_sync(0xffffffffu, ds[h], 1);
        ds[h] += __shfl_xor_sync(0xffffffffu, ds[h], 2);
        if (q == 0 && rv[h]) p.dsp[(int64_t)n_tile * p.cap + row[h]] = ds[h];
    }
}

/* dh's epilogue, straight from the accumulators. The thread
 * holds dA' for rows lr and lr + 8 of the warpgroup's 64 and, in 8-column
 * group j, units n0 + 8j + 2q and + 1 (the m64nBN accumulator layout:
 * acc[4j + 2h + {0,1}]). Per group it loads the H pairs of those units
 * (gated: (gate, up) x 2 = 8 bytes; plain: 4 bytes per row; a warp reads
 * whole 32-byte sectors), computes dH and A' = s A and stores them from
 * registers, and adds <dA', A> to its two row sums. The loads run DIST
 * groups ahead of the math, so only the first group's latency is exposed
 * (staged through shared memory, each 32-unit chunk waited a full memory
 * latency: ncu, notes/sm90_log.md rung 8). The row sums are reduced over
 * the row's 4 lanes once per tile. */
template <int ACT, int BN>
__device__ __forceinline__ void ep_dh_direct(const float *ac, const sm90_gemm_params &p,
                                             int wrow0, int nvalid, int n0, int lr, int q,
                                             int n_tile)
{
    constexpr bool GATED = ACT <= SMOE_ACT_REGLU;
    constexpr int J = BN / 8, DIST = 8, HW = GATED ? 2 : 1; /* H columns per unit */
    const int jn = min(J, (p.N - n0) / 8); /* n % 64 == 0: whole groups */
    /* No branches in the body, so the compiler can keep the loads in flight:
     * rows past the expert's end and groups past n load row 0 / group 0 of
     * the tile (always valid) and store nothing. */
    bool rv[2];
    int64_t row[2];
    float s[2], ds[2] = {0.0f, 0.0f};
    const bf16 *hp[2];
    ep_dh_rows(p, wrow0, nvalid, n0, lr, q, HW, rv, row, s, hp);
    uint2 hv[J][2];
#pragma unroll
    for (int j = 0; j < J + DIST; j++) {
        if (j < J) { /* loads DIST groups ahead of their use */
            const int jl = j < jn ? j : 0;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                /* plain (coherent) loads: the compiler may not move them
                 * past the stores below (they might alias), so they stay
                 * DIST groups ahead; __ldg ones were sunk to their use */
                if (GATED) {
                    hv[j][h] = *(const uint2 *)(hp[h] + 16 * jl);
                } else {
                    hv[j][h].x = *(const unsigned int *)(hp[h] + 8 * jl);
                    hv[j][h].y = 0u;
                }
            }
        }
        const int jc = j - DIST;
        if (jc < 0) continue;
        const bool jv = jc < jn;
        const int u = n0 + 8 * jc + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float da0 = ac[4 * jc + 2 * h], da1 = ac[4 * jc + 2 * h + 1];
            const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv[jc][h];
            const bool st = rv[h] && jv;
            float a0, a1;
            if (GATED) {
                float f0, df0, f1, df1;
                const float g0 = __low2float(h2[0]), u0 = __high2float(h2[0]);
                const float g1 = __low2float(h2[1]), u1 = __high2float(h2[1]);
                smoe_act_fd<ACT>(g0, f0, df0);
                smoe_act_fd<ACT>(g1, f1, df1);
                a0 = f0 * u0;
                a1 = f1 * u1;
                const float e0 = s[h] * da0, e1 = s[h] * da1;
                __nv_bfloat162 o0 = __floats2bfloat162_rn(e0 * df0 * u0, e0 * f0);
                __nv_bfloat162 o1 = __floats2bfloat162_rn(e1 * df1 * u1, e1 * f1);
                if (st)
                    *(uint2 *)(p.out0 + row[h] * p.h_cols + 2 * u) =
                        make_uint2(*(uint32_t *)&o0, *(uint32_t *)&o1);
            } else {
                float df0, df1;
                smoe_act_fd<ACT>(__low2float(h2[0]), a0, df0);
                smoe_act_fd<ACT>(__high2float(h2[0]), a1, df1);
                __nv_bfloat162 o = __floats2bfloat162_rn(s[h] * da0 * df0, s[h] * da1 * df1);
                if (st) *(uint32_t *)(p.out0 + row[h] * p.h_cols + u) = *(uint32_t *)&o;
            }
            __nv_bfloat162 a = __floats2bfloat162_rn(s[h] * a0, s[h] * a1);
            if (st) *(uint32_t *)(p.out1 + row[h] * p.n + u) = *(uint32_t *)&a;
            ds[h] = jv ? fmaf(da1, a1, fmaf(da0, a0, ds[h])) : ds[h];
        }
    }
    ep_dh_ds_out(ds, rv, row, q, n_tile, p);
}

/* ep_dh_direct with the activation dispatched once per tile. */
template <int BN>
__device__ __forceinline__ void ep_dh_direct_any(const float *ac, const sm90_gemm_params &p,
                                                 int wrow0, int nvalid, int n0, int lr, int q,
                                                 int n_tile)
{
    /* a block wholly past the expert's end stores nothing, and its "row 0"
     * (the stand-in row of ep_dh_direct's loads) may lie past the buffer's
     * last row: found by compute-sanitizer memcheck on the GEMM test */
    if (nvalid <= 0) return;
#define SM90_DH_DIRECT(A) ep_dh_direct<A, BN>(ac, p, wrow0, nvalid, n0, lr, q, n_tile)
    SMOE_ACT_SWITCH(p.act, SM90_DH_DIRECT);
#undef SM90_DH_DIRECT
}

/* One warp's rows of a staged pair of chunks out (dh's dH and A'): rows
 * 16 w .. 16 w + 15 of hb (64 rows x 64 bf16, 128B swizzle) to columns
 * c0.. of out0 (row stride ld0, map0: 16-row boxes) and of ab (64 rows x
 * 32 bf16, 64B swizzle) to columns c1.. of out1 (ld1, map1); by TMA store
 * from the warp's lane 0 (one bulk group) where all 16 rows are valid, by
 * its lanes for an expert's last rows (r < nvalid only, so no row of the
 * next expert is written). The caller has fenced and synchronised the warp
 * after writing its rows. */
__device__ __forceinline__ void ep_pair_out_warp(const uint8_t *hb, const uint8_t *ab,
                                                 const CUtensorMap *map0,
                                                 const CUtensorMap *map1, bf16 *out0,
                                                 int64_t ld0, int c0, bf16 *out1, int64_t ld1,
                                                 int c1, int wrow0, int nvalid, int w, int lane)
{
    const int r0 = 16 * w;
    if (r0 + 16 <= nvalid) {
        if (lane == 0) {
            tma_store_2d(map0, smem_addr(hb + r0 * 128), c0, wrow0 + r0);
            tma_store_2d(map1, smem_addr(ab + r0 * 64), c1, wrow0 + r0);
            bulk_commit();
        }
        return;
    }
    /* 16 rows x 8 pieces of 16 bytes, then 16 rows x 4 */
#pragma unroll
    for (int i = lane; i < 16 * 8; i += 32) {
        const int r = r0 + (i >> 3), g = i & 7;
        if (r < nvalid)
            *(uint4 *)(out0 + (int64_t)(wrow0 + r) * ld0 + c0 + 8 * g) =
                *(const uint4 *)(hb + r * 128 + ((g ^ (r & 7)) << 4));
    }
#pragma unroll
    for (int i = lane; i < 16 * 4; i += 32) {
        const int r = r0 + (i >> 2), g = i & 3;
        if (r < nvalid)
            *(uint4 *)(out1 + (int64_t)(wrow0 + r) * ld1 + c1 + 8 * g) =
                *(const uint4 *)(ab + r * 64 + ((g ^ ((r >> 1) & 3)) << 4));
    }
}

/* dh's arithmetic for one thread's two units of one row (gated): from the H
 * pair hv ((gate, up) x 2), dA' (da0, da1) and the row's score s, the two
 * dH pairs (to *dh, as stored), A' = s A (to *as) and the row sum's terms
 * (added to *ds where jv). */
template <int ACT>
__device__ __forceinline__ void ep_dh_unit2(uint2 hv, float da0, float da1, float s, uint2 *dh,
                                            uint32_t *as, float *ds, bool jv)
{
    const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv;
    float f0, df0, f1, df1;
    const float g0 = __low2float(h2[0]), u0 = __high2float(h2[0]);
    const float g1 = __low2float(h2[1]), u1 = __high2float(h2[1]);
    smoe_act_fd<ACT>(g0, f0, df0);
    smoe_act_fd<ACT>(g1, f1, df1);
    const float a0 = f0 * u0, a1 = f1 * u1;
    const float e0 = s * da0, e1 = s * da1;
    __nv_bfloat162 o0 = __floats2bfloat162_rn(e0 * df0 * u0, e0 * f0);
    __nv_bfloat162 o1 = __floats2bfloat162_rn(e1 * df1 * u1, e1 * f1);
    *dh = make_uint2(*(uint32_t *)&o0, *(uint32_t *)&o1);
    __nv_bfloat162 a = __floats2bfloat162_rn(s * a0, s * a1);
    *as = *(uint32_t *)&a;
    *ds = jv ? fmaf(da1, a1, fmaf(da0, a0, *ds)) : *ds;
}

/* dh's epilogue with SM90_FL_TMA_ST2 (gated; experiment): the same
 * arithmetic and H loads as ep_dh_direct, but dH and A' leave through
 * shared memory by TMA store, 32 units at a time: dH's 64 x 64 chunk (the
 * units' (gate, up) pairs) into hb (128B swizzle, as map_dh reads it) and
 * A''s 64 x 32 chunk into ab (64B swizzle, as map_as reads it), instead of
 * 8- and 4-byte stores scattered over 8 rows per warp instruction. Each
 * warp fills and stores only its own 16 rows (the accumulator layout), so
 * its lanes meet by __syncwarp and its lane 0 issues and waits for its own
 * TMA stores (16-row boxes; warpgroup barriers here measured slower: rung
 * 26). A chunk waits until the warp's previous stores have read its rows;
 * whole 16-row pieces leave by TMA, an expert's last rows by the lanes. */
template <int ACT, int BN>
__device__ __forceinline__ void ep_dh_tma(const float *ac, uint8_t *hb, uint8_t *ab,
                                          const CUtensorMap *map_dh, const CUtensorMap *map_as,
                                          const sm90_gemm_params &p, int wrow0, int nvalid,
                                          int n0, int lr, int q, int n_tile, int t)
{
    static_assert(ACT <= SMOE_ACT_REGLU, "gated activations only");
    constexpr int J = BN / 8, DIST = 8;
    const int jn = min(J, (p.N - n0) / 8);
    bool rv[2];
    int64_t row[2];
    float s[2], ds[2] = {0.0f, 0.0f};
    const bf16 *hp[2];
    ep_dh_rows(p, wrow0, nvalid, n0, lr, q, 2, rv, row, s, hp);
    uint2 hv[J][2];
#pragma unroll
    for (int j = 0; j < J + DIST; j++) {
        if (j < J) { /* loads DIST groups ahead of their use (see ep_dh_direct) */
            const int jl = j < jn ? j : 0;
#pragma unroll
            for (int h = 0; h < 2; h++) hv[j][h] = *(const uint2 *)(hp[h] + 16 * jl);
        }
        const int jc = j - DIST;
        if (jc < 0) continue;
        const int g = jc & 3; /* group within the 32-unit chunk */
        if (g == 0) {         /* a new chunk: the warp's previous stores have read its rows */
            if ((t & 31) == 0) bulk_wait_read<0>();
            __syncwarp();
        }
        const bool jv = jc < jn;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = lr + 8 * h;
            /* dH: units 8 g + 2 q, +1 of the chunk = bytes 32 g + 8 q of the
             * 128-byte row; A': bytes 16 g + 4 q of the 64-byte row */
            ep_dh_unit2<ACT>(
                hv[jc][h], ac[4 * jc + 2 * h], ac[4 * jc + 2 * h + 1], s[h],
                (uint2 *)(hb + r * 128 + (((2 * g + (q >> 1)) ^ (r & 7)) << 4) + 8 * (q & 1)),
                (uint32_t *)(ab + r * 64 + ((g ^ ((r >> 1) & 3)) << 4) + 4 * q), &ds[h], jv);
        }
        if (g == 3) { /* the chunk is complete: out */
            const int u0c = n0 + 8 * (jc - 3); /* its first unit */
            fence_proxy_async();
            __syncwarp();
            if (u0c < p.N)
                ep_pair_out_warp(hb, ab, map_dh, map_as, p.out0, p.h_cols, 2 * u0c, p.out1, p.n,
                                 u0c, wrow0, nvalid, t >> 5, t & 31);
        }
    }
    ep_dh_ds_out(ds, rv, row, q, n_tile, p);
}

/* ep_dh_tma with the (gated) activation dispatched once per tile. A block
 * wholly past the expert's end returns at once, as in ep_dh_direct_any (its
 * stand-in row may lie past the buffer); nvalid is the same for the whole
 * warpgroup, so its named barriers stay matched. */
template <int BN>
__device__ __forceinline__ void ep_dh_tma_any(const float *ac, uint8_t *hb, uint8_t *ab,
                                              const CUtensorMap *map_dh,
                                              const CUtensorMap *map_as,
                                              const sm90_gemm_params &p, int wrow0, int nvalid,
                                              int n0, int lr, int q, int n_tile, int t)
{
    if (nvalid <= 0) return;
    if (p.act == SMOE_ACT_GEGLU)
        ep_dh_tma<SMOE_ACT_GEGLU, BN>(ac, hb, ab, map_dh, map_as, p, wrow0, nvalid, n0, lr, q,
                                      n_tile, t);
    else if (p.act == SMOE_ACT_REGLU)
        ep_dh_tma<SMOE_ACT_REGLU, BN>(ac, hb, ab, map_dh, map_as, p, wrow0, nvalid, n0, lr, q,
                                      n_tile, t);
    else
        ep_dh_tma<SMOE_ACT_SWIGLU, BN>(ac, hb, ab, map_dh, map_as, p, wrow0, nvalid, n0, lr, q,
                                       n_tile, t);
}


/* Chunk c (64 columns from col0) of a warpgroup's 64 x BN block, bias
 * added and rounded, into the 64 x 64 box hb (128B swizzle: 16-byte chunk jj
 * of row r at jj ^ (r & 7); free of bank conflicts for these 4-byte writes). */
__device__ __forceinline__ void ep_stage_chunk(const float *ac, uint8_t *hb,
                                               const sm90_gemm_params &p, int c, int col0,
                                               int64_t bo, int lr, int q)
{
#pragma unroll
    for (int jj = 0; jj < 8; jj++) {
        const int j = 8 * c + jj, col = col0 + 8 * jj + 2 * q;
        const float b0 = load_bias(p.bias, bo + col), b1 = load_bias(p.bias, bo + col + 1);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = lr + 8 * h;
            const __nv_bfloat162 hv =
                __floats2bfloat162_rn(ac[4 * j + 2 * h] + b0, ac[4 * j + 2 * h + 1] + b1);
            *(__nv_bfloat162 *)(hb + r * 128 + ((jj ^ (r & 7)) << 4) + 4 * q) = hv;
        }
    }
}

/* down / dxt with SM90_FL_TMA_ST2: the warpgroup's 64 x BN block in 64-column
 * chunks through two 8 KiB buffers (wb, wb + 8192; 128B-swizzled 64 x 64
 * boxes, as map_c reads them). Chunk i (counted over the warpgroup's whole
 * run in `it`) takes buffer i & 1 once the TMA store of chunk i - 2 has read
 * it (at most one bulk group left pending), and leaves by TMA store (whole
 * 64-row blocks) or by the threads (rows < nvalid only: no row of the next
 * expert is written). */
template <int BN>
__device__ __forceinline__ void ep_store_chunks_tma(const float *ac, uint8_t *wb,
                                                    const CUtensorMap *map_c,
                                                    const sm90_gemm_params &p, int wrow0,
                                                    int nvalid, int n0, int64_t bo, int lr, int q,
                                                    int t, int cw, uint32_t &it)
{
#pragma unroll
    for (int c = 0; c < BN / 64; c++) {
        const int col0 = n0 + 64 * c;
        if (col0 >= p.N) break;
        uint8_t *box = wb + (it & 1u) * 8192;
        if (t == 0) bulk_wait_read<1>(); /* chunk it - 2's store has read this buffer */
        named_barrier_sync(1 + cw, 128);
        ep_stage_chunk(ac, box, p, c, col0, bo, lr, q);
        fence_proxy_async(); /* generic writes -> the TMA engine's reads */
        named_barrier_sync(1 + cw, 128);
        if (nvalid == 64) {
            if (t == 0) {
                tma_store_2d(map_c, smem_addr(box), col0, wrow0);
                bulk_commit();
            }
        } else {
            /* 16 bytes per (row, 8-column group): 64 x 8 pieces, 4 per thread */
#pragma unroll
            for (int i = t; i < 64 * 8; i += 128) {
                const int r = i >> 3, g = i & 7;
                if (r < nvalid)
                    *(uint4 *)(p.out0 + (int64_t)(wrow0 + r) * p.N + col0 + 8 * g) =
                        *(const uint4 *)(box + r * 128 + ((g ^ (r & 7)) << 4));
            }
        }
        it++;
    }
}

/* The epilogue of one tile, for consumer warpgroup cw from its
 * accumulators acc (the kernel's shape decides which: dh's direct or
 * TMA-store epilogue, down / dxt's TMA-store chunks or staged stores, up's
 * H and A through the staging or handed to the epilogue warps). ep_it
 * counts the warpgroup's TMA-store chunks, jt the CTA's tiles (EPIWG). */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_epilogue_tile(const float *acc, const sm90_tile &tl,
                                                   const sm90_gemm_params &p,
                                                   const CUtensorMap *map_a,
                                                   const CUtensorMap *map_c, uint8_t *ep_base,
                                                   uint64_t *stg, int tid, int cw,
                                                   uint32_t &ep_it, uint32_t &jt)
{
    typedef sm90_traits<BN, STAGES, MODE, FL> K;
    constexpr bool PP = K::PP, EPIWG = K::EPIWG, TMA_ST2 = K::TMA_ST2;
    constexpr int MH = K::MH, NACC = K::NACC;
    const int lane = tid & 31, warp = (tid >> 5) & 3;
    const int q = lane & 3;
        /* ---------------- epilogue ----------------
         * Through a per-warpgroup shared buffer, 64 columns at a time: the
         * accumulator layout scatters a warp's stores over 8 rows, so each
         * chunk is written to shared memory first and then stored as whole
         * 128-byte row segments (16 bytes per thread), clipped at the
         * expert's last row. */
        uint8_t *eb = ep_base + cw * SM90_EP_BYTES;
        /* EPIWG: the staging is free once the epilogue warps have read
         * the previous tile out of it */
        if constexpr (EPIWG) mbar_wait(smem_addr(stg + 1), (jt & 1) ^ 1);
        const int lr = warp * 16 + (lane >> 2); /* this thread's rows lr, lr + 8 in the 64 */
        const int n0 = tl.n_tile * BN;
        const int64_t bo = (int64_t)tl.e * p.N;
#pragma unroll
        for (int mh = 0; mh < MH; mh++) { /* each m64 block of the warpgroup */
        const float *ac = acc + mh * NACC;
        const int wrow0 = tl.row0 + (PP ? mh : cw) * 64; /* first row of the 64 */
        const int nvalid = min(64, tl.row_end - wrow0);
        if constexpr (MODE == SM90_MODE_DH && TMA_ST2) {
            ep_dh_tma_any<BN>(ac, ep_base + cw * 16384, ep_base + cw * 16384 + 8192, map_c,
                              map_a, p, wrow0, nvalid, n0, lr, q, tl.n_tile, tid & 127);
        } else if constexpr (MODE == SM90_MODE_DH) {
            ep_dh_direct_any<BN>(ac, p, wrow0, nvalid, n0, lr, q, tl.n_tile);
        } else {
        if constexpr (TMA_ST2) {
            ep_store_chunks_tma<BN>(ac, ep_base + cw * 16384, map_c, p, wrow0, nvalid, n0,
                                    bo, lr, q, tid & 127, cw, ep_it);
        } else {
#pragma unroll
        for (int c = 0; c < BN / 64; c++) {
            if constexpr (MODE != SM90_MODE_UP) {
                const int col0 = n0 + 64 * c;
                if (col0 >= p.N) break;
#pragma unroll
                for (int jj = 0; jj < 8; jj++) {
                    const int j = 8 * c + jj, col = col0 + 8 * jj + 2 * q;
                    float b0 = load_bias(p.bias, bo + col), b1 = load_bias(p.bias, bo + col + 1);
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        ep_put2(eb, lr + 8 * h, 8 * jj + 2 * q,
                                ac[4 * j + 2 * h] + b0, ac[4 * j + 2 * h + 1] + b1);
                }
                ep_flush<128, !PP>(
                    eb, p.out0 + (int64_t)wrow0 * p.N + col0, p.N, nvalid, tid & 127, cw);
            } else {
                /* The chunk's 64 H columns (bias added, rounded) go to shared
                 * memory in interleaved order; the flush stores them and computes
                 * A from the staged bf16 values in a compact loop. (Unrolling the
                 * activation over all 128 accumulators made the kernel 450 KB of
                 * code, and the epilogue's instruction fetches stalled every warp.)
                 * Concatenated W1: chunk c holds units u0 .. u0 + 31, gates in
                 * accumulator chunks 4c..4c+3 and their ups BN/16 chunks further. */
                int hc0;
                if constexpr (EPIWG) eb = ep_base + (cw * 4 + c) * SM90_EP_BYTES;
                if (p.gated && p.concat) {
                    const int u0 = n0 / 2 + 32 * c;
                    if (u0 >= p.n) break;
                    hc0 = 2 * u0;
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) {
                        const int jg = 4 * c + jj, ju = jg + BN / 16, u = u0 + 8 * jj + 2 * q;
                        float bg0 = load_bias(p.bias, bo + u), bg1 = load_bias(p.bias, bo + u + 1);
                        float bu0 = load_bias(p.bias, bo + p.n + u);
                        float bu1 = load_bias(p.bias, bo + p.n + u + 1);
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            ep_put4(eb, lr + 8 * h, 16 * jj + 4 * q, ac[4 * jg + 2 * h] + bg0,
                                    ac[4 * ju + 2 * h] + bu0, ac[4 * jg + 2 * h + 1] + bg1,
                                    ac[4 * ju + 2 * h + 1] + bu1);
                    }
                } else {
                    hc0 = n0 + 64 * c;
                    if (hc0 >= p.N) break;
#pragma unroll
                    for (int jj = 0; jj < 8; jj++) {
                        const int j = 8 * c + jj, col = hc0 + 8 * jj + 2 * q;
                        float b0 = load_bias(p.bias, bo + col);
                        float b1 = load_bias(p.bias, bo + col + 1);
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            ep_put2(eb, lr + 8 * h, 8 * jj + 2 * q, ac[4 * j + 2 * h] + b0,
                                    ac[4 * j + 2 * h + 1] + b1);
                    }
                }
                if constexpr (!EPIWG)
                    ep_flush_up_any(eb, p.out0, p.out1, p.N, p.n, p.act, wrow0, hc0, nvalid,
                                    tid & 127);
            }
        }
        } /* not TMA_ST2 */
        } /* not dh */
        } /* mh */
        if constexpr (EPIWG) {
            mbar_arrive(smem_addr(stg)); /* the staging holds this tile */
            jt++;
        }
}


/* The epilogue warps (SM90_FL_EPIWG: warps 2-3 of the producer
 * warpgroup, tid 64..127). */
template <int BN, int STAGES, int MODE, int FL>
__device__ __forceinline__ void sm90_epilogue_warps(const sm90_gemm_params &p,
                                                    const sm90_ctx &c, int tid)
{
    uint8_t *ep_base = c.ep_base;
    uint64_t *stg = c.stg;
    const int *tile_start = c.tile_start;
    const int nt = c.nt, total = c.total, gm = c.gm, cid = c.cid, ncl = c.ncl;
    /* ---------------- epilogue warps (EPIWG) ----------------
     * The CTA's tiles in the consumers' order: per tile, once the
     * staging is full, H and A of its 8 units (2 row blocks x 4
     * column chunks) leave as ep_flush_up_ct stores them (its 128
     * thread slots taken by the 64 threads twice); then the staging
     * is handed back. */
    const int t64 = tid - 64;
    uint32_t jt = 0;
    for (int t = cid; t < total; t += ncl, jt++) {
        sm90_tile tl = sm90_tile_decode(t, tile_start, p.E, nt, p.expert_offset,
                                            p.off_stride, gm);
        const int n0 = tl.n_tile * BN;
        mbar_wait(smem_addr(stg), jt & 1);
        for (int h = 0; h < 2; h++) {
            const int wrow0 = tl.row0 + 64 * h;
            const int nvalid = min(64, tl.row_end - wrow0);
            for (int c = 0; c < BN / 64; c++) {
                int hc0;
                if (p.gated && p.concat) {
                    const int u0 = n0 / 2 + 32 * c;
                    if (u0 >= p.n) break;
                    hc0 = 2 * u0;
                } else {
                    hc0 = n0 + 64 * c;
                    if (hc0 >= p.N) break;
                }
                for (int hv = 0; hv < 2; hv++)
                    ep_flush_up_any<false>(ep_base + (h * 4 + c) * SM90_EP_BYTES, p.out0,
                                           p.out1, p.N, p.n, p.act, wrow0, hc0, nvalid,
                                           t64 + 64 * hv);
            }
        }
        mbar_arrive(smem_addr(stg + 1));
    }
}

#endif /* SMOE_EPILOGUE_SM90_CUH */
