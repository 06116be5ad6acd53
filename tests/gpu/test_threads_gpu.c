/*
 * test_threads_gpu.c -- one GPU layer used by several host threads at once,
 * each on a stream of its own (smoe.h, "Threads and streams"): every thread
 * runs forward + backward on its own problem (its own T, inputs, saved
 * block, workspace, outputs) through the same smoe_layer, ROUNDS times, and
 * each result must equal bit for bit what the same call gave alone. Both
 * routing families: TOPK_SOFTMAX (the sparse router backward) and
 * SOFTMAX_TOPK (the dense cuBLAS router GEMMs, whose handle the threads
 * share), on the CUDA and SM90 backends. Skips without a GPU.
 */
#include "testutil_cuda.h"

#include <pthread.h>

#define NTHREADS 4
#define ROUNDS 8
enum { NG = 4 }; /* dx, drouter_w, dw1, dw2 */

typedef struct job {
    smoe_layer *L;
    int64_t T;
    cudaStream_t s;
    void *x, *wr, *w1, *w2, *dout, *out, *saved, *ws, *g[NG];
    size_t out_b, saved_b, ws_b, g_b[NG];
    unsigned char *ref_out, *ref_g[NG]; /* host copies of the call alone */
    pthread_barrier_t *bar;
    int ok_calls, same;
    char msg[256];
} job;

static int run_once(job *j) {
    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = j->T; fa.x = j->x; fa.router_w = j->wr; fa.w1 = j->w1; fa.w2 = j->w2; fa.out = j->out;
    smoe_status st = smoe_layer_forward(j->L, &fa, j->saved, j->saved_b, j->ws, j->ws_b, j->s);
    if (st != SMOE_SUCCESS) {
        snprintf(j->msg, sizeof j->msg, "forward: %s", smoe_last_error());
        return 0;
    }
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.T = j->T; ba.x = j->x; ba.router_w = j->wr; ba.w1 = j->w1; ba.w2 = j->w2;
    ba.dout = j->dout;
    ba.dx = (smoe_grad){j->g[0], SMOE_DTYPE_BF16, 0};
    ba.drouter_w = (smoe_grad){j->g[1], SMOE_DTYPE_F32, 0};
    ba.dw1 = (smoe_grad){j->g[2], SMOE_DTYPE_F32, 0};
    ba.dw2 = (smoe_grad){j->g[3], SMOE_DTYPE_BF16, 0};
    st = smoe_layer_backward(j->L, &ba, j->saved, j->saved_b, j->ws, j->ws_b, j->s);
    if (st == SMOE_SUCCESS) st = smoe_layer_device_status(j->L, j->s, 1);
    if (st != SMOE_SUCCESS) {
        snprintf(j->msg, sizeof j->msg, "backward: %s", smoe_last_error());
        return 0;
    }
    return cudaStreamSynchronize(j->s) == cudaSuccess;
}

static void poison(job *j) {
    CUDA_OK(cudaMemsetAsync(j->out, 0xC3, j->out_b, j->s));
    for (int i = 0; i < NG; i++) CUDA_OK(cudaMemsetAsync(j->g[i], 0xC3, j->g_b[i], j->s));
}

static int matches(job *j) {
    int ok = 1;
    unsigned char *h = (unsigned char *)malloc(j->out_b);
    CUDA_OK(cudaMemcpy(h, j->out, j->out_b, cudaMemcpyDeviceToHost));
    ok &= !memcmp(h, j->ref_out, j->out_b);
    free(h);
    for (int i = 0; i < NG; i++) {
        h = (unsigned char *)malloc(j->g_b[i]);
        CUDA_OK(cudaMemcpy(h, j->g[i], j->g_b[i], cudaMemcpyDeviceToHost));
        ok &= !memcmp(h, j->ref_g[i], j->g_b[i]);
        free(h);
    }
    return ok;
}

static void *thread_main(void *p) {
    job *j = (job *)p;
    pthread_barrier_wait(j->bar);
    for (int r = 0; r < ROUNDS; r++) {
        poison(j);
        if (!run_once(j)) return NULL;
        j->ok_calls++;
        if (matches(j)) j->same++;
    }
    return NULL;
}

static void test_backend(smoe_backend backend, smoe_routing routing, tu_rng *rng) {
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 256; D.n = 128; D.E = 16; D.K = 4;
    D.routing = routing;
    D.renormalize = 1;
    D.backend = backend;
    const char *name = backend == SMOE_BACKEND_SM90 ? "sm90" : "cuda";
    const char *mode = routing == SMOE_ROUTING_TOPK_SOFTMAX ? "topk-softmax" : "softmax-topk";
    smoe_layer *L = tu_layer(&D);
    if (!L) return;
    tu_problem W;
    tu_problem_init(&W, &D, 1, rng, 1.0, 0.1);
    const int64_t d = D.d, n = D.n, E = D.E, hc = 2 * n;
    const smoe_dtype bf = SMOE_DTYPE_BF16;
    void *wr = tu_dev_to_dtype(bf, W.wr, (size_t)(E * d));
    void *w1 = tu_dev_to_dtype(bf, W.w1, (size_t)(E * hc * d));
    void *w2 = tu_dev_to_dtype(bf, W.w2, (size_t)(E * d * n));
    static const int64_t Ts[NTHREADS] = {37, 1000, 513, 4096};
    job jobs[NTHREADS];
    memset(jobs, 0, sizeof jobs);
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    for (int t = 0; t < NTHREADS; t++) {
        job *j = &jobs[t];
        j->L = L;
        j->T = Ts[t];
        j->bar = &bar;
        j->wr = wr; j->w1 = w1; j->w2 = w2;
        CUDA_OK(cudaStreamCreateWithFlags(&j->s, cudaStreamNonBlocking));
        double *v = tu_alloc_d((size_t)(j->T * d));
        tu_fill_normal(rng, v, (size_t)(j->T * d), 1.0);
        j->x = tu_dev_to_dtype(bf, v, (size_t)(j->T * d));
        tu_fill_normal(rng, v, (size_t)(j->T * d), 1.0);
        j->dout = tu_dev_to_dtype(bf, v, (size_t)(j->T * d));
        free(v);
        j->out_b = (size_t)(j->T * d) * 2;
        j->saved_b = smoe_layer_saved_bytes(L, j->T, 0);
        j->ws_b = smoe_layer_workspace_bytes(L, j->T, 0);
        CUDA_OK(cudaMalloc(&j->out, j->out_b));
        CUDA_OK(cudaMalloc(&j->saved, j->saved_b));
        CUDA_OK(cudaMalloc(&j->ws, j->ws_b));
        const size_t gb[NG] = {(size_t)(j->T * d) * 2, (size_t)(E * d) * 4,
                               (size_t)(E * hc * d) * 4, (size_t)(E * d * n) * 2};
        for (int i = 0; i < NG; i++) {
            j->g_b[i] = gb[i];
            CUDA_OK(cudaMalloc(&j->g[i], gb[i]));
        }
        tu_case("threads %s %s: job %d alone", name, mode, t);
        CUDA_OK(cudaDeviceSynchronize()); /* the uploads ran on the legacy stream */
        poison(j);
        CHECK(run_once(j), "%s", j->msg);
        j->ref_out = (unsigned char *)malloc(j->out_b);
        CUDA_OK(cudaMemcpy(j->ref_out, j->out, j->out_b, cudaMemcpyDeviceToHost));
        for (int i = 0; i < NG; i++) {
            j->ref_g[i] = (unsigned char *)malloc(j->g_b[i]);
            CUDA_OK(cudaMemcpy(j->ref_g[i], j->g[i], j->g_b[i], cudaMemcpyDeviceToHost));
        }
    }
    pthread_t th[NTHREADS];
    for (int t = 0; t < NTHREADS; t++) pthread_create(&th[t], NULL, thread_main, &jobs[t]);
    for (int t = 0; t < NTHREADS; t++) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&bar);
    for (int t = 0; t < NTHREADS; t++) {
        job *j = &jobs[t];
        tu_case("threads %s %s: job %d (T = %lld) with %d others at once, own streams", name,
                mode, t, (long long)j->T, NTHREADS - 1);
        CHECK(j->ok_calls == ROUNDS, "%d of %d rounds ran (%s)", j->ok_calls, ROUNDS, j->msg);
        CHECK(j->same == j->ok_calls, "%d of %d rounds differ from the call run alone",
              j->ok_calls - j->same, j->ok_calls);
        cudaStreamDestroy(j->s);
        cudaFree(j->x); cudaFree(j->dout); cudaFree(j->out); cudaFree(j->saved); cudaFree(j->ws);
        for (int i = 0; i < NG; i++) {
            cudaFree(j->g[i]);
            free(j->ref_g[i]);
        }
        free(j->ref_out);
    }
    cudaFree(wr); cudaFree(w1); cudaFree(w2);
    tu_problem_free(&W);
    smoe_layer_free(L);
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 17));
    const int cc = tu_gpu_cc("test_threads_gpu");
    if (!cc) return 0;
    const int sm90 = cc == 90;
    for (int r = 0; r < 2; r++) {
        const smoe_routing routing = r ? SMOE_ROUTING_SOFTMAX_TOPK : SMOE_ROUTING_TOPK_SOFTMAX;
        test_backend(SMOE_BACKEND_CUDA, routing, &rng);
        if (sm90) test_backend(SMOE_BACKEND_SM90, routing, &rng);
    }
    return tu_summary("test_threads_gpu");
}
