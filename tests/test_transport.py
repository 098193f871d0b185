"""Publisher and Reader against a real redis-server: delivery, consumer groups, crash recovery,
hostile entries, credentials, and a Redis that is down, slow or restarted."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus import reader, redisconf, wire
from argus.errors import RedisUnavailable
from argus.rediskeys import K_JOBS, k_agent, k_agents, k_hb, k_names, k_steps
from argus.replay import synthetic_steps
from argus.schema import Heartbeat, RankStep
from argus.transport import AGENT_TTL_S, Publisher
from tests.helpers import REPO_ROOT, run_argus
from tests.redisproc import RedisProc, free_port
from tests.wirecheck import assert_equivalent

pytestmark = pytest.mark.redis
JOB = "train:llama-70b/run{7}"  # ':' and braces: keys must still work


def steps(n_ranks: int = 4, n_steps: int = 5, job: str = JOB, seed: int = 0) -> List[RankStep]:
    return list(synthetic_steps(job, n_ranks, n_steps, seed=seed))


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def publisher(url: str, **kw: Any) -> Publisher:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("backoff_s", (0.05, 0.3))
    return Publisher(redisconf.parse(url, env={}), "test-host:1", **kw).start()


def drain(rd: reader.Reader) -> List[reader.Message]:
    out: List[reader.Message] = []
    while True:
        got = rd.read(block_ms=50)
        if not got:
            return out
        out += got


def test_published_steps_arrive_once_decoded_with_names(redis_url: str, redis_client: redis.Redis) -> None:
    sent = steps()
    pub = publisher(redis_url)
    for rs in sent:
        assert pub.publish_step(rs)
    wait_for(lambda: redis_client.xlen(k_steps(JOB)) == len(sent))
    stats = pub.close()
    assert stats["published"] == stats["enqueued"] == len(sent) and stats["dropped_oldest"] == 0
    assert redis_client.hlen(k_names(JOB)) == len(sent[0].kernels)
    rd = reader.Reader(redis_client, JOB)
    got = drain(rd)
    assert len(got) == len(sent) and rd.stats.rejected_total == 0
    for m, rs in zip(got, sent):
        assert_equivalent(m.step, rs)
    rd.ack([m.id for m in got])
    assert redis_client.xpending(k_steps(JOB), reader.DEFAULT_GROUP)["pending"] == 0


def test_pending_entries_survive_a_consumer_crash(redis_client: redis.Redis, redis_url: str) -> None:
    pub = publisher(redis_url)
    for rs in steps(n_steps=3):
        pub.publish_step(rs)
    pub.close()
    a = reader.Reader(redis_client, JOB, consumer="agg-a")
    first = a.read(block_ms=100)
    assert len(first) == 12
    a.ack([m.id for m in first[:2]])  # then "crashes" with 10 unacknowledged
    # the same consumer restarted gets its own pending entries first
    a2 = reader.Reader(redis_client, JOB, consumer="agg-a")
    again = a2.read(block_ms=100)
    assert [m.id for m in again] == [m.id for m in first[2:]]
    # another consumer takes over what a dead one left idle
    b = reader.Reader(redis_client, JOB, consumer="agg-b", claim_idle_ms=0)
    claimed = b.read(block_ms=100)
    assert {m.id for m in claimed} == {m.id for m in first[2:]} and b.stats.claimed == 10
    b.ack([m.id for m in claimed])
    assert redis_client.xpending(k_steps(JOB), reader.DEFAULT_GROUP)["pending"] == 0


def test_duplicates_and_trimmed_entries_are_counted(redis_client: redis.Redis) -> None:
    rs = steps(n_ranks=1, n_steps=1)[0]
    data = wire.encode_step(rs)
    for _ in range(3):
        redis_client.xadd(k_steps(JOB), {b"d": data})
    redis_client.hset(k_names(JOB), mapping={str(k): v for k, v in wire.step_names(rs).items()})
    rd = reader.Reader(redis_client, JOB)
    got = drain(rd)
    assert len(got) == 1 and rd.stats.duplicates == 2
    assert redis_client.xpending(k_steps(JOB), reader.DEFAULT_GROUP)["pending"] == 1  # the caller acks it


def test_names_missing_from_redis_are_counted_not_fatal(redis_client: redis.Redis) -> None:
    rs = steps(n_ranks=1, n_steps=1)[0]
    redis_client.xadd(k_steps(JOB), {b"d": wire.encode_step(rs)})
    redis_client.hset(k_names(JOB), "12345", "not the right name for 12345")  # forged: ignored
    rd = reader.Reader(redis_client, JOB)
    (m,) = drain(rd)
    assert rd.stats.unknown_names == len(rs.kernels) and all(k.startswith("#") for k in m.step.kernels)


def test_a_name_collision_between_agents_switches_that_name_to_inline(
    redis_client: redis.Redis, redis_url: str
) -> None:
    a, b = "k97872", "k15860000"  # same CRC-32
    t0 = time.time_ns()
    pa, pb = publisher(redis_url), publisher(redis_url)
    pa.publish_step(RankStep(JOB, 0, "h", 1, 1, t0, 10, kernels={a: 1}))
    wait_for(lambda: pa.stats()["published"] == 1)
    pb.publish_step(RankStep(JOB, 1, "h", 2, 1, t0, 10, kernels={b: 2}))
    wait_for(lambda: pb.stats()["name_collisions"] == 1)
    pb.publish_step(RankStep(JOB, 1, "h", 2, 2, t0 + 10, 10, kernels={b: 3}))
    pa.close(), pb.close()
    got = {(m.rank, m.step): m.kernels for _, m in reader.iter_steps(redis_client, JOB)}
    assert got[(0, 1)] == {a: 1} and got[(1, 2)] == {b: 3}  # the step before detection is mislabelled


HOSTILE: List[Dict[bytes, Any]] = [
    {b"d": b"\xc1"},
    {b"d": b"garbage" * 100},
    {b"x": b"no d field"},
    {b"d": msgpack.packb({"v": 99})},
    {b"d": msgpack.packb({"v": 1, "hb": 1})},
    {b"d": b"\x00" * (wire.MAX_ENTRY_BYTES + 1)},
    {b"d": msgpack.packb({"v": 1, "k": list(range(100_001))})},
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    extra=st.lists(
        st.binary(max_size=300).map(lambda b: {b"d": b})
        | st.dictionaries(st.binary(min_size=1, max_size=3), st.binary(max_size=20), min_size=1, max_size=3),
        max_size=5,
    )
)
def test_hostile_entries_are_rejected_counted_and_acked(redis_client: redis.Redis, extra: List[Dict]) -> None:
    redis_client.flushdb()
    good = steps(n_ranks=2, n_steps=1)
    for rs in good:
        redis_client.xadd(k_steps(JOB), {b"d": wire.encode_step(rs)})
    bad = HOSTILE + extra
    for fields in bad:
        redis_client.xadd(k_steps(JOB), fields)
    rd = reader.Reader(redis_client, JOB)
    got = drain(rd)
    assert len(got) == 2 and rd.stats.rejected_total == len(bad), rd.stats
    assert redis_client.xpending(k_steps(JOB), reader.DEFAULT_GROUP)["pending"] == 2  # rejects are acked


def with_extra(data: bytes, **extra: Any) -> bytes:
    d = msgpack.unpackb(data, strict_map_key=False)
    d.update(extra)
    return msgpack.packb(d, use_bin_type=True)


def test_a_newer_agents_fields_are_read_and_skipped_entries_are_said(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Agents are upgraded before aggregators: an unknown field is skipped (and named), not a
    reason to reject every summary; malformed entries are said, and a stream with nothing
    readable is an error (exit 9), in every reader a person runs."""
    from argus.aggregator.engine import Engine
    from argus.aggregator.service import Aggregator

    redis_client.flushdb()
    good = steps(n_ranks=2, n_steps=3)
    for i, rs in enumerate(good):
        data = wire.encode_step(rs)
        redis_client.xadd(k_steps(JOB), {b"d": with_extra(data, zz=[1, 2]) if i % 2 else data})
    for fields in HOSTILE[:2]:
        redis_client.xadd(k_steps(JOB), fields)
    hb = Heartbeat(JOB, "host-a:1", "host-a", time.time_ns(), ranks={0: 10, 1: 11})
    redis_client.xadd(k_hb(JOB), {b"d": with_extra(wire.encode_heartbeat(hb), nw=1)})
    redis_client.xadd(k_hb(JOB), {b"d": b"\xc1"})

    r = run_argus("diagnose", "--redis", redis_url, "--job", JOB)
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert f"WARNING: skipped 3 malformed entries of job {JOB} (msgpack 2, heartbeat:msgpack 1)" in err, err
    assert any(x.startswith("HINT: something other than argus writes to") for x in err), err
    note = [x for x in err if x.startswith("NOTE:")]
    assert len(note) == 1 and "(heartbeat:nw, step:zz)" in note[0], err

    lines: List[str] = []
    agg = Aggregator(redis_client, Engine(), [JOB], consumer="c1", on_notice=lines.append)
    while agg.poll(block_ms=50):
        pass
    assert agg.stats.entries == len(good) and agg.stats.heartbeats == 1
    assert lines[0] == f"job {JOB}: leading it (took over 0 pending summaries)", lines
    assert lines[1].startswith("WARNING: skipped 3 malformed entries"), lines
    assert any("step:zz" in x for x in lines), lines

    svg = tmp_path / "top.svg"
    r = run_argus("top", "--redis", redis_url, "--job", JOB, "--once", "--svg", str(svg))
    assert r.returncode == 0 and "WARNING: skipped 2 malformed entries" in r.stderr, r.stderr  # no heartbeats
    assert "(step:zz)" in r.stderr
    assert svg.read_text().lstrip().startswith("<svg") and JOB in svg.read_text()  # the frame as a picture

    junk = "junk-job"
    for fields in [*HOSTILE[:2], {b"d": msgpack.packb({"v": 2})}]:
        redis_client.xadd(k_steps(junk), fields)
    for cmd in (["diagnose"], ["report", "-o", str(tmp_path / "r.png")]):
        r = run_argus(*cmd, "--redis", redis_url, "--job", junk)
        assert r.returncode == 9, (cmd, r.stdout, r.stderr)
        assert f"ERROR: none of the 3 entries of job {junk} is readable (msgpack 2, version 1)" in r.stderr
        assert "HINT:" in r.stderr and "Traceback" not in r.stderr


def test_heartbeats_registry_and_goodbye(redis_client: redis.Redis, redis_url: str) -> None:
    pub = publisher(redis_url)
    hb = Heartbeat(JOB, "test-host:1", "test-host", time.time_ns(), ranks={0: 11, 1: 12}, last_step={0: 4})
    pub.publish_heartbeat(hb)
    wait_for(lambda: redis_client.exists(k_agent(JOB, "test-host:1")))
    assert 0 < redis_client.ttl(k_agent(JOB, "test-host:1")) <= AGENT_TTL_S
    assert redis_client.sismember(K_JOBS, JOB)
    live = reader.live_agents(redis_client, JOB)
    assert live["test-host:1"].ranks == {0: 11, 1: 12}
    assert live["test-host:1"].health["connected"] in (0, 1)  # publisher counters ride along
    assert len(reader.heartbeats(redis_client, JOB)) == 1 and redis_client.xlen(k_hb(JOB)) == 1
    assert reader.registry(redis_client, JOB)["test-host:1"]["state"] == "live"
    redis_client.hset(k_agents(JOB), "forged", b"\xc1 not msgpack")
    pub.close()
    assert not redis_client.exists(k_agent(JOB, "test-host:1"))
    reg = reader.registry(redis_client, JOB)
    assert reg["test-host:1"]["state"] == "exited" and "forged" not in reg


def test_acl_user_from_env_and_a_wrong_password_is_reported_not_printed(
    redis_client: redis.Redis, redis_url: str
) -> None:
    redis_client.execute_command("ACL", "SETUSER", "argus-agent", "on", ">pw-ok-123", "~argus:*", "+@all")
    try:
        env = {"ARGUS_REDIS_USERNAME": "argus-agent", "ARGUS_REDIS_PASSWORD": "pw-ok-123"}
        pub = Publisher(redisconf.parse(redis_url, env=env), "a:1", timeout_s=0.5).start()
        pub.publish_step(steps(1, 1)[0])
        wait_for(lambda: pub.stats()["published"] == 1)
        pub.close()
        env["ARGUS_REDIS_PASSWORD"] = "wrong-pw-456"
        events: List[str] = []
        pub = Publisher(redisconf.parse(redis_url, env=env), "a:1", timeout_s=0.5, on_event=events.append)
        pub.start().publish_step(steps(1, 1)[0])
        wait_for(lambda: bool(pub.last_error))
        stats = pub.close(timeout_s=0.2)
        assert stats["published"] == 0 and stats["dropped_exit"] == 1
        text = " ".join(events) + pub.last_error + pub.summary()
        assert "WRONGPASS" in text or "invalid" in text
        assert "wrong-pw-456" not in text
    finally:
        redis_client.execute_command("ACL", "DELUSER", "argus-agent")


def test_redis_down_slow_and_back(tmp_path: Path) -> None:
    """publish() never waits; the buffer keeps the newest `buffer_max`; the loss is exact."""
    srv = RedisProc(tmp_path / "r")  # not started: nothing listens on the port yet
    pub = publisher(srv.url, buffer_max=50)
    sent = steps(n_ranks=10, n_steps=20)  # 200 summaries
    worst = 0.0
    for rs in sent[:100]:
        t = time.perf_counter()
        pub.publish_step(rs)
        worst = max(worst, time.perf_counter() - t)
    s = pub.stats()
    assert s["buffer_len"] == 50 and s["dropped_oldest"] == 50 and s["buffer_peak"] == 50
    wait_for(lambda: bool(pub.last_error))  # the sender tried, failed, and keeps retrying
    assert not pub.stats()["connected"]
    srv.start()
    try:
        client = redis.Redis.from_url(srv.url)
        wait_for(lambda: pub.stats()["published"] == 50)
        srv.pause()  # slow: the server stops answering
        for rs in sent[100:]:
            t = time.perf_counter()
            pub.publish_step(rs)
            worst = max(worst, time.perf_counter() - t)
        time.sleep(1.0)  # the sender is stuck in a socket timeout meanwhile
        srv.resume()
        stats = pub.close(timeout_s=10.0)
        assert stats["send_errors"] >= 1 and stats["reconnects"] >= 1  # the stall was noticed
        assert worst < 0.05, f"publish_step took {worst * 1e3:.1f} ms"
        assert stats["enqueued"] == 200
        assert stats["published"] + stats["dropped_oldest"] + stats["dropped_exit"] == 200
        assert stats["buffer_peak"] <= 50
        got = list(reader.iter_steps(client, JOB))
        delivered = {(m.rank, m.step) for _, m in got}
        assert len(delivered) == 200 - stats["dropped_oldest"] - stats["dropped_exit"]
        assert {(rs.rank, rs.step) for rs in sent[50:100]} <= delivered  # the newest 50 of the outage
        assert {(rs.rank, rs.step) for rs in sent[-50:]} <= delivered
        client.close()
    finally:
        srv.stop()


def test_replay_cli_publishes_a_recording_and_synthetic_jobs(
    redis_client: redis.Redis, redis_url: str
) -> None:
    rec = REPO_ROOT / "tests" / "data" / "probe-default-dp4.jsonl"
    res = run_argus("replay", str(rec), "--redis", redis_url, "--job", "replayed:1", "--rate", "200")
    assert res.returncode == 0, res.stderr
    assert "replayed 9 summaries" in res.stderr
    from argus.replay import load_jsonl

    with open(rec) as f:
        want = list(load_jsonl(f))
    got = [m for _, m in reader.iter_steps(redis_client, "replayed:1")]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w.job = "replayed:1"
        assert_equivalent(g, w)
    res = run_argus(
        "replay", "--synthetic", "16x3", "--straggler", "3:1.4", "--job", "syn", "--redis", redis_url
    )
    assert res.returncode == 0, res.stderr
    assert redis_client.xlen(k_steps("syn")) == 48 and redis_client.sismember(K_JOBS, "syn")
    res = run_argus("replay", "--synthetic", "2x1", "--redis", "redis://127.0.0.1:1/0")
    assert res.returncode == 8 and "HINT: " in res.stderr


def _tls_server(tmp: Path) -> Tuple[subprocess.Popen, int]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make test certificates")
    sh = (
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=argus-ca && "
        "openssl req -newkey rsa:2048 -nodes -keyout s.key -out s.csr -subj /CN=127.0.0.1 && "
        "printf 'subjectAltName=IP:127.0.0.1\\n' > ext && "
        "openssl x509 -req -in s.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out s.crt -days 2 -extfile ext"
    )
    subprocess.run(["sh", "-c", sh], cwd=tmp, check=True, capture_output=True)
    port = free_port()
    cmd = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--tls-cert-file", "s.crt", "--tls-key-file", "s.key", "--tls-ca-cert-file", "ca.crt"]
    proc = subprocess.Popen([*cmd, "--tls-auth-clients", "no"], cwd=tmp, stdout=subprocess.DEVNULL)
    client = redisconf.parse(f"rediss://127.0.0.1:{port}/0?ca={tmp / 'ca.crt'}", env={}).client(0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, port
        except redis.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.skip("this redis-server has no TLS support")
            time.sleep(0.05)


def test_rediss_with_a_private_ca(tmp_path: Path) -> None:
    proc, port = _tls_server(tmp_path)
    try:
        good = f"rediss://127.0.0.1:{port}/0?ca={tmp_path / 'ca.crt'}"
        pub = publisher(good)
        sent = steps(n_ranks=2, n_steps=2)
        for rs in sent:
            pub.publish_step(rs)
        wait_for(lambda: pub.stats()["published"] == 4)
        pub.close()
        client = redisconf.parse(good, env={}).client()
        assert len(list(reader.iter_steps(client, JOB))) == 4
        client.close()
        pub = publisher(f"rediss://127.0.0.1:{port}/0")  # the system CAs do not know ours
        pub.publish_step(sent[0])
        wait_for(lambda: bool(pub.last_error))
        assert "certificate" in pub.last_error.lower() and pub.close(0.1)["published"] == 0
    finally:
        proc.kill()
        proc.wait()


def test_reader_recreates_a_vanished_group_and_reports_a_lost_server(tmp_path: Path) -> None:
    srv = RedisProc(tmp_path / "r").start()
    try:
        client = redisconf.parse(srv.url, env={}).client(0.5)
        rd = reader.Reader(client, JOB)
        client.xadd(k_steps(JOB), {b"d": wire.encode_step(steps(1, 1)[0])})
        assert len(drain(rd)) == 1
        client.flushall()  # what a restart without persistence looks like
        assert rd.read(block_ms=10) == []
        client.xadd(k_steps(JOB), {b"d": wire.encode_step(steps(1, 1, seed=5)[0])})
        assert len(drain(rd)) == 1
        srv.kill()
        with pytest.raises(RedisUnavailable):
            rd.read(block_ms=10)
        client.close()
    finally:
        srv.stop()
