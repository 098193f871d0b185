/* Simulated libcuda.so.1: the CUDA driver API subset a training framework uses, with the real
 * exported names and C signatures, so uprobes attach and read arguments exactly as they would
 * on NVIDIA's library.
 *
 * Model: one context per process; each stream is a FIFO served by a worker thread that keeps
 * the stream's virtual GPU time (see simgpu.h). A kernel's duration is its module-declared
 * ns-per-block times the grid size; copies take latency + bytes / bandwidth; events complete
 * when the stream reaches them; host-blocking calls sleep until the virtual completion time.
 * Kernels enqueued on an idle stream are accounted without waking the worker, so thousands of
 * launches per step cost the host almost nothing beyond the call itself.
 *
 * Not modelled: the legacy default stream's implicit synchronisation with other streams,
 * graphs, unified memory, peer access. Device memory is address space only (no bytes move).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simgpu.h"

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

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

#define MAGIC_CTX 0x43545831u
#define MAGIC_STREAM 0x53545231u
#define MAGIC_EVENT 0x45564e31u
#define MAGIC_MOD 0x4d4f4431u
#define MAGIC_FUNC 0x46554e31u
#define CU_EVENT_DISABLE_TIMING 0x2
#define QCAP 4096
#define MAX_FUNCS 256

/* Bandwidths in bytes per ns (= GB/s), latencies in ns. */
#define PCIE_BW 25.0
#define PCIE_LAT 2000
#define HBM_BW 1500.0
#define HBM_LAT 1000

enum { OP_KERNEL, OP_EVENT, OP_WAIT_EVENT, OP_FN };

struct op {
    int kind;
    int64_t enq_ns;
    int64_t dur_ns;
    int64_t end_ns; /* written when completed */
    CUevent ev;
    uint64_t ev_gen;
    argus_sim_fn fn;
    void *arg;
    void (*free_fn)(void *);
};

struct CUstream_st {
    uint32_t magic;
    int id;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    struct op ring[QCAP];
    uint64_t head, tail; /* head: ops completed; tail: ops enqueued */
    int64_t gpu_ns;      /* virtual completion time of the last completed op */
    int failed, stop, worker_waiting;
    pthread_t th;
    struct CUstream_st *next;
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    uint64_t rec_gen, done_gen;
    int64_t ts;
};

struct CUfunc_st {
    uint32_t magic;
    double ns_per_block;
    CUmodule mod;
    char name[256];
};

struct CUmod_st {
    uint32_t magic;
    int nfuncs;
    struct CUfunc_st funcs[MAX_FUNCS];
};

struct CUctx_st {
    uint32_t magic;
    CUdevice dev;
    struct CUstream_st *streams; /* list, default stream first */
    int nstreams;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* context, stream list, events */
static pthread_cond_t g_ev_cv = PTHREAD_COND_INITIALIZER;
static int g_initialized;
/* Launch queue depth (ARGUS_SIM_LAUNCH_QUEUE, read at cuInit): an enqueue waits until the GPU has
 * completed the op `depth` places back, as a real driver's launch blocks on a full push buffer
 * (~1024 pending launches a stream). 0: only the ring's QCAP, which no preset fills. */
static uint64_t g_qdepth;
static struct CUctx_st *g_ctx;
static __thread CUcontext t_current;

/* ---- time ---------------------------------------------------------------------------- */

API int64_t argusSimNow(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_until(int64_t t_ns) {
    if (t_ns <= argusSimNow()) return;
    struct timespec ts = {.tv_sec = t_ns / 1000000000LL, .tv_nsec = t_ns % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- sync epochs: ground truth for the tracer's per-step error counts ------------------ */

/* The tracer counts non-zero CUresults per epoch of the process, and the return of a
 * host-blocking sync begins the next epoch (argus/bpf/cuda.bpf.c, libcuda.py SYNC_CALLS). The
 * trainer's cuEventQuery calls come from its main thread and from its watchdog thread at any
 * time, so the trainer cannot count their CUDA_ERROR_NOT_READY per step itself without racing
 * the step's sync; the library counts them per epoch, under the lock the query takes anyway, and
 * argusSimNotReadyCount gives a step's count (argus/sim/trainer.py). Nothing else depends on it. */
#define EPOCH_RING 4096
static uint64_t g_epoch;                /* host-blocking syncs returned so far */
static uint64_t g_notready[EPOCH_RING]; /* cuEventQuery -> CUDA_ERROR_NOT_READY, per epoch */

static __thread int64_t t_sync_enter, t_sync_exit; /* this thread's last host-blocking sync */

static void epoch_tick(int *unused) {
    (void)unused;
    t_sync_exit = argusSimNow();
    pthread_mutex_lock(&g_mu);
    g_epoch++;
    g_notready[g_epoch % EPOCH_RING] = 0;
    pthread_mutex_unlock(&g_mu);
}
/* First statement of every host-blocking sync: the epoch advances on every return path, as the
 * tracer's return probe does. */
#define SYNC_CALL()                 \
    t_sync_enter = argusSimNow();   \
    int epoch_guard__ __attribute__((cleanup(epoch_tick), unused)) = 0

/* When the calling thread's last host-blocking sync was entered and returned (CLOCK_MONOTONIC):
 * the trainer's ground truth of its sync wait, measured where a tracer measures it, not around
 * the Python call (which also waits for the GIL when another Python thread holds it). */
API void argusSimLastSync(int64_t *enter_ns, int64_t *exit_ns) {
    if (enter_ns) *enter_ns = t_sync_enter;
    if (exit_ns) *exit_ns = t_sync_exit;
}

API uint64_t argusSimSyncEpoch(void) {
    pthread_mutex_lock(&g_mu);
    uint64_t e = g_epoch;
    pthread_mutex_unlock(&g_mu);
    return e;
}

/* cuEventQuery results CUDA_ERROR_NOT_READY in epochs [from, to) (the last EPOCH_RING kept). */
API uint64_t argusSimNotReadyCount(uint64_t from, uint64_t to) {
    uint64_t n = 0;
    pthread_mutex_lock(&g_mu);
    if (to > g_epoch + 1) to = g_epoch + 1;
    if (to > from + EPOCH_RING) from = to - EPOCH_RING;
    for (uint64_t e = from; e < to; e++) n += g_notready[e % EPOCH_RING];
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* ---- streams ------------------------------------------------------------------------- */

static void *stream_worker(void *p) {
    struct CUstream_st *s = p;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == s->tail && !s->stop) {
            s->worker_waiting = 1;
            pthread_cond_wait(&s->cv_work, &s->mu);
            s->worker_waiting = 0;
        }
        if (s->head == s->tail && s->stop) break;
        struct op *o = &s->ring[s->head % QCAP];
        int64_t start = max64(s->gpu_ns, o->enq_ns);
        int failed = s->failed;
        pthread_mutex_unlock(&s->mu);

        int64_t end = start;
        if (failed) {
            /* a failed stream completes everything at once, like a context in error */
        } else if (o->kind == OP_KERNEL) {
            end = start + o->dur_ns;
        } else if (o->kind == OP_EVENT) {
            pthread_mutex_lock(&g_mu);
            o->ev->ts = start;
            if (o->ev->done_gen < o->ev_gen) o->ev->done_gen = o->ev_gen;
            pthread_cond_broadcast(&g_ev_cv);
            pthread_mutex_unlock(&g_mu);
        } else if (o->kind == OP_WAIT_EVENT) {
            pthread_mutex_lock(&g_mu);
            while (o->ev->done_gen < o->ev_gen) pthread_cond_wait(&g_ev_cv, &g_mu);
            end = max64(start, o->ev->ts);
            pthread_mutex_unlock(&g_mu);
        } else if (o->kind == OP_FN) {
            end = o->fn(o->arg, start, &failed);
        }
        if (o->free_fn) o->free_fn(o->arg);

        pthread_mutex_lock(&s->mu);
        if (failed) s->failed = 1;
        o->end_ns = end;
        s->gpu_ns = max64(s->gpu_ns, end);
        s->head++;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static struct CUstream_st *stream_new(void) {
    struct CUstream_st *s = calloc(1, sizeof(*s));
    if (!s) return NULL;
    s->magic = MAGIC_STREAM;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    if (pthread_create(&s->th, NULL, stream_worker, s) != 0) {
        free(s);
        return NULL;
    }
    return s;
}

static struct CUstream_st *resolve_stream(CUstream h) {
    /* NULL, CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) mean the default stream. */
    if ((uintptr_t)h <= 2) return g_ctx ? g_ctx->streams : NULL;
    if (h->magic != MAGIC_STREAM) return NULL;
    return h;
}

/* Enqueue an op. Kernels on an idle stream are completed inline (no worker wake-up). */
static uint64_t enqueue(struct CUstream_st *s, struct op *o) {
    pthread_mutex_lock(&s->mu);
    while (s->tail - s->head >= QCAP) pthread_cond_wait(&s->cv_done, &s->mu); /* launch queue full */
    if (g_qdepth && s->tail >= g_qdepth) {
        /* a full queue in GPU time: op tail-depth must have ended (kernels complete inline with
         * a future end time, so the ring's head alone does not say the GPU passed them) */
        uint64_t j = s->tail - g_qdepth;
        while (s->head <= j) pthread_cond_wait(&s->cv_done, &s->mu);
        int64_t t = s->ring[j % QCAP].end_ns;
        if (t > argusSimNow()) {
            pthread_mutex_unlock(&s->mu);
            sleep_until(t);
            pthread_mutex_lock(&s->mu);
            while (s->tail - s->head >= QCAP) pthread_cond_wait(&s->cv_done, &s->mu);
            o->enq_ns = max64(o->enq_ns, argusSimNow());
        }
    }
    uint64_t idx = s->tail;
    if (o->kind == OP_KERNEL && s->head == s->tail) {
        int64_t end = s->failed ? o->enq_ns : max64(s->gpu_ns, o->enq_ns) + o->dur_ns;
        o->end_ns = end;
        s->ring[idx % QCAP] = *o;
        s->gpu_ns = end;
        s->tail++;
        s->head++;
        pthread_mutex_unlock(&s->mu);
        return idx + 1;
    }
    s->ring[idx % QCAP] = *o;
    s->tail++;
    if (s->worker_waiting) pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return idx + 1;
}

/* Block the host until the stream has completed `target` ops; returns the virtual completion
 * time of op target-1 (0 if none) and the failure flag. */
static int64_t wait_stream(struct CUstream_st *s, uint64_t target, int *failed) {
    pthread_mutex_lock(&s->mu);
    while (s->head < target) pthread_cond_wait(&s->cv_done, &s->mu);
    int64_t t = target ? s->ring[(target - 1) % QCAP].end_ns : 0;
    *failed = s->failed;
    pthread_mutex_unlock(&s->mu);
    return t;
}

static CUresult sync_stream(struct CUstream_st *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->tail;
    pthread_mutex_unlock(&s->mu);
    int failed = 0;
    int64_t t = wait_stream(s, target, &failed);
    sleep_until(t);
    return failed ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

API int argusSimStreamEnqueueFn(void *stream, argus_sim_fn fn, void *arg, void (*free_fn)(void *)) {
    struct CUstream_st *s = resolve_stream((CUstream)stream);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    struct op o = {.kind = OP_FN, .enq_ns = argusSimNow(), .fn = fn, .arg = arg, .free_fn = free_fn};
    enqueue(s, &o);
    return CUDA_SUCCESS;
}

/* ---- init, device, context ----------------------------------------------------------- */

#define REQUIRE_INIT()                                     \
    do {                                                   \
        if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)
#define REQUIRE_CTX()                                      \
    do {                                                   \
        REQUIRE_INIT();                                    \
        if (!g_ctx) return CUDA_ERROR_INVALID_CONTEXT;     \
    } while (0)

static int device_count(void) {
    const char *e = getenv("ARGUS_SIM_GPUS");
    int n = e ? atoi(e) : 8;
    return n > 0 ? n : 0;
}

API CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    g_initialized = 1;
    const char *q = getenv("ARGUS_SIM_LAUNCH_QUEUE");
    long qd = q ? atol(q) : 0;
    g_qdepth = qd > 0 && qd < QCAP ? (uint64_t)qd : 0;
    return device_count() ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

API CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 12040;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
    REQUIRE_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count();
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    REQUIRE_INIT();
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    REQUIRE_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "NVIDIA H100 80GB HBM3 (argus-sim)");
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    REQUIRE_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = 80ULL << 30;
    return CUDA_SUCCESS;
}

static CUresult ctx_get(CUcontext *pctx, CUdevice dev) {
    REQUIRE_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    if (!g_ctx) {
        struct CUctx_st *c = calloc(1, sizeof(*c));
        c->magic = MAGIC_CTX;
        c->dev = dev;
        c->streams = stream_new();
        c->nstreams = 1;
        g_ctx = c;
    }
    pthread_mutex_unlock(&g_mu);
    *pctx = g_ctx;
    t_current = g_ctx;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) { return ctx_get(pctx, dev); }

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return ctx_get(pctx, dev);
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    REQUIRE_INIT();
    if (ctx && ctx->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    t_current = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    REQUIRE_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_current;
    return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    REQUIRE_INIT();
    if (!ctx || ctx->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS; /* the process-wide context lives until exit */
}

API CUresult cuCtxSynchronize(void) {
    SYNC_CALL();
    REQUIRE_CTX();
    CUresult rc = CUDA_SUCCESS;
    int64_t t = 0;
    pthread_mutex_lock(&g_mu);
    struct CUstream_st *list = g_ctx->streams;
    pthread_mutex_unlock(&g_mu);
    for (struct CUstream_st *s = list; s; s = s->next) {
        pthread_mutex_lock(&s->mu);
        uint64_t target = s->tail;
        pthread_mutex_unlock(&s->mu);
        int failed = 0;
        t = max64(t, wait_stream(s, target, &failed));
        if (failed) rc = CUDA_ERROR_LAUNCH_FAILED;
    }
    sleep_until(t);
    return rc;
}

/* ---- modules and kernels ------------------------------------------------------------- */

/* A module image is text: a first line "//argus-sim-module", then "<kernel> <ns_per_block>". */
API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    REQUIRE_CTX();
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    const char *text = image;
    if (strncmp(text, "//argus-sim-module", 18) != 0) return CUDA_ERROR_INVALID_IMAGE;
    struct CUmod_st *m = calloc(1, sizeof(*m));
    m->magic = MAGIC_MOD;
    const char *line = strchr(text, '\n');
    while (line && *line && m->nfuncs < MAX_FUNCS) {
        line++;
        char name[256];
        double nspb = 1000.0;
        int n = sscanf(line, "%255s %lf", name, &nspb);
        if (n >= 1 && name[0] != '#') {
            struct CUfunc_st *f = &m->funcs[m->nfuncs++];
            f->magic = MAGIC_FUNC;
            f->mod = m;
            f->ns_per_block = nspb;
            snprintf(f->name, sizeof(f->name), "%s", name);
        }
        line = strchr(line, '\n');
    }
    *module = m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule module) {
    REQUIRE_CTX();
    if (!module || module->magic != MAGIC_MOD) return CUDA_ERROR_INVALID_HANDLE;
    module->magic = 0; /* functions stay readable: in-flight launches may reference them */
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule module, const char *name) {
    REQUIRE_CTX();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!module || module->magic != MAGIC_MOD) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < module->nfuncs; i++) {
        if (strcmp(module->funcs[i].name, name) == 0) {
            *hfunc = &module->funcs[i];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, CUstream h) {
    REQUIRE_CTX();
    if (!f || f->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = resolve_stream(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    double blocks = (double)gx * gy * gz;
    struct op o = {.kind = OP_KERNEL, .enq_ns = argusSimNow(), .dur_ns = (int64_t)(blocks * f->ns_per_block)};
    enqueue(s, &o);
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                            unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                            unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    (void)blockDimX, (void)blockDimY, (void)blockDimZ, (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, hStream);
}

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    (void)kernelParams, (void)extra;
    if (!config) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->hStream);
}

/* ---- memory -------------------------------------------------------------------------- */

#define ALLOC_SLOTS (1 << 16)
static struct {
    CUdeviceptr ptr;
    size_t size;
} g_allocs[ALLOC_SLOTS];
static CUdeviceptr g_next_ptr = 0x7f0000000000ULL;
static size_t g_used;

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    REQUIRE_CTX();
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (g_used + bytesize > (80ULL << 30)) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUdeviceptr p = g_next_ptr;
    g_next_ptr += (bytesize + 511) & ~(size_t)511;
    for (unsigned i = 0; i < ALLOC_SLOTS; i++) {
        unsigned k = (unsigned)((p >> 9) + i) % ALLOC_SLOTS;
        if (g_allocs[k].ptr == 0) {
            g_allocs[k].ptr = p;
            g_allocs[k].size = bytesize;
            g_used += bytesize;
            pthread_mutex_unlock(&g_mu);
            *dptr = p;
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    REQUIRE_CTX();
    pthread_mutex_lock(&g_mu);
    for (unsigned i = 0; i < ALLOC_SLOTS; i++) {
        unsigned k = (unsigned)((dptr >> 9) + i) % ALLOC_SLOTS;
        if (g_allocs[k].ptr == dptr && dptr) {
            g_used -= g_allocs[k].size;
            g_allocs[k].ptr = 0;
            pthread_mutex_unlock(&g_mu);
            return CUDA_SUCCESS;
        }
        if (g_allocs[k].ptr == 0) break;
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult copy(size_t bytes, double bw, int64_t lat, CUstream h, int sync) {
    REQUIRE_CTX();
    struct CUstream_st *s = resolve_stream(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    struct op o = {.kind = OP_KERNEL, .enq_ns = argusSimNow(), .dur_ns = lat + (int64_t)((double)bytes / bw)};
    uint64_t target = enqueue(s, &o);
    if (!sync) return CUDA_SUCCESS;
    int failed = 0;
    sleep_until(wait_stream(s, target, &failed));
    return failed ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    SYNC_CALL();
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, PCIE_BW, PCIE_LAT, NULL, 1);
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    SYNC_CALL();
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, PCIE_BW, PCIE_LAT, NULL, 1);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    SYNC_CALL();
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, HBM_BW, HBM_LAT, NULL, 1);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, PCIE_BW, PCIE_LAT, h, 0);
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, PCIE_BW, PCIE_LAT, h, 0);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, HBM_BW, HBM_LAT, h, 0);
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    SYNC_CALL();
    (void)v;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, HBM_BW, HBM_LAT, NULL, 1);
}
API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n) {
    SYNC_CALL();
    (void)v;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    return copy(n * 4, HBM_BW, HBM_LAT, NULL, 1);
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream h) {
    (void)v;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    return copy(n, HBM_BW, HBM_LAT, h, 0);
}

/* ---- streams API ----------------------------------------------------------------------- */

API CUresult cuStreamCreate(CUstream *ph, unsigned int flags) {
    (void)flags;
    REQUIRE_CTX();
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = stream_new();
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    s->id = g_ctx->nstreams++;
    /* append so the default stream stays first */
    struct CUstream_st *t = g_ctx->streams;
    while (t->next) t = t->next;
    t->next = s;
    pthread_mutex_unlock(&g_mu);
    *ph = s;
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int priority) {
    (void)priority;
    return cuStreamCreate(ph, flags);
}

API CUresult cuStreamDestroy_v2(CUstream h) {
    REQUIRE_CTX();
    if ((uintptr_t)h <= 2 || h->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS; /* kept alive: in-flight host waits may still reference it */
}

API CUresult cuStreamSynchronize(CUstream h) {
    SYNC_CALL();
    REQUIRE_CTX();
    struct CUstream_st *s = resolve_stream(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    return sync_stream(s);
}

API CUresult cuStreamQuery(CUstream h) {
    REQUIRE_CTX();
    struct CUstream_st *s = resolve_stream(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&s->mu);
    int idle = s->head == s->tail && s->gpu_ns <= argusSimNow();
    int failed = s->failed;
    pthread_mutex_unlock(&s->mu);
    if (failed) return CUDA_ERROR_LAUNCH_FAILED;
    return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) {
    (void)flags;
    REQUIRE_CTX();
    struct CUstream_st *s = resolve_stream(h);
    if (!s || !ev || ev->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    uint64_t gen = ev->rec_gen;
    pthread_mutex_unlock(&g_mu);
    if (gen == 0) return CUDA_SUCCESS; /* never recorded: nothing to wait for */
    struct op o = {.kind = OP_WAIT_EVENT, .enq_ns = argusSimNow(), .ev = ev, .ev_gen = gen};
    enqueue(s, &o);
    return CUDA_SUCCESS;
}

/* ---- events ---------------------------------------------------------------------------- */

API CUresult cuEventCreate(CUevent *ph, unsigned int flags) {
    REQUIRE_CTX();
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof(*e));
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = flags;
    *ph = e;
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent ev) {
    REQUIRE_CTX();
    if (!ev || ev->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS; /* kept: a pending record may still reference it */
}

API CUresult cuEventRecord(CUevent ev, CUstream h) {
    REQUIRE_CTX();
    struct CUstream_st *s = resolve_stream(h);
    if (!s || !ev || ev->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    uint64_t gen = ++ev->rec_gen;
    pthread_mutex_unlock(&g_mu);
    struct op o = {.kind = OP_EVENT, .enq_ns = argusSimNow(), .ev = ev, .ev_gen = gen};
    enqueue(s, &o);
    return CUDA_SUCCESS;
}

/* 1 when the event's last record has been reached by its stream and its time has passed. */
static int event_complete(CUevent ev, int64_t *ts) {
    pthread_mutex_lock(&g_mu);
    int done = ev->done_gen >= ev->rec_gen;
    *ts = ev->ts;
    pthread_mutex_unlock(&g_mu);
    return done && *ts <= argusSimNow();
}

API CUresult cuEventQuery(CUevent ev) {
    REQUIRE_CTX();
    if (!ev || ev->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    int done = ev->done_gen >= ev->rec_gen && ev->ts <= argusSimNow();
    if (!done) g_notready[g_epoch % EPOCH_RING]++;
    pthread_mutex_unlock(&g_mu);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent ev) {
    SYNC_CALL();
    REQUIRE_CTX();
    if (!ev || ev->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    while (ev->done_gen < ev->rec_gen) pthread_cond_wait(&g_ev_cv, &g_mu);
    int64_t ts = ev->ts;
    pthread_mutex_unlock(&g_mu);
    sleep_until(ts);
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent start, CUevent end) {
    REQUIRE_CTX();
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    if (!start || !end || start->magic != MAGIC_EVENT || end->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (start->rec_gen == 0 || end->rec_gen == 0) return CUDA_ERROR_INVALID_HANDLE;
    int64_t t0, t1;
    if (!event_complete(start, &t0) || !event_complete(end, &t1)) return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)(t1 - t0) / 1e6);
    return CUDA_SUCCESS;
}

/* ---- errors ---------------------------------------------------------------------------- */

static const struct {
    int code;
    const char *name, *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

API CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++) {
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++) {
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
