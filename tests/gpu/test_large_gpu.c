/*
 * test_large_gpu.c -- 64-bit sizes on the GPU: a whole forward + backward
 * whose H has more than 2^32 elements (d = 64, n = 4096, E = 128, K = 8,
 * T = 66560: 532480 routed rows x 8192 columns), so every row x column
 * product of the kernels passes 2^31, on the CUDA and SM90 backends.
 *
 * Routing is GENERAL, chosen so that it can be checked on the CPU: every
 * token has K = 8 experts among the first E - 1, and 48 sampled tokens
 * (spread over T, the last one included) also the last expert E - 1, whose
 * rows are then the last rows of H (offsets near 4.4e9). The CPU backend runs
 * only the sampled tokens (F64 exact and BF16, the bf16-rounding
 * reference), which gives their outputs, dx rows and pair-score gradients,
 * and the whole weight and bias gradients of expert E - 1, the sampled
 * tokens being its only rows. FA3's rule: err(gpu, f64) <= 2 err(bf16 cpu,
 * f64) + atol. Guard bytes after the saved block and the workspace must
 * be untouched, and the sizes the GPU asked for must hold what it wrote.
 *
 * A second run routes by TOPK_SOFTMAX (token choice); its sampled rows are
 * checked the same way with the GPU's own router logits routed on the CPU
 * (smoe_route_cpu) as the triples of the reference.
 *
 * Needs about 24 GB of device memory; skips (exit 0, says so) without a
 * GPU or with less memory free.
 */
#include "testutil_cuda.h"

enum { D_ = 64, N_ = 4096, E_ = 128, K_ = 8, T_ = 66560, S_ = 48, GUARD = 4096 };

static int64_t sample_token(int i) { return i == S_ - 1 ? T_ - 1 : (int64_t)i * (T_ / S_) + 7; }

/* The sampled tokens' problem for the CPU: their x rows, the weights, and
 * the triples (token renumbered 0..S-1). */
typedef struct sample {
    tu_problem P;
    double *dout; /* (S, d) */
} sample;

/* CPU run of the sample: out, dx, dpair_score, and the weight gradients. */
typedef struct cpu_res {
    double *out, *dx, *dps, *dw1, *dw2, *db1, *db2;
} cpu_res;

static void cpu_run(const sample *s, smoe_dtype dt, cpu_res *r) {
    smoe_layer_desc D = s->P.desc;
    D.dtype = dt;
    D.backend = SMOE_BACKEND_CPU;
    tu_problem P = s->P;
    P.desc = D;
    smoe_layer *L = tu_layer(&D);
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    tu_grads g;
    tu_grads_alloc(&g, &P, dt == SMOE_DTYPE_F64 ? SMOE_DTYPE_F64 : SMOE_DTYPE_F32);
    void *G = tu_to_dtype(dt, s->dout, (size_t)(S_ * D_));
    tu_run_backward(L, &P, &B, G, NULL, &g, 0);
    r->out = tu_from_dtype(dt, B.out, (size_t)(S_ * D_));
    r->dx = tu_grad_d(&g, TU_GX);
    r->dps = tu_grad_d(&g, TU_GPS);
    r->dw1 = tu_grad_d(&g, TU_GW1);
    r->dw2 = tu_grad_d(&g, TU_GW2);
    r->db1 = tu_grad_d(&g, TU_GB1);
    r->db2 = tu_grad_d(&g, TU_GB2);
    free(G);
    tu_grads_free(&g);
    tu_bufs_free(&B);
    smoe_layer_free(L);
}

static void cpu_res_free(cpu_res *r) {
    free(r->out); free(r->dx); free(r->dps); free(r->dw1); free(r->dw2); free(r->db1); free(r->db2);
}

/* FA3's rule on n values at a stride (a slice of a bigger tensor). */
static void fa3(const char *what, const double *gpu, const double *f64, const double *b16,
                size_t n) {
    const double scale = tu_max_abs(f64, n) + 1e-30;
    const double eg = tu_max_abs_diff(gpu, f64, n) / scale;
    const double eb = tu_max_abs_diff(b16, f64, n) / scale;
    CHECK(eg <= 2.0 * eb + 2e-3, "%s: err(gpu) %.3g > 2 err(bf16 cpu) %.3g + 2e-3", what, eg, eb);
}

static int guard_ok(const void *dptr, size_t bytes) {
    unsigned char *h = (unsigned char *)tu_dev_fetch((const char *)dptr + bytes, GUARD);
    int ok = 1;
    for (int i = 0; i < GUARD; i++) ok &= h[i] == 0x5C;
    free(h);
    return ok;
}

static void run(smoe_backend backend, int token_choice, tu_rng *rng) {
    const char *bname = backend == SMOE_BACKEND_SM90 ? "sm90" : "cuda";
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = D_; D.n = N_; D.E = E_; D.K = token_choice ? K_ : 0;
    D.routing = token_choice ? SMOE_ROUTING_TOPK_SOFTMAX : SMOE_ROUTING_GENERAL;
    D.has_bias = 1;
    D.dtype = SMOE_DTYPE_BF16;
    D.backend = backend;
    tu_case("large %s %s: create", bname, token_choice ? "topk-softmax" : "general");
    smoe_layer *L = tu_layer(&D);
    if (!L) return;
    const int64_t hc = 2 * N_;

    /* weights (shared with the sample) and x */
    tu_problem W;
    tu_problem_init(&W, &D, T_, rng, 1.0, 0.05);
    /* GENERAL triples */
    const int64_t np = (int64_t)T_ * K_;
    int32_t *pt = NULL, *pe = NULL;
    float *ps = NULL;
    if (!token_choice) {
        pt = (int32_t *)malloc((size_t)np * 4);
        pe = (int32_t *)malloc((size_t)np * 4);
        ps = (float *)malloc((size_t)np * 4);
        int si = 0;
        for (int64_t t = 0; t < T_; t++) {
            const int sampled = si < S_ && sample_token(si) == t;
            for (int k = 0; k < K_; k++) {
                const int64_t i = t * K_ + k;
                pt[i] = (int32_t)t;
                pe[i] = (sampled && k == K_ - 1) ? E_ - 1 : (int32_t)((t * 37 + k * 11) % (E_ - 1));
                ps[i] = (float)(0.1 + 0.8 * tu_uniform(rng));
            }
            si += sampled;
        }
    }
    const size_t xb = (size_t)T_ * D_ * 2;
    double *dout = tu_alloc_d((size_t)T_ * D_);
    tu_fill_normal(rng, dout, (size_t)T_ * D_, 1.0);
    tu_round_array(D.dtype, dout, (size_t)T_ * D_);
    void *x = tu_dev_to_dtype(D.dtype, W.x, (size_t)T_ * D_);
    void *w1 = tu_dev_to_dtype(D.dtype, W.w1, (size_t)E_ * hc * D_);
    void *w2 = tu_dev_to_dtype(D.dtype, W.w2, (size_t)E_ * D_ * N_);
    void *b1 = tu_dev_to_dtype(D.dtype, W.b1, (size_t)E_ * hc);
    void *b2 = tu_dev_to_dtype(D.dtype, W.b2, (size_t)E_ * D_);
    void *wr = tu_dev_to_dtype(D.dtype, W.wr, (size_t)E_ * D_);
    void *dO = tu_dev_to_dtype(D.dtype, dout, (size_t)T_ * D_);
    int32_t *dpt = token_choice ? NULL : (int32_t *)tu_dev_put(pt, (size_t)np * 4);
    int32_t *dpe = token_choice ? NULL : (int32_t *)tu_dev_put(pe, (size_t)np * 4);
    float *dps = token_choice ? NULL : (float *)tu_dev_put(ps, (size_t)np * 4);
    const int64_t pairs = token_choice ? 0 : np;
    const size_t sb = smoe_layer_saved_bytes(L, T_, pairs), wb = smoe_layer_workspace_bytes(L, T_, pairs);
    size_t free_b = 0, total_b = 0;
    CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
    const size_t grads_b = (size_t)E_ * hc * D_ * 4 + (size_t)E_ * D_ * N_ * 4 + xb + (size_t)np * 4;
    if (sb + wb + grads_b + xb + 2 * GUARD + ((size_t)1 << 30) > free_b) {
        printf("test_large_gpu: needs %.1f GB, %.1f GB free: %s skipped\n",
               (double)(sb + wb + grads_b) / 1e9, (double)free_b / 1e9, bname);
        smoe_layer_free(L);
        tu_problem_free(&W);
        return;
    }
    printf("  %s %s: H %lld x %lld = %.3g elements, saved %.2f GB, workspace %.2f GB\n", bname,
           token_choice ? "topk-softmax" : "general", (long long)np, (long long)hc,
           (double)np * (double)hc, (double)sb / 1e9, (double)wb / 1e9);
    void *saved = NULL, *ws = NULL, *out = NULL;
    CUDA_OK(cudaMalloc(&saved, sb + GUARD));
    CUDA_OK(cudaMalloc(&ws, wb + GUARD));
    CUDA_OK(cudaMemset((char *)saved + sb, 0x5C, GUARD));
    CUDA_OK(cudaMemset((char *)ws + wb, 0x5C, GUARD));
    CUDA_OK(cudaMalloc(&out, xb));
    float *logits = NULL;
    if (token_choice) CUDA_OK(cudaMalloc((void **)&logits, (size_t)T_ * E_ * 4));
    void *gdx, *gdw1, *gdw2, *gdb1, *gdb2, *gdps = NULL;
    CUDA_OK(cudaMalloc(&gdx, xb));
    CUDA_OK(cudaMalloc(&gdw1, (size_t)E_ * hc * D_ * 4));
    CUDA_OK(cudaMalloc(&gdw2, (size_t)E_ * D_ * N_ * 4));
    CUDA_OK(cudaMalloc(&gdb1, (size_t)E_ * hc * 4));
    CUDA_OK(cudaMalloc(&gdb2, (size_t)E_ * D_ * 4));
    if (!token_choice) CUDA_OK(cudaMalloc(&gdps, (size_t)np * 4));

    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T_; fa.x = x; fa.w1 = w1; fa.b1 = b1; fa.w2 = w2; fa.b2 = b2; fa.out = out;
    if (token_choice) {
        fa.router_w = wr;
        fa.router_logits = logits;
    } else {
        fa.pairs = np; fa.pair_token = dpt; fa.pair_expert = dpe; fa.pair_score = dps;
    }
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = T_; ba.x = x; ba.router_w = token_choice ? wr : NULL; ba.pairs = pairs;
    ba.w1 = w1; ba.w2 = w2; ba.b2 = b2; ba.dout = dO;
    ba.dx = (smoe_grad){gdx, SMOE_DTYPE_BF16, 0};
    ba.dw1 = (smoe_grad){gdw1, SMOE_DTYPE_F32, 0};
    ba.dw2 = (smoe_grad){gdw2, SMOE_DTYPE_F32, 0};
    ba.db1 = (smoe_grad){gdb1, SMOE_DTYPE_F32, 0};
    ba.db2 = (smoe_grad){gdb2, SMOE_DTYPE_F32, 0};
    ba.dpair_score = (smoe_grad){gdps, SMOE_DTYPE_F32, 0};
    tu_case("large %s %s: forward + backward", bname, token_choice ? "topk-softmax" : "general");
    CHECK_OK(smoe_layer_forward(L, &fa, saved, sb, ws, wb, NULL));
    CHECK_OK(smoe_layer_backward(L, &ba, saved, sb, ws, wb, NULL));
    CHECK_OK(smoe_layer_device_status(L, NULL, 1));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(guard_ok(saved, sb), "bytes written past saved_bytes = %zu", sb);
    CHECK(guard_ok(ws, wb), "bytes written past workspace_bytes = %zu", wb);

    /* the sample's problem: its rows of x and dout, its triples */
    sample s;
    memset(&s, 0, sizeof s);
    s.P = W;
    s.P.T = S_;
    s.P.x = tu_alloc_d((size_t)S_ * D_);
    s.dout = tu_alloc_d((size_t)S_ * D_);
    s.P.pairs = S_ * K_;
    s.P.pt = (int32_t *)malloc((size_t)S_ * K_ * 4);
    s.P.pe = (int32_t *)malloc((size_t)S_ * K_ * 4);
    s.P.ps = tu_alloc_d((size_t)S_ * K_);
    s.P.desc.routing = SMOE_ROUTING_GENERAL;
    s.P.desc.K = 0;
    float *glog = token_choice ? (float *)tu_dev_fetch(logits, (size_t)T_ * E_ * 4) : NULL;
    for (int i = 0; i < S_; i++) {
        const int64_t t = sample_token(i);
        memcpy(s.P.x + (size_t)i * D_, W.x + (size_t)t * D_, D_ * sizeof(double));
        memcpy(s.dout + (size_t)i * D_, dout + (size_t)t * D_, D_ * sizeof(double));
        if (token_choice) {
            /* the GPU's logits of this token, routed on the CPU */
            smoe_layer_desc R = D;
            int32_t ex[K_];
            float sc[K_];
            smoe_routing_result res;
            memset(&res, 0, sizeof res);
            res.expert = ex;
            res.score = sc;
            CHECK_OK(smoe_route_cpu(&R, 1, glog + (size_t)t * E_, &res));
            /* sorted by expert within the token: any order is allowed */
            for (int k = 0; k < K_; k++) {
                s.P.pt[i * K_ + k] = i;
                s.P.pe[i * K_ + k] = ex[k];
                s.P.ps[i * K_ + k] = sc[k];
            }
        } else {
            for (int k = 0; k < K_; k++) {
                s.P.pt[i * K_ + k] = i;
                s.P.pe[i * K_ + k] = pe[t * K_ + k];
                s.P.ps[i * K_ + k] = ps[t * K_ + k];
            }
        }
    }
    cpu_res r64, r16;
    cpu_run(&s, SMOE_DTYPE_F64, &r64);
    cpu_run(&s, SMOE_DTYPE_BF16, &r16);

    /* the GPU's rows of the sampled tokens */
    uint16_t *hout = (uint16_t *)tu_dev_fetch(out, xb), *hdx = (uint16_t *)tu_dev_fetch(gdx, xb);
    double *gout = tu_alloc_d((size_t)S_ * D_), *gdxs = tu_alloc_d((size_t)S_ * D_);
    for (int i = 0; i < S_; i++)
        for (int c = 0; c < D_; c++) {
            const int64_t t = sample_token(i);
            gout[i * D_ + c] = tu_bf16_to_f32(hout[t * D_ + c]);
            gdxs[i * D_ + c] = tu_bf16_to_f32(hdx[t * D_ + c]);
        }
    tu_case("large %s %s: sampled rows", bname, token_choice ? "topk-softmax" : "general");
    fa3("out (sampled tokens)", gout, r64.out, r16.out, (size_t)S_ * D_);
    if (!token_choice) {
        /* dx, its router share absent (GENERAL), and expert E-1's gradients */
        fa3("dx (sampled tokens)", gdxs, r64.dx, r16.dx, (size_t)S_ * D_);
        float *hps = (float *)tu_dev_fetch(gdps, (size_t)np * 4);
        double *gps = tu_alloc_d((size_t)S_ * K_);
        for (int i = 0; i < S_; i++)
            for (int k = 0; k < K_; k++) gps[i * K_ + k] = hps[sample_token(i) * K_ + k];
        fa3("dpair_score (sampled pairs)", gps, r64.dps, r16.dps, (size_t)S_ * K_);
        const size_t w1e = (size_t)hc * D_, w2e = (size_t)D_ * N_;
        const smoe_dtype f32 = SMOE_DTYPE_F32;
        double *g1 = tu_dev_from_dtype(f32, (float *)gdw1 + (size_t)(E_ - 1) * w1e, w1e);
        double *g2 = tu_dev_from_dtype(f32, (float *)gdw2 + (size_t)(E_ - 1) * w2e, w2e);
        double *gb1 = tu_dev_from_dtype(f32, (float *)gdb1 + (size_t)(E_ - 1) * hc, (size_t)hc);
        double *gb2 = tu_dev_from_dtype(f32, (float *)gdb2 + (size_t)(E_ - 1) * D_, (size_t)D_);
        fa3("dW1[E-1]", g1, r64.dw1 + (E_ - 1) * w1e, r16.dw1 + (E_ - 1) * w1e, w1e);
        fa3("dW2[E-1]", g2, r64.dw2 + (E_ - 1) * w2e, r16.dw2 + (E_ - 1) * w2e, w2e);
        fa3("db1[E-1]", gb1, r64.db1 + (E_ - 1) * hc, r16.db1 + (E_ - 1) * hc, (size_t)hc);
        fa3("db2[E-1]", gb2, r64.db2 + (E_ - 1) * D_, r16.db2 + (E_ - 1) * D_, (size_t)D_);
        free(hps); free(gps); free(g1); free(g2); free(gb1); free(gb2);
    }
    cpu_res_free(&r64);
    cpu_res_free(&r16);
    free(hout); free(hdx); free(gout); free(gdxs); free(glog);
    free(s.P.x); free(s.dout); free(s.P.pt); free(s.P.pe); free(s.P.ps);

    cudaFree(saved); cudaFree(ws); cudaFree(out); cudaFree(logits);
    cudaFree(gdx); cudaFree(gdw1); cudaFree(gdw2); cudaFree(gdb1); cudaFree(gdb2); cudaFree(gdps);
    cudaFree(x); cudaFree(w1); cudaFree(w2); cudaFree(b1); cudaFree(b2); cudaFree(wr); cudaFree(dO);
    cudaFree(dpt); cudaFree(dpe); cudaFree(dps);
    free(dout);
    free(pt); free(pe); free(ps);
    tu_problem_free(&W);
    smoe_layer_free(L);
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 31));
    const int cc = tu_gpu_cc("test_large_gpu");
    if (!cc) return 0;
    const int sm90 = cc == 90;
    for (int tc = 0; tc < 2; tc++) {
        run(SMOE_BACKEND_CUDA, tc, &rng);
        if (sm90) run(SMOE_BACKEND_SM90, tc, &rng);
    }
    return tu_summary("test_large_gpu");
}
