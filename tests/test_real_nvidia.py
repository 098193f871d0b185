"""`argus probe` on real NVIDIA libraries, no GPU needed.

The libraries come from NVIDIA's pip wheels (tests/nvidia_wheels.py, cached): libcudart.so.12 from
nvidia-cuda-runtime-cu12 (3.5 MB, every run) and libnccl.so.2 from nvidia-nccl-cu13 (305 MB,
`slow` tier); NVIDIA's driver library libcuda.so.1 from Debian's non-free `libcuda1` (3 MB, every
run). tests/targets/nvidia_calls.py loads one with ctypes, waits at a gate until the probe
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
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests import nvidia_wheels
from tests.helpers import REPO_ROOT, argus_env

TARGET = REPO_ROOT / "tests" / "targets" / "nvidia_calls.py"
CUDA_ERROR_INSUFFICIENT_DRIVER = 35


class Proc:
    """A child whose stdout and stderr lines are collected by threads (no pipe ever fills)."""

    def __init__(self, args: List[str], env: Optional[dict] = None) -> None:
        self.args = args
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**argus_env(), **(env or {})},
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


def trace_calls(kind: str, library: Path, tmp_path: Path, *flags: str, env: Optional[dict] = None) -> Traced:
    """Start the target, attach `argus probe` once the library is mapped, open the gate once the
    probe is tracing, and collect the probe's JSON records after both exited."""
    gate = tmp_path / "gate"
    target = Proc([sys.executable, str(TARGET), kind, str(library), str(gate)], env)
    probe: Optional[Proc] = None
    try:
        target.wait_for("loaded", "stdout", timeout=60)
        probe = Proc(
            [sys.executable, "-m", "argus", "probe", "-p", str(target.p.pid), "--json", "-i", "0.2s", *flags]
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


def _libcuda() -> Path:
    path, why = nvidia_wheels.fetch_libcuda()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(autouse=True)
def _no_device_nodes_left() -> Iterator[None]:
    """The real libcuda's cuInit creates /dev/nvidiactl as root: never leave one behind."""
    with nvidia_wheels.no_new_device_nodes():
        yield


def test_real_libcuda_every_probe_lands_behind_its_dispatch_stub() -> None:
    """NVIDIA's exported cu* functions are stubs that jump through a relocated slot; the probes go
    to the implementations, whose first instruction the kernel emulates."""
    lib = _libcuda()
    res = subprocess.run(
        [sys.executable, "-m", "argus.probes", str(lib)],
        capture_output=True,
        text=True,
        env=argus_env(),
        timeout=60,
    )
    print(res.stdout)  # the table: symbol, stub slot, address probed, first instruction (pytest -s)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines()[1:-1]}
    from argus.probes import libcuda

    assert set(rows) == {s.symbol for s in libcuda.SPECS}, res.stdout  # every probed call, every variant
    for sym, row in rows.items():
        slot, insn, cost = row[1], row[3], row[-1]
        assert slot.startswith("0x"), f"{sym} was not seen as a dispatch stub: {row}"
        assert cost == "emulated" and insn == "push", row
    from argus.probes.elf import Elf

    elf = Elf(lib)
    assert int(rows["cuLaunchKernel"][2], 16) != elf.symbols["cuLaunchKernel"].vaddr  # not the stub itself
    assert len({int(r[2], 16) for r in rows.values()}) == len(rows)  # no two calls share an implementation
    assert res.stdout.splitlines()[-1].endswith(f"{len(rows)} behind a dispatch stub, 0 single-stepped")


@pytest.mark.bpf
def test_real_libcuda_launches_both_ways_in_counted_once(tmp_path: Path) -> None:
    """A process loads NVIDIA's libcuda.so.1 and launches through the exported symbols and through
    cuGetProcAddress pointers (libcudart's way), per-thread-stream variants included: every launch
    is counted exactly once, under its own CUfunction, and the driver's no-GPU codes are seen."""
    t = trace_calls("cuda", _libcuda(), tmp_path, "--launch-latency", "--launch-steps", "all")
    err = t.probe_stderr
    stub_lines = [ln for ln in err.splitlines() if "libcuda" in ln and "dispatch stub" in ln]
    assert stub_lines and stub_lines[0].endswith("(0 single-stepped)"), err
    assert not any("single-step" in ln and "libcuda" in ln and "warning" in ln for ln in err.splitlines()), (
        err
    )
    assert not any("dispatch slot" in ln for ln in err.splitlines()), err  # slots hold what relocations say

    from tests.targets import nvidia_calls

    funcs = t.values["functions"]
    want = {f"fn@{funcs[label]:#x}": n for label, n in nvidia_calls.LAUNCHES.items()}
    want["fn@0x2001"] = nvidia_calls.GRAPH_LAUNCHES
    launches = t.section("cuda", "launches")
    assert launches["by_kernel"] == want, launches
    assert launches["total"] == sum(want.values())

    want_calls, want_errors = t.expected()
    assert want_calls["cuLaunchKernel"] == sum(nvidia_calls.LAUNCHES.values())
    got_errors = t.section("cuda", "errors")
    if t.values["driver_version"] and dict(t.calls)["cuInit"] == 100:  # no GPU here (FACTS.md)
        assert got_errors["cuInit"] == {"100": 1}
        assert got_errors["cuStreamSynchronize"] == {"3": 2}  # the _ptsz variant counted as the call
    assert got_errors == want_errors, (got_errors, want_errors)
    # this build hands out its exported stubs from cuGetProcAddress (FACTS.md): both ways pass the slot
    assert t.values["cuGetProcAddress proc-address"][0] == 0


@pytest.mark.bpf
@pytest.mark.parametrize("through", [1, 0], ids=["interposer", "replacement"])
def test_real_libcuda_a_replaced_dispatch_slot_is_probed_where_it_points(
    tmp_path: Path, through: int
) -> None:
    """A tool replaced cuLaunchKernel's slot before the probe came (tests/targets/cuda_interposer.c).
    The probe reads the live slot and probes what the process really calls: each launch counted
    once, whether the tool calls on into the driver (an interposer: not counted at both) or answers
    itself (a replacement: the driver's implementation never runs, so probing it would count 0)."""
    lib = _libcuda()
    so = tmp_path / "interposer.so"
    src = REPO_ROOT / "tests" / "targets" / "cuda_interposer.c"
    subprocess.run(
        ["cc", "-O0", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-o", str(so), str(src)], check=True
    )
    t = trace_calls(
        "cuda-interposed",
        lib,
        tmp_path,
        "--launch-steps",
        "all",
        env={"ARGUS_TEST_INTERPOSER": str(so), "ARGUS_TEST_INTERPOSE_THROUGH": str(through)},
    )
    said = [ln for ln in t.probe_stderr.splitlines() if "dispatch slot" in ln]
    assert len(said) == 1 and "cuLaunchKernel:" in said[0] and "interposer.so+0x" in said[0], t.probe_stderr

    from tests.targets import nvidia_calls

    funcs = t.values["functions"]
    want = {f"fn@{funcs[label]:#x}": n for label, n in nvidia_calls.LAUNCHES.items()}
    want["fn@0x2001"] = nvidia_calls.GRAPH_LAUNCHES
    assert t.section("cuda", "launches")["by_kernel"] == want
    # the exported stub and the cuGetProcAddress pointer both went through the tool's function
    assert (
        t.values["interposed_calls"]
        == nvidia_calls.LAUNCHES["exported"] + nvidia_calls.LAUNCHES["proc-address"]
    )
