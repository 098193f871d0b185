"""`argus probe --redis`: the agent's side of the transport (summaries, heartbeats, counters).

Everything here runs on the probe loop's thread and costs CPU only: `argus.transport.Publisher`
buffers and a background thread talks to Redis, so a down or slow Redis never stalls the loop
(and the probed processes never wait for the agent in any case).
"""

from __future__ import annotations

import os
import resource
import socket
import time
from typing import Callable, Dict, List, Optional

from argus.agent import clock
from argus.agent.session import Session
from argus.probes import libnccl
from argus.redisconf import RedisConf
from argus.schema import OPS, P2P, Heartbeat, InFlight, RankStep
from argus.transport import HB_INTERVAL_S, Publisher

COLLECTIVES = frozenset(op for op in OPS if op not in P2P)
SUSPECT_S = 5.0  # a call in flight this long: say what every rank of the job is doing


def agent_id(host: Optional[str] = None) -> str:
    """host:pid of this agent (the registry key)."""
    return f"{host or socket.gethostname()}:{os.getpid()}"


def heartbeats(s: Session, agent: str, host: str) -> List[Heartbeat]:
    """One heartbeat per job among the live targets: in-flight calls (realtime since_ns), each
    rank's last collective sequence number per communicator and last step, and agent health."""
    wall, _ = clock.wall_offset()
    now = clock.realtime_ns()
    synced, _est, maxerr = clock.sync_state()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    health = {
        "decode_errors": s.health.decode_errors,
        "probes": s.health.attached,
        "slow_probes": len(s.health.slow_probes),
        "targets": sum(t.alive for t in s.targets.values()),
        "cpu_ms": int((ru.ru_utime + ru.ru_stime) * 1000),
        "rss_kb": int(ru.ru_maxrss),
        "clock_synced": int(synced),
        "clock_maxerror_us": maxerr,
    }
    out: Dict[str, Heartbeat] = {}
    for pid, t in s.targets.items():
        if not t.alive:
            continue
        hb = out.get(t.identity.job)
        if hb is None:
            hb = out[t.identity.job] = Heartbeat(
                t.identity.job, agent, host, now, drops=dict(s.health.drops), health=dict(health)
            )
        r = t.identity.rank
        hb.ranks[r] = pid
        hb.last_seq[r] = dict(t.tracker.last_seq)
        if t.tracker.last_step is not None:
            hb.last_step[r] = t.tracker.last_step
    suspect = set()
    for f in s.inflight():
        tf = s.targets.get(f["pid"])
        if tf is None or not tf.alive:
            continue
        comm: Optional[str] = None
        seq: Optional[int] = None
        if f["channel"] == "nccl" and f["handle"]:
            info = tf.tracker.comms.get(f["handle"])
            comm = info.key if info is not None else f"{f['handle']:016x}"
            if libnccl.OPS.get(f["call"]) in COLLECTIVES:
                seq = None if f["seq"] is None else int(f["seq"])
        hb = out[tf.identity.job]
        hb.inflight.append(
            InFlight(tf.identity.rank, f["pid"], f["call"], int(f["since_ns"]) + wall, comm, seq)
        )
        if f.get("scan") and tf.identity.rank not in hb.attach_blocked:
            hb.attach_blocked.append(tf.identity.rank)
            info = tf.tracker.comms.get(f["handle"]) if f["handle"] else None
            if info is not None and 0 <= info.rank < info.nranks:
                hb.inflight_comm[tf.identity.rank] = [info.nranks, info.rank]
        if f["age_s"] >= SUSPECT_S:
            suspect.add(tf.identity.job)
    for pid, t in s.targets.items():  # maybe a hang: what is every rank doing (the others first)
        if t.alive and t.identity.job in suspect:
            where = s.where(pid)
            if where:
                out[t.identity.job].where[t.identity.rank] = where
    return list(out.values())


class RedisOut:
    """Publishes what the probe loop produces; `tick()` sends a heartbeat every 2 s."""

    def __init__(
        self,
        conf: RedisConf,
        host: Optional[str],
        say: Callable[[str], None],
        buffer_max: int = 10_000,
        maxlen: int = 100_000,
    ) -> None:
        self.host = host or socket.gethostname()
        self.agent = agent_id(self.host)
        self.say = say
        self.pub = Publisher(conf, self.agent, buffer_max=buffer_max, maxlen=maxlen, on_event=say)
        self.next_hb = 0.0

    def start(self) -> RedisOut:
        self.pub.start()
        return self

    def steps(self, steps: List[RankStep]) -> None:
        for rs in steps:
            self.pub.publish_step(rs)  # the agent's own RankStep: its detail stays here (argus.wire)

    def tick(self, s: Session, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.next_hb:
            return
        self.next_hb = now + HB_INTERVAL_S
        for hb in heartbeats(s, self.agent, self.host):
            self.pub.publish_heartbeat(hb)

    def footer(self) -> str:
        return self.pub.summary()

    def close(self) -> str:
        self.pub.close()
        return self.pub.summary()
