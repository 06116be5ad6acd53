/*
 * ep_kernels.cu -- the expert-parallel layer's own kernels (ep_cuda.cu's
 * schedule launches them; ep_cuda.h declares them): the source side's
 * entries (each token's destination ranks) and the pack of rows and pairs
 * by entry, the counts and status messages and their checks, the expert
 * side's rows, triples and chunk offsets, the backward's pack of x and
 * dout, the scatter and gather of dS, and the outputs (counts, logits, the
 * pair-score gradient).
 */
#include "cuda/ep_cuda.h"

/* ------------------------------------------------------------ kernels */

/* Each token's destination ranks, ascending, Kq entries per token (-1
 * pads): the "assignments" of the metadata sort with E = P. Also copies the
 * routing's experts (int32) to the saved block's 16-bit assign_expert. */
__global__ void k_ep_entries(int T, int P, int64_t El, int Kq, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, uint16_t *aexp16, int32_t *dest,
                             int32_t *tok, float *score, int32_t *ent_off, int32_t *ent_count,
                             const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) {
        ent_off[T] = T * Kq;
        *ent_count = T * Kq;
    }
    if (t >= T) return;
    unsigned long long mask = 0ull;
    for (int a = toff[t]; a < toff[t + 1]; ++a) {
        mask |= 1ull << (int)(aexp[a] / El);
        aexp16[a] = (uint16_t)aexp[a];
    }
    int j = 0;
    for (int q = 0; q < P; ++q) {
        if (!(mask >> q & 1ull)) continue;
        const int64_t e = (int64_t)t * Kq + j++;
        dest[e] = q;
        tok[e] = t;
        score[e] = 0.0f;
    }
    for (; j < Kq; ++j) {
        const int64_t e = (int64_t)t * Kq + j;
        dest[e] = -1;
        tok[e] = t;
        score[e] = 0.0f;
    }
    ent_off[t] = t * Kq;
}

/* One warp per entry: its partial row pidx = ep_slot(q, i) of its
 * position i among the rows for q (-1: none, or i past capacity), x's row
 * to send[pidx] (recv[pidx] for this rank's own experts: no exchange), the
 * token's pairs on q (pick order) to pairs[(q C + i) Km ...]. whole: x
 * itself is the peers' slice, so a peer's position is the token's and its
 * row is not copied; own_x (with whole): the same for this rank's own
 * (the up GEMM reads them from x). */
__global__ void k_ep_pack(int64_t n_ent, int Kq, ep_slots sl, int Km, int64_t El, int64_t d,
                          const bf16 *__restrict__ x, const int32_t *__restrict__ toff,
                          const int32_t *__restrict__ aexp, const float *__restrict__ ascore,
                          const int32_t *__restrict__ dest, const int32_t *__restrict__ ent_row,
                          const int32_t *__restrict__ eoff, int whole, int own_x, int32_t *pidx,
                          bf16 *send_rows, bf16 *recv_rows, pair_msg *send_pairs,
                          const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int lane = threadIdx.x & 31;
    const int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (e >= n_ent) return;
    const int q = dest[e];
    const int t = (int)(e / Kq);
    const int at_token = whole && (q != sl.self || own_x); /* position t, no copy */
    int64_t p = -1, u = -1;
    if (q >= 0) {
        const int64_t i = at_token ? (int64_t)t : (int64_t)ent_row[e] - eoff[q];
        if (i < sl.C) {
            p = ep_slot(sl, q, i);
            u = (int64_t)q * sl.C + i;
        }
    }
    if (lane == 0) pidx[e] = (int32_t)p;
    if (p < 0) return;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + (int64_t)t * d);
    uint4 *dst = reinterpret_cast<uint4 *>((q == sl.self ? recv_rows : send_rows) + p * d);
    for (int64_t i = lane; !at_token && i < d / 8; i += 32) dst[i] = src[i];
    if (lane == 0) {
        int k = 0;
        for (int a = toff[t]; a < toff[t + 1]; ++a) {
            const int64_t ex = aexp[a];
            if (ex / El != q) continue;
            pair_msg m;
            m.e = (int32_t)(ex - (int64_t)q * El);
            m.s = ascore[a];
            send_pairs[u * Km + k++] = m;
        }
        for (; k < Km; ++k) {
            pair_msg m;
            m.e = -1;
            m.s = 0.0f;
            send_pairs[u * Km + k] = m;
        }
    }
}

/* The counts message to every rank: [rows for it, this rank's status]; a
 * destination past capacity sets the status (the first such rank). whole
 * (>= 0): every peer gets the whole slice of `whole` rows (x itself), and
 * with own_x this rank too. */
__global__ void k_ep_msg(int P, int self, int64_t C, const int32_t *__restrict__ eoff, int whole,
                         int own_x, int32_t *msg, smoe_dev_status *st, smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < P; ++q) {
        const int c = whole >= 0 && (q != self || own_x) ? whole : eoff[q + 1] - eoff[q];
        if (c > C && st->code == SMOE_DEV_OK) {
            st->code = SMOE_DEV_EP_OVERFLOW;
            st->first_bad = q;
            st->value = c;
            st->value2 = C;
            smoe_dev_report_error(rep, st);
        }
    }
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = whole >= 0 && (q != self || own_x) ? whole : eoff[q + 1] - eoff[q];
        msg[2 * q + 1] = st->code;
    }
}

/* After an exchange of [count, status] messages: another rank's failure
 * stops this one too (its own code first; its own message not read). */
__global__ void k_ep_peers(int P, int self, const int32_t *__restrict__ msg, smoe_dev_status *st,
                           smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0 || st->code != SMOE_DEV_OK) return;
    for (int s = 0; s < P; ++s)
        if (s != self && msg[2 * s + 1] != SMOE_DEV_OK) {
            st->code = SMOE_DEV_EP_PEER;
            st->first_bad = s;
            st->value = s;
            st->value2 = msg[2 * s + 1];
            smoe_dev_report_error(rep, st);
            return;
        }
}

/* Expert side: pairs per received row slot (0 past the source's count, in
 * an unused slot or after a failure). */
__global__ void k_ep_row_counts(int64_t Tv, ep_slots sl, int Km, const int32_t *__restrict__ msg,
                                const pair_msg *__restrict__ pairs, int32_t *cnt,
                                const int *abort)
{
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= Tv) return;
    int64_t j = 0;
    const int s = ep_slot_src(sl, v, &j);
    int c = 0;
    if (!*abort && s >= 0 && j < sl.C && j < msg[2 * s]) {
        const int64_t u = (int64_t)s * sl.C + j;
        for (int k = 0; k < Km; ++k) c += pairs[u * Km + k].e >= 0;
    }
    cnt[v] = c;
}

/* The triples in token-major order (none when more than `rows`: the
 * check after this sets the status); pe16, if not NULL, gets the experts
 * in 16 bits too (the saved block's). */
__global__ void k_ep_triples(int64_t Tv, ep_slots sl, int Km, int64_t rows,
                             const pair_msg *__restrict__ pairs,
                             const int32_t *__restrict__ off, int32_t *pt,
                             int32_t *pe, uint16_t *pe16, float *ps, int32_t *tri_slot,
                             const smoe_dev_status *st)
{
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= Tv || st->code != SMOE_DEV_OK || off[Tv] > rows) return;
    int64_t i = off[v];
    if (i >= off[v + 1]) return;
    int64_t j = 0;
    const int s = ep_slot_src(sl, v, &j);
    const int64_t u = (int64_t)s * sl.C + j;
    for (int k = 0; k < Km; ++k) {
        const pair_msg m = pairs[u * Km + k];
        if (m.e < 0 || i >= off[v + 1]) continue;
        pt[i] = (int32_t)v;
        pe[i] = m.e;
        if (pe16) pe16[i] = (uint16_t)m.e;
        ps[i] = m.s;
        tri_slot[i] = (int32_t)(u * Km + k);
        ++i;
    }
}

/* One thread: the expert side's row check (after k_ep_triples read it) and
 * the second message to every rank (it goes with the partial sums). */
__global__ void k_ep_rows_check(int P, int64_t rows, const int32_t *total, int32_t *msg,
                                smoe_dev_status *st, smoe_dev_report rep)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*total > rows && st->code == SMOE_DEV_OK) {
        st->code = SMOE_DEV_EP_ROWS;
        st->first_bad = 0;
        st->value = *total;
        st->value2 = rows;
        smoe_dev_report_error(rep, st);
    }
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = 0;
        msg[2 * q + 1] = st->code;
    }
}

/* The status message to every rank: [0, this rank's code]. */
__global__ void k_ep_status_msg(int P, int32_t *msg, const smoe_dev_status *st)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < P; ++q) {
        msg[2 * q] = 0;
        msg[2 * q + 1] = st->code;
    }
}

/* After the row check: no triples for the experts when this rank failed. */
__global__ void k_ep_rows_final(int32_t *total, const smoe_dev_status *st)
{
    if (threadIdx.x == 0 && blockIdx.x == 0 && st->code != SMOE_DEV_OK) *total = 0;
}

/* Each chunk's rows of each expert: off2[e nc + c] = the first of expert
 * e's rows [off[e], off[e+1]) whose received row is b[c] or later (its
 * rows ascend by received row), off2[El nc] = off[El]. Chunk cs >= 0 (the
 * forward's second chunk of this rank's own rows) starts on the device
 * instead: share percent into the own rows this rank sent itself
 * (eoff[self+1] - eoff[self], at most C), from b[cs - 1], rounded down per
 * expert to whole 128-row m-tiles. */
__global__ void k_ep_chunk_off(int El, int nc, ep_bounds bd, const int32_t *__restrict__ off,
                               const int32_t *__restrict__ row_token, int32_t *off2, int cs,
                               const int32_t *__restrict__ eoff, int self, int64_t C, int share,
                               const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)El * nc;
    if (i > n) return;
    if (i == n) {
        off2[n] = off[El];
        return;
    }
    const int e = (int)(i / nc), c = (int)(i % nc);
    int lo = off[e], hi = off[e + 1];
    int64_t want = bd.b[c];
    if (c == cs) {
        int64_t own = (int64_t)eoff[self + 1] - eoff[self];
        if (own > C) own = C;
        want = bd.b[c - 1] + (own * share + 99) / 100;
    }
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (row_token[mid] < want) lo = mid + 1;
        else hi = mid;
    }
    if (c == cs) {
        /* the first own chunk ends on a whole number of the expert's
         * 128-row m-tiles (the rest goes to the second), so that only the
         * second ends in a ragged tile (2 x H200, P = 2, 30B-n512, same
         * call, 3 rounds: forward 7.70-7.75 -> 7.58-7.67 ms) */
        int a = off[e], b = lo;
        while (a < b) {
            const int mid = a + (b - a) / 2;
            if (row_token[mid] < bd.b[c - 1]) a = mid + 1;
            else b = mid;
        }
        lo = a + (lo - a) / 128 * 128;
    }
    off2[i] = lo;
}

/* out[r] = in[r] - base: the rows' slots as positions in this rank's own
 * slice (own_x: the up GEMM of an own chunk gathers from x itself). */
__global__ void k_ep_rebase(int64_t n, const int32_t *__restrict__ in, int64_t base, int32_t *out,
                            const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (int32_t)(in[i] - base);
}

__global__ void k_ep_iota(int64_t n, int32_t *v, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = (int32_t)i;
}

/* counts (E) of this rank's assignments, and the logits out. */
__global__ void k_ep_outputs(int T, int E, const int32_t *__restrict__ toff,
                             const int32_t *__restrict__ aexp, int32_t *counts,
                             const float *__restrict__ lg, void *lg_out, int lg_bf16,
                             const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (lg_out && i < (int64_t)T * E) {
        if (lg_bf16) ((bf16 *)lg_out)[i] = __float2bfloat16_rn(lg[i]);
        else ((float *)lg_out)[i] = lg[i];
    }
    if (counts && i < E) {
        int c = 0;
        for (int a = 0; a < toff[T]; ++a) c += aexp[a] == (int)i;
        counts[i] = c;
    }
}

/* Backward: x and dout rows to the entries' partial rows (this rank's own
 * straight into the receive buffers); dout alone where sx is NULL (keep_x);
 * this rank's own alone with own_only (x and dout themselves travel). */
__global__ void k_ep_pack2(int64_t n_ent, int Kq, int64_t d, ep_slots sl, int own_only,
                           const bf16 *__restrict__ x, const bf16 *__restrict__ dout,
                           const int32_t *__restrict__ pidx, bf16 *sx, bf16 *sdo, bf16 *rx,
                           bf16 *rdo, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int lane = threadIdx.x & 31;
    const int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (e >= n_ent) return;
    const int64_t p = pidx[e], t = e / Kq;
    if (p < 0) return;
    const uint4 *b = reinterpret_cast<const uint4 *>(dout + t * d);
    const bool own = ep_slot_is_own(sl, p);
    if (own_only && !own) return; /* x and dout themselves travel */
    uint4 *db = reinterpret_cast<uint4 *>((own ? rdo : sdo) + p * d);
    if (!sx) { /* keep_x: the received x rows are the saved block's */
        for (int64_t i = lane; i < d / 8; i += 32) db[i] = b[i];
        return;
    }
    const uint4 *a = reinterpret_cast<const uint4 *>(x + t * d);
    uint4 *da = reinterpret_cast<uint4 *>((own ? rx : sx) + p * d);
    for (int64_t i = lane; i < d / 8; i += 32) {
        da[i] = a[i];
        db[i] = b[i];
    }
}

/* dS of the triples of received row slots [v0, v1) to their places in the
 * pairs' layout: this rank's own rows (there [own0, own1)) into recv_ds,
 * the others' into send_ds. */
__global__ void k_ep_ds_scatter(int64_t v0, int64_t v1, int64_t own0, int64_t own1, int Km,
                                const int32_t *__restrict__ toff,
                                const int32_t *__restrict__ tri_slot,
                                const int32_t *__restrict__ arow, const float *__restrict__ ds,
                                float *send_ds, float *recv_ds, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t a = toff[v0] + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (a >= toff[v1]) return;
    const int64_t slot = tri_slot[a], v = slot / Km;
    (v >= own0 && v < own1 ? recv_ds : send_ds)[slot] = ds[arow[a]];
}

/* Each assignment's dS: the k-th of the token's pairs on rank q is pair k of
 * its row there. */
__global__ void k_ep_ds_gather(int T, int Kq, int Km, int64_t El, ep_slots sl,
                               const int32_t *__restrict__ toff,
                               const uint16_t *__restrict__ aexp,
                               const int32_t *__restrict__ pidx,
                               const float *__restrict__ recv_ds, float *ds, const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    int seen[64];
    for (int q = 0; q < 64; ++q) seen[q] = 0;
    /* the token's entries are its destinations in ascending order */
    for (int a = toff[t]; a < toff[t + 1]; ++a) {
        const int q = (int)(aexp[a] / El);
        int j = 0; /* the entry of q: the number of lower destinations */
        for (int b = toff[t]; b < toff[t + 1]; ++b) {
            const int qb = (int)(aexp[b] / El);
            if (qb < q) {
                /* count distinct lower destinations */
                bool first = true;
                for (int c = toff[t]; c < b; ++c) first &= (int)(aexp[c] / El) != qb;
                j += first;
            }
        }
        const int64_t p = pidx[(int64_t)t * Kq + j];
        int64_t i = 0;
        const int64_t u = p >= 0 ? (int64_t)ep_slot_src(sl, p, &i) * sl.C + i : -1;
        ds[a] = u >= 0 ? recv_ds[u * Km + seen[q]] : 0.0f;
        ++seen[q];
    }
}

/* GENERAL: the pair-score gradient out (overwrite or accumulate). */
__global__ void k_ep_dps_out(int64_t A, const float *__restrict__ ds, float *out, int accumulate,
                             const int *abort)
{
    SMOE_DEV_RETURN_IF_ABORTED(abort);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < A) out[i] = accumulate ? out[i] + ds[i] : ds[i];
}
