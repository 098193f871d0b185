"""The aggregator over a real redis-server: consumer groups, alert stream/channel/state, `argus alerts`,
the webhook, `argus diagnose --redis`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, ClassVar, List

import pytest

from argus.aggregator.config import PhaseInfo
from argus.aggregator.engine import Engine
from argus.aggregator.service import Aggregator, current, history
from argus.aggregator.webhook import Webhook
from argus.rediskeys import k_alert_state, k_alerts, k_steps
from argus.replay import publish_all
from tests.aggsynth import Faults, Job, steps
from tests.helpers import run_argus

pytestmark = pytest.mark.redis

NAMES = PhaseInfo.parse("forward,backward,optimizer,grad_sync")


def drain(agg: Aggregator, total: int, rounds: int = 200) -> None:
    for _ in range(rounds):
        agg.poll(block_ms=50)
        if agg.stats.entries >= total:
            return


def test_aggregate_publishes_alerts(redis_client: Any, redis_url: str) -> None:
    items = steps(Job(job="rj", faults=Faults(straggler=(3, 1.5, 10))))
    publish_all(redis_client, items)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(k_alerts("rj"))
    agg = Aggregator(redis_client, Engine(None, NAMES), ["rj"], consumer="a1")
    drain(agg, len(items))
    agg.engine.flush()
    assert agg.stats.entries == len(items)
    (a,) = current(redis_client, "rj")
    assert (a.kind, a.ranks, a.state) == ("straggler", [3], "firing")
    assert [x.kind for _id, x in history(redis_client, "rj")] == ["straggler"]
    msgs = [m for m in iter(lambda: pubsub.get_message(timeout=0.2), None) if m["type"] == "message"]
    assert json.loads(msgs[0]["data"])["id"] == a.id
    # every entry was acknowledged: nothing pending for the group
    assert redis_client.xpending("argus:{rj}:steps", "argus-aggregate")["pending"] == 0
    res = run_argus("alerts", "--redis", redis_url, "--job", "rj", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[0])["ranks"] == [3]
    res = run_argus("alerts", "--redis", redis_url, "--job", "rj", "--since", "1h")
    assert res.returncode == 0 and "FIRING" in res.stdout and "straggler" in res.stdout
    res = run_argus(
        "diagnose", "--redis", redis_url, "--job", "rj", "--phases", "forward,backward,optimizer,grad_sync"
    )
    assert res.returncode == 0 and "straggler — ranks 3" in res.stdout, res.stdout + res.stderr


def test_restart_continues_the_alert_book(redis_client: Any) -> None:
    items = steps(Job(job="rk", steps=20, faults=Faults(straggler=(2, 1.5, 8))))
    publish_all(redis_client, items)
    agg = Aggregator(redis_client, Engine(None, NAMES), ["rk"], consumer="a1")
    drain(agg, len(items))
    (a,) = current(redis_client, "rk")
    assert a.state == "firing"
    # a restarted aggregator knows the firing alert and resolves it once the rank is healthy again
    agg2 = Aggregator(redis_client, Engine(None, NAMES), ["rk"], consumer="a1")
    later = [rs for rs in steps(Job(job="rk", steps=40, seed=3)) if rs.step >= 20]
    publish_all(redis_client, later)
    drain(agg2, len(later))
    agg2.engine.flush()
    assert {x.id: x.state for x in current(redis_client, "rk")} == {a.id: "resolved"}


def test_without_a_lease_two_aggregators_split_a_job(redis_client: Any) -> None:
    items = steps(Job(job="rs", steps=30))
    publish_all(redis_client, items)
    a1 = Aggregator(redis_client, Engine(), ["rs"], consumer="c1", count=64, lease_s=None)
    a2 = Aggregator(redis_client, Engine(), ["rs"], consumer="c2", count=64, lease_s=None)
    for _ in range(100):
        n = a1.poll(block_ms=10) + a2.poll(block_ms=10)
        if n == 0 and a1.stats.entries + a2.stats.entries >= len(items):
            break
    assert a1.stats.entries + a2.stats.entries == len(items)
    assert a1.stats.entries > 0 and a2.stats.entries > 0


def test_one_aggregator_leads_a_job_and_a_standby_takes_over_its_pending_entries(redis_client: Any) -> None:
    """The leader judges the whole job; the standby reads nothing until the leader's lease lapses,
    then claims what the leader was given and never acknowledged (it died after the engine took
    them), and goes on: every entry judged once by the job's leader at that time, none lost."""
    from argus.rediskeys import k_leader

    items = steps(Job(job="ha", steps=30))
    publish_all(redis_client, items[:200])
    said: List[str] = []
    a1 = Aggregator(redis_client, Engine(), ["ha"], consumer="lead", count=64, lease_s=0.6)
    a2 = Aggregator(
        redis_client, Engine(), ["ha"], consumer="standby", count=64, lease_s=0.6, on_notice=said.append
    )
    a1.poll(block_ms=10)
    a2.poll(block_ms=10)
    assert a1.stats.entries == 64 and a2.stats.entries == 0
    assert said == ["job ha: standing by, lead leads it"]
    assert redis_client.get(k_leader("ha")) == b"lead"
    unacked = a1.readers["ha"].read(block_ms=10)  # delivered to the leader, which dies before its ack
    assert len(unacked) == 64
    publish_all(redis_client, items[200:])
    deadline = time.monotonic() + 10
    while a2.stats.entries < len(items) - 64 and time.monotonic() < deadline:
        a2.poll(block_ms=20)
    assert a2.stats.taken_over == 64, said
    assert a1.stats.entries + a2.stats.entries == len(items)  # 64 judged by a1, the rest by a2 once
    assert redis_client.xpending(k_steps("ha"), "argus-aggregate")["pending"] == 0
    assert "job ha: leading it (took over 64 pending summaries)" in said
    assert redis_client.get(k_leader("ha")) == b"standby"


class _Sink(BaseHTTPRequestHandler):
    bodies: ClassVar[List[Any]] = []
    fail_first = 0

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n)
        if _Sink.fail_first > 0:
            _Sink.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        _Sink.bodies.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_a: Any) -> None:
        pass


def test_webhook_retries_then_posts_alertmanager_json() -> None:
    from argus.aggregator.alerts import AlertBook, Finding

    srv = HTTPServer(("127.0.0.1", 0), _Sink)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        _Sink.bodies, _Sink.fail_first = [], 2
        book = AlertBook()
        book.update(
            "j", 1_800_000_000 * 10**9, [Finding("hang", [6], (12, 12), "rank 6 hung")], {6: "n"}, set()
        )
        waits: List[float] = []
        hook = Webhook(f"http://127.0.0.1:{srv.server_port}/api/v2/alerts", sleep=waits.append)
        assert hook.post(book.all())
        assert waits == [0.5, 1.0]  # two 503s, exponential backoff
        (body,) = _Sink.bodies
        assert body[0]["labels"]["alertname"] == "ArgusHang" and body[0]["labels"]["severity"] == "critical"
        dead = Webhook("http://127.0.0.1:9/none", retries=1, sleep=waits.append, timeout_s=0.5)
        assert not dead.post(book.all()) and dead.failed == 1
    finally:
        srv.shutdown()


def test_alert_keys_are_per_job() -> None:
    assert k_alerts("a") == "argus:{a}:alerts" and k_alert_state("a") == "argus:{a}:alert_state"


def test_aggregate_command(redis_client: Any, redis_url: str) -> None:
    publish_all(redis_client, steps(Job(job="rc", faults=Faults(host_stall=(5, 12, 400.0, 1)))))
    res = run_argus("aggregate", "--redis", redis_url, "--job", "rc", "-d", "4", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "FIRING   host_stall" in res.stdout and "ranks [5]" in res.stdout
    assert "Hit Ctrl-C to end." in res.stderr and "320 summaries" in res.stderr
    res = run_argus("aggregate", "--redis", redis_url, "--set", "bogus=1")
    assert res.returncode == 2 and res.stderr.startswith("ERROR: unknown threshold")


def test_diagnose_picks_the_only_job_and_lists_several(redis_client: Any, redis_url: str) -> None:
    publish_all(redis_client, steps(Job(job="only", faults=Faults(straggler=(3, 1.5, 10)))))
    res = run_argus("diagnose", "--redis", redis_url, "--phases", "forward,backward,optimizer,grad_sync")
    assert res.returncode == 0, res.stderr
    assert "job only (the only one in this Redis)" in res.stderr and "straggler — ranks 3" in res.stdout
    publish_all(redis_client, steps(Job(job="other", steps=12)))
    res = run_argus("diagnose", "--redis", redis_url)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "ERROR: several jobs in this Redis: only, other" in res.stderr and "HINT: " in res.stderr
    res = run_argus("alerts", "--redis", redis_url, "--follow")
    assert res.returncode != 0 and "this Redis has: only, other" in res.stderr, res.stderr
