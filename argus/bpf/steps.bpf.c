/* Step marker (--step-fn): every call of the user's step function ends the previous step. It acts
 * like a host sync: it closes the process's epoch and leaves a record of when. In every compile
 * unit (argus/agent/bpfprog.py), whichever channels are on. */

#include "helpers.h"

int step_marker_entry(struct pt_regs *ctx) {
    u32 tgid;
    if (!target(&tgid)) return 0;
    u64 epoch = close_epoch(tgid);
    struct rec_sync *r = RECORD(rec_sync, REC_SYNC, CALL_step_marker, epoch);
    if (!r) return 0;
    r->enter_ns = r->h.ts;
    r->handle = 0;
    r->result = 0;
    r->bytes_kind = ~0u;
    r->bytes = 0;
    record_submit(r);
    return 0;
}
