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
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct sd_ctx *CUcontext;
typedef struct sd_stream *CUstream;
typedef struct sd_module *CUmodule;
typedef struct sd_func *CUfunction;
typedef struct sd_event *CUevent;
typedef void (*standin_host_fn)(void *);

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_UNKNOWN = 999,
};

#define DRIVER_VERSION 12040 /* what cuDriverGetVersion reports: CUDA 12.4 */
#define N_DEVICES 8          /* one 8-GPU node */
#define DEVICE_MEM (80ULL << 30)
#define QUEUE_DEPTH 1024 /* launches block when a stream has this many pending (as a full push buffer) */
#define COPY_LATENCY_NS 4000.0
#define COPY_BYTES_PER_NS 20.0 /* ~20 GB/s host<->device */
#define MAX_FUNCS 256
#define NAME_LEN 128

#define MAGIC_CTX 0x43545843u
#define MAGIC_STREAM 0x5354524du
#define MAGIC_MODULE 0x4d4f444cu
#define MAGIC_FUNC 0x46554e43u
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

/* ------------------------------------------------------------------------------ time */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t_ns) {
    struct timespec ts = {(time_t)(t_ns / 1000000000ull), (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

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

struct sd_ctx {
    uint32_t magic;
    CUdevice dev;
    pthread_mutex_t mu;
    struct sd_stream *streams; /* every stream of the context, the default one first */
};

struct sd_func {
    uint32_t magic;
    char name[NAME_LEN];
    double ns_per_block;
    _Atomic double scale;
};

struct sd_module {
    uint32_t magic;
    int nfuncs;
    struct sd_func funcs[];
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

struct alloc {
    uintptr_t base;
    size_t size;
};

static atomic_int g_initialized;
static __thread struct sd_ctx *tls_ctx;
static _Atomic double g_device_scale = 1.0;
static int g_launch_blocking; /* CUDA_LAUNCH_BLOCKING=1 */

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *g_allocs;
static size_t g_nallocs, g_cap_allocs;
static unsigned long long g_mem_used;

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
    default: {
        /* Back-to-back operations start when the previous one ends in the model, not when the
           worker woke up: oversleeping on a busy host does not accumulate into the GPU timeline. */
        uint64_t start = o->enq_ns > s->model_free_ns ? o->enq_ns : s->model_free_ns;
        uint64_t end = start + o->dur_ns;
        if (o->kind == OP_COPY && o->bytes) memcpy(o->dst, o->src, o->bytes);
        sleep_until(end);
        s->model_free_ns = end;
        return;
    }
    }
    /* a wait or a collective ended now: what follows starts from here, not from the model's past */
    t = now_ns();
    if (t > s->model_free_ns) s->model_free_ns = t;
}

static void *stream_worker(void *arg) {
    struct sd_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->completed == s->submitted) pthread_cond_wait(&s->work, &s->mu);
        struct op o = s->q[s->completed % QUEUE_DEPTH];
        pthread_mutex_unlock(&s->mu);
        run_op(s, &o);
        pthread_mutex_lock(&s->mu);
        s->completed++;
        /* wake host threads only when one can proceed: a drained stream or a freed queue slot */
        if (s->host_waiters && (s->completed == s->submitted || s->submitted - s->completed == QUEUE_DEPTH - 1))
            pthread_cond_broadcast(&s->done);
        if (s->ev_waiters) pthread_cond_broadcast(&s->passed);
    }
    return NULL;
}

static CUresult stream_new(struct sd_ctx *ctx, int priority, struct sd_stream **out) {
    struct sd_stream *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = MAGIC_STREAM;
    s->priority = priority;
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    pthread_cond_init(&s->passed, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024); /* it runs NCCL's enqueued work too */
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&s->thread, &attr, stream_worker, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&ctx->mu);
    /* append: the default stream stays first */
    struct sd_stream **p = &ctx->streams;
    while (*p) p = &(*p)->next;
    *p = s;
    pthread_mutex_unlock(&ctx->mu);
    *out = s;
    return CUDA_SUCCESS;
}

/* NULL, CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) name the current context's
   default stream (per-thread default streams are not modelled separately). */
static CUresult stream_of(CUstream h, struct sd_stream **out) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if ((uintptr_t)h <= 2) {
        if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
        *out = tls_ctx->streams;
        return CUDA_SUCCESS;
    }
    if (h->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    *out = h;
    return CUDA_SUCCESS;
}

/* With s->mu held: wait for a free queue slot (as a full push buffer blocks the host). */
static void stream_reserve_locked(struct sd_stream *s) {
    while (s->submitted - s->completed >= QUEUE_DEPTH) {
        s->host_waiters++;
        pthread_cond_wait(&s->done, &s->mu);
        s->host_waiters--;
    }
}

/* With s->mu held and a slot reserved: append; returns the operation's 1-based index (the
   stream has run it once completed >= index). */
static uint64_t stream_commit_locked(struct sd_stream *s, const struct op *o) {
    s->q[s->submitted % QUEUE_DEPTH] = *o;
    s->submitted++;
    pthread_cond_signal(&s->work);
    return s->submitted;
}

static void stream_push(struct sd_stream *s, const struct op *o) {
    pthread_mutex_lock(&s->mu);
    stream_reserve_locked(s);
    stream_commit_locked(s, o);
    pthread_mutex_unlock(&s->mu);
}

static void stream_drain(struct sd_stream *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->submitted;
    while (s->completed < target) {
        s->host_waiters++;
        pthread_cond_wait(&s->done, &s->mu);
        s->host_waiters--;
    }
    pthread_mutex_unlock(&s->mu);
}

/* ------------------------------------------------------------------------------ memory */

static int alloc_find(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nallocs; i++)
        if (p >= g_allocs[i].base && p + n <= g_allocs[i].base + g_allocs[i].size) return 1;
    return 0;
}

static int device_range_ok(CUdeviceptr p, size_t n) {
    pthread_mutex_lock(&g_mem_mu);
    int ok = alloc_find((uintptr_t)p, n);
    pthread_mutex_unlock(&g_mem_mu);
    return ok;
}

/* ------------------------------------------------------------------------------ module images */

/* Our module image format (passed to cuModuleLoadData as a NUL-terminated string):
 *
 *   standin-module v1
 *   # comment
 *   kernel <name> <ns_per_block>
 *
 * A real cubin/PTX is rejected with CUDA_ERROR_INVALID_IMAGE. */
static CUresult parse_image(const char *text, struct sd_module **out) {
    static const char header[] = "standin-module v1";
    if (strncmp(text, header, sizeof(header) - 1) != 0) return CUDA_ERROR_INVALID_IMAGE;
    struct sd_module *m = calloc(1, sizeof(*m) + MAX_FUNCS * sizeof(struct sd_func));
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MAGIC_MODULE;
    const char *line = strchr(text, '\n');
    while (line) {
        line++;
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        char buf[256];
        if (len >= sizeof(buf)) goto bad;
        memcpy(buf, line, len);
        buf[len] = 0;
        char name[NAME_LEN];
        double ns;
        char *p = buf;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == 0 || *p == '#') {
            line = eol;
            continue;
        }
        if (sscanf(p, "kernel %127s %lf", name, &ns) != 2 || ns < 0 || m->nfuncs >= MAX_FUNCS) goto bad;
        struct sd_func *f = &m->funcs[m->nfuncs++];
        f->magic = MAGIC_FUNC;
        snprintf(f->name, sizeof(f->name), "%s", name);
        f->ns_per_block = ns;
        atomic_store(&f->scale, 1.0);
        line = eol;
    }
    *out = m;
    return CUDA_SUCCESS;
bad:
    free(m);
    return CUDA_ERROR_INVALID_IMAGE;
}

/* ------------------------------------------------------------------------------ API */

API CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    const char *lb = getenv("CUDA_LAUNCH_BLOCKING");
    g_launch_blocking = lb && lb[0] == '1';
    atomic_store(&g_initialized, 1);
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = N_DEVICES;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= N_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= N_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    struct sd_ctx *c = calloc(1, sizeof(*c));
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = MAGIC_CTX;
    c->dev = dev;
    pthread_mutex_init(&c->mu, NULL);
    struct sd_stream *s;
    CUresult rc = stream_new(c, 0, &s); /* the default stream */
    if (rc != CUDA_SUCCESS) {
        free(c);
        return rc;
    }
    tls_ctx = c; /* documented: the new context is made current for the calling thread */
    *pctx = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx && ctx->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    tls_ctx = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    struct sd_ctx *c = tls_ctx;
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&c->mu);
    struct sd_stream *first = c->streams;
    pthread_mutex_unlock(&c->mu);
    /* streams are only ever appended, so the list can be walked without the lock */
    for (struct sd_stream *s = first; s; s = s->next) stream_drain(s);
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!phStream || (Flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    return stream_new(tls_ctx, 0, phStream);
}

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

API CUresult cuStreamSynchronize(CUstream hStream) {
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    stream_drain(s);
    return CUDA_SUCCESS;
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

/* ------------------------------------------------------------------------------ memory API */

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t size = (bytesize + 4095) & ~(size_t)4095;
    pthread_mutex_lock(&g_mem_mu);
    CUresult rc = CUDA_SUCCESS;
    if (g_mem_used + size > DEVICE_MEM) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    if (g_nallocs == g_cap_allocs) {
        size_t cap = g_cap_allocs ? 2 * g_cap_allocs : 64;
        struct alloc *a = realloc(g_allocs, cap * sizeof(*a));
        if (!a) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        g_allocs = a;
        g_cap_allocs = cap;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    g_allocs[g_nallocs++] = (struct alloc){(uintptr_t)p, size};
    g_mem_used += size;
    *dptr = (CUdeviceptr)(uintptr_t)p;
out:
    pthread_mutex_unlock(&g_mem_mu);
    return rc;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mem_mu);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < g_nallocs; i++) {
        if (g_allocs[i].base == (uintptr_t)dptr) {
            munmap((void *)g_allocs[i].base, g_allocs[i].size);
            g_mem_used -= g_allocs[i].size;
            g_allocs[i] = g_allocs[--g_nallocs];
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_mem_mu);
    return rc;
}

static CUresult push_copy(void *dst, const void *src, size_t n, CUstream hStream) {
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    struct op o = {OP_COPY, (uint64_t)(COPY_LATENCY_NS + (double)n / COPY_BYTES_PER_NS), now_ns(), dst, src, n};
    stream_push(s, &o);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                  CUstream hStream) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (ByteCount && (!srcHost || !device_range_ok(dstDevice, ByteCount))) return CUDA_ERROR_INVALID_VALUE;
    return push_copy((void *)(uintptr_t)dstDevice, srcHost, ByteCount, hStream);
}

API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (ByteCount && (!dstHost || !device_range_ok(srcDevice, ByteCount))) return CUDA_ERROR_INVALID_VALUE;
    return push_copy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount, hStream);
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    if (!tls_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    return parse_image(image, module);
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!hmod || hmod->magic != MAGIC_MODULE) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < hmod->nfuncs; i++) {
        if (strcmp(hmod->funcs[i].name, name) == 0) {
            *hfunc = &hmod->funcs[i];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                            unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                            unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    (void)kernelParams;
    (void)extra;
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!f || f->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ ||
        (unsigned long long)blockDimX * blockDimY * blockDimZ > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    double blocks = (double)gridDimX * gridDimY * gridDimZ;
    double ns = f->ns_per_block * blocks * atomic_load(&f->scale) * atomic_load(&g_device_scale);
    if (ns > 3.6e12) ns = 3.6e12; /* an hour: keeps the sum in range */
    struct op o = {OP_KERNEL, (uint64_t)ns, now_ns(), NULL, NULL, 0};
    stream_push(s, &o);
    if (g_launch_blocking) stream_drain(s);
    return CUDA_SUCCESS;
}

/* Not CUDA: make one function (or, with f == NULL, every kernel of the device) `factor` times
   slower from the next launch on. Fault injection for stragglers and pipeline bubbles. */
API CUresult standinScaleKernel(CUfunction f, double factor) {
    if (!(factor > 0)) return CUDA_ERROR_INVALID_VALUE;
    if (!f) {
        atomic_store(&g_device_scale, factor);
        return CUDA_SUCCESS;
    }
    if (f->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    atomic_store(&f->scale, factor);
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const char *s;
    switch (error) {
    case CUDA_SUCCESS: s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: s = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: s = "initialization error"; break;
    case CUDA_ERROR_NO_DEVICE: s = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_INVALID_DEVICE: s = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_IMAGE: s = "device kernel image is invalid"; break;
    case CUDA_ERROR_INVALID_CONTEXT: s = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: s = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: s = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: s = "device not ready"; break;
    case CUDA_ERROR_LAUNCH_FAILED: s = "unspecified launch failure"; break;
    case CUDA_ERROR_UNKNOWN: s = "unknown error"; break;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = s;
    return CUDA_SUCCESS;
}
