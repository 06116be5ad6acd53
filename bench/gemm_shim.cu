/*
 * gemm_shim.cu -- a C-ABI door onto the grouped-GEMM launcher tables
 * (src/cuda/gemm.h), for bench/gemm_vs_torch.py (ctypes). Built by
 * `make gemm-shim` into build/libsmoe_gemm_shim.so, which links libsmoe.a
 * statically: the tables are hidden in libsmoe.so but reachable from the
 * archive. Only the smoe_shim_* functions are exported on purpose.
 *
 * ptrs[] per kind (device pointers; NULL where the launcher allows it):
 *   0 up   : x (T,d), w1 (E,h_cols,d), b1, h (cap,h_cols), a (cap,n)
 *   1 down : a (cap,n), w2 (E,d,n), b2, y (cap,d)
 *   2 dh   : dout (T,d), w2, b2, h, dh (cap,h_cols), a_scaled (cap,n), ds (cap) fp32
 *   3 dw2  : dout (T,d), a_scaled (cap,n), dw2 (E,d,n)
 *   4 dxt  : dh (cap,h_cols), w1, dxt (cap,d)
 *   5 dw1  : dh (cap,h_cols), x (T,d), dw1 (E,h_cols,d)
 * dw2/dw1 take out_dtype (SMOE_DTYPE_F32 / SMOE_DTYPE_BF16) and accumulate
 * from the problem struct. Each call runs the table's default plan for the
 * problem's shape on the current device (smoe_gemm_ops.plan), where the
 * table has one.
 *
 * Returns the launcher's smoe_status (>= 0), or a negative shim code:
 *   SMOE_SHIM_NO_ENTRY  the table leaves this kind NULL,
 *   SMOE_SHIM_BAD_ARG   unknown table or kind, or a NULL problem/ptrs.
 */
#include <string.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda/gemm.h"

#define SHIM_API extern "C" __attribute__((visibility("default")))

enum { SMOE_SHIM_NO_ENTRY = -1, SMOE_SHIM_BAD_ARG = -2 };

/* The plain C problem; bench/gemm_vs_torch.py mirrors it field by field and
 * checks its size against smoe_shim_problem_size(). */
typedef struct smoe_shim_problem {
    int64_t d, n, h_cols, E, cap;
    const int32_t *expert_offset; /* (E+1), device */
    const int32_t *row_token;     /* (cap), device */
    const float *row_score;       /* (cap), device */
    int32_t gated, act, w1_layout, num_sms;
    int32_t out_dtype, accumulate; /* dw2 / dw1 only */
} smoe_shim_problem;

static const smoe_gemm_ops *shim_table(int table)
{
    if (table == 0) return &smoe_gemm_ops_sm80;
#ifdef SMOE_WITH_SM90
    if (table == 1) return &smoe_gemm_ops_sm90;
#endif
    return NULL;
}

static smoe_gemm_problem shim_problem(const smoe_shim_problem *q)
{
    smoe_gemm_problem p;
    memset(&p, 0, sizeof p); /* abort NULL: no device-side check here */
    p.d = q->d;
    p.n = q->n;
    p.h_cols = q->h_cols;
    p.E = q->E;
    p.cap = q->cap;
    p.gated = q->gated;
    p.act = (smoe_activation)q->act;
    p.w1_layout = (smoe_w1_layout)q->w1_layout;
    p.expert_offset = q->expert_offset;
    p.row_token = q->row_token;
    p.row_score = q->row_score;
    p.num_sms = q->num_sms;
    return p;
}

SHIM_API size_t smoe_shim_problem_size(void) { return sizeof(smoe_shim_problem); }

/* 1 when the table exists in this build (sm90 needs SMOE_WITH_SM90). */
SHIM_API int smoe_shim_has_table(int table) { return shim_table(table) != NULL; }

SHIM_API const char *smoe_shim_table_name(int table)
{
    const smoe_gemm_ops *t = shim_table(table);
    return t ? t->name : "";
}

/* The library's thread-local message of the last failed call. */
SHIM_API const char *smoe_shim_last_error(void) { return smoe_last_error(); }

SHIM_API size_t smoe_shim_scratch_bytes(int table, const smoe_shim_problem *q)
{
    const smoe_gemm_ops *t = shim_table(table);
    if (!t || !q || !t->scratch_bytes) return 0;
    smoe_gemm_problem p = shim_problem(q);
    return t->scratch_bytes(&p);
}

SHIM_API int smoe_shim_gemm(int table, int kind, const smoe_shim_problem *q, void *const ptrs[8],
                            void *scratch, void *stream)
{
    const smoe_gemm_ops *t = shim_table(table);
    if (!t || !q || !ptrs) return SMOE_SHIM_BAD_ARG;
    smoe_gemm_problem p = shim_problem(q);
    smoe_gemm_plan plan;
    if (t->plan) {
        t->plan(&p, &plan);
        p.plan = &plan;
    }
    cudaStream_t s = (cudaStream_t)stream;
    const smoe_dtype od = (smoe_dtype)q->out_dtype;
#define B(i) ((bf16 *)ptrs[i])
    switch (kind) {
    case 0:
        if (!t->up) return SMOE_SHIM_NO_ENTRY;
        return t->up(&p, B(0), B(1), B(2), B(3), B(4), scratch, s);
    case 1:
        if (!t->down) return SMOE_SHIM_NO_ENTRY;
        return t->down(&p, B(0), B(1), B(2), B(3), scratch, s);
    case 2:
        if (!t->dh) return SMOE_SHIM_NO_ENTRY;
        return t->dh(&p, B(0), B(1), B(2), B(3), B(4), B(5), (float *)ptrs[6], scratch, s);
    case 3:
        if (!t->dw2) return SMOE_SHIM_NO_ENTRY;
        return t->dw2(&p, B(0), B(1), ptrs[2], od, q->accumulate, scratch, s);
    case 4:
        if (!t->dxt) return SMOE_SHIM_NO_ENTRY;
        return t->dxt(&p, B(0), B(1), B(2), scratch, s);
    case 5:
        if (!t->dw1) return SMOE_SHIM_NO_ENTRY;
        return t->dw1(&p, B(0), B(1), ptrs[2], od, q->accumulate, scratch, s);
    default:
        return SMOE_SHIM_BAD_ARG;
    }
#undef B
}
