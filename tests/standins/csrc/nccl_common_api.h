/*
 * The second half of what both stand-in libnccls share (see nccl_common.h): the shared-memory
 * segment and its rendezvous (posts, the futex bell, waiting for every party, dead-peer checks),
 * communicator set-up and tear-down, argument checks, groups, and the NCCL API both variants
 * export with the same behaviour.
 *
 * Before including it the variant defines:
 *   - SEG_MAGIC, its own segment magic (the variants' segments differ);
 *   - struct member (one rank's slot in the segment) with  _Atomic int32_t state; int32_t pid,
 *     global; uint64_t start_ticks; _Atomic uint64_t coll_seq, coll_ns[COLL_SLOTS];
 *   - struct ncclComm with  uint64_t magic, commHash; char shmName[64]; struct segment *seg;
 *     uint64_t collSeq; int32_t globalRank, nRanks (at 0x1e8), rank (at 0x2f4);
 *     uint64_t sendSeq[MAX_RANKS] (at 0x300), recvSeq[MAX_RANKS];
 * and afterwards the five functions declared below.
 */
#ifndef STANDIN_NCCL_COMMON_API_H
#define STANDIN_NCCL_COMMON_API_H

#include "nccl_common.h"

#ifndef SEG_MAGIC
#error "define SEG_MAGIC (and the variant's struct member and struct ncclComm) before including nccl_common_api.h"
#endif

struct segment {
    _Atomic uint32_t magic;
    _Atomic int32_t nranks;
    _Atomic uint32_t bell; /* futex word, bumped after every post */
    _Atomic int32_t refs;
    struct member m[MAX_RANKS];
    struct lane lanes[MAX_RANKS][MAX_RANKS]; /* [src][dst] */
};

_Static_assert(offsetof(struct ncclComm, nRanks) == 0x1e8, "nRanks offset");
_Static_assert(offsetof(struct ncclComm, rank) == 0x2f4, "rank offset");
_Static_assert(offsetof(struct ncclComm, sendSeq) == 0x300, "sendSeq offset");

/* The variant's: the modelled transfer time of `o` once every party arrived */
static uint64_t model_ns(const struct op *o);
/* The variant's: a checked call, run or enqueued now, or added to the open group (group_add) */
static ncclResult_t submit(struct op o);
/* The variant's: run or enqueue the operations of the outermost ncclGroupEnd together */
static ncclResult_t launch(struct op *ops, int n);
/* The variant's: what else a joining member publishes in its slot before it counts as joined */
static void member_publish(struct member *me);
/* The variant's: the rest of a new communicator's state, once every member joined. On an error
   the communicator is freed and this member leaves the segment. */
static ncclResult_t comm_setup(struct ncclComm *c);

/* ------------------------------------------------------------------------------ rendezvous */

static void ring_bell(struct segment *seg) {
    atomic_fetch_add(&seg->bell, 1);
    syscall(SYS_futex, &seg->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Sleep until the bell rings past `seen` or the timeout passes: the peers' posts wake us. */
static void wait_bell(struct segment *seg, uint32_t seen, long long timeout_ns) {
    struct timespec rel = {(time_t)(timeout_ns / 1000000000ll), (long)(timeout_ns % 1000000000ll)};
    syscall(SYS_futex, &seg->bell, FUTEX_WAIT, seen, &rel, NULL, 0);
}

static int member_alive(const struct member *m) {
    char st;
    uint64_t ticks;
    if (!proc_stat(m->pid, &st, &ticks)) return 0;
    if (st == 'Z' || st == 'X' || st == 'x') return 0; /* killed, not yet reaped by its parent */
    return ticks == m->start_ticks;
}

static int global_of(const struct ncclComm *c, int r) {
    int g = c->seg->m[r].global;
    return g >= 0 ? g : r;
}

/* The operation's sequence number: per peer and direction for send/recv, per communicator for
   collectives. */
static void take_seq(struct op *o) {
    struct ncclComm *c = o->comm;
    if (o->kind == K_SEND)
        o->seq = ++c->sendSeq[o->peer];
    else if (o->kind == K_RECV)
        o->seq = ++c->recvSeq[o->peer];
    else
        o->seq = ++c->collSeq;
}

/* This rank arrived at `o` (its sequence number taken) at time t: publish it, wake the peers. */
static void post(struct op *o, uint64_t t) {
    struct ncclComm *c = o->comm;
    struct segment *seg = c->seg;
    if (o->kind == K_SEND) {
        struct lane *l = &seg->lanes[c->rank][o->peer];
        atomic_store(&l->send_ns[o->seq % LANE_SLOTS], t);
        atomic_store(&l->send_seq, o->seq);
    } else if (o->kind == K_RECV) {
        struct lane *l = &seg->lanes[o->peer][c->rank];
        atomic_store(&l->recv_ns[o->seq % LANE_SLOTS], t);
        atomic_store(&l->recv_seq, o->seq);
    } else {
        struct member *me = &seg->m[c->rank];
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
    if (!is_coll(o->kind)) {
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
    if (!is_coll(o->kind)) return member_alive(&seg->m[o->peer]) ? -1 : o->peer;
    for (int i = 0; i < c->nRanks; i++)
        if (i != c->rank && !member_alive(&seg->m[i])) return i;
    return -1;
}

/* Wait until every party of the posted `ops` arrived (each one's start_ns: its last arrival).
   -1 then; or, once a pending operation has a dead party, its index (after saying so). */
static int await_parties(struct op *ops, int n) {
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
        if (!pending) return -1;
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
                    return i;
                }
            }
            next_watch = now_ns() + WATCH_NS;
        }
        /* ops on several communicators ring several bells: poll them briefly instead */
        wait_bell(wait_on, seen, several ? 2000000ll : BELL_WAIT_NS);
    }
}

/* When the last transfer of `ops` (every party arrived) ends. */
static uint64_t transfer_end(const struct op *ops, int n) {
    uint64_t end = 0;
    for (int i = 0; i < n; i++) {
        uint64_t e = ops[i].start_ns + model_ns(&ops[i]);
        if (e > end) end = e;
    }
    return end;
}

/* ------------------------------------------------------------------------------ calls */

static ncclResult_t check_comm(const struct ncclComm *c) {
    return (c && c->magic == COMM_MAGIC) ? ncclSuccess : ncclInvalidArgument;
}

/* Inside ncclGroupStart/End: keep `o` for the outermost ncclGroupEnd. */
static ncclResult_t group_add(const struct op *o) {
    if (g_group_nops == MAX_GROUP_OPS) {
        g_group_error = ncclInvalidUsage;
        return ncclInvalidUsage;
    }
    g_group_ops[g_group_nops++] = *o;
    return ncclSuccess;
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

/* Blocks until all nranks members joined (as NCCL's bootstrap does), then removes the segment's
   name (every member has it mapped: a killed job leaves no segment behind) and lets the variant
   finish the communicator (comm_setup). */
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
    member_publish(me);
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
    shm_unlink(name); /* all members have it mapped: a killed job leaves no segment behind */

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
    if ((rc = comm_setup(c)) != ncclSuccess) {
        free(c);
        atomic_store(&me->state, 2);
        atomic_fetch_sub(&seg->refs, 1);
        ring_bell(seg);
        goto fail;
    }
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

/* ncclCommDestroy's common part: this member leaves the segment (the last member out removes
   it) and the handle becomes invalid. The variant frees the communicator. */
static void comm_leave(struct ncclComm *comm) {
    struct segment *seg = comm->seg;
    atomic_store(&seg->m[comm->rank].state, 2);
    ring_bell(seg);
    if (atomic_fetch_sub(&seg->refs, 1) == 1) shm_unlink(comm->shmName);
    munmap(seg, sizeof(struct segment));
    comm->magic = 0;
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

/* Only the outermost ncclGroupEnd runs (blocking) or enqueues (async) the group: every op is
   posted before any is waited for. */
API ncclResult_t ncclGroupEnd(void) {
    if (g_group_depth == 0) return ncclInvalidUsage;
    if (--g_group_depth > 0) return ncclSuccess;
    int n = g_group_nops;
    g_group_nops = 0;
    if (g_group_error != ncclSuccess) return g_group_error;
    return n ? launch(g_group_ops, n) : ncclSuccess;
}

#endif
