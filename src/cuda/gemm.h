/*
 * gemm.h -- the six grouped GEMMs of the MoE layer on the GPU (DESIGN.md
 * section 6), as a table of launchers. Two implementations fill the table:
 * the portable one (grouped_gemm.cu, mma.sync + cp.async, sm_80 and later)
 * and the Hopper one (sm90/grouped_gemm_sm90.cu, TMA + wgmma, sm_90a).
 * The layer (cuda_layer.cu) calls through the tables. Each family has a
 * tile table per GEMM (rows: a kernel configuration with a name); the
 * family's plan() picks each GEMM's row for a shape once, when the layer is
 * made, and the layer runs the Hopper row where there is one, the portable
 * row otherwise (its path name says which family runs each GEMM).
 *
 * Conventions, for every launcher:
 *  - bf16 storage, fp32 accumulation. All pointers are device pointers.
 *  - Rows are sorted by expert: rows of expert e are
 *    [expert_offset[e], expert_offset[e+1]), read on the device. The host
 *    knows only `cap` >= R, the row capacity, and sizes grids for it (or runs
 *    persistent grids); nothing waits for the device.
 *  - H, dH, A, A' are row-major with cap rows. H and dH have h_cols columns
 *    in interleaved order (gate j at 2j, up j at 2j+1) when gated, whatever
 *    W1's layout: the W1 loaders map a logical row c of W1 to its physical
 *    row (w1_row() below).
 *  - Rows past R are neither read nor written.
 *  - Launch errors are returned as SMOE_ERROR_BACKEND with a message.
 *  - A launcher runs the row p->plan names for its GEMM, or returns
 *    SMOE_ERROR_UNSUPPORTED (a row that cannot run the shape, a misaligned
 *    pointer) before touching memory; it never picks another kernel. With
 *    cap = 0 it launches nothing.
 *  - Deterministic: no atomics on floating-point values.
 *  - Every kernel reads *p->abort first (when not NULL) and does nothing if
 *    it is set (see smoe_gemm_problem.abort).
 */
#ifndef SMOE_CUDA_GEMM_H
#define SMOE_CUDA_GEMM_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/activation.cuh"
#include "smoe_internal.h"

typedef __nv_bfloat16 bf16;

/* The six GEMMs, as indices of a plan. */
enum {
    SMOE_GEMM_UP = 0,
    SMOE_GEMM_DOWN,
    SMOE_GEMM_DH,
    SMOE_GEMM_DW2,
    SMOE_GEMM_DXT,
    SMOE_GEMM_DW1,
    SMOE_GEMM_COUNT
};

/* Which kernel each GEMM runs: a row of its family's tile table, or -1
 * where the family cannot run that GEMM at this shape. A plan is made once,
 * when the layer is made (smoe_gemm_ops.plan, from the shape and the
 * device), and every launch runs exactly its row: no launcher chooses a
 * kernel during a call. Tests and the benchmark name rows
 * (smoe_gemm_row_find) to run a particular kernel. */
typedef struct smoe_gemm_plan {
    int row[SMOE_GEMM_COUNT];
} smoe_gemm_plan;

typedef struct smoe_gemm_problem {
    int64_t d, n;             /* hidden, intermediate */
    int64_t h_cols;           /* 2n gated, n otherwise */
    int64_t E;
    int64_t cap;              /* row capacity (>= R) */
    int gated;
    smoe_activation act;
    smoe_w1_layout w1_layout;
    const int32_t *expert_offset; /* (E+1), or a view's (see off_stride) */
    /* A view of the rows (the expert-parallel layer's chunks): 0 or 1 is the
     * plain case; s > 1 makes expert e's rows [expert_offset[e s],
     * expert_offset[e s + 1]), other rows neither read nor written. Only
     * the Hopper table's up, down, dh and dxt take a view; every other
     * launcher refuses one (SMOE_ERROR_UNSUPPORTED). */
    int off_stride;
    const int32_t *row_token;     /* (cap) token of each row */
    const float *row_score;       /* (cap) score of each row */
    int num_sms;              /* of the device, for persistent grids */
    /* The call's device status code (cuda_common.h): every kernel of the
     * launchers returns at once when it is not 0, so a call whose
     * device-side check failed writes nothing. NULL: never. */
    const int *abort;
    /* The kernels to run (required; the launcher refuses a row that cannot
     * run the problem's shape with SMOE_ERROR_UNSUPPORTED). */
    const smoe_gemm_plan *plan;
} smoe_gemm_problem;

/* Physical W1 row of logical row c (interleaved order). */
static inline __host__ __device__ int64_t smoe_w1_row(int64_t c, int64_t n, int gated,
                                                      smoe_w1_layout layout)
{
    if (!gated || layout == SMOE_W1_INTERLEAVED) return c;
    return (c & 1) ? n + (c >> 1) : (c >> 1);
}

typedef struct smoe_gemm_ops {
    const char *name; /* e.g. "mma.sync" or "tma+wgmma" */

    /* Scratch bytes the launchers below need (dS partial sums...). */
    size_t (*scratch_bytes)(const smoe_gemm_problem *p);

    /* 1. Up-projection: H[r] = X[row_token[r]] W1[e]^T + b1[e] (b1 may be
     *    NULL); A[r] = act(H[r]) (n columns). h NULL: inference, H not
     *    written. x (T, d), w1 (E, h_cols, d), b1 (E, h_cols), h (cap,
     *    h_cols), a (cap, n). */
    smoe_status (*up)(const smoe_gemm_problem *p, const bf16 *x, const bf16 *w1,
                      const bf16 *b1, bf16 *h, bf16 *a, void *scratch, cudaStream_t s);

    /* 2. Down-projection: Y[r] = A[r] W2[e]^T + b2[e] (b2 may be NULL).
     *    a (cap, n), w2 (E, d, n), b2 (E, d), y (cap, d). */
    smoe_status (*down)(const smoe_gemm_problem *p, const bf16 *a, const bf16 *w2,
                        const bf16 *b2, bf16 *y, void *scratch, cudaStream_t s);

    /* 3. dH: dA'[r] = dO[row_token[r]] W2[e] (n columns), then per row with
     *    A = act(H[r]) recomputed and s = row_score[r]:
     *      ds[r]       = <dA'[r], A> (+ <dO[token], b2[e]> if b2 != NULL),
     *                    partial sums over N tiles reduced in a fixed order;
     *      a_scaled[r] = s * A                     (cap, n), for dW2
     *      dh[r]       = s * dact(H[r], dA'[r])    (cap, h_cols)
     *    dout (T, d), w2 (E, d, n), h (cap, h_cols), ds (cap) fp32. */
    smoe_status (*dh)(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *w2,
                      const bf16 *b2, const bf16 *h, bf16 *dh, bf16 *a_scaled,
                      float *ds, void *scratch, cudaStream_t s);

    /* 4. dW2[e] (d, n) = sum over rows r of e of dO[row_token[r]]^T a_scaled[r].
     *    out_dtype BF16 or F32; accumulate 0 overwrites, 1 adds (in fp32).
     *    Experts with no rows: zeros (overwrite) or untouched (accumulate). */
    smoe_status (*dw2)(const smoe_gemm_problem *p, const bf16 *dout, const bf16 *a_scaled,
                       void *dw2, smoe_dtype out_dtype, int accumulate, void *scratch,
                       cudaStream_t s);

    /* 5. dX~[r] = dH[r] W1[e] (d columns; W1 rows mapped by smoe_w1_row).
     *    dh (cap, h_cols), w1 (E, h_cols, d), dxt (cap, d). */
    smoe_status (*dxt)(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *w1,
                       bf16 *dxt, void *scratch, cudaStream_t s);

    /* 6. dW1[e] (h_cols, d) = sum over rows r of e of dH[r]^T X[row_token[r]],
     *    logical row c written to physical row smoe_w1_row(c). Same output
     *    rules as dw2. */
    smoe_status (*dw1)(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                       void *dw1, smoe_dtype out_dtype, int accumulate, void *scratch,
                       cudaStream_t s);

    /* The tile table: each GEMM's row for the problem's shape on the
     * current device (cap, pointers and plan ignored), -1 where this family
     * cannot run the GEMM there. */
    void (*plan)(const smoe_gemm_problem *p, smoe_gemm_plan *plan);

    /* The name of row `row` of GEMM `gemm`'s table (e.g. "256x4 tma-store"),
     * NULL past its last row. */
    const char *(*row_name)(int gemm, int row);

    /* Whether row `row` of GEMM `gemm` can run p's shape (1), or 0 with the
     * reason as smoe_last_error(): for tests that run every row. */
    int (*row_fits)(const smoe_gemm_problem *p, int gemm, int row);
} smoe_gemm_ops;

/* GEMM g's name ("up", "down", "dh", "dw2", "dxt", "dw1"), and the index
 * of a name (-1 if none). */
static inline const char *smoe_gemm_name(int g)
{
    static const char *const names[SMOE_GEMM_COUNT] = {"up", "down", "dh", "dw2", "dxt", "dw1"};
    return g >= 0 && g < SMOE_GEMM_COUNT ? names[g] : "?";
}

static inline int smoe_gemm_find(const char *name, size_t len)
{
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
        const char *n = smoe_gemm_name(g);
        size_t k = 0;
        while (k < len && n[k] && n[k] == name[k]) k++;
        if (k == len && !n[k]) return g;
    }
    return -1;
}

/* The row of GEMM `gemm` named `name` in ops' table, -1 if none. */
static inline int smoe_gemm_row_find(const smoe_gemm_ops *ops, int gemm, const char *name)
{
    for (int i = 0;; i++) {
        const char *r = ops->row_name(gemm, i);
        if (!r) return -1;
        int k = 0;
        while (r[k] && r[k] == name[k]) k++;
        if (r[k] == name[k]) return i;
    }
}

#ifdef __cplusplus
extern "C" {
#endif
extern const smoe_gemm_ops smoe_gemm_ops_sm80; /* grouped_gemm.cu */
/* dh's last step, both families (ds_reduce.cu): ds[r] = dsp[t cap + r]
 * summed over t < tiles in order, + <dO[row_token[r]], b2[e]> (b2 may be
 * NULL), for the rows of p (a view's rows only); cap / 8 blocks of 8
 * warps. */
smoe_status smoe_ds_reduce(const smoe_gemm_problem *p, const float *dsp, int tiles,
                           const bf16 *dout, const bf16 *b2, float *ds, cudaStream_t s);
extern const smoe_gemm_ops smoe_gemm_ops_sm90; /* sm90/grouped_gemm_sm90.cu; NULL entries
                                                  run the portable kernel */
#ifdef __cplusplus
}
#endif

#endif /* SMOE_CUDA_GEMM_H */
