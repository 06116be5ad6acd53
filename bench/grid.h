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

/*
 * Routed-expert shapes of public MoE models people train (issue 20), from
 * their published configs: d = hidden_size, n = moe_intermediate_size (or the
 * experts' intermediate_size), E = routed experts, K = experts per token.
 * Shared experts, dense layers and each model's own router (sigmoid scores,
 * group-limited top-K, score bias, gpt-oss's clamped SwiGLU with biases) are
 * not modelled: every row runs bf16, SwiGLU, TOPK_SOFTMAX, all E experts on
 * one GPU (no expert parallelism). No published numbers (-1).
 *
 * T = tokens per GPU, 8K to 32K, chosen so that one forward+backward fits an
 * H100 80GB with room for two implementations in one process: weights and
 * their gradients take 12End bytes (bf16 W1 (E, 2n, d), W2 (E, d, n), the
 * same again for dW1, dW2), the activations about TK(6n + 4d) bytes (H, A,
 * gathered rows) plus a few T x d buffers. Largest: DeepSeek-V3, 12End =
 * 45.1 GB, so T = 8K (TK(6n + 4d) = 2.7 GB); the others take 16K or 32K
 * and stay under 20 GB (GLM-4.5: 15.1 + 3.9). Kimi-K2 (d 7168, n 2048,
 * E 384, K 8) is left out: its weights and gradients alone are 67.6 GB.
 * Supported by smoe's Hopper path: d and n multiples of 64 (gpt-oss's
 * 2880 = 45 x 64, GLM-4.5-Air's 1408 = 22 x 64), E <= 1024.
 */
static const smoe_grid_row smoe_model_rows[] = {
    /* Sources (each number checked in the config named):
     * Mixtral-8x7B: mistralai/Mixtral-8x7B-v0.1 config.json; transformers
     *   MixtralConfig defaults (hidden_size 4096, intermediate_size 14336,
     *   num_local_experts 8, num_experts_per_tok 2).
     * OLMoE-1B-7B: allenai/OLMoE-1B-7B-0924 config.json (hidden_size 2048,
     *   intermediate_size 1024, num_experts 64, num_experts_per_tok 8; note
     *   transformers' OlmoeConfig default intermediate_size is 2048, not the
     *   released model's).
     * Qwen3-30B-A3B: transformers Qwen3MoeConfig defaults (hidden_size 2048,
     *   moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8).
     * Qwen3-235B-A22B: Qwen/Qwen3-235B-A22B (hidden_size 4096,
     *   moe_intermediate_size 1536, num_experts 128, num_experts_per_tok 8;
     *   expert weights [1536, 4096] per its checkpoint; MindSpeed-RL's
     *   qwen3_235b_a22b.yaml agrees).
     * GLM-4.5-Air: transformers Glm4MoeConfig defaults (hidden_size 4096,
     *   moe_intermediate_size 1408, n_routed_experts 128, num_experts_per_tok
     *   8, 46 layers: the Air model).
     * GLM-4.5: the GLM-5 technical report's GLM-4.5 column (hidden 5120, MoE
     *   intermediate 1536, 160 experts, 8 routed per token); zai-org's
     *   GLM-4.6 / GLM-4.7 config.json have the same numbers.
     * gpt-oss-120b: transformers GptOssConfig defaults (hidden_size 2880,
     *   intermediate_size 2880, num_local_experts 128, num_experts_per_tok 4,
     *   36 layers: the 120b model); openai/gpt-oss-120b original/config.json.
     * DeepSeek-V3: transformers DeepseekV3Config defaults (hidden_size 7168,
     *   moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok
     *   8), deepseek-ai/DeepSeek-V3 config.json. */
    /* name               model              T      d     n      E    K  floor  published: none */
    {"Mixtral-8x7B",    "Mixtral-8x7B",    16384, 4096, 14336, 8,   2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"OLMoE-1B-7B",     "OLMoE-1B-7B",     32768, 2048, 1024,  64,  8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"Qwen3-30B-A3B",   "Qwen3-30B-A3B",   32768, 2048, 768,   128, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"Qwen3-235B-A22B", "Qwen3-235B-A22B", 16384, 4096, 1536,  128, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"GLM-4.5-Air",     "GLM-4.5-Air",     16384, 4096, 1408,  128, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"GLM-4.5",         "GLM-4.5",         16384, 5120, 1536,  160, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"gpt-oss-120b",    "gpt-oss-120b",    16384, 2880, 2880,  128, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    {"DeepSeek-V3",     "DeepSeek-V3",     8192,  7168, 2048,  256, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
};

#define SMOE_MODEL_ROWS ((int)(sizeof smoe_model_rows / sizeof smoe_model_rows[0]))

/* Small enough for a 2-core CPU in a few seconds (layer + fp64 reference). */
static const smoe_grid_row smoe_grid_default = {
    "small", "small", 512, 256, 128, 16, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

#endif /* SMOE_BENCH_GRID_H */
