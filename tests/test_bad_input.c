/*
 * test_bad_input.c -- every bad argument is refused with its status, a
 * message that names the offending field or value, and no output written.
 *
 * Each case starts from a valid call, breaks one thing, fills every output
 * (out, router_logits, expert_counts, saved, gradients, routing results)
 * with a byte pattern, makes the call, and checks: the status, that
 * smoe_last_error() is non-empty and contains the expected text, and that
 * every output still holds the pattern, byte for byte.
 */
#include "testutil.h"

#include <pthread.h>

#define PAT 0xA5

typedef struct region {
    void *p;
    size_t n;
} region;

static region outs[16];
static int nouts;

static void outs_reset(void) { nouts = 0; }
static void outs_add(void *p, size_t n) {
    if (p && n) { outs[nouts].p = p; outs[nouts].n = n; nouts++; }
}
static void outs_fill(void) {
    for (int i = 0; i < nouts; i++) memset(outs[i].p, PAT, outs[i].n);
}
static int outs_untouched(void) {
    for (int i = 0; i < nouts; i++)
        for (size_t j = 0; j < outs[i].n; j++)
            if (((unsigned char *)outs[i].p)[j] != PAT) return 0;
    return 1;
}

/* Checks one refused call. */
static void expect(smoe_status got, smoe_status want, const char *text) {
    const char *msg = smoe_last_error();
    CHECK(got == want, "status %d (%s), want %d (%s); message \"%s\"", got, smoe_status_string(got),
          want, smoe_status_string(want), msg);
    CHECK(msg && msg[0], "smoe_last_error() is empty");
    if (text) CHECK(msg && strstr(msg, text), "message \"%s\" does not name \"%s\"", msg, text);
    CHECK(outs_untouched(), "an output was written by a refused call");
}

/* ------------------------------------------------------------ create */

static smoe_layer_desc good_desc(void) {
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 8; D.n = 4; D.E = 4; D.K = 2;
    D.dtype = SMOE_DTYPE_F32;
    D.backend = SMOE_BACKEND_CPU;
    return D;
}

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
    tu_case("check_device on the CPU backend");
    D = good_desc();
    smoe_layer *L = NULL;
    CHECK_OK(smoe_layer_create(&D, &L));
    if (L) {
        char ws[256];
        CHECK_OK(smoe_layer_check_device(L, ws, NULL));
        smoe_layer_free(L);
    }
    outs_reset();
    expect(smoe_layer_check_device(NULL, NULL, NULL), SMOE_ERROR_NULL_POINTER, "layer");
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
}

/* ------------------------------------------------------------ forward / backward */

static void fwd_outs(tu_fixture *S) {
    const smoe_layer_desc *D = &S->P.desc;
    outs_reset();
    outs_add(S->B.out, (size_t)(S->P.T * D->d) * tu_dtype_size(D->dtype));
    outs_add(S->B.logits, (size_t)(S->P.T * D->E) * sizeof(float));
    outs_add(S->B.counts, (size_t)D->E * sizeof(int32_t));
    outs_add(S->B.saved, S->B.saved_bytes);
    outs_fill();
}

static void fwd_case(tu_fixture *S, const char *name, smoe_forward_args a, int null_saved, int null_ws,
                     smoe_status want, const char *text) {
    tu_case("forward %s: %s", tu_mode_name(&S->P.desc), name);
    fwd_outs(S);
    expect(smoe_layer_forward(S->L, &a, null_saved ? NULL : S->B.saved, null_ws ? NULL : S->B.ws,
                              NULL),
           want, text);
}

static void test_forward_args(tu_rng *rng) {
    for (int general = 0; general < 2; general++) {
        smoe_layer_desc D = good_desc();
        D.has_bias = 1;
        if (general) D.routing = SMOE_ROUTING_GENERAL;
        tu_fixture S;
        if (!tu_fixture_make(&S, &D, 5, rng, 0.5, 0.6)) continue;
        smoe_forward_args g = tu_fwd_args(&S.P, &S.B, 0), a;
        /* the good call works */
        tu_case("forward %s: valid call", tu_mode_name(&D));
        CHECK_OK(smoe_layer_forward(S.L, &g, S.B.saved, S.B.ws, NULL));

        tu_case("forward: NULL layer");
        fwd_outs(&S);
        expect(smoe_layer_forward(NULL, &g, S.B.saved, S.B.ws, NULL), SMOE_ERROR_NULL_POINTER, "layer");
        tu_case("forward: NULL args");
        fwd_outs(&S);
        expect(smoe_layer_forward(S.L, NULL, S.B.saved, S.B.ws, NULL), SMOE_ERROR_NULL_POINTER, "args");
        a = g; a.T = 0;     fwd_case(&S, "T=0", a, 0, 0, SMOE_ERROR_INVALID_SIZE, "T");
        a = g; a.T = -5;    fwd_case(&S, "T=-5", a, 0, 0, SMOE_ERROR_INVALID_SIZE, "-5");
        a = g; a.x = NULL;  fwd_case(&S, "x NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "x");
        a = g; a.w1 = NULL; fwd_case(&S, "w1 NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "w1");
        a = g; a.w2 = NULL; fwd_case(&S, "w2 NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "w2");
        a = g; a.b1 = NULL; fwd_case(&S, "b1 NULL with bias", a, 0, 0, SMOE_ERROR_NULL_POINTER, "b1");
        a = g; a.b2 = NULL; fwd_case(&S, "b2 NULL with bias", a, 0, 0, SMOE_ERROR_NULL_POINTER, "b2");
        a = g; a.out = NULL; fwd_case(&S, "out NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "out");
        a = g;              fwd_case(&S, "saved NULL (training)", a, 1, 0, SMOE_ERROR_NULL_POINTER, "saved");
        a = g;              fwd_case(&S, "workspace NULL", a, 0, 1, SMOE_ERROR_NULL_POINTER, "workspace");
        a = g; a.inference = 2; fwd_case(&S, "inference=2", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "2");
        {
            /* a saved block that is not 16-byte aligned */
            tu_case("forward %s: misaligned saved", tu_mode_name(&D));
            unsigned char *mis = (unsigned char *)malloc(S.B.saved_bytes + 64);
            fwd_outs(&S);
            outs_add(mis, S.B.saved_bytes + 64);
            outs_fill();
            a = g;
            expect(smoe_layer_forward(S.L, &a, mis + 8, S.B.ws, NULL), SMOE_ERROR_INVALID_SIZE, "aligned");
            free(mis);
        }
        if (!general) {
            a = g; a.router_w = NULL;
            fwd_case(&S, "router_w NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "router_w");
        } else {
            int64_t np = S.P.pairs;
            int32_t *pt = (int32_t *)malloc((size_t)np * sizeof(int32_t));
            int32_t *pe = (int32_t *)malloc((size_t)np * sizeof(int32_t));
            float *ps = (float *)malloc((size_t)np * sizeof(float));
#define RESET_TRIPLES()                                   \
    memcpy(pt, S.P.pt, (size_t)np * sizeof(int32_t));     \
    memcpy(pe, S.P.pe, (size_t)np * sizeof(int32_t));     \
    memcpy(ps, S.B.pscore, (size_t)np * sizeof(float));   \
    a = g; a.pair_token = pt; a.pair_expert = pe; a.pair_score = ps
            if (!CHECK(np >= 4, "want at least 4 GENERAL pairs, got %lld", (long long)np)) np = 0;
            if (np >= 4) {
                RESET_TRIPLES(); pt[np - 1] = 5; /* T = 5 */
                fwd_case(&S, "pair_token = T", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "5");
                RESET_TRIPLES(); pt[0] = -1;
                fwd_case(&S, "pair_token = -1", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "-1");
                RESET_TRIPLES(); pe[1] = 4; /* E = 4 */
                fwd_case(&S, "pair_expert = E", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "4");
                RESET_TRIPLES(); pe[2] = -3;
                fwd_case(&S, "pair_expert = -3", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "-3");
                /* unsorted: swap the first and last tokens (they differ) */
                RESET_TRIPLES(); { int32_t t0 = pt[0]; pt[0] = pt[np - 1]; pt[np - 1] = t0; }
                if (pt[0] != pt[np - 1])
                    fwd_case(&S, "pair_token unsorted", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "sorted");
                /* a duplicate (token, expert): copy pair 0 over pair 1 if same token,
                 * else make a run: find i with pt[i] == pt[i+1] */
                RESET_TRIPLES();
                int64_t dup = -1;
                for (int64_t i = 0; i + 1 < np; i++)
                    if (pt[i] == pt[i + 1]) { dup = i; break; }
                if (dup >= 0) {
                    pe[dup + 1] = pe[dup];
                    fwd_case(&S, "duplicate pair", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "twice");
                }
                RESET_TRIPLES(); ps[1] = NAN;
                fwd_case(&S, "pair_score NaN", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "pair_score");
                RESET_TRIPLES(); a.pair_token = NULL;
                fwd_case(&S, "pair_token NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "pair_token");
                RESET_TRIPLES(); a.pair_score = NULL;
                fwd_case(&S, "pair_score NULL", a, 0, 0, SMOE_ERROR_NULL_POINTER, "pair_score");
                RESET_TRIPLES(); a.pairs = -1;
                fwd_case(&S, "pairs=-1", a, 0, 0, SMOE_ERROR_INVALID_SIZE, "-1");
                RESET_TRIPLES(); a.pairs = 21; /* > T*E = 20 */
                fwd_case(&S, "pairs > T*E", a, 0, 0, SMOE_ERROR_INVALID_SIZE, "21");
                tu_case("sizes: GENERAL pairs > T*E");
                CHECK(smoe_layer_saved_bytes(S.L, 5, 21) == 0 && strstr(smoe_last_error(), "21"),
                      "saved_bytes(pairs = 21 > T*E) \"%s\"", smoe_last_error());
                CHECK(smoe_layer_saved_bytes(S.L, 5, -1) == 0, "saved_bytes(pairs = -1)");
            }
            free(pt); free(pe); free(ps);
        }
        tu_fixture_free(&S);
    }
}

/* Biases given to a layer without them, logits asked of GENERAL routing. */
static void test_forward_extra(tu_rng *rng) {
    smoe_layer_desc D = good_desc();
    tu_fixture S;
    if (!tu_fixture_make(&S, &D, 4, rng, 0.5, 0.6)) return;
    smoe_forward_args g = tu_fwd_args(&S.P, &S.B, 0), a;
    float b[64] = {0};
    a = g; a.b1 = b; fwd_case(&S, "b1 given, no bias", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "b1");
    a = g; a.b2 = b; fwd_case(&S, "b2 given, no bias", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "b2");
    tu_fixture_free(&S);
    D.routing = SMOE_ROUTING_GENERAL;
    D.K = 0;
    if (!tu_fixture_make(&S, &D, 4, rng, 0.5, 0.6)) return;
    g = tu_fwd_args(&S.P, &S.B, 0);
    a = g; a.router_logits = S.B.logits;
    fwd_case(&S, "router_logits asked of GENERAL", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "router_logits");
    /* no pair at all: the triple pointers may be NULL; out is zero */
    a = g; a.pairs = 0; a.pair_token = NULL; a.pair_expert = NULL; a.pair_score = NULL;
    tu_case("forward general: pairs = 0, NULL triples");
    memset(S.B.out, PAT, (size_t)(4 * D.d) * 4);
    CHECK_OK(smoe_layer_forward(S.L, &a, S.B.saved, S.B.ws, NULL));
    int zero = 1;
    for (int64_t i = 0; i < 4 * D.d; i++) zero &= ((float *)S.B.out)[i] == 0.0f;
    CHECK(zero, "out is not zero without pairs");
    tu_fixture_free(&S);
}

static void test_backward_args(tu_rng *rng) {
    for (int general = 0; general < 2; general++) {
        smoe_layer_desc D = good_desc();
        D.has_bias = 1;
        if (general) D.routing = SMOE_ROUTING_GENERAL;
        tu_fixture S;
        if (!tu_fixture_make(&S, &D, 5, rng, 0.5, 0.6)) continue;
        smoe_forward_args fa = tu_fwd_args(&S.P, &S.B, 0);
        tu_case("backward %s: forward", tu_mode_name(&D));
        CHECK_OK(smoe_layer_forward(S.L, &fa, S.B.saved, S.B.ws, NULL));
        int64_t T = S.P.T, d = D.d, E = D.E, hc = S.P.hc, n = D.n;
        float *dout = (float *)calloc((size_t)(T * d), sizeof(float));
        for (int64_t i = 0; i < T * d; i++) dout[i] = (float)tu_normal(rng);
        float *dle = (float *)calloc((size_t)(T * E), sizeof(float));
        size_t sz[7] = {(size_t)(T * d), general ? 0 : (size_t)(E * d), (size_t)(E * hc * d),
                        (size_t)(E * hc), (size_t)(E * d * n), (size_t)(E * d),
                        general ? (size_t)S.P.pairs : 0};
        void *gb[7];
        smoe_backward_args g;
        memset(&g, 0, sizeof g);
        g.T = T; g.x = S.B.x; g.router_w = general ? NULL : S.B.wr; g.pairs = general ? S.P.pairs : 0;
        g.w1 = S.B.w1; g.w2 = S.B.w2; g.b2 = S.B.b2; g.dout = dout;
        smoe_grad *slot[7] = {&g.dx, &g.drouter_w, &g.dw1, &g.db1, &g.dw2, &g.db2, &g.dpair_score};
        outs_reset();
        for (int i = 0; i < 7; i++) {
            gb[i] = sz[i] ? malloc(sz[i] * 4) : NULL;
            slot[i]->ptr = gb[i];
            slot[i]->dtype = SMOE_DTYPE_F32;
            outs_add(gb[i], sz[i] * 4);
        }
        /* a copy of the saved block: backward only reads it */
        void *saved_ref = malloc(S.B.saved_bytes);
        memcpy(saved_ref, S.B.saved, S.B.saved_bytes);
        tu_case("backward %s: valid call", tu_mode_name(&D));
        CHECK_OK(smoe_layer_backward(S.L, &g, S.B.saved, S.B.ws, NULL));
        CHECK(memcmp(saved_ref, S.B.saved, S.B.saved_bytes) == 0, "backward wrote the saved block");

        smoe_backward_args a;
#define BWD(name, mod, null_saved, want, text)                                                    \
    do {                                                                                          \
        tu_case("backward %s: %s", tu_mode_name(&D), name);                                       \
        a = g;                                                                                    \
        mod;                                                                                      \
        outs_fill();                                                                              \
        expect(smoe_layer_backward(S.L, &a, (null_saved) ? NULL : S.B.saved, S.B.ws, NULL), want, \
               text);                                                                             \
    } while (0)
        tu_case("backward: NULL layer/args");
        outs_fill();
        expect(smoe_layer_backward(NULL, &g, S.B.saved, S.B.ws, NULL), SMOE_ERROR_NULL_POINTER, "layer");
        outs_fill();
        expect(smoe_layer_backward(S.L, NULL, S.B.saved, S.B.ws, NULL), SMOE_ERROR_NULL_POINTER, "args");
        BWD("T=0", a.T = 0, 0, SMOE_ERROR_INVALID_SIZE, "T");
        BWD("T=-9", a.T = -9, 0, SMOE_ERROR_INVALID_SIZE, "-9");
        BWD("dout NULL", a.dout = NULL, 0, SMOE_ERROR_NULL_POINTER, "dout");
        BWD("x NULL", a.x = NULL, 0, SMOE_ERROR_NULL_POINTER, "x");
        BWD("w1 NULL", a.w1 = NULL, 0, SMOE_ERROR_NULL_POINTER, "w1");
        BWD("w2 NULL", a.w2 = NULL, 0, SMOE_ERROR_NULL_POINTER, "w2");
        BWD("b2 NULL with bias", a.b2 = NULL, 0, SMOE_ERROR_NULL_POINTER, "b2");
        BWD("saved NULL", (void)0, 1, SMOE_ERROR_NULL_POINTER, "saved");
        BWD("dw1 dtype BF16 on an F32 layer", a.dw1.dtype = SMOE_DTYPE_BF16, 0,
            SMOE_ERROR_INVALID_VALUE, "dw1");
        BWD("dw2 dtype F64 on an F32 layer", a.dw2.dtype = SMOE_DTYPE_F64, 0,
            SMOE_ERROR_INVALID_VALUE, "dw2");
        BWD("dx dtype 17", a.dx.dtype = (smoe_dtype)17, 0, SMOE_ERROR_INVALID_VALUE, "17");
        BWD("db1 accumulate 2", a.db1.accumulate = 2, 0, SMOE_ERROR_INVALID_VALUE, "accumulate");
        if (!general) {
            BWD("router_w NULL", a.router_w = NULL, 0, SMOE_ERROR_NULL_POINTER, "router_w");
            BWD("dpair_score on token choice", a.dpair_score.ptr = gb[0], 0,
                SMOE_ERROR_INVALID_VALUE, "dpair_score");
        } else {
            BWD("dpair_score dtype BF16", a.dpair_score.dtype = SMOE_DTYPE_BF16, 0,
                SMOE_ERROR_INVALID_VALUE, "dpair_score");
            BWD("drouter_w on GENERAL", a.drouter_w.ptr = gb[0], 0, SMOE_ERROR_INVALID_VALUE,
                "drouter_w");
            BWD("dlogits_extra on GENERAL", a.dlogits_extra = dle, 0, SMOE_ERROR_INVALID_VALUE,
                "dlogits_extra");
            BWD("pairs=-2", a.pairs = -2, 0, SMOE_ERROR_INVALID_SIZE, "-2");
        }
        CHECK(memcmp(saved_ref, S.B.saved, S.B.saved_bytes) == 0, "a refused backward wrote saved");
        {
            /* a saved block no training forward filled */
            tu_case("backward %s: saved block never filled", tu_mode_name(&D));
            void *junk = malloc(S.B.saved_bytes);
            memset(junk, PAT, S.B.saved_bytes);
            outs_fill();
            smoe_status st = smoe_layer_backward(S.L, &g, junk, S.B.ws, NULL);
            expect(st, SMOE_ERROR_INVALID_VALUE, "saved");
            free(junk);
        }
        for (int i = 0; i < 7; i++) free(gb[i]);
        free(saved_ref); free(dout); free(dle);
        tu_fixture_free(&S);
    }
}

/* GENERAL with E = 20: a token with 18 experts (longer runs take another
 * path in a duplicate check); valid, then with one duplicate. */
static void test_long_runs(tu_rng *rng) {
    smoe_layer_desc D = good_desc();
    D.routing = SMOE_ROUTING_GENERAL;
    D.E = 20; D.K = 0;
    tu_fixture S;
    tu_problem_init(&S.P, &D, 3, rng, 1.0, 0.5);
    S.P.pt = (int32_t *)malloc(60 * sizeof(int32_t));
    S.P.pe = (int32_t *)malloc(60 * sizeof(int32_t));
    S.P.ps = tu_alloc_d(60);
    S.P.pairs = 0;
    for (int t = 0; t < 3; t++)
        for (int e = 0; e < 20; e++)
            if (t == 1 ? e < 18 : e % 5 == 0) {
                /* token 1's experts in descending order: any order within a token */
                S.P.pt[S.P.pairs] = t;
                S.P.pe[S.P.pairs] = t == 1 ? 17 - e : e;
                S.P.ps[S.P.pairs++] = 0.25;
            }
    S.L = tu_layer(&D);
    if (!S.L) return;
    tu_bufs_make(&S.B, &S.P, S.L, 0);
    smoe_forward_args a = tu_fwd_args(&S.P, &S.B, 0);
    tu_case("forward general: 18 experts for one token (valid)");
    CHECK_OK(smoe_layer_forward(S.L, &a, S.B.saved, S.B.ws, NULL));
    double *ref = tu_alloc_d(3 * 8), *out = tu_from_dtype(SMOE_DTYPE_F32, S.B.out, 3 * 8);
    tu_forward_ref(&S.P, ref);
    CHECK_CLOSE(out, ref, 3 * 8, 2e-5, "out");
    free(ref); free(out);
    int32_t pe[60];
    memcpy(pe, S.P.pe, sizeof pe);
    pe[4 + 10] = pe[4 + 3]; /* token 1 starts at pair 4 */
    a.pair_expert = pe;
    fwd_case(&S, "duplicate in a run of 18", a, 0, 0, SMOE_ERROR_INVALID_VALUE, "twice");
    tu_fixture_free(&S);
}

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

/* ------------------------------------------------------------ smoe_route_cpu */

static void test_route_args(void) {
    enum { T = 4, E = 4, CAP = T * E };
    float lg[T * E] = {3, 0, 1, 2, 0, 1, 2, 3, 1, 1, 1, 1, 5, 4, 3, 2};
    int32_t ex[T * 2], pt[CAP], pe[CAP];
    float sc[T * 2], ps[CAP];
    int64_t np;
    smoe_routing_result r;
    smoe_layer_desc D = good_desc();
#define ROUTE_RESET()                                  \
    do {                                               \
        memset(&r, 0, sizeof r);                       \
        r.expert = ex; r.score = sc; r.cap = CAP;      \
        r.pair_token = pt; r.pair_expert = pe;         \
        r.pair_score = ps; r.pairs = &np;              \
        outs_reset();                                  \
        outs_add(ex, sizeof ex); outs_add(sc, sizeof sc); \
        outs_add(pt, sizeof pt); outs_add(pe, sizeof pe); \
        outs_add(ps, sizeof ps); outs_add(&np, sizeof np); \
        outs_fill();                                   \
    } while (0)
    tu_case("route: NULL desc");
    ROUTE_RESET();
    expect(smoe_route_cpu(NULL, T, lg, &r), SMOE_ERROR_NULL_POINTER, "desc");
    tu_case("route: NULL logits");
    ROUTE_RESET();
    expect(smoe_route_cpu(&D, T, NULL, &r), SMOE_ERROR_NULL_POINTER, "logits");
    tu_case("route: NULL res");
    ROUTE_RESET();
    expect(smoe_route_cpu(&D, T, lg, NULL), SMOE_ERROR_NULL_POINTER, "res");
    tu_case("route: T=-2");
    ROUTE_RESET();
    expect(smoe_route_cpu(&D, -2, lg, &r), SMOE_ERROR_INVALID_SIZE, "-2");
    tu_case("route: K=5 > E");
    ROUTE_RESET();
    D.K = 5;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_INVALID_SIZE, "5");
    D = good_desc();
    tu_case("route: GENERAL");
    ROUTE_RESET();
    D.routing = SMOE_ROUTING_GENERAL;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_INVALID_VALUE, "GENERAL");
    D = good_desc();
    tu_case("route: expert NULL");
    ROUTE_RESET();
    r.expert = NULL;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_NULL_POINTER, "expert");
    /* token rounding up with M=4: every expert with a TC token rounds up to
     * 4 = T rows; capacity 3 is too small */
    D.routing = SMOE_ROUTING_SOFTMAX_TOPK; D.renormalize = 1;
    D.rounding = SMOE_ROUND_UP; D.round_tile = 4;
    tu_case("route: token rounding, cap too small");
    ROUTE_RESET();
    r.cap = 3;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_INVALID_SIZE, "cap");
    tu_case("route: token rounding, cap -1");
    ROUTE_RESET();
    r.cap = -1;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_INVALID_SIZE, "-1");
    tu_case("route: token rounding, pairs NULL");
    ROUTE_RESET();
    r.pairs = NULL;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_NULL_POINTER, "pairs");
    tu_case("route: token rounding, pair_score NULL");
    ROUTE_RESET();
    r.pair_score = NULL;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_NULL_POINTER, "pair_score");
    tu_case("route: token rounding, cap exactly enough");
    ROUTE_RESET();
    r.cap = CAP;
    CHECK_OK(smoe_route_cpu(&D, T, lg, &r));
    CHECK(np > 0 && np <= CAP && np % 4 == 0, "pairs = %lld", (long long)np);
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 99));
    test_basics();
    test_create();
    test_forward_args(&rng);
    test_forward_extra(&rng);
    test_backward_args(&rng);
    test_route_args();
    test_long_runs(&rng);
    test_thread_local();
    return tu_summary("test_bad_input");
}
