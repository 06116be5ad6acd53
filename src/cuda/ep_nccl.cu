/*
 * ep_nccl.cu -- the expert-parallel layer's CUDA path and NCCL: the library
 * loaded at run time (dlopen, the process's libnccl first; nccl.h is not
 * needed to build), the point-to-point groups every exchange is made of,
 * and the layer's CUDA state, made at create and freed: the caller's
 * communicator checked against rank and nranks, every rank's description
 * compared over it, the chunks and their order, the overlap's stream,
 * events and own communicator (split from the caller's).
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/ep_cuda.h"

/* ------------------------------------------------------------ NCCL */

typedef struct nccl_api {
    nccl_result (*GroupStart)(void);
    nccl_result (*GroupEnd)(void);
    nccl_result (*Send)(const void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*Recv)(void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*AllGather)(const void *, void *, size_t, int, nccl_comm, cudaStream_t);
    nccl_result (*CommCount)(const nccl_comm, int *);
    nccl_result (*CommUserRank)(const nccl_comm, int *);
    nccl_result (*CommSplit)(nccl_comm, int, int, nccl_comm *, void *);
    nccl_result (*CommDestroy)(nccl_comm);
    const char *(*GetErrorString)(nccl_result);
    /* NCCL >= 2.28 (copy-engine all-to-all): NULL where the library lacks them */
    nccl_result (*GetVersion)(int *);
    nccl_result (*MemAlloc)(void **, size_t);
    nccl_result (*MemFree)(void *);
    nccl_result (*CommWindowRegister)(nccl_comm, void *, size_t, void **, int);
    nccl_result (*CommWindowDeregister)(nccl_comm, void *);
    nccl_result (*AlltoAll)(const void *, void *, size_t, int, nccl_comm, cudaStream_t);
} nccl_api;

static nccl_api g_nccl;
static int g_nccl_state; /* 0 not tried, 1 loaded, -1 failed */
static char g_nccl_why[512];
static pthread_mutex_t g_nccl_lock = PTHREAD_MUTEX_INITIALIZER;

/* The process's libnccl if one is loaded (PyTorch's), else
 * $SMOE_NCCL_LIBRARY, else libnccl.so.2 by the loader's search. */
static int nccl_load(void)
{
    pthread_mutex_lock(&g_nccl_lock);
    if (g_nccl_state == 0) {
        const char *env = getenv("SMOE_NCCL_LIBRARY");
        void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
        if (!h && env && *env) h = dlopen(env, RTLD_NOW | RTLD_GLOBAL);
        if (!h) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
        if (!h) {
            snprintf(g_nccl_why, sizeof g_nccl_why,
                     "dlopen(%s): %s (set SMOE_NCCL_LIBRARY to libnccl.so.2's path)",
                     env && *env ? env : "libnccl.so.2", dlerror());
            g_nccl_state = -1;
        } else {
#define NCCL_SYM(f)                                                                \
    do {                                                                           \
        *(void **)&g_nccl.f = dlsym(h, "nccl" #f);                                 \
        if (!g_nccl.f && g_nccl_state == 0) {                                      \
            snprintf(g_nccl_why, sizeof g_nccl_why, "libnccl has no nccl%s", #f);  \
            g_nccl_state = -1;                                                     \
        }                                                                          \
    } while (0)
            NCCL_SYM(GroupStart);
            NCCL_SYM(GroupEnd);
            NCCL_SYM(Send);
            NCCL_SYM(Recv);
            NCCL_SYM(AllGather);
            NCCL_SYM(CommCount);
            NCCL_SYM(CommUserRank);
            NCCL_SYM(CommSplit);
            NCCL_SYM(CommDestroy);
            NCCL_SYM(GetErrorString);
#undef NCCL_SYM
            *(void **)&g_nccl.GetVersion = dlsym(h, "ncclGetVersion");
            *(void **)&g_nccl.MemAlloc = dlsym(h, "ncclMemAlloc");
            *(void **)&g_nccl.MemFree = dlsym(h, "ncclMemFree");
            *(void **)&g_nccl.CommWindowRegister = dlsym(h, "ncclCommWindowRegister");
            *(void **)&g_nccl.CommWindowDeregister = dlsym(h, "ncclCommWindowDeregister");
            *(void **)&g_nccl.AlltoAll = dlsym(h, "ncclAlltoAll");
            if (g_nccl_state == 0) g_nccl_state = 1;
        }
    }
    const int ok = g_nccl_state == 1;
    pthread_mutex_unlock(&g_nccl_lock);
    return ok;
}

#define NCCL_CHECK(expr)                                                                  \
    do {                                                                                  \
        nccl_result smoe_nr_ = (expr);                                                   \
        if (smoe_nr_ != NCCL_OK)                                                      \
            return smoe_fail(SMOE_ERROR_BACKEND, "%s:%d: %s: %s", __FILE__, __LINE__, #expr, \
                             g_nccl.GetErrorString(smoe_nr_));                            \
    } while (0)

/* ncclConfig_t as NCCL 2.18 laid it out (NCCL reads a config by its size
 * and version, so a newer library takes this one): what the layer's own
 * communicator asks for. */
typedef struct nccl_config {
    size_t size;
    unsigned int magic;   /* 0xcafebeef */
    unsigned int version; /* NCCL_VERSION(2, 18, 0) */
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
} nccl_config;

/* ncclConfig_t as NCCL 2.28 laid it out: the copy engines' communicator
 * (CTAPolicy NCCL_CTA_POLICY_ZERO = 2); INT_MIN / NULL are "unset". */
typedef struct nccl_config28 {
    size_t size;
    unsigned int magic;
    unsigned int version; /* NCCL_VERSION(2, 28, 0) */
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare, trafficClass;
    const char *commName;
    int collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs, nChannelsPerNetPeer,
        nvlinkCentricSched;
} nccl_config28;

static nccl_comm comm_of(const smoe_ep_layer *ep)
{
    return ep->cuda && ep->cuda->comm ? ep->cuda->comm : (nccl_comm)ep->desc.nccl_comm;
}

static smoe_status p2p_group(nccl_comm comm, const p2p_op *op, int n, cudaStream_t s)
{
    NCCL_CHECK(g_nccl.GroupStart());
    for (int i = 0; i < n; i++) {
        if (!op[i].bytes) continue;
        nccl_result r1 = g_nccl.Send(op[i].send, op[i].bytes, NCCL_UINT8, op[i].to, comm, s);
        nccl_result r2 = g_nccl.Recv(op[i].recv, op[i].bytes, NCCL_UINT8, op[i].from, comm, s);
        if (r1 != NCCL_OK || r2 != NCCL_OK) {
            g_nccl.GroupEnd();
            return smoe_fail(SMOE_ERROR_BACKEND, "expert parallelism: ncclSend/Recv: %s",
                             g_nccl.GetErrorString(r1 != NCCL_OK ? r1 : r2));
        }
    }
    NCCL_CHECK(g_nccl.GroupEnd());
    return SMOE_SUCCESS;
}

/* 0: the layer's communicator, 1: its messages' one where it has one, 2:
 * the caller's */
static nccl_comm comm_pick(const smoe_ep_layer *ep, int which)
{
    if (which == 2) return (nccl_comm)ep->desc.nccl_comm;
    if (which == 1 && ep->cuda && ep->cuda->mcomm) return ep->cuda->mcomm;
    return comm_of(ep);
}

smoe_status smoe_ep_p2p_group(const smoe_ep_layer *ep, const p2p_op *op, int n, int comm,
                              cudaStream_t s)
{
    return p2p_group(comm_pick(ep, comm), op, n, s);
}

/* The exchange of several buffers with every rank, itself included (n <= 2):
 * rank r's slice q (x[b].row bytes) goes to rank q's slice r. */
smoe_status smoe_ep_alltoall(const smoe_ep_layer *ep, const cbuf *x, int n, int msg,
                             cudaStream_t s)
{
    p2p_op op[2 * 64];
    int k = 0;
    for (int b = 0; b < n && b < 2; b++)
        for (int q = 0; q < ep->P; q++) {
            op[k].send = x[b].send + (size_t)q * x[b].row;
            op[k].recv = x[b].recv + (size_t)q * x[b].row;
            op[k].bytes = x[b].row;
            op[k].to = op[k].from = q;
            k++;
        }
    return p2p_group(comm_pick(ep, msg), op, k, s);
}

smoe_status smoe_ep_ce_alltoall(const smoe_ep_layer *ep, const char *send, char *recv, size_t bytes,
                                cudaStream_t s)
{
    nccl_result nr = g_nccl.AlltoAll(send, recv, bytes, NCCL_UINT8, ep->cuda->ce_comm, s);
    SMOE_RETURN_ERROR_IF(nr != NCCL_OK, SMOE_ERROR_BACKEND,
                         "expert parallelism: ncclAlltoAll (copy engines): %s",
                         g_nccl.GetErrorString(nr));
    return SMOE_SUCCESS;
}

smoe_status smoe_ep_ce_allgather(const smoe_ep_layer *ep, const char *send, char *recv,
                                 size_t bytes, cudaStream_t s)
{
    nccl_result nr = g_nccl.AllGather(send, recv, bytes, NCCL_UINT8, ep->cuda->ce_comm, s);
    SMOE_RETURN_ERROR_IF(nr != NCCL_OK, SMOE_ERROR_BACKEND,
                         "expert parallelism: ncclAllGather (copy engines): %s",
                         g_nccl.GetErrorString(nr));
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ copy engines' windows */

/* The layers of one communicator (the caller's, on one device) share the
 * copy engines' communicator and their windows: a layer takes the smallest
 * window that holds its buffers, or registers a new one of its size (a
 * collective, as is create itself: every rank creates and frees its layers
 * in the same order, so every rank finds or makes the same window). A
 * window is freed with its last layer, the communicator with its last
 * window. The layers sharing a window must run one at a time (one stream,
 * as a model's layers do); a CUDA graph keeps working, as no window moves
 * while a layer holds it. */
#define CE_MAX_WINDOWS 8
typedef struct ce_window {
    void *mem, *win;
    size_t bytes;
    int refs;
} ce_window;

typedef struct ce_group {
    nccl_comm key;
    int device;
    nccl_comm comm;
    ce_window w[CE_MAX_WINDOWS];
    struct ce_group *next;
} ce_group;

static ce_group *g_ce; /* under g_nccl_lock, never held across a collective */

static ce_group *ce_find(nccl_comm key, int device)
{
    for (ce_group *g = g_ce; g; g = g->next)
        if (g->key == key && g->device == device) return g;
    return NULL;
}

/* The group without windows goes: out of the list, its communicator
 * destroyed. */
static void ce_drop_if_empty(ce_group *g)
{
    int any = 0;
    for (int i = 0; i < CE_MAX_WINDOWS; i++) any |= g->w[i].mem != NULL;
    if (any) return;
    pthread_mutex_lock(&g_nccl_lock);
    for (ce_group **p = &g_ce; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
    pthread_mutex_unlock(&g_nccl_lock);
    g_nccl.CommDestroy(g->comm);
    free(g);
}

/* A window of `need` bytes or more for this layer: its memory in *mem;
 * *nowin = 1 where NCCL has no symmetric windows on this communicator. */
static smoe_status ce_acquire(smoe_ep_layer *ep, size_t need, char **mem, int *nowin)
{
    const char *fn = "smoe_ep_layer_create";
    ep_cuda *X = ep->cuda;
    nccl_comm key = (nccl_comm)ep->desc.nccl_comm;
    const int dev = ep->desc.layer.device;
    pthread_mutex_lock(&g_nccl_lock);
    ce_group *g = ce_find(key, dev);
    pthread_mutex_unlock(&g_nccl_lock);
    if (!g) {
        nccl_config28 cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.size = sizeof cfg;
        cfg.magic = 0xcafebeef;
        cfg.version = 22800;
        cfg.blocking = 1;
        cfg.cgaClusterSize = cfg.minCTAs = cfg.maxCTAs = INT_MIN;
        cfg.splitShare = cfg.trafficClass = cfg.collnetEnable = INT_MIN;
        cfg.shrinkShare = cfg.nvlsCTAs = cfg.nChannelsPerNetPeer = INT_MIN;
        cfg.nvlinkCentricSched = INT_MIN;
        cfg.CTAPolicy = 2; /* NCCL_CTA_POLICY_ZERO */
        nccl_comm ce = NULL;
        nccl_result nr = g_nccl.CommSplit(key, 0, ep->r, &ce, &cfg);
        SMOE_RETURN_ERROR_IF(nr != NCCL_OK || !ce, SMOE_ERROR_BACKEND,
                             "%s: ncclCommSplit (copy engines): %s", fn,
                             g_nccl.GetErrorString(nr));
        g = (ce_group *)calloc(1, sizeof *g);
        if (!g) {
            g_nccl.CommDestroy(ce);
            return smoe_fail(SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation", fn);
        }
        g->key = key;
        g->device = dev;
        g->comm = ce;
        pthread_mutex_lock(&g_nccl_lock);
        g->next = g_ce;
        g_ce = g;
        pthread_mutex_unlock(&g_nccl_lock);
    }
    int best = -1, freew = -1;
    for (int i = 0; i < CE_MAX_WINDOWS; i++) {
        if (!g->w[i].mem) {
            if (freew < 0) freew = i;
        } else if (g->w[i].bytes >= need && (best < 0 || g->w[i].bytes < g->w[best].bytes)) {
            best = i;
        }
    }
    if (best < 0) {
        SMOE_RETURN_ERROR_IF(freew < 0, SMOE_ERROR_UNSUPPORTED,
                             "%s: copy engines: %d windows of different sizes on this "
                             "communicator already (the most)",
                             fn, CE_MAX_WINDOWS);
        ce_window *w = &g->w[freew];
        nccl_result nr = g_nccl.MemAlloc(&w->mem, need);
        if (nr != NCCL_OK || !w->mem) {
            w->mem = NULL;
            return smoe_fail(SMOE_ERROR_OUT_OF_MEMORY,
                             "%s: ncclMemAlloc of %zu bytes (copy engines' window): %s", fn,
                             need, g_nccl.GetErrorString(nr));
        }
        nr = g_nccl.CommWindowRegister(g->comm, w->mem, need, &w->win, 1 /* symmetric */);
        if (nr != NCCL_OK || !w->win) {
            /* NCCL registers nothing (and says success) where the ranks'
             * GPUs cannot all reach each other's memory by load and store:
             * every rank of the communicator finds the same */
            g_nccl.MemFree(w->mem);
            memset(w, 0, sizeof *w);
            ce_drop_if_empty(g);
            *nowin = 1; /* copy_engines = 0 then takes NCCL's kernels */
            if (nr == NCCL_OK) {
                return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                                 "%s: copy_engines = 1, but NCCL registered no symmetric window "
                                 "on this communicator (its ranks' GPUs do not all reach each "
                                 "other's memory: across nodes, or over PCIe); copy_engines = "
                                 "-1 or 0 uses NCCL's kernels",
                                 fn);
            }
            return smoe_fail(SMOE_ERROR_BACKEND, "%s: ncclCommWindowRegister: %s", fn,
                             g_nccl.GetErrorString(nr));
        }
        w->bytes = need;
        best = freew;
    }
    g->w[best].refs++;
    X->ce_group = g;
    X->ce_win = best;
    X->ce_comm = g->comm;
    *mem = (char *)g->w[best].mem;
    return SMOE_SUCCESS;
}

static void ce_release(ep_cuda *X)
{
    ce_group *g = (ce_group *)X->ce_group;
    if (!g) return;
    ce_window *w = &g->w[X->ce_win];
    if (--w->refs == 0) {
        g_nccl.CommWindowDeregister(g->comm, w->win);
        g_nccl.MemFree(w->mem);
        memset(w, 0, sizeof *w);
    }
    ce_drop_if_empty(g);
    X->ce_group = NULL;
}

/* ------------------------------------------------------------ create */

void smoe_ep_cuda_free(smoe_ep_layer *ep)
{
    ep_cuda *X = ep ? ep->cuda : NULL;
    if (!X) return;
    int prev = 0;
    const int have = cudaGetDevice(&prev) == cudaSuccess;
    if (have) cudaSetDevice(ep->desc.layer.device);
    ep_trace_report(ep); /* SMOE_EP_TRACE=1 only */
    for (int i = 0; i < X->n_ev; i++)
        if (X->ev[i]) cudaEventDestroy(X->ev[i]);
    if (X->cs) cudaStreamDestroy(X->cs);
    ce_release(X);
    if (X->own_comm && X->comm) g_nccl.CommDestroy(X->comm);
    if (X->mcomm) g_nccl.CommDestroy(X->mcomm);
    if (have) cudaSetDevice(prev);
    free(X->ev);
    free(X);
    ep->cuda = NULL;
}

/* The overlap's chunks on NCCL's kernels: one per source rank, in the
 * order its rows arrive (round k brings rank r - k's), this rank's own in
 * two around them where split (the first while the peers' rows travel,
 * the second last); halves: every peer's in two as well, all first halves
 * before the second ones (the order they travel in). */
static void chunks_make(ep_chunks *K, int P, int r, int64_t C, int split, int halves)
{
    int first[64], second[64], c = 0;
    for (int q = 0; q < P; q++) {
        first[q] = c;
        K->bd.b[c++] = (int64_t)q * C;
        second[q] = c;
        K->bd.b[c++] = (int64_t)q * C + C / 2;
        if (q == r ? !split : !halves) second[q] = -1, c--;
    }
    K->bd.b[c] = (int64_t)P * C;
    K->nc = c;
    K->halves = halves;
    int i = 0;
    K->order[i++] = first[r];
    for (int k = 1; k < P; k++) K->order[i++] = first[(r - k + P) % P];
    for (int k = 1; halves && k < P; k++) K->order[i++] = second[(r - k + P) % P];
    if (split) K->order[i++] = second[r];
}

/* The chunks, their order and the stream and events of the overlap: the
 * first half of this rank's own rows while the peers' rows travel, then
 * the peers' in the order they arrive, each one's partial sums sent back
 * while the next computes, and the second half of this rank's own last
 * (forward and backward alike, but for the forward's halves at P = 2
 * where n <= 512, and the backward at P = 2 on NCCL's kernels, whose own
 * rows are one chunk; the backward's weight gradients follow, one of them
 * beside the last partial sums). */
static smoe_status cuda_state_make(smoe_ep_layer *ep, int no_ce, int *nowin)
{
    const char *fn = "smoe_ep_layer_create";
    ep_cuda *X = (ep_cuda *)calloc(1, sizeof *X);
    SMOE_RETURN_ERROR_IF(!X, SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation", fn);
    ep->cuda = X;
    const int P = ep->P, r = ep->r;
    X->g = smoe_cuda_layer_gemms(ep->experts, ep->rows);
    SMOE_RETURN_ERROR_IF(ep->desc.overlap >= 1 && !X->g.views, SMOE_ERROR_UNSUPPORTED,
                         "%s: overlap = %d, but this layer's expert GEMMs (%s) take no view of "
                         "their rows (the Hopper GEMMs do)",
                         fn, ep->desc.overlap, smoe_layer_path_name(ep->experts));
    const int split = ep->C >= 2 ? 1 : 0; /* this rank's own rows in two */
    /* overlap = 0: on where each exchange sends at least 128 MiB to a peer.
     * Measured on 2 H100s (bench/RESULTS.md, "Expert parallelism"): with
     * 256 MiB slices (30B-n512, 120B-n1024) the overlap gains 2.5-2.7 points
     * of per-GPU throughput; with 64 MiB slices (Qwen3-30B-A3B-like,
     * Mixtral-like) the chunks and the SMs left to NCCL cost more than the
     * exchanges they hide (1.5-9 points lost). */
    const double slice = (double)ep->C * (double)ep->desc.layer.d * 2.0;
    const int want = ep->desc.overlap == 1 || (ep->desc.overlap == 0 && slice >= 128.0 * 1048576.0);
    /* The backward alone (overlap = 2, or 0 where the slices are 64 MiB or
     * more and K n <= 8192: the rows' GEMM work per exchanged byte goes
     * as K n). 2 x H200, P = 2, same call, 2 rounds (session 48):
     * Qwen3-like (64 MiB slices, K n = 6144) backward 5.44 / 5.56 ms
     * sequential, 5.28 / 5.21 with the overlap, while its forward lost
     * with it (2.88 / 2.95 -> 3.50 / 3.53); Mixtral-like (64 MiB, K n =
     * 28672) lost both ways (backward 19.58 / 19.60 -> 20.20 / 20.06).
     * With the backward's two chunks (session 49), 3 rounds (session 50):
     * Qwen3-like backward 5.36-5.51 -> 5.09-5.27 ms, forward even;
     * OLMoE-like (K n = 8192) even both ways, 2 rounds. */
    const int64_t kn = (int64_t)ep->desc.layer.K * ep->desc.layer.n;
    const int want_b = want || ep->desc.overlap == 2 ||
                       (ep->desc.overlap == 0 && slice >= 64.0 * 1048576.0 && kn <= 8192);
    /* copy engines: each exchange in H parts (2 measured better than 4 at
     * P = 4, bench/RESULTS.md "copy engines") */
    const int H = 2;
    SMOE_RETURN_ERROR_IF(ep->desc.copy_engines == 1 && !X->g.views, SMOE_ERROR_UNSUPPORTED,
                         "%s: copy_engines = 1, but this layer's expert GEMMs (%s) take no view "
                         "of their rows (the Hopper GEMMs do)",
                         fn, smoe_layer_path_name(ep->experts));
    /* copy_engines = 0: on from P = 4, where they measured faster on every
     * shape (4 x H200: 30B-n512 77.5% of the single layer per GPU against
     * 74.4% on NCCL's kernels, 120B-n1024 86.5 / 83.0, Qwen3-like 73.2 /
     * 53.3, Mixtral-like 93.5 / 87.9), off at P = 2 (slower on three shapes
     * of four there); where NCCL has them and registers symmetric windows
     * (else NCCL's kernels, and the path name says why) */
    const int ce_syms = g_nccl.AlltoAll && g_nccl.MemAlloc && g_nccl.MemFree &&
                        g_nccl.CommWindowRegister && g_nccl.CommWindowDeregister;
    const int ce_auto = ep->desc.copy_engines == 0 && !no_ce && P >= 4 && X->g.views &&
                        (ep->desc.overlap == 0 || ep->desc.overlap == 1) && ce_syms;
    X->ce = (ep->desc.copy_engines == 1 || ce_auto) && P > 1 && ep->C > 0;
    X->sl.C = ep->C;
    X->sl.P = P;
    X->sl.self = r;
    X->sl.H = X->ce ? H : 1;
    X->sl.Ch = X->ce ? (ep->C + H - 1) / H : ep->C;
    X->sl.own_end = X->ce;
    ep_chunks *B = &X->bw, *F = &X->fw;
    B->nc = X->ce ? H + 1 + split : want_b && X->g.views && P > 1 ? P + split : 1;
    B->own_b = -1;
    if (X->ce) {
        /* this rank's first half, the parts as they arrive, its second half */
        const int64_t Xr = ep_slots_exchanged(X->sl);
        int c = 0;
        for (int h = 0; h < H; h++) B->bd.b[c++] = (int64_t)h * P * X->sl.Ch;
        B->bd.b[c++] = Xr;
        if (split) B->bd.b[c++] = Xr + ep->C / 2;
        B->bd.b[c] = Xr + ep->C;
        int i = 0;
        B->order[i++] = H;
        for (int h = 0; h < H; h++) B->order[i++] = h;
        if (split) B->order[i++] = H + 1;
    } else if (B->nc == 1) {
        B->bd.b[0] = 0;
        B->bd.b[1] = (int64_t)P * ep->C;
        B->order[0] = 0;
    } else {
        chunks_make(B, P, r, ep->C, split, 0);
    }
    /* The forward: the backward's chunks, or, at P = 2 where n <= 512 and K <= 8,
     * every peer's rows in two halves that travel one after the other, each half its own
     * chunk: the GEMMs of a received half start while the second travels,
     * and the last partial sums to leave are half a slice. Measured in
     * session 17 (2 x H200, P = 2, every chunk in halves, the backward
     * too): the forward of 30B-n512 73% -> 77-78% of the single layer's,
     * but 120B-n1024's 5% slower (n = 1024: its GEMMs hide the whole
     * slice's exchange already, and halves make smaller GEMMs); the
     * backward lost on both, so it keeps whole slices. Session 30, the
     * forward alone (same call, 3 rounds): 30B-n512 forward 72% -> 78%,
     * total 82% -> 83%. Session 31 (same machine, 3 rounds each): at K =
     * 16 they do not pay, so K <= 8 (general routing, K = 0, too): 30B-n256
     * total 83.5-83.9% -> 83.0-84.3%, 120B-n512 88.5-89.0% -> 87.3-88.2%
     * (its forward 0.4-0.6 ms slower), 30B-n512 80.9-81.5% -> 81.8-83.1%.
     * At P = 2 only: at P = 4 (the kernel path; the copy engines have parts
     * of their own) the halves made 30B-n512's forward 13.2 ms against 9.2
     * without them (4 x H200, session 33, same call: fwd+bwd 66.7% -> 75.5%
     * of the single layer per GPU; where the time goes was not traced). */
    *F = *B;
    if (!X->ce && B->nc > 1 && !want) {
        /* the backward alone: one forward chunk, its exchanges on the
         * caller's communicator (2 x H200, Qwen3-like at P = 2: forward
         * 4.12-4.21 ms on the layer's, 8 CTAs at most, against 2.89-2.99
         * on the caller's) */
        X->fw_caller = 1;
        F->nc = 1;
        F->bd.b[0] = 0;
        F->bd.b[1] = (int64_t)P * ep->C;
        F->order[0] = 0;
        F->halves = 0;
    }
    if (!X->ce && want && B->nc > 1 && split && P == 2 && ep->desc.layer.n <= 512 &&
        ep->desc.layer.K <= 8)
        chunks_make(F, P, r, ep->C, split, 1);
    /* The forward's own chunks split at a share of this rank's own rows
     * (found on the device), not of the C slots as the backward's (bd's C /
     * 2: Mixtral-like at P = 4 fills about 46% of them, so there the
     * second chunk was empty): a third first at P >= 4, since the last
     * chunk hides the last part's partial sums, which take longer beside
     * the GEMMs than the first part's rows do alone (4 x H200, same call:
     * forward 0.14-0.55 ms faster on four shapes, fwd+bwd 0.11-0.37 ms on
     * three; a quarter no better); half at P = 2. The backward, where it
     * splits its own rows (P >= 4, the copy engines), measured best with
     * bd's halves (bench/RESULTS.md session 20): split by rows, its first
     * own chunk's dx partials wait for the second, where they no longer
     * fill the wait for dout's first part. */
    F->own_b = !split || F->nc == 1 ? -1 : X->ce ? H + 1 : F->order[F->nc - 1];
    F->own_share = P >= 4 ? 33 : 50;
    /* The backward at P = 2 on NCCL's kernels: this rank's own rows in one
     * chunk, first (their GEMMs last until the peer's dout has arrived),
     * then the peer's; the peer's dx partial sums then come back beside a
     * weight gradient instead of beside a last own chunk: dW2 where it
     * outlasts their exchange, else dW1 (dw1_beside; general routing, K =
     * 0, too), the other after the join on every SM. The GEMMs' time grows
     * with every chunk (each expert's rows cut into more m-tiles, ragged
     * ends and tails: 30B-n512's backward chunk GEMMs 6.3-6.4 ms in three
     * chunks against 5.4-5.5 in one, with the exchanges as local copies,
     * SMOE_EP_TRACE, session 49). dW2's time against the partial sums'
     * grows with K n (30B-n512, K n = 4096: dW2 1.87 ms, the partial sums
     * 2.48 ms beside it; 120B-n1024, K n = 8192: dW2 outlasts them). Same
     * binary, 3 interleaved rounds (2 x H200, session 49) against session
     * 48's schedule (own rows split at 65%, the second part last, dW2
     * beside): backward 30B-n512 14.17-14.32 -> 13.97-13.98 ms (dW2 beside
     * instead: 14.33-14.41), 120B-n1024 26.04-26.17 -> 25.46-25.61 (dW1
     * beside instead: 25.71-25.74); per GPU 81.8-83.2% -> 83.7-84.1% and
     * 86.4-87.8% -> 88.3-88.4% of the single layer. */
    if (!X->ce && split && B->nc > 1 && P == 2) {
        chunks_make(B, P, r, ep->C, 0, 0);
        X->dw1_beside = (int64_t)ep->desc.layer.K * ep->desc.layer.n < 8192;
    }
    /* 0: four SMs per rank, 8 to 32 (best measured: 8 at P = 2, 16 at P = 4;
     * more peers want more of NCCL's channels at once); copy engines: 8 (the
     * rows need none; the counts, pairs and dS messages go faster with 8
     * than with 2 at P = 4) */
    const int r_auto = X->ce ? 8 : 4 * P < 8 ? 8 : 4 * P > 32 ? 32 : 4 * P;
    int R = ep->desc.comm_sms == 0 ? r_auto : ep->desc.comm_sms < 0 ? 0 : ep->desc.comm_sms;
    if (R > X->g.num_sms / 2) R = X->g.num_sms / 2;
    X->sms_overlap = X->g.num_sms - R;
    const int ncm = F->nc > B->nc ? F->nc : B->nc;
    X->n_ev = EV_IN + 2 * P + ncm;
    X->ev = (cudaEvent_t *)calloc((size_t)X->n_ev, sizeof(cudaEvent_t));
    SMOE_RETURN_ERROR_IF(!X->ev, SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation", fn);
    int lo = 0, hi = 0;
    SMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    SMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&X->cs, cudaStreamNonBlocking, hi));
    for (int i = 0; i < X->n_ev; i++)
        SMOE_CUDA_CHECK(cudaEventCreateWithFlags(&X->ev[i], cudaEventDisableTiming));
    ep_trace_make(X); /* SMOE_EP_TRACE=1 only */
    /* The overlap's exchanges run beside GEMMs that leave R SMs free: NCCL's
     * kernels must fit there, so the layer splits a communicator of its own
     * whose kernels launch one CTA per cluster (the default, clusters of
     * four, finds no room among scattered free SMs and waits for the GEMM;
     * bench/nccl_overlap_probe.cu measures it) and at most R of them. */
    if (B->nc > 1 && P > 1) {
        nccl_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.size = sizeof cfg;
        cfg.magic = 0xcafebeef;
        cfg.version = 21800;
        cfg.blocking = 1;
        cfg.cgaClusterSize = 1;
        cfg.minCTAs = INT_MIN; /* NCCL's "unset" */
        cfg.maxCTAs = R > 0 ? R : INT_MIN;
        cfg.netName = NULL;
        cfg.splitShare = 0;
        nccl_comm mine = NULL;
        nccl_result nr = g_nccl.CommSplit((nccl_comm)ep->desc.nccl_comm, 0, r, &mine, &cfg);
        SMOE_RETURN_ERROR_IF(nr != NCCL_OK || !mine, SMOE_ERROR_BACKEND,
                             "%s: ncclCommSplit (the overlap's communicator): %s", fn,
                             g_nccl.GetErrorString(nr));
        X->comm = mine;
        X->own_comm = 1;
        /* NCCL's kernels: a rank whose T is the capacity sends x itself
         * (ep_cuda.cu's ep_whole_x). Where a row carries at most 8 pairs
         * (64 bytes of pairs against d * 2 of row), the forward's counts
         * and pairs go first on comm, with its R CTAs, and x's rows after
         * them (pairs_first); else x's rows leave at the forward's start
         * and the counts and pairs, which the expert side needs first, go
         * beside them on a second communicator of one CTA (mcomm; NCCL
         * runs one communicator's calls in order). At 30B-n512 mcomm's CTA
         * took 0.24 ms for the 2 MiB of pairs beside the rows, comm 0.10 ms
         * ahead of them, and the rows' later start cost nothing. 2 x H200, P = 2, same call, 3
         * interleaved rounds (session 50): forward 30B-n512 7.63-7.71 ->
         * 7.43-7.56 ms, 120B-n1024 12.58-12.63 -> 12.38-12.43; at K = 16
         * (4 MiB of pairs, 30B-n256) it lost, 9.49-9.67 -> 9.74-9.80. The
         * backward-only overlap's forward (F->nc = 1) sends both on the
         * caller's communicator. Decided from the description alone: every
         * rank calls the same communicators in the same order. */
        X->pairs_first = !X->ce && F->nc > 1 && ep->Kmax <= 8;
        if (!X->ce && F->nc > 1 && !X->pairs_first) {
            cfg.maxCTAs = 1;
            mine = NULL;
            nr = g_nccl.CommSplit((nccl_comm)ep->desc.nccl_comm, 0, r, &mine, &cfg);
            SMOE_RETURN_ERROR_IF(nr != NCCL_OK || !mine, SMOE_ERROR_BACKEND,
                                 "%s: ncclCommSplit (the messages' communicator): %s", fn,
                                 g_nccl.GetErrorString(nr));
            X->mcomm = mine;
        }
    }
    if (X->ce) {
        SMOE_RETURN_ERROR_IF(!ce_syms,
                             SMOE_ERROR_UNSUPPORTED,
                             "%s: copy engines: this libnccl has no ncclAlltoAll / ncclMemAlloc "
                             "/ ncclCommWindowRegister (NCCL 2.28 or later)",
                             fn);
        const size_t row = (size_t)ep->desc.layer.d * 2, A = 4096;
        const size_t sx = ((size_t)ep_slots_exchanged(X->sl) * row + A - 1) / A * A;
        const size_t sv = ((size_t)ep_slots_total(X->sl) * row + A - 1) / A * A;
        char *m = NULL;
        SMOE_FORWARD_IF_ERROR(ce_acquire(ep, 3 * (sx + sv), &m, nowin));
        X->rows_send = m; m += sx;
        X->rows_recv = m; m += sv;
        X->do_send = m; m += sx;
        X->do_recv = m; m += sv;
        X->part_send = m; m += sx;
        X->part_recv = m;
        /* x itself: part h of every peer's slice is its x's rows [h Ch,
         * (h + 1) Ch), one all-gather per part (no pack, and on its way from
         * the forward's start). Every rank or none (an all-gather on one
         * and an all-to-all on another would be two collectives), so
         * decided here: where no rank's T can pass the capacity (C >=
         * max_tokens; a smaller capacity is per destination, which x
         * itself would exceed) and the parts split C evenly (else the last
         * part's all-gather would read past x). A rank with T < C copies
         * its rows into the send region first (ep_cuda.cu's
         * ce_whole_stage). */
        X->ce_whole = P > 1 && ep->C > 0 && ep->C >= ep->desc.max_tokens && ep->C % H == 0;
    }
    if (X->ce)
        snprintf(ep->path, sizeof ep->path,
                 "%s; ep: copy engines, %d parts, %d chunks, %d SMs left to NCCL beside the "
                 "GEMMs%s",
                 smoe_layer_path_name(ep->experts), H, B->nc, X->g.num_sms - X->sms_overlap,
                 X->ce_whole ? "; x itself sent by all-gathers" : "");
    else if (B->nc > 1 && F->halves)
        snprintf(ep->path, sizeof ep->path,
                 "%s; ep: overlap, %d chunks (forward: %d, every peer's rows in halves), %d SMs "
                 "left to NCCL beside the GEMMs; x itself sent where T = capacity%s",
                 smoe_layer_path_name(ep->experts), B->nc, F->nc, X->g.num_sms - X->sms_overlap,
                 X->pairs_first ? ", after the pairs" : "");
    else if (B->nc > 1)
        snprintf(ep->path, sizeof ep->path,
                 "%s; ep: overlap%s, %d chunks, %d SMs left to NCCL beside the GEMMs; x itself "
                 "sent where T = capacity%s",
                 smoe_layer_path_name(ep->experts),
                 F->nc == 1 ? " in the backward only (the forward exchanges, then computes)" : "",
                 B->nc, X->g.num_sms - X->sms_overlap, X->pairs_first ? ", after the pairs" : "");
    else
        snprintf(ep->path, sizeof ep->path, "%s; ep: no overlap (exchange, then compute)",
                 smoe_layer_path_name(ep->experts));
    if (no_ce) {
        const size_t k = strlen(ep->path);
        snprintf(ep->path + k, sizeof ep->path - k,
                 "; not the copy engines: NCCL registered no symmetric window");
    }
    return SMOE_SUCCESS;
}

smoe_status smoe_ep_cuda_init(smoe_ep_layer *ep)
{
    const char *fn = "smoe_ep_layer_create";
    SMOE_RETURN_ERROR_IF(!nccl_load(), SMOE_ERROR_NO_DEVICE, "%s: NCCL: %s", fn, g_nccl_why);
    nccl_comm comm = (nccl_comm)ep->desc.nccl_comm;
    int count = 0, rank = -1;
    NCCL_CHECK(g_nccl.CommCount(comm, &count));
    NCCL_CHECK(g_nccl.CommUserRank(comm, &rank));
    SMOE_RETURN_ERROR_IF(count != ep->P || rank != ep->r, SMOE_ERROR_INVALID_VALUE,
                         "%s: the NCCL communicator has %d ranks and this is rank %d; the "
                         "description says rank %d of %d",
                         fn, count, rank, ep->r, ep->P);
    SMOE_RETURN_ERROR_IF(ep->P > 64, SMOE_ERROR_UNSUPPORTED,
                         "%s: nranks = %d, at most 64 ranks on the CUDA path", fn, ep->P);
    SMOE_RETURN_ERROR_IF(ep->desc.layer.d % 8 != 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: d = %lld, a multiple of 8 on the GPU", fn,
                         (long long)ep->desc.layer.d);
    /* every rank's description, compared (a synchronisation: create time) */
    smoe_ep_desc mine = ep->desc;
    mine.rank = 0;
    mine.group = NULL;
    mine.nccl_comm = NULL;
    mine.layer.device = 0; /* each rank's own GPU */
    const size_t b = sizeof mine;
    void *dev = NULL;
    cudaStream_t s = NULL;
    int prev = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&prev));
    SMOE_CUDA_CHECK(cudaSetDevice(ep->desc.layer.device));
    smoe_status r = SMOE_SUCCESS;
    unsigned char *all = (unsigned char *)malloc(b * (size_t)ep->P);
    if (!all) r = smoe_fail(SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation", fn);
    if (r == SMOE_SUCCESS && cudaMalloc(&dev, b * (size_t)(ep->P + 1)) != cudaSuccess)
        r = smoe_fail(SMOE_ERROR_BACKEND, "%s: cudaMalloc for the description check", fn);
    if (r == SMOE_SUCCESS && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        r = smoe_fail(SMOE_ERROR_BACKEND, "%s: cudaStreamCreate", fn);
    if (r == SMOE_SUCCESS &&
        cudaMemcpy((char *)dev + b * (size_t)ep->P, &mine, b, cudaMemcpyHostToDevice) != cudaSuccess)
        r = smoe_fail(SMOE_ERROR_BACKEND, "%s: cudaMemcpy", fn);
    if (r == SMOE_SUCCESS) {
        nccl_result nr = g_nccl.AllGather((char *)dev + b * (size_t)ep->P, dev, b, NCCL_UINT8,
                                           comm, s);
        if (nr != NCCL_OK)
            r = smoe_fail(SMOE_ERROR_BACKEND, "%s: ncclAllGather: %s", fn,
                          g_nccl.GetErrorString(nr));
    }
    if (r == SMOE_SUCCESS && (cudaStreamSynchronize(s) != cudaSuccess ||
                              cudaMemcpy(all, dev, b * (size_t)ep->P, cudaMemcpyDeviceToHost) !=
                                  cudaSuccess))
        r = smoe_fail(SMOE_ERROR_BACKEND, "%s: the description check's copy", fn);
    for (int q = 0; q < ep->P && r == SMOE_SUCCESS; q++)
        if (memcmp(all + b * (size_t)q, &mine, b) != 0)
            r = smoe_fail(SMOE_ERROR_INVALID_VALUE,
                          "%s: rank %d's description differs from rank %d's (every field but "
                          "rank, nccl_comm and layer.device must match)",
                          fn, q, ep->r);
    if (s) cudaStreamDestroy(s);
    if (dev) cudaFree(dev);
    free(all);
    if (r == SMOE_SUCCESS) {
        SMOE_CUDA_CHECK(cudaSetDevice(ep->desc.layer.device));
        int nowin = 0;
        r = cuda_state_make(ep, 0, &nowin);
        if (r != SMOE_SUCCESS && nowin && ep->desc.copy_engines == 0) {
            /* copy_engines = 0 and no symmetric window (none registered,
             * or the registration failed): NCCL's kernels. Where NCCL
             * has no symmetric memory every rank finds the same, so every
             * rank makes the same communicators again. */
            smoe_ep_cuda_free(ep);
            r = cuda_state_make(ep, 1, &nowin);
        }
    }
    cudaSetDevice(prev);
    return r;
}
