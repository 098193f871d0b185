/* Shared by every Argus BPF channel: knobs, record layouts, the maps every channel uses, and the
 * accessors of the process, thread and epoch a probe runs in.
 *
 * Design: high-rate events (kernel launches, memcpy, errors) are aggregated in hash maps keyed
 * by (tgid, epoch, ...). An epoch ends whenever a host-blocking synchronisation returns; user
 * space cuts steps at a subset of those syncs, so per-step sums are exact without shipping
 * events. Low-rate events (syncs, collectives, communicator creation, event timings, kernel
 * names) go through one ring buffer, never woken per event.
 *
 * Every struct here has a Python mirror in argus/probes/records.py; a test checks the layouts.
 * CALL_* ids come from the Python probe table as -D flags (one source for call names).
 * A channel's own maps live in its file (cuda.bpf.c: launches, hists, mem) or in the header of
 * what it shares (pystack.h, hoststack.h); the patterns probes repeat are in helpers.h.
 */
#ifndef ARGUS_H
#define ARGUS_H

#include <uapi/linux/ptrace.h>

#ifndef ARGUS_RINGBUF_PAGES
#define ARGUS_RINGBUF_PAGES 256
#endif
#ifndef ARGUS_MAX_TARGETS
#define ARGUS_MAX_TARGETS 1024
#endif
#ifndef ARGUS_AGG_ENTRIES
#define ARGUS_AGG_ENTRIES 65536
#endif

#include "records.h"

BPF_HASH(targets, u32, struct target_cfg, ARGUS_MAX_TARGETS);
BPF_HASH(epochs, u32, u64, ARGUS_MAX_TARGETS);
BPF_HASH(errors, struct err_key, u64, 4096);
BPF_HASH(call_counts, struct call_key, u64, 4096);
/* One entry per (thread, class), written in place at every call and marked consumed (enter_ns 0)
 * at its return: a hash update allocates an element and a delete frees one, most of what a
 * probe pair cost in BPF. LRU, so threads that exited make room instead of filling the map. */
BPF_TABLE("lru_hash", u64, struct inflight, inflight_calls, 16384);
BPF_TABLE("lru_hash", u64, struct scratch, scratches, 16384);
BPF_ARRAY(drops, u64, DROP_SLOTS);
struct drop_key {
    u32 tgid;
    u32 slot;
};
BPF_HASH(drops_by_pid, struct drop_key, u64, 4096); /* the same, per process: its summaries say it */
BPF_RINGBUF_OUTPUT(records, ARGUS_RINGBUF_PAGES);
/* Per process: how many stream operations it enqueued (event recordings, stream waits, collectives,
 * syncs). Each carries its count, so user space knows their order on a stream from the few it is
 * told of (argus/agent/gpuarrive.py) without a record per recording. */
BPF_HASH(stream_ops, u32, u64, ARGUS_MAX_TARGETS);

static __always_inline u32 cur_tgid(void) { return bpf_get_current_pid_tgid() >> 32; }
static __always_inline u32 cur_tid(void) { return (u32)bpf_get_current_pid_tgid(); }

static __always_inline u64 cur_epoch(u32 tgid) {
    u64 *e = epochs.lookup(&tgid);
    return e ? *e : 0;
}

/* A host sync (or the step marker) returned: the process's epoch ends. Returns the epoch closed,
 * which the sync's record carries. */
static __always_inline u64 close_epoch(u32 tgid) {
    u64 epoch = 0, *e = epochs.lookup(&tgid);
    if (e) epoch = __sync_fetch_and_add(e, 1);
    return epoch;
}

/* The next stream operation's place in its process (1, 2, ...; 0 when the map is full). */
static __always_inline u64 next_op(u32 tgid) {
    u64 zero = 0, *v = stream_ops.lookup_or_try_init(&tgid, &zero);
    return v ? __sync_fetch_and_add(v, 1) + 1 : 0;
}

static __always_inline void drop(u32 slot) {
    u64 *d = drops.lookup(&slot);
    if (d) __sync_fetch_and_add(d, 1);
    struct drop_key k = {.tgid = cur_tgid(), .slot = slot};
    u64 zero = 0, *p = drops_by_pid.lookup_or_try_init(&k, &zero);
    if (p) __sync_fetch_and_add(p, 1);
}

static __always_inline u64 scratch_key(u32 cls) { return ((u64)cur_tid() << 1) | cls; }

/* The n-th integer argument, 1-based, System V x86-64: six in registers, then the stack. At a
 * function's entry (or past instructions that leave rsp alone) the stack holds the return address
 * at sp, so argument 7 is at sp + 8. */
static __always_inline u64 arg_n(struct pt_regs *ctx, int n) {
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    case 6: return PT_REGS_PARM6(ctx);
    }
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}

static __always_inline void fill_hdr(struct rec_hdr *h, u32 kind, u32 call, u64 epoch) {
    u64 id = bpf_get_current_pid_tgid();
    h->kind = kind;
    h->tgid = id >> 32;
    h->tid = (u32)id;
    h->call = call;
    h->ts = bpf_ktime_get_ns();
    h->epoch = epoch;
}

static __always_inline void save_scratch(u32 cls, struct scratch *s) {
    u64 k = scratch_key(cls);
    struct scratch *cur = scratches.lookup(&k);
    if (cur) {
        __builtin_memcpy(cur, s, sizeof(*s));
        return;
    }
    if (scratches.update(&k, s) != 0) drop(DROP_SCRATCH);
}

/* 0 and the call's arguments, or -1 when its entry was not seen (entered before we attached). */
static __always_inline int load_scratch(u32 cls, struct scratch *out) {
    u64 k = scratch_key(cls);
    struct scratch *s = scratches.lookup(&k);
    if (!s || !s->enter_ns) return -1;
    __builtin_memcpy(out, s, sizeof(*out));
    s->enter_ns = 0;
    return 0;
}

/* enter_ns is written last and cleared first: user space, reading concurrently, skips an entry
 * whose enter_ns is 0 (argus/agent/session.py `inflight`). */
static __always_inline void inflight_enter(u32 cls, u32 call, u64 enter_ns, u64 handle, u64 seq) {
    u64 k = scratch_key(cls);
    struct inflight *cur = inflight_calls.lookup(&k);
    if (cur) {
        cur->tgid = cur_tgid();
        cur->call = call;
        cur->handle = handle;
        cur->seq = seq;
        asm volatile("" ::: "memory"); /* stores stay in order on x86 (TSO) once emitted in order */
        cur->enter_ns = enter_ns;
        return;
    }
    struct inflight f = {.tgid = cur_tgid(), .call = call, .enter_ns = enter_ns, .handle = handle, .seq = seq};
    inflight_calls.update(&k, &f);
}

static __always_inline void inflight_exit(u32 cls) {
    u64 k = scratch_key(cls);
    struct inflight *cur = inflight_calls.lookup(&k);
    if (cur) cur->enter_ns = 0;
}

#endif
