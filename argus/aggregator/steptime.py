"""L1 — iteration time: spikes (sliding-window ratio gate) and regressions (change point).

Input: the job's step time per step (the median over ranks of the step duration: in a synchronous
job every rank's step lasts as long as the slowest rank's, so one number per step is the job's).
Output: anomalous step windows. L1 never names a rank: L2/L3 do; the engine folds an L1 window into
the alert that explains it and publishes it alone only when nothing does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

from argus.aggregator.config import Thresholds
from argus.aggregator.robust import median


@dataclass
class L1Finding:
    kind: str  # step_spike | step_regression
    first: int
    last: int
    ratio: float
    baseline_ns: float
    level_ns: float


def spike(history: List[float], value: float, th: Thresholds) -> Optional[float]:
    """The ratio value / median(history) when it passes the gate, else None."""
    if len(history) < max(3, th.spike_window // 4):
        return None
    base = median(history[-th.spike_window :])
    if base <= 0:
        return None
    r = value / base
    return r if r >= th.spike_ratio and value - base >= th.spike_min_ns else None


def _spread(xs: List[float]) -> float:
    m = median(xs)
    return median([abs(x - m) for x in xs]) / m if m > 0 else 0.0


def change_point(xs: List[float], th: Thresholds) -> Optional[Tuple[int, float]]:
    """Full scan for the split of `xs` maximising the mean shift; (split index, ratio after/before)
    when the later segment is `regress_ratio` x the earlier one and both segments are steady."""
    n = len(xs)
    k = th.regress_min_segment
    if n < 2 * k:
        return None
    prefix = [0.0]
    for x in xs:
        prefix.append(prefix[-1] + x)
    best: Optional[Tuple[int, float]] = None
    for i in range(k, n - k + 1):
        before = prefix[i] / i
        after = (prefix[n] - prefix[i]) / (n - i)
        if before <= 0:
            continue
        r = after / before
        if best is None or r > best[1]:
            best = (i, r)
    if best is None or best[1] < th.regress_ratio:
        return None
    i = best[0]
    if _spread(xs[:i]) > th.regress_max_spread or _spread(xs[i:]) > th.regress_max_spread:
        return None
    # robust confirmation: medians shift too (a few spikes do not make a regression)
    if median(xs[i:]) < th.regress_ratio * median(xs[:i]):
        return None
    return best


def steps_spanned(colls: Sequence[float], history: Deque[float]) -> float:
    """How many training steps one summary spans, from every rank's collective count in it
    (`colls`) against the recent steps' (`history`, appended to): 1 normally; k when the probe
    missed k - 1 step boundaries (its ranks issued k times the usual collectives), so that L1
    compares per-step times."""
    n = median(list(colls))
    typical = median(list(history)) if history else n
    history.append(n)
    if typical <= 0 or n < 1.5 * typical:
        return 1.0
    return n / typical


Held = List[Tuple[L1Finding, int]]  # (finding, publish at this judged-step count)


def release(held: Held, judged: int, explained: bool) -> Tuple[Held, List[L1Finding], int]:
    """(still held, due for publishing alone, folded): a held L1 finding is folded into what a
    level found (`explained`: a specific finding now, or one firing), else published once due."""
    if explained:
        return [], [], len(held)
    due = [f for f, at in held if judged >= at]
    return [(f, at) for f, at in held if judged < at], due, 0


class L1:
    """Per-job step-time series and its detectors."""

    def __init__(self, th: Thresholds) -> None:
        self.th = th
        self.steps: Deque[Tuple[int, float]] = deque(maxlen=max(th.window, th.regress_window))
        self.healthy: Deque[float] = deque(maxlen=th.spike_window)  # step times of non-spike steps
        self.run = 0  # consecutive spikes: a lasting new level becomes the baseline after a few

    def median_step(self) -> float:
        vals = list(self.healthy) or [t for _, t in self.steps]
        return median(vals) if vals else 0.0

    def observe(self, step: int, step_ns: float) -> List[L1Finding]:
        out: List[L1Finding] = []
        hist = list(self.healthy)
        r = spike(hist, step_ns, self.th)
        if r is not None:
            out.append(L1Finding("step_spike", step, step, r, median(hist[-self.th.spike_window :]), step_ns))
            self.run += 1
        if r is None or self.run > self.th.regress_min_segment:
            self.healthy.append(step_ns)
            self.run = 0 if r is None else self.run
        self.steps.append((step, step_ns))
        window = [t for _, t in list(self.steps)[-self.th.regress_window :]]
        cp = change_point(window, self.th)
        if cp is not None:
            i, ratio = cp
            steps = [s for s, _ in list(self.steps)[-len(window) :]]
            out.append(
                L1Finding(
                    "step_regression",
                    steps[i],
                    step,
                    ratio,
                    median(window[:i]),
                    median(window[i:]),
                )
            )
        return out
