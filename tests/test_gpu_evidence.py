"""NVML's view of a rank's GPU from the agent to the alert and `argus top`, on the simulated job:
the agent reads devices through a stand-in `pynvml` (tests/fakenvml, first on its PYTHONPATH; the
agent cannot tell it from nvidia-ml-py) whose device 3 holds its clocks down for hardware
slowdown, while rank 3 of the job is a 1.5x straggler. Its summaries carry the sample, the wire
keeps it, the straggler alert says what NVML saw, and the live table shows it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from argus import wire
from argus.aggregator.config import PhaseInfo
from argus.aggregator.engine import Engine
from argus.exporter.prom import render_metrics
from argus.schema import from_probe
from argus.sim.launcher import SimConfig
from argus.tui.snapshot import JobView
from tests.helpers import REPO_ROOT
from tests.probing import probed_run

pytestmark = pytest.mark.bpf
FAKE = Path(__file__).resolve().parent / "fakenvml"


def test_a_throttled_gpu_is_said_in_the_straggler_alert_and_in_top(tmp_path: Path) -> None:
    env = {
        "PYTHONPATH": os.pathsep.join((str(FAKE), str(REPO_ROOT))),
        "FAKE_NVML_THROTTLED": "3",
    }
    cfg = SimConfig(
        timers=True,
        ranks=8,
        steps=22,
        preset="small",
        injects=["straggler:rank=3,factor=1.5,from_step=10"],
        run_dir=str(tmp_path),
    )
    _job, probe = probed_run(cfg, env=env)
    printed = [d for d in probe.steps() if d.get("step") is not None]
    assert printed and all("gpu" in d for d in printed), probe.stderr[-2000:]
    # each rank on its own device (LOCAL_RANK: the stand-in lists no processes per device)
    assert {d["rank"]: d["gpu"]["device"] for d in printed} == {r: r for r in range(8)}
    slow = next(d["gpu"] for d in printed if d["rank"] == 3)
    assert slow["throttle"] == ["hw_slowdown"] and slow["sm_clock_mhz"] == 1095
    steps = sorted((from_probe(d) for d in printed), key=lambda rs: (rs.step or 0, rs.rank))
    assert steps[0].gpu["sm_max_mhz"] == 1980 and "mem_used_gib" in steps[0].gpu
    assert all(wire.decode_step(wire.encode_step(rs), wire.step_names(rs)).gpu == rs.gpu for rs in steps)
    eng = Engine(None, PhaseInfo.parse("forward,backward,optimizer,grad_sync"))
    fired = [a for rs in steps for a in eng.add(rs) if a.state == "firing"]
    fired += [a for a in eng.flush() if a.state == "firing"]
    assert [(a.kind, a.ranks) for a in fired][:1] == [("straggler", [3])], [a.summary for a in fired]
    a = fired[0]
    assert "NVML: rank 3's GPU: clocks held down: hw_slowdown (SM clock 1095 of 1980 MHz)" in a.summary
    assert a.evidence["gpu"][3]["throttle"] == 8.0
    view = JobView(steps[0].job)
    for rs in steps:
        view.ingest(rs)
    snap = view.snapshot()
    rows = {r.rank: r for r in snap.rows}
    assert rows[3].gpu == ("1095MHz", "97%", "402W", "67°C", "hw_slowdown"), rows[3].gpu
    assert rows[0].gpu == ("1980MHz", "97%", "655W", "64°C")
    text = render_metrics([snap])
    lab = f'{{job="{snap.job}",rank="3",host="node-0"}}'
    assert f"argus_rank_gpu_throttled{lab} 1" in text and f"argus_rank_gpu_sm_clock_mhz{lab} 1095" in text
    assert f'argus_rank_gpu_throttled{{job="{snap.job}",rank="0",host="node-0"}} 0' in text
