/*
 * grouped_gemm.cu -- the six grouped GEMMs of the MoE layer, portable
 * version (sm_80 and later: A100, H100): fills smoe_gemm_ops_sm80 as
 * specified in gemm.h.
 *
 * What: with rows sorted by expert (rows of expert e are
 * [off[e], off[e+1]), off read on the device):
 *   up    H[r]  = X[tok[r]] W1[e]^T + b1[e],  A[r] = act(H[r])   M=rows N=h_cols K=d
 *   down  Y[r]  = A[r] W2[e]^T + b2[e]                           M=rows N=d      K=n
 *   dh    dA'[r]= dO[tok[r]] W2[e], then dS, A' = s*A, dH = s*dact   M=rows N=n K=d
 *   dw2   dW2[e]= sum_r dO[tok[r]]^T A'[r]                       M=d    N=n      K=rows(e)
 *   dxt   dX~[r]= dH[r] W1[e]                                    M=rows N=d      K=h_cols
 *   dw1   dW1[e]= sum_r dH[r]^T X[tok[r]]                        M=h_cols N=d    K=rows(e)
 * The first four kinds ("varlen-M") have a per-expert M; dw1/dw2
 * ("varlen-K") have a per-expert reduction length.
 *
 * Algorithm: one kernel template, gg_kernel, in two parts.
 *  - Main loop: a BM x BN output tile, BK-deep k-tiles streamed through a
 *    STAGES-deep cp.async ring in shared memory (16-byte copies, zero-filled
 *    past ragged edges, optionally with a 128/256-byte L2 prefetch hint;
 *    one barrier per k-tile), fragments read with ldmatrix (.trans for
 *    operands stored MN-major) for the mma.sync m16n8k16 bf16 -> fp32 that
 *    consume them: B's one k16-step ahead (double-buffered), A's either
 *    the same way (FA = 2) or each m16 fragment re-read right after its
 *    last MMA (FA = 1, 16 registers fewer, used with BK = 64). An operand
 *    is K-major (memory rows run along K: X, dO, A,
 *    dH, W1 in up, W2 in down) or MN-major (memory rows run along M or N:
 *    W2 in dh, W1 in dxt, both operands of dw1/dw2); its memory row comes
 *    from its logical index through a map: identity, the row's token (the
 *    gather of X or dO, along M for varlen-M and along K for varlen-K), or
 *    smoe_w1_row (W1's physical layout). K-major rows are mapped once per
 *    tile; MN-major rows (k indices) are mapped a k-tile ahead, with the
 *    map a template constant. The copies of a k-tile are issued from
 *    per-thread state computed once per tile (row pointers and a row mask,
 *    or a column pointer), 32-bit k arithmetic and the L2 hint chosen once
 *    per call: a few instructions per 16-byte copy, since each one delays
 *    the issuing warp's next MMAs.
 *  - Epilogue, chosen per use, through shared memory (the pipeline's
 *    stages, free after the main loop) so that rows leave with coalesced
 *    16-byte stores clipped at the expert's last row and at N:
 *    UP (bias, H tile staged; A computed from each 16-byte chunk of bf16 H
 *    on the way out: gate and up of a pair are adjacent columns), STORE
 *    (bias, bf16: down, dxt), DH (the H tile, 2*BN columns for BN columns
 *    of dA', loaded into shared memory; per element A and dact recomputed
 *    with the activation a template constant, dS partial sums per row and
 *    N-tile to scratch, A' stored, dH written over H in shared memory and
 *    then stored), DW (fp32 or bf16, overwrite or accumulate in fp32, zeros
 *    for empty experts on overwrite). gg_ds_reduce then sums the dS
 *    partials in N-tile order and adds <dO_t, b2[e]>. DH and DW run each
 *    thread over its own fragments in unrolled code (DH: 560 KB of code
 *    for its seven activations); their staged forms DHR and DWS (the
 *    defaults where shared memory allows) first write the fp32 tile, half
 *    the rows at a time, into shared memory and then run a rolled loop:
 *    DHR one warp per row (4 dA' columns a lane per 128; dS of the row is
 *    a warp sum, written straight to the partials), DWS 8 columns a thread
 *    with 16-byte stores (and loads, to accumulate). DHX (dh's default) is
 *    DHR with H loaded unpadded in two halves (the second lands while the
 *    first is processed), the rows' scores in shared memory, two rows per
 *    warp at a time, and dH stored straight from registers; optionally the
 *    H tile is prefetched into L2 near the end of the main loop.
 *  Tiles and variants (per GEMM, see the configurations and the variant
 *  hook above the launchers): warp tiles of 64x64; 256x128x64 with 8
 *  warps and 3 or 4 stages (144 or 192 KiB) by default, 256x128x32 /
 *  128x256x32 with 3 stages and 128x128x32 with 4 warps (two CTAs per SM)
 *  as alternatives and fallbacks for devices with less shared memory.
 *  Shared-memory tiles are XOR-swizzled in 16-byte chunks so that cp.async
 *  stores and ldmatrix reads hit distinct banks: chunk ^ (row & 7) for
 *  rows of 8+ chunks, chunk ^ ((row >> 1) & 3) for 64-byte rows; epilogue
 *  tiles are padded instead.
 *  Scheduling: varlen-M grids are sized for the worst case,
 *  tiles_n * (ceil(cap/BM) + E) CTAs; each CTA finds its expert and m-tile
 *  with a warp-wide prefix sum over ceil(count_e/BM) read from off[] (no
 *  host reads); CTAs past the last tile exit. n-tiles vary fastest so the
 *  CTAs resident together share the gathered A rows and one expert's weight.
 *  varlen-K grids are E * tiles_m * tiles_n CTAs, each running over its
 *  expert's rows. Persistent grids (the default of down, dw2, dxt): as many
 *  CTAs as fit at once walk the same tile order with a stride of the grid;
 *  off[] and the m-tile prefix sums sit in shared memory, and after a
 *  tile's main loop the next tile's first k-tiles (and the tokens of the
 *  tile after it) are issued before the epilogue, which then runs in the
 *  shared memory after those stages.
 *
 * Numerics: bf16 operands, fp32 accumulation (mma.sync), biases added in
 * fp32. up rounds H to bf16 and computes A from the rounded H, so that the
 * backward, which recomputes A from the stored H, sees the same A. dh uses
 * the fp32 dA' and A = act(bf16 H) for dS, A' and dH, rounding only the
 * stored values. Weight gradients accumulate in fp32 and, with
 * accumulate=1, are added to the existing values in fp32.
 *
 * Determinism: every output element is produced by one thread with a fixed
 * summation order; dS partial sums are combined in a fixed order (DH: quad
 * shuffles, warps in order; DHR: each lane's columns, then a butterfly;
 * then N-tiles in order by gg_ds_reduce). No atomics.
 *
 * Requirements: d % 8 == 0, n % 8 == 0 and 16-byte aligned pointers (every
 * row is a whole number of 16-byte chunks); anything else is rejected with
 * SMOE_ERROR_UNSUPPORTED. Ragged tiles (rows at expert ends, K and N tails)
 * are predicated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/gemm.h"

/* ------------------------------------------------------------ PTX wrappers */

static __device__ __forceinline__ uint32_t gg_smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global->shared copy; pred false writes 16 zero bytes. */
static __device__ __forceinline__ void gg_cp_async16(uint32_t dst, const void *src, bool pred)
{
    int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

/* The same with an L2 prefetch hint known at compile time (L2: 1 = 128
 * bytes, 2 = 256 bytes around the chunk come into L2). */
template <int L2>
static __device__ __forceinline__ void gg_cp_async16_h(uint32_t dst, const void *src, bool pred)
{
    int n = pred ? 16 : 0;
    if (L2 == 2)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(n));
    else if (L2 == 1)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(n));
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

static __device__ __forceinline__ void gg_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
static __device__ __forceinline__ void gg_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void gg_ldsm_x4(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void gg_ldsm_x4_t(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* D += A B, m16n8k16, bf16 inputs, fp32 accumulators. */
static __device__ __forceinline__ void gg_mma(float c[4], const uint32_t a[4], uint32_t b0,
                                              uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ------------------------------------------------------------ activations */

static __device__ __forceinline__ float gg_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

#define GG_GELU_C 0.7978845608028654f /* sqrt(2/pi) */
#define GG_GELU_A 0.044715f

/* The gate function f (gated activations) or the activation itself. */
static __device__ __forceinline__ float gg_act(int act, float x)
{
    switch (act) {
    case SMOE_ACT_SWIGLU:
    case SMOE_ACT_SILU: return x * gg_sigmoid(x);
    case SMOE_ACT_GEGLU:
    case SMOE_ACT_GELU: return 0.5f * x * (1.0f + tanhf(GG_GELU_C * (x + GG_GELU_A * x * x * x)));
    case SMOE_ACT_REGLU:
    case SMOE_ACT_RELU: return smoe_relu(x);
    case SMOE_ACT_RELU2: { float r = smoe_relu(x); return r * r; }
    default: return 0.0f;
    }
}

/* f(x) and f'(x) with the activation known at compile time (dh's epilogue
 * is unrolled over the thread's 64 elements: a run-time switch there would
 * inline every activation 64 times and overflow the instruction cache). */
template <int ACT>
static __device__ __forceinline__ void gg_act_fd(float x, float &f, float &df)
{
    if (ACT == SMOE_ACT_SWIGLU || ACT == SMOE_ACT_SILU) {
        const float s = gg_sigmoid(x);
        f = x * s;
        df = s * (1.0f + x * (1.0f - s));
    } else if (ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_GELU) {
        const float th = tanhf(GG_GELU_C * (x + GG_GELU_A * x * x * x));
        f = 0.5f * x * (1.0f + th);
        df = 0.5f * (1.0f + th) +
             0.5f * x * (1.0f - th * th) * GG_GELU_C * (1.0f + 3.0f * GG_GELU_A * x * x);
    } else if (ACT == SMOE_ACT_REGLU || ACT == SMOE_ACT_RELU) {
        f = smoe_relu(x);
        df = x <= 0.0f ? 0.0f : 1.0f;
    } else { /* RELU2 */
        const float r = smoe_relu(x);
        f = r * r;
        df = 2.0f * r;
    }
}

/* ------------------------------------------------------------ parameters */

enum { GG_MAP_IDENT = 0, GG_MAP_TOKEN = 1, GG_MAP_W1 = 2 };
/* GG_EPI_DHR and GG_EPI_DWS: the epilogues of dh and dw with the fp32
 * accumulators staged in shared memory (half a tile at a time) and then
 * processed in a rolled loop, whole rows by whole warps (DHR) or 16-byte
 * chunks by threads (DWS), instead of each thread handling its own
 * fragments in fully unrolled code (DH, DW). */
/* GG_EPI_DHX: DHR with the H tile unpadded and loaded in two halves, the
 * scores in shared memory, two rows per warp at a time and dH stored
 * straight from registers (gg_epi_dh_rowsx). */
enum {
    GG_EPI_UP = 0,
    GG_EPI_STORE = 1,
    GG_EPI_DH = 2,
    GG_EPI_DW = 3,
    GG_EPI_DHR = 4,
    GG_EPI_DWS = 5,
    GG_EPI_DHX = 6
};

typedef struct gg_operand {
    const bf16 *ptr;       /* expert 0's matrix (or the activation matrix) */
    int64_t expert_stride; /* elements from one expert's matrix to the next; 0: shared */
    int64_t ld;            /* elements per memory row */
    int map;               /* GG_MAP_*: logical strided index -> memory row */
} gg_operand;

typedef struct gg_args {
    int64_t M, N, K; /* varlen-M: M unused; varlen-K: K unused (expert rows) */
    int E;
    int tiles_m, tiles_n;
    int act, gated, w1_layout;
    int64_t n; /* for smoe_w1_row */
    const int32_t *off, *tok;
    const float *score;
    gg_operand a, b;
    /* epilogue */
    const bf16 *bias; /* (E, N) in the map below; NULL: none */
    int64_t bias_stride;
    int bias_map; /* GG_MAP_IDENT or GG_MAP_W1 */
    bf16 *out;    /* H (up), Y or dX~ (store), dH (dh) */
    int64_t ld_out;
    bf16 *out2; /* A (up), A' (dh) */
    int64_t ld_out2;
    const bf16 *hin; /* H (dh) */
    int64_t ld_h;
    float *dsp; /* (tiles_n, cap) dS partial sums (dh) */
    int64_t cap;
    void *wout; /* (E, M, N) weight gradient (dw) */
    int out_f32, accumulate, out_map;
    int l2pf; /* L2 prefetch hint of the operand copies (gg_cp_async16_h) */
    int hpf;  /* DHX: the H tile is prefetched into L2 this many K elements
                 before the main loop ends (0: not) */
    const int *abort; /* smoe_gemm_problem.abort */
} gg_args;

static __device__ __forceinline__ int64_t gg_map(const gg_args &p, int map, int64_t i)
{
    if (map == GG_MAP_TOKEN) return p.tok[i];
    if (map == GG_MAP_W1) return smoe_w1_row(i, p.n, p.gated, (smoe_w1_layout)p.w1_layout);
    return i;
}

/* The same with the map known at compile time (MN-major operands map
 * every k-tile's rows inside the main loop). */
template <int MAP>
static __device__ __forceinline__ int64_t gg_map_c(const gg_args &p, int64_t i)
{
    if (MAP == GG_MAP_TOKEN) return p.tok[i];
    if (MAP == GG_MAP_W1) return smoe_w1_row(i, p.n, p.gated, (smoe_w1_layout)p.w1_layout);
    return i;
}

/* Byte offset of 16-byte chunk `c` of tile row `r`, rows of CPR chunks. */
template <int CPR>
static __device__ __forceinline__ uint32_t gg_swz(int r, int c)
{
    static_assert(CPR == 4 || CPR % 8 == 0, "tile rows of 64 bytes or multiples of 128");
    int pc = (CPR >= 8) ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3));
    return (uint32_t)((r * CPR + pc) * 16);
}

/* ------------------------------------------------------------ tile loaders */

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
 * the token loads overlap the MMAs. Copies that read nothing still name a
 * valid address (the operand's start or a row inside). k indices fit in
 * int (gg_check_problem), row byte offsets are 32x32 -> 64-bit products. */
template <int L2, int ROWS, int COLS, int NT, bool KMAJ, int MAP>
static __device__ __forceinline__ void gg_issue_h(const gg_args &p,
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
            if (L::TOKN) {
                if (MAP == GG_MAP_TOKEN) {
                    const int32_t *tp = p.tok + k0 + ROWS + l.row0; /* read below rem only */
                    l.tokn[i] = ROWS + r < rem ? tp[i * L::RPP] : 0;
                } else {
                    l.tokn[i] = ROWS + r < rem ? (int32_t)gg_map_c<MAP>(p, k0 + ROWS + r) : 0;
                }
            }
        }
    }
}

/* gg_issue_h with the run-time hint p.l2pf (uniform: one branch per call,
 * not one per copy). */
template <int ROWS, int COLS, int NT, bool KMAJ, int MAP>
static __device__ __forceinline__ void gg_issue(const gg_args &p,
                                                gg_loader<ROWS, COLS, NT, KMAJ, MAP> &l,
                                                const gg_operand &op, const bf16 *base,
                                                uint32_t dst, int kt, int k_begin, int k_end)
{
    if (p.l2pf == 2) gg_issue_h<2>(p, l, op, base, dst, kt, k_begin, k_end);
    else if (p.l2pf == 1) gg_issue_h<1>(p, l, op, base, dst, kt, k_begin, k_end);
    else gg_issue_h<0>(p, l, op, base, dst, kt, k_begin, k_end);
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
        gg_ldsm_x4(sa + gg_swz<A_CPR>(r, c), af);
    } else {
        const int r = ks * 16 + ((lane >> 4) << 3) + (lane & 7);
        const int c = row0 / 8 + ((lane >> 3) & 1);
        gg_ldsm_x4_t(sa + gg_swz<A_CPR>(r, c), af);
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
            gg_ldsm_x4(sb + gg_swz<B_CPR>(r, c), t);
        } else {
            const int r = ks * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
            const int c = (wn0 + nj * 16) / 8 + (lane >> 4);
            gg_ldsm_x4_t(sb + gg_swz<B_CPR>(r, c), t);
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
    for (int mi = 0; mi < MI; mi++) gg_load_a_frag<A_KM, A_CPR>(sa, ks, lane, wm0 + mi * 16, af[mi]);
    gg_load_b_frags<B_KM, B_CPR, NI>(sb, ks, lane, wn0, bfr);
}

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
    constexpr bool GATED =
        ACT == SMOE_ACT_SWIGLU || ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_REGLU;
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
                    gg_act_fd<ACT>(__low2float(p0), f0, df0);
                    gg_act_fd<ACT>(__low2float(p1), f1, df1);
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
                    gg_act_fd<ACT>(__low2float(hv), a0, df0);
                    gg_act_fd<ACT>(__high2float(hv), a1, df1);
                    *(__nv_bfloat162 *)(hs + lr * pitch + cl * 2) =
                        __floats2bfloat162_rn(s * d0 * df0, s * d1 * df1);
                }
                dsr[mi][h] += d0 * a0 + d1 * a1;
                *(__nv_bfloat162 *)(p.out2 + r * p.ld_out2 + c) = __floats2bfloat162_rn(s * a0, s * a1);
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
        gg_act_fd<ACT>(__low2float(hp[k]), f, df);
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
        gg_act_fd<ACT>(__low2float(hp[k]), a[2 * k], df0);
        gg_act_fd<ACT>(__high2float(hp[k]), a[2 * k + 1], df1);
        hp[k] = __floats2bfloat162_rn(s * d[2 * k] * df0, s * d[2 * k + 1] * df1);
    }
}

/* dh's epilogue over staged rows [r0, r0 + nrows) of the tile (DHR): one
 * warp per row, BN/32 dA' columns per lane (4 or 8, in 4-column groups:
 * 16 bytes of fp32 dA', 16 bytes of gated H or 8 of plain H). dS of the
 * row: the lane's columns in order, then a butterfly over the warp; A' out
 * with 8-byte stores, dH over H in shared memory. n is a multiple of 8, so
 * a 4-column group is inside N or outside it as a whole. */
template <int ACT, int BN, int NW>
static __device__ void gg_epi_dh_rows(const gg_args &p, const float *stg, int srow,
                                      unsigned char *hs, int pitch, int r0, int nrows,
                                      int64_t m0, int64_t m_lim, int64_t n0, int64_t n_lim,
                                      int n_tile, int warp, int lane)
{
    constexpr bool GATED =
        ACT == SMOE_ACT_SWIGLU || ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_REGLU;
    constexpr int GROUPS = BN / 128; /* 4-column groups per lane */
#pragma unroll 1
    for (int lr = r0 + warp; lr < r0 + nrows; lr += NW) {
        const int64_t r = m0 + lr;
        if (r >= m_lim) break; /* rows ascend: the rest of this warp's are out too */
        const float s = p.score[r];
        const float *srw = (const float *)((const unsigned char *)stg + (lr - r0) * srow);
        float dsum = 0.0f;
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
                *(uint4 *)(hs + lr * pitch + cl * 4) = hv;
            } else {
                uint2 hv = *(const uint2 *)(hs + lr * pitch + cl * 2);
                gg_dh_group<ACT>(hv, s, d, a);
                *(uint2 *)(hs + lr * pitch + cl * 2) = hv;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) dsum += d[k] * a[k];
            __nv_bfloat162 ao[2] = {__floats2bfloat162_rn(s * a[0], s * a[1]),
                                    __floats2bfloat162_rn(s * a[2], s * a[3])};
            *(uint2 *)(p.out2 + r * p.ld_out2 + c) = *(const uint2 *)ao;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dsum += __shfl_xor_sync(0xffffffffu, dsum, o);
        if (lane == 0) p.dsp[(int64_t)n_tile * p.cap + r] = dsum;
    }
}

/* DHX's rows [r0, r0 + nrows) of the tile: as gg_epi_dh_rows, two rows per
 * warp at a time (rows lr and lr + NW: their loads and butterflies
 * interleave), the score from shared memory (ssc, the tile's rows), H read
 * from an unpadded tile (row pitch `pitch` bytes), dH stored to global
 * memory straight from registers (16 bytes a lane gated, 8 plain: a warp
 * writes one contiguous piece of the row). Same values and summation
 * order as gg_epi_dh_rows. */
template <int ACT, int BN, int NW>
static __device__ void gg_epi_dh_rowsx(const gg_args &p, const float *stg, int srow,
                                       const unsigned char *hs, int pitch, const float *ssc,
                                       int r0, int nrows, int64_t m0, int64_t m_lim, int64_t n0,
                                       int64_t n_lim, int n_tile, int warp, int lane)
{
    constexpr bool GATED =
        ACT == SMOE_ACT_SWIGLU || ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_REGLU;
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

/* ------------------------------------------------------------ the kernel */

/* Persistent grids (variants + 10000): one CTA per SM slot walks the tiles
 * t = blockIdx.x, + gridDim.x, ... in the order of the non-persistent grid;
 * it keeps off[] (and varlen-M's tile prefix sums) in shared memory, so
 * E is at most GG_PERS_EMAX (larger E runs the same configuration
 * non-persistently). */
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
    /* DHR / DWS: fp32 staging of half the tile's rows, rows padded by 32
     * bytes (a quad's float2 writes of 8 rows hit distinct banks); DHR
     * puts it after the H tile. */
    static constexpr int SROW = 4 * BN + 32;
    static constexpr int DHR_SMEM = DH_H_BYTES + (BM / 2) * SROW;
    static constexpr int DWS_SMEM = (BM / 2) * SROW;
    static constexpr int ST_SMEM = BM * (2 * BN + 16);
    /* DHX: the H tile unpadded, the fp32 staging of half the rows after
     * it, then the tile's row scores. */
    static constexpr int DHX_H_BYTES = BM * 4 * BN;
    static constexpr int DHX_SMEM = DHX_H_BYTES + (BM / 2) * SROW + BM * 4;
    static constexpr int mx(int a, int b) { return a > b ? a : b; }
    static constexpr int smem_bytes(int epi)
    {
        return epi == 0 ? mx(SMEM, UP_SMEM) : epi == 1 ? mx(SMEM, ST_SMEM)
                        : epi == 2 ? mx(SMEM, DH_SMEM) : epi == 4 ? mx(SMEM, DHR_SMEM)
                        : epi == 5 ? mx(SMEM, DWS_SMEM) : epi == 6 ? mx(SMEM, DHX_SMEM)
                        : SMEM;
    }
    /* Persistent grids (UP, STORE, DWS): the epilogue's shared memory
     * after the first STAGES-1 stages (which the next tile's prologue
     * fills while the epilogue runs), then off[0..E], varlen-M's tile
     * prefix sums and two buffers of BM prefetched tokens. */
    static constexpr int PERS_EOFF = (STAGES - 1) * STAGE_BYTES;
    static constexpr int epi_bytes(int epi)
    {
        return epi == 0 ? UP_SMEM : epi == 1 ? ST_SMEM : epi == 5 ? DWS_SMEM : 0;
    }
    static constexpr int pers_tail(int epi)
    {
        return (mx(SMEM, PERS_EOFF + epi_bytes(epi)) + 15) / 16 * 16;
    }
    static constexpr int pers_smem(int epi)
    {
        return pers_tail(epi) + (2 * (GG_PERS_EMAX + 1) + 2 * BM) * 4;
    }
    /* Fragment buffers of A: FA = 2 double-buffers them like B's (read a
     * k16-step ahead, before the MMAs), FA = 1 keeps one set, each m16
     * fragment re-read right after its last MMA (16 registers fewer). */
    static_assert(FA == 1 || FA == 2, "A fragment buffers");
    static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BK % 16 == 0, "warp tile shape");
};

/* The kernel's template parameters (tile configuration, operand layouts and
 * maps, epilogue), shared by its parts below. */
#define GG_TPARAMS                                                                             \
    int BM, int BN, int BK, int WM, int WN, int STAGES, int FA, int A_KM, int B_KM, int A_MAP, \
        int B_MAP, int EPI
#define GG_TARGS BM, BN, BK, WM, WN, STAGES, FA, A_KM, B_KM, A_MAP, B_MAP, EPI

/* One output tile: expert e, M range [m0, m_lim) (rows of e for varlen-M,
 * M indices clipped at M for varlen-K), N-tile n_tile, K range
 * [k_begin, k_end) (the expert's rows for varlen-K). */
struct gg_tile {
    int e, n_tile;
    int64_t m0, m_lim, k_begin, k_end;
};

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

/* 4-byte global->shared copy (cp.async.ca); pred false writes zeros. */
static __device__ __forceinline__ void gg_cp_async4(uint32_t dst, const void *src, bool pred)
{
    int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
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
            gg_issue(p, la, p.a, a_base, smem0 + s * C::STAGE_BYTES, s, (int)tl.k_begin,
                     (int)tl.k_end);
            gg_issue(p, lb, p.b, b_base, smem0 + s * C::STAGE_BYTES + C::A_ELEMS * 2, s,
                     (int)tl.k_begin, (int)tl.k_end);
        }
        if (s == 0 && tok_dst) {
            for (int i = tid; i < BM; i += C::NT) {
                const bool v = tok_m0 + i < tok_lim;
                gg_cp_async4(tok_dst + 4 * i, v ? p.tok + tok_m0 + i : p.tok, v);
            }
        }
        gg_cp_async_commit();
    }
}

/* DHX: the H columns tile tl's epilogue reads, 128-byte lines into L2
 * (prefetch.global.L2), issued some k-tiles before the main loop ends, so
 * that the epilogue's copies find them in L2 and the DRAM reads of H,
 * spread over the main loops still running, do not come in one burst when
 * every CTA of a wave reaches its epilogue together. */
template <int BM, int BN, int NT>
static __device__ __forceinline__ void gg_prefetch_h(const gg_args &p, const gg_tile &tl)
{
    const int lines = p.gated ? (4 * BN) / 128 : (2 * BN) / 128; /* per H row */
    const int64_t hc0 = p.gated ? 2 * (int64_t)tl.n_tile * BN : (int64_t)tl.n_tile * BN;
    for (int i = threadIdx.x; i < BM * lines; i += NT) {
        const int lr = i / lines, l = i % lines;
        const int64_t r = tl.m0 + lr, col = hc0 + l * 64;
        if (r < tl.m_lim && col < p.ld_h)
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.hin + r * p.ld_h + col));
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
    float (&acc)[gg_kt<GG_TARGS>::C::MI][gg_kt<GG_TARGS>::C::NI][4], int pf_kt = -1)
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
    gg_cp_async_wait<STAGES - 2>();
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
                gg_cp_async_wait<STAGES - 2>();
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
                if (EPI == GG_EPI_DHX && kt == pf_kt) gg_prefetch_h<BM, BN, C::NT>(p, tl);
                const int nk = kt + STAGES - 1;
                if (nk < KT) {
                    const uint32_t st = smem0 + (nk % STAGES) * C::STAGE_BYTES;
                    gg_issue(p, la, p.a, a_base, st, nk, (int)tl.k_begin, (int)tl.k_end);
                    gg_issue(p, lb, p.b, b_base, st + C::A_ELEMS * 2, nk, (int)tl.k_begin,
                             (int)tl.k_end);
                }
                gg_cp_async_commit();
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
#pragma unroll
                for (int ni = 0; ni < NI; ni++)
                    gg_mma(acc[mi][ni], af[ca][mi], bfr[cur][ni][0], bfr[cur][ni][1]);
                if (FA == 1 && more)
                    gg_load_a_frag<A_KM, A_CPR>(sa, nks, lane, wm0 + mi * 16, af[0][mi]);
            }
        }
    }
    gg_cp_async_wait<0>();
}

/* The epilogues, chosen by EPI (see the file's overview), for tile tl
 * from the thread's accumulators; es: the shared memory they may use (the
 * pipeline's stages, free after the main loop, or in a persistent grid the
 * space after the stages the next tile's prologue fills). */
template <GG_TPARAMS>
static __device__ __forceinline__ void gg_epilogue(
    const gg_args &p, const gg_tile &tl,
    const float (&acc)[gg_kt<GG_TARGS>::C::MI][gg_kt<GG_TARGS>::C::NI][4], unsigned char *es)
{
    typedef typename gg_kt<GG_TARGS>::C C;
    constexpr int NT = C::NT, MI = C::MI, NI = C::NI;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int wm0 = wm * C::WTM, wn0 = wn * C::WTN;
    const int e = tl.e, n_tile = tl.n_tile;
    const int64_t m0 = tl.m0, m_lim = tl.m_lim, n0 = (int64_t)n_tile * BN, n_lim = p.N;
    const uint32_t esa = gg_smem_addr(es);
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
        constexpr int CPR = BN / 8;
#pragma unroll 1
        for (int i = tid; i < BM * CPR; i += NT) {
            const int lr = i / CPR, ch = i % CPR;
            const int64_t r = m0 + lr, c = n0 + ch * 8;
            if (r >= m_lim || c >= n_lim) continue;
            const uint4 v = *(const uint4 *)(ts + lr * OP + ch * 16);
            if (EPI == GG_EPI_STORE || p.out) *(uint4 *)(p.out + r * p.ld_out + c) = v;
            if (EPI == GG_EPI_UP) {
                const __nv_bfloat162 *hp = (const __nv_bfloat162 *)&v;
                if (p.gated) {
                    __nv_bfloat162 o[2];
#pragma unroll
                    for (int q = 0; q < 2; q++)
                        o[q] = __floats2bfloat162_rn(
                            gg_act(p.act, __low2float(hp[2 * q])) * __high2float(hp[2 * q]),
                            gg_act(p.act, __low2float(hp[2 * q + 1])) * __high2float(hp[2 * q + 1]));
                    *(uint2 *)(p.out2 + r * p.ld_out2 + (c >> 1)) = *(const uint2 *)o;
                } else {
                    __nv_bfloat162 o[4];
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        o[q] = __floats2bfloat162_rn(gg_act(p.act, __low2float(hp[q])),
                                                     gg_act(p.act, __high2float(hp[q])));
                    *(uint4 *)(p.out2 + r * p.ld_out2 + c) = *(const uint4 *)o;
                }
            }
        }
    } else if (EPI == GG_EPI_DH || EPI == GG_EPI_DHR) {
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
            gg_cp_async16(esa + lr * pitch + ch * 16, v ? p.hin + r * p.ld_h + col : p.hin, v);
        }
        gg_cp_async_commit();
        gg_cp_async_wait<0>();
        unsigned char *hs = es; /* H in, dH out */
        if (EPI == GG_EPI_DHR) {
            /* Half the rows at a time: the warps owning them stage their
             * fp32 dA' after the H tile, then every warp takes whole rows
             * (gg_epi_dh_rows): dS of a row is one warp's sum, no partials
             * to combine across warps. */
            float *stg = (float *)(es + C::DH_H_BYTES);
            constexpr int PR = BM / 2;
#pragma unroll 1
            for (int pass = 0; pass < 2; pass++) {
                if (wm0 / PR == pass) gg_stage_acc<MI, NI>(acc, stg, C::SROW, wm0 - pass * PR, wn0, g, t4);
                __syncthreads(); /* staging written, H landed for every thread */
#define GG_DH_ROWS(A)                                                                          \
    gg_epi_dh_rows<A, BN, NT / 32>(p, stg, C::SROW, hs, pitch, pass * PR, PR, m0, m_lim, n0,   \
                                   n_lim, n_tile, warp, lane)
                SMOE_ACT_SWITCH(p.act, GG_DH_ROWS);
#undef GG_DH_ROWS
                __syncthreads(); /* staging consumed; dH written */
            }
        } else {
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
        }
        /* dH rows out, coalesced (the barrier above ordered the writes). */
        for (int i = tid; i < BM * hcpr; i += NT) {
            const int lr = i / hcpr, ch = i % hcpr;
            const int64_t r = m0 + lr, col = hc0 + ch * 8;
            if (r < m_lim && col < p.ld_out)
                *(uint4 *)(p.out + r * p.ld_out + col) = *(const uint4 *)(hs + lr * pitch + ch * 16);
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
                gg_cp_async16(esa + lr * pitch + ch * 16, v ? p.hin + r * p.ld_h + col : p.hin, v);
            }
            gg_cp_async_commit();
        }
        for (int lr = tid; lr < BM; lr += NT) ssc[lr] = m0 + lr < m_lim ? p.score[m0 + lr] : 0.0f;
#pragma unroll 1
        for (int pass = 0; pass < 2; pass++) {
            if (wm0 / PR == pass) gg_stage_acc<MI, NI>(acc, stg, C::SROW, wm0 - pass * PR, wn0, g, t4);
            if (pass == 0) gg_cp_async_wait<1>();
            else gg_cp_async_wait<0>();
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
            if (wm0 / PR == pass) gg_stage_acc<MI, NI>(acc, stg, C::SROW, wm0 - pass * PR, wn0, g, t4);
            __syncthreads();
#pragma unroll 1
            for (int i = tid; i < PR * CPR; i += NT) {
                const int lr = i / CPR, ch = i % CPR;
                const int64_t m = m0 + pass * PR + lr, c = n0 + ch * 8;
                if (m >= m_lim || c >= n_lim) continue;
                const float *sp = (const float *)((const unsigned char *)stg + lr * C::SROW) + ch * 8;
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
                    for (int k = 0; k < 4; k++) ov[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
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

/* Tile t of a persistent grid (see gg_pers_next) from the tables in shared
 * memory: s_off = off[0..E], s_ts = varlen-M's first tile of each expert
 * (s_ts[E] = the m-tiles in all). */
template <int BM, bool VARLEN_K>
static __device__ __forceinline__ gg_tile gg_pers_tile(const gg_args &p, const int *s_off,
                                                       const int *s_ts, int t)
{
    gg_tile tl;
    if (!VARLEN_K) {
        const int mt = t / p.tiles_n;
        tl.n_tile = t % p.tiles_n;
        int lo = 0, hi = p.E; /* the last e with s_ts[e] <= mt (s_ts[0] = 0) */
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (s_ts[mid] <= mt) lo = mid;
            else hi = mid;
        }
        tl.e = lo;
        tl.m0 = s_off[lo] + (int64_t)(mt - s_ts[lo]) * BM;
        tl.m_lim = s_off[lo + 1];
        tl.k_begin = 0;
        tl.k_end = p.K;
    } else {
        const int per_e = p.tiles_m * p.tiles_n;
        tl.e = t / per_e;
        const int rem = t % per_e;
        tl.n_tile = rem % p.tiles_n;
        tl.m0 = (int64_t)(rem / p.tiles_n) * BM;
        tl.m_lim = p.M;
        tl.k_begin = s_off[tl.e];
        tl.k_end = s_off[tl.e + 1];
    }
    return tl;
}

/* The first tile index >= t, in steps of gridDim.x, with work (varlen-K
 * skips the empty experts' tiles when accumulating: untouched), or -1. */
template <bool VARLEN_K>
static __device__ __forceinline__ int gg_pers_next(const gg_args &p, const int *s_off,
                                                   const int *s_ts, int t)
{
    if (!VARLEN_K) return t < s_ts[p.E] * p.tiles_n ? t : -1;
    const int per_e = p.tiles_m * p.tiles_n, total = p.E * per_e;
    for (; t < total; t += gridDim.x) {
        const int e = t / per_e;
        if (!p.accumulate || s_off[e + 1] > s_off[e]) return t;
    }
    return -1;
}

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
    const uint32_t smem0 = gg_smem_addr(gg_smem);
    typename K::LA la;
    typename K::LB lb;
    float acc[MI][NI][4];

    if constexpr (!PERS) {
        __shared__ int64_t s_info[3];
        /* --- which tile: expert e, M range [m0, m_lim), N offset n0, K range */
        gg_tile tl;
        if (!VARLEN_K) {
            const int64_t mt = blockIdx.x / p.tiles_n;
            tl.n_tile = (int)(blockIdx.x % p.tiles_n);
            if (warp == 0) {
                /* Tiles of expert e: ceil(count_e / BM); prefix sum 32 experts
                 * at a time. */
                int64_t running = 0, found_e = -1, found_t = 0;
                for (int base = 0; base < p.E && found_e < 0; base += 32) {
                    int ex = base + lane;
                    int tiles = 0;
                    if (ex < p.E) tiles = (p.off[ex + 1] - p.off[ex] + BM - 1) / BM;
                    int incl = tiles;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        int v = __shfl_up_sync(0xffffffffu, incl, o);
                        if (lane >= o) incl += v;
                    }
                    unsigned hit = __ballot_sync(0xffffffffu, ex < p.E && running + incl > mt);
                    if (hit) {
                        int l = __ffs(hit) - 1;
                        int excl = __shfl_sync(0xffffffffu, incl - tiles, l);
                        found_e = base + l;
                        found_t = mt - running - excl;
                    }
                    running += __shfl_sync(0xffffffffu, incl, 31);
                }
                if (lane == 0) {
                    s_info[0] = found_e;
                    s_info[1] = found_e >= 0 ? p.off[found_e] + found_t * BM : 0;
                    s_info[2] = found_e >= 0 ? p.off[found_e + 1] : 0;
                }
            }
            __syncthreads();
            tl.e = (int)s_info[0];
            if (tl.e < 0) return;
            tl.m0 = s_info[1];
            tl.m_lim = s_info[2];
            tl.k_begin = 0;
            tl.k_end = p.K;
        } else {
            const int per_e = p.tiles_m * p.tiles_n;
            tl.e = blockIdx.x / per_e;
            const int rem = blockIdx.x % per_e;
            tl.n_tile = rem % p.tiles_n;
            tl.m0 = (int64_t)(rem / p.tiles_n) * BM;
            tl.m_lim = p.M;
            tl.k_begin = p.off[tl.e];
            tl.k_end = p.off[tl.e + 1];
            if (tl.k_end == tl.k_begin && p.accumulate) return; /* untouched */
        }
        const int KT = (int)((tl.k_end - tl.k_begin + BK - 1) / BK);
        const bf16 *a_base = p.a.ptr + (int64_t)tl.e * p.a.expert_stride;
        const bf16 *b_base = p.b.ptr + (int64_t)tl.e * p.b.expert_stride;
        gg_setup<GG_TARGS>(p, tl, la, lb, a_base, b_base, tid, nullptr);
        gg_prologue<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, tid, 0, 0, 0);
        /* DHX: the k-tile at which the H tile's L2 prefetch is issued. */
        const int pf_kt = EPI == GG_EPI_DHX && p.hpf > 0 ? max(KT - (p.hpf + BK - 1) / BK, 0) : -1;
        gg_mainloop<GG_TARGS>(p, tl, la, lb, a_base, b_base, smem0, KT, lane, wm0, wn0, acc, pf_kt);
        gg_epilogue<GG_TARGS>(p, tl, acc, gg_smem);
    } else {
        /* Tables: off[0..E], varlen-M's first tile of each expert; then
         * two buffers of prefetched tokens (tile j's tokens come with tile
         * j-1's prologue into buffer j & 1). */
        int *s_off = (int *)(gg_smem + C::pers_tail(EPI));
        int *s_ts = s_off + (GG_PERS_EMAX + 1);
        int *tok_s = s_ts + (GG_PERS_EMAX + 1);
        unsigned char *es = gg_smem + C::PERS_EOFF;
        for (int i = tid; i <= p.E; i += NT) s_off[i] = p.off[i];
        __syncthreads();
        if (!VARLEN_K && warp == 0) {
            int running = 0;
            for (int base = 0; base < p.E; base += 32) {
                const int ex = base + lane;
                const int tiles = ex < p.E ? (s_off[ex + 1] - s_off[ex] + BM - 1) / BM : 0;
                int incl = tiles;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                if (ex < p.E) s_ts[ex] = running + incl - tiles;
                running += __shfl_sync(0xffffffffu, incl, 31);
            }
            if (lane == 0) s_ts[p.E] = running;
        }
        __syncthreads();
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
                                  tokpf && tn >= 0 ? gg_smem_addr(tok_s + BM) : 0, nx.m0,
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
                                      tokpf && tnn >= 0 ? gg_smem_addr(tok_s + (it & 1) * BM) : 0,
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

/* ds[r] = sum over N-tiles of the partial sums, in tile order, plus
 * <dO[tok[r]], b2[e]> when b2 is given. One warp per row. */
__global__ void gg_ds_reduce(const float *dsp, int tiles, int64_t cap, const int32_t *off, int E,
                             const int32_t *tok, const bf16 *dout, const bf16 *b2, int64_t d,
                             float *ds, const int *abort)
{
    if (abort && *abort) return;
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (r >= off[E]) return;
    float dot = 0.0f;
    if (b2) {
        int lo = 0, hi = E; /* expert: the last e with off[e] <= r */
        while (hi - lo > 1) {
            int mid = (lo + hi) / 2;
            if (off[mid] <= r) lo = mid; else hi = mid;
        }
        const bf16 *x = dout + (int64_t)tok[r] * d;
        const bf16 *b = b2 + (int64_t)lo * d;
        for (int64_t j = (int64_t)lane * 8; j < d; j += 256) {
            const uint4 xv = *(const uint4 *)(x + j), bv = *(const uint4 *)(b + j);
            const __nv_bfloat162 *xp = (const __nv_bfloat162 *)&xv;
            const __nv_bfloat162 *bp = (const __nv_bfloat162 *)&bv;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                dot += __low2float(xp[q]) * __low2float(bp[q]);
                dot += __high2float(xp[q]) * __high2float(bp[q]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
    if (lane == 0) {
        float v = 0.0f;
        for (int t = 0; t < tiles; t++) v += dsp[(int64_t)t * cap + r];
        ds[r] = v + dot;
    }
}

/* ------------------------------------------------------------ launchers */

/* Tile configurations: (BM, BN, BK, warps along M, warps along N, stages,
 * A fragment buffers FA). Warp tiles of 64x64: 128 fp32 accumulators,
 * 240-255 registers a thread, so one CTA of 8 warps or two of 4 per SM.
 * Shared memory of the stages in the comment; dh adds its H tile (136-141
 * KiB at 256x128 or 128x256), the staged epilogues their fp32 staging.
 * Measured on an H100 (notes/portable_log.md): 256x128x64 with 8 warps is
 * the fastest main loop at the large shapes, 1 and 3 were the earlier
 * defaults; 64x32 warp tiles (16 warps per SM), 128x128x64, 128x256x64
 * and 5-stage rings were measured slower and removed. The numbers match
 * the log. */
#define GG_CFG_1 128, 128, 32, 2, 2, 4, 2  /*  4 warps,  64 KiB: two CTAs per SM */
#define GG_CFG_2 256, 128, 32, 4, 2, 3, 2  /*  8 warps,  72 KiB */
#define GG_CFG_3 128, 256, 32, 2, 4, 3, 2  /*  8 warps,  72 KiB */
#define GG_CFG_4 256, 128, 64, 4, 2, 3, 1  /*  8 warps, 144 KiB */
#define GG_CFG_12 256, 128, 64, 4, 2, 4, 1 /*  8 warps, 192 KiB (sm_90: 227 KiB a block) */
/* The smallest BN of the list (dh's dS partial sums: one per row and N-tile). */
#define GG_MIN_BN 128

/* GEMM indices (gemm.h order), the default variant of each (see
 * gg_dispatch for the numbering) and the fallback run where the default
 * needs more shared memory than the device lets a block have (A100: 163
 * KiB; the defaults need up to 216 KiB, sm_90's 227 KiB); configuration 1
 * (at most 71 KiB) where the fallback does not fit either. Measured on an
 * H100 (notes/portable_log.md): dh's DHX and down's persistent grid
 * (session 6); with the leaner copy issue of session 7, the persistent
 * grids of dw2 (configuration 2) and dxt, and dw1 on 3 stages; the
 * persistent grids of up and dw1 measured even or slower and stay
 * variants. */
enum { GG_UP = 0, GG_DOWN, GG_DH, GG_DW2, GG_DXT, GG_DW1, GG_NGEMM };
static const char *const gg_gemm_names[GG_NGEMM] = {"up", "down", "dh", "dw2", "dxt", "dw1"};
static const int gg_default_variant[GG_NGEMM] = {2004, 12012, 2404, 12202, 12004, 2204};
static const int gg_fallback_variant[GG_NGEMM] = {2004, 2004, 2, 2202, 2004, 2202};

/* Variant hook for tests and tuning: 0 = the default. Set directly (tests)
 * or from the environment variable SMOE_SM80_GEMM_VARIANT, read at the
 * first launch: either one number for all six GEMMs or a list such as
 * "dh=202,dw1=2004" (smoe_sm80_gemm_variant_parse). */
extern "C" int smoe_sm80_gemm_variant[GG_NGEMM];
int smoe_sm80_gemm_variant[GG_NGEMM] = {0, 0, 0, 0, 0, 0};
static int gg_env_read = 0;

extern "C" int smoe_sm80_gemm_variant_parse(const char *spec);
int smoe_sm80_gemm_variant_parse(const char *spec)
{
    gg_env_read = 1;
    if (!spec || !*spec) return 0;
    if (!strchr(spec, '=')) {
        const int v = atoi(spec);
        for (int g = 0; g < GG_NGEMM; g++) smoe_sm80_gemm_variant[g] = v;
        return 0;
    }
    const char *q = spec;
    while (*q) {
        int g, found = -1;
        for (g = 0; g < GG_NGEMM; g++) {
            const size_t len = strlen(gg_gemm_names[g]);
            if (!strncmp(q, gg_gemm_names[g], len) && q[len] == '=') {
                found = g;
                q += len + 1;
                break;
            }
        }
        if (found < 0) return -1;
        smoe_sm80_gemm_variant[found] = (int)strtol(q, (char **)&q, 10);
        if (*q == ',') q++;
        else if (*q) return -1;
    }
    return 0;
}

static int gg_variant(int gemm)
{
    if (!gg_env_read) {
        const char *env = getenv("SMOE_SM80_GEMM_VARIANT");
        if (env) smoe_sm80_gemm_variant_parse(env);
        gg_env_read = 1;
    }
    const int v = smoe_sm80_gemm_variant[gemm];
    return v ? v : gg_default_variant[gemm];
}

static int64_t gg_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static smoe_status gg_check_problem(const smoe_gemm_problem *p, const char *what)
{
    SMOE_RETURN_ERROR_IF(p->off_stride > 1, SMOE_ERROR_UNSUPPORTED,
                         "%s: the mma.sync GEMMs take no view of the rows (off_stride %d)", what,
                         p->off_stride);
    SMOE_RETURN_ERROR_IF(p->d <= 0 || p->n <= 0 || p->E <= 0 || p->cap < 0, SMOE_ERROR_INVALID_SIZE,
                         "%s: bad sizes d=%lld n=%lld E=%lld cap=%lld", what, (long long)p->d,
                         (long long)p->n, (long long)p->E, (long long)p->cap);
    SMOE_RETURN_ERROR_IF(p->d % 8 != 0 || p->n % 8 != 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: the mma.sync GEMMs need d and n multiples of 8 (d=%lld, n=%lld)", what,
                         (long long)p->d, (long long)p->n);
    SMOE_RETURN_ERROR_IF(p->h_cols != (p->gated ? 2 * p->n : p->n), SMOE_ERROR_INTERNAL,
                         "%s: h_cols=%lld inconsistent with n=%lld", what, (long long)p->h_cols,
                         (long long)p->n);
    SMOE_RETURN_ERROR_IF(p->E > (int64_t)INT32_MAX / 2 || p->cap > (int64_t)INT32_MAX - 4096,
                         SMOE_ERROR_UNSUPPORTED, "%s: E=%lld or cap=%lld too large", what,
                         (long long)p->E, (long long)p->cap);
    /* The loaders index k and form row byte offsets in int (gg_issue_h). */
    SMOE_RETURN_ERROR_IF(p->d > ((int64_t)1 << 28) || p->h_cols > ((int64_t)1 << 28),
                         SMOE_ERROR_UNSUPPORTED, "%s: d=%lld or n=%lld too large", what,
                         (long long)p->d, (long long)p->n);
    return SMOE_SUCCESS;
}

static smoe_status gg_check_ptr(const void *ptr, const char *what, const char *name)
{
    SMOE_RETURN_ERROR_IF(((uintptr_t)ptr & 15) != 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: %s=%p is not 16-byte aligned", what, name, ptr);
    return SMOE_SUCCESS;
}

static gg_args gg_args_make(const smoe_gemm_problem *p)
{
    gg_args a;
    memset(&a, 0, sizeof a);
    a.E = (int)p->E;
    a.act = (int)p->act;
    a.gated = p->gated;
    a.w1_layout = (int)p->w1_layout;
    a.n = p->n;
    a.off = p->expert_offset;
    a.tok = p->row_token;
    a.score = p->row_score;
    a.cap = p->cap;
    a.abort = p->abort;
    return a;
}

static gg_operand gg_op(const bf16 *ptr, int64_t expert_stride, int64_t ld, int map)
{
    gg_operand o;
    o.ptr = ptr;
    o.expert_stride = expert_stride;
    o.ld = ld;
    o.map = map;
    return o;
}

/* Maps W1's logical rows only when the physical layout differs. */
static int gg_w1_map(const smoe_gemm_problem *p)
{
    return (p->gated && p->w1_layout != SMOE_W1_INTERLEAVED) ? GG_MAP_W1 : GG_MAP_IDENT;
}


/* Shared memory a block may opt in to on the current device. */
static int gg_smem_optin(void)
{
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return 0;
    return v;
}

/* Launches one configuration: the grid from the problem (varlen-M: worst
 * case, sum ceil(c_e/BM) <= ceil(cap/BM) + E m-tiles; varlen-K: E * tiles);
 * PERS: as many CTAs of it as fit on the device at once (at most one per
 * tile), E <= GG_PERS_EMAX (larger E runs the grid of one CTA per tile).
 * probe != 0: only says whether the configuration fits the device. */
template <int BM, int BN, int BK, int WM, int WN, int STAGES, int FA, int A_KM, int B_KM,
          int A_MAP, int B_MAP, int EPI, int PERS>
static smoe_status gg_launch(gg_args *a, const smoe_gemm_problem *p, int probe, cudaStream_t s,
                             const char *what)
{
    typedef gg_cfg<BM, BN, BK, WM, WN, STAGES, FA> C;
    if constexpr (PERS != 0)
        if (p->E > GG_PERS_EMAX)
            return gg_launch<BM, BN, BK, WM, WN, STAGES, FA, A_KM, B_KM, A_MAP, B_MAP, EPI, 0>(
                a, p, probe, s, what);
    const int smem = PERS ? C::pers_smem(EPI) : C::smem_bytes(EPI);
    const int optin = gg_smem_optin();
    if (probe) return smem <= optin ? SMOE_SUCCESS : SMOE_ERROR_UNSUPPORTED;
    SMOE_RETURN_ERROR_IF(smem > optin, SMOE_ERROR_UNSUPPORTED,
                         "%s: tile %dx%dx%d needs %d bytes of shared memory, the device gives %d",
                         what, BM, BN, BK, smem, optin);
    auto kern = gg_kernel<BM, BN, BK, WM, WN, STAGES, FA, A_KM, B_KM, A_MAP, B_MAP, EPI, PERS>;
    int64_t blocks;
    a->tiles_n = (int)gg_cdiv(a->N, BN);
    if (EPI == GG_EPI_DW || EPI == GG_EPI_DWS) {
        a->tiles_m = (int)gg_cdiv(a->M, BM);
        blocks = p->E * a->tiles_m * a->tiles_n;
    } else {
        blocks = p->cap == 0 ? 0 : (gg_cdiv(p->cap, BM) + p->E) * a->tiles_n;
    }
    if (blocks <= 0) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(blocks > (int64_t)INT32_MAX, SMOE_ERROR_UNSUPPORTED,
                         "%s: %lld thread blocks exceed the grid limit", what, (long long)blocks);
    cudaError_t err =
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND, "%s: cudaFuncSetAttribute: %s",
                         what, cudaGetErrorString(err));
    if (PERS) {
        /* Resident CTAs of this kernel per SM, asked once. */
        static int per_sm = 0;
        if (per_sm <= 0) {
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, C::NT, smem);
            SMOE_RETURN_ERROR_IF(err != cudaSuccess || per_sm <= 0, SMOE_ERROR_BACKEND,
                                 "%s: occupancy query: %s", what, cudaGetErrorString(err));
        }
        int sms = p->num_sms;
        if (sms <= 0) {
            int dev = 0;
            if (cudaGetDevice(&dev) != cudaSuccess ||
                cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
                sms <= 0)
                sms = 1;
        }
        if (blocks > (int64_t)sms * per_sm) blocks = (int64_t)sms * per_sm;
    }
    kern<<<(unsigned)blocks, C::NT, smem, s>>>(*a);
    err = cudaGetLastError();
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND, "%s: launch: %s", what,
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

/* Variant v of one GEMM kind: configuration c = v % 100 (GG_CFG_c); plus
 * 200 for dh, dw1, dw2: the staged epilogue (GG_EPI_DHR, GG_EPI_DWS), plus
 * 400 for dh: GG_EPI_DHX (600, 800: with H prefetched into L2); plus 1000 or 2000: operand copies with a 128- or
 * 256-byte L2 prefetch hint; plus 10000: a persistent grid (up, down, dxt
 * and the staged dw1, dw2; configurations 2, 4, 12). */
template <int A_KM, int B_KM, int A_MAP, int B_MAP, int EPI>
static smoe_status gg_dispatch(int v, gg_args *a, const smoe_gemm_problem *p, int probe,
                               cudaStream_t s, const char *what)
{
#define GG_CASE(c, E_, P_)                                                                      \
    case c: return gg_launch<GG_CFG_##c, A_KM, B_KM, A_MAP, B_MAP, E_, P_>(a, p, probe, s, what);
    const int pers = v >= 0 ? v / 10000 : 0;
    a->l2pf = v >= 0 ? (v / 1000) % 10 : 0;
    v = v >= 0 && pers <= 1 && a->l2pf <= 2 ? v % 1000 : -1;
    if constexpr (EPI == GG_EPI_DH) {
        if (!pers) {
            switch (v - 200) {
                GG_CASE(1, GG_EPI_DHR, 0)
                GG_CASE(2, GG_EPI_DHR, 0)
                GG_CASE(3, GG_EPI_DHR, 0)
                GG_CASE(4, GG_EPI_DHR, 0)
                GG_CASE(12, GG_EPI_DHR, 0)
            default: break;
            }
            /* DHX; + 600, + 800: the H tile prefetched into L2 512 or 1536
             * K elements before the main loop ends. */
            const int dhx = v >= 400 ? (v - 400) / 200 : -1;
            a->hpf = dhx == 1 ? 512 : dhx == 2 ? 1536 : 0;
            switch (dhx >= 0 && dhx <= 2 ? v - 400 - 200 * dhx : -1) {
                GG_CASE(1, GG_EPI_DHX, 0)
                GG_CASE(2, GG_EPI_DHX, 0)
                GG_CASE(4, GG_EPI_DHX, 0)
                GG_CASE(12, GG_EPI_DHX, 0)
            default: break;
            }
        }
    }
    if constexpr (EPI == GG_EPI_DW) {
        if (pers) {
            switch (v - 200) {
                GG_CASE(2, GG_EPI_DWS, 1)
                GG_CASE(4, GG_EPI_DWS, 1)
                GG_CASE(12, GG_EPI_DWS, 1)
            default: break;
            }
        } else {
            switch (v - 200) {
                GG_CASE(2, GG_EPI_DWS, 0)
                GG_CASE(3, GG_EPI_DWS, 0)
                GG_CASE(4, GG_EPI_DWS, 0)
                GG_CASE(12, GG_EPI_DWS, 0)
            default: break;
            }
        }
    }
    if constexpr (EPI == GG_EPI_UP || EPI == GG_EPI_STORE) {
        if (pers) {
            switch (v) {
                GG_CASE(2, EPI, 1)
                GG_CASE(4, EPI, 1)
                GG_CASE(12, EPI, 1)
            default: break;
            }
        }
    }
    if (!pers) {
        switch (v) {
            GG_CASE(1, EPI, 0)
            GG_CASE(2, EPI, 0)
            GG_CASE(3, EPI, 0)
            GG_CASE(4, EPI, 0)
            GG_CASE(12, EPI, 0)
        default: break;
        }
    }
#undef GG_CASE
    if (probe) return SMOE_ERROR_UNSUPPORTED;
    return smoe_fail(SMOE_ERROR_UNSUPPORTED, "%s: no tile configuration %d", what, v);
}

/* The selected variant of `gemm`; a default that does not fit the device
 * runs the fallback, then configuration 1. A variant set through the hook
 * runs as asked (or fails with its reason). */
template <int A_KM, int B_KM, int A_MAP, int B_MAP, int EPI>
static smoe_status gg_run(int gemm, gg_args *a, const smoe_gemm_problem *p, cudaStream_t s,
                          const char *what)
{
    int v = gg_variant(gemm);
    if (!smoe_sm80_gemm_variant[gemm]) {
        const int order[3] = {v, gg_fallback_variant[gemm], 1};
        for (int i = 0; i < 3; i++) {
            v = order[i];
            if (gg_dispatch<A_KM, B_KM, A_MAP, B_MAP, EPI>(v, a, p, 1, s, what) == SMOE_SUCCESS)
                break;
        }
    }
    return gg_dispatch<A_KM, B_KM, A_MAP, B_MAP, EPI>(v, a, p, 0, s, what);
}

static size_t gg_scratch_bytes(const smoe_gemm_problem *p)
{
    /* dh: dS partial sums, (ceil(n/BN), cap) fp32, for the smallest BN. */
    return (size_t)gg_cdiv(p->n, GG_MIN_BN) * (size_t)p->cap * sizeof(float) + 256;
}

static smoe_status gg_up(const smoe_gemm_problem *p, const bf16 *x, const bf16 *w1, const bf16 *b1,
                         bf16 *h, bf16 *a_out, void *scratch, cudaStream_t s)
{
    const char *what = "grouped GEMM up (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(x, what, "x"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(w1, what, "w1"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(h, what, "h"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(a_out, what, "a"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(b1, what, "b1"));
    gg_args a = gg_args_make(p);
    a.N = p->h_cols;
    a.K = p->d;
    a.a = gg_op(x, 0, p->d, GG_MAP_TOKEN);
    a.b = gg_op(w1, p->h_cols * p->d, p->d, gg_w1_map(p));
    a.bias = b1;
    a.bias_stride = p->h_cols;
    a.bias_map = gg_w1_map(p);
    a.out = h;
    a.ld_out = p->h_cols;
    a.out2 = a_out;
    a.ld_out2 = p->n;
    return gg_run<1, 1, 0, 0, GG_EPI_UP>(GG_UP, &a, p, s, what);
}

static smoe_status gg_down(const smoe_gemm_problem *p, const bf16 *a_in, const bf16 *w2,
                           const bf16 *b2, bf16 *y, void *scratch, cudaStream_t s)
{
    const char *what = "grouped GEMM down (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(a_in, what, "a"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(w2, what, "w2"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(b2, what, "b2"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(y, what, "y"));
    gg_args a = gg_args_make(p);
    a.N = p->d;
    a.K = p->n;
    a.a = gg_op(a_in, 0, p->n, GG_MAP_IDENT);
    a.b = gg_op(w2, p->d * p->n, p->n, GG_MAP_IDENT);
    a.bias = b2;
    a.bias_stride = p->d;
    a.bias_map = GG_MAP_IDENT;
    a.out = y;
    a.ld_out = p->d;
    return gg_run<1, 1, 0, 0, GG_EPI_STORE>(GG_DOWN, &a, p, s, what);
}

static smoe_status gg_dh(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *w2,
                         const bf16 *b2, const bf16 *h, bf16 *dh, bf16 *a_scaled, float *ds,
                         void *scratch, cudaStream_t s)
{
    const char *what = "grouped GEMM dh (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dout, what, "dout"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(w2, what, "w2"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(b2, what, "b2"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(h, what, "h"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dh, what, "dh"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(a_scaled, what, "a_scaled"));
    SMOE_RETURN_ERROR_IF(p->cap > 0 && scratch == NULL, SMOE_ERROR_NULL_POINTER,
                         "%s: scratch is NULL (needs %zu bytes)", what, gg_scratch_bytes(p));
    if (p->cap == 0) return SMOE_SUCCESS;
    gg_args a = gg_args_make(p);
    a.N = p->n;
    a.K = p->d;
    a.a = gg_op(dout, 0, p->d, GG_MAP_TOKEN);
    a.b = gg_op(w2, p->d * p->n, p->n, GG_MAP_IDENT); /* k-row k of W2[e] (d, n) */
    a.hin = h;
    a.ld_h = p->h_cols;
    a.out = dh;
    a.ld_out = p->h_cols;
    a.out2 = a_scaled;
    a.ld_out2 = p->n;
    a.dsp = (float *)scratch;
    smoe_status st = gg_run<1, 0, 0, GG_MAP_IDENT, GG_EPI_DH>(GG_DH, &a, p, s, what);
    if (st != SMOE_SUCCESS) return st;
    const int rows_per_block = 8;
    gg_ds_reduce<<<(unsigned)gg_cdiv(p->cap, rows_per_block), rows_per_block * 32, 0, s>>>(
        a.dsp, a.tiles_n, p->cap, p->expert_offset, (int)p->E, p->row_token, dout, b2, p->d, ds,
        p->abort);
    cudaError_t err = cudaGetLastError();
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND, "%s: dS reduce launch: %s", what,
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

static smoe_status gg_check_wgrad(smoe_dtype dt, const char *what)
{
    SMOE_RETURN_ERROR_IF(dt != SMOE_DTYPE_F32 && dt != SMOE_DTYPE_BF16, SMOE_ERROR_UNSUPPORTED,
                         "%s: weight-gradient dtype %d (F32 or BF16 only)", what, (int)dt);
    return SMOE_SUCCESS;
}

static smoe_status gg_dw2(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *a_scaled,
                          void *dw2, smoe_dtype out_dtype, int accumulate, void *scratch,
                          cudaStream_t s)
{
    const char *what = "grouped GEMM dw2 (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_wgrad(out_dtype, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dout, what, "dout"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(a_scaled, what, "a_scaled"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dw2, what, "dw2"));
    gg_args a = gg_args_make(p);
    a.M = p->d;
    a.N = p->n;
    a.a = gg_op(dout, 0, p->d, GG_MAP_TOKEN);
    a.b = gg_op(a_scaled, 0, p->n, GG_MAP_IDENT);
    a.wout = dw2;
    a.out_f32 = out_dtype == SMOE_DTYPE_F32;
    a.accumulate = accumulate != 0;
    a.out_map = GG_MAP_IDENT;
    return gg_run<0, 0, GG_MAP_TOKEN, GG_MAP_IDENT, GG_EPI_DW>(GG_DW2, &a, p, s, what);
}

static smoe_status gg_dxt(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *w1, bf16 *dxt,
                          void *scratch, cudaStream_t s)
{
    const char *what = "grouped GEMM dxt (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dh, what, "dh"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(w1, what, "w1"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dxt, what, "dxt"));
    gg_args a = gg_args_make(p);
    a.N = p->d;
    a.K = p->h_cols;
    a.a = gg_op(dh, 0, p->h_cols, GG_MAP_IDENT);
    a.b = gg_op(w1, p->h_cols * p->d, p->d, gg_w1_map(p)); /* k-row c: W1 row w1_row(c) */
    a.out = dxt;
    a.ld_out = p->d;
    if (a.b.map == GG_MAP_W1)
        return gg_run<1, 0, 0, GG_MAP_W1, GG_EPI_STORE>(GG_DXT, &a, p, s, what);
    return gg_run<1, 0, 0, GG_MAP_IDENT, GG_EPI_STORE>(GG_DXT, &a, p, s, what);
}

static smoe_status gg_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x, void *dw1,
                          smoe_dtype out_dtype, int accumulate, void *scratch, cudaStream_t s)
{
    const char *what = "grouped GEMM dw1 (mma.sync)";
    SMOE_FORWARD_IF_ERROR(gg_check_problem(p, what));
    SMOE_FORWARD_IF_ERROR(gg_check_wgrad(out_dtype, what));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dh, what, "dh"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(x, what, "x"));
    SMOE_FORWARD_IF_ERROR(gg_check_ptr(dw1, what, "dw1"));
    gg_args a = gg_args_make(p);
    a.M = p->h_cols;
    a.N = p->d;
    a.a = gg_op(dh, 0, p->h_cols, GG_MAP_IDENT);
    a.b = gg_op(x, 0, p->d, GG_MAP_TOKEN);
    a.wout = dw1;
    a.out_f32 = out_dtype == SMOE_DTYPE_F32;
    a.accumulate = accumulate != 0;
    a.out_map = gg_w1_map(p);
    return gg_run<0, 0, GG_MAP_IDENT, GG_MAP_TOKEN, GG_EPI_DW>(GG_DW1, &a, p, s, what);
}

extern "C" const smoe_gemm_ops smoe_gemm_ops_sm80 = {
    "mma.sync", gg_scratch_bytes, gg_up, gg_down, gg_dh, gg_dw2, gg_dxt, gg_dw1,
};
