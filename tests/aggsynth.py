"""Synthetic `argus probe --json` objects of a small job, for unit tests of the aggregator (no root).

The model follows the simulated trainer (argus/sim/trainer.py): per step each rank loads data on
the host, enqueues forward and backward (the host runs ahead of the GPU, so its arrival at the
all-reduces is a host time), and the GPU runs forward (timer0), backward (timer1), optimizer
(timer2); the all-reduces run on the communication stream (timer3, from the rank's own first
gradient bucket to the last all-reduce's end, which is common to the group) and every rank ends
the step when the slowest rank's last all-reduce is done. Layout "pp-dp" pairs ranks (2k, 2k+1)
as pipeline stages joined by Send/Recv; a stage-1 rank slower in backward makes its stage-0 peer
wait in Recv inside its own backward.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

MS = 1_000_000
T0 = 1_800_000_000 * 10**9  # a realtime in 2027
COMPUTE = "0x7f0000001000"
COMM_STREAM = "0x7f0000002000"


@dataclass
class Faults:
    straggler: Optional[Tuple[int, float, int]] = None  # rank, factor on forward+backward, from step
    straggler_off: Tuple[int, ...] = ()  # steps in which the straggler runs at normal speed
    host_stall: Optional[Tuple[int, int, float, int]] = None  # rank, step, ms, steps
    slow_comm: Optional[Tuple[float, int]] = None  # factor on the collective itself, from step
    bubble: Optional[Tuple[int, float, int]] = None  # stage-1 rank, backward factor, from step (pp-dp)
    link: Optional[Tuple[int, int, float, int]] = None  # pp-dp peers a, b, extra ms per phase, from step
    drift: Optional[Tuple[int, float, int]] = None  # rank, small backward factor, from step
    spike: Optional[Tuple[int, float]] = None  # step, ms added to every rank's step (job-wide pause)
    # rank, from step, steps, ms: its host was descheduled while launching forward (CPU contention):
    # the GPU idled waiting for the launches, and the host's own time grew by as much
    contention: Optional[Tuple[int, int, int, float]] = None
    stream_info: bool = True


@dataclass
class Job:
    ranks: int = 8
    steps: int = 40
    layout: str = "dp"
    seed: int = 1
    faults: Faults = field(default_factory=Faults)
    job: str = "synth"
    buckets: int = 8
    fwd_ms: float = 18.4
    bwd_ms: float = 34.1
    opt_ms: float = 1.7
    comm_ms: float = 30.0
    data_ms: float = 5.0
    # each rank's communication timer off by up to this (a timer's noise on a shared host: which rank
    # waited least by a margin is then chance, though the straggler still waits less than most)
    comm_jitter_ms: float = 0.0


def _comm_ids(j: Job) -> Dict[str, List[List[int]]]:
    if j.layout == "dp":
        return {"dp": [list(range(j.ranks))]}
    return {
        "dp": [list(range(0, j.ranks, 2)), list(range(1, j.ranks, 2))],
        "pp": [[2 * k, 2 * k + 1] for k in range(j.ranks // 2)],
    }


def generate(j: Job) -> List[dict]:
    rng = random.Random(j.seed)
    f = j.faults
    groups = _comm_ids(j)
    cid: Dict[Tuple[str, int], str] = {}
    for kind, gs in groups.items():
        for gi, g in enumerate(gs):
            for r in g:
                cid[(kind, r)] = f"{zlib.crc32(f'{j.job}/{kind}'.encode()):08x}{gi:08x}"
    out: List[dict] = []
    t = T0
    for s in range(j.steps):
        fwd: Dict[int, float] = {}
        bwd: Dict[int, float] = {}
        host_extra: Dict[int, float] = {}
        host_busy_extra: Dict[int, float] = {}
        for r in range(j.ranks):
            k = 1.0
            if f.straggler and r == f.straggler[0] and s >= f.straggler[2] and s not in f.straggler_off:
                k = f.straggler[1]
            gap = rng.choice([0.0] * 12 + [rng.uniform(0.5, 4.0)])  # occasional host launch gaps
            fwd[r] = j.fwd_ms * k + gap
            cn = f.contention
            busy = cn[3] if cn and r == cn[0] and cn[1] <= s < cn[1] + cn[2] else 0.0
            fwd[r] += busy
            b = j.bwd_ms * k
            if f.drift and r == f.drift[0] and s >= f.drift[2]:
                b *= f.drift[1]
            bwd[r] = b + rng.uniform(0.0, 0.2)
            hs = f.host_stall
            host_extra[r] = hs[2] if hs and r == hs[0] and hs[1] <= s < hs[1] + hs[3] else 0.0
            host_busy_extra[r] = busy
        if j.layout == "pp-dp":
            for a in range(0, j.ranks, 2):
                b1 = a + 1
                bwd[a] += 0.4 * j.bwd_ms  # stage 0 waits in Recv for stage 1's first gradients
                if f.bubble and b1 == f.bubble[0] and s >= f.bubble[2]:
                    extra = j.bwd_ms * (f.bubble[1] - 1)
                    bwd[b1] += extra
                    bwd[a] += extra  # stage 0 waits in Recv for stage 1's gradients
                if f.link and {a, b1} == {f.link[0], f.link[1]} and s >= f.link[3]:
                    for r in (a, b1):
                        fwd[r] += f.link[2]
                        bwd[r] += f.link[2]
        comm = j.comm_ms * (f.slow_comm[0] if f.slow_comm and s >= f.slow_comm[1] else 1.0)
        ready = {r: host_extra[r] + fwd[r] + bwd[r] / j.buckets for r in range(j.ranks)}
        # every rank of a DP group waits for the latest one; the job ends with its slowest group
        end_comm: Dict[int, float] = {}
        for g in groups["dp"]:
            last = max(ready[r] for r in g)
            for r in g:
                end_comm[r] = last + comm + rng.uniform(0.0, 0.3)
        step_ms = max(end_comm.values()) + j.opt_ms + j.data_ms + rng.uniform(0.0, 0.8)
        if f.spike and s == f.spike[0]:
            step_ms += f.spike[1]
        dur = int(step_ms * MS)
        for r in range(j.ranks):
            start = t + int(rng.uniform(0, 0.3) * MS)
            enq = start + int((j.data_ms + host_extra[r] + rng.uniform(0.5, 2.5)) * MS)
            arrivals: List[list] = []
            dp = cid[("dp", r)]
            size = next(len(g) for g in groups["dp"] if r in g)
            base = s * j.buckets
            for k in range(j.buckets):
                arrivals.append(
                    [dp, base + k, "AllReduce", 16 << 20, enq + k * 60_000 + rng.randrange(20_000), 2_000]
                )
            comms = {dp: {"nranks": size, "rank": r // (2 if j.layout == "pp-dp" else 1), "identity": "init"}}
            if j.layout == "pp-dp":
                pp = cid[("pp", r)]
                me = r % 2
                comms[pp] = {"nranks": 2, "rank": me, "identity": "init"}
                for mb in range(4):
                    op = "Send" if me == 0 else "Recv"
                    arrivals.append([pp, 0, op, 4 << 20, enq + mb * 10_000, 3_000, 1 - me, "g"])
                    op = "Recv" if me == 0 else "Send"
                    arrivals.append([pp, 0, op, 4 << 20, enq + 100_000 + mb * 10_000, 3_000, 1 - me, "g"])
            comm_timer = end_comm[r] - (host_extra[r] + fwd[r] + bwd[r] / j.buckets)
            if j.comm_jitter_ms:  # (only then: the other tests' random draws stay as they were)
                comm_timer += rng.uniform(-j.comm_jitter_ms, j.comm_jitter_ms)
            timers = [
                {"ms": fwd[r], "stream": COMPUTE},
                {"ms": bwd[r], "stream": COMPUTE},
                {"ms": j.opt_ms, "stream": COMPUTE},
                {"ms": comm_timer, "stream": COMM_STREAM if f.stream_info else COMPUTE},
            ]
            host_busy = (j.data_ms + host_extra[r] + host_busy_extra[r] + 3.0) * MS
            wait = max(0, dur - int(host_busy))
            out.append(
                {
                    "schema": 1,
                    "job": j.job,
                    "rank": r,
                    "world_size": j.ranks,
                    "host": f"node-{r // 4}",
                    "pid": 1000 + r,
                    "step": s,
                    "step_source": "nccl-seq",
                    "start_ns": start,
                    "duration_ns": dur,
                    "wall_offset_ns": 0,
                    "cuda": {
                        "launches": {"total": 165, "by_kernel": {"gemm": 165}},
                        "sync": {"count": 1, "wait_ns": wait},
                        "timers": timers,
                    },
                    "nccl": {"comms": comms, "arrivals": arrivals},
                }
            )
        t += dur + 200_000
    return out


def steps(j: Job) -> list:
    from argus.schema import from_probe

    return [from_probe(d) for d in generate(j)]


def judge(items: Iterable[Any], th: Optional[Any] = None) -> Any:
    """An aggregator engine (the trainer's phase names) fed `items` (summaries and heartbeats), flushed."""
    from argus.aggregator.config import PhaseInfo
    from argus.aggregator.engine import Engine

    eng = Engine(th, PhaseInfo.parse("forward,backward,optimizer,grad_sync"))
    for x in items:
        eng.add(x)
    eng.flush()
    return eng


# ---- GPU arrival: a data-parallel job without timers (docs/diagnosis.md "Which GPU arrived last") ----


@dataclass
class GpuJob:
    """A DDP-like job whose GPU timeline is modelled per gradient bucket: rank r's GPU reaches
    bucket b's all-reduce once its forward and b+1 buckets of backward ran (and the previous
    all-reduce ended); the all-reduce starts when the last member reached it and ends together on
    every rank. Hosts enqueue everything within milliseconds of the step's start (NCCL's
    enqueue-and-return), so host arrivals say nothing of the GPUs. What the summaries carry of the
    GPU is chosen per test: CUDA-event timers, and the agent's GPU-arrival evidence one step late
    (first network send, event-query bounds tight or loose, in-collective GPU times)."""

    ranks: int = 8
    hosts: int = 2
    steps: int = 40
    seed: int = 1
    job: str = "gpu-synth"
    slow: Optional[Tuple[int, float, int]] = None  # rank, factor on its GPU's compute, from step
    fwd_ms: float = 95.0
    bwd_ms: float = 85.0
    buckets: int = 4
    coll_ms: float = 6.0  # one all-reduce's own time
    data_ms: float = 10.0
    opt_ms: float = 5.0
    timers: bool = False
    net: bool = False  # the proxy's first network send (the group spans hosts)
    net_jitter_ms: float = 0.05  # its latency after the GPU's arrival: uniform in [0, this]
    net_bias_ms: Dict[int, float] = field(default_factory=dict)  # rank -> later by this (a slow proxy)
    # "" | "tight" (event queries around the arrival) | "loose" (host enqueue .. end event) | "paced"
    # (a launch-bound host: queries beside the arrival at the first bucket, the rest bounded by the end)
    # | "coarse" (queries every `query_ms` at their own phase: bounds as wide as a lateness)
    bounds: str = ""
    query_ms: float = 30.0
    coll_times: bool = False  # in-collective GPU times (TORCH_NCCL_ENABLE_TIMING=1)
    clock_ms: Dict[str, float] = field(default_factory=dict)  # host -> its clock ahead by this
    clock_err_ms: Dict[str, float] = field(default_factory=dict)  # host -> its agents' clock error bound
    host_of: Dict[int, str] = field(default_factory=dict)  # rank -> host (else spread evenly over `hosts`)
    # rank -> the job step its agent attached at: its summaries start there, numbered from 0
    # (`ordinal`: the aggregator aligns them by their step ends), its evidence a step later
    attach: Dict[int, int] = field(default_factory=dict)
    # (rank, step) -> its host launched the step's work this much later (ms): CPU contention, which
    # delays its GPU as much and shows in the host's own time
    host_late: Dict[Tuple[int, int], float] = field(default_factory=dict)
    # every rank's GPU starts each step's work up to this much later (uniform, ms), its host's time
    # unchanged: a GPU-side delay, now one rank, now another (the simulator's GPU is a CPU thread:
    # 8 launch-bound ranks and the agent on 2 CPUs delay it by tens of ms)
    gpu_jitter_ms: float = 0.0
    # rank -> its host's own time is this much longer every step, its work launched in time (a
    # launch-bound host on a busy machine); rank -> its launches wait this long a step for a full
    # launch queue (`launches.wait_ns`; "*": every other rank)
    host_busy_ms: Dict[int, float] = field(default_factory=dict)
    launch_wait_ms: Dict[Any, float] = field(default_factory=dict)


def generate_gpu(j: GpuJob) -> List[dict]:
    rng = random.Random(j.seed)
    comm = f"{zlib.crc32(f'{j.job}/dp'.encode()):08x}00000000"
    per_host = -(-j.ranks // j.hosts)
    host = {r: j.host_of.get(r, f"node-{r // per_host}") for r in range(j.ranks)}
    out: List[dict] = []
    prev_ev: Dict[int, dict] = {}
    t = T0
    for s in range(j.steps):
        start = {r: t + int(rng.uniform(0, 0.3) * MS) for r in range(j.ranks)}
        held = {r: int(j.host_late.get((r, s), 0.0) * MS) for r in range(j.ranks)}
        gpu0 = {r: start[r] + held[r] + int((j.data_ms + rng.uniform(0.5, 1.5)) * MS) for r in range(j.ranks)}
        if j.gpu_jitter_ms:
            gpu0 = {r: t0 + int(rng.uniform(0.0, j.gpu_jitter_ms) * MS) for r, t0 in gpu0.items()}
        k = {r: (j.slow[1] if j.slow and r == j.slow[0] and s >= j.slow[2] else 1.0) for r in range(j.ranks)}
        fwd = {r: j.fwd_ms * k[r] + rng.uniform(0.0, 0.2) for r in range(j.ranks)}
        bwd = {r: j.bwd_ms * k[r] + rng.uniform(0.0, 0.2) for r in range(j.ranks)}
        reach: Dict[int, List[int]] = {r: [] for r in range(j.ranks)}  # GPU reached bucket b's all-reduce
        # ... and its compute stream produced bucket b (where PyTorch records the event the NCCL
        # stream waits for: what event-query bounds bound, however long the previous all-reduce ran)
        ready_at: Dict[int, List[int]] = {r: [] for r in range(j.ranks)}
        ends: List[int] = []
        end_prev = 0
        for b in range(j.buckets):
            for r in range(j.ranks):
                ready = gpu0[r] + int((fwd[r] + (b + 1) * bwd[r] / j.buckets) * MS)
                reach[r].append(max(ready, end_prev))
                ready_at[r].append(ready)
            begin = max(reach[r][b] for r in range(j.ranks))
            end_prev = begin + int((j.coll_ms + rng.uniform(0.0, 0.1)) * MS)
            ends.append(end_prev)
        fin = end_prev + int(j.opt_ms * MS)
        enq = {r: gpu0[r] + int(rng.uniform(1.0, 2.5) * MS) for r in range(j.ranks)}
        for r in range(j.ranks):
            c = int(j.clock_ms.get(host[r], 0.0) * MS)  # every realtime stamp of its host
            at = j.attach.get(r, 0)
            if s < at:
                continue
            end = fin + int(rng.uniform(0.0, 0.2) * MS)
            dur = end - start[r]
            arrivals = [
                [comm, (s - at) * j.buckets + b, "AllReduce", 16 << 20, enq[r] + b * 60_000 + c, 2_000]
                for b in range(j.buckets)
            ]
            timers = []
            if j.timers:
                ct = ends[-1] - reach[r][0]
                timers = [
                    {"ms": fwd[r], "stream": COMPUTE},
                    {"ms": bwd[r], "stream": COMPUTE},
                    {"ms": j.opt_ms, "stream": COMPUTE},
                    {"ms": ct / MS, "stream": COMM_STREAM},
                ]
            busy = int((j.data_ms + 3.0 + j.host_busy_ms.get(r, 0.0)) * MS) + held[r]
            lw = int(j.launch_wait_ms.get(r, j.launch_wait_ms.get("*", 0.0)) * MS)
            d: Dict[str, Any] = {
                "schema": 1,
                "job": j.job,
                "rank": r,
                "world_size": j.ranks,
                "host": host[r],
                "pid": 1000 + r,
                "step": s - at,
                "step_source": "ordinal" if r in j.attach else "nccl-seq",
                "start_ns": start[r] + c,
                "duration_ns": dur,
                "wall_offset_ns": 0,
                "wall_offset_err_ns": int(j.clock_err_ms.get(host[r], 0.0) * MS),
                "cuda": {
                    "launches": {"total": 165, "by_kernel": {"gemm": 165}, "wait_ns": lw},
                    "sync": {"count": 1, "wait_ns": max(0, dur - busy - lw)},
                    "timers": timers,
                },
                "nccl": {
                    "comms": {comm: {"nranks": j.ranks, "rank": r, "identity": "init"}},
                    "arrivals": arrivals,
                },
            }
            if r in prev_ev:
                d["gpu_arrival"] = prev_ev[r]
            # this step's evidence, carried by the next summary
            ev: Dict[str, Any] = {"step": s - at}
            if j.net:
                lat = rng.uniform(0.0, j.net_jitter_ms) + j.net_bias_ms.get(r, 0.0)
                ev["net_first_ns"] = reach[r][0] + int(lat * MS) + c
            if j.bounds == "paced":
                tight = reach[r][0] - int(rng.uniform(0.05, 0.4) * MS), reach[r][0] + int(0.3 * MS)
                rows = [[0, tight[0] + c, tight[1] + c, "qq"]]
                rows += [[b, tight[0] + c, ends[b] + c, "qe"] for b in range(1, j.buckets)]
                ev["bounds"] = {comm: rows}
            elif j.bounds == "coarse":  # an allocator polling every `query_ms`, at its own phase
                ev["bounds"] = {comm: []}
                for b in range(j.buckets):
                    lo = ready_at[r][b] - int(rng.uniform(0.0, j.query_ms) * MS)
                    ev["bounds"][comm].append([b, lo + c, lo + int(j.query_ms * MS) + c, "qq"])
            elif j.bounds == "tight":
                ev["bounds"] = {
                    comm: [
                        [
                            b,
                            ready_at[r][b] - int(rng.uniform(0.05, 0.4) * MS) + c,
                            ready_at[r][b] + int(rng.uniform(0.05, 0.4) * MS) + c,
                            "qq",
                        ]
                        for b in range(j.buckets)
                    ]
                }
            elif j.bounds == "loose":
                ev["bounds"] = {
                    comm: [
                        [b, enq[r] + b * 60_000 + c, ends[b] + int(rng.uniform(0.0, 0.5) * MS) + c, "he"]
                        for b in range(j.buckets)
                    ]
                }
            if j.coll_times:
                ev["coll_gpu_ns"] = {comm: [ends[b] - reach[r][b] for b in range(j.buckets)]}
            if len(ev) > 1:  # the agent sends none when it has nothing
                prev_ev[r] = ev
            out.append(d)
        t = fin + int(0.5 * MS)
    return out


def gpu_steps(j: GpuJob) -> list:
    from argus.schema import from_probe

    return [from_probe(d) for d in generate_gpu(j)]
