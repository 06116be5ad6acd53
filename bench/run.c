/*
 * run.c -- the main job (`make run`): one MoE layer, forward and backward,
 * on the best backend present, timed and checked against the fp64
 * reference (the CPU backend with F64 storage on the same inputs).
 *
 *   build/smoe_run                       the small default configuration
 *   build/smoe_run --config 7B-n256      a row of SonicMoE's grid (--list)
 *   build/smoe_run --shape T,d,n,E,K     any shape
 *   options: --backend cpu|cuda|sm90|auto   --tokens T   --iters N
 *            --seed S   --check-tokens N   --no-check   --list   --help
 *
 * The layer is bf16, SwiGLU, TOPK_SOFTMAX (the grid's setting). TFLOPS
 * count 6TKdn for the forward and 12TKdn for the backward (DESIGN.md 8).
 * Activation memory is what the forward leaves allocated: the saved block
 * plus the output O (2Td bytes), next to the floor 4TKn + 2Td + 16TK
 * (H, O and the routing metadata).
 *
 * The check: with token-choice routing a token's output and input gradient
 * depend on that token alone, so the fp64 reference may run on the first
 * N tokens only (--check-tokens; all of them by default on small shapes)
 * and O and dX are compared there. The weight gradients, sums over all
 * tokens, are compared too when all tokens are checked.
 */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200112L /* clock_gettime */
#endif
#include "grid.h"
#include "smoe.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef SMOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* ------------------------------------------------------------ errors */

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "smoe_run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(1);
}

#define SMOE_CHECK(call)                                                                  \
    do {                                                                                  \
        smoe_status st_ = (call);                                                         \
        if (st_ != SMOE_SUCCESS) {                                                        \
            fprintf(stderr, "smoe_run: %s failed: %s: %s\n", #call, smoe_status_string(st_), \
                    smoe_last_error());                                                   \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

/* ------------------------------------------------------------ layer memory */

/* Buffers the layer reads and writes live where its backend runs: host
 * memory for the CPU backend, device memory for the CUDA backends. Every
 * allocation and copy goes through these functions. */
static int g_device_mem; /* 1: the layer runs on a CUDA device */

#ifdef SMOE_WITH_CUDA
static void cuda_check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "smoe_run: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}
#endif

static void *alloc_buf(size_t bytes)
{
    void *p = NULL;
    if (bytes == 0) bytes = 1;
    if (g_device_mem) {
#ifdef SMOE_WITH_CUDA
        cuda_check(cudaMalloc(&p, bytes), "cudaMalloc failed");
        cuda_check(cudaMemset(p, 0, bytes), "cudaMemset failed");
#endif
    } else {
        p = aligned_alloc(256, (bytes + 255) / 256 * 256);
        if (p) memset(p, 0, bytes);
    }
    if (!p) die("out of memory (%s)", g_device_mem ? "device" : "host");
    return p;
}

static void free_buf(void *p)
{
    if (!p) return;
#ifdef SMOE_WITH_CUDA
    if (g_device_mem) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

/* host -> layer memory */
static void copy_to(void *dst, const void *src, size_t bytes)
{
#ifdef SMOE_WITH_CUDA
    if (g_device_mem) {
        cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* layer memory -> host */
static void copy_from(void *dst, const void *src, size_t bytes)
{
#ifdef SMOE_WITH_CUDA
    if (g_device_mem) {
        cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* Waits for the layer's work before a clock is read. */
static void device_sync(void)
{
#ifdef SMOE_WITH_CUDA
    if (g_device_mem) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ host data */

static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static double bf16_to_double(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}

static uint64_t g_rng;
static double uniform_pm1(void) /* splitmix64, uniform in [-1, 1) */
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* A bf16 tensor and its exact double copy (the reference's input). */
typedef struct tensor {
    size_t count;
    uint16_t *bf;
    double *f64;
} tensor;

static tensor tensor_random(size_t count, double scale)
{
    tensor t = {count, malloc(count * 2), malloc(count * 8)};
    if (!t.bf || !t.f64) die("out of host memory (%s)", "inputs");
    for (size_t i = 0; i < count; i++) {
        t.bf[i] = f32_to_bf16((float)(scale * uniform_pm1()));
        t.f64[i] = bf16_to_double(t.bf[i]);
    }
    return t;
}

static void tensor_free(tensor *t)
{
    free(t->bf);
    free(t->f64);
}

/* ------------------------------------------------------------ one layer run */

typedef struct inputs {
    int64_t T;
    const void *x, *wr, *w1, *w2, *dout; /* host, in the layer's dtype */
} inputs;

typedef struct results {
    double fwd_s, bwd_s;        /* median seconds */
    size_t saved_bytes, workspace_bytes;
    char path[96];              /* the layer's path name */
    double *out, *dx;           /* (T, d) */
    double *dw1, *dw2, *dwr;    /* weight gradients (fp32 main-grad) */
} results;

static double *to_host_double(const void *buf, smoe_dtype t, size_t count)
{
    size_t es = t == SMOE_DTYPE_BF16 ? 2 : t == SMOE_DTYPE_F32 ? 4 : 8;
    void *h = malloc(count * es);
    double *d = malloc(count * 8);
    if (!h || !d) die("out of host memory (%s)", "results");
    copy_from(h, buf, count * es);
    for (size_t i = 0; i < count; i++)
        d[i] = t == SMOE_DTYPE_BF16 ? bf16_to_double(((uint16_t *)h)[i])
               : t == SMOE_DTYPE_F32 ? (double)((float *)h)[i]
                                     : ((double *)h)[i];
    free(h);
    return d;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Forward (training) and backward `iters` times after one warm-up; keeps
 * the results of the last iteration. wgrads: 0 the weight gradients are not
 * asked for, 1 computed, 2 computed and copied back into the results. */
static results run_layer(const smoe_layer_desc *desc, const inputs *in, int iters, int wgrads)
{
    results res;
    memset(&res, 0, sizeof res);
    smoe_layer *layer = NULL;
    SMOE_CHECK(smoe_layer_create(desc, &layer));
    g_device_mem = smoe_layer_backend(layer) != SMOE_BACKEND_CPU;
    snprintf(res.path, sizeof res.path, "%s", smoe_layer_path_name(layer));

    const int64_t T = in->T, d = desc->d, n = desc->n, E = desc->E;
    const size_t es = desc->dtype == SMOE_DTYPE_BF16 ? 2 : desc->dtype == SMOE_DTYPE_F32 ? 4 : 8;
    const size_t nx = (size_t)(T * d), nwr = (size_t)(E * d), nw1 = (size_t)(E * 2 * n * d),
                 nw2 = (size_t)(E * d * n);
    res.saved_bytes = smoe_layer_saved_bytes(layer, T, 0);
    res.workspace_bytes = smoe_layer_workspace_bytes(layer, T, 0);
    if (!res.saved_bytes || !res.workspace_bytes) die("sizes: %s", smoe_last_error());

    void *x = alloc_buf(nx * es), *wr = alloc_buf(nwr * es), *w1 = alloc_buf(nw1 * es),
         *w2 = alloc_buf(nw2 * es), *dout = alloc_buf(nx * es), *out = alloc_buf(nx * es),
         *dx = alloc_buf(nx * es), *dwr = wgrads ? alloc_buf(nwr * 4) : NULL,
         *dw1 = wgrads ? alloc_buf(nw1 * 4) : NULL, *dw2 = wgrads ? alloc_buf(nw2 * 4) : NULL,
         *saved = alloc_buf(res.saved_bytes),
         *ws = alloc_buf(res.workspace_bytes);
    copy_to(x, in->x, nx * es);
    copy_to(wr, in->wr, nwr * es);
    copy_to(w1, in->w1, nw1 * es);
    copy_to(w2, in->w2, nw2 * es);
    copy_to(dout, in->dout, nx * es);

    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T;
    fa.x = x;
    fa.router_w = wr;
    fa.w1 = w1;
    fa.w2 = w2;
    fa.out = out;
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T;
    ba.x = x;
    ba.router_w = wr;
    ba.w1 = w1;
    ba.w2 = w2;
    ba.dout = dout;
    ba.dx = (smoe_grad){dx, desc->dtype, 0};
    if (wgrads) {
        ba.drouter_w = (smoe_grad){dwr, SMOE_DTYPE_F32, 0};
        ba.dw1 = (smoe_grad){dw1, SMOE_DTYPE_F32, 0};
        ba.dw2 = (smoe_grad){dw2, SMOE_DTYPE_F32, 0};
    }

    double *tf = malloc(sizeof(double) * (size_t)(iters + 1));
    double *tb = malloc(sizeof(double) * (size_t)(iters + 1));
    if (!tf || !tb) die("out of host memory (%s)", "timers");
    for (int it = 0; it <= iters; it++) { /* iteration 0 warms up */
        device_sync();
        double t0 = now_s();
        SMOE_CHECK(smoe_layer_forward(layer, &fa, saved, res.saved_bytes, ws, res.workspace_bytes,
                                      NULL));
        device_sync();
        double t1 = now_s();
        SMOE_CHECK(smoe_layer_backward(layer, &ba, saved, res.saved_bytes, ws, res.workspace_bytes,
                                       NULL));
        device_sync();
        double t2 = now_s();
        tf[it] = t1 - t0;
        tb[it] = t2 - t1;
    }
    SMOE_CHECK(smoe_layer_device_status(layer, NULL, 1));
    int m = iters > 0 ? iters : 1;
    double *sf = iters > 0 ? tf + 1 : tf, *sb = iters > 0 ? tb + 1 : tb;
    qsort(sf, (size_t)m, sizeof(double), cmp_double);
    qsort(sb, (size_t)m, sizeof(double), cmp_double);
    res.fwd_s = sf[m / 2];
    res.bwd_s = sb[m / 2];
    free(tf);
    free(tb);

    res.out = to_host_double(out, desc->dtype, nx);
    res.dx = to_host_double(dx, desc->dtype, nx);
    if (wgrads == 2) {
        res.dwr = to_host_double(dwr, SMOE_DTYPE_F32, nwr);
        res.dw1 = to_host_double(dw1, SMOE_DTYPE_F32, nw1);
        res.dw2 = to_host_double(dw2, SMOE_DTYPE_F32, nw2);
    }

    void *bufs[] = {x, wr, w1, w2, dout, out, dx, dwr, dw1, dw2, saved, ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free_buf(bufs[i]);
    smoe_layer_free(layer);
    return res;
}

static void results_free(results *r)
{
    free(r->out);
    free(r->dx);
    free(r->dw1);
    free(r->dw2);
    free(r->dwr);
}

/* max |a - b| / max |b| over `count` elements */
static double rel_err(const double *a, const double *b, size_t count)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < count; i++) {
        double e = fabs(a[i] - b[i]), m = fabs(b[i]);
        if (e > num || e != e) num = e;
        if (m > den) den = m;
    }
    return den > 0.0 ? num / den : num;
}

/* ------------------------------------------------------------ main */

static void usage(void)
{
    printf("usage: smoe_run [--config NAME | --shape T,d,n,E,K] [--tokens T]\n"
           "                [--backend cpu|cuda|sm90|auto] [--iters N] [--seed S]\n"
           "                [--check-tokens N] [--no-check] [--list] [--help]\n"
           "One bf16 SwiGLU TOPK_SOFTMAX MoE layer, forward and backward, timed\n"
           "(median of --iters after a warm-up) and checked against the fp64 CPU\n"
           "reference on the first --check-tokens tokens. Default: the small\n"
           "configuration T=%lld d=%lld n=%lld E=%lld K=%lld.\n",
           (long long)smoe_grid_default.T, (long long)smoe_grid_default.d,
           (long long)smoe_grid_default.n, (long long)smoe_grid_default.E,
           (long long)smoe_grid_default.K);
}

static void list_configs(void)
{
    printf("%-11s %6s %5s %5s %4s %3s %10s %12s\n", "config", "T", "d", "n", "E", "K",
           "floor GiB", "sonic TFLOPS");
    for (int i = 0; i < SMOE_GRID_ROWS; i++) {
        const smoe_grid_row *g = &smoe_grid[i];
        printf("%-11s %6lld %5lld %5lld %4lld %3lld %10.2f %5.0f / %4.0f\n", g->name,
               (long long)g->T, (long long)g->d, (long long)g->n, (long long)g->E,
               (long long)g->K, g->floor_act_gib, g->sonicmoe_fwd, g->sonicmoe_bwd);
    }
}

static const char *need_arg(int argc, char **argv, int i)
{
    if (i + 1 >= argc) die("%s needs a value", argv[i]);
    return argv[i + 1];
}

static int64_t parse_pos(const char *s, const char *what)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v <= 0) die("%s must be a positive integer", what);
    return (int64_t)v;
}

int main(int argc, char **argv)
{
    smoe_grid_row cfg = smoe_grid_default;
    const smoe_grid_row *published = NULL;
    smoe_backend backend = SMOE_BACKEND_AUTO;
    int64_t tokens = 0, check_tokens = -1;
    int iters = 3, check = 1;
    uint64_t seed = 1;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--list")) {
            list_configs();
            return 0;
        } else if (!strcmp(a, "--config")) {
            const char *name = need_arg(argc, argv, i++);
            published = NULL;
            for (int g = 0; g < SMOE_GRID_ROWS; g++)
                if (!strcmp(smoe_grid[g].name, name)) published = &smoe_grid[g];
            if (!strcmp(name, "small")) {
                cfg = smoe_grid_default;
            } else {
                if (!published) die("unknown config %s (--list shows them)", name);
                cfg = *published;
            }
        } else if (!strcmp(a, "--shape")) {
            const char *s = need_arg(argc, argv, i++);
            long long v[5];
            if (sscanf(s, "%lld,%lld,%lld,%lld,%lld", &v[0], &v[1], &v[2], &v[3], &v[4]) != 5)
                die("--shape %s: expected T,d,n,E,K", s);
            cfg = smoe_grid_default;
            cfg.name = "custom";
            cfg.T = v[0];
            cfg.d = v[1];
            cfg.n = v[2];
            cfg.E = v[3];
            cfg.K = v[4];
            published = NULL;
        } else if (!strcmp(a, "--tokens")) {
            tokens = parse_pos(need_arg(argc, argv, i++), "--tokens");
        } else if (!strcmp(a, "--check-tokens")) {
            check_tokens = parse_pos(need_arg(argc, argv, i++), "--check-tokens");
        } else if (!strcmp(a, "--iters")) {
            iters = (int)parse_pos(need_arg(argc, argv, i++), "--iters");
        } else if (!strcmp(a, "--seed")) {
            seed = (uint64_t)parse_pos(need_arg(argc, argv, i++), "--seed");
        } else if (!strcmp(a, "--no-check")) {
            check = 0;
        } else if (!strcmp(a, "--backend")) {
            const char *b = need_arg(argc, argv, i++);
            if (!strcmp(b, "cpu")) backend = SMOE_BACKEND_CPU;
            else if (!strcmp(b, "cuda")) backend = SMOE_BACKEND_CUDA;
            else if (!strcmp(b, "sm90")) backend = SMOE_BACKEND_SM90;
            else if (!strcmp(b, "auto")) backend = SMOE_BACKEND_AUTO;
            else die("--backend %s: expected cpu, cuda, sm90 or auto", b);
        } else {
            die("unknown option %s (--help)", a);
        }
    }
    if (cfg.T <= 0 || cfg.d <= 0 || cfg.n <= 0 || cfg.E <= 0 || cfg.K <= 0 || cfg.K > cfg.E)
        die("invalid shape in %s (need T,d,n,E,K > 0 and K <= E)", cfg.name);
    if (tokens > 0) {
        cfg.T = tokens;
        published = NULL; /* a different T: the published numbers do not apply */
    }
    const int64_t T = cfg.T, d = cfg.d, n = cfg.n, E = cfg.E, K = cfg.K;

    smoe_layer_desc desc = smoe_layer_desc_default();
    desc.d = d;
    desc.n = n;
    desc.E = E;
    desc.K = K;
    desc.dtype = SMOE_DTYPE_BF16;
    desc.backend = backend;

    /* The CPU's speed on this code, roughly: a warning before hours. */
    const double flops_fwd = 6.0 * (double)T * (double)K * (double)d * (double)n;
    {
        smoe_layer *probe = NULL;
        SMOE_CHECK(smoe_layer_create(&desc, &probe));
        int cpu = smoe_layer_backend(probe) == SMOE_BACKEND_CPU;
        smoe_layer_free(probe);
        int64_t ct = check_tokens < 0 ? (T <= 4096 ? T : 256) : check_tokens;
        double est = 3.0 * flops_fwd * ((iters + 1) + (check ? (double)ct / (double)T : 0.0)) / 2e9;
        if (cpu && est > 60.0)
            fprintf(stderr,
                    "smoe_run: warning: %s on the CPU backend is about %.0f minutes at ~2 "
                    "GFLOP/s; --tokens T runs fewer tokens, --iters 1 fewer repetitions\n",
                    cfg.name, est / 60.0);
    }

    /* inputs: x, dO ~ U(-1, 1); weights U(-1, 1) / sqrt(fan-in) */
    g_rng = seed;
    tensor x = tensor_random((size_t)(T * d), 1.0);
    tensor wr = tensor_random((size_t)(E * d), 1.0 / sqrt((double)d));
    tensor w1 = tensor_random((size_t)(E * 2 * n * d), 1.0 / sqrt((double)d));
    tensor w2 = tensor_random((size_t)(E * d * n), 1.0 / sqrt((double)n));
    tensor dout = tensor_random((size_t)(T * d), 1.0);

    inputs in = {T, x.bf, wr.bf, w1.bf, w2.bf, dout.bf};
    if (check_tokens < 0) check_tokens = T <= 4096 ? T : 256;
    if (check_tokens > T) check_tokens = T;
    const int full_check = check && check_tokens == T;
    results r = run_layer(&desc, &in, iters, full_check ? 2 : 1);

    /* the fp64 reference on the first check_tokens tokens */
    int pass = 1;
    double e_out = 0, e_dx = 0, e_dw1 = -1, e_dw2 = -1, e_dwr = -1;
    const double tol = 2e-2; /* bf16 storage: ~2^-8 per rounding, a few in a row */
    if (check) {
        smoe_layer_desc ref = desc;
        ref.dtype = SMOE_DTYPE_F64;
        ref.backend = SMOE_BACKEND_CPU;
        inputs rin = {check_tokens, x.f64, wr.f64, w1.f64, w2.f64, dout.f64};
        int saved_mem = g_device_mem;
        results rr = run_layer(&ref, &rin, 0, full_check ? 2 : 0);
        g_device_mem = saved_mem;
        size_t nc = (size_t)(check_tokens * d);
        e_out = rel_err(r.out, rr.out, nc);
        e_dx = rel_err(r.dx, rr.dx, nc);
        pass = e_out <= tol && e_dx <= tol;
        if (full_check) {
            e_dw1 = rel_err(r.dw1, rr.dw1, (size_t)(E * 2 * n * d));
            e_dw2 = rel_err(r.dw2, rr.dw2, (size_t)(E * d * n));
            e_dwr = rel_err(r.dwr, rr.dwr, (size_t)(E * d));
            pass = pass && e_dw1 <= tol && e_dw2 <= tol && e_dwr <= tol;
        }
        results_free(&rr);
    }

    /* report */
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double tk = (double)T * (double)K;
    const double act = (double)r.saved_bytes + 2.0 * (double)T * (double)d;
    const double floor_b = 4.0 * tk * (double)n + 2.0 * (double)T * (double)d + 16.0 * tk;
    printf("smoe %s  config %s: T=%lld d=%lld n=%lld E=%lld K=%lld, bf16 SwiGLU TOPK_SOFTMAX\n",
           smoe_version_string(), cfg.name, (long long)T, (long long)d, (long long)n,
           (long long)E, (long long)K);
    printf("backend path: %s   (median of %d after a warm-up)\n", r.path, iters);
    printf("%-11s %10s %8s %10s %8s %10s %10s\n", "config", "fwd ms", "TFLOPS", "bwd ms", "TFLOPS",
           "act GiB", "floor GiB");
    printf("%-11s %10.3f %8.3f %10.3f %8.3f %10.4f %10.4f\n", cfg.name, r.fwd_s * 1e3,
           flops_fwd / r.fwd_s * 1e-12, r.bwd_s * 1e3, 2.0 * flops_fwd / r.bwd_s * 1e-12,
           act / gib, floor_b / gib);
    printf("activation memory: saved block %.4f GiB + O %.4f GiB; floor = H 4TKn + O 2Td + "
           "metadata 16TK; workspace %.4f GiB (transient)\n",
           (double)r.saved_bytes / gib, 2.0 * (double)T * (double)d / gib,
           (double)r.workspace_bytes / gib);
    if (published)
        printf("published (H100): SonicMoE %.0f / %.0f TFLOPS fwd/bwd, floor %.2f GiB; "
               "torch grouped_mm %.1f / %.1f, %.2f GiB; ScatterMoE %.1f / %.1f, %.2f GiB; "
               "GEMM bound %.0f / %.0f\n",
               published->sonicmoe_fwd, published->sonicmoe_bwd, published->floor_act_gib,
               published->torch_fwd, published->torch_bwd, published->torch_act_gib,
               published->scattermoe_fwd, published->scattermoe_bwd,
               published->scattermoe_act_gib, published->gemm_bound_fwd,
               published->gemm_bound_bwd);
    if (check) {
        printf("check vs fp64 reference on %lld of %lld tokens: rel err O %.2e, dX %.2e", (long long)check_tokens,
               (long long)T, e_out, e_dx);
        if (e_dw1 >= 0)
            printf(", dW1 %.2e, dW2 %.2e, dWr %.2e", e_dw1, e_dw2, e_dwr);
        printf("  (tolerance %.0e): %s\n", tol, pass ? "PASS" : "FAIL");
    } else {
        printf("check skipped (--no-check)\n");
    }

    results_free(&r);
    tensor_free(&x);
    tensor_free(&wr);
    tensor_free(&w1);
    tensor_free(&w2);
    tensor_free(&dout);
    return pass ? 0 : 1;
}
