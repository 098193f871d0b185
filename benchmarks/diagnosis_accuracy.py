"""Detection accuracy of the aggregator on the simulated job with `argus probe` attached (real BPF).

    sudo .venv/bin/python -m benchmarks.diagnosis_accuracy [--reps 3] [--clean-steps 300] [--no-python]

For every fault kind the simulator injects, `--reps` runs (8 ranks, preset small, the fault from step
10–12, a different rank or pair each run) and clean runs: the summaries go through the aggregator in
step order. A run is *detected* when an alert of the expected kind naming the faulty rank (the pair,
or for a data-parallel ring the group containing the pair) fires within 3 steps of the onset; every
other alert fired in the run is a false positive. Hang: heartbeats from the probing session, a 1 s
threshold, latency in seconds after the hung rank stopped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.aggregator.config import PhaseInfo, Thresholds  # noqa: E402
from argus.aggregator.engine import Engine  # noqa: E402
from argus.schema import RankStep  # noqa: E402
from argus.sim.launcher import SimConfig  # noqa: E402
from tests.agg_probing import Collected, collect_steps, collect_with_heartbeats  # noqa: E402

NAMES = PhaseInfo.parse("forward,backward,optimizer,grad_sync")


@dataclass
class Case:
    fault: str  # simulator kind
    layout: str
    specs: List[str]  # one inject per repetition
    kind: str  # expected alert kind


CASES: List[Case] = [
    Case("straggler", "dp", [f"straggler:rank={r},factor=1.5,from_step=10" for r in (3, 5, 1)], "straggler"),
    Case(
        "masked_straggler",
        "dp",
        [f"masked_straggler:rank={r},factor=2,from_step=10" for r in (4, 2, 6)],
        "straggler",
    ),
    Case(
        "slow_link (dp ring)",
        "dp",
        [f"slow_link:ranks={a}-{b},factor=50,from_step=10" for a, b in ((2, 3), (5, 6), (0, 1))],
        "slow_link",
    ),
    Case(
        "slow_link (pp-dp)",
        "pp-dp",
        [f"slow_link:ranks={a}-{b},factor=100,from_step=10" for a, b in ((2, 3), (4, 5), (0, 1))],
        "slow_link",
    ),
    Case("host_stall", "dp", [f"host_stall:rank={r},step=12,seconds=0.5" for r in (5, 2, 7)], "host_stall"),
    Case(
        "dataloader_stall",
        "dp",
        [f"dataloader_stall:rank={r},step=12,seconds=0.3,steps=3" for r in (6, 0, 3)],
        "host_stall",
    ),
    Case("gc_pause", "dp", [f"gc_pause:rank={r},step=12,seconds=0.3" for r in (1, 4, 6)], "host_stall"),
    Case(
        "bubble (pp-dp)",
        "pp-dp",
        [f"bubble:rank={r},factor=1.9,from_step=10" for r in (5, 3, 7)],
        "pipeline_bubble",
    ),
    Case("hang", "dp", [f"hang:rank={r},step=12" for r in (6, 3, 0)], "hang"),
]


@dataclass
class Run:
    detected: bool
    latency: Optional[float]  # steps (hang: seconds)
    alerts: List[Tuple[str, List[int]]] = field(default_factory=list)
    false: int = 0


def judge(c: Collected, kind: str, th: Thresholds) -> Run:
    (f,) = c.truth["faults"]
    truth = set(f["ranks"])
    onset = int(f["onset_step"])
    eng = Engine(th, NAMES)
    hits: List[Tuple[str, List[int], Optional[int], int]] = []
    for it in c.items:
        for a in eng.add(it):
            if a.state == "firing":
                step = eng.jobs[a.job].last_step if isinstance(it, RankStep) else None
                hits.append((a.kind, a.ranks, step, a.first_seen))
    for a in eng.flush():
        if a.state == "firing":
            hits.append((a.kind, a.ranks, None, a.first_seen))
    run = Run(False, None, [(k, r) for k, r, _, _ in hits])
    for k, ranks, step, seen in hits:
        ok = k == kind and truth <= set(ranks)
        if kind != "slow_link" or f["kind"] != "slow_link":
            ok = ok and set(ranks) == truth
        if ok and not run.detected:
            if kind == "hang":
                lat = (seen - (c.hang_seen_ns or seen)) / 1e9
                run.detected, run.latency = True, lat
            elif step is not None and step - onset <= 3:
                run.detected, run.latency = True, float(step - onset)
            else:
                run.false += 1
        elif not ok:
            run.false += 1
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clean-steps", type=int, default=300)
    ap.add_argument(
        "--no-python", action="store_true", help="probe without the Python channel (as the e2e tests do)"
    )
    args = ap.parse_args()
    python = not args.no_python
    th_hang = Thresholds()
    th_hang.hang_min_s = 1.0
    rows: List[Tuple[str, str, List[Run]]] = []
    t0 = time.monotonic()
    for case in CASES:
        runs: List[Run] = []
        for spec in case.specs[: args.reps]:
            with tempfile.TemporaryDirectory(prefix="argus-acc-") as d:
                cfg = SimConfig(
                    ranks=8, steps=22, layout=case.layout, preset="small", injects=[spec], run_dir=d
                )
                if case.kind == "hang":
                    c = collect_with_heartbeats(cfg, hold_s=4.0)
                    runs.append(judge(c, case.kind, th_hang))
                else:
                    runs.append(judge(collect_steps(cfg, python), case.kind, Thresholds()))
            print(f"  {spec}: {runs[-1]}", file=sys.stderr, flush=True)
        rows.append((case.fault, case.kind, runs))
    clean: Dict[str, Tuple[int, List[Tuple[str, List[int]]]]] = {}
    for layout in ("dp", "pp-dp"):
        with tempfile.TemporaryDirectory(prefix="argus-acc-") as d:
            cfg = SimConfig(ranks=8, steps=args.clean_steps, layout=layout, preset="small", run_dir=d)
            c = collect_steps(cfg, python)
            eng = Engine(Thresholds(), NAMES)
            fired = [(a.kind, a.ranks) for a in eng.run(c.items) if a.state == "firing"]
            clean[layout] = (eng.stats.steps_judged, fired)
            print(f"  clean {layout}: {eng.stats.steps_judged} steps, {fired}", file=sys.stderr, flush=True)
    took = time.monotonic() - t0

    chans = "every default channel" if python else "every default channel but Python"
    print(f"# diagnosis accuracy: 8 simulated ranks (preset small), {args.reps} runs per fault, {chans}\n")
    print("| injected fault | expected alert | runs | recall | precision | latency (median / max) | others |")
    print("|---|---|---:|---:|---:|---:|---|")
    for fault, kind, runs in rows:
        det = [r for r in runs if r.detected]
        tp = len(det)
        fp = sum(r.false for r in runs)
        lats = [r.latency for r in det if r.latency is not None]
        unit = " s" if kind == "hang" else " steps"
        lat = f"{statistics.median(lats):.1f} / {max(lats):.1f}{unit}" if lats else "-"
        other = "; ".join(f"{k} {rk}" for r in runs for k, rk in r.alerts if not (k == kind)) or "none"
        prec = f"{tp / (tp + fp):.2f}" if tp + fp else "-"
        print(f"| {fault} | `{kind}` | {len(runs)} | {tp / len(runs):.2f} | {prec} | {lat} | {other} |")
    for layout, (n, fired) in clean.items():
        alerts = f"{len(fired)} alert(s) {fired or ''}"
        print(f"| none ({layout}, clean) | none | 1 ({n} steps) | - | - | - | {alerts} |")
    print(f"\n(took {took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
