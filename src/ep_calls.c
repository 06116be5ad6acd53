/*
 * ep_calls.c -- the expert-parallel layer's calls (smoe_ep_layer_forward,
 * smoe_ep_layer_backward) and their memory sizes: each rank's checks, then
 * the CUDA path (src/cuda/ep_cuda.cu) or, on the CPU backend, the steps of
 * ep.c's overview here, over the in-process group (ep_group.c): the saved
 * block's and workspace's layouts, dispatch, exchanges, the experts'
 * GENERAL layer, the partial sums and the router's backward.
 */
#include "ep_internal.h"
#include "cpu/cpu_backend.h"
#include "routing.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ layouts */

/* Scores and logits in the layer's fp32 intermediates (double for F64), as
 * the CPU backend's saved block keeps them. */
static size_t fsize(const smoe_ep_layer *ep) { return ep->desc.layer.dtype == SMOE_DTYPE_F64 ? 8 : 4; }

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

/* Does the backward read the fp32 logits (T, E)? The modes whose router
 * backward differentiates a function of the logits beyond the saved
 * scores (token rounding is refused here). */
static int ep_saves_logits(const smoe_layer_desc *L)
{
    return L->routing == SMOE_ROUTING_SOFTMAX_TOPK || L->routing == SMOE_ROUTING_SIGMOID_TOPK;
}

/* One pair of a slot: the local expert (-1: none) and the score. */
typedef struct ep_pair {
    int32_t e;
    int32_t pad;
    double s;
} ep_pair;

/* The saved block: source side (this rank's tokens), expert side. */
typedef struct ep_saved {
    size_t header, token_offset, assign_expert, assign_row, score, logits, slot, counts,
        tri_slot, experts, xkeep;
    size_t total;
    int64_t A;             /* assignments of this rank's tokens (capacity) */
    smoe_saved_layout ex;  /* the GENERAL layer's block, at `experts` */
} ep_saved;

static int64_t assignments(const smoe_ep_layer *ep, int64_t T, int64_t pairs)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    return L->routing == SMOE_ROUTING_GENERAL ? pairs : T * L->K;
}

static void saved_make(const smoe_ep_layer *ep, int64_t T, int64_t pairs, ep_saved *s)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const size_t t = (size_t)T, E = (size_t)L->E, P = (size_t)ep->P, fs = fsize(ep);
    const int64_t A = assignments(ep, T, pairs);
    size_t o = 0;
    memset(s, 0, sizeof *s);
    s->A = A;
    s->header = o; o += al(sizeof(smoe_saved_header));
    s->token_offset = o; o += al((t + 1) * 4);
    s->assign_expert = o; o += al((size_t)A * 2);
    s->assign_row = o; o += al((size_t)A * 4);
    s->score = o; o += al((size_t)A * fs);
    s->logits = o; o += al(ep_saves_logits(L) ? t * E * fs : 0);
    s->slot = o; o += al(t * P * 4);
    s->counts = o; o += al(2 * P * 8 + 8); /* sent (P), received (P), expert pairs */
    s->tri_slot = o; o += al((size_t)ep->rows * 4);
    s->experts = o;
    smoe_saved_layout_make(ep->experts, P * (size_t)ep->C, ep->rows, &s->ex);
    o += al(s->ex.total);
    /* keep_x: the received rows of x, (P C, d) */
    const size_t xrow = (size_t)L->d * smoe_dtype_size(L->dtype);
    s->xkeep = o; o += al(ep->desc.keep_x ? P * (size_t)ep->C * xrow : 0);
    s->total = o;
}

/* The workspace: exchange buffers, then the GENERAL layer's workspace. */
typedef struct ep_ws {
    size_t meta; /* the saved block's source-side sections, until the call succeeds */
    size_t xd, xb, l32, l64, route, ascore, send_rows, recv_rows, send_pairs, recv_pairs, part,
        part_recv, pt, pe, ps, dps, dsd, kq, dl, rp, ridx, rl32, experts;
    size_t total;
} ep_ws;

static void ws_make(const smoe_ep_layer *ep, int64_t T, int64_t pairs, ep_ws *w)
{
    const smoe_layer_desc *L = &ep->desc.layer;
    const size_t t = (size_t)T, d = (size_t)L->d, E = (size_t)L->E, P = (size_t)ep->P;
    const size_t C = (size_t)ep->C, Km = (size_t)ep->Kmax, es = smoe_dtype_size(L->dtype);
    const size_t A = (size_t)assignments(ep, T, pairs), rows = (size_t)ep->rows;
    ep_saved S;
    saved_make(ep, T, pairs, &S);
    size_t o = 0;
    memset(w, 0, sizeof *w);
    w->meta = o; o += al(S.experts);
    w->xd = o; o += al(t * d * 8);
    w->xb = o; o += al(t * d * 8);
    w->l32 = o; o += al(t * E * 4);
    w->l64 = o; o += al(t * E * 8);
    w->route = o; o += al(smoe_route_scratch_bytes(L, T > 0 ? T : 1, 0));
    w->ascore = o; o += al(A * 8);
    w->send_rows = o; o += al(P * C * 2 * d * es); /* [x | dout] in backward */
    w->recv_rows = o; o += al(P * C * 2 * d * es);
    w->send_pairs = o; o += al(P * C * Km * sizeof(ep_pair));
    w->recv_pairs = o; o += al(P * C * Km * sizeof(ep_pair));
    w->part = o; o += al(P * C * d * es);
    w->part_recv = o; o += al(P * C * d * es);
    w->pt = o; o += al(rows * 4);
    w->pe = o; o += al(rows * 4);
    w->ps = o; o += al(rows * 4);
    w->dps = o; o += al(rows * 4);
    w->dsd = o; o += al(A * 8);
    w->kq = o; o += al(P * 4);
    w->dl = o; o += al(t * E * 8);
    w->rp = o; o += al(3 * E * 8);
    w->ridx = o; o += al((size_t)L->K * 4 + 4);
    w->rl32 = o; o += al(E * 4);
    w->experts = o;
    o += al(smoe_layer_workspace_bytes(ep->experts, (int64_t)(P * C) > 0 ? (int64_t)(P * C) : 1,
                                       (int64_t)rows));
    w->total = o;
}

static smoe_status ep_sizes(const smoe_ep_layer *ep, const char *fn, int64_t T, int64_t pairs)
{
    SMOE_RETURN_ERROR_IF(T < 0 || T > ep->desc.max_tokens, SMOE_ERROR_INVALID_SIZE,
                         "%s: T = %lld, must be in [0, max_tokens = %lld]", fn, (long long)T,
                         (long long)ep->desc.max_tokens);
    if (ep->desc.layer.routing == SMOE_ROUTING_GENERAL)
        SMOE_RETURN_ERROR_IF(pairs < 0 || pairs > T * ep->desc.layer.E, SMOE_ERROR_INVALID_SIZE,
                             "%s: pairs = %lld, must be in [0, T*E = %lld]", fn,
                             (long long)pairs, (long long)(T * ep->desc.layer.E));
    return SMOE_SUCCESS;
}

/* The size queries' common part: the layer and T checked (0 with the
 * reason recorded otherwise), and the pairs they size for: GENERAL's worst
 * case (T*E), else 0. */
static int ep_size_query(const smoe_ep_layer *ep, const char *fn, int64_t T, int64_t *pairs)
{
    if (!ep) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "%s: layer is NULL", fn);
        return 0;
    }
    if (ep_sizes(ep, fn, T, 0) != SMOE_SUCCESS) return 0;
    *pairs = ep->desc.layer.routing == SMOE_ROUTING_GENERAL ? T * ep->desc.layer.E : 0;
    return 1;
}

size_t smoe_ep_layer_workspace_bytes(const smoe_ep_layer *ep, int64_t T)
{
    int64_t pairs;
    if (!ep_size_query(ep, "smoe_ep_layer_workspace_bytes", T, &pairs)) return 0;
#ifdef SMOE_WITH_CUDA
    if (ep->desc.layer.backend != SMOE_BACKEND_CPU)
        return smoe_ep_cuda_workspace_bytes(ep, T, pairs);
#endif
    ep_ws w;
    ws_make(ep, T, pairs, &w);
    return w.total;
}

size_t smoe_ep_layer_saved_bytes(const smoe_ep_layer *ep, int64_t T)
{
    int64_t pairs;
    if (!ep_size_query(ep, "smoe_ep_layer_saved_bytes", T, &pairs)) return 0;
#ifdef SMOE_WITH_CUDA
    if (ep->desc.layer.backend != SMOE_BACKEND_CPU) return smoe_ep_cuda_saved_bytes(ep, T, pairs);
#endif
    ep_saved s;
    saved_make(ep, T, pairs, &s);
    return s.total;
}

/* ------------------------------------------------------------ helpers */

static double ld_val(const void *p, smoe_dtype t, int64_t i)
{
    if (t == SMOE_DTYPE_F64) return ((const double *)p)[i];
    if (t == SMOE_DTYPE_F32) return (double)((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}

static void st_val(void *p, smoe_dtype t, int64_t i, double v)
{
    if (t == SMOE_DTYPE_F64) {
        ((double *)p)[i] = v;
    } else if (t == SMOE_DTYPE_F32) {
        ((float *)p)[i] = (float)v;
    } else {
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u; /* NaN stays NaN */
        else u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    }
}

/* The received rows (P slices of C slots; slice s holds recvd[s] real
 * ones) into dst, `row` bytes each, read at byte `off` of each src_row-byte
 * received row; the slots past a slice's count zeroed. */
static void slots_copy(char *dst, const char *src, size_t src_row, size_t off, int P, int64_t C,
                       const int64_t *recvd, size_t row)
{
    for (int s = 0; s < P; s++)
        for (int64_t j = 0; j < C; j++) {
            const size_t vt = (size_t)s * (size_t)C + (size_t)j;
            if (j < recvd[s]) memcpy(dst + vt * row, src + vt * src_row + off, row);
            else memset(dst + vt * row, 0, row);
        }
}

static void put_f(const smoe_ep_layer *ep, void *p, int64_t i, double v)
{
    if (fsize(ep) == 8) ((double *)p)[i] = v;
    else ((float *)p)[i] = (float)v;
}

/* The saved-view shape the CPU router backward reads, over this rank's
 * tokens: assignments in token-major order, row = assignment. */
static smoe_saved_view source_view(const ep_saved *s, char *base)
{
    smoe_saved_view v;
    memset(&v, 0, sizeof v);
    v.header = (smoe_saved_header *)(base + s->header);
    v.token_offset = (int32_t *)(base + s->token_offset);
    v.assign_expert = (uint16_t *)(base + s->assign_expert);
    v.assign_row = (int32_t *)(base + s->assign_row);
    v.row_score = (float *)(base + s->score);
    v.logits = (float *)(base + s->logits);
    return v;
}

/* What the single layer's checks of a call need to know of this one: the
 * rank's experts, T = 0 allowed, the saved block's and workspace's sizes
 * (the backend's) and the functions that give them; S and W are the CPU
 * path's layouts. */
static smoe_call_shape ep_call_shape(const smoe_ep_layer *ep, int64_t T, int64_t pairs,
                                     ep_saved *S, ep_ws *W)
{
    smoe_call_shape cs;
    saved_make(ep, T, pairs, S);
    ws_make(ep, T, pairs, W);
    memset(&cs, 0, sizeof cs);
    cs.E_experts = ep->El;
    cs.empty_ok = 1;
    cs.saved_need = S->total;
    cs.ws_need = W->total;
#ifdef SMOE_WITH_CUDA
    if (ep->desc.layer.backend != SMOE_BACKEND_CPU) {
        cs.saved_need = smoe_ep_cuda_saved_bytes(ep, T, pairs);
        cs.ws_need = smoe_ep_cuda_workspace_bytes(ep, T, pairs);
    }
#endif
    cs.saved_query = "smoe_ep_layer_saved_bytes";
    cs.ws_query = "smoe_ep_layer_workspace_bytes";
    return cs;
}

/* ------------------------------------------------------------ forward */

smoe_status smoe_ep_layer_forward(smoe_ep_layer *ep, const smoe_forward_args *args, void *saved,
                                  size_t saved_bytes, void *workspace, size_t workspace_bytes,
                                  void *stream)
{
    const char *fn = "smoe_ep_layer_forward";
    (void)stream;
    SMOE_REQUIRE_PTR(ep, "layer");
    smoe_ep_group *g = ep->desc.group;
    const int P = ep->P, r = ep->r;
    const smoe_layer_desc *L = &ep->desc.layer;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int64_t d = L->d, E = L->E, El = ep->El, C = ep->C, Km = ep->Kmax;
    const smoe_dtype dt = L->dtype;
    const size_t es = smoe_dtype_size(dt);

    /* 0. this rank's checks; every rank's verdict */
    smoe_status st = SMOE_SUCCESS;
    ep_saved S;
    ep_ws W;
    if (!args) st = smoe_fail(SMOE_ERROR_NULL_POINTER, "%s: args is NULL", fn);
    else if (args->inference != 0 && args->inference != 1)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: args.inference = %d, must be 0 or 1", fn,
                       args->inference);
    else st = ep_sizes(ep, fn, args->T, general ? args->pairs : 0);
    if (st == SMOE_SUCCESS) {
        const smoe_call_shape cs =
            ep_call_shape(ep, args->T, general ? args->pairs : 0, &S, &W);
        st = smoe_forward_validate(ep->full, fn, args, &cs, saved, saved_bytes, workspace,
                                   workspace_bytes);
    }
#ifdef SMOE_WITH_CUDA
    if (L->backend != SMOE_BACKEND_CPU) {
        SMOE_FORWARD_IF_ERROR(st);
        return smoe_ep_cuda_forward(ep, args, saved, workspace, stream);
    }
#endif
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    const int64_t T = args->T;
    const int training = !args->inference;
    char *ws = (char *)workspace;
    /* the source side's metadata goes to the workspace first and into the
     * saved block once every rank succeeded: a refused call writes nothing */
    char *meta = ws + W.meta;
    smoe_saved_view v = source_view(&S, meta);
    double *xd = (double *)(ws + W.xd);
    int32_t *slot = (int32_t *)(meta + S.slot);
    int64_t *counts = (int64_t *)(meta + S.counts); /* sent[P], received[P], expert pairs */

    /* 1. routing of this rank's tokens (or the caller's triples) */
    for (int64_t i = 0; i < T * d; i++) xd[i] = ld_val(args->x, dt, i);
    int64_t A;
    double *ascore = (double *)(ws + W.ascore);
    float *l32 = (float *)(ws + W.l32);
    double *l64 = (double *)(ws + W.l64);
    st = SMOE_SUCCESS;
    if (!general) {
        smoe_cpu_router_logits(ep->full, T, xd, args->router_w, l32, l64);
        smoe_assignments as;
        as.token_offset = v.token_offset;
        as.expert = v.assign_expert;
        as.score = ascore;
        as.cap = S.A;
        as.R = 0;
        v.token_offset[0] = 0;
        if (T > 0)
            st = smoe_route_assign(L, T, 0, l32, dt == SMOE_DTYPE_F64 ? l64 : NULL,
                                   args->expert_bias, ws + W.route, &as);
        A = T * L->K;
        if (training && ep_saves_logits(L))
            for (int64_t i = 0; i < T * E; i++)
                put_f(ep, v.logits, i, dt == SMOE_DTYPE_F64 ? l64[i] : (double)l32[i]);
    } else {
        A = args->pairs;
        for (int64_t t = 0; t <= T; t++) v.token_offset[t] = 0;
        for (int64_t a = 0; a < A; a++) {
            v.token_offset[args->pair_token[a] + 1]++;
            v.assign_expert[a] = (uint16_t)args->pair_expert[a];
            ascore[a] = (double)args->pair_score[a];
        }
        for (int64_t t = 0; t < T; t++) v.token_offset[t + 1] += v.token_offset[t];
    }
    for (int64_t a = 0; a < A; a++) {
        v.assign_row[a] = (int32_t)a;
        put_f(ep, v.row_score, a, fsize(ep) == 8 ? ascore[a] : (double)(float)ascore[a]);
    }

    /* 2. dispatch: slots and pairs per destination rank */
    int64_t *sent = counts, *recvd = counts + P;
    ep_pair *spairs = (ep_pair *)(ws + W.send_pairs);
    char *srows = ws + W.send_rows;
    for (int q = 0; q < P; q++) sent[q] = 0;
    for (int64_t i = 0; i < (int64_t)P * C * Km; i++) {
        spairs[i].e = -1;
        spairs[i].pad = 0;
        spairs[i].s = 0.0;
    }
    memset(srows, 0, (size_t)P * (size_t)C * (size_t)d * es);
    int overflow = -1;
    for (int64_t t = 0; t < T && st == SMOE_SUCCESS; t++) {
        for (int q = 0; q < P; q++) slot[t * P + q] = -1;
        for (int32_t a = v.token_offset[t]; a < v.token_offset[t + 1]; a++) {
            const int q = (int)(v.assign_expert[a] / El);
            if (slot[t * P + q] < 0) {
                if (sent[q] >= C) { /* counted, not placed: the call fails below */
                    if (overflow < 0) overflow = q;
                    sent[q]++;
                    continue;
                }
                slot[t * P + q] = (int32_t)sent[q]++;
                memcpy(srows + ((size_t)q * C + (size_t)slot[t * P + q]) * (size_t)d * es,
                       (const char *)args->x + (size_t)t * (size_t)d * es, (size_t)d * es);
            }
            ep_pair *pp = spairs + ((size_t)q * C + (size_t)slot[t * P + q]) * (size_t)Km;
            int64_t k = 0;
            while (k < Km && pp[k].e >= 0) k++;
            pp[k].e = (int32_t)(v.assign_expert[a] - (int64_t)q * El);
            pp[k].s = fsize(ep) == 8 ? ascore[a] : (double)(float)ascore[a];
        }
    }
    if (st == SMOE_SUCCESS && overflow >= 0)
        st = smoe_fail(SMOE_ERROR_INVALID_SIZE,
                       "%s: rank %d sends %lld rows to rank %d, more than capacity = %lld; "
                       "nothing written",
                       fn, r, (long long)sent[overflow], overflow, (long long)C);
    /* 3. counts, rows and pairs out: an overflow anywhere stops every rank */
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    smoe_ep_group_alltoall(g, r, sent, recvd, 8);
    smoe_ep_group_alltoall(g, r, srows, ws + W.recv_rows, (size_t)C * (size_t)d * es);
    smoe_ep_group_alltoall(g, r, spairs, ws + W.recv_pairs,
                           (size_t)C * (size_t)Km * sizeof(ep_pair));

    /* 4. the expert side: virtual tokens v = source * C + slot */
    const ep_pair *rpairs = (const ep_pair *)(ws + W.recv_pairs);
    int32_t *pt = (int32_t *)(ws + W.pt), *pe = (int32_t *)(ws + W.pe);
    float *ps = (float *)(ws + W.ps);
    int32_t *tri_slot = (int32_t *)(meta + S.tri_slot);
    int64_t rows = 0;
    for (int s = 0; s < P; s++)
        for (int64_t j = 0; j < recvd[s]; j++)
            for (int64_t k = 0; k < Km; k++) {
                const ep_pair *pp = rpairs + ((size_t)s * C + (size_t)j) * (size_t)Km + k;
                if (pp->e < 0) continue;
                if (rows < ep->rows) {
                    pt[rows] = (int32_t)(s * C + j);
                    pe[rows] = pp->e;
                    ps[rows] = (float)pp->s;
                    tri_slot[rows] = (int32_t)(((int64_t)s * C + j) * Km + k);
                }
                rows++;
            }
    counts[2 * P] = rows;
    if (rows > ep->rows)
        st = smoe_fail(SMOE_ERROR_INVALID_SIZE,
                       "%s: rank %d computes %lld (row, expert) pairs, more than expert_rows = "
                       "%lld; nothing written",
                       fn, r, (long long)rows, (long long)ep->rows);
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    const int64_t Tv = (int64_t)P * C;
    char *part = ws + W.part;
    if (Tv > 0) {
        smoe_forward_args ea;
        memset(&ea, 0, sizeof ea);
        ea.T = Tv;
        ea.x = ws + W.recv_rows;
        ea.pairs = rows;
        ea.pair_token = pt;
        ea.pair_expert = pe;
        ea.pair_score = ps;
        ea.w1 = args->w1; ea.b1 = args->b1; ea.w2 = args->w2; ea.b2 = args->b2;
        ea.out = part;
        ea.inference = args->inference;
        smoe_saved_layout el;
        smoe_saved_layout_make(ep->experts, Tv, rows, &el);
        /* the backend directly: the arguments were checked above (the
         * expert block's header stays the GENERAL layer's own) */
        st = ep->experts->ops->forward(ep->experts, &ea, &el,
                                       training ? (char *)saved + S.experts : NULL,
                                       ws + W.experts, NULL);
    }
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));

    /* 5. the partials back, summed per token in rank order */
    char *prec = ws + W.part_recv;
    smoe_ep_group_alltoall(g, r, part, prec, (size_t)C * (size_t)d * es);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < d; i++) {
            double o = 0.0;
            for (int q = 0; q < P; q++) {
                const int32_t j = slot[t * P + q];
                if (j >= 0) o += ld_val(prec, dt, ((int64_t)q * C + j) * d + i);
            }
            st_val(args->out, dt, t * d + i, o);
        }
    if (!general && args->router_logits)
        smoe_cpu_put_logits(args->router_logits, args->router_logits_dtype, l32, T * E);
    if (args->expert_counts) {
        for (int64_t e = 0; e < E; e++) args->expert_counts[e] = 0;
        for (int64_t a = 0; a < A; a++) args->expert_counts[v.assign_expert[a]]++;
    }
    if (training) {
        /* keep_x: the received rows of x, as the backward's own copy has them */
        if (ep->desc.keep_x)
            slots_copy((char *)saved + S.xkeep, ws + W.recv_rows, (size_t)d * es, 0, P, C, recvd,
                       (size_t)d * es);
        /* the source side's sections, then the header last */
        memcpy((char *)saved + S.token_offset, meta + S.token_offset, S.experts - S.token_offset);
        *(smoe_saved_header *)((char *)saved + S.header) =
            smoe_saved_header_make(ep->full, T, general ? args->pairs : 0);
    }
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ backward */

smoe_status smoe_ep_layer_backward(smoe_ep_layer *ep, const smoe_backward_args *args,
                                   const void *saved, size_t saved_bytes, void *workspace,
                                   size_t workspace_bytes, void *stream)
{
    const char *fn = "smoe_ep_layer_backward";
    (void)stream;
    SMOE_REQUIRE_PTR(ep, "layer");
    smoe_ep_group *g = ep->desc.group;
    const int P = ep->P, r = ep->r;
    const smoe_layer_desc *L = &ep->desc.layer;
    const int general = L->routing == SMOE_ROUTING_GENERAL;
    const int64_t d = L->d, E = L->E, C = ep->C, Km = ep->Kmax;
    const smoe_dtype dt = L->dtype;
    const size_t es = smoe_dtype_size(dt);

    smoe_status st = SMOE_SUCCESS;
    ep_saved S;
    ep_ws W;
    if (!args) st = smoe_fail(SMOE_ERROR_NULL_POINTER, "%s: args is NULL", fn);
    else st = ep_sizes(ep, fn, args->T, general ? args->pairs : 0);
    if (st == SMOE_SUCCESS) {
        const smoe_call_shape cs =
            ep_call_shape(ep, args->T, general ? args->pairs : 0, &S, &W);
        st = smoe_backward_validate(ep->full, fn, args, &cs, saved, saved_bytes, workspace,
                                    workspace_bytes, 0);
    }
#ifdef SMOE_WITH_CUDA
    if (L->backend != SMOE_BACKEND_CPU) {
        /* the saved block's header is checked on the device */
        SMOE_FORWARD_IF_ERROR(st);
        return smoe_ep_cuda_backward(ep, args, saved, workspace, stream);
    }
#endif
    if (st == SMOE_SUCCESS)
        st = smoe_saved_header_check(ep->full, (const smoe_saved_header *)((const char *)saved + S.header),
                                     args->T, general ? args->pairs : 0);
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    const int64_t T = args->T;
    char *ws = (char *)workspace;
    char *sb = (char *)(uintptr_t)saved;
    smoe_saved_view v = source_view(&S, sb);
    const int32_t *slot = (const int32_t *)(sb + S.slot);
    const int64_t *counts = (const int64_t *)(sb + S.counts);
    const int64_t *recvd = counts + P, rows = counts[2 * P];
    const int32_t *tri_slot = (const int32_t *)(sb + S.tri_slot);
    const int64_t Tv = (int64_t)P * C;

    /* 1. [x | dout] out again, by the forward's slots (keep_x: dout alone,
     *    x' is the saved block's) */
    const int kx = ep->desc.keep_x;
    char *srows = ws + W.send_rows, *rrows = ws + W.recv_rows;
    const size_t row = (size_t)d * es, row2 = (kx ? 1 : 2) * row;
    memset(srows, 0, (size_t)Tv * row2);
    for (int64_t t = 0; t < T; t++)
        for (int q = 0; q < P; q++) {
            const int32_t j = slot[t * P + q];
            if (j < 0) continue;
            char *dst = srows + ((size_t)q * C + (size_t)j) * row2;
            if (!kx) memcpy(dst, (const char *)args->x + (size_t)t * row, row);
            memcpy(dst + row2 - row, (const char *)args->dout + (size_t)t * row, row);
        }
    smoe_ep_group_alltoall(g, r, srows, rrows, (size_t)C * row2);
    /* split into x' (Tv, d) and dout' (Tv, d): the GENERAL layer reads rows */
    char *xv = kx ? sb + S.xkeep : ws + W.send_rows;
    char *dov = ws + W.send_rows + (size_t)Tv * row;
    if (!kx) slots_copy(xv, rrows, row2, 0, P, C, recvd, row);
    slots_copy(dov, rrows, row2, row2 - row, P, C, recvd, row);

    /* 2. the expert side's backward: dx' per virtual token, dS per pair,
     *    this rank's weight gradients */
    char *dxv = ws + W.part;
    float *dps = (float *)(ws + W.dps);
    if (Tv > 0) {
        smoe_backward_args eb;
        memset(&eb, 0, sizeof eb);
        eb.T = Tv;
        eb.x = xv;
        eb.pairs = rows;
        eb.w1 = args->w1; eb.w2 = args->w2; eb.b2 = args->b2;
        eb.dout = dov;
        eb.dx = (smoe_grad){dxv, dt, 0};
        eb.dw1 = args->dw1; eb.db1 = args->db1; eb.dw2 = args->dw2; eb.db2 = args->db2;
        eb.dpair_score = (smoe_grad){rows ? dps : NULL, SMOE_DTYPE_F32, 0};
        smoe_saved_layout el;
        smoe_saved_layout_make(ep->experts, Tv, rows, &el);
        st = ep->experts->ops->backward(ep->experts, &eb, &el, sb + S.experts, ws + W.experts,
                                        NULL);
    }
    st = smoe_ep_agree(g, r, st, fn);
    SMOE_FORWARD_IF_ERROR(st);

    /* 3. back: the dx partials, and the dS of each slot's pairs */
    char *dxr = ws + W.part_recv;
    smoe_ep_group_alltoall(g, r, dxv, dxr, (size_t)C * (size_t)d * es);
    ep_pair *sp = (ep_pair *)(ws + W.send_pairs), *rp = (ep_pair *)(ws + W.recv_pairs);
    for (int64_t i = 0; i < Tv * Km; i++) {
        sp[i].e = -1;
        sp[i].s = 0.0;
    }
    for (int64_t i = 0; i < rows; i++) {
        sp[tri_slot[i]].e = 0;
        sp[tri_slot[i]].s = (double)dps[i];
    }
    smoe_ep_group_alltoall(g, r, sp, rp, (size_t)C * (size_t)Km * sizeof(ep_pair));

    /* 4. this rank's tokens: dS per assignment (its k-th pair on rank q is
     *    the k-th of the token's assignments with an expert on q), dx */
    double *ds = (double *)(ws + W.dsd);
    int32_t *kq = (int32_t *)(ws + W.kq); /* pairs seen per rank, per token */
    for (int64_t t = 0; t < T; t++) {
        for (int q = 0; q < P; q++) kq[q] = 0;
        for (int32_t a = v.token_offset[t]; a < v.token_offset[t + 1]; a++) {
            const int q = (int)(v.assign_expert[a] / ep->El);
            const int32_t j = slot[t * P + q];
            ds[a] = rp[((size_t)q * C + (size_t)j) * (size_t)Km + (size_t)kq[q]].s;
            kq[q]++;
        }
    }
    double *dxd = (double *)(ws + W.xd); /* dx in double: partials, then the router */
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < d; i++) {
            double o = 0.0;
            for (int q = 0; q < P; q++) {
                const int32_t j = slot[t * P + q];
                if (j >= 0) o += ld_val(dxr, dt, ((int64_t)q * C + j) * d + i);
            }
            dxd[t * d + i] = o;
        }
    if (!general) {
        double *xbuf = (double *)(ws + W.xb);
        for (int64_t i = 0; i < T * d; i++) xbuf[i] = ld_val(args->x, dt, i);
        double *dl = (double *)(ws + W.dl);
        smoe_cpu_router_scratch rs = {(double *)(ws + W.rp), (int32_t *)(ws + W.ridx),
                                      (float *)(ws + W.rl32)};
        smoe_cpu_router_backward(ep->full, T, &v, ds, args->dlogits_extra,
                                 args->dlogits_extra_dtype, xbuf, &args->drouter_w, dl, &rs);
        for (int64_t t = 0; t < T && args->dx.ptr; t++)
            smoe_cpu_router_dx(ep->full, dl + t * E, args->router_w, dxd + t * d);
    } else if (args->dpair_score.ptr) {
        float *g0 = (float *)args->dpair_score.ptr;
        for (int64_t a = 0; a < v.token_offset[T]; a++)
            g0[a] = args->dpair_score.accumulate ? g0[a] + (float)ds[a] : (float)ds[a];
    }
    if (args->dx.ptr)
        for (int64_t i = 0; i < T * d; i++) {
            double o = dxd[i];
            if (args->dx.accumulate) o += ld_val(args->dx.ptr, args->dx.dtype, i);
            st_val(args->dx.ptr, args->dx.dtype, i, o);
        }
    return SMOE_SUCCESS;
}
