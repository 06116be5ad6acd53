/*
 * cuda_layer.h -- what the CUDA backend's layer offers the expert-parallel
 * layer's CUDA path (ep_cuda.cu) and the benchmark: the GEMM launchers of a
 * layer (cuda_layer.cu), a GEMM's row chosen by name (cuda_layer_init.cu),
 * the router of a whole layer without its experts (cuda_router.cu). For
 * the CUDA files (after cuda_common.h).
 */
#ifndef SMOE_CUDA_LAYER_H
#define SMOE_CUDA_LAYER_H

#include "smoe_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The GEMM launchers `layer` runs (each op's Hopper entry where create
 * chose it, else the portable one), for the expert-parallel layer's
 * chunked schedule (ep_cuda.cu), which calls them itself. */
typedef struct smoe_cuda_gemms {
    smoe_gemm_ops ops;
    int views;            /* up, down, dh and dxt take a view (off_stride) */
    smoe_gemm_problem problem; /* the layer's sizes with cap; no buffers */
    size_t scratch_bytes; /* the launchers' scratch for cap rows */
    int num_sms;
} smoe_cuda_gemms;

smoe_cuda_gemms smoe_cuda_layer_gemms(const smoe_layer *layer, int64_t cap);

/* For tests and the benchmark, before the layer's first call: GEMM `gemm`
 * ("up", "down", "dh", "dw2", "dxt", "dw1") runs the row named `name` of
 * its family's tile table instead of the plan's; refused (and the plan
 * kept) if there is no such row or it cannot run the layer's shape. */
smoe_status smoe_cuda_layer_set_row(smoe_layer *layer, const char *gemm, const char *name);

/* The router of `layer` (not GENERAL; no token rounding) on T tokens:
 * workspace bytes of the two calls below. */
size_t smoe_cuda_router_ws_bytes(const smoe_layer *layer, int64_t T);

/* logits (T, E) fp32 = x Wr^T (cuBLAS), then the routing into `as`
 * (smoe_cuda_route's assignments: expert, token, score, token_offset,
 * count); expert_bias: SIGMOID_TOPK's (E) or NULL. */
smoe_status smoe_cuda_router_forward(smoe_layer *layer, int64_t T, const void *x,
                                     const void *router_w, const float *expert_bias,
                                     float *logits, struct smoe_assign_dev as, void *workspace,
                                     void *stream);

/* The router's backward from per-assignment score gradients ds (indexed by
 * v->assign_row, as v->row_score): dlogits through the routing mode (plus
 * dlogits_extra), drouter_w (its ptr may be NULL) = dlogits^T x, and dxr
 * (T, d) fp32 = dlogits Wr (dense; NULL: not wanted). */
smoe_status smoe_cuda_router_backward(smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                                      const float *ds, const void *dlogits_extra,
                                      smoe_dtype extra_dt, const void *x, const void *router_w,
                                      const smoe_grad *drouter_w, float *dxr, void *workspace,
                                      const int *abort, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SMOE_CUDA_LAYER_H */
