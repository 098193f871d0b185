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
