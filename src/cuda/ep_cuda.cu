/*
 * ep_cuda.cu -- the expert-parallel layer on the CUDA backends, over NCCL
 * (notes/ep_design.md, "the CUDA path"). Per call, on the caller's stream,
 * with no host synchronisation:
 *
 * forward   router GEMM + routing (the single-GPU kernels, cuda_layer.h) ->
 *           entries: each token's distinct destination ranks, Kq =
 *           min(P, K) per token -> the metadata counting sort with E = P
 *           over them (slot of each (token, rank)) -> pack rows and pairs
 *           by entry -> NCCL: counts and status, rows, pairs (capacity C per
 *           peer) -> expert side: per received row its pairs, a scan, the
 *           triples -> a second status exchange -> the experts' GENERAL
 *           forward with the triple count on the device -> NCCL: partials
 *           back -> the aggregation over the entries (rank order) writes
 *           out and the saved block's header.
 * backward  header check -> x and dout packed by entry -> NCCL -> the
 *           experts' GENERAL backward (dx partials, dS per pair, this rank's
 *           weight gradients) -> dS by slot, NCCL back with the dx
 *           partials -> dS to the assignments -> the router's backward
 *           (dense) -> dx: the aggregation over the entries plus the
 *           router's term.
 *
 * The status word of the call (the EP workspace's first bytes) stops every
 * later kernel of this path; its counts exchange carries every rank's code
 * so that an overflow on one rank stops them all. The experts' own calls
 * have their own status words; when the EP call failed before them, they
 * get no rows (the triple count is 0) and write nothing that is used.
 *
 * NCCL is loaded at run time (dlopen, the process's libnccl first).
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"
#include "ep_internal.h"

/* ------------------------------------------------------------ NCCL */

/* The few NCCL entry points used, by their C ABI (nccl.h is not needed to
 * build: libnccl is found at run time). ncclComm_t is an opaque pointer,
 * ncclResult_t an int (0 = success), NCCL_UINT8 the data type 1. */
typedef int nccl_result;
typedef void *nccl_comm;
enum { NCCL_OK = 0, NCCL_UINT8 = 1 };

typedef struct nccl_api {
    nccl_result (*GroupStart)(void);
    nccl_result (*GroupEnd)(void);
    nccl_result (*Send)(const void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*Recv)(void *, size_t, int, int, nccl_comm, cudaStream_t);
    nccl_result (*AllGather)(const void *, void *, size_t, int, nccl_comm, cudaStream_t);
    nccl_result (*CommCount)(const nccl_comm, int *);
    nccl_result (*CommUserRank)(const nccl_comm, int *);
    const char *(*GetErrorString)(nccl_result);
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
            NCCL_SYM(GetErrorString);
#undef NCCL_SYM
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

/* One exchange of several buffers: for every buffer b and rank q, rank r's
 * send[b] + q * slice[b] goes to rank q's recv[b] + r * slice[b]. */
typedef struct xchg {
    const void *send;
    void *recv;
    size_t slice; /* bytes */
} xchg;

static smoe_status alltoall(const smoe_ep_layer *ep, const xchg *x, int n, cudaStream_t s)
{
    nccl_comm comm = (nccl_comm)ep->desc.nccl_comm;
    NCCL_CHECK(g_nccl.GroupStart());
    for (int b = 0; b < n; b++) {
        if (!x[b].slice) continue;
        for (int q = 0; q < ep->P; q++) {
            nccl_result r1 = g_nccl.Send((const char *)x[b].send + (size_t)q * x[b].slice,
                                          x[b].slice, NCCL_UINT8, q, comm, s);
            nccl_result r2 = g_nccl.Recv((char *)x[b].recv + (size_t)q * x[b].slice,
                                          x[b].slice, NCCL_UINT8, q, comm, s);
            if (r1 != NCCL_OK || r2 != NCCL_OK) {
                g_nccl.GroupEnd();
                return smoe_fail(SMOE_ERROR_BACKEND, "expert parallelism: ncclSend/Recv: %s",
                                 g_nccl.GetErrorString(r1 != NCCL_OK ? r1 : r2));
            }
        }
    }
    NCCL_CHECK(g_nccl.GroupEnd());
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ layouts */

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

/* Entries (destination ranks) per token. */
static int64_t kq_of(const smoe_ep_layer *ep)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const int64_t K = L->routing == SMOE_ROUTING_GENERAL ? L->E : L->K;
    return K < ep->P ? K : ep->P;
}

static int64_t assignments(const smoe_ep_layer *ep, int64_t T, int64_t pairs)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    return L->routing == SMOE_ROUTING_GENERAL ? pairs : T * L->K;
}

typedef struct pair_msg { /* one pair of a row: local expert (-1: none), score */
    int32_t e;
    float s;
} pair_msg;

typedef struct gsaved {
    size_t header, token_offset, assign_expert, assign_row, row_score, logits, pidx, ent_off,
        rows, tri_slot, experts;
    smoe_saved_layout ex;
    size_t total;
} gsaved;

static void gsaved_make(const smoe_ep_layer *ep, int64_t T, int64_t pairs, gsaved *s)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const size_t t = (size_t)T, A = (size_t)assignments(ep, T, pairs), Kq = (size_t)kq_of(ep);
    size_t o = 0;
    memset(s, 0, sizeof *s);
    s->header = o; o += al(sizeof(smoe_saved_header));
    s->token_offset = o; o += al((t + 1) * 4);
    s->assign_expert = o; o += al(A * 4);
    s->assign_row = o; o += al(A * 4);
    s->row_score = o; o += al(A * 4);
    s->logits = o; o += al(L->routing == SMOE_ROUTING_SOFTMAX_TOPK ? t * (size_t)L->E * 4 : 0);
    s->pidx = o; o += al(t * Kq * 4);
    s->ent_off = o; o += al((t + 1) * 4);
    s->rows = o; o += al(4);
    s->tri_slot = o; o += al((size_t)ep->rows * 4);
    s->experts = o;
    smoe_saved_layout_make(ep->experts, (int64_t)ep->P * ep->C, ep->rows, &s->ex);
    o += al(s->ex.total);
    s->total = o;
}

typedef struct gws {
    size_t status, router, logits, as_token, as_count, ent_dest, ent_token, ent_score,
        ent_count, eoff, ent_row, rtok, rsc, md, msg_send, msg_recv, send_rows, recv_rows,
        send_do, recv_do, send_pairs, recv_pairs, vt_cnt, vt_off, pt, pe, ps, part, part_recv,
        dps, send_ds, recv_ds, ds_assign, dxr, experts;
    size_t total;
} gws;

static void gws_make(const smoe_ep_layer *ep, int64_t T, int64_t pairs, gws *w)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const size_t t = (size_t)T, d = (size_t)L->d, E = (size_t)L->E, P = (size_t)ep->P;
    const size_t C = (size_t)ep->C, Km = (size_t)ep->Kmax, Kq = (size_t)kq_of(ep);
    const size_t A = (size_t)assignments(ep, T, pairs), rows = (size_t)ep->rows;
    const size_t ent = t * Kq, Tv = P * C;
    size_t o = 0;
    memset(w, 0, sizeof *w);
    w->status = o; o += SMOE_DEV_STATUS_BYTES;
    w->router = o; o += al(smoe_cuda_router_ws_bytes(ep->full, T));
    w->logits = o; o += al(t * E * 4);
    w->as_token = o; o += al(A * 4);
    w->as_count = o; o += al(4);
    w->ent_dest = o; o += al(ent * 4);
    w->ent_token = o; o += al(ent * 4);
    w->ent_score = o; o += al(ent * 4);
    w->ent_count = o; o += al(4);
    w->eoff = o; o += al((P + 1) * 4);
    w->ent_row = o; o += al(ent * 4);
    w->rtok = o; o += al(ent * 4);
    w->rsc = o; o += al(ent * 4);
    w->md = o; o += al(smoe_cuda_metadata_scratch_bytes((int64_t)P, (int64_t)ent));
    w->msg_send = o; o += al(P * 8);
    w->msg_recv = o; o += al(P * 8);
    w->send_rows = o; o += al(Tv * d * 2);
    w->recv_rows = o; o += al(Tv * d * 2);
    w->send_do = o; o += al(Tv * d * 2);
    w->recv_do = o; o += al(Tv * d * 2);
    w->send_pairs = o; o += al(Tv * Km * sizeof(pair_msg));
    w->recv_pairs = o; o += al(Tv * Km * sizeof(pair_msg));
    w->vt_cnt = o; o += al(Tv * 4);
    w->vt_off = o; o += al((Tv + 1) * 4);
    w->pt = o; o += al(rows * 4);
    w->pe = o; o += al(rows * 4);
    w->ps = o; o += al(rows * 4);
    w->part = o; o += al(Tv * d * 2);
    w->part_recv = o; o += al(Tv * d * 2);
    w->dps = o; o += al(rows * 4);
    w->send_ds = o; o += al(Tv * Km * 4);
    w->recv_ds = o; o += al(Tv * Km * 4);
    w->ds_assign = o; o += al(A * 4);
    w->dxr = o; o += al(t * d * 4);
    w->experts = o;
    o += al(smoe_layer_workspace_bytes(ep->experts, (int64_t)Tv, ep->rows));
    w->total = o;
}

/* The workspace, then room for the saved block's source-side sections
 * (up to the experts' part): an inference forward keeps its metadata there. */
size_t smoe_ep_cuda_workspace_bytes(const smoe_ep_layer *ep, int64_t T, int64_t pairs)
{
    gws w;
    gsaved s;
    gws_make(ep, T, pairs, &w);
    gsaved_make(ep, T, pairs, &s);
    return w.total + s.experts;
}

size_t smoe_ep_cuda_saved_bytes(const smoe_ep_layer *ep, int64_t T, int64_t pairs)
{
    gsaved s;
    gsaved_make(ep, T, pairs, &s);
    return s.total;
}

/* ------------------------------------------------------------ kernels */

/* Each token's destination ranks, ascending, Kq entries per token (-1
 * pads): the "assignments" of the metadata sort with E = P. */
__global__ void k_ep_entries(int T, int P, int64_t El, int Kq, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, int32_t *dest, int32_t *tok,
                             float *score, int32_t *ent_off, int32_t *ent_count,
                             const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) {
        ent_off[T] = T * Kq;
        *ent_count = T * Kq;
    }
    if (t >= T) return;
    unsigned long long mask = 0ull;
    for (int a = toff[t]; a < toff[t + 1]; ++a) mask |= 1ull << (int)(aexp[a] / El);
    int j = 0;
    for (int q = 0; q < P; ++q) {
        if (!(mask >> q & 1ull)) continue;
        const int64_t e = (int64_t)t * Kq + j++;
        dest[e] = q;
        tok[e] = t;
        score[e] = 0.0f;
    }
    for (; j < Kq; ++j) {
        const int64_t e = (int64_t)t * Kq + j;
        dest[e] = -1;
        tok[e] = t;
        score[e] = 0.0f;
    }
    ent_off[t] = t * Kq;
}

/* One warp per entry: its partial row pidx = q C + slot (-1: none, or the
 * slot past capacity), x's row to send[pidx], the token's pairs on q
 * (pick order) to pairs[pidx Km ...]. */
__global__ void k_ep_pack(int64_t n_ent, int Kq, int64_t C, int Km, int64_t El, int64_t d,
                          const bf16 *__restrict__ x, const int32_t *__restrict__ toff,
                          const int32_t *__restrict__ aexp, const float *__restrict__ ascore,
                          const int32_t *__restrict__ dest, const int32_t *__restrict__ ent_row,
                          const int32_t *__restrict__ eoff, int32_t *pidx, bf16 *send_rows,
                          pair_msg *send_pairs, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int lane = threadIdx.x & 31;
    const int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (e >= n_ent) return;
    const int q = dest[e];
    const int t = (int)(e / Kq);
    int64_t p = -1;
    if (q >= 0) {
        const int64_t slot = (int64_t)ent_row[e] - eoff[q];
        if (slot < C) p = (int64_t)q * C + slot;
    }
    if (lane == 0) pidx[e] = (int32_t)p;
    if (p < 0) return;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + (int64_t)t * d);
    uint4 *dst = reinterpret_cast<uint4 *>(send_rows + p * d);
    for (int64_t i = lane; i < d / 8; i += 32) dst[i] = src[i];
    if (lane == 0) {
        int k = 0;
        for (int a = toff[t]; a < toff[t + 1]; ++a) {
            const int64_t ex = aexp[a];
            if (ex / El != q) continue;
            pair_msg m;
            m.e = (int32_t)(ex - (int64_t)q * El);
            m.s = ascore[a];
            send_pairs[p * Km + k++] = m;
        }
        for (; k < Km; ++k) {
            pair_msg m;
            m.e = -1;
            m.s = 0.0f;
            send_pairs[p * Km + k] = m;
        }
    }
}

/* The counts message to every rank: [rows for it, this rank's status]; a
 * destination past capacity sets the status (the first such rank). */
__global__ void k_ep_msg(int P, int64_t C, const int32_t *__restrict__ eoff, int32_t *msg,
                         smoe_dev_status *st, smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < P; ++q) {
        const int c = eoff[q + 1] - eoff[q];
        if (c > C && st->code == SMOE_DEV_OK) {
            st->code = SMOE_DEV_EP_OVERFLOW;
            st->first_bad = q;
            st->value = c;
            st->value2 = C;
            smoe_dev_report_error(rep, st);
        }
    }
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = eoff[q + 1] - eoff[q];
        msg[2 * q + 1] = st->code;
    }
}

/* After an exchange of [count, status] messages: another rank's failure
 * stops this one too (its own code first). */
__global__ void k_ep_peers(int P, const int32_t *__restrict__ msg, smoe_dev_status *st,
                           smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0 || st->code != SMOE_DEV_OK) return;
    for (int s = 0; s < P; ++s)
        if (msg[2 * s + 1] != SMOE_DEV_OK) {
            st->code = SMOE_DEV_EP_PEER;
            st->first_bad = s;
            st->value = s;
            st->value2 = msg[2 * s + 1];
            smoe_dev_report_error(rep, st);
            return;
        }
}

/* Expert side: pairs per received row (0 past the source's count or after
 * a failure). */
__global__ void k_ep_row_counts(int64_t Tv, int64_t C, int Km, const int32_t *__restrict__ msg,
                                const pair_msg *__restrict__ pairs, int32_t *cnt,
                                const int *abort)
{
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= Tv) return;
    const int s = (int)(v / C);
    const int64_t j = v % C;
    int c = 0;
    if (!*abort && j < msg[2 * s])
        for (int k = 0; k < Km; ++k) c += pairs[v * Km + k].e >= 0;
    cnt[v] = c;
}

/* The triples in token-major order; more than `rows` sets the status and
 * the count to 0 (the experts' call then computes nothing). */
__global__ void k_ep_triples(int64_t Tv, int Km, int64_t rows, const pair_msg *__restrict__ pairs,
                             const int32_t *__restrict__ off, int32_t *pt,
                             int32_t *pe, float *ps, int32_t *tri_slot, const smoe_dev_status *st)
{
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= Tv || st->code != SMOE_DEV_OK || off[Tv] > rows) return;
    int64_t i = off[v];
    for (int k = 0; k < Km; ++k) {
        const pair_msg m = pairs[v * Km + k];
        if (m.e < 0 || i >= off[v + 1]) continue;
        pt[i] = (int32_t)v;
        pe[i] = m.e;
        ps[i] = m.s;
        tri_slot[i] = (int32_t)(v * Km + k);
        ++i;
    }
}

/* One thread: the expert side's row check (after k_ep_triples read it), the
 * second message to every rank, and the count the experts' call reads. */
__global__ void k_ep_rows_check(int P, int64_t rows, const int32_t *total, int32_t *msg,
                                smoe_dev_status *st, smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*total > rows && st->code == SMOE_DEV_OK) {
        st->code = SMOE_DEV_EP_ROWS;
        st->first_bad = 0;
        st->value = *total;
        st->value2 = rows;
        smoe_dev_report_error(rep, st);
    }
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = 0;
        msg[2 * q + 1] = st->code;
    }
}

/* The status message to every rank: [0, this rank's code]. */
__global__ void k_ep_status_msg(int P, int32_t *msg, const smoe_dev_status *st)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = 0;
        msg[2 * q + 1] = st->code;
    }
}

/* After the second exchange: no rows for the experts when any rank failed. */
__global__ void k_ep_rows_final(int32_t *total, int32_t *rows_saved, const smoe_dev_status *st)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (st->code != SMOE_DEV_OK) *total = 0;
    *rows_saved = *total;
}

__global__ void k_ep_iota(int64_t n, int32_t *v, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = (int32_t)i;
}

/* counts (E) of this rank's assignments, and the logits out. */
__global__ void k_ep_outputs(int T, int E, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, int32_t *counts,
                             const float *__restrict__ lg, float *lg_out, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (lg_out && i < (int64_t)T * E) lg_out[i] = lg[i];
    if (counts && i < E) {
        int c = 0;
        for (int a = 0; a < toff[T]; ++a) c += aexp[a] == (int)i;
        counts[i] = c;
    }
}

/* Backward: x and dout rows to the entries' partial rows. */
__global__ void k_ep_pack2(int64_t n_ent, int Kq, int64_t d, const bf16 *__restrict__ x,
                           const bf16 *__restrict__ dout, const int32_t *__restrict__ pidx,
                           bf16 *sx, bf16 *sdo, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int lane = threadIdx.x & 31;
    const int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (e >= n_ent) return;
    const int64_t p = pidx[e], t = e / Kq;
    if (p < 0) return;
    const uint4 *a = reinterpret_cast<const uint4 *>(x + t * d);
    const uint4 *b = reinterpret_cast<const uint4 *>(dout + t * d);
    uint4 *da = reinterpret_cast<uint4 *>(sx + p * d);
    uint4 *db = reinterpret_cast<uint4 *>(sdo + p * d);
    for (int64_t i = lane; i < d / 8; i += 32) {
        da[i] = a[i];
        db[i] = b[i];
    }
}

/* dS of each triple to its row's slot (the rest zeroed before). */
__global__ void k_ep_ds_scatter(int64_t rows, const int32_t *__restrict__ total,
                                const int32_t *__restrict__ tri_slot,
                                const float *__restrict__ dps, float *send_ds, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows && i < *total) send_ds[tri_slot[i]] = dps[i];
}

/* Each assignment's dS: the k-th of the token's pairs on rank q is pair k of
 * its row there. */
__global__ void k_ep_ds_gather(int T, int Kq, int Km, int64_t El, const int32_t *__restrict__ toff,
                               const int32_t *__restrict__ aexp,
                               const int32_t *__restrict__ pidx,
                               const float *__restrict__ recv_ds, float *ds, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    int seen[64];
    for (int q = 0; q < 64; ++q) seen[q] = 0;
    /* the token's entries are its destinations in ascending order */
    for (int a = toff[t]; a < toff[t + 1]; ++a) {
        const int q = (int)(aexp[a] / El);
        int j = 0; /* the entry of q: the number of lower destinations */
        for (int b = toff[t]; b < toff[t + 1]; ++b) {
            const int qb = (int)(aexp[b] / El);
            if (qb < q) {
                /* count distinct lower destinations */
                bool first = true;
                for (int c = toff[t]; c < b; ++c) first &= (int)(aexp[c] / El) != qb;
                j += first;
            }
        }
        const int64_t p = pidx[(int64_t)t * Kq + j];
        ds[a] = p >= 0 ? recv_ds[p * Km + seen[q]] : 0.0f;
        ++seen[q];
    }
}

/* GENERAL: the pair-score gradient out (overwrite or accumulate). */
__global__ void k_ep_dps_out(int64_t A, const float *__restrict__ ds, float *out, int accumulate,
                             const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < A) out[i] = accumulate ? out[i] + ds[i] : ds[i];
}

static unsigned blocks_for(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b);
}

#define LAUNCHED(what) SMOE_CUDA_LAUNCH_CHECK(what)

/* ------------------------------------------------------------ create */

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
    cudaSetDevice(prev);
    return r;
}

/* ------------------------------------------------------------ forward */

smoe_status smoe_ep_cuda_forward(smoe_ep_layer *ep, const smoe_forward_args *args, void *saved,
                                 void *workspace, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const smoe_layer_desc *L = &ep->desc.layer;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int training = !args->inference;
    const int P = ep->P;
    const int64_t T = args->T, d = L->d, E = L->E, El = ep->El, C = ep->C, Km = ep->Kmax;
    const int64_t Kq = kq_of(ep), Tv = (int64_t)P * C, pairs = general ? args->pairs : 0;
    const int64_t A = assignments(ep, T, pairs), n_ent = T * Kq;
    gsaved S;
    gws W;
    gsaved_make(ep, T, pairs, &S);
    gws_make(ep, T, pairs, &W);
    char *ws = (char *)workspace;
    /* an inference forward has no saved block: its source-side metadata
     * goes after the workspace's own sections (the size query adds them) */
    char *sb = training ? (char *)saved : ws + W.total;
    smoe_dev_status *st = (smoe_dev_status *)(ws + W.status);
    const int *abort = &st->code;
    const smoe_dev_report rep = smoe_cuda_report(ep->full, 0);
    int prev = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != L->device) SMOE_CUDA_CHECK(cudaSetDevice(L->device));
    smoe_status r = SMOE_SUCCESS;
#define TRY(expr)                                                         \
    do {                                                                  \
        r = (expr);                                                       \
        if (r != SMOE_SUCCESS) goto done;                                 \
    } while (0)
#define TRYL(what)                                                        \
    do {                                                                  \
        cudaError_t e_ = cudaGetLastError();                              \
        if (e_ != cudaSuccess) {                                          \
            r = smoe_fail(SMOE_ERROR_BACKEND, "%s: %s", what,             \
                          cudaGetErrorString(e_));                        \
            goto done;                                                    \
        }                                                                 \
    } while (0)
    {
        TRY(smoe_cuda_status_reset(st, s));
        int32_t *toff = (int32_t *)(sb + S.token_offset);
        int32_t *aexp = (int32_t *)(sb + S.assign_expert);
        float *ascore = (float *)(sb + S.row_score);
        float *lg = (training && L->routing == SMOE_ROUTING_SOFTMAX_TOPK)
                        ? (float *)(sb + S.logits)
                        : (float *)(ws + W.logits);
        smoe_assign_dev as;
        as.expert = aexp;
        as.token = (int32_t *)(ws + W.as_token);
        as.score = ascore;
        as.token_offset = toff;
        as.count = (int32_t *)(ws + W.as_count);
        as.abort = abort;
        /* 1. routing */
        if (general) {
            TRY(smoe_cuda_route_general(T, E, pairs, args->pair_token, args->pair_expert,
                                        args->pair_score, NULL, as, st, rep, s));
        } else if (T > 0) {
            TRY(smoe_cuda_router_forward(ep->full, T, args->x, args->router_w, lg, as,
                                         ws + W.router, s));
        } else {
            TRY(smoe_cuda_exclusive_scan((int32_t *)(ws + W.vt_cnt), 0, toff, as.count, s));
        }
        k_ep_iota<<<blocks_for(A, 256), 256, 0, s>>>(A, (int32_t *)(sb + S.assign_row), abort);
        TRYL("k_ep_iota");
        /* 2. entries, their slots, the pack */
        int32_t *dest = (int32_t *)(ws + W.ent_dest), *pidx = (int32_t *)(sb + S.pidx);
        int32_t *ent_off = (int32_t *)(sb + S.ent_off), *eoff = (int32_t *)(ws + W.eoff);
        if (T > 0) {
            k_ep_entries<<<blocks_for(T, 128), 128, 0, s>>>(
                (int)T, P, El, (int)Kq, toff, aexp, dest, (int32_t *)(ws + W.ent_token),
                (float *)(ws + W.ent_score), ent_off, (int32_t *)(ws + W.ent_count), abort);
            TRYL("k_ep_entries");
        }
        smoe_assign_dev en;
        en.expert = dest;
        en.token = (int32_t *)(ws + W.ent_token);
        en.score = (float *)(ws + W.ent_score);
        en.token_offset = ent_off;
        en.count = (int32_t *)(ws + W.ent_count);
        en.abort = abort;
        if (T > 0) {
            TRY(smoe_cuda_metadata(P, n_ent, en, eoff, (int32_t *)(ws + W.ent_row),
                                   (int32_t *)(ws + W.rtok), (float *)(ws + W.rsc), NULL,
                                   ws + W.md, s));
            k_ep_pack<<<blocks_for(n_ent * 32, 256), 256, 0, s>>>(
                n_ent, (int)Kq, C, (int)Km, El, d, (const bf16 *)args->x, toff, aexp, ascore,
                dest, (int32_t *)(ws + W.ent_row), eoff, pidx, (bf16 *)(ws + W.send_rows),
                (pair_msg *)(ws + W.send_pairs), abort);
            TRYL("k_ep_pack");
        } else {
            SMOE_CUDA_CHECK(cudaMemsetAsync(eoff, 0, (size_t)(P + 1) * 4, s));
            SMOE_CUDA_CHECK(cudaMemsetAsync(ent_off, 0, 4, s));
        }
        int32_t *msg_send = (int32_t *)(ws + W.msg_send), *msg_recv = (int32_t *)(ws + W.msg_recv);
        k_ep_msg<<<1, 32, 0, s>>>(P, C, eoff, msg_send, st, rep);
        TRYL("k_ep_msg");
        /* 3. counts and status, rows, pairs */
        const xchg x1[3] = {{msg_send, msg_recv, 8},
                            {ws + W.send_rows, ws + W.recv_rows, (size_t)C * (size_t)d * 2},
                            {ws + W.send_pairs, ws + W.recv_pairs,
                             (size_t)C * (size_t)Km * sizeof(pair_msg)}};
        TRY(alltoall(ep, x1, 3, s));
        k_ep_peers<<<1, 32, 0, s>>>(P, msg_recv, st, rep);
        TRYL("k_ep_peers");
        /* 4. the expert side's triples */
        int32_t *vt_cnt = (int32_t *)(ws + W.vt_cnt), *vt_off = (int32_t *)(ws + W.vt_off);
        int32_t *total = (int32_t *)(ws + W.as_count);
        k_ep_row_counts<<<blocks_for(Tv, 256), 256, 0, s>>>(
            Tv, C, (int)Km, msg_recv, (const pair_msg *)(ws + W.recv_pairs), vt_cnt, abort);
        TRYL("k_ep_row_counts");
        TRY(smoe_cuda_exclusive_scan(vt_cnt, Tv, vt_off, total, s));
        k_ep_triples<<<blocks_for(Tv, 256), 256, 0, s>>>(
            Tv, (int)Km, ep->rows, (const pair_msg *)(ws + W.recv_pairs), vt_off,
            (int32_t *)(ws + W.pt), (int32_t *)(ws + W.pe), (float *)(ws + W.ps),
            (int32_t *)(sb + S.tri_slot), st);
        TRYL("k_ep_triples");
        k_ep_rows_check<<<1, 32, 0, s>>>(P, ep->rows, total, msg_send, st, rep);
        TRYL("k_ep_rows_check");
        const xchg x2[1] = {{msg_send, msg_recv, 8}};
        TRY(alltoall(ep, x2, 1, s));
        k_ep_peers<<<1, 32, 0, s>>>(P, msg_recv, st, rep);
        TRYL("k_ep_peers");
        k_ep_rows_final<<<1, 32, 0, s>>>(total, (int32_t *)(sb + S.rows), st);
        TRYL("k_ep_rows_final");
        /* the experts */
        smoe_forward_args ea;
        memset(&ea, 0, sizeof ea);
        ea.T = Tv;
        ea.x = ws + W.recv_rows;
        ea.pairs = ep->rows;
        ea.pair_token = (int32_t *)(ws + W.pt);
        ea.pair_expert = (int32_t *)(ws + W.pe);
        ea.pair_score = (float *)(ws + W.ps);
        ea.w1 = args->w1; ea.b1 = args->b1; ea.w2 = args->w2; ea.b2 = args->b2;
        ea.out = ws + W.part;
        ea.inference = args->inference;
        TRY(smoe_cuda_forward_dev_pairs(ep->experts, &ea, total, &S.ex,
                                        training ? sb + S.experts : NULL, ws + W.experts, s));
        /* 5. partials back, summed over the entries in rank order */
        const xchg x3[1] = {{ws + W.part, ws + W.part_recv, (size_t)C * (size_t)d * 2}};
        TRY(alltoall(ep, x3, 1, s));
        if (T > 0) {
            TRY(smoe_cuda_aggregate_forward(
                T, d, ent_off, pidx, NULL, (const bf16 *)(ws + W.part_recv), (bf16 *)args->out,
                training ? (smoe_saved_header *)(sb + S.header) : NULL,
                smoe_saved_header_make(ep->full, T, pairs), abort, s));
        } else if (training) {
            /* no token to aggregate: the header alone (status included) */
            TRY(smoe_cuda_aggregate_forward(0, d, ent_off, pidx, NULL,
                                            (const bf16 *)(ws + W.part_recv), NULL,
                                            (smoe_saved_header *)(sb + S.header),
                                            smoe_saved_header_make(ep->full, T, pairs), abort,
                                            s));
        }
        if (args->router_logits || args->expert_counts) {
            k_ep_outputs<<<blocks_for(T * E > E ? T * E : E, 256), 256, 0, s>>>(
                (int)T, (int)E, toff, aexp, args->expert_counts, lg,
                general ? NULL : args->router_logits, abort);
            TRYL("k_ep_outputs");
        }
    }
done:
    if (prev != L->device) cudaSetDevice(prev);
    return r;
}

/* ------------------------------------------------------------ backward */

smoe_status smoe_ep_cuda_backward(smoe_ep_layer *ep, const smoe_backward_args *args,
                                  const void *saved, void *workspace, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const smoe_layer_desc *L = &ep->desc.layer;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int P = ep->P;
    const int64_t T = args->T, d = L->d, El = ep->El, C = ep->C, Km = ep->Kmax;
    const int64_t Kq = kq_of(ep), Tv = (int64_t)P * C, pairs = general ? args->pairs : 0;
    const int64_t A = assignments(ep, T, pairs), n_ent = T * Kq;
    gsaved S;
    gws W;
    gsaved_make(ep, T, pairs, &S);
    gws_make(ep, T, pairs, &W);
    char *ws = (char *)workspace;
    char *sb = (char *)(uintptr_t)saved;
    smoe_dev_status *st = (smoe_dev_status *)(ws + W.status);
    const int *abort = &st->code;
    int prev = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != L->device) SMOE_CUDA_CHECK(cudaSetDevice(L->device));
    smoe_status r = SMOE_SUCCESS;
    {
        /* the saved block's header: this layer's, this T and pairs */
        TRY(smoe_cuda_backward_prologue((const smoe_saved_header *)(sb + S.header),
                                        smoe_saved_header_make(ep->full, T, pairs), NULL, st,
                                        smoe_cuda_report(ep->full, 1), NULL, 0, d, NULL, s));
        const int32_t *pidx = (const int32_t *)(sb + S.pidx);
        const int32_t *ent_off = (const int32_t *)(sb + S.ent_off);
        const int32_t *toff = (const int32_t *)(sb + S.token_offset);
        const int32_t *aexp = (const int32_t *)(sb + S.assign_expert);
        bf16 *sx = (bf16 *)(ws + W.send_rows), *sdo = (bf16 *)(ws + W.send_do);
        if (n_ent > 0) {
            k_ep_pack2<<<blocks_for(n_ent * 32, 256), 256, 0, s>>>(
                n_ent, (int)Kq, d, (const bf16 *)args->x, (const bf16 *)args->dout, pidx, sx,
                sdo, abort);
            TRYL("k_ep_pack2");
        }
        /* every rank's status (its header check) goes with the rows */
        int32_t *msg_send = (int32_t *)(ws + W.msg_send), *msg_recv = (int32_t *)(ws + W.msg_recv);
        k_ep_status_msg<<<1, 32, 0, s>>>(P, msg_send, st);
        TRYL("k_ep_status_msg");
        const xchg x1[3] = {{msg_send, msg_recv, 8},
                            {sx, ws + W.recv_rows, (size_t)C * (size_t)d * 2},
                            {sdo, ws + W.recv_do, (size_t)C * (size_t)d * 2}};
        TRY(alltoall(ep, x1, 3, s));
        k_ep_peers<<<1, 32, 0, s>>>(P, msg_recv, st, smoe_cuda_report(ep->full, 1));
        TRYL("k_ep_peers");
        /* the experts: dx partials, dS per triple, this rank's weight grads */
        smoe_backward_args eb;
        memset(&eb, 0, sizeof eb);
        eb.T = Tv;
        eb.x = ws + W.recv_rows;
        eb.pairs = ep->rows;
        eb.w1 = args->w1; eb.w2 = args->w2; eb.b2 = args->b2;
        eb.dout = ws + W.recv_do;
        eb.dx = (smoe_grad){ws + W.part, SMOE_DTYPE_BF16, 0};
        eb.dw1 = args->dw1; eb.db1 = args->db1; eb.dw2 = args->dw2; eb.db2 = args->db2;
        eb.dpair_score = (smoe_grad){ws + W.dps, SMOE_DTYPE_F32, 0};
        TRY(smoe_cuda_backward_upstream(ep->experts, &eb, &S.ex, sb + S.experts, ws + W.experts,
                                        abort, s));
        float *send_ds = (float *)(ws + W.send_ds);
        SMOE_CUDA_CHECK(cudaMemsetAsync(send_ds, 0, (size_t)Tv * (size_t)Km * 4, s));
        k_ep_ds_scatter<<<blocks_for(ep->rows, 256), 256, 0, s>>>(
            ep->rows, (const int32_t *)(sb + S.rows), (const int32_t *)(sb + S.tri_slot),
            (const float *)(ws + W.dps), send_ds, abort);
        TRYL("k_ep_ds_scatter");
        const xchg x2[2] = {{ws + W.part, ws + W.part_recv, (size_t)C * (size_t)d * 2},
                            {send_ds, ws + W.recv_ds, (size_t)C * (size_t)Km * 4}};
        TRY(alltoall(ep, x2, 2, s));
        /* this rank's tokens: dS per assignment, the router, dx */
        float *ds = (float *)(ws + W.ds_assign);
        if (T > 0) {
            k_ep_ds_gather<<<blocks_for(T, 128), 128, 0, s>>>(
                (int)T, (int)Kq, (int)Km, El, toff, aexp, pidx, (const float *)(ws + W.recv_ds),
                ds, abort);
            TRYL("k_ep_ds_gather");
        }
        float *dxr = NULL;
        if (!general) {
            smoe_saved_view v;
            memset(&v, 0, sizeof v);
            v.token_offset = (int32_t *)toff;
            v.assign_expert = (int32_t *)aexp;
            v.assign_row = (int32_t *)(sb + S.assign_row);
            v.row_score = (float *)(sb + S.row_score);
            v.logits = L->routing == SMOE_ROUTING_SOFTMAX_TOPK ? (float *)(sb + S.logits) : NULL;
            dxr = args->dx.ptr && T > 0 ? (float *)(ws + W.dxr) : NULL;
            TRY(smoe_cuda_router_backward(ep->full, T, &v, ds, args->dlogits_extra, args->x,
                                          args->router_w, &args->drouter_w, dxr, ws + W.router,
                                          abort, s));
        } else if (args->dpair_score.ptr && A > 0) {
            k_ep_dps_out<<<blocks_for(A, 256), 256, 0, s>>>(A, ds, (float *)args->dpair_score.ptr,
                                                            args->dpair_score.accumulate, abort);
            TRYL("k_ep_dps_out");
        }
        if (args->dx.ptr && T > 0)
            TRY(smoe_cuda_aggregate_backward(T, d, ent_off, pidx,
                                             (const bf16 *)(ws + W.part_recv), dxr, NULL, NULL,
                                             NULL, NULL, args->dx.ptr, args->dx.dtype,
                                             args->dx.accumulate, abort, s));
    }
done:
    if (prev != L->device) cudaSetDevice(prev);
    return r;
#undef TRY
#undef TRYL
}
