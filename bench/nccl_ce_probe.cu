/*
 * nccl_ce_probe.cu -- does NCCL's copy-engine all-to-all (NCCL >= 2.28:
 * a communicator with CTAPolicy NCCL_CTA_POLICY_ZERO, buffers from
 * ncclMemAlloc registered as symmetric windows) move an EP exchange beside
 * a GEMM that holds every SM, at the speed it has alone? Against the
 * kernel-based exchanges the EP layer uses today (ncclSend/ncclRecv groups
 * on a communicator of 8 one-CTA clusters, and NCCL's default one), and
 * the same with 4 clusters and with buffers registered by ncclCommRegister
 * (NCCL's p2p over NVLink then writes into the peer's buffer itself, no
 * copy through its FIFO: session 50, 1.75x faster alone on 2 x H200).
 *
 * On every GPU of the machine (one thread per rank): `mib` MiB to each
 * other rank (the all-to-all also copies the rank's own slice), alone, and
 * launched on a high-priority stream just after a chain of cuBLAS bf16
 * GEMMs (8192^3 each, every SM) on another stream. Per mode: the exchange's
 * end and the GEMM chain's end from a common start, median over rounds of
 * the slowest rank; the GEMM chain alone for reference.
 *
 *   nccl_ce_probe [mib (256)] [gemms (6)] [rounds (5)]
 * Build: make build/nccl_ce_probe (links cuBLAS; needs libnccl.so.2 or
 * $SMOE_NCCL_LIBRARY at run time, NCCL >= 2.28 for the CE modes).
 * Uses nccl.h for NCCL's types only (the library is dlopen'd).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ok.h"
#define NOK(call)                                                                     \
    do {                                                                              \
        ncclResult_t n_ = (call);                                                     \
        if (n_ != ncclSuccess) {                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,              \
                    f.GetErrorString(n_));                                            \
            exit(3);                                                                  \
        }                                                                             \
    } while (0)

static struct {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
    ncclResult_t (*MemAlloc)(void **, size_t);
    ncclResult_t (*CommWindowRegister)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
    ncclResult_t (*CommRegister)(ncclComm_t, void *, size_t, void **);
    ncclResult_t (*AlltoAll)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
} f;

/* the exchanges: p2p = ncclSend/Recv to every other rank in a group;
 * a2a = ncclAlltoAll (own slice included) */
enum { X_NONE, X_P2P_DEFAULT, X_P2P_K8, X_P2P_CE, X_A2A_K8, X_A2A_CE, X_P2P_K8R, X_P2P_K4,
       X_P2P_K4R };
static const char *xname[] = {"(none)", "p2p, default comm", "p2p, 8 one-CTA clusters",
                              "p2p, zero-CTA comm + windows", "a2a, 8 one-CTA clusters",
                              "a2a, zero-CTA comm + windows",
                              "p2p, 8 one-CTA clusters, registered",
                              "p2p, 4 one-CTA clusters",
                              "p2p, 4 one-CTA clusters, registered"};
/* gemm: the GEMM chain beside (2: the exchange launched first); parts:
 * the exchange as that many all-to-alls of 1/parts of the bytes */
typedef struct mode {
    int x, gemm, parts;
} mode;
static const mode modes[] = {
    {X_NONE, 1, 1},   {X_P2P_DEFAULT, 0, 1}, {X_P2P_K8, 0, 1}, {X_P2P_CE, 0, 1},
    {X_A2A_K8, 0, 1}, {X_A2A_CE, 0, 1},      {X_A2A_CE, 0, 4}, {X_P2P_K8, 1, 1},
    {X_P2P_CE, 1, 1}, {X_A2A_K8, 1, 1},      {X_A2A_CE, 1, 1}, {X_A2A_CE, 2, 1},
    {X_A2A_CE, 2, 4},
    /* ncclCommRegister'd send and receive buffers (NCCL's p2p over NVLink
     * then writes straight into the peer's buffer, no FIFO copy) */
    {X_P2P_K8R, 0, 1}, {X_P2P_K4, 0, 1}, {X_P2P_K4R, 0, 1},
    {X_P2P_K8R, 1, 1}, {X_P2P_K4, 1, 1}, {X_P2P_K4R, 1, 1},
};
enum { NM = sizeof modes / sizeof modes[0], MAXR = 16 };

typedef struct ctx {
    int r, P, gemms, rounds;
    ncclComm_t base;
    size_t bytes;
    pthread_barrier_t *bar;
    float x_end[NM][MAXR], g_end[NM][MAXR];
} ctx;

static void *rank_main(void *arg)
{
    ctx *c = (ctx *)arg;
    CUDA_OK(cudaSetDevice(c->r));
    ncclConfig_t k8 = NCCL_CONFIG_INITIALIZER, ce = NCCL_CONFIG_INITIALIZER;
    k8.cgaClusterSize = 1;
    k8.maxCTAs = 8;
    ce.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    ncclConfig_t k8r = k8, k4 = k8, k4r = k8;
    k4.maxCTAs = k4r.maxCTAs = 4;
    ncclComm_t ck8 = NULL, cce = NULL, ck8r = NULL, ck4 = NULL, ck4r = NULL;
    NOK(f.CommSplit(c->base, 0, c->r, &ck8, &k8));
    NOK(f.CommSplit(c->base, 0, c->r, &ck8r, &k8r));
    NOK(f.CommSplit(c->base, 0, c->r, &ck4, &k4));
    NOK(f.CommSplit(c->base, 0, c->r, &ck4r, &k4r));
    NOK(f.CommSplit(c->base, 0, c->r, &cce, &ce));
    char *sb = NULL, *rb = NULL;
    const size_t all = c->bytes * (size_t)c->P;
    NOK(f.MemAlloc((void **)&sb, all));
    NOK(f.MemAlloc((void **)&rb, all));
    CUDA_OK(cudaMemset(sb, 1, all));
    CUDA_OK(cudaMemset(rb, 0, all));
    ncclWindow_t ws = NULL, wr = NULL;
    NOK(f.CommWindowRegister(cce, sb, all, &ws, NCCL_WIN_COLL_SYMMETRIC));
    NOK(f.CommWindowRegister(cce, rb, all, &wr, NCCL_WIN_COLL_SYMMETRIC));
    /* the registered modes: their own buffers (a buffer is either
     * registered on a communicator or not for every rank) */
    char *sr = NULL, *rr = NULL;
    NOK(f.MemAlloc((void **)&sr, all));
    NOK(f.MemAlloc((void **)&rr, all));
    CUDA_OK(cudaMemset(sr, 1, all));
    CUDA_OK(cudaMemset(rr, 0, all));
    void *h8s = NULL, *h8r = NULL, *h4s = NULL, *h4r = NULL;
    NOK(f.CommRegister(ck8r, sr, all, &h8s));
    NOK(f.CommRegister(ck8r, rr, all, &h8r));
    NOK(f.CommRegister(ck4r, sr, all, &h4s));
    NOK(f.CommRegister(ck4r, rr, all, &h4r));
    const int G = 8192;
    __nv_bfloat16 *A, *B, *Cm;
    CUDA_OK(cudaMalloc(&A, (size_t)G * G * 2));
    CUDA_OK(cudaMalloc(&B, (size_t)G * G * 2));
    CUDA_OK(cudaMalloc(&Cm, (size_t)G * G * 2));
    CUDA_OK(cudaMemset(A, 0, (size_t)G * G * 2));
    CUDA_OK(cudaMemset(B, 0, (size_t)G * G * 2));
    cudaStream_t s, cs;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int lo, hi;
    CUDA_OK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CUDA_OK(cudaStreamCreateWithPriority(&cs, cudaStreamNonBlocking, hi));
    cublasHandle_t hb;
    if (cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS || cublasSetStream(hb, s)) exit(4);
    const float one = 1.0f, zero = 0.0f;
    cudaEvent_t e0, ex, eg;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&ex));
    CUDA_OK(cudaEventCreate(&eg));
    for (int it = -1; it < c->rounds; it++) /* one warm-up round */
        for (int m = 0; m < NM; m++) {
            pthread_barrier_wait(c->bar);
            CUDA_OK(cudaEventRecord(e0, s));
            CUDA_OK(cudaStreamWaitEvent(cs, e0, 0));
            const int x = modes[m].x;
            ncclComm_t cm = x == X_P2P_DEFAULT                 ? c->base
                            : (x == X_P2P_K8 || x == X_A2A_K8) ? ck8
                            : x == X_P2P_K8R                   ? ck8r
                            : x == X_P2P_K4                    ? ck4
                            : x == X_P2P_K4R                   ? ck4r
                                                               : cce;
            const int reg = x == X_P2P_K8R || x == X_P2P_K4R;
            char *xs = reg ? sr : sb, *xr = reg ? rr : rb;
            const size_t part = c->bytes / (size_t)modes[m].parts;
            if (modes[m].gemm == 2)
                for (int k = 0; k < modes[m].parts; k++)
                    NOK(f.AlltoAll(sb + k * part * c->P, rb + k * part * c->P, part, ncclUint8,
                                   cm, cs));
            if (modes[m].gemm)
                for (int g = 0; g < c->gemms; g++)
                    if (cublasGemmEx(hb, CUBLAS_OP_N, CUBLAS_OP_N, G, G, G, &one, A,
                                     CUDA_R_16BF, G, B, CUDA_R_16BF, G, &zero, Cm,
                                     CUDA_R_16BF, G, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                        exit(4);
            CUDA_OK(cudaEventRecord(eg, s));
            if (modes[m].gemm == 2) {
            } else if (x == X_A2A_K8 || x == X_A2A_CE) {
                for (int k = 0; k < modes[m].parts; k++)
                    NOK(f.AlltoAll(sb + k * part * c->P, rb + k * part * c->P, part, ncclUint8,
                                   cm, cs));
            } else if (x != X_NONE) {
                NOK(f.GroupStart());
                for (int q = 0; q < c->P; q++) {
                    if (q == c->r) continue;
                    NOK(f.Send(xs + q * c->bytes, c->bytes, ncclUint8, q, cm, cs));
                    NOK(f.Recv(xr + q * c->bytes, c->bytes, ncclUint8, q, cm, cs));
                }
                NOK(f.GroupEnd());
            }
            CUDA_OK(cudaEventRecord(ex, cs));
            CUDA_OK(cudaEventSynchronize(ex));
            CUDA_OK(cudaEventSynchronize(eg));
            if (it >= 0) {
                CUDA_OK(cudaEventElapsedTime(&c->x_end[m][it], e0, ex));
                CUDA_OK(cudaEventElapsedTime(&c->g_end[m][it], e0, eg));
            }
        }
    /* the data arrived: rank q's slice r of sb (ones) is in rb's slice q */
    unsigned char probe = 0;
    const int q = (c->r + 1) % c->P;
    CUDA_OK(cudaMemcpy(&probe, rb + (size_t)q * c->bytes + c->bytes - 1, 1, cudaMemcpyDeviceToHost));
    if (probe != 1) fprintf(stderr, "rank %d: slice %d not received\n", c->r, q);
    CUDA_OK(cudaMemcpy(&probe, rr + (size_t)q * c->bytes + c->bytes - 1, 1, cudaMemcpyDeviceToHost));
    if (probe != 1) fprintf(stderr, "rank %d: slice %d not received (registered)\n", c->r, q);
    /* the CE all-to-all in a CUDA graph: captured, replayed, the data there */
    CUDA_OK(cudaMemset(sb, 2, all));
    CUDA_OK(cudaMemset(rb, 0, all));
    CUDA_OK(cudaDeviceSynchronize());
    pthread_barrier_wait(c->bar);
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CUDA_OK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    NOK(f.AlltoAll(sb, rb, c->bytes, ncclUint8, cce, cs));
    CUDA_OK(cudaStreamEndCapture(cs, &gr));
    CUDA_OK(cudaGraphInstantiate(&ge, gr, 0));
    pthread_barrier_wait(c->bar);
    for (int k = 0; k < 3; k++) CUDA_OK(cudaGraphLaunch(ge, cs));
    CUDA_OK(cudaStreamSynchronize(cs));
    CUDA_OK(cudaMemcpy(&probe, rb + (size_t)q * c->bytes + c->bytes / 2, 1, cudaMemcpyDeviceToHost));
    printf("rank %d: CE all-to-all in a CUDA graph: %s\n", c->r,
           probe == 2 ? "data arrived" : "DATA MISSING");
    return NULL;
}

static int cmpf(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const double mib = argc > 1 ? atof(argv[1]) : 256.0;
    const int gemms = argc > 2 ? atoi(argv[2]) : 6;
    int rounds = argc > 3 ? atoi(argv[3]) : 5;
    if (rounds > MAXR) rounds = MAXR;
    const char *env = getenv("SMOE_NCCL_LIBRARY");
    void *h = env && *env ? dlopen(env, RTLD_NOW) : dlopen("libnccl.so.2", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "no libnccl.so.2 (set SMOE_NCCL_LIBRARY)\n");
        return 2;
    }
#define SYM(n)                                                                        \
    do {                                                                              \
        *(void **)&f.n = dlsym(h, "nccl" #n);                                         \
        if (!f.n) {                                                                   \
            fprintf(stderr, "libnccl has no nccl%s\n", #n);                           \
            return 2;                                                                 \
        }                                                                             \
    } while (0)
    SYM(GetVersion); SYM(CommInitAll); SYM(CommSplit); SYM(MemAlloc);
    SYM(CommWindowRegister); SYM(CommRegister); SYM(AlltoAll); SYM(Send); SYM(Recv);
    SYM(GroupStart); SYM(GroupEnd); SYM(GetErrorString);
    int ver = 0;
    f.GetVersion(&ver);
    int P = 0;
    CUDA_OK(cudaGetDeviceCount(&P));
    if (P > 8) P = 8;
    ncclComm_t comm[8];
    int dev[8];
    for (int q = 0; q < P; q++) dev[q] = q;
    NOK(f.CommInitAll(comm, P, dev));
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)P);
    static ctx c[8];
    pthread_t th[8];
    for (int q = 0; q < P; q++) {
        c[q].r = q; c[q].P = P; c[q].base = comm[q]; c[q].gemms = gemms;
        c[q].rounds = rounds; c[q].bytes = (size_t)(mib * 1048576.0); c[q].bar = &bar;
        pthread_create(&th[q], NULL, rank_main, &c[q]);
    }
    for (int q = 0; q < P; q++) pthread_join(th[q], NULL);
    cudaDeviceProp pr;
    CUDA_OK(cudaGetDeviceProperties(&pr, 0));
    printf("# %s x %d, NCCL %d; %.0f MiB to each other rank; %d bf16 GEMMs of 8192^3; "
           "median of %d rounds, slowest rank\n",
           pr.name, P, ver, mib, gemms, rounds);
    printf("%-36s %-7s %12s %12s %10s\n", "exchange", "GEMMs", "exch. end", "GEMMs end",
           "GB/s/rank");
    for (int m = 0; m < NM; m++) {
        float xs[MAXR], gs[MAXR];
        for (int i = 0; i < rounds; i++) {
            xs[i] = gs[i] = 0;
            for (int q = 0; q < P; q++) {
                if (c[q].x_end[m][i] > xs[i]) xs[i] = c[q].x_end[m][i];
                if (c[q].g_end[m][i] > gs[i]) gs[i] = c[q].g_end[m][i];
            }
        }
        qsort(xs, rounds, sizeof(float), cmpf);
        qsort(gs, rounds, sizeof(float), cmpf);
        const float x = xs[rounds / 2], g = gs[rounds / 2];
        const double gbs = modes[m].x == X_NONE ? 0.0
                           : (double)(P - 1) * mib * 1048576.0 / (x * 1e-3) / 1e9;
        char nm[64];
        snprintf(nm, sizeof nm, "%s%s", xname[modes[m].x], modes[m].parts > 1 ? " x4" : "");
        printf("%-36s %-7s %9.3f ms %9.3f ms %10.0f\n", nm,
               modes[m].gemm == 2 ? "after" : modes[m].gemm ? "yes" : "no",
               modes[m].x == X_NONE ? 0.0f : x,
               modes[m].gemm ? g : 0.0f, gbs);
    }
    return 0;
}
