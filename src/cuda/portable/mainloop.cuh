/*
 * mainloop.cuh -- the portable grouped GEMM's main loop: a BM x BN tile's
 * fp32 accumulators over its BK-deep k-tiles, streamed through a
 * STAGES-deep cp.async ring in shared memory (16-byte copies, zero-filled
 * past ragged edges, optionally with a 256-byte L2 prefetch hint; one
 * barrier per k-tile) and consumed by mma.sync m16n8k16 (bf16 -> fp32)
 * from fragments read with ldmatrix (.trans for operands stored MN-major).
 *
 * An operand is K-major (memory rows run along K: X, dO, A, dH, W1 in up,
 * W2 in down) or MN-major (memory rows run along M or N: W2 in dh, W1 in
 * dxt, both operands of dw1/dw2); its memory row comes from its logical
 * index through a map (args.cuh). K-major rows are mapped once per tile;
 * MN-major rows (k indices) are mapped a k-tile ahead, with the map a
 * template constant. The copies of a k-tile are issued from per-thread
 * state computed once per tile (row pointers and a row mask, or a column
 * pointer), 32-bit k arithmetic and the L2 hint a template constant of the row: a
 * few instructions per 16-byte copy, since each one delays the issuing
 * warp's next MMAs (notes/portable_log.md, session 7: dw1's loop from
 * about 640 to about 410 instructions per k-tile).
 *
 * Shared-memory tiles are XOR-swizzled in 16-byte chunks so that cp.async
 * stores and ldmatrix reads hit distinct banks: chunk ^ (row & 7) for rows
 * of 8+ chunks, chunk ^ ((row >> 1) & 3) for 64-byte rows.
 */
#ifndef SMOE_PORTABLE_MAINLOOP_CUH
#define SMOE_PORTABLE_MAINLOOP_CUH

#include "cuda/portable/config.cuh"
#include "cuda/ptx.cuh"

/* Byte offset of 16-byte chunk `c` of tile row `r`, rows of CPR chunks. */
template <int CPR>
static __device__ __forceinline__ uint32_t gg_swz(int r, int c)
{
    static_assert(CPR == 4 || CPR % 8 == 0, "tile rows of 64 bytes or multiples of 128");
    int pc = (CPR >= 8) ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3));
    return (uint32_t)((r * CPR + pc) * 16);
}

/* ------------------------------------------------------------ tile loaders */

/* One 16-byte operand copy, the L2 hint L2 (0 or 256 bytes) a compile-time
 * constant (a run-time one cost a branch around every copy). */
template <int L2>
static __device__ __forceinline__ void gg_cp_async16_h(uint32_t dst, const void *src, bool pred)
{
    if (L2 == 256) smoe_cp_async16_l2_256(dst, src, pred);
    else smoe_cp_async16(dst, src, pred);
}

/* One operand's share of a stage: a tile of ROWS memory-row pieces of COLS
 * elements, loaded by NT threads, each owning IPT chunks in one chunk column.
 * K-major tiles have rows = M or N indices (fixed per CTA: row pointers are
 * computed once) and columns = K; MN-major tiles have rows = K indices
 * (consecutive memory rows, or mapped anew per k-tile: TOKN) and columns
 * = M or N. The state is what each k-tile's copies need beyond a few
 * 32-bit operations: the main loop issues them between MMAs, and every
 * instruction there delays the warp's next MMAs (ncu, session 7 of
 * notes/portable_log.md). */
template <int ROWS, int COLS, int NT, bool KMAJ, int MAP>
struct gg_loader {
    static constexpr int CPR = COLS / 8;
    static constexpr int RPP = NT / CPR; /* rows per pass */
    static constexpr int IPT = ROWS / RPP;
    static constexpr bool TOKN = !KMAJ && MAP != GG_MAP_IDENT; /* rows looked up a k-tile ahead */
    static_assert(NT % CPR == 0 && ROWS % RPP == 0, "loader shape");
    static_assert(IPT <= 32, "row mask");
    const bf16 *rp[KMAJ ? IPT : 1]; /* K-major: the owned chunk of each owned row at k = 0
                                       (the operand's start where the row is outside) */
    uint32_t vm;                    /* K-major: bit i set: owned row i inside */
    const bf16 *cb;                 /* MN-major: the owned chunk column in memory row 0
                                       (the operand's start where the column is outside) */
    int32_t tokn[TOKN ? IPT : 1];   /* TOKN: memory rows of the next k-tile (0 past its end) */
    int col;                        /* owned chunk column */
    int row0;                       /* first owned tile row */
    bool cval;                      /* MN-major: owned column inside the matrix */
};

/* Issues the 16-byte copies of k-tile kt (K range [k_begin, k_end)) into
 * the tile at shared address `dst`, with L2 hint L2. K-major: the owned
 * rows are fixed, K advances along them (a chunk past K: no row is read).
 * MN-major: the owned rows are k indices of this k-tile, memory rows
 * k itself (IDENT) or tokn, mapped here a k-tile ahead of their use so that
 * the token loads overlap the MMAs (gathered rows: after this k-tile's
 * copies, as predicated loads straight into tokn, so that no instruction
 * of the k-tile waits for them; notes/portable_log.md, session 15).
 * Copies that read nothing still name a valid address (the operand's
 * start or a row inside). k indices fit in int (gg_check_problem), row
 * byte offsets are 32x32 -> 64-bit products. */
template <int L2, int ROWS, int COLS, int NT, bool KMAJ, int MAP>
static __device__ __forceinline__ void gg_issue(const gg_args &p,
                                                  gg_loader<ROWS, COLS, NT, KMAJ, MAP> &l,
                                                  const gg_operand &op, const bf16 *base,
                                                  uint32_t dst, int kt, int k_begin, int k_end)
{
    typedef gg_loader<ROWS, COLS, NT, KMAJ, MAP> L;
    if (KMAJ) {
        const int k0 = k_begin + kt * COLS;
        if (k0 + l.col * 8 < k_end) {
#pragma unroll
            for (int i = 0; i < L::IPT; i++)
                gg_cp_async16_h<L2>(dst + gg_swz<L::CPR>(l.row0 + i * L::RPP, l.col), l.rp[i] + k0,
                                    (l.vm >> i) & 1u);
        } else {
#pragma unroll
            for (int i = 0; i < L::IPT; i++)
                gg_cp_async16_h<L2>(dst + gg_swz<L::CPR>(l.row0 + i * L::RPP, l.col), base, false);
        }
    } else {
        const int k0 = k_begin + kt * ROWS;
        const int rem = k_end - k0; /* tile rows r < rem are inside */
        const int ldb = (int)op.ld * 2; /* bytes per memory row */
#pragma unroll
        for (int i = 0; i < L::IPT; i++) {
            const int r = l.row0 + i * L::RPP;
            const bool v = l.cval && r < rem;
            const int row = L::TOKN ? l.tokn[i] : (v ? k0 + r : 0);
            const bf16 *src = (const bf16 *)((const char *)l.cb + (int64_t)row * ldb);
            gg_cp_async16_h<L2>(dst + gg_swz<L::CPR>(r, l.col), src, v);
            if (L::TOKN && MAP != GG_MAP_TOKEN)
                l.tokn[i] = ROWS + r < rem ? (int32_t)gg_map_c<MAP>(p, k0 + ROWS + r) : 0;
        }
        /* Gathered rows: the next k-tile's tokens after every copy has read
         * tokn, with predicated loads. A conditional C++ load (a branch
         * around it) let ptxas load a token into a spare register and copy
         * it into tokn at the end of the issue, a copy that waits for the
         * load before the warp's MMAs (dw2 3.2 -> 4.4 ms). */
        if (L::TOKN && MAP == GG_MAP_TOKEN) {
            const int32_t *tp = p.tok + k0 + ROWS + l.row0; /* read below rem only */
#pragma unroll
            for (int i = 0; i < L::IPT; i++) {
                const int r = l.row0 + i * L::RPP;
                l.tokn[i] = smoe_ld_global_s32_pred(tp + i * L::RPP, ROWS + r < rem);
            }
        }
    }
}

/* Fragments of k16-step ks for a warp's WTM x WTN tile: A as MI m16k16
 * tiles (ldmatrix x4), B as NI k16n8 tiles (x4 covers two). MN-major
 * operands are read transposed. */
template <int A_KM, int A_CPR>
static __device__ __forceinline__ void gg_load_a_frag(uint32_t sa, int ks, int lane, int row0,
                                                      uint32_t af[4])
{
    if (A_KM) {
        const int r = row0 + (lane & 15);
        const int c = ks * 2 + (lane >> 4);
        smoe_ldmatrix_x4(sa + gg_swz<A_CPR>(r, c), af);
    } else {
        const int r = ks * 16 + ((lane >> 4) << 3) + (lane & 7);
        const int c = row0 / 8 + ((lane >> 3) & 1);
        smoe_ldmatrix_x4_trans(sa + gg_swz<A_CPR>(r, c), af);
    }
}

template <int B_KM, int B_CPR, int NI>
static __device__ __forceinline__ void gg_load_b_frags(uint32_t sb, int ks, int lane, int wn0,
                                                       uint32_t bfr[NI][2])
{
#pragma unroll
    for (int nj = 0; nj < NI / 2; nj++) {
        uint32_t t[4];
        if (B_KM) {
            const int r = wn0 + nj * 16 + ((lane >> 4) << 3) + (lane & 7);
            const int c = ks * 2 + ((lane >> 3) & 1);
            smoe_ldmatrix_x4(sb + gg_swz<B_CPR>(r, c), t);
        } else {
            const int r = ks * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
            const int c = (wn0 + nj * 16) / 8 + (lane >> 4);
            smoe_ldmatrix_x4_trans(sb + gg_swz<B_CPR>(r, c), t);
        }
        bfr[2 * nj][0] = t[0];
        bfr[2 * nj][1] = t[1];
        bfr[2 * nj + 1][0] = t[2];
        bfr[2 * nj + 1][1] = t[3];
    }
}

template <int A_KM, int B_KM, int A_CPR, int B_CPR, int MI, int NI>
static __device__ __forceinline__ void gg_load_frags(uint32_t sa, uint32_t sb, int ks, int lane,
                                                     int wm0, int wn0, uint32_t af[MI][4],
                                                     uint32_t bfr[NI][2])
{
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
        gg_load_a_frag<A_KM, A_CPR>(sa, ks, lane, wm0 + mi * 16, af[mi]);
    gg_load_b_frags<B_KM, B_CPR, NI>(sb, ks, lane, wn0, bfr);
}

/* Shapes derived from the template parameters. */
template <GG_TPARAMS>
struct gg_kt {
    typedef gg_cfg<BM, BN, BK, WM, WN, STAGES, FA> C;
    static constexpr bool VARLEN_K = (EPI == GG_EPI_DW || EPI == GG_EPI_DWS);
    /* A tile: K-major [BM][BK], MN-major [BK][BM]; B likewise with BN. */
    static constexpr int A_ROWS = A_KM ? BM : BK, A_COLS = A_KM ? BK : BM;
    static constexpr int B_ROWS = B_KM ? BN : BK, B_COLS = B_KM ? BK : BN;
    static constexpr int A_CPR = A_COLS / 8, B_CPR = B_COLS / 8;
    typedef gg_loader<A_ROWS, A_COLS, C::NT, (bool)A_KM, A_MAP> LA;
    typedef gg_loader<B_ROWS, B_COLS, C::NT, (bool)B_KM, B_MAP> LB;
};

/* The loaders of tile tl: K-major operands' row pointers (M for A, N for B)
 * and row mask, MN-major operands' column pointer and, mapped ones, memory
 * rows of k-tile 0. tokp (persistent grids, A gathered by token): the
 * tile's tokens, prefetched into shared memory. */
template <GG_TPARAMS>
static __device__ __forceinline__ void gg_setup(const gg_args &p, const gg_tile &tl,
                                                typename gg_kt<GG_TARGS>::LA &la,
                                                typename gg_kt<GG_TARGS>::LB &lb,
                                                const bf16 *a_base, const bf16 *b_base, int tid,
                                                const int *tokp)
{
    typedef gg_kt<GG_TARGS> K;
    const int64_t n0 = (int64_t)tl.n_tile * BN;
    la.col = tid % K::A_CPR;
    la.row0 = tid / K::A_CPR;
    lb.col = tid % K::B_CPR;
    lb.row0 = tid / K::B_CPR;
    if (A_KM) {
        la.vm = 0;
#pragma unroll
        for (int i = 0; i < la.IPT; i++) {
            const int lr = la.row0 + i * la.RPP;
            const int64_t m = tl.m0 + lr;
            la.rp[i] = a_base;
            if (m < tl.m_lim) {
                la.rp[i] = a_base + (tokp ? (int64_t)tokp[lr] : gg_map(p, p.a.map, m)) * p.a.ld +
                           la.col * 8;
                la.vm |= 1u << i;
            }
        }
    } else {
        la.cval = tl.m0 + la.col * 8 < tl.m_lim;
        la.cb = la.cval ? a_base + tl.m0 + la.col * 8 : a_base;
    }
    if (B_KM) {
        lb.vm = 0;
#pragma unroll
        for (int i = 0; i < lb.IPT; i++) {
            const int64_t nn = n0 + lb.row0 + i * lb.RPP;
            lb.rp[i] = b_base;
            if (nn < p.N) {
                lb.rp[i] = b_base + gg_map(p, p.b.map, nn) * p.b.ld + lb.col * 8;
                lb.vm |= 1u << i;
            }
        }
    } else {
        lb.cval = n0 + lb.col * 8 < p.N;
        lb.cb = lb.cval ? b_base + n0 + lb.col * 8 : b_base;
    }
    if (K::LA::TOKN) {
#pragma unroll
        for (int i = 0; i < la.IPT; i++) {
            const int64_t k = tl.k_begin + la.row0 + i * la.RPP;
            la.tokn[i] = k < tl.k_end ? (int32_t)gg_map_c<A_MAP>(p, k) : 0;
        }
    }
    if (K::LB::TOKN) {
#pragma unroll
        for (int i = 0; i < lb.IPT; i++) {
            const int64_t k = tl.k_begin + lb.row0 + i * lb.RPP;
            lb.tokn[i] = k < tl.k_end ? (int32_t)gg_map_c<B_MAP>(p, k) : 0;
        }
    }
}

/* The first STAGES-1 k-tiles of tile tl into stages 0.., one commit group
 * each (empty past KT). tok_dst (persistent grids): the tokens of rows
 * [tok_m0, tok_lim) of the tile after, copied into shared memory with the
 * first group. */
template <GG_TPARAMS>
static __device__ __forceinline__ void gg_prologue(const gg_args &p, const gg_tile &tl,
                                                   typename gg_kt<GG_TARGS>::LA &la,
                                                   typename gg_kt<GG_TARGS>::LB &lb,
                                                   const bf16 *a_base, const bf16 *b_base,
                                                   uint32_t smem0, int KT, int tid,
                                                   uint32_t tok_dst, int64_t tok_m0,
                                                   int64_t tok_lim)
{
    typedef typename gg_kt<GG_TARGS>::C C;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) {
            gg_issue<L2>(p, la, p.a, a_base, smem0 + s * C::STAGE_BYTES, s, (int)tl.k_begin,
                     (int)tl.k_end);
            gg_issue<L2>(p, lb, p.b, b_base, smem0 + s * C::STAGE_BYTES + C::A_ELEMS * 2, s,
                     (int)tl.k_begin, (int)tl.k_end);
        }
        if (s == 0 && tok_dst) {
            for (int i = tid; i < BM; i += C::NT) {
                const bool v = tok_m0 + i < tok_lim;
                smoe_cp_async4(tok_dst + 4 * i, v ? p.tok + tok_m0 + i : p.tok, v);
            }
        }
        smoe_cp_async_commit();
    }
}

/* The main loop over tile tl's KT k-tiles (the prologue issued): acc
 * zeroed, then accumulated. STAGES-deep cp.async ring, one barrier per
 * k-tile. Fragments are double-buffered in registers: those of k16-step
 * ks+1 (of the next stage at the last step) are read while the MMAs of ks
 * run. The barrier before the last step's reads both lands the next stage
 * (wait_group) and frees the stage the copies of step 0 refill. On return
 * every copy has landed; warps may still read the last stage. */
template <GG_TPARAMS>
static __device__ __forceinline__ void gg_mainloop(
    const gg_args &p, const gg_tile &tl, typename gg_kt<GG_TARGS>::LA &la,
    typename gg_kt<GG_TARGS>::LB &lb, const bf16 *a_base, const bf16 *b_base, uint32_t smem0,
    int KT, int lane, int wm0, int wn0,
    float (&acc)[gg_kt<GG_TARGS>::C::MI][gg_kt<GG_TARGS>::C::NI][4])
{
    typedef gg_kt<GG_TARGS> K;
    typedef typename K::C C;
    constexpr int MI = C::MI, NI = C::NI, A_CPR = K::A_CPR, B_CPR = K::B_CPR;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
    constexpr int KS = BK / 16;
    static_assert(KS % 2 == 0 || KS == 1, "fragment double buffer parity");
    /* Fragments: B's double-buffered (those of k16-step ks+1, or of the
     * next stage at the last step, read before the MMAs of ks), A's as FA
     * says. The barrier at the start of the last step both lands the next
     * stage (wait_group) and frees the stage the copies of step 0 refill:
     * every read of a stage happens before the barrier of its last step. */
    uint32_t af[FA][MI][4], bfr[2][NI][2];
    smoe_cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (KT > 0)
        gg_load_frags<A_KM, B_KM, A_CPR, B_CPR, MI, NI>(smem0, smem0 + C::A_ELEMS * 2, 0, lane, wm0,
                                                        wn0, af[0], bfr[0]);
    for (int kt = 0; kt < KT; kt++) {
        const int s = kt % STAGES;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const int cur = ks & 1, nxt = (ks + 1) & 1;
            const int ca = ks & (FA - 1), na = (ks + 1) & (FA - 1);
            const bool last = ks == KS - 1;
            if (last) {
                smoe_cp_async_wait<STAGES - 2>();
                __syncthreads();
            }
            const bool more = !last || kt + 1 < KT;
            const uint32_t sa = smem0 + (last ? (kt + 1) % STAGES : s) * C::STAGE_BYTES;
            const int nks = last ? 0 : ks + 1;
            if (more) {
                if (FA == 2)
                    gg_load_frags<A_KM, B_KM, A_CPR, B_CPR, MI, NI>(
                        sa, sa + C::A_ELEMS * 2, nks, lane, wm0, wn0, af[na], bfr[nxt]);
                else
                    gg_load_b_frags<B_KM, B_CPR, NI>(sa + C::A_ELEMS * 2, nks, lane, wn0, bfr[nxt]);
            }
            if (ks == 0) {
                const int nk = kt + STAGES - 1;
                if (nk < KT) {
                    const uint32_t st = smem0 + (nk % STAGES) * C::STAGE_BYTES;
                    gg_issue<L2>(p, la, p.a, a_base, st, nk, (int)tl.k_begin, (int)tl.k_end);
                    gg_issue<L2>(p, lb, p.b, b_base, st + C::A_ELEMS * 2, nk, (int)tl.k_begin,
                             (int)tl.k_end);
                }
                smoe_cp_async_commit();
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
#pragma unroll
                for (int ni = 0; ni < NI; ni++)
                    smoe_mma_m16n8k16_bf16(acc[mi][ni], af[ca][mi], bfr[cur][ni][0],
                                           bfr[cur][ni][1]);
                if (FA == 1 && more)
                    gg_load_a_frag<A_KM, A_CPR>(sa, nks, lane, wm0 + mi * 16, af[0][mi]);
            }
        }
    }
    smoe_cp_async_wait<0>();
}

#endif /* SMOE_PORTABLE_MAINLOOP_CUH */
