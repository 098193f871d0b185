/*
 * The asynchronous variant of the stand-in NCCL (libnccl.so.2), written from the public nccl.h,
 * the NCCL user guide and the net-plugin API (ncclNet_v9+ isend) only. It shares nccl.c's
 * design (a shared-memory rendezvous named in the unique id, futex bell, dead-peer detection,
 * our own struct ncclComm with nRanks at 0x1e8 and rank at 0x2f4, no data moved, version 22105)
 * but its calls behave like the real library's:
 *
 *   - collectives and send/recv ENQUEUE onto their stream and return at once. The stream's
 *     worker (the stand-in libcuda runs one per stream) reaches the operation after everything
 *     enqueued before it, posts its arrival, waits there until every peer's worker arrived at the
 *     same instance, then occupies the stream for the modelled transfer time. A slow GPU thus
 *     delays its peers' collectives on their GPUs, never their hosts. Sequence numbers are taken
 *     at enqueue, in program order; a communicator is meant to be used from one stream;
 *   - a group (ncclGroupStart/End) is enqueued at the outermost ncclGroupEnd as one unit on the
 *     stream of its first operation: its operations are posted together and completed together;
 *   - every member publishes its host name (ARGUS_HOST, else gethostname()). A link between two
 *     hosts is slower (NET_BYTES_PER_NS) than one inside a host (BYTES_PER_NS); a ring is paced
 *     by its slowest link;
 *   - a communicator whose members are on more than one host gets a network proxy thread per
 *     member, like NCCL's IB transport: when the rank's stream reaches a collective (or a send to
 *     another host) the proxy posts the first chunk at once with ncclIbIsend, then the remaining
 *     chunks spread over the transfer (NET_CHUNKS calls in all). A communicator within one host
 *     never calls it. ncclIbIsend is exported (this library is stripped) with the net plugin's
 *     signature and does a little real work: it checksums the head of the chunk and fills a
 *     request from its connection's pool;
 *   - errors found by a worker (a peer died while it waited) are asynchronous: the communicator
 *     is aborted, ncclCommGetAsyncError reports ncclRemoteError, later enqueues return it, and
 *     the stream moves on (its operations after that are skipped);
 *   - ncclCommDestroy first waits for the communicator's enqueued operations (it finalizes).
 *
 * Extra exports, outside the NCCL API: standinSetLinkFactor (as nccl.c) and standinCollTimes
 * (ground truth for tests: when this rank's worker reached collective number `seq`, when every
 * peer had, when it ended, when the proxy's first ncclIbIsend for it was called).
 *
 * What it shares with nccl.c is in nccl_common.h and nccl_common_api.h; this file holds the
 * variant's communicator, host-aware link model, network proxy and the stream's and host's sides.
 */
#define _GNU_SOURCE
#include "nccl_common.h"

#define NET_BYTES_PER_NS 20.0  /* ~20 GB/s per rank between hosts */
#define NET_CHUNKS 8           /* ncclIbIsend calls per collective (or send) over the network */
#define STAGE_BYTES 4096       /* the proxy's staging slot per chunk */
#define NET_REQS 32
#define PROXY_DEPTH 32
#define HIST 1024              /* collectives remembered per communicator for standinCollTimes */
#define HOST_LEN 64
#define SEG_MAGIC 0x53454732u /* not nccl.c's: the two variants' segments differ */
#define SEND_COMM_MAGIC 0x49425343u
#define MR_MAGIC 0x49424d52u

/* ------------------------------------------------------------------------------ shared segment */

struct member {
    _Atomic int32_t state; /* 0 empty, 1 joined, 2 left (ncclCommDestroy) */
    int32_t pid;
    int32_t global; /* RANK of the member, -1 if unknown */
    int32_t pad;
    uint64_t start_ticks; /* /proc/PID/stat starttime: tells a reused pid from the member */
    char host[HOST_LEN];  /* ARGUS_HOST (or gethostname), written before state becomes 1 */
    _Atomic uint64_t coll_seq;
    _Atomic uint64_t coll_ns[COLL_SLOTS];
};

/* ------------------------------------------------------------------------------ communicator */

/* What this rank knows about one collective, for standinCollTimes. Guarded by the comm's mu. */
struct coll_rec {
    uint64_t seq; /* 0: empty */
    uint64_t bytes;
    uint64_t enqueue_rt, arrive_rt, arrive_mono, start_mono, end_mono, end_rt, first_isend_rt;
    uint32_t isend_calls;
    int32_t state; /* 0 enqueued, 1 reached by the worker, 2 done, 3 failed */
};

/* The layout standinCollTimes fills (CLOCK_REALTIME ns; 0: not yet). */
struct standin_coll_times {
    uint64_t seq, bytes;
    uint64_t enqueue_ns;     /* the host enqueued it */
    uint64_t arrive_ns;      /* this rank's stream worker reached it */
    uint64_t start_ns;       /* the last member's worker reached it: the transfer began */
    uint64_t end_ns;         /* the transfer ended; the stream moved on */
    uint64_t first_isend_ns; /* the proxy called ncclIbIsend for its first chunk */
    uint32_t isend_calls;
    int32_t state;
};

struct proxy;

/* Our own layout. The reserved areas stand for state a real library keeps (channels, proxy,
   tuning tables); they push nRanks and rank to offsets an observer cannot guess. */
struct ncclComm {
    uint64_t magic;              /* 0x000 */
    uint64_t commHash;           /* 0x008 */
    char shmName[64];            /* 0x010 */
    struct segment *seg;         /* 0x050 */
    uint64_t collSeq;            /* 0x058: collectives enqueued on this communicator */
    int32_t globalRank;          /* 0x060 */
    _Atomic int32_t aborted;     /* 0x064: a peer died; every later operation fails */
    _Atomic int32_t asyncError;  /* 0x068: what ncclCommGetAsyncError reports */
    int32_t multiHost;           /* 0x06c: members on more than one host */
    uint8_t reserved0[0x178];    /* 0x070 */
    int32_t nRanks;              /* 0x1e8 */
    uint8_t reserved1[0x108];    /* 0x1ec */
    int32_t rank;                /* 0x2f4 */
    uint64_t pad1;               /* 0x2f8 */
    uint64_t sendSeq[MAX_RANKS]; /* 0x300: sends enqueued per peer */
    uint64_t recvSeq[MAX_RANKS]; /* 0x500: receives enqueued per peer */
    pthread_mutex_t mu;          /* pending, hist */
    pthread_cond_t idle;
    int pending;                 /* operations enqueued, not yet run by the worker */
    struct proxy *proxy;         /* multi-host communicators only */
    struct coll_rec hist[HIST];
};

#include "nccl_common_api.h"

/* ------------------------------------------------------------------------------ helpers */

static uint64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void own_host(char out[HOST_LEN]) {
    const char *h = getenv("ARGUS_HOST");
    if (h && *h) {
        snprintf(out, HOST_LEN, "%s", h);
        return;
    }
    if (gethostname(out, HOST_LEN) != 0) snprintf(out, HOST_LEN, "localhost");
    out[HOST_LEN - 1] = 0;
}

/* A joining member publishes its host. */
static void member_publish(struct member *me) { own_host(me->host); }

/* ------------------------------------------------------------------------------ link model */

static int same_host(const struct ncclComm *c, int a, int b) {
    return strncmp(c->seg->m[a].host, c->seg->m[b].host, HOST_LEN) == 0;
}

/* Bytes per ns between two members (comm ranks): the network between hosts, NVLink-like inside. */
static double link_bw(const struct ncclComm *c, int a, int b) {
    double bw = same_host(c, a, b) ? BYTES_PER_NS : NET_BYTES_PER_NS;
    return bw / link_factor(global_of(c, a), global_of(c, b));
}

/* A ring over the communicator's ranks in order: its slowest link paces every step. */
static double ring_bw(const struct ncclComm *c) {
    double bw = BYTES_PER_NS;
    int n = c->nRanks;
    for (int i = 0; i < n && n > 1; i++) {
        double x = link_bw(c, i, (i + 1) % n);
        if (x < bw) bw = x;
    }
    return bw;
}

/* ------------------------------------------------------------------------------ operations */

/* What a stream's worker runs: one operation, or a whole group. */
struct task {
    int n;
    struct op ops[];
};

static uint64_t model_ns(const struct op *o) {
    const struct ncclComm *c = o->comm;
    double n = c->nRanks, b = (double)o->bytes, t;
    if (o->kind == K_SEND || o->kind == K_RECV) return (uint64_t)(ALPHA_NS + b / link_bw(c, c->rank, o->peer));
    if (c->nRanks == 1) return 0;
    double bw = ring_bw(c);
    switch (o->kind) {
    case K_ALLREDUCE: /* ring: reduce-scatter then all-gather, 2(n-1) steps of b/n */
        t = 2 * (n - 1) * ALPHA_NS + 2 * (n - 1) / n * b / bw;
        break;
    case K_ALLGATHER:
    case K_REDUCESCATTER: /* n-1 steps of one chunk */
        t = (n - 1) * ALPHA_NS + (n - 1) * b / bw;
        break;
    default: /* broadcast: pipelined along the ring */
        t = (n - 1) * ALPHA_NS + b / bw;
        break;
    }
    return (uint64_t)t;
}

/* Bytes this rank puts on the wire for `o` (what the proxy splits into chunks). */
static size_t wire_bytes(const struct op *o) {
    double n = o->comm->nRanks, b = (double)o->bytes;
    switch (o->kind) {
    case K_ALLREDUCE: return (size_t)(2 * (n - 1) / n * b);
    case K_ALLGATHER:
    case K_REDUCESCATTER: return (size_t)((n - 1) * b);
    default: return o->bytes;
    }
}

/* Does `o` use this rank's network proxy? Collectives of a multi-host communicator, and sends to
   a member on another host. */
static int uses_net(const struct op *o) {
    const struct ncclComm *c = o->comm;
    if (!c->proxy) return 0;
    if (is_coll(o->kind)) return c->nRanks > 1;
    return o->kind == K_SEND && !same_host(c, c->rank, o->peer);
}

static struct coll_rec *rec_of(struct ncclComm *c, uint64_t seq) {
    struct coll_rec *r = &c->hist[seq % HIST];
    return r->seq == seq ? r : NULL;
}

/* ------------------------------------------------------------------------------ network proxy */

/* What the IB transport keeps per connection and per registered buffer (our own shapes). */
struct ib_request {
    int used;
    int tag;
    size_t size;
    void *data;
    uint32_t sum;
};

struct ib_mr {
    uint32_t magic;
    uint32_t lkey;
    void *base;
    size_t len;
};

struct ib_send_comm {
    uint32_t magic;
    int peer; /* the next member on the ring */
    uint64_t posted;
    uint64_t bytes;
    uint32_t sum;
    struct ib_request reqs[NET_REQS];
};

struct proxy_job {
    struct ncclComm *comm;
    uint64_t seq;   /* collectives: the comm's collective number; 0 for a send */
    size_t chunk;   /* bytes per ncclIbIsend */
    int sent;       /* calls made so far */
    int timed;      /* start/end known: every peer arrived */
    int failed;
    uint64_t start, end;
};

struct proxy {
    struct ncclComm *comm;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    int stop;
    uint64_t head, tail;
    struct proxy_job q[PROXY_DEPTH];
    pthread_t thread;
    struct ib_send_comm send;
    struct ib_mr mr;
    unsigned char staging[NET_CHUNKS][STAGE_BYTES];
};

/* The net plugin's isend (ncclNet v9+ signature). Posts `size` bytes of the registered buffer at
   `data` to the connection's peer: takes a request from the connection's pool, checksums the
   head of the chunk into it, and returns it in *request (NULL: no request free, try again). */
API __attribute__((noinline)) int ncclIbIsend(void *sendComm, void *data, size_t size, int tag, void *mhandle,
                                              void *phandle, void **request) {
    (void)phandle; /* the profiler's handle: no profiler here */
    struct ib_send_comm *sc = sendComm;
    struct ib_mr *mr = mhandle;
    if (!sc || sc->magic != SEND_COMM_MAGIC || !request) return ncclInternalError;
    if (!mr || mr->magic != MR_MAGIC || (uintptr_t)data < (uintptr_t)mr->base ||
        (uintptr_t)data >= (uintptr_t)mr->base + mr->len)
        return ncclInternalError;
    struct ib_request *r = &sc->reqs[sc->posted % NET_REQS];
    if (r->used) {
        *request = NULL;
        return ncclSuccess;
    }
    size_t head = (uintptr_t)mr->base + mr->len - (uintptr_t)data;
    if (head > 64) head = 64;
    if (head > size) head = size;
    uint32_t h = 2166136261u; /* FNV-1a over the head of the chunk */
    for (size_t i = 0; i < head; i++) h = (h ^ ((const unsigned char *)data)[i]) * 16777619u;
    r->used = 1;
    r->tag = tag;
    r->size = size;
    r->data = data;
    r->sum = h;
    sc->posted++;
    sc->bytes += size;
    sc->sum ^= h;
    *request = r;
    return ncclSuccess;
}

/* The transfer of a request is modelled by the worker's sleep: testing one completes it. */
static void ib_test(void *request) {
    struct ib_request *r = request;
    r->used = 0;
}

static void proxy_send(struct proxy *p, struct proxy_job *j, int i) {
    unsigned char *slot = p->staging[i % NET_CHUNKS];
    /* what a GPU would have written into the FIFO slot: a small header */
    uint64_t hdr[3] = {j->seq, (uint64_t)i, (uint64_t)j->chunk};
    memcpy(slot, hdr, sizeof(hdr));
    uint64_t t = realtime_ns();
    void *req = NULL;
    for (int tries = 0; tries < 2 && !req; tries++) {
        if (ncclIbIsend(&p->send, slot, j->chunk, p->comm->rank, &p->mr, NULL, &req) != ncclSuccess) return;
        if (!req) ib_test(&p->send.reqs[p->send.posted % NET_REQS]); /* free the oldest, retry */
    }
    if (req) ib_test(req);
    if (!j->seq) return;
    struct ncclComm *c = j->comm;
    pthread_mutex_lock(&c->mu);
    struct coll_rec *r = rec_of(c, j->seq);
    if (r) {
        if (i == 0) r->first_isend_rt = t;
        r->isend_calls++;
    }
    pthread_mutex_unlock(&c->mu);
}

/* Chunk 0 goes out as soon as the rank's worker reached the operation; chunk i (of NET_CHUNKS)
   at start + i/NET_CHUNKS of the transfer. First chunks come before any due chunk. */
static void *proxy_main(void *arg) {
    struct proxy *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        while (p->head < p->tail) {
            struct proxy_job *j = &p->q[p->head % PROXY_DEPTH];
            if (!j->failed && !(j->timed && j->sent >= NET_CHUNKS)) break;
            p->head++;
        }
        struct proxy_job *next = NULL;
        uint64_t due = UINT64_MAX;
        for (uint64_t k = p->head; k < p->tail; k++) {
            struct proxy_job *j = &p->q[k % PROXY_DEPTH];
            uint64_t t;
            if (j->failed) continue;
            if (j->sent == 0)
                t = 0;
            else if (!j->timed || j->sent >= NET_CHUNKS)
                continue;
            else
                t = j->start + (j->end - j->start) * (uint64_t)j->sent / NET_CHUNKS;
            if (t < due) {
                due = t;
                next = j;
            }
        }
        if (!next) {
            pthread_cond_wait(&p->cv, &p->mu);
            continue;
        }
        if (due > now_ns()) {
            struct timespec ts = {(time_t)(due / 1000000000ull), (long)(due % 1000000000ull)};
            pthread_cond_timedwait(&p->cv, &p->mu, &ts);
            continue;
        }
        int i = next->sent;
        pthread_mutex_unlock(&p->mu);
        proxy_send(p, next, i); /* the slot stays ours: only this thread advances head */
        pthread_mutex_lock(&p->mu);
        next->sent++;
        pthread_cond_broadcast(&p->cv); /* a worker may wait for a free slot */
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static ncclResult_t proxy_start(struct ncclComm *c) {
    struct proxy *p = calloc(1, sizeof(*p));
    if (!p) return ncclSystemError;
    p->comm = c;
    pthread_mutex_init(&p->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->cv, &ca);
    pthread_condattr_destroy(&ca);
    p->send.magic = SEND_COMM_MAGIC;
    p->send.peer = (c->rank + 1) % c->nRanks;
    p->mr = (struct ib_mr){MR_MAGIC, 0x1000u + (uint32_t)c->rank, p->staging, sizeof(p->staging)};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 128 * 1024);
    int rc = pthread_create(&p->thread, &attr, proxy_main, p);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(p);
        return ncclSystemError;
    }
    c->proxy = p;
    return ncclSuccess;
}

static void proxy_stop(struct proxy *p) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* The worker reached `o`: the proxy sends its first chunk now. Returns the job (to time later). */
static struct proxy_job *proxy_arrived(const struct op *o) {
    struct proxy *p = o->comm->proxy;
    pthread_mutex_lock(&p->mu);
    while (p->tail - p->head >= PROXY_DEPTH && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    struct proxy_job *j = &p->q[p->tail % PROXY_DEPTH];
    size_t chunk = wire_bytes(o) / NET_CHUNKS;
    *j = (struct proxy_job){o->comm, is_coll(o->kind) ? o->seq : 0, chunk ? chunk : 1, 0, 0, 0, 0, 0};
    p->tail++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return j;
}

static void proxy_timed(struct proxy *p, struct proxy_job *j, uint64_t start, uint64_t end, int failed) {
    pthread_mutex_lock(&p->mu);
    j->start = start;
    j->end = end;
    j->timed = 1;
    j->failed = failed;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* A communicator that spans hosts gets its network proxy (and every one its bookkeeping). */
static ncclResult_t comm_setup(struct ncclComm *c) {
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->idle, NULL);
    for (int i = 0; i < c->nRanks; i++) c->multiHost |= !same_host(c, c->rank, i);
    return c->multiHost ? proxy_start(c) : ncclSuccess;
}

/* ------------------------------------------------------------------------------ the stream's side */

static void rec_update(struct ncclComm *c, uint64_t seq, int state, uint64_t mono, uint64_t rt) {
    pthread_mutex_lock(&c->mu);
    struct coll_rec *r = rec_of(c, seq);
    if (r) {
        if (state == 1) {
            r->arrive_mono = mono;
            r->arrive_rt = rt;
        } else if (state == 2) {
            r->end_mono = mono;
            r->end_rt = rt;
        }
        r->state = state;
    }
    pthread_mutex_unlock(&c->mu);
}

static void rec_start(struct ncclComm *c, uint64_t seq, uint64_t start_mono) {
    pthread_mutex_lock(&c->mu);
    struct coll_rec *r = rec_of(c, seq);
    if (r) r->start_mono = start_mono;
    pthread_mutex_unlock(&c->mu);
}

static void fail_ops(struct op *ops, int n, int err) {
    for (int i = 0; i < n; i++) {
        struct ncclComm *c = ops[i].comm;
        atomic_store(&c->aborted, 1);
        int none = ncclSuccess;
        atomic_compare_exchange_strong(&c->asyncError, &none, err);
    }
}

/* Post, wait for every party, then hold the stream until the last transfer ends. Returns 0, or
   the error that aborted the operations' communicators. */
static ncclResult_t run_ops(struct op *ops, int n, struct proxy_job **jobs, uint64_t arrive) {
    for (int i = 0; i < n; i++)
        if (atomic_load(&ops[i].comm->aborted)) return ncclRemoteError; /* skipped */
    for (int i = 0; i < n; i++) post(&ops[i], arrive);
    for (int i = 0; i < n; i++)
        if (uses_net(&ops[i])) jobs[i] = proxy_arrived(&ops[i]);
    if (await_parties(ops, n) >= 0) return ncclRemoteError;
    uint64_t end = transfer_end(ops, n);
    for (int i = 0; i < n; i++) {
        if (is_coll(ops[i].kind)) rec_start(ops[i].comm, ops[i].seq, ops[i].start_ns);
        if (jobs[i]) {
            proxy_timed(ops[i].comm->proxy, jobs[i], ops[i].start_ns, end, 0);
            jobs[i] = NULL;
        }
    }
    sleep_until(end);
    return ncclSuccess;
}

/* Called by the stream's worker when it reaches the task (or inline, without a stand-in GPU). */
static void run_task(void *arg) {
    struct task *t = arg;
    uint64_t arrive = now_ns(), arrive_rt = realtime_ns();
    struct proxy_job *jobs[t->n];
    memset(jobs, 0, sizeof(jobs));
    for (int i = 0; i < t->n; i++)
        if (is_coll(t->ops[i].kind)) rec_update(t->ops[i].comm, t->ops[i].seq, 1, arrive, arrive_rt);
    ncclResult_t rc = run_ops(t->ops, t->n, jobs, arrive);
    if (rc != ncclSuccess) {
        fail_ops(t->ops, t->n, rc);
        for (int i = 0; i < t->n; i++)
            if (jobs[i]) proxy_timed(t->ops[i].comm->proxy, jobs[i], 0, 0, 1);
    }
    uint64_t end = now_ns(), end_rt = realtime_ns();
    for (int i = 0; i < t->n; i++) {
        struct ncclComm *c = t->ops[i].comm;
        if (is_coll(t->ops[i].kind)) rec_update(c, t->ops[i].seq, rc == ncclSuccess ? 2 : 3, end, end_rt);
        pthread_mutex_lock(&c->mu);
        if (--c->pending == 0) pthread_cond_broadcast(&c->idle);
        pthread_mutex_unlock(&c->mu);
    }
    free(t);
}

/* ------------------------------------------------------------------------------ the host's side */

typedef int (*enqueue_fn)(void *stream, void (*fn)(void *), void *arg);
static enqueue_fn g_enqueue;
static pthread_once_t g_enqueue_once = PTHREAD_ONCE_INIT;

/* Without the stand-in libcuda there is no GPU: operations run on the calling thread. */
static void resolve_enqueue(void) { g_enqueue = (enqueue_fn)cuda_sym("standinStreamEnqueue"); }

/* Take the operation's sequence number now, in program order, and note a collective. */
static void number(struct op *o) {
    take_seq(o);
    if (is_coll(o->kind)) {
        struct ncclComm *c = o->comm;
        pthread_mutex_lock(&c->mu);
        struct coll_rec *r = &c->hist[o->seq % HIST];
        *r = (struct coll_rec){.seq = o->seq, .bytes = o->bytes, .enqueue_rt = realtime_ns()};
        pthread_mutex_unlock(&c->mu);
    }
}

/* Enqueue `ops` (one call, or the group of the outermost ncclGroupEnd) as one unit on the stream
   of the first. */
static ncclResult_t launch(struct op *ops, int n) {
    for (int i = 0; i < n; i++) {
        int err = atomic_load(&ops[i].comm->asyncError);
        if (err != ncclSuccess) return (ncclResult_t)err;
    }
    struct task *t = malloc(sizeof(*t) + (size_t)n * sizeof(struct op));
    if (!t) return ncclSystemError;
    t->n = n;
    memcpy(t->ops, ops, (size_t)n * sizeof(struct op));
    for (int i = 0; i < n; i++) {
        struct ncclComm *c = ops[i].comm;
        pthread_mutex_lock(&c->mu);
        c->pending++;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_once(&g_enqueue_once, resolve_enqueue);
    int rc = g_enqueue ? g_enqueue(ops[0].stream, run_task, t) : 3;
    if (rc == 3) { /* CUDA_ERROR_NOT_INITIALIZED: no GPU work to order with, run it here */
        run_task(t);
        return (ncclResult_t)atomic_load(&ops[0].comm->asyncError);
    }
    if (rc != 0) {
        for (int i = 0; i < n; i++) {
            struct ncclComm *c = ops[i].comm;
            pthread_mutex_lock(&c->mu);
            if (--c->pending == 0) pthread_cond_broadcast(&c->idle);
            pthread_mutex_unlock(&c->mu);
        }
        free(t);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

static ncclResult_t submit(struct op o) {
    if (g_group_depth > 0) {
        if (g_group_nops < MAX_GROUP_OPS) number(&o); /* a full group takes no number: group_add fails */
        return group_add(&o);
    }
    int err = atomic_load(&o.comm->asyncError);
    if (err != ncclSuccess) return (ncclResult_t)err;
    number(&o);
    return launch(&o, 1);
}

/* ------------------------------------------------------------------------------ API */

/* Finalizes first (waits until the worker ran every enqueued operation); the last member out
   removes the segment. */
API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess; /* documented as a no-op */
    if (check_comm(comm) != ncclSuccess) return ncclInvalidArgument;
    pthread_mutex_lock(&comm->mu);
    while (comm->pending > 0) pthread_cond_wait(&comm->idle, &comm->mu);
    pthread_mutex_unlock(&comm->mu);
    if (comm->proxy) proxy_stop(comm->proxy);
    comm_leave(comm);
    pthread_cond_destroy(&comm->idle);
    pthread_mutex_destroy(&comm->mu);
    free(comm);
    return ncclSuccess;
}

/* ncclSuccess until a worker found an error (then ncclRemoteError: a peer died). */
API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (check_comm(comm) != ncclSuccess || !asyncError) return ncclInvalidArgument;
    *asyncError = (ncclResult_t)atomic_load(&comm->asyncError);
    return ncclSuccess;
}

/* Not NCCL: ground truth about collective number `seq` (1-based, per communicator, in enqueue
   order) of this rank, while it is among the last HIST. ncclInvalidArgument if it is not. */
API ncclResult_t standinCollTimes(ncclComm_t comm, uint64_t seq, struct standin_coll_times *out) {
    if (check_comm(comm) != ncclSuccess || !out || !seq) return ncclInvalidArgument;
    ncclResult_t rc = ncclInvalidArgument;
    pthread_mutex_lock(&comm->mu);
    struct coll_rec *r = rec_of(comm, seq);
    if (r) {
        /* the start is known on the monotonic clock: shift it by this rank's offset at arrival */
        int64_t off = (int64_t)r->arrive_rt - (int64_t)r->arrive_mono;
        *out = (struct standin_coll_times){
            .seq = r->seq,
            .bytes = r->bytes,
            .enqueue_ns = r->enqueue_rt,
            .arrive_ns = r->arrive_rt,
            .start_ns = r->start_mono ? (uint64_t)((int64_t)r->start_mono + off) : 0,
            .end_ns = r->end_rt,
            .first_isend_ns = r->first_isend_rt,
            .isend_calls = r->isend_calls,
            .state = r->state,
        };
        rc = ncclSuccess;
    }
    pthread_mutex_unlock(&comm->mu);
    return rc;
}
