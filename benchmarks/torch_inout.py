"""Argus in and out of one running PyTorch job: step time with and without `argus probe`,
alternating segments in the same two rank processes.

    sudo .venv/bin/python -m benchmarks.torch_inout [--quick] [--pairs 6] [--seconds 10]

torch_overhead.py starts a fresh job per run, and on this 2-CPU machine runs of the same condition
differ by up to ±10% (where the ranks and their gloo threads land), which hides a 1% effect. Here
one job (benchmarks/torch_train.py, the same model and 2 ranks over gloo) runs throughout while the
benchmark alternates `off` and `argus` segments of `--seconds` each (order swapped every pair).
An `argus` segment starts once `argus probe --json` (the defaults) prints "Tracing" plus 1 s (its
BPF compile is not part of the steady state it measures) and ends before it is stopped; an `off`
segment starts once the previous agent and its uprobe-removal child are gone. Each step (mean of
the ranks' step times, timed inside the ranks) belongs to the segment its end falls in.
Result: the median step of each segment, the median over segments per condition, and the
per-pair ratio argus / off (each argus segment against the mean of the off segments on either
side), whose median is the overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from benchmarks._util import Observer, machine, med, need_root
from benchmarks.bpf_breakdown import all_programs
from benchmarks.python_overhead import bpf_stats
from benchmarks.torch_overhead import start_ranks, trainer_python, wait_ready

# condition, t0, t1 (monotonic s), agent CPU share, BPF run time in the segment (ns, all of argus's programs)
Segment = Tuple[str, float, float, float, float]


def run(py: str, pairs: int, seconds: float) -> Tuple[List[Segment], List[Tuple[float, float]]]:
    """The segments, and every timed step as (end, seconds)."""
    with tempfile.TemporaryDirectory(prefix="argus-torch-inout-") as tmp:
        d = Path(tmp)
        procs = start_ranks(py, d, 2, ["5", "1000000", "none"], BENCH_STOP_FILE=str(d / "stop"))
        obs: Optional[Observer] = None
        segs: List[Segment] = []
        try:
            wait_ready(d, procs)
            (d / "go").write_text("go")
            time.sleep(3.0)  # past the first steps' warm-up
            argv = [sys.executable, "-m", "argus", "probe", "--json", "--no-gpu-metrics"]
            for p in procs:
                argv += ["-p", str(p.pid)]
            for i in range(pairs):
                for cond in ("off", "argus") if i % 2 == 0 else ("argus", "off"):
                    cpu = bpf_ns = 0.0
                    before: Dict[int, Tuple[str, int, int]] = {}
                    if cond == "argus":
                        old = set(all_programs())
                        obs = Observer(argv, d / "argus.jsonl", ready="Tracing")
                        obs.wait_ready()
                        time.sleep(1.0)
                        obs.mark()
                        bpf_stats(True)
                        before = {i: v for i, v in all_programs().items() if i not in old}
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < seconds:
                        time.sleep(0.2)
                        if obs is not None:
                            obs.touch()
                    t1 = time.monotonic()
                    if obs is not None:
                        after = all_programs()
                        bpf_stats(False)
                        bpf_ns = float(sum(after[i][1] - v[1] for i, v in before.items() if i in after))
                        cpu = obs.cpu_share()
                        obs.stop()  # and waits for its uprobe-removal child
                        obs = None
                    segs.append((cond, t0, t1, cpu, bpf_ns))
                    print(f"  pair {i} {cond}: {t1 - t0:.1f} s", file=sys.stderr, flush=True)
            (d / "stop").write_text("stop")
            for p in procs:
                p.wait(timeout=120)
                if p.returncode != 0:
                    raise RuntimeError(f"rank exited {p.returncode}: {(d / 'rank0.log').read_text()[-2000:]}")
            res = [json.loads((d / f"result{r}.json").read_text()) for r in range(2)]
            steps = [
                (max(e), sum(t) / len(t))
                for e, t in zip(zip(*(r["ends"] for r in res)), zip(*(r["times"] for r in res)))
            ]
            return segs, steps
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if obs is not None:
                obs.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 pair of 3 s segments")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--python", help="interpreter of the ranks (needs torch)")
    a = ap.parse_args()
    if not need_root("torch_inout"):
        return 3
    pairs, seconds = (1, 3.0) if a.quick else (a.pairs, a.seconds)
    py = trainer_python(a.python)
    print(f"{machine()}\n")
    t_start = time.monotonic()
    segs, steps = run(py, pairs, seconds)
    medians: List[Tuple[str, float, int, float]] = []
    for cond, t0, t1, cpu, _bpf in segs:
        xs = [s for end, s in steps if t0 <= end <= t1]
        medians.append((cond, med(xs) if xs else float("nan"), len(xs), cpu))
    print(
        f"# argus in and out of one PyTorch job (2 ranks, gloo, CPU): {pairs} pairs of "
        f"{seconds:g} s segments\n"
    )
    print("| segment | condition | steps | median step (ms) | agent CPU (% of a core) |")
    print("|---:|---|---:|---:|---:|")
    for i, (cond, m, n, cpu) in enumerate(medians):
        print(f"| {i} | {cond} | {n} | {m * 1e3:.2f} | {f'{100 * cpu:.1f}%' if cond == 'argus' else '—'} |")
    ratios = []
    for i, (cond, m, _n, _cpu) in enumerate(medians):
        if cond != "argus":
            continue
        near = [medians[j][1] for j in (i - 1, i + 1) if 0 <= j < len(medians) and medians[j][0] == "off"]
        if near:
            ratios.append(m / (sum(near) / len(near)))
    by: Dict[str, List[float]] = {}
    for cond, m, _n, _cpu in medians:
        by.setdefault(cond, []).append(m)
    off, on = med(by.get("off", [float("nan")])), med(by.get("argus", [float("nan")]))
    ov = 100 * (on - off) / off
    print(f"\nmedian over segments: off {off * 1e3:.2f} ms, argus {on * 1e3:.2f} ms ({ov:+.2f}%)")
    if ratios:
        r = med(ratios)
        spread_txt = ", ".join(f"{100 * (x - 1):+.1f}%" for x in ratios)
        print(f"argus vs the off segments beside it: median {100 * (r - 1):+.2f}% (each: {spread_txt})")
    # what argus costs the ranks by accounting: its BPF programs run on the ranks' time; the agent
    # takes its CPU share from the 2 cores the 2 ranks use
    on_segs = [x for x in segs if x[0] == "argus"]
    wall = sum(t1 - t0 for _c, t0, t1, _cpu, _b in on_segs)
    if wall > 0:
        bpf_share = sum(b for *_x, b in on_segs) / 1e9 / wall / 2  # per rank
        agent = med([cpu for _c, _t0, _t1, cpu, _b in on_segs])
        cores = os.cpu_count() or 1
        print(
            f"by accounting: argus's BPF programs ran {100 * bpf_share:.3f}% of each rank's time, the agent "
            f"used {100 * agent:.2f}% of a core ({100 * agent / cores:.2f}% of this {cores}-CPU machine): "
            f"at most {100 * (bpf_share + agent / cores):.2f}% of the ranks' time"
        )
    print(f"\n(took {time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
