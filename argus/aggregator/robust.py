"""Small robust statistics over plain lists (no numpy: the aggregator stays a pure-Python service)."""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Sequence


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the middle two when even)."""
    s = sorted(xs)
    n = len(s)
    m = n // 2
    return float(s[m]) if n & 1 else (s[m - 1] + s[m]) / 2.0


def median_sorted(s: Sequence[float]) -> float:
    n = len(s)
    m = n // 2
    return float(s[m]) if n & 1 else (s[m - 1] + s[m]) / 2.0


def quantile_sorted(s: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a sorted non-empty sequence (type 7)."""
    pos = q * (len(s) - 1)
    i = int(pos)
    frac = pos - i
    if i + 1 >= len(s):
        return float(s[-1])
    return s[i] + (s[i + 1] - s[i]) * frac


def mad(xs: Sequence[float]) -> float:
    """Median absolute deviation from the median (unscaled)."""
    m = median(xs)
    return median([abs(x - m) for x in xs])


def w1_sorted(a: Sequence[float], b: Sequence[float], points: int = 32) -> float:
    """Wasserstein-1 between two empirical distributions given as sorted lists: the mean absolute
    difference of their quantile functions on a midpoint grid (equal-weight)."""
    total = 0.0
    for k in range(points):
        q = (k + 0.5) / points
        total += abs(quantile_sorted(a, q) - quantile_sorted(b, q))
    return total / points


class Noise:
    """The spread of a quantity while healthy: a bounded history of |deviation from the group median|,
    summarised by its 99th percentile (the value a healthy rank exceeds 1 time in 100: phase noise on
    a shared host is heavy-tailed — mostly nothing, now and then a few ms of launch gaps — so a lower
    quantile times a factor would be exceeded often by healthy ranks)."""

    __slots__ = ("_cache", "_sorted", "hist")

    def __init__(self, size: int = 512) -> None:
        self.hist: Deque[float] = deque(maxlen=size)
        self._sorted: Optional[List[float]] = None  # hist sorted, until the next add
        self._cache: Dict[float, float] = {}  # quantile -> its value, until the next add

    def add(self, values: Iterable[float]) -> None:
        self.hist.extend(values)
        self._sorted = None
        self._cache.clear()

    def __len__(self) -> int:
        return len(self.hist)

    def scale(self, q: float = 0.99) -> float:
        v = self._cache.get(q)
        if v is None:
            if self._sorted is None:
                self._sorted = sorted(self.hist)
            v = self._cache[q] = quantile_sorted(self._sorted, q) if self._sorted else 0.0
        return v


OUTLIER_K = 4.0


def teaching(devs: List[float], floor: float) -> List[float]:
    """The |deviations| that may teach a group's noise: not one that stands out by the floors and by
    OUTLIER_K x the step's median |deviation|. Before judging starts everything else is learnt, so
    without this a rank that was already slow when the agents attached would teach the group that
    its slowness is noise (and never be named)."""
    if len(devs) < 3:
        return devs
    typical = median(devs)
    return [d for d in devs if d < floor or d < OUTLIER_K * typical]


def fence_high(scores: List[float], k: float) -> float:
    """Upper IQR fence Q3 + k·IQR of a non-empty score list."""
    s = sorted(scores)
    q1, q3 = quantile_sorted(s, 0.25), quantile_sorted(s, 0.75)
    return q3 + k * (q3 - q1)
