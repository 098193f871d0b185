"""Where the probes' time goes on the simulated job: each BPF program's runs and run time per
rank-step, from the kernel's own accounting (kernel.bpf_stats_enabled).

    sudo .venv/bin/python -m benchmarks.bpf_breakdown [--quick] [--ranks 8] [--seconds 5]
        [--preset default|heavy|small|tp] [--layout dp|tp-dp|pp-dp] [-- PROBE ARGS]

    e.g. sudo .venv/bin/python -m benchmarks.bpf_breakdown --preset tp --seconds 10 -- --launch-steps all

The 8-rank simulated job (default preset) runs with `argus probe` (the defaults, or the probe
arguments after `--`); once the steps flow, the benchmark reads every loaded program's run count
and run time twice, `--seconds` apart. Rank-steps in that window are counted from the ranks' own
step records (each step's share of its time inside the window, summed over ranks), as are the
calls the ranks issued in it (the ground truth printed under the table). A program's run time
includes the programs it tail-calls (the Python walk at native hits). Not included: the trap into
the kernel around each uprobe hit (~0.6-0.8 µs on this VM, benchmarks.probe_overhead) and the
agent's user-space CPU. `tests/test_cost_budget.py` runs `measure` as a regression guard.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Set, Tuple

from benchmarks._util import REPO, Observer, machine, need_root

sys.path.insert(0, str(REPO))

from argus.sim.launcher import LAYOUTS, SimConfig, SimJob
from argus.sim.workload import PRESETS
from benchmarks import python_overhead as po


def all_programs() -> Dict[int, Tuple[str, int, int]]:
    """id -> (name, run_time_ns, run_cnt) of every loaded BPF program."""
    return po.bpf_programs(names=None)


def programs_of(pid: int) -> Set[int]:
    """Ids of the BPF programs a process holds open (its bpf-prog fds' fdinfo): what it loaded.
    Another tool's programs, or another argus's started meanwhile, are not in it."""
    ids: Set[int] = set()
    fdinfo = Path(f"/proc/{pid}/fdinfo")
    for fd in fdinfo.iterdir():
        try:
            for line in fd.read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
        except (OSError, ValueError):
            pass
    return ids


Row = Tuple[str, float, float]  # program, runs per rank-step, ns per run


@dataclass
class Breakdown:
    rows: List[Row]  # heaviest first
    step_s: float  # the job's median step time
    rank_steps: float  # rank-steps inside the measured window (from the ranks' step records)
    window_s: float  # the window's length
    #: what the ranks issued per rank-step in the window: launches, collectives by op
    launches: float = 0.0
    colls: Dict[str, float] = field(default_factory=dict)

    def total_ns(self) -> float:
        """BPF run time per rank-step, every program."""
        return sum(runs * ns for _, runs, ns in self.rows)


def yardstick_ns(calls: int = 200_000, reps: int = 3) -> float:
    """ns per run of benchmarks/bpf/yardstick.bpf.c (a fixed program of a typical probe's shape) on
    `calls` simulated launches by the C driver, median of `reps`: the unit the cost budget test
    keeps its budget in, so a slower VM day moves the budget with argus's programs."""
    import ctypes
    import statistics
    import subprocess

    from bcc import BPF  # the system's python3-bpfcc (needs root)

    from argus.sim.build import build
    from benchmarks.probe_overhead import build_driver, libcuda_site

    libs, driver = build(), build_driver()
    addr, _ = libcuda_site(str(libs.libcuda), "cuLaunchKernel")  # where argus puts its launch program
    b = BPF(src_file=str(REPO / "benchmarks" / "bpf" / "yardstick.bpf.c"))
    fd = b.load_func("yard_hit", BPF.KPROBE).fd
    b.attach_uprobe(name=str(libs.libcuda), addr=addr, fn_name="yard_hit")
    out = []
    po.bpf_stats(True)
    try:
        for _ in range(reps):
            p = subprocess.Popen(
                [str(driver), str(libs.libcuda.parent), "cuLaunchKernel", str(calls)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert p.stdout is not None and p.stdin is not None
            assert p.stdout.readline().strip() == "ready"
            b["yard_targets"][ctypes.c_uint32(p.pid)] = ctypes.c_uint64(7)
            before = _prog_stats(fd)
            p.stdin.write("go\n")
            p.stdin.flush()
            p.stdout.readline()
            p.wait()
            after = _prog_stats(fd)
            runs = after[1] - before[1]
            if runs >= calls // 2:
                out.append((after[0] - before[0]) / runs)
    finally:
        po.bpf_stats(False)
        b.cleanup()
    if not out:
        raise RuntimeError("the yardstick program did not run on the driver's launches")
    return statistics.median(out)


def _prog_stats(fd: int) -> Tuple[int, int]:
    """(run_time_ns, run_cnt) of a program this process holds, from its fd's fdinfo."""
    ns = cnt = 0
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("run_time_ns:"):
            ns = int(line.split()[1])
        elif line.startswith("run_cnt:"):
            cnt = int(line.split()[1])
    return ns, cnt


def window_truth(job: SimJob, t0_ns: int, t1_ns: int) -> Tuple[float, float, Dict[str, float]]:
    """Rank-steps, launches and collectives (by op) inside [t0_ns, t1_ns]: each step record counts
    with the share of its [start_ns, end_ns] inside the window (CLOCK_MONOTONIC, as time.monotonic)."""
    steps = launches = 0.0
    colls: Counter = Counter()
    for rs in job.ranks.values():
        for rec in rs.records:
            a, b = rec["start_ns"], rec["end_ns"]
            share = max(0, min(b, t1_ns) - max(a, t0_ns)) / max(1, b - a)
            if share <= 0:
                continue
            steps += share
            launches += share * sum(rec["launches"].values())
            for op, (n, _bytes) in rec["colls"].items():
                colls[op] += share * n
    return steps, launches, dict(colls)


def measure(
    ranks: int,
    seconds: float,
    probe_args: List[str],
    preset: str = "default",
    layout: str = "dp",
    ranks_per_host: int = 8,
) -> Breakdown:
    """Run the simulated job under `argus probe PROBE_ARGS` and read the kernel's accounting of
    every program the probe loaded over `seconds` of steady steps."""
    steps = int(8 + seconds / 0.15) + 20
    job = SimJob(
        SimConfig(
            ranks=ranks, steps=steps, preset=preset, layout=layout, gate=True, ranks_per_host=ranks_per_host
        )
    )
    # The uprobes sit on the library file and fire in every process that maps it (the programs
    # then drop other processes): a build of the simulated libraries of its own keeps another
    # simulated job on this machine (a test beside) out of the counts.
    cache = tempfile.mkdtemp(prefix="argus-bpf-breakdown-")
    saved = os.environ.get("ARGUS_CACHE_DIR")
    os.environ["ARGUS_CACHE_DIR"] = cache
    obs = None
    try:
        try:
            job.start()
        finally:
            if saved is None:
                os.environ.pop("ARGUS_CACHE_DIR", None)
            else:
                os.environ["ARGUS_CACHE_DIR"] = saved
        job.wait_loaded()
        argv = [sys.executable, "-m", "argus", "probe", "--json", *probe_args]
        for pid in job.pids.values():
            argv += ["-p", str(pid)]
        obs = Observer(argv, ready="Tracing")
        obs.wait_ready()
        po.bpf_stats(True)
        job.release()
        time.sleep(2.0)
        p0 = all_programs()
        t0 = time.monotonic_ns()
        time.sleep(seconds)
        p1 = all_programs()
        t1 = time.monotonic_ns()
        # what the probe loaded (launch programs load at their first window): not another tool's
        # programs, nor another argus's (a test beside)
        mine = programs_of(obs.p.pid)
        deadline = time.monotonic() + 20.0  # the steps in flight at t1 end and are logged
        while True:
            job.poll()  # the ranks' own step log
            ends = [rs.records[-1]["end_ns"] if rs.records else 0 for rs in job.ranks.values()]
            if min(ends) >= t1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        po.bpf_stats(False)
        if obs is not None:
            obs.stop()
        job.stop()
        shutil.rmtree(cache, ignore_errors=True)
    times = job.job_step_seconds()
    step_s = sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else 0.2
    rank_steps, launches, colls = window_truth(job, t0, t1)
    shutil.rmtree(job.run_dir, ignore_errors=True)  # the job's records are read: its run directory goes
    if rank_steps <= 0:  # no step record reached the window (steps longer than it): by time
        rank_steps = ranks * (t1 - t0) / 1e9 / step_s
    rows = []
    for i, (name, ns, runs) in p1.items():
        _, ns0, runs0 = p0.get(i, (name, 0, 0))
        if i in mine and runs > runs0:
            d_runs, d_ns = runs - runs0, ns - ns0
            rows.append((name, d_runs / rank_steps, d_ns / d_runs))
    rows.sort(key=lambda r: -r[1] * r[2])
    per = {op: n / rank_steps for op, n in colls.items()}
    return Breakdown(rows, step_s, rank_steps, (t1 - t0) / 1e9, launches / rank_steps, per)


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
    ap.add_argument("--preset", default="default", choices=list(PRESETS), help="workload preset")
    ap.add_argument(
        "--layout", choices=list(LAYOUTS), help="the job's layout (default: tp-dp for heavy and tp, else dp)"
    )
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=8,
        help="simulated hosts of this many ranks (fewer than --ranks: the proxy's network sends fire)",
    )
    a = ap.parse_args(argv)
    if not need_root("bpf_breakdown"):
        return 3
    ranks, seconds = (2, 1.0) if a.quick else (a.ranks, a.seconds)
    layout = a.layout or ("tp-dp" if a.preset in ("heavy", "tp") else "dp")
    b = measure(ranks, seconds, probe_args, a.preset, layout, a.ranks_per_host)
    rows, step_s = b.rows, b.step_s
    print(f"{machine()}\n")
    print(
        f"# BPF run time per rank-step: simulated job, {ranks} ranks ({a.ranks_per_host} per host), "
        f"{a.preset} preset ({layout}), "
        f"`argus probe {' '.join(probe_args) or '(defaults)'}`, {seconds:g} s at "
        f"{step_s * 1e3:.0f} ms steps ({b.rank_steps:.1f} rank-steps)\n"
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
    ops = ", ".join(f"{op} {n:,.0f}" for op, n in sorted(b.colls.items()))
    print(
        f"Issued per rank-step in the window (the ranks' own records): {b.launches:,.0f} launches, "
        f"{sum(b.colls.values()):,.0f} collectives ({ops})."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
