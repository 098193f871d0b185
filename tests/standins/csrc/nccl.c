/*
 * A stand-in for NVIDIA NCCL (libnccl.so.2), written from the public nccl.h / NCCL user guide
 * only: the documented C signatures (the tracer reads arguments by position), the documented
 * result codes, data types and group semantics. Everything else is our own design and differs
 * on purpose from both NVIDIA's library and the Argus simulator:
 *
 *   - ncclGetVersion claims 22105 (2.21.5, like a vendor fork), but struct ncclComm is ours:
 *     nRanks at 0x1e8 and rank at 0x2f4, read back only by the ncclCommCount/ncclCommUserRank
 *     accessors;
 *   - collectives and point-to-point calls are BLOCKING: a call first waits for its stream to
 *     drain (the "GPU" reached the collective), then blocks the host until every peer arrived at
 *     the same collective instance (a Send until its Recv is posted and vice versa), then sleeps
 *     the modelled transfer time (alpha + bytes / bandwidth, ring algorithms limited by their
 *     slowest link), then returns. Between ncclGroupStart and ncclGroupEnd calls only record;
 *     ncclGroupEnd posts all of them, then completes all of them, so grouped send/recv pairs
 *     never deadlock;
 *   - the rendezvous is a POSIX shared-memory segment named in the unique id (created by
 *     ncclGetUniqueId), with sequence counters per rank and per (src, dst) lane and a futex
 *     "bell" rung after every post. Waiters sleep on the futex with a timeout and check, every
 *     WATCH_NS, that the peers they wait for are alive: a dead peer (pid gone, zombie, or reused)
 *     makes the call return ncclRemoteError; a live peer that never arrives blocks for real;
 *   - no data moves (buffers are only validated for NULL): the model is about time;
 *   - a subset: no ncclCommSplit, ncclCommInitRankConfig, ncclCommCuDevice, ncclReduce, ...
 *
 * The "global rank" a link factor refers to is the RANK environment variable of each member at
 * ncclCommInitRank (torchrun sets it), published in the segment; without it, the comm rank.
 * One extra export, outside the NCCL API: standinSetLinkFactor.
 */
#define _GNU_SOURCE
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

#define API __attribute__((visibility("default")))

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
#define BYTES_PER_NS 40.0     /* ~40 GB/s per link */
#define WATCH_NS 250000000ull /* how often a waiter checks that its peers are alive */
#define BELL_WAIT_NS 200000000ll
#define ID_MAGIC "STANDIN-NCCL-ID1"
#define SHM_PREFIX "/argus-standin-nccl-"
#define COMM_MAGIC 0x636f6d6d5354444eull
#define SEG_MAGIC 0x53454731u

/* ------------------------------------------------------------------------------ shared segment */

struct member {
    _Atomic int32_t state; /* 0 empty, 1 joined, 2 left (ncclCommDestroy) */
    int32_t pid;
    int32_t global; /* RANK of the member, -1 if unknown */
    int32_t pad;
    uint64_t start_ticks; /* /proc/PID/stat starttime: tells a reused pid from the member */
    _Atomic uint64_t coll_seq;
    _Atomic uint64_t coll_ns[COLL_SLOTS];
};

/* one direction between two ranks: sends src -> dst and the matching receives */
struct lane {
    _Atomic uint64_t send_seq, recv_seq;
    _Atomic uint64_t send_ns[LANE_SLOTS], recv_ns[LANE_SLOTS];
};

struct segment {
    _Atomic uint32_t magic;
    _Atomic int32_t nranks;
    _Atomic uint32_t bell; /* futex word, bumped after every post */
    _Atomic int32_t refs;
    struct member m[MAX_RANKS];
    struct lane lanes[MAX_RANKS][MAX_RANKS]; /* [src][dst] */
};

/* ------------------------------------------------------------------------------ communicator */

/* Our own layout. The reserved areas stand for state a real library keeps (channels, proxy,
   tuning tables); they push nRanks and rank to offsets an observer cannot guess. */
struct ncclComm {
    uint64_t magic;             /* 0x000 */
    uint64_t commHash;          /* 0x008 */
    char shmName[64];           /* 0x010 */
    struct segment *seg;        /* 0x050 */
    uint64_t collSeq;           /* 0x058: collectives posted on this communicator */
    int32_t globalRank;         /* 0x060 */
    int32_t aborted;            /* 0x064: a peer died; every later call fails */
    int32_t lastError;          /* 0x068 */
    int32_t pad0;               /* 0x06c */
    uint8_t reserved0[0x178];   /* 0x070 */
    int32_t nRanks;             /* 0x1e8 */
    uint8_t reserved1[0x108];   /* 0x1ec */
    int32_t rank;               /* 0x2f4 */
    uint64_t pad1;              /* 0x2f8 */
    uint64_t sendSeq[MAX_RANKS]; /* 0x300: sends posted per peer */
    uint64_t recvSeq[MAX_RANKS]; /* 0x500: receives posted per peer */
};
_Static_assert(offsetof(struct ncclComm, nRanks) == 0x1e8, "nRanks offset");
_Static_assert(offsetof(struct ncclComm, rank) == 0x2f4, "rank offset");
_Static_assert(offsetof(struct ncclComm, sendSeq) == 0x300, "sendSeq offset");

/* ------------------------------------------------------------------------------ helpers */

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

static void ring_bell(struct segment *seg) {
    atomic_fetch_add(&seg->bell, 1);
    syscall(SYS_futex, &seg->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Sleep until the bell rings past `seen` or the timeout passes: the peers' posts wake us. */
static void wait_bell(struct segment *seg, uint32_t seen, long long timeout_ns) {
    struct timespec rel = {(time_t)(timeout_ns / 1000000000ll), (long)(timeout_ns % 1000000000ll)};
    syscall(SYS_futex, &seg->bell, FUTEX_WAIT, seen, &rel, NULL, 0);
}

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

static int member_alive(const struct member *m) {
    char st;
    uint64_t ticks;
    if (!proc_stat(m->pid, &st, &ticks)) return 0;
    if (st == 'Z' || st == 'X' || st == 'x') return 0; /* killed, not yet reaped by its parent */
    return ticks == m->start_ticks;
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

static int global_of(const struct ncclComm *c, int r) {
    int g = c->seg->m[r].global;
    return g >= 0 ? g : r;
}

/* A ring over the communicator's ranks in order: its slowest link paces every step. */
static double ring_factor(const struct ncclComm *c) {
    double f = 1.0;
    int n = c->nRanks;
    for (int i = 0; i < n && n > 1; i++) {
        double x = link_factor(global_of(c, i), global_of(c, (i + 1) % n));
        if (x > f) f = x;
    }
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
    uint64_t seq;
    uint64_t start_ns; /* when every party had arrived */
    int done;
};

static __thread int g_group_depth;
static __thread int g_group_nops;
static __thread ncclResult_t g_group_error;
static __thread struct op g_group_ops[MAX_GROUP_OPS];

static uint64_t model_ns(const struct op *o) {
    const struct ncclComm *c = o->comm;
    double n = c->nRanks, b = (double)o->bytes, t;
    if (o->kind == K_SEND || o->kind == K_RECV) {
        double f = link_factor(global_of(c, c->rank), global_of(c, o->peer));
        return (uint64_t)(ALPHA_NS + b / BYTES_PER_NS * f);
    }
    if (c->nRanks == 1) return 0;
    double f = ring_factor(c);
    switch (o->kind) {
    case K_ALLREDUCE: /* ring: reduce-scatter then all-gather, 2(n-1) steps of b/n */
        t = 2 * (n - 1) * ALPHA_NS + 2 * (n - 1) / n * b / BYTES_PER_NS * f;
        break;
    case K_ALLGATHER:
    case K_REDUCESCATTER: /* n-1 steps of one chunk */
        t = (n - 1) * ALPHA_NS + (n - 1) * b / BYTES_PER_NS * f;
        break;
    default: /* broadcast: pipelined along the ring */
        t = (n - 1) * ALPHA_NS + b / BYTES_PER_NS * f;
        break;
    }
    return (uint64_t)t;
}

typedef int (*stream_wait_fn)(void *);
static stream_wait_fn g_stream_wait;
static pthread_once_t g_stream_wait_once = PTHREAD_ONCE_INIT;

/* The stand-in libcuda, found by its soname among the loaded libraries (like the real NCCL, we
   do not link the driver). Without it there is no GPU work to wait for. */
static void resolve_stream_wait(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h) g_stream_wait = (stream_wait_fn)dlsym(h, "standinStreamWait");
}

static ncclResult_t drain_streams(const struct op *ops, int n) {
    pthread_once(&g_stream_wait_once, resolve_stream_wait);
    if (!g_stream_wait) return ncclSuccess;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = ops[j].stream == ops[i].stream;
        if (!seen && g_stream_wait(ops[i].stream) != 0) return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

static void post(struct op *o) {
    struct ncclComm *c = o->comm;
    struct segment *seg = c->seg;
    uint64_t t = now_ns();
    if (o->kind == K_SEND) {
        struct lane *l = &seg->lanes[c->rank][o->peer];
        o->seq = ++c->sendSeq[o->peer];
        atomic_store(&l->send_ns[o->seq % LANE_SLOTS], t);
        atomic_store(&l->send_seq, o->seq);
    } else if (o->kind == K_RECV) {
        struct lane *l = &seg->lanes[o->peer][c->rank];
        o->seq = ++c->recvSeq[o->peer];
        atomic_store(&l->recv_ns[o->seq % LANE_SLOTS], t);
        atomic_store(&l->recv_seq, o->seq);
    } else {
        struct member *me = &seg->m[c->rank];
        o->seq = ++c->collSeq;
        atomic_store(&me->coll_ns[o->seq % COLL_SLOTS], t);
        atomic_store(&me->coll_seq, o->seq);
    }
    ring_bell(seg);
}

/* Has every party of `o` arrived? Then o->start_ns is the last arrival. */
static int try_complete(struct op *o) {
    struct ncclComm *c = o->comm;
    struct segment *seg = c->seg;
    uint64_t start = 0, t;
    if (o->kind == K_SEND || o->kind == K_RECV) {
        struct lane *l = o->kind == K_SEND ? &seg->lanes[c->rank][o->peer] : &seg->lanes[o->peer][c->rank];
        _Atomic uint64_t *other = o->kind == K_SEND ? &l->recv_seq : &l->send_seq;
        if (atomic_load(other) < o->seq) return 0;
        start = atomic_load(&l->send_ns[o->seq % LANE_SLOTS]);
        t = atomic_load(&l->recv_ns[o->seq % LANE_SLOTS]);
        if (t > start) start = t;
    } else {
        for (int i = 0; i < c->nRanks; i++) {
            if (atomic_load(&seg->m[i].coll_seq) < o->seq) return 0;
            t = atomic_load(&seg->m[i].coll_ns[o->seq % COLL_SLOTS]);
            if (t > start) start = t;
        }
    }
    o->start_ns = start;
    o->done = 1;
    return 1;
}

/* A dead party of the pending `o`, or -1. Members that already arrived count too: the transfer
   needs them (as a real ring needs its connections), so the instance can no longer complete. */
static int dead_peer(const struct op *o) {
    const struct ncclComm *c = o->comm;
    const struct segment *seg = c->seg;
    if (o->kind == K_SEND || o->kind == K_RECV) return member_alive(&seg->m[o->peer]) ? -1 : o->peer;
    for (int i = 0; i < c->nRanks; i++)
        if (i != c->rank && !member_alive(&seg->m[i])) return i;
    return -1;
}

static const char *kind_name(int k) {
    static const char *names[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Send", "Recv"};
    return names[k];
}

/* Drain, post, wait for every party, then sleep until the last transfer ends. */
static ncclResult_t run_ops(struct op *ops, int n) {
    for (int i = 0; i < n; i++)
        if (ops[i].comm->aborted) return ncclRemoteError;
    ncclResult_t rc = drain_streams(ops, n);
    if (rc != ncclSuccess) return rc;
    for (int i = 0; i < n; i++) post(&ops[i]);
    uint64_t next_watch = now_ns() + WATCH_NS;
    for (;;) {
        int pending = 0;
        struct segment *wait_on = NULL;
        uint32_t seen = 0;
        int several = 0;
        for (int i = 0; i < n; i++) {
            if (ops[i].done) continue;
            struct segment *seg = ops[i].comm->seg;
            uint32_t b = atomic_load(&seg->bell); /* read before checking: no lost wake-up */
            if (try_complete(&ops[i])) continue;
            pending++;
            if (!wait_on) {
                wait_on = seg;
                seen = b;
            } else if (wait_on != seg) {
                several = 1;
            }
        }
        if (!pending) break;
        if (now_ns() >= next_watch) {
            for (int i = 0; i < n; i++) {
                if (ops[i].done) continue;
                int d = dead_peer(&ops[i]);
                if (d >= 0) {
                    struct ncclComm *c = ops[i].comm;
                    fprintf(stderr,
                            "standin-nccl: rank %d: %s: peer rank %d (pid %d) of communicator %016llx "
                            "died\n",
                            c->rank, kind_name(ops[i].kind), d, c->seg->m[d].pid,
                            (unsigned long long)c->commHash);
                    for (int j = 0; j < n; j++) ops[j].comm->aborted = 1;
                    c->lastError = ncclRemoteError;
                    return ncclRemoteError;
                }
            }
            next_watch = now_ns() + WATCH_NS;
        }
        /* ops on several communicators ring several bells: poll them briefly instead */
        wait_bell(wait_on, seen, several ? 2000000ll : BELL_WAIT_NS);
    }
    uint64_t end = 0;
    for (int i = 0; i < n; i++) {
        uint64_t e = ops[i].start_ns + model_ns(&ops[i]);
        if (e > end) end = e;
    }
    sleep_until(end);
    return ncclSuccess;
}

static ncclResult_t check_comm(const struct ncclComm *c) {
    return (c && c->magic == COMM_MAGIC) ? ncclSuccess : ncclInvalidArgument;
}

static ncclResult_t submit(struct op o) {
    if (g_group_depth > 0) {
        if (g_group_nops == MAX_GROUP_OPS) {
            g_group_error = ncclInvalidUsage;
            return ncclInvalidUsage;
        }
        g_group_ops[g_group_nops++] = o;
        return ncclSuccess;
    }
    return run_ops(&o, 1);
}

static ncclResult_t collective(int kind, const void *sendbuff, void *recvbuff, size_t count,
                               ncclDataType_t datatype, int op, int root, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_comm(comm);
    if (rc != ncclSuccess) return rc;
    int reduces = kind == K_ALLREDUCE || kind == K_REDUCESCATTER;
    if (type_size(datatype) == 0 || (reduces && (op < 0 || op >= ncclNumOps)) || !recvbuff ||
        (!sendbuff && kind != K_BROADCAST) || (kind == K_BROADCAST && (root < 0 || root >= comm->nRanks)))
        return ncclInvalidArgument;
    struct op o = {comm, kind, root, count * type_size(datatype), stream, 0, 0, 0};
    return submit(o);
}

static ncclResult_t p2p(int kind, const void *buff, size_t count, ncclDataType_t datatype, int peer,
                        ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_comm(comm);
    if (rc != ncclSuccess) return rc;
    if (type_size(datatype) == 0 || peer < 0 || peer >= comm->nRanks || (!buff && count)) return ncclInvalidArgument;
    struct op o = {comm, kind, peer, count * type_size(datatype), stream, 0, 0, 0};
    return submit(o);
}

/* ------------------------------------------------------------------------------ API */

API ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = VERSION_CODE;
    return ncclSuccess;
}

API const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The id names a fresh shared-memory segment, created here (the real library starts its
   bootstrap root here too): "STANDIN-NCCL-ID1" then the segment name, NUL-terminated. */
API ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) return ncclInvalidArgument;
    unsigned char rnd[12];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) return ncclSystemError;
    char name[64];
    int len = snprintf(name, sizeof(name), SHM_PREFIX);
    for (size_t i = 0; i < sizeof(rnd); i++) len += snprintf(name + len, sizeof(name) - len, "%02x", rnd[i]);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return ncclSystemError;
    if (ftruncate(fd, sizeof(struct segment)) != 0) {
        close(fd);
        shm_unlink(name);
        return ncclSystemError;
    }
    struct segment *seg = mmap(NULL, sizeof(struct segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (seg == MAP_FAILED) {
        shm_unlink(name);
        return ncclSystemError;
    }
    atomic_store(&seg->magic, SEG_MAGIC); /* the rest is zero: ftruncate fills with zeros */
    munmap(seg, sizeof(struct segment));
    memset(uniqueId, 0, sizeof(*uniqueId));
    memcpy(uniqueId->internal, ID_MAGIC, 16);
    memcpy(uniqueId->internal + 16, name, (size_t)len + 1);
    return ncclSuccess;
}

/* Blocks until all nranks members joined (as NCCL's bootstrap does). */
API ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    if (!comm || nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    if (memcmp(commId.internal, ID_MAGIC, 16) != 0 || memchr(commId.internal + 16, 0, 64) == NULL)
        return ncclInvalidArgument;
    const char *name = commId.internal + 16;
    if (strncmp(name, SHM_PREFIX, strlen(SHM_PREFIX)) != 0) return ncclInvalidArgument;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return errno == ENOENT ? ncclInvalidUsage : ncclSystemError;
    struct segment *seg = mmap(NULL, sizeof(struct segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (seg == MAP_FAILED) return ncclSystemError;
    ncclResult_t rc = ncclInvalidUsage;
    if (atomic_load(&seg->magic) != SEG_MAGIC) goto fail;
    int32_t expect = 0;
    if (!atomic_compare_exchange_strong(&seg->nranks, &expect, nranks) && expect != nranks) goto fail;
    struct member *me = &seg->m[rank];
    if (atomic_load(&me->state) == 1 && member_alive(me)) goto fail; /* two processes claim this rank */
    char st;
    uint64_t ticks = 0;
    rc = ncclSystemError;
    if (!proc_stat(getpid(), &st, &ticks)) goto fail;
    me->pid = getpid();
    me->global = env_rank();
    me->start_ticks = ticks;
    atomic_store(&me->coll_seq, 0);
    atomic_store(&me->state, 1);
    atomic_fetch_add(&seg->refs, 1);
    ring_bell(seg);

    uint64_t next_watch = now_ns() + WATCH_NS;
    for (;;) {
        uint32_t b = atomic_load(&seg->bell);
        int missing = 0;
        for (int i = 0; i < nranks; i++) missing += atomic_load(&seg->m[i].state) != 1;
        if (!missing) break;
        if (now_ns() >= next_watch) {
            for (int i = 0; i < nranks; i++) {
                if (atomic_load(&seg->m[i].state) == 1 && !member_alive(&seg->m[i])) {
                    fprintf(stderr, "standin-nccl: rank %d: ncclCommInitRank: peer rank %d (pid %d) died\n", rank,
                            i, seg->m[i].pid);
                    atomic_store(&me->state, 2);
                    atomic_fetch_sub(&seg->refs, 1);
                    rc = ncclRemoteError;
                    goto fail;
                }
            }
            next_watch = now_ns() + WATCH_NS;
        }
        wait_bell(seg, b, BELL_WAIT_NS);
    }

    struct ncclComm *c = calloc(1, sizeof(*c));
    if (!c) {
        rc = ncclSystemError;
        goto fail;
    }
    c->magic = COMM_MAGIC;
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the id: the same on every member */
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) h = (h ^ (unsigned char)commId.internal[i]) * 1099511628211ull;
    c->commHash = h;
    memcpy(c->shmName, name, sizeof(c->shmName)); /* NUL within 64 bytes: checked above */
    c->seg = seg;
    c->globalRank = me->global;
    c->nRanks = nranks;
    c->rank = rank;
    *comm = c;
    return ncclSuccess;
fail:
    munmap(seg, sizeof(struct segment));
    return rc;
}

API ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (check_comm(comm) != ncclSuccess || !count) return ncclInvalidArgument;
    *count = comm->nRanks;
    return ncclSuccess;
}

API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (check_comm(comm) != ncclSuccess || !rank) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}

/* The last member out removes the segment. */
API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess; /* documented as a no-op */
    if (check_comm(comm) != ncclSuccess) return ncclInvalidArgument;
    struct segment *seg = comm->seg;
    atomic_store(&seg->m[comm->rank].state, 2);
    ring_bell(seg);
    if (atomic_fetch_sub(&seg->refs, 1) == 1) shm_unlink(comm->shmName);
    munmap(seg, sizeof(struct segment));
    comm->magic = 0;
    free(comm);
    return ncclSuccess;
}

API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return collective(K_ALLREDUCE, sendbuff, recvbuff, count, datatype, (int)op, 0, comm, stream);
}

API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                               ncclComm_t comm, cudaStream_t stream) {
    return collective(K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, 0, comm, stream);
}

API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                   ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return collective(K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, (int)op, 0, comm, stream);
}

API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               int root, ncclComm_t comm, cudaStream_t stream) {
    return collective(K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root, comm, stream);
}

API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
    return p2p(K_SEND, sendbuff, count, datatype, peer, comm, stream);
}

API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
    return p2p(K_RECV, recvbuff, count, datatype, peer, comm, stream);
}

API ncclResult_t ncclGroupStart(void) {
    if (g_group_depth++ == 0) {
        g_group_nops = 0;
        g_group_error = ncclSuccess;
    }
    return ncclSuccess;
}

/* Only the outermost ncclGroupEnd runs the group: every op is posted before any is waited for. */
API ncclResult_t ncclGroupEnd(void) {
    if (g_group_depth == 0) return ncclInvalidUsage;
    if (--g_group_depth > 0) return ncclSuccess;
    int n = g_group_nops;
    g_group_nops = 0;
    if (g_group_error != ncclSuccess) return g_group_error;
    return n ? run_ops(g_group_ops, n) : ncclSuccess;
}
