/*
 * cuda_layer_state.h -- the CUDA backend's layer state (cuda_state: made at
 * create in cuda_layer_init.cu) and what the layer's files share: the calls
 * (cuda_layer.cu), create (cuda_layer_init.cu), the router's dense GEMMs
 * (cuda_router.cu) and the reading of the device status (status.cu). For
 * those files, after cuda_common.h.
 */
#ifndef SMOE_CUDA_LAYER_STATE_H
#define SMOE_CUDA_LAYER_STATE_H

#include <pthread.h>

#include "cuda/cuda_common.h"

/* cuBLAS's scratch, in each call's workspace */
#define CUBLAS_WS_BYTES ((size_t)8 << 20)

/* the six GEMMs, gemm.h's indices */
enum {
    OP_UP = SMOE_GEMM_UP,
    OP_DOWN = SMOE_GEMM_DOWN,
    OP_DH = SMOE_GEMM_DH,
    OP_DW2 = SMOE_GEMM_DW2,
    OP_DXT = SMOE_GEMM_DXT,
    OP_DW1 = SMOE_GEMM_DW1,
    OP_COUNT = SMOE_GEMM_COUNT
};

/* A debugging aid, off unless the environment has SMOE_CUDA_TIMING=1 when
 * the layer is created: CUDA events between the stages of every call, the
 * call then waits for its last event (so: not for graph capture or
 * production), and the mean time of each stage is printed to stderr when
 * the layer is freed. The benchmark's --stages uses it. */
#define MAX_STAGES 16

typedef struct stage_timer {
    cudaEvent_t ev[MAX_STAGES + 1];
    int n;
    const char *name[2][MAX_STAGES];
    double ms[2][MAX_STAGES];
    int nst[2];
    long calls[2];
} stage_timer;

typedef struct cuda_state {
    int device;
    int sm; /* major * 10 + minor */
    int num_sms;
    cublasHandle_t cublas;
    pthread_mutex_t cublas_lock; /* held while the handle is bound and used */
    const smoe_gemm_ops *tab90; /* NULL: portable only */
    int use90[OP_COUNT];        /* this op runs the Hopper kernel (fixed at create) */
    smoe_gemm_plan plan;        /* each op's tile row in its family's table (create) */
    int *claim;                 /* device memory: the report's claim word */
    smoe_dev_mapped *rec_host;  /* mapped page-locked record, host address */
    smoe_dev_mapped *rec_dev;   /* ... its device address */
    struct stage_timer *timer;  /* SMOE_CUDA_TIMING=1 only */
} cuda_state;

/* Makes the layer's device current for the call and restores the caller's
 * (cuda_layer.cu). */
typedef struct dev_guard {
    int prev, changed;
} dev_guard;

smoe_status smoe_cuda_dev_enter(const cuda_state *st, dev_guard *g);
void smoe_cuda_dev_leave(const dev_guard *g);

/* The layer's GEMM problem for `cap` rows, no buffers (cuda_layer.cu). */
smoe_gemm_problem smoe_cuda_problem_make(const smoe_layer *layer, int64_t cap);

/* The backend's operations (smoe_internal.h, smoe_backend_ops): the
 * workspace size and the calls (cuda_layer.cu), the device status
 * (status.cu); and the stage timer's means, printed when the layer is
 * freed (cuda_layer.cu). */
size_t smoe_cuda_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap, int call);
size_t smoe_cuda_backward_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap,
                                          const smoe_backward_args *args);
int smoe_cuda_drouter_slot(const smoe_layer *layer, const smoe_saved_layout *l, size_t *offset,
                           size_t *bytes);
smoe_status smoe_cuda_forward(smoe_layer *layer, const smoe_forward_args *args,
                              const smoe_saved_layout *sl, void *saved, void *workspace,
                              void *stream);
smoe_status smoe_cuda_backward(smoe_layer *layer, const smoe_backward_args *args,
                               const smoe_saved_layout *sl, void *saved, void *workspace,
                               void *stream);
smoe_status smoe_cuda_device_status(smoe_layer *layer, void *stream, int wait);
void smoe_cuda_timer_report(const smoe_layer *layer, stage_timer *tm);

/* C (m x n, col-major, ldc) = op(A) op(B) on cuBLAS, bf16 in, fp32 out
 * (cuda_router.cu says more). */
smoe_status smoe_cuda_gemm_bf16_f32_dev(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                        cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                        int64_t n, int64_t k, const void *const *A, int64_t lda,
                                        const void *const *B, int64_t ldb, void *const *C,
                                        int64_t ldc);
smoe_status smoe_cuda_gemm_bf16_f32(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                    cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                    int64_t n, int64_t k, const bf16 *A, int64_t lda,
                                    const bf16 *B, int64_t ldb, float *C, int64_t ldc);

#endif /* SMOE_CUDA_LAYER_STATE_H */
