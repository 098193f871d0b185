"""Blocking or asynchronous: which one a communicator's calls are, told from the data.

Normal NCCL enqueues and returns: a call's host time is an enqueue, and its exit follows its
arrival on every rank. Under blocking settings (`TORCH_NCCL_BLOCKING_WAIT`, a full launch queue,
CPU backends, some vendor builds) the host call returns only when every peer arrived: exits line
up across ranks however spread the arrivals were, the last to arrive waits least and the first
waits most. Both kinds appear in real jobs, so each communicator's instances vote every step: an
instance whose arrivals spread over at least `min_spread_ns` and whose exits spread less than
`ratio` of that is blocking. Send/recv-only links have no instances to compare; they take the
job's majority.

For a blocking communicator the time each rank's host spent *inside* its calls is its wait for
the others, and becomes a phase of the step (`wait:coll`, `wait:p2p`) with the role of a
communication phase (argus.aggregator.ranks): its lowest value is the rank the others waited for, its
high values are victims, never causes.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Deque, Dict, List, Optional

from argus.aggregator.robust import median
from argus.aggregator.state import Groups
from argus.schema import CommStep, RankStep

WAIT_COLL = "wait:coll"
WAIT_P2P = "wait:p2p"
WAIT_PHASES = (WAIT_COLL, WAIT_P2P)


def modal_seqs(cs: List[CommStep]) -> List[int]:
    """The instances most members of a communicator recorded in a step. A member whose agent began
    sampling (every n-th collective) in the middle of the step holds the ones before as well, and
    is the odd one out, not the reference the others are matched against."""
    first = cs[0].seqs
    if all(c.seqs == first for c in cs):
        return first
    n = Counter(tuple(c.seqs) for c in cs)
    best = max(n.values())
    return next(c.seqs for c in cs if n[tuple(c.seqs)] == best)


class CommModes:
    def __init__(self, window: int = 8, min_spread_ns: int = 1_000_000, ratio: float = 0.5) -> None:
        self.window = window
        self.min_spread_ns = min_spread_ns
        self.ratio = ratio
        self.votes: Dict[str, Deque[float]] = {}  # comm -> per-step median exit/arrival spread ratio

    def observe(self, ranks: Dict[int, RankStep], groups: Groups) -> None:
        for g in groups.collectives():
            rows = []
            for r in g.members:
                rs = ranks.get(r)
                c = rs.comms.get(g.comm) if rs is not None else None
                if c is not None and c.seqs:
                    rows.append(c)
            if len(rows) < 2:
                continue
            ref = modal_seqs(rows)
            rows = [c for c in rows if c.seqs == ref]
            if len(rows) < 2:
                continue
            ratios: List[float] = []
            n = min(min(len(c.arrive_ns), len(c.host_ns)) for c in rows)
            for i in range(n):
                arr = [c.arrive_ns[i] for c in rows]
                ex = [c.arrive_ns[i] + c.host_ns[i] for c in rows]
                spread = max(arr) - min(arr)
                if spread >= self.min_spread_ns:
                    ratios.append((max(ex) - min(ex)) / spread)
            if ratios:
                q = self.votes.get(g.comm)
                if q is None:
                    q = self.votes[g.comm] = deque(maxlen=self.window)
                q.append(median(ratios))

    def blocking(self, comm: str) -> Optional[bool]:
        """True / False once the communicator showed which; None before."""
        q = self.votes.get(comm)
        if not q:  # one step's median over its instances already tells: exits line up or they do not
            return None
        return median(list(q)) < self.ratio

    def job_blocking(self) -> Optional[bool]:
        said = [b for b in (self.blocking(c) for c in self.votes) if b is not None]
        if not said:
            return None
        return 2 * sum(said) > len(said)

    def modes(self) -> Dict[str, str]:
        out = {}
        for c in self.votes:
            b = self.blocking(c)
            if b is not None:
                out[c] = "blocking" if b else "async"
        return out

    def add_wait_phases(self, ranks: Dict[int, RankStep], groups: Groups) -> None:
        """Host time inside the calls of blocking communicators, as phases of each rank's step."""
        job = self.job_blocking()
        for rs in ranks.values():
            coll = p2p = 0
            any_coll = any_p2p = False
            for key, c in rs.comms.items():
                b = self.blocking(key)
                if c.seqs and b:
                    coll += sum(c.host_ns)
                    any_coll = True
                if c.p2p and (b if b is not None else job):
                    p2p += sum(p.host_ns for p in c.p2p)
                    any_p2p = True
            if any_coll:
                rs.phases[WAIT_COLL] = coll
            if any_p2p:
                rs.phases[WAIT_P2P] = p2p
