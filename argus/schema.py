"""The per-rank, per-step summary every part after the agent works on (schema version 1).

`RankStep` is the decoded form: what the aggregator, `top`, reports and exporters read. The agent's
tracker builds it directly, with the probe-only `detail` (`ProbeDetail`) that `argus probe --json`
also prints: `to_probe_json` is that JSON object (schema 1 of docs/probe.md), `from_probe` its exact
inverse (the one reader of recorded lines: `read_jsonl`). It is shipped compactly without the
detail (argus.wire: msgpack), and rebuilt by readers. Times are nanoseconds; absolute times are
CLOCK_REALTIME (the agent adds its measured monotonic→realtime offset), so ranks on different hosts
are comparable within the clock sync uncertainty recorded in each summary.

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


# ---- what `argus probe --json` says beyond the summary (never on the wire) ------------------------


@dataclass
class StepPeriod:
    """How the agent cuts steps (`period`): syncs per step, the detector's confidence and source;
    all None while no period is found."""

    syncs_per_step: Optional[int] = None
    confidence: Optional[float] = None
    source: Optional[str] = None


@dataclass
class Timer:
    """A GPU time the process read with cuEventElapsedTime (`cuda.timers[k]`: phase timer<k>)."""

    ms: float
    start_event: int  # CUevent handles
    end_event: int
    stream: Optional[int]  # the stream the end event was recorded on (0: unseen); None: not said


@dataclass
class OpTotals:
    """One NCCL operation's calls in the step (`nccl.ops[op]`); host time as entered, before a
    group's wait is moved onto its last operation."""

    count: int = 0
    nbytes: int = 0
    host_ns: int = 0


@dataclass
class CommInit:
    """A communicator creation (`nccl.inits`)."""

    call: str
    result: int
    nranks: int
    rank: int
    comm: Optional[str]  # its key; None when the call failed


@dataclass
class CommDetail:
    """What `nccl.comms[c]` and `nccl.arrivals` say of a communicator beyond its CommStep; lists
    parallel to the CommStep's collectives (sorted by seq) and to its p2p ops."""

    first_seq: int
    last_seq: int
    ops: int = -1  # operations on it in the step (-1: its instances and p2p ops, all recorded)
    collectives: Optional[int] = None  # the step's collectives from BPF's sums (None: not printed)
    roots: List[Optional[int]] = field(default_factory=list)  # root of Broadcast/Reduce; None: none
    grouped: List[bool] = field(default_factory=list)  # called inside ncclGroupStart/End ("g")
    p2p_seqs: List[int] = field(default_factory=list)
    p2p_grouped: List[bool] = field(default_factory=list)


@dataclass
class CudaDetail:
    launch_hist: Dict[int, int] = field(default_factory=dict)  # log2(launch-call ns) -> count
    sampled_said: bool = False  # `launches.sampled` printed (launch probes in windows: --launch-steps)
    sync_by_call: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # call -> (count, wait ns)
    memory: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # alloc*/free* -> (count, bytes)
    timers: List[Timer] = field(default_factory=list)
    event_records: int = 0
    runtime_calls: Dict[str, int] = field(default_factory=dict)  # `cudart.calls`


@dataclass
class NcclDetail:
    ops: Dict[str, OpTotals] = field(default_factory=dict)
    comms: Dict[str, CommDetail] = field(default_factory=dict)
    # `nccl.arrivals` in the order printed (the order of the calls' records): (comm, i), i >= 0 the
    # comm's i-th collective, i < 0 its p2p op -1 - i (CommStep keeps collectives sorted by seq)
    order: List[Tuple[str, int]] = field(default_factory=list)
    groups: int = 0  # ncclGroupStart calls
    calls: Dict[str, int] = field(default_factory=dict)  # other calls, counted
    inits: List[CommInit] = field(default_factory=list)


@dataclass
class ProbeDetail:
    """Everything `argus probe --json` prints that the summary does not carry: kept with the
    agent's RankStep and with one read back from a JSONL file, so `to_probe_json` gives the line
    again; never shipped (argus.wire leaves it out: the aggregator judges without it)."""

    ns_pid: Optional[int] = None  # the pid in its own PID namespace (docs/probe.md)
    rank_from: Optional[str] = None  # `identity.rank`; None: a line of an agent before `identity`
    identity_why: str = ""
    # the monotonic end printed when it is not start + duration (a tail with nothing traced: 0)
    end_ns: Optional[int] = None
    period: Optional[StepPeriod] = None
    cuda: CudaDetail = field(default_factory=CudaDetail)
    nccl: NcclDetail = field(default_factory=NcclDetail)
    # the Python and host channels' sections as printed (`python`, `host_cpu`: docs/python.md)
    sections: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    gpu: Optional[Dict[str, Any]] = None  # NVML's sample as printed (RankStep.gpu: its compact form)


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
    # host time in launches that waited for a full launch queue: a wait for the GPU, in `host_wait`
    # (0 where launches were not sampled or their returns not probed)
    launch_wait_ns: int = 0
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
    # what only `argus probe --json` says (the agent's and a JSONL file's steps); None off the wire
    detail: Optional[ProbeDetail] = None

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


PROBE_SCHEMA = 1  # of the `argus probe --json` object (docs/probe.md)
MEMCPY_KINDS = ("HtoD", "DtoH", "DtoD", "memset")
# top-level keys of the probe object that are not a channel's section (`python`, `host_cpu`, ...)
_PROBE_KEYS = frozenset(
    "schema job rank local_rank world_size host pid ns_pid identity step step_source start_ns end_ns "
    "duration_ns wall_offset_ns period cuda cudart nccl drops gpu_arrival wall_offset_err_ns gpu".split()
)


def error_channel(call: str) -> str:
    """The `--json` section a call's errors are printed in: RankStep.errors holds every channel's.
    By the API's prefix (tests/test_probe_json.py checks it against every probed call)."""
    if call.startswith("nccl"):
        return "nccl"
    return "cudart" if call.startswith("cuda") else "cuda"


def from_probe(d: Dict[str, Any]) -> RankStep:
    """Build a RankStep, its detail included, from one `argus probe --json` object (schema 1 of
    docs/probe.md): the exact inverse of `to_probe_json` for what the agent prints; lines of older
    agents read with defaults."""
    off = int(d.get("wall_offset_ns", 0))
    mono_start = int(d["start_ns"])
    duration = int(d["duration_ns"])
    cuda = d.get("cuda", {})
    cudart = d.get("cudart", {})
    timers = [_timer_from(t) for t in cuda.get("timers", [])]
    sync = cuda.get("sync", {})
    wait = int(sync.get("wait_ns", 0))
    launches = cuda.get("launches", {})
    launch_wait = int(launches.get("wait_ns", 0))
    comms, nccl = nccl_from_probe(d.get("nccl", {}), off)
    errors: Dict[str, Dict[int, int]] = {}
    for section in ("cuda", "cudart", "nccl"):
        errors.update(errors_from_probe(d.get(section, {}).get("errors", {})))
    sections = {str(k): v for k, v in d.items() if k not in _PROBE_KEYS and isinstance(v, dict)}
    ident = d.get("identity")
    period = d.get("period")
    end = int(d.get("end_ns", mono_start + duration))
    gpu = d.get("gpu")
    detail = ProbeDetail(
        ns_pid=None if d.get("ns_pid") is None else int(d["ns_pid"]),
        rank_from=None if ident is None else str(ident.get("rank", "")),
        identity_why="" if ident is None else str(ident.get("why", "")),
        end_ns=None if end == mono_start + duration else end,
        period=None
        if period is None
        else StepPeriod(
            None if period.get("syncs_per_step") is None else int(period["syncs_per_step"]),
            None if period.get("confidence") is None else float(period["confidence"]),
            None if period.get("source") is None else str(period["source"]),
        ),
        cuda=CudaDetail(
            launch_hist={int(k): int(v) for k, v in launches.get("api_ns_log2_hist", {}).items()},
            sampled_said="sampled" in launches,
            sync_by_call={
                str(k): (int(v.get("count", 0)), int(v.get("wait_ns", 0)))
                for k, v in sync.get("by_call", {}).items()
            },
            memory={str(k): (int(v["count"]), int(v["bytes"])) for k, v in cuda.get("memory", {}).items()},
            timers=timers,
            event_records=int(cuda.get("event_records", 0)),
            runtime_calls={str(k): int(v) for k, v in cudart.get("calls", {}).items()},
        ),
        nccl=nccl,
        sections=sections,
        gpu=gpu if isinstance(gpu, dict) else None,
    )
    return RankStep(
        job=str(d["job"]),
        rank=int(d["rank"]),
        host=str(d["host"]),
        pid=int(d["pid"]),
        step=None if d.get("step") is None else int(d["step"]),
        start_ns=mono_start + off,
        duration_ns=duration,
        local_rank=int(d.get("local_rank", -1)),
        world_size=int(d.get("world_size", -1)),
        step_source=str(d.get("step_source", "ordinal")),
        clock_offset_ns=off,
        clock_uncertainty_ns=int(d.get("wall_offset_err_ns", 0)),
        sync_count=int(sync.get("count", 0)),
        sync_wait_ns=wait,
        phases=step_phases(timers, wait + launch_wait, duration),
        launches=int(launches.get("total", 0)),
        launches_sampled=bool(launches.get("sampled", True)),
        launch_wait_ns=launch_wait,
        kernels={str(k): int(v) for k, v in launches.get("by_kernel", {}).items()},
        memcpy={str(k): (int(v["count"]), int(v["bytes"])) for k, v in cuda.get("memcpy", {}).items()},
        errors=errors,
        comms=comms,
        phase_stream=stream_ordinals(timers),
        py_phases=python_phases(sections.get("python")),
        gpu=gpu_compact(gpu) if isinstance(gpu, dict) else {},
        drops={str(k): int(v) for k, v in (d.get("drops") or {}).items()},
        gpu_arrival=gpu_arrival_from_probe(d.get("gpu_arrival"), off),
        detail=detail,
    )


def _timer_from(t: Dict[str, Any]) -> Timer:
    stream = t.get("stream")
    return Timer(
        float(t["ms"]),
        int(str(t.get("start_event", "0")), 16),
        int(str(t.get("end_event", "0")), 16),
        None if stream is None else int(str(stream), 16),
    )


def errors_from_probe(errors: Dict[str, Any]) -> Dict[str, Dict[int, int]]:
    """A section's `errors` ({call: {"code": count}}) as RankStep.errors holds them."""
    return {str(call): {int(k): int(v) for k, v in codes.items()} for call, codes in errors.items()}


def step_phases(timers: List[Timer], wait_ns: int, duration_ns: int) -> Dict[str, int]:
    """RankStep.phases: timer<k> in ns, the host's wait on the GPU (syncs, launches that waited for
    a full queue), the rest of the step."""
    phases = {f"timer{i}": round(t.ms * 1e6) for i, t in enumerate(timers)}
    phases["host_wait"] = wait_ns
    phases["host_other"] = max(0, duration_ns - wait_ns)
    return phases


def python_phases(section: Any) -> Dict[str, int]:
    """RankStep.py_phases from the Python channel's section: its phases that took any time."""
    if not isinstance(section, dict):
        return {}
    return {str(k): int(v) for k, v in section.get("phases", {}).items() if int(v) > 0}


def nccl_from_probe(n: Dict[str, Any], off: int) -> Tuple[Dict[str, CommStep], NcclDetail]:
    """The probe's `nccl` section as CommSteps (realtime: `off` added) and the rest of it. The agent's
    tracker builds that section and converts it here too, so the two forms cannot drift."""
    info = n.get("comms", {})
    comms: Dict[str, CommStep] = {}
    details: Dict[str, CommDetail] = {}
    order: List[Tuple[str, int]] = []
    for comm, meta in info.items():  # in the printed order; one may have no record in the step
        comm = str(comm)
        comms[comm] = CommStep(
            comm, int(meta.get("nranks", -1)), int(meta.get("rank", -1)), str(meta.get("identity", "handle"))
        )
        first = int(meta.get("first_seq", -1))
        n_coll = meta.get("collectives")
        details[comm] = CommDetail(
            first,
            int(meta.get("last_seq", first)),
            int(meta.get("ops", -1)),
            None if n_coll is None else int(n_coll),
        )
    for a in n.get("arrivals", []):
        comm, seq, op, nbytes, enter, host = str(a[0]), int(a[1]), str(a[2]), int(a[3]), int(a[4]), int(a[5])
        extra = a[6:]  # [peer or root], ["g"]
        said = extra[0] if extra and not isinstance(extra[0], str) else None
        grouped = bool(extra) and extra[-1] == "g"
        c = comms.get(comm)
        if c is None:
            meta = info.get(comm, {})
            c = comms[comm] = CommStep(
                comm,
                int(meta.get("nranks", -1)),
                int(meta.get("rank", -1)),
                str(meta.get("identity", "handle")),
            )
            cd = details[comm] = CommDetail(int(meta.get("first_seq", seq)), int(meta.get("last_seq", seq)))
        else:
            cd = details[comm]
        if op in P2P:
            order.append((comm, -1 - len(c.p2p)))
            c.p2p.append(P2POp(op, -1 if said is None else int(said), nbytes, enter + off, host))
            cd.p2p_seqs.append(seq)
            cd.p2p_grouped.append(grouped)
        else:
            order.append((comm, len(c.seqs)))
            c.seqs.append(seq)
            c.ops.append(op)
            c.nbytes.append(nbytes)
            c.arrive_ns.append(enter + off)
            c.host_ns.append(host)
            cd.roots.append(None if said is None else int(said))
            cd.grouped.append(grouped)
    for key, c in comms.items():
        cd = details[key]
        if cd.collectives is not None and cd.collectives > len(c.seqs):  # every n-th (docs/schema.md)
            c.count, c.first_seq = cd.collectives, cd.first_seq
        if cd.ops == len(c.seqs) + len(c.p2p):
            cd.ops = -1  # what the instances say: not kept twice
    moved: Dict[str, List[int]] = {}  # comm -> new index of each collective, when sorting moved any
    for key, c in comms.items():
        seqs = c.seqs
        if all(seqs[i] <= seqs[i + 1] for i in range(len(seqs) - 1)):
            continue
        perm = sorted(range(len(seqs)), key=seqs.__getitem__)
        cd = details[key]
        for lst in (c.seqs, c.ops, c.nbytes, c.arrive_ns, c.host_ns, cd.roots, cd.grouped):
            _permute(lst, perm)
        where = [0] * len(perm)
        for new, old in enumerate(perm):
            where[old] = new
        moved[key] = where
    if moved:
        order = [(k, moved[k][i]) if i >= 0 and k in moved else (k, i) for k, i in order]
    return comms, NcclDetail(
        ops={
            str(op): OpTotals(int(v.get("count", 0)), int(v.get("bytes", 0)), int(v.get("host_ns", 0)))
            for op, v in n.get("ops", {}).items()
        },
        comms=details,
        order=order,
        groups=int(n.get("groups", 0)),
        calls={str(k): int(v) for k, v in n.get("calls", {}).items()},
        inits=[
            CommInit(
                str(i.get("call", "")),
                int(i.get("result", 0)),
                int(i.get("nranks", -1)),
                int(i.get("rank", -1)),
                None if i.get("comm") is None else str(i["comm"]),
            )
            for i in n.get("inits", [])
        ],
    )


def _permute(lst: List[Any], perm: List[int]) -> None:
    lst[:] = [lst[i] for i in perm]


def gpu_arrival_from_probe(g: Any, off: int) -> Optional[GpuArrival]:
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


def stream_ordinals(timers: List[Timer]) -> Dict[str, int]:
    """timer<k> -> 0 for the stream most timers end on (the first timer's on a tie), 1, 2, ... for the
    others in order of appearance; empty when a stream is unknown."""
    streams = [t.stream for t in timers]
    if not streams or None in streams:
        return {}
    counts: Dict[Optional[int], int] = {}
    for st in streams:
        counts[st] = counts.get(st, 0) + 1
    main = max(counts, key=lambda st: (counts[st], -streams.index(st)))
    order: Dict[Optional[int], int] = {main: 0}
    for st in streams:
        order.setdefault(st, len(order))
    return {f"timer{i}": order[st] for i, st in enumerate(streams)}


def probe_span(rs: RankStep) -> Tuple[int, int]:
    """The step's start and end on the agent's monotonic clock, as `--json` prints them."""
    start = rs.start_ns - rs.clock_offset_ns
    end = rs.detail.end_ns if rs.detail is not None else None
    return start, start + rs.duration_ns if end is None else end


def to_probe_json(rs: RankStep) -> Dict[str, Any]:
    """The `argus probe --json` object of a step (schema 1 of docs/probe.md), what `--json` prints:
    the agent's own steps and those `from_probe` read. Needs the detail (a step decoded from the
    wire has none: ValueError)."""
    det = rs.detail
    if det is None:
        raise ValueError(f"rank {rs.rank} step {rs.step}: no probe detail (a summary from the wire?)")
    off = rs.clock_offset_ns
    start, end = probe_span(rs)
    d: Dict[str, Any] = {
        "schema": PROBE_SCHEMA,
        "job": rs.job,
        "rank": rs.rank,
        "local_rank": rs.local_rank,
        "world_size": rs.world_size,
        "host": rs.host,
        "pid": rs.pid,
    }
    if det.ns_pid is not None:
        d["ns_pid"] = det.ns_pid
    if det.rank_from is not None:
        d["identity"] = {"rank": det.rank_from, "why": det.identity_why}
    d["step"] = rs.step
    d["step_source"] = rs.step_source
    d["start_ns"] = start
    d["end_ns"] = end
    d["duration_ns"] = rs.duration_ns
    d["wall_offset_ns"] = off
    if det.period is not None:
        p = det.period
        d["period"] = {"syncs_per_step": p.syncs_per_step, "confidence": p.confidence, "source": p.source}
    cu = det.cuda
    launches: Dict[str, Any] = {
        "total": rs.launches,
        "by_kernel": dict(rs.kernels),
        "api_ns_log2_hist": {str(k): v for k, v in cu.launch_hist.items()},
    }
    if cu.sampled_said:
        launches["sampled"] = rs.launches_sampled
    if rs.launch_wait_ns:
        launches["wait_ns"] = rs.launch_wait_ns
    d["cuda"] = {
        "launches": launches,
        "sync": {
            "count": rs.sync_count,
            "wait_ns": rs.sync_wait_ns,
            "by_call": {k: {"count": c, "wait_ns": w} for k, (c, w) in cu.sync_by_call.items()},
        },
        "memcpy": {k: {"count": c, "bytes": b} for k, (c, b) in rs.memcpy.items()},
        "memory": {k: {"count": c, "bytes": b} for k, (c, b) in cu.memory.items()},
        "timers": [_timer_json(t) for t in cu.timers],
        "event_records": cu.event_records,
        "errors": _errors_json(rs.errors, "cuda"),
    }
    d["cudart"] = {"calls": dict(cu.runtime_calls), "errors": _errors_json(rs.errors, "cudart")}
    d["nccl"] = _nccl_json(rs, det.nccl, off)
    if rs.drops:
        d["drops"] = dict(rs.drops)
    if rs.gpu_arrival is not None:
        d["gpu_arrival"] = _gpu_arrival_json(rs.gpu_arrival, off)
    d.update(det.sections)
    d["wall_offset_err_ns"] = rs.clock_uncertainty_ns
    if det.gpu is not None:
        d["gpu"] = det.gpu
    return d


def _timer_json(t: Timer) -> Dict[str, Any]:
    out: Dict[str, Any] = {"ms": t.ms, "start_event": f"{t.start_event:#x}", "end_event": f"{t.end_event:#x}"}
    if t.stream is not None:
        out["stream"] = f"{t.stream:#x}"
    return out


def _errors_json(errors: Dict[str, Dict[int, int]], channel: str) -> Dict[str, Dict[str, int]]:
    return {
        call: {str(k): v for k, v in codes.items()}
        for call, codes in errors.items()
        if error_channel(call) == channel
    }


def _nccl_json(rs: RankStep, n: NcclDetail, off: int) -> Dict[str, Any]:
    comms: Dict[str, Any] = {}
    for key, c in rs.comms.items():
        cd = n.comms[key]
        comms[key] = {
            "nranks": c.nranks,
            "rank": c.rank,
            "identity": c.identity,
            "ops": cd.ops if cd.ops >= 0 else len(c.seqs) + len(c.p2p),
            "first_seq": cd.first_seq,
            "last_seq": cd.last_seq,
        }
        if cd.collectives is not None:
            comms[key]["collectives"] = cd.collectives
    arrivals: List[List[Any]] = []
    for key, i in n.order:
        c, cd = rs.comms[key], n.comms[key]
        if i >= 0:
            a: List[Any] = [key, c.seqs[i], c.ops[i], c.nbytes[i], c.arrive_ns[i] - off, c.host_ns[i]]
            root = cd.roots[i]
            if root is not None:
                a.append(root)
            if cd.grouped[i]:
                a.append("g")
        else:
            j = -1 - i
            p = c.p2p[j]
            a = [key, cd.p2p_seqs[j], p.op, p.nbytes, p.arrive_ns - off, p.host_ns, p.peer]
            if cd.p2p_grouped[j]:
                a.append("g")
        arrivals.append(a)
    return {
        "ops": {k: {"count": o.count, "bytes": o.nbytes, "host_ns": o.host_ns} for k, o in n.ops.items()},
        "comms": comms,
        "arrivals": arrivals,
        "groups": n.groups,
        "errors": _errors_json(rs.errors, "nccl"),
        "calls": dict(n.calls),
        "inits": [
            {"call": i.call, "result": i.result, "nranks": i.nranks, "rank": i.rank, "comm": i.comm}
            for i in n.inits
        ],
    }


def _gpu_arrival_json(g: GpuArrival, off: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"step": g.step}
    if g.bounds:
        out["bounds"] = {
            c: [[i, lo - off, hi - off if hi else 0, src] for i, lo, hi, src in v]
            for c, v in g.bounds.items()
        }
    if g.net_first_ns:
        out["net_first_ns"] = g.net_first_ns - off
    if g.coll_gpu_ns:
        out["coll_gpu_ns"] = {c: list(v) for c, v in g.coll_gpu_ns.items()}
    return out


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
