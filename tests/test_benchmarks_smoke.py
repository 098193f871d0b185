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


# Each benchmark's smoke run, with the arguments that keep it short: the tables' code paths run,
# the numbers mean nothing. `footprint --quick` runs in test_gpu_check_skips_gpu_parts_without_a_gpu.
# sim_overhead takes two of its conditions: the others differ only in the probe's flags.
SMOKE = {
    "probe_overhead": ["--quick", "--per-hit-only"],
    "sim_overhead": ["--quick", "--conditions", "off,all"],
    "torch_overhead": ["--quick"],
    "uprobe_session": ["--quick"],
}


@pytest.mark.bpf
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_quick_benchmark_prints_its_table(name: str) -> None:
    if name == "torch_overhead":
        pytest.importorskip("torch", reason="torch_overhead needs PyTorch (pip install -e '.[bench]')")
    r = run([sys.executable, "-m", f"benchmarks.{name}", *SMOKE[name]], 600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "\n|---" in r.stdout, f"{name} printed no table:\n{r.stdout[-2000:]}"


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
