/* Simulated libnccl.so.2: NCCL's C API (names and signatures of NCCL 2.21) over the simulated
 * CUDA streams of libcuda.so.1.
 *
 * A collective returns to the host at once (enqueue); on its stream it really rendezvouses
 * with the other ranks of its communicator, which are other processes, through a shared-memory
 * segment per communicator (futex wake-ups). Its virtual completion is
 *     max over ranks (time the rank's stream reached it) + modelled time,
 * where the modelled time is the alpha-beta cost of a ring over the links it uses; a link can be
 * slowed (argusSimSetLink). So a rank that arrives late makes everyone's stream wait, and a rank
 * that never arrives blocks its peers for real. A dead peer fails the stream instead of hanging.
 *
 * Communicator layout: commHash, rank, nRanks and a collective counter sit in struct ncclComm as
 * they do (at other, version-specific offsets) in NVIDIA's. Nothing tells the tracer where: it
 * decodes ncclCommUserRank/ncclCommCount like for any build, and the commHash offset is in its
 * layout table as a row of this version validated by those accessors (argus/probes/nccl_layout.py).
 * commHash is this library's own hash of the unique id, unrelated to anything the tracer computes.
 *
 * Network proxy: every member registers its simulated host (ARGUS_HOST) at init, so each knows
 * whether its communicator spans hosts. Such a communicator gets a proxy thread, as NCCL's
 * proxy progresses network transfers: when this rank's stream reaches a collective, the stream
 * worker hands it to the proxy (never blocking), which posts the first chunk of the rank's data
 * at once through the net plugin's isend (ncclNetSocketIsend, or ncclIbIsend with
 * ARGUS_SIM_NET=ib: local symbols, as in NVIDIA's builds), and the following chunks spaced over
 * the modelled transfer once every member arrived. Communicators within one host send nothing
 * over the network (NVLink).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
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

#include "simgpu.h"

#define API __attribute__((visibility("default")))
/* NVIDIA's libnccl has some entry points that do not begin with `push` (FACTS.md); so do we. */
#define NOFRAME __attribute__((optimize("omit-frame-pointer")))

#define NCCL_VERSION_CODE 22105
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_SPLIT_NOCOLOR -1
#define MAXR 512
#define COLL_RING 64
#define P2P_RING 16
#define SPLIT_RING 8
#define MAX_GROUP_TASKS 1024

typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

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
    ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
    ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11, ncclNumTypes = 12
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

typedef void *cudaStream_t;
typedef struct ncclConfig_v21700 ncclConfig_t; /* opaque here: accepted, not interpreted */

enum { OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER, OP_REDUCESCATTER, OP_SEND, OP_RECV };

struct coll_slot {
    uint64_t seq1; /* seq + 1 once posted */
    int64_t ready, dur;
    uint64_t bytes;
    int32_t op, pad;
};

struct p2p_slot {
    uint64_t s_seq1;
    int64_t s_ready, s_dur;
    uint64_t r_seq1;
    int64_t r_ready, r_dur;
};

struct split_slot {
    uint64_t seq1;
    int32_t color, key;
};

struct shm_hdr {
    uint64_t magic;
    uint64_t comm_hash;
    uint32_t nranks;
    uint32_t gen; /* futex word: bumped on every post */
    uint32_t joined, left, aborted, pad;
    int32_t global_rank[MAXR];
    int32_t pid[MAXR];
    uint64_t host[MAXR]; /* hash of each member's simulated host (ARGUS_HOST) */
    struct split_slot split[SPLIT_RING][MAXR];
    /* followed by: struct coll_slot coll[COLL_RING][nranks];
     *              struct p2p_slot p2p[nranks (src)][nranks (dst)][P2P_RING]; */
};

struct ncclComm {
    uint64_t magic;       /* 0 */
    uint64_t commHash;    /* 8: mix64 over the unique id (or over parent hash, split seq, color) */
    int rank;             /* 16 */
    int nRanks;           /* 20 */
    int cudaDev;          /* 24 */
    int globalRank;       /* 28 */
    uint64_t collOpCount; /* 32: collectives issued by the host so far */
    uint64_t opCount;     /* 40: all operations including point-to-point */
    uint64_t splitCount;  /* 48 */
    struct shm_hdr *shm;  /* 56 */
    size_t shm_size;
    uint64_t *sendCount, *recvCount; /* per peer */
    char shm_name[96];
    /* past NVIDIA's fields: sim-only */
    int spansHosts;           /* members on more than one simulated host */
    struct proxy *proxy;      /* the network proxy thread (spansHosts only) */
    struct coll_truth *truth; /* per collective: when this rank's stream reached it, first send */
};
typedef struct ncclComm *ncclComm_t;

#define COMM_MAGIC 0x4c434e4e53475241ULL /* "ARGSNNCL" */

/* ---- model knobs (per process; every rank is given the same values) ----------------------- */

static double g_alpha_ns = 8000.0;    /* per-hop latency */
static double g_nvlink_bw = 150.0;    /* bytes/ns within a host */
static double g_net_bw = 25.0;        /* bytes/ns between hosts */
static int g_local_world = 8;         /* ranks per host */
static int g_global_rank = -1;
static pthread_mutex_t g_link_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int a, b;
    double factor;
} g_links[64];
static int g_nlinks;

static uint64_t g_host_hash;  /* this process's simulated host */
static int g_net_ib;          /* ARGUS_SIM_NET=ib: the IB plugin's isend, else the socket one's */

static __thread int t_group_depth;
static __thread struct task *t_group[MAX_GROUP_TASKS];
static __thread int t_ngroup;
static __thread cudaStream_t t_group_stream[MAX_GROUP_TASKS];

static void load_env(void) {
    if (g_global_rank >= 0) return;
    const char *e = getenv("RANK");
    g_global_rank = e ? atoi(e) : 0;
    if ((e = getenv("LOCAL_WORLD_SIZE"))) g_local_world = atoi(e) > 0 ? atoi(e) : 8;
    if ((e = getenv("ARGUS_SIM_ALPHA_US"))) g_alpha_ns = atof(e) * 1000.0;
    if ((e = getenv("ARGUS_SIM_NVLINK_GBPS"))) g_nvlink_bw = atof(e);
    if ((e = getenv("ARGUS_SIM_NET_GBPS"))) g_net_bw = atof(e);
    e = getenv("ARGUS_SIM_NET");
    g_net_ib = e && strcmp(e, "ib") == 0;
    /* the launcher sets ARGUS_HOST; without it, the host is the rank's group of LOCAL_WORLD_SIZE
     * (link_bw's idea of a host) */
    char fallback[32];
    snprintf(fallback, sizeof(fallback), "#%d", g_global_rank / g_local_world);
    const char *host = getenv("ARGUS_HOST");
    if (!host || !*host) host = fallback;
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (const char *c = host; *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ULL;
    g_host_hash = h;
}

/* Slow the link between global ranks a and b by `factor` (1.0 restores it). */
API void argusSimSetLink(int a, int b, double factor) {
    pthread_mutex_lock(&g_link_mu);
    for (int i = 0; i < g_nlinks; i++) {
        if ((g_links[i].a == a && g_links[i].b == b) || (g_links[i].a == b && g_links[i].b == a)) {
            g_links[i].factor = factor;
            pthread_mutex_unlock(&g_link_mu);
            return;
        }
    }
    if (g_nlinks < 64) g_links[g_nlinks++] = (typeof(g_links[0])){a, b, factor};
    pthread_mutex_unlock(&g_link_mu);
}

static double link_bw(int ga, int gb) {
    double bw = (ga / g_local_world == gb / g_local_world) ? g_nvlink_bw : g_net_bw;
    pthread_mutex_lock(&g_link_mu);
    for (int i = 0; i < g_nlinks; i++) {
        if ((g_links[i].a == ga && g_links[i].b == gb) || (g_links[i].a == gb && g_links[i].b == ga)) {
            bw /= g_links[i].factor;
            break;
        }
    }
    pthread_mutex_unlock(&g_link_mu);
    return bw;
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* splitmix64's finaliser folded over 8-byte words: the communicator's hash (argus/sim/trainer.py
 * computes the same for its ground truth) */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static uint64_t hash_words(const void *p, size_t n, uint64_t h) {
    const unsigned char *c = p;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, c + i, 8);
        h = mix64(h ^ w);
    }
    return h;
}
#define HASH_SEED 0x6a09e667f3bcc909ULL

static size_t dtype_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

static struct coll_slot *coll_slot(struct shm_hdr *h, uint64_t seq, int rank) {
    struct coll_slot *base = (struct coll_slot *)(h + 1);
    return &base[(seq % COLL_RING) * h->nranks + (unsigned)rank];
}

static struct p2p_slot *p2p_slot(struct shm_hdr *h, int src, int dst, uint64_t seq) {
    struct p2p_slot *base =
        (struct p2p_slot *)((char *)(h + 1) + sizeof(struct coll_slot) * COLL_RING * h->nranks);
    return &base[((size_t)src * h->nranks + (unsigned)dst) * P2P_RING + seq % P2P_RING];
}

static size_t shm_bytes(int nranks) {
    return sizeof(struct shm_hdr) + sizeof(struct coll_slot) * COLL_RING * (size_t)nranks +
           sizeof(struct p2p_slot) * (size_t)nranks * nranks * P2P_RING;
}

static void post(struct shm_hdr *h) {
    __atomic_add_fetch(&h->gen, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &h->gen, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* A process that exited is gone (ESRCH) or a zombie its parent has not reaped yet. */
static int pid_dead(int pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static int peer_dead(struct shm_hdr *h) {
    for (uint32_t r = 0; r < h->nranks; r++) {
        int pid = __atomic_load_n(&h->pid[r], __ATOMIC_ACQUIRE);
        if (pid > 0 && pid_dead(pid)) return (int)r + 1;
    }
    return 0;
}

typedef int (*cond_fn)(void *ctx);

/* Wait on the communicator's futex until cond(ctx) holds. Returns 0, or -1 when the
 * communicator was aborted or a peer process died (then the wait would never end). */
static int wait_for(struct shm_hdr *h, cond_fn cond, void *ctx) {
    int64_t last_check = argusSimNow();
    for (;;) {
        uint32_t g = __atomic_load_n(&h->gen, __ATOMIC_ACQUIRE);
        if (cond(ctx)) return 0;
        if (__atomic_load_n(&h->aborted, __ATOMIC_ACQUIRE)) return -1;
        struct timespec to = {.tv_sec = 0, .tv_nsec = 200 * 1000 * 1000};
        syscall(SYS_futex, &h->gen, FUTEX_WAIT, g, &to, NULL, 0);
        int64_t now = argusSimNow();
        if (now - last_check > 1000000000LL) {
            last_check = now;
            int dead = peer_dead(h);
            if (dead) {
                fprintf(stderr, "argus-sim nccl: peer rank %d (pid %d) died; failing communicator\n",
                        dead - 1, h->pid[dead - 1]);
                __atomic_store_n(&h->aborted, 1, __ATOMIC_RELEASE);
                post(h);
                return -1;
            }
        }
    }
}

/* ---- network proxy ---------------------------------------------------------------------------- */

#define PROXY_SCHED 4096  /* sends scheduled and not yet posted, per communicator */
#define TRUTH_RING 1024   /* collectives whose times argusSimCollTimes still returns */
#define NET_REQS 8        /* requests in flight per send communicator */
#define NET_MAX_STEPS 64  /* sends per collective, at most */
#define NET_CHUNK (512 << 10) /* NCCL's 4 MiB buffer in 8 steps: the pipelined ops' slice */

/* When this rank's stream reached a collective and when its proxy first sent for it (ground
 * truth for the trainer, argusSimCollTimes; both CLOCK_REALTIME). */
struct coll_truth {
    uint64_t seq1;         /* seq + 1 once written */
    int64_t arrive_ns;
    int64_t first_send_ns; /* 0 until the first send (or with no proxy) */
};

/* The net plugin's send communicator (one per peer, stable) and its requests. */
struct net_request {
    void *send_comm, *data, *mhandle;
    int size, tag;
    uint64_t id, key;
};
struct net_send_comm {
    int peer, peer_global;
    uint64_t posted;
    struct net_request reqs[NET_REQS];
};

struct send_item {
    int64_t due; /* CLOCK_MONOTONIC (virtual GPU time) */
    uint64_t seq;
    const char *data;
    int peer, size, step, coll; /* step 0 of a collective: the rank's own first chunk */
};

struct proxy {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* on CLOCK_MONOTONIC */
    int stop, n, ring_peer;
    uint64_t dropped;
    ncclComm_t comm;
    struct net_send_comm *send_comms; /* [nRanks] */
    struct send_item items[PROXY_SCHED];
    char mhandle[64]; /* the registered buffer's handle */
};

static volatile uint64_t g_socket_isends, g_ib_isends;

/* The net plugins' isend (ncclNet v6-v8: int size, a tag, the registration handle, a request
 * out). NVIDIA's libnccl has ncclNetSocketIsend and ncclIbIsend as local symbols (.symtab, not
 * .dynsym): so here. noipa keeps them out of line, unspecialised and unmerged, so a probe on
 * their address sees every send with its real arguments. */
/* What both plugins' isend do: take the next request slot of the connection and fill it. */
static struct net_request *post_send(void *sendComm, void *data, int size, int tag, void *mhandle,
                                     volatile uint64_t *counter) {
    struct net_send_comm *sc = sendComm;
    struct net_request *r = &sc->reqs[sc->posted++ % NET_REQS];
    r->send_comm = sendComm;
    r->data = data;
    r->size = size;
    r->tag = tag;
    r->mhandle = mhandle;
    r->id = __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED);
    return r;
}

static __attribute__((noinline, noipa, used)) ncclResult_t ncclNetSocketIsend(void *sendComm, void *data, int size,
                                                                             int tag, void *mhandle,
                                                                             void **request) {
    if (!sendComm || !request || size < 0) return ncclInternalError;
    *request = post_send(sendComm, data, size, tag, mhandle, &g_socket_isends);
    return ncclSuccess;
}

static __attribute__((noinline, noipa, used)) ncclResult_t ncclIbIsend(void *sendComm, void *data, int size, int tag,
                                                                      void *mhandle, void **request) {
    if (!sendComm || !request || size < 0) return ncclInternalError;
    struct net_request *r = post_send(sendComm, data, size, tag, mhandle, &g_ib_isends);
    struct net_send_comm *sc = sendComm;
    r->key = (uint64_t)(uintptr_t)mhandle ^ ((uint64_t)(unsigned)sc->peer_global << 32); /* the "lkey" */
    *request = r;
    return ncclSuccess;
}

static int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void proxy_send(struct proxy *p, const struct send_item *it) {
    struct net_send_comm *sc = &p->send_comms[it->peer];
    void *req = NULL;
    int64_t t = realtime_ns();
    if (g_net_ib)
        ncclIbIsend(sc, (void *)it->data, it->size, p->comm->rank, p->mhandle, &req);
    else
        ncclNetSocketIsend(sc, (void *)it->data, it->size, p->comm->rank, p->mhandle, &req);
    if (it->coll && it->step == 0) {
        struct coll_truth *ct = &p->comm->truth[it->seq % TRUTH_RING];
        if (__atomic_load_n(&ct->seq1, __ATOMIC_ACQUIRE) == it->seq + 1)
            __atomic_store_n(&ct->first_send_ns, t, __ATOMIC_RELEASE);
    }
}

/* Post each scheduled send when its time comes (sends of several collectives interleave, as
 * NCCL's proxy progresses every operation in flight). */
static void *proxy_main(void *arg) {
    struct proxy *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        int best = -1;
        for (int i = 0; i < p->n; i++)
            if (best < 0 || p->items[i].due < p->items[best].due) best = i;
        if (best < 0) {
            if (p->stop) break;
            pthread_cond_wait(&p->cv, &p->mu);
            continue;
        }
        int64_t due = p->items[best].due;
        if (due > argusSimNow()) {
            if (p->stop) break; /* the communicator is gone: what is still to come never will */
            struct timespec ts = {.tv_sec = due / 1000000000LL, .tv_nsec = due % 1000000000LL};
            pthread_cond_timedwait(&p->cv, &p->mu, &ts);
            continue;
        }
        struct send_item it = p->items[best];
        p->items[best] = p->items[--p->n];
        pthread_mutex_unlock(&p->mu);
        proxy_send(p, &it);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* The stream worker's handoff: a short critical section, never a wait. */
static void proxy_push(struct proxy *p, const struct send_item *items, int n) {
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n; i++) {
        if (!p->stop && p->n < PROXY_SCHED) p->items[p->n++] = items[i];
        else p->dropped++;
    }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void proxy_start(ncclComm_t c) {
    struct proxy *p = calloc(1, sizeof(*p));
    if (!p) return;
    struct shm_hdr *h = c->shm;
    p->comm = c;
    p->send_comms = calloc((size_t)c->nRanks, sizeof(struct net_send_comm));
    if (!p->send_comms) {
        free(p);
        return;
    }
    for (int r = 0; r < c->nRanks; r++) {
        p->send_comms[r].peer = r;
        p->send_comms[r].peer_global = h->global_rank[r];
    }
    /* a ring's send to another host: the next member, in ring order, on another host */
    p->ring_peer = (c->rank + 1) % c->nRanks;
    for (int k = 1; k < c->nRanks; k++) {
        int r = (c->rank + k) % c->nRanks;
        if (h->host[r] != h->host[c->rank]) {
            p->ring_peer = r;
            break;
        }
    }
    snprintf(p->mhandle, sizeof(p->mhandle), "mr-%016llx-%d", (unsigned long long)c->commHash, c->rank);
    pthread_mutex_init(&p->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&p->th, NULL, proxy_main, p) != 0) {
        free(p->send_comms);
        free(p);
        return;
    }
    char name[16];
    snprintf(name, sizeof(name), "NCCL Progress%2d", c->cudaDev % 100);
    pthread_setname_np(p->th, name);
    c->proxy = p;
}

static void proxy_stop(ncclComm_t c) {
    struct proxy *p = c->proxy;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->th, NULL);
    /* p stays allocated: stream work already enqueued may still hand it sends (dropped) */
}

/* ---- communicators -------------------------------------------------------------------------- */

struct join_ctx {
    struct shm_hdr *h;
    uint32_t n;
};
static int joined_all(void *p) {
    struct join_ctx *c = p;
    return __atomic_load_n(&c->h->joined, __ATOMIC_ACQUIRE) >= c->n;
}

static ncclResult_t comm_open(uint64_t hash, int nranks, int rank, ncclComm_t *out) {
    load_env();
    struct ncclComm *c = calloc(1, sizeof(*c));
    if (!c) return ncclSystemError;
    const char *run = getenv("ARGUS_SIM_RUN");
    snprintf(c->shm_name, sizeof(c->shm_name), "/argus-sim-%s-%016llx", run ? run : "x",
             (unsigned long long)hash);
    int fd = shm_open(c->shm_name, O_CREAT | O_RDWR, 0600);
    if (fd < 0) {
        free(c);
        return ncclSystemError;
    }
    size_t size = shm_bytes(nranks);
    struct stat st;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        free(c);
        return ncclSystemError;
    }
    struct shm_hdr *h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (h == MAP_FAILED) {
        free(c);
        return ncclSystemError;
    }
    h->magic = COMM_MAGIC;
    h->comm_hash = hash;
    h->nranks = (uint32_t)nranks;
    __atomic_store_n(&h->global_rank[rank], g_global_rank, __ATOMIC_RELEASE);
    __atomic_store_n(&h->host[rank], g_host_hash, __ATOMIC_RELEASE);
    __atomic_store_n(&h->pid[rank], (int32_t)getpid(), __ATOMIC_RELEASE);
    __atomic_add_fetch(&h->joined, 1, __ATOMIC_ACQ_REL);
    post(h);
    struct join_ctx jc = {h, (uint32_t)nranks};
    if (wait_for(h, joined_all, &jc) != 0) {
        munmap(h, size);
        free(c);
        return ncclRemoteError;
    }
    /* Every member has it mapped now: the name can go, so a killed job leaves nothing in /dev/shm. */
    shm_unlink(c->shm_name);
    c->magic = COMM_MAGIC;
    c->commHash = hash;
    c->rank = rank;
    c->nRanks = nranks;
    c->globalRank = g_global_rank;
    c->shm = h;
    c->shm_size = size;
    c->sendCount = calloc((size_t)nranks, sizeof(uint64_t));
    c->recvCount = calloc((size_t)nranks, sizeof(uint64_t));
    c->truth = calloc(TRUTH_RING, sizeof(struct coll_truth));
    for (int r = 0; r < nranks; r++)
        if (__atomic_load_n(&h->host[r], __ATOMIC_ACQUIRE) != g_host_hash) c->spansHosts = 1;
    if (c->spansHosts) proxy_start(c);
    *out = c;
    return ncclSuccess;
}

static int valid(ncclComm_t c) { return c && c->magic == COMM_MAGIC; }

API ncclResult_t ncclGetVersion(int *version) NOFRAME;
API ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

API ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) return ncclInvalidArgument;
    memset(uniqueId, 0, sizeof(*uniqueId));
    /* like NCCL's bootstrap handle: a random magic, then a socket address (here loopback) */
    uint64_t magic = 0;
    if (getrandom(&magic, sizeof(magic), 0) != sizeof(magic)) magic = (uint64_t)argusSimNow() ^ (uint64_t)getpid();
    memcpy(uniqueId->internal, &magic, 8);
    unsigned char addr[16] = {2, 0, 0x9c, 0x40, 127, 0, 0, 1};
    uint16_t port = (uint16_t)(40000 + (magic % 20000));
    memcpy(addr + 2, &port, 2);
    memcpy(uniqueId->internal + 8, addr, sizeof(addr));
    return ncclSuccess;
}

API ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    if (!comm || nranks < 1 || nranks > MAXR || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    uint64_t hash = hash_words(commId.internal, NCCL_UNIQUE_ID_BYTES, HASH_SEED);
    return comm_open(hash, nranks, rank, comm);
}

API ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                        ncclConfig_t *config) NOFRAME;
API ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                        ncclConfig_t *config) {
    (void)config;
    return ncclCommInitRank(comm, nranks, commId, rank);
}

struct split_ctx {
    struct shm_hdr *h;
    uint64_t seq;
};
static int split_all_posted(void *p) {
    struct split_ctx *c = p;
    for (uint32_t r = 0; r < c->h->nranks; r++)
        if (__atomic_load_n(&c->h->split[c->seq % SPLIT_RING][r].seq1, __ATOMIC_ACQUIRE) != c->seq + 1) return 0;
    return 1;
}

API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    (void)config;
    if (!valid(comm) || !newcomm) return ncclInvalidArgument;
    struct shm_hdr *h = comm->shm;
    uint64_t seq = comm->splitCount++;
    struct split_slot *mine = &h->split[seq % SPLIT_RING][comm->rank];
    mine->color = color;
    mine->key = key;
    __atomic_store_n(&mine->seq1, seq + 1, __ATOMIC_RELEASE);
    post(h);
    struct split_ctx sc = {h, seq};
    if (wait_for(h, split_all_posted, &sc) != 0) return ncclRemoteError;
    if (color == NCCL_SPLIT_NOCOLOR) {
        *newcomm = NULL;
        return ncclSuccess;
    }
    int n = 0, me = 0;
    for (int r = 0; r < comm->nRanks; r++) {
        struct split_slot *s = &h->split[seq % SPLIT_RING][r];
        if (s->color != color) continue;
        if (s->key < key || (s->key == key && r < comm->rank)) me++;
        n++;
    }
    int64_t c64 = color;
    uint64_t words[3] = {comm->commHash, seq, (uint64_t)c64};
    uint64_t hh = hash_words(words, sizeof(words), HASH_SEED);
    return comm_open(hh, n, me, newcomm);
}

API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!valid(comm)) return ncclInvalidArgument;
    struct shm_hdr *h = comm->shm;
    comm->magic = 0;
    proxy_stop(comm);
    uint32_t left = __atomic_add_fetch(&h->left, 1, __ATOMIC_ACQ_REL);
    if (left >= h->nranks) shm_unlink(comm->shm_name);
    /* The mapping stays: stream work already enqueued may still reference it. */
    return ncclSuccess;
}

API ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!valid(comm)) return ncclInvalidArgument;
    __atomic_store_n(&comm->shm->aborted, 1, __ATOMIC_RELEASE);
    post(comm->shm);
    return ncclCommDestroy(comm);
}

API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!valid(comm) || !asyncError) return ncclInvalidArgument;
    *asyncError = __atomic_load_n(&comm->shm->aborted, __ATOMIC_ACQUIRE) ? ncclRemoteError : ncclSuccess;
    return ncclSuccess;
}

API ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!valid(comm) || !count) return ncclInvalidArgument;
    *count = comm->nRanks;
    return ncclSuccess;
}

API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!valid(comm) || !rank) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}

API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!valid(comm) || !device) return ncclInvalidArgument;
    *device = comm->cudaDev;
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

API const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    return "";
}

/* ---- operations ------------------------------------------------------------------------------ */

struct task {
    ncclComm_t comm;
    int op, peer;
    uint64_t seq, bytes;
    int64_t dur;
    const char *buf; /* the rank's send buffer (never dereferenced) */
};

/* Alpha-beta cost of an operation over the ring of the communicator's ranks. */
static int64_t model_ns(ncclComm_t c, int op, uint64_t bytes, int peer) {
    struct shm_hdr *h = c->shm;
    int n = c->nRanks;
    if (op == OP_SEND || op == OP_RECV) {
        int src = op == OP_SEND ? c->rank : peer, dst = op == OP_SEND ? peer : c->rank;
        return (int64_t)(g_alpha_ns + (double)bytes / link_bw(h->global_rank[src], h->global_rank[dst]));
    }
    if (n == 1) return 2000;
    double bw = 1e30;
    for (int i = 0; i < n; i++) {
        double b = link_bw(h->global_rank[i], h->global_rank[(i + 1) % n]);
        if (b < bw) bw = b;
    }
    double S = (double)bytes, hops = n - 1;
    switch (op) {
    case OP_ALLREDUCE: return (int64_t)(2 * hops * g_alpha_ns + 2 * hops / n * S / bw);
    case OP_ALLGATHER:
    case OP_REDUCESCATTER: return (int64_t)(hops * g_alpha_ns + hops / n * (S * n) / bw);
    default: return (int64_t)(hops * g_alpha_ns + S / bw); /* broadcast, reduce: pipelined ring */
    }
}

struct match_ctx {
    struct task **tasks;
    int n;
};

static int task_matched(struct task *t) {
    struct shm_hdr *h = t->comm->shm;
    if (t->op == OP_SEND) return __atomic_load_n(&p2p_slot(h, t->comm->rank, t->peer, t->seq)->r_seq1, __ATOMIC_ACQUIRE) == t->seq + 1;
    if (t->op == OP_RECV) return __atomic_load_n(&p2p_slot(h, t->peer, t->comm->rank, t->seq)->s_seq1, __ATOMIC_ACQUIRE) == t->seq + 1;
    for (int r = 0; r < t->comm->nRanks; r++)
        if (__atomic_load_n(&coll_slot(h, t->seq, r)->seq1, __ATOMIC_ACQUIRE) != t->seq + 1) return 0;
    return 1;
}

static int all_matched(void *p) {
    struct match_ctx *m = p;
    for (int i = 0; i < m->n; i++)
        if (!task_matched(m->tasks[i])) return 0;
    return 1;
}

/* The data movement of a matched operation: it starts once every member arrived. */
static void task_window(struct task *t, int64_t *start, int64_t *dur) {
    struct shm_hdr *h = t->comm->shm;
    if (t->op == OP_SEND || t->op == OP_RECV) {
        struct p2p_slot *s = t->op == OP_SEND ? p2p_slot(h, t->comm->rank, t->peer, t->seq)
                                              : p2p_slot(h, t->peer, t->comm->rank, t->seq);
        *start = s->s_ready > s->r_ready ? s->s_ready : s->r_ready;
        *dur = s->s_dur > s->r_dur ? s->s_dur : s->r_dur;
        return;
    }
    *start = *dur = 0;
    for (int r = 0; r < t->comm->nRanks; r++) {
        struct coll_slot *s = coll_slot(h, t->seq, r);
        if (s->ready > *start) *start = s->ready;
        if (s->dur > *dur) *dur = s->dur;
    }
}

static int64_t task_end(struct task *t) {
    int64_t start, dur;
    task_window(t, &start, &dur);
    return start + dur;
}

/* Network sends of an operation on a communicator that spans hosts: the ring steps of a
 * collective (2(n-1) for an all-reduce, n-1 for an all-gather or reduce-scatter, the pipelined
 * slices of a broadcast or reduce), two for a send to a peer on another host, none else. */
static int net_steps(struct task *t, int *peer, int *size) {
    ncclComm_t c = t->comm;
    struct proxy *p = c->proxy;
    int n = c->nRanks, steps;
    uint64_t chunk;
    if (!p || n < 2) return 0;
    *peer = p->ring_peer;
    switch (t->op) {
    case OP_ALLREDUCE: steps = 2 * (n - 1), chunk = t->bytes / (uint64_t)n; break;
    case OP_ALLGATHER:
    case OP_REDUCESCATTER: steps = n - 1, chunk = t->bytes; break;
    case OP_BROADCAST:
    case OP_REDUCE:
        steps = (int)((t->bytes + NET_CHUNK - 1) / NET_CHUNK);
        steps = steps < 2 ? 2 : steps > 8 ? 8 : steps;
        chunk = t->bytes / (uint64_t)steps;
        break;
    case OP_SEND:
        if (c->shm->host[t->peer] == c->shm->host[c->rank]) return 0;
        *peer = t->peer, steps = 2, chunk = t->bytes / 2;
        break;
    default: return 0;
    }
    *size = chunk < 1 ? 1 : chunk > INT_MAX ? INT_MAX : (int)chunk;
    return steps > NET_MAX_STEPS ? NET_MAX_STEPS : steps;
}

static int is_coll(int op) { return op != OP_SEND && op != OP_RECV; }

/* This rank's stream reached the operation at `ready`: note it, and hand the first send to the
 * proxy (the rank's own data need not wait for its peers). */
static void on_arrival(struct task *t, int64_t ready) {
    ncclComm_t c = t->comm;
    if (is_coll(t->op) && c->truth) {
        struct coll_truth *ct = &c->truth[t->seq % TRUTH_RING];
        __atomic_store_n(&ct->seq1, 0, __ATOMIC_RELEASE);
        ct->first_send_ns = 0;
        ct->arrive_ns = ready + (realtime_ns() - argusSimNow());
        __atomic_store_n(&ct->seq1, t->seq + 1, __ATOMIC_RELEASE);
    }
    int peer, size;
    if (net_steps(t, &peer, &size) < 1) return;
    struct send_item it = {.due = ready, .seq = t->seq, .data = t->buf, .peer = peer, .size = size,
                           .step = 0, .coll = is_coll(t->op)};
    proxy_push(c->proxy, &it, 1);
}

/* Every member arrived: the remaining sends, spaced over the modelled transfer. */
static void on_matched(struct task *t) {
    int peer, size, steps = net_steps(t, &peer, &size);
    if (steps < 2) return;
    int64_t start, dur;
    task_window(t, &start, &dur);
    struct send_item items[NET_MAX_STEPS];
    for (int i = 1; i < steps; i++) {
        int n = t->comm->nRanks;
        items[i - 1] = (struct send_item){.due = start + dur * i / steps, .seq = t->seq,
                                          .data = t->buf + (uint64_t)(i % n) * (uint64_t)size,
                                          .peer = peer, .size = size, .step = i, .coll = is_coll(t->op)};
    }
    proxy_push(t->comm->proxy, items, steps - 1);
}

/* Sim-only, for the trainer's ground truth: when this rank's stream reached collective `seq` of
 * `comm` and when its proxy first sent for it (CLOCK_REALTIME ns; 0: no send yet, or the
 * communicator stays on one host). 0 when known, -1 when not (not reached, or too old). */
API int argusSimCollTimes(ncclComm_t comm, uint64_t seq, int64_t *arrive_ns, int64_t *first_send_ns) {
    if (!valid(comm) || !comm->truth || !arrive_ns || !first_send_ns) return -1;
    struct coll_truth *ct = &comm->truth[seq % TRUTH_RING];
    if (__atomic_load_n(&ct->seq1, __ATOMIC_ACQUIRE) != seq + 1) return -1;
    *arrive_ns = ct->arrive_ns;
    *first_send_ns = __atomic_load_n(&ct->first_send_ns, __ATOMIC_ACQUIRE);
    return 0;
}

/* Sim-only: 1 when the communicator's members sit on more than one simulated host. */
API int argusSimCommSpansHosts(ncclComm_t comm) { return valid(comm) ? comm->spansHosts : -1; }

struct batch {
    int n;
    struct task *tasks[];
};

static void batch_free(void *p) {
    struct batch *b = p;
    for (int i = 0; i < b->n; i++) free(b->tasks[i]);
    free(b);
}

/* Runs on the stream worker: post every task of the batch, then wait until all are matched. */
static int64_t run_batch(void *arg, int64_t ready, int *failed) {
    struct batch *b = arg;
    for (int i = 0; i < b->n; i++) {
        struct task *t = b->tasks[i];
        struct shm_hdr *h = t->comm->shm;
        if (t->op == OP_SEND) {
            struct p2p_slot *s = p2p_slot(h, t->comm->rank, t->peer, t->seq);
            s->s_ready = ready;
            s->s_dur = t->dur;
            __atomic_store_n(&s->s_seq1, t->seq + 1, __ATOMIC_RELEASE);
        } else if (t->op == OP_RECV) {
            struct p2p_slot *s = p2p_slot(h, t->peer, t->comm->rank, t->seq);
            s->r_ready = ready;
            s->r_dur = t->dur;
            __atomic_store_n(&s->r_seq1, t->seq + 1, __ATOMIC_RELEASE);
        } else {
            struct coll_slot *s = coll_slot(h, t->seq, t->comm->rank);
            s->ready = ready;
            s->dur = t->dur;
            s->bytes = t->bytes;
            s->op = t->op;
            __atomic_store_n(&s->seq1, t->seq + 1, __ATOMIC_RELEASE);
        }
        on_arrival(t, ready);
        post(h);
    }
    int64_t end = ready;
    for (int i = 0; i < b->n; i++) {
        struct task *t = b->tasks[i];
        struct match_ctx m = {&t, 1};
        if (wait_for(t->comm->shm, all_matched, &m) != 0) {
            *failed = 1;
            return end;
        }
        on_matched(t);
        int64_t e = task_end(t);
        if (e > end) end = e;
    }
    return end;
}

static ncclResult_t submit(struct task **tasks, int n, cudaStream_t stream) {
    struct batch *b = malloc(sizeof(*b) + sizeof(struct task *) * (size_t)n);
    if (!b) return ncclSystemError;
    b->n = n;
    memcpy(b->tasks, tasks, sizeof(struct task *) * (size_t)n);
    if (argusSimStreamEnqueueFn(stream, run_batch, b, batch_free) != 0) {
        batch_free(b);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

static ncclResult_t issue(int op, const void *buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
    if (!valid(comm)) return ncclInvalidArgument;
    size_t sz = dtype_size(dt);
    if (sz == 0) return ncclInvalidArgument;
    if ((op == OP_SEND || op == OP_RECV || op == OP_BROADCAST || op == OP_REDUCE) &&
        (peer < 0 || peer >= comm->nRanks))
        return ncclInvalidArgument;
    struct task *t = calloc(1, sizeof(*t));
    if (!t) return ncclSystemError;
    t->comm = comm;
    t->op = op;
    t->peer = peer;
    t->bytes = (uint64_t)count * sz;
    t->buf = buf;
    if (op == OP_SEND) t->seq = comm->sendCount[peer]++;
    else if (op == OP_RECV) t->seq = comm->recvCount[peer]++;
    else t->seq = comm->collOpCount++;
    comm->opCount++;
    t->dur = model_ns(comm, op, t->bytes, peer);
    if (t_group_depth > 0) {
        if (t_ngroup >= MAX_GROUP_TASKS) {
            free(t);
            return ncclInvalidUsage;
        }
        t_group_stream[t_ngroup] = stream;
        t_group[t_ngroup++] = t;
        return ncclSuccess;
    }
    return submit(&t, 1, stream);
}

API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (!sendbuff || !recvbuff || op < 0 || op >= ncclNumOps) return ncclInvalidArgument;
    return issue(OP_ALLREDUCE, sendbuff, count, datatype, 0, comm, stream);
}

API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                               ncclComm_t comm, cudaStream_t stream) {
    if (!recvbuff) return ncclInvalidArgument;
    return issue(OP_BROADCAST, sendbuff ? sendbuff : recvbuff, count, datatype, root, comm, stream);
}

API ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                            ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    (void)recvbuff;
    if (!sendbuff || op < 0 || op >= ncclNumOps) return ncclInvalidArgument;
    return issue(OP_REDUCE, sendbuff, count, datatype, root, comm, stream);
}

API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                               ncclComm_t comm, cudaStream_t stream) {
    if (!sendbuff || !recvbuff) return ncclInvalidArgument;
    return issue(OP_ALLGATHER, sendbuff, sendcount, datatype, 0, comm, stream);
}

API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (!sendbuff || !recvbuff || op < 0 || op >= ncclNumOps) return ncclInvalidArgument;
    return issue(OP_REDUCESCATTER, sendbuff, recvcount, datatype, 0, comm, stream);
}

API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
    if (!sendbuff) return ncclInvalidArgument;
    return issue(OP_SEND, sendbuff, count, datatype, peer, comm, stream);
}

API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
    if (!recvbuff) return ncclInvalidArgument;
    return issue(OP_RECV, recvbuff, count, datatype, peer, comm, stream);
}

API ncclResult_t ncclGroupStart(void) {
    t_group_depth++;
    return ncclSuccess;
}

/* Operations of a group are posted together, so matched sends and receives cannot deadlock.
 * One batch per distinct stream (NCCL would also order the streams; not modelled). */
API ncclResult_t ncclGroupEnd(void) {
    if (t_group_depth <= 0) return ncclInvalidUsage;
    if (--t_group_depth > 0) return ncclSuccess;
    ncclResult_t rc = ncclSuccess;
    int done[MAX_GROUP_TASKS] = {0};
    for (int i = 0; i < t_ngroup; i++) {
        if (done[i]) continue;
        struct task *batch[MAX_GROUP_TASKS];
        int n = 0;
        for (int j = i; j < t_ngroup; j++) {
            if (!done[j] && t_group_stream[j] == t_group_stream[i]) {
                batch[n++] = t_group[j];
                done[j] = 1;
            }
        }
        ncclResult_t r = submit(batch, n, t_group_stream[i]);
        if (r != ncclSuccess) rc = r;
    }
    t_ngroup = 0;
    return rc;
}
