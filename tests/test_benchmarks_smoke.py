"""Smoke runs of the benchmarks (`python -m benchmarks NAME --quick`): each runs and prints its table.

The measurements themselves are never part of the test suite (`make bench`, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.slow]


def run(args, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(args, cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=timeout)


def test_benchmarks_list() -> None:
    r = run([sys.executable, "-m", "benchmarks", "list"], 30)
    assert r.returncode == 0, r.stderr
    for name in ("sim_overhead", "torch_overhead", "probe_overhead", "footprint", "summary_size"):
        assert name in r.stdout


@pytest.mark.bpf
@pytest.mark.timeout(960)
def test_quick_benchmarks_print_their_tables() -> None:
    names = ["probe_overhead", "sim_overhead", "footprint"]
    try:
        import torch  # noqa: F401

        names.append("torch_overhead")
    except ImportError:
        pass
    # 225 s alone on this 2-core VM; in the full suite, after the e2e tests, it went past 420 s twice
    # (probes of earlier agents are still being removed, serially, while these attach)
    r = run([sys.executable, "-m", "benchmarks", "--quick", *names], 900)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    for name in names:
        assert f"## {name}:" in out
        section = out.split(f"## {name}:", 1)[1].split(f"[{name}: exit", 1)[0]
        assert "\n|---" in section, f"{name} printed no table:\n{section[-2000:]}"
    assert f"all {len(names)} benchmark(s) ran" in out


@pytest.mark.bpf
def test_gpu_check_skips_gpu_parts_without_a_gpu(tmp_path: Path) -> None:
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip():
        pytest.skip("a GPU is present: gpu_check.sh would run its GPU parts")
    r = run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)], 300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "SKIP: GPU training loop" in r.stdout
    assert "footprint --quick exit: 0" in r.stdout
    assert (tmp_path / "gpu_check.log").exists()
