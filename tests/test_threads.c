/*
 * test_threads.c -- one layer used by several threads at once (smoe.h,
 * "Threads and streams"): each thread runs forward + backward on its own
 * problem (its own T, inputs, saved block, workspace and outputs) through
 * the same smoe_layer, many times, and every result must equal, bit for
 * bit, what the same call gave when run alone. `make sanitize` runs this
 * under ThreadSanitizer as well, which reports any data race inside the
 * library. Threads record their results; the checks run after the joins
 * (the CHECK counters are not shared between threads).
 */
#include "testutil.h"

#include <pthread.h>

#define NTHREADS 4
#define ROUNDS 6

typedef struct job {
    smoe_layer *L;
    tu_problem P;
    tu_bufs B;
    tu_grads g;
    void *dout;
    void *ref_out, *ref_g[TU_NGRAD]; /* the results of the call run alone */
    size_t out_bytes;
    pthread_barrier_t *bar;
    int ok_calls, same;               /* set by the thread */
    char msg[256];
} job;

static int run_once(job *j) {
    smoe_forward_args fa = tu_fwd_args(&j->P, &j->B, 0);
    smoe_status st = smoe_layer_forward(j->L, &fa, j->B.saved, j->B.saved_bytes, j->B.ws,
                                        j->B.ws_bytes, NULL);
    if (st != SMOE_SUCCESS) {
        snprintf(j->msg, sizeof j->msg, "forward: %s", smoe_last_error());
        return 0;
    }
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    const int general = j->P.desc.routing == SMOE_ROUTING_GENERAL;
    ba.T = j->P.T;
    ba.x = j->B.x;
    ba.router_w = general ? NULL : j->B.wr;
    ba.pairs = general ? j->P.pairs : 0;
    ba.w1 = j->B.w1; ba.w2 = j->B.w2; ba.b2 = j->B.b2;
    ba.dout = j->dout;
    smoe_grad *slot[TU_NGRAD] = {&ba.dx, &ba.drouter_w, &ba.dw1, &ba.db1, &ba.dw2, &ba.db2,
                                 &ba.dpair_score};
    for (int i = 0; i < TU_NGRAD; i++) {
        slot[i]->ptr = j->g.g[i];
        slot[i]->dtype = j->g.dt[i];
    }
    st = smoe_layer_backward(j->L, &ba, j->B.saved, j->B.saved_bytes, j->B.ws, j->B.ws_bytes,
                             NULL);
    if (st != SMOE_SUCCESS) {
        snprintf(j->msg, sizeof j->msg, "backward: %s", smoe_last_error());
        return 0;
    }
    return 1;
}

static void poison(job *j) {
    memset(j->B.out, 0xC3, j->out_bytes);
    for (int i = 0; i < TU_NGRAD; i++)
        if (j->g.g[i]) memset(j->g.g[i], 0xC3, j->g.n[i] * tu_dtype_size(j->g.dt[i]));
}

static int matches(const job *j) {
    if (memcmp(j->B.out, j->ref_out, j->out_bytes)) return 0;
    for (int i = 0; i < TU_NGRAD; i++)
        if (j->g.g[i] && memcmp(j->g.g[i], j->ref_g[i], j->g.n[i] * tu_dtype_size(j->g.dt[i])))
            return 0;
    return 1;
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

static void test_mode(int mode, tu_rng *rng) {
    smoe_layer_desc D = smoe_layer_desc_default();
    tu_set_mode(&D, mode);
    D.d = 24; D.n = 16; D.E = 6; D.K = 2;
    D.has_bias = mode % 2;
    D.dtype = SMOE_DTYPE_F32;
    D.backend = SMOE_BACKEND_CPU;
    smoe_layer *L = tu_layer(&D);
    if (!L) return;
    static const int64_t Ts[NTHREADS] = {7, 19, 33, 50};
    job jobs[NTHREADS];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    memset(jobs, 0, sizeof jobs);
    for (int t = 0; t < NTHREADS; t++) {
        job *j = &jobs[t];
        j->L = L;
        j->bar = &bar;
        tu_problem_init(&j->P, &D, Ts[t], rng, 1.0, 0.5);
        if (D.routing == SMOE_ROUTING_GENERAL) tu_problem_general(&j->P, rng, 0.4);
        tu_bufs_make(&j->B, &j->P, L, 0);
        tu_grads_alloc(&j->g, &j->P, SMOE_DTYPE_F32);
        double *g = tu_alloc_d((size_t)(Ts[t] * D.d));
        tu_fill_normal(rng, g, (size_t)(Ts[t] * D.d), 1.0);
        j->dout = tu_to_dtype(D.dtype, g, (size_t)(Ts[t] * D.d));
        free(g);
        j->out_bytes = (size_t)(Ts[t] * D.d) * tu_dtype_size(D.dtype);
        /* alone first: the reference bits */
        tu_case("threads %s: job %d alone", tu_mode_name(&D), t);
        poison(j);
        CHECK(run_once(j), "%s", j->msg);
        j->ref_out = malloc(j->out_bytes);
        memcpy(j->ref_out, j->B.out, j->out_bytes);
        for (int i = 0; i < TU_NGRAD; i++) {
            if (!j->g.g[i]) continue;
            size_t b = j->g.n[i] * tu_dtype_size(j->g.dt[i]);
            j->ref_g[i] = malloc(b ? b : 1);
            memcpy(j->ref_g[i], j->g.g[i], b);
        }
    }
    pthread_t th[NTHREADS];
    for (int t = 0; t < NTHREADS; t++) pthread_create(&th[t], NULL, thread_main, &jobs[t]);
    for (int t = 0; t < NTHREADS; t++) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&bar);
    for (int t = 0; t < NTHREADS; t++) {
        job *j = &jobs[t];
        tu_case("threads %s: job %d (T = %lld) with %d others at once", tu_mode_name(&D), t,
                (long long)j->P.T, NTHREADS - 1);
        CHECK(j->ok_calls == ROUNDS, "%d of %d rounds ran (%s)", j->ok_calls, ROUNDS, j->msg);
        CHECK(j->same == j->ok_calls, "%d of %d rounds differ from the call run alone",
              j->ok_calls - j->same, j->ok_calls);
        free(j->ref_out);
        for (int i = 0; i < TU_NGRAD; i++) free(j->ref_g[i]);
        free(j->dout);
        tu_grads_free(&j->g);
        tu_bufs_free(&j->B);
        tu_problem_free(&j->P);
    }
    smoe_layer_free(L);
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 5));
    for (int mode = 0; mode < TU_NMODES; mode++) test_mode(mode, &rng);
    return tu_summary("test_threads");
}
