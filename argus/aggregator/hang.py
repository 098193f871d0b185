"""Hang: ranks blocked in a sync or collective past a threshold while a peer never arrived.

A hung job completes no step, so this reads heartbeats, not summaries: every agent reports the
calls its ranks entered and have not returned from (`InFlight`, with `since_ns`) and, per rank,
the last collective sequence number it entered on each communicator. The missing rank is the
one whose last sequence on a communicator is behind its peers' (it never reached the next
instance); the instance is its last sequence + 1. When no rank is behind — everyone entered the
collective and one never left it (a dead GPU, a wedged kernel) — the ranks that are *not* blocked
while their peers are, if any, are named; otherwise the alert names the blocked ranks and says
that the data cannot tell which one failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

from argus.schema import Heartbeat


@dataclass
class HangFinding:
    missing: List[int]
    comm: Optional[str]
    seq: Optional[int]
    blocked: Dict[int, Dict[str, Any]]  # rank -> {call, blocked_s, comm, seq}
    evidence: Dict[str, Any]


class HangWatch:
    """Latest heartbeat per agent of one job."""

    def __init__(self) -> None:
        self.beats: Dict[str, Heartbeat] = {}

    def add(self, hb: Heartbeat) -> None:
        old = self.beats.get(hb.agent)
        if old is None or hb.ts_ns >= old.ts_ns:
            self.beats[hb.agent] = hb

    def now_ns(self) -> int:
        return max((hb.ts_ns for hb in self.beats.values()), default=0)

    def judge(self, threshold_s: float, members: Dict[str, Set[int]]) -> Optional[HangFinding]:
        """`members`: communicator -> ranks (from the step summaries seen so far)."""
        if not self.beats:
            return None
        blocked: Dict[int, Dict[str, Any]] = {}
        alive: Set[int] = set()
        last_seq: Dict[int, Dict[str, int]] = {}
        last_step: Dict[int, int] = {}
        for hb in self.beats.values():
            alive |= set(hb.ranks)
            for r, m in hb.last_seq.items():
                last_seq.setdefault(r, {}).update(m)
            last_step.update(hb.last_step)
            for f in hb.inflight:
                age = (hb.ts_ns - f.since_ns) / 1e9
                if age < threshold_s:
                    continue
                cur = blocked.get(f.rank)
                if cur is None or age > cur["blocked_s"]:
                    blocked[f.rank] = {
                        "call": f.call,
                        "blocked_s": round(age, 2),
                        "comm": f.comm,
                        "seq": f.seq,
                    }
        if not blocked:
            return None
        # a communicator some blocked rank belongs to, on which a rank is behind
        comms: Set[str] = set()
        for r in blocked:
            comms |= {c for c, rs in members.items() if r in rs}
            comms |= set(last_seq.get(r, {}))
        best: Optional[HangFinding] = None
        for c in sorted(comms):
            seqs = {r: m[c] for r, m in last_seq.items() if c in m}
            if c in members:
                for r in members[c] & alive:
                    seqs.setdefault(r, -1)  # a member that never entered a collective there
            if len(seqs) < 2:
                continue
            top = max(seqs.values())
            behind = sorted(r for r, s in seqs.items() if s < top)
            if not behind or len(behind) == len(seqs):
                continue
            seq = min(seqs[r] for r in behind) + 1
            cand = HangFinding(behind, c, seq, blocked, {})
            if best is None or len(cand.missing) < len(best.missing):
                best = cand
        if best is None:
            idle = sorted(r for r in alive if r not in blocked)
            best = HangFinding(idle, None, None, blocked, {"note": "" if idle else "no rank is behind"})
        best.evidence.update(
            {
                "blocked_ranks": len(blocked),
                "longest_blocked_s": max(b["blocked_s"] for b in blocked.values()),
                "calls": sorted({b["call"] for b in blocked.values()}),
                "last_step": {r: last_step[r] for r in sorted(last_step)},
                "threshold_s": round(threshold_s, 2),
            }
        )
        if best.comm is not None:
            best.evidence["last_seq"] = {
                r: m[best.comm] for r, m in sorted(last_seq.items()) if best.comm in m
            }
        return best
