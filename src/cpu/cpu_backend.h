/*
 * cpu_backend.h -- what the CPU backend shares with the expert-parallel
 * layer (src/ep.c), so that both compute the router the same way, bit for
 * bit: its logits, and its backward from per-assignment score gradients.
 */
#ifndef SMOE_CPU_BACKEND_H
#define SMOE_CPU_BACKEND_H

#include "smoe_internal.h"

/* logits (T, E) = X Wr^T, summed in double from x in double (T, d):
 * l32 the fp32 values the routing reads, l64 the double ones (F64 layers'
 * scores); either may be NULL. */
void smoe_cpu_router_logits(const smoe_layer *layer, int64_t T, const double *xd,
                            const void *router_w, float *l32, double *l64);

/* Scratch of smoe_cpu_router_backward: rp (3E doubles), ridx (K int32),
 * rl32 (E floats). */
typedef struct smoe_cpu_router_scratch {
    double *rp;
    int32_t *ridx;
    float *rl32;
} smoe_cpu_router_scratch;

/* The router's backward over T tokens: dl (T, E) = dlogits through the
 * routing mode from the score gradients ds (indexed by v->assign_row, as
 * v->row_score), plus dlogits_extra (may be NULL; of dtype extra_dt), each rounded as the
 * layer's fp32 intermediates; then drouter_w (if its ptr is set) = dl^T X.
 * v needs token_offset, assign_row, assign_expert, row_score and, for
 * SOFTMAX_TOPK and token rounding, logits. */
void smoe_cpu_router_backward(const smoe_layer *layer, int64_t T, const smoe_saved_view *v,
                              const double *ds, const void *dlogits_extra, smoe_dtype extra_dt,
                              const double *xd, const smoe_grad *drouter_w, double *dl,
                              const smoe_cpu_router_scratch *scratch);

/* The router_logits output: the n fp32 logits l32 into dst as dtype dt
 * (F32 copied; BF16 rounded to nearest even; F64 widened). */
void smoe_cpu_put_logits(void *dst, smoe_dtype dt, const float *l32, int64_t n);

/* o (d) += dl (E) Wr, dense as PyTorch's dlogits @ Wr: a zero dlogit still
 * meets a NaN or infinite router weight (0 * inf = NaN). */
void smoe_cpu_router_dx(const smoe_layer *layer, const double *dl, const void *router_w,
                        double *o);

#endif /* SMOE_CPU_BACKEND_H */
