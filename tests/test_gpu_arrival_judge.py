"""Which GPU arrived last, on a job that records no timers (argus/aggregator/gpuarrival.py): synthetic
data-parallel jobs (tests/aggsynth.py GpuJob) of 8 ranks over 2 hosts, steps of ~200 ms, whose
summaries carry the agent's GPU-arrival evidence one step late and no CUDA-event timers. Pure: no
root, no Redis."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from argus.aggregator.alerts import Alert
from argus.aggregator.config import Thresholds
from argus.aggregator.engine import Engine
from argus.schema import RankStep
from tests.aggsynth import GpuJob, gpu_steps, judge

FAULT = 15  # rank 3's GPU runs 1.3x slower from this step (after the 8 warm-up steps)
SLOW = (3, 1.3, FAULT)


def run(job: GpuJob, th: Optional[Thresholds] = None, items: Optional[List[RankStep]] = None) -> Engine:
    return judge(items if items is not None else gpu_steps(job), th)


def fired(eng: Engine) -> List[Tuple[str, List[int], int]]:
    """(kind, ranks, step it first fired at) of every alert, in order."""
    return [(a.kind, a.ranks, a.steps[1]) for a in eng.transitions if a.state == "firing"]


def named(eng: Engine) -> List[int]:
    """Every rank any alert named."""
    return sorted({r for a in eng.transitions for r in a.ranks})


def verdicts(eng: Engine, job: str = "gpu-synth") -> List[Tuple[int, int]]:
    """(evidence step, rank) of every step's 'surely last' verdict the judge kept."""
    return [(x.step, r) for x in eng.jobs[job].gpuarr.records for r in x.last]


def straggler(eng: Engine, rank: int = 3) -> Alert:
    """The straggler alert naming `rank` as it first fired (the alert itself is refreshed since)."""
    got = [a for a in eng.transitions if a.kind == "straggler" and a.ranks == [rank] and a.state == "firing"]
    assert len(got) == 1, fired(eng)
    return got[0]


def test_summaries_carry_no_timers_and_host_arrival_cannot_tell() -> None:
    """The premise: without the new evidence, this job's GPU straggler is not named (host arrivals
    line up, there are no timers), and the job's slowdown is an unexplained regression."""
    items = gpu_steps(GpuJob(slow=SLOW))
    assert not any(p.startswith("timer") for rs in items for p in rs.phases)
    assert all(rs.gpu_arrival is None for rs in items)
    eng = run(GpuJob(), items=items)
    assert named(eng) == []
    assert [k for k, _r, _s in fired(eng)] == ["step_regression"]
    reg = eng.alerts()[0]
    assert "no GPU-arrival evidence in the summaries" in reg.summary, reg.summary


def test_i_first_network_send_alone_names_the_slow_gpu_within_5_steps() -> None:
    eng = run(GpuJob(net=True, slow=SLOW))
    got = fired(eng)
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    assert named(eng) == [3], got  # no other rank; the regression is folded into the straggler
    a = straggler(eng)
    ev = a.evidence["gpu_arrival"]
    assert ev["source"] == "first network send"
    assert 1.0 <= ev["bound_ms"] <= 1.2  # the slack (1 ms) and the hosts' clocks (corrected)
    assert ev["steps"] >= 3 and ev["steps"] == ev["judged_steps"]
    assert ev["late_ms"] > 30  # 0.3 x (forward + a bucket of backward): 34 ms
    assert ev["evidence_steps"][0] == FAULT  # judged one step behind, on the step it is about
    assert "its GPU reached the collectives last in 3 of 3 steps" in a.summary, a.summary
    assert "(evidence: first network send, ±1.0 ms)" in a.summary or "±1.1 ms)" in a.summary, a.summary
    head = "rank 3 (host node-0) is the straggler of its AllReduce group comm 43771033 (8 ranks)"
    assert a.summary.startswith(f"{head} in steps {FAULT}–"), a.summary
    now = eng.alerts()[0]  # refreshed at every step since: every judged step's GPU came last
    n = now.evidence["gpu_arrival"]["steps"]
    assert n > 20 and f"last in {n} of {n} steps" in now.summary, now.summary


def test_ii_event_query_bounds_alone_name_it() -> None:
    eng = run(GpuJob(bounds="tight", slow=SLOW))
    got = fired(eng)
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    assert named(eng) == [3]
    a = straggler(eng)
    assert a.evidence["gpu_arrival"]["source"] == "event queries"
    assert a.evidence["gpu_arrival"]["bound_ms"] < 0.5
    assert "(evidence: event queries, ±0.2 ms)" in a.summary, a.summary


def test_ii_a_launch_bound_host_bounds_its_first_collectives_tightly_and_names_it() -> None:
    """A host that keeps pace with its GPU (a full launch queue) queries beside the first
    collectives' arrivals; the last ones are bounded only by the step's end. The tight few name the
    straggler, and the job's evidence counts as separating (each member's tightest row), not as
    "cannot be told" from the loose majority."""
    job = GpuJob(bounds="paced", hosts=1, slow=SLOW)
    eng = run(job)
    got = fired(eng)
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    assert named(eng) == [3]
    assert straggler(eng).evidence["gpu_arrival"]["source"] == "event queries"
    arr = eng.jobs[job.job].gpuarr
    assert arr.unseparated(0, job.steps)["separable"] is True  # type: ignore[index]
    assert arr.summary()["query_bound_ms"] < 0.5


def test_ii_b_gpus_late_now_one_now_another_name_nobody_by_event_queries() -> None:
    """Every GPU starts its step's work up to 40 ms late, at random (its host's time unchanged: the
    simulated GPU of a launch-bound rank is a CPU thread, starved by 8 ranks and the agent on 2
    CPUs; measured there: ±30-60 ms). The tight bounds say truly that some rank came last in most
    steps, a different one each time, and now and then the same one 3 steps of 4: the group's
    learnt noise in event queries keeps all unnamed. Without it one is named; a straggler whose
    lateness passes the noise is named all the same."""
    job = GpuJob(bounds="tight", hosts=1, gpu_jitter_ms=40.0, steps=200)
    eng = run(job)
    assert len(verdicts(eng)) < 20, verdicts(eng)  # the first steps, before the noise is known
    assert named(eng) == [], fired(eng)
    bare = run(job, Thresholds.from_pairs(["gpu_noise_min=100000"]))
    # what it is there for (verdicts: of the last `window` steps)
    assert len(verdicts(bare)) > 30 and named(bare), fired(bare)
    slow = dataclasses.replace(job, slow=(3, 1.3, 100))  # late at every step, by 35-54 ms
    got = fired(run(slow))
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= 100 + 5, got


def test_ii_c_bounds_wider_than_the_lateness_name_it_by_their_mid_points() -> None:
    """Queries every 60 ms at their own phase bound each arrival within 60 ms, wider than the
    straggler's lateness (35-54 ms): never surely last. The mid-points estimate it, and it alone
    stands past the group's learnt spread of that estimate and past every peer by as much
    (measured on the launch-bound stand-ins: bounds 11-15 ms wide, the straggler 10-15 ms late,
    surely last in 5 of 20 steps). The bound said is the worst case: both half-widths. A healthy
    job with those bounds raises nothing."""
    job = GpuJob(bounds="coarse", query_ms=60.0, hosts=1, slow=SLOW)
    eng = run(job)
    got = fired(eng)
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    assert named(eng) == [3], got
    ev = straggler(eng).evidence["gpu_arrival"]
    assert ev["source"] == "event queries (mid-points)", ev
    assert ev["bound_ms"] == 60.0, ev
    assert "(evidence: event queries (mid-points), ±60 ms)" in straggler(eng).summary
    for seed in (1, 2, 3):
        clean = run(dataclasses.replace(job, slow=None, steps=200, seed=seed))
        assert clean.transitions == [], fired(clean)


def test_ii_d_a_launch_bound_host_that_waited_more_for_its_gpu_did_not_launch_late() -> None:
    """The straggler's host spends 15 ms more of its own time a step than its peers' (measured on
    the simulator's launch-bound job on 2 CPUs: 4-50 ms): against its GPU's 35 ms lateness that
    reads as a host that launched its work late, which must hold 12 of 16 steps. But its launches
    also waited 15 ms longer than its peers' for a full launch queue (a slower GPU frees slots
    later): its host kept the GPU fed, and it is named as any straggler. A host that stalls instead
    lets its queue drain and waits less in launches: host-bound, as before."""
    late_host = GpuJob(bounds="paced", hosts=1, slow=SLOW, host_busy_ms={3: 15.0}, steps=60)
    got = [x for x in fired(run(late_host)) if x[1]]
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] >= FAULT + 12, got  # host-bound
    fed = dataclasses.replace(late_host, launch_wait_ms={"*": 30.0, 3: 45.0})
    got = [x for x in fired(run(fed))]
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    drained = dataclasses.replace(late_host, launch_wait_ms={"*": 30.0, 3: 20.0})
    got = [x for x in fired(run(drained)) if x[1]]
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] >= FAULT + 12, got


def test_ii_loose_bounds_on_two_hosts_name_nobody() -> None:
    """Bounds from the host's enqueue to the collective's end event hold every rank's arrival, the
    straggler's included: they separate nothing, and nobody is named from them."""
    eng = run(GpuJob(bounds="loose", slow=SLOW))
    assert named(eng) == [] and verdicts(eng) == []


def test_iii_in_collective_gpu_times_alone_name_it() -> None:
    eng = run(GpuJob(coll_times=True, slow=SLOW))
    got = fired(eng)
    assert got and got[0][:2] == ("straggler", [3]) and got[0][2] <= FAULT + 5, got
    assert named(eng) == [3]
    a = straggler(eng)
    assert a.evidence["gpu_arrival"]["source"] == "in-collective GPU times"
    assert "(evidence: in-collective GPU times, ±" in a.summary, a.summary
    # no clocks are compared: the tolerance is 5% of the group's median time in the collectives
    assert a.evidence["gpu_arrival"]["bound_ms"] < 2


def test_iv_one_host_nothing_separates_so_it_is_said_and_nobody_named() -> None:
    eng = run(GpuJob(hosts=1, bounds="loose", slow=SLOW))
    assert named(eng) == [], fired(eng)
    assert verdicts(eng) == []
    assert [k for k, _r, _s in fired(eng)] == ["step_regression"]
    reg = eng.alerts()[0]
    assert "no rank, phase or link explains it; which GPU arrived last cannot be told: " in reg.summary
    for said in (
        "no CUDA-event timers",
        "no in-collective GPU times (TORCH_NCCL_ENABLE_TIMING is off)",
        "no network sends (the group stays on one host)",
        "event queries bound arrivals only to ±",
    ):
        assert said in reg.summary, reg.summary
    ev = reg.evidence["gpu_arrival"]
    assert ev["separable"] is False and ev["bound_ms"] > 20


def test_v_host_clock_offsets_taken_out_create_no_false_straggler() -> None:
    """Rank 7 alone on node-1, whose clock runs 5 ms ahead: its network sends look 5 ms late until
    the clocks' estimate (from step ends) takes the offset out. With the lateness floor lowered to
    2 ms (`gpu_late_share=0.01`, so that 5 ms would be named) nobody is named; a straggler on the
    other host is still named."""
    hosts = {7: "node-1", **{r: "node-0" for r in range(7)}}
    low = Thresholds.from_pairs(["gpu_late_share=0.01"])
    eng = run(GpuJob(net=True, host_of=hosts, clock_ms={"node-1": 5.0}, steps=60), low)
    assert abs(eng.jobs["gpu-synth"].clocks.evidence()["offsets_ms"]["node-1"] - 5.0) < 0.1
    assert named(eng) == [] and verdicts(eng) == [], fired(eng)
    # two hosts of 4, node-1's clock 5 ms ahead, a real straggler on node-0: named as without offset
    eng = run(GpuJob(net=True, clock_ms={"node-1": 5.0}, slow=SLOW))
    assert named(eng) == [3] and fired(eng)[0][2] <= FAULT + 5
    offs = straggler(eng).evidence["identity"]["clocks"]["offsets_ms"]
    assert list(offs) == ["node-1"] and abs(offs["node-1"] - 5.0) < 0.1


def test_v_a_large_clock_uncertainty_prevents_naming_and_is_said() -> None:
    """node-1's agents know their clock only to ±40 ms: rank 3's 34 ms lead at its first network
    send no longer separates it from node-1's ranks. Nobody is named; the regression says why."""
    eng = run(GpuJob(net=True, clock_err_ms={"node-1": 40.0}, slow=SLOW))
    assert named(eng) == [] and verdicts(eng) == [], fired(eng)
    reg = eng.alerts()[0]
    assert reg.kind == "step_regression"
    assert "network sends bound arrivals only to ±41 ms (host clocks uncertain)" in reg.summary, reg.summary
    # the same job with the clocks known: named
    assert named(run(GpuJob(net=True, slow=SLOW))) == [3]


def test_vi_a_healthy_job_with_noisy_network_sends_raises_nothing() -> None:
    """Network sends jitter by 1 ± 1 ms, and rank 5's proxy posts 0.8 ms later than the others every
    step: no alert. Even with the lateness floors at zero the slack keeps rank 5 (and every other
    rank) unnamed, and so does the group's learnt noise; without both it would be named (it comes
    last in half of the steps)."""
    job = GpuJob(net=True, net_jitter_ms=2.0, net_bias_ms={5: 0.8}, steps=120)
    eng = run(job)
    assert eng.transitions == [] and verdicts(eng) == []
    no_floor = ["gpu_late_min_ns=0", "gpu_late_share=0"]
    assert run(job, Thresholds.from_pairs(no_floor)).transitions == []
    assert run(job, Thresholds.from_pairs([*no_floor, "gpu_net_slack_ns=0"])).transitions == []
    assert run(job, Thresholds.from_pairs([*no_floor, "gpu_noise_min=100000"])).transitions == []
    bare = run(job, Thresholds.from_pairs([*no_floor, "gpu_net_slack_ns=0", "gpu_noise_min=100000"]))
    assert 5 in named(bare)  # what they are there for


def _bursts(ranks: int, steps: int, every: int, length: int, ms: float) -> dict:
    """(rank, step) -> ms: a burst of `length` steps every `every` steps, on the next rank each time."""
    return {
        (b % ranks, s): ms
        for b, start in enumerate(range(10, steps, every))
        for s in range(start, start + length)
    }


def test_vii_cpu_contention_bursts_name_nobody_a_starved_host_is_named_late() -> None:
    """CPU contention makes a host launch its work late for a few steps, now one rank, now another,
    and its GPU reaches the collectives late as much (measured on the 2-core machine: 3-4 ms of
    64 ms steps, for 3-4 steps; here 15 ms of ~200 ms steps): the first network sends say so,
    truly, and the host's own time says why. Bursts of 4 steps name nobody (host-bound, which must
    hold 12 of 16 steps; the verdict is weighed against the host time of the step it is about, one
    summary earlier). A host starved for good is named, once it held that long."""
    job = GpuJob(net=True, net_jitter_ms=1.0, steps=200, host_late=_bursts(8, 200, 12, 4, 15.0))
    eng = run(job)
    assert verdicts(eng), "the bursts are late enough to be seen"
    assert named(eng) == [], fired(eng)
    starved = GpuJob(net=True, net_jitter_ms=1.0, steps=80, host_late={(2, s): 15.0 for s in range(30, 80)})
    got = fired(run(starved))
    assert got and got[0][:2] == ("straggler", [2]) and 30 + 12 <= got[0][2] <= 30 + 20, got


def test_timers_keep_their_judgement_and_nothing_is_counted_twice() -> None:
    """With CUDA-event timers the timer judgement stands (its words), the network sends add no flag
    of their own, and the steps its GPU came last are counted once."""
    eng = run(GpuJob(net=True, timers=True, slow=SLOW))
    assert named(eng) == [3]
    a = straggler(eng)
    assert "gpu_arrival" not in a.evidence
    assert "its GPU reached the collectives last in 3 of 3 steps (its grad_sync (timer3)" in a.summary, (
        a.summary
    )
    assert "evidence: first network send" not in a.summary
    assert a.evidence["gpu_reached_last_steps"] == a.evidence["steps_flagged"]


def test_contradicting_evidence_names_nobody() -> None:
    """Network sends say rank 3 came last, the in-collective GPU times (tampered with) say rank 5:
    a step where two ranks are 'surely last' says nothing."""
    items = gpu_steps(GpuJob(net=True, coll_times=True, slow=SLOW))
    out = []
    for rs in items:
        ga = rs.gpu_arrival
        if ga is not None and rs.rank == 5:
            ga = dataclasses.replace(ga, coll_gpu_ns={c: [1_000] * len(v) for c, v in ga.coll_gpu_ns.items()})
            rs = dataclasses.replace(rs, gpu_arrival=ga)
        out.append(rs)
    eng = run(GpuJob(), items=out)
    assert named(eng) == [], fired(eng)
    # from the step after the onset (the in-collective times are judged over the last
    # gpu_coll_steps steps: the onset step's median still holds times from before it)
    recs = [x for x in eng.jobs["gpu-synth"].gpuarr.records if x.step > FAULT]
    assert recs and all(x.conflicts == 1 and not x.last for x in recs)


def test_a_host_cut_off_leaves_its_group_unjudged_until_it_returns() -> None:
    """node-1's agents cannot reach Redis in steps 20-39 (their summaries never come): the first
    network sends of node-0's 4 ranks are not compared among themselves, since a rank that sent no
    summary may be the last (measured on the 2-core machine: 4 ranks of one host under CPU
    contention drew false 'stragglers' from 3-6 ms bursts). Rank 1's GPU, slow from step 20, is
    named once node-1 reports again."""
    items = [
        rs
        for rs in gpu_steps(GpuJob(net=True, steps=60, slow=(1, 1.3, 20)))
        if rs.rank < 4 or not 20 <= rs.step < 40
    ]
    eng = run(GpuJob(), items=items)
    recs = {x.step: x for x in eng.jobs["gpu-synth"].gpuarr.records}
    assert all(not recs[s].last and recs[s].net_ranks == 0 for s in range(20, 39)), [
        (s, x.last, x.net_ranks) for s, x in recs.items()
    ]
    got = fired(eng)
    assert [(k, r) for k, r, _s in got if r] == [("straggler", [1])], got
    assert 40 <= next(s for _k, r, s in got if r) <= 45, got


def test_ranks_attached_late_are_judged_on_the_job_steps() -> None:
    """node-1's agents attached at job step 6 and number their steps from 0: their evidence (for
    their own previous step) is put on the job's step by the same offset as their summaries, so
    every step from 6 on compares all 8 ranks, and the straggler is named as before."""
    eng = run(GpuJob(net=True, attach={r: 6 for r in range(4, 8)}, slow=(3, 1.3, 20)))
    recs = {x.step: x for x in eng.jobs["gpu-synth"].gpuarr.records}
    assert all(recs[s].ranks == 8 and recs[s].net_ranks == 8 for s in range(6, 38)), [
        (s, x.ranks) for s, x in recs.items()
    ]
    assert all(sorted(x.last) == ([3] if x.step >= 20 else []) for x in recs.values())
    assert named(eng) == [3] and fired(eng)[0][2] <= 25
