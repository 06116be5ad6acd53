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

#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer_state.h"

static __device__ int saved_check(smoe_saved_header *__restrict__ h,
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
    return s.code;
}

/* Thread (0, 0): the header. Thread i of the grid, i < d: column i of the
 * router weight (E, d): wr_nf[i] = NaN if one of its E values is not
 * finite, else 0. */
__global__ void k_backward_prologue(smoe_saved_header *__restrict__ h,
                                    smoe_saved_header want, int consume, smoe_dev_status *st,
                                    smoe_dev_report rep, const bf16 *__restrict__ wr, int E,
                                    int64_t d, float *wr_nf, smoe_dxr_slots sl)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) {
        const int code = saved_check(h, want, consume != 0, st, rep);
        for (int k = 0; sl.slots && k < sl.n; k++) {
            sl.slots[3 * k] = sl.a;
            sl.slots[3 * k + 1] = (char *)sl.b + (size_t)k * sl.b_step;
            sl.slots[3 * k + 2] = code != SMOE_DEV_OK && sl.sink ? sl.sink : sl.c;
        }
    }
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
                                        smoe_dxr_slots slots, cudaStream_t stream)
{
    const int threads = 256;
    const unsigned blocks = wr ? (unsigned)smoe_cdiv(d, threads) : 1;
    k_backward_prologue<<<blocks, threads, 0, stream>>>(header, want, consume, status, report, wr,
                                                        (int)E, d, wr_nf, slots);
    SMOE_CUDA_LAUNCH_CHECK("k_backward_prologue");
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_status_reset(smoe_dev_status *status, cudaStream_t stream)
{
    k_status_reset<<<1, 1, 0, stream>>>(status);
    SMOE_CUDA_LAUNCH_CHECK("k_status_reset");
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ device status */

/* The message of a recorded failure, as the CPU backend words the same
 * failure (validate.c's check_triples, smoe.c's smoe_saved_header_check). */
static smoe_status device_failure(const smoe_layer *layer, int call, const smoe_dev_status *h)
{
    const char *fwd = "smoe_layer_forward (GENERAL triples, checked on the device)";
    const char *bwd = "smoe_layer_backward (saved block, checked on the device)";
    const long long v = h->value, v2 = h->value2;
    switch (h->code) {
    case SMOE_DEV_BAD_TOKEN:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_token[%d] = %lld, must be in [0, T = %lld); nothing written",
                         fwd, h->first_bad, v, v2);
    case SMOE_DEV_BAD_EXPERT:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_expert[%d] = %lld, must be in [0, E = %lld); nothing written",
                         fwd, h->first_bad, v, (long long)layer->desc.E);
    case SMOE_DEV_UNSORTED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_token[%d] = %lld < pair_token[%d] = %lld: triples must be "
                         "sorted by token; nothing written",
                         fwd, h->first_bad, v, h->first_bad - 1, v2);
    case SMOE_DEV_DUPLICATE:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: (token %lld, expert %lld) is given twice (again at pair %d); "
                         "nothing written",
                         fwd, v, v2, h->first_bad);
    case SMOE_DEV_BAD_SCORE: {
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, 4);
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_score[%d] = %g is not finite; nothing written", fwd,
                         h->first_bad, (double)f);
    }
    case SMOE_DEV_SAVED_INVALID:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was not filled by a training forward (its header "
                         "is not valid); nothing written",
                         bwd);
    case SMOE_DEV_SAVED_LAYER:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by another layer (id %016llx, this "
                         "layer is %016llx); nothing written",
                         bwd, (unsigned long long)v, (unsigned long long)v2);
    case SMOE_DEV_SAVED_T:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with T = %lld, this "
                         "backward has T = %lld; nothing written",
                         bwd, v, v2);
    case SMOE_DEV_SAVED_PAIRS:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with pairs = %lld, this "
                         "backward has pairs = %lld; nothing written",
                         bwd, v, v2);
    case SMOE_DEV_EP_OVERFLOW:
        return smoe_fail(SMOE_ERROR_INVALID_SIZE,
                         "smoe_ep_layer_forward (checked on the device): %lld rows for rank %d, "
                         "more than capacity = %lld; nothing written",
                         v, h->first_bad, v2);
    case SMOE_DEV_EP_ROWS:
        return smoe_fail(SMOE_ERROR_INVALID_SIZE,
                         "smoe_ep_layer_forward (checked on the device): %lld (row, expert) "
                         "pairs on this rank, more than expert_rows = %lld; nothing written",
                         v, v2);
    case SMOE_DEV_EP_PEER:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "smoe_ep_layer (checked on the device): rank %lld's call failed (its "
                         "code %lld; read its device status); nothing written",
                         v, v2);
    case SMOE_DEV_SAVED_CONSUMED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was consumed by an earlier backward "
                         "(desc.consume_saved = 1 writes dH over its H); run a training forward "
                         "again; nothing written",
                         bwd);
    case SMOE_DEV_SAVED_FAILED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the forward that filled the saved block failed a device-side "
                         "check (code %lld); nothing written",
                         bwd, v);
    default:
        return smoe_fail(SMOE_ERROR_INTERNAL, "smoe_layer_device_status: %s recorded code %d",
                         call ? "backward" : "forward", h->code);
    }
}

smoe_status smoe_cuda_device_status(smoe_layer *layer, void *stream, int wait)
{
    cuda_state *st = (cuda_state *)layer->state;
    if (wait) {
        dev_guard g;
        SMOE_FORWARD_IF_ERROR(smoe_cuda_dev_enter(st, &g));
        cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
        smoe_cuda_dev_leave(&g);
        SMOE_RETURN_ERROR_IF(e != cudaSuccess, SMOE_ERROR_BACKEND,
                             "smoe_layer_device_status: %s", cudaGetErrorString(e));
    }
    volatile smoe_dev_mapped *rec = st->rec_host;
    const int code = rec->code;
    if (code == SMOE_DEV_OK) return SMOE_SUCCESS;
    __sync_synchronize(); /* the record's fields were written before its code */
    smoe_dev_status h;
    h.first_bad = rec->st.first_bad;
    h.code = code;
    h.value = rec->st.value;
    h.value2 = rec->st.value2;
    const int call = rec->call;
    /* read: clear the record and free the claim for the next failure */
    rec->code = SMOE_DEV_OK;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_dev_enter(st, &g));
    cudaError_t e = cudaMemsetAsync(st->claim, 0, sizeof(int), (cudaStream_t)stream);
    smoe_cuda_dev_leave(&g);
    SMOE_RETURN_ERROR_IF(e != cudaSuccess, SMOE_ERROR_BACKEND,
                         "smoe_layer_device_status: clearing the record: %s",
                         cudaGetErrorString(e));
    return device_failure(layer, call, &h);
}
