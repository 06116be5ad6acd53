/*
 * activation.cuh -- the activations on the GPU, for every kernel family:
 * f (of the gate when gated) and f' with the activation a compile-time
 * constant, so an epilogue unrolled over its elements carries one
 * activation's code (a run-time switch per element inlined every
 * activation into every unrolled element: 450 KB kernels that stalled on
 * instruction fetch, notes/sm90_log.md rung 8); SMOE_ACT_SWITCH dispatches
 * once per tile or chunk.
 *
 * Numerics (fp32, before the bf16 rounding of what is stored): the
 * sigmoid as x / (1 + 2^(-x log2 e)) by the special-function unit's 2^x
 * and the fast reciprocal (1-2 ulp), tanh by tanhf; relu keeps NaN as
 * PyTorch does (fmaxf(NaN, 0) would be 0) and its derivative, x <= 0 ? 0 :
 * 1, passes a NaN's gradient through. The CPU oracle (src/cpu) computes the
 * same functions in double.
 */
#ifndef SMOE_ACTIVATION_CUH
#define SMOE_ACTIVATION_CUH

#include "cuda/ptx.cuh"
#include "smoe.h"

/* Gated activations (SwiGLU, GEGLU, ReGLU) come first in smoe_activation. */
static __host__ __device__ constexpr bool smoe_act_gated(int act) { return act <= SMOE_ACT_REGLU; }

static __device__ __forceinline__ float smoe_relu(float x) { return x <= 0.0f ? 0.0f : x; }

/* e^-x with results below 2^-126 flushed to zero: 1 + e^-x, its only use,
 * is the same fp32 value either way, at three instructions fewer than
 * __expf. */
static __device__ __forceinline__ float smoe_exp_neg(float x)
{
    return smoe_ex2_approx_ftz(x * -1.4426950408889634f);
}

#define SMOE_GELU_C 0.7978845608028654f /* sqrt(2 / pi) */
#define SMOE_GELU_A 0.044715f

/* f(x). */
template <int ACT>
static __device__ __forceinline__ float smoe_act_f(float x)
{
    if constexpr (ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_GELU) {
        return __fdividef(x, 1.0f + __expf(-2.0f * SMOE_GELU_C * (x + SMOE_GELU_A * x * x * x)));
    } else if constexpr (ACT == SMOE_ACT_REGLU || ACT == SMOE_ACT_RELU) {
        return smoe_relu(x);
    } else if constexpr (ACT == SMOE_ACT_RELU2) {
        const float r = smoe_relu(x);
        return r * r;
    } else { /* SWIGLU, SILU */
        return __fdividef(x, 1.0f + smoe_exp_neg(x));
    }
}

/* f(x) and f'(x). */
template <int ACT>
static __device__ __forceinline__ void smoe_act_fd(float x, float &f, float &df)
{
    if constexpr (ACT == SMOE_ACT_GEGLU || ACT == SMOE_ACT_GELU) {
        const float th = tanhf(SMOE_GELU_C * (x + SMOE_GELU_A * x * x * x));
        f = 0.5f * x * (1.0f + th);
        df = 0.5f * (1.0f + th) +
             0.5f * x * (1.0f - th * th) * SMOE_GELU_C * (1.0f + 3.0f * SMOE_GELU_A * x * x);
    } else if constexpr (ACT == SMOE_ACT_REGLU || ACT == SMOE_ACT_RELU) {
        f = smoe_relu(x);
        df = x <= 0.0f ? 0.0f : 1.0f;
    } else if constexpr (ACT == SMOE_ACT_RELU2) {
        const float r = smoe_relu(x);
        f = r * r;
        df = 2.0f * r;
    } else { /* SWIGLU, SILU */
        const float sg = __fdividef(1.0f, 1.0f + smoe_exp_neg(x));
        f = x * sg;
        df = sg * (1.0f + x * (1.0f - sg));
    }
}

/* CALL(A) with the activation act as the compile-time constant A: once
 * per tile or chunk, never per element. Layers are made with a valid
 * activation; any other value runs SwiGLU's code. */
#define SMOE_ACT_SWITCH(act, CALL)                                                               \
    switch (act) {                                                                               \
    case SMOE_ACT_GEGLU: CALL(SMOE_ACT_GEGLU); break;                                            \
    case SMOE_ACT_REGLU: CALL(SMOE_ACT_REGLU); break;                                            \
    case SMOE_ACT_RELU2: CALL(SMOE_ACT_RELU2); break;                                            \
    case SMOE_ACT_RELU: CALL(SMOE_ACT_RELU); break;                                              \
    case SMOE_ACT_SILU: CALL(SMOE_ACT_SILU); break;                                              \
    case SMOE_ACT_GELU: CALL(SMOE_ACT_GELU); break;                                              \
    default: CALL(SMOE_ACT_SWIGLU); break;                                                       \
    }

#endif /* SMOE_ACTIVATION_CUH */
