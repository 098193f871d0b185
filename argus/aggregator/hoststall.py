"""Host stall: one rank's host stops feeding its GPU (data loading, JIT compilation, garbage
collection, swapping), the step spikes for everyone, and only that rank's host time grew.

Signals, all per step and relative to the rank's symmetric group:

* its host reached the step's collectives (with blocking collectives: one of them) late by at
  least max(`stall_min_ns`, `stall_rel` x the median step) — everyone else's step spikes too,
  because they wait for it at the collectives;
* its own host time outside GPU waits and blocking collectives (`host_other` = duration − host
  sync wait − `wait:*`) grew by at least `stall_host_share` of that lateness — its peers' host
  time did not (they sat in the sync, or inside the collectives);
* its launch rate (launches per ms of step) collapsed: the same launches spread over a long step.

Where the gap sat tells part of the cause: before the first collective (the batch was not ready,
or compilation/GC ran before the forward pass) or between collectives (inside the forward/backward
pass: a JIT compile of a new shape, a GC triggered by allocation). Telling data loading from
compilation from GC needs host stacks (the Python channel), which the summaries do not carry yet:
the evidence says so rather than guessing.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from argus.aggregator.config import Thresholds
from argus.aggregator.ranks import RankFlag, own_host
from argus.aggregator.robust import median
from argus.schema import RankStep


def first_arrival_ns(rs: RankStep) -> Optional[int]:
    """Offset of the rank's first collective arrival from its step start."""
    firsts = [c.arrive_ns[0] for c in rs.comms.values() if c.arrive_ns]
    firsts += [c.p2p[0].arrive_ns for c in rs.comms.values() if c.p2p]
    return min(firsts) - rs.start_ns if firsts else None


def late(f: RankFlag) -> float:
    """How late its host reached the step's collectives: its median lateness, or its largest where
    collectives block (the ranks line up again at each one, so a stall shows before one only)."""
    return max(f.late_ns, f.late_peak_ns)


def detect(
    ranks: Dict[int, RankStep],
    flags: Dict[int, RankFlag],
    step_ns: float,
    base_step_ns: float,
    th: Thresholds,
) -> List[Dict[str, Any]]:
    """Stalled ranks of this step, each as an evidence dict (and `flags[r].stall` set)."""
    out: List[Dict[str, Any]] = []
    need = max(th.stall_min_ns, th.stall_rel * (base_step_ns or step_ns))
    stalled = [
        r
        for r, f in flags.items()
        if late(f) >= need and f.host_excess_ns >= th.stall_host_share * late(f) and r in ranks
    ]
    if not stalled:
        return out
    peers = [rs for r, rs in ranks.items() if r not in stalled]
    first = [x for x in (first_arrival_ns(rs) for rs in peers) if x is not None]
    ho = [own_host(rs) for rs in peers]
    for r in stalled:
        rs, f = ranks[r], flags[r]
        f.stall = True
        fa = first_arrival_ns(rs)
        gap_first = fa - median(first) if fa is not None and first else None
        where = "unknown"
        if gap_first is not None:
            where = "before the first collective" if gap_first >= 0.5 * late(f) else "between collectives"
        ev: Dict[str, Any] = {
            "late_ms": round(late(f) / 1e6, 1),
            "host_other_ms": round(own_host(rs) / 1e6, 1),
            "peers_host_other_ms": round(median(ho) / 1e6, 1) if ho else None,
            "step_ms": round(step_ns / 1e6, 1),
            "baseline_step_ms": round(base_step_ns / 1e6, 1),
            # None: the launch probes did not cover this step (argus probe --launch-steps)
            "launches": rs.launches if rs.launches_sampled else None,
            "launches_per_ms": round(rs.launches / max(rs.duration_ns / 1e6, 1e-9), 2)
            if rs.launches_sampled
            else None,
            "normal_launches_per_ms": round(rs.launches / max(base_step_ns / 1e6, 1e-9), 2)
            if rs.launches_sampled
            else None,
            "gap": where,
            "gap_before_first_collective_ms": None if gap_first is None else round(gap_first / 1e6, 1),
            "cause": "host-side: data loading, JIT compilation or GC (host stacks not collected yet)",
        }
        out.append({"rank": r, "evidence": ev})
    return out
