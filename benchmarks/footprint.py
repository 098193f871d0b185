"""Agent footprint: CPU and memory of `argus probe` for 1, 4 and 8 probed ranks on one host, and the
time from starting `argus probe` to its first data, per workload preset.

    sudo .venv/bin/python -m benchmarks.footprint [--quick] [--ranks 1,4,8] [--presets default,heavy,tp]
                                                  [--steps N] [--reps 2]

Each run starts the simulated job (data parallel for the default preset; tensor + data parallel for
`heavy` and `tp`, the tensor-parallel group cut to the ranks probed when fewer: the rates per rank
stay; every rank on this host) and lets it run, then starts `argus probe --json -i 1s` (all
channels) on its ranks, as an on-call engineer would. Measured: time to the "Tracing" line (BPF
compile + attach), time to the first JSON line on stdout (first complete step after attach), the
agent's CPU share from "Tracing" until the job ends (% of one core) and from its first data on (the
steady state, without the start-up: attach scans, steps before sampling engages), its peak RSS (VmHWM) and the
collectives per rank-step it reported (the rates measured). Median over --reps runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks._util import REPO, Observer, machine, med, need_root

sys.path.insert(0, str(REPO))

from argus.sim.launcher import SimConfig, SimJob

# steps a run: ~30-40 s of job at each preset's step time on this VM
STEPS = {"default": 150, "heavy": 150, "tp": 25}


def config(preset: str, ranks: int, steps: int) -> SimConfig:
    if preset == "default":
        return SimConfig(ranks=ranks, steps=steps, preset=preset)
    tp = int(SimConfig(preset=preset).workload().tp)
    over = {} if ranks % tp == 0 else {"tp": float(ranks if tp > ranks else 1)}
    return SimConfig(ranks=ranks, steps=steps, preset=preset, layout="tp-dp", overrides=over)


def run_one(ranks: int, steps: int, tmp: Path, preset: str = "default") -> Dict[str, float]:
    job = SimJob(config(preset, ranks, steps)).start()
    obs = None
    try:
        while job.steps_done() < 3:  # the job is running before the agent starts
            job.poll()
            time.sleep(0.05)
        argv = [sys.executable, "-m", "argus", "probe", "--json", "-i", "1s"]
        for pid in job.pids.values():
            argv += ["-p", str(pid)]
        out = tmp / f"fp-{preset}-{ranks}.jsonl"
        obs = Observer(argv, out, ready="Tracing")
        try:
            ready = obs.wait_ready()
        except RuntimeError:
            for r, p in job.procs.items():
                print(
                    f"rank {r}: rc {p.poll()}: {(job.run_dir / f'rank{r}.log').read_text()[-800:]}",
                    file=sys.stderr,
                )
            raise
        obs.mark()
        first = None
        at_first = (0.0, 0.0)  # (agent CPU s, monotonic s) at its first data: the steady state after
        while any(p.poll() is None for p in job.procs.values()):
            obs.touch()
            if first is None and out.exists() and out.stat().st_size > 0:
                first = time.monotonic() - obs.t_start
                at_first = (obs.cpu_last, obs.t_last)
            time.sleep(0.05)
        job.wait()
        cpu = obs.cpu_share()
        steady = (obs.cpu_last - at_first[0]) / max(1e-9, obs.t_last - at_first[1]) if first else float("nan")
        obs.wait(timeout=120)
        if first is None:
            first = float("nan")
        return {
            "ready": ready,
            "first": first,
            "cpu": cpu,
            "steady": steady,
            "rss": obs.hwm_kb / 1024,
            "colls": _colls(out),
        }
    finally:
        job.stop()
        if obs is not None and obs.p.poll() is None:
            obs.stop()


def _colls(out: Path) -> float:
    """Collectives per rank-step in what the agent printed (its steps, median): the rates measured."""
    import json

    n = []
    for line in out.read_text().splitlines() if out.exists() else []:
        d = json.loads(line)
        if d.get("step") is not None:
            n.append(sum(o["count"] for o in d.get("nccl", {}).get("ops", {}).values()))
    return med(n) if n else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 ranks, 80 steps, 1 rep")
    ap.add_argument("--ranks", default="1,4,8")
    ap.add_argument("--presets", default="default", help="comma-separated: default, heavy, tp")
    ap.add_argument("--steps", type=int, default=0, help="steps a job (default: by preset, ~30-40 s)")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    if not need_root("footprint"):
        return 3
    sizes = [1, 2] if a.quick else [int(x) for x in a.ranks.split(",")]
    reps = 1 if a.quick else a.reps
    presets = a.presets.split(",")
    import tempfile

    print("# agent footprint: `argus probe --json` (all channels), simulated job, one host\n")
    print(f"{machine()}\n")
    print(f"the agent started on a running job; median of {reps} run(s)\n")
    print(
        "| preset | steps | probed ranks | collectives per rank-step | start → tracing (s) "
        "| start → first data (s) | agent CPU (% of a core) | after first data | agent peak RSS (MB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="argus-fp-") as t:
        for preset in presets:
            steps = 80 if a.quick else (a.steps or STEPS[preset])
            for n in sizes:
                rs: List[Dict[str, float]] = [run_one(n, steps, Path(t), preset) for _ in range(reps)]
                for r in rs:
                    print(f"  {preset}, {n} ranks: {r}", file=sys.stderr, flush=True)
                m = {k: med([r[k] for r in rs]) for k in rs[0]}
                print(
                    f"| {preset} | {steps} | {n} | {m['colls']:.0f} | {m['ready']:.1f} | {m['first']:.1f} "
                    f"| {100 * m['cpu']:.1f}% | {100 * m['steady']:.1f}% | {m['rss']:.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
