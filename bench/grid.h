/*
 * grid.h -- SonicMoE's H100 benchmark grid (its paper's Figures 13/14), as
 * listed in shared/bench/grid.tsv, plus a small default configuration that
 * runs in seconds on a CPU. All rows: bf16, SwiGLU, TOPK_SOFTMAX routing.
 *
 * Columns (shared/bench/README.md): floor_act_gib is the least activation
 * memory without GEMM recomputation, H (4TKn) + O (2Td) + routing metadata
 * (about 16TK bytes). The *_fwd/_bwd columns are TFLOPS (6TKdn / forward
 * time, 12TKdn / backward time) and *_act_gib activation memory, measured on
 * one H100 80GB HBM3: SonicMoE as published (+-5), the plain PyTorch
 * grouped_mm layer, ScatterMoE 0.3.0, and the grouped GEMMs alone (cuBLAS).
 * A negative value: not published (the default configuration).
 */
#ifndef SMOE_BENCH_GRID_H
#define SMOE_BENCH_GRID_H

#include <stdint.h>

typedef struct smoe_grid_row {
    const char *name; /* "<model>-n<n>", e.g. "7B-n256" */
    const char *model;
    int64_t T, d, n, E, K;
    double floor_act_gib;
    double sonicmoe_fwd, sonicmoe_bwd;
    double torch_fwd, torch_bwd, torch_act_gib;
    double scattermoe_fwd, scattermoe_bwd, scattermoe_act_gib;
    double gemm_bound_fwd, gemm_bound_bwd;
} smoe_grid_row;

static const smoe_grid_row smoe_grid[] = {
    /* name        model   T      d     n     E    K   floor  sonic fwd/bwd torch fwd/bwd/act   scatter fwd/bwd/act  gemm fwd/bwd */
    {"1.4B-n256",  "1.4B", 40960, 768,  256,  128, 8,  0.38, 334, 362, 73.7,  121.0, 2.1,   127.6, 113.5, 1.16, 502, 526},
    {"1.4B-n512",  "1.4B", 40960, 768,  512,  64,  4,  0.37, 400, 400, 108.8, 156.6, 1.39,  148.7, 137.1, 0.92, 586, 634},
    {"1.4B-n1024", "1.4B", 40960, 768,  1024, 32,  2,  0.37, 403, 433, 150.7, 176.6, 1.04,  135.8, 154.2, 0.8,  634, 634},
    {"7B-n256",    "7B",   24576, 1536, 256,  128, 8,  0.26, 362, 403, 82.2,  144.1, 2.14,  145.4, 140.1, 1.01, 527, 569},
    {"7B-n512",    "7B",   24576, 1536, 512,  64,  4,  0.26, 430, 440, 122.7, 199.2, 1.29,  164.3, 172.0, 0.73, 627, 658},
    {"7B-n1024",   "7B",   24576, 1536, 1024, 32,  2,  0.26, 463, 466, 165.9, 236.6, 0.87,  170.5, 196.5, 0.59, 663, 677},
    {"30B-n256",   "30B",  32768, 4096, 256,  256, 16, 0.76, 427, 459, 78.7,  178.7, 13.26, 241.1, 210.7, 5.26, 626, 608},
    {"30B-n512",   "30B",  32768, 4096, 512,  128, 8,  0.75, 500, 510, 159.7, 263.2, 7.26,  273.9, 246.8, 3.26, 687, 664},
    {"30B-n1024",  "30B",  32768, 4096, 1024, 64,  4,  0.75, 552, 554, 243.0, 332.9, 4.25,  296.2, 306.5, 2.25, 684, 660},
    {"120B-n512",  "120B", 32768, 4096, 512,  256, 16, 1.26, 517, 526, 138.8, 257.0, 14.26, 310.0, 266.7, 6.26, 669, 649},
    {"120B-n1024", "120B", 32768, 4096, 1024, 128, 8,  1.25, 560, 568, 252.6, 333.2, 8.26,  327.4, 302.4, 4.26, 708, 663},
    {"120B-n2048", "120B", 32768, 4096, 2048, 64,  4,  1.25, 595, 586, 347.1, 386.7, 5.25,  329.4, 336.3, 3.25, 697, 671},
};

#define SMOE_GRID_ROWS ((int)(sizeof smoe_grid / sizeof smoe_grid[0]))

/* Small enough for a 2-core CPU in a few seconds (layer + fp64 reference). */
static const smoe_grid_row smoe_grid_default = {
    "small", "small", 512, 256, 128, 16, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

#endif /* SMOE_BENCH_GRID_H */
