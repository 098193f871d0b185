"""Diagnosis accuracy attached late, every run real: a job of 8 ranks, `argus probe --redis` (real
BPF, every default channel) attached to it while it runs, `argus aggregate` (the service) reading
Redis, alerts read back from Redis.

    sudo .venv/bin/python -m benchmarks.diagnosis_accuracy [--reps 1] [--clean-steps 300]
                                                           [--families sim,standins] [--faults ...]

Matrix: {fault present before attach, fault after attach} x {the simulator, the second stand-ins
(tests/standins)} x {straggler, slow link, hang} (and, asked for, `pp_straggler`: a compute
straggler in pipeline stage 0), plus one clean run of `--clean-steps` probed steps per family.
Timers off: `--families standins-async-net,standins-async-timing,... --faults straggler`
(VARIANTS: jobs that record no timers, each with one kind of GPU-arrival evidence; the `evidence`
column says what the alert used). The agent always arrives late: every communicator
was created before it.

* detected: an alert of the expected kind naming exactly the faulty rank (the link's pair) fires;
  its step is the trainer step being judged when it fired (the alert's first_seen is that step's
  end). Fault before attach: latency counts from the faulty rank's first summary (its first
  aligned data; target <= 5 steps); after attach: from the onset (target <= 3 steps).
* hang: before attach, the job has hung 3 s when the agent starts (latency from the agent being
  ready); after, the hang starts after attach (latency from the hang); target <= 30 s, with the
  default threshold max(15 s, 10 x the median step).
* false: every other alert that names a rank (an L1 alert names none and is listed apart).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.aggregator.service import history  # noqa: E402
from argus.reader import iter_steps  # noqa: E402
from benchmarks._util import env, sigint_default  # noqa: E402
from tests import families  # noqa: E402
from tests.redisproc import RedisProc  # noqa: E402

# per family: straggler factor, slow-link factor (a pipeline pair of pp-dp), pipeline straggler
# factor, attach step, onset of an after-attach fault (past the time the agent takes to attach: ~4 s
# until 2026-12-06, ~65 simulated steps, ~36 stand-in; 9.6-10.4 s on 2026-12-07, this code and the
# last stop's alike, 141-188 simulated steps, 87-100 stand-in)
PARAMS: Dict[str, Dict[str, Any]] = {
    "sim": {"straggler": 1.35, "link": 100, "pp_straggler": 1.5, "attach": 20, "onset": 250},
    "standins": {"straggler": 1.35, "link": 20, "pp_straggler": 1.5, "attach": 10, "onset": 150},
}
RANKS, SLOW_RANK = 8, 5  # the job's ranks, the straggler's rank (a variant may have its own)
# a variant's own: 8 launch-bound stand-in ranks keep this machine's 2 CPUs busy, and the agent once
# took until step 93 to be ready; 8 launch-bound simulated ranks and the agent's launch probes
# saturate them, and by the simulator's ground truth the straggler's GPU then no longer comes last
# (docs/benchmarks.md 8.18): 4 ranks, the straggler the last
VARIANT_PARAMS: Dict[str, Dict[str, Any]] = {
    "standins-async-queries": {"onset": 250},
    "sim-queries": {"ranks": 4, "slow_rank": 3},
}


def params(family: str) -> Dict[str, Any]:
    return {**PARAMS[base(family)[0]], **VARIANT_PARAMS.get(family, {})}


# timers off (issue "Which GPU arrived last"): family variants that record no timers, each leaving
# one kind of GPU-arrival evidence (docs/diagnosis.md); the table's `evidence` column says what the
# alert used. name -> (family, its config's extra fields)
VARIANTS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "sim-net": ("sim", {"timers": False, "ranks_per_host": 4}),
    "sim-timing": ("sim", {"timers": False, "nccl_timing": True}),
    "sim-none": ("sim", {"timers": False}),
    # a launch-bound job: >1024 launches a step and a driver whose launches block past 1024 pending
    # (as NVIDIA's), so the host keeps pace with its GPU and the allocator's event queries bound
    # arrivals tightly; one host, timing off: event queries are the only evidence
    "sim-queries": ("sim", {"timers": False, "preset": "heavy", "overrides": {"launch_queue": 1024}}),
    # the same over 2 hosts of 4 ranks: network sends and event queries both (replay its `--keep`
    # file without the sends to judge the queries alone over two hosts)
    "sim-queries-net": (
        "sim",
        {"timers": False, "preset": "heavy", "overrides": {"launch_queue": 1024}, "ranks_per_host": 4},
    ),
    "standins-async-net": ("standins", {"variant": "async"}),
    "standins-async-timing": ("standins", {"variant": "async", "ranks_per_host": 8, "nccl_timing": True}),
    "standins-async-none": ("standins", {"variant": "async", "ranks_per_host": 8}),
    "standins-async-queries": ("standins", {"variant": "async", "ranks_per_host": 8, "launch_bound": True}),
}
FAULTS = ("straggler", "slow_link", "hang")
# also: a compute straggler inside pipeline stage 0 (`--faults pp_straggler`): its pipeline peer
# waits in forward and backward as for a slow link, and it is named as the pipeline's bubble
KINDS = {
    "straggler": "straggler",
    "slow_link": "slow_link",
    "hang": "hang",
    "pp_straggler": "pipeline_bubble",
}


@dataclass
class Run:
    family: str
    fault: str
    when: str  # before | after | clean
    detected: bool = False
    latency: Optional[float] = None  # steps (hang: seconds)
    false: List[Tuple[str, List[int]]] = field(default_factory=list)
    l1: List[str] = field(default_factory=list)
    identity: str = ""
    mode: str = ""
    evidence: str = ""
    note: str = ""


def base(family: str) -> Tuple[str, Dict[str, Any]]:
    """(the family tests/families.py starts, its config's extra fields)."""
    return VARIANTS.get(family, (family, {}))


def spec(family: str, fault: str, when: str) -> Tuple[str, List[str], int, List[int]]:
    """(layout, injects, steps, faulty ranks)."""
    p = params(family)
    onset = 0 if when == "before" else p["onset"]
    if fault == "straggler":
        r = p.get("slow_rank", SLOW_RANK)
        return "dp", [f"straggler:rank={r},factor={p['straggler']},from_step={onset}"], p["onset"] + 90, [r]
    if fault == "slow_link":
        return "pp-dp", [f"slow_link:ranks=2-3,factor={p['link']},from_step={onset}"], p["onset"] + 90, [2, 3]
    if fault == "pp_straggler":
        return (
            "pp-dp",
            [f"straggler:rank=2,factor={p['pp_straggler']},from_step={onset}"],
            p["onset"] + 90,
            [2],
        )
    if fault == "hang":
        step = 12 if when == "before" else onset
        return "dp", [f"hang:rank=6,step={step}"], 4000, [6]
    return "dp", [], 0, []


def run_one(
    family: str, fault: str, when: str, redis: RedisProc, clean_steps: int, keep: Optional[Path] = None
) -> Run:
    import redis as redis_py

    run = Run(family, fault, when)
    fam, extra = base(family)
    p = params(family)
    if when == "clean":
        layout, injects, steps, truth = "dp", [], p["attach"] + clean_steps + 40, []
    else:
        layout, injects, steps, truth = spec(family, fault, when)
    d = tempfile.mkdtemp(prefix="argus-acc-")
    job = families.start_job(
        fam, p.get("ranks", RANKS), steps, layout, injects, d, hang_hold_s=600.0, **extra
    )
    client = redis_py.Redis.from_url(redis.url)
    agg = probe = None
    kept = None
    if keep is not None:
        n = 1 + sum(1 for _ in keep.glob(f"{family}-{fault}-{when}*.jsonl"))
        kept = open(keep / f"{family}-{fault}-{when}{f'-{n}' if n > 1 else ''}.jsonl", "w")
    try:
        jid = families.job_id(job)
        mono_off = time.time_ns() - time.monotonic_ns()
        hang_ns: Optional[int] = None
        if fault == "hang" and when == "before":
            while not families.hang_started(job):
                time.sleep(0.05)
            hang_ns = time.time_ns()
            time.sleep(3.0)
        else:
            families.wait_step(job, p["attach"])
        args = [sys.executable, "-m", "argus"]
        names = families.PHASES[fam] if not extra else ""
        agg = subprocess.Popen(
            [
                *args,
                "aggregate",
                "--redis",
                redis.url,
                "--job",
                jid,
                "-q",
                *(["--phases", names] if names else []),
            ],
            env=env(),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        pids = [a for pid in job.pids.values() for a in ("-p", str(pid))]
        probe = subprocess.Popen(
            [*args, "probe", *pids, "--redis", redis.url, "-i", "0.5s", "--json"],
            env=env(),
            cwd=REPO,
            preexec_fn=sigint_default,
            stdout=kept or subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        err = _wait_ready(probe)
        ready_ns = time.time_ns()
        at_ready = families.current_step(job)
        if when == "after" and fault != "hang" and at_ready > p["onset"] - 5:
            run.note = f"invalid: the agent was ready at step {at_ready}, after the onset"
        deadline = time.monotonic() + (clean_steps * 0.2 + 120 if when == "clean" else 240)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if fault == "hang" and when != "clean":
                if hang_ns is None and families.hang_started(job):
                    hang_ns = time.time_ns()
                if hang_ns is not None and time.time_ns() - max(hang_ns, ready_ns) > 32e9:
                    break
            elif all(x.poll() is not None for x in _procs(job)):
                break
        probe.send_signal(signal.SIGINT)
        err += probe.communicate(timeout=60)[1]
        time.sleep(3.0)  # the aggregator drains what the agent sent last
        agg.send_signal(signal.SIGTERM)
        agg.communicate(timeout=60)
        times = families.step_times(job)
        alerts = [a for _id, a in history(client, jid) if a.state == "firing"]
        first_step: Dict[int, int] = {}
        for _eid, rs in iter_steps(client, jid):
            if rs.rank in truth and rs.rank not in first_step:
                s = families.trainer_step_at(times, rs.rank, rs.end_ns - rs.clock_offset_ns)
                if s is not None:
                    first_step[rs.rank] = s
        _judge(run, alerts, truth, times, mono_off, first_step, ready_ns, hang_ns, injects)
        if not alerts and when != "clean":
            run.note = run.note or f"no alert; agent said: {err.strip().splitlines()[-1:]}"
    finally:
        for x in (probe, agg):
            if x is not None and x.poll() is None:
                x.kill()
        job.stop()
        client.close()
        if kept is not None:
            kept.close()
        shutil.rmtree(d, ignore_errors=True)  # the job's logs: what matters is in `kept`
    return run


def _judge(
    run: Run,
    alerts: List[Any],
    truth: List[int],
    times: Dict[int, List[Tuple[int, int, int]]],
    mono_off: int,
    first_step: Dict[int, int],
    ready_ns: int,
    hang_ns: Optional[int],
    injects: List[str],
) -> None:
    want = KINDS.get(run.fault)
    onset = _onset(injects)
    for a in alerts:
        if not a.ranks:
            run.l1.append(a.kind)
            continue
        ok = run.when != "clean" and a.kind == want and sorted(a.ranks) == truth
        if ok and not run.detected:
            run.detected = True
            run.identity = str(a.evidence.get("identity", {}).get("comm", {}).get("identity", "-"))
            run.mode = str(a.evidence.get("comm_mode", "-"))
            gpu = a.evidence.get("gpu_arrival") or {}
            run.evidence = str(
                gpu.get("source") or ("timers" if a.evidence.get("gpu_reached_last_steps") else "host")
            )
            if run.fault == "hang":
                since = ready_ns if run.when == "before" else (hang_ns or ready_ns)
                run.latency = round((a.first_seen - since) / 1e9, 1)
            else:
                step = families.trainer_step_at(times, truth[0], a.first_seen - mono_off)
                ref = max(first_step.get(r, 0) for r in truth) if run.when == "before" else onset
                run.latency = None if step is None or ref is None else float(step - ref)
        elif not ok:
            run.false.append((a.kind, a.ranks))


def _onset(injects: List[str]) -> Optional[int]:
    for s in injects:
        kv = dict(p.split("=") for p in s.partition(":")[2].split(",") if "=" in p)
        for k in ("from_step", "step"):
            if k in kv:
                return int(kv[k])
    return None


def _wait_ready(probe: subprocess.Popen) -> str:  # type: ignore[type-arg]
    assert probe.stderr is not None
    out = ""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = probe.stderr.readline()
        if not line:
            raise RuntimeError(f"argus probe exited before tracing: {out}")
        out += line
        if "Tracing" in line:
            return out
    raise RuntimeError(f"argus probe not ready in 90 s: {out}")


def _procs(job: Any) -> List[Any]:
    return list(job.procs.values()) if hasattr(job, "procs") else [r.proc for r in job._ranks.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--clean-steps", type=int, default=300)
    ap.add_argument(
        "--families",
        default=",".join(families.FAMILIES),
        help=f"of {', '.join((*families.FAMILIES, *VARIANTS))} (the variants record no timers)",
    )
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--when", default="before,after,clean", help="which runs: before, after attach, clean")
    ap.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="write each run's summaries there (FAMILY-FAULT-WHEN[-N].jsonl) for argus diagnose --from-jsonl",
    )
    args = ap.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    fams = [f for f in args.families.split(",") if f]
    faults = [f for f in args.faults.split(",") if f]
    t0 = time.monotonic()
    runs: List[Run] = []
    with tempfile.TemporaryDirectory(prefix="argus-acc-redis-") as rd:
        redis = RedisProc(Path(rd))
        redis.start()
        try:
            for fam in fams:
                for fault in faults:
                    for when in [w for w in ("before", "after") if w in args.when.split(",")]:
                        for _ in range(args.reps):
                            runs.append(run_one(fam, fault, when, redis, args.clean_steps, args.keep))
                            print(f"  {runs[-1]}", file=sys.stderr, flush=True)
                if args.clean_steps and "clean" in args.when.split(","):
                    runs.append(run_one(fam, "clean", "clean", redis, args.clean_steps, args.keep))
                    print(f"  {runs[-1]}", file=sys.stderr, flush=True)
        finally:
            redis.stop()
    took = time.monotonic() - t0
    print(
        "# diagnosis accuracy, attached late: 8 ranks (sim-queries: 4), every default channel, "
        "probe -> Redis -> aggregate\n"
    )
    print(
        "| family | fault | when | runs | recall | latency | other alerts naming a rank | L1 only | identity "
        "| collectives | evidence | note |"
    )
    print("|---|---|---|---:|---:|---:|---|---|---|---|---|---|")
    for r in runs:
        unit = " s" if r.fault == "hang" else " steps"
        lat = f"{r.latency:g}{unit}" if r.latency is not None else "-"
        rec = "-" if r.when == "clean" else ("1.00" if r.detected else "0.00")
        when = {"before": "before attach", "after": "after attach", "clean": "none"}[r.when]
        fault = "clean" if r.when == "clean" else r.fault
        others = "; ".join(f"{k} {v}" for k, v in r.false) or "none"
        print(
            f"| {r.family} | {fault} | {when} | 1 | {rec} | {lat} | {others} | {', '.join(r.l1) or '-'} | "
            f"{r.identity or '-'} | {r.mode or '-'} | {r.evidence or '-'} | {r.note} |"
        )
    print(f"\n(took {took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
