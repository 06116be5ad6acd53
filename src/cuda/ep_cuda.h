/*
 * ep_cuda.h -- what the expert-parallel layer's CUDA files share (for them
 * only, after cuda_common.h): the layer's CUDA state (made at create in
 * ep_nccl.cu, read by the schedule in ep_cuda.cu), NCCL's point-to-point
 * groups (ep_nccl.cu), and the kernels (ep_kernels.cu) with the types they
 * take. ep_cuda.cu's top comment says what the path computes.
 */
#ifndef SMOE_CUDA_EP_CUDA_H
#define SMOE_CUDA_EP_CUDA_H

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"
#include "ep_internal.h"

/* ------------------------------------------------------------ NCCL (ep_nccl.cu) */

/* The few NCCL entry points used, by their C ABI (nccl.h is not needed to
 * build: libnccl is found at run time). ncclComm_t is an opaque pointer,
 * ncclResult_t an int (0 = success), NCCL_UINT8 the data type 1. */
typedef int nccl_result;
typedef void *nccl_comm;
enum { NCCL_OK = 0, NCCL_UINT8 = 1 };

/* A buffer that travels in slices: `row` bytes per unit (a received row,
 * or one rank's whole slice), sent from send and received into recv. */
typedef struct cbuf {
    const char *send;
    char *recv;
    size_t row;
} cbuf;

/* One NCCL group of point-to-point pairs: op i sends `bytes` from send to
 * rank `to` and receives as many into recv from rank `from`. */
typedef struct p2p_op {
    const void *send;
    void *recv;
    size_t bytes;
    int to, from;
} p2p_op;

/* One group of point-to-point pairs on stream s, over the layer's
 * communicator (comm 0) or the caller's (comm 2); the exchange of n <= 2
 * buffers with every rank, itself included (rank r's slice q goes to rank
 * q's slice r), over the layer's communicator (msg 0), its messages' one
 * where it has one (msg 1) or the caller's (msg 2). */
smoe_status smoe_ep_p2p_group(const smoe_ep_layer *ep, const p2p_op *op, int n, int comm,
                              cudaStream_t s);
smoe_status smoe_ep_alltoall(const smoe_ep_layer *ep, const cbuf *x, int n, int msg,
                             cudaStream_t s);
/* Copy engines: ncclAlltoAll of `bytes` per rank from send to recv (both in
 * the layer's symmetric window) on the layer's zero-CTA communicator. */
smoe_status smoe_ep_ce_alltoall(const smoe_ep_layer *ep, const char *send, char *recv, size_t bytes,
                                cudaStream_t s);
/* Copy engines: ncclAllGather of `bytes` per rank from send to recv (rank
 * q's at recv + q bytes), both in the layer's symmetric window (NCCL 2.28
 * takes the copy engines only then; send = recv + this rank's: in place). */
smoe_status smoe_ep_ce_allgather(const smoe_ep_layer *ep, const char *send, char *recv,
                                 size_t bytes, cudaStream_t s);

/* ------------------------------------------------------------ row slots */

/* Where a received row lives. Position i of source q's rows (i < C) has
 * the slot ep_slot(q, i) in the receive buffers (and the same in the send
 * buffers of the rank that sent it). The exchanged region holds H parts,
 * each [P][Ch] (rank q's slice of part h: its positions [h Ch, (h+1) Ch)),
 * so that an all-to-all per part moves it; with own_end this rank's own
 * rows follow the exchanged region (they never travel, and the slice an
 * all-to-all copies to itself stays unused). H = 1 and own_end = 0 is the
 * plain [P][C] layout of the point-to-point exchanges. The pairs and dS
 * messages keep the plain layout: index q C + i. */
typedef struct ep_slots {
    int64_t C, Ch;
    int P, H, self, own_end;
} ep_slots;

__host__ __device__ static inline int64_t ep_slots_exchanged(ep_slots s)
{
    return (int64_t)s.P * s.H * s.Ch;
}

__host__ __device__ static inline int64_t ep_slots_total(ep_slots s)
{
    return ep_slots_exchanged(s) + (s.own_end ? s.C : 0);
}

__host__ __device__ static inline int64_t ep_slot(ep_slots s, int q, int64_t i)
{
    if (s.own_end && q == s.self) return ep_slots_exchanged(s) + i;
    const int64_t h = i / s.Ch;
    return (h * s.P + q) * s.Ch + (i - h * s.Ch);
}

/* The source of slot v and its position there; -1: an unused slot (this
 * rank's slice of the exchanged region when own_end). */
__host__ __device__ static inline int ep_slot_src(ep_slots s, int64_t v, int64_t *i)
{
    const int64_t X = ep_slots_exchanged(s);
    if (v >= X) {
        *i = v - X;
        return s.self;
    }
    const int64_t h = v / ((int64_t)s.P * s.Ch), rem = v - h * s.P * s.Ch;
    const int q = (int)(rem / s.Ch);
    *i = h * s.Ch + (rem - (int64_t)q * s.Ch);
    return s.own_end && q == s.self ? -1 : q;
}

__host__ __device__ static inline int ep_slot_is_own(ep_slots s, int64_t v)
{
    int64_t i;
    return ep_slot_src(s, v, &i) == s.self;
}

/* ------------------------------------------------------------ per layer */

/* The layer's CUDA state, made at create: the stream the overlapping
 * exchanges run on, its events, the chunking and the experts' GEMMs. One
 * call at a time per layer (as NCCL allows one per communicator). */
/* Events: EV_IN + h P + k: part h of the first exchange's round k arrived
 * (h = 1: the forward's second halves); EV_IN + 2 P + c: chunk c's partial
 * sums may leave. */
enum { EV_FORK, EV_JOIN, EV_X, EV_IN };

/* Chunk c holds the received rows [b[c], b[c+1]). */
#define EP_MAX_CHUNKS 128 /* two per source rank (at most 64) */
typedef struct ep_bounds {
    int64_t b[EP_MAX_CHUNKS + 1];
} ep_bounds;

/* One direction's chunking of the received rows (ep_nccl.cu's
 * chunks_make). */
typedef struct ep_chunks {
    int nc;          /* chunks: one per source rank and this rank's own in
                        two (halves: every source's in two), or 1
                        (exchange, then compute) */
    int halves;      /* the peers' rows travel in two halves, each its own
                        chunk (the forward where n <= 512, K <= 8) */
    ep_bounds bd;    /* chunk c: received rows [bd.b[c], bd.b[c+1]) */
    int order[EP_MAX_CHUNKS]; /* the chunks in the order they run */
    int own_b;       /* the forward: the second chunk of this rank's own
                        rows (-1: none), which starts own_share percent
                        into the own rows, a bound found on the device; the
                        backward's own chunks split the own slots at bd's
                        C / 2, or 65% of C at P = 2 without copy engines
                        (own_b -1) */
    int own_share;
} ep_chunks;

typedef struct ep_cuda {
    nccl_comm comm;  /* with overlap: the layer's own (split from the caller's
                        at create: clusters of one CTA, at most comm_sms CTAs);
                        else the caller's */
    int own_comm;
    nccl_comm mcomm; /* with overlap on NCCL's kernels where the forward's
                        counts and pairs do not go first (pairs_first): a
                        second one (one CTA) for them, beside x's rows
                        (NCCL runs one communicator's calls one after the
                        other; every rank calls mcomm first, then comm:
                        NCCL connects a communicator's peers at its first
                        call) */
    int pairs_first; /* the forward's counts and pairs on comm (its R CTAs),
                        not on mcomm, and x's rows after them (ep_nccl.cu) */
    cudaStream_t cs;
    cudaEvent_t *ev;
    int n_ev;
    ep_chunks fw, bw; /* the forward's and the backward's chunks */
    int sms_overlap; /* the GEMMs' SMs while an exchange is in flight */
    int dw1_beside;  /* the backward: dW1 (not dW2) beside the last partial
                        sums, dW2 after the join (ep_nccl.cu) */
    int fw_caller;   /* the overlap in the backward only: the forward's
                        exchanges, which run alone, on the caller's
                        communicator (NCCL's own CTAs), not the layer's R */
    smoe_cuda_gemms g;
    ep_slots sl;     /* the received rows' layout */
    /* copy engines (sl.H parts, own_end): the zero-CTA communicator, the
     * symmetric window and this layer's buffers in it (send: the exchanged
     * region; recv: every slot) */
    int ce;
    int ce_whole;      /* copy engines: every rank sends x itself, part h by
                          an all-gather of its rows [h Ch, (h + 1) Ch) into
                          part h (C >= max_tokens and a multiple of H;
                          ep_cuda.cu's ep_whole_x, ce_whole_stage) */
    nccl_comm ce_comm; /* shared by the communicator's layers (ep_nccl.cu) */
    void *ce_group;    /* the shared communicator and windows; ce_win: ours */
    int ce_win;
    char *rows_send, *rows_recv, *do_send, *do_recv, *part_send, *part_recv;
    struct ep_trace *tr; /* SMOE_EP_TRACE=1 at create only (ep_trace.cu) */
} ep_cuda;

/* ep_trace.cu: the calls' marks, a debugging aid (SMOE_EP_TRACE=1 at create;
 * else every one returns at once). bwd: 0 the forward, 1 the backward; on_cs:
 * the mark is on the exchanges' stream; idx: the chunk or part it names
 * (-1: none). The report (stderr) comes with the layer's free. */
typedef struct ep_trace ep_trace;
void ep_trace_make(ep_cuda *X);
void ep_trace_begin(const ep_cuda *X, int bwd, cudaStream_t s);
void ep_trace_mark(const ep_cuda *X, int bwd, cudaStream_t s, int on_cs, const char *name,
                   int idx);
void ep_trace_report(const smoe_ep_layer *ep);
void ep_trace_free(ep_cuda *X);


/* ------------------------------------------------------------ kernels (ep_kernels.cu) */

/* The pairs message's entry, then the kernels (ep_kernels.cu says what
 * each computes). */
typedef struct pair_msg { /* one pair of a row: local expert (-1: none), score */
    int32_t e;
    float s;
} pair_msg;

__global__ void k_ep_entries(int T, int P, int64_t El, int Kq, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, uint16_t *aexp16, int32_t *dest,
                             int32_t *tok, float *score, int32_t *ent_off, int32_t *ent_count,
                             const int *abort);
__global__ void k_ep_pack(int64_t n_ent, int Kq, ep_slots sl, int Km, int64_t El, int64_t d,
                          const bf16 *__restrict__ x, const int32_t *__restrict__ toff,
                          const int32_t *__restrict__ aexp, const float *__restrict__ ascore,
                          const int32_t *__restrict__ dest, const int32_t *__restrict__ ent_row,
                          const int32_t *__restrict__ eoff, int whole, int own_x, int32_t *pidx,
                          bf16 *send_rows, bf16 *recv_rows, pair_msg *send_pairs,
                          const int *abort);
__global__ void k_ep_msg(int P, int self, int64_t C, const int32_t *__restrict__ eoff, int whole,
                         int own_x, int32_t *msg, smoe_dev_status *st, smoe_dev_report rep);
__global__ void k_ep_peers(int P, int self, const int32_t *__restrict__ msg, smoe_dev_status *st,
                           smoe_dev_report rep);
__global__ void k_ep_row_counts(int64_t Tv, ep_slots sl, int Km, const int32_t *__restrict__ msg,
                                const pair_msg *__restrict__ pairs, int32_t *cnt,
                                const int *abort);
__global__ void k_ep_triples(int64_t Tv, ep_slots sl, int Km, int64_t rows,
                             const pair_msg *__restrict__ pairs,
                             const int32_t *__restrict__ off, int32_t *pt,
                             int32_t *pe, uint16_t *pe16, float *ps, int32_t *tri_slot,
                             const smoe_dev_status *st);
__global__ void k_ep_rows_check(int P, int64_t rows, const int32_t *total, int32_t *msg,
                                smoe_dev_status *st, smoe_dev_report rep);
__global__ void k_ep_status_msg(int P, int32_t *msg, const smoe_dev_status *st);
__global__ void k_ep_rows_final(int32_t *total, const smoe_dev_status *st);
__global__ void k_ep_chunk_off(int El, int nc, ep_bounds bd, const int32_t *__restrict__ off,
                               const int32_t *__restrict__ row_token, int32_t *off2, int cs,
                               const int32_t *__restrict__ eoff, int self, int64_t C, int share,
                               const int *abort);
__global__ void k_ep_rebase(int64_t n, const int32_t *__restrict__ in, int64_t base, int32_t *out,
                            const int *abort);
__global__ void k_ep_iota(int64_t n, int32_t *v, const int *abort);
__global__ void k_ep_outputs(int T, int E, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, int32_t *counts,
                             const float *__restrict__ lg, void *lg_out, int lg_bf16,
                             const int *abort);
__global__ void k_ep_pack2(int64_t n_ent, int Kq, int64_t d, ep_slots sl, int own_only,
                           const bf16 *__restrict__ x, const bf16 *__restrict__ dout,
                           const int32_t *__restrict__ pidx, bf16 *sx, bf16 *sdo, bf16 *rx,
                           bf16 *rdo, const int *abort);
__global__ void k_ep_ds_scatter(int64_t v0, int64_t v1, int64_t own0, int64_t own1, int Km,
                                const int32_t *__restrict__ toff,
                                const int32_t *__restrict__ tri_slot,
                                const int32_t *__restrict__ arow, const float *__restrict__ ds,
                                float *send_ds, float *recv_ds, const int *abort);
__global__ void k_ep_ds_gather(int T, int Kq, int Km, int64_t El, ep_slots sl,
                               const int32_t *__restrict__ toff,
                               const uint16_t *__restrict__ aexp,
                               const int32_t *__restrict__ pidx,
                               const float *__restrict__ recv_ds, float *ds, const int *abort);
__global__ void k_ep_dps_out(int64_t A, const float *__restrict__ ds, float *out, int accumulate,
                             const int *abort);

#endif /* SMOE_CUDA_EP_CUDA_H */
