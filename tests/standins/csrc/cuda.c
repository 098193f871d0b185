/*
 * A stand-in for the CUDA driver (libcuda.so.1), written from NVIDIA's public driver API
 * reference only. It implements the subset a small training loop needs, with the documented C
 * signatures (the tracer reads arguments by position), and models a GPU by time:
 *
 *   - every stream is served by one worker thread; launches and async copies only enqueue and
 *     return, the worker "runs" each operation by sleeping its modelled duration (never spinning:
 *     eight ranks and a tracer share two cores);
 *   - a kernel's duration is   ns_per_block(function) x gridX*gridY*gridZ x scale(function)
 *     x scale(device), where ns_per_block comes from the module image (a text format of our own,
 *     see parse_image) and the scales are set by standinScaleKernel (fault injection);
 *   - "device memory" is anonymous MAP_NORESERVE memory, so a job may allocate realistic gradient
 *     buffers without committing them; copies really copy.
 *
 * Deliberately absent: every cuEvent* function (a job that records no CUDA-event timers),
 * cuLaunchKernelEx, synchronous memcpy/memset, cuStreamQuery/WaitEvent. Not modelled: ordering
 * between streams (the legacy default stream does not synchronise with other streams), SM sharing
 * between concurrent streams.
 *
 * CUDA_LAUNCH_BLOCKING=1 (read at cuInit, as CUDA documents it) makes every launch return only
 * when its kernel has run: the host is then on the GPU's critical path, so a slow "GPU" makes its
 * host late at the next collective.
 *
 * Two extra exports, outside the CUDA API: standinStreamWait (what the stand-in NCCL calls to
 * wait for "the GPU" to reach a collective, so that the tracer does not see host syncs the
 * program never made) and standinScaleKernel.
 *
 * What it shares with the async variant (cuda_async.c) is in cuda_common.h and cuda_common_api.h;
 * this file holds the blocking family's streams (kernels and copies only) and standinStreamWait.
 */
#define _GNU_SOURCE
#include "cuda_common.h"

/* ------------------------------------------------------------------------------ streams */

enum op_kind { OP_KERNEL, OP_COPY };

struct op {
    int kind;
    uint64_t dur_ns;
    uint64_t enq_ns;
    void *dst;
    const void *src;
    size_t bytes;
};

struct sd_stream {
    uint32_t magic;
    struct sd_ctx *ctx;
    pthread_mutex_t mu;
    pthread_cond_t work; /* worker waits here for operations */
    pthread_cond_t done; /* host threads wait here for completions */
    int host_waiters;
    uint64_t submitted, completed;
    uint64_t model_free_ns; /* when the previous operation ends in the model (worker only) */
    pthread_t thread;
    struct sd_stream *next;
    struct op q[QUEUE_DEPTH];
};

#define STREAM_STACK_BYTES (64 * 1024)

#include "cuda_common_api.h"

/* Only kernels and copies here: every operation is modelled time. */
static void run_op(struct sd_stream *s, const struct op *o) { run_model_op(s, o); }

/* No priorities, no event waiters. */
static void stream_init(struct sd_stream *s, int priority) {
    (void)s;
    (void)priority;
}

static void stream_ran_locked(struct sd_stream *s) { (void)s; }

/* ------------------------------------------------------------------------------ API */

/* Not CUDA: the stand-in NCCL's way to wait for a stream without running cuStreamSynchronize,
   which the tracer counts as a host sync the program made. Its own body (not a call, and not
   identical code that the compiler could fold into one function): before cuInit there is no GPU
   work to wait for. */
API CUresult standinStreamWait(CUstream hStream) {
    if (!atomic_load(&g_initialized)) return CUDA_SUCCESS;
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc == CUDA_SUCCESS) stream_drain(s);
    return rc;
}
