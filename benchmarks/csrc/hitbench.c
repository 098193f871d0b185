/* Calls one probed function of the simulated libcuda/libnccl in a tight loop and prints ns per call.
 * usage: hitbench LIBDIR FUNCTION N
 * It prints "ready" and waits for a line on stdin before the timed loop, so a probe can attach. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*fn0)(void);
typedef int (*fn1)(void *);
typedef int (*fn2)(void *, void *);
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                        void **);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    char path[4096];
    snprintf(path, sizeof(path), "%s/libcuda.so.1", argv[1]);
    void *cu = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    snprintf(path, sizeof(path), "%s/libnccl.so.2", argv[1]);
    void *nc = dlopen(path, RTLD_NOW);
    if (!cu || !nc) return 3;
    const char *fname = argv[2];
    long n = atol(argv[3]);
    ((int (*)(unsigned))dlsym(cu, "cuInit"))(0);
    void *ctx = 0;
    ((int (*)(void **, int))dlsym(cu, "cuDevicePrimaryCtxRetain"))(&ctx, 0);
    void *stream = 0, *ev = 0, *mod = 0, *fn = 0;
    ((int (*)(void **, unsigned))dlsym(cu, "cuStreamCreate"))(&stream, 0);
    ((int (*)(void **, unsigned))dlsym(cu, "cuEventCreate"))(&ev, 0);
    ((int (*)(void **, const char *))dlsym(cu, "cuModuleLoadData"))(&mod, "//argus-sim-module\nk 0\n");
    ((int (*)(void **, void *, const char *))dlsym(cu, "cuModuleGetFunction"))(&fn, mod, "k");
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin)) return 4;
    double t0 = now();
    if (!strcmp(fname, "cuLaunchKernel")) {
        launch_t f = (launch_t)dlsym(cu, fname);
        for (long i = 0; i < n; i++) f(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0);
    } else if (!strcmp(fname, "cuEventRecord")) {
        fn2 f = (fn2)dlsym(cu, fname);
        for (long i = 0; i < n; i++) f(ev, stream);
    } else if (!strcmp(fname, "cuEventQuery") || !strcmp(fname, "cuStreamQuery")) {
        fn1 f = (fn1)dlsym(cu, fname);
        void *arg = !strcmp(fname, "cuEventQuery") ? ev : stream;
        for (long i = 0; i < n; i++) f(arg);
    } else if (!strcmp(fname, "ncclGroupStart")) {
        fn0 f = (fn0)dlsym(nc, "ncclGroupStart");
        fn0 g = (fn0)dlsym(nc, "ncclGroupEnd");
        for (long i = 0; i < n; i++) {
            f();
            g();
        }
    } else if (!strcmp(fname, "ncclGroupStartOnly")) { /* one uprobe, no return probe */
        fn0 f = (fn0)dlsym(nc, "ncclGroupStart");
        for (long i = 0; i < n; i++) f();
    } else if (!strcmp(fname, "ncclGetVersion")) {
        fn1 f = (fn1)dlsym(nc, fname);
        int v;
        for (long i = 0; i < n; i++) f(&v);
    } else {
        return 5;
    }
    double t1 = now();
    printf("%.1f\n", (t1 - t0) / n);
    return 0;
}
