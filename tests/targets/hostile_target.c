/* A target for tests/reliability/test_hostile_target.py, linked to hostile_libcuda.c's libcuda.so.1.
 *   names GATE STEPS   kernel names of 100 KB, invalid UTF-8, control characters, rich markup,
 *                      empty; name i launched N-i times a step; a step ends in cuStreamSynchronize
 *   storm GATE SECONDS 80,000 kernels launched in turn as fast as it can, an event recorded after
 *                      each launch, a sync every 100,000; prints launches/s every 0.25 s
 * Both print "ready" and wait for the file GATE before the first traced call. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUfunction;
CUresult cuInit(unsigned);
CUresult cuModuleGetFunction(CUfunction *, void *, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
CUresult cuStreamSynchronize(void *);
CUresult cuEventRecord(void *, void *);

#define HUGE (100 * 1024)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    if (cuInit(0)) return 3;
    printf("ready\n");
    fflush(stdout);
    while (access(argv[1], F_OK) != 0) usleep(5000);
    if (strcmp(argv[2], "names") == 0) {
        char *huge = malloc(HUGE + 1);
        memset(huge, 'A', HUGE);
        huge[HUGE] = 0;
        /* launched 6, 5, ... 1 times a step: the first two are the live table's "top kernels" */
        const char *names[] = {
            "ctl\n\r\t\x1b[31mred\x1b[0m\x07\x08" "end",
            "k[/]markup[bold]x",
            huge,
            "bad\xff\xfe\xc3(utf8",
            "",
            "plain_gemm",
        };
        enum { N = sizeof(names) / sizeof(names[0]) };
        CUfunction f[N];
        for (int i = 0; i < N; i++)
            if (cuModuleGetFunction(&f[i], 0, names[i])) return 4;
        int steps = atoi(argv[3]);
        for (int s = 0; s < steps; s++) {
            for (int i = 0; i < N; i++)
                for (int k = 0; k < N - i; k++) cuLaunchKernel(f[i], 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
            cuStreamSynchronize(0);
            usleep(20000);
        }
        printf("done %d steps\n", steps);
        return 0;
    }
    /* more kernels than the launch map holds (65,536 keys), each launch followed by an event
     * record (a ring-buffer record): what overflows, and what the agent must count */
    enum { NF = 80000 };
    static CUfunction fs[NF];
    char name[32];
    for (int i = 0; i < NF; i++) {
        snprintf(name, sizeof(name), "storm_%d", i);
        if (cuModuleGetFunction(&fs[i], 0, name)) return 4;
    }
    printf("registered\n");
    fflush(stdout);
    int ev = 1;
    double end = now() + atof(argv[3]), mark = now();
    uint64_t n = 0, at_mark = 0;
    while (now() < end) {
        for (int k = 0; k < 100; k++, n++) {
            cuLaunchKernel(fs[n % NF], 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
            cuEventRecord(&ev, 0);
        }
        if (n % 100000 == 0) cuStreamSynchronize(0); /* a step: 100,000 launches */
        double t = now();
        if (t - mark >= 0.25) {
            printf("rate %.0f %.3f\n", (n - at_mark) / (t - mark), t);
            fflush(stdout);
            mark = t, at_mark = n;
        }
    }
    printf("total %llu\n", (unsigned long long)n);
    return 0;
}
