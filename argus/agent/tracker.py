"""Per-process state of `argus probe`: records and per-epoch aggregates in, step summaries out.

Pure: it never touches BPF, so it is tested by feeding records. The session feeds ring-buffer
records as they arrive (`on_record`) and drained map contents (`add_*`), then calls
`finalize_steps(final_before)` once every epoch below `final_before` is complete: RankSteps with
their probe detail (argus.schema; `to_probe_json` is what `--json` prints).
"""

from __future__ import annotations

import functools
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from argus.agent.gpuarrive import GpuArrival
from argus.agent.identity import Identity
from argus.agent.steps import EpochSig, StepDetector
from argus.probes import libcuda, libnccl
from argus.probes.base import P2P, call_channel, call_id, call_name
from argus.probes.records import (
    NCCL_F_IN_GROUP,
    RecCommInit,
    RecElapsed,
    RecEventDone,
    RecFuncName,
    RecNccl,
    RecNetSend,
    Record,
    RecStreamWait,
    RecSync,
)
from argus.probes.stepfn import STEP_MARKER
from argus.schema import (
    MEMCPY_KINDS,
    CudaDetail,
    ProbeDetail,
    RankStep,
    StepPeriod,
    Timer,
    errors_from_probe,
    gpu_arrival_from_probe,
    nccl_from_probe,
    python_phases,
    step_phases,
    stream_ordinals,
    to_probe_json,
)

FNV_OFFSET = 0xCBF29CE484222325
MAX_PENDING_EPOCHS = 4096
# collective records kept per epoch at most. An epoch that never closes (no host sync: a job that
# never syncs, or `--no-cuda`) kept every record for as long as the agent ran (400 MB in a minute at
# tensor-parallel rates); past this the records are counted as not kept (the step's sums stay exact)
MAX_EPOCH_RECORDS = 1 << 17
# An epoch still open at 8 x --coll-records collective records has its busy communicators sampled,
# 8 x sparser at 64 x (RankTracker._sample_open_epoch)
OPEN_EPOCH_MARK = 8
NOT_KEPT = "records kept per epoch (limit)"
_STEP_MARKER = call_id(STEP_MARKER)
GROUP_END = call_id("ncclGroupEnd")
_STREAM_SYNC = call_id("cuStreamSynchronize")
_CTX_SYNC = call_id("cuCtxSynchronize")
_EVENT_RECORD = call_id("cuEventRecord")


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# Where a communicator's identity came from. The first three give a key every rank of the
# communicator shares; the last two a key of this process only (its handle), which the aggregator
# maps onto the job's communicators by size, call signature and step time.
SHARED_IDENTITIES = ("table", "init", "split")
MAX_NRANKS = 1 << 20
#: per process: kernel names and CUDA events remembered. A JIT that loads kernels without end, or a
#: process that creates events and never reuses them, must not grow the agent without bound: past
#: this the oldest are forgotten (a forgotten kernel is named by its address, `fn@0x...`)
MAX_REMEMBERED = 1 << 16


def _remember(d: Dict[int, Any], key: int, value: Any) -> None:
    if key not in d and len(d) >= MAX_REMEMBERED:
        del d[next(iter(d))]  # dicts keep insertion order: the oldest goes
    d[key] = value


@dataclass
class CommInfo:
    hash: int
    nranks: int  # -1 when unknown
    rank: int
    # table (commHash read through a validated layout) | init (seen created: unique id hash) |
    # split (seen split from a shared parent) | accessors (rank/nRanks read, local key) |
    # inferred (nothing known, local key)
    source: str
    created: bool = False  # seen created: its sequence numbers count from its first collective

    @functools.cached_property
    def key(self) -> str:  # cached: read for every collective of every summary
        return f"{self.hash:016x}"

    @property
    def shared(self) -> bool:
        return self.source in SHARED_IDENTITIES


@dataclass
class EpochData:
    launches: Counter = field(default_factory=Counter)  # CUfunction -> count
    launch_hist: Counter = field(default_factory=Counter)  # log2(ns) -> count
    mem: Dict[int, List[int]] = field(default_factory=dict)  # MEM kind -> [count, bytes]
    errors: Counter = field(default_factory=Counter)  # (call, result) -> count
    calls: Counter = field(default_factory=Counter)  # call -> count
    sync: Optional[RecSync] = None
    nccl: List[RecNccl] = field(default_factory=list)
    group_ends: List[RecNccl] = field(default_factory=list)  # outermost ncclGroupEnd calls
    elapsed: List[RecElapsed] = field(default_factory=list)
    inits: List[RecCommInit] = field(default_factory=list)
    # BPF's sums of the epoch's NCCL operations (nccl.bpf.c `colls`):
    # (comm handle, call, datatype) -> [count, elements, host ns, first seq, first enter, last exit]
    colls: Dict[Tuple[int, int, int], List[int]] = field(default_factory=dict)


P2P_CALLS = frozenset(call_id(s.symbol) for s in libnccl.SPECS if s.cls == P2P)
_DTYPE_SIZE = dict(enumerate(libnccl.DTYPE_SIZES))


@functools.cache
def _op_of(call: int) -> str:
    """The collective an NCCL call id stands for (AllReduce, Send, ...), else its name."""
    name = call_name(call)
    return libnccl.OPS.get(name, name)


def _add_group_waits(grouped: List[Tuple[int, int, list]], ends: List[RecNccl]) -> None:
    """Each outermost ncclGroupEnd's time past its group's last posted operation becomes that
    operation's host time (arrival[5]): where operations block, the group's wait for its peers is
    spent there, not in the ncclSend/ncclRecv that posted them (else it would look like the rank's
    own host time)."""
    taken: Set[int] = set()
    for g in sorted(ends, key=lambda x: x.enter_ns):
        ops = [a for a in grouped if a[0] == g.h.tid and a[1] <= g.enter_ns and id(a[2]) not in taken]
        if not ops:
            continue
        taken.update(id(a[2]) for a in ops)
        last = max(ops, key=lambda a: a[1])[2]
        posted = max(a[2][4] + a[2][5] for a in ops)
        last[5] += max(0, g.h.ts - max(posted, g.enter_ns))


def _add_op(ops: Dict[str, Dict[str, int]], op: str, count: int, nbytes: int, host_ns: int) -> None:
    """`nccl.ops[op]` of a summary: `count` more operations of `nbytes` and `host_ns` in all."""
    o = ops.get(op)
    if o is None:
        o = ops[op] = {"count": 0, "bytes": 0, "host_ns": 0}
    o["count"] += count
    o["bytes"] += nbytes
    o["host_ns"] += host_ns


def _comm_entry(comms: Dict[str, dict], info: CommInfo, seq: int) -> dict:
    """`nccl.comms[key]` of a summary, made at its first operation (sequence number `seq`)."""
    cm = comms.get(info.key)
    if cm is None:
        cm = comms[info.key] = {
            "nranks": info.nranks,
            "rank": info.rank,
            "identity": info.source,
            "ops": 0,
            "first_seq": seq,
            "last_seq": seq,
        }
    return cm


def _ms(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class _Cuda(NamedTuple):
    """The driver channel's part of a step: RankStep fields and the probe's detail."""

    kernels: Dict[str, int]
    memcpy: Dict[str, Tuple[int, int]]
    errors: Dict[str, Dict[int, int]]
    detail: CudaDetail
    launch_wait_ns: int  # launches that waited for a full launch queue


class RankTracker:
    def __init__(
        self,
        identity: Identity,
        layout: libnccl.CommLayout = libnccl.UNKNOWN_LAYOUT,
        read_mem: Optional[Callable[[int, int], Optional[bytes]]] = None,
        step_fn: bool = False,
        coll_records: int = 0,
    ) -> None:
        self.id = identity
        self.layout = layout
        self.read_mem = read_mem
        self.epochs: Dict[int, EpochData] = {}
        self.func_names: Dict[int, str] = {}
        self.comms: Dict[int, CommInfo] = {}
        self.called: Set[int] = set()  # communicator handles seen created or in a call
        self.identity_errors = 0  # communicator fields read from the process that made no sense
        self.split_counts: Counter = Counter()
        self.last_seq: Dict[str, int] = {}  # comm id -> last collective sequence number entered
        self.last_step: Optional[int] = None
        self.detector = StepDetector(step_fn=step_fn)
        self.next_epoch = 0  # first epoch not yet given to the detector
        self.queue: List[int] = []  # epochs given to the detector, not yet cut into steps
        self.last_boundary: Optional[int] = None
        self.last_boundary_sync: Optional[RecSync] = None
        self.ordinal = 0
        self.unassigned_epochs = 0
        # what was traced but falls in no step: the partial step before the first boundary, epochs
        # given up while no step period was found ({"epochs", "launches", "collectives"})
        self.left_out: Counter = Counter()
        self.records_seen = 0
        self.decode_errors = 0
        self.steps_emitted = 0
        self.drops_total: Dict[str, int] = {}  # BPF drop counters of this process (Session.drain)
        self._sigs: Dict[int, EpochSig] = {}  # closed epochs' signatures (_sig)
        self._drops_said: Dict[str, int] = {}  # ... as of its previous summary
        # extra per-step sections (python, host: argus/agent/pysection.py), each with
        # epochs() and summarize(epochs, timers) -> Optional[dict]
        self.sections: List[Any] = []
        self.arrive = GpuArrival()  # when the GPU reached each collective (argus/agent/gpuarrive.py)
        # BPF sums the NCCL operations per epoch (add_colls): the steps' signatures come from those
        # sums, exact when ring records are lost; fed records alone (the unit tests), from records
        self.has_coll_sums = False
        # at most this many collective records per communicator and step (0: all): past it BPF
        # records every n-th (sample_wanted), and counts, bytes and host time come from the sums
        self.coll_records = coll_records
        self.sampled: Dict[int, Tuple[int, int]] = {}  # comm handle -> (stride, phase) asked of BPF
        self._sample_new: List[Tuple[int, int, int]] = []  # (handle, stride, phase) not yet in BPF
        self._coll_n: Dict[int, int] = {}  # comm handle -> its collectives in the previous step
        self._provisional: Set[int] = set()  # sampled before steps were cut: phase not aligned yet
        # an open epoch's record counts at which its busy communicators are sampled (more sparsely)
        k = coll_records
        self._open_marks = {OPEN_EPOCH_MARK * k, OPEN_EPOCH_MARK**2 * k} if k > 0 else set()

    def epoch(self, e: int) -> EpochData:
        d = self.epochs.get(e)
        if d is None:
            d = self.epochs[e] = EpochData()
        return d

    # ---- inputs --------------------------------------------------------------------------------------

    def on_record(self, r: Record) -> None:
        self.records_seen += 1
        if type(r) is RecEventDone:  # the most frequent at PyTorch's rates (its events' completions)
            self.arrive.on_event_done(r.stream, r.pos, r.rec_ns, r.not_ready_ns, r.h.ts, bool(r.by_sync))
        elif type(r) is RecNccl:  # then collectives: lean
            h = r.h
            if h.call == GROUP_END:
                if not r.flags & NCCL_F_IN_GROUP:  # the outermost: where a group's operations ran
                    self.epoch(h.epoch).group_ends.append(r)
                return
            kept = self.epoch(h.epoch).nccl
            if len(kept) >= MAX_EPOCH_RECORDS:
                self.drops_total[NOT_KEPT] = self.drops_total.get(NOT_KEPT, 0) + 1
                return
            kept.append(r)
            if len(kept) in self._open_marks:
                self._sample_open_epoch(kept)
            comm = r.comm
            self.called.add(comm)
            info = self.comms.get(comm)
            if info is None and comm:
                self._identify(comm)
                info = self.comms.get(comm)
            if info is not None and h.call not in P2P_CALLS:
                key = info.key
                if r.seq > self.last_seq.get(key, -1):
                    self.last_seq[key] = r.seq
                self.arrive.on_collective(h.epoch, key, r.seq, r.stream, r.pos, r.enter_ns, r.skip_pos)
        elif isinstance(r, RecSync):
            self.epoch(r.h.epoch).sync = r
            call = r.h.call
            if call == _STREAM_SYNC:
                self.arrive.on_stream_sync(r.handle, r.pos, r.enter_ns, r.h.ts)
            elif call == _CTX_SYNC:
                self.arrive.on_ctx_sync(r.pos, r.enter_ns, r.h.ts)
            # (an event sync's completion comes as a RecEventDone: argus/bpf/cuda.bpf.c)
        elif type(r) is RecStreamWait:
            self.arrive.on_stream_wait(r.stream, r.pos, r.mark_stream, r.mark_pos, r.mark_ns, r.h.ts)
        elif isinstance(r, RecNetSend):
            self.arrive.on_net_send(r.h.epoch, r.h.ts, r.prev_ns)
        elif isinstance(r, RecElapsed):
            if r.result == 0 and self.arrive.on_elapsed(
                r.start_stream, r.start_pos, r.end_stream, r.end_pos, round(_ms(r.ms_bits) * 1e6), r.h.epoch
            ):
                return  # the GPU time of one collective (TORCH_NCCL_ENABLE_TIMING), not a timer
            # A timer belongs to the step whose GPU work it measures: the epoch its end event was
            # recorded in (frameworks read timers after the step's sync, or steps later).
            e = r.end_epoch if r.end_pos else r.h.epoch
            if self.last_boundary is not None and e <= self.last_boundary:
                e = r.h.epoch  # that step is already out
            self.epoch(e).elapsed.append(r)
        # RecEventRecord (`argus record` only) adds nothing here: the records above carry the
        # recordings they refer to, and BPF counts them (call_counts)
        elif isinstance(r, RecFuncName):
            if r.result == 0 and r.func:
                _remember(self.func_names, r.func, r.name.decode(errors="replace"))
        elif isinstance(r, RecCommInit):
            self.epoch(r.h.epoch).inits.append(r)
            self._on_comm_init(r)

    def add_launches(self, epoch: int, func: int, count: int) -> None:
        self.epoch(epoch).launches[func] += count

    def add_hist(self, epoch: int, slot: int, count: int) -> None:
        self.epoch(epoch).launch_hist[slot] += count

    def add_mem(self, epoch: int, kind: int, count: int, nbytes: int) -> None:
        m = self.epoch(epoch).mem.setdefault(kind, [0, 0])
        m[0] += count
        m[1] += nbytes

    def add_error(self, epoch: int, call: int, result: int, count: int) -> None:
        self.epoch(epoch).errors[(call, result)] += count

    def add_call(self, epoch: int, call: int, count: int) -> None:
        self.epoch(epoch).calls[call] += count

    def add_sync(self, epoch: int, v: Any) -> None:
        """The sync that closed `epoch`, kept in BPF (cuda.bpf.c `epoch_syncs`): the same as its ring
        record, which a full ring may have lost -- and every step boundary with it."""
        d = self.epoch(epoch)
        if d.sync is None:
            self.on_record(RecSync.from_buffer_copy(bytes(v)))

    def add_colls(self, k: Any, v: Any) -> None:
        """BPF's sums of one (epoch, communicator, call, datatype) (records.CollKey/CollVal)."""
        self.has_coll_sums = True
        comm = k.comm
        if comm and comm not in self.comms:
            self._identify(comm)  # its records may all have been lost
        self.epoch(k.epoch).colls[(comm, k.call, k.dtype)] = [
            v.count,
            v.elems,
            v.host_ns,
            v.first_seq,
            v.first_enter,
            v.last_exit,
        ]

    # ---- communicators -------------------------------------------------------------------------------

    def _on_comm_init(self, r: RecCommInit) -> None:
        if r.result != 0 or not r.comm:
            return
        name = call_name(r.h.call)
        nranks, rank = r.nranks, r.rank
        if 0 <= r.comm_rank < r.comm_nranks <= MAX_NRANKS:  # read through the layout at return
            nranks, rank = r.comm_nranks, r.comm_rank
        if name == "ncclCommSplit":
            nranks = r.comm_nranks if 0 <= r.comm_rank < r.comm_nranks <= MAX_NRANKS else -1
            rank = r.comm_rank if nranks > 0 else -1
        if r.comm_hash:
            info = CommInfo(r.comm_hash, nranks, rank, "table", True)
        elif r.has_uid:
            info = CommInfo(fnv1a64(bytes(r.uid)), nranks, rank, "init", True)
        elif name == "ncclCommSplit" and r.parent in self.comms and self.comms[r.parent].shared:
            # ranks of the parent split in the same order: (parent, split index, color) names the child
            seq = self.split_counts[r.parent]
            h = fnv1a64(self.comms[r.parent].hash.to_bytes(8, "little"))
            h = fnv1a64(seq.to_bytes(8, "little"), h)
            h = fnv1a64(r.color.to_bytes(8, "little", signed=True), h)
            info = CommInfo(h, nranks, rank, "split", True)
        else:
            info = CommInfo(r.comm, nranks, rank, "accessors" if nranks > 0 else "inferred", True)
        if name == "ncclCommSplit":
            self.split_counts[r.parent] += 1
        self.comms[r.comm] = info
        self.called.add(r.comm)

    def world_communicator(self) -> Optional[CommInfo]:
        """The largest communicator whose rank and size are known: the job's world, usually. Only
        handles the process created or called NCCL with: a stack word taken for one at attach
        (is_comm) may be another object whose bytes happen to make sense."""
        known = [c for h, c in self.comms.items() if h in self.called and 0 <= c.rank < c.nranks]
        return max(known, key=lambda c: c.nranks, default=None)

    def is_comm(self, addr: int) -> bool:
        """Whether `addr` looks like a communicator of this build (its rank and nRanks, read through
        the layout, make sense; with a table row, a commHash too). Identifies it when so."""
        if addr in self.comms:
            return True
        if not self.layout.has_ranks:
            return False
        before = self.identity_errors
        self._identify(addr)
        info = self.comms[addr]
        self.identity_errors = before  # a stack word that is not a communicator is no error
        if info.source == "inferred" or (self.layout.has_hash and info.source != "table"):
            del self.comms[addr]
            return False
        return True

    def _identify(self, comm: int) -> None:
        """A communicator created before we attached: read what the layout of this build gives
        (commHash, rank, nRanks through a validated table row; rank and nRanks through the decoded
        accessors), checked for sense; else it is known by its handle until the aggregator matches it."""
        lay = self.layout
        info = CommInfo(comm, -1, -1, "inferred")
        if lay.has_ranks and self.read_mem is not None:
            offs = [lay.rank, lay.nranks] + ([lay.comm_hash] if lay.has_hash else [])
            lo, hi = min(offs), max(offs) + 8
            raw = self.read_mem(comm + lo, hi - lo)
            if raw is not None and len(raw) >= hi - lo:
                rank = int.from_bytes(raw[lay.rank - lo : lay.rank - lo + 4], "little", signed=True)
                nranks = int.from_bytes(raw[lay.nranks - lo : lay.nranks - lo + 4], "little", signed=True)
                h = (
                    int.from_bytes(raw[lay.comm_hash - lo : lay.comm_hash - lo + 8], "little")
                    if lay.has_hash
                    else 0
                )
                if 0 <= rank < nranks <= MAX_NRANKS:
                    info = (
                        CommInfo(h, nranks, rank, "table") if h else CommInfo(comm, nranks, rank, "accessors")
                    )
                else:
                    self.identity_errors += 1
        self.comms[comm] = info

    # ---- steps ---------------------------------------------------------------------------------------

    def _sig(self, e: int) -> EpochSig:
        """The signature of a closed epoch (its data is final: finalize asks only below
        final_before), computed once: finalize looks at a queued epoch at every drain until a step
        boundary comes, thousands of collectives each at tensor-parallel rates."""
        sig = self._sigs.get(e)
        if sig is None:
            sig = self._sigs[e] = self._make_sig(e)
        return sig

    def _make_sig(self, e: int) -> EpochSig:
        d = self.epochs.get(e) or EpochData()
        colls: Counter = Counter()
        first = last = None
        comms = self.comms
        if self.has_coll_sums:
            for (comm, call, _dt), (count, _el, _host, _seq, enter, exit_) in d.colls.items():
                info = comms.get(comm)
                colls[(info.hash if info is not None else comm, call)] += count
                first = enter if first is None else min(first, enter)
                last = exit_ if last is None else max(last, exit_)
        else:
            for n in d.nccl:
                info = comms.get(n.comm)
                colls[(info.hash if info is not None else n.comm, n.h.call)] += 1
            if d.nccl:
                first = min(n.enter_ns for n in d.nccl)
                last = max(n.h.ts for n in d.nccl)
        s = d.sync
        sync = (s.h.call, s.handle, s.h.tid) if s is not None else None
        marker = s is not None and s.h.call == _STEP_MARKER
        return EpochSig(
            e, sync, tuple(sorted(colls.items(), key=repr)), s.h.ts if s else 0, first, last, marker
        )

    def finalize(self, final_before: int, wall_offset_ns: int = 0) -> List[dict]:
        """`finalize_steps` as the `--json` objects (argus.schema.to_probe_json)."""
        return [to_probe_json(rs) for rs in self.finalize_steps(final_before, wall_offset_ns)]

    def finalize_steps(
        self, final_before: int, wall_offset_ns: int = 0, wall_offset_err_ns: int = 0
    ) -> List[RankStep]:
        """Cut every step whose epochs are all below `final_before`; return their summaries."""
        for e in range(self.next_epoch, final_before):
            self.detector.add(self._sig(e))
            self.queue.append(e)
            self._provisional_samples(e)
        self.next_epoch = max(self.next_epoch, final_before)
        out: List[RankStep] = []
        if self.detector.period is None and not self.detector.step_fn:
            while len(self.queue) > MAX_PENDING_EPOCHS:  # no period yet: bound what we keep
                self._sigs.pop(self.queue[0], None)
                self._leave_out(self.queue.pop(0))
                self.unassigned_epochs += 1
            return out
        keep: List[int] = []
        done = 0  # queue entries cut into steps (or left out): never cut twice, even on an exception
        try:
            for i, e in enumerate(self.queue):
                keep.append(e)
                if not self.detector.is_boundary(self._sig(e)):
                    continue
                if self.last_boundary is not None:
                    out.append(self.summarize(keep, wall_offset_ns, wall_offset_err_ns))
                self.last_boundary_sync = self.epoch(e).sync  # before `e` (in `keep`) is forgotten
                for x in keep:
                    if self.last_boundary is not None:
                        self.epochs.pop(x, None)
                    else:  # before the first boundary: the step the agent attached in the middle of
                        self._leave_out(x)
                keep = []
                self.last_boundary = e
                done = i + 1
        finally:
            self.queue = self.queue[done:]
        if len(self._sigs) > len(keep):
            self._sigs = {x: self._sigs[x] for x in keep if x in self._sigs}
        return out

    def _leave_out(self, e: int) -> None:
        """Forget an epoch that is part of no step, counting what it held (never silently)."""
        d = self.epochs.pop(e, None)
        self.left_out["epochs"] += 1
        if d is not None:
            self.left_out["launches"] += sum(d.launches.values())
            self.left_out["collectives"] += (
                sum(v[0] for v in d.colls.values()) if self.has_coll_sums else len(d.nccl)
            )

    def take_left_out(self) -> Counter:
        out, self.left_out = self.left_out, Counter()
        return out

    def flush_tail(self, wall_offset_ns: int = 0) -> Optional[dict]:
        """`flush_tail_step` as the `--json` object (argus.schema.to_probe_json)."""
        rs = self.flush_tail_step(wall_offset_ns)
        return None if rs is None else to_probe_json(rs)

    def flush_tail_step(self, wall_offset_ns: int = 0, wall_offset_err_ns: int = 0) -> Optional[RankStep]:
        """After the process exited: what was never part of a complete step (or of any step, when
        no period was found) as one record with step None and step_source "tail"."""
        rest = sorted(set(self.queue) | {e for e in self.epochs if e >= self.next_epoch})
        rest = sorted(set(rest) | {e for sec in self.sections for e in sec.epochs() if e >= self.next_epoch})
        self.queue = []
        # `not rest`: the sections still hold only epochs already summarized or left out (before
        # the first boundary), nothing of a tail
        if not rest or (
            not any(e in self.epochs for e in rest) and not any(sec.epochs() for sec in self.sections)
        ):
            return None
        out = self.summarize(rest, wall_offset_ns, wall_offset_err_ns)
        out.step, out.step_source = None, "tail"
        for e in rest:
            self.epochs.pop(e, None)
        return out

    # ---- summaries -----------------------------------------------------------------------------------

    def summarize(self, epochs: List[int], wall_offset_ns: int = 0, wall_offset_err_ns: int = 0) -> RankStep:
        """One step: its RankStep, with the detail `--json` prints (docs/probe.md)."""
        data = [self.epochs.get(e) or EpochData() for e in epochs]
        start_sync = self.last_boundary_sync
        end_sync = data[-1].sync
        # a tail (no closing sync): the last record seen stands in for the end (read only then:
        # thousands of records a step at tensor-parallel rates)
        end_ns = end_sync.h.ts if end_sync else max(_record_times(data), default=0)
        start_ns = (
            start_sync.h.ts
            if start_sync
            else (data[0].sync.enter_ns if data[0].sync else min(_record_times(data), default=end_ns))
        )
        step, source = self._step_index(data)
        self.ordinal += 1
        self.steps_emitted += 1
        if step is not None:
            self.last_step = step
        det = self.detector.period
        # records of this process the BPF side lost (ring buffer or a map full) since its previous
        # summary: this step's numbers may be short by them
        drops = {k: v - self._drops_said.get(k, 0) for k, v in self.drops_total.items()}
        drops = {k: v for k, v in drops.items() if v > 0}
        self._drops_said = dict(self.drops_total)
        colls = self._step_colls(data) if self.has_coll_sums else {}
        gpu_arrival = self.arrive.close_step(
            epochs,
            step,
            start_ns,
            {(self.comms.get(h) or CommInfo(h, -1, -1, "inferred")).key: v for h, v in colls.items()},
        )
        self._want_samples(colls)
        cuda = self._cuda(data)
        cuda.detail.runtime_calls, rt_errors = self._cudart(data)
        nccl = self._nccl(data)
        comms, nccl_detail = nccl_from_probe(nccl, wall_offset_ns)
        sections = self._sections(epochs, data)
        duration = max(0, end_ns - start_ns)
        wait = sum(w for _c, w in cuda.detail.sync_by_call.values())
        # a launch that waited for a slot in a full launch queue waited for the GPU, as a sync does:
        # a launch-bound host's time follows its GPU, and is not its own (argus.aggregator.ranks);
        # within the step's time outside its syncs (a wait that began before the step's start)
        launch_wait = min(cuda.launch_wait_ns, max(0, duration - wait))
        host_wait = wait + launch_wait
        ident = self.id
        return RankStep(
            job=ident.job,
            rank=ident.rank,
            host=ident.host,
            pid=ident.pid,
            step=step,
            start_ns=start_ns + wall_offset_ns,
            duration_ns=duration,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            step_source=source,
            clock_offset_ns=wall_offset_ns,
            clock_uncertainty_ns=wall_offset_err_ns,
            sync_count=sum(c for c, _w in cuda.detail.sync_by_call.values()),
            sync_wait_ns=wait,
            phases=step_phases(cuda.detail.timers, host_wait, duration),
            launches=sum(cuda.kernels.values()),
            launch_wait_ns=launch_wait,
            kernels=cuda.kernels,
            memcpy=cuda.memcpy,
            # one errors map, by channel as --json prints them (argus.schema.error_channel)
            errors={**cuda.errors, **rt_errors, **errors_from_probe(nccl["errors"])},
            comms=comms,
            drops=drops,
            phase_stream=stream_ordinals(cuda.detail.timers),
            py_phases=python_phases(sections.get("python")),
            gpu_arrival=gpu_arrival_from_probe(gpu_arrival, wall_offset_ns),
            detail=ProbeDetail(
                ns_pid=ident.ns_pid,
                rank_from=ident.rank_from,
                identity_why=ident.describe(),
                end_ns=end_ns if end_ns != start_ns + duration else None,
                period=StepPeriod(det.length, round(det.confidence, 3), det.source) if det else StepPeriod(),
                cuda=cuda.detail,
                nccl=nccl_detail,
                sections=sections,
            ),
        )

    def _sections(self, epochs: List[int], data: List[EpochData]) -> Dict[str, Any]:
        timers = [el for d in data for el in d.elapsed]
        out: Dict[str, Any] = {}
        for sec in self.sections:
            v = sec.summarize(epochs, timers)
            if v is not None:
                out[sec.name] = v
        return out

    def _step_index(self, data: List[EpochData]) -> Tuple[int, str]:
        """The step number: for a communicator seen created (so its sequence numbers count from its
        first collective, like every rank's), its first sequence number in the step divided by its
        collectives per step — the trainer's own step index, the same on every rank. Otherwise a local
        ordinal, which the aggregator aligns across ranks by step time."""
        per_comm: Dict[int, Tuple[int, int]] = {}  # handle -> (first sequence number, collectives)
        if self.has_coll_sums:
            for handle, (first, n) in self._step_colls(data).items():
                info = self.comms.get(handle)
                if info is not None and info.created:
                    per_comm[handle] = (first, n)
        else:
            seqs_of: Dict[int, List[int]] = {}
            for d in data:
                for r in d.nccl:
                    info = self.comms.get(r.comm)
                    if info is not None and info.created and r.h.call not in P2P_CALLS:
                        seqs_of.setdefault(r.comm, []).append(r.seq)
            per_comm = {c: (min(v), len(v)) for c, v in seqs_of.items()}
        if per_comm:
            ref = max(per_comm, key=lambda c: (self.comms[c].nranks, per_comm[c][1], c))
            first, n = per_comm[ref]
            return first // n, "nccl-seq"
        return self.ordinal, "ordinal"

    def _step_colls(self, data: List[EpochData]) -> Dict[int, Tuple[int, int]]:
        """Per communicator handle: the first sequence number of its collectives in these epochs
        and how many (BPF's sums; point-to-point operations number apart and are left out)."""
        out: Dict[int, Tuple[int, int]] = {}
        for d in data:
            for (comm, call, _dt), v in d.colls.items():
                if call in P2P_CALLS or not comm:
                    continue
                first, n = out.get(comm, (v[3], 0))
                out[comm] = (min(first, v[3]), n + v[0])
        return out

    def _sums(self, data: List[EpochData]) -> Tuple[Dict[str, Dict[str, int]], Dict[str, dict]]:
        """The step's per-op totals and per-communicator counts from BPF's sums: exact whether or
        not every collective has a record (sampled past `coll_records`, or lost)."""
        ops: Dict[str, Dict[str, int]] = {}
        comms: Dict[str, dict] = {}
        firsts: Dict[str, Tuple[int, int]] = {}  # comm -> (first sequence number, collectives)
        for d in data:
            for (handle, call, dtype), (count, elems, host, first, _enter, _exit) in d.colls.items():
                op = _op_of(call)
                _add_op(ops, op, count, elems * _DTYPE_SIZE.get(dtype, 0), host)
                info = self.comms.get(handle) or CommInfo(handle, -1, -1, "inferred")
                key = info.key
                cm = _comm_entry(comms, info, first)
                cm["ops"] += count
                if call not in P2P_CALLS:
                    f, n = firsts.get(key, (first, 0))
                    firsts[key] = (min(f, first), n + count)
        for key, (first, n) in firsts.items():
            cm = comms[key]
            cm["first_seq"], cm["last_seq"], cm["collectives"] = first, first + n - 1, n
        return ops, comms

    def _provisional_samples(self, e: int) -> None:
        """Before any step is cut (finding the period takes several steps): a communicator with more
        than twice `coll_records` collectives in one epoch gets every stride-th recorded at once,
        else the records of those steps, thousands a step and rank at tensor-parallel rates, are
        most of the agent's memory. Until `_want_samples` aligns it, the phase is this rank's own."""
        k = self.coll_records
        d = self.epochs.get(e)
        if k <= 0 or d is None or not d.colls:
            return
        n: Counter = Counter()
        for (handle, call, _dt), v in d.colls.items():
            if handle and call not in P2P_CALLS:
                n[handle] += v[0]
        for handle, count in n.items():
            # (a provisional stride from an open epoch's first records is set right here)
            if count > 2 * k and (handle not in self.sampled or handle in self._provisional):
                self._provisional_stride(handle, -(-count // k))

    def _sample_open_epoch(self, kept: List[RecNccl]) -> None:
        """An epoch still open after many collective records: the job's first steps after attach
        (an epoch is sampled only once it is final, two drains after its sync), or no host sync
        for a long while (a job that syncs rarely; `--no-cuda`). Its busy communicators are sampled
        now, and more sparsely at the next mark, or every record of the epoch is kept: thousands a
        second at tensor-parallel rates (the agent's start-up burst), without bound with no sync."""
        k = self.coll_records
        n = Counter(r.comm for r in kept if r.comm and r.h.call not in P2P_CALLS)
        for handle, count in n.items():
            if count <= 2 * k:
                continue
            old = self.sampled.get(handle)
            if old is None:
                self._provisional_stride(handle, -(-count // k))
            elif handle in self._provisional:
                self._provisional_stride(handle, old[0] * OPEN_EPOCH_MARK)  # (aligned ones stay)

    def _provisional_stride(self, handle: int, stride: int) -> None:
        if self.sampled.get(handle) != (stride, 0):
            self.sampled[handle] = (stride, 0)
            self._provisional.add(handle)
            self._sample_new.append((handle, stride, 0))

    def _want_samples(self, colls: Dict[int, Tuple[int, int]]) -> None:
        """After a step: communicators with more collectives than `coll_records` in it and in the
        step before get every stride-th recorded from now on, the first of each step among them (the
        phase): the same instances on every rank, whenever its agent attached, since every rank
        cuts its steps at the same collectives. The stride divides the step's count so that the
        phase holds step after step."""
        k = self.coll_records
        if k <= 0:
            return
        for handle, (first, n) in colls.items():
            prev, self._coll_n[handle] = self._coll_n.get(handle), n
            if n <= k or prev != n or (handle in self.sampled and handle not in self._provisional):
                continue
            self._provisional.discard(handle)
            stride = next(d for d in range(-(-n // k), n + 1) if n % d == 0)
            self.sampled[handle] = (stride, first % stride)
            self._sample_new.append((handle, stride, first % stride))

    def saw_seq(self, handle: int, seq: int) -> None:
        """A collective of a sampled communicator entered, recorded or not (drain.read_samples)."""
        info = self.comms.get(handle)
        if info is not None and seq > self.last_seq.get(info.key, -1):
            self.last_seq[info.key] = seq

    def take_samples(self) -> List[Tuple[int, int, int]]:
        """(communicator handle, stride, phase) to write into BPF's `coll_sample` since the last call."""
        out, self._sample_new = self._sample_new, []
        return out

    def _cuda(self, data: List[EpochData]) -> _Cuda:
        launches: Counter = Counter()
        hist: Counter = Counter()
        mem: Dict[str, List[int]] = {}
        errors: Dict[str, Dict[int, int]] = {}
        sync_by: Dict[str, List[int]] = {}
        timers = []
        event_records = 0
        for d in data:
            for f, c in d.launches.items():
                launches[self.func_names.get(f, f"fn@{f:#x}")] += c
            hist.update(d.launch_hist)
            for k, (c, b) in d.mem.items():
                m = mem.setdefault(libcuda.MEM_KINDS[k] if k < len(libcuda.MEM_KINDS) else str(k), [0, 0])
                m[0] += c
                m[1] += b
            for (call, res), c in d.errors.items():
                if call_channel(call) == "cuda":  # one errors map for every channel: the driver's here
                    per = errors.setdefault(call_name(call), {})
                    per[res] = per.get(res, 0) + c
            if d.sync is not None:
                s = sync_by.setdefault(call_name(d.sync.h.call), [0, 0])
                s[0] += 1
                s[1] += d.sync.h.ts - d.sync.enter_ns
            for el in d.elapsed:
                if el.result == 0:
                    timers.append(Timer(_ms(el.ms_bits), el.start_ev, el.end_ev, el.end_stream))
            event_records += d.calls.get(_EVENT_RECORD, 0)
        return _Cuda(
            kernels=dict(launches.most_common()),
            memcpy={k: (c, b) for k, (c, b) in mem.items() if k in MEMCPY_KINDS},
            errors=errors,
            detail=CudaDetail(
                launch_hist=dict(sorted(hist.items())),
                sync_by_call={k: (c, w) for k, (c, w) in sync_by.items()},
                memory={k: (c, b) for k, (c, b) in mem.items() if k.startswith(("alloc", "free"))},
                timers=timers,
                event_records=event_records,
            ),
            launch_wait_ns=mem.get("launch_wait", [0, 0])[1],
        )

    def _cudart(self, data: List[EpochData]) -> Tuple[Dict[str, int], Dict[str, Dict[int, int]]]:
        """CUDA runtime calls (libcudart): how often each ran and its non-zero results. Launches,
        copies and syncs are reported under "cuda" (the driver channel sees them too)."""
        calls: Counter = Counter()
        errors: Dict[str, Dict[int, int]] = {}
        for d in data:
            for call, c in d.calls.items():
                if call_channel(call) == "cudart":
                    calls[call_name(call)] += c
            for (call, res), c in d.errors.items():
                if call_channel(call) == "cudart":
                    per = errors.setdefault(call_name(call), {})
                    per[res] = per.get(res, 0) + c
        return dict(calls), errors

    def _nccl(self, data: List[EpochData]) -> dict:
        ops: Dict[str, Dict[str, int]] = {}
        comms: Dict[str, dict] = {}
        arrivals = []
        errors: Dict[str, Dict[str, int]] = {}
        groups = 0
        grouped: List[Tuple[int, int, list]] = []  # (tid, enter, arrival) of operations in a group
        for d in data:
            groups += d.calls.get(call_id("ncclGroupStart"), 0)
            for (call, res), c in d.errors.items():
                if call_channel(call) == "nccl":
                    name = call_name(call)
                    errors.setdefault(name, {})[str(res)] = errors.get(name, {}).get(str(res), 0) + c
            sums = self.has_coll_sums  # counts and totals from BPF's sums, not from the records
            for n in d.nccl:
                h = n.h
                op = _op_of(h.call)
                nbytes = n.count * _DTYPE_SIZE.get(n.dtype, 0)
                host_ns = h.ts - n.enter_ns
                info = self.comms.get(n.comm) or CommInfo(n.comm, -1, -1, "inferred")
                key = info.key
                seq = n.seq
                if not sums:
                    _add_op(ops, op, 1, nbytes, host_ns)
                    cm = _comm_entry(comms, info, seq)
                    cm["ops"] += 1
                    if op != "Send" and op != "Recv":
                        if seq < cm["first_seq"]:
                            cm["first_seq"] = seq
                        if seq > cm["last_seq"]:
                            cm["last_seq"] = seq
                arrival = [key, seq, op, nbytes, n.enter_ns, host_ns]
                if op in ("Send", "Recv", "Broadcast", "Reduce"):
                    arrival.append(n.peer)
                if n.flags & NCCL_F_IN_GROUP:
                    arrival.append("g")
                    grouped.append((n.h.tid, n.enter_ns, arrival))
                arrivals.append(arrival)
        _add_group_waits(grouped, [g for d in data for g in d.group_ends])
        if self.has_coll_sums:
            ops, comms = self._sums(data)
        calls: Counter = Counter()
        inits = []
        for d in data:
            for call, c in d.calls.items():
                if call_channel(call) == "nccl":
                    calls[call_name(call)] += c
            for r in d.inits:
                inits.append(
                    {
                        "call": call_name(r.h.call),
                        "result": r.result,
                        "nranks": r.nranks,
                        "rank": r.rank,
                        "comm": self.comms[r.comm].key if r.comm in self.comms else None,
                    }
                )
        return {
            "ops": ops,
            "comms": comms,
            "arrivals": arrivals,
            "groups": groups,
            "errors": errors,
            "calls": dict(calls),
            "inits": inits,
        }


def _record_times(data: List[EpochData]) -> List[int]:
    """When each kept record of these epochs was made."""
    return [r.h.ts for d in data for r in (*d.nccl, *d.elapsed, *([d.sync] if d.sync else []))]
