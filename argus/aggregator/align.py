"""Put every rank on the job's step numbers and collective instances, whenever its agent attached.

An agent numbers a rank's steps and collectives itself: from the communicators' creation when it
saw them created (`step_source` "nccl-seq": the trainer's own step index, the same on every rank),
else from when it attached (`ordinal`, a local count). No NCCL field counts collectives one by one,
so nothing read from the process can renumber a late-attached rank. Synchronous training does:
every rank ends step *n* within a small part of a step of the others (they all wait for the same
collectives). So each rank's own step numbers get an offset onto the job's, found by matching its
step *end times* (realtime, with the agent's clock offset applied) against the job's, and checked
at every step; collective instances are numbered by their order within the step
(`step * POSITIONS + i`). What does not fit is said, never guessed: a rank whose step ends do not
line up within the tolerance, or whose clocks are too uncertain, stays out of the judgement, and
an instance whose count differs between ranks is not matched (argus.aggregator.ranks).

Communicators: a key every rank shares (commHash read through a validated layout, or the unique
id's hash when the agent saw the creation) identifies a communicator across ranks as it is. A key
of one process only (the agent knew the handle and perhaps rank/nRanks from the accessors) is
matched here: communicators of one job are grouped by their size and their per-step call
signature (op, bytes, in order), and split into communicators of that size by the stride of the
global ranks over the ranks within the communicator (DP groups across TP groups have stride tp,
TP groups stride 1). Each job communicator keeps where its identity came from, and how sure that
is: table/init/split (high), accessors (medium: an exact split by size and rank), inferred (low:
no sizes; ranks with the same calls grouped together).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

from argus.aggregator.robust import median
from argus.schema import CommStep, RankStep

POSITIONS = 1 << 16  # rewritten sequence numbers: job step * POSITIONS + position in the step
SHARED = ("table", "init", "split")
CONFIDENCE = {"table": "high", "init": "high", "split": "high", "accessors": "medium", "inferred": "low"}
Sig = Tuple[Any, ...]


@dataclass(frozen=True)
class AlignParams:
    #: own steps needed before a rank is aligned by time
    min_steps: int = 3
    #: a step end must lie within this fraction of the median step of the job's (and clocks must
    #: be known better than that): nearest-step matching is unambiguous well below half a step
    tol_frac: float = 0.25
    #: consecutive misfitting steps before a rank is aligned afresh
    max_misfits: int = 3
    #: job time (s, and steps) the first ranks wait for the others to align before they are judged
    #: without them
    hold_s: float = 3.0
    hold_steps: int = 6
    #: summaries kept per rank while it is not aligned
    max_pending: int = 64
    #: job steps of reference end times kept
    window: int = 256
    #: newest job steps whose every end time is kept (older ones: only their median, which is all
    #: alignment needs; every rank's ends for `window` steps was ~100 MB at 10,000 ranks)
    raw_steps: int = 16


def fit_offset(
    own: Sequence[Tuple[int, int]], ref: Dict[int, int], tol_ns: float, min_n: int = 2
) -> Tuple[Optional[int], float, str]:
    """(offset, median residual ns, why not) mapping own steps onto the job's: own step s ends at
    e; the job's step s + offset should end at ref[s + offset]. The offset voted by nearest ends is
    accepted when its median residual is within `tol_ns` and clearly better than its neighbours'."""
    if not ref or not own:
        return None, float("inf"), "no job steps to align with yet"
    keys = sorted(ref, key=ref.__getitem__)
    ends = [ref[k] for k in keys]
    votes: Counter = Counter()
    for s, e in own:
        i = bisect.bisect_left(ends, e)
        near = [j for j in (i - 1, i) if 0 <= j < len(ends)]
        g = keys[min(near, key=lambda j: abs(ends[j] - e))]
        votes[g - s] += 1
    o = votes.most_common(1)[0][0]

    def resid(off: int) -> float:
        d = [abs(e - ref[s + off]) for s, e in own if s + off in ref]
        return median(d) if len(d) >= min_n else float("inf")

    r0 = resid(o)
    if r0 == float("inf"):
        return None, r0, "too few steps overlap the job's yet"
    if r0 > tol_ns:
        return (
            None,
            r0,
            f"its step ends are {r0 / 1e6:.1f} ms from the job's (tolerance {tol_ns / 1e6:.1f} ms)",
        )
    rn = min(resid(o - 1), resid(o + 1))
    if rn < 2 * r0:
        return (
            None,
            r0,
            f"ambiguous: offsets {o} and its neighbour fit alike ({r0 / 1e6:.1f} vs {rn / 1e6:.1f} ms)",
        )
    return o, r0, ""


def signature(c: CommStep) -> Sig:
    """What one rank issued on a communicator in a step: collectives in order with their sizes; for
    send/recv only links, the multiset of sizes (the two ends of a link issue complementary ops)."""
    if c.seqs:
        return ("coll", tuple(c.ops), tuple(c.nbytes))
    return ("p2p", tuple(sorted(p.nbytes for p in c.p2p)))


@dataclass
class JobComm:
    key: str
    source: str  # table | init | split | accessors | inferred
    nranks: int = -1
    members: Dict[int, int] = field(default_factory=dict)  # global rank -> rank in the communicator
    sig: Optional[Sig] = None
    note: str = ""

    @property
    def confidence(self) -> str:
        return CONFIDENCE.get(self.source, "low")

    def stride(self) -> Optional[Tuple[int, int]]:
        """(stride, base) of global ranks over communicator ranks, once two members say it."""
        ms = sorted((c, g) for g, c in self.members.items() if c >= 0)
        if len(ms) < 2:
            return None
        (c0, g0), (c1, g1) = ms[0], ms[1]
        if c1 == c0 or (g1 - g0) % (c1 - c0):
            return None
        s = (g1 - g0) // (c1 - c0)
        return s, g0 - c0 * s

    def fits(self, g: int, c: int) -> bool:
        if c in self.members.values() or (self.nranks > 0 and len(self.members) >= self.nranks):
            return False
        sb = self.stride()
        return sb is None or (c >= 0 and g - c * sb[0] == sb[1])


def _key(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def partition(members: Dict[int, int], nranks: int) -> Optional[List[Dict[int, int]]]:
    """Split global rank -> communicator rank into communicators of `nranks` ranks, each holding a
    communicator rank at most once: by the smallest stride s for which base = g - c*s groups the
    members into as few communicators as their number allows (members still missing fit later)."""
    if nranks <= 0 or not members or any(c < 0 or c >= nranks for c in members.values()):
        return None
    need = -(-len(members) // nranks)
    for s in range(1, max(members) + 2):
        groups: Dict[int, Dict[int, int]] = {}
        for g, c in members.items():
            groups.setdefault(g - c * s, {})[g] = c
        if len(groups) == need and all(len(set(m.values())) == len(m) for m in groups.values()):
            return list(groups.values())
    return None


class CommMatcher:
    """(rank, the rank's own communicator key) -> the job's communicator."""

    def __init__(self) -> None:
        self.comms: Dict[str, JobComm] = {}
        self.of: Dict[Tuple[int, str], str] = {}
        self.waiting: Dict[Tuple[int, str], Tuple[Sig, int, int]] = {}  # -> (sig, nranks, comm rank)
        self.notes: List[str] = []

    def observe(self, rank: int, c: CommStep) -> None:
        k = (rank, c.comm)
        if k in self.of or k in self.waiting:
            return
        if c.identity in SHARED:
            jc = self.comms.get(c.comm)
            if jc is None:
                jc = self.comms[c.comm] = JobComm(c.comm, c.identity, c.nranks)
            jc.members[rank] = c.rank
            jc.nranks = max(jc.nranks, c.nranks)
            if jc.sig is None:
                jc.sig = signature(c)
            self.of[k] = c.comm
            return
        self.waiting[k] = (signature(c), c.nranks, c.rank)

    def match(self) -> None:
        """Give waiting local communicators a job communicator: join one with the same calls and a
        free place, else split them by size and stride (called when no rank is still being
        aligned, so the members of a communicator come together)."""
        for k, (sig, n, c) in list(self.waiting.items()):
            rank = k[0]
            for jc in self.comms.values():
                if jc.sig != sig:
                    continue
                if n < 0 and jc.source == "inferred":  # sizes unknown: everyone with these calls
                    c = len(jc.members)
                elif not ((n < 0 or jc.nranks in (-1, n)) and jc.fits(rank, c)):
                    continue
                jc.members[rank] = c
                self.of[k] = jc.key
                del self.waiting[k]
                break
        if not self.waiting:
            return
        classes: Dict[Tuple[Sig, int], Dict[int, Tuple[str, int]]] = {}
        for (rank, local), (sig, n, c) in self.waiting.items():
            classes.setdefault((sig, n), {})[rank] = (local, c)
        for (sig, n), ms in classes.items():
            cranks = {g: c for g, (_l, c) in ms.items()}
            if n > 0:
                parts = partition(cranks, n)
                if parts is None:
                    self._note(
                        f"{len(ms)} ranks issue the same calls on communicators of {n} ranks but do not "
                        "split into such communicators by rank: not matched"
                    )
                    continue
                source, note = "accessors", f"matched by size ({n}), calls and rank stride"
            else:
                parts = [{g: i for i, g in enumerate(sorted(cranks))}]
                source, note = "inferred", "sizes unknown: ranks issuing the same calls grouped together"
            for members in parts:
                key = _key(sig, sorted(members))
                jc = self.comms.setdefault(
                    key, JobComm(key, source, n if n > 0 else len(members), {}, sig, note)
                )
                for g, c in members.items():
                    jc.members[g] = c
                    local = ms[g][0]
                    self.of[(g, local)] = key
                    del self.waiting[(g, local)]

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


@dataclass
class RankAlign:
    rank: int
    offset: Optional[int] = None  # job step = own step + offset
    method: str = ""  # nccl-seq | time | anchor
    residual_ns: float = 0.0
    tol_ns: float = 0.0
    pending: Deque[RankStep] = field(default_factory=deque)
    misfits: int = 0
    why_not: str = ""
    since_end: int = 0  # the job's newest step end when its summaries started waiting for alignment
    # own comm key -> (job step, first own sequence number, instances) of its last aligned step
    seqpos: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)
    last: Optional[Tuple[int, int, str, int]] = None  # (own step, end ns, host, pid) of its newest summary


@dataclass
class AlignStats:
    realigned: int = 0
    restarted: int = 0  # a rank's own numbering began again (its agent restarted, or a new pid)
    extrapolated: int = 0  # aligned by the job's step time past a gap no aligned rank covers
    pending_dropped: int = 0
    clock_refused: int = 0


class JobAlign:
    """Feed a job's summaries in arrival order; get them back on the job's numbering, in order."""

    def __init__(self, params: Optional[AlignParams] = None) -> None:
        self.p = params or AlignParams()
        self.ranks: Dict[int, RankAlign] = {}
        # ranks given summaries while unaligned: `_holding` looks at these, not at every rank (a scan
        # of all ranks per summary made a step cost O(ranks²): 2,900 rank-steps/s at 10,000 ranks)
        self._waiting: Set[int] = set()
        self.ends: Dict[int, List[int]] = {}  # newest job steps -> end times of aligned ranks
        self.ref_ends: Dict[int, int] = {}  # older job steps -> the median of their end times
        # job step -> (ends it was taken over, median of the newest steps' ends): a median of every
        # rank's end on each summary was O(ranks log ranks) a summary (time-aligned ranks at 10,000)
        self._medians: Dict[int, Tuple[int, float]] = {}
        self.durations: Deque[int] = deque(maxlen=64)
        self.absolute = False  # job steps count from the communicators' creation
        self.anchor: Optional[int] = None  # the job step the numbering was anchored at
        self.anchor_end = 0  # when (its end) that step was
        self.newest = 0  # the newest step end seen (the job's clock)
        self.top = -1  # highest job step of an aligned summary
        self.world = -1  # world size the ranks report (-1: unknown)
        self.scope = -1  # a shard's ranks (argus.aggregator.sharded): the world it waits for
        self.outbox: List[RankStep] = []
        self.comms = CommMatcher()
        self.stats = AlignStats()

    # ---- input ------------------------------------------------------------------------------------

    def add(self, rs: RankStep) -> List[RankStep]:
        if rs.step is None:
            return []
        ra = self.ranks.get(rs.rank)
        if ra is None:
            ra = self.ranks[rs.rank] = RankAlign(rs.rank)
        self.durations.append(rs.duration_ns)
        self.newest = max(self.newest, rs.end_ns)
        out: List[RankStep] = []
        self._restart(ra, rs)
        if ra.offset is None:
            if not ra.pending:
                ra.since_end = max(self.newest, rs.end_ns)
            ra.pending.append(rs)
            self._waiting.add(rs.rank)
            if len(ra.pending) > self.p.max_pending:
                ra.pending.popleft()
                self.stats.pending_dropped += 1
            self._try_align(ra)
        else:
            self._check(ra, rs)
            if ra.offset is None:
                self._try_align(ra)
            else:
                self.outbox.append(self._rewrite(ra, rs))
        self.world = self.scope if self.scope > 0 else max(self.world, rs.world_size)
        return out if self._holding() else self._release()

    def flush(self) -> List[RankStep]:
        """End of a finite source: what is aligned goes out (the rest was never aligned: said)."""
        return self._release()

    def _release(self) -> List[RankStep]:
        self.comms.match()
        out, self.outbox = self.outbox, []
        return sorted((self.resolve(x) for x in out), key=lambda x: (x.step or 0, x.rank))

    # ---- alignment --------------------------------------------------------------------------------

    def step_ns(self) -> float:
        return median(list(self.durations)) if self.durations else 0.0

    def _median_end(self, g: int) -> float:
        """The median end of job step `g` among aligned ranks, taken again once its ends grew by a
        quarter: the median of a few thousand ends hardly moves with the next few, and the
        tolerances it is compared with are a fraction of a step."""
        v = self.ends.get(g, [])
        c = self._medians.get(g)
        if c is None or len(v) < 32 or len(v) >= c[0] * 5 // 4:
            c = self._medians[g] = (len(v), median(v))
        return c[1]

    def _ref(self) -> Dict[int, int]:
        return {**self.ref_ends, **{g: int(self._median_end(g)) for g, v in self.ends.items() if v}}

    def _try_align(self, ra: RankAlign) -> None:
        first = ra.pending[0]
        if self.anchor is None:
            nccl = first.step_source == "nccl-seq"
            others_abs = any(
                x.pending and x.pending[0].step_source == "nccl-seq"
                for x in self.ranks.values()
                if x is not ra
            )
            if nccl or (len(ra.pending) >= self.p.min_steps and not others_abs):
                self.absolute = nccl
                self.anchor = first.step or 0
                self.anchor_end = first.end_ns
                self._aligned(ra, 0, "nccl-seq" if nccl else "anchor", 0.0, 0.0)
            return
        if self.absolute and first.step_source == "nccl-seq":
            self._aligned(ra, 0, "nccl-seq", 0.0, 0.0)
            return
        if len(ra.pending) < self.p.min_steps:
            return
        step = self.step_ns() or float(median([x.duration_ns for x in ra.pending]))
        tol = max(self.p.tol_frac * step, 1e6)
        unc = max(x.clock_uncertainty_ns for x in ra.pending)
        if unc > tol:
            ra.why_not = (
                f"its host clock is known to ±{unc / 1e6:.1f} ms, too uncertain to align steps of "
                f"{step / 1e6:.0f} ms (tolerance {tol / 1e6:.1f} ms): fix clock sync (chrony/PTP)"
            )
            self.stats.clock_refused += 1
            return
        own = [(x.step or 0, x.end_ns) for x in ra.pending]
        off, res, why = fit_offset(own, self._ref(), tol, min_n=min(self.p.min_steps, len(own)))
        if off is None:
            ext = self._extrapolate(ra, step)
            if ext is None:
                ra.why_not = why
                return
            self.stats.extrapolated += 1
            self._aligned(ra, ext, "extrapolated", 0.0, tol)
            return
        self._aligned(ra, off, "time", res, tol)

    def _restart(self, ra: RankAlign, rs: RankStep) -> None:
        """A rank whose own step numbers go back while its time goes on, or that another process
        or host now publishes: its agent restarted (ordinals from 0 again) or the rank did. Its old
        offset means nothing now: it is aligned afresh."""
        last, ra.last = ra.last, (rs.step or 0, rs.end_ns, rs.host, rs.pid)
        if last is None or ra.offset is None or (ra.method == "nccl-seq" and rs.step_source == "nccl-seq"):
            return
        went_back = (rs.step or 0) < last[0] and rs.end_ns > last[1]
        if went_back or (rs.host, rs.pid) != (last[2], last[3]):
            self.stats.restarted += 1
            ra.offset, ra.method, ra.misfits = None, "", 0
            ra.why_not = "its own step numbers began again (agent or rank restarted): aligning it afresh"

    def _extrapolate(self, ra: RankAlign, step_ns: float) -> Optional[int]:
        """No aligned rank has ended a step near this rank's (every rank's agent restarted, or it
        is the only one): put its first pending step at the job's newest step plus the steps the
        job's step time fits in between. Never into the past."""
        ref = self._ref()
        if not ref or step_ns <= 0:
            return None
        top = max(ref)
        first = ra.pending[0]
        if first.end_ns <= ref[top] + 2 * step_ns:  # the reference covers it: time fitting decides
            return None
        g = top + max(1, round((first.end_ns - ref[top]) / step_ns))
        return g - (first.step or 0)

    def _aligned(self, ra: RankAlign, off: int, method: str, res: float, tol: float) -> None:
        ra.offset, ra.method, ra.residual_ns, ra.tol_ns, ra.why_not, ra.misfits = off, method, res, tol, "", 0
        pending, ra.pending = list(ra.pending), deque()
        for rs in pending:
            self.outbox.append(self._rewrite(ra, rs))

    def _check(self, ra: RankAlign, rs: RankStep) -> None:
        """An aligned rank must keep ending its steps with the job's; else it is aligned afresh (its
        agent may have cut a step in two, or missed a boundary)."""
        assert ra.offset is not None
        g = (rs.step or 0) + ra.offset
        others = self.ends.get(g, [])
        ref = self.ref_ends.get(g)
        step = self.step_ns()
        if (not others and ref is None) or step <= 0 or ra.method == "nccl-seq":
            return
        tol = max(self.p.tol_frac * step, 1e6)
        if abs(rs.end_ns - (ref if ref is not None else self._median_end(g))) <= tol:
            ra.misfits = 0
            return
        ra.misfits += 1
        if ra.misfits >= self.p.max_misfits:
            self.stats.realigned += 1
            ra.offset, ra.method, ra.misfits = None, "", 0
            ra.why_not = "its step ends stopped matching the job's: aligning it afresh"
            ra.pending.append(rs)
            self._waiting.add(ra.rank)

    def _holding(self) -> bool:
        """Aligned summaries wait while a rank that reported is still being aligned, and at the
        start until as many ranks as the world size reported, for up to `hold_s` of job time (the
        newest step end seen): judging a step without them would lose their first steps to the
        judged frontier (an agent sends one rank's steps of an interval, then the next rank's)."""
        if self.anchor is None:
            return True
        h = max(self.p.hold_s * 1e9, self.p.hold_steps * self.step_ns())
        if len(self.ranks) < self.world and self.newest - self.anchor_end < h:
            return True
        if not self._waiting:
            return False
        # those aligned since are no longer waiting; a new set, as one emptied by discard() keeps
        # its table and iterating it would cost its largest size (every rank, at the first step)
        self._waiting = {r for r in self._waiting if self.ranks[r].offset is None and self.ranks[r].pending}
        return any(self.newest - self.ranks[r].since_end < h for r in self._waiting)

    # ---- rewriting --------------------------------------------------------------------------------

    def _rewrite(self, ra: RankAlign, rs: RankStep) -> RankStep:
        assert ra.offset is not None
        g = (rs.step or 0) + ra.offset
        if g not in self.ref_ends:  # (an older step's reference is settled)
            self.ends.setdefault(g, []).append(rs.end_ns)
        if len(self.ends) > self.p.raw_steps:
            old = min(self.ends)
            self.ref_ends[old] = int(median(self.ends.pop(old)))
            self._medians.pop(old, None)
            if len(self.ref_ends) + len(self.ends) > self.p.window:
                del self.ref_ends[min(self.ref_ends)]
        self.top = max(self.top, g)
        comms: Dict[str, CommStep] = {}
        for local, c in rs.comms.items():
            self.comms.observe(rs.rank, c)
            if c.seqs:
                ra.seqpos[local] = (g, c.first, c.collectives)
            # positions in the step: every instance's, or every n-th past the agent's records per step
            first = c.first
            comms[local] = dataclasses.replace(c, seqs=[g * POSITIONS + s - first for s in c.seqs])
        # GPU-arrival evidence is for the rank's previous step (its own number): on the job's by the
        # same offset; evidence that claims this step or a later one is not evidence of a past step
        ga = rs.gpu_arrival
        if ga is not None:
            own = ga.step
            past = own is not None and own < (rs.step or 0)
            ga = dataclasses.replace(ga, step=(own or 0) + ra.offset) if past else None
        return dataclasses.replace(rs, step=g, comms=comms, gpu_arrival=ga)  # job communicators: at release

    def resolve(self, rs: RankStep) -> RankStep:
        """The summary with its communicators under their job keys (call at judging time: a local
        communicator may have been matched after the summary was aligned)."""
        comms: Dict[str, CommStep] = {}
        for local, c in rs.comms.items():
            key = self.comms.of.get((rs.rank, local))
            if key is None:
                comms[local] = c
                continue
            jc = self.comms.comms[key]
            comms[key] = dataclasses.replace(
                c, comm=key, nranks=jc.nranks, rank=jc.members.get(rs.rank, c.rank), identity=jc.source
            )
        ga = rs.gpu_arrival
        if ga is not None and (ga.bounds or ga.coll_gpu_ns):
            of = self.comms.of
            ga = dataclasses.replace(
                ga,
                bounds={of.get((rs.rank, c), c): v for c, v in ga.bounds.items()},
                coll_gpu_ns={of.get((rs.rank, c), c): v for c, v in ga.coll_gpu_ns.items()},
            )
        return dataclasses.replace(rs, comms=comms, gpu_arrival=ga)

    # ---- what other parts ask ------------------------------------------------------------------------

    def position(self, rank: int, local: str, seq: int) -> Optional[Tuple[str, int, int]]:
        """(job comm, job step, position in the step) of a rank's own collective sequence number."""
        ra = self.ranks.get(rank)
        key = self.comms.of.get((rank, local))
        if ra is None or key is None or local not in ra.seqpos:
            return None
        g, first, n = ra.seqpos[local]
        if n <= 0:
            return None
        d = seq - first
        return key, g + d // n, d % n

    def job_comm(self, rank: int, local: str) -> Optional[str]:
        return self.comms.of.get((rank, local))

    def identity(self, comm: Optional[str], ranks: Sequence[int] = ()) -> Dict[str, Any]:
        """Where a finding's identity came from, for its evidence."""
        out: Dict[str, Any] = {}
        jc = self.comms.comms.get(comm) if comm else None
        if jc is not None:
            out["comm"] = {"identity": jc.source, "confidence": jc.confidence, "ranks": len(jc.members)}
            if jc.note:
                out["comm"]["note"] = jc.note
        methods = sorted({self.ranks[r].method for r in ranks if r in self.ranks and self.ranks[r].method})
        if methods:
            res = [
                self.ranks[r].residual_ns for r in ranks if r in self.ranks and self.ranks[r].method == "time"
            ]
            tol = [self.ranks[r].tol_ns for r in ranks if r in self.ranks and self.ranks[r].method == "time"]
            steps: Dict[str, Any] = {"aligned_by": "+".join(methods)}
            if res:
                steps["residual_ms"] = round(max(res) / 1e6, 2)
                steps["tolerance_ms"] = round(max(tol) / 1e6, 2)
            steps["confidence"] = "high" if not res or max(res) <= 0.4 * max(tol) else "medium"
            out["steps"] = steps
        return out

    def unaligned(self) -> Dict[int, str]:
        """Ranks not on the job's numbering, and why."""
        return {
            r: x.why_not or "waiting for its first steps" for r, x in self.ranks.items() if x.offset is None
        }

    def summary(self) -> Dict[str, Any]:
        by: Counter = Counter(x.method for x in self.ranks.values() if x.offset is not None)
        src: Counter = Counter(jc.source for jc in self.comms.comms.values())
        return {
            "steps": dict(by),
            "numbering": "from the communicators' creation" if self.absolute else "from the agents' attach",
            "comms": dict(src),
            "unaligned": self.unaligned(),
            "unmatched_comms": len(self.comms.waiting),
            "notes": list(self.comms.notes),
            "realigned": self.stats.realigned,
            "restarted": self.stats.restarted,
            "extrapolated": self.stats.extrapolated,
        }
