/*
 * fuzz_desc.c -- layer descriptions and size queries. Every field comes from
 * the input (any int for the enums, sizes from fz_size). Oracle: a
 * description that breaks a rule smoe.h states is refused, with a message;
 * create returns a layer exactly when it succeeds; the two size queries of
 * a layer agree on which (T, pairs) are valid, and a valid query's bytes
 * cover at least the H rows the routing can produce.
 */
#include "fuzz_util.h"

static int enum_ok(int v, int last) { return v >= 0 && v <= last; }

/* The rules of smoe.h's descriptor, written from the header. */
static int breaks_a_rule(const smoe_layer_desc *D) {
    if (D->d <= 0 || D->n <= 0 || D->E <= 0 || D->E > 65536) return 1;
    if (D->routing == SMOE_ROUTING_GENERAL ? (D->K < 0 || D->K > D->E)
                                           : (D->K < 1 || D->K > D->E))
        return 1;
    if (!enum_ok((int)D->activation, SMOE_ACT_GELU) ||
        !enum_ok((int)D->w1_layout, SMOE_W1_CONCATENATED) ||
        !enum_ok((int)D->routing, SMOE_ROUTING_SIGMOID_TOPK) ||
        !enum_ok((int)D->rounding, SMOE_ROUND_NEAREST) || !enum_ok((int)D->dtype, SMOE_DTYPE_F64) ||
        !enum_ok((int)D->backend, SMOE_BACKEND_SM90))
        return 1;
    if ((D->has_bias != 0 && D->has_bias != 1) || (D->renormalize != 0 && D->renormalize != 1))
        return 1;
    if (D->round_tile <= 0) return 1;
    if (D->rounding != SMOE_ROUND_OFF && D->routing == SMOE_ROUTING_GENERAL) return 1;
    /* SIGMOID_TOPK: no token rounding; groups and scaling for it alone */
    const int sig = D->routing == SMOE_ROUTING_SIGMOID_TOPK;
    if (sig && D->rounding != SMOE_ROUND_OFF) return 1;
    if (!(D->routed_scaling > 0.0 && D->routed_scaling <= 1e300)) return 1; /* NaN, inf, <= 0 */
    if (!sig && D->routed_scaling != 1.0) return 1;
    if (D->n_group < 0 || D->topk_group < 0 || (D->n_group == 0) != (D->topk_group == 0)) return 1;
    if (D->n_group > 0) {
        if (!sig || D->E % D->n_group != 0 || D->E / D->n_group < 2) return 1;
        if (D->topk_group > D->n_group || D->topk_group * (D->E / D->n_group) < D->K) return 1;
    }
    if (D->device < 0) return 1;
    if (D->consume_saved != 0 && D->consume_saved != 1) return 1;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz r = {data, size};
    smoe_layer_desc D = smoe_layer_desc_default();
    D.d = fz_size(&r, 64);
    D.n = fz_size(&r, 64);
    D.E = fz_size(&r, 16);
    D.K = fz_range(&r, -1, 17);
    D.activation = (smoe_activation)(int)fz_range(&r, -1, 7);
    D.w1_layout = (smoe_w1_layout)(int)fz_range(&r, -1, 2);
    D.has_bias = (int)fz_range(&r, -1, 2);
    D.routing = (smoe_routing)(int)fz_range(&r, -1, 4);
    D.renormalize = (int)fz_range(&r, -1, 2);
    D.rounding = (smoe_rounding)(int)fz_range(&r, -1, 4);
    D.round_tile = fz_size(&r, 256);
    D.dtype = (smoe_dtype)(int)fz_range(&r, -1, 3);
    /* CPU or AUTO mostly (this build has no GPU backend: those say NO_DEVICE) */
    D.backend = (smoe_backend)(int)fz_range(&r, -1, 4);
    D.device = (int)fz_range(&r, -1, 1);
    /* SIGMOID_TOPK's fields: mostly off, else small groups, scales incl. bad ones */
    if (fz_range(&r, 0, 3) == 0) {
        D.n_group = fz_range(&r, -1, 8);
        D.topk_group = fz_range(&r, -1, 8);
    }
    {
        static const double scales[] = {1.0, 2.5, 0.0, -1.0, INFINITY, NAN, 1e-30};
        D.routed_scaling = scales[fz_range(&r, 0, 6)];
    }
    D.consume_saved = (int)fz_range(&r, -1, 2);

    smoe_layer *L = NULL;
    smoe_status st = smoe_layer_create(&D, &L);
    FZ_CHECK((st == SMOE_SUCCESS) == (L != NULL), "status %d, layer %p", (int)st, (void *)L);
    if (st != SMOE_SUCCESS) {
        FZ_CHECK(smoe_last_error()[0], "refused (%s) without a message", smoe_status_string(st));
        FZ_CHECK(st > SMOE_SUCCESS && st <= SMOE_ERROR_INTERNAL && st != SMOE_ERROR_INTERNAL,
                 "status %d", (int)st);
        return 0;
    }
    FZ_CHECK(!breaks_a_rule(&D), "accepted a description that breaks a rule of smoe.h");
    FZ_CHECK(smoe_layer_backend(L) == SMOE_BACKEND_CPU, "backend %d", smoe_layer_backend(L));

    for (int q = 0; q < 4; q++) {
        int64_t T = fz_size(&r, 4096), pairs = fz_size(&r, 4096);
        size_t ws = smoe_layer_workspace_bytes(L, T, pairs);
        size_t sb = smoe_layer_saved_bytes(L, T, pairs);
        FZ_CHECK((ws == 0) == (sb == 0), "T %lld pairs %lld: workspace %zu, saved %zu",
                 (long long)T, (long long)pairs, ws, sb);
        if (sb) {
            FZ_CHECK(T >= 1, "T = %lld accepted", (long long)T);
            /* H alone: rows x h_cols elements of the dtype */
            const int gated = D.activation <= SMOE_ACT_REGLU;
            const double rows = D.routing == SMOE_ROUTING_GENERAL ? (double)pairs
                                                                  : (double)T * (double)D.K;
            const double esz = D.dtype == SMOE_DTYPE_F64 ? 8 : D.dtype == SMOE_DTYPE_F32 ? 4 : 2;
            const double h = rows * (double)D.n * (gated ? 2.0 : 1.0) * esz;
            FZ_CHECK((double)sb >= h, "saved %zu < H's %.0f bytes (T %lld pairs %lld)", sb, h,
                     (long long)T, (long long)pairs);
        } else {
            FZ_CHECK(smoe_last_error()[0], "size query refused without a message");
        }
        /* a backward's own size: refused exactly when the sizes are, at
         * most SMOE_CALL_BACKWARD's, whatever dw1 says (the query reads no
         * buffer) */
        static char dummy[16];
        smoe_backward_args a;
        memset(&a, 0, sizeof a);
        a.T = T;
        a.pairs = pairs;
        a.dw1.ptr = fz_u32(&r) % 2 ? dummy : NULL;
        a.dw1.dtype = (smoe_dtype)(fz_u32(&r) % 5);
        a.dw1.accumulate = (int)(fz_u32(&r) % 3);
        const size_t bb = smoe_layer_call_workspace_bytes(L, SMOE_CALL_BACKWARD, T, pairs);
        const size_t own = smoe_layer_backward_workspace_bytes(L, &a);
        FZ_CHECK((own == 0) == (bb == 0) && own <= bb,
                 "T %lld pairs %lld: backward_workspace_bytes %zu, SMOE_CALL_BACKWARD %zu",
                 (long long)T, (long long)pairs, own, bb);
    }
    smoe_layer_free(L);
    return 0;
}
