"""The per-rank, per-step summary every part after the agent works on (schema version 1).

`RankStep` is the decoded form: what the aggregator, `top`, reports and exporters read. It is
built by the agent from a probe step (`from_probe`), shipped compactly (argus.wire: msgpack), and
rebuilt by readers. Times are nanoseconds; absolute times are CLOCK_REALTIME (the agent adds its
measured monotonic→realtime offset), so ranks on different hosts are comparable within the clock
sync uncertainty recorded in each summary.

Phases: `timer<k>` are the GPU durations the process itself measured with cuEventElapsedTime,
in the order it read them in the step (the same code on every rank reads them in the same order,
so timer k is comparable across ranks); `host_wait` is the time the host blocked on the GPU and
`host_other` the rest of the step. Named phases (forward, backward, ...) come from the Python
channel when it is on, in `py_phases`: sampled estimates, shown and used in explanations, never
judged as outliers like the GPU timers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any, Dict, Iterator, List, Optional, Tuple, Union

from argus.errors import BadData
from argus.gpu import compact as gpu_compact

SCHEMA_VERSION = 1
OPS: Tuple[str, ...] = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "Send", "Recv")
P2P = ("Send", "Recv")


@dataclass
class P2POp:
    op: str  # Send | Recv
    peer: int  # rank within the communicator
    nbytes: int
    arrive_ns: int  # realtime ns the host entered the call
    host_ns: int  # host time inside the call (enqueue under normal NCCL)


@dataclass
class CommStep:
    """One rank's collectives on one communicator during one step."""

    comm: str  # 16 hex digits, the same on every rank of the communicator
    nranks: int  # -1 when unknown
    rank: int  # this rank's rank in the communicator, -1 when unknown
    identity: str  # init | attach | split | handle
    seqs: List[int] = field(default_factory=list)  # collective sequence numbers, ascending
    ops: List[str] = field(default_factory=list)
    nbytes: List[int] = field(default_factory=list)
    arrive_ns: List[int] = field(default_factory=list)  # realtime ns of arrival at each collective
    host_ns: List[int] = field(default_factory=list)
    p2p: List[P2POp] = field(default_factory=list)
    # Past the agent's collective records per step (argus probe --coll-records), the instances above
    # are every n-th: then the step's first sequence number and count of collectives (0: the
    # instances above are all of them). Positions in the step are seq - first_seq either way.
    first_seq: int = -1
    count: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def collectives(self) -> int:
        """The step's collectives on this communicator, whether or not each has an instance above."""
        return self.count or len(self.seqs)

    @property
    def first(self) -> int:
        """The step's first sequence number (position 0)."""
        return self.first_seq if self.count else (self.seqs[0] if self.seqs else 0)


# Where a GPU-arrival bound came from (GpuArrival.bounds): one letter for the lower bound, one for
# the upper. h: the host's enqueue (lower only); q: an event query (failed: lower, succeeded: upper);
# s: a host sync returned; e: the collective's end event completed (upper, loose by the collective's
# own time); -: none.
BOUND_SOURCES = {"h": "host enqueue", "q": "event query", "s": "host sync", "e": "end event", "-": "none"}


@dataclass
class GpuArrival:
    """When this rank's GPU reached the collectives of one of its steps (docs/diagnosis.md "Which
    GPU arrived last"), from calls the framework makes anyway. The evidence comes in after the step
    (an event's completion is seen at the next query), so a summary carries its previous step's."""

    step: Optional[int]  # the rank's own step number these are for (its previous summary's)
    # comm -> (index of the collective among the comm's in that step, lo, hi (0: unknown), sources)
    bounds: Dict[str, List[Tuple[int, int, int, str]]] = field(default_factory=dict)
    net_first_ns: int = 0  # realtime ns of the first network send in that step (0: none)
    # comm -> the in-collective GPU times the framework read (cuEventElapsedTime of the start and end
    # events around one collective: TORCH_NCCL_ENABLE_TIMING), ns, in the order read
    coll_gpu_ns: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class RankStep:
    job: str
    rank: int
    host: str
    pid: int
    step: Optional[int]
    start_ns: int  # realtime
    duration_ns: int
    local_rank: int = -1
    world_size: int = -1
    step_source: str = "nccl-seq"
    clock_offset_ns: int = 0  # realtime - monotonic at the agent
    clock_uncertainty_ns: int = 0
    sync_count: int = 0
    sync_wait_ns: int = 0
    phases: Dict[str, int] = field(default_factory=dict)  # ns
    launches: int = 0
    launches_sampled: bool = True  # False: the launch probes did not cover this step (--launch-steps)
    kernels: Dict[str, int] = field(default_factory=dict)  # kernel name (or fn@0x..) -> launches
    memcpy: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # kind -> (count, bytes)
    errors: Dict[str, Dict[int, int]] = field(default_factory=dict)  # call -> result -> count
    comms: Dict[str, CommStep] = field(default_factory=dict)
    drops: Dict[str, int] = field(default_factory=dict)
    version: int = SCHEMA_VERSION
    # timer<k> -> stream ordinal of its end event in this step: 0 = the stream most timers end on
    # (the compute stream), 1, 2, ... = other streams (e.g. NCCL's); empty when unknown
    phase_stream: Dict[str, int] = field(default_factory=dict)
    # Python channel: ns per training phase of the main thread (forward, backward, optimizer, data,
    # ...; sampled, so only for display and explanations, never judged like GPU timers)
    py_phases: Dict[str, int] = field(default_factory=dict)
    # NVML's latest sample of the rank's device (argus.gpu.compact): clocks, throttle mask,
    # utilisation, power, temperature, XID and link errors; empty without NVML
    gpu: Dict[str, float] = field(default_factory=dict)
    # when this rank's GPU reached the collectives of its previous step (None: no evidence)
    gpu_arrival: Optional[GpuArrival] = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


# What a hostile or broken `argus probe --json` line can make json.loads/from_probe raise: every
# JSONL reader turns exactly these into its one-line BadData (a JSON array where an object belongs:
# AttributeError; "[[[[...": RecursionError; 1e999 as an int: OverflowError).
PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError)
MAX_LINE = 16 << 20  # bytes of one JSONL line read at most: a summary is a few KiB


def parse_line(line: str) -> Dict[str, Any]:
    """One JSONL line as an object; raises one of PARSE_ERRORS when it is not one."""
    if len(line) > MAX_LINE:
        raise ValueError(f"line of {len(line)} bytes (at most {MAX_LINE})")
    d = json.loads(line)
    if not isinstance(d, dict):
        raise TypeError(f"a JSON {type(d).__name__}, not an object")
    return d


def from_probe(d: dict) -> RankStep:
    """Build a RankStep from one `argus probe --json` object (schema 1 of docs/probe.md)."""
    off = int(d.get("wall_offset_ns", 0))
    start = int(d["start_ns"]) + off
    cuda = d.get("cuda", {})
    phases: Dict[str, int] = {}
    for i, t in enumerate(cuda.get("timers", [])):
        phases[f"timer{i}"] = round(float(t["ms"]) * 1e6)
    phase_stream = _stream_ordinals([str(t.get("stream", "")) for t in cuda.get("timers", [])])
    wait = int(cuda.get("sync", {}).get("wait_ns", 0))
    phases["host_wait"] = wait
    phases["host_other"] = max(0, int(d["duration_ns"]) - wait)
    comms: Dict[str, CommStep] = {}
    nccl = d.get("nccl", {})
    info = nccl.get("comms", {})
    for a in nccl.get("arrivals", []):
        comm, seq, op, nbytes, enter, host = a[0], int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5])
        meta = info.get(comm, {})
        c = comms.get(comm)
        if c is None:
            c = comms[comm] = CommStep(
                comm,
                int(meta.get("nranks", -1)),
                int(meta.get("rank", -1)),
                str(meta.get("identity", "handle")),
            )
        if op in P2P:
            peer = int(a[6]) if len(a) > 6 and not isinstance(a[6], str) else -1
            c.p2p.append(P2POp(op, peer, nbytes, enter + off, host))
        else:
            c.seqs.append(seq)
            c.ops.append(op)
            c.nbytes.append(nbytes)
            c.arrive_ns.append(enter + off)
            c.host_ns.append(host)
    for c in comms.values():
        meta = info.get(c.comm, {})
        n = int(meta.get("collectives", 0))
        if n > len(c.seqs):  # sampled (docs/schema.md): the step's count and first
            c.count, c.first_seq = n, int(meta.get("first_seq", -1))
        order = sorted(range(len(c.seqs)), key=c.seqs.__getitem__)
        c.seqs = [c.seqs[i] for i in order]
        c.ops = [c.ops[i] for i in order]
        c.nbytes = [c.nbytes[i] for i in order]
        c.arrive_ns = [c.arrive_ns[i] for i in order]
        c.host_ns = [c.host_ns[i] for i in order]
    errors: Dict[str, Dict[int, int]] = {}
    for section in ("cuda", "cudart", "nccl"):
        for call, codes in d.get(section, {}).get("errors", {}).items():
            errors[call] = {int(k): int(v) for k, v in codes.items()}
    launches = cuda.get("launches", {})
    return RankStep(
        job=str(d["job"]),
        rank=int(d["rank"]),
        host=str(d["host"]),
        pid=int(d["pid"]),
        step=None if d.get("step") is None else int(d["step"]),
        start_ns=start,
        duration_ns=int(d["duration_ns"]),
        local_rank=int(d.get("local_rank", -1)),
        world_size=int(d.get("world_size", -1)),
        step_source=str(d.get("step_source", "ordinal")),
        clock_offset_ns=off,
        clock_uncertainty_ns=int(d.get("wall_offset_err_ns", 0)),
        sync_count=int(cuda.get("sync", {}).get("count", 0)),
        sync_wait_ns=wait,
        phases=phases,
        launches=int(launches.get("total", 0)),
        launches_sampled=bool(launches.get("sampled", True)),
        kernels={k: int(v) for k, v in launches.get("by_kernel", {}).items()},
        memcpy={k: (int(v["count"]), int(v["bytes"])) for k, v in cuda.get("memcpy", {}).items()},
        errors=errors,
        comms=comms,
        phase_stream=phase_stream,
        py_phases={
            str(k): int(v) for k, v in (d.get("python") or {}).get("phases", {}).items() if int(v) > 0
        },
        gpu=gpu_compact(d["gpu"]) if isinstance(d.get("gpu"), dict) else {},
        drops={str(k): int(v) for k, v in (d.get("drops") or {}).items()},
        gpu_arrival=_gpu_arrival(d.get("gpu_arrival"), off),
    )


def _gpu_arrival(g: Any, off: int) -> Optional[GpuArrival]:
    """The probe's `gpu_arrival` object (monotonic ns) on the realtime clock."""
    if not isinstance(g, dict):
        return None
    step = g.get("step")
    return GpuArrival(
        step=None if step is None else int(step),
        bounds={
            str(c): [
                (int(i), int(lo) + off, int(hi) + off if int(hi) else 0, str(src)) for i, lo, hi, src in v
            ]
            for c, v in (g.get("bounds") or {}).items()
        },
        net_first_ns=int(g["net_first_ns"]) + off if g.get("net_first_ns") else 0,
        coll_gpu_ns={str(c): [int(x) for x in v] for c, v in (g.get("coll_gpu_ns") or {}).items()},
    )


def _stream_ordinals(streams: List[str]) -> Dict[str, int]:
    """timer<k> -> 0 for the stream most timers end on (the first timer's on a tie), 1, 2, ... for the
    others in order of appearance; empty when a stream is unknown."""
    if not streams or "" in streams:
        return {}
    counts: Dict[str, int] = {}
    for st in streams:
        counts[st] = counts.get(st, 0) + 1
    main = max(counts, key=lambda st: (counts[st], -streams.index(st)))
    order: Dict[str, int] = {main: 0}
    for st in streams:
        order.setdefault(st, len(order))
    return {f"timer{i}": order[st] for i, st in enumerate(streams)}


@dataclass
class InFlight:
    """A call a rank entered and has not returned from (what a hung rank is blocked in)."""

    rank: int
    pid: int
    call: str  # e.g. cuStreamSynchronize, ncclAllReduce
    since_ns: int  # realtime ns of entry
    comm: Optional[str] = None  # for NCCL calls: communicator id
    seq: Optional[int] = None  # for NCCL collectives: sequence number


@dataclass
class Heartbeat:
    """Sent by every agent every few seconds, steps or not: a hung job completes no step, so hang
    diagnosis reads these (who is blocked in what since when; how far each rank got per comm)."""

    job: str
    agent: str  # host:pid of the agent
    host: str
    ts_ns: int  # realtime
    ranks: Dict[int, int] = field(default_factory=dict)  # rank -> pid
    inflight: List[InFlight] = field(default_factory=list)
    last_seq: Dict[int, Dict[str, int]] = field(default_factory=dict)  # rank -> comm -> last seq entered
    last_step: Dict[int, int] = field(default_factory=dict)  # rank -> last step emitted
    drops: Dict[str, int] = field(default_factory=dict)
    version: int = SCHEMA_VERSION
    # agent health (docs/schema.md): publisher counters, ring decode errors, probes, CPU and RSS
    health: Dict[str, int] = field(default_factory=dict)
    # while a call has been in flight for a while: what each rank's threads are doing
    # ("blocked in ncclAllReduce (libnccl.so.2) from step (train.py:88)", "in sleep_forever
    # (train.py:40), clock_nanosleep"), from the agent's scan of its threads
    where: Dict[int, str] = field(default_factory=dict)
    # ranks whose in-flight call was found by the attach scan: it began before the agent attached,
    # so its since_ns (the scan) is a lower bound
    attach_blocked: List[int] = field(default_factory=list)
    # rank -> [nRanks, its rank in it] of the communicator its blocked NCCL call works on, when
    # read from the process (found on the blocked thread's stack at attach)
    inflight_comm: Dict[int, List[int]] = field(default_factory=dict)


def heartbeat_from_json(d: Dict[str, Any]) -> Heartbeat:
    """A heartbeat line's object (`{"heartbeat": {...}}` in a JSONL file: the fields of Heartbeat)."""
    return Heartbeat(
        job=str(d["job"]),
        agent=str(d["agent"]),
        host=str(d.get("host", "")),
        ts_ns=int(d["ts_ns"]),
        ranks={int(k): int(v) for k, v in d.get("ranks", {}).items()},
        inflight=[InFlight(**f) for f in d.get("inflight", [])],
        last_seq={int(r): {str(c): int(s) for c, s in m.items()} for r, m in d.get("last_seq", {}).items()},
        last_step={int(k): int(v) for k, v in d.get("last_step", {}).items()},
    )


def read_jsonl(f: IO[str], name: str = "FILE") -> Iterator[Union[RankStep, Heartbeat]]:
    """The one reader of recorded summaries: `argus probe --json` lines as RankSteps (a process's
    tail, with no step number, included) and heartbeat lines as Heartbeats; blank lines skipped.
    Anything else is one `BadData` line naming the file and line."""
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            d = parse_line(line)
            yield heartbeat_from_json(d["heartbeat"]) if "heartbeat" in d else from_probe(d)
        except PARSE_ERRORS as e:
            raise BadData(
                f"{name}:{n}: not an `argus probe --json` summary ({type(e).__name__}: {e})"[:300],
                "record it with: sudo argus probe -p PID --json > steps.jsonl",
            ) from None
