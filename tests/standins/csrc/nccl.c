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
 *
 * What it shares with the async variant (nccl_async.c) is in nccl_common.h and nccl_common_api.h;
 * this file holds the blocking family's communicator, link model and blocking calls.
 */
#define _GNU_SOURCE
#include "nccl_common.h"

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

#include "nccl_common_api.h"

/* Nothing beyond pid, RANK and start time. */
static void member_publish(struct member *me) { (void)me; }

static ncclResult_t comm_setup(struct ncclComm *c) {
    (void)c;
    return ncclSuccess;
}

/* ------------------------------------------------------------------------------ link model */

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

/* ------------------------------------------------------------------------------ blocking calls */

typedef int (*stream_wait_fn)(void *);
static stream_wait_fn g_stream_wait;
static pthread_once_t g_stream_wait_once = PTHREAD_ONCE_INIT;

/* Without the stand-in libcuda there is no GPU work to wait for. */
static void resolve_stream_wait(void) { g_stream_wait = (stream_wait_fn)cuda_sym("standinStreamWait"); }

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

/* Drain, post, wait for every party, then sleep until the last transfer ends. */
static ncclResult_t launch(struct op *ops, int n) {
    for (int i = 0; i < n; i++)
        if (ops[i].comm->aborted) return ncclRemoteError;
    ncclResult_t rc = drain_streams(ops, n);
    if (rc != ncclSuccess) return rc;
    for (int i = 0; i < n; i++) {
        take_seq(&ops[i]);
        post(&ops[i], now_ns());
    }
    int dead = await_parties(ops, n);
    if (dead >= 0) {
        for (int j = 0; j < n; j++) ops[j].comm->aborted = 1;
        ops[dead].comm->lastError = ncclRemoteError;
        return ncclRemoteError;
    }
    sleep_until(transfer_end(ops, n));
    return ncclSuccess;
}

static ncclResult_t submit(struct op o) {
    if (g_group_depth > 0) return group_add(&o);
    return launch(&o, 1);
}

/* ------------------------------------------------------------------------------ API */

/* The last member out removes the segment. */
API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess; /* documented as a no-op */
    if (check_comm(comm) != ncclSuccess) return ncclInvalidArgument;
    comm_leave(comm);
    free(comm);
    return ncclSuccess;
}
