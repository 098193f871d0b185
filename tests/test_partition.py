"""One job over several aggregators, without Redis: the partition, the partials and the reduce step
(argus.aggregator.partition, partials, reduce; the Redis side is tests/test_sharded_redis.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from argus import wire
from argus.aggregator.alerts import Alert, Finding
from argus.aggregator.engine import Engine
from argus.aggregator.gpuarrival import StepEvidence
from argus.aggregator.partials import GroupPart, HangPartial, StepPartial, decode, summarize
from argus.aggregator.partition import Plan, RankInfo, make_plan, parse_shard, rank_info
from argus.aggregator.reduce import Reducer, merge_evidence, pick_hang
from argus.aggregator.sharded import peek_rank
from argus.errors import UsageError
from argus.replay import Straggler, synthetic_steps
from argus.schema import RankStep
from tests.aggsynth import Faults, Job, steps


def _infos(items: List[RankStep]) -> List[RankInfo]:
    seen: Dict[int, RankInfo] = {}
    for rs in items:
        seen.setdefault(rs.rank, rank_info(rs))
    return list(seen.values())


def _mesh(tp: int, pp: int, dp: int, per_host: int) -> List[RankInfo]:
    """Megatron's order: rank = t + tp * (d + dp * p); TP groups on a host, pipeline links
    between stages, data-parallel groups across replicas."""
    out = []
    world = tp * pp * dp
    for r in range(world):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        comms = [(f"tp-{d}-{p}", tp), (f"dp-{t}-{p}", dp)]
        if p + 1 < pp:
            comms.append((f"pp-{t}-{d}-{p}", 2))
        if p > 0:
            comms.append((f"pp-{t}-{d}-{p - 1}", 2))
        out.append(RankInfo(r, f"h{r // per_host}", world, tuple(sorted(comms))))
    return out


def test_tp_groups_stay_whole_and_the_data_parallel_communicators_are_cut() -> None:
    items = list(synthetic_steps("p", 1024, 1, tp=8))
    plan = make_plan(_infos(items), 2)
    assert plan.sizes() == [512, 512]
    # ranks 0-511 / 512-1023: every TP group (= host) is in one shard, each DP group is cut in two
    assert plan.ranks_of(0) == set(range(512))
    tp_comms = {c.comm for rs in items for c in rs.comms.values() if c.nranks == 8}
    assert set(plan.comms) == tp_comms and plan.cut == 8
    assert all(plan.hosts[f"node-{h}"] == (0 if h < 64 else 1) for h in range(128))


def test_model_replicas_stay_whole_across_hosts() -> None:
    # TP=2 on hosts of 2 ranks, PP=2: a replica (4 ranks) spans two hosts joined by the pipeline
    # links; the DP communicators (4 replicas) are cut
    infos = _mesh(tp=2, pp=2, dp=4, per_host=2)
    plan = make_plan(infos, 2)
    assert plan.sizes() == [8, 8]
    for i in infos:
        d, p = (i.rank // 2) % 4, i.rank // 8
        peers = [x.rank for x in infos if (x.rank // 2) % 4 == d]  # the replica: same d, both stages
        assert len({plan.of[r] for r in peers}) == 1, (i.rank, p)
    assert all(c.startswith(("tp-", "pp-")) for c in plan.comms)
    assert plan.cut == 4  # dp-{t}-{p}


def test_without_shared_communicator_keys_a_job_splits_by_host_and_rank_range() -> None:
    infos = [RankInfo(r, f"h{r // 4}", 32) for r in range(32)]  # accessor identities: no keys
    plan = make_plan(infos, 4)
    assert [sorted(plan.ranks_of(s)) for s in range(4)] == [list(range(8 * s, 8 * s + 8)) for s in range(4)]


def test_a_host_is_never_split_even_above_the_cap() -> None:
    infos = [RankInfo(r, "big" if r < 12 else f"h{r}", 16) for r in range(16)]
    plan = make_plan(infos, 4)
    assert len({plan.of[r] for r in range(12)}) == 1


def test_ranks_the_plan_did_not_know_are_placed_alike_by_every_router() -> None:
    infos = _mesh(tp=2, pp=1, dp=8, per_host=2)[:12]  # ranks 12-15 not seen yet
    plan = make_plan(infos, 2, world=16)
    assert plan.place(RankInfo(13, "h1")) == plan.of[2]  # its host is known
    assert plan.place(RankInfo(13, "new", 16, (("tp-6-0", 2),))) == plan.place(RankInfo(12, "new2", 16))
    assert plan.place(RankInfo(15, "elsewhere", 16)) == 1  # by rank range
    assert plan.place(RankInfo(40, "elsewhere", 16)) == 40 % 2
    again = Plan.from_bytes(plan.to_bytes())
    assert (again.of, again.hosts, again.comms, again.shards, again.world) == (
        plan.of,
        plan.hosts,
        plan.comms,
        2,
        16,
    )
    assert again.place(RankInfo(13, "new", 16, (("tp-6-0", 2),))) == plan.place(RankInfo(13, "new", 16))


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b'{"v": 2}', b'{"v":1,"n":2,"w":4,"s":[0,5],"h":{},"c":{}}', b'{"v":1,"n":0}']
)
def test_a_damaged_plan_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        Plan.from_bytes(raw)


def test_parse_shard() -> None:
    assert parse_shard("0/2") == (0, 2) and parse_shard("3/4") == (3, 4)
    for bad in ("2/2", "-1/2", "1", "a/b", "0/0", "1/2/3"):
        with pytest.raises(UsageError) as e:
            parse_shard(bad)
        assert e.value.exit_code == 2 and "I/N" in e.value.message and e.value.hint


def test_peek_rank_reads_only_the_first_keys() -> None:
    rs = next(iter(synthetic_steps("p", 8, 1)))
    rs.rank = 5
    assert peek_rank(wire.encode_step(rs)) == 5
    for bad in (b"", b"\x81\xa1r\xa1x", b"\x93\x01\x02\x03", None, b"\xc1"):
        assert peek_rank(bad) is None


def test_partials_round_trip_and_damage_is_refused() -> None:
    ev = StepEvidence(4, ranks=3, hosts=1, timers=False, net_ranks=2, net_bound_ns=1e6, floor_ns=2e6)
    g = GroupPart("c1", [1, 2], True, {"timer0": "main"}, {"timer0": [1.0, 2.0]}, 5.0, "AllReduce", {})
    p = StepPartial("j", 1, 5, 123, [10, 20], [24, 24], True, False, [ev], [g], {1: "h1"})
    q = decode(p.to_bytes())
    assert q == p
    f = Finding("hang", [3], (5, 5), "hang: ...", {"blocked": {3: {"call": "x"}}}, "c1")
    h = HangPartial("j", 0, 99, f, {3: "h0"}, True)
    assert decode(h.to_bytes()) == h
    for bad in (b"x", b"\x80", b"\x82\xa1k\xa1s\xa1j\xa1j", h.to_bytes()[:-3], None):
        with pytest.raises(ValueError):
            decode(bad)
    assert summarize([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    big = summarize([float(x) for x in range(1000)])
    assert len(big) == 34 and big[0] == 0.0 and big[-1] == 999.0


def test_evidence_of_the_shards_adds_up() -> None:
    a = StepEvidence(4, ranks=3, hosts=1, timers=False, net_ranks=1, net_bound_ns=1e6, floor_ns=2e6)
    b = StepEvidence(4, ranks=5, hosts=2, timers=False, net_ranks=1, bound_width_ns=3e6, floor_ns=2e6)
    (m,) = merge_evidence([a, b])
    assert (m.ranks, m.hosts, m.net_ranks, m.net_bound_ns, m.bound_width_ns) == (8, 3, 2, 1e6, 3e6)


def test_the_hang_that_names_the_missing_rank_wins() -> None:
    def hp(shard: int, ranks: List[int], named: bool) -> HangPartial:
        return HangPartial(
            "j", shard, 10, Finding("hang", ranks, (3, 3), "s"), {r: "h" for r in ranks}, named
        )

    f, _ = pick_hang([hp(0, [0, 1, 2], False), hp(1, [5], True)])
    assert f is not None and f.ranks == [5]
    f, hosts = pick_hang([hp(0, [0, 1], False), hp(1, [4, 5], False)])
    assert f is not None and f.ranks == [0, 1, 4, 5] and set(hosts) == {0, 1, 4, 5}
    assert pick_hang([HangPartial("j", 0, 1, None)]) == (None, {})


def _alerts(alerts: List[Alert]) -> List[Tuple[Any, ...]]:
    return sorted((a.kind, tuple(a.ranks), tuple(a.steps), a.state, a.comm) for a in alerts)


def split_run(items: List[RankStep], n: int) -> Tuple[List[Alert], Reducer]:
    """The sharded pipeline in one process: n shard engines on the plan's ranks, one reducer."""
    job = items[0].job
    plan = make_plan(_infos(items), n)
    red = Reducer(job)
    red.shards = {s for s in range(n) if plan.ranks_of(s)}
    out: List[Alert] = []
    for s in sorted(red.shards):
        eng = Engine(shard=s)
        eng.set_scope(job, len(plan.ranks_of(s)), {c for c, x in plan.comms.items() if x == s})
        eng.run([rs for rs in items if plan.of[rs.rank] == s])
        out += eng.alerts()
        for p in eng.partials:
            red.add(decode(p.to_bytes()), 0.0)
    red.ready(0.0, flush=True)
    return out + red.book.all(), red


@pytest.mark.parametrize(
    "ranks,layout,faults",
    [
        (16, "dp", Faults(spike=(24, 400.0))),
        (16, "dp", Faults(straggler=(5, 1.4, 14))),
        (16, "dp", Faults(slow_comm=(1.6, 16))),
        (32, "pp-dp", Faults(bubble=(5, 1.5, 14))),
        (32, "pp-dp", Faults(link=(4, 5, 6.0, 14))),
        (32, "pp-dp", Faults(host_stall=(6, 20, 300.0, 2))),
        (32, "pp-dp", Faults(drift=(9, 1.06, 10))),
    ],
    ids=["spike", "straggler", "slow-collectives", "bubble", "slow-link", "host-stall", "drift"],
)
def test_two_shards_and_the_reducer_say_what_one_engine_says(ranks: int, layout: str, faults: Faults) -> None:
    # hosts of 4 ranks; the data-parallel communicators are cut in two, the pipeline links kept
    # whole: the job-wide step time (a spike nobody explains), a straggler, a slower collective of
    # the whole (cut) group, a pipeline bubble and a slow link, a host stall, a slow drift
    items = steps(Job(ranks=ranks, steps=50, layout=layout, faults=faults))
    one = Engine()
    one.run(items)
    got, red = split_run(items, 2)
    assert _alerts(got) == _alerts(one.alerts())
    assert one.alerts(), "the fault was found"
    assert red.stats.steps == 50 and red.stats.short == 0


def test_a_cut_group_is_not_blamed_for_a_straggler_in_the_other_part() -> None:
    # 1,024 ranks, one data-parallel communicator: the half without the straggler sees its
    # communication time grow; alone it would call that a slower group (kernel_degradation)
    items = list(synthetic_steps("c", 1024, 24, seed=1, straggler=Straggler(341, 1.3, 12)))
    one = Engine()
    one.run(items)
    got, _red = split_run(items, 2)
    assert _alerts(got) == _alerts(one.alerts())
    assert [(a.kind, a.ranks) for a in got] == [("straggler", [341])]


def test_a_shard_silent_past_the_patience_is_not_waited_for() -> None:
    red = Reducer("j", patience_s=5.0)
    red.shards = {0, 1}
    for s in range(3):
        red.add(StepPartial("j", 0, s, s, [100] * 4, [24] * 4, False, True), now=1.0)
    assert red.ready(now=2.0) == [] and red.judged == -1  # shard 1 may still come
    red.add(StepPartial("j", 1, 0, 0, [100] * 4, [24] * 4, False, True), now=2.5)
    red.ready(now=3.0)
    assert red.judged == 0  # shard 1 sent step 0; steps 1-2 wait for it
    red.ready(now=8.0)
    assert red.judged == 2 and red.stats.short == 2  # silent 5.5 s: judged without it
    red.add(StepPartial("j", 1, 1, 1, [100] * 4, [24] * 4, False, True), now=9.0)
    assert red.stats.late == 1


def test_a_hang_across_shards_names_the_rank_the_others_wait_for() -> None:
    # 16 ranks on 4 hosts, one agent a host; rank 6 never reached step 12's first all-reduce of
    # the data-parallel communicator (cut in two): the shard without it sees everyone blocked
    from argus.aggregator.config import Thresholds
    from argus.schema import Heartbeat, InFlight

    th = Thresholds()
    th.hang_min_s = 2.0
    job = Job(ranks=16, steps=12)
    items = steps(job)
    dp = next(iter(items[0].comms))
    last = {r: 12 * job.buckets + 2 for r in range(16)}
    last[6] = 12 * job.buckets - 1

    def beats(ts: float, hung: bool) -> List[Heartbeat]:
        s = int(ts * 1e9)
        return [
            Heartbeat(
                job="synth",
                agent=f"node-{h}:1",
                host=f"node-{h}",
                ts_ns=s,
                ranks={r: 100 + r for r in range(4 * h, 4 * h + 4)},
                inflight=[
                    InFlight(r, 100 + r, "ncclAllReduce", s - 5 * 10**9)
                    for r in range(4 * h, 4 * h + 4)
                    if hung and r != 6
                ],
                last_seq={r: {dp: last[r] if hung else 400} for r in range(4 * h, 4 * h + 4)},
            )
            for h in (1, 0, 2, 3)  # rank 6's host first: one aggregator names it from the start
        ]

    one = Engine(th)
    for rs in items:
        one.add(rs)
    fired = [a for hb in beats(100.0, True) for a in one.add(hb)]
    assert [(a.kind, a.ranks) for a in fired] == [("hang", [6])]

    plan = make_plan(_infos(items), 2)
    red = Reducer("synth", th)
    red.shards = {0, 1}
    engines = {}
    for s in (0, 1):
        eng = engines[s] = Engine(th, shard=s)
        eng.set_scope("synth", len(plan.ranks_of(s)), {c for c, x in plan.comms.items() if x == s})
        for rs in items:
            if plan.of[rs.rank] == s:
                eng.add(rs)
    out: List[Alert] = []
    for ts, hung in ((100.0, True), (102.0, False), (104.0, False)):
        for hb in beats(ts, hung):
            s = plan.hosts[hb.host]
            assert engines[s].add(hb) == []  # a shard publishes no hang itself
            out += red.hang(decode(engines[s].hangs.pop("synth").to_bytes()))
    assert (out[0].kind, out[0].ranks, out[0].state, out[0].id) == ("hang", [6], "firing", fired[0].id)
    # heartbeats of a job that runs again: every hang alert resolves, as with one aggregator
    for ts in (102.0, 104.0):
        for hb in beats(ts, False):
            one.add(hb)
    assert not one.book.firing() and not red.book.firing()
