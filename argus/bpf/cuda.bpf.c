/* CUDA driver channel (libcuda.so.1).
 *
 * Kernel launches: a per-(tgid, epoch, CUfunction) counter at entry, and with
 * ARGUS_LAUNCH_LATENCY a log2 histogram of the launch call's host time at return; with
 * ARGUS_LAUNCH_WAIT the time of launches (and of event recordings and stream waits, which take a
 * slot of the same queue) that waited for a slot in a full launch queue.
 * Host-blocking syncs (stream, event, context, synchronous copies and memsets): a record per
 * call with enter/exit, and the epoch of the process advances at return.
 * cuEventElapsedTime (the milliseconds the caller got, and the two recordings it measured between)
 * is a record, so GPU timings the framework measures itself are harvested for free;
 * cuStreamWaitEvent and the first successful cuEventQuery of a recording are records too (when the
 * GPU got where). A recording itself is not (ev_marks): those three carry it.
 * Copies, allocations and frees: bytes per epoch. Every non-zero CUresult: counted per call.
 */

#include "helpers.h"
#include "marks.h"
#include "pyhooks.h"

#define CU_SUCCESS 0
#define LAUNCH_WAIT_MIN_NS 32768 /* a launch this long waited (normal ones: 2-10 us) */

/* This channel's aggregates, drained by user space only when the channel is on. */
BPF_HASH(launches, struct launch_key, u64, ARGUS_AGG_ENTRIES);
BPF_HASH(hists, struct hist_key, u64, ARGUS_AGG_ENTRIES);
BPF_HASH(mem, struct mem_key, struct mem_val, 4096);

static __always_inline u32 log2_u64(u64 v) {
    u32 r = 0;
#pragma unroll
    for (int i = 32; i > 0; i >>= 1) {
        if (v >= (1ULL << i)) {
            v >>= i;
            r += i;
        }
    }
    return r;
}

static __always_inline void hist_add(u32 tgid, u16 kind, u64 epoch, u64 value) {
    struct hist_key k = {.tgid = tgid, .kind = kind, .slot = (u16)log2_u64(value), .epoch = epoch};
    u64 zero = 0;
    agg_add(hists.lookup_or_try_init(&k, &zero), 1);
}

/* Bytes of a copy, allocation or free, for a process already found a target. */
static __always_inline int mem_add(u32 tgid, u32 kind, u64 bytes) {
    struct mem_key k = {.tgid = tgid, .kind = kind, .epoch = cur_epoch(tgid)};
    struct mem_val zero = {};
    agg_add_sum(mem.lookup_or_try_init(&k, &zero), bytes);
    return 0;
}

/* ---- kernel launches ---------------------------------------------------------------------- */

BPF_HASH(launch_enter, u32, u64, 16384); /* tid -> entry time */
#ifdef ARGUS_LAUNCH_WAIT
BPF_HASH(enqueue_enter, u32, u64, 16384); /* tid -> entry time of an event recording or stream wait */
#endif
#ifdef ARGUS_RECORD
struct launch_rec {
    u64 func;
    u64 stream;
};
BPF_HASH(launch_recs, u32, struct launch_rec, 16384); /* tid -> (function, stream), record mode */
#endif

static __always_inline int launch_enter_common(u32 call, u64 func, u64 stream) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct launch_key k = {.tgid = tgid, .epoch = cur_epoch(tgid), .func = func};
    u64 zero = 0;
    agg_add(launches.lookup_or_try_init(&k, &zero), 1);
    py_native_hit(call, func, PY_HIT_LAUNCH);
#if defined(ARGUS_LAUNCH_LATENCY) || defined(ARGUS_LAUNCH_WAIT) || defined(ARGUS_RECORD)
    u32 tid = cur_tid();
    u64 now = bpf_ktime_get_ns();
    launch_enter.update(&tid, &now);
#endif
#ifdef ARGUS_RECORD
    struct launch_rec lr = {.func = func, .stream = stream};
    launch_recs.update(&tid, &lr);
#endif
    return 0;
}

static __always_inline int launch_return_common(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, call, rc);
#if defined(ARGUS_LAUNCH_LATENCY) || defined(ARGUS_LAUNCH_WAIT) || defined(ARGUS_RECORD)
    u32 tid = cur_tid();
    u64 *t0 = launch_enter.lookup(&tid);
    /* the entry is consumed here: while a window's probes are being removed (one at a time, an
     * RCU grace period each) a return can fire for a call whose entry probe was already gone, and
     * must not be timed from the thread's previous launch */
    u64 enter = t0 ? *t0 : 0;
    if (!enter) return 0;
    *t0 = 0;
#endif
#if defined(ARGUS_LAUNCH_LATENCY) || defined(ARGUS_LAUNCH_WAIT)
    u64 dt = bpf_ktime_get_ns() - enter;
#ifdef ARGUS_LAUNCH_LATENCY
    hist_add(tgid, HIST_LAUNCH_NS, cur_epoch(tgid), dt);
#endif
#ifdef ARGUS_LAUNCH_WAIT
    /* a launch returns in microseconds unless its stream's launch queue was full: then it
     * waited for the GPU to free a slot, a wait for the GPU like a sync's */
    if (dt >= LAUNCH_WAIT_MIN_NS) mem_add(tgid, MEM_LAUNCH_WAIT, dt);
#endif
#endif
#ifdef ARGUS_RECORD
    struct launch_rec *lr = launch_recs.lookup(&tid);
    if (lr) record_call(call, enter, lr->func, lr->stream);
#endif
    return 0;
}

/* the stream of a launch, read only in record mode: cuLaunchKernel's 9th argument, or
 * CUlaunchConfig.hStream (after seven 32-bit dimensions and padding) */
static __always_inline u64 launch_stream(struct pt_regs *ctx, int ex) {
#ifdef ARGUS_RECORD
    if (!ex) return arg_n(ctx, 9);
    u64 s = 0;
    bpf_probe_read_user(&s, sizeof(s), (void *)(PT_REGS_PARM1(ctx) + 32));
    return s;
#else
    return 0;
#endif
}

int cuLaunchKernel_entry(struct pt_regs *ctx) {
    int rc = launch_enter_common(CALL_cuLaunchKernel, PT_REGS_PARM1(ctx), launch_stream(ctx, 0));
    py_tail(ctx);
    return rc;
}
int cuLaunchKernel_return(struct pt_regs *ctx) { return launch_return_common(ctx, CALL_cuLaunchKernel); }

/* cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, ...) */
int cuLaunchKernelEx_entry(struct pt_regs *ctx) {
    int rc = launch_enter_common(CALL_cuLaunchKernelEx, PT_REGS_PARM2(ctx), launch_stream(ctx, 1));
    py_tail(ctx);
    return rc;
}
int cuLaunchKernelEx_return(struct pt_regs *ctx) { return launch_return_common(ctx, CALL_cuLaunchKernelEx); }

/* cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream): the graph counts as one launch, keyed by
 * its handle (CUDA graphs replay many kernels for one host call) */
int cuGraphLaunch_entry(struct pt_regs *ctx) {
    int rc = launch_enter_common(CALL_cuGraphLaunch, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx));
    py_tail(ctx);
    return rc;
}
int cuGraphLaunch_return(struct pt_regs *ctx) { return launch_return_common(ctx, CALL_cuGraphLaunch); }

/* ---- host-blocking synchronisation ------------------------------------------------------------ */

/* (tgid, sync call, epoch it closed) -> the sync's record: drained like the sums (user space takes
 * it when the ring lost the record) */
BPF_HASH(epoch_syncs, struct call_key, struct rec_sync, 4096);

static __always_inline int sync_enter(u32 call, u64 handle, u32 bytes_kind, u64 bytes) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = handle;
    s.a[1] = bytes_kind;
    s.a[2] = bytes;
    s.a[3] = next_op(tgid); /* a sync's mark passes what was enqueued before it */
    save_scratch(CLASS_CUDA, &s);
    inflight_enter(CLASS_CUDA, call, s.enter_ns, handle, 0);
    py_native_hit(call, handle, PY_HIT_ALWAYS);
    return 0;
}

static __always_inline int sync_exit(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s;
    if (load_scratch(CLASS_CUDA, &s) != 0) return 0; /* entered before we attached */
    inflight_exit(CLASS_CUDA);
    s64 rc = (s32)PT_REGS_RC(ctx);
    u64 epoch = close_epoch(tgid);
    count_error(tgid, call, rc);
    if (s.a[1] != ~0u && rc == CU_SUCCESS) {
        /* the bytes count in the epoch this sync closes (mem_add would take the next one) */
        struct mem_key mk = {.tgid = tgid, .kind = (u32)s.a[1], .epoch = epoch};
        struct mem_val zero = {};
        agg_add_sum(mem.lookup_or_try_init(&mk, &zero), s.a[2]); /* a full map counts as a drop */
    }
    struct rec_sync v = {.enter_ns = s.enter_ns, .handle = s.a[0], .result = (s32)rc, .bytes_kind = (u32)s.a[1]};
    fill_hdr(&v.h, REC_SYNC, call, epoch);
    v.bytes = s.a[2];
    v.pos = s.a[3];
    /* the epoch's sync, kept where a full ring cannot lose it: steps are cut at syncs */
    struct call_key ck = {.tgid = tgid, .call = call, .epoch = epoch};
    if (epoch_syncs.update(&ck, &v) != 0) drop(DROP_AGG);
    struct rec_sync *r = ring_reserve(sizeof(v));
    if (r) {
        __builtin_memcpy(r, &v, sizeof(v));
        record_submit(r);
    }
    if (call == CALL_cuEventSynchronize && rc == CU_SUCCESS) mark_passed(tgid, s.a[0], call, 1);
    return 0;
}

#define SYNC_PROBE(name, handle, kind, bytes)                                                    \
    int name##_entry(struct pt_regs *ctx) {                                                      \
        int rc = sync_enter(CALL_##name, handle, kind, bytes);                                   \
        py_tail(ctx);                                                                            \
        return rc;                                                                               \
    }                                                                                            \
    int name##_return(struct pt_regs *ctx) { return sync_exit(ctx, CALL_##name); }

SYNC_PROBE(cuStreamSynchronize, PT_REGS_PARM1(ctx), ~0u, 0)
SYNC_PROBE(cuEventSynchronize, PT_REGS_PARM1(ctx), ~0u, 0)
SYNC_PROBE(cuCtxSynchronize, 0, ~0u, 0)
SYNC_PROBE(cuMemcpyHtoD_v2, 0, MEM_HTOD, PT_REGS_PARM3(ctx))
SYNC_PROBE(cuMemcpyDtoH_v2, 0, MEM_DTOH, PT_REGS_PARM3(ctx))
SYNC_PROBE(cuMemcpyDtoD_v2, 0, MEM_DTOD, PT_REGS_PARM3(ctx))
SYNC_PROBE(cuMemsetD8_v2, 0, MEM_SET, PT_REGS_PARM3(ctx))
SYNC_PROBE(cuMemsetD32_v2, 0, MEM_SET, PT_REGS_PARM3(ctx) * 4)

/* ---- asynchronous copies: bytes at entry, errors at return ------------------------------------ */

static __always_inline int result_only(struct pt_regs *ctx, u32 call) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    count_error(tgid, call, (s32)PT_REGS_RC(ctx));
    record_call(call, 0, 0, 0);
    return 0;
}

static __always_inline int copy_enter(u32 call, u32 kind, u64 bytes, u64 stream) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    record_call(call, 0, bytes, stream);
    return mem_add(tgid, kind, bytes);
}

#define RESULT_PROBE(name) \
    int name##_return(struct pt_regs *ctx) { return result_only(ctx, CALL_##name); }

/* An event recording or a stream wait takes a slot of the stream's launch queue as a launch does:
 * with the queue full it blocks as long (measured on the simulator's launch-bound job: 40% of the
 * time its host blocked was in these). Their probes are always on; timing them costs a map update. */
static __always_inline void enqueue_enter_mark(void) {
#ifdef ARGUS_LAUNCH_WAIT
    u32 tid = cur_tid();
    u64 now = bpf_ktime_get_ns();
    enqueue_enter.update(&tid, &now);
#endif
}

static __always_inline int enqueue_return(struct pt_regs *ctx, u32 call) {
#ifdef ARGUS_LAUNCH_WAIT
    u32 tid = cur_tid();
    u64 *t0 = enqueue_enter.lookup(&tid);
    u64 enter = t0 ? *t0 : 0;
    if (enter) {
        *t0 = 0;
        u64 dt = bpf_ktime_get_ns() - enter;
        u32 tgid;
        if (dt >= LAUNCH_WAIT_MIN_NS && target(&tgid)) mem_add(tgid, MEM_LAUNCH_WAIT, dt);
    }
#endif
    return result_only(ctx, call);
}
#define COPY_PROBE(name, kind, bytes)                                                                  \
    int name##_entry(struct pt_regs *ctx) { return copy_enter(CALL_##name, kind, bytes, PT_REGS_PARM4(ctx)); } \
    RESULT_PROBE(name)

COPY_PROBE(cuMemcpyHtoDAsync_v2, MEM_HTOD, PT_REGS_PARM3(ctx))
COPY_PROBE(cuMemcpyDtoHAsync_v2, MEM_DTOH, PT_REGS_PARM3(ctx))
COPY_PROBE(cuMemcpyDtoDAsync_v2, MEM_DTOD, PT_REGS_PARM3(ctx))
COPY_PROBE(cuMemsetD8Async, MEM_SET, PT_REGS_PARM3(ctx))

RESULT_PROBE(cuInit)
RESULT_PROBE(cuCtxSetCurrent)
RESULT_PROBE(cuModuleLoadData)
RESULT_PROBE(cuStreamCreate)
RESULT_PROBE(cuStreamQuery)
RESULT_PROBE(cuEventCreate)

/* ---- allocations: sizes remembered by pointer so frees count bytes ----------------------------- */

struct alloc_key {
    u32 tgid;
    u32 pad;
    u64 ptr;
};
BPF_HASH(allocs, struct alloc_key, u64, ARGUS_AGG_ENTRIES);

int cuMemAlloc_v2_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM1(ctx);
    s.a[1] = PT_REGS_PARM2(ctx);
    save_scratch(CLASS_CUDA, &s);
    return 0;
}

int cuMemAlloc_v2_return(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s;
    if (load_scratch(CLASS_CUDA, &s) != 0) return 0;
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, CALL_cuMemAlloc_v2, rc);
    if (rc != CU_SUCCESS) return 0;
    struct alloc_key k = {.tgid = tgid};
    bpf_probe_read_user(&k.ptr, sizeof(k.ptr), (void *)s.a[0]);
    u64 size = s.a[1];
    allocs.update(&k, &size);
    return mem_add(tgid, MEM_ALLOC, size);
}

int cuMemFree_v2_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct alloc_key k = {.tgid = tgid, .ptr = PT_REGS_PARM1(ctx)};
    u64 *size = allocs.lookup(&k);
    if (!size) return mem_add(tgid, MEM_FREE_UNKNOWN, 0); /* allocated before we attached */
    u64 bytes = *size;
    allocs.delete(&k);
    return mem_add(tgid, MEM_FREE, bytes);
}
RESULT_PROBE(cuMemFree_v2)

/* ---- events: which stream an event marks, and the timings the framework reads -------------------
 * No record per recording (hundreds a step at PyTorch's rates: its caching allocator, its watchdog,
 * an event before and after every collective): the recording is kept in ev_marks and told with
 * what refers to it -- its completion, a stream waiting for it, a timing read of it. */

int cuEventRecord_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    enqueue_enter_mark();
    u64 epoch = cur_epoch(tgid), pos = next_op(tgid);
    mark_record(tgid, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), pos, epoch);
    count_call(tgid, CALL_cuEventRecord, epoch);
#ifdef ARGUS_RECORD
    struct rec_event_record *r = RECORD(rec_event_record, REC_EVENT_RECORD, CALL_cuEventRecord, epoch);
    if (r) {
        r->event = PT_REGS_PARM1(ctx);
        r->stream = PT_REGS_PARM2(ctx);
        r->pos = pos;
        record_submit(r);
    }
#endif
    py_native_hit(CALL_cuEventRecord, PT_REGS_PARM1(ctx), PY_HIT_EVENT); /* no walk: see PY_HIT_EVENT */
    return 0;
}
int cuEventRecord_return(struct pt_regs *ctx) { return enqueue_return(ctx, CALL_cuEventRecord); }

/* ---- what the GPU passed, from calls the framework makes anyway --------------------------------
 * cuStreamWaitEvent(stream, event) ties a stream's next work to an event of another stream (what
 * PyTorch records before every collective); cuEventQuery's first success after a failure bounds
 * when the GPU passed the event: after the failed query's entry, before the success's return.
 * Only that transition becomes a record (one per recording at most), not every poll. */

int cuStreamWaitEvent_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    enqueue_enter_mark();
    struct rec_stream_wait w = {.stream = PT_REGS_PARM1(ctx), .event = PT_REGS_PARM2(ctx), .pos = next_op(tgid)};
    fill_hdr(&w.h, REC_STREAM_WAIT, CALL_cuStreamWaitEvent, cur_epoch(tgid));
    struct ev_key k = {.tgid = tgid, .event = w.event};
    struct ev_mark *m = ev_marks.lookup(&k);
    if (m) {
        w.mark_stream = m->stream;
        w.mark_pos = m->pos;
        w.mark_ns = m->ts;
    }
    if (mark_hold_wait(tgid, &w)) return 0; /* told with the stream's next collective, if recorded */
    struct rec_stream_wait *r = ring_reserve(sizeof(w));
    if (!r) return 0;
    __builtin_memcpy(r, &w, sizeof(w));
    record_submit(r);
    return 0;
}
int cuStreamWaitEvent_return(struct pt_regs *ctx) { return enqueue_return(ctx, CALL_cuStreamWaitEvent); }

#define CUDA_ERROR_NOT_READY 600

int cuEventQuery_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM1(ctx);
    save_scratch(CLASS_CUDA, &s);
    return 0;
}

int cuEventQuery_return(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, CALL_cuEventQuery, rc);
    record_call(CALL_cuEventQuery, 0, 0, 0);
    struct scratch s;
    if (load_scratch(CLASS_CUDA, &s) != 0) return 0;
    if (rc == CUDA_ERROR_NOT_READY) {
        struct ev_key k = {.tgid = tgid, .event = s.a[0]};
        struct ev_mark *m = ev_marks.lookup(&k);
        if (m && !m->done) m->not_ready = s.enter_ns;
        return 0;
    }
    if (rc == CU_SUCCESS) mark_passed(tgid, s.a[0], CALL_cuEventQuery, 0);
    return 0;
}

/* cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) */
int cuEventElapsedTime_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM1(ctx);
    s.a[1] = PT_REGS_PARM2(ctx);
    s.a[2] = PT_REGS_PARM3(ctx);
    save_scratch(CLASS_CUDA, &s);
    return 0;
}

int cuEventElapsedTime_return(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s;
    if (load_scratch(CLASS_CUDA, &s) != 0) return 0;
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, CALL_cuEventElapsedTime, rc);
    struct rec_elapsed *r = RECORD(rec_elapsed, REC_ELAPSED, CALL_cuEventElapsedTime, cur_epoch(tgid));
    if (!r) return 0;
    r->start_ev = s.a[1];
    r->end_ev = s.a[2];
    r->result = (s32)rc;
    r->ms_bits = 0;
    if (rc == CU_SUCCESS) bpf_probe_read_user(&r->ms_bits, sizeof(r->ms_bits), (void *)s.a[0]);
    /* the recordings it measured between, as they are now (a timer is read after they completed) */
    struct ev_key ks = {.tgid = tgid, .event = s.a[1]}, ke = {.tgid = tgid, .event = s.a[2]};
    struct ev_mark *ms = ev_marks.lookup(&ks);
    r->start_stream = ms ? ms->stream : 0;
    r->start_pos = ms ? ms->pos : 0;
    r->start_ns = ms ? ms->ts : 0;
    struct ev_mark *me = ev_marks.lookup(&ke);
    r->end_stream = me ? me->stream : 0;
    r->end_pos = me ? me->pos : 0;
    r->end_ns = me ? me->ts : 0;
    r->end_epoch = me ? me->epoch : r->h.epoch;
    record_submit(r);
    return 0;
}

/* ---- kernel names: cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) ------ */

int cuModuleGetFunction_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s = {.enter_ns = bpf_ktime_get_ns()};
    s.a[0] = PT_REGS_PARM1(ctx);
    s.a[1] = PT_REGS_PARM3(ctx);
    save_scratch(CLASS_CUDA, &s);
    return 0;
}

int cuModuleGetFunction_return(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    struct scratch s;
    if (load_scratch(CLASS_CUDA, &s) != 0) return 0;
    s64 rc = (s32)PT_REGS_RC(ctx);
    count_error(tgid, CALL_cuModuleGetFunction, rc);
    struct rec_func_name *r = RECORD(rec_func_name, REC_FUNC_NAME, CALL_cuModuleGetFunction, cur_epoch(tgid));
    if (!r) return 0;
    r->result = (s32)rc;
    r->pad = 0;
    r->func = 0;
    if (rc == CU_SUCCESS) bpf_probe_read_user(&r->func, sizeof(r->func), (void *)s.a[0]);
    bpf_probe_read_user_str(r->name, sizeof(r->name), (void *)s.a[1]);
    record_submit(r);
    return 0;
}
