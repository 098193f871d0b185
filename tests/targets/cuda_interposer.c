/* A stand-in for a tool that replaced a libcuda dispatch slot before Argus attached (an
 * interposer, a profiler's dispatch table): cuLaunchKernel's slot is pointed at
 * `interposed_launch`, which counts and then either calls the implementation the slot held (an
 * interposer) or answers itself (a replacement: the driver's code never runs).
 * Built by tests/test_real_nvidia.py; installed by tests/targets/nvidia_calls.py (cuda-interposed). */
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
static launch_fn original;
static int call_through;
static volatile long interposed_calls;

__attribute__((noinline)) int interposed_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                unsigned by, unsigned bz, unsigned shmem, void *stream,
                                                void **params, void **extra) {
    interposed_calls++;
    if (!call_through) return 400; /* CUDA_ERROR_INVALID_HANDLE, as the driver answers these */
    return original(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

long interposed_count(void) { return interposed_calls; }

/* slot: the address of the pointer the exported stub jumps through (RELRO: made writable here) */
int interpose(void **slot, int through) {
    call_through = through;
    long page = sysconf(_SC_PAGESIZE);
    void *start = (void *)((uintptr_t)slot & ~(uintptr_t)(page - 1));
    if (mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0) return -1;
    original = (launch_fn)*slot;
    *slot = (void *)interposed_launch;
    mprotect(start, (size_t)page, PROT_READ);
    return 0;
}
