/* benchmarks/uprobe_session.py: one program for a call's entry and return (a uprobe session link,
 * BPF_TRACE_UPROBE_SESSION, kernel >= 6.13), whose entry asks for the return only every
 * WANT_EVERY-th call. A session program runs at both ends; without the bpf_session_is_return kfunc
 * (bcc 0.26 cannot call kfuncs) the return is told by the stack pointer: on x86-64 the entry sees
 * the return address at sp, and the return sees sp 8 bytes above it.
 */
#include <uapi/linux/ptrace.h>

#ifndef WANT_EVERY
#define WANT_EVERY 1
#endif

BPF_ARRAY(hits, u64, 4); /* 0: entries, 1: returns, 2: classic entries, 3: classic returns */
BPF_HASH(entry_sp, u32, u64, 1024);

static __always_inline void bump(int i) {
    u64 *c = hits.lookup(&i);
    if (c) __sync_fetch_and_add(c, 1);
}

int session(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
    u64 *prev = entry_sp.lookup(&tid);
    if (prev && *prev && *prev + 8 == sp) {
        *prev = 0;
        bump(1);
        return 0;
    }
    int k = 0;
    u64 *n = hits.lookup(&k);
    if (!n) return 1;
    if ((__sync_fetch_and_add(n, 1) + 1) % WANT_EVERY) return 1; /* 1: no return probe for this call */
    if (prev)
        *prev = sp;
    else
        entry_sp.update(&tid, &sp);
    return 0;
}

int classic_entry(struct pt_regs *ctx) {
    bump(2);
    return 0;
}

int classic_return(struct pt_regs *ctx) {
    bump(3);
    return 0;
}
