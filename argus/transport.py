"""Publishing summaries to Redis without ever slowing the agent's loop (docs/schema.md, "Transport").

`Publisher.publish_step()` encodes a RankStep and appends it to a bounded in-memory buffer; that is
all the caller pays (tens to a few hundred µs of encoding, no I/O, no waiting on a lock that I/O
holds). A background thread drains the buffer with pipelined ``XADD ... MAXLEN ~`` (plus the
kernel-name table, the agent registry and heartbeats), reconnecting with capped exponential
backoff when Redis is down or slow. When the buffer is full the oldest entry is dropped and
counted: ``enqueued == published + dropped_oldest + dropped_exit + buffer_len`` at any time
(`dropped_exit`: still buffered when `close()` gave up). A batch whose pipeline failed midway may
have been applied in part, so it is never dropped: it waits in a retry slot (one batch, outside
the bounded buffer) and is sent again first — and stays there if the server then refuses it
(e.g. LOADING after a restart), since the first attempt's outcome is still unknown — which makes
`dropped_oldest` exactly the entries Redis never saw; a reader can then see an entry twice
(`argus.reader` drops such duplicates).
Only at exit can an unconfirmed batch be given up (counted in `dropped_exit` and `unconfirmed`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import msgpack

from argus import __version__, redisconf, wire
from argus.redisconf import RedisConf
from argus.rediskeys import K_JOBS, k_agent, k_agents, k_hb, k_names, k_steps
from argus.schema import Heartbeat, RankStep

HB_INTERVAL_S = 2.0
AGENT_TTL_S = 10  # the liveness key outlives 4 missed heartbeats
STEPS_MAXLEN = 100_000  # per job; size it as ranks × steps of backlog the aggregators may need
HB_MAXLEN = 1_000
MAX_NAMES = 100_000  # distinct kernel names remembered per agent (more are sent inline)


Entry = Tuple[str, bytes]  # (job, encoded step)


def write_steps(pipe: Any, entries: List[Entry], maxlen: int) -> None:
    """Queue one XADD per entry on a redis-py pipeline (shared with `argus replay`)."""
    for job, data in entries:
        pipe.xadd(k_steps(job), {b"d": data}, maxlen=maxlen, approximate=True)


def write_names(pipe: Any, names: List[Tuple[str, int, str]]) -> None:
    for job, nid, name in names:
        pipe.hsetnx(k_names(job), str(nid), name)


def registry_record(hb: Heartbeat, started_ns: int, state: str = "live") -> bytes:
    rec = {
        "v": 1,
        "host": hb.host,
        "pid": os.getpid(),
        "ranks": hb.ranks,
        "started_ns": started_ns,
        "ts_ns": hb.ts_ns,
        "state": state,
        "argus": __version__,
    }
    return msgpack.packb(rec, use_bin_type=True)  # type: ignore[no-any-return]


class Publisher:
    """Bounded, non-blocking publisher of one agent's summaries and heartbeats."""

    def __init__(
        self,
        conf: RedisConf,
        agent: str,
        *,
        buffer_max: int = 10_000,
        buffer_bytes_max: int = 64 << 20,
        maxlen: int = STEPS_MAXLEN,
        batch: int = 256,
        timeout_s: float = 2.0,
        backoff_s: Tuple[float, float] = (0.1, 5.0),
        client_factory: Optional[Callable[[], Any]] = None,
        on_event: Optional[Callable[[str], None]] = None,
    ) -> None:
        if buffer_max < 1 or buffer_bytes_max < 1 or maxlen < 1 or batch < 1:
            raise ValueError("buffer_max, buffer_bytes_max, maxlen and batch must be >= 1")
        self.conf, self.agent = conf, agent
        self.buffer_max, self.buffer_bytes_max = buffer_max, buffer_bytes_max
        self.maxlen, self.batch, self.backoff_s = maxlen, batch, backoff_s
        self._factory = client_factory or (lambda: conf.client(timeout_s))
        self._on_event = on_event or (lambda _msg: None)
        self._lock = threading.Lock()  # never held during I/O
        self._wake = threading.Event()  # set by publish_*: work to send (cleared before taking it)
        self._stop = threading.Event()  # set by close(): end backoff sleeps early
        self._buf: Deque[Entry] = deque()
        self._retry: List[Entry] = []  # the batch whose pipeline failed: outcome unknown, sent again first
        self._buf_bytes = 0
        self._names: Dict[Tuple[str, int], str] = {}  # every (job, id) ever queued: re-sent on reconnect
        self._names_pending: List[Tuple[str, int, str]] = []
        self._verify: List[Tuple[str, int, str]] = []  # HSETNX found the id taken: compare names
        self._inline: Set[str] = set()  # names sent inline (their id collides)
        self._bad_reasons: Set[str] = set()
        self._hb: Dict[str, Tuple[bytes, bytes]] = {}  # job -> (heartbeat, registry record), latest only
        self._jobs: Set[str] = set()
        self._client: Any = None
        self._closing = False
        self._deadline = 0.0
        self.started_ns = time.time_ns()
        self.c: Dict[str, int] = dict.fromkeys(
            (
                "enqueued",
                "published",
                "dropped_oldest",
                "dropped_exit",
                "send_errors",
                "encode_errors",
                "reconnects",
                "heartbeats",
                "name_collisions",
                "unconfirmed",
                "buffer_peak",
            ),
            0,
        )
        self.connected = False
        self._ever_connected = False
        self.last_error = ""
        self._refusing = ""  # the reason Redis gave for refusing the last batch, "" when it took it
        self._last_hb: Dict[str, Heartbeat] = {}
        self._thread = threading.Thread(target=self._run, name="argus-redis", daemon=True)

    # ---- the caller's side: O(1), never blocks on Redis ----------------------------------------------

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def publish_step(self, rs: RankStep) -> bool:
        """Encode and buffer one summary. False when it could not be encoded (counted)."""
        job = rs.job
        with self._lock:
            inline = {n for n in rs.kernels if n in self._inline}
            for name in rs.kernels:
                nid = wire.name_id(name)
                known = self._names.get((job, nid))
                if known is not None and known != name:
                    self._inline.add(name)
                    inline.add(name)
        try:
            data = wire.encode_step(rs, inline)
            wire.decode_step(data)  # never publish what a reader would reject (27-80 µs)
        except (wire.WireError, ValueError, TypeError, OverflowError) as e:
            reason = getattr(e, "reason", type(e).__name__)
            with self._lock:
                self.c["encode_errors"] += 1
                first = reason not in self._bad_reasons
                self._bad_reasons.add(reason)
            if first:  # once per reason: say what is wrong, then only count
                self._on_event(f"redis: not publishing rank {rs.rank} step {rs.step}: {e} (counted)")
            return False
        with self._lock:
            for nid, name in wire.step_names(rs, inline).items():
                if (job, nid) not in self._names and len(self._names) < MAX_NAMES:
                    self._names[(job, nid)] = name
                    self._names_pending.append((job, nid, name))
            self._jobs.add(job)
            self.c["enqueued"] += 1
            self._buf.append((job, data))
            self._buf_bytes += len(data)
            self._trim()
        self._wake.set()
        return True

    def publish_heartbeat(self, hb: Heartbeat) -> None:
        """Replace the pending heartbeat of hb.job (only the latest one is worth sending)."""
        hb.health = {**hb.health, **self.stats()}
        data = wire.encode_heartbeat(hb)
        rec = registry_record(hb, self.started_ns)
        with self._lock:
            self._hb[hb.job] = (data, rec)
            self._last_hb[hb.job] = hb
            self._jobs.add(hb.job)
        self._wake.set()

    def _trim(self) -> None:  # with the lock held
        while self._buf and (len(self._buf) > self.buffer_max or self._buf_bytes > self.buffer_bytes_max):
            _, old = self._buf.popleft()
            self._buf_bytes -= len(old)
            self.c["dropped_oldest"] += 1
        self.c["buffer_peak"] = max(self.c["buffer_peak"], len(self._buf))

    def stats(self) -> Dict[str, int]:
        with self._lock:
            out = dict(self.c)
            out["buffer_len"] = len(self._buf) + len(self._retry)
            out["buffer_max"] = self.buffer_max
            out["connected"] = int(self.connected)
        return out

    def summary(self) -> str:
        s = self.stats()
        state = "connected" if s["connected"] else "DISCONNECTED"
        text = (
            f"redis {self.conf.display} {state}: published {s['published']}, "
            f"dropped {s['dropped_oldest'] + s['dropped_exit']} (oldest {s['dropped_oldest']}, at exit "
            f"{s['dropped_exit']}), send errors {s['send_errors']}, reconnects {s['reconnects']}, "
            f"buffer {s['buffer_len']}/{s['buffer_max']} (peak {s['buffer_peak']})"
        )
        if s["unconfirmed"]:
            text += f", {s['unconfirmed']} of those dropped at exit were sent unconfirmed (may have arrived)"
        if s["encode_errors"]:
            text += f", encode errors {s['encode_errors']}"
        return text

    def close(self, timeout_s: float = 3.0) -> Dict[str, int]:
        """Send what can be sent within `timeout_s`, then stop; what is left counts as dropped_exit."""
        with self._lock:
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 5.0)
        if not self._thread.is_alive():
            for hb in list(self._last_hb.values()):
                self._goodbye(hb)
        with self._lock:
            self.c["dropped_exit"] += len(self._buf) + len(self._retry)
            self.c["unconfirmed"] += len(self._retry)
            self._retry = []
            self._buf.clear()
            self._buf_bytes = 0
        return self.stats()

    # ---- the sender thread ---------------------------------------------------------------------------

    def _done(self) -> bool:
        with self._lock:
            if not self._closing:
                return False
            idle = not self._buf and not self._retry and not self._hb and not self._names_pending
            return idle or time.monotonic() >= self._deadline

    def _connect(self) -> None:
        client = self._factory()
        client.ping()
        self._client = client
        with self._lock:
            self.connected = True
            # the server may have restarted empty: every name goes again (HSETNX keeps what exists)
            self._names_pending = [(j, i, n) for (j, i), n in self._names.items()]
            if self._ever_connected:
                self.c["reconnects"] += 1
            self._ever_connected = True
        self._on_event(f"redis: connected to {self.conf.display}")

    def _drop_client(self, err: BaseException) -> None:
        msg = f"{type(err).__name__}: {err}"[:200]
        with self._lock:
            was = self.connected
            self.connected = False
            self.last_error = msg
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        self._client = None
        if was:
            self._on_event(f"redis: lost connection to {self.conf.display} ({msg}); buffering")

    def _sleep(self, seconds: float) -> None:
        """Backoff. Never a wait on `_wake`: publish() keeps setting it, and a thread spinning on a set
        event holds the GIL in 5 ms slices, starving the probe loop (seen: seconds-long stalls)."""
        if not self._stop.is_set():
            self._stop.wait(seconds)
            return
        with self._lock:  # closing: retry until the deadline, without spinning
            left = self._deadline - time.monotonic()
        time.sleep(max(0.0, min(seconds, left)))

    def _run(self) -> None:
        import redis

        backoff = self.backoff_s[0]
        while not self._done():
            if self._client is None:
                try:
                    self._connect()
                    backoff = self.backoff_s[0]
                except (redis.RedisError, OSError) as e:
                    if not self.last_error:
                        # a TLS mistake will not heal by retrying: say its fix (tracing goes on regardless)
                        fix = redisconf.connection_hint(e, self.conf.scheme, "")
                        self._on_event(
                            f"redis: cannot reach {self.conf.display} ({e}); buffering, retrying"
                            + (f"; hint: {fix}" if fix else "")
                        )
                    self._drop_client(e)
                    self._sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2.0, self.backoff_s[1])
                    continue
            self._wake.clear()  # before taking: a publish() from now on wakes the wait below
            with self._lock:
                unknown = bool(self._retry)  # a batch Redis may have applied in part before
                if unknown:
                    batch, self._retry = self._retry, []
                else:
                    n = min(self.batch, len(self._buf))
                    batch = [self._buf.popleft() for _ in range(n)]
                    self._buf_bytes -= sum(len(d) for _, d in batch)
                names, self._names_pending = self._names_pending, []
                verify, self._verify = self._verify, []
                hbs = dict(self._hb)
            if not batch and not names and not verify and not hbs:
                self._wake.wait(0.2)
                continue
            try:
                failed = self._send(batch, names, verify, hbs)
            except (redis.RedisError, OSError) as e:
                with self._lock:  # Redis may have applied part of it: never drop it, send it again
                    self._retry = batch
                self._requeue([], names, verify)
                with self._lock:
                    self.c["send_errors"] += 1
                self._drop_client(e)
                self._sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2.0, self.backoff_s[1])
                continue
            self._say_refusals(failed)
            if failed and unknown:
                # refused now (e.g. LOADING after a restart), but the first, broken attempt may have
                # applied them: still unknown, so they stay in the retry slot and are never dropped
                with self._lock:
                    self._retry = failed
                self._sleep(backoff)
                backoff = min(backoff * 2.0, self.backoff_s[1])
            elif failed:  # refused (e.g. OOM), so certainly not applied: back to the buffer's front
                self._requeue(failed, [], [])
                self._sleep(backoff)
                backoff = min(backoff * 2.0, self.backoff_s[1])
            else:
                backoff = self.backoff_s[0]

    def _say_refusals(self, failed: List[Entry]) -> None:
        """Once per reason: Redis refuses writes (OOM under maxmemory, READONLY replica, ACL), and
        when it accepts them again; the counters carry the rest."""
        reason = self.last_error if failed else ""
        if reason == self._refusing:
            return
        if reason:
            self._on_event(f"redis: {self.conf.display} refuses summaries ({reason}); buffering, retrying")
        else:
            self._on_event(f"redis: {self.conf.display} accepts summaries again")
        self._refusing = reason

    def _requeue(
        self, batch: List[Entry], names: List[Tuple[str, int, str]], verify: List[Tuple[str, int, str]]
    ) -> None:
        with self._lock:
            self._buf.extendleft(reversed(batch))
            self._buf_bytes += sum(len(d) for _, d in batch)
            self._names_pending = names + self._names_pending
            self._verify = verify + self._verify
            self._trim()

    def _send(
        self,
        batch: List[Entry],
        names: List[Tuple[str, int, str]],
        verify: List[Tuple[str, int, str]],
        hbs: Dict[str, Tuple[bytes, bytes]],
    ) -> List[Entry]:
        """One pipeline; returns the entries Redis refused (to retry). Raises on connection errors."""
        import redis

        pipe = self._client.pipeline(transaction=False)
        write_names(pipe, names)
        for job, nid, _ in verify:
            pipe.hget(k_names(job), str(nid))
        write_steps(pipe, batch, self.maxlen)
        for job, (data, rec) in hbs.items():
            pipe.set(k_agent(job, self.agent), data, ex=AGENT_TTL_S)
            pipe.hset(k_agents(job), self.agent, rec)
            pipe.sadd(K_JOBS, job)
            pipe.xadd(k_hb(job), {b"d": data}, maxlen=HB_MAXLEN, approximate=True)
        res = pipe.execute(raise_on_error=False)
        for r in res:  # a broken connection mid-pipeline comes back as an exception object
            if isinstance(r, (redis.ConnectionError, redis.TimeoutError, OSError)):
                raise r
        i = 0
        retry_names = []
        for item, r in zip(names, res[: len(names)]):
            if isinstance(r, Exception):
                retry_names.append(item)
            elif r == 0:
                self._verify.append(item)
        i += len(names)
        for _job, _nid, name in verify:
            got = res[i]
            i += 1
            if isinstance(got, bytes) and got.decode("utf-8", "replace") != name:
                with self._lock:
                    self._inline.add(name)
                    self.c["name_collisions"] += 1
        failed: List[Entry] = []
        for entry, r in zip(batch, res[i : i + len(batch)]):
            if isinstance(r, Exception):
                failed.append(entry)
                self.last_error = f"{type(r).__name__}: {r}"[:200]
        i += len(batch)
        with self._lock:
            self.c["published"] += len(batch) - len(failed)
            if failed:
                self.c["send_errors"] += 1
            self._names_pending = retry_names + self._names_pending
            for job, (data, _rec) in hbs.items():
                if self._hb.get(job, (None,))[0] is data:
                    del self._hb[job]
            self.c["heartbeats"] += len(hbs)
        return failed

    def _goodbye(self, hb: Heartbeat) -> None:
        """On a clean exit: drop the liveness key, mark the registry record exited (best effort, 1 s)."""
        if self._client is None:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(k_agent(hb.job, self.agent))
            pipe.hset(k_agents(hb.job), self.agent, registry_record(hb, self.started_ns, "exited"))
            pipe.execute()
        except Exception:  # best effort: the TTL ends the key anyway
            pass
