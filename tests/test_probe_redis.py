"""`argus probe --redis` on the simulated job: exactly-once delivery that matches --json, and an agent
that shrugs off a Redis killed mid-run (the job does not notice; the loss is counted exactly)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import redis

from argus import reader
from argus.rediskeys import k_steps
from argus.schema import from_probe
from argus.sim.launcher import SimConfig, SimJob
from tests.probing import ProbeProc, probed_run
from tests.redisproc import RedisProc
from tests.wirecheck import assert_equivalent

pytestmark = [pytest.mark.bpf, pytest.mark.redis]
SUMMARY = re.compile(
    r"published (\d+), dropped (\d+) \(oldest (\d+), at exit (\d+)\), send errors (\d+), "
    r"reconnects (\d+), buffer (\d+)/(\d+) \(peak (\d+)\)"
)
Key = Tuple[int, Optional[int], int]  # rank, step, start_ns (tail records have step None)


def key_of_json(d: dict) -> Key:
    return d["rank"], d["step"], d["start_ns"] + d["wall_offset_ns"]


def counters(stderr: str) -> Dict[str, int]:
    m = SUMMARY.findall(stderr)
    assert m, stderr
    names = "published dropped oldest at_exit send_errors reconnects buffer_len buffer_max peak".split()
    return dict(zip(names, map(int, m[-1])))


def test_every_rank_step_arrives_exactly_once_and_matches_json(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    _job, probe = probed_run(
        SimConfig(ranks=4, steps=25, preset="small", run_dir=str(tmp_path)),
        "--redis",
        redis_url,
    )
    printed = probe.steps()
    job_id = printed[0]["job"]
    assert {d["rank"] for d in printed if d["step"] is not None} == {0, 1, 2, 3}
    n = redis_client.xlen(k_steps(job_id))
    assert n == len(printed), (n, len(printed), probe.stderr[-2000:])  # no entry twice, none missing
    rd = reader.Reader(redis_client, job_id)
    got: Dict[Key, reader.Message] = {}
    while True:
        batch = rd.read(block_ms=100)
        if not batch:
            break
        for m in batch:
            got[(m.step.rank, m.step.step, m.step.start_ns)] = m
        rd.ack([m.id for m in batch])
    assert rd.stats.rejected_total == 0 and rd.stats.duplicates == 0 and rd.stats.unknown_names == 0
    assert set(got) == {key_of_json(d) for d in printed}
    for d in printed:
        assert_equivalent(got[key_of_json(d)].step, from_probe(d))
    c = counters(probe.stderr)
    assert (c["published"], c["dropped"], c["send_errors"]) == (len(printed), 0, 0)
    # each rank's last heartbeat holds where it got to: its last collective on the DP communicator
    final: Dict[int, Dict[str, int]] = {}
    for _, hb in reader.heartbeats(redis_client, job_id):
        for r in hb.ranks:
            final[r] = hb.last_seq.get(r, {})
    want: Dict[int, Dict[str, int]] = {}
    for d in printed:
        for key, cm in ((d.get("nccl") or {}).get("comms") or {}).items():
            m = want.setdefault(d["rank"], {})
            m[key] = max(m.get(key, -1), cm["last_seq"])
    assert set(final) == {0, 1, 2, 3} and final == want, (final, want)
    assert all(len(m) == 1 for m in final.values())  # the DP communicator
    assert next(iter(reader.registry(redis_client, job_id).values()))["state"] == "exited"


def job_step_times(job: SimJob, lo_ns: int, hi_ns: int) -> List[float]:
    """Per step index, the job's step time (max over ranks) for steps entirely inside [lo, hi]."""
    per: Dict[int, float] = {}
    for rs in job.ranks.values():
        for r in rs.records:
            if lo_ns <= r["start_ns"] and r["end_ns"] <= hi_ns:
                per[r["step"]] = max(per.get(r["step"], 0.0), (r["end_ns"] - r["start_ns"]) / 1e9)
    return list(per.values())


def probe_into_redis(job: SimJob, url: str, read_url: str, buffer: int = 120) -> ProbeProc:
    """A gated job's probe publishing to `url` (`--redis-buffer buffer`), released, returned once
    60 of its summaries are in Redis (read at `read_url`)."""
    job.wait_loaded()  # attach before the first CUDA call, then let the job run
    probe = ProbeProc(job.pids.values(), "--redis", url, "--redis-buffer", str(buffer))
    probe.wait_for("redis: connected", timeout=120)
    job.release()
    client = redis.Redis.from_url(read_url)
    deadline = time.monotonic() + 30
    while client.xlen(k_steps(f"sim-{job.run_id}")) < 60:
        assert time.monotonic() < deadline, probe.stderr
        time.sleep(0.1)
    client.close()
    return probe


def test_redis_killed_mid_run_and_restarted(tmp_path: Path) -> None:
    srv = RedisProc(tmp_path / "redis", durable=True).start()  # what Redis acknowledged survives the kill
    cfg = SimConfig(ranks=4, steps=300, preset="small", run_dir=str(tmp_path / "job"), gate=True)
    job = SimJob(cfg).start()
    probe: Optional[ProbeProc] = None
    job_id = f"sim-{job.run_id}"
    try:
        # 120: the ~7 s outage (~430 summaries) overflows it; one drain's burst (~60) does not
        probe = probe_into_redis(job, srv.url, srv.url)
        t_up = time.monotonic_ns()
        srv.kill()
        t_kill = time.monotonic_ns()
        probe.wait_for("lost connection", timeout=10)
        time.sleep(4.0)
        t_restart = time.monotonic_ns()
        srv.start()
        deadline = time.monotonic() + 20
        while probe.stderr.count("redis: connected") < 2:
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(0.05)
        t_back = time.monotonic_ns()
        job.wait()
        assert probe.wait(timeout=60) == 0, probe.stderr
        c = counters(probe.stderr)
        client = redis.Redis.from_url(srv.url)
        stats = reader.ReaderStats()
        got = reader.iter_steps(client, job_id, stats)
        received = {(m.rank, m.step, m.start_ns) for _, m in got if m.step is not None}
        client.close()
    finally:
        job.stop()
        if probe is not None and probe.proc.poll() is None:
            probe.proc.kill()
        srv.stop()
    # tail records (step None) are flushed when the job is stopped, after Redis was read
    printed = {key_of_json(d): d for d in probe.steps() if d["step"] is not None}
    missing = set(printed) - received
    # the agent kept running and printing through the outage
    during = [d for d in printed.values() if t_kill <= d["start_ns"] and d["end_ns"] <= t_restart]
    assert len(during) >= 0.5 * 4 * (t_restart - t_kill) / 1e9 / 0.075, len(during)  # ~65 ms steps
    # the buffer stayed within its bound; the loss is exactly what the counters say
    assert c["peak"] <= c["buffer_max"] == 120
    assert c["reconnects"] >= 1 and c["send_errors"] >= 1 and c["at_exit"] == 0
    assert received <= set(printed)
    assert len(missing) == c["oldest"] + c["at_exit"] > 0, (len(missing), c, probe.stderr[-3000:])
    assert stats.rejected_total == 0
    # what was lost is from the outage; everything produced after the reconnection arrived
    ends = sorted(printed[k]["end_ns"] for k in missing)
    assert t_up - 3 * 10**9 <= ends[0] and ends[-1] <= t_back, (
        (ends[0] - t_up) / 1e9,
        (ends[-1] - t_back) / 1e9,
        (t_kill - t_up) / 1e9,
    )
    after = [k for k, d in printed.items() if d["start_ns"] > t_back]
    assert after and all(k in received for k in after)
    # the job's step time did not change while Redis was down
    before = job_step_times(job, t_up - 4 * 10**9, t_kill)
    outage = job_step_times(job, t_kill, t_restart)
    b, o = statistics.median(before), statistics.median(outage)
    spread = statistics.median(abs(x - b) for x in before)  # MAD of the baseline: the noise
    print(
        f"\nredis-kill: counters {c}; printed {len(printed)}, received {len(received)}, missing "
        f"{len(missing)}, reader duplicates {stats.duplicates}; job step median before {b * 1e3:.2f} ms "
        f"({len(before)} steps), during outage {o * 1e3:.2f} ms ({len(outage)} steps)"
    )
    assert abs(o - b) < max(0.05 * b, 4 * spread), (b, o, spread)
