/*
 * cuda_layer.h -- what the CUDA backend's layer (cuda_layer.cu) offers the
 * expert-parallel layer's CUDA path (ep_cuda.cu): the router of a whole
 * layer without its experts, and the GENERAL forward with its triples'
 * number on the device. For the CUDA files (after cuda_common.h).
 */
#ifndef SMOE_CUDA_LAYER_H
#define SMOE_CUDA_LAYER_H

#include "smoe_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The GENERAL layer's forward (the layer's own checks done) with the
 * number of triples on the device (*pairs_dev <= args->pairs, the
 * capacity the saved layout and the workspace were sized for). */
smoe_status smoe_cuda_forward_dev_pairs(smoe_layer *layer, const smoe_forward_args *args,
                                        const int32_t *pairs_dev, const smoe_saved_layout *sl,
                                        void *saved, void *workspace, void *stream);

/* The layer's backward (its own checks done) that computes nothing when
 * *upstream (a device status code) is not 0: the expert-parallel layer's
 * failure stops its experts' call. */
smoe_status smoe_cuda_backward_upstream(smoe_layer *layer, const smoe_backward_args *args,
                                        const smoe_saved_layout *sl, const void *saved,
                                        void *workspace, const int *upstream, void *stream);

/* The router of `layer` (not GENERAL; no token rounding) on T tokens:
 * workspace bytes of the two calls below. */
size_t smoe_cuda_router_ws_bytes(const smoe_layer *layer, int64_t T);

/* logits (T, E) fp32 = x Wr^T (cuBLAS), then the routing into `as`
 * (smoe_cuda_route's assignments: expert, token, score, token_offset,
 * count). */
smoe_status smoe_cuda_router_forward(smoe_layer *layer, int64_t T, const void *x,
                                     const void *router_w, float *logits,
                                     struct smoe_assign_dev as, void *workspace, void *stream);

/* The router's backward from per-assignment score gradients ds (indexed by
 * v->assign_row, as v->row_score): dlogits through the routing mode (plus
 * dlogits_extra), drouter_w (its ptr may be NULL) = dlogits^T x, and dxr
 * (T, d) fp32 = dlogits Wr (dense; NULL: not wanted). */
smoe_status smoe_cuda_router_backward(smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                                      const float *ds, const float *dlogits_extra,
                                      const void *x, const void *router_w,
                                      const smoe_grad *drouter_w, float *dxr, void *workspace,
                                      const int *abort, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SMOE_CUDA_LAYER_H */
