/*
 * cuda_layer.cu -- the CUDA backend of the layer (SMOE_BACKEND_CUDA and
 * SMOE_BACKEND_SM90): the workspace layout, and the forward / backward
 * orchestration of DESIGN.md sections 4 and 5:
 *
 *   forward   router GEMM (cuBLAS, bf16 in, fp32 out) -> routing kernels ->
 *             metadata -> up GEMM (gather X, act; H kept) -> down GEMM (Y)
 *             -> aggregation (o_t = sum s Y)
 *   backward  dh GEMM (gather dO; dS, A' = s A, dH) -> dW2 -> dX~ -> dW1 ->
 *             bias sums -> router dlogits -> cuBLAS dWr = dl^T X ->
 *             aggregation dX_t = sum_a (dX~[r_a] + dl_a Wr[e_a]) when dlogits
 *             lives on the routed pairs only (TOPK_SOFTMAX), else
 *             dX_t = sum_a dX~[r_a] + (cuBLAS dl Wr)_t
 *   The dense router GEMMs take dlogits as a bf16 hi/lo pair (16 significant
 *   bits) on the tensor cores (router_backward.cu).
 *
 * The grouped GEMMs come from the gemm.h tables: each op's row of the
 * Hopper tile table where it has one for the layer's shape (SM90 backend
 * on an sm_90 device), the portable table's otherwise, chosen once at
 * create (plans_make, cuda_layer_init.cu); path_name lists which family
 * runs each op.
 *
 * Debugging: SMOE_CUDA_TIMING=1 in the environment at create time times
 * every stage with CUDA events (and waits at the end of each call) and
 * prints the means when the layer is freed; bench --stages uses it.
 *
 * Nothing here synchronises with the host or allocates: every buffer is
 * carved from the caller's workspace (cuBLAS's too, so a graph capture has
 * nothing to allocate), grids are sized for the row capacity, and the row
 * count stays on the device. smoe_layer_device_status (status.cu) is the
 * one exception (with wait = 1 it waits for the stream).
 *
 * Device-side checks (cuda_common.h, "device status"): a call's status word
 * sits at the start of its workspace; every kernel after a check takes its
 * code as `abort`. The layer's report record (a claim word in device memory,
 * the record in mapped page-locked memory) is made at create time.
 *
 * Threads: the layer's state is read-only during calls except the cuBLAS
 * handle, which is bound to the call's stream and workspace under a mutex
 * for each dense GEMM (cuda_router.cu), so one layer serves several threads
 * and streams.
 *
 * The layer's other files: cuda_layer_init.cu (create: the device checks,
 * the cuBLAS handle, the report record, each GEMM's kernel), cuda_router.cu
 * (the dense router GEMMs, the router alone), status.cu (the device status
 * read on the host), cuda_layer_state.h (the state they share).
 */
#include <stdio.h>
#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"
#include "cuda/cuda_layer_state.h"

/* ------------------------------------------------------------ stage timing */

static void timer_begin(cuda_state *st, cudaStream_t s)
{
    if (!st->timer) return;
    st->timer->n = 0;
    cudaEventRecord(st->timer->ev[0], s);
}

static void timer_mark(cuda_state *st, int which, const char *name, cudaStream_t s)
{
    stage_timer *tm = st->timer;
    if (!tm || tm->n >= MAX_STAGES) return;
    tm->name[which][tm->n] = name;
    cudaEventRecord(tm->ev[++tm->n], s);
}

static void timer_end(cuda_state *st, int which)
{
    stage_timer *tm = st->timer;
    if (!tm || tm->n == 0) return;
    if (cudaEventSynchronize(tm->ev[tm->n]) != cudaSuccess) return;
    for (int i = 0; i < tm->n; ++i) {
        float ms = 0;
        cudaEventElapsedTime(&ms, tm->ev[i], tm->ev[i + 1]);
        tm->ms[which][i] += ms;
    }
    tm->nst[which] = tm->n;
    tm->calls[which]++;
}

void smoe_cuda_timer_report(const smoe_layer *layer, stage_timer *tm)
{
    static const char *what[2] = {"forward", "backward"};
    for (int w = 0; w < 2; ++w) {
        if (!tm->calls[w]) continue;
        double total = 0;
        for (int i = 0; i < tm->nst[w]; ++i) total += tm->ms[w][i];
        fprintf(stderr, "smoe stage times, %s, mean of %ld calls, %s: %.3f ms\n", what[w],
                tm->calls[w], layer->path_name, total / tm->calls[w]);
        for (int i = 0; i < tm->nst[w]; ++i)
            fprintf(stderr, "  %-16s %8.3f ms  %5.1f%%\n", tm->name[w][i],
                    tm->ms[w][i] / tm->calls[w], 100.0 * tm->ms[w][i] / (total > 0 ? total : 1));
    }
}

/* ------------------------------------------------------------ workspace */

typedef struct ws_layout {
    size_t status;
    /* forward */
    size_t logits, assign_token, assign_score, assign_count;
    size_t m_h_unused, m_row_score, m_row_token, m_assign_row, m_assign_expert, m_token_offset,
        m_expert_offset; /* the metadata of an inference forward (no saved block);
                            m_assign_expert: the routing's experts, always */
    size_t route_scratch, md_scratch, a, y, f_gemm; /* f_gemm: cuBLAS's scratch too */
    size_t fwd_end;
    /* backward (overlaps the forward region) */
    size_t dh, a_scaled, ds, dxt, wr_nf, b_gemm;
    size_t rscr, dwr2;   /* the router weight's GEMM: cuBLAS's scratch, then dwr2
                            (in dX~'s region, dead by then, where it fits) */
    int dh_in_saved;     /* consume_saved: dH over the saved block's H (dh unused) */
    int a_ext;           /* A' in dW1's buffer (a_in_dw1), not in this workspace */
    /* the router's buffers: offsets from the router region's start, which
     * is the dH region (the saved H with consume_saved) where rtr_in_h, else
     * dh's offset in this workspace */
    size_t split, tc, dla, wr2;
    int rtr_in_h;
    size_t dxr;          /* the dXr chunk: in the router region where dxr_in_h,
                            else an offset in this workspace */
    int dxr_in_h;
    int64_t dxr_tokens;  /* the dense router term of dX in chunks of this many tokens */
    size_t slots;        /* dXr's cuBLAS pointers, DXR_CHUNKS triples */
    size_t bwd_end;
    size_t total;
} ws_layout;

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

/* consume_saved's dense router term of dX: at most this many chunks */
#define DXR_CHUNKS 8

static size_t gemm_scratch(const smoe_layer *layer, const smoe_gemm_problem *p)
{
    const cuda_state *st = (const cuda_state *)layer->state;
    size_t b = smoe_gemm_ops_sm80.scratch_bytes(p);
    if (st->tab90 && st->tab90->scratch_bytes) {
        size_t b90 = st->tab90->scratch_bytes(p);
        if (b90 > b) b = b90;
    }
    return al(b);
}

smoe_gemm_problem smoe_cuda_problem_make(const smoe_layer *layer, int64_t cap)
{
    const cuda_state *st = (const cuda_state *)layer->state;
    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = layer->desc.d;
    p.n = layer->desc.n;
    p.h_cols = layer->h_cols;
    p.E = layer->desc.E;
    p.cap = cap;
    p.gated = layer->gated;
    p.act = layer->desc.activation;
    p.w1_layout = layer->desc.w1_layout;
    p.num_sms = st->num_sms;
    p.plan = &st->plan;
    return p;
}

/* Does A' (a_scaled, R x n bf16) go into the dW1 output's buffer? Where the
 * backward overwrites dW1 (wanted, accumulate 0) and that buffer (E x h_cols
 * x d of its dtype) holds R x n bf16: the dh GEMM writes A' and the dW2 GEMM
 * reads it, both before the dW1 GEMM writes dW1 (one stream; no other
 * kernel reads dW1 or A'). Only the dh kernels write A', after their abort
 * check, so a call the device refuses leaves dW1 as it was. The caller's
 * dW1 is 16-byte aligned (vec_align) and overlaps no other argument
 * (validate.c), as the workspace's A' did. The backward's workspace then
 * holds dX~ (R x d) where it held R x max(d, n), and dh's scratch fits
 * where A' was: smaller where n >= d (Mixtral-8x7B's R (n - d) bf16, 640
 * MiB at 16K tokens). Decided from the arguments alone: the same arguments
 * give the same layout whatever workspace size the caller passes. */
static int a_in_dw1(const smoe_layer *layer, int64_t cap, const smoe_backward_args *args)
{
    if (!args || cap <= 0 || !args->dw1.ptr || args->dw1.accumulate != 0) return 0;
    const size_t es = smoe_dtype_size(args->dw1.dtype);
    const size_t dw1_bytes =
        (size_t)layer->desc.E * (size_t)layer->h_cols * (size_t)layer->desc.d * es;
    return es > 0 && (size_t)cap * (size_t)layer->desc.n * 2 <= dw1_bytes;
}

static void ws_make_as(const smoe_layer *layer, int64_t T, int64_t cap, int a_ext, ws_layout *w)
{
    const smoe_layer_desc *d = &layer->desc;
    const size_t E = (size_t)d->E, dd = (size_t)d->d, n = (size_t)d->n, K = (size_t)d->K;
    const size_t hc = (size_t)layer->h_cols, t = (size_t)T, c = (size_t)(cap > 0 ? cap : 1);
    smoe_gemm_problem p = smoe_cuda_problem_make(layer, cap);
    const size_t gs = gemm_scratch(layer, &p);
    size_t o = 0;
    memset(w, 0, sizeof *w);
    w->status = o; o += SMOE_DEV_STATUS_BYTES;
    w->slots = o; o += al(3 * DXR_CHUNKS * sizeof(void *)); /* the backward's prologue writes */
    const size_t base = o;

    w->logits = o; o += al(t * E * 4);
    w->assign_token = o; o += al(c * 4);
    w->assign_score = o; o += al(c * 4);
    w->assign_count = o; o += al(4);
    w->m_row_score = o; o += al(c * 4);
    w->m_row_token = o; o += al(c * 4);
    w->m_assign_row = o; o += al(c * 4);
    w->m_assign_expert = o; o += al(c * 4);
    w->m_token_offset = o; o += al((t + 1) * 4);
    w->m_expert_offset = o; o += al((E + 1) * 4);
    w->route_scratch = o; o += al(smoe_cuda_routing_scratch_bytes(d, T, 1));
    w->md_scratch = o; o += al(smoe_cuda_metadata_scratch_bytes(d->E, cap));
    w->a = o; o += al(c * n * 2);
    w->y = o; o += al(c * dd * 2);
    /* the expert GEMMs' scratch, and before them the router GEMM's cuBLAS
     * scratch (one stream: the router GEMM is done when up starts) */
    w->f_gemm = o; o += gs > CUBLAS_WS_BYTES ? gs : CUBLAS_WS_BYTES;
    w->fwd_end = o;

    /* The backward's buffers, by lifetime (one stream, so in this order):
     *   dh:        written by the dh GEMM; read by dxt, dw1, db1
     *   a_scaled:  written by the dh GEMM; read by dw2 (before dxt)
     *   ds:        written by the dh GEMM; read by the router backward and
     *              the pair-score gradient (to the end)
     *   dxt:       written by dxt (after dw2); read by the dx aggregation
     *   b_gemm:    the expert GEMMs' scratch (dh's dS partials, only in
     *              the dh launch)
     *   router:    split, tc, dla, wr2, the dXr chunk: written after db1,
     *              read up to the dx aggregation (split: to the end)
     *   rscr:      the router weight's GEMM, after the dx aggregation:
     *              cuBLAS's scratch, then dwr2 (both halves, fp32)
     * so a_scaled (with b_gemm after it), dxt and rscr share one region
     * (b_gemm and rscr go after it where they do not fit; with a_ext, A'
     * is in dW1 and the region is dX~'s R x d, b_gemm at its start), and the router's
     * buffers share dh's (dead once db1 has run). dXr's cuBLAS calls run
     * with no scratch (K = 2E: no split of K to sum). With consume_saved,
     * dH is written over the saved block's H (the same lifetime: H is dead
     * once the dh GEMM has read it), so the router's buffers go there and
     * this workspace has no dH region. Their layout from the region's start
     * is the same either way, so a reading and a consuming layer make the
     * same calls and their gradients agree bit for bit.
     * A call whose saved block the device refused (another layer's,
     * another T's, a consumed one) must write nothing into that block,
     * which may be another call's live one: the dlogits kernel and
     * stack_twice read the status word, and dXr's cuBLAS calls (which do
     * not) take their pointers from the slots the backward's prologue
     * writes after the block's check: the router region, or in a refused
     * call dX~'s region of this workspace (the sink). dwr2 and cuBLAS's
     * scratch stay in this workspace (rscr).
     * dXr (T x d fp32, only for a dense router gradient: a dlogits_extra,
     * or a router whose gradient is dense) runs in chunks of dxr_tokens
     * tokens (a multiple of 64), as many as fit in the region after the
     * other buffers and in the sink; where that would take more than
     * DXR_CHUNKS chunks, the chunk (ceil(T / DXR_CHUNKS) tokens, at least
     * 256) is this workspace's. cap > 0: the saved block's H is then
     * exactly hreg bytes (the saved layout's 256-byte alignment is al's). */
    const size_t hreg = al(c * hc * 2), sink_full = al(c * (dd > n ? dd : n) * 2);
    w->split = 0;
    w->tc = w->split + al(t * 2 * E * 2);
    w->dla = w->tc + al(t * K * 4);
    w->wr2 = w->dla + al(c * 4);
    const size_t small_end = w->wr2 + al(2 * E * dd * 2);
    w->dh_in_saved = d->consume_saved != 0;
    w->a_ext = a_ext;
    w->rtr_in_h = cap > 0 && small_end <= hreg;
    int64_t tcnt = 0;
    if (w->rtr_in_h && T > 0) {
        size_t fit = (hreg - small_end) / (dd * 4), fs = sink_full / (dd * 4);
        if (fs < fit) fit = fs;
        tcnt = fit >= t ? T : (int64_t)(fit / 64 * 64);
        if (tcnt > 0 && (T + tcnt - 1) / tcnt > DXR_CHUNKS) tcnt = 0;
    }
    w->dxr_in_h = tcnt > 0;
    if (!w->dxr_in_h) {
        tcnt = (T + DXR_CHUNKS - 1) / DXR_CHUNKS;
        tcnt = (tcnt + 63) / 64 * 64;
        if (tcnt < 256) tcnt = 256;
        if (tcnt > T) tcnt = T > 0 ? T : 1;
    }
    w->dxr_tokens = tcnt;
    /* dX~'s region: R x max(d, n) (A' then dX~), or with A' in dW1 dX~'s R
     * x d, at least a dXr chunk (a refused call's sink). The chunks are the
     * same either way, so the same cuBLAS calls and the same bits. */
    size_t sink = sink_full;
    if (a_ext) {
        sink = al(c * dd * 2);
        const size_t ch = w->dxr_in_h ? al((size_t)tcnt * dd * 4) : 0;
        if (ch > sink) sink = ch;
    }
    o = base;
    w->dh = o;
    if (w->dxr_in_h) w->dxr = small_end;
    if (w->rtr_in_h) {
        if (!w->dh_in_saved) o += hreg;
    } else {
        o += small_end; /* larger than dH's region (or cap = 0: no dh GEMM) */
    }
    if (!w->dxr_in_h) { w->dxr = o; o += al((size_t)tcnt * dd * 4); }
    w->ds = o; o += al(c * 4);
    w->wr_nf = o; o += al(dd * 4);
    w->a_scaled = o;
    w->dxt = o;
    o += sink;
    {
        /* b_gemm (the dh launch alone uses it) after a_scaled in the same
         * region, and rscr (after the dx aggregation) at its start, where
         * they fit; else after it, b_gemm and rscr then sharing one place */
        const size_t as_b = a_ext ? 0 : al(c * n * 2), rb = CUBLAS_WS_BYTES + al(2 * E * dd * 4);
        const int gs_in = as_b + gs <= sink, r_in = rb <= sink;
        size_t extra = gs_in ? 0 : gs;
        if (!r_in && rb > extra) extra = rb;
        w->b_gemm = gs_in ? w->dxt + as_b : o;
        w->rscr = r_in ? w->dxt : o;
        w->dwr2 = w->rscr + CUBLAS_WS_BYTES;
        o += extra;
    }
    w->bwd_end = o;
    w->total = w->fwd_end > w->bwd_end ? w->fwd_end : w->bwd_end;
}

/* The layout of a call: a forward's or a query's (args NULL: A' in this
 * workspace), or a backward's, with A' in dW1 where a_in_dw1 holds and the
 * workspace is smaller for it (the cuBLAS scratch of the router weight's
 * GEMM may not fit the smaller sink and go after it). */
static void ws_make(const smoe_layer *layer, int64_t T, int64_t cap,
                    const smoe_backward_args *args, ws_layout *w)
{
    ws_make_as(layer, T, cap, 0, w);
    if (a_in_dw1(layer, cap, args)) {
        ws_layout e;
        ws_make_as(layer, T, cap, 1, &e);
        if (e.bwd_end < w->bwd_end) *w = e;
    }
}

size_t smoe_cuda_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap, int call)
{
    ws_layout w;
    ws_make(layer, T, cap, NULL, &w);
    if (call == SMOE_CALL_FORWARD) return w.fwd_end;
    if (call == SMOE_CALL_BACKWARD) return w.bwd_end;
    return w.total;
}

/* The router slot (smoe.h's smoe_layer_drouter_slot): the consumed saved
 * H from the router's tc buffer on (the router region's start is H's with
 * consume_saved). Everything there (tc, dla, wr2, the dXr chunks) is dead
 * once the dx aggregation has run, and the dWr GEMM after it reads split
 * alone, which lies before tc; combine_halves writes drouter_w last. */
int smoe_cuda_drouter_slot(const smoe_layer *layer, const smoe_saved_layout *l, size_t *offset,
                           size_t *bytes)
{
    ws_layout w;
    ws_make(layer, l->T, l->cap, NULL, &w);
    const size_t h = (size_t)l->cap * (size_t)layer->h_cols * 2;
    if (!w.rtr_in_h || !w.dh_in_saved || h <= w.tc) return 0;
    *offset = l->h + w.tc;
    *bytes = h - w.tc;
    return 1;
}

size_t smoe_cuda_backward_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap,
                                          const smoe_backward_args *args)
{
    ws_layout w;
    ws_make(layer, T, cap, args, &w);
    return w.bwd_end;
}

/* ------------------------------------------------------------ helpers */

smoe_status smoe_cuda_dev_enter(const cuda_state *st, dev_guard *g)
{
    g->changed = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&g->prev));
    if (g->prev != st->device) {
        SMOE_CUDA_CHECK(cudaSetDevice(st->device));
        g->changed = 1;
    }
    return SMOE_SUCCESS;
}

void smoe_cuda_dev_leave(const dev_guard *g)
{
    if (g->changed) cudaSetDevice(g->prev);
}

/* A Hopper launcher declined a call it accepted at create time: a bug, not
 * a reason to switch kernels in the middle of a call. */
static smoe_status gemm_declined(const char *op)
{
    char why[256];
    snprintf(why, sizeof why, "%s", smoe_last_error());
    return smoe_fail(SMOE_ERROR_INTERNAL,
                     "the Hopper %s GEMM declined a call it accepted at create time: %s", op,
                     why);
}

/* The op's kernel as chosen at create time. */
#define GEMM_CALL(layer, op, field, ...)                                                   \
    do {                                                                                   \
        cuda_state *st_ = (cuda_state *)(layer)->state;                                    \
        if (st_->use90[op]) {                                                              \
            smoe_status r_ = st_->tab90->field(__VA_ARGS__);                               \
            if (r_ == SMOE_ERROR_UNSUPPORTED) return gemm_declined(#field);                \
            SMOE_FORWARD_IF_ERROR(r_);                                                     \
        } else {                                                                           \
            SMOE_FORWARD_IF_ERROR(smoe_gemm_ops_sm80.field(__VA_ARGS__));                  \
        }                                                                                  \
    } while (0)

/* ------------------------------------------------------------ forward */

/* The layer's report record, for the kernels that set a status code. */
static smoe_dev_report report_make(const cuda_state *st, int call)
{
    smoe_dev_report r;
    r.claim = st->claim;
    r.rec = st->rec_dev;
    r.call = call;
    return r;
}

smoe_dev_report smoe_cuda_report(const smoe_layer *layer, int call)
{
    return report_make((const cuda_state *)layer->state, call);
}

/* The aggregations' k_uniform: K where every token has exactly K rows (top-K
 * routing without token rounding, `rounding` as the call applies it), else 0
 * (the token offsets are read). */
static int uniform_k(const smoe_layer_desc *d, int rounding)
{
    return d->routing != SMOE_ROUTING_GENERAL && !rounding ? (int)d->K : 0;
}

static smoe_status forward_impl(smoe_layer *layer, const smoe_forward_args *args,
                                const smoe_saved_layout *sl,
                                void *saved, void *workspace, cudaStream_t s)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    const int64_t T = args->T;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int training = !args->inference;
    const int rounding = training && d->rounding != SMOE_ROUND_OFF;
    const int64_t cap = smoe_row_capacity(layer, T, general ? args->pairs : 0, args->inference);

    ws_layout w;
    ws_make(layer, T, cap, NULL, &w);
    char *ws = (char *)workspace;
    smoe_dev_status *dst = (smoe_dev_status *)(ws + w.status);
    const int *abort = &dst->code;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_status_reset(dst, s));

    smoe_saved_view v;
    if (training) {
        v = smoe_saved_view_make(sl, saved);
    } else {
        memset(&v, 0, sizeof v);
        v.row_score = (float *)(ws + w.m_row_score);
        v.row_token = (int32_t *)(ws + w.m_row_token);
        v.assign_row = (int32_t *)(ws + w.m_assign_row);
        v.token_offset = (int32_t *)(ws + w.m_token_offset);
        v.expert_offset = (int32_t *)(ws + w.m_expert_offset);
    }
    /* the routing's experts in int32 here; the metadata copies them to the
     * saved block's 16-bit assign_expert */
    smoe_assign_dev as;
    as.expert = (int32_t *)(ws + w.m_assign_expert);
    as.expert16 = training ? v.assign_expert : NULL;
    as.token = (int32_t *)(ws + w.assign_token);
    as.score = (float *)(ws + w.assign_score);
    as.token_offset = v.token_offset;
    as.count = (int32_t *)(ws + w.assign_count);
    as.abort = abort;

    if (general) {
        SMOE_FORWARD_IF_ERROR(smoe_cuda_route_general(
            T, d->E, args->pairs, args->pair_token, args->pair_expert, args->pair_score,
            as, dst, report_make(st, 0), s));
        timer_mark(st, 0, "general triples", s);
    } else {
        /* fp32 logits: the saved block's, the caller's fp32 output, or the
         * workspace's (then converted into a bf16 output) */
        const int out32 = args->router_logits && args->router_logits_dtype == SMOE_DTYPE_F32;
        float *lg = (training && v.logits) ? v.logits
                    : out32                ? (float *)args->router_logits
                                           : (float *)(ws + w.logits);
        /* logits^T (E x T, col-major) = Wr (E x d) . X^T */
        SMOE_FORWARD_IF_ERROR(smoe_cuda_gemm_bf16_f32(st, ws + w.f_gemm, s, CUBLAS_OP_T,
                                                      CUBLAS_OP_N, d->E, T, d->d,
                                                      (const bf16 *)args->router_w, d->d,
                                                      (const bf16 *)args->x, d->d, lg, d->E));
        timer_mark(st, 0, "router gemm", s);
        /* a bf16 router_logits comes out of the routing kernel (from the
         * logits it reads anyway); an fp32 one not in place is a copy */
        void *lg16 = NULL;
        if (args->router_logits && args->router_logits != lg) {
            if (args->router_logits_dtype == SMOE_DTYPE_BF16)
                lg16 = args->router_logits;
            else
                SMOE_FORWARD_IF_ERROR(smoe_cuda_logits_out(lg, args->router_logits,
                                                           args->router_logits_dtype, T * d->E, s));
        }
        SMOE_FORWARD_IF_ERROR(smoe_cuda_route(d, T, rounding, lg, args->expert_bias, lg16, as,
                                              ws + w.route_scratch, s));
        timer_mark(st, 0, "routing", s);
    }
    SMOE_FORWARD_IF_ERROR(smoe_cuda_metadata(d->E, cap, as, v.expert_offset, v.assign_row,
                                             v.row_token, v.row_score, args->expert_counts,
                                             ws + w.md_scratch, s));
    timer_mark(st, 0, "metadata", s);

    smoe_gemm_problem p = smoe_cuda_problem_make(layer, cap);
    p.expert_offset = v.expert_offset;
    p.row_token = v.row_token;
    p.row_score = v.row_score;
    p.abort = abort;
    bf16 *a = (bf16 *)(ws + w.a), *y = (bf16 *)(ws + w.y);
    void *gs = ws + w.f_gemm;
    if (cap > 0) {
        GEMM_CALL(layer, OP_UP, up, &p, (const bf16 *)args->x, (const bf16 *)args->w1,
                  (const bf16 *)args->b1, training ? (bf16 *)v.h : NULL, a, gs, s);
        timer_mark(st, 0, "up", s);
        GEMM_CALL(layer, OP_DOWN, down, &p, a, (const bf16 *)args->w2, (const bf16 *)args->b2, y,
                  gs, s);
        timer_mark(st, 0, "down", s);
    }
    SMOE_FORWARD_IF_ERROR(smoe_cuda_aggregate_forward(
        T, d->d, v.token_offset, uniform_k(d, rounding), v.assign_row, v.row_score, y,
        (bf16 *)args->out, training ? v.header : NULL,
        smoe_saved_header_make(layer, T, args->pairs), abort, s));
    timer_mark(st, 0, "aggregate", s);
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ backward */

static smoe_status backward_impl(smoe_layer *layer, const smoe_backward_args *args,
                                 const smoe_saved_layout *sl, void *saved, void *workspace,
                                 cudaStream_t s)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    const int64_t T = args->T, cap = sl->cap;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int rounding = d->rounding != SMOE_ROUND_OFF;
    const int k_uniform = uniform_k(d, rounding);

    ws_layout w;
    ws_make(layer, T, cap, args, &w);
    char *ws = (char *)workspace;
    smoe_saved_view v = smoe_saved_view_make(sl, saved);
    smoe_dev_status *dst = (smoe_dev_status *)(ws + w.status);
    const int *abort = &dst->code;
    const int want_dx = args->dx.ptr != NULL;
    const int want_router = !general && (args->drouter_w.ptr || want_dx);
    const void *extra = args->dlogits_extra;
    const int sparse = want_router && smoe_cuda_router_sparse(d, rounding, extra);
    float *wr_nf = sparse && want_dx ? (float *)(ws + w.wr_nf) : NULL;
    /* the router's buffers (rbase) and the dXr chunk (xbase): in the saved
     * block's H, in this workspace's dH region, or after it (ws_make) */
    char *rbase = (w.rtr_in_h && w.dh_in_saved) ? (char *)v.h : ws + w.dh;
    char *xbase = w.dxr_in_h ? rbase : ws;
    const int dense_dx = want_router && want_dx && !sparse;
    const int64_t nchunks = T > 0 ? (T + w.dxr_tokens - 1) / w.dxr_tokens : 0;
    smoe_dxr_slots sl3 = smoe_dxr_slots_none();
    if (dense_dx && nchunks > 0) {
        sl3.slots = (void **)(ws + w.slots);
        sl3.n = (int)nchunks;
        sl3.a = rbase + w.wr2;
        sl3.b = rbase + w.split;
        sl3.b_step = (size_t)w.dxr_tokens * 2 * (size_t)d->E * 2;
        sl3.c = xbase + w.dxr;
        sl3.sink = (w.dxr_in_h && w.dh_in_saved) ? ws + w.dxt : NULL; /* in the saved H */
    }
    /* first: is the saved block this call's? (every later kernel reads
     * abort); and the router weight's non-finite columns; dXr's pointers */
    SMOE_FORWARD_IF_ERROR(smoe_cuda_backward_prologue(
        v.header, smoe_saved_header_make(layer, T, general ? args->pairs : 0),
        d->consume_saved, dst,
        report_make(st, 1), wr_nf ? (const bf16 *)args->router_w : NULL, d->E, d->d, wr_nf,
        sl3, s));

    const int want_ds = want_router || (general && args->dpair_score.ptr);
    const int want_dh = want_dx || args->dw1.ptr || args->db1.ptr;
    const int run_dh = want_dh || want_ds || args->dw2.ptr;

    smoe_gemm_problem p = smoe_cuda_problem_make(layer, cap);
    p.expert_offset = v.expert_offset;
    p.row_token = v.row_token;
    p.row_score = v.row_score;
    p.abort = abort;
    /* consume_saved: dH is written over the saved H, so the dh GEMM gets
     * the same pointer as its input h and its output dh. That is safe on
     * every dh path, as read from the kernels:
     *  - the portable DH epilogue (portable/epilogue.cuh) copies the tile's
     *    H block (rows [m0, m_lim), H columns [hc0, hc0 + 2BN) gated or BN
     *    plain) into shared memory with cp.async, waits for all of it and
     *    synchronises, computes dH in shared memory and only then stores
     *    it to exactly that block;
     *  - DHX loads the same block in two commit groups (row halves) and
     *    stores a half's rows only after waiting for that half's group (and
     *    a barrier); the other half's loads in flight are other rows;
     *  - sm90's ep_dh_direct and ep_dh_tma (sm90/epilogue_sm90.cuh): a
     *    thread loads the H pairs of its own rows and units (plain coherent
     *    loads, DIST groups ahead) and stores dH to those addresses after
     *    its load (direct: from registers; tma: through shared memory and a
     *    TMA store or thread stores of rows < nvalid, after the chunk's four
     *    groups were loaded). Stand-in loads (rows past nvalid read row 0 of
     *    the block, groups past n read group 0) may see dH already written,
     *    but feed no store and no dS term (st, jv, rv are false there);
     *  - tiles (m-tile of one expert, n-tile) cover disjoint rows x columns,
     *    a column block is the same in H and dH (2 x BN, interleaved: H is
     *    saved interleaved whatever W1's layout), and nothing else in the
     *    dh launch (the dS reduction) reads H.
     * No launcher refuses h == dh (none compares them); h_in / hin are not
     * __restrict__. */
    bf16 *dh = w.dh_in_saved ? (bf16 *)v.h : (bf16 *)(ws + w.dh);
    bf16 *a_scaled = w.a_ext ? (bf16 *)args->dw1.ptr : (bf16 *)(ws + w.a_scaled);
    bf16 *dxt = (bf16 *)(ws + w.dxt);
    float *ds = (float *)(ws + w.ds);
    void *gs = ws + w.b_gemm;
    const bf16 *dout = (const bf16 *)args->dout;

    if (run_dh && cap > 0)
        GEMM_CALL(layer, OP_DH, dh, &p, dout, (const bf16 *)args->w2, (const bf16 *)args->b2,
                  (const bf16 *)v.h, dh, a_scaled, ds, gs, s);
    timer_mark(st, 1, "dh", s);
    if (args->dw2.ptr)
        GEMM_CALL(layer, OP_DW2, dw2, &p, dout, a_scaled, args->dw2.ptr, args->dw2.dtype,
                  args->dw2.accumulate, gs, s);
    timer_mark(st, 1, "dw2", s);
    if (args->db2.ptr)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_expert_colsum(
            d->E, d->d, v.expert_offset, dout, v.row_token, v.row_score, d->n, layer->gated,
            d->w1_layout, 0, args->db2.ptr, args->db2.dtype, args->db2.accumulate, abort, s));
    timer_mark(st, 1, "db2", s);
    if (want_dx && cap > 0)
        GEMM_CALL(layer, OP_DXT, dxt, &p, dh, (const bf16 *)args->w1, dxt, gs, s);
    timer_mark(st, 1, "dxt", s);
    if (args->dw1.ptr)
        GEMM_CALL(layer, OP_DW1, dw1, &p, dh, (const bf16 *)args->x, args->dw1.ptr,
                  args->dw1.dtype, args->dw1.accumulate, gs, s);
    timer_mark(st, 1, "dw1", s);
    if (args->db1.ptr)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_expert_colsum(
            d->E, layer->h_cols, v.expert_offset, dh, NULL, NULL, d->n, layer->gated,
            d->w1_layout, 1, args->db1.ptr, args->db1.dtype, args->db1.accumulate, abort, s));
    timer_mark(st, 1, "db1", s);

    const int64_t E2 = 2 * d->E;
    float *dla = NULL;
    if (want_router) {
        bf16 *split = (bf16 *)(rbase + w.split);
        if (sparse && want_dx) dla = (float *)(rbase + w.dla);
        SMOE_FORWARD_IF_ERROR(smoe_cuda_router_dlogits(
            d, T, rounding, v.logits, v.token_offset, v.assign_expert, v.assign_row,
            v.row_score, ds, extra, args->dlogits_extra_dtype, split, (int32_t *)(rbase + w.tc),
            dla, abort,
            s));
        timer_mark(st, 1, "router dlogits", s);
        if (dense_dx) {
            const float *dxr = (const float *)(xbase + w.dxr);
            SMOE_FORWARD_IF_ERROR(smoe_cuda_stack_twice((const bf16 *)args->router_w, d->E,
                                                        d->d, (bf16 *)(rbase + w.wr2), abort,
                                                        s));
            /* dXr (T x d row-major = d x T col-major) = wr2^T-view . split^T-view,
             * a chunk of w.dxr_tokens tokens at a time through the prologue's
             * pointers (slot triple i: chunk i), each chunk then into dx */
            const size_t dx_es = smoe_dtype_size(args->dx.dtype);
            void **sp = (void **)(ws + w.slots);
            for (int64_t i = 0; i < nchunks; i++) {
                const int64_t t0 = i * w.dxr_tokens;
                const int64_t tn = T - t0 < w.dxr_tokens ? T - t0 : w.dxr_tokens;
                SMOE_FORWARD_IF_ERROR(smoe_cuda_gemm_bf16_f32_dev(
                    st, NULL, s, CUBLAS_OP_N, CUBLAS_OP_N, d->d, tn, E2,
                    (const void *const *)(sp + 3 * i), d->d, (const void *const *)(sp + 3 * i + 1),
                    E2, sp + 3 * i + 2, d->d));
                SMOE_FORWARD_IF_ERROR(smoe_cuda_aggregate_backward(
                    tn, d->d, v.token_offset + t0, k_uniform, v.assign_row + t0 * k_uniform,
                    dxt, dxr, NULL, v.assign_expert + t0 * k_uniform, NULL, 0, NULL,
                    (char *)args->dx.ptr + (size_t)t0 * (size_t)d->d * dx_es, args->dx.dtype,
                    args->dx.accumulate, abort, s));
            }
            timer_mark(st, 1, "dXr gemm + aggregate dx", s);
        }
    }
    if (want_dx && !dense_dx)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_aggregate_backward(
            T, d->d, v.token_offset, k_uniform, v.assign_row, dxt, NULL, dla, v.assign_expert,
            dla ? (const bf16 *)args->router_w : NULL, d->E, wr_nf, args->dx.ptr, args->dx.dtype,
            args->dx.accumulate, abort, s));
    timer_mark(st, 1, "aggregate dx", s);
    if (want_router && args->drouter_w.ptr) {
        /* after the dx aggregation: dX~'s region is dead (rscr); drouter_w
         * may be the consumed block's router slot (smoe_cuda_drouter_slot),
         * which split, the GEMM's one read in the router region, precedes */
        float *dwr2 = (float *)(ws + w.dwr2);
        /* dWr2 (2E x d row-major = d x 2E col-major) = X^T . split */
        SMOE_FORWARD_IF_ERROR(smoe_cuda_gemm_bf16_f32(
            st, ws + w.rscr, s, CUBLAS_OP_N, CUBLAS_OP_T, d->d, E2, T, (const bf16 *)args->x,
            d->d, (const bf16 *)(rbase + w.split), E2, dwr2, d->d));
        SMOE_FORWARD_IF_ERROR(smoe_cuda_combine_halves(dwr2, d->E, d->d, args->drouter_w.ptr,
                                                       args->drouter_w.dtype,
                                                       args->drouter_w.accumulate, abort, s));
        timer_mark(st, 1, "dWr gemm", s);
    }
    if (general && args->dpair_score.ptr)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_pair_score_grad(
            args->pairs, v.token_offset + T, v.assign_row, ds, (float *)args->dpair_score.ptr,
            args->dpair_score.accumulate, abort, s));
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ the calls */

/* A forward (f) or a backward (b) on the layer's device, timed by stage
 * when the stage timer is on. */
static smoe_status run_call(smoe_layer *layer, const smoe_forward_args *f,
                            const smoe_backward_args *b, const smoe_saved_layout *sl,
                            void *saved, void *workspace, void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(smoe_cuda_dev_enter(st, &g));
    timer_begin(st, (cudaStream_t)stream);
    smoe_status r = f ? forward_impl(layer, f, sl, saved, workspace, (cudaStream_t)stream)
                      : backward_impl(layer, b, sl, saved, workspace, (cudaStream_t)stream);
    if (r == SMOE_SUCCESS) timer_end(st, f ? 0 : 1);
    smoe_cuda_dev_leave(&g);
    return r;
}

smoe_status smoe_cuda_forward(smoe_layer *layer, const smoe_forward_args *args,
                              const smoe_saved_layout *sl, void *saved, void *workspace,
                              void *stream)
{
    return run_call(layer, args, NULL, sl, saved, workspace, stream);
}

smoe_status smoe_cuda_backward(smoe_layer *layer, const smoe_backward_args *args,
                               const smoe_saved_layout *sl, void *saved, void *workspace,
                               void *stream)
{
    return run_call(layer, NULL, args, sl, saved, workspace, stream);
}

/* ------------------------------------------------------------ parts */

/* The expert-parallel layer's chunked schedule (cuda_layer.h). */
smoe_cuda_gemms smoe_cuda_layer_gemms(const smoe_layer *layer, int64_t cap)
{
    const cuda_state *st = (const cuda_state *)layer->state;
    const smoe_gemm_ops *h = st->tab90, *q = &smoe_gemm_ops_sm80;
    smoe_cuda_gemms g;
    memset(&g, 0, sizeof g);
    g.ops = *q;
    g.ops.name = NULL;
    if (st->use90[OP_UP]) g.ops.up = h->up;
    if (st->use90[OP_DOWN]) g.ops.down = h->down;
    if (st->use90[OP_DH]) g.ops.dh = h->dh;
    if (st->use90[OP_DW2]) g.ops.dw2 = h->dw2;
    if (st->use90[OP_DXT]) g.ops.dxt = h->dxt;
    if (st->use90[OP_DW1]) g.ops.dw1 = h->dw1;
    g.views = st->use90[OP_UP] && st->use90[OP_DOWN] && st->use90[OP_DH] && st->use90[OP_DXT];
    g.problem = smoe_cuda_problem_make(layer, cap);
    g.scratch_bytes = gemm_scratch(layer, &g.problem);
    g.num_sms = st->num_sms;
    return g;
}
