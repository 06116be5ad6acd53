/*
 * args.cuh -- what the portable grouped-GEMM kernel (kernel.cuh) is
 * given: its operands, the maps from an operand's logical rows to memory
 * rows, the epilogue's outputs, and the epilogue kinds. One struct passed
 * by value, so the launchers (grouped_gemm.cu) fill it on the host and
 * every part reads the same fields.
 */
#ifndef SMOE_PORTABLE_ARGS_CUH
#define SMOE_PORTABLE_ARGS_CUH

#include "cuda/gemm.h"

/* Logical strided index -> memory row of an operand: itself, the row's
 * token (the gather of X or dO), or W1's physical row (smoe_w1_row). */
enum { GG_MAP_IDENT = 0, GG_MAP_TOKEN = 1, GG_MAP_W1 = 2 };

/* The epilogues (epilogue.cuh). UP: bias, H, A = act(H) (up). STORE: bias,
 * bf16 out (down, dxt). DH: dh's, each thread over its own fragments in
 * unrolled code. DHX: dh's with the fp32 dA' staged in shared memory and
 * whole rows per warp (H loaded in two halves, dH stored from registers).
 * DW: the weight gradients' (dw1, dw2), unrolled over the fragments. DWS:
 * the same through fp32 staging, 16-byte stores. */
enum { GG_EPI_UP = 0, GG_EPI_STORE, GG_EPI_DH, GG_EPI_DHX, GG_EPI_DW, GG_EPI_DWS };

typedef struct gg_operand {
    const bf16 *ptr;       /* expert 0's matrix (or the activation matrix) */
    int64_t expert_stride; /* elements from one expert's matrix to the next; 0: shared */
    int64_t ld;            /* elements per memory row */
    int map;               /* GG_MAP_*: logical strided index -> memory row */
} gg_operand;

typedef struct gg_args {
    int64_t M, N, K; /* varlen-M: M unused; varlen-K: K unused (expert rows) */
    int E;
    int tiles_m, tiles_n;
    int act, gated, w1_layout;
    int64_t n; /* for smoe_w1_row */
    const int32_t *off, *tok;
    const float *score;
    gg_operand a, b;
    /* epilogue */
    const bf16 *bias; /* (E, N) in the map below; NULL: none */
    int64_t bias_stride;
    int bias_map; /* GG_MAP_IDENT or GG_MAP_W1 */
    bf16 *out;    /* H (up), Y or dX~ (store), dH (dh) */
    int64_t ld_out;
    bf16 *out2; /* A (up), A' (dh) */
    int64_t ld_out2;
    const bf16 *hin; /* H (dh) */
    int64_t ld_h;
    float *dsp; /* (tiles_n, cap) dS partial sums (dh) */
    int64_t cap;
    void *wout; /* (E, M, N) weight gradient (dw) */
    int out_f32, accumulate, out_map;
    const int *abort; /* smoe_gemm_problem.abort */
} gg_args;

static __device__ __forceinline__ int64_t gg_map(const gg_args &p, int map, int64_t i)
{
    if (map == GG_MAP_TOKEN) return p.tok[i];
    if (map == GG_MAP_W1) return smoe_w1_row(i, p.n, p.gated, (smoe_w1_layout)p.w1_layout);
    return i;
}

/* The same with the map known at compile time (MN-major operands map
 * every k-tile's rows inside the main loop). */
template <int MAP>
static __device__ __forceinline__ int64_t gg_map_c(const gg_args &p, int64_t i)
{
    if (MAP == GG_MAP_TOKEN) return p.tok[i];
    if (MAP == GG_MAP_W1) return smoe_w1_row(i, p.n, p.gated, (smoe_w1_layout)p.w1_layout);
    return i;
}

#endif /* SMOE_PORTABLE_ARGS_CUH */
