"""Putting late-attached ranks on the job's steps and communicators (argus.aggregator.align): pure
logic over synthetic summaries shaped like agents' output after attaching at different steps."""

from __future__ import annotations

import copy
import random
from typing import Dict, List, Optional

from argus.aggregator.align import POSITIONS, JobAlign, fit_offset, partition
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.engine import Engine
from argus.schema import RankStep, from_probe
from tests.aggsynth import Faults, Job, generate

NAMES = PhaseInfo.parse("forward,backward,optimizer,grad_sync")


def attached_late(
    j: Job, attach: Dict[int, int], identity: str = "accessors", uncertainty_ns: int = 0
) -> List[RankStep]:
    """What agents that attached to rank r at step attach[r] would send: steps counted from there
    (ordinal), sequence numbers counted from there, each rank's own key for every communicator
    (its handle), with rank/nRanks (accessors) or nothing (inferred)."""
    out: List[RankStep] = []
    first_seq: Dict[tuple, int] = {}
    for d in generate(j):
        r, s = d["rank"], d["step"]
        if s < attach.get(r, 0):
            continue
        d = copy.deepcopy(d)
        d["step"], d["step_source"] = s - attach[r], "ordinal"
        d["wall_offset_err_ns"] = uncertainty_ns
        local = {
            c: f"{0x7F00_0000_0000 + 0x1000 * r + i:016x}" for i, c in enumerate(sorted(d["nccl"]["comms"]))
        }
        comms = {}
        for c, meta in d["nccl"]["comms"].items():
            m = dict(meta, identity=identity)
            if identity == "inferred":
                m["nranks"], m["rank"] = -1, -1
            comms[local[c]] = m
        d["nccl"]["comms"] = comms
        arr = []
        for a in d["nccl"]["arrivals"]:
            a = list(a)
            key = (r, a[0])
            if a[2] not in ("Send", "Recv"):
                first_seq.setdefault(key, a[1])
                a[1] = a[1] - first_seq[key] + 17  # the agent's own count, from attach
            a[0] = local[a[0]]
            arr.append(a)
        d["nccl"]["arrivals"] = arr
        out.append(from_probe(d))
    # agents on different hosts deliver in their own order
    random.Random(3).shuffle(out)
    out.sort(key=lambda rs: rs.end_ns)
    return out


def aligned(items: List[RankStep]) -> List[RankStep]:
    ja = JobAlign()
    out: List[RankStep] = []
    for rs in items:
        out += ja.add(rs)
    return out + ja.flush()


ATTACH = {0: 3, 1: 5, 2: 4, 3: 6, 4: 3, 5: 7, 6: 4, 7: 5}


def test_fit_offset_nearest_step_end_within_tolerance() -> None:
    ref = {g: 1000 * g for g in range(10, 20)}
    own = [(s, 1000 * (s + 12) + 30) for s in range(3)]
    assert fit_offset(own, ref, 250)[0] == 12
    off, res, why = fit_offset([(s, 1000 * (s + 12) + 400) for s in range(3)], ref, 250)
    assert off is None and "tolerance" in why and res == 400
    off, _res, why = fit_offset([(0, 15_500), (1, 16_500), (2, 17_500)], ref, 600)
    assert off is None and "ambiguous" in why  # halfway between two steps: no guess


def test_partition_by_rank_stride() -> None:
    dp = {0: 0, 2: 1, 4: 2, 6: 3, 1: 0, 3: 1, 5: 2, 7: 3}
    assert sorted(sorted(p) for p in partition(dp, 4) or []) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    pp = {r: r % 2 for r in range(8)}
    assert sorted(sorted(p) for p in partition(pp, 2) or []) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition({0: 0, 1: 0, 2: 0}, 2) is None  # three rank-0s of 2-rank communicators: no guess


def test_late_ranks_get_the_job_steps_and_instances() -> None:
    """Every rank attached at another step: its summaries come back on the anchor's numbering (the
    same job step on every rank for the same trainer step) and the instances of a step match."""
    j = Job(steps=30)
    out = aligned(attached_late(j, ATTACH))
    anchor = min(ATTACH.values())
    by: Dict[int, Dict[int, RankStep]] = {}
    for rs in out:
        by.setdefault(rs.rank, {})[rs.step or 0] = rs
    assert set(by) == set(range(8))
    truth = {(d["rank"], d["step"]): d["start_ns"] for d in generate(j)}
    for r, steps in by.items():
        for g, rs in steps.items():
            assert rs.start_ns == truth[(r, g + anchor)], (r, g)  # the trainer's step g + anchor
    comms = {k for rs in out for k in rs.comms}
    assert len(comms) == 1, comms  # one job communicator, not eight handles
    c = by[0][10].comms[next(iter(comms))]
    assert c.identity == "accessors" and c.nranks == 8 and c.seqs == [10 * POSITIONS + i for i in range(8)]
    assert all(by[r][10].comms[c.comm].seqs == c.seqs for r in range(8))


def test_pp_dp_communicators_are_split_by_size_and_stride() -> None:
    out = aligned(attached_late(Job(steps=20, layout="pp-dp"), ATTACH))
    members: Dict[str, set] = {}
    for rs in out:
        for k in rs.comms:
            members.setdefault(k, set()).add(rs.rank)
    got = sorted(sorted(m) for m in members.values())
    assert got == [[0, 1], [0, 2, 4, 6], [1, 3, 5, 7], [2, 3], [4, 5], [6, 7]], got


def test_sizes_unknown_groups_by_calls_and_says_so() -> None:
    ja = JobAlign()
    out: List[RankStep] = []
    for rs in attached_late(Job(steps=20), ATTACH, identity="inferred"):
        out += ja.add(rs)
    (key,) = {k for rs in out for k in rs.comms}
    ident = ja.identity(key, [0])
    assert ident["comm"]["identity"] == "inferred" and ident["comm"]["confidence"] == "low"
    assert "sizes unknown" in ident["comm"]["note"] and ident["steps"]["aligned_by"] in ("anchor", "time")


def test_clock_too_uncertain_is_refused_and_said() -> None:
    ja = JobAlign()
    items = attached_late(Job(steps=20), ATTACH, uncertainty_ns=40_000_000)  # ±40 ms on ~85 ms steps
    for rs in items:
        ja.add(rs)
    why = ja.unaligned()
    assert why and all("clock" in w for w in why.values()), why


def _first_fire(eng: Engine, items: List[RankStep], kind: str) -> Optional[int]:
    for rs in items:
        for a in eng.add(rs):
            if a.state == "firing" and a.kind == kind:
                return eng.jobs[a.job].last_step
    return None


def test_straggler_present_before_attach_is_named_from_the_first_aligned_steps() -> None:
    """The fault was there before any agent arrived: no healthy history, yet the straggler is named
    within 5 steps of the first aligned data, with where its identity came from."""
    j = Job(steps=30, faults=Faults(straggler=(5, 1.4, 0)))
    eng = Engine(Thresholds(), NAMES)
    at = _first_fire(eng, attached_late(j, ATTACH), "straggler")
    first = ATTACH[5] - min(ATTACH.values())  # the job step of rank 5's first summary
    assert at is not None and at - first <= 5, (at, first)
    (a,) = [a for a in eng.transitions if a.kind == "straggler"]
    assert a.ranks == [5] and a.evidence["identity"]["comm"]["identity"] == "accessors"
    assert [x.kind for x in eng.transitions if x.state == "firing"] == ["straggler"]


def _blocking(j: Job) -> List[RankStep]:
    """The synthetic job as a blocking communication library would show it: every rank's call
    returns when the last rank arrived (plus the transfer), so host time is the wait."""
    items = [from_probe(d) for d in generate(j)]
    by: Dict[Optional[int], List[RankStep]] = {}
    for rs in items:
        by.setdefault(rs.step, []).append(rs)
    for group in by.values():
        for key in group[0].comms:
            rows = [rs.comms[key] for rs in group if key in rs.comms]
            for i in range(len(rows[0].arrive_ns)):
                done = max(c.arrive_ns[i] for c in rows) + 2_000_000
                for c in rows:
                    c.host_ns[i] = done - c.arrive_ns[i]
    return items


def test_blocking_collectives_are_told_from_the_data() -> None:
    from argus.aggregator.commmode import WAIT_COLL, CommModes
    from argus.aggregator.state import Groups

    for blocking in (False, True):
        items = (
            _blocking(Job(steps=6, faults=Faults(host_stall=(3, 2, 40.0, 4))))
            if blocking
            else [from_probe(d) for d in generate(Job(steps=6, faults=Faults(host_stall=(3, 2, 40.0, 4))))]
        )
        g, m = Groups(), CommModes()
        frames: Dict[Optional[int], Dict[int, RankStep]] = {}
        for rs in items:
            g.observe(rs)
            frames.setdefault(rs.step, {})[rs.rank] = rs
        for ranks in frames.values():
            m.observe(ranks, g)
            m.add_wait_phases(ranks, g)
        (comm,) = m.modes()
        assert m.modes()[comm] == ("blocking" if blocking else "async")
        last = frames[5]
        if blocking:  # the rank the others waited for waited least
            waits = {r: rs.phases[WAIT_COLL] for r, rs in last.items()}
            assert min(waits, key=waits.__getitem__) == 3, waits
        else:
            assert all(WAIT_COLL not in rs.phases for rs in last.values())


def test_hang_names_the_communicator_rank_nobody_is_blocked_as() -> None:
    from argus.aggregator.hang import missing_members

    blocked = {0: [4, 0], 2: [4, 1], 6: [4, 3]}  # a DP group over TP pairs: stride 2
    assert missing_members(blocked, {4, 5}) == {
        "nranks": 4,
        "blocked_as": [0, 1, 3],
        "missing_as": [2],
        "missing": [4],
    }
    assert missing_members(blocked, {5}) is None  # rank 4 is busy elsewhere: no guess
    assert missing_members({0: [4, 0], 2: [8, 1]}, {4}) is None  # two communicators
