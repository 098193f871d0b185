"""Run a simulated job with the probe attached and collect what the aggregator consumes: the step
summaries of `argus probe --json` and, for hangs, heartbeats built from the probing session itself
(argus.agent.redisout.heartbeats: in-flight calls and last collective sequence per communicator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

from argus.schema import Heartbeat, RankStep, from_probe
from argus.sim.launcher import SimConfig, SimJob
from tests.probing import probed_run

Item = Union[RankStep, Heartbeat]


@dataclass
class Collected:
    job: SimJob
    truth: dict
    items: List[Item] = field(default_factory=list)  # in the order they became available
    hang_seen_ns: Optional[int] = None  # realtime when the hung rank's ground truth appeared

    @property
    def steps(self) -> List[RankStep]:
        return [x for x in self.items if isinstance(x, RankStep)]


def collect_steps(cfg: SimConfig, python: bool = False) -> Collected:
    """`argus probe --json` attached before the first CUDA call; summaries sorted by (step, rank).

    The Python channel is off unless `python`: its stack walks add host-side jitter to the
    simulated ranks (8 on 2 cores) that, in CI, raised false straggler alerts in clean pipeline
    runs about once per suite (measured before the walks were sampled; docs/diagnosis.md)."""
    job, probe = probed_run(cfg, *(() if python else ("--no-python",)))
    steps = [from_probe(d) for d in probe.steps() if d.get("step") is not None]
    steps.sort(key=lambda rs: (rs.step or 0, rs.rank))
    return Collected(job, job.truth(), list(steps))


def collect_with_heartbeats(cfg: SimConfig, hold_s: float = 4.0, hb_every_s: float = 0.5) -> Collected:
    """Probe in-process (the agent's Session) so heartbeats can be built while the job hangs; the
    job is stopped `hold_s` after a rank reported its injected hang (or when it ends)."""
    from argus.agent import identity
    from argus.agent.redisout import heartbeats
    from argus.agent.session import Session

    cfg.gate = True
    job = SimJob(cfg).start()
    out = Collected(job, {})
    s: Any = None
    try:
        job.wait_loaded()
        s = Session()
        for pid in job.pids.values():
            s.add(pid, identity.of_pid(pid, None, None, "node-0"))
        job.release()
        next_drain = next_hb = time.monotonic()
        deadline = time.monotonic() + 120.0 + cfg.steps
        hang_at: Optional[float] = None
        while time.monotonic() < deadline:
            time.sleep(0.05)
            s.consume()
            now = time.monotonic()
            if now >= next_drain:
                next_drain = now + 0.25
                s.drain()
                fresh: List[RankStep] = [from_probe(d) for d in s.steps() if d.get("step") is not None]
                fresh.sort(key=lambda rs: (rs.step or 0, rs.rank))
                out.items += fresh
            if now >= next_hb:
                next_hb = now + hb_every_s
                out.items += heartbeats(s, "node-0:test", "node-0")
            job.poll()
            if hang_at is None and any(rs.hang for rs in job.ranks.values()):
                hang_at = now
                out.hang_seen_ns = time.time_ns()
            if hang_at is not None and now - hang_at >= hold_s:
                job.hung = True
                break
            if all(p.poll() is not None for p in job.procs.values()):
                break
        out.truth = job.truth()
        return out
    finally:
        job.stop()
        if s is not None:
            s.close(background=True)


def onset(truth: dict) -> Tuple[str, List[int], int]:
    """(kind, ranks, onset step) of the single injected fault."""
    (f,) = truth["faults"]
    return f["kind"], list(f["ranks"]), int(f["onset_step"])
