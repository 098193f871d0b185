/* Python stacks: the walker of a thread's frames, the stacks it stores and the time counted per
 * stack. Shared by the Python channel's programs (python.bpf.c: samples, walks at native calls) and
 * off-CPU accounting (offcpu.bpf.c, sched_switch); python.bpf.c's opening comment says how a walk
 * works. Empty without the Python channel (ARGUS_PYTHON): offcpu.bpf.c also serves the host channel
 * alone, which has no Python maps.
 */
#ifndef ARGUS_PYSTACK_H
#define ARGUS_PYSTACK_H

#include "helpers.h"

#ifdef ARGUS_PYTHON

#ifndef ARGUS_PY_STACKS
#define ARGUS_PY_STACKS 8192
#endif

#define PY_OWNED_BY_CSTACK 3
#define PY_SLOT_PROBE 0 /* scratch slot for perf-event and uprobe programs */
#define PY_SLOT_SCHED 1 /* scratch slot for sched_switch */

BPF_HASH(py_targets, u32, struct py_cfg, ARGUS_MAX_TARGETS);
/* A thread's state (0: not a Python thread) and the lowest frame address its last walk found
 * within PY_WINDOW of the top: where the next walk's one read of the stack's span starts. */
struct py_thread {
    u64 tstate;
    u64 low;
};
BPF_HASH(py_threads, u32, struct py_thread, 65536); /* tid -> struct py_thread */
BPF_HASH(py_unknown, u32, u32, 1024);  /* tid -> tgid: sampled, thread state not known yet */
BPF_HASH(py_stacks, u64, struct py_stack, ARGUS_PY_STACKS);
BPF_PERCPU_ARRAY(py_scratch, struct py_stack, 2);
BPF_HASH(py_prof, struct prof_key, struct prof_val, ARGUS_AGG_ENTRIES);

static __always_inline u64 py_first_frame(struct py_cfg *cfg, u64 tstate) {
    u64 p = 0;
    bpf_probe_read_user(&p, sizeof(p), (void *)(tstate + cfg->off_tstate_frame));
    if (p && cfg->off_cframe_frame != OFF_UNKNOWN) {
        u64 f = 0;
        bpf_probe_read_user(&f, sizeof(f), (void *)(p + cfg->off_cframe_frame));
        p = f;
    }
    return p;
}

/* One read per frame: the code, caller and owner fields of every supported layout lie in the
 * frame's first PY_FRAME_READ bytes (user space checks the offsets: argus/agent/pyagent.py), and a
 * 72-byte bpf_probe_read_user costs about what one 8-byte read does, so this is ~3x cheaper than a
 * read per field. Cheaper still: CPython >= 3.11 keeps a thread's frames contiguous in its data
 * stack, so one read of the span from the lowest frame the last walk found up to the top frame
 * holds most frames (`w`; a 43-frame walk at a switch-out 2.9 -> 0.9 µs, docs/benchmarks.md
 * 8.15); frames outside it (generators' and C-stack shim frames, a deeper stack) are read one by
 * one, as are all of an older Python's (heap frames: a span of them was no faster). The buffers are larger than the
 * reads so masked offsets stay inside them. */
#define PY_WINDOW 16384
struct py_frame_buf {
    u8 b[128];
    u8 w[PY_WINDOW + 128];
};
BPF_PERCPU_ARRAY(py_frame_bufs, struct py_frame_buf, 2);

/* Walk thread `tid`'s frames (it must be the current task); store the stack once; return its id,
 * 0 when the thread has no Python frame or its thread state is not known yet. */
static __always_inline u64 py_walk(struct py_cfg *cfg, u32 tgid, u32 tid, u32 slot) {
    struct py_thread *pt = py_threads.lookup(&tid);
    if (!pt) {
        py_unknown.update(&tid, &tgid);
        return 0;
    }
    if (!pt->tstate) return 0;
    struct py_stack *st = py_scratch.lookup(&slot);
    if (!st) return 0;
    struct py_frame_buf *fb = py_frame_bufs.lookup(&slot);
    if (!fb) return 0;
    u64 frame = py_first_frame(cfg, pt->tstate);
    u64 wend = frame + PY_FRAME_READ, wbase = wend, low = pt->low;
    if (cfg->version >= 0x30b && frame && low && low < frame) { /* older: heap frames, scattered */
        wbase = wend - low > PY_WINDOW ? wend - PY_WINDOW : low;
        u64 size = wend - wbase; /* 64 bits: a u32 is bounded in a copy, the call passes the whole */
        if (size > PY_WINDOW) size = PY_WINDOW;
        if (bpf_probe_read_user(fb->w, size, (void *)wbase) != 0) wbase = wend; /* not all mapped */
    }
    low = frame;
    u64 h = (0xcbf29ce484222325ULL ^ tgid) * 0x100000001b3ULL; /* ids are per process */
    /* Branch-light on purpose (the verifier walks every unrolled iteration): without an owner
     * byte, read any byte and compare with a value an owner never has. A C-stack shim frame is
     * stored as code 0 and dropped by user space. Masks keep the verifier sure of the bounds. */
    u32 off_code = cfg->off_frame_code & 63, off_back = cfg->off_frame_back & 63;
    u32 off_owner = (cfg->off_frame_owner == OFF_UNKNOWN ? off_code : cfg->off_frame_owner) & 127;
    u8 shim = cfg->off_frame_owner == OFF_UNKNOWN ? 0xff : PY_OWNED_BY_CSTACK;
    u32 n = 0;
    /* a real loop (kernel >= 5.3): unrolled, it would be pasted into every native probe */
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_MAX_FRAMES; i++) {
        if (!frame) break;
        u8 *p = fb->b;
        if (frame >= wbase && frame + PY_FRAME_READ <= wend)
            p = fb->w + ((frame - wbase) & (PY_WINDOW - 1));
        else if (bpf_probe_read_user(fb->b, PY_FRAME_READ, (void *)frame) != 0)
            break;
        if (frame < low && frame + PY_WINDOW >= wend) low = frame;
        u64 code = *(u64 *)(p + off_code), back = *(u64 *)(p + off_back);
        if (p[off_owner] == shim) code = 0;
        st->code[i] = code;
        h = (h ^ code) * 0x100000001b3ULL;
        frame = back;
        n = i + 1;
    }
    pt->low = low;
    if (!n) return 0;
    st->depth = n;
    st->flags = frame ? PY_F_TRUNCATED : 0;
    h = (h ^ n) * 0x100000001b3ULL;
    if (h == 0) h = 1;
    py_stacks.insert(&h, st);
    return h;
}

static __always_inline void py_prof_add(u32 tgid, u32 tid, u64 epoch, u64 stack, u32 kind, u64 ns) {
    struct prof_key k = {.tgid = tgid, .tid = tid, .epoch = epoch, .stack = stack, .ustack = -1, .kstack = -1,
                         .kind = kind};
    struct prof_val zero = {};
    agg_add_sum(py_prof.lookup_or_try_init(&k, &zero), ns);
}

#endif /* ARGUS_PYTHON */

#endif
