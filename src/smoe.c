/*
 * smoe.c -- the core: errors, the layer object, backend choice, memory
 * sizes, the saved-block layout, and the validation of every argument of
 * forward and backward before a backend sees the call (so that on error
 * nothing is written).
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

static const char *dtype_name(smoe_dtype t)
{
    switch (t) {
    case SMOE_DTYPE_F32: return "F32";
    case SMOE_DTYPE_BF16: return "BF16";
    case SMOE_DTYPE_F64: return "F64";
    }
    return "?";
}

static int is_gated(smoe_activation a)
{
    return a == SMOE_ACT_SWIGLU || a == SMOE_ACT_GEGLU || a == SMOE_ACT_REGLU;
}

/* a*b for non-negative a, b; -1 when it exceeds INT64_MAX. */
static int64_t mul_i64(int64_t a, int64_t b)
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

/* Sizes past these are refused. Tensors of at most 2^44 elements keep every
 * byte count far from overflow and every GPU tile count in an int; tokens
 * and routed rows below 2^31 - 2^16 keep the kernels' int row indices and
 * their block-strided loops (i += blockDim) from wrapping. */
#define SMOE_MAX_ELEMS ((int64_t)1 << 44)
#define SMOE_MAX_ROWS ((int64_t)INT32_MAX - 65536)

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

/* The fields of SIGMOID_TOPK routing (smoe.h, smoe_routing): groups, the
 * scaling factor, and the modes that cannot use them. */
static smoe_status validate_sigmoid_fields(const smoe_layer_desc *desc)
{
    const int sigmoid = desc->routing == SMOE_ROUTING_SIGMOID_TOPK;
    const double c = desc->routed_scaling;
    const long long G = (long long)desc->n_group, g = (long long)desc->topk_group;
    SMOE_RETURN_ERROR_IF(!isfinite(c) || c <= 0.0, SMOE_ERROR_INVALID_VALUE,
                         "desc.routed_scaling = %g, must be finite and > 0 (1.0 is no "
                         "scaling, as smoe_layer_desc_default() sets)",
                         c);
    SMOE_RETURN_ERROR_IF(!sigmoid && c != 1.0, SMOE_ERROR_INVALID_VALUE,
                         "desc.routed_scaling = %g needs SIGMOID_TOPK routing (desc.routing = "
                         "%d scales nothing: leave it 1.0)",
                         c, (int)desc->routing);
    SMOE_RETURN_ERROR_IF(G < 0 || g < 0, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld, desc.topk_group = %lld: must be >= 0", G, g);
    SMOE_RETURN_ERROR_IF((G == 0) != (g == 0), SMOE_ERROR_INVALID_VALUE,
                         "desc.n_group = %lld, desc.topk_group = %lld: both 0 (no groups) or "
                         "both > 0",
                         G, g);
    if (G == 0) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!sigmoid, SMOE_ERROR_INVALID_VALUE,
                         "desc.n_group = %lld: group-limited selection needs SIGMOID_TOPK "
                         "routing (desc.routing = %d); set n_group = topk_group = 0",
                         G, (int)desc->routing);
    const long long E = (long long)desc->E, K = (long long)desc->K;
    SMOE_RETURN_ERROR_IF(E % G != 0, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld does not divide E = %lld", G, E);
    SMOE_RETURN_ERROR_IF(E / G < 2, SMOE_ERROR_INVALID_SIZE,
                         "desc.n_group = %lld gives groups of E/n_group = %lld expert(s); a "
                         "group's key sums its 2 best, so groups need >= 2",
                         G, E / G);
    SMOE_RETURN_ERROR_IF(g > G, SMOE_ERROR_INVALID_SIZE,
                         "desc.topk_group = %lld, must be in [1, n_group = %lld]", g, G);
    SMOE_RETURN_ERROR_IF(g * (E / G) < K, SMOE_ERROR_INVALID_SIZE,
                         "desc.topk_group = %lld groups of %lld experts hold fewer than K = %lld "
                         "experts",
                         g, E / G, K);
    return SMOE_SUCCESS;
}

smoe_status smoe_desc_validate(const smoe_layer_desc *desc)
{
    SMOE_RETURN_ERROR_IF(!desc, SMOE_ERROR_NULL_POINTER, "desc is NULL");
    SMOE_RETURN_ERROR_IF(desc->d <= 0, SMOE_ERROR_INVALID_SIZE, "desc.d = %lld, must be > 0",
                         (long long)desc->d);
    SMOE_RETURN_ERROR_IF(desc->n <= 0, SMOE_ERROR_INVALID_SIZE, "desc.n = %lld, must be > 0",
                         (long long)desc->n);
    SMOE_RETURN_ERROR_IF(desc->E <= 0 || desc->E > INT32_MAX, SMOE_ERROR_INVALID_SIZE,
                         "desc.E = %lld, must be in [1, %d]", (long long)desc->E, INT32_MAX);
    SMOE_RETURN_ERROR_IF((unsigned)desc->routing > SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.routing = %d is not a smoe_routing", (int)desc->routing);
    if (desc->routing == SMOE_ROUTING_GENERAL) {
        /* K is not read by GENERAL routing; 0 (the default) is fine. */
        SMOE_RETURN_ERROR_IF(desc->K < 0 || desc->K > desc->E, SMOE_ERROR_INVALID_SIZE,
                             "desc.K = %lld, must be in [0, E = %lld] (not read by GENERAL)",
                             (long long)desc->K, (long long)desc->E);
    } else {
        SMOE_RETURN_ERROR_IF(desc->K <= 0 || desc->K > desc->E, SMOE_ERROR_INVALID_SIZE,
                             "desc.K = %lld, must be in [1, E = %lld]", (long long)desc->K,
                             (long long)desc->E);
    }
    SMOE_RETURN_ERROR_IF((unsigned)desc->activation > SMOE_ACT_GELU, SMOE_ERROR_INVALID_VALUE,
                         "desc.activation = %d is not a smoe_activation",
                         (int)desc->activation);
    SMOE_RETURN_ERROR_IF((unsigned)desc->w1_layout > SMOE_W1_CONCATENATED,
                         SMOE_ERROR_INVALID_VALUE, "desc.w1_layout = %d is not a smoe_w1_layout",
                         (int)desc->w1_layout);
    SMOE_RETURN_ERROR_IF(desc->has_bias != 0 && desc->has_bias != 1, SMOE_ERROR_INVALID_VALUE,
                         "desc.has_bias = %d, must be 0 or 1", desc->has_bias);
    SMOE_RETURN_ERROR_IF(desc->renormalize != 0 && desc->renormalize != 1,
                         SMOE_ERROR_INVALID_VALUE, "desc.renormalize = %d, must be 0 or 1",
                         desc->renormalize);
    SMOE_RETURN_ERROR_IF((unsigned)desc->rounding > SMOE_ROUND_NEAREST, SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d is not a smoe_rounding", (int)desc->rounding);
    SMOE_RETURN_ERROR_IF(desc->round_tile <= 0 || desc->round_tile > INT32_MAX,
                         SMOE_ERROR_INVALID_SIZE, "desc.round_tile = %lld, must be in [1, %d]",
                         (long long)desc->round_tile, INT32_MAX);
    SMOE_RETURN_ERROR_IF(desc->rounding != SMOE_ROUND_OFF &&
                             desc->routing == SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d: token rounding ranks tokens by their softmax "
                         "probabilities, which SIGMOID_TOPK routing has none of (use "
                         "TOPK_SOFTMAX or SOFTMAX_TOPK, or rounding off)",
                         (int)desc->rounding);
    SMOE_RETURN_ERROR_IF(desc->rounding != SMOE_ROUND_OFF &&
                             desc->routing == SMOE_ROUTING_GENERAL,
                         SMOE_ERROR_INVALID_VALUE,
                         "desc.rounding = %d needs TOPK_SOFTMAX or SOFTMAX_TOPK routing, "
                         "not GENERAL",
                         (int)desc->rounding);
    SMOE_FORWARD_IF_ERROR(validate_sigmoid_fields(desc));
    SMOE_RETURN_ERROR_IF((unsigned)desc->dtype > SMOE_DTYPE_F64, SMOE_ERROR_INVALID_VALUE,
                         "desc.dtype = %d is not a smoe_dtype", (int)desc->dtype);
    SMOE_RETURN_ERROR_IF((unsigned)desc->backend > SMOE_BACKEND_SM90, SMOE_ERROR_INVALID_VALUE,
                         "desc.backend = %d is not a smoe_backend", (int)desc->backend);
    SMOE_RETURN_ERROR_IF(desc->dtype == SMOE_DTYPE_F64 && (desc->backend == SMOE_BACKEND_CUDA ||
                                                           desc->backend == SMOE_BACKEND_SM90),
                         SMOE_ERROR_UNSUPPORTED,
                         "desc.dtype = F64 runs on the CPU backend only (desc.backend = %d)",
                         (int)desc->backend);
    SMOE_RETURN_ERROR_IF(desc->device < 0, SMOE_ERROR_INVALID_VALUE,
                         "desc.device = %d, must be >= 0", desc->device);
    SMOE_RETURN_ERROR_IF(desc->consume_saved != 0 && desc->consume_saved != 1,
                         SMOE_ERROR_INVALID_VALUE, "desc.consume_saved = %d, must be 0 or 1",
                         desc->consume_saved);
    /* Weight tensors must be indexable: E * 2n * d elements. */
    int64_t h_cols = is_gated(desc->activation) ? mul_i64(2, desc->n) : desc->n;
    int64_t w1 = mul_i64(mul_i64(desc->E, h_cols), desc->d);
    int64_t wr = mul_i64(desc->E, desc->d);
    SMOE_RETURN_ERROR_IF(h_cols < 0 || w1 < 0 || w1 > SMOE_MAX_ELEMS || wr > SMOE_MAX_ELEMS ||
                             h_cols > INT32_MAX || desc->d > INT32_MAX,
                         SMOE_ERROR_INVALID_SIZE,
                         "weights of E = %lld, n = %lld, d = %lld are too large",
                         (long long)desc->E, (long long)desc->n, (long long)desc->d);
    return SMOE_SUCCESS;
}

/* ------------------------------------------------------------ capacity, layout */

int64_t smoe_desc_row_capacity(const smoe_layer_desc *desc, int64_t T, int64_t pairs,
                               int inference)
{
    if (desc->routing == SMOE_ROUTING_GENERAL) return pairs;
    int64_t tk = mul_i64(T, desc->K);
    if (inference || desc->rounding == SMOE_ROUND_OFF || desc->rounding == SMOE_ROUND_DOWN)
        return tk;
    /* Rounding up or to nearest adds at most M-1 rows per expert. */
    int64_t te = mul_i64(T, desc->E);
    int64_t extra = add_i64(tk, mul_i64(desc->E, desc->round_tile - 1));
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
    off = align_up(off + (size_t)cap * 4);
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
    v.assign_expert = (int32_t *)(b + l->assign_expert);
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
    int64_t te = mul_i64(T, d->E);
    int64_t td = mul_i64(T, d->d);
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
    int64_t hsz = mul_i64(cap, layer->h_cols);
    int64_t dsz = mul_i64(cap, d->d);
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
    layer->gated = is_gated(desc->activation);
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

size_t smoe_layer_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t pairs)
{
    int64_t cap;
    if (!layer) {
        smoe_fail(SMOE_ERROR_NULL_POINTER, "smoe_layer_workspace_bytes: layer is NULL");
        return 0;
    }
    if (check_sizes(layer, T, pairs, 0, &cap) != SMOE_SUCCESS) return 0;
    return layer->ops->workspace_bytes(layer, T, cap);
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

/* ------------------------------------------------------------ validation */

#define REQUIRE_PTR(p, what)                                                       \
    SMOE_RETURN_ERROR_IF(!(p), SMOE_ERROR_NULL_POINTER, "%s: %s is NULL", fn, what)

/* The memory one call touches: each argument's extent in bytes and whether
 * the call writes it, for smoe.h's alignment and overlap rules. */
typedef struct span {
    const char *name;
    uintptr_t lo, hi; /* [lo, hi) */
    int out;
} span;

typedef struct span_set {
    span s[24];
    int n;
} span_set;

/* Adds p (bytes long) unless it is NULL; refuses it unless it is aligned to
 * `align` (elem: the element's size, for the message). */
static smoe_status span_add(span_set *set, const char *fn, const char *name, const void *p,
                            size_t bytes, size_t elem, size_t align, int out)
{
    if (!p) return SMOE_SUCCESS;
    if (align < elem) align = elem;
    SMOE_RETURN_ERROR_IF((uintptr_t)p % align != 0, SMOE_ERROR_INVALID_SIZE,
                         "%s: %s = %p is not %zu-byte aligned%s", fn, name, p, align,
                         align > elem ? " (the backend loads 16-byte vectors)" : "");
    if (bytes == 0 || set->n == (int)(sizeof set->s / sizeof set->s[0])) return SMOE_SUCCESS;
    span *sp = &set->s[set->n++];
    sp->name = name;
    sp->lo = (uintptr_t)p;
    sp->hi = sp->lo + bytes < sp->lo ? UINTPTR_MAX : sp->lo + bytes;
    sp->out = out;
    return SMOE_SUCCESS;
}

/* No output (or saved block, or workspace) shares a byte with anything else. */
static smoe_status spans_disjoint(const char *fn, const span_set *set)
{
    for (int i = 0; i < set->n; i++)
        for (int j = 0; j < i; j++) {
            const span *a = &set->s[i], *b = &set->s[j];
            if (!a->out && !b->out) continue;
            SMOE_RETURN_ERROR_IF(a->lo < b->hi && b->lo < a->hi, SMOE_ERROR_INVALID_VALUE,
                                 "%s: %s [%p, %zu bytes) overlaps %s [%p, %zu bytes); outputs, "
                                 "the saved block and the workspace may not overlap each other "
                                 "or an input",
                                 fn, a->name, (void *)a->lo, (size_t)(a->hi - a->lo), b->name,
                                 (void *)b->lo, (size_t)(b->hi - b->lo));
        }
    return SMOE_SUCCESS;
}

static smoe_status check_buffer(const char *fn, const char *name, size_t given, size_t need,
                                int64_t T, int64_t pairs, const char *query)
{
    SMOE_RETURN_ERROR_IF(given < need, SMOE_ERROR_INVALID_SIZE,
                         "%s: %s_bytes = %zu, but this call (T = %lld, pairs = %lld) needs %zu "
                         "(%s)",
                         fn, name, given, (long long)T, (long long)pairs, need, query);
    return SMOE_SUCCESS;
}

/* The first repeated expert in pairs [p0, p1) of one token, or -1. Short
 * runs compare pairs; longer ones mark experts in a bitmap on the stack,
 * 2^16 experts per pass (nothing allocated, nothing of the caller's
 * written, not even the workspace). */
static int64_t first_duplicate(const int32_t *ex, int64_t p0, int64_t p1, int64_t E)
{
    enum { PASS = 1 << 16 };
    if (p1 - p0 <= 32) {
        for (int64_t i = p0 + 1; i < p1; i++)
            for (int64_t j = p0; j < i; j++)
                if (ex[j] == ex[i]) return i;
        return -1;
    }
    uint64_t seen[PASS / 64];
    for (int64_t base = 0; base < E; base += PASS) {
        const int64_t span = E - base < PASS ? E - base : PASS;
        memset(seen, 0, (size_t)((span + 63) / 64) * sizeof seen[0]);
        for (int64_t i = p0; i < p1; i++) {
            const int64_t e = (int64_t)ex[i] - base;
            if (e < 0 || e >= span) continue;
            if (seen[e >> 6] >> (e & 63) & 1) return i;
            seen[e >> 6] |= (uint64_t)1 << (e & 63);
        }
    }
    return -1;
}

/* GENERAL triples in host memory: token in [0, T), expert in [0, E),
 * tokens non-decreasing, each (token, expert) once, finite scores. */
static smoe_status check_triples(const smoe_layer *layer, const smoe_forward_args *a)
{
    const char *fn = "smoe_layer_forward";
    const int64_t E = layer->desc.E;
    for (int64_t i = 0; i < a->pairs; i++) {
        int32_t t = a->pair_token[i], e = a->pair_expert[i];
        float s = a->pair_score[i];
        SMOE_RETURN_ERROR_IF(t < 0 || t >= a->T, SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_token[%lld] = %d, must be in [0, T = %lld)", fn,
                             (long long)i, (int)t, (long long)a->T);
        SMOE_RETURN_ERROR_IF(e < 0 || e >= E, SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_expert[%lld] = %d, must be in [0, E = %lld)", fn,
                             (long long)i, (int)e, (long long)E);
        SMOE_RETURN_ERROR_IF(!isfinite(s), SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_score[%lld] = %g is not finite", fn, (long long)i,
                             (double)s);
        SMOE_RETURN_ERROR_IF(i > 0 && t < a->pair_token[i - 1], SMOE_ERROR_INVALID_VALUE,
                             "%s: pair_token[%lld] = %d < pair_token[%lld] = %d: triples must "
                             "be sorted by token",
                             fn, (long long)i, (int)t, (long long)(i - 1),
                             (int)a->pair_token[i - 1]);
    }
    /* Duplicates, token by token (the tokens are sorted now). */
    for (int64_t p0 = 0, p1; p0 < a->pairs; p0 = p1) {
        for (p1 = p0 + 1; p1 < a->pairs && a->pair_token[p1] == a->pair_token[p0]; p1++) {
        }
        const int64_t i = first_duplicate(a->pair_expert, p0, p1, E);
        SMOE_RETURN_ERROR_IF(i >= 0, SMOE_ERROR_INVALID_VALUE,
                             "%s: (token %d, expert %d) is given twice (again at pair %lld)", fn,
                             (int)a->pair_token[i], (int)a->pair_expert[i], (long long)i);
    }
    return SMOE_SUCCESS;
}

smoe_status smoe_forward_validate(const smoe_layer *layer, const char *fn,
                                  const smoe_forward_args *args, const smoe_call_shape *cs,
                                  const void *saved, size_t saved_bytes, const void *workspace,
                                  size_t workspace_bytes)
{
    const smoe_layer_desc *d = &layer->desc;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int training = !args->inference;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    if (T > 0 || !cs->empty_ok) REQUIRE_PTR(args->x, "args.x");
    REQUIRE_PTR(args->w1, "args.w1");
    REQUIRE_PTR(args->w2, "args.w2");
    if (T > 0 || !cs->empty_ok) REQUIRE_PTR(args->out, "args.out");
    if (d->has_bias) {
        REQUIRE_PTR(args->b1, "args.b1 (the layer has biases)");
        REQUIRE_PTR(args->b2, "args.b2 (the layer has biases)");
    } else {
        SMOE_RETURN_ERROR_IF(args->b1 || args->b2, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.b%d is given but the layer has no bias (desc.has_bias = 0)",
                             fn, args->b1 ? 1 : 2);
    }
    if (general) {
        if (pairs > 0) {
            REQUIRE_PTR(args->pair_token, "args.pair_token (GENERAL routing)");
            REQUIRE_PTR(args->pair_expert, "args.pair_expert (GENERAL routing)");
            REQUIRE_PTR(args->pair_score, "args.pair_score (GENERAL routing)");
        }
        SMOE_RETURN_ERROR_IF(args->router_logits != NULL, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.router_logits is given but GENERAL routing has no router",
                             fn);
    } else {
        REQUIRE_PTR(args->router_w, "args.router_w");
    }
    SMOE_RETURN_ERROR_IF(args->expert_bias && d->routing != SMOE_ROUTING_SIGMOID_TOPK,
                         SMOE_ERROR_INVALID_VALUE,
                         "%s: args.expert_bias is given but desc.routing = %d has no expert "
                         "bias (SIGMOID_TOPK only)",
                         fn, (int)d->routing);
    if (training) REQUIRE_PTR(saved, "saved (a training forward, args.inference = 0)");
    REQUIRE_PTR(workspace, "workspace");
    if (training)
        SMOE_FORWARD_IF_ERROR(check_buffer(fn, "saved", saved_bytes, cs->saved_need, T, pairs,
                                           cs->saved_query));
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "workspace", workspace_bytes, cs->ws_need, T, pairs,
                                       cs->ws_query));

    /* alignment and overlap */
    const size_t es = smoe_dtype_size(d->dtype), va = layer->vec_align;
    const size_t t = (size_t)T, dd = (size_t)d->d, n = (size_t)d->n, E = (size_t)d->E;
    const size_t Ex = (size_t)cs->E_experts, hc = (size_t)layer->h_cols, np = (size_t)pairs;
    span_set sp;
    sp.n = 0;
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.x", args->x, t * dd * es, es, va, 0));
    if (!general)
        SMOE_FORWARD_IF_ERROR(
            span_add(&sp, fn, "args.router_w", args->router_w, E * dd * es, es, va, 0));
    if (general) {
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_token", args->pair_token, np * 4, 4, 4, 0));
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_expert", args->pair_expert, np * 4, 4, 4, 0));
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.pair_score", args->pair_score, np * 4, 4, 4, 0));
    }
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w1", args->w1, Ex * hc * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b1", args->b1, Ex * hc * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w2", args->w2, Ex * dd * n * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b2", args->b2, Ex * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.out", args->out, t * dd * es, es, va, 1));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.expert_bias", args->expert_bias, E * 4, 4, 4, 0));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.router_logits", args->router_logits, t * E * 4, 4, 4, 1));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.expert_counts", args->expert_counts, E * 4, 4, 4, 1));
    if (training)
        SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "saved", saved, cs->saved_need, 16, 16, 1));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "workspace", workspace, cs->ws_need, 16, 16, 1));
    SMOE_FORWARD_IF_ERROR(spans_disjoint(fn, &sp));

    if (general && layer->backend == SMOE_BACKEND_CPU)
        SMOE_FORWARD_IF_ERROR(check_triples(layer, args));
    return SMOE_SUCCESS;
}

smoe_status smoe_layer_forward(smoe_layer *layer, const smoe_forward_args *args, void *saved,
                               size_t saved_bytes, void *workspace, size_t workspace_bytes,
                               void *stream)
{
    const char *fn = "smoe_layer_forward";
    REQUIRE_PTR(layer, "layer");
    REQUIRE_PTR(args, "args");
    const int general = layer->desc.routing == SMOE_ROUTING_GENERAL;
    SMOE_RETURN_ERROR_IF(args->inference != 0 && args->inference != 1, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.inference = %d, must be 0 or 1", fn, args->inference);
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    int64_t cap;
    SMOE_FORWARD_IF_ERROR(check_sizes(layer, T, pairs, args->inference, &cap));
    smoe_saved_layout l;
    smoe_saved_layout_make(layer, T, cap, &l);
    smoe_call_shape cs;
    memset(&cs, 0, sizeof cs);
    cs.E_experts = layer->desc.E;
    cs.saved_need = l.total;
    cs.ws_need = layer->ops->workspace_bytes(layer, T, cap);
    cs.saved_query = "smoe_layer_saved_bytes";
    cs.ws_query = "smoe_layer_workspace_bytes";
    SMOE_FORWARD_IF_ERROR(smoe_forward_validate(layer, fn, args, &cs, saved, saved_bytes,
                                                workspace, workspace_bytes));
    return layer->ops->forward(layer, args, &l, args->inference ? NULL : saved, workspace,
                               stream);
}

static smoe_status check_grad(const char *fn, const smoe_layer *layer, const smoe_grad *g,
                              const char *name, int allowed, const char *why, int f32_only)
{
    if (!g->ptr) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!allowed, SMOE_ERROR_INVALID_VALUE, "%s: args.%s.ptr is given but %s",
                         fn, name, why);
    smoe_dtype want = layer->desc.dtype;
    if (f32_only) {
        SMOE_RETURN_ERROR_IF(g->dtype != SMOE_DTYPE_F32, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.%s.dtype = %d, must be F32", fn, name, (int)g->dtype);
    } else {
        SMOE_RETURN_ERROR_IF(g->dtype != SMOE_DTYPE_F32 && g->dtype != want,
                             SMOE_ERROR_INVALID_VALUE,
                             "%s: args.%s.dtype = %d, must be F32 or the layer's %s", fn, name,
                             (int)g->dtype, dtype_name(want));
    }
    SMOE_RETURN_ERROR_IF(g->accumulate != 0 && g->accumulate != 1, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.%s.accumulate = %d, must be 0 or 1", fn, name, g->accumulate);
    return SMOE_SUCCESS;
}

/* A gradient output's extent (elems of its dtype), aligned as the layer's
 * tensors unless vec is 0. */
static smoe_status grad_span(span_set *sp, const char *fn, const char *name, const smoe_grad *g,
                             size_t elems, size_t vec_align)
{
    const size_t gs = smoe_dtype_size(g->dtype);
    return span_add(sp, fn, name, g->ptr, elems * gs, gs, vec_align, 1);
}

smoe_status smoe_backward_validate(const smoe_layer *layer, const char *fn,
                                   const smoe_backward_args *args, const smoe_call_shape *cs,
                                   const void *saved, size_t saved_bytes, const void *workspace,
                                   size_t workspace_bytes, int saved_out)
{
    const smoe_layer_desc *d = &layer->desc;
    const int general = d->routing == SMOE_ROUTING_GENERAL;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    const int some = T > 0 || !cs->empty_ok;
    if (some) REQUIRE_PTR(args->x, "args.x");
    REQUIRE_PTR(args->w1, "args.w1");
    REQUIRE_PTR(args->w2, "args.w2");
    if (some) REQUIRE_PTR(args->dout, "args.dout");
    if (!general) REQUIRE_PTR(args->router_w, "args.router_w");
    if (d->has_bias) {
        REQUIRE_PTR(args->b2, "args.b2 (the layer has biases)");
    } else {
        SMOE_RETURN_ERROR_IF(args->b2 != NULL, SMOE_ERROR_INVALID_VALUE,
                             "%s: args.b2 is given but the layer has no bias", fn);
    }
    SMOE_RETURN_ERROR_IF(general && args->dlogits_extra != NULL, SMOE_ERROR_INVALID_VALUE,
                         "%s: args.dlogits_extra is given but GENERAL routing has no router",
                         fn);
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dx, "dx", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->drouter_w, "drouter_w", !general,
                                     "GENERAL routing has no router weight", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dw1, "dw1", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->db1, "db1", d->has_bias,
                                     "the layer has no bias", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dw2, "dw2", 1, "", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->db2, "db2", d->has_bias,
                                     "the layer has no bias", 0));
    SMOE_FORWARD_IF_ERROR(check_grad(fn, layer, &args->dpair_score, "dpair_score", general,
                                     "only GENERAL routing has pair scores", 1));
    REQUIRE_PTR(saved, "saved");
    REQUIRE_PTR(workspace, "workspace");
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "saved", saved_bytes, cs->saved_need, T, pairs,
                                       cs->saved_query));
    SMOE_FORWARD_IF_ERROR(check_buffer(fn, "workspace", workspace_bytes, cs->ws_need, T, pairs,
                                       cs->ws_query));

    const size_t es = smoe_dtype_size(d->dtype), va = layer->vec_align;
    const size_t t = (size_t)T, dd = (size_t)d->d, n = (size_t)d->n, E = (size_t)d->E;
    const size_t Ex = (size_t)cs->E_experts, hc = (size_t)layer->h_cols, np = (size_t)pairs;
    span_set sp;
    sp.n = 0;
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.x", args->x, t * dd * es, es, va, 0));
    if (!general)
        SMOE_FORWARD_IF_ERROR(
            span_add(&sp, fn, "args.router_w", args->router_w, E * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w1", args->w1, Ex * hc * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.w2", args->w2, Ex * dd * n * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.b2", args->b2, Ex * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "args.dout", args->dout, t * dd * es, es, va, 0));
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "args.dlogits_extra", args->dlogits_extra, t * E * 4, 4, 4, 0));
    /* a consumed block is written: an output, so it may not overlap an input */
    SMOE_FORWARD_IF_ERROR(
        span_add(&sp, fn, "saved", saved, cs->saved_need, 16, 16, saved_out != 0));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dx.ptr", &args->dx, t * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.drouter_w.ptr", &args->drouter_w, E * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dw1.ptr", &args->dw1, Ex * hc * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.db1.ptr", &args->db1, Ex * hc, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dw2.ptr", &args->dw2, Ex * dd * n, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.db2.ptr", &args->db2, Ex * dd, va));
    SMOE_FORWARD_IF_ERROR(grad_span(&sp, fn, "args.dpair_score.ptr", &args->dpair_score, np, 4));
    SMOE_FORWARD_IF_ERROR(span_add(&sp, fn, "workspace", workspace, cs->ws_need, 16, 16, 1));
    return spans_disjoint(fn, &sp);
}

smoe_status smoe_layer_backward(smoe_layer *layer, const smoe_backward_args *args,
                                void *saved, size_t saved_bytes, void *workspace,
                                size_t workspace_bytes, void *stream)
{
    const char *fn = "smoe_layer_backward";
    REQUIRE_PTR(layer, "layer");
    REQUIRE_PTR(args, "args");
    const int general = layer->desc.routing == SMOE_ROUTING_GENERAL;
    const int64_t T = args->T, pairs = general ? args->pairs : 0;
    int64_t cap;
    SMOE_FORWARD_IF_ERROR(check_sizes(layer, T, pairs, 0, &cap));
    smoe_saved_layout l;
    smoe_saved_layout_make(layer, T, cap, &l);
    smoe_call_shape cs;
    memset(&cs, 0, sizeof cs);
    cs.E_experts = layer->desc.E;
    cs.saved_need = l.total;
    cs.ws_need = layer->ops->workspace_bytes(layer, T, cap);
    cs.saved_query = "smoe_layer_saved_bytes";
    cs.ws_query = "smoe_layer_workspace_bytes";
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
    REQUIRE_PTR(logits, "logits");
    REQUIRE_PTR(res, "res");
    const int rounding = desc->rounding != SMOE_ROUND_OFF;
    int64_t cap = smoe_desc_row_capacity(desc, T, 0, 0);
    int64_t te = mul_i64(T, desc->E);
    SMOE_RETURN_ERROR_IF(cap < 0 || cap > SMOE_MAX_ROWS || te < 0 || te > SMOE_MAX_ELEMS,
                         SMOE_ERROR_INVALID_SIZE, "%s: T = %lld is too large", fn, (long long)T);
    if (rounding) {
        REQUIRE_PTR(res->pair_token, "res.pair_token");
        REQUIRE_PTR(res->pair_expert, "res.pair_expert");
        REQUIRE_PTR(res->pair_score, "res.pair_score");
        REQUIRE_PTR(res->pairs, "res.pairs");
        SMOE_RETURN_ERROR_IF(res->cap < 0, SMOE_ERROR_INVALID_SIZE, "%s: res.cap = %lld < 0",
                             fn, (long long)res->cap);
    } else {
        REQUIRE_PTR(res->expert, "res.expert");
        REQUIRE_PTR(res->score, "res.score");
    }

    size_t scratch_bytes = smoe_route_scratch_bytes(desc, T, rounding);
    size_t bytes = scratch_bytes + (size_t)(T + 1) * 4 + (size_t)cap * (4 + 8) + 64;
    char *mem = (char *)malloc(bytes);
    SMOE_RETURN_ERROR_IF(!mem, SMOE_ERROR_OUT_OF_MEMORY, "%s: malloc(%zu) failed", fn, bytes);
    smoe_assignments as;
    as.score = (double *)mem;
    as.expert = (int32_t *)(mem + (size_t)cap * 8);
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
