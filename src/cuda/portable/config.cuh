/*
 * config.cuh -- a tile configuration of the portable grouped GEMM
 * (BM x BN output tile, BK-deep k-tiles, WM x WN warps, a STAGES-deep
 * cp.async ring, FA buffers of A fragments) and what follows from it: the
 * warp tile, the shared memory of the ring, of each epilogue and of a
 * persistent grid's tables. The tile table (grouped_gemm.cu) reads its
 * rows' shared-memory needs from here at compile time; the kernel's parts
 * read their shapes.
 */
#ifndef SMOE_PORTABLE_CONFIG_CUH
#define SMOE_PORTABLE_CONFIG_CUH

#include "cuda/portable/args.cuh"

/* Persistent grids: one CTA per SM slot walks the tiles t = blockIdx.x,
 * + gridDim.x, ... in the order of the one-CTA-per-tile grid; it keeps
 * off[] (and varlen-M's tile prefix sums) in shared memory, so E is at
 * most GG_PERS_EMAX (the plan picks a row with a one-CTA-per-tile grid
 * above that). */
#define GG_PERS_EMAX 256

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int FA>
struct gg_cfg {
    static constexpr int BM_ = BM, BN_ = BN;
    static constexpr int NT = WM * WN * 32;
    static constexpr int WTM = BM / WM, WTN = BN / WN;
    static constexpr int MI = WTM / 16, NI = WTN / 8;
    static constexpr int A_ELEMS = BM * BK, B_ELEMS = BN * BK;
    static constexpr int STAGE_BYTES = (A_ELEMS + B_ELEMS) * 2;
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    /* dh's epilogue: the H tile (gated width, padded rows), then the dS
     * partial sums of the WN warps. */
    static constexpr int DH_H_BYTES = BM * (4 * BN + 32);
    static constexpr int DH_SMEM = DH_H_BYTES + WN * BM * 4;
    /* up and down/dxt: the staged output tiles (H and A, or Y/dX~). */
    static constexpr int UP_SMEM = BM * (2 * BN + 16);
    /* DHX / DWS: fp32 staging of half the tile's rows, rows padded by 32
     * bytes (a quad's float2 writes of 8 rows hit distinct banks). */
    static constexpr int SROW = 4 * BN + 32;
    static constexpr int DWS_SMEM = (BM / 2) * SROW;
    static constexpr int ST_SMEM = BM * (2 * BN + 16);
    /* DHX: the H tile unpadded, the fp32 staging of half the rows after
     * it, then the tile's row scores. */
    static constexpr int DHX_H_BYTES = BM * 4 * BN;
    static constexpr int DHX_SMEM = DHX_H_BYTES + (BM / 2) * SROW + BM * 4;
    static constexpr int mx(int a, int b) { return a > b ? a : b; }
    /* One CTA per tile: the epilogue runs over the ring's stages. */
    static constexpr int smem_bytes(int epi)
    {
        return epi == GG_EPI_UP ? mx(SMEM, UP_SMEM) : epi == GG_EPI_STORE ? mx(SMEM, ST_SMEM)
             : epi == GG_EPI_DH ? mx(SMEM, DH_SMEM) : epi == GG_EPI_DWS ? mx(SMEM, DWS_SMEM)
             : epi == GG_EPI_DHX ? mx(SMEM, DHX_SMEM) : SMEM;
    }
    /* Persistent grids (UP, STORE, DWS): the epilogue's shared memory
     * after the first STAGES-1 stages (which the next tile's prologue
     * fills while the epilogue runs), then off[0..E], varlen-M's tile
     * prefix sums and two buffers of BM prefetched tokens. */
    static constexpr int PERS_EOFF = (STAGES - 1) * STAGE_BYTES;
    static constexpr int epi_bytes(int epi)
    {
        return epi == GG_EPI_UP ? UP_SMEM : epi == GG_EPI_STORE ? ST_SMEM
             : epi == GG_EPI_DWS ? DWS_SMEM : 0;
    }
    static constexpr int pers_tail(int epi)
    {
        return (mx(SMEM, PERS_EOFF + epi_bytes(epi)) + 15) / 16 * 16;
    }
    static constexpr int pers_smem(int epi)
    {
        return pers_tail(epi) + (2 * (GG_PERS_EMAX + 1) + 2 * BM) * 4;
    }
    /* Dynamic shared memory of a kernel with epilogue epi, persistent or not. */
    static constexpr int smem(int epi, int pers) { return pers ? pers_smem(epi) : smem_bytes(epi); }
    /* Fragment buffers of A: FA = 2 double-buffers them like B's (read a
     * k16-step ahead, before the MMAs), FA = 1 keeps one set, each m16
     * fragment re-read right after its last MMA (16 registers fewer). */
    static_assert(FA == 1 || FA == 2, "A fragment buffers");
    static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BK % 16 == 0, "warp tile shape");
};

/* The kernel's template parameters (tile configuration, operand layouts and
 * maps, epilogue, the L2 hint of the operand copies: 0 or 256 bytes),
 * shared by its parts. The hint is a compile-time constant of the row: as a
 * run-time value ptxas if-converts its branch into predicated copies in the
 * main loop (both hints issued, one predicated off, around every copy),
 * which cost dw1 14% (notes/portable_log.md, session 13). */
#define GG_TPARAMS                                                                             \
    int BM, int BN, int BK, int WM, int WN, int STAGES, int FA, int A_KM, int B_KM, int A_MAP, \
        int B_MAP, int EPI, int L2
#define GG_TARGS BM, BN, BK, WM, WN, STAGES, FA, A_KM, B_KM, A_MAP, B_MAP, EPI, L2

/* One output tile: expert e, M range [m0, m_lim) (rows of e for varlen-M,
 * M indices clipped at M for varlen-K), N-tile n_tile, K range
 * [k_begin, k_end) (the expert's rows for varlen-K). */
struct gg_tile {
    int e, n_tile;
    int64_t m0, m_lim, k_begin, k_end;
};

#endif /* SMOE_PORTABLE_CONFIG_CUH */
