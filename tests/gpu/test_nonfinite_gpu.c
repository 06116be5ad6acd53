/*
 * test_nonfinite_gpu.c -- NaN and infinities on the GPU (smoe.h, "Non-finite
 * values"): one NaN or inf put into x (one token), the router weight (one
 * expert), W1 or W2 (one element of one expert) or dout (one token), for
 * TOPK_SOFTMAX, SOFTMAX_TOPK and token rounding, on the CUDA and SM90
 * backends. The CPU backend in BF16 on the same inputs is the reference
 * (python/tests/test_nonfinite.py checks the CPU backend against PyTorch):
 * out, router logits and every gradient must be non-finite in exactly the
 * same places, and agree where finite. Cases whose clean routing has a near
 * tie (the GPU's and the CPU's fp32 logits may order it differently) are
 * redrawn. Skips without a GPU.
 */
#include "testutil_cuda.h"

enum { INJ_X, INJ_WR, INJ_W1, INJ_W2, INJ_DOUT, INJ_N };
static const char *inj_name[INJ_N] = {"x", "router_w", "w1", "w2", "dout"};

/* outputs compared: out, logits, dx, dwr, dw1, dw2, db1, db2 */
enum { O_OUT, O_LOG, O_DX, O_DWR, O_DW1, O_DW2, O_DB1, O_DB2, O_N };
static const char *o_name[O_N] = {"out", "router_logits", "dx", "drouter_w", "dw1", "dw2", "db1",
                                  "db2"};

typedef struct result {
    double *v[O_N];
    size_t n[O_N];
} result;

static void result_free(result *r) {
    for (int i = 0; i < O_N; i++) free(r->v[i]);
}

/* The layer on the GPU: forward (logits out) + backward, gradients fp32
 * (dx bf16). */
static int gpu_run(const smoe_layer_desc *D0, const tu_problem *P, const double *dout, result *r) {
    smoe_layer_desc D = *D0;
    smoe_layer *L = tu_layer(&D);
    if (!L) return 0;
    const int64_t T = P->T, d = D.d, n = D.n, E = D.E, hc = P->hc;
    const smoe_dtype bf = SMOE_DTYPE_BF16, f32 = SMOE_DTYPE_F32;
    void *x = tu_dev_to_dtype(bf, P->x, (size_t)(T * d));
    void *wr = tu_dev_to_dtype(bf, P->wr, (size_t)(E * d));
    void *w1 = tu_dev_to_dtype(bf, P->w1, (size_t)(E * hc * d));
    void *w2 = tu_dev_to_dtype(bf, P->w2, (size_t)(E * d * n));
    void *b1 = tu_dev_to_dtype(bf, P->b1, (size_t)(E * hc));
    void *b2 = tu_dev_to_dtype(bf, P->b2, (size_t)(E * d));
    void *dO = tu_dev_to_dtype(bf, dout, (size_t)(T * d));
    const size_t sb = smoe_layer_saved_bytes(L, T, 0), wb = smoe_layer_workspace_bytes(L, T, 0);
    void *saved, *ws, *out, *lg, *g[6];
    CUDA_OK(cudaMalloc(&saved, sb));
    CUDA_OK(cudaMalloc(&ws, wb));
    CUDA_OK(cudaMalloc(&out, (size_t)(T * d) * 2));
    CUDA_OK(cudaMalloc(&lg, (size_t)(T * E) * 4));
    const size_t gn[6] = {(size_t)(T * d), (size_t)(E * d), (size_t)(E * hc * d),
                          (size_t)(E * d * n), (size_t)(E * hc), (size_t)(E * d)};
    for (int i = 0; i < 6; i++) CUDA_OK(cudaMalloc(&g[i], gn[i] * 4));
    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T; fa.x = x; fa.router_w = wr; fa.w1 = w1; fa.b1 = b1; fa.w2 = w2; fa.b2 = b2;
    fa.out = out; fa.router_logits = (float *)lg;
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T; ba.x = x; ba.router_w = wr; ba.w1 = w1; ba.w2 = w2; ba.b2 = b2; ba.dout = dO;
    ba.dx = (smoe_grad){g[0], SMOE_DTYPE_BF16, 0};
    ba.drouter_w = (smoe_grad){g[1], SMOE_DTYPE_F32, 0};
    ba.dw1 = (smoe_grad){g[2], SMOE_DTYPE_F32, 0};
    ba.dw2 = (smoe_grad){g[3], SMOE_DTYPE_F32, 0};
    ba.db1 = (smoe_grad){g[4], SMOE_DTYPE_F32, 0};
    ba.db2 = (smoe_grad){g[5], SMOE_DTYPE_F32, 0};
    smoe_status st = smoe_layer_forward(L, &fa, saved, sb, ws, wb, NULL);
    if (st == SMOE_SUCCESS) st = smoe_layer_backward(L, &ba, saved, sb, ws, wb, NULL);
    if (st == SMOE_SUCCESS) st = smoe_layer_device_status(L, NULL, 1);
    CHECK(st == SMOE_SUCCESS, "gpu: %s: %s", smoe_status_string(st), smoe_last_error());
    r->n[O_OUT] = (size_t)(T * d);
    r->v[O_OUT] = tu_dev_from_dtype(bf, out, r->n[O_OUT]);
    r->n[O_LOG] = (size_t)(T * E);
    r->v[O_LOG] = tu_dev_from_dtype(f32, lg, r->n[O_LOG]);
    r->n[O_DX] = gn[0];
    r->v[O_DX] = tu_dev_from_dtype(bf, g[0], gn[0]);
    for (int i = 1; i < 6; i++) {
        r->n[O_DX + i] = gn[i];
        r->v[O_DX + i] = tu_dev_from_dtype(f32, g[i], gn[i]);
    }
    void *bufs[] = {x, wr, w1, w2, b1, b2, dO, saved, ws, out, lg};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    for (int i = 0; i < 6; i++) cudaFree(g[i]);
    smoe_layer_free(L);
    return st == SMOE_SUCCESS;
}

/* The CPU backend in BF16 on the same problem. */
static int cpu_run(const smoe_layer_desc *D0, const tu_problem *P0, const double *dout, result *r) {
    smoe_layer_desc D = *D0;
    D.backend = SMOE_BACKEND_CPU;
    tu_problem P = *P0;
    P.desc = D;
    smoe_layer *L = tu_layer(&D);
    if (!L) return 0;
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, &P, SMOE_DTYPE_F32);
    void *G = tu_to_dtype(SMOE_DTYPE_BF16, dout, (size_t)(P.T * D.d));
    const int ok = tu_run_backward(L, &P, &B, G, NULL, &g, 0);
    r->n[O_OUT] = (size_t)(P.T * D.d);
    r->v[O_OUT] = tu_from_dtype(SMOE_DTYPE_BF16, B.out, r->n[O_OUT]);
    r->n[O_LOG] = (size_t)(P.T * D.E);
    r->v[O_LOG] = tu_from_dtype(SMOE_DTYPE_F32, B.logits, r->n[O_LOG]);
    const int gi[6] = {TU_GX, TU_GWR, TU_GW1, TU_GW2, TU_GB1, TU_GB2};
    for (int i = 0; i < 6; i++) {
        r->n[O_DX + i] = g.n[gi[i]];
        r->v[O_DX + i] = tu_grad_d(&g, gi[i]);
    }
    free(G);
    tu_grads_free(&g);
    tu_bufs_free(&B);
    smoe_layer_free(L);
    return ok;
}

static void compare(const result *gpu, const result *cpu) {
    for (int o = 0; o < O_N; o++) {
        const size_t n = cpu->n[o];
        size_t bad = (size_t)-1, nonfinite = 0;
        double scale = 0.0, err = 0.0;
        for (size_t i = 0; i < n; i++) {
            const int fg = isfinite(gpu->v[o][i]) != 0, fc = isfinite(cpu->v[o][i]) != 0;
            if (fg != fc && bad == (size_t)-1) bad = i;
            nonfinite += !fc;
            if (fc) scale = fmax(scale, fabs(cpu->v[o][i]));
        }
        for (size_t i = 0; i < n; i++)
            if (isfinite(gpu->v[o][i]) && isfinite(cpu->v[o][i]))
                err = fmax(err, fabs(gpu->v[o][i] - cpu->v[o][i]));
        CHECK(bad == (size_t)-1, "%s[%zu]: gpu %g, cpu %g (%zu of %zu non-finite on the cpu)",
              o_name[o], bad, bad == (size_t)-1 ? 0.0 : gpu->v[o][bad],
              bad == (size_t)-1 ? 0.0 : cpu->v[o][bad], nonfinite, n);
        CHECK(err <= 0.05 * scale + 1e-3, "%s: finite entries differ by %g (scale %g)", o_name[o],
              err, scale);
    }
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 23));
    const int cc = tu_gpu_cc("test_nonfinite_gpu");
    if (!cc) return 0;
    const int sm90 = cc == 90;
    int redrawn = 0;
    for (int b = 0; b < 2; b++) {
        if (b == 1 && !sm90) continue;
        for (int mode = 0; mode < 3; mode++)
            for (int inj = 0; inj < INJ_N; inj++)
                for (int nan = 0; nan < 2; nan++) {
                    smoe_layer_desc D = smoe_layer_desc_default();
                    D.d = 64; D.n = 64; D.E = 8; D.K = 2;
                    D.has_bias = 1;
                    D.routing = mode == 0 ? SMOE_ROUTING_TOPK_SOFTMAX : SMOE_ROUTING_SOFTMAX_TOPK;
                    D.renormalize = 1;
                    D.rounding = mode == 2 ? SMOE_ROUND_UP : SMOE_ROUND_OFF;
                    D.round_tile = 4;
                    D.backend = b ? SMOE_BACKEND_SM90 : SMOE_BACKEND_CUDA;
                    const int64_t T = 24;
                    tu_problem P;
                    double *dout = NULL;
                    for (int tries = 0;; tries++) {
                        tu_problem_init(&P, &D, T, &rng, 1.0, 0.2);
                        if (tu_selection_margin(&P) > 2e-2 || tries > 20) break;
                        tu_problem_free(&P);
                        redrawn++;
                    }
                    dout = tu_alloc_d((size_t)(T * D.d));
                    tu_fill_normal(&rng, dout, (size_t)(T * D.d), 1.0);
                    tu_round_array(SMOE_DTYPE_BF16, dout, (size_t)(T * D.d));
                    const double v = nan ? NAN : INFINITY;
                    const int64_t t = 5, e = 3, hc = P.hc;
                    switch (inj) {
                    case INJ_X: P.x[t * D.d + 7] = v; break;
                    case INJ_WR: P.wr[e * D.d + 11] = v; break;
                    case INJ_W1: P.w1[(e * hc + 9) * D.d + 2] = v; break;
                    case INJ_W2: P.w2[(e * D.d + 4) * D.n + 30] = v; break;
                    default: dout[t * D.d + 13] = v; break;
                    }
                    tu_case("%s %s: %s in %s", b ? "sm90" : "cuda", tu_mode_name(&D),
                            nan ? "NaN" : "+inf", inj_name[inj]);
                    result rg, rc;
                    memset(&rg, 0, sizeof rg);
                    memset(&rc, 0, sizeof rc);
                    if (gpu_run(&D, &P, dout, &rg) && cpu_run(&D, &P, dout, &rc)) compare(&rg, &rc);
                    result_free(&rg);
                    result_free(&rc);
                    free(dout);
                    tu_problem_free(&P);
                }
    }
    printf("test_nonfinite_gpu: %d draws redrawn for a near tie\n", redrawn);
    return tu_summary("test_nonfinite_gpu");
}
