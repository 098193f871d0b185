"""L2 — ranks and phases: who the others wait for, and which of its phases is slow.

Per judged step, two measurements per rank, both relative to the rank's peers:

* **host arrival lateness**: for every collective instance (communicator, sequence number) the
  arrival of each member minus the members' median; a rank's lateness in a step is the median over
  its instances, and the rank that arrives last at an instance is counted. Under asynchronous NCCL
  the host runs ahead of the GPU, so this names *host-side* stragglers (stalls, slow data loading);
  under blocking communication it names every straggler.
* **phase outliers within the symmetric group** (argus.aggregator.state): for every GPU timing the
  ranks harvest (`timer<k>`, named phases), the deviation from the group's median, judged against
  the group's own healthy spread (noise), a relative floor and an absolute floor. A phase that runs
  on the communication stream *absorbs waits*: the rank everyone waits for shows there as the
  *lowest* value (it waited least), its victims as the majority — so a low outlier in a
  communication phase is GPU-side lateness, and a high one is a symptom and never blamed.

Where the group has no communication timer (a stock job records none), a rank whose GPU surely
reached the previous step's collectives last (argus.aggregator.gpuarrival: its first network send,
event-query bounds, in-collective GPU times) is flagged for that too (`gpu_arrival`).

Naming: a rank flagged (late host arrival, a high non-communication phase, a low communication
phase, or its GPU last) in `persist_k` of its last `persist_n` steps is a straggler. Victims are
the majority of the group, so they are never outliers. Across a pipeline link the victim *is* an
outlier in its own group (it waits in Recv inside its forward/backward), so flagged ranks joined
by a small communicator are judged together: equal extra time in every phase both grew in means
the link between them; otherwise the one whose phase grew by the larger factor is the cause and
the other is reported as its pipeline victim.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import sub
from typing import Deque, Dict, FrozenSet, List, Optional, Set, Tuple

from argus.aggregator.commmode import WAIT_COLL, WAIT_P2P, WAIT_PHASES, modal_seqs
from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.gpuarrival import GpuLate
from argus.aggregator.robust import Noise, median, median_sorted, teaching
from argus.aggregator.state import Groups
from argus.schema import CommStep, RankStep

HOST_PHASES = ("host_wait", "host_other")


@dataclass
class RankFlag:
    """What L2 saw of one rank in one step."""

    rank: int
    group: str
    step: int = -1
    late_ns: float = 0.0
    late_peak_ns: float = 0.0  # its latest instance: a stall before one collective, then in step
    late_n: int = 0
    late_last: int = 0
    late: bool = False
    high: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # phase -> (ratio, extra ns)
    low: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # comm phase -> (ratio, ns less)
    gpu_last: Dict[str, bool] = field(default_factory=dict)  # comm phase -> it had the group minimum
    waited_least: bool = False  # flagged by the order of waits in a blocking call (wait_order_ratio)
    # its GPU surely reached the previous step's collectives last (argus.aggregator.gpuarrival); set
    # only in groups without a communication timer, which keep their own judgement
    gpu_arr: Optional[GpuLate] = None
    dev: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # every phase -> (ratio, v - median)
    host_excess_ns: float = 0.0
    stall: bool = False
    host_share: float = 0.0  # its own host time's excess / its largest GPU phase deviation

    @property
    def flagged(self) -> bool:
        return not self.stall and (self.late or bool(self.high) or bool(self.low) or self.gpu_arr is not None)

    def reasons(self) -> FrozenSet[str]:
        out = {f"high:{p}" for p in self.high} | {f"low:{p}" for p in self.low}
        if self.late:
            out.add("late")
        if self.gpu_arr is not None:
            out.add(GPU_ARRIVAL)
        if self.waited_least:
            out.add(ORDER_WAIT)
        return frozenset(out)


ORDER_WAIT = f"least:{WAIT_COLL}"  # a flag reason: it waited least, by the order rule alone
GPU_ARRIVAL = "gpu_arrival"  # a flag reason: its GPU surely reached the collectives last


def own_host(rs: RankStep) -> int:
    """Host time of the step outside GPU waits and outside blocking collectives (its own work)."""
    return rs.phases.get("host_other", 0) - sum(rs.phases.get(w, 0) for w in WAIT_PHASES)


def arrival_lateness(ranks: Dict[int, RankStep], groups: Groups) -> Dict[int, Tuple[float, int, int, float]]:
    """rank -> (median lateness ns over its collective instances, instances, instances arrived last,
    its largest lateness: when collectives block, ranks line up again at every instance, so a stall
    before one shows there only).

    Members of a communicator report the same instances in a step (positions in the step,
    argus.aggregator.align): their arrivals form a matrix whose columns are the instances (median
    and last arrival per column). A member whose instances differ but whose step has as many
    collectives (a lost record; every n-th recorded from another step on) is matched by position;
    one with another number (a boundary cut elsewhere) is not: which call is which would be a guess.
    """
    devs: Dict[int, List[int]] = {}
    last: Dict[int, int] = {}
    for g in groups.collectives():
        rows: List[Tuple[int, List[int]]] = []
        odd: List[Tuple[int, List[int], List[int]]] = []
        have: List[Tuple[int, CommStep]] = []
        for r in g.members:
            rs = ranks.get(r)
            c = rs.comms.get(g.comm) if rs is not None else None
            if c is not None and c.seqs:
                have.append((r, c))
        if len(have) < 2:
            continue
        ref = modal_seqs([c for _, c in have])
        ref_n = next(c.collectives for _, c in have if c.seqs == ref)
        for r, c in have:
            if c.seqs == ref:
                rows.append((r, c.arrive_ns))
            elif c.collectives == ref_n:  # the same step, other instances recorded (or lost)
                odd.append((r, c.seqs, c.arrive_ns))
        if len(rows) < 2:
            continue
        meds: List[int] = []
        members = [r for r, _ in rows]
        for col in zip(*[a for _, a in rows]):
            srt = sorted(col)
            n = len(srt)
            m = n // 2
            meds.append(srt[m] if n & 1 else (srt[m - 1] + srt[m]) // 2)
            lr = members[col.index(srt[-1])]
            last[lr] = last.get(lr, 0) + 1
        for r, arr in rows:
            d = devs.get(r)
            if d is None:
                devs[r] = list(map(sub, arr, meds))
            else:
                d.extend(map(sub, arr, meds))
        if odd:
            at = dict(zip(ref, meds))
            for r, seqs, arr in odd:
                d = [a - at[q] for q, a in zip(seqs, arr) if q in at]
                if d:
                    devs.setdefault(r, []).extend(d)
    out: Dict[int, Tuple[float, int, int, float]] = {}
    for r, d in devs.items():
        d.sort()
        out[r] = (median_sorted(d), len(d), last.get(r, 0), float(d[-1]))
    return out


def phase_roles(ranks: List[RankStep], phases: List[str], info: PhaseInfo) -> Dict[str, str]:
    """phase -> 'comm' (times communication: absorbs waits), 'main' or 'unknown'."""
    roles: Dict[str, str] = {}
    for p in phases:
        if p.startswith("wait:"):  # host time inside blocking calls (argus.aggregator.commmode)
            roles[p] = "comm"
            continue
        if info.comm_phases is not None:
            roles[p] = "comm" if p in info.comm_phases else "main"
            continue
        known = [rs.phase_stream[p] for rs in ranks if p in rs.phase_stream]
        multi = any(len(set(rs.phase_stream.values())) > 1 for rs in ranks[:4])
        if not known or not multi:
            roles[p] = "unknown"
        else:
            side = sum(1 for o in known if o > 0)
            roles[p] = "comm" if 2 * side > len(known) else "main"
    return roles


class L2:
    """Per-job L2 state: noise per (group, phase), flag history per rank."""

    def __init__(self, th: Thresholds, info: PhaseInfo) -> None:
        self.th = th
        self.info = info
        self.noise: Dict[Tuple[str, str], Noise] = {}
        self.roles: Dict[str, Dict[str, str]] = {}  # group -> phase -> role
        self.hist: Dict[int, Deque[FrozenSet[str]]] = {}  # per step: why the rank was flagged
        self.recent: Dict[int, Deque[Optional[RankFlag]]] = {}  # last `window` flags (None = clean)
        self.devs: Dict[int, Deque[Dict[str, Tuple[float, float]]]] = {}  # last `persist_n` deviations
        self.hshare: Dict[int, Deque[float]] = {}  # per step (as `hist`): RankFlag.host_share
        self.links: Dict[Tuple[int, int], int] = {}  # pair -> -1: a slow link (sticky); n: steps undecided
        self.causes: Dict[FrozenSet[int], int] = {}  # component -> the rank named as its cause
        self.deferred: Dict[int, int] = {}  # rank -> steps its naming waited for a link peer's data
        self.members: Dict[str, List[int]] = {}  # symmetric group -> ranks (last step)
        self.excess: Dict[int, Deque[Tuple[int, float]]] = {}  # rank -> (step, host_excess_ns), recent

    def _noise(self, key: Tuple[str, str]) -> Noise:
        n = self.noise.get(key)
        if n is None:
            n = self.noise[key] = Noise()
        return n

    def measure(
        self,
        step: int,
        ranks: Dict[int, RankStep],
        groups: Groups,
        step_ns: float,
        judge: bool,
        gpu: Optional[Dict[int, GpuLate]] = None,
    ) -> Dict[int, RankFlag]:
        """Flags of every rank in this step (noise histories learn from unflagged ranks); `gpu`: the
        ranks whose GPU surely reached the previous step's collectives last."""
        th = self.th
        sym = groups.symmetric(ranks)
        self.members = sym
        late = arrival_lateness(ranks, groups)
        flags: Dict[int, RankFlag] = {}
        for key, members in sym.items():
            for r in members:
                flags[r] = RankFlag(r, key, step)
            # host lateness
            ln = self._noise((key, "#late"))
            floor = max(th.late_min_ns, th.rel_min * step_ns)
            thr = max(th.noise_k * ln.scale(), floor) if len(ln) >= 8 else max(floor, 3 * th.late_min_ns)
            healthy: List[float] = []
            for r in members:
                lt = late.get(r)
                if lt is None:
                    continue
                f = flags[r]
                f.late_ns, f.late_n, f.late_last, f.late_peak_ns = lt
                if judge and f.late_ns >= thr:
                    f.late = True
                else:
                    healthy.append(abs(f.late_ns))
            ln.add(teaching(healthy, floor))
            if len(members) < th.min_group:
                continue
            self._phases(key, members, ranks, flags, judge, th.share_min * step_ns, gpu or {})
        return flags

    def _phases(
        self,
        key: str,
        members: List[int],
        ranks: Dict[int, RankStep],
        flags: Dict[int, RankFlag],
        judge: bool,
        share_ns: float,
        gpu: Dict[int, GpuLate],
    ) -> None:
        th = self.th
        rsl = [ranks[r] for r in members]
        names = [p for p in rsl[0].phases if p not in HOST_PHASES]
        roles = self.roles.get(key)
        if roles is None or set(roles) != set(names):
            roles = self.roles[key] = phase_roles(rsl, names, self.info)
        # GPU arrival where no communication timer says it (a timer's judgement stands: not twice)
        if judge and gpu and not any(r == "comm" and not p.startswith("wait:") for p, r in roles.items()):
            for r in members:
                if r in gpu:
                    flags[r].gpu_arr = gpu[r]
        for p in names:
            vals = [(rs.phases[p], rs.rank) for rs in rsl if p in rs.phases]
            if len(vals) < th.min_group:
                continue
            vals.sort()
            n = len(vals)
            m = vals[n // 2][0] if n & 1 else (vals[n // 2 - 1][0] + vals[n // 2][0]) / 2.0
            noise = self._noise((key, p))
            thr = max(th.noise_k * noise.scale(), th.rel_min * m, th.abs_min_ns, share_ns)
            comm = roles.get(p) == "comm"
            floor = max(th.rel_min * m, th.abs_min_ns)
            # a blocking collective's lowest wait: the others waited for that rank (wait_order_ratio);
            # not send/recv, whose peers are outside this group
            first = vals[0][1] if p == WAIT_COLL and vals[0][0] <= th.wait_order_ratio * m else None
            healthy: List[float] = []
            for v, r in vals:
                d = v - m
                f = flags[r]
                f.dev[p] = (v / m if m > 0 else 1.0, d)
                if judge and d >= thr and not comm:
                    f.high[p] = (v / m if m > 0 else float("inf"), d)
                elif judge and comm and (-d >= thr or (r == first and -d >= floor)):
                    f.low[p] = (v / m if m > 0 else 0.0, -d)
                    f.waited_least = r == first
                elif not self._biased(r, p, d, floor):
                    healthy.append(abs(d))
            if comm:
                flags[vals[0][1]].gpu_last[p] = vals[1][0] - vals[0][0] > th.abs_min_ns
            noise.add(teaching(healthy, floor))
        # host time outside GPU waits and blocking collectives, relative to the group (host stalls),
        # less its launch waits relative to the group's: in a launch-bound job a host that stalls
        # lets its launch queue drain and waits less in launches by as much as its own time grew,
        # while a host whose GPU is slower waits more in them (measured on 4 simulated ranks on 2
        # CPUs: a 1.3x straggler's own time +4-50 ms a step, its launch waits -8-+17 ms; a host
        # stalled in a clean run: +19-38 ms and -4-19 ms). Without launch waits: its own time.
        ho = [own_host(rs) for rs in rsl]
        mho = median(ho)
        mlw = median([rs.launch_wait_ns for rs in rsl])
        for rs, v in zip(rsl, ho):
            f = flags[rs.rank]
            f.host_excess_ns = v - mho - (rs.launch_wait_ns - mlw)
            excess = f.host_excess_ns
            past = self.excess.get(rs.rank)
            if past is None:
                past = self.excess[rs.rank] = deque(maxlen=th.gpu_coll_steps + 1)
            past.append((f.step, excess))
            dev = [x[1] for x in f.high.values()] + [x[1] for p, x in f.low.items() if p not in WAIT_PHASES]
            if f.gpu_arr is not None:
                dev.append(f.gpu_arr.late_ns)
                # the evidence is about earlier steps (argus.aggregator.gpuarrival GpuLate.span): the
                # host's own time then says whether it launched the work late (a slow GPU leaves it
                # as it was); over several steps the median, as the in-collective times are
                e = f.gpu_arr.step
                then = [v for s, v in past if e - f.gpu_arr.span < s <= e]
                excess = median(then) if then else excess
            if dev:  # (host waits in blocking calls are host time: they tell nothing here)
                f.host_share = excess / max(dev)

    def _biased(self, rank: int, phase: str, d: float, floor: float) -> bool:
        """The rank stood off the group's median in this phase to the same side, beyond the floor, in
        this and at least `persist_k - 1` of its last `persist_n` steps: a bias, not noise. Taught
        as noise, a rank slower just under the threshold raised the threshold away from it for good
        (a slowed pipeline link's receiving end, 11 ms under a 12.8 ms floor, then never flagged)."""
        if abs(d) < floor:
            return False
        same = sum(
            1
            for x in self.devs.get(rank, ())
            if phase in x and abs(x[phase][1]) >= floor and (x[phase][1] > 0) == (d > 0)
        )
        return same >= self.th.persist_k - 1

    # ---- persistence and naming ---------------------------------------------------------------------

    def remember(self, flags: Dict[int, RankFlag]) -> None:
        th = self.th
        for r, f in flags.items():
            h = self.hist.get(r)
            if h is None:
                h = self.hist[r] = deque(maxlen=max(th.persist_n, th.host_persist_n))
                self.recent[r] = deque(maxlen=th.window)
                self.devs[r] = deque(maxlen=th.persist_n)
            h.append(f.reasons() if f.flagged else frozenset())
            self.hshare.setdefault(r, deque(maxlen=h.maxlen)).append(f.host_share)
            self.devs[r].append(f.dev)
            self.recent[r].append(f if (f.flagged or f.stall) else None)

    def persistent(self, young: bool = False, async_comm: bool = False) -> Set[int]:
        """Ranks flagged now for a reason (late; phase p high; phase p low) that held in `persist_k`
        of their last `persist_n` steps: the same symptom again, not noise hitting a rank in a
        different phase each step. While the group's baselines are `young` (the first steps after
        attaching: its noise is barely known), in every one of the last `persist_n` — except the
        lowest wait in a blocking call (`wait_order_ratio`: counted only in the steps where it was
        the lowest, not those where the young noise flagged it) and a GPU surely last (its own error
        bounds and margins, argus/aggregator/gpuarrival.py), which need no learnt baseline.
        Host-bound reasons need `host_persist_k` of `host_persist_n`: a GPU phase whose deviation is
        the host's own time, and — with `async_comm`, where the host runs ahead of the GPU — host
        lateness."""
        th = self.th
        out: Set[int] = set()
        for r, h in self.hist.items():
            if not h[-1]:
                continue
            hs = list(self.hshare[r])
            steps = list(h)
            for why in h[-1]:
                k = th.persist_n if young and why not in (ORDER_WAIT, GPU_ARRIVAL) else th.persist_k
                recent = [i for i in range(max(0, len(steps) - th.persist_n), len(steps)) if why in steps[i]]
                if len(recent) < k:
                    continue
                if why == "late":  # the host's own arrival: host-bound when collectives are async
                    bursty = async_comm
                else:  # a host wait in a blocking call is host time already: nothing to split
                    bursty = (
                        not why.endswith(WAIT_PHASES)
                        and median([hs[i] for i in recent]) >= th.host_bound_share
                    )
                if not bursty:
                    out.add(r)
                    break
                # host-bound (its host launched the work late): bursty by nature, it must last longer
                if sum(1 for x in steps[-th.host_persist_n :] if why in x) >= th.host_persist_k:
                    out.add(r)
                    break
        return out

    def recently_flagged(self) -> Set[int]:
        """Ranks flagged, for any reason, in one of their last `persist_n` steps."""
        return {r for r, h in self.hist.items() if any(list(h)[-self.th.persist_n :])}

    def flagged_within(self, steps: int) -> Set[int]:
        """Ranks flagged (or stalled) in one of their last `steps` judged steps."""
        return {r for r, q in self.recent.items() if any(f is not None for f in list(q)[-steps:])}

    def still_flagged(self, ranks: List[int]) -> bool:
        """Every one of `ranks` was flagged, for any reason, in one of its last `persist_n` steps:
        weaker evidence than naming needs, enough to keep an alert already named from resolving
        (a mild straggler on a noisy host dips under the thresholds for a step or two; the alert
        must not resolve and fire again)."""
        return bool(ranks) and set(ranks) <= self.recently_flagged()

    def extra(self, rank: int, phase: str) -> Tuple[float, float]:
        """(median ratio, median extra ns) of a phase over the rank's last `persist_n` steps."""
        vals = [d[phase] for d in self.devs.get(rank, ()) if phase in d]
        if not vals:
            return 1.0, 0.0
        return median([v[0] for v in vals]), median([v[1] for v in vals])

    def episode(self, rank: int, steps: int) -> List[RankFlag]:
        """The rank's flagged steps among its last `steps` judged steps."""
        rec = self.recent.get(rank)
        if not rec:
            return []
        return [f for f in list(rec)[-steps:] if f is not None and f.flagged]

    def phase_summary(self, rank: int, steps: int) -> Dict[str, Tuple[float, float, int]]:
        """phase -> (median ratio, median extra ns, steps) over the rank's recent flagged steps
        (high phases; low communication phases are keyed '<phase>:low')."""
        acc: Dict[str, List[Tuple[float, float]]] = {}
        for f in self.episode(rank, steps):
            for p, v in f.high.items():
                acc.setdefault(p, []).append(v)
            for p, v in f.low.items():
                acc.setdefault(p + ":low", []).append(v)
        return {p: (median([x[0] for x in v]), median([x[1] for x in v]), len(v)) for p, v in acc.items()}


@dataclass
class Culprit:
    kind: str  # straggler | pipeline_bubble | slow_link
    ranks: List[int]  # the cause (slow_link: the pair)
    victims: List[int] = field(default_factory=list)
    link: Optional[str] = None  # the small communicator joining a pair / pipeline peers


def name_culprits(
    cands: Set[int],
    flagged: Set[int],
    l2: L2,
    groups: Groups,
    th: Thresholds,
    assessed: Optional[Set[int]] = None,
) -> List[Culprit]:
    """Turn persistent ranks (`cands`) into causes. Ranks joined by a small communicator are judged
    together with their peers flagged in this step (`flagged`): a cause must itself be persistent
    to be named (else the component waits a step), victims are its persistent peers."""
    out: List[Culprit] = []
    seen: Set[int] = set()
    pool = cands | flagged
    for x in [x for x in l2.deferred if x not in cands]:
        del l2.deferred[x]  # no longer a candidate: a new episode waits afresh
    for pair in [p for p in l2.links if not (set(p) & pool)]:
        del l2.links[pair]  # the pair no longer stands out: judge it afresh next time
    for r in sorted(cands):
        if r in seen:
            continue
        comp = _component(r, pool, groups)
        seen |= comp
        if len(comp) == 1:
            # a link peer whose phases this step could not judge (its data late, its group short of
            # ranks) may be waiting on it: a pipeline bubble, not a straggler; look again (twice)
            unseen = assessed is not None and bool(link_peers(r, groups) - assessed)
            if unseen and l2.deferred.get(r, 0) < 2:
                l2.deferred[r] = l2.deferred.get(r, 0) + 1
                continue
            if _others_waited(l2, r):
                out.append(Culprit("straggler", [r]))
            continue
        ordered = sorted(comp)
        # a pair one end of which was already named the cause: what both ends show must have stood
        # out as long as a cause must (a 2-step burst on both ends at a job's end raised the bar
        # for the work the named pipeline straggler grew alone, and a contradicting slow link fired)
        need = th.persist_k if frozenset(comp) in l2.causes else 2
        if len(ordered) == 2:
            a, b = ordered
            link = groups.small_links(a, b)
            if link is not None:
                verdict = (
                    "link"
                    if (a, b) in l2.links and l2.links[(a, b)] < 0
                    else _link_pattern(a, b, l2, th, need)
                )
                if verdict == "link":
                    l2.links[(a, b)] = -1  # once a link, it stays one while the pair stands out
                    out.append(Culprit("slow_link", [a, b], link=link))
                    continue
                waited = l2.links.get((a, b), 0)
                if verdict == "maybe" and waited < 2:
                    l2.links[(a, b)] = waited + 1  # a second phase is growing on one end: look again
                    continue
        strength = {x: _strength(l2, x, 2) for x in ordered}
        # what a peer needs to take the cause from the rank already named: to have grown more in
        # a phase that stood out as long as a cause must (`persist_k` steps); with phases, else as is
        firm = {x: _strength(l2, x, th.persist_k) for x in ordered}
        if all(v == 1.0 for v in strength.values()):  # no phase stood out twice: take what there is
            strength = {x: _strength(l2, x, 1) for x in ordered}
        if all(v == 1.0 for v in strength.values()) and any(_gpu_last(l2, x) for x in ordered):
            # no timers: the one whose GPU surely reached the collectives last most often
            strength = firm = {x: 1.0 + _gpu_last(l2, x) for x in ordered}
        elif all(v == 1.0 for v in strength.values()) and all(_has_waits(l2, x) for x in ordered):
            # blocking links, no GPU phases: the one the others waited for waited least itself
            strength = firm = {x: -l2.extra(x, WAIT_P2P)[1] for x in ordered}
        cause = max(ordered, key=lambda x: (strength[x], -x))
        prev = l2.causes.get(frozenset(comp))
        alone = grew_alone(ordered[0], ordered[1], l2, th, set(), need) if len(ordered) == 2 else None
        # keep the rank already named unless a peer clearly outgrew it, persistently: a bubble's
        # stage-0 victim (its backward waits as long as its peer's grew) had its thread-GPU's forward
        # slowed 1.4-3.0x by CPU contention in 2-3 of 4 steps and took the cause, as a pipeline
        # bubble or as a link (CI of 5f88dc5, and 2 runs of 3 here on 2026-12-07)
        keep = prev if prev is not None and prev in cands else None
        if alone is not None and (
            keep is None or alone == keep or firm[alone] >= th.cause_keep * strength[keep]
        ):
            cause = alone  # its own work grew, its peer's did not: both waiting phases grew alike
        elif keep is not None and (alone is not None or firm[cause] < th.cause_keep * strength[keep]):
            cause = keep
        if cause not in cands:
            continue  # its peer grew more but is not persistent yet: decide next step
        l2.causes[frozenset(comp)] = cause
        victims = [x for x in ordered if x != cause]
        link = groups.small_links(cause, victims[0]) if victims else None
        out.append(Culprit("pipeline_bubble" if link else "straggler", [cause], victims, link))
    return out


WAITED_STEPS = 16


def _others_waited(l2: L2, rank: int) -> bool:
    """A rank slows its group only if the others waited for it: in at least half of its flagged steps
    among the last WAITED_STEPS it was late on the host, or lowest in a communication phase (it
    waited least: flagged, or the group's minimum by a clear margin). Where the group
    has no communication phase (no side-stream timer, no blocking calls) nothing can show that,
    and a phase outlier is taken as it is. Measured: in clean simulated runs on 2 cores, a rank's
    forward grew 1.33x for 4-7 steps from CPU contention while its peers waited for nobody."""
    eps = l2.episode(rank, WAITED_STEPS)
    comm = comm_phases(l2, eps[-1].group) if eps else []
    if not comm:
        return True
    waited = sum(1 for f in eps if f.late or f.low or any(f.gpu_last.values()) or f.gpu_arr is not None)
    return 2 * waited >= len(eps) or _waited_less(l2, eps, comm)


def comm_phases(l2: L2, group: str) -> List[str]:
    """The group's communication phases (the rank everyone waits for spends least in them)."""
    return [p for p, role in l2.roles.get(group, {}).items() if role == "comm"]


def _waited_less(l2: L2, eps: List[RankFlag], comm: List[str]) -> bool:
    """In at least 3 of 4 of its flagged steps, and more than `persist_n` of them, the rank waited
    less than its group's median in a communication phase, by `abs_min_ns` on median: the others
    waited for it, though not always by a margin over the second-least waiting member (8 simulated
    ranks on 2 CPUs: a 1.35x straggler waited least by 1 ms in 4-5 of 10 steps, under its group's
    median in 27 of 28, and was named 24-61 steps late). A rank whose phase grew while nobody
    waited for it lies on either side of the median; one the others waited for in a burst of 3-4
    steps (a thread-GPU slowed by a co-tenant, in a clean run) has too few steps."""
    devs = [min(f.dev[p][1] for p in comm if p in f.dev) for f in eps if any(p in f.dev for p in comm)]
    if len(devs) <= l2.th.persist_n:
        return False
    below = sum(1 for d in devs if d < 0)
    return 4 * below >= 3 * len(devs) and median(devs) <= -l2.th.abs_min_ns


def _strength(l2: L2, rank: int, min_steps: int) -> float:
    """The largest factor by which one of the rank's phases stood out in at least `min_steps` of
    its recent steps (one noisy step of the waiting peer must not outweigh the cause's phase)."""
    hi = [
        v[0]
        for p, v in l2.phase_summary(rank, l2.th.persist_n).items()
        if not p.endswith(":low") and v[2] >= min_steps
    ]
    return max(hi) if hi else 1.0


def link_peers(r: int, groups: Groups) -> Set[int]:
    """Ranks joined to `r` by send/recv or by a 2-rank collective."""
    peers = set(groups.edges.get(r, ()))
    for g in groups.by_comm.values():
        if len(g.members) == 2 and r in g.members:
            peers |= g.members
    return peers - {r}


def _component(r: int, cands: Set[int], groups: Groups) -> Set[int]:
    comp = {r}
    todo = [r]
    while todo:
        x = todo.pop()
        for y in link_peers(x, groups) & cands:  # send/recv and 2-rank collectives (TP pairs)
            if y not in comp:
                comp.add(y)
                todo.append(y)
    return comp


def _gpu_last(l2: L2, rank: int) -> int:
    """Steps among its last `persist_n` in which its GPU surely reached the collectives last."""
    return sum(1 for f in l2.episode(rank, l2.th.persist_n) if f.gpu_arr is not None)


def _has_waits(l2: L2, rank: int) -> bool:
    return any(WAIT_P2P in d for d in l2.devs.get(rank, ()))


def _wait_pattern(a: int, b: int, l2: L2, th: Thresholds) -> str:
    """No GPU phase stood out (a job without CUDA-event timers), but its pipeline link blocks: both
    ends' host waits in send/recv grew by about the same time -> the link; one end's did not grow
    at all -> that end is the one the other waits for ('no'). 'maybe' without such waits yet, or
    when both grew but unequally."""
    if not (_has_waits(l2, a) and _has_waits(l2, b)):
        return "maybe"
    ea, eb = l2.extra(a, WAIT_P2P)[1], l2.extra(b, WAIT_P2P)[1]
    top = max(ea, eb)
    if top > 0 and min(ea, eb) >= (1.0 - th.pair_equal_tol) * top:
        return "link"
    # both grew, unequally: a CPU burst on one end's host makes the other wait longer for a step
    # or two (measured: 35 vs 3.5 ms once, on a link both ends waited 7 ms more on), look again
    return "maybe" if top > 0 and min(ea, eb) >= 0.25 * top else "no"


def _link_pattern(a: int, b: int, l2: L2, th: Thresholds, min_steps: int = 2) -> str:
    """'link' when the transfers between a and b got slower: in every phase both of them stand out
    in, both grew by about the same time; a phase standing out on one end only grew on the other by
    at least a quarter as much; and they grew in at least two phases (every phase that moves data
    between them: forward and backward of a pipeline) — where a phase too noisy to stand out counts
    if one end grew in it by at least half as much as the largest and the other by at least a
    quarter of that (the receiving stage's forward is full of waits). A slow *rank* fails this: it
    shows a phase its waiting peer does not (a pipeline bubble grows backward only; a compute
    straggler also its optimizer step). 'maybe' when only one phase qualifies yet but another is
    growing on one end, or a phase flagged on one end grew on the other by less than a quarter (a
    receiver that waited anyway hides a slower transfer for a step or two); 'no' otherwise. A phase
    stands out when it did in `min_steps` of the last `persist_n`."""
    by: Dict[int, Set[str]] = {
        x: {
            p
            for p, v in l2.phase_summary(x, th.persist_n).items()
            if not p.endswith(":low") and v[2] >= min_steps
        }
        for x in (a, b)
    }
    flagged = by[a] | by[b]
    if not flagged:
        return _wait_pattern(a, b, l2, th)
    tops: List[float] = []
    hidden = False
    for p in flagged:
        ea, eb = l2.extra(a, p)[1], l2.extra(b, p)[1]
        top = max(ea, eb)
        if min(ea, eb) <= 0:
            return "no"
        # Flagged on both ends: the same transfer got slower, so both grew by about the same time.
        # Flagged on one end only: the other end's copy of the phase is too noisy to stand out
        # (e.g. the receiving stage's forward, full of waits) — it must still have grown clearly.
        if p in by[a] and p in by[b]:
            if abs(ea - eb) > th.pair_equal_tol * top:
                return "no"
        elif min(ea, eb) < 0.25 * top:
            # grew on the other end too, but little: a receiver that waited anyway hides most of a
            # slower transfer for a step or two (CI: a slowed link's sender's forward +11 ms, its
            # receiver's under 3 ms, judged a bubble one step before the link showed)
            hidden = True
            continue
        tops.append(top)
    if not tops:
        return "maybe" if hidden else "no"
    # a phase counts towards the two only if it grew by at least half as much as the largest: a
    # noisy phase that stood out by a few ms once made a pipeline bubble look like a link
    ref = max(tops)
    strong = sum(t >= 0.5 * ref for t in tops)
    roles = {p: r for m in l2.roles.values() for p, r in m.items()}
    phases = {p for x in (a, b) for d in l2.devs.get(x, ()) for p in d}
    corroborated = maybe = 0
    for p in phases - flagged:
        if roles.get(p) == "comm":
            continue
        ea, eb = l2.extra(a, p)[1], l2.extra(b, p)[1]
        # as a phase flagged on one end: the other end grew at least a quarter as much as this one
        # (measured: a slowed link's receiving forward grew 2.0 ms beside its sender's 6.2 ms)
        if max(ea, eb) >= 0.5 * ref and min(ea, eb) >= 0.25 * max(ea, eb):
            corroborated += 1
        elif max(ea, eb) >= 0.25 * ref:
            maybe += 1
    if grew_alone(a, b, l2, th, flagged, min_steps) is not None:
        return "no"
    if strong + corroborated >= 2:
        return "maybe" if hidden else "link"
    return "maybe" if maybe or hidden else "no"


def grew_alone(a: int, b: int, l2: L2, th: Thresholds, skip: Set[str], min_steps: int = 2) -> Optional[int]:
    """The end of a pair whose own work grew: a phase (not communication, not in `skip`) that on it
    grew by twice the largest deviation of the group's other ranks in their recent steps, and by at
    least half the relative growth of the end's phases that stood out on both ends (a slow GPU or
    host slows all its own work by about one factor; a wait for the peer grows a phase by part of
    the peer's delay), while the other end grew by less than a quarter as much. A slower transfer
    grows what both ends do; a compute straggler inside a pipeline stage also grows work its peer
    does not wait on (its optimizer step: 1.5x beside its peer's 1.0 in the simulated job, while
    forward and backward grew 1.1-1.5x on both ends alike; a bubble's waiting peer's forward grew
    1.15-1.23x while its backward, waiting, grew 1.64x). The other ranks' recent deviations are the
    reference, not the group's learnt noise, which a deviation below the naming floors teaches.
    "Stood out" is in `min_steps` of the last `persist_n` steps."""
    roles = {p: r for m in l2.roles.values() for p, r in m.items()}
    phases = {p for x in (a, b) for d in l2.devs.get(x, ()) for p in d} - skip
    # each end's growth where both ends stood out (what the waiting peer shares; its own phase that
    # spiked once must not set the bar: a 2.2x forward burst hid a straggler's 1.5x optimizer)
    summary = {x: l2.phase_summary(x, th.persist_n) for x in (a, b)}
    both = [
        {p for p, v in summary[x].items() if not p.endswith(":low") and v[2] >= min_steps} for x in (a, b)
    ]
    top = {
        x: max(
            [l2.extra(x, p)[0] for p in both[0] & both[1]]
            or [v[0] for p, v in summary[x].items() if not p.endswith(":low")],
            default=1.0,
        )
        for x in (a, b)
    }
    # each end's group's other ranks (the reference), looked up once, not per phase
    others: Dict[int, Optional[List[int]]] = {}
    for x, y in ((a, b), (b, a)):
        eps = l2.episode(x, th.persist_n)
        others[x] = [m for m in l2.members.get(eps[-1].group, ()) if m not in (x, y)] if eps else None
    found: Set[int] = set()
    for p in phases:
        if roles.get(p) == "comm":
            continue
        for x, y in ((a, b), (b, a)):
            rx, ex = l2.extra(x, p)
            ref = others[x]
            if ref is None or ex <= 0 or rx - 1.0 < max(th.rel_min, 0.5 * (top[x] - 1.0)):
                continue
            if l2.extra(y, p)[1] >= 0.25 * ex:
                continue
            # (only now, past the cheap tests: O(group size))
            spread = [abs(d[p][1]) for m in ref for d in l2.devs.get(m, ()) if p in d]
            if len(ref) >= 2 and spread and ex > 2 * max(spread):
                found.add(x)
    return found.pop() if len(found) == 1 else None
