"""`argus sim run --hosts`: the simulated hosts' names, as the agent reads them from each rank
(one machine running one job of its own reports its own name, not node-0)."""

from __future__ import annotations

from pathlib import Path

from argus.agent import identity
from argus.sim.launcher import SimConfig, SimJob
from tests.helpers import run_argus


def test_ranks_report_the_hosts_named(tmp_path: Path) -> None:
    cfg = SimConfig(
        ranks=3, steps=200, preset="small", ranks_per_host=2, host_names=["vm-a"], run_dir=str(tmp_path)
    )
    job = SimJob(cfg).start()
    try:
        hosts = {r: identity.of_pid(pid, None, None, "fallback").host for r, pid in job.pids.items()}
    finally:
        job.stop()
    assert hosts == {0: "vm-a", 1: "vm-a", 2: "node-1"}  # past the list: node-<index>


def test_a_bad_host_name_is_a_usage_error() -> None:
    res = run_argus("sim", "run", "--hosts", "vm a", "--steps", "1")
    assert res.returncode == 2 and res.stderr.startswith("ERROR: --hosts: 'vm a' is not a host name")
