/* A fixed yardstick for BPF run time (benchmarks/bpf_breakdown.py `yardstick_ns`): the shape of a
 * typical argus probe -- is the caller traced, which epoch, one aggregate bumped, a clock read, a
 * per-thread entry written in place -- attached to a simulated launch the C driver repeats. The
 * same program runs 2-3x slower on some days of the same VM kind than on others; argus's programs
 * move with it, so budgets are kept in units of this program's ns per run. Never change it: a
 * budget recorded in its units would change meaning.
 */
#include <uapi/linux/ptrace.h>

struct yard_key {
    u32 tgid;
    u32 pad;
    u64 epoch;
    u64 arg;
};
BPF_HASH(yard_targets, u32, u64, 1024);
BPF_HASH(yard_counts, struct yard_key, u64, 4096);
BPF_TABLE("lru_hash", u32, u64, yard_last, 1024);

int yard_hit(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u64 *epoch = yard_targets.lookup(&tgid);
    if (!epoch) return 0;
    struct yard_key k = {.tgid = tgid, .epoch = *epoch, .arg = PT_REGS_PARM1(ctx)};
    u64 zero = 0, *v = yard_counts.lookup_or_try_init(&k, &zero);
    if (v) __sync_fetch_and_add(v, 1);
    u64 now = bpf_ktime_get_ns();
    u64 *last = yard_last.lookup(&tid);
    if (last)
        *last = now;
    else
        yard_last.update(&tid, &now);
    return 0;
}
