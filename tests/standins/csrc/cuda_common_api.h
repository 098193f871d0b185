/*
 * The second half of what both stand-in libcudas share (see cuda_common.h): one worker thread per
 * stream, the stream queue, and the CUDA API both variants export with the same behaviour.
 *
 * Before including it the variant defines:
 *   - enum op_kind with OP_KERNEL and OP_COPY;
 *   - struct op with  int kind; uint64_t dur_ns, enq_ns; void *dst; const void *src; size_t bytes;
 *     (what kernels and copies set; other fields are zero for them);
 *   - struct sd_stream with  uint32_t magic; struct sd_ctx *ctx; pthread_mutex_t mu;
 *     pthread_cond_t work, done; int host_waiters; uint64_t submitted, completed, model_free_ns;
 *     pthread_t thread; struct sd_stream *next; struct op q[QUEUE_DEPTH];
 *   - STREAM_STACK_BYTES, the worker threads' stack size;
 *   - STANDIN_CUDA_EVENTS if cuGetErrorString should name CUDA_ERROR_NOT_READY.
 * and afterwards the three functions declared below.
 */
#ifndef STANDIN_CUDA_COMMON_API_H
#define STANDIN_CUDA_COMMON_API_H

#include "cuda_common.h"

#ifndef STREAM_STACK_BYTES
#error "define STREAM_STACK_BYTES (and the variant's stream types) before including cuda_common_api.h"
#endif

/* The variant's: what the worker does with one operation (kernels and copies: run_model_op) */
static void run_op(struct sd_stream *s, const struct op *o);
/* The variant's: the rest of a new stream's state, set before its worker starts */
static void stream_init(struct sd_stream *s, int priority);
/* The variant's: the worker completed one more operation (s->mu held, host waiters woken) */
static void stream_ran_locked(struct sd_stream *s);

/* ------------------------------------------------------------------------------ streams */

/* A kernel or a copy: sleep its modelled duration. */
static void run_model_op(struct sd_stream *s, const struct op *o) {
    /* Back-to-back operations start when the previous one ends in the model, not when the worker
       woke up: oversleeping on a busy host does not accumulate into the GPU timeline. */
    uint64_t start = o->enq_ns > s->model_free_ns ? o->enq_ns : s->model_free_ns;
    uint64_t end = start + o->dur_ns;
    if (o->kind == OP_COPY && o->bytes) memcpy(o->dst, o->src, o->bytes);
    sleep_until(end);
    s->model_free_ns = end;
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
        if (s->host_waiters && (s->completed == s->submitted || s->submitted - s->completed == g_queue_depth - 1))
            pthread_cond_broadcast(&s->done);
        stream_ran_locked(s);
    }
    return NULL;
}

static CUresult stream_new(struct sd_ctx *ctx, int priority, struct sd_stream **out) {
    struct sd_stream *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = MAGIC_STREAM;
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    stream_init(s, priority);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, STREAM_STACK_BYTES);
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
    while (s->submitted - s->completed >= g_queue_depth) {
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

/* ------------------------------------------------------------------------------ API */

API CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    const char *lb = getenv("CUDA_LAUNCH_BLOCKING");
    g_launch_blocking = lb && lb[0] == '1';
    /* STANDIN_LAUNCH_QUEUE: a driver that holds fewer pending launches a stream (vendors differ) */
    const char *qd = getenv("STANDIN_LAUNCH_QUEUE");
    long q = qd ? atol(qd) : 0;
    g_queue_depth = q > 1 && q < QUEUE_DEPTH ? (uint64_t)q : QUEUE_DEPTH;
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

API CUresult cuStreamSynchronize(CUstream hStream) {
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    stream_drain(s);
    return CUDA_SUCCESS;
}

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
    uint64_t dur = (uint64_t)(COPY_LATENCY_NS + (double)n / COPY_BYTES_PER_NS);
    struct op o = {.kind = OP_COPY, .dur_ns = dur, .enq_ns = now_ns(), .dst = dst, .src = src, .bytes = n};
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
    struct op o = {.kind = OP_KERNEL, .dur_ns = (uint64_t)ns, .enq_ns = now_ns()};
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
#ifdef STANDIN_CUDA_EVENTS
    case CUDA_ERROR_NOT_READY: s = "device not ready"; break;
#endif
    case CUDA_ERROR_LAUNCH_FAILED: s = "unspecified launch failure"; break;
    case CUDA_ERROR_UNKNOWN: s = "unknown error"; break;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = s;
    return CUDA_SUCCESS;
}

#endif
