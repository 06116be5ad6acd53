/*
 * nccl_overlap_probe.cu -- can an NCCL exchange run beside a kernel that
 * holds most of the GPU? On every GPU of this machine (one thread each,
 * ncclCommInitAll): a kernel that keeps (SMs - R) CTAs busy for about
 * `ms` milliseconds (one CTA per SM: a large shared-memory request) on one
 * stream, and an exchange of `mib` MiB with every other rank (ncclSend /
 * ncclRecv in a group) on a second stream, launched just after. For each
 * R, the time from the start to the end of the exchange and of the busy
 * kernel (slowest rank): an exchange that ends near its own time (the
 * first line, alone) ran beside the kernel; one that ends after the kernel
 * waited for its SMs. What the expert-parallel layer's comm_sms needs.
 *
 *   nccl_overlap_probe [mib (256)] [ms (5)]
 * Build: make build/nccl_overlap_probe
 * Needs libnccl.so.2 (or $SMOE_NCCL_LIBRARY).
 */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_ok.h"

static int (*g_start)(void), (*g_end)(void);
static int (*g_send)(const void *, size_t, int, int, void *, cudaStream_t);
static int (*g_recv)(void *, size_t, int, int, void *, cudaStream_t);

__global__ void busy(long long cycles, int *sink)
{
    extern __shared__ int sm[];
    const long long t0 = clock64();
    int v = 0;
    while (clock64() - t0 < cycles) v += sm[threadIdx.x & 31];
    if (v == 12345) *sink = v;
}

enum { NR = 7 };
static const int reserve[NR] = {-1, 0, 4, 8, 16, 24, 32}; /* -1: the exchange alone */

typedef struct ctx {
    int r, P;
    void *comm;
    size_t bytes;
    float ms;
    pthread_barrier_t *bar;
    float x_end[NR], k_end[NR];
} ctx;

static void *rank_main(void *arg)
{
    ctx *c = (ctx *)arg;
    CUDA_OK(cudaSetDevice(c->r));
    int sms = 0, clk = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->r));
    CUDA_OK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, c->r)); /* kHz */
    const int smem = 227 * 1024;
    CUDA_OK(cudaFuncSetAttribute(busy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaStream_t s, cs;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int lo, hi;
    CUDA_OK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CUDA_OK(cudaStreamCreateWithPriority(&cs, cudaStreamNonBlocking, hi));
    char *sb, *rb;
    int *sink;
    CUDA_OK(cudaMalloc(&sb, c->bytes * c->P));
    CUDA_OK(cudaMalloc(&rb, c->bytes * c->P));
    CUDA_OK(cudaMalloc(&sink, 4));
    cudaEvent_t e0, ex, ek;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&ex));
    CUDA_OK(cudaEventCreate(&ek));
    for (int it = 0; it < 3; it++) /* warm-up, then the measured round */
        for (int i = 0; i < NR; i++) {
            pthread_barrier_wait(c->bar);
            CUDA_OK(cudaEventRecord(e0, s));
            CUDA_OK(cudaStreamWaitEvent(cs, e0, 0));
            if (reserve[i] >= 0)
                busy<<<sms - reserve[i], 256, smem, s>>>((long long)(c->ms * clk), sink);
            CUDA_OK(cudaGetLastError());
            CUDA_OK(cudaEventRecord(ek, s));
            int e = g_start();
            for (int q = 0; q < c->P; q++) {
                if (q == c->r) continue;
                e |= g_send(sb + q * c->bytes, c->bytes, 1, q, c->comm, cs);
                e |= g_recv(rb + q * c->bytes, c->bytes, 1, q, c->comm, cs);
            }
            e |= g_end();
            if (e) {
                fprintf(stderr, "nccl error %d\n", e);
                exit(3);
            }
            CUDA_OK(cudaEventRecord(ex, cs));
            CUDA_OK(cudaEventSynchronize(ex));
            CUDA_OK(cudaEventSynchronize(ek));
            CUDA_OK(cudaEventElapsedTime(&c->x_end[i], e0, ex));
            CUDA_OK(cudaEventElapsedTime(&c->k_end[i], e0, ek));
        }
    return NULL;
}

int main(int argc, char **argv)
{
    const double mib = argc > 1 ? atof(argv[1]) : 256.0;
    const float ms = argc > 2 ? (float)atof(argv[2]) : 5.0f;
    const char *env = getenv("SMOE_NCCL_LIBRARY");
    void *h = env && *env ? dlopen(env, RTLD_NOW) : dlopen("libnccl.so.2", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "no libnccl.so.2 (set SMOE_NCCL_LIBRARY)\n");
        return 2;
    }
    int (*init_all)(void **, int, const int *);
    *(void **)&init_all = dlsym(h, "ncclCommInitAll");
    *(void **)&g_start = dlsym(h, "ncclGroupStart");
    *(void **)&g_end = dlsym(h, "ncclGroupEnd");
    *(void **)&g_send = dlsym(h, "ncclSend");
    *(void **)&g_recv = dlsym(h, "ncclRecv");
    int P = 0;
    CUDA_OK(cudaGetDeviceCount(&P));
    if (P > 8) P = 8;
    void *comm[8];
    int dev[8];
    for (int q = 0; q < P; q++) dev[q] = q;
    if (init_all(comm, P, dev)) {
        fprintf(stderr, "ncclCommInitAll failed\n");
        return 3;
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)P);
    ctx c[8];
    pthread_t th[8];
    for (int q = 0; q < P; q++) {
        c[q].r = q; c[q].P = P; c[q].comm = comm[q];
        c[q].bytes = (size_t)(mib * 1048576.0); c[q].ms = ms; c[q].bar = &bar;
        pthread_create(&th[q], NULL, rank_main, &c[q]);
    }
    for (int q = 0; q < P; q++) pthread_join(th[q], NULL);
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("# %d GPUs, %d SMs; %.0f MiB to each other rank beside a kernel of ~%.1f ms\n", P,
           sms, mib, ms);
    printf("%-28s %12s %12s\n", "SMs left free", "exchange end", "kernel end");
    for (int i = 0; i < NR; i++) {
        float x = 0, k = 0;
        for (int q = 0; q < P; q++) {
            x = c[q].x_end[i] > x ? c[q].x_end[i] : x;
            k = c[q].k_end[i] > k ? c[q].k_end[i] : k;
        }
        char name[64];
        if (reserve[i] < 0) snprintf(name, sizeof name, "(exchange alone)");
        else snprintf(name, sizeof name, "%d", reserve[i]);
        printf("%-28s %9.3f ms %9.3f ms\n", name, x, k);
    }
    return 0;
}
