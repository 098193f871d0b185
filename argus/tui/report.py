"""`argus report`: a picture of a job that makes the straggler obvious at a glance.

Two rank × step heatmaps (arrival lateness at collectives; step time), the phase breakdown per
rank, and the alert timeline — as a PNG (Pillow) or a self-contained HTML page (inline SVG).
The data model (`ReportData`) is built by a pure function from summaries and alerts.
"""

from __future__ import annotations

import html
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from argus.aggregator.align import JobAlign
from argus.aggregator.ranks import arrival_lateness
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
    step_end: Dict[int, int] = field(default_factory=dict)  # step -> its latest end (realtime ns)


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
        d.step_end[step] = max(rs.end_ns for rs in ranks.values())
        for r, rs in ranks.items():
            d.step_ms[(r, step)] = rs.duration_ns / 1e6
            d.hosts[r] = rs.host
            for b, ns in step_parts(rs).items():
                sums.setdefault(r, {}).setdefault(b, []).append(ns / 1e6)
    d.phases = {r: {b: statistics.fmean(v) for b, v in bs.items()} for r, bs in sums.items()}
    if d.signal:
        d.signal_title = "GPU compute time vs the median rank (%)"
    else:
        d.signal = d.late_ms
    return d


def step_parts(rs: RankStep) -> Dict[str, float]:
    """A step split for the bar: the host's wait on the GPU (and through it on its peers' collectives)
    as its own part; the rest split as the Python phases (sampled) say, else as the host's own work.
    The Python samples count the wait inside whatever function made it, so they are scaled to the
    time left."""
    wait = float(rs.phases.get("host_wait", 0))
    out = {k: float(v) for k, v in bucket_phases(rs.py_phases or rs.phases, rs.duration_ns).items()}
    out.pop("host_wait", None)
    busy = sum(out.values())
    left = max(0.0, rs.duration_ns - wait)
    if busy > 0:
        out = {k: v * left / busy for k, v in out.items()}
    out["waiting"] = wait
    return {k: v for k, v in out.items() if v > 0}


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


# ---- layout shared by the picture and the page ---------------------------------------------------

WIDTH = 1400
LEFT, RIGHT = 150, 40  # row labels; margin
PHASE_COLORS: Dict[str, Tuple[int, int, int]] = {
    "data": (0, 170, 200),
    "forward": (0, 160, 0),
    "backward": (40, 80, 220),
    "optimizer": (180, 0, 180),
    "comm": (220, 180, 0),
    "other": (150, 150, 150),
    "host": (0, 120, 120),
    "waiting": (235, 120, 60),
}
PHASE_LABELS = {"waiting": "waiting (on the GPU, its peers)", "host": "host (its own work)"}


@dataclass
class Span:
    """An alert drawn on the step axis: evidence from `start`, fired at `fired`, until `end`."""

    kind: str
    ranks: List[int]
    start: int
    fired: int
    end: int
    firing: bool
    summary: str


def alert_spans(d: ReportData) -> List[Span]:
    """Where each alert sits on the step axis. An alert record keeps its steps as they were when it
    fired; how long it fired comes from its times (first_seen, resolved_at) against the steps'."""
    if not d.steps:
        return []

    def step_at(t_ns: Optional[int]) -> int:
        if not t_ns:
            return d.steps[-1]
        for s in d.steps:
            if d.step_end.get(s, 0) >= t_ns:
                return s
        return d.steps[-1]

    out = []
    for a in d.alerts:
        st = a.get("steps") or [d.steps[0], d.steps[0]]
        fired = step_at(a.get("first_seen"))
        firing = a.get("state") != "resolved"
        end = d.steps[-1] if firing else step_at(a.get("resolved_at"))
        start = max(d.steps[0], min(int(st[0]), fired))
        out.append(
            Span(
                str(a.get("kind")),
                list(a.get("ranks") or []),
                start,
                fired,
                max(end, fired),
                firing,
                str(a.get("summary", "")),
            )
        )
    return sorted(out, key=lambda x: (x.fired, x.kind))


def caption(d: ReportData) -> List[Tuple[str, str]]:
    """The diagnosis in a few lines: (headline, summary) per alert — what fired, where, since when."""
    spans = alert_spans(d)
    if not spans:
        return [("No alert: no rank, link or phase stood out in these steps.", "")]
    out = []
    for sp in spans[:3]:
        who = (
            f"rank{'s' if len(sp.ranks) > 1 else ''} {', '.join(map(str, sp.ranks))}"
            if sp.ranks
            else "the job"
        )
        when = f"fired at step {sp.fired}, " + ("still firing" if sp.firing else f"resolved at step {sp.end}")
        out.append((f"{sp.kind} - {who} ({when})", sp.summary))
    if len(spans) > 3:
        out.append((f"... and {len(spans) - 3} more alert(s)", ""))
    return out


def row_labels(bins: List[List[int]], flagged: Dict[int, str], row_h: int) -> List[Tuple[int, str, bool]]:
    """(row, label, names an alerted rank) for the rows that get a label: every row when rows are
    tall enough, else every k-th — and always the alerted ranks' rows."""
    every = max(1, -(-12 // row_h))
    out = []
    for i, b in enumerate(bins):
        hit = next((flagged[r] for r in b if r in flagged), None)
        if hit is None and i % every:
            continue
        label = f"rank {b[0]}" if len(b) == 1 else f"{b[0]}-{b[-1]}"
        out.append((i, f"{hit} > {label}" if hit else label, hit is not None))
    return out


def step_x(d: ReportData, step: int, width: float) -> float:
    """Left edge of a step's column, `width` the plot's width."""
    n = max(1, len(d.steps))
    i = d.steps.index(step) if step in d.steps else (0 if not d.steps or step < d.steps[0] else n - 1)
    return LEFT + i * width / n


def ticks(lo: int, hi: int, n: int = 10) -> List[int]:
    """Round step numbers for the axis, about `n` of them."""
    span = max(1, hi - lo)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = -(-lo // step) * step
    return list(range(first, hi + 1, step))


def _font(size: int, bold: bool = False) -> Any:  # a PIL font (Pillow is imported lazily)
    from PIL import ImageFont

    for path in (
        f"/usr/share/fonts/truetype/dejavu/DejaVuSans{'-Bold' if bold else ''}.ttf",
        f"/usr/share/fonts/truetype/dejavu/DejaVuSansMono{'-Bold' if bold else ''}.ttf",
    ):
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _wrap(text: str, width: int) -> List[str]:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return lines + ([cur] if cur else [])


def png(d: ReportData, path: str) -> None:
    """Panels stacked on one step axis: the straggler signal, step time, alerts over the steps they
    fired, then the mean phases per rank with waiting as its own part."""
    from PIL import Image, ImageDraw

    f_title, f_text, f_small, f_bold = _font(22, True), _font(15), _font(12), _font(13, True)
    bins, signal = _grid(d, d.signal)
    _, stept = _grid(d, d.step_ms)
    spans = alert_spans(d)
    flagged = {r: sp.kind for sp in reversed(spans) for r in sp.ranks}
    pw = WIDTH - LEFT - RIGHT
    n = max(1, len(d.steps))
    row_h = max(3, min(22, 360 // max(1, len(bins))))
    hm_h = row_h * len(bins)
    cap: List[Tuple[bool, str]] = []  # (a headline, the line)
    for head, text in caption(d):
        cap.append((True, head))
        cap += [(False, ln) for ln in _wrap(text, 160)]
    height = 70 + 20 * len(cap) + 2 * (hm_h + 80) + 40 + 24 * max(1, len(spans)) + 50 + hm_h + 90
    img = Image.new("RGB", (WIDTH, height), "white")
    dr = ImageDraw.Draw(img)

    def x_of(step: int) -> float:
        return step_x(d, step, pw)

    first, last = (d.steps[0], d.steps[-1]) if d.steps else (0, 0)
    dr.text((20, 14), f"argus report - job {d.job}", fill="black", font=f_title)
    dr.text(
        (20, 44),
        f"steps {first}-{last}, {len(d.ranks)} ranks"
        + (f" ({len(d.ranks) // len(bins)} per row)" if len(bins) < len(d.ranks) else ""),
        fill=(90, 90, 90),
        font=f_text,
    )
    y = 70
    for is_head, ln in cap:
        colour = (170, 0, 0) if is_head and spans else "black"
        dr.text((20, y), ln, fill=colour, font=f_bold if is_head else f_text)
        y += 20
    y += 10

    def labels(y0: int) -> None:
        for i, label, hit in row_labels(bins, flagged, row_h):
            ty = y0 + i * row_h + row_h / 2 - 7
            font, colour = (f_bold, (190, 0, 0)) if hit else (f_small, "black")
            dr.text((LEFT - 8, ty), label, fill=colour, font=font, anchor="ra")

    def axis(y0: int) -> None:
        dr.line([LEFT, y0, LEFT + pw, y0], fill="black")
        for t in ticks(first, last):
            if t in d.steps:
                x = x_of(t) + pw / n / 2
                dr.line([x, y0, x, y0 + 4], fill="black")
                dr.text((x, y0 + 6), str(t), fill="black", font=f_small, anchor="ma")
        dr.text((LEFT + pw, y0 + 20), "step", fill=(90, 90, 90), font=f_small, anchor="ra")

    def markers(y0: int, h: int) -> None:
        for sp in spans:  # where each alert fired: a dashed line through the panel
            x = x_of(sp.fired)
            for yy in range(y0, y0 + h, 8):
                dr.line([x, yy, x, min(y0 + h, yy + 4)], fill=(0, 0, 0), width=2)

    for title, rows, zero, unit in (
        (d.signal_title, signal, True, "%" if "%" in d.signal_title else "ms"),
        ("step time (ms)", stept, False, "ms"),
    ):
        lo, hi = _range(rows, zero)
        dr.text((LEFT, y), title, fill="black", font=f_bold)
        # colour scale
        sx = LEFT + pw - 260
        for k in range(200):
            dr.line([sx + k, y + 2, sx + k, y + 14], fill=_color(lo + (hi - lo) * k / 199, lo, hi))
        dr.text((sx - 6, y), f"{round(lo)} {unit}", fill="black", font=f_small, anchor="ra")
        dr.text((sx + 206, y), f"{round(hi)} {unit}", fill="black", font=f_small)
        y0 = y + 22
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                x = LEFT + j * pw / n
                dr.rectangle(
                    [x, y0 + i * row_h, x + pw / n, y0 + (i + 1) * row_h - 1], fill=_color(v, lo, hi)
                )
        for i, b in enumerate(bins):
            if any(r in flagged for r in b):
                dr.rectangle(
                    [LEFT - 2, y0 + i * row_h - 1, LEFT + pw + 1, y0 + (i + 1) * row_h],
                    outline=(190, 0, 0),
                    width=2,
                )
        markers(y0, hm_h)
        labels(y0)
        axis(y0 + hm_h + 2)
        y = y0 + hm_h + 58

    # alerts on the same axis: evidence (light), firing (red) or resolved (grey)
    dr.text(
        (LEFT, y),
        "alerts (light: evidence before it fired; red: firing; grey: resolved)",
        fill="black",
        font=f_bold,
    )
    y += 24
    if not spans:
        dr.text((LEFT, y), "none", fill=(90, 90, 90), font=f_text)
        y += 24
    for sp in spans:
        xa, xf, xb = x_of(sp.start), x_of(sp.fired), x_of(sp.end) + pw / n
        dr.rectangle([xa, y, max(xa, xf), y + 14], fill=(250, 200, 200))
        dr.rectangle([xf, y, xb, y + 14], fill=(200, 30, 30) if sp.firing else (160, 160, 160))
        who = ",".join(map(str, sp.ranks)) if sp.ranks else "job"
        dr.text((LEFT - 8, y), f"{sp.kind} [{who}]", fill="black", font=f_small, anchor="ra")
        label = f"fired at step {sp.fired}" + ("" if sp.firing else f", resolved at {sp.end}")
        if xb - xf > dr.textlength(label, font=f_small) + 12:
            dr.text((xf + 6, y + 1), label, fill="white", font=f_small)
        else:
            dr.text((min(xb + 6, LEFT + pw - 160), y + 1), label, fill="black", font=f_small)
        y += 24
    axis(y)
    y += 50

    # mean phases per step, per rank
    dr.text((LEFT, y), "mean time per step (ms)", fill="black", font=f_bold)
    y0 = y + 22
    longest = max((sum(p.values()) for p in d.phases.values()), default=1.0) or 1.0
    for i, b in enumerate(bins):
        x = float(LEFT)
        for name, ms in d.phases.get(b[0], {}).items():
            w = pw * ms / longest
            dr.rectangle(
                [x, y0 + i * row_h, x + w, y0 + (i + 1) * row_h - 2], fill=PHASE_COLORS.get(name, (0, 0, 0))
            )
            x += w
    labels(y0)
    ly = y0 + hm_h + 8
    x = float(LEFT)
    used = [k for k in PHASE_COLORS if any(k in p for p in d.phases.values())]
    for name in used:
        dr.rectangle([x, ly + 2, x + 12, ly + 14], fill=PHASE_COLORS[name])
        label = PHASE_LABELS.get(name, name)
        dr.text((x + 16, ly), label, fill="black", font=f_small)
        x += 16 + dr.textlength(label, font=f_small) + 18
    dr.text((LEFT + pw, ly), f"bar = {longest:.0f} ms", fill=(90, 90, 90), font=f_small, anchor="ra")
    img = img.crop((0, 0, WIDTH, min(height, ly + 40)))
    img.save(path)


def html_page(d: ReportData) -> str:
    """The same panels as the picture, as one self-contained page (inline SVG, no network); each
    cell's tooltip gives its rank, step and value."""
    bins, signal = _grid(d, d.signal)
    _, stept = _grid(d, d.step_ms)
    spans = alert_spans(d)
    flagged = {r: sp.kind for sp in reversed(spans) for r in sp.ranks}
    pw = WIDTH - LEFT - RIGHT
    n = max(1, len(d.steps))
    cw = pw / n
    row_h = max(3, min(22, 360 // max(1, len(bins))))
    hm_h = row_h * len(bins)
    first, last = (d.steps[0], d.steps[-1]) if d.steps else (0, 0)
    esc = html.escape

    def x_of(step: int) -> float:
        return step_x(d, step, pw)

    def labels() -> str:
        out = []
        for i, label, hit in row_labels(bins, flagged, row_h):
            style = ' fill="#b00" font-weight="bold"' if hit else ""
            out.append(
                f'<text x="{LEFT - 8}" y="{i * row_h + row_h / 2 + 4:.1f}" text-anchor="end" '
                f'font-size="12"{style}>{esc(label)}</text>'
            )
        return "".join(out)

    def axis(y: float) -> str:
        out = [f'<line x1="{LEFT}" y1="{y}" x2="{LEFT + pw}" y2="{y}" stroke="black"/>']
        for t in ticks(first, last):
            if t in d.steps:
                x = x_of(t) + cw / 2
                out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="black"/>')
                out.append(f'<text x="{x:.1f}" y="{y + 17}" text-anchor="middle" font-size="12">{t}</text>')
        out.append(
            f'<text x="{LEFT + pw}" y="{y + 32}" text-anchor="end" font-size="11" fill="#555">step</text>'
        )
        return "".join(out)

    def heatmap(rows: List[List[float]], title: str, zero: bool, unit: str) -> str:
        lo, hi = _range(rows, zero)
        cells = []
        for i, row in enumerate(rows):
            who = f"rank {bins[i][0]}" if len(bins[i]) == 1 else f"ranks {bins[i][0]}-{bins[i][-1]}"
            for j, v in enumerate(row):
                r, g, bl = _color(v, lo, hi)
                cells.append(
                    f'<rect x="{LEFT + j * cw:.2f}" y="{i * row_h}" width="{cw + 0.3:.2f}" height="{row_h}" '
                    f'fill="rgb({r},{g},{bl})"><title>{esc(who)}, step {d.steps[j]}: {v:.1f} {unit}'
                    "</title></rect>"
                )
        for i, b in enumerate(bins):
            if any(r in flagged for r in b):
                cells.append(
                    f'<rect x="{LEFT - 2}" y="{i * row_h - 1}" width="{pw + 3}" height="{row_h + 1}" '
                    'fill="none" stroke="#b00" stroke-width="2"/>'
                )
        for sp in spans:
            x = x_of(sp.fired)
            cells.append(
                f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{hm_h}" stroke="black" stroke-width="2" '
                f'stroke-dasharray="4 4"><title>{esc(sp.kind)} fired at step {sp.fired}</title></line>'
            )
        scale = f"<span class='scale'>{round(lo)} {unit} <span class='bar'></span> {round(hi)} {unit}</span>"
        return (
            f"<h3>{esc(title)} {scale}</h3><svg width='{WIDTH}' height='{hm_h + 40}'>"
            f"{labels()}{''.join(cells)}{axis(hm_h + 2)}</svg>"
        )

    unit = "%" if "%" in d.signal_title else "ms"
    caps = "".join(f"<p class='head'>{esc(h)}</p>" + (f"<p>{esc(t)}</p>" if t else "") for h, t in caption(d))
    bars = []
    y = 0
    for sp in spans:
        xa, xf, xb = x_of(sp.start), x_of(sp.fired), x_of(sp.end) + cw
        who = ",".join(map(str, sp.ranks)) if sp.ranks else "job"
        state = "still firing" if sp.firing else f"resolved at step {sp.end}"
        bars.append(
            f'<text x="{LEFT - 8}" y="{y + 12}" text-anchor="end" font-size="12">'
            f"{esc(sp.kind)} [{who}]</text>"
            f'<rect x="{xa:.1f}" y="{y}" width="{max(0.0, xf - xa):.1f}" height="14" fill="#fac8c8"/>'
            f'<rect x="{xf:.1f}" y="{y}" width="{max(1.0, xb - xf):.1f}" height="14" '
            f'fill="{"#c81e1e" if sp.firing else "#a0a0a0"}"><title>{esc(sp.summary)}</title></rect>'
            f'<text x="{xf + 6:.1f}" y="{y + 12}" font-size="11" fill="white">fired at step {sp.fired}, '
            f"{state}</text>"
        )
        y += 24
    timeline = (
        f"<svg width='{WIDTH}' height='{y + 40}'>{''.join(bars)}{axis(y + 2)}</svg>"
        if spans
        else "<p>none</p>"
    )
    longest = max((sum(p.values()) for p in d.phases.values()), default=1.0) or 1.0
    pbars = []
    for i, b in enumerate(bins):
        x = float(LEFT)
        for name, ms in d.phases.get(b[0], {}).items():
            w = pw * ms / longest
            c = PHASE_COLORS.get(name, (0, 0, 0))
            pbars.append(
                f'<rect x="{x:.1f}" y="{i * row_h}" width="{w:.1f}" height="{row_h - 1}" fill="rgb{c}">'
                f"<title>rank {b[0]}: {esc(PHASE_LABELS.get(name, name))} {ms:.1f} ms</title></rect>"
            )
            x += w
    used = [k for k in PHASE_COLORS if any(k in p for p in d.phases.values())]
    legend = " ".join(
        f"<span class='key' style='background:rgb{PHASE_COLORS[k]}'></span>{esc(PHASE_LABELS.get(k, k))}"
        for k in used
    )
    table = "".join(
        f"<tr><td>{r}</td><td>{esc(d.hosts.get(r, ''))}</td>"
        + "".join(f"<td>{esc(k)} {v:.1f}</td>" for k, v in d.phases.get(r, {}).items())
        + "</tr>"
        for r in d.ranks[:MAX_ROWS]
    )
    style = (
        "body{font-family:sans-serif;margin:20px;color:#111}h2{margin:0}h3{font-size:14px;margin:18px 0 4px "
        f"{LEFT}px}}p{{margin:2px 0}}p.head{{color:#a00;font-weight:bold;margin-top:8px}}.sub{{color:#555}}"
        ".scale{font-weight:normal;font-size:12px;margin-left:20px}.bar{display:inline-block;width:200px;"
        "height:10px;background:linear-gradient(to right,#ffffff,#ffff00,#ff0000)}.key{display:inline-block;"
        "width:12px;height:12px;margin:0 4px 0 14px;vertical-align:middle}details{margin-top:16px}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>argus report {esc(d.job)}</title>"
        f"<style>{style}</style></head><body>"
        f"<h2>argus report - job {esc(d.job)}</h2>"
        f"<p class='sub'>steps {first}-{last}, {len(d.ranks)} ranks</p>"
        f"<div id='caption'>{caps}</div>"
        f"{heatmap(signal, d.signal_title, True, unit)}{heatmap(stept, 'step time (ms)', False, 'ms')}"
        "<h3>alerts (light: evidence before it fired; red: firing; grey: resolved)</h3>"
        f"{timeline}<h3>mean time per step (ms), bar = {longest:.0f} ms</h3>"
        f"<svg width='{WIDTH}' height='{hm_h + 4}'>{labels()}{''.join(pbars)}</svg>"
        f"<p style='margin-left:{LEFT}px'>{legend}</p>"
        "<details><summary>mean time per step, per rank (ms)</summary>"
        f"<table border=1>{table}</table></details>"
        "</body></html>"
    )
