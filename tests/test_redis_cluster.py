"""Argus over a Redis Cluster: three masters on loopback made with `redis-cli --cluster create`, the
client given two of them as seeds (`redis+cluster://...`). The agent publishes the simulated job
into it; jobs whose hash tags fall on different masters are judged by one `argus aggregate`; the
reading commands (alerts, diagnose, top, doctor) and two aggregators' leader lease work on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from argus import reader, redisconf
from argus.aggregator.config import PhaseInfo
from argus.aggregator.engine import Engine
from argus.aggregator.service import Aggregator, current
from argus.errors import UsageError
from argus.rediskeys import k_steps
from argus.replay import publish_all
from argus.sim.launcher import SimConfig
from tests.aggsynth import Faults, Job, steps
from tests.helpers import run_argus
from tests.redisproc import RedisClusterProcs

PHASES = "forward,backward,optimizer,grad_sync"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    c = RedisClusterProcs(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster: RedisClusterProcs) -> Iterator[Any]:
    c = redisconf.parse(cluster.url, {}).client()
    try:
        yield c
    finally:
        c.close()


def jobs_on_masters(cluster: RedisClusterProcs, n: int, prefix: str) -> List[str]:
    """`n` job names whose keys live on `n` different masters."""
    out: Dict[int, str] = {}
    for i in range(200):
        name = f"{prefix}{i}"
        out.setdefault(cluster.master_of(k_steps(name)), name)
        if len(out) == n:
            return sorted(out.values())
    raise AssertionError("no job names spread over the masters")


def test_cluster_urls_parse_and_refuse_what_a_cluster_cannot_do() -> None:
    c = redisconf.parse("redis+cluster://agent@10.0.0.5:7000,10.0.0.6:7001", {"ARGUS_REDIS_PASSWORD": "pw"})
    assert c.cluster and c.seeds == (("10.0.0.5", 7000), ("10.0.0.6", 7001)) and c.username == "agent"
    assert c.password == "pw" and "pw" not in c.display and c.display.startswith("redis+cluster://agent@")
    t = redisconf.parse("rediss+cluster://h:7000?verify=no", {})
    assert t.cluster and t.tls == {"verify": "no"} and t.client_kwargs()["ssl"] is True
    for bad, says in [
        ("redis+cluster://h:7000/2", "only database 0"),
        ("redis+cluster://u:pw@h:7000", "contains a password"),
        ("redis+cluster://", "at least one seed"),
        ("redis+cluster://h:7000,h:port", "is not HOST:PORT"),
    ]:
        with pytest.raises(UsageError, match=says):
            redisconf.parse(bad, {})


@pytest.mark.redis
def test_an_unreachable_cluster_is_a_connection_error_at_the_first_command() -> None:
    import redis

    from tests.redisproc import free_port

    c = redisconf.parse(f"redis+cluster://127.0.0.1:{free_port()}", {}).client(timeout_s=0.5)
    c.close()  # never connected: nothing to close, no error
    with pytest.raises(redis.ConnectionError, match="no seed node of the cluster answered"):
        c.ping()
    res = run_argus("alerts", "--redis", f"redis+cluster://127.0.0.1:{free_port()}", "--job", "x")
    assert res.returncode == 8 and res.stderr.startswith("ERROR: ") and "Traceback" not in res.stderr


@pytest.mark.redis
def test_jobs_on_different_masters_are_judged_and_read_back(cluster: RedisClusterProcs, client: Any) -> None:
    a, b = jobs_on_masters(cluster, 2, "llm-")
    publish_all(client, steps(Job(job=a, faults=Faults(straggler=(3, 1.5, 10)))))
    publish_all(client, steps(Job(job=b, faults=Faults(host_stall=(5, 12, 400.0, 1)))))
    assert cluster.master_of(k_steps(a)) != cluster.master_of(k_steps(b))
    res = run_argus("aggregate", "--redis", cluster.url, "--phases", PHASES, "-d", "6", timeout=90)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(x.startswith("FIRING") and f"straggler          job {a} ranks [3]" in x for x in lines), lines
    assert any(x.startswith("FIRING") and f"host_stall         job {b} ranks [5]" in x for x in lines), lines
    (got,) = current(client, a)
    assert (got.kind, got.ranks) == ("straggler", [3])
    res = run_argus("alerts", "--redis", cluster.url, "--job", b, "--json")
    assert res.returncode == 0 and json.loads(res.stdout.splitlines()[0])["ranks"] == [5], res.stderr
    res = run_argus("diagnose", "--redis", cluster.url, "--job", a, "--phases", PHASES)
    assert res.returncode == 0 and "straggler — ranks 3" in res.stdout, res.stdout + res.stderr
    res = run_argus("top", "--redis", cluster.url, "--job", a, "--once")
    assert res.returncode == 0 and a in res.stdout, res.stdout + res.stderr
    res = run_argus("doctor", "--json", "--redis", cluster.url)
    row = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "redis")
    assert row["status"] == "OK", row


@pytest.mark.redis
def test_two_aggregators_share_jobs_by_lease_on_a_cluster(cluster: RedisClusterProcs, client: Any) -> None:
    """The lease (SET NX, a Lua renewal) is one key per job: each job is led by one aggregator,
    the other stands by, whichever master holds the job."""
    a, b = jobs_on_masters(cluster, 2, "lease-")
    items = {j: steps(Job(job=j, faults=Faults(straggler=(2, 1.5, 10)))) for j in (a, b)}
    for j in (a, b):
        publish_all(client, items[j])
    names = PhaseInfo.parse(PHASES)
    first = Aggregator(client, Engine(None, names), [a, b], consumer="agg-1")
    second = Aggregator(client, Engine(None, names), [a, b], consumer="agg-2")
    for _ in range(100):
        first.poll(block_ms=20)
        second.poll(block_ms=20)
        if first.stats.entries + second.stats.entries >= sum(len(v) for v in items.values()):
            break
    assert first.stats.entries == sum(len(v) for v in items.values()) and second.stats.entries == 0
    first.engine.flush()
    for j in (a, b):
        assert [(x.kind, x.ranks) for x in current(client, j)] == [("straggler", [2])]


@pytest.mark.bpf
@pytest.mark.redis
def test_the_agent_publishes_the_simulated_job_into_a_cluster(
    tmp_path: Path, cluster: RedisClusterProcs, client: Any
) -> None:
    from tests.probing import probed_run

    _job, probe = probed_run(
        SimConfig(ranks=4, steps=25, preset="small", run_dir=str(tmp_path)), "--redis", cluster.url
    )
    printed = probe.steps()
    job_id = printed[0]["job"]
    assert "redis: connected to redis+cluster://" in probe.stderr, probe.stderr[-2000:]
    assert client.xlen(k_steps(job_id)) == len(printed)  # every summary, none twice
    rd = reader.Reader(client, job_id)
    seen = 0
    while batch := rd.read(block_ms=100):
        seen += len(batch)
        rd.ack([m.id for m in batch])
    assert seen == len(printed) and rd.stats.rejected_total == 0 and rd.stats.duplicates == 0
    assert next(iter(reader.registry(client, job_id).values()))["state"] == "exited"
    assert [hb.ranks for _, hb in reader.heartbeats(client, job_id)][-1]
