"""`argus report`: a picture of a job that makes the straggler obvious at a glance.

Two rank × step heatmaps (arrival lateness at collectives; step time), the phase breakdown per
rank, and the alert timeline — as a PNG (Pillow) or a self-contained HTML page (inline SVG).
The data model (`ReportData`) is built by a pure function from summaries and alerts.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from argus.aggregator.align import JobAlign
from argus.aggregator.l2 import arrival_lateness
from argus.aggregator.state import Groups
from argus.schema import RankStep
from argus.tui.snapshot import bucket_phases

MAX_ROWS = 256  # more ranks are binned (max per bin) so the picture stays readable


@dataclass
class ReportData:
    job: str
    ranks: List[int]
    steps: List[int]
    late_ms: Dict[Tuple[int, int], float] = field(default_factory=dict)  # (rank, step) -> ms
    # the straggler signal drawn first: GPU compute time vs the step's median rank (%), from the
    # process's own timers; arrival lateness (ms) when no compute timer is known
    signal: Dict[Tuple[int, int], float] = field(default_factory=dict)
    signal_title: str = "arrival lateness (ms vs median)"
    step_ms: Dict[Tuple[int, int], float] = field(default_factory=dict)
    phases: Dict[int, Dict[str, float]] = field(default_factory=dict)  # rank -> bucket -> mean ms
    hosts: Dict[int, str] = field(default_factory=dict)
    alerts: List[dict] = field(default_factory=list)


def build(
    job: str,
    summaries: Iterable[RankStep],
    alerts: Sequence[dict] = (),
    steps: Optional[Tuple[int, int]] = None,
) -> ReportData:
    by_step: Dict[int, Dict[int, RankStep]] = {}
    groups = Groups(min_group=2)
    align = JobAlign()  # ranks attached at other times onto the job's steps (as the aggregator)
    mine = sorted((rs for rs in summaries if rs.job == job and rs.step is not None), key=lambda rs: rs.end_ns)
    for rs in [x for m in mine for x in align.add(m)] + align.flush():
        if rs.step is None:
            continue
        if steps and not steps[0] <= rs.step <= steps[1]:
            continue
        by_step.setdefault(rs.step, {})[rs.rank] = rs
        groups.observe(rs)
    d = ReportData(
        job,
        sorted({r for s in by_step.values() for r in s}),
        sorted(by_step),
        alerts=[a for a in alerts if a.get("job") == job],
    )
    sums: Dict[int, Dict[str, List[float]]] = {}
    for step, ranks in by_step.items():
        for r, (late, _n, _last, _peak) in arrival_lateness(ranks, groups).items():
            d.late_ms[(r, step)] = late / 1e6
        compute = {r: compute_ns(rs) for r, rs in ranks.items()}
        known = sorted(v for v in compute.values() if v > 0)
        if known:
            med = known[len(known) // 2]
            for r, v in compute.items():
                d.signal[(r, step)] = 100.0 * (v / med - 1.0) if v > 0 and med > 0 else 0.0
        for r, rs in ranks.items():
            d.step_ms[(r, step)] = rs.duration_ns / 1e6
            d.hosts[r] = rs.host
            for b, ns in bucket_phases(rs.py_phases or rs.phases, rs.duration_ns).items():
                sums.setdefault(r, {}).setdefault(b, []).append(ns / 1e6)
    d.phases = {r: {b: statistics.fmean(v) for b, v in bs.items()} for r, bs in sums.items()}
    if d.signal:
        d.signal_title = "GPU compute time vs the median rank (%)"
    else:
        d.signal = d.late_ms
    return d


def compute_ns(rs: RankStep) -> int:
    """GPU compute time the process measured: named compute phases, else its timers on the main stream."""
    named = [v for k, v in rs.phases.items() if any(w in k.lower() for w in ("forward", "backward", "optim"))]
    if named:
        return sum(named)
    if not rs.phase_stream:
        return 0
    return sum(v for k, v in rs.phases.items() if k.startswith("timer") and rs.phase_stream.get(k, 1) == 0)


def _bins(ranks: List[int]) -> List[List[int]]:
    if len(ranks) <= MAX_ROWS:
        return [[r] for r in ranks]
    k = -(-len(ranks) // MAX_ROWS)
    return [ranks[i : i + k] for i in range(0, len(ranks), k)]


def _color(v: float, lo: float, hi: float) -> Tuple[int, int, int]:
    """White (lo) -> yellow -> red (hi)."""
    t = 0.0 if hi <= lo else max(0.0, min(1.0, (v - lo) / (hi - lo)))
    if t < 0.5:
        return (255, 255, int(255 * (1 - 2 * t)))
    return (255, int(255 * (2 - 2 * t)), 0)


def _grid(d: ReportData, values: Dict[Tuple[int, int], float]) -> Tuple[List[List[int]], List[List[float]]]:
    bins = _bins(d.ranks)
    rows = []
    for b in bins:
        rows.append([max((values.get((r, s), 0.0) for r in b), default=0.0) for s in d.steps])
    return bins, rows


def _range(rows: List[List[float]], from_zero: bool) -> Tuple[float, float]:
    """Colour scale: lateness from 0 (on time) up; step time over its own spread, so a flat job is
    uniformly pale and a spike stands out."""
    flat = sorted(v for row in rows for v in row)
    if not flat:
        return 0.0, 1.0
    lo = min(0.0, flat[0]) if from_zero else flat[0]
    hi = flat[-1]
    if hi - lo < max(1.0, 0.02 * abs(hi)):  # no visible variation: keep it pale
        hi = lo + max(1.0, 0.02 * abs(hi)) * 10
    return lo, hi


def png(d: ReportData, path: str) -> None:
    from PIL import Image, ImageDraw

    cell_w = max(3, min(12, 900 // max(1, len(d.steps))))
    cell_h = max(2, min(14, 600 // max(1, len(_bins(d.ranks)))))
    left, top, gap = 90, 40, 60
    bins, late = _grid(d, d.signal)
    _, stept = _grid(d, d.step_ms)
    hm_w, hm_h = cell_w * len(d.steps), cell_h * len(bins)
    bar_w = 360
    width = left + 2 * hm_w + gap + bar_w + 60
    height = top + max(hm_h, 14 * len(bins)) + 60 + 22 * max(1, len(d.alerts)) + 40
    img = Image.new("RGB", (width, height), "white")
    dr = ImageDraw.Draw(img)
    dr.text(
        (10, 8),
        f"argus report - job {d.job} - steps {d.steps[0] if d.steps else '-'}-"
        f"{d.steps[-1] if d.steps else '-'} - {len(d.ranks)} ranks (red: late / slow)",
        fill="black",
    )
    for title, rows, x0, zero in (
        (d.signal_title, late, left, True),
        ("step time (ms)", stept, left + hm_w + gap // 2, False),
    ):
        lo, hi = _range(rows, zero)
        dr.text((x0, top - 14), f"{title}  [{lo:.0f} .. {hi:.0f}]", fill="black")
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                x, y = x0 + j * cell_w, top + i * cell_h
                dr.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=_color(v, lo, hi))
    for i, b in enumerate(bins):
        if cell_h >= 9 or i % max(1, 10 // cell_h) == 0:
            label = f"rank {b[0]}" if len(b) == 1 else f"{b[0]}-{b[-1]}"
            dr.text((8, top + i * cell_h), label, fill="black")
    # phase bars per rank
    x0 = left + 2 * hm_w + gap
    dr.text((x0, top - 14), "mean phases per step (ms)", fill="black")
    colors = {
        "data": (0, 170, 200),
        "forward": (0, 160, 0),
        "backward": (40, 80, 220),
        "optimizer": (180, 0, 180),
        "comm": (220, 180, 0),
        "other": (150, 150, 150),
        "host": (0, 120, 120),
        "host_wait": (190, 190, 190),
    }
    longest = max((sum(p.values()) for p in d.phases.values()), default=1.0) or 1.0
    for i, b in enumerate(bins):
        r = b[0]
        x = x0
        for name, ms in d.phases.get(r, {}).items():
            w = int(bar_w * ms / longest)
            dr.rectangle(
                [x, top + i * cell_h, x + w, top + i * cell_h + cell_h - 1], fill=colors.get(name, (0, 0, 0))
            )
            x += w
    legend_y = top + hm_h + 10
    x = x0
    for name, c in colors.items():
        dr.rectangle([x, legend_y, x + 10, legend_y + 10], fill=c)
        dr.text((x + 13, legend_y), name, fill="black")
        x += 13 + 7 * len(name) + 8
    # alert timeline
    y = top + max(hm_h, 14) + 40
    dr.text((10, y), "alerts", fill="black")
    for a in d.alerts:
        y += 20
        st = a.get("steps") or [0, 0]
        if d.steps:
            xa = left + max(0, d.steps.index(st[0]) if st[0] in d.steps else 0) * cell_w
            xb = left + (d.steps.index(st[1]) if st[1] in d.steps else len(d.steps) - 1) * cell_w + cell_w
            dr.rectangle(
                [xa, y, xb, y + 12], fill=(220, 40, 40) if a.get("state") != "resolved" else (160, 160, 160)
            )
        dr.text(
            (left + hm_w + 20, y),
            f"{a.get('kind')} ranks {a.get('ranks')}: {a.get('summary', '')}"[:110],
            fill="black",
        )
    img.save(path)


def html_page(d: ReportData) -> str:
    bins, late = _grid(d, d.signal)
    _, stept = _grid(d, d.step_ms)
    cw, ch = max(3, min(12, 900 // max(1, len(d.steps)))), max(2, min(14, 600 // max(1, len(bins))))

    def svg(rows: List[List[float]], title: str, zero: bool) -> str:
        lo, hi = _range(rows, zero)
        cells = []
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                r, g, b = _color(v, lo, hi)
                label = html.escape(
                    f"{'rank ' + str(bins[i][0]) if len(bins[i]) == 1 else bins[i]} step "
                    f"{d.steps[j]}: {v:.1f} ms"
                )
                cells.append(
                    f'<rect x="{60 + j * cw}" y="{i * ch}" width="{cw}" height="{ch}" '
                    f'fill="rgb({r},{g},{b})"><title>{label}</title></rect>'
                )
        labels = "".join(
            f'<text x="0" y="{i * ch + ch - 1}" font-size="{min(ch, 11)}">{bins[i][0]}</text>'
            for i in range(len(bins))
            if ch >= 8
        )
        return (
            f"<h3>{html.escape(title)} [{lo:.0f} … {hi:.0f} ms]</h3><svg width='{60 + cw * len(d.steps)}' "
            f"height='{ch * len(bins)}'>{labels}{''.join(cells)}</svg>"
        )

    alerts = (
        "".join(
            f"<li><b>{html.escape(str(a.get('kind')))}</b> ranks {html.escape(str(a.get('ranks')))} "
            f"steps {html.escape(str(a.get('steps')))}: {html.escape(str(a.get('summary', '')))}</li>"
            for a in d.alerts
        )
        or "<li>none</li>"
    )
    rows = "".join(
        f"<tr><td>{r}</td><td>{html.escape(d.hosts.get(r, ''))}</td>"
        + "".join(f"<td>{v:.1f}</td>" for v in d.phases.get(r, {}).values())
        + "</tr>"
        for r in d.ranks[:MAX_ROWS]
    )
    return (
        f"<!doctype html><meta charset='utf-8'><title>argus report {html.escape(d.job)}</title>"
        f"<h2>argus report — job {html.escape(d.job)} — {len(d.ranks)} ranks, {len(d.steps)} steps</h2>"
        f"{svg(late, d.signal_title, True)}{svg(stept, 'step time', False)}"
        f"<h3>alerts</h3><ul>{alerts}</ul><h3>mean phases per step (ms)</h3><table border=1>{rows}</table>"
    )
