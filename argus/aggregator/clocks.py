"""Hosts' clock offsets, estimated from the ranks' step ends, taken out of cross-host arrivals.

Arrival lateness compares realtime stamps of different hosts: a host whose clock is 50 ms ahead
makes its ranks look 50 ms late at every collective (and the others early). Synchronous training
gives a reference that does not depend on any clock: every rank ends step *n* at about the same
true time (its end-of-step sync returns once the step's last collective completed on every GPU),
whoever was slow before it. So each host's offset is the median, over recent steps, of its ranks'
median step end minus the reference host's (the first by name in the first step seen); every stamp of
its ranks is moved back by it before lateness is judged (GPU-arrival bounds and network sends too:
argus.aggregator.gpuarrival, which widens its margins by `uncertainty`). What a rank does after
the last collective (its share of the optimizer) also moves its end: the median over a host's
ranks and steps keeps one slow rank out of its host's offset, except on a host with one rank
(then that rank's post-collective excess is taken for clock and its lateness understated, never
overstated).

An offset under `min_ns` (clock sync between hosts is ~1 ms at best) is not applied: it is the
ranks' own step-end spread. Applied offsets, with their spread, go into the evidence of every alert
of the job and into `argus diagnose` (the correction is said, with how sure it is).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from argus.aggregator.robust import median
from argus.schema import CommStep, RankStep


class HostClocks:
    def __init__(self, min_ns: int = 2_000_000, window: int = 64) -> None:
        self.min_ns = min_ns
        self.window = window
        self.ref: Optional[str] = None
        self.diffs: Dict[str, Deque[int]] = {}  # host -> its median end minus the reference host's, per step

    def observe(self, ranks: Dict[int, RankStep]) -> None:
        """Learn from one judged step (every rank's raw end time)."""
        ends: Dict[str, List[int]] = {}
        for rs in ranks.values():
            ends.setdefault(rs.host, []).append(rs.end_ns)
        if len(ends) < 2:
            return
        if self.ref is None or self.ref not in ends:
            if self.ref is not None:  # the reference host is absent this step: no comparison
                return
            self.ref = min(ends)
        ref = median(ends[self.ref])
        for host, e in ends.items():
            if host != self.ref:
                q = self.diffs.get(host)
                if q is None:
                    q = self.diffs[host] = deque(maxlen=self.window)
                q.append(int(median(e) - ref))

    def offset(self, host: str) -> Optional[Tuple[float, float]]:
        """(offset ns, spread ns: median absolute deviation of the per-step estimates) when applied."""
        q = self.diffs.get(host)
        if not q:
            return None
        o = median(list(q))
        if abs(o) < self.min_ns:
            return None
        return o, median([abs(x - o) for x in q])

    def uncertainty(self, host: str) -> float:
        """How well `host`'s stamps are known on the reference host's clock once corrected (ns): the
        spread of its offset estimates, plus the offset itself when too small to be applied (it is
        still in the stamps). The reference host: 0; a host never compared: `min_ns`."""
        if host == self.ref:
            return 0.0
        q = self.diffs.get(host)
        if not q:
            return float(self.min_ns)
        o = median(list(q))
        spread = median([abs(x - o) for x in q])
        return spread if abs(o) >= self.min_ns else abs(o) + spread

    def applied(self) -> Dict[str, Tuple[float, float]]:
        out = {}
        for h in self.diffs:
            o = self.offset(h)
            if o is not None:
                out[h] = o
        return out

    def correct(self, ranks: Dict[int, RankStep]) -> Dict[int, RankStep]:
        """The step's summaries with their hosts' offsets taken out of every realtime stamp."""
        offs = self.applied()
        if not offs:
            return ranks
        out: Dict[int, RankStep] = {}
        for r, rs in ranks.items():
            o = offs.get(rs.host)
            out[r] = rs if o is None else shift(rs, int(o[0]))
        return out

    def evidence(self) -> Dict[str, Any]:
        """What an alert says of the correction: offsets from the reference host, ms."""
        offs = self.applied()
        if not offs:
            return {}
        return {
            "reference": self.ref,
            "estimated_from": "step ends",
            "offsets_ms": {h: round(o / 1e6, 2) for h, (o, _s) in sorted(offs.items())},
            "spread_ms": {h: round(s / 1e6, 2) for h, (_o, s) in sorted(offs.items())},
        }


def shift(rs: RankStep, off: int) -> RankStep:
    """`rs` with `off` ns taken out of its realtime stamps (its durations are its own clock's)."""
    comms: Dict[str, CommStep] = {}
    for k, c in rs.comms.items():
        comms[k] = dataclasses.replace(
            c,
            arrive_ns=[a - off for a in c.arrive_ns],
            p2p=[dataclasses.replace(p, arrive_ns=p.arrive_ns - off) for p in c.p2p],
        )
    ga = rs.gpu_arrival
    if ga is not None:  # the GPU-arrival bounds and network send are realtime stamps of the same host
        ga = dataclasses.replace(
            ga,
            bounds={
                c: [(i, lo - off if lo else 0, hi - off if hi else 0, src) for i, lo, hi, src in v]
                for c, v in ga.bounds.items()
            },
            net_first_ns=ga.net_first_ns - off if ga.net_first_ns else 0,
        )
    return dataclasses.replace(
        rs, start_ns=rs.start_ns - off, clock_offset_ns=rs.clock_offset_ns - off, comms=comms, gpu_arrival=ga
    )
