"""The diagnosis engine: feeds summaries and heartbeats to the levels as they arrive and emits alert
transitions.

Input is anything iterable of `RankStep` / `Heartbeat` (a `StepSource`): a list, a JSONL file of
`argus probe --json` output (`JsonlSource`), or — once wired — the Redis reader. Per job, summaries
are aligned per step (argus.aggregator.state) and each step is judged once, in order, by every level
(L1, L2, host stall, L3); heartbeats are judged for hangs as they come. Work per step is linear in
the ranks of the step (medians per group and per collective instance, no pairwise comparison), and
the state kept per job is bounded by `Thresholds.window` steps.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Protocol, Set, Tuple, Union

from argus.aggregator import hoststall
from argus.aggregator.alerts import Alert, AlertBook, Finding
from argus.aggregator.align import POSITIONS, JobAlign
from argus.aggregator.clocks import HostClocks
from argus.aggregator.commmode import CommModes
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.distributions import L3
from argus.aggregator.explain import Explainer
from argus.aggregator.gpuarrival import GpuArrivals
from argus.aggregator.hang import HangWatch
from argus.aggregator.partials import GroupPart, HangPartial, StepPartial, summarize
from argus.aggregator.ranks import HOST_PHASES, L2, link_peers, name_culprits
from argus.aggregator.robust import median
from argus.aggregator.state import Aligner, Frame, Groups
from argus.aggregator.steptime import L1, L1Finding, release, steps_spanned
from argus.gpu import trouble
from argus.schema import Heartbeat, RankStep, read_jsonl

Item = Union[RankStep, Heartbeat]
STEP_KINDS = {
    "straggler",
    "pipeline_bubble",
    "slow_link",
    "host_stall",
    "kernel_degradation",
    "step_spike",
    "step_regression",
    "hang",
    "missing",
}
# kinds that explain a change of the job's step time (a missing host explains nothing of it)
SPECIFIC = STEP_KINDS - {"step_spike", "step_regression", "missing"}
#: alerts naming ranks from L2's flags: held while their ranks are still flagged now and then
L2_KINDS = {"straggler", "pipeline_bubble", "slow_link"}
#: what only the whole job can judge: a shard's engine leaves these to the reducer (argus.aggregator.reduce)
JOB_KINDS = {"step_spike", "step_regression", "hang"}
PY_WINDOW = 8  # steps of Python phases kept per rank for explanations


class StepSource(Protocol):
    """Where summaries come from: the Redis reader, a file, a list. Iteration yields items in arrival
    order and ends when the source is exhausted (a live source simply never ends)."""

    def __iter__(self) -> Iterator[Item]: ...


class JsonlSource:
    """A recorded file as a source (argus.schema.read_jsonl), without the processes' tails (no step
    number: nothing to align them with), counted in `skipped`."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self.skipped = 0

    def __iter__(self) -> Iterator[Item]:
        with open(self.path) as f:
            for x in read_jsonl(f, str(self.path)):
                if isinstance(x, RankStep) and x.step is None:
                    self.skipped += 1
                else:
                    yield x


@dataclass
class Stats:
    rank_steps: int = 0
    heartbeats: int = 0
    steps_judged: int = 0
    late_dropped: int = 0
    l1_folded: int = 0


@dataclass
class JobDiag:
    job: str
    th: Thresholds
    info: PhaseInfo
    aligner: Aligner
    groups: Groups
    l1: L1
    l2: L2
    l3: L3
    gpuarr: GpuArrivals
    hang: HangWatch = field(default_factory=HangWatch)
    align: JobAlign = field(default_factory=JobAlign)
    modes: CommModes = field(default_factory=CommModes)
    clocks: HostClocks = field(default_factory=HostClocks)
    hosts: Dict[int, str] = field(default_factory=dict)
    judged: int = 0
    last_step: int = -1
    last_t_ns: int = 0
    held: List[Tuple[L1Finding, int]] = field(default_factory=list)  # (finding, publish at judged count)
    gpu: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    host_wait: Dict[str, Deque[Tuple[int, float]]] = field(default_factory=dict)  # group -> (step, median)
    group_size: Dict[str, int] = field(default_factory=dict)  # symmetric group -> most members seen
    l1_log: Deque[L1Finding] = field(default_factory=lambda: deque(maxlen=256))  # for reports
    first_step: int = -1
    stall_since: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # rank -> (first step, judged #)
    colls: Deque[float] = field(default_factory=lambda: deque(maxlen=32))  # collectives per rank-step
    # recent Python-channel phases per rank (explanations only: sampled, never judged)
    py: Dict[int, Deque[Dict[str, int]]] = field(default_factory=dict)
    # steps a rank that had reported sent nothing for (an agent restarted, summaries lost): said,
    # never filled in. (rank, first missing job step, last), and the open ones: rank -> first
    gaps: Deque[Tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=256))
    absent: Dict[int, int] = field(default_factory=dict)
    reported: Set[int] = field(default_factory=set)
    beats: Dict[str, int] = field(default_factory=dict)  # host -> newest heartbeat (its agent's clock)

    def track_gaps(self, step: int, present: Set[int]) -> None:
        """Before `last_step` moves to `step`: job steps skipped since it are missing for every rank
        that had reported (no rank published them: all agents restarted, or all were lost)."""
        if self.last_step >= 0 and step > self.last_step + 1:
            for r in self.reported:
                self.absent.setdefault(r, self.last_step + 1)
        for r in present:
            first = self.absent.pop(r, None)
            if first is not None:
                self.gaps.append((r, first, step - 1))
        for r in self.reported - present:
            self.absent.setdefault(r, step)
        self.reported |= present


def coll_count(rs: RankStep) -> int:
    """Collectives and p2p ops of a summary, counted whether or not each has an instance (past the
    agent's records per step: every n-th), for how many steps it spans: steptime."""
    return sum(c.collectives + len(c.p2p) for c in rs.comms.values())


def host_wait_ratio(hw: Deque[Tuple[int, float]], since: int) -> Dict[str, Any]:
    before = [v for s, v in hw if s < since][-16:]
    after = [v for s, v in hw if s >= since]
    if not before or not after or median(before) <= 0:
        return {}
    return {
        "host_wait_ms": round(median(after) / 1e6, 2),
        "host_wait_ratio": round(median(after) / median(before), 2),
    }


class Engine:
    """`shard` >= 0: the engine of one shard of a job split over several aggregators
    (argus.aggregator.sharded): it judges the ranks it is given and leaves the job-wide kinds
    (`JOB_KINDS`) to the reducer, to which it hands `partials` and `hangs` instead."""

    def __init__(
        self,
        thresholds: Optional[Thresholds] = None,
        phases: Optional[PhaseInfo] = None,
        book: Optional[AlertBook] = None,
        shard: int = -1,
    ) -> None:
        self.th = thresholds or Thresholds()
        self.info = phases or PhaseInfo({})
        self.book = book or AlertBook(self.th.resolve_after)
        self.jobs: Dict[str, JobDiag] = {}
        self.stats = Stats()
        self.transitions: List[Alert] = []
        self.shard = shard
        self.partials: List[StepPartial] = []  # judged steps, for the reducer (taken by the caller)
        self.hangs: Dict[str, HangPartial] = {}  # job -> the newest hang judgement, for the reducer
        self.scope: Dict[str, int] = {}  # job -> ranks this shard judges (its frames wait for these)
        self.whole: Dict[str, Set[str]] = {}  # job -> communicators kept whole in this shard
        self._told: Dict[str, Set[int]] = {}

    def set_scope(self, job: str, nranks: int, whole: Optional[Set[str]] = None) -> None:
        """A shard's rank count: its steps are complete with these, not with the job's world; and
        the communicators whose every member it judges (the others are cut: argus.aggregator.partition)."""
        self.scope[job] = nranks
        if whole is not None:
            self.whole[job] = whole
        d = self.jobs.get(job)
        if d is not None:
            d.aligner.scope = d.aligner.world = nranks
            d.align.scope = d.align.world = nranks

    # ---- input ----------------------------------------------------------------------------------------

    def _job(self, job: str) -> JobDiag:
        d = self.jobs.get(job)
        if d is None:
            th = self.th
            d = self.jobs[job] = JobDiag(
                job,
                th,
                self.info,
                Aligner(th.lag_steps, max_pending=th.window, lag_s=th.lag_s),
                Groups(th.min_group),
                L1(th),
                L2(th, self.info),
                L3(th),
                GpuArrivals(th),
            )
            if job in self.scope:
                self.set_scope(job, self.scope[job])
        return d

    def add(self, item: Item) -> List[Alert]:
        if isinstance(item, Heartbeat):
            return self.add_heartbeat(item)
        return self.add_step(item)

    def add_step(self, rs: RankStep) -> List[Alert]:
        self.stats.rank_steps += 1
        d = self._job(rs.job)
        d.hosts[rs.rank] = rs.host  # the rank's own host wins over its agent's (heartbeats come first)
        if rs.gpu:
            d.gpu[rs.rank] = rs.gpu  # NVML's latest sample of its device: evidence for its alerts
        out: List[Alert] = []
        for x in d.align.add(rs):  # on the job's step numbers and communicators (argus.aggregator.align)
            out += self._take(d, x)
        return out

    def _take(self, d: JobDiag, rs: RankStep) -> List[Alert]:
        before = d.aligner.late
        d.aligner.add(rs)
        if d.aligner.late != before:
            self.stats.late_dropped += 1
            return []
        d.groups.observe(rs)
        out: List[Alert] = []
        for frame in d.aligner.ready():
            out += self._judge(d, frame)
        return out

    def _job_beat(self, d: JobDiag, hb: Heartbeat) -> Tuple[Heartbeat, Dict[int, Dict[str, int]]]:
        """The heartbeat on the job's communicators and collective positions (what each rank's own
        sequence numbers are in the job's steps), and each rank's next position per communicator."""
        last: Dict[int, Dict[str, int]] = {}
        nxt: Dict[int, Dict[str, int]] = {}
        for r, m in hb.last_seq.items():
            for c, seq in m.items():
                pos, after = d.align.position(r, c, seq), d.align.position(r, c, seq + 1)
                if pos is None or after is None:
                    continue
                last.setdefault(r, {})[pos[0]] = pos[1] * POSITIONS + pos[2]
                nxt.setdefault(r, {})[pos[0]] = after[1] * POSITIONS + after[2]
        inflight = []
        for f in hb.inflight:
            comm: Optional[str] = f.comm
            jseq: Optional[int] = None
            if comm is not None:
                pos = d.align.position(f.rank, comm, f.seq) if f.seq is not None else None
                after = d.align.position(f.rank, comm, f.seq + 1) if f.seq is not None else None
                comm = pos[0] if pos else d.align.job_comm(f.rank, comm) or comm
                if pos is not None:
                    jseq = pos[1] * POSITIONS + pos[2]
                if pos is not None and after is not None and jseq is not None:
                    # a blocking call entered and not returned made no record yet: it counts
                    if jseq > last.get(f.rank, {}).get(pos[0], -1):
                        last.setdefault(f.rank, {})[pos[0]] = jseq
                        nxt.setdefault(f.rank, {})[pos[0]] = after[1] * POSITIONS + after[2]
            inflight.append(dataclasses.replace(f, comm=comm, seq=jseq))
        return dataclasses.replace(hb, last_seq=last, inflight=inflight), nxt

    def add_heartbeat(self, hb: Heartbeat) -> List[Alert]:
        self.stats.heartbeats += 1
        d = self._job(hb.job)
        for r in hb.ranks:
            d.hosts.setdefault(r, hb.host)
        d.beats[hb.host] = max(d.beats.get(hb.host, 0), hb.ts_ns)
        jb, nxt = self._job_beat(d, hb)
        d.hang.add(jb, nxt)
        base = d.l1.median_step()
        threshold = max(self.th.hang_min_s, self.th.hang_steps * base / 1e9)
        members = {g.comm: set(g.members) for g in d.groups.by_comm.values()}
        h = d.hang.judge(threshold, members)
        ex = Explainer(d.job, d.groups, self.info, d.hosts, align=d.align, modes=d.modes)
        findings = [ex.hang(h, d.last_step if d.last_step >= 0 else None)] if h else []
        if self.shard >= 0:  # a cut communicator's other part sees nobody behind: the reducer picks
            f = findings[0] if findings else None
            hosts = {r: d.hosts[r] for r in (f.ranks if f else []) if r in d.hosts}
            named = h is not None and bool(h.missing)
            self.hangs[d.job] = HangPartial(d.job, self.shard, d.hang.now_ns(), f, hosts, named)
            return []
        return self._publish(d, d.hang.now_ns(), findings, {"hang"}, resolve_after=2)

    def flush(self) -> List[Alert]:
        """Judge every pending step (end of a finite source)."""
        out: List[Alert] = []
        for d in self.jobs.values():
            for x in d.align.flush():
                d.aligner.add(x)
                d.groups.observe(x)
            for frame in d.aligner.ready(flush=True):
                out += self._judge(d, frame)
        return out

    def run(self, source: Iterable[Item]) -> List[Alert]:
        out: List[Alert] = []
        for item in source:
            out += self.add(item)
        out += self.flush()
        return out

    # ---- judging one step -------------------------------------------------------------------------------

    def _judge(self, d: JobDiag, frame: Frame) -> List[Alert]:
        th = self.th
        ranks = frame.ranks
        if not ranks:
            return []
        # hosts' clock offsets out of the realtime stamps before ranks are compared (argus.aggregator.clocks)
        d.clocks.observe(ranks)
        ranks = d.clocks.correct(ranks)
        self.stats.steps_judged += 1
        d.track_gaps(frame.step, set(ranks))
        d.judged += 1
        d.last_step = frame.step
        if d.first_step < 0:
            d.first_step = frame.step
        t_ns = max(rs.end_ns for rs in ranks.values())
        d.last_t_ns = t_ns
        step_ns = median([rs.duration_ns for rs in ranks.values()])
        base_ns = d.l1.median_step() or step_ns
        # a job seen from its start is noisiest there; one attached to is in its steady state
        start = d.align.absolute and d.first_step < th.warmup_steps
        warm = th.warmup_steps if start else th.attach_warmup_steps
        judge = d.judged > warm
        young = not start and d.judged <= warm + th.young_steps
        for r, rs in ranks.items():
            if rs.py_phases:
                q = d.py.get(r)
                if q is None:
                    q = d.py[r] = deque(maxlen=PY_WINDOW)
                q.append(rs.py_phases)
        ex = Explainer(d.job, d.groups, self.info, d.hosts, d.py, d.align, d.modes, d.gpuarr)
        findings: List[Finding] = []

        # blocking communicators: the host's wait inside their calls is a phase (argus.aggregator.commmode)
        d.modes.observe(ranks, d.groups)
        d.modes.add_wait_phases(ranks, d.groups)
        # which GPU reached the previous step's collectives last (argus.aggregator.gpuarrival)
        floor = max(th.gpu_late_min_ns, th.gpu_late_share * base_ns)
        before = d.gpuarr.records[-1] if d.gpuarr.records else None
        last_gpu = d.gpuarr.judge(
            frame.step, ranks, d.groups, d.groups.symmetric(ranks), d.clocks.uncertainty, floor
        )
        # L2 (and host stalls, which take their ranks out of the straggler count)
        flags = d.l2.measure(frame.step, ranks, d.groups, base_ns, judge, last_gpu)
        stalls = hoststall.detect(ranks, flags, step_ns, base_ns, th) if judge else []
        d.l2.remember(flags)
        for s in stalls:
            r = s["rank"]
            since = d.stall_since.get(r)
            if since is None or since[1] < d.judged - th.resolve_after:
                since = (frame.step, d.judged)
            d.stall_since[r] = (since[0], d.judged)
            findings.append(ex.stall(r, s["evidence"], since[0], frame.step))
        is_async = d.modes.job_blocking() is False
        cands = d.l2.persistent(young, is_async) if judge else set()
        if judge and young:  # two linked ranks standing out together is not independent noise
            loose = d.l2.persistent(False, is_async)
            cands |= {r for r in loose if link_peers(r, d.groups) & loose}
        named: Set[int] = set()
        # a candidate's link peers flagged in its last steps are judged with it: a slow link shows on
        # both ends, but on a noisy host one end may dip under the thresholds in the step judged
        flagged = d.l2.recently_flagged() if judge else set()
        assessed = {r for r, f in flags.items() if f.dev}  # ranks whose phases this step judged
        for c in name_culprits(cands, flagged, d.l2, d.groups, th, assessed):
            findings.append(ex.culprit(c, d.l2, flags, frame.step, th.window))
            named |= set(c.ranks) | set(c.victims)

        # L3: group vs own past every step, rank vs group every `l3_every` steps
        # a rank L2 flagged within L3's window is L2's to judge: a burst is not a drift
        named_or_flagged = named | d.l2.flagged_within(th.l3_window) | cands
        parts: List[GroupPart] = []
        for key, members in d.l2.members.items():
            cut = self.shard >= 0 and key not in self.whole.get(d.job, ())
            if len(members) < (1 if cut else th.min_group):
                continue
            rsl = [ranks[r] for r in members]
            roles = dict(d.l2.roles.get(key, {}))
            quiet = not (set(members) & (named | cands))  # a one-step noise flag does not veto
            if cut:  # the reducer judges the whole group's shift (argus.aggregator.reduce)
                parts.append(self._group_part(d, key, members, rsl, roles, quiet))
                if len(members) < th.min_group:
                    continue
            hw = d.host_wait.get(key)
            if hw is None:
                hw = d.host_wait[key] = deque(maxlen=th.window)
            hw.append((frame.step, median([rs.phases.get("host_wait", 0) for rs in rsl])))
            full = d.group_size[key] = max(d.group_size.get(key, 0), len(members))
            # a group short of members this step (a rank's data late or lost) has another minimum:
            # its level is not comparable with its past
            shifts = (
                d.l3.group_shift(frame.step, key, rsl, roles, quiet)
                if len(members) == full and not cut
                else []
            )
            for sh in shifts:
                if judge:
                    findings.append(ex.shift(sh, sorted(members), frame.step, host_wait_ratio(hw, sh.since)))
            phases = sorted(p for p in rsl[0].phases if p not in HOST_PHASES and roles.get(p) != "comm")
            d.l3.push(key, rsl, phases)
            if judge and d.judged % th.l3_every == 0:
                for dr in d.l3.rank_drift(key, members):
                    if dr.rank not in named_or_flagged:
                        findings.append(ex.drift(dr, frame.step, th.l3_window))

        # L1: held until a level explains it, else published alone
        colls = [coll_count(x) for x in ranks.values()]
        l1 = d.l1.observe(frame.step, step_ns / steps_spanned(colls, d.colls))
        if self.shard >= 0:  # the job's step time is the reducer's: this shard's ranks are part of it
            self._partial(d, frame.step, t_ns, ranks, colls, findings, before, parts)
        else:
            for f in l1:
                if judge:
                    d.held.append((f, d.judged + th.l1_hold_steps))
                    d.l1_log.append(f)
            findings += self._release_l1(d, findings, ex)
        self._attach_gpu(d, findings)
        clocks = d.clocks.evidence()
        for fd in findings if clocks else []:
            if fd.ranks:  # the lateness behind it compared stamps of hosts whose clocks disagree
                fd.evidence.setdefault("identity", {})["clocks"] = clocks
        findings += self._missing(d, frame.step, t_ns, ex)
        held = {a.id for a in self.book.firing(d.job) if a.kind in L2_KINDS and d.l2.still_flagged(a.ranks)}
        return self._publish(d, t_ns, findings, STEP_KINDS, held=held)

    def _missing(self, d: JobDiag, step: int, t_ns: int, ex: Explainer) -> List[Finding]:
        """Ranks that had reported and fell silent while the others kept stepping, one finding per
        host: the levels judge only the ranks present, so without this a host cut off from Redis
        (or whose agent died) would simply vanish from the diagnosis."""
        th = self.th
        silent: Dict[str, List[int]] = {}
        quiet: Dict[str, List[int]] = {}  # silent for half as long: a host's ranks stop a step apart
        for r, first in d.absent.items():
            last_end = d.aligner.last_end.get(r)
            if last_end is None or step - first + 1 < th.missing_steps:
                continue
            if t_ns - last_end >= th.missing_s * 1e9:
                silent.setdefault(d.hosts.get(r, ""), []).append(r)
            elif t_ns - last_end >= th.missing_s * 0.5e9:
                quiet.setdefault(d.hosts.get(r, ""), []).append(r)
        out: List[Finding] = []
        if not silent:  # the common case, every judged step: nothing more to look at
            return out
        # a host cut off together: the rank whose last summary came a step later is missing with the
        # others, not one still stepping (CI: "ranks [4, 5, 7] ... while 5 other rank(s) kept stepping")
        for host, rs in silent.items():
            rs.extend(quiet.get(host, ()))
        newest_beat = max(d.beats.values(), default=0)
        # ranks back from a silence this long just now: a host's ranks come back one by one (its agent
        # sends a rank's backlog at a time), which does not make the host's silence partial
        back = {
            r for r, lo, hi in d.gaps if step - hi <= th.missing_steps and hi - lo + 1 >= th.missing_steps
        }
        for host, rs in sorted(silent.items()):
            on_host = sorted(r for r in d.reported if d.hosts.get(r, "") == host)
            first = min(d.absent[r] for r in rs)
            since = min(d.aligner.last_end[r] for r in rs)
            beat = d.beats.get(host)
            beat_age = (newest_beat - beat) / 1e9 if beat is not None and newest_beat else None
            out.append(
                ex.missing(
                    host,
                    sorted(rs),
                    on_host,
                    (first, step),
                    (t_ns - since) / 1e9,
                    beat_age,
                    len(d.reported) - len(rs),
                    sorted(back & set(on_host)),
                )
            )
        return out

    def _partial(
        self,
        d: JobDiag,
        step: int,
        t_ns: int,
        ranks: Dict[int, RankStep],
        colls: List[int],
        findings: List[Finding],
        before: Any,
        parts: List[GroupPart],
    ) -> None:
        """What the reducer needs of this step (argus.aggregator.partials), taken at the point where
        the whole-job engine decides whether a level explains a slower step."""
        explained = any(f.kind in SPECIFIC for f in findings) or any(
            a.kind in SPECIFIC for a in self.book.firing(d.job)
        )
        told = self._told.setdefault(d.job, set())  # ranks whose host the reducer knows
        recs = list(d.gpuarr.records)
        new = []  # the evidence records this step's judging appended
        while recs and recs[-1] is not before:
            new.append(recs.pop())
        self.partials.append(
            StepPartial(
                d.job,
                self.shard,
                step,
                t_ns,
                [rs.duration_ns for rs in ranks.values()],
                colls,
                explained,
                d.align.absolute,
                new[::-1],
                parts,
                {r: rs.host for r, rs in ranks.items() if r not in told},
            )
        )
        told.update(ranks)

    def _group_part(
        self,
        d: JobDiag,
        key: str,
        members: List[int],
        rsl: List[RankStep],
        roles: Dict[str, str],
        quiet: bool,
    ) -> GroupPart:
        g = d.groups.by_comm.get(key)
        comm = None if g is None else key
        values = {p: summarize([float(rs.phases[p]) for rs in rsl if p in rs.phases]) for p in roles}
        hw = median([rs.phases.get("host_wait", 0) for rs in rsl])
        ident = d.align.identity(comm, members) if comm else {}
        return GroupPart(key, sorted(members), quiet, roles, values, hw, g.main_op if g else None, ident)

    def _release_l1(self, d: JobDiag, findings: List[Finding], ex: Explainer) -> List[Finding]:
        explained = any(f.kind in SPECIFIC for f in findings) or any(
            a.kind in SPECIFIC for a in self.book.firing(d.job)
        )
        d.held, due, folded = release(d.held, d.judged, explained)
        self.stats.l1_folded += folded
        # nothing named: say whether the GPUs' arrivals could have told who held the job up
        return [ex.l1(f, d.gpuarr.unseparated(f.first, f.last)) for f in due]

    def _attach_gpu(self, d: JobDiag, findings: List[Finding]) -> None:
        if not d.gpu:
            return
        for f in findings:
            g = {r: d.gpu[r] for r in f.ranks if r in d.gpu}
            if g:
                f.evidence["gpu"] = g
            said = [f"rank {r}'s GPU: {t}" for r, t in ((r, trouble(v)) for r, v in sorted(g.items())) if t]
            if said and "GPU:" not in f.summary:  # once, however often the finding is re-judged
                f.summary += ". NVML: " + "; ".join(said)

    def _publish(
        self,
        d: JobDiag,
        t_ns: int,
        findings: List[Finding],
        evaluated: Set[str],
        resolve_after: Optional[int] = None,
        held: Optional[Set[str]] = None,
    ) -> List[Alert]:
        out = self.book.update(d.job, t_ns, findings, d.hosts, evaluated, resolve_after, held)
        self.transitions += out
        return out

    # ---- queries ------------------------------------------------------------------------------------

    def alerts(self, job: Optional[str] = None) -> List[Alert]:
        return sorted(self.book.all(job), key=lambda a: (a.first_seen, a.id))
