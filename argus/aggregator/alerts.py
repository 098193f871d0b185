"""Alerts (DESIGN §8): the JSON an on-call person and Alertmanager read, de-duplication and resolution.

An alert's `id` is stable: a hash of (job, kind, ranks — or the rank pair of a link —, comm), so
the same condition seen again updates one alert instead of raising a new one, and a condition that
clears and comes back re-fires the same id. Transitions (a new `firing`, a `resolved`) are what
is published; refreshes only move `last_seen`, `steps` and `evidence`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

ALERT_VERSION = 1
KINDS = (
    "straggler",
    "pipeline_bubble",
    "slow_link",
    "host_stall",
    "hang",
    "kernel_degradation",
    "step_spike",
    "step_regression",
    "gpu_throttle",
    "missing",
)
SEVERITY = {
    "hang": "critical",
    "straggler": "warning",
    "pipeline_bubble": "warning",
    "slow_link": "warning",
    "kernel_degradation": "warning",
    "step_regression": "warning",
    "gpu_throttle": "warning",
    "missing": "warning",
    "host_stall": "info",
    "step_spike": "info",
}


#: kinds that are one condition seen more precisely: the alert keeps its id when its kind is refined
FAMILY = {"pipeline_bubble": "straggler"}


def alert_id(
    job: str, kind: str, ranks: Iterable[int], comm: Optional[str], key: Optional[str] = None
) -> str:
    """`key`, when given, stands for the ranks: a condition of a thing whose ranks change while it
    lasts (a missing host's ranks come back one by one)."""
    fam = FAMILY.get(kind, kind)
    who = key if key is not None else ",".join(str(r) for r in sorted(ranks))
    key = "\0".join([job, fam, who, comm or ""])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class Alert:
    id: str
    kind: str
    severity: str
    job: str
    ranks: List[int]
    hosts: List[str]
    comm: Optional[str]
    op: Optional[str]
    steps: List[int]  # [first, last]
    evidence: Dict[str, Any]
    state: str  # firing | resolved
    first_seen: int  # realtime ns (of the data, not of the aggregator's clock)
    last_seen: int
    summary: str = ""
    resolved_at: Optional[int] = None
    version: int = ALERT_VERSION

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Alert:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def copy(self) -> Alert:
        return Alert.from_json(self.to_json())


@dataclass
class Finding:
    """What a level concluded at one step; the book turns findings into alerts."""

    kind: str
    ranks: List[int]
    steps: Tuple[int, int]
    summary: str
    evidence: Dict[str, Any] = field(default_factory=dict)
    comm: Optional[str] = None
    op: Optional[str] = None
    severity: Optional[str] = None
    key: Optional[str] = None  # the alert's identity instead of its ranks (see alert_id)


class AlertBook:
    """All alerts of the jobs one aggregator serves, with their firing/resolved state."""

    def __init__(self, resolve_after: int = 5) -> None:
        self.resolve_after = resolve_after
        self.alerts: Dict[str, Alert] = {}
        self.unseen: Dict[str, int] = {}

    def update(
        self,
        job: str,
        t_ns: int,
        findings: List[Finding],
        hosts: Dict[int, str],
        evaluated: Set[str],
        resolve_after: Optional[int] = None,
        held: Optional[Set[str]] = None,
    ) -> List[Alert]:
        """Apply one evaluation of the kinds in `evaluated`; return the transitions (copies). Alerts in
        `held` were not found again but their condition is not over: they do not count towards
        resolving."""
        out: List[Alert] = []
        seen: Set[str] = set()
        for f in findings:
            aid = alert_id(job, f.kind, f.ranks, f.comm, f.key)
            seen.add(aid)
            a = self.alerts.get(aid)
            if a is not None and a.state == "firing":
                if f.key is not None:
                    a.ranks = sorted(f.ranks)
                    a.hosts = sorted({hosts[r] for r in f.ranks if r in hosts})
                a.steps[1] = max(a.steps[1], f.steps[1])
                a.last_seen = t_ns
                a.evidence = f.evidence
                a.summary = f.summary
                a.kind = f.kind  # a straggler seen to hold up its pipeline peers becomes a pipeline_bubble
                a.severity = f.severity or SEVERITY.get(f.kind, a.severity)
                self.unseen[aid] = 0
                continue
            a = Alert(
                id=aid,
                kind=f.kind,
                severity=f.severity or SEVERITY.get(f.kind, "warning"),
                job=job,
                ranks=sorted(f.ranks),
                hosts=sorted({hosts[r] for r in f.ranks if r in hosts}),
                comm=f.comm,
                op=f.op,
                steps=[f.steps[0], f.steps[1]],
                evidence=f.evidence,
                state="firing",
                first_seen=t_ns,
                last_seen=t_ns,
                summary=f.summary,
            )
            self.alerts[aid] = a
            self.unseen[aid] = 0
            out.append(a.copy())
        limit = self.resolve_after if resolve_after is None else resolve_after
        for aid, a in self.alerts.items():
            if a.job != job or a.state != "firing" or aid in seen or a.kind not in evaluated:
                continue
            if held and aid in held:
                self.unseen[aid] = 0
                continue
            self.unseen[aid] = self.unseen.get(aid, 0) + 1
            if self.unseen[aid] >= limit:
                a.state = "resolved"
                a.resolved_at = t_ns
                out.append(a.copy())
        return out

    def firing(self, job: Optional[str] = None) -> List[Alert]:
        return [a for a in self.alerts.values() if a.state == "firing" and (job is None or a.job == job)]

    def all(self, job: Optional[str] = None) -> List[Alert]:
        return [a for a in self.alerts.values() if job is None or a.job == job]


# ---- Alertmanager ------------------------------------------------------------------------------------


def _rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def to_alertmanager(alerts: Iterable[Alert], generator_url: str = "") -> List[Dict[str, Any]]:
    """The body of a POST to Alertmanager's /api/v2/alerts (a list of postable alerts)."""
    out = []
    for a in alerts:
        labels = {
            "alertname": "Argus" + "".join(w.capitalize() for w in a.kind.split("_")),
            "argus_id": a.id,
            "kind": a.kind,
            "severity": a.severity,
            "job": a.job,
            "ranks": ",".join(str(r) for r in a.ranks),
        }
        if a.hosts:
            labels["hosts"] = ",".join(a.hosts)
        if a.comm:
            labels["comm"] = a.comm
        d: Dict[str, Any] = {
            "labels": labels,
            "annotations": {
                "summary": a.summary,
                "steps": f"{a.steps[0]}-{a.steps[1]}",
            },
            "startsAt": _rfc3339(a.first_seen),
        }
        if a.state == "resolved" and a.resolved_at is not None:
            d["endsAt"] = _rfc3339(a.resolved_at)
        if generator_url:
            d["generatorURL"] = generator_url
        out.append(d)
    return out
