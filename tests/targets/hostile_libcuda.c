/* A minimal libcuda.so.1 for tests/reliability/test_hostile_target.py: the driver calls the CUDA
 * channel needs, accepting any kernel name (the stand-ins only know names from a module image, at
 * most 127 bytes), so a target can hand the tracer names of any length and bytes. No GPU model:
 * a launch counts, a sync returns. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default"))) __attribute__((noinline))
typedef int CUresult;
typedef struct fn { uint64_t id; } * CUfunction;
typedef void *CUmodule;
typedef void *CUstream;

static volatile uint64_t launches, next_id = 1;

API CUresult cuInit(unsigned flags) { return flags ? 1 : 0; }

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule mod, const char *name) {
    (void)mod;
    if (!hfunc || !name) return 1;
    struct fn *f = malloc(sizeof(*f));
    f->id = __atomic_fetch_add(&next_id, 1, __ATOMIC_RELAXED);
    *hfunc = f;
    return 0;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, CUstream s, void **params, void **extra) {
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)s, (void)params, (void)extra;
    if (!f) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    __atomic_fetch_add(&launches, 1, __ATOMIC_RELAXED);
    return 0;
}

API CUresult cuStreamSynchronize(CUstream s) { (void)s; return 0; }
API CUresult cuEventRecord(void *ev, CUstream s) { (void)s; return ev ? 0 : 400; }
API CUresult cuCtxSynchronize(void) { return 0; }
API uint64_t hostileLaunches(void) { return launches; }
