"""Feed a JobView from Redis without a consumer group: tail the job's step and alert streams.

`top`, `report` and the Prometheus exporter are readers that must not take entries away from the
aggregators, so they read with XRANGE/XREAD (entries stay for the aggregators' consumer group).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Dict, List, Optional

import msgpack

from argus.errors import RedisUnavailable
from argus.reader import Reader, notices
from argus.redisconf import connection_hint
from argus.rediskeys import k_alerts, k_steps
from argus.schema import RankStep
from argus.tui.snapshot import JobSnapshot, JobView


def decode_alert(fields: Dict[bytes, bytes]) -> Optional[dict]:
    """An alert entry as JSON (msgpack or JSON payload); anything malformed is skipped."""
    raw = fields.get(b"d") or fields.get(b"json") or fields.get(b"alert")
    if raw is None or len(raw) > 1 << 20:
        return None
    try:
        obj = json.loads(raw) if raw[:1] in (b"{", b"[") else msgpack.unpackb(raw, raw=False, max_ext_len=0)
    except Exception:  # hostile or foreign data: skip it
        return None
    if isinstance(obj, dict) and isinstance(obj.get("id"), str) and isinstance(obj.get("kind"), str):
        return obj
    return None


class Feed:
    """Keeps a JobView up to date from Redis in a background thread; `snapshot()` is thread-safe."""

    def __init__(self, client: Any, job: str, expected: Optional[int] = None, backlog: int = 20_000) -> None:
        self.r = client
        self.job = job
        self.view = JobView(job, expected)
        self.reader = Reader(client, job)  # only for validation and kernel names; never XREADGROUP here
        self.backlog = backlog
        self.last_step_id: Optional[bytes] = None
        self.last_alert_id = b"0-0"
        self.lock = threading.Lock()
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._snap: Optional[JobSnapshot] = None
        self._notices: List[str] = []

    def poll(self, block_ms: int = 500) -> int:
        """Read what is new once; returns the number of summaries ingested."""
        import redis

        try:
            if self.last_step_id is None:
                raw = list(reversed(self.r.xrevrange(k_steps(self.job), count=self.backlog)))
            else:
                got = self.r.xread({k_steps(self.job): self.last_step_id}, count=5000, block=block_ms)
                raw = got[0][1] if got else []
            if raw:
                self.last_step_id = raw[-1][0]
            elif self.last_step_id is None:
                self.last_step_id = b"0-0"
            msgs = self.reader._accept(raw, ack=False)
            alerts = self.r.xrange(k_alerts(self.job), min=b"(" + self.last_alert_id, count=1000)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"lost Redis: {e}", connection_hint(e)) from None
        with self.lock:
            for m in msgs:
                self.view.ingest(m.step)
            for eid, fields in alerts:
                self.last_alert_id = eid
                a = decode_alert(fields or {})
                if a is not None:
                    self.view.ingest_alert(a)
            self._snap = self.view.snapshot()
            self._notices = notices(self.reader.stats, self.job)  # the stats change in this thread only
        return len(msgs)

    def notices(self) -> List[str]:
        """Entries skipped as malformed or carrying a newer agent's fields (argus.reader.notices)."""
        with self.lock:
            return list(self._notices)

    def snapshot(self) -> JobSnapshot:
        with self.lock:
            if self._snap is None:
                self._snap = self.view.snapshot()
            return self._snap

    def last(self, rank: int) -> Optional[RankStep]:
        with self.lock:
            st = self.view.ranks.get(rank)
            return st.last if st else None

    def run(self, interval: float = 0.5) -> threading.Thread:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll(block_ms=int(interval * 1000))
                    self.error = None
                except RedisUnavailable as e:
                    self.error = e.message
                    time.sleep(1.0)

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        return th

    def stop(self) -> None:
        self._stop.set()


def detail(rs: RankStep) -> dict:
    """The drill-down of one rank's last summary, as short strings."""
    colls = []
    for c in rs.comms.values():
        per: Dict[str, List[int]] = {}
        for op, b in zip(c.ops, c.nbytes):
            per.setdefault(op, [0, 0])
            per[op][0] += 1
            per[op][1] += b
        for op, (n, b) in per.items():
            colls.append(f"{op} ×{n} {b / 2**20:.0f} MB on {c.comm[:8]} ({c.nranks} ranks)")
    kernels = ", ".join(f"{k} ×{v}" for k, v in sorted(rs.kernels.items(), key=lambda kv: -kv[1])[:8])
    phases = ", ".join(f"{k} {v / 1e6:.1f} ms" for k, v in rs.phases.items())
    errors = ", ".join(f"{call}={code}×{n}" for call, codes in rs.errors.items() for code, n in codes.items())
    return {
        "rank": rs.rank,
        "step": rs.step,
        "phases": phases,
        "collectives": "; ".join(colls[:6]),
        "kernels": kernels,
        "errors": errors,
    }
