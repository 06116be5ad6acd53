/*
 * varlen_k_sm90.cu -- the weight-gradient grouped GEMMs on Hopper (sm_90a):
 * the dw2 and dw1 entries of gemm.h, exported as smoe_sm90_dw2/_dw1.
 *
 *   dW2[e] (d, n)      = sum over rows r of e of dO[row_token[r]]^T a_scaled[r]
 *   dW1[e] (h_cols, d) = sum over rows r of e of dH[r]^T X[row_token[r]],
 *                        logical row c stored at physical row smoe_w1_row(c)
 *
 * Both are C_e (M x N) = A_e^T B_e with the reduction over the expert's rows
 * ("varlen-K"): A_e is (count_e x M), B_e is (count_e x N), both row-major,
 * so both operands are MN-major in shared memory and wgmma reads them with
 * its transpose bits set. One operand is gathered by token along K (dO for
 * dW2: A; X for dW1: B), the other is a contiguous slice of rows (a_scaled,
 * dH).
 *
 * Algorithm: a persistent, warp-specialised kernel. The tile scheduler walks
 * the OUTPUT tiles (expert, m-tile, n-tile), whose number the host knows
 * (E * ceil(M/128) * ceil(N/BN)), so the grid is static; the k-loop length of
 * a tile, ceil(count_e / 64), is read on the device from expert_offset, and
 * any count (0 included) works: rows past the expert's end are zero-filled.
 *   - warpgroup 0 (producer, 56 registers): 16-byte cp.async for both
 *     operands, each thread copying fixed 16-byte columns of a stage's 64
 *     k-rows into the 128B-swizzled MN-major layout (a 64-column slab is 64
 *     k-rows of 128 bytes; chunk c of k-row r lands at r*128 + ((c ^ r%8)*16));
 *     gathered rows take their token from row_token, read by the thread for
 *     its own rows. Completion goes to the stage's full mbarrier through
 *     cp.async.mbarrier.arrive.noinc (count: 128 producer threads). TMA is
 *     not used for the contiguous operand: a box would read rows past the
 *     expert's end (the next expert's rows, or rows past R that the contract
 *     forbids reading), which only a per-expert tensor map could clip.
 *   - warpgroups 1 and 2 (consumers, 224 registers): each owns 64 rows of
 *     the 128-row M tile and runs wgmma m64nBNk16 (fp32 accumulators in
 *     registers) over the stage, releasing the previous stage through the
 *     empty mbarrier once its wgmma group retired (wait_group 1).
 *   - a ring of VK_STAGES stages; the producer runs ahead into the next tile
 *     while the consumers store the current one.
 * Epilogue: straight from the accumulators to global memory (each warp store
 * covers whole 32-byte sectors), fp32 or bf16, overwrite or accumulate (the
 * old value read, the sum formed in fp32). Tiles of experts without rows
 * write zeros (overwrite) or nothing (accumulate).
 *
 * Numerics: bf16 products exact in fp32, fp32 accumulation by the tensor
 * cores in a fixed order. Deterministic: every output tile is owned by one
 * CTA; no atomics.
 *
 * Limits: d and n multiples of 64 (so rows are 16-byte aligned and M/N tiles
 * split into whole 64-column slabs); partial tiles are zero-filled on load and
 * clipped on store.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/gemm.h"
#include "cuda/sm90/ptx_sm90.cuh"

using namespace smoe_sm90;

#define VK_BM 128               /* M tile: two consumer warpgroups x 64 rows */
#define VK_BK 64                /* k-rows per stage */
#define VK_STAGES 4
#define VK_THREADS 384          /* producer + 2 consumer warpgroups */
#define VK_SLAB_BYTES (VK_BK * 128) /* one 64-column slab: 64 k-rows x 128 B */
#define VK_PRODUCER_REGS 56
#define VK_CONSUMER_REGS 224

static_assert(VK_BK % 16 == 0, "k16 steps");
static_assert(VK_PRODUCER_REGS * 128 + 2 * VK_CONSUMER_REGS * 128 <= 65536, "register file");

typedef struct vk_args {
    const bf16 *a;                 /* (rows or T, M) row-major: M-side operand */
    const bf16 *b;                 /* (rows or T, N) row-major: N-side operand */
    const int32_t *expert_offset;  /* (E+1) */
    const int32_t *row_token;      /* (cap) */
    void *out;                     /* (E, M, N) fp32 or bf16 */
    int M, N;
    int tiles_m, tiles_n, total_tiles;
    int out_f32, accumulate;
    int map_rows;                  /* 1: logical row c -> smoe_w1_row (concatenated W1) */
    int n_half;                    /* n, for that map */
} vk_args;

/* ------------------------------------------------------------ PTX the header lacks */

/* Shared-memory descriptor of an MN-major, 128B-swizzled bf16 operand:
 * 64-element (128-byte) MN atoms, 8 k-rows of 128 bytes per 1024-byte swizzle
 * atom. For MN-major layouts the leading byte offset is the distance between
 * neighbouring 64-column MN atoms and the stride byte offset the distance
 * between neighbouring groups of 8 k-rows. */
static __device__ __forceinline__ uint64_t vk_desc_mn_sw128(uint32_t saddr, uint32_t mn_atom_bytes)
{
    uint64_t d = 0;
    d |= (uint64_t)((saddr & 0x3FFFF) >> 4);
    d |= (uint64_t)((mn_atom_bytes >> 4) & 0x3FFF) << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

/* wgmma with both operands MN-major (transpose bits 1, 1): ptx_sm90.cuh's
 * wrappers fix A as K-major. */
static __device__ __forceinline__ void vk_wgmma_m64n256k16_mn(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

static __device__ __forceinline__ void vk_wgmma_m64n128k16_mn(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <int BN>
static __device__ __forceinline__ void vk_wgmma_mn(float *d, uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d)
{
    if constexpr (BN == 256) vk_wgmma_m64n256k16_mn(d, desc_a, desc_b, scale_d);
    else vk_wgmma_m64n128k16_mn(d, desc_a, desc_b, scale_d);
}

/* ------------------------------------------------------------ kernel */

static __device__ __forceinline__ void vk_tile_coords(const vk_args &p, int tile, int *e, int *mt,
                                                      int *nt)
{
    int per_e = p.tiles_m * p.tiles_n;
    *e = tile / per_e;
    int rem = tile - *e * per_e;
    *mt = rem / p.tiles_n;
    *nt = rem - *mt * p.tiles_n;
}

/* Copies one operand's stage: 64 k-rows x W columns (W/64 slabs) starting at
 * column col0, k-rows row0.. of the expert (rows >= row_end zero-filled),
 * gathered by token when GATHER. Thread t owns 16-byte column chunk t % CPR
 * of k-rows t / CPR + RPP * i. */
template <int W, bool GATHER>
static __device__ __forceinline__ void vk_load_operand(uint32_t sdst, const bf16 *src, int ld,
                                                       int col0, int ncols, int row0, int row_end,
                                                       const int32_t *row_token, int t)
{
    constexpr int CPR = W / 8;
    constexpr int RPP = 128 / CPR;
    constexpr int ITERS = VK_BK / RPP;
    static_assert(128 % CPR == 0 && VK_BK % RPP == 0, "producer mapping");
    const int c = t % CPR;
    const int r0 = t / CPR;
    const int col = col0 + c * 8;
    const bool col_ok = col < ncols;
    const uint32_t dst0 = sdst + (uint32_t)(c >> 3) * VK_SLAB_BYTES;
    /* groups of 8 rows: the token loads of a group are in flight together,
     * and the producer's registers hold one group's addresses */
    constexpr int G = ITERS < 8 ? ITERS : 8;
#pragma unroll
    for (int i0 = 0; i0 < ITERS; i0 += G) {
        int src_row[G];
#pragma unroll
        for (int i = 0; i < G; i++) {
            int grow = row0 + r0 + RPP * (i0 + i);
            bool ok = col_ok && grow < row_end;
            if (GATHER) src_row[i] = ok ? __ldg(row_token + grow) : -1;
            else src_row[i] = ok ? grow : -1;
        }
#pragma unroll
        for (int i = 0; i < G; i++) {
            int r = r0 + RPP * (i0 + i);
            uint32_t dst = dst0 + (uint32_t)r * 128 + ((uint32_t)((c & 7) ^ (r & 7)) << 4);
            bool ok = src_row[i] >= 0;
            const bf16 *g = ok ? src + (size_t)src_row[i] * (size_t)ld + col : src;
            cp_async_16(dst, g, ok ? 16u : 0u);
        }
    }
}

template <bool F32, bool ACC, int BN>
static __device__ __forceinline__ void vk_store_tile(const vk_args &p, const float *acc, int e,
                                                     int row_base, int col_base, bool zero)
{
    const size_t M = (size_t)p.M, N = (size_t)p.N;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row_base + 8 * h;
        if (row >= p.M) continue;
        int prow = row;
        if (p.map_rows) prow = (row & 1) ? p.n_half + (row >> 1) : (row >> 1);
        size_t rowoff = ((size_t)e * M + (size_t)prow) * N;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            int col = col_base + 8 * j;
            if (col >= p.N) continue;
            float v0 = zero ? 0.f : acc[4 * j + 2 * h];
            float v1 = zero ? 0.f : acc[4 * j + 2 * h + 1];
            if (F32) {
                float2 *o = (float2 *)((float *)p.out + rowoff + col);
                if (ACC) {
                    float2 old = *o;
                    v0 += old.x;
                    v1 += old.y;
                }
                *o = make_float2(v0, v1);
            } else {
                __nv_bfloat162 *o = (__nv_bfloat162 *)((bf16 *)p.out + rowoff + col);
                if (ACC) {
                    float2 old = __bfloat1622float2(*o);
                    v0 += old.x;
                    v1 += old.y;
                }
                *o = __floats2bfloat162_rn(v0, v1);
            }
        }
    }
}

template <int BN, bool GATHER_A>
__global__ void __launch_bounds__(VK_THREADS, 1) vk_varlen_k_kernel(const vk_args p)
{
    constexpr uint32_t A_BYTES = VK_BK * VK_BM * 2;
    constexpr uint32_t B_BYTES = VK_BK * BN * 2;
    constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(STAGE_BYTES % 1024 == 0, "stages stay 1024-byte aligned");

    extern __shared__ uint8_t vk_smem[];
    const uint32_t base = (smem_addr(vk_smem) + 1023u) & ~1023u;
    const uint32_t full_bar = base + VK_STAGES * STAGE_BYTES; /* + 8 s */
    const uint32_t empty_bar = full_bar + 8 * VK_STAGES;      /* + 8 s */
    const int wg = threadIdx.x / 128;
    const int t = threadIdx.x % 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < VK_STAGES; s++) {
            mbar_init(full_bar + 8 * s, 128); /* one cp.async arrival per producer thread */
            mbar_init(empty_bar + 8 * s, 8);  /* one arrival per consumer warp */
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        setmaxnreg_dec<VK_PRODUCER_REGS>();
        uint32_t it = 0;
        for (int tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
            int e, mt, nt;
            vk_tile_coords(p, tile, &e, &mt, &nt);
            const int row_begin = __ldg(p.expert_offset + e);
            const int row_end = __ldg(p.expert_offset + e + 1);
            const int nk = row_end > row_begin ? (row_end - row_begin + VK_BK - 1) / VK_BK : 0;
            for (int kt = 0; kt < nk; kt++, it++) {
                const uint32_t s = it % VK_STAGES;
                const uint32_t ph = (it / VK_STAGES) & 1;
                const int row0 = row_begin + kt * VK_BK;
                const uint32_t sa = base + s * STAGE_BYTES;
                mbar_wait(empty_bar + 8 * s, ph ^ 1);
                vk_load_operand<VK_BM, GATHER_A>(sa, p.a, p.M, mt * VK_BM, p.M, row0, row_end,
                                                 p.row_token, t);
                vk_load_operand<BN, !GATHER_A>(sa + A_BYTES, p.b, p.N, nt * BN, p.N, row0, row_end,
                                               p.row_token, t);
                cp_async_mbar_arrive_noinc(full_bar + 8 * s);
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    } else {
        /* ---------------- consumers ---------------- */
        setmaxnreg_inc<VK_CONSUMER_REGS>();
        const int cw = wg - 1; /* which 64-row half of the M tile */
        const int warp = t / 32, lane = t % 32;
        float acc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
        uint32_t it = 0;
        for (int tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
            int e, mt, nt;
            vk_tile_coords(p, tile, &e, &mt, &nt);
            const int row_begin = __ldg(p.expert_offset + e);
            const int row_end = __ldg(p.expert_offset + e + 1);
            const int nk = row_end > row_begin ? (row_end - row_begin + VK_BK - 1) / VK_BK : 0;
            if (nk == 0 && p.accumulate) continue;
            uint32_t prev_s = 0;
            for (int kt = 0; kt < nk; kt++, it++) {
                const uint32_t s = it % VK_STAGES;
                const uint32_t ph = (it / VK_STAGES) & 1;
                mbar_wait(full_bar + 8 * s, ph);
                /* cp.async wrote through the generic proxy; wgmma reads through the async one */
                fence_proxy_async();
                const uint32_t sa = base + s * STAGE_BYTES + (uint32_t)cw * VK_SLAB_BYTES;
                const uint32_t sb = base + s * STAGE_BYTES + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < VK_BK / 16; ks++) {
                    /* 16 k-rows = 2048 bytes: whole swizzle atoms, no phase change */
                    uint64_t da = vk_desc_mn_sw128(sa + ks * 2048, VK_SLAB_BYTES);
                    uint64_t db = vk_desc_mn_sw128(sb + ks * 2048, VK_SLAB_BYTES);
                    vk_wgmma_mn<BN>(acc, da, db, (kt > 0 || ks > 0) ? 1 : 0);
                }
                wgmma_commit();
                wgmma_wait<1>(); /* the previous stage's group has retired */
                if (kt > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev_s);
                prev_s = s;
            }
            if (nk > 0) {
                wgmma_wait<0>();
                wgmma_fence_regs<BN / 2>(acc);
                if (lane == 0) mbar_arrive(empty_bar + 8 * prev_s);
            }
            const int row_base = mt * VK_BM + cw * 64 + warp * 16 + lane / 4;
            const int col_base = nt * BN + 2 * (lane % 4);
            const bool zero = nk == 0;
            if (p.out_f32) {
                if (p.accumulate) vk_store_tile<true, true, BN>(p, acc, e, row_base, col_base, zero);
                else vk_store_tile<true, false, BN>(p, acc, e, row_base, col_base, zero);
            } else {
                if (p.accumulate) vk_store_tile<false, true, BN>(p, acc, e, row_base, col_base, zero);
                else vk_store_tile<false, false, BN>(p, acc, e, row_base, col_base, zero);
            }
        }
    }
}

/* ------------------------------------------------------------ launchers */

template <int BN, bool GATHER_A>
static smoe_status vk_launch(const vk_args *a, int num_sms, cudaStream_t stream)
{
    const size_t smem = (size_t)VK_STAGES * (VK_BK * VK_BM * 2 + VK_BK * BN * 2) + 1024 +
                        16 * VK_STAGES;
    cudaError_t err = cudaFuncSetAttribute(vk_varlen_k_kernel<BN, GATHER_A>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                         "sm90 varlen-K GEMM: cudaFuncSetAttribute(%zu bytes): %s", smem,
                         cudaGetErrorString(err));
    int grid = a->total_tiles < num_sms ? a->total_tiles : num_sms;
    vk_varlen_k_kernel<BN, GATHER_A><<<grid, VK_THREADS, smem, stream>>>(*a);
    err = cudaGetLastError();
    SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                         "sm90 varlen-K GEMM: launch failed: %s", cudaGetErrorString(err));
    return SMOE_SUCCESS;
}

/* Shared checks and launch: C_e (M x N) = A_e^T B_e, A gathered if gather_a. */
static smoe_status vk_run(const char *name, const smoe_gemm_problem *p, const bf16 *a,
                          const bf16 *b, int64_t M, int64_t N, int gather_a, void *out,
                          smoe_dtype out_dtype, int accumulate, int map_rows, cudaStream_t stream)
{
    SMOE_RETURN_ERROR_IF(p->d % 64 != 0 || p->n % 64 != 0 || p->h_cols % 64 != 0,
                         SMOE_ERROR_UNSUPPORTED,
                         "sm90 %s: needs d, n and h_cols multiples of 64 (d=%lld, n=%lld, "
                         "h_cols=%lld)",
                         name, (long long)p->d, (long long)p->n, (long long)p->h_cols);
    SMOE_RETURN_ERROR_IF(out_dtype != SMOE_DTYPE_F32 && out_dtype != SMOE_DTYPE_BF16,
                         SMOE_ERROR_UNSUPPORTED, "sm90 %s: output dtype %d is neither F32 nor BF16",
                         name, (int)out_dtype);
    SMOE_RETURN_ERROR_IF(p->E < 0 || M <= 0 || N <= 0, SMOE_ERROR_INVALID_SIZE,
                         "sm90 %s: bad sizes E=%lld M=%lld N=%lld", name, (long long)p->E,
                         (long long)M, (long long)N);
    if (p->E == 0) return SMOE_SUCCESS;
    SMOE_RETURN_ERROR_IF(!a || !b || !out || !p->expert_offset || !p->row_token,
                         SMOE_ERROR_NULL_POINTER, "sm90 %s: NULL operand", name);
    const int64_t tiles_m = (M + VK_BM - 1) / VK_BM;
    const int bn = (N % 256 == 0) ? 256 : 128;
    const int64_t tiles_n = (N + bn - 1) / bn;
    const int64_t total = p->E * tiles_m * tiles_n;
    SMOE_RETURN_ERROR_IF(M > INT32_MAX / 2 || N > INT32_MAX / 2 || total > INT32_MAX,
                         SMOE_ERROR_UNSUPPORTED, "sm90 %s: sizes too large (M=%lld, N=%lld, "
                         "%lld tiles)", name, (long long)M, (long long)N, (long long)total);
    int num_sms = p->num_sms;
    if (num_sms <= 0) {
        int dev = 0;
        cudaError_t err = cudaGetDevice(&dev);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
        SMOE_RETURN_ERROR_IF(err != cudaSuccess, SMOE_ERROR_BACKEND,
                             "sm90 %s: cannot read the multiprocessor count: %s", name,
                             cudaGetErrorString(err));
    }
    vk_args args;
    args.a = a;
    args.b = b;
    args.expert_offset = p->expert_offset;
    args.row_token = p->row_token;
    args.out = out;
    args.M = (int)M;
    args.N = (int)N;
    args.tiles_m = (int)tiles_m;
    args.tiles_n = (int)tiles_n;
    args.total_tiles = (int)total;
    args.out_f32 = out_dtype == SMOE_DTYPE_F32;
    args.accumulate = accumulate != 0;
    args.map_rows = map_rows;
    args.n_half = (int)p->n;
    if (bn == 256)
        return gather_a ? vk_launch<256, true>(&args, num_sms, stream)
                        : vk_launch<256, false>(&args, num_sms, stream);
    return gather_a ? vk_launch<128, true>(&args, num_sms, stream)
                    : vk_launch<128, false>(&args, num_sms, stream);
}

extern "C" smoe_status smoe_sm90_dw2(const smoe_gemm_problem *p, const bf16 *dout,
                                     const bf16 *a_scaled, void *dw2, smoe_dtype out_dtype,
                                     int accumulate, void *scratch, cudaStream_t s)
{
    (void)scratch;
    SMOE_RETURN_ERROR_IF(!p, SMOE_ERROR_NULL_POINTER, "sm90 dw2: NULL problem");
    /* M = d (dO columns, gathered by token), N = n (a_scaled columns) */
    return vk_run("dw2", p, dout, a_scaled, p->d, p->n, 1, dw2, out_dtype, accumulate, 0, s);
}

extern "C" smoe_status smoe_sm90_dw1(const smoe_gemm_problem *p, const bf16 *dh, const bf16 *x,
                                     void *dw1, smoe_dtype out_dtype, int accumulate,
                                     void *scratch, cudaStream_t s)
{
    (void)scratch;
    SMOE_RETURN_ERROR_IF(!p, SMOE_ERROR_NULL_POINTER, "sm90 dw1: NULL problem");
    /* M = h_cols (dH columns, logical interleaved order), N = d (X columns, gathered) */
    const int map_rows = p->gated && p->w1_layout == SMOE_W1_CONCATENATED;
    return vk_run("dw1", p, dh, x, p->h_cols, p->d, 0, dw1, out_dtype, accumulate, map_rows, s);
}
