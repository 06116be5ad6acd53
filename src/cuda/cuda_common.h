/*
 * cuda_common.h -- what the CUDA backend's files share: CUDA and cuBLAS
 * error checks that turn into a smoe_status (never an exit), the device
 * status word that kernels fill when they find bad device-resident input,
 * and the launchers of the non-GEMM kernels (routing.cu, metadata.cu,
 * aggregate.cu, router_backward.cu), called by cuda_layer.cu.
 *
 * Every launcher only enqueues work on `stream`: no host synchronisation, no
 * allocation. Sizes the host cannot know (rows R, GENERAL triples that are
 * skipped) are read on the device; grids are sized for the capacity `cap`.
 */
#ifndef SMOE_CUDA_COMMON_H
#define SMOE_CUDA_COMMON_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/gemm.h"
#include "smoe_internal.h"

/* ------------------------------------------------------------ errors */

#define SMOE_CUDA_CHECK(expr)                                                           \
    do {                                                                                \
        cudaError_t smoe_ce_ = (expr);                                                  \
        if (smoe_ce_ != cudaSuccess)                                                    \
            return smoe_fail(SMOE_ERROR_BACKEND, "%s:%d: %s: %s", __FILE__, __LINE__,   \
                             #expr, cudaGetErrorString(smoe_ce_));                      \
    } while (0)

/* After a kernel launch: a bad configuration shows up here, without a sync. */
#define SMOE_CUDA_LAUNCH_CHECK(what)                                                    \
    do {                                                                                \
        cudaError_t smoe_ce_ = cudaGetLastError();                                      \
        if (smoe_ce_ != cudaSuccess)                                                    \
            return smoe_fail(SMOE_ERROR_BACKEND, "%s:%d: launch of %s: %s", __FILE__,   \
                             __LINE__, (what), cudaGetErrorString(smoe_ce_));           \
    } while (0)

#define SMOE_CUBLAS_CHECK(expr)                                                         \
    do {                                                                                \
        cublasStatus_t smoe_cb_ = (expr);                                               \
        if (smoe_cb_ != CUBLAS_STATUS_SUCCESS)                                          \
            return smoe_fail(SMOE_ERROR_BACKEND, "%s:%d: %s: cuBLAS status %d (%s)",    \
                             __FILE__, __LINE__, #expr, (int)smoe_cb_,                  \
                             cublasGetStatusString(smoe_cb_));                          \
    } while (0)

static inline int64_t smoe_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ------------------------------------------------------------ device status */

/* The first words of every workspace. A forward clears it; kernels that find
 * bad GENERAL triples record the lowest bad index (atomicMin, so the result
 * does not depend on the order threads run in); a later kernel fills in the
 * reason and the offending value of that triple. */
enum {
    SMOE_DEV_OK = 0,
    SMOE_DEV_BAD_TOKEN = 1,    /* pair_token out of [0, T) */
    SMOE_DEV_BAD_EXPERT = 2,   /* pair_expert out of [0, E) */
    SMOE_DEV_UNSORTED = 3,     /* pair_token[i] < pair_token[i-1] */
    SMOE_DEV_DUPLICATE = 4     /* (token, expert) given twice */
};

typedef struct smoe_dev_status {
    int first_bad;  /* lowest bad triple index; INT_MAX when none */
    int code;       /* SMOE_DEV_* of that triple */
    int value;      /* its offending token or expert */
    int value2;     /* the previous token (unsorted) or the expert (duplicate) */
} smoe_dev_status;

#define SMOE_DEV_STATUS_BYTES 256 /* keeps what follows SMOE_ALIGN-aligned */

/* ------------------------------------------------------------ routing.cu */

/* What the routing kernels produce: routed pairs in token-major order
 * (DESIGN.md "assignments"), with their count on the device. */
typedef struct smoe_assign_dev {
    int32_t *expert;       /* (cap); -1: skipped (bad GENERAL triple) */
    int32_t *token;        /* (cap) */
    float *score;          /* (cap) */
    int32_t *token_offset; /* (T+1) */
    int32_t *count;        /* (1) number of pairs, <= cap */
} smoe_assign_dev;

/* Scratch (bytes) the routing of mode `rounding` needs beyond the outputs. */
size_t smoe_cuda_routing_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding);

/* Token choice (TOPK_SOFTMAX, SOFTMAX_TOPK), optionally followed by token
 * rounding (rounding != 0, desc->rounding != OFF), from fp32 logits (T, E).
 * Bit-exact with smoe_route_cpu on the same logits. */
smoe_status smoe_cuda_route(const smoe_layer_desc *desc, int64_t T, int rounding,
                            const float *logits, smoe_assign_dev out, void *scratch,
                            cudaStream_t stream);

/* GENERAL: copies `pairs` triples into `out`, checking each; a bad one is
 * skipped (expert -1) and recorded in *status. */
smoe_status smoe_cuda_route_general(int64_t T, int64_t E, int64_t pairs,
                                    const int32_t *pair_token, const int32_t *pair_expert,
                                    const float *pair_score, smoe_assign_dev out,
                                    smoe_dev_status *status, cudaStream_t stream);

/* Clears the status word (first thing a forward does). */
smoe_status smoe_cuda_status_reset(smoe_dev_status *status, cudaStream_t stream);

/* ------------------------------------------------------------ metadata.cu */

size_t smoe_cuda_metadata_scratch_bytes(int64_t E, int64_t cap);

/* From the assignments: expert_offset (E+1), assign_row (cap), row_token and
 * row_score (cap), and optionally expert_counts (E). Rows sorted by expert,
 * then by token (a stable counting sort over token-major assignments). */
smoe_status smoe_cuda_metadata(int64_t E, int64_t cap, smoe_assign_dev in,
                               int32_t *expert_offset, int32_t *assign_row,
                               int32_t *row_token, float *row_score,
                               int32_t *expert_counts, void *scratch, cudaStream_t stream);

/* ------------------------------------------------------------ aggregate.cu */

/* Forward: out[t] = sum_a row_score[row_a] * y[row_a] over the token's
 * assignments (fp32 sums in assignment order), bf16 out. */
smoe_status smoe_cuda_aggregate_forward(int64_t T, int64_t d, const int32_t *token_offset,
                                        const int32_t *assign_row, const float *row_score,
                                        const bf16 *y, bf16 *out, cudaStream_t stream);

/* Backward: dx[t] (op)= sum_a (dxt[row_a] + dl_a * wr[e_a]) (+ extra[t]),
 * into dtype BF16 or F32, overwritten or accumulated. extra (T, d) fp32 may
 * be NULL; assign_dl (cap) fp32 with assign_expert and wr (E, d) may be
 * NULL (no per-pair router term). */
smoe_status smoe_cuda_aggregate_backward(int64_t T, int64_t d, const int32_t *token_offset,
                                         const int32_t *assign_row, const bf16 *dxt,
                                         const float *extra, const float *assign_dl,
                                         const int32_t *assign_expert, const bf16 *wr, void *dx,
                                         smoe_dtype dx_dtype, int accumulate,
                                         cudaStream_t stream);

/* ------------------------------------------------------------ router_backward.cu */

/* dlogits (T, E) of the routing mode from the per-row score gradients ds
 * (cap), plus dlogits_extra (may be NULL), written as a bf16 hi/lo split
 * (T, 2E): columns [0, E) hold bf16(g), [E, 2E) bf16(g - bf16(g)), so two
 * bf16 GEMMs with fp32 accumulation see g to about 16 bits. tc_scratch
 * (T, K) int32: token rounding's token-choice experts, recomputed. */
smoe_status smoe_cuda_router_dlogits(const smoe_layer_desc *desc, int64_t T, int rounding,
                                     const float *logits, const int32_t *token_offset,
                                     const int32_t *assign_expert, const int32_t *assign_row,
                                     const float *row_score, const float *ds,
                                     const float *dlogits_extra, bf16 *split,
                                     int32_t *tc_scratch, float *assign_dl, cudaStream_t stream);

/* Is dlogits sparse: nonzero only on each token's routed pairs
 * (TOPK_SOFTMAX, no rounding, K <= 32, no dlogits_extra)? Then
 * smoe_cuda_router_dlogits also writes each pair's entry into assign_dl
 * (cap, fp32) and the aggregation adds dl_a * Wr[e_a] itself, with no dense
 * dX GEMM. Otherwise assign_dl must be NULL. */
int smoe_cuda_router_sparse(const smoe_layer_desc *desc, int rounding, const float *dlogits_extra);

/* wr2 (2E, d) = [wr; wr]: the B operand of dX += split * wr2. */
smoe_status smoe_cuda_stack_twice(const bf16 *wr, int64_t E, int64_t d, bf16 *wr2,
                                  cudaStream_t stream);

/* dwr (E, d) (op)= dwr2[0:E] + dwr2[E:2E] (fp32 (2E, d)). */
smoe_status smoe_cuda_combine_halves(const float *dwr2, int64_t E, int64_t d, void *dwr,
                                     smoe_dtype dtype, int accumulate, cudaStream_t stream);

/* GENERAL: dpair_score[a] (op)= ds[assign_row[a]] (0 for skipped triples). */
smoe_status smoe_cuda_pair_score_grad(int64_t pairs, const int32_t *assign_row,
                                      const float *ds, float *dscore, int accumulate,
                                      cudaStream_t stream);

/* Per-expert column sums, deterministic (fixed partition of each expert's
 * rows over 8 row lanes, reduced in lane order), for the bias gradients:
 *   db1[e][w1_row(c)] (op)= sum over rows r of e of dh[r][c]       (map_w1 = 1)
 *   db2[e][c]         (op)= sum over rows r of e of s_r dout[tok_r][c]
 * src bf16 with `cols` columns; gather (cap) maps a row to its source row
 * (NULL: the row itself); scale (cap) multiplies it (NULL: 1). Experts with
 * no rows: zeros (overwrite) or untouched (accumulate). */
smoe_status smoe_cuda_expert_colsum(int64_t E, int64_t cols, const int32_t *expert_offset,
                                    const bf16 *src, const int32_t *gather, const float *scale,
                                    int64_t n, int gated, smoe_w1_layout layout, int map_w1,
                                    void *dst, smoe_dtype dtype, int accumulate,
                                    cudaStream_t stream);

#endif /* SMOE_CUDA_COMMON_H */
