"""When this process's GPU reached each collective, from calls the framework makes anyway.

A stock PyTorch job records no timers, and NCCL enqueues and returns, so the host's arrival at a
collective says nothing about its GPU's. What the host does show (docs/diagnosis.md "Which GPU
arrived last"):

* event recordings put marks on a stream, in the order the GPU passes them; `cuStreamWaitEvent`
  ties a stream's next work to a mark of another stream (PyTorch records one on the compute stream
  before every collective and makes the NCCL stream wait for it);
* the first successful `cuEventQuery` of a recording (a watchdog, a caching allocator) says the GPU
  had passed the mark by then, the failed query before it that it had not yet (one BPF record per
  recording, carrying it: argus/bpf/cuda.bpf.c); a stream or event sync's return says the same of
  every mark before it;
* the elapsed time read between the events recorded right before and after one collective
  (TORCH_NCCL_ENABLE_TIMING) is the time the GPU spent inside it: least on the rank that came last;
* NCCL's proxy posts a network send only once the kernel produced data: the first send after a
  step began bounds when the GPU reached the step's first network collective (argus/bpf/nccl.bpf.c).

Places count every stream operation of the process that BPF sees (recordings, waits, collectives,
syncs: argus.h `next_op`), so the few recordings the agent is told of (completed, waited for, timed)
still fall in order, with no record per recording; kernels launched in between are not counted,
which is why only a mark right before a collective bounds its start from above. Evidence comes in
after the step it is about (a recording completes at the next query), so `close_step` returns the
bounds of the step closed before.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

MAX_MARKS = 8192  # per stream: a few steps' worth at PyTorch's rates
MAX_WAITS = 64  # marks a stream waits for before its next collective
# Bounds per communicator and step at most: every n-th instance (the same ones on every member, which
# issue the same number). A straggler's GPU is late at every collective of the step, so 64 say what
# 3,240 would (tensor-parallel rates), at 1/50 of the agent's work and of the summary's bytes.
MAX_BOUNDS = 64
NEVER = 1 << 63
_BY_POS = operator.attrgetter("pos")
_BY_SEQ = operator.attrgetter("seq")
_PASSED = operator.attrgetter("passed")
_NOT_PASSED = operator.attrgetter("not_passed")
_UNKNOWN = (NEVER, "-")


@dataclass(slots=True)  # thousands made a second at tensor-parallel rates
class Mark:
    """A point of a stream the GPU passes: an event recording or a host sync of the stream."""

    stream: int
    pos: int  # its place among the process's stream operations (BPF counts them: argus.h next_op)
    ts: int  # host time of the recording (monotonic ns)
    not_passed: int = 0  # the GPU had not passed it at this time (0: unknown)
    passed: int = 0  # ... and had by this time (0: unknown)
    by_sync: bool = False


@dataclass(slots=True)
class _Coll:
    epoch: int
    comm: Any  # the communicator's key (CommInfo.key)
    seq: int
    stream: int
    pos: int
    after: int  # place of the stream's previous wait or collective, recorded or not (0: none)
    enter_ns: int
    waits: List[Mark]


@dataclass
class _Step:
    epochs: List[int]
    step: Optional[int]
    start_ns: int
    colls: List[_Coll] = field(default_factory=list)
    coll_gpu_ns: Dict[Any, List[int]] = field(default_factory=dict)
    # comm -> (first sequence number, collectives) in the step, counted by BPF (empty: not known)
    firsts: Dict[Any, Tuple[int, int]] = field(default_factory=dict)


class GpuArrival:
    """Per process: stream marks, the collectives on them, and the evidence that bounds them.

    Every input carries its place among the process's stream operations, counted in BPF, so a
    recording is learnt only when something refers to it (its completion, a wait for it, a timing
    read of it) and still falls in its place; one never referred to bounds nothing anyway."""

    def __init__(self) -> None:
        self.streams: Set[int] = set()
        self.marks: Dict[int, List[Mark]] = {}  # stream -> its known marks by place
        self.at: Dict[Tuple[int, int], Mark] = {}  # (stream, place) -> mark
        self.unsorted: Set[int] = set()  # streams whose marks came out of place order since the last step
        # stream -> (mark, the wait's place) it waits for before its next collective
        self.waits: Dict[int, List[Tuple[Mark, int]]] = {}
        self.colls: Dict[int, List[_Coll]] = {}  # epoch -> collectives enqueued in it
        self.barrier: Dict[int, int] = {}  # stream -> place of its latest wait or recorded collective
        self.coll_pos: Dict[int, Deque[Tuple[int, _Coll]]] = {}  # stream -> recent (place, collective)
        self.net: Dict[int, Tuple[int, int]] = {}  # epoch -> (its first network send, the send before)
        self.coll_gpu: Dict[int, Dict[Any, List[int]]] = {}  # epoch read in -> comm -> GPU ns
        self.pending: Optional[_Step] = None
        self.consumed_elapsed = 0
        self.sampled_streams: Set[int] = set()  # streams a collective was sampled out on (skip_pos)

    # ---- inputs (argus.agent.tracker feeds its records) ----------------------------------------------

    def _mark(self, stream: int, pos: int, ts: int) -> Mark:
        """The mark at `pos` of `stream`, made when first told of."""
        m = self.at.get((stream, pos))
        if m is not None:
            return m
        m = self.at[(stream, pos)] = Mark(stream, pos, ts)
        self.streams.add(stream)
        q = self.marks.get(stream)
        if q is None:
            q = self.marks[stream] = []
        if q and q[-1].pos > pos:
            self.unsorted.add(stream)  # told late (completions come in query order): sorted per step
        q.append(m)
        return m

    def on_event_done(
        self, stream: int, pos: int, rec_ns: int, not_ready_ns: int, ts: int, by_sync: bool = False
    ) -> None:
        """The GPU had passed the recording at `pos` of `stream` (made at `rec_ns`) by `ts`, and not
        by `not_ready_ns` (a failed query of it; 0: none)."""
        if not pos:
            return
        m = self._mark(stream, pos, rec_ns)
        if not_ready_ns and not_ready_ns >= m.ts:
            m.not_passed = max(m.not_passed, not_ready_ns)
        if not m.passed or ts < m.passed:
            m.passed, m.by_sync = ts, by_sync

    def on_stream_wait(
        self, stream: int, pos: int, mark_stream: int, mark_pos: int, mark_ns: int, ts: int = 0
    ) -> None:
        """`stream`'s next work waits (from place `pos`) for the recording at `mark_pos` of `mark_stream`."""
        self.streams.add(stream)
        if pos:
            self.barrier[stream] = pos
        if not mark_pos or mark_stream == stream:
            return
        w = self.waits.setdefault(stream, [])
        w.append((self._mark(mark_stream, mark_pos, mark_ns), pos))
        if len(w) > MAX_WAITS:  # a stream that waits and runs no collective (DDP's compute stream)
            del w[: len(w) - MAX_WAITS]

    def on_stream_sync(self, stream: int, pos: int, enter_ns: int, exit_ns: int) -> None:
        if not pos:
            return
        m = self._mark(stream, pos, enter_ns)
        m.passed, m.by_sync = exit_ns, True

    def on_ctx_sync(self, pos: int, enter_ns: int, exit_ns: int) -> None:
        for stream in list(self.streams):
            self.on_stream_sync(stream, pos, enter_ns, exit_ns)

    def on_collective(
        self, epoch: int, comm: Any, seq: int, stream: int, pos: int, enter_ns: int, skip_pos: int = 0
    ) -> None:
        """A recorded collective at place `pos`; the last of its communicator with no record before it
        (sampled: nccl.bpf.c) was at `skip_pos` (0: none)."""
        self.streams.add(stream)
        if skip_pos:
            self.sampled_streams.add(stream)
        after = max(self.barrier.get(stream, 0), skip_pos)
        self.barrier[stream] = pos
        # only waits after the stream's previous collective, recorded or not, are this one's
        waits = [m for m, wpos in self.waits.pop(stream, []) if wpos > skip_pos]
        c = _Coll(epoch, comm, seq, stream, pos, after, enter_ns, waits)
        self.colls.setdefault(epoch, []).append(c)
        q = self.coll_pos.get(stream)
        if q is None:
            q = self.coll_pos[stream] = deque(maxlen=MAX_MARKS)
        q.append((pos, c))

    def on_elapsed(
        self, start_stream: int, start_pos: int, end_stream: int, end_pos: int, ns: int, epoch: int
    ) -> bool:
        """True when the two recordings bracket exactly one collective on one stream (the time the
        GPU spent in it, not a framework timer): the caller then leaves it out of the timers."""
        q = self.coll_pos.get(start_stream)
        if not start_pos or not end_pos or start_stream != end_stream or not q:
            return False
        inside = [c for p, c in _between(q, start_pos, end_pos)]
        if not inside and start_stream in self.sampled_streams:
            # a collective stream whose collectives are sampled: the two recordings bracket one
            # that was not recorded (TORCH_NCCL_ENABLE_TIMING times every one), not a timer
            self.consumed_elapsed += 1
            return True
        if len(inside) != 1:
            return False
        self.coll_gpu.setdefault(epoch, {}).setdefault(inside[0].comm, []).append(ns)
        self.consumed_elapsed += 1
        return True

    def on_net_send(self, epoch: int, ts: int, prev_ns: int) -> None:
        if epoch not in self.net:
            self.net[epoch] = (ts, prev_ns)

    # ---- per step --------------------------------------------------------------------------------------

    def close_step(
        self,
        epochs: List[int],
        step: Optional[int],
        start_ns: int,
        colls: Optional[Dict[Any, Tuple[int, int]]] = None,
    ) -> Optional[Dict[str, Any]]:
        """Close a step (its epochs, its number, its start, monotonic ns; per communicator, the first
        sequence number of its collectives in the step and how many, when BPF counted them); return
        the previous step's evidence as the probe's `gpu_arrival` object, or None when there is none."""
        cur = _Step(list(epochs), step, start_ns, firsts=colls or {})
        for e in epochs:
            cur.colls += self.colls.pop(e, [])
            for comm, ts in self.coll_gpu.pop(e, {}).items():
                cur.coll_gpu_ns.setdefault(comm, []).extend(ts)
        prev, self.pending = self.pending, cur
        for s in self.unsorted:
            self.marks[s].sort(key=_BY_POS)  # nearly sorted: linear
        self.unsorted.clear()
        out = self._finish(prev, cur) if prev is not None else None
        # marks before the pending step began bound nothing of it (its collectives were enqueued
        # after); past MAX_MARKS a stream keeps its newest
        for q in self.marks.values():
            k = max(0, len(q) - MAX_MARKS)
            while k < len(q) and q[k].ts < start_ns:
                k += 1
            for m in q[:k]:
                self.at.pop((m.stream, m.pos), None)
            del q[:k]
        # what no step will claim: older epochs
        low = min(epochs, default=0)
        for d in (self.colls, self.net, self.coll_gpu):
            for e in [e for e in d if e < low]:
                del d[e]
        return out

    def _finish(self, st: _Step, nxt: _Step) -> Optional[Dict[str, Any]]:
        bounds: Dict[Any, List[List[Any]]] = {}
        indexed, count = _instance_index(st.colls, st.firsts)
        stride = {comm: -(-n // MAX_BOUNDS) for comm, n in count.items()}
        chosen = [(i, c) for i, c in indexed if not i % stride[c.comm]]
        # the streams the chosen collectives are on or wait for: tables of those only
        used = {c.stream for _, c in chosen} | {m.stream for _, c in chosen for m in c.waits}
        lo_tab = {s: _prefix_not_passed(q) for s, q in self.marks.items() if s in used}
        hi_tab = {s: _suffix_passed(q) for s, q in self.marks.items() if s in used}
        for i, c in chosen:
            if c.waits:
                # the collective waits for marks of other streams (PyTorch: the compute stream's
                # event before it): when the GPU's compute got there, however long the NCCL stream
                # was still busy with the collective before, is the arrival that names a straggler
                lo, lo_src = max(m.ts for m in c.waits), "h"
                hi, hi_src = 0, "-"
                for m in c.waits:
                    v = _lookup_lo(lo_tab.get(m.stream), m.pos)
                    if v > lo:
                        lo, lo_src = v, "q"
                    h, h_src = _lookup_passed(hi_tab.get(m.stream), m.pos)
                    if not h:  # one mark not known passed: nothing bounds them all
                        hi, hi_src = 0, "-"
                        break
                    if h > hi:
                        hi, hi_src = h, h_src
                # the NCCL stream reaching the collective implies all of them passed
                h, h_src = _lookup_hi(hi_tab.get(c.stream), c.pos, c.after)
                if h and (not hi or h < hi):
                    hi, hi_src = h, h_src
            else:
                lo, lo_src = c.enter_ns, "h"
                v = _lookup_lo(lo_tab.get(c.stream), c.pos - 1)
                if v > lo:
                    lo, lo_src = v, "q"
                hi, hi_src = _lookup_hi(hi_tab.get(c.stream), c.pos, c.after)
            if hi and hi < lo:  # clocks of one host: cannot be; keep what is certain
                hi, hi_src = 0, "-"
            bounds.setdefault(c.comm, []).append([i, lo, hi, lo_src + hi_src])
        # the step's first network send: the GPU reached its first network collective by then
        net_first = 0
        net = [self.net[e] for e in st.epochs if e in self.net]
        if net:
            ts, prev = min(net)
            if prev < st.start_ns:
                net_first = ts
        # in-collective GPU times of this step's collectives are read during the next step
        coll_gpu = nxt.coll_gpu_ns
        if not bounds and not net_first and not coll_gpu:
            return None
        out: Dict[str, Any] = {"step": st.step}
        if bounds:
            out["bounds"] = {str(k): v for k, v in bounds.items()}
        if net_first:
            out["net_first_ns"] = net_first
        if coll_gpu:
            out["coll_gpu_ns"] = {str(k): v for k, v in coll_gpu.items()}
        return out


def _instance_index(
    colls: List[_Coll], firsts: Dict[Any, Tuple[int, int]]
) -> Tuple[List[Tuple[int, _Coll]], Dict[Any, int]]:
    """(index, collective) for each recorded collective, by communicator in order of their first
    record: its index among its communicator's in the step (its position: the same on every member
    whichever were recorded); and each communicator's count. Both from its first sequence number and
    count in the step where BPF counted them, else by order of the records."""
    per: Dict[Any, List[_Coll]] = {}
    for c in colls:
        per.setdefault(c.comm, []).append(c)
    out: List[Tuple[int, _Coll]] = []
    count: Dict[Any, int] = {}
    for comm, cs in per.items():
        known = firsts.get(comm)
        if known is not None:
            first, count[comm] = known
            out += [(c.seq - first, c) for c in cs]
        else:
            count[comm] = len(cs)
            order = {id(c): i for i, c in enumerate(sorted(cs, key=_BY_SEQ))}
            out += [(order[id(c)], c) for c in cs]  # (in record order, as the bounds are listed)
    return out, count


def _between(q: Deque[Tuple[int, _Coll]], a: int, b: int) -> List[Tuple[int, _Coll]]:
    """The collectives of a stream strictly between positions a and b (newest last)."""
    out = []
    for p, c in reversed(q):
        if p <= a:
            break
        if p < b:
            out.append((p, c))
    return out


# per stream, marks by position: positions ascending, the running bound at each, its source, and
# the mark's own time passed
_Table = Tuple[List[int], List[int], List[str], List[int]]


def _prefix_not_passed(q: List[Mark]) -> Tuple[List[int], List[int]]:
    """Latest time the GPU had surely not passed position p: the max over marks at or before p.
    (Built per step over a few steps' marks: C-level passes, not a Python loop per mark.)"""
    return list(map(_BY_POS, q)), list(accumulate(map(_NOT_PASSED, q), max))


def _suffix_passed(q: List[Mark]) -> _Table:
    """Earliest time the GPU had surely passed position p: the min over marks at or after p."""
    own = list(map(_PASSED, q))
    keyed = [(t, "s" if m.by_sync else "q") if t else _UNKNOWN for t, m in zip(own, q)]
    best = list(accumulate(reversed(keyed), min))
    best.reverse()
    val = [0 if t == NEVER else t for t, _ in best]
    src = [h for _, h in best]
    return list(map(_BY_POS, q)), val, src, own


def _lookup_lo(tab: Optional[Tuple[List[int], List[int]]], p: int) -> int:
    if not tab or p < 0:
        return 0
    pos, val = tab
    k = bisect.bisect_right(pos, p) - 1
    return val[k] if k >= 0 else 0


def _lookup_passed(tab: Optional[_Table], p: int) -> Tuple[int, str]:
    """Earliest time the GPU had surely passed the mark at position p (a mark at or after it passed)."""
    if not tab:
        return 0, "-"
    pos, val, src, _own = tab
    k = bisect.bisect_left(pos, p)
    if k < len(pos) and val[k]:
        return val[k], src[k]
    return 0, "-"


def _lookup_hi(tab: Optional[_Table], cpos: int, after: int) -> Tuple[int, str]:
    """Upper bound on when the stream reached the collective at `cpos`: the last mark before it,
    when nothing we know of lies between (it comes after the stream's last wait), passed: tight;
    anything after it passed: the collective had ended by then (loose: 'e', or 's' for a sync)."""
    if not tab:
        return 0, "-"
    pos, val, src, own = tab
    k = bisect.bisect_left(pos, cpos) - 1
    if k >= 0 and pos[k] > after and val[k]:
        tight = own[k] == val[k]
        return val[k], src[k] if tight else ("e" if src[k] == "q" else src[k])
    k = bisect.bisect_left(pos, cpos)
    if k < len(pos) and val[k]:
        return val[k], "e" if src[k] == "q" else src[k]
    return 0, "-"
