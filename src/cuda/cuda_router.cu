/*
 * cuda_router.cu -- the router's dense GEMMs on cuBLAS (the forward's
 * logits, the backward's dWr and dXr), through the layer's one cuBLAS
 * handle, bound to each call's stream and workspace under a mutex; and the
 * router of a whole layer without its experts (smoe_cuda_router_forward /
 * _backward, cuda_layer.h), the expert-parallel layer's source side.
 */
#include <pthread.h>
#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"
#include "cuda/cuda_layer_state.h"

/* ------------------------------------------------------------ cuBLAS */

/* The layer's cuBLAS handle bound to this call (under its mutex): its
 * stream, and after SetStream (which resets it) cuBLAS's scratch from the
 * call's workspace, so it never allocates (graph capture) and two calls in
 * flight never share it. */
static smoe_status cublas_bind_locked(cuda_state *st, void *cublas_ws, cudaStream_t s)
{
    SMOE_CUBLAS_CHECK(cublasSetStream(st->cublas, s));
    SMOE_CUBLAS_CHECK(cublasSetWorkspace(st->cublas, cublas_ws, cublas_ws ? CUBLAS_WS_BYTES : 0));
    return SMOE_SUCCESS;
}

/* The cuBLAS part of smoe_cuda_gemm_bf16_f32, with the handle bound to this call. */
static smoe_status gemm_bf16_f32_locked(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                        cublasOperation_t ta,
                                        cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                                        const bf16 *A, int64_t lda, const bf16 *B, int64_t ldb,
                                        float *C, int64_t ldc)
{
    const float one = 1.0f, zero = 0.0f;
    SMOE_FORWARD_IF_ERROR(cublas_bind_locked(st, cublas_ws, s));
    SMOE_CUBLAS_CHECK(cublasGemmEx(st->cublas, ta, tb, (int)m, (int)n, (int)k, &one, A,
                                   CUDA_R_16BF, (int)lda, B, CUDA_R_16BF, (int)ldb, &zero, C,
                                   CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    return SMOE_SUCCESS;
}

/* The same with A, B and C read from device memory when the GEMM runs
 * (cublasGemmBatchedEx with one matrix). */
static smoe_status gemm_bf16_f32_dev_locked(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                            cublasOperation_t ta, cublasOperation_t tb,
                                            int64_t m, int64_t n, int64_t k,
                                            const void *const *A, int64_t lda,
                                            const void *const *B, int64_t ldb, void *const *C,
                                            int64_t ldc)
{
    const float one = 1.0f, zero = 0.0f;
    SMOE_FORWARD_IF_ERROR(cublas_bind_locked(st, cublas_ws, s));
    SMOE_CUBLAS_CHECK(cublasGemmBatchedEx(st->cublas, ta, tb, (int)m, (int)n, (int)k, &one, A,
                                          CUDA_R_16BF, (int)lda, B, CUDA_R_16BF, (int)ldb, &zero,
                                          C, CUDA_R_32F, (int)ldc, 1, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT));
    return SMOE_SUCCESS;
}

/* C (m x n, col-major, ldc) = op(A) op(B); bf16 A, B; fp32 C; enqueued on s
 * with cuBLAS's scratch in the call's workspace (CUBLAS_WS_BYTES at
 * cublas_ws). The layer's one cuBLAS handle is bound and used under its
 * mutex, so calls from several threads do not race on it. */
smoe_status smoe_cuda_gemm_bf16_f32(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                    cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                    int64_t n, int64_t k, const bf16 *A, int64_t lda,
                                    const bf16 *B, int64_t ldb, float *C, int64_t ldc)
{
    pthread_mutex_lock(&st->cublas_lock);
    smoe_status r = gemm_bf16_f32_locked(st, cublas_ws, s, ta, tb, m, n, k, A, lda, B, ldb, C, ldc);
    pthread_mutex_unlock(&st->cublas_lock);
    return r;
}

/* The same with A[0], B[0], C[0] device pointers that a kernel before it
 * on s writes (smoe_dxr_slots), read when the GEMM runs. cublas_ws NULL:
 * cuBLAS runs with no scratch. */
smoe_status smoe_cuda_gemm_bf16_f32_dev(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                        cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                        int64_t n, int64_t k, const void *const *A, int64_t lda,
                                        const void *const *B, int64_t ldb, void *const *C,
                                        int64_t ldc)
{
    pthread_mutex_lock(&st->cublas_lock);
    smoe_status r =
        gemm_bf16_f32_dev_locked(st, cublas_ws, s, ta, tb, m, n, k, A, lda, B, ldb, C, ldc);
    pthread_mutex_unlock(&st->cublas_lock);
    return r;
}

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

/* ------------------------------------------------------------ the router alone */

/* The expert-parallel layer's source side (cuda_layer.h): the router of a
 * whole-layer description (E experts) without its experts. Workspace: */
typedef struct router_ws {
    size_t cublas, route, split, wr2, dwr2, tc, total;
} router_ws;

static void router_ws_make(const smoe_layer *layer, int64_t T, router_ws *w)
{
    const smoe_layer_desc *d = &layer->desc;
    const size_t t = (size_t)(T > 0 ? T : 1), E = (size_t)d->E, dd = (size_t)d->d;
    size_t o = 0;
    w->cublas = o; o += CUBLAS_WS_BYTES;
    w->route = o; o += al(smoe_cuda_routing_scratch_bytes(d, T, 0));
    w->split = o; o += al(t * 2 * E * 2);
    w->wr2 = o; o += al(2 * E * dd * 2);
    w->dwr2 = o; o += al(2 * E * dd * 4);
    w->tc = o; o += al(t * (size_t)(d->K > 0 ? d->K : 1) * 4);
    w->total = o;
}

size_t smoe_cuda_router_ws_bytes(const smoe_layer *layer, int64_t T)
{
    router_ws w;
    router_ws_make(layer, T, &w);
    return w.total;
}

smoe_status smoe_cuda_router_forward(smoe_layer *layer, int64_t T, const void *x,
                                     const void *router_w, const float *expert_bias,
                                     float *logits, smoe_assign_dev as, void *workspace,
                                     void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    cudaStream_t s = (cudaStream_t)stream;
    router_ws w;
    router_ws_make(layer, T, &w);
    char *ws = (char *)workspace;
    if (T == 0) return SMOE_SUCCESS;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_dev_enter(st, &g));
    smoe_status r = smoe_cuda_gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_T, CUBLAS_OP_N, d->E,
                                            T, d->d, (const bf16 *)router_w, d->d,
                                            (const bf16 *)x, d->d, logits, d->E);
    if (r == SMOE_SUCCESS)
        r = smoe_cuda_route(d, T, 0, logits, expert_bias, NULL, as, ws + w.route, s);
    smoe_cuda_dev_leave(&g);
    return r;
}

smoe_status smoe_cuda_router_backward(smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                                      const float *ds, const void *dlogits_extra,
                                      smoe_dtype extra_dt, const void *x, const void *router_w,
                                      const smoe_grad *drouter_w, float *dxr, void *workspace,
                                      const int *abort, void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    cudaStream_t s = (cudaStream_t)stream;
    router_ws w;
    router_ws_make(layer, T, &w);
    char *ws = (char *)workspace;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_dev_enter(st, &g));
    const int64_t E2 = 2 * d->E;
    bf16 *split = (bf16 *)(ws + w.split);
    smoe_status r = SMOE_SUCCESS;
    if (T > 0)
        r = smoe_cuda_router_dlogits(d, T, 0, v->logits, v->token_offset, v->assign_expert,
                                     v->assign_row, v->row_score, ds, dlogits_extra, extra_dt,
                                     split, (int32_t *)(ws + w.tc), NULL, abort, s);
    if (r == SMOE_SUCCESS && drouter_w->ptr) {
        float *dwr2 = (float *)(ws + w.dwr2);
        if (T > 0) {
            r = smoe_cuda_gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_T, d->d,
                                        E2, T, (const bf16 *)x, d->d, split, E2, dwr2, d->d);
        } else {
            const cudaError_t e = cudaMemsetAsync(dwr2, 0, (size_t)E2 * (size_t)d->d * 4, s);
            if (e != cudaSuccess)
                r = smoe_fail(SMOE_ERROR_BACKEND, "router backward: %s", cudaGetErrorString(e));
        }
        if (r == SMOE_SUCCESS)
            r = smoe_cuda_combine_halves(dwr2, d->E, d->d, drouter_w->ptr, drouter_w->dtype,
                                         drouter_w->accumulate, abort, s);
    }
    if (r == SMOE_SUCCESS && dxr && T > 0) {
        bf16 *wr2 = (bf16 *)(ws + w.wr2);
        r = smoe_cuda_stack_twice((const bf16 *)router_w, d->E, d->d, wr2, abort, s);
        if (r == SMOE_SUCCESS)
            r = smoe_cuda_gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_N, d->d,
                                        T, E2, wr2, d->d, split, E2, dxr, d->d);
    }
    smoe_cuda_dev_leave(&g);
    return r;
}
