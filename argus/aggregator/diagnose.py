"""`argus diagnose`: a one-shot report of what the levels found, in words a person on call can act on."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from argus.aggregator.alerts import Alert
from argus.aggregator.engine import Engine, JobDiag
from argus.aggregator.explain import ranks_text
from argus.aggregator.steptime import L1Finding

ORDER = {"critical": 0, "warning": 1, "info": 2}
NEXT_STEP = {
    "straggler": "check the named rank's GPU (clocks, throttling, XID) and node; replace it if it persists",
    "pipeline_bubble": "check the named rank's GPU first; its pipeline peers only wait for it",
    "slow_link": "test the link: nccl-tests between the named ranks' GPUs/hosts, NIC and PCIe error counters",
    "host_stall": "look at the rank's host: data loader workers, JIT/compile caches, GC, swap",
    "hang": "dump the stacks of the missing rank (py-spy dump -p PID); the others only wait for it",
    "kernel_degradation": "compare the rank's GPU clocks and temperature with its peers'",
    "step_spike": "look for job-wide events at that step (checkpoint, evaluation, storage)",
    "step_regression": "look for what changed at that step (config, data, co-located load)",
    "missing": "check the host's agent (is `argus probe` running?) and its network path to Redis",
}


def _overlaps(a: Alert, rng: Optional[Tuple[int, int]]) -> bool:
    if rng is None:
        return True
    lo, hi = rng
    first, last = a.steps
    return not (last < lo or (first > hi and first >= 0))


def _l1_windows(d: JobDiag, rng: Optional[Tuple[int, int]]) -> List[L1Finding]:
    """The L1 log merged into windows: overlapping or adjacent findings of one kind become one."""
    out: List[L1Finding] = []
    for f in sorted(d.l1_log, key=lambda f: (f.kind, f.first)):
        if rng is not None and (f.last < rng[0] or f.first > rng[1]):
            continue
        prev = out[-1] if out else None
        if prev is not None and prev.kind == f.kind and f.first <= prev.last + 1:
            out[-1] = L1Finding(
                f.kind,
                prev.first,
                max(prev.last, f.last),
                max(prev.ratio, f.ratio),
                prev.baseline_ns,
                f.level_ns,
            )
        else:
            out.append(f)
    return sorted(out, key=lambda f: f.first)


def _comm_identity(d: JobDiag, comm: str) -> str:
    jc = d.align.comms.comms.get(comm)
    return f"{jc.source}, {jc.confidence}" if jc is not None else "-"


def _identity_text(ev: Dict[str, Any]) -> str:
    """The alert's identity evidence as one line: where its communicator and steps came from."""
    ident = ev.get("identity") or {}
    parts = []
    c = ident.get("comm")
    if c:
        note = f"; {c['note']}" if c.get("note") else ""
        parts.append(f"communicator from {c['identity']} (confidence {c['confidence']}{note})")
    st = ident.get("steps")
    if st:
        res = (
            f", step ends within {st['residual_ms']} ms of the job's (tolerance {st['tolerance_ms']} ms)"
            if "residual_ms" in st
            else ""
        )
        parts.append(f"steps aligned by {st['aligned_by']}{res} (confidence {st['confidence']})")
    ck = ident.get("clocks")
    if ck:
        parts.append(f"host clocks corrected by {_clocks_text(ck)}")
    if ev.get("comm_mode"):
        parts.append(f"collectives {ev['comm_mode']}")
    return "; ".join(parts)


def _clocks_text(ck: Dict[str, Any]) -> str:
    offs = ", ".join(
        f"{h} {o:+.1f} ms (±{ck['spread_ms'].get(h, 0.0):.1f})" for h, o in ck["offsets_ms"].items()
    )
    return f"{offs} from {ck['reference']}, estimated from {ck['estimated_from']}"


def report_data(
    engine: Engine, job: Optional[str] = None, steps: Optional[Tuple[int, int]] = None
) -> Dict[str, Any]:
    jobs = [job] if job else sorted(engine.jobs)
    out: Dict[str, Any] = {"jobs": []}
    for j in jobs:
        d = engine.jobs.get(j)
        if d is None:
            continue
        alerts = [a for a in engine.alerts(j) if _overlaps(a, steps)]
        alerts.sort(key=lambda a: (ORDER.get(a.severity, 3), a.steps[0], a.kind))
        out["jobs"].append(
            {
                "job": j,
                "ranks": sorted(d.hosts),
                "hosts": sorted(set(d.hosts.values())),
                "steps": [d.first_step, d.last_step],
                "judged": d.judged,
                "warmup": engine.th.warmup_steps if d.align.absolute else engine.th.attach_warmup_steps,
                "alignment": d.align.summary(),
                "clocks": d.clocks.evidence(),
                "gpu_arrival": d.gpuarr.summary(),
                # a rank absent from the last step judged only: the recording ended between two
                # ranks' summaries (flush judges that frame without it), not a gap
                "gaps": [list(g) for g in d.gaps]
                + [[r, s, None] for r, s in sorted(d.absent.items()) if s < d.last_step],
                "median_step_ms": round(d.l1.median_step() / 1e6, 2),
                "alerts": [a.to_json() for a in alerts],
                "l1": [
                    {
                        "kind": f.kind,
                        "steps": [f.first, f.last],
                        "ratio": round(f.ratio, 3),
                        "baseline_ms": round(f.baseline_ns / 1e6, 2),
                        "level_ms": round(f.level_ns / 1e6, 2),
                    }
                    for f in _l1_windows(d, steps)
                ],
                "groups": [
                    {
                        "comm": g.comm,
                        "ranks": sorted(g.members),
                        "ops": dict(g.ops),
                        "p2p": g.p2p_ops,
                        "identity": _comm_identity(d, g.comm),
                        "mode": d.modes.modes().get(g.comm),
                    }
                    for g in d.groups.by_comm.values()
                ],
            }
        )
    out["stats"] = vars(engine.stats)
    return out


def report_text(data: Dict[str, Any], steps: Optional[Tuple[int, int]] = None) -> str:
    lines: List[str] = []
    if not data["jobs"]:
        return "argus diagnose: no step summaries in the input"
    for j in data["jobs"]:
        rng = f"steps {steps[0]}–{steps[1]}" if steps else f"steps {j['steps'][0]}–{j['steps'][1]}"
        lines.append(
            f"argus diagnose — job {j['job']}: {len(j['ranks'])} ranks on {len(j['hosts'])} host(s), {rng}, "
            f"median step {j['median_step_ms']:.1f} ms ({j['judged']} steps judged; the first {j['warmup']} "
            "only teach the baselines)"
        )
        groups = ", ".join(
            f"{g['comm'][:8]} ({'/'.join(g['ops']) or 'Send/Recv'}: ranks {ranks_text(g['ranks'])}; "
            f"identity {g['identity']}{'; ' + g['mode'] if g.get('mode') else ''})"
            for g in j["groups"]
        )
        lines.append(f"communicators: {groups or 'none seen'}")
        al = j.get("alignment") or {}
        if al:
            by = ", ".join(f"{n} by {m}" for m, n in sorted(al["steps"].items())) or "none"
            lines.append(f"steps: numbered {al['numbering']}; ranks aligned: {by}")
            for r, why in sorted(al["unaligned"].items()):
                lines.append(f"  rank {r} not aligned: {why}")
            for note in al["notes"]:
                lines.append(f"  note: {note}")
            if al.get("restarted"):
                how = (
                    f"; {al['extrapolated']} placed by the job's step time (no rank ran through the gap)"
                    if al.get("extrapolated")
                    else ""
                )
                lines.append(
                    f"  {al['restarted']} rank(s) began their own step numbers again (agent restarted){how}"
                )
        if j.get("clocks"):
            lines.append(f"clocks: {_clocks_text(j['clocks'])}; taken out of arrival times")
        ga = j.get("gpu_arrival") or {}
        if ga and not ga.get("timers"):  # no timers: who reached the collectives last, and from what
            if ga.get("cannot_tell"):
                lines.append("which GPU arrives last cannot be told: " + ", ".join(ga["cannot_tell"]))
            elif ga.get("separating"):
                told = ", ".join(
                    f"{k} ({n} of {ga['steps']} recent steps)" for k, n in ga["separating"].items()
                )
                lines.append(f"which GPU arrives last (no timers; judged one step behind): from {told}")
        for r, a, b in j.get("gaps", []):
            span = f"job steps {a}–{b}, then resumed" if b is not None else f"any job step since {a}"
            lines.append(f"  gap: rank {r} sent no summary for {span} (lost, or its agent restarted)")
        lines.append("")
        alerts = j["alerts"]
        if not alerts:
            lines.append(
                "No finding: no rank was late or an outlier, no collective slowed, no host stalled, "
                "no hang, no unexplained step-time spike or regression."
            )
        for i, a in enumerate(alerts, 1):
            where = f" on {', '.join(a['hosts'])}" if a["hosts"] else ""
            lines.append(
                f"{i}. [{a['severity']}] {a['kind']} — ranks {ranks_text(a['ranks']) or '-'}{where}, "
                f"steps {a['steps'][0]}–{a['steps'][1]}, {a['state']}"
            )
            lines.append(f"   {a['summary']}.")
            ident = _identity_text(a.get("evidence") or {})
            if ident:
                lines.append(f"   identity: {ident}.")
            nxt = NEXT_STEP.get(a["kind"])
            if nxt:
                lines.append(f"   next: {nxt}.")
            lines.append(f"   id {a['id']}")
        if j["l1"]:
            lines.append("")
            lines.append("Iteration time (L1):")
            for f in j["l1"]:
                what = "spike" if f["kind"] == "step_spike" else "regression"
                why = [
                    str(i)
                    for i, a in enumerate(alerts, 1)
                    if a["kind"] not in ("step_spike", "step_regression")
                    and a["steps"][0] <= f["steps"][1] + 3
                    and a["steps"][1] >= f["steps"][0] - 3
                ]
                lines.append(
                    f"  {what} in steps {f['steps'][0]}–{f['steps'][1]}: {f['level_ms']:.1f} ms vs "
                    f"{f['baseline_ms']:.1f} ms ({f['ratio']:.2f}×)"
                    + (f" — explained by finding {', '.join(why)}" if why else "")
                )
        lines.append("")
    st = data["stats"]
    lines.append(
        f"({st['rank_steps']} summaries, {st['heartbeats']} heartbeats, {st['steps_judged']} steps judged, "
        f"{st['late_dropped']} late summaries dropped)"
    )
    return "\n".join(lines)
