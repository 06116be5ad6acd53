/*
 * cuda_layer_init.cu -- the CUDA backend's layer at create (SMOE_BACKEND_CUDA
 * and SMOE_BACKEND_SM90) and its destruction: the device checks, the cuBLAS
 * handle and the report record (on the layer's device), each GEMM's kernel
 * chosen once (plans_make: the Hopper table's row where it has one for the
 * layer's shape, the portable table's otherwise), the path name, the stage
 * timer when SMOE_CUDA_TIMING=1 (cuda_layer.cu's top comment), and the
 * operations table the calls go through.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"
#include "cuda/cuda_layer_state.h"

/* ------------------------------------------------------------ kernel choice */

static const char *act_name(smoe_activation a)
{
    switch (a) {
    case SMOE_ACT_SWIGLU: return "swiglu";
    case SMOE_ACT_GEGLU: return "geglu";
    case SMOE_ACT_REGLU: return "reglu";
    case SMOE_ACT_RELU2: return "relu2";
    case SMOE_ACT_RELU: return "relu";
    case SMOE_ACT_SILU: return "silu";
    case SMOE_ACT_GELU: return "gelu";
    }
    return "?";
}

/* The path name from which kernels each op runs. */
static void path_name_make(smoe_layer *layer)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_gemm_ops *p = &smoe_gemm_ops_sm80, *h = st->tab90;
    char gemm[96];
    if (!h) {
        snprintf(gemm, sizeof gemm, "cuda: gemm %s (sm%d)", p->name, st->sm);
    } else {
        char a[64] = "", b[64] = "";
        for (int i = 0; i < OP_COUNT; ++i) {
            char *dst = st->use90[i] ? a : b;
            if (dst[0]) strncat(dst, ",", 63 - strlen(dst));
            strncat(dst, smoe_gemm_name(i), 63 - strlen(dst));
        }
        if (!b[0]) snprintf(gemm, sizeof gemm, "sm90: all %s", h->name);
        else if (!a[0]) snprintf(gemm, sizeof gemm, "sm90: all %s", p->name);
        else snprintf(gemm, sizeof gemm, "sm90: %s %s; %s %s", a, h->name, b, p->name);
    }
    snprintf(layer->path_name, sizeof layer->path_name, "%s [%s]", gemm,
             act_name(layer->desc.activation));
}

/* Each op's kernel, decided once here: the Hopper table's row where it has
 * one for this shape (SM90 backend on an sm_90 device), else the portable
 * table's; every call then runs exactly these rows (the launchers never
 * choose). A shape neither table runs is refused here. */
static smoe_status plans_make(smoe_layer *layer, const char *fn)
{
    cuda_state *st = (cuda_state *)layer->state;
    smoe_gemm_problem p = smoe_cuda_problem_make(layer, 0);
    p.plan = NULL;
    smoe_gemm_plan p80, p90;
    smoe_gemm_ops_sm80.plan(&p, &p80);
    for (int i = 0; i < OP_COUNT; ++i) p90.row[i] = -1;
    if (st->tab90) st->tab90->plan(&p, &p90);
    for (int i = 0; i < OP_COUNT; ++i) {
        st->use90[i] = p90.row[i] >= 0;
        st->plan.row[i] = st->use90[i] ? p90.row[i] : p80.row[i];
        SMOE_RETURN_ERROR_IF(st->plan.row[i] < 0, SMOE_ERROR_UNSUPPORTED,
                             "%s: no %s GEMM kernel fits this device at d = %lld, n = %lld", fn,
                             smoe_gemm_name(i), (long long)layer->desc.d, (long long)layer->desc.n);
    }
    return SMOE_SUCCESS;
}

/* cuda_layer.h: a test's or the benchmark's choice of one GEMM's row. */
smoe_status smoe_cuda_layer_set_row(smoe_layer *layer, const char *gemm, const char *name)
{
    cuda_state *st = (cuda_state *)layer->state;
    const int g = smoe_gemm_find(gemm, strlen(gemm));
    SMOE_RETURN_ERROR_IF(g < 0, SMOE_ERROR_INVALID_VALUE, "set_row: no GEMM named %s", gemm);
    const smoe_gemm_ops *ops = st->use90[g] ? st->tab90 : &smoe_gemm_ops_sm80;
    SMOE_RETURN_ERROR_IF(!ops->row_name, SMOE_ERROR_UNSUPPORTED,
                         "set_row: the %s table has no named rows", ops->name);
    const int row = smoe_gemm_row_find(ops, g, name);
    SMOE_RETURN_ERROR_IF(row < 0, SMOE_ERROR_INVALID_VALUE, "set_row: %s has no row \"%s\" (%s)",
                         gemm, name, ops->name);
    smoe_gemm_problem p = smoe_cuda_problem_make(layer, 0);
    if (ops->row_fits && !ops->row_fits(&p, g, row)) return SMOE_ERROR_UNSUPPORTED;
    st->plan.row[g] = row;
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ init */

static void cuda_destroy(smoe_layer *layer)
{
    cuda_state *st = (cuda_state *)layer->state;
    if (!st) return;
    if (st->timer) {
        smoe_cuda_timer_report(layer, st->timer);
        for (int i = 0; i <= MAX_STAGES; ++i) cudaEventDestroy(st->timer->ev[i]);
        free(st->timer);
    }
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != st->device) cudaSetDevice(st->device);
    if (st->cublas) cublasDestroy(st->cublas);
    if (st->claim) cudaFree(st->claim);
    if (st->rec_host) cudaFreeHost(st->rec_host);
    if (prev >= 0 && prev != st->device) cudaSetDevice(prev);
    pthread_mutex_destroy(&st->cublas_lock);
    free(st);
    layer->state = NULL;
}

static const smoe_backend_ops cuda_ops = {
    smoe_cuda_workspace_bytes, smoe_cuda_forward, smoe_cuda_backward, cuda_destroy,
    smoe_cuda_device_status, smoe_cuda_backward_workspace_bytes, smoe_cuda_drouter_slot,
};

/* The cuBLAS handle and the report record, on the layer's device (current). */
static smoe_status state_make(cuda_state *st, const char *fn)
{
    cublasStatus_t cs = cublasCreate(&st->cublas);
    if (cs == CUBLAS_STATUS_SUCCESS) cs = cublasSetMathMode(st->cublas, CUBLAS_DEFAULT_MATH);
    SMOE_RETURN_ERROR_IF(cs != CUBLAS_STATUS_SUCCESS, SMOE_ERROR_BACKEND,
                         "%s: cublasCreate: cuBLAS status %d (%s)", fn, (int)cs,
                         cublasGetStatusString(cs));
    SMOE_CUDA_CHECK(cudaMalloc((void **)&st->claim, sizeof(int)));
    SMOE_CUDA_CHECK(cudaMemset(st->claim, 0, sizeof(int)));
    SMOE_CUDA_CHECK(cudaHostAlloc((void **)&st->rec_host, sizeof(smoe_dev_mapped),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
    memset((void *)st->rec_host, 0, sizeof(smoe_dev_mapped));
    SMOE_CUDA_CHECK(cudaHostGetDevicePointer((void **)&st->rec_dev, st->rec_host, 0));
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_layer_init(smoe_layer *layer, int want_sm90)
{
    const smoe_layer_desc *d = &layer->desc;
    const char *fn = want_sm90 ? "backend SM90" : "backend CUDA";
    SMOE_RETURN_ERROR_IF(d->dtype != SMOE_DTYPE_BF16, SMOE_ERROR_UNSUPPORTED,
                         "%s: desc.dtype = %s, but the CUDA backends store bf16 only (use "
                         "SMOE_DTYPE_BF16, or SMOE_BACKEND_CPU for F32/F64)",
                         fn, d->dtype == SMOE_DTYPE_F32 ? "F32" : "F64");
    SMOE_RETURN_ERROR_IF(d->d % 8 != 0 || d->n % 8 != 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: d = %lld and n = %lld must be multiples of 8 (16-byte rows)", fn,
                         (long long)d->d, (long long)d->n);
    SMOE_RETURN_ERROR_IF(d->E > 4096, SMOE_ERROR_UNSUPPORTED,
                         "%s: E = %lld, at most 4096 experts on the GPU", fn, (long long)d->E);
    /* the portable GEMMs form row strides in int (grouped_gemm.cu) */
    SMOE_RETURN_ERROR_IF(d->d > ((int64_t)1 << 28) || layer->h_cols > ((int64_t)1 << 28),
                         SMOE_ERROR_UNSUPPORTED,
                         "%s: d = %lld, h_cols = %lld: at most 2^28 on the GPU", fn,
                         (long long)d->d, (long long)layer->h_cols);

    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        cudaGetLastError();
        return smoe_fail(SMOE_ERROR_NO_DEVICE, "%s: no CUDA device (%s)", fn,
                         ce != cudaSuccess ? cudaGetErrorString(ce) : "device count 0");
    }
    SMOE_RETURN_ERROR_IF(d->device >= count, SMOE_ERROR_NO_DEVICE,
                         "%s: desc.device = %d, but %d CUDA device(s) present", fn, d->device,
                         count);
    cudaDeviceProp prop;
    SMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, d->device));
    const int sm = prop.major * 10 + prop.minor;
    SMOE_RETURN_ERROR_IF(sm < 80, SMOE_ERROR_NO_DEVICE,
                         "%s: device %d (%s) is sm_%d; the CUDA kernels need sm_80 or later", fn,
                         d->device, prop.name, sm);
#ifdef SMOE_WITH_SM90
    SMOE_RETURN_ERROR_IF(want_sm90 && sm != 90, SMOE_ERROR_NO_DEVICE,
                         "%s: device %d (%s) is sm_%d; the Hopper kernels need sm_90", fn,
                         d->device, prop.name, sm);
#else
    SMOE_RETURN_ERROR_IF(want_sm90, SMOE_ERROR_NO_DEVICE,
                         "%s: smoe was built without the sm_90a kernels", fn);
#endif

    cuda_state *st = (cuda_state *)calloc(1, sizeof *st);
    SMOE_RETURN_ERROR_IF(!st, SMOE_ERROR_OUT_OF_MEMORY, "%s: calloc failed", fn);
    st->device = d->device;
    st->sm = sm;
    st->num_sms = prop.multiProcessorCount;
    pthread_mutex_init(&st->cublas_lock, NULL);
#ifdef SMOE_WITH_SM90
    st->tab90 = want_sm90 ? &smoe_gemm_ops_sm90 : NULL;
#endif
    layer->state = st;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaError_t se = cudaSetDevice(d->device);
    smoe_status r = se == cudaSuccess
                        ? state_make(st, fn)
                        : smoe_fail(SMOE_ERROR_BACKEND, "%s: cudaSetDevice(%d): %s", fn,
                                    d->device, cudaGetErrorString(se));
    if (prev != d->device) cudaSetDevice(prev);
    if (r == SMOE_SUCCESS) r = plans_make(layer, fn);
    if (r != SMOE_SUCCESS) {
        cuda_destroy(layer);
        return r;
    }
    layer->ops = &cuda_ops;
    layer->vec_align = 16; /* the kernels load and store 16-byte vectors */
    const char *tenv = getenv("SMOE_CUDA_TIMING");
    if (tenv && tenv[0] == '1') {
        st->timer = (stage_timer *)calloc(1, sizeof *st->timer);
        if (st->timer) {
            cudaGetDevice(&prev);
            if (prev != d->device) cudaSetDevice(d->device);
            for (int i = 0; i <= MAX_STAGES; ++i) cudaEventCreate(&st->timer->ev[i]);
            if (prev != d->device) cudaSetDevice(prev);
        }
    }
    path_name_make(layer);
    return SMOE_SUCCESS;
}
