"""Run a simulated job with the probe attached and collect what the aggregator consumes: the step
summaries of `argus probe --json` and, for hangs, heartbeats built from the probing session itself
(argus.agent.redisout.heartbeats: in-flight calls and last collective sequence per communicator).
"""

from __future__ import annotations

import statistics
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
    probe_stderr: str = ""
    ready_ns: Optional[int] = None  # realtime when the agent was attached and ready
    raw: List[dict] = field(default_factory=list)  # what `argus probe --json` printed

    @property
    def steps(self) -> List[RankStep]:
        return [x for x in self.items if isinstance(x, RankStep)]


def collect_steps(cfg: SimConfig, python: bool = True) -> Collected:
    """`argus probe --json` attached before the first CUDA call (every default channel unless not
    `python`); summaries sorted by (step, rank)."""
    job, probe = probed_run(cfg, *(() if python else ("--no-python",)))
    steps = [from_probe(d) for d in probe.steps() if d.get("step") is not None]
    steps.sort(key=lambda rs: (rs.step or 0, rs.rank))
    return Collected(job, job.truth(), list(steps))


def collect_with_heartbeats(cfg: SimConfig, hold_s: float = 4.0, hb_every_s: float = 0.5) -> Collected:
    """Probe in-process (the agent's Session) so heartbeats can be built while the job hangs; the
    simulated job is gated (the agent attaches before its first CUDA call) and stopped `hold_s`
    after a rank reported its injected hang (or when it ends)."""
    cfg.gate = True
    job = SimJob(cfg).start()
    try:
        job.wait_loaded()
        out = _probe_in_process(job, hold_s, hb_every_s, release=True)
        out.truth = job.truth()
        return out
    finally:
        job.stop()


def collect_hang(
    family: str,
    ranks: int,
    steps: int,
    layout: str,
    inject: str,
    attach_after_hang_s: Optional[float] = None,
    attach_at_step: Optional[int] = None,
    hold_s: float = 25.0,
    hb_every_s: float = 0.5,
) -> Collected:
    """A hang in a job of either family (tests/families.py), the agent (in-process Session, with
    heartbeats) arriving late: `attach_after_hang_s` after the hang began (it is in progress at
    attach), or once the job reached `attach_at_step` (before the hang; its communicators were
    created long before either way). `ready_ns`: the agent attached; `hang_seen_ns`: the hung rank's
    ground truth appeared. Held `hold_s` after the later of the two."""
    from tests import families

    job = families.start_job(family, ranks, steps, layout, [inject], hang_hold_s=600.0)
    try:
        seen: Optional[int] = None
        if attach_after_hang_s is not None:
            deadline = time.monotonic() + 120.0
            while not families.hang_started(job):
                assert time.monotonic() < deadline, "the injected hang did not happen"
                time.sleep(0.05)
            seen = time.time_ns()
            time.sleep(attach_after_hang_s)
        else:
            families.wait_step(job, attach_at_step or 0)
        out = _probe_in_process(job, hold_s, hb_every_s, release=False, hang_seen_ns=seen)
        out.truth = job.truth()
        out.truth["steps"] = families.step_times(job)
        return out
    finally:
        job.stop()


def _probe_in_process(
    job: Any, hold_s: float, hb_every_s: float, release: bool, hang_seen_ns: Optional[int] = None
) -> Collected:
    from argus.agent import identity
    from argus.agent.redisout import heartbeats
    from argus.agent.session import Session
    from tests import families

    out = Collected(job, {}, hang_seen_ns=hang_seen_ns)
    s: Any = None
    try:
        s = Session()
        for pid in job.pids.values():
            s.add(pid, identity.of_pid(pid, None, None, "node-0"))
        out.ready_ns = time.time_ns()
        if release:
            job.release()
        next_drain = next_hb = time.monotonic()
        deadline = time.monotonic() + 300.0
        hang_at: Optional[float] = time.monotonic() if hang_seen_ns is not None else None
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
            if hang_at is None and families.hang_started(job):
                hang_at = now
                out.hang_seen_ns = time.time_ns()
            if hang_at is not None and now - hang_at >= hold_s:
                job.hung = True
                break
            if all(p.poll() is not None for p in _procs(job)):
                break
        return out
    finally:
        if s is not None:
            s.close(background=True)


def _procs(job: Any) -> List[Any]:
    if hasattr(job, "procs"):
        return list(job.procs.values())
    return [r.proc for r in job._ranks.values()]


def onset(truth: dict) -> Tuple[str, List[int], int]:
    """(kind, ranks, onset step) of the single injected fault."""
    (f,) = truth["faults"]
    return f["kind"], list(f["ranks"]), int(f["onset_step"])


def collect_late(
    family: str,
    ranks: int,
    steps: int,
    layout: str,
    injects: List[str],
    attach_at_step: int,
    probe_s: float,
    python: bool = True,
    run_dir: Optional[str] = None,
    **extra: Any,
) -> Collected:
    """The job (of either family, tests/families.py) starts unprobed; `argus probe --json` attaches
    once it reached `attach_at_step` (every communicator was created long before) and traces for
    `probe_s`. Summaries in the order the agent printed them; `truth["steps"]` maps each rank's
    trainer steps to their CLOCK_MONOTONIC start/end; `ready_ns` is when the probe said Tracing."""
    from tests import families
    from tests.probing import ProbeProc

    job = families.start_job(family, ranks, steps, layout, injects, run_dir, **extra)
    try:
        families.wait_step(job, attach_at_step)
        probe = ProbeProc(job.pids.values(), "-d", f"{probe_s}s", *(() if python else ("--no-python",)))
        probe.wait_for("Tracing")
        ready = time.time_ns()
        rc = probe.wait(timeout=probe_s + 120)
        assert rc == 0, probe.stderr
        out = Collected(job, job.truth())
        out.raw = probe.steps()
        out.items = [from_probe(d) for d in out.raw if d.get("step") is not None]
        out.truth["steps"] = families.step_times(job)
        out.probe_stderr = probe.stderr
        out.ready_ns = ready
        return out
    finally:
        job.stop()


def trainer_step(c: Collected, rs: RankStep) -> Optional[int]:
    """The trainer step a summary ended in (its end-of-step sync returns inside the trainer's step)."""
    from tests.families import trainer_step_at

    return trainer_step_at(c.truth["steps"], rs.rank, rs.end_ns - rs.clock_offset_ns)


def job_slowed(c: Collected, first: int, last: int) -> float:
    """The job's own step time (its slowest rank, from the trainer's records) over trainer steps
    first..last, over the 30 steps before: whether a job-level step-time alert is true. On this
    shared 2-core VM the whole job does slow down at times (CPU steal), and saying so is right."""
    from tests.families import step_times

    times = c.truth.get("steps")  # collect_late's; the simulator's own truth has a step count there
    if not isinstance(times, dict):
        times = step_times(c.job)
    per: dict = {}
    for rows in times.values():
        for s, start, end in rows:
            per[s] = max(per.get(s, 0), end - start)
    during = [per[s] for s in range(first, last + 1) if s in per]
    before = [per[s] for s in range(first - 30, first) if s in per]
    return statistics.median(during) / statistics.median(before) if during and before else 0.0


def rank_was_slow(c: Collected, rank: int, at: Optional[int], ratio: float = 1.3) -> bool:
    """In at least 3 of the 4 steps up to `at`, one of the rank's phases, as the trainer itself timed
    it, took `ratio` x the median of the ranks that do the same work (their median over the run
    within 20% of its own: its stage). Measured on clean pp-dp runs: 0 of 1,104 rank-steps pass
    this idle, 4-8 of 1,104 with one or two busy loops beside the job; all 4 rank alerts of 8
    such busy runs passed it (docs/benchmarks.md 8.14)."""
    ranks = getattr(c.job, "ranks", None)
    if at is None or not isinstance(ranks, dict):
        return False  # (a job without the simulator's records: nothing to tell it by)
    timers = {r: {x["step"]: x.get("timers_ms") or {} for x in rs.records} for r, rs in ranks.items()}
    typical = {  # rank -> phase -> its median over the run
        r: {
            p: statistics.median([x[p] for x in t.values() if p in x])
            for p in {p for x in t.values() for p in x}
        }
        for r, t in timers.items()
    }
    slow = 0
    for step in range(at - 3, at + 1):
        for phase, v in timers[rank].get(step, {}).items():
            if phase == "grad_sync":  # a wait: the slow rank's peers wait longer there
                continue
            mine = typical[rank][phase]
            peers = [
                t[step][phase]
                for r, t in timers.items()
                if phase in t.get(step, {}) and abs(typical[r][phase] - mine) <= 0.2 * mine
            ]
            if len(peers) >= 3 and v >= ratio * statistics.median(peers):
                slow += 1
                break
    return slow >= 3
