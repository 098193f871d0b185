"""L3 — distributions: degradation that never spikes.

Two comparisons, both within symmetric groups (never all pairs of ranks: at 10,000 ranks that is
5·10^7 pairs per phase):

* **rank vs its group** (every `l3_every` steps): each rank's last `l3_window` values of a phase
  form an empirical distribution; the group's *median distribution* takes, for every order
  statistic, the median across ranks. A rank's score is the Wasserstein-1 distance between the
  two divided by the group median; it is an outlier beyond the robust fence Q3 + `l3_fence`·IQR of
  the group's scores and above `l3_rel`. W1 sees a shifted median and a fattened tail alike, so a
  rank a few percent slower — below L2's per-step floors — is caught once its window fills.
* **group vs its own past** (every step): the group's per-step *minimum* of a phase is the phase's
  own duration — for a communication phase the collective's (the rank that arrived last did not
  wait), for a compute phase the kernels' (waits and launch gaps only ever add time) — immune to
  stragglers and host noise. When it rises by `link_rel` and `link_k` x its healthy
  spread for `link_persist` steps, while no rank of the group is late, the collective itself got
  slower: the silent slow link. The same shift in a compute phase of every rank is a group-wide
  compute degradation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from argus.aggregator.config import Thresholds
from argus.aggregator.robust import fence_high, mad, median, median_sorted, quantile_sorted, w1_sorted
from argus.aggregator.state import Ring
from argus.schema import RankStep

# consecutive L3 checks (every `l3_every` steps) a rank must stay beyond the fence: 2 (8 steps)
# raised a false alarm in about 1 of 3 clean 300-step simulated runs on a 2-core machine
DRIFT_CHECKS = 3


@dataclass
class Drift:
    rank: int
    group: str
    phase: str
    score: float  # W1 / group median
    fence: float
    rank_median_ns: float
    group_median_ns: float


@dataclass
class Shift:
    group: str
    phase: str
    role: str
    ratio: float  # recent level / baseline level
    baseline_ns: float
    level_ns: float
    w1_rel: float  # W1(recent values of all members, baseline values) / baseline median
    since: int


@dataclass
class _Series:
    mins: Deque[Tuple[int, float]] = field(default_factory=lambda: deque(maxlen=64))
    vals: Deque[List[float]] = field(default_factory=lambda: deque(maxlen=64))  # all members, per step
    healthy: Deque[bool] = field(default_factory=lambda: deque(maxlen=64))
    frozen: Optional[Tuple[float, float, List[float]]] = None  # baseline (median, MAD, values) in alarm
    since: int = -1


class L3:
    def __init__(self, th: Thresholds) -> None:
        self.th = th
        self.rings: Dict[str, Ring] = {}
        self.series: Dict[Tuple[str, str], _Series] = {}
        self.steps = 0
        self.drift_hist: Dict[Tuple[int, str], int] = {}  # consecutive evaluations flagged

    # ---- group vs own past -----------------------------------------------------------------------

    def group_shift(
        self, step: int, key: str, members: List[RankStep], roles: Dict[str, str], quiet: bool
    ) -> List[Shift]:
        """Feed one step of a symmetric group; `quiet`: no rank of the group is late or an outlier."""
        values = {p: [float(rs.phases[p]) for rs in members if p in rs.phases] for p in roles}
        return self.group_shift_values(step, key, values, roles, quiet)

    def group_shift_values(
        self, step: int, key: str, values: Dict[str, List[float]], roles: Dict[str, str], quiet: bool
    ) -> List[Shift]:
        """`group_shift` from each phase's values over the group (a reducer has the parts' least
        value and quantiles, argus.aggregator.reduce: the level is the least, exact)."""
        th = self.th
        out: List[Shift] = []
        for p, role in roles.items():
            vals = sorted(values.get(p, ()))
            if len(vals) < th.min_group:
                continue
            s = self.series.get((key, p))
            if s is None:
                s = self.series[(key, p)] = _Series()
            level = float(vals[0])  # waits and launch gaps only add: the fastest rank is the phase's own time
            s.mins.append((step, level))
            # the step's distribution over the group, kept as 32 quantiles (bounded at any group size)
            s.vals.append(
                [quantile_sorted(vals, (i + 0.5) / 32) for i in range(32)] if len(vals) > 32 else vals
            )
            s.healthy.append(quiet)
            r = self._judge(s, th, th.link_rel if role == "comm" else 2 * th.link_rel)
            if r is not None:
                ratio, base, lvl, w1 = r
                out.append(Shift(key, p, role, ratio, base, lvl, w1, s.since))
        return out

    def _judge(self, s: _Series, th: Thresholds, rel: float) -> Optional[Tuple[float, float, float, float]]:
        k = th.link_persist
        if len(s.mins) < k + th.link_baseline:
            return None
        recent = [v for _, v in list(s.mins)[-k:]]
        if s.frozen is None:
            old = list(zip(s.mins, s.healthy, s.vals))[:-k]
            base_pts = [(m[1], vals) for m, ok, vals in old if ok][-th.link_baseline * 4 :]
            if len(base_pts) < th.link_baseline:
                return None
            levels = [x for x, _ in base_pts]
            bvals = sorted(v for _, vals in base_pts for v in vals)
            base, spread = (
                median(levels),
                max(1.4826 * mad(levels), (max(levels) - median(levels)) / th.link_k),
            )
        else:
            base, spread, bvals = s.frozen
        need = max(base * (1 + rel), base + th.link_k * spread)
        if s.frozen is not None:
            if min(recent) < base * (1 + rel / 2):
                s.frozen = None  # back to the baseline: resolved
                s.since = -1
                return None
        elif min(recent) >= need and all(list(s.healthy)[-k:]):
            s.frozen = (base, spread, bvals)
            s.since = list(s.mins)[-k][0]
        else:
            return None
        rvals = sorted(v for vals in list(s.vals)[-k:] for v in vals)
        w1 = w1_sorted(rvals, bvals) / base if base > 0 else 0.0
        return median(recent) / base if base > 0 else float("inf"), base, median(recent), w1

    # ---- rank vs group -----------------------------------------------------------------------------

    def push(self, key: str, members: List[RankStep], phases: List[str]) -> None:
        ring = self.rings.get(key)
        if ring is None or ring.phases != phases:
            ring = self.rings[key] = Ring(phases, self.th.l3_window)
        ring.push({rs.rank: rs.phases for rs in members})

    def rank_drift(self, key: str, ranks: List[int]) -> List[Drift]:
        """Ranks whose recent distribution of a phase sits beyond the group's fence (high side)."""
        th = self.th
        ring = self.rings.get(key)
        out: List[Drift] = []
        if ring is None or ring.filled < th.l3_window or len(ranks) < max(th.min_group, 4):
            return out
        w = th.l3_window
        for i, p in enumerate(ring.phases):
            wins: Dict[int, List[float]] = {}
            for r in ranks:
                v = ring.window(r, i)
                if len(v) == w:
                    v.sort()
                    wins[r] = v
            if len(wins) < max(th.min_group, 4):
                continue
            cols = list(zip(*wins.values()))
            med_dist = [median(c) for c in cols]
            gmed = median_sorted(med_dist)
            if gmed <= 0:
                continue
            scores = {r: w1_sorted(v, med_dist, points=w) / gmed for r, v in wins.items()}
            fence = fence_high(list(scores.values()), th.l3_fence)
            for r, sc in scores.items():
                hit = sc > fence and sc >= th.l3_rel and median_sorted(wins[r]) > gmed
                k = (r, p)
                if hit:
                    self.drift_hist[k] = self.drift_hist.get(k, 0) + 1
                    if self.drift_hist[k] >= DRIFT_CHECKS:
                        out.append(Drift(r, key, p, sc, fence, median_sorted(wins[r]), gmed))
                else:
                    self.drift_hist.pop(k, None)
        return out
