/*
 * fuzz_route.c -- smoe_route_cpu on fuzzed logits (any float, NaN and
 * infinities included) for every token-choice mode and token rounding.
 * Oracle, from smoe.h: token choice picks K distinct experts per token, in
 * the documented order (NaN first, then larger logits, equal keys to the
 * lower expert) and no unpicked expert ranks ahead of a pick; scores of a
 * token whose logits are all finite lie in [0, 1] and, when normalised,
 * sum to 1. Token rounding: triples sorted by (token, expert), each once,
 * every expert's count a multiple of M or T, at most the capacity.
 */
#include "fuzz_util.h"

/* Does logit a of expert ia rank ahead of logit b of expert ib? */
static int ahead(float a, int ia, float b, int ib) {
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a > b || (a == b && ia < ib);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz r = {data, size};
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = 8; D.n = 8;
    D.E = fz_range(&r, 1, 40);
    D.K = fz_range(&r, 1, D.E);
    D.routing = fz_u8(&r) & 1 ? SMOE_ROUTING_SOFTMAX_TOPK : SMOE_ROUTING_TOPK_SOFTMAX;
    D.renormalize = (int)(fz_u8(&r) & 1);
    D.rounding = (smoe_rounding)(int)fz_range(&r, 0, 3);
    D.round_tile = fz_range(&r, 1, 16);
    const int64_t T = fz_range(&r, 1, 48), E = D.E, K = D.K;
    float *lg = (float *)malloc((size_t)(T * E) * sizeof(float));
    for (int64_t i = 0; i < T * E; i++) lg[i] = fz_float(&r);

    const int64_t cap = T * E;
    int32_t *ex = (int32_t *)malloc((size_t)(T * K) * 4), *pt = (int32_t *)malloc((size_t)cap * 4);
    int32_t *pe = (int32_t *)malloc((size_t)cap * 4);
    float *sc = (float *)malloc((size_t)(T * K) * 4), *ps = (float *)malloc((size_t)cap * 4);
    int64_t np = -1;
    smoe_routing_result res = {ex, sc, cap, pt, pe, ps, &np};
    smoe_status st = smoe_route_cpu(&D, T, lg, &res);
    FZ_CHECK(st == SMOE_SUCCESS, "routing refused a valid call: %s", smoe_status_string(st));

    if (D.rounding == SMOE_ROUND_OFF) {
        for (int64_t t = 0; t < T; t++) {
            const float *l = lg + t * E;
            const int32_t *x = ex + t * K;
            int finite = 1;
            for (int64_t e = 0; e < E; e++) finite &= isfinite(l[e]) != 0;
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) {
                FZ_CHECK(x[k] >= 0 && x[k] < E, "token %lld pick %lld = %d", (long long)t,
                         (long long)k, x[k]);
                for (int64_t j = 0; j < k; j++) FZ_CHECK(x[j] != x[k], "expert %d twice", x[k]);
                if (k > 0)
                    FZ_CHECK(ahead(l[x[k - 1]], x[k - 1], l[x[k]], x[k]),
                             "token %lld: pick %lld (%d, %g) before pick %lld (%d, %g)",
                             (long long)t, (long long)k - 1, x[k - 1], l[x[k - 1]], (long long)k,
                             x[k], l[x[k]]);
                const float s = sc[t * K + k];
                if (finite) {
                    FZ_CHECK(s >= 0.0f && s <= 1.0f + 1e-6f, "score %g", s);
                    sum += s;
                }
            }
            /* no unpicked expert ranks ahead of the last pick */
            for (int64_t e = 0; e < E; e++) {
                int picked = 0;
                for (int64_t k = 0; k < K; k++) picked |= x[k] == e;
                if (!picked)
                    FZ_CHECK(!ahead(l[e], (int)e, l[x[K - 1]], x[K - 1]),
                             "token %lld: expert %lld (%g) ranks ahead of pick %d (%g)",
                             (long long)t, (long long)e, l[e], x[K - 1], l[x[K - 1]]);
            }
            const int normalised =
                D.routing == SMOE_ROUTING_TOPK_SOFTMAX || D.renormalize;
            if (finite && normalised) FZ_CHECK(fabs(sum - 1.0) < 1e-5, "scores sum to %g", sum);
        }
    } else {
        FZ_CHECK(np >= 0 && np <= cap, "pairs %lld", (long long)np);
        int64_t *cnt = (int64_t *)calloc((size_t)E, sizeof(int64_t));
        for (int64_t i = 0; i < np; i++) {
            FZ_CHECK(pt[i] >= 0 && pt[i] < T && pe[i] >= 0 && pe[i] < E, "triple %lld = (%d, %d)",
                     (long long)i, pt[i], pe[i]);
            if (i > 0)
                FZ_CHECK(pt[i] > pt[i - 1] || (pt[i] == pt[i - 1] && pe[i] > pe[i - 1]),
                         "triples %lld, %lld not sorted or repeated", (long long)i - 1,
                         (long long)i);
            cnt[pe[i]]++;
        }
        for (int64_t e = 0; e < E; e++)
            FZ_CHECK(cnt[e] % D.round_tile == 0 || cnt[e] == T,
                     "expert %lld has %lld rows, M = %lld, T = %lld", (long long)e,
                     (long long)cnt[e], (long long)D.round_tile, (long long)T);
        free(cnt);
    }
    free(lg); free(ex); free(sc); free(pt); free(pe); free(ps);
    return 0;
}
