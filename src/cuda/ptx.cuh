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

/* Shared-memory address of a generic pointer into shared memory (what
 * cp.async, ldmatrix and the other shared-memory operands take). */
static __device__ __forceinline__ uint32_t smoe_smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* cp.async (sm_80): global -> shared copies that bypass the registers,
 * grouped by commit and waited for by group. pred false copies no bytes
 * and zero-fills the destination, so a tile's ragged edges need no second
 * code path (src must still be a valid address). */

/* 16 bytes, through L2 only (.cg). */
static __device__ __forceinline__ void smoe_cp_async16(uint32_t dst, const void *src, bool pred)
{
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

/* The same, with the 256 bytes around the chunk fetched into L2 as well
 * (an operand's next chunks, read by neighbouring CTAs or the next k-tile). */
static __device__ __forceinline__ void smoe_cp_async16_l2_256(uint32_t dst, const void *src,
                                                             bool pred)
{
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(n));
}

/* 4 bytes, through L1 (.ca: 4-byte copies cannot take .cg). */
static __device__ __forceinline__ void smoe_cp_async4(uint32_t dst, const void *src, bool pred)
{
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

static __device__ __forceinline__ void smoe_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}

/* Wait until at most N of this thread's commit groups are in flight. */
template <int N>
static __device__ __forceinline__ void smoe_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* A 4-byte global load where pred holds, 0 elsewhere, as one predicated
 * ld.global: the address is formed whatever pred says (a C++ conditional
 * load becomes a branch around the load and its address arithmetic).
 * Unordered against the thread's own stores: for data the kernel does not
 * write. */
static __device__ __forceinline__ int32_t smoe_ld_global_s32_pred(const int32_t *src, bool pred)
{
    int32_t v;
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\tmov.b32 %0, 0;\n\t"
                 "@p ld.global.b32 %0, [%1];\n\t}\n"
                 : "=r"(v)
                 : "l"(src), "r"((int)pred));
    return v;
}

/* Four 8x8 b16 matrices from shared memory (lane i gives the row address
 * of matrix i / 8), fragments in mma.sync's layout; _trans transposes each,
 * for operands stored MN-major. */
static __device__ __forceinline__ void smoe_ldmatrix_x4(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void smoe_ldmatrix_x4_trans(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a b, m16n8k16, bf16 inputs, fp32 accumulators (warp-wide). */
static __device__ __forceinline__ void smoe_mma_m16n8k16_bf16(float c[4], const uint32_t a[4],
                                                              uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
