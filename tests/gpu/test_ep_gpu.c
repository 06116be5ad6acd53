/*
 * test_ep_gpu.c -- the expert-parallel layer on the CUDA backends over
 * NCCL: P GPUs of this machine, one thread per rank (ncclCommInitAll),
 * against the single CPU layer on the gathered batch (ep_ref.h: FA3's rule
 * against the F64 layer, with the BF16 CPU layer's error as the bar):
 *  - each rank's out and dx rows, the sum over ranks of drouter_w, each
 *    rank's slice of dW1, db1, dW2, db2, GENERAL's pair-score gradient, the
 *    expert counts summed over ranks (exact);
 *  - P = 1, 2, 4 and 8, as many as there are GPUs; the three routing modes and SIGMOID_TOPK; the CUDA
 *    and Hopper backends; uneven T with a rank of none; gradients
 *    accumulated onto a known start; biases, activations, both W1 layouts;
 *  - an inference forward (no saved block) between forward and backward
 *    gives the same out bit for bit;
 *  - the router's logits (T_r, E) out and a dlogits_extra in, fp32 or
 *    bf16 (router_logits_dtype / dlogits_extra_dtype): the logits against
 *    X Wr^T in double (within fp32's or bf16's rounding), the gradients
 *    against the single layer given the same extra (bf16-exact values);
 *  - keep_x (the received rows of x kept for the backward, which then
 *    sends dout alone): bitwise equal to the same case without it, on
 *    both GEMM families, with and without overlap, in a CUDA graph;
 *  - two runs bitwise equal; forward + backward captured in a CUDA graph
 *    (every rank's stream) replay bit for bit like the eager call (no host
 *    synchronisation: a capture would fail on one);
 *  - a capacity too small: the sending rank's device check (EP_OVERFLOW)
 *    stops every rank (the others report its failure), out untouched;
 *  - the Hopper cases (d, n multiples of 64) run the overlapped schedule
 *    (overlap = 1: chunks, two streams, the layer's own communicator), once
 *    more with overlap = -1; at P = 2, where n <= 512 and K <= 8, the
 *    forward's chunks are every peer's rows in halves (the path says so;
 *    at P = 4 it must not), n = 576 and K = 16 keep whole slices, with an
 *    odd capacity (unequal halves);
 *    every rank at capacity (x itself travels: with a CUDA graph, with
 *    halves and keep_x, with every pair on one rank's experts; the uneven
 *    cases have one rank at capacity and the others packing), and without
 *    the overlap (packed: the path must not say it);
 *    overlap = 2 (the backward's alone; the path says so): with a bias,
 *    GENERAL with keep_x, accumulate and a CUDA graph, every rank at
 *    capacity (x itself, router logits);
 *    overlap = 1 on the portable GEMMs is refused on every rank;
 *  - copy_engines (P >= 2, Hopper): the three routing modes, a CUDA graph,
 *    keep_x (bitwise against the same case without it), an odd capacity
 *    and a rank without tokens, every pair on one rank, a capacity too
 *    small, a second layer sharing the first's window (its run bitwise
 *    equal to the first's); every rank at capacity (x itself by
 *    all-gathers: with a CUDA graph, with keep_x, with every pair on one
 *    rank; at an odd capacity packed, the path must not say it); refused
 *    on the portable GEMMs and with overlap = -1 or 2;
 *  - refused at create on every rank: descriptions that differ (compared
 *    over NCCL), E not a multiple of P (each rank's own check).
 * Needs libnccl (the loader's libnccl.so.2 or $SMOE_NCCL_LIBRARY); skips
 * without 1 GPU or NCCL. SMOE_EP_QUICK=1: the largest P alone;
 * SMOE_EP_BARRIER=1: the rank threads meet before each blocking call (for
 * compute-sanitizer; see meet()); SMOE_EP_CASE=<text>: only the cases whose
 * name contains it (to run one under a tool; the others' data then differ);
 * SMOE_EP_WARMUP=1: one small ncclAllReduce on the first P's ranks before
 * any case, its end printed (under compute-sanitizer a process has stalled
 * in its first case, never later: this tells NCCL's first collective from
 * the layer's first call).
 */
#include "ep_ref.h"

#include "testutil_cuda.h"

#include <dlfcn.h>
#include <pthread.h>

#define MAXP 8

/* NCCL's C ABI for the communicators (the library itself needs no more) */
typedef int (*comm_init_all_fn)(void **comms, int ndev, const int *devlist);
typedef int (*comm_destroy_fn)(void *comm);
typedef int (*all_reduce_fn)(const void *send, void *recv, size_t count, int dtype, int op,
                             void *comm, cudaStream_t s);
static comm_init_all_fn nccl_init_all;
static comm_destroy_fn nccl_destroy;
static all_reduce_fn nccl_all_reduce; /* SMOE_EP_WARMUP only */

static int nccl_open(void) {
    const char *env = getenv("SMOE_NCCL_LIBRARY");
    void *h = env && *env ? dlopen(env, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!h) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!h) return 0;
    *(void **)&nccl_init_all = dlsym(h, "ncclCommInitAll");
    *(void **)&nccl_destroy = dlsym(h, "ncclCommDestroy");
    *(void **)&nccl_all_reduce = dlsym(h, "ncclAllReduce");
    return nccl_init_all && nccl_destroy;
}

typedef struct gcase {
    smoe_layer_desc D;
    int P;
    int64_t Tr[MAXP];
    int64_t capacity;  /* 0: worst case */
    int accumulate;    /* gradients accumulated onto 0.25 */
    int overflow;      /* the capacity is too small: every rank's call fails */
    int one_rank;      /* GENERAL: every pair on rank 0's experts */
    int mismatch;      /* rank 1's description has n + 8 */
    const char *refused; /* create must fail on every rank with this text */
    int graph;         /* forward + backward captured in a CUDA graph, replayed twice */
    int overlap;       /* smoe_ep_desc.overlap */
    int keep_x;        /* smoe_ep_desc.keep_x (the case runs without it first) */
    int ce;            /* smoe_ep_desc.copy_engines (base_case: -1) */
    int path_ce;       /* 1: the path name must say copy engines, 2: must not */
    int path_halves;   /* 1: the path name must say the forward's peer rows
                          travel in halves, 2: must not */
    int path_whole;    /* 1: at P >= 2 the path name must say x itself travels
                          where T = capacity, 2: must not */
    int path_bwonly;   /* 1: at P >= 2 the path name must say the overlap is the
                          backward's only */
    int share;         /* a second layer of the same description (copy engines:
                          it shares the first's window) runs the second run */
    int logits;        /* token choice: router logits out and a dlogits_extra in,
                          1: fp32, 2: bf16 */
} gcase;

typedef struct grank {
    int r;
    const gcase *c;
    void *comm;
    const tu_problem *Pb;
    const double *dout;
    const float *extra; /* dlogits_extra's rows of this rank (c->logits), or NULL */
    int64_t t0, T, p0, np;
    smoe_status st_create, st_fwd, st_bwd, st_dev;
    char msg[512];
    double *out, *g[7], *logits;
    int32_t counts[64];
    uint64_t hash[3];
    int untouched; /* overflow: out still the poison */
    int ce_on;     /* the path name says copy engines */
    int halves_on; /* the path name says the forward's halves */
    int whole_on;  /* the path name says x itself travels where T = capacity */
    int bwonly_on; /* the path name says the overlap is the backward's only */
    int inf_same;  /* an inference forward gave the training forward's out */
    pthread_barrier_t *bar; /* SMOE_EP_BARRIER=1: every rank's thread meets here */
} grank;

/* SMOE_EP_BARRIER=1 (for compute-sanitizer): before each call that blocks
 * on the device, every rank's thread waits until all have enqueued their
 * calls, so no rank blocks while a peer's NCCL work is still unqueued (a
 * tool that serializes the CUDA API across threads would otherwise hang
 * there). A rank that stops early (a failed call) then hangs the case:
 * for diagnosis only, off by default. */
static void meet(const grank *R, const char *where) {
    if (!R->bar) return;
    printf("  rank %d at %s\n", R->r, where); /* where a hang stopped */
    fflush(stdout);
    pthread_barrier_wait(R->bar);
}

static void *rank_main(void *arg) {
    grank *R = (grank *)arg;
    const gcase *c = R->c;
    const tu_problem *P = R->Pb;
    const smoe_layer_desc D = c->D;
    const int r = R->r, NP = c->P;
    const int64_t d = D.d, n = D.n, E = D.E, El = E / NP, hc = P->hc, T = R->T;
    const int general = D.routing == SMOE_ROUTING_GENERAL;
    CUDA_OK(cudaSetDevice(r));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    smoe_ep_desc ed = smoe_ep_desc_default();
    ed.layer = D;
    ed.layer.device = r;
    if (c->mismatch && r == 1) ed.layer.n += 8;
    ed.rank = r;
    ed.nranks = NP;
    ed.nccl_comm = R->comm;
    int64_t tmax = 0;
    for (int q = 0; q < NP; q++) tmax = c->Tr[q] > tmax ? c->Tr[q] : tmax;
    ed.max_tokens = tmax;
    ed.capacity = c->capacity;
    ed.overlap = c->overlap;
    ed.keep_x = c->keep_x;
    ed.copy_engines = c->ce;
    smoe_ep_layer *L = NULL;
    if (R->bar) printf("  rank %d creates\n", r), fflush(stdout);
    R->st_create = smoe_ep_layer_create(&ed, &L);
    if (R->bar) printf("  rank %d created: %d\n", r, (int)R->st_create), fflush(stdout);
    if (R->st_create != SMOE_SUCCESS) {
        snprintf(R->msg, sizeof R->msg, "create: %s", smoe_last_error());
        return NULL;
    }
    R->ce_on = strstr(smoe_ep_layer_path_name(L), "ep: copy engines") != NULL;
    R->halves_on = strstr(smoe_ep_layer_path_name(L), "rows in halves") != NULL;
    R->whole_on = strstr(smoe_ep_layer_path_name(L), "x itself sent") != NULL;
    R->bwonly_on = strstr(smoe_ep_layer_path_name(L), "in the backward only") != NULL;
    smoe_ep_layer *L1 = L, *L2 = NULL;
    if (c->share) {
        R->st_create = smoe_ep_layer_create(&ed, &L2);
        if (R->st_create != SMOE_SUCCESS) {
            snprintf(R->msg, sizeof R->msg, "create (second layer): %s", smoe_last_error());
            smoe_ep_layer_free(L);
            return NULL;
        }
    }
    const smoe_dtype bf = SMOE_DTYPE_BF16;
    void *x = tu_dev_to_dtype(bf, P->x + R->t0 * d, (size_t)(T * d));
    void *wr = tu_dev_to_dtype(bf, P->wr, (size_t)(E * d));
    void *w1 = tu_dev_to_dtype(bf, P->w1 + (size_t)r * El * hc * d, (size_t)(El * hc * d));
    void *w2 = tu_dev_to_dtype(bf, P->w2 + (size_t)r * El * d * n, (size_t)(El * d * n));
    void *b1 = P->b1 ? tu_dev_to_dtype(bf, P->b1 + (size_t)r * El * hc, (size_t)(El * hc)) : NULL;
    void *b2 = P->b2 ? tu_dev_to_dtype(bf, P->b2 + (size_t)r * El * d, (size_t)(El * d)) : NULL;
    void *G = tu_dev_to_dtype(bf, R->dout + R->t0 * d, (size_t)(T * d));
    const size_t out_b = (size_t)(T * d) * 2;
    void *out = tu_dev_alloc(out_b);
    /* the router's logits and their extra gradient, in c->logits' dtype */
    const int with_logits = c->logits && !general;
    const smoe_dtype ldt = c->logits == 2 ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
    const size_t lg_n = (size_t)(T * E);
    void *lg = NULL, *extra = NULL;
    if (with_logits) {
        lg = tu_dev_alloc(lg_n * tu_dtype_size(ldt) + 4);
        double *e64 = tu_alloc_d(lg_n + 1);
        for (size_t i = 0; i < lg_n; i++) e64[i] = R->extra[i];
        extra = ldt == SMOE_DTYPE_F32 ? tu_dev_put(R->extra, lg_n * 4 + 4)
                                      : tu_dev_to_dtype(ldt, e64, lg_n);
        free(e64);
    }
    int32_t *counts = (int32_t *)tu_dev_alloc((size_t)E * 4);
    void *pt = NULL, *pe = NULL, *ps = NULL;
    if (general) {
        int32_t *a = (int32_t *)malloc((size_t)R->np * 4 + 4);
        int32_t *b = (int32_t *)malloc((size_t)R->np * 4 + 4);
        float *f = (float *)malloc((size_t)R->np * 4 + 4);
        for (int64_t i = 0; i < R->np; i++) {
            a[i] = (int32_t)(P->pt[R->p0 + i] - R->t0);
            b[i] = P->pe[R->p0 + i];
            f[i] = (float)P->ps[R->p0 + i];
        }
        pt = tu_dev_put(a, (size_t)R->np * 4);
        pe = tu_dev_put(b, (size_t)R->np * 4);
        ps = tu_dev_put(f, (size_t)R->np * 4);
        free(a); free(b); free(f);
    }
    void *eb = NULL;
    if (P->ebias) {
        float *hb = (float *)malloc((size_t)E * 4);
        for (int64_t e = 0; e < E; e++) hb[e] = (float)P->ebias[e];
        eb = tu_dev_put(hb, (size_t)E * 4);
        free(hb);
    }
    const size_t sb = smoe_ep_layer_saved_bytes(L, T), wb = smoe_ep_layer_workspace_bytes(L, T);
    void *saved = tu_dev_alloc(sb), *ws = tu_dev_alloc(wb);
    const size_t gn[7] = {(size_t)(T * d), (size_t)(E * d), (size_t)(El * hc * d),
                          (size_t)(El * hc), (size_t)(El * d * n), (size_t)(El * d),
                          (size_t)R->np};
    void *gd[7];
    float *gh[7];
    for (int i = 0; i < 7; i++) {
        gd[i] = tu_dev_alloc(gn[i] * 4);
        gh[i] = (float *)malloc(gn[i] * 4 + 4);
    }
    unsigned char *oh = (unsigned char *)malloc(out_b + 1);
    /* the uploads above ran on the legacy stream, which s does not wait for */
    CUDA_OK(cudaDeviceSynchronize());
    /* run 0 eager; then eager again, or (c->graph) forward + backward
     * captured once into a CUDA graph and replayed twice */
    const int runs = c->graph ? 3 : 2;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    for (int run = 0; run < runs; run++) {
        L = c->share && run == 1 ? L2 : L1;
        CUDA_OK(cudaMemsetAsync(out, 0xC3, out_b, s));
        for (int i = 0; i < 7; i++) {
            for (size_t j = 0; j < gn[i]; j++) gh[i][j] = c->accumulate ? 0.25f : 0.0f;
            CUDA_OK(cudaMemcpyAsync(gd[i], gh[i], gn[i] * 4, cudaMemcpyHostToDevice, s));
        }
        smoe_forward_args fa;
        memset(&fa, 0, sizeof fa);
        fa.T = T; fa.x = x; fa.router_w = general ? NULL : wr;
        fa.pairs = general ? R->np : 0;
        fa.pair_token = (const int32_t *)pt; fa.pair_expert = (const int32_t *)pe;
        fa.pair_score = (const float *)ps;
        fa.w1 = w1; fa.b1 = b1; fa.w2 = w2; fa.b2 = b2;
        fa.out = out;
        fa.expert_counts = counts;
        fa.expert_bias = (const float *)eb;
        fa.router_logits = lg;
        fa.router_logits_dtype = ldt;
        smoe_backward_args ba;
        memset(&ba, 0, sizeof ba);
        ba.T = T; ba.x = x; ba.router_w = general ? NULL : wr; ba.pairs = fa.pairs;
        ba.w1 = w1; ba.w2 = w2; ba.b2 = b2; ba.dout = G;
        ba.dlogits_extra = extra;
        ba.dlogits_extra_dtype = ldt;
        const int acc = c->accumulate;
        ba.dx = (smoe_grad){gd[0], SMOE_DTYPE_F32, acc};
        ba.drouter_w = (smoe_grad){general ? NULL : gd[1], SMOE_DTYPE_F32, acc};
        ba.dw1 = (smoe_grad){gd[2], SMOE_DTYPE_F32, acc};
        ba.db1 = (smoe_grad){b1 ? gd[3] : NULL, SMOE_DTYPE_F32, acc};
        ba.dw2 = (smoe_grad){gd[4], SMOE_DTYPE_F32, acc};
        ba.db2 = (smoe_grad){b2 ? gd[5] : NULL, SMOE_DTYPE_F32, acc};
        ba.dpair_score = (smoe_grad){general && R->np ? gd[6] : NULL, SMOE_DTYPE_F32, acc};
        const int use_graph = c->graph && run > 0;
        if (!use_graph || !exec) {
            if (use_graph) CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            R->st_fwd = smoe_ep_layer_forward(L, &fa, saved, sb, ws, wb, s);
            if (R->st_fwd != SMOE_SUCCESS) {
                snprintf(R->msg, sizeof R->msg, "forward: %s", smoe_last_error());
                if (use_graph) cudaStreamEndCapture(s, &graph);
                break;
            }
            if (c->overflow) {
                /* every rank's call fails on the device; nothing else to run */
                meet(R, "the overflow's device status");
                R->st_dev = smoe_ep_layer_device_status(L, s, 1);
                snprintf(R->msg, sizeof R->msg, "%s", smoe_last_error());
                CUDA_OK(cudaMemcpy(oh, out, out_b, cudaMemcpyDeviceToHost));
                R->untouched = 1;
                for (size_t i = 0; i < out_b; i++) R->untouched &= oh[i] == 0xC3;
                break;
            }
            if (run == 0) {
                /* an inference forward (no saved block) between the
                 * training forward and its backward: the same out */
                smoe_forward_args fi = fa;
                void *out2 = tu_dev_alloc(out_b);
                unsigned char *o2 = (unsigned char *)malloc(out_b + 1);
                fi.out = out2;
                fi.expert_counts = NULL;
                fi.router_logits = NULL;
                fi.inference = 1;
                const smoe_status si = smoe_ep_layer_forward(L, &fi, NULL, 0, ws, wb, s);
                meet(R, "the inference forward's sync");
                CUDA_OK(cudaStreamSynchronize(s));
                CUDA_OK(cudaMemcpy(oh, out, out_b, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(o2, out2, out_b, cudaMemcpyDeviceToHost));
                R->inf_same = si == SMOE_SUCCESS && !memcmp(oh, o2, out_b);
                cudaFree(out2);
                free(o2);
            }
            R->st_bwd = smoe_ep_layer_backward(L, &ba, saved, sb, ws, wb, s);
            if (R->st_bwd != SMOE_SUCCESS) {
                snprintf(R->msg, sizeof R->msg, "backward: %s", smoe_last_error());
                if (use_graph) cudaStreamEndCapture(s, &graph);
                break;
            }
            if (use_graph) {
                CUDA_OK(cudaStreamEndCapture(s, &graph));
                CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            }
        }
        if (use_graph) CUDA_OK(cudaGraphLaunch(exec, s));
        meet(R, "the device status");
        R->st_dev = smoe_ep_layer_device_status(L, s, 1);
        if (R->st_dev != SMOE_SUCCESS) {
            snprintf(R->msg, sizeof R->msg, "device: %s", smoe_last_error());
            break;
        }
        CUDA_OK(cudaStreamSynchronize(s));
        CUDA_OK(cudaMemcpy(oh, out, out_b, cudaMemcpyDeviceToHost));
        uint64_t h = fnv(14695981039346656037ull, oh, out_b);
        for (int i = 0; i < 7; i++) {
            CUDA_OK(cudaMemcpy(gh[i], gd[i], gn[i] * 4, cudaMemcpyDeviceToHost));
            h = fnv(h, gh[i], gn[i] * 4);
        }
        R->hash[run] = h;
        if (run == runs - 1) {
            R->out = tu_from_dtype(SMOE_DTYPE_BF16, oh, (size_t)(T * d));
            for (int i = 0; i < 7; i++) {
                R->g[i] = tu_alloc_d(gn[i] + 1);
                for (size_t j = 0; j < gn[i]; j++) R->g[i][j] = gh[i][j] - (acc ? 0.25 : 0.0);
            }
            CUDA_OK(cudaMemcpy(R->counts, counts, (size_t)E * 4, cudaMemcpyDeviceToHost));
            if (with_logits) {
                void *h = malloc(lg_n * tu_dtype_size(ldt) + 4);
                CUDA_OK(cudaMemcpy(h, lg, lg_n * tu_dtype_size(ldt), cudaMemcpyDeviceToHost));
                R->logits = tu_from_dtype(ldt, h, lg_n);
                free(h);
            }
        }
    }
    cudaFree(x); cudaFree(wr); cudaFree(w1); cudaFree(w2); cudaFree(b1); cudaFree(b2);
    cudaFree(G); cudaFree(out); cudaFree(counts); cudaFree(pt); cudaFree(pe); cudaFree(ps);
    cudaFree(saved); cudaFree(ws); cudaFree(eb); cudaFree(lg); cudaFree(extra);
    for (int i = 0; i < 7; i++) {
        cudaFree(gd[i]);
        free(gh[i]);
    }
    free(oh);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    smoe_ep_layer_free(L2); /* NULL is fine; the same order on every rank */
    smoe_ep_layer_free(L1);
    return NULL;
}

/* SMOE_EP_WARMUP: rank q's share of one all-reduce of 4 floats */
typedef struct warm_rank {
    int dev;
    void *comm;
    int rc;
} warm_rank;

static void *warm_main(void *arg) {
    warm_rank *w = (warm_rank *)arg;
    float *buf = NULL;
    cudaStream_t s = NULL;
    w->rc = -1;
    if (cudaSetDevice(w->dev) != cudaSuccess || cudaMalloc((void **)&buf, 16) != cudaSuccess ||
        cudaMemset(buf, 0, 16) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess)
        return NULL;
    /* 7: ncclFloat32, 0: ncclSum */
    w->rc = nccl_all_reduce(buf, buf, 4, 7, 0, w->comm, s);
    if (w->rc == 0 && cudaStreamSynchronize(s) != cudaSuccess) w->rc = -2;
    cudaStreamDestroy(s);
    cudaFree(buf);
    return NULL;
}

static void warm_up(int NP) {
    void *comms[MAXP] = {0};
    int devs[MAXP];
    for (int q = 0; q < NP; q++) devs[q] = q;
    printf("warm-up: one ncclAllReduce on %d ranks\n", NP);
    fflush(stdout);
    int nr = nccl_all_reduce ? nccl_init_all(comms, NP, devs) : -1;
    if (!CHECK(nr == 0, "warm-up: ncclCommInitAll -> %d", nr)) return;
    warm_rank W[MAXP];
    pthread_t th[MAXP];
    for (int q = 0; q < NP; q++) {
        W[q].dev = q; W[q].comm = comms[q]; W[q].rc = -1;
        pthread_create(&th[q], NULL, warm_main, &W[q]);
    }
    for (int q = 0; q < NP; q++) pthread_join(th[q], NULL);
    for (int q = 0; q < NP; q++) {
        CHECK(W[q].rc == 0, "warm-up: rank %d's all-reduce -> %d", q, W[q].rc);
        nccl_destroy(comms[q]);
    }
    printf("warm-up: done\n");
    fflush(stdout);
}

static void run_case(const char *name, const gcase *c, tu_rng *rng) {
    const int NP = c->P;
    const char *only = getenv("SMOE_EP_CASE");
    if (only && *only && !strstr(name, only)) return;
    printf("case P = %d: %s\n", NP, name); /* where a hang stopped, in the log */
    fflush(stdout);
    smoe_layer_desc D = c->D;
    int64_t T = 0;
    for (int q = 0; q < NP; q++) T += c->Tr[q];
    tu_problem P;
    /* a routing whose selection no rounding can change (fp32 cuBLAS logits
     * on the GPU, double on the CPU) */
    for (int tries = 0;; tries++) {
        tu_problem_init(&P, &D, T, rng, 1.0, 0.5);
        if (D.routing == SMOE_ROUTING_GENERAL) {
            tu_problem_general(&P, rng, 0.4);
            if (c->one_rank) { /* keep the pairs with e < E/P */
                int64_t k = 0;
                for (int64_t i = 0; i < P.pairs; i++)
                    if (P.pe[i] < D.E / NP) {
                        P.pt[k] = P.pt[i]; P.pe[k] = P.pe[i]; P.ps[k] = P.ps[i]; k++;
                    }
                P.pairs = k;
            }
        }
        if (tu_selection_margin(&P) > 1e-3 || tries == 50) break;
        tu_problem_free(&P);
    }
    double *dout = tu_alloc_d((size_t)(T * D.d) + 1);
    tu_fill_normal(rng, dout, (size_t)(T * D.d), 1.0);
    tu_round_array(D.dtype, dout, (size_t)(T * D.d));
    /* dlogits_extra: values bf16 holds exactly, so both dtypes pass the same */
    float *extra = NULL;
    if (c->logits && D.routing != SMOE_ROUTING_GENERAL) {
        double *e = tu_alloc_d((size_t)(T * D.E) + 1);
        tu_fill_normal(rng, e, (size_t)(T * D.E), 0.5);
        tu_round_array(SMOE_DTYPE_BF16, e, (size_t)(T * D.E));
        extra = (float *)malloc((size_t)(T * D.E) * 4 + 4);
        for (int64_t i = 0; i < T * D.E; i++) extra[i] = (float)e[i];
        free(e);
    }
    tu_case("ep-gpu %s (P = %d, %s, backend %d)", name, NP, tu_mode_name(&D), (int)D.backend);
    grank R[MAXP];
    /* keep_x: the case without it first (its hashes kept), then with it */
    gcase c0 = *c;
    c0.keep_x = 0;
    uint64_t h0[MAXP] = {0};
    for (int pass = c->keep_x ? 0 : 1; pass < 2; pass++) {
        void *comms[MAXP] = {0};
        int devs[MAXP];
        for (int q = 0; q < NP; q++) devs[q] = q;
        const int nr = nccl_init_all(comms, NP, devs);
        if (!CHECK(nr == 0, "ncclCommInitAll -> %d", nr)) {
            free(dout);
            tu_problem_free(&P);
            return;
        }
        memset(R, 0, sizeof R);
        int64_t t0 = 0, p = 0;
        for (int q = 0; q < NP; q++) {
            R[q].r = q; R[q].c = pass ? c : &c0; R[q].comm = comms[q]; R[q].Pb = &P;
            R[q].dout = dout;
            R[q].extra = extra ? extra + t0 * D.E : NULL;
            R[q].t0 = t0; R[q].T = c->Tr[q];
            R[q].p0 = p;
            while (p < P.pairs && P.pt[p] < t0 + c->Tr[q]) p++;
            R[q].np = p - R[q].p0;
            t0 += c->Tr[q];
        }
        pthread_t th[MAXP];
        const char *be = getenv("SMOE_EP_BARRIER");
        pthread_barrier_t bar;
        const int use_bar = be && *be == '1' && NP > 1;
        if (use_bar) pthread_barrier_init(&bar, NULL, (unsigned)NP);
        for (int q = 0; q < NP; q++) R[q].bar = use_bar ? &bar : NULL;
        for (int q = 0; q < NP; q++) pthread_create(&th[q], NULL, rank_main, &R[q]);
        for (int q = 0; q < NP; q++) pthread_join(th[q], NULL);
        if (use_bar) pthread_barrier_destroy(&bar);
        for (int q = 0; q < NP; q++) nccl_destroy(comms[q]);
        if (pass == 0)
            for (int q = 0; q < NP; q++) {
                CHECK(R[q].st_fwd == SMOE_SUCCESS && R[q].st_bwd == SMOE_SUCCESS &&
                          R[q].st_dev == SMOE_SUCCESS,
                      "rank %d, keep_x = 0: %s", q, R[q].msg);
                h0[q] = R[q].hash[0];
                free(R[q].out);
                free(R[q].logits);
                for (int i = 0; i < 7; i++) free(R[q].g[i]);
            }
    }
    for (int q = 0; q < NP && c->keep_x; q++)
        CHECK(R[q].hash[0] == h0[q], "rank %d: keep_x = 1 and 0 differ (out or a gradient)", q);

    if (c->refused) {
        for (int q = 0; q < NP; q++)
            CHECK(R[q].st_create != SMOE_SUCCESS && strstr(R[q].msg, c->refused),
                  "rank %d: create gave %s (%s), want a refusal naming \"%s\"", q,
                  smoe_status_string(R[q].st_create), R[q].msg, c->refused);
    } else if (c->overflow) {
        for (int q = 0; q < NP; q++) {
            CHECK(R[q].st_create == SMOE_SUCCESS && R[q].st_fwd == SMOE_SUCCESS,
                  "rank %d: the call itself should be accepted (%s)", q, R[q].msg);
            CHECK(R[q].st_dev == SMOE_ERROR_INVALID_SIZE || R[q].st_dev == SMOE_ERROR_INVALID_VALUE,
                  "rank %d: device status %s, want a failure (%s)", q,
                  smoe_status_string(R[q].st_dev), R[q].msg);
            CHECK(strstr(R[q].msg, "capacity") || strstr(R[q].msg, "call failed"),
                  "rank %d: message \"%s\" names neither the capacity nor a peer", q, R[q].msg);
            CHECK(R[q].untouched, "rank %d: out was written by a failed call", q);
        }
    } else {
        int ok = 1;
        for (int q = 0; q < NP; q++)
            ok &= CHECK(R[q].st_create == SMOE_SUCCESS && R[q].st_fwd == SMOE_SUCCESS &&
                            R[q].st_bwd == SMOE_SUCCESS && R[q].st_dev == SMOE_SUCCESS,
                        "rank %d: %s", q, R[q].msg);
        for (int q = 0; q < NP && ok && c->path_ce; q++)
            CHECK(R[q].ce_on == (c->path_ce == 1), "rank %d: the path %s copy engines", q,
                  c->path_ce == 1 ? "does not say" : "says");
        for (int q = 0; q < NP && ok && c->path_halves; q++)
            CHECK(R[q].halves_on == (c->path_halves == 1),
                  "rank %d: the path %s the forward's halves", q,
                  c->path_halves == 1 ? "does not say" : "says");
        for (int q = 0; q < NP && ok && NP > 1 && c->path_whole; q++)
            CHECK(R[q].whole_on == (c->path_whole == 1),
                  "rank %d: the path %s that x itself travels", q,
                  c->path_whole == 1 ? "does not say" : "says");
        for (int q = 0; q < NP && ok && NP > 1 && c->path_bwonly; q++)
            CHECK(R[q].bwonly_on, "rank %d: the path does not say the overlap is the "
                  "backward's only", q);
        for (int q = 0; q < NP && ok; q++)
            CHECK(R[q].inf_same, "rank %d: the inference forward's out differs from training's",
                  q);
        for (int q = 0; q < NP && ok; q++)
            for (int k = 1; k < (c->graph ? 3 : 2); k++)
                CHECK(R[q].hash[0] == R[q].hash[k], "rank %d: run %d differs from the first%s", q,
                      k, c->graph ? " (a CUDA graph replay)" : "");
        if (ok) {
            single_res s64, s16;
            single_run(&P, dout, extra, SMOE_DTYPE_F64, &s64);
            single_run(&P, dout, extra, SMOE_DTYPE_BF16, &s16);
            if (extra) { /* the logits against X Wr^T in double */
                double *ref = tu_alloc_d((size_t)(T * D.E) + 1);
                tu_logits(&P, ref);
                const double scale = tu_max_abs(ref, (size_t)(T * D.E)) + 1e-30;
                for (int q = 0; q < NP; q++) {
                    double worst = 0.0;
                    for (int64_t i = 0; i < R[q].T * D.E; i++) {
                        const double want = ref[R[q].t0 * D.E + i], got = R[q].logits[i];
                        /* fp32 sums of bf16 products; bf16: its rounding on top */
                        const double tol = 1e-5 * scale +
                                           (c->logits == 2 ? fabs(want) * 0x1p-8 : 0.0);
                        const double ex = fabs(got - want) / tol;
                        worst = ex > worst ? ex : worst;
                    }
                    CHECK(worst <= 1.0, "rank %d: router logits (%s) off X Wr^T by %.3g x the "
                          "tolerance", q, c->logits == 2 ? "bf16" : "fp32", worst);
                }
                free(ref);
            }
            double *dwr[MAXP];
            const int32_t *cnts[MAXP];
            for (int q = 0; q < NP; q++) {
                const grank *Rq = &R[q];
                ep_check_rank(q, NP, &P, &s64, &s16, 1, Rq->t0, Rq->T, Rq->p0, Rq->np, Rq->out,
                              Rq->g);
                dwr[q] = Rq->g[TU_GWR];
                cnts[q] = Rq->counts;
            }
            ep_check_sums(NP, &P, &s64, &s16, 1, dwr, cnts);
            single_free(&s64);
            single_free(&s16);
        }
    }
    for (int q = 0; q < NP; q++) {
        free(R[q].out);
        free(R[q].logits);
        for (int i = 0; i < 7; i++) free(R[q].g[i]);
    }
    free(dout);
    free(extra);
    tu_problem_free(&P);
}

static gcase base_case(int P, smoe_routing routing, smoe_backend be) {
    gcase c;
    memset(&c, 0, sizeof c);
    c.D = smoe_layer_desc_default();
    c.D.d = 64; c.D.n = 32; c.D.E = 8; c.D.K = 2;
    c.D.routing = routing;
    c.D.renormalize = 1;
    c.D.dtype = SMOE_DTYPE_BF16;
    c.D.backend = be;
    if (routing == SMOE_ROUTING_GENERAL) c.D.K = 0;
    c.P = P;
    c.ce = -1; /* NCCL's kernels; the copy-engine cases ask for them */
    for (int q = 0; q < P; q++) c.Tr[q] = 40 + 13 * q;
    return c;
}

/* A Hopper case (d = 128) with the overlap and every rank at capacity: T
 * tokens each, so x itself travels where the path allows it. */
static gcase at_capacity(int P, smoe_routing routing, int64_t n, int64_t T) {
    gcase c = base_case(P, routing, SMOE_BACKEND_SM90);
    c.D.d = 128; c.D.n = n;
    for (int q = 0; q < P; q++) c.Tr[q] = T;
    c.overlap = 1;
    return c;
}

/* Every rank at capacity: x itself travels (NCCL's kernels, ce -1: by the
 * point-to-point rounds; the copy engines, ce 1: by all-gathers, where the
 * two parts split the capacity), with a CUDA graph, with keep_x (kernels:
 * an odd capacity, so unequal halves where the forward takes them; the
 * path says halves as `halves` wants), with every pair on one rank; then
 * packed, which the path must not call x itself (kernels: without
 * overlap; copy engines: an odd capacity). */
static void at_capacity_cases(int P, int ce, int halves, tu_rng *rng) {
    const char *on = ce == 1 ? "copy engines" : "Hopper, overlap";
    char name[160];
    gcase c = at_capacity(P, SMOE_ROUTING_TOPK_SOFTMAX, 64, 64);
    c.ce = ce;
    c.graph = 1;
    c.path_whole = 1;
    snprintf(name, sizeof name, "%s, every rank at capacity (x itself travels)", on);
    run_case(name, &c, rng);
    c = at_capacity(P, SMOE_ROUTING_SOFTMAX_TOPK, 512, ce == 1 ? 78 : 77);
    c.ce = ce;
    c.keep_x = 1;
    c.accumulate = 1;
    c.path_halves = ce == 1 ? 0 : halves;
    c.path_whole = 1;
    snprintf(name, sizeof name, "%s, at capacity, keep_x%s", on, ce == 1 ? "" : ", halves");
    run_case(name, &c, rng);
    c = at_capacity(P, SMOE_ROUTING_GENERAL, 64, 50);
    c.ce = ce;
    c.one_rank = 1;
    snprintf(name, sizeof name, "%s, at capacity, every pair on rank 0's experts", on);
    run_case(name, &c, rng);
    c = at_capacity(P, SMOE_ROUTING_TOPK_SOFTMAX, 64, ce == 1 ? 77 : 64);
    c.ce = ce;
    if (ce != 1) c.overlap = -1;
    c.path_whole = 2;
    snprintf(name, sizeof name, "%s, at capacity, rows packed (%s)", on,
             ce == 1 ? "77 rows: the two parts do not split them" : "no overlap");
    run_case(name, &c, rng);
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 17));
    int ngpu = 0;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 1) {
        printf("test_ep_gpu: SKIP (no GPU)\n");
        return 0;
    }
    if (!nccl_open()) {
        printf("test_ep_gpu: SKIP (no libnccl.so.2; set SMOE_NCCL_LIBRARY)\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const int hopper = prop.major == 9;
    /* P = 1, 2, 4, 8 up to the GPUs present (every P divides the cases' E) */
    int plist[4], np = 0;
    for (int P = 1; P <= MAXP && P <= ngpu; P *= 2) plist[np++] = P;
    static const smoe_routing modes[3] = {SMOE_ROUTING_TOPK_SOFTMAX, SMOE_ROUTING_SOFTMAX_TOPK,
                                          SMOE_ROUTING_GENERAL};
    /* SMOE_EP_QUICK=1: the largest P only, for compute-sanitizer */
    const char *quick = getenv("SMOE_EP_QUICK");
    const int q0 = quick && *quick == '1' ? np - 1 : 0;
    const char *warm = getenv("SMOE_EP_WARMUP");
    if (warm && *warm == '1') warm_up(plist[q0]);
    for (int pi = q0; pi < np; pi++) {
        const int P = plist[pi];
        for (int b = 0; b < 1 + hopper; b++)
            for (int m = 0; m < 3; m++) {
                gcase c = base_case(P, modes[m], b ? SMOE_BACKEND_SM90 : SMOE_BACKEND_CUDA);
                c.D.activation = (smoe_activation)((P + m + b) % 7);
                c.D.w1_layout = (smoe_w1_layout)((m + b) % 2);
                c.D.has_bias = (P + m) % 2;
                c.accumulate = m == 1;
                c.logits = 1 + (m + b) % 2;
                if (b) { /* the Hopper GEMMs' shapes: the overlapped schedule (views) */
                    c.D.d = 128; c.D.n = 64;
                    /* the Hopper dX~ GEMM (a view's too) needs W1 interleaved
                     * when gated: with the other layout overlap = 1 is
                     * refused, 0 takes the sequential schedule */
                    c.overlap = c.D.w1_layout == SMOE_W1_INTERLEAVED;
                    for (int q = 0; q < P; q++) c.Tr[q] = 40 + 14 * q;
                }
                run_case(b ? "balanced, Hopper, overlap" : "balanced", &c, &rng);
            }
        {
            /* SIGMOID_TOPK: the replicated router with the bias and groups */
            gcase c = base_case(P, SMOE_ROUTING_SIGMOID_TOPK, SMOE_BACKEND_CUDA);
            c.D.n_group = 4; c.D.topk_group = 2; c.D.K = 3;
            c.D.routed_scaling = 2.5;
            c.D.has_bias = 1;
            c.logits = 2;
            run_case("sigmoid, groups", &c, &rng);
        }
        {
            gcase c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
            c.overlap = 1;
            c.refused = "no view";
            run_case("overlap required on the portable GEMMs", &c, &rng);
        }
        if (hopper) {
            gcase c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_BACKEND_SM90);
            c.D.d = 128; c.D.n = 64; c.D.has_bias = 1;
            c.overlap = -1;
            run_case("Hopper, overlap off", &c, &rng);
            c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_SM90);
            c.D.d = 128; c.D.n = 64;
            c.overlap = 1;
            c.graph = 1;
            c.accumulate = 1;
            run_case("Hopper, overlap, CUDA graph replays", &c, &rng);
            c.keep_x = 1;
            run_case("Hopper, overlap, keep_x, CUDA graph replays", &c, &rng);
            c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
            c.D.d = 128; c.D.n = 64;
            c.overlap = -1;
            c.keep_x = 1;
            c.logits = 2;
            run_case("Hopper, overlap off, keep_x", &c, &rng);
        }
        {
            gcase c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_BACKEND_CUDA);
            c.keep_x = 1;
            c.accumulate = 1;
            run_case("keep_x", &c, &rng);
        }
        if (P < 2) continue;
        /* the forward's halves: at P = 2 only (where n <= 512 and K <= 8) */
        const int halves = P == 2 ? 1 : 2;
        gcase c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
        c.Tr[1] = 0;
        c.Tr[0] = 57;
        run_case("uneven, rank 1 without tokens", &c, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_CUDA);
        c.one_rank = 1;
        run_case("every pair on rank 0's experts", &c, &rng);
        c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, hopper ? SMOE_BACKEND_SM90 : SMOE_BACKEND_CUDA);
        c.D.E = 16; c.D.K = 6; c.D.d = 128; c.D.n = 64;
        for (int q = 0; q < P; q++) c.Tr[q] = 200 + 37 * q;
        c.capacity = 0;
        run_case("K = 6 of 16", &c, &rng);
        c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, hopper ? SMOE_BACKEND_SM90 : SMOE_BACKEND_CUDA);
        c.graph = 1;
        c.accumulate = 1;
        c.logits = 2;
        run_case("CUDA graph replays", &c, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_CUDA);
        c.graph = 1;
        run_case("CUDA graph replays", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
        c.mismatch = 1;
        c.refused = "differs";
        run_case("descriptions differ between ranks", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
        c.D.E = 8 * P + 1;
        c.refused = "split evenly";
        run_case("E not a multiple of P", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
        c.capacity = 3; /* 40+ tokens, K = 2 of 8 over P ranks: overflow */
        c.overflow = 1;
        run_case("capacity too small", &c, &rng);
        if (!hopper) continue;
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.Tr[1] = 0;
        c.Tr[0] = 58;
        c.overlap = 1;
        run_case("Hopper, overlap, uneven, rank 1 without tokens", &c, &rng);
        /* every rank at capacity (the uneven cases have their largest rank
         * at capacity and the others packing) */
        at_capacity_cases(P, -1, halves, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.one_rank = 1;
        c.overlap = 1;
        c.path_halves = halves; /* n <= 512 */
        run_case("Hopper, overlap, every pair on rank 0's experts", &c, &rng);
        /* n > 512: the forward's chunks are whole slices, as the backward's */
        c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 576; c.D.has_bias = 1;
        c.D.w1_layout = SMOE_W1_INTERLEAVED;
        for (int q = 0; q < P; q++) c.Tr[q] = 90 + 23 * q;
        c.overlap = 1;
        c.capacity = 0; /* max_tokens, odd: unequal halves */
        c.path_halves = 2;
        run_case("Hopper, overlap, n > 512 (no halves), odd capacity", &c, &rng);
        c.D.n = 512;
        c.path_halves = halves;
        run_case("Hopper, overlap, n = 512 (halves), odd capacity", &c, &rng);
        c.D.E = 32; c.D.K = 16; /* K > 8: whole slices again */
        c.path_halves = 2;
        run_case("Hopper, overlap, n = 512, K = 16 (no halves)", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.capacity = 4;
        c.overflow = 1;
        c.overlap = 1;
        run_case("Hopper, overlap, capacity too small", &c, &rng);
        /* overlap = 2: the forward exchanges, then computes; the backward
         * in chunks (with x itself where T = capacity, halves never) */
        c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64; c.D.has_bias = 1;
        c.overlap = 2;
        c.path_bwonly = 1;
        c.path_halves = 2;
        run_case("Hopper, overlap in the backward only", &c, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.overlap = 2;
        c.path_bwonly = 1;
        c.graph = 1;
        c.accumulate = 1;
        c.keep_x = 1;
        run_case("Hopper, overlap in the backward only, keep_x, CUDA graph replays", &c, &rng);
        c = at_capacity(P, SMOE_ROUTING_TOPK_SOFTMAX, 64, 48); /* x itself travels */
        c.overlap = 2;
        c.path_bwonly = 1;
        c.path_whole = 1;
        c.logits = 1;
        run_case("Hopper, overlap in the backward only, every rank at capacity", &c, &rng);
        /* copy engines (W1 interleaved: the Hopper dX~ GEMM's view) */
        for (int m = 0; m < 3; m++) {
            c = base_case(P, modes[m], SMOE_BACKEND_SM90);
            c.D.d = 128; c.D.n = 64;
            c.D.w1_layout = SMOE_W1_INTERLEAVED;
            c.D.activation = (smoe_activation)((P + m + 1) % 7);
            c.D.has_bias = (P + m) % 2;
            c.accumulate = m == 1;
            c.logits = 2 - m % 2;
            for (int q = 0; q < P; q++) c.Tr[q] = 40 + 14 * q;
            c.ce = 1;
            run_case("copy engines, balanced", &c, &rng);
        }
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.ce = 1;
        c.graph = 1;
        c.accumulate = 1;
        run_case("copy engines, CUDA graph replays", &c, &rng);
        c.keep_x = 1;
        run_case("copy engines, keep_x, CUDA graph replays", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.Tr[1] = 0;
        c.Tr[0] = 57; /* capacity 57: the two parts of 29 rows, one padded */
        c.ce = 1;
        c.path_whole = 2; /* an odd capacity: packed */
        run_case("copy engines, odd capacity, rank 1 without tokens", &c, &rng);
        c.Tr[0] = 80; /* the capacity, even: x itself, rank 1 empty, the others copied */
        c.path_whole = 1;
        run_case("copy engines, x itself, uneven, rank 1 without tokens", &c, &rng);
        c.Tr[0] = 90;
        c.capacity = 88; /* under max_tokens (90): packed */
        c.path_whole = 2;
        run_case("copy engines, capacity under max_tokens", &c, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.one_rank = 1;
        c.ce = 1;
        run_case("copy engines, every pair on rank 0's experts", &c, &rng);
        c = base_case(P, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.ce = 1;
        c.share = 1;
        run_case("copy engines, two layers sharing a window", &c, &rng);
        /* every rank at capacity: x itself by all-gathers (the forward's
         * rows, the backward's dout and x) */
        at_capacity_cases(P, 1, 0, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.capacity = 4;
        c.overflow = 1;
        c.ce = 1;
        run_case("copy engines, capacity too small", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_CUDA);
        c.ce = 1;
        c.refused = "no view";
        run_case("copy engines on the portable GEMMs", &c, &rng);
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.ce = 1;
        c.overlap = -1;
        c.refused = "overlap = -1";
        run_case("copy engines with overlap = -1", &c, &rng);
        c.overlap = 2;
        c.refused = "overlap = 2";
        run_case("copy engines with overlap = 2", &c, &rng);
        /* copy_engines = 0: copy engines from P = 4 on the Hopper GEMMs
         * with overlap >= 0, NCCL's kernels otherwise */
        c = base_case(P, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_BACKEND_SM90);
        c.D.d = 128; c.D.n = 64;
        c.ce = 0;
        c.path_ce = P >= 4 ? 1 : 2;
        run_case("copy engines automatic", &c, &rng);
        c.overlap = -1;
        c.path_ce = 2;
        run_case("copy engines automatic, overlap = -1", &c, &rng);
        c = base_case(P, SMOE_ROUTING_GENERAL, SMOE_BACKEND_CUDA);
        c.ce = 0;
        c.path_ce = 2;
        run_case("copy engines automatic, portable GEMMs", &c, &rng);
    }
    return tu_summary("test_ep_gpu");
}
