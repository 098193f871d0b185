/* Calls cuLaunchKernel of a real libcuda.so.1 in a tight loop and prints ns per call.
 * usage: cudahit LIBCUDA N [proc]   ("proc": through the pointer cuGetProcAddress hands out)
 * No GPU is needed: cuInit fails, and each launch of a zeroed CUfunction returns an error at once.
 * It prints "ready" and waits for a line on stdin before the timed loop, so a probe can attach. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                        void **);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    void *cu = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!cu) return 3;
    long n = atol(argv[2]);
    ((int (*)(unsigned))dlsym(cu, "cuInit"))(0);
    launch_t f = (launch_t)dlsym(cu, "cuLaunchKernel");
    if (argc > 3 && !strcmp(argv[3], "proc")) {
        void *p = 0;
        ((int (*)(const char *, void **, int, unsigned long))dlsym(cu, "cuGetProcAddress"))("cuLaunchKernel", &p, 12000,
                                                                                           0);
        if (p) f = (launch_t)p;
    }
    static char func[4096]; /* a zeroed CUfunction: the driver reads it and refuses it */
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin)) return 4;
    double t0 = now();
    for (long i = 0; i < n; i++) f(func, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    double t1 = now();
    printf("%.1f\n", (t1 - t0) / n);
    return 0;
}
