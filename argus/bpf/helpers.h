/* What nearly every probe does, written once: is the caller a target, reserve a ring record,
 * add to an aggregate, count a call or its error.
 *
 * Map calls (`targets.lookup(...)`) stay in functions: bcc refuses them inside a macro ("cannot use
 * map function inside a macro"). Everything is __always_inline: a probe compiles to what it did with
 * these lines written out in it, within an instruction or two.
 */
#ifndef ARGUS_HELPERS_H
#define ARGUS_HELPERS_H

#include "argus.h"

/* The calling process's config when it is a traced target, else NULL; *tgid is set to the process
 * either way. Every probe starts with `u32 tgid; if (!target(&tgid)) return 0;`: no other work
 * for the processes we do not trace, which share the libraries we probe. (An out-parameter, not a
 * tgid-or-0 return: that costs two more instructions in every probe.) */
static __always_inline struct target_cfg *target(u32 *tgid) {
    *tgid = cur_tgid();
    return targets.lookup(tgid);
}

/* ---- the ring -------------------------------------------------------------------------------- */

/* `size` bytes of the ring, or NULL when it is full (counted: user space says records were lost). */
static __always_inline void *ring_reserve(u32 size) {
    void *r = records.ringbuf_reserve(size);
    if (!r) drop(DROP_RINGBUF);
    return r;
}

/* A record with its header filled for this thread, now: `struct rec_x *r = RECORD(rec_x, REC_X,
 * call, epoch); if (!r) return 0;` then its fields, then record_submit(r). Every record starts
 * with its struct rec_hdr h. */
#define RECORD(type, kind, call, epoch) ((struct type *)record_reserve(sizeof(struct type), kind, call, epoch))

static __always_inline void *record_reserve(u32 size, u32 kind, u32 call, u64 epoch) {
    struct rec_hdr *h = ring_reserve(size);
    if (h) fill_hdr(h, kind, call, epoch);
    return h;
}

/* No wakeup: the agent polls the ring on a timer; a wakeup per record would cost more than the
 * record. */
static __always_inline void record_submit(void *r) { records.ringbuf_submit(r, BPF_RB_NO_WAKEUP); }

/* ---- aggregates -------------------------------------------------------------------------------
 * `v` is what the map's lookup_or_try_init returned at the call site (a map cannot be passed to a
 * function); NULL means the map is full, counted so user space says the sums are short. */

static __always_inline void agg_add(u64 *v, u64 n) {
    if (v) __sync_fetch_and_add(v, n);
    else drop(DROP_AGG);
}

/* A {u64 count; u64 sum} value (struct mem_val, struct prof_val): one more of `n` (bytes, ns). */
static __always_inline void agg_add_sum(void *v, u64 n) {
    u64 *cs = v;
    if (cs) {
        __sync_fetch_and_add(&cs[0], 1);
        __sync_fetch_and_add(&cs[1], n);
    } else {
        drop(DROP_AGG);
    }
}
_Static_assert(sizeof(struct mem_val) == 16 && __builtin_offsetof(struct mem_val, bytes) == 8, "agg_add_sum");
_Static_assert(sizeof(struct prof_val) == 16 && __builtin_offsetof(struct prof_val, ns) == 8, "agg_add_sum");

/* ---- calls and results, per (process, epoch): every channel's counters -------------------------- */

static __always_inline void count_error(u32 tgid, u32 call, s64 result) {
    if (result == 0) return;
    struct err_key k = {.tgid = tgid, .call = call, .epoch = cur_epoch(tgid), .result = result};
    u64 zero = 0;
    agg_add(errors.lookup_or_try_init(&k, &zero), 1);
}

static __always_inline void count_call(u32 tgid, u32 call, u64 epoch) {
    struct call_key k = {.tgid = tgid, .call = call, .epoch = epoch};
    u64 zero = 0;
    agg_add(call_counts.lookup_or_try_init(&k, &zero), 1);
}

/* `argus record`: one record per CUDA call (driver and runtime channels), for the full-detail
 * window; a no-op otherwise. */
#ifdef ARGUS_RECORD
static __always_inline void record_call(u32 call, u64 enter_ns, u64 arg, u64 stream) {
    struct rec_call *r = RECORD(rec_call, REC_CALL, call, cur_epoch(cur_tgid()));
    if (!r) return;
    r->enter_ns = enter_ns ? enter_ns : r->h.ts;
    r->arg = arg;
    r->stream = stream;
    record_submit(r);
}
#else
static __always_inline void record_call(u32 call, u64 enter_ns, u64 arg, u64 stream) {}
#endif

#endif
