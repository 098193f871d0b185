"""Bounded rolling state of one job: step alignment across ranks and the groups its communicators form.

Alignment: summaries arrive per rank, in any order across ranks (an agent publishes a rank's few
steps of one interval together, then the next rank's). Step `s` is judged once every expected rank
reported it, or once each rank missing from it has either moved past it (it reported a later
step: that one was lost) or fallen silent — reported nothing for `lag_s` of job time (the
newest step end seen), and at least `lag_steps` steps: a rank that is late or gone must not stall
diagnosis. A summary for a step already judged is counted and dropped.

Groups: every communicator a rank reports (`CommStep.comm`, with `nranks`) is a group; its members
are the ranks that report it. Nothing is assumed about DP/TP/PP: a rank's *symmetric group* (the
peers it is compared with) is the smallest collective communicator with at least `min_group` ranks
that contains it — the ranks of one collective communicator run the same code on the same shapes.
Communicators that carry only Send/Recv are pipeline links: they are never used as symmetric groups
(stages differ), but their edges tell which ranks wait on which.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from argus.schema import RankStep

JOB_GROUP = "job"  # the symmetric group of ranks that share no collective communicator


@dataclass
class Group:
    comm: str
    nranks: int = -1
    members: Set[int] = field(default_factory=set)
    ops: Counter = field(default_factory=Counter)  # op -> instances seen (one step of one rank)
    p2p_ops: int = 0
    crank: Dict[int, int] = field(default_factory=dict)  # rank in the communicator -> global rank

    @property
    def collective(self) -> bool:
        return bool(self.ops)

    @property
    def main_op(self) -> Optional[str]:
        return self.ops.most_common(1)[0][0] if self.ops else None


class Groups:
    """Communicators of a job and the groups they imply (updated as summaries arrive)."""

    def __init__(self, min_group: int = 3) -> None:
        self.min_group = min_group
        self.by_comm: Dict[str, Group] = {}
        self.edges: Dict[int, Set[int]] = {}  # rank -> p2p peers (global ranks)
        self._seen: Dict[int, Tuple[str, ...]] = {}  # rank -> comms it reported last time
        self._sym: Dict[int, str] = {}
        self._dirty = True

    def observe(self, rs: RankStep) -> None:
        key = tuple(rs.comms)
        fresh = self._seen.get(rs.rank) != key
        for cid, c in rs.comms.items():
            g = self.by_comm.get(cid)
            if g is None:
                g = self.by_comm[cid] = Group(cid, c.nranks)
                fresh = True
            if fresh or rs.rank not in g.members:
                g.members.add(rs.rank)
                if c.nranks > g.nranks:
                    g.nranks = c.nranks
                if c.rank >= 0:
                    g.crank[c.rank] = rs.rank
                for op in c.ops:
                    g.ops[op] += 1
                self._dirty = True
            if c.p2p:
                g.p2p_ops += len(c.p2p)
                for p in c.p2p:
                    peer = g.crank.get(p.peer)
                    if peer is not None and peer != rs.rank:
                        mine = self.edges.setdefault(rs.rank, set())
                        if peer not in mine:
                            mine.add(peer)
                            self.edges.setdefault(peer, set()).add(rs.rank)
        self._seen[rs.rank] = key

    def collectives(self) -> List[Group]:
        return [g for g in self.by_comm.values() if g.collective and len(g.members) >= 2]

    def symmetric(self, ranks: Iterable[int]) -> Dict[str, List[int]]:
        """Symmetric group key -> member ranks (among `ranks`), each rank in exactly one group."""
        if self._dirty:
            self._sym = {}
            cands = sorted(
                (g for g in self.by_comm.values() if g.collective and len(g.members) >= self.min_group),
                key=lambda g: (len(g.members), g.comm),
            )
            for g in cands:
                for r in g.members:
                    self._sym.setdefault(r, g.comm)
            self._dirty = False
        out: Dict[str, List[int]] = {}
        for r in ranks:
            out.setdefault(self._sym.get(r, JOB_GROUP), []).append(r)
        return out

    def small_links(self, a: int, b: int) -> Optional[str]:
        """A communicator of at most two ranks (a p2p link, or a 2-rank collective) joining a and b."""
        for g in self.by_comm.values():
            if a in g.members and b in g.members and len(g.members) <= 2:
                return g.comm
        return None

    def describe(self, key: str) -> str:
        if key == JOB_GROUP:
            return "the job"
        g = self.by_comm.get(key)
        if g is None:
            return f"comm {key[:8]}"
        what = ", ".join(op for op, _ in g.ops.most_common(2)) if g.ops else "Send/Recv"
        return f"{what} group comm {key[:8]} ({len(g.members)} ranks)"


class Ring:
    """The last `width` values of a few phases for each rank of a group, in flat float arrays."""

    def __init__(self, phases: List[str], width: int) -> None:
        self.phases = phases
        self.width = width
        self.pos = 0  # next column
        self.filled = 0
        self.data: Dict[int, array] = {}

    def push(self, values: Dict[int, Dict[str, int]]) -> None:
        w, col = self.width, self.pos
        nan = float("nan")
        for r, ph in values.items():
            a = self.data.get(r)
            if a is None:
                a = self.data[r] = array("d", [nan]) * (w * len(self.phases))
            for i, p in enumerate(self.phases):
                v = ph.get(p)
                a[i * w + col] = nan if v is None else float(v)
        for r, a in self.data.items():
            if r not in values:
                for i in range(len(self.phases)):
                    a[i * w + col] = nan
        self.pos = (col + 1) % w
        self.filled = min(self.filled + 1, w)

    def window(self, rank: int, phase_index: int) -> List[float]:
        a = self.data.get(rank)
        if a is None:
            return []
        w = self.width
        vals = a[phase_index * w : (phase_index + 1) * w]
        return [v for v in vals if v == v]  # drop NaN


@dataclass
class Frame:
    """One step's summaries, rank -> RankStep."""

    step: int
    ranks: Dict[int, RankStep] = field(default_factory=dict)


class Aligner:
    """Collects summaries per step and hands out steps ready to judge, in order."""

    def __init__(self, lag_steps: int = 2, max_pending: int = 64, lag_s: float = 3.0) -> None:
        self.lag = lag_steps
        self.lag_ns = int(lag_s * 1e9)
        self.max_pending = max_pending
        self.frames: Dict[int, Frame] = {}
        self.expected: Set[int] = set()
        self.world = -1
        self.scope = -1  # a shard's ranks (argus.aggregator.sharded): the world it waits for
        self.max_step = -1
        self.judged = -1  # highest step handed out
        self.late = 0  # summaries for steps already judged (dropped)
        self.dupes = 0
        self.last_step: Dict[int, int] = {}  # rank -> highest step it reported
        self.last_end: Dict[int, int] = {}  # rank -> end of its newest summary (realtime ns)
        self.newest_end = 0
        self.step_ns = 0

    def add(self, rs: RankStep) -> None:
        s = rs.step
        if s is None:
            return
        if s <= self.judged:
            self.late += 1
            return
        self.expected.add(rs.rank)
        if self.scope > 0:
            self.world = self.scope
        elif rs.world_size > self.world:
            self.world = rs.world_size
        f = self.frames.get(s)
        if f is None:
            f = self.frames[s] = Frame(s)
        if rs.rank in f.ranks:
            self.dupes += 1
        f.ranks[rs.rank] = rs
        if s > self.max_step:
            self.max_step = s
        self.last_step[rs.rank] = max(self.last_step.get(rs.rank, s), s)
        self.last_end[rs.rank] = max(self.last_end.get(rs.rank, 0), rs.end_ns)
        self.newest_end = max(self.newest_end, rs.end_ns)
        self.step_ns = rs.duration_ns if not self.step_ns else (7 * self.step_ns + rs.duration_ns) // 8

    def _complete(self, f: Frame) -> bool:
        n = self.world if self.world > 0 else len(self.expected)
        return len(f.ranks) >= max(n, len(self.expected))

    def _given_up(self, f: Frame) -> bool:
        """Every expected rank missing from the frame moved past it, or has been silent too long."""
        if self.max_step - f.step < self.lag:
            return False
        lag = max(self.lag_ns, self.lag * self.step_ns)
        if len(self.expected) < self.world:  # ranks never heard from: wait for them a while
            end = max(rs.end_ns for rs in f.ranks.values())
            if self.newest_end - end < lag:
                return False
        for r in self.expected - set(f.ranks):
            if self.last_step.get(r, -1) <= f.step and self.newest_end - self.last_end.get(r, 0) < lag:
                return False
        return True

    def ready(self, flush: bool = False) -> List[Frame]:
        out: List[Frame] = []
        for s in sorted(self.frames):
            f = self.frames[s]
            if not (flush or self._complete(f) or len(self.frames) > self.max_pending or self._given_up(f)):
                break  # judge in order: a later step never overtakes an incomplete earlier one
            del self.frames[s]
            self.judged = s
            out.append(f)
        return out

    def pending_ranks(self) -> int:
        return sum(len(f.ranks) for f in self.frames.values())
