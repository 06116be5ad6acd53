/*
 * ep_cuda.cu -- the expert-parallel layer on the CUDA backends, over NCCL
 * (notes/ep_design.md, "the CUDA path"). Per call, on the caller's stream,
 * with no host synchronisation:
 *
 * forward   router GEMM + routing (the single-GPU kernels, cuda_layer.h) ->
 *           entries: each token's distinct destination ranks, Kq =
 *           min(P, K) per token -> the metadata counting sort with E = P
 *           over them (slot of each (token, rank)) -> pack rows and pairs
 *           by entry (rows for this rank straight into its receive slice)
 *           -> NCCL: counts, status and pairs (small, on the caller's
 *           stream) -> NCCL on the layer's own stream: rows, one round per
 *           peer (round k: to r + k, from r - k) -> expert side: per
 *           received row its pairs, a scan, the triples, the experts'
 *           metadata -> the expert GEMMs chunk by chunk (one per source
 *           rank, this rank's own in two, its first while the rows travel;
 *           at P = 2 where n <= 512 and K <= 8 every peer's rows in two halves
 *           that travel one after the other), the partial sums of each
 *           chunk's peer rows back to their source as soon as it is done,
 *           beside the next chunk's GEMMs -> the combine over the entries
 *           (rank order: this rank's own rows summed there from Y, the
 *           peers' partial sums) writes out and the saved block's header.
 *           Where this rank's T is the capacity (overlap on NCCL's
 *           kernels), x itself is every peer's slice: no pack of the
 *           peers' rows, and their exchange waits only for x (ep_whole_x);
 *           nor of this rank's own (without keep_x): its own chunks' up
 *           GEMM reads x itself.
 * backward  header check -> x and dout packed by entry (x and dout
 *           themselves where the forward sent x itself: this rank's own
 *           rows alone, after the exchanges are on their way) -> NCCL (layer's
 *           stream): dout with every rank's status, then x (keep_x: the
 *           forward received x into the saved block, dout alone) -> per chunk:
 *           dH and dS, dX~, the chunk's dx partial sums and dS back to the
 *           source -> dW2 and db2 over all rows (beside the last partials
 *           still in flight), the exchanges joined, dW1 and db1 (x must
 *           have arrived) -> dS to the assignments -> the router's
 *           backward (dense) -> dx: the aggregation over the entries plus
 *           the router's term.
 * copy_engines  the rows, dout and x and the partial sums travel by NCCL's
 *           copy-engine all-to-all (ncclAlltoAll on a zero-CTA
 *           communicator, from the layer's symmetric window) in H = 2
 *           parts: the received rows are laid out part by part (ep_slots,
 *           this rank's own after them), chunk h is part h of every peer's
 *           rows, between this rank's own two halves; part h's partial
 *           sums go back by one all-to-all after its chunk. Where every
 *           rank's capacity is max_tokens and even (create's ce_whole), x
 *           (and in the backward dout, then x) travels itself instead: one
 *           in-place ncclAllGather per part from this rank's own slice,
 *           started at the forward's start, no pack (ce_whole_stage). The
 *           counts, pairs, status and dS messages stay NCCL's kernels'
 *           (small).
 *
 * The chunks are views of the experts' rows, which stay sorted by expert
 * then by received row (so dW sums each expert's rows in the same order as
 * without chunks): a chunk's rows of expert e are [off2[e nc + c],
 * off2[e nc + c + 1]). Only the Hopper GEMMs take views; with the portable
 * ones (or overlap = -1) there is one chunk: exchange, then compute. While
 * an exchange is in flight the GEMMs' persistent grids leave comm_sms SMs
 * to NCCL's kernels.
 *
 * The status word of the call (the EP workspace's first bytes) stops every
 * later kernel of this path; the exchanges carry every rank's code (the
 * first with the counts, the forward's second with the partial sums, the
 * backward's with dout) so that a failure on one rank stops them all
 * before anything is written.
 *
 * NCCL is loaded at run time (dlopen, the process's libnccl first). The
 * files: ep_nccl.cu (NCCL, the layer's CUDA state made at create),
 * ep_kernels.cu (the kernels), this file (the layouts and the schedule),
 * ep_cuda.h (what they share).
 */
#include <stdio.h>
#include <string.h>

#include "cuda/ep_cuda.h"

/* ------------------------------------------------------------ layouts */

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

/* Does the router backward read the fp32 logits (T, E)? As src/ep_calls.c's. */
static int ep_saves_logits(const smoe_layer_desc *L)
{
    return L->routing == SMOE_ROUTING_SOFTMAX_TOPK || L->routing == SMOE_ROUTING_SIGMOID_TOPK;
}

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

/* The saved block: this rank's routing and entries (source side), the
 * triples' slots and the chunk offsets, then the experts' part (H and
 * their metadata, smoe_saved_layout over P C received rows), then with
 * keep_x the received rows of x. */
typedef struct gsaved {
    size_t header, token_offset, assign_expert, assign_row, row_score, logits, pidx, ent_off,
        tri_slot, off2, experts, xkeep;
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
    s->assign_expert = o; o += al(A * 2);
    s->assign_row = o; o += al(A * 4);
    s->row_score = o; o += al(A * 4);
    s->logits = o; o += al(ep_saves_logits(L) ? t * (size_t)L->E * 4 : 0);
    s->pidx = o; o += al(t * Kq * 4);
    s->ent_off = o; o += al((t + 1) * 4);
    s->tri_slot = o; o += al((size_t)ep->rows * 4);
    s->off2 = o; o += al(((size_t)ep->El * (size_t)ep->cuda->bw.nc + 1) * 4);
    s->experts = o;
    const int64_t Tv = ep_slots_total(ep->cuda->sl);
    smoe_saved_layout_make(ep->experts, Tv, ep->rows, &s->ex);
    o += al(s->ex.total);
    /* keep_x: the received rows of x (every slot, d), where the forward
     * receives them (copy engines: copied there from the window) */
    const size_t xrows = ep->desc.keep_x ? (size_t)Tv : 0;
    s->xkeep = o; o += al(xrows * (size_t)L->d * 2);
    s->total = o;
}

/* The workspace. The experts' buffers: a, y (forward) and dh, a_scaled,
 * dxt, ds (backward) share one region; m_*: the experts' metadata of an
 * inference forward (a training forward's is in the saved block), except
 * m_assign_expert, the triples' experts in int32 always (the saved block
 * has them in 16 bits); as_expert: the routing's experts in int32. */
typedef struct gws {
    size_t status, router, logits, as_expert, as_token, as_count, ent_dest, ent_token, ent_score,
        ent_count, eoff, ent_row, rtok, rsc, md, msg_send, msg_recv, msg2_send, msg2_recv,
        send_rows, recv_rows, send_do, recv_do, send_pairs, recv_pairs, vt_cnt, pt, ps, part,
        part_recv, send_ds, recv_ds, ds_assign, dxr, m_row_score, m_row_token, m_assign_row,
        m_assign_expert, m_token_offset, m_expert_offset, xmd, off2f, own_rt, gemm, a, y, dh,
        a_scaled, dxt, ds;
    size_t total;
} gws;

static int ep_whole_x(const smoe_ep_layer *ep, int64_t T);

static void gws_make(const smoe_ep_layer *ep, int64_t T, int64_t pairs, gws *w)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const size_t t = (size_t)T, d = (size_t)L->d, E = (size_t)L->E, P = (size_t)ep->P;
    const size_t C = (size_t)ep->C, Km = (size_t)ep->Kmax, Kq = (size_t)kq_of(ep);
    const size_t A = (size_t)assignments(ep, T, pairs), rows = (size_t)ep->rows;
    const size_t n = (size_t)L->n, hc = (size_t)ep->cuda->g.problem.h_cols;
    const size_t El = (size_t)ep->El;
    const size_t ent = t * Kq, Tv = (size_t)ep_slots_total(ep->cuda->sl), Tu = P * C;
    /* with copy engines the rows travel in the layer's window */
    const size_t Tw = ep->cuda->ce ? 0 : Tv;
    size_t o = 0;
    memset(w, 0, sizeof *w);
    w->status = o; o += SMOE_DEV_STATUS_BYTES;
    w->router = o; o += al(smoe_cuda_router_ws_bytes(ep->full, T));
    w->logits = o; o += al(t * E * 4);
    w->as_expert = o; o += al(A * 4);
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
    w->msg2_send = o; o += al(P * 8);
    w->msg2_recv = o; o += al(P * 8);
    /* where x itself travels (ep_whole_x), x and dout are the send buffers
     * and the packs write this rank's own rows alone, into the receive
     * buffers: no send buffers then */
    const size_t Ts = ep_whole_x(ep, T) ? 0 : Tw;
    w->send_rows = o; o += al(Ts * d * 2);
    w->recv_rows = o; o += al(Tw * d * 2);
    w->send_do = o; o += al(Ts * d * 2);
    w->recv_do = o; o += al(Tw * d * 2);
    w->send_pairs = o; o += al(Tu * Km * sizeof(pair_msg));
    w->recv_pairs = o; o += al(Tu * Km * sizeof(pair_msg));
    w->vt_cnt = o; o += al(Tv * 4);
    w->pt = o; o += al(rows * 4);
    w->ps = o; o += al(rows * 4);
    w->part = o; o += al(Tw * d * 2);
    w->part_recv = o; o += al(Tw * d * 2);
    w->send_ds = o; o += al(Tu * Km * 4);
    w->recv_ds = o; o += al(Tu * Km * 4);
    w->ds_assign = o; o += al(A * 4);
    w->m_row_score = o; o += al(rows * 4);
    w->m_row_token = o; o += al(rows * 4);
    w->m_assign_row = o; o += al(rows * 4);
    w->m_assign_expert = o; o += al(rows * 4);
    w->m_token_offset = o; o += al((Tv + 1) * 4);
    w->m_expert_offset = o; o += al((El + 1) * 4);
    w->xmd = o; o += al(smoe_cuda_metadata_scratch_bytes((int64_t)El, (int64_t)rows));
    w->off2f = o; o += al((El * (size_t)ep->cuda->fw.nc + 1) * 4);
    /* where x itself travels on NCCL's kernels: the rows' positions in this
     * rank's own slice (an own chunk's up GEMM gathers from x itself) */
    w->own_rt = o; o += al((ep_whole_x(ep, T) && !ep->cuda->ce ? rows : 0) * 4);
    w->gemm = o; o += al(ep->cuda->g.scratch_bytes);
    const size_t base = o;
    w->a = o; o += al(rows * n * 2);
    w->y = o; o += al(rows * d * 2);
    const size_t fwd_end = o;
    o = base;
    w->dh = o; o += al(rows * hc * 2);
    w->a_scaled = o; o += al(rows * n * 2);
    w->dxt = o; o += al(rows * d * 2);
    /* the router's term of dx (T x d fp32): written after dW1 and db1, when
     * dh, a_scaled and dX~ are dead (the chunks' dx partial sums left dX~
     * for the partial-sum buffers before the join), so over them where it
     * fits; ds, read by nothing after the chunks either, stays apart */
    const size_t dxr_b = al(t * d * 4);
    if (dxr_b <= o - base) {
        w->dxr = base;
    } else {
        w->dxr = o;
        o += dxr_b;
    }
    w->ds = o; o += al(rows * 4);
    if (fwd_end > o) o = fwd_end;
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

static unsigned blocks_for(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b);
}

/* ------------------------------------------------------------ the schedule */


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
#define TRYC(call)                                                        \
    do {                                                                  \
        cudaError_t e_ = (call);                                          \
        if (e_ != cudaSuccess) {                                          \
            r = smoe_fail(SMOE_ERROR_BACKEND, "%s: %s", #call,            \
                          cudaGetErrorString(e_));                        \
            goto done;                                                    \
        }                                                                 \
    } while (0)
/* SMOE_EP_TRACE=1 only (ep_trace.cu): a timing mark of this call */
#define MARK(bwd, st, on_cs, name, idx) ep_trace_mark(X, bwd, st, on_cs, name, idx)

/* A GEMM launcher chose at create time: declining now is a bug. */
static smoe_status gemm_ran(smoe_status st, const char *op)
{
    if (st != SMOE_ERROR_UNSUPPORTED) return st;
    char why[256];
    snprintf(why, sizeof why, "%s", smoe_last_error());
    return smoe_fail(SMOE_ERROR_INTERNAL, "expert parallelism: the %s GEMM declined: %s", op,
                     why);
}

/* The received rows [v0, v1) of chunk c of K that came from rank q: its
 * piece (empty when the chunk holds none of q's rows). */
static int piece(const smoe_ep_layer *ep, const ep_chunks *K, int c, int q, int64_t *v0,
                 int64_t *v1)
{
    const int64_t a = K->bd.b[c], b = K->bd.b[c + 1];
    const int64_t lo = (int64_t)q * ep->C, hi = lo + ep->C;
    *v0 = a > lo ? a : lo;
    *v1 = b < hi ? b : hi;
    return *v1 > *v0;
}

/* Chunk c holds rows of some peer (its partial sums then travel). */
static int has_peer_piece(const smoe_ep_layer *ep, const ep_chunks *K, int c)
{
    int64_t v0, v1;
    for (int q = 0; q < ep->P; q++)
        if (q != ep->r && piece(ep, K, c, q, &v0, &v1)) return 1;
    return 0;
}

/* Where the run stands: the chunking, the parts of the first exchange
 * (rounds, or half rounds) not yet waited for, and whether partial sums are
 * on their way (then the GEMMs leave SMs to NCCL). */
typedef struct sched {
    const ep_chunks *K;
    int waited[64][2];
    int rounds_left;
    int sending;
    int comm; /* smoe_ep_p2p_group's: 0 the layer's, 2 the caller's */
} sched;

static sched sched_make(const smoe_ep_layer *ep, const ep_chunks *K)
{
    sched z;
    memset(&z, 0, sizeof z);
    z.K = K;
    z.comm = K == &ep->cuda->fw && ep->cuda->fw_caller ? 2 : 0;
    z.rounds_left = (ep->P - 1) * (K->halves ? 2 : 1);
    return z;
}

/* Before chunk c: wait for the rows of every peer it holds (the half that
 * holds them, with halves). */
static smoe_status chunk_wait(const smoe_ep_layer *ep, sched *z, int c, cudaStream_t s)
{
    const ep_cuda *X = ep->cuda;
    int64_t v0, v1;
    for (int q = 0; q < ep->P; q++) {
        if (q == ep->r || !piece(ep, z->K, c, q, &v0, &v1)) continue;
        const int h = z->K->halves && v0 >= (int64_t)q * ep->C + ep->C / 2;
        if (z->waited[q][h]) continue;
        const int k = (ep->r - q + ep->P) % ep->P;
        SMOE_CUDA_CHECK(cudaStreamWaitEvent(s, X->ev[EV_IN + h * ep->P + k], 0));
        z->waited[q][h] = 1;
        z->rounds_left--;
    }
    return SMOE_SUCCESS;
}

/* Every round of the first exchange waited for (its messages read next). */
static smoe_status wait_all(const smoe_ep_layer *ep, sched *z, cudaStream_t s)
{
    for (int k = 1; k < ep->P; k++) {
        const int q = (ep->r - k + ep->P) % ep->P;
        if (z->waited[q][0]) continue;
        SMOE_CUDA_CHECK(cudaStreamWaitEvent(s, ep->cuda->ev[EV_IN + k], 0));
        z->waited[q][0] = 1;
        z->rounds_left--;
    }
    return SMOE_SUCCESS;
}

static int sms_now(const smoe_ep_layer *ep, const sched *z)
{
    const ep_cuda *X = ep->cuda;
    return z->rounds_left > 0 || z->sending ? X->sms_overlap : X->g.num_sms;
}

/* After chunk c: its pieces for peers go back to them on the layer's
 * stream (bufs: n buffers of `row` bytes per received row, sent from
 * send[b] and received into recv[b] at the partner's piece: the rank
 * whose rows this rank's piece of q mirrors, r + (r - q)), and with the
 * last piece of a peer's rows the 8-byte message msg2 when given. */
static smoe_status chunk_send(const smoe_ep_layer *ep, sched *z, int c, const cbuf *b, int nb,
                              const int32_t *msg2_send, int32_t *msg2_recv, cudaStream_t s)
{
    const ep_cuda *X = ep->cuda;
    const int P = ep->P, r = ep->r;
    p2p_op op[3 * 64];
    int n = 0;
    int64_t v0, v1;
    for (int q = 0; q < P; q++) {
        if (q == r || !piece(ep, z->K, c, q, &v0, &v1)) continue;
        const int partner = (2 * r - q + 2 * P) % P;
        const int64_t w0 = (int64_t)partner * ep->C + (v0 - (int64_t)q * ep->C);
        for (int i = 0; i < nb; i++) {
            op[n].send = b[i].send + (size_t)v0 * b[i].row;
            op[n].recv = b[i].recv + (size_t)w0 * b[i].row;
            op[n].bytes = (size_t)(v1 - v0) * b[i].row;
            op[n].to = q;
            op[n].from = partner;
            n++;
        }
        if (msg2_send && v1 == (int64_t)(q + 1) * ep->C) {
            op[n].send = msg2_send + 2 * q;
            op[n].recv = msg2_recv + 2 * partner;
            op[n].bytes = 8;
            op[n].to = q;
            op[n].from = partner;
            n++;
        }
    }
    if (!n) return SMOE_SUCCESS;
    SMOE_CUDA_CHECK(cudaEventRecord(X->ev[EV_IN + 2 * P + c], s));
    SMOE_CUDA_CHECK(cudaStreamWaitEvent(X->cs, X->ev[EV_IN + 2 * P + c], 0));
    SMOE_FORWARD_IF_ERROR(smoe_ep_p2p_group(ep, op, n, z->comm, X->cs));
    z->sending = 1;
    return SMOE_SUCCESS;
}

/* The first exchange's rounds on the layer's stream, after the caller's
 * stream has packed: round k sends to r + k and receives from r - k, nb
 * buffers of rows [i0, i1) of each C-row slice (and the 8-byte message msg
 * when given); event ev_each + k after round k (ev_each < 0: none). The
 * send buffers hold a slice per rank, or with whole (x itself) one for all;
 * comm as smoe_ep_p2p_group's. */
static smoe_status rounds(const smoe_ep_layer *ep, const cbuf *b, int nb, const int32_t *msg_send,
                          int32_t *msg_recv, int64_t i0, int64_t i1, int ev_each, int whole,
                          int comm)
{
    const ep_cuda *X = ep->cuda;
    const int P = ep->P, r = ep->r;
    for (int k = 1; k < P; k++) {
        const int to = (r + k) % P, from = (r - k + P) % P;
        p2p_op op[4];
        int n = 0;
        for (int i = 0; i < nb && i < 3; i++, n++) {
            op[n].send = b[i].send + (size_t)((whole ? 0 : (int64_t)to * ep->C) + i0) * b[i].row;
            op[n].recv = b[i].recv + (size_t)((int64_t)from * ep->C + i0) * b[i].row;
            op[n].bytes = (size_t)(i1 - i0) * b[i].row;
            op[n].to = to;
            op[n].from = from;
        }
        if (msg_send) { /* [count, status] for `to`, from `from` */
            op[n].send = msg_send + 2 * to;
            op[n].recv = msg_recv + 2 * from;
            op[n].bytes = 8;
            op[n].to = to;
            op[n].from = from;
            n++;
        }
        SMOE_FORWARD_IF_ERROR(smoe_ep_p2p_group(ep, op, n, comm, X->cs));
        if (ev_each >= 0) SMOE_CUDA_CHECK(cudaEventRecord(X->ev[ev_each + k], X->cs));
    }
    return SMOE_SUCCESS;
}

/* Does x itself travel? Where this rank's T is the capacity, on NCCL's
 * kernels with the overlap: each peer's slice is x whole (position i =
 * token i; the rows a peer has no pair for travel unused), so the peers'
 * rows need no pack and leave at the forward's start, beside the routing,
 * while the counts and pairs go on the messages' communicator; the
 * backward sends dout and x themselves likewise. Same bytes as the packed
 * slices (every exchange moves whole C-row slices), same rows in the same
 * order on the expert side (a peer's rows stay in token order), so the
 * same bits. A rank with fewer tokens packs (its x is shorter than a
 * slice); the receivers do not need to know which a peer did. On the copy
 * engines every rank or none sends x itself (create's ce_whole: the
 * all-gathers are collectives), a rank with fewer tokens a copy of its x. */
static int ep_whole_x(const smoe_ep_layer *ep, int64_t T)
{
    if (ep->cuda->ce) return ep->cuda->ce_whole; /* every rank, one collective */
    return ep->cuda->own_comm && ep->P > 1 && T > 0 && T == ep->C; /* the overlap */
}

/* Copy engines with x itself: NCCL (2.28) runs a collective on the copy
 * engines only where both its buffers are in a symmetric window, so x (or
 * dout) is first copied, on the exchange stream, into this rank's own
 * slice of each part of the receive region (a slice no exchange reads:
 * this rank's own rows live after the exchanged region); each part's
 * all-gather then runs in place from there (NCCL skips its own copy). A
 * rank with T < C leaves the rest of its slices as they are: those rows
 * travel unread (their pairs say no expert). */
static smoe_status ce_whole_stage(const smoe_ep_layer *ep, const void *a, char *recv, int64_t T,
                                  size_t row)
{
    const ep_slots sl = ep->cuda->sl;
    for (int h = 0; h < sl.H; h++) {
        const int64_t r0 = (int64_t)h * sl.Ch, nr = T - r0 < sl.Ch ? T - r0 : sl.Ch;
        if (nr > 0)
            SMOE_CUDA_CHECK(cudaMemcpyAsync(
                recv + (size_t)((int64_t)h * sl.P + sl.self) * (size_t)sl.Ch * row,
                (const char *)a + (size_t)r0 * row, (size_t)nr * row, cudaMemcpyDeviceToDevice,
                ep->cuda->cs));
    }
    return SMOE_SUCCESS;
}

/* Copy engines: part h of one exchange, from send's part h to recv's by an
 * all-to-all, or (whole: x itself, staged by ce_whole_stage) by an in-place
 * all-gather of this rank's slice of recv's part h to every rank's. */
static smoe_status ce_part(const smoe_ep_layer *ep, int whole, const char *send, char *recv, int h,
                           size_t part_bytes)
{
    const ep_slots sl = ep->cuda->sl;
    const size_t o = (size_t)h * (size_t)sl.P * part_bytes;
    if (whole)
        return smoe_ep_ce_allgather(ep, recv + o + (size_t)sl.self * part_bytes, recv + o,
                                    part_bytes, ep->cuda->cs);
    return smoe_ep_ce_alltoall(ep, send + o, recv + o, part_bytes, ep->cuda->cs);
}

static smoe_status fork_streams(const smoe_ep_layer *ep, cudaStream_t s)
{
    SMOE_CUDA_CHECK(cudaEventRecord(ep->cuda->ev[EV_FORK], s));
    SMOE_CUDA_CHECK(cudaStreamWaitEvent(ep->cuda->cs, ep->cuda->ev[EV_FORK], 0));
    return SMOE_SUCCESS;
}

static smoe_status join_streams(const smoe_ep_layer *ep, cudaStream_t s)
{
    SMOE_CUDA_CHECK(cudaEventRecord(ep->cuda->ev[EV_JOIN], ep->cuda->cs));
    SMOE_CUDA_CHECK(cudaStreamWaitEvent(s, ep->cuda->ev[EV_JOIN], 0));
    return SMOE_SUCCESS;
}

/* The experts' problem for chunk c (-1: all rows, no view). */
static smoe_gemm_problem chunk_problem(const smoe_ep_layer *ep, const ep_chunks *K,
                                       const smoe_saved_view *v, const int32_t *off2, int c,
                                       int sms, const int *abort)
{
    const ep_cuda *X = ep->cuda;
    smoe_gemm_problem p = X->g.problem;
    if (c >= 0 && K->nc > 1) {
        p.expert_offset = off2 + c;
        p.off_stride = K->nc;
    } else {
        p.expert_offset = v->expert_offset;
        p.off_stride = 1;
    }
    p.row_token = v->row_token;
    p.row_score = v->row_score;
    p.abort = abort;
    p.num_sms = sms;
    return p;
}

/* Chunk c's up and down GEMMs (both schedules): the rows from `rows`,
 * H saved in training, A and Y in the workspace. own_rt (own_x): a chunk
 * of this rank's own rows alone gathers them from x itself, own_rt[r]
 * being row r's position in the own slice (its token). */
static smoe_status chunk_forward(const smoe_ep_layer *ep, const smoe_saved_view *v,
                                 const int32_t *off2, int c, int sms, const int *abort,
                                 const bf16 *rows, const int32_t *own_rt,
                                 const smoe_forward_args *args, int training, bf16 *a, bf16 *y,
                                 char *scratch, cudaStream_t s)
{
    const ep_cuda *X = ep->cuda;
    smoe_gemm_problem p = chunk_problem(ep, &X->fw, v, off2, c, sms, abort);
    smoe_gemm_problem pu = p;
    int64_t v0, v1;
    if (own_rt && piece(ep, &X->fw, c, ep->r, &v0, &v1)) {
        /* the chunks are one source's rows each where x itself travels */
        SMOE_RETURN_ERROR_IF(has_peer_piece(ep, &X->fw, c), SMOE_ERROR_INTERNAL,
                             "expert parallelism: chunk %d mixes this rank's own rows (read "
                             "from x) with a peer's", c);
        pu.row_token = own_rt;
        rows = (const bf16 *)args->x;
    }
    SMOE_FORWARD_IF_ERROR(gemm_ran(X->g.ops.up(&pu, rows, (const bf16 *)args->w1,
                                               (const bf16 *)args->b1,
                                               training ? (bf16 *)v->h : NULL, a, scratch, s),
                                   "up"));
    return gemm_ran(X->g.ops.down(&p, a, (const bf16 *)args->w2, (const bf16 *)args->b2, y,
                                  scratch, s),
                    "down");
}

/* Chunk c's dH (with dS and A scaled) and dX~ GEMMs (both schedules). */
static smoe_status chunk_backward(const smoe_ep_layer *ep, const smoe_saved_view *v,
                                  const int32_t *off2, int c, int sms, const int *abort,
                                  const bf16 *rdo, const smoe_backward_args *args, bf16 *dh,
                                  bf16 *a_scaled, float *ds, bf16 *dxt, char *scratch,
                                  cudaStream_t s)
{
    const ep_cuda *X = ep->cuda;
    smoe_gemm_problem p = chunk_problem(ep, &X->bw, v, off2, c, sms, abort);
    SMOE_FORWARD_IF_ERROR(gemm_ran(X->g.ops.dh(&p, rdo, (const bf16 *)args->w2,
                                               (const bf16 *)args->b2, (const bf16 *)v->h, dh,
                                               a_scaled, ds, scratch, s),
                                   "dh"));
    return gemm_ran(X->g.ops.dxt(&p, dh, (const bf16 *)args->w1, dxt, scratch, s), "dxt");
}

/* Received slots [v0, v1) after their chunk's dX~: each slot's dx partial
 * (its pairs' dX~ rows summed in pair order) into out, its pairs' dS into
 * send_ds (this rank's own slots' straight into recv_ds). */
static smoe_status piece_backward(const smoe_ep_layer *ep, const smoe_saved_view *v, int64_t v0,
                                  int64_t v1, const int32_t *tri_slot, const bf16 *dxt,
                                  const float *ds, char *out, float *send_ds, float *recv_ds,
                                  const int *abort, cudaStream_t s)
{
    const int64_t C = ep->C;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_aggregate_backward(
        v1 - v0, ep->desc.layer.d, v->token_offset + v0, 0, v->assign_row, dxt, NULL, NULL, NULL,
        NULL, 0, NULL, out, SMOE_DTYPE_BF16, 0, abort, s));
    k_ep_ds_scatter<<<blocks_for(ep->rows, 256), 256, 0, s>>>(
        v0, v1, (int64_t)ep->r * C, (int64_t)(ep->r + 1) * C, (int)ep->Kmax, v->token_offset,
        tri_slot, v->assign_row, ds, send_ds, recv_ds, abort);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? SMOE_SUCCESS
                            : smoe_fail(SMOE_ERROR_BACKEND, "k_ep_ds_scatter: %s",
                                        cudaGetErrorString(e));
}

/* Copy engines: part c's partial sums (rows [v0, v0 + P Ch) of the
 * exchanged slots) back to their sources by one all-to-all on the
 * exchange stream, once this stream has written them. */
static smoe_status ce_partials_back(const smoe_ep_layer *ep, int c, char *part, char *part_recv,
                                    int64_t v0, size_t row, cudaStream_t s)
{
    const ep_cuda *X = ep->cuda;
    cudaEvent_t done = X->ev[EV_IN + 2 * ep->P + c];
    SMOE_CUDA_CHECK(cudaEventRecord(done, s));
    SMOE_CUDA_CHECK(cudaStreamWaitEvent(X->cs, done, 0));
    return smoe_ep_ce_alltoall(ep, part + (size_t)v0 * row, part_recv + (size_t)v0 * row,
                               (size_t)X->sl.Ch * row, X->cs);
}

/* ------------------------------------------------------------ forward */

smoe_status smoe_ep_cuda_forward(smoe_ep_layer *ep, const smoe_forward_args *args, void *saved,
                                 void *workspace, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const smoe_layer_desc *L = &ep->desc.layer;
    const ep_cuda *X = ep->cuda;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int training = !args->inference;
    const int P = ep->P, self = ep->r;
    const int64_t T = args->T, d = L->d, E = L->E, El = ep->El, C = ep->C, Km = ep->Kmax;
    const int64_t Kq = kq_of(ep), Tv = ep_slots_total(X->sl), pairs = general ? args->pairs : 0;
    const int64_t A = assignments(ep, T, pairs), n_ent = T * Kq;
    const size_t row = (size_t)d * 2;
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
    {
        TRY(smoe_cuda_status_reset(st, s));
        ep_trace_begin(X, 0, s);
        const ep_chunks *K = &X->fw;
        /* keep_x: the rows of x arrive in the saved block, for the backward
         * (a refused call's header says so: no backward reads them) */
        bf16 *recv_rows = X->ce ? (bf16 *)X->rows_recv
                          : training && ep->desc.keep_x ? (bf16 *)(sb + S.xkeep)
                                                        : (bf16 *)(ws + W.recv_rows);
        bf16 *send_rows = X->ce ? (bf16 *)X->rows_send : (bf16 *)(ws + W.send_rows);
        /* x itself to every peer: its exchange's stream waits for nothing
         * after this point (enqueued after the counts all the same: NCCL
         * connects a communicator's peers at its first call, a wait for the
         * peer's host, so every rank calls the communicators in one order),
         * or with pairs_first for nothing after the counts and pairs (the
         * fork there) */
        const int whole = ep_whole_x(ep, T);
        /* own_x: this rank's own rows, at their tokens' positions too, are
         * not copied: an own chunk's up GEMM reads x itself (keep_x keeps
         * the copy, in the saved block) */
        const int own_x = whole && !X->ce && K->nc > 1 && !(training && ep->desc.keep_x);
        if (whole && !X->pairs_first) TRY(fork_streams(ep, s));
        if (whole && X->ce) {
            TRY(ce_whole_stage(ep, args->x, (char *)recv_rows, T, row));
            MARK(0, X->cs, 1, "x staged", -1);
        }
        int32_t *toff = (int32_t *)(sb + S.token_offset);
        /* the routing's experts in int32 here; k_ep_entries copies them to
         * the saved block's 16-bit assign_expert */
        int32_t *aexp = (int32_t *)(ws + W.as_expert);
        float *ascore = (float *)(sb + S.row_score);
        float *lg = (training && ep_saves_logits(L))
                        ? (float *)(sb + S.logits)
                        : (float *)(ws + W.logits);
        smoe_assign_dev as;
        as.expert = aexp;
        as.expert16 = NULL;
        as.token = (int32_t *)(ws + W.as_token);
        as.score = ascore;
        as.token_offset = toff;
        as.count = (int32_t *)(ws + W.as_count);
        as.abort = abort;
        /* 1. routing */
        if (general) {
            TRY(smoe_cuda_route_general(T, E, pairs, args->pair_token, args->pair_expert,
                                        args->pair_score, as, st, rep, s));
        } else if (T > 0) {
            TRY(smoe_cuda_router_forward(ep->full, T, args->x, args->router_w,
                                         args->expert_bias, lg, as, ws + W.router, s));
        } else {
            TRY(smoe_cuda_exclusive_scan((int32_t *)(ws + W.vt_cnt), 0, toff, as.count, s));
        }
        k_ep_iota<<<blocks_for(A, 256), 256, 0, s>>>(A, (int32_t *)(sb + S.assign_row), abort);
        TRYL("k_ep_iota");
        MARK(0, s, 0, "routing", -1);
        /* 2. entries, their slots, the pack */
        int32_t *dest = (int32_t *)(ws + W.ent_dest), *pidx = (int32_t *)(sb + S.pidx);
        int32_t *ent_off = (int32_t *)(sb + S.ent_off), *eoff = (int32_t *)(ws + W.eoff);
        if (T > 0) {
            k_ep_entries<<<blocks_for(T, 128), 128, 0, s>>>(
                (int)T, P, El, (int)Kq, toff, aexp, (uint16_t *)(sb + S.assign_expert), dest,
                (int32_t *)(ws + W.ent_token), (float *)(ws + W.ent_score), ent_off,
                (int32_t *)(ws + W.ent_count), abort);
            TRYL("k_ep_entries");
        }
        smoe_assign_dev en;
        en.expert = dest;
        en.expert16 = NULL;
        en.token = (int32_t *)(ws + W.ent_token);
        en.score = (float *)(ws + W.ent_score);
        en.token_offset = ent_off;
        en.count = (int32_t *)(ws + W.ent_count);
        en.abort = abort;
        if (T > 0) {
            TRY(smoe_cuda_metadata(P, n_ent, en, eoff, (int32_t *)(ws + W.ent_row),
                                   (int32_t *)(ws + W.rtok), (float *)(ws + W.rsc), NULL,
                                   ws + W.md, s));
            MARK(0, s, 0, "entries", -1);
            /* whole: every position of a peer's slice is read, the tokens
             * without a pair there as pairs of expert -1 */
            if (whole)
                TRYC(cudaMemsetAsync(ws + W.send_pairs, 0xff,
                                     (size_t)P * (size_t)C * (size_t)Km * sizeof(pair_msg), s));
            k_ep_pack<<<blocks_for(n_ent * 32, 256), 256, 0, s>>>(
                n_ent, (int)Kq, X->sl, (int)Km, El, d, (const bf16 *)args->x, toff, aexp,
                ascore, dest, (int32_t *)(ws + W.ent_row), eoff, whole, own_x, pidx,
                send_rows, recv_rows, (pair_msg *)(ws + W.send_pairs), abort);
            TRYL("k_ep_pack");
        } else {
            TRYC(cudaMemsetAsync(eoff, 0, (size_t)(P + 1) * 4, s));
            TRYC(cudaMemsetAsync(ent_off, 0, 4, s));
        }
        MARK(0, s, 0, "pack", -1);
        int32_t *msg_send = (int32_t *)(ws + W.msg_send), *msg_recv = (int32_t *)(ws + W.msg_recv);
        int32_t *msg2_send = (int32_t *)(ws + W.msg2_send);
        int32_t *msg2_recv = (int32_t *)(ws + W.msg2_recv);
        /* the second message is read from every peer (none comes when C = 0) */
        TRYC(cudaMemsetAsync(msg2_recv, 0, (size_t)P * 8, s));
        k_ep_msg<<<1, 32, 0, s>>>(P, self, C, eoff, whole ? (int)T : -1, own_x, msg_send, st,
                                  rep);
        TRYL("k_ep_msg");
        /* 3. counts, status and pairs (small: on this stream, on the
         * messages' communicator where there is one), then the rows on the
         * layer's stream (whole: forked before the routing) */
        const cbuf x1[2] = {{(const char *)msg_send, (char *)msg_recv, 8},
                            {ws + W.send_pairs, ws + W.recv_pairs,
                             (size_t)C * (size_t)Km * sizeof(pair_msg)}};
        TRY(smoe_ep_alltoall(ep, x1, 2, X->fw_caller ? 2 : X->pairs_first ? 0 : 1, s));
        k_ep_peers<<<1, 32, 0, s>>>(P, self, msg_recv, st, rep);
        TRYL("k_ep_peers");
        MARK(0, s, 0, "counts and pairs", -1);
        /* pairs_first: x's rows leave after the counts and pairs */
        if (whole && X->pairs_first) TRY(fork_streams(ep, s));
        sched z = sched_make(ep, K);
        if (P > 1 && X->ce) {
            /* copy engines: part h of every slice, one all-to-all each
             * (whole: one all-gather each, of x's rows of part h, which
             * the stream forked before the routing copied in) */
            if (!whole) TRY(fork_streams(ep, s));
            const size_t part_bytes = (size_t)X->sl.Ch * row;
            for (int h = 0; h < X->sl.H; h++) {
                TRY(ce_part(ep, whole, (const char *)send_rows, (char *)recv_rows, h, part_bytes));
                TRYC(cudaEventRecord(X->ev[EV_IN + h], X->cs));
                MARK(0, X->cs, 1, "rows, part", h);
            }
            if (training && ep->desc.keep_x) {
                /* whole: this rank's own rows, which the pack wrote on the
                 * caller's stream after the fork, go too */
                if (whole) TRY(fork_streams(ep, s));
                TRYC(cudaMemcpyAsync(sb + S.xkeep, recv_rows, (size_t)Tv * row,
                                     cudaMemcpyDeviceToDevice, X->cs));
            }
        } else if (P > 1) {
            if (!whole) TRY(fork_streams(ep, s));
            const cbuf rb[1] = {{whole ? (const char *)args->x : (const char *)send_rows,
                                 (char *)recv_rows, row}};
            if (K->halves) { /* every slice's first halves, then the second */
                TRY(rounds(ep, rb, 1, NULL, NULL, 0, C / 2, EV_IN, whole, 0));
                MARK(0, X->cs, 1, "rows, half", 0);
                TRY(rounds(ep, rb, 1, NULL, NULL, C / 2, C, EV_IN + P, whole, 0));
                MARK(0, X->cs, 1, "rows, half", 1);
            } else {
                TRY(rounds(ep, rb, 1, NULL, NULL, 0, C, EV_IN, whole, X->fw_caller ? 2 : 0));
                MARK(0, X->cs, 1, "rows", -1);
            }
        }
        /* 4. the expert side's triples and metadata */
        smoe_saved_view v;
        if (training) {
            v = smoe_saved_view_make(&S.ex, sb + S.experts);
        } else {
            memset(&v, 0, sizeof v);
            v.row_score = (float *)(ws + W.m_row_score);
            v.row_token = (int32_t *)(ws + W.m_row_token);
            v.assign_row = (int32_t *)(ws + W.m_assign_row);
            v.token_offset = (int32_t *)(ws + W.m_token_offset);
            v.expert_offset = (int32_t *)(ws + W.m_expert_offset);
        }
        int32_t *vt_cnt = (int32_t *)(ws + W.vt_cnt), *total = (int32_t *)(ws + W.as_count);
        /* the chunks' offsets: the forward's (its own split found on the
         * device) and, for the backward, bd's in the saved block */
        int32_t *off2 = (int32_t *)(ws + W.off2f);
        k_ep_row_counts<<<blocks_for(Tv, 256), 256, 0, s>>>(
            Tv, X->sl, (int)Km, msg_recv, (const pair_msg *)(ws + W.recv_pairs), vt_cnt, abort);
        TRYL("k_ep_row_counts");
        TRY(smoe_cuda_exclusive_scan(vt_cnt, Tv, v.token_offset, total, s));
        MARK(0, s, 0, "slots counted", -1);
        k_ep_triples<<<blocks_for(Tv, 256), 256, 0, s>>>(
            Tv, X->sl, (int)Km, ep->rows, (const pair_msg *)(ws + W.recv_pairs), v.token_offset,
            (int32_t *)(ws + W.pt), (int32_t *)(ws + W.m_assign_expert), v.assign_expert,
            (float *)(ws + W.ps), (int32_t *)(sb + S.tri_slot), st);
        TRYL("k_ep_triples");
        k_ep_rows_check<<<1, 32, 0, s>>>(P, ep->rows, total, msg2_send, st, rep);
        TRYL("k_ep_rows_check");
        k_ep_rows_final<<<1, 32, 0, s>>>(total, st);
        TRYL("k_ep_rows_final");
        MARK(0, s, 0, "triples", -1);
        smoe_assign_dev tr;
        tr.expert = (int32_t *)(ws + W.m_assign_expert);
        tr.expert16 = NULL; /* k_ep_triples wrote the 16-bit copy */
        tr.token = (int32_t *)(ws + W.pt);
        tr.score = (float *)(ws + W.ps);
        tr.token_offset = v.token_offset;
        tr.count = total;
        tr.abort = abort;
        /* beside the rows in flight: no cooperative launch (it would wait
         * for NCCL's SMs) */
        TRY(smoe_cuda_metadata_beside(El, ep->rows, tr, v.expert_offset, v.assign_row,
                                      v.row_token, v.row_score, NULL, ws + W.xmd, 1, s));
        MARK(0, s, 0, "expert metadata", -1);
        if (K->nc > 1) {
            k_ep_chunk_off<<<blocks_for(El * K->nc + 1, 256), 256, 0, s>>>(
                (int)El, K->nc, K->bd, v.expert_offset, v.row_token, off2, K->own_b, eoff,
                self, C, K->own_share, abort);
            TRYL("k_ep_chunk_off");
        }
        if (X->bw.nc > 1 && training) {
            k_ep_chunk_off<<<blocks_for(El * X->bw.nc + 1, 256), 256, 0, s>>>(
                (int)El, X->bw.nc, X->bw.bd, v.expert_offset, v.row_token,
                (int32_t *)(sb + S.off2), -1, eoff, self, C, 0, abort);
            TRYL("k_ep_chunk_off");
        }
        int32_t *own_rt = own_x ? (int32_t *)(ws + W.own_rt) : NULL;
        if (own_x) {
            k_ep_rebase<<<blocks_for(ep->rows, 256), 256, 0, s>>>(
                ep->rows, v.row_token, ep_slot(X->sl, self, 0), own_rt, abort);
            TRYL("k_ep_rebase");
        }
        MARK(0, s, 0, "metadata", -1);
        /* 5. the experts, chunk by chunk; each peer's rows' partial sums to
         * their source after its chunk (this rank's own rows are summed
         * into out by the combine, 6.) */
        bf16 *a = (bf16 *)(ws + W.a), *y = (bf16 *)(ws + W.y);
        char *part = X->ce ? X->part_send : ws + W.part;
        char *part_recv = X->ce ? X->part_recv : ws + W.part_recv;
        const smoe_saved_header hdr = smoe_saved_header_make(ep->full, T, pairs);
        for (int i = 0; X->ce && i < K->nc; i++) {
            /* copy engines: chunk c < H is part c of the peers' rows, the
             * others this rank's own; a part's partial sums go back by one
             * all-to-all while the next chunk computes */
            const int c = K->order[i];
            const int64_t v0 = K->bd.b[c], v1 = K->bd.b[c + 1];
            const int peers = c < X->sl.H;
            if (peers) TRYC(cudaStreamWaitEvent(s, X->ev[EV_IN + c], 0));
            MARK(0, s, 0, "in, chunk", c);
            TRY(chunk_forward(ep, &v, off2, c, X->sms_overlap, abort, recv_rows, NULL, args,
                              training, a, y, ws + W.gemm, s));
            MARK(0, s, 0, "gemms, chunk", c);
            if (!peers) continue;
            TRY(smoe_cuda_aggregate_forward(v1 - v0, d, v.token_offset + v0, 0, v.assign_row,
                                            v.row_score, y, (bf16 *)(part + (size_t)v0 * row),
                                            NULL, hdr, abort, s));
            MARK(0, s, 0, "sums, chunk", c);
            TRY(ce_partials_back(ep, c, part, part_recv, v0, row, s));
            MARK(0, X->cs, 1, "partials back, chunk", c);
        }
        if (X->ce && P > 1) {
            /* every rank's status after its row check, with the partials */
            const cbuf m2[1] = {{(const char *)msg2_send, (char *)msg2_recv, 8}};
            TRY(smoe_ep_alltoall(ep, m2, 1, 0, X->cs));
        }
        for (int i = 0; !X->ce && i < K->nc; i++) {
            const int c = K->order[i];
            TRY(chunk_wait(ep, &z, c, s));
            MARK(0, s, 0, "in, chunk", c);
            TRY(chunk_forward(ep, &v, off2, c, sms_now(ep, &z), abort, recv_rows, own_rt, args,
                              training, a, y, ws + W.gemm, s));
            MARK(0, s, 0, "gemms, chunk", c);
            for (int q = 0; q < P; q++) {
                int64_t v0, v1;
                if (q == self || !piece(ep, K, c, q, &v0, &v1)) continue;
                TRY(smoe_cuda_aggregate_forward(v1 - v0, d, v.token_offset + v0, 0, v.assign_row,
                                                v.row_score, y, (bf16 *)(part + (size_t)v0 * row),
                                                NULL, hdr, abort, s));
            }
            MARK(0, s, 0, "sums, chunk", c);
            if (P > 1) {
                const cbuf pb[1] = {{part, part_recv, (size_t)d * 2}};
                TRY(chunk_send(ep, &z, c, pb, 1, msg2_send, msg2_recv, s));
                if (has_peer_piece(ep, K, c)) MARK(0, X->cs, 1, "partials back, chunk", c);
            }
        }
        if (P > 1) {
            TRY(join_streams(ep, s));
            k_ep_peers<<<1, 32, 0, s>>>(P, self, msg2_recv, st, rep);
            TRYL("k_ep_peers");
            MARK(0, s, 0, "join", -1);
        }
        /* 6. per token, over its entries in rank order: this rank's own
         * rows (score x Y, the pairs in order) and the partial sums the
         * peers sent back, in fp32 (T = 0: the saved block's header alone,
         * status included) */
        if (T > 0 || training)
            TRY(smoe_cuda_aggregate_combine(
                T, d, ent_off, dest, self, pidx, v.token_offset, v.assign_row, v.row_score, y,
                (const bf16 *)part_recv, (bf16 *)args->out,
                training ? (smoe_saved_header *)(sb + S.header) : NULL, hdr, abort, s));
        if (args->router_logits || args->expert_counts) {
            k_ep_outputs<<<blocks_for(T * E > E ? T * E : E, 256), 256, 0, s>>>(
                (int)T, (int)E, toff, aexp, args->expert_counts, lg,
                general ? NULL : args->router_logits,
                args->router_logits_dtype == SMOE_DTYPE_BF16, abort);
            TRYL("k_ep_outputs");
        }
        MARK(0, s, 0, "end", -1);
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
    const ep_cuda *X = ep->cuda;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int P = ep->P, self = ep->r;
    const int64_t T = args->T, d = L->d, El = ep->El, C = ep->C, Km = ep->Kmax;
    const int64_t Kq = kq_of(ep), Tu = (int64_t)P * C, pairs = general ? args->pairs : 0;
    const int64_t A = assignments(ep, T, pairs), n_ent = T * Kq;
    const size_t row = (size_t)d * 2;
    gsaved S;
    gws W;
    gsaved_make(ep, T, pairs, &S);
    gws_make(ep, T, pairs, &W);
    char *ws = (char *)workspace;
    char *sb = (char *)(uintptr_t)saved;
    smoe_dev_status *st = (smoe_dev_status *)(ws + W.status);
    const int *abort = &st->code;
    const smoe_dev_report rep = smoe_cuda_report(ep->full, 1);
    int prev = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != L->device) SMOE_CUDA_CHECK(cudaSetDevice(L->device));
    smoe_status r = SMOE_SUCCESS;
    {
        /* the saved block's header: this layer's, this T and pairs */
        TRY(smoe_cuda_backward_prologue((smoe_saved_header *)(sb + S.header),
                                        smoe_saved_header_make(ep->full, T, pairs), 0, st,
                                        rep, NULL, 0, d, NULL, smoe_dxr_slots_none(), s));
        ep_trace_begin(X, 1, s);
        const int32_t *pidx = (const int32_t *)(sb + S.pidx);
        const int32_t *ent_off = (const int32_t *)(sb + S.ent_off);
        const int32_t *toff = (const int32_t *)(sb + S.token_offset);
        const uint16_t *aexp = (const uint16_t *)(sb + S.assign_expert);
        const int32_t *off2 = (const int32_t *)(sb + S.off2);
        smoe_saved_view v = smoe_saved_view_make(&S.ex, sb + S.experts);
        /* keep_x: x's rows are in the saved block, only dout travels */
        const int keep = ep->desc.keep_x;
        bf16 *sx = keep ? NULL : X->ce ? (bf16 *)X->rows_send : (bf16 *)(ws + W.send_rows);
        bf16 *sdo = X->ce ? (bf16 *)X->do_send : (bf16 *)(ws + W.send_do);
        bf16 *rx = keep ? (bf16 *)(sb + S.xkeep)
                   : X->ce ? (bf16 *)X->rows_recv : (bf16 *)(ws + W.recv_rows);
        bf16 *rdo = X->ce ? (bf16 *)X->do_recv : (bf16 *)(ws + W.recv_do);
        /* whole: x and dout themselves travel, this rank's own rows packed
         * after the exchanges are on their way */
        const int whole = ep_whole_x(ep, T);
        if (n_ent > 0 && !whole) {
            k_ep_pack2<<<blocks_for(n_ent * 32, 256), 256, 0, s>>>(
                n_ent, (int)Kq, d, X->sl, 0, (const bf16 *)args->x, (const bf16 *)args->dout,
                pidx, sx, sdo, rx, rdo, abort);
            TRYL("k_ep_pack2");
        }
        /* every rank's status (its header check) goes with dout */
        int32_t *msg_send = (int32_t *)(ws + W.msg_send), *msg_recv = (int32_t *)(ws + W.msg_recv);
        k_ep_status_msg<<<1, 32, 0, s>>>(P, msg_send, st);
        TRYL("k_ep_status_msg");
        float *send_ds = (float *)(ws + W.send_ds), *recv_ds = (float *)(ws + W.recv_ds);
        TRYC(cudaMemsetAsync(send_ds, 0, (size_t)Tu * (size_t)Km * 4, s));
        TRYC(cudaMemsetAsync(recv_ds, 0, (size_t)Tu * (size_t)Km * 4, s));
        MARK(1, s, 0, "pack", -1);
        const ep_chunks *K = &X->bw;
        sched z = sched_make(ep, K);
        if (P > 1 && X->ce) {
            /* the status messages, then dout part by part, then x */
            TRY(fork_streams(ep, s));
            const cbuf mb[1] = {{(const char *)msg_send, (char *)msg_recv, 8}};
            TRY(smoe_ep_alltoall(ep, mb, 1, 0, X->cs));
            const size_t part_bytes = (size_t)X->sl.Ch * row;
            /* whole: dout's and then x's rows of part h by all-gathers,
             * each copied into this rank's own slices first */
            if (whole) TRY(ce_whole_stage(ep, args->dout, (char *)rdo, T, row));
            for (int h = 0; h < X->sl.H; h++) {
                TRY(ce_part(ep, whole, (const char *)sdo, (char *)rdo, h, part_bytes));
                TRYC(cudaEventRecord(X->ev[EV_IN + h], X->cs));
                MARK(1, X->cs, 1, "dout, part", h);
            }
            if (whole && !keep) TRY(ce_whole_stage(ep, args->x, (char *)rx, T, row));
            for (int h = 0; !keep && h < X->sl.H; h++) {
                TRY(ce_part(ep, whole, (const char *)sx, (char *)rx, h, part_bytes));
                MARK(1, X->cs, 1, "x, part", h);
            }
            TRYC(cudaEventRecord(X->ev[EV_X], X->cs));
        } else if (P > 1) {
            TRY(fork_streams(ep, s));
            /* dout with the status message, then x (keep_x: none); EV_X
             * marks the end of what the backward receives */
            const cbuf db[1] = {{whole ? (const char *)args->dout : (const char *)sdo, (char *)rdo,
                                 (size_t)d * 2}};
            TRY(rounds(ep, db, 1, msg_send, msg_recv, 0, C, EV_IN, whole, 0));
            MARK(1, X->cs, 1, "dout", -1);
            if (!keep) {
                const cbuf xb[1] = {{whole ? (const char *)args->x : (const char *)sx, (char *)rx,
                                     (size_t)d * 2}};
                TRY(rounds(ep, xb, 1, NULL, NULL, 0, C, -1, whole, 0));
                MARK(1, X->cs, 1, "x", -1);
            }
            TRYC(cudaEventRecord(X->ev[EV_X], X->cs));
        }
        if (n_ent > 0 && whole) {
            k_ep_pack2<<<blocks_for(n_ent * 32, 256), 256, 0, s>>>(
                n_ent, (int)Kq, d, X->sl, 1, (const bf16 *)args->x, (const bf16 *)args->dout,
                pidx, sx, sdo, rx, rdo, abort);
            TRYL("k_ep_pack2");
            MARK(1, s, 0, "own rows packed", -1);
        }
        /* per chunk: dH, dS and dX~, the chunk's dx partials and dS back */
        bf16 *dh = (bf16 *)(ws + W.dh), *a_scaled = (bf16 *)(ws + W.a_scaled);
        bf16 *dxt = (bf16 *)(ws + W.dxt);
        float *ds = (float *)(ws + W.ds);
        char *part = X->ce ? X->part_send : ws + W.part;
        char *part_recv = X->ce ? X->part_recv : ws + W.part_recv;
        for (int i = 0; X->ce && i < K->nc; i++) {
            /* copy engines: as the forward's chunks; dS of own rows straight
             * to recv_ds, the peers' after the last chunk */
            const int c = K->order[i];
            const int64_t v0 = K->bd.b[c], v1 = K->bd.b[c + 1];
            const int peers = c < X->sl.H;
            if (peers) TRYC(cudaStreamWaitEvent(s, X->ev[EV_IN + c], 0));
            MARK(1, s, 0, "in, chunk", c);
            TRY(chunk_backward(ep, &v, off2, c, X->sms_overlap, abort, rdo, args, dh, a_scaled,
                               ds, dxt, ws + W.gemm, s));
            MARK(1, s, 0, "gemms, chunk", c);
            TRY(piece_backward(ep, &v, v0, v1, (const int32_t *)(sb + S.tri_slot), dxt, ds,
                               (peers ? part : part_recv) + (size_t)v0 * row, send_ds, recv_ds,
                               abort, s));
            MARK(1, s, 0, "pieces, chunk", c);
            if (peers) TRY(ce_partials_back(ep, c, part, part_recv, v0, row, s));
            if (peers) MARK(1, X->cs, 1, "partials back, chunk", c);
        }
        if (X->ce && P > 1) {
            /* the peers' dS (the plain layout; this rank's own stays) */
            TRYC(cudaEventRecord(X->ev[EV_IN + 2 * P + K->nc - 1], s));
            TRYC(cudaStreamWaitEvent(X->cs, X->ev[EV_IN + 2 * P + K->nc - 1], 0));
            p2p_op op[64];
            int n = 0;
            for (int q = 0; q < P; q++) {
                if (q == self) continue;
                op[n].send = send_ds + (size_t)q * (size_t)C * (size_t)Km;
                op[n].recv = recv_ds + (size_t)q * (size_t)C * (size_t)Km;
                op[n].bytes = (size_t)C * (size_t)Km * 4;
                op[n].to = op[n].from = q;
                n++;
            }
            TRY(smoe_ep_p2p_group(ep, op, n, 0, X->cs));
            MARK(1, X->cs, 1, "dS back", -1);
            z.rounds_left = 0;
        }
        for (int i = 0; !X->ce && i < K->nc; i++) {
            const int c = K->order[i];
            TRY(chunk_wait(ep, &z, c, s));
            MARK(1, s, 0, "in, chunk", c);
            /* with chunks x travels until dW1; without, everything has
             * arrived before the GEMMs */
            if (K->nc == 1 && P > 1) TRYC(cudaStreamWaitEvent(s, X->ev[EV_X], 0));
            const int sms = K->nc > 1 && P > 1 ? X->sms_overlap : X->g.num_sms;
            TRY(chunk_backward(ep, &v, off2, c, sms, abort, rdo, args, dh, a_scaled, ds, dxt,
                               ws + W.gemm, s));
            MARK(1, s, 0, "gemms, chunk", c);
            for (int q = 0; q < P; q++) {
                int64_t v0, v1;
                if (!piece(ep, K, c, q, &v0, &v1)) continue;
                TRY(piece_backward(ep, &v, v0, v1, (const int32_t *)(sb + S.tri_slot), dxt, ds,
                                   (q == self ? part_recv : part) + (size_t)v0 * (size_t)d * 2,
                                   send_ds, recv_ds, abort, s));
            }
            MARK(1, s, 0, "pieces, chunk", c);
            if (P > 1) {
                const cbuf pb[2] = {{part, part_recv, (size_t)d * 2},
                                    {(const char *)send_ds, (char *)recv_ds, (size_t)Km * 4}};
                TRY(chunk_send(ep, &z, c, pb, 2, NULL, NULL, s));
                if (has_peer_piece(ep, K, c)) MARK(1, X->cs, 1, "partials back, chunk", c);
            }
        }
        /* The weight gradients need dout and x and the peers' status (their
         * header checks, which came with dout) before any of them is
         * written. With chunks the first (dW2, or dW1 where dw1_beside)
         * runs beside the last partial sums still in flight (leaving their
         * SMs), then, every exchange done, the other on every SM. Without,
         * the exchanges end first: a persistent GEMM beside NCCL's kernel
         * on its SMs would wait for them with its share of the tiles. */
        const int tail = P > 1 && K->nc > 1;
        if (P > 1 && !tail) {
            TRY(join_streams(ep, s));
            z.sending = 0;
        }
        if (P > 1) {
            if (!X->ce) TRY(wait_all(ep, &z, s));
            TRYC(cudaStreamWaitEvent(s, X->ev[EV_X], 0));
            k_ep_peers<<<1, 32, 0, s>>>(P, self, msg_recv, st, rep);
            TRYL("k_ep_peers");
            MARK(1, s, 0, "exchanges in", -1);
        }
        const smoe_gemm_problem *g = &X->g.problem;
        for (int step = 0; step < 2; step++) {
            const int w1 = step == 0 ? X->dw1_beside : !X->dw1_beside, beside = tail && step == 0;
            smoe_gemm_problem p = chunk_problem(ep, K, &v, off2, -1,
                                                beside ? X->sms_overlap : X->g.num_sms, abort);
            if (!w1) {
                if (args->dw2.ptr)
                    TRY(gemm_ran(X->g.ops.dw2(&p, rdo, a_scaled, args->dw2.ptr, args->dw2.dtype,
                                              args->dw2.accumulate, ws + W.gemm, s),
                                 "dw2"));
                if (args->db2.ptr)
                    TRY(smoe_cuda_expert_colsum(El, d, v.expert_offset, rdo, v.row_token,
                                                v.row_score, g->n, g->gated, g->w1_layout, 0,
                                                args->db2.ptr, args->db2.dtype,
                                                args->db2.accumulate, abort, s));
                MARK(1, s, 0, "dw2", -1);
            } else {
                if (args->dw1.ptr)
                    TRY(gemm_ran(X->g.ops.dw1(&p, dh, rx, args->dw1.ptr, args->dw1.dtype,
                                              args->dw1.accumulate, ws + W.gemm, s),
                                 "dw1"));
                if (args->db1.ptr)
                    TRY(smoe_cuda_expert_colsum(El, g->h_cols, v.expert_offset, dh, NULL, NULL,
                                                g->n, g->gated, g->w1_layout, 1, args->db1.ptr,
                                                args->db1.dtype, args->db1.accumulate, abort, s));
                MARK(1, s, 0, "dw1", -1);
            }
            if (beside) {
                TRY(join_streams(ep, s));
                z.sending = 0;
                MARK(1, s, 0, "join", -1);
            }
        }
        /* this rank's tokens: dS per assignment, the router, dx */
        float *dsa = (float *)(ws + W.ds_assign);
        if (T > 0) {
            k_ep_ds_gather<<<blocks_for(T, 128), 128, 0, s>>>(
                (int)T, (int)Kq, (int)Km, El, X->sl, toff, aexp, pidx, recv_ds, dsa, abort);
            TRYL("k_ep_ds_gather");
        }
        float *dxr = NULL;
        if (!general) {
            smoe_saved_view u;
            memset(&u, 0, sizeof u);
            u.token_offset = (int32_t *)toff;
            u.assign_expert = (uint16_t *)aexp;
            u.assign_row = (int32_t *)(sb + S.assign_row);
            u.row_score = (float *)(sb + S.row_score);
            u.logits = ep_saves_logits(L) ? (float *)(sb + S.logits) : NULL;
            dxr = args->dx.ptr && T > 0 ? (float *)(ws + W.dxr) : NULL;
            TRY(smoe_cuda_router_backward(ep->full, T, &u, dsa, args->dlogits_extra,
                                          args->dlogits_extra_dtype, args->x,
                                          args->router_w, &args->drouter_w, dxr, ws + W.router,
                                          abort, s));
        } else if (args->dpair_score.ptr && A > 0) {
            k_ep_dps_out<<<blocks_for(A, 256), 256, 0, s>>>(
                A, dsa, (float *)args->dpair_score.ptr, args->dpair_score.accumulate, abort);
            TRYL("k_ep_dps_out");
        }
        MARK(1, s, 0, "router", -1);
        if (args->dx.ptr && T > 0)
            TRY(smoe_cuda_aggregate_backward(T, d, ent_off, 0, pidx, (const bf16 *)part_recv, dxr,
                                             NULL, NULL, NULL, 0, NULL, args->dx.ptr,
                                             args->dx.dtype, args->dx.accumulate, abort, s));
        MARK(1, s, 0, "end", -1);
    }
done:
    if (prev != L->device) cudaSetDevice(prev);
    return r;
}

#undef TRY
#undef TRYL
#undef TRYC
#undef MARK
