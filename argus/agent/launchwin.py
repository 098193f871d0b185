"""When kernel launches are probed: in windows of whole steps (pure; argus/agent/attach.py attaches).

A launch is the one call a job makes hundreds to thousands of times a step, and its uprobe trap
is most of what probing costs (docs/benchmarks.md 8.1). So by default the launch probes are
attached for `on` whole steps of every rank, then detached for as long again times
(period - on) / on: they are attached about on/period of the time. A step's launch counts are
exact when the whole step lies inside a window; the other steps say their launches were not
sampled. Windows are sized in steps (the typical step time of the latest steps), not seconds, so a
job with 10 s steps still gets whole steps.

A launch-bound job keeps the window open: where a rank's launches waited for a full launch queue
for `BOUND_SHARE` of its step (their returns are probed in the windows: BpfOptions.launch_wait),
its host's time follows its GPU, and that wait must be counted at every step, or its host time
would read as its own (a CPU-bound host) whenever the window is shut. Its probes cost it nothing:
they run while the host would wait for a queue slot anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

from argus.schema import RankStep, probe_span

ATTACH, DETACH = "attach", "detach"
MAX_OPEN_NS = 60_000_000_000  # a window open this long closes, steps or not
BOUND_SHARE = 0.1  # a step whose launches waited this share of it for a full queue: launch-bound
# held open while a launch-bound step ended this recently (steps are reported a drain or two, of 1 s
# by default, after they end), or (on + 2) steps of the typical length if longer
HOLD_NS = 3_000_000_000


def parse(text: str) -> Optional[Tuple[int, int]]:
    """`N/M` -> (N, M): launches probed for N steps of every M; `all` -> None (always). ValueError
    with the reason on anything else."""
    t = text.strip().lower()
    if t in ("all", "always"):
        return None
    m = re.fullmatch(r"(\d+)\s*/\s*(\d+)", t)
    if not m:
        raise ValueError(f"'{text}' is not N/M (e.g. 3/30) or 'all'")
    on, period = int(m.group(1)), int(m.group(2))
    if on < 1 or period < on:
        raise ValueError(f"'{text}': need 1 <= N <= M")
    return None if on == period else (on, period)


@dataclass
class LaunchWindows:
    on: int  # whole steps per window, for every rank
    period: int  # the window repeats every `period` steps' worth of time
    max_open_ns: int = MAX_OPEN_NS
    opened_ns: Optional[int] = None  # the current window: launch probes attached since
    next_open_ns: int = 0  # closed: open again at this time
    windows: List[Tuple[int, int]] = field(default_factory=list)  # closed windows (attached, detached)
    recent: List[int] = field(default_factory=list)  # durations of the latest steps (ns)
    typical_ns: int = 0  # their median; 0 until a step was seen
    bound_end_ns: int = 0  # the end of the latest launch-bound step reported (monotonic ns)
    held: bool = False  # the open window was held open for a launch-bound job

    def is_open(self) -> bool:
        return self.opened_ns is not None

    def sampled(self, start_ns: int, end_ns: int) -> bool:
        """Whether the probes were attached for the whole of [start_ns, end_ns]."""
        if self.opened_ns is not None and start_ns >= self.opened_ns:
            return True
        return any(a <= start_ns and end_ns <= d for a, d in self.windows)

    def observe(self, durations: Iterable[int]) -> None:
        """Durations (ns) of steps just reported: the typical step time (their median)."""
        n = len(self.recent)
        self.recent.extend(durations)
        if len(self.recent) != n:
            del self.recent[:-32]
            self.typical_ns = sorted(self.recent)[len(self.recent) // 2]

    def tick(self, now_ns: int) -> Optional[str]:
        """Whether to attach or detach the launch probes now."""
        if self.opened_ns is None:
            return ATTACH if now_ns >= self.next_open_ns else None
        open_ns = now_ns - self.opened_ns
        hold = max(HOLD_NS, (self.on + 2) * self.typical_ns)
        if self.bound_end_ns and now_ns - self.bound_end_ns < hold:
            self.held = True
            return None  # launch-bound: stay open while its steps keep saying so
        if open_ns >= self.max_open_ns:
            return DETACH
        if not self.typical_ns:
            return None  # no step seen yet: stay open (up to max_open_ns)
        # steps are reported an interval or two after they end: close by the clock, after the step
        # that was running at the attach and `on` whole ones of the typical length
        return DETACH if open_ns >= (self.on + 1) * self.typical_ns else None

    def opened(self, now_ns: int) -> None:
        """The launch probes are attached (every breakpoint is in place) as of now."""
        self.opened_ns = now_ns

    def closed(self, now_ns: int) -> None:
        """The launch probes start detaching now: later launches may or may not be counted."""
        assert self.opened_ns is not None
        self.windows.append((self.opened_ns, now_ns))
        del self.windows[:-64]  # steps are judged within seconds of their end
        span = now_ns - self.opened_ns  # a window held open for a launch-bound job counts as one
        if self.held and self.typical_ns:
            span = min(span, (self.on + 1) * self.typical_ns)
        self.held = False
        self.next_open_ns = now_ns + span * (self.period - self.on) // self.on
        self.opened_ns = None

    def label(self, steps: Iterable[RankStep]) -> None:
        """Say in each step summary whether its launches were counted whole (`sampled`); a step the
        probes did not cover whole loses its launch data, which would be short."""
        for rs in steps:
            span = probe_span(rs)
            if self.sampled(*span):
                rs.launches_sampled = True
                if rs.duration_ns and rs.launch_wait_ns >= BOUND_SHARE * rs.duration_ns:
                    self.bound_end_ns = max(self.bound_end_ns, span[1])
                if rs.detail is not None:
                    rs.detail.cuda.sampled_said = True
            else:
                mark_unsampled(rs)


def mark_unsampled(rs: RankStep) -> None:
    """Launch data of a step the launch probes did not cover whole: dropped, and said so."""
    rs.launches, rs.kernels, rs.launches_sampled = 0, {}, False
    if rs.launch_wait_ns:  # part of the step's launch waits: none, as in the steps outside windows
        if "host_wait" in rs.phases:
            rs.phases["host_wait"] = max(0, rs.phases["host_wait"] - rs.launch_wait_ns)
            rs.phases["host_other"] = max(0, rs.duration_ns - rs.phases["host_wait"])
        rs.launch_wait_ns = 0
    if rs.detail is None:
        return
    rs.detail.cuda.launch_hist = {}
    rs.detail.cuda.sampled_said = True
    py = rs.detail.sections.get("python")
    if py is not None:
        py.pop("gpu_phases", None)  # timers are labelled by the walks at launches
        for calls in py.get("calls", {}).values():
            calls.pop("launches", None)
