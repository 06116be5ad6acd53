/*
 * tensor_map_sm90.h -- the one TMA tensor-map constructor the Hopper kernels
 * share (defined in grouped_gemm_sm90.cu).
 */
#ifndef SMOE_TENSOR_MAP_SM90_H
#define SMOE_TENSOR_MAP_SM90_H

#include <cuda.h>
#include <stdint.h>

#include "smoe.h"

/* A row-major bf16 matrix (rows x cols) as a 2-D tensor map: boxes of 64
 * columns (128 bytes) x box_rows rows, 128-byte swizzle, 256-byte L2
 * promotion, out-of-range elements read as zero. `what` names the operand
 * in the error message. */
extern "C" smoe_status smoe_sm90_make_map(CUtensorMap *map, const void *base, int64_t rows,
                                          int64_t cols, int box_rows, const char *what);

#endif
