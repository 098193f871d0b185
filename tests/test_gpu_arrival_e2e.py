"""End to end, attached late, on jobs that record no timers (stock PyTorch DDP over NCCL): which GPU
reached the collectives last comes from what the job does anyway (docs/diagnosis.md "Which GPU
arrived last"). Real BPF, every default channel, the summaries fed to the aggregator in the order
the agent printed them. The second stand-ins' asynchronous variant (tests/standins: written without
reading the simulator; its proxy's `ncclIbIsend` is exported) and the simulator (stock-PyTorch
pattern by default; `ncclNetSocketIsend` a local symbol).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest

from argus.aggregator.alerts import Alert
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.engine import Engine
from argus.schema import RankStep
from tests.agg_probing import Collected, collect_late, trainer_step

pytestmark = [pytest.mark.bpf, pytest.mark.slow, pytest.mark.noisy_vm]

NAMED_WITHIN = 5  # steps after the faulty rank's first aligned data (the evidence is one step late)


def judge(c: Collected) -> Tuple[Engine, List[Tuple[Alert, Optional[int]]]]:
    eng = Engine(Thresholds(), PhaseInfo.parse(""))
    fired: List[Tuple[Alert, Optional[int]]] = []
    for it in c.items:
        for a in eng.add(it):
            if a.state == "firing":
                fired.append((a, trainer_step(c, it) if isinstance(it, RankStep) else None))
    fired += [(a, None) for a in eng.flush() if a.state == "firing"]
    return eng, fired


# (id, family, ranks, config, evidence source the alert must cite)
Case = Tuple[str, str, int, Dict[str, Any], str]
Q = "event queries"  # surely last at an instance, or estimated by the bounds' mid-points
NAMED: List[Case] = [
    # the simulator as a stock PyTorch job (its default): 2 hosts, the proxy's local ncclNetSocketIsend.
    # 4 ranks: with 8 and the agent on 2 CPUs a healthy rank's first send comes up to 12 ms after its
    # peers' (learnt noise: 13 ms), as late as the 1.3x straggler's (6-16 ms). Named 4 steps after
    # its first data in 2 runs here, but 17 in CI on a machine at half speed (2026-12-07); with 4
    # ranks, 3 steps in 3 runs
    ("sim_net", "sim", 4, {"timers": False, "ranks_per_host": 2}, "first network send"),
    # 4 ranks as well: with 8, named 6 and 7 steps after the first data on 2026-12-07 (this machine
    # at half its speed, as CI's that day; the code of d923af7 alike); with 4, 3 and 3
    ("sim_timing", "sim", 4, {"timers": False, "nccl_timing": True}, "in-collective GPU times"),
    ("standins_net", "standins", 8, {"variant": "async"}, "first network send"),
    (
        "standins_timing",
        "standins",
        8,
        {"variant": "async", "ranks_per_host": 8, "nccl_timing": True},
        "in-collective GPU times",
    ),
    # one host, timing off, launch-bound (a full launch queue: the host keeps pace with its GPU, its
    # launches' waits are GPU waits): event queries alone. The simulator with 4 ranks: 8 launch-bound
    # simulated ranks and the agent's launch probes keep both CPUs of this machine busy, and then,
    # by the simulator's own ground truth, the straggler's GPU is no longer the one that comes last
    # (docs/benchmarks.md 8.18)
    ("sim_queries", "sim", 4, {"timers": False, "preset": "heavy", "overrides": {"launch_queue": 1024}}, Q),
    ("standins_queries", "standins", 8, {"variant": "async", "ranks_per_host": 8, "launch_bound": True}, Q),
]
# The stand-ins' allocator bounds an arrival within 11-15 ms, their 1.3x straggler is 10-15 ms late:
# each step's evidence is marginal by their own query rate (surely last in 1 step of 4, estimated by
# the mid-points in most others), and 8 launch-bound ranks on this machine's 2 CPUs blur it more.
# Measured in 6 runs: 5-7 steps. The simulator's: 3 steps in 11 runs of 14, 4 in one, 6 in two: in
# the first steps after attaching its host's own time on 2 CPUs reads as host-bound now and then
# (docs/benchmarks.md 8.18). The accuracy runs count from the fault's onset: 3 steps in both.
WITHIN = {"sim_queries": 6, "standins_queries": 10}
STEPS = {"sim": (600, 40), "sim_queries": (200, 20), "standins": (250, 10)}  # steps, attach step


@pytest.mark.parametrize("case", NAMED, ids=[c[0] for c in NAMED])
def test_a_gpu_straggler_is_named_without_timers(case: Case) -> None:
    _id, fam, ranks, extra, source = case
    steps, at = STEPS.get(_id, STEPS[fam])
    c = collect_late(fam, ranks, steps, "dp", ["straggler:rank=3,factor=1.3"], at, 10, **extra)
    assert any(rs.gpu_arrival is not None for rs in c.steps), "no GPU-arrival evidence in the summaries"
    _eng, fired = judge(c)
    got = [(a.kind, a.ranks, s) for a, s in fired]
    named = [(a, s) for a, s in fired if a.ranks]
    assert named, f"nobody named: {got}"
    first, at = named[0]
    ev = json.dumps(first.evidence, default=str)
    assert (first.kind, first.ranks) == ("straggler", [3]), f"{got} {ev}"
    assert source in first.evidence["gpu_arrival"]["source"], ev
    assert source in first.summary, first.summary
    seen = min(s for s in (trainer_step(c, rs) for rs in c.steps if rs.rank == 3) if s is not None)
    print(f"\nnamed at step {at}, {None if at is None else at - seen} steps after its first data: {got}")
    assert at is not None and at - seen <= WITHIN.get(_id, NAMED_WITHIN), (at, seen, got)
    others = [(a.kind, a.ranks) for a, _ in named if a.ranks != [3]]
    assert others == [], got


def test_one_host_without_timing_says_what_evidence_is_missing() -> None:
    """NVLink-only (one host: no network sends), timing off, the host far ahead of its GPU (event
    queries bound nothing tightly): the slowdown is reported, nobody is named, and the alert says
    why it cannot tell which GPU came last."""
    extra = {"variant": "async", "ranks_per_host": 8}
    # the fault once the agent is ready (8 busy stand-in ranks: ~10 s, 90-100 steps, on 2026-12-07)
    c = collect_late("standins", 8, 300, "dp", ["straggler:rank=3,factor=2,from_step=160"], 10, 16, **extra)
    _eng, fired = judge(c)
    got = [(a.kind, a.ranks, a.summary) for a, _ in fired]
    assert [a for a, _ in fired if a.ranks] == [], got
    l1 = [a for a, _ in fired if a.kind in ("step_regression", "step_spike")]
    assert l1, got
    text = l1[0].summary
    assert "which GPU arrived last cannot be told" in text, text
    for missing in ("no CUDA-event timers", "TORCH_NCCL_ENABLE_TIMING is off", "no network sends"):
        assert missing in text, text
