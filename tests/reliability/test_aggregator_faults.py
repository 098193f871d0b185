"""The aggregator killed mid-stream (issue 14, item 4): a standby `argus aggregate` takes the job's
lease, claims the entries the dead leader was given and never acknowledged, and goes on. Every
summary is read and acknowledged (none lost), and no alert fires twice (none judged twice into
an alert). Real processes: `argus replay` of a synthetic 8-rank job with a straggler, two
aggregators, a private redis-server."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import List

import pytest
import redis

from argus.rediskeys import k_alerts, k_leader, k_steps
from tests.helpers import ArgusProc
from tests.redisproc import RedisProc

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
JOB = "ha-e2e"


def _pending(client: redis.Redis, consumer: str) -> int:
    info = client.xpending(k_steps(JOB), "argus-aggregate")
    return sum(int(c["pending"]) for c in info.get("consumers") or [] if c["name"] == consumer.encode())


def test_a_standby_aggregator_takes_over_from_a_killed_leader(tmp_path: Path) -> None:
    srv = RedisProc(tmp_path / "redis").start()
    url = srv.url
    procs: List[ArgusProc] = []
    try:
        lead = ArgusProc("aggregate", "--redis", url, "--job", JOB, "--consumer", "lead", "--lease", "2")
        procs.append(lead)
        lead.wait_for("Aggregating")
        standby = ArgusProc(
            "aggregate", "--redis", url, "--job", JOB, "--consumer", "standby", "--lease", "2"
        )
        procs.append(standby)
        standby.wait_for(f"job {JOB}: standing by, lead leads it")
        # 256 ranks as fast as replay goes: the leader reads batches of 1024 and judges each for
        # ~0.1 s, delivered (pending) and not yet acknowledged
        replay = ArgusProc(
            "replay", "--synthetic", "256x60", "--straggler", "3:1.5:10", "--job", JOB, "--redis", url
        )
        procs.append(replay)
        lead.wait_for("FIRING", timeout=60)  # the leader has judged part of the job and raised the alert
        client = redis.Redis.from_url(url)
        held = 0
        for _ in range(200):  # freeze the leader while it holds entries, then kill it
            time.sleep(0.05)
            if _pending(client, "lead") == 0:
                continue
            lead.p.send_signal(signal.SIGSTOP)
            held = _pending(client, "lead")
            if held:
                break
            lead.p.send_signal(signal.SIGCONT)
        assert held > 0, "never caught the leader holding entries"
        lead.p.kill()  # SIGKILL: no goodbye, its lease stays until it lapses
        lead.p.wait(timeout=10)
        t_kill = time.monotonic()
        standby.wait_for(f"job {JOB}: leading it (took over", timeout=15)
        took = time.monotonic() - t_kill
        assert replay.p.wait(timeout=60) == 0, "".join(replay.lines)
        deadline = time.monotonic() + 30
        while True:
            g = next(x for x in client.xinfo_groups(k_steps(JOB)) if x["name"] == b"argus-aggregate")
            if g["pending"] == 0 and g["lag"] == 0:
                break
            assert time.monotonic() < deadline, g
            time.sleep(0.2)
        assert g["entries-read"] == client.xlen(k_steps(JOB)) == 256 * 60  # every summary read and acked
        assert client.get(k_leader(JOB)) == b"standby"
        transitions = [json.loads(f[b"d"]) for _, f in client.xrange(k_alerts(JOB))]
        firing = Counter(a["id"] for a in transitions if a["state"] == "firing")
        straggler = [a for a in transitions if a["state"] == "firing" and a["kind"] == "straggler"]
        assert straggler and straggler[0]["ranks"] == [3], transitions
        assert all(n == 1 for n in firing.values()), firing  # no alert fired twice across the handover
        line = next(x for x in standby.lines if "leading it (took over" in x)
        assert f"took over {held} pending summaries" in line, (held, line)
        print(
            f"\naggregator handover: {line.strip()} {took:.1f} s after the kill; alert transitions "
            f"{[(a['state'], a['kind'], a['ranks']) for a in transitions]}"
        )
    finally:
        for p in procs:
            p.stop()
        srv.stop()
