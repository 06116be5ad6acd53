/*
 * ptx_sm90.cuh -- thin named wrappers for the Hopper (sm_90a) instructions the
 * grouped GEMMs use: TMA tensor loads, mbarriers, cp.async with mbarrier
 * completion, wgmma (descriptors, fences, m64nNk16 bf16), setmaxnreg, proxy
 * fences and stmatrix; it includes ../ptx.cuh (the instructions every
 * device runs). No other file under src/cuda/sm90 holds inline assembly.
 * Each wrapper is one instruction (or one wait loop) so kernel bodies read
 * as algorithms. Build with -gencode=arch=compute_90a,code=sm_90a.
 */
#ifndef SMOE_PTX_SM90_CUH
#define SMOE_PTX_SM90_CUH

#include <cuda.h> /* CUtensorMap (type only: no libcuda link) */
#include <stdio.h> /* printf: SMOE_SM90_WAIT_CHECK builds only */
#include <stdint.h>

#include "cuda/ptx.cuh"

namespace smoe_sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* ------------------------------------------------------------ mbarrier */

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

/* Makes the initialised barriers visible to the other threads and to the
 * async proxy (TMA); follow with a block barrier. */
__device__ __forceinline__ void mbar_fence_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* One arrival plus `bytes` more transaction bytes expected in this phase. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* One bounded wait for the phase: the thread may be suspended until the phase
 * completes or up to the hint (10 ms, as CUTLASS's barriers ask) passes.
 * Without the hint every waiter spins, and under compute-sanitizer's
 * racecheck such spinning stalled a 6-stage kernel for minutes
 * (notes/sm90_log.md rung 13); on an H100 the hint is neutral for speed. */
__device__ __forceinline__ int mbar_try_wait(uint32_t bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 10000000;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return (int)ok;
}

/* Ends the barrier object's life: its 8 bytes may then hold anything else
 * (PTX asks for this before a barrier's memory is reused). Every kernel
 * invalidates its barriers before the CTA exits, once no thread or copy
 * uses them. Speed-neutral; under compute-sanitizer's racecheck the whole
 * Hopper GEMM test then finished for the first time (notes/sm90_log.md
 * rung 14). */
__device__ __forceinline__ void mbar_inval(uint32_t bar)
{
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

/* Waits until the phase with the given parity has completed. A fresh barrier
 * counts as having completed the phase of parity 1. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    while (!mbar_try_wait(bar, parity)) {
    }
}

#ifdef SMOE_SM90_WAIT_CHECK
/* A debugging build's hang detector (make SM90_WAIT_CHECK=MS, best in a
 * build directory of its own): a barrier wait that has not passed after MS
 * milliseconds prints where it waits (file and line of the call, block,
 * thread, the barrier's shared address and the parity) from each warp's
 * lane 0, and gives up. From then on every wait of that file's kernels
 * (the flag is per file: grouped_gemm_sm90.cu, varlen_k_sm90.cu) gives up
 * at once, so the kernels and the program run out (their results are
 * wrong) and the lines are flushed, instead of the process hanging with
 * nothing said. Session 37 found a ring-protocol hang with it in one call
 * (notes/sm90_log.md rung 29). Not for speed: the wait is a call. */
static __device__ int g_wait_stuck;

static __device__ __noinline__ void mbar_wait_checked(uint32_t bar, uint32_t parity,
                                                      const char *file, int line)
{
    if (mbar_try_wait(bar, parity)) return;
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (!mbar_try_wait(bar, parity)) {
        if (*(volatile int *)&g_wait_stuck) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > (uint64_t)(SMOE_SM90_WAIT_CHECK) * 1000000ull) {
            if ((threadIdx.x & 31) == 0)
                printf("SMOE WAIT STUCK %s:%d block %d thread %d barrier 0x%x parity %u "
                       "(every later wait gives up: results are wrong from here)\n",
                       file, line, (int)blockIdx.x, (int)threadIdx.x, bar, parity);
            atomicExch(&g_wait_stuck, 1);
            return;
        }
    }
}
#define mbar_wait(bar, parity) mbar_wait_checked((bar), (parity), __FILE__, __LINE__)
#endif

/* ------------------------------------------------------------ TMA */

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map)
{
    asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)map) : "memory");
}

/* 2-D tile load; c0 is the innermost (contiguous) coordinate. Completion:
 * the box's bytes as transactions on `bar`. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                            int32_t c0, int32_t c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1)
                 : "memory");
}


/* tma_load_2d into every CTA of the cluster named in `mask` (bit i: CTA
 * rank i): the box lands at shared offset dst of each of them and its bytes
 * complete on the barrier at offset bar of each. */
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                               int32_t c0, int32_t c1, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
                 "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
                 : "memory");
}

/* ------------------------------------------------------------ clusters */

/* This CTA's rank in its cluster. */
__device__ __forceinline__ uint32_t cluster_rank()
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of every CTA of the cluster meets here (release, then
 * acquire): shared-memory writes and barrier inits before it are seen by
 * the peers after it. */
__device__ __forceinline__ void cluster_barrier()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* One arrival on the mbarrier at shared offset `bar` in the cluster's CTA
 * `rank` (mapa turns the local offset into that CTA's window). CTA-scope
 * release, as for a local arrival: a stage's release orders only this
 * warpgroup's wgmma reads, which have retired (a cluster-scope release adds
 * a cluster-wide memory barrier per stage, which rung 8 of
 * notes/sm90_log.md measured at 8-10% of the stalls). */
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, uint32_t rank)
{
    asm volatile("{\n\t.reg .b32 rb;\n\t"
                 "mapa.shared::cluster.u32 rb, %0, %1;\n\t"
                 "mbarrier.arrive.shared::cluster.b64 _, [rb];\n\t}" ::"r"(bar),
                 "r"(rank)
                 : "memory");
}


/* 2-D tile store from shared memory (the map's box and swizzle), in this
 * thread's bulk group; rows or columns past the tensor's extent are not
 * written. The source may be reused after bulk_wait_read. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int32_t c0,
                                             int32_t c1)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"((uint64_t)map), "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/* Waits until at most N of this thread's bulk groups are still reading
 * their shared-memory source. */
template <int N>
__device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/* Waits until at most N of this thread's bulk groups are incomplete. */
template <int N>
__device__ __forceinline__ void bulk_wait()
{
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

/* ------------------------------------------------------------ cp.async */

/* 16-byte copy; src_bytes 0 writes zeros (src must still be a valid address). */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* 16-byte copy, every byte read (no zero-fill operand). */
__device__ __forceinline__ void cp_async_16_full(uint32_t dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

/* Waits for every cp.async of this thread. */
__device__ __forceinline__ void cp_async_wait_all()
{
    asm volatile("cp.async.wait_all;" ::: "memory");
}

/* 4-byte cp.async through L1 (small index loads, e.g. row tokens). */
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Waits until at most N of this thread's cp.async groups are pending. */
template <int N>
__device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float v0, float v1)
{
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

/* One 16-byte global store. A plain uint4 assignment is not always one:
 * where the value was taken apart first (ep_flush_up_ct reads its H
 * pieces as bf16 pairs), the compiler emitted four 4-byte stores, each
 * writing a quarter of the same sectors (notes/sm90_log.md, rung 26). */
__device__ __forceinline__ void st_global_v4(void *dst, uint4 v)
{
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/* Arrives on `bar` once all of this thread's earlier cp.async have landed;
 * the arrival counts against the barrier's expected count (noinc). */
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

/* ------------------------------------------------------------ fences, registers */

/* Orders this thread's generic-proxy shared-memory accesses with later
 * async-proxy ones (wgmma, TMA) and the reverse. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* setmaxnreg only moves registers inside the CTA's launch allocation: 168
 * per thread under __launch_bounds__(384, 1) (65536 / 384, rounded down to
 * a multiple of 8). Budgets over it make setmaxnreg.inc wait forever
 * (notes/sm90_log.md rung 32 item 3); the kernels assert theirs against it. */
#define SM90_LAUNCH_REGS 168

template <int R>
__device__ __forceinline__ void setmaxnreg_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

template <int R>
__device__ __forceinline__ void setmaxnreg_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

/* Named barrier over `threads` threads (a multiple of 32). */
__device__ __forceinline__ void named_barrier_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Arrives on named barrier `id` without waiting (the other side syncs). */
__device__ __forceinline__ void named_barrier_arrive(int id, int threads)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Four 8x8 b16 matrices from registers to shared memory; lane l gives the
 * address of row l%8 of matrix l/8. */
__device__ __forceinline__ void stmatrix_x4(uint32_t dst, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3)
{
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(dst),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/* The same, each matrix transposed on its way: lane l gives the address of
 * row l%8 of the TRANSPOSED matrix l/8 (column l%8 of the registers'
 * matrix). */
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t dst, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3)
{
    asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(dst),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/* ------------------------------------------------------------ wgmma */

/* Shared-memory matrix descriptor for a 128B-swizzled operand whose 8-row
 * groups lie 1024 bytes apart (K-major: rows of 64 bf16). The tile must start
 * 1024-byte aligned; stepping K by 16 inside the 128-byte row adds 32 bytes
 * to the start address. */
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t saddr)
{
    uint64_t d = 0;
    d |= (uint64_t)((saddr & 0x3FFFF) >> 4);
    d |= (uint64_t)1 << 16;             /* leading byte offset: unused for this swizzle */
    d |= (uint64_t)(1024 >> 4) << 32;   /* stride byte offset: one 8-row atom */
    d |= (uint64_t)1 << 62;             /* 128-byte swizzle */
    return d;
}

/* Descriptor for a 128B-swizzled MN-major operand (wgmma transpose bit set):
 * rows of 64 MN-elements (128 bytes) along K, 8-row atoms 1024 bytes apart
 * along K (stride byte offset), 64-element MN blocks `mn_block_bytes` apart
 * (leading byte offset). Stepping K by 16 adds 2048 bytes. */
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(uint32_t saddr, uint32_t mn_block_bytes)
{
    uint64_t d = 0;
    d |= (uint64_t)((saddr & 0x3FFFF) >> 4);
    d |= (uint64_t)((mn_block_bytes >> 4) & 0x3FFF) << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

__device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* Pins accumulator registers so the compiler neither moves nor copies them
 * across the asynchronous wgmma. */
template <int R>
__device__ __forceinline__ void wgmma_fence_regs(float *d)
{
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* The accumulator operands d[b .. b+7] of a wgmma, and the register lists
 * of its PTX text, in blocks of 32 (the wrappers below differ only in N). */
#define SMOE_WG_ACC8(b)                                                                         \
    "+f"(d[(b)]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]),      \
        "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define SMOE_WG_ACC32(b) \
    SMOE_WG_ACC8(b), SMOE_WG_ACC8((b) + 8), SMOE_WG_ACC8((b) + 16), SMOE_WG_ACC8((b) + 24)
#define SMOE_WG_OUT32 SMOE_WG_ACC32(0)
#define SMOE_WG_OUT64 SMOE_WG_OUT32, SMOE_WG_ACC32(32)
#define SMOE_WG_OUT96 SMOE_WG_OUT64, SMOE_WG_ACC32(64)
#define SMOE_WG_OUT128 SMOE_WG_OUT96, SMOE_WG_ACC32(96)
#define SMOE_WG_REG32 \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15" \
    ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define SMOE_WG_REG64 \
    SMOE_WG_REG32 \
    ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47" \
    ",%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define SMOE_WG_REG96 \
    SMOE_WG_REG64 \
    ",%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79" \
    ",%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define SMOE_WG_REG128 \
    SMOE_WG_REG96 \
    ",%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111" \
    ",%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"

/* D (64 x N, fp32, registers) (+)= A (64 x 16, smem) * B (16 x N, smem), bf16:
 * wgmma_m64n{64,128,192,256}k16. scale_d 0 ignores D's old value. TRANS_B 1
 * reads B MN-major, TRANS_A 1 reads A MN-major (the weight-gradient GEMMs).
 * Accumulator layout: thread (warp w, lane l) holds rows 16w + l/4 (+8) and
 * columns 8j + 2(l%4) + {0,1}; d[4j + {0,1}] row +0, d[4j + {2,3}] row +8.
 * Operand numbers: the N/2 accumulators, then desc_a (A), desc_b (A + 1),
 * scale_d (A + 2), TRANS_B (A + 3), TRANS_A (A + 4). */
#define SMOE_DEFINE_WGMMA(N, REGS, OUTS, A, B, S, TB, TA)                                       \
    template <int TRANS_B, int TRANS_A = 0>                                                     \
    __device__ __forceinline__ void wgmma_m64n##N##k16(float *d, uint64_t desc_a,               \
                                                       uint64_t desc_b, int scale_d)            \
    {                                                                                           \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS "}, "    \
                     "%" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"                        \
                     : OUTS                                                                     \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B), "n"(TRANS_A));     \
    }
SMOE_DEFINE_WGMMA(64, SMOE_WG_REG32, SMOE_WG_OUT32, 32, 33, 34, 35, 36)
SMOE_DEFINE_WGMMA(128, SMOE_WG_REG64, SMOE_WG_OUT64, 64, 65, 66, 67, 68)
SMOE_DEFINE_WGMMA(192, SMOE_WG_REG96, SMOE_WG_OUT96, 96, 97, 98, 99, 100)
SMOE_DEFINE_WGMMA(256, SMOE_WG_REG128, SMOE_WG_OUT128, 128, 129, 130, 131, 132)
#undef SMOE_DEFINE_WGMMA

} /* namespace smoe_sm90 */

#endif /* SMOE_PTX_SM90_CUH */
