/*
 * smoe_internal.h -- what the core (src/smoe.c, src/validate.c) shares with
 * the backends (src/cpu/, src/cuda/): the layer object, the error helpers,
 * the layout of the saved-for-backward block, and the backend operations
 * table.
 *
 * Division of labour: the core validates every argument (src/smoe.c: T and
 * pairs; src/validate.c: the description, pointers, flags, buffer sizes,
 * host-visible GENERAL triples on the CPU) before a backend sees a call, so
 * a backend may assume its arguments are well formed except where it alone
 * can check them (device-resident data).
 */
#ifndef SMOE_INTERNAL_H
#define SMOE_INTERNAL_H

#include "smoe.h"

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ errors */

/* Records a printf-style message as this thread's smoe_last_error() and
 * returns `status`, so callers can `return smoe_fail(...)`. */
smoe_status smoe_fail(smoe_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void smoe_clear_error(void);

#define SMOE_RETURN_ERROR_IF(cond, status, ...) \
    do { if (cond) return smoe_fail((status), __VA_ARGS__); } while (0)
#define SMOE_FORWARD_IF_ERROR(expr) \
    do { smoe_status smoe_st_ = (expr); if (smoe_st_ != SMOE_SUCCESS) return smoe_st_; } while (0)

/* ------------------------------------------------------------ layer */

typedef struct smoe_backend_ops smoe_backend_ops;

struct smoe_layer {
    smoe_layer_desc desc;
    uint64_t id;          /* unique in the process: stamped into saved blocks */
    int gated;            /* activation has a gate half */
    int64_t h_cols;       /* columns of H (rows of W1 per expert): 2n or n */
    smoe_backend backend; /* resolved, never AUTO */
    const smoe_backend_ops *ops;
    void *state;          /* backend private (cuBLAS handle, device props...) */
    size_t vec_align;     /* alignment the backend needs of every tensor of the
                             layer's dtype and every gradient (1: the element's) */
    char path_name[96];
};

size_t smoe_dtype_size(smoe_dtype t);

/* Rows the routing can produce for T tokens (and `pairs` GENERAL triples):
 * T*K for token choice, pairs for GENERAL, and for token rounding up or to
 * nearest min(T*E, T*K + E*(M-1)). Inference ignores rounding. */
int64_t smoe_row_capacity(const smoe_layer *layer, int64_t T, int64_t pairs, int inference);

/* Does the backward need the fp32 router logits (T, E) kept? True for
 * SOFTMAX_TOPK and token rounding (the full softmax is differentiated). */
int smoe_saves_logits(const smoe_layer *layer);

/* ------------------------------------------------------------ saved block */

/* The saved-for-backward block, identical on every backend. Each section
 * starts at a multiple of SMOE_ALIGN bytes from the block's start.
 *
 *   header       smoe_saved_header     written last by a training forward
 *                                      (SMOE_ALIGN bytes)
 * "Assignments" are the routed (token, expert) pairs in token-major order
 * (token ascending, then the routing's order within a token): for token
 * choice assignment t*K + k is the token's k-th choice. "Rows" are the same
 * pairs sorted by expert, then by token: the GEMMs' row order.
 *
 *   h            (cap, h_cols) dtype   pre-activation W1 x + b1, per row,
 *                                      always in interleaved order (gate j
 *                                      at column 2j, up j at 2j+1) whatever
 *                                      W1's layout; non-gated: n columns
 *   row_score    (cap) fp32            routing score of each row
 *   row_token    (cap) int32           token of each row (gather index)
 *   assign_row   (cap) int32           row of each assignment
 *   assign_expert(cap) uint16          expert of each assignment (16 bits:
 *                                      E <= SMOE_MAX_EXPERTS)
 *   token_offset (T+1) int32           assignments of token t are
 *                                      [token_offset[t], token_offset[t+1])
 *   expert_offset(E+1) int32           rows of expert e are
 *                                      [expert_offset[e], expert_offset[e+1]);
 *                                      expert_offset[E] is R
 *   logits       (T, E) fp32           only if smoe_saves_logits()
 * Entries past R (cap > R) are unspecified and never read.
 * F64 layers (CPU only): row_score and logits hold double instead of fp32,
 * so the fp64 reference keeps its router exact (the view's float pointers
 * then point at doubles).
 */
#define SMOE_ALIGN 256

/* The saved block keeps each pair's expert in 16 bits (128 KiB less per 64K
 * pairs than int32), so a layer has at most this many experts. */
#define SMOE_MAX_EXPERTS 65536

typedef struct smoe_saved_layout {
    int64_t T, cap;
    size_t header, h, row_score, row_token, assign_row, assign_expert;
    size_t token_offset, expert_offset, logits; /* logits: 0 if absent */
    size_t total;
} smoe_saved_layout;

void smoe_saved_layout_make(const smoe_layer *layer, int64_t T, int64_t cap,
                            smoe_saved_layout *out);

/* Typed views of a saved block (host or device addresses alike). */
typedef struct smoe_saved_view {
    struct smoe_saved_header *header;
    void *h;
    float *row_score;
    int32_t *row_token, *assign_row, *token_offset, *expert_offset;
    uint16_t *assign_expert;
    float *logits; /* NULL if absent */
} smoe_saved_view;

smoe_saved_view smoe_saved_view_make(const smoe_saved_layout *l, void *base);

/* The header a training forward writes at the start of its saved block and
 * the backward checks (on the host for the CPU backend, in the first kernel
 * of the call on the GPU). `check` is a hash of the other fields (status
 * excluded), so a block that no forward filled fails the check. status is
 * 0 for a forward that completed, else the SMOE_DEV_* code of the
 * device-side check that failed. consumed is 0 from the forward and set by
 * a consuming backward (desc.consume_saved). 48 bytes; the section is SMOE_ALIGN. */
#define SMOE_SAVED_MAGIC 0x65766173656f6d73ull /* "smoesave" */

typedef struct smoe_saved_header {
    uint64_t magic;
    uint64_t layer_id;
    int64_t T;
    int64_t pairs; /* GENERAL: the forward's pairs; 0 otherwise */
    uint64_t check;
    int32_t status;
    int32_t consumed; /* 1: a backward of a consume_saved layer wrote over
                         the block (not hashed, as status) */
} smoe_saved_header;

#if defined(__CUDACC__)
#define SMOE_HOST_DEVICE __host__ __device__
#else
#define SMOE_HOST_DEVICE
#endif

/* The check word of a header: splitmix64's finaliser over its fields. */
static inline SMOE_HOST_DEVICE uint64_t smoe_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline SMOE_HOST_DEVICE uint64_t smoe_saved_header_hash(const smoe_saved_header *h)
{
    uint64_t z = smoe_mix64(h->magic);
    z = smoe_mix64(z ^ h->layer_id);
    z = smoe_mix64(z ^ (uint64_t)h->T);
    return smoe_mix64(z ^ (uint64_t)h->pairs);
}

/* The header a forward of `layer` with T tokens (and `pairs`) writes. */
smoe_saved_header smoe_saved_header_make(const smoe_layer *layer, int64_t T, int64_t pairs);

/* Host check of a header (CPU backend): SMOE_SUCCESS or INVALID_VALUE with
 * a message saying what does not match. */
smoe_status smoe_saved_header_check(const smoe_layer *layer, const smoe_saved_header *h,
                                    int64_t T, int64_t pairs);

/* ------------------------------------------------------------ validation */

/* Refuses a NULL pointer argument, naming it (`fn`: the calling function's
 * name, in scope). */
#define SMOE_REQUIRE_PTR(p, what)                                                       \
    SMOE_RETURN_ERROR_IF(!(p), SMOE_ERROR_NULL_POINTER, "%s: %s is NULL", fn, what)

/* Sizes past these are refused. Tensors of at most 2^44 elements keep every
 * byte count far from overflow and every GPU tile count in an int; tokens
 * and routed rows below 2^31 - 2^16 keep the kernels' int row indices and
 * their block-strided loops (i += blockDim) from wrapping. */
#define SMOE_MAX_ELEMS ((int64_t)1 << 44)
#define SMOE_MAX_ROWS ((int64_t)INT32_MAX - 65536)

/* a*b for non-negative a, b; -1 when it exceeds INT64_MAX (smoe.c). */
int64_t smoe_mul_i64(int64_t a, int64_t b);

/* Does the activation have a gate half (H has 2n columns)? (smoe.c) */
int smoe_is_gated(smoe_activation a);

/* What a call needs beyond the layer's description: the experts in the
 * weight tensors (the layer's E, or E/P on an expert-parallel rank), whether
 * T = 0 is allowed (an expert-parallel rank may have no tokens), and the
 * saved block's and workspace's sizes with the query that gives them. */
typedef struct smoe_call_shape {
    int64_t E_experts;
    int empty_ok;
    size_t saved_need, ws_need;
    const char *saved_query, *ws_query;
    /* a consume_saved backward's router slot in the saved block (smoe.h's
     * smoe_layer_drouter_slot): offset and bytes, bytes 0 where none */
    size_t drouter_slot, drouter_slot_bytes;
} smoe_call_shape;

/* Every check of smoe.h's rules on a forward's / backward's arguments (T
 * and pairs already checked): pointers, flags, buffer sizes, alignment,
 * overlap, host-visible GENERAL triples. */
smoe_status smoe_forward_validate(const smoe_layer *layer, const char *fn,
                                  const smoe_forward_args *args, const smoe_call_shape *cs,
                                  const void *saved, size_t saved_bytes, const void *workspace,
                                  size_t workspace_bytes);
smoe_status smoe_backward_validate(const smoe_layer *layer, const char *fn,
                                   const smoe_backward_args *args, const smoe_call_shape *cs,
                                   const void *saved, size_t saved_bytes, const void *workspace,
                                   size_t workspace_bytes, int saved_out);

/* ------------------------------------------------------------ backends */

struct smoe_backend_ops {
    /* Scratch for one call of the kind `call` (smoe_call) with T tokens and
     * a row capacity of `cap`; SMOE_CALL_ANY: the larger of the two. A
     * call's workspace layout is the same whatever size it was asked for:
     * each call's buffers lie below its own size. */
    size_t (*workspace_bytes)(const smoe_layer *layer, int64_t T, int64_t cap, int call);
    smoe_status (*forward)(smoe_layer *layer, const smoe_forward_args *args,
                           const smoe_saved_layout *saved_layout, void *saved,
                           void *workspace, void *stream);
    smoe_status (*backward)(smoe_layer *layer, const smoe_backward_args *args,
                            const smoe_saved_layout *saved_layout, void *saved,
                            void *workspace, void *stream);
    void (*destroy)(smoe_layer *layer); /* frees layer->state; may be NULL */
    /* smoe_layer_device_status() (smoe.h). NULL: the backend checks
     * everything on the host and the call succeeds. */
    smoe_status (*device_status)(smoe_layer *layer, void *stream, int wait);
    /* A backward's scratch for these arguments (smoe.h's
     * smoe_layer_backward_workspace_bytes): at most workspace_bytes(...,
     * SMOE_CALL_BACKWARD), from T, pairs and the dw1 output alone (the same
     * arguments give the same layout whatever size the caller passes). NULL:
     * the backend's backward takes workspace_bytes(..., SMOE_CALL_BACKWARD). */
    size_t (*backward_workspace_bytes)(const smoe_layer *layer, int64_t T, int64_t cap,
                                       const smoe_backward_args *args);
    /* Where in a consume_saved layer's saved block (layout l) the backward
     * may write the router weight's gradient: bytes at offset that nothing
     * of the call reads or writes once the gradient is written (smoe.h's
     * smoe_layer_drouter_slot). 0: no such room at this shape. NULL: none
     * on this backend. Only asked for a consume_saved layer with a router
     * and cap > 0. */
    int (*drouter_slot)(const smoe_layer *layer, const smoe_saved_layout *l, size_t *offset,
                        size_t *bytes);
};

/* Each backend's constructor fills layer->ops, state and path_name. */
smoe_status smoe_cpu_layer_init(smoe_layer *layer);
#ifdef SMOE_WITH_CUDA
/* Returns SMOE_ERROR_NO_DEVICE when no usable device (or, for SM90, no
 * sm_90 device) is present, with a message. */
smoe_status smoe_cuda_layer_init(smoe_layer *layer, int want_sm90);
#endif

#ifdef __cplusplus
}
#endif

#endif /* SMOE_INTERNAL_H */
