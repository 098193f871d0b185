/* Python channel (CPython 3.9-3.13): which Python code a rank is running, without touching it.
 *
 * Python USDT function probes never fire on 3.11+ and a uprobe on the eval loop misses
 * Python->Python calls, so the always-on path is sampling plus walking: a perf-event program
 * (software CPU_CLOCK, ARGUS_PY_PERIOD_NS) reads the sampled thread's frame chain with
 * per-version offsets from the `py_targets` config map, stores the stack of code-object
 * addresses once (`py_stacks`, keyed by a hash of the addresses) and counts (thread, epoch,
 * stack) in `py_prof`. User space resolves code objects to qualnames by reading the process.
 *
 * The thread state of a thread comes from `py_threads` (tid -> PyThreadState*), which user space
 * fills from the interpreter's thread list; this works for every version, for threads that
 * released the GIL, and for 3.12+ where the current thread state is thread-local. Unknown tids
 * that were sampled are reported in `py_unknown` so user space refreshes the list.
 *
 * The same walk runs at native CUDA/NCCL probe hits (py_native_hit): always for host syncs, for
 * every ARGUS_PY_COLL_EVERY-th collective and every ARGUS_PY_LAUNCH_EVERY-th launch of a thread
 * (weighted by the calls it stands for), and for the first launch after an event record. Each
 * walk is a small record (REC_PY_MARK), so launches, syncs and collectives are attributed to the
 * Python phase that issued them and the framework's own CUDA-event timers to the phase between
 * their events. Walks cost ~2 us each (docs/benchmarks.md): these rates keep them to a few dozen
 * per step.
 *
 * The walker and its maps are in pystack.h (offcpu.bpf.c walks with it too, at sched_switch).
 * GC pauses come from the interpreter's gc__start/gc__done USDT probes when it has them; the
 * opt-in precise mode times selected functions with a uprobe pair on _PyEval_EvalFrameDefault.
 */

#include "helpers.h"
#include "pyhooks.h"
#include "pystack.h"

#ifndef ARGUS_PY_PERIOD_NS
#define ARGUS_PY_PERIOD_NS 20408163 /* 49 Hz */
#endif
#ifndef ARGUS_PY_LAUNCH_EVERY
#define ARGUS_PY_LAUNCH_EVERY 16
#endif
#ifndef ARGUS_PY_COLL_EVERY
#define ARGUS_PY_COLL_EVERY 4
#endif
/* At tensor-parallel rates (thousands of launches and collectives a step, issued in bursts) the
 * counts alone made ~1,450 walks a rank-step, each a record the agent decodes. A thread's launch and
 * collective walks are at least this far apart: a call that would be walked sooner is counted, in
 * BPF, to the stack of the thread's last walk (within the same epoch, so never to another step). */
#ifndef ARGUS_PY_HIT_GAP_NS
#define ARGUS_PY_HIT_GAP_NS 2000000
#endif

struct py_hit_state {
    u32 countdown;      /* launches until the next walk */
    u32 force;          /* walk at the next launch (an event record was just made) */
    u32 coll_countdown; /* collectives until the next walk */
    u32 events;         /* event recordings since the thread's last walk: its next walk's record says */
    u64 last_ns;    /* the thread's last walk at a native call */
    u64 last_stack; /* ... the stack it found (0: none) */
    u64 last_epoch; /* ... and its epoch */
};
BPF_HASH(py_hits, u32, struct py_hit_state, 16384);
BPF_HASH(py_owed, struct py_owed_key, u64, 16384);

/* ---- sampling ---------------------------------------------------------------------------------- */

/* A perf-event program: its context is struct bpf_perf_event_data, but only passed on, never read,
 * so it is typed as pt_regs (including <uapi/linux/bpf_perf_event.h> costs ~1 s of compile time). */
int py_on_cpu(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct py_cfg *cfg = py_targets.lookup(&tgid);
    if (!cfg) return 0;
    u64 stack = py_walk(cfg, tgid, tid, PY_SLOT_PROBE);
    if (!stack) return 0;
    u64 epoch = cur_epoch(tgid);
    py_prof_add(tgid, tid, epoch, stack, PROF_ONCPU, ARGUS_PY_PERIOD_NS);
#ifdef ARGUS_RECORD
    struct rec_py_sample *r = RECORD(rec_py_sample, REC_PY_SAMPLE, 0, epoch);
    if (!r) return 0;
    r->stack = stack;
    r->ustack = -1;
    r->kstack = -1;
    record_submit(r);
#endif
    return 0;
}

/* ---- walks at native CUDA/NCCL calls (declared in pyhooks.h) ------------------------------------ */

struct py_hit_arg {
    u32 pending;
    u32 call;
    u64 aux;
    u32 weight;
    u32 pad;
};
BPF_PERCPU_ARRAY(py_hit_args, struct py_hit_arg, 1); /* decision -> walker (probes never nest per CPU) */
BPF_PROG_ARRAY(py_walkers, 1);                      /* [0] = py_walk_native, set by user space */

/* Decide whether this native call is walked; the walk itself happens in py_walk_native, reached by a
 * tail call from py_tail at the end of the probe program, so the walking code is compiled and
 * verified once instead of in every native probe. */
static __always_inline void py_native_hit(u32 call, u64 aux, u32 how) {
    u32 tgid = cur_tgid();
    if (!py_targets.lookup(&tgid)) return;
    u32 tid = cur_tid();
    u32 weight = 1;
    if (how != PY_HIT_ALWAYS) {
        /* a thread's first collective is walked: coll_countdown starts at 1 */
        struct py_hit_state zero = {.countdown = ARGUS_PY_LAUNCH_EVERY, .coll_countdown = 1}, *st;
        st = py_hits.lookup_or_try_init(&tid, &zero);
        if (!st) return;
        if (how == PY_HIT_EVENT) {
            st->force = 1;
            st->events += 1;
            return;
        } else if (how == PY_HIT_COLL) {
            if (st->coll_countdown > 1) {
                st->coll_countdown -= 1;
                return;
            }
            st->coll_countdown = ARGUS_PY_COLL_EVERY;
            weight = ARGUS_PY_COLL_EVERY;
        } else if (st->force) {
            st->force = 0;
        } else if (st->countdown > 1) {
            st->countdown -= 1;
            return;
        } else {
            st->countdown = ARGUS_PY_LAUNCH_EVERY;
            weight = ARGUS_PY_LAUNCH_EVERY;
        }
        u64 now = bpf_ktime_get_ns();
        if (weight > 1 && st->last_stack && now - st->last_ns < ARGUS_PY_HIT_GAP_NS) {
            u64 epoch = cur_epoch(tgid);
            if (epoch == st->last_epoch) {
                struct py_owed_key k = {.tgid = tgid, .call = call, .epoch = epoch, .stack = st->last_stack};
                u64 zero = 0;
                agg_add(py_owed.lookup_or_try_init(&k, &zero), weight);
                return;
            }
        }
        st->last_ns = now;
    }
    u32 zero = 0;
    struct py_hit_arg *a = py_hit_args.lookup(&zero);
    if (!a) return;
    a->pending = 1;
    a->call = call;
    a->aux = aux;
    a->weight = weight;
}

static __always_inline void py_tail(struct pt_regs *ctx) {
    u32 zero = 0;
    struct py_hit_arg *a = py_hit_args.lookup(&zero);
    if (!a || !a->pending) return;
    py_walkers.call(ctx, 0); /* returns only if the tail call failed */
    a->pending = 0;
}

int py_walk_native(struct pt_regs *ctx) {
    u32 zero = 0;
    struct py_hit_arg *a = py_hit_args.lookup(&zero);
    if (!a || !a->pending) return 0;
    a->pending = 0;
    u32 tgid = cur_tgid();
    struct py_cfg *cfg = py_targets.lookup(&tgid);
    if (!cfg) return 0;
    u32 tid = cur_tid();
    u64 stack = py_walk(cfg, tgid, tid, PY_SLOT_PROBE), epoch = cur_epoch(tgid);
    struct py_hit_state *st = py_hits.lookup(&tid);
    u32 events = 0;
    if (st) {
        st->last_stack = stack;
        st->last_epoch = epoch;
        events = st->events;
        st->events = 0;
    }
    struct rec_py_mark *r = RECORD(rec_py_mark, REC_PY_MARK, a->call, epoch);
    if (!r) return 0;
    r->stack = stack;
    r->aux = a->aux;
    r->weight = a->weight;
    r->events = events;
    record_submit(r);
    return 0;
}

/* ---- garbage collection (USDT python:gc__start / gc__done) ---------------------------------------- */

struct gc_start {
    u64 ts;
    s64 gen;
};
BPF_HASH(py_gc_starts, u32, struct gc_start, 16384);
BPF_HASH(py_gc, struct gc_key, struct gc_val, 4096);

/* A USDT argument: a register (a word of struct pt_regs), memory at register + offset, or a constant. */
static __always_inline s64 usdt_read(struct pt_regs *ctx, struct usdt_arg *a) {
    if (a->kind == USDT_ARG_CONST) return a->offset;
    if (a->kind != USDT_ARG_REG && a->kind != USDT_ARG_MEM) return 0;
    /* copy the saved registers: clang turns a switch over ctx fields into ctx pointer arithmetic,
     * which the verifier rejects */
    u64 regs[21] = {};
    bpf_probe_read_kernel(regs, sizeof(regs), (void *)ctx);
    u32 idx = a->reg;
    if (idx >= 21) return 0;
    u64 reg = regs[idx];
    u64 v = reg;
    if (a->kind == USDT_ARG_MEM) {
        v = 0;
        bpf_probe_read_user(&v, sizeof(v), (void *)(reg + a->offset));
    }
    switch (a->size) {
    case 1: return a->is_signed ? (s64)(s8)v : (s64)(u8)v;
    case 2: return a->is_signed ? (s64)(s16)v : (s64)(u16)v;
    case 4: return a->is_signed ? (s64)(s32)v : (s64)(u32)v;
    }
    return (s64)v;
}

int py_gc_start(struct pt_regs *ctx) {
    u32 tgid = cur_tgid();
    struct py_cfg *cfg = py_targets.lookup(&tgid);
    if (!cfg) return 0;
    u32 tid = cur_tid();
    struct gc_start s = {.ts = bpf_ktime_get_ns(), .gen = usdt_read(ctx, &cfg->gc_start_gen)};
    py_gc_starts.update(&tid, &s);
    return 0;
}

int py_gc_done(struct pt_regs *ctx) {
    u32 tgid = cur_tgid();
    struct py_cfg *cfg = py_targets.lookup(&tgid);
    if (!cfg) return 0;
    u32 tid = cur_tid();
    struct gc_start *s = py_gc_starts.lookup(&tid);
    if (!s) return 0;
    u64 now = bpf_ktime_get_ns(), d = now - s->ts;
    s64 gen = s->gen, collected = usdt_read(ctx, &cfg->gc_done_collected);
    u64 start = s->ts;
    py_gc_starts.delete(&tid);
    u64 epoch = cur_epoch(tgid);
    struct gc_key k = {.tgid = tgid, .gen = (s32)gen, .epoch = epoch};
    struct gc_val zero = {}, *v = py_gc.lookup_or_try_init(&k, &zero);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->ns, d);
        __sync_fetch_and_add(&v->collected, collected);
        if (d > v->max_ns) v->max_ns = d;
    } else {
        drop(DROP_AGG);
    }
#ifdef ARGUS_RECORD
    struct rec_gc *r = RECORD(rec_gc, REC_GC, 0, epoch);
    if (!r) return 0;
    r->start_ns = start;
    r->collected = collected;
    r->generation = (s32)gen;
    r->pad = 0;
    record_submit(r);
#endif
    return 0;
}

/* ---- precise mode: selected functions timed at the eval loop (opt-in) -------------------------- */

BPF_HASH(py_precise, u64, u32, 1024); /* code objects to time, filled by user space */
struct precise_key {
    u32 tid;
    u32 pad;
    u64 sp;
};
struct precise_val {
    u64 ts;
    u64 code;
};
BPF_HASH(py_precise_enter, struct precise_key, struct precise_val, 16384);

/* _PyEval_EvalFrameDefault(PyThreadState *tstate, frame *f, int throwflag): f's code object. The
 * return matches its entry by the stack pointer (one word above the entry's after `ret`). */
int py_eval_entry(struct pt_regs *ctx) {
    u32 tgid = cur_tgid();
    struct py_cfg *cfg = py_targets.lookup(&tgid);
    if (!cfg) return 0;
    u64 code = 0;
    bpf_probe_read_user(&code, sizeof(code), (void *)(PT_REGS_PARM2(ctx) + cfg->off_frame_code));
    if (!py_precise.lookup(&code)) return 0;
    struct precise_key k = {.tid = cur_tid(), .pad = 0, .sp = PT_REGS_SP(ctx)};
    struct precise_val v = {.ts = bpf_ktime_get_ns(), .code = code};
    py_precise_enter.update(&k, &v);
    return 0;
}

int py_eval_return(struct pt_regs *ctx) {
    u32 tgid = cur_tgid();
    if (!py_targets.lookup(&tgid)) return 0;
    struct precise_key k = {.tid = cur_tid(), .pad = 0, .sp = PT_REGS_SP(ctx) - 8};
    struct precise_val *v = py_precise_enter.lookup(&k);
    if (!v) return 0;
    u64 enter = v->ts, code = v->code;
    py_precise_enter.delete(&k);
    struct rec_py_call *r = RECORD(rec_py_call, REC_PY_CALL, 0, cur_epoch(tgid));
    if (!r) return 0;
    r->code = code;
    r->enter_ns = enter;
    record_submit(r);
    return 0;
}
