/* Off-CPU accounting for the Python and host channels (sched:sched_switch).
 *
 * When a thread of a target process is switched out, its Python stack is walked (it is still the
 * current task, so its memory is readable) and, with the host channel, its user and kernel stacks
 * are taken; when it runs again, the interval is added to that stack's off-CPU time in the epoch
 * the thread wakes in (a host sync is counted in the step it ends). Off-CPU includes time
 * runnable but waiting for a CPU. A sampler alone cannot see a blocked thread: this is what makes
 * phase times right for threads that sleep, wait on locks or block in GPU syncs.
 * In the compile unit whenever the Python or host channel is (argus/agent/bpfprog.py); the stack
 * walkers come from pystack.h and hoststack.h, each empty without its channel.
 */

#include "helpers.h"
#include "hoststack.h"
#include "pystack.h"

struct offcpu_start {
    u64 ts;
    u64 stack;
    u32 tgid;
    s32 ustack;
    s32 kstack;
    u32 pad;
};
BPF_HASH(offcpu_starts, u32, struct offcpu_start, 65536);

/* Written over the thread's entry when it has one: an update allocates an element and the delete
 * at switch-in freed it, at every switch of a Python thread. */
static __always_inline void offcpu_start_save(u32 tid, struct offcpu_start *s) {
    struct offcpu_start *cur = offcpu_starts.lookup(&tid);
    if (cur)
        __builtin_memcpy(cur, s, sizeof(*s));
    else
        offcpu_starts.update(&tid, s);
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 prev = (u32)args->prev_pid, next = (u32)args->next_pid;
    u32 tgid = cur_tgid();
    if (prev && targets.lookup(&tgid)) {
        struct offcpu_start s = {.ts = now, .stack = 0, .tgid = tgid, .ustack = -1, .kstack = -1, .pad = 0};
#ifdef ARGUS_PYTHON
        struct py_cfg *cfg = py_targets.lookup(&tgid);
        if (cfg) s.stack = py_walk(cfg, tgid, prev, PY_SLOT_SCHED);
#endif
#ifdef ARGUS_HOST
        s.ustack = stack_traces.get_stackid(args, BPF_F_USER_STACK);
        s.kstack = stack_traces.get_stackid(args, 0);
        offcpu_start_save(prev, &s);
#else
        /* no Python stack (a CUDA stream or NCCL thread: most switches of a rank): nothing to
         * attribute, so no bookkeeping either */
        if (s.stack) offcpu_start_save(prev, &s);
#endif
    }
    if (!next) return 0;
    struct offcpu_start *s = offcpu_starts.lookup(&next);
    if (!s || !s->ts) return 0;
    u64 start = s->ts, stack = s->stack, d = now - start;
    u32 owner = s->tgid;
    s32 ustack = s->ustack, kstack = s->kstack;
    s->ts = 0; /* consumed: kept for the thread's next switch-out (user space trims the exited) */
    if (!targets.lookup(&owner)) return 0;
    u64 epoch = cur_epoch(owner);
#ifdef ARGUS_PYTHON
    if (stack) py_prof_add(owner, next, epoch, stack, PROF_OFFCPU, d);
#endif
#ifdef ARGUS_HOST
    host_prof_add(owner, next, epoch, ustack, kstack, PROF_OFFCPU, d);
#endif
#ifdef ARGUS_RECORD
    /* not RECORD(): the span belongs to the thread switched in, not the current one */
    struct rec_offcpu *r = ring_reserve(sizeof(struct rec_offcpu));
    if (!r) return 0;
    r->h.kind = REC_OFFCPU;
    r->h.tgid = owner;
    r->h.tid = next;
    r->h.call = 0;
    r->h.ts = now;
    r->h.epoch = epoch;
    r->start_ns = start;
    r->stack = stack;
    r->ustack = ustack;
    r->kstack = kstack;
    record_submit(r);
#endif
    return 0;
}
