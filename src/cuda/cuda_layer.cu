/*
 * cuda_layer.cu -- the CUDA backend of the layer (SMOE_BACKEND_CUDA and
 * SMOE_BACKEND_SM90): device checks and the cuBLAS handle at create time,
 * the workspace layout, and the forward / backward orchestration of
 * DESIGN.md sections 4 and 5:
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
 * create (plans_make); path_name lists which family runs each op.
 *
 * Debugging: SMOE_CUDA_TIMING=1 in the environment at create time times
 * every stage with CUDA events (and waits at the end of each call) and
 * prints the means when the layer is freed; bench --stages uses it.
 *
 * Nothing here synchronises with the host or allocates: every buffer is
 * carved from the caller's workspace (cuBLAS's too, so a graph capture has
 * nothing to allocate), grids are sized for the row capacity, and the row
 * count stays on the device. smoe_layer_device_status is the one exception
 * (with wait = 1 it waits for the stream).
 *
 * Device-side checks (cuda_common.h, "device status"): a call's status word
 * sits at the start of its workspace; every kernel after a check takes its
 * code as `abort`. The layer's report record (a claim word in device memory,
 * the record in mapped page-locked memory) is made at create time.
 *
 * Threads: the layer's state is read-only during calls except the cuBLAS
 * handle, which is bound to the call's stream and workspace under a mutex
 * for each dense GEMM, so one layer serves several threads and streams.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_common.h"
#include "cuda/cuda_layer.h"

#define CUBLAS_WS_BYTES ((size_t)8 << 20)

/* the six GEMMs, gemm.h's indices */
enum {
    OP_UP = SMOE_GEMM_UP,
    OP_DOWN = SMOE_GEMM_DOWN,
    OP_DH = SMOE_GEMM_DH,
    OP_DW2 = SMOE_GEMM_DW2,
    OP_DXT = SMOE_GEMM_DXT,
    OP_DW1 = SMOE_GEMM_DW1,
    OP_COUNT = SMOE_GEMM_COUNT
};

typedef struct cuda_state {
    int device;
    int sm; /* major * 10 + minor */
    int num_sms;
    cublasHandle_t cublas;
    pthread_mutex_t cublas_lock; /* held while the handle is bound and used */
    const smoe_gemm_ops *tab90; /* NULL: portable only */
    int use90[OP_COUNT];        /* this op runs the Hopper kernel (fixed at create) */
    smoe_gemm_plan plan;        /* each op's tile row in its family's table (create) */
    int *claim;                 /* device memory: the report's claim word */
    smoe_dev_mapped *rec_host;  /* mapped page-locked record, host address */
    smoe_dev_mapped *rec_dev;   /* ... its device address */
    struct stage_timer *timer;  /* SMOE_CUDA_TIMING=1 only */
} cuda_state;

/* ------------------------------------------------------------ stage timing */

/* A debugging aid, off unless the environment has SMOE_CUDA_TIMING=1 when
 * the layer is created: CUDA events between the stages of every call, the
 * call then waits for its last event (so: not for graph capture or
 * production), and the mean time of each stage is printed to stderr when
 * the layer is freed. The benchmark's --stages uses it. */
#define MAX_STAGES 16

typedef struct stage_timer {
    cudaEvent_t ev[MAX_STAGES + 1];
    int n;
    const char *name[2][MAX_STAGES];
    double ms[2][MAX_STAGES];
    int nst[2];
    long calls[2];
} stage_timer;

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

static void timer_report(const smoe_layer *layer, stage_timer *tm)
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
    size_t status, cublas;
    /* forward */
    size_t logits, assign_token, assign_score, assign_count;
    size_t m_h_unused, m_row_score, m_row_token, m_assign_row, m_assign_expert, m_token_offset,
        m_expert_offset; /* the metadata of an inference forward (no saved block) */
    size_t route_scratch, md_scratch, a, y, f_gemm;
    size_t fwd_end;
    /* backward (overlaps the forward region) */
    size_t dh, a_scaled, ds, dxt, split, wr2, dwr2, dxr, tc, dla, wr_nf, b_gemm;
    int dh_in_saved;     /* consume_saved: dH over the saved block's H (dh unused) */
    size_t bwd_end;
    size_t total;
} ws_layout;

static size_t al(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

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

static smoe_gemm_problem problem_make(const smoe_layer *layer, int64_t cap)
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

static void ws_make(const smoe_layer *layer, int64_t T, int64_t cap, ws_layout *w)
{
    const smoe_layer_desc *d = &layer->desc;
    const size_t E = (size_t)d->E, dd = (size_t)d->d, n = (size_t)d->n, K = (size_t)d->K;
    const size_t hc = (size_t)layer->h_cols, t = (size_t)T, c = (size_t)(cap > 0 ? cap : 1);
    smoe_gemm_problem p = problem_make(layer, cap);
    const size_t gs = gemm_scratch(layer, &p);
    size_t o = 0;
    memset(w, 0, sizeof *w);
    w->status = o; o += SMOE_DEV_STATUS_BYTES;
    w->cublas = o; o += CUBLAS_WS_BYTES;
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
    w->f_gemm = o; o += gs;
    w->fwd_end = o;

    /* The backward's buffers, by lifetime (one stream, so in this order):
     *   dh:        written by the dh GEMM; read by dxt, dw1, db1
     *   a_scaled:  written by the dh GEMM; read by dw2 (before dxt)
     *   ds:        written by the dh GEMM; read by the router backward and
     *              the pair-score gradient (to the end)
     *   dxt:       written by dxt (after dw2); read by the dx aggregation
     *   router:    split, tc, dla, wr2, dwr2, dxr: written after db1, read
     *              up to the dx aggregation
     * so a_scaled and dxt share one region, and the router's buffers share
     * dh's (dead once db1 has run). */
    /* With consume_saved, dH is written over the saved block's H (the same
     * lifetime: H is dead once the dh GEMM has read it), so the region
     * holds the router's buffers alone. They stay in the workspace, not in
     * the saved H: stack_twice and cuBLAS (wr2, dwr2, dxr) run whatever the
     * status word says, so in a call whose saved block the device refused
     * (another layer's, another T's, a consumed one) they would write into
     * that block, which may be another call's live one. */
    o = base;
    w->dh = o;
    w->dh_in_saved = d->consume_saved != 0;
    size_t r = o; /* the router's buffers from the same start */
    w->split = r; r += al(t * 2 * E * 2);
    w->wr2 = r; r += al(2 * E * dd * 2);
    w->dwr2 = r; r += al(2 * E * dd * 4);
    w->dxr = r; r += al(t * dd * 4);
    w->tc = r; r += al(t * K * 4);
    w->dla = r; r += al(c * 4);
    if (!w->dh_in_saved) o += al(c * hc * 2);
    if (r > o) o = r;
    w->ds = o; o += al(c * 4);
    w->wr_nf = o; o += al(dd * 4);
    w->a_scaled = o;
    w->dxt = o;
    o += al(c * (dd > n ? dd : n) * 2);
    w->b_gemm = o; o += gs;
    w->bwd_end = o;
    w->total = w->fwd_end > w->bwd_end ? w->fwd_end : w->bwd_end;
}

static size_t cuda_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t cap)
{
    ws_layout w;
    ws_make(layer, T, cap, &w);
    return w.total;
}

/* ------------------------------------------------------------ helpers */

/* Makes the layer's device current for the call and restores the caller's. */
typedef struct dev_guard {
    int prev, changed;
} dev_guard;

static smoe_status dev_enter(const cuda_state *st, dev_guard *g)
{
    g->changed = 0;
    SMOE_CUDA_CHECK(cudaGetDevice(&g->prev));
    if (g->prev != st->device) {
        SMOE_CUDA_CHECK(cudaSetDevice(st->device));
        g->changed = 1;
    }
    return SMOE_SUCCESS;
}

static void dev_leave(const dev_guard *g)
{
    if (g->changed) cudaSetDevice(g->prev);
}

/* The cuBLAS part of gemm_bf16_f32, with the handle bound to this call. */
static smoe_status gemm_bf16_f32_locked(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                        cublasOperation_t ta,
                                        cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                                        const bf16 *A, int64_t lda, const bf16 *B, int64_t ldb,
                                        float *C, int64_t ldc)
{
    const float one = 1.0f, zero = 0.0f;
    SMOE_CUBLAS_CHECK(cublasSetStream(st->cublas, s));
    /* after SetStream (which resets it): cuBLAS's scratch from the call's
     * workspace, so it never allocates (graph capture) and two calls in
     * flight never share it */
    SMOE_CUBLAS_CHECK(cublasSetWorkspace(st->cublas, cublas_ws, CUBLAS_WS_BYTES));
    SMOE_CUBLAS_CHECK(cublasGemmEx(st->cublas, ta, tb, (int)m, (int)n, (int)k, &one, A,
                                   CUDA_R_16BF, (int)lda, B, CUDA_R_16BF, (int)ldb, &zero, C,
                                   CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    return SMOE_SUCCESS;
}

/* C (m x n, col-major, ldc) = op(A) op(B); bf16 A, B; fp32 C; enqueued on s
 * with cuBLAS's scratch in the call's workspace (CUBLAS_WS_BYTES at
 * cublas_ws). The layer's one cuBLAS handle is bound and used under its
 * mutex, so calls from several threads do not race on it. */
static smoe_status gemm_bf16_f32(cuda_state *st, void *cublas_ws, cudaStream_t s,
                                 cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                 int64_t n, int64_t k, const bf16 *A, int64_t lda, const bf16 *B,
                                 int64_t ldb, float *C, int64_t ldc)
{
    pthread_mutex_lock(&st->cublas_lock);
    smoe_status r = gemm_bf16_f32_locked(st, cublas_ws, s, ta, tb, m, n, k, A, lda, B, ldb, C, ldc);
    pthread_mutex_unlock(&st->cublas_lock);
    return r;
}

/* ------------------------------------------------------------ kernel choice */

static const char *act_name(smoe_activation a)
{
    switch (a) {
    case SMOE_ACT_SWIGLU: return "swiglu";
    case SMOE_ACT_GEGLU: return "geglu";
    case SMOE_ACT_REGLU: return "reglu";
    case SMOE_ACT_RELU2: return "relu2";
    case SMOE_ACT_RELU: return "relu";
    case SMOE_ACT_SILU: return "silu";
    case SMOE_ACT_GELU: return "gelu";
    }
    return "?";
}

/* The path name from which kernels each op runs. */
static void path_name_make(smoe_layer *layer)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_gemm_ops *p = &smoe_gemm_ops_sm80, *h = st->tab90;
    char gemm[96];
    if (!h) {
        snprintf(gemm, sizeof gemm, "cuda: gemm %s (sm%d)", p->name, st->sm);
    } else {
        char a[64] = "", b[64] = "";
        for (int i = 0; i < OP_COUNT; ++i) {
            char *dst = st->use90[i] ? a : b;
            if (dst[0]) strncat(dst, ",", 63 - strlen(dst));
            strncat(dst, smoe_gemm_name(i), 63 - strlen(dst));
        }
        if (!b[0]) snprintf(gemm, sizeof gemm, "sm90: all %s", h->name);
        else if (!a[0]) snprintf(gemm, sizeof gemm, "sm90: all %s", p->name);
        else snprintf(gemm, sizeof gemm, "sm90: %s %s; %s %s", a, h->name, b, p->name);
    }
    snprintf(layer->path_name, sizeof layer->path_name, "%s [%s]", gemm,
             act_name(layer->desc.activation));
}

/* Each op's kernel, decided once here: the Hopper table's row where it has
 * one for this shape (SM90 backend on an sm_90 device), else the portable
 * table's; every call then runs exactly these rows (the launchers never
 * choose). A shape neither table runs is refused here. */
static smoe_status plans_make(smoe_layer *layer, const char *fn)
{
    cuda_state *st = (cuda_state *)layer->state;
    smoe_gemm_problem p = problem_make(layer, 0);
    p.plan = NULL;
    smoe_gemm_plan p80, p90;
    smoe_gemm_ops_sm80.plan(&p, &p80);
    for (int i = 0; i < OP_COUNT; ++i) p90.row[i] = -1;
    if (st->tab90) st->tab90->plan(&p, &p90);
    for (int i = 0; i < OP_COUNT; ++i) {
        st->use90[i] = p90.row[i] >= 0;
        st->plan.row[i] = st->use90[i] ? p90.row[i] : p80.row[i];
        SMOE_RETURN_ERROR_IF(st->plan.row[i] < 0, SMOE_ERROR_UNSUPPORTED,
                             "%s: no %s GEMM kernel fits this device at d = %lld, n = %lld", fn,
                             smoe_gemm_name(i), (long long)layer->desc.d, (long long)layer->desc.n);
    }
    return SMOE_SUCCESS;
}

/* cuda_layer.h: a test's or the benchmark's choice of one GEMM's row. */
smoe_status smoe_cuda_layer_set_row(smoe_layer *layer, const char *gemm, const char *name)
{
    cuda_state *st = (cuda_state *)layer->state;
    const int g = smoe_gemm_find(gemm, strlen(gemm));
    SMOE_RETURN_ERROR_IF(g < 0, SMOE_ERROR_INVALID_VALUE, "set_row: no GEMM named %s", gemm);
    const smoe_gemm_ops *ops = st->use90[g] ? st->tab90 : &smoe_gemm_ops_sm80;
    SMOE_RETURN_ERROR_IF(!ops->row_name, SMOE_ERROR_UNSUPPORTED,
                         "set_row: the %s table has no named rows", ops->name);
    const int row = smoe_gemm_row_find(ops, g, name);
    SMOE_RETURN_ERROR_IF(row < 0, SMOE_ERROR_INVALID_VALUE, "set_row: %s has no row \"%s\" (%s)",
                         gemm, name, ops->name);
    smoe_gemm_problem p = problem_make(layer, 0);
    if (ops->row_fits && !ops->row_fits(&p, g, row)) return SMOE_ERROR_UNSUPPORTED;
    st->plan.row[g] = row;
    return SMOE_SUCCESS;
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
    ws_make(layer, T, cap, &w);
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
        v.assign_expert = (int32_t *)(ws + w.m_assign_expert);
        v.token_offset = (int32_t *)(ws + w.m_token_offset);
        v.expert_offset = (int32_t *)(ws + w.m_expert_offset);
    }
    smoe_assign_dev as;
    as.expert = v.assign_expert;
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
        float *lg = (training && v.logits) ? v.logits
                    : args->router_logits  ? args->router_logits
                                           : (float *)(ws + w.logits);
        /* logits^T (E x T, col-major) = Wr (E x d) . X^T */
        SMOE_FORWARD_IF_ERROR(gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_T, CUBLAS_OP_N, d->E,
                                            T, d->d, (const bf16 *)args->router_w, d->d,
                                            (const bf16 *)args->x, d->d, lg, d->E));
        timer_mark(st, 0, "router gemm", s);
        if (args->router_logits && args->router_logits != lg)
            SMOE_CUDA_CHECK(cudaMemcpyAsync(args->router_logits, lg,
                                            (size_t)T * (size_t)d->E * 4,
                                            cudaMemcpyDeviceToDevice, s));
        SMOE_FORWARD_IF_ERROR(
            smoe_cuda_route(d, T, rounding, lg, args->expert_bias, as, ws + w.route_scratch, s));
        timer_mark(st, 0, "routing", s);
    }
    SMOE_FORWARD_IF_ERROR(smoe_cuda_metadata(d->E, cap, as, v.expert_offset, v.assign_row,
                                             v.row_token, v.row_score, args->expert_counts,
                                             ws + w.md_scratch, s));
    timer_mark(st, 0, "metadata", s);

    smoe_gemm_problem p = problem_make(layer, cap);
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
        T, d->d, v.token_offset, v.assign_row, v.row_score, y, (bf16 *)args->out,
        training ? v.header : NULL, smoe_saved_header_make(layer, T, args->pairs), abort, s));
    timer_mark(st, 0, "aggregate", s);
    return SMOE_SUCCESS;
}

static smoe_status cuda_forward(smoe_layer *layer, const smoe_forward_args *args,
                                const smoe_saved_layout *sl, void *saved, void *workspace,
                                void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
    timer_begin(st, (cudaStream_t)stream);
    smoe_status r = forward_impl(layer, args, sl, saved, workspace, (cudaStream_t)stream);
    if (r == SMOE_SUCCESS) timer_end(st, 0);
    dev_leave(&g);
    return r;
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

    ws_layout w;
    ws_make(layer, T, cap, &w);
    char *ws = (char *)workspace;
    smoe_saved_view v = smoe_saved_view_make(sl, saved);
    smoe_dev_status *dst = (smoe_dev_status *)(ws + w.status);
    const int *abort = &dst->code;
    const int want_dx = args->dx.ptr != NULL;
    const int want_router = !general && (args->drouter_w.ptr || want_dx);
    const int sparse = want_router && smoe_cuda_router_sparse(d, rounding, args->dlogits_extra);
    float *wr_nf = sparse && want_dx ? (float *)(ws + w.wr_nf) : NULL;
    /* first: is the saved block this call's? (every later kernel reads
     * abort); and the router weight's non-finite columns */
    SMOE_FORWARD_IF_ERROR(smoe_cuda_backward_prologue(
        v.header, smoe_saved_header_make(layer, T, general ? args->pairs : 0),
        d->consume_saved, dst,
        report_make(st, 1), wr_nf ? (const bf16 *)args->router_w : NULL, d->E, d->d, wr_nf, s));

    const int want_ds = want_router || (general && args->dpair_score.ptr);
    const int want_dh = want_dx || args->dw1.ptr || args->db1.ptr;
    const int run_dh = want_dh || want_ds || args->dw2.ptr;

    smoe_gemm_problem p = problem_make(layer, cap);
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
    bf16 *a_scaled = (bf16 *)(ws + w.a_scaled);
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

    float *dxr = NULL, *dla = NULL;
    if (want_router) {
        bf16 *split = (bf16 *)(ws + w.split);
        if (sparse && want_dx) dla = (float *)(ws + w.dla);
        SMOE_FORWARD_IF_ERROR(smoe_cuda_router_dlogits(
            d, T, rounding, v.logits, v.token_offset, v.assign_expert, v.assign_row,
            v.row_score, ds, args->dlogits_extra, split, (int32_t *)(ws + w.tc), dla, abort, s));
        timer_mark(st, 1, "router dlogits", s);
        const int64_t E2 = 2 * d->E;
        if (args->drouter_w.ptr) {
            float *dwr2 = (float *)(ws + w.dwr2);
            /* dWr2 (2E x d row-major = d x 2E col-major) = X^T . split */
            SMOE_FORWARD_IF_ERROR(gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_T,
                                                d->d, E2, T, (const bf16 *)args->x, d->d, split,
                                                E2, dwr2, d->d));
            SMOE_FORWARD_IF_ERROR(smoe_cuda_combine_halves(
                dwr2, d->E, d->d, args->drouter_w.ptr, args->drouter_w.dtype,
                args->drouter_w.accumulate, abort, s));
            timer_mark(st, 1, "dWr gemm", s);
        }
        if (want_dx && !sparse) {
            bf16 *wr2 = (bf16 *)(ws + w.wr2);
            dxr = (float *)(ws + w.dxr);
            SMOE_FORWARD_IF_ERROR(
                smoe_cuda_stack_twice((const bf16 *)args->router_w, d->E, d->d, wr2, s));
            /* dXr (T x d row-major = d x T col-major) = wr2^T-view . split^T-view */
            SMOE_FORWARD_IF_ERROR(gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_N,
                                                d->d, T, E2, wr2, d->d, split, E2, dxr, d->d));
            timer_mark(st, 1, "dXr gemm", s);
        }
    }
    if (want_dx)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_aggregate_backward(
            T, d->d, v.token_offset, v.assign_row, dxt, dxr, dla, v.assign_expert,
            dla ? (const bf16 *)args->router_w : NULL, wr_nf, args->dx.ptr, args->dx.dtype,
            args->dx.accumulate, abort, s));
    timer_mark(st, 1, "aggregate dx", s);
    if (general && args->dpair_score.ptr)
        SMOE_FORWARD_IF_ERROR(smoe_cuda_pair_score_grad(
            args->pairs, v.token_offset + T, v.assign_row, ds, (float *)args->dpair_score.ptr,
            args->dpair_score.accumulate, abort, s));
    return SMOE_SUCCESS;
}

static smoe_status cuda_backward(smoe_layer *layer, const smoe_backward_args *args,
                                 const smoe_saved_layout *sl, void *saved, void *workspace,
                                 void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
    timer_begin(st, (cudaStream_t)stream);
    smoe_status r = backward_impl(layer, args, sl, saved, workspace, (cudaStream_t)stream);
    if (r == SMOE_SUCCESS) timer_end(st, 1);
    dev_leave(&g);
    return r;
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
    g.problem = problem_make(layer, cap);
    g.scratch_bytes = gemm_scratch(layer, &g.problem);
    g.num_sms = st->num_sms;
    return g;
}

/* ------------------------------------------------------------ the router alone */

/* The expert-parallel layer's source side (cuda_layer.h): the router of a
 * whole-layer description (E experts) without its experts. Workspace: */
typedef struct router_ws {
    size_t cublas, route, split, wr2, dwr2, tc, total;
} router_ws;

static void router_ws_make(const smoe_layer *layer, int64_t T, router_ws *w)
{
    const smoe_layer_desc *d = &layer->desc;
    const size_t t = (size_t)(T > 0 ? T : 1), E = (size_t)d->E, dd = (size_t)d->d;
    size_t o = 0;
    w->cublas = o; o += CUBLAS_WS_BYTES;
    w->route = o; o += al(smoe_cuda_routing_scratch_bytes(d, T, 0));
    w->split = o; o += al(t * 2 * E * 2);
    w->wr2 = o; o += al(2 * E * dd * 2);
    w->dwr2 = o; o += al(2 * E * dd * 4);
    w->tc = o; o += al(t * (size_t)(d->K > 0 ? d->K : 1) * 4);
    w->total = o;
}

size_t smoe_cuda_router_ws_bytes(const smoe_layer *layer, int64_t T)
{
    router_ws w;
    router_ws_make(layer, T, &w);
    return w.total;
}

smoe_status smoe_cuda_router_forward(smoe_layer *layer, int64_t T, const void *x,
                                     const void *router_w, const float *expert_bias,
                                     float *logits, smoe_assign_dev as, void *workspace,
                                     void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    cudaStream_t s = (cudaStream_t)stream;
    router_ws w;
    router_ws_make(layer, T, &w);
    char *ws = (char *)workspace;
    if (T == 0) return SMOE_SUCCESS;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
    smoe_status r = gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_T, CUBLAS_OP_N, d->E, T, d->d,
                                  (const bf16 *)router_w, d->d, (const bf16 *)x, d->d, logits,
                                  d->E);
    if (r == SMOE_SUCCESS) r = smoe_cuda_route(d, T, 0, logits, expert_bias, as, ws + w.route, s);
    dev_leave(&g);
    return r;
}

smoe_status smoe_cuda_router_backward(smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                                      const float *ds, const float *dlogits_extra,
                                      const void *x, const void *router_w,
                                      const smoe_grad *drouter_w, float *dxr, void *workspace,
                                      const int *abort, void *stream)
{
    cuda_state *st = (cuda_state *)layer->state;
    const smoe_layer_desc *d = &layer->desc;
    cudaStream_t s = (cudaStream_t)stream;
    router_ws w;
    router_ws_make(layer, T, &w);
    char *ws = (char *)workspace;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
    const int64_t E2 = 2 * d->E;
    bf16 *split = (bf16 *)(ws + w.split);
    smoe_status r = SMOE_SUCCESS;
    if (T > 0)
        r = smoe_cuda_router_dlogits(d, T, 0, v->logits, v->token_offset, v->assign_expert,
                                     v->assign_row, v->row_score, ds, dlogits_extra, split,
                                     (int32_t *)(ws + w.tc), NULL, abort, s);
    if (r == SMOE_SUCCESS && drouter_w->ptr) {
        float *dwr2 = (float *)(ws + w.dwr2);
        if (T > 0) {
            r = gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_T, d->d, E2, T,
                              (const bf16 *)x, d->d, split, E2, dwr2, d->d);
        } else {
            const cudaError_t e = cudaMemsetAsync(dwr2, 0, (size_t)E2 * (size_t)d->d * 4, s);
            if (e != cudaSuccess)
                r = smoe_fail(SMOE_ERROR_BACKEND, "router backward: %s", cudaGetErrorString(e));
        }
        if (r == SMOE_SUCCESS)
            r = smoe_cuda_combine_halves(dwr2, d->E, d->d, drouter_w->ptr, drouter_w->dtype,
                                         drouter_w->accumulate, abort, s);
    }
    if (r == SMOE_SUCCESS && dxr && T > 0) {
        bf16 *wr2 = (bf16 *)(ws + w.wr2);
        r = smoe_cuda_stack_twice((const bf16 *)router_w, d->E, d->d, wr2, s);
        if (r == SMOE_SUCCESS)
            r = gemm_bf16_f32(st, ws + w.cublas, s, CUBLAS_OP_N, CUBLAS_OP_N, d->d, T, E2, wr2,
                              d->d, split, E2, dxr, d->d);
    }
    dev_leave(&g);
    return r;
}

/* ------------------------------------------------------------ device status */

/* The message of a recorded failure, as the CPU backend words the same
 * failure (smoe.c's check_triples and smoe_saved_header_check). */
static smoe_status device_failure(const smoe_layer *layer, int call, const smoe_dev_status *h)
{
    const char *fwd = "smoe_layer_forward (GENERAL triples, checked on the device)";
    const char *bwd = "smoe_layer_backward (saved block, checked on the device)";
    const long long v = h->value, v2 = h->value2;
    switch (h->code) {
    case SMOE_DEV_BAD_TOKEN:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_token[%d] = %lld, must be in [0, T = %lld); nothing written",
                         fwd, h->first_bad, v, v2);
    case SMOE_DEV_BAD_EXPERT:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_expert[%d] = %lld, must be in [0, E = %lld); nothing written",
                         fwd, h->first_bad, v, (long long)layer->desc.E);
    case SMOE_DEV_UNSORTED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_token[%d] = %lld < pair_token[%d] = %lld: triples must be "
                         "sorted by token; nothing written",
                         fwd, h->first_bad, v, h->first_bad - 1, v2);
    case SMOE_DEV_DUPLICATE:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: (token %lld, expert %lld) is given twice (again at pair %d); "
                         "nothing written",
                         fwd, v, v2, h->first_bad);
    case SMOE_DEV_BAD_SCORE: {
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, 4);
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: pair_score[%d] = %g is not finite; nothing written", fwd,
                         h->first_bad, (double)f);
    }
    case SMOE_DEV_SAVED_INVALID:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was not filled by a training forward (its header "
                         "is not valid); nothing written",
                         bwd);
    case SMOE_DEV_SAVED_LAYER:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by another layer (id %016llx, this "
                         "layer is %016llx); nothing written",
                         bwd, (unsigned long long)v, (unsigned long long)v2);
    case SMOE_DEV_SAVED_T:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with T = %lld, this "
                         "backward has T = %lld; nothing written",
                         bwd, v, v2);
    case SMOE_DEV_SAVED_PAIRS:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with pairs = %lld, this "
                         "backward has pairs = %lld; nothing written",
                         bwd, v, v2);
    case SMOE_DEV_EP_OVERFLOW:
        return smoe_fail(SMOE_ERROR_INVALID_SIZE,
                         "smoe_ep_layer_forward (checked on the device): %lld rows for rank %d, "
                         "more than capacity = %lld; nothing written",
                         v, h->first_bad, v2);
    case SMOE_DEV_EP_ROWS:
        return smoe_fail(SMOE_ERROR_INVALID_SIZE,
                         "smoe_ep_layer_forward (checked on the device): %lld (row, expert) "
                         "pairs on this rank, more than expert_rows = %lld; nothing written",
                         v, v2);
    case SMOE_DEV_EP_PEER:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "smoe_ep_layer (checked on the device): rank %lld's call failed (its "
                         "code %lld; read its device status); nothing written",
                         v, v2);
    case SMOE_DEV_SAVED_CONSUMED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was consumed by an earlier backward "
                         "(desc.consume_saved = 1 writes dH over its H); run a training forward "
                         "again; nothing written",
                         bwd);
    case SMOE_DEV_SAVED_FAILED:
        return smoe_fail(SMOE_ERROR_INVALID_VALUE,
                         "%s: the forward that filled the saved block failed a device-side "
                         "check (code %lld); nothing written",
                         bwd, v);
    default:
        return smoe_fail(SMOE_ERROR_INTERNAL, "smoe_layer_device_status: %s recorded code %d",
                         call ? "backward" : "forward", h->code);
    }
}

static smoe_status cuda_device_status(smoe_layer *layer, void *stream, int wait)
{
    cuda_state *st = (cuda_state *)layer->state;
    if (wait) {
        dev_guard g;
        SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
        cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
        dev_leave(&g);
        SMOE_RETURN_ERROR_IF(e != cudaSuccess, SMOE_ERROR_BACKEND,
                             "smoe_layer_device_status: %s", cudaGetErrorString(e));
    }
    volatile smoe_dev_mapped *rec = st->rec_host;
    const int code = rec->code;
    if (code == SMOE_DEV_OK) return SMOE_SUCCESS;
    __sync_synchronize(); /* the record's fields were written before its code */
    smoe_dev_status h;
    h.first_bad = rec->st.first_bad;
    h.code = code;
    h.value = rec->st.value;
    h.value2 = rec->st.value2;
    const int call = rec->call;
    /* read: clear the record and free the claim for the next failure */
    rec->code = SMOE_DEV_OK;
    dev_guard g;
    SMOE_FORWARD_IF_ERROR(dev_enter(st, &g));
    cudaError_t e = cudaMemsetAsync(st->claim, 0, sizeof(int), (cudaStream_t)stream);
    dev_leave(&g);
    SMOE_RETURN_ERROR_IF(e != cudaSuccess, SMOE_ERROR_BACKEND,
                         "smoe_layer_device_status: clearing the record: %s",
                         cudaGetErrorString(e));
    return device_failure(layer, call, &h);
}

/* ------------------------------------------------------------ init */

static void cuda_destroy(smoe_layer *layer)
{
    cuda_state *st = (cuda_state *)layer->state;
    if (!st) return;
    if (st->timer) {
        timer_report(layer, st->timer);
        for (int i = 0; i <= MAX_STAGES; ++i) cudaEventDestroy(st->timer->ev[i]);
        free(st->timer);
    }
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != st->device) cudaSetDevice(st->device);
    if (st->cublas) cublasDestroy(st->cublas);
    if (st->claim) cudaFree(st->claim);
    if (st->rec_host) cudaFreeHost(st->rec_host);
    if (prev >= 0 && prev != st->device) cudaSetDevice(prev);
    pthread_mutex_destroy(&st->cublas_lock);
    free(st);
    layer->state = NULL;
}

static const smoe_backend_ops cuda_ops = {
    cuda_workspace_bytes, cuda_forward, cuda_backward, cuda_destroy, cuda_device_status,
};

/* The cuBLAS handle and the report record, on the layer's device (current). */
static smoe_status state_make(cuda_state *st, const char *fn)
{
    cublasStatus_t cs = cublasCreate(&st->cublas);
    if (cs == CUBLAS_STATUS_SUCCESS) cs = cublasSetMathMode(st->cublas, CUBLAS_DEFAULT_MATH);
    SMOE_RETURN_ERROR_IF(cs != CUBLAS_STATUS_SUCCESS, SMOE_ERROR_BACKEND,
                         "%s: cublasCreate: cuBLAS status %d (%s)", fn, (int)cs,
                         cublasGetStatusString(cs));
    SMOE_CUDA_CHECK(cudaMalloc((void **)&st->claim, sizeof(int)));
    SMOE_CUDA_CHECK(cudaMemset(st->claim, 0, sizeof(int)));
    SMOE_CUDA_CHECK(cudaHostAlloc((void **)&st->rec_host, sizeof(smoe_dev_mapped),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
    memset((void *)st->rec_host, 0, sizeof(smoe_dev_mapped));
    SMOE_CUDA_CHECK(cudaHostGetDevicePointer((void **)&st->rec_dev, st->rec_host, 0));
    return SMOE_SUCCESS;
}

smoe_status smoe_cuda_layer_init(smoe_layer *layer, int want_sm90)
{
    const smoe_layer_desc *d = &layer->desc;
    const char *fn = want_sm90 ? "backend SM90" : "backend CUDA";
    SMOE_RETURN_ERROR_IF(d->dtype != SMOE_DTYPE_BF16, SMOE_ERROR_UNSUPPORTED,
                         "%s: desc.dtype = %s, but the CUDA backends store bf16 only (use "
                         "SMOE_DTYPE_BF16, or SMOE_BACKEND_CPU for F32/F64)",
                         fn, d->dtype == SMOE_DTYPE_F32 ? "F32" : "F64");
    SMOE_RETURN_ERROR_IF(d->d % 8 != 0 || d->n % 8 != 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: d = %lld and n = %lld must be multiples of 8 (16-byte rows)", fn,
                         (long long)d->d, (long long)d->n);
    SMOE_RETURN_ERROR_IF(d->E > 4096, SMOE_ERROR_UNSUPPORTED,
                         "%s: E = %lld, at most 4096 experts on the GPU", fn, (long long)d->E);
    /* the portable GEMMs form row strides in int (grouped_gemm.cu) */
    SMOE_RETURN_ERROR_IF(d->d > ((int64_t)1 << 28) || layer->h_cols > ((int64_t)1 << 28),
                         SMOE_ERROR_UNSUPPORTED,
                         "%s: d = %lld, h_cols = %lld: at most 2^28 on the GPU", fn,
                         (long long)d->d, (long long)layer->h_cols);

    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        cudaGetLastError();
        return smoe_fail(SMOE_ERROR_NO_DEVICE, "%s: no CUDA device (%s)", fn,
                         ce != cudaSuccess ? cudaGetErrorString(ce) : "device count 0");
    }
    SMOE_RETURN_ERROR_IF(d->device >= count, SMOE_ERROR_NO_DEVICE,
                         "%s: desc.device = %d, but %d CUDA device(s) present", fn, d->device,
                         count);
    cudaDeviceProp prop;
    SMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, d->device));
    const int sm = prop.major * 10 + prop.minor;
    SMOE_RETURN_ERROR_IF(sm < 80, SMOE_ERROR_NO_DEVICE,
                         "%s: device %d (%s) is sm_%d; the CUDA kernels need sm_80 or later", fn,
                         d->device, prop.name, sm);
#ifdef SMOE_WITH_SM90
    SMOE_RETURN_ERROR_IF(want_sm90 && sm != 90, SMOE_ERROR_NO_DEVICE,
                         "%s: device %d (%s) is sm_%d; the Hopper kernels need sm_90", fn,
                         d->device, prop.name, sm);
#else
    SMOE_RETURN_ERROR_IF(want_sm90, SMOE_ERROR_NO_DEVICE,
                         "%s: smoe was built without the sm_90a kernels", fn);
#endif

    cuda_state *st = (cuda_state *)calloc(1, sizeof *st);
    SMOE_RETURN_ERROR_IF(!st, SMOE_ERROR_OUT_OF_MEMORY, "%s: calloc failed", fn);
    st->device = d->device;
    st->sm = sm;
    st->num_sms = prop.multiProcessorCount;
    pthread_mutex_init(&st->cublas_lock, NULL);
#ifdef SMOE_WITH_SM90
    st->tab90 = want_sm90 ? &smoe_gemm_ops_sm90 : NULL;
#endif
    layer->state = st;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaError_t se = cudaSetDevice(d->device);
    smoe_status r = se == cudaSuccess
                        ? state_make(st, fn)
                        : smoe_fail(SMOE_ERROR_BACKEND, "%s: cudaSetDevice(%d): %s", fn,
                                    d->device, cudaGetErrorString(se));
    if (prev != d->device) cudaSetDevice(prev);
    if (r == SMOE_SUCCESS) r = plans_make(layer, fn);
    if (r != SMOE_SUCCESS) {
        cuda_destroy(layer);
        return r;
    }
    layer->ops = &cuda_ops;
    layer->vec_align = 16; /* the kernels load and store 16-byte vectors */
    const char *tenv = getenv("SMOE_CUDA_TIMING");
    if (tenv && tenv[0] == '1') {
        st->timer = (stage_timer *)calloc(1, sizeof *st->timer);
        if (st->timer) {
            cudaGetDevice(&prev);
            if (prev != d->device) cudaSetDevice(d->device);
            for (int i = 0; i <= MAX_STAGES; ++i) cudaEventCreate(&st->timer->ev[i]);
            if (prev != d->device) cudaSetDevice(prev);
        }
    }
    path_name_make(layer);
    return SMOE_SUCCESS;
}
