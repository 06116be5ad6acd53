/* cuda_ok.h -- CUDA_OK(call): a benchmark or probe stops (status 3) on a CUDA
 * error, naming the call. Shared by bench/ep_bench.c, the NCCL probes and the
 * GPU tests (tests/gpu/testutil_cuda.h). It stops by _exit from whichever
 * thread failed: exit() would run the libraries' exit handlers while other
 * ranks' threads are still inside CUDA or NCCL (ep_bench: SIGSEGV). */
#ifndef SMOE_BENCH_CUDA_OK_H
#define SMOE_BENCH_CUDA_OK_H
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define CUDA_OK(call)                                                                      \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #call,             \
                    cudaGetErrorString(e_));                                               \
            fflush(stdout);                                                                \
            fflush(stderr);                                                                \
            _exit(3);                                                                      \
        }                                                                                  \
    } while (0)

#endif
