"""A tracker fed the records of the cases a simulated job rarely prints (tests/test_probe_json.py):
a communicator split mid-run and a failed creation inside a step, NCCL, runtime and driver errors,
runtime calls, a broadcast's root, grouped send/recv, collectives whose records come out of sequence
order, two timer streams, allocations, the launch histogram, Python and host sections, drops, GPU
arrival evidence with a first network send, a tail, and a tail with nothing traced but a section.

Written against the tracker's record inputs only, so the same feed ran on the tracker from before
RankStep was built directly and recorded what it printed (tests/data/probe-json-tracker-edge.jsonl).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

from argus.agent.identity import from_environ
from argus.agent.tracker import RankTracker
from argus.probes import libcudart, libnccl
from argus.probes.base import call_id
from argus.probes.records import (
    NCCL_F_IN_GROUP,
    RecCommInit,
    RecElapsed,
    RecFuncName,
    RecNccl,
    RecNetSend,
    RecSync,
)

assert libcudart.CHANNEL.name == "cudart"  # imported for its calls' ids (registered on import)
WALL = 1_796_000_000 * 10**9  # realtime - monotonic
ERR = 1234  # the clock offset's uncertainty
STREAM, NCCL_STREAM, SIDE = 0x55, 0x77, 0x66
COMM, CHILD, OTHER = 0xC0, 0xD0, 0xE0

Finalize = Callable[[RankTracker, int], List[Any]]
Tail = Callable[[RankTracker], Optional[Any]]


def _hdr(rec: Any, call: str, epoch: int, ts: int, tid: int = 7) -> Any:
    h = rec.h
    h.kind, h.tgid, h.tid, h.call, h.ts, h.epoch = 1, 7, tid, call_id(call), ts, epoch
    return rec


def _nccl(
    call: str, epoch: int, comm: int, seq: int, enter: int, count: int = 1024, peer: int = -1, flags: int = 0
) -> RecNccl:
    r = RecNccl(comm=comm, seq=seq, count=count, dtype=9, peer=peer, flags=flags, enter_ns=enter)
    r.stream = NCCL_STREAM
    r.pos = enter  # places on streams (BPF counts them) need only be in enqueue order
    return _hdr(r, call, epoch, enter + 5_000)


def _ms_bits(ms: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", ms))[0])


class Section:
    """A channel section as argus/agent/pysection.py's: per-epoch data in, one object per step out."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: Dict[int, int] = {}

    def add(self, epoch: int, ns: int) -> None:
        self.data[epoch] = self.data.get(epoch, 0) + ns

    def epochs(self) -> Set[int]:
        return set(self.data)

    def summarize(self, epochs: Sequence[int], timers: Iterable[Any] = ()) -> Optional[dict]:
        got = [self.data.pop(e) for e in epochs if e in self.data]
        if not got:
            return None
        ns = sum(got)
        if self.name == "host_cpu":
            return {"hz": 19, "on_cpu_ns": ns, "off_cpu_ns": 0, "threads": {}, "stacks": {"a;b": ns}}
        return {
            "version": 312,
            "hz": 99,
            "thread": 7,
            "phases": {"forward": ns, "backward": 2 * ns, "compile": 0},
            "samples": len(got),
            "offcpu_ns": 0,
            "stacks": {"train.py:step;model.py:forward": ns},
            "calls": {"forward": {"launches": 3, "sync": 1}},
            "gpu_phases": {"forward": len(list(timers))},
        }


def tracker(ns_pid: Optional[int] = 12) -> RankTracker:
    ident = from_environ(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "j1"}, 7, "h"
    )
    t = RankTracker(dataclasses.replace(ident, ns_pid=ns_pid), libnccl.CommLayout("table", 8, 16, 20))
    t.sections = [Section("python"), Section("host_cpu")]
    return t


def feed_epoch(t: RankTracker, e: int, split: bool = False, close: bool = True) -> None:
    """One sync interval of a training step: collectives (one group of send/recv), launches, timers,
    copies, errors, and the end-of-step sync (unless `close`: a tail's interval)."""
    base = 10_000_000 * (e + 1)
    seq = 100 + 6 * e
    for i in range(4):
        t.on_record(_nccl("ncclAllReduce", e, COMM, seq + i, base + 1_000 * i))
    t.on_record(_nccl("ncclBroadcast", e, COMM, seq + 4, base + 5_000, peer=2))
    t.add_call(e, call_id("ncclGroupStart"), 1)
    t.on_record(_nccl("ncclSend", e, COMM, 7 + e, base + 6_000, count=8, peer=4, flags=NCCL_F_IN_GROUP))
    t.on_record(_nccl("ncclRecv", e, COMM, 9 + e, base + 6_500, count=8, peer=2, flags=NCCL_F_IN_GROUP))
    end = RecNccl(comm=0, seq=0, count=0, dtype=0xFF, peer=-1, flags=0, enter_ns=base + 7_000)
    t.on_record(_hdr(end, "ncclGroupEnd", e, base + 90_000))
    t.on_record(_nccl("ncclAllReduce", e, COMM, seq + 5, base + 95_000))
    if split:  # a communicator split inside the step, and a creation that failed
        init = RecCommInit(comm=CHILD, parent=COMM, nranks=-1, rank=-1, color=1, result=0)
        init.comm_rank, init.comm_nranks = 1, 4
        t.on_record(_hdr(init, "ncclCommSplit", e, base + 100_000))
        bad = RecCommInit(comm=0, nranks=8, rank=3, result=5, comm_rank=-1, comm_nranks=-1)
        t.on_record(_hdr(bad, "ncclCommInitRank", e, base + 110_000))
    if CHILD in t.comms:  # its records reach the ring out of sequence order (two threads)
        t.on_record(_nccl("ncclAllGather", e, CHILD, 2 * e + 1, base + 130_000))
        t.on_record(_nccl("ncclAllGather", e, CHILD, 2 * e, base + 120_000))
    t.on_record(_hdr(RecNetSend(prev_ns=base - 20_000_000), "ncclNetSocketIsend", e, base + 140_000))
    for f, n in ((0xF1, 50), (0xF2, 3)):
        t.add_launches(e, f, n)
    t.add_hist(e, 10, 40)
    t.add_hist(e, 12, 2)
    t.add_mem(e, 0, 1, 4096)  # HtoD
    t.add_mem(e, 4, 1, 1 << 20)  # alloc
    t.add_error(e, call_id("cuEventQuery"), 600, 2)
    t.add_error(e, call_id("cudaMalloc"), 2, 1)
    t.add_error(e, call_id("ncclAllReduce"), 3, 1)
    t.add_call(e, call_id("cudaMalloc"), 4)
    t.add_call(e, call_id("ncclCommDestroy"), 1)
    # three event recordings: BPF counts them and keeps them for the records that refer to them
    t.add_call(e, call_id("cuEventRecord"), 3)
    marks = {
        0xE0: (STREAM, base + 10, base + 10),
        0xE1: (STREAM, base + 500, base + 500),
        0xE2: (SIDE, base + 600, base + 600),
    }
    for sec in t.sections:
        sec.add(e, 1_000 + e)
    if not close:
        return
    sync = RecSync(
        enter_ns=base + 500_000, handle=NCCL_STREAM, result=0, bytes_kind=0xFFFFFFFF, pos=base + 500_000
    )
    t.on_record(_hdr(sync, "cuStreamSynchronize", e, base + 900_000))
    for start, end_ev, ms in ((0xE0, 0xE1, 1.5), (0xE1, 0xE2, 0.25)):  # read after the step's sync
        (s0, p0, t0), (s1, p1, t1) = marks[start], marks[end_ev]
        el = RecElapsed(start_ev=start, end_ev=end_ev, ms_bits=_ms_bits(ms), start_stream=s0, start_pos=p0)
        el.start_ns, el.end_stream, el.end_pos, el.end_ns, el.end_epoch = t0, s1, p1, t1, e
        t.on_record(_hdr(el, "cuEventElapsedTime", e + 1, base + 950_000))


def run(finalize: Finalize, tail: Tail) -> List[Any]:
    """Every summary of the feed, in order."""
    t = tracker()
    t.on_record(_hdr(RecFuncName(func=0xF1, result=0, name=b"gemm"), "cuModuleGetFunction", 0, 11))
    uid = RecCommInit(comm=COMM, nranks=8, rank=3, result=0, comm_rank=-1, comm_nranks=-1, has_uid=1)
    uid.uid[:] = list(range(128))
    t.on_record(_hdr(uid, "ncclCommInitRank", 0, 10))
    out: List[Any] = []
    for e in range(12):
        feed_epoch(t, e, split=e == 5)
        if e == 5:
            out += finalize(t, 6)
            t.drops_total = {"ringbuf": 17, "aggregation map full": 2}
    out += finalize(t, 12)
    feed_epoch(t, 12, close=False)  # the process exits in the middle of a step
    out.append(tail(t))
    # a process attached late (its communicator never seen created: ordinal steps) whose last
    # interval holds only a section's samples: a tail with nothing traced (end 0, duration 0)
    t = tracker(ns_pid=None)
    for e in range(8):
        base = 10_000_000 * (e + 1)
        t.on_record(_nccl("ncclAllReduce", e, OTHER, 40 + e, base))
        sync = RecSync(
            enter_ns=base + 500_000, handle=NCCL_STREAM, result=0, bytes_kind=0xFFFFFFFF, pos=base + 500_000
        )
        t.on_record(_hdr(sync, "cuStreamSynchronize", e, base + 900_000))
    out += finalize(t, 8)
    t.sections[0].add(9, 500)  # type: ignore[attr-defined]
    out.append(tail(t))
    return out
