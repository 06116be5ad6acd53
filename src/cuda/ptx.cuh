/*
 * ptx.cuh -- thin named wrappers for the PTX instructions the kernels for
 * every device (sm_80 and later) use; the Hopper-only ones (TMA, mbarrier,
 * wgmma, setmaxnreg) are in sm90/ptx_sm90.cuh, which includes this one.
 * Each wrapper is one instruction, so kernel bodies read as algorithms;
 * no other file under src/cuda holds inline assembly.
 */
#ifndef SMOE_PTX_CUH
#define SMOE_PTX_CUH

#include <stdint.h>

/* 2^x, the special-function unit's approximation, results below 2^-126
 * flushed to zero. */
static __device__ __forceinline__ float smoe_ex2_approx_ftz(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Programmatic dependent launch (sm_90 and later; nothing before): wait
 * for the previous kernel's results; let the next kernel start its
 * prologue. */
static __device__ __forceinline__ void smoe_griddep_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void smoe_griddep_launch_dependents(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#endif /* SMOE_PTX_CUH */
