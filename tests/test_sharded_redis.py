"""One job over several aggregators on a real redis-server (argus.aggregator.sharded): the same
alerts as one aggregator, each once; a member killed mid-run is taken over without a step lost;
`argus aggregate --shard` refuses what it cannot do."""

from __future__ import annotations

import signal
import time
from typing import Any, List, Set, Tuple

import pytest

from argus.aggregator.engine import Engine
from argus.aggregator.partials import StepPartial, decode
from argus.aggregator.partition import Plan
from argus.aggregator.service import Aggregator, current, history
from argus.aggregator.sharded import Member
from argus.rediskeys import k_reduce, k_shard_plan, k_shard_steps, k_steps
from argus.replay import Straggler, publish_all, synthetic_steps
from argus.schema import RankStep
from tests.helpers import ArgusProc, run_argus

pytestmark = pytest.mark.redis


def _alerts(client: Any, job: str) -> List[Tuple[Any, ...]]:
    return sorted((a.kind, tuple(a.ranks), tuple(a.steps), a.state) for a in current(client, job))


def _one(client: Any, items: List[RankStep], job: str) -> List[Tuple[Any, ...]]:
    for rs in items:
        rs.job = job
    publish_all(client, items)
    agg = Aggregator(client, Engine(), [job], consumer="one")
    while agg.stats.entries < len(items):
        agg.poll(block_ms=20)
    return _alerts(client, job)


def _group_drained(client: Any, key: str, group: str) -> bool:
    for g in client.xinfo_groups(key):
        if g["name"].decode() == group:
            return int(g["pending"]) == 0 and int(g.get("lag") or 0) == 0
    return False


def _partials(client: Any, job: str) -> Set[Tuple[int, int]]:
    """(shard, step) of every step partial the reduce stream holds."""
    out = set()
    for _eid, fields in client.xrange(k_reduce(job)):
        p = decode(fields[b"p"])
        if isinstance(p, StepPartial):
            out.add((p.shard, p.step))
    return out


@pytest.mark.parametrize("tp", [1, 8], ids=["dp", "tp8xdp"])
def test_two_members_say_what_one_aggregator_says_once(redis_client: Any, tp: int) -> None:
    # 256 ranks on 32 hosts; data parallel (one communicator of all ranks, cut in two) or TP=8 x DP
    # (TP groups whole, the 8 DP communicators cut): a 1.3x straggler from step 12
    items = list(synthetic_steps("x", 256, 24, seed=1, tp=tp, straggler=Straggler(85, 1.3, 12)))
    one = _one(redis_client, items, f"one-{tp}")
    job = f"sh-{tp}"
    for rs in items:
        rs.job = job
    publish_all(redis_client, items)
    members = [Member(redis_client, i, 2, jobs=[job], consumer=f"m{i}", lease_s=2.0) for i in range(2)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        n = sum(m.poll(idle_ms=5) for m in members)
        red = members[0].members[job].reducing if job in members[0].members else None
        if n == 0 and red is not None and red.reducer.judged == 23:
            break
    for m in members:
        m.close()
    plan = Plan.from_bytes(redis_client.get(k_shard_plan(job)))
    assert plan.sizes() == [128, 128] and plan.cut == tp
    assert [m.stats.by_shard for m in members] == [{0: 3072}, {1: 3072}]
    assert sum(m.stats.routed for m in members) == len(items)
    got = _alerts(redis_client, job)
    assert got == one and ("straggler", (85,)) in [a[:2] for a in got]
    # each alert written once: one firing transition per id
    fired = [a.id for _eid, a in history(redis_client, job) if a.state == "firing"]
    assert len(fired) == len(set(fired)) == len(got)
    # every summary judged and acknowledged, every partial reduced
    for s in (0, 1):
        assert _group_drained(redis_client, k_shard_steps(job, s), "argus-aggregate")
    assert _group_drained(redis_client, k_steps(job), "argus-aggregate:route")
    assert _group_drained(redis_client, k_reduce(job), "argus-aggregate:reduce")
    assert _partials(redis_client, job) == {(s, k) for s in (0, 1) for k in range(24)}


@pytest.mark.slow
def test_a_killed_member_is_taken_over_without_losing_a_step(redis_client: Any, redis_url: str) -> None:
    # 64 ranks (TP=8 x DP=8, 8 hosts) at 4 steps/s for 60 steps; member 0 (shard 0 and the reduce
    # step) is killed in step 20; rank 10, in shard 0, is a 1.4x straggler from step 36: member 1
    # must take both over, lose no step, and name it
    job, steps = "tk", 60
    ms = [
        ArgusProc("aggregate", "--redis", redis_url, "--job", job, "--shard", f"{i}/2", "--lease", "2")
        for i in range(2)
    ]
    try:
        for m in ms:
            m.wait_for("Aggregating")

        def paced() -> Any:
            for rs in synthetic_steps(
                job,
                64,
                steps,
                seed=4,
                tp=8,
                step_ms=250,
                start_ns=time.time_ns(),
                straggler=Straggler(10, 1.4, 36),
            ):
                if rs.rank == 16 and rs.step == 20:  # in the middle of shard 0's step
                    ms[0].p.send_signal(signal.SIGKILL)
                yield rs

        publish_all(redis_client, paced(), rate=64 / 0.25)
        assert ms[0].p.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            drained = all(
                _group_drained(redis_client, k_shard_steps(job, s), "argus-aggregate") for s in (0, 1)
            )
            drained = drained and _group_drained(redis_client, k_reduce(job), "argus-aggregate:reduce")
            drained = drained and _group_drained(redis_client, k_steps(job), "argus-aggregate:route")
            if drained and (1, steps - 1) in _partials(redis_client, job):
                break
            time.sleep(0.5)
        out = "".join(ms[1].lines)
        assert "judging shard 0 (took over" in out and "reducing it (took over" in out, out
        # no step lost: every step of both shards was judged and handed to a reducer, every
        # summary and every partial acknowledged (a reducer acknowledges a partial once its step
        # is reduced)
        assert _partials(redis_client, job) == {(s, k) for s in (0, 1) for k in range(steps)}
        assert drained, out
        got = _alerts(redis_client, job)
        assert ("straggler", (10,)) in [a[:2] for a in got], (got, out)
        fired = [a.id for _eid, a in history(redis_client, job) if a.state == "firing"]
        assert len(fired) == len(set(fired))
    finally:
        for m in ms:
            m.stop()


def test_shard_flag_errors() -> None:
    for args, says in (
        (["--shard", "2/2"], "--shard '2/2' is not I/N"),
        (["--shard", "0/2", "--lease", "0"], "--shard needs a lease"),
    ):
        res = run_argus("aggregate", "--redis", "redis://127.0.0.1:1/0", *args)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert lines[0].startswith("ERROR: ") and says in lines[0] and lines[1].startswith("HINT: "), (
            res.stderr
        )
    res = run_argus("aggregate", "--help")
    assert "--shard I/N" in res.stdout and "--shard 0/4" in res.stdout


def test_a_member_started_with_another_split_says_so(redis_client: Any, redis_url: str) -> None:
    items = list(synthetic_steps("ns", 16, 6, seed=1))
    publish_all(redis_client, items)
    m = Member(redis_client, 0, 2, jobs=["ns"], consumer="m0", lease_s=2.0)
    while redis_client.get(k_shard_plan("ns")) is None:
        m.poll(idle_ms=5)
    m.close()
    res = run_argus("aggregate", "--redis", redis_url, "--job", "ns", "--shard", "0/3", "-d", "10")
    assert res.returncode == 2
    assert (
        "job ns is split into 2 shards" in res.stderr
        and "HINT: start every member with the same N" in res.stderr
    )


def test_the_summaries_a_dead_member_had_not_judged_are_judged_by_its_successor(redis_client: Any) -> None:
    # member 0 read half of step 10 of its shard (16 summaries) and died (stopped, its leases left
    # to lapse): they are pending on it, not acknowledged; member 1 takes shard 0 over with them
    job = "pend"
    items = list(synthetic_steps(job, 64, 12, seed=2, tp=8))
    head = [rs for rs in items if rs.step < 10 or (rs.step == 10 and rs.rank < 16)]
    publish_all(redis_client, head)
    a, b = (Member(redis_client, i, 2, jobs=[job], consumer=f"m{i}", lease_s=1.0) for i in range(2))
    while (
        a.members[job].reducing.reducer.judged if job in a.members and a.members[job].reducing else -1
    ) < 9:
        a.poll(idle_ms=5)
        b.poll(idle_ms=5)
    a.poll(idle_ms=5)
    a._stop.set()  # as if its process died: nothing renews its leases any more
    pending = redis_client.xpending(k_shard_steps(job, 0), "argus-aggregate")
    # (bundles of summaries: one router batch of the shard's ranks an entry)
    assert pending["pending"] >= 1 and [c["name"] for c in pending["consumers"]] == [b"m0"]
    publish_all(redis_client, [rs for rs in items if rs not in head])
    deadline = time.monotonic() + 30
    while (0, 11) not in _partials(redis_client, job) and time.monotonic() < deadline:
        b.poll(idle_ms=20)
    assert b.stats.taken_over >= 16 and set(b.members[job].owners) == {0, 1}
    assert _partials(redis_client, job) == {(s, k) for s in (0, 1) for k in range(12)}
    assert _group_drained(redis_client, k_shard_steps(job, 0), "argus-aggregate")
    b.close()


def test_members_work_as_the_aggregator_user_of_docs_security(redis_client: Any, redis_url: str) -> None:
    # the ACL line operators are told to create (docs/security.md), for real: routing, plans,
    # leases, partials, placing a rank that came late, giving the leases up at exit
    import re
    from pathlib import Path

    import redis

    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    rules = re.search(r"^ACL SETUSER argus-aggregator (.*)$", doc, re.M)
    assert rules is not None
    redis_client.execute_command(
        "ACL", "SETUSER", "argus-aggregator", *rules.group(1).replace("PASSWORD", "agg-pw").split()
    )
    job = "acl"
    items = [rs for rs in synthetic_steps(job, 16, 12, seed=3) if rs.rank != 15 or rs.step >= 6]
    publish_all(redis_client, [rs for rs in items if rs.step < 6])
    client = redis.Redis.from_url(redis_url, username="argus-aggregator", password="agg-pw")
    members = [Member(client, i, 2, jobs=[job], consumer=f"m{i}", lease_s=1.0) for i in range(2)]
    stop = {"now": False}
    deadline = time.monotonic() + 30
    while redis_client.get(k_shard_plan(job)) is None:  # made without rank 15, after 3 s
        assert time.monotonic() < deadline
        for m in members:
            m.poll(idle_ms=20)
    publish_all(redis_client, [rs for rs in items if rs.step >= 6])
    while (1, 11) not in _partials(redis_client, job) or (0, 11) not in _partials(redis_client, job):
        assert time.monotonic() < deadline
        for m in members:
            m.poll(idle_ms=20)
    assert redis_client.hget("argus:{acl}:shardextra", "15") is not None  # placed after the plan
    for m in members:  # each shard waits for its ranks, rank 15 counted once, before and after
        assert sum(m.members[job].expected(s) for s in (0, 1)) == 16
    for m in members:
        m.run(duration=0.0, stop=lambda: stop["now"])  # a clean exit gives the leases up
    assert redis_client.get("argus:{acl}:reducer") is None
    assert all(redis_client.get(f"argus:{{acl}}:shard:{s}:owner") is None for s in (0, 1))
    redis_client.execute_command("ACL", "DELUSER", "argus-aggregator")


def test_a_member_busy_longer_than_its_lease_keeps_its_shard(redis_client: Any) -> None:
    # judging one step of a 50,000-rank shard holds the loop for seconds: its leases are renewed
    # beside it (found by benchmarks/aggregator_scale.py at 100,000 ranks: the shard was lost)
    job = "busy"
    publish_all(redis_client, list(synthetic_steps(job, 16, 4, seed=5)))
    m = Member(redis_client, 0, 1, jobs=[job], consumer="m0", lease_s=1.0)
    try:
        while not m.members.get(job) or not m.members[job].owners or not m.members[job].reducing:
            m.poll(idle_ms=5)
        time.sleep(2.5)  # a loop busy for 2.5 leases
        assert redis_client.get(f"argus:{{{job}}}:shard:0:owner") == b"m0"
        assert redis_client.get(f"argus:{{{job}}}:reducer") == b"m0"
        m.poll(idle_ms=5)
        assert set(m.members[job].owners) == {0} and m.members[job].reducing is not None
    finally:
        m.close()


def test_a_malformed_entry_is_routed_rejected_and_said(redis_client: Any) -> None:
    job = "junk"
    publish_all(redis_client, list(synthetic_steps(job, 16, 4, seed=6)))
    redis_client.xadd(k_steps(job), {b"d": b"\x81\xa1v\x07"})  # another schema version
    redis_client.xadd(k_steps(job), {b"x": b"y"})  # not a summary at all
    said: List[str] = []
    m = Member(redis_client, 0, 1, jobs=[job], consumer="m0", lease_s=1.0, on_notice=said.append)
    try:
        deadline = time.monotonic() + 20
        while not any(x.startswith("WARNING: skipped 2 malformed entries") for x in said):
            assert time.monotonic() < deadline, said
            m.poll(idle_ms=20)
        assert any(x.startswith("HINT: ") for x in said)
        assert m.stats.routed == 16 * 4 + 2
        assert _group_drained(redis_client, k_shard_steps(job, 0), "argus-aggregate")
    finally:
        m.close()
