/*
 * test_saved.c -- the saved-for-backward block, inference, determinism.
 *
 *   - smoe_layer_saved_bytes() is what a training forward really uses: the
 *     block plus a guard region is filled with a pattern; after the forward
 *     the guard is intact, the last aligned unit of the block was written
 *     (the block is not over-sized), and the size is within alignment
 *     padding of the header's own account (H, scores, tokens, metadata,
 *     logits). Token rounding: the guard holds for the worst case.
 *   - backward only reads the block.
 *   - desc.consume_saved: the consuming backward gives the reading one's
 *     gradients bit for bit (every routing mode, dtype, activation, W1
 *     layout, with and without bias) in a workspace of exactly
 *     smoe_layer_workspace_bytes (no larger than the reading layer's, with
 *     nothing written past it); a second backward with the block is
 *     refused (INVALID_VALUE, "consumed") and writes nothing; a new forward
 *     fills the block again; a block overlapping an input is refused (it is
 *     an output now); consume_saved outside {0, 1} is refused at create.
 *   - inference: saved = NULL works, a saved pointer given anyway is not
 *     written, the inputs are not written, and the output equals the
 *     training forward's bit for bit.
 *   - determinism: two forward+backward runs, one on 1 thread and one on 3,
 *     give identical bytes (out, logits, counts, saved block, every
 *     gradient).
 *   - the router's dtypes: router_logits written in the layer's dtype is
 *     the fp32 output rounded (bf16) or widened (f64), bit for bit, and a
 *     dlogits_extra given in the layer's dtype gives the same gradients,
 *     output and saved block as the same values in fp32, bit for bit
 *     (every routing mode with a router; bf16 and f64 layers); any other
 *     dtype is refused (INVALID_VALUE) before anything is written.
 *   - E = 65536, the most the block's 16-bit experts hold: a layer whose
 *     only live experts are 0, 21845, 43690 and 65535 gives the output and
 *     every gradient of the 4-expert layer of those experts bit for bit
 *     (TOPK_SOFTMAX, renormalised SIGMOID_TOPK, GENERAL), and exact zeros
 *     for the other experts.
 */
#include "testutil.h"

#include <omp.h>

#define PAT 0xA5
#define GUARD 4096
#define ALIGN 256 /* SMOE_ALIGN: sections start at multiples of it */

static int all_pat(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != PAT) return 0;
    return 1;
}

static void test_saved_bytes(tu_rng *rng) {
    const smoe_dtype dts[3] = {SMOE_DTYPE_F32, SMOE_DTYPE_BF16, SMOE_DTYPE_F64};
    for (int it = 0; it < 3 * TU_NMODES * 2; it++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        int mode = it % TU_NMODES;
        tu_set_mode(&D, mode);
        D.dtype = dts[(it / TU_NMODES) % 3];
        D.d = tu_int(rng, 1, 20); D.n = tu_int(rng, 1, 10);
        D.E = tu_int(rng, 1, 7); D.K = tu_int(rng, 1, D.E);
        D.activation = (smoe_activation)tu_int(rng, 0, 6);
        D.has_bias = (int)tu_int(rng, 0, 1);
        D.round_tile = tu_int(rng, 1, 6);
        D.backend = SMOE_BACKEND_CPU;
        int64_t T = tu_int(rng, 1, 30);
        tu_case("saved bytes it %d %s dtype=%d T=%lld d=%lld n=%lld E=%lld K=%lld M=%lld act=%s",
                it, tu_mode_name(&D), D.dtype, (long long)T, (long long)D.d, (long long)D.n,
                (long long)D.E, (long long)D.K, (long long)D.round_tile, tu_act_name(D.activation));
        tu_fixture F;
        if (!tu_fixture_make(&F, &D, T, rng, 0.5, 0.5)) continue;
        size_t S = F.B.saved_bytes;
        /* the header's account of the block */
        int general = D.routing == SMOE_ROUTING_GENERAL, tr = D.rounding != SMOE_ROUND_OFF;
        int64_t R = general ? F.P.pairs : T * D.K;
        if (tr && D.rounding != SMOE_ROUND_DOWN) {
            int64_t w = T * D.K + D.E * (D.round_tile - 1);
            R = w < T * D.E ? w : T * D.E;
        }
        size_t fs = D.dtype == SMOE_DTYPE_F64 ? 8 : 4;
        size_t need = ALIGN /* header */ + (size_t)R * (size_t)F.P.hc * tu_dtype_size(D.dtype) +
                      (size_t)R * (fs + 10) + /* score; token, row 4 bytes, expert 2 */
                      (size_t)(T + 1) * 4 + (size_t)(D.E + 1) * 4;
        if (D.routing == SMOE_ROUTING_SOFTMAX_TOPK || tr) need += (size_t)(T * D.E) * fs;
        CHECK(S >= need && S <= need + 9 * ALIGN, "saved_bytes %zu, the header's account %zu", S, need);
        unsigned char *blk = (unsigned char *)malloc(S + GUARD);
        memset(blk, PAT, S + GUARD);
        smoe_forward_args a = tu_fwd_args(&F.P, &F.B, 0);
        CHECK_OK(smoe_layer_forward(F.L, &a, blk, S, F.B.ws, F.B.ws_bytes, NULL));
        CHECK(all_pat(blk + S, GUARD), "the forward wrote past saved_bytes = %zu", S);
        if (!tr) {
            size_t last = S;
            while (last > 0 && blk[last - 1] == PAT) last--;
            CHECK(S - last < ALIGN, "saved_bytes %zu but the forward wrote only up to byte %zu", S, last);
        }
        /* backward reads the block and writes nothing into it */
        unsigned char *copy = (unsigned char *)malloc(S + GUARD);
        memcpy(copy, blk, S + GUARD);
        void *dx = calloc((size_t)(T * D.d), tu_dtype_size(D.dtype));
        void *dout = tu_to_dtype(D.dtype, F.P.x, (size_t)(T * D.d)); /* any values */
        float *dw1 = (float *)calloc((size_t)(D.E * F.P.hc * D.d), sizeof(float));
        smoe_backward_args b;
        memset(&b, 0, sizeof b);
        b.T = T; b.x = F.B.x; b.router_w = general ? NULL : F.B.wr; b.pairs = general ? F.P.pairs : 0;
        b.w1 = F.B.w1; b.w2 = F.B.w2; b.b2 = F.B.b2; b.dout = dout;
        b.dx.ptr = dx; b.dx.dtype = D.dtype;
        b.dw1.ptr = dw1; b.dw1.dtype = SMOE_DTYPE_F32;
        CHECK_OK(smoe_layer_backward(F.L, &b, blk, S, F.B.ws, F.B.ws_bytes, NULL));
        CHECK(memcmp(copy, blk, S + GUARD) == 0, "backward wrote into the saved block");
        free(copy); free(dx); free(dout); free(dw1); free(blk);
        tu_fixture_free(&F);
    }
}

static void test_inference(tu_rng *rng) {
    const smoe_dtype dts[3] = {SMOE_DTYPE_F32, SMOE_DTYPE_BF16, SMOE_DTYPE_F64};
    for (int it = 0; it < 21; it++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        tu_set_mode(&D, it % 4); /* token choice and GENERAL: the same rows either way */
        D.dtype = dts[it % 3];
        D.d = 11; D.n = 6; D.E = 5; D.K = 2;
        D.activation = (smoe_activation)(it % 7);
        D.has_bias = it % 2;
        D.backend = SMOE_BACKEND_CPU;
        int64_t T = 9;
        tu_case("inference it %d %s dtype=%d act=%s", it, tu_mode_name(&D), D.dtype,
                tu_act_name(D.activation));
        tu_fixture F;
        if (!tu_fixture_make(&F, &D, T, rng, 0.5, 0.5)) continue;
        size_t ob = (size_t)(T * D.d) * tu_dtype_size(D.dtype);
        smoe_forward_args a = tu_fwd_args(&F.P, &F.B, 0);
        CHECK_OK(smoe_layer_forward(F.L, &a, F.B.saved, F.B.saved_bytes, F.B.ws, F.B.ws_bytes, NULL));
        void *train_out = malloc(ob);
        memcpy(train_out, F.B.out, ob);
        /* inputs, to see that nothing is written to them */
        size_t xb = (size_t)(T * D.d) * tu_dtype_size(D.dtype);
        size_t w1b = (size_t)(D.E * F.P.hc * D.d) * tu_dtype_size(D.dtype);
        void *x0 = malloc(xb), *w10 = malloc(w1b);
        memcpy(x0, F.B.x, xb);
        memcpy(w10, F.B.w1, w1b);
        memset(F.B.out, PAT, ob);
        a.inference = 1;
        a.router_logits = NULL;
        a.expert_counts = NULL;
        CHECK_OK(smoe_layer_forward(F.L, &a, NULL, 0, F.B.ws, F.B.ws_bytes, NULL));
        CHECK(memcmp(F.B.out, train_out, ob) == 0, "inference out differs from the training out");
        CHECK(memcmp(F.B.x, x0, xb) == 0 && memcmp(F.B.w1, w10, w1b) == 0, "inference wrote an input");
        /* a saved pointer given anyway is left alone */
        memset(F.B.saved, PAT, F.B.saved_bytes);
        memset(F.B.out, PAT, ob);
        CHECK_OK(smoe_layer_forward(F.L, &a, F.B.saved, F.B.saved_bytes, F.B.ws, F.B.ws_bytes, NULL));
        CHECK(all_pat(F.B.saved, F.B.saved_bytes), "inference wrote into the saved block");
        CHECK(memcmp(F.B.out, train_out, ob) == 0, "inference out (saved given) differs");
        free(train_out); free(x0); free(w10);
        tu_fixture_free(&F);
    }
}

/* ------------------------------------------------------------ determinism */

typedef struct run_out {
    void *out, *saved;
    float *logits;
    int32_t *counts;
    tu_grads g;
} run_out;

/* Forward and backward (every gradient, weights in fp32) from a saved
 * block and workspace filled with the same pattern; keeps every output. */
static void one_run(smoe_layer *L, const tu_problem *P, tu_bufs *B, const void *dout,
                    const float *dle, run_out *r) {
    const smoe_layer_desc *D = &P->desc;
    int64_t T = P->T, d = D->d, E = D->E;
    memset(B->saved, PAT, B->saved_bytes);
    if (B->ws) memset(B->ws, PAT, B->ws_bytes);
    memset(B->out, PAT, (size_t)(T * d) * tu_dtype_size(D->dtype));
    tu_grads_alloc(&r->g, P, SMOE_DTYPE_F32);
    tu_run_backward(L, P, B, dout, dle, &r->g, 0);
    size_t ob = (size_t)(T * d) * tu_dtype_size(D->dtype);
    r->out = malloc(ob);
    memcpy(r->out, B->out, ob);
    r->saved = malloc(B->saved_bytes);
    memcpy(r->saved, B->saved, B->saved_bytes);
    r->logits = (float *)malloc((size_t)(T * E) * sizeof(float));
    memcpy(r->logits, B->logits, (size_t)(T * E) * sizeof(float));
    r->counts = (int32_t *)malloc((size_t)E * sizeof(int32_t));
    memcpy(r->counts, B->counts, (size_t)E * sizeof(int32_t));
}

static void test_determinism(tu_rng *rng) {
    for (int mode = 0; mode < TU_NMODES; mode++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        tu_set_mode(&D, mode);
        D.dtype = mode % 2 ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F32;
        D.d = 48; D.n = 24; D.E = 8; D.K = 2; D.round_tile = 16;
        D.activation = (smoe_activation)(mode % 7);
        D.has_bias = 1;
        D.backend = SMOE_BACKEND_CPU;
        int64_t T = 160;
        tu_case("determinism %s dtype=%d act=%s", tu_mode_name(&D), D.dtype, tu_act_name(D.activation));
        tu_fixture F;
        if (!tu_fixture_make(&F, &D, T, rng, 0.3, 0.3)) continue;
        double *G = tu_alloc_d((size_t)(T * D.d));
        tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
        void *Gb = tu_to_dtype(D.dtype, G, (size_t)(T * D.d));
        float *dle = (float *)malloc((size_t)(T * D.E) * sizeof(float));
        for (int64_t i = 0; i < T * D.E; i++) dle[i] = (float)(0.1 * tu_normal(rng));
        /* the backend promises the same bytes whatever the thread count */
        int nthr = omp_get_max_threads();
        run_out r1, r2;
        omp_set_num_threads(1);
        one_run(F.L, &F.P, &F.B, Gb, dle, &r1);
        omp_set_num_threads(3);
        one_run(F.L, &F.P, &F.B, Gb, dle, &r2);
        omp_set_num_threads(nthr);
        size_t ob = (size_t)(T * D.d) * tu_dtype_size(D.dtype);
        CHECK(memcmp(r1.out, r2.out, ob) == 0, "out differs run to run");
        CHECK(memcmp(r1.saved, r2.saved, F.B.saved_bytes) == 0, "saved block differs run to run");
        CHECK(memcmp(r1.logits, r2.logits, (size_t)(T * D.E) * 4) == 0, "logits differ run to run");
        CHECK(memcmp(r1.counts, r2.counts, (size_t)D.E * 4) == 0, "counts differ run to run");
        for (int i = 0; i < TU_NGRAD; i++)
            CHECK(!r1.g.n[i] || memcmp(r1.g.g[i], r2.g.g[i], r1.g.n[i] * tu_dtype_size(r1.g.dt[i])) == 0,
                  "%s differs run to run", tu_grad_name[i]);
        tu_grads_free(&r1.g);
        tu_grads_free(&r2.g);
        free(r1.out); free(r2.out); free(r1.saved); free(r2.saved);
        free(r1.logits); free(r2.logits); free(r1.counts); free(r2.counts);
        free(G); free(Gb); free(dle);
        tu_fixture_free(&F);
    }
}

/* The backward arguments of tu_run_backward, every gradient wanted. */
static smoe_backward_args bwd_args(const tu_problem *P, const tu_bufs *B, const void *G,
                                   const float *G2, tu_grads *g) {
    smoe_backward_args ba;
    memset(&ba, 0, sizeof ba);
    const int general = P->desc.routing == SMOE_ROUTING_GENERAL;
    ba.T = P->T;
    ba.x = B->x;
    ba.router_w = general ? NULL : B->wr;
    ba.pairs = general ? P->pairs : 0;
    ba.w1 = B->w1; ba.w2 = B->w2; ba.b2 = B->b2;
    ba.dout = G;
    ba.dlogits_extra = general ? NULL : G2;
    smoe_grad *slot[TU_NGRAD] = {&ba.dx, &ba.drouter_w, &ba.dw1, &ba.db1, &ba.dw2, &ba.db2,
                                 &ba.dpair_score};
    for (int i = 0; i < TU_NGRAD; i++) {
        slot[i]->ptr = g->g[i];
        slot[i]->dtype = g->dt[i];
    }
    return ba;
}

static int grads_equal(const tu_grads *a, const tu_grads *b, int *which) {
    for (int i = 0; i < TU_NGRAD; i++) {
        if (!a->g[i]) continue;
        if (memcmp(a->g[i], b->g[i], a->n[i] * tu_dtype_size(a->dt[i])) != 0) {
            *which = i;
            return 0;
        }
    }
    return 1;
}

static void grads_fill(tu_grads *g, int byte) {
    for (int i = 0; i < TU_NGRAD; i++)
        if (g->g[i]) memset(g->g[i], byte, g->n[i] * tu_dtype_size(g->dt[i]));
}

/* Forward with the router_logits output in ldt and backward with
 * dlogits_extra (in xdt), every gradient in fp32; keeps out, the saved
 * block and the gradients. */
static int dtype_run(smoe_layer *L, const tu_problem *P, tu_bufs *B, const void *G,
                     void *logits, smoe_dtype ldt, const void *dle, smoe_dtype xdt,
                     run_out *r) {
    const smoe_layer_desc *D = &P->desc;
    const size_t ob = (size_t)(P->T * D->d) * tu_dtype_size(D->dtype);
    memset(B->saved, PAT, B->saved_bytes);
    if (B->ws) memset(B->ws, PAT, B->ws_bytes);
    memset(B->out, PAT, ob);
    smoe_forward_args fa = tu_fwd_args(P, B, 0);
    fa.router_logits = logits;
    fa.router_logits_dtype = ldt;
    smoe_status st = smoe_layer_forward(L, &fa, B->saved, B->saved_bytes,
                                        B->ws_fwd ? B->ws_fwd : B->ws,
                                        B->ws_fwd_bytes ? B->ws_fwd_bytes : B->ws_bytes, NULL);
    if (!CHECK(st == SMOE_SUCCESS, "forward (logits dtype %d) -> %s (%s)", (int)ldt,
               smoe_status_string(st), smoe_last_error()))
        return 0;
    tu_grads_alloc(&r->g, P, SMOE_DTYPE_F32);
    smoe_backward_args ba = bwd_args(P, B, G, NULL, &r->g);
    ba.dlogits_extra = dle;
    ba.dlogits_extra_dtype = xdt;
    st = smoe_layer_backward(L, &ba, B->saved, B->saved_bytes, B->ws,
                             B->ws_bwd_bytes ? B->ws_bwd_bytes : B->ws_bytes, NULL);
    if (!CHECK(st == SMOE_SUCCESS, "backward (dlogits_extra dtype %d) -> %s (%s)", (int)xdt,
               smoe_status_string(st), smoe_last_error()))
        return 0;
    r->out = malloc(ob);
    memcpy(r->out, B->out, ob);
    r->saved = malloc(B->saved_bytes);
    memcpy(r->saved, B->saved, B->saved_bytes);
    r->logits = NULL;
    r->counts = NULL;
    return 1;
}

static void test_router_dtypes(tu_rng *rng) {
    const smoe_dtype dts[2] = {SMOE_DTYPE_BF16, SMOE_DTYPE_F64};
    for (int mode = 0; mode < TU_NMODES; mode++)
        for (int di = 0; di < 2; di++) {
            smoe_layer_desc D = smoe_layer_desc_default();
            tu_set_mode(&D, mode);
            if (D.routing == SMOE_ROUTING_GENERAL) continue;
            D.dtype = dts[di];
            D.d = 40; D.n = 24; D.E = 8; D.K = 2; D.round_tile = 16;
            D.backend = SMOE_BACKEND_CPU;
            const int64_t T = 96, TE = T * D.E;
            tu_case("router dtypes %s dtype=%d", tu_mode_name(&D), D.dtype);
            tu_fixture F;
            if (!tu_fixture_make(&F, &D, T, rng, 0.3, 0.3)) continue;
            const size_t es = tu_dtype_size(D.dtype);
            double *G = tu_alloc_d((size_t)(T * D.d));
            tu_fill_normal(rng, G, (size_t)(T * D.d), 1.0);
            void *Gb = tu_to_dtype(D.dtype, G, (size_t)(T * D.d));
            /* dlogits_extra: values the layer's dtype holds exactly, as fp32 and as that dtype */
            double *xd = tu_alloc_d((size_t)TE);
            for (int64_t i = 0; i < TE; i++) xd[i] = tu_round_bf16(0.1 * tu_normal(rng));
            float *x32 = (float *)tu_to_dtype(SMOE_DTYPE_F32, xd, (size_t)TE);
            void *xl = tu_to_dtype(D.dtype, xd, (size_t)TE);
            float *l32 = (float *)malloc((size_t)TE * 4);
            void *ll = malloc((size_t)TE * es);
            memset(ll, PAT, (size_t)TE * es);
            run_out a, b;
            if (dtype_run(F.L, &F.P, &F.B, Gb, l32, SMOE_DTYPE_F32, x32, SMOE_DTYPE_F32, &a) &&
                dtype_run(F.L, &F.P, &F.B, Gb, ll, D.dtype, xl, D.dtype, &b)) {
                double *ld = tu_alloc_d((size_t)TE);
                for (int64_t i = 0; i < TE; i++) ld[i] = (double)l32[i];
                void *want = tu_to_dtype(D.dtype, ld, (size_t)TE);
                CHECK(memcmp(ll, want, (size_t)TE * es) == 0,
                      "router_logits in dtype %d differ from the fp32 output converted",
                      (int)D.dtype);
                const size_t ob = (size_t)(T * D.d) * es;
                CHECK(memcmp(a.out, b.out, ob) == 0, "out differs with the logits' dtype");
                CHECK(memcmp(a.saved, b.saved, F.B.saved_bytes) == 0,
                      "saved block differs with the logits' dtype");
                int which = -1;
                CHECK(grads_equal(&a.g, &b.g, &which),
                      "%s differs with dlogits_extra in dtype %d",
                      which >= 0 ? tu_grad_name[which] : "?", (int)D.dtype);
                free(ld); free(want);
                tu_grads_free(&a.g); tu_grads_free(&b.g);
                free(a.out); free(b.out); free(a.saved); free(b.saved);
            }
            /* any other dtype: refused, nothing written */
            {
                smoe_forward_args fa = tu_fwd_args(&F.P, &F.B, 0);
                fa.router_logits_dtype = D.dtype == SMOE_DTYPE_BF16 ? SMOE_DTYPE_F64
                                                                    : SMOE_DTYPE_BF16;
                memset(F.B.out, PAT, (size_t)(T * D.d) * es);
                smoe_status st = smoe_layer_forward(
                    F.L, &fa, F.B.saved, F.B.saved_bytes, F.B.ws_fwd ? F.B.ws_fwd : F.B.ws,
                    F.B.ws_fwd_bytes ? F.B.ws_fwd_bytes : F.B.ws_bytes, NULL);
                CHECK(st == SMOE_ERROR_INVALID_VALUE &&
                          strstr(smoe_last_error(), "router_logits_dtype") != NULL,
                      "router_logits_dtype of another dtype -> %s (%s)", smoe_status_string(st),
                      smoe_last_error());
                CHECK(all_pat(F.B.out, (size_t)(T * D.d) * es),
                      "a refused forward wrote its output");
                fa.router_logits_dtype = (smoe_dtype)7;
                st = smoe_layer_forward(F.L, &fa, F.B.saved, F.B.saved_bytes,
                                        F.B.ws_fwd ? F.B.ws_fwd : F.B.ws,
                                        F.B.ws_fwd_bytes ? F.B.ws_fwd_bytes : F.B.ws_bytes, NULL);
                CHECK(st == SMOE_ERROR_INVALID_VALUE, "router_logits_dtype 7 -> %s",
                      smoe_status_string(st));
                tu_grads g;
                tu_grads_alloc(&g, &F.P, SMOE_DTYPE_F32);
                grads_fill(&g, PAT);
                smoe_backward_args ba = bwd_args(&F.P, &F.B, Gb, x32, &g);
                ba.dlogits_extra_dtype = (smoe_dtype)7;
                st = smoe_layer_backward(F.L, &ba, F.B.saved, F.B.saved_bytes, F.B.ws,
                                         F.B.ws_bwd_bytes ? F.B.ws_bwd_bytes : F.B.ws_bytes, NULL);
                CHECK(st == SMOE_ERROR_INVALID_VALUE &&
                          strstr(smoe_last_error(), "dlogits_extra_dtype") != NULL,
                      "dlogits_extra_dtype 7 -> %s (%s)", smoe_status_string(st),
                      smoe_last_error());
                int untouched = 1;
                for (int i = 0; i < TU_NGRAD; i++)
                    if (g.g[i]) untouched &= all_pat(g.g[i], g.n[i] * tu_dtype_size(g.dt[i]));
                CHECK(untouched, "a refused backward wrote a gradient");
                tu_grads_free(&g);
            }
            free(G); free(Gb); free(xd); free(x32); free(xl); free(l32); free(ll);
            tu_fixture_free(&F);
        }
}

/* smoe_layer_drouter_slot of the consuming layer L1 (B1: its buffers, g0:
 * the reading layer's gradients of the same call, wdt their dtype): with
 * drouter_w at the slot the backward gives g0's gradients bit for bit and
 * the slot holds g0's drouter_w; a slot pointer that accumulates, or one
 * elsewhere in the block, is refused with nothing written. Where the CPU
 * backend has no slot (H smaller than E x d), the query says so. */
static void test_slot(smoe_layer *L1, const tu_problem *P, tu_bufs *B1, const void *G,
                      const float *G2, const tu_grads *g0, smoe_dtype wdt) {
    const smoe_layer_desc *D = &P->desc;
    const int64_t T = P->T;
    size_t off = 12345;
    smoe_status st = smoe_layer_drouter_slot(L1, T, P->pairs, &off);
    if (D->routing == SMOE_ROUTING_GENERAL) {
        CHECK(st == SMOE_ERROR_UNSUPPORTED && strstr(smoe_last_error(), "GENERAL") && off == 12345,
              "GENERAL slot -> %s (%s)", smoe_status_string(st), smoe_last_error());
        return;
    }
    /* the CPU's slot is H: cap x h_cols of the dtype, from the header's own
     * account (the rows a token-choice forward keeps; rounding's worst case) */
    const size_t es = tu_dtype_size(D->dtype);
    const int64_t hc = tu_gated(D->activation) ? 2 * D->n : D->n;
    const int64_t up = T * D->K + D->E * (D->round_tile - 1);
    const int64_t cap = D->rounding == SMOE_ROUND_UP || D->rounding == SMOE_ROUND_NEAREST
                            ? (T * D->E < up ? T * D->E : up)
                            : T * D->K;
    const size_t hbytes = (size_t)(cap * hc) * es;
    const size_t need = (size_t)(D->E * D->d) * (es > 4 ? es : 4);
    if (hbytes < need) {
        CHECK(st == SMOE_ERROR_UNSUPPORTED && strstr(smoe_last_error(), "no room") && off == 12345,
              "slot with H %zu < %zu bytes -> %s (%s)", hbytes, need, smoe_status_string(st),
              smoe_last_error());
        return;
    }
    if (!CHECK(st == SMOE_SUCCESS && off % ALIGN == 0 && off + need <= B1->saved_bytes,
               "slot -> %s (%s), offset %zu of %zu", smoe_status_string(st), smoe_last_error(),
               off, B1->saved_bytes))
        return;
    const size_t db = (size_t)(D->E * D->d) * tu_dtype_size(wdt);
    tu_grads gs;
    tu_grads_alloc(&gs, P, wdt);
    void *own = gs.g[1];
    gs.g[1] = (char *)B1->saved + off;
    int which = -1;
    if (tu_run_backward(L1, P, B1, G, G2, &gs, 0)) {
        CHECK(memcmp(gs.g[1], g0->g[1], db) == 0, "drouter_w in the slot differs");
        gs.g[1] = g0->g[1];
        CHECK(grads_equal(g0, &gs, &which), "with drouter_w in the slot %s differs",
              which >= 0 ? tu_grad_name[which] : "?");
    }
    /* refusals, on a fresh block: nothing written */
    smoe_forward_args fa = tu_fwd_args(P, B1, 0);
    st = smoe_layer_forward(L1, &fa, B1->saved, B1->saved_bytes, B1->ws_fwd ? B1->ws_fwd : B1->ws,
                            B1->ws_fwd_bytes ? B1->ws_fwd_bytes : B1->ws_bytes, NULL);
    CHECK(st == SMOE_SUCCESS, "forward -> %s", smoe_status_string(st));
    unsigned char *copy = (unsigned char *)malloc(B1->saved_bytes);
    memcpy(copy, B1->saved, B1->saved_bytes);
    gs.g[1] = (char *)B1->saved + off;
    grads_fill(&gs, 0x3C);
    memcpy(B1->saved, copy, B1->saved_bytes);
    tu_grads g2;
    tu_grads_alloc(&g2, P, wdt);
    grads_fill(&g2, 0x3C);
    for (int k = 0; k < 2; k++) {
        smoe_backward_args ba = bwd_args(P, B1, G, G2, &gs);
        if (k == 0) {
            ba.drouter_w.accumulate = 1;
        } else {
            if (off + ALIGN + need > B1->saved_bytes) break;
            ba.drouter_w.ptr = (char *)B1->saved + off + ALIGN;
        }
        st = smoe_layer_backward(L1, &ba, B1->saved, B1->saved_bytes, B1->ws,
                                 B1->ws_bwd_bytes ? B1->ws_bwd_bytes : B1->ws_bytes, NULL);
        CHECK(st == SMOE_ERROR_INVALID_VALUE &&
                  strstr(smoe_last_error(), k == 0 ? "accumulate" : "overlaps"),
              "%s -> %s (%s)", k == 0 ? "the slot accumulated" : "drouter_w past the slot",
              smoe_status_string(st), smoe_last_error());
        void *keep = gs.g[1];
        gs.g[1] = g2.g[1];
        CHECK(grads_equal(&g2, &gs, &which) && memcmp(copy, B1->saved, B1->saved_bytes) == 0,
              "the refused backward (%s) wrote something", k == 0 ? "accumulate" : "past the slot");
        gs.g[1] = keep;
    }
    gs.g[1] = own;
    tu_grads_free(&gs);
    tu_grads_free(&g2);
    free(copy);
}

static void test_consume(tu_rng *rng) {
    const smoe_dtype dts[3] = {SMOE_DTYPE_BF16, SMOE_DTYPE_F32, SMOE_DTYPE_F64};
    for (int it = 0; it < 6 * TU_NMODES; it++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        D.d = tu_int(rng, 1, 20); D.n = tu_int(rng, 1, 10);
        D.E = tu_int(rng, 1, 7); D.K = tu_int(rng, 1, D.E);
        tu_set_mode(&D, it % TU_NMODES);
        D.dtype = dts[it % 3];
        D.activation = (smoe_activation)(it % 7);
        D.w1_layout = (smoe_w1_layout)((it / 7) % 2);
        D.has_bias = (it / 2) % 2;
        D.round_tile = tu_int(rng, 1, 6);
        D.backend = SMOE_BACKEND_CPU;
        const int64_t T = tu_int(rng, 1, 30);
        tu_case("consume it %d %s dtype=%d T=%lld d=%lld n=%lld E=%lld K=%lld act=%s w1=%d bias=%d",
                it, tu_mode_name(&D), D.dtype, (long long)T, (long long)D.d, (long long)D.n,
                (long long)D.E, (long long)D.K, tu_act_name(D.activation), (int)D.w1_layout,
                D.has_bias);
        tu_fixture F;
        if (!tu_fixture_make(&F, &D, T, rng, 0.5, 0.5)) continue;
        smoe_layer_desc D1 = D;
        D1.consume_saved = 1;
        smoe_layer *L1 = tu_layer(&D1);
        if (!L1) {
            tu_fixture_free(&F);
            continue;
        }
        CHECK(smoe_layer_get_desc(L1).consume_saved == 1, "get_desc lost consume_saved");
        const int general = D.routing == SMOE_ROUTING_GENERAL;
        const int64_t np = general ? F.P.pairs : 0;
        const size_t wb = smoe_layer_workspace_bytes(L1, T, np);
        CHECK(wb > 0 && wb <= F.B.ws_bytes, "consuming workspace %zu bytes, reading %zu", wb,
              F.B.ws_bytes);
        CHECK(smoe_layer_saved_bytes(L1, T, np) == F.B.saved_bytes, "saved bytes differ");
        const smoe_dtype wdt = it % 2 ? SMOE_DTYPE_F32 : D.dtype;
        double *gd = tu_alloc_d((size_t)(T * D.d));
        tu_fill_normal(rng, gd, (size_t)(T * D.d), 1.0);
        void *G = tu_to_dtype(D.dtype, gd, (size_t)(T * D.d));
        float *G2 = (float *)malloc((size_t)(T * D.E) * sizeof(float));
        for (int64_t i = 0; i < T * D.E; i++) G2[i] = (float)tu_normal(rng);
        tu_grads g0, g1;
        tu_grads_alloc(&g0, &F.P, wdt);
        tu_grads_alloc(&g1, &F.P, wdt);
        tu_run_backward(F.L, &F.P, &F.B, G, G2, &g0, 0);
        /* the consuming layer: its own saved block; odd cases give forward
         * and backward workspaces of exactly each call's own size
         * (smoe_layer_call_workspace_bytes), even ones one of exactly wb,
         * the larger of the two */
        const size_t wbf = smoe_layer_call_workspace_bytes(L1, SMOE_CALL_FORWARD, T, np);
        const size_t wbb = smoe_layer_call_workspace_bytes(L1, SMOE_CALL_BACKWARD, T, np);
        CHECK(wbf > 0 && wbb > 0 && wb == (wbf > wbb ? wbf : wbb),
              "workspace %zu, forward's %zu, backward's %zu", wb, wbf, wbb);
        const int own = it % 2;
        tu_bufs B1 = F.B;
        B1.saved = malloc(F.B.saved_bytes);
        B1.ws_bytes = own ? wbb : wb;
        B1.ws = malloc(B1.ws_bytes + GUARD);
        memset(B1.ws, PAT, B1.ws_bytes + GUARD);
        if (own) {
            B1.ws_fwd_bytes = wbf;
            B1.ws_fwd = malloc(wbf + GUARD);
            memset(B1.ws_fwd, PAT, wbf + GUARD);
        }
        if (tu_run_backward(L1, &F.P, &B1, G, G2, &g1, 0)) {
            int which = -1;
            CHECK(grads_equal(&g0, &g1, &which), "%s of the consuming backward differs",
                  which >= 0 ? tu_grad_name[which] : "?");
        }
        CHECK(all_pat((char *)B1.ws + B1.ws_bytes, GUARD),
              "the backward wrote past workspace_bytes = %zu", B1.ws_bytes);
        CHECK(!own || all_pat((char *)B1.ws_fwd + wbf, GUARD),
              "the forward wrote past workspace_bytes = %zu", wbf);
        /* a second backward: refused, nothing written */
        unsigned char *copy = (unsigned char *)malloc(F.B.saved_bytes);
        memcpy(copy, B1.saved, F.B.saved_bytes);
        grads_fill(&g1, 0x3C);
        tu_grads g2;
        tu_grads_alloc(&g2, &F.P, wdt);
        grads_fill(&g2, 0x3C);
        smoe_backward_args ba = bwd_args(&F.P, &B1, G, G2, &g1);
        smoe_status st =
            smoe_layer_backward(L1, &ba, B1.saved, F.B.saved_bytes, B1.ws, B1.ws_bytes, NULL);
        CHECK(st == SMOE_ERROR_INVALID_VALUE && strstr(smoe_last_error(), "consumed"),
              "second backward -> %s (%s)", smoe_status_string(st), smoe_last_error());
        int which = -1;
        CHECK(grads_equal(&g1, &g2, &which), "the refused backward wrote %s",
              which >= 0 ? tu_grad_name[which] : "?");
        CHECK(memcmp(copy, B1.saved, F.B.saved_bytes) == 0,
              "the refused backward wrote into the saved block");
        /* a saved block over an input (dout) is an overlap now; nothing written */
        if (T * D.d * (int64_t)tu_dtype_size(D.dtype) <= (int64_t)F.B.saved_bytes) {
            smoe_backward_args bo = ba;
            bo.dout = B1.saved;
            st = smoe_layer_backward(L1, &bo, B1.saved, F.B.saved_bytes, B1.ws, B1.ws_bytes, NULL);
            CHECK(st == SMOE_ERROR_INVALID_VALUE && strstr(smoe_last_error(), "overlaps"),
                  "saved over dout -> %s (%s)", smoe_status_string(st), smoe_last_error());
            CHECK(grads_equal(&g1, &g2, &which) && memcmp(copy, B1.saved, F.B.saved_bytes) == 0,
                  "the refused overlapping backward wrote something");
        }
        /* a new forward fills the block again */
        grads_fill(&g1, 0);
        if (tu_run_backward(L1, &F.P, &B1, G, G2, &g1, 0))
            CHECK(grads_equal(&g0, &g1, &which), "after a new forward: %s differs",
                  which >= 0 ? tu_grad_name[which] : "?");
        test_slot(L1, &F.P, &B1, G, G2, &g0, wdt);
        /* the reading layer has no slot */
        size_t off = 7;
        st = smoe_layer_drouter_slot(F.L, T, np, &off);
        CHECK(st == SMOE_ERROR_UNSUPPORTED && strstr(smoe_last_error(), "consume_saved") &&
                  off == 7,
              "slot of a reading layer -> %s (%s)", smoe_status_string(st), smoe_last_error());
        free(copy);
        free(B1.saved);
        free(B1.ws);
        free(B1.ws_fwd);
        tu_grads_free(&g0); tu_grads_free(&g1); tu_grads_free(&g2);
        free(gd); free(G); free(G2);
        smoe_layer_free(L1);
        tu_fixture_free(&F);
    }
    /* the field's own validation */
    const int bad[3] = {2, -1, 1000};
    for (int i = 0; i < 3; i++) {
        smoe_layer_desc D = smoe_layer_desc_default();
        D.d = 8; D.n = 4; D.E = 4; D.K = 2;
        D.backend = SMOE_BACKEND_CPU;
        D.consume_saved = bad[i];
        tu_case("consume_saved = %d", bad[i]);
        smoe_layer *L = NULL;
        smoe_status st = smoe_layer_create(&D, &L);
        CHECK(st == SMOE_ERROR_INVALID_VALUE && !L && strstr(smoe_last_error(), "consume_saved"),
              "create -> %s (%s)", smoe_status_string(st), smoe_last_error());
        smoe_layer_free(L);
    }
    tu_case("consume_saved default");
    CHECK(smoe_layer_desc_default().consume_saved == 0, "the default consumes");
}

/* Rows of a per-expert gradient: expert e's `w` values at e * w. */
static int rows_match(const float *g4, const float *gl, int64_t w, const int64_t *map) {
    for (int64_t e = 0; e < 4; e++)
        if (memcmp(g4 + e * w, gl + map[e] * w, (size_t)w * sizeof(float)) != 0) return 0;
    return 1;
}

static int64_t nonzero_elsewhere(const float *gl, int64_t E, int64_t w, const int64_t *map) {
    int64_t nz = 0;
    for (int64_t e = 0, j = 0; e < E; e++) {
        if (j < 4 && e == map[j]) {
            j++;
            continue;
        }
        for (int64_t i = 0; i < w; i++) nz += gl[e * w + i] != 0.0f;
    }
    return nz;
}

static void test_max_experts(tu_rng *rng) {
    static const int64_t map[4] = {0, 21845, 43690, 65535};
    static const smoe_routing modes[3] = {SMOE_ROUTING_TOPK_SOFTMAX, SMOE_ROUTING_SIGMOID_TOPK,
                                          SMOE_ROUTING_GENERAL};
    for (int m = 0; m < 3; m++) {
        smoe_layer_desc D4 = smoe_layer_desc_default();
        D4.d = 8; D4.n = 4; D4.E = 4; D4.K = 2;
        D4.routing = modes[m];
        D4.renormalize = m == 1;
        D4.has_bias = 1;
        D4.dtype = SMOE_DTYPE_F32;
        D4.backend = SMOE_BACKEND_CPU;
        smoe_layer_desc DL = D4;
        DL.E = 65536;
        const int64_t T = 6, d = D4.d, n = D4.n, EL = DL.E;
        tu_case("E = 65536 against E = 4, %s", tu_mode_name(&D4));
        tu_problem P4, PL;
        tu_problem_init(&P4, &D4, T, rng, 1.0, 0.5);
        /* a constant first feature with router weight 8 on it: the four
         * experts' logits near 8, every other expert's 0 */
        for (int64_t t = 0; t < T; t++) P4.x[t * d] = 1.0;
        for (int64_t e = 0; e < 4; e++) P4.wr[e * d] = 8.0;
        if (m == 2) tu_problem_general(&P4, rng, 0.6);
        tu_problem_init(&PL, &DL, T, rng, 1.0, 0.5);
        const int64_t hc = P4.hc;
        memcpy(PL.x, P4.x, (size_t)(T * d) * sizeof(double));
        memset(PL.wr, 0, (size_t)(EL * d) * sizeof(double));
        memset(PL.w1, 0, (size_t)(EL * hc * d) * sizeof(double));
        memset(PL.w2, 0, (size_t)(EL * d * n) * sizeof(double));
        memset(PL.b1, 0, (size_t)(EL * hc) * sizeof(double));
        memset(PL.b2, 0, (size_t)(EL * d) * sizeof(double));
        if (PL.ebias) memset(PL.ebias, 0, (size_t)EL * sizeof(double));
        for (int64_t e = 0; e < 4; e++) {
            const int64_t f = map[e];
            memcpy(PL.wr + f * d, P4.wr + e * d, (size_t)d * sizeof(double));
            memcpy(PL.w1 + f * hc * d, P4.w1 + e * hc * d, (size_t)(hc * d) * sizeof(double));
            memcpy(PL.w2 + f * d * n, P4.w2 + e * d * n, (size_t)(d * n) * sizeof(double));
            memcpy(PL.b1 + f * hc, P4.b1 + e * hc, (size_t)hc * sizeof(double));
            memcpy(PL.b2 + f * d, P4.b2 + e * d, (size_t)d * sizeof(double));
            if (PL.ebias) PL.ebias[f] = P4.ebias[e];
        }
        if (m == 2) {
            free(PL.pt); free(PL.pe); free(PL.ps);
            PL.pairs = P4.pairs;
            PL.pt = (int32_t *)malloc((size_t)P4.pairs * 4 + 4);
            PL.pe = (int32_t *)malloc((size_t)P4.pairs * 4 + 4);
            PL.ps = tu_alloc_d((size_t)P4.pairs + 1);
            for (int64_t i = 0; i < P4.pairs; i++) {
                PL.pt[i] = P4.pt[i];
                PL.pe[i] = (int32_t)map[P4.pe[i]];
                PL.ps[i] = P4.ps[i];
            }
        } else {
            tu_problem_route(&P4, 0);
            tu_problem_route(&PL, 0);
        }
        /* the reference routes both alike (the test's premise) */
        int same = P4.pairs == PL.pairs && P4.pairs > 0;
        int top = 0;
        for (int64_t i = 0; same && i < P4.pairs; i++) {
            same = PL.pt[i] == P4.pt[i] && PL.pe[i] == map[P4.pe[i]] && PL.ps[i] == P4.ps[i];
            top |= PL.pe[i] == 65535;
        }
        if (CHECK(same && top, "the reference routes the two layers differently or never to "
                               "expert 65535 (%lld pairs)",
                  (long long)P4.pairs)) {
            smoe_layer *L4 = tu_layer(&D4), *LL = tu_layer(&DL);
            tu_bufs B4, BL;
            tu_bufs_make(&B4, &P4, L4, 0);
            tu_bufs_make(&BL, &PL, LL, 0);
            float *G = (float *)malloc((size_t)(T * d) * sizeof(float));
            for (int64_t i = 0; i < T * d; i++) G[i] = (float)tu_normal(rng);
            tu_grads g4, gl;
            tu_grads_alloc(&g4, &P4, SMOE_DTYPE_F32);
            tu_grads_alloc(&gl, &PL, SMOE_DTYPE_F32);
            if (tu_run_backward(L4, &P4, &B4, G, NULL, &g4, 0) &&
                tu_run_backward(LL, &PL, &BL, G, NULL, &gl, 0)) {
                CHECK(!memcmp(B4.out, BL.out, (size_t)(T * d) * 4), "out differs");
                CHECK(!memcmp(g4.g[TU_GX], gl.g[TU_GX], (size_t)(T * d) * 4), "dx differs");
                if (m == 2)
                    CHECK(!memcmp(g4.g[TU_GPS], gl.g[TU_GPS], (size_t)P4.pairs * 4),
                          "dpair_score differs");
                const int idx[5] = {TU_GWR, TU_GW1, TU_GB1, TU_GW2, TU_GB2};
                const int64_t w[5] = {d, hc * d, hc, d * n, d};
                for (int i = 0; i < 5; i++) {
                    if (!g4.g[idx[i]]) continue;
                    CHECK(rows_match((const float *)g4.g[idx[i]], (const float *)gl.g[idx[i]],
                                     w[i], map),
                          "%s of the four experts differs", tu_grad_name[idx[i]]);
                    const int64_t nz =
                        nonzero_elsewhere((const float *)gl.g[idx[i]], EL, w[i], map);
                    CHECK(nz == 0, "%s: %lld nonzero values for experts without pairs",
                          tu_grad_name[idx[i]], (long long)nz);
                }
            }
            tu_grads_free(&g4);
            tu_grads_free(&gl);
            free(G);
            tu_bufs_free(&B4);
            tu_bufs_free(&BL);
            smoe_layer_free(L4);
            smoe_layer_free(LL);
        }
        tu_problem_free(&P4);
        tu_problem_free(&PL);
    }
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 4242));
    test_saved_bytes(&rng);
    test_inference(&rng);
    test_determinism(&rng);
    test_consume(&rng);
    test_router_dtypes(&rng);
    test_max_experts(&rng);
    return tu_summary("test_saved");
}
