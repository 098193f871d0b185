"""Where the probes' time goes on the simulated job: each BPF program's runs and run time per
rank-step, from the kernel's own accounting (kernel.bpf_stats_enabled).

    sudo .venv/bin/python -m benchmarks.bpf_breakdown [--quick] [--ranks 8] [--seconds 5] [-- PROBE ARGS]

The 8-rank simulated job (default preset) runs with `argus probe` (the defaults, or the probe
arguments after `--`); once the steps flow, the benchmark reads every loaded program's run count
and run time twice, `--seconds` apart. A program's run time includes the programs it tail-calls
(the Python walk at native hits). Not included: the trap into the kernel around each uprobe hit
(~0.6-0.8 µs on this VM, benchmarks.probe_overhead) and the agent's user-space CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List, Tuple

from benchmarks._util import REPO, Observer, machine, need_root

sys.path.insert(0, str(REPO))

from argus.sim.launcher import SimConfig, SimJob
from benchmarks import python_overhead as po


def all_programs() -> Dict[int, Tuple[str, int, int]]:
    """id -> (name, run_time_ns, run_cnt) of every loaded BPF program."""
    return po.bpf_programs(names=None)


Row = Tuple[str, float, float]  # program, runs per rank-step, ns per run


def measure(ranks: int, seconds: float, probe_args: List[str]) -> Tuple[List[Row], float]:
    """The rows, and the job's step time (s)."""
    steps = int(8 + seconds / 0.15) + 20
    job = SimJob(SimConfig(ranks=ranks, steps=steps, preset="default", gate=True)).start()
    obs = None
    try:
        job.wait_loaded()
        before = set(all_programs())  # another tool's programs are not argus's
        argv = [sys.executable, "-m", "argus", "probe", "--json", *probe_args]
        for pid in job.pids.values():
            argv += ["-p", str(pid)]
        obs = Observer(argv, ready="Tracing")
        obs.wait_ready()
        mine = set(all_programs()) - before
        po.bpf_stats(True)
        job.release()
        time.sleep(2.0)
        p0 = all_programs()
        t0 = time.monotonic()
        time.sleep(seconds)
        p1 = all_programs()
        el = time.monotonic() - t0
        job.poll()  # the ranks' own step log
    finally:
        po.bpf_stats(False)
        if obs is not None:
            obs.stop()
        job.stop()
    steps = job.job_step_seconds()
    step_s = sorted(steps[3:])[len(steps[3:]) // 2] if len(steps) > 3 else 0.2
    rank_steps = ranks * el / step_s
    rows = []
    for i, (name, ns, runs) in p1.items():
        if i in p0 and i in mine and runs > p0[i][2]:
            d_runs, d_ns = runs - p0[i][2], ns - p0[i][1]
            rows.append((name, d_runs / rank_steps, d_ns / d_runs))
    return sorted(rows, key=lambda r: -r[1] * r[2]), step_s


def main() -> int:
    argv = sys.argv[1:]
    probe_args: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, probe_args = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, 1 s")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    if not need_root("bpf_breakdown"):
        return 3
    ranks, seconds = (2, 1.0) if a.quick else (a.ranks, a.seconds)
    rows, step_s = measure(ranks, seconds, probe_args)
    print(f"{machine()}\n")
    print(
        f"# BPF run time per rank-step: simulated job, {ranks} ranks, default preset, "
        f"`argus probe {' '.join(probe_args) or '(defaults)'}`, {seconds:g} s at "
        f"{step_s * 1e3:.0f} ms steps\n"
    )
    print("| BPF program (name cut at 15 chars) | runs per rank-step | ns per run | µs per rank-step |")
    print("|---|---:|---:|---:|")
    total = runs_total = 0.0
    for name, runs, ns in rows:
        total += runs * ns / 1e3
        runs_total += runs
        if runs * ns >= 1e3:  # under 1 µs per rank-step: folded into the total
            print(f"| `{name}` | {runs:.1f} | {ns:.0f} | {runs * ns / 1e3:.1f} |")
    print(f"| **all programs** | {runs_total:.0f} | | **{total:.0f}** |")
    print(
        f"\nIn-BPF time is {100 * total / 1e6 / step_s:.2f}% of one rank's step ({total:.0f} µs of "
        f"{step_s * 1e3:.0f} ms); uprobe traps and the agent come on top."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
