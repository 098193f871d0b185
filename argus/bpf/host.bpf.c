/* Host channel: why a rank's host threads are slow — native and kernel stacks, on and off CPU.
 *
 * A low-rate perf-event program (software CPU_CLOCK, ARGUS_HOST_PERIOD_NS) takes the user and
 * kernel stack of every running thread of a target process (frame-pointer unwinding by the
 * kernel: binaries without frame pointers give truncated user stacks) and counts
 * (thread, epoch, user stack, kernel stack) in `host_prof` (hoststack.h). Off-CPU time per thread
 * and stack is added by offcpu.bpf.c at sched_switch. User space folds and symbolises the stacks
 * per window.
 */

#include "helpers.h"
#include "hoststack.h"

#ifndef ARGUS_HOST_PERIOD_NS
#define ARGUS_HOST_PERIOD_NS 52631578 /* 19 Hz */
#endif

/* A perf-event program: its context is struct bpf_perf_event_data, but only passed on, never read,
 * so it is typed as pt_regs (including <uapi/linux/bpf_perf_event.h> costs ~1 s of compile time). */
int host_on_cpu(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!targets.lookup(&tgid)) return 0;
    s32 ustack = stack_traces.get_stackid(ctx, BPF_F_USER_STACK);
    s32 kstack = stack_traces.get_stackid(ctx, 0);
    host_prof_add(tgid, tid, cur_epoch(tgid), ustack, kstack, PROF_ONCPU, ARGUS_HOST_PERIOD_NS);
    return 0;
}
