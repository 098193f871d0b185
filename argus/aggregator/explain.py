"""Turn what the levels measured into findings: the numbers that convinced them, and one sentence a
person on call can act on."""

from __future__ import annotations

from typing import Any, Deque, Dict, List, Mapping, Optional, Tuple

from argus.aggregator.alerts import Finding
from argus.aggregator.align import POSITIONS, JobAlign
from argus.aggregator.commmode import WAIT_P2P, CommModes
from argus.aggregator.config import PhaseInfo
from argus.aggregator.distributions import Drift, Shift
from argus.aggregator.gpuarrival import GpuArrivals, sources_text
from argus.aggregator.hang import HangFinding
from argus.aggregator.ranks import L2, Culprit, RankFlag, comm_phases
from argus.aggregator.robust import median
from argus.aggregator.state import JOB_GROUP, Groups
from argus.aggregator.steptime import L1Finding


def _position(pos: Optional[int]) -> Optional[Dict[str, int]]:
    """A job position (argus.aggregator.align) as step and index of the collective in the step."""
    if pos is None:
        return None
    return {"step": pos // POSITIONS, "index": pos % POSITIONS}


def ranks_text(ranks: List[int]) -> str:
    """[0,1,2,3,5] -> '0–3, 5'."""
    rs = sorted(set(ranks))
    parts: List[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}–{rs[j]}")
        i = j + 1
    return ", ".join(parts)


def _ms(ns: float) -> str:
    v = ns / 1e6
    return f"{v:.0f} ms" if abs(v) >= 10 else f"{v:.1f} ms"


def _x(r: float) -> str:
    return f"{r:.2f}×"


class Explainer:
    def __init__(
        self,
        job: str,
        groups: Groups,
        info: PhaseInfo,
        hosts: Dict[int, str],
        py: Optional[Mapping[int, Deque[Dict[str, int]]]] = None,
        align: Optional[JobAlign] = None,
        modes: Optional[CommModes] = None,
        gpu: Optional[GpuArrivals] = None,
    ) -> None:
        self.job = job
        self.groups = groups
        self.info = info
        self.hosts = hosts
        self.py = py or {}
        self.align = align
        self.modes = modes
        self.gpu = gpu

    def identity(self, ev: Dict[str, Any], comm: Optional[str], ranks: List[int]) -> None:
        """Where the finding's communicator and step alignment came from, and how sure that is; and
        whether its collectives block the host (then host time inside them is the wait)."""
        if self.align is not None:
            ident = self.align.identity(comm, ranks)
            if ident:
                ev["identity"] = ident
        if self.modes is not None and comm is not None:
            b = self.modes.blocking(comm)
            if b is None:  # a send/recv link has no instances to vote with: the job's majority
                b = self.modes.job_blocking()
            if b is not None:
                ev["comm_mode"] = "blocking" if b else "async"

    def py_outliers(self, r: int, peers: List[int]) -> Dict[str, Dict[str, Optional[float]]]:
        """Python phases in which rank r spent clearly more time per step than its peers' median
        over the recent steps (sampled: >= 1.25x and >= 5 ms per step, at least 4 steps each).
        Evidence and words only; the levels never judge these."""
        mine = self.py.get(r)
        if not mine or len(mine) < 4:
            return {}

        def per_step(q: Deque[Dict[str, int]]) -> Dict[str, float]:
            tot: Dict[str, float] = {}
            for d in q:
                for k, v in d.items():
                    tot[k] = tot.get(k, 0.0) + v
            return {k: v / len(q) for k, v in tot.items()}

        others = [per_step(self.py[x]) for x in peers if x != r and len(self.py.get(x, ())) >= 4]
        if len(others) < 2:
            return {}
        own = per_step(mine)
        out: Dict[str, Dict[str, Optional[float]]] = {}
        for p, v in own.items():
            ref = median([o.get(p, 0.0) for o in others])
            if v - ref >= 5e6 and v >= 1.25 * ref:
                # ratio None: the peers spend (almost) no time in this phase at all
                ratio = round(v / ref, 2) if ref > 0 else None
                out[p] = {"ratio": ratio, "extra_ms": round((v - ref) / 1e6, 1)}
        return dict(sorted(out.items(), key=lambda kv: -(kv[1]["extra_ms"] or 0.0)))

    def who(self, r: int) -> str:
        h = self.hosts.get(r)
        return f"rank {r} (host {h})" if h else f"rank {r}"

    def _group(self, key: str) -> Dict[str, Any]:
        g = self.groups.by_comm.get(key)
        if key == JOB_GROUP or g is None:
            return {"comm": None, "op": None, "size": None}
        return {"comm": key, "op": g.main_op, "size": len(g.members)}

    # ---- L2 ---------------------------------------------------------------------------------------

    @staticmethod
    def _under_median(l2: L2, key: str, eps: List[RankFlag]) -> List[Tuple[str, Tuple[float, float, int]]]:
        """(communication phase, (median ratio, median ns less, steps under the median)) over the
        flagged steps `eps`, for phases the rank spent less in than its group's median in most."""
        out = []
        for p in comm_phases(l2, key):
            devs = [e.dev[p] for e in eps if p in e.dev]
            under = sum(1 for _r, d in devs if d < 0)
            if devs and 2 * under > len(devs):
                out.append((p, (median([r for r, _d in devs]), -median([d for _r, d in devs]), under)))
        return sorted(out, key=lambda x: -x[1][1])

    def culprit(self, c: Culprit, l2: L2, flags: Dict[int, RankFlag], step: int, window: int) -> Finding:
        if c.kind == "slow_link":
            return self._pair(c, l2, step, window)
        r = c.ranks[0]
        eps = l2.episode(r, window)
        first = eps[0].step if eps else step
        summ = l2.phase_summary(r, window)
        f = flags.get(r)
        key = f.group if f else JOB_GROUP
        grp = self._group(key)
        members = l2.members.get(key, [])
        high = sorted(((p, v) for p, v in summ.items() if not p.endswith(":low")), key=lambda x: -x[1][1])
        low = [(p[:-4], v) for p, v in summ.items() if p.endswith(":low")]
        # named because it waited less than its group's median (argus.aggregator.ranks._waited_less),
        # never by a margin that flagged it low: that is what says the others waited for it
        under = [] if low else self._under_median(l2, key, eps)
        late = [e for e in eps if e.late]
        inst = sum(e.late_n for e in eps)
        last = sum(e.late_last for e in eps)
        # a step counts once whichever evidence said its GPU came last (timers, or GPU arrival)
        gpu_last = sum(1 for e in eps if any(e.gpu_last.values()) or e.gpu_arr is not None)
        arr = [e.gpu_arr for e in eps if e.gpu_arr is not None]
        ev: Dict[str, Any] = {
            "group": grp["comm"],
            "group_size": len(members),
            "steps_flagged": len(eps),
            "phases": {
                p: {"ratio": round(v[0], 3), "extra_ms": round(v[1] / 1e6, 2), "steps": v[2]} for p, v in high
            },
            "waited_for": {
                p: {"ratio": round(v[0], 3), "peers_waited_ms": round(v[1] / 1e6, 2), "steps": v[2]}
                for p, v in (low or under)
            },
            "host_late_steps": len(late),
            "host_late_median_ms": round(median([e.late_ns for e in late]) / 1e6, 2) if late else 0.0,
            "arrived_last": {"instances": inst, "last": last},
            "gpu_reached_last_steps": gpu_last,
            "victims": c.victims,
            "symptoms": sorted(x for x in members if x != r),
        }
        arr_text = ""
        if arr:
            src, by = sources_text(arr)
            since = min(v.step for v in arr)
            first = min(first, since)  # the evidence is for the step before the one that carried it
            _n, judged = self.gpu.tally(r, since) if self.gpu is not None else (len(arr), len(arr))
            judged = max(judged, len(arr))
            arr_late = median([v.late_ns for v in arr])
            ev["gpu_arrival"] = {
                "source": " + ".join(by),
                "bound_ms": round(min(v.bound_ns for v in arr) / 1e6, 2),
                "steps": len(arr),
                "judged_steps": judged,
                "late_ms": round(arr_late / 1e6, 2),
                "by_source": by,
                "evidence_steps": [since, max(v.step for v in arr)],
            }
            arr_text = (
                f"its GPU reached the collectives last in {len(arr)} of {judged} steps, "
                f"{_ms(arr_late)} after its peers' on median (evidence: {src})"
            )
        py = self.py_outliers(r, members or sorted(self.py))
        if py:
            ev["python_phases"] = py
        parts: List[str] = []
        if late:
            frac = last / inst if inst else 0.0
            parts.append(
                f"arrived last at {frac:.0%} of its collectives, {_ms(ev['host_late_median_ms'] * 1e6)} "
                "late on median"
            )
        if high:
            txt = ", ".join(f"{self.info.label(p)} {_x(v[0])} (+{_ms(v[1])})" for p, v in high[:2])
            parts.append(f"its {txt} of its peers'")
        if low:
            p, v = low[0]
            if p.startswith("wait:"):  # host time inside blocking calls (argus.aggregator.commmode)
                parts.append(
                    f"it waited least inside the blocking collectives in {v[2]} of {len(eps)} steps "
                    f"(its host time in them is {_x(v[0])} its peers': they waited {_ms(v[1])} for it)"
                )
            else:
                parts.append(
                    f"its GPU reached the collectives last in {gpu_last} of {len(eps)} steps "
                    f"(its {self.info.label(p)} is {_x(v[0])} its peers': they waited {_ms(v[1])} for it)"
                )
        elif under:
            p, v = under[0]
            parts.append(
                f"it waited less than its peers' median in {v[2]} of {len(eps)} steps (its "
                f"{self.info.label(p)} is {_x(v[0])} its peers': they waited {_ms(v[1])} for it)"
            )
        elif arr_text:  # no communication timer: the GPU-arrival evidence says it
            parts.append(arr_text)
        if py:
            txt = ", ".join(
                f"{p} {_x(v['ratio']) + ' ' if v['ratio'] else ''}(+{_ms((v['extra_ms'] or 0.0) * 1e6)}/step)"
                for p, v in list(py.items())[:2]
            )
            parts.append(f"in Python it spends more time in {txt} than its peers")
        where = f"its {self.groups.describe(key)}" if key != JOB_GROUP else "the job"
        if c.kind == "pipeline_bubble":
            vict = c.victims
            vtxt = ", ".join(f"rank {x}" for x in vict)
            tail = (
                f"; its pipeline peer{'s' if len(vict) > 1 else ''} {vtxt} "
                f"wait{'' if len(vict) > 1 else 's'} for it in Recv "
                "(their own phases grew by the same time: symptoms, not causes)"
            )
            head = f"{self.who(r)} amplifies pipeline bubbles in steps {first}–{step}"
        else:
            n = max(len(members) - 1, 0)
            tail = f"; the other {n} ranks' collective waits are symptoms, not causes" if n else ""
            head = f"{self.who(r)} is the straggler of {where} in steps {first}–{step}"
        summary = head + ": " + "; ".join(parts or ["it was the outlier of its group"]) + tail
        self.identity(ev, grp["comm"], members or [r])
        return Finding(c.kind, [r], (first, step), summary, ev, grp["comm"], grp["op"])

    def _pair(self, c: Culprit, l2: L2, step: int, window: int) -> Finding:
        a, b = c.ranks
        sa, sb = l2.phase_summary(a, window), l2.phase_summary(b, window)
        eps = l2.episode(a, window)
        first = eps[0].step if eps else step
        phases = sorted(p for p in sa if not p.endswith(":low"))
        ev = {
            "pair": [a, b],
            "link_comm": c.link,
            "extra_ms": {p: [round(sa[p][1] / 1e6, 2), round(sb[p][1] / 1e6, 2)] for p in phases if p in sb},
            "ratios": {p: [round(sa[p][0], 3), round(sb[p][0], 3)] for p in phases if p in sb},
            "attribution": "pair (both ends grew by the same time in every phase either grew in)",
        }
        grown = ", ".join(
            f"{self.info.short(p)} +{_ms(sa[p][1])}/+{_ms(sb[p][1])}" for p in phases if p in sb
        )
        if not grown:  # no GPU phase: the pair's host waits inside blocking send/recv grew alike
            ea, eb = l2.extra(a, WAIT_P2P)[1], l2.extra(b, WAIT_P2P)[1]
            ev["extra_ms"] = {WAIT_P2P: [round(ea / 1e6, 2), round(eb / 1e6, 2)]}
            ev["attribution"] = (
                "pair (both ends' host waits in their blocking send/recv grew by the same time)"
            )
            grown = f"host time in send/recv +{_ms(ea)}/+{_ms(eb)}"
        what = self.groups.describe(c.link) if c.link else "link"
        self.identity(ev, c.link, [a, b])
        summary = (
            f"the link between {self.who(a)} and {self.who(b)} ({what}) is slow in steps {first}–{step}: "
            f"both ends grew by the same time ({grown}) while their peers did not — the transfers "
            "between them got slower; a slow rank would grow more than the peer that waits for it"
        )
        return Finding("slow_link", [a, b], (first, step), summary, ev, c.link, None)

    def stall(self, r: int, ev: Dict[str, Any], first: int, step: int) -> Finding:
        gap = ev.get("gap")
        when = f"step {step}" if first == step else f"steps {first}–{step}"
        if ev.get("launches") is not None:
            spread = (
                f", and its {ev['launches']} kernel launches were spread over a {ev['step_ms']:.0f} ms step "
                f"({ev['launches_per_ms']}/ms vs {ev['normal_launches_per_ms']}/ms normally)"
            )
        else:  # the launch probes did not cover the step
            spread = f", over a {ev['step_ms']:.0f} ms step"
        summary = (
            f"{self.who(r)} stalled on the host in {when}: it reached its collectives "
            f"{ev['late_ms']:.0f} ms after its peers ({gap}); its host time outside GPU waits was "
            f"{ev['host_other_ms']:.0f} ms vs {ev['peers_host_other_ms']} ms on its peers{spread}: its GPU "
            f"sat idle while every other rank waited (baseline step {ev['baseline_step_ms']:.0f} ms). "
            "Data loading, JIT compilation or GC: host stacks would tell which"
        )
        self.identity(ev, None, [r])
        return Finding("host_stall", [r], (first, step), summary, ev)

    def missing(
        self,
        host: str,
        ranks: List[int],
        on_host: List[int],
        steps: Tuple[int, int],
        silent_s: float,
        beat_age_s: Optional[float],
        others: int,
        back: List[int],
    ) -> Finding:
        """Ranks that fell silent while `others` ranks kept stepping (argus.aggregator.engine); `back`:
        ranks of the host that were silent as long and just reported again."""
        whole = set(ranks) | set(back) >= set(on_host)
        where = f"host {host}" if host else "an unnamed host"
        if beat_age_s is not None and beat_age_s < 5.0:
            why = (
                "its agent still sends heartbeats, so their summaries are lost on the way: see the agent's "
                "drop counters (`argus top`, or its log)"
            )
        elif whole:
            why = "its agent, or its network path to Redis, is down: no sign that its GPUs are slow"
        else:
            why = "their agent lost them (a rank or the agent restarted?) or their summaries are dropped"
        if whole:
            who = f"{where} missing: its {len(on_host)} rank(s) ({ranks_text(on_host)})"
            if back:
                who += f", coming back (rank(s) {ranks_text(back)} report again; not yet {ranks_text(ranks)})"
        else:
            who = f"rank(s) {ranks_text(ranks)} of {where}"
        summary = (
            f"{who} sent no step summary for {silent_s:.0f} s (since job step {steps[0]}) while "
            f"{others} other rank(s) kept stepping; {why}. They are left out of the diagnosis "
            "until they report again (not judged as stragglers)"
        )
        ev: Dict[str, Any] = {
            "host": host,
            "whole_host": whole,
            "silent_s": round(silent_s, 1),
            "ranks_on_host": on_host,
            "reporting_ranks": others,
        }
        if beat_age_s is not None:
            ev["heartbeat_age_s"] = round(beat_age_s, 1)
        return Finding("missing", ranks, steps, summary, ev, key=f"host:{host}")

    # ---- L3 ---------------------------------------------------------------------------------------

    def shift(self, s: Shift, members: List[int], step: int, extra: Dict[str, Any]) -> Finding:
        grp = self._group(s.group)
        label = self.info.label(s.phase)
        ev: Dict[str, Any] = {
            "phase": s.phase,
            "role": s.role,
            "ratio": round(s.ratio, 3),
            "baseline_ms": round(s.baseline_ns / 1e6, 2),
            "level_ms": round(s.level_ns / 1e6, 2),
            "w1_rel": round(s.w1_rel, 3),
            "late_ranks": 0,
            **extra,
        }
        where = self.groups.describe(s.group)
        if s.role == "comm":
            ev["pair"] = None
            ev["attribution"] = (
                "group only: a ring collective completes at the same time on every rank, so per-rank "
                "timings cannot tell which link of the group is slow"
            )
            summary = (
                f"the collectives of the {where} (ranks {ranks_text(members)}) are slower since step "
                f"{s.since} with no late rank: the fastest rank's {label} — the collective's own time — "
                f"is {_x(s.ratio)} its baseline ({_ms(s.baseline_ns)} → {_ms(s.level_ns)})"
                + (f"; host sync wait {_x(extra['host_wait_ratio'])}" if extra.get("host_wait_ratio") else "")
                + ". A slow link or NIC inside this group; which pair cannot be told from per-rank timings "
                "of a ring collective: run nccl-tests between pairs of these ranks' hosts"
            )
            self.identity(ev, grp["comm"], members)
            return Finding("slow_link", members, (s.since, step), summary, ev, grp["comm"], grp["op"])
        note = "" if s.role == "main" else " (if this timer measures communication, this is a slow link)"
        summary = (
            f"{label} of every rank of the {where} (ranks {ranks_text(members)}) is {_x(s.ratio)} its "
            f"baseline since step {s.since} ({_ms(s.baseline_ns)} → {_ms(s.level_ns)}), with no outlier "
            f"rank{note}"
        )
        return Finding("kernel_degradation", members, (s.since, step), summary, ev, grp["comm"], grp["op"])

    def drift(self, d: Drift, step: int, window: int) -> Finding:
        ev = {
            "phase": d.phase,
            "w1_rel": round(d.score, 4),
            "fence": round(d.fence, 4),
            "rank_median_ms": round(d.rank_median_ns / 1e6, 2),
            "group_median_ms": round(d.group_median_ns / 1e6, 2),
            "window_steps": window,
        }
        summary = (
            f"{self.who(d.rank)}'s {self.info.label(d.phase)} drifted away from its "
            f"{self.groups.describe(d.group)} over the last {window} steps without spiking: median "
            f"{_ms(d.rank_median_ns)} vs {_ms(d.group_median_ns)} (W1 {d.score:.1%} of the group median, "
            f"fence {d.fence:.1%})"
        )
        return Finding("kernel_degradation", [d.rank], (step - window + 1, step), summary, ev)

    # ---- hang and L1 -------------------------------------------------------------------------------

    def hang(self, h: HangFinding, step: Optional[int]) -> Finding:
        ev = dict(h.evidence)
        ev["comm"] = h.comm
        ev["collective"] = _position(h.seq)
        ev["blocked"] = {
            r: {**h.blocked[r], "seq": _position(h.blocked[r].get("seq"))} for r in sorted(h.blocked)
        }
        if "last_seq" in ev:
            ev["last_seq"] = {r: _position(v) for r, v in ev["last_seq"].items()}
        nb = len(h.blocked)
        calls = "/".join(ev["calls"])
        blocked_txt = f"{nb} rank(s) blocked in {calls} for {ev['longest_blocked_s']:.1f} s"
        if ev.get("since_attach"):
            blocked_txt += " or more (blocked when the agent attached)"
        where = ev.get("where") or {}
        doing = "; ".join(f"rank {r} is {w}" for r, w in sorted(where.items()) if r in h.missing)
        if h.comm is not None and h.seq is not None:
            at = ev["collective"]
            summary = (
                f"hang: {blocked_txt} while {', '.join(self.who(r) for r in h.missing)} never reached "
                f"collective #{at['index']} of step {at['step']} on {self.groups.describe(h.comm)}"
            )
        elif h.missing and "communicator" in ev:
            cm = ev["communicator"]
            summary = (
                f"hang: {blocked_txt} as ranks {ranks_text(cm['blocked_as'])} of a communicator of "
                f"{cm['nranks']} ranks; {', '.join(self.who(r) for r in h.missing)} — its rank(s) "
                f"{ranks_text(cm['missing_as'])} — never arrived"
            )
        elif h.missing:
            on = f" on {self.groups.describe(h.comm)}" if h.comm is not None else ""
            summary = (
                f"hang: {blocked_txt}{on}; {', '.join(self.who(r) for r in h.missing)} "
                f"{'is' if len(h.missing) == 1 else 'are'} not blocked in any probed call: look there first"
            )
        else:
            summary = (
                f"hang: {blocked_txt} and no rank is behind: one entered and never left "
                "(dead GPU, wedged kernel)"
            )
        if doing:
            summary += f" ({doing})"
        ranks = h.missing or sorted(h.blocked)
        self.identity(ev, h.comm, ranks)
        s = step if step is not None else -1
        return Finding("hang", ranks, (s, s), summary, ev, h.comm, None)

    def l1(self, f: L1Finding, gpu: Optional[Dict[str, Any]] = None) -> Finding:
        """`gpu`: what the GPUs' arrivals could tell over the finding's steps
        (argus.aggregator.gpuarrival.GpuArrivals.unseparated): said, so that a slower job on which no
        evidence separates the ranks says so instead of seeming to have no culprit."""
        ev: Dict[str, Any] = {
            "ratio": round(f.ratio, 3),
            "baseline_ms": round(f.baseline_ns / 1e6, 2),
            "level_ms": round(f.level_ns / 1e6, 2),
        }
        if f.kind == "step_spike":
            summary = (
                f"step {f.first} took {_ms(f.level_ns)}, {_x(f.ratio)} the recent median "
                f"({_ms(f.baseline_ns)}); no rank, phase or link explains it"
            )
        else:
            summary = (
                f"step time regressed from {_ms(f.baseline_ns)} to {_ms(f.level_ns)} ({_x(f.ratio)}) at step "
                f"{f.first}; no rank, phase or link explains it"
            )
        if gpu:
            ev["gpu_arrival"] = {k: v for k, v in gpu.items() if k != "text"}
            summary += f"; {gpu['text']}"
        return Finding(f.kind, [], (f.first, f.last), summary, ev)
