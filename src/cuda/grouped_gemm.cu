/*
 * grouped_gemm.cu -- the six grouped GEMMs of the MoE layer, portable
 * version (mma.sync + cp.async, sm_80 and later: A100, H100): fills
 * smoe_gemm_ops_sm80 as specified in gemm.h.
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
 * Parts (src/cuda/portable/): args.cuh (the kernel's arguments, operand
 * maps), config.cuh (a tile configuration and its shared memory),
 * mainloop.cuh (loaders, cp.async ring, ldmatrix + mma.sync),
 * epilogue.cuh (UP, STORE, DH, DHX, DW, DWS), scheduler.cuh (which tile a
 * CTA computes, one CTA per tile or persistent), kernel.cuh (gg_kernel,
 * their composition). PTX wrappers: ptx.cuh; activations: activation.cuh;
 * dh's dS reduction: ds_reduce.cu. This file: the tile table (which
 * compositions exist and why) and the launchers.
 *
 * The tile table: per GEMM an ordered list of rows (tile configuration,
 * epilogue, grid, L2 hint); row 0 is the fastest measured on an H100, the
 * later ones what a device with less shared memory (A100: 163 KiB a
 * block) or a shape a row cannot run (a persistent grid's E <= 256) gets
 * instead. gg_plan picks, per GEMM, the first row that fits the device and
 * the shape; a launcher runs exactly the row its problem's plan names and
 * refuses one that cannot run, never picking another itself.
 *
 * Numerics: bf16 operands, fp32 accumulation (mma.sync), biases added in
 * fp32. up rounds H to bf16 and computes A from the rounded H, so that the
 * backward, which recomputes A from the stored H, sees the same A. dh uses
 * the fp32 dA' and A = act(bf16 H) for dS, A' and dH, rounding only the
 * stored values. Activations as activation.cuh computes them. Weight
 * gradients accumulate in fp32 and, with accumulate=1, are added to the
 * existing values in fp32.
 *
 * Determinism: every output element is produced by one thread with a fixed
 * summation order; dS partial sums are combined in a fixed order (DH: quad
 * shuffles, warps in order; DHX: each lane's columns, then a butterfly;
 * then N-tiles in order by smoe_ds_reduce). No atomics. A row's results do
 * not depend on the grid's size (persistent grids included).
 *
 * Requirements: d % 8 == 0, n % 8 == 0 and 16-byte aligned pointers (every
 * row is a whole number of 16-byte chunks); anything else is rejected with
 * SMOE_ERROR_UNSUPPORTED. Ragged tiles (rows at expert ends, K and N tails)
 * are predicated.
 */
#include <stdint.h>
#include <string.h>

#include "cuda/gemm.h"
#include "cuda/portable/kernel.cuh"

/* ------------------------------------------------------------ launch */

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
                         "%s: the mma.sync GEMMs need d and n multiples of 8 (d=%lld, n=%lld)",
                         what, (long long)p->d, (long long)p->n);
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

/* Shared memory a block may opt in to on the current device, asked once
 * per device (0 where the query fails). */
#define GG_MAX_DEVICES 64
static int gg_smem_optin(void)
{
    static int asked[GG_MAX_DEVICES]; /* 0: not yet */
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    const int cached = dev >= 0 && dev < GG_MAX_DEVICES;
    if (cached && (v = __atomic_load_n(&asked[dev], __ATOMIC_RELAXED)) > 0) return v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return 0;
    if (cached) __atomic_store_n(&asked[dev], v, __ATOMIC_RELAXED);
    return v;
}

/* Launches one composition: the grid from the problem (varlen-M: worst
 * case, sum ceil(c_e/BM) <= ceil(cap/BM) + E m-tiles; varlen-K: E *
 * tiles); PERS: as many CTAs of it as fit on the device at once (at most
 * one per tile). The caller (gg_run) has checked that the row fits the
 * device and the shape. */
template <int BM, int BN, int BK, int WM, int WN, int STAGES, int FA, int A_KM, int B_KM,
          int A_MAP, int B_MAP, int EPI, int L2, int PERS>
static smoe_status gg_launch(gg_args *a, const smoe_gemm_problem *p, cudaStream_t s,
                             const char *what)
{
    typedef gg_cfg<BM, BN, BK, WM, WN, STAGES, FA> C;
    const int smem = C::smem(EPI, PERS);
    auto kern = gg_kernel<BM, BN, BK, WM, WN, STAGES, FA, A_KM, B_KM, A_MAP, B_MAP, EPI, L2, PERS>;
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

/* ------------------------------------------------------------ tile table */

/* Tile configurations: (BM, BN, BK, warps along M, warps along N, stages,
 * A fragment buffers FA). Warp tiles of 64x64: 128 fp32 accumulators,
 * 240-255 registers a thread, so one CTA of 8 warps or two of 4 per SM.
 * Shared memory of the ring in the comment; each row below adds its
 * epilogue's. Measured on an H100 (notes/portable_log.md, call 1):
 * 256x128x64 with 8 warps is the fastest main loop at the large shapes;
 * 64x32 warp tiles (16 warps per SM), 128x128x64, 128x256x64 and 5-stage
 * rings were slower. */
#define GG_CFG_1 128, 128, 32, 2, 2, 4, 2  /*  4 warps,  64 KiB: two CTAs per SM */
#define GG_CFG_2 256, 128, 32, 4, 2, 3, 2  /*  8 warps,  72 KiB */
#define GG_CFG_4 256, 128, 64, 4, 2, 3, 1  /*  8 warps, 144 KiB */
#define GG_CFG_12 256, 128, 64, 4, 2, 4, 1 /*  8 warps, 192 KiB (sm_90: 227 KiB a block) */
/* The smallest BN of the table (dh's dS partial sums: one per row and
 * N-tile, sized by gg_scratch_bytes). */
#define GG_MIN_BN 128

/* Each GEMM's operands as template constants: A K-major, B K-major, A's
 * map, B's map (the maps of MN-major operands; K-major ones map at run
 * time, gg_operand.map). dxt's W1 is mapped only when its physical rows
 * differ from the interleaved order (gg_w1_map): two instances per row. */
#define GG_OPS_UP 1, 1, 0, 0
#define GG_OPS_DOWN 1, 1, 0, 0
#define GG_OPS_DH 1, 0, 0, GG_MAP_IDENT
#define GG_OPS_DW2 0, 0, GG_MAP_TOKEN, GG_MAP_IDENT
#define GG_OPS_DXT 1, 0, 0, GG_MAP_IDENT
#define GG_OPS_DXT_W1 1, 0, 0, GG_MAP_W1
#define GG_OPS_DW1 0, 0, GG_MAP_IDENT, GG_MAP_TOKEN

typedef smoe_status (*gg_launch_fn)(gg_args *a, const smoe_gemm_problem *p, cudaStream_t s,
                                    const char *what);

/* One row of a GEMM's table: a composition of the kernel's parts. */
typedef struct gg_row {
    const char *name;       /* "BMxBNxBK s<stages> [epilogue] [pers]" */
    gg_launch_fn launch;    /* gg_launch of (configuration, operands, epilogue, L2 hint, grid) */
    gg_launch_fn launch_w1; /* dxt: the same with W1's rows mapped; NULL elsewhere */
    int pers;               /* persistent grid: needs E <= GG_PERS_EMAX */
    int smem;               /* dynamic shared memory, bytes */
} gg_row;

#define GG_ROW(NAME, CFG, OPS, EPI, PERS, L2)                                                   \
    {NAME, gg_launch<CFG, OPS, EPI, L2, PERS>, NULL, PERS, gg_cfg<CFG>::smem(EPI, PERS)}
#define GG_ROW_DXT(NAME, CFG, PERS, L2)                                                         \
    {NAME, gg_launch<CFG, GG_OPS_DXT, GG_EPI_STORE, L2, PERS>,                                 \
     gg_launch<CFG, GG_OPS_DXT_W1, GG_EPI_STORE, L2, PERS>, PERS,                               \
     gg_cfg<CFG>::smem(GG_EPI_STORE, PERS)}

/* The rows, fastest first (TFLOPS on an H100 at the 120B-n1024 per-expert
 * shape, notes/portable_log.md). The last row of each GEMM, 128x128x32 on
 * 4 stages (at most 69 KiB), runs on every sm_80+ device. Compositions that
 * lost (128x256x32 tiles, dh's DHR epilogue, DHX with an L2 prefetch of H,
 * the 128-byte L2 hint, the persistent grids of up and dw1, and the other
 * configurations of each GEMM) were removed with the experiment hook in
 * issue 18; they are in git at 3a13394 (grouped_gemm.cu, gg_dispatch), their
 * measurements in notes/portable_log.md. */

/* up: 256x128x64 with the 256-byte L2 hint, 363 against 330 (the old
 * 128x128x32 default, call 2); its persistent grid measured even or
 * slower (sessions 6, 7). 144 KiB. */
static const gg_row gg_rows_up[] = {
    GG_ROW("256x128x64 s3", GG_CFG_4, GG_OPS_UP, GG_EPI_UP, 0, 256),
    GG_ROW("128x128x32 s4", GG_CFG_1, GG_OPS_UP, GG_EPI_UP, 0, 0),
};

/* down: the persistent grid on 4 stages, 216 KiB (sm_90 only), +1-2% at
 * 120B and +10% at n = 512 over one CTA per tile (session 6); then that
 * one-CTA-per-tile grid (192 KiB, 339 at 120B in call 2: what row 0 ran as
 * at E > GG_PERS_EMAX before there was a table), then 3 stages (144 KiB,
 * an A100's). */
static const gg_row gg_rows_down[] = {
    GG_ROW("256x128x64 s4 pers", GG_CFG_12, GG_OPS_DOWN, GG_EPI_STORE, 1, 256),
    GG_ROW("256x128x64 s4", GG_CFG_12, GG_OPS_DOWN, GG_EPI_STORE, 0, 256),
    GG_ROW("256x128x64 s3", GG_CFG_4, GG_OPS_DOWN, GG_EPI_STORE, 0, 256),
    GG_ROW("128x128x32 s4", GG_CFG_1, GG_OPS_DOWN, GG_EPI_STORE, 0, 0),
};

/* dh: DHX, 197 KiB (sm_90 only): 309.5 against DHR's 276.6 (session 6),
 * 322.8 with session 7's copy issue; then the unrolled DH epilogue on
 * 256x128x32 (138 KiB, an A100's; 252, the default before call 2). */
static const gg_row gg_rows_dh[] = {
    GG_ROW("256x128x64 s3 dhx", GG_CFG_4, GG_OPS_DH, GG_EPI_DHX, 0, 256),
    GG_ROW("256x128x32 s3 dh", GG_CFG_2, GG_OPS_DH, GG_EPI_DH, 0, 0),
    GG_ROW("128x128x32 s4 dh", GG_CFG_1, GG_OPS_DH, GG_EPI_DH, 0, 0),
};

/* dw2: the staged DWS epilogue, persistent, on 256x128x32 (120 KiB):
 * 336.3 / 340.7 against 282.4 for its one-CTA-per-tile grid in the same
 * binary (session 7, call 3); that grid (72 KiB) where E > GG_PERS_EMAX. */
static const gg_row gg_rows_dw2[] = {
    GG_ROW("256x128x32 s3 dws pers", GG_CFG_2, GG_OPS_DW2, GG_EPI_DWS, 1, 256),
    GG_ROW("256x128x32 s3 dws", GG_CFG_2, GG_OPS_DW2, GG_EPI_DWS, 0, 256),
    GG_ROW("128x128x32 s4 dw", GG_CFG_1, GG_OPS_DW2, GG_EPI_DW, 0, 0),
};

/* dxt: the persistent grid on 256x128x64 (168 KiB, sm_90 only): 421.9 /
 * 426.1 against one CTA per tile's 395.2 / 390.5 (session 7, call 2; one
 * later sample reversed, notes: open); one CTA per tile (144 KiB) on an
 * A100 and where E > GG_PERS_EMAX. */
static const gg_row gg_rows_dxt[] = {
    GG_ROW_DXT("256x128x64 s3 pers", GG_CFG_4, 1, 256),
    GG_ROW_DXT("256x128x64 s3", GG_CFG_4, 0, 256),
    GG_ROW_DXT("128x128x32 s4", GG_CFG_1, 0, 0),
};

/* dw1: DWS on 256x128x64, 3 stages (144 KiB): 373.3 / 374.6 against 4
 * stages' 364.5 / 362.0 and the persistent grid's 354.4 / 353.3 (session
 * 7, call 2); 256x128x32 (72 KiB) below 144 KiB. */
static const gg_row gg_rows_dw1[] = {
    GG_ROW("256x128x64 s3 dws", GG_CFG_4, GG_OPS_DW1, GG_EPI_DWS, 0, 256),
    GG_ROW("256x128x32 s3 dws", GG_CFG_2, GG_OPS_DW1, GG_EPI_DWS, 0, 256),
    GG_ROW("128x128x32 s4 dw", GG_CFG_1, GG_OPS_DW1, GG_EPI_DW, 0, 0),
};

#define GG_NROWS(t) ((int)(sizeof(t) / sizeof((t)[0])))
static const struct {
    const gg_row *rows;
    int count;
} gg_table[SMOE_GEMM_COUNT] = {
    {gg_rows_up, GG_NROWS(gg_rows_up)},   {gg_rows_down, GG_NROWS(gg_rows_down)},
    {gg_rows_dh, GG_NROWS(gg_rows_dh)},   {gg_rows_dw2, GG_NROWS(gg_rows_dw2)},
    {gg_rows_dxt, GG_NROWS(gg_rows_dxt)}, {gg_rows_dw1, GG_NROWS(gg_rows_dw1)},
};


/* Why row r cannot run problem p on a device giving `optin` bytes of
 * shared memory a block, or NULL if it can. */
static const char *gg_row_refusal(const gg_row *r, const smoe_gemm_problem *p, int optin)
{
    if (r->pers && p->E > GG_PERS_EMAX) return "a persistent grid keeps at most 256 experts";
    if (r->smem > optin) return "needs more shared memory than the device gives a block";
    return NULL;
}

/* The shape conditions of gg_check_problem (cap aside): the family runs no
 * GEMM of a shape that fails them. */
static int gg_shape_ok(const smoe_gemm_problem *p)
{
    return p->off_stride <= 1 && p->d > 0 && p->n > 0 && p->E > 0 && p->d % 8 == 0 &&
           p->n % 8 == 0 && p->h_cols == (p->gated ? 2 * p->n : p->n) &&
           p->E <= (int64_t)INT32_MAX / 2 && p->d <= ((int64_t)1 << 28) &&
           p->h_cols <= ((int64_t)1 << 28);
}

/* smoe_gemm_ops.plan: per GEMM the first row that runs the shape on the
 * current device. */
static void gg_plan(const smoe_gemm_problem *p, smoe_gemm_plan *plan)
{
    const int optin = gg_smem_optin();
    const int ok = gg_shape_ok(p);
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
        plan->row[g] = -1;
        for (int i = 0; ok && i < gg_table[g].count; i++) {
            if (!gg_row_refusal(&gg_table[g].rows[i], p, optin)) {
                plan->row[g] = i;
                break;
            }
        }
    }
}

/* smoe_gemm_ops.row_fits */
static int gg_row_fits(const smoe_gemm_problem *p, int gemm, int row)
{
    if (gemm < 0 || gemm >= SMOE_GEMM_COUNT || row < 0 || row >= gg_table[gemm].count) {
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "mma.sync: no row %d for GEMM %d", row, gemm);
        return 0;
    }
    if (!gg_shape_ok(p)) {
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "mma.sync %s: the shape is outside these kernels",
                  smoe_gemm_name(gemm));
        return 0;
    }
    const gg_row *r = &gg_table[gemm].rows[row];
    const char *why = gg_row_refusal(r, p, gg_smem_optin());
    if (why)
        smoe_fail(SMOE_ERROR_UNSUPPORTED, "mma.sync %s: row \"%s\": %s", smoe_gemm_name(gemm),
                  r->name, why);
    return why == NULL;
}

static const char *gg_row_name(int gemm, int row)
{
    if (gemm < 0 || gemm >= SMOE_GEMM_COUNT || row < 0 || row >= gg_table[gemm].count)
        return NULL;
    return gg_table[gemm].rows[row].name;
}

/* Runs GEMM `gemm` (a's operands and outputs set) with the row its plan
 * names; w1_mapped: dxt's instance with W1's rows mapped. */
static smoe_status gg_run(int gemm, gg_args *a, const smoe_gemm_problem *p, int w1_mapped,
                          cudaStream_t s, const char *what)
{
    const smoe_gemm_plan *plan = p->plan;
    SMOE_RETURN_ERROR_IF(!plan, SMOE_ERROR_INTERNAL, "%s: no plan", what);
    const int i = plan->row[gemm];
    SMOE_RETURN_ERROR_IF(i == -1, SMOE_ERROR_UNSUPPORTED,
                         "%s: the plan has no row of the tile table for this GEMM", what);
    SMOE_RETURN_ERROR_IF(i < 0 || i >= gg_table[gemm].count, SMOE_ERROR_INTERNAL,
                         "%s: the plan names row %d, the %s table has %d", what, i,
                         smoe_gemm_name(gemm), gg_table[gemm].count);
    const gg_row *r = &gg_table[gemm].rows[i];
    const int optin = gg_smem_optin();
    const char *why = gg_row_refusal(r, p, optin);
    SMOE_RETURN_ERROR_IF(why != NULL, SMOE_ERROR_UNSUPPORTED,
                         "%s: row \"%s\" cannot run here: %s (E=%lld; %d bytes of shared memory, "
                         "the device gives %d)",
                         what, r->name, why, (long long)p->E, r->smem, optin);
    return (w1_mapped ? r->launch_w1 : r->launch)(a, p, s, what);
}

/* ------------------------------------------------------------ launchers */

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
    return gg_run(SMOE_GEMM_UP, &a, p, 0, s, what);
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
    return gg_run(SMOE_GEMM_DOWN, &a, p, 0, s, what);
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
    /* the GEMM sets a.tiles_n: the partial sums of each row */
    SMOE_FORWARD_IF_ERROR(gg_run(SMOE_GEMM_DH, &a, p, 0, s, what));
    if (p->cap == 0) return SMOE_SUCCESS;
    return smoe_ds_reduce(p, a.dsp, a.tiles_n, dout, b2, ds, s);
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
    return gg_run(SMOE_GEMM_DW2, &a, p, 0, s, what);
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
    return gg_run(SMOE_GEMM_DXT, &a, p, a.b.map == GG_MAP_W1, s, what);
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
    return gg_run(SMOE_GEMM_DW1, &a, p, 0, s, what);
}

extern "C" const smoe_gemm_ops smoe_gemm_ops_sm80 = {
    "mma.sync", gg_scratch_bytes, gg_up, gg_down, gg_dh, gg_dw2, gg_dxt, gg_dw1, gg_plan,
    gg_row_name, gg_row_fits,
};
