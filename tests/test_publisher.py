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
