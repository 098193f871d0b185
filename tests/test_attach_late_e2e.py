"""End to end, attached late: the job runs (its communicators created long before), then `argus
probe` attaches with real BPF and every default channel; its summaries go to the aggregator in the
order the agent printed them. Both families of stand-ins (tests/families.py): the simulator
(asynchronous collectives, CUDA-event timers, a layout from the table) and the second stand-ins
(blocking collectives, their own ncclComm layout read through the decoded accessors, stripped, no
CUDA events). A fault already present at attach is named within 5 steps of the faulty rank's first
aligned data; one that starts after attach within 3 steps of its onset; nothing else names a rank.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import pytest

from argus.aggregator.alerts import Alert
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.engine import Engine
from argus.schema import Heartbeat, RankStep
from tests import families
from tests.agg_probing import Collected, collect_hang, collect_late, job_slowed, rank_was_slow, trainer_step

pytestmark = [pytest.mark.bpf, pytest.mark.noisy_vm]

BEFORE_MAX = 5  # steps after the faulty rank's first aligned data
AFTER_MAX = 3  # steps after the onset
L1_KINDS = ("step_regression", "step_spike")
HANG_MAX_S = 30.0  # after the agent was ready (hang in progress) / the hang began (after attach)

# (id, family, layout, steps, inject, attach at trainer step, probe s, kind, ranks)
Case = Tuple[str, str, str, int, str, int, float, str, List[int]]
CASES: List[Case] = [
    # the case: rank 5 was the straggler from the start; named `straggler`, nobody else
    ("sim_straggler", "sim", "dp", 600, "straggler:rank=5,factor=1.35", 40, 10, "straggler", [5]),
    ("sim_slow_link_pp", "sim", "pp-dp", 400, "slow_link:ranks=2-3,factor=100", 30, 10, "slow_link", [2, 3]),
    ("sim_bubble", "sim", "pp-dp", 400, "bubble:rank=5,factor=1.9", 30, 10, "pipeline_bubble", [5]),
    ("standins_straggler", "standins", "dp", 250, "straggler:rank=5,factor=1.35", 10, 10, "straggler", [5]),
    (
        "standins_slow_link_pp",
        "standins",
        "pp-dp",
        250,
        "slow_link:ranks=2-3,factor=20",
        10,
        10,
        "slow_link",
        [2, 3],
    ),
    ("standins_bubble", "standins", "pp-dp", 250, "bubble:rank=3,factor=2", 10, 10, "pipeline_bubble", [3]),
    # after attach: a one-step stall of one rank's host
    (
        "standins_host_stall",
        "standins",
        "dp",
        150,
        "host_stall:rank=5,step=95,seconds=0.5",
        10,
        10,
        "host_stall",
        [5],
    ),
]


def judge(c: Collected, names: str) -> Tuple[Engine, List[Tuple[Alert, Optional[int]]]]:
    """Feed in arrival order; each firing transition with the trainer step being judged."""
    eng = Engine(Thresholds(), PhaseInfo.parse(names))
    fired: List[Tuple[Alert, Optional[int]]] = []
    for it in c.items:
        for a in eng.add(it):
            if a.state == "firing":
                fired.append((a, trainer_step(c, it) if isinstance(it, RankStep) else None))
    fired += [(a, None) for a in eng.flush() if a.state == "firing"]
    return eng, fired


def _job_really_slowed(c: Collected, a: Alert, at: Optional[int]) -> bool:
    """A job-level step-time alert whose trainer steps (the `at` it fired in, as many back as the
    alert spans) really were 1.15x the job's steps before."""
    if a.ranks or a.kind not in L1_KINDS or at is None:
        return False
    return job_slowed(c, at - (a.steps[1] - a.steps[0]), at) >= 1.15


def _onset(inject: str) -> Optional[int]:
    kv = dict(p.split("=") for p in inject.partition(":")[2].split(",") if "=" in p)
    for k in ("from_step", "step"):
        if k in kv:
            return int(kv[k])
    return None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fault_is_named_attached_late(case: Case) -> None:
    _id, fam, layout, steps, inject, at, probe_s, kind, ranks = case
    c = collect_late(fam, 8, steps, layout, [inject], at, probe_s)
    assert "communicators identified from " + ("table" if fam == "sim" else "accessors") in c.probe_stderr
    eng, fired = judge(c, families.PHASES[fam])
    got = [(a.kind, a.ranks, s) for a, s in fired]
    # a job-level step-time alert before the finding is right where the job's own clock slowed as
    # much (CPU steal on this shared VM: in CI a 1.25x step regression fired 9 steps before the
    # host stall it was not about)
    fired = [(a, s) for a, s in fired if not _job_really_slowed(c, a, s)]
    assert fired, f"nothing fired for {inject}: {eng.jobs and next(iter(eng.jobs.values())).align.summary()}"
    first, at_step = fired[0]
    ev = json.dumps(first.evidence, default=str)
    assert (first.kind, first.ranks) == (kind, ranks), f"{got} {ev}"
    onset = _onset(inject)
    seen = {
        r: min(s for s in (trainer_step(c, rs) for rs in c.items if rs.rank == r) if s is not None)
        for r in ranks
    }
    assert at_step is not None, got
    if onset is not None and onset > max(seen.values()):  # the fault began after attach
        assert at_step - onset <= AFTER_MAX, (at_step, onset, got)
    else:
        assert at_step - max(seen.values()) <= BEFORE_MAX, (at_step, seen, got)
    # the same finding may resolve and fire again near its threshold; another one naming a rank may
    # not, unless the trainer's own records say that rank was slow then: the simulated GPUs are
    # threads, and a co-tenant really slows one, as in clean runs (test_diagnosis_e2e). CI of 5f88dc5,
    # on a machine at half its usual speed: `pipeline_bubble [4]` at step 344, 150 steps after the
    # injected [5] was named
    assert _others_named(c, fired[1:], kind, ranks) == [], f"other alerts naming ranks: {got}"

    # where the identity came from, and how sure: in the alert's evidence
    ident = first.evidence["identity"]
    assert ident["steps"]["aligned_by"] in ("time", "anchor+time", "anchor", "time+anchor"), ident
    if first.kind != "host_stall":
        want = "table" if fam == "sim" else "accessors"
        assert ident["comm"]["identity"] == want and ident["comm"]["confidence"], ident
        assert first.evidence["comm_mode"] == ("async" if fam == "sim" else "blocking")


def _others_named(
    c: Collected, fired: List[Tuple[Alert, Optional[int]]], kind: str, ranks: List[int]
) -> List[Tuple[str, List[int], Optional[int]]]:
    """The alerts naming a rank other than the finding, but those where the trainer's own records
    say that rank was slow then."""
    return [
        (a.kind, a.ranks, s)
        for a, s in fired
        if a.ranks
        and (a.kind, a.ranks) != (kind, ranks)
        and not (a.kind in ("straggler", "pipeline_bubble") and rank_was_slow(c, a.ranks[0], s))
    ]


@pytest.mark.parametrize("fam", families.FAMILIES)
def test_hang_in_progress_at_attach(fam: str) -> None:
    """The job is already hung when the agent arrives: the ranks blocked in a probed call and the
    one that is not, and what it is doing, named within 30 s of the agent being ready, with the
    default threshold (15 s: no step was ever seen)."""
    c = collect_hang(fam, 8, 400, "dp", "hang:rank=6,step=12", attach_after_hang_s=3.0, hold_s=25.0)
    assert c.ready_ns is not None
    eng = Engine(Thresholds(), PhaseInfo.parse(families.PHASES[fam]))
    hangs: List[Alert] = []
    for it in c.items:
        hangs += [a for a in eng.add(it) if a.state == "firing"]
    assert [(a.kind, a.ranks) for a in hangs][:1] == [("hang", [6])], [
        (a.kind, a.ranks, a.summary) for a in hangs
    ]
    a = hangs[0]
    assert (a.first_seen - c.ready_ns) / 1e9 <= HANG_MAX_S
    ev: Dict[str, Any] = a.evidence
    assert ev["since_attach"] == [0, 1, 2, 3, 4, 5, 7] and ev["blocked_ranks"] == 7
    assert "maybe_hang" in ev["where"][6] and "clock_nanosleep" in ev["where"][6], ev["where"]
    call = "cuStreamSynchronize" if fam == "sim" else "ncclAllReduce"
    assert ev["calls"] == [call] and all(call in ev["where"][r] for r in (0, 1, 2, 3, 4, 5, 7))
    if fam == "standins":  # blocked inside the collective: its communicator read from their stacks
        assert ev["communicator"]["missing_as"] == [6] and ev["communicator"]["nranks"] == 8
    assert len(hangs) == 1, [x.summary for x in hangs]


def test_hang_after_attach_names_the_collective() -> None:
    """Attached late (no communicator seen created), then a rank stops before a collective: the
    others block inside it (blocking stand-ins); named with the job's step and collective."""
    c = collect_hang("standins", 8, 400, "dp", "hang:rank=6,step=80", attach_at_step=10, hold_s=20.0)
    assert c.hang_seen_ns is not None
    eng = Engine(Thresholds(), PhaseInfo.parse(""))
    fired = [a for it in c.items for a in eng.add(it) if a.state == "firing"]
    # as in the other cases, no other alert may name a rank (a job-level L1 step_regression names
    # none: one CI run on this 2-core machine drew two before the hang)
    hangs = [a for a in fired if a.ranks]
    assert [(a.kind, a.ranks) for a in hangs] == [("hang", [6])], [(a.kind, a.ranks) for a in fired]
    assert all(a.kind in L1_KINDS for a in fired if not a.ranks), [(a.kind, a.ranks) for a in fired]
    a = hangs[0]
    assert (a.first_seen - c.hang_seen_ns) / 1e9 <= HANG_MAX_S
    steps = [rs for rs in c.items if isinstance(rs, RankStep)]
    assert steps and a.evidence["collective"]["index"] == 0
    assert a.evidence["identity"]["comm"]["identity"] == "accessors"
    assert "never reached collective #0 of step" in a.summary
    assert all(isinstance(x, (RankStep, Heartbeat)) for x in c.items)


# (family, steps, attach at, collective records kept per communicator-step): the simulator's 24
# all-reduces a step become every 6th, the stand-ins' 4 every 2nd
NTH = [("sim", 8, 600, 40, 4), ("standins", 8, 250, 10, 2)]


@pytest.mark.parametrize("fam, ranks, steps, at, keep", NTH, ids=[n[0] for n in NTH])
def test_straggler_named_from_every_nth_collective(
    monkeypatch: pytest.MonkeyPatch, fam: str, ranks: int, steps: int, at: int, keep: int
) -> None:
    """The issue's case with the agent keeping fewer collective records per communicator and step
    than the job issues (`--coll-records`, default 32: the `tp` preset's 3,200 a rank-step become
    32): BPF records every n-th, the same ones on every rank whenever its agent attached, and
    counts the rest; the straggler is still named, alone, as soon. Both families of stand-ins."""
    monkeypatch.setenv("ARGUS_PROBE_COLL_RECORDS", str(keep))
    slow = ranks - 3
    c = collect_late(fam, ranks, steps, "dp", [f"straggler:rank={slow},factor=1.35"], at, 10)
    sampled = [rs for rs in c.steps if any(x.count > len(x.seqs) for x in rs.comms.values())]
    assert len({rs.rank for rs in sampled}) == ranks, "not every rank's collectives were sampled"
    # one step's instances are the same positions on every rank (the aggregator matches them), but
    # for the step a rank's agent began sampling in: it holds the instances before as well (one CI
    # run: 0, 1, 2, 4, 6 of 8 on one rank, 0, 2, 4, 6 on the others), matched by position
    pos: Dict[Tuple[Optional[int], str], Dict[int, Tuple[int, ...]]] = {}
    began: Dict[Tuple[int, str], int] = {}
    for rs in sampled:
        for key, x in rs.comms.items():
            if x.count > len(x.seqs):
                s = trainer_step(c, rs)
                pos.setdefault((s, key), {})[rs.rank] = tuple(q - x.first_seq for q in x.seqs)
                if s is not None:
                    began[rs.rank, key] = min(began.get((rs.rank, key), s), s)
    odd = [
        (r, k)
        for k, v in pos.items()
        for r, p in v.items()
        if p != Counter(v.values()).most_common(1)[0][0] and k[0] != began.get((r, k[1]))
    ]
    assert not odd, [(r, k, pos[k]) for r, k in odd]
    _eng, fired = judge(c, families.PHASES[fam])
    got = [(a.kind, a.ranks, s) for a, s in fired]
    assert fired and (fired[0][0].kind, fired[0][0].ranks) == ("straggler", [slow]), got
    seen = min(s for s in (trainer_step(c, rs) for rs in c.items if rs.rank == slow) if s is not None)
    print(f"\nnamed at step {fired[0][1]}, first data at {seen}: {got}")
    assert fired[0][1] is not None and fired[0][1] - seen <= BEFORE_MAX, (got, seen)
    assert _others_named(c, fired[1:], "straggler", [slow]) == [], got
