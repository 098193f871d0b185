"""Which shard judges which rank, when one job is split over several aggregators.

What must stay together is what the levels compare: a collective instance is aligned across the
members of its communicator (argus.aggregator.ranks), a rank's phases against its symmetric group
(the smallest collective communicator of at least `min_group` ranks), the two ends of a pipeline
link against each other; a host's ranks share one agent (its heartbeats, hence hangs and missing
hosts) and one clock (argus.aggregator.clocks). So a plan is made of *units*:

1. the ranks of one host form a unit;
2. communicators whose every member shares its key (identity table/init/split: docs/schema.md)
   join the units of their members, smallest communicator first, as long as the joined unit stays
   within `cap` ranks (half a shard's share); a larger one is *cut*: each shard judges its part.

Smallest first because the small communicators are the tight comparisons: tensor-parallel groups
(the symmetric group of a TP job) and pipeline links; the data-parallel communicator of a large
job has hundreds or thousands of members, and the median arrival or phase time over half of them
is the median over all of them (what a cut costs is measured: docs/benchmarks.md). In a TP×PP×DP
job the units are model replicas (TP×PP ranks); in a data-parallel job, hosts. Communicators
known only by a process's handle (identity accessors/inferred) join nothing, so such a job is
split by host and rank range.

Units are laid out in order of their lowest rank and cut into `shards` contiguous runs of about
equal size, so a job without shared communicator keys still splits by rank range, which keeps
stride-1 groups together. A rank the plan did not know (its agent came later) goes to its host's
shard, else to the shard of a communicator of its that the plan kept whole, else by rank range
(`Plan.place`): the same answer from every router, given the same plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from argus.aggregator.align import SHARED
from argus.errors import UsageError
from argus.schema import RankStep

PLAN_VERSION = 1
MAX_SHARDS = 1024


@dataclass(frozen=True)
class RankInfo:
    """What a plan needs of a rank, from one of its summaries."""

    rank: int
    host: str
    world: int = -1
    comms: Tuple[Tuple[str, int], ...] = ()  # (shared communicator key, nranks)


def rank_info(rs: RankStep) -> RankInfo:
    comms = tuple(sorted((c.comm, c.nranks) for c in rs.comms.values() if c.identity in SHARED))
    return RankInfo(rs.rank, rs.host, rs.world_size, comms)


@dataclass
class Plan:
    shards: int
    world: int
    of: Dict[int, int] = field(default_factory=dict)  # rank -> shard
    hosts: Dict[str, int] = field(default_factory=dict)  # host -> shard (hosts are never split)
    comms: Dict[str, int] = field(default_factory=dict)  # communicator kept whole -> its shard
    cut: int = 0  # communicators cut across shards

    def shard_of(self, rank: int) -> Optional[int]:
        return self.of.get(rank)

    def place(self, info: RankInfo) -> int:
        """The shard of a rank the plan did not know: a pure function of the plan and the rank."""
        s = self.of.get(info.rank)
        if s is not None:
            return s
        s = self.hosts.get(info.host)
        if s is not None:
            return s
        for comm, _n in sorted(info.comms, key=lambda c: (c[1], c[0])):
            s = self.comms.get(comm)
            if s is not None:
                return s
        world = max(self.world, info.world, 1)
        if info.rank >= world:
            return info.rank % self.shards
        return min(self.shards - 1, info.rank * self.shards // world)

    def ranks_of(self, shard: int) -> Set[int]:
        return {r for r, s in self.of.items() if s == shard}

    def sizes(self) -> List[int]:
        out = [0] * self.shards
        for s in self.of.values():
            out[s] += 1
        return out

    # ---- in Redis (argus:{JOB}:shardplan) ----------------------------------------------------------

    def to_bytes(self) -> bytes:
        top = max(self.of, default=-1)
        by_rank = [self.of.get(r, -1) for r in range(top + 1)]  # ~3 bytes a rank, not ~12 as a map
        d = {"v": PLAN_VERSION, "n": self.shards, "w": self.world, "s": by_rank, "h": self.hosts}
        d.update({"c": self.comms, "x": self.cut})
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        """Strict: a plan that does not parse is refused (ValueError), never half used."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("v") != PLAN_VERSION:
                raise ValueError("not a version-1 plan")
            n, w = int(d["n"]), int(d["w"])
            if not 1 <= n <= MAX_SHARDS:
                raise ValueError(f"{n} shards")
            of = {r: int(s) for r, s in enumerate(d["s"]) if int(s) >= 0}
            hosts = {str(h): int(s) for h, s in dict(d["h"]).items()}
            comms = {str(c): int(s) for c, s in dict(d["c"]).items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed plan: {e}") from None
        if any(not 0 <= s < n for s in [*of.values(), *hosts.values(), *comms.values()]):
            raise ValueError("a shard out of range")
        return cls(n, w, of, hosts, comms, int(d.get("x", 0)))


class _Units:
    """Union-find over ranks, with each unit's size."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.up: Dict[int, int] = {r: r for r in ranks}
        self.size: Dict[int, int] = {r: 1 for r in self.up}

    def find(self, r: int) -> int:
        root = r
        while self.up[root] != root:
            root = self.up[root]
        while self.up[r] != root:  # path compression
            self.up[r], r = root, self.up[r]
        return root

    def join(self, ranks: Iterable[int]) -> None:
        roots = sorted({self.find(r) for r in ranks})
        if len(roots) < 2:
            return
        top = roots[0]
        for x in roots[1:]:
            self.up[x] = top
            self.size[top] += self.size.pop(x)


def make_plan(infos: Iterable[RankInfo], shards: int, world: int = -1) -> Plan:
    """Split the ranks of `infos` (one per rank) into `shards` shards (see the module's doc)."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be in 1..{MAX_SHARDS}")
    by_rank = {i.rank: i for i in infos}
    world = max([world, len(by_rank), *(i.world for i in by_rank.values()), *(r + 1 for r in by_rank)])
    plan = Plan(shards, world)
    if not by_rank:
        return plan
    units = _Units(sorted(by_rank))
    hosts: Dict[str, List[int]] = {}
    for i in by_rank.values():
        hosts.setdefault(i.host, []).append(i.rank)
    for on_host in hosts.values():
        units.join(on_host)
    cap = max(1, -(-world // (2 * shards)))  # half a share: units small enough to balance shards
    comms: Dict[str, List[int]] = {}
    size: Dict[str, int] = {}
    for i in by_rank.values():
        for c, n in i.comms:
            comms.setdefault(c, []).append(i.rank)
            size[c] = max(size.get(c, 0), n)
    for c in sorted(comms, key=lambda c: (max(size[c], len(comms[c])), c)):
        roots = {units.find(r) for r in comms[c]}
        if len(roots) > 1 and sum(units.size[x] for x in roots) <= cap:
            units.join(comms[c])
    members: Dict[int, List[int]] = {}
    for r in sorted(by_rank):
        members.setdefault(units.find(r), []).append(r)
    total, done = len(by_rank), 0
    for unit in sorted(members.values(), key=lambda m: m[0]):  # in rank order: a split by rank range
        # each unit goes where its middle falls: contiguous runs, each within half a unit of a share
        s = min(shards - 1, (2 * done + len(unit)) * shards // (2 * total))
        for r in unit:
            plan.of[r] = s
        done += len(unit)
    for h, rs in hosts.items():
        plan.hosts[h] = plan.of[rs[0]]
    for c, rs in comms.items():
        got = {plan.of[r] for r in rs}
        if len(got) == 1:
            plan.comms[c] = got.pop()
        else:
            plan.cut += 1
    return plan


def parse_shard(text: str) -> Tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    a, sep, b = text.partition("/")
    try:
        i, n = int(a), int(b)
    except ValueError:
        i, n = -1, 0
    if not sep or not 1 <= n <= MAX_SHARDS or not 0 <= i < n:
        raise UsageError(
            f"--shard '{text}' is not I/N with 0 <= I < N <= {MAX_SHARDS}",
            "start N members with --shard 0/N ... --shard N-1/N, e.g. --shard 0/2 and --shard 1/2",
        )
    return i, n
