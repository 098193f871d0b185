/*
 * The asynchronous variant of the stand-in CUDA driver (libcuda.so.1), written from NVIDIA's
 * public driver API reference only. Everything cuda.c does, plus what a stock PyTorch job needs
 * to run collectives asynchronously and time them with events:
 *
 *   - events: cuEventCreate, cuEventRecord, cuEventQuery, cuEventSynchronize,
 *     cuEventElapsedTime, cuEventDestroy(_v2), and cuStreamWaitEvent. A recording is a marker in
 *     its stream; the stream's worker "passes" it once every earlier operation of the stream has
 *     run, and stamps the time (CLOCK_MONOTONIC) it did so. As the reference says, a recording
 *     overwrites the event's previously captured state: cuEventQuery, cuEventSynchronize and
 *     cuStreamWaitEvent refer to the most recent recording at the time of their call, and before
 *     the first recording an event is an empty set of work (query: CUDA_SUCCESS, a wait: no-op).
 *     cuEventElapsedTime is the difference between the times the workers passed the two latest
 *     recordings (CUDA_ERROR_NOT_READY while one is pending, CUDA_ERROR_INVALID_HANDLE if one was
 *     never recorded or was created with CU_EVENT_DISABLE_TIMING). cuStreamWaitEvent makes the
 *     waiting stream's worker block, at that point of its queue, until the event's recording was
 *     passed (streams wait for each other on the "GPU", never on the host);
 *   - cuStreamCreateWithPriority / cuCtxGetStreamPriorityRange (PyTorch's stream pools); the
 *     priority is recorded, not modelled;
 *   - the legacy default stream (NULL) is an ordinary stream of the context: no implicit
 *     synchronisation with other streams is modelled (PyTorch's NCCL streams are non-blocking).
 *
 * Kernels and copies are modelled as in cuda.c: one worker thread per stream sleeps each
 * operation (never spinning), a kernel lasts ns_per_block x blocks x scale(function) x
 * scale(device). CUDA_LAUNCH_BLOCKING=1 makes launches (and NCCL's enqueued work) wait.
 *
 * Extra exports, outside the CUDA API: standinScaleKernel (fault injection) and
 * standinStreamEnqueue(stream, fn, arg), which the variant's NCCL uses to put a collective on a
 * stream: the stream's worker calls fn(arg) when it reaches it and the stream moves on when fn
 * returns (the way a real NCCL kernel occupies its stream). Absent: cuLaunchKernelEx,
 * synchronous memcpy/memset, cuStreamQuery, cuLaunchHostFunc, interprocess event handles.
 *
 * What it shares with cuda.c is in cuda_common.h and cuda_common_api.h; this file holds the
 * variant's stream operations (records, waits, host work), events and extra exports.
 */
#define _GNU_SOURCE
#include "cuda_common.h"

typedef struct sd_event *CUevent;
typedef void (*standin_host_fn)(void *);

#define MAGIC_EVENT 0x45564e54u

/* cuEventCreate flags and cuStreamWaitEvent flags (cuda.h) */
#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_EVENT_INTERPROCESS 0x4
#define CU_EVENT_WAIT_DEFAULT 0x0
#define CU_EVENT_WAIT_EXTERNAL 0x1
#define PRIORITY_LEAST 0
#define PRIORITY_GREATEST (-5)

/* ------------------------------------------------------------------------------ objects */

enum op_kind { OP_KERNEL, OP_COPY, OP_RECORD, OP_WAIT, OP_HOST };

struct sd_stream;

struct op {
    int kind;
    uint64_t dur_ns;
    uint64_t enq_ns;
    void *dst;
    const void *src;
    size_t bytes;
    struct sd_event *ev;       /* OP_RECORD: the event, and which of its recordings this is */
    uint64_t gen;
    struct sd_stream *wait_on; /* OP_WAIT: block until wait_on has completed wait_idx operations */
    uint64_t wait_idx;
    standin_host_fn fn;        /* OP_HOST: called by the worker */
    void *arg;
};

struct sd_stream {
    uint32_t magic;
    struct sd_ctx *ctx;
    pthread_mutex_t mu;
    pthread_cond_t work; /* worker waits here for operations */
    pthread_cond_t done; /* host threads wait here for completions */
    pthread_cond_t passed; /* event waiters (hosts and other streams' workers) wait here */
    int host_waiters;
    int ev_waiters;
    int priority;
    uint64_t submitted, completed;
    uint64_t model_free_ns; /* when the previous operation ends in the model (worker only) */
    pthread_t thread;
    struct sd_stream *next;
    struct op q[QUEUE_DEPTH];
};

/* One recording at a time matters: the latest (gen). Markers of older recordings still in a
   queue hold a reference, so a destroyed event lives until its last marker was passed. */
struct sd_event {
    uint32_t magic;
    unsigned flags;
    pthread_mutex_t mu;
    int refs;                 /* the handle (until cuEventDestroy) + markers not yet passed */
    uint64_t gen;             /* recordings so far; 0: never recorded (an empty set of work) */
    struct sd_stream *stream; /* of the latest recording */
    uint64_t index;           /* latest recording passed once stream->completed >= index */
    uint64_t passed_ns;       /* when the worker passed the latest recording; 0: not yet */
};

#define STREAM_STACK_BYTES (256 * 1024) /* it runs NCCL's enqueued work too */
#define STANDIN_CUDA_EVENTS

#include "cuda_common_api.h"

/* ------------------------------------------------------------------------------ streams */

static void event_unref_locked(struct sd_event *e) {
    /* called with e->mu held; unlocks it (and frees e when this was the last reference) */
    int last = --e->refs == 0;
    pthread_mutex_unlock(&e->mu);
    if (last) {
        pthread_mutex_destroy(&e->mu);
        free(e);
    }
}

/* Block until `src` has completed `idx` operations (the worker of another stream, or a host). */
static void stream_wait_index(struct sd_stream *src, uint64_t idx) {
    pthread_mutex_lock(&src->mu);
    while (src->completed < idx) {
        src->ev_waiters++;
        pthread_cond_wait(&src->passed, &src->mu);
        src->ev_waiters--;
    }
    pthread_mutex_unlock(&src->mu);
}

static void run_op(struct sd_stream *s, const struct op *o) {
    uint64_t t;
    switch (o->kind) {
    case OP_RECORD:
        /* a marker takes no GPU time: stamp when the worker got past everything before it */
        t = now_ns();
        pthread_mutex_lock(&o->ev->mu);
        if (o->gen == o->ev->gen) o->ev->passed_ns = t;
        event_unref_locked(o->ev);
        return;
    case OP_WAIT:
        stream_wait_index(o->wait_on, o->wait_idx);
        break;
    case OP_HOST:
        o->fn(o->arg);
        break;
    default:
        run_model_op(s, o);
        return;
    }
    /* a wait or a collective ended now: what follows starts from here, not from the model's past */
    t = now_ns();
    if (t > s->model_free_ns) s->model_free_ns = t;
}

static void stream_init(struct sd_stream *s, int priority) {
    s->priority = priority;
    pthread_cond_init(&s->passed, NULL);
}

static void stream_ran_locked(struct sd_stream *s) {
    if (s->ev_waiters) pthread_cond_broadcast(&s->passed);
}

/* ------------------------------------------------------------------------------ stream API */

/* Lower numbers are higher priorities; the range is what a recent data-centre GPU reports. */
API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (leastPriority) *leastPriority = PRIORITY_LEAST;
    if (greatestPriority) *greatestPriority = PRIORITY_GREATEST;
    return CUDA_SUCCESS;
}

/* A priority outside the range is clamped to it, as the reference says. */
API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!phStream || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (priority > PRIORITY_LEAST) priority = PRIORITY_LEAST;
    if (priority < PRIORITY_GREATEST) priority = PRIORITY_GREATEST;
    return stream_new(tls_ctx, priority, phStream);
}

/* Not CUDA: the variant's NCCL puts a collective on a stream with this. The stream's worker
   calls fn(arg) when it reaches it, and the stream moves on when fn returns. Like a kernel launch
   it returns at once (with CUDA_LAUNCH_BLOCKING=1: once the stream ran it). */
API CUresult standinStreamEnqueue(CUstream hStream, standin_host_fn fn, void *arg) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    struct op o = {.kind = OP_HOST, .enq_ns = now_ns(), .fn = fn, .arg = arg};
    stream_push(s, &o);
    if (g_launch_blocking) stream_drain(s);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------ events */

static int event_ok(const struct sd_event *e) { return e && e->magic == MAGIC_EVENT; }

API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    unsigned all = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~all)) return CUDA_ERROR_INVALID_VALUE;
    /* documented: an interprocess event must also disable timing */
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)) return CUDA_ERROR_INVALID_VALUE;
    struct sd_event *e = calloc(1, sizeof(*e));
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = Flags;
    e->refs = 1;
    pthread_mutex_init(&e->mu, NULL);
    *phEvent = e;
    return CUDA_SUCCESS;
}

/* Captures the stream's current contents: a marker after every operation enqueued so far. */
API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    struct op o = {.kind = OP_RECORD, .enq_ns = now_ns(), .ev = hEvent};
    /* lock order: stream, then event (workers take an event's lock without their stream's) */
    pthread_mutex_lock(&s->mu);
    stream_reserve_locked(s);
    pthread_mutex_lock(&hEvent->mu);
    o.gen = ++hEvent->gen;
    hEvent->refs++; /* the marker's */
    hEvent->stream = s;
    hEvent->passed_ns = 0;
    hEvent->index = stream_commit_locked(s, &o);
    pthread_mutex_unlock(&hEvent->mu);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

/* The latest recording: its stream and index (stream NULL: never recorded) and its time. */
static void event_latest(struct sd_event *e, struct sd_stream **stream, uint64_t *index, uint64_t *passed_ns) {
    pthread_mutex_lock(&e->mu);
    *stream = e->gen ? e->stream : NULL;
    *index = e->index;
    *passed_ns = e->passed_ns;
    pthread_mutex_unlock(&e->mu);
}

API CUresult cuEventQuery(CUevent hEvent) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    struct sd_stream *s;
    uint64_t idx, t;
    event_latest(hEvent, &s, &idx, &t);
    return (!s || t) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent hEvent) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    struct sd_stream *s;
    uint64_t idx, t;
    event_latest(hEvent, &s, &idx, &t);
    if (s && !t) stream_wait_index(s, idx);
    return CUDA_SUCCESS;
}

/* The stream's worker waits, at this point of its queue, for the event's latest recording (as
   captured now: a later cuEventRecord does not change what this wait waits for). */
API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    struct sd_stream *src;
    uint64_t idx, t;
    event_latest(hEvent, &src, &idx, &t);
    if (!src) return CUDA_SUCCESS; /* an empty set of work */
    struct op o = {.kind = OP_WAIT, .enq_ns = now_ns(), .wait_on = src, .wait_idx = idx};
    stream_push(s, &o);
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    if (!event_ok(hStart) || !event_ok(hEnd)) return CUDA_ERROR_INVALID_HANDLE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    struct sd_stream *s0, *s1;
    uint64_t i0, i1, t0, t1;
    event_latest(hStart, &s0, &i0, &t0);
    event_latest(hEnd, &s1, &i1, &t1);
    if (!s0 || !s1) return CUDA_ERROR_INVALID_HANDLE; /* never recorded */
    if (!t0 || !t1) return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)(((double)t1 - (double)t0) / 1e6);
    return CUDA_SUCCESS;
}

/* Pending recordings still complete; the memory goes with the last of them. */
static CUresult event_destroy(CUevent e) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&e->mu);
    e->magic = 0;
    event_unref_locked(e);
    return CUDA_SUCCESS;
}

/* cuda.h maps cuEventDestroy to cuEventDestroy_v2 (since CUDA 4.0); the driver exports both, as
   two functions (exported, so the compiler does not fold them into one address). */
API CUresult cuEventDestroy_v2(CUevent hEvent) { return event_destroy(hEvent); }

API CUresult cuEventDestroy(CUevent hEvent) { return event_destroy(hEvent); }
