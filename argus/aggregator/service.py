"""The aggregator as a service: read summaries from Redis through a consumer group, judge them, and
publish alert transitions (stream + pub/sub channel + current-state hash per job).

Keys (hash-tagged per job like argus.transport's):

* ``argus:{JOB}:alerts``  stream of transitions, field ``d`` = the alert JSON (``XADD MAXLEN ~``);
* ``argus:{JOB}:alerts``  pub/sub channel, the same JSON;
* ``argus:{JOB}:alert_state``  hash: alert id -> its latest JSON (what `argus alerts` shows now).

* ``argus:{JOB}:leader``  the consumer that leads the job now (a lease, ``SET NX PX``).

Crash safety comes from the consumer group (argus.reader): entries are acknowledged only after the
engine took them, and a restarted aggregator first re-reads what it was given and never
acknowledged; its alert book is reloaded from the state hash, so an alert that was firing resolves
properly once its condition is gone. The engine's rolling state is rebuilt from new steps (a few
steps of warm-up).

One aggregator leads each job: a diagnosis compares every rank of a step, so two aggregators that
split a job's entries between them would each judge half a job. Others stand by; the leader renews
its lease every third of it, and when the lease lapses (the leader died or stalled) a standby takes
it, claims every entry still pending on the old leader, reloads the alert book, and goes on.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from argus.aggregator.alerts import Alert, AlertBook
from argus.aggregator.engine import Engine
from argus.errors import RedisUnavailable
from argus.redisconf import connection_hint
from argus.rediskeys import k_alert_state, k_alerts, k_leader, list_jobs

ALERTS_MAXLEN = 10_000
LEASE_S = 10.0  # a job's leader lease; a standby takes over this long after the leader stops renewing
# renew the lease only if it is still ours (a stalled leader must not extend its successor's)
RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)


def alert_json(a: Alert) -> bytes:
    return json.dumps(a.to_json(), separators=(",", ":"), sort_keys=True).encode()


def parse_alert(data: Any) -> Optional[Alert]:
    """An alert from its stored JSON; None for anything malformed (never trusted further)."""
    if not isinstance(data, (bytes, str)) or len(data) > 1 << 20:
        return None
    try:
        d = json.loads(data)
        a = Alert.from_json(d)
    except (ValueError, TypeError):
        return None
    if not isinstance(a.id, str) or not isinstance(a.kind, str) or not isinstance(a.ranks, list):
        return None
    return a


def publish_alerts(client: Any, alerts: List[Alert]) -> None:
    """Alert transitions to the job's stream, channel and state hash."""
    from argus.redisconf import is_cluster

    cluster = is_cluster(client)
    pipe = client.pipeline(transaction=False)
    for a in alerts:
        data = alert_json(a)
        pipe.xadd(k_alerts(a.job), {"d": data}, maxlen=ALERTS_MAXLEN, approximate=True)
        if not cluster:
            pipe.publish(k_alerts(a.job), data)
        pipe.hset(k_alert_state(a.job), a.id, data)
    pipe.execute()
    if cluster:  # a cluster pipeline refuses PUBLISH (it goes to every node): after the stream
        for a in alerts:
            client.publish(k_alerts(a.job), alert_json(a))


def load_book(client: Any, job: str, book: AlertBook, keep: Callable[[Alert], bool] = lambda a: True) -> None:
    """Firing alerts another (or a previous) aggregator left, those `keep` says are this one's to
    continue: the book resolves them once their condition is gone."""
    for _aid, raw in client.hgetall(k_alert_state(job)).items():
        a = parse_alert(raw)
        if a is not None and a.job == job and a.id not in book.alerts and keep(a):
            book.alerts[a.id] = a


@dataclass
class ServiceStats:
    entries: int = 0
    heartbeats: int = 0
    published: int = 0
    taken_over: int = 0  # entries claimed from a previous leader
    cpu_s: float = 0.0
    by_job: Dict[str, int] = field(default_factory=dict)


class Aggregator:
    """One consumer of every job it serves (given, or discovered from ``argus:jobs``)."""

    def __init__(
        self,
        client: Any,
        engine: Engine,
        jobs: Optional[List[str]] = None,
        group: str = "argus-aggregate",
        consumer: Optional[str] = None,
        count: int = 1024,
        on_alert: Optional[Callable[[Alert], None]] = None,
        on_notice: Optional[Callable[[str], None]] = None,
        lease_s: Optional[float] = LEASE_S,
    ) -> None:
        from argus import reader

        self.r = client
        self.engine = engine
        self.fixed_jobs = jobs
        self.group = group
        self.consumer = consumer or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_s = lease_s  # None: no leadership (every aggregator reads its share)
        self._leading: Dict[str, bool] = {}
        self._lease_check: Dict[str, float] = {}
        self.count = count
        self.on_alert = on_alert
        self.on_notice = on_notice  # lines about entries skipped as malformed or from a newer agent
        self._said: Dict[str, Tuple[int, int]] = {}  # job -> (rejected, ignored keys) last said
        self._next_notice: Dict[str, float] = {}
        self.readers: Dict[str, Any] = {}
        self.hb_cursor: Dict[str, str] = {}
        self.stats = ServiceStats()
        self._reader_mod = reader
        self._next_jobs = 0.0
        self._next_hb = 0.0

    # ---- jobs ----------------------------------------------------------------------------------------

    def jobs(self) -> List[str]:
        if self.fixed_jobs:
            return self.fixed_jobs
        now = time.monotonic()
        if now >= self._next_jobs:
            self._next_jobs = now + 5.0
            found = list_jobs(self.r)
            for j in found:
                self._reader(j)
        return sorted(self.readers)

    def _reader(self, job: str) -> Any:
        rd = self.readers.get(job)
        if rd is None:
            rd = self.readers[job] = self._reader_mod.Reader(
                self.r, job, self.group, self.consumer, count=self.count
            )
            self._reload(job)
        return rd

    def _reload(self, job: str) -> None:
        """Firing alerts another (or a previous) aggregator left: the book continues them."""
        load_book(self.r, job, self.engine.book)

    # ---- leadership ----------------------------------------------------------------------------------

    def _lead(self, job: str) -> bool:
        """Whether this aggregator leads `job` now (taking the lease when it is free)."""
        if self.lease_s is None:
            return True
        now = time.monotonic()
        was = self._leading.get(job)
        if was is not None and now < self._lease_check.get(job, 0.0):
            return was
        self._lease_check[job] = now + self.lease_s / 3
        key, px = k_leader(job), int(self.lease_s * 1000)
        try:
            if was:
                if self.r.eval(RENEW, 1, key, self.consumer, px):
                    return True
                self._say(
                    f"job {job}: lost the lead (stalled past its {self.lease_s:g} s lease), standing by"
                )
                self._leading[job] = False
                return False
            elif self.r.set(key, self.consumer, nx=True, px=px):
                self._leading[job] = True
                self._take_over(job)
                return True
            holder = self.r.get(key)
            who = holder.decode("utf-8", "replace") if isinstance(holder, bytes) else "another aggregator"
            if who == self.consumer:  # restarted under the same name within its lease: still ours
                self.r.eval(RENEW, 1, key, self.consumer, px)
                self._leading[job] = True
                self._take_over(job)
                return True
        except Exception as e:  # redis errors, without importing redis at module load
            raise self._unavailable(e) from None
        if was is None:
            self._say(f"job {job}: standing by, {who} leads it")
        self._leading[job] = False
        return False

    def _take_over(self, job: str) -> None:
        """Just became the leader: the previous one's unacknowledged entries are ours now."""
        rd = self._reader(job)
        self._reload(job)
        msgs = rd.take_over()
        out: List[Alert] = []
        for m in msgs:
            out += self.engine.add(m.step)
        if msgs:
            rd.ack([m.id for m in msgs])
        self.stats.taken_over += len(msgs)
        self.stats.entries += len(msgs)
        self._publish(job, out)
        self._say(f"job {job}: leading it (took over {len(msgs)} pending summaries)")

    def _say(self, line: str) -> None:
        if self.on_notice is not None:
            self.on_notice(line)

    # ---- the loop ------------------------------------------------------------------------------------

    def poll(self, block_ms: int = 200) -> int:
        """One round over the jobs: new summaries (and heartbeats every second). Returns entries."""
        t0 = time.process_time()
        n = 0
        jobs = [j for j in self.jobs() if self._lead(j)]
        if not jobs:
            time.sleep(block_ms / 1000)  # standing by for every job
        for job in jobs:
            rd = self._reader(job)
            try:
                msgs = rd.read(block_ms=block_ms if len(jobs) == 1 else 1)
            except Exception as e:  # redis errors, without importing redis at module load
                raise self._unavailable(e) from None
            out: List[Alert] = []
            for m in msgs:
                out += self.engine.add(m.step)
            if msgs:
                rd.ack([m.id for m in msgs])
            n += len(msgs)
            self.stats.by_job[job] = self.stats.by_job.get(job, 0) + len(msgs)
            self._publish(job, out)
        now = time.monotonic()
        if now >= self._next_hb:
            self._next_hb = now + 1.0
            for job in jobs:
                self._heartbeats(job)
        for job in jobs:
            self._notice(job, self._reader(job).stats)
        self.stats.entries += n
        self.stats.cpu_s += time.process_time() - t0
        return n

    def _heartbeats(self, job: str) -> None:
        since = self.hb_cursor.get(job, "-")
        got = self._reader_mod.heartbeats(self.r, job, since=since, stats=self._reader(job).stats)
        out: List[Alert] = []
        for eid, hb in got:
            if since != "-" and eid.decode() == since.lstrip("("):
                continue
            out += self.engine.add_heartbeat(hb)
            self.stats.heartbeats += 1
        if got:
            self.hb_cursor[job] = "(" + got[-1][0].decode()
        self._publish(job, out)

    def _notice(self, job: str, st: Any) -> None:
        """Say what was skipped when it changes, at most every 30 s per job."""
        said = (st.rejected_total, len(st.ignored))
        if self.on_notice is None or said == self._said.get(job, (0, 0)):
            return
        now = time.monotonic()
        if now < self._next_notice.get(job, 0.0):
            return
        self._said[job] = said
        self._next_notice[job] = now + 30.0
        for line in self._reader_mod.notices(st, job):
            self.on_notice(line)

    def _publish(self, job: str, alerts: List[Alert]) -> None:
        if not alerts:
            return
        publish_alerts(self.r, alerts)
        self.stats.published += len(alerts)
        if self.on_alert is not None:
            for a in alerts:
                self.on_alert(a)

    def run(self, duration: Optional[float] = None, stop: Callable[[], bool] = lambda: False) -> ServiceStats:
        end = None if duration is None else time.monotonic() + duration
        while not stop() and (end is None or time.monotonic() < end):
            if self.poll() == 0 and not self.readers:
                time.sleep(0.5)  # no job yet
        return self.stats

    @staticmethod
    def _unavailable(e: Exception) -> Exception:
        if type(e).__module__.startswith("redis"):
            return RedisUnavailable(
                f"lost Redis: {e}",
                connection_hint(e, None, "is redis-server running? the aggregator resumes on restart"),
            )
        return e


# ---- reading alerts back (argus alerts) --------------------------------------------------------------


def current(client: Any, job: str) -> List[Alert]:
    out = [a for a in (parse_alert(v) for v in client.hgetall(k_alert_state(job)).values()) if a is not None]
    return sorted(out, key=lambda a: (a.first_seen, a.id))


def history(client: Any, job: str, since_ns: int = 0) -> Iterator[Tuple[bytes, Alert]]:
    """Transitions in the job's alert stream at or after `since_ns` (realtime)."""
    start = f"{since_ns // 1_000_000}-0" if since_ns else "-"
    cursor = start
    while True:
        raw = client.xrange(k_alerts(job), min=cursor, count=1000)
        if not raw:
            return
        for eid, fields in raw:
            a = parse_alert((fields or {}).get(b"d"))
            if a is not None:
                yield eid, a
        cursor = "(" + raw[-1][0].decode()


def follow(
    client: Any, job: str, last_id: str = "$", block_ms: int = 1000
) -> Iterator[Tuple[bytes, Optional[Alert]]]:
    """New transitions as they are written (XREAD BLOCK); yields (id, None) on a quiet interval."""
    cursor = last_id
    while True:
        got = client.xread({k_alerts(job): cursor}, block=block_ms, count=100)
        if not got:
            yield b"", None
            continue
        for eid, fields in got[0][1]:
            cursor = eid.decode()
            yield eid, parse_alert((fields or {}).get(b"d"))
