/*
 * fuzz_layer.c -- a small whole layer, forward then backward, on the CPU
 * backend, with random sizes, flags and dtypes, and every buffer a pointer
 * into one arena: usually a well-placed slot of its own, sometimes an
 * arbitrary offset (overlapping another buffer, misaligned, running off the
 * arena's end is impossible by construction but sizes may be understated),
 * sometimes NULL; the saved and workspace sizes given may be short.
 * Oracle: the library never touches a byte it was not told it may write: a
 * refused call leaves the whole arena as it was, an accepted call changes
 * nothing outside its outputs, saved block and workspace (as sized by the
 * size queries; the backward writes the saved block only with
 * desc.consume_saved, and then a second backward with it is refused, with
 * "consumed", writing nothing); AddressSanitizer watches the arena's edges
 * and everything else, UndefinedBehaviorSanitizer the arithmetic
 * (misaligned loads included).
 */
#include "fuzz_util.h"

#define ARENA (1 << 16)

typedef struct slot {
    size_t off, bytes;
    int null;
} slot;

static unsigned char *arena, *before;
static size_t next_free;

/* A buffer of `bytes` with element alignment `align`. */
static slot take(fz *r, size_t bytes, size_t align) {
    slot s = {0, bytes, 0};
    const uint32_t kind = fz_u8(r) % 32;
    if (kind == 0) {
        s.null = 1;
    } else if (kind == 1 && ARENA > bytes) {
        s.off = (size_t)fz_range(r, 0, (int64_t)(ARENA - bytes)); /* anywhere: overlap, misalign */
    } else {
        size_t o = (next_free + 63) / 64 * 64;
        if (o + bytes > ARENA) {
            s.null = 1;
            return s;
        }
        s.off = o;
        next_free = o + bytes;
    }
    (void)align;
    return s;
}

static void *ptr(slot s) { return s.null ? NULL : arena + s.off; }

/* bytes [off, off+n) may be written */
static unsigned char *writable;
static void may_write(slot s, size_t n) {
    if (s.null) return;
    if (n > ARENA - s.off) n = ARENA - s.off;
    memset(writable + s.off, 1, n);
}

static void fill_values(slot s, smoe_dtype dt, size_t elems, fz *r) {
    if (s.null) return;
    const size_t es = dt == SMOE_DTYPE_F64 ? 8 : dt == SMOE_DTYPE_F32 ? 4 : 2;
    for (size_t i = 0; i < elems && s.off + (i + 1) * es <= ARENA; i++) {
        const float v = (fz_u8(r) & 31) == 0 ? fz_float(r) : ((float)fz_u8(r) - 128.0f) / 128.0f;
        unsigned char *p = arena + s.off + i * es;
        if (dt == SMOE_DTYPE_F64) {
            double d = v;
            memcpy(p, &d, 8);
        } else if (dt == SMOE_DTYPE_F32) {
            memcpy(p, &v, 4);
        } else {
            uint32_t u;
            memcpy(&u, &v, 4);
            uint16_t h = (uint16_t)(u >> 16);
            memcpy(p, &h, 2);
        }
    }
}

static void check_writes(smoe_status st, const char *call) {
    if (!memcmp(arena, before, ARENA)) return;
    for (size_t i = 0; i < ARENA; i++) {
        if (arena[i] == before[i]) continue;
        FZ_CHECK(st == SMOE_SUCCESS && writable[i],
                 "%s (%s) wrote arena byte %zu, which it %s", call, smoe_status_string(st), i,
                 st == SMOE_SUCCESS ? "was not given" : "must not touch after refusing");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz r = {data, size};
    if (!arena) {
        arena = (unsigned char *)malloc(ARENA);
        before = (unsigned char *)malloc(ARENA);
        writable = (unsigned char *)malloc(ARENA);
    }
    memset(arena, 0, ARENA);
    next_free = 0;

    smoe_layer_desc D = smoe_layer_desc_default();
    static const smoe_dtype dts[3] = {SMOE_DTYPE_F32, SMOE_DTYPE_BF16, SMOE_DTYPE_F64};
    D.dtype = dts[fz_u8(&r) % 3];
    D.d = fz_range(&r, 1, 12);
    D.n = fz_range(&r, 1, 8);
    D.E = fz_range(&r, 1, 6);
    D.K = fz_range(&r, 1, D.E);
    D.activation = (smoe_activation)(int)fz_range(&r, 0, 6);
    D.w1_layout = (smoe_w1_layout)(int)fz_range(&r, 0, 1);
    D.has_bias = (int)(fz_u8(&r) & 1);
    const int mode = (int)fz_range(&r, 0, 5);
    D.routing = mode == 0 ? SMOE_ROUTING_TOPK_SOFTMAX
                : mode == 1 ? SMOE_ROUTING_GENERAL : SMOE_ROUTING_SOFTMAX_TOPK;
    D.renormalize = (int)(fz_u8(&r) & 1);
    D.rounding = mode >= 3 ? (smoe_rounding)(mode - 2) : SMOE_ROUND_OFF;
    D.round_tile = fz_range(&r, 1, 8);
    D.consume_saved = (int)(fz_u8(&r) & 1);
    D.backend = SMOE_BACKEND_CPU;
    smoe_layer *L = NULL;
    FZ_CHECK(smoe_layer_create(&D, &L) == SMOE_SUCCESS, "create");
    const int general = D.routing == SMOE_ROUTING_GENERAL;
    const int64_t T = fz_range(&r, 1, 12), d = D.d, n = D.n, E = D.E;
    const int64_t hc = D.activation <= SMOE_ACT_REGLU ? 2 * n : n;
    const size_t es = D.dtype == SMOE_DTYPE_F64 ? 8 : D.dtype == SMOE_DTYPE_F32 ? 4 : 2;
    int64_t np = 0;
    if (general) np = fz_range(&r, 0, T * E);
    const size_t sb = smoe_layer_saved_bytes(L, T, np), wb = smoe_layer_workspace_bytes(L, T, np);
    FZ_CHECK(sb && wb, "size queries refused a valid T");

    slot x = take(&r, (size_t)(T * d) * es, es), wr = take(&r, (size_t)(E * d) * es, es);
    slot w1 = take(&r, (size_t)(E * hc * d) * es, es), w2 = take(&r, (size_t)(E * d * n) * es, es);
    slot b1 = take(&r, (size_t)(E * hc) * es, es), b2 = take(&r, (size_t)(E * d) * es, es);
    slot out = take(&r, (size_t)(T * d) * es, es);
    /* router_logits: fp32 (mostly), the layer's dtype, or an invalid dtype */
    const int ldc = fz_u8(&r) & 7;
    const smoe_dtype ldt = ldc < 5 ? SMOE_DTYPE_F32 : ldc < 7 ? D.dtype : (smoe_dtype)fz_range(&r, 1, 9);
    const size_t ls = ldt == SMOE_DTYPE_F64 ? 8 : ldt == SMOE_DTYPE_BF16 ? 2 : 4;
    slot lg = take(&r, (size_t)(T * E) * ls, ls), cnt = take(&r, (size_t)E * 4, 4);
    slot pt = take(&r, (size_t)np * 4, 4), pe = take(&r, (size_t)np * 4, 4);
    slot ps = take(&r, (size_t)np * 4, 4);
    slot saved = take(&r, sb, 16), ws = take(&r, wb, 16);
    fill_values(x, D.dtype, (size_t)(T * d), &r);
    fill_values(wr, D.dtype, (size_t)(E * d), &r);
    fill_values(w1, D.dtype, (size_t)(E * hc * d), &r);
    fill_values(w2, D.dtype, (size_t)(E * d * n), &r);
    fill_values(b1, D.dtype, (size_t)(E * hc), &r);
    fill_values(b2, D.dtype, (size_t)(E * d), &r);
    /* triples: token t's pairs in order, or whatever bytes follow */
    if (general) {
        for (int64_t i = 0; i < np; i++) {
            int32_t t = (int32_t)(i / E), e = (int32_t)(i % E);
            if ((fz_u8(&r) & 15) == 0) t = (int32_t)fz_range(&r, -1, T);
            if ((fz_u8(&r) & 15) == 0) e = (int32_t)fz_range(&r, -1, E);
            float s = (fz_u8(&r) & 15) == 0 ? fz_float(&r) : 0.5f;
            if (!pt.null && pt.off + (size_t)(i + 1) * 4 <= ARENA) memcpy(arena + pt.off + i * 4, &t, 4);
            if (!pe.null && pe.off + (size_t)(i + 1) * 4 <= ARENA) memcpy(arena + pe.off + i * 4, &e, 4);
            if (!ps.null && ps.off + (size_t)(i + 1) * 4 <= ARENA) memcpy(arena + ps.off + i * 4, &s, 4);
        }
    }
    smoe_forward_args a;
    memset(&a, 0, sizeof a);
    a.T = T;
    a.x = ptr(x);
    a.router_w = general ? NULL : ptr(wr);
    a.pairs = np;
    a.pair_token = (const int32_t *)ptr(pt);
    a.pair_expert = (const int32_t *)ptr(pe);
    a.pair_score = (const float *)ptr(ps);
    a.w1 = ptr(w1); a.w2 = ptr(w2);
    a.b1 = D.has_bias ? ptr(b1) : NULL;
    a.b2 = D.has_bias ? ptr(b2) : NULL;
    a.out = ptr(out);
    a.router_logits = general || (fz_u8(&r) & 1) ? NULL : ptr(lg);
    a.router_logits_dtype = ldt;
    a.expert_counts = fz_u8(&r) & 1 ? (int32_t *)ptr(cnt) : NULL;
    a.inference = (fz_u8(&r) & 7) == 0;
    /* the sizes given: usually right, sometimes short */
    const size_t sb_given = (fz_u8(&r) & 15) == 0 ? sb - (size_t)fz_range(&r, 1, (int64_t)sb) : sb;
    const size_t wb_given = (fz_u8(&r) & 15) == 0 ? wb - (size_t)fz_range(&r, 1, (int64_t)wb) : wb;

    memset(writable, 0, ARENA);
    may_write(out, (size_t)(T * d) * es);
    if (a.router_logits) may_write(lg, (size_t)(T * E) * ls);
    if (a.expert_counts) may_write(cnt, (size_t)E * 4);
    if (!a.inference) may_write(saved, sb);
    may_write(ws, wb);
    memcpy(before, arena, ARENA);
    smoe_status st = smoe_layer_forward(L, &a, ptr(saved), sb_given, ptr(ws), wb_given, NULL);
    check_writes(st, "forward");
    if (st != SMOE_SUCCESS) FZ_CHECK(smoe_last_error()[0], "refused without a message");

    if (st == SMOE_SUCCESS && !a.inference) {
        slot dout = take(&r, (size_t)(T * d) * es, es);
        fill_values(dout, D.dtype, (size_t)(T * d), &r);
        const smoe_dtype gdt = fz_u8(&r) & 1 ? SMOE_DTYPE_F32 : D.dtype;
        const size_t gs = gdt == SMOE_DTYPE_F64 ? 8 : gdt == SMOE_DTYPE_F32 ? 4 : 2;
        slot gx = take(&r, (size_t)(T * d) * gs, gs), gwr = take(&r, (size_t)(E * d) * gs, gs);
        slot gw1 = take(&r, (size_t)(E * hc * d) * gs, gs), gw2 = take(&r, (size_t)(E * d * n) * gs, gs);
        slot gb1 = take(&r, (size_t)(E * hc) * gs, gs), gb2 = take(&r, (size_t)(E * d) * gs, gs);
        slot gps = take(&r, (size_t)np * 4, 4);
        smoe_backward_args b;
        memset(&b, 0, sizeof b);
        b.T = T;
        b.x = a.x;
        b.router_w = a.router_w;
        b.pairs = np;
        b.w1 = a.w1; b.w2 = a.w2; b.b2 = a.b2;
        b.dout = ptr(dout);
        const int acc = fz_u8(&r) & 1;
        b.dx = (smoe_grad){ptr(gx), gdt, acc};
        b.drouter_w = (smoe_grad){general ? NULL : ptr(gwr), gdt, acc};
        b.dw1 = (smoe_grad){ptr(gw1), gdt, acc};
        b.db1 = (smoe_grad){D.has_bias ? ptr(gb1) : NULL, gdt, acc};
        b.dw2 = (smoe_grad){ptr(gw2), gdt, acc};
        b.db2 = (smoe_grad){D.has_bias ? ptr(gb2) : NULL, gdt, acc};
        b.dpair_score = (smoe_grad){general && np ? ptr(gps) : NULL, SMOE_DTYPE_F32, acc};
        memset(writable, 0, ARENA);
        if (b.dx.ptr) may_write(gx, (size_t)(T * d) * gs);
        if (b.drouter_w.ptr) may_write(gwr, (size_t)(E * d) * gs);
        if (b.dw1.ptr) may_write(gw1, (size_t)(E * hc * d) * gs);
        if (b.db1.ptr) may_write(gb1, (size_t)(E * hc) * gs);
        if (b.dw2.ptr) may_write(gw2, (size_t)(E * d * n) * gs);
        if (b.db2.ptr) may_write(gb2, (size_t)(E * d) * gs);
        if (b.dpair_score.ptr) may_write(gps, (size_t)np * 4);
        if (D.consume_saved) may_write(saved, sb);
        may_write(ws, wb);
        memcpy(before, arena, ARENA);
        st = smoe_layer_backward(L, &b, ptr(saved), sb, ptr(ws), wb, NULL);
        check_writes(st, "backward");
        if (st == SMOE_SUCCESS && D.consume_saved) {
            /* the block is consumed: the same call again is refused */
            memset(writable, 0, ARENA);
            memcpy(before, arena, ARENA);
            st = smoe_layer_backward(L, &b, ptr(saved), sb, ptr(ws), wb, NULL);
            check_writes(st, "second backward");
            FZ_CHECK(st == SMOE_ERROR_INVALID_VALUE && strstr(smoe_last_error(), "consumed"),
                     "second backward with a consumed block -> %s", smoe_status_string(st));
        }
    }
    smoe_layer_free(L);
    return 0;
}
