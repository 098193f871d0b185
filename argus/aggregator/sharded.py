"""One job over several aggregators: `argus aggregate --shard I/N` (docs/architecture.md, "One job
over several aggregators").

N members, started alike but for I, each do three things for every job they serve:

* **route**: as members of one consumer group on the job's stream (``argus:{JOB}:steps``, the
  agents' own: nothing changes for them) they read the summaries in any share, look at the rank
  (a few msgpack keys, ~1 µs: no decoding) and append the entries' bytes unchanged to their
  shard's stream (``argus:{JOB}:shard:S:steps``), one entry per shard and batch: Redis's work is
  per entry, and one job's keys are one Redis master's. Heartbeats likewise, by their ranks. Routing is
  stateless given the plan, so any member may route any entry, and entries a member read and
  did not forward are claimed by the others once idle for a lease period (XAUTOCLAIM).
* **judge a shard**: the member holding shard S's lease (``argus:{JOB}:shard:S:owner``; member
  I takes shard I, and a shard whose lease lapsed — its member died — is taken by the first
  other member to see it, after its own first lease period) reads S's stream through a consumer
  group with a whole-job engine limited to S's ranks (argus.aggregator.engine, `shard`),
  publishes those ranks' alerts, and hands per-step partials to ``argus:{JOB}:reduce``
  (argus.aggregator.partials). Entries are acknowledged once their step was judged, so a member
  that dies loses nothing: its successor claims what it had not judged (`Reader.take_over`).
* **reduce**: one member (the lease ``argus:{JOB}:reducer``: member 0 first) runs what needs the
  whole job (argus.aggregator.reduce: L1, hangs) and writes those alerts; it also makes the
  partition, once, from the first summaries of the job (argus.aggregator.partition,
  ``argus:{JOB}:shardplan``, SET NX: every member uses the one stored).

Every alert is written once: a rank is judged by one shard, and only the reducer judges the
job-wide kinds.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import msgpack

from argus import wire
from argus.aggregator.alerts import Alert
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.engine import JOB_KINDS, Engine
from argus.aggregator.partials import HangPartial, StepPartial, decode
from argus.aggregator.partition import Plan, RankInfo, make_plan, rank_info
from argus.aggregator.reduce import Reducer
from argus.aggregator.service import RENEW, load_book, publish_alerts
from argus.errors import RedisUnavailable, UsageError
from argus.reader import Message, Reader
from argus.redisconf import connection_hint
from argus.rediskeys import (
    k_hb,
    k_reduce,
    k_reducer,
    k_shard_extra,
    k_shard_hb,
    k_shard_owner,
    k_shard_plan,
    k_shard_steps,
    k_steps,
    list_jobs,
)
from argus.schema import RankStep
from argus.transport import HB_MAXLEN

PLAN_WAIT_S = 3.0  # a plan waits this long (wall) for ranks beyond those seen, unless all are seen
PLAN_SAMPLE = 8192  # entries of the job's stream read per poll while planning
REDUCE_MAXLEN = 100_000
SHARD_MAXLEN = 20_000  # bundles (a router's batch of one shard's summaries each): millions of summaries
MAX_BUNDLE = 65_536
BUNDLES_PER_READ = 4  # a bundle holds up to a routing batch (1,024 summaries)
# a lease given up (a clean exit) only by its holder
_DROP = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], 0) end return 0"
# a rank placed once for every member: the first placement stays (HEXISTS + HSET in one script:
# within the aggregator's ACL, docs/security.md, which has no HSETNX)
_PLACE = (
    "if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end "
    "return redis.call('hget', KEYS[1], ARGV[1])"
)
SHIFT_KINDS = {"kernel_degradation", "slow_link"}  # L3's group shifts (slow_link also L2's, by a pair)


def peek_rank(data: Any) -> Optional[int]:
    """The rank of an encoded summary from its first keys (argus.wire puts `r` third); None when it
    is not one: the shard's reader rejects it properly (counted, said)."""
    if not isinstance(data, bytes):
        return None
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 1)
    try:
        u.feed(data)
        for _ in range(min(u.read_map_header(), 64)):
            k = u.unpack()
            if k == "r":
                r = u.unpack()
                return r if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 else None
            u.skip()
    except Exception:  # malformed: msgpack's errors have no common base
        return None
    return None


@dataclass
class MemberStats:
    routed: int = 0  # summaries this member forwarded to a shard's stream
    routed_hb: int = 0
    entries: int = 0  # summaries judged by the shards it owned
    partials: int = 0
    reduced: int = 0  # steps reduced
    published: int = 0  # alert transitions
    taken_over: int = 0  # entries claimed from a previous owner of a shard or of the reduce step
    cpu_s: float = 0.0
    cpu_route_s: float = 0.0
    cpu_shard_s: float = 0.0
    cpu_reduce_s: float = 0.0
    cpu_plan_s: float = 0.0  # once per job: the partition, from the first summaries
    by_shard: Dict[int, int] = field(default_factory=dict)


class Lease:
    """A key held by one member with an expiry. Taken in the member's loop; renewed every third of
    it by the member's renewal thread (`Member`), not by the loop: judging one step of a 50,000-rank
    shard holds the loop for seconds, and a loop that renewed its own leases lost them then (its
    shard taken over while it was judging it)."""

    def __init__(self, client: Any, key: str, holder: str, lease_s: float) -> None:
        self.r, self.key, self.holder, self.lease_s = client, key, holder, lease_s
        self.held = False
        self.lost = False  # set by the renewal thread; said once by `tick`
        self._next = 0.0

    def tick(self, now: float, may_take: bool) -> str:
        """'held', 'taken' (just now), 'lost' (since the last tick: not renewed in time) or 'no'."""
        if self.lost:
            self.lost = False
            return "lost"
        if self.held:
            return "held"
        if now < self._next:
            return "no"
        self._next = now + self.lease_s / 3
        px = int(self.lease_s * 1000)
        if may_take and self.r.set(self.key, self.holder, nx=True, px=px):
            self.held = True
            return "taken"
        cur = self.r.get(self.key)
        if isinstance(cur, bytes) and cur.decode("utf-8", "replace") == self.holder:
            self.r.eval(RENEW, 1, self.key, self.holder, px)  # restarted under the same name: ours
            self.held = True
            return "taken"
        return "no"

    def renew(self) -> None:
        """The renewal thread's: extend it while it is still this member's."""
        if self.held and not self.r.eval(RENEW, 1, self.key, self.holder, int(self.lease_s * 1000)):
            self.held, self.lost = False, True

    def release(self) -> None:
        if self.held:  # PEXPIRE 0 deletes it: the aggregator's ACL has PEXPIRE, not DEL
            self.held = False
            self.r.eval(_DROP, 1, self.key, self.holder)


def _group(client: Any, key: str, group: str) -> None:
    import redis

    try:
        client.xgroup_create(key, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class GroupStream:
    """Raw entries of one stream through a consumer group: this consumer's own pending first (after
    a restart), entries idle past `claim_idle_ms` on other consumers (a dead member's), then new."""

    def __init__(
        self, client: Any, key: str, group: str, consumer: str, count: int, claim_idle_ms: int
    ) -> None:
        self.r, self.key, self.group, self.consumer = client, key, group, consumer
        self.count, self.claim_idle_ms = count, claim_idle_ms
        self._ready = False
        self._own = True
        self._next_claim = 0.0
        self.claimed = 0

    def read(self, now: float) -> List[Tuple[bytes, Optional[Dict[bytes, bytes]]]]:
        import redis

        try:
            if not self._ready:
                _group(self.r, self.key, self.group)
                self._ready = True
            if self._own:
                got = self.r.xreadgroup(self.group, self.consumer, {self.key: "0"}, count=self.count)
                if got and got[0][1]:
                    return list(got[0][1])
                self._own = False
            if now >= self._next_claim:
                self._next_claim = now + max(1.0, self.claim_idle_ms / 3000)
                claimed = self.claim(self.claim_idle_ms)
                if claimed:
                    return claimed
            got = self.r.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=self.count)
            return list(got[0][1]) if got else []
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._ready, self._own = False, True  # Redis restarted empty: the group comes back
            return []

    def claim(self, idle_ms: int) -> List[Tuple[bytes, Optional[Dict[bytes, bytes]]]]:
        if not self._ready:
            _group(self.r, self.key, self.group)
            self._ready = True
        out: List[Tuple[bytes, Optional[Dict[bytes, bytes]]]] = []
        cursor = "0-0"
        while True:
            res = self.r.xautoclaim(
                self.key, self.group, self.consumer, idle_ms, start_id=cursor, count=self.count
            )
            cursor, entries = res[0], res[1]
            out += entries
            if len(res) > 2 and res[2]:  # trimmed away while pending: nothing to forward
                self.r.xack(self.key, self.group, *res[2])
            if cursor in (b"0-0", "0-0") or not entries:
                break
        self.claimed += len(out)
        return out


class ShardReader(Reader):
    """A shard's stream: each entry a bundle of the summaries of one router batch for this shard
    (msgpack list of the agents' bytes, unchanged). A summary comes back as a Message with its
    bundle's id; the bundle is acknowledged by the owner once every summary of it was judged, and
    at once here when none of it is to be judged (all malformed or seen before)."""

    def _accept(
        self, raw: List[Tuple[bytes, Optional[Dict[bytes, bytes]]]], ack: bool = True
    ) -> List[Message]:
        empty: List[bytes] = []
        scratch: List[bytes] = []  # a rejected or duplicate summary is counted, its bundle kept
        decoded: List[Tuple[bytes, bytes, Optional[RankStep], Set[int]]] = []
        missing: Set[int] = set()
        for eid, fields in raw:
            if not fields:  # trimmed away while pending
                self.stats.trimmed += 1
                empty.append(eid)
                continue
            items = self._bundle(fields)
            if items is None:
                self._reject("fields", eid, empty)
                continue
            for data in items:
                m: Set[int] = set()
                decoded.append((eid, data, self._decode(eid, {b"d": data}, scratch, m), m))
                missing |= m
        if missing:
            self._fetch_names(missing)
        out: List[Message] = []
        for eid, data, rs, m in decoded:
            if rs is not None and m:
                m2: Set[int] = set()
                rs = self._decode(eid, {b"d": data}, scratch, m2, again=True)
                self.stats.unknown_names += len(m2)
            if rs is not None:
                self._emit(eid, rs, out, scratch)
        kept = {x.id for x in out}
        empty += [eid for eid, _f in raw if eid not in kept and eid not in empty]
        if ack:
            self.ack(empty)
        return out

    @staticmethod
    def _bundle(fields: Dict[bytes, bytes]) -> Optional[List[bytes]]:
        b = fields.get(b"b")
        if not isinstance(b, bytes) or len(fields) != 1:
            return None
        try:
            items = msgpack.unpackb(b, raw=True, max_array_len=MAX_BUNDLE, max_map_len=0, max_ext_len=0)
        except Exception:  # malformed: msgpack's errors have no common base
            return None
        if not isinstance(items, list) or not all(isinstance(x, bytes) for x in items):
            return None
        return items


class ShardOwner:
    """One shard of one job, judged by this member while it holds the shard's lease."""

    def __init__(self, m: JobMember, shard: int) -> None:
        self.m, self.shard = m, shard
        self.engine = Engine(m.member.th, m.member.info, shard=shard)
        self.reader = ShardReader(
            m.r,
            m.job,
            m.member.group,
            m.member.consumer,
            key=k_shard_steps(m.job, shard),
            count=BUNDLES_PER_READ,  # bundles: a backlog read at once was ~50 MB at 1,024 ranks
            claim_idle_ms=int(m.member.lease_s * 1000),
        )
        self.hb_cursor = "-"
        self._next_hb = 0.0
        self._said: Tuple[int, int] = (0, 0)
        self._next_notice = 0.0
        # entries acknowledged once their step is judged: job step -> ids; and (id, rank, own
        # step, judged frontier when it came) of ranks not aligned yet
        self.buckets: Dict[int, List[bytes]] = {}
        self.waiting: List[Tuple[bytes, int, int, int]] = []
        self.open: Dict[bytes, int] = {}  # bundle -> its summaries not judged yet
        self.ranks: Set[int] = set()
        self.scope()
        load_book(m.r, m.job, self.engine.book, self._mine)

    def _mine(self, a: Alert) -> bool:
        return not self.m.reducers(a) and bool(a.ranks) and set(a.ranks) <= self.ranks

    def scope(self) -> None:
        """The ranks this shard waits for (the plan's, and those placed since), and the
        communicators it judges whole."""
        assert self.m.plan is not None
        self.ranks = self.m.ranks_of(self.shard)
        whole = {c for c, s in self.m.plan.comms.items() if s == self.shard}
        self.engine.set_scope(self.m.job, max(1, self.m.expected(self.shard)), whole)

    def take_over(self) -> int:
        msgs = self.reader.take_over()
        self.m.member.stats.taken_over += len(msgs)
        self._feed(msgs)
        return len(msgs)

    def poll(self, now: float) -> int:
        msgs = self.reader.read(block_ms=None)
        self._feed(msgs)
        if now >= self._next_hb:  # heartbeats come every 2 s per agent: once a second is enough
            self._next_hb = now + 1.0
            self._heartbeats()
        self._notice(now)
        return len(msgs)

    def _notice(self, now: float) -> None:
        """Say what was skipped (malformed entries, a newer agent's fields) when it changes, at most
        every 30 s, as one aggregator does."""
        from argus.reader import notices

        st = self.reader.stats
        said = (st.rejected_total, len(st.ignored))
        if said == self._said or now < self._next_notice:
            return
        self._said, self._next_notice = said, now + 30.0
        for line in notices(st, self.m.job):
            self.m.member.say(line)

    def _feed(self, msgs: List[Any]) -> None:
        out: List[Alert] = []
        for m in msgs:
            out += self.engine.add(m.step)
        st = self.m.member.stats
        st.entries += len(msgs)
        st.by_shard[self.shard] = st.by_shard.get(self.shard, 0) + len(msgs)
        # alerts and partials out before the acknowledgement: dying in between judges a step twice
        # (the reducer keeps the first partial), never not at all
        self.m.publish(out)
        self._hand_over()
        self._settle(msgs)

    def _settle(self, msgs: List[Any]) -> None:
        """Acknowledge what was judged (or will never be): a member that dies before judging a
        step leaves its entries pending for the next owner."""
        for m in msgs:
            self.open[m.id] = self.open.get(m.id, 0) + 1
        d = self.engine.jobs.get(self.m.job)
        if d is None:
            return
        judged = d.aligner.judged
        ack: List[bytes] = []  # one per summary settled: its bundle goes once all of it has
        for m in msgs:
            ra = d.align.ranks.get(m.step.rank)
            own = m.step.step if m.step.step is not None else -1
            if ra is None or ra.offset is None:
                self.waiting.append((m.id, m.step.rank, own, judged))
                continue
            js = own + ra.offset
            if js <= judged:
                ack.append(m.id)
            else:
                self.buckets.setdefault(js, []).append(m.id)
        if self.waiting:
            keep = []
            for eid, r, own, since in self.waiting:
                ra = d.align.ranks.get(r)
                if ra is not None and ra.offset is not None:
                    self.buckets.setdefault(own + ra.offset, []).append(eid)
                elif judged - since > self.m.member.th.window:
                    ack.append(eid)  # never aligned within the window: its summaries were let go
                else:
                    keep.append((eid, r, own, since))
            self.waiting = keep
        for s in [s for s in self.buckets if s <= judged]:
            ack += self.buckets.pop(s)
        done = []
        for eid in ack:
            left = self.open.get(eid, 1) - 1
            if left > 0:
                self.open[eid] = left
            else:
                self.open.pop(eid, None)
                done.append(eid)
        self.reader.ack(done)

    def _hand_over(self) -> None:
        """Partials of the steps just judged, and a new hang judgement, to the reducer."""
        parts: List[StepPartial] = self.engine.partials
        hang: Optional[HangPartial] = self.engine.hangs.pop(self.m.job, None)
        if not parts and hang is None:
            return
        self.engine.partials = []
        pipe = self.m.r.pipeline(transaction=False)
        for p in parts:
            pipe.xadd(k_reduce(self.m.job), {b"p": p.to_bytes()}, maxlen=REDUCE_MAXLEN, approximate=True)
        if hang is not None:
            pipe.xadd(k_reduce(self.m.job), {b"p": hang.to_bytes()}, maxlen=REDUCE_MAXLEN, approximate=True)
        pipe.execute()
        self.m.member.stats.partials += len(parts) + (hang is not None)

    def _heartbeats(self) -> None:
        key = k_shard_hb(self.m.job, self.shard)
        raw = self.m.r.xrange(key, min=self.hb_cursor, count=1000)
        out: List[Alert] = []
        for eid, fields in raw:
            self.hb_cursor = "(" + eid.decode()
            try:
                hb = wire.decode_heartbeat((fields or {}).get(b"d"))
            except wire.WireError as e:
                self.reader.stats.reject(f"heartbeat:{e.reason}")
                continue
            if hb.job != self.m.job:
                self.reader.stats.reject("heartbeat:other-job")
                continue
            out += self.engine.add_heartbeat(hb)
        self.m.publish(out)
        self._hand_over()


class ReduceOwner:
    """The job's reduce step, run by this member while it holds the reducer lease."""

    def __init__(self, m: JobMember) -> None:
        th = m.member.th
        self.m = m
        patience = 2 * m.member.lease_s + th.lag_s  # a dead member's shard is taken over within it
        self.reducer = Reducer(m.job, th, m.member.info, patience_s=patience, max_pending=th.window)
        self.stream = GroupStream(
            m.r,
            k_reduce(m.job),
            m.member.group + ":reduce",
            m.member.consumer,
            4096,
            int(m.member.lease_s * 1000),
        )
        self.unacked: Dict[int, List[bytes]] = {}
        self.bad = 0
        load_book(m.r, m.job, self.reducer.book, m.reducers)

    def take_over(self, now: float) -> int:
        got = self.stream.claim(0)  # the previous reducer's: whatever it had not reduced
        self.m.member.stats.taken_over += len(got)
        self._feed(got, now)
        return len(got)

    def poll(self, now: float) -> int:
        self.reducer.shards = {s for s in range(self.m.n) if self.m.expected(s) > 0}
        got = self.stream.read(now)
        self._feed(got, now)
        return len(got)

    def _feed(self, got: List[Tuple[bytes, Optional[Dict[bytes, bytes]]]], now: float) -> None:
        out: List[Alert] = []
        ack: List[bytes] = []
        for eid, fields in got:
            try:
                p = decode((fields or {}).get(b"p"))
            except ValueError:
                self.bad += 1  # only aggregators write here: a damaged entry, said in the stats
                ack.append(eid)
                continue
            if p.job != self.m.job:
                self.bad += 1
                ack.append(eid)
            elif isinstance(p, HangPartial):
                out += self.reducer.hang(p)
                ack.append(eid)
            else:
                self.reducer.add(p, now)
                self.unacked.setdefault(p.step, []).append(eid)
        before = self.reducer.stats.steps
        out += self.reducer.ready(now)
        self.m.member.stats.reduced += self.reducer.stats.steps - before
        self.m.publish(out)  # before the acknowledgement, as a shard's
        for s in [s for s in self.unacked if s <= self.reducer.judged]:
            ack += self.unacked.pop(s)
        if ack:
            self.m.r.xack(self.stream.key, self.stream.group, *ack)


class JobMember:
    """This member's part in one job: routing, the shards it owns, the reduce step if it has it."""

    def __init__(self, member: Member, job: str) -> None:
        self.member, self.job, self.r = member, job, member.r
        self.n = member.shards
        self.plan: Optional[Plan] = None
        self.extra: Dict[int, int] = {}  # rank -> shard, placed after the plan
        self._sizes: Dict[int, int] = {}
        self._next_extra = 0.0
        self._dirty = False  # ranks placed since the shards' sizes were counted
        self._next_plan = 0.0
        self.infos: Dict[int, RankInfo] = {}  # planning: ranks seen at the head of the job's stream
        self._plan_cursor = "-"
        self._grew = 0.0
        cl = int(member.lease_s * 1000)  # a live member forwards within a poll: idle longer is dead
        self.steps_in = GroupStream(
            self.r, k_steps(job), member.group + ":route", member.consumer, member.count, cl
        )
        self.hb_in = GroupStream(
            self.r, k_hb(job), member.group + ":route", member.consumer, member.count, cl
        )
        self.shard_leases = {
            s: Lease(self.r, k_shard_owner(job, s), member.consumer, member.lease_s) for s in range(self.n)
        }
        self.reduce_lease = Lease(self.r, k_reducer(job), member.consumer, member.lease_s)
        self.owners: Dict[int, ShardOwner] = {}
        self.reducing: Optional[ReduceOwner] = None

    # ---- the plan ------------------------------------------------------------------------------------

    def reducers(self, a: Alert) -> bool:
        """Whether an alert is the reducer's to continue: a job-wide kind, or a group shift of a
        group cut across shards (argus.aggregator.reduce); the others are their ranks' shard's."""
        assert self.plan is not None
        if a.kind in JOB_KINDS:
            return True
        return a.kind in SHIFT_KINDS and (a.comm is None or a.comm not in self.plan.comms)

    def ranks_of(self, shard: int) -> Set[int]:
        assert self.plan is not None
        return self.plan.ranks_of(shard) | {r for r, s in self.extra.items() if s == shard}

    def expected(self, shard: int) -> int:
        """Ranks shard `shard` waits for: the plan's and those placed since, and by rank range the
        ranks below the job's world size nobody has seen yet (as one aggregator waits for them)."""
        return self._sizes.get(shard, 0)

    def _resize(self) -> None:
        """How many ranks each shard waits for (`expected`); its owner's scope when that changed."""
        assert self.plan is not None
        n, world = self.n, self.plan.world
        sizes = [0] * n
        known = {**self.plan.of, **self.extra}
        # ranks below the world size nobody has seen yet: by rank range (Plan.place), counted per
        # range rather than one by one (100,000 ranks)
        for s in range(n):
            sizes[s] = -(-(s + 1) * world // n) - -(-s * world // n)
        for r, s in known.items():
            sizes[s] += 1
            if r < world:
                sizes[min(n - 1, r * n // world)] -= 1
        new = dict(enumerate(sizes))
        changed, self._sizes = new != self._sizes, new
        if changed:
            for o in self.owners.values():
                o.scope()

    def _load_plan(self, now: float) -> Optional[Plan]:
        if now < self._next_plan:
            return None
        self._next_plan = now + 0.5
        raw = self.r.get(k_shard_plan(self.job))
        if raw is None:
            return None
        try:
            plan = Plan.from_bytes(raw)
        except ValueError as e:
            raise UsageError(
                f"job {self.job}: {k_shard_plan(self.job)} is not a plan ({e})",
                f"delete it to split the job anew: redis-cli DEL '{k_shard_plan(self.job)}'",
            ) from None
        if plan.shards != self.n:
            raise UsageError(
                f"job {self.job} is split into {plan.shards} shards ({k_shard_plan(self.job)}); this member "
                f"was started with --shard {self.member.shard}/{self.n}",
                f"start every member with the same N, or delete the plan to split the job anew: "
                f"redis-cli DEL '{k_shard_plan(self.job)}' (the shards' state is rebuilt)",
            )
        self.member.say(
            f"job {self.job}: split into {plan.shards} shards of {'/'.join(map(str, plan.sizes()))} ranks "
            f"({len(plan.comms)} communicators kept whole, {plan.cut} cut)"
        )
        return plan

    def _make_plan(self, now: float) -> None:
        """The reducer's first job: the partition, from the head of the job's stream (read, not
        consumed), once every rank the world size promises was seen or none came for a while."""
        world = max((i.world for i in self.infos.values()), default=-1)
        full = 0 < world <= len(self.infos)
        raw = [] if full else self.r.xrange(k_steps(self.job), min=self._plan_cursor, count=PLAN_SAMPLE)
        for eid, fields in raw:
            self._plan_cursor = "(" + eid.decode()
            data = (fields or {}).get(b"d")
            if peek_rank(data) in self.infos:  # a rank's first summary is all a plan needs of it
                continue
            try:
                rs = wire.decode_step(data, {}, set())
            except wire.WireError:
                continue
            if rs.job == self.job and rs.rank not in self.infos:
                self.infos[rs.rank] = rank_info(rs)
                self._grew = now
                world = max(world, rs.world_size)
                if 0 < world <= len(self.infos):
                    full = True
                    break
        if not self.infos or (not full and len(raw) == PLAN_SAMPLE):  # nothing yet, or more to read
            return
        if not full and now - self._grew < PLAN_WAIT_S:
            return
        plan = make_plan(self.infos.values(), self.n, world)
        self.r.set(k_shard_plan(self.job), plan.to_bytes(), nx=True)
        self._next_plan = 0.0

    def _place(self, rank: int, info: Optional[RankInfo]) -> int:
        """A rank the plan did not know: placed once for every router (HSETNX, the first wins)."""
        assert self.plan is not None
        s = self.plan.place(info or RankInfo(rank, "\0"))
        got = self.r.eval(_PLACE, 1, k_shard_extra(self.job), str(rank), str(s))
        try:
            s = int(got) if got is not None and 0 <= int(got) < self.n else s
        except ValueError:
            pass
        self.extra[rank] = s
        self._dirty, self._next_extra = True, 0.0  # sizes at the next poll, once for all placed by then
        return s

    def _refresh_extra(self, now: float) -> None:
        if now < self._next_extra:
            return
        self._next_extra = now + 2.0
        got: Dict[int, int] = {}
        for k, v in self.r.hgetall(k_shard_extra(self.job)).items():
            try:
                r, s = int(k), int(v)
            except ValueError:
                continue
            if 0 <= s < self.n:
                got[r] = s
        if got != self.extra or self._dirty:
            self.extra, self._dirty = got, False
            self._resize()

    def shard_of(self, rank: int, data: Optional[bytes]) -> int:
        assert self.plan is not None
        s = self.plan.of.get(rank)
        if s is None:
            s = self.extra.get(rank)
        if s is None:
            info = None
            try:
                info = rank_info(wire.decode_step(data, {}, set()))
            except wire.WireError:
                pass
            s = self._place(rank, info)
        return s

    # ---- the loop ------------------------------------------------------------------------------------

    def poll(self, now: float) -> int:
        self._leases(now)
        if self.plan is None:
            if self.reduce_lease.held:
                t0 = time.process_time()
                self._make_plan(now)
                self.member.stats.cpu_plan_s += time.process_time() - t0
            self.plan = self._load_plan(now)
            if self.plan is None:
                return 0
            self._resize()
        self._refresh_extra(now)
        n = 0
        t0 = time.process_time()
        n += self._route(now)
        t1 = time.process_time()
        self.member.stats.cpu_route_s += t1 - t0
        for s in sorted(self.shard_leases):
            if self.shard_leases[s].held and s not in self.owners:
                o = self.owners[s] = ShardOwner(self, s)
                took = o.take_over()
                self.member.say(f"job {self.job}: judging shard {s} (took over {took} pending summaries)")
        for o in list(self.owners.values()):
            n += o.poll(now)
        t2 = time.process_time()
        self.member.stats.cpu_shard_s += t2 - t1
        if self.reduce_lease.held:
            if self.reducing is None:
                self.reducing = ReduceOwner(self)
                took = self.reducing.take_over(now)
                self.member.say(f"job {self.job}: reducing it (took over {took} pending partials)")
            n += self.reducing.poll(now)
        self.member.stats.cpu_reduce_s += time.process_time() - t2
        return n

    def _leases(self, now: float) -> None:
        m = self.member
        seasoned = now - m.started >= m.lease_s  # the other members' own shards were theirs to take first
        for s, lease in self.shard_leases.items():
            st = lease.tick(now, s == m.shard or seasoned)
            if st == "lost":
                self.owners.pop(s, None)
                m.say(f"job {self.job}: lost shard {s} (stalled past its {m.lease_s:g} s lease)")
        st = self.reduce_lease.tick(now, m.shard == 0 or seasoned)
        if st == "lost":
            self.reducing = None
            m.say(f"job {self.job}: lost the reduce step (stalled past its {m.lease_s:g} s lease)")

    def _route(self, now: float) -> int:
        n = 0
        got = self.steps_in.read(now)
        if got:
            pipe = self.r.pipeline(transaction=False)
            by: Dict[int, List[bytes]] = {}
            for _eid, fields in got:
                if not fields:  # trimmed away while pending
                    continue
                data = fields.get(b"d")
                rank = peek_rank(data)
                s = 0 if rank is None else self.shard_of(rank, data)  # malformed: a reader says so
                by.setdefault(s, []).append(data if isinstance(data, bytes) and len(fields) == 1 else b"")
            for s, bundle in by.items():  # one entry per shard and batch: Redis's work is per entry
                pipe.xadd(
                    k_shard_steps(self.job, s),
                    {b"b": msgpack.packb(bundle)},
                    maxlen=SHARD_MAXLEN,
                    approximate=True,
                )
            pipe.xack(self.steps_in.key, self.steps_in.group, *[eid for eid, _f in got])
            pipe.execute()
            self.member.stats.routed += len(got)
            n += len(got)
        hbs = self.hb_in.read(now)
        if hbs:
            pipe = self.r.pipeline(transaction=False)
            for _eid, fields in hbs:
                if not fields:
                    continue
                for s in self._hb_shards(fields.get(b"d")):
                    pipe.xadd(k_shard_hb(self.job, s), fields, maxlen=HB_MAXLEN, approximate=True)
            pipe.xack(self.hb_in.key, self.hb_in.group, *[eid for eid, _f in hbs])
            pipe.execute()
            self.member.stats.routed_hb += len(hbs)
            n += len(hbs)
        return n

    def _hb_shards(self, data: Any) -> Set[int]:
        """A heartbeat goes to the shards of its ranks (a host's ranks are one shard's)."""
        assert self.plan is not None
        try:
            hb = wire.decode_heartbeat(data)
        except wire.WireError:
            return {0}  # shard 0's owner counts it as rejected
        out = {self.plan.of.get(r, self.extra.get(r, -1)) for r in hb.ranks}
        for r in [r for r in hb.ranks if self.plan.of.get(r, self.extra.get(r, -1)) < 0]:
            out.add(self._place(r, RankInfo(r, hb.host)))
        out.discard(-1)
        if not out:
            out = {self.plan.hosts.get(hb.host, 0)}
        return out

    def publish(self, alerts: List[Alert]) -> None:
        if alerts:
            publish_alerts(self.r, alerts)
            self.member.stats.published += len(alerts)
            if self.member.on_alert is not None:
                for a in alerts:
                    self.member.on_alert(a)

    def leases(self) -> List[Lease]:
        return [*self.shard_leases.values(), self.reduce_lease]

    def stop(self) -> None:
        """A clean exit: the leases go at once, so the others take over without waiting them out."""
        for lease in self.leases():
            lease.release()


class Member:
    """`argus aggregate --shard I/N`: member I of N for every job it serves."""

    def __init__(
        self,
        client: Any,
        shard: int,
        shards: int,
        thresholds: Optional[Thresholds] = None,
        phases: Optional[PhaseInfo] = None,
        jobs: Optional[List[str]] = None,
        group: str = "argus-aggregate",
        consumer: Optional[str] = None,
        count: int = 1024,
        lease_s: float = 10.0,
        on_alert: Optional[Callable[[Alert], None]] = None,
        on_notice: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.r = client
        self.shard, self.shards = shard, shards
        self.th = thresholds or Thresholds()
        self.info = phases or PhaseInfo({})
        self.fixed_jobs = jobs
        self.group = group
        self.consumer = consumer or f"{socket.gethostname()}:{os.getpid()}:{shard}/{shards}"
        self.count = count
        self.lease_s = lease_s
        self.on_alert = on_alert
        self.on_notice = on_notice
        self.started = time.monotonic()
        self.stats = MemberStats()
        self.members: Dict[str, JobMember] = {}
        self._next_jobs = 0.0
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None

    def _renew(self) -> None:
        """Every third of a lease, extend the leases held (see `Lease`); Redis errors are the loop's
        to say: the next round tries again."""
        while not self._stop.wait(self.lease_s / 3):
            for jm in list(self.members.values()):
                for lease in jm.leases():
                    try:
                        lease.renew()
                    except Exception:  # redis errors, without importing redis at module load
                        pass

    def say(self, line: str) -> None:
        if self.on_notice is not None:
            self.on_notice(line)

    def jobs(self) -> List[str]:
        if self.fixed_jobs:
            return self.fixed_jobs
        now = time.monotonic()
        if now >= self._next_jobs:
            self._next_jobs = now + 5.0
            for j in list_jobs(self.r):
                self.members.setdefault(j, JobMember(self, j))
        return sorted(self.members)

    def poll(self, idle_ms: int = 50) -> int:
        """One round over the jobs; sleeps `idle_ms` when there was nothing to do. Returns entries."""
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew, name="argus-leases", daemon=True)
            self._renewer.start()
        t0 = time.process_time()
        n = 0
        try:
            for job in self.jobs():
                jm = self.members.get(job)
                if jm is None:
                    jm = self.members[job] = JobMember(self, job)
                n += jm.poll(time.monotonic())
        except Exception as e:  # redis errors, without importing redis at module load
            if type(e).__module__.startswith("redis"):
                raise RedisUnavailable(
                    f"lost Redis: {e}",
                    connection_hint(e, None, "is redis-server running? the members resume on restart"),
                ) from None
            raise
        self.stats.cpu_s += time.process_time() - t0
        if n == 0:
            time.sleep(idle_ms / 1000)
        return n

    def run(self, duration: Optional[float] = None, stop: Callable[[], bool] = lambda: False) -> MemberStats:
        end = None if duration is None else time.monotonic() + duration
        try:
            while not stop() and (end is None or time.monotonic() < end):
                self.poll()
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        """Stop renewing and give the leases up (a clean exit: the others take over at once)."""
        self._stop.set()
        for jm in self.members.values():
            try:
                jm.stop()
            except Exception:  # exiting anyway: the leases then lapse by themselves
                pass
