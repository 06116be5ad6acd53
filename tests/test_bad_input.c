/*
 * test_bad_input.c -- the bad-input cases of bad_input.h on the CPU backend
 * (host memory), plus smoe_route_cpu's own. tests/gpu/test_bad_input_gpu
 * runs the same cases on the CUDA backends.
 */
#include "bad_input.h"

static void *h_alloc(size_t n) { return malloc(n ? n : 1); }
static void h_release(void *p) { free(p); }
static void h_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static void h_fill(void *p, int byte, size_t n) { memset(p, byte, n); }

static const bi_mem host_mem = {"cpu", h_alloc, h_release, h_copy, h_copy, h_fill};

/* ------------------------------------------------------------ smoe_route_cpu */

static void test_route_args(void) {
    enum { T = 4, E = 4, CAP = T * E };
    float lg[T * E] = {3, 0, 1, 2, 0, 1, 2, 3, 1, 1, 1, 1, 5, 4, 3, 2};
    int32_t ex[T * 2], pt[CAP], pe[CAP];
    float sc[T * 2], ps[CAP];
    int64_t np;
    smoe_routing_result r;
    smoe_layer_desc D = bi_base;
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
    D = bi_base;
    tu_case("route: GENERAL");
    ROUTE_RESET();
    D.routing = SMOE_ROUTING_GENERAL;
    expect(smoe_route_cpu(&D, T, lg, &r), SMOE_ERROR_INVALID_VALUE, "GENERAL");
    D = bi_base;
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
#undef ROUTE_RESET
}

int main(int argc, char **argv) {
    tu_rng rng = tu_rng_make(tu_init(argc, argv, 99));
    M = &host_mem;
    bi_base = smoe_layer_desc_default();
    bi_base.d = 8; bi_base.n = 4; bi_base.E = 4; bi_base.K = 2;
    bi_base.dtype = SMOE_DTYPE_F32;
    bi_base.backend = SMOE_BACKEND_CPU;
    bi_run_all(&rng);
    test_route_args();
    return tu_summary("test_bad_input");
}
