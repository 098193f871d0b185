/* Host stacks: the native user and kernel stacks taken of a target's threads and the time counted
 * per (thread, epoch, user stack, kernel stack). Shared by the host channel's sampler (host.bpf.c)
 * and off-CPU accounting (offcpu.bpf.c, sched_switch). Empty without the host channel
 * (ARGUS_HOST): offcpu.bpf.c also serves the Python channel alone, which takes no native stacks.
 */
#ifndef ARGUS_HOSTSTACK_H
#define ARGUS_HOSTSTACK_H

#include "helpers.h"

#ifdef ARGUS_HOST

#ifndef ARGUS_STACK_ENTRIES
#define ARGUS_STACK_ENTRIES 8192
#endif

BPF_STACK_TRACE(stack_traces, ARGUS_STACK_ENTRIES);
BPF_HASH(host_prof, struct prof_key, struct prof_val, 16384);

static __always_inline void host_prof_add(u32 tgid, u32 tid, u64 epoch, s32 ustack, s32 kstack, u32 kind,
                                          u64 ns) {
    struct prof_key k = {.tgid = tgid, .tid = tid, .epoch = epoch, .stack = 0, .ustack = ustack,
                         .kstack = kstack, .kind = kind};
    struct prof_val zero = {};
    agg_add_sum(host_prof.lookup_or_try_init(&k, &zero), ns);
}

#endif /* ARGUS_HOST */

#endif
