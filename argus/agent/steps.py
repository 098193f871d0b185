"""Cut training steps from the stream of host-blocking syncs, with no framework hook.

The BPF side closes an *epoch* at every host-blocking sync. Each closed epoch gets a signature:
which sync closed it (call, handle, thread) and how many collectives of each (communicator, op)
it contains. A training loop repeats the same sequence of epochs every step, so the period P is
the smallest shift under which the signature sequence matches itself; the step boundary is the
last sync before the longest collective-free stretch of the period (the end-of-step
`loss.item()`, not a mid-step sync such as gradient clipping). A `--step-fn` marker overrides all
of this: every call to it ends a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional, Tuple

MIN_MATCH = 0.8  # fraction of epochs that must repeat at the period for it to count
HISTORY = 512


@dataclass(frozen=True)
class EpochSig:
    epoch: int
    sync: Hashable  # (call, handle, tid) of the sync that closed the epoch
    colls: Tuple[Tuple[Hashable, int], ...]  # sorted ((comm, op), count)
    sync_exit_ns: int
    first_coll_ns: Optional[int] = None
    last_coll_ns: Optional[int] = None
    marker: bool = False  # closed by the --step-fn marker

    def key(self) -> Tuple[Hashable, Tuple[Tuple[Hashable, int], ...]]:
        return (self.sync, self.colls)


@dataclass(frozen=True)
class Period:
    length: int  # epochs per step
    phase: int  # boundary epochs e satisfy (e - anchor) % length == phase
    anchor: int
    confidence: float
    source: str  # "syncs" or "step-fn"
    sync: Hashable = None  # the sync that ends a step; epochs closed by other syncs never cut

    def is_boundary(self, sig: EpochSig) -> bool:
        return (sig.epoch - self.anchor) % self.length == self.phase and sig.sync == self.sync


def find_period(
    sigs: List[EpochSig], max_period: int = 16, min_match: float = MIN_MATCH
) -> Optional[Tuple[int, float]]:
    """Smallest P whose shifted signature sequence matches (fraction >= min_match), and that fraction."""
    n = len(sigs)
    keys = [s.key() for s in sigs]
    for p in range(1, max_period + 1):
        if n < max(3 * p, p + 4):
            return None
        m = sum(1 for i in range(p, n) if keys[i] == keys[i - p])
        frac = m / (n - p)
        if frac >= min_match:
            return p, frac
    return None


def choose_phase(sigs: List[EpochSig], p: int) -> int:
    """Position in the period whose sync ends a step: the last sync before the longest collective-free
    stretch (averaged over periods). Without collectives: the sync followed by the longest gap."""
    n = len(sigs)
    start = sigs[0].epoch
    score: Dict[int, List[float]] = {j: [] for j in range(p)}
    has_colls = any(s.first_coll_ns is not None for s in sigs)
    for i in range(n - 1):
        j = (sigs[i].epoch - start) % p
        if has_colls:
            nxt = sigs[i + 1]
            if nxt.first_coll_ns is None:
                continue  # not the last sync before collectives resume
            prev_coll = next(
                (s.last_coll_ns for s in reversed(sigs[: i + 1]) if s.last_coll_ns is not None), None
            )
            if prev_coll is None:
                continue
            score[j].append(nxt.first_coll_ns - prev_coll)
        else:
            score[j].append(sigs[i + 1].sync_exit_ns - sigs[i].sync_exit_ns)
    best = max(range(p), key=lambda j: sum(score[j]) / len(score[j]) if score[j] else -1.0)
    return best


class StepDetector:
    """Feed closed epochs in order; ask for the period; know which epochs end steps."""

    def __init__(self, max_period: int = 16, step_fn: bool = False) -> None:
        self.max_period = max_period
        self.step_fn = step_fn
        self.sigs: Deque[EpochSig] = deque(maxlen=HISTORY)
        self.period: Optional[Period] = None
        self._since_check = 0

    def add(self, sig: EpochSig) -> None:
        self.sigs.append(sig)
        self._since_check += 1
        if self.step_fn:
            if sig.marker and self.period is None:
                self.period = Period(1, 0, sig.epoch, 1.0, "step-fn", sig.sync)
            return
        # re-detect while unknown, and every few epochs afterwards (the loop may change)
        if self.period is None or self._since_check >= 4 * self.period.length:
            self._since_check = 0
            self.detect()

    def detect(self) -> Optional[Period]:
        sigs = list(self.sigs)[-64 * 4 :]
        found = find_period(sigs, self.max_period)
        if found is None:
            if self.period is not None:
                # keep a known period unless it clearly stopped matching
                recent = sigs[-4 * self.period.length :]
                keys = [s.key() for s in recent]
                p = self.period.length
                m = [keys[i] == keys[i - p] for i in range(p, len(keys))]
                if m and sum(m) / len(m) < 0.5:
                    self.period = None
            return self.period
        p, conf = found
        if self.period is not None and self.period.length == p:
            # keep the established alignment (boundaries must not jump between steps)
            self.period = Period(p, self.period.phase, self.period.anchor, conf, "syncs", self.period.sync)
            return self.period
        phase = choose_phase(sigs, p)
        anchor = sigs[0].epoch
        # the sync that ends steps: the most common one at that position of the period
        at_phase = [s.sync for s in sigs if (s.epoch - anchor) % p == phase and s.sync is not None]
        sync = max(set(at_phase), key=at_phase.count) if at_phase else None
        self.period = Period(p, phase, anchor, conf, "syncs", sync)
        return self.period

    def is_boundary(self, sig: EpochSig) -> bool:
        if self.step_fn:
            return sig.marker
        return self.period is not None and self.period.is_boundary(sig)
