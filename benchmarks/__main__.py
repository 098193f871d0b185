"""Run the benchmarks: one command for all of them, or any subset.

    sudo .venv/bin/python -m benchmarks all [--quick] [--out DIR]
    sudo .venv/bin/python -m benchmarks list
    sudo .venv/bin/python -m benchmarks sim_overhead torch_overhead [--quick]

Each benchmark runs as its own process (`python -m benchmarks.NAME ARGS`), in turn; its tables
(markdown) go to stdout as it prints them, its progress lines to stderr. `--quick` is a smoke mode
(seconds to a minute or two each: checks that every benchmark runs and prints its table; the
numbers mean nothing). `--out DIR` also keeps each benchmark's stdout in DIR/NAME.md. The exit
status is non-zero when any benchmark failed; the others still run. `make bench` runs `all`.
Overhead numbers want a quiet machine: each run prints the load average it started with.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

from benchmarks._util import REPO, env, machine

# name -> (what it measures (issue item), full args, quick args)
BENCHMARKS: Dict[str, Tuple[str, List[str], List[str]]] = {
    "sim_overhead": (
        "step time of the simulated 8-rank job: off / each argus channel / all / bpftrace floor (8.1)",
        [],
        ["--quick"],
    ),
    "torch_overhead": (
        "real PyTorch (CPU, gloo, 2 ranks): argus vs torch.profiler vs py-spy (8.2)",
        [],
        ["--quick"],
    ),
    "torch_inout": (
        "real PyTorch: argus in and out of one running job by turns, and its cost by accounting (8.2)",
        [],
        ["--quick"],
    ),
    "probe_overhead": (
        "per-hit cost of each probe type, projection at 1e4-1e5 events/GPU-minute (8.3, 3)",
        ["--per-hit-only"],
        ["--quick", "--per-hit-only"],
    ),
    "bpf_breakdown": (
        "BPF run time per rank-step on the simulated job, per program (8.1: where the time goes)",
        [],
        ["--quick"],
    ),
    "uprobe_session": (
        "a return probe only where needed: uprobe session links vs the uprobe + uretprobe pair (8.11)",
        [],
        ["--quick"],
    ),
    "summary_size": (
        "bytes per rank per step in Redis vs raw events (8.4, 5)",
        ["--probe-arg=--no-host", "--probe-arg=--no-python"],
        ["--ranks", "2", "--steps-default", "8", "--steps-heavy", "6", "--probe-arg=--no-host"],
    ),
    "footprint": ("agent CPU and RSS for 1/4/8 ranks, time to first data (8.5)", [], ["--quick"]),
    "python_overhead": ("Python channel vs py-spy on a Python-bound worker (python.md)", [], ["--quick"]),
    "kde_fidelity": ("KDE clusters vs log2 histograms: size and fidelity (5)", [], []),
    "diagnosis_accuracy": (
        "detection accuracy attached late, {before, after attach} x {simulator, second stand-ins} x "
        "{straggler, slow link, hang} + clean runs, via Redis and argus aggregate (13)",
        [],
        ["--families", "standins", "--faults", "straggler", "--clean-steps", "0"],
    ),
    "late_straggler": (
        "argus sim run with a straggler from the start, argus probe attached 5 s in (13)",
        [],
        ["--trace", "15"],
    ),
    "aggregator_scale": (
        "aggregator throughput and latency at 1,024 / 10,000 ranks (6)",
        [],
        ["--ranks", "64", "--steps", "8", "--live-steps", "6"],
    ),
}
NEEDS_ROOT = {"sim_overhead", "torch_overhead", "probe_overhead", "summary_size", "footprint"}
NEEDS_ROOT |= {"python_overhead", "diagnosis_accuracy", "bpf_breakdown", "torch_inout", "late_straggler"}
NEEDS_ROOT |= {"uprobe_session"}


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("names", nargs="+", help="'all', 'list', or benchmark names")
    ap.add_argument("--quick", action="store_true", help="smoke mode: every benchmark small and fast")
    ap.add_argument("--out", help="also write each benchmark's stdout to DIR/NAME.md")
    a = ap.parse_args()
    if a.names == ["list"]:
        for name, (what, full, quick) in BENCHMARKS.items():
            print(
                f"{name:20} {what}\n{'':20} full: {' '.join(full) or '(defaults)'}; quick: {' '.join(quick)}"
            )
        return 0
    names = list(BENCHMARKS) if a.names == ["all"] else a.names
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(
            f"ERROR: unknown benchmark(s) {', '.join(unknown)}\nHINT: python -m benchmarks list",
            file=sys.stderr,
        )
        return 2
    if os.geteuid() != 0 and any(n in NEEDS_ROOT for n in names):
        print(
            "ERROR: these benchmarks load BPF\nHINT: sudo .venv/bin/python -m benchmarks ...", file=sys.stderr
        )
        return 3
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(f"# argus benchmarks ({'quick smoke mode' if a.quick else 'full'})\n\n{machine()}\n", flush=True)
    failed, took = [], {}
    for name in names:
        what, full, quick = BENCHMARKS[name]
        args = quick if a.quick else full
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
        print(
            f"\n## {name}: {what}\n\n`{' '.join(['python', '-m', f'benchmarks.{name}', *args])}`\n",
            flush=True,
        )
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=str(REPO), env=env(), stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        lines = []
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
        rc = p.wait()
        took[name] = time.monotonic() - t0
        if out:
            (out / f"{name}.md").write_text("".join(lines))
        has_table = any(line.startswith("|") for line in lines) or name == "kde_fidelity"
        if rc != 0 or not has_table:
            failed.append(f"{name} (exit {rc}{'' if has_table else ', no table'})")
        print(f"\n[{name}: exit {rc}, {took[name]:.0f} s]", flush=True)
    print("\n# summary\n")
    for name in names:
        print(f"- {name}: {took[name]:.0f} s")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    print(f"\nall {len(names)} benchmark(s) ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
