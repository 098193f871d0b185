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

static void run_op(struct sd_stream *s, const struct op *o) {
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
        if (s->host_waiters && (s->completed == s->submitted || s->submitted - s->completed == QUEUE_DEPTH - 1))
            pthread_cond_broadcast(&s->done);
    }
    return NULL;
}

static CUresult stream_new(struct sd_ctx *ctx, struct sd_stream **out) {
    struct sd_stream *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = MAGIC_STREAM;
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
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

static void stream_push(struct sd_stream *s, const struct op *o) {
    pthread_mutex_lock(&s->mu);
    while (s->submitted - s->completed >= QUEUE_DEPTH) {
        s->host_waiters++;
        pthread_cond_wait(&s->done, &s->mu);
        s->host_waiters--;
    }
    s->q[s->submitted % QUEUE_DEPTH] = *o;
    s->submitted++;
    pthread_cond_signal(&s->work);
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
    CUresult rc = stream_new(c, &s); /* the default stream */
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
    return stream_new(tls_ctx, phStream);
}

API CUresult cuStreamSynchronize(CUstream hStream) {
    struct sd_stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc != CUDA_SUCCESS) return rc;
    stream_drain(s);
    return CUDA_SUCCESS;
}

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
    case CUDA_ERROR_LAUNCH_FAILED: s = "unspecified launch failure"; break;
    case CUDA_ERROR_UNKNOWN: s = "unknown error"; break;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = s;
    return CUDA_SUCCESS;
}
