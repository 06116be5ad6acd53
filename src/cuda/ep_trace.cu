/*
 * ep_trace.cu -- where an expert-parallel call's time goes: SMOE_EP_TRACE=1
 * in the environment when the layer is created (a debugging aid, as the
 * single layer's SMOE_CUDA_TIMING is; off otherwise, and then every call
 * below returns at once).
 *
 * Each call records a timing event at each of its marks: on the caller's
 * stream (s: routing, pack, each chunk's wait, GEMMs and sums, the join,
 * the weight gradients) or on the exchanges' stream (c: when a part of the
 * rows, dout or x has arrived, when a chunk's partial sums are through).
 * A mark's time is from the call's first mark. Nothing waits during the
 * calls: a call's events are read when the next call of the same direction
 * begins, if its last event has completed (cudaEventQuery; a benchmark that
 * synchronises each iteration has them all), else that call is not
 * counted. The first call of each direction is left out (unless it is the
 * only one): it loads the kernels' modules and connects NCCL's peers, which
 * put 5 ms into the mean forward of 23 calls on one H200 (114 ms in one
 * call). The layer's free reads the last one after a synchronisation and
 * prints to stderr, per direction, the mean time of every mark over the
 * calls read, in time order, with the step since the previous mark of the
 * same stream. A call being captured into a CUDA graph is
 * not traced. One call at a time, as the layer already requires.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_internal.h"
#include "cuda/ep_cuda.h"

#define EP_TRACE_MAX 128

typedef struct ep_trace_dir {
    cudaEvent_t ev[EP_TRACE_MAX];
    const char *name[EP_TRACE_MAX]; /* the call in flight's marks */
    int idx[EP_TRACE_MAX];          /* its chunk or part, -1: none */
    char cs[EP_TRACE_MAX];          /* 1: on the exchanges' stream */
    int n, pending, truncated;
    int captured;                   /* the call in flight is being captured: no marks */
    int first_out;                  /* the direction's first call was left out */
    /* the calls read: their marks (the first call's; a call whose marks
     * differ is left out and counted) and each mark's summed time */
    const char *mname[EP_TRACE_MAX];
    int midx[EP_TRACE_MAX];
    char mcs[EP_TRACE_MAX];
    int nm;
    double sum[EP_TRACE_MAX];
    long calls, unread, differ;
} ep_trace_dir;

struct ep_trace {
    ep_trace_dir d[2]; /* forward, backward */
    int off;           /* an event call failed: the trace stopped (said once) */
};

void ep_trace_make(ep_cuda *X)
{
    const char *e = getenv("SMOE_EP_TRACE");
    if (!e || e[0] != '1') return;
    X->tr = (ep_trace *)calloc(1, sizeof *X->tr);
    for (int w = 0; X->tr && w < 2; w++)
        for (int i = 0; i < EP_TRACE_MAX; i++)
            if (cudaEventCreate(&X->tr->d[w].ev[i]) != cudaSuccess) {
                cudaGetLastError();
                ep_trace_free(X); /* the events made so far */
                break;
            }
    if (!X->tr) fprintf(stderr, "smoe ep trace: no memory or events for it, no trace\n");
}

/* The call's marks read into the sums (its events have completed). */
static void take(ep_trace_dir *D)
{
    D->pending = 0;
    if (D->n < 2) return;
    int same = D->calls == 0 || D->nm == D->n;
    for (int i = 0; same && D->calls && i < D->n; i++)
        same = D->mname[i] == D->name[i] && D->midx[i] == D->idx[i] && D->mcs[i] == D->cs[i];
    if (!same) {
        D->differ++;
        return;
    }
    double ms[EP_TRACE_MAX];
    for (int i = 0; i < D->n; i++) {
        float f = 0.0f;
        if (cudaEventElapsedTime(&f, D->ev[0], D->ev[i]) != cudaSuccess) {
            cudaGetLastError();
            D->unread++;
            return;
        }
        ms[i] = f;
    }
    if (D->calls == 0) {
        D->nm = D->n;
        memcpy(D->mname, D->name, sizeof D->mname);
        memcpy(D->midx, D->idx, sizeof D->midx);
        memcpy(D->mcs, D->cs, sizeof D->mcs);
    }
    for (int i = 0; i < D->n; i++) D->sum[i] += ms[i];
    D->calls++;
}

void ep_trace_begin(const ep_cuda *X, int bwd, cudaStream_t s)
{
    ep_trace *t = X->tr;
    if (!t || t->off) return;
    ep_trace_dir *D = &t->d[bwd];
    /* a call captured into a graph is not traced (an event query there
     * would end the capture), nor counted */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &cap) != cudaSuccess) cudaGetLastError();
    D->captured = cap != cudaStreamCaptureStatusNone;
    if (D->captured) return;
    if (D->pending && !D->first_out) { /* the first call: left out */
        D->first_out = 1;
        D->pending = 0;
    }
    if (D->pending) {
        const cudaError_t q = cudaEventQuery(D->ev[D->n - 1]);
        if (q == cudaSuccess) {
            take(D);
        } else {
            if (q != cudaErrorNotReady) cudaGetLastError();
            D->unread++;
            D->pending = 0;
        }
    }
    D->n = 0;
    ep_trace_mark(X, bwd, s, 0, "start", -1);
}

void ep_trace_mark(const ep_cuda *X, int bwd, cudaStream_t s, int on_cs, const char *name,
                   int idx)
{
    ep_trace *t = X->tr;
    if (!t || t->off) return;
    ep_trace_dir *D = &t->d[bwd];
    if (D->captured) return;
    if (D->n >= EP_TRACE_MAX) {
        D->truncated = 1;
        return;
    }
    if (cudaEventRecord(D->ev[D->n], s) != cudaSuccess) {
        cudaGetLastError();
        fprintf(stderr, "smoe ep trace: cudaEventRecord failed (graph capture?), trace stopped\n");
        t->off = 1;
        return;
    }
    D->name[D->n] = name;
    D->idx[D->n] = idx;
    D->cs[D->n] = (char)on_cs;
    D->n++;
    D->pending = 1;
}

static void report(const smoe_ep_layer *ep, ep_trace *t, int w)
{
    static const char *what[2] = {"forward", "backward"};
    ep_trace_dir *D = &t->d[w];
    const int only_first = D->pending && !D->first_out; /* one call, the first */
    if (D->pending && cudaEventSynchronize(D->ev[D->n - 1]) == cudaSuccess) take(D);
    cudaGetLastError();
    if (!D->calls) return;
    int order[EP_TRACE_MAX];
    for (int i = 0; i < D->nm; i++) { /* in time order (insertion: a few dozen marks) */
        int k = i;
        for (; k > 0 && D->sum[order[k - 1]] > D->sum[i]; k--) order[k] = order[k - 1];
        order[k] = i;
    }
    char buf[8192];
    int o = snprintf(buf, sizeof buf,
                     "smoe ep trace, rank %d of %d, %s, mean of %ld calls (%s, %ld unread, "
                     "%ld with other marks%s), %s:\n",
                     ep->r, ep->P, what[w], D->calls,
                     only_first ? "the first call alone" : "the first left out", D->unread,
                     D->differ, D->truncated ? ", marks past 128 dropped" : "", ep->path);
    /* each mark's time, and the step since the last mark of its stream */
    double last[2] = {0.0, 0.0};
    for (int k = 0; k < D->nm && o < (int)sizeof buf; k++) {
        const int i = order[k], c = D->mcs[i] != 0;
        const double t = D->sum[i] / (double)D->calls;
        char nm[64];
        if (D->midx[i] >= 0) snprintf(nm, sizeof nm, "%s %d", D->mname[i], D->midx[i]);
        else snprintf(nm, sizeof nm, "%s", D->mname[i]);
        o += snprintf(buf + o, sizeof buf - (size_t)o, "  r%d %c %8.3f ms  +%7.3f  %s\n", ep->r,
                      c ? 'c' : 's', t, t - last[c], nm);
        last[c] = t;
    }
    fputs(buf, stderr); /* one write: the ranks' threads print at once */
}

void ep_trace_report(const smoe_ep_layer *ep)
{
    ep_cuda *X = ep->cuda;
    if (!X || !X->tr) return;
    if (!X->tr->off) {
        report(ep, X->tr, 0);
        report(ep, X->tr, 1);
    }
    ep_trace_free(X);
}

void ep_trace_free(ep_cuda *X)
{
    ep_trace *t = X->tr;
    if (!t) return;
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < EP_TRACE_MAX; i++)
            if (t->d[w].ev[i]) cudaEventDestroy(t->d[w].ev[i]);
    free(t);
    X->tr = NULL;
}
