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
#define MEM_LAUNCH_WAIT 7 /* not memory: launches that waited for a full launch queue (ns) */

/* drop counter slots */
#define DROP_RINGBUF 0
#define DROP_AGG 1
#define DROP_SCRATCH 2
#define DROP_SLOTS 4

/* Per target process, written by user space. */
struct target_cfg {
    u32 rank;
    u32 flags;
    u32 off_comm_hash; /* struct ncclComm offsets, or OFF_UNKNOWN (argus/probes/nccl_layout.py) */
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
    u64 pos; /* the process's stream-operation count at entry (argus.h next_op; 0: not counted) */
};

struct rec_func_name {
    struct rec_hdr h;
    u64 func;
    s32 result;
    u32 pad;
    char name[128];
};

/* `argus record` only: the agent learns a recording when it is queried, waited for or timed
 * (rec_event_done, rec_stream_wait, rec_elapsed carry it), not from a record per recording. */
struct rec_event_record {
    struct rec_hdr h;
    u64 event;
    u64 stream;
    u64 pos;
};

struct rec_elapsed {
    struct rec_hdr h;
    u64 start_ev;
    u64 end_ev;
    u32 ms_bits; /* the float the caller received, bit for bit */
    s32 result;
    /* the two events' latest recordings at the read (pos 0: recorded before we attached) */
    u64 start_stream;
    u64 start_pos;
    u64 start_ns;
    u64 end_stream;
    u64 end_pos;
    u64 end_ns;
    u64 end_epoch;
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
    u32 skipped;  /* collectives of this communicator not recorded since its previous record */
    u64 pos;      /* the process's stream-operation count at entry (argus.h next_op) */
    u64 skip_pos; /* ... of the last of those (0: none) */
};
#define NCCL_F_IN_GROUP 1

/* Which collectives of a communicator get a record (nccl.bpf.c `coll_sample`, set by the agent
 * once it knows the communicator's collectives per step): those whose sequence number is
 * `phase` mod `stride`; the others are only summed (`colls`). */
struct sample_key {
    u32 tgid;
    u32 pad;
    u64 comm;
};

struct sample_val {
    u64 stride;
    u64 phase;
    u64 skipped;
    u64 last_seq; /* of the communicator's latest collective, recorded or not (hangs: who is behind) */
    u64 skip_pos;
};

struct rec_comm_init {
    struct rec_hdr h;
    u64 comm;
    u64 parent;
    u64 comm_hash; /* read from the new communicator when a table row gives its offset, else 0 */
    s32 nranks;
    s32 rank;
    s32 color;
    s32 key;
    s32 result;
    s32 comm_rank;  /* read from the communicator when its offset is known, else -1 */
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

/* Every NCCL operation, summed per (process, epoch, communicator handle, call, datatype) in BPF
 * (nccl.bpf.c `colls`): what the step's signature and per-op totals need, exact even when ring
 * records are lost (a record per operation is what diagnosis of instances needs, not counting). */
struct coll_key {
    u32 tgid;
    u32 call;
    u64 epoch;
    u64 comm;
    u32 dtype;
    u32 pad;
};

struct coll_val {
    u64 count;
    u64 elems;       /* count argument summed (x datatype size: bytes) */
    u64 host_ns;     /* enter -> return, summed */
    u64 first_seq;   /* of the first seen in the epoch (sequence numbers: nccl.bpf.c) */
    u64 first_enter; /* monotonic ns */
    u64 last_exit;
};

/* ---- Python, host and record-mode layouts (bpf/python.bpf.c, bpf/host.bpf.c) -------------------- */

#define REC_PY_MARK 7   /* a Python stack walked at a native CUDA/NCCL call */
#define REC_PY_SAMPLE 8 /* record mode: one on-CPU sample */
#define REC_OFFCPU 9    /* record mode: one off-CPU span */
#define REC_PY_CALL 10  /* precise mode: one call of a selected Python function, at its return */
#define REC_CALL 11     /* record mode: one CUDA call (launch, copy, result-only call) */
#define REC_GC 12       /* record mode: one garbage collection */
#define REC_STREAM_WAIT 13 /* cuStreamWaitEvent: a stream waits for an event (GPU-arrival evidence) */
#define REC_EVENT_DONE 14  /* the first successful cuEventQuery since the event was recorded */
#define REC_NET_SEND 15    /* the first network send of NCCL's proxy in an epoch */

#define PY_MAX_FRAMES 96
#define PY_FRAME_READ 72 /* bytes read per frame: every field the walk uses lies in them */
#define PY_F_TRUNCATED 1

#define PROF_ONCPU 0
#define PROF_OFFCPU 1

/* How native hits walk the Python stack (py_native_hit). */
#define PY_HIT_ALWAYS 0 /* host syncs: a few per step */
#define PY_HIT_LAUNCH 1 /* launches: every ARGUS_PY_LAUNCH_EVERY-th per thread, and the first after
                           an event record */
#define PY_HIT_EVENT 2  /* cuEventRecord: no walk; forces one at the thread's next launch, whose
                           record counts it (rec_py_mark.events) */
#define PY_HIT_COLL 3   /* collectives: every ARGUS_PY_COLL_EVERY-th per thread, weighted */

/* Where a USDT argument lives (parsed from the stapsdt note by user space). */
struct usdt_arg {
    u8 kind; /* USDT_ARG_* */
    u8 reg;  /* word index into struct pt_regs */
    u8 size; /* bytes, 1..8 */
    u8 is_signed;
    s32 offset; /* for USDT_ARG_MEM: reg + offset; for USDT_ARG_CONST: the value */
};
#define USDT_ARG_NONE 0
#define USDT_ARG_REG 1
#define USDT_ARG_MEM 2
#define USDT_ARG_CONST 3

/* Per target Python process, written by user space from the interpreter's offset table. */
struct py_cfg {
    u32 version;          /* major << 8 | minor */
    u32 flags;
    u32 off_tstate_frame; /* PyThreadState: the current frame, or the _PyCFrame pointer (3.11, 3.12) */
    u32 off_cframe_frame; /* _PyCFrame.current_frame, or OFF_UNKNOWN */
    u32 off_frame_code;   /* frame: code object (f_code, f_executable) */
    u32 off_frame_back;   /* frame: the caller's frame (f_back, previous) */
    u32 off_frame_owner;  /* frame: owner byte, OFF_UNKNOWN before 3.12 (no C-stack shim frames) */
    u32 pad;
    struct usdt_arg gc_start_gen; /* python:gc__start(int generation) */
    struct usdt_arg gc_done_collected; /* python:gc__done(Py_ssize_t collected) */
};

/* A walked Python stack: code object addresses, innermost first. */
struct py_stack {
    u32 depth;
    u32 flags; /* PY_F_* */
    u64 code[PY_MAX_FRAMES];
};

/* On-CPU samples and off-CPU time per (thread, epoch, stack). Python keys use `stack`; host keys
 * use `ustack`/`kstack` (ids in the stack-trace map, negative when unavailable). */
struct prof_key {
    u32 tgid;
    u32 tid;
    u64 epoch;
    u64 stack;
    s32 ustack;
    s32 kstack;
    u32 kind; /* PROF_* */
    u32 pad;
};

struct prof_val {
    u64 count;
    u64 ns;
};

struct gc_key {
    u32 tgid;
    s32 gen;
    u64 epoch;
};

/* Launches and collectives whose Python stack was not walked (a walk of the thread's was too
 * recent: python.bpf.c), counted to the stack of that walk: (process, call, epoch, stack) -> calls */
struct py_owed_key {
    u32 tgid;
    u32 call;
    u64 epoch;
    u64 stack;
};

struct gc_val {
    u64 count;
    u64 ns;
    u64 max_ns;
    s64 collected;
};

struct rec_py_mark {
    struct rec_hdr h; /* call: the native call */
    u64 stack;
    u64 aux;    /* the event of cuEventRecord, the communicator of a collective, else 0 */
    u32 weight; /* calls this walk stands for */
    u32 events; /* the thread's event recordings since its previous walk (not walked themselves) */
};

struct rec_py_sample {
    struct rec_hdr h;
    u64 stack;
    s32 ustack;
    s32 kstack;
};

struct rec_offcpu {
    struct rec_hdr h; /* ts: when the thread ran again */
    u64 start_ns;
    u64 stack;
    s32 ustack;
    s32 kstack;
};

struct rec_py_call {
    struct rec_hdr h; /* ts: return */
    u64 code;
    u64 enter_ns;
};

struct rec_call {
    struct rec_hdr h; /* ts: return (or entry for entry-only calls) */
    u64 enter_ns;
    u64 arg; /* CUfunction for launches, bytes for copies */
    u64 stream;
};

struct rec_gc {
    struct rec_hdr h;
    u64 start_ns;
    s64 collected;
    s32 generation;
    u32 pad;
};

/* GPU-arrival evidence (docs/diagnosis.md "Which GPU arrived last"). */
struct rec_stream_wait {
    struct rec_hdr h; /* ts: entry */
    u64 stream;
    u64 event;
    u64 pos;        /* the wait's own place (argus.h next_op) */
    u64 mark_stream; /* the event's latest recording: its stream, place (0: unknown) and time */
    u64 mark_pos;
    u64 mark_ns;
};

struct rec_event_done {
    struct rec_hdr h; /* ts: return of the query (or event sync) that found the event complete */
    u64 event;
    u64 not_ready_ns; /* entry of the last query that found it not complete, 0 if none */
    u64 stream;       /* the recording: its stream, place and time */
    u64 pos;
    u64 rec_ns;
    u32 by_sync; /* found by cuEventSynchronize's return, not a query */
    u32 pad;
};

struct rec_net_send {
    struct rec_hdr h; /* ts: entry of the send; tid: the proxy thread */
    u64 prev_ns;      /* entry of this process's send before it (any epoch), 0 if none */
    u64 pad;
};

#endif
