"""Load (issue 14, item 5): a 10,000-rank synthetic job through the real `argus aggregate`, the soak
of benchmarks/aggregator_scale.py shortened to 140 s (`--soak 600` is the full one, recorded in
docs/benchmarks.md): one job step every 2.5 s = 4,000 summaries/s into a private redis-server (a
slower step where the aggregator's capacity, measured first, is under 6,667/s), a 1.3x straggler
(rank 3333) from 50% to 65% of the steps.

It holds the aggregator to: alive to the end, every summary read and acknowledged within seconds,
never more than a few steps behind, RSS about flat after the warm-up, the straggler named and
then resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.aggregator_scale import capacity, soak, soak_verdict
from tests.redisproc import RedisProc

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]

RANKS = 10_000
# One aggregator takes 4,900-5,600 summaries/s at 98% of a core on the 2-core CI machine (kernel
# 6.18 VM, 2026-12-07, while the publisher holds the other core), and 2,900/s on another day's CI
# machine (its lag then grew to 44 s of job time: the load, not the aggregator, was wrong). At a
# step every 2 s (5,000/s) it had no headroom and its lag was a random walk — 9,800-59,000 entries
# over 5 runs of one code. So the test measures the aggregator's capacity first (a backlog read,
# benchmarks.aggregator_scale.capacity) and paces at most HEADROOM of it: a step every 2.5 s, or
# slower on a slower machine. Live, beside the publisher, it read 72-86% of what it read from the
# backlog (2,556 of 3,530/s and 2,774 of 3,243/s, 2026-12-07; at 75% its lag grew to 14 s). Real
# jobs of 10,000 GPUs step every few seconds, and a larger rate is
# for `argus aggregate --shard I/N` (tests/test_sharded_redis.py).
STEP_S = 2.5
HEADROOM = 0.6
DURATION_S = 140.0  # the RSS is compared from step 36 (91 s) on, as it was from step 35 at 2 s
# Never this many job steps' worth of entries behind. The 600 s soak's worst was 1.9 steps, while
# another engineer's tests kept the second core busy; with the O(ranks²) alignment check fixed
# with it, the aggregator took 2,300 summaries/s of 5,000 and was 11 steps behind at 40 s.
MAX_LAG_STEPS = 4
# RSS growth from the sample at 65% of the run (36 steps in: the reader's de-duplication window and
# the engine's state are there) to the end, 49 s later. Measured +2 MB over that span in the 600 s soak
# (+12 MB before the alignment's reference ends were kept as medians); the allocator also steps up
# by 8-20 MB now and then with the Python objects flat (tracemalloc). One step of decoded summaries
# is 54 MB: an engine that kept a step's summaries every 20 steps would exceed this.
MAX_GROWTH_MB = 30.0


def test_ten_thousand_ranks_memory_flat_lag_bounded(tmp_path: Path) -> None:
    srv = RedisProc(tmp_path / "redis").start()
    try:
        cap = capacity(srv.url, RANKS)
        step_s = max(STEP_S, RANKS / (HEADROOM * cap))
        print(f"capacity {cap:,.0f} summaries/s: one step every {step_s:.2f} s")
        r = soak(srv.url, RANKS, DURATION_S, step_s)
    finally:
        srv.stop()
    verdict = "\n".join(soak_verdict(r))
    print(verdict)
    said = "\n".join(r.output[-20:])
    assert r.alive, f"the aggregator died:\n{said}"
    assert r.published == RANKS * r.steps
    assert len(r.samples) >= 10, "a sample every 10 s"
    # drained: lag and pending 0 this soon after the last summary was published
    assert r.drained_s is not None and r.drained_s < 15.0, f"not drained:\n{verdict}\n{said}"
    worst = max(r.samples, key=lambda x: x.lag)
    assert worst.lag <= MAX_LAG_STEPS * RANKS, verdict
    warm, end = r.at(0.65), r.samples[-1]
    assert warm.t_s >= 60.0 and end.t_s - warm.t_s >= 30.0
    assert end.rss_mb - warm.rss_mb < MAX_GROWTH_MB, verdict
    st = r.straggler
    assert r.fired("straggler", st.rank), f"straggler rank {st.rank} not named:\n{verdict}"
    assert r.resolved("straggler", st.rank), f"straggler rank {st.rank} never resolved:\n{verdict}"
