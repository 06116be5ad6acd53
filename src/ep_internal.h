/*
 * ep_internal.h -- the expert-parallel layer's object and the CPU backend's
 * in-process group, shared by its core (src/ep.c: create, the description's
 * checks; src/ep_calls.c: the calls, the CPU path; src/ep_group.c: the
 * group) and its CUDA path (src/cuda/ep_cuda.cu).
 */
#ifndef SMOE_EP_INTERNAL_H
#define SMOE_EP_INTERNAL_H

#include "smoe_internal.h"

#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ the group (ep_group.c) */

/* A message of rank q's own status, for every rank's smoe_last_error(). */
typedef struct agree_msg {
    int32_t status;
    char text[252];
} agree_msg;

struct smoe_ep_group {
    int P;
    pthread_barrier_t bar;
    const void **post; /* (P) what each rank publishes for the exchange */
    agree_msg *msgs;   /* (P x P) each rank's copy of every rank's status */
};

/* The group's collectives and the agreement on a step's status (each
 * called by every rank; ep_group.c says more). */
void smoe_ep_group_alltoall(smoe_ep_group *g, int r, const void *send, void *recv, size_t slice);
void smoe_ep_group_allgather(smoe_ep_group *g, int r, const void *mine, void *all, size_t bytes);
smoe_status smoe_ep_agree(smoe_ep_group *g, int r, smoe_status mine, const char *what);

/* ------------------------------------------------------------ the layer */

struct smoe_ep_layer {
    smoe_ep_desc desc;
    int P, r;
    int64_t El;          /* experts per rank */
    int64_t C;           /* capacity: rows per (source, destination) */
    int64_t Kmax;        /* pairs per row (slot) */
    int64_t rows;        /* (row, expert) pairs per rank */
    smoe_layer *full;    /* the whole layer's description: checks, router */
    smoe_layer *experts; /* GENERAL over the E/P local experts: the compute */
    struct ep_cuda *cuda; /* the CUDA path's stream and events (cuda/ep_cuda.h) */
    char path[384];       /* the path name: the experts' kernels and the schedule */
};

#ifdef SMOE_WITH_CUDA
/* cuda/ep_nccl.cu. Create: NCCL loaded, the communicator checked against
 * rank and nranks, the descriptions compared over NCCL (a synchronisation,
 * at create time). */
smoe_status smoe_ep_cuda_init(smoe_ep_layer *ep);
void smoe_ep_cuda_free(smoe_ep_layer *ep); /* NULL state is fine */
/* cuda/ep_cuda.cu: the sizes and the calls. */
size_t smoe_ep_cuda_workspace_bytes(const smoe_ep_layer *ep, int64_t T, int64_t pairs);
size_t smoe_ep_cuda_saved_bytes(const smoe_ep_layer *ep, int64_t T, int64_t pairs);
smoe_status smoe_ep_cuda_forward(smoe_ep_layer *ep, const smoe_forward_args *args, void *saved,
                                 void *workspace, void *stream);
smoe_status smoe_ep_cuda_backward(smoe_ep_layer *ep, const smoe_backward_args *args,
                                  const void *saved, void *workspace, void *stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* SMOE_EP_INTERNAL_H */
