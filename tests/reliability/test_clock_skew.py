"""Ranks on hosts whose clocks disagree (issue 14, item 6): lateness must still name the right rank,
never a confident wrong one.

The skew is injected where a skewed host's shows: the agent's wall-clock reading
(``ARGUS_FAULT_CLOCK_SKEW_MS``, argus/agent/clock.py), so every realtime stamp of the ranks it
traces is off, as their host would send them. One agent per simulated host (ranks 0-3 on node-0,
4-7 on node-1, as `--ranks-per-host 4` names them), node-1's skewed by ±50 ms. The aggregator takes
each host's offset, estimated from the ranks' step ends, out of the arrival times
(argus/aggregator/clocks.py) and says so in the alert.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from argus.agent.clock import SKEW_ENV
from argus.aggregator.clocks import shift
from argus.aggregator.config import PhaseInfo
from argus.aggregator.engine import Engine
from argus.schema import RankStep
from argus.sim.launcher import SimConfig, SimJob
from tests.aggsynth import Faults, Job, judge, steps
from tests.helpers import run_argus
from tests.probing import ProbeProc

MS = 1_000_000
NAMES = PhaseInfo.parse("forward,backward,optimizer,grad_sync")


# ---- the aggregator alone, on synthetic summaries (fast) --------------------------------------------


_engine = judge


def _skewed(job: Job, host: str, skew_ns: int) -> List[RankStep]:
    # shift() takes an offset out; a host ahead by `skew` is the summary with -skew taken out
    return [shift(rs, -skew_ns) if rs.host == host else rs for rs in steps(job)]


def _alerts(eng: Engine) -> List[Any]:
    return [(a.kind, a.ranks) for a in eng.transitions if a.state == "firing"]


@pytest.mark.parametrize("skew_ms", [50, -50])
def test_host_late_rank_named_alike_whatever_the_skew(skew_ms: int) -> None:
    """A rank whose host is late at the collectives (15 ms, steps 10-39) on the skewed host (rank 6
    on node-1): named the same, with the same lateness, as without skew. Without the correction +50
    ms made all of node-1 25 ms late at every collective and -50 ms hid the rank's lateness."""
    job = Job(steps=60, faults=Faults(host_stall=(6, 10, 15.0, 30)))
    want = _engine(steps(job))
    got = _engine(_skewed(job, "node-1", skew_ms * MS))
    assert _alerts(want) == [("straggler", [6])]
    assert _alerts(got) == _alerts(want)
    a, b = want.alerts()[0].evidence, got.alerts()[0].evidence
    assert b["host_late_median_ms"] == pytest.approx(a["host_late_median_ms"], abs=1.0)
    ck = b["identity"]["clocks"]
    assert ck["reference"] == "node-0" and ck["offsets_ms"]["node-1"] == pytest.approx(skew_ms, abs=0.5)
    assert "clocks" not in a.get("identity", {})  # nothing to correct: nothing said


def test_clean_skewed_job_raises_nothing_and_small_offsets_are_left_alone() -> None:
    job = Job(steps=120, seed=7)
    assert _alerts(_engine(_skewed(job, "node-1", 50 * MS))) == []
    eng = _engine(_skewed(job, "node-1", MS))  # 1 ms: within what clock sync gives, not corrected
    assert eng.transitions == [] and eng.jobs["synth"].clocks.applied() == {}


# ---- end to end: two agents, one host's clock skewed ------------------------------------------------


def _run(tmp: Path, redis_url: str, skew_ms: int, inject: Optional[str]) -> Dict[str, Any]:
    """The 8-rank job probed by one agent per host, node-1's skewed; `argus diagnose --redis --json`."""
    cfg = SimConfig(
        timers=True,
        ranks=8,
        steps=100,
        preset="small",
        ranks_per_host=4,
        run_dir=str(tmp / "job"),
        gate=True,
        injects=[inject] if inject else [],
    )
    job = SimJob(cfg).start()
    agents: List[ProbeProc] = []
    try:
        job.wait_loaded()
        pids = job.pids
        agents = [
            ProbeProc([pids[r] for r in range(4)], "--redis", redis_url),
            ProbeProc([pids[r] for r in range(4, 8)], "--redis", redis_url, env={SKEW_ENV: str(skew_ms)}),
        ]
        for a in agents:
            a.wait_for("redis: connected", timeout=120)
        job.release()
        job.wait()
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
    finally:
        job.stop()
        for a in agents:
            if a.proc.poll() is None:
                a.proc.kill()
    # the skewed agent's stamps really are off by the skew (its summaries are all the aggregator has)
    ends: Dict[int, Dict[int, int]] = {}
    for a in agents:
        for d in a.steps():
            if d["step"] is not None:
                ends.setdefault(d["step"], {})[d["rank"]] = (
                    d["start_ns"] + d["duration_ns"] + d["wall_offset_ns"]
                )
    gaps = [
        (sum(e[r] for r in range(4, 8)) - sum(e[r] for r in range(4))) / 4 / MS
        for e in ends.values()
        if len(e) == 8
    ]
    assert len(gaps) > 50 and abs(sorted(gaps)[len(gaps) // 2] - skew_ms) < 3, gaps[:10]
    res = run_argus("diagnose", "--redis", redis_url, "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    (j,) = json.loads(res.stdout)["jobs"]
    assert j["hosts"] == ["node-0", "node-1"] and j["ranks"] == list(range(8))
    return j


@pytest.mark.bpf
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "skew_ms,inject",
    [
        (50, "straggler:rank=5,factor=1.35,from_step=20"),
        (-50, "straggler:rank=5,factor=1.35,from_step=20"),
        (50, "dataloader_stall:rank=5,step=30,seconds=0.03,steps=50"),
        (-50, None),
    ],
    ids=["straggler+50", "straggler-50", "late-host+50", "clean-50"],
)
def test_skewed_host_names_the_right_rank_or_none(
    tmp_path: Path, redis_url: str, redis_client: Any, skew_ms: int, inject: Optional[str]
) -> None:
    t0 = time.monotonic()
    j = _run(tmp_path, redis_url, skew_ms, inject)
    ck = j["clocks"]
    assert ck["reference"] == "node-0" and abs(ck["offsets_ms"]["node-1"] - skew_ms) < 2, ck
    named = [(a["kind"], a["ranks"]) for a in j["alerts"] if a["ranks"]]
    print(f"\nskew {skew_ms} ms, {inject}: clocks {ck}; named {named}; {time.monotonic() - t0:.1f} s")
    if inject is None:
        assert named == [], j["alerts"]
        return
    assert named == [("straggler", [5])], j["alerts"]
    (a,) = [a for a in j["alerts"] if a["ranks"]]
    ev = a["evidence"]
    assert abs(ev["identity"]["clocks"]["offsets_ms"]["node-1"] - skew_ms) < 2
    if inject.startswith("dataloader"):
        # its host reached the collectives 30 ms late: said as 30, not 30 ± 25 (half the skew)
        assert 22 <= ev["host_late_median_ms"] <= 38, ev
    else:
        assert ev["phases"]["timer1"]["ratio"] == pytest.approx(1.35, abs=0.05), ev


def test_skew_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """The knob moves the agent's realtime reading by exactly its value; a bad value is a usage error."""
    from argus.agent import clock
    from argus.errors import UsageError

    monkeypatch.setattr(clock, "_skew_ns", None)
    monkeypatch.setenv(SKEW_ENV, "-50")
    off, _err = clock.wall_offset()
    assert abs(off - (time.time_ns() - time.monotonic_ns()) + 50 * MS) < MS
    monkeypatch.setattr(clock, "_skew_ns", None)
    monkeypatch.setenv(SKEW_ENV, "fifty")
    with pytest.raises(UsageError, match=SKEW_ENV):
        clock.wall_offset()
    monkeypatch.setattr(clock, "_skew_ns", None)
