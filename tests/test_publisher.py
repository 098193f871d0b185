"""The Publisher with no Redis at all (nothing listens on the port): publish() stays cheap, the sender
thread stays idle between reconnect attempts, and every summary is accounted for."""

from __future__ import annotations

import time
from typing import List

from argus import redisconf
from argus.replay import synthetic_steps
from argus.transport import Publisher
from tests.redisproc import free_port


def test_publishing_while_redis_is_down_costs_almost_nothing() -> None:
    conf = redisconf.parse(f"redis://127.0.0.1:{free_port()}/0", env={})
    pub = Publisher(conf, "t:1", buffer_max=30, timeout_s=0.2, backoff_s=(0.05, 0.4)).start()
    steps = list(synthetic_steps("j", 8, 8))
    cpu0, t0 = time.process_time(), time.monotonic()
    worst = 0.0
    for rs in steps:  # 64 summaries over ~1.6 s, like an agent's drains
        t = time.perf_counter()
        pub.publish_step(rs)
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.025)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - t0
    # a sender spinning on its wake-up event burns a core and starves the caller of the GIL
    assert cpu < 0.35 * wall, f"{cpu:.2f} s CPU in {wall:.2f} s"
    assert worst < 0.02, f"publish_step took {worst * 1e3:.1f} ms"
    s = pub.stats()
    assert (s["enqueued"], s["buffer_len"], s["dropped_oldest"], s["published"]) == (64, 30, 34, 0)
    assert s["buffer_peak"] == 30 and not s["connected"]
    t = time.monotonic()
    s = pub.close(timeout_s=0.3)
    assert time.monotonic() - t < 2.0
    assert s["dropped_exit"] == 30 and s["dropped_oldest"] + s["dropped_exit"] == 64
    assert "DISCONNECTED" in pub.summary() and "dropped 64" in pub.summary()


def test_byte_bound_and_encode_errors() -> None:
    conf = redisconf.parse(f"redis://127.0.0.1:{free_port()}/0", env={})
    pub = Publisher(conf, "t:1", buffer_max=1000, buffer_bytes_max=2000)  # not started: nothing sends
    steps = list(synthetic_steps("j", 8, 1))
    for rs in steps:
        pub.publish_step(rs)
    s = pub.stats()
    assert s["buffer_len"] * 480 <= 2000 and s["dropped_oldest"] == 8 - s["buffer_len"]
    bad = steps[0]
    bad.comms[next(iter(bad.comms))].comm = "not hex"
    assert not pub.publish_step(bad) and pub.stats()["encode_errors"] == 1


def test_a_summary_readers_would_reject_is_not_published_and_is_reported_once() -> None:
    events: List[str] = []
    conf = redisconf.parse(f"redis://127.0.0.1:{free_port()}/0", env={})
    pub = Publisher(conf, "t:1", on_event=events.append)
    for rs in synthetic_steps("j", 3, 1):
        rs.host = "x" * 1000  # e.g. a JSON section that overwrote the host name
        assert not pub.publish_step(rs)
    assert pub.stats()["encode_errors"] == 3 and pub.stats()["enqueued"] == 0
    assert len(events) == 1 and "host: 1000 characters" in events[0]
    assert "encode errors 3" in pub.summary()


class _FakeRedis:
    """Just enough of a redis client for the Publisher, scripted per connection: connection 1
    applies half of its pipeline's stream writes and then breaks; connection 2 waits for the test,
    then answers its first pipeline with LOADING (a restarted server reading its AOF), then works."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.n = server.connect()

    def ping(self) -> bool:
        return True

    def pipeline(self, transaction: bool = False) -> _FakePipe:
        return _FakePipe(self)

    def close(self) -> None:
        pass


class _FakePipe:
    def __init__(self, client: _FakeRedis) -> None:
        self.client, self.cmds = client, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return lambda *a, **k: self.cmds.append((name, a))

    def execute(self, raise_on_error: bool = True) -> list:
        import redis

        srv, n = self.client.server, self.client.n
        if n == 2 and srv.loading:
            srv.loading -= 1
            return [redis.ResponseError("LOADING Redis is loading the dataset in memory") for _ in self.cmds]
        out: list = []
        xadds = [c for c in self.cmds if c[0] == "xadd" and c[1][0].endswith(":steps")]
        for name, args in self.cmds:
            if name == "xadd" and args[0].endswith(":steps"):
                if n == 1 and xadds.index((name, args)) >= len(xadds) // 2:
                    raise redis.ConnectionError("Connection reset by peer")
                srv.steps.append(args[1][b"d"])
            out.append(1)
        return out


class _Server:
    def __init__(self) -> None:
        import threading

        self.steps: List[bytes] = []
        self.conns = 0
        self.loading = 1  # pipelines answered LOADING on connection 2
        self.second = threading.Event()  # the test lets connection 2 in

    def connect(self) -> int:
        self.conns += 1
        if self.conns == 2:
            assert self.second.wait(10)
        return self.conns


def test_a_batch_applied_in_part_then_refused_is_never_counted_dropped() -> None:
    """A pipeline that broke midway may have been applied in part; when the restarted server then
    refuses it (LOADING), its outcome is still unknown, so it must stay in the retry slot: were it
    put back in the droppable buffer, entries Redis holds could be counted as lost."""
    conf = redisconf.parse("redis://127.0.0.1:1/0", env={})
    srv = _Server()
    pub = Publisher(
        conf, "t:1", buffer_max=4, batch=4, backoff_s=(0.01, 0.02), client_factory=lambda: _FakeRedis(srv)
    )
    steps = list(synthetic_steps("j", 4, 4))  # 16 summaries
    for rs in steps[:4]:
        pub.publish_step(rs)
    pub.start()
    deadline = time.monotonic() + 10
    while pub.stats()["send_errors"] < 1:  # connection 1 applied 2 of 4, then broke
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for rs in steps[4:]:  # 12 more into a buffer of 4: 8 never-sent summaries are dropped
        pub.publish_step(rs)
    srv.second.set()
    s = pub.close(timeout_s=5.0)
    held = len(set(srv.steps))
    assert s["enqueued"] == 16 and s["dropped_exit"] == 0, s
    assert held == 16 - s["dropped_oldest"], (held, s)  # what is counted lost is exactly what is missing
    assert s["published"] == len(srv.steps) - 2  # the 2 applied twice (at least once) are not counted twice
