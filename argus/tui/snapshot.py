"""What `argus top` shows, as immutable snapshots built from step summaries and alerts (pure).

`JobView` ingests RankSteps (any order across ranks) and alert JSON; `snapshot()` returns a frozen
`JobSnapshot` the renderer draws. Arrival lateness is computed per step once every expected rank
reported it (or a later step arrived), with the aggregator's own alignment code, and kept as a
rolling median per rank: the rank everyone waits for sorts to the top.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from argus.aggregator.align import JobAlign
from argus.aggregator.ranks import arrival_lateness
from argus.aggregator.state import Groups
from argus.gpu import BENIGN_REASONS, throttle_names
from argus.schema import RankStep

WINDOW = 10  # steps of rolling lateness per rank
SPARK = 40  # steps in the step-time sparkline
# job step-time histogram bounds (s): 10 ms to 2 min, roughly x2 apart
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# phase buckets shown as a bar, in this order (named phases come from the Python channel)
BUCKETS = ("data", "forward", "backward", "optimizer", "comm", "other")


@dataclass(frozen=True)
class RankRow:
    rank: int
    host: str
    pid: int
    step: int
    step_ns: int
    buckets: Tuple[Tuple[str, int], ...]  # (bucket, ns) in BUCKETS order
    late_ns: float  # rolling median arrival lateness vs the group median (ns)
    last_share: float  # fraction of recent collectives at which this rank arrived last
    top_coll: str
    launches_per_s: float
    drops: int
    timers_ms: Tuple[float, ...] = ()  # the GPU timings the process read (cuEventElapsedTime)
    gpu: Tuple[str, ...] = ()  # NVML's latest sample of its device, as short cells (gpu_cells)
    gpu_values: Tuple[Tuple[str, float], ...] = ()  # ... and its numbers (RankStep.gpu), for metrics
    state: str = "ok"  # ok | straggler | hung | stalled | gone
    alert: str = ""  # summary of the alert naming this rank
    coll_ns: int = 0  # host time inside NCCL calls in the step (waits included)


def gpu_cells(g: Dict[str, float]) -> Tuple[str, ...]:
    """SM clock, utilisation, power, temperature, and what is wrong (non-benign throttle reasons,
    XIDs): what an on-call engineer reads first about a GPU."""
    if not g:
        return ()
    out = []
    for key, unit in (("sm_mhz", "MHz"), ("util_pct", "%"), ("power_w", "W"), ("temp_c", "°C")):
        if key in g:
            out.append(f"{g[key]:.0f}{unit}")
    out += throttle_names(int(g.get("throttle", 0)) & ~BENIGN_REASONS)
    if g.get("xids"):
        out.append(f"XID {g.get('xid', 0):.0f}")
    return tuple(out)


@dataclass(frozen=True)
class JobSnapshot:
    job: str
    ranks_seen: int
    ranks_expected: int
    step: int
    step_times: Tuple[float, ...]  # recent job step times (s), oldest first
    l1: str  # steady | spike | regression
    rows: Tuple[RankRow, ...]
    alerts: Tuple[dict, ...]  # firing alerts (JSON), most severe first
    taken_ns: int
    # cumulative histogram of job step times since this view started (Prometheus semantics):
    # counts per STEP_BUCKETS upper bound (non-cumulative here), their sum and count
    step_hist: Tuple[int, ...] = ()
    step_sum: float = 0.0


def bucket_phases(phases: Dict[str, int], step_ns: int) -> Dict[str, int]:
    """Fold a summary's phases into display buckets.

    Named phases (from the Python channel) map by name into data / forward / backward / optimizer /
    comm / other. Without them only the host split is honest: `host_wait` (blocked on the GPU) and
    `host` (the rest). GPU timers (`timer<k>`) overlap each other and the wait, so they are shown
    separately, not stacked.
    """
    named = {k: v for k, v in phases.items() if not k.startswith(("timer", "host_"))}
    if not named:
        wait = phases.get("host_wait", 0)
        return {"host": max(0, step_ns - wait), "host_wait": wait}
    out = dict.fromkeys(BUCKETS, 0)
    for name, ns in named.items():
        low = name.lower()
        if "data" in low or "load" in low:
            out["data"] += ns
        elif "forward" in low:
            out["forward"] += ns
        elif "backward" in low:
            out["backward"] += ns
        elif "optim" in low or low.endswith("step"):
            out["optimizer"] += ns
        elif "comm" in low or "sync" in low or "allreduce" in low:
            out["comm"] += ns
        else:
            out["other"] += ns
    return {k: v for k, v in out.items() if v}


@dataclass
class _Rank:
    last: Optional[RankStep] = None
    late: Deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    lasts: Deque[Tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (arrived last, n)
    launches: Deque[Tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (launches, ns)
    drops: int = 0  # records its agent lost, over every summary seen


class JobView:
    def __init__(self, job: str, expected: Optional[int] = None, lag_steps: int = 2) -> None:
        self.job = job
        self.expected = expected
        self.lag = lag_steps
        self.ranks: Dict[int, _Rank] = {}
        self.pending: Dict[int, Dict[int, RankStep]] = {}  # step -> rank -> summary
        self.groups = Groups(min_group=2)
        self.step_times: Deque[Tuple[int, float]] = deque(maxlen=SPARK)
        self.alerts: Dict[str, dict] = {}
        self.max_step = -1
        self.step_hist = [0] * (len(STEP_BUCKETS) + 1)  # last slot: above the largest bound
        self.step_sum = 0.0
        self.align = JobAlign()  # ranks attached at other times onto the job's steps (as the aggregator)

    def ingest(self, rs: RankStep) -> None:
        if rs.job != self.job or rs.step is None:
            return
        for x in self.align.add(rs):
            self._ingest(x)

    def _ingest(self, rs: RankStep) -> None:
        assert rs.step is not None
        r = self.ranks.setdefault(rs.rank, _Rank())
        if r.last is None or (rs.step >= (r.last.step or 0)):
            r.last = rs
        r.drops += sum(rs.drops.values())
        if rs.launches_sampled:  # launches/s over the steps the launch probes covered
            r.launches.append((rs.launches, rs.duration_ns))
        self.groups.observe(rs)
        self.pending.setdefault(rs.step, {})[rs.rank] = rs
        self.max_step = max(self.max_step, rs.step)
        self._close_steps()

    def ingest_alert(self, alert: dict) -> None:
        if alert.get("job") != self.job:
            return
        if alert.get("state") == "resolved":
            self.alerts.pop(alert["id"], None)
        else:
            self.alerts[alert["id"]] = alert

    def _close_steps(self) -> None:
        want = self.expected or len(self.ranks)
        for step in sorted(self.pending):
            got = self.pending[step]
            if len(got) < want and step > self.max_step - self.lag:
                break
            del self.pending[step]
            t = max(rs.duration_ns for rs in got.values()) / 1e9
            self.step_times.append((step, t))
            self.step_hist[next((i for i, b in enumerate(STEP_BUCKETS) if t <= b), len(STEP_BUCKETS))] += 1
            self.step_sum += t
            for rank, (late, n, last, _peak) in arrival_lateness(got, self.groups).items():
                st = self.ranks.get(rank)
                if st is not None and n:
                    st.late.append(late)
                    st.lasts.append((last, n))

    def snapshot(self) -> JobSnapshot:
        flagged: Dict[int, Tuple[str, str]] = {}
        for a in sorted(self.alerts.values(), key=lambda a: a.get("first_seen", 0)):
            state = {
                "straggler": "straggler",
                "pipeline_bubble": "straggler",
                "hang": "hung",
                "host_stall": "stalled",
            }.get(a.get("kind", ""), "")
            for rk in a.get("ranks", []):
                if state:
                    flagged[rk] = (state, a.get("summary", a.get("kind", "")))
        rows = []
        for rank, st in self.ranks.items():
            rs = st.last
            if rs is None:
                continue
            late = statistics.median(st.late) if st.late else 0.0
            nlast = sum(x for x, _ in st.lasts)
            n = sum(y for _, y in st.lasts)
            launches = sum(x for x, _ in st.launches)
            dur = sum(y for _, y in st.launches)
            state, why = flagged.get(rank, ("ok", ""))
            rows.append(
                RankRow(
                    rank=rank,
                    host=rs.host,
                    pid=rs.pid,
                    step=rs.step or 0,
                    step_ns=rs.duration_ns,
                    buckets=tuple(bucket_phases(rs.py_phases or rs.phases, rs.duration_ns).items()),
                    late_ns=late,
                    last_share=nlast / n if n else 0.0,
                    top_coll=_top_coll(rs),
                    launches_per_s=launches / (dur / 1e9) if dur else 0.0,
                    drops=st.drops,
                    timers_ms=tuple(v / 1e6 for k, v in sorted(rs.phases.items()) if k.startswith("timer")),
                    state=state,
                    alert=why,
                    coll_ns=_coll_ns(rs),
                    gpu=gpu_cells(rs.gpu),
                    gpu_values=tuple(sorted(rs.gpu.items())),
                )
            )
        kinds = {a.get("kind") for a in self.alerts.values()}
        l1 = "regression" if "step_regression" in kinds else "spike" if "step_spike" in kinds else "steady"
        sev = {"critical": 0, "warning": 1, "info": 2}
        alerts = tuple(
            sorted(
                self.alerts.values(),
                key=lambda a: (sev.get(a.get("severity", ""), 3), -a.get("last_seen", 0)),
            )
        )
        return JobSnapshot(
            job=self.job,
            ranks_seen=len(rows),
            ranks_expected=self.expected or len(rows),
            step=max((r.step for r in rows), default=-1),
            step_times=tuple(t for _, t in self.step_times),
            l1=l1,
            rows=tuple(rows),
            alerts=alerts,
            taken_ns=time.time_ns(),
            step_hist=tuple(self.step_hist),
            step_sum=self.step_sum,
        )


def _coll_ns(rs: RankStep) -> int:
    return sum(sum(c.host_ns) + sum(p.host_ns for p in c.p2p) for c in rs.comms.values())


def _top_coll(rs: RankStep) -> str:
    best: Tuple[int, str] = (0, "-")
    for c in rs.comms.values():
        per: Dict[str, int] = {}
        for op, b in zip(c.ops, c.nbytes):
            per[op] = per.get(op, 0) + b
        for p in c.p2p:
            per[p.op] = per.get(p.op, 0) + p.nbytes
        for op, b in per.items():
            if b > best[0]:
                best = (b, f"{op} {b / 2**20:.0f} MB")
    return best[1]


def sort_rows(rows: Tuple[RankRow, ...], key: str = "late") -> List[RankRow]:
    """What matters first: flagged ranks, then arrival lateness, then step time."""
    order = {"hung": 0, "straggler": 1, "stalled": 2, "ok": 3, "gone": 4}
    if key == "rank":
        return sorted(rows, key=lambda r: r.rank)
    if key == "step":
        return sorted(rows, key=lambda r: (-r.step_ns, r.rank))
    return sorted(rows, key=lambda r: (order.get(r.state, 5), -r.late_ns, -r.step_ns, r.rank))
