"""Two independent families of stand-in libraries behind one small interface, for tests and
benchmarks that must pass on both: the project's simulator (argus/sim: asynchronous collectives,
here with Megatron-style CUDA-event timers unless `timers=False`, symbols) and the second
stand-ins (tests/standins: blocking collectives, their own ncclComm layout, stripped, no events;
`variant="async"`: enqueued collectives, events, two hosts). Nothing in the tracer or aggregator
knows either.

    job = start_job("standins", ranks=8, steps=200, layout="pp-dp", injects=["slow_link:ranks=2-3,factor=4"])
    step_times(job)   # rank -> [(trainer step, start, end)], CLOCK_MONOTONIC ns
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

FAMILIES = ("sim", "standins")
# GPU timer names the simulated trainer reads (timer0..3); the stand-ins record none
PHASES = {"sim": "forward,backward,optimizer,grad_sync", "standins": ""}


def start_job(
    family: str,
    ranks: int,
    steps: int,
    layout: str = "dp",
    injects: Optional[List[str]] = None,
    run_dir: Optional[str] = None,
    gate: bool = False,
    hang_hold_s: float = 10.0,
    **extra: Any,
) -> Any:
    """A started job of either family (with `gate`, ranks wait for `job.release()` before their
    first CUDA call, after mapping the libraries); `extra` goes to the family's config (e.g. the
    stand-ins' `variant="async"`, the simulator's `timers`)."""
    injects = list(injects or [])
    if family == "sim":
        from argus.sim.launcher import SimConfig, SimJob

        extra = {"timers": True, "preset": "small", **extra}  # the "sim" family: a Megatron-style job
        cfg = SimConfig(
            ranks=ranks,
            steps=steps,
            layout=layout,
            injects=injects,
            run_dir=run_dir,
            gate=gate,
            hang_hold_s=hang_hold_s,
            **extra,
        )
        return SimJob(cfg).start()
    if family == "standins":
        from tests.standins.job import StandinConfig, StandinJob

        scfg = StandinConfig(
            ranks=ranks,
            steps=steps,
            layout=layout,
            injects=injects,
            run_dir=run_dir,
            gate=gate,
            hang_hold_s=hang_hold_s,
            **extra,
        )
        return StandinJob(scfg).start()
    raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")


def step_times(job: Any) -> Dict[int, List[Tuple[int, int, int]]]:
    """rank -> [(trainer step, start, end)] in CLOCK_MONOTONIC ns, for the steps done so far."""
    job.poll()
    if hasattr(job, "ranks") and hasattr(job, "cfg") and hasattr(job.cfg, "preset"):  # the simulator
        return {
            r: [(s["step"], s["start_ns"], s["end_ns"]) for s in rs.records] for r, rs in job.ranks.items()
        }
    return {int(r): [tuple(x) for x in v] for r, v in job.truth()["step_times"].items()}  # type: ignore[misc]


def hang_started(job: Any) -> bool:
    """The injected hang happened (a rank stopped before its collective)."""
    job.poll()
    t = job.truth()
    return any(f.get("hang") for f in t["faults"])


def job_id(job: Any) -> str:
    return str(job.truth()["job"])


def current_step(job: Any) -> int:
    """The highest trainer step any rank finished."""
    return max((s for v in step_times(job).values() for s, _a, _b in v), default=-1)


def wait_step(job: Any, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while current_step(job) < step:
        assert time.monotonic() < deadline, f"the job did not reach step {step}"
        time.sleep(0.05)


def trainer_step_at(times: Dict[int, List[Tuple[int, int, int]]], rank: int, mono_ns: int) -> Optional[int]:
    """The trainer step `rank` was in (or had just ended) at `mono_ns`."""
    best = None
    for s, start, end in times.get(rank, []):
        if start <= mono_ns + 2_000_000:
            best = s
        if start <= mono_ns <= end:
            return s
    return best
