/*
 * status.cu -- the call's status word and the saved block's header on the
 * device (cuda_common.h, "device status"; smoe_internal.h has the header).
 * A forward's first kernel clears the status word (k_status_reset); a
 * check that fails writes its code there, and every later kernel of the
 * call takes that code as `abort` and does nothing.
 *
 * The saved block's header: the forward's last kernel (the aggregation,
 * aggregate.cu) writes it, the backward's first kernel (here) checks it.
 * The check is the host's smoe_saved_header_check, field by field in the
 * same order, so both backends refuse the same blocks with the same reason.
 *
 * The backward's first kernel also finds the router weight's columns that
 * hold a NaN or an infinity, for the sparse router backward (see
 * smoe_cuda_backward_prologue).
 */
#include <limits.h>

#include "cuda/cuda_common.h"

static __device__ void saved_check(smoe_saved_header *__restrict__ h,
                                   const smoe_saved_header &want, bool consume,
                                   smoe_dev_status *st, smoe_dev_report rep)
{
    const smoe_saved_header got = *h;
    smoe_dev_status s;
    s.first_bad = INT_MAX;
    s.code = SMOE_DEV_OK;
    s.value = 0;
    s.value2 = 0;
    if (got.magic != SMOE_SAVED_MAGIC || got.check != smoe_saved_header_hash(&got)) {
        s.code = SMOE_DEV_SAVED_INVALID;
    } else if (got.layer_id != want.layer_id) {
        s.code = SMOE_DEV_SAVED_LAYER;
        s.value = (long long)got.layer_id;
        s.value2 = (long long)want.layer_id;
    } else if (got.T != want.T) {
        s.code = SMOE_DEV_SAVED_T;
        s.value = got.T;
        s.value2 = want.T;
    } else if (got.pairs != want.pairs) {
        s.code = SMOE_DEV_SAVED_PAIRS;
        s.value = got.pairs;
        s.value2 = want.pairs;
    } else if (got.status != 0) {
        s.code = SMOE_DEV_SAVED_FAILED;
        s.value = got.status;
    } else if (got.consumed != 0) {
        s.code = SMOE_DEV_SAVED_CONSUMED;
    }
    /* a passing block is consumed by this call (every later kernel runs) */
    if (s.code == SMOE_DEV_OK && consume) h->consumed = 1;
    *st = s;
    smoe_dev_report_error(rep, st);
}

/* Thread (0, 0): the header. Thread i of the grid, i < d: column i of the
 * router weight (E, d): wr_nf[i] = NaN if one of its E values is not
 * finite, else 0. */
__global__ void k_backward_prologue(smoe_saved_header *__restrict__ h,
                                    smoe_saved_header want, int consume, smoe_dev_status *st,
                                    smoe_dev_report rep, const bf16 *__restrict__ wr, int E,
                                    int64_t d, float *wr_nf)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) saved_check(h, want, consume != 0, st, rep);
    if (!wr || i >= d) return;
    bool finite = true;
    for (int e = 0; e < E; ++e) finite &= isfinite(__bfloat162float(wr[(int64_t)e * d + i]));
    wr_nf[i] = finite ? 0.0f : __int_as_float(0x7fc00000);
}

/* The call's status word cleared: a forward's first kernel. */
__global__ void k_status_reset(smoe_dev_status *st)
{
    st->first_bad = INT_MAX;
    st->code = SMOE_DEV_OK;
    st->value = 0;
    st->value2 = 0;
}

smoe_status smoe_cuda_backward_prologue(smoe_saved_header *header, smoe_saved_header want,
                                        int consume, smoe_dev_status *status,
                                        smoe_dev_report report,
                                        const bf16 *wr, int64_t E, int64_t d, float *wr_nf,
                                        cudaStream_t stream)
{
    const int threads = 256;
    const unsigned blocks = wr ? (unsigned)smoe_cdiv(d, threads) : 1;
    k_backward_prologue<<<blocks, threads, 0, stream>>>(header, want, consume, status, report, wr,
                                                        (int)E, d, wr_nf);
    SMOE_CUDA_LAUNCH_CHECK("k_backward_prologue");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_status_reset(smoe_dev_status *status, cudaStream_t stream)
{
    k_status_reset<<<1, 1, 0, stream>>>(status);
    SMOE_CUDA_LAUNCH_CHECK("k_status_reset");
    return SMOE_SUCCESS;
}
