/*
 * ds_reduce.cu -- the last step of the dh GEMM, for both kernel families:
 * dS[r] = the row's partial sums over the N tiles of dA' A (written by the
 * dh epilogue, one per (n-tile, row), in fp32) summed in n-tile order,
 * plus <dO[token(r)], b2[e]> when the layer has b2. A fixed order, so the
 * result is the same bits run to run.
 */
#include "cuda/gemm.h"

/* a view's per-expert bounds go to shared memory: at most this many
 * experts in a view (the Hopper GEMMs' own limit) */
#define DS_MAX_EXPERTS 1024

/* ds[r] = the n-tile partials in tile order (+ <dO[tok[r]], b2[e]>). One
 * warp per row; rows past R, and in a view (os > 1) rows outside it,
 * untouched. */
static __global__ void ds_reduce_kernel(const float *dsp, int tiles, int64_t cap,
                                        const int32_t *off, int os, int E, const int32_t *tok,
                                        const bf16 *dout, const bf16 *b2, int d, float *ds,
                                        const int *abort)
{
    if (abort && *abort) return;
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    /* a view's rows: each expert's [begin, end) into shared memory first */
    __shared__ int vb[DS_MAX_EXPERTS + 1], ve[DS_MAX_EXPERTS + 1];
    if (os > 1) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            vb[e] = __ldg(off + (int64_t)e * os);
            ve[e] = __ldg(off + (int64_t)e * os + 1);
        }
        __syncthreads();
    }
    if (r >= cap || (os == 1 && r >= __ldg(off + E))) return;
    float dot = 0.0f;
    int lo = 0;
    if (b2 || os > 1) {
        int hi = E; /* lo: the last e whose rows start at or before r */
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if ((os > 1 ? vb[mid] : __ldg(off + mid)) <= r) lo = mid; else hi = mid;
        }
        if (os > 1 && (r < vb[lo] || r >= ve[lo])) return;
    }
    if (b2) {
        const bf16 *x = dout + (int64_t)__ldg(tok + r) * d;
        const bf16 *b = b2 + (int64_t)lo * d;
        for (int j = lane * 8; j < d; j += 256) {
            const uint4 xv = *(const uint4 *)(x + j), bv = *(const uint4 *)(b + j);
            const __nv_bfloat162 *xp = (const __nv_bfloat162 *)&xv;
            const __nv_bfloat162 *bp = (const __nv_bfloat162 *)&bv;
#pragma unroll
            for (int k = 0; k < 4; k++)
                dot += __low2float(xp[k]) * __low2float(bp[k]) +
                       __high2float(xp[k]) * __high2float(bp[k]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
    if (lane == 0) {
        float v = 0.0f;
        for (int t = 0; t < tiles; t++) v += dsp[(int64_t)t * cap + r];
        ds[r] = v + dot;
    }
}

extern "C" smoe_status smoe_ds_reduce(const smoe_gemm_problem *p, const float *dsp, int tiles,
                                      const bf16 *dout, const bf16 *b2, float *ds, cudaStream_t s)
{
    const int os = p->off_stride > 1 ? p->off_stride : 1;
    if (os > 1 && p->E > DS_MAX_EXPERTS)
        return smoe_fail(SMOE_ERROR_UNSUPPORTED,
                         "dS reduction: a view of at most %d experts (E=%lld)", DS_MAX_EXPERTS,
                         (long long)p->E);
    if (p->cap == 0) return SMOE_SUCCESS;
    ds_reduce_kernel<<<(unsigned)((p->cap + 7) / 8), 256, 0, s>>>(
        dsp, tiles, p->cap, p->expert_offset, os, (int)p->E, p->row_token, dout, b2, (int)p->d,
        ds, p->abort);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return smoe_fail(SMOE_ERROR_BACKEND, "dS reduction: launch failed: %s",
                         cudaGetErrorString(err));
    return SMOE_SUCCESS;
}
