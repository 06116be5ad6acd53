/*
 * testutil_cuda.h -- the GPU tests' helpers on top of testutil.h (header
 * only; C11 for the C GPU tests, C++ for the CUDA ones and bench/bench_gemm.cu):
 *
 *   - CUDA_OK(call): a failed CUDA call prints where and exits (3): the
 *     context is then unusable, so the test cannot go on;
 *   - tu_gpu_cc(): the device's compute capability, or "no CUDA device,
 *     skipped" and 0;
 *   - device buffers: tu_dev_alloc, tu_dev_put (host -> new device buffer),
 *     tu_dev_get (device -> host), tu_dev_fetch (device -> new host
 *     buffer), tu_dev_to_dtype / tu_dev_from_dtype (doubles <-> a device
 *     buffer of a dtype, as tu_to_dtype / tu_from_dtype), tu_dev_poison
 *     (every byte 0xFF: a bf16 0xFFFF and an fp32 0xFFFFFFFF are NaN, so a
 *     value the kernel should have written, or must not read, shows);
 *   - nvcc only: tu_dev_fill_bf16 / tu_dev_fill_f32, uniform random values
 *     on the device (a hash of the seed and the index), for buffers too
 *     large to draw on the host.
 */
#ifndef SMOE_TESTUTIL_CUDA_H
#define SMOE_TESTUTIL_CUDA_H

#include "testutil.h"

#include <cuda_runtime_api.h>

#include "../../bench/cuda_ok.h" /* CUDA_OK, shared with the benchmarks */

/* SMOE_OK_OR_EXIT(call): a call that must succeed for the test to go on */
#define SMOE_OK_OR_EXIT(call)                                                              \
    do {                                                                                   \
        smoe_status s_ = (call);                                                           \
        if (s_ != SMOE_SUCCESS) {                                                          \
            fprintf(stderr, "FATAL %s:%d %s -> %s (%s)\n", __FILE__, __LINE__, #call,      \
                    smoe_status_string(s_), smoe_last_error());                            \
            exit(3);                                                                       \
        }                                                                                  \
    } while (0)

/* Device 0's compute capability as 10 major + minor (90 for an H100), or
 * 0 after printing "NAME: no CUDA device, skipped". */
static TU_UNUSED int tu_gpu_cc(const char *name) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("%s: no CUDA device, skipped\n", name);
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    return prop.major * 10 + prop.minor;
}

/* ------------------------------------------------------------ buffers */

/* bytes of device memory (16 when bytes is 0, so the pointer is valid) */
static TU_UNUSED void *tu_dev_alloc(size_t bytes) {
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
    return p;
}

/* a new device buffer holding the host's bytes */
static TU_UNUSED void *tu_dev_put(const void *host, size_t bytes) {
    void *p = tu_dev_alloc(bytes);
    if (bytes) CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
}

/* the device's bytes into host (after the work queued before it) */
static TU_UNUSED void tu_dev_get(void *host, const void *dev, size_t bytes) {
    if (bytes) CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

/* the device's bytes in a new host buffer (caller frees) */
static TU_UNUSED void *tu_dev_fetch(const void *dev, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    if (!h) { fprintf(stderr, "out of memory\n"); exit(2); }
    tu_dev_get(h, dev, bytes);
    return h;
}

/* n doubles as a new device buffer of dtype t (tu_to_dtype, uploaded) */
static TU_UNUSED void *tu_dev_to_dtype(smoe_dtype t, const double *src, size_t n) {
    void *h = tu_to_dtype(t, src, n), *d = tu_dev_put(h, n * tu_dtype_size(t));
    free(h);
    return d;
}

/* n values of dtype t on the device as new host doubles (caller frees) */
static TU_UNUSED double *tu_dev_from_dtype(smoe_dtype t, const void *dev, size_t n) {
    void *h = tu_dev_fetch(dev, n * tu_dtype_size(t));
    double *r = tu_from_dtype(t, h, n);
    free(h);
    return r;
}

#define TU_POISON_BF16 0xFFFFu

static TU_UNUSED void tu_dev_poison(void *dev, size_t bytes) {
    if (bytes) CUDA_OK(cudaMemset(dev, 0xFF, bytes));
}

/* ------------------------------------------------------------ fills (nvcc) */

#ifdef __CUDACC__
#include <cuda_bf16.h>

/* splitmix64's finaliser of (seed, i): 24 random bits as a float in [0, 1) */
static __device__ __forceinline__ float tu_dev_unit(uint64_t seed, uint64_t i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + (i + 1) * 0xD1B54A32D192ED03ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

static __global__ void tu_fill_bf16_kernel(__nv_bfloat16 *p, size_t n, uint64_t seed, float lo,
                                           float hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(lo + (hi - lo) * tu_dev_unit(seed, i));
}

static __global__ void tu_fill_f32_kernel(float *p, size_t n, uint64_t seed, float lo, float hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = lo + (hi - lo) * tu_dev_unit(seed, i);
}

/* n values uniform in [lo, hi), rounded to bf16 / fp32 */
static TU_UNUSED void tu_dev_fill_bf16(void *p, size_t n, uint64_t seed, float lo, float hi) {
    if (!n) return;
    tu_fill_bf16_kernel<<<1024, 256>>>((__nv_bfloat16 *)p, n, seed, lo, hi);
    CUDA_OK(cudaGetLastError());
}

static TU_UNUSED void tu_dev_fill_f32(float *p, size_t n, uint64_t seed, float lo, float hi) {
    if (!n) return;
    tu_fill_f32_kernel<<<1024, 256>>>(p, n, seed, lo, hi);
    CUDA_OK(cudaGetLastError());
}
#endif /* __CUDACC__ */

#endif /* SMOE_TESTUTIL_CUDA_H */
