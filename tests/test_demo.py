"""`argus demo` runs to the diagnosis on its own and cleans up everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, argus_env, sigint_as_at_a_terminal

pytestmark = [pytest.mark.bpf, pytest.mark.redis, pytest.mark.slow]


def leftovers(workdir_prefix: str) -> list:
    out = subprocess.run(
        ["pgrep", "-af", "argus.sim.trainer|argus probe|argus aggregate|redis-server --port"],
        capture_output=True,
        text=True,
    ).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln and workdir_prefix in ln]


def test_demo_runs_to_the_diagnosis(tmp_path: Path) -> None:
    report = tmp_path / "demo.png"
    res = subprocess.run(
        [sys.executable, "-m", "argus", "demo", "--no-tui", "--seconds", "25", "-o", str(report)],
        capture_output=True,
        text=True,
        env=argus_env(),
        cwd=str(REPO_ROOT),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "ALERT straggler ranks [3]" in out, out
    assert "=== diagnosis" in out and "straggler" in out.split("=== diagnosis")[1]
    assert "rank 3" in out.split("=== diagnosis")[1]
    assert report.exists() and report.read_bytes()[:4] == b"\x89PNG"
    assert "Traceback" not in res.stderr


def test_demo_cleans_up_on_ctrl_c(tmp_path: Path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "argus", "demo", "--no-tui", "--seconds", "60", "-o", str(tmp_path / "r.png")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=argus_env(),
        cwd=str(REPO_ROOT),
        preexec_fn=sigint_as_at_a_terminal,
    )
    assert p.stdout is not None
    workdir = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "logs and ground truth in" in line:
            workdir = line.rsplit(" ", 1)[-1].strip()
        if "aggregator running" in line:
            break
    assert workdir
    time.sleep(3)
    run_id = Path(workdir, "job", "config.json").read_text().split('"run_id": "')[1].split('"')[0]
    started = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and f"ARGUS_SIM_RUN={run_id}".encode() in open(f"/proc/{d}/environ", "rb").read():
                started.append(int(d))
        except OSError:
            continue
    assert len(started) >= 8  # the ranks (and the tools the demo started inherit nothing of it)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 130
    time.sleep(1)
    alive = [
        pid
        for pid in started
        if os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read()
    ]
    assert not alive
    procs = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert workdir not in procs  # the private redis-server ran with --dir WORKDIR
    assert not [f for f in os.listdir("/dev/shm") if run_id in f]
