"""An installed wheel traces: `pip install` of the built wheel into a fresh venv made from the system
interpreter (as the README says), then `argus doctor`, `argus probe` and `argus demo` run from a
directory outside the checkout, with no PYTHONPATH: the BPF sources and the simulator's C sources
come from the package, not from the repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.bpf, pytest.mark.redis, pytest.mark.slow]


def _clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; its dependencies are this venv's (no network)."""
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "wheels"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
         str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300, cwd=str(tmp),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = wheels.glob("argus_tracer-*.whl")
    venv = tmp / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # the dependencies (click, rich, redis, ...) from this venv, appended after the new venv's own
    # site-packages; this venv's editable argus is not (its finder is a .pth, not processed here)
    Path(site, "argus-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    res = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return venv


def _run(venv: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "argus"), *args], capture_output=True, text=True, timeout=timeout, cwd=str(cwd),
        env=_clean_env(),
    )  # fmt: skip


def _ranks(job: subprocess.Popen) -> List[int]:
    """The rank processes `argus sim run` started (not another job's)."""
    import psutil

    kids = psutil.Process(job.pid).children(recursive=True)
    return [k.pid for k in kids if "argus.sim.trainer" in " ".join(k.cmdline())]


def test_the_wheel_holds_the_bpf_sources_and_its_argus_is_the_one_run(
    installed: Path, tmp_path: Path
) -> None:
    py = installed / "bin" / "python"
    res = subprocess.run(
        [str(py), "-c", "import argus, argus.agent.bpfprog as b; print(argus.__file__); print(b.BPF_DIR)"],
        capture_output=True, text=True, cwd=str(tmp_path), env=_clean_env(), check=True,
    )  # fmt: skip
    where, bpf = res.stdout.split()
    assert where.startswith(str(installed)) and bpf.startswith(str(installed)), res.stdout
    assert {"argus.h", "records.h", "cuda.bpf.c", "nccl.bpf.c", "python.bpf.c"} <= {
        p.name for p in Path(bpf).iterdir()
    }
    helped = _run(installed, tmp_path, "--help")
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("probe", "record", "demo", "doctor"))


def test_installed_doctor_probe_and_demo_run_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    doc = _run(installed, tmp_path, "doctor")
    assert doc.returncode == 0 and "Traceback" not in doc.stderr, doc.stdout + doc.stderr
    job = subprocess.Popen(
        [str(installed / "bin" / "argus"), "sim", "run", "--ranks", "2", "--steps", "400",
         "--run-dir", str(tmp_path / "sim")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=_clean_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_ranks(job)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # past the libraries' load
        args = [a for p in _ranks(job) for a in ("--pid", str(p))]
        probe = _run(installed, tmp_path, "probe", *args, "-d", "4s", "--json", timeout=120)
        assert probe.returncode == 0, probe.stderr[-2000:]
        steps = [json.loads(x) for x in probe.stdout.splitlines() if x.startswith("{")]
        assert {d["rank"] for d in steps if d.get("step") is not None} == {0, 1}, probe.stderr[-2000:]
    finally:
        job.terminate()
        job.wait(timeout=30)
    demo = _run(installed, tmp_path, "demo", "--no-tui", "--ranks", "4", "--seconds", "25", timeout=240)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "ALERT straggler ranks [3]" in demo.stdout and "Traceback" not in demo.stderr, demo.stdout[-2000:]
