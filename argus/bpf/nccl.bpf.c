/* NCCL channel (libnccl.so.2, wherever the process mapped it).
 *
 * Every collective and point-to-point call becomes one record at return: op, count, datatype,
 * reduction, root/peer, communicator, stream, host enter and exit, result, and a sequence number
 * per communicator. The arrival (host enter) of each rank at collective n of a communicator is
 * what names the rank everyone waits for; enter->exit is the host call (an enqueue under normal
 * NCCL, the whole operation under blocking settings) and is never presented as collective time.
 *
 * The sequence number is counted here, per communicator handle, from the first call seen: no NCCL
 * field counts collectives one by one (opCount/collOpCount move per kernel plan, not per call), so
 * ranks attached at different times number differently and the aggregator aligns them (by step
 * time and order within the step). Communicator creation is recorded with the 128-byte unique id,
 * the new handle and, where the layout of this build is known, commHash/rank/nRanks read from it.
 */

#include "helpers.h"
#include "marks.h"
#include "pyhooks.h"

struct seq_key {
    u64 comm;
    s32 peer;
    u32 dir; /* 0 collective, 1 send, 2 recv */
};
BPF_HASH(comm_seq, struct seq_key, u64, 16384);
BPF_HASH(group_depth, u32, s32, 16384);
BPF_HASH(colls, struct coll_key, struct coll_val, 16384);
BPF_HASH(coll_sample, struct sample_key, struct sample_val, 4096);

struct uid_buf {
    u8 b[128];
};
BPF_HASH(init_uid, u64, struct uid_buf, 1024);

static __always_inline int nccl_enter(u32 call, u64 comm, u64 count, u64 dtype, u64 redop, s64 peer, u64 stream,
                                      u32 dir) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    u64 seq = 0;
    u32 flags = 0;
    struct seq_key k = {.comm = comm, .peer = dir ? (s32)peer : -1, .dir = dir};
    u64 zero = 0, *v = comm_seq.lookup_or_try_init(&k, &zero);
    if (v) seq = __sync_fetch_and_add(v, 1);
    u32 tid = cur_tid();
    s32 *depth = group_depth.lookup(&tid);
    if (depth && *depth > 0) flags |= NCCL_F_IN_GROUP;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = comm;
    s.a[1] = seq;
    s.a[2] = count;
    s.a[3] = stream;
    s.a[4] = (dtype & 0xff) | ((redop & 0xff) << 8) | ((u64)(flags & 0xffff) << 16) | ((u64)(u32)peer << 32);
    s.a[5] = next_op(tgid);
    save_scratch(CLASS_NCCL, &s);
    inflight_enter(CLASS_NCCL, call, s.enter_ns, comm, seq);
    py_native_hit(call, comm, PY_HIT_COLL);
    return 0;
}

/* The operation in the (process, epoch, communicator, call, datatype) sums. One thread issues a
 * communicator's operations (NCCL requires it), so the first/last fields need no atomics. */
static __always_inline void count_coll(u32 tgid, u32 call, u64 epoch, struct scratch *s, u64 now) {
    struct coll_key k = {.tgid = tgid, .call = call, .epoch = epoch, .comm = s->a[0], .dtype = s->a[4] & 0xff};
    struct coll_val zero = {.first_seq = s->a[1], .first_enter = s->enter_ns};
    struct coll_val *v = colls.lookup_or_try_init(&k, &zero);
    if (!v) {
        drop(DROP_AGG);
        return;
    }
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->elems, s->a[2]);
    __sync_fetch_and_add(&v->host_ns, now - s->enter_ns);
    v->last_exit = now;
}

static __always_inline int nccl_exit(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s;
    if (load_scratch(CLASS_NCCL, &s) != 0) return 0;
    inflight_exit(CLASS_NCCL);
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, call, rc);
    u64 epoch = cur_epoch(tgid), now = bpf_ktime_get_ns();
    u32 flags = (u32)((s.a[4] >> 16) & 0xffff);
    u32 skipped = 0;
    u64 skip_pos = 0;
    if (call != CALL_ncclGroupEnd) {
        count_coll(tgid, call, epoch, &s, now);
        /* At tensor-parallel rates (thousands of collectives a step) a record per collective costs
         * the agent more than everything else together: past the agent's limit per step, only every
         * stride-th collective of a communicator is recorded, the same ones on every rank (the
         * phase puts the first of each step among them). Point-to-point and grouped operations
         * are always recorded. */
        struct sample_key sk = {.tgid = tgid, .comm = s.a[0]};
        struct sample_val *sv = (call == CALL_ncclSend || call == CALL_ncclRecv || (flags & NCCL_F_IN_GROUP))
                                    ? 0
                                    : coll_sample.lookup(&sk);
        if (sv && sv->stride > 1) {
            sv->last_seq = s.a[1];
            if ((s.a[1] - sv->phase) % sv->stride) {
                sv->skipped += 1;
                sv->skip_pos = s.a[5];
                mark_sampled_out(tgid);
                mark_waits_before(tgid, s.a[3], 0);
                return 0;
            }
            skipped = (u32)sv->skipped;
            skip_pos = sv->skip_pos;
            sv->skipped = 0;
        }
    }
    if (call != CALL_ncclGroupEnd) {
        mark_waits_before(tgid, s.a[3], 1);
        mark_near_recorded(tgid, s.a[5]);
    }
    struct rec_nccl *r = RECORD(rec_nccl, REC_NCCL, call, epoch);
    if (!r) return 0;
    r->comm = s.a[0];
    r->seq = s.a[1];
    r->count = s.a[2];
    r->stream = s.a[3];
    r->enter_ns = s.enter_ns;
    r->dtype = s.a[4] & 0xff;
    r->redop = (s.a[4] >> 8) & 0xff;
    r->flags = flags;
    r->peer = (s32)(s.a[4] >> 32);
    r->result = (s32)rc;
    r->skipped = skipped;
    r->pos = s.a[5];
    r->skip_pos = skip_pos;
    record_submit(r);
    return 0;
}

#define NCCL_PROBE(name, count, dtype, redop, peer, comm, stream, dir)                               \
    int name##_entry(struct pt_regs *ctx) {                                                          \
        int rc = nccl_enter(CALL_##name, comm, count, dtype, redop, peer, stream, dir);              \
        py_tail(ctx);                                                                                \
        return rc;                                                                                   \
    }                                                                                                \
    int name##_return(struct pt_regs *ctx) { return nccl_exit(ctx, CALL_##name); }

/* ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream) */
NCCL_PROBE(ncclAllReduce, arg_n(ctx, 3), arg_n(ctx, 4), arg_n(ctx, 5), -1, arg_n(ctx, 6), arg_n(ctx, 7), 0)
/* ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream) */
NCCL_PROBE(ncclBroadcast, arg_n(ctx, 3), arg_n(ctx, 4), 0xff, (s32)arg_n(ctx, 5), arg_n(ctx, 6), arg_n(ctx, 7), 0)
/* ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream) */
NCCL_PROBE(ncclReduce, arg_n(ctx, 3), arg_n(ctx, 4), arg_n(ctx, 5), (s32)arg_n(ctx, 6), arg_n(ctx, 7),
           arg_n(ctx, 8), 0)
/* ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream) */
NCCL_PROBE(ncclAllGather, arg_n(ctx, 3), arg_n(ctx, 4), 0xff, -1, arg_n(ctx, 5), arg_n(ctx, 6), 0)
/* ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream) */
NCCL_PROBE(ncclReduceScatter, arg_n(ctx, 3), arg_n(ctx, 4), arg_n(ctx, 5), -1, arg_n(ctx, 6), arg_n(ctx, 7), 0)
/* ncclSend(sendbuff, count, datatype, peer, comm, stream) */
NCCL_PROBE(ncclSend, arg_n(ctx, 2), arg_n(ctx, 3), 0xff, (s32)arg_n(ctx, 4), arg_n(ctx, 5), arg_n(ctx, 6), 1)
/* ncclRecv(recvbuff, count, datatype, peer, comm, stream) */
NCCL_PROBE(ncclRecv, arg_n(ctx, 2), arg_n(ctx, 3), 0xff, (s32)arg_n(ctx, 4), arg_n(ctx, 5), arg_n(ctx, 6), 2)

/* ---- groups ------------------------------------------------------------------------------------ */

static __always_inline int group_step(u32 call, s32 delta) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    u32 tid = cur_tid();
    s32 zero = 0, *d = group_depth.lookup_or_try_init(&tid, &zero);
    if (d) {
        s32 v = *d + delta;
        *d = v < 0 ? 0 : v;
    }
    count_call(tgid, call, cur_epoch(tgid));
    return 0;
}

int ncclGroupStart_entry(struct pt_regs *ctx) { return group_step(CALL_ncclGroupStart, 1); }

/* A group's calls only post their operations; ncclGroupEnd runs them, and where operations block
 * (a full launch queue, blocking settings, a vendor build) it is where the host waits for the
 * peers. So ncclGroupEnd is a record too (no communicator; IN_GROUP when an inner one), and the
 * agent counts its time as the wait of the group's last operation. */
int ncclGroupEnd_entry(struct pt_regs *ctx) {
    group_step(CALL_ncclGroupEnd, -1);
    u32 tgid;
    if (!target(&tgid)) return 0;
    u32 tid = cur_tid();
    s32 *depth = group_depth.lookup(&tid);
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[4] = 0xff | ((u64)(depth && *depth > 0 ? NCCL_F_IN_GROUP : 0) << 16) | ((u64)(u32)-1 << 32);
    s.a[5] = 0; /* not a stream operation: its group's operations were counted at their calls */
    save_scratch(CLASS_NCCL, &s);
    return 0;
}
int ncclGroupEnd_return(struct pt_regs *ctx) { return nccl_exit(ctx, CALL_ncclGroupEnd); }

/* ---- communicator creation ----------------------------------------------------------------------- */

/* ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank): the 128-byte id is
 * passed by value in memory (on the stack, at sp + 8 on entry), so `rank` is the third register. */
static __always_inline int init_enter(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM1(ctx);
    s.a[1] = PT_REGS_PARM2(ctx);
    s.a[2] = PT_REGS_PARM3(ctx);
    s.a[3] = 0;         /* parent */
    s.a[4] = ~0ULL;     /* color, key */
    s.a[5] = 1;         /* has uid */
    save_scratch(CLASS_NCCL, &s);
    struct uid_buf u = {};
    bpf_probe_read_user(&u, sizeof(u), (void *)(PT_REGS_SP(ctx) + 8));
    u64 k = scratch_key(CLASS_NCCL);
    init_uid.update(&k, &u);
    inflight_enter(CLASS_NCCL, call, s.enter_ns, 0, 0);
    return 0;
}

/* ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) */
int ncclCommSplit_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM4(ctx);
    s.a[1] = 0;
    s.a[2] = ~0ULL;
    s.a[3] = PT_REGS_PARM1(ctx);
    s.a[4] = ((u64)(u32)PT_REGS_PARM2(ctx)) | ((u64)(u32)PT_REGS_PARM3(ctx) << 32);
    s.a[5] = 0;
    save_scratch(CLASS_NCCL, &s);
    inflight_enter(CLASS_NCCL, CALL_ncclCommSplit, s.enter_ns, s.a[3], 0);
    return 0;
}

static __always_inline int init_exit(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    struct target_cfg *cfg = target(&tgid);
    if (!cfg) return 0;
    struct scratch s;
    if (load_scratch(CLASS_NCCL, &s) != 0) return 0;
    inflight_exit(CLASS_NCCL);
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, call, rc);
    struct rec_comm_init *r = RECORD(rec_comm_init, REC_COMM_INIT, call, cur_epoch(tgid));
    if (!r) return 0;
    u64 comm = 0;
    if (rc == 0) bpf_probe_read_user(&comm, sizeof(comm), (void *)s.a[0]);
    r->comm = comm;
    r->parent = s.a[3];
    r->nranks = (s32)s.a[1];
    r->rank = (s32)s.a[2];
    r->color = (s32)(u32)s.a[4];
    r->key = (s32)(u32)(s.a[4] >> 32);
    r->result = (s32)rc;
    r->comm_hash = 0;
    r->comm_rank = -1;
    r->comm_nranks = -1;
    /* offsets come from a validated table row (hash, rank, nRanks) or the decoded accessors (rank,
     * nRanks): argus/probes/nccl_layout.py */
    if (comm && cfg->off_comm_hash != OFF_UNKNOWN)
        bpf_probe_read_user(&r->comm_hash, sizeof(r->comm_hash), (void *)(comm + cfg->off_comm_hash));
    if (comm && cfg->off_comm_rank != OFF_UNKNOWN && cfg->off_comm_nranks != OFF_UNKNOWN) {
        bpf_probe_read_user(&r->comm_rank, sizeof(r->comm_rank), (void *)(comm + cfg->off_comm_rank));
        bpf_probe_read_user(&r->comm_nranks, sizeof(r->comm_nranks), (void *)(comm + cfg->off_comm_nranks));
    }
    r->has_uid = 0;
    u64 k = scratch_key(CLASS_NCCL);
    struct uid_buf *u = init_uid.lookup(&k);
    if (s.a[5] && u) {
        __builtin_memcpy(r->uid, u->b, sizeof(r->uid));
        r->has_uid = 1;
        init_uid.delete(&k);
    } else {
        __builtin_memset(r->uid, 0, sizeof(r->uid));
    }
    record_submit(r);
    return 0;
}

int ncclCommInitRank_entry(struct pt_regs *ctx) { return init_enter(ctx, CALL_ncclCommInitRank); }
int ncclCommInitRank_return(struct pt_regs *ctx) { return init_exit(ctx, CALL_ncclCommInitRank); }
int ncclCommInitRankConfig_entry(struct pt_regs *ctx) { return init_enter(ctx, CALL_ncclCommInitRankConfig); }
int ncclCommInitRankConfig_return(struct pt_regs *ctx) { return init_exit(ctx, CALL_ncclCommInitRankConfig); }
int ncclCommSplit_return(struct pt_regs *ctx) { return init_exit(ctx, CALL_ncclCommSplit); }

/* ---- a few calls whose results matter (version probing, unique ids, teardown) ---------------------- */

static __always_inline int nccl_result(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    count_call(tgid, call, cur_epoch(tgid));
    count_error(tgid, call, (s32)PT_REGS_RC(ctx));
    return 0;
}

#define NCCL_RESULT_PROBE(name) \
    int name##_return(struct pt_regs *ctx) { return nccl_result(ctx, CALL_##name); }

NCCL_RESULT_PROBE(ncclGetVersion)
NCCL_RESULT_PROBE(ncclGetUniqueId)
NCCL_RESULT_PROBE(ncclCommDestroy)
NCCL_RESULT_PROBE(ncclCommAbort)

/* ---- the network proxy: when this rank's GPU had data to send ---------------------------------
 * NCCL's proxy thread posts a network send only once the rank's kernel produced the data, so the
 * first send after the previous step's end bounds when this rank's GPU reached its first network
 * collective (docs/diagnosis.md). The transports are local symbols (.symtab), called through
 * function pointers; sends are many per collective, so only the first of each epoch is a record,
 * with the process's send before it. */

struct net_state {
    u64 epoch1; /* epoch + 1 of the last send (0: none yet) */
    u64 last_ns;
};
BPF_HASH(net_sends, u32, struct net_state, 4096);

static __always_inline int net_send(u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    u64 now = bpf_ktime_get_ns(), epoch = cur_epoch(tgid);
    struct net_state *st = net_sends.lookup(&tgid);
    if (st && st->epoch1 == epoch + 1) {
        st->last_ns = now;
        return 0;
    }
    struct net_state next = {.epoch1 = epoch + 1, .last_ns = now};
    u64 prev = st ? st->last_ns : 0;
    net_sends.update(&tgid, &next);
    struct rec_net_send *r = RECORD(rec_net_send, REC_NET_SEND, call, epoch);
    if (!r) return 0;
    r->h.ts = now;
    r->prev_ns = prev;
    r->pad = 0;
    record_submit(r);
    return 0;
}

int ncclNetSocketIsend_entry(struct pt_regs *ctx) { return net_send(CALL_ncclNetSocketIsend); }
int ncclIbIsend_entry(struct pt_regs *ctx) { return net_send(CALL_ncclIbIsend); }
