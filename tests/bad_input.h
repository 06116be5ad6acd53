/*
 * bad_input.h -- every bad argument is refused with its status, a message
 * that names the offending argument or value, and no output written. The
 * cases, shared by test_bad_input (the CPU backend, host memory) and
 * tests/gpu/test_bad_input_gpu (the CUDA and SM90 backends, device memory):
 * the includer sets bi_mem (how the backend's memory is allocated, filled
 * and read back) and the layer's description, then calls bi_run_all().
 *
 * Each case starts from a valid call, breaks one thing, fills every output
 * (out, router_logits, expert_counts, saved, gradients) with a byte
 * pattern, makes the call, and checks: the status, that smoe_last_error()
 * contains the expected text, and that every output still holds the
 * pattern. A call the host accepts and the device refuses (the GENERAL
 * triples and the saved block's header on the GPU) returns SMOE_SUCCESS;
 * its status is then smoe_layer_device_status(wait = 1), which on the CPU
 * is always SMOE_SUCCESS, so one check covers both.
 */
#ifndef SMOE_TESTS_BAD_INPUT_H
#define SMOE_TESTS_BAD_INPUT_H

#include "testutil.h"

#include <pthread.h>

#define PAT 0xA5

/* ------------------------------------------------------------ memory */

typedef struct bi_mem {
    const char *name;
    void *(*alloc)(size_t n);
    void (*release)(void *p);
    void (*put)(void *dst, const void *src, size_t n); /* host -> backend */
    void (*get)(void *dst, const void *src, size_t n); /* backend -> host */
    void (*fill)(void *p, int byte, size_t n);
} bi_mem;

static const bi_mem *M;            /* set by the includer */
static smoe_layer_desc bi_base;    /* the layer under test (backend, dtype, sizes) */

static void *bi_upload(const void *h, size_t n) {
    void *p = M->alloc(n ? n : 16);
    if (n) M->put(p, h, n);
    return p;
}

/* ------------------------------------------------------------ outputs */

typedef struct region {
    void *p;
    size_t n;
} region;

static region outs[24];
static int nouts;

static void outs_reset(void) { nouts = 0; }
static void outs_add(void *p, size_t n) {
    if (p && n && nouts < 24) { outs[nouts].p = p; outs[nouts].n = n; nouts++; }
}
static void outs_fill(void) {
    for (int i = 0; i < nouts; i++) M->fill(outs[i].p, PAT, outs[i].n);
}
static int outs_untouched(void) {
    int ok = 1;
    for (int i = 0; i < nouts && ok; i++) {
        unsigned char *h = (unsigned char *)malloc(outs[i].n);
        M->get(h, outs[i].p, outs[i].n);
        for (size_t j = 0; j < outs[i].n && ok; j++) ok = h[j] == PAT;
        free(h);
    }
    return ok;
}

/* The status of a call, device-side checks included. */
static smoe_status settle(smoe_layer *L, smoe_status st) {
    if (st != SMOE_SUCCESS || !L) return st;
    return smoe_layer_device_status(L, NULL, 1);
}

/* Checks one refused call. */
static void expect(smoe_status got, smoe_status want, const char *text) {
    const char *msg = smoe_last_error();
    CHECK(got == want, "status %d (%s), want %d (%s); message \"%s\"", got, smoe_status_string(got),
          want, smoe_status_string(want), msg);
    if (want != SMOE_SUCCESS) CHECK(msg && msg[0], "smoe_last_error() is empty");
    if (text) CHECK(msg && strstr(msg, text), "message \"%s\" does not name \"%s\"", msg, text);
    CHECK(outs_untouched(), "an output was written by a refused call");
}

/* ------------------------------------------------------------ fixture */

/* A problem, its layer, and every buffer of a forward and a backward in the
 * backend's memory. */
typedef struct bi_fix {
    tu_problem P;
    smoe_layer *L;
    int general;
    size_t es;                       /* bytes per element of the layer's dtype */
    void *x, *wr, *w1, *b1, *w2, *b2, *out, *dout;
    float *logits, *ps, *dle;
    int32_t *counts, *pt, *pe;
    void *saved, *ws;
    size_t saved_b, ws_b, ws_fb, ws_bb; /* ws_b: either call's; ws_fb / ws_bb each call's own */
    void *g[TU_NGRAD];               /* F32 gradients */
    size_t gn[TU_NGRAD];             /* bytes */
    float *hps;                      /* host copy of the scores */
    float *eb;                       /* SIGMOID_TOPK's expert bias (E) */
} bi_fix;

static void *put_d(const bi_fix *F, const double *src, size_t n) {
    void *h = tu_to_dtype(F->P.desc.dtype, src, n);
    void *p = bi_upload(h, n * F->es);
    free(h);
    return p;
}

static int fix_make(bi_fix *F, const smoe_layer_desc *D, int64_t T, tu_rng *rng) {
    memset(F, 0, sizeof *F);
    tu_problem_init(&F->P, D, T, rng, 1.0, 0.5);
    F->general = D->routing == SMOE_ROUTING_GENERAL;
    if (F->general) tu_problem_general(&F->P, rng, 0.6);
    F->L = tu_layer(D);
    if (!F->L) {
        tu_problem_free(&F->P);
        return 0;
    }
    const int64_t d = D->d, n = D->n, E = D->E, hc = F->P.hc;
    const int64_t np = F->general ? F->P.pairs : 0;
    F->es = tu_dtype_size(D->dtype);
    F->x = put_d(F, F->P.x, (size_t)(T * d));
    F->wr = put_d(F, F->P.wr, (size_t)(E * d));
    F->w1 = put_d(F, F->P.w1, (size_t)(E * hc * d));
    F->w2 = put_d(F, F->P.w2, (size_t)(E * d * n));
    if (D->has_bias) {
        F->b1 = put_d(F, F->P.b1, (size_t)(E * hc));
        F->b2 = put_d(F, F->P.b2, (size_t)(E * d));
    }
    double *dout = tu_alloc_d((size_t)(T * d));
    tu_fill_normal(rng, dout, (size_t)(T * d), 1.0);
    F->dout = put_d(F, dout, (size_t)(T * d));
    free(dout);
    F->out = M->alloc((size_t)(T * d) * F->es);
    F->logits = (float *)M->alloc((size_t)(T * E) * 4);
    F->dle = (float *)M->alloc((size_t)(T * E) * 4);
    M->fill(F->dle, 0, (size_t)(T * E) * 4);
    F->counts = (int32_t *)M->alloc((size_t)E * 4);
    F->hps = (float *)calloc((size_t)np + 1, sizeof(float));
    for (int64_t i = 0; i < np; i++) F->hps[i] = (float)F->P.ps[i];
    if (F->general) {
        F->pt = (int32_t *)bi_upload(F->P.pt, (size_t)np * 4);
        F->pe = (int32_t *)bi_upload(F->P.pe, (size_t)np * 4);
        F->ps = (float *)bi_upload(F->hps, (size_t)np * 4);
    }
    if (F->P.ebias) {
        float *hb = (float *)malloc((size_t)E * 4);
        for (int64_t e = 0; e < E; e++) hb[e] = (float)F->P.ebias[e];
        F->eb = (float *)bi_upload(hb, (size_t)E * 4);
        free(hb);
    }
    F->saved_b = smoe_layer_saved_bytes(F->L, T, np);
    F->ws_b = smoe_layer_workspace_bytes(F->L, T, np);
    F->ws_fb = smoe_layer_call_workspace_bytes(F->L, SMOE_CALL_FORWARD, T, np);
    F->ws_bb = smoe_layer_call_workspace_bytes(F->L, SMOE_CALL_BACKWARD, T, np);
    F->saved = M->alloc(F->saved_b);
    F->ws = M->alloc(F->ws_b);
    const size_t ge[TU_NGRAD] = {(size_t)(T * d), F->general ? 0 : (size_t)(E * d),
                                 (size_t)(E * hc * d), D->has_bias ? (size_t)(E * hc) : 0,
                                 (size_t)(E * d * n), D->has_bias ? (size_t)(E * d) : 0,
                                 (size_t)np};
    for (int i = 0; i < TU_NGRAD; i++) {
        F->gn[i] = ge[i] * 4;
        F->g[i] = F->gn[i] ? M->alloc(F->gn[i]) : NULL;
    }
    return 1;
}

static void fix_free(bi_fix *F) {
    void *bufs[] = {F->x, F->wr, F->w1, F->b1, F->w2, F->b2, F->out, F->dout, F->logits, F->ps,
                    F->dle, F->counts, F->pt, F->pe, F->saved, F->ws, F->eb};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) M->release(bufs[i]);
    for (int i = 0; i < TU_NGRAD; i++)
        if (F->g[i]) M->release(F->g[i]);
    free(F->hps);
    smoe_layer_free(F->L);
    tu_problem_free(&F->P);
    memset(F, 0, sizeof *F);
}

static smoe_forward_args fix_fwd(const bi_fix *F) {
    smoe_forward_args a;
    memset(&a, 0, sizeof a);
    a.T = F->P.T;
    a.x = F->x;
    if (F->general) {
        a.pairs = F->P.pairs;
        a.pair_token = F->pt;
        a.pair_expert = F->pe;
        a.pair_score = F->ps;
    } else {
        a.router_w = F->wr;
        a.router_logits = F->logits;
    }
    a.w1 = F->w1; a.b1 = F->b1; a.w2 = F->w2; a.b2 = F->b2;
    a.out = F->out;
    a.expert_counts = F->counts;
    a.expert_bias = F->eb;
    return a;
}

static smoe_backward_args fix_bwd(const bi_fix *F) {
    smoe_backward_args b;
    memset(&b, 0, sizeof b);
    b.T = F->P.T;
    b.x = F->x;
    b.router_w = F->general ? NULL : F->wr;
    b.pairs = F->general ? F->P.pairs : 0;
    b.w1 = F->w1; b.w2 = F->w2; b.b2 = F->b2;
    b.dout = F->dout;
    smoe_grad *slot[TU_NGRAD] = {&b.dx, &b.drouter_w, &b.dw1, &b.db1, &b.dw2, &b.db2, &b.dpair_score};
    for (int i = 0; i < TU_NGRAD; i++) {
        slot[i]->ptr = F->g[i];
        slot[i]->dtype = SMOE_DTYPE_F32;
    }
    return b;
}

/* The forward's outputs, filled with the pattern. skip_header: a forward
 * refused on the device writes the saved block's header (it records the
 * failure), nothing else. */
static void fwd_outs(const bi_fix *F, int skip_header) {
    const smoe_layer_desc *D = &F->P.desc;
    outs_reset();
    outs_add(F->out, (size_t)(F->P.T * D->d) * F->es);
    if (!F->general) outs_add(F->logits, (size_t)(F->P.T * D->E) * 4);
    outs_add(F->counts, (size_t)D->E * 4);
    if (skip_header) outs_add((char *)F->saved + 256, F->saved_b - 256);
    else outs_add(F->saved, F->saved_b);
    outs_fill();
}

static void bwd_outs(const bi_fix *F) {
    outs_reset();
    for (int i = 0; i < TU_NGRAD; i++) outs_add(F->g[i], F->gn[i]);
    outs_fill();
}

static smoe_status fwd_call(bi_fix *F, const smoe_forward_args *a) {
    return settle(F->L, smoe_layer_forward(F->L, a, F->saved, F->saved_b, F->ws, F->ws_b, NULL));
}

static smoe_status bwd_call(bi_fix *F, const smoe_backward_args *b) {
    return settle(F->L, smoe_layer_backward(F->L, b, F->saved, F->saved_b, F->ws, F->ws_b, NULL));
}

/* ------------------------------------------------------------ create */

static smoe_layer_desc good_desc(void) { return bi_base; }

static void create_case(const char *name, smoe_layer_desc D, smoe_status want, const char *text) {
    tu_case("create: %s", name);
    outs_reset();
    smoe_layer *L = NULL;
    smoe_status st = smoe_layer_create(&D, &L);
    expect(st, want, text);
    CHECK(L == NULL, "a layer was returned");
    if (st == SMOE_SUCCESS) smoe_layer_free(L);
}

/* Defaults, version and status strings: what smoe.h says they are. */
static void test_basics(void) {
    tu_case("smoe_layer_desc_default");
    smoe_layer_desc D = smoe_layer_desc_default();
    CHECK(D.d == 0 && D.n == 0 && D.E == 0 && D.K == 0, "sizes not 0");
    CHECK(D.activation == SMOE_ACT_SWIGLU && D.w1_layout == SMOE_W1_INTERLEAVED && D.has_bias == 0,
          "activation %d layout %d bias %d", D.activation, D.w1_layout, D.has_bias);
    CHECK(D.routing == SMOE_ROUTING_TOPK_SOFTMAX && D.renormalize == 0 &&
              D.rounding == SMOE_ROUND_OFF && D.round_tile == 128,
          "routing %d renormalize %d rounding %d M %lld", D.routing, D.renormalize, D.rounding,
          (long long)D.round_tile);
    CHECK(D.dtype == SMOE_DTYPE_BF16 && D.backend == SMOE_BACKEND_AUTO && D.device == 0,
          "dtype %d backend %d device %d", D.dtype, D.backend, D.device);
    tu_case("version and status strings");
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", SMOE_VERSION_MAJOR, SMOE_VERSION_MINOR, SMOE_VERSION_PATCH);
    CHECK(strcmp(smoe_version_string(), want) == 0, "version \"%s\" want \"%s\"",
          smoe_version_string(), want);
    for (int a = 0; a <= SMOE_ERROR_INTERNAL; a++) {
        const char *sa = smoe_status_string((smoe_status)a);
        CHECK(sa && sa[0], "status %d has no string", a);
        for (int b = 0; b < a; b++)
            CHECK(strcmp(sa, smoe_status_string((smoe_status)b)) != 0, "statuses %d and %d read alike", a, b);
    }
    CHECK(smoe_status_string((smoe_status)99) != NULL, "status 99 gives NULL");
    tu_case("device status with nothing recorded");
    D = good_desc();
    smoe_layer *L = NULL;
    CHECK_OK(smoe_layer_create(&D, &L));
    if (L) {
        CHECK_OK(smoe_layer_device_status(L, NULL, 1));
        CHECK_OK(smoe_layer_device_status(L, NULL, 0));
        outs_reset();
        expect(smoe_layer_device_status(L, NULL, 2), SMOE_ERROR_INVALID_VALUE, "wait");
        smoe_layer_free(L);
    }
    outs_reset();
    expect(smoe_layer_device_status(NULL, NULL, 1), SMOE_ERROR_NULL_POINTER, "layer");
}

/* A valid SIGMOID_TOPK description: 2 groups, 1 kept, renormalised,
 * scaled. */
static smoe_layer_desc sig_good(void) {
    smoe_layer_desc D = good_desc();
    D.routing = SMOE_ROUTING_SIGMOID_TOPK;
    D.renormalize = 1;
    D.n_group = 2;
    D.topk_group = 1;
    D.routed_scaling = 2.5;
    return D;
}

static void test_create(void) {
    smoe_layer_desc D;
    tu_case("create: NULL desc");
    outs_reset();
    smoe_layer *L = NULL;
    expect(smoe_layer_create(NULL, &L), SMOE_ERROR_NULL_POINTER, "desc");
    CHECK(L == NULL, "a layer was returned");
    tu_case("create: NULL out");
    D = good_desc();
    expect(smoe_layer_create(&D, NULL), SMOE_ERROR_NULL_POINTER, "out");

    D = good_desc(); D.d = -3;  create_case("d=-3", D, SMOE_ERROR_INVALID_SIZE, "-3");
    D = good_desc(); D.d = 0;   create_case("d=0", D, SMOE_ERROR_INVALID_SIZE, "d");
    D = good_desc(); D.n = -7;  create_case("n=-7", D, SMOE_ERROR_INVALID_SIZE, "-7");
    D = good_desc(); D.E = 0;   create_case("E=0", D, SMOE_ERROR_INVALID_SIZE, "E");
    D = good_desc(); D.E = -2;  create_case("E=-2", D, SMOE_ERROR_INVALID_SIZE, "-2");
    D = good_desc(); D.E = 65537;
    create_case("E=65537 (16-bit experts)", D, SMOE_ERROR_INVALID_SIZE, "65536");
    D = good_desc(); D.K = 0;   create_case("K=0", D, SMOE_ERROR_INVALID_SIZE, "K");
    D = good_desc(); D.K = 9;   create_case("K=9 > E=4", D, SMOE_ERROR_INVALID_SIZE, "9");
    D = good_desc(); D.K = -1;  create_case("K=-1", D, SMOE_ERROR_INVALID_SIZE, "-1");
    D = good_desc(); D.activation = (smoe_activation)42;
    create_case("activation 42", D, SMOE_ERROR_INVALID_VALUE, "42");
    D = good_desc(); D.activation = (smoe_activation)-1;
    create_case("activation -1", D, SMOE_ERROR_INVALID_VALUE, "-1");
    D = good_desc(); D.w1_layout = (smoe_w1_layout)5;
    create_case("w1_layout 5", D, SMOE_ERROR_INVALID_VALUE, "5");
    D = good_desc(); D.routing = (smoe_routing)7;
    create_case("routing 7", D, SMOE_ERROR_INVALID_VALUE, "7");
    D = good_desc(); D.rounding = (smoe_rounding)9;
    create_case("rounding 9", D, SMOE_ERROR_INVALID_VALUE, "9");
    D = good_desc(); D.dtype = (smoe_dtype)11;
    create_case("dtype 11", D, SMOE_ERROR_INVALID_VALUE, "11");
    D = good_desc(); D.backend = (smoe_backend)13;
    create_case("backend 13", D, SMOE_ERROR_INVALID_VALUE, "13");
    D = good_desc(); D.has_bias = 2;
    create_case("has_bias 2", D, SMOE_ERROR_INVALID_VALUE, "2");
    D = good_desc(); D.renormalize = 3;
    create_case("renormalize 3", D, SMOE_ERROR_INVALID_VALUE, "3");
    D = good_desc(); D.rounding = SMOE_ROUND_UP; D.round_tile = -4;
    create_case("round_tile -4", D, SMOE_ERROR_INVALID_SIZE, "-4");
    D = good_desc(); D.routing = SMOE_ROUTING_GENERAL; D.rounding = SMOE_ROUND_UP;
    create_case("rounding on GENERAL", D, SMOE_ERROR_INVALID_VALUE, "GENERAL");
    D = good_desc(); D.dtype = SMOE_DTYPE_F64; D.backend = SMOE_BACKEND_CUDA;
    create_case("F64 on CUDA", D, SMOE_ERROR_UNSUPPORTED, "F64");
    D = good_desc(); D.dtype = SMOE_DTYPE_F64; D.backend = SMOE_BACKEND_SM90;
    create_case("F64 on SM90", D, SMOE_ERROR_UNSUPPORTED, "F64");
    D = good_desc(); D.device = -1;
    create_case("device -1", D, SMOE_ERROR_INVALID_VALUE, "-1");
    /* SIGMOID_TOPK's fields (E = 4, K = 2 here) */
    const smoe_layer_desc S = sig_good();
    D = S; D.n_group = 3; D.topk_group = 1;
    create_case("n_group 3 does not divide E 4", D, SMOE_ERROR_INVALID_SIZE, "n_group = 3");
    D = S; D.n_group = 4; D.topk_group = 2;
    create_case("n_group = E: groups of 1", D, SMOE_ERROR_INVALID_SIZE, "n_group = 4");
    D = S; D.topk_group = 3;
    create_case("topk_group 3 > n_group 2", D, SMOE_ERROR_INVALID_SIZE, "topk_group = 3");
    D = S; D.K = 3; D.topk_group = 1;
    create_case("topk_group * E/n_group = 2 < K = 3", D, SMOE_ERROR_INVALID_SIZE, "K = 3");
    D = S; D.topk_group = 0;
    create_case("n_group without topk_group", D, SMOE_ERROR_INVALID_VALUE, "topk_group = 0");
    D = S; D.n_group = 0;
    create_case("topk_group without n_group", D, SMOE_ERROR_INVALID_VALUE, "n_group = 0");
    D = S; D.n_group = -2;
    create_case("n_group -2", D, SMOE_ERROR_INVALID_SIZE, "-2");
    D = S; D.routed_scaling = NAN;
    create_case("routed_scaling NaN", D, SMOE_ERROR_INVALID_VALUE, "routed_scaling");
    D = S; D.routed_scaling = INFINITY;
    create_case("routed_scaling inf", D, SMOE_ERROR_INVALID_VALUE, "routed_scaling = inf");
    D = S; D.routed_scaling = 0.0;
    create_case("routed_scaling 0 (a zeroed desc)", D, SMOE_ERROR_INVALID_VALUE,
                "routed_scaling = 0");
    D = S; D.routed_scaling = -1.5;
    create_case("routed_scaling -1.5", D, SMOE_ERROR_INVALID_VALUE, "-1.5");
    D = good_desc(); D.routed_scaling = 2.5;
    create_case("routed_scaling on TOPK_SOFTMAX", D, SMOE_ERROR_INVALID_VALUE, "2.5");
    D = good_desc(); D.routing = SMOE_ROUTING_SOFTMAX_TOPK; D.n_group = 2; D.topk_group = 1;
    create_case("groups on SOFTMAX_TOPK", D, SMOE_ERROR_INVALID_VALUE, "SIGMOID_TOPK");
    D = good_desc(); D.routing = SMOE_ROUTING_GENERAL; D.n_group = 2; D.topk_group = 1;
    create_case("groups on GENERAL", D, SMOE_ERROR_INVALID_VALUE, "n_group = 2");
    D = S; D.rounding = SMOE_ROUND_UP;
    create_case("token rounding on SIGMOID_TOPK", D, SMOE_ERROR_INVALID_VALUE, "softmax");
    /* sizes whose products overflow: refused, not wrapped */
    D = good_desc(); D.d = (int64_t)1 << 40; D.n = (int64_t)1 << 40;
    create_case("d = n = 2^40", D, SMOE_ERROR_INVALID_SIZE, NULL);
    D = good_desc(); D.E = (int64_t)1 << 33; D.K = 2;
    create_case("E = 2^33", D, SMOE_ERROR_INVALID_SIZE, "8589934592");

    /* valid corner descriptions are accepted */
    tu_case("create: F64 with AUTO runs on the CPU");
    D = good_desc(); D.dtype = SMOE_DTYPE_F64; D.backend = SMOE_BACKEND_AUTO;
    L = NULL;
    CHECK_OK(smoe_layer_create(&D, &L));
    CHECK(L && smoe_layer_backend(L) == SMOE_BACKEND_CPU, "backend %d", smoe_layer_backend(L));
    smoe_layer_free(L);
    smoe_layer_free(NULL); /* NULL is fine */

    tu_case("sizes: bad T");
    D = good_desc();
    L = NULL;
    CHECK_OK(smoe_layer_create(&D, &L));
    if (L) {
        CHECK(smoe_layer_saved_bytes(L, 0, 0) == 0 && smoe_last_error()[0], "saved_bytes(T=0)");
        CHECK(smoe_layer_saved_bytes(L, -6, 0) == 0 && strstr(smoe_last_error(), "-6"),
              "saved_bytes(T=-6): \"%s\"", smoe_last_error());
        CHECK(smoe_layer_workspace_bytes(L, -6, 0) == 0 && strstr(smoe_last_error(), "-6"),
              "workspace_bytes(T=-6): \"%s\"", smoe_last_error());
        CHECK(smoe_layer_saved_bytes(L, INT64_MAX / 2, 0) == 0 && smoe_last_error()[0],
              "saved_bytes(T = 2^62) must refuse, not wrap");
        CHECK(smoe_layer_workspace_bytes(L, INT64_MAX / 2, 0) == 0 && smoe_last_error()[0],
              "workspace_bytes(T = 2^62) must refuse, not wrap");
        smoe_layer_free(L);
    }
    CHECK(smoe_layer_saved_bytes(NULL, 4, 0) == 0 && smoe_last_error()[0], "saved_bytes(NULL)");
    CHECK(smoe_layer_workspace_bytes(NULL, 4, 0) == 0 && smoe_last_error()[0], "workspace_bytes(NULL)");
    CHECK(smoe_layer_call_workspace_bytes(NULL, SMOE_CALL_BACKWARD, 4, 0) == 0 &&
              smoe_last_error()[0],
          "call_workspace_bytes(NULL)");
    {
        smoe_backward_args b;
        memset(&b, 0, sizeof b);
        b.T = 4;
        CHECK(smoe_layer_backward_workspace_bytes(NULL, &b) == 0 &&
                  strstr(smoe_last_error(), "layer"),
              "backward_workspace_bytes(NULL, args): \"%s\"", smoe_last_error());
        D = good_desc();
        L = NULL;
        CHECK_OK(smoe_layer_create(&D, &L));
        if (L) {
            CHECK(smoe_layer_backward_workspace_bytes(L, NULL) == 0 &&
                      strstr(smoe_last_error(), "args"),
                  "backward_workspace_bytes(layer, NULL): \"%s\"", smoe_last_error());
            b.T = -6;
            CHECK(smoe_layer_backward_workspace_bytes(L, &b) == 0 &&
                      strstr(smoe_last_error(), "-6"),
                  "backward_workspace_bytes(T=-6): \"%s\"", smoe_last_error());
            b.T = INT64_MAX / 2;
            CHECK(smoe_layer_backward_workspace_bytes(L, &b) == 0 && smoe_last_error()[0],
                  "backward_workspace_bytes(T = 2^62) must refuse, not wrap");
            smoe_layer_free(L);
        }
    }

    tu_case("sizes: the router slot's query");
    {
        size_t off = 5;
        smoe_status st = smoe_layer_drouter_slot(NULL, 4, 0, &off);
        CHECK(st == SMOE_ERROR_NULL_POINTER && off == 5 && strstr(smoe_last_error(), "layer"),
              "drouter_slot(NULL) -> %s: \"%s\"", smoe_status_string(st), smoe_last_error());
        D = good_desc();
        D.consume_saved = 1;
        L = NULL;
        CHECK_OK(smoe_layer_create(&D, &L));
        if (L) {
            st = smoe_layer_drouter_slot(L, 4, 0, NULL);
            CHECK(st == SMOE_ERROR_NULL_POINTER && strstr(smoe_last_error(), "offset"),
                  "drouter_slot(offset NULL) -> %s: \"%s\"", smoe_status_string(st),
                  smoe_last_error());
            st = smoe_layer_drouter_slot(L, -6, 0, &off);
            CHECK(st == SMOE_ERROR_INVALID_SIZE && off == 5 && strstr(smoe_last_error(), "-6"),
                  "drouter_slot(T=-6) -> %s: \"%s\"", smoe_status_string(st),
                  smoe_last_error());
            st = smoe_layer_drouter_slot(L, INT64_MAX / 2, 0, &off);
            CHECK(st == SMOE_ERROR_INVALID_SIZE && off == 5,
                  "drouter_slot(T = 2^62) -> %s, must refuse, not wrap", smoe_status_string(st));
            smoe_layer_free(L);
        }
    }

    tu_case("sizes: each call's workspace");
    D = good_desc();
    L = NULL;
    CHECK_OK(smoe_layer_create(&D, &L));
    if (L) {
        for (int64_t T = 1; T <= 4096; T *= 8) {
            const size_t any = smoe_layer_workspace_bytes(L, T, 0);
            const size_t f = smoe_layer_call_workspace_bytes(L, SMOE_CALL_FORWARD, T, 0);
            const size_t b = smoe_layer_call_workspace_bytes(L, SMOE_CALL_BACKWARD, T, 0);
            CHECK(f > 0 && b > 0 && any == (f > b ? f : b) &&
                      smoe_layer_call_workspace_bytes(L, SMOE_CALL_ANY, T, 0) == any,
                  "T = %lld: any %zu, forward %zu, backward %zu", (long long)T, any, f, b);
        }
        /* a backward's own size: SMOE_CALL_BACKWARD's without dw1 or with
         * it accumulated; at most that with dw1 overwritten (the query reads
         * no buffer: any non-NULL pointer will do) */
        static char dummy[16];
        for (int64_t T = 1; T <= 4096; T *= 8) {
            const size_t b = smoe_layer_call_workspace_bytes(L, SMOE_CALL_BACKWARD, T, 0);
            smoe_backward_args a;
            memset(&a, 0, sizeof a);
            a.T = T;
            const size_t none = smoe_layer_backward_workspace_bytes(L, &a);
            a.dw1.ptr = dummy;
            a.dw1.dtype = D.dtype;
            const size_t own = smoe_layer_backward_workspace_bytes(L, &a);
            a.dw1.accumulate = 1;
            const size_t acc = smoe_layer_backward_workspace_bytes(L, &a);
            CHECK(none == b && acc == b && own > 0 && own <= b,
                  "T = %lld: SMOE_CALL_BACKWARD %zu; own: no dw1 %zu, dw1 %zu, accumulated %zu",
                  (long long)T, b, none, own, acc);
        }
        const int bad_call[3] = {3, -1, 1 << 20};
        for (int i = 0; i < 3; i++)
            CHECK(smoe_layer_call_workspace_bytes(L, (smoe_call)bad_call[i], 4, 0) == 0 &&
                      strstr(smoe_last_error(), "call ="),
                  "call %d: \"%s\"", bad_call[i], smoe_last_error());
        CHECK(smoe_layer_call_workspace_bytes(L, SMOE_CALL_FORWARD, -6, 0) == 0 &&
                  strstr(smoe_last_error(), "-6"),
              "call_workspace_bytes(T=-6): \"%s\"", smoe_last_error());
        smoe_layer_free(L);
    }
}

/* ------------------------------------------------------------ forward */

/* One forward case: the call with args `a` (and the given saved /
 * workspace buffers and sizes). */
static void fwd_case_buf(bi_fix *F, const char *name, smoe_forward_args a, void *saved,
                         size_t saved_b, void *ws, size_t ws_b, smoe_status want, const char *text) {
    tu_case("%s forward %s: %s", M->name, tu_mode_name(&F->P.desc), name);
    fwd_outs(F, 0);
    expect(settle(F->L, smoe_layer_forward(F->L, &a, saved, saved_b, ws, ws_b, NULL)), want, text);
}

static void fwd_case(bi_fix *F, const char *name, smoe_forward_args a, smoe_status want,
                     const char *text) {
    fwd_case_buf(F, name, a, F->saved, F->saved_b, F->ws, F->ws_b, want, text);
}

/* A GENERAL case the GPU refuses on the device: its saved header records the
 * failure, the rest of every output is untouched. */
static void fwd_case_triples(bi_fix *F, const char *name, const int32_t *pt, const int32_t *pe,
                             const float *ps, int64_t np, const char *text) {
    tu_case("%s forward %s: %s", M->name, tu_mode_name(&F->P.desc), name);
    M->put(F->pt, pt, (size_t)np * 4);
    M->put(F->pe, pe, (size_t)np * 4);
    M->put(F->ps, ps, (size_t)np * 4);
    fwd_outs(F, 1);
    smoe_forward_args a = fix_fwd(F);
    expect(fwd_call(F, &a), SMOE_ERROR_INVALID_VALUE, text);
}

static char *off(const void *p, size_t bytes) { return (char *)p + bytes; }

/* Every pointer argument of a forward, by name, and the byte offset that
 * breaks its alignment (1 byte: the element's; the layer's vector alignment
 * on the GPU: 2 bytes for a bf16 tensor). */
static void fwd_misaligned(bi_fix *F, smoe_forward_args g, size_t step) {
    char name[96];
#define MIS(field, label)                                                                     \
    do {                                                                                      \
        if (!g.field) break;                                                                  \
        smoe_forward_args a_ = g;                                                             \
        a_.field = (__typeof__(a_.field))off(g.field, step);                                  \
        snprintf(name, sizeof name, "%s misaligned by %zu", label, step);                     \
        fwd_case(F, name, a_, SMOE_ERROR_INVALID_SIZE, label);                                \
    } while (0)
    MIS(x, "args.x");
    MIS(router_w, "args.router_w");
    MIS(w1, "args.w1");
    MIS(b1, "args.b1");
    MIS(w2, "args.w2");
    MIS(b2, "args.b2");
    MIS(out, "args.out");
    if (step % 4) {
        MIS(router_logits, "args.router_logits");
        MIS(expert_counts, "args.expert_counts");
        MIS(pair_token, "args.pair_token");
        MIS(pair_expert, "args.pair_expert");
        MIS(pair_score, "args.pair_score");
    }
#undef MIS
    /* (the sizes claim 8 bytes past the buffers: refused before any access) */
    fwd_case_buf(F, "saved misaligned", g, off(F->saved, 8), F->saved_b, F->ws, F->ws_b,
                 SMOE_ERROR_INVALID_SIZE, "saved");
    fwd_case_buf(F, "workspace misaligned", g, F->saved, F->saved_b, off(F->ws, 8), F->ws_b,
                 SMOE_ERROR_INVALID_SIZE, "workspace");
}

static void test_forward_args(tu_rng *rng) {
    for (int general = 0; general < 2; general++) {
        smoe_layer_desc D = good_desc();
        D.has_bias = 1;
        if (general) D.routing = SMOE_ROUTING_GENERAL;
        bi_fix F;
        if (!fix_make(&F, &D, 5, rng)) continue;
        const smoe_forward_args g = fix_fwd(&F);
        smoe_forward_args a;
        tu_case("%s forward %s: valid call", M->name, tu_mode_name(&D));
        CHECK_OK(fwd_call(&F, &g));

        tu_case("forward: NULL layer");
        fwd_outs(&F, 0);
        expect(smoe_layer_forward(NULL, &g, F.saved, F.saved_b, F.ws, F.ws_b, NULL),
               SMOE_ERROR_NULL_POINTER, "layer");
        tu_case("forward: NULL args");
        fwd_outs(&F, 0);
        expect(smoe_layer_forward(F.L, NULL, F.saved, F.saved_b, F.ws, F.ws_b, NULL),
               SMOE_ERROR_NULL_POINTER, "args");
        a = g; a.T = 0;     fwd_case(&F, "T=0", a, SMOE_ERROR_INVALID_SIZE, "T");
        a = g; a.T = -5;    fwd_case(&F, "T=-5", a, SMOE_ERROR_INVALID_SIZE, "-5");
        a = g; a.x = NULL;  fwd_case(&F, "x NULL", a, SMOE_ERROR_NULL_POINTER, "x");
        a = g; a.w1 = NULL; fwd_case(&F, "w1 NULL", a, SMOE_ERROR_NULL_POINTER, "w1");
        a = g; a.w2 = NULL; fwd_case(&F, "w2 NULL", a, SMOE_ERROR_NULL_POINTER, "w2");
        a = g; a.b1 = NULL; fwd_case(&F, "b1 NULL with bias", a, SMOE_ERROR_NULL_POINTER, "b1");
        a = g; a.b2 = NULL; fwd_case(&F, "b2 NULL with bias", a, SMOE_ERROR_NULL_POINTER, "b2");
        a = g; a.out = NULL; fwd_case(&F, "out NULL", a, SMOE_ERROR_NULL_POINTER, "out");
        fwd_case_buf(&F, "saved NULL (training)", g, NULL, F.saved_b, F.ws, F.ws_b,
                     SMOE_ERROR_NULL_POINTER, "saved");
        fwd_case_buf(&F, "workspace NULL", g, F.saved, F.saved_b, NULL, F.ws_b,
                     SMOE_ERROR_NULL_POINTER, "workspace");
        a = g; a.inference = 2; fwd_case(&F, "inference=2", a, SMOE_ERROR_INVALID_VALUE, "2");

        /* buffer sizes */
        fwd_case_buf(&F, "saved_bytes one short", g, F.saved, F.saved_b - 1, F.ws, F.ws_b,
                     SMOE_ERROR_INVALID_SIZE, "saved_bytes");
        fwd_case_buf(&F, "saved_bytes 0", g, F.saved, 0, F.ws, F.ws_b, SMOE_ERROR_INVALID_SIZE,
                     "saved_bytes = 0");
        fwd_case_buf(&F, "workspace_bytes one short", g, F.saved, F.saved_b, F.ws, F.ws_fb - 1,
                     SMOE_ERROR_INVALID_SIZE, "SMOE_CALL_FORWARD");
        a = g; a.inference = 1;
        fwd_case_buf(&F, "inference, workspace_bytes 1", a, NULL, 0, F.ws, 1,
                     SMOE_ERROR_INVALID_SIZE, "workspace_bytes = 1");

        /* alignment: the element's, and the GPU's 16-byte vectors */
        fwd_misaligned(&F, g, 1);
        if (F.es < 16 && D.backend != SMOE_BACKEND_CPU) fwd_misaligned(&F, g, F.es);

        /* overlap: outputs against inputs, each other, saved and workspace */
        a = g; a.out = F.x;
        fwd_case(&F, "out is x", a, SMOE_ERROR_INVALID_VALUE, "overlaps");
        a = g; a.out = off(F.w1, 16 * F.es);
        fwd_case(&F, "out inside w1", a, SMOE_ERROR_INVALID_VALUE, "args.out");
        a = g; a.expert_counts = (int32_t *)F.out;
        fwd_case(&F, "expert_counts inside out", a, SMOE_ERROR_INVALID_VALUE, "expert_counts");
        a = g; a.expert_counts = (int32_t *)off(F.saved, 512);
        fwd_case(&F, "expert_counts inside saved", a, SMOE_ERROR_INVALID_VALUE, "saved");
        fwd_case_buf(&F, "saved overlaps workspace", g, F.ws, F.saved_b, off(F.ws, 256), F.ws_b,
                     SMOE_ERROR_INVALID_VALUE, "overlaps");
        fwd_case_buf(&F, "workspace is x", g, F.saved, F.saved_b, F.x, F.ws_b,
                     SMOE_ERROR_INVALID_VALUE, "workspace");
        if (!general) {
            a = g; a.router_logits = (float *)F.out;
            fwd_case(&F, "router_logits is out", a, SMOE_ERROR_INVALID_VALUE, "router_logits");
            a = g; a.router_w = NULL;
            fwd_case(&F, "router_w NULL", a, SMOE_ERROR_NULL_POINTER, "router_w");
            /* inputs may overlap each other: router_w inside w1 is fine */
            tu_case("%s forward %s: router_w inside w1 (inputs may overlap)", M->name,
                    tu_mode_name(&D));
            a = g; a.router_w = F.w1;
            outs_reset();
            CHECK_OK(fwd_call(&F, &a));
        } else {
            int64_t np = F.P.pairs;
            int32_t *pt = (int32_t *)malloc((size_t)np * 4), *pe = (int32_t *)malloc((size_t)np * 4);
            float *ps = (float *)malloc((size_t)np * 4);
#define RESET_TRIPLES()                                  \
    memcpy(pt, F.P.pt, (size_t)np * 4);                  \
    memcpy(pe, F.P.pe, (size_t)np * 4);                  \
    memcpy(ps, F.hps, (size_t)np * 4)
            if (!CHECK(np >= 4, "want at least 4 GENERAL pairs, got %lld", (long long)np)) np = 0;
            if (np >= 4) {
                RESET_TRIPLES(); pt[np - 1] = 5; /* T = 5 */
                fwd_case_triples(&F, "pair_token = T", pt, pe, ps, np, "= 5, must be in [0, T = 5)");
                RESET_TRIPLES(); pt[0] = -1;
                fwd_case_triples(&F, "pair_token = -1", pt, pe, ps, np, "pair_token[0] = -1");
                RESET_TRIPLES(); pe[1] = (int32_t)D.E;
                fwd_case_triples(&F, "pair_expert = E", pt, pe, ps, np, "pair_expert[1]");
                RESET_TRIPLES(); pe[2] = -3;
                fwd_case_triples(&F, "pair_expert = -3", pt, pe, ps, np, "pair_expert[2] = -3");
                /* unsorted: swap the first and last tokens (they differ) */
                RESET_TRIPLES(); { int32_t t0 = pt[0]; pt[0] = pt[np - 1]; pt[np - 1] = t0; }
                if (pt[0] != pt[np - 1])
                    fwd_case_triples(&F, "pair_token unsorted", pt, pe, ps, np, "sorted");
                /* a duplicate (token, expert) within one token's run */
                RESET_TRIPLES();
                int64_t dup = -1;
                for (int64_t i = 0; i + 1 < np; i++)
                    if (pt[i] == pt[i + 1]) { dup = i; break; }
                if (dup >= 0) {
                    pe[dup + 1] = pe[dup];
                    fwd_case_triples(&F, "duplicate pair", pt, pe, ps, np, "twice");
                }
                RESET_TRIPLES(); ps[1] = NAN;
                fwd_case_triples(&F, "pair_score NaN", pt, pe, ps, np, "pair_score[1]");
                RESET_TRIPLES(); ps[2] = INFINITY;
                fwd_case_triples(&F, "pair_score +inf", pt, pe, ps, np, "pair_score[2] = inf");
                RESET_TRIPLES(); ps[3] = -INFINITY;
                fwd_case_triples(&F, "pair_score -inf", pt, pe, ps, np, "pair_score[3] = -inf");
                /* a backward on the block of a forward the device refused */
                if (D.backend != SMOE_BACKEND_CPU) {
                    RESET_TRIPLES(); pe[0] = -9;
                    fwd_case_triples(&F, "bad triple, then backward", pt, pe, ps, np, "-9");
                    tu_case("%s backward %s: the saved block of a refused forward", M->name,
                            tu_mode_name(&D));
                    smoe_backward_args b = fix_bwd(&F);
                    bwd_outs(&F);
                    expect(bwd_call(&F, &b), SMOE_ERROR_INVALID_VALUE, "failed a device-side check");
                }
                RESET_TRIPLES();
                M->put(F.pt, pt, (size_t)np * 4);
                M->put(F.pe, pe, (size_t)np * 4);
                M->put(F.ps, ps, (size_t)np * 4);
                tu_case("%s forward %s: valid again after the refusals", M->name, tu_mode_name(&D));
                CHECK_OK(fwd_call(&F, &g));
                a = g; a.pair_token = NULL;
                fwd_case(&F, "pair_token NULL", a, SMOE_ERROR_NULL_POINTER, "pair_token");
                a = g; a.pair_score = NULL;
                fwd_case(&F, "pair_score NULL", a, SMOE_ERROR_NULL_POINTER, "pair_score");
                a = g; a.pairs = -1;
                fwd_case(&F, "pairs=-1", a, SMOE_ERROR_INVALID_SIZE, "-1");
                a = g; a.pairs = 5 * D.E + 1; /* > T*E */
                {
                    char want[32];
                    snprintf(want, sizeof want, "%lld", (long long)a.pairs);
                    fwd_case(&F, "pairs > T*E", a, SMOE_ERROR_INVALID_SIZE, want);
                    tu_case("sizes: GENERAL pairs > T*E");
                    CHECK(smoe_layer_saved_bytes(F.L, 5, a.pairs) == 0 &&
                              strstr(smoe_last_error(), want),
                          "saved_bytes(pairs > T*E) \"%s\"", smoe_last_error());
                    CHECK(smoe_layer_saved_bytes(F.L, 5, -1) == 0, "saved_bytes(pairs = -1)");
                }
            }
            free(pt); free(pe); free(ps);
#undef RESET_TRIPLES
        }
        fix_free(&F);
    }
}

/* Biases given to a layer without them, logits asked of GENERAL routing. */
static void test_forward_extra(tu_rng *rng) {
    smoe_layer_desc D = good_desc();
    bi_fix F;
    if (!fix_make(&F, &D, 4, rng)) return;
    smoe_forward_args g = fix_fwd(&F), a;
    a = g; a.b1 = F.w1; fwd_case(&F, "b1 given, no bias", a, SMOE_ERROR_INVALID_VALUE, "b1");
    a = g; a.b2 = F.w2; fwd_case(&F, "b2 given, no bias", a, SMOE_ERROR_INVALID_VALUE, "b2");
    a = g; a.expert_bias = F.dle;
    fwd_case(&F, "expert_bias given, TOPK_SOFTMAX", a, SMOE_ERROR_INVALID_VALUE, "expert_bias");
    /* router_logits' dtype: F32 or the layer's; the CUDA backends take F32 only */
    a = g; a.router_logits_dtype = D.dtype == SMOE_DTYPE_BF16 ? SMOE_DTYPE_F64 : SMOE_DTYPE_BF16;
    fwd_case(&F, "router_logits_dtype of another dtype", a, SMOE_ERROR_INVALID_VALUE,
             "router_logits_dtype");
    a = g; a.router_logits_dtype = (smoe_dtype)7;
    fwd_case(&F, "router_logits_dtype 7", a, SMOE_ERROR_INVALID_VALUE, "router_logits_dtype");
    if (D.dtype != SMOE_DTYPE_F32) {
        tu_case("%s forward %s: router_logits in the layer's dtype", M->name, tu_mode_name(&D));
        outs_reset();
        a = g; a.router_logits_dtype = D.dtype;
        CHECK_OK(fwd_call(&F, &a));
    }
    fix_free(&F);
    /* SIGMOID_TOPK: the bias is optional, an fp32 input */
    D = sig_good();
    if (!fix_make(&F, &D, 4, rng)) return;
    g = fix_fwd(&F);
    tu_case("%s forward %s: valid call, with and without the bias", M->name, tu_mode_name(&D));
    outs_reset();
    CHECK_OK(fwd_call(&F, &g));
    a = g; a.expert_bias = NULL;
    CHECK_OK(fwd_call(&F, &a));
    a = g; a.expert_bias = (const float *)off(F.eb, 1);
    fwd_case(&F, "expert_bias misaligned", a, SMOE_ERROR_INVALID_SIZE, "expert_bias");
    a = g; a.expert_bias = F.logits;
    fwd_case(&F, "expert_bias is router_logits", a, SMOE_ERROR_INVALID_VALUE, "expert_bias");
    fix_free(&F);
    D = good_desc();
    D.routing = SMOE_ROUTING_GENERAL;
    D.K = 0;
    if (!fix_make(&F, &D, 4, rng)) return;
    g = fix_fwd(&F);
    a = g; a.router_logits = F.logits;
    fwd_case(&F, "router_logits asked of GENERAL", a, SMOE_ERROR_INVALID_VALUE, "router_logits");
    /* no pair at all: the triple pointers may be NULL; out is zero */
    a = g; a.pairs = 0; a.pair_token = NULL; a.pair_expert = NULL; a.pair_score = NULL;
    tu_case("%s forward general: pairs = 0, NULL triples", M->name);
    const size_t ob = (size_t)(4 * D.d) * F.es;
    M->fill(F.out, PAT, ob);
    const size_t sb0 = smoe_layer_saved_bytes(F.L, 4, 0), wb0 = smoe_layer_workspace_bytes(F.L, 4, 0);
    CHECK_OK(settle(F.L, smoe_layer_forward(F.L, &a, F.saved, sb0, F.ws, wb0, NULL)));
    unsigned char *h = (unsigned char *)malloc(ob);
    M->get(h, F.out, ob);
    int zero = 1;
    for (size_t i = 0; i < ob; i++) zero &= h[i] == 0;
    CHECK(zero, "out is not zero without pairs");
    free(h);
    fix_free(&F);
}

/* ------------------------------------------------------------ backward */

static void test_backward_args(tu_rng *rng) {
    for (int general = 0; general < 2; general++) {
        smoe_layer_desc D = good_desc();
        D.has_bias = 1;
        if (general) D.routing = SMOE_ROUTING_GENERAL;
        bi_fix F;
        if (!fix_make(&F, &D, 5, rng)) continue;
        smoe_forward_args fa = fix_fwd(&F);
        tu_case("%s backward %s: forward", M->name, tu_mode_name(&D));
        CHECK_OK(fwd_call(&F, &fa));
        const smoe_backward_args g = fix_bwd(&F);
        /* the saved block, to see that no backward writes it */
        unsigned char *saved_ref = (unsigned char *)malloc(F.saved_b);
        unsigned char *saved_now = (unsigned char *)malloc(F.saved_b);
        M->get(saved_ref, F.saved, F.saved_b);
        tu_case("%s backward %s: valid call", M->name, tu_mode_name(&D));
        CHECK_OK(bwd_call(&F, &g));
        /* this call's own workspace size: at most SMOE_CALL_BACKWARD's (less
         * on the GPU, where A' goes into dw1's buffer), and enough */
        const size_t ws_ab = smoe_layer_backward_workspace_bytes(F.L, &g);
        tu_case("%s backward %s: workspace of exactly smoe_layer_backward_workspace_bytes",
                M->name, tu_mode_name(&D));
        CHECK(ws_ab > 0 && ws_ab <= F.ws_bb, "backward_workspace_bytes %zu, SMOE_CALL_BACKWARD %zu",
              ws_ab, F.ws_bb);
        CHECK_OK(settle(F.L, smoe_layer_backward(F.L, &g, F.saved, F.saved_b, F.ws, ws_ab, NULL)));

        smoe_backward_args a;
#define BWD_BUF(label, mod, sv, svb, wsp, wsb, want, text)                                      \
    do {                                                                                        \
        tu_case("%s backward %s: %s", M->name, tu_mode_name(&D), label);                        \
        a = g;                                                                                  \
        mod;                                                                                    \
        bwd_outs(&F);                                                                           \
        expect(settle(F.L, smoe_layer_backward(F.L, &a, sv, svb, wsp, wsb, NULL)), want, text); \
    } while (0)
#define BWD(label, mod, want, text) BWD_BUF(label, mod, F.saved, F.saved_b, F.ws, F.ws_b, want, text)
        tu_case("backward: NULL layer/args");
        bwd_outs(&F);
        expect(smoe_layer_backward(NULL, &g, F.saved, F.saved_b, F.ws, F.ws_b, NULL),
               SMOE_ERROR_NULL_POINTER, "layer");
        bwd_outs(&F);
        expect(smoe_layer_backward(F.L, NULL, F.saved, F.saved_b, F.ws, F.ws_b, NULL),
               SMOE_ERROR_NULL_POINTER, "args");
        BWD("T=0", a.T = 0, SMOE_ERROR_INVALID_SIZE, "T");
        BWD("T=-9", a.T = -9, SMOE_ERROR_INVALID_SIZE, "-9");
        BWD("dout NULL", a.dout = NULL, SMOE_ERROR_NULL_POINTER, "dout");
        BWD("x NULL", a.x = NULL, SMOE_ERROR_NULL_POINTER, "x");
        BWD("w1 NULL", a.w1 = NULL, SMOE_ERROR_NULL_POINTER, "w1");
        BWD("w2 NULL", a.w2 = NULL, SMOE_ERROR_NULL_POINTER, "w2");
        BWD("b2 NULL with bias", a.b2 = NULL, SMOE_ERROR_NULL_POINTER, "b2");
        BWD_BUF("saved NULL", (void)0, NULL, F.saved_b, F.ws, F.ws_b, SMOE_ERROR_NULL_POINTER, "saved");
        BWD_BUF("workspace NULL", (void)0, F.saved, F.saved_b, NULL, F.ws_b,
                SMOE_ERROR_NULL_POINTER, "workspace");
        BWD_BUF("saved_bytes one short", (void)0, F.saved, F.saved_b - 1, F.ws, F.ws_b,
                SMOE_ERROR_INVALID_SIZE, "saved_bytes");
        BWD_BUF("workspace_bytes one short", (void)0, F.saved, F.saved_b, F.ws, ws_ab - 1,
                SMOE_ERROR_INVALID_SIZE, "smoe_layer_backward_workspace_bytes");
        BWD("dw1 dtype 17", a.dw1.dtype = (smoe_dtype)17, SMOE_ERROR_INVALID_VALUE, "dw1");
        BWD("dw2 dtype F64", a.dw2.dtype = SMOE_DTYPE_F64, SMOE_ERROR_INVALID_VALUE, "dw2");
        BWD("dx dtype 17", a.dx.dtype = (smoe_dtype)17, SMOE_ERROR_INVALID_VALUE, "17");
        BWD("db1 accumulate 2", a.db1.accumulate = 2, SMOE_ERROR_INVALID_VALUE, "accumulate");
        /* alignment */
        BWD("dout misaligned", a.dout = off(g.dout, 1), SMOE_ERROR_INVALID_SIZE, "args.dout");
        BWD("x misaligned", a.x = off(g.x, 1), SMOE_ERROR_INVALID_SIZE, "args.x");
        BWD("dx misaligned", a.dx.ptr = off(g.dx.ptr, 2), SMOE_ERROR_INVALID_SIZE, "args.dx.ptr");
        BWD("dw1 misaligned", a.dw1.ptr = off(g.dw1.ptr, 1), SMOE_ERROR_INVALID_SIZE, "args.dw1.ptr");
        BWD_BUF("saved misaligned", (void)0, off(F.saved, 4), F.saved_b, F.ws, F.ws_b,
                SMOE_ERROR_INVALID_SIZE, "saved");
        if (D.backend != SMOE_BACKEND_CPU) {
            BWD("dw2 not 16-byte aligned", a.dw2.ptr = off(g.dw2.ptr, 4), SMOE_ERROR_INVALID_SIZE,
                "16-byte");
            BWD("w1 not 16-byte aligned", a.w1 = off(g.w1, 2), SMOE_ERROR_INVALID_SIZE, "16-byte");
        }
        /* overlap */
        BWD("dx is dout", a.dx.ptr = (void *)g.dout, SMOE_ERROR_INVALID_VALUE, "overlaps");
        BWD("dw1 is w1", a.dw1.ptr = (void *)g.w1, SMOE_ERROR_INVALID_VALUE, "args.dw1.ptr");
        BWD("dw2 is dw1", a.dw2.ptr = g.dw1.ptr, SMOE_ERROR_INVALID_VALUE, "args.dw2.ptr");
        BWD("db2 inside saved", a.db2.ptr = off(F.saved, 1024), SMOE_ERROR_INVALID_VALUE, "saved");
        BWD_BUF("workspace overlaps saved", (void)0, F.saved, F.saved_b, off(F.saved, 256),
                F.ws_b, SMOE_ERROR_INVALID_VALUE, "workspace");
        if (!general) {
            BWD("router_w NULL", a.router_w = NULL, SMOE_ERROR_NULL_POINTER, "router_w");
            BWD("dpair_score on token choice", a.dpair_score.ptr = g.dx.ptr,
                SMOE_ERROR_INVALID_VALUE, "dpair_score");
            BWD("drouter_w is x", a.drouter_w.ptr = (void *)g.x, SMOE_ERROR_INVALID_VALUE,
                "drouter_w");
            BWD("dlogits_extra misaligned", a.dlogits_extra = (float *)off(F.dle, 2),
                SMOE_ERROR_INVALID_SIZE, "dlogits_extra");
            /* its dtype: F32 or the layer's; the CUDA backends take F32 only */
            BWD("dlogits_extra_dtype of another dtype",
                (a.dlogits_extra = F.dle,
                 a.dlogits_extra_dtype =
                     D.dtype == SMOE_DTYPE_BF16 ? SMOE_DTYPE_F64 : SMOE_DTYPE_BF16),
                SMOE_ERROR_INVALID_VALUE, "dlogits_extra_dtype");
            BWD("dlogits_extra_dtype 7", (a.dlogits_extra = F.dle,
                                          a.dlogits_extra_dtype = (smoe_dtype)7),
                SMOE_ERROR_INVALID_VALUE, "dlogits_extra_dtype");
            if (D.dtype != SMOE_DTYPE_F32) {
                tu_case("%s backward %s: dlogits_extra in the layer's dtype", M->name,
                        tu_mode_name(&D));
                outs_reset();
                a = g; a.dlogits_extra = F.dle; a.dlogits_extra_dtype = D.dtype;
                CHECK_OK(bwd_call(&F, &a));
            }
        } else {
            BWD("dpair_score dtype BF16", a.dpair_score.dtype = SMOE_DTYPE_BF16,
                SMOE_ERROR_INVALID_VALUE, "dpair_score");
            BWD("drouter_w on GENERAL", a.drouter_w.ptr = g.dx.ptr, SMOE_ERROR_INVALID_VALUE,
                "drouter_w");
            BWD("dlogits_extra on GENERAL", a.dlogits_extra = F.dle, SMOE_ERROR_INVALID_VALUE,
                "dlogits_extra");
            BWD("pairs=-2", a.pairs = -2, SMOE_ERROR_INVALID_SIZE, "-2");
            char want[96];
            snprintf(want, sizeof want, "pairs = %lld, this backward has pairs = %lld",
                     (long long)F.P.pairs, (long long)(F.P.pairs - 1));
            BWD("pairs one fewer than the forward's", a.pairs = g.pairs - 1,
                SMOE_ERROR_INVALID_VALUE, want);
        }
        /* the saved block's header: this layer, this T */
        BWD("T one less than the forward's", a.T = g.T - 1, SMOE_ERROR_INVALID_VALUE,
            "T = 5, this backward has T = 4");
        {
            tu_case("%s backward %s: the saved block of another layer", M->name, tu_mode_name(&D));
            smoe_layer *L2 = tu_layer(&D);
            if (L2) {
                bwd_outs(&F);
                expect(settle(L2, smoe_layer_backward(L2, &g, F.saved, F.saved_b, F.ws, F.ws_b,
                                                      NULL)),
                       SMOE_ERROR_INVALID_VALUE, "another layer");
                smoe_layer_free(L2);
            }
            tu_case("%s backward %s: a saved block never filled", M->name, tu_mode_name(&D));
            void *junk = M->alloc(F.saved_b);
            M->fill(junk, PAT, F.saved_b);
            bwd_outs(&F);
            expect(settle(F.L, smoe_layer_backward(F.L, &g, junk, F.saved_b, F.ws, F.ws_b, NULL)),
                   SMOE_ERROR_INVALID_VALUE, "not filled by a training forward");
            M->release(junk);
        }
        M->get(saved_now, F.saved, F.saved_b);
        tu_case("%s backward %s: saved untouched", M->name, tu_mode_name(&D));
        CHECK(memcmp(saved_ref, saved_now, F.saved_b) == 0, "a backward wrote the saved block");
        tu_case("%s backward %s: valid again after the refusals", M->name, tu_mode_name(&D));
        outs_reset();
        CHECK_OK(bwd_call(&F, &g));
#undef BWD
#undef BWD_BUF
        free(saved_ref); free(saved_now);
        fix_free(&F);
    }
}

/* GENERAL with E = 20: a token with 18 experts (longer runs take another
 * path in a duplicate check); valid, then with one duplicate. */
static void test_long_runs(tu_rng *rng) {
    smoe_layer_desc D = good_desc();
    D.routing = SMOE_ROUTING_GENERAL;
    D.E = 20; D.K = 0;
    bi_fix F;
    if (!fix_make(&F, &D, 3, rng)) return;
    int32_t pt[60], pe[60];
    float ps[60];
    int64_t np = 0;
    for (int t = 0; t < 3; t++)
        for (int e = 0; e < 20; e++)
            if (t == 1 ? e < 18 : e % 5 == 0) {
                /* token 1's experts in descending order: any order within a token */
                pt[np] = t;
                pe[np] = t == 1 ? 17 - e : e;
                ps[np++] = 0.25f;
            }
    /* the fixture's buffers hold its own random triples: make room */
    M->release(F.pt); M->release(F.pe); M->release(F.ps);
    F.pt = (int32_t *)bi_upload(pt, (size_t)np * 4);
    F.pe = (int32_t *)bi_upload(pe, (size_t)np * 4);
    F.ps = (float *)bi_upload(ps, (size_t)np * 4);
    M->release(F.saved); M->release(F.ws);
    F.saved_b = smoe_layer_saved_bytes(F.L, 3, np);
    F.ws_b = smoe_layer_workspace_bytes(F.L, 3, np);
    F.saved = M->alloc(F.saved_b);
    F.ws = M->alloc(F.ws_b);
    F.P.pairs = np;
    smoe_forward_args a = fix_fwd(&F);
    tu_case("%s forward general: 18 experts for one token (valid)", M->name);
    CHECK_OK(fwd_call(&F, &a));
    pe[4 + 10] = pe[4 + 3]; /* token 1 starts at pair 4 */
    fwd_case_triples(&F, "duplicate in a run of 18", pt, pe, ps, np, "twice");
    fix_free(&F);
}

/* ------------------------------------------------------------ threads */

/* smoe_last_error() is per thread. */
typedef struct thr_arg {
    pthread_barrier_t *bar;
    int64_t d;
    char msg[512];
    smoe_status st;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = (thr_arg *)p;
    smoe_layer_desc D = good_desc();
    D.d = a->d;
    smoe_layer *L = NULL;
    a->st = smoe_layer_create(&D, &L);
    pthread_barrier_wait(a->bar); /* both failed before either reads */
    snprintf(a->msg, sizeof a->msg, "%s", smoe_last_error());
    return NULL;
}

static void test_thread_local(void) {
    tu_case("smoe_last_error is thread-local");
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    thr_arg a = {&bar, -111, "", SMOE_SUCCESS}, b = {&bar, -222, "", SMOE_SUCCESS};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, thr_main, &a);
    pthread_create(&tb, NULL, thr_main, &b);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    pthread_barrier_destroy(&bar);
    CHECK(a.st == SMOE_ERROR_INVALID_SIZE && b.st == SMOE_ERROR_INVALID_SIZE, "statuses %d %d", a.st, b.st);
    CHECK(strstr(a.msg, "-111") && !strstr(a.msg, "-222"), "thread A reads \"%s\"", a.msg);
    CHECK(strstr(b.msg, "-222") && !strstr(b.msg, "-111"), "thread B reads \"%s\"", b.msg);
}

static void bi_run_all(tu_rng *rng) {
    test_basics();
    test_create();
    test_forward_args(rng);
    test_forward_extra(rng);
    test_backward_args(rng);
    test_long_runs(rng);
    test_thread_local();
}

#endif /* SMOE_TESTS_BAD_INPUT_H */
