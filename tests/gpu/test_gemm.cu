/*
 * test_gemm.cu -- the portable grouped GEMMs (smoe_gemm_ops_sm80, gemm.h)
 * against host references in double precision.
 *
 *   test_gemm            random cases (sizes not multiples of the tiles,
 *                        empty experts, every activation, both W1 layouts,
 *                        bias on/off, fp32/bf16 weight gradients,
 *                        overwrite/accumulate), determinism, bad input and
 *                        plans, all on the default plan (smoe_gemm_ops.plan);
 *                        then every other row of every GEMM's tile table on
 *                        a few more cases each (a row the device cannot run
 *                        is reported as skipped)
 *   test_gemm --small    a few small cases (for compute-sanitizer)
 *   --row GEMM=NAME      run row NAME of GEMM's tile table instead of the
 *                        plan's, e.g. --row "dh=256x128x32 s3 dh";
 *                        repeatable; the other rows' cases are then skipped
 *   --seed N             the random seed (printed on failure)
 *
 * The timings of these GEMMs (each row of the tile tables, on the grid's
 * shapes) are bench/bench_gemm.cu's.
 *
 * Tolerances: each GEMM's inputs are random bf16; the reference sums in
 * double. A value that the kernel rounds to bf16 may differ by the bf16
 * rounding (2^-8 relative, with slack) plus the fp32 accumulation error,
 * bounded by 2^-13 of the sum of |terms| (the "magnitude"). Values computed
 * from a stored H (A, A', dH) are compared with the same formulas applied to
 * that H. Every output row past R and every output element the call must not
 * touch is poisoned before and checked after.
 */
#include <algorithm>
#include <vector>

#include "cuda/gemm.h"
#include "testutil_cuda.h"

static const smoe_gemm_ops *G = &smoe_gemm_ops_sm80;

/* Rows run instead of the plan's (-1: the plan's): --row, or the row
 * coverage after the default cases. */
static int g_rows[SMOE_GEMM_COUNT] = {-1, -1, -1, -1, -1, -1};
static int g_fail = 0;
static uint64_t g_seed = 1;

/* ------------------------------------------------------------ host helpers */

static tu_rng g_rng;
static int rnd_int(int lo, int hi) { return (int)tu_int(&g_rng, lo, hi); }
static float rnd_unif(void) { return (float)tu_range(&g_rng, -1.0, 1.0); }

/* Random bf16 host array, values scale * U(-1, 1). */
static std::vector<uint16_t> rnd_bf16(size_t count, float scale)
{
    std::vector<uint16_t> v(count);
    for (size_t i = 0; i < count; i++) v[i] = tu_f32_to_bf16(scale * rnd_unif());
    return v;
}

template <typename T>
static T *dev_upload(const std::vector<T> &h)
{
    return (T *)tu_dev_put(h.data(), h.size() * sizeof(T));
}
template <typename T>
static std::vector<T> dev_download(const T *d, size_t count)
{
    std::vector<T> h(count);
    tu_dev_get(h.data(), d, count * sizeof(T));
    return h;
}

/* A tally that failed counts as one failure of the case. */
static void tally_done(const tu_tally *t, const char *cs)
{
    if (t->bad) {
        fprintf(stderr, "FAIL %s: %s: %lld of %lld wrong (seed %llu)\n", cs, t->what, t->bad,
                t->count, (unsigned long long)g_seed);
        g_fail++;
    }
}

#define RTOL_BF16 (1.0 / 128.0) /* two bf16 ulps */
#define ACC_TOL (1.0 / 8192.0)

/* ------------------------------------------------------------ one case */

typedef struct tcase {
    int64_t T, d, n, E;
    int act, layout, bias, cap_slack;
    std::vector<int> counts;
} tcase;

static int64_t w1_row(int64_t c, int64_t n, int gated, int layout)
{
    return smoe_w1_row(c, n, gated, (smoe_w1_layout)layout);
}

static void run_case(const tcase &tc, int idx)
{
    const int fails_before = g_fail;
    const int64_t T = tc.T, d = tc.d, n = tc.n, E = tc.E;
    const smoe_activation act = (smoe_activation)tc.act;
    const int gated = tu_gated(act);
    const int64_t hc = gated ? 2 * n : n;
    std::vector<int32_t> off(E + 1, 0);
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + tc.counts[e];
    const int64_t R = off[E], cap = R + tc.cap_slack;
    char cs[256];
    snprintf(cs, sizeof cs, "case %d: T=%lld d=%lld n=%lld E=%lld R=%lld cap=%lld %s %s bias=%d",
             idx, (long long)T, (long long)d, (long long)n, (long long)E, (long long)R,
             (long long)cap, tu_act_name(act), tc.layout ? "concat" : "interleaved", tc.bias);

    std::vector<int32_t> tok(cap, 0);
    std::vector<float> score(cap, 0.0f);
    for (int64_t e = 0; e < E; e++) {
        for (int64_t r = off[e]; r < off[e + 1]; r++) tok[r] = rnd_int(0, (int)T - 1);
        std::sort(tok.begin() + off[e], tok.begin() + off[e + 1]);
    }
    for (int64_t r = 0; r < R; r++) score[r] = 0.05f + 0.95f * (0.5f + 0.5f * rnd_unif());

    /* Inputs, each GEMM its own. */
    std::vector<uint16_t> x = rnd_bf16(T * d, 1.0f), w1 = rnd_bf16(E * hc * d, 0.1f),
                          b1 = rnd_bf16(E * hc, 0.5f), a_in = rnd_bf16(cap * n, 1.0f),
                          w2 = rnd_bf16(E * d * n, 0.1f), b2 = rnd_bf16(E * d, 0.5f),
                          dO = rnd_bf16(T * d, 1.0f), h_in = rnd_bf16(cap * hc, 2.0f),
                          as_in = rnd_bf16(cap * n, 1.0f), dh_in = rnd_bf16(cap * hc, 1.0f);

    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = d;
    p.n = n;
    p.h_cols = hc;
    p.E = E;
    p.cap = cap;
    p.gated = gated;
    p.act = (smoe_activation)tc.act;
    p.w1_layout = (smoe_w1_layout)tc.layout;
    /* Persistent grids size themselves by num_sms: every odd case claims 1
     * to 3 SMs, so that each CTA walks many tiles. */
    p.num_sms = (idx & 1) ? 1 + (idx >> 1) % 3 : 132;
    /* The plan of this shape on this device, with g_rows' rows instead. */
    smoe_gemm_plan plan;
    G->plan(&p, &plan);
    for (int g = 0; g < SMOE_GEMM_COUNT; g++)
        if (g_rows[g] >= 0) plan.row[g] = g_rows[g];
    p.plan = &plan;
    int32_t *d_off = dev_upload(off), *d_tok = dev_upload(tok);
    float *d_score = dev_upload(score);
    p.expert_offset = d_off;
    p.row_token = d_tok;
    p.row_score = d_score;
    bf16 *d_x = (bf16 *)dev_upload(x), *d_w1 = (bf16 *)dev_upload(w1), *d_b1 = (bf16 *)dev_upload(b1),
         *d_a_in = (bf16 *)dev_upload(a_in), *d_w2 = (bf16 *)dev_upload(w2),
         *d_b2 = (bf16 *)dev_upload(b2), *d_dO = (bf16 *)dev_upload(dO),
         *d_h_in = (bf16 *)dev_upload(h_in), *d_as_in = (bf16 *)dev_upload(as_in),
         *d_dh_in = (bf16 *)dev_upload(dh_in);
    void *scratch = NULL;
    CUDA_OK(cudaMalloc(&scratch, G->scratch_bytes(&p)));
    const bf16 *bias1 = tc.bias ? d_b1 : NULL, *bias2 = tc.bias ? d_b2 : NULL;

    /* Outputs, poisoned. */
    bf16 *d_h, *d_a, *d_a2, *d_y, *d_dh, *d_as, *d_dxt;
    float *d_ds;
    CUDA_OK(cudaMalloc(&d_h, std::max<int64_t>(cap * hc, 1) * 2));
    CUDA_OK(cudaMalloc(&d_a, std::max<int64_t>(cap * n, 1) * 2));
    CUDA_OK(cudaMalloc(&d_a2, std::max<int64_t>(cap * n, 1) * 2));
    CUDA_OK(cudaMalloc(&d_y, std::max<int64_t>(cap * d, 1) * 2));
    CUDA_OK(cudaMalloc(&d_dh, std::max<int64_t>(cap * hc, 1) * 2));
    CUDA_OK(cudaMalloc(&d_as, std::max<int64_t>(cap * n, 1) * 2));
    CUDA_OK(cudaMalloc(&d_dxt, std::max<int64_t>(cap * d, 1) * 2));
    CUDA_OK(cudaMalloc(&d_ds, std::max<int64_t>(cap, 1) * 4));
    CUDA_OK(cudaMemset(d_h, 0xff, cap * hc * 2));
    CUDA_OK(cudaMemset(d_a, 0xff, cap * n * 2));
    CUDA_OK(cudaMemset(d_a2, 0xff, cap * n * 2));
    CUDA_OK(cudaMemset(d_y, 0xff, cap * d * 2));
    CUDA_OK(cudaMemset(d_dh, 0xff, cap * hc * 2));
    CUDA_OK(cudaMemset(d_as, 0xff, cap * n * 2));
    CUDA_OK(cudaMemset(d_dxt, 0xff, cap * d * 2));
    CUDA_OK(cudaMemset(d_ds, 0xff, cap * 4));

    SMOE_OK_OR_EXIT(G->up(&p, d_x, d_w1, bias1, d_h, d_a, scratch, 0));
    SMOE_OK_OR_EXIT(G->up(&p, d_x, d_w1, bias1, NULL, d_a2, scratch, 0)); /* inference: no H */
    SMOE_OK_OR_EXIT(G->down(&p, d_a_in, d_w2, bias2, d_y, scratch, 0));
    SMOE_OK_OR_EXIT(G->dh(&p, d_dO, d_w2, bias2, d_h_in, d_dh, d_as, d_ds, scratch, 0));
    SMOE_OK_OR_EXIT(G->dxt(&p, d_dh_in, d_w1, d_dxt, scratch, 0));

    /* Weight gradients: (dtype, accumulate) = 4 combinations each. */
    std::vector<uint16_t> wprev_bf = rnd_bf16(E * hc * d, 1.0f);
    std::vector<float> wprev_f(E * hc * d);
    for (size_t i = 0; i < wprev_f.size(); i++) wprev_f[i] = rnd_unif();
    std::vector<float> dw2_out[4], dw1_out[4];
    for (int v = 0; v < 4; v++) {
        const int f32 = v & 1, accum = v >> 1;
        const size_t n2 = E * d * n, n1 = E * hc * d;
        void *o2, *o1;
        CUDA_OK(cudaMalloc(&o2, n2 * 4));
        CUDA_OK(cudaMalloc(&o1, n1 * 4));
        if (accum) {
            CUDA_OK(cudaMemcpy(o2, f32 ? (void *)wprev_f.data() : (void *)wprev_bf.data(),
                               n2 * (f32 ? 4 : 2), cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(o1, f32 ? (void *)wprev_f.data() : (void *)wprev_bf.data(),
                               n1 * (f32 ? 4 : 2), cudaMemcpyHostToDevice));
        } else {
            CUDA_OK(cudaMemset(o2, 0xff, n2 * 4));
            CUDA_OK(cudaMemset(o1, 0xff, n1 * 4));
        }
        smoe_dtype dt = f32 ? SMOE_DTYPE_F32 : SMOE_DTYPE_BF16;
        SMOE_OK_OR_EXIT(G->dw2(&p, d_dO, d_as_in, o2, dt, accum, scratch, 0));
        SMOE_OK_OR_EXIT(G->dw1(&p, d_dh_in, d_x, o1, dt, accum, scratch, 0));
        dw2_out[v].resize(n2);
        dw1_out[v].resize(n1);
        if (f32) {
            std::vector<float> t2 = dev_download((float *)o2, n2), t1 = dev_download((float *)o1, n1);
            dw2_out[v] = t2;
            dw1_out[v] = t1;
        } else {
            std::vector<uint16_t> t2 = dev_download((uint16_t *)o2, n2),
                                  t1 = dev_download((uint16_t *)o1, n1);
            for (size_t i = 0; i < n2; i++) dw2_out[v][i] = (float)tu_bf16_to_f32(t2[i]);
            for (size_t i = 0; i < n1; i++) dw1_out[v][i] = (float)tu_bf16_to_f32(t1[i]);
        }
        CUDA_OK(cudaFree(o2));
        CUDA_OK(cudaFree(o1));
    }
    CUDA_OK(cudaDeviceSynchronize());

    std::vector<uint16_t> h = dev_download((uint16_t *)d_h, cap * hc),
                          a = dev_download((uint16_t *)d_a, cap * n),
                          a2 = dev_download((uint16_t *)d_a2, cap * n),
                          y = dev_download((uint16_t *)d_y, cap * d),
                          dh = dev_download((uint16_t *)d_dh, cap * hc),
                          as = dev_download((uint16_t *)d_as, cap * n),
                          dxt = dev_download((uint16_t *)d_dxt, cap * d);
    std::vector<float> ds = dev_download(d_ds, cap);

    std::vector<int> row_e(cap, -1);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = off[e]; r < off[e + 1]; r++) row_e[r] = (int)e;

    /* up: H, then A from the stored H; inference A identical. */
    {
        tu_tally ch = tu_tally_make("up H", 0, 0), ca = tu_tally_make("up A", 0, 0),
                 cp = tu_tally_make("poison", 0, 0), ci = tu_tally_make("up A (no H)", 0, 0);
        for (int64_t r = 0; r < cap; r++) {
            if (r >= R) {
                for (int64_t c = 0; c < hc; c++)
                    tu_tally_add(&cp, h[r * hc + c] == TU_POISON_BF16, 1, 0, r);
                for (int64_t j = 0; j < n; j++)
                    tu_tally_add(&cp, a[r * n + j] == TU_POISON_BF16, 1, 0, r);
                continue;
            }
            const int e = row_e[r];
            const uint16_t *xr = &x[tok[r] * d];
            for (int64_t c = 0; c < hc; c++) {
                const int64_t pr = w1_row(c, n, gated, tc.layout);
                const uint16_t *wr = &w1[(e * hc + pr) * d];
                double s = 0, m = 0;
                for (int64_t k = 0; k < d; k++) {
                    double t = tu_bf16_to_f32(xr[k]) * tu_bf16_to_f32(wr[k]);
                    s += t;
                    m += fabs(t);
                }
                if (tc.bias) {
                    s += tu_bf16_to_f32(b1[e * hc + pr]);
                    m += fabs(tu_bf16_to_f32(b1[e * hc + pr]));
                }
                tu_tally_add(&ch, tu_bf16_to_f32(h[r * hc + c]), s,
                             RTOL_BF16 * fabs(s) + ACC_TOL * m + 1e-30, r * hc + c);
            }
            for (int64_t j = 0; j < n; j++) {
                double ref = gated ? tu_act1(act, tu_bf16_to_f32(h[r * hc + 2 * j])) *
                                         tu_bf16_to_f32(h[r * hc + 2 * j + 1])
                                   : tu_act1(act, tu_bf16_to_f32(h[r * hc + j]));
                tu_tally_add(&ca, tu_bf16_to_f32(a[r * n + j]), ref, RTOL_BF16 * fabs(ref) + 1e-6,
                             r * n + j);
                tu_tally_add(&ci, a2[r * n + j], a[r * n + j], 0, r * n + j);
            }
        }
        tally_done(&ch, cs);
        tally_done(&ca, cs);
        tally_done(&ci, cs);
        tally_done(&cp, cs);
    }
    /* down */
    {
        tu_tally cy = tu_tally_make("down Y", 0, 0), cp = tu_tally_make("down poison", 0, 0);
        for (int64_t r = 0; r < cap; r++) {
            if (r >= R) {
                for (int64_t i = 0; i < d; i++)
                    tu_tally_add(&cp, y[r * d + i] == TU_POISON_BF16, 1, 0, r);
                continue;
            }
            const int e = row_e[r];
            for (int64_t i = 0; i < d; i++) {
                double s = 0, m = 0;
                for (int64_t j = 0; j < n; j++) {
                    double t =
                        tu_bf16_to_f32(a_in[r * n + j]) * tu_bf16_to_f32(w2[(e * d + i) * n + j]);
                    s += t;
                    m += fabs(t);
                }
                if (tc.bias) {
                    s += tu_bf16_to_f32(b2[e * d + i]);
                    m += fabs(tu_bf16_to_f32(b2[e * d + i]));
                }
                tu_tally_add(&cy, tu_bf16_to_f32(y[r * d + i]), s,
                             RTOL_BF16 * fabs(s) + ACC_TOL * m + 1e-30, r * d + i);
            }
        }
        tally_done(&cy, cs);
        tally_done(&cp, cs);
    }
    /* dh: dA' = dO[tok] W2[e]; dS, A', dH from the input H. */
    {
        tu_tally cds = tu_tally_make("dh dS", 0, 0), cas = tu_tally_make("dh A'", 0, 0),
                 cdh = tu_tally_make("dh dH", 0, 0), cp = tu_tally_make("dh poison", 0, 0);
        std::vector<double> dap(n), dapm(n);
        for (int64_t r = 0; r < cap; r++) {
            if (r >= R) {
                for (int64_t c = 0; c < hc; c++)
                    tu_tally_add(&cp, dh[r * hc + c] == TU_POISON_BF16, 1, 0, r);
                for (int64_t j = 0; j < n; j++)
                    tu_tally_add(&cp, as[r * n + j] == TU_POISON_BF16, 1, 0, r);
                uint32_t u;
                memcpy(&u, &ds[r], 4);
                tu_tally_add(&cp, u == 0xffffffffu, 1, 0, r);
                continue;
            }
            const int e = row_e[r];
            const uint16_t *g = &dO[tok[r] * d];
            for (int64_t j = 0; j < n; j++) {
                double s = 0, m = 0;
                for (int64_t i = 0; i < d; i++) {
                    double t = tu_bf16_to_f32(g[i]) * tu_bf16_to_f32(w2[(e * d + i) * n + j]);
                    s += t;
                    m += fabs(t);
                }
                dap[j] = s;
                dapm[j] = m;
            }
            const double sc = score[r];
            double dsr = 0, dsm = 0;
            for (int64_t j = 0; j < n; j++) {
                double av, dg = 0, du = 0, mg = 0, mu = 0;
                if (gated) {
                    double hg = tu_bf16_to_f32(h_in[r * hc + 2 * j]),
                           hu = tu_bf16_to_f32(h_in[r * hc + 2 * j + 1]);
                    av = tu_act1(act, hg) * hu;
                    dg = sc * dap[j] * tu_act1_d(act, hg) * hu;
                    du = sc * dap[j] * tu_act1(act, hg);
                    mg = sc * dapm[j] * fabs(tu_act1_d(act, hg) * hu);
                    mu = sc * dapm[j] * fabs(tu_act1(act, hg));
                    tu_tally_add(&cdh, tu_bf16_to_f32(dh[r * hc + 2 * j]), dg,
                                 RTOL_BF16 * fabs(dg) + ACC_TOL * mg + 1e-6, r * hc + 2 * j);
                    tu_tally_add(&cdh, tu_bf16_to_f32(dh[r * hc + 2 * j + 1]), du,
                        RTOL_BF16 * fabs(du) + ACC_TOL * mu + 1e-6, r * hc + 2 * j + 1);
                } else {
                    double hv = tu_bf16_to_f32(h_in[r * hc + j]);
                    av = tu_act1(act, hv);
                    dg = sc * dap[j] * tu_act1_d(act, hv);
                    mg = sc * dapm[j] * fabs(tu_act1_d(act, hv));
                    tu_tally_add(&cdh, tu_bf16_to_f32(dh[r * hc + j]), dg,
                                 RTOL_BF16 * fabs(dg) + ACC_TOL * mg + 1e-6, r * hc + j);
                }
                tu_tally_add(&cas, tu_bf16_to_f32(as[r * n + j]), sc * av,
                             RTOL_BF16 * fabs(sc * av) + 1e-6, r * n + j);
                dsr += dap[j] * av;
                dsm += dapm[j] * fabs(av);
            }
            if (tc.bias)
                for (int64_t i = 0; i < d; i++) {
                    double t = tu_bf16_to_f32(g[i]) * tu_bf16_to_f32(b2[e * d + i]);
                    dsr += t;
                    dsm += fabs(t);
                }
            tu_tally_add(&cds, ds[r], dsr, ACC_TOL * dsm + 1e-6, r);
        }
        tally_done(&cds, cs);
        tally_done(&cas, cs);
        tally_done(&cdh, cs);
        tally_done(&cp, cs);
    }
    /* dxt */
    {
        tu_tally cx = tu_tally_make("dxt", 0, 0), cp = tu_tally_make("dxt poison", 0, 0);
        for (int64_t r = 0; r < cap; r++) {
            if (r >= R) {
                for (int64_t i = 0; i < d; i++)
                    tu_tally_add(&cp, dxt[r * d + i] == TU_POISON_BF16, 1, 0, r);
                continue;
            }
            const int e = row_e[r];
            for (int64_t i = 0; i < d; i++) {
                double s = 0, m = 0;
                for (int64_t c = 0; c < hc; c++) {
                    double t =
                        tu_bf16_to_f32(dh_in[r * hc + c]) *
                        tu_bf16_to_f32(w1[(e * hc + w1_row(c, n, gated, tc.layout)) * d + i]);
                    s += t;
                    m += fabs(t);
                }
                tu_tally_add(&cx, tu_bf16_to_f32(dxt[r * d + i]), s,
                             RTOL_BF16 * fabs(s) + ACC_TOL * m + 1e-30, r * d + i);
            }
        }
        tally_done(&cx, cs);
        tally_done(&cp, cs);
    }
    /* dw2, dw1: sums over each expert's rows. */
    {
        tu_tally c2 = tu_tally_make("dw2", 0, 0), c1 = tu_tally_make("dw1", 0, 0);
        for (int64_t e = 0; e < E; e++) {
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < n; j++) {
                    double s = 0, m = 0;
                    for (int64_t r = off[e]; r < off[e + 1]; r++) {
                        double t =
                            tu_bf16_to_f32(dO[tok[r] * d + i]) * tu_bf16_to_f32(as_in[r * n + j]);
                        s += t;
                        m += fabs(t);
                    }
                    const size_t q = (e * d + i) * n + j;
                    for (int v = 0; v < 4; v++) {
                        const int f32 = v & 1, accum = v >> 1;
                        double prev =
                            accum ? (f32 ? wprev_f[q] : tu_bf16_to_f32(wprev_bf[q])) : 0.0;
                        double ref = s + prev;
                        double tol = ACC_TOL * (m + fabs(prev)) + (f32 ? 1e-6 * fabs(ref) : RTOL_BF16 * fabs(ref)) + 1e-30;
                        if (off[e] == off[e + 1]) tol = 0; /* exact: zeros or untouched */
                        tu_tally_add(&c2, dw2_out[v][q], ref, tol, (long)q);
                    }
                }
            for (int64_t c = 0; c < hc; c++) {
                const int64_t pr = w1_row(c, n, gated, tc.layout);
                for (int64_t i = 0; i < d; i++) {
                    double s = 0, m = 0;
                    for (int64_t r = off[e]; r < off[e + 1]; r++) {
                        double t =
                            tu_bf16_to_f32(dh_in[r * hc + c]) * tu_bf16_to_f32(x[tok[r] * d + i]);
                        s += t;
                        m += fabs(t);
                    }
                    const size_t q = (e * hc + pr) * d + i;
                    for (int v = 0; v < 4; v++) {
                        const int f32 = v & 1, accum = v >> 1;
                        double prev =
                            accum ? (f32 ? wprev_f[q] : tu_bf16_to_f32(wprev_bf[q])) : 0.0;
                        double ref = s + prev;
                        double tol = ACC_TOL * (m + fabs(prev)) + (f32 ? 1e-6 * fabs(ref) : RTOL_BF16 * fabs(ref)) + 1e-30;
                        if (off[e] == off[e + 1]) tol = 0;
                        tu_tally_add(&c1, dw1_out[v][q], ref, tol, (long)q);
                    }
                }
            }
        }
        tally_done(&c2, cs);
        tally_done(&c1, cs);
    }

    /* Determinism: dh and dw1 again, bit for bit. */
    {
        SMOE_OK_OR_EXIT(G->dh(&p, d_dO, d_w2, bias2, d_h_in, d_dh, d_as, d_ds, scratch, 0));
        std::vector<float> ds2 = dev_download(d_ds, cap);
        std::vector<uint16_t> dh2 = dev_download((uint16_t *)d_dh, cap * hc);
        if (memcmp(ds2.data(), ds.data(), R * 4) || memcmp(dh2.data(), dh.data(), R * hc * 2)) {
            fprintf(stderr, "FAIL %s: dh not bitwise deterministic\n", cs);
            g_fail++;
        }
    }

    void *bufs[] = {d_off, d_tok, d_score, d_x, d_w1, d_b1, d_a_in, d_w2, d_b2, d_dO, d_h_in,
                    d_as_in, d_dh_in, scratch, d_h, d_a, d_a2, d_y, d_dh, d_as, d_dxt, d_ds};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CUDA_OK(cudaFree(bufs[i]));
    printf("%s %s\n", g_fail > fails_before ? "FAIL" : "ok  ", cs);
}

static tcase random_case(int small)
{
    static const int ds[] = {8, 16, 24, 40, 136, 264};
    static const int ns[] = {8, 16, 24, 40, 72, 136, 200};
    tcase c;
    c.d = ds[rnd_int(0, small ? 3 : 5)];
    c.n = ns[rnd_int(0, small ? 3 : 6)];
    c.E = rnd_int(1, small ? 4 : 9);
    c.T = rnd_int(1, small ? 64 : 400);
    c.act = rnd_int(0, 6);
    c.layout = rnd_int(0, 1);
    c.bias = rnd_int(0, 1);
    c.cap_slack = rnd_int(0, 40);
    c.counts.resize(c.E);
    for (int64_t e = 0; e < c.E; e++) {
        int k = rnd_int(0, 5);
        c.counts[e] = k == 0 ? 0 : k == 1 ? rnd_int(1, 8) : k == 2 ? 128 : rnd_int(1, small ? 150 : 300);
    }
    return c;
}

/* ------------------------------------------------------------ bad input */

static void test_rejects(void)
{
    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = 12; /* not a multiple of 8 */
    p.n = 16;
    p.h_cols = 32;
    p.E = 2;
    p.cap = 4;
    p.gated = 1;
    smoe_status st = G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0);
    if (st != SMOE_ERROR_UNSUPPORTED) {
        fprintf(stderr, "FAIL: d=12 gave status %d, want UNSUPPORTED\n", (int)st);
        g_fail++;
    }
    p.d = 16;
    st = G->down(&p, (const bf16 *)(uintptr_t)0x1008, (const bf16 *)(uintptr_t)0x2000, NULL,
                 (bf16 *)(uintptr_t)0x3000, NULL, 0);
    if (st != SMOE_ERROR_UNSUPPORTED) {
        fprintf(stderr, "FAIL: misaligned pointer gave status %d, want UNSUPPORTED\n", (int)st);
        g_fail++;
    }
    printf("ok   bad input rejected (%s)\n", smoe_last_error());
}

static void expect(smoe_status st, smoe_status want, const char *what)
{
    if (st != want) {
        fprintf(stderr, "FAIL: %s gave status %d (%s), want %d\n", what, (int)st,
                smoe_last_error(), (int)want);
        g_fail++;
    }
}

/* The tile table and plans: names, the plan's choices, and the launchers'
 * refusals of rows they cannot run (all before anything is launched:
 * cap = 0, no buffers). */
static void test_plans(void)
{
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
        int count = 0;
        while (G->row_name(g, count)) count++;
        if (count == 0) {
            fprintf(stderr, "FAIL: %s has no rows\n", smoe_gemm_name(g));
            g_fail++;
        }
        for (int r = 0; r < count; r++)
            if (smoe_gemm_row_find(G, g, G->row_name(g, r)) != r) {
                fprintf(stderr, "FAIL: %s row %d: name \"%s\" not unique\n", smoe_gemm_name(g), r,
                        G->row_name(g, r));
                g_fail++;
            }
        if (smoe_gemm_row_find(G, g, "no such row") != -1 || G->row_name(g, -1)) {
            fprintf(stderr, "FAIL: %s: a row that does not exist was found\n", smoe_gemm_name(g));
            g_fail++;
        }
    }
    if (G->row_name(-1, 0) || G->row_name(SMOE_GEMM_COUNT, 0)) {
        fprintf(stderr, "FAIL: row_name of a GEMM that does not exist\n");
        g_fail++;
    }

    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = 16;
    p.n = 16;
    p.h_cols = 32;
    p.E = 4;
    p.cap = 0;
    p.gated = 1;
    smoe_gemm_plan plan;
    G->plan(&p, &plan);
    for (int g = 0; g < SMOE_GEMM_COUNT; g++)
        if (!G->row_name(g, plan.row[g])) {
            fprintf(stderr, "FAIL: the plan of d=n=16 E=4 has no row for %s\n", smoe_gemm_name(g));
            g_fail++;
        }
    p.plan = &plan;
    expect(G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0), SMOE_SUCCESS, "up, cap 0");
    /* A row past the table: the caller's bug. */
    smoe_gemm_plan bad = plan;
    bad.row[SMOE_GEMM_UP] = 99;
    p.plan = &bad;
    expect(G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0), SMOE_ERROR_INTERNAL, "up, row 99");
    /* -1: the family cannot run the GEMM. */
    bad = plan;
    bad.row[SMOE_GEMM_DOWN] = -1;
    p.plan = &bad;
    expect(G->down(&p, NULL, NULL, NULL, NULL, NULL, 0), SMOE_ERROR_UNSUPPORTED, "down, row -1");
    /* No plan: a bug of the caller's */
    p.plan = NULL;
    expect(G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0), SMOE_ERROR_INTERNAL, "no plan");

    /* More experts than a persistent grid keeps in shared memory (256):
     * the plan picks no persistent row, and a launcher asked for one
     * refuses it, naming it. */
    p.E = 300;
    G->plan(&p, &plan);
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
        const char *name = G->row_name(g, plan.row[g]);
        if (!name || strstr(name, "pers")) {
            fprintf(stderr, "FAIL: E=300: %s's plan row is %s\n", smoe_gemm_name(g),
                    name ? name : "none");
            g_fail++;
        }
        for (int r = 0; G->row_name(g, r); r++) {
            if (!strstr(G->row_name(g, r), "pers")) continue;
            bad = plan;
            bad.row[g] = r;
            p.plan = &bad;
            smoe_status s2 = SMOE_SUCCESS;
            switch (g) { /* only those with persistent rows need a call here */
            case SMOE_GEMM_UP: s2 = G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0); break;
            case SMOE_GEMM_DOWN: s2 = G->down(&p, NULL, NULL, NULL, NULL, NULL, 0); break;
            case SMOE_GEMM_DH:
                s2 = G->dh(&p, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0);
                break;
            case SMOE_GEMM_DW2: s2 = G->dw2(&p, NULL, NULL, NULL, SMOE_DTYPE_F32, 1, NULL, 0); break;
            case SMOE_GEMM_DXT: s2 = G->dxt(&p, NULL, NULL, NULL, NULL, 0); break;
            case SMOE_GEMM_DW1: s2 = G->dw1(&p, NULL, NULL, NULL, SMOE_DTYPE_F32, 1, NULL, 0); break;
            }
            char what[160];
            snprintf(what, sizeof what, "E=300, %s row \"%s\"", smoe_gemm_name(g), G->row_name(g, r));
            expect(s2, SMOE_ERROR_UNSUPPORTED, what);
            if (s2 == SMOE_ERROR_UNSUPPORTED && !strstr(smoe_last_error(), G->row_name(g, r))) {
                fprintf(stderr, "FAIL: %s: the message does not name the row: %s\n", what,
                        smoe_last_error());
                g_fail++;
            }
        }
    }
    /* A shape the family cannot run: no row for any GEMM. */
    p.E = 4;
    p.d = 12;
    G->plan(&p, &plan);
    for (int g = 0; g < SMOE_GEMM_COUNT; g++)
        if (plan.row[g] != -1) {
            fprintf(stderr, "FAIL: d=12: %s's plan row is %d, want -1\n", smoe_gemm_name(g),
                    plan.row[g]);
            g_fail++;
        }
    printf("ok   tile table and plans (%s)\n", smoe_last_error());
}

/* Whether row `row` of GEMM g runs on this device at a small shape (E = 1):
 * the launcher with cap = 0 refuses a row that does not fit before
 * launching anything; the weight gradients, which launch even at cap = 0,
 * accumulate into a real buffer over an expert with no rows (untouched). */
static bool row_runs(int g, int row)
{
    smoe_gemm_problem p;
    memset(&p, 0, sizeof p);
    p.d = 16;
    p.n = 16;
    p.h_cols = 32;
    p.E = 1;
    p.cap = 0;
    p.gated = 1;
    smoe_gemm_plan plan;
    G->plan(&p, &plan);
    plan.row[g] = row;
    p.plan = &plan;
    std::vector<int32_t> off(2, 0);
    int32_t *d_off = dev_upload(off);
    float *w;
    CUDA_OK(cudaMalloc(&w, 32 * 16 * 4));
    p.expert_offset = d_off;
    smoe_status st = SMOE_SUCCESS;
    switch (g) {
    case SMOE_GEMM_UP: st = G->up(&p, NULL, NULL, NULL, NULL, NULL, NULL, 0); break;
    case SMOE_GEMM_DOWN: st = G->down(&p, NULL, NULL, NULL, NULL, NULL, 0); break;
    case SMOE_GEMM_DH: st = G->dh(&p, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0); break;
    case SMOE_GEMM_DW2: st = G->dw2(&p, NULL, NULL, w, SMOE_DTYPE_F32, 1, NULL, 0); break;
    case SMOE_GEMM_DXT: st = G->dxt(&p, NULL, NULL, NULL, NULL, 0); break;
    case SMOE_GEMM_DW1: st = G->dw1(&p, NULL, NULL, w, SMOE_DTYPE_F32, 1, NULL, 0); break;
    }
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(d_off));
    CUDA_OK(cudaFree(w));
    if (st != SMOE_SUCCESS && st != SMOE_ERROR_UNSUPPORTED) SMOE_OK_OR_EXIT(st);
    if (st != SMOE_SUCCESS) printf("skip %s row \"%s\": %s\n", smoe_gemm_name(g),
                                   G->row_name(g, row), smoe_last_error());
    return st == SMOE_SUCCESS;
}

/* --row GEMM=NAME: row NAME of GEMM's table instead of the plan's. */
static int parse_row(const char *spec)
{
    const char *eq = strchr(spec, '=');
    const int g = eq ? smoe_gemm_find(spec, (size_t)(eq - spec)) : -1;
    if (g >= 0) {
        g_rows[g] = smoe_gemm_row_find(G, g, eq + 1);
        if (g_rows[g] >= 0) return 0;
        fprintf(stderr, "--row %s: no such row; %s's rows:", spec, smoe_gemm_name(g));
        for (int r = 0; G->row_name(g, r); r++) fprintf(stderr, " \"%s\"", G->row_name(g, r));
        fprintf(stderr, "\n");
        return -1;
    }
    fprintf(stderr, "--row %s: want GEMM=NAME, GEMM one of up down dh dw2 dxt dw1\n", spec);
    return -1;
}

int main(int argc, char **argv)
{
    int small = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) small = 1;
        else if (!strcmp(argv[i], "--row") && i + 1 < argc) {
            if (parse_row(argv[++i]) != 0) return 2;
        }
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) g_seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [--small] [--row GEMM=NAME ...] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    if (!tu_gpu_cc("test_gemm")) return 0;
    tu_seed = g_seed;
    g_rng = tu_rng_make(g_seed);
    test_rejects();
    test_plans();
    const int cases = small ? 4 : 40;
    for (int i = 0; i < cases; i++) run_case(random_case(small), i);
    /* Fixed corner cases: one expert with everything, all experts empty but one row. */
    {
        tcase c;
        c.T = 300; c.d = 64; c.n = 64; c.E = 3; c.act = SMOE_ACT_SWIGLU; c.layout = 1; c.bias = 1;
        c.cap_slack = 0;
        c.counts = {0, 300, 0};
        run_case(c, 1000);
        c.counts = {0, 0, 1};
        c.T = 1; c.d = 8; c.n = 8;
        run_case(c, 1001);
        /* More experts than a persistent grid keeps in shared memory
         * (grouped_gemm.cu's GG_PERS_EMAX, 256): the one-CTA-per-tile grid. */
        c.T = 64; c.d = 16; c.n = 16; c.E = 300; c.act = SMOE_ACT_GEGLU; c.layout = 0;
        c.cap_slack = 5;
        c.counts.assign(300, 0);
        for (int e = 0; e < 300; e++) c.counts[e] = rnd_int(0, 3);
        run_case(c, 1003);
    }
    /* Every row of every GEMM's tile table: the cases above ran the
     * plan's rows (row 0 where the device has the shared memory; the E =
     * 300 case the rows without a persistent grid); set k runs row k of
     * each GEMM whose plan row is not k, on a few more cases. A row the
     * device cannot run is reported as skipped. Not with --row. */
    bool forced = false;
    for (int g = 0; g < SMOE_GEMM_COUNT; g++) forced = forced || g_rows[g] >= 0;
    if (!forced) {
        smoe_gemm_problem p;
        memset(&p, 0, sizeof p);
        p.d = p.n = 16;
        p.h_cols = 32;
        p.E = 9; /* the random cases' largest */
        p.gated = 1;
        smoe_gemm_plan plan;
        G->plan(&p, &plan);
        for (int k = 0;; k++) {
            char rows[512] = "";
            bool any = false, more = false;
            for (int g = 0; g < SMOE_GEMM_COUNT; g++) {
                if (!G->row_name(g, k)) continue;
                more = true;
                if (k == plan.row[g] || !row_runs(g, k)) continue;
                g_rows[g] = k;
                any = true;
                snprintf(rows + strlen(rows), sizeof rows - strlen(rows), "%s%s=\"%s\"",
                         rows[0] ? " " : "", smoe_gemm_name(g), G->row_name(g, k));
            }
            if (!more) break;
            if (!any) continue;
            printf("rows %s:\n", rows);
            for (int i = 0; i < (small ? 1 : 6); i++)
                run_case(random_case(small), 2000 + 10 * k + i);
            for (int g = 0; g < SMOE_GEMM_COUNT; g++) g_rows[g] = -1;
        }
    }
    if (g_fail) {
        printf("test_gemm: %d failures (seed %llu)\n", g_fail, (unsigned long long)g_seed);
        return 1;
    }
    printf("test_gemm: all passed\n");
    return 0;
}
