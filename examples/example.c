/*
 * example.c -- the smallest complete use of smoe: one MoE layer, a training
 * forward and a backward, on the CPU backend with fp32 storage (so the
 * buffers are plain float arrays). Every call's status is checked.
 *
 * On a CUDA backend the same calls take device pointers (cudaMalloc) and a
 * cudaStream_t as `stream`; nothing else changes.
 *
 *   make && build/example
 */
#include "smoe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* Every smoe call returns a status; on failure smoe_last_error() says what
 * was wrong, with the offending value. */
#define CHECK(call)                                                                     \
    do {                                                                                \
        smoe_status st_ = (call);                                                       \
        if (st_ != SMOE_SUCCESS) {                                                      \
            fprintf(stderr, "%s failed: %s (%s)\n", #call, smoe_status_string(st_),     \
                    smoe_last_error());                                                 \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* malloc that never returns NULL; 64-byte aligned (smoe wants >= 16 for
 * the saved block and the workspace) and zero-filled. */
static void *xalloc(size_t bytes)
{
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    for (size_t i = 0; i < rounded; i++) ((unsigned char *)p)[i] = 0;
    return p;
}

/* Deterministic values in [-scale, scale). */
static void fill(float *p, size_t count, float scale, unsigned seed)
{
    for (size_t i = 0; i < count; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = scale * ((float)(seed >> 8) / 8388608.0f - 1.0f);
    }
}

int main(void)
{
    /* 1. Describe the layer: start from the defaults (SwiGLU, interleaved
     *    W1, no bias, TOPK_SOFTMAX routing, no token rounding) and set the
     *    sizes. T tokens per call is not part of the layer. */
    smoe_layer_desc desc = smoe_layer_desc_default();
    desc.d = 64;                     /* hidden size */
    desc.n = 32;                     /* expert intermediate size */
    desc.E = 8;                      /* experts */
    desc.K = 2;                      /* experts per token */
    desc.dtype = SMOE_DTYPE_F32;     /* storage of x, weights, out, saved state */
    desc.backend = SMOE_BACKEND_CPU; /* host pointers; AUTO would pick a GPU if present */

    smoe_layer *layer = NULL;
    CHECK(smoe_layer_create(&desc, &layer));
    printf("smoe %s, backend path: %s\n", smoe_version_string(), smoe_layer_path_name(layer));

    const int64_t T = 16, d = desc.d, n = desc.n, E = desc.E;

    /* 2. Ask how much memory a call with T tokens needs. The workspace is
     *    scratch for one call; the saved block carries the forward's state
     *    (H and the routing metadata) to the backward. 0 means an error. */
    size_t ws_bytes = smoe_layer_workspace_bytes(layer, T, 0);
    size_t saved_bytes = smoe_layer_saved_bytes(layer, T, 0);
    if (ws_bytes == 0 || saved_bytes == 0) {
        fprintf(stderr, "size query failed: %s\n", smoe_last_error());
        return 1;
    }
    printf("T = %lld: workspace %zu bytes, saved for backward %zu bytes\n", (long long)T,
           ws_bytes, saved_bytes);

    /* 3. Allocate the tensors (the caller owns all memory). SwiGLU is gated,
     *    so W1 has 2n rows per expert. */
    float *x = xalloc(sizeof(float) * T * d);          /* (T, d) */
    float *router_w = xalloc(sizeof(float) * E * d);   /* (E, d) */
    float *w1 = xalloc(sizeof(float) * E * 2 * n * d); /* (E, 2n, d) */
    float *w2 = xalloc(sizeof(float) * E * d * n);     /* (E, d, n) */
    float *out = xalloc(sizeof(float) * T * d);        /* (T, d) */
    float *logits = xalloc(sizeof(float) * T * E);     /* (T, E), optional output */
    int32_t *counts = xalloc(sizeof(int32_t) * E);     /* (E), optional output */
    void *saved = xalloc(saved_bytes);
    void *workspace = xalloc(ws_bytes);
    fill(x, (size_t)(T * d), 1.0f, 1);
    fill(router_w, (size_t)(E * d), 1.0f / sqrtf((float)d), 2);
    fill(w1, (size_t)(E * 2 * n * d), 1.0f / sqrtf((float)d), 3);
    fill(w2, (size_t)(E * d * n), 1.0f / sqrtf((float)n), 4);

    /* 4. Training forward: out = MoE(x); the router logits and the rows per
     *    expert come back for auxiliary losses. */
    smoe_forward_args fa = {0};
    fa.T = T;
    fa.x = x;
    fa.router_w = router_w;
    fa.w1 = w1;
    fa.w2 = w2;
    fa.out = out;
    fa.router_logits = logits;
    fa.expert_counts = counts;
    fa.inference = 0; /* keep state for the backward in `saved` */
    CHECK(smoe_layer_forward(layer, &fa, saved, saved_bytes, workspace, ws_bytes, NULL));

    int64_t rows = 0;
    for (int64_t e = 0; e < E; e++) rows += counts[e];
    printf("forward: %lld routed rows (T*K = %lld), out[0][0..3] = %.5f %.5f %.5f %.5f\n",
           (long long)rows, (long long)(T * desc.K), out[0], out[1], out[2], out[3]);

    /* 5. Backward with the loss L = sum(out^2) / 2, so dL/dout = out. Each
     *    gradient is a smoe_grad: a buffer, its dtype (the layer's or F32)
     *    and whether to overwrite (0) or accumulate into it (1). A NULL
     *    buffer means "not wanted". */
    float *dx = xalloc(sizeof(float) * T * d);
    float *drouter_w = xalloc(sizeof(float) * E * d);
    float *dw1 = xalloc(sizeof(float) * E * 2 * n * d);
    float *dw2 = xalloc(sizeof(float) * E * d * n);

    smoe_backward_args ba = {0};
    ba.T = T;
    ba.x = x; /* the forward's inputs, unchanged */
    ba.router_w = router_w;
    ba.w1 = w1;
    ba.w2 = w2;
    ba.dout = out;
    ba.dx = (smoe_grad){dx, SMOE_DTYPE_F32, 0};
    ba.drouter_w = (smoe_grad){drouter_w, SMOE_DTYPE_F32, 0};
    ba.dw1 = (smoe_grad){dw1, SMOE_DTYPE_F32, 0};
    ba.dw2 = (smoe_grad){dw2, SMOE_DTYPE_F32, 0};
    CHECK(smoe_layer_backward(layer, &ba, saved, saved_bytes, workspace, ws_bytes, NULL));

    double norm = 0.0;
    for (int64_t i = 0; i < T * d; i++) norm += (double)dx[i] * dx[i];
    printf("backward: |dL/dx| = %.6f\n", sqrt(norm));

    /* 6. A bad call is refused with a message, and writes nothing. */
    fa.T = 0;
    smoe_status st = smoe_layer_forward(layer, &fa, saved, saved_bytes, workspace, ws_bytes, NULL);
    printf("forward with T = 0: %s (%s)\n", smoe_status_string(st), smoe_last_error());
    if (st != SMOE_ERROR_INVALID_SIZE) return 1;

    /* 7. Free everything; smoe_layer_free accepts NULL. */
    free(x);
    free(router_w);
    free(w1);
    free(w2);
    free(out);
    free(logits);
    free(counts);
    free(saved);
    free(workspace);
    free(dx);
    free(drouter_w);
    free(dw1);
    free(dw2);
    smoe_layer_free(layer);
    return 0;
}
