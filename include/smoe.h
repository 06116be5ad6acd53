/*
 * smoe.h -- the public API of smoe, a Mixture-of-Experts feed-forward layer
 * for training (forward and backward), with the algorithm of SonicMoE
 * (arXiv 2512.14080). This header is the manual.
 *
 * Legend (the paper's names, used for every shape below):
 *   T  tokens                      d  hidden size
 *   n  expert intermediate size    E  experts
 *   K  experts per token           R  routed rows (token, expert) pairs:
 *                                     T*K for token choice, variable for
 *                                     GENERAL routing and token rounding
 *
 * The layer, for token t routed to experts e_1..e_K with scores s_1..s_K:
 *   h   = W1[e] x_t + b1[e]              (2n values)
 *   a   = act(h)                         (n values; gated: act(gate) * up)
 *   y   = W2[e] a + b2[e]                (d values)
 *   o_t = sum_k s_k y_k
 *
 * Memory: the caller owns all of it. smoe_layer_workspace_bytes() and
 * smoe_layer_saved_bytes() say how many bytes a call needs, and forward and
 * backward take the sizes of the buffers they are given and refuse buffers
 * that are too small. Forward and backward never allocate and never
 * synchronise the host with the device. On the CUDA backends every pointer
 * is a device pointer and `stream` is a cudaStream_t (NULL: the legacy
 * default stream). On the CPU backend every pointer is a host pointer and
 * `stream` is ignored.
 *
 * The rules every call checks, on every backend, before any work:
 *  - Sizes: T, pairs and the buffer sizes as documented at each call.
 *  - Alignment: every pointer is aligned to its element type (2 bytes for
 *    bf16, 4 for fp32 and int32, 8 for fp64); saved and workspace to 16
 *    bytes. The CUDA backends also need 16 bytes for every tensor of the
 *    layer's dtype and every gradient (the kernels load 16-byte vectors);
 *    only the int32 / fp32 vectors (pair_*, expert_bias, expert_counts,
 *    dpair_score) and the router's matrices (router_logits, dlogits_extra)
 *    may sit at their element size.
 *    A misaligned pointer is SMOE_ERROR_INVALID_SIZE.
 *  - Overlap: no output (out, router_logits, expert_counts, every gradient),
 *    the saved block or the workspace may share a byte with another of
 *    them or with an input. Inputs may overlap each other. The one
 *    in-place mode is desc.consume_saved (the backward writes into its
 *    saved block, which then counts as an output; args.drouter_w may then
 *    be the block's router slot, smoe_layer_drouter_slot). An overlap is
 *    SMOE_ERROR_INVALID_VALUE. The extent of saved and workspace is what
 *    the call uses (the *_bytes() size), not the capacity given.
 * Refusals name the argument, and give the sizes or addresses involved.
 *
 * Non-finite values follow PyTorch. A NaN or an infinity in x, a weight or
 * dout propagates through the formulas below as IEEE arithmetic does; the
 * router's top-K ranks NaN above every number (as torch.topk does; equal
 * keys, NaN among them, go to the lower expert index), so a token with a
 * NaN logit picks that expert, gets NaN scores, and its output and every
 * gradient it touches are NaN. Each expert's weights touch only the rows
 * routed to it. GENERAL scores must be finite (refused otherwise).
 *
 * Errors: every call returns a smoe_status. On error nothing is written to
 * any output, and smoe_last_error() (thread-local) says what was wrong, with
 * the offending value. What the host cannot see (data in device memory: the
 * GENERAL triples, the saved block's header) the CUDA backends check on the
 * device: the first kernel of the call records the error in a status word
 * of the call's workspace, and every later kernel of that call does nothing,
 * so no output is written (except the saved block's header, which then
 * records that its forward failed, so a backward refuses it). The call
 * itself returns SMOE_SUCCESS; smoe_layer_device_status() reports the error.
 *
 * Threads and streams: a layer is immutable after smoe_layer_create, so
 * several threads may call forward and backward on one layer at once, on
 * one stream or several, as long as each call in flight has its own
 * workspace, saved block and outputs. (SMOE_CUDA_TIMING, a debugging aid,
 * is the exception: it times one call at a time.) smoe_layer_free must not
 * run while a call is in flight.
 *
 * All matrices are row-major and contiguous.
 */
#ifndef SMOE_H
#define SMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SMOE_VERSION_MAJOR 0
#define SMOE_VERSION_MINOR 4
#define SMOE_VERSION_PATCH 0
#define SMOE_VERSION_NUMBER \
    (SMOE_VERSION_MAJOR * 10000 + SMOE_VERSION_MINOR * 100 + SMOE_VERSION_PATCH)

#if defined(_WIN32)
#define SMOE_API __declspec(dllexport)
#else
#define SMOE_API __attribute__((visibility("default")))
#endif

/* ---------------------------------------------------------------- status */

typedef enum smoe_status {
    SMOE_SUCCESS = 0,
    SMOE_ERROR_NULL_POINTER,     /* a required pointer is NULL */
    SMOE_ERROR_INVALID_SIZE,     /* a size is zero, negative or too large, a buffer is
                                    too small, or a pointer is misaligned */
    SMOE_ERROR_INVALID_VALUE,    /* an enum, flag, index or score is out of range, a
                                    buffer overlaps another, or a saved block does not
                                    belong to this call */
    SMOE_ERROR_UNSUPPORTED,      /* a valid combination this backend cannot run */
    SMOE_ERROR_NO_DEVICE,        /* the backend asked for has no device here */
    SMOE_ERROR_OUT_OF_MEMORY,    /* smoe_layer_create could not allocate the handle */
    SMOE_ERROR_BACKEND,          /* the CUDA runtime or cuBLAS returned an error */
    SMOE_ERROR_INTERNAL          /* a bug in smoe: please report it */
} smoe_status;

SMOE_API const char *smoe_status_string(smoe_status s);
/* The message of the last failed call on this thread ("" if none). */
SMOE_API const char *smoe_last_error(void);
SMOE_API const char *smoe_version_string(void);

/* ----------------------------------------------------------------- enums */

typedef enum smoe_dtype {
    SMOE_DTYPE_F32 = 0,
    SMOE_DTYPE_BF16 = 1,
    SMOE_DTYPE_F64 = 2   /* CPU backend only: for gradient checks */
} smoe_dtype;

typedef enum smoe_activation {
    SMOE_ACT_SWIGLU = 0, /* silu(gate) * up                       (gated) */
    SMOE_ACT_GEGLU,      /* gelu_tanh(gate) * up                  (gated) */
    SMOE_ACT_REGLU,      /* relu(gate) * up                       (gated) */
    SMOE_ACT_RELU2,      /* relu(h)^2                         (not gated) */
    SMOE_ACT_RELU,       /* relu(h)                           (not gated) */
    SMOE_ACT_SILU,       /* silu(h)                           (not gated) */
    SMOE_ACT_GELU        /* gelu_tanh(h)                      (not gated) */
} smoe_activation;
/* Gated activations give W1 2n rows per expert (gate and up); the others n. */

typedef enum smoe_w1_layout {
    SMOE_W1_INTERLEAVED = 0,  /* row 2j gate j, row 2j+1 up j (SonicMoE) */
    SMOE_W1_CONCATENATED = 1  /* rows [0,n) gate, [n,2n) up (Hugging Face) */
} smoe_w1_layout;

typedef enum smoe_routing {
    SMOE_ROUTING_TOPK_SOFTMAX = 0, /* top-K logits, softmax over those K */
    SMOE_ROUTING_SOFTMAX_TOPK = 1, /* softmax over E, top-K probabilities,
                                      renormalised if desc.renormalize */
    SMOE_ROUTING_GENERAL = 2,      /* caller's (token, expert, score) triples */
    SMOE_ROUTING_SIGMOID_TOPK = 3  /* DeepSeek-V3 / Kimi-K2 / GLM-4.5: sigmoid
                                      scores, optional expert bias for the
                                      selection, group-limited top-K,
                                      renormalisation, routed scaling */
} smoe_routing;
/* SIGMOID_TOPK, for token t with fp32 logits l (T, E), args.expert_bias b
 * (E) (zeros when NULL), G = desc.n_group, g = desc.topk_group, c =
 * desc.routed_scaling (Hugging Face's DeepseekV3TopkRouter and
 * DeepseekV3MoE.route_tokens_to_experts, transformers 5.x):
 *   s_e  = sigmoid(l_e)                  the score
 *   k_e  = s_e + b_e                     the selection key (b: no gradient)
 *   groups (G > 0): the E experts in G contiguous groups of E/G; a group's
 *        key is the sum of its two largest k_e; the g groups with the
 *        largest keys are kept, every expert of another group gets the key
 *        -inf (Hugging Face's mask)
 *   the K experts with the largest keys are the token's experts, in
 *        descending key order (equal keys: lower expert index; equal group
 *        keys: lower group index; NaN ranks above every number)
 *   score_k = c * s_k / (sum_j s_j + 1e-20)   desc.renormalize = 1
 *           = c * s_k                          desc.renormalize = 0
 *   (sum over the K selected, in selection order).
 * Keys, group keys and scores are computed in double from the fp32 logits
 * with one sigmoid the CPU and the GPU evaluate bit for bit alike, so the
 * selection (and the scores) are the same on every backend; scores are
 * rounded to fp32 last. Gradients flow into the K selected logits only,
 * through the sigmoid, the renormalisation and c; the bias gets none. The
 * backward reads the selection from the saved block (it needs no bias, and
 * a bias changed between forward and backward changes nothing); the saved
 * block keeps the fp32 logits (T, E) for the sigmoid's derivative.
 * Non-finite biases are not refused: they enter the keys as IEEE
 * arithmetic does (+inf forces an expert in, -inf keeps it out unless fewer
 * than K keys are larger, NaN ranks first). Token rounding is refused with
 * SIGMOID_TOPK (it ranks tokens by softmax probabilities), and expert
 * parallelism supports it (the router is replicated). */

typedef enum smoe_rounding {
    SMOE_ROUND_OFF = 0,
    SMOE_ROUND_UP,       /* each expert's count rounded up to a multiple of M */
    SMOE_ROUND_DOWN,     /* ... down ... */
    SMOE_ROUND_NEAREST   /* ... to the nearest multiple (ties up) */
} smoe_rounding;
/* Token rounding (training only; inference uses plain token choice) works on
 * top of the token-choice selection of TOPK_SOFTMAX or SOFTMAX_TOPK (both
 * pick the K largest logits). Kept token-choice pairs score their
 * renormalised softmax probability p_e / sum_{j in top-K} p_j; pairs added
 * by rounding up score p_e. Gradients flow through both into the logits.
 * See README.md, "Token rounding". */

typedef enum smoe_backend {
    SMOE_BACKEND_AUTO = 0, /* the best backend present (Hopper, CUDA, CPU) */
    SMOE_BACKEND_CPU,      /* portable C11: the reference */
    SMOE_BACKEND_CUDA,     /* portable CUDA kernels (sm_80 and later) */
    SMOE_BACKEND_SM90      /* Hopper kernels (sm_90a: TMA, wgmma) */
} smoe_backend;

/* ------------------------------------------------------------ descriptor */

typedef struct smoe_layer_desc {
    int64_t d;                   /* hidden size */
    int64_t n;                   /* expert intermediate size */
    int64_t E;                   /* experts, at most 65536 */
    int64_t K;                   /* experts per token (token-choice modes) */
    smoe_activation activation;
    smoe_w1_layout w1_layout;    /* only read for gated activations */
    int has_bias;                /* b1 (E, 2n or n) and b2 (E, d) */
    smoe_routing routing;
    int renormalize;             /* SOFTMAX_TOPK, SIGMOID_TOPK: renormalise the K
                                    scores (DeepSeek's norm_topk_prob) */
    smoe_rounding rounding;      /* token rounding (TOPK_SOFTMAX or SOFTMAX_TOPK) */
    int64_t round_tile;          /* M for token rounding (default 128) */
    /* SIGMOID_TOPK only (see smoe_routing). Group-limited selection:
     * n_group groups (dividing E, E/n_group >= 2), keep topk_group of them
     * (1 <= topk_group <= n_group, topk_group * E/n_group >= K); both 0:
     * off. routed_scaling: the factor c of every score, finite and > 0
     * (1.0 in smoe_layer_desc_default(); 0, as in a zeroed desc, is
     * refused). Other modes need n_group = topk_group = 0 and
     * routed_scaling = 1. */
    int64_t n_group;
    int64_t topk_group;
    double routed_scaling;
    smoe_dtype dtype;            /* storage of x, weights, out, saved state */
    smoe_backend backend;
    int device;                  /* CUDA device ordinal (CUDA backends) */
    /* 1: the backward consumes its saved block: it writes dH (R x h_cols,
     * the dtype) over the block's H, which the backward no longer needs
     * once dH is computed. The backward's workspace loses its dH (up to
     * R x h_cols elements), and the router backward's buffers go to the
     * block's H too once dH is dead, where they fit (the dense router term
     * of dx, T x d fp32, in up to 8 chunks of tokens, through pointers the
     * backward sets on the device after checking the block; where 8 chunks
     * do not fit, a chunk in the workspace); smoe_layer_call_workspace_bytes
     * (SMOE_CALL_BACKWARD) says what it needs. The header is marked consumed,
     * so a second backward with it is refused (SMOE_ERROR_INVALID_VALUE; on
     * the CUDA backends through the device status word). A new training
     * forward fills the block again. Results are those of 0, bit for bit.
     * 0 (the default): the block is only read. Not with expert parallelism
     * (smoe_ep_layer_create refuses it). */
    int consume_saved;
} smoe_layer_desc;

/* d=n=E=K=0 (the caller must set them), SwiGLU, interleaved, no bias,
 * TOPK_SOFTMAX, rounding off with M=128, no groups, routed_scaling 1.0,
 * bf16, AUTO backend, device 0, the saved block not consumed. */
SMOE_API smoe_layer_desc smoe_layer_desc_default(void);

typedef struct smoe_layer smoe_layer; /* opaque */

/* Validates desc and picks the backend. */
SMOE_API smoe_status smoe_layer_create(const smoe_layer_desc *desc, smoe_layer **out);
SMOE_API void smoe_layer_free(smoe_layer *layer); /* NULL is fine */

/* The backend that runs this layer, and the kernel path it takes, e.g.
 * "cpu", "cuda-sm80 (mma.sync)", "sm90 (tma+wgmma)". */
SMOE_API smoe_backend smoe_layer_backend(const smoe_layer *layer);
SMOE_API const char *smoe_layer_path_name(const smoe_layer *layer);
SMOE_API smoe_layer_desc smoe_layer_get_desc(const smoe_layer *layer);

/* ------------------------------------------------------------ memory */

/* Bytes of scratch one forward or backward call with T tokens needs: the
 * larger of the two, so one buffer serves both calls. `pairs` is the number
 * of GENERAL triples (ignored by other modes; pass 0). Returns 0 (and sets
 * smoe_last_error) on invalid sizes. */
SMOE_API size_t smoe_layer_workspace_bytes(const smoe_layer *layer, int64_t T, int64_t pairs);

/* Which call a workspace is sized for (smoe_layer_call_workspace_bytes). */
typedef enum smoe_call {
    SMOE_CALL_ANY = 0,      /* forward or backward: smoe_layer_workspace_bytes */
    SMOE_CALL_FORWARD = 1,  /* a forward, training or inference */
    SMOE_CALL_BACKWARD = 2  /* a backward */
} smoe_call;

/* Bytes of scratch one call of that kind needs, at most
 * smoe_layer_workspace_bytes(). A forward takes a workspace of at least the
 * FORWARD size and a backward one of at least the BACKWARD size, so a caller
 * that allocates the workspace per call (PyTorch's caching allocator does)
 * holds only what each call uses: where the forward's part is the larger
 * (Y and A, R (n + d) elements, against the backward's dX~), the backward's
 * peak is lower by the difference. Returns 0 (and sets smoe_last_error) on
 * invalid sizes or an unknown `call`. */
SMOE_API size_t smoe_layer_call_workspace_bytes(const smoe_layer *layer, smoe_call call,
                                                int64_t T, int64_t pairs);

/* Bytes of state a training forward leaves for backward: a 256-byte header
 * (which layer filled it, T, pairs, whether the forward succeeded), H
 * (R x 2n), the sorted rows' scores and tokens, the routing metadata, and
 * for SOFTMAX_TOPK, SIGMOID_TOPK and token rounding the fp32 router logits. Exact for token
 * choice and GENERAL; a worst case (R <= T*K + E*(M-1), capped at T*E) for
 * token rounding. Inference needs none.
 * Both sizes are exact 64-bit counts (no product of sizes is taken in 32
 * bits); a T whose rows or byte counts would not fit the library's int32
 * row indices (R < 2^31) is refused. */
SMOE_API size_t smoe_layer_saved_bytes(const smoe_layer *layer, int64_t T, int64_t pairs);

/* ------------------------------------------------------------ forward */

typedef struct smoe_forward_args {
    int64_t T;                    /* tokens (>= 1) */
    const void *x;                /* (T, d)  dtype */
    const void *router_w;         /* (E, d)  dtype; not GENERAL */
    /* GENERAL routing: `pairs` triples sorted by token (ascending; ties in
     * any order, each (token, expert) at most once). Not read otherwise. */
    int64_t pairs;
    const int32_t *pair_token;    /* (pairs) in [0, T) */
    const int32_t *pair_expert;   /* (pairs) in [0, E) */
    const float *pair_score;      /* (pairs) finite */
    const void *w1;               /* (E, 2n, d) gated or (E, n, d)  dtype */
    const void *b1;               /* (E, 2n) or (E, n)  dtype; if has_bias */
    const void *w2;               /* (E, d, n)  dtype */
    const void *b2;               /* (E, d)  dtype; if has_bias */
    void *out;                    /* (T, d)  dtype, overwritten */
    void *router_logits;          /* (T, E) optional output (NULL: none), in
                                     router_logits_dtype */
    int32_t *expert_counts;       /* (E) int32, optional: rows per expert */
    int inference;                /* 1: nothing saved, `saved` may be NULL */
    const float *expert_bias;     /* (E) fp32 or NULL (zeros): SIGMOID_TOPK's
                                     selection bias (DeepSeek-V3's
                                     e_score_correction_bias); refused for
                                     other modes. Not needed by backward. */
    smoe_dtype router_logits_dtype; /* SMOE_DTYPE_F32 (0: the default) or
                                     the layer's dtype: the fp32 logits
                                     rounded to nearest even (the routing
                                     reads the fp32 logits either way; a
                                     bf16 copy is what Hugging Face's MoE
                                     blocks return and halves its
                                     bytes). */
} smoe_forward_args;

/* saved: at least smoe_layer_saved_bytes(T, pairs) bytes, given as
 * saved_bytes (training; NULL and 0 for inference). workspace: at least
 * smoe_layer_workspace_bytes(T, pairs) bytes, given as workspace_bytes. */
SMOE_API smoe_status smoe_layer_forward(smoe_layer *layer, const smoe_forward_args *args,
                                        void *saved, size_t saved_bytes, void *workspace,
                                        size_t workspace_bytes, void *stream);

/* ------------------------------------------------------------ backward */

/* A gradient output. ptr NULL: not wanted (not computed). dtype: the layer's
 * dtype or SMOE_DTYPE_F32 (fp32 main-grad). accumulate 0: overwritten;
 * 1: added to what the buffer holds (accumulation in fp32). */
typedef struct smoe_grad {
    void *ptr;
    smoe_dtype dtype;
    int accumulate;
} smoe_grad;

typedef struct smoe_backward_args {
    int64_t T;                   /* as in forward */
    const void *x;               /* (T, d)  the forward's inputs, unchanged */
    const void *router_w;        /* (E, d)  not GENERAL */
    int64_t pairs;               /* GENERAL: as in forward */
    const void *w1;              /* (E, 2n|n, d) */
    const void *w2;              /* (E, d, n) */
    const void *b2;              /* (E, d) if has_bias */
    const void *dout;            /* (T, d)  dtype: gradient of the loss wrt out */
    const void *dlogits_extra;   /* (T, E) optional, in dlogits_extra_dtype:
                                    gradient of the caller's own loss (an aux
                                    loss) wrt the router_logits output;
                                    added to the router gradient. Not
                                    GENERAL. */
    smoe_grad dx;                /* (T, d) */
    smoe_grad drouter_w;         /* (E, d)  not GENERAL */
    smoe_grad dw1;               /* (E, 2n|n, d) */
    smoe_grad db1;               /* (E, 2n|n)  if has_bias */
    smoe_grad dw2;               /* (E, d, n) */
    smoe_grad db2;               /* (E, d)  if has_bias */
    smoe_grad dpair_score;       /* (pairs) fp32 only; GENERAL */
    smoe_dtype dlogits_extra_dtype; /* SMOE_DTYPE_F32 (0: the default) or the
                                    layer's dtype (widened where it is
                                    added). */
} smoe_backward_args;

/* The workspace of a backward with these arguments: at most
 * smoe_layer_call_workspace_bytes(SMOE_CALL_BACKWARD), and smaller where the
 * CUDA backends keep A' (R x n bf16, the scaled activations the dW2 GEMM
 * reads) in the dw1 output's buffer until they write dW1 there. They do that when dw1
 * is wanted and overwritten (accumulate 0) and its buffer holds R x n bf16,
 * and where it makes the workspace smaller: n >= d. Mixtral-8x7B's shape at
 * 16K tokens needs 640 MiB less. Reads args->T, args->pairs (GENERAL) and
 * args->dw1 only. A backward checks its workspace_bytes against this size
 * (a caller of the SMOE_CALL_BACKWARD size passes too). Returns 0 and sets
 * smoe_last_error on a NULL layer or args or invalid sizes. */
SMOE_API size_t smoe_layer_backward_workspace_bytes(const smoe_layer *layer,
                                                    const smoe_backward_args *args);

/* The router slot of a consume_saved layer's saved block: with
 * args.drouter_w.ptr = (char *)saved + *offset (accumulate 0, E x d of the
 * layer's dtype or F32) the backward writes the router weight's gradient
 * into room of the block that nothing of the call touches after it. The
 * caller frees the backward's workspace, then copies the gradient out
 * before the block's next forward: the gradient is then never allocated
 * beside the workspace and H, as when the router's weight gradient is a
 * step of its own after the experts' backward. Results are bit for bit
 * those of a separate buffer. SMOE_ERROR_UNSUPPORTED (offset untouched)
 * where there is no slot: desc.consume_saved 0, GENERAL routing, or a
 * shape whose H leaves no room beside the router's buffers on the
 * layer's backend. The backward refuses a slot pointer with accumulate 1
 * (SMOE_ERROR_INVALID_VALUE); any other pointer into the block overlaps
 * it. */
SMOE_API smoe_status smoe_layer_drouter_slot(const smoe_layer *layer, int64_t T, int64_t pairs,
                                             size_t *offset);

/* `saved` is the block a training forward of this layer with the same T
 * (and pairs) filled. It is only read, unless desc.consume_saved is set:
 * then the backward writes dH over its H and marks its
 * header consumed (see smoe_layer_desc). Its header is checked: a block of
 * another layer, of another T or pairs, never filled, of a forward that
 * failed a device-side check, or already consumed by a backward is
 * refused (on the CPU at once, on the GPU through the device status word).
 * saved_bytes as in forward; workspace: at least
 * smoe_layer_backward_workspace_bytes(args) bytes. */
SMOE_API smoe_status smoe_layer_backward(smoe_layer *layer, const smoe_backward_args *args,
                                         void *saved, size_t saved_bytes,
                                         void *workspace, size_t workspace_bytes,
                                         void *stream);

/* The device status word. On the CUDA backends what lives in device memory
 * is checked by the kernels: the GENERAL triples (token in [0, T), expert
 * in [0, E), tokens sorted, no (token, expert) twice, finite scores) in
 * forward, the saved block's header in backward. The first failure of a
 * call makes the rest of that call do nothing (see "Errors" above) and is
 * recorded in the layer, where it stays until read here.
 * wait = 1: waits for `stream` (this call synchronises), then returns the
 *   first error recorded since the last read, with its message (the bad
 *   index and value), and clears it; SMOE_SUCCESS when there is none.
 * wait = 0: does not wait; reports an error only if the kernel that found
 *   it has finished (cheap enough to call before every forward, as the
 *   Python package does).
 * Errors of calls on other streams are seen once those calls finished.
 * CPU backend: everything is checked on the host before any work; always
 * SMOE_SUCCESS. */
SMOE_API smoe_status smoe_layer_device_status(smoe_layer *layer, void *stream, int wait);

/* ------------------------------------------------------------ lower level */

/* Routing alone, on the CPU, from fp32 logits (T, E): the same code the CPU
 * backend uses, and the GPU tests' reference. For token-choice modes writes
 * expert (T, K) and score (T, K), each token's experts in descending score
 * (ties: lower expert first). Token rounding writes triples instead
 * (sorted by token, then expert) into pair_* of capacity `cap` and their
 * number into *pairs. */
typedef struct smoe_routing_result {
    int32_t *expert;      /* (T, K)  token choice */
    float *score;         /* (T, K)  token choice */
    int64_t cap;          /* token rounding: capacity of the pair arrays */
    int32_t *pair_token;  /* (cap) */
    int32_t *pair_expert; /* (cap) */
    float *pair_score;    /* (cap) */
    int64_t *pairs;       /* number written */
} smoe_routing_result;

SMOE_API smoe_status smoe_route_cpu(const smoe_layer_desc *desc, int64_t T,
                                    const float *logits, smoe_routing_result *res);
/* The same with SIGMOID_TOPK's expert bias (E) fp32 (NULL: none; refused
 * for other modes). smoe_route_cpu(...) is smoe_route_cpu_biased(..., NULL,
 * res). */
SMOE_API smoe_status smoe_route_cpu_biased(const smoe_layer_desc *desc, int64_t T,
                                           const float *logits, const float *expert_bias,
                                           smoe_routing_result *res);

/* ------------------------------------------------------------ expert parallelism */

/* P ranks, each holding the contiguous experts [r E/P, (r+1) E/P) (E a
 * multiple of P) and its own T_r tokens (any number, 0 included). Every
 * (token, rank) pair whose token has at least one expert on that rank
 * travels once to that rank (the token's rows there carry its pairs for
 * that rank's experts), the rank computes them, sums each token's expert
 * outputs (score-weighted) and sends one row back; the token's rank sums
 * the returned rows in rank order (deterministic). notes/ep_design.md has
 * the design.
 *
 * Calls are collective: every rank of the group calls create, forward,
 * backward and free together, with the same description but for rank,
 * nccl_comm and layer.device (each rank's GPU), compared at create; T may
 * differ per rank.
 *
 * Transport. An in-process group (smoe_ep_group: P ranks as P threads of one
 * process, on the CPU backend) for simulation and tests; the caller's NCCL
 * communicator for the CUDA backends (libnccl is loaded at run time: the
 * one already in the process, e.g. PyTorch's, else $SMOE_NCCL_LIBRARY, else
 * libnccl.so.2; P <= 64; layer.device is this rank's GPU). On the CPU
 * every call's refusal is agreed by all ranks; with NCCL a call refused by
 * one rank's host checks returns on that rank only, and the other ranks'
 * calls wait for it in their transfers, as with any collective one rank
 * skips: check the status on every rank. What the device finds (a rank's
 * rows over capacity, another rank's failure) stops every rank's call,
 * reported by smoe_ep_layer_device_status. */
typedef struct smoe_ep_group smoe_ep_group; /* opaque */
SMOE_API smoe_status smoe_ep_group_create(int nranks, smoe_ep_group **out);
SMOE_API void smoe_ep_group_free(smoe_ep_group *group); /* NULL is fine */

typedef struct smoe_ep_desc {
    smoe_layer_desc layer;  /* every expert (E); the routing, activation... */
    int rank, nranks;       /* this rank of nranks = P */
    smoe_ep_group *group;   /* the in-process transport (CPU backend) */
    void *nccl_comm;        /* ncclComm_t over the P ranks (CUDA backends) */
    int64_t max_tokens;     /* the largest T any rank's call will pass (>= 0) */
    int64_t capacity;       /* rows one rank may send one other per call:
                               0 = max_tokens (the worst case: never exceeded) */
    int64_t expert_rows;    /* (row, expert) pairs one rank may compute per
                               call: 0 = the worst case, P * capacity * min(K,
                               E/P); less keeps the saved block smaller */
    int overlap;            /* CUDA: the exchanges run beside the expert GEMMs,
                               which take the received rows in chunks (one per
                               source rank, this rank's own in two; in the
                               forward at P = 2 where n <= 512, K <= 8 every
                               rank's in two, the peers' halves travelling
                               one after the other), on a communicator the
                               layer splits from nccl_comm at create (on
                               NCCL's kernels a rank whose T is the
                               capacity sends x itself, no pack of its
                               rows: after the counts and pairs where K <=
                               8, else from the forward's start, the
                               counts beside it on a second communicator
                               of one CTA):
                               1 = on (SMOE_ERROR_UNSUPPORTED without
                               the Hopper GEMMs), -1 = off (exchange, then
                               compute), 2 = in the backward only (the
                               forward exchanges, then computes; NCCL's
                               kernels, not with copy_engines = 1), 0 = on
                               where the Hopper GEMMs run and capacity * d *
                               2 >= 128 MiB, in the backward only where it
                               is >= 64 MiB and K * n <= 8192 (where each
                               measured faster; smoe_ep_layer_path_name
                               says which) */
    int comm_sms;           /* CUDA, overlap: SMs the GEMMs leave to NCCL while
                               an exchange is in flight (and the most CTAs the
                               layer's own NCCL communicator launches): 0 =
                               4 per rank within [8, 32] (8 at P = 2, 16 at
                               P = 4: measured best; 8 with copy_engines),
                               -1 = none */
    int keep_x;             /* 1: the forward keeps the rows of x this rank
                               received in the saved block, and the backward
                               sends only dout (one exchange of the three
                               fewer); it costs P capacity d elements of the
                               dtype more saved per rank (512 MiB at P = 2,
                               capacity 32768, d 4096, bf16): above the
                               single-GPU floor, so off by default. 0 = x
                               travels again in the backward */
    int copy_engines;       /* CUDA, P > 1: 1 = the rows and partial sums
                               travel by the GPU's copy engines (NCCL >= 2.28's
                               ncclAlltoAll from symmetric memory, on a
                               communicator of NCCL's zero-CTA policy split
                               at create), in two parts per exchange (where
                               capacity is max_tokens and even, x and dout
                               themselves by ncclAllGather: no pack), beside
                               GEMMs that leave comm_sms SMs (0 = 8) for
                               NCCL's own small messages. The exchange
                               buffers then live in a window (ncclMemAlloc,
                               registered at create: (6 P + 3) capacity d
                               bf16 elements; the workspace drops 6 P
                               capacity d of them) that the copy-engine
                               layers of one communicator and device share
                               when it holds them: create and free them in
                               the same order on every rank, run them one
                               at a time (one stream). Needs the Hopper GEMMs,
                               overlap 0 or 1 and ranks whose GPUs reach each
                               other's memory (one NVLink domain: NCCL
                               registers the window) (else
                               SMOE_ERROR_UNSUPPORTED); the CPU backend
                               refuses it. -1 = NCCL's kernels move them
                               (the workspace holds the buffers). 0 = copy
                               engines from P = 4 where all of that holds
                               (measured faster there on every shape; slower
                               at P = 2 on most), else NCCL's kernels;
                               smoe_ep_layer_path_name says which */
} smoe_ep_desc;

/* Defaults: layer as smoe_layer_desc_default(), rank 0 of 1, no group,
 * max_tokens 0 (the caller must set it), capacity, expert_rows, overlap,
 * comm_sms, keep_x and copy_engines 0 (copy engines: automatic). */
SMOE_API smoe_ep_desc smoe_ep_desc_default(void);

typedef struct smoe_ep_layer smoe_ep_layer; /* opaque */
SMOE_API smoe_status smoe_ep_layer_create(const smoe_ep_desc *desc, smoe_ep_layer **out);
/* NULL is fine. With desc.overlap the layer owns communicators split from
 * the caller's, destroyed here: ncclCommDestroy waits until every CUDA
 * graph that captured this layer's calls is destroyed, so destroy those
 * graphs first (or free the layer where a wait does no harm). A debugging
 * aid: with SMOE_EP_TRACE=1 in the environment at create, the CUDA layer
 * marks its calls with timing events (routing, each chunk's wait, GEMMs
 * and sums, each exchange's arrival, ...) and prints here, to stderr, each
 * mark's mean time from its call's start over the calls after the first
 * (which loads modules and connects NCCL; calls being captured into a
 * CUDA graph are not traced). */
SMOE_API void smoe_ep_layer_free(smoe_ep_layer *layer);

/* Bytes of a call with T tokens on this rank (T in [0, max_tokens]). The
 * workspace holds the send and receive buffers: 6 P capacity d elements
 * of the dtype (rows, dout and partial sums, each out and in; 4 on NCCL's
 * kernels where T is the capacity, x and dout then being sent as they
 * are; none with the copy engines, whose buffers the layer allocates at
 * create in an NCCL window), plus the expert computation's own workspace.
 * The saved block holds H of the rows this rank computes (expert_rows of
 * them at most), the routing of its own tokens and O(P capacity K)
 * indices; with keep_x also the received rows of x (P capacity d
 * elements). The workspace's size is not monotonic in T (T = capacity
 * can need less than T - 1): query it for the T of each call, or take
 * the largest over the T a caller uses. */
SMOE_API size_t smoe_ep_layer_workspace_bytes(const smoe_ep_layer *layer, int64_t T);
SMOE_API size_t smoe_ep_layer_saved_bytes(const smoe_ep_layer *layer, int64_t T);

/* As smoe_layer_forward, with: T this rank's tokens (0 allowed, x then may
 * be NULL); router_w (E, d) replicated; w1, b1, w2, b2 this rank's E/P
 * experts ((E/P, 2n|n, d)...); GENERAL triples name global experts;
 * expert_counts (E): the rows of this rank's tokens per expert (sum them
 * over ranks, e.g. for a load-balancing loss). Token rounding is refused
 * (SMOE_ERROR_UNSUPPORTED: it ranks every rank's tokens per expert). A
 * rank whose tokens need more than `capacity` rows to one rank, or more
 * than expert_rows on one rank, fails on every rank with
 * SMOE_ERROR_INVALID_SIZE and a message naming the ranks and counts;
 * no output is written (on the CUDA backends the device finds it: the
 * saved block's sections may be, and its header then records the failure,
 * so a backward refuses it). */
SMOE_API smoe_status smoe_ep_layer_forward(smoe_ep_layer *layer, const smoe_forward_args *args,
                                           void *saved, size_t saved_bytes, void *workspace,
                                           size_t workspace_bytes, void *stream);

/* The kernel path of this rank's experts (smoe_layer_path_name). */
SMOE_API const char *smoe_ep_layer_path_name(const smoe_ep_layer *layer);

/* smoe_layer_device_status for the expert-parallel layer (its router's and
 * its experts' checks). */
SMOE_API smoe_status smoe_ep_layer_device_status(smoe_ep_layer *layer, void *stream, int wait);

/* As smoe_layer_backward: dx of this rank's tokens; drouter_w this rank's
 * share of the router gradient (all-reduce it over ranks like any
 * replicated parameter's gradient); dw1, db1, dw2, db2 of this rank's
 * experts, from every rank's tokens. */
SMOE_API smoe_status smoe_ep_layer_backward(smoe_ep_layer *layer, const smoe_backward_args *args,
                                            const void *saved, size_t saved_bytes,
                                            void *workspace, size_t workspace_bytes,
                                            void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SMOE_H */
