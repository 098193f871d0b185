"""Least privilege in Redis (issue 14, item 8): the ACL users docs/security.md tells operators to
create, used for real. An agent's user may only write its job's keys (and read back the kernel
names it deduplicates against); it cannot read summaries or touch another job. The aggregator's
user reads and acknowledges every job and writes alerts and leases, and nothing administrative."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import pytest
import redis

from argus import reader, redisconf
from argus.aggregator.engine import Engine
from argus.aggregator.service import Aggregator
from argus.rediskeys import k_leader, k_steps
from argus.transport import Publisher
from tests.test_transport import steps, wait_for

pytestmark = pytest.mark.redis

JOB, OTHER = "secure-job", "other-job"
# exactly the lines of docs/security.md (with the job and passwords filled in)
AGENT_ACL = (
    "on >{pw} resetkeys %W~argus:{{{job}}}:* %R~argus:{{{job}}}:names %W~argus:jobs resetchannels "
    "-@all +ping +hello +xadd +hsetnx +hget +hset +set +sadd"
)
AGGREGATOR_ACL = (
    "on >{pw} resetkeys ~argus:* resetchannels &argus:* -@all +ping +hello +@read "
    "+xreadgroup +xack +xautoclaim +xgroup|create +xadd +hset +publish +set +eval +pexpire"
)


def _user(admin: redis.Redis, name: str, rules: str) -> None:
    admin.execute_command("ACL", "SETUSER", name, "reset", *rules.split())


def _env(user: str, pw: str) -> Dict[str, str]:
    return {"ARGUS_REDIS_USERNAME": user, "ARGUS_REDIS_PASSWORD": pw}


def test_agent_and_aggregator_acls_allow_their_work_and_nothing_else(
    redis_client: Any, redis_url: str
) -> None:
    admin = redis_client
    admin.delete(k_steps(JOB), k_steps(OTHER))
    _user(admin, "argus-agent-1", AGENT_ACL.format(pw="agent-pw-1", job=JOB))
    _user(admin, "argus-aggregator", AGGREGATOR_ACL.format(pw="agg-pw-1"))
    try:
        events: List[str] = []
        conf = redisconf.parse(redis_url, env=_env("argus-agent-1", "agent-pw-1"))
        pub = Publisher(conf, "host-a:1", timeout_s=0.5, on_event=events.append).start()
        mine = steps(n_ranks=2, n_steps=3, job=JOB)
        for rs in mine:
            pub.publish_step(rs)
        wait_for(lambda: pub.stats()["published"] == len(mine))
        # another job's summary: refused by Redis (NOPERM), never written, counted and said
        pub.publish_step(steps(n_ranks=1, n_steps=1, job=OTHER)[0])
        wait_for(lambda: any("refuses summaries (NoPermissionError" in e for e in events))
        stats = pub.close(timeout_s=0.5)
        assert stats["published"] == len(mine) and stats["dropped_exit"] == 1, stats
        assert admin.xlen(k_steps(JOB)) == len(mine) and not admin.exists(k_steps(OTHER))

        agent = conf.client()
        for denied in (
            lambda: agent.xrange(k_steps(JOB)),  # cannot read the summaries it wrote
            lambda: agent.xadd(k_steps(OTHER), {b"d": b"x"}),  # nor write another job's
            lambda: agent.keys("*"),
            lambda: agent.flushall(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
        agent.close()

        said: List[str] = []
        aconf = redisconf.parse(redis_url, env=_env("argus-aggregator", "agg-pw-1"))
        agg = Aggregator(aconf.client(), Engine(), [JOB], consumer="agg-1", on_notice=said.append)
        deadline = time.monotonic() + 10
        while agg.stats.entries < len(mine) and time.monotonic() < deadline:
            agg.poll(block_ms=50)
        assert agg.stats.entries == len(mine), said
        assert admin.get(k_leader(JOB)) == b"agg-1"  # its lease: SET NX and the renewal script
        agg._lease_check.clear()
        assert agg._lead(JOB)  # renewed through EVAL with its own permissions
        assert admin.xpending(k_steps(JOB), reader.DEFAULT_GROUP)["pending"] == 0
        aggc = aconf.client()
        for denied in (lambda: aggc.flushall(), lambda: aggc.config_get("*"), lambda: aggc.get("not-argus")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
        aggc.close()
    finally:
        for u in ("argus-agent-1", "argus-aggregator"):
            admin.execute_command("ACL", "DELUSER", u)


HOST_AGENT_ACL = (
    "on >{pw} resetkeys %W~argus:* %R~argus:*:names resetchannels "
    "-@all +ping +hello +xadd +hsetnx +hget +hset +set +sadd"
)
VIEWER_ACL = "on >{pw} resetkeys ~argus:* resetchannels -@all +ping +hello +@read"


def test_a_per_host_agent_writes_every_job_and_a_viewer_only_reads(redis_client: Any, redis_url: str) -> None:
    admin = redis_client
    admin.delete(k_steps(JOB), k_steps(OTHER))
    _user(admin, "argus-agent-host", HOST_AGENT_ACL.format(pw="host-pw-1"))
    _user(admin, "argus-viewer", VIEWER_ACL.format(pw="view-pw-1"))
    try:
        conf = redisconf.parse(redis_url, env=_env("argus-agent-host", "host-pw-1"))
        pub = Publisher(conf, "host-b:1", timeout_s=0.5).start()
        both = steps(n_ranks=1, n_steps=2, job=JOB) + steps(n_ranks=1, n_steps=2, job=OTHER)
        for rs in both:
            pub.publish_step(rs)
        wait_for(lambda: pub.stats()["published"] == len(both))
        pub.close()
        agent = conf.client()
        with pytest.raises(redis.exceptions.NoPermissionError):
            agent.xrange(k_steps(OTHER))
        agent.close()
        viewer = redisconf.parse(redis_url, env=_env("argus-viewer", "view-pw-1")).client()
        assert len([m for _, m in reader.iter_steps(viewer, OTHER)]) == 2
        with pytest.raises(redis.exceptions.NoPermissionError):
            viewer.xadd(k_steps(OTHER), {b"d": b"x"})
        viewer.close()
    finally:
        for u in ("argus-agent-host", "argus-viewer"):
            admin.execute_command("ACL", "DELUSER", u)
