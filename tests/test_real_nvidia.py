"""`argus probe` on real NVIDIA libraries, no GPU needed.

The libraries come from NVIDIA's pip wheels (tests/nvidia_wheels.py, cached): libcudart.so.12 from
nvidia-cuda-runtime-cu12 (3.5 MB, every run) and libnccl.so.2 from nvidia-nccl-cu13 (305 MB,
`slow` tier). tests/targets/nvidia_calls.py loads one with ctypes, waits at a gate until the probe
is tracing, then makes real calls; without a driver they fail with documented codes (FACTS.md,
"Real NVIDIA libraries without a GPU"), and the probe must report each call and each code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from tests import nvidia_wheels
from tests.helpers import REPO_ROOT, argus_env

TARGET = REPO_ROOT / "tests" / "targets" / "nvidia_calls.py"
CUDA_ERROR_INSUFFICIENT_DRIVER = 35


class Proc:
    """A child whose stdout and stderr lines are collected by threads (no pipe ever fills)."""

    def __init__(self, args: List[str]) -> None:
        self.args = args
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=argus_env(),
            cwd=str(REPO_ROOT),
        )
        self.out: List[str] = []
        self.err: List[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.p.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.p.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream: object, into: List[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, where: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in (self.stdout if where == "stdout" else self.stderr):
                return
            if self.p.poll() is not None:
                time.sleep(0.2)  # let the readers catch up
                if text in (self.stdout if where == "stdout" else self.stderr):
                    return
                raise AssertionError(f"{self.describe()} exited ({self.p.returncode}) before '{text}'")
            time.sleep(0.02)
        raise AssertionError(f"no '{text}' on {where} of {self.describe()} within {timeout:.0f} s")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.describe()} still running after {timeout:.0f} s") from None
        for t in self._threads:
            t.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=30)

    def describe(self) -> str:
        cmd = " ".join(self.args[1:4])
        return f"`{cmd} ...`\nstdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"


class Traced:
    def __init__(self, printed: dict, records: List[dict], probe_stderr: str, pid: int) -> None:
        self.calls: List[List] = printed["calls"]  # [[name, result], ...] in call order
        self.values: dict = printed["values"]
        self.records = records
        self.probe_stderr = probe_stderr
        self.pid = pid

    @property
    def tail(self) -> dict:
        tails = [r for r in self.records if r.get("step_source") == "tail"]
        assert len(tails) == 1, f"expected one tail record, got {self.records}"
        return tails[0]

    def section(self, name: str, key: str) -> Dict[str, Any]:
        """`name`.`key` of every record of the target, merged (counts summed)."""
        merged: Dict[str, Any] = {}
        for r in self.records:
            for k, v in r[name][key].items():
                if isinstance(v, dict):
                    per = merged.setdefault(k, {})
                    for res, c in v.items():
                        per[res] = per.get(res, 0) + c
                else:
                    merged[k] = merged.get(k, 0) + v
        return merged

    def expected(self) -> tuple:
        """What the probe must report: {call: count}, {call: {str(result): count}} for non-zero."""
        calls: Counter = Counter(name for name, _ in self.calls)
        errors: Dict[str, Dict[str, int]] = {}
        for name, rc in self.calls:
            if rc != 0:
                per = errors.setdefault(name, {})
                per[str(rc)] = per.get(str(rc), 0) + 1
        return dict(calls), errors


def trace_calls(kind: str, library: Path, tmp_path: Path) -> Traced:
    """Start the target, attach `argus probe` once the library is mapped, open the gate once the
    probe is tracing, and collect the probe's JSON records after both exited."""
    gate = tmp_path / "gate"
    target = Proc([sys.executable, str(TARGET), kind, str(library), str(gate)])
    probe: Optional[Proc] = None
    try:
        target.wait_for("loaded", "stdout", timeout=60)
        probe = Proc(
            [sys.executable, "-m", "argus", "probe", "-p", str(target.p.pid), "--json", "-i", "0.2s"]
        )
        probe.wait_for("Tracing ", "stderr", timeout=120)
        gate.touch()
        assert target.wait(timeout=120) == 0, target.describe()
        assert probe.wait(timeout=120) == 0, probe.describe()  # exits by itself: every target exited
    finally:
        target.kill()
        if probe is not None:
            probe.kill()
    printed = json.loads(target.out[-1])
    records = [json.loads(line) for line in probe.out if line.strip()]
    assert records, f"the probe printed no record\n{probe.describe()}"
    assert {r["pid"] for r in records} == {target.p.pid}
    return Traced(printed, records, probe.stderr, target.p.pid)


def _library(wheel: nvidia_wheels.Wheel) -> Path:
    path, why = nvidia_wheels.fetch(wheel)
    if path is None:
        pytest.skip(why)
    return path


@pytest.mark.bpf
def test_real_libcudart_calls_and_error_codes(tmp_path: Path) -> None:
    t = trace_calls("cudart", _library(nvidia_wheels.CUDART), tmp_path)
    results = dict(t.calls)  # the last result of each call
    assert results["cudaRuntimeGetVersion"] == 0 and t.values["runtime_version"] >= 12000
    if t.values["driver_version"] == 0:  # no driver on this host (FACTS.md)
        assert results["cudaGetDeviceCount"] == CUDA_ERROR_INSUFFICIENT_DRIVER
        assert results["cudaMalloc"] == CUDA_ERROR_INSUFFICIENT_DRIVER
    want_calls, want_errors = t.expected()
    assert want_errors, "the target made no failing call: nothing to check error codes with"

    tail = t.tail
    assert tail["step"] is None and tail["pid"] == t.pid
    assert t.section("cudart", "calls") == want_calls, t.records
    assert t.section("cudart", "errors") == want_errors, t.records
    for name, rc in t.calls:
        if rc == 0:  # successful calls are counted, never reported as errors
            assert name not in want_errors and t.section("cudart", "calls")[name] >= 1
    # runtime calls stay out of the driver's and NCCL's sections
    assert not any(k.startswith("cuda") for k in t.section("cuda", "errors"))
    assert not t.section("nccl", "calls") and not t.section("nccl", "errors")
    assert "cudart" in t.probe_stderr  # the channel was loaded
    # every probed libcudart function starts with a push: no single-stepped probe there
    assert not any("libcudart" in ln and "single-step" in ln for ln in t.probe_stderr.splitlines())


@pytest.mark.bpf
@pytest.mark.slow
def test_real_libnccl_version_uid_and_failing_init(tmp_path: Path) -> None:
    t = trace_calls("nccl", _library(nvidia_wheels.NCCL), tmp_path)
    results = dict(t.calls)
    assert results["ncclGetVersion"] == 0 and t.values["version"] >= 22000
    assert results["ncclGetUniqueId"] == 0
    init_rc = results["ncclCommInitRank"]

    calls = t.section("nccl", "calls")
    errors = t.section("nccl", "errors")
    assert calls.get("ncclGetVersion") == 1 and calls.get("ncclGetUniqueId") == 1, t.records
    assert "ncclGetVersion" not in errors and "ncclGetUniqueId" not in errors
    if init_rc != 0:  # no GPU: FACTS.md says 1 (ncclUnhandledCudaError)
        assert errors == {"ncclCommInitRank": {str(init_rc): 1}}, t.records
    inits = [i for r in t.records for i in r["nccl"]["inits"]]
    assert inits == [
        {
            "call": "ncclCommInitRank",
            "result": init_rc,
            "nranks": 1,
            "rank": 0,
            "comm": inits[0]["comm"] if init_rc == 0 else None,
        }
    ], t.records
    assert t.tail["step"] is None
    # the real ncclGetVersion starts with `test %rdi,%rdi` (not push): the agent says so at attach
    assert any("ncclGetVersion" in line and "single-step" in line for line in t.probe_stderr.splitlines()), (
        t.probe_stderr
    )
