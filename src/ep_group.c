/*
 * ep_group.c -- the CPU backend's transport for the expert-parallel layer:
 * an in-process group of P ranks (threads; smoe.h, smoe_ep_group), its two
 * collectives (all-to-all, all-gather: copies between barriers) and the
 * agreement every step of a call begins with (every rank's status, so a
 * call refused on one rank is refused on all).
 */
#include "ep_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ the group */

smoe_status smoe_ep_group_create(int nranks, smoe_ep_group **out)
{
    const char *fn = "smoe_ep_group_create";
    SMOE_REQUIRE_PTR(out, "out");
    *out = NULL;
    SMOE_RETURN_ERROR_IF(nranks < 1 || nranks > 4096, SMOE_ERROR_INVALID_SIZE,
                         "%s: nranks = %d, must be in [1, 4096]", fn, nranks);
    smoe_ep_group *g = (smoe_ep_group *)calloc(1, sizeof *g);
    const void **post = (const void **)calloc((size_t)nranks, sizeof *post);
    agree_msg *msgs = (agree_msg *)calloc((size_t)nranks * (size_t)nranks, sizeof *msgs);
    if (!g || !post || !msgs || pthread_barrier_init(&g->bar, NULL, (unsigned)nranks) != 0) {
        free(g);
        free(post);
        free(msgs);
        return smoe_fail(SMOE_ERROR_OUT_OF_MEMORY, "%s: allocation failed", fn);
    }
    g->P = nranks;
    g->post = post;
    g->msgs = msgs;
    *out = g;
    return SMOE_SUCCESS;
}

void smoe_ep_group_free(smoe_ep_group *g)
{
    if (!g) return;
    pthread_barrier_destroy(&g->bar);
    free(g->post);
    free(g->msgs);
    free(g);
}

/* Rank r's send + q * slice goes to rank q's recv + r * slice, for every q;
 * called by every rank (a collective). */
void smoe_ep_group_alltoall(smoe_ep_group *g, int r, const void *send, void *recv, size_t slice)
{
    g->post[r] = send;
    pthread_barrier_wait(&g->bar);
    for (int q = 0; q < g->P; q++)
        if (slice) memcpy((char *)recv + (size_t)q * slice, (const char *)g->post[q] + (size_t)r * slice, slice);
    pthread_barrier_wait(&g->bar); /* nobody reuses its send buffer before all copied */
}

/* Every rank's `bytes` into all (P x bytes), in rank order. */
void smoe_ep_group_allgather(smoe_ep_group *g, int r, const void *mine, void *all, size_t bytes)
{
    g->post[r] = mine;
    pthread_barrier_wait(&g->bar);
    for (int q = 0; q < g->P; q++) memcpy((char *)all + (size_t)q * bytes, g->post[q], bytes);
    pthread_barrier_wait(&g->bar);
}

/* ------------------------------------------------------------ agreement */

/* Every rank's status of this step; the first failing rank's (or this
 * rank's own) is returned on all of them, so none goes on alone. */
smoe_status smoe_ep_agree(smoe_ep_group *g, int r, smoe_status mine, const char *what)
{
    agree_msg m, *all = g->msgs + (size_t)r * (size_t)g->P;
    memset(&m, 0, sizeof m);
    m.status = (int32_t)mine;
    if (mine != SMOE_SUCCESS) snprintf(m.text, sizeof m.text, "%s", smoe_last_error());
    smoe_ep_group_allgather(g, r, &m, all, sizeof m);
    smoe_status st = SMOE_SUCCESS;
    for (int q = 0; q < g->P && st == SMOE_SUCCESS; q++) {
        if (all[q].status == SMOE_SUCCESS) continue;
        st = (smoe_status)all[q].status;
        if (q != r) {
            char text[252];
            memcpy(text, all[q].text, sizeof text);
            smoe_fail(st, "%s: rank %d refused the call: %s", what, q, text);
        } else {
            /* keep this rank's own message (a copy: smoe_fail formats into it) */
            char text[252];
            memcpy(text, m.text, sizeof text);
            smoe_fail(st, "%s", text);
        }
    }
    return st;
}
