"""Hang: ranks blocked in a sync or collective past a threshold while a peer never arrived.

A hung job completes no step, so this reads heartbeats, not summaries: every agent reports the
calls its ranks entered and have not returned from (`InFlight`, with `since_ns`; at attach, the
threads it found blocked inside a probed library) and, per rank, the last collective it entered on
each communicator. The engine puts those on the job's positions (argus.aggregator.align: job
step * POSITIONS + position in the step), so ranks attached at different times compare. The
missing rank is the one whose last position on a communicator is behind its peers' (it never
reached the next instance); the instance is its next position. When no rank is behind — everyone entered the
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
    """Latest heartbeat per agent of one job (on the job's positions), and each rank's next
    position per communicator."""

    def __init__(self) -> None:
        self.beats: Dict[str, Heartbeat] = {}
        self.nexts: Dict[str, Dict[int, Dict[str, int]]] = {}

    def add(self, hb: Heartbeat, nexts: Optional[Dict[int, Dict[str, int]]] = None) -> None:
        old = self.beats.get(hb.agent)
        if old is None or hb.ts_ns >= old.ts_ns:
            self.beats[hb.agent] = hb
            self.nexts[hb.agent] = nexts or {}

    def now_ns(self) -> int:
        return max((hb.ts_ns for hb in self.beats.values()), default=0)

    def judge(self, threshold_s: float, members: Dict[str, Set[int]]) -> Optional[HangFinding]:
        """`members`: communicator -> ranks (from the step summaries seen so far)."""
        if not self.beats:
            return None
        blocked: Dict[int, Dict[str, Any]] = {}
        alive: Set[int] = set()
        last_seq: Dict[int, Dict[str, int]] = {}
        nxt: Dict[int, Dict[str, int]] = {}
        last_step: Dict[int, int] = {}
        where: Dict[int, str] = {}
        at_attach: Set[int] = set()
        inside: Set[int] = set()  # ranks with a call in flight, however young
        in_comm: Dict[int, List[int]] = {}  # blocked rank -> [nRanks, its rank in the communicator]
        for agent, hb in self.beats.items():
            alive |= set(hb.ranks)
            where.update(hb.where)
            at_attach |= set(hb.attach_blocked)
            in_comm.update(hb.inflight_comm)
            for r, m in hb.last_seq.items():
                last_seq.setdefault(r, {}).update(m)
            for r, m in self.nexts.get(agent, {}).items():
                nxt.setdefault(r, {}).update(m)
            last_step.update(hb.last_step)
            for f in hb.inflight:
                age = (hb.ts_ns - f.since_ns) / 1e9
                inside.add(f.rank)
                if age < threshold_s / 2:  # count it once some rank passed the threshold
                    continue
                cur = blocked.get(f.rank)
                if cur is None or age > cur["blocked_s"]:
                    blocked[f.rank] = {
                        "call": f.call,
                        "blocked_s": round(age, 2),
                        "comm": f.comm,
                        "seq": f.seq,
                    }
        if not blocked or max(b["blocked_s"] for b in blocked.values()) < threshold_s:
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
            # the instance it never reached: its next position (a member that never entered one: none)
            nexts = [nxt.get(r, {}).get(c) for r in behind if seqs[r] >= 0]
            seq = min((n for n in nexts if n is not None), default=None)
            cand = HangFinding(behind, c, seq, blocked, {})
            if best is None or len(cand.missing) < len(best.missing):
                best = cand
        if best is None:
            idle = sorted(r for r in alive if r not in inside)
            # the communicator they are blocked on (found on their stacks at attach, or entered)
            on = {b["comm"] for b in blocked.values() if b["comm"]}
            comm = next(iter(on)) if len(on) == 1 else None
            best = HangFinding(idle, comm, None, blocked, {"note": "" if idle else "no rank is behind"})
            gap = missing_members({r: in_comm[r] for r in blocked if r in in_comm}, alive - inside)
            if gap is not None:
                best.missing = gap["missing"]
                best.evidence["communicator"] = gap
        best.evidence.update(
            {
                "blocked_ranks": len(blocked),
                "longest_blocked_s": max(b["blocked_s"] for b in blocked.values()),
                "calls": sorted({b["call"] for b in blocked.values()}),
                "last_step": {r: last_step[r] for r in sorted(last_step)},
                "threshold_s": round(threshold_s, 2),
            }
        )
        if where:
            best.evidence["where"] = {r: where[r] for r in sorted(where)}
        if at_attach & set(blocked):
            best.evidence["since_attach"] = sorted(at_attach & set(blocked))
        if best.comm is not None:
            best.evidence["last_seq"] = {
                r: m[best.comm] for r, m in sorted(last_seq.items()) if best.comm in m
            }
        return best


def missing_members(blocked: Dict[int, List[int]], idle: Set[int]) -> Optional[Dict[str, Any]]:
    """Blocked ranks that said which communicator rank they are ([nRanks, rank]) in one communicator
    size: the communicator ranks nobody is blocked as are the ones they wait for. Their global ranks
    follow from the stride of global over communicator ranks (two blocked members give it); only
    idle ranks are named."""
    sizes = {v[0] for v in blocked.values()}
    if len(blocked) < 2 or len(sizes) != 1:
        return None
    (n,) = sizes
    have = {c: g for g, (_n, c) in blocked.items()}
    gone = sorted(set(range(n)) - set(have))
    if not gone or len(have) != len(blocked):
        return None
    (c0, g0), (c1, g1) = sorted(have.items())[:2]
    if (g1 - g0) % (c1 - c0):
        return None
    stride = (g1 - g0) // (c1 - c0)
    if any(g != g0 + (c - c0) * stride for c, g in have.items()):
        return None
    missing = [g0 + (c - c0) * stride for c in gone]
    if not all(g in idle for g in missing):
        return None
    return {"nranks": n, "blocked_as": sorted(have), "missing_as": gone, "missing": missing}
