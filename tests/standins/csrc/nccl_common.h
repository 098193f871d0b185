/*
 * The part of the stand-in libnccl that both variants share (nccl.c: blocking family,
 * nccl_async.c: async variant), in two headers around the variant's own shared-memory and
 * communicator structs:
 *
 *   #define _GNU_SOURCE
 *   #include "nccl_common.h"      types, constants, rendezvous lanes, helpers, link factors, ops
 *   ... SEG_MAGIC, struct member, struct ncclComm (the variant's)
 *   #include "nccl_common_api.h"  the segment, rendezvous, member liveness, the API both export
 *   ... model_ns, submit, launch, member_publish, comm_setup, and the variant's own API
 *
 * nccl_common_api.h lists what it needs of the variant's structs. Everything is static or an API
 * function, and each library is a single translation unit.
 */
#ifndef STANDIN_NCCL_COMMON_H
#define STANDIN_NCCL_COMMON_H

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11,
    ncclNumTypes = 12,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef void *cudaStream_t;
typedef struct ncclComm *ncclComm_t;

#define VERSION_CODE 22105
#define MAX_RANKS 64
#define COLL_SLOTS 8 /* arrival timestamps kept per rank (a peer is at most a few instances ahead) */
#define LANE_SLOTS 16
#define MAX_GROUP_OPS 512
#define MAX_LINKS 64
#define ALPHA_NS 12000.0      /* per ring step / per message */
#define BYTES_PER_NS 40.0     /* ~40 GB/s per link (the async variant: inside a host) */
#define WATCH_NS 250000000ull /* how often a waiter checks that its peers are alive */
#define BELL_WAIT_NS 200000000ll
#define ID_MAGIC "STANDIN-NCCL-ID1"
#define SHM_PREFIX "/argus-standin-nccl-"
#define COMM_MAGIC 0x636f6d6d5354444eull

/* ------------------------------------------------------------------------------ shared segment */

/* one direction between two ranks: sends src -> dst and the matching receives */
struct lane {
    _Atomic uint64_t send_seq, recv_seq;
    _Atomic uint64_t send_ns[LANE_SLOTS], recv_ns[LANE_SLOTS];
};

/* ------------------------------------------------------------------------------ helpers */

/* State and start time of a process from /proc/PID/stat; 0 when it is gone. */
static int proc_stat(int pid, char *state, uint64_t *start_ticks) {
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may contain spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    *state = *p;
    /* field 3 is the state; starttime is field 22 */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    *start_ticks = strtoull(p, NULL, 10);
    return 1;
}

static int env_rank(void) {
    const char *s = getenv("RANK");
    if (!s || !*s) return -1;
    char *end;
    long v = strtol(s, &end, 10);
    return (*end == 0 && v >= 0 && v < INT_MAX) ? (int)v : -1;
}

static size_t type_size(ncclDataType_t t) {
    static const unsigned char sizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return ((unsigned)t < ncclNumTypes) ? sizes[t] : 0;
}

/* A function of the stand-in libcuda, found by its soname among the loaded libraries (like the
   real NCCL, we do not link the driver); NULL without it. */
static void *cuda_sym(const char *name) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? dlsym(h, name) : NULL;
}

/* ------------------------------------------------------------------------------ link model */

struct link {
    int a, b;
    double factor;
};
static pthread_mutex_t g_links_mu = PTHREAD_MUTEX_INITIALIZER;
static struct link g_links[MAX_LINKS];
static int g_nlinks;

/* Not NCCL: the link between global ranks a and b is `factor` times slower (1.0 restores it).
   Every rank of a job applies the same setting so that their models agree. */
API ncclResult_t standinSetLinkFactor(int global_a, int global_b, double factor) {
    if (global_a < 0 || global_b < 0 || global_a == global_b || !(factor > 0)) return ncclInvalidArgument;
    int a = global_a < global_b ? global_a : global_b, b = global_a < global_b ? global_b : global_a;
    ncclResult_t rc = ncclSuccess;
    pthread_mutex_lock(&g_links_mu);
    int i;
    for (i = 0; i < g_nlinks; i++)
        if (g_links[i].a == a && g_links[i].b == b) break;
    if (i == g_nlinks) {
        if (g_nlinks == MAX_LINKS)
            rc = ncclInvalidUsage;
        else
            g_links[g_nlinks++] = (struct link){a, b, factor};
    } else {
        g_links[i].factor = factor;
    }
    pthread_mutex_unlock(&g_links_mu);
    return rc;
}

static double link_factor(int a, int b) {
    double f = 1.0;
    if (a > b) {
        int t = a;
        a = b;
        b = t;
    }
    pthread_mutex_lock(&g_links_mu);
    for (int i = 0; i < g_nlinks; i++)
        if (g_links[i].a == a && g_links[i].b == b) f = g_links[i].factor;
    pthread_mutex_unlock(&g_links_mu);
    return f;
}

/* ------------------------------------------------------------------------------ operations */

enum kind { K_ALLREDUCE, K_ALLGATHER, K_REDUCESCATTER, K_BROADCAST, K_SEND, K_RECV };

struct op {
    struct ncclComm *comm;
    int kind;
    int peer;
    size_t bytes; /* per rank: the buffer (all-reduce, broadcast, p2p) or the chunk (gather/scatter) */
    cudaStream_t stream;
    uint64_t seq;      /* blocking: taken when posted; async: taken at enqueue */
    uint64_t start_ns; /* when every party had arrived */
    int done;
};

static __thread int g_group_depth;
static __thread int g_group_nops;
static __thread ncclResult_t g_group_error;
static __thread struct op g_group_ops[MAX_GROUP_OPS];

static int is_coll(int kind) { return kind != K_SEND && kind != K_RECV; }

static const char *kind_name(int k) {
    static const char *names[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Send", "Recv"};
    return names[k];
}

#endif
