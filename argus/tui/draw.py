"""Draw a JobSnapshot (pure: snapshot in, rich renderable out; tested on a string console)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from argus.plain import plain
from argus.tui.snapshot import JobSnapshot, RankRow, sort_rows

SPARK_CHARS = "▁▂▃▄▅▆▇█"
COLORS = {
    "data": "cyan",
    "forward": "green",
    "backward": "blue",
    "optimizer": "magenta",
    "comm": "yellow",
    "other": "white",
    "host": "green",
    "host_wait": "grey50",
}
STATE_STYLE = {"straggler": "bold red", "hung": "bold magenta", "stalled": "bold yellow", "gone": "dim"}


@dataclass(frozen=True)
class ViewOptions:
    sort: str = "late"  # late | step | rank
    host: Optional[str] = None  # only this host
    drill: Optional[int] = None  # rank shown in detail
    paused: bool = False
    max_rows: int = 30  # rank rows before grouping by host
    detail: Optional[dict] = None  # the drilled rank's last summary, prepared by the caller


def sparkline(values: Sequence[float], width: int = 24) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK_CHARS[min(7, int((v - lo) / span * 7.999))] for v in vals)


def phase_bar(buckets: Sequence[tuple], width: int = 18) -> Text:
    total = sum(ns for _, ns in buckets) or 1
    t = Text()
    used = 0
    for i, (name, ns) in enumerate(buckets):
        n = round(ns / total * width) if i < len(buckets) - 1 else width - used
        n = max(0, min(n, width - used))
        t.append("█" * n, style=COLORS.get(name, "white"))
        used += n
    return t


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def _header(s: JobSnapshot, o: ViewOptions) -> Text:
    t = Text()
    t.append("argus top", style="bold")
    t.append(f" — job {s.job} — ranks {s.ranks_seen}/{s.ranks_expected} — step {s.step}")
    if s.step_times:
        t.append(f" — step time {s.step_times[-1] * 1e3:.0f} ms ")
        t.append(sparkline(s.step_times), style="cyan")
    style = {"steady": "green", "spike": "yellow", "regression": "red"}.get(s.l1, "white")
    t.append(" — L1: ")
    t.append(s.l1, style=style)
    if o.paused:
        t.append("  [paused]", style="reverse")
    return t


def rank_table(rows: List[RankRow], title: str = "") -> Table:
    t = Table(title=title or None, title_justify="left", expand=False, pad_edge=False)
    gpu = any(r.gpu for r in rows)
    cols = [
        ("rank", "right"),
        ("host", "left"),
        ("step", "right"),
        ("step ms", "right"),
        ("phases", "left"),
        ("late ms", "right"),
        ("last %", "right"),
        ("gpu timers ms", "left"),
        ("top collective", "left"),
        ("launch/s", "right"),
        ("drops", "right"),
    ]
    cols += [("gpu", "left")] if gpu else []
    cols += [("alert", "left")]
    for col, just in cols:
        t.add_column(col, justify=just, no_wrap=True, max_width=60 if col == "alert" else None)  # type: ignore[arg-type]
    for r in rows:
        cells: List[RenderableType] = [
            str(r.rank),
            plain(r.host),  # the ranks' own names: never markup (argus/plain.py)
            str(r.step),
            _ms(r.step_ns),
            phase_bar(r.buckets),
            f"{r.late_ns / 1e6:+.1f}",
            f"{100 * r.last_share:.0f}",
            " ".join(f"{x:.0f}" for x in r.timers_ms) or "-",
            plain(r.top_coll),
            f"{r.launches_per_s:.0f}",
            str(r.drops),
        ]
        if gpu:
            cells.append(" ".join(r.gpu) if r.gpu else "-")
        cells.append(plain(r.alert))
        t.add_row(*cells, style=STATE_STYLE.get(r.state, ""))
    return t


def host_table(rows: List[RankRow], limit: int = 12) -> Table:
    by: Dict[str, List[RankRow]] = {}
    for r in rows:
        by.setdefault(r.host, []).append(r)
    t = Table(title="hosts (worst first)", title_justify="left", expand=False, pad_edge=False)
    for col in ("host", "ranks", "median step ms", "max late ms", "flagged"):
        t.add_column(col, justify="left" if col == "host" else "right", no_wrap=True)
    ordered = sorted(by.items(), key=lambda kv: -max(r.late_ns for r in kv[1]))
    for host, rs in ordered[:limit]:
        flagged = sum(1 for r in rs if r.state != "ok")
        t.add_row(
            plain(host),
            str(len(rs)),
            _ms(statistics.median(r.step_ns for r in rs)),
            f"{max(r.late_ns for r in rs) / 1e6:+.1f}",
            str(flagged),
            style="bold red" if flagged else "",
        )
    if len(ordered) > limit:
        t.add_row(f"… {len(ordered) - limit} more hosts", "", "", "", "")
    return t


def alerts_pane(alerts: Sequence[dict], limit: int = 6) -> RenderableType:
    if not alerts:
        return Text("no alerts firing", style="green")
    t = Table(title="alerts", title_justify="left", expand=False, pad_edge=False)
    for col in ("severity", "kind", "ranks", "steps", "summary"):
        t.add_column(col, no_wrap=col != "summary")
    for a in alerts[:limit]:
        ranks = a.get("ranks", [])
        rtxt = ",".join(str(r) for r in ranks[:6]) + ("…" if len(ranks) > 6 else "")
        st = a.get("steps") or ["", ""]
        t.add_row(
            a.get("severity", ""),
            a.get("kind", ""),
            rtxt,
            f"{st[0]}–{st[1]}",
            plain(a.get("summary", "")),
            style="bold red" if a.get("severity") == "critical" else "",
        )
    return t


def drill_pane(detail: dict) -> RenderableType:
    t = Table(
        title=f"rank {detail.get('rank')} — step {detail.get('step')}", title_justify="left", expand=False
    )
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    for k in ("phases", "collectives", "kernels", "errors"):
        if detail.get(k):
            t.add_row(k, plain(str(detail[k])))
    return t


def render(snap: JobSnapshot, opts: ViewOptions = ViewOptions()) -> RenderableType:
    rows = [r for r in snap.rows if opts.host is None or r.host == opts.host]
    ordered = sort_rows(tuple(rows), opts.sort)
    parts: List[RenderableType] = [_header(snap, opts)]
    if len(ordered) <= opts.max_rows:
        parts.append(rank_table(ordered))
    else:
        worst = ordered[: max(5, opts.max_rows - 14)]
        parts.append(rank_table(worst, title=f"worst {len(worst)} of {len(ordered)} ranks"))
        parts.append(host_table(ordered))
    parts.append(alerts_pane(snap.alerts))
    if opts.detail:
        parts.append(drill_pane(opts.detail))
    parts.append(
        Text(
            "keys: s sort (late/step/rank) · h host filter · p pause · d drill into the top rank · q quit",
            style="dim",
        )
    )
    return Group(*parts)
