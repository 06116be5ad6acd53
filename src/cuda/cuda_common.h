/*
 * cuda_common.h -- what the CUDA backend's files share: CUDA and cuBLAS
 * error checks that turn into a smoe_status (never an exit), the device
 * status word that kernels fill when they find bad device-resident input,
 * and the launchers of the non-GEMM kernels (routing*.cu, status.cu,
 * metadata.cu, aggregate.cu, router_backward.cu), called by cuda_layer.cu
 * and the expert-parallel path (ep_cuda.cu).
 *
 * Every launcher only enqueues work on `stream`: no host synchronisation, no
 * allocation. Sizes the host cannot know (rows R) are read on the device;
 * grids are sized for the capacity `cap`. Launchers that run after a
 * device-side check take `abort` (the call's status code; NULL: never).
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

/* The status word: the first bytes of every workspace, one per call. A
 * forward clears it (k_status_reset) and the GENERAL checks fill it: the
 * lowest bad triple's index (atomicMin, so the result does not depend on
 * the order threads run in), then its reason and values. A backward's first
 * kernel (k_saved_check) fills it from the saved block's header. Every
 * kernel launched after a check reads `code` first and does nothing when it
 * is set (SMOE_DEV_RETURN_IF_ABORTED), so a failed call writes no output;
 * the kernel that sets it also reports it to the layer (smoe_dev_report),
 * where smoe_layer_device_status() reads it. */
enum {
    SMOE_DEV_OK = 0,
    SMOE_DEV_BAD_TOKEN = 1,     /* pair_token out of [0, T) */
    SMOE_DEV_BAD_EXPERT = 2,    /* pair_expert out of [0, E) */
    SMOE_DEV_UNSORTED = 3,      /* pair_token[i] < pair_token[i-1] */
    SMOE_DEV_DUPLICATE = 4,     /* (token, expert) given twice */
    SMOE_DEV_BAD_SCORE = 5,     /* pair_score not finite */
    SMOE_DEV_SAVED_INVALID = 6, /* saved block: no valid header */
    SMOE_DEV_SAVED_LAYER = 7,   /* saved block: of another layer */
    SMOE_DEV_SAVED_T = 8,       /* saved block: of another T */
    SMOE_DEV_SAVED_PAIRS = 9,   /* saved block: of another number of pairs */
    SMOE_DEV_SAVED_FAILED = 10, /* saved block: its forward failed a check */
    SMOE_DEV_EP_OVERFLOW = 11,  /* expert parallelism: more rows for a rank than capacity
                                   (first_bad: the destination, value: rows, value2:
                                   capacity) */
    SMOE_DEV_EP_ROWS = 12,      /* ... more (row, expert) pairs than expert_rows */
    SMOE_DEV_EP_PEER = 13,      /* ... another rank's call failed (value: its rank, value2:
                                   its code) */
    SMOE_DEV_SAVED_CONSUMED = 14 /* saved block: consumed by an earlier backward */
};

typedef struct smoe_dev_status {
    int first_bad;    /* GENERAL: lowest bad triple index; INT_MAX when none */
    int code;         /* SMOE_DEV_*; 0 while every check passed */
    long long value;  /* the offending token, expert, score bits, T, pairs... */
    long long value2; /* T (bad token), the previous token (unsorted), the
                         expert (duplicate), the call's T or pairs (saved) */
} smoe_dev_status;

#define SMOE_DEV_STATUS_BYTES 256 /* keeps what follows SMOE_ALIGN-aligned */

#define SMOE_DEV_RETURN_IF_ABORTED(abort) \
    do { if ((abort) && *(abort)) return; } while (0)

/* The layer's record of the first failure not yet read by
 * smoe_layer_device_status: in page-locked host memory mapped into the
 * device, so the host reads it without a copy and without waiting. */
typedef struct smoe_dev_mapped {
    volatile int code; /* written last */
    int call;          /* 0 forward, 1 backward */
    smoe_dev_status st;
} smoe_dev_mapped;

typedef struct smoe_dev_report {
    int *claim;             /* device memory: 0 free, 1 taken until read */
    smoe_dev_mapped *rec;   /* device alias of the mapped record */
    int call;
} smoe_dev_report;

#ifdef __CUDACC__
/* Called by the one thread that set st->code: the first failure since the
 * last read claims the record (a device-memory atomic; the record itself is
 * written with plain stores, the code last). */
static __device__ __forceinline__ void smoe_dev_report_error(smoe_dev_report rep,
                                                             const smoe_dev_status *st)
{
    if (st->code == SMOE_DEV_OK || !rep.claim) return;
    if (atomicCAS(rep.claim, 0, 1) != 0) return;
    rep.rec->call = rep.call;
    rep.rec->st = *st;
    __threadfence_system();
    rep.rec->code = st->code;
    __threadfence_system();
}
#endif

/* ------------------------------------------------------------ routing*.cu */

/* What the routing kernels produce: routed pairs in token-major order
 * (DESIGN.md "assignments"), with their count on the device. */
typedef struct smoe_assign_dev {
    int32_t *expert;       /* (cap) */
    int32_t *token;        /* (cap) */
    float *score;          /* (cap) */
    int32_t *token_offset; /* (T+1) */
    int32_t *count;        /* (1) number of pairs, <= cap */
    uint16_t *expert16;    /* (cap) or NULL: the metadata copies `expert` here
                              in 16 bits (the saved block's assign_expert) */
    const int *abort;      /* the call's status code: GENERAL's copy and the
                              metadata's writers do nothing when it is set */
} smoe_assign_dev;

/* Scratch (bytes) the routing of mode `rounding` needs beyond the outputs
 * (routing_rounding.cu). */
size_t smoe_cuda_routing_scratch_bytes(const smoe_layer_desc *desc, int64_t T, int rounding);

/* Token choice (TOPK_SOFTMAX, SOFTMAX_TOPK, SIGMOID_TOPK with expert_bias
 * (E) or NULL), optionally followed by token rounding (rounding != 0,
 * desc->rounding != OFF), from fp32 logits (T, E). Bit-exact with
 * smoe_route_cpu_biased on the same logits (and bias). logits16: NULL, or
 * (T, E) bf16 that receives the logits rounded (the caller's bf16
 * router_logits; written by the token-choice kernel itself where E <= 256,
 * else by a pass of its own). (routing.cu) */
smoe_status smoe_cuda_route(const smoe_layer_desc *desc, int64_t T, int rounding,
                            const float *logits, const float *expert_bias, void *logits16,
                            smoe_assign_dev out, void *scratch, cudaStream_t stream);

/* smoe_cuda_route's parts in files of their own: SIGMOID_TOPK
 * (routing_sigmoid.cu) and token rounding (routing_rounding.cu). */
smoe_status smoe_cuda_route_sigmoid(const smoe_layer_desc *desc, const float *logits,
                                    const float *bias, int T, smoe_assign_dev out,
                                    cudaStream_t stream);
smoe_status smoe_cuda_route_rounding(const smoe_layer_desc *desc, int64_t T, const float *logits,
                                     smoe_assign_dev out, void *scratch, cudaStream_t stream);

/* GENERAL: checks the `pairs` triples (the first bad one goes into *status
 * and the report), then copies them into `out` unless one was bad
 * (routing_general.cu). */
smoe_status smoe_cuda_route_general(int64_t T, int64_t E, int64_t pairs,
                                    const int32_t *pair_token, const int32_t *pair_expert,
                                    const float *pair_score, smoe_assign_dev out,
                                    smoe_dev_status *status,
                                    smoe_dev_report report, cudaStream_t stream);

/* offsets (n+1) = exclusive scan of cnt (n), *total = the sum (one block;
 * n < 2^31; routing_rounding.cu). */
smoe_status smoe_cuda_exclusive_scan(const int32_t *cnt, int64_t n, int32_t *offsets,
                                     int32_t *total, cudaStream_t stream);

/* The report record of a CUDA layer (cuda_layer.cu), for kernels outside
 * its own calls that set a status code (the expert-parallel layer's). */
smoe_dev_report smoe_cuda_report(const smoe_layer *layer, int call);

/* ------------------------------------------------------------ status.cu */

/* Clears the status word (first thing a forward does). */
smoe_status smoe_cuda_status_reset(smoe_dev_status *status, cudaStream_t stream);

/* Backward's first kernel: the saved block's header against `want` (the
 * header this call's forward would have written), into *status (the whole
 * word) and the report; with consume, a header that passes is marked
 * consumed (desc.consume_saved: this call writes over the block); and,
 * when wr (E, d) is given, wr_nf (d): NaN for each column of wr that holds
 * a NaN or an infinity, 0 for the others.
 * The sparse router backward adds wr_nf to dx, which gives what the dense
 * product dlogits Wr gives (as PyTorch computes it): 0 * inf = NaN from the
 * experts a token did not pick. */
/* The device-side pointers of n cuBLAS calls (the dense router term of dX
 * in n token chunks, cuda_layer.cu): with slots set, the prologue writes
 * triple i: slots[3i] = a, slots[3i + 1] = b + i b_step (bytes) and
 * slots[3i + 2] = c where the saved block passes its check, else the sink
 * (a buffer of this call's workspace as large as c) if one is given, so
 * that a call the device refused writes nothing outside its workspace. */
typedef struct smoe_dxr_slots {
    void **slots;
    int n;
    void *a, *b, *c, *sink;
    size_t b_step;
} smoe_dxr_slots;

static inline smoe_dxr_slots smoe_dxr_slots_none(void)
{
    smoe_dxr_slots z = {NULL, 0, NULL, NULL, NULL, NULL, 0};
    return z;
}

smoe_status smoe_cuda_backward_prologue(smoe_saved_header *header, smoe_saved_header want,
                                        int consume, smoe_dev_status *status,
                                        smoe_dev_report report,
                                        const bf16 *wr, int64_t E, int64_t d, float *wr_nf,
                                        smoe_dxr_slots slots, cudaStream_t stream);


/* ------------------------------------------------------------ metadata.cu */

size_t smoe_cuda_metadata_scratch_bytes(int64_t E, int64_t cap);

/* From the assignments: expert_offset (E+1), assign_row (cap), row_token and
 * row_score (cap), and optionally expert_counts (E). Rows sorted by expert,
 * then by token (a stable counting sort over token-major assignments). */
smoe_status smoe_cuda_metadata(int64_t E, int64_t cap, smoe_assign_dev in,
                               int32_t *expert_offset, int32_t *assign_row,
                               int32_t *row_token, float *row_score,
                               int32_t *expert_counts, void *scratch, cudaStream_t stream);

/* The same, beside != 0 when another stream's kernel may hold SMs meanwhile
 * (the expert-parallel layer's exchanges): then never the cooperative
 * launch, which would wait for every SM. */
smoe_status smoe_cuda_metadata_beside(int64_t E, int64_t cap, smoe_assign_dev in,
                                      int32_t *expert_offset, int32_t *assign_row,
                                      int32_t *row_token, float *row_score,
                                      int32_t *expert_counts, void *scratch, int beside,
                                      cudaStream_t stream);

/* ------------------------------------------------------------ aggregate.cu */

/* Forward: out[t] = sum_a row_score[row_a] * y[row_a] over the token's
 * assignments (fp32 sums in assignment order; rows -1 skipped), bf16
 * out. The assignments of token t are [token_offset[t],
 * token_offset[t + 1]), or with k_uniform > 0 (every token has exactly
 * that many: top-K routing without token rounding) t k_uniform ..
 * (t + 1) k_uniform - 1, read without token_offset. The forward's last
 * kernel, so it also writes the saved block's header (header not NULL, a
 * training forward): `h` with status = the call's status code, also when
 * a failed check (abort) leaves the rest of the kernel undone. */
smoe_status smoe_cuda_aggregate_forward(int64_t T, int64_t d, const int32_t *token_offset,
                                        int k_uniform, const int32_t *assign_row,
                                        const float *row_score, const bf16 *y, bf16 *out,
                                        smoe_saved_header *header, smoe_saved_header h,
                                        const int *abort, cudaStream_t stream);

/* The expert-parallel forward's combine: out[t] = sum over token t's
 * entries e in [ent_offset[t], ent_offset[t + 1]) in order, p = pidx[e]
 * (-1 skipped): where dest[e] == self, the rows of slot p, sum_a
 * row_score[r_a] y[r_a] over a in [slot_offset[p], slot_offset[p + 1])
 * (r_a = assign_row[a], -1 skipped), else the partial sum part[p] (a
 * peer's, bf16); one fp32 sum, one rounding, bf16 out. Writes the header
 * as smoe_cuda_aggregate_forward does. */
smoe_status smoe_cuda_aggregate_combine(int64_t T, int64_t d, const int32_t *ent_offset,
                                        const int32_t *dest, int self, const int32_t *pidx,
                                        const int32_t *slot_offset, const int32_t *assign_row,
                                        const float *row_score, const bf16 *y, const bf16 *part,
                                        bf16 *out, smoe_saved_header *header,
                                        smoe_saved_header h, const int *abort,
                                        cudaStream_t stream);

/* Backward: dx[t] (op)= sum_a (dxt[row_a] + dl_a * wr[e_a]) (+ extra[t])
 * (+ col), into dtype BF16 or F32, overwritten or accumulated. extra (T, d)
 * fp32 may be NULL; assign_dl (cap) fp32 with assign_expert, wr (E, d) and
 * col (d, fp32: wr_nf of smoe_cuda_backward_prologue) may be NULL (no
 * per-pair router term; E is then not read). Token offsets or k_uniform as
 * in the forward (with k_uniform, assign_row, assign_dl and assign_expert
 * start at the first token's first assignment). */
smoe_status smoe_cuda_aggregate_backward(int64_t T, int64_t d, const int32_t *token_offset,
                                         int k_uniform, const int32_t *assign_row,
                                         const bf16 *dxt, const float *extra,
                                         const float *assign_dl, const uint16_t *assign_expert,
                                         const bf16 *wr, int64_t E, const float *col, void *dx,
                                         smoe_dtype dx_dtype, int accumulate, const int *abort,
                                         cudaStream_t stream);

/* ------------------------------------------------------------ router_backward.cu */

/* dlogits (T, E) of the routing mode from the per-row score gradients ds
 * (cap), plus dlogits_extra (may be NULL; fp32, or bf16 where extra_dt is
 * SMOE_DTYPE_BF16), written as a bf16 hi/lo split
 * (T, 2E): columns [0, E) hold bf16(g), [E, 2E) bf16(g - bf16(g)), so two
 * bf16 GEMMs with fp32 accumulation see g to about 16 bits. tc_scratch
 * (T, K) int32: token rounding's token-choice experts, recomputed. */
smoe_status smoe_cuda_router_dlogits(const smoe_layer_desc *desc, int64_t T, int rounding,
                                     const float *logits, const int32_t *token_offset,
                                     const uint16_t *assign_expert, const int32_t *assign_row,
                                     const float *row_score, const float *ds,
                                     const void *dlogits_extra, smoe_dtype extra_dt, bf16 *split,
                                     int32_t *tc_scratch, float *assign_dl, const int *abort,
                                     cudaStream_t stream);

/* Is dlogits sparse: nonzero only on each token's routed pairs
 * (TOPK_SOFTMAX, no rounding, K <= 32, no dlogits_extra)? Then
 * smoe_cuda_router_dlogits also writes each pair's entry into assign_dl
 * (cap, fp32) and the aggregation adds dl_a * Wr[e_a] itself, with no dense
 * dX GEMM. Otherwise assign_dl must be NULL. */
int smoe_cuda_router_sparse(const smoe_layer_desc *desc, int rounding, const void *dlogits_extra);

/* The router_logits output from the fp32 logits lg (n values): copied (F32)
 * or rounded to bf16 (BF16), on stream s. */
smoe_status smoe_cuda_logits_out(const float *lg, void *dst, smoe_dtype dt, int64_t n,
                                 cudaStream_t s);

/* wr2 (2E, d) = [wr; wr]: the B operand of dX += split * wr2; nothing
 * written when *abort is set (wr2 may lie in the saved block's dead H). */
smoe_status smoe_cuda_stack_twice(const bf16 *wr, int64_t E, int64_t d, bf16 *wr2,
                                  const int *abort, cudaStream_t stream);

/* dwr (E, d) (op)= dwr2[0:E] + dwr2[E:2E] (fp32 (2E, d)). */
smoe_status smoe_cuda_combine_halves(const float *dwr2, int64_t E, int64_t d, void *dwr,
                                     smoe_dtype dtype, int accumulate, const int *abort,
                                     cudaStream_t stream);

/* GENERAL: dpair_score[a] (op)= ds[assign_row[a]] for a < *count (the
 * assignments' number on the device, at most `pairs`). */
smoe_status smoe_cuda_pair_score_grad(int64_t pairs, const int32_t *count,
                                      const int32_t *assign_row, const float *ds, float *dscore,
                                      int accumulate, const int *abort, cudaStream_t stream);

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
                                    const int *abort, cudaStream_t stream);

#endif /* SMOE_CUDA_COMMON_H */
