/*
 * ep.c -- the expert-parallel layer (smoe.h, "expert parallelism";
 * notes/ep_design.md): P ranks, each with E/P experts and its own tokens.
 *
 * Forward, on each rank:
 *   1. routing of its own tokens (the CPU backend's router code), or the
 *      caller's GENERAL triples (global experts);
 *   2. dispatch: each token goes once to every rank holding one of its
 *      experts, into slot s of the send buffer for that rank (slots in
 *      token order), with its pairs there (local expert, score), at most
 *      Kmax = min(K, E/P) per slot (GENERAL: E/P);
 *   3. exchange of the per-destination counts, then of the rows and pairs,
 *      each slice `capacity` rows;
 *   4. the expert side: the received rows are "virtual tokens" v = source
 *      * capacity + slot, their pairs GENERAL triples over the E/P local
 *      experts, computed by a GENERAL layer of the backend (H saved there);
 *      its output row v is the token's partial sum over this rank's experts;
 *   5. exchange of the partials back; each token's output is the sum of its
 *      partials in rank order.
 * Backward: x and dout go out again by the same slots (the expert side keeps
 * no copy of x; with desc.keep_x it does, in the saved block, and only dout
 * travels), the GENERAL layer's backward gives each virtual token's dx
 * partial and each pair's score gradient dS, which come back; the token's
 * rank sums dx partials in rank order, gathers its dS and runs the router's
 * backward (dlogits, its share of dWr, dx += dlogits Wr).
 *
 * Transport: an in-process group (ranks are threads; the exchange is a copy
 * between barriers). Every call begins with an exchange of the ranks'
 * validation results, so a call refused on one rank is refused on every
 * rank (none waits for a rank that left).
 *
 * This file holds create and free (the description's checks, the whole
 * layer and the experts' GENERAL layer); ep_calls.c the calls, their sizes
 * and the CPU path; ep_group.c the in-process group. The CUDA backends'
 * path, over the caller's NCCL communicator, is src/cuda/ep_cuda.cu (the
 * same steps on the device, no host synchronisation; a host refusal there
 * is this rank's alone, smoe.h).
 */
#include "ep_internal.h"
#include "routing.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ the layer */

smoe_ep_desc smoe_ep_desc_default(void)
{
    smoe_ep_desc d;
    memset(&d, 0, sizeof d);
    d.layer = smoe_layer_desc_default();
    d.nranks = 1;
    return d;
}

/* The checks of one rank's description (P ranks). */
static smoe_status desc_checks(const smoe_ep_desc *desc, int P, const char *fn)
{
    const smoe_layer_desc *L = &desc->layer;
    const int r = desc->rank;
    smoe_status st = SMOE_SUCCESS;
    if (desc->nranks != P)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: desc.nranks = %d, but the group has %d ranks",
                       fn, desc->nranks, P);
    else if (r < 0 || r >= P)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: desc.rank = %d, must be in [0, %d)", fn, r, P);
    else if ((st = smoe_desc_validate(L)) != SMOE_SUCCESS) {
    } else if (L->E % P != 0)
        st = smoe_fail(SMOE_ERROR_INVALID_SIZE,
                       "%s: E = %lld experts cannot be split evenly over %d ranks", fn,
                       (long long)L->E, P);
    else if (L->rounding != SMOE_ROUND_OFF)
        st = smoe_fail(SMOE_ERROR_UNSUPPORTED,
                       "%s: token rounding ranks every rank's tokens per expert; not supported "
                       "with expert parallelism",
                       fn);
    else if (desc->max_tokens < 0 || desc->max_tokens > INT32_MAX / 2 || desc->capacity < 0 ||
             desc->capacity > INT32_MAX / 2 || desc->expert_rows < 0)
        st = smoe_fail(SMOE_ERROR_INVALID_SIZE,
                       "%s: max_tokens = %lld, capacity = %lld, expert_rows = %lld: each must be "
                       "in [0, 2^30)",
                       fn, (long long)desc->max_tokens, (long long)desc->capacity,
                       (long long)desc->expert_rows);
    else if (L->consume_saved)
        st = smoe_fail(SMOE_ERROR_UNSUPPORTED,
                       "%s: layer.consume_saved = 1: the expert-parallel backward only reads "
                       "its saved block (not supported with expert parallelism; set it to 0)",
                       fn);
    else if (desc->overlap < -1 || desc->overlap > 2)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: overlap = %d, must be -1, 0, 1 or 2", fn,
                       desc->overlap);
    else if (desc->comm_sms < -1 || desc->comm_sms > 1024)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: comm_sms = %d, must be in [-1, 1024]", fn,
                       desc->comm_sms);
    else if (desc->keep_x < 0 || desc->keep_x > 1)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: keep_x = %d, must be 0 or 1", fn,
                       desc->keep_x);
    else if (desc->copy_engines < -1 || desc->copy_engines > 1)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE, "%s: copy_engines = %d, must be -1, 0 or 1", fn,
                       desc->copy_engines);
    else if (desc->copy_engines == 1 && L->backend == SMOE_BACKEND_CPU)
        st = smoe_fail(SMOE_ERROR_UNSUPPORTED,
                       "%s: copy_engines = 1: the CPU backend's exchanges are host copies", fn);
    else if (desc->copy_engines == 1 && (desc->overlap == -1 || desc->overlap == 2))
        st = smoe_fail(SMOE_ERROR_UNSUPPORTED,
                       "%s: copy_engines = 1 with overlap = %d: the copy engines' exchanges "
                       "run beside the expert GEMMs in both directions (overlap 0 or 1)",
                       fn, desc->overlap);
    else if (desc->overlap >= 1 && L->backend == SMOE_BACKEND_CPU)
        st = smoe_fail(SMOE_ERROR_UNSUPPORTED,
                       "%s: overlap = %d (required): the CPU backend exchanges, then computes",
                       fn, desc->overlap);
    return st;
}

/* The layer of a checked description: its sizes, the whole layer and the
 * experts' GENERAL layer. */
static smoe_status layer_make(const smoe_ep_desc *desc, int P, smoe_ep_layer **out)
{
    const char *fn = "smoe_ep_layer_create";
    const smoe_layer_desc *L = &desc->layer;
    smoe_ep_layer *ep = (smoe_ep_layer *)calloc(1, sizeof *ep);
    SMOE_RETURN_ERROR_IF(!ep, SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation failed", fn);
    ep->desc = *desc;
    ep->P = P;
    ep->r = desc->rank;
    ep->El = L->E / P;
    ep->C = desc->capacity ? desc->capacity : desc->max_tokens;
    const int64_t K = L->routing == SMOE_ROUTING_GENERAL ? L->E : L->K;
    ep->Kmax = K < ep->El ? K : ep->El;
    const int64_t worst = (int64_t)P * ep->C * ep->Kmax;
    ep->rows = desc->expert_rows && desc->expert_rows < worst ? desc->expert_rows : worst;
    smoe_layer_desc full = *L, ex = *L;
    ex.E = ep->El;
    ex.K = 0;
    ex.routing = SMOE_ROUTING_GENERAL;
    ex.renormalize = 0;
    ex.n_group = ex.topk_group = 0; /* the router's; the experts take triples */
    ex.routed_scaling = 1.0;
    smoe_status st = smoe_layer_create(&full, &ep->full);
    if (st == SMOE_SUCCESS) st = smoe_layer_create(&ex, &ep->experts);
    if (st != SMOE_SUCCESS) {
        smoe_ep_layer_free(ep);
        return st;
    }
    *out = ep;
    return SMOE_SUCCESS;
}

smoe_status smoe_ep_layer_create(const smoe_ep_desc *desc, smoe_ep_layer **out)
{
    const char *fn = "smoe_ep_layer_create";
    SMOE_REQUIRE_PTR(out, "out");
    *out = NULL;
    SMOE_REQUIRE_PTR(desc, "desc");
    if (desc->layer.backend != SMOE_BACKEND_CPU) {
        /* NCCL: this rank's checks, then the descriptions compared over the
         * communicator (cuda/ep_nccl.cu) */
        SMOE_RETURN_ERROR_IF(desc->group, SMOE_ERROR_INVALID_VALUE,
                             "%s: desc.group is the CPU backend's in-process transport; the CUDA "
                             "backends take desc.nccl_comm",
                             fn);
        SMOE_REQUIRE_PTR(desc->nccl_comm, "desc.nccl_comm (the CUDA backends' transport)");
        SMOE_RETURN_ERROR_IF(desc->nranks < 1 || desc->nranks > 64, SMOE_ERROR_UNSUPPORTED,
                             "%s: desc.nranks = %d, must be in [1, 64] on the CUDA backends", fn,
                             desc->nranks);
        SMOE_FORWARD_IF_ERROR(desc_checks(desc, desc->nranks, fn));
#ifdef SMOE_WITH_CUDA
        smoe_ep_layer *ep = NULL;
        SMOE_FORWARD_IF_ERROR(layer_make(desc, desc->nranks, &ep));
        smoe_status st = smoe_ep_cuda_init(ep);
        if (st != SMOE_SUCCESS) {
            smoe_ep_layer_free(ep);
            return st;
        }
        *out = ep;
        return SMOE_SUCCESS;
#else
        return smoe_fail(SMOE_ERROR_NO_DEVICE, "%s: this library was built without CUDA", fn);
#endif
    }
    SMOE_REQUIRE_PTR(desc->group, "desc.group (the CPU backend's in-process transport)");
    SMOE_RETURN_ERROR_IF(desc->nccl_comm, SMOE_ERROR_INVALID_VALUE,
                         "%s: desc.nccl_comm is the CUDA backends' transport; the CPU backend "
                         "takes desc.group",
                         fn);
    smoe_ep_group *g = desc->group;
    const int P = g->P, r = desc->rank;
    /* the checks of this rank, then every rank's verdict */
    smoe_status st = desc_checks(desc, P, fn);
    /* the same description on every rank (rank aside) */
    smoe_ep_desc mine = *desc, *all = NULL;
    if (st == SMOE_SUCCESS) {
        all = (smoe_ep_desc *)malloc(sizeof *all * (size_t)P);
        if (!all) st = smoe_fail(SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation failed", fn);
    }
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    mine.rank = 0;
    mine.group = NULL;
    smoe_ep_group_allgather(g, r, &mine, all, sizeof mine);
    int differ = -1;
    for (int q = 0; q < P && differ < 0; q++) {
        smoe_ep_desc o = all[q];
        o.rank = 0;
        o.group = NULL;
        if (memcmp(&o, &mine, sizeof o) != 0) differ = q;
    }
    free(all);
    if (differ >= 0)
        st = smoe_fail(SMOE_ERROR_INVALID_VALUE,
                       "%s: rank %d's description differs from rank %d's (every field but rank "
                       "must match)",
                       fn, differ, r);
    SMOE_FORWARD_IF_ERROR(smoe_ep_agree(g, r, st, fn));
    smoe_ep_layer *ep = NULL;
    st = smoe_ep_agree(g, r, layer_make(desc, P, &ep), fn);
    if (st != SMOE_SUCCESS) {
        smoe_ep_layer_free(ep);
        return st;
    }
    *out = ep;
    return SMOE_SUCCESS;
}

void smoe_ep_layer_free(smoe_ep_layer *ep)
{
    if (!ep) return;
    smoe_layer_free(ep->full);
#ifdef SMOE_WITH_CUDA
    smoe_ep_cuda_free(ep);
#endif
    smoe_layer_free(ep->experts);
    free(ep);
}

/* ------------------------------------------------------------ device status, path */

smoe_status smoe_ep_layer_device_status(smoe_ep_layer *ep, void *stream, int wait)
{
    SMOE_RETURN_ERROR_IF(!ep, SMOE_ERROR_NULL_POINTER, "smoe_ep_layer_device_status: layer is NULL");
    /* the EP call's own checks report to the whole layer's record, the
     * experts' GENERAL calls to theirs */
    const smoe_status a = smoe_layer_device_status(ep->full, stream, wait);
    if (a == SMOE_SUCCESS) return smoe_layer_device_status(ep->experts, stream, wait);
    /* the experts' record, when set, is this failure's consequence: read
     * (cleared) too, the first message kept */
    char text[512];
    snprintf(text, sizeof text, "%s", smoe_last_error());
    (void)smoe_layer_device_status(ep->experts, stream, wait);
    return smoe_fail(a, "%s", text);
}

const char *smoe_ep_layer_path_name(const smoe_ep_layer *ep)
{
    if (!ep) return "";
    return ep->path[0] ? ep->path : smoe_layer_path_name(ep->experts);
}
