"""The reduce step of a job split over several aggregators: the job-wide judgements.

Shards (argus.aggregator.sharded) judge their ranks and publish those alerts themselves; what no
shard can judge alone comes here as partials (argus.aggregator.partials):

* **L1, the job's step time** (argus.aggregator.steptime): the median over every rank of the job,
  from the shards' per-rank step times of that step — the same number one aggregator computes —
  with its hold-and-fold rule: a slower step is published alone only when no shard judged
  something that explains it (any shard's `explained`, or a specific alert firing);
* **groups cut across shards** (argus.aggregator.partition): whether the whole group's phase
  level shifted with no rank of it late or an outlier (L3, argus.aggregator.distributions) — a
  part alone would blame its group for the wait a straggler in another part causes — from each
  part's least value (the level: exact), quantiles and quietness;
* **hangs**: each shard sees its own ranks blocked; the part of a cut communicator without the
  missing rank sees everyone blocked and nobody behind, so the candidate that names who the
  others wait for wins, and with none named the blocked ranks of every shard are said together.

A step is reduced once every shard sent it, moved past it (shards judge in order: one that sent a
later step will never send this one), or has been silent for `patience_s` (its member died: the
one taking its shard over needs a lease period). Steps go in order, each once; a partial for a
step already reduced is counted and dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Set, Tuple

from argus.aggregator.alerts import Alert, AlertBook, Finding
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.distributions import L3
from argus.aggregator.engine import SPECIFIC, STEP_KINDS, host_wait_ratio
from argus.aggregator.explain import Explainer
from argus.aggregator.gpuarrival import GpuArrivals, StepEvidence
from argus.aggregator.partials import GroupPart, HangPartial, StepPartial
from argus.aggregator.robust import median
from argus.aggregator.state import Group, Groups
from argus.aggregator.steptime import L1, Held, L1Finding, release, steps_spanned


@dataclass
class ReduceStats:
    steps: int = 0  # steps reduced
    short: int = 0  # of which without some shard (silent past the patience)
    late: int = 0  # partials for steps already reduced (dropped)
    duplicates: int = 0
    l1_folded: int = 0


def merge_evidence(recs: List[StepEvidence]) -> List[StepEvidence]:
    """The shards' GPU-arrival records of one step as one record per evidence step (what one
    aggregator's would say: counts add up, a source any shard could use is usable)."""
    by: Dict[int, List[StepEvidence]] = {}
    for r in recs:
        by.setdefault(r.step, []).append(r)
    out = []
    for e, rs in sorted(by.items()):
        nets = [x.net_bound_ns for x in rs if x.net_bound_ns is not None]
        widths = [x.bound_width_ns for x in rs if x.bound_width_ns is not None]
        out.append(
            StepEvidence(
                e,
                ranks=sum(x.ranks for x in rs),
                hosts=sum(x.hosts for x in rs),
                timers=any(x.timers for x in rs),
                coll=any(x.coll for x in rs),
                net_ranks=sum(x.net_ranks for x in rs),
                net_bound_ns=max(nets) if nets else None,
                bounds=sum(x.bounds for x in rs),
                bound_width_ns=max(widths) if widths else None,
                floor_ns=max(x.floor_ns for x in rs),
                conflicts=sum(x.conflicts for x in rs),
            )
        )
    return out


def pick_hang(cands: List[HangPartial]) -> Tuple[Optional[Finding], Dict[int, str]]:
    """The job's hang from the shards' candidates: one that names who the others wait for (the
    fewest ranks), else every shard's blocked ranks together."""
    have = [p for p in cands if p.finding is not None]
    if not have:
        return None, {}
    named = [p for p in have if p.named]
    if named:
        best = min(named, key=lambda p: (len(p.finding.ranks) if p.finding else 0, p.shard))
        return best.finding, best.hosts
    first = min(have, key=lambda p: p.shard)
    assert first.finding is not None
    ranks = sorted({r for p in have if p.finding is not None for r in p.finding.ranks})
    hosts = {r: h for p in have for r, h in p.hosts.items()}
    f = Finding(**{**first.finding.__dict__, "ranks": ranks})
    return f, hosts


class Reducer:
    """One job's reduce step (pure: the Redis side is argus.aggregator.sharded)."""

    def __init__(
        self,
        job: str,
        th: Optional[Thresholds] = None,
        info: Optional[PhaseInfo] = None,
        book: Optional[AlertBook] = None,
        patience_s: float = 23.0,
        max_pending: int = 64,
    ) -> None:
        self.job = job
        self.th = th or Thresholds()
        self.info = info or PhaseInfo({})
        self.book = book or AlertBook(self.th.resolve_after)
        self.patience_s = patience_s
        self.max_pending = max_pending
        self.shards: Set[int] = set()  # shards with ranks (the plan's): a step waits for these
        self.pending: Dict[int, Dict[int, StepPartial]] = {}
        self.newest: Dict[int, int] = {}  # shard -> newest step it sent
        self.heard: Dict[int, float] = {}  # shard -> when it last sent (the caller's clock)
        self.since: Optional[float] = None  # when this reducer started waiting (a never-heard shard)
        self.judged = -1  # the newest step reduced
        self.count = 0  # steps reduced
        self.first_step = -1
        self.l1 = L1(self.th)
        self.colls: Deque[float] = deque(maxlen=32)
        self.held: Held = []
        self.log: Deque[L1Finding] = deque(maxlen=256)
        self.gpu = GpuArrivals(self.th)
        self.hang_by: Dict[int, HangPartial] = {}
        self.reduced: Deque[Tuple[int, int, int]] = deque(maxlen=4096)  # (step, ranks, shards)
        self.stats = ReduceStats()
        self.groups = Groups(self.th.min_group)  # the cut groups, for the alerts' words
        self.hosts: Dict[int, str] = {}
        self.l3 = L3(self.th)
        self.host_wait: Dict[str, Deque[Tuple[int, float]]] = {}
        self.group_size: Dict[str, int] = {}
        self.ex = Explainer(job, self.groups, self.info, self.hosts)

    # ---- step partials ------------------------------------------------------------------------------

    def add(self, p: StepPartial, now: float) -> None:
        if self.since is None:
            self.since = now
        self.heard[p.shard] = now
        self.newest[p.shard] = max(self.newest.get(p.shard, -1), p.step)
        if p.step <= self.judged:
            self.stats.late += 1
            return
        got = self.pending.setdefault(p.step, {})
        if p.shard in got:
            self.stats.duplicates += 1  # a shard's new owner judged it again: the first one counts
            return
        got[p.shard] = p

    def _waits_for(self, step: int, got: Dict[int, StepPartial], now: float) -> bool:
        for k in self.shards:
            if k in got or self.newest.get(k, -1) > step:
                continue
            if now - self.heard.get(k, self.since if self.since is not None else now) < self.patience_s:
                return True
        return False

    def ready(self, now: float, flush: bool = False) -> List[Alert]:
        """Reduce every step whose partials are all in (or given up), in order."""
        out: List[Alert] = []
        for s in sorted(self.pending):
            got = self.pending[s]
            if not flush and len(self.pending) <= self.max_pending and self._waits_for(s, got, now):
                break
            del self.pending[s]
            out += self._reduce(s, got)
        return out

    def _reduce(self, step: int, got: Dict[int, StepPartial]) -> List[Alert]:
        th = self.th
        parts = [got[k] for k in sorted(got)]
        durations = [d for p in parts for d in p.durations]
        colls = [c for p in parts for c in p.colls]
        self.judged = step
        self.stats.steps += 1
        self.stats.short += int(bool(self.shards - set(got)))
        self.reduced.append((step, len(durations), len(got)))
        if not durations:
            return []
        self.count += 1
        if self.first_step < 0:
            self.first_step = step
        # the whole-job engine's warm-up (argus.aggregator.engine): from the job's start, or attached
        start = any(p.absolute for p in parts) and self.first_step < th.warmup_steps
        judge = self.count > (th.warmup_steps if start else th.attach_warmup_steps)
        step_ns = median(durations)
        for f in self.l1.observe(step, step_ns / steps_spanned(colls, self.colls)):
            if judge:
                self.held.append((f, self.count + th.l1_hold_steps))
                self.log.append(f)
        for rec in merge_evidence([e for p in parts for e in p.evidence]):
            self.gpu.records.append(rec)
        for p in parts:
            self.hosts.update(p.hosts)
        findings = self._cut_groups(step, [g for p in parts for g in p.groups], judge)
        explained = (
            any(p.explained for p in parts)
            or any(f.kind in SPECIFIC for f in findings)
            or any(a.kind in SPECIFIC for a in self.book.firing(self.job))
        )
        self.held, due, folded = release(self.held, self.count, explained)
        self.stats.l1_folded += folded
        findings += [self.ex.l1(f, self.gpu.unseparated(f.first, f.last)) for f in due]
        t_ns = max(p.t_ns for p in parts)
        # every step kind counts as evaluated, as in one aggregator (a job that steps is not hung);
        # this book holds only the reducer's alerts
        return self.book.update(self.job, t_ns, findings, self.hosts, STEP_KINDS)

    def _cut_groups(self, step: int, gps: List[GroupPart], judge: bool) -> List[Finding]:
        """L3's group shift over each cut group, whole (as argus.aggregator.engine judges a group)."""
        th = self.th
        by: Dict[str, List[GroupPart]] = {}
        for g in gps:
            by.setdefault(g.key, []).append(g)
        out: List[Finding] = []
        for key, parts in sorted(by.items()):
            members = sorted({r for g in parts for r in g.members})
            if len(members) < th.min_group:
                continue
            grp = self.groups.by_comm.get(key)
            if key != "job" and grp is None:
                grp = self.groups.by_comm[key] = Group(key)
            if grp is not None:  # as one aggregator describes it: the whole group's members
                grp.members = set(members)
                grp.nranks = max(grp.nranks, len(members))
                if parts[0].op and not grp.ops:
                    grp.ops[parts[0].op] += 1
            hw = self.host_wait.get(key)
            if hw is None:
                hw = self.host_wait[key] = deque(maxlen=th.window)
            hw.append((step, median([g.host_wait for g in parts])))
            full = self.group_size[key] = max(self.group_size.get(key, 0), len(members))
            if len(members) != full:  # short of members: its level is not comparable with its past
                continue
            values: Dict[str, List[float]] = {}
            for g in parts:
                for p, v in g.values.items():
                    values.setdefault(p, []).extend(v)
            quiet = all(g.quiet for g in parts)
            for sh in self.l3.group_shift_values(step, key, values, parts[0].roles, quiet):
                if judge:
                    f = self.ex.shift(sh, members, step, host_wait_ratio(hw, sh.since))
                    if parts[0].identity:
                        f.evidence["identity"] = parts[0].identity
                    out.append(f)
        return out

    # ---- hangs ---------------------------------------------------------------------------------------

    def hang(self, p: HangPartial) -> List[Alert]:
        old = self.hang_by.get(p.shard)
        if old is not None and old.ts_ns > p.ts_ns:
            return []
        self.hang_by[p.shard] = p
        f, hosts = pick_hang(list(self.hang_by.values()))
        t_ns = max(x.ts_ns for x in self.hang_by.values())
        return self.book.update(self.job, t_ns, [f] if f else [], hosts, {"hang"}, resolve_after=2)
