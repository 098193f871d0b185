"""Reading summaries back from Redis: consumer groups, acknowledgement, crash recovery, validation.

The aggregator (and any tool) reads a job's ``argus:{JOB}:steps`` stream through a consumer group,
so several aggregators share one job and a crashed one loses nothing:

* `read()` first re-reads this consumer's own pending entries (delivered before a crash, never
  acknowledged), then every `claim_every_s` takes over entries pending on *other* consumers for
  more than `claim_idle_ms` (``XAUTOCLAIM``: a dead aggregator's work), then reads new entries;
* every entry is validated by `argus.wire.decode_step`; a rejected entry is acknowledged (it will
  never become valid) and counted in ``rejected[reason]``; nothing in an entry is ever executed;
  fields of a newer agent that this version skips are counted in ``ignored``; `notices()` turns
  these counts into the lines a person is shown;
* an entry seen twice (a publisher re-sends a pipeline that failed midway) is acknowledged and
  counted in ``duplicates``, not returned again;
* the caller acknowledges what it has processed with `ack()`.
"""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import msgpack

from argus import wire
from argus.errors import BadData, RedisUnavailable
from argus.redisconf import connection_hint
from argus.rediskeys import k_agent, k_agents, k_hb, k_names, k_steps
from argus.schema import Heartbeat, RankStep

DEFAULT_GROUP = "argus-aggregate"


@dataclass
class Message:
    id: bytes  # stream entry id, for ack()
    step: RankStep


@dataclass
class ReaderStats:
    received: int = 0  # valid, first-seen entries returned
    acked: int = 0
    duplicates: int = 0
    claimed: int = 0  # taken over from other consumers
    trimmed: int = 0  # pending entries that MAXLEN removed before they were read
    unknown_names: int = 0
    rejected: Dict[str, int] = field(default_factory=dict)  # reason -> count
    ignored: Dict[str, int] = field(default_factory=dict)  # "step:key" -> entries that carried it

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def ignore(self, keys: Set[str]) -> None:
        for k in keys:
            self.ignored[k] = self.ignored.get(k, 0) + 1


def _rejected(stats: ReaderStats, job: str) -> Tuple[str, str]:
    """(what was rejected, why that may be) for the lines below."""
    reasons = ", ".join(f"{r} {c}" for r, c in sorted(stats.rejected.items(), key=lambda x: -x[1]))
    if set(stats.rejected) <= {"version", "heartbeat:version"}:
        return reasons, "a newer argus wrote them (another schema version): upgrade this reader"
    if set(stats.rejected) <= {"other-job", "heartbeat:other-job"}:
        return reasons, (
            f"an agent writes another job's summaries into argus:{{{job}}}:*: check the agents' --job "
            "and the Redis ACL that should confine each agent to its job's keys"
        )
    return reasons, (
        f"something other than argus writes to argus:{job}:*, or the data was damaged; "
        f"look with: redis-cli XRANGE {k_steps(job)} - + COUNT 3"
    )


def notices(stats: ReaderStats, job: str) -> List[str]:
    """What a person should hear about the job's entries that were skipped (empty when none were)."""
    out: List[str] = []
    if stats.rejected:
        n = stats.rejected_total
        reasons, hint = _rejected(stats, job)
        out += [f"WARNING: skipped {n} malformed entr{'y' if n == 1 else 'ies'} of job {job} ({reasons})"]
        out += [f"HINT: {hint}"]
    if stats.ignored:
        keys = ", ".join(sorted(stats.ignored))
        out.append(
            f"NOTE: job {job}'s entries carry fields this argus version skips ({keys}): "
            "a newer agent wrote them; upgrade this reader to use them"
        )
    return out


def say_skipped(stats: ReaderStats, job: str, valid: int, say: Callable[[str], None]) -> None:
    """For a tool that read a whole job: `notices` through `say`, or BadData (exit 9) when entries
    were there but none of them was valid."""
    if valid == 0 and stats.rejected_total:
        reasons, hint = _rejected(stats, job)
        n = stats.rejected_total
        raise BadData(f"none of the {n} entries of job {job} is readable ({reasons})", hint)
    for line in notices(stats, job):
        say(line)


def _key(rs: RankStep) -> Tuple[Any, ...]:
    return (rs.job, rs.rank, rs.pid, rs.step, rs.start_ns)


class Reader:
    """One consumer of a job's step stream."""

    def __init__(
        self,
        client: Any,
        job: str,
        group: str = DEFAULT_GROUP,
        consumer: Optional[str] = None,
        *,
        start: str = "0",
        count: int = 512,
        claim_idle_ms: int = 30_000,
        claim_every_s: float = 5.0,
        dedup_window: int = 200_000,
        key: Optional[str] = None,
    ) -> None:
        self.r, self.job, self.group = client, job, group
        self.consumer = consumer or f"{socket.gethostname()}:{os.getpid()}"
        self.key = key or k_steps(job)  # another stream of the job's summaries: a shard's
        self.count, self.claim_idle_ms, self.claim_every_s = count, claim_idle_ms, claim_every_s
        self.stats = ReaderStats()
        self.names: Dict[int, str] = {}
        self._seen: OrderedDict[Tuple[Any, ...], None] = OrderedDict()
        self._dedup_window = dedup_window
        self._own_pending = True  # first, what this consumer was given before a restart
        self._next_claim = 0.0
        self._start = start
        self._group_ready = False

    # ---- setup ---------------------------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if missing; `start` "0": from the beginning,
        "$": only new entries."""
        import redis

        try:
            self.r.xgroup_create(self.key, self.group, id=self._start, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(
                f"cannot reach Redis to read {self.key}: {e}", connection_hint(e)
            ) from None
        self._group_ready = True

    # ---- reading -------------------------------------------------------------------------------------

    def read(self, block_ms: Optional[int] = 1000) -> List[Message]:
        """The next batch of valid, first-seen summaries (possibly empty after `block_ms`).

        A stream or group that vanished (Redis restarted empty) is recreated; a connection failure
        raises RedisUnavailable (call again to retry)."""
        import redis

        try:
            return self._read(block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False
            self._own_pending = True
            return []
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self._group_ready = False
            raise RedisUnavailable(f"lost Redis while reading {self.key}: {e}", connection_hint(e)) from None

    def _read(self, block_ms: Optional[int]) -> List[Message]:
        if not self._group_ready:
            self.ensure_group()
        if self._own_pending:
            got = self.r.xreadgroup(self.group, self.consumer, {self.key: "0"}, count=self.count)
            raw = got[0][1] if got else []
            if raw:
                return self._accept(raw)
            self._own_pending = False
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.claim_every_s
            claimed = self.claim()
            if claimed:
                return claimed
        got = self.r.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=self.count, block=block_ms)
        return self._accept(got[0][1] if got else [])

    def claim(self) -> List[Message]:
        """Take over entries idle > claim_idle_ms on other consumers (a crashed aggregator's)."""
        out: List[Message] = []
        cursor = "0-0"
        while True:
            res = self.r.xautoclaim(
                self.key, self.group, self.consumer, self.claim_idle_ms, start_id=cursor, count=self.count
            )
            cursor, entries = res[0], res[1]
            if len(res) > 2:
                self.stats.trimmed += len(res[2])
            self.stats.claimed += len(entries)
            out += self._accept(entries)
            if cursor in (b"0-0", "0-0") or not entries:
                return out

    def take_over(self) -> List[Message]:
        """Every entry pending on any other consumer, however recently delivered: for the new
        leader of a job, whose previous leader's lease lapsed (it died holding them)."""
        saved, self.claim_idle_ms = self.claim_idle_ms, 0
        try:
            if not self._group_ready:
                self.ensure_group()
            return self.claim()
        finally:
            self.claim_idle_ms = saved

    def ack(self, ids: List[bytes]) -> None:
        if ids:
            self.stats.acked += int(self.r.xack(self.key, self.group, *ids))

    def _accept(
        self, raw: List[Tuple[bytes, Optional[Dict[bytes, bytes]]]], ack: bool = True
    ) -> List[Message]:
        drop: List[bytes] = []
        decoded: List[Tuple[bytes, Any, Optional[RankStep], Set[int]]] = []
        missing: Set[int] = set()
        for eid, fields in raw:
            m: Set[int] = set()
            decoded.append((eid, fields, self._decode(eid, fields, drop, m), m))
            missing |= m
        if missing:  # kernel ids not in the name cache yet: fetched once for the whole batch
            self._fetch_names(missing)
        out: List[Message] = []
        for eid, fields, rs, m in decoded:
            if rs is not None and m:
                m2: Set[int] = set()
                rs = self._decode(eid, fields, drop, m2, again=True)
                self.stats.unknown_names += len(m2)
            if rs is not None:
                self._emit(eid, rs, out, drop)
        if ack:
            self.ack(drop)
        return out

    def _decode(
        self,
        eid: bytes,
        fields: Optional[Dict[bytes, bytes]],
        drop: List[bytes],
        missing: Optional[Set[int]],
        again: bool = False,
    ) -> Optional[RankStep]:
        if not fields:  # the entry was trimmed away while pending
            self.stats.trimmed += 1
            drop.append(eid)
            return None
        data = fields.get(b"d")
        if data is None or len(fields) != 1:
            self._reject("fields", eid, drop)
            return None
        ignored: Set[str] = set()
        try:
            rs = wire.decode_step(data, self.names, missing, ignored)
        except wire.WireError as e:
            self._reject(e.reason, eid, drop)
            return None
        if rs.job != self.job:  # in another job's stream: a misconfigured or forged writer
            self._reject("other-job", eid, drop)
            return None
        if ignored and not again:  # counted once, not again when kernel names are resolved
            self.stats.ignore(ignored)
        return rs

    def _reject(self, reason: str, eid: bytes, drop: List[bytes]) -> None:
        self.stats.reject(reason)
        drop.append(eid)

    def _emit(self, eid: bytes, rs: RankStep, out: List[Message], drop: List[bytes]) -> None:
        k = _key(rs)
        if k in self._seen:
            self.stats.duplicates += 1
            drop.append(eid)
            return
        self._seen[k] = None
        if len(self._seen) > self._dedup_window:
            self._seen.popitem(last=False)
        self.stats.received += 1
        out.append(Message(eid, rs))

    def _fetch_names(self, ids: Set[int]) -> None:
        order = sorted(ids)
        vals = self.r.hmget(k_names(self.job), [str(i) for i in order])
        for i, v in zip(order, vals):
            if isinstance(v, bytes) and len(v) <= 4 * wire.MAX_NAME:
                name = v.decode("utf-8", "replace")
                if len(name) <= wire.MAX_NAME and wire.name_id(name) == i:
                    self.names[i] = name


# ---- without a consumer group: tools and tests -----------------------------------------------------------


def iter_steps(
    client: Any, job: str, stats: Optional[ReaderStats] = None, batch: int = 1000
) -> Iterator[Tuple[bytes, RankStep]]:
    """Every valid summary in the stream, oldest first (XRANGE; acknowledges nothing)."""
    stats = stats if stats is not None else ReaderStats()
    rd = Reader(client, job)
    rd.stats = stats
    cursor = "-"
    while True:
        raw = client.xrange(k_steps(job), min=cursor, count=batch)
        if not raw:
            return
        cursor = "(" + raw[-1][0].decode()
        out = rd._accept(raw, ack=False)
        for m in out:
            yield m.id, m.step


def heartbeats(
    client: Any, job: str, since: str = "-", count: int = 1000, stats: Optional[ReaderStats] = None
) -> List[Tuple[bytes, Heartbeat]]:
    """Heartbeats after `since` (an entry id; "-" for all kept), invalid ones skipped (and counted
    in `stats` as ``heartbeat:REASON``)."""
    out = []
    for eid, fields in client.xrange(k_hb(job), min=since, count=count):
        ignored: Set[str] = set()
        try:
            hb = wire.decode_heartbeat((fields or {}).get(b"d"), ignored)
        except wire.WireError as e:
            if stats is not None:
                stats.reject(f"heartbeat:{e.reason}")
            continue
        if hb.job != job:
            if stats is not None:
                stats.reject("heartbeat:other-job")
            continue
        out.append((eid, hb))
        if stats is not None and ignored:
            stats.ignore(ignored)
    return out


def live_agents(client: Any, job: str) -> Dict[str, Heartbeat]:
    """agent -> its latest heartbeat, for agents whose liveness key has not expired."""
    agents = [a.decode("utf-8", "replace") for a in client.hkeys(k_agents(job))]
    if not agents:
        return {}
    vals = client.mget([k_agent(job, a) for a in agents])
    out: Dict[str, Heartbeat] = {}
    for a, v in zip(agents, vals):
        if v is None:
            continue
        try:
            out[a] = wire.decode_heartbeat(v)
        except wire.WireError:
            continue
    return out


def registry(client: Any, job: str) -> Dict[str, Dict[str, Any]]:
    """agent -> registry record (host, pid, ranks, started_ns, ts_ns, state), malformed ones skipped."""
    out: Dict[str, Dict[str, Any]] = {}
    for a, v in client.hgetall(k_agents(job)).items():
        if len(v) > 65536:
            continue
        try:
            rec = msgpack.unpackb(v, raw=False, strict_map_key=False, max_ext_len=0)
        except Exception:  # hostile or foreign data: skip it
            continue
        if isinstance(rec, dict) and rec.get("v") == 1:
            out[a.decode("utf-8", "replace")] = rec
    return out
