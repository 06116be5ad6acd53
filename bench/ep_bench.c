/*
 * ep_bench.c -- the expert-parallel layer's time on P GPUs of this machine
 * (one thread per rank, ncclCommInitAll), against the single-GPU layer
 * with every expert on one GPU and the same tokens per GPU: the time EP
 * adds (dispatch, the exchanges, combine) at equal work per GPU.
 *
 *   smoe_ep_bench [-r grid row] [-P ranks] [-T tokens per rank] [-d] [-n] [-E]
 *                 [-K] [-c capacity] [-x expert_rows] [-i iterations]
 *                 [-b cuda|sm90] [-m comm_sms] [-o overlap] [-g 1] [-q 1]
 *
 * The EP layer runs three times on NCCL's kernels (copy_engines = -1):
 * with its default schedule (the exchanges
 * beside the expert GEMMs where the kernels allow it; -m sets comm_sms),
 * with overlap = -1 (exchange, then compute): what the overlap buys, and
 * with the default schedule and keep_x = 1 (x's received rows kept for the
 * backward: one exchange fewer there). -o 1 asks for the overlap where the
 * default would not take it. -g 1 adds two runs with copy_engines = 1
 * (NCCL's copy-engine all-to-all, comm_sms at its default), without and
 * with keep_x: the layer's default (copy_engines = 0) takes them from P =
 * 4. -q 1 runs the layer's defaults alone (copy_engines = 0: the layer
 * picks) and the single layer: the quick line for an A/B of two builds;
 * -q 2 the layer's defaults without the single layer. With -q, -g sets the
 * quick run's copy_engines (1: the copy engines, -1: NCCL's kernels) and -m
 * its comm_sms (before session 49 -m was ignored there). Both
 * print first a line of each rank's own median forward and backward (a rank
 * that waits for a slower one reads it in its backward, which starts when
 * its own forward ends). With SMOE_EP_TRACE=1 (smoe.h) every EP layer
 * prints, when freed, where its calls' time went (-q 2: the defaults'
 * alone). -x sets expert_rows: at or above P T K / P = T K on
 * average per rank with random routing, or some rank's call overflows (0:
 * the worst case).
 *
 * -r takes T, d, n, E, K from a row of bench/grid.h (T then per GPU). Per
 * GPU TFLOPS count 6TKdn (forward) and 12TKdn (backward) of the rank's own
 * tokens. Next to it, in the same run: an NCCL all-to-all of the bytes one
 * EP exchange moves (capacity x d bf16 to each other rank; a rank's rows
 * for itself do not travel), the floor of the EP layer's communication
 * without overlap (forward: rows out and partials back, 2 of them;
 * backward: x and dout out, dx back, 3).
 *
 * Each timed iteration starts on every rank at once (a host barrier, then
 * the ranks' streams); a rank's time is cudaEvent time on its stream; the
 * line reports the median over iterations of the slowest rank. Random bf16
 * inputs, TOPK_SOFTMAX routing, SwiGLU. Needs libnccl (the loader's
 * libnccl.so.2 or $SMOE_NCCL_LIBRARY).
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "smoe.h"
#include "cuda_ok.h"
#include "grid.h"

#define MAXP 8
#define MAXI 64

#define SMOE_OK(call)                                                                      \
    do {                                                                                   \
        smoe_status s_ = (call);                                                           \
        if (s_ != SMOE_SUCCESS) {                                                          \
            fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #call,             \
                    smoe_last_error());                                                    \
            fflush(stdout);                                                                \
            fflush(stderr);                                                                \
            _exit(3); /* from a rank's thread: as CUDA_OK (cuda_ok.h) */                   \
        }                                                                                  \
    } while (0)

typedef struct cfg {
    int P, iters, comm_sms, overlap, ce, quick;
    int64_t T, d, n, E, K, capacity, expert_rows;
    smoe_backend backend;
    const char *row;
} cfg;

/* NCCL's C ABI (ncclComm_t a pointer, ncclResult_t an int, ncclUint8 1) */
typedef int (*nccl_group_fn)(void);
typedef int (*nccl_p2p_fn)(const void *, size_t, int, int, void *, cudaStream_t);
static nccl_group_fn g_group_start, g_group_end;
static nccl_p2p_fn g_send, g_recv;

typedef struct rank_ctx {
    int r;
    const cfg *c;
    void *comm;
    int ep; /* 2: NCCL all-to-all alone; 1: the EP layer; 3: the EP layer, no
               overlap; 4: the EP layer, keep_x; 5, 6: copy engines (6: keep_x);
               7: the EP layer's defaults (copy_engines = 0); 0: the single layer */
    pthread_barrier_t *bar;
    float fwd[MAXI], bwd[MAXI];
    char path[256];
} rank_ctx;

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* n bf16 values, uniform in [-scale, scale); period > 0: the first period
 * values repeated (the expert weights: their values set no timing, and
 * generating a billion of them on the host took seconds a line) */
static void *rand_bf16(size_t n, float scale, uint64_t seed, size_t period) {
    const size_t m = period && period < n ? period : n;
    uint16_t *h = (uint16_t *)malloc(m * 2 + 2);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < m; i++) {
        const float f = scale * (2.0f * (float)(rng_next(&s) >> 40) / (float)(1 << 24) - 1.0f);
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    uint16_t *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, n * 2 + 16));
    CUDA_OK(cudaMemcpy(d, h, m * 2, cudaMemcpyHostToDevice));
    for (size_t off = m; off < n; off *= 2) /* doubling copies on the device */
        CUDA_OK(cudaMemcpy(d + off, d, (off < n - off ? off : n - off) * 2,
                           cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaDeviceSynchronize()); /* the rank's stream does not wait for these */
    free(h);
    return d;
}

static void *dalloc(size_t b) {
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, b ? b : 16));
    return d;
}

static void *rank_main(void *arg) {
    rank_ctx *R = (rank_ctx *)arg;
    const cfg *c = R->c;
    const int P = R->ep ? c->P : 1;
    const int64_t T = c->T, d = c->d, n = c->n, E = c->E, El = E / P;
    CUDA_OK(cudaSetDevice(R->r));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (R->ep == 2) { /* the all-to-all of one EP exchange's bytes (peers only) */
        const size_t slice = (size_t)(c->capacity ? c->capacity : T) * (size_t)d * 2;
        char *sendb = (char *)dalloc(slice * (size_t)c->P), *recvb = (char *)dalloc(slice * (size_t)c->P);
        cudaEvent_t a, b;
        CUDA_OK(cudaEventCreate(&a));
        CUDA_OK(cudaEventCreate(&b));
        for (int it = 0; it < 3 + c->iters; it++) {
            pthread_barrier_wait(R->bar);
            CUDA_OK(cudaEventRecord(a, s));
            int e = g_group_start();
            for (int q = 0; q < c->P && !e; q++) {
                if (q == R->r) continue;
                e |= g_send(sendb + (size_t)q * slice, slice, 1, q, R->comm, s);
                e |= g_recv(recvb + (size_t)q * slice, slice, 1, q, R->comm, s);
            }
            e |= g_group_end();
            if (e) {
                fprintf(stderr, "FATAL: NCCL send/recv failed (%d)\n", e);
                fflush(stderr);
                _exit(3);
            }
            CUDA_OK(cudaEventRecord(b, s));
            CUDA_OK(cudaEventSynchronize(b));
            if (it >= 3) CUDA_OK(cudaEventElapsedTime(&R->fwd[it - 3], a, b));
            if (it >= 3) R->bwd[it - 3] = R->fwd[it - 3];
        }
        cudaFree(sendb);
        cudaFree(recvb);
        cudaEventDestroy(a);
        cudaEventDestroy(b);
        cudaStreamDestroy(s);
        snprintf(R->path, sizeof R->path, "nccl send/recv");
        return NULL;
    }
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = d; D.n = n; D.E = E; D.K = c->K;
    D.routing = SMOE_ROUTING_TOPK_SOFTMAX;
    D.activation = SMOE_ACT_SWIGLU;
    D.dtype = SMOE_DTYPE_BF16;
    D.backend = c->backend;
    D.device = R->r;
    smoe_ep_layer *EPL = NULL;
    smoe_layer *L = NULL;
    size_t sb, wb;
    if (R->ep) {
        smoe_ep_desc ed = smoe_ep_desc_default();
        ed.layer = D;
        ed.rank = R->r;
        ed.nranks = P;
        ed.nccl_comm = R->comm;
        ed.max_tokens = T;
        ed.capacity = c->capacity;
        ed.expert_rows = c->expert_rows;
        ed.overlap = R->ep == 3 ? -1 : R->c->overlap;
        ed.comm_sms = R->ep == 5 || R->ep == 6 ? 0 : c->comm_sms; /* -m: quick runs too */
        ed.keep_x = R->ep == 4 || R->ep == 6;
        ed.copy_engines = R->ep == 7 ? c->ce : R->ep >= 5 ? 1 : -1;
        SMOE_OK(smoe_ep_layer_create(&ed, &EPL));
        sb = smoe_ep_layer_saved_bytes(EPL, T);
        wb = smoe_ep_layer_workspace_bytes(EPL, T);
        snprintf(R->path, sizeof R->path, "%s", smoe_ep_layer_path_name(EPL));
    } else {
        SMOE_OK(smoe_layer_create(&D, &L));
        sb = smoe_layer_saved_bytes(L, T, 0);
        wb = smoe_layer_workspace_bytes(L, T, 0);
        snprintf(R->path, sizeof R->path, "%s", smoe_layer_path_name(L));
    }
    if (R->r == 0)
        printf("mem %s P=%d T=%lld: saved %.1f MiB, workspace %.1f MiB (rank 0)\n",
               R->ep ? "EP" : "single", P, (long long)T, sb / 1048576.0,
               wb / 1048576.0);
    const uint64_t seed = 1000u * (uint64_t)R->r + 7u;
    void *x = rand_bf16((size_t)(T * d), 1.0f, seed + 1, 0);
    void *wr = rand_bf16((size_t)(E * d), 0.05f, 99, 0); /* the same router on every rank */
    void *w1 = rand_bf16((size_t)(El * 2 * n * d), 0.02f, seed + 2, (size_t)1 << 24);
    void *w2 = rand_bf16((size_t)(El * d * n), 0.02f, seed + 3, (size_t)1 << 24);
    void *dout = rand_bf16((size_t)(T * d), 1.0f, seed + 4, 0);
    void *out = dalloc((size_t)(T * d) * 2);
    void *dx = dalloc((size_t)(T * d) * 2);
    void *dwr = dalloc((size_t)(E * d) * 4);
    void *dw1 = dalloc((size_t)(El * 2 * n * d) * 2);
    void *dw2 = dalloc((size_t)(El * d * n) * 2);
    void *saved = dalloc(sb), *ws = dalloc(wb);
    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T; fa.x = x; fa.router_w = wr; fa.w1 = w1; fa.w2 = w2; fa.out = out;
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T; ba.x = x; ba.router_w = wr; ba.w1 = w1; ba.w2 = w2; ba.dout = dout;
    ba.dx = (smoe_grad){dx, SMOE_DTYPE_BF16, 0};
    ba.drouter_w = (smoe_grad){dwr, SMOE_DTYPE_F32, 0};
    ba.dw1 = (smoe_grad){dw1, SMOE_DTYPE_BF16, 0};
    ba.dw2 = (smoe_grad){dw2, SMOE_DTYPE_BF16, 0};
    cudaEvent_t e0, e1, e2;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventCreate(&e2));
    const int warm = 3;
    for (int it = 0; it < warm + c->iters; it++) {
        pthread_barrier_wait(R->bar);
        CUDA_OK(cudaEventRecord(e0, s));
        if (R->ep) {
            SMOE_OK(smoe_ep_layer_forward(EPL, &fa, saved, sb, ws, wb, s));
            CUDA_OK(cudaEventRecord(e1, s));
            SMOE_OK(smoe_ep_layer_backward(EPL, &ba, saved, sb, ws, wb, s));
        } else {
            SMOE_OK(smoe_layer_forward(L, &fa, saved, sb, ws, wb, s));
            CUDA_OK(cudaEventRecord(e1, s));
            SMOE_OK(smoe_layer_backward(L, &ba, saved, sb, ws, wb, s));
        }
        CUDA_OK(cudaEventRecord(e2, s));
        CUDA_OK(cudaEventSynchronize(e2));
        if (it >= warm) {
            CUDA_OK(cudaEventElapsedTime(&R->fwd[it - warm], e0, e1));
            CUDA_OK(cudaEventElapsedTime(&R->bwd[it - warm], e1, e2));
        }
    }
    SMOE_OK(R->ep ? smoe_ep_layer_device_status(EPL, s, 1) : smoe_layer_device_status(L, s, 1));
    void *bufs[] = {x, wr, w1, w2, dout, out, dx, dwr, dw1, dw2, saved, ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
    cudaStreamDestroy(s);
    smoe_ep_layer_free(EPL);
    smoe_layer_free(L);
    return NULL;
}

static int cmp_f(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* median over iterations of the slowest rank: forward (bwd = 0), backward
 * (1) or both (2: a rank's backward starts when its own forward ends, so the
 * sum of the first two also counts the ranks' skew at that point) */
static float med_max(const rank_ctx *R, int P, int iters, int bwd) {
    float m[MAXI];
    for (int i = 0; i < iters; i++) {
        m[i] = 0.0f;
        for (int q = 0; q < P; q++) {
            const float v = bwd == 2 ? R[q].fwd[i] + R[q].bwd[i] : bwd ? R[q].bwd[i] : R[q].fwd[i];
            m[i] = v > m[i] ? v : m[i];
        }
    }
    qsort(m, (size_t)iters, sizeof m[0], cmp_f);
    return m[iters / 2];
}

/* rank q's own median forward (bwd = 0) or backward (1) */
static float med_rank(const rank_ctx *R, int q, int iters, int bwd) {
    float m[MAXI];
    for (int i = 0; i < iters; i++) m[i] = bwd ? R[q].bwd[i] : R[q].fwd[i];
    qsort(m, (size_t)iters, sizeof m[0], cmp_f);
    return m[iters / 2];
}

/* ep (rank_ctx's) on the ranks: the medians of the slowest rank's forward,
 * backward and (t, when given) whole iteration, the path name and (ranks,
 * when given) each rank's own forward and backward medians: where a rank
 * waits for a slower one, its backward (which starts when its own forward
 * ends and needs every rank's dout) reads that wait */
static void run(const cfg *c, int ep, void **comms, float *f, float *b, float *t, char *path,
                char *ranks) {
    const int P = ep ? c->P : 1;
    (void)P;
    rank_ctx R[MAXP];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)P);
    pthread_t th[MAXP];
    for (int q = 0; q < P; q++) {
        memset(&R[q], 0, sizeof R[q]);
        R[q].r = q; R[q].c = c; R[q].comm = comms ? comms[q] : NULL; R[q].ep = ep; R[q].bar = &bar;
        pthread_create(&th[q], NULL, rank_main, &R[q]);
    }
    for (int q = 0; q < P; q++) pthread_join(th[q], NULL);
    pthread_barrier_destroy(&bar);
    *f = med_max(R, P, c->iters, 0);
    *b = med_max(R, P, c->iters, 1);
    if (t) *t = med_max(R, P, c->iters, 2);
    snprintf(path, 256, "%s", R[0].path);
    if (ranks) {
        int k = snprintf(ranks, 256, "per rank fwd");
        for (int q = 0; q < P && k < 200; q++)
            k += snprintf(ranks + k, 256 - (size_t)k, " %.3f", med_rank(R, q, c->iters, 0));
        k += snprintf(ranks + k, 256 - (size_t)k, ", bwd");
        for (int q = 0; q < P && k < 240; q++)
            k += snprintf(ranks + k, 256 - (size_t)k, " %.3f", med_rank(R, q, c->iters, 1));
    }
}

int main(int argc, char **argv) {
    cfg c = {2, 20, 0, 0, 0, 0, 8192, 1536, 256, 128, 8, 0, 0, SMOE_BACKEND_AUTO, NULL};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "-r")) {
            c.row = v;
            const size_t nrow = sizeof smoe_grid / sizeof smoe_grid[0];
            size_t j = 0;
            while (j < nrow && strcmp(smoe_grid[j].name, v)) j++;
            if (j == nrow) {
                fprintf(stderr, "no grid row %s\n", v);
                return 2;
            }
            c.T = smoe_grid[j].T; c.d = smoe_grid[j].d; c.n = smoe_grid[j].n;
            c.E = smoe_grid[j].E; c.K = smoe_grid[j].K;
        } else if (!strcmp(k, "-P")) c.P = atoi(v);
        else if (!strcmp(k, "-x")) c.expert_rows = atoll(v);
        else if (!strcmp(k, "-T")) c.T = atoll(v);
        else if (!strcmp(k, "-d")) c.d = atoll(v);
        else if (!strcmp(k, "-n")) c.n = atoll(v);
        else if (!strcmp(k, "-E")) c.E = atoll(v);
        else if (!strcmp(k, "-K")) c.K = atoll(v);
        else if (!strcmp(k, "-c")) c.capacity = atoll(v);
        else if (!strcmp(k, "-i")) c.iters = atoi(v);
        else if (!strcmp(k, "-m")) c.comm_sms = atoi(v);
        else if (!strcmp(k, "-o")) c.overlap = atoi(v);
        else if (!strcmp(k, "-g")) c.ce = atoi(v);
        else if (!strcmp(k, "-q")) c.quick = atoi(v);
        else if (!strcmp(k, "-b")) c.backend = !strcmp(v, "cuda") ? SMOE_BACKEND_CUDA : SMOE_BACKEND_SM90;
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (c.iters > MAXI) c.iters = MAXI;
    int ngpu = 0;
    CUDA_OK(cudaGetDeviceCount(&ngpu));
    if (c.P < 1 || c.P > ngpu || c.P > MAXP || c.E % c.P) {
        fprintf(stderr, "P = %d: need 1 <= P <= %d GPUs, E %% P == 0\n", c.P, ngpu);
        return 2;
    }
    const char *env = getenv("SMOE_NCCL_LIBRARY");
    void *h = env && *env ? dlopen(env, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!h) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    int (*init_all)(void **, int, const int *) = NULL;
    int (*destroy)(void *) = NULL;
    if (h) {
        *(void **)&init_all = dlsym(h, "ncclCommInitAll");
        *(void **)&destroy = dlsym(h, "ncclCommDestroy");
        *(void **)&g_group_start = dlsym(h, "ncclGroupStart");
        *(void **)&g_group_end = dlsym(h, "ncclGroupEnd");
        *(void **)&g_send = dlsym(h, "ncclSend");
        *(void **)&g_recv = dlsym(h, "ncclRecv");
    }
    if (!init_all || !destroy || !g_group_start || !g_group_end || !g_send || !g_recv) {
        fprintf(stderr, "no libnccl.so.2 (set SMOE_NCCL_LIBRARY)\n");
        return 2;
    }
    void *comms[MAXP] = {0};
    int devs[MAXP];
    for (int q = 0; q < c.P; q++) devs[q] = q;
    if (init_all(comms, c.P, devs) != 0) {
        fprintf(stderr, "ncclCommInitAll failed\n");
        return 3;
    }
    float ef, eb, nf, nb, kf, kb, sf, sbw, af, ab;
    char epath[256], npath[256], kpath[256], spath[256], apath[256];
    if (c.quick) {
        float et;
        char rk[256] = "";
        run(&c, 7, comms, &ef, &eb, &et, epath, rk);
        for (int q = 0; q < c.P; q++) destroy(comms[q]);
        if (c.quick == 2) {
            printf("quick ranks: %s ms\n", rk);
            printf("quick %s P=%d T=%lld: EP fwd %.3f bwd %.3f ms, fwd+bwd %.3f ms (%s)\n",
                   c.row ? c.row : "", c.P, (long long)c.T, ef, eb, et, epath);
            return 0;
        }
        run(&c, 0, NULL, &sf, &sbw, NULL, spath, NULL);
        printf("quick ranks: %s ms\n", rk);
        printf("quick %s P=%d T=%lld: EP fwd %.3f bwd %.3f ms, fwd+bwd %.3f ms, single fwd %.3f "
               "bwd %.3f ms; per-GPU EP / single fwd %.1f%% bwd %.1f%% total %.1f%% (%s)\n",
               c.row ? c.row : "", c.P, (long long)c.T, ef, eb, et, sf, sbw, 100 * sf / ef,
               100 * sbw / eb, 100 * (sf + sbw) / et, epath);
        return 0;
    }
    run(&c, 1, comms, &ef, &eb, NULL, epath, NULL);
    run(&c, 3, comms, &nf, &nb, NULL, npath, NULL);
    run(&c, 4, comms, &kf, &kb, NULL, kpath, NULL);
    float gf = 0, gb = 0, hf = 0, hb = 0;
    char gpath[256] = "", hpath[256] = "";
    if (c.ce && c.P > 1) {
        run(&c, 5, comms, &gf, &gb, NULL, gpath, NULL);
        run(&c, 6, comms, &hf, &hb, NULL, hpath, NULL);
    }
    run(&c, 2, comms, &af, &ab, NULL, apath, NULL);
    run(&c, 0, NULL, &sf, &sbw, NULL, spath, NULL);
    for (int q = 0; q < c.P; q++) destroy(comms[q]);
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const int64_t C = c.capacity ? c.capacity : c.T;
    const double fl = 6.0 * (double)c.T * (double)c.K * (double)c.d * (double)c.n;
    const double slice = (double)C * (double)c.d * 2.0;
    printf("# %s x %d; %s T = %lld tokens per GPU, d = %lld, n = %lld, E = %lld, K = %lld; "
           "capacity %lld, expert_rows %lld; median of %d iterations (slowest rank)\n",
           prop.name, c.P, c.row ? c.row : "", (long long)c.T, (long long)c.d, (long long)c.n,
           (long long)c.E, (long long)c.K, (long long)C, (long long)c.expert_rows, c.iters);
    printf("%-52s %8s %8s %8s %8s %8s\n", "layer (kernel path)", "fwd ms", "bwd ms", "fwd TF",
           "bwd TF", "total TF");
    char a[400], a2[400], a3[400], b[400];
    snprintf(a, sizeof a, "EP P=%d, E/P=%lld (%s)", c.P, (long long)(c.E / c.P), epath);
    snprintf(a2, sizeof a2, "EP P=%d, E/P=%lld (%s)", c.P, (long long)(c.E / c.P), npath);
    snprintf(a3, sizeof a3, "EP P=%d, E/P=%lld, keep_x (%s)", c.P, (long long)(c.E / c.P),
             kpath);
    snprintf(b, sizeof b, "single GPU, E=%lld (%s)", (long long)c.E, spath);
    printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", a, ef, eb, fl / ef * 1e-9, 2 * fl / eb * 1e-9,
           3 * fl / (ef + eb) * 1e-9);
    printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", a2, nf, nb, fl / nf * 1e-9,
           2 * fl / nb * 1e-9, 3 * fl / (nf + nb) * 1e-9);
    printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", a3, kf, kb, fl / kf * 1e-9,
           2 * fl / kb * 1e-9, 3 * fl / (kf + kb) * 1e-9);
    if (c.ce && c.P > 1) {
        char g[400], g2[400];
        snprintf(g, sizeof g, "EP P=%d, E/P=%lld (%s)", c.P, (long long)(c.E / c.P), gpath);
        snprintf(g2, sizeof g2, "EP P=%d, E/P=%lld, keep_x (%s)", c.P, (long long)(c.E / c.P),
                 hpath);
        printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", g, gf, gb, fl / gf * 1e-9,
               2 * fl / gb * 1e-9, 3 * fl / (gf + gb) * 1e-9);
        printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", g2, hf, hb, fl / hf * 1e-9,
               2 * fl / hb * 1e-9, 3 * fl / (hf + hb) * 1e-9);
    }
    printf("%-52s %8.3f %8.3f %8.1f %8.1f %8.1f\n", b, sf, sbw, fl / sf * 1e-9,
           2 * fl / sbw * 1e-9, 3 * fl / (sf + sbw) * 1e-9);
    printf("per-GPU EP / single: fwd %.1f%%, bwd %.1f%%, total %.1f%% (no overlap: %.1f%%, "
           "%.1f%%, %.1f%%)\n",
           100 * sf / ef, 100 * sbw / eb, 100 * (sf + sbw) / (ef + eb), 100 * sf / nf,
           100 * sbw / nb, 100 * (sf + sbw) / (nf + nb));
    printf("per-GPU EP keep_x / single: fwd %.1f%%, bwd %.1f%%, total %.1f%%\n", 100 * sf / kf,
           100 * sbw / kb, 100 * (sf + sbw) / (kf + kb));
    if (c.ce && c.P > 1)
        printf("per-GPU EP copy engines / single: fwd %.1f%%, bwd %.1f%%, total %.1f%% "
               "(keep_x: %.1f%%, %.1f%%, %.1f%%)\n",
               100 * sf / gf, 100 * sbw / gb, 100 * (sf + sbw) / (gf + gb), 100 * sf / hf,
               100 * sbw / hb, 100 * (sf + sbw) / (hf + hb));
    const double peers = (double)(c.P - 1) * slice;
    printf("nccl all-to-all of %d x %.1f MiB per rank (peers): %.3f ms (%.0f GB/s per rank); "
           "no-overlap comm floor fwd %.3f ms, bwd %.3f ms; no-overlap EP beyond single + "
           "floor: fwd %.3f, bwd %.3f ms; overlap hides fwd %.3f, bwd %.3f ms\n",
           c.P - 1, slice / 1048576.0, af, peers > 0 ? peers / af * 1e-6 : 0.0, 2 * af, 3 * af,
           nf - sf - 2 * af, nb - sbw - 3 * af, nf - ef, nb - eb);
    return 0;
}
