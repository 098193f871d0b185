"""The live per-rank summary of `argus probe` (pure: views of RankSteps in, a rich renderable out)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from argus.plain import plain
from argus.schema import RankStep, error_channel


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def fmt_ns(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.1f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.0f} µs"
    return f"{ns:.0f} ns"


@dataclass
class RankView:
    """What the table shows about one probed process, updated with each step summary."""

    pid: int
    rank: int
    host: str
    steps: int = 0
    last: Optional[RankStep] = None
    launched: Optional[RankStep] = None  # the latest step whose launches were probed
    durations: Deque[int] = field(default_factory=lambda: deque(maxlen=20))
    waits: Deque[int] = field(default_factory=lambda: deque(maxlen=20))
    exited: bool = False

    def update(self, rs: RankStep) -> None:
        if rs.step is None:  # a tail record after exit: not a step
            return
        self.steps += 1
        self.last = rs
        if rs.launches_sampled:  # --launch-steps: the latest sampled step
            self.launched = rs
        self.durations.append(rs.duration_ns)
        self.waits.append(rs.sync_wait_ns)


def _top_collective(rs: RankStep) -> str:
    ops = rs.detail.nccl.ops if rs.detail is not None else {}
    if not ops:
        return "-"
    op, o = max(ops.items(), key=lambda kv: kv[1].nbytes)
    return f"{op} ×{o.count} {fmt_bytes(o.nbytes)}"


def _top_kernels(rs: RankStep, n: int = 2) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in list(rs.kernels.items())[:n]) or "-"


def _errors(rs: RankStep) -> str:
    # the driver's and NCCL's: what `--json` prints in its `cuda` and `nccl` sections
    parts = [
        f"{call}={code}×{c}"
        for call, codes in rs.errors.items()
        if error_channel(call) != "cudart"
        for code, c in codes.items()
    ]
    return ", ".join(parts[:2]) + ("…" if len(parts) > 2 else "") if parts else "-"


def render(
    views: List[RankView],
    drops: Dict[str, int],
    header: str,
    slow_probes: int = 0,
    footer: Sequence[str] = (),
) -> Group:
    t = Table(title=header, title_justify="left", expand=False)
    for col in (
        "rank",
        "pid",
        "host",
        "step",
        "step time",
        "host wait",
        "launches",
        "top collective (bytes)",
        "top kernels",
        "errors",
    ):
        t.add_column(
            col,
            justify="right"
            if col in ("rank", "pid", "step", "step time", "host wait", "launches")
            else "left",
            no_wrap=True,
        )
    for v in sorted(views, key=lambda v: (v.rank, v.pid)):
        s = v.last
        rank = str(v.rank) if v.rank >= 0 else "?"
        if s is None:
            state = "exited" if v.exited else "waiting for the first step…"
            t.add_row(rank, str(v.pid), plain(v.host), "-", state, "", "", "", "", "")
            continue
        med = statistics.median(v.durations)
        wait = statistics.median(v.waits)
        style = "dim" if v.exited else ""
        t.add_row(
            rank,
            str(v.pid),
            plain(v.host),  # the target's own names: never markup (argus/plain.py)
            str(s.step),
            fmt_ns(med),
            f"{fmt_ns(wait)} ({100 * wait / med:.0f}%)" if med else fmt_ns(wait),
            str(v.launched.launches) if v.launched else "-",
            _top_collective(s),
            plain(_top_kernels(v.launched)) if v.launched else "-",
            _errors(s),
            style=style,
        )
    notes: List[Text] = []
    if drops:
        notes.append(
            Text(
                f"dropped: {', '.join(f'{k} {v}' for k, v in drops.items())} — raise --ringbuf-pages "
                "or shorten --interval",
                style="yellow",
            )
        )
    if slow_probes:
        notes.append(
            Text(f"{slow_probes} probe(s) single-stepped (slow); see the startup warnings", style="yellow")
        )
    for line in footer:
        notes.append(Text(line, style="yellow" if "DISCONNECTED" in line else ""))
    notes.append(
        Text(
            "step time and host wait: median of the last 20 steps; collective bytes per step. "
            "Host time of an NCCL call is enqueue, not transfer.",
            style="dim",
        )
    )
    return Group(t, *notes)
