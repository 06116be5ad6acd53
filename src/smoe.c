/*
 * smoe.c -- the core: errors, the layer object, backend choice, memory
 * sizes, the saved-block layout, and the API's entry points (forward and
 * backward check T and pairs here, every other argument in validate.c,
 * before a backend sees the call, so that on error nothing is written).
 */
#include "smoe_internal.h"
#include "routing.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ errors */

static _Thread_local char smoe_error_message[512];

smoe_status smoe_fail(smoe_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(smoe_error_message, sizeof smoe_error_message, fmt, ap);
    va_end(ap);
    return status;
}

void smoe_clear_error(void) { smoe_error_message[0] = '\0'; }

const char *smoe_last_error(void) { return smoe_error_message; }

const char *smoe_status_string(smoe_status s)
{
    switch (s) {
    case SMOE_SUCCESS: return "success";
    case SMOE_ERROR_NULL_POINTER: return "a required pointer is NULL";
    case SMOE_ERROR_INVALID_SIZE: return "invalid size";
    case SMOE_ERROR_INVALID_VALUE: return "invalid value";
    case SMOE_ERROR_UNSUPPORTED: return "unsupported by this backend";
    case SMOE_ERROR_NO_DEVICE: return "no device for the backend asked for";
    case SMOE_ERROR_OUT_OF_MEMORY: return "out of memory";
    case SMOE_ERROR_BACKEND: return "CUDA runtime or cuBLAS error";
    case SMOE_ERROR_INTERNAL: return "internal error (a bug in smoe)";
    }
    return "unknown status";
}

#define SMOE_STR_(x) #x
#define SMOE_STR(x) SMOE_STR_(x)

const char *smoe_version_string(void)
{
    return SMOE_STR(SMOE_VERSION_MAJOR) "." SMOE_STR(SMOE_VERSION_MINOR) "." SMOE_STR(
        SMOE_VERSION_PATCH);
}

/* ------------------------------------------------------------ small helpers */

size_t smoe_dtype_size(smoe_dtype t)
{
    switch (t) {
    case SMOE_DTYPE_F32: return 4;
    case SMOE_DTYPE_BF16: return 2;
    case SMOE_DTYPE_F64: return 8;
    }
    return 0;
}

int smoe_is_gated(smoe_activation a)
{
    return a == SMOE_ACT_SWIGLU || a == SMOE_ACT_GEGLU || a == SMOE_ACT_REGLU;
}

/* a*b for non-negative a, b; -1 when it exceeds INT64_MAX. */
int64_t smoe_mul_i64(int64_t a, int64_t b)
{
    int64_t r;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
    return r;
}

static int64_t add_i64(int64_t a, int64_t b)
{
    int64_t r;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return -1;
    return r;
}

/* ------------------------------------------------------------ descriptor */

smoe_layer_desc smoe_layer_desc_default(void)
{
    smoe_layer_desc d;
    memset(&d, 0, sizeof d);
    d.activation = SMOE_ACT_SWIGLU;
    d.w1_layout = SMOE_W1_INTERLEAVED;
    d.has_bias = 0;
    d.routing = SMOE_ROUTING_TOPK_SOFTMAX;
    d.renormalize = 0;
    d.rounding = SMOE_ROUND_OFF;
    d.round_tile = 128;
    d.n_group = 0;
    d.topk_group = 0;
    d.routed_scaling = 1.0;
    d.dtype = SMOE_DTYPE_BF16;
    d.backend = SMOE_BACKEND_AUTO;
    d.device = 0;
    d.consume_saved = 0;
    return d;
}

/* ------------------------------------------------------------ capacity, layout */

int64_t smoe_desc_row_capacity(const smoe_layer_desc *desc, int64_t T, int64_t pairs,
                               int inference)
{
    if (desc->routing == SMOE_ROUTING_GENERAL) return pairs;
    int64_t tk = smoe_mul_i64(T, desc->K);
    if (inference || desc->rounding == SMOE_ROUND_OFF || desc->rounding == SMOE_ROUND_DOWN)
        return tk;
    /* Rounding up or to nearest adds at most M-1 rows per expert. */
    int64_t te = smoe_mul_i64(T, desc->E);
    int64_t extra = add_i64(tk, smoe_mul_i64(desc->E, desc->round_tile - 1));
    if (te < 0 || extra < 0) return -1;
    return extra < te ? extra : te;
}

int64_t smoe_row_capacity(const smoe_layer *layer, int64_t T, int64_t pairs, int inference)
{
    return smoe_desc_row_capacity(&layer->desc, T, pairs, inference);
}

int smoe_saves_logits(const smoe_layer *layer)
{
    return layer->desc.routing == SMOE_ROUTING_SOFTMAX_TOPK ||
           layer->desc.routing == SMOE_ROUTING_SIGMOID_TOPK ||
           (layer->desc.routing != SMOE_ROUTING_GENERAL &&
            layer->desc.rounding != SMOE_ROUND_OFF);
}

static size_t align_up(size_t x) { return (x + SMOE_ALIGN - 1) / SMOE_ALIGN * SMOE_ALIGN; }

void smoe_saved_layout_make(const smoe_layer *layer, int64_t T, int64_t cap,
                            smoe_saved_layout *out)
{
    const smoe_layer_desc *d = &layer->desc;
    size_t fsize = d->dtype == SMOE_DTYPE_F64 ? 8 : 4; /* scores, logits */
    size_t off = 0;
    memset(out, 0, sizeof *out);
    out->T = T;
    out->cap = cap;
    out->header = off;
    off = align_up(off + sizeof(smoe_saved_header));
    out->h = off;
    off = align_up(off + (size_t)cap * (size_t)layer->h_cols * smoe_dtype_size(d->dtype));
    out->row_score = off;
    off = align_up(off + (size_t)cap * fsize);
    out->row_token = off;
    off = align_up(off + (size_t)cap * 4);
    out->assign_row = off;
    off = align_up(off + (size_t)cap * 4);
    out->assign_expert = off;
    off = align_up(off + (size_t)cap * 2);
    out->token_offset = off;
    off = align_up(off + (size_t)(T + 1) * 4);
    out->expert_offset = off;
    off = align_up(off + (size_t)(d->E + 1) * 4);
    if (smoe_saves_logits(layer)) {
        out->logits = off;
        off = align_up(off + (size_t)T * (size_t)d->E * fsize);
    }
    out->total = off;
}

smoe_saved_view smoe_saved_view_make(const smoe_saved_layout *l, void *base)
{
    smoe_saved_view v;
    char *b = (char *)base;
    v.header = (smoe_saved_header *)(b + l->header);
    v.h = b + l->h;
    v.row_score = (float *)(b + l->row_score);
    v.row_token = (int32_t *)(b + l->row_token);
    v.assign_row = (int32_t *)(b + l->assign_row);
    v.assign_expert = (uint16_t *)(b + l->assign_expert);
    v.token_offset = (int32_t *)(b + l->token_offset);
    v.expert_offset = (int32_t *)(b + l->expert_offset);
    v.logits = l->logits ? (float *)(b + l->logits) : NULL;
    return v;
}

/* ------------------------------------------------------------ saved header */

smoe_saved_header smoe_saved_header_make(const smoe_layer *layer, int64_t T, int64_t pairs)
{
    smoe_saved_header h;
    memset(&h, 0, sizeof h);
    h.magic = SMOE_SAVED_MAGIC;
    h.layer_id = layer->id;
    h.T = T;
    h.pairs = layer->desc.routing == SMOE_ROUTING_GENERAL ? pairs : 0;
    h.check = smoe_saved_header_hash(&h);
    return h;
}

smoe_status smoe_saved_header_check(const smoe_layer *layer, const smoe_saved_header *h,
                                    int64_t T, int64_t pairs)
{
    const char *fn = "smoe_layer_backward";
    const smoe_saved_header want = smoe_saved_header_make(layer, T, pairs);
    SMOE_RETURN_ERROR_IF(h->magic != SMOE_SAVED_MAGIC || h->check != smoe_saved_header_hash(h),
                         SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was not filled by a training forward (its "
                         "header is not valid)",
                         fn);
    SMOE_RETURN_ERROR_IF(h->layer_id != want.layer_id, SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by another layer (id %016llx, this "
                         "layer is %016llx)",
                         fn, (unsigned long long)h->layer_id, (unsigned long long)want.layer_id);
    SMOE_RETURN_ERROR_IF(h->T != want.T, SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with T = %lld, this "
                         "backward has T = %lld",
                         fn, (long long)h->T, (long long)want.T);
    SMOE_RETURN_ERROR_IF(h->pairs != want.pairs, SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was filled by a forward with pairs = %lld, this "
                         "backward has pairs = %lld",
                         fn, (long long)h->pairs, (long long)want.pairs);
    SMOE_RETURN_ERROR_IF(h->status != 0, SMOE_ERROR_INVALID_VALUE,
                         "%s: the forward that filled the saved block failed a device-side "
                         "check (code %d; see smoe_layer_device_status)",
                         fn, (int)h->status);
    SMOE_RETURN_ERROR_IF(h->consumed != 0, SMOE_ERROR_INVALID_VALUE,
                         "%s: the saved block was consumed by an earlier backward "
                         "(desc.consume_saved = 1 writes dH over its H); run a training "
                         "forward again",
                         fn);
    return SMOE_SUCCESS;
}

/* A process-wide counter, mixed with the address of this counter (ASLR
 * makes it differ between processes), names each layer. */
static uint64_t next_layer_id(void)
{
    static _Atomic uint64_t counter;
    uint64_t c = atomic_fetch_add(&counter, 1);
    return smoe_mix64(c ^ smoe_mix64((uint64_t)(uintptr_t)&counter));
}

/* Checks T and pairs against the layer and computes the training row
 * capacity; every later byte count is then free of overflow. */
static smoe_status check_sizes(const smoe_layer *layer, int64_t T, int64_t pairs, int inference,
                               int64_t *cap_out)
{
    const smoe_layer_desc *d = &layer->desc;
    SMOE_RETURN_ERROR_IF(T < 1 || T > SMOE_MAX_ROWS, SMOE_ERROR_INVALID_SIZE,
                         "T = %lld, must be in [1, %lld]", (long long)T, (long long)SMOE_MAX_ROWS);
    int64_t te = smoe_mul_i64(T, d->E);
    int64_t td = smoe_mul_i64(T, d->d);
    SMOE_RETURN_ERROR_IF(te < 0 || te > SMOE_MAX_ELEMS || td < 0 || td > SMOE_MAX_ELEMS,
                         SMOE_ERROR_INVALID_SIZE, "T = %lld is too large for E = %lld, d = %lld",
                         (long long)T, (long long)d->E, (long long)d->d);
    if (d->routing == SMOE_ROUTING_GENERAL) {
        SMOE_RETURN_ERROR_IF(pairs < 0 || pairs > te, SMOE_ERROR_INVALID_SIZE,
                             "pairs = %lld, must be in [0, T*E = %lld] (GENERAL routing, each "
                             "(token, expert) at most once)",
                             (long long)pairs, (long long)te);
    }
    int64_t cap = smoe_row_capacity(layer, T, pairs, inference);
    int64_t hsz = smoe_mul_i64(cap, layer->h_cols);
    int64_t dsz = smoe_mul_i64(cap, d->d);
    SMOE_RETURN_ERROR_IF(cap < 0 || cap > SMOE_MAX_ROWS || hsz < 0 || hsz > SMOE_MAX_ELEMS ||
                             dsz < 0 || dsz > SMOE_MAX_ELEMS,
                         SMOE_ERROR_INVALID_SIZE,
                         "T = %lld gives %lld routed rows, more than the int32 row indices "
                         "and the byte counts allow",
                         (long long)T, (long long)cap);
    *cap_out = cap;
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ layer */

static smoe_status init_backend(smoe_layer *layer, smoe_backend which)
{
    layer->ops = NULL;
    layer->state = NULL;
    layer->vec_align = 1;
    layer->path_name[0] = '\0';
    switch (which) {
    case SMOE_BACKEND_CPU: return smoe_cpu_layer_init(layer);
    case SMOE_BACKEND_CUDA:
#ifdef SMOE_WITH_CUDA
        return smoe_cuda_layer_init(layer, 0);
#else
        return smoe_fail(SMOE_ERROR_NO_DEVICE,
                         "backend CUDA asked for, but smoe was built without CUDA");
#endif
    case SMOE_BACKEND_SM90:
#if defined(SMOE_WITH_CUDA) && defined(SMOE_WITH_SM90)
        return smoe_cuda_layer_init(layer, 1);
#elif defined(SMOE_WITH_CUDA)
        return smoe_fail(SMOE_ERROR_NO_DEVICE,
                         "backend SM90 asked for, but smoe was built without the sm_90a kernels");
#else
        return smoe_fail(SMOE_ERROR_NO_DEVICE,
                         "backend SM90 asked for, but smoe was built without CUDA");
#endif
    case SMOE_BACKEND_AUTO: break;
    }
    return smoe_fail(SMOE_ERROR_INTERNAL, "init_backend(%d)", (int)which);
}

smoe_status smoe_layer_create(const smoe_layer_desc *desc, smoe_layer **out)
{
    SMOE_RETURN_ERROR_IF(!out, SMOE_ERROR_NULL_POINTER, "smoe_layer_create: out is NULL");
    *out = NULL;
    SMOE_FORWARD_IF_ERROR(smoe_desc_validate(desc));

    smoe_layer *layer = (smoe_layer *)calloc(1, sizeof *layer);
    SMOE_RETURN_ERROR_IF(!layer, SMOE_ERROR_OUT_OF_MEMORY,
                         "smoe_layer_create: calloc(%zu) failed", sizeof *layer);
    layer->desc = *desc;
    layer->id = next_layer_id();
    layer->vec_align = 1;
    layer->gated = smoe_is_gated(desc->activation);
    layer->h_cols = layer->gated ? 2 * desc->n : desc->n;

    smoe_status st;
    if (desc->backend != SMOE_BACKEND_AUTO) {
        st = init_backend(layer, desc->backend);
        layer->backend = desc->backend;
    } else {
        /* AUTO: Hopper kernels, then portable CUDA, then the CPU. A GPU
         * backend that has no device here (NO_DEVICE) or cannot run this
         * description (UNSUPPORTED, e.g. F64 or F32 storage) hands over to
         * the next one; the path name says which ran. The messages of the
         * attempts that handed over are not left in smoe_last_error(). */
        char saved_msg[sizeof smoe_error_message];
        memcpy(saved_msg, smoe_error_message, sizeof saved_msg);
        static const smoe_backend order[] = {SMOE_BACKEND_SM90, SMOE_BACKEND_CUDA,
                                             SMOE_BACKEND_CPU};
        st = SMOE_ERROR_INTERNAL;
        for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
#if !defined(SMOE_WITH_CUDA)
            if (order[i] != SMOE_BACKEND_CPU) continue;
#elif !defined(SMOE_WITH_SM90)
            if (order[i] == SMOE_BACKEND_SM90) continue;
#endif
            if (desc->dtype == SMOE_DTYPE_F64 && order[i] != SMOE_BACKEND_CPU) continue;
            st = init_backend(layer, order[i]);
            layer->backend = order[i];
            if (st != SMOE_ERROR_NO_DEVICE && st != SMOE_ERROR_UNSUPPORTED) break;
        }
        if (st == SMOE_SUCCESS) memcpy(smoe_error_message, saved_msg, sizeof saved_msg);
    }
    if (st != SMOE_SUCCESS) {
        free(layer);
        return st;
    }
    if (!layer->ops || !layer->ops->forward || !layer->ops->backward ||
        !layer->ops->workspace_bytes) {
        int which = (int)layer->backend;
        if (layer->ops && layer->ops->destroy) layer->ops->destroy(layer);
        free(layer);
        return smoe_fail(SMOE_ERROR_INTERNAL, "backend %d left its operations table incomplete",
                         which);
    }
    *out = layer;
    return SMOE_SUCCESS;
}

void smoe_layer_free(smoe_layer *layer)
{
    if (!layer) return;
    if (layer->ops && layer->ops->destroy) layer->ops->destroy(layer);
    free(layer);
}

smoe_backend smoe_layer_backend(const smoe_layer *layer)
{
    return layer ? layer->backend : SMOE_BACKEND_AUTO;
}

const char *smoe_layer_path_name(const smoe_layer *layer)
{
    return layer ? layer->path_name : "";
}

smoe_layer_desc smoe_layer_get_desc(const smoe_layer *layer)
{
    if (!layer) {
        smoe_layer_desc d;
        memset(&d, 0, sizeof d);
        return d;
    }
    return layer->desc;
}

/* ------------------------------------------------------------ memory */

size_t smoe_layer_call_workspace_bytes(const smoe_layer *layer, smoe_call call, int64_t T,
                                       int64_t pairs)
{
    int64_t cap;
    if (!layer) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "smoe_layer_call_workspace_bytes: layer is NULL");
        return 0;
    }
    if (call != SMOE_CALL_ANY && call != SMOE_CALL_FORWARD && call != SMOE_CALL_BACKWARD) {
        smoe_fail(SMOE_ERROR_INVALID_VALUE,
                  "smoe_layer_call_workspace_bytes: call = %d, must be SMOE_CALL_ANY (0), "
                  "SMOE_CALL_FORWARD (1) or SMOE_CALL_BACKWARD (2)",
                  (int)call);
        return 0;
    }
    if (check_sizes(layer, T, pairs, 0, &cap) != SMOE_SUCCESS) return 0;
    return layer->ops->workspace_bytes(layer, T, cap, (int)call);
}

/* A backward's scratch for its arguments: the backend's own rule (CUDA: A'
 * in dW1 where it fits), else its SMOE_CALL_BACKWARD size. */
static size_t backward_ws(const smoe_layer *layer, int64_t T, int64_t cap,
                          const smoe_backward_args *args)
{
    if (!layer->ops->backward_workspace_bytes)
        return layer->ops->workspace_bytes(layer, T, cap, SMOE_CALL_BACKWARD);
    return layer->ops->backward_workspace_bytes(layer, T, cap, args);
}

size_t smoe_layer_backward_workspace_bytes(const smoe_layer *layer,
                                           const smoe_backward_args *args)
{
    int64_t cap;
    if (!layer || !args) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "smoe_layer_backward_workspace_bytes: %s is NULL",
                  layer ? "args" : "layer");
        return 0;
    }
    const int64_t pairs = layer->desc.routing == SMOE_ROUTING_GENERAL ? args->pairs : 0;
    if (check_sizes(layer, args->T, pairs, 0, &cap) != SMOE_SUCCESS) return 0;
    return backward_ws(layer, args->T, cap, args);
}

size_t smoe_layer_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t pairs)
{
    if (!layer) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "smoe_layer_workspace_bytes: layer is NULL");
        return 0;
    }
    return smoe_layer_call_workspace_bytes(layer, SMOE_CALL_ANY, T, pairs);
}

size_t smoe_layer_saved_bytes(const smoe_layer *layer, int64_t T, int64_t pairs)
{
    int64_t cap;
    smoe_saved_layout l;
    if (!layer) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "smoe_layer_saved_bytes: layer is NULL");
        return 0;
    }
    if (check_sizes(layer, T, pairs, 0, &cap) != SMOE_SUCCESS) return 0;
    smoe_saved_layout_make(layer, T, cap, &l);
    return l.total;
}

smoe_status smoe_layer_device_status(smoe_layer *layer, void *stream, int wait)
{
    SMOE_RETURN_ERROR_IF(!layer, SMOE_ERROR_NULL_POINTER,
                         "smoe_layer_device_status: layer is NULL");
    SMOE_RETURN_ERROR_IF(wait != 0 && wait != 1, SMOE_ERROR_INVALID_VALUE,
                         "smoe_layer_device_status: wait = %d, must be 0 or 1", wait);
    if (!layer->ops->device_status) return SMOE_SUCCESS;
    return layer->ops->device_status(layer, stream, wait);
}

/* The router slot of a backward's saved block (layout l): bytes 0 where
 * there is none. It must hold E x d of the layer's dtype or of fp32. */
static void drouter_slot_of(const smoe_layer *layer, const smoe_saved_layout *l, size_t *off,
                            size_t *bytes)
{
    const smoe_layer_desc *d = &layer->desc;
    *off = 0;
    *bytes = 0;
    if (!d->consume_saved || d->routing == SMOE_ROUTING_GENERAL || l->cap == 0 ||
        !layer->ops->drouter_slot || !layer->ops->drouter_slot(layer, l, off, bytes)) {
        *bytes = 0;
        return;
    }
    const size_t es = smoe_dtype_size(d->dtype);
    if (*bytes < (size_t)d->E * (size_t)d->d * (es > 4 ? es : 4)) *bytes = 0;
}

smoe_status smoe_layer_drouter_slot(const smoe_layer *layer, int64_t T, int64_t pairs,
                                    size_t *offset)
{
    const char *fn = "smoe_layer_drouter_slot";
    SMOE_REQUIRE_PTR(layer, "layer");
    SMOE_REQUIRE_PTR(offset, "offset");
    const smoe_layer_desc *d = &layer->desc;
    SMOE_RETURN_ERROR_IF(!d->consume_saved, SMOE_ERROR_UNSUPPORTED,
                         "%s: desc.consume_saved is 0: the backward only reads its saved block",
                         fn);
    SMOE_RETURN_ERROR_IF(d->routing == SMOE_ROUTING_GENERAL, SMOE_ERROR_UNSUPPORTED,
                         "%s: GENERAL routing has no router weight", fn);
    int64_t cap;
    (void)pairs; /* GENERAL only, refused above */
    SMOE_FORWARD_IF_ERROR(check_sizes(layer, T, 0, 0, &cap));
    smoe_saved_layout l;
    smoe_saved_layout_make(layer, T, cap, &l);
    size_t off, bytes;
    drouter_slot_of(layer, &l, &off, &bytes);
    SMOE_RETURN_ERROR_IF(bytes == 0, SMOE_ERROR_UNSUPPORTED,
                         "%s: at T = %lld the saved block's H (%zu bytes) has no room for the "
                         "router weight's gradient beside the router's buffers on this "
                         "backend (%s)",
                         fn, (long long)T, (size_t)cap * (size_t)layer->h_cols *
                                               smoe_dtype_size(d->dtype),
                         layer->path_name);
    *offset = off;
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ forward, backward */

/* A call's T and pairs checked, its saved block's layout, and the shape its
 * other arguments are checked against (validate.c); bargs: a backward's
 * arguments (its workspace follows them), NULL for a forward. */
static smoe_status call_shape_make(const smoe_layer *layer, const smoe_backward_args *bargs,
                                   int64_t T, int64_t pairs, int inference,
                                   smoe_saved_layout *l, smoe_call_shape *cs)
{
    int64_t cap;
    SMOE_FORWARD_IF_ERROR(check_sizes(layer, T, pairs, inference, &cap));
    smoe_saved_layout_make(layer, T, cap, l);
    memset(cs, 0, sizeof *cs);
    cs->E_experts = layer->desc.E;
    cs->saved_need = l->total;
    cs->ws_need = bargs ? backward_ws(layer, T, cap, bargs)
                        : layer->ops->workspace_bytes(layer, T, cap, SMOE_CALL_FORWARD);
    cs->saved_query = "smoe_layer_saved_bytes";
    cs->ws_query = bargs ? "smoe_layer_backward_workspace_bytes"
                         : "smoe_layer_call_workspace_bytes(SMOE_CALL_FORWARD)";
    if (bargs) drouter_slot_of(layer, l, &cs->drouter_slot, &cs->drouter_slot_bytes);
    return SMOE_SUCCESS;
}

smoe_status smoe_layer_forward(smoe_layer *layer, const smoe_forward_args *args, void *saved,
                               size_t saved_bytes, void *workspace, size_t workspace_bytes,
                               void *stream)
{
    const char *fn = "smoe_layer_forward";
    SMOE_REQUIRE_PTR(layer, "layer");
    SMOE_REQUIRE_PTR(args, "args");
    const int general = layer->desc.routing == SMOE_ROUTING_GENERAL;
    SMOE_RETURN_ERROR_IF(args->inference != 0 && args->inference != 1, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.inference = %d, must be 0 or 1", fn, args->inference);
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    smoe_saved_layout l;
    smoe_call_shape cs;
    SMOE_FORWARD_IF_ERROR(call_shape_make(layer, NULL, T, pairs, args->inference, &l, &cs));
    SMOE_FORWARD_IF_ERROR(smoe_forward_validate(layer, fn, args, &cs, saved, saved_bytes,
                                                workspace, workspace_bytes));
    return layer->ops->forward(layer, args, &l, args->inference ? NULL : saved, workspace,
                               stream);
}

smoe_status smoe_layer_backward(smoe_layer *layer, const smoe_backward_args *args,
                                void *saved, size_t saved_bytes, void *workspace,
                                size_t workspace_bytes, void *stream)
{
    const char *fn = "smoe_layer_backward";
    SMOE_REQUIRE_PTR(layer, "layer");
    SMOE_REQUIRE_PTR(args, "args");
    const int general = layer->desc.routing == SMOE_ROUTING_GENERAL;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    smoe_saved_layout l;
    smoe_call_shape cs;
    SMOE_FORWARD_IF_ERROR(call_shape_make(layer, args, T, pairs, 0, &l, &cs));
    SMOE_FORWARD_IF_ERROR(smoe_backward_validate(layer, fn, args, &cs, saved, saved_bytes,
                                                 workspace, workspace_bytes,
                                                 layer->desc.consume_saved));
    return layer->ops->backward(layer, args, &l, saved, workspace, stream);
}

/* ------------------------------------------------------------ routing alone */

smoe_status smoe_route_cpu(const smoe_layer_desc *desc, int64_t T, const float *logits,
                           smoe_routing_result *res)
{
    return smoe_route_cpu_biased(desc, T, logits, NULL, res);
}

smoe_status smoe_route_cpu_biased(const smoe_layer_desc *desc, int64_t T, const float *logits,
                                  const float *expert_bias, smoe_routing_result *res)
{
    const char *fn = "smoe_route_cpu";
    SMOE_FORWARD_IF_ERROR(smoe_desc_validate(desc));
    SMOE_RETURN_ERROR_IF(expert_bias && desc->routing != SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "%s: expert_bias is given but desc.routing = %d has no expert bias "
                         "(SIGMOID_TOPK only)",
                         fn, (int)desc->routing);
    SMOE_RETURN_ERROR_IF(desc->routing == SMOE_ROUTING_GENERAL, SMOE_ERROR_INVALID_VALUE,
                         "%s: GENERAL routing has no router to run", fn);
    SMOE_RETURN_ERROR_IF(T < 1 || T > SMOE_MAX_ROWS, SMOE_ERROR_INVALID_SIZE,
                         "%s: T = %lld, must be in [1, %lld]", fn, (long long)T,
                         (long long)SMOE_MAX_ROWS);
    SMOE_REQUIRE_PTR(logits, "logits");
    SMOE_REQUIRE_PTR(res, "res");
    const int rounding = desc->rounding != SMOE_ROUND_OFF;
    int64_t cap = smoe_desc_row_capacity(desc, T, 0, 0);
    int64_t te = smoe_mul_i64(T, desc->E);
    SMOE_RETURN_ERROR_IF(cap < 0 || cap > SMOE_MAX_ROWS || te < 0 || te > SMOE_MAX_ELEMS,
                         SMOE_ERROR_INVALID_SIZE, "%s: T = %lld is too large", fn, (long long)T);
    if (rounding) {
        SMOE_REQUIRE_PTR(res->pair_token, "res.pair_token");
        SMOE_REQUIRE_PTR(res->pair_expert, "res.pair_expert");
        SMOE_REQUIRE_PTR(res->pair_score, "res.pair_score");
        SMOE_REQUIRE_PTR(res->pairs, "res.pairs");
        SMOE_RETURN_ERROR_IF(res->cap < 0, SMOE_ERROR_INVALID_SIZE, "%s: res.cap = %lld < 0",
                             fn, (long long)res->cap);
    } else {
        SMOE_REQUIRE_PTR(res->expert, "res.expert");
        SMOE_REQUIRE_PTR(res->score, "res.score");
    }

    size_t scratch_bytes = smoe_route_scratch_bytes(desc, T, rounding);
    size_t bytes = scratch_bytes + (size_t)(T + 1) * 4 + (size_t)cap * (4 + 8) + 64;
    char *mem = (char *)malloc(bytes);
    SMOE_RETURN_ERROR_IF(!mem, SMOE_ERROR_OUT_OF_MEMORY, "%s: malloc(%zu) failed", fn, bytes);
    smoe_assignments as;
    as.score = (double *)mem;
    as.expert = (uint16_t *)(mem + (size_t)cap * 8);
    as.token_offset = (int32_t *)(mem + (size_t)cap * 12);
    as.cap = cap;
    as.R = 0;
    void *scratch = mem + (((size_t)cap * 12 + (size_t)(T + 1) * 4 + 63) / 64 * 64);
    smoe_status st = smoe_route_assign(desc, T, rounding, logits, NULL, expert_bias, scratch, &as);
    if (st == SMOE_SUCCESS && rounding && as.R > res->cap)
        st = smoe_fail(SMOE_ERROR_INVALID_SIZE,
                       "%s: res.cap = %lld, token rounding produced %lld pairs (at most %lld "
                       "for this T)",
                       fn, (long long)res->cap, (long long)as.R, (long long)cap);
    if (st == SMOE_SUCCESS) {
        if (rounding) {
            for (int64_t t = 0; t < T; t++)
                for (int32_t a = as.token_offset[t]; a < as.token_offset[t + 1]; a++) {
                    res->pair_token[a] = (int32_t)t;
                    res->pair_expert[a] = as.expert[a];
                    res->pair_score[a] = (float)as.score[a];
                }
            *res->pairs = as.R;
        } else {
            for (int64_t a = 0; a < as.R; a++) {
                res->expert[a] = as.expert[a];
                res->score[a] = (float)as.score[a];
            }
        }
    }
    free(mem);
    return st;
}
