/* Step marker (--step-fn): every call of the user's step function ends the previous step. It acts
 * like a host sync: it closes the process's epoch and leaves a record of when. */

int step_marker_entry(struct pt_regs *ctx) {
    u32 tgid = cur_tgid();
    if (!targets.lookup(&tgid)) return 0;
    u64 epoch = 0, *e = epochs.lookup(&tgid);
    if (e) epoch = __sync_fetch_and_add(e, 1);
    struct rec_sync *r = records.ringbuf_reserve(sizeof(struct rec_sync));
    if (!r) {
        drop(DROP_RINGBUF);
        return 0;
    }
    fill_hdr(&r->h, REC_SYNC, CALL_step_marker, epoch);
    r->enter_ns = r->h.ts;
    r->handle = 0;
    r->result = 0;
    r->bytes_kind = ~0u;
    r->bytes = 0;
    records.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    return 0;
}
