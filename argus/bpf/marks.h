/* Event recordings as marks on streams, shared by the CUDA channel (recordings, queries, syncs) and
 * the NCCL channel (which recordings lie next to a recorded collective).
 *
 * No ring record per recording (hundreds a step at PyTorch's rates: its caching allocator, its
 * watchdog, an event before and after every collective): ev_marks keeps each event's latest
 * recording, and its completion is one record carrying it (argus/agent/gpuarrive.py).
 *
 * Past the agent's collective records per step the NCCL channel records every n-th collective
 * (nccl.bpf.c `coll_sample`); the agent then reads the GPU-arrival evidence of those only, so a
 * completion is told only for a recording near one of them: up to MARK_NEAR_BEFORE stream
 * operations before it (PyTorch's event before the collective, the compute stream's marks of the
 * same layer) or MARK_NEAR_AFTER after (its end event); a stream's waits are told only before a
 * recorded collective. Until a process's first collective is sampled (near_colls has no entry)
 * every completion and wait is told.
 */
#ifndef ARGUS_MARKS_H
#define ARGUS_MARKS_H

#include "helpers.h"

#define MARK_NEAR_BEFORE 8
#define MARK_NEAR_AFTER 4
#define MARK_RECENT 8 /* recordings remembered per process to flag at a recorded collective */

struct ev_key {
    u32 tgid;
    u32 pad;
    u64 event;
};
struct ev_mark {
    u64 stream;
    u64 pos; /* next_op at the recording */
    u64 ts;
    u64 not_ready; /* entry of the last query that found this recording not complete, 0 if none */
    u64 epoch;
    u64 passed; /* return of the query (or event sync) that found it complete */
    u32 done;   /* found complete */
    u32 want;   /* its completion is told (near a recorded collective, or no sampling) */
    u32 told;
    u32 by_sync;
};
/* An LRU: a framework that creates events without end evicts its oldest, whose completions are then
 * not told. */
BPF_TABLE("lru_hash", struct ev_key, struct ev_mark, ev_marks, 16384);

/* Per process, once one of its collectives was sampled out: the place of its latest recorded
 * collective and its latest recordings. */
struct near_state {
    u64 last_rec;
    u64 idx;
    u64 ev[MARK_RECENT];
    u64 pos[MARK_RECENT]; /* each one's place when recorded: most are too far to look up */
};
BPF_HASH(near_colls, u32, struct near_state, ARGUS_MAX_TARGETS);

static __always_inline void mark_tell(u32 tgid, u64 event, struct ev_mark *m, u32 call) {
    m->told = 1;
    struct rec_event_done *r = RECORD(rec_event_done, REC_EVENT_DONE, call, cur_epoch(tgid));
    if (!r) return;
    r->h.ts = m->passed;
    r->event = event;
    r->not_ready_ns = m->not_ready;
    r->stream = m->stream;
    r->pos = m->pos;
    r->rec_ns = m->ts;
    r->by_sync = m->by_sync;
    r->pad = 0;
    record_submit(r);
}

/* A recording at place `pos` on `stream`: kept, and wanted when right after a recorded collective. */
static __always_inline void mark_record(u32 tgid, u64 event, u64 stream, u64 pos, u64 epoch) {
    struct ev_key k = {.tgid = tgid, .event = event};
    struct ev_mark m = {.stream = stream, .pos = pos, .ts = bpf_ktime_get_ns(), .epoch = epoch, .want = 1};
    struct near_state *ns = near_colls.lookup(&tgid);
    if (ns) {
        m.want = pos - ns->last_rec <= MARK_NEAR_AFTER;
        ns->ev[ns->idx % MARK_RECENT] = event;
        ns->pos[ns->idx % MARK_RECENT] = pos;
        ns->idx += 1;
    }
    /* a new recording: its completion is a new question. Written over the event's entry when it
     * has one (PyTorch reuses its events): an LRU update allocates a node and frees the old one. */
    struct ev_mark *cur = ev_marks.lookup(&k);
    if (cur)
        __builtin_memcpy(cur, &m, sizeof(m));
    else
        ev_marks.update(&k, &m);
}

/* The GPU passed the event's latest recording by now: told once, when wanted. Not for a recording
 * made before we attached: its place is unknown. */
static __always_inline void mark_passed(u32 tgid, u64 event, u32 call, u32 by_sync) {
    struct ev_key k = {.tgid = tgid, .event = event};
    struct ev_mark *m = ev_marks.lookup(&k);
    if (!m || m->done) return;
    m->done = 1;
    m->passed = bpf_ktime_get_ns();
    m->by_sync = by_sync;
    if (m->want) mark_tell(tgid, event, m, call);
}

/* A recorded collective at place `pos`: the recent recordings just before it are wanted (told now
 * if already complete). */
static __always_inline void mark_near_recorded(u32 tgid, u64 pos) {
    struct near_state *ns = near_colls.lookup(&tgid);
    if (!ns) return;
    ns->last_rec = pos;
#pragma unroll
    for (int i = 0; i < MARK_RECENT; i++) {
        /* re-recorded since: its newer place is in the ring too */
        if (ns->pos[i] + MARK_NEAR_BEFORE < pos || ns->pos[i] > pos + MARK_NEAR_AFTER) continue;
        struct ev_key k = {.tgid = tgid, .event = ns->ev[i]};
        struct ev_mark *m = ev_marks.lookup(&k);
        if (!m || m->want || m->pos + MARK_NEAR_BEFORE < pos || m->pos > pos + MARK_NEAR_AFTER) continue;
        m->want = 1;
        if (m->done && !m->told) mark_tell(tgid, k.event, m, CALL_cuEventQuery);
    }
}

/* A collective sampled out: from now on only wanted completions are told, and a stream's waits
 * are held until its next collective. */
static __always_inline void mark_sampled_out(u32 tgid) {
    struct near_state zero = {};
    near_colls.lookup_or_try_init(&tgid, &zero);
}

/* ---- waits: a stream's waits before a collective are read only for that collective ------------
 * Under sampling, a stream's waits since its latest collective are held here and told just before
 * its next collective's record, or forgotten when that one is not recorded. */
#define MARK_WAITS 4 /* the newest held per stream (PyTorch waits once before each collective) */
struct stream_key {
    u32 tgid;
    u32 pad;
    u64 stream;
};
struct held_waits {
    u64 n;
    struct rec_stream_wait w[MARK_WAITS];
};
BPF_HASH(waits_held, struct stream_key, struct held_waits, 4096);

/* Held (1) when the process is sampled, else told now by the caller (0). */
static __always_inline int mark_hold_wait(u32 tgid, struct rec_stream_wait *w) {
    if (!near_colls.lookup(&tgid)) return 0;
    struct stream_key k = {.tgid = tgid, .stream = w->stream};
    struct held_waits zero = {};
    struct held_waits *hw = waits_held.lookup_or_try_init(&k, &zero);
    if (!hw) return 0;
    u64 i = hw->n & (MARK_WAITS - 1);
    __builtin_memcpy(&hw->w[i], w, sizeof(*w));
    hw->n += 1;
    return 1;
}

/* The stream's next collective: its held waits told (recorded) or forgotten (sampled out). */
static __always_inline void mark_waits_before(u32 tgid, u64 stream, int recorded) {
    struct stream_key k = {.tgid = tgid, .stream = stream};
    struct held_waits *hw = waits_held.lookup(&k);
    if (!hw || !hw->n) return;
    u64 n = hw->n;
    hw->n = 0;
    if (!recorded) return;
    u64 first = n > MARK_WAITS ? n - MARK_WAITS : 0;
#pragma unroll
    for (int j = 0; j < MARK_WAITS; j++) {
        if (first + j >= n) break;
        struct rec_stream_wait *r = ring_reserve(sizeof(*r));
        if (!r) return;
        __builtin_memcpy(r, &hw->w[(first + j) & (MARK_WAITS - 1)], sizeof(*r));
        record_submit(r);
    }
}

#endif
