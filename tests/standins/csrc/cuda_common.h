/*
 * The part of the stand-in libcuda that both variants share (cuda.c: blocking family, cuda_async.c:
 * async variant), in two headers around the variant's own stream types:
 *
 *   #define _GNU_SOURCE
 *   #include "cuda_common.h"      types, constants, contexts, modules, device memory
 *   ... enum op_kind, struct op, struct sd_stream, STREAM_STACK_BYTES (the variant's)
 *   #include "cuda_common_api.h"  stream workers and queues, and the API both variants export
 *   ... run_op, stream_init, stream_ran_locked, and the variant's own API
 *
 * cuda_common_api.h lists what it needs of the variant's types. Everything is static or an API
 * function, and each library is a single translation unit.
 */
#ifndef STANDIN_CUDA_COMMON_H
#define STANDIN_CUDA_COMMON_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "common.h"

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
    CUDA_ERROR_NOT_READY = 600, /* returned (and named by cuGetErrorString) by the async variant only */
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

/* ------------------------------------------------------------------------------ objects */

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
static uint64_t g_queue_depth = QUEUE_DEPTH; /* pending launches a stream holds (<= QUEUE_DEPTH) */

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *g_allocs;
static size_t g_nallocs, g_cap_allocs;
static unsigned long long g_mem_used;

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

#endif
