"""Which GPU reached a step's collectives last, on jobs that record no CUDA-event timers.

Under NCCL's enqueue-and-return semantics every rank's host enters the collectives at about the
same time, so host arrival cannot tell which GPU came last; without the framework's timers
(`timer<k>`, argus.aggregator.ranks) nothing else in a summary could. The agents now send, one step
late (`RankStep.gpu_arrival`: an event's completion is seen at the next query), three kinds of
evidence, each with what it can prove (docs/diagnosis.md "Which GPU arrived last"):

* **first network send** (`net_first_ns`): NCCL's proxy posts a network send only once the rank's
  kernel produced data, so the send bounds the rank's GPU arrival at its first inter-host
  collective from above, within the proxy's latency (`gpu_net_slack_ns`). Rank r surely came
  after rank o when net_r - slack > net_o + the clocks' uncertainty between their hosts (the
  hosts' offsets are taken out first: argus.aggregator.clocks). Compared among the ranks of one
  symmetric group (the same code: job-wide in a data-parallel job), across hosts.
* **event-query and sync bounds** per collective instance (`bounds`: lo = the GPU had not reached
  it yet, hi = it had): r surely came last at an instance when its lo passes every other member's
  hi by `gpu_bound_margin_ns` (+ the clocks' uncertainty across hosts), and its lateness estimated
  by the bounds' mid-points passes the group's learnt noise in that estimate (CPU contention makes a
  different GPU truly last each step). Where nobody is surely last (bounds as wide as the lateness)
  the member whose estimate stands out past that noise and past every peer's is named from the
  mid-points (`QUERY_EST`), with the worst-case bound. Loose bounds (an end event includes the
  wait for the straggler) simply separate nothing.
* **in-collective GPU times** (`coll_gpu_ns`, TORCH_NCCL_ENABLE_TIMING): all members finish a
  collective together, so the rank that came last spends least time in it; per rank the median of
  the step's times on a communicator; last when below every peer's by max(`gpu_time_tol_ns`,
  `gpu_time_tol_rel` x the group's median). One clock: no synchronisation needed.

A verdict also needs the lateness to matter: at least max(`gpu_late_min_ns`, `gpu_late_share` x
the median step), and to pass the group's own noise in that source (`_learn`). Two ranks of one
group surely last in one step (by different evidence) cancel each other: nothing is said of that
step. A group short of a member (no summary from it this step) is not judged: it may be the
last. Verdicts go to L2 as a flag reason (`gpu_arrival`) where the group has no communication
timer (timers keep their own judgement: no double count), and what could not be separated is kept
per step, so a slower job that names no rank says why (`unseparated`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from argus.aggregator.config import Thresholds
from argus.aggregator.robust import OUTLIER_K, Noise, median, teaching
from argus.aggregator.state import Groups
from argus.schema import GpuArrival, RankStep

NET, QUERY, QUERY_EST, COLL = "net", "query", "query_est", "coll"
LABEL = {
    NET: "first network send",
    QUERY: "event queries",
    QUERY_EST: "event queries (mid-points)",
    COLL: "in-collective GPU times",
}


@dataclass
class GpuLate:
    """One rank's GPU surely reached one step's collectives last."""

    rank: int
    step: int  # the job step the evidence is for (one before the step whose summaries carried it)
    group: str  # its symmetric group
    sources: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # source -> (late ns, bound ns)
    instances: Tuple[int, int] = (0, 0)  # event queries: instances it was surely last at, compared
    span: int = 1  # the steps up to `step` its evidence covers (in-collective times: several)

    @property
    def late_ns(self) -> float:
        """Its lateness behind its peers' median, from the tightest source."""
        return self.sources[self.tightest][0]

    @property
    def bound_ns(self) -> float:
        return self.sources[self.tightest][1]

    @property
    def tightest(self) -> str:
        return min(self.sources, key=lambda s: self.sources[s][1])


@dataclass
class StepEvidence:
    """What one step's evidence could tell, whether or not it named anyone."""

    step: int
    ranks: int = 0  # ranks that sent evidence for it
    hosts: int = 1  # hosts of the step's ranks
    timers: bool = False  # the ranks record CUDA-event timers (L2 judges those)
    coll: bool = False  # in-collective GPU times of a whole communicator
    net_ranks: int = 0
    net_bound_ns: Optional[float] = None  # slack + the worst clock uncertainty between compared hosts
    bounds: int = 0  # event-query bound rows
    bound_width_ns: Optional[float] = None  # median over members of its tightest row (both ends known)
    floor_ns: float = 0.0  # the lateness that names a rank in this step
    last: Dict[int, GpuLate] = field(default_factory=dict)
    conflicts: int = 0  # groups where two ranks were surely last

    def capable(self) -> List[str]:
        """The sources that could separate a lateness that matters in this step."""
        out = []
        if self.coll:
            out.append(COLL)
        if self.net_bound_ns is not None and self.net_ranks >= 2 and self.net_bound_ns < self.floor_ns:
            out.append(NET)
        if self.bound_width_ns is not None and self.bound_width_ns < self.floor_ns:
            out.append(QUERY)
        return out

    def separable(self) -> bool:
        return self.timers or bool(self.capable())

    def missing(self) -> List[str]:
        """Why nothing could separate the ranks, in words."""
        out = ["no CUDA-event timers"] if not self.timers else []
        if self.ranks == 0:
            return [*out, "no GPU-arrival evidence in the summaries (agents older than this aggregator?)"]
        if not self.coll:
            out.append("no in-collective GPU times (TORCH_NCCL_ENABLE_TIMING is off)")
        if self.net_ranks < 2:
            one = self.hosts <= 1
            out.append("no network sends (the group stays on one host)" if one else "no network sends seen")
        elif self.net_bound_ns is not None and self.net_bound_ns >= self.floor_ns:
            out.append(
                f"network sends bound arrivals only to ±{_ms(self.net_bound_ns)} (host clocks uncertain)"
            )
        if self.bounds == 0:
            out.append("no event queries of the collectives")
        elif self.bound_width_ns is None:
            out.append("event queries bound no arrival from above")
        elif self.bound_width_ns >= self.floor_ns:
            out.append(f"event queries bound arrivals only to ±{_ms(self.bound_width_ns / 2)}")
        return out


def _ms(ns: float) -> str:
    v = ns / 1e6
    return f"{v:.0f} ms" if abs(v) >= 10 else f"{v:.1f} ms"


Unc = Callable[[str], float]  # host -> how well its clock is known on the reference host's (ns)


class GpuArrivals:
    """Per job: judges each frame's GPU-arrival evidence (for the step before it) and keeps, per
    rank and per step, what it said (bounded by `window` steps)."""

    def __init__(self, th: Thresholds) -> None:
        self.th = th
        self.records: Deque[StepEvidence] = deque(maxlen=th.window)
        self.hist: Dict[int, Deque[Tuple[int, Optional[GpuLate]]]] = {}  # rank -> (step, verdict)
        self.net_seen: Set[int] = set()  # ranks that sent a network send (their group spans hosts)
        # the previous frame (its step, its summaries: this frame's evidence is about it): a rank that
        # issued another number of collectives on a communicator than its peers is not matched
        # instance by instance
        self.prev: Tuple[int, Dict[int, RankStep]] = (-1, {})
        # (comm, rank) -> (step, in-collective GPU times read for it): a watchdog reads them at its own
        # period (PyTorch's: 100 ms), often not in every step, so a verdict takes the recent ones
        self.coll_recent: Dict[Tuple[str, int], Deque[Tuple[int, List[int]]]] = {}
        self.noise: Dict[Tuple[str, str], Noise] = {}  # (group or comm, source) -> its healthy spread
        self.full: Dict[str, int] = {}  # symmetric group -> the most members seen in one step

    # ---- judging ----------------------------------------------------------------------------------

    def judge(
        self,
        step: int,
        ranks: Dict[int, RankStep],
        groups: Groups,
        sym: Dict[str, List[int]],
        unc: Unc,
        floor_ns: float,
    ) -> Dict[int, GpuLate]:
        """Verdicts (rank -> GpuLate) from the evidence this frame's summaries carry (`ranks`: on the
        job's steps and communicators, host clocks corrected)."""
        ev: Dict[int, Dict[int, GpuArrival]] = {}  # evidence step -> rank -> evidence
        for r, rs in ranks.items():
            ga = rs.gpu_arrival
            if ga is not None and ga.step is not None and ga.step < step:
                ev.setdefault(ga.step, {})[r] = ga
        first = next(iter(ranks.values()), None)
        timers = first is not None and any(p.startswith("timer") for p in first.phases)
        prev_step, prev = self.prev
        self.prev = (step, ranks)
        out: Dict[int, GpuLate] = {}
        if not ev:  # (the common case of older agents: nothing more to look at)
            self.records.append(StepEvidence(step - 1, 0, 1, timers, floor_ns=floor_ns))
            return out
        hosts = len({rs.host for rs in ranks.values()})
        for e, got in sorted(ev.items()):
            rec = StepEvidence(e, len(got), hosts, timers, floor_ns=floor_ns)
            late = self._judge_step(e, ranks, got, groups, sym, unc, rec, prev if e == prev_step else None)
            rec.last = late
            self.records.append(rec)
            for r in got:
                h = self.hist.get(r)
                if h is None:
                    h = self.hist[r] = deque(maxlen=self.th.window)
                h.append((e, late.get(r)))
            out.update(late)
        return out

    def _judge_step(
        self,
        e: int,
        ranks: Dict[int, RankStep],
        got: Dict[int, GpuArrival],
        groups: Groups,
        sym: Dict[str, List[int]],
        unc: Unc,
        rec: StepEvidence,
        prev: Optional[Dict[int, RankStep]],
    ) -> Dict[int, GpuLate]:
        th = self.th
        group_of = {r: key for key, members in sym.items() for r in members}

        known: Dict[str, float] = {}

        def own(r: int) -> float:
            """How well rank r's stamps are known on the reference host's clock: its host's offset
            estimate and its agent's own monotonic-to-realtime error."""
            rs = ranks[r]
            u = known.get(rs.host)
            if u is None:
                u = known[rs.host] = unc(rs.host)
            return u + rs.clock_uncertainty_ns

        def pair(a: int, b: int) -> float:
            """Clock uncertainty between two ranks' stamps: none on one host (one clock)."""
            return 0.0 if ranks[a].host == ranks[b].host else own(a) + own(b)

        found: Dict[int, Dict[str, Tuple[float, float]]] = {}
        inst: Dict[int, Tuple[int, int]] = {}

        def take(r: int, src: str, late: float, bound: float, need: float = 0.0) -> None:
            if late >= max(rec.floor_ns, need):
                found.setdefault(r, {})[src] = (late, bound)

        # (b) first network send, per symmetric group, across hosts
        for r, ga in got.items():
            if ga.net_first_ns:
                self.net_seen.add(r)
        for key, members in sym.items():
            full = self.full[key] = max(self.full.get(key, 0), len(members))
            if len(members) < full:
                continue  # a member without a summary this step (its agent cut off) may be the last
            want = [r for r in members if r in self.net_seen]
            pts = {r: got[r].net_first_ns for r in want if r in got and got[r].net_first_ns}
            rec.net_ranks += len(pts)
            if len(pts) < max(2, th.min_group) or len(pts) < len(want):
                continue  # a rank that sends over the network sent nothing: it may be the last
            per_host: Dict[str, float] = {}
            for x in pts:
                h = ranks[x].host
                per_host[h] = max(per_host.get(h, 0.0), own(x))
            top = sorted(per_host.values(), reverse=True)
            worst = top[0] + top[1] if len(top) >= 2 else 0.0
            nb = th.gpu_net_slack_ns + worst
            rec.net_bound_ns = nb if rec.net_bound_ns is None else max(rec.net_bound_ns, nb)
            r = max(pts, key=lambda x: pts[x])
            others = [o for o in pts if o != r]
            need = self._learn((key, NET), r, pts, rec.floor_ns)
            if all(pts[r] - th.gpu_net_slack_ns - pair(r, o) > pts[o] for o in others):
                bound = th.gpu_net_slack_ns + max(pair(r, o) for o in others)
                take(r, NET, pts[r] - median([pts[o] for o in others]), bound, need)

        # (c) event-query bounds and (a) in-collective GPU times, per communicator
        widths: List[float] = []
        comms = {c for ga in got.values() for c in (*ga.bounds, *ga.coll_gpu_ns)}
        for c in sorted(comms):
            g = groups.by_comm.get(c)
            members = sorted(g.members) if g is not None else sorted(r for r in got if c in got[r].bounds)
            if len(members) < th.min_group or any(r not in ranks for r in members):
                continue  # a member without a summary this step may be the last
            self._bounds(c, members, got, prev, pair, rec, widths, take, inst)
            self._coll(c, members, got, rec, take, e)
        if widths:
            rec.bound_width_ns = median(widths)

        # one verdict per group and step: two ranks surely last (by different evidence) cancel
        by_group: Dict[str, List[int]] = {}
        for r in found:
            by_group.setdefault(group_of.get(r, ""), []).append(r)
        out: Dict[int, GpuLate] = {}
        for key, rs in by_group.items():
            if len(rs) > 1:
                rec.conflicts += 1
                continue
            r = rs[0]
            span = th.gpu_coll_steps if COLL in found[r] else 1
            out[r] = GpuLate(r, e, key, found[r], inst.get(r, (0, 0)), span)
        return out

    def _bounds(
        self,
        c: str,
        members: List[int],
        got: Dict[int, GpuArrival],
        prev: Optional[Dict[int, RankStep]],
        pair: Any,
        rec: StepEvidence,
        widths: List[float],
        take: Any,
        inst: Dict[int, Tuple[int, int]],
    ) -> None:
        th = self.th
        rows: Dict[int, Dict[int, Tuple[int, int]]] = {}
        count: Dict[int, int] = {}  # rank -> its collectives on c in the step the evidence is about
        for r in members:
            x = prev[r].comms.get(c) if prev is not None and r in prev else None
            if x is not None:
                count[r] = x.collectives
        usual = Counter(count.values()).most_common(1)[0][0] if count else None
        tightest: List[float] = []
        for r in members:
            ga = got.get(r)
            if ga is None or c not in ga.bounds:
                continue
            if count.get(r, usual) != usual:
                continue  # another number of collectives than its peers: which is which is a guess
            rows[r] = {i: (lo, hi) for i, lo, hi, _src in ga.bounds[c]}
            rec.bounds += len(ga.bounds[c])
            own = sorted(float(hi - lo) for _i, lo, hi, _s in ga.bounds[c] if hi and lo and hi >= lo)
            if own:  # a member's tightest: where its host kept pace with its GPU, queries bound
                tightest.append(own[0])  # arrivals tightly; the rest may be bounded by its end sync only
        widths += tightest
        if len(rows) < len(members):
            return  # a member's arrivals are not bounded: it may be the last
        sure: Dict[int, List[Tuple[float, float]]] = {}  # rank -> (lateness, bound) per instance
        compared = 0
        # where every member's arrival is bounded tightly (not by its end event or sync: within 4x
        # the lateness that matters, or twice the members' typical tightest), each member's distance
        # from the instance's median mid-point
        cap = max(4.0 * rec.floor_ns, 2.0 * median(tightest)) if tightest else 0.0
        devs: Dict[int, List[float]] = {r: [] for r in members}
        halves: Dict[int, List[float]] = {r: [] for r in members}
        for i in sorted(set.intersection(*(set(x) for x in rows.values()))):
            at = {r: rows[r][i] for r in members}
            compared += 1
            if all(lo and hi and 0 <= hi - lo <= cap for lo, hi in at.values()):
                mid = {r: (lo + hi) / 2 for r, (lo, hi) in at.items()}
                m = median(list(mid.values()))
                for y in members:
                    devs[y].append(mid[y] - m)
                    halves[y].append((at[y][1] - at[y][0]) / 2)
            r = max(at, key=lambda x: at[x][0])
            lo_r = at[r][0]
            others = [o for o in members if o != r]
            margin = th.gpu_bound_margin_ns
            if not lo_r or any(not at[o][1] or lo_r <= at[o][1] + margin + pair(r, o) for o in others):
                continue
            mids = [(at[o][0] + at[o][1]) / 2 if at[o][0] else at[o][1] for o in others]
            mine = (lo_r + at[r][1]) / 2 if at[r][1] else lo_r
            half = median([(at[x][1] - at[x][0]) / 2 for x in members if at[x][1] and at[x][0]] or [0.0])
            bound = max(half, th.gpu_bound_margin_ns + max(pair(r, o) for o in others))
            sure.setdefault(r, []).append((mine - median(mids), bound))
        # the group's noise in each member's lateness estimated by the mid-points (its median over
        # the step's tight instances), learnt from every member, this step's too (a straggler that
        # stands out is not taught: robust.teaching), so that the first step judges
        key = (c, QUERY)
        est = {x: median(v) for x, v in devs.items()} if all(devs.values()) else {}
        top = max(est, key=lambda x: est[x]) if est else -1
        if est:
            self._learn(key, -1, est, rec.floor_ns)
        need = self._need(key)
        if len(sure) == 1:
            r, vals = next(iter(sure.items()))
            if r in est and est[r] < need:
                return  # surely last, by no more than the group's noise over the step's instances
            take(r, QUERY, median([v[0] for v in vals]), median([v[1] for v in vals]))
            inst[r] = (len(vals), compared)
        elif (
            not sure
            and est
            and need > 0
            and est[top] - max(est[x] for x in members if x != top) >= max(need, rec.floor_ns)
        ):
            # Nobody surely last (bounds as wide as the lateness: a query every ~12 ms), but one
            # member's arrivals, estimated by the mid-points, stand out past the group's learnt
            # spread of the same estimate (`take`), and past every other member's by as much. Its
            # bound: its half-width and the median member's, and the clocks across hosts.
            unc = max(pair(top, o) for o in members if o != top)
            hw = median(halves[top]) + median([median(halves[x]) for x in members if x != top])
            take(top, QUERY_EST, est[top] - unc, hw + unc, need)
        # (several ranks surely last at different instances: nothing to say)

    def _coll(
        self, c: str, members: List[int], got: Dict[int, GpuArrival], rec: StepEvidence, take: Any, step: int
    ) -> None:
        th = self.th
        meds: Dict[int, float] = {}
        for r in members:
            ga = got.get(r)
            q = self.coll_recent.get((c, r))
            if q is None:
                q = self.coll_recent[(c, r)] = deque(maxlen=th.gpu_coll_steps)
            ts = ga.coll_gpu_ns.get(c) if ga is not None else None
            if ts:
                q.append((step, ts))
            recent = [t for s, v in q if step - th.gpu_coll_steps < s <= step for t in v]
            if recent:
                meds[r] = median(recent)
        if len(meds) < len(members):
            return
        rec.coll = True
        gm = median(list(meds.values()))
        tol = max(float(th.gpu_time_tol_ns), th.gpu_time_tol_rel * gm)
        r = min(meds, key=lambda x: meds[x])
        others = [meds[o] for o in members if o != r]
        need = self._learn((c, COLL), r, meds, rec.floor_ns)
        if all(v - meds[r] > tol for v in others):
            take(r, COLL, median(others) - meds[r], tol, need)

    def _learn(self, key: Tuple[str, str], top: int, vals: Mapping[int, float], floor: float) -> float:
        """The lateness a group's noise in one source reaches (0 until `gpu_noise_min` values are
        known): `noise_k` x the 99th percentile of its members' |deviation from the median| in past
        steps. Learnt from every member but the step's latest (`top`), which is the very rank judged,
        and but outliers (robust.teaching): a straggler present when the agents attached, or a
        second one, must not teach its lateness as noise. Measured (2-core machine, 8 simulated
        ranks on 2 hosts, clean): the latest first network send lay 2.5 ms past its peers' median on
        median, 3.8 ms at p90 — at the floor — while the others lay within 2.7 ms at p99: CPU
        contention delays a rank's work, now one, now another."""
        need = self._need(key)
        n = self.noise[key]
        m = median(list(vals.values()))
        n.add(teaching([abs(v - m) for x, v in vals.items() if x != top], floor))
        return need

    def _need(self, key: Tuple[str, str]) -> float:
        """The lateness the noise learnt so far for `key` reaches (0 until `gpu_noise_min` values)."""
        n = self.noise.get(key)
        if n is None:
            n = self.noise[key] = Noise()
        if len(n) < self.th.gpu_noise_min:
            return 0.0
        if key[1] != QUERY:
            return self.th.noise_k * n.scale()
        # event queries: a few dozen values while young, one a step per member (4 ranks: 3-4), and
        # one early step of 14 ms among values of 1-2 ms held a 1.3x straggler (12-40 ms late)
        # unnamed for 15 steps: no more than OUTLIER_K x their median, what `teaching` calls noise
        return self.th.noise_k * min(n.scale(self.th.gpu_query_noise_q), OUTLIER_K * n.scale(0.5))

    # ---- what explanations ask ---------------------------------------------------------------------

    def tally(self, rank: int, since: int) -> Tuple[int, int]:
        """(steps its GPU was surely last in, steps judged from its evidence) since job step `since`."""
        h = self.hist.get(rank, ())
        judged = [v for s, v in h if s >= since]
        return sum(1 for v in judged if v is not None), len(judged)

    def unseparated(self, first: int, last: int) -> Optional[Dict[str, Any]]:
        """For a slower job that names no rank (an L1 finding over steps first..last): what the GPU
        arrivals could tell. None when the ranks record timers (L2 judged those); else
        {"separable": bool, "text": ..., ...} — whether most of those steps' evidence could have
        separated a lateness that matters, and in words what was missing or what it showed."""
        recs = [x for x in self.records if first - 1 <= x.step <= last]
        if not recs and self.records:
            recs = [self.records[-1]]
        if not recs or any(x.timers for x in recs):
            return None
        ok = [x for x in recs if x.separable()]
        if 2 * len(ok) >= len(recs):
            srcs = Counter(s for x in ok for s in x.capable())
            used = [LABEL[s] for s, _n in srcs.most_common()]
            return {
                "separable": True,
                "sources": used,
                "steps": len(recs),
                "text": "no rank's GPU reached the collectives last persistently "
                f"(evidence: {', '.join(used)})",
            }
        # the most common reasons over the window (one step's words stand for the rest)
        said = Counter(tuple(x.missing()) for x in recs if not x.separable())
        missing = list(said.most_common(1)[0][0])
        ev: Dict[str, Any] = {"separable": False, "missing": missing, "steps": len(recs)}
        widths = [x.bound_width_ns for x in recs if x.bound_width_ns is not None]
        if widths:
            ev["bound_ms"] = round(median(widths) / 2e6, 2)
        ev["text"] = "which GPU arrived last cannot be told: " + ", ".join(missing)
        return ev

    def summary(self, last: int = 16) -> Dict[str, Any]:
        """The recent steps' evidence for `argus diagnose`: what each source covered."""
        recs = list(self.records)[-last:]
        if not recs:
            return {}
        caps = Counter(s for x in recs for s in x.capable())
        out: Dict[str, Any] = {
            "steps": len(recs),
            "with_evidence": sum(1 for x in recs if x.ranks),
            "timers": any(x.timers for x in recs),
            "separating": {LABEL[s]: n for s, n in caps.most_common()},
        }
        nets = [x.net_bound_ns for x in recs if x.net_bound_ns is not None]
        if nets:
            out["net_bound_ms"] = round(median(nets) / 1e6, 2)
        widths = [x.bound_width_ns for x in recs if x.bound_width_ns is not None]
        if widths:
            out["query_bound_ms"] = round(median(widths) / 2e6, 2)
        bad = [x for x in recs if not x.separable()]
        if bad and 2 * len(bad) >= len(recs):
            out["cannot_tell"] = bad[-1].missing()
        return out


def sources_text(verdicts: Iterable[GpuLate]) -> Tuple[str, Dict[str, Dict[str, Any]]]:
    """'first network send, ±1.0 ms' (each source used, most used first, with its median bound) and
    the same per source for the evidence."""
    per: Dict[str, List[float]] = {}
    for v in verdicts:
        for s, (_late, bound) in v.sources.items():
            per.setdefault(s, []).append(bound)
    order = sorted(per, key=lambda s: (-len(per[s]), s))
    ev = {LABEL[s]: {"steps": len(per[s]), "bound_ms": round(median(per[s]) / 1e6, 2)} for s in order}
    text = "; ".join(f"{LABEL[s]}, ±{_ms(median(per[s]))}" for s in order)
    return text, ev
