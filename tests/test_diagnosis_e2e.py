"""End to end: the simulated 8-rank job with an injected fault, `argus probe` attached with real BPF
and every default channel before the job's first CUDA call, its summaries fed to the aggregator in
step order — the right alert kind names the right rank(s) within 3 steps of the fault's onset, and
nothing else fires. Jobs run one at a time. (Attached late, and on the second stand-ins:
tests/test_attach_late_e2e.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from argus.aggregator.alerts import Alert
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.engine import Engine
from argus.schema import RankStep
from argus.sim.launcher import SimConfig
from tests.agg_probing import (
    Collected,
    collect_steps,
    collect_with_heartbeats,
    job_slowed,
    onset,
    rank_was_slow,
)

pytestmark = [pytest.mark.bpf, pytest.mark.noisy_vm]

NAMES = "forward,backward,optimizer,grad_sync"  # the simulator's timer0..3
MAX_LATENCY = 3  # steps after onset

# (id, layout, steps, inject, expected kind, expected ranks)
CASES: List[Tuple[str, str, int, str, str, List[int]]] = [
    ("straggler", "dp", 22, "straggler:rank=3,factor=1.5,from_step=10", "straggler", [3]),
    ("masked_straggler", "dp", 22, "masked_straggler:rank=4,factor=2,from_step=10", "straggler", [4]),
    ("slow_link_dp", "dp", 22, "slow_link:ranks=2-3,factor=50,from_step=10", "slow_link", list(range(8))),
    ("slow_link_pp", "pp-dp", 22, "slow_link:ranks=2-3,factor=100,from_step=10", "slow_link", [2, 3]),
    ("host_stall", "dp", 22, "host_stall:rank=5,step=12,seconds=0.5", "host_stall", [5]),
    ("dataloader_stall", "dp", 22, "dataloader_stall:rank=6,step=12,seconds=0.3,steps=3", "host_stall", [6]),
    ("gc_pause", "dp", 22, "gc_pause:rank=1,step=12,seconds=0.3", "host_stall", [1]),
    ("bubble", "pp-dp", 22, "bubble:rank=5,factor=1.9,from_step=10", "pipeline_bubble", [5]),
]


def feed(c: Collected, th: Optional[Thresholds] = None) -> Tuple[Engine, List[Tuple[Alert, Optional[int]]]]:
    """Feed in order; each firing transition with the step being judged when it fired."""
    eng = Engine(th, PhaseInfo.parse(NAMES))
    fired: List[Tuple[Alert, Optional[int]]] = []
    for it in c.items:
        for a in eng.add(it):
            if a.state == "firing":
                d = eng.jobs[a.job]
                fired.append((a, d.last_step if isinstance(it, RankStep) else None))
    for a in eng.flush():
        if a.state == "firing":
            fired.append((a, None))
    return eng, fired


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fault_is_named_within_three_steps(
    case: Tuple[str, str, int, str, str, List[int]], tmp_path: Path
) -> None:
    _id, layout, steps, inject, kind, ranks = case
    c = collect_steps(
        SimConfig(
            timers=True,
            ranks=8,
            steps=steps,
            layout=layout,
            preset="small",
            injects=[inject],
            run_dir=str(tmp_path),
        )
    )
    _k, truth_ranks, start = onset(c.truth)
    _eng, fired = feed(c)
    got = [(a.kind, a.ranks, step) for a, step in fired]
    assert got, f"nothing fired for {inject}"
    first, at = fired[0]
    assert (first.kind, first.ranks) == (kind, ranks), f"{got} {json.dumps(first.evidence, default=str)}"
    assert set(truth_ranks) <= set(first.ranks)
    assert at is not None and at - start <= MAX_LATENCY, (at, start, got)
    extra = json.dumps([a.evidence for a, _ in fired[1:]], default=str)
    assert len(fired) == 1, f"extra alerts: {got}; {extra}"  # precision: nothing but the fault
    if _id == "masked_straggler":
        # the victims' collective phase (grad_sync) is the largest, yet the straggler is named
        ev = first.evidence
        assert ev["waited_for"]["timer3"]["ratio"] < 0.9 and ev["symptoms"] == [0, 1, 2, 3, 5, 6, 7]
        last = max(rs.step or 0 for rs in c.steps)
        g = {rs.rank: rs.phases["timer3"] for rs in c.steps if rs.step == last}
        assert min(g, key=g.__getitem__) == 4 and all(g[r] > g[4] for r in g if r != 4)
    if _id == "slow_link_dp":
        assert first.evidence["pair"] is None and first.evidence["ratio"] > 1.5
    if _id == "slow_link_pp":
        assert first.evidence["pair"] == [2, 3]


def test_hang_names_the_missing_rank_and_sequence(tmp_path: Path) -> None:
    c = collect_with_heartbeats(
        SimConfig(
            timers=True,
            ranks=8,
            steps=40,
            preset="small",
            injects=["hang:rank=6,step=12"],
            run_dir=str(tmp_path),
        ),
        hold_s=4.0,
    )
    assert c.truth["faults"][0].get("hang"), "the injected hang did not happen"
    th = Thresholds()
    th.hang_min_s = 1.0  # tests: 1 s blocked is a hang (default 60 s, see docs/diagnosis.md)
    _eng, fired = feed(c, th)
    hangs = [a for a, _ in fired if a.kind == "hang"]
    assert [(a.ranks, a.severity) for a in hangs] == [([6], "critical")], [
        (a.kind, a.ranks) for a, _ in fired
    ]
    # the trainer stopped before its first DP all-reduce of that step: collective #0 of the step
    assert hangs[0].evidence["collective"] == {"step": c.truth["faults"][0]["hang"]["step"], "index": 0}
    assert hangs[0].evidence["blocked_ranks"] == 7
    # detected within the threshold plus two heartbeat periods of the hang
    assert c.hang_seen_ns is not None
    assert (hangs[0].first_seen - c.hang_seen_ns) / 1e9 <= th.hang_min_s + 1.5
    assert [a.kind for a, _ in fired] == ["hang"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,steps", [("dp", 300), ("pp-dp", 150)])
def test_clean_run_raises_no_alert(layout: str, steps: int, tmp_path: Path) -> None:
    """No alert names a rank unless the trainer's own records say that rank was slow; a job-level
    step-time alert only where the job's own clock (the trainer's step records) slowed as much: on
    this shared 2-core VM the whole job sometimes does slow down (CPU steal), and saying so is
    right. The simulated GPUs are threads, so a co-tenant can really slow one rank's "GPU" work:
    in 6 of 16 clean pp-dp runs with one busy loop beside the job a rank was named (e.g. a stage-0
    rank's forward took 1.7-2.4x its stage's in 4 of 6 steps while its peers waited for it: a
    pipeline bubble; in CI once, 1.56x, without a busy loop); alone on the VM, 0 of 8."""
    c = collect_steps(
        SimConfig(timers=True, ranks=8, steps=steps, layout=layout, preset="small", run_dir=str(tmp_path))
    )
    eng, fired = feed(c)
    assert eng.stats.steps_judged >= steps - 3
    ev = json.dumps([a.evidence for a, _ in fired], default=str)
    unjustified = [
        (a.kind, a.ranks, s, round(job_slowed(c, *a.steps), 2))
        for a, s in fired
        if (a.ranks and not (a.kind in ("straggler", "pipeline_bubble") and rank_was_slow(c, a.ranks[0], s)))
        or (
            not a.ranks
            and (a.kind not in ("step_regression", "step_spike") or job_slowed(c, *a.steps) < 1.15)
        )
    ]
    assert unjustified == [], ev
    for a, _s in fired:
        print(f"\n{a.kind} steps {a.steps}: the trainer's own steps slowed {job_slowed(c, *a.steps):.2f}x")
