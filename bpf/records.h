/* Record and key layouts shared by BPF programs and user space (mirrored in
 * argus/probes/records.py; tests/test_layout.py checks both agree with what bcc compiled). */
#ifndef ARGUS_RECORDS_H
#define ARGUS_RECORDS_H

#define OFF_UNKNOWN 0xffffffffu

/* record kinds */
#define REC_SYNC 1
#define REC_FUNC_NAME 2
#define REC_EVENT_RECORD 3
#define REC_ELAPSED 4
#define REC_NCCL 5
#define REC_COMM_INIT 6

/* memory counter kinds */
#define MEM_HTOD 0
#define MEM_DTOH 1
#define MEM_DTOD 2
#define MEM_SET 3
#define MEM_ALLOC 4
#define MEM_FREE 5
#define MEM_FREE_UNKNOWN 6

/* drop counter slots */
#define DROP_RINGBUF 0
#define DROP_AGG 1
#define DROP_SCRATCH 2
#define DROP_SLOTS 4

/* Per target process, written by user space. */
struct target_cfg {
    u32 rank;
    u32 flags;
    u32 off_coll_opcount; /* offset of the communicator's collective counter, or OFF_UNKNOWN */
    u32 off_comm_hash;
    u32 off_comm_rank;
    u32 off_comm_nranks;
};

struct rec_hdr {
    u32 kind;
    u32 tgid;
    u32 tid;
    u32 call;
    u64 ts;    /* CLOCK_MONOTONIC ns, at the call's return (or entry for entry-only records) */
    u64 epoch; /* epoch the record belongs to; for REC_SYNC, the epoch it closes */
};

struct rec_sync {
    struct rec_hdr h;
    u64 enter_ns;
    u64 handle; /* stream or event; 0 for context-wide */
    s32 result;
    u32 bytes_kind; /* MEM_* for synchronous copies, else ~0 */
    u64 bytes;
};

struct rec_func_name {
    struct rec_hdr h;
    u64 func;
    s32 result;
    u32 pad;
    char name[128];
};

struct rec_event_record {
    struct rec_hdr h;
    u64 event;
    u64 stream;
};

struct rec_elapsed {
    struct rec_hdr h;
    u64 start_ev;
    u64 end_ev;
    u32 ms_bits; /* the float the caller received, bit for bit */
    s32 result;
};

struct rec_nccl {
    struct rec_hdr h;
    u64 comm;
    u64 seq;
    u64 count;
    u64 stream;
    u64 enter_ns;
    u32 dtype;
    s32 peer; /* root for broadcast/reduce, peer for send/recv, -1 otherwise */
    u32 redop;
    s32 result;
    u32 flags; /* NCCL_F_* */
    u32 pad;
};
#define NCCL_F_IN_GROUP 1
#define NCCL_F_SEQ_FROM_COMM 2 /* seq read from the communicator (global), not counted here */

struct rec_comm_init {
    struct rec_hdr h;
    u64 comm;
    u64 parent;
    u64 comm_hash; /* read from the new communicator when its layout is known, else 0 */
    s32 nranks;
    s32 rank;
    s32 color;
    s32 key;
    s32 result;
    s32 comm_rank;  /* read from the communicator when known, else -1 */
    s32 comm_nranks;
    u32 has_uid;
    u8 uid[128];
};

/* Aggregation keys. */
struct launch_key {
    u32 tgid;
    u32 pad;
    u64 epoch;
    u64 func;
};

struct hist_key {
    u32 tgid;
    u16 kind; /* HIST_* */
    u16 slot; /* log2 bucket */
    u64 epoch;
};
#define HIST_LAUNCH_NS 0

struct mem_key {
    u32 tgid;
    u32 kind; /* MEM_* */
    u64 epoch;
};

struct mem_val {
    u64 count;
    u64 bytes;
};

struct err_key {
    u32 tgid;
    u32 call;
    u64 epoch;
    s64 result;
};

/* In-flight calls (for hangs: entered, never returned). Key: tid << 1 | class. */
struct inflight {
    u32 tgid;
    u32 call;
    u64 enter_ns;
    u64 handle;
    u64 seq;
};

/* Entry -> return arguments, one per (thread, class): a call of one class never nests in another
 * of the same class, but NCCL calls may call into libcuda. */
struct scratch {
    u64 enter_ns;
    u64 a[6];
};
#define CLASS_CUDA 0
#define CLASS_NCCL 1

struct call_key {
    u32 tgid;
    u32 call;
    u64 epoch;
};

#endif
