/*
 * test_ep.c -- the expert-parallel layer with P ranks simulated as P
 * threads of this process (an in-process smoe_ep_group, the CPU backend),
 * against the single layer on the gathered batch:
 *  - each rank's output and dx rows, the sum over ranks of drouter_w, each
 *    rank's slice of dW1, db1, dW2, db2, GENERAL's pair-score gradient and
 *    the expert counts. F64: within 1e-6 relative (the pairs' scores travel
 *    to the experts' rank as fp32, where the single F64 layer keeps them in
 *    double); BF16: FA3's rule against the F64 single layer (each rank's
 *    partial sum of a token is rounded to bf16 before it travels back: one
 *    more rounding than on one GPU);
 *  - P = 1..4, uneven token counts with a rank of none, every pair on one
 *    rank's experts, each routing mode EP takes, biases, activations, both
 *    W1 layouts, fp32 gradients accumulated;
 *  - two runs bitwise equal; an inference forward (no saved block) between
 *    forward and backward gives the same out bit for bit; keep_x (x's
 *    received rows kept for the backward) bitwise equal to x sent again;
 *  - overlap = 1 (CUDA only), overlap, comm_sms, keep_x or copy_engines out of
 *    range refused; copy engines refused on the CPU;
 *  - refusals on every rank at once: E not a multiple of P, token
 *    rounding, a description that differs between ranks, a capacity too
 *    small (the sender's overflow), a bad argument on one rank only.
 * Threads record their results; the checks run after the joins.
 */
#include "testutil.h"
#include "ep_ref.h"

#include <pthread.h>

#define MAXP 4

typedef struct ep_case {
    smoe_layer_desc D;
    int P;
    int64_t Tr[MAXP];  /* tokens of each rank */
    int64_t capacity;  /* 0: worst case */
    int one_rank;      /* GENERAL: every pair on rank 0's experts */
    int accumulate;    /* gradients accumulated onto a known start */
    int mismatch_rank; /* this rank's description differs (d + 8); -1: none */
    int overlap, comm_sms, keep_x, copy_engines; /* smoe_ep_desc's */
    int bad_rank;      /* this rank passes out = NULL; -1: none */
} ep_case;

typedef struct rank_run {
    int r;
    const ep_case *c;
    smoe_ep_group *g;
    const tu_problem *P; /* the global problem, in doubles */
    const double *dout;  /* (T, d) global */
    int64_t t0, T;       /* its tokens: [t0, t0 + T) of the global batch */
    int64_t p0, np;      /* GENERAL: its triples, [p0, p0 + np) of the global ones */
    smoe_status st_create, st_fwd, st_bwd;
    char msg[512];
    double *out, *dx, *dwr, *dw1, *db1, *dw2, *db2, *dps;
    int32_t counts[64];
    uint64_t hash;
    int inf_same; /* an inference forward gave the training forward's out */
} rank_run;

static void *rank_main(void *arg) {
    rank_run *R = (rank_run *)arg;
    const ep_case *c = R->c;
    const tu_problem *P = R->P;
    smoe_layer_desc D = c->D;
    const int r = R->r, NP = c->P;
    const int64_t d = D.d, n = D.n, E = D.E, El = E / NP, hc = P->hc, T = R->T;
    const int general = D.routing == SMOE_ROUTING_GENERAL;
    smoe_ep_desc ed = smoe_ep_desc_default();
    ed.layer = D;
    if (r == c->mismatch_rank) ed.layer.d += 8;
    ed.rank = r;
    ed.nranks = NP;
    ed.group = R->g;
    int64_t tmax = 0;
    for (int q = 0; q < NP; q++) tmax = c->Tr[q] > tmax ? c->Tr[q] : tmax;
    ed.max_tokens = tmax;
    ed.capacity = c->capacity;
    ed.overlap = c->overlap;
    ed.comm_sms = c->comm_sms;
    ed.keep_x = c->keep_x;
    ed.copy_engines = c->copy_engines;
    smoe_ep_layer *L = NULL;
    R->st_create = smoe_ep_layer_create(&ed, &L);
    if (R->st_create != SMOE_SUCCESS) {
        snprintf(R->msg, sizeof R->msg, "%s", smoe_last_error());
        return NULL;
    }
    /* this rank's tensors */
    const smoe_dtype dt = D.dtype;
    const size_t es = tu_dtype_size(dt);
    void *x = T ? tu_to_dtype(dt, P->x + R->t0 * d, (size_t)(T * d)) : malloc(16);
    void *wr = tu_to_dtype(dt, P->wr, (size_t)(E * d));
    void *w1 = tu_to_dtype(dt, P->w1 + (size_t)r * El * hc * d, (size_t)(El * hc * d));
    void *w2 = tu_to_dtype(dt, P->w2 + (size_t)r * El * d * n, (size_t)(El * d * n));
    void *b1 = P->b1 ? tu_to_dtype(dt, P->b1 + (size_t)r * El * hc, (size_t)(El * hc)) : NULL;
    void *b2 = P->b2 ? tu_to_dtype(dt, P->b2 + (size_t)r * El * d, (size_t)(El * d)) : NULL;
    void *G = T ? tu_to_dtype(dt, R->dout + R->t0 * d, (size_t)(T * d)) : malloc(16);
    void *out = malloc((size_t)(T * d) * es + 16);
    float *logits = (float *)malloc((size_t)(T * E) * 4 + 4);
    int32_t *pt = NULL, *pe = NULL;
    float *ps = NULL;
    if (general) {
        pt = (int32_t *)malloc((size_t)R->np * 4 + 4);
        pe = (int32_t *)malloc((size_t)R->np * 4 + 4);
        ps = (float *)malloc((size_t)R->np * 4 + 4);
        for (int64_t i = 0; i < R->np; i++) {
            pt[i] = (int32_t)(P->pt[R->p0 + i] - R->t0);
            pe[i] = P->pe[R->p0 + i];
            ps[i] = (float)P->ps[R->p0 + i];
        }
    }
    const size_t sb = smoe_ep_layer_saved_bytes(L, T), wb = smoe_ep_layer_workspace_bytes(L, T);
    void *saved = malloc(sb ? sb : 1), *ws = malloc(wb ? wb : 1);
    smoe_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.T = T; fa.x = x; fa.router_w = general ? NULL : wr;
    fa.pairs = general ? R->np : 0;
    fa.pair_token = pt; fa.pair_expert = pe; fa.pair_score = ps;
    fa.w1 = w1; fa.b1 = b1; fa.w2 = w2; fa.b2 = b2;
    fa.out = r == c->bad_rank ? NULL : out;
    fa.router_logits = general ? NULL : logits;
    fa.expert_counts = R->counts;
    float eb[64];
    if (P->ebias) {
        for (int64_t e = 0; e < E; e++) eb[e] = (float)P->ebias[e];
        fa.expert_bias = eb;
    }
    R->st_fwd = smoe_ep_layer_forward(L, &fa, saved, sb, ws, wb, NULL);
    if (R->st_fwd != SMOE_SUCCESS) {
        snprintf(R->msg, sizeof R->msg, "%s", smoe_last_error());
    } else {
        /* an inference forward (no saved block) between the training forward
         * and its backward: the same out, and the saved block untouched */
        smoe_forward_args fi = fa;
        void *out2 = malloc((size_t)(T * d) * es + 16);
        fi.out = out2;
        fi.router_logits = NULL;
        fi.expert_counts = NULL;
        fi.inference = 1;
        const smoe_status si = smoe_ep_layer_forward(L, &fi, NULL, 0, ws, wb, NULL);
        R->inf_same = si == SMOE_SUCCESS && !memcmp(out, out2, (size_t)(T * d) * es);
        free(out2);
        /* gradients: fp32, accumulated onto 0.25 where asked */
        const size_t gn[7] = {(size_t)(T * d), (size_t)(E * d), (size_t)(El * hc * d),
                              (size_t)(El * hc), (size_t)(El * d * n), (size_t)(El * d),
                              (size_t)R->np};
        float *gb[7];
        for (int i = 0; i < 7; i++) {
            gb[i] = (float *)malloc(gn[i] * 4 + 4);
            for (size_t j = 0; j < gn[i]; j++) gb[i][j] = c->accumulate ? 0.25f : 0.0f;
        }
        smoe_backward_args ba;
        memset(&ba, 0, sizeof ba);
        ba.T = T; ba.x = x; ba.router_w = general ? NULL : wr; ba.pairs = fa.pairs;
        ba.w1 = w1; ba.w2 = w2; ba.b2 = b2; ba.dout = G;
        const int acc = c->accumulate;
        ba.dx = (smoe_grad){gb[0], SMOE_DTYPE_F32, acc};
        ba.drouter_w = (smoe_grad){general ? NULL : gb[1], SMOE_DTYPE_F32, acc};
        ba.dw1 = (smoe_grad){gb[2], SMOE_DTYPE_F32, acc};
        ba.db1 = (smoe_grad){b1 ? gb[3] : NULL, SMOE_DTYPE_F32, acc};
        ba.dw2 = (smoe_grad){gb[4], SMOE_DTYPE_F32, acc};
        ba.db2 = (smoe_grad){b2 ? gb[5] : NULL, SMOE_DTYPE_F32, acc};
        ba.dpair_score = (smoe_grad){general && R->np ? gb[6] : NULL, SMOE_DTYPE_F32, acc};
        R->st_bwd = smoe_ep_layer_backward(L, &ba, saved, sb, ws, wb, NULL);
        if (R->st_bwd != SMOE_SUCCESS) snprintf(R->msg, sizeof R->msg, "%s", smoe_last_error());
        double **dst[7] = {&R->dx, &R->dwr, &R->dw1, &R->db1, &R->dw2, &R->db2, &R->dps};
        uint64_t h = fnv(14695981039346656037ull, out, (size_t)(T * d) * es);
        for (int i = 0; i < 7; i++) {
            *dst[i] = tu_alloc_d(gn[i] + 1);
            for (size_t j = 0; j < gn[i]; j++) (*dst[i])[j] = gb[i][j] - (acc ? 0.25 : 0.0);
            h = fnv(h, gb[i], gn[i] * 4);
            free(gb[i]);
        }
        R->hash = h;
        R->out = tu_from_dtype(dt, out, (size_t)(T * d));
    }
    free(x); free(wr); free(w1); free(w2); free(b1); free(b2); free(G); free(out); free(logits);
    free(pt); free(pe); free(ps); free(saved); free(ws);
    smoe_ep_layer_free(L);
    return NULL;
}

static void run_case(const char *name, const ep_case *c, tu_rng *rng, int expect_ok,
                     smoe_status want, const char *want_text) {
    const int NP = c->P;
    smoe_layer_desc D = c->D;
    int64_t T = 0;
    for (int q = 0; q < NP; q++) T += c->Tr[q];
    tu_problem P;
    tu_problem_init(&P, &D, T, rng, 1.0, 0.5);
    if (D.routing == SMOE_ROUTING_GENERAL) {
        tu_problem_general(&P, rng, 0.4);
        if (c->one_rank) {
            /* every pair on rank 0's experts: keep those with e < E/P */
            int64_t k = 0;
            for (int64_t i = 0; i < P.pairs; i++)
                if (P.pe[i] < D.E / NP) {
                    P.pt[k] = P.pt[i]; P.pe[k] = P.pe[i]; P.ps[k] = P.ps[i]; k++;
                }
            P.pairs = k;
        }
    }
    double *dout = tu_alloc_d((size_t)(T * D.d) + 1);
    tu_fill_normal(rng, dout, (size_t)(T * D.d), 1.0);
    tu_round_array(D.dtype, dout, (size_t)(T * D.d));
    smoe_ep_group *g = NULL;
    CHECK_OK(smoe_ep_group_create(NP, &g));
    rank_run R[MAXP];
    memset(R, 0, sizeof R);
    int64_t t0 = 0, p = 0;
    for (int q = 0; q < NP; q++) {
        R[q].r = q; R[q].c = c; R[q].g = g; R[q].P = &P; R[q].dout = dout;
        R[q].t0 = t0; R[q].T = c->Tr[q];
        R[q].p0 = p;
        while (p < P.pairs && P.pt[p] < t0 + c->Tr[q]) p++;
        R[q].np = p - R[q].p0;
        t0 += c->Tr[q];
    }
    /* keep_x: a first run without it, bitwise the same; the checks read
     * the last run's results */
    ep_case c0 = *c;
    c0.keep_x = 0;
    const int runs = expect_ok ? (c->keep_x ? 3 : 2) : 1;
    uint64_t hashes[3][MAXP];
    for (int run = 0; run < runs; run++) {
        pthread_t th[MAXP];
        for (int q = 0; q < NP; q++) {
            R[q].c = runs == 3 && run == 0 ? &c0 : c;
            if (run) {
                free(R[q].out); free(R[q].dx); free(R[q].dwr); free(R[q].dw1); free(R[q].db1);
                free(R[q].dw2); free(R[q].db2); free(R[q].dps);
                R[q].out = R[q].dx = R[q].dwr = R[q].dw1 = R[q].db1 = R[q].dw2 = R[q].db2 =
                    R[q].dps = NULL;
            }
            pthread_create(&th[q], NULL, rank_main, &R[q]);
        }
        for (int q = 0; q < NP; q++) pthread_join(th[q], NULL);
        for (int q = 0; q < NP; q++) hashes[run][q] = R[q].hash;
    }
    tu_case("ep %s (P = %d, %s, dtype %d)", name, NP, tu_mode_name(&D), (int)D.dtype);
    if (!expect_ok) {
        for (int q = 0; q < NP; q++) {
            const smoe_status got = R[q].st_create != SMOE_SUCCESS ? R[q].st_create : R[q].st_fwd;
            CHECK(got == want, "rank %d: status %s, want %s (%s)", q, smoe_status_string(got),
                  smoe_status_string(want), R[q].msg);
            if (want_text)
                CHECK(strstr(R[q].msg, want_text), "rank %d: message \"%s\" lacks \"%s\"", q,
                      R[q].msg, want_text);
        }
    } else {
        int ok = 1;
        for (int q = 0; q < NP; q++)
            ok &= CHECK(R[q].st_create == SMOE_SUCCESS && R[q].st_fwd == SMOE_SUCCESS &&
                            R[q].st_bwd == SMOE_SUCCESS,
                        "rank %d: %s", q, R[q].msg);
        for (int q = 0; q < NP; q++)
            CHECK(hashes[runs - 2][q] == hashes[runs - 1][q], "rank %d: two runs differ", q);
        for (int q = 0; q < NP && runs == 3; q++)
            CHECK(hashes[0][q] == hashes[1][q],
                  "rank %d: keep_x = 1 and keep_x = 0 differ (out or a gradient)", q);
        for (int q = 0; q < NP; q++)
            CHECK(R[q].inf_same, "rank %d: the inference forward's out differs from training's",
                  q);
        if (ok) {
            single_res s64, s16;
            const int bf16 = D.dtype == SMOE_DTYPE_BF16;
            single_run(&P, dout, NULL, SMOE_DTYPE_F64, &s64);
            if (bf16) single_run(&P, dout, NULL, SMOE_DTYPE_BF16, &s16);
            double *dwr[MAXP];
            const int32_t *cnts[MAXP];
            for (int q = 0; q < NP; q++) {
                const rank_run *Rq = &R[q];
                double *const g[TU_NGRAD] = {Rq->dx, Rq->dwr, Rq->dw1, Rq->db1,
                                             Rq->dw2, Rq->db2, Rq->dps};
                ep_check_rank(q, NP, &P, &s64, &s16, bf16, Rq->t0, Rq->T, Rq->p0, Rq->np,
                              Rq->out, g);
                dwr[q] = Rq->dwr;
                cnts[q] = Rq->counts;
            }
            ep_check_sums(NP, &P, &s64, &s16, bf16, dwr, cnts);
            single_free(&s64);
            if (bf16) single_free(&s16);
        }
    }
    for (int q = 0; q < NP; q++) {
        free(R[q].out); free(R[q].dx); free(R[q].dwr); free(R[q].dw1); free(R[q].db1);
        free(R[q].dw2); free(R[q].db2); free(R[q].dps);
    }
    smoe_ep_group_free(g);
    free(dout);
    tu_problem_free(&P);
}

static ep_case base_case(int P, smoe_routing routing, smoe_dtype dt) {
    ep_case c;
    memset(&c, 0, sizeof c);
    c.D = smoe_layer_desc_default();
    c.D.d = 12; c.D.n = 6; c.D.E = 8; c.D.K = 3;
    c.D.routing = routing;
    c.D.renormalize = 1;
    c.D.dtype = dt;
    c.D.backend = SMOE_BACKEND_CPU;
    if (routing == SMOE_ROUTING_GENERAL) c.D.K = 0;
    c.P = P;
    for (int q = 0; q < P; q++) c.Tr[q] = 5 + 3 * q;
    c.mismatch_rank = -1;
    c.bad_rank = -1;
    return c;
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 7));
    static const smoe_routing modes[3] = {SMOE_ROUTING_TOPK_SOFTMAX, SMOE_ROUTING_SOFTMAX_TOPK,
                                          SMOE_ROUTING_GENERAL};
    for (int P = 1; P <= MAXP; P++) {
        if (8 % P) continue;
        for (int m = 0; m < 3; m++)
            for (int dti = 0; dti < 2; dti++) {
                ep_case c = base_case(P, modes[m], dti ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F64);
                c.D.activation = (smoe_activation)((P + m) % 7);
                c.D.w1_layout = (smoe_w1_layout)(m % 2);
                c.D.has_bias = (P + dti) % 2;
                c.accumulate = m == 1;
                run_case("balanced", &c, &rng, 1, SMOE_SUCCESS, NULL);
            }
    }
    /* keep_x: each routing mode, P = 1, 2, 4, both dtypes */
    for (int P = 1; P <= MAXP; P *= 2)
        for (int m = 0; m < 3; m++) {
            ep_case c = base_case(P, modes[m], m == 1 ? SMOE_DTYPE_F64 : SMOE_DTYPE_BF16);
            c.D.has_bias = m != 0;
            c.accumulate = m == 2;
            c.keep_x = 1;
            run_case("keep_x", &c, &rng, 1, SMOE_SUCCESS, NULL);
        }
    {
        ep_case c = base_case(4, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        c.Tr[0] = 7; c.Tr[1] = 0; c.Tr[2] = 1; c.Tr[3] = 12;
        run_case("uneven, a rank without tokens", &c, &rng, 1, SMOE_SUCCESS, NULL);
        c.keep_x = 1;
        run_case("uneven, a rank without tokens, keep_x", &c, &rng, 1, SMOE_SUCCESS, NULL);
        c.keep_x = 0;
        c.D.routing = SMOE_ROUTING_SOFTMAX_TOPK;
        c.D.renormalize = 0;
        run_case("uneven, softmax-topk not renormalised", &c, &rng, 1, SMOE_SUCCESS, NULL);
    }
    /* SIGMOID_TOPK (the replicated router routes with the bias and the
     * groups): groups, scaling, renormalised or not, both dtypes */
    for (int P = 2; P <= 4; P += 2)
        for (int dti = 0; dti < 2; dti++) {
            ep_case c = base_case(P, SMOE_ROUTING_SIGMOID_TOPK,
                                  dti ? SMOE_DTYPE_BF16 : SMOE_DTYPE_F64);
            c.D.n_group = 4; c.D.topk_group = 2;
            c.D.routed_scaling = 2.5;
            c.D.renormalize = dti;
            c.D.activation = (smoe_activation)(P + dti);
            c.D.has_bias = dti;
            run_case("sigmoid, groups", &c, &rng, 1, SMOE_SUCCESS, NULL);
        }
    {
        ep_case c = base_case(2, SMOE_ROUTING_GENERAL, SMOE_DTYPE_F64);
        c.one_rank = 1;
        run_case("every pair on rank 0's experts", &c, &rng, 1, SMOE_SUCCESS, NULL);
    }
    {
        ep_case c = base_case(4, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_BF16);
        c.D.d = 24; c.D.n = 16; c.D.E = 16; c.D.K = 6;
        for (int q = 0; q < 4; q++) c.Tr[q] = 20 + 7 * q;
        run_case("bf16, K = 6 over 4 ranks", &c, &rng, 1, SMOE_SUCCESS, NULL);
    }
    /* refusals, on every rank */
    {
        ep_case c = base_case(3, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        run_case("E = 8 over 3 ranks", &c, &rng, 0, SMOE_ERROR_INVALID_SIZE, "split evenly");
        c = base_case(2, SMOE_ROUTING_SOFTMAX_TOPK, SMOE_DTYPE_F64);
        c.D.rounding = SMOE_ROUND_UP;
        run_case("token rounding", &c, &rng, 0, SMOE_ERROR_UNSUPPORTED, "token rounding");
        c = base_case(2, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        c.mismatch_rank = 1;
        run_case("descriptions differ", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE, "differs");
        c = base_case(2, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        c.capacity = 2; /* rank 1 has 8 tokens, most going to both ranks */
        run_case("capacity too small", &c, &rng, 0, SMOE_ERROR_INVALID_SIZE, "capacity");
        c = base_case(3, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        c.D.E = 9;
        c.bad_rank = 2;
        run_case("a bad argument on rank 2 only", &c, &rng, 0, SMOE_ERROR_NULL_POINTER, "out");
        c = base_case(2, SMOE_ROUTING_TOPK_SOFTMAX, SMOE_DTYPE_F64);
        c.overlap = 1; /* the CPU backend exchanges, then computes */
        run_case("overlap required on the CPU", &c, &rng, 0, SMOE_ERROR_UNSUPPORTED, "overlap");
        c.overlap = 2; /* the backward's: the same */
        run_case("backward overlap required on the CPU", &c, &rng, 0, SMOE_ERROR_UNSUPPORTED,
                 "overlap = 2");
        c.overlap = 3;
        run_case("overlap out of range", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE, "overlap");
        c.overlap = -1;
        c.comm_sms = -2;
        run_case("comm_sms out of range", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE, "comm_sms");
        c.comm_sms = 0;
        c.keep_x = 2;
        run_case("keep_x out of range", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE, "keep_x");
        c.keep_x = 0;
        c.copy_engines = 2;
        run_case("copy_engines out of range", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE,
                 "copy_engines");
        c.copy_engines = -2;
        run_case("copy_engines below -1", &c, &rng, 0, SMOE_ERROR_INVALID_VALUE,
                 "copy_engines");
        c.copy_engines = 1;
        c.overlap = 0;
        run_case("copy engines on the CPU", &c, &rng, 0, SMOE_ERROR_UNSUPPORTED, "copy_engines");
        c.copy_engines = -1; /* NCCL's kernels asked for: the CPU's host copies */
        run_case("copy engines off on the CPU", &c, &rng, 1, SMOE_SUCCESS, NULL);
        c.copy_engines = 0;
        c.overlap = -1;
        c.comm_sms = 8; /* CUDA-only settings, no effect on the CPU */
        run_case("overlap off, comm_sms set", &c, &rng, 1, SMOE_SUCCESS, NULL);
    }
    return tu_summary("test_ep");
}
