/*
 * test_bad_input_gpu.c -- the bad-input cases of tests/bad_input.h on the
 * GPU: the CUDA backend (portable kernels) and, on an sm_90 device, the
 * SM90 backend, with every buffer in device memory. Host-checked cases are
 * refused by the call; device-checked ones (GENERAL triples, the saved
 * block's header) by smoe_layer_device_status, with every output left as it
 * was (the saved block's header excepted, which records the failure).
 * A machine without a GPU skips (exit 0, says so).
 */
#include "bad_input.h"

#include "testutil_cuda.h"

static void d_release(void *p) { CUDA_OK(cudaFree(p)); }
static void d_put(void *dst, const void *src, size_t n) {
    CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
}
static void d_get(void *dst, const void *src, size_t n) {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}
static void d_fill(void *p, int byte, size_t n) {
    CUDA_OK(cudaMemset(p, byte, n));
    CUDA_OK(cudaDeviceSynchronize());
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 99));
    const int cc = tu_gpu_cc("test_bad_input_gpu");
    if (!cc) return 0;
    static const bi_mem mem_cuda = {"cuda", tu_dev_alloc, d_release, d_put, d_get, d_fill};
    static const bi_mem mem_sm90 = {"sm90", tu_dev_alloc, d_release, d_put, d_get, d_fill};
    const smoe_backend backends[2] = {SMOE_BACKEND_CUDA, SMOE_BACKEND_SM90};
    for (int b = 0; b < 2; b++) {
        if (backends[b] == SMOE_BACKEND_SM90 && cc != 90) {
            printf("test_bad_input_gpu: the device is sm_%d, not sm_90: SM90 backend skipped\n",
                   cc);
            continue;
        }
        M = b ? &mem_sm90 : &mem_cuda;
        bi_base = smoe_layer_desc_default();
        /* multiples of 64: the shapes the Hopper kernels take */
        bi_base.d = 64; bi_base.n = 64; bi_base.E = 4; bi_base.K = 2;
        bi_base.dtype = SMOE_DTYPE_BF16;
        bi_base.backend = backends[b];
        bi_run_all(&rng);
    }
    return tu_summary("test_bad_input_gpu");
}
