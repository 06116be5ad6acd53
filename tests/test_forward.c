/*
 * test_forward.c -- the CPU forward against the naive reference of
 * testutil.h (double precision: routing, token rounding, experts, combine),
 * on edge cases, random shapes and large shapes, in each storage dtype
 * (the backward is checked in test_gradcheck.c).
 *
 * Edge cases: T=1, K=1, K=E, E=1, empty experts, every token on one expert,
 * sizes that are multiples of nothing (d=13, n=7), GENERAL routing with
 * tokens that have no expert and with no pair at all, token rounding.
 */
#include "testutil.h"

typedef struct fcase {
    const char *name;
    int64_t T, d, n, E, K;
    int mode;       /* tu_set_mode(): 0 topk-softmax, 1 softmax-topk,
                       2 +renorm, 3 general, 4 tr-up, 5 tr-down, 6 tr-nearest */
    int act, layout, bias;
    int special;    /* 1: every token on expert E-1; 2: GENERAL with no pair */
    int64_t M;
    int variant;    /* token rounding: 1 on top of TOPK_SOFTMAX, 2 of
                       SOFTMAX_TOPK without renormalisation */
} fcase;

/* Tolerance of a forward output vs the fp64 reference, per storage dtype.
 * bf16: the inputs are exact (rounded before the reference sees them); the
 * library also rounds H (saved) and its output to bf16. */
static double fwd_tol(smoe_dtype t) {
    return t == SMOE_DTYPE_F64 ? 1e-12 : t == SMOE_DTYPE_F32 ? 2e-5 : 2e-2;
}

static void make_problem(tu_problem *P, const fcase *c, const smoe_layer_desc *D, tu_rng *rng) {
    for (int tries = 0;; tries++) {
        tu_problem_init(P, D, c->T, rng, 1.0, 0.5);
        if (c->special == 1) {
            /* a positive first feature and a router row that loves it */
            for (int64_t t = 0; t < c->T; t++) P->x[t * c->d] = 1.0 + fabs(P->x[t * c->d]);
            for (int64_t e = 0; e < c->E; e++) P->wr[e * c->d] = e == c->E - 1 ? 40.0 : 0.0;
            tu_round_array(D->dtype, P->x, (size_t)(c->T * c->d));
        }
        if (D->routing == SMOE_ROUTING_GENERAL) tu_problem_general(P, rng, c->special == 2 ? 0.0 : 0.4);
        /* bf16 logits carry ~3 significant digits: ask for a wide margin */
        double want = D->dtype == SMOE_DTYPE_BF16 ? 0.05 : 1e-4;
        if (tu_selection_margin(P) > want || tries > 200) break;
        tu_problem_free(P);
    }
    tu_problem_route(P, 0);
}

static void run_case(const fcase *c, smoe_dtype dt, tu_rng *rng) {
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = c->d; D.n = c->n; D.E = c->E; D.K = c->K;
    tu_set_mode(&D, c->mode);
    D.activation = (smoe_activation)c->act;
    D.w1_layout = c->layout ? SMOE_W1_CONCATENATED : SMOE_W1_INTERLEAVED;
    D.has_bias = c->bias;
    D.round_tile = c->M ? c->M : 128;
    if (D.rounding != SMOE_ROUND_OFF && c->variant == 1) {
        D.routing = SMOE_ROUTING_TOPK_SOFTMAX;
        D.renormalize = 0;
    }
    if (D.rounding != SMOE_ROUND_OFF && c->variant == 2) D.renormalize = 0;
    D.dtype = dt;
    D.backend = SMOE_BACKEND_CPU;
    tu_case("forward %s dtype=%d T=%lld d=%lld n=%lld E=%lld K=%lld %s act=%s %s bias=%d", c->name,
            dt, (long long)c->T, (long long)c->d, (long long)c->n, (long long)c->E,
            (long long)c->K, tu_mode_name(&D), tu_act_name(D.activation),
            c->layout ? "concat" : "interleaved", c->bias);
    tu_problem P;
    make_problem(&P, c, &D, rng);
    smoe_layer *L = tu_layer(&D);
    if (!L) { tu_problem_free(&P); return; }
    CHECK(smoe_layer_backend(L) == SMOE_BACKEND_CPU, "backend %d", smoe_layer_backend(L));
    CHECK(strstr(smoe_layer_path_name(L), "cpu") != NULL, "path name \"%s\"", smoe_layer_path_name(L));
    smoe_layer_desc got = smoe_layer_get_desc(L);
    CHECK(memcmp(&got, &D, sizeof D) == 0, "smoe_layer_get_desc differs from the description");
    tu_bufs B;
    tu_bufs_make(&B, &P, L, 0);
    int64_t T = c->T, d = c->d, E = c->E;
    double *ref = tu_alloc_d((size_t)(T * d)), *rlg = tu_alloc_d((size_t)(T * E));
    tu_forward_ref(&P, ref);
    tu_logits(&P, rlg);
    for (int inf = 0; inf < 2; inf++) {
        if (inf && D.rounding != SMOE_ROUND_OFF) {
            /* inference ignores rounding: plain token choice */
            tu_problem_route(&P, 1);
            tu_forward_ref(&P, ref);
        }
        memset(B.out, 0xA5, (size_t)(T * d) * tu_dtype_size(dt));
        smoe_forward_args a = tu_fwd_args(&P, &B, inf);
        smoe_status st = smoe_layer_forward(L, &a, inf ? NULL : B.saved, inf ? 0 : B.saved_bytes, B.ws,
                                            B.ws_bytes, NULL);
        if (!CHECK(st == SMOE_SUCCESS, "forward (inference=%d) -> %s (%s)", inf,
                   smoe_status_string(st), smoe_last_error()))
            continue;
        double *out = tu_from_dtype(dt, B.out, (size_t)(T * d));
        char what[64];
        snprintf(what, sizeof what, "out (inference=%d)", inf);
        CHECK_CLOSE(out, ref, (size_t)(T * d), fwd_tol(dt), what);
        free(out);
        if (D.routing != SMOE_ROUTING_GENERAL) {
            double *lg = tu_from_dtype(SMOE_DTYPE_F32, B.logits, (size_t)(T * E));
            CHECK_CLOSE(lg, rlg, (size_t)(T * E), dt == SMOE_DTYPE_BF16 ? 1e-5 : 1e-6, "router_logits");
            free(lg);
        }
        int ok = 1;
        int64_t *cnt = (int64_t *)calloc((size_t)E, sizeof(int64_t));
        for (int64_t i = 0; i < P.pairs; i++) cnt[P.pe[i]]++;
        for (int64_t e = 0; e < E; e++) ok &= B.counts[e] == cnt[e];
        CHECK(ok, "expert_counts differ from the reference (e0: %d vs %lld)", B.counts[0],
              (long long)cnt[0]);
        free(cnt);
    }
    free(ref); free(rlg);
    tu_bufs_free(&B);
    smoe_layer_free(L);
    tu_problem_free(&P);
}

static const fcase edge_cases[] = {
    /* name             T   d   n  E  K mode act lay bias sp M variant */
    {"T=1",             1,  8,  4, 4, 2, 0, 0, 0, 0, 0, 0, 0},
    {"T=1 general",     1,  8,  4, 4, 0, 3, 1, 0, 1, 0, 0, 0},
    {"K=1",             9,  8,  4, 5, 1, 0, 2, 1, 1, 0, 0, 0},
    {"K=E",             7,  6,  3, 3, 3, 1, 0, 0, 1, 0, 0, 0},
    {"K=E renorm",      7,  6,  3, 3, 3, 2, 3, 0, 0, 0, 0, 0},
    {"E=1",             5,  6,  5, 1, 1, 0, 0, 1, 1, 0, 0, 0},
    {"E=1 softmax",     5,  6,  5, 1, 1, 1, 6, 0, 0, 0, 0, 0},
    {"empty experts",   3,  8,  4, 8, 1, 0, 0, 0, 1, 0, 0, 0},
    {"one expert K=1", 11,  8,  4, 4, 1, 0, 0, 0, 1, 1, 0, 0},
    {"one expert K=2", 11,  8,  4, 4, 2, 2, 1, 1, 0, 1, 0, 0},
    {"d=13 n=7",       10, 13,  7, 5, 2, 0, 0, 0, 1, 0, 0, 0},
    {"d=13 n=7 conc",  10, 13,  7, 5, 2, 1, 1, 1, 0, 0, 0, 0},
    {"d=1 n=1",         6,  1,  1, 3, 2, 0, 0, 0, 1, 0, 0, 0},
    {"general",        12, 10,  6, 5, 0, 3, 0, 0, 1, 0, 0, 0},
    {"general relu2",  12, 10,  6, 5, 0, 3, 3, 0, 0, 0, 0, 0},
    {"general no pair", 4,  6,  3, 3, 0, 3, 0, 0, 1, 2, 0, 0},
    {"tr-up",          20,  8,  4, 4, 2, 4, 0, 0, 1, 0, 4, 0},
    {"tr-down",        20,  8,  4, 4, 2, 5, 1, 1, 0, 0, 4, 0},
    {"tr-nearest",     20,  8,  4, 4, 2, 6, 4, 0, 1, 0, 3, 0},
    {"tr one expert",  10,  8,  4, 4, 1, 4, 0, 0, 0, 1, 4, 0},
    {"tr T=1",          1,  8,  4, 4, 2, 4, 5, 0, 0, 0, 8, 0},
    {"tr M=1",          9,  8,  4, 4, 2, 6, 0, 0, 1, 0, 1, 0},
    {"tr-up M=2^30",    6,  8,  4, 4, 2, 4, 0, 0, 1, 0, (int64_t)1 << 30, 0},
    {"tr-nearest M=2^30", 6, 8, 4, 4, 2, 6, 0, 0, 1, 0, (int64_t)1 << 30, 0},
    {"tr M=128 (default) T<M", 12, 8, 4, 6, 2, 4, 0, 0, 1, 0, 0, 0},
    {"tr-up on topk-softmax", 20, 8, 4, 4, 2, 4, 1, 0, 1, 0, 4, 1},
    {"tr-down on topk-softmax", 20, 8, 4, 4, 2, 5, 0, 1, 0, 0, 3, 1},
    {"tr-up softmax-topk no renorm", 20, 8, 4, 4, 2, 4, 2, 0, 1, 0, 4, 2},
    {"tr-nearest softmax-topk no renorm", 20, 8, 4, 5, 3, 6, 0, 0, 0, 0, 3, 2},
    {"silu",            8,  8,  4, 4, 2, 0, 5, 0, 1, 0, 0, 0},
    {"gelu",            8,  8,  4, 4, 2, 2, 6, 0, 0, 0, 0, 0},
    {"relu",            8,  8,  4, 4, 2, 0, 4, 0, 1, 0, 0, 0},
    {"reglu",           8,  8,  4, 4, 2, 1, 2, 0, 1, 0, 0, 0},
};

static void test_edge_cases(tu_rng *rng) {
    const smoe_dtype dts[3] = {SMOE_DTYPE_F64, SMOE_DTYPE_F32, SMOE_DTYPE_BF16};
    for (size_t i = 0; i < sizeof edge_cases / sizeof edge_cases[0]; i++)
        for (int k = 0; k < 3; k++) run_case(&edge_cases[i], dts[k], rng);
}

static void test_random_shapes(tu_rng *rng) {
    const smoe_dtype dts[3] = {SMOE_DTYPE_F64, SMOE_DTYPE_F32, SMOE_DTYPE_BF16};
    for (int it = 0; it < 45; it++) {
        fcase c;
        memset(&c, 0, sizeof c);
        c.name = "random";
        c.T = tu_int(rng, 1, 40);
        c.d = tu_int(rng, 1, 24);
        c.n = tu_int(rng, 1, 12);
        c.E = tu_int(rng, 1, 9);
        c.K = tu_int(rng, 1, c.E);
        c.mode = (int)tu_int(rng, 0, TU_NMODES - 1);
        c.act = (int)tu_int(rng, 0, 6);
        c.layout = (int)tu_int(rng, 0, 1);
        c.bias = (int)tu_int(rng, 0, 1);
        c.M = tu_int(rng, 1, 8);
        run_case(&c, dts[it % 3], rng);
    }
}

/* Shapes big enough for every parallel loop of the backend to split. */
static void test_large(tu_rng *rng) {
    for (int mode = 0; mode < 7; mode++) {
        fcase c;
        memset(&c, 0, sizeof c);
        c.name = "large";
        c.T = 257; c.d = 72; c.n = 40; c.E = 16; c.K = 4;
        c.mode = mode;
        c.act = mode;
        c.layout = mode % 2;
        c.bias = (mode / 2) % 2;
        c.M = 16;
        run_case(&c, mode % 2 ? SMOE_DTYPE_F32 : SMOE_DTYPE_F64, rng);
    }
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 1234));
    test_edge_cases(&rng);
    test_random_shapes(&rng);
    test_large(&rng);
    return tu_summary("test_forward");
}
