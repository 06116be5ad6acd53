/*
 * bench.c -- the GPU benchmark (`make bench ARGS=...`): forward and backward
 * of the layer on SonicMoE's H100 grid (bench/grid.h), next to the published
 * SonicMoE numbers and the PyTorch grouped_mm / ScatterMoE / cuBLAS-bound
 * numbers measured on the same kind of GPU.
 *
 *   build/smoe_bench                              the whole grid
 *   build/smoe_bench --rows 7B-n256,30B-n512      rows by name (or "all": the
 *                                                 grid; "models": the public
 *                                                 models' shapes of grid.h)
 *   build/smoe_bench --shape T,d,n,E,K            any shape
 *   options: --backend auto|cuda|sm90  --reps N (10)  --warmup N (3)
 *            --csv FILE  --list  --stages (per-stage times, from the
 *            library's SMOE_CUDA_TIMING stage timer, on stderr)
 *            --gemm-row GEMM=NAME (repeatable: GEMM, one of up, down, dh,
 *            dw2, dxt, dw1, runs row NAME of its tile table instead of the
 *            plan's, e.g. "down=256x4"; the path name then says so)
 *            --timing queued|synced (queued)  --gpu-delay-ms X (0)
 *            --skew S (GENERAL routing from the benchmark's own triples:
 *            each token's K distinct experts drawn from a Zipf(S) law over
 *            the E experts, in a random order of the experts, scores 1/K;
 *            S = 0 draws them uniformly, the baseline to compare with:
 *            issue 20's skewed loads, max / mean expert load about 16 at
 *            S = 1.5, E = 128, K = 8)
 *            --loop S (after the timed calls, forward+backward pairs back
 *            to back for about S seconds, no flush: ms per pair, and from
 *            NVML the energy per pair (J), mean power (W) and the median
 *            SM clock (MHz) near the loop's end; a training loop holds the
 *            GPU at its power limit, where the energy per pair sets the
 *            time, unlike the rested timed calls)
 *
 * Setting: bf16, SwiGLU, TOPK_SOFTMAX routing (the grid's), random inputs
 * (router weights random, so routing is near uniform), every gradient
 * wanted (dX, dWr, dW1, dW2 in bf16, overwritten).
 * Timing: warm-up calls, then `reps` forward+backward pairs; before each
 * timed call a 256 MiB memset evicts L2 (the H100 has 50 MiB), and CUDA
 * events bracket the call alone. Medians are reported. Queued (the
 * default): after the warm-up the pairs are enqueued back to back and the
 * host waits once at the end, so the host runs ahead of the GPU as in a
 * training loop, and as in triton's do_bench, which SonicMoE's benchmark
 * uses (benchmarks/moe-cute.py there: flush, event, call, event, no
 * synchronisation between repetitions). Synced: the host waits for every
 * pair, so each call starts on an idle GPU and the events include the
 * host's latency up to its first kernel (sessions 1-4 timed this way).
 * --gpu-delay-ms X adds X ms of further memsets of the flush buffer between
 * the flush and the start event (the count calibrated once; an experiment:
 * it changes how long the GPU works at low power before each call).
 * TFLOPS = 6TKdn / forward time and 12TKdn / backward time (backward time =
 * the backward call), DESIGN.md section 8. "host" is the CPU time the forward and
 * backward calls take to enqueue their work (median), the library's share
 * of a training step's host time.
 * Activation memory: the saved block plus the output O (2Td bytes) -- what
 * a training forward leaves allocated -- next to the grid's floor.
 */
#include "grid.h"
#include "smoe.h"

#include <cuda_runtime_api.h>
/* cuda_layer.h: one GEMM's row of its tile table, chosen by name */
extern smoe_status smoe_cuda_layer_set_row(smoe_layer *layer, const char *gemm, const char *name);
static const char *g_rows[6]; /* --gemm-row GEMM=NAME */
static int g_nrows;
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>
#include <unistd.h>

#define FLUSH_BYTES ((size_t)256 << 20)
static double g_delay_ms = 0.0; /* --gpu-delay-ms */
static int g_queued = 1;        /* --timing queued|synced */
static double g_skew = -1.0;    /* --skew S: GENERAL triples, Zipf(S) (0: uniform); < 0: off */
static int g_delay_n = -1;      /* memsets of FLUSH_BYTES per delay, calibrated once */
static double g_loop_s = 0.0;   /* --loop S: seconds of back-to-back pairs (0: off) */
#define GIB (1024.0 * 1024.0 * 1024.0)

static int cuda_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 1;
    fprintf(stderr, "smoe_bench: %s: %s\n", what, cudaGetErrorString(e));
    return 0;
}

/* ------------------------------------------------------------ inputs */

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A pool of 8 Mi random bf16 values (~ N(0, scale^2), sum of uniforms),
 * tiled over the device buffer: distinct enough for routing and GEMMs, and
 * cheap to build for gigabytes of weights. */
#define POOL (1u << 23)

static int fill_random(void *dst, size_t count, float scale, uint16_t *pool)
{
    for (size_t i = 0; i < POOL; i++) {
        double s = 0;
        for (int j = 0; j < 4; j++) s += (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0);
        pool[i] = f32_to_bf16((float)((s - 2.0) * 1.7320508 * scale));
    }
    /* the pool shifted by a random offset per tile, so repeats do not align */
    size_t done = 0;
    while (done < count) {
        size_t off = rng_next() % (POOL / 2);
        size_t n = count - done < POOL - off ? count - done : POOL - off;
        if (!cuda_ok(cudaMemcpy((uint16_t *)dst + done, pool + off, n * 2,
                                cudaMemcpyHostToDevice),
                     "cudaMemcpy (inputs)"))
            return 0;
        done += n;
    }
    return 1;
}

/* --skew: T x K triples (token, expert, score), sorted by token, each
 * token's K experts distinct, drawn from p(e) ~ 1 / (rank(e) + 1)^S with a
 * random order of the experts (S = 0: uniform); the largest expert load
 * over the mean goes to *imbalance. */
static int make_triples(int64_t T, int64_t E, int64_t K, double S, int32_t *pt, int32_t *pe,
                        float *ps, double *imbalance)
{
    double *cdf = (double *)malloc((size_t)E * sizeof(double));
    int32_t *perm = (int32_t *)malloc((size_t)E * sizeof(int32_t));
    int64_t *load = (int64_t *)calloc((size_t)E, sizeof(int64_t));
    if (!cdf || !perm || !load) {
        free(cdf); free(perm); free(load);
        return 0;
    }
    double acc = 0;
    for (int64_t e = 0; e < E; e++) {
        acc += pow((double)(e + 1), -S);
        cdf[e] = acc;
        perm[e] = (int32_t)e;
    }
    for (int64_t e = E - 1; e > 0; e--) {
        const int64_t j = (int64_t)(rng_next() % (uint64_t)(e + 1));
        const int32_t t = perm[e]; perm[e] = perm[j]; perm[j] = t;
    }
    for (int64_t t = 0; t < T; t++) {
        int32_t *row = pe + t * K;
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            int dup;
            do { /* redraw an expert the token already has */
                const double u = (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0) * acc;
                int64_t lo = 0, hi = E - 1;
                while (lo < hi) {
                    const int64_t mid = (lo + hi) / 2;
                    if (cdf[mid] > u) hi = mid; else lo = mid + 1;
                }
                e = perm[lo];
                dup = 0;
                for (int64_t j = 0; j < k; j++) dup |= row[j] == e;
            } while (dup);
            row[k] = e;
            pt[t * K + k] = (int32_t)t;
            ps[t * K + k] = 1.0f / (float)K;
            load[e]++;
        }
    }
    int64_t mx = 0;
    for (int64_t e = 0; e < E; e++) mx = load[e] > mx ? load[e] : mx;
    *imbalance = (double)mx * (double)E / ((double)T * (double)K);
    free(cdf); free(perm); free(load);
    return 1;
}

/* ------------------------------------------------------------ one shape */

typedef struct result {
    const smoe_grid_row *row;
    int ok;
    double fwd_ms, bwd_ms, fwd_tflops, bwd_tflops, act_gib, ws_gib;
    double host_fwd_us, host_bwd_us; /* CPU time to enqueue the call (median) */
    double loop_ms, loop_j, loop_w, loop_mhz; /* --loop: per pair; 0 where not measured */
    char path[160];
    char why[320]; /* when !ok: the status and the library's message */
} result;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Monotonic wall clock in microseconds (host enqueue times). */
static double host_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ------------------------------------------------------------ NVML (--loop) */

/* The few NVML calls --loop uses, from the driver's libnvidia-ml.so.1 by
 * dlopen (no build dependency); the GPU found by the PCI bus id of the
 * current CUDA device. 0 where NVML or the counter is missing: the loop's
 * time is reported without energy then. */
typedef struct nvml_api {
    int tried, ok;
    void *dev;
    int (*energy)(void *dev, unsigned long long *mj);
    int (*clock)(void *dev, int type, unsigned int *mhz);
} nvml_api;
static nvml_api g_nvml;

static int nvml_open(void)
{
    nvml_api *N = &g_nvml;
    if (N->tried) return N->ok;
    N->tried = 1;
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "smoe_bench: --loop: no libnvidia-ml.so.1 (%s): no energy\n", dlerror());
        return 0;
    }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*by_bus)(const char *, void **) =
        (int (*)(const char *, void **))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
    N->energy = (int (*)(void *, unsigned long long *))dlsym(h, "nvmlDeviceGetTotalEnergyConsumption");
    N->clock = (int (*)(void *, int, unsigned int *))dlsym(h, "nvmlDeviceGetClockInfo");
    char bus[32];
    int dev = 0;
    unsigned long long mj = 0;
    if (!init || !by_bus || !N->energy || !N->clock || init() != 0 ||
        cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetPCIBusId(bus, (int)sizeof bus, dev) != cudaSuccess ||
        by_bus(bus, &N->dev) != 0 || N->energy(N->dev, &mj) != 0) {
        fprintf(stderr, "smoe_bench: --loop: NVML's energy counter not readable: no energy\n");
        return 0;
    }
    N->ok = 1;
    return 1;
}

#define DMALLOC(p, bytes)                                                           \
    do {                                                                            \
        size_t b_ = (bytes);                                                        \
        if (!cuda_ok(cudaMalloc((void **)&(p), b_ ? b_ : 16), "cudaMalloc " #p))    \
            goto out;                                                               \
    } while (0)

/* The flush, then g_delay_n more memsets of the same buffer (the delay). */
static int flush_and_delay(void *flush, int it)
{
    if (g_delay_n < 0) { /* calibrate: the fastest of 3 timed memsets */
        cudaEvent_t a = NULL, b = NULL;
        float best = 0.0f;
        g_delay_n = 0;
        if (g_delay_ms > 0 && cuda_ok(cudaEventCreate(&a), "cudaEventCreate") &&
            cuda_ok(cudaEventCreate(&b), "cudaEventCreate")) {
            for (int i = 0; i < 4; i++) {
                cudaEventRecord(a, NULL);
                cudaMemsetAsync(flush, i, FLUSH_BYTES, NULL);
                cudaEventRecord(b, NULL);
                if (!cuda_ok(cudaEventSynchronize(b), "delay calibration")) break;
                float ms = 0.0f;
                cudaEventElapsedTime(&ms, a, b);
                if (i > 0 && (best == 0.0f || ms < best)) best = ms;
            }
            if (best > 0.0f) g_delay_n = (int)ceil(g_delay_ms / best);
        }
        if (a) cudaEventDestroy(a);
        if (b) cudaEventDestroy(b);
    }
    for (int i = 0; i <= g_delay_n; i++)
        if (!cuda_ok(cudaMemsetAsync(flush, (it + i) & 0xff, FLUSH_BYTES, NULL), "flush"))
            return 0;
    return 1;
}

/* --loop: forward+backward pairs back to back for about g_loop_s seconds
 * (from the timed pairs' times), no flush between them, one wait at the
 * end, as a training loop runs; the SM clock sampled by NVML while the
 * host waits (the host enqueues ahead until the launch queue is full, so
 * the samples are of the loop's later part). 0: a CUDA or library error. */
static int loop_pairs(smoe_layer *L, const smoe_forward_args *fa, const smoe_backward_args *ba,
                      void *saved, size_t saved_b, void *ws, size_t ws_b, result *res)
{
    const double pair = res->fwd_ms + res->bwd_ms;
    int iters = (int)ceil(g_loop_s * 1e3 / (pair > 0.01 ? pair : 0.01));
    if (iters < 5) iters = 5;
    const int energy = nvml_open();
    cudaEvent_t a = NULL, b = NULL;
    int ok = cuda_ok(cudaEventCreate(&a), "cudaEventCreate") &&
             cuda_ok(cudaEventCreate(&b), "cudaEventCreate") &&
             cuda_ok(cudaDeviceSynchronize(), "sync");
    unsigned long long mj0 = 0, mj1 = 0;
    if (ok && energy && g_nvml.energy(g_nvml.dev, &mj0) != 0) mj0 = 0;
    if (ok) ok = cuda_ok(cudaEventRecord(a, NULL), "cudaEventRecord");
    smoe_status st = SMOE_SUCCESS;
    for (int i = 0; ok && i < iters && st == SMOE_SUCCESS; i++) {
        st = smoe_layer_forward(L, fa, saved, saved_b, ws, ws_b, NULL);
        if (st == SMOE_SUCCESS) st = smoe_layer_backward(L, ba, saved, saved_b, ws, ws_b, NULL);
    }
    if (st != SMOE_SUCCESS) {
        snprintf(res->why, sizeof res->why, "--loop: %s: %s", smoe_status_string(st),
                 smoe_last_error());
        ok = 0;
    }
    if (ok) ok = cuda_ok(cudaEventRecord(b, NULL), "cudaEventRecord");
    double mhz[512];
    int nm = 0;
    while (ok) { /* the clock every 20 ms until the loop is done */
        const cudaError_t q = cudaEventQuery(b);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            ok = cuda_ok(q, "loop");
            break;
        }
        unsigned int c = 0;
        if (energy && nm < 512 && g_nvml.clock(g_nvml.dev, 1 /* NVML_CLOCK_SM */, &c) == 0)
            mhz[nm++] = c;
        usleep(20000);
    }
    if (ok && energy && g_nvml.energy(g_nvml.dev, &mj1) != 0) mj1 = 0;
    float ms = 0.0f;
    if (ok) ok = cuda_ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (ok) {
        res->loop_ms = ms / iters;
        if (mj0 && mj1 > mj0) {
            res->loop_j = (double)(mj1 - mj0) * 1e-3 / iters;
            res->loop_w = res->loop_j / (res->loop_ms * 1e-3);
        }
        if (nm) res->loop_mhz = median(mhz, nm);
    }
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    return ok;
}

static void bench_row(const smoe_grid_row *row, smoe_backend backend, int reps, int warmup,
                      int stages, result *res)
{
    memset(res, 0, sizeof *res);
    res->row = row;
    const int64_t T = row->T, d = row->d, n = row->n, E = row->E, K = row->K;
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = d; D.n = n; D.E = E; D.K = K;
    D.backend = backend;
    const int skew = g_skew >= 0.0;
    const int64_t np = skew ? T * K : 0;
    if (skew) {
        D.routing = SMOE_ROUTING_GENERAL;
        D.K = 0;
    }
    smoe_layer *L = NULL;
    smoe_status st = smoe_layer_create(&D, &L);
    if (st != SMOE_SUCCESS) {
        snprintf(res->why, sizeof res->why, "create: %s: %s", smoe_status_string(st),
                 smoe_last_error());
        fprintf(stderr, "smoe_bench: %s: %s\n", row->name, res->why);
        return;
    }
    if (smoe_layer_backend(L) == SMOE_BACKEND_CPU) {
        snprintf(res->why, sizeof res->why, "no GPU backend (got the CPU)");
        fprintf(stderr, "smoe_bench: %s: no GPU backend (got the CPU)\n", row->name);
        smoe_layer_free(L);
        return;
    }
    snprintf(res->path, sizeof res->path, "%s", smoe_layer_path_name(L));
    for (int i = 0; i < g_nrows; i++) {
        char gemm[16];
        const char *eq = strchr(g_rows[i], '=');
        const size_t gl = eq ? (size_t)(eq - g_rows[i]) : 0;
        snprintf(gemm, sizeof gemm, "%.*s", (int)(gl < 15 ? gl : 15), g_rows[i]);
        st = eq ? smoe_cuda_layer_set_row(L, gemm, eq + 1) : SMOE_ERROR_INVALID_VALUE;
        if (st != SMOE_SUCCESS) {
            snprintf(res->why, sizeof res->why, "--gemm-row %s: %s", g_rows[i],
                     smoe_last_error());
            fprintf(stderr, "smoe_bench: %s: --gemm-row %s: %s\n", row->name, g_rows[i],
                    smoe_last_error());
            smoe_layer_free(L);
            return;
        }
        const size_t used = strlen(res->path);
        snprintf(res->path + used, sizeof res->path - used, " {%s}", g_rows[i]);
    }

    const size_t saved_b = smoe_layer_saved_bytes(L, T, np);
    const size_t ws_b = smoe_layer_workspace_bytes(L, T, np);
    void *x = NULL, *wr = NULL, *w1 = NULL, *w2 = NULL, *out = NULL, *dout = NULL;
    void *dx = NULL, *dwr = NULL, *dw1 = NULL, *dw2 = NULL, *saved = NULL, *ws = NULL;
    void *flush = NULL;
    void *tri = NULL; /* --skew: the triples on the device (token, expert, score) */
    uint16_t *pool = NULL;
    const int nit = warmup + reps;
    cudaEvent_t *ev = (cudaEvent_t *)calloc((size_t)(4 * nit), sizeof(cudaEvent_t));
    double *tf = (double *)calloc((size_t)reps, sizeof(double));
    double *tb = (double *)calloc((size_t)reps, sizeof(double));
    double *hf = (double *)calloc((size_t)reps, sizeof(double));
    double *hb = (double *)calloc((size_t)reps, sizeof(double));
    pool = (uint16_t *)malloc((size_t)POOL * 2);
    if (!tf || !tb || !hf || !hb || !pool || !ev) goto out;

    DMALLOC(x, (size_t)(T * d) * 2);
    DMALLOC(wr, (size_t)(E * d) * 2);
    DMALLOC(w1, (size_t)(E * 2 * n * d) * 2);
    DMALLOC(w2, (size_t)(E * d * n) * 2);
    DMALLOC(out, (size_t)(T * d) * 2);
    DMALLOC(dout, (size_t)(T * d) * 2);
    DMALLOC(dx, (size_t)(T * d) * 2);
    DMALLOC(dwr, (size_t)(E * d) * 2);
    DMALLOC(dw1, (size_t)(E * 2 * n * d) * 2);
    DMALLOC(dw2, (size_t)(E * d * n) * 2);
    DMALLOC(saved, saved_b);
    DMALLOC(ws, ws_b);
    DMALLOC(flush, FLUSH_BYTES);
    if (!fill_random(x, (size_t)(T * d), 1.0f, pool) ||
        !fill_random(wr, (size_t)(E * d), 1.0f / sqrtf((float)d), pool) ||
        !fill_random(w1, (size_t)(E * 2 * n * d), 1.0f / sqrtf((float)d), pool) ||
        !fill_random(w2, (size_t)(E * d * n), 1.0f / sqrtf((float)n), pool) ||
        !fill_random(dout, (size_t)(T * d), 1.0f, pool))
        goto out;
    for (int i = 0; i < 4 * nit; i++)
        if (!cuda_ok(cudaEventCreate(&ev[i]), "cudaEventCreate")) goto out;
    if (skew) {
        DMALLOC(tri, (size_t)np * 12);
        int32_t *h = (int32_t *)malloc((size_t)np * 12);
        double imb = 0;
        const int made = h && make_triples(T, E, K, g_skew, h, h + np, (float *)(h + 2 * np), &imb);
        const int up = made && cuda_ok(cudaMemcpy(tri, h, (size_t)np * 12,
                                                  cudaMemcpyHostToDevice), "cudaMemcpy (triples)");
        free(h);
        if (!up) goto out;
        const size_t used = strlen(res->path);
        snprintf(res->path + used, sizeof res->path - used, " {general, zipf %.2g, max/mean %.1f}",
                 g_skew, imb);
    }

    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T; fa.x = x; fa.router_w = wr; fa.w1 = w1; fa.w2 = w2; fa.out = out;
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T; ba.x = x; ba.router_w = wr; ba.w1 = w1; ba.w2 = w2; ba.dout = dout;
    ba.dx = (smoe_grad){dx, SMOE_DTYPE_BF16, 0};
    ba.drouter_w = (smoe_grad){dwr, SMOE_DTYPE_BF16, 0};
    if (skew) { /* GENERAL: the triples instead of the router (no dWr, no dscore) */
        fa.router_w = NULL;
        fa.pairs = np;
        fa.pair_token = (const int32_t *)tri;
        fa.pair_expert = (const int32_t *)tri + np;
        fa.pair_score = (const float *)((const int32_t *)tri + 2 * np);
        ba.router_w = NULL;
        ba.pairs = np;
        ba.drouter_w = (smoe_grad){NULL, SMOE_DTYPE_BF16, 0};
    }
    ba.dw1 = (smoe_grad){dw1, SMOE_DTYPE_BF16, 0};
    ba.dw2 = (smoe_grad){dw2, SMOE_DTYPE_BF16, 0};

    /* queued: the calls follow each other on the GPU with no
     * synchronisation between them (after the warm-up), so the host runs
     * ahead; synced: the host waits for each pair to finish */
    for (int it = 0; it < nit; it++) {
        cudaEvent_t *e = ev + 4 * it;
        if (!flush_and_delay(flush, it)) goto out;
        cudaEventRecord(e[0], NULL);
        const double h0 = host_us();
        st = smoe_layer_forward(L, &fa, saved, saved_b, ws, ws_b, NULL);
        const double h1 = host_us();
        cudaEventRecord(e[1], NULL);
        if (st != SMOE_SUCCESS) break;
        if (!flush_and_delay(flush, it + 1)) goto out;
        cudaEventRecord(e[2], NULL);
        const double h2 = host_us();
        st = smoe_layer_backward(L, &ba, saved, saved_b, ws, ws_b, NULL);
        const double h3 = host_us();
        cudaEventRecord(e[3], NULL);
        if (st != SMOE_SUCCESS) break;
        if ((!g_queued || it + 1 == warmup) && !cuda_ok(cudaEventSynchronize(e[3]), "run"))
            goto out;
        if (it >= warmup) {
            hf[it - warmup] = h1 - h0;
            hb[it - warmup] = h3 - h2;
        }
    }
    if (st == SMOE_SUCCESS) {
        if (!cuda_ok(cudaDeviceSynchronize(), "run")) goto out;
        for (int it = warmup; it < nit; it++) {
            float f = 0, b = 0;
            cudaEventElapsedTime(&f, ev[4 * it], ev[4 * it + 1]);
            cudaEventElapsedTime(&b, ev[4 * it + 2], ev[4 * it + 3]);
            tf[it - warmup] = f;
            tb[it - warmup] = b;
        }
    }
    if (st != SMOE_SUCCESS) {
        snprintf(res->why, sizeof res->why, "%s: %s", smoe_status_string(st), smoe_last_error());
        fprintf(stderr, "smoe_bench: %s: %s\n", row->name, res->why);
        goto out;
    }
    if (!cuda_ok(cudaDeviceSynchronize(), "sync")) goto out;
    {
        const double flop = (double)T * (double)K * (double)d * (double)n;
        res->fwd_ms = median(tf, reps);
        res->bwd_ms = median(tb, reps);
        res->fwd_tflops = 6.0 * flop / (res->fwd_ms * 1e-3) / 1e12;
        res->bwd_tflops = 12.0 * flop / (res->bwd_ms * 1e-3) / 1e12;
        res->act_gib = ((double)saved_b + 2.0 * (double)(T * d)) / GIB;
        res->ws_gib = (double)ws_b / GIB;
        res->host_fwd_us = median(hf, reps);
        res->host_bwd_us = median(hb, reps);
        res->ok = 1;
    }
    if (g_loop_s > 0.0 && !loop_pairs(L, &fa, &ba, saved, saved_b, ws, ws_b, res)) {
        res->ok = 0;
        if (!res->why[0]) snprintf(res->why, sizeof res->why, "--loop: a CUDA error (stderr)");
        fprintf(stderr, "smoe_bench: %s: %s\n", row->name, res->why);
        goto out;
    }
    if (stages) {
        /* a second layer with the library's stage timer (SMOE_CUDA_TIMING),
         * which prints the mean time of each stage when freed */
        smoe_layer *L2 = NULL;
        setenv("SMOE_CUDA_TIMING", "1", 1);
        st = smoe_layer_create(&D, &L2);
        unsetenv("SMOE_CUDA_TIMING");
        fflush(stdout);
        for (int it = 0; it < 3 && st == SMOE_SUCCESS; it++) {
            cudaMemsetAsync(flush, it & 0xff, FLUSH_BYTES, NULL);
            st = smoe_layer_forward(L2, &fa, saved, saved_b, ws, ws_b, NULL);
            if (st != SMOE_SUCCESS) break;
            cudaMemsetAsync(flush, (it + 1) & 0xff, FLUSH_BYTES, NULL);
            st = smoe_layer_backward(L2, &ba, saved, saved_b, ws, ws_b, NULL);
        }
        if (st != SMOE_SUCCESS)
            fprintf(stderr, "smoe_bench: %s: stage timing: %s: %s\n", row->name,
                    smoe_status_string(st), smoe_last_error());
        cudaDeviceSynchronize();
        smoe_layer_free(L2);
        fflush(stderr);
    }
out:
    for (int i = 0; ev && i < 4 * nit; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    free(ev);
    cudaFree(x); cudaFree(wr); cudaFree(w1); cudaFree(w2); cudaFree(out); cudaFree(dout);
    cudaFree(dx); cudaFree(dwr); cudaFree(dw1); cudaFree(dw2); cudaFree(saved); cudaFree(ws);
    cudaFree(flush);
    cudaFree(tri);
    free(pool);
    free(tf);
    free(tb);
    free(hf);
    free(hb);
    smoe_layer_free(L);
}

/* ------------------------------------------------------------ output */

static void print_line(const result *r)
{
    const smoe_grid_row *g = r->row;
    if (!r->ok) {
        printf("%-15s T=%-6lld d=%-5lld n=%-5lld E=%-4lld K=%-3lld  FAILED: %s\n", g->name,
               (long long)g->T, (long long)g->d, (long long)g->n, (long long)g->E,
               (long long)g->K, r->why[0] ? r->why : "see stderr");
        return;
    }
    printf("%-15s T=%-6lld d=%-5lld n=%-5lld E=%-4lld K=%-3lld fwd %8.3f ms %6.1f TFLOPS  "
           "bwd %8.3f ms %6.1f TFLOPS  act %.3f GiB (floor %.2f)  ws %.2f GiB  "
           "host %.0f/%.0f us  [%s]\n",
           g->name, (long long)g->T, (long long)g->d, (long long)g->n, (long long)g->E,
           (long long)g->K, r->fwd_ms, r->fwd_tflops, r->bwd_ms, r->bwd_tflops, r->act_gib,
           g->floor_act_gib, r->ws_gib, r->host_fwd_us, r->host_bwd_us, r->path);
    if (r->loop_ms > 0)
        printf("%-15s   loop: %.3f ms per fwd+bwd, %.3f J, %.0f W, SM %.0f MHz\n", "",
               r->loop_ms, r->loop_j, r->loop_w, r->loop_mhz);
    if (g->sonicmoe_fwd > 0)
        printf("%-15s   published: SonicMoE %3.0f/%3.0f  torch grouped_mm %5.1f/%5.1f "
               "(%.2f GiB)  ScatterMoE %5.1f/%5.1f (%.2f GiB)  cuBLAS-bound %3.0f/%3.0f TFLOPS\n",
               "", g->sonicmoe_fwd, g->sonicmoe_bwd, g->torch_fwd, g->torch_bwd,
               g->torch_act_gib, g->scattermoe_fwd, g->scattermoe_bwd, g->scattermoe_act_gib,
               g->gemm_bound_fwd, g->gemm_bound_bwd);
    fflush(stdout);
}

static void write_csv(const char *file, const result *rs, int nr, const char *device)
{
    FILE *f = fopen(file, "w");
    if (!f) {
        fprintf(stderr, "smoe_bench: cannot write %s\n", file);
        return;
    }
    fprintf(f, "name,T,d,n,E,K,device,path,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops,act_gib,"
               "floor_act_gib,workspace_gib,sonicmoe_fwd,sonicmoe_bwd,torch_fwd,torch_bwd,"
               "torch_act_gib,scattermoe_fwd,scattermoe_bwd,scattermoe_act_gib,gemm_bound_fwd,"
               "gemm_bound_bwd,host_fwd_us,host_bwd_us,gpu_delay_ms,timing,loop_ms,loop_j,loop_w,"
               "loop_mhz\n");
    for (int i = 0; i < nr; i++) {
        const result *r = &rs[i];
        const smoe_grid_row *g = r->row;
        fprintf(f, "%s,%lld,%lld,%lld,%lld,%lld,\"%s\",\"%s\",", g->name, (long long)g->T,
                (long long)g->d, (long long)g->n, (long long)g->E, (long long)g->K, device,
                r->path);
        if (r->ok)
            fprintf(f, "%.4f,%.4f,%.1f,%.1f,%.4f,", r->fwd_ms, r->bwd_ms, r->fwd_tflops,
                    r->bwd_tflops, r->act_gib);
        else
            fprintf(f, ",,,,,");
        fprintf(f, "%.2f,%.3f,%.0f,%.0f,%.1f,%.1f,%.2f,%.1f,%.1f,%.2f,%.0f,%.0f,",
                g->floor_act_gib, r->ws_gib, g->sonicmoe_fwd, g->sonicmoe_bwd, g->torch_fwd,
                g->torch_bwd, g->torch_act_gib, g->scattermoe_fwd, g->scattermoe_bwd,
                g->scattermoe_act_gib, g->gemm_bound_fwd, g->gemm_bound_bwd);
        if (r->ok)
            fprintf(f, "%.1f,%.1f,", r->host_fwd_us, r->host_bwd_us);
        else
            fprintf(f, ",,");
        fprintf(f, "%.3g,%s,", g_delay_ms, g_queued ? "queued" : "synced");
        if (r->ok && r->loop_ms > 0)
            fprintf(f, "%.4f,%.4f,%.1f,%.0f\n", r->loop_ms, r->loop_j, r->loop_w, r->loop_mhz);
        else
            fprintf(f, ",,,\n");
    }
    fclose(f);
}

static void print_table(const result *rs, int nr, const char *device)
{
    printf("\nsmoe on %s: TFLOPS fwd/bwd, activation GiB (SonicMoE published fwd/bwd, floor "
           "GiB)\n",
           device);
    printf("%-15s %7s %7s %8s | %7s %7s %6s | %6s %6s\n", "row", "fwd", "bwd", "act", "sonic-f",
           "sonic-b", "floor", "f/son", "b/son");
    double lf = 0, lb = 0;
    int m = 0;
    for (int i = 0; i < nr; i++) {
        const result *r = &rs[i];
        const smoe_grid_row *g = r->row;
        if (!r->ok) {
            printf("%-15s  FAILED: %s\n", g->name, r->why[0] ? r->why : "see stderr");
            continue;
        }
        if (g->sonicmoe_fwd > 0) {
            printf("%-15s %7.1f %7.1f %8.3f | %7.0f %7.0f %6.2f | %6.2f %6.2f\n", g->name,
                   r->fwd_tflops, r->bwd_tflops, r->act_gib, g->sonicmoe_fwd, g->sonicmoe_bwd,
                   g->floor_act_gib, r->fwd_tflops / g->sonicmoe_fwd,
                   r->bwd_tflops / g->sonicmoe_bwd);
            lf += log(r->fwd_tflops / g->sonicmoe_fwd);
            lb += log(r->bwd_tflops / g->sonicmoe_bwd);
            m++;
        } else {
            printf("%-15s %7.1f %7.1f %8.3f |\n", g->name, r->fwd_tflops, r->bwd_tflops,
                   r->act_gib);
        }
    }
    if (m)
        printf("geometric mean vs SonicMoE (published H100): fwd %.2fx, bwd %.2fx over %d rows\n",
               exp(lf / m), exp(lb / m), m);
}

/* ------------------------------------------------------------ main */

static void usage(void)
{
    printf("usage: smoe_bench [--rows NAME[,NAME...]|all|models] [--shape T,d,n,E,K]\n"
           "                  [--backend auto|cuda|sm90] [--reps N] [--warmup N] [--csv FILE] "
           "[--list] [--stages] [--gemm-row GEMM=NAME] [--gpu-delay-ms X]\n"
           "                  [--timing queued|synced] [--skew S] [--loop SECONDS]\n");
}

int main(int argc, char **argv)
{
    const char *rows = NULL, *csv = NULL;
    smoe_backend backend = SMOE_BACKEND_AUTO;
    int reps = 10, warmup = 3, nshape = 0, stages = 0;
    smoe_grid_row shapes[16];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--rows") && v) { rows = v; i++; }
        else if (!strcmp(a, "--csv") && v) { csv = v; i++; }
        else if (!strcmp(a, "--reps") && v) { reps = atoi(v); i++; }
        else if (!strcmp(a, "--warmup") && v) { warmup = atoi(v); i++; }
        else if (!strcmp(a, "--stages")) stages = 1;
        else if (!strcmp(a, "--gpu-delay-ms") && v) { g_delay_ms = atof(v); i++; }
        else if (!strcmp(a, "--timing") && v && (!strcmp(v, "queued") || !strcmp(v, "synced"))) {
            g_queued = !strcmp(v, "queued");
            i++;
        }
        else if (!strcmp(a, "--gemm-row") && v && g_nrows < 6) { g_rows[g_nrows++] = v; i++; }
        else if (!strcmp(a, "--skew") && v && atof(v) >= 0.0) { g_skew = atof(v); i++; }
        else if (!strcmp(a, "--loop") && v && atof(v) > 0.0) { g_loop_s = atof(v); i++; }
        else if (!strcmp(a, "--backend") && v) {
            if (!strcmp(v, "cuda")) backend = SMOE_BACKEND_CUDA;
            else if (!strcmp(v, "sm90")) backend = SMOE_BACKEND_SM90;
            else if (!strcmp(v, "auto")) backend = SMOE_BACKEND_AUTO;
            else { usage(); return 2; }
            i++;
        } else if (!strcmp(a, "--shape") && v && nshape < 16) {
            smoe_grid_row s = smoe_grid_default;
            long long T, d, n, E, K;
            if (sscanf(v, "%lld,%lld,%lld,%lld,%lld", &T, &d, &n, &E, &K) != 5) {
                usage();
                return 2;
            }
            s.name = "shape";
            s.T = T; s.d = d; s.n = n; s.E = E; s.K = K;
            shapes[nshape++] = s;
            i++;
        } else if (!strcmp(a, "--list")) {
            for (int r = 0; r < SMOE_GRID_ROWS + SMOE_MODEL_ROWS; r++) {
                const smoe_grid_row *g =
                    r < SMOE_GRID_ROWS ? &smoe_grid[r] : &smoe_model_rows[r - SMOE_GRID_ROWS];
                printf("%-15s T=%lld d=%lld n=%lld E=%lld K=%lld%s\n", g->name, (long long)g->T,
                       (long long)g->d, (long long)g->n, (long long)g->E, (long long)g->K,
                       r < SMOE_GRID_ROWS ? "" : "  (models)");
            }
            return 0;
        } else {
            usage();
            return !strcmp(a, "--help") ? 0 : 2;
        }
    }
    if (reps < 1) reps = 1;
    if (warmup < 0) warmup = 0;

    enum { MAX_TODO = (SMOE_GRID_ROWS + SMOE_MODEL_ROWS) * 4 + 16 };
    const smoe_grid_row *todo[MAX_TODO];
    int nt = 0;
    if (!rows && !nshape) rows = "all"; /* no rows and no shapes: the whole grid */
    if (!rows) {
        /* shapes only */
    } else if (!strcmp(rows, "all")) {
        for (int r = 0; r < SMOE_GRID_ROWS; r++) todo[nt++] = &smoe_grid[r];
    } else {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", rows);
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
            int found = 0;
            const int all = !strcmp(tok, "all") || !strcmp(tok, "grid");
            const int models = !strcmp(tok, "models");
            for (int r = 0; r < SMOE_GRID_ROWS && nt < MAX_TODO - 16; r++)
                if (all || !strcmp(tok, smoe_grid[r].name)) {
                    todo[nt++] = &smoe_grid[r];
                    found = 1;
                }
            for (int r = 0; r < SMOE_MODEL_ROWS && nt < MAX_TODO - 16; r++)
                if (models || !strcmp(tok, smoe_model_rows[r].name)) {
                    todo[nt++] = &smoe_model_rows[r];
                    found = 1;
                }
            if (!found) {
                fprintf(stderr, "smoe_bench: no grid row named %s (--list)\n", tok);
                return 2;
            }
        }
    }
    for (int s = 0; s < nshape; s++) todo[nt++] = &shapes[s];

    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "smoe_bench: no CUDA device\n");
        return 1;
    }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    char device[300];
    snprintf(device, sizeof device, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount);
    printf("smoe_bench %s on %s: bf16 SwiGLU TOPK_SOFTMAX, median of %d (warm-up %d), L2 "
           "flushed, %s timing, GPU delay %.3g ms before each timed call\n",
           smoe_version_string(), device, reps, warmup, g_queued ? "queued" : "synced",
           g_delay_ms);

    result *rs = (result *)calloc((size_t)nt + 1, sizeof(result));
    int failed = 0;
    for (int i = 0; i < nt; i++) {
        bench_row(todo[i], backend, reps, warmup, stages, &rs[i]);
        print_line(&rs[i]);
        failed += !rs[i].ok;
    }
    if (csv) write_csv(csv, rs, nt, device);
    print_table(rs, nt, device);
    free(rs);
    return failed ? 1 : 0;
}
